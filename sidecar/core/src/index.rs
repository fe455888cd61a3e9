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
//!
//! A worker whose engine offloads KV to host memory (vLLM's
//! `--kv-offloading-size`, SGLang's HiCache) has a second list: blocks
//! evicted from its GPU list move there (newest first) instead of being
//! forgotten, while the host tier has room. Which list a node is in is one
//! bit of its `worker` field, so a tier costs no byte per entry. A block
//! on GPU that also has a host copy is a GPU block here: the GPU hit is what
//! the cost sees, and the copy matters only once the GPU one goes, which is
//! when it moves to the host list.

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
    /// The worker in the low 31 bits, [`HOST_ONLY`] in the top one (a freed
    /// node is `NIL`: worker `WORKER_MASK`, which no worker is).
    worker_tier: u32,
}

// The tier bit lives in `worker_tier`: a node is still 28 bytes.
const _: () = assert!(size_of::<Node>() == 28);

/// The node is in its worker's host list: the engine holds the block in
/// host memory only, and a hit must load it back to the GPU first.
const HOST_ONLY: u32 = 1 << 31;
const WORKER_MASK: u32 = !HOST_ONLY;

impl Node {
    fn new(hash: u64, worker: u32, next_holder: u32) -> Self {
        Self {
            hash_lo: hash as u32,
            hash_hi: (hash >> 32) as u32,
            newer: NIL,
            older: NIL,
            next_holder,
            successor: NIL,
            worker_tier: worker & WORKER_MASK,
        }
    }

    fn hash(&self) -> u64 {
        (u64::from(self.hash_hi) << 32) | u64::from(self.hash_lo)
    }

    fn worker(&self) -> u32 {
        self.worker_tier & WORKER_MASK
    }

    fn host_only(&self) -> bool {
        self.worker_tier & HOST_ONLY != 0
    }

    fn set_host_only(&mut self, host_only: bool) {
        if host_only {
            self.worker_tier |= HOST_ONLY;
        } else {
            self.worker_tier &= WORKER_MASK;
        }
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
    /// Each worker's GPU list, and its host list (capacity 0: no host tier).
    workers: Vec<WorkerList>,
    hosts: Vec<WorkerList>,
    /// Scratch for `overlaps`: per worker, the last block index matched
    /// and the node it matched on; the workers still matching.
    last_match: Vec<u32>,
    cursor: Vec<u32>,
    alive: Vec<u32>,
    /// Scratch for `overlaps`: per worker, host-only blocks in its run.
    host_run: Vec<u32>,
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
        self.hosts.push(WorkerList {
            capacity: 0,
            ..WorkerList::new(0)
        });
        self.last_match.push(NIL);
        self.cursor.push(NIL);
        self.host_run.push(0);
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
            for w in 0..self.workers.len() {
                let len = self.held(w);
                match fullest {
                    Some(f) if len <= self.held(f) => runner_up = runner_up.max(len),
                    _ => {
                        runner_up = fullest.map_or(0, |f| self.held(f));
                        fullest = Some(w);
                    }
                }
            }
            let Some(w) = fullest else { break };
            let before = evicted;
            while self.entries() > budget && (self.held(w) > runner_up || evicted == before) {
                // Host-only blocks first: a hit on them is worth less.
                let oldest = match self.hosts[w].oldest {
                    NIL => self.workers[w].oldest,
                    host => host,
                };
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

    /// Blocks held by `worker` on its GPU (some may have host copies too).
    pub fn len(&self, worker: WorkerId) -> usize {
        self.workers.get(worker.0).map_or(0, |w| w.len as usize)
    }

    /// Blocks `worker` holds in host memory only.
    pub fn host_len(&self, worker: WorkerId) -> usize {
        self.hosts.get(worker.0).map_or(0, |w| w.len as usize)
    }

    /// Host-only blocks `worker`'s host tier holds at most (0: none).
    pub fn host_capacity(&self, worker: WorkerId) -> usize {
        self.hosts.get(worker.0).map_or(0, |w| w.capacity as usize)
    }

    /// Entries of worker `w` on both tiers.
    fn held(&self, w: usize) -> u32 {
        self.workers[w].len + self.hosts[w].len
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

    /// Sets `worker`'s host tier to `capacity` host-only blocks (0: none,
    /// so GPU evictions forget blocks again), evicting its oldest host-only
    /// blocks if it shrank. Returns how many went.
    pub fn set_host_capacity(&mut self, worker: WorkerId, capacity: usize) -> usize {
        let Some(list) = self.hosts.get_mut(worker.0) else {
            return 0;
        };
        list.capacity = clamp_u32(capacity);
        self.evict_over_host_capacity(worker.0)
    }

    /// Bytes this index holds on the heap (arena, free list, hash map).
    pub fn memory_bytes(&self) -> usize {
        let map = self.first_holder.allocation_size();
        map + self.nodes.allocated_bytes()
            + self.free.capacity() * size_of::<u32>()
            + (self.workers.capacity() + self.hosts.capacity()) * size_of::<WorkerList>()
            + (self.last_match.capacity()
                + self.cursor.capacity()
                + self.alive.capacity()
                + self.placed.capacity()
                + self.host_run.capacity())
                * size_of::<u32>()
    }

    /// For every worker, how many leading blocks of `hashes` it holds,
    /// written into `overlaps` (one slot per worker, zeroed first).
    pub fn overlaps(&mut self, hashes: &[u64], overlaps: &mut Vec<usize>) {
        self.overlaps_by_tier(hashes, overlaps, None);
    }

    /// `overlaps`, and for every worker how many of those leading blocks it
    /// holds in host memory only, written into `host_only` when given. A
    /// run goes on across tiers: the engine loads host blocks back and
    /// reuses them as its own.
    pub fn overlaps_by_tier(&mut self, hashes: &[u64], overlaps: &mut Vec<usize>, host_only: Option<&mut Vec<usize>>) {
        overlaps.clear();
        overlaps.resize(self.workers.len(), 0);
        self.alive.clear();
        let Some(&first_hash) = hashes.first() else {
            if let Some(host_only) = host_only {
                host_only.clear();
                host_only.resize(self.workers.len(), 0);
            }
            return;
        };
        // Host-only blocks are counted only when some worker has one: an
        // index without host tiers walks as fast as before (the count costs
        // a node read per matched block).
        let tiered = self.hosts.iter().any(|h| h.len > 0);
        // Block 0: every holder starts a run.
        let mut node = self.first_of(first_hash).unwrap_or(NIL);
        while node != NIL {
            let n = self.nodes[node as usize];
            let w = n.worker();
            self.alive.push(w);
            self.cursor[w as usize] = node;
            self.last_match[w as usize] = 0;
            self.host_run[w as usize] = u32::from(n.host_only());
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
                    && s.worker() == w
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
                    if tiered {
                        self.host_run[w as usize] += u32::from(self.nodes[next as usize].host_only());
                    }
                    self.alive[keep] = w;
                    keep += 1;
                }
            }
            self.alive.truncate(keep);
        }
        // Every worker that started a run ends it at its last match.
        let mut host_only = host_only;
        if let Some(host_only) = host_only.as_deref_mut() {
            host_only.clear();
            host_only.resize(self.workers.len(), 0);
        }
        let mut node = self.first_of(first_hash).unwrap_or(NIL);
        while node != NIL {
            let n = self.nodes[node as usize];
            let w = n.worker() as usize;
            overlaps[w] = self.last_match[w] as usize + 1;
            if tiered && let Some(host_only) = host_only.as_deref_mut() {
                host_only[w] = self.host_run[w] as usize;
            }
            node = n.next_holder;
        }
    }

    /// `worker`'s node in the holder chain starting at `first`.
    fn holder_from(&self, mut node: u32, worker: u32) -> Option<u32> {
        while node != NIL {
            let n = &self.nodes[node as usize];
            if n.worker() == worker {
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
                        .is_some_and(|n| n.worker() == worker_u32 && n.hash() == hash)
                });
            let node = linked.or_else(|| self.find(worker_u32, hash)).unwrap_or(NIL);
            placed.push(node);
            previous = node;
        }
        // Backward: touch or create each block, last first (so the first
        // block ends newest), and link each to the block after it. A
        // host-only block is back on the GPU: the engine loaded it.
        let mut after = NIL;
        for (i, &hash) in hashes.iter().enumerate().rev() {
            let node = if placed[i] != NIL {
                self.unlink_lru(placed[i]);
                if self.nodes[placed[i] as usize].host_only() {
                    self.nodes[placed[i] as usize].set_host_only(false);
                    self.hosts[w].len -= 1;
                    self.workers[w].len += 1;
                }
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

    /// Moves `worker`'s `count` oldest GPU blocks to its host list (the
    /// engine evicted them from the GPU and kept their host copies), then
    /// holds the host list to its capacity. Returns how many moved.
    pub fn demote_oldest(&mut self, worker: WorkerId, count: usize) -> usize {
        let mut moved = 0;
        while moved < count {
            let Some(list) = self.workers.get(worker.0) else { break };
            if list.oldest == NIL {
                break;
            }
            self.demote(list.oldest);
            moved += 1;
        }
        if moved > 0 {
            self.evict_over_host_capacity(worker.0);
        }
        moved
    }

    /// Drops `worker`'s `count` oldest host-only blocks; returns how many.
    pub fn drop_oldest_host(&mut self, worker: WorkerId, count: usize) -> usize {
        let mut dropped = 0;
        while dropped < count {
            let Some(list) = self.hosts.get(worker.0) else { break };
            if list.oldest == NIL {
                break;
            }
            self.remove_node(list.oldest);
            dropped += 1;
        }
        dropped
    }

    /// Drops `worker`'s `count` oldest GPU blocks, host copies or not (see
    /// `demote_oldest` for the engine keeping them); returns how many.
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

    /// Forgets everything `worker` holds, on both tiers (a restart or cache
    /// reset). Returns how many GPU blocks went.
    pub fn clear_worker(&mut self, worker: WorkerId) -> usize {
        let host = self.host_len(worker);
        self.drop_oldest_host(worker, host);
        let len = self.len(worker);
        self.drop_oldest(worker, len)
    }

    /// `worker`'s GPU blocks from oldest to newest (for snapshots; host-only
    /// blocks are not kept across restarts).
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

    /// Holds the GPU list to its capacity: its oldest blocks move to the
    /// host list when the worker has a host tier, else are forgotten.
    /// Returns how many left the GPU list.
    fn evict_over_capacity(&mut self, w: usize) -> usize {
        let mut evicted = 0;
        let offload = self.hosts[w].capacity > 0;
        while self.workers[w].len > self.workers[w].capacity {
            let oldest = self.workers[w].oldest;
            if oldest == NIL {
                break;
            }
            if offload {
                self.demote(oldest);
            } else {
                self.remove_node(oldest);
            }
            evicted += 1;
        }
        if offload {
            self.evict_over_host_capacity(w);
        }
        evicted
    }

    fn evict_over_host_capacity(&mut self, w: usize) -> usize {
        let mut evicted = 0;
        while self.hosts[w].len > self.hosts[w].capacity {
            let oldest = self.hosts[w].oldest;
            if oldest == NIL {
                break;
            }
            self.remove_node(oldest);
            evicted += 1;
        }
        evicted
    }

    /// Moves a GPU node to the newest end of its worker's host list.
    fn demote(&mut self, node: u32) {
        if self.nodes[node as usize].host_only() {
            return;
        }
        self.unlink_lru(node);
        let w = self.nodes[node as usize].worker() as usize;
        self.workers[w].len -= 1;
        self.hosts[w].len += 1;
        self.nodes[node as usize].set_host_only(true);
        self.push_newest(node);
    }

    /// The list `node` is in.
    fn list_of(&mut self, node: u32) -> &mut WorkerList {
        let n = self.nodes[node as usize];
        let w = n.worker() as usize;
        if n.host_only() {
            &mut self.hosts[w]
        } else {
            &mut self.workers[w]
        }
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
        let list = self.list_of(node);
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
        let Node { newer, older, .. } = self.nodes[node as usize];
        if newer != NIL {
            self.nodes[newer as usize].older = older;
        }
        if older != NIL {
            self.nodes[older as usize].newer = newer;
        }
        let list = self.list_of(node);
        if newer == NIL {
            list.newest = older;
        }
        if older == NIL {
            list.oldest = newer;
        }
    }

    fn remove_node(&mut self, node: u32) {
        self.unlink_lru(node);
        let removed = self.nodes[node as usize];
        let (hash, next_holder) = (removed.hash(), removed.next_holder);
        self.list_of(node).len -= 1;
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
        self.nodes[node as usize].worker_tier = NIL;
        self.free.push(node);
    }
}

fn clamp_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX - 1)
}
