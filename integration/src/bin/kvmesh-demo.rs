//! `kvmesh-demo`: starts 3 simulated GPU workers, the kvmesh sidecar and a
//! real Envoy with the kvmesh filter, sends two agent sessions through Envoy,
//! prints where each call went and what the engine served from its cache,
//! then stops everything it started.
#![forbid(unsafe_code)]

use kvmesh_integration::{AgentSession, Cluster, ClusterOptions};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    println!(
        "kvmesh demo: starting redis-server, 3 simulated workers, kvmesh-sidecar and Envoy with the kvmesh filter..."
    );
    let defaults = ClusterOptions::default();
    let cluster = Cluster::start(ClusterOptions {
        // Engine timing at a tenth of real time: prefill 50 µs per uncached token.
        sim_args: vec!["--time-scale".into(), "0.1".into()],
        sidecar_args: vec!["--prefill-tokens-per-ms".into(), "200".into()],
        redis: true,
        ..defaults
    })
    .await?;
    println!("  workers: {}", cluster.worker_names().join(", "));
    println!(
        "  sidecar: gRPC {}, admin http://{}",
        cluster.sidecar_grpc, cluster.sidecar_admin
    );
    if let Some(redis) = &cluster.redis {
        println!("  redis:   {}", redis.url());
    }
    println!("  envoy:   {} (admin {})\n", cluster.envoy_url, cluster.envoy_admin);

    // Two agents at work at once: a Claude Code session and a Codex session,
    // their calls interleaved, each prompt resending the whole conversation.
    let sessions = [
        (
            "claude-code",
            "x-claude-code-session-id",
            "3b7e1d2c-claude",
            AgentSession::new("acme/payments"),
        ),
        (
            "codex",
            "session-id",
            "0199a1f4-codex",
            AgentSession::new("acme/search"),
        ),
    ];
    println!(
        "{:<12} {:>4}  {:<22} {:>13} {:>13} {:>7} {:>9}",
        "session", "turn", "worker", "prompt tok", "cached tok", "hit", "latency"
    );
    let (mut prompt_total, mut cached_total) = (0u64, 0u64);
    for turn in 0..6 {
        for (label, header, id, session) in &sessions {
            let reply = cluster.chat(&session.call(turn), &[(header, id)]).await?;
            let prompt = reply.prompt_tokens().unwrap_or(0);
            let cached = reply.cached_tokens().unwrap_or(0);
            prompt_total += prompt;
            cached_total += cached;
            println!(
                "{label:<12} {turn:>4}  {:<22} {prompt:>13} {cached:>13} {:>6.1}% {:>7.1}ms",
                reply.worker.as_deref().unwrap_or("?"),
                100.0 * cached as f64 / prompt.max(1) as f64,
                reply.latency.as_secs_f64() * 1e3,
            );
            if reply.status != 200 {
                anyhow::bail!("call failed with {}: {}", reply.status, reply.body);
            }
        }
    }
    println!(
        "\nprompt tokens served from cache: {cached_total} of {prompt_total} ({:.1}%)",
        100.0 * cached_total as f64 / prompt_total.max(1) as f64
    );
    println!(
        "kvmesh picks in Envoy: {}, fail-opens: {}",
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
