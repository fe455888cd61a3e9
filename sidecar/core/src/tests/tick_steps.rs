//! The ledger's tick taken in steps (as the sidecar takes it, its locks
//! released between steps) against the tick taken whole and against the
//! full walks it replaced (`idle_sessions`, `evicted_idle_sessions`); and
//! the session table's newest-first pages and stepped expiry against a
//! reference of every session sorted by when it was last seen.

#![allow(clippy::unwrap_used, clippy::float_cmp)]

use proptest::prelude::*;

use crate::*;

const WORKERS: usize = 4;

#[derive(Debug, Clone)]
enum Op {
    /// A session's call: session, worker, its number of blocks.
    Pick(u8, u8, u8),
    /// The outcome of the n-th call still awaiting one.
    Outcome(u8),
    Advance(u16),
    /// The fleet loses (or regains) what worker w holds.
    Evict(u8),
    /// A tick, the stepped ledger's in steps of this many sessions.
    Tick(u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..12u8, 0..WORKERS as u8, 1..6u8).prop_map(|(s, w, b)| Op::Pick(s, w, b)),
        3 => (0..8u8).prop_map(Op::Outcome),
        2 => (1..40u16).prop_map(Op::Advance),
        1 => (0..WORKERS as u8).prop_map(Op::Evict),
        2 => (1..6u8).prop_map(Op::Tick),
    ]
}

fn holdings(evicted: &[bool], probes: &[(WorkerId, u64)]) -> Holdings {
    Holdings::new(probes.iter().map(|&p| (p, !evicted[p.0.0])))
}

fn decision(pick_id: u64, worker: usize, blocks: usize) -> Decision {
    Decision {
        pick_id,
        ranked: vec![WorkerId(worker)],
        predicted_cached_blocks: blocks as u32 / 2,
        predicted_cached_tokens: blocks as u64 * 32,
        best_overlap: blocks as u32 / 2,
        overlaps: vec![0; WORKERS],
        costs: vec![Some(Cost::default()); WORKERS],
        bytes_per_token: 4.0,
        prefill_tokens_per_ms: 10.0,
        ..Decision::default()
    }
}

fn ledger() -> Insights {
    Insights::new(InsightConfig {
        session_ttl_ms: 60,
        ..InsightConfig::default()
    })
}

fn stepped_tick(insights: &mut Insights, now_ms: u64, step: usize, evicted: &[bool]) {
    let mut pass = insights.tick_begin(now_ms);
    loop {
        let s = insights.tick_step(&pass, step);
        let answers = holdings(evicted, &s.probes);
        if insights.tick_apply(&mut pass, s, &answers) {
            break;
        }
    }
}

fn sorted_totals(insights: &Insights) -> Vec<(LabelId, Totals)> {
    let mut all: Vec<(LabelId, Totals)> = insights.totals().map(|(l, t)| (l, t.clone())).collect();
    all.sort_by_key(|(l, _)| *l);
    all
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn a_tick_in_steps_gives_what_the_whole_tick_and_the_full_walks_give(ops in prop::collection::vec(op(), 1..120)) {
        let (mut whole, mut stepped) = (ledger(), ledger());
        let mut evicted = [false; WORKERS];
        let mut now = 1_000u64;
        let mut awaiting: Vec<u64> = Vec::new();
        let mut next_pick = 0u64;
        let names: Vec<String> = (0..12).map(|i| format!("s{i}")).collect();
        for op in ops {
            match op {
                Op::Pick(s, w, b) => {
                    next_pick += 1;
                    let blocks: Vec<u64> = (0..u64::from(b)).map(|i| (u64::from(s) << 8) | i).collect();
                    let call = Call {
                        input: PickInput {
                            block_hashes: &blocks,
                            block_bytes: 100,
                            prompt_bytes: blocks.len() as u64 * 100,
                            session_id: &names[usize::from(s)],
                            model: "m",
                            now_ms: now,
                            ..PickInput::default()
                        },
                        harness: if s % 2 == 0 { Harness::from_name("codex") } else { Harness::from_name("claude-code") },
                        tenant: "t",
                        sections: &[],
                    };
                    let d = decision(next_pick, usize::from(w), blocks.len());
                    for ledger in [&mut whole, &mut stepped] {
                        let answers = holdings(&evicted, ledger.probe(&call).as_slice());
                        ledger.on_pick(&call, &d, &answers);
                    }
                    awaiting.push(next_pick);
                }
                Op::Outcome(n) => {
                    if !awaiting.is_empty() {
                        let pick = awaiting.remove(usize::from(n) % awaiting.len());
                        for ledger in [&mut whole, &mut stepped] {
                            ledger.on_outcome(pick, Some(400), Some(200), None, now);
                        }
                    }
                }
                Op::Advance(ms) => now += u64::from(ms),
                Op::Evict(w) => evicted[usize::from(w)] = !evicted[usize::from(w)],
                Op::Tick(step) => {
                    let answers = holdings(&evicted, &whole.idle_probes());
                    whole.tick(now, &answers);
                    stepped_tick(&mut stepped, now, usize::from(step), &evicted);

                    prop_assert_eq!(sorted_totals(&whole), sorted_totals(&stepped));
                    prop_assert_eq!(whole.sessions(), stepped.sessions());
                    prop_assert_eq!(whole.retention().collect::<Vec<_>>(), stepped.retention().collect::<Vec<_>>());
                    prop_assert_eq!(whole.last_tick(), stepped.last_tick());

                    // Against the full walks, with the fleet asked afresh.
                    let answers = holdings(&evicted, &stepped.idle_probes());
                    let tick = stepped.last_tick();
                    let idle = stepped.idle_sessions(now, &answers);
                    prop_assert_eq!(&tick.idle, &idle);
                    prop_assert_eq!(tick.idle_count, idle.len());
                    let mut lost = tick.evicted.clone();
                    lost.sort_by(|a, b| b.kv_bytes.total_cmp(&a.kv_bytes).then_with(|| a.session.cmp(&b.session)));
                    prop_assert_eq!(lost, stepped.evicted_idle_sessions(now, &answers));
                    for (harness, r) in stepped.retention() {
                        let mine: Vec<&IdleSession> = idle.iter().filter(|s| s.harness == harness).collect();
                        prop_assert_eq!(r.idle_sessions, mine.len() as u64);
                        prop_assert_eq!(r.max_idle_ms, mine.iter().map(|s| s.idle_ms).max().unwrap_or(0));
                    }
                }
            }
        }
    }

    #[test]
    fn session_pages_are_newest_first_and_expiry_ends_exactly_the_idle(
        calls in prop::collection::vec((0..40u16, 1..30u16), 1..200),
        page in 1..9usize,
        ttl in 10..400u64,
    ) {
        let mut table = SessionStore::new(1000, ttl);
        let mut now = 0u64;
        let mut seen: std::collections::HashMap<String, u64> = std::collections::HashMap::new();
        for (s, gap) in calls {
            now += u64::from(gap);
            let id = format!("s{s}");
            table.bind(&id, None, WorkerId(usize::from(s) % WORKERS), now);
            seen.insert(id, now);
        }
        // Newest first, ties by the order they were seen (never reordered).
        let mut reference: Vec<(String, u64)> = seen.into_iter().collect();
        reference.sort_by_key(|r| std::cmp::Reverse(r.1));
        let mut walked = Vec::new();
        let mut cursor = u64::MAX;
        loop {
            let (rows, resume) = table.newest_before(cursor, page);
            prop_assert!(rows.len() <= page);
            walked.extend(rows.iter().map(|&(id, _, seen)| (id.to_owned(), seen)));
            if resume == cursor {
                break;
            }
            cursor = resume;
        }
        prop_assert_eq!(walked.iter().map(|r| r.1).collect::<Vec<_>>(), reference.iter().map(|r| r.1).collect::<Vec<_>>());
        let mut ids: Vec<&String> = walked.iter().map(|r| &r.0).collect();
        ids.sort();
        ids.dedup();
        prop_assert_eq!(ids.len(), reference.len());

        let later = now + ttl / 2;
        let idle = reference.iter().filter(|(_, seen)| later - seen > ttl).count();
        prop_assert_eq!(table.expire(later, drop), idle);
        prop_assert_eq!(table.len(), reference.len() - idle);
        let hosted: u32 = (0..WORKERS).map(|w| table.hosted(WorkerId(w))).sum();
        prop_assert_eq!(hosted as usize, table.len());
    }
}

#[test]
fn expiry_ends_at_most_a_step_per_call() {
    let mut table = SessionStore::new(10_000, 10);
    for i in 0..2_500u64 {
        table.bind(&format!("s{i}"), None, WorkerId(0), i / 100);
    }
    assert_eq!(table.expire(1_000, drop), EXPIRE_STEP);
    assert_eq!(table.expire(1_000, drop), EXPIRE_STEP);
    assert_eq!(table.expire(1_000, drop), 500);
    assert!(table.is_empty());
    assert_eq!(table.hosted(WorkerId(0)), 0);
}

#[test]
fn a_map_emptied_by_expiry_gives_its_table_back() {
    let mut map: LruMap<u64, [u8; 64]> = LruMap::new(1 << 20);
    for i in 0..100_000 {
        map.insert(i, [0; 64]);
    }
    let peak = map.allocated();
    while map.len() > 10 {
        map.pop_oldest();
    }
    assert!(
        peak >= 100_000 && map.allocated() < 2048,
        "{peak} -> {}",
        map.allocated()
    );
    // Walks still see every entry in order after the shrink.
    let (keys, _) = map.keys_after(0, map.stamp(), 100);
    assert_eq!(keys, (99_990..100_000).collect::<Vec<_>>());
    let (newest, _) = map.newest_before(u64::MAX, 3);
    assert_eq!(
        newest.iter().map(|(k, _)| **k).collect::<Vec<_>>(),
        [99_999, 99_998, 99_997]
    );
}
