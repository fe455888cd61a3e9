//! Sixteen agent sessions at once through the real Envoy: Picks from many
//! requests are in flight on each worker's stream together, every call
//! succeeds, sessions spread over every worker, their later calls reuse the
//! engine's cache, and nothing stays in flight.
//!
//! A session may move during the burst of sixteen first prefills, when
//! recomputing its still short prefix elsewhere is cheaper than queueing
//! behind them; what users feel is the cache reuse, which is what is held.
//!
//! Nothing is timed: every figure is a count of the calls themselves (their
//! workers, their cached tokens, the filter's pick counter), and the return
//! of the in-flight counts to zero is polled for, with a deadline that only
//! bounds a hang. The router's queue model drains with wall time, so on a
//! slow machine the calls overlap less, which only makes moves rarer.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use kvmesh_integration::{AgentSession, Cluster, ClusterOptions, PATIENT_SIDECAR_TIMEOUT_MS};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_concurrent_sessions_spread_and_reuse_their_cache() -> anyhow::Result<()> {
    let cluster = Arc::new(
        Cluster::start(ClusterOptions {
            // Some engine time, so requests overlap on every Envoy worker.
            sim_args: vec!["--time-scale".into(), "0.2".into()],
            plugin: serde_json::json!({ "sidecar_timeout_ms": PATIENT_SIDECAR_TIMEOUT_MS }),
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
            let mut calls = Vec::new();
            for turn in 0..6 {
                let reply = cluster
                    .chat(&session.call(turn), &[("x-session-id", id.as_str())])
                    .await?;
                anyhow::ensure!(reply.status == 200, "session {s} turn {turn}: {}", reply.body);
                anyhow::ensure!(reply.saw_destination.is_some(), "session {s} turn {turn} not routed");
                let hit = reply.cached_tokens().unwrap_or(0) as f64 / reply.prompt_tokens().unwrap_or(1).max(1) as f64;
                calls.push((reply.worker.unwrap_or_default(), hit));
            }
            Ok::<_, anyhow::Error>((s, calls))
        }));
    }
    let mut first_homes: BTreeMap<String, usize> = BTreeMap::new();
    let (mut later_calls, mut reused) = (0, 0);
    for task in tasks {
        let (s, calls) = task.await??;
        *first_homes.entry(calls[0].0.clone()).or_default() += 1;
        for (turn, (worker, hit)) in calls.iter().enumerate().skip(1) {
            later_calls += 1;
            reused += usize::from(*hit >= 0.5);
            let moves = calls.windows(2).filter(|w| w[0].0 != w[1].0).count();
            assert!(moves <= 2, "session {s} moved {moves} times at turn {turn} ({worker})");
        }
    }
    assert_eq!(first_homes.len(), 3, "sessions not spread: {first_homes:?}");
    // Later calls find at least half their prompt cached, almost always.
    assert!(
        reused * 10 >= later_calls * 9,
        "only {reused} of {later_calls} later calls reused the cache"
    );
    // Only bounds a hang: the last outcome reports follow the last replies.
    cluster.wait_for_no_in_flight(Duration::from_secs(60)).await?;
    assert_eq!(cluster.envoy_counter("wasmcustom.kvmesh.picks").await?, 96);
    Ok(())
}
