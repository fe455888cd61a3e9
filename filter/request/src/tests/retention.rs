//! The declared retention horizon: Anthropic `cache_control` TTLs anywhere
//! in the prompt parts, a request-wide marker, OpenAI
//! `prompt_cache_retention`; the longest wins, bounded to a day, and the
//! markers still never reach the canonical stream.

use serde_json::json;

use crate::retention::marker_horizon_s;
use crate::*;

fn horizon(api: Api, body: &serde_json::Value) -> Option<u32> {
    let bytes = serde_json::to_vec(body).unwrap();
    understand(
        api,
        &Vec::<(String, String)>::new(),
        &bytes,
        false,
        &FilterConfig::default(),
    )
    .unwrap()
    .hints
    .retention_horizon_s
}

#[test]
fn ttls_read_as_seconds_bounded_to_a_day() {
    for (ttl, seconds) in [
        ("5m", Some(300)),
        ("1h", Some(3600)),
        ("30s", Some(30)),
        ("90m", Some(5400)),
        ("24h", Some(86_400)),
        ("25h", Some(86_400)),
        ("99999999999999999999999999h", Some(86_400)),
        ("0s", None),
        ("5", None),
        ("m", None),
        ("-5m", None),
        ("+5m", None),
        ("5 m", None),
        ("5M", None),
        ("1.5h", None),
        ("1é", None),
        ("é", None),
        ("", None),
    ] {
        assert_eq!(parse_ttl_s(ttl), seconds, "{ttl:?}");
    }
}

#[test]
fn a_marker_declares_its_ttl_else_the_ephemeral_default() {
    for (marker, seconds) in [
        (r#"{"type":"ephemeral"}"#, Some(EPHEMERAL_DEFAULT_S)),
        (r#"{"type":"ephemeral","ttl":"5m"}"#, Some(300)),
        (r#"{"type":"ephemeral","ttl":"1h"}"#, Some(3600)),
        (r#"{"ttl":"1h","type":"ephemeral"}"#, Some(3600)),
        // A TTL that does not read is ignored, not the marker.
        (r#"{"type":"ephemeral","ttl":"forever"}"#, Some(300)),
        (r#"{"type":"ephemeral","ttl":7}"#, Some(300)),
        (r#"{"type":"persistent"}"#, None),
        (r#"{"type":"object","properties":{}}"#, None),
        (r#""ephemeral""#, None),
        ("null", None),
        ("{", None),
    ] {
        assert_eq!(marker_horizon_s(marker.as_bytes()), seconds, "{marker}");
    }
    let huge = format!(r#"{{"type":"ephemeral","pad":"{}"}}"#, "x".repeat(300));
    assert_eq!(marker_horizon_s(huge.as_bytes()), None);
}

#[test]
fn the_longest_marker_of_a_messages_request_is_its_horizon() {
    let body = json!({
        "model": "claude",
        "system": [{"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}],
        "tools": [{"name": "read", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral", "ttl": "5m"}}]}
        ],
        "max_tokens": 10
    });
    assert_eq!(horizon(Api::Messages, &body), Some(3600));
    let mut short = body.clone();
    short["tools"][0]["cache_control"] = json!({"type": "ephemeral"});
    assert_eq!(horizon(Api::Messages, &short), Some(300));
    let mut none = body;
    for pointer in ["/system/0", "/tools/0", "/messages/0/content/0"] {
        none.pointer_mut(pointer)
            .and_then(|v| v.as_object_mut())
            .map(|o| o.remove("cache_control"));
    }
    assert_eq!(horizon(Api::Messages, &none), None);
}

#[test]
fn markers_leave_the_stream_whatever_they_declare() {
    let base = json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]});
    let mut marked = base.clone();
    marked["messages"][0]["content"][0]["cache_control"] = json!({"type": "ephemeral", "ttl": "1h"});
    let config = FilterConfig::default();
    let hashes = |body: &serde_json::Value| {
        understand(
            Api::ChatCompletions,
            &Vec::<(String, String)>::new(),
            &serde_json::to_vec(body).unwrap(),
            false,
            &config,
        )
        .unwrap()
        .hashes
    };
    assert_eq!(hashes(&base), hashes(&marked));
    assert_eq!(horizon(Api::ChatCompletions, &marked), Some(3600));
}

#[test]
fn request_wide_markers_and_openai_retention_count_too() {
    let chat = |extra: serde_json::Value| {
        let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "x"}]});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        horizon(Api::ChatCompletions, &body)
    };
    assert_eq!(chat(json!({"prompt_cache_retention": "24h"})), Some(86_400));
    assert_eq!(chat(json!({"prompt_cache_retention": "in_memory"})), None);
    assert_eq!(chat(json!({"prompt_cache_retention": 24})), None);
    assert_eq!(
        chat(json!({"cache_control": {"type": "ephemeral", "ttl": "1h"}})),
        Some(3600)
    );
    let responses = json!({"model": "m", "input": "hi", "prompt_cache_retention": "24h"});
    assert_eq!(horizon(Api::Responses, &responses), Some(86_400));
    // The longest of the request-wide and the per-part declarations.
    let body = json!({"model": "m", "cache_control": {"type": "ephemeral"},
        "messages": [{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}]});
    assert_eq!(horizon(Api::Messages, &body), Some(3600));
}

#[test]
fn markers_past_the_block_cap_are_not_read() {
    // Only the hashed prefix is read: a marker beyond the cap declares
    // nothing (the sidecar keeps blocks it knows of, nothing past them).
    let config = FilterConfig {
        block_bytes: 16,
        max_blocks: 4,
        ..FilterConfig::default()
    };
    let body = json!({"model": "m", "messages": [
        {"role": "user", "content": "a long first message that fills the cap on its own"},
        {"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}
    ]});
    let got = understand(
        Api::ChatCompletions,
        &Vec::<(String, String)>::new(),
        &serde_json::to_vec(&body).unwrap(),
        false,
        &config,
    )
    .unwrap();
    assert!(got.hashes.truncated);
    assert_eq!(got.hints.retention_horizon_s, None);
}
