//! The sidecar is never on the critical path of success: killed, the filter
//! fails open at once; stalled (SIGSTOP), it fails open at its timeout.
//! Every request still succeeds.
//!
//! What proves the path is the filter's own counters: a killed sidecar
//! counts a `sidecar_error` per call and not one `timeout` (the filter tells
//! the two apart by how long it waited, so a call that had waited out its
//! deadline would count a timeout); a stalled one counts a `timeout` per
//! call. The latencies are checked against this run's own healthy calls,
//! with margins of half a timeout: the timeout is 500 ms so that those
//! margins hold on a loaded 2-core machine (load 8: calls several times
//! slower, hiccups of some hundred ms), and still tell "did not wait" from
//! "waited the deadline", and "waited one deadline" from "waited two".

use std::time::{Duration, Instant};

use kvmesh_integration::process::Signal;
use kvmesh_integration::{AgentSession, Cluster, ClusterOptions, Reply};

const TIMEOUT_MS: u64 = 500;
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

fn min(replies: &[Reply]) -> Duration {
    replies.iter().map(|r| r.latency).min().unwrap_or_default()
}

/// Sends calls until one is routed by the sidecar again (the filter reopens
/// its stream with a backoff of up to a second); the deadline only bounds a
/// hang.
async fn until_routed(cluster: &Cluster, label: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    for i in 0.. {
        let reply = cluster.chat(&AgentSession::new(label).call(i % 3), &[]).await?;
        assert_eq!(reply.status, 200, "{label} call {i}: {}", reply.body);
        if reply.saw_destination.is_some() {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "{label}: the sidecar was never used again");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    unreachable!("the loop returns or fails")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_succeed_when_the_sidecar_is_killed_or_stalled() -> anyhow::Result<()> {
    let mut cluster = Cluster::start(ClusterOptions {
        plugin: serde_json::json!({ "sidecar_timeout_ms": TIMEOUT_MS }),
        ..ClusterOptions::default()
    })
    .await?;
    let timeout = Duration::from_millis(TIMEOUT_MS);
    let margin = timeout / 2;

    let healthy = run_calls(&cluster, "healthy").await?;
    assert!(
        healthy.iter().all(|r| r.saw_destination.is_some()),
        "healthy sidecar did not route"
    );
    assert_eq!(cluster.fail_opens().await?, (0, 0), "a healthy sidecar failed open");
    let baseline = median(&healthy);

    // Killed: the connection is refused, the filter continues at once.
    cluster.kill_sidecar()?;
    let killed = run_calls(&cluster, "killed").await?;
    assert!(killed.iter().all(|r| r.saw_destination.is_none()));
    assert_eq!(
        cluster.fail_opens().await?,
        (CALLS as u64, 0),
        "killed sidecar: every call fails open on the refused callout, none waits for its deadline"
    );
    assert!(
        median(&killed) <= baseline + margin,
        "killed sidecar: median {:?} against the healthy calls' {baseline:?}: the calls waited",
        median(&killed)
    );

    // Back: routing resumes on the same address with no Envoy change.
    cluster.restart_sidecar()?;
    until_routed(&cluster, "restart").await?;
    let before_stall = cluster.fail_opens().await?;

    // Stalled: connections open but nothing answers until the timeout.
    cluster.sidecar.signal(Signal::SIGSTOP)?;
    let stalled = run_calls(&cluster, "stalled").await;
    cluster.sidecar.signal(Signal::SIGCONT)?;
    let stalled = stalled?;
    assert!(stalled.iter().all(|r| r.saw_destination.is_none()));
    let after_stall = cluster.fail_opens().await?;
    assert_eq!(
        (after_stall.0 - before_stall.0, after_stall.1 - before_stall.1),
        (0, CALLS as u64),
        "stalled sidecar: every call fails open at its deadline"
    );
    // No call resumed before its deadline (Envoy's cached clock may lag by
    // a few ms, hence 0.9), and none waited a second deadline: the worst
    // stalled call is within one timeout plus the worst healthy call plus
    // half a timeout.
    assert!(
        min(&stalled) >= timeout.mul_f64(0.9),
        "stalled sidecar: a call resumed after {:?}, before its {timeout:?} deadline",
        min(&stalled)
    );
    assert!(
        max(&stalled) <= max(&healthy) + timeout + margin,
        "stalled sidecar: worst call {:?}, worst healthy call {:?}, timeout {timeout:?}",
        max(&stalled),
        max(&healthy)
    );

    // Resumed, the sidecar routes again.
    until_routed(&cluster, "resumed").await?;
    eprintln!(
        "fail-open latency: healthy median {baseline:?} max {:?}; killed median {:?}; stalled median {:?} \
         max {:?} (timeout {timeout:?})",
        max(&healthy),
        median(&killed),
        median(&stalled),
        max(&stalled)
    );
    Ok(())
}
