//! Bodies over the filter's parse cap are routed on what was read before the
//! cap (here: the session), counted, and forwarded whole and unchanged.

use kvmesh_integration::{AgentSession, Cluster, ClusterOptions};
use sha2::{Digest, Sha256};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_over_the_cap_are_routed_counted_and_unchanged() -> anyhow::Result<()> {
    let cluster = Cluster::start(
        ClusterOptions {
            plugin: serde_json::json!({ "max_body_bytes": 1024 }),
            ..ClusterOptions::default()
        }
        .patient(),
    )
    .await?;
    let session = AgentSession::new("acme/bigrepo");
    let mut workers = Vec::new();
    for turn in 0..4 {
        let body = serde_json::to_vec(&session.call(turn))?;
        assert!(body.len() > 1024);
        let digest = hex::encode(Sha256::digest(&body));
        let reply = cluster
            .send(
                reqwest::Method::POST,
                "/v1/chat/completions",
                &[("content-type", "application/json"), ("x-session-id", "big-1")],
                body,
            )
            .await?;
        assert_eq!(reply.status, 200, "{}", reply.body);
        assert!(reply.saw_destination.is_some(), "turn {turn} was not routed");
        assert_eq!(
            reply.worker_body_sha256.as_deref(),
            Some(digest.as_str()),
            "turn {turn}: body changed"
        );
        workers.push(reply.worker.unwrap_or_default());
    }
    assert!(workers.iter().all(|w| *w == workers[0]), "{workers:?}");
    assert_eq!(cluster.envoy_counter("wasmcustom.kvmesh.truncated.body").await?, 4);
    Ok(())
}
