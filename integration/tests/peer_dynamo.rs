//! NVIDIA Dynamo 1.6.1 (`./dev setup-peers`) as a peer router, run the way
//! its users run it: its frontend with the KV router (`python -m
//! dynamo.frontend --router-mode kv`) in front of two of its own vLLM
//! workers (`python -m dynamo.vllm`: the vLLM 0.31.0 CPU build, serving the
//! tiny model of `./dev setup-vllm` with the engine flags of
//! `kvmesh_integration::vllm`), which publish vLLM's real KV events to the
//! router. No etcd or NATS: file discovery, ZMQ event plane, TCP request
//! plane, all on loopback (`kvmesh_integration::peers` has the details).
//!
//! An agent-like session of four chat calls, each resending the
//! conversation so far behind a long stable system prompt, is sent through
//! the KV router, then another through its session-affinity variant
//! (`--router-session-affinity-ttl-secs`, header `x-dynamo-session-id`).
//! Where each call went and what it reused are read from the engines' own
//! counters (`vllm:request_success_total`, `vllm:prefix_cache_hits_total`
//! on each worker's system port), not from Dynamo: every call of a session
//! reached one engine, its first call hit nothing and each later one was
//! served partly from that engine's prefix cache, as the reply's
//! `cached_tokens` says too. Before each call the test waits until the
//! router has applied every KV event the engines published (Dynamo's own
//! counters on both sides), so the router decides on the engines' real
//! state however loaded the machine; with that, the router's own count of
//! cached prefix tokens it selected equals the engines' hits.
//!
//! A third session goes through the router in its approximate mode
//! (`--no-router-kv-events`): it predicts the caches from its own routing
//! decisions, and the session still stays on one engine, served from cache.
//!
//! One test function: the engines' start is most of its time, so the three
//! frontends use the same two engines, one after another. `./dev test` installs Dynamo first
//! (`setup-peers`).

#![allow(clippy::panic)] // a reply without usage fails the test loudly

use std::time::{Duration, Instant};

use kvmesh_integration::peers::{
    self, DYNAMO_SESSION_HEADER, Dynamo, DynamoAffinity, DynamoAffinityMode, DynamoEngineOptions, DynamoEngines,
    DynamoOptions,
};
use kvmesh_integration::vllm::{self, BLOCK_SIZE_TOKENS, READY_TIMEOUT, SERVED_MODEL};
use kvmesh_integration::workload::tool_loop_chat_messages;
use serde_json::{Value, json};

const TURNS: usize = 4;
/// Tokens generated per call: vLLM on CPU can starve the machine's other
/// work while it decodes.
const MAX_TOKENS: u64 = 4;
/// Bounds a wait for a counter to follow a reply: milliseconds normally,
/// far more at load 8. Only a hang reaches it.
const DEADLINE: Duration = Duration::from_secs(60);

/// Call `turn` of session `repo`: the whole conversation so far plus one
/// more tool round trip. Greedy.
fn body(repo: &str, turn: usize) -> Value {
    let messages = tool_loop_chat_messages(repo, turn);
    json!({"model": SERVED_MODEL, "messages": messages, "max_tokens": MAX_TOKENS,
           "temperature": 0, "seed": 7})
}

async fn metrics(http: &reqwest::Client, url: &str) -> anyhow::Result<String> {
    Ok(http.get(url).send().await?.error_for_status()?.text().await?)
}

/// The sum of the samples named `name` whose labels contain `label`.
fn sum_with(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| l.strip_prefix(name).is_some_and(|r| r.starts_with('{')) && l.contains(label))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// One engine's own counts.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Counts {
    finished: f64,
    /// Prefix cache lookups and hits, in tokens.
    queries: f64,
    hits: f64,
    /// KV events its Dynamo worker took from vLLM and published.
    events: f64,
}

async fn counts(http: &reqwest::Client, engines: &DynamoEngines) -> anyhow::Result<Vec<Counts>> {
    let mut all = Vec::new();
    for engine in &engines.engines {
        let text = metrics(http, &engine.metrics_url()).await?;
        let sum = |name| vllm::metric_sum(&text, name).unwrap_or(0.0);
        all.push(Counts {
            finished: sum("vllm:request_success_total"),
            queries: sum("vllm:prefix_cache_queries_total"),
            hits: sum("vllm:prefix_cache_hits_total"),
            events: sum_with(
                &text,
                "dynamo_component_kv_publisher_zmq_events_total",
                "stage=\"accepted\"",
            ),
        });
    }
    Ok(all)
}

/// The router's own counters (the frontend's `/metrics`).
#[derive(Debug, Clone, Copy, Default)]
struct Router {
    /// KV events it applied to its index, whatever their outcome.
    applied: f64,
    /// Prompt tokens it expected the chosen engine to have cached.
    selected_cached: f64,
}

async fn router(http: &reqwest::Client, dynamo: &Dynamo) -> anyhow::Result<Router> {
    let text = metrics(http, &dynamo.metrics_url()).await?;
    let sum = |name| vllm::metric_sum(&text, name).unwrap_or(0.0);
    Ok(Router {
        applied: sum("dynamo_component_kv_cache_events_applied"),
        selected_cached: sum("dynamo_component_router_kv_selected_cached_prefix_tokens_total"),
    })
}

/// Waits until the router has applied as many KV events since `start` as
/// the engines published since `start_counts`: then it routes on the
/// engines' real state, not on a moment's lag of its event plane.
async fn events_settled(
    http: &reqwest::Client,
    dynamo: &Dynamo,
    engines: &DynamoEngines,
    start: Router,
    start_counts: &[Counts],
) -> anyhow::Result<()> {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let published: f64 = counts(http, engines)
            .await?
            .iter()
            .zip(start_counts)
            .map(|(n, b)| n.events - b.events)
            .sum();
        let applied = router(http, dynamo).await?.applied - start.applied;
        if applied >= published {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the router applied {applied} of the {published} KV events the engines published within {DEADLINE:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The engine that finished exactly one more request than in `before`, and
/// the prefix-cache tokens it looked up and hit meanwhile (polled: the
/// counters can follow the reply by a moment).
async fn served_by(
    http: &reqwest::Client,
    engines: &DynamoEngines,
    before: &[Counts],
    prompt: u64,
) -> anyhow::Result<(usize, Counts)> {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let now = counts(http, engines).await?;
        let delta: Vec<Counts> = now
            .iter()
            .zip(before)
            .map(|(n, b)| Counts {
                finished: n.finished - b.finished,
                queries: n.queries - b.queries,
                hits: n.hits - b.hits,
                events: n.events - b.events,
            })
            .collect();
        let grew: Vec<usize> = (0..delta.len()).filter(|i| delta[*i].finished > 0.0).collect();
        match grew.as_slice() {
            [] => {}
            [one] if delta[*one].finished == 1.0 => {
                if delta[*one].queries >= prompt as f64 {
                    return Ok((*one, delta[*one]));
                }
            }
            _ => anyhow::bail!("more than the one call finished: {before:?} -> {now:?}"),
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "no engine finished the call within {DEADLINE:?}: {before:?} -> {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `(prompt_tokens, cached_tokens)` of a chat reply's usage.
fn usage(reply: &Value) -> (u64, u64) {
    let n = |p: &str| reply.pointer(p).and_then(Value::as_u64);
    n("/usage/prompt_tokens")
        .zip(n("/usage/prompt_tokens_details/cached_tokens").or(Some(0)))
        .unwrap_or_else(|| panic!("no usage in {reply}"))
}

async fn post(http: &reqwest::Client, base: &str, session: &str, body: &Value) -> anyhow::Result<Value> {
    let reply = http
        .post(format!("{base}/v1/chat/completions"))
        .header(DYNAMO_SESSION_HEADER, session)
        .json(body)
        .send()
        .await?;
    let status = reply.status();
    let text = reply.text().await?;
    anyhow::ensure!(status.is_success(), "{base}: {status} {text}");
    Ok(serde_json::from_str(&text)?)
}

/// Sends the session `repo` through `dynamo`, call by call, and asserts
/// from the engines' counters that it stayed on one engine which served its
/// later calls from cache. Returns the router's selected cached tokens and
/// the engine's hits, summed over the session.
async fn session(
    http: &reqwest::Client,
    dynamo: &Dynamo,
    engines: &DynamoEngines,
    arm: &str,
    repo: &str,
    kv_events: bool,
) -> anyhow::Result<(f64, u64)> {
    let (start, start_counts) = (router(http, dynamo).await?, counts(http, engines).await?);
    let (mut served, mut prompts, mut hits, mut cached) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for turn in 0..TURNS {
        if kv_events {
            events_settled(http, dynamo, engines, start, &start_counts).await?;
        }
        let before = counts(http, engines).await?;
        let reply = post(http, &dynamo.url(), repo, &body(repo, turn)).await?;
        let (prompt, reported) = usage(&reply);
        let (engine, delta) = served_by(http, engines, &before, prompt).await?;
        served.push(engine);
        prompts.push(prompt);
        hits.push(delta.hits as u64);
        cached.push(reported);
    }
    let selected = router(http, dynamo).await?.selected_cached - start.selected_cached;
    eprintln!(
        "{arm}: engines {served:?}, prompt tokens {prompts:?}, prefix cache hits {hits:?}, usage cached {cached:?}, \
         router's selected cached tokens {selected}"
    );
    assert!(
        served.iter().all(|e| *e == served[0]),
        "{arm}: the session moved between engines {served:?}"
    );
    assert!(
        prompts.windows(2).all(|w| w[1] > w[0]),
        "{arm}: the prompt did not grow {prompts:?}"
    );
    assert_eq!(hits[0], 0, "{arm}: the first call hit the cache {hits:?}");
    for turn in 1..TURNS {
        assert!(
            hits[turn] > 0 && hits[turn] % BLOCK_SIZE_TOKENS == 0 && hits[turn] <= prompts[turn],
            "{arm} turn {turn}: prefix cache hits {hits:?} of prompts {prompts:?}"
        );
    }
    assert_eq!(hits, cached, "{arm}: the engine's counter against the reply's usage");
    Ok((selected, hits.iter().sum()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamo_keeps_an_agent_session_on_one_vllm_engine_which_serves_it_from_cache() -> anyhow::Result<()> {
    let started = Instant::now();
    // Before the engines' start: fail at once when Dynamo is missing.
    peers::dynamo_install()?;
    let dir = std::env::temp_dir().join(format!("kvmesh-peer-dynamo-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    eprintln!("logs in {}", dir.display());
    let engines = {
        let dir = dir.clone();
        let options = DynamoEngineOptions {
            // 8,192 tokens each: a session's prompts fit many times over.
            blocks: 64,
            max_model_len: 4096,
            ready_timeout: READY_TIMEOUT,
            ..DynamoEngineOptions::default()
        };
        tokio::task::spawn_blocking(move || DynamoEngines::start(2, &options, &dir)).await??
    };
    for engine in &engines.engines {
        eprintln!(
            "{} ready in {:.1?} ({})",
            engine.name,
            engine.ready_after,
            engine.metrics_url()
        );
    }
    let http = reqwest::Client::builder().timeout(Duration::from_secs(120)).build()?;

    // The KV router with the engines' KV events, as Dynamo ships it but for
    // loopback and file discovery.
    let kv = {
        let (engines, dir) = (&engines, &dir);
        tokio::task::block_in_place(|| Dynamo::start(engines, &DynamoOptions::default(), dir))?
    };
    eprintln!("dynamo kv router ready in {:.1?}", kv.ready_after);
    let (selected, hits) = session(&http, &kv, &engines, "kv", "acme/dynamo-kv", true).await?;
    // With its index in step with the engines' events, the router expected
    // exactly the cache the engine then hit.
    assert_eq!(
        selected, hits as f64,
        "the router's selected cached tokens against the engine's hits"
    );
    drop(kv);

    // Session affinity on x-dynamo-session-id (hard, Dynamo's default mode).
    let sticky = {
        let options = DynamoOptions {
            session_affinity: Some(DynamoAffinity {
                ttl_secs: 600,
                mode: DynamoAffinityMode::Hard,
            }),
            ..DynamoOptions::default()
        };
        let (engines, dir) = (&engines, &dir);
        tokio::task::block_in_place(|| Dynamo::start(engines, &options, dir))?
    };
    eprintln!(
        "dynamo kv router + session affinity ready in {:.1?}",
        sticky.ready_after
    );
    session(&http, &sticky, &engines, "kv+affinity", "acme/dynamo-affinity", true).await?;
    drop(sticky);

    // Approximate mode: no KV events, the router predicts the caches from
    // its own decisions (blocks expire after --router-ttl-secs, 120 s).
    let approximate = {
        let options = DynamoOptions {
            kv_events: false,
            ..DynamoOptions::default()
        };
        let (engines, dir) = (&engines, &dir);
        tokio::task::block_in_place(|| Dynamo::start(engines, &options, dir))?
    };
    eprintln!(
        "dynamo kv router, approximate, ready in {:.1?}",
        approximate.ready_after
    );
    session(
        &http,
        &approximate,
        &engines,
        "kv approximate",
        "acme/dynamo-approximate",
        false,
    )
    .await?;
    drop(approximate);
    drop(engines);
    std::fs::remove_dir_all(&dir)?;
    eprintln!("whole test {:?}", started.elapsed());
    Ok(())
}
