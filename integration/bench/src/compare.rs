//! `kvmesh-bench compare`: kvmesh beside plain round robin and the real
//! peer routers, as arms in front of one deployment of real vLLM workers
//! (CPU build, the tiny model of `./dev setup-vllm`), driven by one client.
//!
//! Each round starts a fresh deployment (Envoy with and without the kvmesh
//! filter, the sidecar, N vLLM workers) and runs every arm once, in an
//! order rotated from round to round so no arm always goes first or last.
//! Every arm starts cold: each worker's prefix cache is reset and the reset
//! checked (vLLM answers `success: true` only when no block is held), the
//! peer router is a fresh process and kvmesh's sidecar a fresh one (its
//! index and sessions empty). What an arm achieved is read from the
//! engines' own counters (prompt and cached tokens per worker, before and
//! after), what the client saw from the client (time to first token,
//! failures), and the machine's load is sampled throughout.
//!
//! The arms: `kvmesh` (Envoy + the filter + the sidecar), `round_robin`
//! (the same Envoy, a listener without the filter), `smg` (the SGLang
//! Model Gateway's default, `cache_aware`) and `smg_sticky` (the same with
//! its routing key on the session header, its documented agent setting),
//! `dynamo` (Dynamo's frontend with its KV router fed by the engines' KV
//! events) and `dynamo_sticky` (the same with its session affinity, its
//! agent setting). Dynamo routes only to workers of its own runtime, so its
//! arms run over fresh `dynamo.vllm` workers (vLLM 0.31.0, the version
//! Dynamo 1.6.1 is written against) with the deployment's model and engine
//! flags, the deployment's own vLLM 0.32.0 workers idle meanwhile.
//! Peers are as `./dev setup-peers` installs them (docs/peers.md).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kvmesh_integration::Cluster;
use kvmesh_integration::peers::{
    Dynamo, DynamoAffinity, DynamoAffinityMode, DynamoEngineOptions, DynamoEngines, DynamoOptions, Smg, SmgOptions,
    SmgPolicy,
};
use kvmesh_integration::vllm::{SERVED_MODEL, metric_sum};
use serde_json::{Value, json};

use crate::replay::{self, DeployArgs, EngineKind};
use crate::simulate::trace;

/// One router under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
#[value(rename_all = "snake_case")]
pub(crate) enum Arm {
    /// Envoy with the kvmesh filter and a fresh sidecar.
    Kvmesh,
    /// The same Envoy's listener without the filter: its round robin.
    RoundRobin,
    /// smg 1.13.0, `--policy cache_aware` with its defaults.
    Smg,
    /// smg 1.13.0 `cache_aware` with sticky sessions on the session header
    /// (`--routing-key-override --routing-key-headers <header>`).
    SmgSticky,
    /// Dynamo 1.6.1's frontend, `--router-mode kv` with the engines' KV
    /// events (its defaults otherwise), over its own vLLM workers
    /// (`dynamo.vllm`, vLLM 0.31.0 CPU, the same model and engine flags).
    Dynamo,
    /// The same with session affinity on `x-dynamo-session-id`
    /// (`--router-session-affinity-ttl-secs 600`, hard mode, its default).
    DynamoSticky,
}

impl Arm {
    fn name(self) -> &'static str {
        match self {
            Self::Kvmesh => "kvmesh",
            Self::RoundRobin => "round_robin",
            Self::Smg => "smg",
            Self::SmgSticky => "smg_sticky",
            Self::Dynamo => "dynamo",
            Self::DynamoSticky => "dynamo_sticky",
        }
    }
}

/// What sends the calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum ClientKind {
    /// `replay`'s client: a trace's calls at its pace (`--trace`, `--speed`),
    /// streamed chat, with `x-session-id` and `x-dynamo-session-id`.
    Replay,
    /// AIPerf's multi-turn mode (`./dev setup-bench-clients`), which sends
    /// `X-Session-Affinity` on each turn.
    Aiperf,
}

impl ClientKind {
    /// The header that names a call's session, for the sticky arms.
    fn session_header(self) -> &'static str {
        match self {
            Self::Replay => "x-session-id",
            Self::Aiperf => "x-session-affinity",
        }
    }
}

#[derive(Debug, clap::Args)]
pub(crate) struct Options {
    /// The arms, comma-separated; each round runs them in this order
    /// rotated by the round's number.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "kvmesh,round_robin,smg,smg_sticky"
    )]
    arms: Vec<Arm>,
    /// Rounds, each on a fresh deployment.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// vLLM workers.
    #[arg(long, default_value_t = 3)]
    workers: usize,
    #[command(flatten)]
    deploy: DeployArgs,
    #[arg(long, value_enum, default_value_t = ClientKind::Replay)]
    client: ClientKind,
    /// Replay: the workload (a text trace file or directory).
    #[arg(long, required_if_eq("client", "replay"))]
    trace: Option<PathBuf>,
    /// Replay: arrival times divided by this.
    #[arg(long, default_value_t = 1.0)]
    speed: f64,
    /// Replay: start root sessions this many ms apart (traces recorded one
    /// session after another).
    #[arg(long)]
    session_spacing_ms: Option<f64>,
    /// Replay: only the first N calls.
    #[arg(long)]
    limit: Option<usize>,
    #[command(flatten)]
    aiperf: AiperfArgs,
    /// Where every run's results (JSON) and the processes' logs go.
    #[arg(long, default_value = "target/compare")]
    out: PathBuf,
}

/// AIPerf's multi-turn workload (integration/bench/aiperf.sh's defaults).
#[derive(Debug, Clone, clap::Args)]
struct AiperfArgs {
    #[arg(long, default_value_t = 14)]
    conversations: u32,
    #[arg(long, default_value_t = 9)]
    turns: u32,
    /// Input tokens added per turn.
    #[arg(long, default_value_t = 180)]
    isl: u32,
    /// Output tokens per turn.
    #[arg(long, default_value_t = 16)]
    osl: u32,
    #[arg(long, default_value_t = 5)]
    concurrency: u32,
    #[arg(long, default_value_t = 1)]
    aiperf_seed: u64,
}

/// One worker's engine counters.
#[derive(Debug, Clone, Copy, Default)]
struct EngineCounts {
    prompt: f64,
    cached: f64,
    finished: f64,
    preempted: f64,
}

async fn engine_counts(http: &reqwest::Client, metrics_url: &str) -> anyhow::Result<EngineCounts> {
    let text = http.get(metrics_url).send().await?.error_for_status()?.text().await?;
    let read = |name: &str| metric_sum(&text, name).unwrap_or(0.0);
    Ok(EngineCounts {
        prompt: read("vllm:prompt_tokens_total"),
        cached: read("vllm:prompt_tokens_cached_total"),
        finished: read("vllm:request_success_total"),
        preempted: read("vllm:num_preemptions_total"),
    })
}

async fn all_counts(http: &reqwest::Client, metrics_urls: &[String]) -> anyhow::Result<Vec<EngineCounts>> {
    let mut out = Vec::new();
    for url in metrics_urls {
        out.push(
            engine_counts(http, url)
                .await
                .with_context(|| format!("reading {url}"))?,
        );
    }
    Ok(out)
}

/// Empties every worker's prefix cache, and checks it: vLLM resets only
/// when no block is held (`{"success": false}` while a request runs), so
/// it is asked again until it says it did.
async fn reset_caches(http: &reqwest::Client, workers: &[String]) -> anyhow::Result<()> {
    for w in workers {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let reply: Value = http
                .post(format!("{w}/reset_prefix_cache"))
                .send()
                .await?
                .error_for_status()
                .with_context(|| format!("{w}/reset_prefix_cache (the workers need VLLM_SERVER_DEV_MODE=1)"))?
                .json()
                .await?;
            if reply["success"] == json!(true) {
                break;
            }
            if Instant::now() > deadline {
                bail!("{w} did not reset its prefix cache within 120 s: {reply}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    Ok(())
}

/// Warm-up prompts stay under one engine block (128 tokens with the chat
/// template), so they leave nothing in any prefix cache: vLLM caches whole
/// blocks only.
const WARM_UP_MAX_PROMPT_TOKENS: u64 = kvmesh_integration::vllm::BLOCK_SIZE_TOKENS;

/// Rounds of warm-up requests before an engine that never answered is an
/// error (Dynamo's router may send a round's requests to fewer engines).
const WARM_UP_ROUNDS: usize = 20;

/// Sends short chat calls, one to each of `targets` at once per round,
/// until every engine behind `engine_metrics` has finished a request.
/// A fresh vLLM CPU engine spends tens of seconds on its first request
/// (measured on `dynamo.vllm`'s vLLM 0.31: the first calls of a run waited
/// 20-37 s, later ones under a second): every arm's engines take that
/// before the measured calls, not during them. Returns the calls sent.
async fn warm_up(
    http: &reqwest::Client,
    targets: &[String],
    model: &str,
    engine_metrics: &[String],
) -> anyhow::Result<usize> {
    let mut sent = 0;
    for round in 0..WARM_UP_ROUNDS {
        if all_counts(http, engine_metrics)
            .await?
            .iter()
            .all(|c| c.finished >= 1.0)
        {
            return Ok(sent);
        }
        let calls = targets.iter().enumerate().map(|(i, url)| {
            let body = json!({
                "model": model,
                "messages": [{"role": "user", "content": format!("warm-up {round}.{i}")}],
                "max_tokens": 2,
            });
            async move {
                let reply: Value = http
                    .post(format!("{url}/v1/chat/completions"))
                    .timeout(Duration::from_secs(300))
                    .json(&body)
                    .send()
                    .await?
                    .error_for_status()?
                    .json()
                    .await?;
                let prompt = reply["usage"]["prompt_tokens"].as_u64().unwrap_or(u64::MAX);
                if prompt >= WARM_UP_MAX_PROMPT_TOKENS {
                    bail!("a warm-up call counted {prompt} prompt tokens: it could leave a cached block");
                }
                anyhow::Ok(())
            }
        });
        for done in futures_util::future::join_all(calls).await {
            done.context("warming the engines up")?;
        }
        sent += targets.len();
    }
    bail!("an engine had not answered after {sent} warm-up calls")
}

/// The 1-minute load average, sampled every 2 s while a run lasts.
struct LoadSampler {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<Vec<f64>>,
}

fn load_1m() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

impl LoadSampler {
    fn start() -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let task = tokio::spawn(async move {
            let mut samples = vec![load_1m()];
            while !flag.load(Ordering::Relaxed) {
                tokio::time::sleep(Duration::from_secs(2)).await;
                samples.push(load_1m());
            }
            samples
        });
        Self { stop, task }
    }

    async fn finish(self) -> Value {
        self.stop.store(true, Ordering::Relaxed);
        let samples = self.task.await.unwrap_or_default();
        let mut sorted = samples.clone();
        sorted.sort_by(f64::total_cmp);
        json!({
            "start": samples.first(),
            "end": samples.last(),
            "min": sorted.first(),
            "median": percentile(&sorted, 0.5),
            "max": sorted.last(),
            "samples": samples.len(),
        })
    }
}

/// The `p` quantile of sorted values (nearest rank below).
fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted
        .get(((sorted.len().max(1) - 1) as f64 * p) as usize)
        .copied()
        .unwrap_or(f64::NAN)
}

/// What the client saw of one run.
struct ClientOutcome {
    requests: usize,
    failed: usize,
    ttft_p50_ms: f64,
    ttft_p99_ms: f64,
    /// kvmesh only: the sidecar's predictions against the engines' reports,
    /// and each Pick's worker and reason.
    extra: Value,
    /// Replay: each call in the workload's order (session, TTFT, prompt and
    /// cached tokens as the reply's usage says), for the result file.
    calls: Value,
}

/// A running arm: where to send, where its engines count, and what to
/// stop afterwards (fields drop in order: a router before its engines).
struct RunningArm {
    url: String,
    model: String,
    /// Each engine's Prometheus text (`vllm:*` counters).
    engine_metrics: Vec<String>,
    _smg: Option<Smg>,
    _dynamo: Option<Dynamo>,
    _dynamo_engines: Option<DynamoEngines>,
}

impl RunningArm {
    /// An arm in front of the deployment's own vLLM workers.
    fn on_workers(url: String, workers: &[String], smg: Option<Smg>) -> Self {
        Self {
            url,
            model: SERVED_MODEL.to_owned(),
            engine_metrics: workers.iter().map(|w| format!("{w}/metrics")).collect(),
            _smg: smg,
            _dynamo: None,
            _dynamo_engines: None,
        }
    }
}

/// Dynamo's session affinity as its agent guide enables it: a TTL longer
/// than any session of these workloads, hard mode (the default).
const DYNAMO_AFFINITY_TTL_SECS: u64 = 600;

async fn start_arm(
    o: &Options,
    arm: Arm,
    cluster: &mut Cluster,
    workers: &[String],
    dir: &Path,
) -> anyhow::Result<RunningArm> {
    match arm {
        Arm::Kvmesh => {
            // A fresh sidecar: no index, no sessions, no learned rates from
            // an earlier arm.
            cluster.kill_sidecar()?;
            cluster.restart_sidecar()?;
            wait_for_sidecar(cluster, workers.len()).await?;
            Ok(RunningArm::on_workers(cluster.envoy_url.clone(), workers, None))
        }
        Arm::RoundRobin => Ok(RunningArm::on_workers(
            cluster
                .direct_url
                .clone()
                .context("the deployment has no listener without the filter")?,
            workers,
            None,
        )),
        Arm::Smg | Arm::SmgSticky => {
            let options = SmgOptions {
                policy: SmgPolicy::CacheAware,
                sticky_header: (arm == Arm::SmgSticky).then(|| o.client.session_header().to_owned()),
                ..SmgOptions::default()
            };
            let smg = tokio::task::block_in_place(|| Smg::start(workers, &options, dir))?;
            Ok(RunningArm::on_workers(smg.url(), workers, Some(smg)))
        }
        Arm::Dynamo | Arm::DynamoSticky => {
            // Dynamo routes only to workers of its own runtime: fresh
            // engines per arm, cold by construction (checked by the caller).
            let engine_options = DynamoEngineOptions {
                blocks: o.deploy.vllm_blocks,
                max_model_len: o.deploy.max_model_len,
                ..DynamoEngineOptions::default()
            };
            let engines = tokio::task::block_in_place(|| DynamoEngines::start(o.workers, &engine_options, dir))?;
            let options = DynamoOptions {
                session_affinity: (arm == Arm::DynamoSticky).then_some(DynamoAffinity {
                    ttl_secs: DYNAMO_AFFINITY_TTL_SECS,
                    mode: DynamoAffinityMode::Hard,
                }),
                ..DynamoOptions::default()
            };
            let dynamo = tokio::task::block_in_place(|| Dynamo::start(&engines, &options, dir))?;
            Ok(RunningArm {
                url: dynamo.url(),
                model: SERVED_MODEL.to_owned(),
                engine_metrics: engines.engines.iter().map(|e| e.metrics_url()).collect(),
                _smg: None,
                _dynamo: Some(dynamo),
                _dynamo_engines: Some(engines),
            })
        }
    }
}

/// The sidecar lists every worker (it starts routing to them as soon as it
/// knows them; their signals follow with the first scrape).
async fn wait_for_sidecar(cluster: &Cluster, workers: usize) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if cluster.sidecar_workers().await.is_ok_and(|w| w.len() >= workers) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the restarted sidecar did not list {workers} workers within 60 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn run_replay(o: &Options, arm: Arm, url: &str, model: &str, cluster: &Cluster) -> anyhow::Result<ClientOutcome> {
    let workload = trace::WorkloadArgs {
        trace: o.trace.clone().context("--trace is required with --client replay")?,
        format: trace::Format::Text,
        speed: o.speed,
        block_tokens: 512,
        session_spacing_ms: o.session_spacing_ms,
        limit: o.limit,
    };
    let (_, requests) = workload.load()?;
    let requests = Arc::new(requests);
    let results = replay::send_all(url, model, &requests).await?;
    let mut ttft: Vec<f64> = results.iter().filter(|r| r.ok).map(|r| r.ttfb_ms).collect();
    ttft.sort_by(f64::total_cmp);
    let extra = if arm == Arm::Kvmesh {
        // The sidecar logs each Pick just before it answers; its last lines
        // land within moments of the last reply.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let mut p = replay::predictions(cluster, &requests, &results).await?;
        // Calls the filter let through unrouted (no Pick answer in time):
        // a kvmesh arm is only kvmesh where this stays near zero.
        // (Counted over the deployment's life: kvmesh runs once per round.)
        let (sidecar_errors, timeouts) = cluster.fail_opens().await?;
        if let Some(p) = p.as_object_mut() {
            // Each Pick's worker and reason, in the order sent: where a
            // session went and why, beside `calls`' tokens.
            if let Some(calls) = p.remove("calls") {
                p.insert("picks".to_owned(), calls);
            }
            p.remove("tokens_per_block");
            p.insert("fail_open_sidecar_errors".to_owned(), json!(sidecar_errors));
            p.insert("fail_open_timeouts".to_owned(), json!(timeouts));
        }
        p
    } else {
        Value::Null
    };
    Ok(ClientOutcome {
        requests: results.len(),
        failed: results.iter().filter(|r| !r.ok).count(),
        ttft_p50_ms: percentile(&ttft, 0.5),
        ttft_p99_ms: percentile(&ttft, 0.99),
        extra,
        calls: requests
            .iter()
            .zip(&results)
            .map(|(q, r)| {
                json!({"session": q.session, "ok": r.ok, "ttft_ms": r.ttfb_ms, "latency_ms": r.latency_ms,
                       "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens})
            })
            .collect(),
    })
}

fn aiperf_binary() -> anyhow::Result<PathBuf> {
    let aiperf = kvmesh_integration::paths::repo_root().join(".tools/aiperf/bin/aiperf");
    if !aiperf.is_file() {
        bail!("AIPerf is not installed in .tools/aiperf: run `./dev setup-bench-clients`");
    }
    Ok(aiperf)
}

async fn run_aiperf(a: &AiperfArgs, url: &str, model: &str, dir: &Path) -> anyhow::Result<ClientOutcome> {
    let aiperf = aiperf_binary()?;
    let model_dir = kvmesh_integration::paths::repo_root().join(".tools/vllm-model");
    let artifacts = dir.join("aiperf");
    let log = std::fs::File::create(dir.join("aiperf.log"))?;
    // As integration/bench/aiperf.sh runs it; a local tokenizer folder is
    // read only with HF_HUB_OFFLINE unset.
    let status = tokio::process::Command::new(aiperf)
        .env_remove("HF_HUB_OFFLINE")
        .args([
            "profile",
            "--model",
            model,
            "--url",
            url,
            "--endpoint-type",
            "chat",
            "--streaming",
        ])
        .arg("--tokenizer")
        .arg(&model_dir)
        .args(["--conversation-num", &a.conversations.to_string()])
        .args([
            "--conversation-turn-mean",
            &a.turns.to_string(),
            "--conversation-turn-stddev",
            "0",
        ])
        .args([
            "--isl",
            &a.isl.to_string(),
            "--isl-stddev",
            "0",
            "--osl",
            &a.osl.to_string(),
        ])
        .args(["--extra-inputs", "ignore_eos:true"])
        .args(["--num-dataset-entries", &(a.conversations * a.turns * 2).to_string()])
        .args([
            "--concurrency",
            &a.concurrency.to_string(),
            "--random-seed",
            &a.aiperf_seed.to_string(),
        ])
        .args(["--ui-type", "none", "--no-server-metrics", "--workers-max", "2"])
        .arg("--output-artifact-dir")
        .arg(&artifacts)
        .stdout(log.try_clone()?)
        .stderr(log)
        .kill_on_drop(true)
        .status()
        .await?;
    if !status.success() {
        bail!("aiperf failed ({status}); see {}", dir.join("aiperf.log").display());
    }
    let summary = find_file(&artifacts, "profile_export_aiperf.json")?
        .with_context(|| format!("no profile_export_aiperf.json under {}", artifacts.display()))?;
    let data: Value = serde_json::from_str(&std::fs::read_to_string(&summary)?)?;
    let ttft = &data["time_to_first_token"];
    let failed: u64 = data["error_summary"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| e["count"].as_u64().unwrap_or(1))
        .sum();
    Ok(ClientOutcome {
        requests: data["request_count"]["avg"].as_f64().unwrap_or(0.0) as usize,
        failed: failed as usize,
        ttft_p50_ms: ttft["p50"].as_f64().unwrap_or(f64::NAN),
        ttft_p99_ms: ttft["p99"].as_f64().unwrap_or(f64::NAN),
        extra: Value::Null,
        // AIPerf's own per-call records are in its artifacts directory.
        calls: Value::Null,
    })
}

/// The first file called `name` under `dir`, depth first.
fn find_file(dir: &Path, name: &str) -> anyhow::Result<Option<PathBuf>> {
    let mut entries: Vec<_> = std::fs::read_dir(dir)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            if let Some(found) = find_file(&path, name)? {
                return Ok(Some(found));
            }
        } else if path.file_name().is_some_and(|n| n == name) {
            return Ok(Some(path));
        }
    }
    Ok(None)
}

/// Waits until the engines have finished as many requests as were sent
/// (their counters trail the replies slightly) or 30 s have passed.
async fn settle(
    http: &reqwest::Client,
    workers: &[String],
    before: &[EngineCounts],
    sent: usize,
) -> anyhow::Result<Vec<EngineCounts>> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let now = all_counts(http, workers).await?;
        let finished: f64 = now.iter().zip(before).map(|(a, b)| a.finished - b.finished).sum();
        if finished >= sent as f64 || Instant::now() > deadline {
            return Ok(now);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn run_arm(
    o: &Options,
    round: usize,
    position: usize,
    arm: Arm,
    cluster: &mut Cluster,
    http: &reqwest::Client,
) -> anyhow::Result<Value> {
    let workers: Vec<String> = cluster.workers.iter().map(|w| format!("http://{}", w.addr)).collect();
    let dir = o.out.join(format!("round{round}-{}", arm.name()));
    std::fs::create_dir_all(&dir)?;
    let dynamo = matches!(arm, Arm::Dynamo | Arm::DynamoSticky);
    if !dynamo {
        // The deployment's workers, each directly (no router learns from it).
        let metrics: Vec<String> = workers.iter().map(|w| format!("{w}/metrics")).collect();
        warm_up(http, &workers, SERVED_MODEL, &metrics).await?;
        reset_caches(http, &workers).await?;
    }
    let running = start_arm(o, arm, cluster, &workers, &dir).await?;
    if dynamo {
        // Dynamo's engines are reachable only through its frontend: as many
        // calls at once as engines, which its router spreads by their load.
        let targets = vec![running.url.clone(); running.engine_metrics.len()];
        warm_up(http, &targets, &running.model, &running.engine_metrics).await?;
    }
    let before = all_counts(http, &running.engine_metrics).await?;
    if dynamo && before.iter().any(|c| c.cached > 0.0) {
        bail!("Dynamo's fresh engines have cached prompts already: {before:?}");
    }
    let load = LoadSampler::start();
    let started = Instant::now();
    let outcome = match o.client {
        ClientKind::Replay => run_replay(o, arm, &running.url, &running.model, cluster).await,
        ClientKind::Aiperf => run_aiperf(&o.aiperf, &running.url, &running.model, &dir).await,
    };
    let wall_s = started.elapsed().as_secs_f64();
    let load = load.finish().await;
    let outcome = outcome?;
    let after = settle(
        http,
        &running.engine_metrics,
        &before,
        outcome.requests - outcome.failed,
    )
    .await?;
    drop(running);
    let per_worker: Vec<Value> = before
        .iter()
        .zip(&after)
        .map(|(b, a)| {
            json!({
                "requests": a.finished - b.finished,
                "prompt_tokens": a.prompt - b.prompt,
                "computed_tokens": (a.prompt - b.prompt) - (a.cached - b.cached),
                "preemptions": a.preempted - b.preempted,
            })
        })
        .collect();
    let prompt: f64 = per_worker.iter().filter_map(|w| w["prompt_tokens"].as_f64()).sum();
    let computed: Vec<f64> = per_worker
        .iter()
        .filter_map(|w| w["computed_tokens"].as_f64())
        .collect();
    let total_computed: f64 = computed.iter().sum();
    let imbalance =
        computed.iter().copied().fold(0.0, f64::max) / (total_computed / computed.len().max(1) as f64).max(1.0);
    let result = json!({
        "round": round,
        "position": position,
        "arm": arm.name(),
        "client": format!("{:?}", o.client).to_lowercase(),
        "requests": outcome.requests,
        "failed": outcome.failed,
        "hit_rate": (prompt - total_computed) / prompt.max(1.0),
        "prompt_tokens": prompt,
        "computed_tokens": total_computed,
        "imbalance_computed": imbalance,
        "ttft_p50_ms": outcome.ttft_p50_ms,
        "ttft_p99_ms": outcome.ttft_p99_ms,
        "per_worker": per_worker,
        "wall_s": wall_s,
        "load_1m": load,
        "kvmesh": outcome.extra,
        "calls": outcome.calls,
    });
    std::fs::write(dir.join("result.json"), serde_json::to_string_pretty(&result)?)?;
    Ok(result)
}

/// Round `round` (from 1) runs the arms rotated left by `round - 1`: over
/// as many rounds as arms, each arm runs once in every position.
fn order_for_round(arms: &[Arm], round: usize) -> Vec<Arm> {
    let mut order = arms.to_vec();
    if !arms.is_empty() {
        order.rotate_left(round.saturating_sub(1) % arms.len());
    }
    order
}

/// Median and range of one figure over an arm's runs.
fn spread(runs: &[&Value], key: &str) -> (f64, f64, f64) {
    let mut v: Vec<f64> = runs.iter().filter_map(|r| r[key].as_f64()).collect();
    v.sort_by(f64::total_cmp);
    (
        percentile(&v, 0.5),
        v.first().copied().unwrap_or(f64::NAN),
        v.last().copied().unwrap_or(f64::NAN),
    )
}

/// The per-arm summary, as docs/benchmarks.md prints it.
fn table(arms: &[Arm], results: &[Value]) -> String {
    let mut out = String::from(
        "| arm | runs | hit rate (engines) | TTFT p50 ms | TTFT p99 ms | imbalance (computed) | calls per worker, each run | failed | load median |\n\
         |---|---|---|---|---|---|---|---|---|\n",
    );
    for arm in arms {
        let runs: Vec<&Value> = results.iter().filter(|r| r["arm"] == arm.name()).collect();
        let fmt = |(m, lo, hi): (f64, f64, f64), digits: usize| format!("{m:.digits$} [{lo:.digits$}-{hi:.digits$}]");
        let failed: u64 = runs.iter().filter_map(|r| r["failed"].as_u64()).sum();
        let mut loads: Vec<f64> = runs.iter().filter_map(|r| r["load_1m"]["median"].as_f64()).collect();
        loads.sort_by(f64::total_cmp);
        // Sorted, so runs compare whichever worker took the most.
        let split: Vec<String> = runs
            .iter()
            .map(|r| {
                let mut calls: Vec<u64> = r["per_worker"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|w| w["requests"].as_f64())
                    .map(|c| c as u64)
                    .collect();
                calls.sort_unstable_by(|a, b| b.cmp(a));
                calls.iter().map(u64::to_string).collect::<Vec<_>>().join("/")
            })
            .collect();
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {:.2} |\n",
            arm.name(),
            runs.len(),
            fmt(spread(&runs, "hit_rate"), 3),
            fmt(spread(&runs, "ttft_p50_ms"), 0),
            fmt(spread(&runs, "ttft_p99_ms"), 0),
            fmt(spread(&runs, "imbalance_computed"), 2),
            split.join(", "),
            failed,
            percentile(&loads, 0.5),
        ));
    }
    out
}

/// Runs every round; on SIGINT or SIGTERM the rounds are abandoned, which
/// drops the deployment and the arm's router, and so stops every process
/// they started by its pid (vLLM by its process group).
pub(crate) async fn run(o: Options) -> anyhow::Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        done = rounds(o) => done,
        _ = tokio::signal::ctrl_c() => bail!("interrupted: stopped every process this run started"),
        _ = term.recv() => bail!("terminated: stopped every process this run started"),
    }
}

async fn rounds(o: Options) -> anyhow::Result<()> {
    if o.deploy.engine != EngineKind::Vllm {
        bail!("compare runs on real engines: give --engine vllm");
    }
    if o.arms.is_empty() || o.rounds == 0 {
        bail!("give at least one arm and one round");
    }
    if o.client == ClientKind::Aiperf && o.arms.contains(&Arm::DynamoSticky) {
        // Dynamo 1.6.1 names a session by x-dynamo-session-id (or
        // x-session-id and a few harnesses' own headers), not by AIPerf's
        // X-Session-Affinity: the arm would be `dynamo` under another name.
        bail!("dynamo_sticky needs a client that sends x-dynamo-session-id: AIPerf sends X-Session-Affinity only");
    }
    std::fs::create_dir_all(&o.out)?;
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(30))
        .build()?;
    let mut results = Vec::new();
    for round in 1..=o.rounds {
        let order = order_for_round(&o.arms, round);
        eprintln!(
            "compare: round {round}/{}: starting {} workers; arms {:?}",
            o.rounds, o.workers, order
        );
        let options = o
            .deploy
            .options(o.workers, vec![("VLLM_SERVER_DEV_MODE".to_owned(), "1".to_owned())])?;
        let mut cluster = Cluster::start(options).await?;
        for (position, arm) in order.into_iter().enumerate() {
            let result = run_arm(&o, round, position + 1, arm, &mut cluster, &http)
                .await
                .with_context(|| format!("round {round}, arm {}", arm.name()))?;
            eprintln!(
                "compare: round {round} {}: hit rate {:.3}, TTFT p50 {:.0} ms p99 {:.0} ms, failed {}, load {}",
                arm.name(),
                result["hit_rate"].as_f64().unwrap_or(f64::NAN),
                result["ttft_p50_ms"].as_f64().unwrap_or(f64::NAN),
                result["ttft_p99_ms"].as_f64().unwrap_or(f64::NAN),
                result["failed"],
                result["load_1m"]["median"],
            );
            results.push(result);
            std::fs::write(o.out.join("results.json"), serde_json::to_string_pretty(&results)?)?;
        }
        drop(cluster);
    }
    let summary = table(&o.arms, &results);
    std::fs::write(o.out.join("table.md"), &summary)?;
    println!("{summary}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_arm_takes_each_position_once_over_as_many_rounds_as_arms() {
        let arms = [Arm::Kvmesh, Arm::RoundRobin, Arm::Smg, Arm::SmgSticky];
        let orders: Vec<Vec<Arm>> = (1..=arms.len()).map(|r| order_for_round(&arms, r)).collect();
        assert_eq!(orders[0], arms);
        assert_eq!(orders[1], [Arm::RoundRobin, Arm::Smg, Arm::SmgSticky, Arm::Kvmesh]);
        for position in 0..arms.len() {
            let mut seen: Vec<Arm> = orders.iter().map(|o| o[position]).collect();
            seen.sort_by_key(|a| a.name());
            seen.dedup();
            assert_eq!(seen.len(), arms.len(), "position {position}: {orders:?}");
        }
        assert!(order_for_round(&[], 3).is_empty());
    }

    #[test]
    fn the_table_gives_each_arms_median_and_range() {
        let runs = [
            json!({"arm": "kvmesh", "hit_rate": 0.9, "ttft_p50_ms": 80.0, "ttft_p99_ms": 900.0, "imbalance_computed": 1.2, "failed": 0, "load_1m": {"median": 1.0},
                   "per_worker": [{"requests": 3.0}, {"requests": 5.0}, {"requests": 4.0}]}),
            json!({"arm": "kvmesh", "hit_rate": 0.8, "ttft_p50_ms": 60.0, "ttft_p99_ms": 700.0, "imbalance_computed": 1.1, "failed": 1, "load_1m": {"median": 3.0}}),
            json!({"arm": "kvmesh", "hit_rate": 0.85, "ttft_p50_ms": 70.0, "ttft_p99_ms": 800.0, "imbalance_computed": 1.3, "failed": 0, "load_1m": {"median": 2.0}}),
            json!({"arm": "smg", "hit_rate": 0.5, "ttft_p50_ms": 100.0, "ttft_p99_ms": 1000.0, "imbalance_computed": 1.5, "failed": 0, "load_1m": {"median": 2.0}}),
        ];
        let table = table(&[Arm::Kvmesh, Arm::Smg], &runs);
        assert!(
            table.contains(
                "| kvmesh | 3 | 0.850 [0.800-0.900] | 70 [60-80] | 800 [700-900] | 1.20 [1.10-1.30] | 5/4/3, ,  | 1 | 2.00 |"
            ),
            "{table}"
        );
        assert!(table.contains("| smg | 1 | 0.500 [0.500-0.500] |"), "{table}");
    }
}
