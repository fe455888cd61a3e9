//! The canonical prefix stream: the prompt-bearing parts of a request in the
//! order a chat template puts them (tools, system, then each message or input
//! item), so a conversation that grows by appending keeps every earlier byte.
//!
//! Each part is the client's own JSON, minified, with `cache_control` removed
//! at any depth: Claude Code and OpenCode move that marker to the newest
//! messages on every call, and it never reaches the prompt. Fields outside
//! the prompt (`stream`, `temperature`, `max_tokens`, `metadata`, ...) are
//! never read into the stream.

use std::borrow::Cow;
use std::ops::Range;

use kvmesh_vocab::SectionKind;
use serde::de::DeserializeOwned;
use serde_json::Value;

use xxhash_rust::xxh3::xxh3_64;

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

    /// Member `key` decoded as `T`; `None` when absent, `Err` when mistyped.
    pub fn typed<T: DeserializeOwned>(&self, key: &str) -> Result<Option<T>, serde_json::Error> {
        match self.raw(key) {
            None | Some(b"null") => Ok(None),
            Some(raw) => serde_json::from_slice(raw).map(Some),
        }
    }

    /// A string member; `None` when absent or not a string.
    pub fn string(&self, key: &str) -> Option<Cow<'a, str>> {
        let raw = self.raw(key)?;
        // Plain strings (no escapes) borrow; the rest decode.
        if raw.len() >= 2 && raw[0] == b'"' && !raw[1..raw.len() - 1].contains(&b'\\') {
            return std::str::from_utf8(&raw[1..raw.len() - 1]).ok().map(Cow::Borrowed);
        }
        serde_json::from_slice::<String>(raw).ok().map(Cow::Owned)
    }

    /// A member parsed as a JSON tree (for small members such as `metadata`).
    pub fn value(&self, key: &str) -> Option<Value> {
        serde_json::from_slice(self.raw(key)?).ok()
    }

    pub fn truncated(&self) -> bool {
        self.truncated
    }
}

/// One part of the canonical stream: where it starts, and a digest of its
/// bytes, so that two calls of a session can tell which part changed
/// without either of them keeping any prompt text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Section {
    pub kind: SectionKind,
    /// The element's position in `messages` / `input` (0 for the others).
    pub index: u32,
    /// Byte offset of the section in the stream.
    pub start: u64,
    /// XXH3 of the section's bytes in the stream, low 32 bits.
    pub digest: u32,
}

/// The canonical stream of one request.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Canonical {
    pub stream: Vec<u8>,
    /// The parts of `stream`, in order.
    pub sections: Vec<Section>,
    /// Parts were left out because the body was cut at the cap.
    pub truncated: bool,
}

struct Builder<'e, 'a> {
    envelope: &'e Envelope<'a>,
    out: Vec<u8>,
    /// Bytes past which nothing is hashed: stop building there.
    limit: usize,
    truncated: bool,
    /// A cut body lacks a member that the stream puts before what it has.
    unknown_order: bool,
    /// (kind, index, start) of each part written.
    sections: Vec<(SectionKind, u32, usize)>,
}

impl Builder<'_, '_> {
    /// Appends one part; on a cut body, a part that does not scan ends the
    /// stream (what came before it is kept).
    fn part(
        &mut self,
        name: &[u8],
        kind: SectionKind,
        index: u32,
        value: Range<usize>,
    ) -> Result<bool, CanonicalError> {
        if self.out.len() >= self.limit {
            self.truncated = true;
            return Ok(false);
        }
        let mark = self.out.len();
        self.out.push(SECTION);
        self.out.extend_from_slice(name);
        self.out.push(FIELD);
        match scan::write_minified(self.envelope.body, value, DROPPED_KEYS, &mut self.out, self.limit) {
            Ok(()) => {
                self.sections.push((kind, index, mark));
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
                self.part(key.as_bytes(), kind, 0, span)
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
        let mut failed = None;
        let mut index = 0u32;
        // System messages lead the conversation: roles are read only until
        // the first other one, so a long conversation is not scanned twice.
        let mut leading = true;
        let scanned = scan::for_each_element(body, span, |element| {
            leading = leading && is_system_message(body, element.clone());
            let kind = if leading {
                SectionKind::System
            } else {
                SectionKind::Message
            };
            let written = self.part(b"item", kind, index, element);
            index = index.saturating_add(1);
            match written {
                Ok(more) => more,
                Err(err) => {
                    failed = Some(err);
                    false
                }
            }
        });
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
    let mut b = Builder {
        envelope,
        limit,
        out: Vec::with_capacity(envelope.body.len().min(limit)),
        truncated: false,
        unknown_order: false,
        sections: Vec::new(),
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
    if b.unknown_order {
        // Better no prefix than a wrong one: the sidecar routes on the session.
        b.out.clear();
        b.sections.clear();
    }
    let ends = b.sections.iter().skip(1).map(|s| s.2).chain([b.out.len()]);
    let sections = b
        .sections
        .iter()
        .zip(ends)
        .map(|(&(kind, index, start), end)| Section {
            kind,
            index,
            start: start as u64,
            // The low half of XXH3-64 is plenty to tell two versions of
            // one part apart.
            digest: xxh3_64(b.out.get(start..end).unwrap_or_default()) as u32,
        })
        .collect();
    Ok(Canonical {
        truncated: b.truncated || envelope.truncated(),
        stream: b.out,
        sections,
    })
}
