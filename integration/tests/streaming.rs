//! Streaming (SSE) calls are routed like JSON ones and stream back unchanged,
//! usage included.

use kvmesh_integration::{AgentSession, Cluster, ClusterOptions};
use serde_json::Value;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_calls_follow_their_session_and_carry_usage() -> anyhow::Result<()> {
    let cluster = Cluster::start(ClusterOptions::default().patient()).await?;
    let session = AgentSession::new("acme/streams");
    let mut workers = Vec::new();
    let mut cached = Vec::new();
    for turn in 0..3 {
        let body = session.streamed_call(turn);
        let reply = cluster.chat(&body, &[("x-session-affinity", "ses_stream")]).await?;
        assert_eq!(reply.status, 200, "{}", reply.body);
        assert!(reply.saw_destination.is_some(), "streamed call {turn} was not routed");
        let events: Vec<&str> = reply.body.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
        assert_eq!(events.last(), Some(&"[DONE]"), "{}", reply.body);
        let usage_chunk: Value = serde_json::from_str(events[events.len() - 2])?;
        cached.push(
            usage_chunk
                .pointer("/usage/prompt_tokens_details/cached_tokens")
                .and_then(Value::as_u64)
                .unwrap_or_default(),
        );
        workers.push(reply.worker.unwrap_or_default());
    }
    assert!(workers.iter().all(|w| *w == workers[0]), "{workers:?}");
    assert!(cached[1] > 0 && cached[2] > cached[1], "{cached:?}");
    Ok(())
}
