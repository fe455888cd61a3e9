//! The chunked path against the one-shot one: however a body is split, and
//! whatever its key order, [`ChunkedRequest`] understands it exactly as
//! [`understand`] does (same blocks, same sections, same errors); and when
//! the body sends its parts in stream order, the hashing is done ahead.

use proptest::prelude::*;
use serde_json::{Value, json};

use crate::*;

fn headers() -> Vec<(String, String)> {
    vec![
        ("x-session-id".to_owned(), "s-1".to_owned()),
        ("authorization".to_owned(), "Bearer k".to_owned()),
    ]
}

/// Feeds `body` cut at `cuts` (any offsets, any order).
fn chunked(
    api: Api,
    body: &[u8],
    cuts: &[usize],
    truncated: bool,
    config: &FilterConfig,
    likely_model: Option<&str>,
) -> (Result<Understood, NotUnderstood>, usize) {
    let mut at: Vec<usize> = cuts.iter().map(|c| c % (body.len() + 1)).collect();
    at.push(body.len());
    at.sort_unstable();
    let mut request = ChunkedRequest::new(api, &headers(), config, likely_model, body.len());
    let mut from = 0;
    for to in at {
        request.feed(&body[from..to]);
        from = to;
    }
    assert_eq!(request.len(), body.len());
    request.finish_counted(&headers(), truncated, config)
}

fn same_as_one_shot(api: Api, body: &[u8], cuts: &[usize], config: &FilterConfig, likely_model: Option<&str>) {
    for truncated in [false, true] {
        let one_shot = understand(api, &headers(), body, truncated, config);
        let (fed, _) = chunked(api, body, cuts, truncated, config, likely_model);
        assert_eq!(
            fed,
            one_shot,
            "{} body {:?} cut at {cuts:?}",
            api.name(),
            String::from_utf8_lossy(body)
        );
    }
}

/// An agent's chat: system prompt, tool calls and results, long strings
/// full of escapes; `model_first` puts `model` before the messages (as the
/// harnesses do) or after (as a client serialising sorted keys does).
fn agent_chat(turns: usize, model_first: bool, tools: bool) -> Vec<u8> {
    let mut messages =
        vec![json!({"role": "system", "content": "You are a coding agent.\n\"Use\" the tools. ".repeat(20)})];
    for turn in 0..turns {
        messages.push(
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": format!("c{turn}"),
            "type": "function", "function": {"name": "read", "arguments": format!("{{\"path\":\"f{turn}.rs\"}}")}}],
            "cache_control": {"type": "ephemeral"}}),
        );
        messages.push(
            json!({"role": "tool", "tool_call_id": format!("c{turn}"), "content": "fn f() {}\n\\t\n".repeat(30)}),
        );
    }
    let messages = serde_json::to_string(&messages).unwrap();
    let tools = if tools {
        r#","tools":[{"type":"function","function":{"name":"read"}}]"#
    } else {
        ""
    };
    if model_first {
        format!(r#"{{"model":"qwen3","stream":true,"messages":{messages}{tools},"max_tokens":5}}"#)
    } else {
        format!(r#"{{"max_tokens":5,"messages":{messages},"model":"qwen3"{tools},"stream":true}}"#)
    }
    .into_bytes()
}

/// A Codex-like Responses body: its tools in an `additional_tools` input
/// item or in `tools`, every item with a client-made `id` (or none), now
/// and then an `item_reference`; `model_first` as in [`agent_chat`].
fn codex_input(turns: usize, tools_item: bool, ids: bool, model_first: bool) -> Vec<u8> {
    let id = |prefix: &str, n: usize| {
        if ids {
            json!(format!("{prefix}_{n:04}"))
        } else {
            Value::Null
        }
    };
    let tools = json!([{"type": "function", "name": "exec", "description": "Run \"code\".\n".repeat(8)}]);
    let mut input = Vec::new();
    if tools_item {
        input.push(json!({"type": "additional_tools", "id": id("at", 0), "role": "developer", "tools": tools}));
    }
    input.push(json!({"type": "message", "id": id("msg", 1), "role": "developer",
        "content": [{"type": "input_text", "text": "You are Codex.\n".repeat(20)}]}));
    for turn in 0..turns {
        input.push(
            json!({"type": "function_call", "id": id("fc", turn), "call_id": format!("call_{turn}"),
            "name": "exec", "arguments": format!("{{\"cmd\":\"echo {turn}\"}}")}),
        );
        input.push(json!({"id": id("fco", turn), "type": "function_call_output",
            "call_id": format!("call_{turn}"), "output": "ok\n".repeat(10)}));
        if turn % 3 == 2 {
            input.push(json!({"type": "item_reference", "id": format!("msg_{turn}")}));
        }
    }
    let input = serde_json::to_string(&input).unwrap().replace(r#""id":null,"#, "");
    let tools = if tools_item {
        String::new()
    } else {
        format!(r#","tools":{tools}"#)
    };
    if model_first {
        format!(r#"{{"model":"gpt-x","stream":true,"input":{input}{tools},"store":false}}"#)
    } else {
        format!(r#"{{"store":false,"input":{input}{tools},"model":"gpt-x"}}"#)
    }
    .into_bytes()
}

fn fixture_bodies() -> Vec<(Api, Vec<u8>)> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let mut bodies = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.file_stem().is_some_and(|s| s == "golden") {
            continue;
        }
        let fixture: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let api = Api::from_path(fixture["api_path"].as_str().unwrap()).unwrap();
        bodies.push((api, serde_json::to_vec_pretty(&fixture["body"]).unwrap()));
        bodies.push((api, serde_json::to_vec(&fixture["body"]).unwrap()));
    }
    bodies
}

fn small_blocks() -> FilterConfig {
    FilterConfig {
        block_bytes: 16,
        max_blocks: 64,
        ..FilterConfig::default()
    }
}

#[test]
fn fixtures_fed_one_byte_at_a_time_hash_as_one_chunk() {
    for (api, body) in fixture_bodies() {
        let every_byte: Vec<usize> = (0..body.len()).collect();
        for config in [FilterConfig::default(), small_blocks()] {
            same_as_one_shot(api, &body, &every_byte, &config, None);
            same_as_one_shot(api, &body, &every_byte, &config, Some("another-model"));
        }
    }
}

#[test]
fn a_body_in_stream_order_is_hashed_ahead() {
    let config = FilterConfig::default();
    let body = agent_chat(40, true, false);
    let cuts: Vec<usize> = (0..body.len()).step_by(1000).collect();
    let (fed, kept) = chunked(Api::ChatCompletions, &body, &cuts, false, &config, None);
    assert_eq!(fed, understand(Api::ChatCompletions, &headers(), &body, false, &config));
    let fed = fed.unwrap();
    // Every marker of the body says ephemeral, no TTL: the default 5 min.
    assert_eq!(fed.hints.retention_horizon_s, Some(300));
    let blocks = fed.hashes.hashes.len();
    // All but the blocks that the last chunk completes were hashed ahead.
    assert!(
        kept >= (blocks - 8) * config.block_bytes,
        "{kept} bytes of {blocks} blocks"
    );
}

#[test]
fn declared_horizons_and_priority_edits_match_the_one_shot_path() {
    let config = FilterConfig {
        priority_field: serde_json::from_value(json!({"engine": "trtllm"})).ok(),
        ..FilterConfig::default()
    };
    for seed in 0..6 {
        for model_first in [true, false] {
            let body = with_ttls(agent_chat(12, model_first, true), seed);
            let cuts: Vec<usize> = (0..body.len()).step_by(97).collect();
            let (fed, _) = chunked(Api::ChatCompletions, &body, &cuts, false, &config, Some("qwen3"));
            let one_shot = understand(Api::ChatCompletions, &headers(), &body, false, &config).unwrap();
            let fed = fed.unwrap();
            assert_eq!(fed, one_shot);
            // A "2d" TTL does not read (the marker is then 5 min); "48h" is a day.
            assert!(fed.hints.retention_horizon_s.is_some_and(|h| h >= 3600), "{seed}");
            assert!(fed.body_edit.is_some());
        }
    }
}

#[test]
fn codex_items_without_their_ids_are_hashed_ahead() {
    // Ids left out and the tools item as the tools section: the parts are
    // still written as they arrive, and the chain hashed ahead is kept.
    let config = FilterConfig::default();
    let body = codex_input(30, true, true, true);
    let cuts: Vec<usize> = (0..body.len()).step_by(500).collect();
    let (fed, kept) = chunked(Api::Responses, &body, &cuts, false, &config, Some("gpt-x"));
    let fed = fed.unwrap();
    assert_eq!(
        Ok(fed.clone()),
        understand(Api::Responses, &headers(), &body, false, &config)
    );
    assert_eq!(fed.sections[0].kind, SectionKind::Tools);
    assert!(kept > fed.hashes.stream_bytes as usize / 2, "{kept}");
}

#[test]
fn a_model_after_the_messages_is_assumed_and_checked() {
    let config = FilterConfig::default();
    let body = agent_chat(40, false, false);
    let cuts: Vec<usize> = (0..body.len()).step_by(1000).collect();
    let one_shot = understand(Api::ChatCompletions, &headers(), &body, false, &config);
    // The likely model is right: the work ahead is kept.
    let (fed, kept) = chunked(Api::ChatCompletions, &body, &cuts, false, &config, Some("qwen3"));
    assert_eq!(fed, one_shot);
    assert!(kept > body.len() / 2, "{kept}");
    // Wrong, or unknown: the chain starts again from the salt the body
    // names, once it names it.
    for likely in [Some("other"), None] {
        let (fed, _) = chunked(Api::ChatCompletions, &body, &cuts, false, &config, likely);
        assert_eq!(fed, one_shot);
    }
}

#[test]
fn tools_after_the_messages_break_the_order_and_change_nothing() {
    let config = FilterConfig::default();
    for model_first in [true, false] {
        let body = agent_chat(20, model_first, true);
        let cuts: Vec<usize> = (0..body.len()).step_by(700).collect();
        let (fed, kept) = chunked(Api::ChatCompletions, &body, &cuts, false, &config, Some("qwen3"));
        assert_eq!(fed, understand(Api::ChatCompletions, &headers(), &body, false, &config));
        assert_eq!(kept, 0);
    }
}

#[test]
fn hostile_shapes_fail_as_the_one_shot_path_does() {
    let bodies: &[&[u8]] = &[
        b"",
        b"{",
        b"{}",
        b"[]",
        b"{\"model\":\"m\",\"messages\":[1 2]}",
        b"{\"model\":\"m\",\"messages\":[1,]}",
        b"{\"model\":\"m\",\"messages\":[{\"role\":\"user\"}}",
        b"{\"model\":\"m\",\"messages\":[\"a\\\"\",{}]} trailing",
        b"{\"model\":\"m\",\"messages\":[[[[[[[[]]]]]]]]",
        b"{\"model\":7,\"messages\":[]}",
        b"{\"model\":\"m\",\"messages\":{}}",
        b"{\"model\":\"m\" \"messages\":[]}",
        b"{\"model\":\"m\",\"messages\":[{\"a\":1}],\"messages\":[{\"b\":2}]}",
        b"{\"model\":\"m\",\"messages\":[{\"role\":\"system\",\"content\":\"x\"},{\"role\":\"user\"}],\"model\":\"n\"}",
        b"{\"prompt\":[\"a\",\"b\"],\"model\":\"m\",\"cache_salt\":\"s\"}",
        b"{\"model\":\"m\",\"input\":\"hi\",\"instructions\":\"be\",\"tools\":null}",
        b"{\"model\":\"m\",\"input\":[{\"role\":\"user\",\"content\":\"x\"}],\"previous_response_id\":\"r\"}",
        b"{\"model\":\"m\",\"system\":\"s\",\"tools\":[],\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}",
        b"{\"model\":\"m\",\"messages\":[tru",
    ];
    // Nesting at, just under and over the scanner's depth bound.
    let deep: Vec<String> = [126, 127, 128, 200]
        .iter()
        .map(|&n| format!(r#"{{"model":"m","messages":[{}{}]}}"#, "[".repeat(n), "]".repeat(n)))
        .collect();
    for body in bodies.iter().copied().chain(deep.iter().map(|d| d.as_bytes())) {
        let every_byte: Vec<usize> = (0..body.len()).collect();
        for api in Api::ALL {
            same_as_one_shot(api, body, &every_byte, &small_blocks(), Some("m"));
            same_as_one_shot(api, body, &[], &small_blocks(), None);
        }
    }
}

/// The agent chat's `cache_control` markers, each given one of the TTLs a
/// client may send (or a malformed one), picked by `seed`.
fn with_ttls(body: Vec<u8>, seed: u8) -> Vec<u8> {
    const TTLS: [&str; 6] = [
        "",
        r#","ttl":"5m""#,
        r#","ttl":"1h""#,
        r#","ttl":"90s""#,
        r#","ttl":"2d""#,
        r#","ttl":"48h""#,
    ];
    let text = String::from_utf8_lossy(&body).into_owned();
    let mut out = String::new();
    for (n, piece) in text.split(r#""cache_control":{"type":"ephemeral"}"#).enumerate() {
        if n > 0 {
            let ttl = TTLS[(usize::from(seed) + n) % TTLS.len()];
            out.push_str(&format!(r#""cache_control":{{"type":"ephemeral"{ttl}}}"#));
        }
        out.push_str(piece);
    }
    out.into_bytes()
}

fn arb_body() -> impl Strategy<Value = (Api, Vec<u8>)> {
    let fixtures = fixture_bodies();
    let agent = (1usize..12, any::<bool>(), any::<bool>(), any::<u8>()).prop_map(|(turns, model_first, tools, ttl)| {
        (
            Api::ChatCompletions,
            with_ttls(agent_chat(turns, model_first, tools), ttl),
        )
    });
    let fixture = (0..fixtures.len()).prop_map(move |i| fixtures[i].clone());
    let codex = (1usize..8, any::<bool>(), any::<bool>(), any::<bool>())
        .prop_map(|(turns, item, ids, model_first)| (Api::Responses, codex_input(turns, item, ids, model_first)));
    (
        prop_oneof![agent, fixture, codex],
        any::<u8>(),
        any::<usize>(),
        any::<u8>(),
    )
        .prop_map(|((api, mut body), mutate, at, byte)| {
            // Now and then a body is cut or has one byte changed.
            let at = at % (body.len() + 1);
            match mutate % 8 {
                0 => body.truncate(at),
                1 if at < body.len() => body[at] = byte,
                _ => {}
            }
            (api, body)
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn any_split_of_a_body_hashes_as_one_chunk(
        (api, body) in arb_body(),
        cuts in prop::collection::vec(any::<usize>(), 0..40),
        as_api in any::<bool>(),
        likely in prop_oneof![Just(None), Just(Some("qwen3")), Just(Some("claude-sonnet-4-5"))],
        small in any::<bool>(),
        rewrite in any::<bool>(),
        strip in any::<bool>(),
    ) {
        let mut config = if small { small_blocks() } else { FilterConfig::default() };
        if rewrite {
            config.priority_field = serde_json::from_value(json!({"engine": "vllm"})).ok();
        }
        config.strip_preambles = strip;
        let api = if as_api { api } else { Api::Responses };
        for truncated in [false, true] {
            let one_shot = understand(api, &headers(), &body, truncated, &config);
            let (fed, _) = chunked(api, &body, &cuts, truncated, &config, likely);
            prop_assert_eq!(fed, one_shot);
        }
    }
}

#[test]
fn buffers_grow_towards_the_announced_length_and_never_past_twice_the_bytes() {
    let config = FilterConfig::default();
    let body = agent_chat(40, true, false);
    // Announced right: fed 1 KB at a time, the buffers stop growing once
    // about half of the body is in (the stream's, an eighth more than the
    // body, once half of that is).
    let mut request = ChunkedRequest::new(Api::ChatCompletions, &headers(), &config, None, body.len());
    let mut last_growth = 0;
    let mut capacity = 0;
    for (n, piece) in body.chunks(1000).enumerate() {
        request.feed(piece);
        if request.capacity() != capacity {
            capacity = request.capacity();
            last_growth = n * 1000;
        }
    }
    assert!(
        last_growth <= body.len() * 3 / 5 + 1000,
        "grew at {last_growth} of {}",
        body.len()
    );
    // Announced 8 MB, sent 1 KB: no memory for the announcement.
    let mut liar = ChunkedRequest::new(Api::ChatCompletions, &headers(), &config, None, 8 << 20);
    liar.feed(&body[..1000]);
    assert!(liar.capacity() <= 4 * 1000, "{}", liar.capacity());
}
