//! A pick that names a dead worker moves on: Envoy's retry policy takes the
//! next ranked destination, so the call still succeeds.
//!
//! The sidecar's engine watcher would mark the dead worker down within a
//! few scrapes and stop ranking it; it is turned off here, so the sidecar
//! goes on ranking the dead worker first however long the calls take (as
//! it does for every call between a death and its detection). That Envoy's
//! retry moved each call is read from Envoy's own retry counter.

use kvmesh_integration::{AgentSession, Cluster, ClusterOptions, PATIENT_SIDECAR_TIMEOUT_MS};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_picked_onto_a_dead_worker_is_retried_elsewhere() -> anyhow::Result<()> {
    let mut cluster = Cluster::start(ClusterOptions {
        // No engine watcher (`--scrape-interval-ms 0`): nothing marks the
        // dead worker down, on a machine of any speed.
        sidecar_args: vec![
            "--prefill-tokens-per-ms".into(),
            "100".into(),
            "--scrape-interval-ms".into(),
            "0".into(),
        ],
        plugin: serde_json::json!({ "sidecar_timeout_ms": PATIENT_SIDECAR_TIMEOUT_MS }),
        ..ClusterOptions::default()
    })
    .await?;
    let session = AgentSession::new("acme/fragile");
    let first = cluster.chat(&session.call(0), &[("x-session-id", "fragile")]).await?;
    let home = first.worker.clone().unwrap_or_default();
    cluster.kill_worker_at(&home)?;
    let retries_before = cluster.envoy_counter("cluster.gpu_workers.upstream_rq_retry").await?;

    let turns = 1..4;
    for turn in turns.clone() {
        let reply = cluster
            .chat(&session.call(turn), &[("x-session-id", "fragile")])
            .await?;
        assert_eq!(reply.status, 200, "turn {turn}: {}", reply.body);
        // The sidecar still ranks the dead worker first; Envoy's retry
        // moved the call to the next one.
        assert_eq!(
            reply.saw_destination.as_deref().and_then(|d| d.split(',').next()),
            Some(home.as_str())
        );
        assert_ne!(reply.worker.as_deref(), Some(home.as_str()));
    }
    let retries = cluster.envoy_counter("cluster.gpu_workers.upstream_rq_retry").await? - retries_before;
    assert!(
        retries >= turns.len() as u64,
        "Envoy retried {retries} times for {} calls picked onto the dead worker",
        turns.len()
    );
    Ok(())
}
