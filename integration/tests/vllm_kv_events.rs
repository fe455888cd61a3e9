//! Real engines' KV events: two vLLM workers (CPU build, tiny model) publish
//! their KV cache events over ZeroMQ to the SUB sockets the sidecar binds
//! (`--kv-events`), with caches of 16 blocks (2,048 tokens) so that the
//! traffic below evicts. The sidecar does not scrape the engines' metrics
//! here, so its capacity estimate stays at the default 65,536 blocks and
//! only the events can evict: under that pressure the index's blocks per
//! worker track the engine's resident blocks, in tokens; `/reset_prefix_cache`
//! (the engine's `AllBlocksCleared`) wipes the worker in the index; a
//! restarted engine's sequence going back to 0 is counted as a gap and
//! resynced (its blocks forgotten).
//!
//! One test function: a vLLM start is about 30 s and 2.2 GB, so the workers
//! are started once and every case runs against them.

use std::time::{Duration, Instant};

use anyhow::Context;

use kvmesh_integration::vllm::{SERVED_MODEL, VllmOptions};
use kvmesh_integration::{Cluster, ClusterOptions, Engine, PATIENT_SIDECAR_TIMEOUT_MS};
use serde_json::{Value, json};

/// The engines' capacity in 128-token blocks, and the longest prompt.
const BLOCKS: u32 = 16;
const MAX_MODEL_LEN: u32 = 1024;
const CAPACITY_TOKENS: f64 = BLOCKS as f64 * 128.0;
const SESSIONS: usize = 12;
const TURNS: usize = 2;
/// Bounds a wait for the sidecar to see what an engine did: far above the
/// milliseconds it takes, even at load 8. Only a hang reaches it.
const DEADLINE: Duration = Duration::from_secs(60);

/// About 750 tokens of session `n`'s own text, growing per turn.
fn prompt(n: usize, turn: usize) -> String {
    let mut text = format!("Session {n} works on repository number {n}; keep changes small.\n").repeat(24);
    for t in 0..=turn {
        text.push_str(&format!("// step {t} of session {n}\nfn helper_{n}_{t}() -> u32 {{ {t} }}\n").repeat(3));
    }
    text
}

fn worker_view<'a>(workers: &'a [Value], address: &str) -> &'a Value {
    workers.iter().find(|w| w["address"] == address).unwrap_or(&Value::Null)
}

/// (index tokens, engine resident tokens) for worker `address`: kvmesh's
/// blocks at its engine tokens per block, and the engine's blocks at its own.
fn tokens(view: &Value) -> Option<(f64, f64)> {
    let tokens_per_block = view["block_bytes"].as_f64()? / view["bytes_per_token"].as_f64()?;
    let index = view["cached_blocks"].as_f64()? * tokens_per_block;
    let engine = view["engine_resident_blocks"].as_f64()? * view["engine_block_tokens"].as_f64()?;
    Some((index, engine))
}

async fn direct_completion(http: &reqwest::Client, worker: &str, text: &str) -> anyhow::Result<()> {
    let reply = http
        .post(format!("http://{worker}/v1/completions"))
        .json(&json!({"model": SERVED_MODEL, "prompt": text, "max_tokens": 2}))
        .send()
        .await?;
    anyhow::ensure!(reply.status().is_success(), "{worker}: {}", reply.text().await?);
    Ok(())
}

/// Whether the engine's step for this reply must have stored a block, so
/// published a batch of KV events: a full block of the prompt it did not
/// hold (`floor((prompt - 1) / 128)`, as the last prompt token is always
/// computed, against the cached blocks it reported).
fn stored_a_block(reply: &kvmesh_integration::Reply) -> anyhow::Result<bool> {
    let prompt = reply
        .prompt_tokens()
        .with_context(|| format!("no prompt tokens: {}", reply.body))?;
    let cached = reply
        .cached_tokens()
        .with_context(|| format!("no cached tokens: {}", reply.body))?;
    Ok(prompt.saturating_sub(1) / 128 > cached / 128)
}

/// The KV event batches the sidecar has read, over every worker.
async fn batches(cluster: &Cluster, names: &[String]) -> anyhow::Result<f64> {
    let mut sum = 0.0;
    for name in names {
        sum += cluster
            .sidecar_metric(&format!("kvmesh_kv_event_batches_total{{worker=\"{name}\"}}"))
            .await?;
    }
    Ok(sum)
}

/// Outcomes the sidecar has applied for a known pick.
async fn reports(cluster: &Cluster) -> anyhow::Result<f64> {
    cluster.sidecar_metric("kvmesh_reports_total{known=\"true\"}").await
}

/// Polls `/debug/workers` until `done` holds for worker `address`.
async fn wait_for(
    cluster: &Cluster,
    address: &str,
    what: &str,
    done: impl Fn(&Value) -> bool,
) -> anyhow::Result<Value> {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let workers = cluster.sidecar_workers().await?;
        let view = worker_view(&workers, address).clone();
        if done(&view) {
            return Ok(view);
        }
        anyhow::ensure!(Instant::now() < deadline, "{address}: {what} never held: {view}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_vllm_kv_events_track_evict_wipe_and_resync_the_index() -> anyhow::Result<()> {
    let started = Instant::now();
    let mut cluster = Cluster::start(ClusterOptions {
        workers: 2,
        engine: Engine::Vllm(VllmOptions {
            blocks: BLOCKS,
            max_model_len: MAX_MODEL_LEN,
            // /reset_prefix_cache is a dev-mode endpoint.
            extra_env: vec![("VLLM_SERVER_DEV_MODE".into(), "1".into())],
            ..VllmOptions::default()
        }),
        kv_events: true,
        // No scrapes: neither the engine's capacity nor its restarts reach
        // the sidecar except through the events.
        sidecar_args: vec!["--scrape-interval-ms".into(), "0".into()],
        plugin: json!({"sidecar_timeout_ms": PATIENT_SIDECAR_TIMEOUT_MS}),
        ..ClusterOptions::default()
    })
    .await?;
    eprintln!(
        "2 vLLM workers with KV events, sidecar and Envoy ready in {:?}",
        started.elapsed()
    );
    let names = cluster.worker_names();
    let http = reqwest::Client::builder().no_proxy().build()?;

    // (c) Under pressure: sessions through Envoy, each turn compared once
    // the sidecar has read the events of the engine's step for it.
    let mut deviations: Vec<f64> = Vec::new();
    let mut awaited = 0;
    for turn in 0..TURNS {
        for n in 0..SESSIONS {
            let session = format!("kv-session-{n}");
            let body = json!({"model": SERVED_MODEL, "prompt": prompt(n, turn), "max_tokens": 2});
            let batches_before = batches(&cluster, &names).await?;
            let reports_before = reports(&cluster).await?;
            let reply = cluster
                .send(
                    reqwest::Method::POST,
                    "/v1/completions",
                    &[("content-type", "application/json"), ("x-session-affinity", &session)],
                    serde_json::to_vec(&body)?,
                )
                .await?;
            assert_eq!(reply.status, 200, "{}", reply.body);
            // vLLM publishes a step's events before that step's outputs, so
            // before the reply; they reach the sidecar a moment later. When
            // the step stored a block, its batch is waited for (the Pick
            // placed the blocks at once: sampled before it, the index would
            // be a prompt ahead). A step that stored none may still have
            // removed a block or two, which the tolerance covers.
            if stored_a_block(&reply)? {
                awaited += 1;
                let deadline = Instant::now() + DEADLINE;
                while batches(&cluster, &names).await? <= batches_before {
                    anyhow::ensure!(
                        Instant::now() < deadline,
                        "session {n} turn {turn}: the engine stored blocks, and no KV event batch reached the \
                         sidecar within {DEADLINE:?}: {}",
                        reply.body
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            // The call's Outcome teaches the sidecar the engine's bytes per
            // token, which turns index blocks into tokens: it follows the
            // reply, and on a loaded machine a sample taken before it would
            // compare tokens counted at the old rate.
            let deadline = Instant::now() + DEADLINE;
            while reports(&cluster).await? <= reports_before {
                anyhow::ensure!(
                    Instant::now() < deadline,
                    "session {n} turn {turn}: its Outcome never reached the sidecar within {DEADLINE:?}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let workers = cluster.sidecar_workers().await?;
            for name in &names {
                let view = worker_view(&workers, name);
                if let Some((index, engine)) = tokens(view) {
                    deviations.push((index - engine).abs() / CAPACITY_TOKENS);
                }
            }
        }
    }
    let workers = cluster.sidecar_workers().await?;
    for name in &names {
        let view = worker_view(&workers, name);
        eprintln!(
            "{name}: index {} blocks of {:.1} tokens (capacity estimate {} blocks), engine {} resident blocks of {} tokens",
            view["cached_blocks"],
            view["block_bytes"].as_f64().unwrap_or(0.0) / view["bytes_per_token"].as_f64().unwrap_or(1.0),
            view["capacity_blocks"],
            view["engine_resident_blocks"],
            view["engine_block_tokens"],
        );
        let gaps = cluster
            .sidecar_metric(&format!("kvmesh_kv_event_gaps_total{{worker=\"{name}\"}}"))
            .await?;
        let batches = cluster
            .sidecar_metric(&format!("kvmesh_kv_event_batches_total{{worker=\"{name}\"}}"))
            .await?;
        eprintln!("{name}: {batches} batches, {gaps} gaps");
        assert!(batches > 0.0, "{name}: no KV events reached the sidecar");
        assert_eq!(gaps, 0.0, "{name}: a gap without a restart");
    }
    assert!(
        !deviations.is_empty(),
        "no worker reported resident blocks: {workers:?}"
    );
    eprintln!(
        "{awaited} of {} replies stored a block, and were sampled after its KV event batch",
        SESSIONS * TURNS
    );
    assert_eq!(
        cluster.fail_opens().await?,
        (0, 0),
        "requests failed open (sidecar errors, timeouts): not routed where the index placed them"
    );
    deviations.sort_by(f64::total_cmp);
    let mean = deviations.iter().sum::<f64>() / deviations.len() as f64;
    let worst = deviations.last().copied().unwrap_or(0.0);
    let p90 = deviations[deviations.len() * 9 / 10];
    eprintln!(
        "index vs engine resident tokens, as a share of capacity, over {} samples: mean {:.1} %, p90 {:.1} %, worst {:.1} %",
        deviations.len(),
        mean * 100.0,
        p90 * 100.0,
        worst * 100.0
    );
    // Within two engine blocks (256 tokens, 12.5 % of capacity) at every
    // sample: the engine caches only full blocks and kvmesh cuts bytes, so a
    // block's worth each way is the resolution. Measured: mean 2.6 %, worst
    // 5.2 %; without the trim to the engine's resident blocks (removals
    // alone), mean 13.6 % and worst 39.6 %.
    assert!(worst <= 0.125, "worst deviation {worst}");
    assert!(mean <= 0.06, "mean deviation {mean}");
    let evicted: f64 = {
        let mut sum = 0.0;
        for name in &names {
            sum += cluster
                .sidecar_metric(&format!("kvmesh_kv_event_evicted_blocks_total{{worker=\"{name}\"}}"))
                .await?;
        }
        sum
    };
    eprintln!("index blocks evicted in step with the engines' removals: {evicted}");
    assert!(evicted > 0.0, "the engines' removals evicted nothing");

    // (a) The engine's cache reset: AllBlocksCleared comes with its next
    // step (a request straight to the engine, so no Pick adds blocks).
    let w0 = names[0].clone();
    let before = wait_for(&cluster, &w0, "blocks placed", |v| {
        v["cached_blocks"].as_u64().unwrap_or(0) > 0
    })
    .await?;
    let reset = http.post(format!("http://{w0}/reset_prefix_cache")).send().await?;
    assert!(reset.status().is_success(), "reset: {}", reset.text().await?);
    direct_completion(
        &http,
        &w0,
        "After the reset, a short prompt of a few blocks. ".repeat(30).as_str(),
    )
    .await?;
    let after = wait_for(&cluster, &w0, "the wipe", |v| v["cached_blocks"].as_u64() == Some(0)).await?;
    // The sidecar logs the wipe just after applying it: poll for the line.
    let deadline = Instant::now() + DEADLINE;
    while !cluster.sidecar.log().contains("engine cleared its cache") {
        anyhow::ensure!(
            Instant::now() < deadline,
            "the wipe did not come from the KV events:\n{}",
            cluster.sidecar.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "reset: index {} -> {} blocks, engine resident {} -> {}",
        before["cached_blocks"],
        after["cached_blocks"],
        before["engine_resident_blocks"],
        after["engine_resident_blocks"]
    );

    // (b) A restarted engine publishes from sequence 0 again: a gap,
    // counted, and the worker's blocks forgotten.
    let w1 = names[1].clone();
    wait_for(&cluster, &w1, "blocks placed", |v| {
        v["cached_blocks"].as_u64().unwrap_or(0) > 0
    })
    .await?;
    let restart = Instant::now();
    cluster.kill_worker_at(&w1)?;
    cluster.restart_worker(1)?;
    eprintln!("worker 1 restarted in {:?}", restart.elapsed());
    direct_completion(
        &http,
        &w1,
        "A first prompt for the restarted engine. ".repeat(30).as_str(),
    )
    .await?;
    let gap_series = format!("kvmesh_kv_event_gaps_total{{worker=\"{w1}\"}}");
    let deadline = Instant::now() + DEADLINE;
    while cluster.sidecar_metric(&gap_series).await? < 1.0 {
        assert!(
            Instant::now() < deadline,
            "the restart's sequence was not seen as a gap within {DEADLINE:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let view = wait_for(&cluster, &w1, "resynced", |v| {
        v["engine_resident_blocks"].as_u64().is_some()
    })
    .await?;
    eprintln!(
        "restart: gap counted; index {} blocks, engine resident {}",
        view["cached_blocks"], view["engine_resident_blocks"]
    );
    assert!(
        view["engine_resident_blocks"].as_u64().unwrap_or(u64::MAX) <= 8,
        "{view}"
    );
    assert_eq!(view["cached_blocks"].as_u64(), Some(0), "{view}");
    eprintln!("whole test: {:?}", started.elapsed());
    Ok(())
}
