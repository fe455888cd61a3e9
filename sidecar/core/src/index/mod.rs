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

mod arena;
mod holder_sets;
mod holders;

use crate::WorkerId;
use arena::{Arena, Slot};
use holder_sets::{HolderSets, MIN_HOLDERS, mark};
use holders::HolderTable;

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

/// The index's nodes, in chunks of 2^16 (see [`Arena`]): freed nodes are
/// a list threaded through their `next_holder` fields, so a node freed by
/// an eviction is the next one allocated.
type Nodes = Arena<Node, 16>;

/// What a freed node holds: never a match for the walk.
const UNUSED: Node = Node {
    hash_lo: 0,
    hash_hi: 0,
    newer: NIL,
    older: NIL,
    next_holder: NIL,
    successor: NIL,
    worker_tier: NIL,
};

impl Slot for Node {
    /// A freed node must never pass a successor check again: its worker is
    /// `NIL`, which no worker is.
    fn freed(next_free: u32) -> Self {
        Node {
            next_holder: next_free,
            ..UNUSED
        }
    }

    fn next_free(&self) -> u32 {
        self.next_holder
    }
}

/// A worker still matching in a prefix walk: the successor link of the
/// node it matched last, and the host-only blocks in its run.
#[derive(Debug, Clone, Copy)]
struct Walker {
    worker: u32,
    successor: u32,
    host: u32,
}

#[derive(Debug, Clone, Copy)]
struct WorkerList {
    newest: u32,
    oldest: u32,
    len: u32,
    capacity: u32,
}

/// The oldest node of worker `w`'s list in `lists` (its GPU or its host
/// tier), if it holds any: where every eviction and demotion starts.
fn oldest_of(lists: &[WorkerList], w: usize) -> Option<u32> {
    lists.get(w).map(|l| l.oldest).filter(|&n| n != NIL)
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

/// What `insert` found of a block on its worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Touch {
    /// Not held: a new node.
    New,
    /// Held in host memory only.
    Host,
    /// On the GPU, with its older neighbour in the list.
    Gpu(u32),
    /// The node given is not the worker's node of that block.
    NotIts,
}

/// A walk of `hashes` ([`PrefixIndex::overlaps_by_tier`]), handed to the
/// placement of the same blocks ([`PrefixIndex::insert_walked`]). It
/// borrows the blocks, so they are the very ones walked and unchanged.
#[derive(Debug, Clone, Copy)]
pub struct Walk<'a> {
    hashes: &'a [u64],
    /// The walk's stamp: a later walk makes this one stale.
    walk: u32,
}

/// Block hash → holders, with per-worker LRU order and capacity.
#[derive(Debug, Clone)]
pub struct PrefixIndex {
    /// Node index of each block's first holder, keyed by the node's hash.
    first_holder: HolderTable,
    /// Which workers hold each block held by many: a walk steps every
    /// worker still matching at once while a block's holders are exactly
    /// them.
    holder_sets: HolderSets,
    nodes: Nodes,
    /// Each worker's GPU list, and its host list (capacity 0: no host tier).
    workers: Vec<WorkerList>,
    hosts: Vec<WorkerList>,
    /// Scratch for `overlaps`: per worker, the last block index matched;
    /// the workers still matching, each with its walk's state.
    last_match: Vec<u32>,
    alive: Vec<Walker>,
    /// Scratch for `overlaps`: per worker, host-only blocks in its run.
    host_run: Vec<u32>,
    /// Scratch for `overlaps`: per worker, its node of the block being
    /// stepped (`NIL` outside a step).
    holding: Vec<u32>,
    /// Scratch for `insert`: the request's node on the worker, per block.
    placed: Vec<u32>,
    /// The latest walk's matches, kept for the placement that follows it
    /// (it would otherwise find the same nodes again, the same way): per
    /// worker its node of the first block and the walk that wrote it; and
    /// the nodes of the worker that walked on alone (`trail_worker`), from
    /// block `trail_from` on. A worker's nodes between are its successor
    /// links from its first node, checked against the blocks as the walk
    /// did: while several workers match (a prefix shared by many) no node
    /// is recorded per (block, worker). Any removal or insert since the
    /// walk ends their use (`trail_live`).
    trail: Vec<u32>,
    /// Leading entries of `trail` each already its successor's `older` in
    /// the worker's LRU list and linked to it by `successor`, as the walk
    /// read them (0 when the walk counted host-only blocks): a placement
    /// of the same request finds them already in order, and moves them as
    /// one run without reading them again.
    trail_linked: usize,
    trail_worker: u32,
    trail_from: usize,
    trail_start: Vec<u32>,
    trail_walks: Vec<u32>,
    trail_walk: u32,
    /// Where the latest walk's blocks were (address and length): with the
    /// stamp, what tells a [`Walk`] of this index from one of another.
    walked_blocks: (usize, usize),
    trail_live: bool,
    /// Entries allowed in all, from the operator's byte budget: past it
    /// the fullest worker's oldest blocks go, whatever the caches hold.
    entry_budget: Option<usize>,
    /// Per-worker steps the walks took (nodes read for one worker each), for
    /// the tests of how a walk scales.
    #[cfg(test)]
    worker_steps: std::cell::Cell<u64>,
}

/// Heap bytes one entry costs at worst, for the byte budget: its node
/// (28 B) and its share of the block tables while a full one drains into
/// one twice its size (5 bytes a bucket, 3 buckets for every 7/8 of a
/// bucket's entries: about 17 B). A same-size refresh, of a table whose
/// slots were half tombstones, holds up to 23 B per live entry while it
/// drains (a quarter of its entries in inserts): the budget can be passed
/// by up to 6 % then.
pub(crate) const MAX_BYTES_PER_ENTRY: usize = 48;

impl Default for PrefixIndex {
    fn default() -> Self {
        Self::new()
    }
}

impl PrefixIndex {
    pub fn new() -> Self {
        Self {
            first_holder: HolderTable::default(),
            holder_sets: HolderSets::default(),
            nodes: Nodes::new(),
            workers: Vec::new(),
            hosts: Vec::new(),
            last_match: Vec::new(),
            alive: Vec::new(),
            host_run: Vec::new(),
            holding: Vec::new(),
            placed: Vec::new(),
            trail: Vec::new(),
            trail_linked: 0,
            trail_worker: NIL,
            trail_from: 0,
            trail_start: Vec::new(),
            trail_walks: Vec::new(),
            trail_walk: 0,
            walked_blocks: (0, 0),
            trail_live: false,
            entry_budget: None,
            #[cfg(test)]
            worker_steps: std::cell::Cell::new(0),
        }
    }

    fn first_of(&self, hash: u64) -> Option<u32> {
        let nodes = &self.nodes;
        self.first_holder.find(hash, |n| nodes[n as usize].hash())
    }

    /// Makes `node` the first holder of its block (inserting the block);
    /// returns the first holder it replaced, `NIL` when the block is new.
    fn set_first(&mut self, hash: u64, node: u32) -> u32 {
        let nodes = &self.nodes;
        self.first_holder
            .set(hash, node, |n| nodes[n as usize].hash())
            .unwrap_or(NIL)
    }

    fn remove_block(&mut self, hash: u64) {
        let nodes = &self.nodes;
        self.first_holder.remove(hash, |n| nodes[n as usize].hash());
    }

    /// Adds a worker whose cache holds `capacity` blocks.
    pub fn add_worker(&mut self, capacity: usize) -> WorkerId {
        self.workers.push(WorkerList::new(clamp_u32(capacity)));
        self.hosts.push(WorkerList {
            capacity: 0,
            ..WorkerList::new(0)
        });
        self.last_match.push(NIL);
        self.host_run.push(0);
        self.holding.push(NIL);
        self.trail_start.push(NIL);
        self.trail_walks.push(NIL);
        WorkerId(self.workers.len() - 1)
    }

    /// Bounds the index to about `bytes` of heap: one partly filled arena
    /// chunk plus [`MAX_BYTES_PER_ENTRY`] per entry. Returns the entries
    /// that now fit; evicts down to them at once.
    pub fn set_byte_budget(&mut self, bytes: usize) -> usize {
        let fixed = Nodes::CHUNK * size_of::<Node>();
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
        while self.budgeted() > budget {
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
            while self.budgeted() > budget && (self.held(w) > runner_up || evicted == before) {
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

    /// What the byte budget counts: every entry, and every shared block's
    /// holder set (20 bytes and its table slot, within an entry's
    /// [`MAX_BYTES_PER_ENTRY`]).
    fn budgeted(&self) -> usize {
        self.entries() + self.holder_sets.len()
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
        self.nodes.live()
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
        let map = self.first_holder.allocation_size() + self.holder_sets.memory_bytes();
        map + self.nodes.allocated_bytes()
            + (self.workers.capacity() + self.hosts.capacity()) * size_of::<WorkerList>()
            + self.alive.capacity() * size_of::<Walker>()
            + (self.last_match.capacity()
                + self.placed.capacity()
                + self.host_run.capacity()
                + self.holding.capacity()
                + self.trail_start.capacity()
                + self.trail_walks.capacity()
                + self.trail.capacity())
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
    /// reuses them as its own. The [`Walk`] it returns lets a placement of
    /// these very blocks reuse what the walk read ([`PrefixIndex::insert_walked`]).
    pub fn overlaps_by_tier<'a>(
        &mut self,
        hashes: &'a [u64],
        overlaps: &mut Vec<usize>,
        host_only: Option<&mut Vec<usize>>,
    ) -> Walk<'a> {
        self.walk_blocks(hashes, overlaps, host_only);
        self.walked_blocks = (hashes.as_ptr() as usize, hashes.len());
        Walk {
            hashes,
            walk: self.trail_walk,
        }
    }

    fn walk_blocks(&mut self, hashes: &[u64], overlaps: &mut Vec<usize>, host_only: Option<&mut Vec<usize>>) {
        overlaps.clear();
        overlaps.resize(self.workers.len(), 0);
        self.alive.clear();
        self.trail_live = false;
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
        self.trail.clear();
        self.trail_linked = 0;
        self.trail_worker = NIL;
        self.trail_from = hashes.len();
        self.trail_walk = self.trail_walk.wrapping_add(1);
        self.trail_live = true;
        let walk = self.trail_walk;
        let mut alive = std::mem::take(&mut self.alive);
        alive.clear();
        // Block 0: every holder starts a run.
        let mut signature = 0u64;
        let mut node = self.first_of(first_hash).unwrap_or(NIL);
        while node != NIL {
            let n = self.nodes[node as usize];
            let w = n.worker();
            let host = u32::from(n.host_only());
            alive.push(Walker {
                worker: w,
                successor: n.successor,
                host,
            });
            self.last_match[w as usize] = 0;
            self.host_run[w as usize] = host;
            self.trail_start[w as usize] = node;
            self.trail_walks[w as usize] = walk;
            signature = signature.wrapping_add(mark(w));
            node = n.next_holder;
        }
        // Each further block: the workers still matching all continue when
        // its holder set is exactly them (one probe for them all, the run
        // of a prefix every worker holds); else each continues if it holds
        // the block too, found through its successor link or the block's
        // holder chain. A worker that stops writes its run's end; nothing
        // else is written per step.
        let mut ended_at = hashes.len();
        // Where the last block's holder set was found (see `get_near`).
        let mut near_set = NIL;
        for (i, &hash) in hashes.iter().enumerate().skip(1) {
            if alive.len() <= 1 {
                // One worker left, the common case past a shared prefix (a
                // session's own blocks are on its home only): its run goes
                // on alone, recording its nodes for the placement.
                if let Some(&walker) = alive.first() {
                    self.walk_alone(walker, hashes, i, tiered);
                }
                alive.clear();
                ended_at = i;
                break;
            }
            if tiered {
                // Host-only blocks are counted per worker: a node read each.
                self.step_together::<true>(&mut alive, i, hash);
            } else {
                self.step_by_set(&mut alive, &mut signature, &mut near_set, i, hash);
            }
        }
        // Workers still matching at the end (several held every block).
        for walker in alive.drain(..) {
            let w = walker.worker as usize;
            self.last_match[w] = ended_at as u32 - 1;
            self.host_run[w] = walker.host;
        }
        self.alive = alive;
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

    /// One block of the walk for the workers in `alive` (more than one,
    /// whose marks sum to `signature`), without host tiers: nothing to do
    /// when the block's holders are exactly them. Else few workers (fewer
    /// than [`MIN_HOLDERS`]) each follow their own successor link, as
    /// `step_together` does; many read the block's holder chain once and
    /// each continues if it is on it, unless far more workers hold the
    /// block than are still matching (one held more widely than the run
    /// before it), when they follow their links too. The links of workers
    /// stepped by their set are not followed, so they may be stale: every
    /// way checks what it reads, and the chain's way refreshes them (so
    /// fewer than [`MIN_HOLDERS`] left, they are fresh).
    fn step_by_set(&mut self, alive: &mut Vec<Walker>, signature: &mut u64, near: &mut u32, i: usize, hash: u64) {
        let holders = match self.holder_sets.get_near(hash, *near) {
            Some((id, count, set)) if count as usize == alive.len() && set == *signature => {
                *near = id;
                return;
            }
            Some((id, count, _)) => {
                *near = id;
                count as usize
            }
            None => MIN_HOLDERS as usize - 1,
        };
        let matching = alive.len();
        if matching < MIN_HOLDERS as usize || holders > 4 * matching {
            self.step_together::<false>(alive, i, hash);
        } else {
            let first = self.first_of(hash).unwrap_or(NIL);
            let mut node = first;
            while node != NIL {
                let n = &self.nodes[node as usize];
                self.holding[n.worker() as usize] = node;
                node = n.next_holder;
                #[cfg(test)]
                self.worker_steps.set(self.worker_steps.get() + 1);
            }
            let mut stopped = false;
            for walker in alive.iter_mut() {
                let w = walker.worker as usize;
                match self.holding[w] {
                    NIL => {
                        self.last_match[w] = i as u32 - 1;
                        self.host_run[w] = walker.host;
                        walker.worker = NIL;
                        stopped = true;
                    }
                    held => walker.successor = self.nodes[held as usize].successor,
                }
            }
            let mut node = first;
            while node != NIL {
                let n = &self.nodes[node as usize];
                self.holding[n.worker() as usize] = NIL;
                node = n.next_holder;
            }
            if stopped {
                alive.retain(|walker| walker.worker != NIL);
            }
        }
        // Workers only ever leave: the same number is the same workers.
        if alive.len() != matching {
            *signature = alive
                .iter()
                .fold(0u64, |sum, walker| sum.wrapping_add(mark(walker.worker)));
        }
    }

    /// One block of the walk for the workers in `alive` (more than one):
    /// each continues if its successor link leads to its node of `hash`,
    /// or else the table (probed once for them all) finds one; the others
    /// leave `alive`, their runs ended at block `i - 1`. Host-only blocks
    /// are counted when `TIERED`.
    fn step_together<const TIERED: bool>(&mut self, alive: &mut Vec<Walker>, i: usize, hash: u64) {
        #[cfg(test)]
        self.worker_steps.set(self.worker_steps.get() + alive.len() as u64);
        let (nodes, table) = (&self.nodes, &self.first_holder);
        let (last_match, host_run) = (&mut self.last_match, &mut self.host_run);
        let mut probed: Option<u32> = None;
        // Workers that stop are marked and taken out after the pass, so
        // the pass itself indexes nothing (most blocks of a shared prefix
        // stop no one).
        let mut stopped = false;
        for walker in alive.iter_mut() {
            let w = walker.worker;
            let successor = walker.successor;
            let next = if successor != NIL
                && let Some(s) = nodes.get(successor as usize)
                && s.worker() == w
                && s.hash() == hash
            {
                Some(s)
            } else {
                let first =
                    *probed.get_or_insert_with(|| table.find(hash, |n| nodes[n as usize].hash()).unwrap_or(NIL));
                holder_in(nodes, first, w).map(|next| &nodes[next as usize])
            };
            if let Some(n) = next {
                walker.successor = n.successor;
                if TIERED {
                    walker.host += u32::from(n.host_only());
                }
            } else {
                last_match[w as usize] = i as u32 - 1;
                host_run[w as usize] = walker.host;
                walker.worker = NIL;
                stopped = true;
            }
        }
        if stopped {
            alive.retain(|walker| walker.worker != NIL);
        }
    }

    /// The walk from block `from` on, with only `walker` still matching:
    /// the same steps as `overlaps_by_tier`'s loop for one worker, with its
    /// state in registers and each matched node recorded in the trail.
    fn walk_alone(&mut self, walker: Walker, hashes: &[u64], from: usize, tiered: bool) {
        let w = walker.worker;
        let wi = w as usize;
        let (mut successor, mut host) = (walker.successor, walker.host);
        let mut last = from as u32 - 1;
        self.trail.reserve(hashes.len().saturating_sub(from));
        self.trail_worker = w;
        self.trail_from = from;
        // A placement allocates a new run's nodes last block first, so the
        // node of the block after `previous` is most often the one just
        // below it in the arena. Tried first, it lets the reads go ahead of
        // the links: following `successor` alone waits for each node's load
        // before the next can start. A guess is checked as a link is.
        let mut previous = NIL;
        // The previous node's `older`, and whether every trail entry so far
        // is linked to the next (see `trail_linked`).
        let mut previous_older = NIL;
        let mut linked = !tiered;
        let mut linked_count = 0;
        for (i, &hash) in hashes.iter().enumerate().skip(from) {
            let holds = |node: u32| {
                self.nodes
                    .get(node as usize)
                    .filter(|s| s.worker() == w && s.hash() == hash)
                    .map(|&n| (node, n))
            };
            let found = holds(previous.wrapping_sub(1))
                .or_else(|| (successor != NIL).then(|| holds(successor)).flatten())
                .or_else(|| self.find(w, hash).map(|next| (next, self.nodes[next as usize])));
            let Some((next, n)) = found else { break };
            if previous != NIL {
                linked = linked && previous_older == next && successor == next;
                linked_count += usize::from(linked);
            }
            previous = next;
            previous_older = n.older;
            successor = n.successor;
            last = i as u32;
            self.trail.push(next);
            if tiered {
                host += u32::from(n.host_only());
            }
        }
        self.trail_linked = linked_count;
        self.last_match[wi] = last;
        self.host_run[wi] = host;
    }

    /// `worker`'s node in the holder chain starting at `first`.
    fn holder_from(&self, node: u32, worker: u32) -> Option<u32> {
        holder_in(&self.nodes, node, worker)
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
        self.insert_blocks(worker, hashes, false)
    }

    /// `insert` of the blocks `walk` walked, just after that walk: the run
    /// of a worker's nodes the walk found already in order is moved whole,
    /// without reading each node again. The walk's borrow of the blocks
    /// is what makes that safe: they cannot have changed since, and a walk
    /// of other blocks is not one this accepts.
    pub fn insert_walked(&mut self, worker: WorkerId, walk: Walk<'_>) -> usize {
        // This index's latest walk, of these very blocks (a walk of another
        // index may carry the same stamp; it did not walk this slice).
        let latest =
            walk.walk == self.trail_walk && self.walked_blocks == (walk.hashes.as_ptr() as usize, walk.hashes.len());
        self.insert_blocks(worker, walk.hashes, latest)
    }

    fn insert_blocks(&mut self, worker: WorkerId, hashes: &[u64], walked: bool) -> usize {
        let w = worker.0;
        if w >= self.workers.len() {
            return 0;
        }
        let worker_u32 = w as u32;
        // Forward: find the nodes the worker already has, following
        // successor links as the lookup does; the leading ones from the
        // walk just before, when nothing changed since (each is checked
        // against its block, so a walk of other blocks is never used).
        let mut placed = std::mem::take(&mut self.placed);
        placed.clear();
        let linked = self.walked_prefix(w, hashes, &mut placed);
        let linked = if walked { linked } else { 0..0 };
        self.follow(worker_u32, &hashes[placed.len()..], &mut placed);
        // Backward: touch or create each block, last first (so the first
        // block ends newest), and link each to the block after it. Blocks
        // that already follow one another in the worker's list, in request
        // order (a session's prefix placed there before and not touched
        // since), move to the newest end as one run: two links at each end
        // instead of an unlink and a push per block. The list comes out as
        // one push per block, last first, would leave it (callgrind at 10M
        // entries, 64 workers, 1,600 blocks: the unlink and push were 290k
        // of the 667k instructions of a Pick). A host-only block is back on
        // the GPU: the engine loaded it.
        let mut after = NIL;
        // The GPU nodes waiting to move, newest end first: each one's
        // `older` is the next, as in the list now.
        let (mut run_first, mut run_last) = (NIL, NIL);
        for (i, &hash) in hashes.iter().enumerate().rev() {
            // The walk read this node, its worker's GPU node of this block,
            // already the next block's `older` and linked to it: it extends
            // the run that node began, as `read_for_touch` would find.
            if linked.contains(&i) && run_first != NIL && placed.get(i + 1) == Some(&run_first) {
                run_first = placed[i];
                after = run_first;
                continue;
            }
            let mut found = placed[i];
            let mut read = self.read_for_touch(found, worker_u32, hash, after);
            if read == Touch::NotIts {
                // A node from the walk that is not this worker's node of
                // this block (the walk was of other blocks: never in the
                // router's own use) is looked up as the forward pass would.
                found = self.find(worker_u32, hash).unwrap_or(NIL);
                read = self.read_for_touch(found, worker_u32, hash, after);
            }
            let gpu_older = match read {
                Touch::Gpu(older) => Some(older),
                _ => None,
            };
            let node = if let Some(older) = gpu_older {
                if run_first == NIL || older != run_first {
                    if run_first != NIL {
                        self.move_run_newest(w, run_first, run_last);
                    }
                    run_last = found;
                }
                run_first = found;
                found
            } else {
                if run_first != NIL {
                    self.move_run_newest(w, run_first, run_last);
                    run_first = NIL;
                }
                let node = if found != NIL {
                    self.unlink_lru(found);
                    self.nodes[found as usize].set_host_only(false);
                    self.hosts[w].len -= 1;
                    self.workers[w].len += 1;
                    found
                } else {
                    // One probe of the block table: the new node becomes the
                    // block's first holder, ahead of the one it replaces.
                    let node = self.nodes.alloc(Node::new(hash, worker_u32, NIL));
                    let next_holder = self.set_first(hash, node);
                    self.nodes[node as usize].next_holder = next_holder;
                    if next_holder != NIL {
                        let nodes = &self.nodes;
                        self.holder_sets.add(hash, worker_u32, || holder_set_of(nodes, node));
                    }
                    self.workers[w].len += 1;
                    node
                };
                self.push_newest(node);
                self.nodes[node as usize].successor = after;
                node
            };
            after = node;
        }
        if run_first != NIL {
            self.move_run_newest(w, run_first, run_last);
        }
        self.placed = placed;
        self.evict_over_capacity(w) + self.evict_over_budget()
    }

    /// Moves `worker`'s `count` oldest GPU blocks to its host list (the
    /// engine evicted them from the GPU and kept their host copies), then
    /// holds the host list to its capacity. Returns how many moved.
    pub fn demote_oldest(&mut self, worker: WorkerId, count: usize) -> usize {
        let mut moved = 0;
        while moved < count
            && let Some(oldest) = oldest_of(&self.workers, worker.0)
        {
            self.demote(oldest);
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
        while dropped < count
            && let Some(oldest) = oldest_of(&self.hosts, worker.0)
        {
            self.remove_node(oldest);
            dropped += 1;
        }
        dropped
    }

    /// Drops `worker`'s `count` oldest GPU blocks, host copies or not (see
    /// `demote_oldest` for the engine keeping them); returns how many.
    pub fn drop_oldest(&mut self, worker: WorkerId, count: usize) -> usize {
        let mut dropped = 0;
        while dropped < count
            && let Some(oldest) = oldest_of(&self.workers, worker.0)
        {
            self.remove_node(oldest);
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
        while self.workers[w].len > self.workers[w].capacity
            && let Some(oldest) = oldest_of(&self.workers, w)
        {
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
        while self.hosts[w].len > self.hosts[w].capacity
            && let Some(oldest) = oldest_of(&self.hosts, w)
        {
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
        // A walk's linked run may hold this node: it is no longer a GPU
        // node in that order.
        self.trail_linked = 0;
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

    /// One read of a node being placed, for its tier, its list neighbour
    /// and its successor (which becomes `after`); indexing the arena is
    /// most of the placement's work.
    fn read_for_touch(&mut self, node: u32, worker: u32, hash: u64, after: u32) -> Touch {
        if node == NIL {
            return Touch::New;
        }
        let Some(n) = self.nodes.get_mut(node as usize) else {
            return Touch::NotIts;
        };
        if n.worker_tier & WORKER_MASK != worker || n.hash() != hash {
            return Touch::NotIts;
        }
        if n.host_only() {
            return Touch::Host;
        }
        if n.successor != after {
            n.successor = after;
        }
        Touch::Gpu(n.older)
    }

    /// Appends to `placed` `worker`'s node (or `NIL`) of each of `hashes`,
    /// trying the node below the last one in `placed` and then its
    /// successor link, as the lookup does, and probing the table where
    /// both miss.
    fn follow(&self, worker: u32, hashes: &[u64], placed: &mut Vec<u32>) {
        let mut previous = placed.last().copied().unwrap_or(NIL);
        for &hash in hashes {
            let holds = |node: u32| {
                self.nodes
                    .get(node as usize)
                    .is_some_and(|n| n.worker() == worker && n.hash() == hash)
            };
            let guess = previous.wrapping_sub(1);
            let linked = (previous != NIL)
                .then(|| {
                    if holds(guess) {
                        guess
                    } else {
                        self.nodes[previous as usize].successor
                    }
                })
                .filter(|&s| s != NIL && holds(s));
            let node = linked.or_else(|| self.find(worker, hash)).unwrap_or(NIL);
            placed.push(node);
            previous = node;
        }
    }

    /// Writes into `placed` worker `w`'s nodes of the leading blocks the
    /// latest walk matched, if it is still good (no removal or insert
    /// since): its first node, the nodes its successor links lead to while
    /// other workers still matched, and the nodes recorded once it walked
    /// alone. The placement checks each against its block as it reads it,
    /// so a walk of other blocks is never trusted. Returns the indexes `i`
    /// of `placed` whose node the walk found already linked to
    /// `placed[i + 1]` (see `trail_linked`), for a placement handed the
    /// walk itself to move whole.
    fn walked_prefix(&mut self, w: usize, hashes: &[u64], placed: &mut Vec<u32>) -> std::ops::Range<usize> {
        if !std::mem::replace(&mut self.trail_live, false) || self.trail_walks[w] != self.trail_walk {
            return 0..0;
        }
        let run = (self.last_match[w] as usize + 1).min(hashes.len());
        if run == 0 {
            return 0..0;
        }
        placed.push(self.trail_start[w]);
        let alone_from = if self.trail_worker == w as u32 {
            self.trail_from.clamp(1, run)
        } else {
            run
        };
        self.follow(w as u32, &hashes[1..alone_from], placed);
        let recorded = self.trail.len().min(run - alone_from);
        placed.extend_from_slice(&self.trail[..recorded]);
        if self.trail_worker != w as u32 {
            return 0..0;
        }
        let linked = self.trail_linked.min(recorded.saturating_sub(1));
        alone_from..alone_from + linked
    }

    /// Moves the run of worker `w`'s GPU nodes from `first` (the newest
    /// end) through `last`, linked by `older` in between, to the newest end
    /// of its list, in their order.
    fn move_run_newest(&mut self, w: usize, first: u32, last: u32) {
        let newest = self.workers[w].newest;
        if newest == first {
            return;
        }
        let before = self.nodes[first as usize].newer;
        let after = self.nodes[last as usize].older;
        self.nodes[before as usize].older = after;
        if after == NIL {
            self.workers[w].oldest = before;
        } else {
            self.nodes[after as usize].newer = before;
        }
        self.nodes[last as usize].older = newest;
        self.nodes[newest as usize].newer = last;
        self.nodes[first as usize].newer = NIL;
        self.workers[w].newest = first;
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
        self.trail_live = false;
        self.unlink_lru(node);
        let removed = self.nodes[node as usize];
        let (hash, next_holder) = (removed.hash(), removed.next_holder);
        self.list_of(node).len -= 1;
        // Unlink from the block's holder chain (chains are short: the
        // workers holding one block).
        if let Some(first) = self.first_of(hash) {
            let mut shared = true;
            if first == node {
                if next_holder == NIL {
                    self.remove_block(hash);
                    shared = false;
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
            if shared {
                self.holder_sets.remove(hash, removed.worker());
            }
        }
        self.nodes.free(node);
    }
}

#[cfg(test)]
impl PrefixIndex {
    /// Per-worker steps the walks have taken so far.
    pub(crate) fn worker_steps(&self) -> u64 {
        self.worker_steps.get()
    }

    /// Fails unless every block held by [`MIN_HOLDERS`] or more workers has
    /// the holder set its chain lists, and no other block has one.
    pub(crate) fn check_holder_sets(&self) {
        let mut shared = 0;
        let mut seen = std::collections::HashSet::new();
        for list in self.workers.iter().chain(&self.hosts) {
            let mut node = list.oldest;
            while node != NIL {
                let n = &self.nodes[node as usize];
                let hash = n.hash();
                if seen.insert(hash) {
                    let first = self.first_of(hash).unwrap_or(NIL);
                    let (count, signature) = holder_set_of(&self.nodes, first);
                    if count >= MIN_HOLDERS {
                        shared += 1;
                        assert_eq!(self.holder_sets.get(hash), Some((count, signature)), "block {hash}");
                    } else {
                        assert_eq!(self.holder_sets.get(hash), None, "block {hash}");
                    }
                }
                node = n.newer;
            }
        }
        assert_eq!(self.holder_sets.len(), shared);
    }
}

/// How many workers the holder chain from `node` lists, and the sum of
/// their marks: a block's holder set, built whole when it gets its second
/// holder.
fn holder_set_of(nodes: &Nodes, mut node: u32) -> (u32, u64) {
    let (mut count, mut signature) = (0u32, 0u64);
    while node != NIL {
        let n = &nodes[node as usize];
        count += 1;
        signature = signature.wrapping_add(mark(n.worker()));
        node = n.next_holder;
    }
    (count, signature)
}

/// `worker`'s node in the holder chain of `nodes` starting at `node`.
fn holder_in(nodes: &Nodes, mut node: u32, worker: u32) -> Option<u32> {
    while node != NIL {
        let n = &nodes[node as usize];
        if n.worker() == worker {
            return Some(node);
        }
        node = n.next_holder;
    }
    None
}

fn clamp_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX - 1)
}
