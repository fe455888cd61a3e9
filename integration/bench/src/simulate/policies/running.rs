//! The KV blocks each worker's running requests hold, reference-counted so
//! a prefix shared by several of them counts once: Dynamo's router keeps
//! exactly this of its own requests (`ActiveSequences`), and vLLM's
//! `kv_cache_usage_perc` is this over the engine's capacity.

use std::collections::HashMap;

use crate::simulate::world::View;

/// Requests routed and not yet finished, and the unique blocks they hold.
#[derive(Debug, Default)]
pub(super) struct RunningBlocks {
    /// Per worker: block → how many running requests hold it.
    held: Vec<HashMap<u64, u32>>,
    /// Request index → (worker, its blocks).
    requests: HashMap<usize, (usize, Vec<u64>)>,
}

impl RunningBlocks {
    pub(super) fn new(workers: usize) -> Self {
        Self {
            held: vec![HashMap::new(); workers],
            requests: HashMap::new(),
        }
    }

    /// Request `index` runs on `worker`, holding `blocks`.
    pub(super) fn add(&mut self, index: usize, worker: usize, blocks: Vec<u64>) {
        let Some(held) = self.held.get_mut(worker) else {
            return;
        };
        for &b in &blocks {
            *held.entry(b).or_default() += 1;
        }
        if let Some((old_worker, old)) = self.requests.insert(index, (worker, blocks)) {
            // The same request routed twice: drop its first holding.
            self.release(old_worker, &old);
        }
    }

    /// Request `index` finished: its blocks are released.
    pub(super) fn free(&mut self, index: usize) {
        if let Some((worker, blocks)) = self.requests.remove(&index) {
            self.release(worker, &blocks);
        }
    }

    fn release(&mut self, worker: usize, blocks: &[u64]) {
        let Some(held) = self.held.get_mut(worker) else {
            return;
        };
        for b in blocks {
            if let Some(n) = held.get_mut(b) {
                *n -= 1;
                if *n == 0 {
                    held.remove(b);
                }
            }
        }
    }

    /// Distinct blocks the running requests on `worker` hold.
    pub(super) fn unique(&self, worker: usize) -> usize {
        self.held.get(worker).map_or(0, HashMap::len)
    }

    /// How many of `blocks`, from the first, are already held on `worker`:
    /// Dynamo counts a new request's shared blocks by prefix membership, so
    /// a block held again after a gap is still new.
    pub(super) fn shared_prefix(&self, worker: usize, blocks: &[u64]) -> usize {
        self.held
            .get(worker)
            .map_or(0, |held| blocks.iter().take_while(|b| held.contains_key(b)).count())
    }
}

/// vLLM's `kv_cache_usage_perc` (`vllm/v1/core/block_pool.py`
/// `BlockPool::get_usage`: 1 − free / (num_gpu_blocks − 1), the null block
/// left out), in which a cached block no running request holds is free:
/// evictable, so not "used". In the simulator every request passes the
/// router, so the router's running set is the engine's.
pub(super) fn vllm_kv_cache_usage(running: &RunningBlocks, worker: usize, view: &View<'_>) -> f64 {
    let total = view.num_gpu_blocks(worker).saturating_sub(1);
    if total == 0 {
        return 0.0;
    }
    (running.unique(worker) as f64 / total as f64).min(1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_shared_by_two_running_requests_is_held_once() {
        let mut running = RunningBlocks::new(2);
        running.add(0, 0, vec![1, 2, 3]);
        running.add(1, 0, vec![1, 2, 4]);
        // {1, 2, 3, 4}: 4 blocks, not 6.
        assert_eq!(running.unique(0), 4);
        assert_eq!(running.unique(1), 0);
        // Dynamo's `potential_blocks_use_prefix_membership_not_set_membership`:
        // held {1, 2, 4, 5}, a request [1, 2, 3, 5] shares 2 (5 comes after a gap).
        let mut dynamo = RunningBlocks::new(1);
        dynamo.add(0, 0, vec![1, 2, 4, 5]);
        assert_eq!(dynamo.shared_prefix(0, &[1, 2, 3, 5]), 2);
        // Freeing one keeps the other's blocks; freeing both empties the worker.
        running.free(0);
        assert_eq!(running.unique(0), 3);
        running.free(1);
        assert_eq!(running.unique(0), 0);
        running.free(1);
        assert_eq!(running.unique(0), 0);
    }
}
