//! The routing policies compared by `simulate`: kvmesh (through the same
//! core API as the sidecar) and ports of the peers' policies with their
//! documented defaults, one module each, every one citing the upstream file
//! and function it follows. Each gets only what a real deployment of it
//! would know.

mod dynamo;
mod gie;
mod llm_d;
mod running;
mod sglang;

use std::collections::HashMap;

use kvmesh_core::{Outcome, Router, RouterConfig};

use self::dynamo::Dynamo;
use self::gie::GieApproxPrefix;
use self::llm_d::LlmDPrecise;
use self::sglang::{SglangCacheAware, SglangSticky};
use super::world::{Prepared, View};

/// A routing policy under simulation.
pub(crate) trait Policy {
    fn pick(&mut self, request: &Prepared, view: &View<'_>) -> usize;
    /// The request finished at `view.now` on `worker` (outcome feedback).
    fn completed(&mut self, _worker: usize, _request: &Prepared, _cached_tokens: u64, _ttft_ms: f64, _now_ms: f64) {}
    /// Each engine has a host tier of `tokens` (told before the first pick,
    /// as KV events with medium CPU would tell kvmesh's sidecar that a tier
    /// exists). Only kvmesh's index listens; the peers' ports have no tier.
    fn host_tier(&mut self, _tokens: u64) {}
    /// The whole workload, before the first pick: only `greedy_oracle`,
    /// which knows the future's block uses, reads it.
    fn workload(&mut self, _requests: &[Prepared], _block_tokens: u64) {}
}

pub(crate) const ALL: [&str; 18] = [
    "kvmesh",
    super::oracle::NAME,
    "greedy_oracle",
    "kvmesh_pick_time_cache",
    "kvmesh_no_retention",
    "dynamo",
    "dynamo_sticky",
    "dynamo_soft",
    "dynamo_agents",
    "llm_d_precise",
    "gie_approx_prefix",
    "gie_approx_prefix_6250",
    "sglang_cache_aware",
    "sglang_sticky",
    "session_sticky",
    "least_loaded",
    "round_robin",
    "random",
];

pub(crate) fn make(
    name: &str,
    workers: usize,
    capacity_tokens: u64,
    seed: u64,
    prefill_rate: f64,
) -> Option<Box<dyn Policy>> {
    // `dynamo_agents@S` sweeps Dynamo's `--router-prefill-load-scale`.
    // `dynamo_soft@T`: soft affinity with the busy threshold at `T`.
    if let Some(threshold) = name.strip_prefix("dynamo_soft@") {
        let threshold: f64 = threshold.parse().ok().filter(|t: &f64| (0.0..=1.0).contains(t))?;
        return Some(Box::new(Dynamo::soft(workers, threshold, seed)));
    }
    if let Some(scale) = name.strip_prefix("dynamo_agents@") {
        let scale: f64 = scale.parse().ok().filter(|s: &f64| s.is_finite() && *s >= 0.0)?;
        return Some(Box::new(Dynamo::agents(workers, scale, seed)));
    }
    // `kvmesh_no_retention`: kvmesh with the eviction term it had before
    // retention (every cached token the same), everything else equal.
    for (prefix, overlaps, retention) in [
        ("kvmesh_pick_time_cache", Overlaps::PickTimeCache, true),
        ("kvmesh_no_retention", Overlaps::Index, false),
        ("kvmesh", Overlaps::Index, true),
    ] {
        if let Some(overrides) = name.strip_prefix(prefix).filter(|o| o.is_empty() || o.starts_with('@')) {
            let base = if retention {
                RouterConfig::default()
            } else {
                RouterConfig::without_retention()
            };
            let config = kvmesh_config(base, overrides, prefill_rate)?;
            return Some(Box::new(Kvmesh::new(workers, capacity_tokens, config, overlaps)));
        }
    }
    Some(match name {
        "greedy_oracle" => Box::new(GreedyOracle::default()),
        "round_robin" => Box::new(RoundRobin(0)),
        "random" => Box::new(Random(seed | 1)),
        "least_loaded" => Box::new(LeastLoaded),
        "session_sticky" => Box::new(SessionSticky(0)),
        "sglang_cache_aware" => Box::new(SglangCacheAware::new(workers, seed)),
        "sglang_sticky" => Box::new(SglangSticky::new(workers, seed)),
        "gie_approx_prefix" => Box::new(GieApproxPrefix::new(workers, seed)),
        "gie_approx_prefix_6250" => Box::new(GieApproxPrefix::matching(workers, seed, gie::LONG_PROMPT_PREFIX_BLOCKS)),
        "llm_d_precise" => Box::new(LlmDPrecise::new(workers, seed)),
        // `dynamo_precise` is the old name, kept for one release.
        "dynamo" | "dynamo_precise" => Box::new(Dynamo::new(workers, seed)),
        "dynamo_sticky" => Box::new(Dynamo::sticky(workers, seed)),
        "dynamo_soft" => Box::new(Dynamo::soft(workers, 0.85, seed)),
        "dynamo_agents" => Box::new(Dynamo::agents(workers, 1.0, seed)),
        _ => return None,
    })
}

/// The engine's chained hashes of each full block of its tokens, as its KV
/// events name them (a partial last block is never cached, so never named):
/// the peers that see the engine's cache (KV events, `num_gpu_blocks`)
/// count in these, of `View::block_tokens` each.
fn engine_blocks(tokens: &[u32], block_tokens: u64) -> Vec<u64> {
    let mut prev = 0u64;
    tokens
        .chunks_exact(usize::try_from(block_tokens.max(1)).unwrap_or(usize::MAX))
        .map(|block| {
            let bytes: Vec<u8> = block.iter().flat_map(|t| t.to_le_bytes()).collect();
            prev = mix(prev, bytes_hash(&bytes));
            prev
        })
        .collect()
}

/// Seeded xorshift for the peers' random tie-breaks: deterministic for a
/// seed, as every run of the simulator must be.
#[derive(Debug, Clone)]
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(mix(seed, 0x6b76_6d65_7368) | 1)
    }

    /// Uniform in `0..n` (`n` ≥ 1).
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n.max(1) as u64) as usize
    }
}

/// The index of the smallest cost, ties uniformly at random (reservoir
/// sampling over the tied minima, as Dynamo's zero-temperature selector).
fn argmin_random_ties(costs: &[f64], rng: &mut Rng) -> usize {
    argmin_random_ties_within(costs.iter().copied().enumerate(), 0.0, rng).unwrap_or(0)
}

/// `argmin_random_ties` over `(index, cost)` pairs, costs within
/// `tolerance` of the least tying (the first least's cost is the
/// reference); `None` for no pairs.
fn argmin_random_ties_within(
    costs: impl IntoIterator<Item = (usize, f64)>,
    tolerance: f64,
    rng: &mut Rng,
) -> Option<usize> {
    let mut best: Option<(usize, f64)> = None;
    let mut ties = 0;
    for (i, c) in costs {
        let new_least = best.is_none_or(|(_, least)| c < least - tolerance);
        if new_least {
            best = Some((i, c));
            ties = 1;
        } else if let Some((_, least)) = best
            && c >= least - tolerance
            && c <= least + tolerance
        {
            ties += 1;
            if rng.below(ties) == 0 {
                best = Some((i, least));
            }
        }
    }
    best.map(|(i, _)| i)
}

/// The index of the largest score, ties uniformly at random (the
/// max-score picker shuffles, then sorts stably).
fn argmax_random_ties(scores: &[f64], rng: &mut Rng) -> usize {
    let negated: Vec<f64> = scores.iter().map(|s| -s).collect();
    argmin_random_ties(&negated, rng)
}

/// kvmesh as `kvmesh` runs: its default configuration, its own index.
pub(crate) fn kvmesh(workers: usize, capacity_tokens: u64, prefill_rate: f64) -> Kvmesh {
    let config = at_engine_rate(RouterConfig::default(), prefill_rate);
    Kvmesh::new(workers, capacity_tokens, config, Overlaps::Index)
}

/// kvmesh's own core, driven exactly as the sidecar drives it: Picks with
/// the filter's block hashes, Outcomes with the engine's usage.
#[derive(Debug, Clone)]
pub(crate) struct Kvmesh {
    router: Router,
    picks: HashMap<usize, u64>,
    overlaps: Overlaps,
}

/// Where kvmesh's router learns what each worker holds of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Overlaps {
    /// Its own prefix index, as the sidecar runs it (`kvmesh`).
    Index,
    /// The engines' true caches at pick time (`kvmesh_pick_time_cache`):
    /// the same router fed exact overlaps, host-tier blocks apart, through
    /// `Router::pick_with_tier_overlaps`, the hook a precise mode would use.
    /// The gap between the two is what the index's approximation costs. Not
    /// an upper bound: every other term is still kvmesh's estimate, and the
    /// cache can change before the prefill starts (`bound` has the bounds).
    PickTimeCache,
}

impl Kvmesh {
    pub(crate) fn new(workers: usize, capacity_tokens: u64, config: RouterConfig, overlaps: Overlaps) -> Self {
        let mut router = Router::new(
            config,
            (0..workers).map(|w| format!("10.0.{}.{}:8000", w / 256, w % 256)),
        );
        // What the engine watcher reads from each engine's metrics.
        for w in 0..workers {
            router.set_engine_capacity_tokens(kvmesh_core::WorkerId(w), capacity_tokens);
        }
        Self {
            router,
            picks: HashMap::new(),
            overlaps,
        }
    }

    /// `r` placed on worker `w` by a choice made outside kvmesh (the
    /// oracle's), recorded as kvmesh records its own picks.
    pub(crate) fn place_on(&mut self, r: &Prepared, now: f64, w: usize) {
        let d = self.router.place_on(r.pick_input(now as u64), kvmesh_core::WorkerId(w));
        self.picks.insert(r.index, d.pick_id);
    }
}

impl Policy for Kvmesh {
    fn pick(&mut self, r: &Prepared, view: &View<'_>) -> usize {
        let input = r.pick_input(view.now as u64);
        let d = match self.overlaps {
            Overlaps::Index => self.router.pick(input),
            Overlaps::PickTimeCache => {
                // Each engine's true cache, tier by tier: a host hit is
                // priced as the router prices it (`host_hit_credit`).
                let overlaps: Vec<(kvmesh_core::WorkerId, usize, usize)> = (0..view.workers())
                    .map(|w| {
                        let (blocks, host) = view.true_cached_tier_blocks(w, r);
                        (kvmesh_core::WorkerId(w), blocks, host)
                    })
                    .collect();
                self.router.pick_with_tier_overlaps(input, &overlaps)
            }
        };
        self.picks.insert(r.index, d.pick_id);
        d.ranked.first().map_or(0, |w| w.0)
    }

    fn host_tier(&mut self, tokens: u64) {
        // The index counts in kvmesh blocks: the filter's block of the
        // canonical stream (256 bytes) at kvmesh's own estimate of bytes per
        // token (an operator sizes the tier in tokens, kvmesh converts).
        let block_bytes = kvmesh_request::FilterConfig::default().block_bytes.max(1) as f64;
        let blocks = (tokens as f64 * self.router.bytes_per_token("sim") / block_bytes) as u64;
        for w in 0..self.router.workers().len() {
            self.router
                .set_host_capacity_blocks(kvmesh_core::WorkerId(w), usize::try_from(blocks).unwrap_or(usize::MAX));
        }
    }

    fn completed(&mut self, _worker: usize, r: &Prepared, cached_tokens: u64, ttft_ms: f64, now_ms: f64) {
        if let Some(pick_id) = self.picks.remove(&r.index) {
            self.router.report_at(
                Outcome {
                    pick_id,
                    prompt_tokens: Some(r.prompt_tokens),
                    cached_tokens: Some(cached_tokens),
                    ttfb_ms: ttft_ms.round() as u32,
                },
                now_ms as u64,
            );
        }
    }
}

/// `base` with the simulated engines' prefill rate as the rate kvmesh
/// assumes before its first outcome.
fn at_engine_rate(base: RouterConfig, prefill_rate: f64) -> RouterConfig {
    RouterConfig {
        default_prefill_tokens_per_ms: prefill_rate,
        ..base
    }
}

/// kvmesh's router configuration for a run: the defaults (with the
/// simulated engines' prefill rate as the rate before the first outcome),
/// then `@name=value` overrides from the policy's name, for tuning sweeps
/// (`kvmesh@recent_prefill_weight=0.1@session_weight=1024`). `None` for a
/// name or value it does not know.
fn kvmesh_config(base: RouterConfig, overrides: &str, prefill_rate: f64) -> Option<RouterConfig> {
    let mut c = at_engine_rate(base, prefill_rate);
    for pair in overrides.split('@').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=')?;
        if name == "retention" {
            c.retention = value != "0";
            continue;
        }
        let value: f64 = value.parse().ok().filter(|v: &f64| v.is_finite() && *v >= 0.0)?;
        let field = match name {
            "prefill_weight" => &mut c.prefill_weight,
            "decode_weight" => &mut c.decode_weight,
            "session_weight" => &mut c.session_weight,
            "eviction_weight" => &mut c.eviction_weight,
            "waiting_request_tokens" => &mut c.waiting_request_tokens,
            "tie_tolerance" => &mut c.tie_tolerance,
            "move_margin" => &mut c.move_margin,
            "recent_prefill_weight" => &mut c.recent_prefill_weight,
            "host_hit_credit" => &mut c.host_hit_credit,
            "spread_floor" => &mut c.spread_floor,
            _ => return None,
        };
        *field = value;
    }
    Some(c)
}

struct RoundRobin(usize);

impl Policy for RoundRobin {
    fn pick(&mut self, _: &Prepared, view: &View<'_>) -> usize {
        self.0 += 1;
        (self.0 - 1) % view.workers()
    }
}

/// Seeded xorshift: deterministic for a seed.
struct Random(u64);

impl Policy for Random {
    fn pick(&mut self, _: &Prepared, view: &View<'_>) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % view.workers() as u64) as usize
    }
}

/// Fewest requests in flight (Envoy's least request), ties to the lowest id.
struct LeastLoaded;

impl Policy for LeastLoaded {
    fn pick(&mut self, _: &Prepared, view: &View<'_>) -> usize {
        (0..view.workers()).min_by_key(|&w| (view.in_flight(w), w)).unwrap_or(0)
    }
}

fn mix(a: u64, b: u64) -> u64 {
    let mut z = a ^ b.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn bytes_hash(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// `greedy_oracle`: kvmesh's objective, with every term from the world
/// instead of an estimate, one call at a time: a request's time to its
/// first token plus the recomputation it causes others. For each worker, the worker is replayed forward from
/// now with the request added (its queue, admission when the blocks fit,
/// the engine's real evictions while it waits, the true uncached tokens at
/// its prefill's start) until its first token, and without it to the same
/// time: the blocks it evicted that a later call of the workload uses are
/// each priced at one block's compute time. The least cost wins; then the
/// most cached tokens; then the lowest index. It knows the present exactly
/// and the future's block uses, not the future's arrival times or where
/// later calls will go, so it is a far better informed kvmesh, not a bound
/// on a whole run: it loses to kvmesh where moving a session to the worker
/// that is briefly faster costs later calls (`kvmesh_oracle` plays each
/// choice to the end instead).
#[derive(Default)]
struct GreedyOracle {
    /// Per engine block, the calls not yet picked that use it.
    remaining_uses: HashMap<[u8; 32], u32>,
    block_tokens: u64,
}

impl GreedyOracle {
    /// `r` is picked: its uses of its blocks are no longer to come.
    fn picked(&mut self, r: &Prepared) {
        for b in kvmesh_sim::engine::block_chain(&r.tokens, self.block_tokens) {
            if let Some(n) = self.remaining_uses.get_mut(&b) {
                *n = n.saturating_sub(1);
            }
        }
    }
}

impl Policy for GreedyOracle {
    fn workload(&mut self, requests: &[Prepared], block_tokens: u64) {
        self.block_tokens = block_tokens;
        for r in requests {
            for b in kvmesh_sim::engine::block_chain(&r.tokens, block_tokens) {
                *self.remaining_uses.entry(b).or_insert(0) += 1;
            }
        }
    }

    fn pick(&mut self, r: &Prepared, view: &View<'_>) -> usize {
        self.picked(r);
        let block_ms = view.block_compute_ms();
        let mut best: Option<(usize, f64, u64)> = None;
        for w in 0..view.workers() {
            let Some((s, evicted)) = view.replay_forward(w, r) else {
                continue;
            };
            let needed = evicted
                .iter()
                .filter(|b| self.remaining_uses.get(*b).is_some_and(|&n| n > 0))
                .count();
            let cost = s.ttft_ms + needed as f64 * block_ms;
            let better =
                best.is_none_or(|(_, least, cached)| cost < least || (cost == least && s.cached_tokens > cached));
            if better {
                best = Some((w, cost, s.cached_tokens));
            }
        }
        best.map_or(0, |(w, _, _)| w)
    }
}

/// Rendezvous (highest random weight) hashing of the session id; requests
/// without a session go round robin.
struct SessionSticky(usize);

impl Policy for SessionSticky {
    fn pick(&mut self, r: &Prepared, view: &View<'_>) -> usize {
        if r.session.is_empty() {
            self.0 += 1;
            return (self.0 - 1) % view.workers();
        }
        let key = bytes_hash(r.session.as_bytes());
        (0..view.workers()).max_by_key(|&w| mix(key, w as u64)).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use kvmesh_request::FilterConfig;
    use kvmesh_sim::timing::TimingModel;

    use super::*;
    use crate::simulate::trace::Request;
    use crate::simulate::world::{World, prepare};

    pub(super) fn request(index: usize, session: &str, text: &str, output_tokens: u32) -> Prepared {
        child(index, session, "", text, output_tokens)
    }

    /// A request of `session`, a child of `parent` (empty: none).
    pub(super) fn child(index: usize, session: &str, parent: &str, text: &str, output_tokens: u32) -> Prepared {
        let r = Request {
            at_ms: 0.0,
            session: session.to_owned(),
            parent: parent.to_owned(),
            text: text.to_owned(),
            output_tokens,
            session_final: false,
        };
        let mut tokenizer = kvmesh_sim::tokenizer::Tokenizer::new().unwrap();
        prepare(index, &r, &FilterConfig::default(), &mut tokenizer).unwrap()
    }

    pub(super) fn text(seed: usize, kb: usize) -> String {
        format!("doc {seed}: ") + &format!("{seed} lorem ipsum dolor sit amet ").repeat(kb * 1024 / 28)
    }

    /// Serves `n` long requests of `kb` KB on worker `w` at time 0 (they
    /// stay in flight).
    pub(super) fn load(world: &mut World, w: usize, n: usize, kb: usize) {
        for i in 0..n {
            world.serve(w, &request(10_000 + i, "", &text(900 + i, kb), 4000), 0.0);
        }
    }

    #[test]
    fn round_robin_cycles_and_least_loaded_avoids_load() {
        let mut world = World::new(3, 1_000_000, TimingModel::default());
        let r = request(0, "", "hi", 1);
        let mut rr = RoundRobin(0);
        let picks: Vec<usize> = (0..6).map(|_| rr.pick(&r, &world.view(0.0))).collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2]);
        load(&mut world, 0, 2, 1);
        load(&mut world, 1, 1, 1);
        assert_eq!(LeastLoaded.pick(&r, &world.view(1.0)), 2);
    }

    #[test]
    fn random_is_deterministic_for_a_seed_and_uses_every_worker() {
        let world = World::new(4, 1_000_000, TimingModel::default());
        let r = request(0, "", "x", 1);
        let draw = |seed: u64| {
            let mut random = Random(seed | 1);
            (0..64).map(|_| random.pick(&r, &world.view(0.0))).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
        let picks = draw(7);
        assert!((0..4).all(|w| picks.contains(&w)));
    }

    #[test]
    fn session_sticky_is_stable_per_session_and_spreads_sessions() {
        let world = World::new(8, 1_000_000, TimingModel::default());
        let mut sticky = SessionSticky(0);
        let mut seen = std::collections::HashSet::new();
        for s in 0..64 {
            let r = request(s, &format!("session-{s}"), "x", 1);
            let first = sticky.pick(&r, &world.view(0.0));
            assert_eq!(sticky.pick(&r, &world.view(5.0)), first);
            seen.insert(first);
        }
        assert_eq!(seen.len(), 8, "64 sessions should reach all 8 workers");
    }

    #[test]
    fn every_name_in_all_and_the_sweep_and_alias_names_make_a_policy() {
        for name in ALL.iter().chain(&[
            "dynamo_precise",
            "dynamo_agents@1",
            "dynamo_agents@2",
            "dynamo_agents@4",
            "dynamo_soft@0.5",
        ]) {
            let fleet = crate::simulate::Fleet {
                workers: 4,
                capacity_tokens: 100_000,
                host_tier_blocks: 0,
                block_tokens: 16,
                jitter: 0.0,
            };
            let made = crate::simulate::oracle::Picker::make(name, fleet, 1, TimingModel::default());
            assert!(made.is_some(), "{name}");
        }
        for name in [
            "dynamo_agents@",
            "dynamo_agents@-1",
            "dynamo_agents@x",
            "dynamo_soft@1.5",
            "dynamo_soft@x",
            "dynamo@2",
            "nope",
        ] {
            assert!(make(name, 4, 100_000, 1, 20.0).is_none(), "{name}");
        }
        assert_eq!(ALL.iter().filter(|n| n.starts_with("dynamo")).count(), 4);
    }

    #[test]
    fn ties_go_to_a_seeded_uniform_draw_among_the_tied_only() {
        let mut rng = Rng::new(7);
        let mut seen = [0usize; 4];
        for _ in 0..3000 {
            seen[argmin_random_ties(&[2.0, 1.0, 1.0, 1.0], &mut rng)] += 1;
        }
        assert_eq!(seen[0], 0);
        assert!(seen[1..].iter().all(|&n| (800..1200).contains(&n)), "{seen:?}");
        assert_eq!(argmax_random_ties(&[0.5, 3.0, 1.0], &mut rng), 1);
        let draw = |seed| {
            let mut rng = Rng::new(seed);
            (0..16)
                .map(|_| argmin_random_ties(&[0.0; 4], &mut rng))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(3), draw(3));
    }

    #[test]
    fn kvmesh_returns_a_session_to_its_prefix() {
        let mut world = World::new(4, 1_000_000, TimingModel::default());
        let mut kvmesh = make("kvmesh", 4, 1_000_000, 1, 20.0).unwrap();
        let base = text(7, 8);
        let first = request(0, "agent-1", &base, 1);
        let w = kvmesh.pick(&first, &world.view(0.0));
        let served = world.serve(w, &first, 0.0);
        kvmesh.completed(w, &first, served.cached_tokens, served.ttft_ms, 0.0);
        let next = request(1, "agent-1", &(base + " and one more tool result"), 1);
        assert_eq!(kvmesh.pick(&next, &world.view(10_000.0)), w);
    }

    /// The index believes the prefix is where kvmesh sent it; the engine
    /// that really holds it is another. The pick-time cache follows the engine.
    #[test]
    fn the_pick_time_cache_follows_the_engines_cache_not_the_index() {
        let mut world = World::new(3, 1_000_000, TimingModel::default());
        let mut precise = make("kvmesh_pick_time_cache", 3, 1_000_000, 1, 20.0).unwrap();
        let doc = "shared tool schemas and a long repository context ".repeat(200);
        let first = request(0, "a", &doc, 1);
        let believed = precise.pick(&first, &world.view(0.0));
        // Served elsewhere (as if the pick had failed over).
        let elsewhere = (believed + 1) % 3;
        let served = world.serve(elsewhere, &first, 0.0);
        precise.completed(elsewhere, &first, served.cached_tokens, served.ttft_ms, 0.0);
        let next = request(1, "b", &(doc + " and one more turn"), 1);
        assert_eq!(precise.pick(&next, &world.view(60_000.0)), elsewhere);
    }

    #[test]
    fn the_oracle_weighs_a_workers_queue_and_the_blocks_a_pick_would_evict() {
        // Worker 0 holds a session's prefix; its next call goes there...
        let mut world = World::new(2, 1_000_000, TimingModel::default());
        let doc = text(1, 32);
        let first = request(0, "a", &doc, 1);
        world.serve(0, &first, 0.0);
        let next = request(1, "a", &(doc.clone() + " one more turn"), 1);
        let oracle = || {
            let mut o = GreedyOracle::default();
            o.workload(&[first.clone(), next.clone()], 16);
            o
        };
        assert_eq!(oracle().pick(&next, &world.view(10_000.0)), 0);
        // ...unless worker 0's queue holds new prompts whose prefills take
        // longer than recomputing the prefix on worker 1.
        for i in 0..3 {
            world.admit(0, &request(10 + i, "", &text(100 + i, 64), 1), 10_000.0);
        }
        assert_eq!(oracle().pick(&next, &world.view(10_000.0)), 1);

        // Two full workers, each holding one session's prefix: a new
        // session evicts the one no later call needs (worker 1's, though
        // the index order would pick worker 0 on a tie).
        let mut world = World::new(2, 4_000, TimingModel::default());
        let (b, c) = (request(0, "b", &text(2, 8), 1), request(1, "c", &text(3, 8), 1));
        world.serve(0, &b, 0.0);
        world.serve(1, &c, 0.0);
        let x = request(2, "x", &text(4, 8), 1);
        let b_again = request(3, "b", &(text(2, 8) + " next"), 1);
        assert!(world.view(10_000.0).true_cached_tokens(0, &b.tokens) > 2_000);
        let mut o = GreedyOracle::default();
        o.workload(&[b.clone(), c.clone(), x.clone(), b_again], 16);
        // b and c were picked before x.
        o.picked(&b);
        o.picked(&c);
        assert_eq!(o.pick(&x, &world.view(10_000.0)), 1);
    }

    #[test]
    fn kvmesh_takes_config_overrides_for_sweeps_and_refuses_unknown_ones() {
        assert!(kvmesh_config(RouterConfig::default(), "", 20.0).is_some());
        let c = kvmesh_config(
            RouterConfig::default(),
            "@recent_prefill_weight=0.1@session_weight=1024",
            20.0,
        )
        .unwrap();
        assert_eq!((c.recent_prefill_weight, c.session_weight), (0.1, 1024.0));
        assert_eq!(c.default_prefill_tokens_per_ms, 20.0);
        for bad in ["@nope=1", "@session_weight=-1", "@session_weight=x", "@session_weight"] {
            assert!(kvmesh_config(RouterConfig::default(), bad, 20.0).is_none(), "{bad}");
        }
        assert!(make("kvmesh@move_margin=0.5", 2, 1000, 1, 20.0).is_some());
        assert!(make("kvmesh_pick_time_cache@move_margin=0.5", 2, 1000, 1, 20.0).is_some());
        assert!(make("kvmeshx", 2, 1000, 1, 20.0).is_none());
    }
}
