//! The router's vocabulary at its edge: what a request is (`PickInput`),
//! what the router decided about it and why (`Decision`, an owned record of
//! the pick), and what came of it (`Outcome`). Consumers downstream of the
//! router (the insight ledger, the sidecar's metrics) read a `Decision`,
//! never the router itself.

use kvmesh_vocab::{DEFAULT_BLOCK_BYTES, Harness, Lane};

use super::cost::Cost;
use super::fleet::WorkerId;
use crate::lineage::TraceId;

/// Why a worker was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Reason {
    /// It holds the longest cached prefix of the request.
    PrefixMatch,
    /// Another worker holds more of the prefix, but is loaded enough that
    /// recomputing here is cheaper.
    LoadSpill,
    /// No prefix anywhere; the session's home won the tie.
    SessionAffinity,
    /// No prefix anywhere; a subagent seeded on its parent's worker.
    ParentSeed,
    /// No prefix anywhere; the least costly worker.
    LeastLoaded,
    /// No worker can be picked.
    #[default]
    NoWorkers,
}

impl Reason {
    pub const ALL: [Self; 6] = [
        Self::PrefixMatch,
        Self::LoadSpill,
        Self::SessionAffinity,
        Self::ParentSeed,
        Self::LeastLoaded,
        Self::NoWorkers,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::PrefixMatch => "prefix_match",
            Self::LoadSpill => "load_spill",
            Self::SessionAffinity => "session_affinity",
            Self::ParentSeed => "parent_seed",
            Self::LeastLoaded => "least_loaded",
            Self::NoWorkers => "no_workers",
        }
    }
}

/// Where the parent of a pick's session came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ParentSource {
    /// The request names no parent (or is a side call, placed on its own
    /// merits).
    #[default]
    None,
    /// `parent_id` names the parent session.
    Named,
    /// `parent_id` names the parent by trace, and a live session's
    /// main-lane calls carried that trace (or the session resolved it at an
    /// earlier call).
    Trace,
    /// `parent_id` names the parent by trace, and no live session carried
    /// it: the request is placed with no parent rather than a guessed one.
    UnknownTrace,
}

/// What the core needs to know about one request.
#[derive(Debug, Clone, Copy, Default)]
pub struct PickInput<'a> {
    pub block_hashes: &'a [u64],
    pub last_block_partial: bool,
    /// Bytes per block, as the filter cut them (0 means the filter's
    /// default, `kvmesh_vocab::DEFAULT_BLOCK_BYTES`).
    pub block_bytes: u32,
    /// Length of the canonical prompt stream.
    pub prompt_bytes: u64,
    pub session_id: &'a str,
    /// A subagent's own id: when set, the subagent is the session routed.
    pub agent_id: &'a str,
    /// The parent session (or agent); `trace:<32 hex>` names it by the
    /// trace id of the turn that spawned the request.
    pub parent_id: &'a str,
    pub model: &'a str,
    /// Which lane of its session the request is. A side call (a title, a
    /// summary) is placed on its own merits, as a request with no session;
    /// a compaction is placed as the main lane.
    pub lane: Lane,
    /// The trace id of the request's `traceparent`, when well formed: a
    /// main-lane call's names its session for subagents that name their
    /// parent by it.
    pub trace_id: Option<TraceId>,
    /// The session ends with this request.
    pub session_final: bool,
    /// The agent harness that sent it: return gaps are learned per harness
    /// and tenant.
    pub harness: Harness,
    /// The tenant (already a hash when derived from a credential).
    pub tenant: &'a str,
    /// How long the client asked for its prefix to be kept after this call
    /// (Anthropic `cache_control` TTLs): within it the session is worth
    /// keeping whatever the learned gaps say.
    pub retention_horizon_ms: Option<u64>,
    /// The hashes and `prompt_bytes` cover only a prefix of the prompt (the
    /// filter's caps): the engine's usage may exceed what they hold.
    pub truncated: bool,
    pub now_ms: u64,
}

impl PickInput<'_> {
    /// The session this request is scheduled as: a subagent's own id, else
    /// its session's; none for a side call, which shares the session's id
    /// but not its prompt, so it must neither follow the session's worker
    /// nor move it.
    pub fn routing_key(&self) -> &str {
        if self.lane == Lane::Side {
            ""
        } else {
            self.session_key()
        }
    }

    /// The session this request belongs to, whatever its lane: a
    /// subagent's own id, else its session's.
    pub fn session_key(&self) -> &str {
        if self.agent_id.is_empty() {
            self.session_id
        } else {
            self.agent_id
        }
    }

    /// The request's hashes without a trailing partial block.
    pub fn full_blocks(&self) -> &[u64] {
        let n = self.block_hashes.len() - usize::from(self.last_block_partial && !self.block_hashes.is_empty());
        &self.block_hashes[..n]
    }

    /// Bytes per block, the filter's default when the request does not say.
    pub fn block_bytes(&self) -> u32 {
        if self.block_bytes == 0 {
            DEFAULT_BLOCK_BYTES as u32
        } else {
            self.block_bytes
        }
    }
}

/// The record of one pick: the answer, and the figures it was decided on,
/// as owned values (no borrow of the router), so that whatever consumes it
/// (the insight ledger) runs after the router's lock is released and reads
/// exactly what the choice saw, not the router's state some time later.
/// The request's own facts (blocks, session, sizes) stay with the request:
/// the record does not copy them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Decision {
    /// Best first; empty when no worker can be picked.
    pub ranked: Vec<WorkerId>,
    pub predicted_cached_blocks: u32,
    /// Of those, the blocks held in the worker's host tier only.
    pub predicted_host_blocks: u32,
    /// Those blocks as the prompt tokens the engine should report cached:
    /// at the model's learned bytes per token, in whole engine blocks when
    /// the engine's block size is known.
    pub predicted_cached_tokens: u64,
    pub reason: Reason,
    pub pick_id: u64,
    /// The chosen worker's cost, term by term (zero without a worker).
    pub cost: Cost,
    /// The longest overlap on any worker that could take the request.
    pub best_overlap: u32,
    /// Cached blocks placing the request on the chosen worker pushes out,
    /// and those blocks weighted by the chance their session returns
    /// (the reuse the placement gives up; see `retention`).
    pub evicted_blocks: u32,
    pub evicted_value_blocks: f64,
    /// Per worker, by id: the leading full blocks of the request it held
    /// when the choice was made (before this pick placed them).
    pub overlaps: Vec<usize>,
    /// Per worker, by id: its cost, or `None` when it could take no request
    /// (unhealthy, draining, removed).
    pub costs: Vec<Option<Cost>>,
    /// Bytes per token the request was costed at (the model's, learned).
    pub bytes_per_token: f64,
    /// The request's prompt tokens as costed (capped).
    pub request_tokens: f64,
    /// The chosen worker's prefill throughput, tokens per ms (0 without a
    /// worker).
    pub prefill_tokens_per_ms: f64,
    /// The session's home and its parent's home when the choice was made.
    pub home: Option<WorkerId>,
    pub parent_home: Option<WorkerId>,
    /// Where the session's parent came from (a parent named by trace may
    /// resolve to no session).
    pub parent_source: ParentSource,
}

impl Decision {
    /// The worker the request was placed on.
    pub fn chosen(&self) -> Option<WorkerId> {
        self.ranked.first().copied()
    }

    /// Leading blocks of the request `worker` held when it was decided.
    pub fn overlap(&self, worker: WorkerId) -> usize {
        self.overlaps.get(worker.0).copied().unwrap_or(0)
    }

    /// `worker` could take requests when this was decided.
    pub fn pickable(&self, worker: WorkerId) -> bool {
        self.costs.get(worker.0).is_some_and(Option::is_some)
    }
}

/// What the filter learned once the request finished.
#[derive(Debug, Clone, Copy, Default)]
pub struct Outcome {
    pub pick_id: u64,
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    /// Milliseconds to the first response byte (0 when unknown).
    pub ttfb_ms: u32,
}
