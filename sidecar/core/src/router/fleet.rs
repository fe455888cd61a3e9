//! The fleet as the router keeps it: the registry of workers (address,
//! lifecycle, health, the engine's own signals), each one's load, and the
//! picks awaiting their outcome whose load it carries. `Holdings` is the
//! fleet as values, for consumers that must not hold the router.

use hashbrown::HashMap;
use kvmesh_vocab::DEFAULT_BLOCK_BYTES;

use super::Router;
use super::decision::Decision;
use crate::index::PrefixIndex;
use crate::sessions::{SessionId, SessionStore};

/// Index of a worker in the router's list; stable for the router's life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerId(pub usize);

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
    /// The engine's own KV capacity in tokens, when it reports one, and the
    /// engine tokens per block it was converted with (block size of the
    /// Picks placed here over the bytes per token of their model).
    pub engine_capacity_tokens: Option<u64>,
    pub tokens_per_block: f64,
    /// Block size and model of the latest Pick placed here, and that
    /// model's learned bytes per token.
    pub block_bytes: u32,
    pub bytes_per_token: f64,
    /// The engine's own queue, running requests and KV cache in use, from
    /// its metrics.
    pub engine_waiting: f64,
    pub engine_running: Option<f64>,
    pub engine_kv_usage: Option<f64>,
    /// The engine's resident blocks and its tokens per block, from its KV
    /// events (`None` without events, or after a lost message).
    pub engine_resident_blocks: Option<u64>,
    pub engine_block_tokens: Option<u32>,
    /// Blocks the index holds in the worker's host tier only, and the most
    /// it may (0: no host tier seen); the engine's host-only resident
    /// blocks, from its KV events, when they are known complete.
    pub host_blocks: usize,
    pub host_capacity_blocks: usize,
    pub engine_host_only_blocks: Option<u64>,
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
    pub(super) queue_at_ms: u64,
    /// Prefill tokens computed lately (decaying, half-life one minute): a
    /// new session weighs the work a worker has been doing, so sessions do
    /// not pile their prefill onto the same workers.
    pub(super) recent_prefill_tokens: f64,
    /// Learned from time to first byte; 0 until the first outcome.
    pub(super) prefill_tokens_per_ms: f64,
    /// Prompt tokens of picked requests not yet finished (their KV).
    pub active_kv_tokens: f64,
    /// The engine's own queue (from its metrics), in requests.
    pub engine_waiting: f64,
    /// The engine's running requests and KV cache in use (0..=1), when its
    /// metrics say.
    pub engine_running: Option<f64>,
    pub engine_kv_usage: Option<f64>,
}

impl WorkerLoad {
    /// The fluid prefill queue drained up to `now_ms`, at the learned
    /// throughput (or `default_rate` before the first outcome).
    fn queued_at(&self, now_ms: u64, default_rate: f64) -> f64 {
        let rate = if self.prefill_tokens_per_ms > 0.0 {
            self.prefill_tokens_per_ms
        } else {
            default_rate
        };
        let elapsed = now_ms.saturating_sub(self.queue_at_ms) as f64;
        (self.queued_prefill_tokens - rate * elapsed).max(0.0)
    }
}

/// Half-life of a worker's recent prefill, in ms.
const RECENT_PREFILL_HALF_LIFE_MS: f64 = 60_000.0;

impl WorkerLoad {
    /// The share of the last minutes this worker spent prefilling (0 to 1):
    /// its recent prefill over what it would hold after prefilling without
    /// pause at its rate (`rate · half_life / ln 2`, the decay's integral).
    pub(super) fn recent_utilization(&self, default_rate: f64) -> f64 {
        let rate = if self.prefill_tokens_per_ms > 0.0 {
            self.prefill_tokens_per_ms
        } else {
            default_rate
        };
        let busy_tokens = rate * RECENT_PREFILL_HALF_LIFE_MS / std::f64::consts::LN_2;
        if busy_tokens > 0.0 {
            (self.recent_prefill_tokens / busy_tokens).clamp(0.0, 1.0)
        } else {
            1.0
        }
    }
}

#[derive(Debug, Clone)]
pub(super) struct Worker {
    pub(super) address: String,
    pub(super) state: WorkerState,
    pub(super) healthy: bool,
    pub(super) load: WorkerLoad,
    /// The capacity from configuration or the engine: the correction never
    /// grows the estimate past it.
    pub(super) capacity_ceiling: usize,
    /// The KV capacity the engine reports, in its tokens.
    pub(super) engine_capacity_tokens: Option<u64>,
    /// Tokens per block the engine capacity was last converted with: the
    /// block size of the Picks placed here over the bytes per token of
    /// their model. A block is `block_bytes` of kvmesh's canonical stream,
    /// so how many engine tokens it holds depends on both.
    pub(super) tokens_per_block: f64,
    /// Block size and model of the latest Pick placed here.
    pub(super) block_bytes: u32,
    pub(super) model: String,
    /// From the engine's KV events: its resident blocks, its tokens per
    /// block, and the fraction of a kvmesh block its removals owe the index.
    pub(super) engine_resident_blocks: Option<u64>,
    pub(super) engine_block_tokens: Option<u32>,
    pub(super) removal_carry: f64,
    /// The same for the engine's host tier (host-only blocks).
    pub(super) engine_host_only_blocks: Option<u64>,
    pub(super) host_removal_carry: f64,
    /// Blocks kvmesh placed here, not cached at their pick, since the
    /// engine's last batch of KV events: the most a reset published in
    /// the next batch can have seen the engine store after it.
    pub(super) placed_since_events: usize,
}

impl Worker {
    pub(super) fn pickable(&self) -> bool {
        self.healthy && self.state == WorkerState::Active
    }
}

/// A pick awaiting its outcome.
#[derive(Debug, Clone)]
pub(super) struct Pending {
    pub(super) worker: WorkerId,
    pub(super) uncached_tokens: f64,
    pub(super) request_tokens: f64,
    pub(super) predicted_blocks: usize,
    /// Placed on its own session's home: the blocks predicted cached there
    /// are this conversation's earlier prompt, templated by the engine the
    /// same way. Only then is a shortfall evidence of eviction (see
    /// `Router::report`).
    pub(super) on_home: bool,
    pub(super) block_bytes: u32,
    pub(super) prompt_bytes: u64,
    pub(super) truncated: bool,
    /// At most `kvmesh_vocab::limits::MAX_ID_BYTES` (the sidecar rejects
    /// longer), for at most `max_pending_picks` picks.
    pub(super) model: String,
    /// Its session, for the session's retention and pending pick (none for
    /// a call with no session, or a session's final call).
    pub(super) session: Option<SessionId>,
    /// Its load was already taken off the worker (see `pick`).
    pub(super) released: bool,
    pub(super) at_ms: u64,
}

/// Which workers take requests, and which of the (worker, block) pairs a
/// consumer asked about they hold, at one moment: values taken under a
/// short router lock, so the consumer (the insight ledger) runs without it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Holdings {
    held: HashMap<(WorkerId, u64), bool>,
}

impl Holdings {
    /// The answers as a driver knows them (the benchmark asks its engines).
    pub fn new(answers: impl IntoIterator<Item = ((WorkerId, u64), bool)>) -> Self {
        Self {
            held: answers.into_iter().collect(),
        }
    }

    /// Whether `worker` takes requests and holds `block`; `None` when that
    /// was not asked (the question came after the snapshot).
    pub fn holds(&self, worker: WorkerId, block: u64) -> Option<bool> {
        self.held.get(&(worker, block)).copied()
    }
}

impl Router {
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
            engine_capacity_tokens: None,
            tokens_per_block: 0.0,
            block_bytes: DEFAULT_BLOCK_BYTES as u32,
            model: String::new(),
            engine_resident_blocks: None,
            engine_block_tokens: None,
            removal_carry: 0.0,
            engine_host_only_blocks: None,
            host_removal_carry: 0.0,
            placed_since_events: 0,
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
        self.retention.clear_worker(id);
    }

    /// The engine restarted or reset its cache: forget every block kvmesh
    /// placed there, and the closed loop's corrections to its capacity (they
    /// described a cache that is gone): the estimate starts again from the
    /// engine's own figure.
    pub fn restart(&mut self, id: WorkerId) -> usize {
        self.forget_cache_keeping_newest(id, 0)
    }

    /// `restart`, but the newest `kept` blocks kvmesh placed on the worker
    /// stay: those the engine has stored since its reset. Every older block
    /// and every host-only one goes.
    pub(super) fn forget_cache_keeping_newest(&mut self, id: WorkerId, kept: usize) -> usize {
        let dropped = if kept == 0 {
            self.index.clear_worker(id)
        } else {
            let older = self.index.len(id).saturating_sub(kept);
            let host_only = self.index.host_len(id);
            self.index.drop_oldest(id, older) + self.index.drop_oldest_host(id, host_only)
        };
        self.retention.clear_worker(id);
        if let Some(worker) = self.workers.get(id.0) {
            let ceiling = worker.capacity_ceiling;
            self.index.set_capacity(id, ceiling);
        }
        dropped
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

    /// The engine's running requests and the share of its KV cache in use
    /// (0..=1), as its metrics say: shown beside kvmesh's own view of the
    /// worker, so an operator can compare the two.
    pub fn set_engine_activity(&mut self, id: WorkerId, running: Option<f64>, kv_usage: Option<f64>) {
        if let Some(worker) = self.workers.get_mut(id.0) {
            worker.load.engine_running = running.map(|r| r.max(0.0));
            worker.load.engine_kv_usage = kv_usage.map(|u| u.clamp(0.0, 1.0));
        }
    }

    /// The engine's cache block in tokens, as its metrics say (vLLM's
    /// `cache_config_info` `block_size`); KV events say it too. The engine
    /// only ever caches whole blocks of it.
    pub fn set_engine_block_tokens(&mut self, id: WorkerId, tokens: u64) {
        if let Some(worker) = self.workers.get_mut(id.0)
            && let Ok(tokens @ 1..) = u32::try_from(tokens)
        {
            worker.engine_block_tokens = Some(tokens);
        }
    }

    /// The engine reported its KV capacity in tokens. It becomes blocks at
    /// the block size of the Picks placed on the worker and the bytes per
    /// token learned for their model (until the first Pick: the default
    /// block size and bytes per token), and is converted again when either
    /// changes.
    pub fn set_engine_capacity_tokens(&mut self, id: WorkerId, tokens: u64) {
        if let Some(worker) = self.workers.get_mut(id.0) {
            // Scraped every second or so: only a new figure is converted
            // here (Picks and outcomes convert again when their side moves).
            if worker.engine_capacity_tokens == Some(tokens) {
                return;
            }
            worker.engine_capacity_tokens = Some(tokens);
            worker.tokens_per_block = 0.0;
        }
        self.convert_engine_capacity(id);
    }

    /// Gives worker `id` a host tier of `blocks` kvmesh blocks (0: none):
    /// blocks its index evicts for capacity move there, priced at
    /// `host_hit_credit`. The sidecar learns a host tier from KV events
    /// instead (`engine_events`); this is for a tier of known size (the
    /// simulator's, or an operator's figure).
    pub fn set_host_capacity_blocks(&mut self, id: WorkerId, blocks: usize) -> usize {
        self.index.set_host_capacity(id, blocks)
    }

    /// Engine tokens per kvmesh block on worker `id`.
    pub(super) fn tokens_per_block(&self, id: WorkerId) -> f64 {
        let Some(worker) = self.workers.get(id.0) else {
            return 0.0;
        };
        f64::from(worker.block_bytes.max(1)) / self.bytes_per_token(&worker.model)
    }

    /// Turns worker `id`'s engine capacity into blocks if the conversion
    /// moved by more than 2 % since it was last applied (every Pick and
    /// outcome may call it; the index is only resized on a real change).
    pub(super) fn convert_engine_capacity(&mut self, id: WorkerId) {
        let tokens_per_block = self.tokens_per_block(id);
        let Some(worker) = self.workers.get_mut(id.0) else {
            return;
        };
        let Some(tokens) = worker.engine_capacity_tokens else {
            return;
        };
        let before = worker.tokens_per_block;
        if before > 0.0 && (tokens_per_block - before).abs() <= 0.02 * before {
            return;
        }
        worker.tokens_per_block = tokens_per_block;
        let blocks = ((tokens as f64) / tokens_per_block.max(f64::MIN_POSITIVE)).max(1.0) as usize;
        let previous_ceiling = std::mem::replace(&mut worker.capacity_ceiling, blocks);
        let capacity = self.index.capacity(id);
        // The estimate follows the engine's figure down at once; up only
        // from the configured default or the previous engine figure (the
        // closed loop's corrections between them stand).
        if capacity > blocks || capacity == self.config.worker_capacity_blocks || capacity == previous_ceiling {
            self.index.set_capacity(id, blocks);
        }
    }

    /// The block size and model the latest Pick placed on `id` carried.
    pub(super) fn note_block_size(&mut self, id: WorkerId, block_bytes: u32, model: &str) {
        let Some(worker) = self.workers.get_mut(id.0) else {
            return;
        };
        if worker.block_bytes == block_bytes && worker.model == model {
            return;
        }
        worker.block_bytes = block_bytes;
        model.clone_into(&mut worker.model);
        self.convert_engine_capacity(id);
    }

    /// The workers as of `now_ms`: their prefill queues drained for the
    /// time since the last Pick (which drains them for real), so a page read
    /// while no Pick arrives shows what is still queued, not what was.
    pub fn workers_at(&self, now_ms: u64) -> Vec<WorkerView> {
        let default_rate = self.config.default_prefill_tokens_per_ms;
        let mut views = self.workers();
        for (view, w) in views.iter_mut().zip(&self.workers) {
            view.queued_prefill_tokens = w.load.queued_at(now_ms, default_rate);
        }
        views
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
                engine_capacity_tokens: w.engine_capacity_tokens,
                tokens_per_block: w.tokens_per_block,
                block_bytes: w.block_bytes,
                bytes_per_token: self.bytes_per_token(&w.model),
                engine_waiting: w.load.engine_waiting,
                engine_running: w.load.engine_running,
                engine_kv_usage: w.load.engine_kv_usage,
                engine_resident_blocks: w.engine_resident_blocks,
                host_blocks: self.index.host_len(WorkerId(i)),
                host_capacity_blocks: self.index.host_capacity(WorkerId(i)),
                engine_host_only_blocks: w.engine_host_only_blocks,
                engine_block_tokens: w.engine_block_tokens,
            })
            .collect()
    }

    /// Sessions whose latest pick is still pending (what the next call of
    /// each releases early).
    #[cfg(test)]
    pub(crate) fn sessions_with_pending_pick(&self) -> usize {
        self.sessions.with_pending_pick()
    }

    /// The router's session-keyed tables (see `crate::tests::Footprint`).
    #[cfg(test)]
    pub(crate) fn footprints(&self) -> crate::tests::Footprints {
        let mut all = self.sessions.footprints();
        all.push(("router pending", self.pending.footprint()));
        all.extend(self.retention.footprints());
        all
    }

    pub fn sessions(&self) -> &SessionStore {
        &self.sessions
    }

    pub fn index(&self) -> &PrefixIndex {
        &self.index
    }

    /// Ends sessions idle past the TTL: their records, retention learning
    /// from each what it followed.
    pub fn expire_sessions(&mut self, now_ms: u64) -> usize {
        let retention = &mut self.retention;
        self.sessions
            .expire(now_ms, |follow| retention.end_session(follow, now_ms))
    }

    /// Answers which of `probes` the fleet holds now (a worker that takes
    /// no requests holds nothing that counts).
    pub fn holdings(&self, probes: &[(WorkerId, u64)]) -> Holdings {
        Holdings::new(probes.iter().map(|&(worker, block)| {
            let held = self.workers.get(worker.0).is_some_and(Worker::pickable) && self.index.contains(worker, block);
            ((worker, block), held)
        }))
    }

    /// A worker's prefill throughput in tokens per ms: learned, else the default.
    pub fn prefill_tokens_per_ms(&self, id: WorkerId) -> f64 {
        self.workers
            .get(id.0)
            .map(|w| w.load.prefill_tokens_per_ms)
            .filter(|rate| *rate > 0.0)
            .unwrap_or(self.config.default_prefill_tokens_per_ms)
    }

    /// Lets each worker's prefill queue drain up to `now_ms`.
    pub(super) fn drain_queues(&mut self, now_ms: u64) {
        let default_rate = self.config.default_prefill_tokens_per_ms;
        // Workers drained at the same moment decay by the same factor: one
        // `powf` per distinct elapsed time, not per worker (at 512 workers
        // the `exp2` calls were a tenth of a Pick's instructions).
        let mut decay: Option<(u64, f64)> = None;
        for w in &mut self.workers {
            w.load.queued_prefill_tokens = w.load.queued_at(now_ms, default_rate);
            let load = &mut w.load;
            let elapsed = now_ms.saturating_sub(load.queue_at_ms);
            let factor = match decay {
                Some((at, factor)) if at == elapsed => factor,
                _ => {
                    let factor = 0.5f64.powf(elapsed as f64 / RECENT_PREFILL_HALF_LIFE_MS);
                    decay = Some((elapsed, factor));
                    factor
                }
            };
            load.recent_prefill_tokens *= factor;
            load.queue_at_ms = load.queue_at_ms.max(now_ms);
        }
    }

    /// Puts a decided pick's load on its worker and keeps it pending until
    /// its outcome.
    pub(super) fn charge(&mut self, decision: &Decision, pending: Pending) {
        if let Some(w) = self.workers.get_mut(pending.worker.0) {
            w.load.in_flight = w.load.in_flight.saturating_add(1);
            w.load.queued_prefill_tokens += pending.uncached_tokens;
            w.load.recent_prefill_tokens += pending.uncached_tokens;
            w.load.active_kv_tokens += pending.request_tokens;
        }
        if let Some(session) = pending.session {
            self.sessions.set_last_pick(session, Some(decision.pick_id));
        }
        self.remember(decision.pick_id, pending);
    }

    fn remember(&mut self, pick_id: u64, pending: Pending) {
        // At the bound, the oldest unreported pick is released: its outcome
        // is never coming (a filter restart, a lost report).
        if self.pending.len() >= self.pending.capacity()
            && let Some((old_id, old)) = self.pending.pop_oldest()
        {
            self.retire(old_id, &old);
        }
        self.pending.insert(pick_id, pending);
    }

    /// Releases picks whose outcome never came (oldest first).
    pub(super) fn release_stale_picks(&mut self, now_ms: u64) {
        let max_age = self.config.max_pick_age_ms;
        while let Some((_, oldest)) = self.pending.oldest() {
            if now_ms.saturating_sub(oldest.at_ms) <= max_age {
                break;
            }
            if let Some((pick_id, p)) = self.pending.pop_oldest() {
                self.retire(pick_id, &p);
            }
        }
    }

    /// Takes a pending pick's load off its worker, once.
    pub(super) fn release_pick(&mut self, pick_id: u64) {
        let Some(p) = self.pending.get_mut(&pick_id) else {
            return;
        };
        if p.released {
            return;
        }
        let before = p.clone();
        p.released = true;
        self.release(&before);
    }

    /// A pick leaves `pending` (its outcome came, or it aged out): its load
    /// is released, and it is no longer its session's pending pick.
    pub(super) fn retire(&mut self, pick_id: u64, p: &Pending) {
        self.release(p);
        if let Some(session) = p.session
            && self.sessions.last_pick(session) == Some(pick_id)
        {
            self.sessions.set_last_pick(session, None);
        }
    }

    pub(super) fn release(&mut self, p: &Pending) {
        if p.released {
            return;
        }
        // The prefill queue drains by itself (see `WorkerLoad`).
        if let Some(w) = self.workers.get_mut(p.worker.0) {
            w.load.in_flight = w.load.in_flight.saturating_sub(1);
            w.load.active_kv_tokens = (w.load.active_kv_tokens - p.request_tokens).max(0.0);
        }
    }
}
