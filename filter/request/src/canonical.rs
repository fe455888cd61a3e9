//! The canonical prefix stream: the prompt-bearing parts of a request in the
//! order a chat template puts them (tools, system, then each message or input
//! item), so a conversation that grows by appending keeps every earlier byte.
//!
//! Each part is the client's own JSON, minified, with `cache_control` removed
//! at any depth: Claude Code and OpenCode move that marker to the newest
//! messages on every call, and it never reaches the prompt. Fields outside
//! the prompt (`stream`, `temperature`, `max_tokens`, `metadata`, ...) are
//! never read into the stream.
//!
//! The stream follows what the engine tokenizes, so two more things stay
//! out, both of which differ between sessions that share a whole prompt:
//! the client-made `id` of each Responses input item (see [`Shape`]), and
//! Claude Code's billing block at the head of `system` (`crate::preamble`).
//! A Responses `additional_tools` input item (Codex's tools, when its model
//! takes them there) is the stream's tools section.

use std::borrow::Cow;
use std::ops::Range;

use kvmesh_vocab::{PromptSection, SectionKind};
use serde::de::DeserializeOwned;
use serde_json::Value;

use xxhash_rust::xxh3::xxh3_64;

use crate::retention::marker_horizon_s;
use crate::scan::{self, ScanError};

/// The inference APIs the filter understands. Other paths pass through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Api {
    /// OpenAI `/v1/chat/completions`.
    ChatCompletions,
    /// OpenAI `/v1/completions`.
    Completions,
    /// OpenAI `/v1/responses`.
    Responses,
    /// Anthropic `/v1/messages`.
    Messages,
}

impl Api {
    /// Every API, in a fixed order (for per-API metrics).
    pub const ALL: [Self; 4] = [
        Self::ChatCompletions,
        Self::Completions,
        Self::Responses,
        Self::Messages,
    ];

    /// The API served at `path` (query string ignored), if any.
    pub fn from_path(path: &str) -> Option<Self> {
        let path = path.split_once('?').map_or(path, |(p, _)| p);
        match path.trim_end_matches('/') {
            "/v1/chat/completions" | "/chat/completions" => Some(Self::ChatCompletions),
            "/v1/completions" | "/completions" => Some(Self::Completions),
            "/v1/responses" | "/responses" => Some(Self::Responses),
            "/v1/messages" | "/messages" => Some(Self::Messages),
            _ => None,
        }
    }

    /// Stable lowercase name, for logs and metrics.
    pub fn name(self) -> &'static str {
        match self {
            Self::ChatCompletions => "chat_completions",
            Self::Completions => "completions",
            Self::Responses => "responses",
            Self::Messages => "messages",
        }
    }
}

/// A body that is not the shape its API requires.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CanonicalError {
    #[error("body is not a JSON object: {0}")]
    Malformed(#[from] ScanError),
    #[error("`{0}` is missing or has the wrong type")]
    MissingField(&'static str),
}

/// Keys dropped from every part: they steer provider caching, not the prompt.
const DROPPED_KEYS: &[&str] = &["cache_control"];

// Separators that never appear in minified JSON, so parts cannot run together.
const SECTION: u8 = 0x1e;
const FIELD: u8 = 0x1f;

/// The top-level members of a request body, found without parsing values.
#[derive(Debug)]
pub struct Envelope<'a> {
    body: &'a [u8],
    members: Vec<(Range<usize>, Range<usize>)>,
    /// The body was cut by the filter's cap: the last member may be partial.
    truncated: bool,
}

impl<'a> Envelope<'a> {
    /// Splits `body` into its members. A `truncated` body (cut at the cap)
    /// keeps what it could read; a complete one must be well formed.
    pub fn parse(body: &'a [u8], truncated: bool) -> Result<Self, ScanError> {
        let mut members = Vec::new();
        let result = scan::for_each_member(body, 0..body.len(), |key, value| members.push((key, value)));
        match result {
            Ok(()) => {}
            Err(ScanError::Eof) if truncated && !members.is_empty() => {}
            Err(err) => return Err(err),
        }
        Ok(Self {
            body,
            members,
            truncated,
        })
    }

    /// The members a [`crate::scan::Tracker`] found in the whole `body`.
    pub(crate) fn from_members(body: &'a [u8], members: Vec<(Range<usize>, Range<usize>)>, truncated: bool) -> Self {
        Self {
            body,
            members,
            truncated,
        }
    }

    /// The raw value of member `key` (the last one, as JSON parsers do).
    pub fn raw(&self, key: &str) -> Option<&'a [u8]> {
        let body = self.body;
        self.span(key).map(|span| &body[span])
    }

    fn span(&self, key: &str) -> Option<Range<usize>> {
        self.members
            .iter()
            .rev()
            .find(|(k, _)| &self.body[k.clone()] == key.as_bytes())
            .map(|(_, value)| value.clone())
    }

    /// The value spans of every top-level member whose key decodes to
    /// `key`, in body order. JSON parsers keep the last of duplicate keys and
    /// decode escapes in keys (`"\u0070riority"` is `priority`), so a
    /// rewrite of one member must find every spelling of it.
    pub(crate) fn spans_of(&self, key: &str) -> Vec<Range<usize>> {
        self.members
            .iter()
            .filter(|(k, _)| {
                let raw = &self.body[k.clone()];
                raw == key.as_bytes()
                    || (raw.contains(&b'\\')
                        && self.body.get(k.start - 1..k.end + 1).and_then(json_string).as_deref() == Some(key))
            })
            .map(|(_, value)| value.clone())
            .collect()
    }

    /// The body the members are spans of.
    pub(crate) fn body(&self) -> &'a [u8] {
        self.body
    }

    /// The object has no members at all (`{}`).
    pub(crate) fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Member `key` decoded as `T`; `None` when absent, `Err` when mistyped.
    pub fn typed<T: DeserializeOwned>(&self, key: &str) -> Result<Option<T>, serde_json::Error> {
        match self.raw(key) {
            None | Some(b"null") => Ok(None),
            Some(raw) => serde_json::from_slice(raw).map(Some),
        }
    }

    /// A string member; `None` when absent or not a string.
    pub fn string(&self, key: &str) -> Option<Cow<'a, str>> {
        json_string(self.raw(key)?)
    }

    /// A member parsed as a JSON tree (for small members such as `metadata`).
    pub fn value(&self, key: &str) -> Option<Value> {
        serde_json::from_slice(self.raw(key)?).ok()
    }

    pub fn truncated(&self) -> bool {
        self.truncated
    }
}

/// A raw JSON value as a string; `None` when it is not a string.
pub(crate) fn json_string(raw: &[u8]) -> Option<Cow<'_, str>> {
    // Plain strings (no escapes) borrow; the rest decode.
    if raw.len() >= 2 && raw[0] == b'"' && !raw[1..raw.len() - 1].contains(&b'\\') {
        return std::str::from_utf8(&raw[1..raw.len() - 1]).ok().map(Cow::Borrowed);
    }
    serde_json::from_slice::<String>(raw).ok().map(Cow::Owned)
}

/// How a part's value is written: minified as the client sent it, or without
/// what the engine never tokenizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shape {
    Whole,
    /// A Responses input item without its top-level `id`. Codex makes one
    /// for every item (`msg_…`, `at_…`, `fco_…`), new in every session, so
    /// with them two sessions of one prompt share 50 bytes instead of their
    /// system prompt and tools. The engine never sees them: vLLM turns items
    /// into chat messages in `_construct_message_from_response_item`
    /// (`vllm/entrypoints/openai/responses/utils.py`), which links a tool
    /// call to its output by `call_id` and reads `id` only for log lines,
    /// and `_parse_chat_message_content` (`vllm/entrypoints/chat_utils.py`)
    /// gives the template a message of `role`, `content`, tool calls and
    /// their ids, `name`, a developer message's `tools`, never an `id`.
    /// `call_id` stays: it is tokenized, and it pairs calls with outputs.
    WithoutId,
    /// Anthropic `system` without Claude Code's billing block, when it has
    /// one (`crate::preamble`).
    System,
}

/// Appends one part (separator, name, the value written as `shape` says) to
/// `out`, which stops at `limit` bytes. Returns the longest retention
/// horizon its `cache_control` markers declare, up to where it stopped: the
/// markers leave the stream, but what they say is kept.
pub(crate) fn write_part(
    body: &[u8],
    name: &[u8],
    shape: Shape,
    value: Range<usize>,
    out: &mut Vec<u8>,
    limit: usize,
) -> Result<Option<u32>, ScanError> {
    out.push(SECTION);
    out.extend_from_slice(name);
    out.push(FIELD);
    let mut horizon = None;
    let mut marker = |marker: Range<usize>| {
        horizon = horizon.max(marker_horizon_s(body.get(marker).unwrap_or_default()));
    };
    match shape {
        Shape::Whole => scan::write_minified(body, value, DROPPED_KEYS, out, limit, &mut marker)?,
        Shape::WithoutId => write_without_id(body, value, out, limit, &mut marker)?,
        Shape::System => write_system(body, value, out, limit, &mut marker)?,
    }
    Ok(horizon)
}

/// The object at `value` minified as [`scan::write_minified`] writes it,
/// but for its top-level `id` members. Not an object: written whole.
fn write_without_id(
    body: &[u8],
    value: Range<usize>,
    out: &mut Vec<u8>,
    limit: usize,
    marker: &mut impl FnMut(Range<usize>),
) -> Result<(), ScanError> {
    if body.get(value.start) != Some(&b'{') {
        return scan::write_minified(body, value, DROPPED_KEYS, out, limit, marker);
    }
    out.push(b'{');
    let mut first = true;
    let mut failed = None;
    let scanned = scan::for_each_member(body, value, |key, member| {
        // Past the limit nothing is written, and no marker read (as the
        // minifier does); the scan only goes on to its end.
        if failed.is_some() || out.len() >= limit {
            return;
        }
        let raw_key = body.get(key.clone()).unwrap_or_default();
        if raw_key == b"id" {
            return;
        }
        if DROPPED_KEYS.iter().any(|k| k.as_bytes() == raw_key) {
            marker(member);
            return;
        }
        if !first {
            out.push(b',');
        }
        first = false;
        // The key with its quotes, as sent.
        out.extend_from_slice(body.get(key.start.saturating_sub(1)..key.end + 1).unwrap_or_default());
        out.push(b':');
        if let Err(err) = scan::write_minified(body, member, DROPPED_KEYS, out, limit, marker) {
            failed = Some(err);
        }
    });
    finish_container(out, limit, failed, scanned, b'}')
}

/// The Anthropic `system` at `value` minified, without its billing block
/// when it has one: `[` and the elements after the first, as
/// [`scan::write_minified`] writes them.
fn write_system(
    body: &[u8],
    value: Range<usize>,
    out: &mut Vec<u8>,
    limit: usize,
    marker: &mut impl FnMut(Range<usize>),
) -> Result<(), ScanError> {
    if crate::preamble::billing_block(body, value.clone()).is_none() {
        return scan::write_minified(body, value, DROPPED_KEYS, out, limit, marker);
    }
    out.push(b'[');
    let mut index = 0usize;
    let mut failed = None;
    let scanned = scan::for_each_element(body, value, |element| {
        index += 1;
        if index == 1 {
            return true;
        }
        if index > 2 {
            out.push(b',');
        }
        if let Err(err) = scan::write_minified(body, element, DROPPED_KEYS, out, limit, marker) {
            failed = Some(err);
            return false;
        }
        out.len() < limit
    });
    finish_container(out, limit, failed, scanned, b']')
}

/// Ends a container written member by member: cut at `limit` once reached
/// (what follows is not hashed, so not checked: the minifier's rule), else
/// the first error, else the closing bracket.
fn finish_container(
    out: &mut Vec<u8>,
    limit: usize,
    failed: Option<ScanError>,
    scanned: Result<(), ScanError>,
    close: u8,
) -> Result<(), ScanError> {
    if out.len() >= limit {
        out.truncate(limit);
        return Ok(());
    }
    if let Some(err) = failed {
        return Err(err);
    }
    scanned?;
    out.push(close);
    Ok(())
}

/// One part written ahead into a [`PartCache`].
#[derive(Debug, Clone)]
pub(crate) struct CachedPart {
    pub(crate) name: &'static [u8],
    pub(crate) kind: SectionKind,
    pub(crate) shape: Shape,
    pub(crate) index: u32,
    /// The value's span in the body.
    pub(crate) value: Range<usize>,
    /// The part's bytes in the cache.
    pub(crate) bytes: Range<usize>,
    pub(crate) digest: u32,
    /// Not cut by the limit: the bytes are the part's wherever it lands.
    pub(crate) whole: bool,
    /// The retention horizon its markers declare (see [`write_part`]).
    pub(crate) horizon_s: Option<u32>,
}

/// Parts of the canonical stream written before the body is complete, in
/// the order their values arrived. When that order was the canonical one,
/// `bytes` is the stream's first bytes, and the builder keeps them where
/// they are; a part found elsewhere is copied; a part not there at all is
/// written as usual. Whatever was cached, the stream is the one
/// [`canonical_stream`] builds from the whole body.
#[derive(Debug, Default)]
pub(crate) struct PartCache {
    pub(crate) bytes: Vec<u8>,
    pub(crate) parts: Vec<CachedPart>,
    /// The element spans of `messages` / `input` arrays, by the array's
    /// span, each as `for_each_element` would find them.
    pub(crate) arrays: Vec<(Range<usize>, Vec<Range<usize>>)>,
}

impl PartCache {
    /// Writes a part at the end of the cache, as [`canonical_stream`]
    /// would at this offset; `false` when it does not scan (nothing kept).
    pub(crate) fn write(
        &mut self,
        body: &[u8],
        (name, kind, index): (&'static [u8], SectionKind, u32),
        shape: Shape,
        value: Range<usize>,
        limit: usize,
    ) -> bool {
        let mark = self.bytes.len();
        let Ok(horizon_s) = write_part(body, name, shape, value.clone(), &mut self.bytes, limit) else {
            self.bytes.truncate(mark);
            return false;
        };
        self.parts.push(CachedPart {
            horizon_s,
            name,
            kind,
            shape,
            index,
            value,
            digest: xxh3_64(&self.bytes[mark..]) as u32,
            whole: self.bytes.len() < limit,
            bytes: mark..self.bytes.len(),
        });
        true
    }
}

/// The builder's view of a [`PartCache`].
#[derive(Debug)]
struct Reuse {
    parts: Vec<CachedPart>,
    arrays: Vec<(Range<usize>, Vec<Range<usize>>)>,
    /// Parts `..next` are in `out` where the builder wants them.
    next: usize,
    /// While `Some`, `out` is the cache's bytes and the stream so far is
    /// its first `kept` bytes; after the first part that is not the next
    /// cached one, `rest` holds the cache's bytes from `rest_at` on.
    kept: Option<usize>,
    rest: Vec<u8>,
    rest_at: usize,
    /// Cached parts by value span, built once the in-place run ends.
    by_value: std::collections::HashMap<(usize, usize), usize>,
}

/// The canonical stream of one request.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Canonical {
    pub stream: Vec<u8>,
    /// The parts of `stream`, in order.
    pub sections: Vec<PromptSection>,
    /// Parts were left out because the body was cut at the cap.
    pub truncated: bool,
    /// The longest retention horizon the `cache_control` markers of the
    /// parts declare, in seconds (markers past the block cap are not read).
    pub horizon_s: Option<u32>,
}

struct Builder<'e, 'a> {
    api: Api,
    envelope: &'e Envelope<'a>,
    out: Vec<u8>,
    /// Bytes past which nothing is hashed: stop building there.
    limit: usize,
    truncated: bool,
    /// A cut body lacks a member that the stream puts before what it has.
    unknown_order: bool,
    /// (kind, index, start, digest when known) of each part written.
    sections: Vec<(SectionKind, u32, usize, Option<u32>)>,
    reuse: Option<Reuse>,
    /// The longest horizon the parts written declare.
    horizon_s: Option<u32>,
}

impl Builder<'_, '_> {
    /// Length of the stream so far.
    fn len(&self) -> usize {
        match &self.reuse {
            Some(Reuse { kept: Some(kept), .. }) => *kept,
            _ => self.out.len(),
        }
    }

    /// Takes the part from the cache when it holds it: in place while the
    /// cache runs in stream order, else copied when it is whole and fits.
    fn cached(&mut self, name: &[u8], (kind, shape): (SectionKind, Shape), index: u32, value: &Range<usize>) -> bool {
        let Some(reuse) = self.reuse.as_mut() else {
            return false;
        };
        if let Some(kept) = reuse.kept {
            if let Some(part) = reuse.parts.get(reuse.next)
                && part.bytes.start == kept
                && part.name == name
                && part.kind == kind
                && part.shape == shape
                && part.index == index
                && part.value == *value
            {
                self.sections.push((kind, index, kept, Some(part.digest)));
                self.horizon_s = self.horizon_s.max(part.horizon_s);
                reuse.kept = Some(part.bytes.end);
                reuse.next += 1;
                return true;
            }
            reuse.rest = self.out.split_off(kept);
            reuse.rest_at = kept;
            reuse.kept = None;
            reuse.by_value = reuse.parts[reuse.next..]
                .iter()
                .enumerate()
                .map(|(i, part)| ((part.value.start, part.value.end), reuse.next + i))
                .collect();
        }
        let Some(part) = reuse
            .by_value
            .get(&(value.start, value.end))
            .and_then(|&i| reuse.parts.get(i))
        else {
            return false;
        };
        let fits = self.out.len() + part.bytes.len() <= self.limit;
        let bytes = (part.bytes.start.checked_sub(reuse.rest_at))
            .and_then(|start| reuse.rest.get(start..start + part.bytes.len()));
        match bytes {
            // A whole part declares the same wherever it lands: its write
            // read every marker before its last byte.
            Some(bytes) if part.whole && fits && part.name == name && part.shape == shape => {
                self.sections.push((kind, index, self.out.len(), Some(part.digest)));
                self.horizon_s = self.horizon_s.max(part.horizon_s);
                self.out.extend_from_slice(bytes);
                true
            }
            _ => false,
        }
    }

    /// Appends one part; on a cut body, a part that does not scan ends the
    /// stream (what came before it is kept).
    fn part(
        &mut self,
        name: &[u8],
        (kind, shape): (SectionKind, Shape),
        index: u32,
        value: Range<usize>,
    ) -> Result<bool, CanonicalError> {
        if self.len() >= self.limit {
            self.truncated = true;
            return Ok(false);
        }
        if self.cached(name, (kind, shape), index, &value) {
            return Ok(true);
        }
        let mark = self.out.len();
        match write_part(self.envelope.body, name, shape, value, &mut self.out, self.limit) {
            Ok(horizon_s) => {
                self.sections.push((kind, index, mark, None));
                self.horizon_s = self.horizon_s.max(horizon_s);
                Ok(true)
            }
            Err(_) if self.envelope.truncated => {
                self.out.truncate(mark);
                self.truncated = true;
                Ok(false)
            }
            Err(err) => Err(err.into()),
        }
    }

    /// A top-level member as one part, if present and not null. In a cut
    /// body an absent member may only be further on: what follows it in the
    /// stream cannot be known, so the stream stops being trustworthy.
    fn member(&mut self, key: &'static str) -> Result<bool, CanonicalError> {
        match self.envelope.span(key) {
            Some(span) if &self.envelope.body[span.clone()] != b"null" => {
                let kind = match key {
                    "tools" => SectionKind::Tools,
                    "system" | "instructions" => SectionKind::System,
                    "prompt" | "input" => SectionKind::Message,
                    _ => SectionKind::Other,
                };
                let shape = if self.api == Api::Messages && key == "system" {
                    Shape::System
                } else {
                    Shape::Whole
                };
                self.part(key.as_bytes(), (kind, shape), 0, span)
            }
            Some(_) => Ok(true),
            None if self.envelope.truncated => {
                self.unknown_order = true;
                Ok(false)
            }
            None => Ok(true),
        }
    }

    /// Each element of the array member `key` as its own part.
    fn items(&mut self, key: &'static str, required: bool) -> Result<(), CanonicalError> {
        let Some(span) = self.envelope.span(key) else {
            return if required {
                Err(CanonicalError::MissingField(key))
            } else {
                Ok(())
            };
        };
        if self.envelope.body.get(span.start) != Some(&b'[') {
            return Err(CanonicalError::MissingField(key));
        }
        // Parts are written as the elements are found, and the scan stops
        // at the limit: a body of millions of tiny messages costs no more
        // than the blocks that will be hashed.
        let body = self.envelope.body;
        let api = self.api;
        let mut failed = None;
        let mut index = 0u32;
        let mut leading = true;
        let tracked = self.reuse.as_mut().and_then(|reuse| {
            let at = reuse.arrays.iter().position(|(array, _)| *array == span)?;
            Some(reuse.arrays.swap_remove(at).1)
        });
        let mut each = |element: Range<usize>| {
            let part = item_part(api, body, element.clone(), &mut leading);
            let written = self.part(b"item", part, index, element);
            index = index.saturating_add(1);
            match written {
                Ok(more) => more,
                Err(err) => {
                    failed = Some(err);
                    false
                }
            }
        };
        // The tracker found these elements as `for_each_element` does.
        let scanned = match tracked {
            Some(elements) => {
                for element in elements {
                    if !each(element) {
                        break;
                    }
                }
                Ok(())
            }
            None => scan::for_each_element(body, span, each),
        };
        if let Some(err) = failed {
            return Err(err);
        }
        match scanned {
            Ok(()) => {}
            Err(_) if self.envelope.truncated => self.truncated = true,
            Err(err) => return Err(err.into()),
        }
        Ok(())
    }
}

/// The section and shape of one element of `messages` / `input`, given
/// whether the elements before it were all system messages (`leading`,
/// updated): those lead the conversation and are its system section.
///
/// On the Responses API, every item is written without its `id` but an
/// `item_reference`, whose `id` names the item the engine is to read; an
/// `additional_tools` item is the tools section (Codex sends its tools so
/// with models that take them in the input: docs/harnesses/codex.md), and
/// does not end the leading run.
pub(crate) fn item_part(api: Api, body: &[u8], element: Range<usize>, leading: &mut bool) -> (SectionKind, Shape) {
    if api != Api::Responses {
        // Roles are read only until the first other one, so a long
        // conversation is not scanned twice.
        *leading = *leading && is_system_message(body, element);
        let kind = if *leading {
            SectionKind::System
        } else {
            SectionKind::Message
        };
        return (kind, Shape::Whole);
    }
    // Every item is read: its shape depends on its type. The scan skips
    // strings by searching for quotes, a small cost beside the minifying.
    let (mut system, mut tools, mut reference) = (false, false, false);
    // A malformed element is no tools item; the minifier reports it.
    let _ = scan::for_each_member(body, element, |key, value| {
        let value = body.get(value).unwrap_or_default();
        match body.get(key).unwrap_or_default() {
            b"role" => system = matches!(value, b"\"system\"" | b"\"developer\""),
            b"type" => {
                tools = value == b"\"additional_tools\"";
                reference = value == b"\"item_reference\"";
            }
            _ => {}
        }
    });
    *leading = *leading && (system || tools);
    let kind = if tools {
        SectionKind::Tools
    } else if *leading {
        SectionKind::System
    } else {
        SectionKind::Message
    };
    (kind, if reference { Shape::Whole } else { Shape::WithoutId })
}

/// A message whose `role` is `system` or `developer`.
fn is_system_message(body: &[u8], element: Range<usize>) -> bool {
    let mut system = false;
    // A malformed element is not a system message; the minifier reports it.
    let _ = scan::for_each_member(body, element, |key, value| {
        if &body[key] == b"role" {
            system = matches!(&body[value], b"\"system\"" | b"\"developer\"");
        }
    });
    system
}

/// Builds the canonical stream of a request of `api`, up to `limit` bytes
/// (what the block cap lets be hashed).
pub fn canonical_stream(api: Api, envelope: &Envelope<'_>, limit: usize) -> Result<Canonical, CanonicalError> {
    canonical_stream_reusing(api, envelope, limit, None).map(|(canonical, _)| canonical)
}

/// [`canonical_stream`], taking what it can from `cache`; also says how many
/// first bytes of the cache's bytes the stream kept where they were.
pub(crate) fn canonical_stream_reusing(
    api: Api,
    envelope: &Envelope<'_>,
    limit: usize,
    cache: Option<PartCache>,
) -> Result<(Canonical, usize), CanonicalError> {
    let (out, reuse) = match cache {
        Some(cache) => (
            cache.bytes,
            Some(Reuse {
                parts: cache.parts,
                arrays: cache.arrays,
                next: 0,
                kept: Some(0),
                rest: Vec::new(),
                rest_at: 0,
                by_value: std::collections::HashMap::new(),
            }),
        ),
        None => (Vec::with_capacity(envelope.body.len().min(limit)), None),
    };
    let mut b = Builder {
        api,
        envelope,
        limit,
        out,
        truncated: false,
        unknown_order: false,
        sections: Vec::new(),
        reuse,
        horizon_s: None,
    };
    match api {
        Api::ChatCompletions => {
            if b.member("tools")? {
                b.items("messages", true)?;
            }
        }
        Api::Completions => match envelope.raw("prompt").and_then(|raw| raw.first()) {
            Some(b'"' | b'[') => {
                b.member("prompt")?;
            }
            _ if envelope.truncated() => b.truncated = true,
            _ => return Err(CanonicalError::MissingField("prompt")),
        },
        Api::Responses => {
            // A continuation's prefix lives in the engine under the previous
            // response: it starts the chain, so it never matches a fresh one.
            if b.member("tools")? && b.member("instructions")? && b.member("previous_response_id")? {
                match envelope.raw("input").and_then(|raw| raw.first()) {
                    Some(b'[') => b.items("input", false)?,
                    Some(b'"') => {
                        b.member("input")?;
                    }
                    None => {}
                    Some(_) => return Err(CanonicalError::MissingField("input")),
                }
            }
        }
        Api::Messages => {
            if b.member("tools")? && b.member("system")? {
                b.items("messages", true)?;
            }
        }
    }
    let mut kept = 0;
    if let Some(Reuse { kept: Some(len), .. }) = b.reuse {
        // Cached parts past the last one used are not the stream's.
        b.out.truncate(len);
        kept = len;
    } else if let Some(reuse) = &b.reuse {
        kept = reuse.rest_at;
    }
    if b.unknown_order {
        // Better no prefix than a wrong one: the sidecar routes on the session.
        b.out.clear();
        b.sections.clear();
        kept = 0;
    }
    let ends = b.sections.iter().skip(1).map(|s| s.2).chain([b.out.len()]);
    let sections = b
        .sections
        .iter()
        .zip(ends)
        .map(|(&(kind, index, start, digest), end)| PromptSection {
            kind,
            index,
            start: start as u64,
            // The low half of XXH3-64 is plenty to tell two versions of
            // one part apart.
            digest: digest.unwrap_or_else(|| xxh3_64(b.out.get(start..end).unwrap_or_default()) as u32),
        })
        .collect();
    Ok((
        Canonical {
            truncated: b.truncated || envelope.truncated(),
            horizon_s: b.horizon_s,
            stream: b.out,
            sections,
        },
        kept,
    ))
}
