//! Lanes on hostile and edge-case inputs: turn metadata that is not UTF-8,
//! not JSON, huge or mistyped is no signal; a cut body is never a side call;
//! a harness kvmesh does not recognise stays in the main lane.

use serde_json::json;

use crate::*;

fn lane(api: Api, body: &serde_json::Value, headers: &[(&str, &[u8])]) -> Lane {
    let headers: Vec<(String, Vec<u8>)> = headers.iter().map(|(k, v)| ((*k).to_owned(), v.to_vec())).collect();
    let bytes = serde_json::to_vec(body).unwrap();
    understand(api, &headers, &bytes, false, &FilterConfig::default())
        .unwrap()
        .lane
}

/// A Codex 0.171.0 call in code mode: no `tools`, its tools in an
/// `additional_tools` input item.
fn codex_body(metadata: Option<&str>) -> serde_json::Value {
    let mut body = json!({"model": "gpt", "input": [
        {"type": "additional_tools", "id": "at_1", "role": "developer", "tools": []},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
    ]});
    if let Some(metadata) = metadata {
        body["client_metadata"] = json!({"x-codex-turn-metadata": metadata});
    }
    body
}

const CODEX: (&str, &[u8]) = ("originator", b"codex-tui");

#[test]
fn codex_turn_metadata_names_compaction_and_title_from_header_or_body() {
    let compaction = br#"{"session_id":"s","request_kind":"compaction","thread_source":"user"}"#;
    let title = br#"{"request_kind":"turn","thread_source":"thread_title"}"#;
    let turn = br#"{"request_kind":"turn","thread_source":"user"}"#;
    let body = codex_body(None);
    let with = |m: &'static [u8]| lane(Api::Responses, &body, &[CODEX, ("x-codex-turn-metadata", m)]);
    assert_eq!(with(compaction), Lane::Compaction);
    assert_eq!(with(title), Lane::Side);
    assert_eq!(with(turn), Lane::Main);
    // The mirror in `client_metadata` when the header is missing.
    let mirrored = codex_body(Some(r#"{"request_kind":"compaction"}"#));
    assert_eq!(lane(Api::Responses, &mirrored, &[CODEX]), Lane::Compaction);
    // The metadata is an explicit statement: it holds for any harness label.
    assert_eq!(
        lane(Api::Responses, &body, &[("x-codex-turn-metadata", compaction)]),
        Lane::Compaction
    );
}

#[test]
fn unreadable_turn_metadata_is_no_signal() {
    let body = codex_body(None);
    let huge = format!(r#"{{"request_kind":"compaction","pad":"{}"}}"#, "x".repeat(64 * 1024));
    let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
    let hostile: [&[u8]; 8] = [
        b"\xff\xfe{\"request_kind\":\"compaction\"}",
        br#"{"request_kind":"comp\xc3action"}"#,
        b"not json",
        br#"{"request_kind":"compaction""#,
        br#"{"request_kind":7}"#,
        br#"["compaction"]"#,
        huge.as_bytes(),
        deep.as_bytes(),
    ];
    for metadata in hostile {
        assert_eq!(
            lane(Api::Responses, &body, &[CODEX, ("x-codex-turn-metadata", metadata)]),
            Lane::Main,
            "{}",
            String::from_utf8_lossy(&metadata[..metadata.len().min(80)])
        );
    }
    // An unreadable header leaves the body's mirror to speak.
    let mirrored = codex_body(Some(r#"{"request_kind":"compaction"}"#));
    assert_eq!(
        lane(Api::Responses, &mirrored, &[CODEX, ("x-codex-turn-metadata", b"\xff")]),
        Lane::Compaction
    );
    // A mirror that is not a string, or not JSON, is no signal either.
    let mut odd = codex_body(None);
    odd["client_metadata"] = json!({"x-codex-turn-metadata": {"request_kind": "compaction"}});
    assert_eq!(lane(Api::Responses, &odd, &[CODEX]), Lane::Main);
    let garbled = codex_body(Some("{request_kind: compaction}"));
    assert_eq!(lane(Api::Responses, &garbled, &[CODEX]), Lane::Main);
}

#[test]
fn a_recognised_harness_without_tools_is_a_side_call() {
    let opencode: (&str, &[u8]) = ("user-agent", b"opencode/1.18.33 ai-sdk/provider-utils/4.0.23");
    let no_tools = json!({"model": "kv-small", "messages": [{"role": "user", "content": "title?"}]});
    assert_eq!(lane(Api::ChatCompletions, &no_tools, &[opencode]), Lane::Side);
    let mut empty = no_tools.clone();
    empty["tools"] = json!([]);
    assert_eq!(lane(Api::ChatCompletions, &empty, &[opencode]), Lane::Side);
    empty["tools"] = json!(null);
    assert_eq!(lane(Api::ChatCompletions, &empty, &[opencode]), Lane::Side);
    let mut tools = no_tools.clone();
    tools["tools"] = json!([{"type": "function", "function": {"name": "bash"}}]);
    assert_eq!(lane(Api::ChatCompletions, &tools, &[opencode]), Lane::Main);
    let mut functions = no_tools.clone();
    functions["functions"] = json!([{"name": "bash"}]);
    assert_eq!(lane(Api::ChatCompletions, &functions, &[opencode]), Lane::Main);
    // A `tools` that is not an array is not "no tools".
    tools["tools"] = json!({"bash": {}});
    assert_eq!(lane(Api::ChatCompletions, &tools, &[opencode]), Lane::Main);
    // Codex's tools in an input item count as tools; without it, none.
    assert_eq!(lane(Api::Responses, &codex_body(None), &[CODEX]), Lane::Main);
    let bare = json!({"model": "gpt", "input": [{"type": "message", "role": "user", "content": "hi"}]});
    assert_eq!(lane(Api::Responses, &bare, &[CODEX]), Lane::Side);
    // A harness kvmesh does not recognise stays in the main lane.
    assert_eq!(lane(Api::ChatCompletions, &no_tools, &[]), Lane::Main);
    assert_eq!(
        lane(Api::ChatCompletions, &no_tools, &[("user-agent", b"\xff")]),
        Lane::Main
    );
}

#[test]
fn a_cut_body_is_never_called_a_side_call() {
    // OpenCode puts `tools` after `messages`: a cut may hide them.
    let body = br#"{"model":"kv-model","messages":[{"role":"user","content":"hi"}],"too"#;
    let headers = vec![("user-agent".to_owned(), b"opencode/1.18.33".to_vec())];
    let u = understand(Api::ChatCompletions, &headers, body, true, &FilterConfig::default()).unwrap();
    assert_eq!(u.lane, Lane::Main);
}

#[test]
fn older_codex_compaction_subagents_are_compaction() {
    let body = codex_body(None);
    let headers: [(&str, &[u8]); 2] = [CODEX, ("x-openai-subagent", b"compact")];
    assert_eq!(lane(Api::Responses, &body, &headers), Lane::Compaction);
    let review: [(&str, &[u8]); 2] = [CODEX, ("x-openai-subagent", b"review")];
    assert_eq!(lane(Api::Responses, &body, &review), Lane::Main);
}
