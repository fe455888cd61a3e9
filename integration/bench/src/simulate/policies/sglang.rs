//! The SGLang Model Gateway (`smg`) in front of HTTP workers, as release
//! 1.13.0 has it (the release the real comparison runs, read from its
//! source distribution), in two configurations:
//! - `sglang_cache_aware`: `--policy cache_aware` with `smg launch`'s
//!   defaults (`src/smg/router_args.py`: `cache_threshold` 0.3,
//!   `balance_abs_threshold` 64, `balance_rel_threshold` 1.5,
//!   `max_tree_size` 2^26; the token-usage triggers off). Over HTTP it
//!   matches the request's characters in its string tree
//!   (`model_gateway/src/policies/cache_aware.rs`
//!   `select_worker_scanned`, `select_worker_with_text`): a match rate above
//!   the threshold makes the workers holding the deepest match the
//!   candidates (`select_matched_candidate`, `resolve_selection`), any of
//!   them over the count-pressure gate is dropped
//!   (`select_final_from_affinity`, `candidate_requires_spill`,
//!   `over_count_pressure_gate`, `absolute_margin`: a load above 1.5 times
//!   the fleet's mean and more than `min(64, max(ceil(2·√mean), 4))` above
//!   it), and the candidate of least expected wait wins (`least_load.rs`
//!   `score`, `select_min_expected_wait_with_freshness`; `worker/monitor.rs`
//!   `fetch_http_load_vllm`: every `load_monitor_interval`, 10 s, smg reads
//!   each vLLM's running and waiting requests and KV usage from its
//!   `/metrics`; the score is `(reported + dispatched since the poll, or the
//!   router's in-flight count if more) × 1,024 / 2,000 tok/s + 0.15 ·
//!   k/(1 − k)`, `k` the reported KV usage; scores within 1 µs tie, drawn
//!   uniformly). The since-poll credit is what spreads new prefixes: a
//!   worker just sent one looks busier until the next poll. A miss, or a
//!   spill, goes to the least expected wait among the workers under the
//!   gate (all, if none is). The tree records the text for the chosen
//!   worker. The port polls at the first pick after each 10 s boundary.
//! - `sglang_sticky`: the same with `--routing-key-override
//!   --routing-key-headers <session header>` (`policies/registry.rs`
//!   `select_sticky`, `policies/manual.rs`): a session's first call is
//!   placed by `cache_aware` and the session pinned there; later calls go
//!   to the pinned worker without consulting (or updating) the tree, unless
//!   the session already has `STICKY_INFLIGHT_CAP` calls in flight there,
//!   when `cache_aware` picks again and the pin moves if that worker is
//!   under the cap. Pins expire after 4 h idle (longer than any workload
//!   here).

use std::collections::HashMap;

use super::{Policy, Rng, argmin_random_ties_within};
use crate::simulate::radix::RadixTree;
use crate::simulate::world::{Prepared, View};

const CACHE_THRESHOLD: f64 = 0.3;
const BALANCE_ABS_THRESHOLD: f64 = 64.0;
const BALANCE_REL_THRESHOLD: f64 = 1.5;
/// `MIN_ABSOLUTE_MARGIN`.
const MIN_ABSOLUTE_MARGIN: f64 = 4.0;
const MAX_TREE_SIZE: usize = 1 << 26;
/// `STICKY_INFLIGHT_CAP`: a session's calls in flight on its pinned worker
/// before the next one is placed afresh.
const STICKY_INFLIGHT_CAP: usize = 2;
/// `load_monitor_interval` (`smg launch`'s 10 s), in ms.
const LOAD_POLL_MS: f64 = 10_000.0;
/// `DEFAULT_MEAN_PREFILL_TOKENS` over `DEFAULT_THROUGHPUT`: seconds of work
/// a request of unknown size stands for.
const REQUEST_SECONDS: f64 = 1_024.0 / 2_000.0;
/// `DEFAULT_KV_PRESSURE_WEIGHT`, seconds.
const KV_PRESSURE_WEIGHT: f64 = 0.15;
/// `TIE_EPSILON_SECS`.
const TIE_EPSILON_SECS: f64 = 1e-6;

/// The count-pressure gate: `load` is over it against the fleet's mean.
fn over_gate(load: f64, mean: f64) -> bool {
    let margin = BALANCE_ABS_THRESHOLD.min((2.0 * mean.sqrt()).ceil().max(MIN_ABSOLUTE_MARGIN));
    load > mean * BALANCE_REL_THRESHOLD && load > mean + margin
}

/// One character tree recording which worker was sent which text (each
/// worker's share bounded, its least recently used leaves evicted).
pub(crate) struct SglangCacheAware {
    tree: RadixTree,
    rng: Rng,
    /// The last load poll: its 10 s period, each worker's running and
    /// waiting requests and KV usage then, and the requests sent to each
    /// since.
    polled_period: Option<u64>,
    reported: Vec<f64>,
    kv_usage: Vec<f64>,
    since_poll: Vec<f64>,
}

impl SglangCacheAware {
    pub(crate) fn new(workers: usize, seed: u64) -> Self {
        Self {
            tree: RadixTree::new(workers, MAX_TREE_SIZE),
            rng: Rng::new(seed),
            polled_period: None,
            reported: vec![0.0; workers],
            kv_usage: vec![0.0; workers],
            since_poll: vec![0.0; workers],
        }
    }

    /// The load monitor's poll, if a 10 s boundary has passed since the last.
    fn poll(&mut self, view: &View<'_>) {
        let period = (view.now / LOAD_POLL_MS).floor().max(0.0) as u64;
        if self.polled_period == Some(period) {
            return;
        }
        self.polled_period = Some(period);
        for w in 0..view.workers() {
            self.reported[w] = view.in_flight(w) as f64;
            self.kv_usage[w] = view.kv_cache_usage_perc(w);
            self.since_poll[w] = 0.0;
        }
    }

    /// `score`: the expected wait, in seconds.
    fn expected_wait(&self, w: usize, in_flight: f64) -> f64 {
        let requests = in_flight.max(self.reported[w] + self.since_poll[w]);
        let k = self.kv_usage[w].clamp(0.0, 0.999);
        requests * REQUEST_SECONDS + KV_PRESSURE_WEIGHT * k / (1.0 - k)
    }

    /// The candidate of least expected wait, ties drawn uniformly; the
    /// winner is credited a dispatch.
    fn least_wait(&mut self, candidates: &[usize], loads: &[f64]) -> usize {
        let scores: Vec<(usize, f64)> = candidates
            .iter()
            .map(|&w| (w, self.expected_wait(w, loads[w])))
            .collect();
        let best = argmin_random_ties_within(scores, TIE_EPSILON_SECS, &mut self.rng);
        let chosen = best.unwrap_or(0);
        if let Some(n) = self.since_poll.get_mut(chosen) {
            *n += 1.0;
        }
        chosen
    }
}

impl Policy for SglangCacheAware {
    fn pick(&mut self, r: &Prepared, view: &View<'_>) -> usize {
        let text = r.text.as_bytes();
        self.poll(view);
        let loads: Vec<f64> = (0..view.workers()).map(|w| view.in_flight(w) as f64).collect();
        let mean = loads.iter().sum::<f64>() / loads.len().max(1) as f64;
        let all: Vec<usize> = (0..view.workers()).collect();
        let under: Vec<usize> = all.iter().copied().filter(|&w| !over_gate(loads[w], mean)).collect();
        let matched = self.tree.matched(text);
        let deepest = matched.iter().copied().max().unwrap_or(0);
        let rate = deepest as f64 / text.len().max(1) as f64;
        let chosen = if rate > CACHE_THRESHOLD {
            let safe: Vec<usize> = all
                .iter()
                .copied()
                .filter(|&w| matched[w] == deepest && !over_gate(loads[w], mean))
                .collect();
            if !safe.is_empty() {
                self.least_wait(&safe, &loads)
            } else if !under.is_empty() {
                self.least_wait(&under, &loads)
            } else {
                self.least_wait(&all, &loads)
            }
        } else {
            self.least_wait(&all, &loads)
        };
        self.tree.insert(text, chosen);
        chosen
    }
}

/// `sglang_cache_aware` behind the routing-key override.
pub(crate) struct SglangSticky {
    cache_aware: SglangCacheAware,
    /// Session → its pinned workers, the first preferred (at most two).
    pins: HashMap<String, Vec<usize>>,
    /// (session, worker) → its calls in flight there.
    in_flight: HashMap<(String, usize), usize>,
    /// Request index → where it went, to count it out.
    sent: HashMap<usize, usize>,
}

impl SglangSticky {
    pub(crate) fn new(workers: usize, seed: u64) -> Self {
        Self {
            cache_aware: SglangCacheAware::new(workers, seed),
            pins: HashMap::new(),
            in_flight: HashMap::new(),
            sent: HashMap::new(),
        }
    }

    fn over_cap(&self, key: &str, worker: usize) -> bool {
        self.in_flight.get(&(key.to_owned(), worker)).copied().unwrap_or(0) >= STICKY_INFLIGHT_CAP
    }

    fn pin_front(&mut self, key: &str, worker: usize) {
        let pins = self.pins.entry(key.to_owned()).or_default();
        pins.retain(|&w| w != worker);
        pins.insert(0, worker);
        pins.truncate(2);
    }
}

/// `strip_lineage_suffixes`: a trailing `_r<digits>`, then `_t<digits>`.
fn routing_key(session: &str) -> &str {
    let strip = |s: &'_ str, tag: &str| -> Option<usize> {
        let at = s.rfind(tag)?;
        let digits = &s[at + tag.len()..];
        (!digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())).then_some(at)
    };
    let mut key = session;
    if let Some(at) = strip(key, "_r") {
        key = &key[..at];
    }
    if let Some(at) = strip(key, "_t") {
        key = &key[..at];
    }
    key
}

impl Policy for SglangSticky {
    fn pick(&mut self, r: &Prepared, view: &View<'_>) -> usize {
        if r.session.is_empty() {
            return self.cache_aware.pick(r, view);
        }
        let key = routing_key(&r.session).to_owned();
        let chosen = match self.pins.get(&key).and_then(|p| p.first()).copied() {
            Some(pinned) if !self.over_cap(&key, pinned) => pinned,
            Some(pinned) => {
                let again = self.cache_aware.pick(r, view);
                if again != pinned && !self.over_cap(&key, again) {
                    self.pin_front(&key, again);
                }
                again
            }
            None => {
                let first = self.cache_aware.pick(r, view);
                self.pin_front(&key, first);
                first
            }
        };
        *self.in_flight.entry((key, chosen)).or_insert(0) += 1;
        self.sent.insert(r.index, chosen);
        chosen
    }

    fn completed(&mut self, _worker: usize, r: &Prepared, _cached_tokens: u64, _ttft_ms: f64, _now_ms: f64) {
        let Some(worker) = self.sent.remove(&r.index) else {
            return;
        };
        let slot = (routing_key(&r.session).to_owned(), worker);
        if let Some(n) = self.in_flight.get_mut(&slot) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.in_flight.remove(&slot);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use kvmesh_sim::timing::TimingModel;

    use super::super::tests::{load, request, text};
    use super::*;
    use crate::simulate::world::World;

    #[test]
    fn the_gate_spills_a_holder_past_the_fleet_mean_by_both_margins() {
        // Mean 2: margin max(ceil(2·1.41), 4) = 4; 1.5 · 2 = 3.
        assert!(!over_gate(6.0, 2.0));
        assert!(over_gate(6.1, 2.0));
        // Mean 100: margin min(64, 20) = 20 and 1.5 · 100 = 150 both bind.
        assert!(!over_gate(150.0, 100.0));
        assert!(over_gate(151.0, 100.0));
        // Mean 10 000: the configured 64 caps the swing (200).
        assert!(over_gate(15_001.0, 10_000.0));
    }

    #[test]
    fn sglang_follows_the_match_until_its_holder_is_over_the_gate() {
        let mut world = World::new(2, 1_000_000, TimingModel::default());
        let mut sglang = SglangCacheAware::new(2, 1);
        let doc = text(1, 8);
        let w = sglang.pick(&request(0, "", &doc, 1), &world.view(0.0));
        // The same text again matches `w` above the threshold.
        assert_eq!(sglang.pick(&request(1, "", &doc, 1), &world.view(0.0)), w);
        // 5 in flight on `w`, none on the other: mean 2.5, `w` at 5 is over
        // 1.5 × 2.5 but not 2.5 + 4 above: still the match.
        load(&mut world, w, 5, 1);
        assert_eq!(sglang.pick(&request(2, "", &doc, 1), &world.view(1.0)), w);
        // 10 in flight: 10 > 1.5 × 5 but not > 5 + 5 (margin ceil(2·√5)).
        load(&mut world, w, 5, 1);
        assert_eq!(sglang.pick(&request(6, "", &doc, 1), &world.view(1.0)), w);
        // 11: over both margins (mean 5.5, 11 > 8.25 and > 10.5): the match
        // spills to the least loaded.
        load(&mut world, w, 1, 1);
        assert_eq!(sglang.pick(&request(3, "", &doc, 1), &world.view(1.0)), 1 - w);
        // A miss goes to the least loaded whatever the trees hold.
        assert_eq!(sglang.pick(&request(4, "", &text(2, 8), 1), &world.view(1.0)), 1 - w);
    }

    #[test]
    fn a_worker_just_sent_a_miss_looks_busier_until_the_next_load_poll() {
        let world = World::new(3, 1_000_000, TimingModel::default());
        let mut sglang = SglangCacheAware::new(3, 7);
        // Three new prefixes on an idle fleet within one poll period: the
        // since-poll credit sends each to a different worker.
        let mut picked: Vec<usize> = (0..3)
            .map(|i| sglang.pick(&request(i, "", &text(10 + i, 8), 1), &world.view(1_000.0)))
            .collect();
        picked.sort_unstable();
        assert_eq!(picked, [0, 1, 2]);
        // After the poll (nothing in flight: the credit is released), the
        // fourth is a uniform draw again, not forced off the first three.
        let fourth = sglang.pick(&request(3, "", &text(13, 8), 1), &world.view(11_000.0));
        assert!(fourth < 3);
        assert_eq!(sglang.since_poll.iter().sum::<f64>(), 1.0);
    }

    #[test]
    fn sglang_sticky_pins_a_sessions_first_placement_past_the_tree() {
        let world = World::new(2, 1_000_000, TimingModel::default());
        let mut sticky = SglangSticky::new(2, 1);
        let doc = text(1, 8);
        let first = request(0, "s1_t3", &doc, 1);
        let w = sticky.pick(&first, &world.view(0.0));
        sticky.completed(w, &first, 0, 0.0, 0.0);
        // Another session's text is recorded on the other worker by hand:
        // the tree now points s1's next text there, the pin does not follow.
        let moved = text(2, 8);
        sticky.cache_aware.tree.insert(moved.as_bytes(), 1 - w);
        assert_eq!(sticky.pick(&request(1, "s1_t4", &moved, 1), &world.view(1.0)), w);
        assert_eq!(sticky.pick(&request(2, "s1_t5", &moved, 1), &world.view(1.0)), w);
        // Two calls of s1 in flight on `w`: the third is placed afresh (the
        // tree sends it to the other worker) and the pin moves there.
        assert_eq!(sticky.pick(&request(3, "s1", &moved, 1), &world.view(1.0)), 1 - w);
        assert_eq!(sticky.pins.get("s1").map(|p| p[0]), Some(1 - w));
        assert_eq!(routing_key("conv_t2_r1"), "conv");
        assert_eq!(routing_key("gen-11-0"), "gen-11-0");
    }
}
