//! `kvmesh-bench replay`: sends a workload as real HTTP chat calls, at the
//! trace's pace times a speed factor, to a URL (Envoy with kvmesh, or
//! anything else), or to a local deployment it starts itself (`--local N`:
//! Envoy + the kvmesh filter + the sidecar + N `kvmesh-sim` workers). It
//! measures time to first byte, latency and the cached tokens the workers
//! report, so the real path can be compared with `simulate`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::bail;
use kvmesh_integration::paths::Profile;
use kvmesh_integration::{Cluster, ClusterOptions};
use serde_json::{Value, json};

use crate::simulate::trace;

#[derive(Debug, clap::Args)]
pub(crate) struct Options {
    #[command(flatten)]
    workload: trace::WorkloadArgs,
    /// Base URL to send to (e.g. http://127.0.0.1:10000).
    #[arg(long, conflicts_with = "local")]
    url: Option<String>,
    /// Start a local deployment with this many simulated workers instead.
    #[arg(long)]
    local: Option<usize>,
    /// KV capacity of each local worker, in tokens.
    #[arg(long, default_value_t = 200_000)]
    capacity_tokens: u64,
    /// Local workers' time scale (0.1: ten times faster than the hardware
    /// they stand for).
    #[arg(long, default_value_t = 0.1)]
    time_scale: f64,
    /// Write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

struct Result {
    ttfb_ms: f64,
    latency_ms: f64,
    prompt_tokens: u64,
    cached_tokens: u64,
    ok: bool,
}

async fn send(client: &reqwest::Client, url: &str, r: &trace::Request) -> Result {
    let body = json!({"model": "sim", "messages": [{"role": "user", "content": r.text}],
                      "max_tokens": r.output_tokens, "stream": true, "stream_options": {"include_usage": true}});
    let mut request = client.post(format!("{url}/v1/chat/completions")).json(&body);
    if !r.session.is_empty() {
        request = request.header("x-session-id", &r.session);
    }
    if !r.parent.is_empty() {
        request = request.header("x-parent-session-id", &r.parent);
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

pub(crate) async fn run(o: Options) -> anyhow::Result<()> {
    let (_, requests) = o.workload.load()?;
    let cluster = match (o.local, &o.url) {
        (Some(workers), None) => Some(
            Cluster::start(ClusterOptions {
                workers,
                profile: Profile::Release,
                sim_args: vec![
                    "--time-scale".into(),
                    o.time_scale.to_string(),
                    "--capacity-tokens".into(),
                    o.capacity_tokens.to_string(),
                ],
                sidecar_args: vec![
                    "--prefill-tokens-per-ms".into(),
                    (20.0 / o.time_scale.max(1e-6)).to_string(),
                    "--scrape-interval-ms".into(),
                    "500".into(),
                ],
                plugin: json!({"sidecar_timeout_ms": 200}),
                ..ClusterOptions::default()
            })
            .await?,
        ),
        (None, Some(_)) => None,
        _ => bail!("give --url or --local N"),
    };
    let url = match &cluster {
        Some(c) => c.envoy_url.clone(),
        None => o.url.clone().unwrap_or_default(),
    };
    let client = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(600))
        .build()?;
    let requests = Arc::new(requests);
    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..requests.len() {
        let requests = requests.clone();
        let client = client.clone();
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            let r = &requests[i];
            let due = start + Duration::from_secs_f64(r.at_ms / 1e3);
            tokio::time::sleep_until(due.into()).await;
            send(&client, &url, r).await
        }));
    }
    let mut results = Vec::new();
    for t in tasks {
        results.push(t.await?);
    }
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
    let out = json!({
        "trace": o.workload.trace.display().to_string(),
        "requests": results.len(),
        "failed": results.len() - ok.len(),
        "hit_rate": cached as f64 / prompt.max(1) as f64,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "ttfb_p50_ms": at(&ttfb, 0.5),
        "ttfb_p99_ms": at(&ttfb, 0.99),
        "latency_p50_ms": at(&latency, 0.5),
        "latency_p99_ms": at(&latency, 0.99),
    });
    println!("{}", serde_json::to_string_pretty(&out)?);
    if let Some(path) = &o.json {
        std::fs::write(path, serde_json::to_string_pretty(&out)?)?;
    }
    drop(cluster);
    Ok(())
}
