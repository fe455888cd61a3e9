//! `HolderTable`: block hash → the node of the block's first holder, a hash
//! table of 4-byte node ids (the hash itself is read from the node), which
//! grows without a stop-the-world rehash.
//!
//! hashbrown grows a full table inside the insert that found it full: every
//! entry moves to a table twice the size, and each move reads its node's
//! hash from the arena, a cache miss at millions of entries. A sidecar with
//! 100k sessions stalled single Picks for 77-187 ms near 1.8M and 3.7M
//! entries (7/8 of 2^21 and 2^22 buckets, hashbrown's load limit). Deletions
//! do the same later: their tombstones fill the table until hashbrown
//! rehashes it in place, again all at once. Here a full table is set aside
//! and a fresh one takes the inserts (as many buckets when its live entries
//! are at most 3/4 of what it holds, the rest tombstones, else twice the
//! buckets), so churn at a steady size never grows it; the old one drains
//! into it four entries per insert, and lookups read both until it is
//! empty. hashbrown's own rule is half, not 3/4: a table whose live entries
//! sit between half and 3/4 of its room doubles once under churn. An index
//! at its capacity of 2,097,152 entries (57 % of 2^22 buckets' room) did,
//! from 20 to 40 MiB, in a third wave of sessions. At 3/4 the drain still
//! ends first: the old table's entries move four per insert, so it is empty
//! after a quarter of them, and by then the fresh table holds at most 15/16
//! of its room.

use hashbrown::HashTable;

/// Entries moved from the old table per insert, and buckets of it looked
/// at per insert (most are empty or moved already). One move per insert
/// would do: the new table has room for twice the old one's entries (or,
/// same size, those were at most half of it). Four end a drain within a
/// quarter more inserts, so an index filling up is rarely caught holding
/// both tables (at two, the Pick bench's 10M entries were mid-drain: 40.7
/// bytes per entry instead of 36.5, and every miss probed both tables).
const MOVES_PER_INSERT: usize = 8;
const BUCKETS_PER_INSERT: usize = 64;

/// Table hash of a block hash: block hashes are already uniform, one
/// multiply spreads them over the table's bits.
fn table_hash(hash: u64) -> u64 {
    hash.wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// Entries hashbrown lets a table of `buckets` hold (7/8 of them, one less
/// than all for the smallest).
fn full_capacity(buckets: usize) -> usize {
    if buckets <= 8 {
        buckets.saturating_sub(1)
    } else {
        buckets / 8 * 7
    }
}

/// Block hash → first holder; `key` reads a node's block hash.
#[derive(Debug, Clone, Default)]
pub(super) struct HolderTable {
    table: HashTable<u32>,
    /// The table being emptied into `table`, until it is empty.
    old: HashTable<u32>,
    /// The next bucket of `old` to move.
    cursor: usize,
}

impl HolderTable {
    /// The first holder of `hash`.
    pub(super) fn find(&self, hash: u64, key: impl Fn(u32) -> u64) -> Option<u32> {
        let th = table_hash(hash);
        if let Some(&node) = self.table.find(th, |&n| key(n) == hash) {
            return Some(node);
        }
        if self.old.is_empty() {
            return None;
        }
        self.old.find(th, |&n| key(n) == hash).copied()
    }

    /// Makes `node` the first holder of `hash` (whose node `key` must read
    /// as `hash` already); returns the first holder it replaced, `None`
    /// when the block is new.
    pub(super) fn set(&mut self, hash: u64, node: u32, key: impl Fn(u32) -> u64) -> Option<u32> {
        let th = table_hash(hash);
        if let Some(slot) = self.table.find_mut(th, |&n| key(n) == hash) {
            return Some(std::mem::replace(slot, node));
        }
        if !self.old.is_empty()
            && let Some(slot) = self.old.find_mut(th, |&n| key(n) == hash)
        {
            return Some(std::mem::replace(slot, node));
        }
        self.make_room(&key);
        self.table.insert_unique(th, node, |&n| table_hash(key(n)));
        None
    }

    /// Forgets the block `hash`.
    pub(super) fn remove(&mut self, hash: u64, key: impl Fn(u32) -> u64) {
        let th = table_hash(hash);
        if let Ok(entry) = self.table.find_entry(th, |&n| key(n) == hash) {
            entry.remove();
        } else if !self.old.is_empty()
            && let Ok(entry) = self.old.find_entry(th, |&n| key(n) == hash)
        {
            entry.remove();
        }
    }

    /// Blocks held.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.table.len() + self.old.len()
    }

    pub(super) fn allocation_size(&self) -> usize {
        self.table.allocation_size() + self.old.allocation_size()
    }

    /// Buckets of the table taking inserts and of the one draining.
    #[cfg(test)]
    fn buckets(&self) -> (usize, usize) {
        (self.table.num_buckets(), self.old.num_buckets())
    }

    /// Before an insert: moves a few old entries, and sets a full table
    /// aside for a fresh one, so the insert never makes hashbrown resize.
    fn make_room(&mut self, key: &impl Fn(u32) -> u64) {
        if !self.old.is_empty() {
            self.drain(MOVES_PER_INSERT, BUCKETS_PER_INSERT, key);
        }
        if self.table.len() < self.table.capacity() {
            return;
        }
        // Not reached with the sizes below (see the module doc); if it were, finishing the
        // drain at once keeps one table aside at a time.
        if !self.old.is_empty() {
            self.drain(usize::MAX, usize::MAX, key);
        }
        let full = full_capacity(self.table.num_buckets());
        let target = if self.table.len() <= full / 4 * 3 {
            full
        } else {
            full * 2
        };
        let fresh = HashTable::with_capacity(target.max(16));
        self.old = std::mem::replace(&mut self.table, fresh);
        self.cursor = 0;
    }

    /// Moves up to `moves` entries of the old table, looking at up to
    /// `buckets` of its buckets; frees it once empty.
    fn drain(&mut self, mut moves: usize, mut buckets: usize, key: &impl Fn(u32) -> u64) {
        while moves > 0 && buckets > 0 && !self.old.is_empty() && self.cursor < self.old.num_buckets() {
            buckets -= 1;
            match self.old.get_bucket_entry(self.cursor) {
                Ok(entry) => {
                    let (node, _) = entry.remove();
                    self.table
                        .insert_unique(table_hash(key(node)), node, |&n| table_hash(key(n)));
                    moves -= 1;
                }
                Err(_) => self.cursor += 1,
            }
        }
        if self.old.is_empty() && self.old.num_buckets() > 1 {
            self.old = HashTable::new();
            self.cursor = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Entries are ids into `keys`, as nodes are ids into the arena.
    fn key(keys: &[u64]) -> impl Fn(u32) -> u64 + '_ {
        |n| keys[n as usize]
    }

    #[test]
    fn a_full_table_drains_into_a_larger_one_a_few_entries_per_insert() {
        let keys: Vec<u64> = (0..300_000u64)
            .map(|i| i.wrapping_mul(0x2545_f491_4f6c_dd1d) | 1)
            .collect();
        let mut table = HolderTable::default();
        let mut drains = 0;
        for (n, &k) in keys.iter().enumerate() {
            let before = table.buckets();
            assert_eq!(table.set(k, n as u32, key(&keys)), None);
            let after = table.buckets();
            // hashbrown never resized inside an insert: either nothing
            // changed, or a drain began (the full table set aside whole),
            // or the drained table was freed.
            if after != before {
                let began = after.1 == before.0 && after.0 > before.0;
                let ended = after.0 == before.0 && after.1 <= 1;
                assert!(began || ended, "{before:?} -> {after:?} at {n}");
                drains += usize::from(began);
            }
            if n % 997 == 0 {
                for (m, &k) in keys.iter().enumerate().take(n + 1).step_by(101) {
                    assert_eq!(table.find(k, key(&keys)), Some(m as u32));
                }
            }
        }
        assert!(drains >= 10, "{drains}");
        assert_eq!(table.len(), keys.len());
    }

    #[test]
    fn churn_at_a_steady_size_does_not_grow_the_table() {
        let keys: Vec<u64> = (0..2_000_000u64)
            .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
            .collect();
        let live = 50_000;
        let mut table = HolderTable::default();
        let mut largest = [0usize; 2];
        for (n, &k) in keys.iter().enumerate() {
            table.set(k, n as u32, key(&keys));
            if n >= live {
                table.remove(keys[n - live], key(&keys));
            }
            let wave = usize::from(n >= keys.len() / 2);
            largest[wave] = largest[wave].max(table.allocation_size());
        }
        assert_eq!(table.len(), live);
        // Tombstones set a table aside as often as they fill it, but the
        // second million never needs more memory than the first.
        assert!(largest[1] <= largest[0], "{largest:?}");
    }

    #[test]
    fn churn_between_half_and_three_quarters_full_never_grows_past_the_fill() {
        // 32,000 live entries: 2^16 buckets hold 57,344, so they are 56 %
        // of the table's room, where hashbrown's rule would double it.
        let keys: Vec<u64> = (0..1_000_000u64)
            // splitmix64: block hashes are uniform, and a weaker mix spreads
            // keys too evenly over the groups to leave tombstones.
            .map(crate::splitmix64)
            .collect();
        let live = 32_000;
        let mut table = HolderTable::default();
        // The first size with one table once the fill's last drain ended,
        // the largest with one table after it, the largest during a drain
        // of the churn.
        let (mut settled, mut churned, mut draining) = (None, 0usize, 0usize);
        for (n, &k) in keys.iter().enumerate() {
            table.set(k, n as u32, key(&keys));
            if n < live {
                continue;
            }
            table.remove(keys[n - live], key(&keys));
            let size = table.allocation_size();
            if table.buckets().1 > 1 {
                if settled.is_some() {
                    draining = draining.max(size);
                }
            } else {
                settled.get_or_insert(size);
                churned = churned.max(size);
            }
        }
        let filled = settled.unwrap_or(0);
        assert_eq!(table.len(), live);
        assert_eq!(table.buckets().0, 1 << 16, "the table grew");
        assert!(churned <= filled, "churn {churned} > fill {filled}");
        // A same-size table set aside costs a second one while it drains.
        assert!(draining <= 2 * filled, "drain {draining} > 2x {filled}");
    }
}
