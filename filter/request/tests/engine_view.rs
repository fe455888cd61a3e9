//! The canonical stream leaves out what the engine never tokenizes: the
//! client-made `id` of Responses input items, and Claude Code's billing block
//! where vLLM and Dynamo both strip it; `strip_preambles` takes that block
//! out of the body sent upstream, every other byte kept. Hostile shapes of
//! either never panic, and the chunked path agrees with the whole-body one.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvmesh_request::{
    Api, BodyEdit, ChunkedRequest, Envelope, FilterConfig, SectionKind, Understood, canonical_stream, understand,
};

fn headers() -> Vec<(String, String)> {
    vec![
        ("x-session-id".to_owned(), "s".to_owned()),
        ("authorization".to_owned(), "Bearer k".to_owned()),
    ]
}

fn stream(api: Api, body: &[u8]) -> Vec<u8> {
    let config = FilterConfig::default();
    let envelope = Envelope::parse(body, false).unwrap();
    canonical_stream(api, &envelope, config.max_blocks * config.block_bytes)
        .unwrap()
        .stream
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle.as_bytes())
}

fn responses(items: &str) -> Vec<u8> {
    format!(r#"{{"model":"m","input":[{items}],"stream":true}}"#).into_bytes()
}

#[test]
fn item_ids_leave_the_stream_and_call_ids_stay() {
    let with_ids = responses(
        r#"{"type":"message","id":"msg_a1","role":"user","content":[{"type":"input_text","text":"hi","id":"nested_kept"}]},
        {"id":"fc_b2","type":"function_call","call_id":"call_1","name":"f","arguments":"{\"id\":1}"},
        {"type":"function_call_output","call_id":"call_1","output":"ok","id":"fco_c3"}"#,
    );
    let without = responses(
        r#"{"type":"message","role":"user","content":[{"type":"input_text","text":"hi","id":"nested_kept"}]},
        {"type":"function_call","call_id":"call_1","name":"f","arguments":"{\"id\":1}"},
        {"type":"function_call_output","call_id":"call_1","output":"ok"}"#,
    );
    let s = stream(Api::Responses, &with_ids);
    assert_eq!(s, stream(Api::Responses, &without));
    for gone in ["msg_a1", "fc_b2", "fco_c3"] {
        assert!(!contains(&s, gone), "{gone}");
    }
    // Below the item's top level an `id` is content (a schema property, a
    // part's own field): it stays, and so does every `call_id`.
    assert!(contains(&s, "nested_kept") && contains(&s, r#""call_id":"call_1""#));
    // Other ids: the same hashes; another call id: other hashes.
    let renamed = String::from_utf8(with_ids.clone()).unwrap().replace("msg_a1", "msg_zz");
    let hashes = |body: &[u8]| {
        understand(Api::Responses, &headers(), body, false, &FilterConfig::default())
            .unwrap()
            .hashes
    };
    assert_eq!(hashes(renamed.as_bytes()), hashes(&with_ids));
    let recalled = String::from_utf8(with_ids.clone()).unwrap().replace("call_1", "call_2");
    assert_ne!(hashes(recalled.as_bytes()), hashes(&with_ids));
    // Whitespace, `cache_control` and the ids all go: one stream.
    let spaced = String::from_utf8(with_ids.clone())
        .unwrap()
        .replace(r#"",""#, "\" ,\n  \"");
    assert_ne!(spaced.as_bytes(), &with_ids[..]);
    assert_eq!(
        stream(Api::Responses, spaced.as_bytes()),
        stream(Api::Responses, &without)
    );
    let marked =
        responses(r#"{"cache_control":{"type":"ephemeral"},"id":"x","type":"message","role":"user","content":"hi"}"#);
    assert_eq!(
        stream(Api::Responses, &marked),
        stream(
            Api::Responses,
            &responses(r#"{"type":"message","role":"user","content":"hi"}"#)
        )
    );
}

#[test]
fn only_responses_items_lose_their_id_and_a_reference_keeps_it() {
    // An `item_reference` is its id: the engine reads the item it names.
    let reference = responses(r#"{"type":"item_reference","id":"msg_kept"}"#);
    assert!(contains(&stream(Api::Responses, &reference), "msg_kept"));
    // Chat messages are not Responses items: nothing of theirs is dropped.
    let chat = br#"{"model":"m","messages":[{"role":"user","id":"chat_kept","content":"hi"}]}"#;
    assert!(contains(&stream(Api::ChatCompletions, chat), "chat_kept"));
    // An id spelt with an escape is not recognised (it stays: only sharing
    // is lost), and an item of only an id is an empty object.
    assert!(contains(
        &stream(Api::Responses, &responses(r#"{"\u0069d":"esc_kept"}"#)),
        "esc_kept"
    ));
    assert!(contains(
        &stream(
            Api::Responses,
            &responses(r#"{"id":"gone"},{"id":"gone","id":"again"}"#)
        ),
        "\u{1f}{}"
    ));
}

#[test]
fn an_additional_tools_item_is_the_tools_section() {
    let body = responses(
        r#"{"type":"additional_tools","id":"at_1","role":"developer","tools":[{"type":"function","name":"f"}]},
        {"type":"message","role":"developer","content":"be brief"},
        {"type":"message","role":"user","content":"hi"}"#,
    );
    let got = understand(Api::Responses, &headers(), &body, false, &FilterConfig::default()).unwrap();
    let kinds: Vec<(SectionKind, u32)> = got.sections.iter().map(|s| (s.kind, s.index)).collect();
    assert_eq!(
        kinds,
        [
            (SectionKind::Tools, 0),
            (SectionKind::System, 1),
            (SectionKind::Message, 2)
        ]
    );
    // A tools item without a role does not end the leading system run.
    let roleless =
        responses(r#"{"type":"additional_tools","tools":[]},{"type":"message","role":"developer","content":"x"}"#);
    let got = understand(Api::Responses, &headers(), &roleless, false, &FilterConfig::default()).unwrap();
    assert_eq!(got.sections[1].kind, SectionKind::System);
    // On the chat API such an element is only a message.
    let chat = br#"{"model":"m","messages":[{"type":"additional_tools","role":"developer","tools":[]}]}"#;
    let got = understand(Api::ChatCompletions, &headers(), chat, false, &FilterConfig::default()).unwrap();
    assert_eq!(got.sections[0].kind, SectionKind::System);
}

const BILLING: &str =
    r#"{"type":"text","text":"x-anthropic-billing-header: cc_version=2.1.197.c0a; cc_entrypoint=sdk-cli;"}"#;
const SYSTEM: &str = r#"{"type":"text","text":"You are a Claude agent.","cache_control":{"type":"ephemeral"}}"#;

fn messages(system: &str) -> Vec<u8> {
    format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}],"system":{system},"tools":[],"max_tokens":9}}"#
    )
    .into_bytes()
}

/// The stream of a Messages body with `system`, and whether it is the one
/// of the same body with the billing block taken out (`stripped`).
fn left_out(system: &str, stripped: &str) -> bool {
    stream(Api::Messages, &messages(system)) == stream(Api::Messages, &messages(stripped))
}

#[test]
fn the_billing_block_leaves_the_stream_where_vllm_and_dynamo_both_strip_it() {
    let rest = format!("[{SYSTEM}]");
    // Claude Code's shape: the billing block first, then the prompt.
    assert!(left_out(&format!("[{BILLING},{SYSTEM}]"), &rest));
    assert!(left_out(&format!("[ {BILLING} ,\n {SYSTEM} ]"), &rest));
    let cached = BILLING.replace('}', r#","cache_control":{"type":"ephemeral","ttl":"1h"}}"#);
    assert!(left_out(&format!("[{cached},{SYSTEM}]"), &rest));
    // An escape in the text is read as the engine reads it.
    let escaped = BILLING.replace("cc_version", r"cc\u005fversion");
    assert!(left_out(&format!("[{escaped},{SYSTEM}]"), &rest));
    // Where either engine keeps it, it stays.
    let kept = |system: String| {
        let s = stream(Api::Messages, &messages(&system));
        assert!(contains(&s, "billing-header"), "{system}");
    };
    // Alone (Dynamo joins the blocks with newlines: none to cut at).
    kept(format!("[{BILLING}]"));
    // Not first (Dynamo strips only the head of the prompt).
    kept(format!("[{SYSTEM},{BILLING}]"));
    // With a newline (Dynamo keeps what follows it in the block).
    kept(format!(
        "[{},{SYSTEM}]",
        BILLING.replace("sdk-cli;", r"sdk-cli;\nYou are")
    ));
    // Not a text block (vLLM reads only `text` blocks), or no type.
    kept(format!(
        "[{},{SYSTEM}]",
        BILLING.replace(r#""type":"text""#, r#""type":"image""#)
    ));
    kept(format!("[{},{SYSTEM}]", BILLING.replace(r#""type":"text","#, "")));
    // Not at the very start (vLLM does not trim), or without the colon
    // (Dynamo's test).
    kept(format!("[{},{SYSTEM}]", BILLING.replace(r#""x-an"#, r#"" x-an"#)));
    kept(format!("[{},{SYSTEM}]", BILLING.replace("header:", "header")));
    // A string system (vLLM keeps it whole).
    kept(r#""x-anthropic-billing-header: cc_version=1; cc_entrypoint=cli;\nYou are""#.to_owned());
    // Only a Messages `system` has one: a chat system message is a message.
    let chat = format!(r#"{{"model":"m","messages":[{{"role":"system","content":[{BILLING},{SYSTEM}]}}]}}"#);
    assert!(contains(
        &stream(Api::ChatCompletions, chat.as_bytes()),
        "billing-header"
    ));
}

fn config(strip_preambles: bool, priority: bool) -> FilterConfig {
    FilterConfig {
        strip_preambles,
        priority_field: priority.then(|| serde_json::from_value(serde_json::json!({"engine": "vllm"})).unwrap()),
        ..FilterConfig::default()
    }
}

fn edit(api: Api, body: &[u8], config: &FilterConfig) -> Option<BodyEdit> {
    let got = understand(api, &headers(), body, false, config).unwrap();
    let (fed, _) = chunked(api, body, config, 5, false);
    assert_eq!(fed.unwrap(), got, "the chunked path edits otherwise");
    got.body_edit
}

fn chunked(
    api: Api,
    body: &[u8],
    config: &FilterConfig,
    piece: usize,
    truncated: bool,
) -> (Result<Understood, kvmesh_request::NotUnderstood>, usize) {
    let mut request = ChunkedRequest::new(api, &headers(), config, Some("m"), body.len());
    for chunk in body.chunks(piece.max(1)) {
        request.feed(chunk);
    }
    request.finish_counted(&headers(), truncated, config)
}

#[test]
fn strip_preambles_takes_out_the_block_and_keeps_every_other_byte() {
    // The removed bytes are the block and what separates it from the next
    // one, whatever the whitespace; the rest is byte for byte the client's.
    for (head, separator, tail) in [
        (
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"system":["#,
            ",",
            "]}",
        ),
        (
            "{\n  \"model\": \"m\",\n  \"messages\": [ {\"role\": \"user\", \"content\": \"hi\"} ],\n  \"system\": [\n    ",
            " ,\n    ",
            "\n  ],\n  \"tools\": []\n}\n",
        ),
    ] {
        let body = format!("{head}{BILLING}{separator}{SYSTEM}{tail}").into_bytes();
        let expected = format!("{head}{SYSTEM}{tail}").into_bytes();
        let e = edit(Api::Messages, &body, &config(true, false)).expect("an edit");
        assert!(e.preamble && !e.priority && e.replaced == 0);
        assert_eq!(e.apply(&body), expected);
        assert_eq!(e.new_len(body.len()), expected.len());
        // The engine now sees the prompt the stream said: one routing.
        let before = understand(Api::Messages, &headers(), &body, false, &config(true, false)).unwrap();
        let after = understand(Api::Messages, &headers(), &expected, false, &config(true, false)).unwrap();
        assert_eq!(before.hashes, after.hashes);
        assert_eq!(after.body_edit, None);
        // Off (the default): the body is the client's.
        assert_eq!(edit(Api::Messages, &body, &config(false, false)), None);
    }
}

#[test]
fn strip_preambles_and_the_priority_field_make_one_edit() {
    let head = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"system":["#;
    let body = format!(r#"{head}{BILLING},{SYSTEM}],"priority":7,"stream":true}}"#).into_bytes();
    let e = edit(Api::Messages, &body, &config(true, true)).expect("an edit");
    assert!(e.preamble && e.priority);
    assert_eq!(e.replaced, 1);
    // Both changes, in body order: the block out, the client's 7 replaced
    // by the request's priority (0 in vLLM's polarity).
    let expected = format!(r#"{head}{SYSTEM}],"priority":0,"stream":true}}"#).into_bytes();
    assert_eq!(
        String::from_utf8(e.apply(&body)).unwrap(),
        String::from_utf8(expected).unwrap()
    );
    // The priority inserted after the brace, the block out further on.
    let body = format!(r#"{head}{BILLING},{SYSTEM}]}}"#).into_bytes();
    let e = edit(Api::Messages, &body, &config(true, true)).expect("an edit");
    let expected = format!(r#"{{"priority":0,{}{SYSTEM}]}}"#, &head[1..]).into_bytes();
    assert_eq!(
        String::from_utf8(e.apply(&body)).unwrap(),
        String::from_utf8(expected).unwrap()
    );
    assert_eq!((e.priority, e.replaced, e.preamble), (true, 0, true));
    // Nothing to strip: the priority alone.
    let plain = messages(&format!("[{SYSTEM}]"));
    let e = edit(Api::Messages, &plain, &config(true, true)).expect("an edit");
    assert!(e.priority && !e.preamble);
}

#[test]
fn strip_preambles_leaves_other_apis_duplicates_and_cut_bodies_alone_as_engines_read_them() {
    let on = config(true, false);
    let chat = format!(r#"{{"model":"m","messages":[{{"role":"system","content":[{BILLING},{SYSTEM}]}}]}}"#);
    assert_eq!(edit(Api::ChatCompletions, chat.as_bytes(), &on), None);
    assert_eq!(
        edit(Api::Responses, &responses(r#"{"role":"user","content":"hi"}"#), &on),
        None
    );
    // Of two `system` members the engine reads the last: that one loses
    // its block, the first stays as sent.
    let first = format!("[{BILLING},{SYSTEM}]");
    let body = format!(r#"{{"model":"m","messages":[],"system":{first},"sy\u0073tem":[{BILLING},{SYSTEM}]}}"#);
    let e = edit(Api::Messages, body.as_bytes(), &on).expect("an edit");
    let expected = format!(r#"{{"model":"m","messages":[],"system":{first},"sy\u0073tem":[{SYSTEM}]}}"#);
    assert_eq!(e.apply(body.as_bytes()), expected.as_bytes());
    // A body cut at the parse cap may hold another `system` after the cut.
    let body = messages(&format!("[{BILLING},{SYSTEM}]"));
    let cut = understand(Api::Messages, &headers(), &body[..body.len() - 20], true, &on).unwrap();
    assert_eq!(cut.body_edit, None);
}

/// Understood as whole and in pieces, cut or not, with the edits on: the
/// same answer each way, and no panic.
fn survives(api: Api, body: &[u8]) {
    let config = config(true, true);
    let piece = if body.len() > 4096 { 4096 } else { 1 };
    for truncated in [false, true] {
        let whole = understand(api, &headers(), body, truncated, &config);
        let (fed, _) = chunked(api, body, &config, piece, truncated);
        assert_eq!(fed, whole, "{}", String::from_utf8_lossy(&body[..body.len().min(200)]));
        if let Ok(u) = &whole
            && let Some(e) = &u.body_edit
        {
            assert!(e.replace <= body.len());
            assert_eq!(e.apply(body).len(), e.new_len(body.len()));
        }
    }
}

#[test]
fn hostile_system_blocks_and_items_never_panic() {
    let huge_text = format!(
        r#"{{"type":"text","text":"x-anthropic-billing-header: {}"}}"#,
        "a".repeat(2 << 20)
    );
    let escapes = format!(
        r#"{{"type":"text","text":"x-anthropic-billing-header: {}"}}"#,
        r"\\".repeat(1 << 19)
    );
    let systems: Vec<Vec<u8>> = vec![
        format!("[{huge_text},{SYSTEM}]").into_bytes(),
        format!("[{escapes},{SYSTEM}]").into_bytes(),
        format!(r#"[{{"type":"image","source":{{"data":"x-anthropic-billing-header:"}}}},{SYSTEM}]"#).into_bytes(),
        format!(r#"[{{"type":"text","text":123}},{SYSTEM}]"#).into_bytes(),
        format!(r#"[{{"type":"text","text":null,"text":"x-anthropic-billing-header: x"}},{SYSTEM}]"#).into_bytes(),
        format!(r#"["x-anthropic-billing-header: x",{SYSTEM}]"#).into_bytes(),
        format!("[1,null,[],{{}},{SYSTEM}]").into_bytes(),
        format!("[{BILLING},1 2]").into_bytes(),
        format!("[{BILLING},").into_bytes(),
        format!("[{BILLING}").into_bytes(),
        b"[{\"type\":\"text\",\"text\":\"x-anthropic-billing-header: \xff\xfe\"},{\"type\":\"text\",\"text\":\"a\"}]"
            .to_vec(),
        b"[{\"type\":\"text\",\"te\xffxt\":\"x-anthropic-billing-header: a\"},{\"type\":\"text\",\"text\":\"a\"}]"
            .to_vec(),
        b"[{\"type\":\"text\",\"text\":\"x-anthropic-billing-header: a\\ud800\"},{}]".to_vec(),
        format!("[{}{BILLING}{}]", "[".repeat(100), "]".repeat(100)).into_bytes(),
        b"{}".to_vec(),
        b"\"\"".to_vec(),
    ];
    for system in &systems {
        let mut body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"system":"#.to_vec();
        body.extend_from_slice(system);
        body.extend_from_slice(b",\"tools\":[]}");
        survives(Api::Messages, &body);
    }
    // The huge block is still a billing block: out of the stream and body.
    let body = messages(&format!("[{huge_text},{SYSTEM}]"));
    assert!(stream(Api::Messages, &body).len() < 1000);
    let e = edit(Api::Messages, &body, &config(true, false)).unwrap();
    assert!(e.preamble && e.apply(&body).len() < 1000);

    let huge_id = format!(
        r#"{{"id":"{}","type":"message","role":"user","content":"hi"}}"#,
        "i".repeat(2 << 20)
    );
    let items: Vec<Vec<u8>> = vec![
        responses(&huge_id),
        responses(r#"{"id":{"nested":[1,{"id":2}]},"type":"message","content":"x"}"#),
        responses(r#"{"id":"a","id":"b","id":"c"}"#),
        responses(r#""a string item",[1,2],3,null,{}"#),
        responses(r#"{"type":"additional_tools"},{"type":"additional_tools","tools":"x","id":7}"#),
        responses(r#"{"type":"item_reference"},{"type":"item_reference","id":{"x":1}}"#),
        responses(r#"{"id" "x"}"#),
        responses(r#"{"id":}"#),
        responses(r#"{"id":"x","#),
        b"{\"model\":\"m\",\"input\":[{\"id\":\"\xff\xfe\",\"ty\xffpe\":\"additional_tools\"}]}".to_vec(),
        format!(
            r#"{{"model":"m","input":[{}{{"id":1}}{}]}}"#,
            "[".repeat(126),
            "]".repeat(126)
        )
        .into_bytes(),
    ];
    for body in &items {
        survives(Api::Responses, body);
    }
    // Every cut of a Codex-like and a Claude Code-like body, as the parse
    // cap would cut them.
    for (api, body) in [
        (
            Api::Responses,
            responses(
                r#"{"type":"additional_tools","id":"at_1","role":"developer","tools":[]},{"id":"m","type":"message","role":"user","content":"hi"}"#,
            ),
        ),
        (Api::Messages, messages(&format!("[{BILLING},{SYSTEM}]"))),
    ] {
        for cut in 0..body.len() {
            survives(api, &body[..cut]);
        }
    }
}
