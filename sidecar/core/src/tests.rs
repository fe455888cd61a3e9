use super::*;

fn router(n: usize) -> Router {
    Router::new(RouterConfig::default(), (0..n).map(|i| format!("10.0.0.{i}:8000")))
}

fn blocks(prefix: u64, n: u64) -> Vec<u64> {
    (0..n).map(|i| prefix * 1_000_000 + i).collect()
}

fn pick(r: &mut Router, hashes: &[u64], session: &str) -> Decision {
    r.pick(PickInput {
        block_hashes: hashes,
        last_block_partial: false,
        session_id: session,
    })
}

#[test]
fn a_growing_prefix_returns_to_its_worker() {
    let mut r = router(3);
    let first = pick(&mut r, &blocks(1, 4), "s");
    assert_eq!(first.reason, Reason::LeastLoaded);
    for n in 5..25 {
        let next = pick(&mut r, &blocks(1, n), "");
        assert_eq!(next.ranked[0], first.ranked[0]);
        assert_eq!(next.reason, Reason::PrefixMatch);
        assert_eq!(next.predicted_cached_blocks, u32::try_from(n - 1).unwrap());
    }
}

#[test]
fn distinct_prefixes_spread_over_every_worker() {
    let mut r = router(3);
    let mut seen = [0usize; 3];
    for s in 0..12 {
        let d = pick(&mut r, &blocks(s + 10, 8), "");
        seen[d.ranked[0].0] += 1;
        assert!(r.report(Outcome { pick_id: d.pick_id }));
    }
    assert_eq!(seen, [4, 4, 4]);
}

#[test]
fn a_short_shared_prefix_does_not_pile_sessions_onto_one_worker() {
    let mut r = router(3);
    let mut seen = [0usize; 3];
    for s in 0..6 {
        // Two shared blocks (a common tool list), then 18 of the session's own.
        let hashes: Vec<u64> = [7, 8].into_iter().chain(blocks(s + 1, 18)).collect();
        let d = pick(&mut r, &hashes, "");
        assert_eq!(d.reason, Reason::LeastLoaded);
        seen[d.ranked[0].0] += 1;
    }
    assert_eq!(seen, [2, 2, 2]);
}

#[test]
fn partial_tail_is_not_indexed() {
    let mut r = router(2);
    let hashes = blocks(1, 3);
    let d = r.pick(PickInput {
        block_hashes: &hashes,
        last_block_partial: true,
        session_id: "",
    });
    assert_eq!(r.workers()[d.ranked[0].0].cached_blocks, 2);
}

#[test]
fn session_returns_to_its_worker_when_no_prefix_matches() {
    let mut r = router(3);
    let first = pick(&mut r, &blocks(1, 2), "sess");
    // Load the session's worker's neighbours' caches less than its own so
    // least-loaded alone would go elsewhere.
    let again = pick(&mut r, &blocks(2, 2), "sess");
    assert_eq!(again.ranked[0], first.ranked[0]);
    assert_eq!(again.reason, Reason::SessionAffinity);
}

#[test]
fn unhealthy_workers_are_never_ranked_and_none_left_means_no_destination() {
    let mut r = router(2);
    let d = pick(&mut r, &blocks(1, 2), "");
    r.set_healthy(d.ranked[0], false);
    let next = pick(&mut r, &blocks(1, 2), "");
    assert_eq!(next.ranked.len(), 1);
    assert_ne!(next.ranked[0], d.ranked[0]);
    r.set_healthy(next.ranked[0], false);
    assert_eq!(pick(&mut r, &blocks(1, 2), "").reason, Reason::NoWorkers);
}

#[test]
fn in_flight_is_released_once_per_pick_and_bounded_without_reports() {
    let mut r = Router::new(
        RouterConfig {
            max_pending_picks: 4,
            ..RouterConfig::default()
        },
        ["a:1".to_owned()],
    );
    let d = pick(&mut r, &[1], "");
    assert!(r.report(Outcome { pick_id: d.pick_id }));
    assert!(!r.report(Outcome { pick_id: d.pick_id }));
    for _ in 0..10 {
        pick(&mut r, &[1], "");
    }
    assert_eq!(r.workers()[0].in_flight, 4);
}

#[test]
fn worker_cache_model_evicts_least_recent_blocks_at_capacity() {
    let mut lru = Lru::new(3);
    for k in [1, 2, 3] {
        lru.touch(k);
    }
    lru.touch(1);
    assert_eq!(lru.touch(4), 1);
    assert!(lru.contains(&1) && !lru.contains(&2) && lru.contains(&4));
}
