//! Request priority: where it comes from, what is dropped or clamped, how
//! it maps onto each engine's field, and the body rewrite that writes it
//! (every byte kept but the top-level `priority`).

use serde_json::{Value, json};

use crate::*;

fn headers(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
}

fn field(engine: Engine) -> PriorityField {
    serde_json::from_value(json!({"engine": engine_name(engine)})).unwrap()
}

fn engine_name(engine: Engine) -> &'static str {
    match engine {
        Engine::Vllm => "vllm",
        Engine::Sglang => "sglang",
        Engine::Trtllm => "trtllm",
    }
}

fn config(engine: Engine) -> FilterConfig {
    FilterConfig {
        priority_field: Some(field(engine)),
        ..FilterConfig::default()
    }
}

fn understood(api: Api, hdrs: &[(&str, &str)], body: &[u8], config: &FilterConfig) -> Understood {
    understand(api, &headers(hdrs), body, false, config).unwrap()
}

const CHAT: &[u8] = br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;

#[test]
fn kvmesh_priority_maps_onto_each_engines_field_and_polarity() {
    let table: [(i32, &str, &str, &str); 9] = [
        // kvmesh, vLLM (lower first), SGLang (higher first), TRT-LLM (0-1, higher first)
        (0, "0", "0", "0.5"),
        (1000, "-1000", "1000", "1.0"),
        (-1000, "1000", "-1000", "0.0"),
        (1, "-1", "1", "0.5005"),
        (-1, "1", "-1", "0.4995"),
        (500, "-500", "500", "0.75"),
        (-100, "100", "-100", "0.45"),
        (i32::MAX, "-1000", "1000", "1.0"),
        (i32::MIN, "1000", "-1000", "0.0"),
    ];
    for (kvmesh, vllm, sglang, trtllm) in table {
        assert_eq!(engine_priority_json(Engine::Vllm, kvmesh), vllm, "{kvmesh}");
        assert_eq!(engine_priority_json(Engine::Sglang, kvmesh), sglang, "{kvmesh}");
        assert_eq!(engine_priority_json(Engine::Trtllm, kvmesh), trtllm, "{kvmesh}");
    }
    // Higher on kvmesh's scale is sooner on every engine, over the whole range.
    let mut last: Option<(i64, i64, f64)> = None;
    for p in -1000..=1000 {
        let v: i64 = engine_priority_json(Engine::Vllm, p).parse().unwrap();
        let s: i64 = engine_priority_json(Engine::Sglang, p).parse().unwrap();
        let t: f64 = engine_priority_json(Engine::Trtllm, p).parse().unwrap();
        assert!((0.0..=1.0).contains(&t));
        if let Some((lv, ls, lt)) = last {
            assert!(v < lv && s > ls && t > lt, "{p}");
        }
        last = Some((v, s, t));
    }
}

#[test]
fn the_header_wins_then_the_agent_hint_then_the_class() {
    let cfg = config(Engine::Vllm);
    let hinted = br#"{"model":"m","messages":[],"nvext":{"agent_hints":{"priority":7}}}"#;
    let p = |hdrs: &[(&str, &str)], body: &[u8]| understood(Api::ChatCompletions, hdrs, body, &cfg).hints.priority;
    assert_eq!(p(&[("x-kvmesh-priority", "3")], hinted), Some(3));
    assert_eq!(p(&[], hinted), Some(7));
    assert_eq!(p(&[], CHAT), Some(0), "the lead class");
    // Without priority_field there is no class: no priority at all.
    let plain = understood(Api::ChatCompletions, &[], CHAT, &FilterConfig::default());
    assert_eq!(plain.hints.priority, None);
    assert_eq!(plain.body_edit, None);
}

#[test]
fn hostile_priorities_are_dropped_or_clamped_never_kept_raw() {
    let cfg = config(Engine::Sglang);
    let read = |hdrs: &[(&str, &str)], body: &[u8]| {
        let hints = understood(Api::ChatCompletions, hdrs, body, &cfg).hints;
        (hints.priority, hints.priority_dropped, hints.priority_clamped)
    };
    for (header, expect) in [
        ("5000", (Some(1000), 0, true)),
        ("-5000", (Some(-1000), 0, true)),
        ("2147483647", (Some(1000), 0, true)),
        ("99999999999", (Some(0), 1, false)),
        ("-99999999999", (Some(0), 1, false)),
        ("abc", (Some(0), 1, false)),
        ("1.5", (Some(0), 1, false)),
        ("1e3", (Some(0), 1, false)),
        ("", (Some(0), 1, false)),
        (" 12 ", (Some(12), 0, false)),
    ] {
        assert_eq!(
            read(&[("x-kvmesh-priority", header)], CHAT),
            expect,
            "header {header:?}"
        );
    }
    for (hint, expect) in [
        ("1.5", (Some(0), 1, false)),
        ("1e3", (Some(0), 1, false)),
        ("\"7\"", (Some(0), 1, false)),
        ("{\"a\":1}", (Some(0), 1, false)),
        ("[1]", (Some(0), 1, false)),
        ("true", (Some(0), 1, false)),
        ("99999999999", (Some(0), 1, false)),
        ("-3000", (Some(-1000), 0, true)),
        ("null", (Some(0), 0, false)),
    ] {
        let body = format!(r#"{{"model":"m","messages":[],"nvext":{{"agent_hints":{{"priority":{hint}}}}}}}"#);
        assert_eq!(read(&[], body.as_bytes()), expect, "hint {hint}");
    }
    // A bad header falls through to a good hint, and both are counted.
    let body = br#"{"model":"m","messages":[],"nvext":{"agent_hints":{"priority":1.5}}}"#;
    assert_eq!(read(&[("x-kvmesh-priority", "abc")], body), (Some(0), 2, false));
    let body = br#"{"model":"m","messages":[],"nvext":{"agent_hints":{"priority":9}}}"#;
    assert_eq!(read(&[("x-kvmesh-priority", "abc")], body), (Some(9), 1, false));
}

#[test]
fn classes_follow_the_role_and_the_harness() {
    let field: PriorityField = serde_json::from_value(json!({
        "engine": "vllm", "lead": 50, "subagent": 10,
        "harness": {"codex": {"subagent": 20, "background": -900}}
    }))
    .unwrap();
    assert_eq!(field.background, -100, "the default background class");
    let cfg = FilterConfig {
        priority_field: Some(field),
        ..FilterConfig::default()
    };
    let p = |hdrs: &[(&str, &str)]| understood(Api::ChatCompletions, hdrs, CHAT, &cfg).hints.priority;
    assert_eq!(p(&[]), Some(50));
    assert_eq!(p(&[("x-claude-code-agent-id", "a1")]), Some(10));
    assert_eq!(p(&[("x-parent-session-id", "s0")]), Some(10));
    assert_eq!(p(&[("x-kvmesh-background", "true")]), Some(-100));
    assert_eq!(p(&[("x-kvmesh-background", "no")]), Some(50));
    let codex = [("originator", "codex_cli_rs"), ("x-codex-parent-thread-id", "t0")];
    assert_eq!(p(&codex), Some(20));
    assert_eq!(
        p(&[("originator", "codex_cli_rs"), ("x-kvmesh-background", "TRUE")]),
        Some(-900)
    );
    assert_eq!(
        p(&[("originator", "codex_cli_rs")]),
        Some(50),
        "codex has no lead override"
    );
    // An explicit priority still wins over any class.
    assert_eq!(
        p(&[("x-kvmesh-background", "true"), ("x-kvmesh-priority", "5")]),
        Some(5)
    );
}

/// `edited` is `original` with `"priority":<value>,` right after its `{`,
/// or with each top-level `priority` value replaced: nothing else differs.
fn rewritten(original: &[u8], edit: &BodyEdit) -> (Vec<u8>, Value) {
    let edited = edit.apply(original);
    assert_eq!(edited.len(), edit.new_len(original.len()));
    let value: Value = serde_json::from_slice(&edited).unwrap_or_else(|err| {
        panic!(
            "{err}: {:?} from {:?}",
            String::from_utf8_lossy(&edited),
            String::from_utf8_lossy(original)
        )
    });
    (edited, value)
}

#[test]
fn every_api_gets_the_field_right_after_its_brace_and_nothing_else_changes() {
    let bodies: [(Api, &[u8]); 4] = [
        (Api::ChatCompletions, CHAT),
        (Api::Completions, br#"{"model":"m","prompt":"once upon","max_tokens":3}"#),
        (Api::Responses, br#"{"model":"m","input":"hi","stream":true}"#),
        (
            Api::Messages,
            b"  {\n  \"model\": \"m\",\n  \"max_tokens\": 4,\n  \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]\n}\n",
        ),
    ];
    for engine in [Engine::Vllm, Engine::Sglang, Engine::Trtllm] {
        let cfg = config(engine);
        for (api, body) in bodies {
            let got = understood(api, &[("x-kvmesh-priority", "200")], body, &cfg);
            let edit = got.body_edit.expect("an edit");
            assert_eq!(edit.replaced, 0);
            let (edited, value) = rewritten(body, &edit);
            let expected = engine_priority_json(engine, 200);
            let field = format!("\"priority\":{expected},");
            let open = body.iter().position(|&b| b == b'{').unwrap() + 1;
            assert_eq!(&edited[..open], &body[..open]);
            assert_eq!(&edited[open..open + field.len()], field.as_bytes());
            assert_eq!(&edited[open + field.len()..], &body[open..], "{}", api.name());
            assert_eq!(value["priority"].to_string(), expected);
            // The prompt, and so the routing, is the same with or without it.
            let again = understood(api, &[("x-kvmesh-priority", "200")], &edited, &cfg);
            assert_eq!(again.hashes, got.hashes);
        }
    }
}

#[test]
fn a_client_priority_is_replaced_in_every_spelling_never_passed_raw() {
    let cfg = config(Engine::Vllm);
    for (body, replaced) in [
        (&br#"{"model":"m","priority":-99999,"messages":[]}"#[..], 1),
        (br#"{"model":"m","messages":[],"priority":{"nested":[1,2]}}"#, 1),
        (br#"{"priority":"abc","model":"m","messages":[]}"#, 1),
        (br#"{"priority":1.5,"model":"m","messages":[],"priority":-7}"#, 2),
        (br#"{"model":"m","\u0070riority":-99999,"messages":[]}"#, 1),
        (br#"{"model":"m", "priority" :  3 ,"messages":[]}"#, 1),
    ] {
        let got = understood(Api::ChatCompletions, &[("x-kvmesh-priority", "10")], body, &cfg);
        let edit = got.body_edit.expect("an edit");
        assert_eq!(edit.replaced, replaced, "{}", String::from_utf8_lossy(body));
        let (edited, value) = rewritten(body, &edit);
        assert_eq!(value["priority"], json!(-10), "{}", String::from_utf8_lossy(&edited));
        // Every member parses to the same as before, but `priority`.
        let mut before: Value = serde_json::from_slice(body).unwrap();
        let mut after = value.clone();
        before.as_object_mut().unwrap().remove("priority");
        after.as_object_mut().unwrap().remove("priority");
        assert_eq!(before, after);
        // Byte for byte: only the values of the priority members changed.
        let text = String::from_utf8_lossy(&edited);
        assert_eq!(text.matches("-10").count(), replaced, "{text}");
    }
}

#[test]
fn an_empty_object_gets_a_lone_field_and_a_cut_body_none() {
    let cfg = config(Engine::Sglang);
    // `{}` is not a chat request, but the edit itself handles it.
    let envelope = Envelope::parse(b" {} ", false).unwrap();
    let edit = crate::priority::edit(&envelope, "5").unwrap();
    assert_eq!(edit.apply(b" {} "), b" {\"priority\":5} ");
    // A body cut at the parse cap may hide a priority after the cut.
    let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"priority":-9999}"#;
    let cut = understand(Api::ChatCompletions, &headers(&[]), &body[..40], true, &cfg).unwrap();
    assert_eq!(cut.body_edit, None);
}

#[test]
fn priority_field_errors_name_the_field() {
    for (json, field) in [
        (r#"{"priority_field":{}}"#, "priority_field"),
        (r#"{"priority_field":{"engine":"tgi"}}"#, "priority_field.engine"),
        (
            r#"{"priority_field":{"engine":"vllm","lead":1001}}"#,
            "priority_field.lead",
        ),
        (
            r#"{"priority_field":{"engine":"vllm","harness":{"cursor":{"lead":1}}}}"#,
            "priority_field.harness.cursor",
        ),
        (
            r#"{"priority_field":{"engine":"vllm","harness":{"codex":{"background":-2000}}}}"#,
            "priority_field.harness.codex.background",
        ),
        (
            r#"{"priority_field":{"engine":"vllm","harness":{"codex":{"boss":1}}}}"#,
            "priority_field.harness.codex.boss",
        ),
        (
            r#"{"priority_field":{"engine":"vllm","background_header":"X-Bg"}}"#,
            "priority_field.background_header",
        ),
        (
            r#"{"priority_field":{"engine":"vllm","colour":1}}"#,
            "priority_field.colour",
        ),
    ] {
        let err = FilterConfig::from_json(json.as_bytes()).unwrap_err();
        assert!(err.field.starts_with(field), "{json}: {err}");
    }
    let ok = FilterConfig::from_json(br#"{"priority_field":{"engine":"trtllm"}}"#).unwrap();
    assert_eq!(ok.priority_field.map(|f| f.engine), Some(Engine::Trtllm));
}
