//! A session's lanes, through the router and the ledger together as the
//! sidecar drives them: a side call is placed on its own merits and never
//! moves or breaks its session; the main call after a compaction starts a
//! new prefix epoch instead of a break.

#![allow(clippy::unwrap_used)]

use crate::*;

/// The router and the ledger, fed as the sidecar feeds them: the ledger's
/// probe, the pick, the holdings answered under the same lock, the record.
struct Sidecar {
    router: Router,
    ledger: Insights,
    now_ms: u64,
}

impl Sidecar {
    fn new(workers: usize) -> Self {
        Self {
            router: Router::new(
                RouterConfig::default(),
                (0..workers).map(|i| format!("10.0.0.{i}:8000")),
            ),
            ledger: Insights::new(InsightConfig::default()),
            now_ms: 0,
        }
    }

    /// One call of `session` in `lane`, a second after the previous one;
    /// its outcome comes before the next call, as an agent waits for it.
    fn call(&mut self, session: &str, lane: Lane, blocks: &[u64]) -> Decision {
        self.now_ms += 1_000;
        let call = Call {
            input: PickInput {
                block_hashes: blocks,
                block_bytes: 256,
                prompt_bytes: blocks.len() as u64 * 256,
                session_id: session,
                model: "m",
                lane,
                harness: Harness::OpenCode,
                now_ms: self.now_ms,
                ..PickInput::default()
            },
            harness: Harness::OpenCode,
            tenant: "",
            sections: &[],
        };
        let probe = self.ledger.probe(&call);
        let decision = self.router.pick(call.input);
        let holdings = self.router.holdings(probe.as_slice());
        self.ledger.on_pick(&call, &decision, &holdings);
        decision
    }

    fn done(&mut self, decision: &Decision) {
        self.now_ms += 100;
        self.router.report_at(
            Outcome {
                pick_id: decision.pick_id,
                ..Outcome::default()
            },
            self.now_ms,
        );
        self.ledger
            .on_outcome(decision.pick_id, None, None, decision.chosen(), self.now_ms);
    }

    fn totals(&self) -> Totals {
        self.ledger.totals().fold(Totals::default(), |mut all, (_, t)| {
            all.add(t);
            all
        })
    }
}

/// `n` blocks of a prefix family: equal `family` means a shared prefix.
fn blocks(family: u64, n: u64) -> Vec<u64> {
    (0..n).map(|i| (family << 32) | i).collect()
}

#[test]
fn a_side_call_on_another_worker_neither_moves_the_session_nor_breaks_it() {
    let mut s = Sidecar::new(3);
    let main = s.call("s", Lane::Main, &blocks(1, 40));
    s.done(&main);
    let home = main.chosen().unwrap();
    // A title call: the session's id, a prompt of its own. Placed as a
    // request with no session: no home, and the session's home, which
    // hosts a live session, costs more than an empty worker.
    let title = s.call("s", Lane::Side, &blocks(9, 6));
    assert_eq!((title.home, title.parent_home), (None, None));
    let elsewhere = title.chosen().unwrap();
    assert_ne!(elsewhere, home);
    assert_eq!(s.router.sessions().home("s", s.now_ms), Some(home));
    s.done(&title);
    let next = s.call("s", Lane::Main, &blocks(1, 44));
    assert_eq!((next.chosen(), next.home), (Some(home), Some(home)));
    assert_eq!(next.reason, Reason::PrefixMatch);

    let t = s.totals();
    assert_eq!((t.calls, t.side_calls), (3, 1));
    // Only the second main call continues the session, on its worker.
    assert_eq!((t.continuing_calls, t.same_worker_calls), (1, 1));
    assert_eq!(t.moves, [0; MoveReason::ALL.len()]);
    assert_eq!((t.prefix_checks, t.prefix_breaks), (1, [0; SectionKind::ALL.len()]));
    assert!(s.ledger.break_points().is_empty());
    let lanes = s.ledger.session_lanes("s").unwrap();
    assert_eq!((lanes.harness, lanes.calls), (Harness::OpenCode, [2, 1, 0]));
}

#[test]
fn a_side_call_does_not_change_where_the_next_main_call_goes() {
    let mut s = Sidecar::new(3);
    let main = s.call("s", Lane::Main, &blocks(1, 8));
    s.done(&main);
    let home = main.chosen().unwrap();
    // The session's worker is out while the side call is placed.
    s.router.set_healthy(home, false);
    let side = s.call("s", Lane::Side, &blocks(9, 8));
    assert_ne!(side.chosen(), Some(home));
    s.router.set_healthy(home, true);
    s.done(&side);
    // The next main call shares no prefix with anything (a rebuilt
    // history): every worker ties, and the session's home wins, not the
    // side call's worker.
    let next = s.call("s", Lane::Main, &blocks(2, 8));
    assert_eq!(next.chosen(), Some(home));
    assert_eq!(next.reason, Reason::SessionAffinity);
}

#[test]
fn a_side_call_leaves_the_sessions_pending_pick_in_flight() {
    let mut s = Sidecar::new(2);
    let main = s.call("s", Lane::Main, &blocks(1, 8));
    let home = main.chosen().unwrap();
    // Sent while the main call runs (a title beside the first turn).
    let side = s.call("s", Lane::Side, &blocks(9, 8));
    assert_eq!(s.router.sessions_with_pending_pick(), 1);
    let in_flight: u32 = s.router.workers().iter().map(|w| w.in_flight).sum();
    assert_eq!(in_flight, 2);
    assert_eq!(
        s.router.workers()[home.0].in_flight,
        1 + u32::from(side.chosen() == Some(home))
    );
}

#[test]
fn after_a_compaction_the_next_main_calls_new_prefix_is_no_break() {
    let mut s = Sidecar::new(2);
    let first = s.call("s", Lane::Main, &blocks(1, 4));
    s.done(&first);
    // The compaction keeps the prefix and is placed as the main lane.
    let compaction = s.call("s", Lane::Compaction, &blocks(1, 5));
    assert_eq!(compaction.home, first.chosen());
    assert_eq!(compaction.chosen(), first.chosen());
    s.done(&compaction);
    // The rebuilt history: a new prefix epoch.
    let rebuilt = s.call("s", Lane::Main, &blocks(7, 2));
    s.done(&rebuilt);
    let grown = s.call("s", Lane::Main, &blocks(7, 3));
    s.done(&grown);
    let t = s.totals();
    assert_eq!((t.compaction_calls, t.prefix_epochs), (1, 1));
    // Checked: the compaction and the grown call, never the rebuilt one.
    assert_eq!(t.prefix_checks, 2);
    assert_eq!(t.prefix_breaks.iter().sum::<u64>(), 0);
    assert!(s.ledger.break_points().is_empty());
    // The epoch is one call long: a later change is a break again.
    let changed = s.call("s", Lane::Main, &blocks(8, 3));
    s.done(&changed);
    let t = s.totals();
    assert_eq!((t.prefix_epochs, t.prefix_checks), (1, 3));
    assert_eq!(t.prefix_breaks.iter().sum::<u64>(), 1);
    assert_eq!(s.ledger.session_lanes("s").unwrap().calls, [4, 0, 1]);
}
