//! llm-d's precise-prefix configuration of its endpoint picker: the
//! precise prefix-cache scorer (an index of the engines' KV events) ×2,
//! KV-cache utilisation ×1, queue ×1, the max-score picker.
//!
//! Read at llm-d/llm-d-inference-scheduler 520af478:
//! `deploy/config/epp-precise-prefix-cache-config.yaml` (the weights);
//! `pkg/epp/framework/plugins/scheduling/scorer/preciseprefixcache/
//! precise_prefix_cache.go` `Scorer::Score` and `utils.go`
//! `absoluteScoredPods` (matched blocks / the request's blocks, clipped to
//! 1; speculative indexing off by default, per its README); the queue and
//! KV-utilisation scorers and the max-score picker as in `gie.rs`.

use super::gie::queue_scores;
use super::running::{RunningBlocks, vllm_kv_cache_usage};
use super::{Policy, Rng, argmax_random_ties, engine_blocks};
use crate::simulate::world::{Prepared, View};

pub(crate) struct LlmDPrecise {
    running: RunningBlocks,
    rng: Rng,
}

impl LlmDPrecise {
    pub(crate) fn new(workers: usize, seed: u64) -> Self {
        Self {
            running: RunningBlocks::new(workers),
            rng: Rng::new(seed),
        }
    }

    /// The profile's weighted sum per endpoint.
    fn scores(prefix: &[f64], waiting: &[usize], usage: &[f64]) -> Vec<f64> {
        let queue = queue_scores(waiting);
        (0..prefix.len())
            .map(|w| 2.0 * prefix[w] + (1.0 - usage[w]) + queue[w])
            .collect()
    }
}

impl Policy for LlmDPrecise {
    fn pick(&mut self, r: &Prepared, view: &View<'_>) -> usize {
        let block_tokens = view.block_tokens();
        let blocks = engine_blocks(&r.tokens, block_tokens);
        // The index's blocks are the engine's (the sample config's
        // `blockSize` must equal the engine's for the hashes to match; the
        // simulated engine's is vLLM's default 16 unless set).
        let prefix: Vec<f64> = (0..view.workers())
            .map(|w| {
                if blocks.is_empty() {
                    return 0.0;
                }
                let matched = view.true_gpu_cached_tokens(w, &r.tokens) / block_tokens;
                (matched as f64 / blocks.len() as f64).min(1.0)
            })
            .collect();
        let waiting: Vec<usize> = (0..view.workers()).map(|w| view.waiting(w)).collect();
        let usage: Vec<f64> = (0..view.workers())
            .map(|w| vllm_kv_cache_usage(&self.running, w, view))
            .collect();
        let chosen = argmax_random_ties(&Self::scores(&prefix, &waiting, &usage), &mut self.rng);
        self.running.add(r.index, chosen, blocks);
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
    fn llm_d_precise_weighs_prefix_two_against_kv_and_queue_one_each() {
        // Endpoint 0: 80 % cached, the longest queue, KV half in use:
        // 1.6 + 0.5 + 0 = 2.1. Endpoint 1: idle, nothing cached: 0 + 1 + 1 = 2.
        let scores = LlmDPrecise::scores(&[0.8, 0.0], &[3, 1], &[0.5, 0.0]);
        assert_eq!(argmax_random_ties(&scores, &mut Rng::new(1)), 0);
        assert!((scores[0] - 2.1).abs() < 1e-12 && scores[1] == 2.0, "{scores:?}");
        // GIE's 3/2/2 on the same figures goes the other way (3.4 < 4).
        let gie: Vec<f64> = (0..2)
            .map(|w| 3.0 * [0.8, 0.0][w] + 2.0 * [0.0, 1.0][w] + 2.0 * (1.0 - [0.5, 0.0][w]))
            .collect();
        assert!(gie[0] < gie[1]);
        // At 60 % cached, 1.2 + 0.5 = 1.7 < 2: the idle endpoint.
        let scores = LlmDPrecise::scores(&[0.6, 0.0], &[3, 1], &[0.5, 0.0]);
        assert_eq!(argmax_random_ties(&scores, &mut Rng::new(1)), 1);
    }

    #[test]
    fn llm_d_precise_reads_the_true_cache() {
        let mut world = World::new(3, 1_000_000, TimingModel::default());
        let doc = request(0, "", &text(4, 8), 1);
        world.serve(1, &doc, 0.0);
        let mut llm_d = LlmDPrecise::new(3, 1);
        // Finished by 100 s: cached on endpoint 1 only, every queue empty.
        assert_eq!(llm_d.pick(&request(1, "", &text(4, 8), 1), &world.view(100_000.0)), 1);
        // Two long prompts now waiting on endpoint 1 cost it the queue
        // scorer's whole 1, less than the full prefix is worth (2): still 1.
        for i in 0..2 {
            world.serve(1, &request(10 + i, "", &text(50 + i, 64), 4000), 100_000.0);
        }
        assert_eq!(world.view(100_000.0).waiting(1), 2);
        assert_eq!(llm_d.pick(&request(2, "", &text(4, 8), 1), &world.view(100_000.0)), 1);
    }
}
