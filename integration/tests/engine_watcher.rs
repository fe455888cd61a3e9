//! The sidecar's engine watcher against real simulated engines: it reads
//! their KV capacity, forgets a worker's cache when the engine restarts,
//! marks a dead worker down so nothing new is sent to it, and takes it back
//! when it returns.

use std::time::{Duration, Instant};

use kvmesh_integration::{AgentSession, Cluster, ClusterOptions};
use serde_json::Value;

async fn worker_view(cluster: &Cluster, address: &str) -> anyhow::Result<Value> {
    let workers = cluster.sidecar_workers().await?;
    workers
        .into_iter()
        .find(|w| w["address"] == address)
        .ok_or_else(|| anyhow::anyhow!("no worker {address}"))
}

async fn wait_until(
    cluster: &Cluster,
    address: &str,
    what: &str,
    check: impl Fn(&Value) -> bool,
) -> anyhow::Result<Duration> {
    let started = Instant::now();
    loop {
        if check(&worker_view(cluster, address).await?) {
            return Ok(started.elapsed());
        }
        anyhow::ensure!(started.elapsed() < Duration::from_secs(10), "{address} never {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watcher_reads_capacity_restarts_and_health() -> anyhow::Result<()> {
    let mut cluster = Cluster::start(ClusterOptions {
        // SGLang naming on every worker: the watcher reads both.
        sim_args: vec![
            "--time-scale".into(),
            "0".into(),
            "--metrics-names".into(),
            "sglang".into(),
        ],
        ..ClusterOptions::default()
    })
    .await?;
    let session = AgentSession::new("acme/watched");
    let first = cluster.chat(&session.call(0), &[("x-session-id", "watched")]).await?;
    let home = first.worker.clone().unwrap_or_default();

    // Capacity: the sim's 200,000 tokens at 64 tokens per 256-byte block.
    wait_until(&cluster, &home, "learned its capacity", |w| {
        w["capacity_blocks"] == 3125
    })
    .await?;
    assert!(worker_view(&cluster, &home).await?["cached_blocks"].as_u64() > Some(0));

    // Restart with the cache wiped: the router forgets what it held there.
    let http = reqwest::Client::builder().no_proxy().build()?;
    let restarted = http.post(format!("http://{home}/admin/restart")).send().await?;
    assert!(restarted.status().is_success());
    let took = wait_until(&cluster, &home, "was seen restarting", |w| w["cached_blocks"] == 0).await?;
    eprintln!("restart detected within {took:?}");
    assert_eq!(
        cluster
            .sidecar_metric("kvmesh_worker_events_total{event=\"restart\"}")
            .await?,
        1.0
    );

    // Dead: marked down within a few scrapes; new sessions avoid it.
    cluster.kill_worker_at(&home)?;
    let took = wait_until(&cluster, &home, "was marked down", |w| w["healthy"] == false).await?;
    eprintln!("dead worker detected within {took:?}");
    for s in 0..6 {
        let reply = cluster
            .chat(
                &AgentSession::new(&format!("acme/after-{s}")).call(0),
                &[("x-session-id", &format!("after-{s}"))],
            )
            .await?;
        assert_eq!(reply.status, 200);
        let ranked = reply.saw_destination.unwrap_or_default();
        assert!(
            !ranked.split(',').any(|d| d == home),
            "a new request was routed to the dead worker: {ranked}"
        );
    }
    // The worker's own session goes elsewhere and still succeeds.
    let moved = cluster.chat(&session.call(1), &[("x-session-id", "watched")]).await?;
    assert_eq!(moved.status, 200);
    assert_ne!(moved.worker.as_deref(), Some(home.as_str()));
    Ok(())
}
