//! The insight ledger as a consumer of pick records: hand-computed figures
//! for scripted sessions, break points, move reasons, label budgets and
//! report windows.

#![allow(clippy::unwrap_used, clippy::float_cmp)]

use crate::*;

/// A fleet as a test states it.
#[derive(Default)]
struct Fleet {
    gone: Vec<WorkerId>,
    overlaps: Vec<usize>,
    evicted: bool,
}

impl Fleet {
    /// The record of a pick of `worker` in this fleet.
    fn decision(&self, pick_id: u64, (worker, predicted, reachable): (usize, usize, usize)) -> Decision {
        Decision {
            pick_id,
            ranked: vec![WorkerId(worker)],
            predicted_cached_blocks: predicted as u32,
            predicted_cached_tokens: predicted as u64 * 64,
            best_overlap: reachable as u32,
            overlaps: self.overlaps.clone(),
            costs: (0..4)
                .map(|w| (!self.gone.contains(&WorkerId(w))).then(Cost::default))
                .collect(),
            bytes_per_token: 4.0,
            prefill_tokens_per_ms: 10.0,
            ..Decision::default()
        }
    }

    fn holdings(&self, probes: impl IntoIterator<Item = (WorkerId, u64)>) -> Holdings {
        Holdings::new(
            probes
                .into_iter()
                .map(|p| (p, !self.gone.contains(&p.0) && !self.evicted)),
        )
    }
}

/// A pick as the sidecar applies it: the ledger's probe answered by the
/// fleet, then the record.
fn on_pick(insights: &mut Insights, (pick_id, call): &(u64, Call<'_>), placed: (usize, usize, usize), fleet: &Fleet) {
    let holdings = fleet.holdings(insights.probe(call));
    insights.on_pick(call, &fleet.decision(*pick_id, placed), &holdings);
}

fn tick(insights: &mut Insights, now_ms: u64, fleet: &Fleet) {
    let holdings = fleet.holdings(insights.idle_probes());
    insights.tick(now_ms, &holdings);
}

fn section(kind: SectionKind, index: u32, start: u64, digest: u32) -> PromptSection {
    PromptSection {
        kind,
        index,
        start,
        digest,
    }
}

/// 100-byte blocks at 4 bytes per token: 25 tokens a block.
fn call<'a>(
    pick_id: u64,
    key: &'a str,
    harness: &'a str,
    blocks: &'a [u64],
    sections: &'a [PromptSection],
    prompt_bytes: u64,
    now_ms: u64,
) -> (u64, Call<'a>) {
    (
        pick_id,
        Call {
            input: PickInput {
                block_hashes: blocks,
                block_bytes: 100,
                prompt_bytes,
                session_id: key,
                model: "m",
                now_ms,
                ..PickInput::default()
            },
            harness: Harness::from_name(harness),
            tenant: harness,
            sections,
        },
    )
}

/// (worker, predicted blocks, reachable blocks).
fn placed(worker: usize, predicted: usize, reachable: usize) -> (usize, usize, usize) {
    (worker, predicted, reachable)
}

fn totals_of(insights: &Insights, harness: &str) -> Totals {
    let id = Harness::from_name(harness);
    insights
        .totals()
        .filter(|(l, _)| l.harness == id)
        .fold(Totals::default(), |mut acc, (_, t)| {
            acc.add(t);
            acc
        })
}

#[test]
fn a_scripted_workload_gives_the_hand_computed_figures() {
    let config = InsightConfig {
        kv_bytes_per_token: 1000.0,
        ..InsightConfig::default()
    };
    let mut insights = Insights::new(config);
    let fleet = Fleet::default();
    let s1 = [
        section(SectionKind::Tools, 0, 0, 1),
        section(SectionKind::System, 0, 200, 2),
        section(SectionKind::Message, 1, 300, 3),
    ];
    let mut s2 = s1.to_vec();
    s2.push(section(SectionKind::Message, 2, 450, 4));

    // Clean appends: 450 then 650 bytes (112.5 + 162.5 tokens).
    on_pick(
        &mut insights,
        &call(1, "a", "claude_code", &[1, 2, 3, 4], &s1, 450, 0),
        placed(0, 0, 0),
        &fleet,
    );
    insights.on_outcome(1, Some(110), Some(0), Some(WorkerId(0)), 1_000);
    let next = [1, 2, 3, 4, 5, 6];
    on_pick(
        &mut insights,
        &call(2, "a", "claude_code", &next, &s2, 650, 5_000),
        placed(0, 4, 4),
        &fleet,
    );
    insights.on_outcome(2, Some(160), Some(100), Some(WorkerId(0)), 10_000);

    let t = totals_of(&insights, "claude_code");
    assert_eq!(t.calls, 2);
    assert_eq!(t.prompt_tokens, 275.0);
    // The second call repeats 4 blocks of 25 tokens.
    assert_eq!(t.repeated_prefix_tokens, 100.0);
    assert_eq!((t.prompt_bytes, t.repeated_prefix_bytes), (1100, 400));
    assert!((t.repeated_prefix_share() - 400.0 / 1100.0).abs() < 1e-12);
    assert_eq!((t.continuing_calls, t.same_worker_calls), (1, 1));
    assert_eq!(t.same_worker_rate(), 1.0);
    assert_eq!(t.prefix_checks, 1);
    assert_eq!(t.prefix_breaks, [0; 4]);
    // Read 100, written 110 + 60.
    assert_eq!(t.written_tokens, 170.0);
    assert!((t.read_write_ratio() - 100.0 / 170.0).abs() < 1e-12);
    // 100 cached tokens at 10 tokens/ms saved 10 ms of prefill.
    assert_eq!(t.prefill_saved_ms, 10.0);
    assert_eq!(t.prefill_computed_ms, 17.0);
    // Idle 1 s between the calls with 4 blocks (100 tokens × 1000 B).
    assert_eq!(t.idle_kv_byte_ms, 100.0 * 1000.0 * 4_000.0);

    // Idle for a minute after the second call: 150 tokens held.
    tick(&mut insights, 70_000, &fleet);
    let t = totals_of(&insights, "claude_code");
    assert_eq!(t.idle_kv_byte_ms, 100.0 * 1000.0 * 4_000.0 + 150.0 * 1000.0 * 60_000.0);
    let idle = insights.idle_sessions(70_000, &fleet.holdings(insights.idle_probes()));
    assert_eq!(idle.len(), 1);
    assert_eq!((idle[0].session.as_str(), idle[0].model.as_str()), ("a", "m"));
    assert_eq!(
        (idle[0].kv_bytes, idle[0].idle_ms, idle[0].recompute_ms),
        (150_000.0, 60_000, 15.0)
    );
    let (_, r) = insights.retention().next().unwrap();
    assert_eq!(r.idle_sessions, 1);
    assert_eq!(r.kv_bytes, 150_000.0);
    assert_eq!(r.recompute_ms, 15.0);
    assert_eq!(r.max_idle_ms, 60_000);
    assert!(insights.break_points().is_empty());
}

#[test]
fn a_timestamp_in_the_system_prompt_is_named_as_the_breaker() {
    let mut insights = Insights::new(InsightConfig::default());
    let fleet = Fleet::default();
    let sections = |system_digest| {
        [
            section(SectionKind::Tools, 0, 0, 1),
            section(SectionKind::System, 0, 200, system_digest),
            section(SectionKind::Message, 1, 300, 3),
        ]
    };
    let first = sections(10);
    on_pick(
        &mut insights,
        &call(1, "b", "openclaw", &[1, 2, 3, 4], &first, 450, 0),
        placed(1, 0, 0),
        &fleet,
    );
    let second = sections(11);
    on_pick(
        &mut insights,
        &call(2, "b", "openclaw", &[1, 2, 7, 8], &second, 450, 10),
        placed(1, 2, 2),
        &fleet,
    );
    let points = insights.break_points();
    assert_eq!(points.len(), 1);
    let (point, stats) = points[0];
    assert_eq!((point.kind, point.index), (SectionKind::System, 0));
    assert_eq!(point.harness.name(), "openclaw");
    assert_eq!((stats.count, stats.first_block_min), (1, 2));
    let t = totals_of(&insights, "openclaw");
    assert_eq!(t.prefix_breaks[SectionKind::System as usize], 1);
    // The two shared blocks still count as a repeated prefix.
    assert_eq!(t.repeated_prefix_tokens, 50.0);

    // A compacted history drops message 1: the break is named there.
    let compacted = &second[..2];
    on_pick(
        &mut insights,
        &call(3, "b", "openclaw", &[1, 2, 7], compacted, 300, 20),
        placed(1, 2, 2),
        &fleet,
    );
    assert!(
        insights
            .break_points()
            .iter()
            .any(|(p, _)| (p.kind, p.index) == (SectionKind::Message, 1))
    );
}

#[test]
fn a_last_part_that_grows_in_place_is_no_break() {
    let mut insights = Insights::new(InsightConfig::default());
    let fleet = Fleet::default();
    let prompt = |digest| [section(SectionKind::Message, 0, 0, digest)];
    // A completions prompt that grows: its closing quote moves, so the
    // last full block of the first call differs in the second.
    on_pick(
        &mut insights,
        &call(1, "p", "other", &[1, 2, 3], &prompt(1), 350, 0),
        placed(0, 0, 0),
        &fleet,
    );
    on_pick(
        &mut insights,
        &call(2, "p", "other", &[1, 2, 9, 10], &prompt(2), 450, 1),
        placed(0, 2, 2),
        &fleet,
    );
    assert!(insights.break_points().is_empty());
    // Changing an earlier part is a break even if the last one grows.
    let two = |a, b| {
        [
            section(SectionKind::System, 0, 0, a),
            section(SectionKind::Message, 1, 100, b),
        ]
    };
    on_pick(
        &mut insights,
        &call(3, "q", "other", &[1, 2, 3], &two(1, 1), 350, 2),
        placed(0, 0, 0),
        &fleet,
    );
    on_pick(
        &mut insights,
        &call(4, "q", "other", &[5, 6, 7, 8], &two(2, 2), 450, 3),
        placed(0, 0, 0),
        &fleet,
    );
    assert_eq!(insights.break_points().len(), 1);
    assert_eq!(insights.break_points()[0].0.kind, SectionKind::System);
}

#[test]
fn a_move_says_why() {
    let mut insights = Insights::new(InsightConfig::default());
    let blocks = [1, 2, 3, 4];
    let s = [section(SectionKind::Message, 0, 0, 1)];
    let mut fleet = Fleet::default();
    let mut id = 0;
    let mut pick = |insights: &mut Insights, worker, predicted, fleet: &Fleet, blocks: &[u64]| {
        id += 1;
        on_pick(
            insights,
            &call(id, "c", "codex", blocks, &s, 400, id),
            placed(worker, predicted, 4),
            fleet,
        );
    };
    pick(&mut insights, 0, 0, &fleet, &blocks);
    // Worker 0 holds all 4 blocks but the call went to 1 with none: load.
    fleet.overlaps = vec![4, 0];
    pick(&mut insights, 1, 0, &fleet, &blocks);
    // Back to 0, which lost two of the blocks: eviction.
    fleet.overlaps = vec![0, 2];
    pick(&mut insights, 0, 0, &fleet, &blocks);
    // Worker 0 is gone.
    fleet.gone = vec![WorkerId(0)];
    pick(&mut insights, 1, 4, &fleet, &blocks);
    // A new first block: nothing to stick for.
    fleet.gone.clear();
    pick(&mut insights, 0, 0, &fleet, &[9, 2, 3, 4]);
    let t = totals_of(&insights, "codex");
    assert_eq!(t.continuing_calls, 4);
    assert_eq!(t.same_worker_calls, 0);
    assert_eq!(
        t.moves,
        [1, 1, 1, 1, 0],
        "worker_gone, prefix_change, eviction, load, other"
    );
}

#[test]
fn tenants_past_the_label_budget_share_one_label() {
    let config = InsightConfig {
        tenant_labels: 2,
        ..InsightConfig::default()
    };
    let mut insights = Insights::new(config);
    let fleet = Fleet::default();
    for (i, tenant) in ["t1", "t2", "t3", "t4", ""].iter().enumerate() {
        let mut c = call(i as u64, "", "other", &[1], &[], 100, 0);
        c.1.tenant = tenant;
        on_pick(&mut insights, &c, placed(0, 0, 0), &fleet);
    }
    let mut names: Vec<&str> = insights.totals().map(|(l, _)| insights.tenant_name(l.tenant)).collect();
    names.sort_unstable();
    assert_eq!(names, ["none", "other", "t1", "t2"]);
    let report = insights.report(0, 60_000);
    assert_eq!(report.rows.iter().map(|r| r.2.calls).sum::<u64>(), 5);
    // Calls without a session still count their usage.
    insights.on_outcome(4, Some(100), Some(40), Some(WorkerId(0)), 1);
    let report = insights.report(1, 60_000);
    let none = report.rows.iter().find(|r| r.1 == "none").unwrap();
    assert_eq!((none.2.reported_cached_tokens, none.2.written_tokens), (40.0, 60.0));
}

#[test]
fn the_report_covers_only_its_window() {
    let mut insights = Insights::new(InsightConfig::default());
    let fleet = Fleet::default();
    on_pick(
        &mut insights,
        &call(1, "a", "codex", &[1], &[], 100, 0),
        placed(0, 0, 0),
        &fleet,
    );
    on_pick(
        &mut insights,
        &call(2, "b", "codex", &[2], &[], 100, 600_000),
        placed(0, 0, 0),
        &fleet,
    );
    let calls = |window| {
        insights
            .report(600_000, window)
            .rows
            .iter()
            .map(|r| r.2.calls)
            .sum::<u64>()
    };
    assert_eq!(calls(60_000), 1);
    assert_eq!(calls(3_600_000), 2);
}

#[test]
fn an_idle_session_asked_about_too_late_is_charged_at_the_next_tick() {
    let mut insights = Insights::new(InsightConfig {
        kv_bytes_per_token: 1.0,
        ..InsightConfig::default()
    });
    let fleet = Fleet::default();
    on_pick(
        &mut insights,
        &call(1, "a", "codex", &[1, 2, 3, 4], &[], 400, 0),
        placed(0, 0, 0),
        &fleet,
    );
    insights.on_outcome(1, None, None, Some(WorkerId(0)), 1_000);
    // Holdings taken before the session went idle do not answer for it.
    insights.tick(5_000, &Holdings::default());
    assert_eq!(totals_of(&insights, "codex").idle_kv_byte_ms, 0.0);
    // The next tick that asks charges the whole idle stretch.
    tick(&mut insights, 9_000, &fleet);
    assert_eq!(totals_of(&insights, "codex").idle_kv_byte_ms, 100.0 * 8_000.0);
}
