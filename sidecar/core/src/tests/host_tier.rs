//! The host tier: blocks an engine offloaded to host memory are a partial
//! hit (`host_hit_credit` of a GPU one), the index follows the engine's
//! events tier by tier, and a tier costs no byte per entry. A kvmesh block
//! here is 256 bytes at 4 bytes per token: 64 tokens.

use crate::*;

const W: WorkerId = WorkerId(0);

fn router(workers: usize) -> Router {
    Router::new(
        RouterConfig::default(),
        (0..workers).map(|w| format!("10.0.0.{}:8000", w + 1)),
    )
}

fn input(hashes: &[u64]) -> PickInput<'_> {
    PickInput {
        block_hashes: hashes,
        block_bytes: 256,
        prompt_bytes: 256 * hashes.len() as u64,
        session_id: "s",
        model: "m",
        now_ms: 1_000,
        ..PickInput::default()
    }
}

#[test]
fn a_host_only_hit_saves_three_quarters_of_a_gpu_hit() {
    // 20 blocks of 64 tokens: 1,280 prompt tokens. Worker 0 holds them on
    // its GPU, worker 1 in host memory only, worker 2 not at all.
    let blocks: Vec<u64> = (1..=20).collect();
    let mut r = router(3);
    let d = r.pick_with_tier_overlaps(input(&blocks), &[(WorkerId(0), 20, 0), (WorkerId(1), 20, 20)]);
    let prefill: Vec<f64> = d.costs.iter().map(|c| c.map_or(-1.0, |c| c.prefill)).collect();
    // GPU: nothing to compute. Host: 1280 − 0.75 · 1280 = 320, a quarter
    // of what the GPU hit saves. Cold: all 1,280.
    assert_eq!(prefill, vec![0.0, 320.0, 1280.0]);
    assert_eq!(d.chosen(), Some(WorkerId(0)));
    assert_eq!(d.predicted_host_blocks, 0);

    // Without the GPU copy, the host hit still beats recomputing, and its
    // tokens are predicted cached: the engine reports loaded blocks as
    // cached (vLLM's `num_cached_tokens` counts the connector's tokens).
    let mut r = router(2);
    let d = r.pick_with_tier_overlaps(input(&blocks), &[(WorkerId(1), 20, 20)]);
    assert_eq!(d.chosen(), Some(WorkerId(1)));
    assert_eq!((d.predicted_cached_blocks, d.predicted_host_blocks), (20, 20));
    assert_eq!(d.predicted_cached_tokens, 1280);

    // A partly offloaded prefix: 12 GPU blocks and 8 host-only ones save
    // (12 + 0.75 · 8) · 64 = 1,152 tokens.
    let mut r = router(1);
    let d = r.pick_with_tier_overlaps(input(&blocks), &[(WorkerId(0), 20, 8)]);
    assert_eq!(d.cost.prefill, 128.0);
}

#[test]
fn the_credit_is_a_setting() {
    let blocks: Vec<u64> = (1..=20).collect();
    let mut r = Router::new(
        RouterConfig {
            host_hit_credit: 0.5,
            ..RouterConfig::default()
        },
        ["10.0.0.1:8000".to_owned()],
    );
    let d = r.pick_with_tier_overlaps(input(&blocks), &[(W, 20, 20)]);
    assert_eq!(d.cost.prefill, 640.0);
}

/// A router with 20 blocks placed on its one worker, oldest first.
fn placed() -> Router {
    let mut r = router(1);
    let blocks: Vec<u64> = (1..=20).collect();
    r.pick(input(&blocks));
    r
}

#[test]
fn removing_the_gpu_copy_leaves_the_host_one() {
    let mut r = placed();
    // The engine evicts 3 blocks of 128 tokens (6 of ours) from its GPU and
    // keeps their host copies (vLLM: BlockRemoved with medium GPU for
    // blocks stored with medium CPU).
    let change = EngineCacheChange {
        removed_blocks: 3,
        removed_to_host_blocks: 3,
        engine_block_tokens: 128,
        host_tier: true,
        ..EngineCacheChange::default()
    };
    let effect = r.engine_events(W, &change);
    assert_eq!((effect.evicted, effect.demoted, effect.host_evicted), (6, 6, 0));
    let view = &r.workers()[0];
    assert_eq!((view.cached_blocks, view.host_blocks), (14, 6));
    // The request still matches all 20 blocks, 6 of them in host memory:
    // its prefill is (20 − 14 − 0.75 · 6) · 64 = 96 tokens.
    let blocks: Vec<u64> = (1..=20).collect();
    let mut overlaps = Vec::new();
    let mut host = Vec::new();
    r.index()
        .clone()
        .overlaps_by_tier(&blocks, &mut overlaps, Some(&mut host));
    assert_eq!((overlaps[0], host[0]), (20, 6));

    // The engine drops one host-only block (2 of ours); then evicts 2 more
    // GPU blocks, one with a host copy and one without: 2 of ours move to
    // the host list, 2 are forgotten.
    let host_removal = EngineCacheChange {
        host_only_removed_blocks: 1,
        engine_block_tokens: 128,
        host_tier: true,
        ..EngineCacheChange::default()
    };
    assert_eq!(r.engine_events(W, &host_removal).host_evicted, 2);
    assert_eq!(r.workers()[0].host_blocks, 4);
    let mixed = EngineCacheChange {
        removed_blocks: 2,
        removed_to_host_blocks: 1,
        engine_block_tokens: 128,
        host_tier: true,
        ..EngineCacheChange::default()
    };
    let effect = r.engine_events(W, &mixed);
    assert_eq!((effect.evicted, effect.demoted), (4, 2));
    let view = &r.workers()[0];
    assert_eq!((view.cached_blocks, view.host_blocks), (10, 6));

    // A request placed there again finds its blocks back on the GPU.
    r.pick(input(&blocks));
    let view = &r.workers()[0];
    assert_eq!((view.cached_blocks, view.host_blocks), (20, 0));
}

#[test]
fn known_host_residency_holds_the_host_list() {
    let mut r = placed();
    let change = EngineCacheChange {
        removed_blocks: 5,
        removed_to_host_blocks: 5,
        engine_block_tokens: 128,
        host_tier: true,
        ..EngineCacheChange::default()
    };
    r.engine_events(W, &change);
    assert_eq!(r.workers()[0].host_blocks, 10);
    // The engine says it holds 2 host-only blocks of 128 tokens: 4 of ours.
    let known = EngineCacheChange {
        engine_block_tokens: 128,
        host_tier: true,
        host_only_blocks: Some(2),
        ..EngineCacheChange::default()
    };
    assert_eq!(r.engine_events(W, &known).host_evicted, 6);
    assert_eq!(r.workers()[0].host_blocks, 4);
    assert_eq!(r.workers()[0].engine_host_only_blocks, Some(2));
    // A clear empties both tiers.
    let cleared = EngineCacheChange {
        cleared: true,
        ..EngineCacheChange::default()
    };
    r.engine_events(W, &cleared);
    assert_eq!((r.workers()[0].cached_blocks, r.workers()[0].host_blocks), (0, 0));
}

#[test]
fn without_a_host_tier_gpu_evictions_forget() {
    let mut r = placed();
    let change = EngineCacheChange {
        removed_blocks: 3,
        removed_to_host_blocks: 3,
        engine_block_tokens: 128,
        ..EngineCacheChange::default()
    };
    let effect = r.engine_events(W, &change);
    assert_eq!((effect.evicted, effect.demoted), (6, 0));
    assert_eq!(r.workers()[0].host_blocks, 0);
}

#[test]
fn gpu_overflow_moves_to_the_host_tier_in_lru_order() {
    let mut index = PrefixIndex::new();
    let w = index.add_worker(4);
    index.set_host_capacity(w, 2);
    index.insert(w, &[1, 2, 3, 4]);
    // Newest first: 1, 2, 3, 4. Two more blocks push 4 then 3 out of the
    // GPU list, into the host list.
    index.insert(w, &[5, 6]);
    assert_eq!((index.len(w), index.host_len(w)), (4, 2));
    let (mut overlaps, mut host) = (Vec::new(), Vec::new());
    index.overlaps_by_tier(&[1, 2, 3, 4], &mut overlaps, Some(&mut host));
    assert_eq!((overlaps[0], host[0]), (4, 2));
    // One more: 2 leaves the GPU, and the host tier, full, forgets its
    // oldest (4).
    index.insert(w, &[7]);
    index.overlaps_by_tier(&[1, 2, 3, 4], &mut overlaps, Some(&mut host));
    assert_eq!((overlaps[0], host[0]), (3, 2));
    assert!(!index.contains(w, 4));
    assert_eq!(index.entries(), 6);
}

#[test]
fn a_tier_costs_no_byte_per_entry() {
    // 262,144 entries (four arena chunks): 131,072 blocks held by two
    // workers, half of one worker's in its host tier.
    let mut index = PrefixIndex::new();
    let a = index.add_worker(usize::MAX);
    let b = index.add_worker(usize::MAX);
    index.set_host_capacity(a, usize::MAX);
    for start in (0..131_072u64).step_by(64) {
        let blocks: Vec<u64> = (start..start + 64)
            .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
            .collect();
        index.insert(a, &blocks);
        index.insert(b, &blocks);
    }
    assert_eq!(index.demote_oldest(a, 65_536), 65_536);
    assert_eq!(
        (index.len(a), index.host_len(a), index.entries()),
        (65_536, 65_536, 262_144)
    );
    let per_entry = index.memory_bytes() as f64 / index.entries() as f64;
    assert!(per_entry <= 40.0, "{per_entry:.1} bytes per entry");
}
