//! Pick latency of the routing core for agent-sized requests.

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use kvmesh_core::{Outcome, PickInput, Router, RouterConfig};

fn bench_pick(c: &mut Criterion) {
    let mut group = c.benchmark_group("pick");
    for blocks in [40u64, 400, 1600, 4000] {
        let mut router = Router::new(RouterConfig::default(), (0..8).map(|i| format!("10.0.0.{i}:8000")));
        // Eight workers, each holding other sessions' prefixes.
        for s in 0..64u64 {
            let hashes: Vec<u64> = (0..blocks).map(|i| (s << 32) | i).collect();
            let d = router.pick(PickInput {
                block_hashes: &hashes,
                last_block_partial: false,
                session_id: "",
            });
            router.report(Outcome { pick_id: d.pick_id });
        }
        let request: Vec<u64> = (0..blocks).map(|i| (7 << 32) | i).collect();
        group.bench_with_input(BenchmarkId::from_parameter(blocks), &request, |b, request| {
            b.iter(|| {
                let d = router.pick(PickInput {
                    block_hashes: request,
                    last_block_partial: false,
                    session_id: "s",
                });
                router.report(Outcome { pick_id: d.pick_id });
            });
        });
    }
    group.finish();
}

criterion_group!(benches, bench_pick);
criterion_main!(benches);
