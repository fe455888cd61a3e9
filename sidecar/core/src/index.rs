//! `PrefixIndex`: which workers hold which prefix blocks, with each worker's
//! cache modelled as an LRU list bounded by its capacity, as the engine's
//! own prefix cache behaves.
//!
//! Memory is the constraint (tens of millions of (block, worker) entries per
//! GPU cluster), so entries are nodes in one arena, 24 bytes each, linked
//! twice: into their worker's LRU list and into the chain of holders of
//! their block. A hash table of node indices (4 bytes a slot; the block
//! hash is read from the node itself) finds a block's first holder and is
//! the only other per-block cost. Lookups walk the request's blocks once,
//! not once per worker.

use hashbrown::HashTable;

use crate::WorkerId;

const NIL: u32 = u32::MAX;

/// One (block, worker) entry, 28 bytes (the hash is split so the node
/// aligns to 4, not 8).
#[derive(Debug, Clone, Copy)]
struct Node {
    hash_lo: u32,
    hash_hi: u32,
    /// Neighbours in the worker's LRU list (towards newer, towards older).
    newer: u32,
    older: u32,
    /// The next worker holding the same block.
    next_holder: u32,
    /// The node of the block that followed this one, on the same worker,
    /// in the latest request placed there: a prefix walk follows these
    /// instead of probing the hash table for every block (stale links are
    /// caught by checking the hash and worker of the target).
    successor: u32,
    worker: u32,
}

impl Node {
    fn new(hash: u64, worker: u32, next_holder: u32) -> Self {
        Self {
            hash_lo: hash as u32,
            hash_hi: (hash >> 32) as u32,
            newer: NIL,
            older: NIL,
            next_holder,
            successor: NIL,
            worker,
        }
    }

    fn hash(&self) -> u64 {
        (u64::from(self.hash_hi) << 32) | u64::from(self.hash_lo)
    }
}

/// Nodes in fixed-size chunks: the arena grows a chunk at a time, never by
/// doubling, so at tens of millions of entries it holds no more than one
/// partly used chunk (a doubling vector holds up to twice what it needs).
#[derive(Debug, Clone, Default)]
struct Arena {
    chunks: Vec<Vec<Node>>,
    len: usize,
}

const CHUNK_BITS: usize = 16;
const CHUNK: usize = 1 << CHUNK_BITS;

impl Arena {
    fn len(&self) -> usize {
        self.len
    }

    fn get(&self, index: usize) -> Option<&Node> {
        self.chunks.get(index >> CHUNK_BITS)?.get(index & (CHUNK - 1))
    }

    fn push(&mut self, node: Node) {
        if self.len.is_multiple_of(CHUNK) {
            self.chunks.push(Vec::with_capacity(CHUNK));
        }
        if let Some(chunk) = self.chunks.last_mut() {
            chunk.push(node);
            self.len += 1;
        }
    }

    fn allocated_bytes(&self) -> usize {
        self.chunks
            .iter()
            .map(|c| c.capacity() * size_of::<Node>())
            .sum::<usize>()
            + self.chunks.capacity() * size_of::<Vec<Node>>()
    }
}

impl std::ops::Index<usize> for Arena {
    type Output = Node;

    fn index(&self, index: usize) -> &Node {
        &self.chunks[index >> CHUNK_BITS][index & (CHUNK - 1)]
    }
}

impl std::ops::IndexMut<usize> for Arena {
    fn index_mut(&mut self, index: usize) -> &mut Node {
        &mut self.chunks[index >> CHUNK_BITS][index & (CHUNK - 1)]
    }
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
    /// Node index of each block's first holder, keyed by the node's hash.
    first_holder: HashTable<u32>,
    nodes: Arena,
    free: Vec<u32>,
    workers: Vec<WorkerList>,
    /// Scratch for `overlaps`: per worker, the last block index matched
    /// and the node it matched on; the workers still matching.
    last_match: Vec<u32>,
    cursor: Vec<u32>,
    alive: Vec<u32>,
    /// Scratch for `insert`: the request's node on the worker, per block.
    placed: Vec<u32>,
    /// Entries allowed in all, from the operator's byte budget: past it
    /// the fullest worker's oldest blocks go, whatever the caches hold.
    entry_budget: Option<usize>,
}

/// Heap bytes one entry can cost at worst: its node (28 B), its hash-table
/// slot at the lowest load factor after a doubling (about 11.5 B) and a
/// free-list slot (4 B).
pub(crate) const MAX_BYTES_PER_ENTRY: usize = 48;

/// Table hash of a block hash: block hashes are already uniform, one
/// multiply spreads them over the table's bits.
fn table_hash(hash: u64) -> u64 {
    hash.wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

impl PrefixIndex {
    pub fn new() -> Self {
        Self::default()
    }

    fn first_of(&self, hash: u64) -> Option<u32> {
        let nodes = &self.nodes;
        self.first_holder
            .find(table_hash(hash), |&n| nodes[n as usize].hash() == hash)
            .copied()
    }

    /// Makes `node` the first holder of its block (inserting the block).
    fn set_first(&mut self, hash: u64, node: u32) {
        let nodes = &self.nodes;
        match self
            .first_holder
            .find_mut(table_hash(hash), |&n| nodes[n as usize].hash() == hash)
        {
            Some(slot) => *slot = node,
            None => {
                let nodes = &self.nodes;
                self.first_holder
                    .insert_unique(table_hash(hash), node, |&n| table_hash(nodes[n as usize].hash()));
            }
        }
    }

    fn remove_block(&mut self, hash: u64) {
        let nodes = &self.nodes;
        if let Ok(entry) = self
            .first_holder
            .find_entry(table_hash(hash), |&n| nodes[n as usize].hash() == hash)
        {
            entry.remove();
        }
    }

    /// Adds a worker whose cache holds `capacity` blocks.
    pub fn add_worker(&mut self, capacity: usize) -> WorkerId {
        self.workers.push(WorkerList::new(clamp_u32(capacity)));
        self.last_match.push(NIL);
        self.cursor.push(NIL);
        WorkerId(self.workers.len() - 1)
    }

    /// Bounds the index to about `bytes` of heap: one partly filled arena
    /// chunk plus [`MAX_BYTES_PER_ENTRY`] per entry. Returns the entries
    /// that now fit; evicts down to them at once.
    pub fn set_byte_budget(&mut self, bytes: usize) -> usize {
        let fixed = CHUNK * size_of::<Node>();
        let entries = (bytes.saturating_sub(fixed) / MAX_BYTES_PER_ENTRY).max(1);
        self.entry_budget = Some(entries);
        self.evict_over_budget();
        entries
    }

    /// Evicts the fullest worker's oldest blocks until the index fits its
    /// budget: the worker holding most loses least by one block. One scan
    /// of the workers per run of evictions, not per block: the fullest
    /// gives blocks until it is down to the runner-up.
    fn evict_over_budget(&mut self) -> usize {
        let Some(budget) = self.entry_budget else { return 0 };
        let mut evicted = 0;
        while self.entries() > budget {
            let (mut fullest, mut runner_up) = (None::<usize>, 0);
            for (w, list) in self.workers.iter().enumerate() {
                match fullest {
                    Some(f) if list.len <= self.workers[f].len => runner_up = runner_up.max(list.len),
                    _ => {
                        runner_up = fullest.map_or(0, |f| self.workers[f].len);
                        fullest = Some(w);
                    }
                }
            }
            let Some(w) = fullest else { break };
            let before = evicted;
            while self.entries() > budget && (self.workers[w].len > runner_up || evicted == before) {
                let oldest = self.workers[w].oldest;
                if oldest == NIL {
                    break;
                }
                self.remove_node(oldest);
                evicted += 1;
            }
            if evicted == before {
                break;
            }
        }
        evicted
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
        map + self.nodes.allocated_bytes()
            + self.free.capacity() * size_of::<u32>()
            + self.workers.capacity() * size_of::<WorkerList>()
            + (self.last_match.capacity() + self.cursor.capacity() + self.alive.capacity() + self.placed.capacity())
                * size_of::<u32>()
    }

    /// For every worker, how many leading blocks of `hashes` it holds,
    /// written into `overlaps` (one slot per worker, zeroed first).
    pub fn overlaps(&mut self, hashes: &[u64], overlaps: &mut Vec<usize>) {
        overlaps.clear();
        overlaps.resize(self.workers.len(), 0);
        self.alive.clear();
        let Some(&first_hash) = hashes.first() else { return };
        // Block 0: every holder starts a run.
        let mut node = self.first_of(first_hash).unwrap_or(NIL);
        while node != NIL {
            let n = self.nodes[node as usize];
            self.alive.push(n.worker);
            self.cursor[n.worker as usize] = node;
            self.last_match[n.worker as usize] = 0;
            node = n.next_holder;
        }
        // Each further block: a worker continues if it holds it too, found
        // through its successor link, else through one table probe shared
        // by the workers whose link missed.
        for (i, &hash) in hashes.iter().enumerate().skip(1) {
            if self.alive.is_empty() {
                break;
            }
            let mut probed: Option<u32> = None;
            let mut keep = 0;
            for k in 0..self.alive.len() {
                let w = self.alive[k];
                let successor = self.nodes[self.cursor[w as usize] as usize].successor;
                let next = if successor != NIL
                    && let Some(s) = self.nodes.get(successor as usize)
                    && s.worker == w
                    && s.hash() == hash
                {
                    Some(successor)
                } else {
                    let first = *probed.get_or_insert_with(|| self.first_of(hash).unwrap_or(NIL));
                    self.holder_from(first, w)
                };
                if let Some(next) = next {
                    self.cursor[w as usize] = next;
                    self.last_match[w as usize] = i as u32;
                    self.alive[keep] = w;
                    keep += 1;
                }
            }
            self.alive.truncate(keep);
        }
        // Every worker that started a run ends it at its last match.
        let mut node = self.first_of(first_hash).unwrap_or(NIL);
        while node != NIL {
            let n = self.nodes[node as usize];
            let w = n.worker as usize;
            overlaps[w] = self.last_match[w] as usize + 1;
            node = n.next_holder;
        }
    }

    /// `worker`'s node in the holder chain starting at `first`.
    fn holder_from(&self, mut node: u32, worker: u32) -> Option<u32> {
        while node != NIL {
            let n = &self.nodes[node as usize];
            if n.worker == worker {
                return Some(node);
            }
            node = n.next_holder;
        }
        None
    }

    /// Whether `worker` holds `hash`.
    pub fn contains(&self, worker: WorkerId, hash: u64) -> bool {
        self.find(worker.0 as u32, hash).is_some()
    }

    fn find(&self, worker: u32, hash: u64) -> Option<u32> {
        self.holder_from(self.first_of(hash)?, worker)
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
        let worker_u32 = w as u32;
        // Forward: find the nodes the worker already has, following
        // successor links as the lookup does.
        let mut placed = std::mem::take(&mut self.placed);
        placed.clear();
        let mut previous = NIL;
        for &hash in hashes {
            let linked = (previous != NIL)
                .then(|| self.nodes[previous as usize].successor)
                .filter(|&s| s != NIL)
                .filter(|&s| {
                    self.nodes
                        .get(s as usize)
                        .is_some_and(|n| n.worker == worker_u32 && n.hash() == hash)
                });
            let node = linked.or_else(|| self.find(worker_u32, hash)).unwrap_or(NIL);
            placed.push(node);
            previous = node;
        }
        // Backward: touch or create each block, last first (so the first
        // block ends newest), and link each to the block after it.
        let mut after = NIL;
        for (i, &hash) in hashes.iter().enumerate().rev() {
            let node = if placed[i] != NIL {
                self.unlink_lru(placed[i]);
                placed[i]
            } else {
                let next_holder = self.first_of(hash).unwrap_or(NIL);
                let node = self.alloc(Node::new(hash, worker_u32, next_holder));
                self.set_first(hash, node);
                self.workers[w].len += 1;
                node
            };
            self.push_newest(node);
            self.nodes[node as usize].successor = after;
            after = node;
        }
        self.placed = placed;
        self.evict_over_capacity(w) + self.evict_over_budget()
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
            out.push(n.hash());
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
        let removed = self.nodes[node as usize];
        let (hash, next_holder, worker) = (removed.hash(), removed.next_holder, removed.worker);
        self.workers[worker as usize].len -= 1;
        // Unlink from the block's holder chain (chains are short: the
        // workers holding one block).
        if let Some(first) = self.first_of(hash) {
            if first == node {
                if next_holder == NIL {
                    self.remove_block(hash);
                } else {
                    self.set_first(hash, next_holder);
                }
            } else {
                let mut prev = first;
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
        // A freed node must never pass a successor check.
        self.nodes[node as usize].worker = NIL;
        self.free.push(node);
    }
}

fn clamp_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX - 1)
}
