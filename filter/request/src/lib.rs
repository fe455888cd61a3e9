//! Request understanding for the kvmesh filter, with no proxy-wasm in it: which
//! inference API a request speaks, who it belongs to (session, agent, parent,
//! tenant), its scheduling hints, the chained block hashes of its canonical
//! prompt prefix, and, on the way back, the usage the engine reported.
//!
//! Everything here is pure and runs natively in tests and in the benchmark, so
//! the filter, the simulator and the bench hash the same bytes the same way.
#![forbid(unsafe_code)]

mod canonical;
mod chunked;
mod config;
mod hashing;
mod identity;
mod lane;
mod preamble;
mod priority;
mod retention;
mod scan;
mod usage;

pub use canonical::{Api, Canonical, CanonicalError, Envelope, canonical_stream};
pub use chunked::ChunkedRequest;
pub use config::{ConfigError, DESTINATION_HEADER, FORGED_DESTINATION_HEADER, FilterConfig, IdSource};
pub use hashing::{BlockHash, BlockHashes, ChainHasher, block_hashes, salt};
pub use identity::{Headers, Hints, Identity, bounded_id, detect_harness, hints, identify};
use kvmesh_vocab::PromptSection;
use kvmesh_vocab::limits::{MAX_ID_BYTES, MAX_SECTIONS};
/// Shared with the sidecar and the simulator (defined in `kvmesh-vocab`).
pub use kvmesh_vocab::{Harness, Lane, SectionKind};
pub use priority::{BodyEdit, Engine, PriorityField, Role, RoleClasses, engine_priority_json};
pub use retention::{EPHEMERAL_DEFAULT_S, parse_ttl_s};
pub use scan::ScanError;
pub use usage::{Usage, UsageReader};

/// Everything the filter learns from one request before asking for a route.
#[derive(Debug, Clone, PartialEq)]
pub struct Understood {
    pub api: Api,
    pub model: String,
    pub identity: Identity,
    /// The lane of its session the request is (a side call, a compaction).
    pub lane: Lane,
    pub hints: Hints,
    pub hashes: BlockHashes,
    /// The parts of the canonical stream (tools, system, messages), for the
    /// sidecar's prefix-stability diagnostics.
    pub sections: Vec<PromptSection>,
    /// The body was longer than the parse cap: routed on its first bytes.
    pub body_truncated: bool,
    /// With `priority_field` or `strip_preambles` configured: the one
    /// rewrite doing what they ask (the priority in the engine's field, the
    /// billing block out of `system`), or `None` when there is nothing to
    /// change or the body cannot be rewritten safely (cut at the parse cap):
    /// it then goes untouched.
    pub body_edit: Option<BodyEdit>,
}

/// Why a request is not routed on its content (it then passes through as is).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum NotUnderstood {
    #[error("body is not well-formed JSON: {0}")]
    InvalidJson(#[from] ScanError),
    #[error(transparent)]
    Shape(#[from] CanonicalError),
    #[error("`model` is not a string")]
    Model,
    /// No model has such a name: routing on it would only grow the
    /// sidecar's per-model state.
    #[error("`model` is {0} bytes long, over the {max}-byte bound", max = MAX_ID_BYTES)]
    ModelTooLong(usize),
}

/// Understands one buffered request of a known `api`.
///
/// `truncated` says the filter passed only the first `max_body_bytes` of a
/// longer body: the parts before the cut are used, the rest is ignored.
pub fn understand(
    api: Api,
    headers: &impl Headers,
    body: &[u8],
    truncated: bool,
    config: &FilterConfig,
) -> Result<Understood, NotUnderstood> {
    let envelope = Envelope::parse(body, truncated)?;
    understand_envelope(api, headers, &envelope, truncated, config, None, &mut 0)
}

/// [`understand`] on a body already split into its members, taking what it
/// can of the work done while the body arrived ([`ChunkedRequest`]);
/// `kept_ahead` is set to the stream bytes whose hashes it kept.
fn understand_envelope(
    api: Api,
    headers: &impl Headers,
    envelope: &Envelope<'_>,
    truncated: bool,
    config: &FilterConfig,
    ahead: Option<chunked::Ahead>,
    kept_ahead: &mut usize,
) -> Result<Understood, NotUnderstood> {
    let (cache, ahead_hasher) = ahead.map_or((None, None), |ahead| (Some(ahead.cache), ahead.hasher));
    let model = match envelope.typed::<String>("model") {
        Ok(model) => model.unwrap_or_default(),
        Err(_) if truncated => String::new(),
        Err(_) => return Err(NotUnderstood::Model),
    };
    if model.len() > MAX_ID_BYTES {
        return Err(NotUnderstood::ModelTooLong(model.len()));
    }
    let limit = config.max_blocks.saturating_mul(config.block_bytes);
    let (mut canonical, mut kept) = canonical::canonical_stream_reusing(api, envelope, limit, cache)?;
    if truncated && envelope.raw("model").is_none() {
        // The model salts every hash; in a cut body it may come after the cut.
        canonical.stream.clear();
        kept = 0;
    }
    let identity = identify(headers, envelope, config);
    let mut hints = hints(headers, envelope, config, &identity);
    hints.retention_horizon_s = canonical.horizon_s.max(retention::top_level_horizon_s(envelope));
    let priority = (config.priority_field.as_ref())
        .map(|field| engine_priority_json(field.engine, hints.priority.unwrap_or_default()));
    let body_edit = priority::compose(api, envelope, priority.as_deref(), config.strip_preambles);
    let cache_salt = envelope.string("cache_salt").unwrap_or_default();
    let seed = salt(&identity.tenant, &model, &cache_salt);
    // The chain hashed ahead counts only if it started from this salt and
    // every byte it covered is where the final stream has it.
    let hasher = match ahead_hasher {
        Some((ahead_seed, hasher)) if ahead_seed == seed && hasher.consumed() <= kept => {
            *kept_ahead = hasher.consumed();
            hasher
        }
        _ => ChainHasher::new(config.hash, &seed, config.block_bytes, config.max_blocks),
    };
    let mut hashes = hasher.finish(&canonical.stream);
    // The stream stops where the block cap stops hashing: reaching that
    // point is the block cap at work, even if no byte was left unhashed.
    hashes.truncated |= canonical.stream.len() >= limit;
    // The first sections are where a prefix breaks; a request with more
    // parts than the bound reports the earliest ones.
    canonical.sections.truncate(MAX_SECTIONS);
    let lane = lane::classify(headers, envelope, &identity);
    Ok(Understood {
        api,
        model,
        lane,
        identity,
        hints,
        hashes,
        sections: canonical.sections,
        body_truncated: truncated,
        body_edit,
    })
}

#[cfg(test)]
mod tests;
