//! `PrefixIndex` against a plain reference model (a list per worker, oldest
//! first) under random insert / evict / lookup / clear sequences, and with
//! host tiers against one with a host list beside each GPU list.

use proptest::prelude::*;

use crate::{PrefixIndex, WorkerId};

#[derive(Debug, Clone)]
enum Op {
    Insert {
        worker: usize,
        blocks: Vec<u64>,
    },
    /// As the router places a request: a lookup, then the insert on one
    /// worker (which reuses the lookup's walk). `again` continues an
    /// earlier request: its first `keep` blocks, then `blocks` (an
    /// agent's next call, whose prefix moves as one run).
    Place {
        worker: usize,
        again: Option<(usize, usize)>,
        blocks: Vec<u64>,
    },
    Lookup {
        blocks: Vec<u64>,
    },
    DropOldest {
        worker: usize,
        count: usize,
    },
    SetCapacity {
        worker: usize,
        capacity: usize,
    },
    Clear {
        worker: usize,
    },
}

const WORKERS: usize = 4;

fn op() -> impl Strategy<Value = Op> {
    // Small hash space so blocks are shared between workers and requests.
    let blocks = prop::collection::vec(0u64..40, 0..12);
    prop_oneof![
        4 => (0..WORKERS, blocks.clone()).prop_map(|(worker, blocks)| Op::Insert { worker, blocks }),
        3 => (0..WORKERS, prop::option::of((0usize..64, 0usize..12)), blocks.clone())
            .prop_map(|(worker, again, blocks)| Op::Place { worker, again, blocks }),
        3 => blocks.prop_map(|blocks| Op::Lookup { blocks }),
        1 => (0..WORKERS, 0usize..6).prop_map(|(worker, count)| Op::DropOldest { worker, count }),
        1 => (0..WORKERS, 1usize..30).prop_map(|(worker, capacity)| Op::SetCapacity { worker, capacity }),
        1 => (0..WORKERS).prop_map(|worker| Op::Clear { worker }),
    ]
}

/// The reference: per worker, its blocks oldest first, and its capacity.
#[derive(Debug)]
struct Model {
    lists: Vec<Vec<u64>>,
    capacity: Vec<usize>,
}

impl Model {
    fn trim(&mut self, w: usize) -> usize {
        let over = self.lists[w].len().saturating_sub(self.capacity[w]);
        self.lists[w].drain(..over);
        over
    }

    fn insert(&mut self, w: usize, blocks: &[u64]) -> usize {
        for b in blocks.iter().rev() {
            self.lists[w].retain(|x| x != b);
            self.lists[w].push(*b);
        }
        self.trim(w)
    }

    fn overlap(&self, w: usize, blocks: &[u64]) -> usize {
        blocks.iter().take_while(|b| self.lists[w].contains(b)).count()
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    #[test]
    fn index_matches_the_reference_model(ops in prop::collection::vec(op(), 1..80)) {
        let mut index = PrefixIndex::new();
        let mut model = Model { lists: vec![Vec::new(); WORKERS], capacity: vec![16; WORKERS] };
        for _ in 0..WORKERS {
            index.add_worker(16);
        }
        let mut overlaps = Vec::new();
        let mut placed: Vec<Vec<u64>> = Vec::new();
        for op in ops {
            match op {
                Op::Insert { worker, blocks } => {
                    // A request's blocks are distinct (they are a hash chain).
                    let mut seen = std::collections::HashSet::new();
                    let blocks: Vec<u64> = blocks.into_iter().filter(|b| seen.insert(*b)).collect();
                    let evicted = index.insert(WorkerId(worker), &blocks);
                    prop_assert_eq!(evicted, model.insert(worker, &blocks));
                }
                Op::Place { worker, again, blocks } => {
                    let mut request = match again {
                        Some((i, keep)) if !placed.is_empty() => {
                            let earlier = &placed[i % placed.len()];
                            earlier[..keep.min(earlier.len())].to_vec()
                        }
                        _ => Vec::new(),
                    };
                    request.extend(blocks);
                    let mut seen = std::collections::HashSet::new();
                    request.retain(|b| seen.insert(*b));
                    // As the router places a request: the walk, then the
                    // placement of the blocks walked.
                    let walk = index.overlaps_by_tier(&request, &mut overlaps, None);
                    for (w, overlap) in overlaps.iter().enumerate() {
                        prop_assert_eq!(*overlap, model.overlap(w, &request), "worker {}", w);
                    }
                    let evicted = index.insert_walked(WorkerId(worker), walk);
                    prop_assert_eq!(evicted, model.insert(worker, &request));
                    placed.push(request);
                }
                Op::Lookup { blocks } => {
                    index.overlaps(&blocks, &mut overlaps);
                    for (w, overlap) in overlaps.iter().enumerate() {
                        prop_assert_eq!(*overlap, model.overlap(w, &blocks), "worker {}", w);
                    }
                }
                Op::DropOldest { worker, count } => {
                    let dropped = index.drop_oldest(WorkerId(worker), count);
                    let expected = count.min(model.lists[worker].len());
                    model.lists[worker].drain(..expected);
                    prop_assert_eq!(dropped, expected);
                }
                Op::SetCapacity { worker, capacity } => {
                    model.capacity[worker] = capacity;
                    prop_assert_eq!(index.set_capacity(WorkerId(worker), capacity), model.trim(worker));
                }
                Op::Clear { worker } => {
                    index.clear_worker(WorkerId(worker));
                    model.lists[worker].clear();
                }
            }
            for w in 0..WORKERS {
                prop_assert_eq!(index.blocks_oldest_first(WorkerId(w)), model.lists[w].clone());
                prop_assert_eq!(index.len(WorkerId(w)), model.lists[w].len());
            }
            prop_assert_eq!(index.entries(), model.lists.iter().map(Vec::len).sum::<usize>());
            index.check_holder_sets();
        }
    }
}

/// The index with host tiers against a reference model: per worker a GPU
/// list and a host list, oldest first. GPU overflow and demotions move
/// blocks to the host list (when the worker has a host tier), a full host
/// list forgets its oldest, a placement brings host blocks back.
#[derive(Debug, Clone)]
enum TierOp {
    Insert { worker: usize, blocks: Vec<u64> },
    Lookup { blocks: Vec<u64> },
    Demote { worker: usize, count: usize },
    DropHost { worker: usize, count: usize },
    DropOldest { worker: usize, count: usize },
    SetHostCapacity { worker: usize, capacity: usize },
    Clear { worker: usize },
}

fn tier_op() -> impl Strategy<Value = TierOp> {
    let blocks = prop::collection::vec(0u64..40, 0..12);
    prop_oneof![
        4 => (0..WORKERS, blocks.clone()).prop_map(|(worker, blocks)| TierOp::Insert { worker, blocks }),
        3 => blocks.prop_map(|blocks| TierOp::Lookup { blocks }),
        1 => (0..WORKERS, 0usize..6).prop_map(|(worker, count)| TierOp::Demote { worker, count }),
        1 => (0..WORKERS, 0usize..6).prop_map(|(worker, count)| TierOp::DropHost { worker, count }),
        1 => (0..WORKERS, 0usize..6).prop_map(|(worker, count)| TierOp::DropOldest { worker, count }),
        1 => (0..WORKERS, 0usize..12).prop_map(|(worker, capacity)| TierOp::SetHostCapacity { worker, capacity }),
        1 => (0..WORKERS).prop_map(|worker| TierOp::Clear { worker }),
    ]
}

#[derive(Debug)]
struct TierModel {
    gpu: Vec<Vec<u64>>,
    host: Vec<Vec<u64>>,
    host_capacity: Vec<usize>,
}

const GPU_CAPACITY: usize = 10;

impl TierModel {
    fn trim_host(&mut self, w: usize) -> usize {
        let over = self.host[w].len().saturating_sub(self.host_capacity[w]);
        self.host[w].drain(..over);
        over
    }

    fn insert(&mut self, w: usize, blocks: &[u64]) -> usize {
        for b in blocks.iter().rev() {
            self.gpu[w].retain(|x| x != b);
            self.host[w].retain(|x| x != b);
            self.gpu[w].push(*b);
        }
        let over = self.gpu[w].len().saturating_sub(GPU_CAPACITY);
        let out: Vec<u64> = self.gpu[w].drain(..over).collect();
        if self.host_capacity[w] > 0 {
            self.host[w].extend(out);
            self.trim_host(w);
        }
        over
    }

    fn overlap(&self, w: usize, blocks: &[u64]) -> (usize, usize) {
        let run: Vec<&u64> = blocks
            .iter()
            .take_while(|b| self.gpu[w].contains(b) || self.host[w].contains(b))
            .collect();
        (run.len(), run.iter().filter(|b| self.host[w].contains(b)).count())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    #[test]
    fn tiered_index_matches_the_reference_model(ops in prop::collection::vec(tier_op(), 1..80)) {
        let mut index = PrefixIndex::new();
        let mut model = TierModel {
            gpu: vec![Vec::new(); WORKERS],
            host: vec![Vec::new(); WORKERS],
            host_capacity: vec![0, 4, 8, 0],
        };
        for w in 0..WORKERS {
            let id = index.add_worker(GPU_CAPACITY);
            index.set_host_capacity(id, model.host_capacity[w]);
        }
        let (mut overlaps, mut host) = (Vec::new(), Vec::new());
        for op in ops {
            match op {
                TierOp::Insert { worker, blocks } => {
                    let mut seen = std::collections::HashSet::new();
                    let blocks: Vec<u64> = blocks.into_iter().filter(|b| seen.insert(*b)).collect();
                    // Walked first, as the router places a request (a walk
                    // over host-only blocks must not be taken as a GPU run).
                    let walk = index.overlaps_by_tier(&blocks, &mut overlaps, Some(&mut host));
                    prop_assert_eq!(index.insert_walked(WorkerId(worker), walk), model.insert(worker, &blocks));
                }
                TierOp::Lookup { blocks } => {
                    index.overlaps_by_tier(&blocks, &mut overlaps, Some(&mut host));
                    for w in 0..WORKERS {
                        prop_assert_eq!((overlaps[w], host[w]), model.overlap(w, &blocks), "worker {}", w);
                    }
                }
                TierOp::Demote { worker, count } => {
                    let moved = index.demote_oldest(WorkerId(worker), count);
                    let k = count.min(model.gpu[worker].len());
                    let out: Vec<u64> = model.gpu[worker].drain(..k).collect();
                    model.host[worker].extend(out);
                    model.trim_host(worker);
                    prop_assert_eq!(moved, k);
                }
                TierOp::DropHost { worker, count } => {
                    let k = count.min(model.host[worker].len());
                    model.host[worker].drain(..k);
                    prop_assert_eq!(index.drop_oldest_host(WorkerId(worker), count), k);
                }
                TierOp::DropOldest { worker, count } => {
                    let k = count.min(model.gpu[worker].len());
                    model.gpu[worker].drain(..k);
                    prop_assert_eq!(index.drop_oldest(WorkerId(worker), count), k);
                }
                TierOp::SetHostCapacity { worker, capacity } => {
                    model.host_capacity[worker] = capacity;
                    prop_assert_eq!(index.set_host_capacity(WorkerId(worker), capacity), model.trim_host(worker));
                }
                TierOp::Clear { worker } => {
                    index.clear_worker(WorkerId(worker));
                    model.gpu[worker].clear();
                    model.host[worker].clear();
                }
            }
            for w in 0..WORKERS {
                prop_assert_eq!(index.blocks_oldest_first(WorkerId(w)), model.gpu[w].clone());
                prop_assert_eq!(index.host_len(WorkerId(w)), model.host[w].len());
            }
            let all: usize = model.gpu.iter().chain(&model.host).map(Vec::len).sum();
            prop_assert_eq!(index.entries(), all);
            index.check_holder_sets();
        }
    }
}

/// A flood of unique prefixes, far more than the caches' capacities allow,
/// stays within the byte budget, and the newest prefix is still indexed.
#[test]
fn unique_prefix_flood_respects_the_byte_budget() {
    let budget = 8 << 20;
    let mut index = PrefixIndex::new();
    let entries = index.set_byte_budget(budget);
    let workers: Vec<WorkerId> = (0..8).map(|_| index.add_worker(usize::MAX)).collect();
    let mut next = 1u64;
    let mut overlaps = Vec::new();
    for round in 0..4_000 {
        let blocks: Vec<u64> = (next..next + 100)
            .map(|n| n.wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .collect();
        next += 100;
        index.insert(workers[round % workers.len()], &blocks);
        assert!(index.entries() <= entries, "{} entries over {entries}", index.entries());
        if round % 500 == 499 {
            assert!(
                index.memory_bytes() <= budget,
                "{} B over {budget} B",
                index.memory_bytes()
            );
            index.overlaps(&blocks, &mut overlaps);
            assert_eq!(
                overlaps[round % workers.len()],
                blocks.len(),
                "the newest prefix was evicted"
            );
        }
    }
    // 400,000 entries were offered; the budget kept a fraction, evenly.
    assert!(index.entries() > entries * 9 / 10);
    let lens: Vec<usize> = workers.iter().map(|&w| index.len(w)).collect();
    assert!(
        lens.iter().max().unwrap() - lens.iter().min().unwrap() <= 100,
        "{lens:?}"
    );
}

/// Many workers, blocks held widely: each walk's overlaps equal what
/// `contains` says block by block, whichever way the walk stepped (by
/// holder set, by holder chain, or by successor links left stale by set
/// steps, when a block is held far more widely than the run before it).
#[derive(Debug, Clone)]
enum WideOp {
    Insert { workers: Vec<usize>, blocks: Vec<u64> },
    Lookup { blocks: Vec<u64> },
    DropOldest { worker: usize, count: usize },
}

const WIDE: usize = 12;

fn wide_op() -> impl Strategy<Value = WideOp> {
    let blocks = prop::collection::vec(0u64..24, 0..10);
    prop_oneof![
        4 => (prop::collection::vec(0..WIDE, 1..WIDE), blocks.clone())
            .prop_map(|(workers, blocks)| WideOp::Insert { workers, blocks }),
        3 => blocks.prop_map(|blocks| WideOp::Lookup { blocks }),
        1 => (0..WIDE, 0usize..8).prop_map(|(worker, count)| WideOp::DropOldest { worker, count }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn walks_over_widely_held_blocks_match_block_by_block_lookups(ops in prop::collection::vec(wide_op(), 1..60)) {
        let mut index = PrefixIndex::new();
        for _ in 0..WIDE {
            index.add_worker(40);
        }
        let mut overlaps = Vec::new();
        for op in ops {
            match op {
                WideOp::Insert { workers, blocks } => {
                    let mut seen = std::collections::HashSet::new();
                    let blocks: Vec<u64> = blocks.into_iter().filter(|b| seen.insert(*b)).collect();
                    for w in workers {
                        index.insert(WorkerId(w), &blocks);
                    }
                }
                WideOp::Lookup { blocks } => {
                    let mut seen = std::collections::HashSet::new();
                    let blocks: Vec<u64> = blocks.into_iter().filter(|b| seen.insert(*b)).collect();
                    index.overlaps(&blocks, &mut overlaps);
                    for (w, overlap) in overlaps.iter().enumerate() {
                        let expected = blocks.iter().take_while(|&&b| index.contains(WorkerId(w), b)).count();
                        prop_assert_eq!(*overlap, expected, "worker {}", w);
                    }
                }
                WideOp::DropOldest { worker, count } => {
                    index.drop_oldest(WorkerId(worker), count);
                }
            }
            index.check_holder_sets();
        }
    }
}

/// A prefix every worker holds is walked once for all of them: 500 shared
/// blocks over 64 workers take a handful of per-worker steps, not one per
/// block per worker (32,000), and the overlaps are right.
#[test]
fn a_prefix_every_worker_holds_is_walked_once_for_all() {
    const WORKERS: usize = 64;
    const SHARED: u64 = 500;
    let mut index = PrefixIndex::new();
    for _ in 0..WORKERS {
        index.add_worker(100_000);
    }
    let shared: Vec<u64> = (0..SHARED).map(|i| crate::splitmix64(i + 1)).collect();
    let mut own = |w: u64| -> Vec<u64> {
        let mut blocks = shared.clone();
        blocks.extend((0..40).map(|i| crate::splitmix64((w + 1) << 32 | i)));
        blocks
    };
    let requests: Vec<Vec<u64>> = (0..WORKERS as u64).map(&mut own).collect();
    for (w, blocks) in requests.iter().enumerate() {
        index.insert(WorkerId(w), blocks);
    }
    let mut overlaps = Vec::new();
    let before = index.worker_steps();
    index.overlaps(&requests[7], &mut overlaps);
    let steps = index.worker_steps() - before;
    for (w, &overlap) in overlaps.iter().enumerate() {
        let expected = if w == 7 { requests[7].len() } else { SHARED as usize };
        assert_eq!(overlap, expected, "worker {w}");
    }
    assert!(
        steps <= (WORKERS as u64) * 2,
        "{steps} per-worker steps for {SHARED} blocks held by {WORKERS} workers"
    );
}

/// A placement trusts only its own index's latest walk of the very blocks
/// placed: a walk of another index, with the same stamp, is placed as a
/// plain insert (the run it describes is another index's).
#[test]
fn a_walk_of_another_index_is_not_trusted() {
    // `y` differs from `x` in its first ten blocks only: a placement of
    // `y` that trusted a walk of `x` would take `x`'s nodes for them.
    let x: Vec<u64> = (1_000..1_040).collect();
    let y: Vec<u64> = (5_000..5_010).chain(1_010..1_040).collect();
    let mut index = PrefixIndex::new();
    let mut other = PrefixIndex::new();
    for i in [&mut index, &mut other] {
        i.add_worker(60);
        i.insert(WorkerId(0), &y);
        i.insert(WorkerId(0), &x);
    }
    let mut plain = index.clone();
    let mut overlaps = Vec::new();
    // `index` walks `x`, its worker's run in order; `other` walks `y` as
    // often, so its stamp is the same.
    let _ = index.overlaps_by_tier(&x, &mut overlaps, None);
    let foreign = other.overlaps_by_tier(&y, &mut overlaps, None);
    index.insert_walked(WorkerId(0), foreign);
    plain.insert(WorkerId(0), &y);
    assert_eq!(
        index.blocks_oldest_first(WorkerId(0)),
        plain.blocks_oldest_first(WorkerId(0))
    );
    for blocks in [&x, &y] {
        let (mut a, mut b) = (Vec::new(), Vec::new());
        index.overlaps(blocks, &mut a);
        plain.overlaps(blocks, &mut b);
        assert_eq!(a, b);
    }
}
