//! The SGLang model gateway's `cache_aware` policy over HTTP (its
//! approximate string tree; no KV events, no tokens).
//!
//! The gateway left sgl-project/sglang (`sgl-model-gateway`) for
//! lightseekorg/smg, read at 73da68ca: `model_gateway/src/policies/
//! cache_aware.rs` `CacheAwarePolicy::select_worker`, `is_imbalanced`,
//! `select_worker_with_text`, `select_worker_min_load`; the command line's
//! defaults in `model_gateway/src/main.rs` (`cache_threshold` 0.3,
//! `balance_abs_threshold` 64, `balance_rel_threshold` 1.5,
//! `max_tree_size` 2^26, both token-usage triggers 1.0, that is off); and
//! `crates/kv_index/src/string_tree.rs` `match_prefix_with_counts`.

use super::Policy;
use crate::simulate::radix::RadixTree;
use crate::simulate::world::{Prepared, View};

const CACHE_THRESHOLD: f64 = 0.3;
const BALANCE_ABS_THRESHOLD: usize = 64;
const BALANCE_REL_THRESHOLD: f64 = 1.5;
const MAX_TREE_SIZE: usize = 1 << 26;

/// One character tree recording which worker was sent which text (each
/// worker's share bounded, its least recently used leaves evicted), and
/// each worker's count of requests routed (`processed`).
pub(crate) struct SglangCacheAware {
    tree: RadixTree,
    processed: Vec<usize>,
}

impl SglangCacheAware {
    pub(crate) fn new(workers: usize) -> Self {
        Self {
            tree: RadixTree::new(workers, MAX_TREE_SIZE),
            processed: vec![0; workers],
        }
    }
}

impl Policy for SglangCacheAware {
    fn pick(&mut self, r: &Prepared, view: &View<'_>) -> usize {
        let text = r.text.as_bytes();
        // The gateway's load is its own count of requests in flight.
        let loads: Vec<usize> = (0..view.workers()).map(|w| view.in_flight(w)).collect();
        let (min, max) = (
            loads.iter().min().copied().unwrap_or(0),
            loads.iter().max().copied().unwrap_or(0),
        );
        // The least loaded, ties by requests processed, then index (#1714).
        let least_loaded = (0..view.workers())
            .min_by_key(|&w| (loads[w], self.processed[w], w))
            .unwrap_or(0);
        let imbalanced =
            max.saturating_sub(min) > BALANCE_ABS_THRESHOLD && max as f64 > BALANCE_REL_THRESHOLD * min as f64;
        let chosen = if imbalanced {
            least_loaded
        } else {
            // The deepest match in the tree and a worker holding it (upstream
            // takes that node's cached tenant, an arbitrary one of them; here
            // the lowest index).
            let matched = self.tree.matched(text);
            let best = (0..view.workers())
                .max_by_key(|&w| (matched[w], std::cmp::Reverse(w)))
                .unwrap_or(0);
            let rate = matched[best] as f64 / text.len().max(1) as f64;
            // A miss goes to the least loaded: the smallest tree, the older
            // choice, herded every new prefix onto one worker.
            if rate > CACHE_THRESHOLD { best } else { least_loaded }
        };
        // Every branch, the imbalanced one too, records the text for the pick.
        self.tree.insert(text, chosen);
        if let Some(n) = self.processed.get_mut(chosen) {
            *n += 1;
        }
        chosen
    }
}

#[cfg(test)]
mod tests {
    use kvmesh_sim::timing::TimingModel;

    use super::super::tests::{load, request, text};
    use super::*;
    use crate::simulate::world::World;

    #[test]
    fn sglang_follows_the_match_then_balances_past_its_thresholds() {
        let mut world = World::new(2, 1_000_000, TimingModel::default());
        let mut sglang = SglangCacheAware::new(2);
        let doc = text(1, 8);
        // First sight: no match, no load, none processed → worker 0.
        assert_eq!(sglang.pick(&request(0, "", &doc, 1), &world.view(0.0)), 0);
        // The same text again matches worker 0 above the threshold.
        assert_eq!(sglang.pick(&request(1, "", &doc, 1), &world.view(0.0)), 0);
        // A new text: loads equal, worker 0 has processed 2 → worker 1.
        assert_eq!(sglang.pick(&request(2, "", &text(2, 8), 1), &world.view(0.0)), 1);
        // 70 requests in flight on worker 0, none on 1: max − min > 64 and
        // max > 1.5 · min → least loaded, whatever the match.
        load(&mut world, 0, 70, 1);
        assert_eq!(sglang.pick(&request(3, "", &doc, 1), &world.view(1.0)), 1);
    }

    #[test]
    fn sglang_sends_a_miss_to_the_least_loaded_not_the_smallest_tree() {
        let mut world = World::new(2, 1_000_000, TimingModel::default());
        let mut sglang = SglangCacheAware::new(2);
        // Worker 0 busy with 3 requests (balanced: 3 − 0 ≤ 64).
        load(&mut world, 0, 3, 1);
        assert_eq!(sglang.pick(&request(0, "", &text(1, 8), 1), &world.view(1.0)), 1);
        // Worker 1 now holds the bigger tree, worker 0 an empty one.
        assert!(sglang.tree.size(1) > sglang.tree.size(0));
        // Another new text: still the least loaded, worker 1 (the smallest
        // tree would have been worker 0).
        assert_eq!(sglang.pick(&request(1, "", &text(2, 8), 1), &world.view(1.0)), 1);
    }
}
