//! The session-keyed tables over two waves of agent sessions, driven as
//! `kvmesh-bench scale` drives the sidecar (`integration/bench/src/scale.rs`
//! through `sidecar/src/state.rs`): 64 workers, every session's first
//! call, steady calls at 2,000/s to seeded sessions each resending its
//! prefix plus 3 blocks, each answered with the usage the router predicted;
//! session expiry and the ledger's tick every 10 s; the first wave idle
//! past the TTL, then a wave of as many new sessions. The scale bench's
//! goal is RSS after the second wave no higher than after the first, so no
//! table may hold more entries or room at the second wave's end than at
//! the first's.

use crate::tests::{Footprint, Footprints};
use crate::{
    Call, EXPIRE_STEP, Harness, InsightConfig, Insights, Outcome, PickInput, Router, RouterConfig, splitmix64,
};

const WORKERS: usize = 64;
/// The scale bench's call shape and rate.
const SHARED_BLOCKS: u64 = 8;
const FIRST_BLOCKS: u64 = 24;
const BLOCKS_PER_CALL: u64 = 3;
const MAX_BLOCKS: u64 = 400;
const TOKENS_PER_BLOCK: u64 = 64;
const RATE_PER_S: u64 = 2000;
/// First calls go out as fast as the sidecar answers: about this often.
const WARM_STEP_US: u64 = 100;
/// Session expiry and the ledger's tick (`watcher::expire_sessions`).
const TICK_MS: u64 = 10_000;

struct Fleet {
    router: Router,
    insights: Insights,
    now_us: u64,
    next_tick_ms: u64,
    seed: u64,
}

impl Fleet {
    fn new(sessions: usize, ttl_ms: u64) -> Self {
        // The sidecar's settings at `kvmesh-bench scale` (its 32,768 blocks a
        // worker at 100,000 sessions, in proportion), and the default bound
        // on sessions, which the bench's 100,000 reach.
        let router = Router::new(
            RouterConfig {
                worker_capacity_blocks: 32_768 * sessions / 100_000,
                session_ttl_ms: ttl_ms,
                max_sessions: sessions,
                max_pending_picks: sessions,
                ..RouterConfig::default()
            },
            (0..WORKERS).map(|w| format!("10.1.0.{w}:8000")),
        );
        let insights = Insights::new(InsightConfig {
            session_ttl_ms: ttl_ms,
            max_sessions: sessions,
            max_pending: sessions,
            ..InsightConfig::default()
        });
        Self {
            router,
            insights,
            now_us: 1_000_000,
            next_tick_ms: 1_000 + TICK_MS,
            seed: 17 ^ sessions as u64,
        }
    }

    fn now_ms(&self) -> u64 {
        self.now_us / 1000
    }

    /// Call `call` of `session`, its outcome, then `step_us` later.
    fn call(&mut self, wave: u64, session: u64, call: u64, step_us: u64) {
        let own = (FIRST_BLOCKS + BLOCKS_PER_CALL * call).min(MAX_BLOCKS);
        let key = (wave << 40) | session;
        let hashes: Vec<u64> = (0..SHARED_BLOCKS)
            .map(|j| splitmix64(0xC0FF_EE00 ^ j))
            .chain((0..own).map(|j| splitmix64(splitmix64(key) ^ j)))
            .collect();
        let id = format!("agent-{wave}-{session}");
        let now_ms = self.now_ms();
        let call = Call {
            input: PickInput {
                block_hashes: &hashes,
                block_bytes: 256,
                prompt_bytes: hashes.len() as u64 * 256,
                session_id: &id,
                model: "agent-model",
                harness: Harness::Codex,
                tenant: "team-a",
                now_ms,
                ..PickInput::default()
            },
            harness: Harness::Codex,
            tenant: "team-a",
            sections: &[],
        };
        // `Shared::pick`, then `Shared::report` with the bench's outcome.
        let probe = self.insights.probe(&call);
        let decision = self.router.pick(call.input);
        let holdings = self.router.holdings(probe.as_slice());
        self.insights.on_pick(&call, &decision, &holdings);
        let prompt = hashes.len() as u64 * TOKENS_PER_BLOCK;
        let cached = (u64::from(decision.predicted_cached_blocks) * TOKENS_PER_BLOCK).min(prompt);
        self.router.report_at(
            Outcome {
                pick_id: decision.pick_id,
                prompt_tokens: Some(prompt),
                cached_tokens: Some(cached),
                ttfb_ms: 0,
            },
            now_ms,
        );
        self.insights
            .on_outcome(decision.pick_id, Some(prompt), Some(cached), decision.chosen(), now_ms);
        self.advance(step_us);
    }

    /// Time passes, with the sidecar's 10 s ticks.
    fn advance(&mut self, us: u64) {
        self.now_us += us;
        while self.next_tick_ms <= self.now_ms() {
            let at = self.next_tick_ms;
            while self.router.expire_sessions(at) == EXPIRE_STEP {}
            let mut pass = self.insights.tick_begin(at);
            loop {
                let step = self.insights.tick_step(&pass, 1000);
                let holdings = self.router.holdings(&step.probes);
                if self.insights.tick_apply(&mut pass, step, &holdings) {
                    break;
                }
            }
            self.next_tick_ms += TICK_MS;
        }
    }

    fn warm(&mut self, wave: u64, sessions: u64) {
        for s in 0..sessions {
            self.call(wave, s, 0, WARM_STEP_US);
        }
    }

    /// `picks` calls at the bench's rate to seeded sessions of `calls`.
    fn steady(&mut self, wave: u64, calls: &mut [u64], picks: u64) {
        for _ in 0..picks {
            self.seed = splitmix64(self.seed);
            let session = (self.seed % calls.len() as u64) as usize;
            let Some(call) = calls.get_mut(session) else { continue };
            *call += 1;
            let n = *call;
            self.call(wave, session as u64, n, 1_000_000 / RATE_PER_S);
        }
    }

    fn footprints(&self) -> Footprints {
        let mut all = self.router.footprints();
        all.extend(self.insights.footprints());
        all
    }
}

/// The tables at each point the bench reads RSS (and after the fetch loop
/// and after expiry), printed; returns each table's largest during the
/// first wave and its size at the second wave's end.
fn two_waves(sessions: usize) -> (Footprints, Footprints) {
    // The bench's phases: 20 s at 2,000/s, i.e. 0.4 calls per session at
    // 100,000 (kept in proportion), and its TTL.
    let phase_picks = (sessions as u64 * 2 / 5).max(1);
    let phase_ms = phase_picks * 1000 / RATE_PER_S;
    let ttl_ms = (sessions as u64 / 2 + 2 * phase_ms + 20_000).max(30_000);
    let mut fleet = Fleet::new(sessions, ttl_ms);
    let print = |when: &str, fleet: &Fleet| {
        println!("{when}:");
        let kib = |bytes: usize| bytes as f64 / 1024.0;
        let (mut table, mut queue) = (0, 0);
        for (name, f) in fleet.footprints() {
            println!(
                "  {name:<22} len {:>7}  table {:>9.1} KiB  queue {:>9.1} KiB",
                f.len,
                kib(f.table_bytes),
                kib(f.queue_bytes)
            );
            table += f.table_bytes;
            queue += f.queue_bytes;
        }
        println!(
            "  {:<22} {:>11}  table {:>9.1} KiB  queue {:>9.1} KiB",
            "all",
            "",
            kib(table),
            kib(queue)
        );
    };
    fleet.warm(1, sessions as u64);
    let mut calls = vec![0; sessions];
    fleet.steady(1, &mut calls, phase_picks);
    print("wave 1", &fleet);
    let steady = fleet.footprints();
    fleet.steady(1, &mut calls, phase_picks);
    print("wave 1 after the fetch loop's phase", &fleet);
    let first: Vec<(&str, Footprint)> = steady
        .into_iter()
        .zip(fleet.footprints())
        .map(|((name, a), (_, b))| {
            let most = Footprint {
                len: a.len.max(b.len),
                table_bytes: a.table_bytes.max(b.table_bytes),
                queue_bytes: a.queue_bytes.max(b.queue_bytes),
            };
            (name, most)
        })
        .collect();
    fleet.advance((ttl_ms + TICK_MS + 2_000) * 1000);
    print("wave 1 expired", &fleet);
    // The residents are the engines' caches, which the TTL does not empty.
    for (name, f) in fleet.footprints() {
        assert!(
            f.len == usize::from(name == "ledger tenant_ids") || name == "retention residents",
            "{name} keeps {} entries of an expired wave",
            f.len
        );
    }
    fleet.warm(2, sessions as u64);
    let mut calls = vec![0; sessions];
    fleet.steady(2, &mut calls, phase_picks);
    print("wave 2", &fleet);
    (first, fleet.footprints())
}

/// No table holds more bytes at the second wave's end than it did during
/// the first: what the first wave grew, the second reuses. (Against the
/// first wave's largest, not its size at the bench's first RSS reading.)
/// The workers' residents are left out: they are the engines' caches, not
/// a wave's, kept at their bound in blocks across waves, and a hash table
/// that churns at its bound doubles once whenever tombstones fill it while
/// more than half of it is live (hashbrown's rule), which may fall in
/// either wave (at 6,000 sessions it did in some runs, at 100,000 in none).
fn assert_no_growth(first: &[(&str, Footprint)], second: &[(&str, Footprint)]) {
    for ((name, first), (_, second)) in first.iter().zip(second) {
        if *name == "retention residents" {
            continue;
        }
        assert!(
            second.table_bytes <= first.table_bytes && second.queue_bytes <= first.queue_bytes,
            "{name}: {second:?} at the second wave's end, at most {first:?} in the first"
        );
    }
}

/// 6,000 sessions fill the tables as 100,000 do (about 84 % of what their
/// hash tables hold without growing), where churn at the bound doubles a
/// table that keeps the first wave's entries.
#[test]
fn the_second_wave_of_sessions_holds_no_larger_tables_than_the_first() {
    let (wave1, wave2) = two_waves(6_000);
    assert_no_growth(&wave1, &wave2);
}

/// At the scale bench's own size: `cargo test --release -p kvmesh-core
/// -- --ignored --nocapture scale_bench_size`.
#[test]
#[ignore = "about a minute in release"]
fn at_the_scale_bench_size_the_second_wave_holds_no_larger_tables() {
    let (wave1, wave2) = two_waves(100_000);
    assert_no_growth(&wave1, &wave2);
}
