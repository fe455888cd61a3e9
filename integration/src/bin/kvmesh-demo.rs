//! `kvmesh-demo`: starts 3 simulated GPU workers, the kvmesh sidecar and a
//! real Envoy with the kvmesh filter, sends the same two agent sessions
//! through Envoy twice, once with kvmesh choosing the worker and once with
//! plain round robin (a listener of the same Envoy without the filter, same
//! workers, their caches reset in between), prints where each call went,
//! what the engine served from its cache, its time to first token (TTFT,
//! the prefill a cached prefix shortens) and its whole latency (mostly
//! decode, the same on any worker), compares the two runs, then stops
//! everything it started. Calls are streamed, as agents send them, so the
//! first token's arrival can be timed.
#![forbid(unsafe_code)]

use std::time::Duration;

use anyhow::Context;
use kvmesh_integration::{AgentSession, Cluster, ClusterOptions, Reply};

const TURNS: usize = 6;
/// The engines run at half of real time, so the demo takes seconds: 24
/// calls of 64 decode steps. Not faster: the prefill a cached prefix saves
/// (about 25 ms of a cold call's TTFT here) must stay well above the few
/// milliseconds the proxy path adds to every call; at a tenth of real time
/// it was 2-3 ms of a 10-12 ms TTFT.
const TIME_SCALE: f64 = 0.5;
/// The sim's prefill rate in engine time (its default: one H100, ~30B model).
const PREFILL_TOKENS_PER_MS: f64 = 20.0;

/// One agent session: its harness, the header carrying its id, the id.
#[derive(Debug)]
struct Session {
    label: &'static str,
    header: &'static str,
    id: &'static str,
    calls: AgentSession,
}

/// What one run of the sessions added up to.
#[derive(Debug, Default)]
struct RunTotals {
    prompt: u64,
    cached: u64,
    /// Each call's time to first token: what prefix reuse shortens.
    ttfts: Vec<Duration>,
    /// Each call's time to its last byte.
    latencies: Vec<Duration>,
}

impl RunTotals {
    fn hit_rate(&self) -> f64 {
        100.0 * self.cached as f64 / self.prompt.max(1) as f64
    }

    /// Prompt tokens the engines had to compute.
    fn prefilled(&self) -> u64 {
        self.prompt - self.cached
    }
}

fn median(durations: &[Duration]) -> Duration {
    let mut sorted = durations.to_vec();
    sorted.sort();
    match sorted.len() {
        0 => Duration::ZERO,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2,
    }
}

fn ms(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1e3
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    println!(
        "kvmesh demo: starting redis-server, 3 simulated workers, kvmesh-sidecar and Envoy with the kvmesh filter..."
    );
    let defaults = ClusterOptions::default();
    let cluster = Cluster::start(
        ClusterOptions {
            // In wall time: prefill 25 µs per uncached token after a fixed
            // 2.5 ms, and 2.4 ms per decode step (64 output tokens per call;
            // about 4 ms as measured, tokio's millisecond timer rounding up);
            // the sidecar prices prefill at the same scaled rate.
            sim_args: vec![
                "--time-scale".into(),
                TIME_SCALE.to_string(),
                "--prefill-tokens-per-ms".into(),
                PREFILL_TOKENS_PER_MS.to_string(),
            ],
            sidecar_args: vec![
                "--prefill-tokens-per-ms".into(),
                (PREFILL_TOKENS_PER_MS / TIME_SCALE).to_string(),
            ],
            redis: true,
            baseline_listener: true,
            ..defaults
        }
        // The filter waits up to 5 s for each Pick: the shipped 50 ms budget
        // fails a call open to round robin when a busy machine answers late,
        // and the demo compares where kvmesh sends calls, not how fast the
        // machine is (the fail-opens line still counts a sidecar that errs
        // or hangs).
        .patient(),
    )
    .await?;
    let workers = cluster.worker_names();
    for (i, addr) in workers.iter().enumerate() {
        println!("  worker{i}: {addr}");
    }
    println!(
        "  sidecar: gRPC {}, admin http://{}",
        cluster.sidecar_grpc, cluster.sidecar_admin
    );
    if let Some(redis) = &cluster.redis {
        println!("  redis:   {}", redis.url());
    }
    let direct_url = cluster
        .direct_url
        .clone()
        .context("the cluster has no baseline listener")?;
    println!(
        "  envoy:   kvmesh listener {}, round-robin listener {} (admin {})",
        cluster.envoy_url, direct_url, cluster.envoy_admin
    );

    // Two agents at work at once: a Claude Code session and a Codex session,
    // their calls interleaved, each prompt resending the whole conversation.
    let sessions = [
        Session {
            label: "claude-code",
            header: "x-claude-code-session-id",
            id: "3b7e1d2c-claude",
            calls: AgentSession::new("acme/payments"),
        },
        Session {
            label: "codex",
            header: "session-id",
            id: "0199a1f4-codex",
            calls: AgentSession::new("acme/search"),
        },
    ];
    // One connection per listener for every call: it stays on one Envoy
    // thread, whose round robin then cycles the workers in a fixed order, so
    // both runs are the same on every run of the demo. HTTP/2 (Envoy's
    // listener takes it without TLS): over HTTP/1 a call sent right after
    // the last one's final chunk may race the connection's return to the
    // pool and open a second one, landing on the other Envoy thread and its
    // round robin (seen once in a run of the streamed demo). The timeout
    // bounds the demo: a hung call still ends in `main` returning and the
    // cluster stopping its processes (they run in their own sessions, so
    // killing the demo would leave them running).
    let http = reqwest::Client::builder()
        .no_proxy()
        .http2_prior_knowledge()
        .timeout(Duration::from_secs(10))
        .build()?;

    println!("\n1. through kvmesh: the filter asks the sidecar which worker holds the prefix");
    let kvmesh = run(&http, &cluster.envoy_url, &sessions, &workers).await?;

    // Otherwise round robin would find the prefixes kvmesh's run left. The
    // sim speaks HTTP/1 only.
    let admin = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(10))
        .build()?;
    for worker in &cluster.workers {
        let status = admin
            .post(format!("http://{}/admin/reset-cache", worker.addr))
            .send()
            .await?
            .status();
        anyhow::ensure!(status.is_success(), "cache reset of {} failed: {status}", worker.addr);
    }
    println!("\n2. through plain round robin: same Envoy, same workers (caches reset), no kvmesh filter");
    let round_robin = run(&http, &direct_url, &sessions, &workers).await?;

    println!(
        "\n{:<12} {:>13} {:>13} {:>7} {:>12} {:>15}",
        "run", "prompt tok", "cached tok", "hit", "median ttft", "median latency"
    );
    for (name, totals) in [("kvmesh", &kvmesh), ("round robin", &round_robin)] {
        println!(
            "{name:<12} {:>13} {:>13} {:>6.1}% {:>10.1}ms {:>13.1}ms",
            totals.prompt,
            totals.cached,
            totals.hit_rate(),
            ms(median(&totals.ttfts)),
            ms(median(&totals.latencies)),
        );
    }
    println!(
        "ratio: kvmesh served {} the cached tokens of round robin; the engines computed {} prompt tokens instead of {} ({} fewer)",
        times(kvmesh.cached, round_robin.cached),
        kvmesh.prefilled(),
        round_robin.prefilled(),
        times(round_robin.prefilled(), kvmesh.prefilled()),
    );
    // Without this line the close latency medians read as "kvmesh changes
    // nothing".
    let saved_ms =
        round_robin.prefilled().saturating_sub(kvmesh.prefilled()) as f64 * TIME_SCALE / PREFILL_TOKENS_PER_MS;
    println!("ttft: from sending a call to its first output token, mostly the prefill of its uncached prompt tokens");
    println!(
        "latency: to its last byte, mostly its 64 simulated decode steps, the same on any worker; the prefill kvmesh \
         saved is {saved_ms:.1} ms over {} calls at this time scale",
        kvmesh.latencies.len()
    );
    println!(
        "kvmesh picks in Envoy: {} (run 1 only), fail-opens: {}",
        cluster.envoy_counter("wasmcustom.kvmesh.picks").await?,
        cluster
            .envoy_counter("wasmcustom.kvmesh.fail_open.sidecar_error")
            .await?
            + cluster.envoy_counter("wasmcustom.kvmesh.fail_open.timeout").await?
    );
    println!("stopping everything the demo started.");
    drop(cluster);
    Ok(())
}

/// Sends every session's calls, interleaved, to the Envoy listener at
/// `base_url`, printing one row per call.
async fn run(
    http: &reqwest::Client,
    base_url: &str,
    sessions: &[Session],
    workers: &[String],
) -> anyhow::Result<RunTotals> {
    println!(
        "{:<12} {:>4}  {:<8} {:>13} {:>13} {:>7} {:>9} {:>9}",
        "session", "turn", "worker", "prompt tok", "cached tok", "hit", "ttft", "latency"
    );
    let mut totals = RunTotals::default();
    for turn in 0..TURNS {
        for session in sessions {
            let request = http
                .post(format!("{base_url}/v1/chat/completions"))
                .header("content-type", "application/json")
                .header(session.header, session.id)
                .body(serde_json::to_vec(&session.calls.streamed_call(turn))?);
            let reply = Reply::read_streamed(request).await?;
            if reply.status != 200 {
                anyhow::bail!("call failed with {}: {}", reply.status, reply.body);
            }
            let ttft = reply
                .first_token
                .with_context(|| format!("no output token in the stream: {}", reply.body))?;
            let prompt = reply.prompt_tokens().unwrap_or(0);
            let cached = reply.cached_tokens().unwrap_or(0);
            totals.prompt += prompt;
            totals.cached += cached;
            totals.ttfts.push(ttft);
            totals.latencies.push(reply.latency);
            let worker = reply
                .worker
                .as_deref()
                .and_then(|name| workers.iter().position(|w| w == name))
                .map_or_else(|| "?".to_owned(), |i| format!("worker{i}"));
            println!(
                "{:<12} {turn:>4}  {worker:<8} {prompt:>13} {cached:>13} {:>6.1}% {:>7.1}ms {:>7.1}ms",
                session.label,
                100.0 * cached as f64 / prompt.max(1) as f64,
                ms(ttft),
                ms(reply.latency),
            );
        }
    }
    Ok(totals)
}

/// `a / b` as "3.2x" ("inf x" when `b` is 0).
fn times(a: u64, b: u64) -> String {
    if b == 0 {
        "inf x".to_owned()
    } else {
        format!("{:.1}x", a as f64 / b as f64)
    }
}
