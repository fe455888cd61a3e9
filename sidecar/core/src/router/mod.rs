//! The routing decision: for each request, the worker where it costs least.
//!
//! Cost, in prompt-token equivalents, starts from Dynamo's KV router
//! (`prefill + decode`) and adds what agent traffic needs:
//!
//! ```text
//! cost(w) = prefill_weight  · (queued_prefill(w) + uncached(w))
//!         + decode_weight   · (active_kv(w) + request_tokens)
//!         + session_weight  · live_sessions(w)          (new sessions only)
//!         + recent_weight   · recent_prefill(w)         (new sessions only)
//!         + eviction_weight · tokens_evicted(w)         (placing the new blocks)
//! ```
//!
//! `uncached(w)` is the request's tokens minus the leading blocks `w` holds,
//! so the longest cached prefix wins unless its worker is loaded enough that
//! recomputing elsewhere is cheaper. `live_sessions` is load a worker has
//! promised: each live session will keep calling, so new sessions spread
//! even when they share a short prefix (a common tool list). It weighs only
//! where a session starts; after that, its prefix and real load decide. Costs within
//! `tie_tolerance` are ties, broken by preference (the session's home, then
//! its parent's) and then by worker id: affinity follows the cost, it never
//! overrides it (a prototype lost up to 14 % of prefill by preferring the
//! last worker more strongly).
//!
//! A continuing session's home is discounted by `move_margin` of the
//! request: a band of hysteresis, so a session under fluctuating load does
//! not flap between two workers that both hold its prefix.
//!
//! A subagent is its own session; the first call of a child is seeded on
//! its parent's worker when costs tie, and spills to the next cheapest
//! worker once the parent's worker is loaded (hot-prefix replication).

use hashbrown::HashMap;

use kvmesh_vocab::limits::MAX_PROMPT_TOKENS;

use crate::index::PrefixIndex;
use crate::lru::Lru;
use crate::models::ModelRates;
use crate::sessions::SessionTable;
use crate::usage::{MAX_BYTES_PER_TOKEN, UsageError, check_usage};

/// Index of a worker in the router's list; stable for the router's life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerId(pub usize);

/// The smallest prefill that teaches a worker's prefill throughput.
const MIN_TOKENS_TO_LEARN_RATE: f64 = 1024.0;

/// Why a worker was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
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

/// Router settings; the weights are in prompt-token equivalents.
#[derive(Debug, Clone)]
pub struct RouterConfig {
    /// Blocks each worker's cache holds, until the engine reports its own.
    pub worker_capacity_blocks: usize,
    /// Sessions remembered; the least recently seen go first.
    pub max_sessions: usize,
    /// A session idle this long is over.
    pub session_ttl_ms: u64,
    /// Destinations returned per pick: the best, then fallbacks for retries.
    pub ranked_destinations: usize,
    /// Picks awaiting their outcome; past this the oldest are released.
    pub max_pending_picks: usize,
    pub prefill_weight: f64,
    pub decode_weight: f64,
    /// Per live session a worker already hosts.
    pub session_weight: f64,
    /// Per token of cached blocks a placement would push out.
    pub eviction_weight: f64,
    /// Prompt tokens assumed per request the engine reports waiting.
    pub waiting_request_tokens: f64,
    /// Costs closer than this fraction of the best are ties.
    pub tie_tolerance: f64,
    /// A continuing session leaves its home only for a worker cheaper by
    /// more than this fraction of the request's tokens: hysteresis, so a
    /// session does not flap between workers of nearly equal cost.
    pub move_margin: f64,
    /// Bytes per token until outcomes teach the model's own.
    pub default_bytes_per_token: f64,
    /// A pick with no outcome after this long is released: its report was
    /// lost (a filter restart, a reply that arrived after its timeout).
    pub max_pick_age_ms: u64,
    /// Prefill throughput of a worker until its outcomes teach its own
    /// (tokens per ms; 10 is about one H100 prefilling a 30B model).
    pub default_prefill_tokens_per_ms: f64,
    /// Per token of a worker's recent prefill, for placing new sessions.
    pub recent_prefill_weight: f64,
    /// Heap bytes the prefix index may hold, whatever the caches report.
    pub index_budget_bytes: usize,
    /// Distinct models whose bytes per token are remembered; past it the
    /// one taught least recently is forgotten (see `ModelRates`).
    pub max_models: usize,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            worker_capacity_blocks: 64 * 1024,
            max_sessions: 100_000,
            session_ttl_ms: 30 * 60 * 1000,
            ranked_destinations: 3,
            max_pending_picks: 100_000,
            prefill_weight: 1.0,
            // Holding KV slows every decode step a little (a decode step
            // reads the weights and all resident KV; thousands of tokens of
            // KV are a few percent of a 30B model's weights); recomputing a
            // token costs a whole prefill token.
            decode_weight: 0.05,
            // About eight 64-token blocks per live session: enough that a
            // shared tool list does not pile sessions onto one worker,
            // small against any real session prefix.
            session_weight: 512.0,
            // An evicted block is recomputed only if someone comes back.
            eviction_weight: 0.2,
            waiting_request_tokens: 512.0,
            tie_tolerance: 0.02,
            move_margin: 0.25,
            default_bytes_per_token: 4.0,
            default_prefill_tokens_per_ms: 10.0,
            // Measured on generated agent workloads (docs/benchmarks.md):
            // imbalance 1.34 → 1.22 on average over four seeds, prefill
            // +2.5 %.
            recent_prefill_weight: 0.05,
            index_budget_bytes: 1 << 30,
            max_pick_age_ms: 15 * 60 * 1000,
            // Far more models than one GPU cluster serves; small enough
            // that a client inventing names costs under 300 KiB.
            max_models: 1024,
        }
    }
}

/// What the core needs to know about one request.
#[derive(Debug, Clone, Copy, Default)]
pub struct PickInput<'a> {
    pub block_hashes: &'a [u64],
    pub last_block_partial: bool,
    /// Bytes per block, as the filter cut them (0 means 256).
    pub block_bytes: u32,
    /// Length of the canonical prompt stream.
    pub prompt_bytes: u64,
    pub session_id: &'a str,
    /// A subagent's own id: when set, the subagent is the session routed.
    pub agent_id: &'a str,
    pub parent_id: &'a str,
    pub model: &'a str,
    /// The session ends with this request.
    pub session_final: bool,
    /// The hashes and `prompt_bytes` cover only a prefix of the prompt (the
    /// filter's caps): the engine's usage may exceed what they hold.
    pub truncated: bool,
    pub now_ms: u64,
}

impl PickInput<'_> {
    /// The session this request is scheduled as: a subagent's own id, else
    /// its session's.
    pub fn routing_key(&self) -> &str {
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

    /// Bytes per block, 256 when the request does not say.
    pub fn block_bytes(&self) -> u32 {
        if self.block_bytes == 0 { 256 } else { self.block_bytes }
    }
}

/// The answer for one request.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// Best first; empty when no worker can be picked.
    pub ranked: Vec<WorkerId>,
    pub predicted_cached_blocks: u32,
    pub reason: Reason,
    pub pick_id: u64,
    /// The chosen worker's cost, and the longest overlap anywhere.
    pub cost: f64,
    pub best_overlap: u32,
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

/// Lifecycle of a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerState {
    Active,
    /// Finishes its requests, takes no new ones.
    Draining,
    /// Gone; its id is never reused.
    Removed,
}

/// A read-only view of one worker, for admin pages and metrics.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerView {
    pub address: String,
    pub state: WorkerState,
    pub healthy: bool,
    pub in_flight: u32,
    pub queued_prefill_tokens: f64,
    pub active_kv_tokens: f64,
    pub cached_blocks: usize,
    pub capacity_blocks: usize,
    pub live_sessions: u32,
}

/// `WorkerLoad`: what a worker is busy with, from kvmesh's own picks and
/// outcomes and from the engine's metrics.
#[derive(Debug, Clone, Default)]
pub struct WorkerLoad {
    pub in_flight: u32,
    /// Prompt tokens picked here and not yet prefilled, as a fluid queue:
    /// it drains at the worker's prefill throughput. (Counting the uncached
    /// tokens of every unfinished request instead overstates the queue of a
    /// busy worker whose requests are decoding, and moves sessions away.)
    pub queued_prefill_tokens: f64,
    queue_at_ms: u64,
    /// Prefill tokens computed lately (decaying, half-life one minute): a
    /// new session weighs the work a worker has been doing, so sessions do
    /// not pile their prefill onto the same workers.
    recent_prefill_tokens: f64,
    /// Learned from time to first byte; 0 until the first outcome.
    prefill_tokens_per_ms: f64,
    /// Prompt tokens of picked requests not yet finished (their KV).
    pub active_kv_tokens: f64,
    /// The engine's own queue (from its metrics), in requests.
    pub engine_waiting: f64,
}

#[derive(Debug)]
struct Worker {
    address: String,
    state: WorkerState,
    healthy: bool,
    load: WorkerLoad,
    /// The capacity from configuration or the engine: the correction never
    /// grows the estimate past it.
    capacity_ceiling: usize,
}

/// A pick awaiting its outcome.
#[derive(Debug, Clone)]
struct Pending {
    worker: WorkerId,
    uncached_tokens: f64,
    request_tokens: f64,
    predicted_blocks: usize,
    block_bytes: u32,
    prompt_bytes: u64,
    truncated: bool,
    /// At most `kvmesh_vocab::limits::MAX_ID_BYTES` (the sidecar rejects
    /// longer), for at most `max_pending_picks` picks.
    model: String,
    /// Its load was already taken off the worker (see `pick`).
    released: bool,
    at_ms: u64,
}

/// Per-candidate figures of one pick.
#[derive(Debug, Clone, Copy)]
struct Candidate {
    id: WorkerId,
    overlap: usize,
    cost: f64,
    /// 0 the session's home, 1 its parent's, 2 any other.
    preference: u8,
    in_flight: u32,
}

/// A worker's blocks and the sessions homed on it, oldest first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Snapshot {
    pub workers: Vec<(String, Vec<u64>)>,
    /// (session, home address, last seen ms).
    pub sessions: Vec<(String, String, u64)>,
}

/// What the insight ledger reads: the figures of the latest pick.
impl crate::FleetView for Router {
    fn pickable(&self, worker: WorkerId) -> bool {
        self.workers.get(worker.0).is_some_and(Self::pickable)
    }

    fn overlap(&self, worker: WorkerId) -> usize {
        self.overlaps.get(worker.0).copied().unwrap_or(0)
    }

    fn holds(&self, worker: WorkerId, block: u64) -> bool {
        self.index.contains(worker, block)
    }
}

/// The routing state of one GPU cluster.
#[derive(Debug)]
pub struct Router {
    config: RouterConfig,
    workers: Vec<Worker>,
    by_address: HashMap<String, WorkerId>,
    index: PrefixIndex,
    sessions: SessionTable,
    pending: Lru<u64>,
    pending_picks: HashMap<u64, Pending>,
    /// Each session's latest pick, while it is pending.
    last_pick: HashMap<String, u64>,
    next_pick_id: u64,
    bytes_per_token: ModelRates,
    overlaps: Vec<usize>,
}

impl Router {
    pub fn new(config: RouterConfig, addresses: impl IntoIterator<Item = String>) -> Self {
        let mut router = Self {
            sessions: SessionTable::new(config.max_sessions, config.session_ttl_ms),
            pending: Lru::new(config.max_pending_picks),
            bytes_per_token: ModelRates::new(config.max_models),
            config,
            workers: Vec::new(),
            by_address: HashMap::new(),
            index: PrefixIndex::new(),
            pending_picks: HashMap::new(),
            last_pick: HashMap::new(),
            next_pick_id: 1,
            overlaps: Vec::new(),
        };
        let budget = router.config.index_budget_bytes;
        router.index.set_byte_budget(budget);
        for address in addresses {
            router.add_worker(&address);
        }
        router
    }

    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    /// Adds a worker (or revives a removed one at the same address).
    pub fn add_worker(&mut self, address: &str) -> WorkerId {
        if let Some(&id) = self.by_address.get(address) {
            if let Some(w) = self.workers.get_mut(id.0) {
                w.state = WorkerState::Active;
            }
            return id;
        }
        let id = self.index.add_worker(self.config.worker_capacity_blocks);
        self.workers.push(Worker {
            address: address.to_owned(),
            state: WorkerState::Active,
            healthy: true,
            load: WorkerLoad::default(),
            capacity_ceiling: self.config.worker_capacity_blocks,
        });
        self.by_address.insert(address.to_owned(), id);
        id
    }

    pub fn worker_id(&self, address: &str) -> Option<WorkerId> {
        self.by_address.get(address).copied()
    }

    pub fn address(&self, id: WorkerId) -> Option<&str> {
        self.workers.get(id.0).map(|w| w.address.as_str())
    }

    /// Takes no new requests; in-flight ones finish.
    pub fn drain(&mut self, id: WorkerId) {
        if let Some(w) = self.workers.get_mut(id.0)
            && w.state == WorkerState::Active
        {
            w.state = WorkerState::Draining;
        }
    }

    /// Forgets the worker's cache and sessions; it is never picked again
    /// unless added back.
    pub fn remove(&mut self, id: WorkerId) {
        if let Some(w) = self.workers.get_mut(id.0) {
            w.state = WorkerState::Removed;
            w.load = WorkerLoad::default();
        }
        self.index.clear_worker(id);
        self.sessions.evict_worker(id);
    }

    /// The engine restarted or reset its cache: nothing is cached there.
    pub fn restart(&mut self, id: WorkerId) -> usize {
        self.index.clear_worker(id)
    }

    pub fn set_healthy(&mut self, id: WorkerId, healthy: bool) {
        if let Some(worker) = self.workers.get_mut(id.0) {
            worker.healthy = healthy;
        }
    }

    /// The engine's own view of its queue.
    pub fn set_engine_waiting(&mut self, id: WorkerId, waiting: f64) {
        if let Some(worker) = self.workers.get_mut(id.0) {
            worker.load.engine_waiting = waiting.max(0.0);
        }
    }

    /// The engine reported its KV capacity in tokens.
    pub fn set_engine_capacity_tokens(&mut self, id: WorkerId, tokens: u64, block_bytes: u32) {
        let block_tokens = f64::from(block_bytes.max(1)) / self.config.default_bytes_per_token;
        let blocks = ((tokens as f64) / block_tokens).max(1.0) as usize;
        if let Some(worker) = self.workers.get_mut(id.0) {
            worker.capacity_ceiling = blocks;
        }
        if self.index.capacity(id) > blocks || self.index.capacity(id) == self.config.worker_capacity_blocks {
            self.index.set_capacity(id, blocks);
        }
    }

    pub fn workers(&self) -> Vec<WorkerView> {
        self.workers
            .iter()
            .enumerate()
            .map(|(i, w)| WorkerView {
                address: w.address.clone(),
                state: w.state,
                healthy: w.healthy,
                in_flight: w.load.in_flight,
                queued_prefill_tokens: w.load.queued_prefill_tokens,
                active_kv_tokens: w.load.active_kv_tokens,
                cached_blocks: self.index.len(WorkerId(i)),
                capacity_blocks: self.index.capacity(WorkerId(i)),
                live_sessions: self.sessions.hosted(WorkerId(i)),
            })
            .collect()
    }

    pub fn sessions(&self) -> &SessionTable {
        &self.sessions
    }

    pub fn index(&self) -> &PrefixIndex {
        &self.index
    }

    /// Ends sessions idle past the TTL.
    pub fn expire_sessions(&mut self, now_ms: u64) -> usize {
        self.sessions.expire(now_ms)
    }

    /// Where a decision put its request, as the insight ledger reads it.
    pub fn placed(&self, decision: &Decision) -> crate::Placed {
        let worker = decision.ranked.first().copied();
        crate::Placed {
            worker,
            predicted_blocks: decision.predicted_cached_blocks as usize,
            reachable_blocks: decision.best_overlap as usize,
            prefill_tokens_per_ms: worker.map_or(0.0, |w| self.prefill_tokens_per_ms(w)),
        }
    }

    /// A worker's prefill throughput in tokens per ms: learned, else the default.
    pub fn prefill_tokens_per_ms(&self, id: WorkerId) -> f64 {
        self.workers
            .get(id.0)
            .map(|w| w.load.prefill_tokens_per_ms)
            .filter(|rate| *rate > 0.0)
            .unwrap_or(self.config.default_prefill_tokens_per_ms)
    }

    /// Bytes per token learned for `model` (else the default).
    pub fn bytes_per_token(&self, model: &str) -> f64 {
        self.bytes_per_token
            .get(model)
            .unwrap_or(self.config.default_bytes_per_token)
    }

    /// Models with a learned bytes per token (at most `max_models`).
    pub fn models(&self) -> usize {
        self.bytes_per_token.len()
    }

    /// Whether an outcome's usage can be believed: against the absolute
    /// bounds, and against its Pick's prompt when the pick is still pending
    /// and was not truncated.
    pub fn check_usage(&self, outcome: &Outcome) -> Result<(), UsageError> {
        let prompt_bytes = self
            .pending_picks
            .get(&outcome.pick_id)
            .filter(|p| !p.truncated)
            .map(|p| p.prompt_bytes);
        check_usage(prompt_bytes, outcome.prompt_tokens, outcome.cached_tokens)
    }

    fn pickable(w: &Worker) -> bool {
        w.healthy && w.state == WorkerState::Active
    }

    /// Lets each worker's prefill queue drain up to `now_ms`.
    fn drain_queues(&mut self, now_ms: u64) {
        let default_rate = self.config.default_prefill_tokens_per_ms;
        for w in &mut self.workers {
            let load = &mut w.load;
            let rate = if load.prefill_tokens_per_ms > 0.0 {
                load.prefill_tokens_per_ms
            } else {
                default_rate
            };
            let elapsed = now_ms.saturating_sub(load.queue_at_ms) as f64;
            load.queued_prefill_tokens = (load.queued_prefill_tokens - rate * elapsed).max(0.0);
            load.recent_prefill_tokens *= 0.5f64.powf(elapsed / 60_000.0);
            load.queue_at_ms = load.queue_at_ms.max(now_ms);
        }
    }

    /// Chooses the workers for one request and records it as placed on the best.
    pub fn pick(&mut self, input: PickInput<'_>) -> Decision {
        let pick_id = self.next_pick_id;
        self.next_pick_id += 1;
        let key = input.routing_key();
        // An agent sends its next call only once the previous one answered:
        // that call is finished even if its outcome report is still on the
        // way, and its load must not count against the session's own home.
        if let Some(previous) = self.last_pick.get(key).copied() {
            self.release_pick(previous);
        }
        let home = (!key.is_empty())
            .then(|| self.sessions.home(key, input.now_ms))
            .flatten();
        let parent_home = (!input.parent_id.is_empty())
            .then(|| self.sessions.home(input.parent_id, input.now_ms))
            .flatten();

        let bytes_per_token = self.bytes_per_token(input.model);
        let block_bytes = input.block_bytes();
        let block_tokens = f64::from(block_bytes) / bytes_per_token;
        // Capped: whatever a Pick claims, it never queues more prefill on a
        // worker than the largest prompt there can be.
        let request_tokens = (input.prompt_bytes as f64 / bytes_per_token)
            .max(input.block_hashes.len() as f64 * block_tokens * 0.5)
            .min(MAX_PROMPT_TOKENS as f64);
        let full = input.full_blocks();

        self.drain_queues(input.now_ms);
        self.release_stale_picks(input.now_ms);
        let mut overlaps = std::mem::take(&mut self.overlaps);
        self.index.overlaps(full, &mut overlaps);
        let c = &self.config;
        let mut candidates: Vec<Candidate> = Vec::with_capacity(self.workers.len());
        for (i, w) in self.workers.iter().enumerate() {
            if !Self::pickable(w) {
                continue;
            }
            let id = WorkerId(i);
            let overlap = overlaps.get(i).copied().unwrap_or(0);
            let cached = (overlap as f64 * block_tokens).min(request_tokens);
            let uncached = request_tokens - cached;
            let queued = w.load.queued_prefill_tokens + w.load.engine_waiting * c.waiting_request_tokens;
            // Only a session without a home yet weighs where sessions live:
            // for a continuing one, moving for balance would recompute its
            // prefix and flap back (its own departure lightens its old home).
            let live = if home.is_none() { self.sessions.hosted(id) } else { 0 };
            let new_blocks = full.len().saturating_sub(overlap);
            let overflow = (self.index.len(id) + new_blocks).saturating_sub(self.index.capacity(id));
            let hysteresis = if home == Some(id) {
                c.move_margin * request_tokens
            } else {
                0.0
            };
            let cost = c.prefill_weight * (queued + uncached)
                + c.decode_weight * (w.load.active_kv_tokens + request_tokens)
                + c.session_weight * f64::from(live)
                + if home.is_none() {
                    c.recent_prefill_weight * w.load.recent_prefill_tokens
                } else {
                    0.0
                }
                + c.eviction_weight * overflow as f64 * block_tokens
                - hysteresis;
            let preference = if home == Some(id) {
                0
            } else if parent_home == Some(id) {
                1
            } else {
                2
            };
            candidates.push(Candidate {
                id,
                overlap,
                cost,
                preference,
                in_flight: w.load.in_flight,
            });
        }
        self.overlaps = overlaps;

        let Some(best_cost) = candidates.iter().map(|c| c.cost).min_by(f64::total_cmp) else {
            return Decision {
                ranked: Vec::new(),
                predicted_cached_blocks: 0,
                reason: Reason::NoWorkers,
                pick_id,
                cost: 0.0,
                best_overlap: 0,
            };
        };
        let tolerance = self.config.tie_tolerance * best_cost.abs().max(1.0);
        // Ties first by preference, then by fewer requests, then by id:
        // deterministic, and documented in the module docs.
        candidates.sort_by(|a, b| {
            let a_tied = a.cost <= best_cost + tolerance;
            let b_tied = b.cost <= best_cost + tolerance;
            b_tied.cmp(&a_tied).then_with(|| {
                if a_tied && b_tied {
                    a.preference
                        .cmp(&b.preference)
                        .then(a.in_flight.cmp(&b.in_flight))
                        .then(a.id.cmp(&b.id))
                } else {
                    a.cost.total_cmp(&b.cost).then(a.id.cmp(&b.id))
                }
            })
        });
        let chosen = candidates[0];
        let best_overlap = candidates.iter().map(|c| c.overlap).max().unwrap_or(0);
        let reason = if chosen.overlap > 0 && chosen.overlap == best_overlap {
            Reason::PrefixMatch
        } else if best_overlap > chosen.overlap {
            Reason::LoadSpill
        } else if chosen.preference == 0 {
            Reason::SessionAffinity
        } else if chosen.preference == 1 {
            Reason::ParentSeed
        } else {
            Reason::LeastLoaded
        };
        let ranked: Vec<WorkerId> = candidates
            .iter()
            .take(self.config.ranked_destinations.max(1))
            .map(|c| c.id)
            .collect();

        let uncached = request_tokens - (chosen.overlap as f64 * block_tokens).min(request_tokens);
        self.place(chosen.id, full, &input, input.now_ms);
        if let Some(w) = self.workers.get_mut(chosen.id.0) {
            w.load.in_flight = w.load.in_flight.saturating_add(1);
            w.load.queued_prefill_tokens += uncached;
            w.load.recent_prefill_tokens += uncached;
            w.load.active_kv_tokens += request_tokens;
        }
        if !input.routing_key().is_empty() {
            self.last_pick.insert(input.routing_key().to_owned(), pick_id);
        }
        self.remember(
            pick_id,
            Pending {
                worker: chosen.id,
                uncached_tokens: uncached,
                request_tokens,
                predicted_blocks: chosen.overlap,
                block_bytes,
                prompt_bytes: input.prompt_bytes,
                truncated: input.truncated,
                model: input.model.to_owned(),
                released: false,
                at_ms: input.now_ms,
            },
        );
        Decision {
            ranked,
            predicted_cached_blocks: u32::try_from(chosen.overlap).unwrap_or(u32::MAX),
            reason,
            pick_id,
            cost: chosen.cost,
            best_overlap: u32::try_from(best_overlap).unwrap_or(u32::MAX),
        }
    }

    /// The engine will hold the request's full blocks once it prefills them,
    /// and the session's next call should find them there.
    fn place(&mut self, id: WorkerId, full_blocks: &[u64], input: &PickInput<'_>, now_ms: u64) {
        self.index.insert(id, full_blocks);
        let key = input.routing_key();
        if input.session_final {
            self.sessions.end(key);
        } else {
            let parent = if input.parent_id.is_empty() {
                None
            } else {
                Some(input.parent_id)
            };
            self.sessions.bind(key, parent, id, now_ms);
        }
    }

    /// Applies a placement another replica decided (from the shared stream).
    pub fn observe_placement(&mut self, address: &str, full_blocks: &[u64], session: &str, now_ms: u64) {
        let Some(id) = self.worker_id(address) else { return };
        self.index.insert(id, full_blocks);
        self.sessions.bind(session, None, id, now_ms);
    }

    fn remember(&mut self, pick_id: u64, pending: Pending) {
        // At the bound, the oldest unreported pick is released: its outcome
        // is never coming (a filter restart, a lost report).
        if self.pending_picks.len() >= self.pending.capacity()
            && let Some(oldest) = self.pending.pop_oldest()
            && let Some(old) = self.pending_picks.remove(&oldest)
        {
            self.release(&old);
        }
        if self.last_pick.len() > 2 * self.pending.capacity() {
            let pending = &self.pending_picks;
            self.last_pick.retain(|_, id| pending.contains_key(id));
        }
        self.pending.touch(pick_id);
        self.pending_picks.insert(pick_id, pending);
    }

    /// Releases picks whose outcome never came (oldest first).
    fn release_stale_picks(&mut self, now_ms: u64) {
        while let Some(&oldest) = self.pending.oldest() {
            let stale = self
                .pending_picks
                .get(&oldest)
                .is_none_or(|p| now_ms.saturating_sub(p.at_ms) > self.config.max_pick_age_ms);
            if !stale {
                break;
            }
            self.pending.remove(&oldest);
            if let Some(p) = self.pending_picks.remove(&oldest) {
                self.release(&p);
            }
        }
    }

    /// Takes a pending pick's load off its worker, once.
    fn release_pick(&mut self, pick_id: u64) {
        let Some(p) = self.pending_picks.get_mut(&pick_id) else {
            return;
        };
        if p.released {
            return;
        }
        let before = p.clone();
        p.released = true;
        self.release(&before);
    }

    fn release(&mut self, p: &Pending) {
        if p.released {
            return;
        }
        // The prefill queue drains by itself (see `WorkerLoad`).
        if let Some(w) = self.workers.get_mut(p.worker.0) {
            w.load.in_flight = w.load.in_flight.saturating_sub(1);
            w.load.active_kv_tokens = (w.load.active_kv_tokens - p.request_tokens).max(0.0);
        }
    }

    /// Applies the outcome of a pick; unknown or repeated picks are ignored.
    ///
    /// The closed loop: when the engine cached fewer tokens than predicted,
    /// the model's picture of that worker is too big. Dropping just the
    /// missing blocks changes nothing (the request re-inserts them), so the
    /// shortfall is taken as evidence about the worker's effective capacity:
    /// under LRU, if the engine lost blocks the model still had, it lost
    /// every older block too. The oldest entries go, and the capacity
    /// estimate shrinks to what survives; it grows back slowly when the
    /// engine cached more than predicted.
    ///
    /// Usage that fails [`Router::check_usage`] releases the pick but
    /// teaches nothing.
    pub fn report(&mut self, outcome: Outcome) -> bool {
        let usage_ok = self.check_usage(&outcome).is_ok();
        let Some(p) = self.pending_picks.remove(&outcome.pick_id) else {
            return false;
        };
        self.pending.remove(&outcome.pick_id);
        self.release(&p);
        // Prefill throughput: the uncached tokens over the time to first
        // byte (queueing included, so it errs towards slower). Only from
        // prefills big enough that the fixed part of the time to first byte
        // (routing, scheduling, the first decode step) does not dominate.
        if outcome.ttfb_ms > 0
            && p.uncached_tokens >= MIN_TOKENS_TO_LEARN_RATE
            && let Some(w) = self.workers.get_mut(p.worker.0)
        {
            let observed = (p.uncached_tokens / f64::from(outcome.ttfb_ms)).clamp(0.1, 1e6);
            let rate = &mut w.load.prefill_tokens_per_ms;
            *rate = if *rate > 0.0 {
                0.8 * *rate + 0.2 * observed
            } else {
                observed
            };
        }
        if !usage_ok {
            return true;
        }
        if let Some(prompt_tokens) = outcome.prompt_tokens.filter(|t| *t > 0)
            && p.prompt_bytes > 0
        {
            let observed = (p.prompt_bytes as f64 / prompt_tokens as f64).clamp(1.0, MAX_BYTES_PER_TOKEN as f64);
            self.bytes_per_token.learn(&p.model, observed);
        }
        if let Some(cached_tokens) = outcome.cached_tokens {
            let block_tokens = f64::from(p.block_bytes) / self.bytes_per_token(&p.model);
            let cached_blocks = (cached_tokens as f64 / block_tokens).floor() as usize;
            let worker = p.worker;
            let len = self.index.len(worker);
            let capacity = self.index.capacity(worker);
            // The engine counts its own tokens in its own blocks, over its
            // chat template rather than kvmesh's canonical stream, so
            // predictions are only good to a margin: a quarter, plus two
            // blocks. Inside it, nothing is corrected (correcting noise
            // would shrink every worker a little on every call).
            let margin = p.predicted_blocks / 4 + 2;
            if cached_blocks + margin < p.predicted_blocks {
                let shortfall = p.predicted_blocks - cached_blocks;
                let survive = len.saturating_sub(shortfall).max(1);
                self.index.set_capacity(worker, survive.min(capacity));
            } else if cached_blocks > p.predicted_blocks + margin {
                let ceiling = self.workers.get(worker.0).map_or(capacity, |w| w.capacity_ceiling);
                let grown = capacity.saturating_add(cached_blocks - p.predicted_blocks);
                self.index.set_capacity(worker, grown.min(ceiling));
            }
        }
        true
    }

    /// Everything needed to restart warm: each worker's blocks (oldest
    /// first) and the live sessions.
    pub fn snapshot(&self) -> Snapshot {
        let mut snapshot = Snapshot {
            workers: self
                .workers
                .iter()
                .enumerate()
                .filter(|(_, w)| w.state != WorkerState::Removed)
                .map(|(i, w)| (w.address.clone(), self.index.blocks_oldest_first(WorkerId(i))))
                .collect(),
            sessions: self
                .sessions
                .iter()
                .filter_map(|(s, home, seen)| Some((s.to_owned(), self.address(home)?.to_owned(), seen)))
                .collect(),
        };
        snapshot.sessions.sort();
        snapshot
    }

    /// Loads a snapshot into this router (workers it does not know are
    /// skipped: the configuration decides which workers exist).
    pub fn restore(&mut self, snapshot: &Snapshot) {
        for (address, blocks) in &snapshot.workers {
            if let Some(id) = self.worker_id(address) {
                // Oldest first, one at a time, so the LRU order survives.
                for block in blocks {
                    self.index.insert(id, std::slice::from_ref(block));
                }
            }
        }
        for (session, address, seen) in &snapshot.sessions {
            if let Some(id) = self.worker_id(address) {
                self.sessions.bind(session, None, id, *seen);
            }
        }
    }
}
