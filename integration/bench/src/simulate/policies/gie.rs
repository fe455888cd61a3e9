//! The Gateway API Inference Extension's endpoint picker in its default
//! profile: the approximate prefix-cache plugin (AutoTune on), the queue
//! and KV-cache-utilisation scorers, the max-score picker.
//!
//! The picker's code has moved from kubernetes-sigs/gateway-api-inference-
//! extension (whose snapshot 84436a96 holds only the API and conformance)
//! to llm-d/llm-d-inference-scheduler, read at 520af478, under
//! `pkg/epp/framework/plugins/`:
//! - `requestcontrol/dataproducer/approximateprefix/types.go` `defaultConfig`
//!   (AutoTune true, 16-token blocks, 256 blocks matched, 31,250 LRU entries
//!   only when the engine reports no `num_gpu_blocks`), `plugin.go`
//!   `Produce`, `PreRequest`, `makeserver`, `matchLongestPrefix`,
//!   `GetBlockSize`, `hashing.go` `hashPrompt` / `getUserInputBytes`,
//!   `indexer.go` `Add`;
//! - `scheduling/scorer/prefix/plugin.go` `Score` (matched / total blocks),
//!   `scorer/queuedepth/queue.go` `Score`, `scorer/kvcacheutilization/
//!   kvcache_utilization.go` `Score` (1 − `vllm:kv_cache_usage_perc`),
//!   `picker/maxscore/picker.go` `Pick` (shuffle, then stable sort);
//! - weights: `pkg/epp/config/loader/defaults.go` `loadDefaultConfig`
//!   (queue 2, kv-cache-utilization 2, prefix-cache 3).

use kvmesh_core::Lru;

use super::running::{RunningBlocks, vllm_kv_cache_usage};
use super::{Policy, Rng, argmax_random_ties, bytes_hash, engine_blocks, mix};
use crate::simulate::world::{Prepared, View};

/// `averageCharactersPerToken`: the block in bytes of the request body.
const CHARACTERS_PER_TOKEN: usize = 4;
/// `defaultMaxPrefixBlocks`: about 4,096 tokens at 16-token blocks.
const MAX_PREFIX_BLOCKS: usize = 256;
/// `maxPrefixBlocksToMatch` for long prompts: the value at which llm-d's
/// router docs find "hit rates improve significantly" (at an EPP CPU cost);
/// GIE's own guide (`site-src/guides/epp-configuration/prefix-aware.md`)
/// calls the setting the accuracy/performance trade-off. It is the
/// `gie_approx_prefix_6250` variant.
pub(crate) const LONG_PROMPT_PREFIX_BLOCKS: usize = 6_250;

/// `getUserInputBytes` of a chat call: the JSON of its `messages`.
fn user_input(r: &Prepared) -> Vec<u8> {
    let content = serde_json::to_string(&r.text).unwrap_or_default();
    format!(r#"[{{"role":"user","content":{content}}}]"#).into_bytes()
}

/// `hashPrompt`: the input cut at 256 blocks, chained hashes of its full
/// blocks seeded by the model, then of a partial last block if any. The
/// block is vLLM's block size as AutoTune reads it from
/// `vllm:cache_config_info`, in characters.
fn prompt_hashes(input: &[u8], block_size_tokens: u64, max_prefix_blocks: usize) -> Vec<u64> {
    let block = usize::try_from(block_size_tokens).unwrap_or(usize::MAX) * CHARACTERS_PER_TOKEN;
    if input.len() < block {
        return Vec::new();
    }
    let input = &input[..input.len().min(block.saturating_mul(max_prefix_blocks))];
    let mut prev = bytes_hash(b"sim");
    input
        .chunks(block)
        .map(|chunk| {
            prev = mix(prev, bytes_hash(chunk));
            prev
        })
        .collect()
}

pub(crate) struct GieApproxPrefix {
    /// Per server, created on its first `Add` with the engine's
    /// `num_gpu_blocks` (AutoTune), as `indexer.Add` does.
    servers: Vec<Option<Lru<u64>>>,
    running: RunningBlocks,
    rng: Rng,
    /// `maxPrefixBlocksToMatch`.
    max_prefix_blocks: usize,
}

impl GieApproxPrefix {
    pub(crate) fn new(workers: usize, seed: u64) -> Self {
        Self::matching(workers, seed, MAX_PREFIX_BLOCKS)
    }

    /// `maxPrefixBlocksToMatch` set to `max_prefix_blocks`.
    pub(crate) fn matching(workers: usize, seed: u64, max_prefix_blocks: usize) -> Self {
        Self {
            max_prefix_blocks,
            servers: vec![None; workers],
            running: RunningBlocks::new(workers),
            rng: Rng::new(seed),
        }
    }

    /// `matchLongestPrefix`: walk the hashes from the first, stop at the
    /// first no server holds, and count for each server the ones it holds
    /// along the way (so a server missing an early block still scores the
    /// later ones others kept the run going for).
    fn match_longest_prefix(&self, hashes: &[u64]) -> Vec<usize> {
        let mut matched = vec![0; self.servers.len()];
        for h in hashes {
            let mut any = false;
            for (w, lru) in self.servers.iter().enumerate() {
                if lru.as_ref().is_some_and(|lru| lru.contains(h)) {
                    matched[w] += 1;
                    any = true;
                }
            }
            if !any {
                break;
            }
        }
        matched
    }

    /// The default profile's weighted sum per server.
    fn scores(prefix: &[f64], waiting: &[usize], usage: &[f64]) -> Vec<f64> {
        let queue = queue_scores(waiting);
        (0..prefix.len())
            .map(|w| 3.0 * prefix[w] + 2.0 * queue[w] + 2.0 * (1.0 - usage[w]))
            .collect()
    }
}

/// The queue scorer: (max − q)/(max − min) of `vllm:num_requests_waiting`,
/// 1 for all when they are equal.
pub(super) fn queue_scores(waiting: &[usize]) -> Vec<f64> {
    let (min, max) = (
        waiting.iter().copied().min().unwrap_or(0),
        waiting.iter().copied().max().unwrap_or(0),
    );
    waiting
        .iter()
        .map(|&q| {
            if max == min {
                1.0
            } else {
                (max - q) as f64 / (max - min) as f64
            }
        })
        .collect()
}

impl Policy for GieApproxPrefix {
    fn pick(&mut self, r: &Prepared, view: &View<'_>) -> usize {
        let hashes = prompt_hashes(&user_input(r), view.block_tokens(), self.max_prefix_blocks);
        let matched = self.match_longest_prefix(&hashes);
        let prefix: Vec<f64> = matched
            .iter()
            .map(|&m| {
                if hashes.is_empty() {
                    0.0
                } else {
                    m as f64 / hashes.len() as f64
                }
            })
            .collect();
        let waiting: Vec<usize> = (0..view.workers()).map(|w| view.waiting(w)).collect();
        let usage: Vec<f64> = (0..view.workers())
            .map(|w| vllm_kv_cache_usage(&self.running, w, view))
            .collect();
        let chosen = argmax_random_ties(&Self::scores(&prefix, &waiting, &usage), &mut self.rng);
        // `PreRequest`: the chosen server's LRU learns the hashes in order.
        if let Some(slot) = self.servers.get_mut(chosen) {
            let capacity = usize::try_from(view.num_gpu_blocks(chosen))
                .unwrap_or(usize::MAX)
                .max(1);
            let lru = slot.get_or_insert_with(|| Lru::new(capacity));
            for &h in &hashes {
                lru.touch(h);
            }
        }
        self.running
            .add(r.index, chosen, engine_blocks(&r.tokens, view.block_tokens()));
        chosen
    }

    fn completed(&mut self, _worker: usize, r: &Prepared, _cached_tokens: u64, _ttft_ms: f64, _now_ms: f64) {
        self.running.free(r.index);
    }
}

#[cfg(test)]
mod tests {
    use kvmesh_sim::timing::TimingModel;

    use super::super::tests::{request, text};
    use super::*;
    use crate::simulate::world::World;

    #[test]
    fn max_prefix_blocks_bounds_the_hashed_window() {
        // 16-token blocks of 4 characters a token: 64 bytes a block.
        let input = vec![b'x'; 64 * 300];
        assert_eq!(prompt_hashes(&input, 16, MAX_PREFIX_BLOCKS).len(), 256);
        assert_eq!(prompt_hashes(&input, 16, LONG_PROMPT_PREFIX_BLOCKS).len(), 300);
        // Two prompts that differ past the default window hash alike there.
        let mut other = input.clone();
        other[64 * 280] = b'y';
        assert_eq!(
            prompt_hashes(&input, 16, MAX_PREFIX_BLOCKS),
            prompt_hashes(&other, 16, MAX_PREFIX_BLOCKS)
        );
        assert_ne!(
            prompt_hashes(&input, 16, LONG_PROMPT_PREFIX_BLOCKS),
            prompt_hashes(&other, 16, LONG_PROMPT_PREFIX_BLOCKS)
        );
    }

    #[test]
    fn autotune_sizes_each_servers_lru_from_the_engines_blocks() {
        // 100k tokens of KV in 16-token blocks: 6,250 entries, not 31,250.
        let world = World::new(2, 100_000, TimingModel::default());
        let mut gie = GieApproxPrefix::new(2, 1);
        let w = gie.pick(&request(0, "", &text(1, 2), 1), &world.view(0.0));
        assert_eq!(gie.servers[w].as_ref().map(Lru::capacity), Some(6_250));
    }

    #[test]
    fn kv_utilisation_counts_evictable_cached_blocks_as_free() {
        // 4,096 tokens: 256 blocks, 255 without vLLM's null block.
        let mut world = World::new(2, 4_096, TimingModel::default());
        let mut gie = GieApproxPrefix::new(2, 1);
        let r = request(0, "", &text(2, 2), 1);
        let w = gie.pick(&r, &world.view(0.0));
        let served = world.serve(w, &r, 0.0);
        let blocks = engine_blocks(&r.tokens, 16).len();
        assert!(blocks > 16, "{blocks}");
        // Running: its blocks are in use.
        let running = vllm_kv_cache_usage(&gie.running, w, &world.view(0.0));
        assert_eq!(running, blocks as f64 / 255.0);
        // Finished: its blocks stay cached on the engine, but are free.
        gie.completed(w, &r, served.cached_tokens, served.ttft_ms, 0.0);
        let view = world.view(served.end_ms + 1.0);
        assert!(view.kv_usage(w) > 0.0);
        assert_eq!(vllm_kv_cache_usage(&gie.running, w, &view), 0.0);
    }

    #[test]
    fn longest_prefix_counts_a_servers_blocks_within_the_global_run() {
        let mut gie = GieApproxPrefix::new(3, 1);
        let lru = |blocks: &[u64]| {
            let mut lru = Lru::new(100);
            for &b in blocks {
                lru.touch(b);
            }
            Some(lru)
        };
        gie.servers = vec![lru(&[1, 2, 3]), lru(&[2, 3]), lru(&[4])];
        // Block 1: {0}; 2: {0, 1}; 3: {0, 1}; 4 is never reached (5 ends the run).
        assert_eq!(gie.match_longest_prefix(&[1, 2, 3, 5, 4]), vec![3, 2, 0]);
        // A first block no one holds ends it at once.
        assert_eq!(gie.match_longest_prefix(&[9, 1, 2]), vec![0, 0, 0]);
    }

    #[test]
    fn gie_weighs_prefix_three_against_queue_and_kv_two_each() {
        // Server 0: full prefix, the longest queue, half its KV in use:
        // 3 + 0 + 1 = 4. Server 1: nothing cached, idle: 0 + 2 + 2 = 4.
        let scores = GieApproxPrefix::scores(&[1.0, 0.0], &[4, 0], &[0.5, 0.0]);
        assert_eq!(scores, vec![4.0, 4.0]);
        // A little more KV in use on server 0 tips it to server 1; a
        // shorter queue (2 of 4 → 0.5) tips it back.
        let scores = GieApproxPrefix::scores(&[1.0, 0.0, 0.0], &[4, 0, 4], &[0.6, 0.0, 0.0]);
        assert_eq!(argmax_random_ties(&scores, &mut Rng::new(1)), 1);
        let scores = GieApproxPrefix::scores(&[1.0, 0.0, 0.0], &[2, 0, 4], &[0.6, 0.0, 0.0]);
        assert_eq!(argmax_random_ties(&scores, &mut Rng::new(1)), 0);
        // And through a pick: the prefix brings the same text back.
        let world = World::new(2, 1_000_000, TimingModel::default());
        let mut gie = GieApproxPrefix::new(2, 1);
        let doc = text(3, 8);
        let first = gie.pick(&request(0, "", &doc, 1), &world.view(0.0));
        gie.completed(first, &request(0, "", &doc, 1), 0, 0.0, 0.0);
        assert_eq!(gie.pick(&request(1, "", &doc, 1), &world.view(0.0)), first);
    }
}
