//! `SessionTable`: each live session's home worker (where its prefix was
//! last placed), with an idle TTL, and how many live sessions each worker
//! hosts, which is the load a worker has promised to future calls.

use crate::WorkerId;
use crate::lru::LruMap;

#[derive(Debug, Clone)]
struct Binding {
    home: WorkerId,
    last_seen_ms: u64,
    parent: Option<String>,
}

/// Live sessions and their home workers.
#[derive(Debug, Clone)]
pub struct SessionTable {
    ttl_ms: u64,
    /// Least recently seen first, to bound memory.
    bindings: LruMap<String, Binding>,
    /// Live sessions per worker.
    hosted: Vec<u32>,
}

impl SessionTable {
    pub fn new(max_sessions: usize, ttl_ms: u64) -> Self {
        Self {
            ttl_ms,
            bindings: LruMap::new(max_sessions),
            hosted: Vec::new(),
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

    /// The parent a session declared, if any.
    pub fn parent(&self, session: &str) -> Option<&str> {
        self.bindings.get(session)?.parent.as_deref()
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
                };
                // At the bound, the least recently seen session goes first.
                let (_, evicted) = self.bindings.insert(session.to_owned(), binding);
                for (_, gone) in evicted {
                    self.count(gone.home, -1);
                }
                self.count(home, 1);
            }
        }
    }

    /// The session ended (`x-dynamo-session-final`) or went idle.
    pub fn end(&mut self, session: &str) {
        if let Some(b) = self.bindings.remove(session) {
            self.count(b.home, -1);
        }
    }

    /// Ends every session idle for longer than the TTL.
    pub fn expire(&mut self, now_ms: u64) -> usize {
        let ttl = self.ttl_ms;
        let idle: Vec<String> = self
            .bindings
            .iter()
            .filter(|(_, b)| now_ms.saturating_sub(b.last_seen_ms) > ttl)
            .map(|(s, _)| s.clone())
            .collect();
        for s in &idle {
            self.end(s);
        }
        idle.len()
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
