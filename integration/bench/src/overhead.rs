//! The filter-overhead benchmark (see the crate docs).

use std::time::{Duration, Instant};

use kvmesh_integration::paths::Profile;

use crate::latency::{ms, percentile};
use kvmesh_integration::{Cluster, ClusterOptions};
use serde_json::json;

#[derive(Debug, clap::Args)]
pub(crate) struct Options {
    /// Body sizes in KB (1000 KB is written 1MB in the report).
    #[arg(long, value_delimiter = ',', default_values_t = [10usize, 100, 400, 1000])]
    sizes_kb: Vec<usize>,
    /// Measured requests per size, per listener and per round.
    #[arg(long, default_value_t = 200)]
    requests: usize,
    /// Rounds per size: the report gives the median of the rounds' figures
    /// and their range, so one noisy stretch of the machine shows as such.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Unmeasured requests per size first (connections, JIT, caches).
    #[arg(long, default_value_t = 40)]
    warmup: usize,
    /// The filter's block hash (`xxh3` or `sha256`).
    #[arg(long, default_value = "xxh3")]
    hash: String,
}

/// An OpenAI chat body of about `bytes`: a coding agent's system prompt, then
/// tool round trips until the size is reached.
pub(crate) fn agent_body(bytes: usize) -> Vec<u8> {
    let mut messages = vec![json!({"role": "system", "content": "You are a coding agent. Use the tools. ".repeat(60)})];
    let mut size = 3000;
    let mut turn = 0;
    while size < bytes {
        let result = format!(
            "// src/file_{turn}.rs\n{}",
            "pub fn f(x: u32) -> u32 { x * 2 }\n".repeat(60)
        );
        size += result.len() + 200;
        messages.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": format!("c{turn}"),
            "type": "function", "function": {"name": "read_file", "arguments": format!("{{\"path\":\"src/file_{turn}.rs\"}}")}}]}));
        messages.push(json!({"role": "tool", "tool_call_id": format!("c{turn}"), "content": result}));
        turn += 1;
    }
    serde_json::to_vec(&json!({"model": "qwen3-coder-30b", "messages": messages, "max_tokens": 1, "stream": false}))
        .unwrap_or_default()
}

async fn timed_post(client: &reqwest::Client, url: &str, body: &[u8], session: &str) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let response = client
        .post(url)
        .header("content-type", "application/json")
        .header("x-session-id", session)
        .body(body.to_vec())
        .send()
        .await?;
    let status = response.status();
    response.bytes().await?;
    anyhow::ensure!(status.is_success(), "{url} answered {status}");
    Ok(started.elapsed())
}

/// One round's figures, in milliseconds.
#[derive(Debug, Clone, Copy)]
struct Round {
    median_without: f64,
    median_with: f64,
    p99_without: f64,
    p99_with: f64,
    /// Median over pairs of (with − without): each pair ran back to back, so
    /// the machine's slower and faster stretches cancel out.
    paired_added: f64,
}

/// `requests` pairs, alternating which listener goes first so neither always
/// follows the other's cache effects.
async fn measure(
    client: &reqwest::Client,
    [with_filter, direct]: [&str; 2],
    body: &[u8],
    warmup: usize,
    requests: usize,
) -> anyhow::Result<Round> {
    let (mut without, mut with, mut paired) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..warmup + requests {
        let order = if i % 2 == 0 { [true, false] } else { [false, true] };
        let mut pair = [Duration::ZERO; 2];
        for filtered in order {
            let url = if filtered { with_filter } else { direct };
            pair[usize::from(filtered)] = timed_post(client, url, body, "bench-session").await?;
        }
        if i >= warmup {
            without.push(pair[0]);
            with.push(pair[1]);
            paired.push(ms(pair[1]) - ms(pair[0]));
        }
    }
    with.sort();
    without.sort();
    paired.sort_by(f64::total_cmp);
    Ok(Round {
        median_without: ms(percentile(&without, 0.5)),
        median_with: ms(percentile(&with, 0.5)),
        p99_without: ms(percentile(&without, 0.99)),
        p99_with: ms(percentile(&with, 0.99)),
        paired_added: paired.get(paired.len() / 2).copied().unwrap_or_default(),
    })
}

pub(crate) async fn run(options: Options) -> anyhow::Result<()> {
    let cluster = Cluster::start(ClusterOptions {
        workers: 1,
        baseline_listener: true,
        plugin: json!({ "hash": options.hash }),
        profile: Profile::Release,
        ..ClusterOptions::default()
    })
    .await?;
    let with_filter = format!("{}/v1/chat/completions", cluster.envoy_url);
    let direct = format!("{}/v1/chat/completions", cluster.direct_url.clone().unwrap_or_default());
    // One keep-alive connection per listener, like an agent's HTTP client.
    let client = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(4)
        .build()?;

    println!(
        "| body | requests | median without | median with | median added (range over rounds) | **paired median added** (range) | p99 without | p99 with | p99 added (range) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for &kb in &options.sizes_kb {
        let body = agent_body(kb * 1000);
        let mut rounds = Vec::new();
        for round in 0..options.rounds.max(1) {
            let warmup = if round == 0 { options.warmup } else { 0 };
            rounds.push(measure(&client, [&with_filter, &direct], &body, warmup, options.requests).await?);
        }
        let pick = |f: fn(&Round) -> f64| {
            let mut values: Vec<f64> = rounds.iter().map(f).collect();
            values.sort_by(f64::total_cmp);
            (values[values.len() / 2], values[0], values[values.len() - 1])
        };
        let (m0, ..) = pick(|r| r.median_without);
        let (m1, ..) = pick(|r| r.median_with);
        let (added, added_lo, added_hi) = pick(|r| r.median_with - r.median_without);
        let (p0, ..) = pick(|r| r.p99_without);
        let (p1, ..) = pick(|r| r.p99_with);
        let (p99_added, p99_lo, p99_hi) = pick(|r| r.p99_with - r.p99_without);
        let (paired, paired_lo, paired_hi) = pick(|r| r.paired_added);
        let label = if kb >= 1000 {
            format!("{} MB", kb / 1000)
        } else {
            format!("{kb} KB")
        };
        println!(
            "| {label} ({} bytes) | {}×{} | {m0:.3} ms | {m1:.3} ms | {added:.3} ms ({added_lo:.3}–{added_hi:.3}) | **{paired:.3} ms** ({paired_lo:.3}–{paired_hi:.3}) | {p0:.3} ms | {p1:.3} ms | {p99_added:.3} ms ({p99_lo:.3}–{p99_hi:.3}) |",
            body.len(),
            rounds.len(),
            options.requests,
        );
    }
    let picks = cluster.envoy_counter("wasmcustom.kvmesh.picks").await?;
    let fail_opens = cluster.envoy_counter("wasmcustom.kvmesh.fail_open.timeout").await?
        + cluster
            .envoy_counter("wasmcustom.kvmesh.fail_open.sidecar_error")
            .await?;
    println!("\nfilter picks: {picks}, fail-opens: {fail_opens}");
    Ok(())
}
