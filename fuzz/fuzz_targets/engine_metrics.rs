//! The engine watcher's parser on arbitrary scraped bytes, read as the
//! watcher reads a body (lossy UTF-8): never a panic; every reading is a
//! number (no NaN, no infinity reaches the router); a snapshot compared with
//! itself is no restart; text of no known engine gives nothing but a start
//! time; and parsing is deterministic.
#![no_main]

use kvmesh_sidecar::engine_metrics::{EngineSnapshot, parse, restarted};
use libfuzzer_sys::fuzz_target;

fn readings(s: &EngineSnapshot) -> [Option<f64>; 7] {
    [
        s.running,
        s.waiting,
        s.kv_usage,
        s.prefix_queries_tokens,
        s.prefix_hits_tokens,
        s.prompt_tokens_total,
        s.process_start_time,
    ]
}

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let snapshot = parse(&text);
    for value in readings(&snapshot).into_iter().flatten() {
        assert!(value.is_finite(), "{value} in {snapshot:?}");
    }
    if snapshot.kind.is_none() {
        assert_eq!(
            snapshot,
            EngineSnapshot {
                process_start_time: snapshot.process_start_time,
                ..EngineSnapshot::default()
            }
        );
    }
    assert!(!restarted(&snapshot, &snapshot), "{snapshot:?}");
    assert_eq!(parse(&text), snapshot);
});
