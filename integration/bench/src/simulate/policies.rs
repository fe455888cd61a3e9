//! The routing policies compared by `simulate`: kvmesh (through the same
//! core API as the sidecar) and reimplementations of the anchors' policies
//! with their documented defaults. Each gets only what a real deployment of
//! it would know.

use std::collections::HashMap;

use kvmesh_core::{Lru, Outcome, Router, RouterConfig};

use super::radix::RadixTree;
use super::world::{Prepared, View};

/// A routing policy under simulation.
pub(crate) trait Policy {
    fn pick(&mut self, request: &Prepared, view: &View<'_>) -> usize;
    /// The request finished at `view.now` on `worker` (outcome feedback).
    fn completed(&mut self, _worker: usize, _request: &Prepared, _cached_tokens: u64, _ttft_ms: f64) {}
}

pub(crate) const ALL: [&str; 9] = [
    "kvmesh",
    "kvmesh_oracle",
    "round_robin",
    "random",
    "least_loaded",
    "session_sticky",
    "sglang_cache_aware",
    "gie_approx_prefix",
    "dynamo_precise",
];

pub(crate) fn make(
    name: &str,
    workers: usize,
    capacity_tokens: u64,
    seed: u64,
    prefill_rate: f64,
) -> Option<Box<dyn Policy>> {
    Some(match name {
        "kvmesh" => Box::new(Kvmesh::new(workers, capacity_tokens, prefill_rate)),
        "kvmesh_oracle" => Box::new(super::oracle::KvmeshOracle::new(workers, capacity_tokens, prefill_rate)),
        "round_robin" => Box::new(RoundRobin(0)),
        "random" => Box::new(Random(seed | 1)),
        "least_loaded" => Box::new(LeastLoaded),
        "session_sticky" => Box::new(SessionSticky(0)),
        "sglang_cache_aware" => Box::new(SglangCacheAware::new(workers)),
        "gie_approx_prefix" => Box::new(GieApproxPrefix::new(workers)),
        "dynamo_precise" => Box::new(DynamoPrecise),
        _ => return None,
    })
}

/// kvmesh's own core, driven exactly as the sidecar drives it: Picks with
/// the filter's block hashes, Outcomes with the engine's usage.
pub(crate) struct Kvmesh {
    router: Router,
    picks: HashMap<usize, u64>,
}

impl Kvmesh {
    fn new(workers: usize, capacity_tokens: u64, prefill_rate: f64) -> Self {
        let mut router = Router::new(
            RouterConfig {
                default_prefill_tokens_per_ms: prefill_rate,
                ..RouterConfig::default()
            },
            (0..workers).map(|w| format!("10.0.{}.{}:8000", w / 256, w % 256)),
        );
        // What the engine watcher reads from each engine's metrics.
        for w in 0..workers {
            router.set_engine_capacity_tokens(kvmesh_core::WorkerId(w), capacity_tokens);
        }
        Self {
            router,
            picks: HashMap::new(),
        }
    }
}

impl Policy for Kvmesh {
    fn pick(&mut self, r: &Prepared, view: &View<'_>) -> usize {
        let d = self.router.pick(r.pick_input(view.now as u64));
        self.picks.insert(r.index, d.pick_id);
        d.ranked.first().map_or(0, |w| w.0)
    }

    fn completed(&mut self, _worker: usize, r: &Prepared, cached_tokens: u64, ttft_ms: f64) {
        if let Some(pick_id) = self.picks.remove(&r.index) {
            self.router.report(Outcome {
                pick_id,
                prompt_tokens: Some(r.prompt_tokens),
                cached_tokens: Some(cached_tokens),
                ttfb_ms: ttft_ms.round() as u32,
            });
        }
    }
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

fn string_hash(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
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
        let key = string_hash(&r.session);
        (0..view.workers()).max_by_key(|&w| mix(key, w as u64)).unwrap_or(0)
    }
}

/// Chained hashes of `chunk`-byte pieces of `text`, at most `cap` of them.
fn chunk_hashes(text: &[u8], chunk: usize, cap: usize) -> Vec<u64> {
    let mut prev = 0u64;
    text.chunks(chunk)
        .take(cap)
        .map(|c| {
            prev = mix(prev, string_hash(&String::from_utf8_lossy(c)));
            prev
        })
        .collect()
}

/// The SGLang model gateway's cache-aware policy (sgl-router
/// `cache_aware`): one character radix tree recording which worker holds
/// which text (each worker's share bounded by max_tree_size, 2^26, least
/// recently used leaves evicted first). Defaults from its docs:
/// cache_threshold 0.3, balance_abs_threshold 64, balance_rel_threshold 1.5.
/// Imbalanced (max − min load > abs and max > rel · min) → least loaded;
/// else the best match if its rate > threshold; else the smallest tree.
struct SglangCacheAware {
    tree: RadixTree,
}

impl SglangCacheAware {
    fn new(workers: usize) -> Self {
        Self {
            tree: RadixTree::new(workers, 1 << 26),
        }
    }
}

impl Policy for SglangCacheAware {
    fn pick(&mut self, r: &Prepared, view: &View<'_>) -> usize {
        let text = r.text.as_bytes();
        let loads: Vec<usize> = (0..view.workers()).map(|w| view.in_flight(w)).collect();
        let (min, max) = (
            loads.iter().min().copied().unwrap_or(0),
            loads.iter().max().copied().unwrap_or(0),
        );
        let imbalanced = max.saturating_sub(min) > 64 && max as f64 > 1.5 * min as f64;
        let chosen = if imbalanced {
            (0..view.workers()).min_by_key(|&w| (loads[w], w)).unwrap_or(0)
        } else {
            let matched = self.tree.matched(text);
            let best = (0..view.workers())
                .max_by_key(|&w| (matched[w], std::cmp::Reverse(w)))
                .unwrap_or(0);
            let rate = matched[best] as f64 / text.len().max(1) as f64;
            if rate > 0.3 {
                best
            } else {
                (0..view.workers()).min_by_key(|&w| (self.tree.size(w), w)).unwrap_or(0)
            }
        };
        self.tree.insert(text, chosen);
        chosen
    }
}

/// The Gateway API Inference Extension's endpoint picker with its
/// approximate prefix-cache plugin: 64-byte chained blocks of the prompt, at
/// most 256 matched, an LRU of 31,250 blocks per server; scorers prefix 3,
/// queue 2, kv-cache utilization 2, each normalized to [0, 1].
struct GieApproxPrefix {
    servers: Vec<Lru<u64>>,
}

impl GieApproxPrefix {
    fn new(workers: usize) -> Self {
        Self {
            servers: (0..workers).map(|_| Lru::new(31_250)).collect(),
        }
    }
}

impl Policy for GieApproxPrefix {
    fn pick(&mut self, r: &Prepared, view: &View<'_>) -> usize {
        let blocks = chunk_hashes(r.text.as_bytes(), 64, 256);
        let queues: Vec<usize> = (0..view.workers()).map(|w| view.waiting(w)).collect();
        let (qmin, qmax) = (
            queues.iter().min().copied().unwrap_or(0),
            queues.iter().max().copied().unwrap_or(0),
        );
        let score = |w: usize| {
            let matched = blocks.iter().take_while(|b| self.servers[w].contains(b)).count();
            let prefix = matched as f64 / blocks.len().max(1) as f64;
            let queue = if qmax == qmin {
                1.0
            } else {
                (qmax - queues[w]) as f64 / (qmax - qmin) as f64
            };
            let kv = 1.0 - view.kv_usage(w);
            3.0 * prefix + 2.0 * queue + 2.0 * kv
        };
        let chosen = (0..view.workers())
            .max_by(|&a, &b| score(a).total_cmp(&score(b)).then(b.cmp(&a)))
            .unwrap_or(0);
        for b in blocks.iter().rev() {
            self.servers[chosen].touch(*b);
        }
        chosen
    }
}

/// Dynamo's KV router with exact knowledge of every worker's cache (it
/// cheats: it sees the engine model itself). Cost in 16-token blocks =
/// uncached prefill blocks + active prefill blocks + active decode blocks
/// (overlap_score_weight 1, router_temperature 0); ties to the smallest cache.
struct DynamoPrecise;

impl Policy for DynamoPrecise {
    fn pick(&mut self, r: &Prepared, view: &View<'_>) -> usize {
        let cost = |w: usize| {
            let cached = view.true_cached_tokens(w, &r.prompt);
            let uncached = r.prompt_tokens.saturating_sub(cached) as f64 / 16.0;
            uncached + view.queued_prefill_tokens(w) / 16.0 + view.active_kv_tokens(w) / 16.0
        };
        (0..view.workers())
            .min_by(|&a, &b| {
                cost(a)
                    .total_cmp(&cost(b))
                    .then(view.cached_blocks(a).cmp(&view.cached_blocks(b)))
            })
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use kvmesh_request::FilterConfig;
    use kvmesh_sim::timing::TimingModel;

    use super::*;
    use crate::simulate::trace::Request;
    use crate::simulate::world::{World, prepare};

    fn request(index: usize, session: &str, text: &str, output_tokens: u32) -> Prepared {
        let r = Request {
            at_ms: 0.0,
            session: session.to_owned(),
            parent: String::new(),
            text: text.to_owned(),
            output_tokens,
        };
        prepare(index, &r, &FilterConfig::default()).unwrap()
    }

    fn text(seed: usize, kb: usize) -> String {
        format!("doc {seed}: ") + &format!("{seed} lorem ipsum dolor sit amet ").repeat(kb * 1024 / 28)
    }

    /// Serves `n` long requests of `kb` KB on worker `w` at time 0 (they
    /// stay in flight).
    fn load(world: &mut World, w: usize, n: usize, kb: usize) {
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
    fn sglang_follows_the_match_then_balances_past_its_thresholds() {
        let mut world = World::new(2, 1_000_000, TimingModel::default());
        let mut sglang = SglangCacheAware::new(2);
        let doc = text(1, 8);
        // First sight: both trees empty, match 0 ≤ 0.3 → the smallest tree (0).
        assert_eq!(sglang.pick(&request(0, "", &doc, 1), &world.view(0.0)), 0);
        // The same text again matches worker 0 above the threshold.
        assert_eq!(sglang.pick(&request(1, "", &doc, 1), &world.view(0.0)), 0);
        // A new text goes to the smallest tree, worker 1.
        assert_eq!(sglang.pick(&request(2, "", &text(2, 8), 1), &world.view(0.0)), 1);
        // 70 requests in flight on worker 0, none on 1: max − min > 64 and
        // max > 1.5 · min → least loaded, whatever the match.
        load(&mut world, 0, 70, 1);
        assert_eq!(sglang.pick(&request(3, "", &doc, 1), &world.view(1.0)), 1);
    }

    #[test]
    fn gie_weighs_prefix_three_against_queue_and_kv_two_each() {
        // Small caches, so KV utilization tells the workers apart.
        let mut world = World::new(2, 4096, TimingModel::default());
        let mut gie = GieApproxPrefix::new(2);
        let doc = text(3, 8);
        let first = gie.pick(&request(0, "", &doc, 1), &world.view(0.0));
        assert_eq!(first, 0);
        // Prefix (3) beats an equal queue: back to worker 0.
        assert_eq!(gie.pick(&request(1, "", &doc, 1), &world.view(0.0)), 0);
        // Worker 0 holds the prefix (3) but its queue is the longest (0 of
        // 2) and its KV nearly full (~0.3 of 2); worker 1 scores 0 + 2 + 2.
        load(&mut world, 0, 5, 3);
        assert_eq!(gie.pick(&request(2, "", &doc, 1), &world.view(0.5)), 1);
    }

    #[test]
    fn dynamo_precise_sees_the_true_cache_and_ties_to_the_smallest_cache() {
        let mut world = World::new(3, 1_000_000, TimingModel::default());
        let doc = request(0, "", &text(5, 16), 1);
        // Cached on worker 2 only, and finished by t = 100 s.
        world.serve(2, &doc, 0.0);
        let again = request(1, "", &text(5, 16), 1);
        assert_eq!(DynamoPrecise.pick(&again, &world.view(100_000.0)), 2);
        // A text cached nowhere: the workers with the smallest cache (0, 1).
        let other = request(2, "", &text(6, 16), 1);
        assert_eq!(DynamoPrecise.pick(&other, &world.view(100_000.0)), 0);
    }

    #[test]
    fn kvmesh_returns_a_session_to_its_prefix() {
        let mut world = World::new(4, 1_000_000, TimingModel::default());
        let mut kvmesh = Kvmesh::new(4, 1_000_000, 20.0);
        let base = text(7, 8);
        let first = request(0, "agent-1", &base, 1);
        let w = kvmesh.pick(&first, &world.view(0.0));
        let served = world.serve(w, &first, 0.0);
        kvmesh.completed(w, &first, served.cached_tokens, served.ttft_ms);
        let next = request(1, "agent-1", &(base + " and one more tool result"), 1);
        assert_eq!(kvmesh.pick(&next, &world.view(10_000.0)), w);
    }
}
