//! An engine's KV capacity in tokens becomes kvmesh blocks at the block size
//! the Picks carry and the bytes per token learned for their model, never at
//! an assumed 256 bytes or 4 bytes per token.

use crate::*;

const ENGINE_TOKENS: u64 = 64_000;

fn capacity(r: &Router) -> usize {
    r.workers()[0].capacity_blocks
}

fn pick(r: &mut Router, block_bytes: u32, now_ms: u64) -> Decision {
    r.pick(PickInput {
        block_hashes: &[1, 2, 3, 4],
        block_bytes,
        prompt_bytes: 4 * u64::from(block_bytes),
        session_id: "s",
        model: "m",
        now_ms,
        ..PickInput::default()
    })
}

#[test]
fn capacity_follows_the_picks_block_size_and_the_learned_bytes_per_token() {
    let mut r = Router::new(RouterConfig::default(), ["10.0.0.1:8000".to_owned()]);
    r.set_engine_capacity_tokens(WorkerId(0), ENGINE_TOKENS);
    // Before any Pick: the default block size and bytes per token.
    assert_eq!(capacity(&r), 64_000 / (256 / 4));

    // Picks cut at 512 bytes: each block holds twice the tokens.
    let d = pick(&mut r, 512, 1_000);
    assert_eq!(capacity(&r), 64_000 / (512 / 4));

    // The engine says the prompt of 2,048 bytes was 1,024 tokens: the
    // learned bytes per token moves from 4 towards 2, and the capacity with it.
    assert!(r.report(Outcome {
        pick_id: d.pick_id,
        prompt_tokens: Some(1_024),
        cached_tokens: Some(0),
        ttfb_ms: 10,
    }));
    let bytes_per_token = r.bytes_per_token("m");
    assert!(bytes_per_token < 4.0 * 0.98, "{bytes_per_token}");
    let expected = (ENGINE_TOKENS as f64 / (512.0 / bytes_per_token)) as usize;
    assert_eq!(capacity(&r), expected);

    // The same figure scraped again changes nothing.
    r.set_engine_capacity_tokens(WorkerId(0), ENGINE_TOKENS);
    assert_eq!(capacity(&r), expected);
}

#[test]
fn a_restart_forgets_the_closed_loops_corrections_to_capacity() {
    let mut r = Router::new(RouterConfig::default(), ["10.0.0.1:8000".to_owned()]);
    r.set_engine_capacity_tokens(WorkerId(0), ENGINE_TOKENS);
    let ceiling = capacity(&r);
    // The session's second call is predicted to hit its 4 blocks, and the
    // engine reports none cached: the router shrinks its estimate.
    let first = pick(&mut r, 256, 1_000);
    r.report(Outcome {
        pick_id: first.pick_id,
        prompt_tokens: Some(256),
        cached_tokens: Some(0),
        ttfb_ms: 10,
    });
    let second = pick(&mut r, 256, 2_000);
    assert_eq!(second.predicted_cached_blocks, 4);
    r.report(Outcome {
        pick_id: second.pick_id,
        prompt_tokens: Some(256),
        cached_tokens: Some(0),
        ttfb_ms: 10,
    });
    assert!(capacity(&r) < ceiling, "no correction: {}", capacity(&r));
    // The engine restarted: its cache is new, the estimate starts over.
    assert!(r.restart(WorkerId(0)) >= 1);
    assert_eq!(capacity(&r), ceiling);
    assert_eq!(r.workers()[0].cached_blocks, 0);
}

#[test]
fn the_engines_own_figures_are_shown_as_it_reports_them() {
    let mut r = Router::new(RouterConfig::default(), ["10.0.0.1:8000".to_owned()]);
    r.set_engine_waiting(WorkerId(0), 3.0);
    r.set_engine_activity(WorkerId(0), Some(2.0), Some(1.7));
    let w = &r.workers()[0];
    assert_eq!(
        (w.engine_waiting, w.engine_running, w.engine_kv_usage),
        (3.0, Some(2.0), Some(1.0))
    );
}

#[test]
fn predicted_cached_tokens_come_in_whole_engine_blocks_once_the_block_size_is_known() {
    let mut r = Router::new(RouterConfig::default(), ["10.0.0.1:8000".to_owned()]);
    let first = pick(&mut r, 256, 1_000);
    assert_eq!(first.predicted_cached_tokens, 0);
    // 4 blocks of 256 bytes at the default 4 bytes per token, and half the
    // next block on average: 288 tokens, capped at the 256-token prompt.
    let second = pick(&mut r, 256, 2_000);
    assert_eq!(second.predicted_cached_blocks, 4);
    assert_eq!(second.predicted_cached_tokens, 256);

    // An engine caching 100-token blocks holds only 2 whole ones of them.
    r.set_engine_block_tokens(WorkerId(0), 100);
    let third = pick(&mut r, 256, 3_000);
    assert_eq!((third.predicted_cached_blocks, third.predicted_cached_tokens), (4, 200));

    // Blocks larger than the match: nothing will be reported cached.
    r.set_engine_block_tokens(WorkerId(0), 300);
    assert_eq!(pick(&mut r, 256, 4_000).predicted_cached_tokens, 0);

    // A figure no engine has is ignored, not a division by zero.
    r.set_engine_block_tokens(WorkerId(0), 0);
    r.set_engine_block_tokens(WorkerId(0), u64::MAX);
    assert_eq!(pick(&mut r, 256, 5_000).predicted_cached_tokens, 0);
}

#[test]
fn the_workers_page_shows_the_queue_drained_to_the_moment_it_is_read() {
    let mut r = Router::new(
        RouterConfig {
            default_prefill_tokens_per_ms: 10.0,
            ..RouterConfig::default()
        },
        ["10.0.0.1:8000".to_owned()],
    );
    // 4 blocks of 256 bytes at 4 bytes per token: 256 tokens to prefill.
    pick(&mut r, 256, 1_000);
    assert_eq!(r.workers_at(1_000)[0].queued_prefill_tokens, 256.0);
    // No Pick since: 10 ms later at 10 tokens per ms, 100 tokens are done.
    assert_eq!(r.workers_at(1_010)[0].queued_prefill_tokens, 156.0);
    assert_eq!(r.workers_at(1_100)[0].queued_prefill_tokens, 0.0);
    // Reading is not draining: the state is untouched until the next Pick.
    assert_eq!(r.workers()[0].queued_prefill_tokens, 256.0);
}

#[test]
fn a_predicted_match_reaches_half_way_into_the_block_after_the_last_one_matched() {
    let mut r = Router::new(RouterConfig::default(), ["10.0.0.1:8000".to_owned()]);
    let longer = |r: &mut Router, now_ms| {
        r.pick(PickInput {
            block_hashes: &[1, 2, 3, 4, 5, 6, 7, 8],
            block_bytes: 256,
            prompt_bytes: 8 * 256 + 100,
            session_id: "s",
            model: "m",
            now_ms,
            ..PickInput::default()
        })
    };
    pick(&mut r, 256, 1_000);
    // 4 of 8 blocks held, 64 tokens each: the prefix ends in the fifth.
    let d = longer(&mut r, 2_000);
    assert_eq!((d.predicted_cached_blocks, d.predicted_cached_tokens), (4, 288));
    // In whole engine blocks of 96 tokens: 3 of them.
    r.set_engine_block_tokens(WorkerId(0), 96);
    let d = longer(&mut r, 3_000);
    assert_eq!((d.predicted_cached_blocks, d.predicted_cached_tokens), (8, 480));
}
