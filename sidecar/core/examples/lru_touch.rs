//! The worst single touch of an `LruMap` holding 100,000 sessions keyed by
//! strings, as the sidecar's session table is: `cargo run --release -p
//! kvmesh-core --example lru_touch` (docs/benchmarks.md, "The sidecar at
//! fleet scale"). The queue's compaction used to run whole inside one touch.

use std::time::Instant;

use kvmesh_core::LruMap;

fn main() {
    let sessions = 100_000usize;
    let mut map: LruMap<String, u64> = LruMap::new(sessions * 2);
    let keys: Vec<String> = (0..sessions)
        .map(|i| format!("session-{i:08}-abcdefghijklmnop"))
        .collect();
    for key in &keys {
        map.insert(key.clone(), 0);
    }
    let mut took = Vec::new();
    let mut x = 12345u64;
    for i in 0..2_000_000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let key = &keys[(x % sessions as u64) as usize];
        let start = Instant::now();
        map.touch(key.as_str());
        // The first 400,000 touches grow the queue to its steady size.
        if i >= 400_000 {
            took.push(start.elapsed().as_nanos() as u64);
        }
    }
    took.sort_unstable();
    let at = |p: f64| took[((took.len() - 1) as f64 * p) as usize];
    println!(
        "touch of 1 of {sessions} sessions, {} touches: median {} ns, p99 {} ns, p99.99 {} ns, max {} us",
        took.len(),
        at(0.5),
        at(0.99),
        at(0.9999),
        at(1.0) / 1000
    );
}
