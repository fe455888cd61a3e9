//! Dynamo's KV router (ai-dynamo/dynamo), as three configurations:
//! `dynamo`, its defaults with KV events; `dynamo_sticky`, the same with
//! session affinity alone (`--router-session-affinity-ttl-secs 600`, hard
//! mode: the real Dynamo arm of `kvmesh-bench compare`); and
//! `dynamo_agents`, that and the agent fan-out setting of its tuning guide
//! (predict-on-route), with `prefill_load_scale` swept as
//! `dynamo_agents@S`. Affinity binds a parent's children together (sibling
//! grouping, `binding_id`); a child is not placed on its parent's worker
//! (that was PR #12073, closed unmerged). Soft mode differs from hard only
//! when a busy threshold marks the bound worker ineligible, and every busy
//! threshold is off by default, so hard stands for both (1.6.1's
//! `select_worker_for_request` in `lib/kv-router/src/scheduling/queue.rs`,
//! `routing_host/kv.rs`).
//!
//! Read at these commits of ai-dynamo/dynamo:
//! - cost: `lib/kv-router/src/scheduling/selector.rs` (01690d42)
//!   `DefaultWorkerSelector::worker_logit` and `select_worker`;
//! - defaults: `lib/kv-router/src/scheduling/config.rs` (0243c51b)
//!   `KvRouterConfig::default`: `overlap_score_credit` 1.0,
//!   `overlap_score_credit_decay` 0, `prefill_load_scale` 1.0,
//!   `decode_active_request_weight` 0, `router_temperature` 0,
//!   `router_assume_kv_reuse` true, `router_track_output_blocks` false,
//!   `router_track_prefill_tokens` true;
//! - active blocks: `lib/kv-router/src/sequences/single.rs` (04df1c42)
//!   `ActiveSequences` (reference-counted unique blocks, prompt load held
//!   until the first token), and `sequences/multi_worker.rs`'s test
//!   `potential_blocks_use_prefix_membership_not_set_membership`;
//! - sessions: `docs/components/router/router-configuration.md` (057096c3)
//!   "Session Affinity", `docs/agents/session-ids.md` (1cd9f3c2), the
//!   `router_predicted_ttl_secs` field of `config.rs` (0243c51b); the 1.6.1
//!   release (0d9c24a8): `lib/kv-router/src/services/selection/affinity.rs`
//!   (the lease and idle deadline), `lib/llm/src/session_affinity/mod.rs`
//!   `subagent_group_affinity_id`.

use std::collections::HashMap;

use super::running::RunningBlocks;
use super::{Policy, Rng, argmin_random_ties, engine_blocks};
use crate::simulate::world::{Prepared, View};

/// `--router-session-affinity-ttl-secs 600`, the agentic guide's value.
const SESSION_AFFINITY_TTL_MS: f64 = 600_000.0;
/// `--router-predicted-ttl-secs 5`, the tuning guide's value for agent
/// fan-out.
const PREDICTED_TTL_MS: f64 = 5_000.0;
/// How often the predicted side index drops expired entries, in picks:
/// lookups already ignore them, this only bounds memory.
const PRUNE_EVERY: usize = 256;

/// One worker's load as `WorkerLoadProjection` has it.
#[derive(Debug, Clone, Copy, Default)]
struct Load {
    /// Uncached prompt tokens of requests still before their first token.
    active_prefill_tokens: f64,
    /// Unique blocks of the running requests.
    active_decode_blocks: usize,
    /// This request's blocks not already held there (by prefix).
    additional_active_blocks: usize,
}

/// `worker_logit` at the defaults (credit 1, no decay, no host or disk tier,
/// no active-request weight): the prefill side is the worker's prompt
/// backlog plus this request, less its device overlap, scaled; the decode
/// side is the blocks the worker would hold with this request admitted.
fn worker_logit(
    prefill_load_scale: f64,
    block_tokens: u64,
    isl_tokens: u64,
    overlap_blocks: u64,
    cached_tokens: u64,
    load: &Load,
) -> f64 {
    let block = block_tokens as f64;
    // Upstream's operation order: backlog + uncached + cached, so an
    // overlap past the prompt (a stale prediction) is not double counted.
    let raw_prefill_tokens =
        load.active_prefill_tokens + isl_tokens.saturating_sub(cached_tokens) as f64 + cached_tokens as f64;
    let adjusted_prefill_blocks = (raw_prefill_tokens / block - overlap_blocks as f64).max(0.0);
    let decode_blocks = (load.active_decode_blocks + load.additional_active_blocks) as f64;
    prefill_load_scale * adjusted_prefill_blocks + decode_blocks
}

/// A session's binding to a worker: a lease held while its requests run,
/// then an idle timer.
#[derive(Debug, Clone, Copy)]
struct Binding {
    worker: usize,
    active: usize,
    /// When the binding expires once idle (`f64::INFINITY` while leased).
    idle_deadline: f64,
}

impl Binding {
    fn live(&self, now: f64) -> bool {
        self.active > 0 || now < self.idle_deadline
    }
}

/// What `dynamo_agents` adds to the defaults.
#[derive(Debug, Default)]
struct Agents {
    bindings: HashMap<String, Binding>,
    /// Request index → the session whose lease it holds.
    leases: HashMap<usize, String>,
    /// Sessions whose last lease ended since the last pick: the simulator
    /// reports completions just before the next arrival, so the idle timer
    /// starts then (at most one inter-arrival gap late, against 600 s).
    idle: Vec<String>,
    /// The predict-on-route side index, per worker: block → expiry (none:
    /// not predicting).
    predicted: Vec<HashMap<u64, f64>>,
    picks: usize,
}

/// The id a request's binding is kept under (`RoutingHost::group_binding_id`
/// in `lib/llm/src/kv_router/routing_host.rs`, 1.6.1 at 0d9c24a8, from PR
/// #14521): its session's, or, for a request that names a parent, one key
/// shared by every child of that parent (`subagent_group_affinity_id`, a
/// hash of the parent id), so siblings go together and the first of them
/// to dispatch sets the worker; the parent keeps its own binding. It is on
/// whenever affinity is, with no flag.
fn binding_id(r: &Prepared) -> Option<String> {
    if r.session.is_empty() {
        return None;
    }
    if !r.parent.is_empty() && r.parent != r.session {
        return Some(format!("\u{1}sg:{}", r.parent));
    }
    Some(r.session.clone())
}

impl Agents {
    fn observe(&mut self, now: f64) {
        for session in self.idle.drain(..) {
            if let Some(b) = self.bindings.get_mut(&session)
                && b.active == 0
            {
                b.idle_deadline = now + SESSION_AFFINITY_TTL_MS;
            }
        }
        self.picks += 1;
        if self.picks.is_multiple_of(PRUNE_EVERY) {
            for side in &mut self.predicted {
                side.retain(|_, expiry| *expiry > now);
            }
            self.bindings.retain(|_, b| b.live(now));
        }
    }

    /// The worker a live binding sends `r` to (hard mode: exactly there).
    fn bound(&self, r: &Prepared, now: f64) -> Option<usize> {
        let id = binding_id(r)?;
        self.bindings.get(&id).filter(|b| b.live(now)).map(|b| b.worker)
    }

    /// Blocks of `blocks`, from the first, predicted cached on `worker`.
    fn predicted_overlap(&self, worker: usize, blocks: &[u64], now: f64) -> usize {
        self.predicted.get(worker).map_or(0, |side| {
            blocks
                .iter()
                .take_while(|b| side.get(b).is_some_and(|&expiry| expiry > now))
                .count()
        })
    }

    fn dispatch(&mut self, r: &Prepared, worker: usize, blocks: &[u64], now: f64) {
        if let Some(side) = self.predicted.get_mut(worker) {
            for &b in blocks {
                side.insert(b, now + PREDICTED_TTL_MS);
            }
        }
        let Some(id) = binding_id(r) else {
            return;
        };
        let binding = self.bindings.entry(id.clone()).or_insert(Binding {
            worker,
            active: 0,
            idle_deadline: f64::INFINITY,
        });
        if !binding.live(now) || binding.worker != worker {
            // An expired binding is replaced by this dispatch's.
            *binding = Binding {
                worker,
                active: 0,
                idle_deadline: f64::INFINITY,
            };
        }
        binding.active += 1;
        binding.idle_deadline = f64::INFINITY;
        self.leases.insert(r.index, id);
    }

    fn lease_ended(&mut self, index: usize) {
        let Some(session) = self.leases.remove(&index) else {
            return;
        };
        if let Some(b) = self.bindings.get_mut(&session) {
            b.active = b.active.saturating_sub(1);
            if b.active == 0 {
                self.idle.push(session);
            }
        }
    }
}

/// Dynamo's KV router: the cost of each worker from its true cache (KV
/// events; the simulator delivers them at once) and its `ActiveSequences`,
/// the cheapest taken, ties at random (`router_temperature` 0).
pub(crate) struct Dynamo {
    prefill_load_scale: f64,
    running: RunningBlocks,
    rng: Rng,
    agents: Option<Agents>,
    /// `--active-decode-blocks-threshold`: a worker whose blocks in use
    /// (its running requests', or the engine's reported KV usage, whichever
    /// is more) exceed this share of its KV is busy, and out of the
    /// selection; set, it makes affinity soft (`--router-session-affinity-mode
    /// soft`): a session bound to a busy worker is placed by cost among the
    /// others and rebound there. `None`: off, the default.
    busy_threshold: Option<f64>,
}

impl Dynamo {
    /// `--router-mode kv` with every default.
    pub(crate) fn new(workers: usize, seed: u64) -> Self {
        Self {
            prefill_load_scale: 1.0,
            running: RunningBlocks::new(workers),
            rng: Rng::new(seed),
            agents: None,
            busy_threshold: None,
        }
    }

    /// `--router-mode kv --router-session-affinity-ttl-secs 600
    /// --router-predicted-ttl-secs 5 --router-prefill-load-scale S`.
    pub(crate) fn agents(workers: usize, prefill_load_scale: f64, seed: u64) -> Self {
        Self {
            prefill_load_scale,
            agents: Some(Agents {
                predicted: vec![HashMap::new(); workers],
                ..Agents::default()
            }),
            ..Self::new(workers, seed)
        }
    }

    /// `--router-mode kv --router-session-affinity-ttl-secs 600`: a session
    /// (a parent's children together) is bound where its first call went;
    /// no prediction.
    pub(crate) fn sticky(workers: usize, seed: u64) -> Self {
        Self {
            agents: Some(Agents::default()),
            ..Self::new(workers, seed)
        }
    }

    /// `sticky` in soft mode with `--active-decode-blocks-threshold T`
    /// (`lib/llm/src/discovery/worker_monitor.rs` `is_overloaded`; the
    /// request-rejection docs' example is 0.85). Upstream the busy latch
    /// clears only once both signals are back below the threshold; the port
    /// reads them afresh at each pick.
    pub(crate) fn soft(workers: usize, threshold: f64, seed: u64) -> Self {
        Self {
            busy_threshold: Some(threshold),
            ..Self::sticky(workers, seed)
        }
    }

    /// Whether worker `w` is over the busy threshold.
    fn busy(&self, w: usize, view: &View<'_>) -> bool {
        self.busy_threshold.is_some_and(|t| {
            let total = view.num_gpu_blocks(w).max(1) as f64;
            let active = self.running.unique(w) as f64 / total;
            active.max(view.kv_cache_usage_perc(w)) > t
        })
    }

    /// Each worker's cost for a request of `isl_tokens` whose blocks are
    /// `blocks`, given each worker's overlap (blocks) and prompt backlog.
    fn costs(
        &self,
        block_tokens: u64,
        isl_tokens: u64,
        blocks: &[u64],
        overlap_blocks: &[u64],
        active_prefill_tokens: &[f64],
    ) -> Vec<f64> {
        overlap_blocks
            .iter()
            .zip(active_prefill_tokens)
            .enumerate()
            .map(|(w, (&overlap, &active_prefill_tokens))| {
                let load = Load {
                    active_prefill_tokens,
                    active_decode_blocks: self.running.unique(w),
                    additional_active_blocks: blocks.len() - self.running.shared_prefix(w, blocks),
                };
                worker_logit(
                    self.prefill_load_scale,
                    block_tokens,
                    isl_tokens,
                    overlap,
                    overlap * block_tokens,
                    &load,
                )
            })
            .collect()
    }
}

impl Policy for Dynamo {
    fn pick(&mut self, r: &Prepared, view: &View<'_>) -> usize {
        let now = view.now;
        let block_tokens = view.block_tokens();
        let blocks = engine_blocks(&r.tokens, block_tokens);
        if let Some(agents) = &mut self.agents {
            agents.observe(now);
        }
        let busy: Vec<bool> = (0..view.workers()).map(|w| self.busy(w, view)).collect();
        let bound = self
            .agents
            .as_ref()
            .and_then(|a| a.bound(r, now))
            .filter(|&w| !busy.get(w).copied().unwrap_or(false));
        let chosen = bound.unwrap_or_else(|| {
            let overlap: Vec<u64> = (0..view.workers())
                .map(|w| {
                    let events = view.true_gpu_cached_tokens(w, &r.tokens) / block_tokens;
                    // The side index and the events' index: the per-worker maximum.
                    let predicted = self.agents.as_ref().map_or(0, |a| a.predicted_overlap(w, &blocks, now));
                    events.max(predicted as u64)
                })
                .collect();
            let backlog: Vec<f64> = (0..view.workers()).map(|w| view.queued_prefill_tokens(w)).collect();
            let mut costs = self.costs(block_tokens, r.prompt_tokens, &blocks, &overlap, &backlog);
            // Busy workers are out of the selection; with every worker busy
            // upstream answers 529, which a run of served calls cannot, so
            // then all stay in.
            if busy.iter().any(|b| !b) {
                for (c, &b) in costs.iter_mut().zip(&busy) {
                    if b {
                        *c = f64::INFINITY;
                    }
                }
            }
            argmin_random_ties(&costs, &mut self.rng)
        });
        if let Some(agents) = &mut self.agents {
            agents.dispatch(r, chosen, &blocks, now);
        }
        self.running.add(r.index, chosen, blocks);
        chosen
    }

    fn completed(&mut self, _worker: usize, r: &Prepared, _cached_tokens: u64, _ttft_ms: f64, _now_ms: f64) {
        self.running.free(r.index);
        if let Some(agents) = &mut self.agents {
            agents.lease_ended(r.index);
        }
    }
}

#[cfg(test)]
mod tests {
    use kvmesh_sim::timing::TimingModel;

    use super::super::tests::{child, request, text};
    use super::*;
    use crate::simulate::world::World;

    #[test]
    fn worker_logit_matches_upstreams_worked_example() {
        // selector.rs's unit test: isl 64, 96 cached tokens over 6 overlap
        // blocks, 16 tokens of backlog, 2 active + 3 new blocks, scale 2:
        // raw prefill (16 + 0 + 96)/16 = 7, less 6 → 1, × 2 = 2; + 5 = 7.
        let load = Load {
            active_prefill_tokens: 16.0,
            active_decode_blocks: 2,
            additional_active_blocks: 3,
        };
        assert_eq!(worker_logit(2.0, 16, 64, 6, 96, &load), 7.0);
        // At the default scale 1 with nothing cached: 64/16 + 16/16 = 5, + 5.
        assert_eq!(worker_logit(1.0, 16, 64, 0, 0, &load), 10.0);
    }

    #[test]
    fn dynamo_charges_a_prefix_shared_by_two_active_requests_on_one_worker_once() {
        let mut dynamo = Dynamo::new(2, 1);
        let prefix: Vec<u64> = (1..=100).collect();
        // Worker 0 runs two requests sharing 100 blocks, one more each.
        dynamo.running.add(0, 0, [prefix.clone(), vec![1001]].concat());
        dynamo.running.add(1, 0, [prefix.clone(), vec![1002]].concat());
        // Worker 1 runs one unrelated request of 150 blocks.
        dynamo.running.add(2, 1, (2001..=2150).collect());
        // A third of the same prefix, 101 blocks (1,616 tokens), cached
        // nowhere, no backlog: prefill 101 blocks on either worker.
        let blocks = [prefix, vec![1003]].concat();
        let costs = dynamo.costs(16, 1616, &blocks, &[0, 0], &[0.0, 0.0]);
        // Worker 0: 101 + (102 unique + 1 new); worker 1: 101 + (150 + 101).
        assert_eq!(costs, vec![204.0, 352.0]);
        // Summing every prompt in full, and leaving this request out, would
        // have charged worker 0 202 blocks against 150 and sent it away.
        assert_eq!(argmin_random_ties(&costs, &mut Rng::new(1)), 0);
    }

    #[test]
    fn dynamo_sees_the_true_cache_and_breaks_ties_at_random() {
        let mut world = World::new(3, 1_000_000, TimingModel::default());
        let doc = request(0, "", &text(5, 16), 1);
        // Cached on worker 2 only, and finished by t = 100 s.
        world.serve(2, &doc, 0.0);
        let mut dynamo = Dynamo::new(3, 1);
        assert_eq!(dynamo.pick(&request(1, "", &text(5, 16), 1), &world.view(100_000.0)), 2);
        // A text cached nowhere, on idle workers: every seed's pick is a
        // fair draw, and over seeds every worker is drawn.
        let other = request(2, "", &text(6, 16), 1);
        let drawn: std::collections::HashSet<usize> = (0..32)
            .map(|seed| Dynamo::new(3, seed).pick(&other, &world.view(100_000.0)))
            .collect();
        assert_eq!(drawn.len(), 3);
    }

    #[test]
    fn dynamo_agents_keeps_a_session_on_its_worker_until_the_ttl_and_groups_a_parents_children() {
        let world = World::new(2, 1_000_000, TimingModel::default());
        let mut agents = Dynamo::agents(2, 1.0, 1);
        let first = request(0, "s1", &text(1, 4), 1);
        let w = agents.pick(&first, &world.view(0.0));
        let u = 1 - w;
        agents.completed(w, &first, 0, 0.0, 0.0);
        // Make `w` the expensive worker: 5,000 running blocks no one shares.
        agents.running.add(99, w, (10_000..15_000).collect());
        let idle = |index: usize| request(index, "", &text(index, 1), 1);
        // Another session's arrival at 1 s starts s1's idle timer (1 s + 600 s).
        assert_eq!(agents.pick(&idle(1), &world.view(1_000.0)), u);
        // Within the TTL the session stays bound, whatever the cost.
        let again = request(2, "s1", &text(1, 4), 1);
        assert_eq!(agents.pick(&again, &world.view(500_000.0)), w);
        // A child's first call is placed by cost, not on its parent's worker...
        let sub = child(3, "s1-sub", "s1", &text(3, 4), 1);
        assert_eq!(agents.pick(&sub, &world.view(500_001.0)), u);
        // ...and its sibling follows it there, now the dearer worker.
        agents.running.add(98, u, (20_000..30_000).collect());
        let sub2 = child(4, "s1-sub2", "s1", &text(4, 4), 1);
        assert_eq!(agents.pick(&sub2, &world.view(500_002.0)), u);
        for r in [&again, &sub, &sub2] {
            agents.completed(w, r, 0, 0.0, 0.0);
        }
        // Idle from the next pick, 500.003 s: bound until 1,100.003 s.
        agents.pick(&idle(5), &world.view(500_003.0));
        let late = request(6, "s1", &text(1, 4), 1);
        let side = agents.agents.as_ref().unwrap();
        assert_eq!(side.bound(&late, 1_100_002.0), Some(w));
        assert_eq!(side.bound(&sub2, 1_100_002.0), Some(u));
        assert_eq!(side.bound(&late, 1_100_004.0), None);
    }

    #[test]
    fn soft_affinity_leaves_a_bound_worker_over_the_busy_threshold_and_rebinds() {
        // 1,000 blocks of 16 tokens a worker.
        let world = World::new(2, 16_000, TimingModel::default());
        let first = request(0, "s1", &text(1, 4), 1);
        for (mut dynamo, stays) in [(Dynamo::sticky(2, 1), true), (Dynamo::soft(2, 0.85, 1), false)] {
            let w = dynamo.pick(&first, &world.view(0.0));
            dynamo.completed(w, &first, 0, 0.0, 0.0);
            // 900 of `w`'s 1,000 blocks held by running requests: busy at 0.85.
            dynamo.running.add(99, w, (10_000..10_900).collect());
            let again = request(1, "s1", &text(1, 4), 1);
            let next = dynamo.pick(&again, &world.view(1_000.0));
            assert_eq!(next == w, stays, "hard keeps the binding, soft leaves a busy worker");
            // Soft rebinds where it went: the following call goes there too.
            dynamo.completed(next, &again, 0, 0.0, 0.0);
            let third = request(2, "s1", &text(1, 4), 1);
            assert_eq!(dynamo.pick(&third, &world.view(2_000.0)), next);
        }
    }

    #[test]
    fn dynamo_sticky_binds_a_session_but_places_a_child_by_cost_and_predicts_nothing() {
        let world = World::new(2, 1_000_000, TimingModel::default());
        let mut sticky = Dynamo::sticky(2, 1);
        let first = request(0, "s1", &text(1, 4), 1);
        let w = sticky.pick(&first, &world.view(0.0));
        // `w` made the expensive worker, as above.
        sticky.running.add(99, w, (10_000..15_000).collect());
        // The session stays bound whatever the cost...
        let again = request(1, "s1", &text(1, 4), 1);
        assert_eq!(sticky.pick(&again, &world.view(1_000.0)), w);
        // ...but its child's first call is placed by cost, not by its parent.
        let sub = child(2, "s1-sub", "s1", &text(2, 4), 1);
        assert_ne!(sticky.pick(&sub, &world.view(1_001.0)), w);
        let side = sticky.agents.as_ref().unwrap();
        assert_eq!(side.predicted_overlap(w, &engine_blocks(&first.tokens, 16), 1_002.0), 0);
    }

    #[test]
    fn dynamo_agents_predicts_a_routed_prefix_for_five_seconds() {
        let world = World::new(2, 1_000_000, TimingModel::default());
        let doc = request(0, "", &text(8, 8), 1);
        let blocks = engine_blocks(&doc.tokens, 16);
        for seed in 0..8 {
            let mut agents = Dynamo::agents(2, 1.0, seed);
            let w = agents.pick(&doc, &world.view(0.0));
            agents.completed(w, &doc, 0, 0.0, 0.0);
            let side = agents.agents.as_ref().unwrap();
            assert_eq!(side.predicted_overlap(w, &blocks, 4_999.0), blocks.len());
            assert_eq!(side.predicted_overlap(w, &blocks, 5_000.0), 0);
            assert_eq!(side.predicted_overlap(1 - w, &blocks, 1.0), 0);
            // No event yet (the engine never saw it), both workers idle: a
            // sibling follows the prediction, not a coin.
            assert_eq!(agents.pick(&request(1, "", &text(8, 8), 1), &world.view(1.0)), w);
        }
    }
}
