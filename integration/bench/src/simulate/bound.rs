//! Offline bounds on the hit rate any routing can reach on a workload, in
//! the engine's own blocks: the infinite cache (every block ever computed
//! stays) and the pooled Belady cache (every worker's KV, host tiers
//! included, as one cache that evicts the block needed furthest ahead, and
//! does not cache a block needed later than every block it holds).
//!
//! Why the pooled cache bounds every router: at any moment the blocks the
//! workers hold, taken together, fit in the pooled capacity and entered it
//! only when a request computed them; a request's hits on its own worker are
//! hits on that union. Belady's rule (with bypass) gets the most hits of any
//! cache of that capacity fed the same accesses. Each block counts as its
//! own hit, though an engine reuses only a leading run, so the bound can be
//! loose, never low. The accesses are in the workload's order; a closed-loop
//! run interleaves sessions by its own timing, so there the bound is for
//! the recorded order.

use std::collections::{BTreeSet, HashMap};

use kvmesh_sim::engine::block_chain;

/// The hit rates of the two offline caches on one workload.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Bounds {
    pub(crate) infinite_cache: f64,
    pub(crate) pooled_belady: f64,
}

/// Both bounds for `prompts` (in arrival order) over a pooled capacity of
/// `pooled_blocks` engine blocks of `block_tokens`.
pub(crate) fn bounds<'a>(
    prompts: impl IntoIterator<Item = &'a [u32]>,
    pooled_blocks: u64,
    block_tokens: u64,
) -> Bounds {
    // Every block access in order, each block interned to a small id.
    let mut ids: HashMap<[u8; 32], u32> = HashMap::new();
    let mut accesses: Vec<u32> = Vec::new();
    let mut prompt_tokens = 0u64;
    for prompt in prompts {
        prompt_tokens += prompt.len() as u64;
        for block in block_chain(prompt, block_tokens) {
            let next = u32::try_from(ids.len()).unwrap_or(u32::MAX);
            accesses.push(*ids.entry(block).or_insert(next));
        }
    }
    let rate = |hits: u64| (hits * block_tokens) as f64 / prompt_tokens.max(1) as f64;
    Bounds {
        infinite_cache: rate(accesses.len() as u64 - ids.len() as u64),
        pooled_belady: rate(belady_hits(&accesses, pooled_blocks)),
    }
}

/// Hits of an optimal offline cache of `capacity` blocks over `accesses`.
fn belady_hits(accesses: &[u32], capacity: u64) -> u64 {
    const NEVER: usize = usize::MAX;
    // next_use[i]: where accesses[i]'s block is needed next.
    let mut next_use = vec![NEVER; accesses.len()];
    let mut seen: HashMap<u32, usize> = HashMap::new();
    for (i, &block) in accesses.iter().enumerate().rev() {
        if let Some(next) = seen.insert(block, i) {
            next_use[i] = next;
        }
    }
    let capacity = usize::try_from(capacity).unwrap_or(usize::MAX);
    // The cached blocks by when each is needed next.
    let mut held: HashMap<u32, usize> = HashMap::new();
    let mut by_next: BTreeSet<(usize, u32)> = BTreeSet::new();
    let mut hits = 0;
    for (i, &block) in accesses.iter().enumerate() {
        let next = next_use[i];
        if let Some(was) = held.remove(&block) {
            hits += 1;
            by_next.remove(&(was, block));
        } else if next == NEVER || capacity == 0 {
            continue;
        } else if held.len() >= capacity {
            match by_next.last().copied() {
                Some((furthest, victim)) if furthest > next => {
                    by_next.remove(&(furthest, victim));
                    held.remove(&victim);
                }
                _ => continue,
            }
        }
        if next != NEVER {
            held.insert(block, next);
            by_next.insert((next, block));
        }
    }
    hits
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn belady_keeps_what_is_needed_soonest() {
        // Capacity 2 over A B C A B C A: LRU would miss every access;
        // Belady keeps A and B past C (needed later than both), then A
        // and C: A B C A(hit) B(hit) C(miss) A(hit).
        let (a, b, c) = (0, 1, 2);
        assert_eq!(belady_hits(&[a, b, c, a, b, c, a], 2), 3);
        assert_eq!(belady_hits(&[a, b, c, a, b, c, a], 3), 4);
        assert_eq!(belady_hits(&[a, b, c, a, b, c, a], 0), 0);
        // A block never needed again is not cached: it cannot push one out.
        assert_eq!(belady_hits(&[a, b, c, a, b], 2), 2);
    }

    #[test]
    fn the_pooled_bound_lies_between_nothing_and_the_infinite_cache() {
        let shared: Vec<u32> = (0..1_200).collect();
        let prompts: Vec<Vec<u32>> = (0..6u32)
            .map(|s| [shared.clone(), vec![5_000 + s; 500]].concat())
            .chain((0..6u32).map(|s| [shared.clone(), vec![5_000 + s; 1_000]].concat()))
            .collect();
        let views = || prompts.iter().map(Vec::as_slice);
        let roomy = bounds(views(), 1 << 20, 16);
        let tight = bounds(views(), 120, 16);
        assert!(roomy.infinite_cache > 0.5, "{roomy:?}");
        assert!((roomy.pooled_belady - roomy.infinite_cache).abs() < 1e-12, "{roomy:?}");
        assert_eq!(tight.infinite_cache, roomy.infinite_cache);
        assert!(tight.pooled_belady < tight.infinite_cache, "{tight:?}");
        // The shared prefix (75 blocks) fits and is used by every prompt.
        assert!(tight.pooled_belady > 0.4, "{tight:?}");
    }
}
