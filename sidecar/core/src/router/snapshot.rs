//! Routing state from elsewhere: the snapshot a replica saves to restart
//! warm and loads back, and placements other replicas decided (from the
//! shared stream).

use super::Router;
use super::fleet::{WorkerId, WorkerState};

/// A worker's blocks and the sessions homed on it, oldest first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Snapshot {
    pub workers: Vec<(String, Vec<u64>)>,
    /// (session, home address, last seen ms).
    pub sessions: Vec<(String, String, u64)>,
}

impl Router {
    /// Everything needed to restart warm: each worker's blocks (oldest
    /// first) and the live sessions.
    pub fn snapshot(&self) -> Snapshot {
        let mut snapshot = Snapshot {
            workers: self
                .workers
                .iter()
                .enumerate()
                .filter(|(_, w)| w.state != WorkerState::Removed)
                .map(|(i, w)| (w.address.clone(), self.index.blocks_oldest_first(WorkerId(i))))
                .collect(),
            sessions: self
                .sessions
                .iter()
                .filter_map(|(s, home, seen)| Some((s.to_owned(), self.address(home)?.to_owned(), seen)))
                .collect(),
        };
        snapshot.sessions.sort();
        snapshot
    }

    /// Loads a snapshot into this router (workers it does not know are
    /// skipped: the configuration decides which workers exist).
    pub fn restore(&mut self, snapshot: &Snapshot) {
        for (address, blocks) in &snapshot.workers {
            if let Some(id) = self.worker_id(address) {
                // Oldest first, one at a time, so the LRU order survives.
                for block in blocks {
                    self.index.insert(id, std::slice::from_ref(block));
                }
            }
        }
        for (session, address, seen) in &snapshot.sessions {
            if let Some(id) = self.worker_id(address) {
                self.sessions.bind(session, None, id, *seen);
            }
        }
    }

    /// Applies a placement another replica decided (from the shared stream).
    pub fn observe_placement(&mut self, address: &str, full_blocks: &[u64], session: &str, now_ms: u64) {
        let Some(id) = self.worker_id(address) else { return };
        self.index.insert(id, full_blocks);
        self.sessions.bind(session, None, id, now_ms);
    }
}
