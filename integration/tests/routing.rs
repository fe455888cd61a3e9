//! Through the real Envoy: a session's growing prompt stays on its worker, and
//! sessions with different prefixes spread over every worker.

use std::collections::BTreeMap;
use std::time::Duration;

use kvmesh_integration::cluster::settled;
use kvmesh_integration::{AgentSession, Cluster, ClusterOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_growing_session_stays_on_one_worker_and_reuses_its_cache() -> anyhow::Result<()> {
    let cluster = Cluster::start(ClusterOptions::default().patient()).await?;
    let session = AgentSession::new("acme/payments");
    let mut workers = Vec::new();
    let mut cached = Vec::new();
    for turn in 0..20 {
        let reply = cluster
            .chat(
                &session.call(turn),
                &[("x-claude-code-session-id", "6f1c0e4a-session-a")],
            )
            .await?;
        assert_eq!(reply.status, 200, "turn {turn}: {}", reply.body);
        workers.push(reply.worker.clone().unwrap_or_default());
        cached.push(reply.cached_tokens().unwrap_or(0));
        // The filter set the destination; the worker that answered is its first choice.
        let first_choice = reply.saw_destination.as_deref().and_then(|d| d.split(',').next());
        assert_eq!(first_choice, reply.worker.as_deref(), "turn {turn}");
    }
    assert!(
        workers.iter().all(|w| *w == workers[0]),
        "calls moved between workers: {workers:?}"
    );
    // The engine itself confirms the reuse: every call after the first finds
    // the previous call's prefix in its cache.
    assert_eq!(cached[0], 0);
    for turn in 1..20 {
        assert!(
            cached[turn] > cached[turn - 1],
            "cached tokens did not grow at turn {turn}: {cached:?}"
        );
    }
    assert_eq!(cluster.envoy_counter("wasmcustom.kvmesh.picks").await?, 20);
    // Picks travel on the per-worker stream once it is open; at most the
    // first call of each Envoy worker thread can precede it.
    let on_stream = cluster.envoy_counter("wasmcustom.kvmesh.sidecar.stream_calls").await?;
    let unary = cluster.envoy_counter("wasmcustom.kvmesh.sidecar.unary_calls").await?;
    assert_eq!(on_stream + unary, 20);
    assert!(on_stream >= 18, "{on_stream} picks on the stream, {unary} unary");
    // Every routed call reported its outcome (counted once the sidecar
    // applied it) and nothing is left in flight.
    let reports = settled(&20.0, Duration::from_secs(60), || {
        cluster.sidecar_metric("kvmesh_reports_total{known=\"true\"}")
    })
    .await?;
    assert_eq!(reports, 20.0);
    cluster.wait_for_no_in_flight(Duration::from_secs(10)).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_with_different_prefixes_spread_over_all_workers() -> anyhow::Result<()> {
    let cluster = Cluster::start(ClusterOptions::default().patient()).await?;
    let mut per_worker: BTreeMap<String, usize> = BTreeMap::new();
    for s in 0..12 {
        let session = AgentSession::new(&format!("team/repo-{s}"));
        let session_id = format!("session-{s}");
        // Two calls each: the second must follow the first.
        let first = cluster.chat(&session.call(0), &[("x-session-id", &session_id)]).await?;
        let second = cluster.chat(&session.call(1), &[("x-session-id", &session_id)]).await?;
        assert_eq!((first.status, second.status), (200, 200));
        assert_eq!(first.worker, second.worker, "session {s} moved");
        *per_worker.entry(first.worker.unwrap_or_default()).or_default() += 1;
    }
    let names = cluster.worker_names();
    for name in &names {
        assert!(
            per_worker.get(name).copied().unwrap_or(0) >= 1,
            "{name} got no session: {per_worker:?}"
        );
    }
    assert!(per_worker.values().all(|n| *n <= 6), "unbalanced: {per_worker:?}");
    assert_eq!(per_worker.keys().filter(|k| !names.contains(k)).count(), 0);
    Ok(())
}
