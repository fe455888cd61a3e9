//! The sidecar's engine watcher against real simulated engines: it reads
//! their KV capacity, forgets a worker's cache when the engine restarts,
//! marks a dead worker down so nothing new is sent to it, and takes it back
//! when it returns.

use std::time::{Duration, Instant};

use kvmesh_integration::{AgentSession, Cluster, ClusterOptions, PATIENT_SIDECAR_TIMEOUT_MS};
use serde_json::Value;

/// Deadline of a poll for something the watcher must do: only bounds a
/// hang (it scrapes every 200 ms; the times taken are printed).
const HANG: Duration = Duration::from_secs(60);

async fn worker_view(cluster: &Cluster, address: &str) -> anyhow::Result<Value> {
    let workers = cluster.sidecar_workers().await?;
    workers
        .into_iter()
        .find(|w| w["address"] == address)
        .ok_or_else(|| anyhow::anyhow!("no worker {address}"))
}

/// The capacity in blocks that worker view `w` should show: the engine's
/// tokens over the tokens a block of `block_bytes` holds at the learned
/// bytes per token (0 if the view lacks a figure). The router converts again
/// only when that figure moves by over 2 %, so it is held to that.
fn converted(w: &Value, block_bytes: u64) -> Value {
    let (Some(tokens), Some(bytes_per_token), Some(tokens_per_block)) = (
        w["engine_capacity_tokens"].as_u64(),
        w["bytes_per_token"].as_f64(),
        w["tokens_per_block"].as_f64(),
    ) else {
        return Value::from(0);
    };
    let exact = block_bytes as f64 / bytes_per_token;
    if w["block_bytes"] != block_bytes || (tokens_per_block - exact).abs() > 0.02 * tokens_per_block {
        return Value::from(0);
    }
    Value::from((tokens as f64 / tokens_per_block) as u64)
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
        anyhow::ensure!(
            started.elapsed() < HANG,
            "{address} never {what}: {}",
            worker_view(cluster, address).await?
        );
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
        plugin: serde_json::json!({ "sidecar_timeout_ms": PATIENT_SIDECAR_TIMEOUT_MS }),
        ..ClusterOptions::default()
    })
    .await?;
    let session = AgentSession::new("acme/watched");
    let first = cluster.chat(&session.call(0), &[("x-session-id", "watched")]).await?;
    let home = first.worker.clone().unwrap_or_default();

    // Capacity: the sim's 200,000 tokens, at the engine tokens a 256-byte
    // block holds (256 over the bytes per token learned from its usage).
    wait_until(&cluster, &home, "learned its capacity", |w| {
        w["engine_capacity_tokens"] == 200_000 && w["capacity_blocks"] == converted(w, 256)
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

/// With the filter cutting 512-byte blocks, the capacity in blocks is the
/// engine's tokens over 512 / bytes per token: the block size comes from
/// the Picks, and nothing assumes 256 bytes or 4 bytes per token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_capacity_is_converted_at_the_filters_block_size() -> anyhow::Result<()> {
    let cluster = Cluster::start(ClusterOptions {
        plugin: serde_json::json!({"block_bytes": 512, "sidecar_timeout_ms": PATIENT_SIDECAR_TIMEOUT_MS}),
        ..ClusterOptions::default()
    })
    .await?;
    let session = AgentSession::new("acme/blocks-512");
    let mut home = String::new();
    for turn in 0..3 {
        let reply = cluster.chat(&session.call(turn), &[("x-session-id", "b512")]).await?;
        assert_eq!(reply.status, 200, "{}", reply.body);
        home = reply.worker.unwrap_or_default();
    }
    cluster.wait_for_no_in_flight(HANG).await?;
    wait_until(&cluster, &home, "converted its capacity at 512 bytes", |w| {
        w["engine_capacity_tokens"] == 200_000 && w["capacity_blocks"] == converted(w, 512)
    })
    .await?;
    let w = worker_view(&cluster, &home).await?;
    let bytes_per_token = w["bytes_per_token"].as_f64().unwrap_or(0.0);
    eprintln!(
        "capacity {} blocks at {} tokens per block ({bytes_per_token:.3} bytes per token learned)",
        w["capacity_blocks"], w["tokens_per_block"]
    );
    // Not the old fixed conversion (256-byte blocks at 4 bytes per token),
    // which gave twice as many blocks.
    assert_ne!(w["capacity_blocks"], 200_000 / 64);
    Ok(())
}

/// A worker whose engine is not up yet (here: never answered this sidecar's
/// watcher) is marked down at its first failed scrape and never ranked; a
/// worker that was up gets a second chance before it is (one slow scrape of
/// a busy engine is no outage).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_is_not_up_yet_is_not_picked() -> anyhow::Result<()> {
    let mut cluster = Cluster::start(ClusterOptions {
        plugin: serde_json::json!({ "sidecar_timeout_ms": PATIENT_SIDECAR_TIMEOUT_MS }),
        ..ClusterOptions::default()
    })
    .await?;
    let absent = cluster.worker_names()[2].clone();
    cluster.kill_worker_at(&absent)?;
    // A new sidecar, whose watcher has never seen that worker up.
    cluster.kill_sidecar()?;
    cluster.restart_sidecar()?;
    let took = wait_until(&cluster, &absent, "was marked down", |w| w["healthy"] == false).await?;
    eprintln!("a worker never seen up marked down within {took:?}");
    for s in 0..6 {
        let reply = cluster
            .chat(
                &AgentSession::new(&format!("acme/early-{s}")).call(0),
                &[("x-session-id", &format!("early-{s}"))],
            )
            .await?;
        assert_eq!(reply.status, 200, "{}", reply.body);
        let ranked = reply.saw_destination.unwrap_or_default();
        assert!(!ranked.is_empty(), "not routed");
        assert!(
            !ranked.split(',').any(|d| d == absent),
            "ranked a worker not up: {ranked}"
        );
    }
    // Marked down once, at its first failed scrape: never up, so never back
    // up and down again. (A live worker marked down too, after two scrapes
    // slower than the watcher's timeout on a loaded machine, is no error
    // here: it is only printed.)
    let log = cluster.sidecar.log();
    let down: Vec<&str> = log.lines().filter(|l| l.contains("worker marked down")).collect();
    assert_eq!(down.iter().filter(|l| l.contains(absent.as_str())).count(), 1, "{log}");
    if down.len() > 1 {
        eprintln!("live workers marked down as well: {down:?}");
    }
    Ok(())
}
