//! The sidecar's side of the wire: arbitrary bytes decoded as Pick and
//! Outcome messages and fed to the routing core and the insight ledger, as
//! the gRPC service does: never a panic, and in-flight counts never underflow.
#![no_main]

use kvmesh_core::{Call, InsightConfig, Insights, Outcome, PromptSection, Router, RouterConfig};
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
    let mut insights = Insights::new(InsightConfig {
        max_sessions: 8,
        max_pending: 8,
        break_points: 4,
        tenant_labels: 2,
        buckets: 4,
        bucket_ms: 2_000,
        ..InsightConfig::default()
    });
    // Messages are length-prefixed by one byte in the input.
    let mut rest = data;
    let mut now = 0;
    while let Some((&len, tail)) = rest.split_first() {
        let len = usize::from(len).min(tail.len());
        let (message, next) = tail.split_at(len);
        rest = next;
        now += 1_000;
        if let Ok(pick) = v1::PickRequest::decode(message) {
            // The sidecar's own conversions, so the fuzzer checks the
            // program that runs.
            let input = kvmesh_sidecar::wire::pick_input(&pick, now);
            let sections: Vec<PromptSection> = pick.sections.iter().map(PromptSection::from).collect();
            let call = Call {
                input,
                harness: pick.harness(),
                tenant: &pick.tenant,
                sections: &sections,
            };
            // As the sidecar does it: the ledger's probe, the pick and its
            // answer, then the record applied without the router.
            let probe = insights.probe(&call);
            let decision = router.pick(input);
            assert!(decision.ranked.len() <= 3);
            let holdings = router.holdings(probe.as_slice());
            insights.on_pick(&call, &decision, &holdings);
        }
        if let Ok(outcome) = v1::Outcome::decode(message) {
            router.report(Outcome {
                pick_id: outcome.pick_id,
                prompt_tokens: outcome.prompt_tokens,
                cached_tokens: outcome.cached_tokens,
                ttfb_ms: outcome.ttfb_ms,
            });
            let served = router.worker_id(&outcome.destination);
            insights.on_outcome(
                outcome.pick_id,
                outcome.prompt_tokens,
                outcome.cached_tokens,
                served,
                now,
            );
        }
        let holdings = router.holdings(&insights.idle_probes());
        insights.tick(now, &holdings);
    }
    let report = insights.report(now, 60_000);
    assert!(report.rows.iter().all(|r| r.2.repeated_prefix_share() <= 1.0));
    assert!(router.workers().iter().all(|w| w.in_flight <= 8));
});
