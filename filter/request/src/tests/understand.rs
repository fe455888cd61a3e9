use serde_json::json;

use crate::*;

fn headers(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
}

fn chat(turns: usize) -> serde_json::Value {
    let mut messages = vec![json!({"role": "system", "content": "You are a coding agent. ".repeat(40)})];
    for turn in 0..turns {
        messages.push(json!({"role": "user", "content": format!("step {turn}: read src/lib{turn}.rs")}));
        messages.push(json!({"role": "assistant", "content": format!("done with step {turn} ").repeat(8)}));
    }
    json!({"model": "qwen", "messages": messages, "stream": true, "temperature": 0.2})
}

fn understood(body: &serde_json::Value, hdrs: &[(&str, &str)]) -> Understood {
    let bytes = serde_json::to_vec(body).unwrap();
    understand(
        Api::ChatCompletions,
        &headers(hdrs),
        &bytes,
        false,
        &FilterConfig::default(),
    )
    .unwrap()
}

#[test]
fn growing_conversation_keeps_every_full_block_of_the_previous_call() {
    let mut previous = understood(&chat(1), &[]).hashes;
    for turns in 2..20 {
        let current = understood(&chat(turns), &[]).hashes;
        let full = previous.hashes.len() - usize::from(previous.last_partial);
        assert!(full > 0);
        assert_eq!(previous.hashes[..full], current.hashes[..full], "turn {turns}");
        assert!(current.stream_bytes > previous.stream_bytes);
        previous = current;
    }
}

#[test]
fn fields_outside_the_prompt_and_key_order_do_not_change_hashes() {
    let a = understood(&chat(3), &[]).hashes;
    let mut other = chat(3);
    other["temperature"] = json!(0.9);
    other["stream"] = json!(false);
    other["max_tokens"] = json!(77);
    other["metadata"] = json!({"x": 1});
    assert_eq!(a, understood(&other, &[]).hashes);

    // Whitespace between tokens is not prompt text: compact and pretty
    // serializations of the same body hash the same.
    let pretty = serde_json::to_vec_pretty(&chat(3)).unwrap();
    let cfg = FilterConfig::default();
    let got = understand(Api::ChatCompletions, &headers(&[]), &pretty, false, &cfg).unwrap();
    assert_eq!(got.hashes, a);
}

#[test]
fn a_changed_system_prompt_breaks_the_chain_from_its_block_on() {
    let a = understood(&chat(3), &[]).hashes;
    let mut other = chat(3);
    other["messages"][0]["content"] = json!(format!("Today is Monday. {}", "You are a coding agent. ".repeat(40)));
    let b = understood(&other, &[]).hashes;
    assert_ne!(a.hashes[0], b.hashes[0]);
}

#[test]
fn tenants_models_and_cache_salts_never_share_hashes() {
    let base = understood(&chat(2), &[("authorization", "Bearer a")]).hashes.hashes;
    let other_tenant = understood(&chat(2), &[("authorization", "Bearer b")]).hashes.hashes;
    let mut other_model = chat(2);
    other_model["model"] = json!("llama");
    let mut salted = chat(2);
    salted["cache_salt"] = json!("s1");
    for other in [
        other_tenant,
        understood(&other_model, &[("authorization", "Bearer a")]).hashes.hashes,
        understood(&salted, &[("authorization", "Bearer a")]).hashes.hashes,
    ] {
        assert!(base.iter().all(|h| !other.contains(h)));
    }
}

#[test]
fn blocks_are_cut_at_block_bytes_with_a_flagged_partial_tail() {
    for hash in [BlockHash::Xxh3, BlockHash::Sha256] {
        blocks_cut_with(hash);
    }
}

fn blocks_cut_with(hash: BlockHash) {
    let seed = salt("", "m", "");
    let block_hashes =
        |seed: &[u8], stream: &[u8], block: usize, max: usize| block_hashes(hash, seed, stream, block, max);
    let exact = block_hashes(&seed, &[7u8; 512], 256, 100);
    assert_eq!(
        (exact.hashes.len(), exact.last_partial, exact.truncated),
        (2, false, false)
    );
    let tail = block_hashes(&seed, &[7u8; 513], 256, 100);
    assert_eq!((tail.hashes.len(), tail.last_partial), (3, true));
    assert_eq!(tail.hashes[..2], exact.hashes[..]);
    let capped = block_hashes(&seed, &[7u8; 2560], 256, 4);
    assert_eq!(
        (capped.hashes.len(), capped.truncated, capped.stream_bytes),
        (4, true, 2560)
    );
    // Equal blocks at different positions hash differently: the chain carries position.
    assert_ne!(exact.hashes[0], exact.hashes[1]);
    assert!(block_hashes(&seed, b"", 256, 4).hashes.is_empty());
}

#[test]
fn session_ids_follow_the_configured_order() {
    let body = json!({"model": "m", "messages": [], "prompt_cache_key": "pck", "user": "u"});
    let id = |h: &[(&str, &str)]| understood(&body, h).identity;
    assert_eq!(
        id(&[("x-session-id", "oc"), ("x-claude-code-session-id", "cc")]).session_id,
        "cc"
    );
    assert_eq!(id(&[("session-id", "codex")]).session_id, "codex");
    assert_eq!(id(&[]).session_id, "pck");
    let codex = id(&[
        ("session-id", "root"),
        ("thread-id", "child"),
        ("x-codex-parent-thread-id", "root"),
    ]);
    assert_eq!((codex.agent_id.as_str(), codex.parent_id.as_str()), ("child", "root"));
    assert_eq!(id(&[("session-id", "root"), ("thread-id", "root")]).agent_id, "");
    assert!(id(&[("x-dynamo-session-final", "true")]).session_final);
}

#[test]
fn anthropic_user_id_yields_the_session_in_both_forms() {
    let legacy = json!({"model": "m", "messages": [], "metadata": {"user_id": "user_abc_account_1234_session_5f1e"}});
    let modern = json!({"model": "m", "messages": [],
        "metadata": {"user_id": "{\"device_id\":\"d\",\"account_uuid\":\"a\",\"session_id\":\"77aa\"}"}});
    let id = |body: &serde_json::Value| {
        let bytes = serde_json::to_vec(body).unwrap();
        understand(Api::Messages, &headers(&[]), &bytes, false, &FilterConfig::default())
            .unwrap()
            .identity
            .session_id
    };
    assert_eq!(id(&legacy), "5f1e");
    assert_eq!(id(&modern), "77aa");
}

#[test]
fn tenant_from_a_credential_is_a_hash_never_the_key() {
    let t = understood(&chat(1), &[("authorization", "Bearer sk-secret")])
        .identity
        .tenant;
    assert!(t.starts_with("key:") && !t.contains("secret") && t.len() == 20, "{t}");
    let other = understood(&chat(1), &[("authorization", "Bearer sk-other")])
        .identity
        .tenant;
    assert_ne!(t, other);
}

#[test]
fn invalid_or_misshapen_bodies_are_not_understood_and_never_panic() {
    let cfg = FilterConfig::default();
    let none = headers(&[]);
    let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
    for body in [
        &b"{"[..],
        b"",
        b"\xff\xfe",
        deep.as_bytes(),
        b"[1,2]",
        b"{\"messages\": 3}",
    ] {
        assert!(understand(Api::ChatCompletions, &none, body, false, &cfg).is_err());
    }
    assert_eq!(
        understand(Api::Completions, &none, br#"{"prompt": 5}"#, false, &cfg),
        Err(NotUnderstood::Shape(CanonicalError::MissingField("prompt")))
    );
}

#[test]
fn every_api_has_a_canonical_stream() {
    let cfg = FilterConfig::default();
    let none = headers(&[]);
    for (path, body) in [
        (
            "/v1/chat/completions",
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
        ),
        ("/v1/completions?x=1", r#"{"model":"m","prompt":["a","b"]}"#),
        (
            "/v1/responses",
            r#"{"model":"m","instructions":"be brief","input":[{"role":"user","content":"hi"}]}"#,
        ),
        (
            "/v1/messages",
            r#"{"model":"m","system":[{"type":"text","text":"sys"}],"messages":[{"role":"user","content":"hi"}]}"#,
        ),
    ] {
        let api = Api::from_path(path).unwrap();
        let got = understand(api, &none, body.as_bytes(), false, &cfg).unwrap();
        assert_eq!(got.model, "m");
        assert!(!got.hashes.hashes.is_empty(), "{path}");
    }
    assert_eq!(Api::from_path("/v1/models"), None);
    assert_eq!(Api::from_path("/v1/embeddings"), None);
}

#[test]
fn configuration_errors_name_the_field() {
    let err = |json: &str| FilterConfig::from_json(json.as_bytes()).unwrap_err().field;
    assert_eq!(err(r#"{"sidecar_timeout_ms": "fast"}"#), "sidecar_timeout_ms");
    assert_eq!(err(r#"{"sidecar_timeout_ms": 0}"#), "sidecar_timeout_ms");
    assert_eq!(err(r#"{"block_bytes": 3}"#), "block_bytes");
    assert_eq!(err(r#"{"session_sources": ["header:X-Bad"]}"#), "session_sources[0]");
    assert_eq!(err(r#"{"agent_sources": ["cookie:x"]}"#), "agent_sources[0]");
    assert_eq!(err(r#"{"hash": "md5"}"#), "hash");
    assert_eq!(err(r#"{"sidecar_clustr": "x"}"#), "sidecar_clustr");
    assert!(err("[").contains("root"));
    assert_eq!(FilterConfig::from_json(b"").unwrap(), FilterConfig::default());
    let cfg = FilterConfig::from_json(br#"{"sidecar_timeout_ms": 120, "block_bytes": 64}"#).unwrap();
    assert_eq!((cfg.sidecar_timeout_ms, cfg.block_bytes), (120, 64));
}

#[test]
fn priority_and_dynamo_agent_hints_are_read() {
    let cfg = FilterConfig::default();
    let body =
        br#"{"model":"m","messages":[],"nvext":{"agent_hints":{"osl":900,"priority":3,"latency_sensitivity":0.7}}}"#;
    let got = understand(Api::ChatCompletions, &headers(&[]), body, false, &cfg)
        .unwrap()
        .hints;
    assert_eq!(got.priority, Some(3));
    // The header wins over the hint.
    let body = br#"{"model":"m","messages":[],"max_tokens":50,"nvext":{"agent_hints":{"osl":900,"priority":3}}}"#;
    let got = understand(
        Api::ChatCompletions,
        &headers(&[("x-kvmesh-priority", " -2 ")]),
        body,
        false,
        &cfg,
    )
    .unwrap()
    .hints;
    assert_eq!(got.priority, Some(-2));
}

#[test]
fn a_previous_response_id_starts_its_own_chain() {
    let cfg = FilterConfig::default();
    let fresh = br#"{"model":"m","input":[{"role":"user","content":"hello there"}]}"#;
    let continued =
        br#"{"model":"m","previous_response_id":"resp_1","input":[{"role":"user","content":"hello there"}]}"#;
    let a = understand(Api::Responses, &headers(&[]), fresh, false, &cfg)
        .unwrap()
        .hashes
        .hashes;
    let b = understand(Api::Responses, &headers(&[]), continued, false, &cfg)
        .unwrap()
        .hashes
        .hashes;
    assert!(a.iter().all(|h| !b.contains(h)));
}

fn understood_with(body: &serde_json::Value, hdrs: Vec<(String, Vec<u8>)>, config: &FilterConfig) -> Understood {
    let bytes = serde_json::to_vec(body).unwrap();
    understand(Api::ChatCompletions, &hdrs, &bytes, false, config).unwrap()
}

fn byte_headers(pairs: &[(&str, &[u8])]) -> Vec<(String, Vec<u8>)> {
    pairs.iter().map(|(k, v)| ((*k).to_owned(), v.to_vec())).collect()
}

#[test]
fn a_client_sent_tenant_header_is_not_read_unless_trusted() {
    let claim = byte_headers(&[("x-kvmesh-tenant", b"acme"), ("authorization", b"Bearer mallory")]);
    let mallory = understood_with(&chat(1), claim.clone(), &FilterConfig::default()).identity;
    let own = understood_with(
        &chat(1),
        byte_headers(&[("authorization", b"Bearer mallory")]),
        &FilterConfig::default(),
    )
    .identity;
    // By default the claim changes nothing: the tenant is the credential's.
    assert_eq!(mallory.tenant, own.tenant);
    assert!(mallory.tenant.starts_with("key:"), "{}", mallory.tenant);
    let trusted = FilterConfig {
        trust_tenant_header: true,
        ..FilterConfig::default()
    };
    assert_eq!(understood_with(&chat(1), claim, &trusted).identity.tenant, "acme");
}

#[test]
fn header_values_that_are_not_utf8_are_absent_ids_never_a_panic() {
    let hdrs = byte_headers(&[
        ("x-session-id", b"\xff\xfe\xc3("),
        ("x-session-affinity", b"fallback"),
        ("x-kvmesh-priority", b"\xff7"),
        ("user-agent", b"caf\xe9"),
        ("authorization", b"Bearer \xff\xfe"),
    ]);
    let u = understood_with(&chat(1), hdrs, &FilterConfig::default());
    // The hostile session header is skipped; the next source is used.
    assert_eq!(u.identity.session_id, "fallback");
    assert_eq!(u.hints.priority, None);
    assert_eq!(u.identity.harness, Harness::Other);
    // A credential is hashed as bytes: two non-UTF-8 keys stay two tenants.
    let other = understood_with(
        &chat(1),
        byte_headers(&[("authorization", b"Bearer \xff\xfd")]),
        &FilterConfig::default(),
    );
    assert!(u.identity.tenant.starts_with("key:"));
    assert_ne!(u.identity.tenant, other.identity.tenant);
}

#[test]
fn long_ids_are_bounded_and_stay_distinct() {
    let a = format!("{}a", "s".repeat(1000));
    let b = format!("{}b", "s".repeat(1000));
    let (ba, bb) = (bounded_id(&a), bounded_id(&b));
    assert!(ba.len() <= kvmesh_vocab::limits::MAX_ID_BYTES && bb.len() <= kvmesh_vocab::limits::MAX_ID_BYTES);
    assert_ne!(ba, bb);
    assert_eq!(bounded_id("short"), "short");
    // Multi-byte characters are never cut in half.
    assert!(bounded_id(&"é".repeat(500)).starts_with('é'));
    let u = understood(
        &chat(1),
        &[("x-session-id", a.as_str()), ("x-claude-code-agent-id", b.as_str())],
    );
    assert_eq!(u.identity.session_id, ba);
    assert_eq!(u.identity.agent_id, bb);
}

#[test]
fn a_model_name_over_the_bound_is_not_routed_on_content() {
    let mut body = chat(1);
    body["model"] = json!("m".repeat(kvmesh_vocab::limits::MAX_ID_BYTES + 1));
    let bytes = serde_json::to_vec(&body).unwrap();
    let err = understand(
        Api::ChatCompletions,
        &headers(&[]),
        &bytes,
        false,
        &FilterConfig::default(),
    )
    .unwrap_err();
    assert_eq!(err, NotUnderstood::ModelTooLong(kvmesh_vocab::limits::MAX_ID_BYTES + 1));
    body["model"] = json!("m".repeat(kvmesh_vocab::limits::MAX_ID_BYTES));
    assert_eq!(understood(&body, &[]).model.len(), kvmesh_vocab::limits::MAX_ID_BYTES);
}

#[test]
fn sections_are_bounded() {
    let messages: Vec<_> = (0..kvmesh_vocab::limits::MAX_SECTIONS + 100)
        .map(|i| json!({"role": "user", "content": format!("m{i}")}))
        .collect();
    let u = understood(&json!({"model": "m", "messages": messages}), &[]);
    assert_eq!(u.sections.len(), kvmesh_vocab::limits::MAX_SECTIONS);
}
