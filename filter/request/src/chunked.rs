//! Understanding a request while its body arrives: each chunk is scanned
//! where the last one stopped, each prompt part is minified as soon as its
//! value is complete, and whole blocks are hashed as soon as the stream
//! before them is known, so that at the last byte only the tail is left.
//!
//! Why: hashing only once the whole body is in puts all the size-dependent
//! work after the last byte, on the request's critical path
//! (docs/benchmarks.md, filter overhead).
//!
//! Work done ahead is a guess checked at the end, never trusted: the parts
//! are cached in the order the body sends them, which is the canonical order
//! for most agents (model, system, tools, then messages) but not for all;
//! the chain's salt needs the model, which some clients send after the
//! messages (the previous request's model is then assumed). At the end the
//! one-shot builder of [`crate::canonical_stream`] runs over the whole body,
//! taking cached parts where it wants the same bytes, and the hashes ahead
//! are kept only if their salt and every byte they covered are the final
//! ones. So the result is [`crate::understand`]'s for any split of the body,
//! and a wrong guess costs only the work done ahead.

use kvmesh_vocab::SectionKind;

use crate::canonical::{PartCache, Shape, item_part, json_string};
use crate::hashing::{BlockHash, ChainHasher};
use crate::identity::tenant;
use crate::scan::{Found, Tracker};
use crate::{Api, Envelope, FilterConfig, Headers, NotUnderstood, Understood, salt, understand_envelope};

/// The array members whose elements are parts of the stream.
const ITEM_ARRAYS: &[&str] = &["messages", "input"];

/// What the one-shot path is handed from the work done ahead.
#[derive(Debug)]
pub(crate) struct Ahead {
    pub(crate) cache: PartCache,
    /// The chain so far, with the salt it started from.
    pub(crate) hasher: Option<(Vec<u8>, ChainHasher)>,
}

/// The settings the work ahead depends on; checked again at the end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Settings {
    hash: BlockHash,
    block_bytes: usize,
    max_blocks: usize,
}

impl Settings {
    fn of(config: &FilterConfig) -> Self {
        Self {
            hash: config.hash,
            block_bytes: config.block_bytes,
            max_blocks: config.max_blocks,
        }
    }

    fn limit(self) -> usize {
        self.max_blocks.saturating_mul(self.block_bytes)
    }
}

/// One request whose body is fed chunk by chunk (see the module doc).
#[derive(Debug)]
pub struct ChunkedRequest {
    api: Api,
    settings: Settings,
    expected_len: usize,
    body: Vec<u8>,
    tracker: Tracker,
    cache: PartCache,
    /// Parts are still cached (none failed, the limit is not reached).
    caching: bool,
    /// The stream position of the last part cached, while every part came
    /// in canonical order; `None` once one did not.
    order: Option<usize>,
    /// The items array whose leading system messages are being read, and
    /// whether they still lead.
    leading: (usize, bool),
    tenant: String,
    /// `model` and `cache_salt` as the body has given them so far.
    model: Option<String>,
    cache_salt: Option<String>,
    /// The model assumed while the body has not named one.
    likely_model: Option<String>,
    hasher: Option<(Vec<u8>, ChainHasher)>,
    /// Chains started so far, and (chain, bytes it had hashed) when the
    /// latest chunk came: what was done before the body's last chunk.
    chains: u32,
    before_chunk: (u32, usize),
}

impl ChunkedRequest {
    /// `likely_model` is the model assumed for hashing ahead until the body
    /// names its own (the filter passes the last one it saw);
    /// `expected_len` the body length announced (`content-length`, 0 when
    /// unknown), which only shapes how buffers grow (see [`grow`]).
    pub fn new(
        api: Api,
        headers: &impl Headers,
        config: &FilterConfig,
        likely_model: Option<&str>,
        expected_len: usize,
    ) -> Self {
        let settings = Settings::of(config);
        Self {
            api,
            settings,
            expected_len,
            body: Vec::new(),
            tracker: Tracker::new(ITEM_ARRAYS),
            cache: PartCache::default(),
            caching: true,
            order: Some(0),
            leading: (usize::MAX, true),
            tenant: tenant(headers, config),
            model: None,
            cache_salt: None,
            likely_model: likely_model.map(str::to_owned),
            hasher: None,
            chains: 0,
            before_chunk: (0, 0),
        }
    }

    /// Bytes fed so far.
    pub fn len(&self) -> usize {
        self.body.len()
    }

    pub fn is_empty(&self) -> bool {
        self.body.is_empty()
    }

    /// Bytes held for the body and the parts cached from it.
    #[cfg(test)]
    pub(crate) fn capacity(&self) -> usize {
        self.body.capacity() + self.cache.bytes.capacity()
    }

    /// Appends the next bytes of the body and does what they allow.
    pub fn feed(&mut self, chunk: &[u8]) {
        self.before_chunk = (self.chains, self.hasher.as_ref().map_or(0, |(_, h)| h.consumed()));
        grow(&mut self.body, chunk.len(), self.expected_len);
        // The stream is about as long as the body: whitespace out, part
        // separators in (an eighth more covers an agent's many small
        // parts). Room for the body bytes not yet in it, and that eighth.
        let expected_stream = self.expected_len.saturating_add(self.expected_len / 8);
        let pending = (self.body.len() + chunk.len()).saturating_sub(self.cache.bytes.len());
        grow(
            &mut self.cache.bytes,
            pending.saturating_add(pending / 8),
            expected_stream.min(self.settings.limit()),
        );
        self.body.extend_from_slice(chunk);
        self.tracker.feed(&self.body);
        for found in self.tracker.take_found() {
            match found {
                Found::Member(n) => self.member(n),
                Found::Element { array, element } => self.element(array, element),
            }
        }
        self.hash_ahead();
    }

    fn member(&mut self, n: usize) {
        let Some((key, value)) = self.tracker.members.get(n).cloned() else {
            return;
        };
        let raw = &self.body[value.clone()];
        match &self.body[key] {
            b"model" => {
                self.model = Some(
                    serde_json::from_slice::<Option<String>>(raw)
                        .ok()
                        .flatten()
                        .unwrap_or_default(),
                );
                self.reseed();
            }
            b"cache_salt" => {
                self.cache_salt = Some(json_string(raw).unwrap_or_default().into_owned());
                self.reseed();
            }
            key => {
                if let Some((name, kind, shape, slot)) = member_part(self.api, key, raw) {
                    self.cache_part((name, kind, 0), shape, value, slot);
                }
            }
        }
    }

    fn element(&mut self, array: usize, element: usize) {
        let Some(tracked) = self.tracker.arrays.get(array) else {
            return;
        };
        let Some((key, slot)) = items(self.api) else {
            return;
        };
        let Some(span) = tracked.elements.get(element).cloned() else {
            return;
        };
        if tracked.key != key {
            return;
        }
        if self.leading.0 != array {
            self.leading = (array, true);
        }
        // As the builder reads them: the same function, on the same bytes.
        let (kind, shape) = item_part(self.api, &self.body, span.clone(), &mut self.leading.1);
        let index = u32::try_from(element).unwrap_or(u32::MAX);
        self.cache_part((b"item", kind, index), shape, span, slot);
    }

    fn cache_part(
        &mut self,
        part: (&'static [u8], SectionKind, u32),
        shape: Shape,
        value: std::ops::Range<usize>,
        slot: usize,
    ) {
        if !self.caching {
            return;
        }
        let limit = self.settings.limit();
        if self.cache.bytes.len() >= limit || !self.cache.write(&self.body, part, shape, value, limit) {
            self.caching = false;
            return;
        }
        // A part of an earlier slot than the last one's: the cache is not
        // in stream order, so hashing it ahead would be wasted.
        self.order = self.order.filter(|&last| slot >= last).map(|_| slot);
    }

    /// The salt as the body has told it so far, the likely model assumed.
    fn reseed(&mut self) {
        let Some(model) = self.model.as_deref().or(self.likely_model.as_deref()) else {
            return;
        };
        let seed = salt(&self.tenant, model, self.cache_salt.as_deref().unwrap_or_default());
        if self.hasher.as_ref().is_none_or(|(old, _)| *old != seed) {
            self.chains += 1;
            self.hasher = Some((
                seed.clone(),
                ChainHasher::new(
                    self.settings.hash,
                    &seed,
                    self.settings.block_bytes,
                    self.settings.max_blocks,
                ),
            ));
        }
    }

    fn hash_ahead(&mut self) {
        if self.order.is_none() {
            return;
        }
        if self.hasher.is_none() {
            self.reseed();
        }
        if let Some((_, hasher)) = self.hasher.as_mut() {
            hasher.absorb(&self.cache.bytes);
        }
    }

    /// Understands the body fed so far, as [`crate::understand`] would
    /// (`truncated`: the filter fed only the first `max_body_bytes`).
    pub fn finish(
        self,
        headers: &impl Headers,
        truncated: bool,
        config: &FilterConfig,
    ) -> Result<Understood, NotUnderstood> {
        self.finish_counted(headers, truncated, config).0
    }

    /// [`Self::finish`], and how many stream bytes it kept the hashes of
    /// that were hashed before the last chunk came.
    pub fn finish_counted(
        self,
        headers: &impl Headers,
        truncated: bool,
        config: &FilterConfig,
    ) -> (Result<Understood, NotUnderstood>, usize) {
        let Self {
            api,
            settings,
            body,
            tracker,
            mut cache,
            order,
            hasher,
            chains,
            before_chunk,
            ..
        } = self;
        let envelope = if tracker.done() {
            Envelope::from_members(&body, tracker.members, truncated)
        } else {
            match Envelope::parse(&body, truncated) {
                Ok(envelope) => envelope,
                Err(err) => return (Err(err.into()), 0),
            }
        };
        let ahead = (settings == Settings::of(config)).then(|| {
            cache.arrays = tracker
                .arrays
                .into_iter()
                .filter(|array| array.valid)
                .map(|array| (array.span, array.elements))
                .collect();
            Ahead {
                cache,
                hasher: hasher.filter(|_| order.is_some()),
            }
        });
        let mut kept = 0;
        let understood = understand_envelope(api, headers, &envelope, truncated, config, ahead, &mut kept);
        let ahead_of_last_chunk = if before_chunk.0 == chains {
            kept.min(before_chunk.1)
        } else {
            0
        };
        (understood, ahead_of_last_chunk)
    }
}

/// Makes room for `incoming` more bytes, doubling as a `Vec` does but never
/// past `expected` while that holds them, so the last reallocation comes
/// while about half of the body is in, not with its last chunk (at 1 MB,
/// copying the body again cost more than hashing the chunk). Capacity stays
/// within twice what was needed: a client announcing a length it does not
/// send gets no memory for it.
fn grow(buffer: &mut Vec<u8>, incoming: usize, expected: usize) {
    let (len, capacity) = (buffer.len(), buffer.capacity());
    let need = len.saturating_add(incoming);
    if need <= capacity {
        return;
    }
    let doubled = need.max(capacity.saturating_mul(2));
    let target = if expected >= need {
        doubled.min(expected)
    } else {
        doubled
    };
    buffer.reserve_exact(target - len);
}

/// The name, kind, shape and slot in stream order of a member that is one
/// part of `api`'s stream (as the builder writes it).
fn member_part(api: Api, key: &[u8], raw: &[u8]) -> Option<(&'static [u8], SectionKind, Shape, usize)> {
    if raw == b"null" {
        return None;
    }
    let first = raw.first().copied();
    let (name, kind, shape, slot): (&'static [u8], _, _, _) = match (api, key) {
        (Api::ChatCompletions | Api::Responses | Api::Messages, b"tools") => {
            (b"tools", SectionKind::Tools, Shape::Whole, 0)
        }
        (Api::Messages, b"system") => (b"system", SectionKind::System, Shape::System, 1),
        (Api::Responses, b"instructions") => (b"instructions", SectionKind::System, Shape::Whole, 1),
        (Api::Responses, b"previous_response_id") => (b"previous_response_id", SectionKind::Other, Shape::Whole, 2),
        (Api::Responses, b"input") if first == Some(b'"') => (b"input", SectionKind::Message, Shape::Whole, 3),
        (Api::Completions, b"prompt") if matches!(first, Some(b'"' | b'[')) => {
            (b"prompt", SectionKind::Message, Shape::Whole, 0)
        }
        _ => return None,
    };
    Some((name, kind, shape, slot))
}

/// The array whose elements are `api`'s parts, and their slot.
fn items(api: Api) -> Option<(&'static str, usize)> {
    match api {
        Api::ChatCompletions => Some(("messages", 1)),
        Api::Messages => Some(("messages", 2)),
        Api::Responses => Some(("input", 3)),
        Api::Completions => None,
    }
}
