//! `--agent-script`: the scripted decision over every request captured from
//! the real harness CLIs, the scripted replies as each API's client reads
//! them (JSON and SSE), and the flag on a running `kvmesh-sim`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test helpers fail loudly by design

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

mod common;

use common::Sim;
use kvmesh_sim::agent::{self, CallInput, SUB_PROMPT, Script, ToolCall};
use kvmesh_sim::api::{Api, Call, ScriptedReply};
use kvmesh_sim::engine::Served;
use serde_json::{Value, json};

// ------------------------------------------------------------ fixtures

fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../filter/request/tests/real-harnesses")
}

/// Every captured request with a JSON body: (`<harness>/<file>`, API, body).
fn fixtures() -> Vec<(String, Api, Value)> {
    let mut out = Vec::new();
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(fixtures_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    for dir in dirs {
        let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "json"))
            .collect();
        files.sort();
        for file in files {
            let record: Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
            let Some(body) = record.get("body").filter(|b| b.is_object()) else {
                continue;
            };
            let path = record["path"].as_str().unwrap();
            let path = path.split('?').next().unwrap();
            let api = if path.ends_with("/chat/completions") {
                Api::Chat
            } else if path.ends_with("/responses") {
                Api::Responses
            } else if path.ends_with("/messages") {
                Api::Messages
            } else {
                panic!("{path}: no API")
            };
            let name = format!(
                "{}/{}",
                dir.file_name().unwrap().to_str().unwrap(),
                file.file_name().unwrap().to_str().unwrap()
            );
            out.push((name, api, body.clone()));
        }
    }
    out
}

/// The tools a request declares, read independently of `agent`: name →
/// (namespace, Responses type), for every API.
fn declared(api: Api, body: &Value) -> Vec<(Option<String>, String, String)> {
    let mut out = Vec::new();
    let push_responses = |entry: &Value, out: &mut Vec<_>| {
        if entry["type"] == "namespace" {
            for inner in entry["tools"].as_array().unwrap() {
                out.push((
                    entry["name"].as_str().map(str::to_owned),
                    inner["name"].as_str().unwrap().to_owned(),
                    inner["type"].as_str().unwrap().to_owned(),
                ));
            }
        } else if let Some(name) = entry["name"].as_str() {
            let ty = entry["type"].as_str().unwrap_or("function").to_owned();
            out.push((None, name.to_owned(), ty));
        }
    };
    for tool in body["tools"].as_array().into_iter().flatten() {
        match api {
            Api::Chat => out.push((
                None,
                tool["function"]["name"].as_str().unwrap().to_owned(),
                "function".into(),
            )),
            Api::Messages => out.push((None, tool["name"].as_str().unwrap().to_owned(), "function".into())),
            _ => push_responses(tool, &mut out),
        }
    }
    if api == Api::Responses {
        for item in body["input"].as_array().into_iter().flatten() {
            if item["type"] == "additional_tools" {
                for tool in item["tools"].as_array().unwrap() {
                    push_responses(tool, &mut out);
                }
            }
        }
    }
    out
}

/// The scripted model's decision per captured request: what the capture
/// server answered when the real CLIs sent it (its `decision`).
fn expected(name: &str) -> Script {
    let text = |t: &str| Script::Text(t.to_owned());
    let call = |name: &str, args: Value| {
        Script::Call(ToolCall {
            name: name.to_owned(),
            namespace: None,
            input: CallInput::Json(args),
        })
    };
    let collab = |name: &str, args: Value| {
        Script::Call(ToolCall {
            name: name.to_owned(),
            namespace: Some("collaboration".to_owned()),
            input: CallInput::Json(args),
        })
    };
    let exec_js = |cmd: &str| {
        Script::Call(ToolCall {
            name: "exec".to_owned(),
            namespace: None,
            input: CallInput::Custom(format!(
                "const r = await tools.exec_command({{cmd: \"{cmd}\"}});\ntext(r.output);"
            )),
        })
    };
    let hi = json!({"command": "echo hi"});
    let sub = json!({"command": "echo sub"});
    let done = "Done: the shell printed hi.";
    let sub_done = "Subagent done: it printed sub.";
    let title = "A title: listing files";
    let (harness, file) = name.split_once('/').unwrap();
    let number = &file[..2];
    match (harness.split('-').next().unwrap(), number) {
        ("claude", "01" | "08" | "10" | "11") => call("Bash", hi),
        ("claude", "02") => call(
            "Agent",
            json!({"description": "Echo in a subagent", "prompt": SUB_PROMPT, "subagent_type": "general-purpose"}),
        ),
        ("claude", "03") => call("Bash", sub),
        ("claude", "04") => text(sub_done),
        ("claude", "05" | "09") => text(done),
        ("claude", "07") => text(title),
        ("codex", "01" | "07" | "11" | "13" | "14") => exec_js("echo hi"),
        ("codex", "02") => collab("spawn_agent", json!({"task_name": "sub_echo", "message": SUB_PROMPT})),
        ("codex", "03") => collab("wait_agent", json!({"timeout_ms": 30000})),
        ("codex", "04") => exec_js("echo sub"),
        ("codex", "05") => text(sub_done),
        ("codex", "06" | "09" | "12") => text(done),
        ("codex", "08") => text("Run echo in shell"),
        ("codex", "10") => text("Summary: the user asked to run echo hi; it printed hi."),
        ("openclaw", "01" | "06" | "08" | "10" | "11" | "13" | "15") => call("exec", hi),
        ("openclaw", "02") => call(
            "tool_call",
            json!({"id": "sessions_spawn", "args": {"task": SUB_PROMPT, "mode": "run", "label": "kvsub"}}),
        ),
        ("openclaw", "03") => call("sessions_yield", json!({})),
        ("openclaw", "04") => call("exec", sub),
        ("openclaw", "05") => text(sub_done),
        ("openclaw", "07" | "09" | "12" | "14" | "16") => text(done),
        ("opencode", "01" | "07" | "10") => text(title),
        ("opencode", "02" | "08" | "11" | "13" | "14") => call("bash", hi),
        ("opencode", "03") => call(
            "task",
            json!({"description": "Echo in a subagent", "prompt": SUB_PROMPT, "subagent_type": "general"}),
        ),
        ("opencode", "04") => call("bash", sub),
        ("opencode", "05") => text(sub_done),
        ("opencode", "06" | "09" | "12") => text(done),
        _ => panic!("no expectation for {name}"),
    }
}

#[test]
fn every_captured_request_gets_the_decision_the_real_clis_accepted() {
    let fixtures = fixtures();
    // 55 captured requests, one of them a `HEAD` without a body.
    assert_eq!(fixtures.len(), 54, "fixtures under {}", fixtures_dir().display());
    let mut calls = BTreeMap::<String, usize>::new();
    for (name, api, body) in &fixtures {
        let decision = agent::decide(*api, body).unwrap_or_else(|| panic!("{name}: no decision"));
        assert_eq!(decision, expected(name), "{name}");
        let tools = declared(*api, body);
        if let Script::Call(call) = &decision {
            // The call names a tool this very request declared, in the
            // namespace it was declared in (Codex's default `functions`
            // namespace is answered bare), with the call shape of its type.
            let found = tools.iter().find(|(ns, tool, _)| {
                tool == &call.name
                    && match &call.namespace {
                        Some(wanted) => ns.as_deref() == Some(wanted.as_str()),
                        None => ns.is_none() || ns.as_deref() == Some("functions"),
                    }
            });
            let (_, _, ty) = found.unwrap_or_else(|| panic!("{name}: {call:?} calls a tool not declared"));
            match &call.input {
                CallInput::Custom(_) => assert_eq!(ty, "custom", "{name}"),
                CallInput::Json(args) => {
                    assert_eq!(ty, "function", "{name}");
                    assert!(args.is_object(), "{name}: {args}");
                }
            }
            *calls.entry(call.name.clone()).or_default() += 1;
        } else if tools.is_empty() {
            // Title calls declare no tools.
            assert!(name.contains("title"), "{name}");
        }
    }
    // Every harness's shell and subagent tools were exercised.
    for tool in [
        "Bash",
        "Agent",
        "exec",
        "spawn_agent",
        "wait_agent",
        "bash",
        "task",
        "tool_call",
        "sessions_yield",
    ] {
        assert!(calls.contains_key(tool), "{tool} never called: {calls:?}");
    }
}

#[test]
fn title_and_compaction_fixtures_get_text_though_they_declare_tools() {
    let fixtures = fixtures();
    let side: Vec<_> = fixtures
        .iter()
        .filter(|(name, ..)| name.contains("title") || name.contains("compaction-call"))
        .collect();
    // Four title calls (Claude Code, Codex, OpenCode on three APIs) and
    // Codex's compaction.
    assert_eq!(side.len(), 6, "{side:?}");
    for (name, api, body) in side {
        assert!(matches!(agent::decide(*api, body), Some(Script::Text(_))), "{name}");
    }
    // Codex's title thread and compaction declare the full tool set.
    let codex_side = fixtures
        .iter()
        .filter(|(name, ..)| name.starts_with("codex") && (name.contains("title") || name.contains("compaction-call")));
    for (name, api, body) in codex_side {
        assert!(!declared(*api, body).is_empty(), "{name}");
    }
}

// ------------------------------------------------------------ replies

/// A request of `api` declaring a shell tool (Codex's code-mode `exec` for
/// `custom`), with one user message.
fn request(api: Api, stream: bool, tools: bool, custom: bool) -> Value {
    let schema = json!({"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]});
    let user = "KV1: run echo hi in the shell";
    let mut body = match api {
        Api::Chat => json!({"model": "m", "messages": [{"role": "user", "content": user}],
                            "stream_options": {"include_usage": true},
                            "tools": [{"type": "function", "function": {"name": "bash", "parameters": schema}}]}),
        Api::Messages => json!({"model": "m", "max_tokens": 4096, "messages": [{"role": "user", "content": user}],
                                "tools": [{"name": "Bash", "input_schema": schema}]}),
        _ if custom => json!({"model": "m", "input": [
            {"type": "additional_tools", "role": "developer", "tools": [
                {"type": "namespace", "name": "functions", "tools": [{"type": "custom", "name": "exec"}]},
                {"type": "namespace", "name": "collaboration", "tools": [
                    {"type": "function", "name": "spawn_agent", "parameters": {}}]}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": user}]}]}),
        _ => json!({"model": "m", "input": [{"type": "message", "role": "user",
                    "content": [{"type": "input_text", "text": user}]}],
                    "tools": [{"type": "function", "name": "exec", "parameters": schema}]}),
    };
    body["stream"] = json!(stream);
    let object = body.as_object_mut().unwrap();
    if !stream {
        object.remove("stream_options");
    }
    if !tools {
        object.remove("tools");
    }
    body
}

fn scripted(api: Api, body: &Value) -> ScriptedReply {
    let call = Call::parse(api, body, 16).unwrap();
    let script = agent::decide(api, body).unwrap();
    ScriptedReply {
        call,
        served: Served {
            request_id: 7,
            prompt_tokens: 1000,
            cached_tokens: 640,
            host_loaded_tokens: 0,
        },
        script,
        uid: "0123abcd".to_owned(),
        created: 1_700_000_000,
    }
}

/// What a client reads from a reply: its text, or its one tool call as
/// (name, namespace, arguments or custom input), and the usage.
#[derive(Debug, Default, PartialEq)]
struct Reading {
    text: String,
    call: Option<(String, Option<String>, String)>,
    finish: String,
    usage: Value,
}

fn read_json(api: Api, body: &Value) -> Reading {
    let mut read = Reading::default();
    match api {
        Api::Chat => {
            let choice = &body["choices"][0];
            read.finish = choice["finish_reason"].as_str().unwrap().to_owned();
            read.text = choice["message"]["content"].as_str().unwrap_or("").to_owned();
            if let Some(calls) = choice["message"]["tool_calls"].as_array() {
                assert_eq!(calls.len(), 1);
                assert!(calls[0]["id"].as_str().unwrap().starts_with("call_"));
                let f = &calls[0]["function"];
                read.call = Some((
                    f["name"].as_str().unwrap().into(),
                    None,
                    f["arguments"].as_str().unwrap().into(),
                ));
            }
            read.usage = body["usage"].clone();
        }
        Api::Responses => {
            assert_eq!(body["object"], "response");
            assert_eq!(body["status"], "completed");
            let output = body["output"].as_array().unwrap();
            assert_eq!(output.len(), 1);
            let item = &output[0];
            read.finish = item["type"].as_str().unwrap().to_owned();
            match read.finish.as_str() {
                "message" => read.text = item["content"][0]["text"].as_str().unwrap().to_owned(),
                "function_call" | "custom_tool_call" => {
                    assert!(item["call_id"].as_str().unwrap().starts_with("call_"));
                    let input = item.get("arguments").or(item.get("input")).unwrap();
                    read.call = Some((
                        item["name"].as_str().unwrap().into(),
                        item["namespace"].as_str().map(str::to_owned),
                        input.as_str().unwrap().into(),
                    ));
                }
                other => panic!("item {other}"),
            }
            read.usage = body["usage"].clone();
        }
        _ => {
            assert_eq!(body["type"], "message");
            read.finish = body["stop_reason"].as_str().unwrap().to_owned();
            let content = body["content"].as_array().unwrap();
            assert_eq!(content.len(), 1);
            let block = &content[0];
            match block["type"].as_str().unwrap() {
                "text" => read.text = block["text"].as_str().unwrap().to_owned(),
                "tool_use" => {
                    assert!(block["id"].as_str().unwrap().starts_with("toolu_"));
                    read.call = Some((block["name"].as_str().unwrap().into(), None, block["input"].to_string()));
                }
                other => panic!("block {other}"),
            }
            read.usage = body["usage"].clone();
        }
    }
    read
}

/// Server-sent events as (event name, data), `[DONE]` as a string.
fn parse_sse(text: &str) -> Vec<(Option<String>, Value)> {
    assert!(text.ends_with("\n\n"), "{text:?}");
    text.split("\n\n")
        .filter(|block| !block.is_empty())
        .map(|block| {
            let mut name = None;
            let mut data = None;
            for line in block.lines() {
                if let Some(n) = line.strip_prefix("event: ") {
                    name = Some(n.to_owned());
                } else if let Some(d) = line.strip_prefix("data: ") {
                    data = Some(if d == "[DONE]" {
                        json!("[DONE]")
                    } else {
                        serde_json::from_str(d).unwrap()
                    });
                } else {
                    panic!("line {line:?}");
                }
            }
            (name, data.unwrap())
        })
        .collect()
}

/// Reads a streamed reply as each API's client accumulates it.
fn read_sse(api: Api, text: &str) -> Reading {
    let events = parse_sse(text);
    let mut read = Reading::default();
    match api {
        Api::Chat => {
            assert_eq!(events.last().unwrap().1, "[DONE]");
            let mut call: Option<(String, Option<String>, String)> = None;
            for (name, chunk) in &events[..events.len() - 1] {
                assert!(name.is_none());
                assert_eq!(chunk["object"], "chat.completion.chunk");
                if let Some(usage) = chunk.get("usage") {
                    assert_eq!(chunk["choices"], json!([]));
                    read.usage = usage.clone();
                    continue;
                }
                let choice = &chunk["choices"][0];
                let delta = &choice["delta"];
                read.text.push_str(delta["content"].as_str().unwrap_or(""));
                for tc in delta["tool_calls"].as_array().into_iter().flatten() {
                    assert_eq!(tc["index"], 0);
                    if let Some(name) = tc["function"]["name"].as_str() {
                        assert!(call.is_none(), "a second call header");
                        assert!(tc["id"].as_str().unwrap().starts_with("call_"));
                        call = Some((name.to_owned(), None, String::new()));
                    }
                    let args = tc["function"]["arguments"].as_str().unwrap();
                    call.as_mut().unwrap().2.push_str(args);
                }
                if let Some(finish) = choice["finish_reason"].as_str() {
                    read.finish = finish.to_owned();
                }
            }
            read.call = call;
        }
        Api::Responses => {
            let mut deltas = String::new();
            for (i, (name, data)) in events.iter().enumerate() {
                assert_eq!(name.as_deref(), data["type"].as_str());
                assert_eq!(data["sequence_number"], json!(i), "{data}");
                let kind = data["type"].as_str().unwrap();
                if kind.ends_with(".delta") {
                    deltas.push_str(data["delta"].as_str().unwrap());
                }
            }
            assert_eq!(events[0].1["type"], "response.created");
            assert_eq!(events[1].1["type"], "response.in_progress");
            let added = events
                .iter()
                .find(|(_, d)| d["type"] == "response.output_item.added")
                .unwrap();
            let item_done = events
                .iter()
                .find(|(_, d)| d["type"] == "response.output_item.done")
                .unwrap();
            assert_eq!(added.1["item"]["id"], item_done.1["item"]["id"]);
            assert_eq!(added.1["item"]["status"], "in_progress");
            let (_, completed) = events.last().unwrap();
            assert_eq!(completed["type"], "response.completed");
            read = read_json(Api::Responses, &completed["response"]);
            assert_eq!(item_done.1["item"], completed["response"]["output"][0]);
            // What the deltas spelled is what the done item holds.
            let whole = read.call.as_ref().map_or(read.text.clone(), |c| c.2.clone());
            assert_eq!(deltas, whole);
        }
        _ => {
            let names: Vec<&str> = events.iter().map(|(n, _)| n.as_deref().unwrap()).collect();
            assert_eq!(names[..2], ["message_start", "content_block_start"]);
            assert_eq!(
                names[names.len() - 3..],
                ["content_block_stop", "message_delta", "message_stop"]
            );
            let start = &events[0].1["message"];
            assert_eq!(start["stop_reason"], Value::Null);
            assert_eq!(start["content"], json!([]));
            let block = &events[1].1["content_block"];
            let mut partial = String::new();
            for (name, data) in &events {
                assert_eq!(name.as_deref(), data["type"].as_str());
                if data["type"] == "content_block_delta" {
                    let delta = &data["delta"];
                    match delta["type"].as_str().unwrap() {
                        "text_delta" => read.text.push_str(delta["text"].as_str().unwrap()),
                        "input_json_delta" => partial.push_str(delta["partial_json"].as_str().unwrap()),
                        other => panic!("delta {other}"),
                    }
                }
            }
            if block["type"] == "tool_use" {
                assert_eq!(block["input"], json!({}));
                assert!(block["id"].as_str().unwrap().starts_with("toolu_"));
                let input: Value = serde_json::from_str(&partial).unwrap();
                read.call = Some((block["name"].as_str().unwrap().into(), None, input.to_string()));
            }
            let delta = &events[events.len() - 2].1;
            read.finish = delta["delta"]["stop_reason"].as_str().unwrap().to_owned();
            let mut usage = start["usage"].clone();
            usage["output_tokens"] = delta["usage"]["output_tokens"].clone();
            read.usage = usage;
        }
    }
    read
}

fn sse_text(reply: &ScriptedReply) -> String {
    let events = reply.sse();
    assert_eq!(
        events.steps.len(),
        reply.output_tokens() as usize,
        "one group per decode step"
    );
    let mut text = events.start.concat();
    for step in &events.steps {
        text.push_str(&step.concat());
    }
    text + &events.end.concat()
}

fn arguments(read: &Reading) -> Value {
    serde_json::from_str(&read.call.as_ref().unwrap().2).unwrap()
}

#[test]
fn tool_calls_parse_on_every_api_streamed_or_not() {
    for api in [Api::Chat, Api::Responses, Api::Messages] {
        for stream in [false, true] {
            let body = request(api, stream, true, false);
            let reply = scripted(api, &body);
            let read = if stream {
                read_sse(api, &sse_text(&reply))
            } else {
                read_json(api, &reply.json())
            };
            let what = format!("{api:?} stream={stream}: {read:?}");
            let (name, namespace, _) = read.call.as_ref().expect(&what);
            let shell = match api {
                Api::Chat => "bash",
                Api::Messages => "Bash",
                _ => "exec",
            };
            assert_eq!((name.as_str(), namespace), (shell, &None), "{what}");
            assert_eq!(arguments(&read), json!({"command": "echo hi"}), "{what}");
            assert!(read.text.is_empty(), "{what}");
            let finish = match api {
                Api::Chat => "tool_calls",
                Api::Messages => "tool_use",
                _ => "function_call",
            };
            assert_eq!(read.finish, finish, "{what}");
            // The sim's own accounting: 1000 prompt tokens, 640 cached; the
            // output is the reply's tokens, not max_tokens.
            let out = u64::from(reply.output_tokens());
            assert!((1..16).contains(&out), "{what}");
            let usage = match api {
                Api::Chat => json!({"prompt_tokens": 1000, "completion_tokens": out, "total_tokens": 1000 + out,
                                    "prompt_tokens_details": {"cached_tokens": 640}}),
                Api::Responses => json!({"input_tokens": 1000, "input_tokens_details": {"cached_tokens": 640},
                                         "output_tokens": out, "output_tokens_details": {"reasoning_tokens": 0},
                                         "total_tokens": 1000 + out}),
                _ => json!({"input_tokens": 360, "cache_read_input_tokens": 640,
                            "cache_creation_input_tokens": 0, "output_tokens": out}),
            };
            assert_eq!(read.usage, usage, "{what}");
        }
    }
}

#[test]
fn codex_code_mode_gets_a_custom_exec_call_streamed_or_not() {
    for stream in [false, true] {
        let body = request(Api::Responses, stream, true, true);
        let reply = scripted(Api::Responses, &body);
        let read = if stream {
            read_sse(Api::Responses, &sse_text(&reply))
        } else {
            read_json(Api::Responses, &reply.json())
        };
        assert_eq!(read.finish, "custom_tool_call");
        let (name, namespace, input) = read.call.unwrap();
        // `exec` is in Codex's default namespace: answered bare.
        assert_eq!((name.as_str(), namespace), ("exec", None));
        assert_eq!(
            input,
            "const r = await tools.exec_command({cmd: \"echo hi\"});\ntext(r.output);"
        );
    }
}

#[test]
fn text_answers_parse_on_every_api_streamed_or_not() {
    for api in [Api::Chat, Api::Responses, Api::Messages] {
        for stream in [false, true] {
            // No tools: a title call.
            let body = request(api, stream, false, false);
            let reply = scripted(api, &body);
            let read = if stream {
                read_sse(api, &sse_text(&reply))
            } else {
                read_json(api, &reply.json())
            };
            let what = format!("{api:?} stream={stream}: {read:?}");
            assert_eq!(read.text, "A title: listing files", "{what}");
            assert!(read.call.is_none(), "{what}");
            let finish = match api {
                Api::Chat => "stop",
                Api::Messages => "end_turn",
                _ => "message",
            };
            assert_eq!(read.finish, finish, "{what}");
        }
    }
}

#[test]
fn captured_requests_replied_to_as_their_clients_read_them() {
    // Every captured request, streamed as it was sent and also as JSON: the
    // reply carries the decision, in the namespace the request declared.
    for (name, api, body) in fixtures() {
        let decision = agent::decide(api, &body).unwrap();
        for stream in [false, true] {
            let mut body = body.clone();
            body["stream"] = json!(stream);
            if !stream {
                body.as_object_mut().unwrap().remove("stream_options");
            }
            let reply = scripted(api, &body);
            let read = if stream {
                read_sse(api, &sse_text(&reply))
            } else {
                read_json(api, &reply.json())
            };
            let what = format!("{name} stream={stream}: {read:?}");
            match &decision {
                Script::Text(text) => assert_eq!(&read.text, text, "{what}"),
                Script::Call(call) => {
                    let (got, namespace, input) = read.call.as_ref().expect(&what);
                    assert_eq!(got, &call.name, "{what}");
                    if api == Api::Responses {
                        assert_eq!(namespace, &call.namespace, "{what}");
                    }
                    match &call.input {
                        CallInput::Json(args) => {
                            assert_eq!(&serde_json::from_str::<Value>(input).unwrap(), args, "{what}");
                        }
                        CallInput::Custom(js) => assert_eq!(input, js, "{what}"),
                    }
                }
            }
        }
    }
}

/// Prompt and cached tokens from any API's usage (Anthropic's
/// `input_tokens` are the uncached ones).
fn prompt_and_cached(usage: &Value) -> (u64, u64) {
    let n = |v: &Value| v.as_u64().unwrap();
    if let Some(prompt) = usage.get("prompt_tokens") {
        (n(prompt), n(&usage["prompt_tokens_details"]["cached_tokens"]))
    } else if let Some(read) = usage.get("cache_read_input_tokens") {
        (n(&usage["input_tokens"]) + n(read), n(read))
    } else {
        (
            n(&usage["input_tokens"]),
            n(&usage["input_tokens_details"]["cached_tokens"]),
        )
    }
}

fn fixture(name: &str) -> (Api, Value) {
    let (_, api, body) = fixtures().into_iter().find(|(n, ..)| n == name).unwrap();
    (api, body)
}

#[test]
fn the_flag_scripts_a_running_sim_and_without_it_replies_are_as_before() {
    let path = |api| match api {
        Api::Chat => "/v1/chat/completions",
        Api::Responses => "/v1/responses",
        _ => "/v1/messages?beta=true",
    };
    let cases = [
        ("claude-code-2.1.197/01-main-first-call.json", "Bash"),
        ("codex-0.171.0/02-root-after-exec-calls-spawn-agent.json", "spawn_agent"),
        ("opencode-1.18.33/03-chat-main-after-bash-calls-task.json", "task"),
    ];
    let scripted = Sim::start(&["--agent-script"], &[]);
    let by_env = Sim::start(&[], &[("KVMESH_SIM_AGENT_SCRIPT", "1")]);
    let plain = Sim::start(&[], &[]);
    for (name, tool) in cases {
        let (api, body) = fixture(name);
        for sim in [&scripted, &by_env] {
            for stream in [true, false] {
                let mut body = body.clone();
                body["stream"] = json!(stream);
                if !stream {
                    body.as_object_mut().unwrap().remove("stream_options");
                }
                let (status, reply) = sim.post(path(api), &body);
                assert_eq!(status, 200, "{name}: {reply}");
                let read = if stream {
                    read_sse(api, &reply)
                } else {
                    read_json(api, &serde_json::from_str(&reply).unwrap())
                };
                assert_eq!(read.call.as_ref().map(|c| c.0.as_str()), Some(tool), "{name}: {read:?}");
                // Usage is the sim's: the whole prompt, none of it cached
                // the first time on this worker, most of it the second.
                let (prompt, cached) = prompt_and_cached(&read.usage);
                assert!(prompt > 1000, "{name}: {:?}", read.usage);
                if stream {
                    assert_eq!(cached, 0, "{name}: {:?}", read.usage);
                } else {
                    assert!(cached > prompt / 2, "{name}: {:?}", read.usage);
                }
            }
        }
        // Same request, no flag: the sim's usual text. (Without the flag
        // the sim decodes `max_tokens` steps, each at least a timer tick:
        // the default of 16 keeps the test quick.)
        let mut body = body;
        body["stream"] = json!(false);
        for key in [
            "stream_options",
            "max_tokens",
            "max_completion_tokens",
            "max_output_tokens",
        ] {
            body.as_object_mut().unwrap().remove(key);
        }
        let (status, reply) = plain.post(path(api), &body);
        assert_eq!(status, 200);
        let read = read_json(api, &serde_json::from_str(&reply).unwrap());
        assert!(read.call.is_none(), "{name}: {read:?}");
        assert!(read.text.contains("prompt tokens"), "{name}: {read:?}");
    }
}
