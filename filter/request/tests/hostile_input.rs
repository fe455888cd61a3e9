//! Hostile bodies: the parser returns an error or a bounded result, and never
//! panics. (How fast is measured by the `understand` criterion bench's
//! `hostile` group, not timed here.)
#![allow(clippy::unwrap_used, clippy::panic)]

use kvmesh_request::{Api, FilterConfig, NotUnderstood, ScanError, understand};

fn headers() -> Vec<(String, String)> {
    vec![("x-session-id".to_owned(), "s".to_owned())]
}

fn chat(messages: &str) -> Vec<u8> {
    format!(r#"{{"model":"m","messages":[{messages}]}}"#).into_bytes()
}

#[test]
fn every_truncation_of_a_real_body_is_an_error_or_a_prefix() {
    let body = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/claude_code_messages.json"
    ))
    .unwrap();
    let fixture: serde_json::Value = serde_json::from_slice(&body).unwrap();
    // In the order Claude Code writes its members: the model and prompt
    // parts first, the conversation after them.
    let b = &fixture["body"];
    let body = format!(
        r#"{{"model":{},"max_tokens":32000,"system":{},"tools":{},"messages":{},"metadata":{},"stream":true}}"#,
        b["model"], b["system"], b["tools"], b["messages"], b["metadata"]
    )
    .into_bytes();
    let config = FilterConfig::default();
    let mut routed_on_a_prefix = 0;
    let full = understand(Api::Messages, &headers(), &body, false, &config)
        .unwrap()
        .hashes;
    for cut in (0..body.len()).step_by(7) {
        // Cut by the network: the body is incomplete, so it is refused.
        assert!(
            understand(Api::Messages, &headers(), &body[..cut], false, &config).is_err(),
            "cut at {cut}"
        );
        // Cut by the filter's own cap: routed on what came before the cut,
        // whose hashes are a prefix of the whole body's.
        if let Ok(partial) = understand(Api::Messages, &headers(), &body[..cut], true, &config) {
            let n = partial.hashes.hashes.len() - usize::from(partial.hashes.last_partial);
            assert_eq!(partial.hashes.hashes[..n], full.hashes[..n], "cut at {cut}");
            assert!(partial.body_truncated);
            routed_on_a_prefix += usize::from(n > 0);
        }
    }
    assert!(routed_on_a_prefix > 100, "only {routed_on_a_prefix} cuts kept a prefix");
    // Members the stream needs first arriving after the cut: no prefix at all.
    let reordered = format!(
        r#"{{"messages":{},"model":{},"tools":{}}}"#,
        b["messages"], b["model"], b["tools"]
    );
    let cut = &reordered.as_bytes()[..reordered.len() / 2];
    let got = understand(Api::Messages, &headers(), cut, true, &config).unwrap();
    assert!(got.hashes.hashes.is_empty());
}

#[test]
fn invalid_utf8_never_panics() {
    let config = FilterConfig::default();
    let mut body = chat(r#"{"role":"user","content":"caf"#);
    body.extend_from_slice(b"\xc3\x28 \xff\xfe\"}]}");
    // Inside message text it is hashed as bytes (the engine will refuse it).
    assert!(understand(Api::ChatCompletions, &headers(), &body, false, &config).is_ok());
    // Where kvmesh reads a string (the model), it is refused.
    let bad_model = b"{\"model\":\"\xff\",\"messages\":[]}";
    assert_eq!(
        understand(Api::ChatCompletions, &headers(), bad_model, false, &config),
        Err(NotUnderstood::Model)
    );
}

#[test]
fn ten_thousand_deep_nesting_is_refused() {
    let config = FilterConfig::default();
    let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
    let body = chat(&format!(r#"{{"role":"user","content":{deep}}}"#));
    assert_eq!(
        understand(Api::ChatCompletions, &headers(), &body, false, &config),
        Err(NotUnderstood::InvalidJson(ScanError::TooDeep))
    );
    let open_only = "{\"a\":".repeat(10_000);
    assert!(understand(Api::ChatCompletions, &headers(), open_only.as_bytes(), false, &config).is_err());
}

#[test]
fn a_hundred_thousand_empty_messages_give_a_bounded_result() {
    let config = FilterConfig::default();
    let body = chat(&vec!["{}"; 100_000].join(","));
    let got = understand(Api::ChatCompletions, &headers(), &body, false, &config).unwrap();
    assert!(got.hashes.hashes.len() <= config.max_blocks);
    assert!(!got.hashes.hashes.is_empty());
}

#[test]
fn a_twenty_mib_string_is_capped_at_max_blocks() {
    let config = FilterConfig::default();
    let huge = "a".repeat(20 * 1024 * 1024);
    let body = chat(&format!(r#"{{"role":"user","content":"{huge}"}}"#));
    let got = understand(Api::ChatCompletions, &headers(), &body, false, &config).unwrap();
    assert_eq!(got.hashes.hashes.len(), config.max_blocks);
    assert!(got.hashes.truncated);
    // As the filter sees it past its body cap: the first 8 MiB only.
    let cut = &body[..config.max_body_bytes];
    let got = understand(Api::ChatCompletions, &headers(), cut, true, &config).unwrap();
    assert!(got.body_truncated);
}

#[test]
fn wrongly_typed_fields_everywhere_are_refused_or_ignored() {
    let config = FilterConfig::default();
    for body in [
        r#"{"model":5,"messages":[]}"#,
        r#"{"model":"m","messages":{}}"#,
        r#"{"model":"m","messages":"hi"}"#,
        r#"[{"model":"m"}]"#,
        r#""just a string""#,
        r#"{"model":"m","messages":[],"stream":"yes","max_tokens":"many","user":7,"metadata":[1]}"#,
    ] {
        let _ = understand(Api::ChatCompletions, &headers(), body.as_bytes(), false, &config);
    }
    assert!(
        understand(
            Api::ChatCompletions,
            &headers(),
            br#"{"model":5,"messages":[]}"#,
            false,
            &config
        )
        .is_err()
    );
    let odd = br#"{"model":"m","messages":[],"stream":"yes","max_tokens":"many","user":7,"metadata":[1]}"#;
    let got = understand(Api::ChatCompletions, &headers(), odd, false, &config).unwrap();
    assert_eq!(got.hints.priority, None);
    assert_eq!(got.identity.session_id, "s");
    for (api, body) in [
        (Api::Responses, r#"{"model":"m","input":5}"#),
        (Api::Completions, r#"{"model":"m","prompt":{"a":1}}"#),
        (Api::Messages, r#"{"model":"m","system":"s"}"#),
    ] {
        assert!(
            understand(api, &headers(), body.as_bytes(), false, &config).is_err(),
            "{body}"
        );
    }
}
