//! The KV event decoder on arbitrary messages: the input is split into
//! frames as the fixtures store them (each a 4-byte big-endian length and
//! its bytes; a length past the end takes what is left), so the seeds are
//! real vLLM messages. Never a panic; a decoded batch keeps every bound;
//! decoding is deterministic; following the batch keeps the resident set
//! within its bound and counts no more stored blocks than the batch names.
#![no_main]

use kvmesh_sidecar::kv_events::{EngineCache, Event, MAX_EVENTS, MAX_HASHES, decode};
use libfuzzer_sys::fuzz_target;

fn frames(mut data: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    while let Some((len, rest)) = data.split_first_chunk::<4>() {
        let len = (u32::from_be_bytes(*len) as usize).min(rest.len());
        out.push(&rest[..len]);
        data = &rest[len..];
    }
    out
}

fuzz_target!(|data: &[u8]| {
    let frames = frames(data);
    let Ok(batch) = decode(&frames) else { return };
    assert!(batch.events.len() <= MAX_EVENTS);
    let mut named = 0u64;
    for event in &batch.events {
        match event {
            Event::BlockStored { hashes, .. } => {
                assert!(hashes.len() <= MAX_HASHES);
                named += hashes.len() as u64;
            }
            Event::BlockRemoved { hashes, .. } => assert!(hashes.len() <= MAX_HASHES),
            Event::AllBlocksCleared => {}
        }
    }
    assert_eq!(decode(&frames).ok().as_ref().map(|b| &b.events), Some(&batch.events));
    let mut cache = EngineCache::new();
    let applied = cache.apply(&batch);
    assert!(applied.stored_blocks <= named);
    assert!(cache.resident_blocks() <= named);
    // The same message again is a gap (the sequence went back), never a panic.
    let again = cache.apply(&batch);
    assert!(again.gap.is_some());
});
