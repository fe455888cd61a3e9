//! The sidecar is never on the critical path of success: killed, the filter
//! fails open at once; stalled (SIGSTOP), it fails open at its timeout.
//! Every request still succeeds, and the added latency is bounded.

use std::time::Duration;

use kvmesh_integration::process::Signal;
use kvmesh_integration::{AgentSession, Cluster, ClusterOptions, Reply};

const TIMEOUT_MS: u64 = 100;
const CALLS: usize = 12;

async fn run_calls(cluster: &Cluster, label: &str) -> anyhow::Result<Vec<Reply>> {
    let mut replies = Vec::new();
    for i in 0..CALLS {
        let session = AgentSession::new(&format!("{label}/repo-{i}"));
        let reply = cluster
            .chat(&session.call(i % 4), &[("x-session-id", &format!("{label}-{i}"))])
            .await?;
        assert_eq!(reply.status, 200, "{label} call {i}: {}", reply.body);
        assert!(reply.worker.is_some(), "{label} call {i}: no worker answered");
        replies.push(reply);
    }
    Ok(replies)
}

fn median(replies: &[Reply]) -> Duration {
    let mut latencies: Vec<Duration> = replies.iter().map(|r| r.latency).collect();
    latencies.sort();
    latencies[latencies.len() / 2]
}

fn max(replies: &[Reply]) -> Duration {
    replies.iter().map(|r| r.latency).max().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_succeed_when_the_sidecar_is_killed_or_stalled() -> anyhow::Result<()> {
    let mut cluster = Cluster::start(ClusterOptions {
        plugin: serde_json::json!({ "sidecar_timeout_ms": TIMEOUT_MS }),
        ..ClusterOptions::default()
    })
    .await?;
    let timeout = Duration::from_millis(TIMEOUT_MS);
    // Slack for a loaded 2-core machine: the median must sit within a few ms,
    // a single outlier within a scheduling hiccup.
    let median_slack = Duration::from_millis(15);
    let max_slack = Duration::from_millis(80);

    let healthy = run_calls(&cluster, "healthy").await?;
    assert!(
        healthy.iter().all(|r| r.saw_destination.is_some()),
        "healthy sidecar did not route"
    );
    let baseline = median(&healthy);

    // Killed: the connection is refused, the filter continues at once.
    cluster.kill_sidecar()?;
    let killed = run_calls(&cluster, "killed").await?;
    assert!(killed.iter().all(|r| r.saw_destination.is_none()));
    assert!(
        median(&killed) <= baseline + median_slack,
        "killed sidecar: median {:?} vs baseline {baseline:?}",
        median(&killed)
    );
    let refused = cluster
        .envoy_counter("wasmcustom.kvmesh.fail_open.sidecar_error")
        .await?;
    assert_eq!(refused, CALLS as u64);

    // Back: routing resumes on the same address with no Envoy change.
    cluster.restart_sidecar()?;
    let mut routed_again = false;
    for i in 0..50 {
        let reply = cluster.chat(&AgentSession::new("restart").call(i % 3), &[]).await?;
        assert_eq!(reply.status, 200);
        if reply.saw_destination.is_some() {
            routed_again = true;
            break;
        }
    }
    assert!(routed_again, "the restarted sidecar was never used");

    // Stalled: connections open but nothing answers until the timeout.
    cluster.sidecar.signal(Signal::SIGSTOP)?;
    let stalled = run_calls(&cluster, "stalled").await;
    cluster.sidecar.signal(Signal::SIGCONT)?;
    let stalled = stalled?;
    assert!(stalled.iter().all(|r| r.saw_destination.is_none()));
    let added = median(&stalled).saturating_sub(baseline);
    assert!(
        added >= timeout.mul_f64(0.9) && added <= timeout + median_slack,
        "stalled sidecar: median added latency {added:?}, timeout {timeout:?}"
    );
    assert!(
        max(&stalled) <= baseline + timeout + max_slack,
        "stalled sidecar: worst call {:?}",
        max(&stalled)
    );
    assert_eq!(
        cluster.envoy_counter("wasmcustom.kvmesh.fail_open.timeout").await?,
        CALLS as u64
    );
    eprintln!(
        "fail-open latency: baseline median {baseline:?}; killed median {:?}; stalled median {:?} max {:?} (timeout {timeout:?})",
        median(&killed),
        median(&stalled),
        max(&stalled)
    );
    Ok(())
}
