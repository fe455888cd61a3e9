//! Retention: the learned return gaps and the value of a cached session,
//! with figures computed by hand, and the placement they change.

use std::ops::Deref;

use crate::retention::{Class, Eviction, GapHistogram, RetentionValues, bucket_of, bucket_upper_ms};
use crate::sessions::SessionStore;
use crate::*;

const W0: WorkerId = WorkerId(0);
const W1: WorkerId = WorkerId(1);

fn class() -> (Harness, String) {
    (Harness::ClaudeCode, "acme".to_owned())
}

/// Retention with the session store it follows sessions in, driven by
/// session name as the router drives it (`Router::place`).
struct Followed {
    values: RetentionValues,
    store: SessionStore,
}

impl Followed {
    fn new(max_sessions: usize, ttl_ms: u64) -> Self {
        Self {
            values: RetentionValues::new(max_sessions, ttl_ms),
            store: SessionStore::new(max_sessions, ttl_ms),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn on_pick(
        &mut self,
        session: &str,
        class: Class,
        worker: WorkerId,
        new_blocks: usize,
        horizon_ms: Option<u64>,
        session_final: bool,
        capacity_blocks: usize,
        now_ms: u64,
    ) {
        let id = if session_final {
            self.store.detached(session)
        } else {
            self.store.bind(session, None, worker, now_ms)
        }
        .unwrap();
        self.values.on_pick(
            &mut self.store,
            id,
            class,
            worker,
            new_blocks,
            horizon_ms,
            session_final,
            capacity_blocks,
            now_ms,
        );
        if session_final {
            self.store.end(id);
        }
    }

    fn evicted(&self, worker: WorkerId, session: &str, overflow_blocks: usize, now_ms: u64) -> Eviction {
        self.values
            .evicted(worker, self.store.find(session), overflow_blocks, now_ms)
    }

    fn pending_deadlines(&self) -> usize {
        self.store.pending_deadlines()
    }
}

impl Deref for Followed {
    type Target = RetentionValues;

    fn deref(&self) -> &RetentionValues {
        &self.values
    }
}

/// Learns `gaps` as returns of one session of `class()` on `W0`.
fn learn_returns(r: &mut Followed, session: &str, start_ms: u64, gaps: &[u64]) -> u64 {
    let mut now = start_ms;
    r.on_pick(session, class(), W0, 1, None, false, 1_000_000, now);
    for gap in gaps {
        now += gap;
        r.on_pick(session, class(), W0, 1, None, false, 1_000_000, now);
    }
    now
}

#[test]
fn the_chance_of_return_by_hand() {
    let mut h = GapHistogram::default();
    for _ in 0..3 {
        h.observe_return(1_000); // bucket [1000, 2000)
    }
    h.observe_gone(60_000);
    // Idle 0: (3 + 1) / (3 + 1 + 1); half way through the returns' bucket:
    // (1.5 + 1) / (1.5 + 1 + 1); past every return: 1 / (1 + 1).
    assert!((h.p_return(0) - 0.8).abs() < 1e-12);
    assert!((h.p_return(1_500) - 2.5 / 3.5).abs() < 1e-12);
    assert!((h.p_return(10_000) - 0.5).abs() < 1e-12);
    // Nothing learned: every cached token counts, as without retention.
    assert_eq!(GapHistogram::default().p_return(123_456), 1.0);
}

#[test]
fn a_session_returning_soon_outweighs_a_finished_one_of_the_same_size() {
    let mut r = Followed::new(1000, 30 * 60_000);
    // The class returns after about a second.
    let now = learn_returns(&mut r, "teacher", 0, &[1_000; 20]);
    r.on_pick("soon", class(), W0, 50, None, false, 100, now);
    r.on_pick("done", class(), W1, 50, None, true, 100, now);
    let later = now + 500;
    let soon = r.evicted(W0, "new", 60, later);
    let done = r.evicted(W1, "new", 60, later);
    // W0: the teacher's 21 blocks (the oldest, idle 0.5 s) and 39 of
    // "soon", each at p(500 ms) = (20 + 1) / (20 + 1) = 1 (no session was
    // ever counted gone).
    assert_eq!(soon.blocks, 60);
    assert!((soon.valued_blocks - 60.0).abs() < 1e-9, "{soon:?}");
    // W1: the finished session's 50 blocks are free; 10 unknown in full.
    assert!((done.valued_blocks - 10.0).abs() < 1e-9, "{done:?}");
}

#[test]
fn session_final_zeroes_the_value() {
    let mut r = Followed::new(1000, 30 * 60_000);
    r.on_pick("s", class(), W0, 40, None, false, 100, 0);
    assert!((r.evicted(W0, "other", 40, 10).valued_blocks - 40.0).abs() < 1e-9);
    r.on_pick("s", class(), W0, 0, None, true, 100, 20);
    assert_eq!(r.evicted(W0, "other", 40, 30).valued_blocks, 0.0);
    assert_eq!(r.worker_value(W0, 30), (40, 0.0));
}

#[test]
fn a_declared_hour_keeps_a_session_valued_past_the_learned_gap() {
    let mut r = Followed::new(1000, 30 * 60_000);
    // Sessions of the class come back within a second, or never: 20
    // returns, then 20 sessions counted gone (each idle past the horizon).
    let mut now = learn_returns(&mut r, "teacher", 0, &[1_000; 20]);
    for i in 0..20 {
        r.on_pick(&format!("gone-{i}"), class(), W1, 1, None, false, 1_000_000, now);
    }
    let horizon = r.gone_after_ms(&class());
    assert_eq!(horizon, 30_000, "2 × p99 (2 s) is below the 30 s floor");
    now += horizon + 1;
    // A pick checks the deadlines that passed.
    r.on_pick("probe", class(), W1, 1, None, false, 1_000_000, now);
    let learned = r.histogram(&class()).clone();
    assert_eq!(learned.gone.iter().sum::<f64>(), 21.0, "20 sessions and the teacher");
    // Idle 10 minutes: past every return, p = 1 / (1 + 21).
    let idle = 10 * 60_000;
    assert!((learned.p_return(idle) - 1.0 / 22.0).abs() < 1e-12);

    r.on_pick("plain", class(), W0, 30, None, false, 1_000, now);
    r.on_pick("hour", class(), WorkerId(2), 30, Some(3_600_000), false, 1_000, now);
    let at = now + idle;
    let plain = r.evicted(W0, "x", 30, at).valued_blocks;
    let hour = r.evicted(WorkerId(2), "x", 30, at).valued_blocks;
    // W0's oldest resident is the teacher (1 block, counted gone); both
    // are worth 1/22 a block; the declared hour is worth all 30.
    assert!((plain - 30.0 / 22.0).abs() < 1e-6, "{plain}");
    assert!((hour - 30.0).abs() < 1e-9, "{hour}");
    // Past the hour, the learned chance again.
    let past = r.evicted(WorkerId(2), "x", 30, now + 3_600_001).valued_blocks;
    assert!(past < 2.0, "{past}");
}

#[test]
fn the_learned_gaps_match_a_seeded_sequence() {
    let mut r = Followed::new(1000, 30 * 60_000);
    // xorshift64*, seeded: gaps from 100 ms to about 20 s, log-spread.
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = || {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        state.wrapping_mul(0x2545_f491_4f6c_dd1d)
    };
    let gaps: Vec<u64> = (0..500).map(|_| 100 << (next() % 8) as u32).collect();
    let mut expected = [0.0; crate::retention::GAP_BUCKETS];
    for g in &gaps {
        expected[bucket_of(*g)] += 1.0;
    }
    learn_returns(&mut r, "s", 0, &gaps);
    let h = r.histogram(&class());
    assert_eq!(h.returns, expected);
    assert_eq!(h.gone.iter().sum::<f64>(), 0.0);
    // The median gap's bucket, by hand from the same sequence.
    let mut sorted = gaps.clone();
    sorted.sort_unstable();
    let median = sorted[sorted.len() / 2 - 1];
    assert_eq!(h.return_quantile_ms(0.5), Some(bucket_upper_ms(bucket_of(median))));
}

/// Two workers of 100 blocks; weights that would otherwise separate them
/// off, so the eviction term alone decides.
fn router(retention: bool) -> Router {
    let config = RouterConfig {
        worker_capacity_blocks: 100,
        session_weight: 0.0,
        recent_prefill_weight: 0.0,
        ..if retention {
            RouterConfig::default()
        } else {
            RouterConfig::without_retention()
        }
    };
    Router::new(config, ["a:1".to_owned(), "b:1".to_owned()])
}

fn blocks(family: u64, n: u64) -> Vec<u64> {
    (0..n).map(|i| (family << 32) | i).collect()
}

fn place(r: &mut Router, hashes: &[u64], session: &str, session_final: bool, now_ms: u64) -> Decision {
    r.pick(PickInput {
        block_hashes: hashes,
        block_bytes: 256,
        prompt_bytes: hashes.len() as u64 * 256,
        session_id: session,
        session_final,
        now_ms,
        ..PickInput::default()
    })
}

#[test]
fn new_work_goes_where_it_displaces_a_finished_session() {
    for retention in [true, false] {
        let mut r = router(retention);
        let back = place(&mut r, &blocks(1, 60), "back", false, 1_000);
        assert_eq!(back.ranked[0], W0);
        // W0 would have to push 20 of "back"'s blocks out: W1.
        let done = place(&mut r, &blocks(2, 60), "done", true, 2_000);
        assert_eq!(done.ranked[0], W1);
        let new = place(&mut r, &blocks(3, 60), "new", false, 3_000);
        // Both would evict 20 blocks (64 tokens each at 4 bytes a token):
        // "back" is worth them in full (nothing learned yet), "done" nothing.
        let eviction = |w: WorkerId| new.costs[w.0].map(|c| c.eviction);
        if retention {
            assert_eq!(eviction(W0), Some(20.0 * 64.0));
            assert_eq!(eviction(W1), Some(0.0));
            assert_eq!(new.ranked[0], W1, "the finished session's worker");
            // The record says what the placement gave up: 20 blocks, no reuse.
            assert_eq!((new.evicted_blocks, new.evicted_value_blocks), (20, 0.0));
        } else {
            assert_eq!(eviction(W0), eviction(W1));
            assert_eq!(new.ranked[0], W0, "a tie, broken by id");
        }
    }
}

#[test]
fn one_deadline_per_session_however_many_calls() {
    let mut r = Followed::new(1000, 30 * 60_000);
    for call in 0..5_000u64 {
        r.on_pick("busy", class(), W0, 1, None, false, 1_000_000, call * 100);
    }
    r.on_pick("other", class(), W1, 1, None, false, 1_000_000, 500_000);
    assert_eq!(r.pending_deadlines(), 2);
    // Gone, then back: one again.
    r.on_pick("probe", class(), W1, 1, None, false, 1_000_000, 10_000_000);
    r.on_pick("busy", class(), W0, 1, None, false, 1_000_000, 10_000_001);
    assert!(r.pending_deadlines() <= 3, "{}", r.pending_deadlines());
}

#[test]
fn a_flood_of_new_sessions_never_holds_more_deadlines_than_followed_sessions() {
    // 10,000 sessions through a table of 100 follows, each seen once, all
    // within one gone-horizon: every follow the LRU pushes out takes its
    // deadline along (they piled up to twice `max_sessions` before, and
    // were then filtered in one walk under the router's lock).
    let max = 100;
    let mut r = Followed::new(max, 30 * 60_000);
    for s in 0..10_000u64 {
        r.on_pick(&format!("flood-{s}"), class(), W0, 1, None, false, 1_000_000, s);
        assert!(
            r.pending_deadlines() <= max,
            "{} deadlines at {s}",
            r.pending_deadlines()
        );
    }
    assert_eq!(r.pending_deadlines(), max);
    // A final call ends the follow and its deadline.
    r.on_pick("flood-9999", class(), W0, 1, None, true, 1_000_000, 10_000);
    assert_eq!(r.pending_deadlines(), max - 1);
    // The deadlines still fire: past the horizon every follow is counted
    // gone once, and a gone session holds no deadline.
    r.on_pick("late", class(), W0, 1, None, false, 1_000_000, 10 * 60 * 60_000);
    assert_eq!(r.pending_deadlines(), 1, "only the new session's");
    assert_eq!(r.fleet_histogram().gone.iter().sum::<f64>(), (max - 1) as f64);
}
