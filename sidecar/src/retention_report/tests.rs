//! The retention section on a simulated run: a real `Router` and ledger fed
//! a scripted run at known times, as the sidecar's Pick and Outcome feed
//! them, and every figure checked against one computed by hand here.

#![allow(clippy::unwrap_used, clippy::float_cmp)]

use kvmesh_core::{Call, Harness, InsightConfig, Insights, Outcome, PickInput, Router, RouterConfig, WorkerId};

use super::*;

/// One worker of 8 blocks; a block is 1000 bytes = 250 tokens at the
/// default 4 bytes per token; a token's KV is 10⁶ bytes, so a 4-block
/// session holds 1000 tokens = 1 GB. Prefill: the default 10 tokens per ms.
struct Run {
    router: Router,
    insights: Insights,
    next_pick: u64,
}

const BLOCK_BYTES: u32 = 1000;

impl Run {
    fn new() -> Self {
        let config = RouterConfig {
            worker_capacity_blocks: 8,
            ..RouterConfig::default()
        };
        let insights = Insights::new(InsightConfig {
            kv_bytes_per_token: 1e6,
            ..InsightConfig::default()
        });
        Self {
            router: Router::new(config, ["10.0.0.1:8000".to_owned()]),
            insights,
            next_pick: 0,
        }
    }

    /// A call of `session` with `blocks`, picked at `at_ms` and answered at
    /// `answered_ms` with the engine's (prompt, cached) usage, as
    /// `Shared::pick` and `Shared::report` apply them.
    fn call(
        &mut self,
        harness: Harness,
        session: &str,
        blocks: &[u64],
        at_ms: u64,
        answered_ms: u64,
        usage: (u64, u64),
    ) {
        let input = PickInput {
            block_hashes: blocks,
            block_bytes: BLOCK_BYTES,
            prompt_bytes: blocks.len() as u64 * u64::from(BLOCK_BYTES),
            session_id: session,
            harness,
            tenant: "acme",
            now_ms: at_ms,
            ..PickInput::default()
        };
        let call = Call {
            input,
            harness,
            tenant: "acme",
            sections: &[],
        };
        let probe = self.insights.probe(&call);
        let decision = self.router.pick(input);
        let holdings = self.router.holdings(probe.as_slice());
        self.insights.on_pick(&call, &decision, &holdings);
        self.next_pick = decision.pick_id;
        let outcome = Outcome {
            pick_id: decision.pick_id,
            prompt_tokens: Some(usage.0),
            cached_tokens: Some(usage.1),
            ttfb_ms: 0,
        };
        assert!(self.router.report_at(outcome, answered_ms));
        self.insights.on_outcome(
            decision.pick_id,
            Some(usage.0),
            Some(usage.1),
            Some(WorkerId(0)),
            answered_ms,
        );
    }

    /// The report as `/debug/report` builds it, read back as the report
    /// command reads it.
    fn report(&mut self, now_ms: u64, extra_kv_gb: f64) -> crate::report::AgentReport {
        let probes = self.insights.idle_probes();
        let holdings = self.router.holdings(&probes);
        self.insights.tick(now_ms, &holdings);
        let probes = self.insights.idle_probes();
        let fleet = FleetSnapshot::take(&self.router);
        let evicted = self
            .insights
            .evicted_idle_sessions(now_ms, &self.router.holdings(&probes));
        // The last tick's copy, which the admin edge reads, is the same list.
        let mut copied = self.insights.last_tick().evicted.clone();
        copied.sort_by(|a, b| {
            b.kv_bytes
                .total_cmp(&a.kv_bytes)
                .then_with(|| a.session.cmp(&b.session))
        });
        assert_eq!(copied, evicted);
        let report = self.insights.report(now_ms, 3_600_000);
        let section = sections(&report, &fleet, &evicted, extra_kv_gb);
        let json = serde_json::to_string(&crate::report::to_json(&report, section)).unwrap();
        serde_json::from_str(&json).unwrap()
    }
}

/// Four blocks of their own for each session: no prefix shared.
fn blocks(family: u64) -> Vec<u64> {
    (0..4).map(|i| (family << 32) | i).collect()
}

/// The run: A, B and C each send 1000 tokens; C's arrival evicts A (8
/// blocks fit); A comes back after 4.5 s and misses (and evicts B); C comes
/// back after 1.5 s and hits; D evicts A again. A Codex session sends
/// nothing and is given up on after 30 s; a second one's pick checks that.
fn simulated_run() -> Run {
    let mut run = Run::new();
    let cc = Harness::ClaudeCode;
    run.call(cc, "a", &blocks(1), 0, 1_000, (1000, 0));
    run.call(cc, "b", &blocks(2), 2_000, 3_000, (1000, 0));
    run.call(Harness::Codex, "g", &[], 2_500, 2_510, (0, 0));
    run.call(cc, "c", &blocks(3), 4_000, 5_000, (1000, 0));
    run.call(cc, "a", &blocks(1), 5_500, 6_000, (1000, 0));
    run.call(cc, "c", &blocks(3), 6_500, 7_000, (1000, 1000));
    run.call(cc, "d", &blocks(4), 7_500, 8_000, (1000, 0));
    run.call(Harness::Codex, "h", &[], 33_000, 33_010, (0, 0));
    run
}

fn harness<'a>(report: &'a crate::report::AgentReport, name: &str) -> &'a HarnessRetention {
    report
        .retention_by_harness
        .iter()
        .find(|r| r.harness == name)
        .unwrap_or_else(|| panic!("no {name} row in {:?}", report.retention_by_harness))
}

/// The buckets where sessions were counted gone: (lower bound, count).
fn gone_buckets(gaps: &GapDistribution) -> Vec<(u64, f64)> {
    gaps.buckets
        .iter()
        .filter(|b| b.gone > 0.0)
        .map(|b| (b.from_ms, b.gone))
        .collect()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

#[test]
fn the_return_gaps_are_the_runs_by_hand() {
    let report = simulated_run().report(33_000, 1.5);
    let claude = harness(&report, "claude_code");
    let g = &claude.return_gaps;
    // A came back 4.5 s after its answer: bucket [4 s, 8 s); C after 1.5 s:
    // [1 s, 2 s). B, answered at 3 s, was idle 30 s (the horizon: 2 × p99
    // is below its 30 s floor) when H's pick checked at 33 s: counted gone
    // in [16 s, 32 s). A (idle 27 s), C and D are not yet.
    let back: Vec<(u64, Option<u64>, f64)> = g
        .buckets
        .iter()
        .filter(|b| b.returns > 0.0)
        .map(|b| (b.from_ms, b.to_ms, b.returns))
        .collect();
    assert_eq!(back, [(1_000, Some(2_000), 1.0), (4_000, Some(8_000), 1.0)]);
    assert_eq!((g.returns, g.gone), (2.0, 1.0));
    assert_eq!(gone_buckets(g), [(16_000, 1.0)]);
    // Two returns: the median is the first (1 s to 2 s), p90 and p99 the
    // second; a quantile is its bucket's upper bound.
    assert_eq!((g.p50_ms, g.p90_ms, g.p99_ms), (Some(2_000), Some(8_000), Some(8_000)));
    assert_eq!(g.buckets.len(), GAP_BUCKETS);
    assert_eq!(g.buckets.last().map(|b| b.to_ms), Some(None), "the last bucket is open");
    // G answered at 2.51 s, counted gone at 33 s: idle 30.49 s, in [16 s, 32 s).
    let codex = harness(&report, "codex");
    assert_eq!(gone_buckets(&codex.return_gaps), [(16_000, 1.0)]);
    assert_eq!(codex.return_gaps.p50_ms, None, "no Codex session came back");
}

#[test]
fn the_hit_rate_and_the_extra_kv_estimate_are_the_runs_by_hand() {
    let report = simulated_run().report(33_000, 1.5);
    let claude = harness(&report, "claude_code");
    // Six calls of 1000 tokens; C's return was served from the cache.
    assert_eq!(
        (claude.reported_prompt_tokens, claude.reported_cached_tokens),
        (6000.0, 1000.0)
    );
    assert!(close(claude.hit_rate, 1.0 / 6.0));
    // Repeated: A's and C's returns, 2000 of 6000 tokens (a third); the
    // engines cached a sixth: 1000 tokens missed (A's return), computed at
    // 10 tokens per ms: 0.1 GPU-seconds.
    assert!(close(claude.missed_tokens, 1000.0), "{claude:?}");
    assert!(close(claude.missed_gpu_seconds, 0.1), "{claude:?}");
    // Lost KV now: A (idle since 6 s, evicted by D) and B (idle since 3 s,
    // evicted by A's return), 1 GB each; C and D are still held.
    assert_eq!(claude.evicted_idle_sessions, 2);
    assert!(close(claude.evicted_idle_kv_bytes, 2e9));
    // 1.5 GB more keeps A (most recently idle) and half of B. Both are
    // idle past every return gap seen, so each comes back with the same
    // chance, (0 + 1) / (0 + 1 + 1 gone): 1.5 of 2 GB.
    let e = &claude.extra_kv;
    assert_eq!(e.gb_per_worker, 1.5);
    assert!(close(e.kept_share.unwrap(), 0.75), "{e:?}");
    assert!(close(e.saved_gpu_seconds.unwrap(), 0.075), "{e:?}");
    assert!(close(e.hit_rate.unwrap(), 1750.0 / 6000.0), "{e:?}");

    // 0.5 GB keeps half of A only; 3 GB all of both.
    let half = simulated_run().report(33_000, 0.5);
    let e = &harness(&half, "claude_code").extra_kv;
    assert!(close(e.kept_share.unwrap(), 0.25), "{e:?}");
    let all = simulated_run().report(33_000, 3.0);
    let e = &harness(&all, "claude_code").extra_kv;
    assert!(close(e.kept_share.unwrap(), 1.0), "{e:?}");
    assert!(close(e.saved_gpu_seconds.unwrap(), 0.1), "{e:?}");
    // Codex computed nothing and lost nothing: nothing to save.
    let codex = harness(&report, "codex");
    assert_eq!(codex.extra_kv.kept_share, None);
    assert_eq!(codex.extra_kv.saved_gpu_seconds, Some(0.0));
}

#[test]
fn a_session_likely_gone_weighs_less_in_what_more_kv_keeps() {
    let s = |session: &str, harness: &'static str, idle_ms: u64| IdleSession {
        session: session.to_owned(),
        model: String::new(),
        harness,
        worker: WorkerId(0),
        kv_bytes: 1e9,
        idle_ms,
        recompute_ms: 0.0,
    };
    // Most recently idle first: 1 GB keeps "near" only; "far" is twice as
    // likely to come back, so the share kept is 1 / (1 + 2).
    let evicted = [s("far", "codex", 20_000), s("near", "codex", 1_000)];
    let p = |_: &str, idle: u64| if idle > 10_000 { 1.0 } else { 0.5 };
    let kept = kept_by_harness(&evicted, 1e9, p);
    let (k, all) = kept["codex"];
    assert!(close(k / all, 0.5 / 1.5), "{k} of {all}");
}

#[test]
fn managed_api_prices_are_the_runs_by_hand() {
    let report = simulated_run().report(33_000, 1.5);
    let prices = Prices {
        input: Some(3.0),
        cached_input: Some(0.3),
        output: Some(15.0),
    };
    let pricing = Pricing::of(&report.retention_by_harness, prices).unwrap();
    assert!(!pricing.output_tokens_tracked);
    let row = pricing.rows.iter().find(|r| r.harness == "claude_code").unwrap();
    // 6000 prompt tokens at $3/M; 5000 of them at $3 and 1000 cached at
    // $0.30; the cache saved 1000 × $2.70/M.
    assert!(close(row.without_cache_usd, 0.018));
    assert!(close(row.with_cache_usd.unwrap(), 0.0153));
    assert!(close(row.cache_saved_usd.unwrap(), 0.0027));
    assert!(
        pricing.rows.iter().all(|r| r.harness != "codex"),
        "no reported tokens, nothing to price"
    );
    // Without a cached price, only the uncached line.
    let input_only = Pricing::of(
        &report.retention_by_harness,
        Prices {
            input: Some(3.0),
            ..Prices::default()
        },
    )
    .unwrap();
    assert_eq!(input_only.rows[0].with_cache_usd, None);
    assert!(Pricing::of(&report.retention_by_harness, Prices::default()).is_none());
}

#[test]
fn the_text_report_shows_the_section() {
    let mut report = simulated_run().report(33_000, 1.5);
    let text = crate::report::render_text(&report);
    assert!(text.contains("retention by harness"), "{text}");
    assert!(text.contains("pass --price-input"), "{text}");
    let claude = text
        .lines()
        .find(|l| l.trim_start().starts_with("claude_code") && l.contains("16.7%"))
        .unwrap_or_else(|| panic!("{text}"));
    let cells: Vec<&str> = claude.split_whitespace().collect();
    // harness, returns, gone, p50, p90, p99 (each "<n s"), hit rate,
    // missed tokens, missed GPU-s, kept share, saved GPU-s, hit rate then.
    assert_eq!(
        cells,
        [
            "claude_code",
            "2",
            "1",
            "<2",
            "s",
            "<8",
            "s",
            "<8",
            "s",
            "16.7%",
            "1000",
            "0.10",
            "75.0%",
            "0.08",
            "29.2%"
        ],
        "{claude}"
    );
    assert!(text.contains("<2 s: 1 back | <8 s: 1 back"), "{text}");
    assert!(text.contains("<8 s: 1 back | <32 s: 1 gone"), "{text}");
    report.pricing = Pricing::of(
        &report.retention_by_harness,
        Prices {
            input: Some(3.0),
            cached_input: Some(0.3),
            output: Some(15.0),
        },
    );
    let text = crate::report::render_text(&report);
    assert!(text.contains("--price-output is not applied"), "{text}");
    assert!(
        text.contains("$0.0180") && text.contains("$0.0153") && text.contains("$0.0027"),
        "{text}"
    );
    // Typed both ways, pricing included.
    let back: crate::report::AgentReport = serde_json::from_str(&serde_json::to_string(&report).unwrap()).unwrap();
    assert_eq!(back.pricing, report.pricing);
    assert_eq!(back.retention_by_harness, report.retention_by_harness);
}
