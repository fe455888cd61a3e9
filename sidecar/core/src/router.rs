//! The first routing policy, after the SGLang router's cache-aware rule: the
//! worker holding the longest cached prefix wins when that prefix is a real
//! share of the request; otherwise the session returns to its last worker, or
//! a new one goes to the least loaded worker. A short shared prefix (the same
//! tool list in every agent's request) must not pile every session onto one
//! GPU.

use std::collections::HashMap;

use crate::lru::Lru;

/// Index of a worker in the router's list; stable for the router's life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerId(pub usize);

/// Why a worker was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    PrefixMatch,
    LeastLoaded,
    SessionAffinity,
    NoWorkers,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::PrefixMatch => "prefix_match",
            Self::LeastLoaded => "least_loaded",
            Self::SessionAffinity => "session_affinity",
            Self::NoWorkers => "no_workers",
        }
    }
}

/// Router settings.
#[derive(Debug, Clone)]
pub struct RouterConfig {
    /// Blocks each worker's cache holds before it evicts (its KV capacity).
    pub worker_capacity_blocks: usize,
    /// Sessions remembered for affinity; the least recently used go first.
    pub max_sessions: usize,
    /// Destinations returned per pick: the best, then fallbacks for retries.
    pub ranked_destinations: usize,
    /// Picks awaiting their outcome; past this the oldest are forgotten so a
    /// filter that never reports cannot grow memory without bound.
    pub max_pending_picks: usize,
    /// Share of the request's blocks the best worker must hold for the prefix
    /// to decide. Below it, balance instead (SGLang's `cache_threshold`, 0.5).
    pub min_match_ratio: f64,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            worker_capacity_blocks: 64 * 1024,
            max_sessions: 100_000,
            ranked_destinations: 3,
            max_pending_picks: 100_000,
            min_match_ratio: 0.5,
        }
    }
}

/// What the core needs to know about one request.
#[derive(Debug, Clone, Copy, Default)]
pub struct PickInput<'a> {
    pub block_hashes: &'a [u64],
    pub last_block_partial: bool,
    pub session_id: &'a str,
}

/// The answer for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// Best first; empty when no worker is healthy.
    pub ranked: Vec<WorkerId>,
    pub predicted_cached_blocks: u32,
    pub reason: Reason,
    pub pick_id: u64,
}

/// What the filter learned once the request finished.
#[derive(Debug, Clone, Copy, Default)]
pub struct Outcome {
    pub pick_id: u64,
}

/// A read-only view of one worker, for admin pages and metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerView {
    pub address: String,
    pub healthy: bool,
    pub in_flight: u32,
    pub cached_blocks: usize,
}

#[derive(Debug, Clone, Copy)]
struct Candidate {
    id: WorkerId,
    overlap: usize,
    in_flight: u32,
    cached_blocks: usize,
}

#[derive(Debug)]
struct Worker {
    address: String,
    healthy: bool,
    in_flight: u32,
    cache: Lru<u64>,
}

/// The routing state of one GPU cluster.
#[derive(Debug)]
pub struct Router {
    config: RouterConfig,
    workers: Vec<Worker>,
    sessions: Lru<String>,
    session_worker: HashMap<String, WorkerId>,
    pending: Lru<u64>,
    pending_worker: HashMap<u64, WorkerId>,
    next_pick_id: u64,
}

impl Router {
    pub fn new(config: RouterConfig, addresses: impl IntoIterator<Item = String>) -> Self {
        let workers = addresses
            .into_iter()
            .map(|address| Worker {
                address,
                healthy: true,
                in_flight: 0,
                cache: Lru::new(config.worker_capacity_blocks),
            })
            .collect();
        Self {
            sessions: Lru::new(config.max_sessions),
            pending: Lru::new(config.max_pending_picks),
            config,
            workers,
            session_worker: HashMap::new(),
            pending_worker: HashMap::new(),
            next_pick_id: 1,
        }
    }

    pub fn address(&self, id: WorkerId) -> Option<&str> {
        self.workers.get(id.0).map(|w| w.address.as_str())
    }

    pub fn set_healthy(&mut self, id: WorkerId, healthy: bool) {
        if let Some(worker) = self.workers.get_mut(id.0) {
            worker.healthy = healthy;
        }
    }

    pub fn workers(&self) -> Vec<WorkerView> {
        self.workers
            .iter()
            .map(|w| WorkerView {
                address: w.address.clone(),
                healthy: w.healthy,
                in_flight: w.in_flight,
                cached_blocks: w.cache.len(),
            })
            .collect()
    }

    pub fn session_count(&self) -> usize {
        self.session_worker.len()
    }

    /// Leading blocks of `hashes` that `worker` is believed to hold.
    fn overlap(worker: &Worker, hashes: &[u64]) -> usize {
        hashes.iter().take_while(|h| worker.cache.contains(h)).count()
    }

    /// Chooses the workers for one request and records it as placed on the best.
    pub fn pick(&mut self, input: PickInput<'_>) -> Decision {
        let pick_id = self.next_pick_id;
        self.next_pick_id += 1;
        let session_worker = (!input.session_id.is_empty())
            .then(|| self.session_worker.get(input.session_id).copied())
            .flatten();

        let mut candidates: Vec<Candidate> = self
            .workers
            .iter()
            .enumerate()
            .filter(|(_, w)| w.healthy)
            .map(|(i, w)| Candidate {
                id: WorkerId(i),
                overlap: Self::overlap(w, input.block_hashes),
                in_flight: w.in_flight,
                cached_blocks: w.cache.len(),
            })
            .collect();
        // Most overlap first; then the least busy, then the emptiest cache
        // (spreads new prefixes), then the id, so the order is deterministic.
        candidates.sort_by(|a, b| {
            b.overlap
                .cmp(&a.overlap)
                .then(a.in_flight.cmp(&b.in_flight))
                .then(a.cached_blocks.cmp(&b.cached_blocks))
                .then(a.id.cmp(&b.id))
        });
        let Some(longest) = candidates.first().copied() else {
            return Decision {
                ranked: Vec::new(),
                predicted_cached_blocks: 0,
                reason: Reason::NoWorkers,
                pick_id,
            };
        };
        let blocks = input.block_hashes.len();
        let decisive = longest.overlap > 0 && longest.overlap as f64 >= self.config.min_match_ratio * blocks as f64;
        let (chosen, reason) = if decisive {
            (longest, Reason::PrefixMatch)
        } else if let Some(own) = candidates.iter().find(|c| Some(c.id) == session_worker) {
            (*own, Reason::SessionAffinity)
        } else {
            let least = candidates
                .iter()
                .min_by_key(|c| (c.in_flight, c.cached_blocks, c.id))
                .copied()
                .unwrap_or(longest);
            (least, Reason::LeastLoaded)
        };
        let overlap = chosen.overlap;
        let ranked: Vec<WorkerId> = std::iter::once(chosen.id)
            .chain(candidates.iter().map(|c| c.id).filter(|id| *id != chosen.id))
            .take(self.config.ranked_destinations.max(1))
            .collect();
        let best = ranked[0];
        self.place(best, input, pick_id);
        Decision {
            ranked,
            predicted_cached_blocks: u32::try_from(overlap).unwrap_or(u32::MAX),
            reason,
            pick_id,
        }
    }

    /// The engine will hold the request's full blocks once it prefills them.
    /// A partial last block is left out: the next call extends it.
    fn place(&mut self, id: WorkerId, input: PickInput<'_>, pick_id: u64) {
        let full = input.block_hashes.len() - usize::from(input.last_block_partial && !input.block_hashes.is_empty());
        if let Some(worker) = self.workers.get_mut(id.0) {
            for hash in &input.block_hashes[..full] {
                worker.cache.touch(*hash);
            }
            worker.in_flight += 1;
        }
        if !input.session_id.is_empty() {
            self.sessions.touch(input.session_id.to_owned());
            self.session_worker.insert(input.session_id.to_owned(), id);
            if self.session_worker.len() > self.sessions.len() {
                let sessions = &self.sessions;
                self.session_worker.retain(|s, _| sessions.contains(s));
            }
        }
        self.pending.touch(pick_id);
        self.pending_worker.insert(pick_id, id);
        if self.pending_worker.len() > self.pending.len() {
            // Forgotten picks will never be reported: release their slot now.
            let pending = &self.pending;
            let workers = &mut self.workers;
            self.pending_worker.retain(|p, w| {
                let keep = pending.contains(p);
                if !keep && let Some(worker) = workers.get_mut(w.0) {
                    worker.in_flight = worker.in_flight.saturating_sub(1);
                }
                keep
            });
        }
    }

    /// Applies the outcome of a pick; unknown or repeated picks are ignored.
    pub fn report(&mut self, outcome: Outcome) -> bool {
        let Some(id) = self.pending_worker.remove(&outcome.pick_id) else {
            return false;
        };
        self.pending.remove(&outcome.pick_id);
        if let Some(worker) = self.workers.get_mut(id.0) {
            worker.in_flight = worker.in_flight.saturating_sub(1);
        }
        true
    }
}
