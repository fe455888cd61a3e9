//! `kvmesh-bench replay`: sends a workload as real HTTP chat calls, at the
//! trace's pace times a speed factor, to a URL (Envoy with kvmesh, or
//! anything else), or to a local deployment it starts itself (`--local N`:
//! Envoy + the kvmesh filter + the sidecar + N workers, `kvmesh-sim` or real
//! vLLM engines). It measures time to first byte, latency and the cached
//! tokens the workers report, so the real path can be compared with
//! `simulate`, and, against a local deployment, what the sidecar predicted
//! would be cached. `kvmesh-bench serve` starts the same deployment and
//! waits, for other clients (AIPerf).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kvmesh_integration::paths::Profile;
use kvmesh_integration::vllm::{self, VllmInstall, VllmOptions};
use kvmesh_integration::{Cluster, ClusterOptions, Engine};
use serde_json::{Value, json};

use crate::simulate::trace;

/// What serves as a local worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum EngineKind {
    /// `kvmesh-sim`, the simulated engine (`--capacity-tokens`, `--time-scale`).
    Sim,
    /// A real vLLM (CPU build, the tiny model of `./dev setup-vllm`) per
    /// worker (`--vllm-blocks`).
    Vllm,
}

/// The local deployment, shared by `replay --local` and `serve`.
#[derive(Debug, clap::Args)]
pub(crate) struct DeployArgs {
    /// The workers' engine.
    #[arg(long, value_enum, default_value_t = EngineKind::Sim)]
    pub(crate) engine: EngineKind,
    /// vLLM only: each worker's KV capacity in 128-token blocks
    /// (`--num-gpu-blocks-override`); vLLM 0.32 wants one block more than
    /// `--max-model-len` needs (33 for 4096).
    #[arg(long, default_value_t = 64)]
    pub(crate) vllm_blocks: u32,
    /// vLLM only: `--max-model-len`, prompt plus completion in tokens.
    #[arg(long, default_value_t = 4096)]
    pub(crate) max_model_len: u32,
    /// vLLM only: each worker publishes its KV cache events to the sidecar
    /// (`--kv-events`), which then evicts in step with the engines.
    #[arg(long)]
    pub(crate) kv_events: bool,
    /// Simulated workers only: KV capacity of each worker, in tokens.
    #[arg(long, default_value_t = 200_000)]
    capacity_tokens: u64,
    /// Simulated workers only: their time scale (0.1: ten times faster than
    /// the hardware they stand for).
    #[arg(long, default_value_t = 0.1)]
    time_scale: f64,
}

impl DeployArgs {
    /// The model name requests carry.
    pub(crate) fn model(&self) -> &'static str {
        match self.engine {
            EngineKind::Sim => "sim",
            EngineKind::Vllm => vllm::SERVED_MODEL,
        }
    }

    /// Starts Envoy (with the kvmesh listener and the baseline listener
    /// without the filter), the sidecar and `workers` workers.
    pub(crate) async fn start(&self, workers: usize) -> anyhow::Result<Cluster> {
        Cluster::start(self.options(workers, Vec::new())?).await
    }

    /// The deployment `start` starts; `vllm_env` is more environment for
    /// each vLLM worker.
    pub(crate) fn options(&self, workers: usize, vllm_env: Vec<(String, String)>) -> anyhow::Result<ClusterOptions> {
        Ok(match self.engine {
            EngineKind::Sim => ClusterOptions {
                workers,
                profile: Profile::Release,
                sim_args: vec![
                    "--time-scale".into(),
                    self.time_scale.to_string(),
                    "--capacity-tokens".into(),
                    self.capacity_tokens.to_string(),
                ],
                sidecar_args: sidecar_args(20.0 / self.time_scale.max(1e-6)),
                plugin: json!({"sidecar_timeout_ms": 200}),
                baseline_listener: true,
                ..ClusterOptions::default()
            },
            EngineKind::Vllm => {
                // Fails early, naming the setup step, before anything starts.
                VllmInstall::find()?;
                ClusterOptions {
                    workers,
                    profile: Profile::Release,
                    engine: Engine::Vllm(VllmOptions {
                        blocks: self.vllm_blocks,
                        max_model_len: self.max_model_len,
                        extra_env: vllm_env,
                        ..VllmOptions::default()
                    }),
                    // The sidecar learns the engines' real prefill rate from
                    // their usage; this is only its starting guess (the tiny
                    // model on 2 shared cores, about 20 tokens per ms).
                    sidecar_args: sidecar_args(20.0),
                    plugin: json!({"sidecar_timeout_ms": 200}),
                    baseline_listener: true,
                    kv_events: self.kv_events,
                    ..ClusterOptions::default()
                }
            }
        })
    }
}

fn sidecar_args(prefill_tokens_per_ms: f64) -> Vec<String> {
    vec![
        "--prefill-tokens-per-ms".into(),
        prefill_tokens_per_ms.to_string(),
        "--scrape-interval-ms".into(),
        "500".into(),
        // In place of the cluster's `--log info`. The per-pick
        // debug line (session, predicted cached blocks, destination) is how
        // `replay` pairs each call with its prediction.
        "--log".into(),
        "info,kvmesh_sidecar::state=debug".into(),
    ]
}

#[derive(Debug, clap::Args)]
pub(crate) struct Options {
    #[command(flatten)]
    workload: trace::WorkloadArgs,
    /// Base URL to send to (e.g. http://127.0.0.1:10000).
    #[arg(long, conflicts_with = "local")]
    url: Option<String>,
    /// Start a local deployment with this many workers instead.
    #[arg(long)]
    local: Option<usize>,
    /// The model name calls carry (default: the local deployment's, or
    /// `sim` with `--url`).
    #[arg(long)]
    model: Option<String>,
    #[command(flatten)]
    deploy: DeployArgs,
    /// Local deployment only: send to Envoy's listener without the kvmesh
    /// filter (plain round robin over the same workers), as the baseline.
    #[arg(long, requires = "local")]
    no_kvmesh: bool,
    /// Also write the results (printed as JSON either way) here: hit rate,
    /// TTFT, latency, failed calls, `reported_cached_tokens` (the engines'
    /// usage); through a local kvmesh, `predicted_cached_tokens` (each
    /// Pick's prediction in engine tokens, as the sidecar logs it: its
    /// predicted blocks at the learned bytes per token, in whole engine
    /// blocks once the engine's block size is known) and
    /// `prediction_error` (mean over calls of |predicted − reported| /
    /// prompt tokens), `per_worker` calls and computed prompt tokens with
    /// their `imbalance` (max over mean); the file also lists every paired
    /// call (`calls`).
    #[arg(long)]
    json: Option<PathBuf>,
}

/// One call as the client saw it.
pub(crate) struct Result {
    pub(crate) ttfb_ms: f64,
    pub(crate) latency_ms: f64,
    pub(crate) prompt_tokens: u64,
    pub(crate) cached_tokens: u64,
    pub(crate) ok: bool,
}

/// The session headers every call carries: kvmesh's and smg's sticky key
/// (`x-session-id`) and Dynamo's (`x-dynamo-session-id`), each router
/// reading the one it knows, so one client drives every router alike.
const SESSION_HEADERS: [(&str, &str); 2] = [
    ("x-session-id", "x-parent-session-id"),
    ("x-dynamo-session-id", "x-dynamo-parent-session-id"),
];

async fn send(client: &reqwest::Client, url: &str, model: &str, r: &trace::Request) -> Result {
    let body = json!({"model": model, "messages": [{"role": "user", "content": r.text}],
                      "max_tokens": r.output_tokens, "stream": true, "stream_options": {"include_usage": true}});
    let mut request = client.post(format!("{url}/v1/chat/completions")).json(&body);
    for (session, parent) in SESSION_HEADERS {
        if !r.session.is_empty() {
            request = request.header(session, &r.session);
        }
        if !r.parent.is_empty() {
            request = request.header(parent, &r.parent);
        }
    }
    let started = Instant::now();
    let failed = Result {
        ttfb_ms: 0.0,
        latency_ms: 0.0,
        prompt_tokens: 0,
        cached_tokens: 0,
        ok: false,
    };
    let Ok(mut response) = request.send().await else {
        return failed;
    };
    if !response.status().is_success() {
        return failed;
    }
    let mut ttfb = None;
    let mut text = Vec::new();
    while let Ok(Some(chunk)) = response.chunk().await {
        ttfb.get_or_insert_with(|| started.elapsed());
        text.extend_from_slice(&chunk);
    }
    let text = String::from_utf8_lossy(&text);
    let usage = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find_map(|v| v.get("usage").filter(|u| u.is_object()).cloned())
        .unwrap_or(Value::Null);
    Result {
        ttfb_ms: ttfb.unwrap_or_default().as_secs_f64() * 1e3,
        latency_ms: started.elapsed().as_secs_f64() * 1e3,
        prompt_tokens: usage["prompt_tokens"].as_u64().unwrap_or(0),
        cached_tokens: usage
            .pointer("/prompt_tokens_details/cached_tokens")
            .and_then(Value::as_u64)
            .unwrap_or(0),
        ok: true,
    }
}

/// One Pick as the sidecar logged it.
struct LoggedPick {
    predicted_blocks: u64,
    /// The sidecar's own conversion to engine tokens (whole engine blocks).
    predicted_tokens: Option<u64>,
    destination: String,
    /// Why the router chose it (`Reason::as_str`).
    reason: String,
}

/// The value of `key=` in a tracing line (`session=a cached=3 ...`).
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|word| word.strip_prefix(key)?.strip_prefix('='))
}

/// The sidecar's per-pick debug lines, per session in the order picked.
fn logged_picks(log: &str) -> HashMap<String, VecDeque<LoggedPick>> {
    let mut picks: HashMap<String, VecDeque<LoggedPick>> = HashMap::new();
    for line in log
        .lines()
        .map(kvmesh_integration::process::without_colour)
        .filter(|l| l.contains(" pick session="))
    {
        let line = line.as_str();
        let (Some(session), Some(cached)) = (field(line, "session"), field(line, "cached")) else {
            continue;
        };
        let Ok(predicted_blocks) = cached.parse() else {
            continue;
        };
        picks.entry(session.to_owned()).or_default().push_back(LoggedPick {
            predicted_blocks,
            predicted_tokens: field(line, "cached_tokens").and_then(|t| t.parse().ok()),
            // A `&str` field is logged in its Debug form, quoted.
            destination: field(line, "destination")
                .unwrap_or_default()
                .trim_matches('"')
                .to_owned(),
            reason: field(line, "reason").unwrap_or_default().trim_matches('"').to_owned(),
        });
    }
    picks
}

/// What the sidecar predicted, call by call where its log pairs each call
/// with its Pick, converted to tokens with each worker's learned tokens per
/// (filter) block from `/debug/workers`.
pub(crate) async fn predictions(
    cluster: &Cluster,
    requests: &[trace::Request],
    results: &[Result],
) -> anyhow::Result<Value> {
    let http = reqwest::Client::builder().no_proxy().build()?;
    let workers: Value = http
        .get(format!("http://{}/debug/workers", cluster.sidecar_admin))
        .send()
        .await?
        .json()
        .await?;
    let tokens_per_block: HashMap<String, f64> = workers["workers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|w| Some((w["address"].as_str()?.to_owned(), w["tokens_per_block"].as_f64()?)))
        .collect();
    let log = std::fs::read_to_string(cluster.dir.join("sidecar.log")).context("reading the sidecar's log")?;
    let mut picks = logged_picks(&log);
    // Calls are sent in trace order; a session's calls are picked in the
    // order they were sent as long as each waits for the one before, which
    // holds for agent sessions (think and tool time between calls).
    let mut predicted_tokens = 0.0;
    let mut predicted_blocks = 0u64;
    let mut errors = Vec::new();
    let mut calls = Vec::new();
    let mut unpaired = 0usize;
    let mut order: Vec<usize> = (0..requests.len()).collect();
    order.sort_by(|a, b| requests[*a].at_ms.total_cmp(&requests[*b].at_ms));
    for i in order {
        let Some(pick) = picks.get_mut(&requests[i].session).and_then(VecDeque::pop_front) else {
            unpaired += 1;
            continue;
        };
        predicted_blocks += pick.predicted_blocks;
        let predicted = match pick.predicted_tokens {
            Some(tokens) => tokens as f64,
            None => pick.predicted_blocks as f64 * tokens_per_block.get(&pick.destination).copied().unwrap_or(0.0),
        };
        predicted_tokens += predicted;
        let r = &results[i];
        if r.ok && r.prompt_tokens > 0 {
            errors.push((predicted - r.cached_tokens as f64).abs() / r.prompt_tokens as f64);
            calls.push(json!({
                "session": requests[i].session,
                "destination": pick.destination,
                "reason": pick.reason,
                "predicted_blocks": pick.predicted_blocks,
                "predicted_cached_tokens": predicted,
                "reported_cached_tokens": r.cached_tokens,
                "prompt_tokens": r.prompt_tokens,
            }));
        }
    }
    let mean_error = errors.iter().sum::<f64>() / errors.len().max(1) as f64;
    // Where the calls went: calls and computed (uncached) prompt tokens per
    // worker, and the imbalance of the latter (max over mean), as `simulate`
    // reports it.
    let mut per_worker: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for call in &calls {
        let worker = per_worker
            .entry(call["destination"].as_str().unwrap_or_default().to_owned())
            .or_default();
        worker.0 += 1;
        worker.1 += call["prompt_tokens"]
            .as_u64()
            .unwrap_or(0)
            .saturating_sub(call["reported_cached_tokens"].as_u64().unwrap_or(0));
    }
    let computed: Vec<f64> = per_worker.values().map(|w| w.1 as f64).collect();
    let mean_computed = computed.iter().sum::<f64>() / computed.len().max(1) as f64;
    let imbalance = computed.iter().copied().fold(0.0, f64::max) / mean_computed.max(1.0);
    Ok(json!({
        "predicted_cached_tokens": predicted_tokens.round(),
        "predicted_cached_blocks": predicted_blocks,
        "tokens_per_block": tokens_per_block,
        "prediction_error": mean_error,
        "prediction_error_calls": errors.len(),
        "prediction_unpaired_calls": unpaired,
        "per_worker": per_worker.iter().map(|(w, (calls, computed))| (w.clone(), json!({"calls": calls, "computed_prompt_tokens": computed}))).collect::<serde_json::Map<_, _>>(),
        "imbalance": imbalance,
        "calls": calls,
    }))
}

/// Sends every request at its time (from now), each on its own task, and
/// returns what each got, in the workload's order.
pub(crate) async fn send_all(
    url: &str,
    model: &str,
    requests: &Arc<Vec<trace::Request>>,
) -> anyhow::Result<Vec<Result>> {
    let client = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(600))
        .build()?;
    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..requests.len() {
        let requests = requests.clone();
        let client = client.clone();
        let url = url.to_owned();
        let model = model.to_owned();
        tasks.push(tokio::spawn(async move {
            let r = &requests[i];
            let due = start + Duration::from_secs_f64(r.at_ms / 1e3);
            tokio::time::sleep_until(due.into()).await;
            send(&client, &url, &model, r).await
        }));
    }
    let mut results = Vec::new();
    for t in tasks {
        results.push(t.await?);
    }
    Ok(results)
}

pub(crate) async fn run(o: Options) -> anyhow::Result<()> {
    let (_, requests) = o.workload.load()?;
    let cluster = match (o.local, &o.url) {
        (Some(workers), None) => Some(o.deploy.start(workers).await?),
        (None, Some(_)) => None,
        _ => bail!("give --url or --local N"),
    };
    let url = match &cluster {
        Some(c) if o.no_kvmesh => c
            .direct_url
            .clone()
            .context("the deployment has no baseline listener")?,
        Some(c) => c.envoy_url.clone(),
        None => o.url.clone().unwrap_or_default(),
    };
    let model = match (&o.model, &cluster) {
        (Some(model), _) => model.as_str(),
        (None, Some(_)) => o.deploy.model(),
        (None, None) => "sim",
    };
    let requests = Arc::new(requests);
    let start = Instant::now();
    let results = send_all(&url, model, &requests).await?;
    let wall_s = start.elapsed().as_secs_f64();
    let ok: Vec<&Result> = results.iter().filter(|r| r.ok).collect();
    let prompt: u64 = ok.iter().map(|r| r.prompt_tokens).sum();
    let cached: u64 = ok.iter().map(|r| r.cached_tokens).sum();
    let mut ttfb: Vec<f64> = ok.iter().map(|r| r.ttfb_ms).collect();
    ttfb.sort_by(f64::total_cmp);
    let mut latency: Vec<f64> = ok.iter().map(|r| r.latency_ms).collect();
    latency.sort_by(f64::total_cmp);
    let at = |v: &[f64], p: f64| {
        v.get(((v.len().max(1) - 1) as f64 * p) as usize)
            .copied()
            .unwrap_or(0.0)
    };
    let mut out = json!({
        "trace": o.workload.trace.display().to_string(),
        "engine": if cluster.is_some() { format!("{:?}", o.deploy.engine).to_lowercase() } else { "remote".to_owned() },
        "kvmesh": !o.no_kvmesh,
        "kv_events": o.deploy.kv_events,
        "requests": results.len(),
        "failed": results.len() - ok.len(),
        "hit_rate": cached as f64 / prompt.max(1) as f64,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "reported_cached_tokens": cached,
        "ttfb_p50_ms": at(&ttfb, 0.5),
        "ttfb_p99_ms": at(&ttfb, 0.99),
        "latency_p50_ms": at(&latency, 0.5),
        "latency_p99_ms": at(&latency, 0.99),
        "wall_s": wall_s,
    });
    // Only a local deployment with the filter in the path has predictions.
    if let Some(cluster) = cluster.as_ref().filter(|_| !o.no_kvmesh) {
        // The last outcomes and the sidecar's log lines land just after the
        // last reply.
        tokio::time::sleep(Duration::from_millis(500)).await;
        if let (Some(out), Value::Object(extra)) =
            (out.as_object_mut(), predictions(cluster, &requests, &results).await?)
        {
            out.extend(extra);
        }
    }
    // Per call, for whoever wants to see where predictions missed: in the
    // file only, not on the terminal.
    let calls = out.as_object_mut().and_then(|o| o.remove("calls"));
    println!("{}", serde_json::to_string_pretty(&out)?);
    if let Some(path) = &o.json {
        if let (Some(out), Some(calls)) = (out.as_object_mut(), calls) {
            out.insert("calls".to_owned(), calls);
        }
        std::fs::write(path, serde_json::to_string_pretty(&out)?)?;
    }
    drop(cluster);
    Ok(())
}

#[derive(Debug, clap::Args)]
pub(crate) struct ServeOptions {
    /// Workers to start.
    #[arg(long, default_value_t = 3)]
    local: usize,
    #[command(flatten)]
    deploy: DeployArgs,
}

/// `kvmesh-bench serve`: starts the local deployment, prints one JSON line
/// with its URLs, and stops everything on SIGINT or SIGTERM.
pub(crate) async fn serve(o: ServeOptions) -> anyhow::Result<()> {
    // Listening before anything starts: a signal while the engines are still
    // starting abandons the start instead of killing this process and
    // leaving them behind. Every process started is stopped by its pid when
    // dropped; vLLM engines start on a blocking thread, which the runtime
    // lets finish before exiting, so they are stopped as soon as they are up.
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let cluster = tokio::select! {
        cluster = o.deploy.start(o.local) => cluster?,
        _ = tokio::signal::ctrl_c() => return Ok(()),
        _ = term.recv() => return Ok(()),
    };
    let ready = json!({
        "kvmesh_url": cluster.envoy_url,
        "baseline_url": cluster.direct_url,
        "sidecar_admin": format!("http://{}", cluster.sidecar_admin),
        "workers": cluster.workers.iter().map(|w| format!("http://{}", w.addr)).collect::<Vec<_>>(),
        "model": o.deploy.model(),
        "dir": cluster.dir.display().to_string(),
    });
    println!("{ready}");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    // Dropping the cluster stops every process by pid (vLLM by its group).
    drop(cluster);
    Ok(())
}
