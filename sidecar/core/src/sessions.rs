//! `SessionStore`: the one record of each live session. A session's name
//! is interned once, as a [`SessionId`] (a slot and its generation); the
//! router, retention and the pending picks carry that id, never the name.
//! Its record holds everything routing keeps of it: its home worker (where
//! its prefix was last placed) and when it was last seen, the parent it
//! declared, the trace id its current turn carries (what a subagent named
//! by trace resolves to), its latest pick while that is pending, and what
//! retention follows of it (its class, idle time and gone-deadline). One
//! bound (`max_sessions`, least recently seen first) and one stepped
//! expiry end every part together, so no part can outlive the others (the
//! session tables that were eight fell out of step one by one).
//!
//! Beside the records, indexes that only point into them: how many live
//! sessions each worker hosts (the load a worker has promised to future
//! calls), the trace ids' carriers, and the retention deadlines in order.

use std::collections::BTreeSet;
use std::sync::Arc;

use hashbrown::HashMap;

use crate::WorkerId;
use crate::lineage::{MAX_TRACE_CARRIERS, TraceCarriers, TraceId};
use crate::lru::{LruMap, shrunk_room};
use crate::retention::Follow;

/// A live session, interned: its slot in the store and the slot's
/// generation, so an id outlives its session harmlessly (a slot reused by a
/// later session has another generation, and the old id finds nothing).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionId {
    slot: u32,
    generation: u32,
}

/// Everything routing keeps of one live session.
#[derive(Debug, Clone)]
struct Record {
    name: Arc<str>,
    home: WorkerId,
    last_seen_ms: u64,
    parent: Option<Box<str>>,
    /// The trace id of its latest main-lane call, whose entry in
    /// `carriers` goes with the session.
    trace: Option<TraceId>,
    /// Its latest pick, while that is pending: its next call releases it
    /// (an agent sends the next call once the previous one answered).
    last_pick: Option<u64>,
    /// What retention follows of it; `follow.deadline_ms` is in
    /// `deadlines` exactly when it is `Some`.
    follow: Option<Follow>,
}

/// Sessions [`SessionStore::expire`] ends per call: about 0.1-0.2 ms.
pub const EXPIRE_STEP: usize = 1000;

/// Live sessions, one record each.
#[derive(Debug, Clone)]
pub struct SessionStore {
    ttl_ms: u64,
    /// Each live session's slot, by name (the name's one copy, shared with
    /// its record).
    slots: HashMap<Arc<str>, u32>,
    /// The records by slot, least recently seen first, to bound memory.
    records: LruMap<u32, Record>,
    /// Each slot's current generation: bumped when its session ends.
    generations: Vec<u32>,
    /// Slots of ended sessions, to reuse.
    free: Vec<u32>,
    /// Live sessions per worker.
    hosted: Vec<u32>,
    /// The session each remembered trace id names: at most one entry per
    /// live session (its latest trace), dropped with it.
    carriers: TraceCarriers,
    /// (deadline, session): when retention checks whether a session went.
    /// Holds `(d, s)` exactly when `s`'s follow has `deadline_ms ==
    /// Some(d)`, so it is never larger than the store.
    deadlines: BTreeSet<(u64, SessionId)>,
}

impl SessionStore {
    pub fn new(max_sessions: usize, ttl_ms: u64) -> Self {
        Self::with_trace_capacity(max_sessions, ttl_ms, MAX_TRACE_CARRIERS)
    }

    /// A store remembering at most `traces` trace ids (tests of the bound).
    pub(crate) fn with_trace_capacity(max_sessions: usize, ttl_ms: u64, traces: usize) -> Self {
        Self {
            ttl_ms,
            slots: HashMap::new(),
            records: LruMap::new(max_sessions),
            generations: Vec::new(),
            free: Vec::new(),
            hosted: Vec::new(),
            carriers: TraceCarriers::new(traces),
            deadlines: BTreeSet::new(),
        }
    }

    pub fn len(&self) -> usize {
        self.records.len()
    }

    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// The live session named `session`.
    pub fn find(&self, session: &str) -> Option<SessionId> {
        let &slot = self.slots.get(session)?;
        Some(self.id_of(slot))
    }

    /// The id of the session in `slot` now (a slot's generation changes
    /// only when its session ends).
    fn id_of(&self, slot: u32) -> SessionId {
        let generation = self.generations.get(slot as usize).copied().unwrap_or(0);
        SessionId { slot, generation }
    }

    fn record(&self, id: SessionId) -> Option<&Record> {
        (self.id_of(id.slot) == id)
            .then(|| self.records.get(&id.slot))
            .flatten()
    }

    fn record_mut(&mut self, id: SessionId) -> Option<&mut Record> {
        (self.id_of(id.slot) == id)
            .then(|| self.records.get_mut(&id.slot))
            .flatten()
    }

    /// The session's name.
    pub fn name(&self, id: SessionId) -> Option<&str> {
        self.record(id).map(|r| &*r.name)
    }

    /// The home of a session still live at `now_ms`.
    pub fn home(&self, session: &str, now_ms: u64) -> Option<WorkerId> {
        self.home_of(self.find(session)?, now_ms)
    }

    /// [`SessionStore::home`] by id.
    pub fn home_of(&self, id: SessionId, now_ms: u64) -> Option<WorkerId> {
        let r = self.record(id)?;
        (now_ms.saturating_sub(r.last_seen_ms) <= self.ttl_ms).then_some(r.home)
    }

    /// The parent a session declared (or that its trace-named parent
    /// resolved to), if any.
    pub fn parent(&self, session: &str) -> Option<&str> {
        self.parent_of(self.find(session)?)
    }

    /// [`SessionStore::parent`] by id.
    pub fn parent_of(&self, id: SessionId) -> Option<&str> {
        self.record(id)?.parent.as_deref()
    }

    /// The live session whose main-lane calls carried `trace` most
    /// recently, at `now_ms`.
    pub fn trace_carrier(&self, trace: TraceId, now_ms: u64) -> Option<&str> {
        let id = self.carriers.carrier(trace)?;
        self.home_of(id, now_ms)?;
        self.name(id)
    }

    /// The live session's main-lane call carried `trace`: a subagent
    /// naming that trace as its parent resolves to it. The session's
    /// previous trace is forgotten (a session is in one turn at a time).
    pub fn carry_trace(&mut self, id: SessionId, trace: TraceId) {
        let Some(record) = self.record_mut(id) else {
            return;
        };
        let previous = record.trace.replace(trace);
        if let Some(previous) = previous.filter(|p| *p != trace) {
            self.carriers.release(previous, id);
        }
        self.carriers.claim(trace, id);
    }

    /// Trace ids remembered (at most `MAX_TRACE_CARRIERS`).
    pub fn traces(&self) -> usize {
        self.carriers.len()
    }

    /// Live sessions hosted by `worker`.
    pub fn hosted(&self, worker: WorkerId) -> u32 {
        self.hosted.get(worker.0).copied().unwrap_or(0)
    }

    fn count(&mut self, worker: WorkerId, delta: i32) {
        if self.hosted.len() <= worker.0 {
            self.hosted.resize(worker.0 + 1, 0);
        }
        let slot = &mut self.hosted[worker.0];
        *slot = slot.saturating_add_signed(delta);
    }

    /// Binds `session` to `home` at `now_ms`, as a new record if it has
    /// none; its id (none for the empty name, which is no session).
    pub fn bind(&mut self, session: &str, parent: Option<&str>, home: WorkerId, now_ms: u64) -> Option<SessionId> {
        if session.is_empty() {
            return None;
        }
        let parent = parent.filter(|p| !p.is_empty());
        if let Some(id) = self.find(session) {
            let record = self.record_mut(id)?;
            let old = record.home;
            record.home = home;
            record.last_seen_ms = record.last_seen_ms.max(now_ms);
            if record.parent.is_none() {
                record.parent = parent.map(Box::from);
            }
            if old != home {
                self.count(old, -1);
                self.count(home, 1);
            }
            self.records.touch(&id.slot);
            return Some(id);
        }
        let id = self.allocate();
        let name: Arc<str> = Arc::from(session);
        let record = Record {
            name: name.clone(),
            home,
            last_seen_ms: now_ms,
            parent: parent.map(Box::from),
            trace: None,
            last_pick: None,
            follow: None,
        };
        self.slots.insert(name, id.slot);
        self.count(home, 1);
        // At the bound, the least recently seen session goes first.
        let (_, evicted) = self.records.insert(id.slot, record);
        for (slot, gone) in evicted {
            self.forget(slot, gone);
        }
        Some(id)
    }

    /// A fresh id that names no record: for a session's final call when
    /// the session has no record (what retention keeps of the call on its
    /// worker needs an id; it must not take a live session's place).
    pub fn detached(&mut self, session: &str) -> Option<SessionId> {
        if session.is_empty() {
            return None;
        }
        if let Some(id) = self.find(session) {
            return Some(id);
        }
        let id = self.allocate();
        self.release_slot(id.slot);
        Some(id)
    }

    fn allocate(&mut self) -> SessionId {
        let slot = self.free.pop().unwrap_or_else(|| {
            self.generations.push(0);
            u32::try_from(self.generations.len() - 1).unwrap_or(u32::MAX)
        });
        self.id_of(slot)
    }

    /// The slot's session ended: a later session takes it under another
    /// generation.
    fn release_slot(&mut self, slot: u32) {
        if let Some(generation) = self.generations.get_mut(slot as usize) {
            *generation = generation.wrapping_add(1);
            self.free.push(slot);
        }
    }

    /// A record left the store: the indexes that point at it let go, and
    /// its follow is handed back (what retention learns from a session's
    /// end).
    fn forget(&mut self, slot: u32, gone: Record) -> Option<Follow> {
        // Before the slot is released: the generation is still the record's.
        let id = self.id_of(slot);
        self.slots.remove(&gone.name);
        self.shrink();
        self.count(gone.home, -1);
        if let Some(trace) = gone.trace {
            self.carriers.release(trace, id);
        }
        if let Some(deadline) = gone.follow.as_ref().and_then(|f| f.deadline_ms) {
            self.deadlines.remove(&(deadline, id));
        }
        self.release_slot(slot);
        gone.follow
    }

    /// Gives the name table's memory back after a wave of sessions ended
    /// (as `LruMap` does for the records).
    fn shrink(&mut self) {
        if let Some(room) = shrunk_room(self.slots.capacity(), self.slots.len()) {
            self.slots.shrink_to(room);
            self.free.shrink_to(self.generations.len() / 2);
        }
    }

    /// The session ended (`x-dynamo-session-final`): its record goes, and
    /// its follow is handed back.
    pub(crate) fn end(&mut self, id: SessionId) -> Option<Follow> {
        self.record(id)?;
        let gone = self.records.remove(&id.slot)?;
        self.forget(id.slot, gone)
    }

    /// Ends every session idle for longer than the TTL, from the least
    /// recently seen: the work is the sessions ended, not the store (a
    /// walk of the whole table under the router's lock took 0.35 ms per
    /// 1,000 sessions with the ledger's, every 10 s, stalling every Pick).
    /// Records are touched in the order they are seen, so the oldest are
    /// first; should the clock step back, a session behind a fresher one
    /// ends at a later call (`home` checks the TTL itself, so it never
    /// routes meanwhile).
    ///
    /// At most [`EXPIRE_STEP`] per call: a wave of sessions that ends
    /// together must not hold the router's lock for all of them (call again
    /// while it returns `EXPIRE_STEP`). `ended` is handed each ended
    /// session's follow, for retention to learn from.
    pub(crate) fn expire(&mut self, now_ms: u64, mut ended: impl FnMut(Follow)) -> usize {
        let ttl = self.ttl_ms;
        let mut count = 0;
        while count < EXPIRE_STEP
            && let Some((_, r)) = self.records.oldest()
        {
            if now_ms.saturating_sub(r.last_seen_ms) <= ttl {
                break;
            }
            if let Some((slot, gone)) = self.records.pop_oldest() {
                if let Some(follow) = self.forget(slot, gone) {
                    ended(follow);
                }
                count += 1;
            }
        }
        count
    }

    /// Up to `n` sessions seen before `stamp` (`u64::MAX`: the newest),
    /// newest first, as (session, home, last seen), and the stamp to go on
    /// from: a page of `/debug/sessions` costs its rows, not the store.
    pub fn newest_before(&self, stamp: u64, n: usize) -> (Vec<(&str, WorkerId, u64)>, u64) {
        let (rows, resume) = self.records.newest_before(stamp, n);
        (
            rows.into_iter()
                .map(|(_, r)| (&*r.name, r.home, r.last_seen_ms))
                .collect(),
            resume,
        )
    }

    /// Ends every session homed on `worker` (it was removed).
    pub fn evict_worker(&mut self, worker: WorkerId) {
        let gone: Vec<SessionId> = self
            .records
            .iter()
            .filter(|(_, r)| r.home == worker)
            .map(|(&slot, _)| self.id_of(slot))
            .collect();
        for id in gone {
            self.end(id);
        }
    }

    /// (session, home, last seen) for snapshots and debug pages.
    pub fn iter(&self) -> impl Iterator<Item = (&str, WorkerId, u64)> {
        self.records.iter().map(|(_, r)| (&*r.name, r.home, r.last_seen_ms))
    }

    /// The session's latest pick, while it is pending.
    pub(crate) fn last_pick(&self, id: SessionId) -> Option<u64> {
        self.record(id)?.last_pick
    }

    /// Sets (or, with `None`, clears) the session's pending pick.
    pub(crate) fn set_last_pick(&mut self, id: SessionId, pick_id: Option<u64>) {
        if let Some(r) = self.record_mut(id) {
            r.last_pick = pick_id;
        }
    }

    /// What retention follows of the session, taken out of the record
    /// (its deadline leaves the index with it).
    pub(crate) fn take_follow(&mut self, id: SessionId) -> Option<Follow> {
        let follow = self.record_mut(id)?.follow.take()?;
        if let Some(deadline) = follow.deadline_ms {
            self.deadlines.remove(&(deadline, id));
        }
        Some(follow)
    }

    /// Puts the session's follow (back) in its record, its deadline in the
    /// index; nothing if the session has no record.
    pub(crate) fn put_follow(&mut self, id: SessionId, follow: Follow) {
        let deadline = follow.deadline_ms;
        let Some(record) = self.record_mut(id) else {
            return;
        };
        let old = record.follow.replace(follow).and_then(|f| f.deadline_ms);
        if let Some(old) = old {
            self.deadlines.remove(&(old, id));
        }
        if let Some(deadline) = deadline {
            self.deadlines.insert((deadline, id));
        }
    }

    pub(crate) fn follow_mut(&mut self, id: SessionId) -> Option<&mut Follow> {
        self.record_mut(id)?.follow.as_mut()
    }

    /// The session with the earliest deadline due by `now_ms`, its follow
    /// taken out with the deadline cleared.
    pub(crate) fn pop_due(&mut self, now_ms: u64) -> Option<(SessionId, Follow)> {
        loop {
            let &(deadline, id) = self.deadlines.first()?;
            if deadline > now_ms {
                return None;
            }
            self.deadlines.pop_first();
            // Every deadline is a live follow's (see `deadlines`).
            if let Some(mut follow) = self.record_mut(id).and_then(|r| r.follow.take()) {
                follow.deadline_ms = None;
                return Some((id, follow));
            }
        }
    }

    /// Deadlines waiting (at most one per session).
    pub fn pending_deadlines(&self) -> usize {
        self.deadlines.len()
    }

    /// Sessions whose latest pick is still pending.
    #[cfg(test)]
    pub(crate) fn with_pending_pick(&self) -> usize {
        self.records.iter().filter(|(_, r)| r.last_pick.is_some()).count()
    }

    /// The store's tables (see `crate::tests::Footprint`).
    #[cfg(test)]
    pub(crate) fn footprints(&self) -> crate::tests::Footprints {
        let names = crate::tests::Footprint {
            len: self.slots.len(),
            table_bytes: self.slots.allocation_size(),
            queue_bytes: 0,
        };
        let deadlines = crate::tests::Footprint {
            len: self.deadlines.len(),
            ..Default::default()
        };
        let follows = crate::tests::Footprint {
            len: self.records.iter().filter(|(_, r)| r.follow.is_some()).count(),
            ..Default::default()
        };
        vec![
            ("session records", self.records.footprint()),
            ("session names", names),
            ("session follows", follows),
            ("session deadlines", deadlines),
        ]
    }
}
