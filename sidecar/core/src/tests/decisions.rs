//! One deterministic test per decision of the cost model.

use crate::*;

fn router(n: usize) -> Router {
    Router::new(RouterConfig::default(), (0..n).map(|i| format!("10.0.0.{i}:8000")))
}

/// `n` blocks of a prefix family: equal `family` means a shared prefix.
fn blocks(family: u64, n: u64) -> Vec<u64> {
    (0..n).map(|i| (family << 32) | i).collect()
}

thread_local! {
    static CLOCK: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// A virtual clock: each request comes a second after the previous one,
/// so earlier prefills have drained, as between an agent's calls.
fn tick() -> u64 {
    CLOCK.with(|c| {
        c.set(c.get() + 1_000);
        c.get()
    })
}

fn input<'a>(hashes: &'a [u64], session: &'a str) -> PickInput<'a> {
    PickInput {
        block_hashes: hashes,
        block_bytes: 256,
        prompt_bytes: hashes.len() as u64 * 256,
        session_id: session,
        now_ms: tick(),
        ..PickInput::default()
    }
}

fn pick(r: &mut Router, hashes: &[u64], session: &str) -> Decision {
    r.pick(input(hashes, session))
}

fn done(r: &mut Router, d: &Decision) {
    assert!(r.report(Outcome {
        pick_id: d.pick_id,
        ..Outcome::default()
    }));
}

#[test]
fn the_longest_prefix_wins() {
    let mut r = router(3);
    let first = pick(&mut r, &blocks(1, 40), "a");
    done(&mut r, &first);
    let next = pick(&mut r, &blocks(1, 44), "a");
    assert_eq!(next.ranked[0], first.ranked[0]);
    assert_eq!((next.reason, next.predicted_cached_blocks), (Reason::PrefixMatch, 40));
}

#[test]
fn a_growing_session_stays_on_its_worker() {
    let mut r = router(3);
    let first = pick(&mut r, &blocks(1, 4), "s");
    done(&mut r, &first);
    for n in 5..25 {
        let next = pick(&mut r, &blocks(1, n), "s");
        assert_eq!(next.ranked[0], first.ranked[0]);
        assert_eq!(next.reason, Reason::PrefixMatch);
        done(&mut r, &next);
    }
}

#[test]
fn an_overloaded_prefix_loses_to_recomputing_elsewhere() {
    let mut r = router(2);
    let home = pick(&mut r, &blocks(1, 40), "a");
    done(&mut r, &home);
    // Eight big unrelated requests in flight on the same worker (the other
    // one is briefly out of rotation so they land there).
    let other = WorkerId(1 - home.ranked[0].0);
    r.set_healthy(other, false);
    for s in 0..8u64 {
        let d = pick(&mut r, &blocks(100 + s, 200), "");
        assert_eq!(d.ranked[0], home.ranked[0]);
    }
    r.set_healthy(other, true);
    let next = pick(&mut r, &blocks(1, 44), "a");
    assert_ne!(next.ranked[0], home.ranked[0]);
    assert_eq!(next.reason, Reason::LoadSpill);
    assert_eq!(next.best_overlap, 40);
}

#[test]
fn a_session_returns_home_on_a_tie() {
    let mut r = router(3);
    let home = pick(&mut r, &blocks(1, 8), "s");
    done(&mut r, &home);
    // The prefix was rewritten (a compaction): no worker holds any of it,
    // every worker costs the same, and the session's home wins the tie.
    let next = pick(&mut r, &blocks(2, 8), "s");
    assert_eq!(next.ranked[0], home.ranked[0]);
    assert_eq!(next.reason, Reason::SessionAffinity);
}

#[test]
fn new_sessions_spread_even_when_they_share_a_tool_list() {
    let mut r = router(3);
    let mut seen = [0usize; 3];
    for s in 0..12u64 {
        // Two shared blocks (the tool list), then the session's own.
        let hashes: Vec<u64> = [7, 8].into_iter().chain(blocks(s + 1, 18)).collect();
        let d = pick(&mut r, &hashes, &format!("s{s}"));
        seen[d.ranked[0].0] += 1;
        done(&mut r, &d);
    }
    assert_eq!(seen, [4, 4, 4]);
}

/// `spread_floor` scales the spreading terms by the worker's recent
/// utilization: on an idle fleet, new sessions sharing a long prefix (a
/// domain's system prompt) stay where it is cached instead of computing it
/// again elsewhere; at the default (1, in full) they spread.
#[test]
fn on_an_idle_fleet_a_spread_floor_keeps_new_sessions_on_their_shared_prefix() {
    let placements = |spread_floor: f64| {
        let config = RouterConfig {
            spread_floor,
            ..RouterConfig::default()
        };
        let mut r = Router::new(config, (0..3).map(|i| format!("10.0.0.{i}:8000")));
        let mut seen = [0usize; 3];
        for s in 0..12u64 {
            let hashes: Vec<u64> = blocks(99, 24).into_iter().chain(blocks(s + 1, 4)).collect();
            let d = pick(&mut r, &hashes, &format!("s{s}"));
            seen[d.ranked[0].0] += 1;
            done(&mut r, &d);
        }
        seen
    };
    let full = placements(1.0);
    assert!(full.iter().filter(|&&n| n > 0).count() > 1, "{full:?}");
    let floor = placements(0.0);
    assert_eq!(floor.iter().max(), Some(&12), "{floor:?}");
}

#[test]
fn sixteen_subagents_seed_on_the_parent_and_spill_in_order() {
    let mut r = router(4);
    let prefix = blocks(9, 40);
    let parent = pick(&mut r, &prefix, "parent");
    done(&mut r, &parent);
    let parent_worker = parent.ranked[0];
    // 16 children sent at once, each the parent's context plus its own task.
    let burst = tick();
    let mut placed = Vec::new();
    for child in 0..16u64 {
        let hashes: Vec<u64> = prefix.iter().copied().chain(blocks(1000 + child, 4)).collect();
        let agent = format!("child-{child}");
        let d = r.pick(PickInput {
            agent_id: &agent,
            parent_id: "parent",
            now_ms: burst,
            ..input(&hashes, "parent")
        });
        placed.push(d.ranked[0]);
    }
    // Seeded on the parent's worker first...
    assert_eq!(placed[0], parent_worker);
    assert_eq!(
        r.pick(PickInput::default()).reason,
        Reason::LeastLoaded,
        "an empty request still gets a worker"
    );
    // ...then every other worker is opened in id order as load grows...
    let mut first_use = Vec::new();
    for w in &placed {
        if !first_use.contains(w) {
            first_use.push(*w);
        }
    }
    let mut expected: Vec<WorkerId> = vec![parent_worker];
    expected.extend((0..4).map(WorkerId).filter(|w| *w != parent_worker));
    assert_eq!(first_use, expected, "spill order");
    // ...and with the default weights the placements are exactly these: the
    // parent's worker takes children while its cost stays below a full
    // recompute elsewhere. A child is 44 blocks of 64 tokens (2,816), 4 of
    // them new. On the parent's worker with k children placed: prefill 256
    // + queue 256k + decode 0.05 · 2,816 · (k + 1) + sessions 512 · (k + 1)
    // + recent 0.2 · (2,560 + 256k) = 1,420.8 + 960k; on an empty one:
    // 2,816 + 140.8 = 2,956.8. So two children stay (k = 0, 1), the third
    // spills; each opened worker then holds the prefix too and shares the
    // rest by cost.
    let got: Vec<usize> = placed.iter().map(|w| w.0).collect();
    assert_eq!(parent_worker, WorkerId(0));
    assert_eq!(got, [0, 0, 1, 2, 3, 0, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1]);
}

#[test]
fn a_child_with_no_shared_prefix_is_seeded_on_its_parents_worker() {
    let mut r = router(3);
    // Every worker hosts one session, the parent's on worker 1.
    for (family, session) in [(50, "other"), (1, "parent"), (51, "another")] {
        let d = pick(&mut r, &blocks(family, 8), session);
        done(&mut r, &d);
    }
    let parent = pick(&mut r, &blocks(1, 8), "parent");
    done(&mut r, &parent);
    assert_eq!(parent.ranked[0], WorkerId(1));
    // The child has its own system prompt: nothing in common with anyone.
    let hashes = blocks(2, 8);
    let child = r.pick(PickInput {
        agent_id: "child",
        parent_id: "parent",
        ..input(&hashes, "parent")
    });
    assert_eq!(child.ranked[0], parent.ranked[0]);
    assert_eq!(child.reason, Reason::ParentSeed);
}

#[test]
fn a_restart_wipes_the_worker() {
    let mut r = router(2);
    let first = pick(&mut r, &blocks(1, 20), "a");
    done(&mut r, &first);
    assert_eq!(r.restart(first.ranked[0]), 20);
    let next = pick(&mut r, &blocks(1, 24), "a");
    assert_eq!(next.predicted_cached_blocks, 0);
    assert_eq!(next.best_overlap, 0);
}

#[test]
fn drained_removed_and_unhealthy_workers_are_not_picked() {
    let mut r = router(3);
    r.drain(WorkerId(0));
    r.set_healthy(WorkerId(1), false);
    let d = pick(&mut r, &blocks(1, 4), "a");
    assert_eq!(d.ranked, vec![WorkerId(2)]);
    r.remove(WorkerId(2));
    assert_eq!(pick(&mut r, &blocks(1, 4), "a").reason, Reason::NoWorkers);
    r.add_worker("10.0.0.2:8000");
    assert_eq!(pick(&mut r, &blocks(1, 4), "a").ranked, vec![WorkerId(2)]);
}

#[test]
fn a_shortfall_shrinks_the_worker_and_a_surplus_grows_it_back() {
    let mut r = router(1);
    for s in 0..10u64 {
        let d = pick(&mut r, &blocks(s, 100), &format!("s{s}"));
        done(&mut r, &d);
    }
    let w = WorkerId(0);
    assert_eq!(r.index().len(w), 1000);
    // The model predicts 100 cached blocks; the engine had 10 (64 tokens each).
    let d = pick(&mut r, &blocks(9, 100), "s9");
    assert_eq!(d.predicted_cached_blocks, 100);
    r.report(Outcome {
        pick_id: d.pick_id,
        prompt_tokens: Some(6400),
        cached_tokens: Some(640),
        ..Outcome::default()
    });
    assert_eq!(r.index().len(w), 910);
    assert_eq!(r.index().capacity(w), 910);
    // The request's own blocks survive: they are the newest.
    let again = pick(&mut r, &blocks(9, 100), "s9");
    assert_eq!(again.predicted_cached_blocks, 100);
    // More cached than predicted: the estimate grows back by the surplus.
    let fresh = pick(&mut r, &blocks(77, 50), "new");
    r.report(Outcome {
        pick_id: fresh.pick_id,
        prompt_tokens: Some(3200),
        cached_tokens: Some(64 * 20),
        ..Outcome::default()
    });
    assert_eq!(r.index().capacity(w), 930);
}

#[test]
fn a_shortfall_on_another_sessions_blocks_does_not_shrink_the_worker() {
    let mut r = router(1);
    for s in 0..10u64 {
        let d = pick(&mut r, &blocks(s, 100), &format!("s{s}"));
        done(&mut r, &d);
    }
    let w = WorkerId(0);
    let capacity = r.index().capacity(w);
    // A new session whose prompt kvmesh sees as s9's: the engine, whose
    // template orders the prompt otherwise, had only 10 of the blocks.
    let d = pick(&mut r, &blocks(9, 100), "new");
    assert_eq!(d.predicted_cached_blocks, 100);
    r.report(Outcome {
        pick_id: d.pick_id,
        prompt_tokens: Some(6400),
        cached_tokens: Some(640),
        ..Outcome::default()
    });
    assert_eq!(r.index().len(w), 1000, "evicted on another session's blocks");
    assert_eq!(r.index().capacity(w), capacity);
    // The same shortfall on the session's own home is evidence: it shrinks.
    let again = pick(&mut r, &blocks(9, 100), "new");
    r.report(Outcome {
        pick_id: again.pick_id,
        prompt_tokens: Some(6400),
        cached_tokens: Some(640),
        ..Outcome::default()
    });
    assert_eq!(r.index().capacity(w), 910);
}

#[test]
fn bytes_per_token_are_learned_per_model() {
    let mut r = router(1);
    for _ in 0..30 {
        let hashes = blocks(1, 10);
        let d = r.pick(PickInput {
            model: "qwen",
            ..input(&hashes, "")
        });
        r.report(Outcome {
            pick_id: d.pick_id,
            prompt_tokens: Some(2560 / 3),
            cached_tokens: None,
            ..Outcome::default()
        });
    }
    assert!(
        (r.bytes_per_token("qwen") - 3.0).abs() < 0.05,
        "{}",
        r.bytes_per_token("qwen")
    );
    assert_eq!(r.bytes_per_token("other"), 4.0);
}

#[test]
fn in_flight_is_released_once_and_bounded_without_reports() {
    let mut r = Router::new(
        RouterConfig {
            max_pending_picks: 4,
            ..RouterConfig::default()
        },
        ["10.0.0.1:1".to_owned()],
    );
    let d = pick(&mut r, &[1], "");
    assert!(r.report(Outcome {
        pick_id: d.pick_id,
        ..Outcome::default()
    }));
    assert!(!r.report(Outcome {
        pick_id: d.pick_id,
        ..Outcome::default()
    }));
    for _ in 0..10 {
        pick(&mut r, &[1], "");
    }
    assert_eq!(r.workers()[0].in_flight, 4);
    // Picks whose outcome never comes are released once they are too old.
    let late = RouterConfig::default().max_pick_age_ms + tick();
    let hashes = [2];
    r.pick(PickInput {
        now_ms: late,
        ..input(&hashes, "")
    });
    assert_eq!(r.workers()[0].in_flight, 1);
}

#[test]
fn a_sessions_latest_pick_is_forgotten_with_the_pick() {
    // Each session's latest pick is kept only while it is pending: reported,
    // aged out or pushed out by the bound, its entry goes too (the map was
    // pruned by a walk of up to twice the bound inside some Pick).
    let mut r = Router::new(
        RouterConfig {
            max_pending_picks: 10,
            ..RouterConfig::default()
        },
        ["10.0.0.1:1".to_owned()],
    );
    for s in 0..100 {
        pick(&mut r, &blocks(s, 2), &format!("s{s}"));
        assert!(r.sessions_with_pending_pick() <= 10, "after session {s}");
    }
    assert_eq!(r.workers()[0].in_flight, 10);
    // The sessions of the last ten picks come back: each call releases its
    // previous pick early, and the outcome of the new one forgets it.
    for s in 90..100 {
        let d = pick(&mut r, &blocks(s, 3), &format!("s{s}"));
        done(&mut r, &d);
    }
    assert_eq!(r.workers()[0].in_flight, 0);
    assert_eq!(r.sessions_with_pending_pick(), 0);
    // Picks that age out take their entries with them.
    for s in 0..5 {
        pick(&mut r, &blocks(s, 2), &format!("s{s}"));
    }
    let late = RouterConfig::default().max_pick_age_ms + tick();
    let hashes = [7];
    let d = r.pick(PickInput {
        now_ms: late,
        ..input(&hashes, "")
    });
    assert_eq!(r.sessions_with_pending_pick(), 0);
    done(&mut r, &d);
}

#[test]
fn sessions_expire_end_and_are_bounded() {
    let mut r = Router::new(
        RouterConfig {
            max_sessions: 3,
            session_ttl_ms: 10_000,
            ..RouterConfig::default()
        },
        ["10.0.0.1:1".to_owned()],
    );
    for s in 0..5 {
        let d = pick(&mut r, &blocks(s, 2), &format!("s{s}"));
        done(&mut r, &d);
    }
    assert_eq!(r.sessions().len(), 3);
    assert_eq!(r.workers()[0].live_sessions, 3);
    let hashes = blocks(4, 2);
    let d = r.pick(PickInput {
        session_final: true,
        ..input(&hashes, "s4")
    });
    done(&mut r, &d);
    assert_eq!(r.sessions().len(), 2);
    assert_eq!(r.expire_sessions(tick() + 20_000), 2);
    assert_eq!(r.workers()[0].live_sessions, 0);
}

#[test]
fn a_snapshot_restores_the_same_overlaps_and_sessions() {
    let mut r = router(3);
    for s in 0..6u64 {
        let d = pick(&mut r, &blocks(s, 10 + s), &format!("s{s}"));
        done(&mut r, &d);
    }
    let snapshot = r.snapshot();
    let mut warm = router(3);
    warm.restore(&snapshot);
    assert_eq!(warm.snapshot(), snapshot);
    for s in 0..6u64 {
        let a = pick(&mut r, &blocks(s, 12 + s), &format!("s{s}"));
        let b = pick(&mut warm, &blocks(s, 12 + s), &format!("s{s}"));
        assert_eq!(
            (a.ranked[0], a.predicted_cached_blocks),
            (b.ranked[0], b.predicted_cached_blocks)
        );
    }
}

#[test]
fn the_partial_tail_is_not_indexed() {
    let mut r = router(2);
    let hashes = blocks(1, 3);
    let d = r.pick(PickInput {
        last_block_partial: true,
        ..input(&hashes, "")
    });
    assert_eq!(r.workers()[d.ranked[0].0].cached_blocks, 2);
}

#[test]
fn a_sessions_next_call_releases_its_previous_one_exactly_once() {
    let mut r = router(1);
    let first = pick(&mut r, &blocks(1, 4), "s");
    assert_eq!(r.workers()[0].in_flight, 1);
    // The next call came before the first one's report: the first is over.
    let second = pick(&mut r, &blocks(1, 6), "s");
    assert_eq!(r.workers()[0].in_flight, 1);
    // Its late report changes nothing more; the second's releases the rest.
    assert!(r.report(Outcome {
        pick_id: first.pick_id,
        ..Outcome::default()
    }));
    assert_eq!(r.workers()[0].in_flight, 1);
    done(&mut r, &second);
    assert_eq!(r.workers()[0].in_flight, 0);
    assert_eq!(r.workers()[0].active_kv_tokens, 0.0);
}

#[test]
fn a_decision_records_what_the_choice_saw_term_by_term() {
    let mut r = router(3);
    let first = pick(&mut r, &blocks(1, 40), "a");
    done(&mut r, &first);
    let home = first.ranked[0];
    let drained = WorkerId((home.0 + 1) % 3);
    r.drain(drained);
    let next = pick(&mut r, &blocks(1, 44), "a");
    // Every worker has its overlap; a drained one has no cost.
    assert_eq!(next.overlaps.len(), 3);
    assert_eq!(next.overlap(home), 40);
    assert_eq!(next.costs.len(), 3);
    assert!(!next.pickable(drained) && next.costs[drained.0].is_none());
    assert!(next.pickable(home));
    assert_eq!(next.home, Some(home));
    // The chosen worker's cost is its entry, its total the sum of its terms,
    // and at home the hysteresis term is a quarter of the request.
    assert_eq!(Some(next.cost), next.costs[home.0]);
    let c = next.cost;
    let sum = c.queue + c.prefill + c.decode + c.sessions + c.recent + c.eviction - c.hysteresis;
    assert!((c.total - sum).abs() < 1e-9, "{c:?}");
    assert!((c.hysteresis - 0.25 * next.request_tokens).abs() < 1e-9, "{c:?}");
    assert_eq!(c.sessions, 0.0, "a continuing session weighs no sessions");
    assert_eq!(next.bytes_per_token, 4.0);
}

/// Two routers that lived the same history, one picking from its index and
/// one from overlaps given as equal to the index's, decide alike: the
/// oracle path differs from `pick` only in where the overlaps come from.
#[test]
fn given_overlaps_equal_to_the_index_decide_as_the_index_does() {
    let history = |r: &mut Router| {
        let mut now = 0;
        for (family, n, session) in [(1, 40, "a"), (2, 30, "b"), (1, 48, "a"), (3, 20, "c"), (2, 36, "b")] {
            now += 700;
            let hashes = blocks(family, n);
            let d = r.pick(PickInput {
                now_ms: now,
                ..input(&hashes, session)
            });
            if family != 2 {
                done(r, &d);
            }
        }
    };
    let (mut from_index, mut given) = (router(4), router(4));
    history(&mut from_index);
    history(&mut given);
    for (family, n, session) in [(1, 52, "a"), (2, 40, "b"), (3, 24, "new"), (9, 10, "d")] {
        let hashes = blocks(family, n);
        let at = PickInput {
            now_ms: 10_000,
            ..input(&hashes, session)
        };
        let expected = from_index.pick(at);
        let overlaps: Vec<(WorkerId, usize)> = expected
            .overlaps
            .iter()
            .enumerate()
            .map(|(w, &blocks)| (WorkerId(w), blocks))
            .collect();
        assert!(expected.overlaps.iter().any(|&o| o > 0) || family == 9);
        assert_eq!(given.pick_with_overlaps(at, &overlaps), expected);
    }
}

/// Given overlaps decide: the index believes worker 0 holds the prefix, the
/// engines say worker 2 does, and the pick follows the engines.
#[test]
fn given_overlaps_replace_the_index() {
    let mut r = router(3);
    let first = pick(&mut r, &blocks(1, 40), "a");
    done(&mut r, &first);
    let believed = first.ranked[0];
    let truth = WorkerId((believed.0 + 2) % 3);
    let next = r.pick_with_overlaps(input(&blocks(1, 44), "a"), &[(truth, 40), (WorkerId(7), 40)]);
    assert_eq!(next.ranked[0], truth);
    assert_eq!(next.overlaps[believed.0], 0);
    assert_eq!((next.reason, next.predicted_cached_blocks), (Reason::PrefixMatch, 40));
}

/// `place_on` where `pick` would have put the request leaves the router
/// exactly as `pick` leaves it (the simulator's oracle relies on it to
/// replay kvmesh's own choice); elsewhere, the request and its session go
/// where they were placed.
#[test]
fn placing_a_request_on_a_worker_records_it_as_a_pick_there() {
    let mut r = router(3);
    let first = pick(&mut r, &blocks(1, 40), "a");
    done(&mut r, &first);
    let hashes = blocks(1, 44);
    let next = input(&hashes, "a");
    let mut placed = r.clone();
    let d = r.pick(next);
    let p = placed.place_on(next, d.ranked[0]);
    assert_eq!(format!("{d:?}"), format!("{p:?}"));
    assert_eq!(format!("{r:?}"), format!("{placed:?}"));

    let elsewhere = WorkerId((d.ranked[0].0 + 1) % 3);
    let mut moved = r.clone();
    let m = moved.place_on(input(&blocks(1, 48), "a"), elsewhere);
    assert_eq!(m.ranked[0], elsewhere);
    done(&mut moved, &m);
    let after = pick(&mut moved, &blocks(1, 52), "a");
    assert_eq!(
        after.ranked[0], elsewhere,
        "the session's home and blocks moved with it"
    );
    assert_eq!(after.predicted_cached_blocks, 48);
}
