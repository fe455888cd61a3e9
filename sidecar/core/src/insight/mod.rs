//! What agents gain from the cache, as an operator reads it: per harness and
//! tenant, how much of each prompt repeats an earlier one, how much a worker
//! was predicted to hold, could have held (the best worker) and really held
//! (the engine's report), how often a session's next call reaches the same
//! worker and why not, where a session's prefix broke, and what keeping idle
//! sessions warm costs in KV memory against the prefill it saves.
//!
//! A consumer downstream of the router: it reads each pick's record (a
//! [`Decision`]) and, for whether a worker still holds a session's prefix,
//! [`Holdings`] values the driver took under a short router lock. It never
//! touches the router, so the sidecar runs it after the router's lock is
//! released, and the benchmark feeds it its engines' truth instead. Pure
//! like the router: time comes in as `now_ms`, and nothing here ever holds
//! prompt text (sections are kinds, positions and 32-bit digests).
//!
//! Its per-session state (`Trace`) is a second session table beside the
//! router's `SessionStore`, on purpose: it is keyed by session *and model*
//! (a harness's side calls on another model must not read as breaks of the
//! main conversation, even from a filter that does not tell lanes apart),
//! holds the last call's blocks and sections (which routing never needs),
//! follows in-flight calls and idle time (which routing does not), and is
//! fed the fleet's truth in the benchmark, where the router's table would
//! be one policy's belief. Sharing one table would put the ledger back
//! under the router's lock.
//!
//! Lanes: a side call (a title, a summary) has no trace, as a call with no
//! session: it is never compared with the session's prefix nor counted as
//! its move, only as a side call, per harness and per session (`lanes`).
//! The main call after a compaction starts a new prefix epoch: it is not
//! compared with the compacted call's prefix, and counts as an epoch, not
//! a break.

use std::collections::VecDeque;
use std::sync::Arc;

use hashbrown::HashMap;

use kvmesh_vocab::limits::MAX_PROMPT_TOKENS;

mod lanes;
mod totals;

use crate::lru::LruMap;
use crate::{Decision, Holdings, ParentSource, PickInput, WorkerId};

use lanes::Lanes;
pub use lanes::SessionLanes;
pub use totals::{Figure, Figures, Totals};

/// The agent harnesses kvmesh tells apart and the parts of a prompt: the
/// workspace's one vocabulary (`kvmesh-vocab`).
pub use kvmesh_vocab::{Harness, Lane, PromptSection, SectionKind};

/// Label of requests that name no tenant.
pub const NO_TENANT: &str = "none";
/// Label of tenants past the label budget.
pub const OTHER_TENANT: &str = "other";

/// Why a session's call did not reach the worker of its previous call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MoveReason {
    /// That worker is unhealthy, draining or gone.
    WorkerGone,
    /// The session's own prefix changed at its first block: there was
    /// nothing left to stick for.
    PrefixChange,
    /// The router believes that worker lost part of the session's prefix.
    Eviction,
    /// That worker held more of the prefix but was too loaded.
    Load,
    /// Costs tied elsewhere (e.g. every candidate held the same prefix).
    Other,
}

impl MoveReason {
    pub const ALL: [Self; 5] = [
        Self::WorkerGone,
        Self::PrefixChange,
        Self::Eviction,
        Self::Load,
        Self::Other,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::WorkerGone => "worker_gone",
            Self::PrefixChange => "prefix_change",
            Self::Eviction => "eviction",
            Self::Load => "load",
            Self::Other => "other",
        }
    }
}

/// Settings of the insight ledger.
#[derive(Debug, Clone)]
pub struct InsightConfig {
    /// KV-cache bytes one token holds on a GPU: 2 (K and V) × layers × KV
    /// heads × head size × bytes per value. 98,304 is a 48-layer model with
    /// 4 KV heads of 128 in bf16 (about a 30B mixture of experts).
    pub kv_bytes_per_token: f64,
    /// Distinct tenants given their own label; later ones count as `other`.
    pub tenant_labels: usize,
    /// Sessions followed; the least recently seen go first.
    pub max_sessions: usize,
    /// Heap bytes the sessions' traces (each one's last block list and
    /// sections, and its key) may hold; past it the least recently seen go
    /// first. With `max_sessions` alone, sessions at the wire's block cap
    /// could hold 100,000 × 600 KiB.
    pub trace_budget_bytes: usize,
    /// A session idle this long is over.
    pub session_ttl_ms: u64,
    /// Distinct prefix break points remembered.
    pub break_points: usize,
    /// Width of one bucket of the report window.
    pub bucket_ms: u64,
    /// Buckets kept: the longest window a report can cover.
    pub buckets: usize,
    /// Picks awaiting their outcome.
    pub max_pending: usize,
}

impl Default for InsightConfig {
    fn default() -> Self {
        Self {
            kv_bytes_per_token: 98_304.0,
            tenant_labels: 16,
            max_sessions: 100_000,
            // About 20,000 sessions of 100k-token prompts; far more of the
            // short ones most agent calls are.
            trace_budget_bytes: 256 << 20,
            session_ttl_ms: 30 * 60 * 1000,
            break_points: 256,
            bucket_ms: 60_000,
            buckets: 24 * 60,
            max_pending: 100_000,
        }
    }
}

/// One call, as the filter described it (the router's record of it is a
/// separate [`Decision`]).
#[derive(Debug, Clone, Copy)]
pub struct Call<'a> {
    /// The request as the router saw it: session, model, blocks, sizes, time.
    pub input: PickInput<'a>,
    pub harness: Harness,
    pub tenant: &'a str,
    pub sections: &'a [PromptSection],
}

/// Index of a (harness, tenant) label pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LabelId {
    pub harness: Harness,
    pub tenant: u16,
}

/// Where prefixes break: no prompt text, only positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BreakPoint {
    pub harness: Harness,
    pub kind: SectionKind,
    /// The message's position (0 for tools and system parts).
    pub index: u32,
}

/// How often a break point was seen, and at which blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakStats {
    pub count: u64,
    pub first_block_min: u64,
    pub first_block_max: u64,
}

impl BreakStats {
    fn new(block: u64) -> Self {
        Self {
            count: 0,
            first_block_min: block,
            first_block_max: block,
        }
    }

    fn see(&mut self, block: u64, count: u64) {
        self.count += count;
        self.first_block_min = self.first_block_min.min(block);
        self.first_block_max = self.first_block_max.max(block);
    }

    fn merge(&mut self, other: &BreakStats) {
        self.count += other.count;
        self.first_block_min = self.first_block_min.min(other.first_block_min);
        self.first_block_max = self.first_block_max.max(other.first_block_max);
    }
}

/// The idle sessions of one harness right now.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Retention {
    pub idle_sessions: u64,
    /// KV bytes they hold on their workers.
    pub kv_bytes: f64,
    /// Prefill GPU time to recompute them if they were evicted.
    pub recompute_ms: f64,
    /// How long the longest of them has been idle.
    pub max_idle_ms: u64,
}

/// One idle session's hold on its worker.
#[derive(Debug, Clone, PartialEq)]
pub struct IdleSession {
    pub session: String,
    pub model: String,
    pub harness: &'static str,
    pub worker: WorkerId,
    pub kv_bytes: f64,
    pub idle_ms: u64,
    /// Prefill time to rebuild it if it were evicted.
    pub recompute_ms: f64,
}

/// A session's last call, to compare its next one with.
#[derive(Debug, Clone)]
struct Trace {
    label: LabelId,
    worker: Option<WorkerId>,
    blocks: Vec<u64>,
    sections: Vec<PromptSection>,
    /// Tokens its blocks hold on `worker`.
    held_tokens: f64,
    prefill_tokens_per_ms: f64,
    in_flight: u32,
    /// Idle (no call in flight) since, and KV cost accounted up to.
    idle_since_ms: Option<u64>,
    accrued_to_ms: u64,
    last_seen_ms: u64,
}

#[derive(Debug, Clone)]
struct PendingCall {
    label: LabelId,
    trace_key: String,
    prefill_tokens_per_ms: f64,
    worker: Option<WorkerId>,
}

#[derive(Debug, Default)]
struct Bucket {
    start_ms: u64,
    totals: HashMap<LabelId, Totals>,
    breaks: HashMap<BreakPoint, BreakStats>,
}

/// A report over a window.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Report {
    pub window_ms: u64,
    /// (harness, tenant, totals), busiest first.
    pub rows: Vec<(String, String, Totals)>,
    /// Most frequent break points first.
    pub breakers: Vec<(String, BreakPoint, BreakStats)>,
    pub retention: Vec<(String, Retention)>,
}

/// The ledger.
#[derive(Debug)]
pub struct Insights {
    config: InsightConfig,
    tenants: Vec<String>,
    tenant_ids: HashMap<String, u16>,
    totals: HashMap<LabelId, Totals>,
    breaks: HashMap<BreakPoint, BreakStats>,
    /// Each session's last call, least recently seen first.
    traces: LruMap<String, Trace>,
    /// What `traces` holds, as `trace_bytes` counts it.
    trace_bytes: usize,
    /// Each session's calls by lane, and whether a compaction ended its
    /// prefix epoch.
    lanes: Lanes,
    /// Calls awaiting their outcome, oldest first.
    pending: LruMap<u64, PendingCall>,
    buckets: VecDeque<Bucket>,
    retention: [Retention; Harness::ALL.len()],
    /// The idle lists of the last finished tick: pages read them instead of
    /// walking every session.
    last_tick: Arc<TickSnapshot>,
}

/// Idle sessions a tick keeps in its list, largest first: `/debug/sessions`
/// pages at most this far (its page limit).
pub const IDLE_LIST_MAX: usize = 10_000;

/// A tick taken in steps: [`Insights::tick_step`] names the next sessions
/// and what to ask the fleet about them, [`Insights::tick_apply`] applies the
/// answer. The driver releases the ledger's lock between the two and
/// between steps, so no Pick waits on a walk of every session (at 100,000
/// sessions the walk took 33-42 ms under the locks every Pick takes). The
/// pass visits the sessions as they were when it began, oldest first; one
/// seen during the pass is counted at the next.
#[derive(Debug)]
pub struct TickPass {
    now_ms: u64,
    /// LRU stamps: visited up to `after`, and the newest when the pass began.
    after: u64,
    until: u64,
    done: bool,
    retention: [Retention; Harness::ALL.len()],
    idle: std::collections::BinaryHeap<ByBytes>,
    idle_count: usize,
    evicted: Vec<IdleSession>,
}

/// One step of a [`TickPass`].
#[derive(Debug, Default)]
pub struct TickStep {
    keys: Vec<String>,
    resume: Option<u64>,
    /// Answer these with [`crate::Router::holdings`].
    pub probes: Vec<(WorkerId, u64)>,
}

/// What the last finished tick found.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TickSnapshot {
    /// When that tick began (its `now_ms`).
    pub taken_ms: u64,
    /// Idle sessions whose worker holds their prefix, largest first, as
    /// [`Insights::idle_sessions`] lists them, at most [`IDLE_LIST_MAX`].
    pub idle: Vec<IdleSession>,
    /// All of them, listed or not.
    pub idle_count: usize,
    /// Idle sessions whose worker lost their prefix, as
    /// [`Insights::evicted_idle_sessions`] lists them, least recently seen
    /// first.
    pub evicted: Vec<IdleSession>,
}

/// An idle session ordered so that the worst of a list is the greatest:
/// fewer KV bytes, then the later id.
#[derive(Debug)]
struct ByBytes(IdleSession);

impl PartialEq for ByBytes {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other).is_eq()
    }
}

impl Eq for ByBytes {}

impl PartialOrd for ByBytes {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for ByBytes {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        other
            .0
            .kv_bytes
            .total_cmp(&self.0.kv_bytes)
            .then_with(|| self.0.session.cmp(&other.0.session))
    }
}

/// Key of a session's trace: a harness's side calls on another model (a
/// title, a summary) must not read as breaks of the main conversation.
fn trace_key(routing_key: &str, model: &str) -> String {
    let mut key = String::with_capacity(routing_key.len() + model.len() + 1);
    key.push_str(routing_key);
    key.push('\u{0}');
    key.push_str(model);
    key
}

impl Insights {
    pub fn new(config: InsightConfig) -> Self {
        Self {
            traces: LruMap::new(config.max_sessions.max(1)),
            pending: LruMap::new(config.max_pending.max(1)),
            tenants: vec![NO_TENANT.to_owned(), OTHER_TENANT.to_owned()],
            tenant_ids: HashMap::new(),
            totals: HashMap::new(),
            breaks: HashMap::new(),
            trace_bytes: 0,
            lanes: Lanes::new(config.max_sessions),
            buckets: VecDeque::new(),
            retention: [Retention::default(); Harness::ALL.len()],
            last_tick: Arc::default(),
            config,
        }
    }

    pub fn config(&self) -> &InsightConfig {
        &self.config
    }

    pub fn tenant_name(&self, id: u16) -> &str {
        self.tenants.get(usize::from(id)).map_or(OTHER_TENANT, String::as_str)
    }

    fn tenant_id(&mut self, tenant: &str) -> u16 {
        if tenant.is_empty() {
            return 0;
        }
        if let Some(&id) = self.tenant_ids.get(tenant) {
            return id;
        }
        if self.tenant_ids.len() >= self.config.tenant_labels {
            return 1;
        }
        let id = u16::try_from(self.tenants.len()).unwrap_or(1);
        self.tenants.push(tenant.to_owned());
        self.tenant_ids.insert(tenant.to_owned(), id);
        id
    }

    /// Adds to the cumulative totals and to the current window bucket.
    fn count(&mut self, label: LabelId, now_ms: u64, update: impl Fn(&mut Totals)) {
        update(self.totals.entry(label).or_default());
        update(self.bucket(now_ms).totals.entry(label).or_default());
    }

    fn bucket(&mut self, now_ms: u64) -> &mut Bucket {
        let width = self.config.bucket_ms.max(1);
        let start = now_ms - now_ms % width;
        if self.buckets.back().is_none_or(|b| b.start_ms < start) {
            self.buckets.push_back(Bucket {
                start_ms: start,
                ..Bucket::default()
            });
            while self.buckets.len() > self.config.buckets.max(1) {
                self.buckets.pop_front();
            }
        }
        // Events are counted in the newest bucket even if their clock is a
        // little behind it (replicas, reordered reports).
        let last = self.buckets.len() - 1;
        &mut self.buckets[last]
    }

    /// The one fact about the fleet that [`Insights::on_pick`] needs for
    /// `call` and its record cannot give: whether the worker of the
    /// session's previous call still holds that call's last block (its idle
    /// time is charged only then). Ask before the pick, answer with
    /// [`crate::Router::holdings`] after it, under the same lock.
    pub fn probe(&self, call: &Call<'_>) -> Option<(WorkerId, u64)> {
        if call.input.routing_key().is_empty() {
            return None;
        }
        let trace = self
            .traces
            .get(&trace_key(call.input.routing_key(), call.input.model))?;
        probe_of(trace)
    }

    /// What [`Insights::tick`] and [`Insights::idle_sessions`] ask of the
    /// fleet: each idle session's worker and last block.
    pub fn idle_probes(&self) -> Vec<(WorkerId, u64)> {
        self.traces
            .iter()
            .filter(|(_, t)| t.idle_since_ms.is_some())
            .filter_map(|(_, t)| probe_of(t))
            .collect()
    }

    /// Records a picked call from the router's record of it; `holdings`
    /// answers [`Insights::probe`] for this call.
    pub fn on_pick(&mut self, call: &Call<'_>, decision: &Decision, holdings: &Holdings) {
        let label = LabelId {
            harness: call.harness,
            tenant: self.tenant_id(call.tenant),
        };
        let placed_worker = decision.chosen();
        let predicted_blocks = decision.predicted_cached_blocks as usize;
        let reachable_blocks = decision.best_overlap as usize;
        let bytes_per_token = if decision.bytes_per_token > 0.0 {
            decision.bytes_per_token
        } else {
            4.0
        };
        let block_tokens = f64::from(call.input.block_bytes()) / bytes_per_token;
        let prompt_tokens = (call.input.prompt_bytes as f64 / bytes_per_token).min(MAX_PROMPT_TOKENS as f64);
        let tokens = |blocks: usize| (blocks as f64 * block_tokens).min(prompt_tokens);
        let key = trace_key(call.input.routing_key(), call.input.model);
        let now = call.input.now_ms;
        let lane = call.input.lane;
        // Every lane counts for its session; the main call after a
        // compaction rebuilds the history with a new prefix.
        let new_epoch = self.lanes.count(call.input.session_key(), label.harness, lane, now);

        // The previous call of this session, if any.
        let previous = if call.input.routing_key().is_empty() {
            None
        } else {
            self.accrue_idle(&key, now, holdings);
            self.traces.get(&key)
        };
        let common = previous.map_or(0, |p| common_prefix(&p.blocks, call.input.full_blocks()));
        let mut moved = None;
        let mut same = false;
        let mut broke = None;
        if let Some(prev) = previous {
            if let (Some(old), Some(new)) = (prev.worker, placed_worker) {
                same = old == new;
                if !same {
                    let reason = if !decision.pickable(old) {
                        MoveReason::WorkerGone
                    } else if common == 0 {
                        MoveReason::PrefixChange
                    } else if decision.overlap(old) < common {
                        MoveReason::Eviction
                    } else if predicted_blocks < decision.overlap(old) {
                        MoveReason::Load
                    } else {
                        MoveReason::Other
                    };
                    moved = Some(reason);
                }
            }
            if !new_epoch && !prev.blocks.is_empty() && common < prev.blocks.len() && !grew_in_place(prev, call) {
                broke = Some((common, break_section(prev, call, common)));
            }
        }
        let continuing = previous.is_some_and(|p| p.worker.is_some()) && placed_worker.is_some();
        // A new epoch's prefix is not compared with the compacted one.
        let checked = !new_epoch && previous.is_some_and(|p| !p.blocks.is_empty());
        let repeated = common.max(reachable_blocks);
        let repeated_bytes = (repeated as u64)
            .saturating_mul(u64::from(call.input.block_bytes()))
            .min(call.input.prompt_bytes);
        self.count(label, now, |t| {
            t.calls += 1;
            // Saturating: a byte count from the wire must not wrap a counter.
            t.prompt_bytes = t.prompt_bytes.saturating_add(call.input.prompt_bytes);
            t.repeated_prefix_bytes = t.repeated_prefix_bytes.saturating_add(repeated_bytes);
            t.prompt_tokens += prompt_tokens;
            t.repeated_prefix_tokens += tokens(repeated);
            // The router's own conversion, in whole engine blocks.
            t.predicted_cached_tokens += decision.predicted_cached_tokens as f64;
            t.reachable_cached_tokens += tokens(reachable_blocks);
            if continuing {
                t.continuing_calls += 1;
                t.same_worker_calls += u64::from(same);
            }
            if let Some(reason) = moved {
                t.moves[reason as usize] += 1;
            }
            if checked {
                t.prefix_checks += 1;
            }
            if let Some((_, (kind, _))) = broke {
                t.prefix_breaks[kind as usize] += 1;
            }
            t.side_calls += u64::from(lane == Lane::Side);
            t.compaction_calls += u64::from(lane == Lane::Compaction);
            t.prefix_epochs += u64::from(new_epoch);
            match decision.parent_source {
                ParentSource::Trace => t.trace_parents += 1,
                ParentSource::UnknownTrace => t.unknown_trace_parents += 1,
                ParentSource::None | ParentSource::Named => {}
            }
        });
        if let Some((block, (kind, index))) = broke {
            let point = BreakPoint {
                harness: label.harness,
                kind,
                index,
            };
            let limit = self.config.break_points.max(1);
            record_break(&mut self.breaks, point, block as u64, limit);
            record_break(&mut self.bucket(now).breaks, point, block as u64, limit);
        }

        // Its outcome is counted whether or not it belongs to a session; at
        // the bound the oldest call's outcome is given up.
        self.pending.insert(
            decision.pick_id,
            PendingCall {
                label,
                trace_key: key.clone(),
                prefill_tokens_per_ms: decision.prefill_tokens_per_ms,
                worker: placed_worker,
            },
        );
        if call.input.routing_key().is_empty() {
            return;
        }
        // This call is now the session's trace.
        let trace = Trace {
            label,
            worker: placed_worker,
            blocks: call.input.full_blocks().to_vec(),
            sections: call.sections.to_vec(),
            held_tokens: tokens(call.input.full_blocks().len()),
            prefill_tokens_per_ms: decision.prefill_tokens_per_ms,
            in_flight: self.traces.get(&key).map_or(0, |t| t.in_flight).saturating_add(1),
            idle_since_ms: None,
            accrued_to_ms: now,
            last_seen_ms: now,
        };
        self.trace_bytes += trace_bytes(&key, &trace);
        // At the session bound the least recently seen trace goes.
        let (replaced, evicted) = self.traces.insert(key.clone(), trace);
        if let Some(old) = replaced {
            self.trace_bytes = self.trace_bytes.saturating_sub(trace_bytes(&key, &old));
        }
        for (gone_key, gone) in evicted {
            self.uncount_trace(&gone_key, &gone);
        }
        // The newest trace is popped last: alone it is far under the budget.
        while self.trace_bytes > self.config.trace_budget_bytes
            && let Some((gone_key, gone)) = self.traces.pop_oldest()
        {
            self.uncount_trace(&gone_key, &gone);
        }
    }

    /// Takes a dropped trace off the byte count.
    fn uncount_trace(&mut self, key: &str, trace: &Trace) {
        self.trace_bytes = self.trace_bytes.saturating_sub(trace_bytes(key, trace));
    }

    /// Heap bytes the traces hold.
    pub fn trace_memory_bytes(&self) -> usize {
        self.trace_bytes
    }

    /// Records the outcome of a pick: the engine's usage, and the end of the
    /// call (its session is idle from now until its next call).
    pub fn on_outcome(
        &mut self,
        pick_id: u64,
        prompt_tokens: Option<u64>,
        cached_tokens: Option<u64>,
        served: Option<WorkerId>,
        now_ms: u64,
    ) {
        let Some(call) = self.pending.remove(&pick_id) else {
            return;
        };
        let rate = if call.prefill_tokens_per_ms > 0.0 {
            call.prefill_tokens_per_ms
        } else {
            10.0
        };
        // The edge drops implausible usage before it gets here; the
        // absolute bounds are checked again so no driver can wrap a total.
        let plausible = crate::usage::check_usage(None, prompt_tokens, cached_tokens).is_ok();
        let usage = prompt_tokens.filter(|_| plausible).map(|prompt| {
            let prompt = prompt as f64;
            let cached = (cached_tokens.unwrap_or(0) as f64).min(prompt);
            (prompt, cached)
        });
        self.count(call.label, now_ms, |t| {
            t.outcomes += 1;
            if let Some((prompt, cached)) = usage {
                t.reported_calls += 1;
                t.reported_prompt_tokens += prompt;
                t.reported_cached_tokens += cached;
                t.written_tokens += prompt - cached;
                t.prefill_saved_ms += cached / rate;
                t.prefill_computed_ms += (prompt - cached) / rate;
            }
        });
        if let Some(trace) = self.traces.get_mut(&call.trace_key) {
            trace.in_flight = trace.in_flight.saturating_sub(1);
            // A retry that moved the call: the session's KV is where it ran.
            if served.is_some() && served != call.worker && trace.worker == call.worker {
                trace.worker = served;
            }
            if trace.in_flight == 0 {
                trace.idle_since_ms = Some(now_ms);
                trace.accrued_to_ms = now_ms;
            }
        }
    }

    /// Charges a session's idle KV memory up to `now_ms`.
    fn accrue_idle(&mut self, key: &str, now_ms: u64, holdings: &Holdings) {
        let kv_bytes_per_token = self.config.kv_bytes_per_token;
        let Some(trace) = self.traces.get_mut(key) else { return };
        let Some(cost) = idle_cost(trace, now_ms, kv_bytes_per_token, holdings) else {
            return;
        };
        let label = trace.label;
        self.count(label, now_ms, |t| t.idle_kv_byte_ms += cost);
    }

    /// Charges every idle session's KV memory up to `now_ms`, ends sessions
    /// idle past the TTL, and refreshes the retention gauges. `holdings`
    /// answers [`Insights::idle_probes`]; a session that went idle after
    /// they were taken is charged at the next tick. The whole
    /// [`TickPass`] in one step: the sidecar takes it in steps instead.
    pub fn tick(&mut self, now_ms: u64, holdings: &Holdings) {
        let mut pass = self.tick_begin(now_ms);
        loop {
            let step = self.tick_step(&pass, usize::MAX);
            if self.tick_apply(&mut pass, step, holdings) {
                break;
            }
        }
    }

    /// Starts a tick taken in steps (see [`TickPass`]).
    pub fn tick_begin(&self, now_ms: u64) -> TickPass {
        TickPass {
            now_ms,
            after: 0,
            until: self.traces.stamp(),
            done: false,
            retention: [Retention::default(); Harness::ALL.len()],
            idle: std::collections::BinaryHeap::new(),
            idle_count: 0,
            evicted: Vec::new(),
        }
    }

    /// The next `n` sessions of `pass`, least recently seen first, and
    /// what the fleet must answer for them (each idle one's worker and last
    /// block): ask [`crate::Router::holdings`] with the ledger unlocked.
    pub fn tick_step(&self, pass: &TickPass, n: usize) -> TickStep {
        if pass.done {
            return TickStep::default();
        }
        let (keys, resume) = self.traces.keys_after(pass.after, pass.until, n.max(1));
        let probes = keys
            .iter()
            .filter_map(|k| self.traces.get(k))
            .filter(|t| t.idle_since_ms.is_some())
            .filter_map(probe_of)
            .collect();
        TickStep { keys, resume, probes }
    }

    /// Applies one step of `pass`: charges its idle sessions, ends the
    /// expired, adds the rest to the pass's gauges and idle lists. True
    /// once the pass is over; its gauges and lists are then the ledger's.
    pub fn tick_apply(&mut self, pass: &mut TickPass, step: TickStep, holdings: &Holdings) -> bool {
        if pass.done {
            return true;
        }
        let now_ms = pass.now_ms;
        let kv_bytes_per_token = self.config.kv_bytes_per_token;
        let ttl = self.config.session_ttl_ms;
        let mut charges: Vec<(LabelId, f64)> = Vec::new();
        let mut ended = Vec::new();
        for key in &step.keys {
            let Some(trace) = self.traces.get_mut(key) else {
                continue;
            };
            let expired = now_ms.saturating_sub(trace.last_seen_ms) > ttl;
            let until = if expired {
                trace.last_seen_ms.saturating_add(ttl).max(trace.accrued_to_ms)
            } else {
                now_ms
            };
            if let Some(cost) = idle_cost(trace, until, kv_bytes_per_token, holdings) {
                charges.push((trace.label, cost));
            }
            if expired {
                ended.push(key);
                continue;
            }
            let (Some(since), Some(worker)) = (trace.idle_since_ms, trace.worker) else {
                continue;
            };
            let held = held(trace, holdings);
            if held == Some(true) {
                let r = &mut pass.retention[trace.label.harness as usize];
                r.idle_sessions += 1;
                r.kv_bytes += trace.held_tokens * kv_bytes_per_token;
                r.recompute_ms += trace.held_tokens / trace.prefill_tokens_per_ms.max(0.1);
                r.max_idle_ms = r.max_idle_ms.max(now_ms.saturating_sub(since));
            }
            let kv_bytes = trace.held_tokens * kv_bytes_per_token;
            let idle = |session: String, model: String| IdleSession {
                session,
                model,
                harness: trace.label.harness.name(),
                worker,
                kv_bytes,
                idle_ms: now_ms.saturating_sub(since),
                recompute_ms: trace.held_tokens / trace.prefill_tokens_per_ms.max(0.1),
            };
            match held {
                Some(true) => {
                    pass.idle_count += 1;
                    // Only a session that may enter the list pays for its ids.
                    let worst = pass.idle.peek().map(|w| w.0.kv_bytes);
                    if pass.idle.len() < IDLE_LIST_MAX || worst.is_some_and(|w| kv_bytes >= w) {
                        let (session, model) = key.split_once('\u{0}').unwrap_or((key.as_str(), ""));
                        pass.idle.push(ByBytes(idle(session.to_owned(), model.to_owned())));
                        if pass.idle.len() > IDLE_LIST_MAX {
                            pass.idle.pop();
                        }
                    }
                }
                Some(false) if trace.held_tokens > 0.0 => {
                    let (session, model) = key.split_once('\u{0}').unwrap_or((key.as_str(), ""));
                    pass.evicted.push(idle(session.to_owned(), model.to_owned()));
                }
                _ => {}
            }
        }
        for (label, cost) in charges {
            self.count(label, now_ms, |t| t.idle_kv_byte_ms += cost);
        }
        for key in ended {
            if let Some(gone) = self.traces.remove(key) {
                self.uncount_trace(key, &gone);
            }
        }
        self.lanes.expire(now_ms, ttl);
        match step.resume {
            Some(resume) => {
                pass.after = resume;
                false
            }
            None => {
                pass.done = true;
                self.retention = pass.retention;
                let idle = std::mem::take(&mut pass.idle).into_sorted_vec();
                self.last_tick = Arc::new(TickSnapshot {
                    taken_ms: now_ms,
                    idle: idle.into_iter().map(|b| b.0).collect(),
                    idle_count: pass.idle_count,
                    evicted: std::mem::take(&mut pass.evicted),
                });
                true
            }
        }
    }

    /// The idle lists of the last finished tick.
    pub fn last_tick(&self) -> Arc<TickSnapshot> {
        Arc::clone(&self.last_tick)
    }

    /// Each idle session whose prefix its worker still holds, largest first:
    /// (session, model, harness, worker, KV bytes, idle ms, recompute ms).
    /// `holdings` answers [`Insights::idle_probes`].
    pub fn idle_sessions(&self, now_ms: u64, holdings: &Holdings) -> Vec<IdleSession> {
        self.idle_where(now_ms, holdings, true)
    }

    /// Each idle session whose worker no longer holds its prefix (evicted,
    /// or the worker is gone), largest first: what more KV would have kept.
    /// Sessions that held nothing are left out. `holdings` answers
    /// [`Insights::idle_probes`].
    pub fn evicted_idle_sessions(&self, now_ms: u64, holdings: &Holdings) -> Vec<IdleSession> {
        self.idle_where(now_ms, holdings, false)
    }

    fn idle_where(&self, now_ms: u64, holdings: &Holdings, holding: bool) -> Vec<IdleSession> {
        let mut idle: Vec<IdleSession> = self
            .traces
            .iter()
            .filter_map(|(key, t)| {
                let since = t.idle_since_ms?;
                let worker = t.worker?;
                if held(t, holdings) != Some(holding) || (!holding && t.held_tokens <= 0.0) {
                    return None;
                }
                let (session, model) = key.split_once('\u{0}').unwrap_or((key.as_str(), ""));
                Some(IdleSession {
                    session: session.to_owned(),
                    model: model.to_owned(),
                    harness: t.label.harness.name(),
                    worker,
                    kv_bytes: t.held_tokens * self.config.kv_bytes_per_token,
                    idle_ms: now_ms.saturating_sub(since),
                    recompute_ms: t.held_tokens / t.prefill_tokens_per_ms.max(0.1),
                })
            })
            .collect();
        idle.sort_by(|a, b| {
            b.kv_bytes
                .total_cmp(&a.kv_bytes)
                .then_with(|| a.session.cmp(&b.session))
        });
        idle
    }

    /// Cumulative totals per label.
    pub fn totals(&self) -> impl Iterator<Item = (LabelId, &Totals)> {
        self.totals.iter().map(|(l, t)| (*l, t))
    }

    /// Idle sessions per harness, as of the last [`Insights::tick`].
    pub fn retention(&self) -> impl Iterator<Item = (&'static str, Retention)> + '_ {
        Harness::ALL
            .iter()
            .map(|h| h.name())
            .zip(self.retention.iter().copied())
    }

    /// Break points seen since the start, most frequent first.
    pub fn break_points(&self) -> Vec<(BreakPoint, BreakStats)> {
        let mut points: Vec<_> = self.breaks.iter().map(|(p, s)| (*p, *s)).collect();
        points.sort_by(|a, b| b.1.count.cmp(&a.1.count).then(a.0.cmp(&b.0)));
        points
    }

    /// The ledger's session-keyed tables (see `crate::tests::Footprint`).
    #[cfg(test)]
    pub(crate) fn footprints(&self) -> crate::tests::Footprints {
        let tenants = crate::tests::Footprint {
            len: self.tenant_ids.len(),
            table_bytes: self.tenant_ids.allocation_size(),
            queue_bytes: 0,
        };
        vec![
            ("ledger traces", self.traces.footprint()),
            ("ledger pending", self.pending.footprint()),
            ("ledger lane tallies", self.lanes.footprint()),
            ("ledger tenant_ids", tenants),
        ]
    }

    /// Sessions followed.
    pub fn sessions(&self) -> usize {
        self.traces.len()
    }

    /// `session`'s calls by lane and its latest harness, while it is
    /// followed.
    pub fn session_lanes(&self, session: &str) -> Option<SessionLanes> {
        self.lanes.get(session)
    }

    /// Sessions whose calls by lane are kept (at most `max_sessions`).
    pub fn lane_sessions(&self) -> usize {
        self.lanes.len()
    }

    /// The totals and break points of the last `window_ms`.
    pub fn report(&self, now_ms: u64, window_ms: u64) -> Report {
        let from = now_ms.saturating_sub(window_ms);
        let width = self.config.bucket_ms.max(1);
        let mut totals: HashMap<LabelId, Totals> = HashMap::new();
        let mut breaks: HashMap<BreakPoint, BreakStats> = HashMap::new();
        for bucket in self.buckets.iter().filter(|b| b.start_ms + width > from) {
            for (label, t) in &bucket.totals {
                totals.entry(*label).or_default().add(t);
            }
            for (point, s) in &bucket.breaks {
                breaks.entry(*point).and_modify(|b| b.merge(s)).or_insert(*s);
            }
        }
        let mut rows: Vec<(String, String, Totals)> = totals
            .into_iter()
            .map(|(label, t)| {
                (
                    label.harness.name().to_owned(),
                    self.tenant_name(label.tenant).to_owned(),
                    t,
                )
            })
            .collect();
        rows.sort_by(|a, b| {
            b.2.prompt_tokens
                .total_cmp(&a.2.prompt_tokens)
                .then_with(|| (&a.0, &a.1).cmp(&(&b.0, &b.1)))
        });
        let mut breakers: Vec<(String, BreakPoint, BreakStats)> = breaks
            .into_iter()
            .map(|(p, s)| (p.harness.name().to_owned(), p, s))
            .collect();
        breakers.sort_by(|a, b| b.2.count.cmp(&a.2.count).then(a.1.cmp(&b.1)));
        Report {
            window_ms,
            rows,
            breakers,
            retention: self.retention().map(|(h, r)| (h.to_owned(), r)).collect(),
        }
    }
}

/// What one trace costs: its key twice (map and order), its blocks and
/// sections, and the entry itself.
fn trace_bytes(key: &str, trace: &Trace) -> usize {
    2 * key.len()
        + trace.blocks.len() * std::mem::size_of::<u64>()
        + trace.sections.len() * std::mem::size_of::<PromptSection>()
        + std::mem::size_of::<Trace>()
}

/// The (worker, block) whose hold says the trace's prefix is still cached.
fn probe_of(trace: &Trace) -> Option<(WorkerId, u64)> {
    Some((trace.worker?, *trace.blocks.last()?))
}

/// Whether the trace's worker still holds its prefix: `None` when
/// `holdings` was taken without asking (then nothing is decided on it).
fn held(trace: &Trace, holdings: &Holdings) -> Option<bool> {
    match probe_of(trace) {
        Some((worker, last)) => holdings.holds(worker, last),
        None => Some(false),
    }
}

/// KV byte-milliseconds an idle session held since its last charge; moves
/// the charge mark to `until`.
fn idle_cost(trace: &mut Trace, until: u64, kv_bytes_per_token: f64, holdings: &Holdings) -> Option<f64> {
    trace.idle_since_ms?;
    let from = trace.accrued_to_ms;
    if until <= from {
        return None;
    }
    // Unknown (a session that went idle after the holdings were taken):
    // leave its charge mark, so the next look charges the whole stretch.
    let held = held(trace, holdings)?;
    trace.accrued_to_ms = until;
    // Evicted blocks cost nothing: the session's next call pays for them.
    held.then(|| trace.held_tokens * kv_bytes_per_token * (until - from) as f64)
}

fn common_prefix(a: &[u64], b: &[u64]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// The part of the prompt where the session's prefix broke: the first
/// section whose digest differs from the previous call's, else the section
/// holding the first differing block.
fn break_section(prev: &Trace, call: &Call<'_>, block: usize) -> (SectionKind, u32) {
    let changed = prev
        .sections
        .iter()
        .zip(call.sections)
        .find(|(a, b)| a != b)
        .map(|(_, b)| b);
    // Every part left matches, but parts are gone (a compacted history).
    let dropped = || {
        (call.sections.len() < prev.sections.len())
            .then(|| prev.sections.get(call.sections.len()))
            .flatten()
    };
    let by_block = || {
        let byte = (block as u64).saturating_mul(u64::from(call.input.block_bytes()));
        call.sections.iter().rev().find(|s| s.start <= byte)
    };
    changed
        .or_else(dropped)
        .or_else(by_block)
        .map_or((SectionKind::Other, 0), |s| (s.kind, s.index))
}

/// Every part of the previous call is unchanged but its last, which the
/// current call continues at the same place: a prompt string or a single
/// message that grows (a completions prompt, a text trace). Its closing
/// bytes move, so a block or two differ, but nothing before it changed.
fn grew_in_place(prev: &Trace, call: &Call<'_>) -> bool {
    let Some((last, earlier)) = prev.sections.split_last() else {
        return false;
    };
    call.sections.len() >= prev.sections.len()
        && call.sections[..earlier.len()] == *earlier
        && call
            .sections
            .get(earlier.len())
            .is_some_and(|s| (s.kind, s.index, s.start) == (last.kind, last.index, last.start))
}

fn record_break(breaks: &mut HashMap<BreakPoint, BreakStats>, point: BreakPoint, block: u64, limit: usize) {
    if !breaks.contains_key(&point) && breaks.len() >= limit {
        // Full: the rarest point makes room (a new one starts from its count,
        // as space-saving counters do, so a rising point can displace it).
        let Some((&rarest, &stats)) = breaks.iter().min_by_key(|(p, s)| (s.count, **p)) else {
            return;
        };
        breaks.remove(&rarest);
        let mut start = BreakStats::new(block);
        start.count = stats.count;
        breaks.insert(point, start);
    }
    breaks
        .entry(point)
        .or_insert_with(|| BreakStats::new(block))
        .see(block, 1);
}
