//! Golden tests on request fixtures shaped like the wire traffic of Claude
//! Code, Codex, OpenCode and OpenClaw (`tests/fixtures/*.json`, each with a
//! `source` note on where its shape comes from and `cli`, the CLI version
//! that sends it). Where a documented shape and a captured CLI
//! (`tests/real-harnesses`, checked in `real_harnesses.rs`) disagree, the
//! fixture follows the capture; shapes of older versions stay, named by
//! their version.
//!
//! Set `KVMESH_BLESS=1` to rewrite `tests/fixtures/golden.json` after an
//! intended change of the canonical form (every deployed filter of a GPU
//! cluster must then be upgraded together).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kvmesh_request::{Api, ChunkedRequest, FilterConfig, Understood, understand};
use serde_json::{Value, json};

#[derive(Debug)]
struct Fixture {
    name: String,
    path: String,
    headers: Vec<(String, String)>,
    expect: Value,
    items_key: String,
    system_pointer: String,
    tools_pointer: Option<String>,
    body: Value,
    next_turn: Value,
}

fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn fixtures() -> Vec<Fixture> {
    let mut all = Vec::new();
    for entry in std::fs::read_dir(fixtures_dir()).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_stem().unwrap().to_string_lossy().into_owned();
        if path.extension().is_none_or(|e| e != "json") || name == "golden" {
            continue;
        }
        let f: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert!(
            f["source"].as_str().is_some_and(|s| s.len() > 40),
            "{name}: no source note"
        );
        // A harness's fixture names the version whose shape it is.
        let cli = f["cli"].as_str().unwrap_or_else(|| panic!("{name}: no cli"));
        assert!(
            f["expect"]["harness"] == "other" || cli.contains(|c: char| c.is_ascii_digit()),
            "{name}: cli {cli:?} names no version"
        );
        all.push(Fixture {
            headers: f["headers"]
                .as_object()
                .unwrap()
                .iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_owned()))
                .collect(),
            path: f["api_path"].as_str().unwrap().to_owned(),
            expect: f["expect"].clone(),
            items_key: f["items_key"].as_str().unwrap().to_owned(),
            system_pointer: f["system_pointer"].as_str().unwrap().to_owned(),
            tools_pointer: f["tools_pointer"].as_str().map(str::to_owned),
            body: f["body"].clone(),
            next_turn: f["next_turn"].clone(),
            name,
        });
    }
    all.sort_by(|a, b| a.name.cmp(&b.name));
    assert!(all.len() >= 8, "fixtures missing");
    all
}

fn run(f: &Fixture, body: &Value, headers: &[(String, String)]) -> Understood {
    let api = Api::from_path(&f.path).unwrap();
    let bytes = serde_json::to_vec(body).unwrap();
    understand(api, &headers.to_vec(), &bytes, false, &FilterConfig::default())
        .unwrap_or_else(|e| panic!("{}: {e}", f.name))
}

fn hashes(f: &Fixture, body: &Value) -> Vec<u64> {
    run(f, body, &f.headers).hashes.hashes
}

fn strip_cache_control(value: &mut Value) {
    match value {
        Value::Object(map) => {
            map.remove("cache_control");
            map.values_mut().for_each(strip_cache_control);
        }
        Value::Array(items) => items.iter_mut().for_each(strip_cache_control),
        _ => {}
    }
}

/// The next call of the session, as the harness sends it: the earlier
/// conversation unchanged except for `cache_control`, which Claude Code and
/// OpenCode move to the newest messages, then the new turn appended.
fn next_call(f: &Fixture) -> Value {
    let mut body = f.body.clone();
    if let Some(prompt) = body[&f.items_key].as_str() {
        body[&f.items_key] = Value::String(format!("{prompt}{}", f.next_turn.as_str().unwrap()));
        return body;
    }
    let items = body[&f.items_key].as_array_mut().unwrap();
    items.iter_mut().for_each(strip_cache_control);
    items.extend(f.next_turn.as_array().unwrap().iter().cloned());
    body
}

#[test]
fn the_next_turn_keeps_every_full_block_of_the_previous_turn() {
    for f in fixtures() {
        let first = run(&f, &f.body, &f.headers).hashes;
        let second = run(&f, &next_call(&f), &f.headers).hashes;
        let full = first.hashes.len() - usize::from(first.last_partial);
        assert!(full >= 4, "{}: only {full} full blocks", f.name);
        assert_eq!(
            second.hashes[..full],
            first.hashes[..full],
            "{}: the next turn broke the prefix",
            f.name
        );
        assert!(second.stream_bytes > first.stream_bytes, "{}", f.name);
    }
}

#[test]
fn fields_outside_the_prompt_and_header_order_change_no_hash() {
    for f in fixtures() {
        let base = hashes(&f, &f.body);
        let mut body = f.body.clone();
        let stream = body["stream"].as_bool().unwrap_or(false);
        body["stream"] = json!(!stream);
        body["stream_options"] = json!({"include_usage": true});
        body["temperature"] = json!(0.01);
        body["max_tokens"] = json!(77);
        body["metadata"] = json!({"user_id": "someone-else", "trace": 7});
        let mut headers = f.headers.clone();
        headers.reverse();
        headers.push(("x-request-id".to_owned(), "r-42".to_owned()));
        assert_eq!(run(&f, &body, &headers).hashes.hashes, base, "{}", f.name);
        // A body re-serialized with other whitespace is the same prompt.
        let pretty = serde_json::to_vec_pretty(&f.body).unwrap();
        let api = Api::from_path(&f.path).unwrap();
        let got = understand(api, &f.headers, &pretty, false, &FilterConfig::default()).unwrap();
        assert_eq!(got.hashes.hashes, base, "{}: whitespace changed hashes", f.name);
    }
}

/// Flips one character in the middle of the string at `pointer`.
fn with_one_byte_changed(body: &Value, pointer: &str) -> Value {
    let mut body = body.clone();
    let text = body.pointer_mut(pointer).unwrap();
    let mut chars: Vec<char> = text.as_str().unwrap().chars().collect();
    let middle = chars.len() / 2;
    chars[middle] = if chars[middle] == 'Q' { 'R' } else { 'Q' };
    *text = Value::String(chars.into_iter().collect());
    body
}

#[test]
fn one_byte_of_the_system_prompt_or_the_tools_changes_every_hash_from_there_on() {
    for f in fixtures() {
        let base = hashes(&f, &f.body);
        for pointer in std::iter::once(&f.system_pointer).chain(f.tools_pointer.as_ref()) {
            let changed = hashes(&f, &with_one_byte_changed(&f.body, pointer));
            assert_eq!(changed.len(), base.len(), "{} {pointer}", f.name);
            let first_diff = (0..base.len())
                .find(|&i| base[i] != changed[i])
                .unwrap_or_else(|| panic!("{} {pointer}: no hash changed", f.name));
            assert!(
                (first_diff..base.len()).all(|i| base[i] != changed[i]),
                "{} {pointer}: a hash after block {first_diff} survived the change",
                f.name
            );
        }
    }
}

#[test]
fn two_tenants_with_identical_prompts_share_no_hash() {
    for f in fixtures() {
        // A tenant header set by a trusted hop (a gateway).
        let trusted = FilterConfig {
            trust_tenant_header: true,
            ..FilterConfig::default()
        };
        let tenant = |t: &str| {
            let mut headers = f.headers.clone();
            headers.push(("x-kvmesh-tenant".to_owned(), t.to_owned()));
            let api = Api::from_path(&f.path).unwrap();
            let bytes = serde_json::to_vec(&f.body).unwrap();
            understand(api, &headers, &bytes, false, &trusted)
                .unwrap()
                .hashes
                .hashes
        };
        let (a, b) = (tenant("team-a"), tenant("team-b"));
        assert!(a.iter().all(|h| !b.contains(h)), "{}: tenants share a hash", f.name);
        // Without a tenant header, different credentials are different tenants.
        let mut other_key = f.headers.clone();
        other_key.retain(|(k, _)| k != "authorization");
        other_key.push(("authorization".to_owned(), "Bearer another-key".to_owned()));
        let other = run(&f, &f.body, &other_key).hashes.hashes;
        assert!(hashes(&f, &f.body).iter().all(|h| !other.contains(h)), "{}", f.name);
    }
}

#[test]
fn the_session_agent_parent_harness_and_lane_match_each_fixture() {
    for f in fixtures() {
        let u = run(&f, &f.body, &f.headers);
        let id = u.identity;
        let got = json!({
            "session": id.session_id,
            "agent": id.agent_id,
            "parent": id.parent_id,
            "harness": id.harness.name(),
            "lane": u.lane.name(),
        });
        assert_eq!(got, f.expect, "{}", f.name);
    }
}

#[test]
fn hashes_match_the_golden_file() {
    let golden_path = fixtures_dir().join("golden.json");
    let mut actual = BTreeMap::new();
    for f in fixtures() {
        let h = run(&f, &f.body, &f.headers).hashes;
        actual.insert(
            f.name.clone(),
            json!({
                "blocks": h.hashes.len(),
                "last_partial": h.last_partial,
                "stream_bytes": h.stream_bytes,
                "first": format!("{:016x}", h.hashes[0]),
                "last": format!("{:016x}", h.hashes[h.hashes.len() - 1]),
            }),
        );
    }
    let actual = serde_json::to_value(actual).unwrap();
    // The filter feeds bodies as Envoy delivers them: in 1-byte and 64 KB
    // chunks the fixtures hash as in one.
    for f in fixtures() {
        let api = Api::from_path(&f.path).unwrap();
        let bytes = serde_json::to_vec(&f.body).unwrap();
        for chunk in [1, 64 * 1024] {
            let config = FilterConfig::default();
            let mut request = ChunkedRequest::new(api, &f.headers, &config, None, bytes.len());
            for piece in bytes.chunks(chunk) {
                request.feed(piece);
            }
            let fed = request.finish(&f.headers, false, &config).unwrap();
            assert_eq!(fed, run(&f, &f.body, &f.headers), "{} in {chunk}-byte chunks", f.name);
        }
    }
    if std::env::var_os("KVMESH_BLESS").is_some() {
        std::fs::write(&golden_path, serde_json::to_string_pretty(&actual).unwrap() + "\n").unwrap();
        return;
    }
    let golden: Value = serde_json::from_str(&std::fs::read_to_string(&golden_path).unwrap()).unwrap();
    assert_eq!(
        actual, golden,
        "the canonical form changed; if intended, rerun with KVMESH_BLESS=1 and upgrade all filters together"
    );
}

#[test]
fn each_harness_is_recognised_and_a_declared_one_wins() {
    use kvmesh_request::Harness;
    for f in fixtures() {
        let expected = match f.name.split('_').next().unwrap() {
            "claude" => Harness::ClaudeCode,
            "codex" => Harness::Codex,
            "opencode" => Harness::OpenCode,
            // By its prompt: OpenClaw 2026.9.6 sends no header of its own.
            "openclaw" => Harness::OpenClaw,
            _ => Harness::Other,
        };
        assert_eq!(run(&f, &f.body, &f.headers).identity.harness, expected, "{}", f.name);
        let mut declared = f.headers.clone();
        declared.push(("X-Kvmesh-Harness".to_owned(), "other".to_owned()));
        assert_eq!(
            run(&f, &f.body, &declared).identity.harness,
            Harness::Other,
            "{}",
            f.name
        );
    }
}

#[test]
fn the_next_turn_keeps_every_section_and_a_changed_part_is_named() {
    use kvmesh_request::SectionKind;
    for f in fixtures() {
        let first = run(&f, &f.body, &f.headers).sections;
        let second = run(&f, &next_call(&f), &f.headers).sections;
        assert!(!first.is_empty(), "{}", f.name);
        if f.body[&f.items_key].is_array() {
            assert_eq!(second[..first.len()], first[..], "{}: a section changed", f.name);
            assert!(second.len() > first.len(), "{}", f.name);
            let last = second.last().unwrap();
            assert_eq!(
                (last.kind, last.index as usize),
                (SectionKind::Message, second_items(&f) - 1)
            );
        }
        let system_kind = if f.system_pointer.starts_with("/prompt") {
            SectionKind::Message
        } else {
            SectionKind::System
        };
        let pointers = std::iter::once((&f.system_pointer, system_kind))
            .chain(f.tools_pointer.as_ref().map(|p| (p, SectionKind::Tools)));
        for (pointer, kind) in pointers {
            let changed = run(&f, &with_one_byte_changed(&f.body, pointer), &f.headers).sections;
            let at = (0..first.len())
                .find(|&i| first[i] != changed[i])
                .unwrap_or_else(|| panic!("{} {pointer}: no section changed", f.name));
            assert_eq!(changed[at].kind, kind, "{} {pointer}", f.name);
            assert_eq!(changed[at].start, first[at].start, "{} {pointer}", f.name);
            assert!(
                first[at + 1..] == changed[at + 1..] || f.body[&f.items_key].is_string(),
                "{} {pointer}: later sections changed too",
                f.name
            );
        }
    }
}

fn second_items(f: &Fixture) -> usize {
    next_call(f)[&f.items_key].as_array().unwrap().len()
}
