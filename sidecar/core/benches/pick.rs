//! Pick latency of the routing core at cluster scale, and memory per index
//! entry: `cargo bench -p kvmesh-core --bench pick` (results and goals in
//! docs/benchmarks.md).
//!
//! For each (indexed entries, workers) the index is filled with sessions of
//! 8,000 blocks spread over the workers; then picks are timed one by one
//! (single thread, so one core) for requests shaped like an agent's next
//! call: a cached session prefix plus 20 new blocks (a tool result). The
//! lookup walks every cached block; the pick then places the request
//! (re-touching its cached blocks, adding the new ones). Medians and p99
//! over 2,000 picks per size. Beside it, what the insight ledger adds to the
//! sidecar's handling of each Pick (`Insights::on_pick`: the prefix
//! comparison with the session's previous call and its new trace), which
//! runs after the router's lock is released.
//!
//! `--goal` times only the goal's points (1,600 blocks at 10M entries over
//! 64 and 512 workers), cheap enough to run after every core change;
//! `--only ENTRIES:WORKERS:BLOCKS --picks N` one point with N picks, for a
//! profiler (`valgrind --tool=callgrind`, see docs/benchmarks.md);
//! `--shared-prefix N` starts every session with the same N blocks, so all
//! workers hold them (the lookup follows each of them through the prefix).
//!
//! `--criterion` runs instead criterion's estimates of one Pick as the
//! sidecar handles it, with the ledger applied and without: `router_lock`
//! is what runs under the router's lock (`Router::pick` and the ledger's
//! one `holdings` answer), `with_ledger` adds the ledger's probe and
//! `on_pick` after it. `--quick` shrinks the index either way.

use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion};
use kvmesh_core::{Call, InsightConfig, Insights, Outcome, PickInput, Router, RouterConfig, splitmix64 as hash};

const SESSION_BLOCKS: u64 = 8000;
/// Blocks an agent's next call adds to its cached prefix.
const NEW_BLOCKS: u64 = 20;

/// Session `session`'s first `n` blocks: with `--shared-prefix N` the first
/// N are the same in every session (an agent fleet's common system prompt
/// and tool definitions), so every worker holds them.
fn session_blocks(session: u64, n: u64) -> Vec<u64> {
    let shared = shared_prefix();
    (0..n)
        .map(|i| {
            if i < shared {
                hash(u64::MAX / 2 + i)
            } else {
                hash(session * 1_000_003 + i)
            }
        })
        .collect()
}

/// `--shared-prefix N`: blocks every session starts with (0: none).
fn shared_prefix() -> u64 {
    static SHARED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *SHARED.get_or_init(|| {
        arg_after("--shared-prefix")
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or(0)
            .min(SESSION_BLOCKS)
    })
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p) as usize].as_secs_f64() * 1e6
}

/// A router of `workers` filled with `entries` blocks in sessions.
fn filled_router(entries: u64, workers: usize) -> (Router, u64) {
    let sessions = entries / SESSION_BLOCKS;
    let capacity = (entries as usize / workers) * 2;
    let addresses: Vec<String> = (0..workers)
        .map(|w| format!("10.{}.{}.{}:8000", w / 65536, (w / 256) % 256, w % 256))
        .collect();
    let mut router = Router::new(
        RouterConfig {
            worker_capacity_blocks: capacity,
            max_sessions: 1_000_000,
            ..RouterConfig::default()
        },
        addresses.iter().cloned(),
    );
    for s in 0..sessions {
        let blocks = session_blocks(s, SESSION_BLOCKS);
        router.observe_placement(&addresses[(s as usize) % workers], &blocks, &format!("s{s}"), 0);
    }
    (router, sessions)
}

/// The i-th request: a cached session's blocks, extended past them.
fn request(i: u64, sessions: u64, request_blocks: u64) -> (Vec<u64>, String) {
    let s = hash(i) % sessions;
    let cached = request_blocks.saturating_sub(NEW_BLOCKS).min(SESSION_BLOCKS);
    let mut hashes = session_blocks(s, cached);
    hashes.extend((cached..request_blocks).map(|j| hash(u64::MAX - i * 100_000 - j)));
    (hashes, format!("s{s}"))
}

/// The i-th call of an agent's session, as the filter would describe it.
fn agent_call<'a>(hashes: &'a [u64], session: &'a str, i: u64) -> Call<'a> {
    Call {
        input: PickInput {
            block_hashes: hashes,
            block_bytes: 256,
            prompt_bytes: hashes.len() as u64 * 256,
            session_id: session,
            model: "m",
            now_ms: i,
            ..PickInput::default()
        },
        harness: kvmesh_core::Harness::ClaudeCode,
        tenant: "t",
        sections: &[],
    }
}

/// One Pick as the sidecar handles it: the ledger's probe, then under the
/// router's lock the pick and the probe's answer, then (with the ledger)
/// the record applied to the ledger.
fn sidecar_pick(router: &mut Router, insights: Option<&mut Insights>, hashes: &[u64], session: &str, i: u64) {
    let call = agent_call(hashes, session, i);
    let probe = insights.as_ref().and_then(|l| l.probe(&call));
    let d = router.pick(call.input);
    let holdings = router.holdings(probe.as_slice());
    if let Some(insights) = insights {
        insights.on_pick(&call, &d, &holdings);
        insights.on_outcome(d.pick_id, None, None, d.chosen(), i);
    }
    router.report(Outcome {
        pick_id: d.pick_id,
        ..Outcome::default()
    });
}

/// Criterion's estimates, ledger on and off (see the module doc).
fn criterion_ledger(quick: bool) {
    let entries = if quick { 100_000 } else { 1_000_000 };
    let mut c = Criterion::default()
        .sample_size(30)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4));
    let mut group = c.benchmark_group("pick");
    for workers in [8usize, 64] {
        for request_blocks in [100u64, 1600] {
            let parameter = format!("{entries}x{workers}w/{request_blocks}b");
            for ledger in [false, true] {
                let (mut router, sessions) = filled_router(entries, workers);
                let mut insights = Insights::new(InsightConfig::default());
                let requests: Vec<(Vec<u64>, String)> =
                    (0..256).map(|i| request(i, sessions, request_blocks)).collect();
                let name = if ledger { "with_ledger" } else { "router_lock" };
                let mut i = 0u64;
                group.bench_function(BenchmarkId::new(name, &parameter), |b| {
                    b.iter(|| {
                        i += 1;
                        let (hashes, session) = &requests[(i % 256) as usize];
                        sidecar_pick(&mut router, ledger.then_some(&mut insights), hashes, session, i);
                    });
                });
            }
        }
    }
    group.finish();
}

/// The points the routing core is held to (docs/benchmarks.md): the
/// goal's 1,600 blocks over 64 workers at 10M entries, and the 512-worker
/// row beside it.
const GOAL_POINTS: [(u64, usize, u64); 2] = [(10_000_000, 64, 1600), (10_000_000, 512, 1600)];

/// Picks timed per row, after this many untimed ones.
const TIMED_PICKS: u64 = 2000;
const WARM_UP_PICKS: u64 = 100;

/// The value after `flag` on the command line.
fn arg_after(flag: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == flag)
        .and_then(|i| args.get(i + 1).cloned())
}

/// Times `picks` picks of `request_blocks` blocks on `router` and prints
/// the row (Pick median and p99, the ledger's beside it).
fn measure_row(router: &mut Router, sessions: u64, entries: u64, workers: usize, request_blocks: u64, picks: u64) {
    let index = router.index();
    let bytes_per_entry = index.memory_bytes() as f64 / index.entries().max(1) as f64;
    let mut took = Vec::with_capacity(picks as usize);
    let mut insight_took = Vec::with_capacity(picks as usize);
    let mut insights = Insights::new(InsightConfig::default());
    for i in 0..picks + WARM_UP_PICKS {
        let (hashes, session) = request(i, sessions, request_blocks);
        let call = agent_call(&hashes, &session, i);
        let started = Instant::now();
        let d = router.pick(call.input);
        let elapsed = started.elapsed();
        // As the sidecar does it: the probe and the record, with the
        // router's lock released (the probe's answer, one index lookup, is
        // left out of both figures).
        let started = Instant::now();
        let probe = insights.probe(&call);
        let insight_took_probe = started.elapsed();
        let holdings = router.holdings(probe.as_slice());
        let started = Instant::now();
        insights.on_pick(&call, &d, &holdings);
        let insight_elapsed = insight_took_probe + started.elapsed();
        router.report(Outcome {
            pick_id: d.pick_id,
            ..Outcome::default()
        });
        if i >= WARM_UP_PICKS {
            took.push(elapsed);
            insight_took.push(insight_elapsed);
        }
    }
    took.sort();
    insight_took.sort();
    println!(
        "| {entries} | {workers} | {request_blocks} | {:.1} µs | {:.1} µs | {bytes_per_entry:.1} | {:.1} µs | {:.1} µs |",
        percentile(&took, 0.5),
        percentile(&took, 0.99),
        percentile(&insight_took, 0.5),
        percentile(&insight_took, 0.99)
    );
}

/// `--goal`: only [`GOAL_POINTS`], each on a freshly filled router (the
/// regression guard after a core change). `--only ENTRIES:WORKERS:BLOCKS`:
/// one point (for a profiler). `--picks N`: N timed picks per row instead
/// of 2,000. Otherwise every point of the table, as docs/benchmarks.md
/// shows it (each router filled once, its three request sizes in turn).
fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    if std::env::args().any(|a| a == "--criterion") {
        criterion_ledger(quick);
        return;
    }
    let picks = arg_after("--picks")
        .and_then(|n| n.parse::<u64>().ok())
        .filter(|&n| n > 0)
        .unwrap_or(TIMED_PICKS);
    let only = arg_after("--only").and_then(|point| {
        let mut parts = point.split(':').map(str::parse::<u64>);
        match (parts.next(), parts.next(), parts.next()) {
            (Some(Ok(e)), Some(Ok(w)), Some(Ok(b))) => Some((e, w as usize, b)),
            _ => None,
        }
    });
    println!(
        "| indexed entries | workers | request blocks | median | p99 | bytes per entry | insights median | insights p99 |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let points: Vec<(u64, usize, u64)> = if let Some(point) = only {
        vec![point]
    } else if std::env::args().any(|a| a == "--goal") {
        GOAL_POINTS.to_vec()
    } else {
        let entry_counts: &[u64] = if quick { &[100_000] } else { &[1_000_000, 10_000_000] };
        let mut points = Vec::new();
        for &entries in entry_counts {
            for workers in [8usize, 64, 512] {
                for request_blocks in [100u64, 1600, 8000] {
                    points.push((entries, workers, request_blocks));
                }
            }
        }
        points
    };
    let mut filled: Option<((u64, usize), Router, u64)> = None;
    for (entries, workers, request_blocks) in points {
        if filled.as_ref().is_none_or(|(at, _, _)| *at != (entries, workers)) {
            // The previous router goes first (two at 10M entries hold
            // about 1 GB).
            drop(filled.take());
            let (router, sessions) = filled_router(entries, workers);
            filled = Some(((entries, workers), router, sessions));
        }
        if let Some((_, router, sessions)) = filled.as_mut() {
            measure_row(router, *sessions, entries, workers, request_blocks, picks);
        }
    }
}
