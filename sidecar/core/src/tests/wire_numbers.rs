//! The core fed the largest numbers the wire can carry: no overflow panic,
//! no load beyond the largest prompt, no learning from implausible usage,
//! and per-model state bounded.

use kvmesh_vocab::limits::MAX_PROMPT_TOKENS;

use crate::*;

fn router() -> Router {
    Router::new(
        RouterConfig {
            max_models: 8,
            ..RouterConfig::default()
        },
        (0..2).map(|i| format!("10.0.0.{i}:8000")),
    )
}

#[test]
fn a_pick_claiming_u64_max_bytes_queues_no_more_than_the_largest_prompt() {
    let mut r = router();
    let mut insights = Insights::new(InsightConfig::default());
    for n in 0..3 {
        let input = PickInput {
            block_hashes: &[1, 2],
            block_bytes: 0,
            prompt_bytes: u64::MAX,
            session_id: "s",
            model: "m",
            now_ms: n,
            ..PickInput::default()
        };
        let call = Call {
            input,
            harness: Harness::Other,
            tenant: "",
            sections: &[],
        };
        let probe = insights.probe(&call);
        let d = r.pick(input);
        let holdings = r.holdings(probe.as_slice());
        insights.on_pick(&call, &d, &holdings);
    }
    for w in r.workers() {
        assert!(w.queued_prefill_tokens <= 3.0 * MAX_PROMPT_TOKENS as f64, "{w:?}");
        assert!(w.active_kv_tokens <= 3.0 * MAX_PROMPT_TOKENS as f64, "{w:?}");
    }
    let (_, totals) = insights.totals().next().unwrap();
    assert_eq!(totals.prompt_bytes, u64::MAX, "saturates, never wraps");
}

#[test]
fn implausible_usage_teaches_nothing() {
    let mut r = router();
    let input = PickInput {
        block_hashes: &[1, 2, 3, 4],
        block_bytes: 256,
        prompt_bytes: 1024,
        session_id: "s",
        model: "m",
        ..PickInput::default()
    };
    let d = r.pick(input);
    let outcome = Outcome {
        pick_id: d.pick_id,
        prompt_tokens: Some(u64::MAX),
        cached_tokens: Some(u64::MAX),
        ttfb_ms: 1,
    };
    assert!(r.check_usage(&outcome).is_err());
    assert!(r.report(outcome), "the pick is still released");
    assert_eq!(r.models(), 0);
    let capacity = r.workers()[d.ranked[0].0].capacity_blocks;
    assert_eq!(capacity, RouterConfig::default().worker_capacity_blocks);

    // A truncated pick's usage may exceed its bytes; a whole one's may not.
    let d = r.pick(PickInput {
        truncated: true,
        ..input
    });
    let beyond = Outcome {
        pick_id: d.pick_id,
        prompt_tokens: Some(1024 + TEMPLATE_TOKENS + 1),
        ..Outcome::default()
    };
    assert_eq!(r.check_usage(&beyond), Ok(()));
    let d = r.pick(input);
    assert!(
        r.check_usage(&Outcome {
            pick_id: d.pick_id,
            ..beyond
        })
        .is_err()
    );
}

#[test]
fn learned_models_stay_within_max_models() {
    let mut r = router();
    for i in 0..100u64 {
        let model = format!("model-{i}");
        let d = r.pick(PickInput {
            block_hashes: &[i],
            block_bytes: 256,
            prompt_bytes: 256,
            model: &model,
            now_ms: i,
            ..PickInput::default()
        });
        r.report(Outcome {
            pick_id: d.pick_id,
            prompt_tokens: Some(64),
            ..Outcome::default()
        });
    }
    assert_eq!(r.models(), 8);
}

#[test]
fn session_traces_stay_within_their_byte_budget() {
    let mut insights = Insights::new(InsightConfig {
        trace_budget_bytes: 4 << 20,
        ..InsightConfig::default()
    });
    // Sessions at the wire's block cap: 512 KiB of hashes each.
    let blocks: Vec<u64> = (0..kvmesh_vocab::limits::MAX_BLOCKS as u64).collect();
    for i in 0..64u64 {
        let session = format!("s{i}");
        insights.on_pick(
            &Call {
                input: PickInput {
                    block_hashes: &blocks,
                    block_bytes: 256,
                    prompt_bytes: blocks.len() as u64 * 256,
                    session_id: &session,
                    model: "m",
                    now_ms: i,
                    ..PickInput::default()
                },
                harness: Harness::Other,
                tenant: "",
                sections: &[],
            },
            &Decision {
                pick_id: i + 1,
                bytes_per_token: 4.0,
                prefill_tokens_per_ms: 10.0,
                ..Decision::default()
            },
            &Holdings::default(),
        );
        assert!(insights.trace_memory_bytes() <= 4 << 20);
    }
    assert!((6..=8).contains(&insights.sessions()), "{}", insights.sessions());
}
