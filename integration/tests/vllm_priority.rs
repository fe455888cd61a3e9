//! A real vLLM (CPU build, the tiny model of `./dev setup-vllm`) with
//! `--scheduling-policy priority --max-num-seqs 1` behind the real Envoy
//! with `priority_field: {"engine": "vllm"}`: a request sent last with a
//! higher kvmesh priority overtakes the ones already queued, because the
//! filter wrote vLLM's `priority` (lower first) into its body. The same
//! requests without priorities start in the order they were sent.
//!
//! Nothing here depends on how fast the machine is. The order is forced:
//! each request is sent only once the engine's own metrics count the one
//! before it (running, then `vllm:num_requests_waiting`), so arrival order
//! is certain, and the last request is sent into a queue of three built
//! while the first still runs. That the first was still running when the
//! last was queued is checked, not assumed: the engine showed all four
//! waiting at once, before it finished any request. Every request decodes
//! exactly its `max_tokens` (`min_tokens` = `max_tokens`: `ignore_eos`
//! alone still stops at the chat template's `<|im_end|>`; checked in each
//! stream's usage), so the first chunks of two requests that ran one after
//! the other are one whole 512-token decode apart, however slow the
//! machine: far beyond the pauses a loaded API server puts into a stream.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvmesh_integration::vllm::{self, SERVED_MODEL, VllmOptions};
use kvmesh_integration::{Cluster, ClusterOptions, Engine, PATIENT_SIDECAR_TIMEOUT_MS};
use serde_json::{Value, json};

/// Tokens each queued request (and the last one) decodes: one such decode
/// separates the first chunks of requests that run in turn (0.85 s at the
/// fastest measured decode, 600 tokens/s; seconds on a loaded machine).
const OUTPUT_TOKENS: u64 = 512;
/// The first request, the one running while the others queue, is six times
/// longer: the queue is built in four steps, each a request through Envoy
/// and the sidecar and a poll of the engine's `/metrics`, while it runs
/// (about 5 s at 600 tokens/s; at 512 tokens that window was 0.6-0.8 s). If
/// it ends first anyway, the round fails saying so.
const FIRST_TOKENS: u64 = 6 * OUTPUT_TOKENS;
/// Tokens per streamed chunk after the first.
const STREAM_INTERVAL: u64 = 64;
/// Requests queued behind the first one before the last is sent.
const QUEUED: usize = 4;
/// Bounds a wait for the engine to count a request: far above the
/// milliseconds it takes, even at load 8. Only a hang reaches it.
const ENGINE_DEADLINE: Duration = Duration::from_secs(120);

fn body(n: usize, tokens: u64) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "model": SERVED_MODEL,
        "messages": [{"role": "user", "content": format!("request {n}: write a long story")}],
        "stream": true,
        "stream_options": {"include_usage": true},
        // The first token alone, then every 64th (vLLM's own option): 9
        // chunks instead of 512 for the API server and Envoy to push. With
        // one chunk per token a loaded machine held streams back by 1-1.5
        // s, first chunks included, which brought the delivery jitter near
        // the 512-token spacing of first chunks this test reads.
        "stream_interval": STREAM_INTERVAL,
        "max_tokens": tokens,
        "min_tokens": tokens,
        "ignore_eos": true,
        "temperature": 0,
    }))
    .unwrap_or_default()
}

/// What the engine's own `/metrics` says about its requests.
#[derive(Debug, Clone, Copy)]
struct EngineState {
    running: f64,
    waiting: f64,
    /// `vllm:request_success_total` over every finish reason.
    finished: f64,
}

/// The engine's state, or `None` when its `/metrics` could not be read
/// (a loaded API server can be slow to answer; the caller polls again).
fn engine_state(addr: SocketAddr) -> Option<EngineState> {
    let (status, text) = vllm::http_get(addr, "/metrics").ok()?;
    if status != 200 {
        return None;
    }
    Some(EngineState {
        running: vllm::metric_sum(&text, "vllm:num_requests_running").unwrap_or(0.0),
        waiting: vllm::metric_sum(&text, "vllm:num_requests_waiting").unwrap_or(0.0),
        finished: vllm::metric_sum(&text, "vllm:request_success_total").unwrap_or(0.0),
    })
}

/// Polls the engine until `reached` holds. Fails at once if it finished a
/// request beyond `finished_before` first: the first request ended before
/// the queue was built, so the round would show no order. Fails after
/// `ENGINE_DEADLINE` (a hang).
async fn wait_for_engine(
    addr: SocketAddr,
    what: &str,
    finished_before: f64,
    since: Instant,
    reached: impl Fn(&EngineState) -> bool,
) -> anyhow::Result<EngineState> {
    let deadline = Instant::now() + ENGINE_DEADLINE;
    let mut last = None;
    loop {
        if let Some(state) = tokio::task::spawn_blocking(move || engine_state(addr)).await? {
            if reached(&state) {
                return Ok(state);
            }
            anyhow::ensure!(
                state.finished <= finished_before,
                "the first request ({FIRST_TOKENS} tokens) ended, {:?} after it was sent, before the engine showed \
                 {what}: the queue must be built while it runs, or the round shows no order (engine: {state:?})",
                since.elapsed()
            );
            last = Some(state);
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the engine never showed {what} within {ENGINE_DEADLINE:?}: last seen {last:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The completion tokens in a stream's usage chunk.
fn completion_tokens(stream: &str) -> Option<u64> {
    stream
        .lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .filter_map(|data| serde_json::from_str::<Value>(data).ok())
        .find_map(|chunk| chunk.pointer("/usage/completion_tokens")?.as_u64())
}

/// Round `round` (earlier rounds' requests all finished): sends a long
/// request with priority `queued` and, each once the engine
/// counts the one before, `QUEUED - 1` more (one running, the rest waiting
/// in the engine), then, once the engine shows those waiting, a last one
/// with priority `last`, and checks that the engine held all of them
/// waiting before the first ended. Returns the indexes in the order the
/// engine started them (the last one is `QUEUED`): the order of their first
/// streamed chunk, which vLLM sends with the first token.
async fn start_order(
    cluster: &Cluster,
    round: usize,
    queued: Option<&str>,
    last: Option<&str>,
) -> anyhow::Result<Vec<usize>> {
    let engine = cluster.workers[0].addr;
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
            // The decode length the spacing of first chunks rests on.
            anyhow::ensure!(
                completion_tokens(&text) == Some(tokens),
                "request {n}: not {tokens} tokens decoded: {text}"
            );
            let first = first.ok_or_else(|| anyhow::anyhow!("request {n}: no chunk"))?;
            eprintln!("  request {n} started at {first:?}, ended at {:?}", started.elapsed());
            anyhow::Ok((n, first))
        })
    };
    // Idle, every earlier request counted: its gauges and counters are
    // updated with the outputs, which may follow the last stream's end.
    let earlier = (round * (QUEUED + 1)) as f64;
    let before = wait_for_engine(engine, "itself idle", f64::INFINITY, started, |s| {
        s.running == 0.0 && s.waiting == 0.0 && s.finished >= earlier
    })
    .await?;
    anyhow::ensure!(
        before.finished == earlier,
        "the engine finished requests this test did not send: {before:?}"
    );
    let mut tasks = vec![send(0, FIRST_TOKENS, queued)];
    // The first runs (max-num-seqs 1); each next one is sent once the engine
    // holds the one before it, so arrival order, vLLM's tie-break, is that
    // of the indexes, whatever the load.
    wait_for_engine(engine, "the first request running", before.finished, started, |s| {
        s.running >= 1.0
    })
    .await?;
    for n in 1..=QUEUED {
        tasks.push(send(n, OUTPUT_TOKENS, if n < QUEUED { queued } else { last }));
        let what = format!("{n} requests waiting");
        let seen = wait_for_engine(engine, &what, before.finished, started, |s| s.waiting >= n as f64).await?;
        eprintln!("  request {n} queued at {:?}: {seen:?}", started.elapsed());
    }
    // All QUEUED waited at once behind the first, which had not ended (else
    // one of them would have started and left the queue): the last one was
    // in the queue before any other queued one could start.
    let mut firsts = Vec::new();
    for task in tasks {
        firsts.push(task.await??);
    }
    firsts.sort_by_key(|(_, first)| *first);
    Ok(firsts.into_iter().map(|(n, _)| n).collect())
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
        // The sidecar's answer may wait on a loaded machine: a Pick that
        // timed out would fail open (still rewritten, but not this test's
        // path); none may (checked below).
        plugin: json!({"priority_field": {"engine": "vllm"}, "sidecar_timeout_ms": PATIENT_SIDECAR_TIMEOUT_MS}),
        sidecar_args: sidecar_args(),
        ..ClusterOptions::default()
    })
    .await?;
    eprintln!("vLLM, sidecar and Envoy ready in {:?}", started.elapsed());

    // Everyone at kvmesh's 0 (the lead class, vLLM's 0): first come, first
    // served, in the order the engine received them.
    eprintln!("no priorities:");
    let fcfs = start_order(&cluster, 0, None, None).await?;
    assert_eq!(
        fcfs,
        (0..=QUEUED).collect::<Vec<_>>(),
        "without priorities they start in arrival order: {fcfs:?}"
    );

    // Queued at -100 (vLLM 100), the last at 100 (vLLM -100): it starts as
    // soon as the running one is done, before the three that waited.
    eprintln!("the last one at a higher priority:");
    let order = start_order(&cluster, 1, Some("-100"), Some("100")).await?;
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
    assert_eq!(
        cluster.fail_opens().await?,
        (0, 0),
        "requests failed open (sidecar errors, timeouts)"
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
