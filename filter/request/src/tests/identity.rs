//! Who a request is, on hostile and edge-case inputs: OpenClaw's prompt
//! (its marker, its `Runtime:` line), its subagents' trace parent, and the
//! id sources' configuration.

use serde_json::json;

use crate::*;

fn byte_headers(pairs: &[(&str, &[u8])]) -> Vec<(String, Vec<u8>)> {
    pairs.iter().map(|(k, v)| ((*k).to_owned(), v.to_vec())).collect()
}

/// OpenClaw's Chat Completions shape (2026.9.6): the marker starts the
/// system prompt, the `Runtime:` line ends the first user message.
fn openclaw_chat(runtime: &str) -> serde_json::Value {
    json!({
        "model": "kv-model",
        "messages": [
            {"role": "system", "content": "<!-- openclaw:attempt:STABLE -->\nYou are a personal assistant running inside OpenClaw.\n## Tooling\n"},
            {"role": "user", "content": format!("[Thu 2026-12-03 13:28 UTC] hi\n\n{runtime}")},
        ],
        "tools": [{"type": "function", "function": {"name": "exec"}}],
    })
}

fn identity(body: &serde_json::Value, headers: &[(&str, &[u8])]) -> Identity {
    let bytes = serde_json::to_vec(body).unwrap();
    understand(
        Api::ChatCompletions,
        &byte_headers(headers),
        &bytes,
        false,
        &FilterConfig::default(),
    )
    .unwrap()
    .identity
}

const TRACEPARENT: &[u8] = b"00-34d223add902cf5f3d2fbb8637a0f178-4d464ffc3e122b30-01";

#[test]
fn openclaw_is_one_session_with_or_without_its_affinity_headers() {
    let body = openclaw_chat("Runtime: agent=main | session=agent:main:main | sessionId=59546c3b | host=vm");
    let plain = identity(&body, &[("user-agent", b"OpenAI/JS 7.15.0")]);
    let affinity = identity(
        &body,
        &[
            ("user-agent", b"OpenAI/JS 7.15.0"),
            ("session_id", b"59546c3b:0"),
            ("x-session-affinity", b"59546c3b:0"),
        ],
    );
    assert_eq!(plain.session_id, "59546c3b");
    assert_eq!(affinity.session_id, "59546c3b");
    assert_eq!(
        (plain.harness, affinity.harness),
        (Harness::OpenClaw, Harness::OpenClaw)
    );
    // A main session has no parent, even with a trace.
    assert_eq!(identity(&body, &[("traceparent", TRACEPARENT)]).parent_id, "");
}

#[test]
fn an_openclaw_subagent_names_its_parent_by_trace_only() {
    let body =
        openclaw_chat("Runtime: agent=main | session=agent:main:subagent:8a6d3a01 | sessionId=019446da | host=vm");
    let id = identity(&body, &[("traceparent", TRACEPARENT)]);
    assert_eq!(id.session_id, "019446da");
    assert_eq!(id.agent_id, "");
    assert_eq!(id.parent_id, "trace:34d223add902cf5f3d2fbb8637a0f178");
    assert!(id.parent_id.starts_with(kvmesh_vocab::PARENT_BY_TRACE_PREFIX));
    // No trace (or a malformed one): no parent, rather than a wrong one.
    assert_eq!(identity(&body, &[]).parent_id, "");
    assert_eq!(identity(&body, &[("traceparent", b"00-zz-\xff-01")]).parent_id, "");
    // A parent header, if one ever comes, wins.
    let id = identity(&body, &[("traceparent", TRACEPARENT), ("x-parent-session-id", b"p")]);
    assert_eq!(id.parent_id, "p");
}

#[test]
fn a_runtime_line_without_a_session_id_leaves_the_other_sources() {
    let body = openclaw_chat("Runtime: agent=main | session=agent:main:main | host=vm");
    let id = identity(&body, &[]);
    assert_eq!((id.harness, id.session_id.as_str()), (Harness::OpenClaw, ""));
    // The affinity header then is the session, as it is sent.
    assert_eq!(identity(&body, &[("session_id", b"s:0")]).session_id, "s:0");
    let empty = openclaw_chat("Runtime: agent=main | sessionId= | host=vm");
    assert_eq!(identity(&empty, &[]).session_id, "");
}

#[test]
fn a_session_id_too_long_is_bounded_and_one_past_the_window_is_none() {
    let long = "7".repeat(1000);
    let body = openclaw_chat(&format!("Runtime: agent=main | sessionId={long} | host=vm"));
    let id = identity(&body, &[]);
    assert_eq!(id.session_id, bounded_id(&long));
    assert!(id.session_id.len() <= kvmesh_vocab::limits::MAX_ID_BYTES);
    // A line so long its start is out of the scanned tail is not read.
    let huge = "7".repeat(64 * 1024);
    let body = openclaw_chat(&format!("Runtime: agent=main | sessionId={huge}"));
    let id = identity(&body, &[]);
    assert_eq!((id.harness, id.session_id.as_str()), (Harness::OpenClaw, ""));
}

#[test]
fn the_prompt_never_overrides_a_harness_its_headers_name() {
    let body = openclaw_chat("Runtime: agent=main | sessionId=from-prompt");
    // Codex's session header comes before OpenClaw's prompt.
    let id = identity(&body, &[("originator", b"codex_exec"), ("session-id", b"cx")]);
    assert_eq!((id.harness, id.session_id.as_str()), (Harness::Codex, "cx"));
    let declared = identity(&body, &[("x-kvmesh-harness", b"other")]);
    assert_eq!(declared.harness, Harness::Other);
    // A non-UTF-8 user agent says nothing: the prompt still does.
    assert_eq!(
        identity(&body, &[("user-agent", b"\xff\xfe")]).harness,
        Harness::OpenClaw
    );
    // Another harness's prompt that mentions a Runtime line is not read.
    let other = json!({"model": "m", "messages": [
        {"role": "system", "content": "You help."},
        {"role": "user", "content": "Runtime: agent=main | sessionId=nope"},
    ]});
    let id = identity(&other, &[]);
    assert_eq!((id.harness, id.session_id.as_str()), (Harness::Other, ""));
}

#[test]
fn openclaw_sources_are_configurable_and_named_in_errors() {
    let config = FilterConfig::from_json(
        br#"{"session_sources": ["openclaw_runtime"], "parent_sources": ["openclaw_parent_trace"]}"#,
    )
    .unwrap();
    assert_eq!(config.session_sources, [IdSource::OpenClawRuntime]);
    assert_eq!(config.parent_sources, [IdSource::OpenClawParentTrace]);
    let err = FilterConfig::from_json(br#"{"session_sources": ["openclaw"]}"#).unwrap_err();
    assert!(err.problem.contains("openclaw_runtime"), "{err}");
    // Without the source, OpenClaw is still recognised but has no session.
    let body = serde_json::to_vec(&openclaw_chat("Runtime: agent=main | sessionId=s1")).unwrap();
    let config = FilterConfig {
        session_sources: vec![],
        ..FilterConfig::default()
    };
    let u = understand(Api::ChatCompletions, &byte_headers(&[]), &body, false, &config).unwrap();
    assert_eq!(
        (u.identity.harness, u.identity.session_id.as_str()),
        (Harness::OpenClaw, "")
    );
}
