//! The routing decision: for each request, the worker where it costs least.
//!
//! Cost, in prompt-token equivalents, starts from Dynamo's KV router
//! (`prefill + decode`) and adds what agent traffic needs. It is one
//! function, `cost::cost`, whose named terms are these (and a `Decision`
//! carries them as is):
//!
//! ```text
//! cost(w) = prefill_weight  · uncached(w)               (prefill)
//!         + prefill_weight  · queued_prefill(w)         (queue)
//!         + decode_weight   · (active_kv(w) + request_tokens)   (decode)
//!         + session_weight  · live_sessions(w)          (sessions; new sessions only)
//!         + recent_weight   · recent_prefill(w)         (recent; new sessions only)
//!         + eviction_weight · tokens_evicted(w)         (eviction; placing the new blocks)
//!         - move_margin     · request_tokens            (hysteresis; the session's home only)
//! ```
//!
//! With `spread_floor` below 1, the sessions and recent terms are scaled
//! by `floor + (1 − floor) · utilization(w)`, the worker's recent share of
//! time spent prefilling (an experiment, off by default: docs/benchmarks-history.md,
//! "tau-bench with its system prompts, pressured KV (compare)").
//!
//! `uncached(w)` is the request's tokens minus the leading blocks `w` holds
//! (a block in its host tier only counts `host_hit_credit` of one),
//! so the longest cached prefix wins unless its worker is loaded enough that
//! recomputing elsewhere is cheaper. `queued_prefill` counts kvmesh's own
//! queue and the engine's reported waiting requests (`waiting_request_tokens`
//! each). `live_sessions` is load a worker has
//! promised: each live session will keep calling, so new sessions spread
//! even when they share a short prefix (a common tool list). It weighs only
//! where a session starts; after that, its prefix and real load decide. Costs within
//! `tie_tolerance` are ties, broken by preference (the session's home, then
//! its parent's) and then by worker id: affinity follows the cost, it never
//! overrides it (a prototype lost up to 14 % of prefill by preferring the
//! last worker more strongly).
//!
//! The hysteresis term discounts a continuing session's home by
//! `move_margin` of the request: a band, so a session under fluctuating
//! load does not flap between two workers that both hold its prefix.
//!
//! A subagent is its own session; the first call of a child is seeded on
//! its parent's worker when costs tie, and spills to the next cheapest
//! worker once the parent's worker is loaded (hot-prefix replication). A
//! parent named by trace (`trace:<32 hex>`, OpenClaw's) is the live session
//! whose main-lane calls carried that trace id (`lineage`); when none did,
//! the child has no parent.
//!
//! A session's side calls (a title, a summary: its id, another prompt) are
//! placed as requests with no session: by prefix and load only, never
//! moving the session's home nor releasing its pending pick. A compaction
//! call is placed as the main lane.
//!
//! The router's jobs, one file each: `fleet` (workers, their load and the
//! picks awaiting outcomes), `cost` (the formula and the ranking),
//! `learning` (what outcomes teach), `engine_events` (what the engine's KV
//! events say: its resident blocks, evictions and wipes), `snapshot` (warm restarts and other
//! replicas' placements), and `decision` (the record a pick returns, which
//! consumers such as the insight ledger read instead of the router).

mod cost;
mod decision;
mod engine_events;
mod fleet;
pub(crate) mod learning;
mod snapshot;

use std::borrow::Cow;

use hashbrown::HashMap;

use kvmesh_vocab::Lane;
use kvmesh_vocab::limits::MAX_PROMPT_TOKENS;

use crate::index::{PrefixIndex, Walk};
use crate::lineage::ParentName;
use crate::lru::LruMap;
use crate::models::ModelRates;
use crate::retention::{Eviction, RetentionValues};
use crate::sessions::{SessionId, SessionStore};

pub use cost::Cost;
pub use decision::{Decision, Outcome, ParentSource, PickInput, Reason};
pub use engine_events::{EngineCacheChange, EngineCacheEffect};
pub use fleet::{Holdings, WorkerId, WorkerLoad, WorkerState, WorkerView};
pub use snapshot::Snapshot;

use cost::{Candidate, CostFacts};
use fleet::{Pending, Worker};

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
    /// Per token of cached blocks a placement would push out; with
    /// `retention`, each block weighted by the chance its session returns.
    pub eviction_weight: f64,
    /// Price evicted blocks by their session's retention value (see
    /// `retention`); off, every cached token counts the same.
    pub retention: bool,
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
    /// The two spreading terms (sessions, recent) count in full on a
    /// worker busy all of late (recent utilization 1) and this fraction of
    /// it on an idle one, linearly between: spreading new sessions buys
    /// shorter queues, which a busy worker has. 1: always in full.
    pub spread_floor: f64,
    /// Heap bytes the prefix index may hold, whatever the caches report.
    pub index_budget_bytes: usize,
    /// Distinct models whose bytes per token are remembered; past it the
    /// one taught least recently is forgotten (see `ModelRates`).
    pub max_models: usize,
    /// What a block held in a worker's host tier only saves, as a fraction
    /// of a GPU hit (0 to 1): the engine loads it back over PCIe instead of
    /// recomputing it. `uncached(w)` counts such a block as `1 − credit` of
    /// a block.
    pub host_hit_credit: f64,
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
            // Holding KV slows every decode step (a step reads the weights
            // and the batch's KV: on an 8B model at 128 KiB of KV per token
            // and 3.35 TB/s, ~39 ns per token held per step, ~12 µs over a
            // 300-token answer, against ~50 µs to recompute a prompt token
            // at 20 tokens per ms), but a session that moves for it
            // recomputes its prefix. Measured on the closed-loop agent
            // workloads (docs/benchmarks-history.md, 5 seeds): 0.1 balances
            // gen-agents' prefill better (imbalance 1.23 → 1.20) for 5.5 %
            // more prefill there and 1.1 % more on tau-bench; 0.05 computes
            // the least.
            decode_weight: 0.05,
            // About eight 64-token blocks per live session: enough that a
            // shared tool list does not pile sessions onto one worker,
            // small against any real session prefix.
            session_weight: 512.0,
            // An evicted block is recomputed only if its session comes
            // back: with `retention` each block counts its chance of that,
            // so the term is the expected recompute, at the prefill's own
            // weight. (Every block in full, the term's weight was 0.2.) On
            // the long-tool-wait workload of docs/benchmarks-history.md 1.0 computed
            // 4.4 % less prefill than the term without retention, 0.2 1.2 %
            // more; the other workloads within 0.2 %.
            eviction_weight: 1.0,
            retention: true,
            waiting_request_tokens: 512.0,
            tie_tolerance: 0.02,
            move_margin: 0.25,
            default_bytes_per_token: 4.0,
            default_prefill_tokens_per_ms: 10.0,
            // A new session weighs the prefill a worker did lately: on the
            // closed-loop agent workloads (5 seeds) 0.2 computed 11 % less
            // prefill than 0.05 with a lower TTFT p99 and imbalance
            // (docs/benchmarks-history.md, "The corrected field").
            recent_prefill_weight: 0.2,
            spread_floor: 1.0,
            index_budget_bytes: 1 << 30,
            max_pick_age_ms: 15 * 60 * 1000,
            // Far more models than one GPU cluster serves; small enough
            // that a client inventing names costs under 300 KiB.
            max_models: 1024,
            // Dynamo's default (`host_cache_hit_weight`, 0.75, in
            // lib/kv-router/src/scheduling/config.rs,
            // `default_host_cache_hit_weight`). The transfer alone costs
            // less (an 8B model's 128 KiB per token at ~25 GB/s of PCIe is
            // ~190 tokens per ms against ~20 of prefill, a credit of ~0.9);
            // the rest is the load's queueing and its not overlapping the
            // request's own prefill.
            host_hit_credit: 0.75,
        }
    }
}

/// The eviction weight of the cost before retention priced evicted blocks
/// (every cached token the same), kept for side-by-side runs.
const EVICTION_WEIGHT_WITHOUT_RETENTION: f64 = 0.2;

impl RouterConfig {
    /// The defaults with the eviction term kvmesh had before retention:
    /// every cached token a placement pushes out costs the same.
    pub fn without_retention() -> Self {
        Self {
            retention: false,
            eviction_weight: EVICTION_WEIGHT_WITHOUT_RETENTION,
            ..Self::default()
        }
    }
}

/// The routing state of one GPU cluster.
#[derive(Debug, Clone)]
pub struct Router {
    config: RouterConfig,
    workers: Vec<Worker>,
    by_address: HashMap<String, WorkerId>,
    index: PrefixIndex,
    /// Every live session's one record.
    sessions: SessionStore,
    /// Picks awaiting their outcome, oldest first.
    pending: LruMap<u64, Pending>,
    next_pick_id: u64,
    bytes_per_token: ModelRates,
    retention: RetentionValues,
    scratch: PickScratch,
}

/// The parent of a pick's session, as `Router::lineage_of` found it.
#[derive(Debug, Default)]
struct Lineage<'a> {
    /// The parent's home, while the parent is live.
    home: Option<WorkerId>,
    source: ParentSource,
    /// The parent for the session to record if it has none yet: `None`
    /// when there is none, or when the session recorded it already.
    to_record: Option<Cow<'a, str>>,
}

/// Buffers a Pick fills and empties again, kept so that a Pick allocates
/// only what its `Decision` carries out.
#[derive(Debug, Default, Clone)]
struct PickScratch {
    host_overlaps: Vec<usize>,
    candidates: Vec<Candidate>,
    /// Per worker, what placing the request there would push out (when
    /// it overflows), priced once in the candidate loop and read again for
    /// the chosen one's record.
    evictions: Vec<Option<Eviction>>,
}

impl Router {
    pub fn new(config: RouterConfig, addresses: impl IntoIterator<Item = String>) -> Self {
        let mut router = Self {
            sessions: SessionStore::new(config.max_sessions, config.session_ttl_ms),
            pending: LruMap::new(config.max_pending_picks),
            bytes_per_token: ModelRates::new(config.max_models),
            retention: RetentionValues::new(config.max_sessions, config.session_ttl_ms),
            config,
            workers: Vec::new(),
            by_address: HashMap::new(),
            index: PrefixIndex::new(),
            next_pick_id: 1,
            scratch: PickScratch::default(),
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

    /// What kept KV is worth: the learned return gaps, each worker's
    /// residents.
    pub fn retention(&self) -> &RetentionValues {
        &self.retention
    }

    /// Chooses the workers for one request, records it as placed on the
    /// best, and returns the record of the decision.
    pub fn pick(&mut self, input: PickInput<'_>) -> Decision {
        self.pick_from(input, None, None)
    }

    /// `pick`, with the request placed on `worker` whatever the ranking
    /// says (when `worker` can take it): a choice made outside the router,
    /// as a simulator's oracle makes when it tries each worker. Everything
    /// else is `pick`'s, so placing a request where `pick` would have put
    /// it leaves the router exactly as `pick` does.
    pub fn place_on(&mut self, input: PickInput<'_>, worker: WorkerId) -> Decision {
        self.pick_from(input, None, Some(worker))
    }

    /// `pick` with each worker's overlap (leading full blocks it holds)
    /// given instead of read from the prefix index: the engines' own
    /// account of their caches (a precise mode fed by engine lookups, or a
    /// simulator's oracle). Workers not listed hold none; an overlap past
    /// the request's full blocks counts as all of them. Everything else,
    /// the index's learning from the placement included, is `pick`'s.
    pub fn pick_with_overlaps(&mut self, input: PickInput<'_>, overlaps: &[(WorkerId, usize)]) -> Decision {
        let tiered: Vec<(WorkerId, usize, usize)> = overlaps.iter().map(|&(w, blocks)| (w, blocks, 0)).collect();
        self.pick_from(input, Some(&tiered), None)
    }

    /// `pick_with_overlaps` with each worker's leading blocks on either
    /// tier, and how many of those it holds in host memory only.
    pub fn pick_with_tier_overlaps(&mut self, input: PickInput<'_>, overlaps: &[(WorkerId, usize, usize)]) -> Decision {
        self.pick_from(input, Some(overlaps), None)
    }

    fn pick_from(
        &mut self,
        input: PickInput<'_>,
        known_overlaps: Option<&[(WorkerId, usize, usize)]>,
        placed_on: Option<WorkerId>,
    ) -> Decision {
        let pick_id = self.next_pick_id;
        self.next_pick_id += 1;
        // The one look-up of the session's name: the rest goes by its id.
        let session = self.sessions.find(input.routing_key());
        // An agent sends its next call only once the previous one answered:
        // that call is finished even if its outcome report is still on the
        // way, and its load must not count against the session's own home.
        if let Some(previous) = session.and_then(|id| self.sessions.last_pick(id)) {
            self.release_pick(previous);
        }
        let home = session.and_then(|id| self.sessions.home_of(id, input.now_ms));
        let lineage = self.lineage_of(&input, session);
        let parent_home = lineage.home;

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
        let mut overlaps = Vec::with_capacity(self.workers.len());
        let PickScratch {
            mut host_overlaps,
            mut candidates,
            mut evictions,
        } = std::mem::take(&mut self.scratch);
        host_overlaps.clear();
        candidates.clear();
        evictions.clear();
        evictions.resize(self.workers.len(), None);
        let walk = match known_overlaps {
            None => Some(
                self.index
                    .overlaps_by_tier(full, &mut overlaps, Some(&mut host_overlaps)),
            ),
            Some(known) => {
                overlaps.resize(self.workers.len(), 0);
                host_overlaps.resize(self.workers.len(), 0);
                for &(WorkerId(w), blocks, host) in known {
                    if let (Some(slot), Some(host_slot)) = (overlaps.get_mut(w), host_overlaps.get_mut(w)) {
                        *slot = blocks.min(full.len());
                        *host_slot = host.min(*slot);
                    }
                }
                None
            }
        };
        let mut costs = vec![None; self.workers.len()];
        for (i, w) in self.workers.iter().enumerate() {
            if !w.pickable() {
                continue;
            }
            let id = WorkerId(i);
            let overlap = overlaps.get(i).copied().unwrap_or(0);
            let host_overlap = host_overlaps.get(i).copied().unwrap_or(0);
            let new_blocks = full.len().saturating_sub(overlap);
            let overflow_blocks = (self.index.len(id) + new_blocks).saturating_sub(self.index.capacity(id));
            let evicted_blocks = if self.config.retention && overflow_blocks > 0 {
                let eviction = self.retention.evicted(id, session, overflow_blocks, input.now_ms);
                if let Some(slot) = evictions.get_mut(i) {
                    *slot = Some(eviction);
                }
                eviction.valued_blocks
            } else {
                overflow_blocks as f64
            };
            let cost = cost::cost(
                &self.config,
                &CostFacts {
                    request_tokens,
                    block_tokens,
                    overlap,
                    host_overlap,
                    queued_tokens: w.load.queued_prefill_tokens
                        + w.load.engine_waiting * self.config.waiting_request_tokens,
                    active_kv_tokens: w.load.active_kv_tokens,
                    recent_prefill_tokens: w.load.recent_prefill_tokens,
                    // Read only where `spread_floor` weighs it: off the
                    // default Pick's per-worker loop.
                    recent_utilization: if self.config.spread_floor < 1.0 {
                        w.load.recent_utilization(self.config.default_prefill_tokens_per_ms)
                    } else {
                        1.0
                    },
                    live_sessions: self.sessions.hosted(id),
                    evicted_blocks,
                    new_session: home.is_none(),
                    at_home: home == Some(id),
                },
            );
            if let Some(slot) = costs.get_mut(i) {
                *slot = Some(cost);
            }
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
                cost: cost.total,
                preference,
                in_flight: w.load.in_flight,
            });
        }
        let mut decision = Decision {
            pick_id,
            overlaps,
            costs,
            bytes_per_token,
            request_tokens,
            home,
            parent_home,
            parent_source: lineage.source,
            ..Decision::default()
        };
        let ranked = self.config.ranked_destinations.max(1);
        let ranking = cost::rank(&mut candidates, self.config.tie_tolerance, ranked);
        if let Some(at) = placed_on.and_then(|w| candidates.iter().position(|c| c.id == w)) {
            candidates[..=at].rotate_right(1);
        }
        let chosen = candidates.first().copied();
        decision.ranked = candidates.iter().take(ranked).map(|c| c.id).collect();
        let chosen_eviction = chosen.and_then(|c| evictions.get(c.id.0).copied().flatten());
        self.scratch = PickScratch {
            host_overlaps,
            candidates,
            evictions,
        };
        let (Some((reason, best_overlap)), Some(chosen)) = (ranking, chosen) else {
            decision.reason = Reason::NoWorkers;
            decision.ranked.clear();
            return decision;
        };
        let host_overlaps = &self.scratch.host_overlaps;
        decision.reason = reason;
        decision.cost = decision.costs.get(chosen.id.0).copied().flatten().unwrap_or_default();
        decision.predicted_cached_blocks = u32::try_from(chosen.overlap).unwrap_or(u32::MAX);
        let chosen_host = host_overlaps.get(chosen.id.0).copied().unwrap_or(0);
        decision.predicted_host_blocks = u32::try_from(chosen_host).unwrap_or(u32::MAX);
        // Host-loaded blocks count as cached: vLLM reports them so (the
        // scheduler's `num_cached_tokens` includes the connector's loaded
        // tokens).
        decision.predicted_cached_tokens = cost::engine_cached_tokens(
            cost::matched_tokens(chosen.overlap, block_tokens),
            request_tokens,
            self.workers.get(chosen.id.0).and_then(|w| w.engine_block_tokens),
        );
        decision.best_overlap = u32::try_from(best_overlap).unwrap_or(u32::MAX);
        // Priced in the candidate loop when retention weighs the cost;
        // without it, priced here for the record only.
        let eviction = chosen_eviction.or_else(|| {
            let overflow = (self.index.len(chosen.id) + full.len().saturating_sub(chosen.overlap))
                .saturating_sub(self.index.capacity(chosen.id));
            (overflow > 0).then(|| self.retention.evicted(chosen.id, session, overflow, input.now_ms))
        });
        if let Some(evicted) = eviction {
            decision.evicted_blocks = u32::try_from(evicted.blocks).unwrap_or(u32::MAX);
            decision.evicted_value_blocks = evicted.valued_blocks;
        }
        decision.prefill_tokens_per_ms = self.prefill_tokens_per_ms(chosen.id);

        let uncached = request_tokens
            - cost::credited_cached_tokens(&self.config, chosen.overlap, chosen_host, block_tokens, request_tokens);
        self.note_block_size(chosen.id, block_bytes, input.model);
        let session = self.place(
            chosen.id,
            walk,
            full.len().saturating_sub(chosen.overlap),
            lineage.to_record.as_deref(),
            &input,
        );
        self.charge(
            &decision,
            Pending {
                worker: chosen.id,
                uncached_tokens: uncached,
                request_tokens,
                predicted_blocks: chosen.overlap,
                on_home: home == Some(chosen.id),
                block_bytes,
                prompt_bytes: input.prompt_bytes,
                truncated: input.truncated,
                model: input.model.to_owned(),
                session,
                released: false,
                at_ms: input.now_ms,
            },
        );
        decision
    }

    /// The lineage of the request's session: its parent's home, where the
    /// parent came from, and the parent to record for a session that has
    /// none yet. A side call has none: it is placed on its own merits.
    fn lineage_of<'a>(&self, input: &PickInput<'a>, session: Option<SessionId>) -> Lineage<'a> {
        let now_ms = input.now_ms;
        if input.lane == Lane::Side {
            return Lineage::default();
        }
        match ParentName::of(input.parent_id) {
            ParentName::None => Lineage::default(),
            ParentName::Session(parent) => Lineage {
                home: self.sessions.home(parent, now_ms),
                source: ParentSource::Named,
                to_record: Some(Cow::Borrowed(parent)),
            },
            ParentName::Trace(trace) => {
                let key = input.routing_key();
                // Every call of a subagent names the same parent turn: the
                // parent resolved at its first call stands (the turn's trace
                // is forgotten once the parent's next turn begins), and is
                // not copied again.
                if let Some(recorded) = session.and_then(|id| self.sessions.parent_of(id)) {
                    return Lineage {
                        home: self.sessions.home(recorded, now_ms),
                        source: ParentSource::Trace,
                        to_record: None,
                    };
                }
                let carrier = trace
                    .and_then(|trace| self.sessions.trace_carrier(trace, now_ms))
                    // A session is never its own parent.
                    .filter(|carrier| *carrier != key);
                match carrier {
                    Some(parent) => Lineage {
                        home: self.sessions.home(parent, now_ms),
                        source: ParentSource::Trace,
                        to_record: Some(Cow::Owned(parent.to_owned())),
                    },
                    None => Lineage {
                        source: ParentSource::UnknownTrace,
                        ..Lineage::default()
                    },
                }
            }
        }
    }

    /// The engine will hold the request's full blocks once it prefills them,
    /// and the session's next call should find them there. The session's
    /// record is made or updated (or ended, by a final call); its id, while
    /// it has a record.
    fn place(
        &mut self,
        id: WorkerId,
        walk: Option<Walk<'_>>,
        new_blocks: usize,
        parent: Option<&str>,
        input: &PickInput<'_>,
    ) -> Option<SessionId> {
        // After the walk of these blocks, the placement reuses what it read.
        match walk {
            Some(walk) => self.index.insert_walked(id, walk),
            None => self.index.insert(id, input.full_blocks()),
        };
        if let Some(worker) = self.workers.get_mut(id.0) {
            worker.placed_since_events = worker.placed_since_events.saturating_add(new_blocks);
        }
        let key = input.routing_key();
        // A final call makes no record (it would take a live session's
        // place at the bound), but what it leaves on the worker still needs
        // an id.
        let session = if input.session_final {
            self.sessions.detached(key)?
        } else {
            self.sessions.bind(key, parent, id, input.now_ms)?
        };
        self.retention.on_pick(
            &mut self.sessions,
            session,
            (input.harness, input.tenant.to_owned()),
            id,
            new_blocks,
            input.retention_horizon_ms,
            input.session_final,
            self.index.capacity(id),
            input.now_ms,
        );
        if input.session_final {
            self.sessions.end(session);
            return None;
        }
        // The trace of a call that names no parent is its own turn's (a
        // subagent's carries its parent's turn, which it must not claim); a
        // side call has no key and claims nothing.
        if let Some(trace) = input.trace_id
            && input.parent_id.is_empty()
        {
            self.sessions.carry_trace(session, trace);
        }
        Some(session)
    }
}
