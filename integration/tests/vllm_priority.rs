//! A real vLLM (CPU build, the tiny model of `./dev setup-vllm`) with
//! `--scheduling-policy priority --max-num-seqs 1` behind the real Envoy
//! with `priority_field: {"engine": "vllm"}`: a request sent last with a
//! higher kvmesh priority overtakes the ones already queued, because the
//! filter wrote vLLM's `priority` (lower first) into its body. The same
//! requests without priorities finish in the order they were sent.
//!
//! Each queued request decodes exactly 512 tokens (`min_tokens` = `max_tokens`:
//! `ignore_eos` alone still stops at the chat template's `<|im_end|>`), so
//! a queue forms: the tiny model otherwise answers before the next request
//! arrives (the earlier probe of docs/vllm.md saw no order for that
//! reason), and every request takes as long as the others.

use std::time::{Duration, Instant};

use kvmesh_integration::vllm::{self, SERVED_MODEL, VllmOptions};
use kvmesh_integration::{Cluster, ClusterOptions, Engine};
use serde_json::json;

const OUTPUT_TOKENS: u64 = 512;
/// The first request, the one running while the others queue, is four
/// times longer: the queue must be seen whole (a poll of the engine's
/// `/metrics`) and the last request sent while it still runs; at 512
/// tokens that window was 0.6-0.8 s.
const FIRST_TOKENS: u64 = 4 * OUTPUT_TOKENS;
/// The last request is short: what matters is when it starts.
const SHORT_TOKENS: u64 = 16;
const QUEUED: usize = 4;

fn body(n: usize, tokens: u64) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "model": SERVED_MODEL,
        "messages": [{"role": "user", "content": format!("request {n}: write a long story")}],
        "stream": true,
        "max_tokens": tokens,
        "min_tokens": tokens,
        "ignore_eos": true,
        "temperature": 0,
    }))
    .unwrap_or_default()
}

/// The engine's own queue length.
fn waiting(cluster: &Cluster) -> f64 {
    vllm::http_get(cluster.workers[0].addr, "/metrics")
        .ok()
        .and_then(|(_, text)| vllm::metric_sum(&text, "vllm:num_requests_waiting"))
        .unwrap_or(0.0)
}

/// Sends `QUEUED` long requests with priority `queued` (one running, the
/// rest waiting in the engine), then a short one with priority `last`;
/// returns the indexes in the order the engine started them (the last one
/// is `QUEUED`): the order of their first streamed chunk, which vLLM sends
/// with the first token. The first chunks of two requests are one whole
/// long request apart (`max-num-seqs 1`), so a late flush of the API
/// server cannot reorder them, as it did completion times.
async fn start_order(cluster: &Cluster, queued: Option<&str>, last: Option<&str>) -> anyhow::Result<Vec<usize>> {
    let started = Instant::now();
    let send = |n: usize, tokens: u64, priority: Option<&str>| {
        let url = format!("{}/v1/chat/completions", cluster.envoy_url);
        let priority = priority.map(str::to_owned);
        tokio::spawn(async move {
            let client = reqwest::Client::builder().no_proxy().build()?;
            let mut request = client
                .post(url)
                .header("content-type", "application/json")
                .header("x-session-id", format!("priority-{n}"))
                .body(body(n, tokens));
            if let Some(p) = priority {
                request = request.header("x-kvmesh-priority", p);
            }
            let mut response = request.send().await?;
            anyhow::ensure!(response.status() == 200, "request {n}: {}", response.status());
            let mut first = None;
            let mut text = Vec::new();
            while let Some(chunk) = response.chunk().await? {
                first.get_or_insert_with(|| started.elapsed());
                text.extend_from_slice(&chunk);
            }
            let text = String::from_utf8_lossy(&text);
            anyhow::ensure!(text.contains("[DONE]"), "request {n}: the stream did not end: {text}");
            let first = first.ok_or_else(|| anyhow::anyhow!("request {n}: no chunk"))?;
            eprintln!("  request {n} started at {first:?}, ended at {:?}", started.elapsed());
            anyhow::Ok((n, first))
        })
    };
    let mut tasks = Vec::new();
    for n in 0..QUEUED {
        let tokens = if n == 0 { FIRST_TOKENS } else { OUTPUT_TOKENS };
        tasks.push(send(n, tokens, queued));
        // Arrival order is the FCFS tie-break: keep it certain (a request
        // crosses Envoy and the sidecar in milliseconds), and short beside
        // the first request's decode (about 4 s on an idle machine).
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The first runs (max-num-seqs 1), the others wait in vLLM's queue.
    let deadline = Instant::now() + Duration::from_secs(30);
    while waiting(cluster) < (QUEUED - 1) as f64 {
        anyhow::ensure!(Instant::now() < deadline, "the engine's queue never formed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tasks.push(send(QUEUED, SHORT_TOKENS, last));
    let mut firsts = Vec::new();
    for task in tasks {
        firsts.push(task.await??);
    }
    firsts.sort_by_key(|(_, first)| *first);
    Ok(firsts.into_iter().map(|(n, _)| n).collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_higher_priority_request_overtakes_the_queued_ones_on_real_vllm() -> anyhow::Result<()> {
    let started = Instant::now();
    let cluster = Cluster::start(ClusterOptions {
        workers: 1,
        engine: Engine::Vllm(VllmOptions {
            priority_scheduling: true,
            max_num_seqs: Some(1),
            // One OpenMP thread for the model: with one per core (torch's
            // default) the engine's spinning threads starved the API
            // server on 2 cores, whose streams then stalled for 1-3 s and
            // delivered several requests' first chunks in one burst, in
            // no particular order (a CI failure; measured: the longest gap
            // inside a stream fell from 1.0-2.9 s to 14-25 ms). The order
            // the engine ran them in is what this test reads.
            extra_env: vec![("OMP_NUM_THREADS".into(), "1".into())],
            ..VllmOptions::default()
        }),
        plugin: json!({"priority_field": {"engine": "vllm"}}),
        ..ClusterOptions::default()
    })
    .await?;
    eprintln!("vLLM, sidecar and Envoy ready in {:?}", started.elapsed());

    // Everyone at kvmesh's 0 (the lead class, vLLM's 0): first come, first served.
    eprintln!("no priorities:");
    let fcfs = start_order(&cluster, None, None).await?;
    // The queued ones start in arrival order, and the last request starts
    // after them. A queued request the random-weight model ends at once
    // (an early end-of-text) and the last one can stream their first
    // chunks microseconds apart, so the last two may swap.
    assert_eq!(
        &fcfs[..QUEUED - 1],
        (0..QUEUED - 1).collect::<Vec<_>>(),
        "without priorities: {fcfs:?}"
    );
    let last_at = fcfs.iter().position(|&n| n == QUEUED);
    assert!(
        last_at >= Some(QUEUED - 1),
        "without priorities the last one overtook: {fcfs:?}"
    );

    // Queued at -100 (vLLM 100), the last at 100 (vLLM -100): it starts as
    // soon as the running one is done, before the three that waited.
    eprintln!("the last one at a higher priority:");
    let order = start_order(&cluster, Some("-100"), Some("100")).await?;
    assert_eq!(order[0], 0, "the running request went first: {order:?}");
    assert_eq!(
        order[1], QUEUED,
        "the high-priority request did not overtake: {order:?}"
    );
    assert_eq!(&order[2..], &[1, 2, 3], "the queued ones keep their order: {order:?}");
    assert_eq!(
        cluster.envoy_counter("wasmcustom.kvmesh.priority.written").await?,
        2 * (QUEUED as u64 + 1)
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_without_the_priority_policy_still_answers_a_priority() -> anyhow::Result<()> {
    // Turning the rewrite on for engines started without
    // `--scheduling-policy priority` must not fail requests: vLLM 0.32's
    // field doc says a non-zero priority "will raise an error" then.
    let dir = std::env::temp_dir().join(format!("kvmesh-vllm-priority-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let worker =
        tokio::task::spawn_blocking(move || vllm::VllmWorker::start("plain", &dir, &VllmOptions::default())).await??;
    let client = reqwest::Client::builder().no_proxy().build()?;
    let mut statuses = Vec::new();
    for priority in [0, -100, 100] {
        let response = client
            .post(format!("{}/v1/chat/completions", worker.url()))
            .header("content-type", "application/json")
            .body(serde_json::to_vec(&json!({
                "model": SERVED_MODEL, "max_tokens": 2, "priority": priority,
                "messages": [{"role": "user", "content": "hi"}],
            }))?)
            .send()
            .await?;
        let status = response.status().as_u16();
        let text = response.text().await?;
        eprintln!(
            "priority {priority}: {status} {}",
            text.chars().take(200).collect::<String>()
        );
        statuses.push(status);
    }
    assert_eq!(statuses, [200, 200, 200]);
    Ok(())
}
