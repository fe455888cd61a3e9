//! A pick that names a dead worker moves on: Envoy's retry policy takes the
//! next ranked destination, so the call still succeeds.

use kvmesh_integration::{AgentSession, Cluster, ClusterOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_picked_onto_a_dead_worker_is_retried_elsewhere() -> anyhow::Result<()> {
    let mut cluster = Cluster::start(ClusterOptions::default()).await?;
    let session = AgentSession::new("acme/fragile");
    let first = cluster.chat(&session.call(0), &[("x-session-id", "fragile")]).await?;
    let home = first.worker.clone().unwrap_or_default();
    cluster.kill_worker_at(&home)?;

    for turn in 1..4 {
        let reply = cluster
            .chat(&session.call(turn), &[("x-session-id", "fragile")])
            .await?;
        assert_eq!(reply.status, 200, "turn {turn}: {}", reply.body);
        // The sidecar still ranks the dead worker first (it has no health
        // checks yet); Envoy's retry moved the call to the next one.
        assert_eq!(
            reply.saw_destination.as_deref().and_then(|d| d.split(',').next()),
            Some(home.as_str())
        );
        assert_ne!(reply.worker.as_deref(), Some(home.as_str()));
    }
    Ok(())
}
