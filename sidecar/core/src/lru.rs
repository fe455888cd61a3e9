//! Least-recently-used containers with a capacity: `LruMap<K, V>`, a map
//! whose entries are ordered by last use (every bounded table of the core:
//! sessions, pending picks, the ledger's traces and calls), and `Lru<K>`,
//! the same as a set, as an engine's prefix cache behaves (touching a key
//! makes it newest, inserting past capacity evicts the oldest).
//!
//! Touches are the hot path (every block of every routed request, in the
//! simulator's engines), so they cost one hash-map write and one queue push:
//! the queue keeps every touch in order and stale entries (keys touched
//! again since) are skipped when evicting and dropped, a few per write, once
//! the queue grows past twice the live set. One structure, so the order and the values can
//! never disagree (they were once a `Lru` and a `HashMap` kept in step by
//! hand, four times).

use std::borrow::Borrow;
use std::collections::VecDeque;
use std::hash::Hash;

use hashbrown::HashMap;

/// Whether the queue entry `(stamp, key)` is still `key`'s latest touch
/// (else a later touch or a removal made it stale).
fn is_live<K: Hash + Eq, V>(entries: &HashMap<K, (u64, V)>, stamp: u64, key: &K) -> bool {
    entries.get(key).is_some_and(|(s, _)| *s == stamp)
}

/// The room to shrink a table of `capacity` holding `live` entries to, when
/// it is far larger than they need (more than four times, and past a
/// floor): twice the live entries, so that shrinking costs amortised O(1)
/// per removal and the table can grow back without rehashing at once. The
/// one rule for every bounded table of the core (see `LruMap::shrink`).
pub(crate) fn shrunk_room(capacity: usize, live: usize) -> Option<usize> {
    const FLOOR: usize = 1024;
    (capacity > FLOOR && capacity > 4 * live).then(|| (2 * live).max(FLOOR / 2))
}

/// A map of at most `capacity` entries, ordered by last insert or touch.
#[derive(Debug, Clone)]
pub struct LruMap<K, V> {
    capacity: usize,
    clock: u64,
    /// Each key's value and the stamp of its latest touch.
    entries: HashMap<K, (u64, V)>,
    /// Touches in order, oldest first; an entry is live while its stamp is
    /// still the key's stamp.
    order: Order<K>,
}

/// Live entries dropped from the queue per write while it is compacted.
/// The queue then holds at most about 2.5x the live set (a compaction of
/// `L` entries takes `L / 4` writes, each pushing one); one write never
/// looks at more than this many.
const COMPACT_STEP: usize = 4;

/// The touch queue: `head` then `tail`, both in stamp order, every stamp
/// of `head` below every stamp of `tail`. A compaction moves the live
/// entries at the front of `tail` to the back of `head`, `COMPACT_STEP` a
/// write, until the `remaining` entries that were in the queue when it
/// began are done; then the two are one again. (It was one `retain` over
/// the whole queue inside the write that crossed the bound: at 100,000
/// sessions keyed by strings, a 50-60 ms stall of one touch every 100,000.)
#[derive(Debug, Clone)]
struct Order<K> {
    head: Chunked<(u64, K)>,
    tail: Chunked<(u64, K)>,
    remaining: usize,
}

/// Entries of a [`Chunked`] queue's chunk.
const QUEUE_CHUNK: usize = 1024;

/// A queue in chunks of [`QUEUE_CHUNK`] entries: it grows a chunk at a
/// time, never by doubling. A `VecDeque` of 131,072 touches doubled inside
/// one write, a 4 MB copy that took 1.8 ms under mimalloc (whose realloc
/// copies); the sidecar's session-keyed maps, touched together by every
/// Pick, reached that size together, and Picks 15 s into `kvmesh-bench
/// scale`'s steady phase took 5.8-6.9 ms. No chunk is ever empty, nor
/// holds more than [`QUEUE_CHUNK`] (so none ever reallocates).
#[derive(Debug, Clone)]
struct Chunked<T> {
    chunks: VecDeque<VecDeque<T>>,
    len: usize,
}

impl<T> Chunked<T> {
    fn new() -> Self {
        Self {
            chunks: VecDeque::new(),
            len: 0,
        }
    }

    fn len(&self) -> usize {
        self.len
    }

    fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn push_back(&mut self, entry: T) {
        match self.chunks.back_mut() {
            Some(chunk) if chunk.len() < QUEUE_CHUNK => chunk.push_back(entry),
            _ => {
                let mut chunk = VecDeque::with_capacity(QUEUE_CHUNK);
                chunk.push_back(entry);
                self.chunks.push_back(chunk);
            }
        }
        self.len += 1;
    }

    fn front(&self) -> Option<&T> {
        self.chunks.front()?.front()
    }

    fn pop_front(&mut self) -> Option<T> {
        let chunk = self.chunks.front_mut()?;
        let entry = chunk.pop_front();
        if chunk.is_empty() {
            self.chunks.pop_front();
        }
        if entry.is_some() {
            self.len -= 1;
        }
        entry
    }

    /// `VecDeque::partition_point`: `pred` holds for a prefix of the queue.
    fn partition_point(&self, mut pred: impl FnMut(&T) -> bool) -> usize {
        let whole = self.chunks.partition_point(|c| c.back().is_some_and(&mut pred));
        let before: usize = self.chunks.range(..whole).map(VecDeque::len).sum();
        before + self.chunks.get(whole).map_or(0, |c| c.partition_point(pred))
    }

    /// The entries from position `start` to `end` (both clamped).
    fn range(&self, start: usize, end: usize) -> impl DoubleEndedIterator<Item = &T> {
        let end = end.min(self.len);
        let start = start.min(end);
        let mut spans = Vec::new();
        let mut at = 0;
        for (i, chunk) in self.chunks.iter().enumerate() {
            let (lo, hi) = (start.max(at), end.min(at + chunk.len()));
            if lo < hi {
                spans.push((i, lo - at, hi - at));
            }
            at += chunk.len();
            if at >= end {
                break;
            }
        }
        spans
            .into_iter()
            .flat_map(move |(i, lo, hi)| self.chunks.get(i).into_iter().flat_map(move |c| c.range(lo..hi)))
    }

    fn iter(&self) -> impl Iterator<Item = &T> {
        self.chunks.iter().flat_map(VecDeque::iter)
    }

    fn retain(&mut self, mut keep: impl FnMut(&T) -> bool) {
        let mut kept = Self::new();
        for chunk in std::mem::take(&mut self.chunks) {
            for entry in chunk {
                if keep(&entry) {
                    kept.push_back(entry);
                }
            }
        }
        *self = kept;
    }

    /// Moves every entry of `other` to the back of this queue, chunk by
    /// chunk (a chunk in the middle may then be part full: nothing needs
    /// them full).
    fn append(&mut self, other: &mut Self) {
        self.chunks.append(&mut other.chunks);
        self.len += std::mem::take(&mut other.len);
    }

    /// Room for about `n` entries of chunk handles; the chunks themselves
    /// are only ever as many as the entries need.
    fn shrink_to(&mut self, n: usize) {
        self.chunks.shrink_to(n / QUEUE_CHUNK + 1);
    }

    fn clear(&mut self) {
        self.chunks.clear();
        self.len = 0;
    }

    /// Entries the chunks have room for.
    #[cfg(test)]
    fn capacity(&self) -> usize {
        self.chunks.iter().map(VecDeque::capacity).sum()
    }
}

impl<K> Order<K> {
    fn new() -> Self {
        Self {
            head: Chunked::new(),
            tail: Chunked::new(),
            remaining: 0,
        }
    }

    fn len(&self) -> usize {
        self.head.len() + self.tail.len()
    }

    fn push_back(&mut self, entry: (u64, K)) {
        self.tail.push_back(entry);
    }

    fn front(&self) -> Option<&(u64, K)> {
        self.head.front().or_else(|| self.tail.front())
    }

    fn pop_front(&mut self) -> Option<(u64, K)> {
        if let Some(entry) = self.head.pop_front() {
            return Some(entry);
        }
        let entry = self.tail.pop_front()?;
        self.remaining = self.remaining.saturating_sub(1);
        Some(entry)
    }

    /// `partition_point` over the whole queue.
    fn partition_point(&self, mut pred: impl FnMut(&(u64, K)) -> bool) -> usize {
        let in_head = self.head.partition_point(&mut pred);
        if in_head < self.head.len() {
            in_head
        } else {
            in_head + self.tail.partition_point(pred)
        }
    }

    /// The entries from `start` (an index into the whole queue) to `end`.
    fn range(&self, start: usize, end: usize) -> impl DoubleEndedIterator<Item = &(u64, K)> {
        let h = self.head.len();
        let end = end.min(self.len());
        let start = start.min(end);
        self.head
            .range(start.min(h), end.min(h))
            .chain(self.tail.range(start.saturating_sub(h), end.saturating_sub(h)))
    }

    fn iter(&self) -> impl Iterator<Item = &(u64, K)> {
        self.head.iter().chain(self.tail.iter())
    }

    /// Keeps the entries `live` accepts, all at once (the queue is one again).
    fn retain_all(&mut self, mut live: impl FnMut(&(u64, K)) -> bool) {
        self.head.retain(&mut live);
        self.tail.retain(&mut live);
        self.remaining = 0;
        self.merge();
    }

    /// Makes the queue one again, all in `tail` (what was pushed during a
    /// compaction follows its live part).
    fn merge(&mut self) {
        if !self.head.is_empty() {
            self.head.append(&mut self.tail);
            std::mem::swap(&mut self.head, &mut self.tail);
        }
    }

    fn shrink_to(&mut self, n: usize) {
        self.head.shrink_to(n);
        self.tail.shrink_to(n);
    }

    fn clear(&mut self) {
        self.head.clear();
        self.tail.clear();
        self.remaining = 0;
    }
}

impl<K: Hash + Eq> Order<K> {
    /// One write's share of compacting: starts a compaction once the queue
    /// passes `bound`, then moves up to `COMPACT_STEP` entries of it.
    fn compact_step<V>(&mut self, entries: &HashMap<K, (u64, V)>, bound: usize) {
        if self.remaining == 0 {
            // Pops may have ended a compaction without its last step.
            self.merge();
            if self.len() <= bound {
                return;
            }
            // The whole queue is `tail` now; `head` grows a chunk at a time.
            self.remaining = self.tail.len();
        }
        for _ in 0..COMPACT_STEP {
            if self.remaining == 0 {
                break;
            }
            let Some(entry) = self.tail.pop_front() else {
                self.remaining = 0;
                break;
            };
            self.remaining -= 1;
            if is_live(entries, entry.0, &entry.1) {
                self.head.push_back(entry);
            }
        }
        if self.remaining == 0 {
            self.merge();
        }
    }
}

impl<K: Hash + Eq + Clone, V> LruMap<K, V> {
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            clock: 0,
            entries: HashMap::new(),
            order: Order::new(),
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn contains_key<Q: Hash + Eq + ?Sized>(&self, key: &Q) -> bool
    where
        K: Borrow<Q>,
    {
        self.entries.contains_key(key)
    }

    /// The value, without making it newer.
    pub fn get<Q: Hash + Eq + ?Sized>(&self, key: &Q) -> Option<&V>
    where
        K: Borrow<Q>,
    {
        self.entries.get(key).map(|(_, v)| v)
    }

    /// The value, without making it newer.
    pub fn get_mut<Q: Hash + Eq + ?Sized>(&mut self, key: &Q) -> Option<&mut V>
    where
        K: Borrow<Q>,
    {
        self.entries.get_mut(key).map(|(_, v)| v)
    }

    /// Makes an existing key the newest; false if it is absent.
    pub fn touch<Q: Hash + Eq + ?Sized>(&mut self, key: &Q) -> bool
    where
        K: Borrow<Q>,
    {
        let Some((key, _)) = self.entries.get_key_value(key) else {
            return false;
        };
        let key = key.clone();
        self.clock += 1;
        let clock = self.clock;
        if let Some((stamp, _)) = self.entries.get_mut(&key) {
            *stamp = clock;
        }
        self.order.push_back((clock, key));
        self.compact();
        true
    }

    /// Inserts or replaces `key` as the newest entry. Returns the replaced
    /// value and the entries evicted to stay within capacity, oldest first
    /// (an owner that counts what its entries hold must uncount them).
    pub fn insert(&mut self, key: K, value: V) -> (Option<V>, Vec<(K, V)>) {
        self.clock += 1;
        let old = self.entries.insert(key.clone(), (self.clock, value)).map(|(_, v)| v);
        self.order.push_back((self.clock, key));
        let mut evicted = Vec::new();
        while self.entries.len() > self.capacity {
            match self.pop_oldest() {
                Some(entry) => evicted.push(entry),
                None => break,
            }
        }
        self.compact();
        (old, evicted)
    }

    /// The least recently used entry, without removing it.
    pub fn oldest(&mut self) -> Option<(&K, &V)> {
        // Skip entries made stale by later touches or removals.
        while let Some((stamp, key)) = self.order.front() {
            if is_live(&self.entries, *stamp, key) {
                break;
            }
            self.order.pop_front();
        }
        let (_, key) = self.order.front()?;
        self.entries.get_key_value(key).map(|(k, (_, v))| (k, v))
    }

    /// Removes and returns the least recently used entry.
    pub fn pop_oldest(&mut self) -> Option<(K, V)> {
        while let Some((stamp, key)) = self.order.pop_front() {
            if is_live(&self.entries, stamp, &key) {
                let popped = self.entries.remove(&key).map(|(_, v)| (key, v));
                self.shrink();
                return popped;
            }
        }
        None
    }

    pub fn remove<Q: Hash + Eq + ?Sized>(&mut self, key: &Q) -> Option<V>
    where
        K: Borrow<Q>,
    {
        // Its queue entries become stale and are skipped later.
        let removed = self.entries.remove(key).map(|(_, v)| v);
        self.shrink();
        removed
    }

    /// Entries the map's table has room for without growing.
    pub fn allocated(&self) -> usize {
        self.entries.capacity()
    }

    /// Live entries and the bytes of the table and the touch queue: what a
    /// test of the tables' memory over waves of sessions compares.
    #[cfg(test)]
    pub(crate) fn footprint(&self) -> crate::tests::Footprint {
        crate::tests::Footprint {
            len: self.entries.len(),
            table_bytes: self.entries.allocation_size(),
            queue_bytes: (self.order.head.capacity() + self.order.tail.capacity()) * size_of::<(u64, K)>(),
        }
    }

    /// The stamp of the newest touch: entries touched later have larger ones.
    pub fn stamp(&self) -> u64 {
        self.clock
    }

    /// Up to `n` live keys touched after `after` and no later than `until`,
    /// oldest first, and the stamp to resume from (`None` once nothing is
    /// left in that range): a walk in steps that releases its owner's lock
    /// between them. At most `4n` queue entries are looked at per step
    /// (stale ones included), so a step's cost is bounded whatever the
    /// queue holds. A key touched again between steps moves past `until`
    /// when `until` is the stamp at the walk's start, so no walk sees a key
    /// twice.
    pub fn keys_after(&self, after: u64, until: u64, n: usize) -> (Vec<K>, Option<u64>) {
        let start = self.order.partition_point(|(s, _)| *s <= after);
        let mut keys = Vec::with_capacity(n.min(self.entries.len()));
        let mut resume = None;
        for (s, key) in self.order.range(start, usize::MAX).take(n.saturating_mul(4)) {
            if keys.len() == n || *s > until {
                break;
            }
            resume = Some(*s);
            if is_live(&self.entries, *s, key) {
                keys.push(key.clone());
            }
        }
        (keys, resume)
    }

    /// Up to `n` live entries touched before `stamp`, newest first, and the
    /// stamp to resume from (the same walk as [`LruMap::keys_after`], the
    /// other way). `u64::MAX` starts from the newest.
    pub fn newest_before(&self, stamp: u64, n: usize) -> (Vec<(&K, &V)>, u64) {
        let end = self.order.partition_point(|(s, _)| *s < stamp);
        let mut found = Vec::with_capacity(n.min(self.entries.len()));
        let mut resume = stamp;
        for (s, key) in self.order.range(0, end).rev().take(n.saturating_mul(4)) {
            if found.len() == n {
                break;
            }
            resume = *s;
            if let Some((k, (live, v))) = self.entries.get_key_value(key)
                && live == s
            {
                found.push((k, v));
            }
        }
        (found, resume)
    }

    /// Gives memory back once the map is far below what it held: after a
    /// wave of sessions expired, the tables kept their peak size (a table
    /// and queue sized for 100,000 sessions) for the next wave to find
    /// already grown, and the freed capacity never served anything else.
    /// Shrinking at a quarter to half keeps the cost amortised O(1) per
    /// removal and leaves room to grow back without rehashing at once.
    fn shrink(&mut self) {
        if let Some(room) = shrunk_room(self.entries.capacity(), self.entries.len()) {
            self.entries.shrink_to(room);
            let entries = &self.entries;
            self.order.retain_all(|(stamp, key)| is_live(entries, *stamp, key));
            self.order.shrink_to(room);
        }
    }

    pub fn clear(&mut self) {
        self.entries.clear();
        self.order.clear();
    }

    /// Every entry, least recently used first (stale queue entries are
    /// skipped: at most about as many as there are live ones).
    pub fn iter_oldest(&self) -> impl Iterator<Item = (&K, &V)> {
        self.order.iter().filter_map(|(stamp, key)| {
            self.entries
                .get_key_value(key)
                .filter(|(_, (s, _))| s == stamp)
                .map(|(k, (_, v))| (k, v))
        })
    }

    /// Every entry, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.entries.iter().map(|(k, (_, v))| (k, v))
    }

    /// Every entry, in no particular order; the order of use is unchanged.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (&K, &mut V)> {
        self.entries.iter_mut().map(|(k, (_, v))| (k, v))
    }

    /// Drops stale queue entries once they outnumber the live ones, so the
    /// queue stays within about twice the live set.
    fn compact(&mut self) {
        self.order.compact_step(&self.entries, 2 * self.entries.len() + 64);
    }
}

/// LRU set of `K` bounded by `capacity` entries.
#[derive(Debug, Clone)]
pub struct Lru<K> {
    map: LruMap<K, ()>,
}

impl<K: Hash + Eq + Clone> Lru<K> {
    pub fn new(capacity: usize) -> Self {
        Self {
            map: LruMap::new(capacity),
        }
    }

    pub fn contains(&self, key: &K) -> bool {
        self.map.contains_key(key)
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn capacity(&self) -> usize {
        self.map.capacity()
    }

    /// Inserts `key` as the newest entry (or refreshes it); returns how many
    /// old entries were evicted to make room.
    pub fn touch(&mut self, key: K) -> usize {
        self.map.insert(key, ()).1.len()
    }

    /// The least recently used key, without removing it.
    pub fn oldest(&mut self) -> Option<&K> {
        self.map.oldest().map(|(k, ())| k)
    }

    /// Removes and returns the least recently used key.
    pub fn pop_oldest(&mut self) -> Option<K> {
        self.map.pop_oldest().map(|(k, ())| k)
    }

    pub fn remove(&mut self, key: &K) -> bool {
        self.map.remove(key).is_some()
    }

    pub fn clear(&mut self) {
        self.map.clear();
    }

    /// Every key, in no promised order.
    pub fn iter(&self) -> impl Iterator<Item = &K> {
        self.map.iter().map(|(k, ())| k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A chunked queue answers as a `VecDeque` does, through pushes, pops,
    /// partition points, ranges both ways, retains and appends, across
    /// many chunk boundaries.
    #[test]
    fn a_chunked_queue_behaves_as_a_vecdeque() {
        let mut chunked = Chunked::new();
        let mut model: VecDeque<u64> = VecDeque::new();
        let mut next = 0u64;
        let mut seed = 7u64;
        for round in 0..400 {
            seed = crate::splitmix64(seed);
            let pushes = (seed % 3000) as usize;
            for _ in 0..pushes {
                chunked.push_back(next);
                model.push_back(next);
                next += 1;
            }
            let pops = ((seed >> 20) % 2500) as usize;
            for _ in 0..pops {
                assert_eq!(chunked.pop_front(), model.pop_front());
            }
            assert_eq!(chunked.len(), model.len());
            assert_eq!(chunked.front(), model.front());
            let cut = model.front().copied().unwrap_or(0) + (seed >> 40) % 4000;
            assert_eq!(
                chunked.partition_point(|&x| x < cut),
                model.partition_point(|&x| x < cut)
            );
            let (a, b) = (((seed >> 8) % 5000) as usize, ((seed >> 28) % 6000) as usize);
            let (lo, hi) = (a.min(b).min(model.len()), a.max(b).min(model.len()));
            assert!(chunked.range(a.min(b), a.max(b)).eq(model.range(lo..hi)));
            assert!(chunked.range(a.min(b), a.max(b)).rev().eq(model.range(lo..hi).rev()));
            assert!(chunked.iter().eq(model.iter()));
            if round % 37 == 0 {
                chunked.retain(|&x| x % 3 != 0);
                model.retain(|&x| x % 3 != 0);
            }
            if round % 53 == 0 {
                let mut other = Chunked::new();
                let mut other_model = VecDeque::new();
                for _ in 0..(seed % 1500) {
                    other.push_back(next);
                    other_model.push_back(next);
                    next += 1;
                }
                chunked.append(&mut other);
                model.append(&mut other_model);
                assert!(other.is_empty());
            }
            assert!(chunked.chunks.iter().all(|c| !c.is_empty() && c.len() <= QUEUE_CHUNK));
        }
        chunked.clear();
        assert_eq!((chunked.len(), chunked.front()), (0, None));
    }

    #[test]
    fn a_touched_entry_outlives_older_ones_and_eviction_returns_the_oldest() {
        let mut map = LruMap::new(2);
        map.insert("a", 1);
        map.insert("b", 2);
        assert!(map.touch(&"a"));
        let (old, evicted) = map.insert("c", 3);
        assert_eq!((old, evicted), (None, vec![("b", 2)]));
        assert_eq!(map.get(&"a"), Some(&1));
        assert_eq!(map.oldest(), Some((&"a", &1)));
        assert_eq!(map.insert("a", 4), (Some(1), vec![]));
        assert_eq!(map.pop_oldest(), Some(("c", 3)));
        assert_eq!(map.remove(&"a"), Some(4));
        assert!(map.is_empty() && map.pop_oldest().is_none());
    }

    #[test]
    fn the_touch_queue_stays_bounded() {
        let mut lru = Lru::new(4);
        for i in 0..10_000u64 {
            lru.touch(i % 3);
        }
        assert_eq!(lru.len(), 3);
        assert!(lru.map.order.len() <= 3 * 3 + 65);
    }

    #[test]
    fn a_compaction_in_steps_keeps_the_order_and_bounds_each_write() {
        // A reference: every live key in order of its last touch.
        let mut map = LruMap::new(1_000);
        let mut reference: Vec<u64> = Vec::new();
        let mut x = 7u64;
        let mut mid_compaction = 0;
        for step in 0..200_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let key = x % 1_500;
            match x % 7 {
                0 => {
                    map.remove(&key);
                    reference.retain(|k| *k != key);
                }
                1 if map.touch(&key) => {
                    reference.retain(|k| *k != key);
                    reference.push(key);
                }
                _ => {
                    let (_, evicted) = map.insert(key, step);
                    reference.retain(|k| *k != key);
                    reference.push(key);
                    for (k, _) in evicted {
                        assert_eq!(reference.first(), Some(&k), "evicted the oldest");
                        reference.remove(0);
                    }
                }
            }
            assert!(
                map.order.len() <= 3 * map.capacity() + 65,
                "queue bounded at step {step}"
            );
            if step % 997 == 0 {
                mid_compaction += usize::from(map.order.remaining > 0);
                let walked: Vec<u64> = map.iter_oldest().map(|(k, _)| *k).collect();
                assert_eq!(walked, reference, "order at step {step}");
                // The walks in steps, across both parts of the queue.
                let (mut after, mut oldest_first) = (0, Vec::new());
                loop {
                    let (keys, resume) = map.keys_after(after, map.stamp(), 5);
                    oldest_first.extend(keys);
                    match resume {
                        Some(resume) => after = resume,
                        None => break,
                    }
                }
                assert_eq!(oldest_first, reference);
                let (mut before, mut newest_first) = (u64::MAX, Vec::new());
                loop {
                    let (found, resume) = map.newest_before(before, 5);
                    newest_first.extend(found.into_iter().map(|(k, _)| *k));
                    if resume == before {
                        break;
                    }
                    before = resume;
                }
                assert_eq!(newest_first, reference.iter().rev().copied().collect::<Vec<_>>());
            }
        }
        assert!(mid_compaction > 3, "checked mid-compaction {mid_compaction} times");
    }
}
