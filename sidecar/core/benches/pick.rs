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
//! comparison with the session's previous call and its new trace).

use std::time::{Duration, Instant};

use kvmesh_core::{Call, InsightConfig, Insights, Outcome, PickInput, Router, RouterConfig};

/// splitmix64: a fixed, seeded stream of hashes.
fn hash(seed: u64) -> u64 {
    let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

const SESSION_BLOCKS: u64 = 8000;
/// Blocks an agent's next call adds to its cached prefix.
const NEW_BLOCKS: u64 = 20;

fn session_blocks(session: u64, n: u64) -> Vec<u64> {
    (0..n).map(|i| hash(session * 1_000_003 + i)).collect()
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p) as usize].as_secs_f64() * 1e6
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let entry_counts: &[u64] = if quick { &[100_000] } else { &[1_000_000, 10_000_000] };
    println!(
        "| indexed entries | workers | request blocks | median | p99 | bytes per entry | insights median | insights p99 |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for &entries in entry_counts {
        for workers in [8usize, 64, 512] {
            let sessions = entries / SESSION_BLOCKS;
            let capacity = (entries as usize / workers) * 2;
            let mut router = Router::new(
                RouterConfig {
                    worker_capacity_blocks: capacity,
                    max_sessions: 1_000_000,
                    ..RouterConfig::default()
                },
                (0..workers).map(|w| format!("10.{}.{}.{}:8000", w / 65536, (w / 256) % 256, w % 256)),
            );
            let addresses: Vec<String> = (0..workers)
                .map(|w| format!("10.{}.{}.{}:8000", w / 65536, (w / 256) % 256, w % 256))
                .collect();
            for s in 0..sessions {
                let blocks = session_blocks(s, SESSION_BLOCKS);
                router.observe_placement(&addresses[(s as usize) % workers], &blocks, &format!("s{s}"), 0);
            }
            let index = router.index();
            let bytes_per_entry = index.memory_bytes() as f64 / index.entries().max(1) as f64;
            for request_blocks in [100u64, 1600, 8000] {
                let mut took = Vec::with_capacity(2000);
                let mut insight_took = Vec::with_capacity(2000);
                let mut insights = Insights::new(InsightConfig::default());
                for i in 0..2100u64 {
                    // A cached session's blocks, extended past them.
                    let s = hash(i) % sessions;
                    let cached = request_blocks.saturating_sub(NEW_BLOCKS).min(SESSION_BLOCKS);
                    let mut hashes = session_blocks(s, cached);
                    hashes.extend((cached..request_blocks).map(|j| hash(u64::MAX - i * 100_000 - j)));
                    let session = format!("s{s}");
                    let input = PickInput {
                        block_hashes: &hashes,
                        block_bytes: 256,
                        prompt_bytes: request_blocks * 256,
                        session_id: &session,
                        model: "m",
                        now_ms: i,
                        ..PickInput::default()
                    };
                    let started = Instant::now();
                    let d = router.pick(input);
                    let elapsed = started.elapsed();
                    let started = Instant::now();
                    insights.on_pick(
                        &Call {
                            pick_id: d.pick_id,
                            input,
                            harness: "claude_code",
                            tenant: "t",
                            sections: &[],
                            bytes_per_token: 4.0,
                        },
                        &router.placed(&d),
                        &router,
                    );
                    let insight_elapsed = started.elapsed();
                    router.report(Outcome {
                        pick_id: d.pick_id,
                        ..Outcome::default()
                    });
                    if i >= 100 {
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
        }
    }
}
