//! A multi-turn session in each of the four APIs, streamed and not, through
//! the real Envoy: every call of a session lands on one worker, and the
//! sidecar receives one Outcome per request carrying the cached tokens the
//! worker reported.

#![allow(clippy::panic)] // a reply without usage fails the test loudly

use std::time::Duration;

use kvmesh_integration::cluster::settled;
use kvmesh_integration::workload::{tool_loop_chat_messages, tool_loop_system_prompt, tool_loop_tool_result};
use kvmesh_integration::{Cluster, ClusterOptions, Reply};
use serde_json::{Value, json};

const TURNS: usize = 4;

/// The body of call `turn` of a session in `api`, each call resending the
/// whole conversation plus one more tool round trip.
fn body(api: &str, repo: &str, turn: usize, stream: bool) -> Value {
    match api {
        "/v1/chat/completions" => {
            let messages = tool_loop_chat_messages(repo, turn);
            let mut body = json!({"model": "m", "messages": messages, "stream": stream});
            // Engines refuse stream options on a call that does not stream.
            if stream {
                body["stream_options"] = json!({"include_usage": true});
            }
            body
        }
        "/v1/completions" => {
            let mut prompt = tool_loop_system_prompt(repo);
            for t in 0..turn {
                prompt.push_str(&tool_loop_tool_result(t));
            }
            let mut body = json!({"model": "m", "prompt": prompt, "stream": stream, "user": format!("{repo}-user")});
            if stream {
                body["stream_options"] = json!({"include_usage": true});
            }
            body
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
            json!({"model": "m", "instructions": tool_loop_system_prompt(repo), "input": input, "stream": stream,
                   "store": false, "prompt_cache_key": format!("{repo}-codex")})
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
            // Claude Code marks the newest message for caching on every call.
            if let Some(last) = messages.last_mut() {
                last["content"][0]["cache_control"] = json!({"type": "ephemeral"});
            }
            json!({"model": "m", "max_tokens": 64, "stream": stream,
                   "system": [{"type": "text", "text": tool_loop_system_prompt(repo), "cache_control": {"type": "ephemeral"}}],
                   "messages": messages})
        }
    }
}

/// (prompt tokens, cached tokens) as the worker reported them, read
/// independently of the filter's own reader.
fn reported_usage(api: &str, reply: &Reply) -> (u64, u64) {
    let events: Vec<Value> = if reply.body.trim_start().starts_with('{') {
        vec![serde_json::from_str(&reply.body).unwrap_or(Value::Null)]
    } else {
        reply
            .body
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter_map(|d| serde_json::from_str(d).ok())
            .collect()
    };
    let n = |v: &Value, p: &str| v.pointer(p).and_then(Value::as_u64);
    for e in events.iter().rev() {
        let found = match api {
            "/v1/responses" => e
                .pointer("/response/usage")
                .or_else(|| e.get("usage"))
                .and_then(|u| Some((n(u, "/input_tokens")?, n(u, "/input_tokens_details/cached_tokens")?))),
            "/v1/messages" => e.pointer("/message/usage").or_else(|| e.get("usage")).and_then(|u| {
                let read = n(u, "/cache_read_input_tokens")?;
                Some((n(u, "/input_tokens")? + read, read))
            }),
            _ => e
                .get("usage")
                .and_then(|u| Some((n(u, "/prompt_tokens")?, n(u, "/prompt_tokens_details/cached_tokens")?))),
        };
        if let Some(found) = found {
            return found;
        }
    }
    panic!("no usage in the {api} reply: {}", reply.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_in_every_api_stay_on_their_worker_and_report_cached_tokens() -> anyhow::Result<()> {
    let cluster = Cluster::start(ClusterOptions::default().patient()).await?;
    let apis = [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
    ];
    let (mut requests, mut prompt_sum, mut cached_sum) = (0u64, 0u64, 0u64);
    for api in apis {
        for stream in [false, true] {
            let repo = format!("repo{}{}", api.replace('/', "-"), if stream { "-stream" } else { "" });
            let session = format!("session-{repo}");
            let headers: Vec<(&str, &str)> = match api {
                "/v1/messages" => vec![
                    ("x-claude-code-session-id", session.as_str()),
                    ("anthropic-version", "2023-06-01"),
                ],
                "/v1/responses" => vec![("session-id", session.as_str())],
                "/v1/chat/completions" => vec![("x-session-affinity", session.as_str())],
                _ => vec![],
            };
            let mut workers = Vec::new();
            let mut cached = Vec::new();
            for turn in 0..TURNS {
                let mut all = vec![("content-type", "application/json")];
                all.extend(headers.iter().copied());
                let bytes = serde_json::to_vec(&body(api, &repo, turn, stream))?;
                let reply = cluster.send(reqwest::Method::POST, api, &all, bytes).await?;
                assert_eq!(reply.status, 200, "{api} stream={stream} turn {turn}: {}", reply.body);
                assert!(
                    reply.saw_destination.is_some(),
                    "{api} stream={stream} turn {turn} was not routed"
                );
                let (prompt, hit) = reported_usage(api, &reply);
                workers.push(reply.worker.clone().unwrap_or_default());
                cached.push(hit);
                requests += 1;
                prompt_sum += prompt;
                cached_sum += hit;
            }
            assert!(
                workers.iter().all(|w| *w == workers[0]),
                "{api} stream={stream}: {workers:?}"
            );
            assert!(
                cached[1..].iter().all(|c| *c > 0),
                "{api} stream={stream}: no reuse {cached:?}"
            );
        }
    }
    // One Outcome per request, with exactly the tokens the workers reported
    // (read once the sidecar has applied them all: they trail the replies).
    let expected = (requests as f64, prompt_sum as f64, cached_sum as f64, requests);
    let counted = settled(&expected, Duration::from_secs(60), || async {
        Ok((
            cluster.sidecar_metric("kvmesh_reports_total{known=\"true\"}").await?,
            cluster.sidecar_metric("kvmesh_reported_prompt_tokens_total").await?,
            cluster.sidecar_metric("kvmesh_reported_cached_tokens_total").await?,
            cluster.envoy_counter("wasmcustom.kvmesh.outcomes.with_usage").await?,
        ))
    })
    .await?;
    assert_eq!(
        counted, expected,
        "(reports, prompt tokens, cached tokens, outcomes with usage)"
    );
    cluster.wait_for_no_in_flight(Duration::from_secs(10)).await?;
    Ok(())
}
