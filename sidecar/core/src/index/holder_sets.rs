//! `HolderSets`: for every block more than one worker holds, how many hold
//! it and a signature of which, so a prefix walk can tell in one probe that
//! a block is held by exactly the workers still matching, and step them all
//! at once.
//!
//! A fleet's common system prompt and tools sit on every worker: hundreds
//! of blocks, each held by all of them. Following each worker's own node
//! through such a run costs a node read per block per worker (500 blocks
//! over 64 workers: 32,000 reads, about 100 µs); Dynamo's radix tree keeps
//! one node per run with the set of workers holding it. Here a block's
//! holder set is a count and a sum of a 64-bit mix of each holder's id:
//! two different sets of the same size have the same sum with probability
//! about 2^-64, the odds the block hashes themselves already accept.
//!
//! Only a block held by [`MIN_HOLDERS`] or more workers has a set: most
//! blocks are a session's own, on its home only, and a block on a few
//! workers is stepped as cheaply through its holder chain. A set costs
//! about 25 bytes, so at most about 3 bytes per entry. Sets live in an
//! [`Arena`], as the nodes do, found through a [`HolderTable`], which grows
//! without a stop-the-world rehash.

use super::arena::{Arena, Slot};
use super::holders::HolderTable;

/// One shared block: its hash (split so the entry aligns to 4), how many
/// workers hold it, and the sum of their marks.
#[derive(Debug, Clone, Copy)]
struct HolderSet {
    hash_lo: u32,
    hash_hi: u32,
    count: u32,
    signature_lo: u32,
    signature_hi: u32,
}

const _: () = assert!(size_of::<HolderSet>() == 20);

impl HolderSet {
    fn hash(&self) -> u64 {
        (u64::from(self.hash_hi) << 32) | u64::from(self.hash_lo)
    }

    fn signature(&self) -> u64 {
        (u64::from(self.signature_hi) << 32) | u64::from(self.signature_lo)
    }

    fn set_signature(&mut self, signature: u64) {
        self.signature_lo = signature as u32;
        self.signature_hi = (signature >> 32) as u32;
    }
}

/// The fewest holders a block's set is kept for. Every block held by two
/// workers with a set cost 13 bytes per entry (53 in all, where the index
/// promises 40); at eight, at most about 3.
pub(super) const MIN_HOLDERS: u32 = 8;

/// A worker's mark: holder sets are compared by the sum of their marks.
pub(super) fn mark(worker: u32) -> u64 {
    crate::splitmix64(u64::from(worker) ^ 0x6b76_6d65_7368_0001)
}

impl Slot for HolderSet {
    /// A freed set has a count of 0 (a live one's is at least
    /// [`MIN_HOLDERS`]), its link in `signature_lo`.
    fn freed(next_free: u32) -> Self {
        HolderSet {
            hash_lo: 0,
            hash_hi: 0,
            count: 0,
            signature_lo: next_free,
            signature_hi: 0,
        }
    }

    fn next_free(&self) -> u32 {
        self.signature_lo
    }
}

/// Block hash → (holders, signature) for blocks held by [`MIN_HOLDERS`] or more.
#[derive(Debug, Clone)]
pub(super) struct HolderSets {
    table: HolderTable,
    sets: Arena<HolderSet, 12>,
}

impl Default for HolderSets {
    fn default() -> Self {
        Self {
            table: HolderTable::default(),
            sets: Arena::new(),
        }
    }
}

impl HolderSets {
    fn slot(&self, id: u32) -> &HolderSet {
        &self.sets[id as usize]
    }

    fn slot_mut(&mut self, id: u32) -> &mut HolderSet {
        &mut self.sets[id as usize]
    }

    fn find(&self, hash: u64) -> Option<u32> {
        self.table.find(hash, |id| self.slot(id).hash())
    }

    /// How many workers hold `hash` and their signature, when
    /// [`MIN_HOLDERS`] or more do.
    #[cfg(test)]
    pub(super) fn get(&self, hash: u64) -> Option<(u32, u64)> {
        let set = self.slot(self.find(hash)?);
        Some((set.count, set.signature()))
    }

    /// `get`, trying the set just below `near` first, and also returning
    /// where the set was found (the next block's `near`). A placement
    /// gives a prefix's blocks their sets last block first, so the next
    /// block's set is most often there: one read in place of a table probe.
    pub(super) fn get_near(&self, hash: u64, near: u32) -> Option<(u32, u32, u64)> {
        let guess = near.wrapping_sub(1);
        let id = match self.sets.get(guess as usize) {
            Some(set) if set.hash() == hash && set.count != 0 => guess,
            _ => self.find(hash)?,
        };
        let set = self.slot(id);
        Some((id, set.count, set.signature()))
    }

    /// Blocks with a set.
    pub(super) fn len(&self) -> usize {
        self.sets.live()
    }

    /// One more worker, `worker`, holds `hash`; `holders` (called only
    /// when the block had no set) lists every holder, `worker` included.
    pub(super) fn add(&mut self, hash: u64, worker: u32, holders: impl FnOnce() -> (u32, u64)) {
        if let Some(id) = self.find(hash) {
            let set = self.slot_mut(id);
            set.count += 1;
            let signature = set.signature().wrapping_add(mark(worker));
            set.set_signature(signature);
            return;
        }
        let (count, signature) = holders();
        if count < MIN_HOLDERS {
            return;
        }
        let mut set = HolderSet {
            hash_lo: hash as u32,
            hash_hi: (hash >> 32) as u32,
            count,
            signature_lo: 0,
            signature_hi: 0,
        };
        set.set_signature(signature);
        let id = self.sets.alloc(set);
        let sets = &self.sets;
        self.table.set(hash, id, |id| sets[id as usize].hash());
    }

    /// `worker` no longer holds `hash`: its set shrinks, and goes below
    /// [`MIN_HOLDERS`].
    pub(super) fn remove(&mut self, hash: u64, worker: u32) {
        let Some(id) = self.find(hash) else { return };
        let set = self.slot_mut(id);
        set.count = set.count.saturating_sub(1);
        let signature = set.signature().wrapping_sub(mark(worker));
        set.set_signature(signature);
        if set.count < MIN_HOLDERS {
            let sets = &self.sets;
            self.table.remove(hash, |id| sets[id as usize].hash());
            self.sets.free(id);
        }
    }

    pub(super) fn memory_bytes(&self) -> usize {
        self.table.allocation_size() + self.sets.allocated_bytes()
    }
}
