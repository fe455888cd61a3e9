//! A least-recently-used set with a capacity, as an engine's prefix cache
//! behaves: touching a key makes it newest, inserting past capacity evicts the
//! oldest.
//!
//! Touches are the hot path (every block of every routed request), so they
//! cost one hash-map write and one queue push: the queue keeps every touch in
//! order and stale entries (keys touched again since) are skipped when
//! evicting and dropped when the queue grows past twice the live set.

use std::collections::VecDeque;
use std::hash::Hash;

use hashbrown::HashMap;

/// LRU set of `K` bounded by `capacity` entries.
#[derive(Debug, Clone)]
pub struct Lru<K> {
    capacity: usize,
    clock: u64,
    stamp_of: HashMap<K, u64>,
    /// Touches in order, oldest first; an entry is live while its stamp is
    /// still the key's stamp.
    order: VecDeque<(u64, K)>,
}

impl<K: Hash + Eq + Clone> Lru<K> {
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            clock: 0,
            stamp_of: HashMap::new(),
            order: VecDeque::new(),
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

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Inserts `key` as the newest entry (or refreshes it); returns how many
    /// old entries were evicted to make room.
    pub fn touch(&mut self, key: K) -> usize {
        self.clock += 1;
        self.stamp_of.insert(key.clone(), self.clock);
        self.order.push_back((self.clock, key));
        let mut evicted = 0;
        while self.stamp_of.len() > self.capacity {
            if self.pop_oldest().is_none() {
                break;
            }
            evicted += 1;
        }
        if self.order.len() > 2 * self.stamp_of.len() + 64 {
            let stamp_of = &self.stamp_of;
            self.order.retain(|(stamp, key)| stamp_of.get(key) == Some(stamp));
        }
        evicted
    }

    /// The least recently used key, without removing it.
    pub fn oldest(&mut self) -> Option<&K> {
        // Skip entries made stale by later touches or removals.
        while let Some((stamp, key)) = self.order.front() {
            if self.stamp_of.get(key) == Some(stamp) {
                break;
            }
            self.order.pop_front();
        }
        self.order.front().map(|(_, key)| key)
    }

    /// Removes and returns the least recently used key.
    pub fn pop_oldest(&mut self) -> Option<K> {
        while let Some((stamp, key)) = self.order.pop_front() {
            if self.stamp_of.get(&key) == Some(&stamp) {
                self.stamp_of.remove(&key);
                return Some(key);
            }
        }
        None
    }

    pub fn remove(&mut self, key: &K) -> bool {
        // Its queue entries become stale and are skipped later.
        self.stamp_of.remove(key).is_some()
    }

    pub fn clear(&mut self) {
        self.stamp_of.clear();
        self.order.clear();
    }
}
