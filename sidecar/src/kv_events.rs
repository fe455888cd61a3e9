//! An engine's KV cache events (vLLM's ZeroMQ publisher; SGLang frames them
//! the same way) decoded from their three frames, and the engine's resident
//! blocks followed from them. Pure: no sockets, no tokio; the subscriber is
//! the `kv_subscriber` edge, and the fuzz target feeds this module directly.
//!
//! The wire, as vLLM 0.32 sends it (fixtures in `tests/fixtures/kv_events`, tests in `tests/kv_events.rs`):
//! frames `[topic, seq as 8 bytes big-endian, payload]`, the payload a
//! msgpack array `[ts, [event, …], dp_rank]` (msgspec `array_like`, the rank
//! left out when unset), each event a map tagged by `"type"`: `BlockStored`
//! (`block_hashes`, `parent_block_hash`, `token_ids`, `block_size`, `medium`,
//! …), `BlockRemoved` (`block_hashes`, `medium`, …), `AllBlocksCleared`.
//! Older publishers sent each event as a positional array led by its tag;
//! both are read. A hash is a 64-bit integer (signed from SGLang), or bytes
//! when vLLM hashes to sha256 bytes: their low 8 bytes, big-endian, the same
//! value vLLM's integer mode gives.

use std::collections::HashSet;
use std::fmt;

use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// A payload over this is refused undecoded. A batch is one scheduler step:
/// vLLM's largest seen here was 1.8 KB; a step that stores a 128k-token
/// prompt at 16-token blocks is about 8,000 hashes and 128k token ids, well
/// under 2 MiB in msgpack.
pub const MAX_PAYLOAD_BYTES: usize = 16 << 20;
/// Events in one batch, and hashes in one event: past either the batch is
/// refused (no step of a real engine comes near them).
pub const MAX_EVENTS: usize = 65_536;
pub const MAX_HASHES: usize = 65_536;
/// A topic is a short name (vLLM's default is empty).
pub const MAX_TOPIC_BYTES: usize = 256;
/// Resident blocks followed per engine and medium. A hostile publisher could
/// otherwise grow the set without bound; 4M blocks is 64M tokens at 16 per
/// block, more than any one engine's GPU holds.
pub const MAX_TRACKED_BLOCKS: usize = 4 << 20;

/// Where a block lives: vLLM's `medium` (`vllm/distributed/kv_events.py`:
/// `MEDIUM_GPU = "GPU"`, `MEDIUM_CPU = "CPU"`, `MEDIUM_STORAGE = "STORAGE"`,
/// the field `medium: str | None` of `BlockStored` and `BlockRemoved`; the
/// offloading connector's `offloading/events.py` sends CPU and STORAGE).
/// vLLM says "GPU" even on its CPU backend: that is its primary cache.
/// Names are matched without case and read bounded (64 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Medium {
    /// The engine's own cache: "GPU", and a medium left out or null.
    Primary,
    /// Host memory the engine offloads to ("CPU": vLLM's
    /// `--kv-offloading-size`, SGLang's HiCache host pool).
    Host,
    /// Any other tier ("STORAGE", a name this version does not know):
    /// ignored, because a hit there is priced by neither kvmesh's index nor
    /// its cost, and counting it as either tier above would overstate it.
    Other,
}

/// One event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    BlockStored {
        hashes: Vec<u64>,
        parent: Option<u64>,
        /// How many token ids came with it (the ids are not kept: kvmesh's
        /// blocks are bytes, not the engine's tokens).
        tokens: u64,
        /// The engine's tokens per block.
        block_size: u32,
        medium: Medium,
    },
    BlockRemoved {
        hashes: Vec<u64>,
        medium: Medium,
    },
    AllBlocksCleared,
}

/// One message: the publisher's sequence number, its timestamp (seconds)
/// and its events in order.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    pub seq: u64,
    pub ts: f64,
    pub events: Vec<Event>,
}

/// Why a message was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("{0} frames, not 3 (topic, sequence, payload)")]
    Frames(usize),
    #[error("topic of {0} bytes, over {MAX_TOPIC_BYTES}")]
    Topic(usize),
    #[error("sequence frame of {0} bytes, not 8")]
    Sequence(usize),
    #[error("payload of {0} bytes, over {MAX_PAYLOAD_BYTES}")]
    PayloadTooLarge(usize),
    #[error("payload is not a batch: {0}")]
    Payload(String),
}

/// Decodes one message's frames.
pub fn decode(frames: &[&[u8]]) -> Result<Batch, DecodeError> {
    let [topic, seq, payload] = frames else {
        return Err(DecodeError::Frames(frames.len()));
    };
    if topic.len() > MAX_TOPIC_BYTES {
        return Err(DecodeError::Topic(topic.len()));
    }
    let seq: [u8; 8] = (*seq).try_into().map_err(|_| DecodeError::Sequence(seq.len()))?;
    if payload.len() > MAX_PAYLOAD_BYTES {
        return Err(DecodeError::PayloadTooLarge(payload.len()));
    }
    let raw: RawBatch =
        rmp_serde::from_slice(payload).map_err(|err| DecodeError::Payload(truncate(err.to_string())))?;
    Ok(Batch {
        seq: u64::from_be_bytes(seq),
        ts: raw.ts,
        events: raw.events,
    })
}

/// Error text stays short whatever the input (it reaches the log).
fn truncate(mut text: String) -> String {
    if text.len() > 200 {
        let mut end = 200;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
    text
}

struct RawBatch {
    ts: f64,
    events: Vec<Event>,
}

impl<'de> serde::Deserialize<'de> for RawBatch {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct BatchVisitor;
        impl<'de> Visitor<'de> for BatchVisitor {
            type Value = RawBatch;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("[ts, [events], dp_rank]")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<RawBatch, A::Error> {
                let ts: f64 = seq.next_element()?.ok_or_else(|| de::Error::invalid_length(0, &self))?;
                let events: Events = seq.next_element()?.ok_or_else(|| de::Error::invalid_length(1, &self))?;
                // The data-parallel rank, and anything a later version adds.
                let mut extra = 0usize;
                while seq.next_element::<IgnoredAny>()?.is_some() {
                    extra += 1;
                    if extra > 16 {
                        return Err(de::Error::custom("too many batch fields"));
                    }
                }
                Ok(RawBatch { ts, events: events.0 })
            }
        }
        deserializer.deserialize_seq(BatchVisitor)
    }
}

struct Events(Vec<Event>);

impl<'de> serde::Deserialize<'de> for Events {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct EventsVisitor;
        impl<'de> Visitor<'de> for EventsVisitor {
            type Value = Events;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a list of events")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Events, A::Error> {
                let mut events = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64));
                while let Some(event) = seq.next_element::<EventOrUnknown>()? {
                    if events.len() >= MAX_EVENTS {
                        return Err(de::Error::custom("too many events"));
                    }
                    // An event type this version does not know is skipped:
                    // the ones it does know still count.
                    if let EventOrUnknown::Known(event) = event {
                        events.push(event);
                    }
                }
                Ok(Events(events))
            }
        }
        deserializer.deserialize_seq(EventsVisitor)
    }
}

enum EventOrUnknown {
    Known(Event),
    Unknown,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Tag {
    Stored,
    Removed,
    Cleared,
    Unknown,
}

impl Tag {
    fn from_name(name: &str) -> Self {
        match name {
            "BlockStored" => Self::Stored,
            "BlockRemoved" => Self::Removed,
            "AllBlocksCleared" => Self::Cleared,
            _ => Self::Unknown,
        }
    }
}

/// The fields kvmesh reads, however they came.
#[derive(Default)]
struct Fields {
    hashes: Option<Vec<u64>>,
    parent: Option<u64>,
    tokens: u64,
    block_size: u32,
    medium: Option<Medium>,
}

impl Fields {
    fn into_event<E: de::Error>(self, tag: Tag) -> Result<EventOrUnknown, E> {
        let medium = self.medium.unwrap_or(Medium::Primary);
        Ok(EventOrUnknown::Known(match tag {
            Tag::Stored => Event::BlockStored {
                hashes: self.hashes.ok_or_else(|| E::missing_field("block_hashes"))?,
                parent: self.parent,
                tokens: self.tokens,
                block_size: self.block_size,
                medium,
            },
            Tag::Removed => Event::BlockRemoved {
                hashes: self.hashes.ok_or_else(|| E::missing_field("block_hashes"))?,
                medium,
            },
            Tag::Cleared => Event::AllBlocksCleared,
            Tag::Unknown => return Ok(EventOrUnknown::Unknown),
        }))
    }
}

impl<'de> serde::Deserialize<'de> for EventOrUnknown {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct EventVisitor;
        impl<'de> Visitor<'de> for EventVisitor {
            type Value = EventOrUnknown;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an event map tagged by \"type\", or an array led by its tag")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<EventOrUnknown, A::Error> {
                let mut tag = None;
                let mut fields = Fields::default();
                let mut seen = 0usize;
                while let Some(key) = map.next_key::<Key>()? {
                    seen += 1;
                    if seen > 64 {
                        return Err(de::Error::custom("too many event fields"));
                    }
                    match key {
                        Key::Type => tag = Some(Tag::from_name(&map.next_value::<ShortString>()?.0)),
                        Key::BlockHashes => fields.hashes = Some(map.next_value::<Hashes>()?.0),
                        Key::Parent => fields.parent = map.next_value::<Option<Hash>>()?.map(|h| h.0),
                        Key::TokenIds => fields.tokens = map.next_value::<Count>()?.0,
                        Key::BlockSize => fields.block_size = map.next_value()?,
                        Key::Medium => fields.medium = Some(medium(map.next_value::<Option<ShortString>>()?)),
                        Key::Other => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                fields.into_event(tag.ok_or_else(|| de::Error::missing_field("type"))?)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<EventOrUnknown, A::Error> {
                // msgspec's array_like tagged structs: [tag, fields in order].
                let tag: ShortString = seq.next_element()?.ok_or_else(|| de::Error::invalid_length(0, &self))?;
                let tag = Tag::from_name(&tag.0);
                let mut fields = Fields::default();
                match tag {
                    Tag::Stored => {
                        fields.hashes = seq.next_element::<Hashes>()?.map(|h| h.0);
                        fields.parent = seq.next_element::<Option<Hash>>()?.flatten().map(|h| h.0);
                        fields.tokens = seq.next_element::<Count>()?.map_or(0, |c| c.0);
                        fields.block_size = seq.next_element()?.unwrap_or(0);
                        // lora_id, then the medium.
                        let _ = seq.next_element::<IgnoredAny>()?;
                        fields.medium = seq.next_element::<Option<ShortString>>()?.map(medium);
                    }
                    Tag::Removed => {
                        fields.hashes = seq.next_element::<Hashes>()?.map(|h| h.0);
                        fields.medium = seq.next_element::<Option<ShortString>>()?.map(medium);
                    }
                    Tag::Cleared | Tag::Unknown => {}
                }
                let mut extra = 0usize;
                while seq.next_element::<IgnoredAny>()?.is_some() {
                    extra += 1;
                    if extra > 64 {
                        return Err(de::Error::custom("too many event fields"));
                    }
                }
                fields.into_event(tag)
            }
        }
        deserializer.deserialize_any(EventVisitor)
    }
}

fn medium(name: Option<ShortString>) -> Medium {
    match name.as_ref().map(|n| n.0.as_str()) {
        None => Medium::Primary,
        Some(n) if n.eq_ignore_ascii_case("GPU") => Medium::Primary,
        Some(n) if n.eq_ignore_ascii_case("CPU") => Medium::Host,
        Some(_) => Medium::Other,
    }
}

enum Key {
    Type,
    BlockHashes,
    Parent,
    TokenIds,
    BlockSize,
    Medium,
    Other,
}

impl<'de> serde::Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let name = ShortString::deserialize(deserializer)?;
        Ok(match name.0.as_str() {
            "type" => Self::Type,
            "block_hashes" => Self::BlockHashes,
            "parent_block_hash" => Self::Parent,
            "token_ids" => Self::TokenIds,
            "block_size" => Self::BlockSize,
            "medium" => Self::Medium,
            _ => Self::Other,
        })
    }
}

/// A string of at most 64 bytes (tags, keys, media); longer is refused.
struct ShortString(String);

impl<'de> serde::Deserialize<'de> for ShortString {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct StrVisitor;
        impl Visitor<'_> for StrVisitor {
            type Value = ShortString;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a short string")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<ShortString, E> {
                if v.len() > 64 {
                    return Err(E::custom("string over 64 bytes"));
                }
                Ok(ShortString(v.to_owned()))
            }
            fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<ShortString, E> {
                let text = std::str::from_utf8(v).map_err(|_| E::custom("string is not UTF-8"))?;
                self.visit_str(text)
            }
        }
        deserializer.deserialize_str(StrVisitor)
    }
}

/// A block hash as kvmesh keeps it.
struct Hash(u64);

impl<'de> serde::Deserialize<'de> for Hash {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct HashVisitor;
        impl Visitor<'_> for HashVisitor {
            type Value = Hash;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a block hash (integer or bytes)")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Hash, E> {
                Ok(Hash(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Hash, E> {
                // SGLang's signed hashes: the same 64 bits.
                Ok(Hash(v as u64))
            }
            fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Hash, E> {
                if v.is_empty() || v.len() > 64 {
                    return Err(E::custom("hash bytes must be 1 to 64 long"));
                }
                let tail = &v[v.len().saturating_sub(8)..];
                Ok(Hash(tail.iter().fold(0u64, |acc, b| (acc << 8) | u64::from(*b))))
            }
        }
        deserializer.deserialize_any(HashVisitor)
    }
}

struct Hashes(Vec<u64>);

impl<'de> serde::Deserialize<'de> for Hashes {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct HashesVisitor;
        impl<'de> Visitor<'de> for HashesVisitor {
            type Value = Hashes;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a list of block hashes")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Hashes, A::Error> {
                let mut hashes = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64));
                while let Some(hash) = seq.next_element::<Hash>()? {
                    if hashes.len() >= MAX_HASHES {
                        return Err(de::Error::custom("too many block hashes"));
                    }
                    hashes.push(hash.0);
                }
                Ok(Hashes(hashes))
            }
        }
        deserializer.deserialize_seq(HashesVisitor)
    }
}

/// The length of a list, read without keeping its elements.
struct Count(u64);

impl<'de> serde::Deserialize<'de> for Count {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct CountVisitor;
        impl<'de> Visitor<'de> for CountVisitor {
            type Value = Count;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a list")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Count, A::Error> {
                let mut n = 0u64;
                while seq.next_element::<IgnoredAny>()?.is_some() {
                    n += 1;
                }
                Ok(Count(n))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Count, E> {
                Ok(Count(0))
            }
        }
        deserializer.deserialize_any(CountVisitor)
    }
}

/// What one batch changed in an engine's primary cache, as
/// [`EngineCache::apply`] saw it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Applied {
    /// The sequence did not follow the last one seen.
    pub gap: Option<Gap>,
    /// An `AllBlocksCleared` came (what follows it in the batch is counted
    /// below, against the empty cache).
    pub cleared: bool,
    /// Blocks newly resident, and blocks the engine removed (after the last
    /// clear in the batch). A removal counts even when its store was never
    /// seen: the engine evicted it all the same.
    pub stored_blocks: u64,
    pub removed_blocks: u64,
    /// The engine's tokens per block, from the latest store seen.
    pub block_tokens: Option<u32>,
    /// The engine has a host tier: an event with medium CPU came, in this
    /// batch or before.
    pub host_tier: bool,
    /// Of `removed_blocks`, the ones with a host copy: off the GPU, still
    /// in host memory.
    pub removed_to_host_blocks: u64,
    /// Host copies removed while the GPU held no copy: host-only blocks
    /// gone (a removal of a block never seen stored counts too).
    pub host_only_removed_blocks: u64,
}

/// A break in the sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gap {
    /// `missed` messages were lost (a slow subscriber, a dropped frame).
    Missed { missed: u64 },
    /// The sequence went back: a new publisher, i.e. the engine restarted
    /// (vLLM counts from 0 each start). Its cache is a new one.
    Restarted,
}

/// One engine's primary cache as its events describe it: the set of
/// resident block hashes, and whether that set is known to be complete.
#[derive(Debug, Clone, Default)]
pub struct EngineCache {
    next_seq: Option<u64>,
    resident: HashSet<u64>,
    /// Blocks with a host copy (on the GPU too or not), and how many of
    /// them the GPU does not hold.
    host: HashSet<u64>,
    host_only: u64,
    host_tier: bool,
    /// No message was lost since the set was last known empty (a clear, or
    /// the publisher's first message).
    exact: bool,
    block_tokens: Option<u32>,
}

impl EngineCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// Blocks resident now, as far as the events say.
    pub fn resident_blocks(&self) -> u64 {
        self.resident.len() as u64
    }

    /// Whether `resident_blocks` is the engine's whole cache: false after a
    /// lost message, until the next clear or restart (it converges as the
    /// cache turns over: the blocks stored since the gap are all counted).
    pub fn exact(&self) -> bool {
        self.exact
    }

    pub fn block_tokens(&self) -> Option<u32> {
        self.block_tokens
    }

    /// Blocks resident in host memory only, as far as the events say
    /// (exact when `exact` is).
    pub fn host_only_blocks(&self) -> u64 {
        self.host_only
    }

    /// Blocks with a host copy, on the GPU too or not.
    pub fn host_blocks(&self) -> u64 {
        self.host.len() as u64
    }

    fn forget(&mut self) {
        self.resident.clear();
        self.host.clear();
        self.host_only = 0;
    }

    /// Applies one batch in order.
    pub fn apply(&mut self, batch: &Batch) -> Applied {
        let mut applied = Applied::default();
        match self.next_seq {
            Some(next) if batch.seq == next => {}
            Some(next) if batch.seq > next => {
                applied.gap = Some(Gap::Missed {
                    missed: batch.seq - next,
                });
                // The lost messages may have stored and removed anything:
                // start the set again from what comes now. It undercounts
                // until the blocks resident at the gap are evicted (their
                // removals are then of unknown hashes), never overcounts
                // forever as a set kept across the gap would.
                self.forget();
                self.exact = false;
            }
            Some(_) => {
                applied.gap = Some(Gap::Restarted);
                self.forget();
                self.exact = batch.seq == 0;
            }
            // The first message: exact only if it is the publisher's first
            // (events sent before the subscriber was up are lost).
            None => self.exact = batch.seq == 0,
        }
        self.next_seq = Some(batch.seq.wrapping_add(1));
        for event in &batch.events {
            match event {
                Event::AllBlocksCleared => {
                    // The router wipes the worker on both tiers (as on a
                    // restart), so the host set goes too: what the host
                    // tier still holds is learned again from its events.
                    self.forget();
                    self.exact = true;
                    applied.cleared = true;
                    applied.stored_blocks = 0;
                    applied.removed_blocks = 0;
                    applied.removed_to_host_blocks = 0;
                    applied.host_only_removed_blocks = 0;
                }
                Event::BlockStored {
                    hashes,
                    block_size,
                    medium: Medium::Primary,
                    ..
                } => {
                    if *block_size > 0 {
                        self.block_tokens = Some(*block_size);
                        applied.block_tokens = Some(*block_size);
                    }
                    for hash in hashes {
                        if self.resident.len() < MAX_TRACKED_BLOCKS && self.resident.insert(*hash) {
                            applied.stored_blocks += 1;
                            if self.host.contains(hash) {
                                self.host_only = self.host_only.saturating_sub(1);
                            }
                        }
                    }
                }
                Event::BlockRemoved {
                    hashes,
                    medium: Medium::Primary,
                } => {
                    for hash in hashes {
                        if self.resident.remove(hash) && self.host.contains(hash) {
                            applied.removed_to_host_blocks += 1;
                            self.host_only += 1;
                        }
                        applied.removed_blocks += 1;
                    }
                }
                Event::BlockStored {
                    hashes,
                    medium: Medium::Host,
                    ..
                } => {
                    self.host_tier = true;
                    for hash in hashes {
                        if self.host.len() < MAX_TRACKED_BLOCKS
                            && self.host.insert(*hash)
                            && !self.resident.contains(hash)
                        {
                            self.host_only += 1;
                        }
                    }
                }
                Event::BlockRemoved {
                    hashes,
                    medium: Medium::Host,
                } => {
                    self.host_tier = true;
                    for hash in hashes {
                        let known = self.host.remove(hash);
                        if !self.resident.contains(hash) {
                            if known {
                                self.host_only = self.host_only.saturating_sub(1);
                            }
                            applied.host_only_removed_blocks += 1;
                        }
                    }
                }
                Event::BlockStored { .. } | Event::BlockRemoved { .. } => {}
            }
        }
        if applied.block_tokens.is_none() {
            applied.block_tokens = self.block_tokens;
        }
        applied.host_tier = self.host_tier;
        applied
    }
}
