//! Real engines: three vLLM workers (CPU build, the tiny model of
//! `./dev setup-vllm`) behind the real Envoy with the kvmesh filter and
//! sidecar. A multi-turn agent session in each API vLLM serves, streamed and
//! not, stays on one engine, and from its second call on that engine itself
//! reports the reused prefix (whole 128-token blocks) in `usage`; the
//! sidecar receives exactly the tokens the engines reported. A real
//! Prometheus scrapes the sidecar, Envoy and the engines meanwhile, and
//! every query of the shipped dashboard returns series on it.
//!
//! One test function: a vLLM start is 20-45 s and 3 GB, so the workers are
//! started once and every case runs against them.

#![allow(clippy::panic)] // a reply without usage fails the test loudly

use std::time::{Duration, Instant};

use kvmesh_integration::prometheus::{self, Prometheus};
use kvmesh_integration::vllm::{self, BLOCK_SIZE_TOKENS, SERVED_MODEL, VllmOptions};
use kvmesh_integration::workload::{tool_loop_chat_messages, tool_loop_system_prompt, tool_loop_tool_result};
use kvmesh_integration::{Cluster, ClusterOptions, Engine, PATIENT_SIDECAR_TIMEOUT_MS, Reply};
use serde_json::{Value, json};

const TURNS: usize = 4;
/// Tokens generated per call: vLLM on CPU can starve the machine's other
/// work while it decodes.
const MAX_TOKENS: u64 = 4;
/// Bounds a wait for the engines' or the sidecar's counts to follow a
/// reply: milliseconds normally, far more even at load 8. Only a hang
/// reaches it.
const DEADLINE: Duration = Duration::from_secs(60);
/// The sidecar's count of workers it marked down.
const DOWN_EVENTS: &str = "kvmesh_worker_events_total{event=\"down\"}";

/// About 800 tokens of the tiny model's tokenizer: several full blocks.
/// Asks for the final usage chunk of a stream. vLLM answers 400 to
/// `stream_options` on a call that does not stream ("Stream options can
/// only be defined when `stream=True`").
fn with_usage_when_streaming(mut body: Value) -> Value {
    if body["stream"] == json!(true) {
        body["stream_options"] = json!({"include_usage": true});
    }
    body
}

/// The body of call `turn` of a session in `api`, each call resending the
/// whole conversation plus one more tool round trip.
fn body(api: &str, repo: &str, turn: usize, stream: bool) -> Value {
    match api {
        "/v1/chat/completions" => {
            let messages = tool_loop_chat_messages(repo, turn);
            with_usage_when_streaming(
                json!({"model": SERVED_MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "stream": stream}),
            )
        }
        "/v1/completions" => {
            let mut prompt = tool_loop_system_prompt(repo);
            for t in 0..turn {
                prompt.push_str(&tool_loop_tool_result(t));
            }
            with_usage_when_streaming(
                json!({"model": SERVED_MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                             "stream": stream, "user": format!("{repo}-user")}),
            )
        }
        "/v1/responses" => {
            let mut input = vec![json!({"type": "message", "role": "user",
                                        "content": [{"type": "input_text", "text": "Fix the failing test."}]})];
            for t in 0..turn {
                input.push(
                    json!({"type": "function_call", "name": "shell", "call_id": format!("k{t}"),
                                  "arguments": format!("{{\"command\":[\"cat\",\"src/module_{t}.rs\"]}}")}),
                );
                input.push(
                    json!({"type": "function_call_output", "call_id": format!("k{t}"), "output": tool_loop_tool_result(t)}),
                );
            }
            json!({"model": SERVED_MODEL, "instructions": tool_loop_system_prompt(repo), "input": input,
                   "max_output_tokens": MAX_TOKENS, "stream": stream, "store": false,
                   "prompt_cache_key": format!("{repo}-codex")})
        }
        _ => {
            let mut messages =
                vec![json!({"role": "user", "content": [{"type": "text", "text": "Fix the failing test."}]})];
            for t in 0..turn {
                messages.push(
                    json!({"role": "assistant", "content": [{"type": "tool_use", "id": format!("t{t}"),
                    "name": "Read", "input": {"n": t}}]}),
                );
                messages.push(
                    json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": format!("t{t}"),
                    "content": tool_loop_tool_result(t)}]}),
                );
            }
            if let Some(last) = messages.last_mut() {
                last["content"][0]["cache_control"] = json!({"type": "ephemeral"});
            }
            json!({"model": SERVED_MODEL, "max_tokens": MAX_TOKENS, "stream": stream,
                   "system": [{"type": "text", "text": tool_loop_system_prompt(repo), "cache_control": {"type": "ephemeral"}}],
                   "messages": messages})
        }
    }
}

/// The reply's JSON documents: the body, or each SSE `data:` line.
fn documents(reply: &Reply) -> Vec<Value> {
    if reply.body.trim_start().starts_with('{') {
        return vec![serde_json::from_str(&reply.body).unwrap_or(Value::Null)];
    }
    reply
        .body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str(d).ok())
        .collect()
}

/// The last `usage` object the engine sent, as it sent it.
fn last_usage(api: &str, reply: &Reply) -> Value {
    documents(reply)
        .iter()
        .rev()
        .find_map(|e| {
            let usage = match api {
                "/v1/responses" => e.pointer("/response/usage").or_else(|| e.get("usage")),
                "/v1/messages" => e.get("usage").or_else(|| e.pointer("/message/usage")),
                _ => e.get("usage"),
            }?;
            (!usage.is_null()).then(|| usage.clone())
        })
        .unwrap_or_else(|| panic!("no usage in the {api} reply: {}", reply.body))
}

/// (prompt tokens, cached tokens) from `usage`, read independently of the
/// filter's own reader. Messages' `input_tokens` excludes the cached part.
fn prompt_and_cached(api: &str, usage: &Value) -> (u64, u64) {
    let n = |p: &str| usage.pointer(p).and_then(Value::as_u64);
    let found = match api {
        "/v1/responses" => n("/input_tokens").zip(n("/input_tokens_details/cached_tokens")),
        "/v1/messages" => n("/input_tokens")
            .zip(n("/cache_read_input_tokens"))
            .map(|(input, read)| {
                let created = n("/cache_creation_input_tokens").unwrap_or(0);
                (input + read + created, read)
            }),
        _ => n("/prompt_tokens").zip(n("/prompt_tokens_details/cached_tokens")),
    };
    found.unwrap_or_else(|| panic!("{api}: no prompt or cached tokens in {usage}"))
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

/// Requests the filter sent on without the sidecar's answer: timed out or
/// failed calls.
async fn fail_opens(cluster: &Cluster) -> anyhow::Result<u64> {
    let (errors, timeouts) = cluster.fail_opens().await?;
    Ok(errors + timeouts)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_on_real_vllm_stay_on_one_engine_which_reports_its_cached_blocks() -> anyhow::Result<()> {
    let started = Instant::now();
    let cluster = Cluster::start(ClusterOptions {
        engine: Engine::Vllm(VllmOptions {
            // 16,384 tokens each: the eight sessions' prompts fit with room.
            blocks: 128,
            max_model_len: 4096,
            ..VllmOptions::default()
        }),
        plugin: json!({"sidecar_timeout_ms": PATIENT_SIDECAR_TIMEOUT_MS}),
        sidecar_args: sidecar_args(),
        ..ClusterOptions::default()
    })
    .await?;
    eprintln!("3 vLLM workers, sidecar and Envoy ready in {:?}", started.elapsed());
    // A real Prometheus scrapes the sidecar, Envoy and the three engines
    // throughout; the dashboard is evaluated on it at the end.
    let prometheus = Prometheus::start(&cluster.dir.join("prometheus"), &prometheus::jobs(&cluster)).await?;

    // What each engine states about its cache, which the sidecar reads.
    for index in 0..cluster.workers.len() {
        let text = cluster.worker_metrics(index).await?;
        let labels = vllm::metric_labels(&text, "vllm:cache_config_info").unwrap_or_default();
        let label = |k: &str| labels.iter().find(|(key, _)| key == k).map(|(_, v)| v.as_str());
        assert_eq!(label("block_size"), Some("128"), "{labels:?}");
        assert_eq!(label("num_gpu_blocks"), Some("128"), "{labels:?}");
        assert_eq!(label("enable_prefix_caching"), Some("True"), "{labels:?}");
    }

    // Every engine is up in the sidecar's view before the first call, and
    // none is marked down while the sessions run (checked per session): a
    // session moves for no other reason than routing.
    let deadline = Instant::now() + DEADLINE;
    loop {
        let workers = cluster.sidecar_workers().await?;
        if workers.len() == cluster.workers.len() && workers.iter().all(|w| w["healthy"] == true) {
            break;
        }
        anyhow::ensure!(Instant::now() < deadline, "engines not all up: {workers:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let downs_before = cluster.sidecar_metric(DOWN_EVENTS).await?;

    let apis = [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
    ];
    let (mut requests, mut prompt_sum, mut cached_sum) = (0u64, 0u64, 0u64);
    let mut engines_used = std::collections::BTreeSet::new();
    for api in apis {
        // What the sidecar is told, per API: the counters' growth over this
        // API's calls against the sums of what the engines returned.
        cluster.wait_for_no_in_flight(DEADLINE).await?;
        let told = || async {
            anyhow::Ok((
                cluster.sidecar_metric("kvmesh_reported_prompt_tokens_total").await?,
                cluster.sidecar_metric("kvmesh_reported_cached_tokens_total").await?,
            ))
        };
        let (told_prompt, told_cached) = told().await?;
        let (api_prompt, api_cached) = (prompt_sum, cached_sum);
        for stream in [false, true] {
            let case = Instant::now();
            let repo = format!("repo{}{}", api.replace('/', "-"), if stream { "-stream" } else { "" });
            let session = format!("session-{repo}");
            let headers: Vec<(&str, &str)> = match api {
                "/v1/messages" => vec![
                    ("x-claude-code-session-id", session.as_str()),
                    ("anthropic-version", "2023-06-01"),
                ],
                "/v1/responses" => vec![("session-id", session.as_str())],
                // OpenCode's header.
                "/v1/chat/completions" => vec![("x-session-affinity", session.as_str())],
                _ => vec![],
            };
            let (mut engines, mut prompts, mut cached) = (Vec::new(), Vec::new(), Vec::new());
            for turn in 0..TURNS {
                let mut all = vec![("content-type", "application/json")];
                all.extend(headers.iter().copied());
                let bytes = serde_json::to_vec(&body(api, &repo, turn, stream))?;
                let before = cluster.engine_requests_finished().await?;
                let reply = cluster.send(reqwest::Method::POST, api, &all, bytes).await?;
                assert_eq!(reply.status, 200, "{api} stream={stream} turn {turn}: {}", reply.body);
                let engine = cluster.engine_that_served(&before, DEADLINE).await?;
                let usage = last_usage(api, &reply);
                if turn == 1 {
                    eprintln!("{api} stream={stream} usage: {usage}");
                }
                let (prompt, hit) = prompt_and_cached(api, &usage);
                engines.push(engine);
                prompts.push(prompt);
                cached.push(hit);
                requests += 1;
                prompt_sum += prompt;
                cached_sum += hit;
            }
            // Every call was placed by the sidecar, none by round robin
            // (which would move the session for a reason other than routing).
            assert_eq!(
                fail_opens(&cluster).await?,
                0,
                "{api} stream={stream}: requests failed open; engines {engines:?}"
            );
            assert_eq!(
                cluster.sidecar_metric(DOWN_EVENTS).await?,
                downs_before,
                "{api} stream={stream}: an engine was marked down (a scrape failed twice); engines {engines:?}"
            );
            assert!(
                engines.iter().all(|e| *e == engines[0]),
                "{api} stream={stream}: the session moved between engines {engines:?}"
            );
            engines_used.insert(engines[0]);
            assert!(
                prompts.windows(2).all(|w| w[1] > w[0]),
                "{api} stream={stream}: the prompt did not grow {prompts:?}"
            );
            // The engine's own word: the previous call's prefix was in its
            // cache, in whole blocks, and never more than the prompt.
            for turn in 1..TURNS {
                assert!(
                    cached[turn] > 0 && cached[turn] % BLOCK_SIZE_TOKENS == 0 && cached[turn] <= prompts[turn],
                    "{api} stream={stream} turn {turn}: cached {cached:?} of prompts {prompts:?}"
                );
            }
            eprintln!(
                "{api} stream={stream}: engine {}, prompts {prompts:?}, cached {cached:?}, {:?}",
                engines[0],
                case.elapsed()
            );
        }
        cluster.wait_for_no_in_flight(DEADLINE).await?;
        let (now_prompt, now_cached) = told().await?;
        assert_eq!(
            (now_prompt - told_prompt, now_cached - told_cached),
            ((prompt_sum - api_prompt) as f64, (cached_sum - api_cached) as f64),
            "{api}: prompt and cached tokens the sidecar was told, against the engines' own"
        );
    }
    eprintln!("sessions spread over engines {engines_used:?}");

    // One Outcome per request, with exactly the tokens the engines reported.
    cluster.wait_for_no_in_flight(DEADLINE).await?;
    assert_eq!(
        cluster.sidecar_metric("kvmesh_reports_total{known=\"true\"}").await?,
        requests as f64
    );
    assert_eq!(
        cluster.sidecar_metric("kvmesh_reported_prompt_tokens_total").await?,
        prompt_sum as f64,
        "prompt tokens the sidecar was told, against the engines' own"
    );
    assert_eq!(
        cluster.sidecar_metric("kvmesh_reported_cached_tokens_total").await?,
        cached_sum as f64,
        "cached tokens the sidecar was told, against the engines' own"
    );
    assert_eq!(
        cluster.envoy_counter("wasmcustom.kvmesh.outcomes.with_usage").await?,
        requests
    );
    assert_eq!(fail_opens(&cluster).await?, 0, "requests failed open");
    // The sidecar's engine watcher read each engine's capacity from
    // `vllm:cache_config_info`: 128 blocks of 128 tokens.
    let workers = cluster.sidecar_workers().await?;
    eprintln!("sidecar /debug/workers: {}", serde_json::to_string(&workers)?);
    for worker in &workers {
        assert_eq!(
            worker["engine_capacity_tokens"].as_u64(),
            Some(128 * BLOCK_SIZE_TOKENS),
            "{worker}"
        );
        // And its block size, at which predictions come in whole blocks.
        assert_eq!(
            worker["engine_block_tokens"].as_u64(),
            Some(BLOCK_SIZE_TOKENS),
            "{worker}"
        );
    }
    let predicted = cluster.sidecar_metric("kvmesh_predicted_cached_tokens_total").await?;
    assert!(
        predicted > 0.0 && predicted % BLOCK_SIZE_TOKENS as f64 == 0.0,
        "predictions of {predicted} tokens are not whole engine blocks"
    );
    // Prometheus saw the engines' own counters, and every dashboard query
    // has series: the kvmesh panels and the engines' panels alike.
    prometheus.wait_for("sum(kvmesh_picks_total)", requests as f64).await?;
    prometheus
        .wait_for(r#"sum(vllm:prompt_tokens_total{job="workers"})"#, prompt_sum as f64)
        .await?;
    assert_eq!(
        prometheus
            .scalar(r#"sum(vllm:prompt_tokens_total{job="workers"})"#)
            .await?,
        prompt_sum as f64,
        "the engines' prompt tokens as Prometheus scraped them"
    );
    for series in [
        "kvmesh_calls_total",
        "kvmesh_picks_total",
        "kvmesh_picks",
        "vllm:prefix_cache_hits_total",
    ] {
        prometheus
            .wait_for(&format!("min(count_over_time({series}[1m]))"), 3.0)
            .await?;
    }
    let empty = prometheus.empty_dashboard_queries().await?;
    assert!(
        empty.is_empty(),
        "{} dashboard queries returned no series on real vLLM:\n{}",
        empty.len(),
        empty.join("\n")
    );
    // What the sidecar predicted against what the engines reported.
    for prefix in ["kvmesh_predicted_cached", "kvmesh_reported_"] {
        for (series, value) in cluster.sidecar_samples_at(cluster.sidecar_admin, prefix).await? {
            eprintln!("sidecar {series} {value}");
        }
    }
    eprintln!("whole test {:?}", started.elapsed());
    Ok(())
}
