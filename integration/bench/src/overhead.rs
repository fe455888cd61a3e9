//! The filter-overhead benchmark (see the crate docs).

use std::time::{Duration, Instant};

use kvmesh_integration::paths::Profile;
use kvmesh_integration::{Cluster, ClusterOptions};
use serde_json::json;

#[derive(Debug, clap::Args)]
pub(crate) struct Options {
    /// Body sizes in KB (1000 KB is written 1MB in the report).
    #[arg(long, value_delimiter = ',', default_values_t = [10usize, 100, 400, 1000])]
    sizes_kb: Vec<usize>,
    /// Measured requests per size and per listener.
    #[arg(long, default_value_t = 400)]
    requests: usize,
    /// Unmeasured requests per size first (connections, JIT, caches).
    #[arg(long, default_value_t = 40)]
    warmup: usize,
}

/// An OpenAI chat body of about `bytes`: a coding agent's system prompt, then
/// tool round trips until the size is reached.
fn agent_body(bytes: usize) -> Vec<u8> {
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

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let rank = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted.get(rank).copied().unwrap_or_default()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
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

pub(crate) async fn run(options: Options) -> anyhow::Result<()> {
    let cluster = Cluster::start(ClusterOptions {
        workers: 1,
        baseline_listener: true,
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

    println!("| body | requests | median without | median with | median added | p99 without | p99 with | p99 added |");
    println!("|---|---|---|---|---|---|---|---|");
    for &kb in &options.sizes_kb {
        let body = agent_body(kb * 1000);
        let (mut without, mut with) = (Vec::new(), Vec::new());
        for i in 0..options.warmup + options.requests {
            // Alternate which listener goes first, so neither always follows
            // the other's cache effects.
            let order = if i % 2 == 0 { [true, false] } else { [false, true] };
            for filtered in order {
                let url = if filtered { &with_filter } else { &direct };
                let took = timed_post(&client, url, &body, "bench-session").await?;
                if i >= options.warmup {
                    if filtered { with.push(took) } else { without.push(took) }
                }
            }
        }
        with.sort();
        without.sort();
        let label = if kb >= 1000 {
            format!("{} MB", kb / 1000)
        } else {
            format!("{kb} KB")
        };
        let (m0, m1) = (percentile(&without, 0.5), percentile(&with, 0.5));
        let (p0, p1) = (percentile(&without, 0.99), percentile(&with, 0.99));
        println!(
            "| {label} ({} bytes) | {} | {:.3} ms | {:.3} ms | **{:.3} ms** | {:.3} ms | {:.3} ms | {:.3} ms |",
            body.len(),
            options.requests,
            ms(m0),
            ms(m1),
            ms(m1) - ms(m0),
            ms(p0),
            ms(p1),
            ms(p1) - ms(p0),
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
