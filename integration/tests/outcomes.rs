//! Every routed request reports its outcome, also when the client walks away
//! mid-stream or no worker can serve it: the sidecar's in-flight counts
//! return to zero.
//!
//! Nothing is timed: the streaming request is seen in flight after its
//! first event (its Pick came first, its answer streams for seconds of the
//! engine's own decode), and the returns to zero are polled for, with a
//! deadline that only bounds a hang.

use std::time::Duration;

use futures_util::StreamExt;
use kvmesh_integration::{AgentSession, Cluster, ClusterOptions, PATIENT_SIDECAR_TIMEOUT_MS};

/// Deadline of a poll for the in-flight counts: only bounds a hang.
const HANG: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborted_and_failed_requests_release_their_in_flight_slot() -> anyhow::Result<()> {
    let mut cluster = Cluster::start(ClusterOptions {
        // Real-time decode: a 2,000-token answer streams for seconds (6.7 GB
        // of weights at 3.35 TB/s: 2 ms a step).
        sim_args: vec!["--time-scale".into(), "1".into(), "--weight-gb".into(), "6.7".into()],
        plugin: serde_json::json!({ "sidecar_timeout_ms": PATIENT_SIDECAR_TIMEOUT_MS }),
        ..ClusterOptions::default()
    })
    .await?;
    let client = reqwest::Client::builder().no_proxy().build()?;

    // Aborted: read the first event of a long stream, then hang up.
    let mut body = AgentSession::new("acme/abort").call(0);
    body["stream"] = true.into();
    body["max_tokens"] = 2000.into();
    let response = client
        .post(format!("{}/v1/chat/completions", cluster.envoy_url))
        .header("content-type", "application/json")
        .header("x-session-id", "abort-1")
        .json(&body)
        .send()
        .await?;
    assert_eq!(response.status(), 200);
    let mut stream = response.bytes_stream();
    let first = stream.next().await.transpose()?;
    assert!(first.is_some_and(|b| !b.is_empty()));
    let busy: u64 = cluster
        .sidecar_workers()
        .await?
        .iter()
        .filter_map(|w| w["in_flight"].as_u64())
        .sum();
    assert_eq!(busy, 1, "the streaming request is in flight");
    drop(stream);
    cluster.wait_for_no_in_flight(HANG).await?;

    // Failed: every worker is gone; Envoy answers 503 after its retries.
    for worker in &mut cluster.workers {
        worker.process.kill()?;
    }
    let reply = cluster
        .chat(&AgentSession::new("acme/down").call(1), &[("x-session-id", "down-1")])
        .await?;
    assert_eq!(reply.status, 503, "{}", reply.body);
    cluster.wait_for_no_in_flight(HANG).await?;
    assert_eq!(
        cluster.sidecar_metric("kvmesh_reports_total{known=\"true\"}").await?,
        2.0
    );
    Ok(())
}
