//! `SessionTable`: each live session's home worker (where its prefix was
//! last placed), with an idle TTL, and how many live sessions each worker
//! hosts, which is the load a worker has promised to future calls; and each
//! session's lineage: the parent it declared, and the trace id its current
//! turn carries (what a subagent named by trace resolves to).

use crate::WorkerId;
use crate::lineage::{MAX_TRACE_CARRIERS, TraceCarriers, TraceId};
use crate::lru::LruMap;

#[derive(Debug, Clone)]
struct Binding {
    home: WorkerId,
    last_seen_ms: u64,
    parent: Option<String>,
    /// The trace id of its latest main-lane call, whose entry in
    /// `carriers` goes with the session.
    trace: Option<TraceId>,
}

/// Sessions [`SessionTable::expire`] ends per call: about 0.1-0.2 ms.
pub const EXPIRE_STEP: usize = 1000;

/// Live sessions and their home workers.
#[derive(Debug, Clone)]
pub struct SessionTable {
    ttl_ms: u64,
    /// Least recently seen first, to bound memory.
    bindings: LruMap<String, Binding>,
    /// Live sessions per worker.
    hosted: Vec<u32>,
    /// The session each remembered trace id names: at most one entry per
    /// live session (its latest trace), dropped with it.
    carriers: TraceCarriers,
}

impl SessionTable {
    pub fn new(max_sessions: usize, ttl_ms: u64) -> Self {
        Self::with_trace_capacity(max_sessions, ttl_ms, MAX_TRACE_CARRIERS)
    }

    /// A table remembering at most `traces` trace ids (tests of the bound).
    pub(crate) fn with_trace_capacity(max_sessions: usize, ttl_ms: u64, traces: usize) -> Self {
        Self {
            ttl_ms,
            bindings: LruMap::new(max_sessions),
            hosted: Vec::new(),
            carriers: TraceCarriers::new(traces),
        }
    }

    pub fn len(&self) -> usize {
        self.bindings.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bindings.is_empty()
    }

    /// The home of a session still live at `now_ms`.
    pub fn home(&self, session: &str, now_ms: u64) -> Option<WorkerId> {
        let b = self.bindings.get(session)?;
        (now_ms.saturating_sub(b.last_seen_ms) <= self.ttl_ms).then_some(b.home)
    }

    /// The parent a session declared (or that its trace-named parent
    /// resolved to), if any.
    pub fn parent(&self, session: &str) -> Option<&str> {
        self.bindings.get(session)?.parent.as_deref()
    }

    /// The live session whose main-lane calls carried `trace` most
    /// recently, at `now_ms`.
    pub fn trace_carrier(&self, trace: TraceId, now_ms: u64) -> Option<&str> {
        self.carriers
            .carrier(trace)
            .filter(|session| self.home(session, now_ms).is_some())
    }

    /// The live `session`'s main-lane call carried `trace`: a subagent
    /// naming that trace as its parent resolves to it. The session's
    /// previous trace is forgotten (a session is in one turn at a time).
    pub fn carry_trace(&mut self, session: &str, trace: TraceId) {
        let Some(binding) = self.bindings.get_mut(session) else {
            return;
        };
        let previous = binding.trace.replace(trace);
        if let Some(previous) = previous.filter(|p| *p != trace) {
            self.carriers.release(previous, session);
        }
        self.carriers.claim(trace, session);
    }

    /// The bindings' table (see `crate::tests::Footprint`).
    #[cfg(test)]
    pub(crate) fn footprint(&self) -> crate::tests::Footprint {
        self.bindings.footprint()
    }

    /// Trace ids remembered (at most `MAX_TRACE_CARRIERS`).
    pub fn traces(&self) -> usize {
        self.carriers.len()
    }

    /// A binding left the table: its trace goes with it.
    fn forget(&mut self, session: &str, gone: &Binding) {
        self.count(gone.home, -1);
        if let Some(trace) = gone.trace {
            self.carriers.release(trace, session);
        }
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

    /// Binds `session` to `home` at `now_ms`.
    pub fn bind(&mut self, session: &str, parent: Option<&str>, home: WorkerId, now_ms: u64) {
        if session.is_empty() {
            return;
        }
        match self.bindings.get_mut(session) {
            Some(b) => {
                let old = b.home;
                b.home = home;
                b.last_seen_ms = b.last_seen_ms.max(now_ms);
                if b.parent.is_none() {
                    b.parent = parent.filter(|p| !p.is_empty()).map(str::to_owned);
                }
                if old != home {
                    self.count(old, -1);
                    self.count(home, 1);
                }
                self.bindings.touch(session);
            }
            None => {
                let binding = Binding {
                    home,
                    last_seen_ms: now_ms,
                    parent: parent.filter(|p| !p.is_empty()).map(str::to_owned),
                    trace: None,
                };
                // At the bound, the least recently seen session goes first.
                let (_, evicted) = self.bindings.insert(session.to_owned(), binding);
                for (gone_session, gone) in evicted {
                    self.forget(&gone_session, &gone);
                }
                self.count(home, 1);
            }
        }
    }

    /// The session ended (`x-dynamo-session-final`) or went idle.
    pub fn end(&mut self, session: &str) {
        if let Some(b) = self.bindings.remove(session) {
            self.forget(session, &b);
        }
    }

    /// Ends every session idle for longer than the TTL, from the least
    /// recently seen: the work is the sessions ended, not the table (a
    /// walk of the whole table under the router's lock took 0.35 ms per
    /// 1,000 sessions with the ledger's, every 10 s, stalling every Pick).
    /// Bindings are touched in the order they are seen, so the oldest are
    /// first; should the clock step back, a session behind a fresher one
    /// ends at a later call (`home` checks the TTL itself, so it never
    /// routes meanwhile).
    ///
    /// At most [`EXPIRE_STEP`] per call: a wave of sessions that ends
    /// together must not hold the router's lock for all of them (call again
    /// while it returns `EXPIRE_STEP`). `ended_session` is handed each ended
    /// session, for what else the router keeps per session.
    pub fn expire(&mut self, now_ms: u64, mut ended_session: impl FnMut(String)) -> usize {
        let ttl = self.ttl_ms;
        let mut ended = 0;
        while ended < EXPIRE_STEP
            && let Some((_, b)) = self.bindings.oldest()
        {
            if now_ms.saturating_sub(b.last_seen_ms) <= ttl {
                break;
            }
            if let Some((gone_session, gone)) = self.bindings.pop_oldest() {
                self.forget(&gone_session, &gone);
                ended_session(gone_session);
                ended += 1;
            }
        }
        ended
    }

    /// Up to `n` sessions seen before `stamp` (`u64::MAX`: the newest),
    /// newest first, as (session, home, last seen), and the stamp to go on
    /// from: a page of `/debug/sessions` costs its rows, not the table.
    pub fn newest_before(&self, stamp: u64, n: usize) -> (Vec<(&str, WorkerId, u64)>, u64) {
        let (rows, resume) = self.bindings.newest_before(stamp, n);
        (
            rows.into_iter()
                .map(|(s, b)| (s.as_str(), b.home, b.last_seen_ms))
                .collect(),
            resume,
        )
    }

    /// Ends every session homed on `worker` (it was removed).
    pub fn evict_worker(&mut self, worker: WorkerId) {
        let gone: Vec<String> = self
            .bindings
            .iter()
            .filter(|(_, b)| b.home == worker)
            .map(|(s, _)| s.clone())
            .collect();
        for s in gone {
            self.end(&s);
        }
    }

    /// (session, home, last seen) for snapshots and debug pages.
    pub fn iter(&self) -> impl Iterator<Item = (&str, WorkerId, u64)> {
        self.bindings.iter().map(|(s, b)| (s.as_str(), b.home, b.last_seen_ms))
    }
}
