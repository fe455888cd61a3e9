//! A filter VM that fails is rebuilt and counted: with the shipped
//! `failure_policy: FAIL_RELOAD`, a panic (here on purpose, from the
//! filter's `crash-test` build) costs the request that caused it a 503 (and
//! any request on that Envoy thread within the 10 ms backoff), Envoy
//! rebuilds the VM for the next one, `wasm.kvmesh.vm_reload_success` counts
//! it for alerts, routing resumes, and steering stays closed throughout.
//!
//! Nothing is timed: the failure is read from Envoy's log and the rebuild
//! from its counter, each polled for until it shows, with a deadline that
//! only bounds a hang.

use std::time::{Duration, Instant};

use kvmesh_integration::paths;
use kvmesh_integration::{AgentSession, Cluster, ClusterOptions, PATIENT_SIDECAR_TIMEOUT_MS};

/// Deadline of a poll: only bounds a hang.
const HANG: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_vm_is_rebuilt_counted_and_routes_again() -> anyhow::Result<()> {
    let cluster = Cluster::start(ClusterOptions {
        filter_wasm: Some(paths::crash_test_wasm()?),
        plugin: serde_json::json!({ "sidecar_timeout_ms": PATIENT_SIDECAR_TIMEOUT_MS }),
        ..ClusterOptions::default()
    })
    .await?;
    let session = AgentSession::new("acme/reload");
    let headers = [("x-session-id", "reload")];
    let first = cluster.chat(&session.call(0), &headers).await?;
    assert_eq!(first.status, 200, "{}", first.body);
    let home = first.worker.clone().unwrap_or_default();
    assert_eq!(
        cluster
            .envoy_counter("wasm.kvmesh.vm_reload_success")
            .await
            .unwrap_or(0),
        0
    );

    let crashed = cluster
        .chat(
            &session.call(1),
            &[("x-session-id", "reload"), ("x-kvmesh-test-crash", "1")],
        )
        .await?;
    assert_eq!(crashed.status, 503, "the failing request: {}", crashed.body);
    // Envoy's log may reach its file a moment after the reply.
    let deadline = Instant::now() + HANG;
    while !cluster
        .envoy
        .log()
        .contains("Function: proxy_on_request_headers failed")
    {
        assert!(
            Instant::now() < deadline,
            "the VM did not fail: {}",
            cluster.envoy.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Every later request is routed (on fresh connections, so on both
    // Envoy worker threads, the failed one included, whose VM is rebuilt
    // for its next request), and a forged destination never steers.
    let other = cluster
        .worker_names()
        .into_iter()
        .find(|w| *w != home)
        .unwrap_or_default();
    // The rebuild happens when a request reaches the failed thread after
    // the backoff: poll (fresh connections) until one has.
    let deadline = Instant::now() + HANG;
    let mut turn = 2;
    let mut in_backoff = 0;
    let mut routed_after_reload = false;
    while !routed_after_reload {
        assert!(Instant::now() < deadline, "no request routed by a rebuilt VM");
        let reloaded = cluster
            .envoy_counter("wasm.kvmesh.vm_reload_success")
            .await
            .unwrap_or(0)
            > 0;
        let reply = cluster
            .send_bytes(
                reqwest::Method::POST,
                "/v1/chat/completions",
                &[
                    ("content-type", b"application/json"),
                    ("x-session-id", b"reload"),
                    ("x-kvmesh-destination", other.as_bytes()),
                ],
                serde_json::to_vec(&session.call(turn))?,
                false,
            )
            .await?;
        turn += 1;
        if reply.status == 503 && !reloaded {
            // Envoy's answer on the failed thread while it waits out the
            // backoff: a 10 ms window, so the slower the machine, the fewer.
            in_backoff += 1;
            assert!(in_backoff <= 20, "the failed thread kept failing requests");
            continue;
        }
        assert_eq!(reply.status, 200, "{}", reply.body);
        assert!(reply.saw_destination.is_some(), "not routed after the VM failed");
        assert_eq!(
            reply.worker.as_deref(),
            Some(home.as_str()),
            "a forged destination steered"
        );
        routed_after_reload = reloaded;
    }
    Ok(())
}
