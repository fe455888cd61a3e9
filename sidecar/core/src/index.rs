//! `PrefixIndex`: which workers hold which prefix blocks, with each worker's
//! cache modelled as an LRU list bounded by its capacity, as the engine's
//! own prefix cache behaves.
//!
//! Memory is the constraint (tens of millions of (block, worker) entries per
//! GPU cluster), so entries are nodes in one arena, 24 bytes each, linked
//! twice: into their worker's LRU list and into the chain of holders of
//! their block. A hash map from block hash to the first holder node is the
//! only other per-block cost. Lookups walk the request's blocks once, not
//! once per worker.

use hashbrown::HashMap;

use crate::WorkerId;

const NIL: u32 = u32::MAX;

/// One (block, worker) entry.
#[derive(Debug, Clone, Copy)]
struct Node {
    hash: u64,
    /// Neighbours in the worker's LRU list (towards newer, towards older).
    newer: u32,
    older: u32,
    /// The next worker holding the same block.
    next_holder: u32,
    worker: u32,
}

#[derive(Debug, Clone, Copy)]
struct WorkerList {
    newest: u32,
    oldest: u32,
    len: u32,
    capacity: u32,
}

impl WorkerList {
    fn new(capacity: u32) -> Self {
        Self {
            newest: NIL,
            oldest: NIL,
            len: 0,
            capacity: capacity.max(1),
        }
    }
}

/// Block hash → holders, with per-worker LRU order and capacity.
#[derive(Debug, Clone, Default)]
pub struct PrefixIndex {
    first_holder: HashMap<u64, u32>,
    nodes: Vec<Node>,
    free: Vec<u32>,
    workers: Vec<WorkerList>,
    /// Scratch for `overlaps`: per worker, the last block index matched.
    last_match: Vec<u32>,
}

impl PrefixIndex {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a worker whose cache holds `capacity` blocks.
    pub fn add_worker(&mut self, capacity: usize) -> WorkerId {
        self.workers.push(WorkerList::new(clamp_u32(capacity)));
        self.last_match.push(NIL);
        WorkerId(self.workers.len() - 1)
    }

    pub fn worker_count(&self) -> usize {
        self.workers.len()
    }

    /// Blocks held by `worker`.
    pub fn len(&self, worker: WorkerId) -> usize {
        self.workers.get(worker.0).map_or(0, |w| w.len as usize)
    }

    /// (block, worker) entries in all.
    pub fn entries(&self) -> usize {
        self.nodes.len() - self.free.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries() == 0
    }

    pub fn capacity(&self, worker: WorkerId) -> usize {
        self.workers.get(worker.0).map_or(0, |w| w.capacity as usize)
    }

    /// Sets `worker`'s capacity, evicting its oldest blocks if it shrank.
    pub fn set_capacity(&mut self, worker: WorkerId, capacity: usize) -> usize {
        let Some(list) = self.workers.get_mut(worker.0) else {
            return 0;
        };
        list.capacity = clamp_u32(capacity).max(1);
        self.evict_over_capacity(worker.0)
    }

    /// Bytes this index holds on the heap (arena, free list, hash map).
    pub fn memory_bytes(&self) -> usize {
        let map = self.first_holder.allocation_size();
        map + self.nodes.capacity() * size_of::<Node>()
            + self.free.capacity() * size_of::<u32>()
            + self.workers.capacity() * size_of::<WorkerList>()
            + self.last_match.capacity() * size_of::<u32>()
    }

    /// For every worker, how many leading blocks of `hashes` it holds,
    /// written into `overlaps` (one slot per worker, zeroed first).
    pub fn overlaps(&mut self, hashes: &[u64], overlaps: &mut Vec<usize>) {
        overlaps.clear();
        overlaps.resize(self.workers.len(), 0);
        self.last_match.iter_mut().for_each(|m| *m = NIL);
        for (i, hash) in hashes.iter().enumerate() {
            let Some(&first) = self.first_holder.get(hash) else {
                break;
            };
            let i = i as u32;
            let mut matched = false;
            let mut node = first;
            while node != NIL {
                let n = self.nodes[node as usize];
                let w = n.worker as usize;
                // A worker continues its run only if it held every block so far.
                if (i == 0 && self.last_match[w] == NIL) || (i > 0 && self.last_match[w] == i - 1) {
                    self.last_match[w] = i;
                    matched = true;
                }
                node = n.next_holder;
            }
            if !matched {
                break;
            }
        }
        for (w, last) in self.last_match.iter().enumerate() {
            if *last != NIL {
                overlaps[w] = *last as usize + 1;
            }
        }
    }

    /// Whether `worker` holds `hash`.
    pub fn contains(&self, worker: WorkerId, hash: u64) -> bool {
        self.find(worker.0 as u32, hash).is_some()
    }

    fn find(&self, worker: u32, hash: u64) -> Option<u32> {
        let mut node = *self.first_holder.get(&hash)?;
        while node != NIL {
            let n = &self.nodes[node as usize];
            if n.worker == worker {
                return Some(node);
            }
            node = n.next_holder;
        }
        None
    }

    /// Records that `worker` now holds `hashes` (a request's full blocks, in
    /// prompt order). Returns how many older blocks were evicted.
    ///
    /// Blocks are touched last to first, so a prefix's first block is the
    /// newest: engines free a finished request's blocks tail first, and
    /// evict the ends of prefixes before their shared beginnings.
    pub fn insert(&mut self, worker: WorkerId, hashes: &[u64]) -> usize {
        let w = worker.0;
        if w >= self.workers.len() {
            return 0;
        }
        for &hash in hashes.iter().rev() {
            match self.find(w as u32, hash) {
                Some(node) => {
                    self.unlink_lru(node);
                    self.push_newest(node);
                }
                None => {
                    let next_holder = self.first_holder.get(&hash).copied().unwrap_or(NIL);
                    let node = self.alloc(Node {
                        hash,
                        newer: NIL,
                        older: NIL,
                        next_holder,
                        worker: w as u32,
                    });
                    self.first_holder.insert(hash, node);
                    self.push_newest(node);
                    self.workers[w].len += 1;
                }
            }
        }
        self.evict_over_capacity(w)
    }

    /// Drops `worker`'s `count` oldest blocks; returns how many it dropped.
    pub fn drop_oldest(&mut self, worker: WorkerId, count: usize) -> usize {
        let mut dropped = 0;
        while dropped < count {
            let Some(list) = self.workers.get(worker.0) else { break };
            if list.oldest == NIL {
                break;
            }
            self.remove_node(list.oldest);
            dropped += 1;
        }
        dropped
    }

    /// Forgets everything `worker` holds (a restart or cache reset).
    pub fn clear_worker(&mut self, worker: WorkerId) -> usize {
        let len = self.len(worker);
        self.drop_oldest(worker, len)
    }

    /// `worker`'s blocks from oldest to newest (for snapshots).
    pub fn blocks_oldest_first(&self, worker: WorkerId) -> Vec<u64> {
        let mut out = Vec::with_capacity(self.len(worker));
        let mut node = self.workers.get(worker.0).map_or(NIL, |l| l.oldest);
        while node != NIL {
            let n = &self.nodes[node as usize];
            out.push(n.hash);
            node = n.newer;
        }
        out
    }

    fn evict_over_capacity(&mut self, w: usize) -> usize {
        let mut evicted = 0;
        while self.workers[w].len > self.workers[w].capacity {
            let oldest = self.workers[w].oldest;
            if oldest == NIL {
                break;
            }
            self.remove_node(oldest);
            evicted += 1;
        }
        evicted
    }

    fn alloc(&mut self, node: Node) -> u32 {
        if let Some(slot) = self.free.pop() {
            self.nodes[slot as usize] = node;
            slot
        } else {
            self.nodes.push(node);
            (self.nodes.len() - 1) as u32
        }
    }

    fn push_newest(&mut self, node: u32) {
        let w = self.nodes[node as usize].worker as usize;
        let list = &mut self.workers[w];
        let old_newest = list.newest;
        list.newest = node;
        if list.oldest == NIL {
            list.oldest = node;
        }
        self.nodes[node as usize].older = old_newest;
        self.nodes[node as usize].newer = NIL;
        if old_newest != NIL {
            self.nodes[old_newest as usize].newer = node;
        }
    }

    fn unlink_lru(&mut self, node: u32) {
        let Node {
            newer, older, worker, ..
        } = self.nodes[node as usize];
        let list = &mut self.workers[worker as usize];
        if newer == NIL {
            list.newest = older;
        } else {
            self.nodes[newer as usize].older = older;
        }
        if older == NIL {
            list.oldest = newer;
        } else {
            self.nodes[older as usize].newer = newer;
        }
    }

    fn remove_node(&mut self, node: u32) {
        self.unlink_lru(node);
        let Node {
            hash,
            next_holder,
            worker,
            ..
        } = self.nodes[node as usize];
        self.workers[worker as usize].len -= 1;
        // Unlink from the block's holder chain (chains are short: the
        // workers holding one block).
        if let Some(first) = self.first_holder.get_mut(&hash) {
            if *first == node {
                if next_holder == NIL {
                    self.first_holder.remove(&hash);
                } else {
                    *first = next_holder;
                }
            } else {
                let mut prev = *first;
                while prev != NIL {
                    let next = self.nodes[prev as usize].next_holder;
                    if next == node {
                        self.nodes[prev as usize].next_holder = next_holder;
                        break;
                    }
                    prev = next;
                }
            }
        }
        self.free.push(node);
    }
}

fn clamp_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX - 1)
}
