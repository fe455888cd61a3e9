//! Each session's calls by lane (main, side, compaction), and whether its
//! last main-lane call was a compaction: then its next main call starts a
//! new prefix epoch, whose new prefix is no break. Keyed by the session
//! (whatever the model: a compaction on a small model still ends the main
//! conversation's epoch), unlike the ledger's traces.

use kvmesh_vocab::{Harness, Lane};

use crate::lru::LruMap;

/// One session's calls by lane, as `/debug/sessions` shows them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SessionLanes {
    /// The harness of its latest call.
    pub harness: Harness,
    /// Calls by [`Lane::ALL`] order.
    pub calls: [u64; Lane::ALL.len()],
}

impl SessionLanes {
    pub fn calls(&self, lane: Lane) -> u64 {
        self.calls[lane as usize]
    }
}

#[derive(Debug, Clone)]
struct Tally {
    lanes: SessionLanes,
    /// A compaction came after the session's last main call.
    compacted: bool,
    last_seen_ms: u64,
}

/// Tallies ended per [`Lanes::expire`]: about as much work as one step of
/// the ledger's tick.
const EXPIRE_STEP: usize = 1000;

/// The sessions' tallies, least recently seen first: at most the ledger's
/// `max_sessions`, each ended with its session's idle TTL.
#[derive(Debug)]
pub(super) struct Lanes {
    tallies: LruMap<String, Tally>,
}

impl Lanes {
    pub(super) fn new(max_sessions: usize) -> Self {
        Self {
            tallies: LruMap::new(max_sessions.max(1)),
        }
    }

    pub(super) fn get(&self, session: &str) -> Option<SessionLanes> {
        self.tallies.get(session).map(|t| t.lanes)
    }

    pub(super) fn len(&self) -> usize {
        self.tallies.len()
    }

    #[cfg(test)]
    pub(super) fn footprint(&self) -> crate::tests::Footprint {
        self.tallies.footprint()
    }

    /// Counts a call of `session` in `lane`. True when it is a main call
    /// that starts a new prefix epoch (a compaction came since the
    /// session's last main call).
    pub(super) fn count(&mut self, session: &str, harness: Harness, lane: Lane, now_ms: u64) -> bool {
        if session.is_empty() {
            return false;
        }
        if !self.tallies.touch(session) {
            let tally = Tally {
                lanes: SessionLanes::default(),
                compacted: false,
                last_seen_ms: now_ms,
            };
            // At the bound the least recently seen session's tally goes.
            self.tallies.insert(session.to_owned(), tally);
        }
        let Some(tally) = self.tallies.get_mut(session) else {
            return false;
        };
        tally.lanes.harness = harness;
        tally.lanes.calls[lane as usize] += 1;
        tally.last_seen_ms = tally.last_seen_ms.max(now_ms);
        match lane {
            Lane::Main => std::mem::take(&mut tally.compacted),
            Lane::Compaction => {
                tally.compacted = true;
                false
            }
            // Beside the conversation: its epoch goes on.
            Lane::Side => false,
        }
    }

    /// Ends the tallies of sessions idle past `ttl_ms`, oldest first, at
    /// most [`EXPIRE_STEP`] a call (the tick calls it at each step).
    pub(super) fn expire(&mut self, now_ms: u64, ttl_ms: u64) -> usize {
        let mut ended = 0;
        while ended < EXPIRE_STEP
            && let Some((_, oldest)) = self.tallies.oldest()
            && now_ms.saturating_sub(oldest.last_seen_ms) > ttl_ms
        {
            self.tallies.pop_oldest();
            ended += 1;
        }
        ended
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_main_call_after_a_compaction_starts_an_epoch() {
        let mut lanes = Lanes::new(8);
        let h = Harness::Codex;
        assert!(!lanes.count("s", h, Lane::Main, 1));
        assert!(!lanes.count("s", h, Lane::Compaction, 2));
        // A side call between them neither starts nor ends the epoch.
        assert!(!lanes.count("s", h, Lane::Side, 3));
        assert!(lanes.count("s", h, Lane::Main, 4));
        assert!(!lanes.count("s", h, Lane::Main, 5));
        assert_eq!(lanes.get("s").map(|l| l.calls), Some([3, 1, 1]));
        assert!(!lanes.count("", h, Lane::Main, 6));
        assert_eq!(lanes.len(), 1);
    }

    #[test]
    fn tallies_are_bounded_and_end_when_idle() {
        let mut lanes = Lanes::new(2);
        for (i, session) in ["a", "b", "c"].into_iter().enumerate() {
            lanes.count(session, Harness::Other, Lane::Main, i as u64);
        }
        assert_eq!(lanes.len(), 2);
        assert_eq!(lanes.get("a"), None);
        assert_eq!(lanes.expire(12, 10), 1);
        assert_eq!((lanes.get("b"), lanes.len()), (None, 1));
    }
}
