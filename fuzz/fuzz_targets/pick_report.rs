//! The sidecar's side of the wire: arbitrary bytes decoded as Pick and
//! Outcome messages and fed to the routing core, as the gRPC service does:
//! never a panic, and in-flight counts never underflow.
#![no_main]

use kvmesh_core::{Outcome, PickInput, Router, RouterConfig};
use kvmesh_proto::v1;
use libfuzzer_sys::fuzz_target;
use prost::Message;

fuzz_target!(|data: &[u8]| {
    let mut router = Router::new(
        RouterConfig {
            worker_capacity_blocks: 64,
            max_pending_picks: 8,
            max_sessions: 8,
            ..RouterConfig::default()
        },
        ["10.0.0.1:1".to_owned(), "10.0.0.2:1".to_owned()],
    );
    // Messages are length-prefixed by one byte in the input.
    let mut rest = data;
    let mut now = 0;
    while let Some((&len, tail)) = rest.split_first() {
        let len = usize::from(len).min(tail.len());
        let (message, next) = tail.split_at(len);
        rest = next;
        now += 1_000;
        if let Ok(pick) = v1::PickRequest::decode(message) {
            let decision = router.pick(PickInput {
                block_hashes: &pick.block_hashes,
                last_block_partial: pick.last_block_partial,
                block_bytes: pick.block_bytes,
                prompt_bytes: pick.prompt_bytes,
                session_id: &pick.session_id,
                agent_id: &pick.agent_id,
                parent_id: &pick.parent_id,
                model: &pick.model,
                session_final: pick.session_final,
                now_ms: now,
            });
            assert!(decision.ranked.len() <= 3);
        }
        if let Ok(outcome) = v1::Outcome::decode(message) {
            router.report(Outcome {
                pick_id: outcome.pick_id,
                prompt_tokens: outcome.prompt_tokens,
                cached_tokens: outcome.cached_tokens,
                ttfb_ms: outcome.ttfb_ms,
            });
        }
    }
    assert!(router.workers().iter().all(|w| w.in_flight <= 8));
});
