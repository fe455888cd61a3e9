//! A least-recently-used set with a capacity, as an engine's prefix cache
//! behaves: touching a key makes it newest, inserting past capacity evicts the
//! oldest.

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;

/// LRU set of `K` bounded by `capacity` entries.
#[derive(Debug, Clone)]
pub struct Lru<K> {
    capacity: usize,
    clock: u64,
    stamp_of: HashMap<K, u64>,
    by_age: BTreeMap<u64, K>,
}

impl<K: Hash + Eq + Clone> Lru<K> {
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            clock: 0,
            stamp_of: HashMap::new(),
            by_age: BTreeMap::new(),
        }
    }

    pub fn contains(&self, key: &K) -> bool {
        self.stamp_of.contains_key(key)
    }

    pub fn len(&self) -> usize {
        self.stamp_of.len()
    }

    pub fn is_empty(&self) -> bool {
        self.stamp_of.is_empty()
    }

    /// Inserts `key` as the newest entry (or refreshes it); returns how many
    /// old entries were evicted to make room.
    pub fn touch(&mut self, key: K) -> usize {
        self.clock += 1;
        if let Some(old) = self.stamp_of.insert(key.clone(), self.clock) {
            self.by_age.remove(&old);
        }
        self.by_age.insert(self.clock, key);
        let mut evicted = 0;
        while self.stamp_of.len() > self.capacity {
            let Some((_, oldest)) = self.by_age.pop_first() else {
                break;
            };
            self.stamp_of.remove(&oldest);
            evicted += 1;
        }
        evicted
    }

    pub fn remove(&mut self, key: &K) -> bool {
        match self.stamp_of.remove(key) {
            Some(stamp) => {
                self.by_age.remove(&stamp);
                true
            }
            None => false,
        }
    }

    pub fn clear(&mut self) {
        self.stamp_of.clear();
        self.by_age.clear();
    }
}
