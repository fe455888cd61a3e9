//! What agents gain from the cache, as an operator reads it: per harness and
//! tenant, how much of each prompt repeats an earlier one, how much a worker
//! was predicted to hold, could have held (the best worker) and really held
//! (the engine's report), how often a session's next call reaches the same
//! worker and why not, where a session's prefix broke, and what keeping idle
//! sessions warm costs in KV memory against the prefill it saves.
//!
//! Pure like the router: time comes in as `now_ms`, the fleet is read
//! through [`FleetView`], and nothing here ever holds prompt text (sections
//! are kinds, positions and 32-bit digests).

use std::collections::VecDeque;

use hashbrown::HashMap;

use kvmesh_vocab::limits::MAX_PROMPT_TOKENS;

use crate::lru::Lru;
use crate::{PickInput, WorkerId};

/// The agent harnesses kvmesh tells apart; anything else is `other`. A
/// closed set, so that it can label metrics.
pub const HARNESSES: [&str; 5] = ["claude_code", "codex", "opencode", "openclaw", "other"];

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

/// Which part of a prompt a section is (mirrors the filter's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SectionKind {
    Tools,
    System,
    Message,
    Other,
}

impl SectionKind {
    pub const ALL: [Self; 4] = [Self::Tools, Self::System, Self::Message, Self::Other];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Tools => "tools",
            Self::System => "system",
            Self::Message => "message",
            Self::Other => "other",
        }
    }
}

/// One part of a request's canonical stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptSection {
    pub kind: SectionKind,
    pub index: u32,
    pub start: u64,
    pub digest: u32,
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

/// What the ledger reads of the fleet.
pub trait FleetView {
    /// The worker may take requests.
    fn pickable(&self, worker: WorkerId) -> bool;
    /// Leading blocks of the request just picked that the worker holds.
    fn overlap(&self, worker: WorkerId) -> usize;
    /// The worker still holds this block.
    fn holds(&self, worker: WorkerId, block: u64) -> bool;
}

/// One call, as the filter described it.
#[derive(Debug, Clone, Copy)]
pub struct Call<'a> {
    pub pick_id: u64,
    /// The request as the router saw it: session, model, blocks, sizes, time.
    pub input: PickInput<'a>,
    pub harness: &'a str,
    pub tenant: &'a str,
    pub sections: &'a [PromptSection],
    pub bytes_per_token: f64,
}

/// Where the router put it.
#[derive(Debug, Clone, Copy, Default)]
pub struct Placed {
    pub worker: Option<WorkerId>,
    /// Leading blocks the chosen worker holds.
    pub predicted_blocks: usize,
    /// Leading blocks the best worker holds.
    pub reachable_blocks: usize,
    /// The chosen worker's prefill throughput, tokens per ms.
    pub prefill_tokens_per_ms: f64,
}

/// Sums over calls; tokens are estimates from bytes unless named reported.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Totals {
    pub calls: u64,
    /// Canonical prompt bytes, and the leading ones that repeat an earlier
    /// call: the repeated-prefix share is their ratio (exact, whatever the
    /// tokenizer; tokens below are estimates from these bytes).
    pub prompt_bytes: u64,
    pub repeated_prefix_bytes: u64,
    /// Prompt tokens of every call (bytes ÷ the model's bytes per token).
    pub prompt_tokens: f64,
    /// Leading tokens an earlier call already sent: the session's previous
    /// call, or any call whose blocks a worker holds.
    pub repeated_prefix_tokens: f64,
    pub predicted_cached_tokens: f64,
    /// Cached on the best worker for the call: what routing could reach.
    pub reachable_cached_tokens: f64,
    /// Calls of a session that had a previous call on a known worker.
    pub continuing_calls: u64,
    pub same_worker_calls: u64,
    /// Continuing calls that moved, by [`MoveReason::ALL`] order.
    pub moves: [u64; MoveReason::ALL.len()],
    /// Continuing calls compared with their previous call's prefix.
    pub prefix_checks: u64,
    /// Those whose prefix broke, by [`SectionKind::ALL`] order.
    pub prefix_breaks: [u64; SectionKind::ALL.len()],
    pub outcomes: u64,
    /// Outcomes that reported usage.
    pub reported_calls: u64,
    pub reported_prompt_tokens: f64,
    /// Read from the cache.
    pub reported_cached_tokens: f64,
    /// Computed and written to the cache (prompt − cached).
    pub written_tokens: f64,
    /// GPU time the cached tokens saved, at the worker's prefill rate.
    pub prefill_saved_ms: f64,
    /// GPU time spent on the written tokens.
    pub prefill_computed_ms: f64,
    /// KV bytes held by idle sessions × the time they were idle.
    pub idle_kv_byte_ms: f64,
}

impl Totals {
    /// Adds another label's or bucket's sums to these.
    pub fn add(&mut self, other: &Totals) {
        self.calls += other.calls;
        self.prompt_bytes = self.prompt_bytes.saturating_add(other.prompt_bytes);
        self.repeated_prefix_bytes = self.repeated_prefix_bytes.saturating_add(other.repeated_prefix_bytes);
        self.prompt_tokens += other.prompt_tokens;
        self.repeated_prefix_tokens += other.repeated_prefix_tokens;
        self.predicted_cached_tokens += other.predicted_cached_tokens;
        self.reachable_cached_tokens += other.reachable_cached_tokens;
        self.continuing_calls += other.continuing_calls;
        self.same_worker_calls += other.same_worker_calls;
        for (a, b) in self.moves.iter_mut().zip(other.moves) {
            *a += b;
        }
        self.prefix_checks += other.prefix_checks;
        for (a, b) in self.prefix_breaks.iter_mut().zip(other.prefix_breaks) {
            *a += b;
        }
        self.outcomes += other.outcomes;
        self.reported_calls += other.reported_calls;
        self.reported_prompt_tokens += other.reported_prompt_tokens;
        self.reported_cached_tokens += other.reported_cached_tokens;
        self.written_tokens += other.written_tokens;
        self.prefill_saved_ms += other.prefill_saved_ms;
        self.prefill_computed_ms += other.prefill_computed_ms;
        self.idle_kv_byte_ms += other.idle_kv_byte_ms;
    }

    /// Share of the prompt that repeats an earlier prefix.
    pub fn repeated_prefix_share(&self) -> f64 {
        ratio(self.repeated_prefix_bytes as f64, self.prompt_bytes as f64)
    }

    /// Share of a session's continuing calls that reached the same worker.
    pub fn same_worker_rate(&self) -> f64 {
        ratio(self.same_worker_calls as f64, self.continuing_calls as f64)
    }

    /// Tokens read from the cache per token written to it.
    pub fn read_write_ratio(&self) -> f64 {
        ratio(self.reported_cached_tokens, self.written_tokens)
    }

    /// Moves by reason, named as in metric labels and reports.
    pub fn moves_by_reason(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        MoveReason::ALL.iter().map(|r| (r.as_str(), self.moves[*r as usize]))
    }

    /// Prefix breaks by the section where they broke, named likewise.
    pub fn breaks_by_section(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        SectionKind::ALL
            .iter()
            .map(|s| (s.as_str(), self.prefix_breaks[*s as usize]))
    }

    /// The headline figures by name, as the sidecar's report and the
    /// benchmark both print them, so a simulation and a live deployment
    /// read the same way.
    pub fn figures(&self) -> Vec<(&'static str, f64)> {
        vec![
            ("calls", self.calls as f64),
            ("prompt_bytes", self.prompt_bytes as f64),
            ("repeated_prefix_bytes", self.repeated_prefix_bytes as f64),
            ("repeated_prefix_share", self.repeated_prefix_share()),
            ("prompt_tokens", self.prompt_tokens.round()),
            ("predicted_cached_tokens", self.predicted_cached_tokens.round()),
            ("reachable_cached_tokens", self.reachable_cached_tokens.round()),
            ("reported_calls", self.reported_calls as f64),
            ("reported_prompt_tokens", self.reported_prompt_tokens),
            ("cache_read_tokens", self.reported_cached_tokens),
            ("cache_written_tokens", self.written_tokens),
            ("read_write_ratio", self.read_write_ratio()),
            ("continuing_calls", self.continuing_calls as f64),
            ("same_worker_calls", self.same_worker_calls as f64),
            ("same_worker_rate", self.same_worker_rate()),
            ("prefix_checks", self.prefix_checks as f64),
            ("gpu_seconds_saved", self.prefill_saved_ms / 1000.0),
            ("gpu_seconds_computed", self.prefill_computed_ms / 1000.0),
            ("idle_kv_byte_seconds", self.idle_kv_byte_ms / 1000.0),
        ]
    }
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 { a / b } else { 0.0 }
}

/// Index of a (harness, tenant) label pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LabelId {
    pub harness: u8,
    pub tenant: u16,
}

/// Where prefixes break: no prompt text, only positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BreakPoint {
    pub harness: u8,
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
    traces: HashMap<String, Trace>,
    trace_order: Lru<String>,
    /// What `traces` holds, as `trace_bytes` counts it.
    trace_bytes: usize,
    pending: HashMap<u64, PendingCall>,
    pending_order: Lru<u64>,
    buckets: VecDeque<Bucket>,
    retention: [Retention; HARNESSES.len()],
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
            trace_order: Lru::new(config.max_sessions.max(1)),
            pending_order: Lru::new(config.max_pending.max(1)),
            tenants: vec![NO_TENANT.to_owned(), OTHER_TENANT.to_owned()],
            tenant_ids: HashMap::new(),
            totals: HashMap::new(),
            breaks: HashMap::new(),
            traces: HashMap::new(),
            trace_bytes: 0,
            pending: HashMap::new(),
            buckets: VecDeque::new(),
            retention: [Retention::default(); HARNESSES.len()],
            config,
        }
    }

    pub fn config(&self) -> &InsightConfig {
        &self.config
    }

    /// The harness label of a name from the wire.
    pub fn harness_id(name: &str) -> u8 {
        HARNESSES.iter().position(|h| *h == name).unwrap_or(HARNESSES.len() - 1) as u8
    }

    pub fn harness_name(id: u8) -> &'static str {
        HARNESSES.get(usize::from(id)).copied().unwrap_or("other")
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

    /// Records a picked call.
    pub fn on_pick(&mut self, call: &Call<'_>, placed: &Placed, fleet: &impl FleetView) {
        let label = LabelId {
            harness: Self::harness_id(call.harness),
            tenant: self.tenant_id(call.tenant),
        };
        let bytes_per_token = if call.bytes_per_token > 0.0 {
            call.bytes_per_token
        } else {
            4.0
        };
        let block_tokens = f64::from(call.input.block_bytes()) / bytes_per_token;
        let prompt_tokens = (call.input.prompt_bytes as f64 / bytes_per_token).min(MAX_PROMPT_TOKENS as f64);
        let tokens = |blocks: usize| (blocks as f64 * block_tokens).min(prompt_tokens);
        let key = trace_key(call.input.routing_key(), call.input.model);
        let now = call.input.now_ms;

        // The previous call of this session, if any.
        let previous = if call.input.routing_key().is_empty() {
            None
        } else {
            self.accrue_idle(&key, now, fleet);
            self.traces.get(&key)
        };
        let common = previous.map_or(0, |p| common_prefix(&p.blocks, call.input.full_blocks()));
        let mut moved = None;
        let mut same = false;
        let mut broke = None;
        if let Some(prev) = previous {
            if let (Some(old), Some(new)) = (prev.worker, placed.worker) {
                same = old == new;
                if !same {
                    let reason = if !fleet.pickable(old) {
                        MoveReason::WorkerGone
                    } else if common == 0 {
                        MoveReason::PrefixChange
                    } else if fleet.overlap(old) < common {
                        MoveReason::Eviction
                    } else if placed.predicted_blocks < fleet.overlap(old) {
                        MoveReason::Load
                    } else {
                        MoveReason::Other
                    };
                    moved = Some(reason);
                }
            }
            if !prev.blocks.is_empty() && common < prev.blocks.len() && !grew_in_place(prev, call) {
                broke = Some((common, break_section(prev, call, common)));
            }
        }
        let continuing = previous.is_some_and(|p| p.worker.is_some()) && placed.worker.is_some();
        let checked = previous.is_some_and(|p| !p.blocks.is_empty());
        let repeated = common.max(placed.reachable_blocks);
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
            t.predicted_cached_tokens += tokens(placed.predicted_blocks);
            t.reachable_cached_tokens += tokens(placed.reachable_blocks);
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

        // Its outcome is counted whether or not it belongs to a session.
        if self.pending.len() >= self.pending_order.capacity()
            && let Some(oldest) = self.pending_order.pop_oldest()
        {
            self.pending.remove(&oldest);
        }
        self.pending_order.touch(call.pick_id);
        self.pending.insert(
            call.pick_id,
            PendingCall {
                label,
                trace_key: key.clone(),
                prefill_tokens_per_ms: placed.prefill_tokens_per_ms,
                worker: placed.worker,
            },
        );
        if call.input.routing_key().is_empty() {
            return;
        }
        // This call is now the session's trace.
        let trace = Trace {
            label,
            worker: placed.worker,
            blocks: call.input.full_blocks().to_vec(),
            sections: call.sections.to_vec(),
            held_tokens: tokens(call.input.full_blocks().len()),
            prefill_tokens_per_ms: placed.prefill_tokens_per_ms,
            in_flight: self.traces.get(&key).map_or(0, |t| t.in_flight).saturating_add(1),
            idle_since_ms: None,
            accrued_to_ms: now,
            last_seen_ms: now,
        };
        if !self.traces.contains_key(&key)
            && self.traces.len() >= self.trace_order.capacity()
            && let Some(oldest) = self.trace_order.pop_oldest()
        {
            self.forget_trace(&oldest);
        }
        self.trace_order.touch(key.clone());
        self.trace_bytes += trace_bytes(&key, &trace);
        if let Some(old) = self.traces.insert(key.clone(), trace) {
            self.trace_bytes = self.trace_bytes.saturating_sub(trace_bytes(&key, &old));
        }
        // The newest trace is popped last: alone it is far under the budget.
        while self.trace_bytes > self.config.trace_budget_bytes
            && let Some(oldest) = self.trace_order.pop_oldest()
        {
            self.forget_trace(&oldest);
        }
    }

    /// Drops a trace (its key is already out of `trace_order`).
    fn forget_trace(&mut self, key: &str) {
        if let Some(old) = self.traces.remove(key) {
            self.trace_bytes = self.trace_bytes.saturating_sub(trace_bytes(key, &old));
        }
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
        self.pending_order.remove(&pick_id);
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
    fn accrue_idle(&mut self, key: &str, now_ms: u64, fleet: &impl FleetView) {
        let kv_bytes_per_token = self.config.kv_bytes_per_token;
        let Some(trace) = self.traces.get_mut(key) else { return };
        let Some(cost) = idle_cost(trace, now_ms, kv_bytes_per_token, fleet) else {
            return;
        };
        let label = trace.label;
        self.count(label, now_ms, |t| t.idle_kv_byte_ms += cost);
    }

    /// Charges every idle session's KV memory up to `now_ms`, ends sessions
    /// idle past the TTL, and refreshes the retention gauges.
    pub fn tick(&mut self, now_ms: u64, fleet: &impl FleetView) {
        let kv_bytes_per_token = self.config.kv_bytes_per_token;
        let ttl = self.config.session_ttl_ms;
        let mut retention = [Retention::default(); HARNESSES.len()];
        let mut charges: Vec<(LabelId, f64)> = Vec::new();
        let mut ended = Vec::new();
        for (key, trace) in &mut self.traces {
            let expired = now_ms.saturating_sub(trace.last_seen_ms) > ttl;
            let until = if expired {
                trace.last_seen_ms.saturating_add(ttl).max(trace.accrued_to_ms)
            } else {
                now_ms
            };
            if let Some(cost) = idle_cost(trace, until, kv_bytes_per_token, fleet) {
                charges.push((trace.label, cost));
            }
            if expired {
                ended.push(key.clone());
                continue;
            }
            if let Some(since) = trace.idle_since_ms
                && held(trace, fleet)
            {
                let r = &mut retention[usize::from(trace.label.harness).min(HARNESSES.len() - 1)];
                r.idle_sessions += 1;
                r.kv_bytes += trace.held_tokens * kv_bytes_per_token;
                r.recompute_ms += trace.held_tokens / trace.prefill_tokens_per_ms.max(0.1);
                r.max_idle_ms = r.max_idle_ms.max(now_ms.saturating_sub(since));
            }
        }
        for (label, cost) in charges {
            self.count(label, now_ms, |t| t.idle_kv_byte_ms += cost);
        }
        for key in ended {
            self.forget_trace(&key);
            self.trace_order.remove(&key);
        }
        self.retention = retention;
    }

    /// Each idle session whose prefix its worker still holds, largest first:
    /// (session, model, harness, worker, KV bytes, idle ms, recompute ms).
    pub fn idle_sessions(&self, now_ms: u64, fleet: &impl FleetView) -> Vec<IdleSession> {
        let mut idle: Vec<IdleSession> = self
            .traces
            .iter()
            .filter_map(|(key, t)| {
                let since = t.idle_since_ms?;
                let worker = t.worker?;
                if !held(t, fleet) {
                    return None;
                }
                let (session, model) = key.split_once('\u{0}').unwrap_or((key.as_str(), ""));
                Some(IdleSession {
                    session: session.to_owned(),
                    model: model.to_owned(),
                    harness: Self::harness_name(t.label.harness),
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
        HARNESSES.iter().copied().zip(self.retention.iter().copied())
    }

    /// Break points seen since the start, most frequent first.
    pub fn break_points(&self) -> Vec<(BreakPoint, BreakStats)> {
        let mut points: Vec<_> = self.breaks.iter().map(|(p, s)| (*p, *s)).collect();
        points.sort_by(|a, b| b.1.count.cmp(&a.1.count).then(a.0.cmp(&b.0)));
        points
    }

    /// Sessions followed.
    pub fn sessions(&self) -> usize {
        self.traces.len()
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
                    Self::harness_name(label.harness).to_owned(),
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
            .map(|(p, s)| (Self::harness_name(p.harness).to_owned(), p, s))
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

fn held(trace: &Trace, fleet: &impl FleetView) -> bool {
    match (trace.worker, trace.blocks.last()) {
        (Some(worker), Some(&last)) => fleet.pickable(worker) && fleet.holds(worker, last),
        _ => false,
    }
}

/// KV byte-milliseconds an idle session held since its last charge; moves
/// the charge mark to `until`.
fn idle_cost(trace: &mut Trace, until: u64, kv_bytes_per_token: f64, fleet: &impl FleetView) -> Option<f64> {
    trace.idle_since_ms?;
    let from = trace.accrued_to_ms;
    if until <= from {
        return None;
    }
    trace.accrued_to_ms = until;
    // Evicted blocks cost nothing: the session's next call pays for them.
    held(trace, fleet).then(|| trace.held_tokens * kv_bytes_per_token * (until - from) as f64)
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::float_cmp)]

    use super::*;

    /// A fleet as a test states it.
    #[derive(Default)]
    struct Fleet {
        gone: Vec<WorkerId>,
        overlaps: Vec<usize>,
        evicted: bool,
    }

    impl FleetView for Fleet {
        fn pickable(&self, worker: WorkerId) -> bool {
            !self.gone.contains(&worker)
        }
        fn overlap(&self, worker: WorkerId) -> usize {
            self.overlaps.get(worker.0).copied().unwrap_or(0)
        }
        fn holds(&self, _: WorkerId, _: u64) -> bool {
            !self.evicted
        }
    }

    fn section(kind: SectionKind, index: u32, start: u64, digest: u32) -> PromptSection {
        PromptSection {
            kind,
            index,
            start,
            digest,
        }
    }

    /// 100-byte blocks at 4 bytes per token: 25 tokens a block.
    fn call<'a>(
        pick_id: u64,
        key: &'a str,
        harness: &'a str,
        blocks: &'a [u64],
        sections: &'a [PromptSection],
        prompt_bytes: u64,
        now_ms: u64,
    ) -> Call<'a> {
        Call {
            pick_id,
            input: PickInput {
                block_hashes: blocks,
                block_bytes: 100,
                prompt_bytes,
                session_id: key,
                model: "m",
                now_ms,
                ..PickInput::default()
            },
            harness,
            tenant: harness,
            sections,
            bytes_per_token: 4.0,
        }
    }

    fn placed(worker: usize, predicted: usize, reachable: usize) -> Placed {
        Placed {
            worker: Some(WorkerId(worker)),
            predicted_blocks: predicted,
            reachable_blocks: reachable,
            prefill_tokens_per_ms: 10.0,
        }
    }

    fn totals_of(insights: &Insights, harness: &str) -> Totals {
        let id = Insights::harness_id(harness);
        insights
            .totals()
            .filter(|(l, _)| l.harness == id)
            .fold(Totals::default(), |mut acc, (_, t)| {
                acc.add(t);
                acc
            })
    }

    #[test]
    fn a_scripted_workload_gives_the_hand_computed_figures() {
        let config = InsightConfig {
            kv_bytes_per_token: 1000.0,
            ..InsightConfig::default()
        };
        let mut insights = Insights::new(config);
        let fleet = Fleet::default();
        let s1 = [
            section(SectionKind::Tools, 0, 0, 1),
            section(SectionKind::System, 0, 200, 2),
            section(SectionKind::Message, 1, 300, 3),
        ];
        let mut s2 = s1.to_vec();
        s2.push(section(SectionKind::Message, 2, 450, 4));

        // Clean appends: 450 then 650 bytes (112.5 + 162.5 tokens).
        insights.on_pick(
            &call(1, "a", "claude_code", &[1, 2, 3, 4], &s1, 450, 0),
            &placed(0, 0, 0),
            &fleet,
        );
        insights.on_outcome(1, Some(110), Some(0), Some(WorkerId(0)), 1_000);
        let next = [1, 2, 3, 4, 5, 6];
        insights.on_pick(
            &call(2, "a", "claude_code", &next, &s2, 650, 5_000),
            &placed(0, 4, 4),
            &fleet,
        );
        insights.on_outcome(2, Some(160), Some(100), Some(WorkerId(0)), 10_000);

        let t = totals_of(&insights, "claude_code");
        assert_eq!(t.calls, 2);
        assert_eq!(t.prompt_tokens, 275.0);
        // The second call repeats 4 blocks of 25 tokens.
        assert_eq!(t.repeated_prefix_tokens, 100.0);
        assert_eq!((t.prompt_bytes, t.repeated_prefix_bytes), (1100, 400));
        assert!((t.repeated_prefix_share() - 400.0 / 1100.0).abs() < 1e-12);
        assert_eq!((t.continuing_calls, t.same_worker_calls), (1, 1));
        assert_eq!(t.same_worker_rate(), 1.0);
        assert_eq!(t.prefix_checks, 1);
        assert_eq!(t.prefix_breaks, [0; 4]);
        // Read 100, written 110 + 60.
        assert_eq!(t.written_tokens, 170.0);
        assert!((t.read_write_ratio() - 100.0 / 170.0).abs() < 1e-12);
        // 100 cached tokens at 10 tokens/ms saved 10 ms of prefill.
        assert_eq!(t.prefill_saved_ms, 10.0);
        assert_eq!(t.prefill_computed_ms, 17.0);
        // Idle 1 s between the calls with 4 blocks (100 tokens × 1000 B).
        assert_eq!(t.idle_kv_byte_ms, 100.0 * 1000.0 * 4_000.0);

        // Idle for a minute after the second call: 150 tokens held.
        insights.tick(70_000, &fleet);
        let t = totals_of(&insights, "claude_code");
        assert_eq!(t.idle_kv_byte_ms, 100.0 * 1000.0 * 4_000.0 + 150.0 * 1000.0 * 60_000.0);
        let idle = insights.idle_sessions(70_000, &fleet);
        assert_eq!(idle.len(), 1);
        assert_eq!((idle[0].session.as_str(), idle[0].model.as_str()), ("a", "m"));
        assert_eq!(
            (idle[0].kv_bytes, idle[0].idle_ms, idle[0].recompute_ms),
            (150_000.0, 60_000, 15.0)
        );
        let (_, r) = insights.retention().next().unwrap();
        assert_eq!(r.idle_sessions, 1);
        assert_eq!(r.kv_bytes, 150_000.0);
        assert_eq!(r.recompute_ms, 15.0);
        assert_eq!(r.max_idle_ms, 60_000);
        assert!(insights.break_points().is_empty());
    }

    #[test]
    fn a_timestamp_in_the_system_prompt_is_named_as_the_breaker() {
        let mut insights = Insights::new(InsightConfig::default());
        let fleet = Fleet::default();
        let sections = |system_digest| {
            [
                section(SectionKind::Tools, 0, 0, 1),
                section(SectionKind::System, 0, 200, system_digest),
                section(SectionKind::Message, 1, 300, 3),
            ]
        };
        let first = sections(10);
        insights.on_pick(
            &call(1, "b", "openclaw", &[1, 2, 3, 4], &first, 450, 0),
            &placed(1, 0, 0),
            &fleet,
        );
        let second = sections(11);
        insights.on_pick(
            &call(2, "b", "openclaw", &[1, 2, 7, 8], &second, 450, 10),
            &placed(1, 2, 2),
            &fleet,
        );
        let points = insights.break_points();
        assert_eq!(points.len(), 1);
        let (point, stats) = points[0];
        assert_eq!((point.kind, point.index), (SectionKind::System, 0));
        assert_eq!(Insights::harness_name(point.harness), "openclaw");
        assert_eq!((stats.count, stats.first_block_min), (1, 2));
        let t = totals_of(&insights, "openclaw");
        assert_eq!(t.prefix_breaks[SectionKind::System as usize], 1);
        // The two shared blocks still count as a repeated prefix.
        assert_eq!(t.repeated_prefix_tokens, 50.0);

        // A compacted history drops message 1: the break is named there.
        let compacted = &second[..2];
        insights.on_pick(
            &call(3, "b", "openclaw", &[1, 2, 7], compacted, 300, 20),
            &placed(1, 2, 2),
            &fleet,
        );
        assert!(
            insights
                .break_points()
                .iter()
                .any(|(p, _)| (p.kind, p.index) == (SectionKind::Message, 1))
        );
    }

    #[test]
    fn a_last_part_that_grows_in_place_is_no_break() {
        let mut insights = Insights::new(InsightConfig::default());
        let fleet = Fleet::default();
        let prompt = |digest| [section(SectionKind::Message, 0, 0, digest)];
        // A completions prompt that grows: its closing quote moves, so the
        // last full block of the first call differs in the second.
        insights.on_pick(
            &call(1, "p", "other", &[1, 2, 3], &prompt(1), 350, 0),
            &placed(0, 0, 0),
            &fleet,
        );
        insights.on_pick(
            &call(2, "p", "other", &[1, 2, 9, 10], &prompt(2), 450, 1),
            &placed(0, 2, 2),
            &fleet,
        );
        assert!(insights.break_points().is_empty());
        // Changing an earlier part is a break even if the last one grows.
        let two = |a, b| {
            [
                section(SectionKind::System, 0, 0, a),
                section(SectionKind::Message, 1, 100, b),
            ]
        };
        insights.on_pick(
            &call(3, "q", "other", &[1, 2, 3], &two(1, 1), 350, 2),
            &placed(0, 0, 0),
            &fleet,
        );
        insights.on_pick(
            &call(4, "q", "other", &[5, 6, 7, 8], &two(2, 2), 450, 3),
            &placed(0, 0, 0),
            &fleet,
        );
        assert_eq!(insights.break_points().len(), 1);
        assert_eq!(insights.break_points()[0].0.kind, SectionKind::System);
    }

    #[test]
    fn a_move_says_why() {
        let mut insights = Insights::new(InsightConfig::default());
        let blocks = [1, 2, 3, 4];
        let s = [section(SectionKind::Message, 0, 0, 1)];
        let mut fleet = Fleet::default();
        let mut id = 0;
        let mut pick = |insights: &mut Insights, worker, predicted, fleet: &Fleet, blocks: &[u64]| {
            id += 1;
            insights.on_pick(
                &call(id, "c", "codex", blocks, &s, 400, id),
                &placed(worker, predicted, 4),
                fleet,
            );
        };
        pick(&mut insights, 0, 0, &fleet, &blocks);
        // Worker 0 holds all 4 blocks but the call went to 1 with none: load.
        fleet.overlaps = vec![4, 0];
        pick(&mut insights, 1, 0, &fleet, &blocks);
        // Back to 0, which lost two of the blocks: eviction.
        fleet.overlaps = vec![0, 2];
        pick(&mut insights, 0, 0, &fleet, &blocks);
        // Worker 0 is gone.
        fleet.gone = vec![WorkerId(0)];
        pick(&mut insights, 1, 4, &fleet, &blocks);
        // A new first block: nothing to stick for.
        fleet.gone.clear();
        pick(&mut insights, 0, 0, &fleet, &[9, 2, 3, 4]);
        let t = totals_of(&insights, "codex");
        assert_eq!(t.continuing_calls, 4);
        assert_eq!(t.same_worker_calls, 0);
        assert_eq!(
            t.moves,
            [1, 1, 1, 1, 0],
            "worker_gone, prefix_change, eviction, load, other"
        );
    }

    #[test]
    fn tenants_past_the_label_budget_share_one_label() {
        let config = InsightConfig {
            tenant_labels: 2,
            ..InsightConfig::default()
        };
        let mut insights = Insights::new(config);
        let fleet = Fleet::default();
        for (i, tenant) in ["t1", "t2", "t3", "t4", ""].iter().enumerate() {
            let mut c = call(i as u64, "", "other", &[1], &[], 100, 0);
            c.tenant = tenant;
            insights.on_pick(&c, &placed(0, 0, 0), &fleet);
        }
        let mut names: Vec<&str> = insights.totals().map(|(l, _)| insights.tenant_name(l.tenant)).collect();
        names.sort_unstable();
        assert_eq!(names, ["none", "other", "t1", "t2"]);
        let report = insights.report(0, 60_000);
        assert_eq!(report.rows.iter().map(|r| r.2.calls).sum::<u64>(), 5);
        // Calls without a session still count their usage.
        insights.on_outcome(4, Some(100), Some(40), Some(WorkerId(0)), 1);
        let report = insights.report(1, 60_000);
        let none = report.rows.iter().find(|r| r.1 == "none").unwrap();
        assert_eq!((none.2.reported_cached_tokens, none.2.written_tokens), (40.0, 60.0));
    }

    #[test]
    fn the_report_covers_only_its_window() {
        let mut insights = Insights::new(InsightConfig::default());
        let fleet = Fleet::default();
        insights.on_pick(&call(1, "a", "codex", &[1], &[], 100, 0), &placed(0, 0, 0), &fleet);
        insights.on_pick(
            &call(2, "b", "codex", &[2], &[], 100, 600_000),
            &placed(0, 0, 0),
            &fleet,
        );
        let calls = |window| {
            insights
                .report(600_000, window)
                .rows
                .iter()
                .map(|r| r.2.calls)
                .sum::<u64>()
        };
        assert_eq!(calls(60_000), 1);
        assert_eq!(calls(3_600_000), 2);
    }
}
