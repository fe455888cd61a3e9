//! Parents named by trace (`trace:<32 hex>`, OpenClaw's subagents): the
//! session whose main-lane calls carried the trace, or no parent at all;
//! and the trace table's bounds.

#![allow(clippy::unwrap_used)]

use kvmesh_vocab::PARENT_BY_TRACE_PREFIX;

use crate::sessions::SessionStore;
use crate::*;

fn router(n: usize) -> Router {
    Router::new(RouterConfig::default(), (0..n).map(|i| format!("10.0.0.{i}:8000")))
}

fn blocks(family: u64, n: u64) -> Vec<u64> {
    (0..n).map(|i| (family << 32) | i).collect()
}

const TURN: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const OTHER_TURN: &str = "00f067aa0ba902b700f067aa0ba902b7";

fn trace(hex: &str) -> Option<TraceId> {
    TraceId::parse(hex)
}

fn by_trace(hex: &str) -> String {
    format!("{PARENT_BY_TRACE_PREFIX}{hex}")
}

/// A call of `session` at `now_ms`, in the main lane.
fn input<'a>(hashes: &'a [u64], session: &'a str, now_ms: u64) -> PickInput<'a> {
    PickInput {
        block_hashes: hashes,
        block_bytes: 256,
        prompt_bytes: hashes.len() as u64 * 256,
        session_id: session,
        now_ms,
        ..PickInput::default()
    }
}

fn done(r: &mut Router, d: &Decision) {
    r.report(Outcome {
        pick_id: d.pick_id,
        ..Outcome::default()
    });
}

#[test]
fn a_trace_named_parent_is_the_session_that_carried_the_trace() {
    let mut r = router(3);
    // Every worker hosts one session, the parent's on worker 1.
    for (at, (family, session)) in [(50, "other"), (1, "parent"), (51, "another")].into_iter().enumerate() {
        let hashes = blocks(family, 8);
        let d = r.pick(input(&hashes, session, at as u64 * 1000));
        done(&mut r, &d);
    }
    let prefix = blocks(1, 9);
    let parent = r.pick(PickInput {
        trace_id: trace(TURN),
        ..input(&prefix, "parent", 4_000)
    });
    done(&mut r, &parent);
    assert_eq!(parent.chosen(), Some(WorkerId(1)));
    // Two subagents of that turn: sessions of their own, their own prompt,
    // and the parent turn's trace id.
    let parent_id = by_trace(TURN);
    for (i, child) in ["child-1", "child-2"].into_iter().enumerate() {
        let hashes = blocks(2 + i as u64, 8);
        let d = r.pick(PickInput {
            parent_id: &parent_id,
            trace_id: trace(TURN),
            ..input(&hashes, child, 5_000 + i as u64)
        });
        assert_eq!(d.parent_source, ParentSource::Trace, "{child}");
        assert_eq!(d.parent_home, Some(WorkerId(1)), "{child}");
        assert_eq!(r.sessions().parent(child), Some("parent"));
        // Seeded on the parent's worker, as a subagent named by id is.
        if i == 0 {
            assert_eq!((d.chosen(), d.reason), (Some(WorkerId(1)), Reason::ParentSeed));
        }
    }
    // The children carried the trace, but never claim their parent's turn.
    assert_eq!(r.sessions().trace_carrier(trace(TURN).unwrap(), 6_000), Some("parent"));
    // A later call of a child keeps its parent, even once the parent's
    // next turn has replaced the trace.
    let next_turn = r.pick(PickInput {
        trace_id: trace("11111111111111111111111111111111"),
        ..input(&prefix, "parent", 7_000)
    });
    assert_eq!(next_turn.parent_source, ParentSource::None);
    assert_eq!(r.sessions().trace_carrier(trace(TURN).unwrap(), 7_000), None);
    let hashes = blocks(2, 9);
    let again = r.pick(PickInput {
        parent_id: &parent_id,
        trace_id: trace(TURN),
        ..input(&hashes, "child-1", 8_000)
    });
    assert_eq!(again.parent_source, ParentSource::Trace);
    assert_eq!(r.sessions().parent("child-1"), Some("parent"));
}

#[test]
fn an_unknown_or_malformed_trace_leaves_no_parent() {
    let mut r = router(2);
    let hashes = blocks(1, 8);
    let parent = r.pick(PickInput {
        trace_id: trace(TURN),
        ..input(&hashes, "parent", 1_000)
    });
    done(&mut r, &parent);
    let unknown = by_trace(OTHER_TURN);
    let malformed = by_trace("not-a-trace-id");
    for (child, parent_id) in [("child-1", unknown.as_str()), ("child-2", malformed.as_str())] {
        let hashes = blocks(2, 8);
        let d = r.pick(PickInput {
            parent_id,
            trace_id: trace(OTHER_TURN),
            ..input(&hashes, child, 2_000)
        });
        assert_eq!(d.parent_source, ParentSource::UnknownTrace, "{parent_id}");
        assert_eq!(d.parent_home, None);
        // No parent invented: neither the trace's text nor a guess.
        assert_eq!(r.sessions().parent(child), None);
    }
    // A side call names no session's turn: a trace it carries resolves to
    // nothing.
    let hashes = blocks(3, 2);
    r.pick(PickInput {
        lane: Lane::Side,
        trace_id: trace(OTHER_TURN),
        ..input(&hashes, "side", 3_000)
    });
    assert_eq!(r.sessions().trace_carrier(trace(OTHER_TURN).unwrap(), 3_000), None);
}

#[test]
fn a_trace_goes_with_its_session() {
    let mut r = router(2);
    let hashes = blocks(1, 8);
    let parent = r.pick(PickInput {
        trace_id: trace(TURN),
        ..input(&hashes, "parent", 1_000)
    });
    done(&mut r, &parent);
    assert_eq!(r.sessions().traces(), 1);
    // Idle past the TTL: the session is over, and so is its trace, even
    // before the table is swept.
    let ttl = r.config().session_ttl_ms;
    assert_eq!(r.sessions().trace_carrier(trace(TURN).unwrap(), 1_000 + ttl + 1), None);
    let child_hashes = blocks(2, 8);
    let parent_id = by_trace(TURN);
    let late = r.pick(PickInput {
        parent_id: &parent_id,
        ..input(&child_hashes, "child", 1_000 + ttl + 1)
    });
    assert_eq!(late.parent_source, ParentSource::UnknownTrace);
    assert_eq!(r.expire_sessions(1_000 + ttl + 1), 1);
    assert_eq!(r.sessions().traces(), 0);
    // The session's last call ends it, and its trace with it.
    let last = r.pick(PickInput {
        trace_id: trace(OTHER_TURN),
        ..input(&hashes, "p2", 2 * ttl)
    });
    done(&mut r, &last);
    assert_eq!(r.sessions().traces(), 1);
    r.pick(PickInput {
        session_final: true,
        trace_id: trace(OTHER_TURN),
        ..input(&hashes, "p2", 2 * ttl + 1)
    });
    assert_eq!(r.sessions().traces(), 0);
}

#[test]
fn the_trace_table_never_exceeds_its_bound() {
    // Its own bound, below the sessions'.
    let mut table = SessionStore::with_trace_capacity(100, 60_000, 4);
    for i in 0..50u128 {
        let session = table.bind(&format!("s{i}"), None, WorkerId(0), 1).unwrap();
        table.carry_trace(session, TraceId::parse(&format!("{:032x}", i + 1)).unwrap());
        assert!(table.traces() <= 4);
    }
    assert_eq!(table.traces(), 4);
    // One entry per session whatever the turns it went through.
    let mut table = SessionStore::with_trace_capacity(100, 60_000, 4);
    let session = table.bind("s", None, WorkerId(0), 1).unwrap();
    for i in 1..=10u128 {
        table.carry_trace(session, TraceId::parse(&format!("{i:032x}")).unwrap());
    }
    assert_eq!(table.traces(), 1);
    // And never more than the live sessions: an evicted session's trace
    // goes with it.
    let mut r = Router::new(
        RouterConfig {
            max_sessions: 8,
            ..RouterConfig::default()
        },
        ["10.0.0.1:8000".to_owned()],
    );
    let hashes = blocks(1, 2);
    for i in 0..100u64 {
        let session = format!("s{i}");
        let hex = format!("{:032x}", i + 1);
        let d = r.pick(PickInput {
            trace_id: TraceId::parse(&hex),
            ..input(&hashes, &session, i)
        });
        done(&mut r, &d);
        assert!(r.sessions().traces() <= r.sessions().len());
        assert!(r.sessions().len() <= 8);
    }
    assert_eq!(r.sessions().traces(), 8);
}

#[test]
fn the_ledger_counts_trace_parents_resolved_and_not() {
    let mut r = router(2);
    let mut ledger = Insights::new(InsightConfig::default());
    let parent_id = by_trace(TURN);
    let unknown = by_trace(OTHER_TURN);
    let hashes = blocks(1, 4);
    let calls = [
        ("parent", "", 1_000),
        ("child", parent_id.as_str(), 2_000),
        ("stray", unknown.as_str(), 3_000),
    ];
    for (session, parent, now_ms) in calls {
        let call = Call {
            input: PickInput {
                parent_id: parent,
                trace_id: trace(TURN),
                model: "m",
                ..input(&hashes, session, now_ms)
            },
            harness: Harness::OpenClaw,
            tenant: "",
            sections: &[],
        };
        let probe = ledger.probe(&call);
        let d = r.pick(call.input);
        let holdings = r.holdings(probe.as_slice());
        ledger.on_pick(&call, &d, &holdings);
    }
    let t = ledger
        .totals()
        .find(|(label, _)| label.harness == Harness::OpenClaw)
        .map(|(_, t)| t.clone())
        .unwrap();
    assert_eq!((t.calls, t.trace_parents, t.unknown_trace_parents), (3, 1, 1));
}
