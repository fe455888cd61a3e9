//! What the sidecar's engine watcher reads from real vLLM engines (CPU
//! build, the tiny model of `./dev setup-vllm`), through the real Envoy:
//!
//! - each engine's capacity is its own `num_gpu_blocks × block_size`, and
//!   becomes kvmesh blocks at the Picks' block size over the bytes per token
//!   learned from the engine's usage (a real tokenizer: not 4);
//! - the engine's running requests and KV usage are shown per worker;
//! - an engine killed mid-session costs no client request (Envoy retries the
//!   next ranked worker) and is marked down; one a new sidecar has never
//!   seen up is not picked; restarted, it is seen as a restart, its entries
//!   and the capacity corrections are gone, and new sessions reach it again.
//!
//! One test function: a vLLM start is 20-45 s.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kvmesh_integration::vllm::{self, BLOCK_SIZE_TOKENS, SERVED_MODEL, VllmOptions};
use kvmesh_integration::{Cluster, ClusterOptions, Engine, PATIENT_SIDECAR_TIMEOUT_MS};
use serde_json::{Value, json};

const BLOCKS: u64 = 128;
/// Bounds a wait for the sidecar or an engine to show what happened: far
/// above the scrapes' 2 s (two failed ones mark a worker down) and the
/// milliseconds a count takes to follow a reply, even at load 8. Only a
/// hang reaches it.
const DEADLINE: Duration = Duration::from_secs(60);

fn call(repo: &str, turn: usize) -> Value {
    let mut messages = vec![
        json!({"role": "system", "content": format!("You are a coding agent in {repo}. Keep changes small.\n").repeat(24)}),
    ];
    for t in 0..=turn {
        messages.push(json!({"role": "user", "content": format!("step {t}: {}", "read src/lib.rs and run the tests. ".repeat(6))}));
        messages.push(json!({"role": "assistant", "content": format!("done with step {t}.")}));
    }
    json!({"model": SERVED_MODEL, "messages": messages, "max_tokens": 2})
}

/// The sidecar's flags: the cluster's default prefill guess, and scrapes of
/// the engines' `/metrics` every 2 s. A scrape times out after its interval
/// (at most 2 s) and two failed in a row mark a worker down: at the
/// cluster's 200 ms a busy vLLM on a loaded machine was marked down and up
/// again several times a minute, and sessions moved off it.
fn sidecar_args() -> Vec<String> {
    ["--prefill-tokens-per-ms", "100", "--scrape-interval-ms", "2000"]
        .map(str::to_owned)
        .to_vec()
}

async fn workers(cluster: &Cluster) -> anyhow::Result<BTreeMap<String, Value>> {
    Ok(cluster
        .sidecar_workers()
        .await?
        .into_iter()
        .map(|w| (w["address"].as_str().unwrap_or_default().to_owned(), w))
        .collect())
}

async fn wait_until(
    cluster: &Cluster,
    what: &str,
    timeout: Duration,
    check: impl Fn(&BTreeMap<String, Value>) -> bool,
) -> anyhow::Result<Duration> {
    let started = Instant::now();
    loop {
        let seen = workers(cluster).await?;
        if check(&seen) {
            return Ok(started.elapsed());
        }
        anyhow::ensure!(started.elapsed() < timeout, "never {what}: {seen:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Sends call `turn` of session `repo`; the engine that served it.
async fn send(cluster: &Cluster, repo: &str, turn: usize) -> anyhow::Result<String> {
    let before = cluster.engine_requests_finished().await?;
    let reply = cluster.chat(&call(repo, turn), &[("x-session-affinity", repo)]).await?;
    anyhow::ensure!(
        reply.status == 200,
        "{repo} turn {turn}: {} {}",
        reply.status,
        reply.body
    );
    let index = cluster.engine_that_served(&before, DEADLINE).await?;
    // Placed by the sidecar, not round robin: what it did is what the
    // watcher's view made it do.
    let (errors, timeouts) = cluster.fail_opens().await?;
    anyhow::ensure!(
        (errors, timeouts) == (0, 0),
        "{repo} turn {turn}: requests failed open ({errors} sidecar errors, {timeouts} timeouts)"
    );
    Ok(cluster.worker_names()[index].clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watcher_reads_real_engines_capacity_activity_death_and_restart() -> anyhow::Result<()> {
    let mut cluster = Cluster::start(ClusterOptions {
        engine: Engine::Vllm(VllmOptions {
            blocks: BLOCKS as u32,
            max_model_len: 4096,
            ..VllmOptions::default()
        }),
        plugin: json!({"sidecar_timeout_ms": PATIENT_SIDECAR_TIMEOUT_MS}),
        sidecar_args: sidecar_args(),
        ..ClusterOptions::default()
    })
    .await?;

    // Capacity: each engine's own figure, from its /metrics.
    let names = cluster.worker_names();
    for (index, name) in names.iter().enumerate() {
        let text = cluster.worker_metrics(index).await?;
        let labels = vllm::metric_labels(&text, "vllm:cache_config_info").unwrap_or_default();
        let label = |k: &str| {
            labels
                .iter()
                .find(|(key, _)| key == k)
                .and_then(|(_, v)| v.parse::<u64>().ok())
        };
        let tokens = label("num_gpu_blocks").unwrap_or(0) * label("block_size").unwrap_or(0);
        assert_eq!(tokens, BLOCKS * BLOCK_SIZE_TOKENS);
        wait_until(&cluster, "read the engine's capacity", DEADLINE, |w| {
            w.get(name)
                .is_some_and(|w| w["engine_capacity_tokens"] == tokens && w["healthy"] == true)
        })
        .await?;
    }

    // A session teaches the bytes per token of the real tokenizer; the
    // capacity in blocks follows it.
    let mut home = String::new();
    for turn in 0..4 {
        home = send(&cluster, "acme/signals", turn).await?;
    }
    cluster.wait_for_no_in_flight(DEADLINE).await?;
    let seen = workers(&cluster).await?;
    let w = &seen[&home];
    let bytes_per_token = w["bytes_per_token"].as_f64().unwrap_or(0.0);
    let tokens_per_block = w["tokens_per_block"].as_f64().unwrap_or(0.0);
    eprintln!("engine {home}: {w}");
    assert!((bytes_per_token - 4.0).abs() > 0.1, "no bytes per token learned: {w}");
    assert!(
        (tokens_per_block - 256.0 / bytes_per_token).abs() <= 0.02 * tokens_per_block,
        "{w}"
    );
    let expected = ((BLOCKS * BLOCK_SIZE_TOKENS) as f64 / tokens_per_block) as u64;
    assert_eq!(w["capacity_blocks"].as_u64(), Some(expected), "{w}");
    // The engine's own signals are shown, not dropped.
    assert!(w["engine_kv_usage"].is_number(), "{w}");
    assert!(w["engine_running"].is_number(), "{w}");

    // Killed mid-session: the next call of its session still succeeds
    // (Envoy retries the next ranked worker), and the engine is marked down.
    let index = names.iter().position(|n| *n == home).unwrap_or(0);
    cluster.kill_worker_at(&home)?;
    let moved_to = send(&cluster, "acme/signals", 4).await?;
    assert_ne!(moved_to, home);
    wait_until(&cluster, "marked the dead engine down", DEADLINE, |w| {
        w.get(&home).is_some_and(|w| w["healthy"] == false)
    })
    .await?;

    // Restarted on its port: seen as a restart (its entries are wiped and
    // the capacity estimate starts over), and new sessions reach it again
    // (it is the emptiest worker).
    cluster.restart_worker(index)?;
    wait_until(&cluster, "took the restarted engine back", DEADLINE, |w| {
        w.get(&home)
            .is_some_and(|w| w["healthy"] == true && w["cached_blocks"] == 0)
    })
    .await?;
    let restarts = cluster
        .sidecar_metric("kvmesh_worker_events_total{event=\"restart\"}")
        .await?;
    assert!(restarts >= 1.0, "the restart was not seen");
    let downs = || cluster.sidecar_metric("kvmesh_worker_events_total{event=\"down\"}");
    let downs_before = downs().await?;
    let mut reached = 0;
    for s in 0..6 {
        if send(&cluster, &format!("acme/after-restart-{s}"), 0).await? == home {
            reached += 1;
        }
    }
    eprintln!("{reached} of 6 new sessions reached the restarted engine");
    assert!(
        reached > 0,
        "no new session reached the restarted, empty engine ({} workers marked down meanwhile)",
        downs().await? - downs_before
    );

    // Gone again, and a new sidecar that never saw it up: not picked.
    cluster.kill_worker_at(&home)?;
    cluster.kill_sidecar()?;
    cluster.restart_sidecar()?;
    wait_until(&cluster, "marked the absent engine down", DEADLINE, |w| {
        w.get(&home).is_some_and(|w| w["healthy"] == false)
    })
    .await?;
    for s in 0..4 {
        let engine = send(&cluster, &format!("acme/absent-{s}"), 0).await?;
        assert_ne!(engine, home, "a new session went to an engine that is not up");
    }
    Ok(())
}
