//! The filter-overhead benchmark (see the crate docs).

use std::time::{Duration, Instant};

use kvmesh_integration::paths::Profile;

use crate::latency::{ms, percentile};
use futures_util::StreamExt;
use kvmesh_integration::{Cluster, ClusterOptions};
use kvmesh_vocab::FILTER_TIME_PHASES;
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
    /// Another build of the filter (a `kvmesh_filter.wasm`) to measure in
    /// the same run: a second Envoy, sidecar and worker load it, and every
    /// pair of the filter under test is followed (or preceded) by a pair of
    /// this one, so both see the same stretch of a noisy machine. The report
    /// then gives both and the ratio of their paired medians per round.
    #[arg(long)]
    against: Option<std::path::PathBuf>,
    /// Send each body at this rate (megabits per second) instead of as fast
    /// as loopback takes it: one write per millisecond of rate/8 KB, as a
    /// client on a link of that speed delivers it. Over loopback Envoy
    /// otherwise reads a 1 MB body in 2-3 pieces, nearly all of it in the
    /// last. 0 sends at once.
    #[arg(long, default_value_t = 0)]
    paced_mbps: usize,
    /// Plugin settings merged over `{"hash": …}` for both builds (a JSON
    /// object), e.g. `{"max_blocks": 1}` to see what buffering and a Pick
    /// cost with almost nothing hashed.
    #[arg(long, default_value = "{}")]
    plugin: String,
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

async fn timed_post(
    client: &reqwest::Client,
    url: &str,
    body: &[u8],
    session: &str,
    paced_mbps: usize,
) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let request = client
        .post(url)
        .header("content-type", "application/json")
        .header("x-session-id", session);
    let request = if paced_mbps == 0 {
        request.body(body.to_vec())
    } else {
        // `paced_mbps` megabits per second is that many times 125 bytes per ms.
        let per_ms = (paced_mbps * 125).max(1);
        let pieces: Vec<Vec<u8>> = body.chunks(per_ms).map(<[u8]>::to_vec).collect();
        let stream = futures_util::stream::iter(pieces.into_iter().enumerate()).then(|(n, piece)| async move {
            if n > 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            Ok::<_, std::io::Error>(piece)
        });
        request
            .header("content-length", body.len())
            .body(reqwest::Body::wrap_stream(stream))
    };
    let response = request.send().await?;
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

/// `requests` pairs per build, alternating which listener goes first so
/// neither always follows the other's cache effects, and which build goes
/// first in each step, so both builds share every stretch of the run.
async fn measure(
    client: &reqwest::Client,
    builds: &[[String; 2]],
    body: &[u8],
    warmup: usize,
    requests: usize,
    paced_mbps: usize,
) -> anyhow::Result<Vec<Round>> {
    let mut samples = vec![(Vec::new(), Vec::new(), Vec::new()); builds.len()];
    for i in 0..warmup + requests {
        let order = if i % 2 == 0 { [true, false] } else { [false, true] };
        for step in 0..builds.len() {
            let build = (step + i / 2) % builds.len();
            let [with_filter, direct] = &builds[build];
            let mut pair = [Duration::ZERO; 2];
            for filtered in order {
                let url = if filtered { with_filter } else { direct };
                pair[usize::from(filtered)] = timed_post(client, url, body, "bench-session", paced_mbps).await?;
            }
            if i >= warmup {
                let (without, with, paired) = &mut samples[build];
                without.push(pair[0]);
                with.push(pair[1]);
                paired.push(ms(pair[1]) - ms(pair[0]));
            }
        }
    }
    Ok(samples
        .into_iter()
        .map(|(mut without, mut with, mut paired)| {
            with.sort();
            without.sort();
            paired.sort_by(f64::total_cmp);
            Round {
                median_without: ms(percentile(&without, 0.5)),
                median_with: ms(percentile(&with, 0.5)),
                p99_without: ms(percentile(&without, 0.99)),
                p99_with: ms(percentile(&with, 0.99)),
                paired_added: paired.get(paired.len() / 2).copied().unwrap_or_default(),
            }
        })
        .collect())
}

/// The median of `values` and their range.
fn spread(mut values: Vec<f64>) -> (f64, f64, f64) {
    values.sort_by(f64::total_cmp);
    (values[values.len() / 2], values[0], values[values.len() - 1])
}

async fn start(options: &Options, wasm: Option<std::path::PathBuf>) -> anyhow::Result<(Cluster, [String; 2])> {
    let mut plugin = json!({ "hash": options.hash });
    let extra: serde_json::Map<String, serde_json::Value> = serde_json::from_str(&options.plugin)?;
    if let Some(object) = plugin.as_object_mut() {
        object.extend(extra);
    }
    let cluster = Cluster::start(ClusterOptions {
        workers: 1,
        baseline_listener: true,
        plugin,
        profile: Profile::Release,
        filter_wasm: wasm,
        ..ClusterOptions::default()
    })
    .await?;
    let with_filter = format!("{}/v1/chat/completions", cluster.envoy_url);
    let direct = format!("{}/v1/chat/completions", cluster.direct_url.clone().unwrap_or_default());
    Ok((cluster, [with_filter, direct]))
}

pub(crate) async fn run(options: Options) -> anyhow::Result<()> {
    let mut clusters = vec![start(&options, None).await?];
    if let Some(against) = &options.against {
        clusters.push(start(&options, Some(against.canonicalize()?)).await?);
    }
    let builds: Vec<[String; 2]> = clusters.iter().map(|(_, urls)| urls.clone()).collect();
    // One keep-alive connection per listener, like an agent's HTTP client.
    let client = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(4)
        .build()?;

    let names = ["this build", "against"];
    let mut phases = Vec::new();
    for (cluster, _) in &clusters {
        phases.push(phase_times(cluster).await);
    }
    let mut breakdown = String::new();
    let mut tables = vec![String::new(); builds.len()];
    let mut ratios = String::new();
    for &kb in &options.sizes_kb {
        let body = agent_body(kb * 1000);
        let mut rounds: Vec<Vec<Round>> = vec![Vec::new(); builds.len()];
        for round in 0..options.rounds.max(1) {
            let warmup = if round == 0 { options.warmup } else { 0 };
            for (build, figures) in measure(&client, &builds, &body, warmup, options.requests, options.paced_mbps)
                .await?
                .into_iter()
                .enumerate()
            {
                rounds[build].push(figures);
            }
        }
        let label = if kb >= 1000 {
            format!("{} MB", kb / 1000)
        } else {
            format!("{kb} KB")
        };
        for (build, rounds) in rounds.iter().enumerate() {
            let pick = |f: fn(&Round) -> f64| spread(rounds.iter().map(f).collect());
            let (m0, ..) = pick(|r| r.median_without);
            let (m1, ..) = pick(|r| r.median_with);
            let (added, added_lo, added_hi) = pick(|r| r.median_with - r.median_without);
            let (p0, ..) = pick(|r| r.p99_without);
            let (p1, ..) = pick(|r| r.p99_with);
            let (p99_added, p99_lo, p99_hi) = pick(|r| r.p99_with - r.p99_without);
            let (paired, paired_lo, paired_hi) = pick(|r| r.paired_added);
            tables[build] += &format!(
                "| {label} ({} bytes) | {}×{} | {m0:.3} ms | {m1:.3} ms | {added:.3} ms ({added_lo:.3}–{added_hi:.3}) | **{paired:.3} ms** ({paired_lo:.3}–{paired_hi:.3}) | {p0:.3} ms | {p1:.3} ms | {p99_added:.3} ms ({p99_lo:.3}–{p99_hi:.3}) |\n",
                body.len(),
                rounds.len(),
                options.requests,
            );
        }
        for (build, (cluster, _)) in clusters.iter().enumerate() {
            let now = phase_times(cluster).await;
            if let Some(line) = phase_line(&phases[build], &now) {
                breakdown += &format!("| {label} | {} | {line} |\n", names[build]);
            }
            phases[build] = now;
        }
        if let [ours, theirs] = &rounds[..] {
            let (ratio, lo, hi) = spread(
                ours.iter()
                    .zip(theirs)
                    .map(|(a, b)| a.paired_added / b.paired_added)
                    .collect(),
            );
            let (a, ..) = spread(ours.iter().map(|r| r.paired_added).collect());
            let (b, ..) = spread(theirs.iter().map(|r| r.paired_added).collect());
            ratios += &format!("| {label} | {a:.3} ms | {b:.3} ms | **{ratio:.2}×** ({lo:.2}–{hi:.2}) |\n");
        }
    }
    for (build, table) in tables.iter().enumerate() {
        if builds.len() > 1 {
            println!("\n**{}**\n", names[build]);
        }
        println!(
            "| body | requests | median without | median with | median added (range over rounds) | **paired median added** (range) | p99 without | p99 with | p99 added (range) |"
        );
        println!("|---|---|---|---|---|---|---|---|---|");
        print!("{table}");
    }
    if !ratios.is_empty() {
        println!("\n| body | paired median added, this build | against | **ratio** (range over rounds) |");
        println!("|---|---|---|---|");
        print!("{ratios}");
    }
    if !breakdown.is_empty() {
        println!(
            "\nPer request, µs (mean; `phase-timing` builds): {}",
            breakdown_columns().join(" / ")
        );
        print!("{breakdown}");
    }
    for (build, (cluster, _)) in clusters.iter().enumerate() {
        let picks = cluster.envoy_counter("wasmcustom.kvmesh.picks").await?;
        let fail_opens = cluster.envoy_counter("wasmcustom.kvmesh.fail_open.timeout").await?
            + cluster
                .envoy_counter("wasmcustom.kvmesh.fail_open.sidecar_error")
                .await?;
        // Builds before the chunked path have neither counter.
        let chunks = cluster
            .envoy_counter("wasmcustom.kvmesh.body_chunks")
            .await
            .unwrap_or(0);
        let ahead = cluster
            .envoy_counter("wasmcustom.kvmesh.hashed_ahead_bytes")
            .await
            .unwrap_or(0);
        println!(
            "\n{}: filter picks: {picks}, fail-opens: {fail_opens}, body chunks: {chunks}, stream bytes hashed before the last chunk: {ahead}",
            names[build]
        );
    }
    Ok(())
}

/// The breakdown's columns: the phases a `phase-timing` build of the filter
/// times (`kvmesh.time_us.*`, its last counter being the requests), then
/// the sidecar's own time deciding a Pick.
fn breakdown_columns() -> Vec<&'static str> {
    let timed = &FILTER_TIME_PHASES[..FILTER_TIME_PHASES.len() - 1];
    timed.iter().copied().chain(["sidecar_pick"]).collect()
}

async fn phase_times(cluster: &Cluster) -> Vec<u64> {
    let mut out = Vec::new();
    for phase in FILTER_TIME_PHASES {
        out.push(
            cluster
                .envoy_counter(&format!("wasmcustom.kvmesh.time_us.{phase}"))
                .await
                .unwrap_or(0),
        );
    }
    // The sidecar's Pick histogram, in µs, before the request count.
    let sum = cluster
        .sidecar_metric("kvmesh_pick_duration_seconds_sum")
        .await
        .unwrap_or(0.0);
    out.insert(FILTER_TIME_PHASES.len() - 1, (sum * 1e6) as u64);
    out
}

/// Mean µs per request of each phase between two readings, if counted.
fn phase_line(before: &[u64], after: &[u64]) -> Option<String> {
    let delta: Vec<u64> = after.iter().zip(before).map(|(a, b)| a.saturating_sub(*b)).collect();
    let requests = *delta.last()?;
    (requests > 0).then(|| {
        delta[..FILTER_TIME_PHASES.len()]
            .iter()
            .map(|us| format!("{:.0}", *us as f64 / requests as f64))
            .collect::<Vec<_>>()
            .join(" | ")
    })
}
