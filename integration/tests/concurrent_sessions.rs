//! Sixteen agent sessions at once through the real Envoy: Picks from many
//! requests are in flight on each worker's stream together, every call
//! succeeds, each session keeps its worker, and nothing stays in flight.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use kvmesh_integration::{AgentSession, Cluster, ClusterOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_concurrent_sessions_keep_their_workers() -> anyhow::Result<()> {
    let cluster = Arc::new(
        Cluster::start(ClusterOptions {
            // Some engine time, so requests overlap on every Envoy worker.
            sim_args: vec!["--time-scale".into(), "0.2".into()],
            ..ClusterOptions::default()
        })
        .await?,
    );
    let mut tasks = Vec::new();
    for s in 0..16 {
        let cluster = cluster.clone();
        tasks.push(tokio::spawn(async move {
            let session = AgentSession::new(&format!("org/service-{s}"));
            let id = format!("concurrent-{s}");
            let mut workers = Vec::new();
            for turn in 0..6 {
                let reply = cluster
                    .chat(&session.call(turn), &[("x-session-id", id.as_str())])
                    .await?;
                anyhow::ensure!(reply.status == 200, "session {s} turn {turn}: {}", reply.body);
                anyhow::ensure!(reply.saw_destination.is_some(), "session {s} turn {turn} not routed");
                workers.push(reply.worker.unwrap_or_default());
            }
            Ok::<_, anyhow::Error>((s, workers))
        }));
    }
    let mut per_worker: BTreeMap<String, usize> = BTreeMap::new();
    for task in tasks {
        let (s, workers) = task.await??;
        assert!(
            workers.iter().all(|w| *w == workers[0]),
            "session {s} moved: {workers:?}"
        );
        *per_worker.entry(workers[0].clone()).or_default() += 1;
    }
    assert_eq!(per_worker.len(), 3, "sessions not spread: {per_worker:?}");
    cluster.wait_for_no_in_flight(Duration::from_secs(10)).await?;
    assert_eq!(cluster.envoy_counter("wasmcustom.kvmesh.picks").await?, 96);
    Ok(())
}
