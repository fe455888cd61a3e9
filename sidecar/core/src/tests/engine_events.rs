//! The engine's KV events drive the index: a clear wipes the worker (but
//! for the blocks stored after it in the same batch), a
//! removal evicts its oldest blocks in step, converted from engine tokens
//! to kvmesh blocks. Before any Pick a kvmesh block is 256 bytes at 4 bytes
//! per token: 64 engine tokens, so one 128-token engine block is 2 of them.

use crate::*;

const W: WorkerId = WorkerId(0);

/// A router with `n` blocks placed on its one worker, oldest first.
fn placed(n: u64) -> Router {
    let mut r = Router::new(RouterConfig::default(), ["10.0.0.1:8000".to_owned()]);
    let blocks: Vec<u64> = (1..=n).collect();
    r.pick(PickInput {
        block_hashes: &blocks,
        block_bytes: 256,
        prompt_bytes: 256 * n,
        session_id: "s",
        model: "m",
        now_ms: 1_000,
        ..PickInput::default()
    });
    assert_eq!(r.workers()[0].cached_blocks, n as usize);
    r
}

fn removed(blocks: u64, engine_block_tokens: u32, resident: Option<u64>) -> EngineCacheChange {
    EngineCacheChange {
        removed_blocks: blocks,
        engine_block_tokens,
        resident_blocks: resident,
        ..EngineCacheChange::default()
    }
}

#[test]
fn a_removal_evicts_the_oldest_blocks_converted_to_kvmesh_blocks() {
    let mut r = placed(20);
    // 3 engine blocks of 128 tokens = 384 tokens = 6 blocks of 64.
    let effect = r.engine_events(W, &removed(3, 128, None));
    assert_eq!(
        effect,
        EngineCacheEffect {
            wiped: 0,
            evicted: 6,
            ..EngineCacheEffect::default()
        }
    );
    assert_eq!(r.workers()[0].cached_blocks, 14);
    // A request's blocks are touched last to first, so its tail is the
    // oldest: blocks 15..=20 went, the prompt's start stays.
    let mut left = r.index().blocks_oldest_first(W);
    left.sort_unstable();
    assert_eq!(left, (1..=14).collect::<Vec<u64>>());
    assert_eq!(r.workers()[0].engine_block_tokens, Some(128));
}

#[test]
fn removals_never_take_the_index_below_the_engines_resident_blocks() {
    let mut r = placed(20);
    // The engine holds 5 blocks of 128 (10 of ours) after removing 8 (16 of
    // ours due): 20 - 10 = 10 go, not 16.
    assert_eq!(r.engine_events(W, &removed(8, 128, Some(5))).evicted, 10);
    assert_eq!(r.workers()[0].cached_blocks, 10);
    assert_eq!(r.workers()[0].engine_resident_blocks, Some(5));
    // At the floor already: a further removal evicts nothing.
    assert_eq!(r.engine_events(W, &removed(2, 128, Some(5))).evicted, 0);
    assert_eq!(r.workers()[0].cached_blocks, 10);
}

#[test]
fn an_evicting_engine_holds_the_index_to_its_resident_blocks() {
    // One removal is 2 of our blocks due, but the engine, full, holds 4 of
    // 128 tokens (8 of ours): the index had placed more than that (a
    // prompt's partial tail, which the engine never caches), and goes to 8.
    let mut r = placed(20);
    assert_eq!(r.engine_events(W, &removed(1, 128, Some(4))).evicted, 12);
    assert_eq!(r.workers()[0].cached_blocks, 8);
    // Stores alone (the engine not evicting) evict nothing, even above it.
    let mut r = placed(20);
    let stored = EngineCacheChange {
        stored_blocks: 2,
        engine_block_tokens: 128,
        resident_blocks: Some(4),
        ..EngineCacheChange::default()
    };
    assert_eq!(r.engine_events(W, &stored).evicted, 0);
}

#[test]
fn fractions_of_a_block_carry_to_the_next_batch() {
    let mut r = placed(20);
    // 96-token engine blocks: 1.5 of ours each.
    assert_eq!(r.engine_events(W, &removed(1, 96, None)).evicted, 1);
    assert_eq!(r.engine_events(W, &removed(1, 96, None)).evicted, 2);
    assert_eq!(r.engine_events(W, &removed(1, 96, None)).evicted, 1);
    assert_eq!(r.workers()[0].cached_blocks, 16);
    // No block size known yet: nothing to convert with, nothing evicted.
    let mut fresh = placed(4);
    assert_eq!(fresh.engine_events(W, &removed(1, 0, None)).evicted, 0);
}

#[test]
fn a_clear_alone_wipes_the_worker_as_a_restart_does() {
    let mut r = placed(20);
    let change = EngineCacheChange {
        cleared: true,
        engine_block_tokens: 128,
        resident_blocks: Some(0),
        ..EngineCacheChange::default()
    };
    assert_eq!(
        r.engine_events(W, &change),
        EngineCacheEffect {
            wiped: 20,
            ..EngineCacheEffect::default()
        }
    );
    let view = &r.workers()[0];
    assert_eq!(view.cached_blocks, 0);
    assert_eq!(view.engine_resident_blocks, Some(0));
    // An unknown worker is ignored.
    assert_eq!(r.engine_events(WorkerId(7), &change), EngineCacheEffect::default());
}

/// vLLM publishes a reset with its next step's events, which store the
/// blocks of the first request after the reset: kvmesh placed that request
/// before the clear reached it, and keeps its blocks, so the session's next
/// call finds them; what was placed before the reset goes.
#[test]
fn a_clear_keeps_the_blocks_stored_after_it_in_the_same_batch() {
    let mut r = placed(20);
    let pick = |r: &mut Router, blocks: &[u64], now_ms| {
        r.pick(PickInput {
            block_hashes: blocks,
            block_bytes: 256,
            prompt_bytes: 256 * blocks.len() as u64,
            session_id: "after",
            model: "m",
            now_ms,
            ..PickInput::default()
        })
    };
    let after: Vec<u64> = (101..=110).collect();
    pick(&mut r, &after, 2_000);
    assert_eq!(r.workers()[0].cached_blocks, 30);
    // 5 engine blocks of 128 tokens stored since the clear: 10 of ours.
    let change = EngineCacheChange {
        cleared: true,
        stored_blocks: 5,
        engine_block_tokens: 128,
        resident_blocks: Some(5),
        ..EngineCacheChange::default()
    };
    assert_eq!(r.engine_events(W, &change).wiped, 20);
    let mut left = r.index().blocks_oldest_first(W);
    left.sort_unstable();
    assert_eq!(left, after);
    let next: Vec<u64> = (101..=112).collect();
    let d = pick(&mut r, &next, 3_000);
    assert_eq!(d.predicted_cached_blocks, 10);
    // A reset whose first step was a request kvmesh did not place (straight
    // to the engine): every block kvmesh placed before it goes, though the
    // batch stored as many, since they were placed before the previous
    // batch.
    let quiet = EngineCacheChange {
        stored_blocks: 1,
        engine_block_tokens: 128,
        resident_blocks: Some(6),
        ..EngineCacheChange::default()
    };
    r.engine_events(W, &quiet);
    assert_eq!(r.engine_events(W, &change).wiped, 12);
    assert_eq!(r.workers()[0].cached_blocks, 0);
}
