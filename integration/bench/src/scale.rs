//! `kvmesh-bench scale`: a release sidecar driven as a busy GPU cluster
//! drives it (issue 17). 64 simulated workers (addresses only: nothing is
//! scraped, the bench reports each call's usage as the engine would), N
//! live agent sessions whose calls resend a growing prefix, a steady Pick
//! rate on one PickStream with an Outcome for every Pick on one
//! ReportStream, a Prometheus-like `/metrics` scrape every 15 s, and a phase
//! that fetches the debug pages in a loop.
//!
//! The sender is open-loop (Picks go out on schedule whatever the replies
//! do), so a stall of the sidecar counts for every Pick queued behind it,
//! as it would against the filter's timeout. The sidecar's RSS is
//! read from /proc after a first wave of sessions (after its steady phase,
//! and at its end, after the debug-page loop too) and after a second wave
//! of as many new sessions, started once the first wave expired.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use kvmesh_core::splitmix64;
use kvmesh_integration::cluster::start_sidecar_binary;
use kvmesh_integration::paths::{self, Profile};
use kvmesh_integration::process::memory_kib;
use kvmesh_proto::v1::router_client::RouterClient;
use kvmesh_proto::v1::{Outcome, PickRequest};
use tokio::sync::{Semaphore, mpsc};

use crate::latency::{ms, percentile};

#[derive(Debug, clap::Args)]
pub(crate) struct Options {
    /// Live sessions, one run each.
    #[arg(long, value_delimiter = ',', default_values_t = [1000usize, 10_000, 100_000])]
    sessions: Vec<usize>,
    /// Simulated workers the sidecar routes over.
    #[arg(long, default_value_t = 64)]
    workers: usize,
    /// Picks per second in the measured phases.
    #[arg(long, default_value_t = 2000)]
    rate: u64,
    /// Seconds of each measured phase (steady, then steady with the fetch loop).
    #[arg(long, default_value_t = 20)]
    phase_secs: u64,
    /// Seconds between `/metrics` scrapes.
    #[arg(long, default_value_t = 15)]
    scrape_secs: u64,
    /// The sidecar to run (default: this tree's release build), e.g. another
    /// commit's build side by side.
    #[arg(long)]
    sidecar_bin: Option<PathBuf>,
    /// Seed of which session calls next.
    #[arg(long, default_value_t = 17)]
    seed: u64,
    /// The sidecar's --worker-capacity-blocks: small enough that the first
    /// wave fills the index (64 × 32,768 blocks against about 2.6M placed),
    /// so the second wave's RSS is the sessions' and the ledger's, not an
    /// index still growing to its bound.
    #[arg(long, default_value_t = 32_768)]
    worker_capacity_blocks: usize,
    /// Only the first wave: no expiry wait, no second wave.
    #[arg(long)]
    one_wave: bool,
    /// Waves after the second, each after the one before expired, run as
    /// the second is (first calls, then a steady phase): whether RSS
    /// keeps growing wave after wave or settles. Their Picks are counted
    /// in one row, not in the goal's phases.
    #[arg(long, default_value_t = 0)]
    later_waves: u64,
    /// The pages of the fetch loop, fetched in turn: a subset tells which
    /// page's work delays the Picks.
    #[arg(long, value_delimiter = ',', default_values_t = PAGES.map(str::to_owned))]
    pages: Vec<String>,
}

/// Blocks every session shares (system prompt and tools).
const SHARED_BLOCKS: u64 = 8;
/// A session's own blocks at its first call, what each call adds, and where
/// growth stops (a compacting harness).
const FIRST_BLOCKS: u64 = 24;
const BLOCKS_PER_CALL: u64 = 3;
const MAX_BLOCKS: u64 = 400;
/// Picks in flight while sessions are created (their first calls, not measured).
const WARM_WINDOW: usize = 256;
/// Tokens per 256-byte block, as the simulated engine counts them.
const TOKENS_PER_BLOCK: u64 = 64;
/// The filter's default Pick timeout: a Pick answered later routes nothing.
const IN_TIME: Duration = Duration::from_millis(50);
/// How long a Pick may wait before it is listed as a stall.
const STALL: Duration = Duration::from_millis(5);
/// The sidecar's session-expiry tick (`watcher::expire_sessions`).
const EXPIRY_TICK_SECS: u64 = 10;
/// The pages of the fetch loop unless told, in turn.
const PAGES: [&str; 5] = [
    "/debug/sessions",
    "/debug/workers",
    "/debug/report",
    "/debug/prefix-breaks",
    "/metrics",
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Phase {
    Warm = 0,
    Steady = 1,
    Fetch = 2,
    Wave2Warm = 3,
    Wave2 = 4,
    LaterWarm = 5,
    Later = 6,
}

const PHASES: [Phase; 7] = [
    Phase::Warm,
    Phase::Steady,
    Phase::Fetch,
    Phase::Wave2Warm,
    Phase::Wave2,
    Phase::LaterWarm,
    Phase::Later,
];

impl Phase {
    fn name(self) -> &'static str {
        match self {
            Self::Warm => "wave 1: first calls",
            Self::Steady => "wave 1: steady",
            Self::Fetch => "wave 1: steady + fetch loop",
            Self::Wave2Warm => "wave 2: first calls",
            Self::Wave2 => "wave 2: steady",
            Self::LaterWarm => "later waves: first calls",
            Self::Later => "later waves: steady",
        }
    }

    /// Each session's first call, sent through the warm window.
    fn first_calls(self) -> bool {
        matches!(self, Self::Warm | Self::Wave2Warm | Self::LaterWarm)
    }

    /// A phase the goals are measured on (stall bursts are counted there).
    fn measured(self) -> bool {
        matches!(self, Self::Steady | Self::Fetch | Self::Wave2)
    }
}

/// One Pick on the wire, awaiting its reply.
#[derive(Debug)]
struct Sent {
    sent_at: Instant,
    phase: Phase,
    blocks: u64,
}

/// One answered Pick.
#[derive(Debug, Clone, Copy)]
struct Sample {
    phase: Phase,
    answered: Instant,
    waited: Duration,
}

/// Call `call` of session `session`: the shared prefix, then the session's
/// own blocks, one prefix of the next call's.
fn agent_call(wave: u64, session: u64, call: u64, request_id: u64) -> PickRequest {
    let own = (FIRST_BLOCKS + BLOCKS_PER_CALL * call).min(MAX_BLOCKS);
    let key = (wave << 40) | session;
    let block_hashes: Vec<u64> = (0..SHARED_BLOCKS)
        .map(|j| splitmix64(0xC0FF_EE00 ^ j))
        .chain((0..own).map(|j| splitmix64(splitmix64(key) ^ j)))
        .collect();
    let blocks = block_hashes.len() as u64;
    PickRequest {
        block_hashes,
        block_bytes: 256,
        prompt_bytes: blocks * 256,
        session_id: format!("agent-{wave}-{session}"),
        tenant: "team-a".to_owned(),
        model: "agent-model".to_owned(),
        harness: "codex".to_owned(),
        request_id,
        ..PickRequest::default()
    }
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

fn gauge(metrics: &str, name: &str) -> Option<f64> {
    metrics
        .lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// The sum of a counter's series (`name{labels} value` or `name value`).
fn counter_sum(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(name) && matches!(l.as_bytes().get(name.len()), Some(b'{' | b' ')))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Waits until the sidecar has applied `outcomes` outcomes (its
/// `kvmesh_reports_total`), polling every 50 ms, at most 30 s; returns how
/// long it waited. The first calls are sent as fast as they are answered,
/// and their outcomes are still being applied when the last reply is in:
/// a steady phase started then would measure that backlog, not the steady
/// state.
async fn settle(http: &reqwest::Client, admin: std::net::SocketAddr, outcomes: u64) -> Duration {
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(30) {
        if let Ok(reply) = http.get(format!("http://{admin}/metrics")).send().await
            && let Ok(text) = reply.text().await
            && counter_sum(&text, "kvmesh_reports_total") >= outcomes as f64
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    started.elapsed()
}

/// One `/metrics` scrape: when, index entries, live sessions, how long it took.
type Scrape = (Instant, f64, f64, Duration);

/// What one run measured, for the summary table.
#[derive(Debug, Default)]
struct RunSummary {
    sessions: usize,
    steady: (f64, f64, f64, f64),
    fetch: (f64, f64, f64, f64),
    rss_wave1_kib: u64,
    /// At wave 1's end, after the debug-page loop: the second wave has no
    /// page loop, but what the pages left allocated is still there.
    rss_wave1_end_kib: u64,
    hwm_wave1_kib: u64,
    rss_expired_kib: u64,
    rss_wave2_kib: u64,
    hwm_wave2_kib: u64,
    /// Each later wave's RSS after the one before expired, and at its end.
    rss_later_kib: Vec<(u64, u64)>,
}

pub(crate) async fn run(options: Options) -> anyhow::Result<()> {
    let binary = match &options.sidecar_bin {
        Some(path) => path.clone(),
        None => paths::binary("kvmesh-sidecar", Profile::Release)?,
    };
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("sidecar {} ; load average at start: {}", binary.display(), load.trim());
    let mut summaries = Vec::new();
    for &sessions in &options.sessions {
        summaries.push(run_one(&options, &binary, sessions).await?);
    }
    println!();
    println!(
        "| sessions | p50 | p99 | max | Picks/s in 50 ms | with fetch loop: p50 | p99 | max | Picks/s in 50 ms | RSS wave 1 (peak) | wave 1's end | after expiry | RSS wave 2 (peak) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for s in &summaries {
        println!(
            "| {} | {:.2} ms | {:.2} ms | {:.1} ms | {:.0} | {:.2} ms | {:.2} ms | {:.1} ms | {:.0} | {:.0} ({:.0}) MiB | {:.0} MiB | {:.0} MiB | {:.0} ({:.0}) MiB |",
            s.sessions,
            s.steady.0,
            s.steady.1,
            s.steady.2,
            s.steady.3,
            s.fetch.0,
            s.fetch.1,
            s.fetch.2,
            s.fetch.3,
            mib(s.rss_wave1_kib),
            mib(s.hwm_wave1_kib),
            mib(s.rss_wave1_end_kib),
            mib(s.rss_expired_kib),
            mib(s.rss_wave2_kib),
            mib(s.hwm_wave2_kib),
        );
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("load average at end: {}", load.trim());
    Ok(())
}

/// The pick and report streams of one run, and what came back.
struct Driver {
    picks: mpsc::UnboundedSender<PickRequest>,
    pending: Arc<Mutex<HashMap<u64, Sent>>>,
    window: Arc<Semaphore>,
    next_id: u64,
}

impl Driver {
    fn send(&mut self, mut request: PickRequest, phase: Phase) -> anyhow::Result<()> {
        self.next_id += 1;
        request.request_id = self.next_id;
        let sent = Sent {
            // The send, not the schedule: tokio's timer wakes the sender up
            // to 1 ms late, which a schedule-based figure would add to
            // every Pick. The sender never waits on the sidecar (the stream
            // is unbounded), so a stall still counts for every Pick sent
            // into it.
            sent_at: Instant::now(),
            phase,
            blocks: request.block_hashes.len() as u64,
        };
        if let Ok(mut pending) = self.pending.lock() {
            pending.insert(self.next_id, sent);
        }
        self.picks
            .send(request)
            .map_err(|_| anyhow::anyhow!("the pick stream ended"))
    }

    /// Each session's first call, `WARM_WINDOW` in flight.
    async fn warm(&mut self, wave: u64, sessions: usize, phase: Phase) -> anyhow::Result<Duration> {
        let started = Instant::now();
        for session in 0..sessions as u64 {
            self.window.acquire().await?.forget();
            self.send(agent_call(wave, session, 0, 0), phase)?;
        }
        // Every first call answered before the measured phase.
        let _ = self.window.acquire_many(WARM_WINDOW as u32).await?;
        Ok(started.elapsed())
    }

    /// `rate` Picks a second for `length`, open-loop, to seeded sessions.
    async fn steady(
        &mut self,
        wave: u64,
        calls: &mut [u64],
        rate: u64,
        length: Duration,
        seed: &mut u64,
        phase: Phase,
    ) -> anyhow::Result<()> {
        let started = Instant::now();
        let total = rate.saturating_mul(length.as_secs()).max(1);
        for k in 0..total {
            let at = started + Duration::from_secs_f64(k as f64 / rate.max(1) as f64);
            tokio::time::sleep_until(at.into()).await;
            *seed = splitmix64(*seed);
            let session = (*seed % calls.len().max(1) as u64) as usize;
            let Some(call) = calls.get_mut(session) else { continue };
            *call += 1;
            self.send(agent_call(wave, session as u64, *call, 0), phase)?;
        }
        Ok(())
    }
}

async fn run_one(options: &Options, binary: &std::path::Path, sessions: usize) -> anyhow::Result<RunSummary> {
    let dir = std::env::temp_dir().join(format!("kvmesh-bench-scale-{}-{sessions}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let workers: Vec<std::net::SocketAddr> = (1..=options.workers)
        .map(|i| format!("10.1.{}.{}:8000", i / 250, i % 250 + 1).parse())
        .collect::<Result<_, _>>()?;
    // Every session of wave 1 must stay live through both measured phases:
    // its first call to the end of the fetch loop, with room for a slow warm-up.
    let ttl_secs = (sessions as u64 / 2000 + 2 * options.phase_secs + 20).max(30);
    let extra = [
        "--scrape-interval-ms".to_owned(),
        "0".to_owned(),
        "--session-ttl-secs".to_owned(),
        ttl_secs.to_string(),
        "--worker-capacity-blocks".to_owned(),
        options.worker_capacity_blocks.to_string(),
        "--log".to_owned(),
        "warn".to_owned(),
    ];
    let (mut sidecar, grpc, admin) = start_sidecar_binary(binary, &dir, "127.0.0.1:0".parse()?, &workers, &extra)?;
    let pid = sidecar.pid();
    let result = drive(options, sessions, ttl_secs, pid, grpc, admin).await;
    sidecar.stop();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

async fn drive(
    options: &Options,
    sessions: usize,
    ttl_secs: u64,
    pid: u32,
    grpc: std::net::SocketAddr,
    admin: std::net::SocketAddr,
) -> anyhow::Result<RunSummary> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{grpc}"))?
        .tcp_nodelay(true)
        .connect()
        .await?;
    let mut picker = RouterClient::new(channel.clone());
    let mut reporter = RouterClient::new(channel);
    let (pick_tx, pick_rx) = mpsc::unbounded_channel::<PickRequest>();
    let (outcome_tx, outcome_rx) = mpsc::unbounded_channel::<Outcome>();
    let pick_stream = futures_util::stream::unfold(pick_rx, |mut rx| async move { rx.recv().await.map(|p| (p, rx)) });
    let outcome_stream =
        futures_util::stream::unfold(outcome_rx, |mut rx| async move { rx.recv().await.map(|o| (o, rx)) });
    let report_task = tokio::spawn(async move { reporter.report_stream(outcome_stream).await });
    let mut replies = picker.pick_stream(pick_stream).await?.into_inner();

    let pending: Arc<Mutex<HashMap<u64, Sent>>> = Arc::default();
    // Outcomes handed to the report stream, for `settle`.
    let outcomes_sent: Arc<std::sync::atomic::AtomicU64> = Arc::default();
    let samples: Arc<Mutex<Vec<Sample>>> = Arc::default();
    let window = Arc::new(Semaphore::new(WARM_WINDOW));
    let receiver = {
        let (pending, samples, window) = (pending.clone(), samples.clone(), window.clone());
        let outcomes_sent = outcomes_sent.clone();
        tokio::spawn(async move {
            while let Some(reply) = replies.next().await {
                let reply = reply?;
                let answered = Instant::now();
                let sent = pending.lock().ok().and_then(|mut p| p.remove(&reply.request_id));
                let Some(sent) = sent else { continue };
                if sent.phase.first_calls() {
                    window.add_permits(1);
                }
                if let Ok(mut samples) = samples.lock() {
                    samples.push(Sample {
                        phase: sent.phase,
                        answered,
                        waited: answered.duration_since(sent.sent_at),
                    });
                }
                // The engine cached what the router predicted.
                let prompt = sent.blocks * TOKENS_PER_BLOCK;
                let cached = (u64::from(reply.predicted_cached_blocks) * TOKENS_PER_BLOCK).min(prompt);
                if outcome_tx
                    .send(Outcome {
                        pick_id: reply.pick_id,
                        destination: reply.destinations.first().cloned().unwrap_or_default(),
                        prompt_tokens: Some(prompt),
                        cached_tokens: Some(cached),
                        ..Outcome::default()
                    })
                    .is_ok()
                {
                    outcomes_sent.fetch_add(1, Ordering::Relaxed);
                }
            }
            anyhow::Ok(())
        })
    };
    let mut driver = Driver {
        picks: pick_tx,
        pending,
        window,
        next_id: 0,
    };

    // The Prometheus-like scrape, all run long.
    let http = reqwest::Client::builder().timeout(Duration::from_secs(30)).build()?;
    let scrapes: Arc<Mutex<Vec<Scrape>>> = Arc::default();
    let scraper = {
        let (http, scrapes, every) = (http.clone(), scrapes.clone(), Duration::from_secs(options.scrape_secs));
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(every);
            loop {
                ticker.tick().await;
                let started = Instant::now();
                let Ok(reply) = http.get(format!("http://{admin}/metrics")).send().await else {
                    continue;
                };
                let Ok(text) = reply.text().await else { continue };
                let took = started.elapsed();
                if let Ok(mut s) = scrapes.lock() {
                    s.push((
                        started,
                        gauge(&text, "kvmesh_index_entries").unwrap_or(f64::NAN),
                        gauge(&text, "kvmesh_sessions").unwrap_or(f64::NAN),
                        took,
                    ));
                }
            }
        })
    };

    let run_started = Instant::now();
    let mut seed = options.seed ^ sessions as u64;
    let length = Duration::from_secs(options.phase_secs);
    let warm_took = driver.warm(1, sessions, Phase::Warm).await?;
    let settled = settle(&http, admin, outcomes_sent.load(Ordering::Relaxed)).await;
    let mut calls = vec![0u64; sessions];
    let steady_started = Instant::now();
    driver
        .steady(1, &mut calls, options.rate, length, &mut seed, Phase::Steady)
        .await?;
    let steady_ended = Instant::now();
    let (rss_wave1, _) = memory_kib(pid).unwrap_or_default();
    print_sizes(&http, admin, "end of wave 1").await;

    // The debug pages in a loop, one fetch after another, while Picks go on.
    let fetches: Arc<Mutex<Vec<(usize, Duration)>>> = Arc::default();
    let stop = stop_flag();
    let fetcher = {
        let (http, fetches, stop) = (http.clone(), fetches.clone(), stop.clone());
        let pages = options.pages.clone();
        tokio::spawn(async move {
            let mut i = 0usize;
            while !stop.load(Ordering::Relaxed) && !pages.is_empty() {
                let page = i % pages.len();
                let started = Instant::now();
                if let Ok(reply) = http.get(format!("http://{admin}{}", pages[page])).send().await {
                    let _ = reply.bytes().await;
                }
                if let Ok(mut f) = fetches.lock() {
                    f.push((page, started.elapsed()));
                }
                i += 1;
            }
        })
    };
    let fetch_started = Instant::now();
    driver
        .steady(1, &mut calls, options.rate, length, &mut seed, Phase::Fetch)
        .await?;
    let fetch_ended = Instant::now();
    stop.store(true, Ordering::Relaxed);
    let _ = fetcher.await;
    let (rss_wave1_end, hwm_wave1) = memory_kib(pid).unwrap_or_default();

    let mut summary = RunSummary {
        sessions,
        rss_wave1_kib: rss_wave1,
        rss_wave1_end_kib: rss_wave1_end,
        hwm_wave1_kib: hwm_wave1,
        ..RunSummary::default()
    };
    let mut wave2_window = None;
    let mut warm2_took = Duration::ZERO;
    let mut settled2 = Duration::ZERO;
    if !options.one_wave {
        // Each wave after the first, once the one before expired: its last
        // call was just now, and the sidecar ends sessions on a 10 s tick.
        for wave in 2..3 + options.later_waves {
            let (warm_phase, phase) = if wave == 2 {
                (Phase::Wave2Warm, Phase::Wave2)
            } else {
                (Phase::LaterWarm, Phase::Later)
            };
            tokio::time::sleep(Duration::from_secs(ttl_secs + EXPIRY_TICK_SECS + 2)).await;
            let expired = memory_kib(pid).unwrap_or_default().0;
            let metrics = http.get(format!("http://{admin}/metrics")).send().await?.text().await?;
            println!(
                "  after expiry: kvmesh_sessions {} , kvmesh_index_entries {}",
                gauge(&metrics, "kvmesh_sessions").unwrap_or(f64::NAN),
                gauge(&metrics, "kvmesh_index_entries").unwrap_or(f64::NAN)
            );
            print_sizes(&http, admin, "after expiry").await;
            let warm_took = driver.warm(wave, sessions, warm_phase).await?;
            let settled = settle(&http, admin, outcomes_sent.load(Ordering::Relaxed)).await;
            let mut calls = vec![0u64; sessions];
            let started = Instant::now();
            driver
                .steady(wave, &mut calls, options.rate, length, &mut seed, phase)
                .await?;
            let window = (started, Instant::now());
            let (rss, hwm) = memory_kib(pid).unwrap_or_default();
            print_sizes(&http, admin, &format!("end of wave {wave}")).await;
            if wave == 2 {
                (warm2_took, settled2, wave2_window) = (warm_took, settled, Some(window));
                summary.rss_expired_kib = expired;
                summary.rss_wave2_kib = rss;
                summary.hwm_wave2_kib = hwm;
            } else {
                summary.rss_later_kib.push((expired, rss));
            }
        }
    }
    // The last replies.
    tokio::time::sleep(Duration::from_millis(500)).await;
    scraper.abort();
    drop(driver);
    receiver.abort();
    let _ = receiver.await;
    let _ = report_task.await;

    let samples = samples.lock().map(|s| s.clone()).unwrap_or_default();
    println!();
    println!(
        "sessions {sessions}, {} workers, {} Picks/s offered, session TTL {ttl_secs} s; first calls of wave 1 took {:.1} s (their outcomes applied {:.2} s later), of wave 2 {:.1} s ({:.2} s)",
        options.workers,
        options.rate,
        warm_took.as_secs_f64(),
        settled.as_secs_f64(),
        warm2_took.as_secs_f64(),
        settled2.as_secs_f64()
    );
    println!("| phase | Picks | answered in 50 ms /s | p50 | p99 | max |");
    println!("|---|---|---|---|---|---|");
    for p in PHASES {
        let window = match p {
            Phase::Steady => Some((steady_started, steady_ended)),
            Phase::Fetch => Some((fetch_started, fetch_ended)),
            Phase::Wave2 => wave2_window,
            Phase::Warm | Phase::Wave2Warm | Phase::LaterWarm | Phase::Later => None,
        };
        let mut waited: Vec<Duration> = samples.iter().filter(|s| s.phase == p).map(|s| s.waited).collect();
        if waited.is_empty() {
            continue;
        }
        waited.sort();
        // Picks answered in the phase's window within the filter's timeout,
        // per second: the sender is open-loop, so a stalled sidecar still
        // answers about as many, late, and only the timeout tells.
        let rate = window.map_or(f64::NAN, |(from, to)| {
            let answered = samples
                .iter()
                .filter(|s| s.answered >= from && s.answered <= to && s.waited <= IN_TIME)
                .count();
            answered as f64 / to.duration_since(from).as_secs_f64()
        });
        let figures = (
            ms(percentile(&waited, 0.5)),
            ms(percentile(&waited, 0.99)),
            ms(waited.last().copied().unwrap_or_default()),
            rate,
        );
        println!(
            "| {} | {} | {:.0} | {:.3} ms | {:.3} ms | {:.1} ms |",
            p.name(),
            waited.len(),
            figures.3,
            figures.0,
            figures.1,
            figures.2
        );
        match p {
            Phase::Steady => summary.steady = figures,
            Phase::Fetch => summary.fetch = figures,
            _ => {}
        }
    }
    let fetches = fetches.lock().map(|f| f.clone()).unwrap_or_default();
    println!("| page (fetch loop) | fetches | p50 | max |");
    println!("|---|---|---|---|");
    for (i, page) in options.pages.iter().enumerate() {
        let mut took: Vec<Duration> = fetches.iter().filter(|(p, _)| *p == i).map(|(_, d)| *d).collect();
        took.sort();
        println!(
            "| {page} | {} | {:.2} ms | {:.1} ms |",
            took.len(),
            ms(percentile(&took, 0.5)),
            ms(took.last().copied().unwrap_or_default())
        );
    }
    // Stalls: Picks that waited past STALL in the measured phases, one line
    // per burst, with the index size at the scrape before it.
    let scrapes = scrapes.lock().map(|s| s.clone()).unwrap_or_default();
    let mut stalls: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.phase.measured() && s.waited > STALL)
        .collect();
    stalls.sort_by_key(|s| s.answered);
    let mut bursts: Vec<(Instant, Duration, usize)> = Vec::new();
    for s in stalls {
        match bursts.last_mut() {
            Some((at, worst, n)) if s.answered.duration_since(*at) < Duration::from_millis(200) => {
                *worst = (*worst).max(s.waited);
                *n += 1;
            }
            _ => bursts.push((s.answered, s.waited, 1)),
        }
    }
    let count = bursts.len();
    // The worst first: a scrape's or a rehash's stall, not the machine's noise.
    bursts.sort_by_key(|b| std::cmp::Reverse(b.1));
    for (at, worst, n) in bursts.iter().take(12) {
        let entries = scrapes
            .iter()
            .rev()
            .find(|(t, ..)| t <= at)
            .map_or(f64::NAN, |(_, e, ..)| *e);
        println!(
            "  stall at {:.1} s: {n} Picks over {} ms, worst {:.1} ms (index entries at the scrape before: {entries})",
            at.duration_since(run_started).as_secs_f64(),
            STALL.as_millis(),
            ms(*worst)
        );
    }
    println!("  {count} stall bursts in all");
    for (t, entries, live, took) in &scrapes {
        println!(
            "  scrape at {:.0} s: {took:.1?}, kvmesh_index_entries {entries}, kvmesh_sessions {live}",
            t.duration_since(run_started).as_secs_f64()
        );
    }
    println!(
        "  RSS: wave 1 {:.0} MiB ({:.0} at its end, after the page loop; peak {:.0}), after expiry {:.0} MiB, wave 2 {:.0} MiB (peak {:.0})",
        mib(summary.rss_wave1_kib),
        mib(summary.rss_wave1_end_kib),
        mib(summary.hwm_wave1_kib),
        mib(summary.rss_expired_kib),
        mib(summary.rss_wave2_kib),
        mib(summary.hwm_wave2_kib)
    );
    for (i, (expired, rss)) in summary.rss_later_kib.iter().enumerate() {
        println!(
            "  RSS: wave {}: after expiry {:.0} MiB, at its end {:.0} MiB",
            i + 3,
            mib(*expired),
            mib(*rss)
        );
    }
    Ok(summary)
}

/// What the sidecar says its index and ledger hold, to tell their memory
/// from the allocator's.
async fn print_sizes(http: &reqwest::Client, admin: std::net::SocketAddr, when: &str) {
    let Ok(reply) = http.get(format!("http://{admin}/metrics")).send().await else {
        return;
    };
    let Ok(text) = reply.text().await else { return };
    let mib_of = |name: &str| gauge(&text, name).unwrap_or(f64::NAN) / f64::from(1 << 20);
    println!(
        "  {when}: kvmesh_index_bytes {:.0} MiB, kvmesh_insight_trace_bytes {:.0} MiB",
        mib_of("kvmesh_index_bytes"),
        mib_of("kvmesh_insight_trace_bytes")
    );
}

/// Tells the fetch loop to end.
fn stop_flag() -> Arc<std::sync::atomic::AtomicBool> {
    Arc::new(std::sync::atomic::AtomicBool::new(false))
}
