//! Who each request of the four real harness CLIs is, and which lane: every
//! capture in `tests/real-harnesses/<harness>-<version>/` (see its
//! README.md) goes through `understand` as the filter sees it (its exact
//! wire bytes, its headers as bytes) and must match the table below,
//! written from the captures by hand: the harness, the session, agent and
//! parent ids, and the lane. A new capture without a row, or a row without
//! a capture, fails.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kvmesh_request::{Api, ChunkedRequest, FilterConfig, Harness, Lane, Understood, understand};
use serde_json::Value;

use Harness::{ClaudeCode as CC, Codex as CX, OpenClaw as OCL, OpenCode as OC};
use Lane::{Compaction, Main, Side};

/// One row: capture (`<dir>/<number>`), harness, session, agent, parent, lane.
type Row = (&'static str, Harness, &'static str, &'static str, &'static str, Lane);

// Claude Code 2.1.197: `-p` with a subagent, interactive, two sessions.
const CC_SUB: &str = "d835142c-7288-4eb3-8721-e3a0f021acbe";
const CC_TUI: &str = "551ffebe-1011-4ba9-b746-70a5570e4e8e";
const CC_AGENT: &str = "a19ff0ffd9b031e65";
// Codex 0.171.0: `exec` with a subagent, interactive (title thread, compaction), two sessions.
const CX_SUB: &str = "01a23c00-76fd-7020-9c1d-d52b7abdebb7";
const CX_CHILD: &str = "01a23c00-79c0-7780-9769-04438e093b09";
const CX_TUI: &str = "01a23c3b-b57b-74d0-b9cc-d1c8ec8a1b25";
const CX_TITLE: &str = "01a23c3b-bf13-7bf1-be82-94a598350fe9";
// OpenCode 1.18.33: Chat with a child session, Messages, Responses, two sessions.
const OC_SUB: &str = "ses_dc3fb3476ffeJ6RA3oYkI2zsHX";
const OC_CHILD: &str = "ses_dc3fb0c57ffeikFc7dC70cKTm5";
const OC_ANTH: &str = "ses_dc3fddb1dffeBPHezrE7CloEL0";
const OC_RESP: &str = "ses_dc3c266e4ffesPmP17FZeyhgaA";
// OpenClaw 2026.9.6: gateway with a subagent, local turns, affinity headers, Messages, Responses.
const OCL_SUB: &str = "88d347c2-db26-4295-8b8e-2b7fddd2d60e";
const OCL_CHILD: &str = "019446da-7246-4283-832d-977ab20b19df";
/// The trace id of the gateway turn that spawned the subagent.
const OCL_TURN: &str = "trace:34d223add902cf5f3d2fbb8637a0f178";
const OCL_LOCAL: &str = "64ea1c8a-e7c5-4ae7-973f-c98df737359d";
const OCL_AFF: &str = "59546c3b-4ddd-447f-92da-b4abc0b17c80";
const OCL_ANTH: &str = "0dcbc5ed-776f-4d1f-a29f-ee6e9429c998";
const OCL_RESP: &str = "cef5ab96-2708-4161-833b-a47268f839e9";

const EXPECTED: &[Row] = &[
    ("claude-code-2.1.197/01", CC, CC_SUB, "", "", Main),
    ("claude-code-2.1.197/02", CC, CC_SUB, "", "", Main),
    ("claude-code-2.1.197/03", CC, CC_SUB, CC_AGENT, CC_SUB, Main),
    ("claude-code-2.1.197/04", CC, CC_SUB, CC_AGENT, CC_SUB, Main),
    ("claude-code-2.1.197/05", CC, CC_SUB, "", "", Main),
    // 06 is the `HEAD /` connection check: no body, not an API call.
    ("claude-code-2.1.197/07", CC, CC_TUI, "", "", Side),
    ("claude-code-2.1.197/08", CC, CC_TUI, "", "", Main),
    ("claude-code-2.1.197/09", CC, CC_TUI, "", "", Main),
    (
        "claude-code-2.1.197/10",
        CC,
        "4ce67478-4604-4699-ab03-52abf2545e98",
        "",
        "",
        Main,
    ),
    (
        "claude-code-2.1.197/11",
        CC,
        "90fc6b48-f9fa-4cb4-bbdc-50891f6a4b8e",
        "",
        "",
        Main,
    ),
    ("codex-0.171.0/01", CX, CX_SUB, "", "", Main),
    ("codex-0.171.0/02", CX, CX_SUB, "", "", Main),
    ("codex-0.171.0/03", CX, CX_SUB, "", "", Main),
    ("codex-0.171.0/04", CX, CX_SUB, CX_CHILD, CX_SUB, Main),
    ("codex-0.171.0/05", CX, CX_SUB, CX_CHILD, CX_SUB, Main),
    ("codex-0.171.0/06", CX, CX_SUB, "", "", Main),
    ("codex-0.171.0/07", CX, CX_TUI, "", "", Main),
    // The title thread is a session of its own: only its lane says it is a side call.
    ("codex-0.171.0/08", CX, CX_TITLE, "", "", Side),
    ("codex-0.171.0/09", CX, CX_TUI, "", "", Main),
    ("codex-0.171.0/10", CX, CX_TUI, "", "", Compaction),
    ("codex-0.171.0/11", CX, CX_TUI, "", "", Main),
    ("codex-0.171.0/12", CX, CX_TUI, "", "", Main),
    (
        "codex-0.171.0/13",
        CX,
        "01a23c2c-34a5-7c93-ab92-9f579eecd2d9",
        "",
        "",
        Main,
    ),
    (
        "codex-0.171.0/14",
        CX,
        "01a23c2c-474f-7d93-9c3f-41ed70942d1e",
        "",
        "",
        Main,
    ),
    ("openclaw-2026.9.6/01", OCL, OCL_SUB, "", "", Main),
    ("openclaw-2026.9.6/02", OCL, OCL_SUB, "", "", Main),
    ("openclaw-2026.9.6/03", OCL, OCL_SUB, "", "", Main),
    ("openclaw-2026.9.6/04", OCL, OCL_CHILD, "", OCL_TURN, Main),
    ("openclaw-2026.9.6/05", OCL, OCL_CHILD, "", OCL_TURN, Main),
    ("openclaw-2026.9.6/06", OCL, OCL_LOCAL, "", "", Main),
    ("openclaw-2026.9.6/07", OCL, OCL_LOCAL, "", "", Main),
    ("openclaw-2026.9.6/08", OCL, OCL_LOCAL, "", "", Main),
    ("openclaw-2026.9.6/09", OCL, OCL_LOCAL, "", "", Main),
    (
        "openclaw-2026.9.6/10",
        OCL,
        "3b9c8f00-0000-4000-8000-00000000cafe",
        "",
        "",
        Main,
    ),
    // With `compat.sendSessionAffinityHeaders` (`session_id: <sessionId>:0`): the same id.
    ("openclaw-2026.9.6/11", OCL, OCL_AFF, "", "", Main),
    ("openclaw-2026.9.6/12", OCL, OCL_AFF, "", "", Main),
    ("openclaw-2026.9.6/13", OCL, OCL_ANTH, "", "", Main),
    ("openclaw-2026.9.6/14", OCL, OCL_ANTH, "", "", Main),
    ("openclaw-2026.9.6/15", OCL, OCL_RESP, "", "", Main),
    ("openclaw-2026.9.6/16", OCL, OCL_RESP, "", "", Main),
    ("opencode-1.18.33/01", OC, OC_SUB, "", "", Side),
    ("opencode-1.18.33/02", OC, OC_SUB, "", "", Main),
    ("opencode-1.18.33/03", OC, OC_SUB, "", "", Main),
    ("opencode-1.18.33/04", OC, OC_CHILD, "", OC_SUB, Main),
    ("opencode-1.18.33/05", OC, OC_CHILD, "", OC_SUB, Main),
    ("opencode-1.18.33/06", OC, OC_SUB, "", "", Main),
    ("opencode-1.18.33/07", OC, OC_ANTH, "", "", Side),
    ("opencode-1.18.33/08", OC, OC_ANTH, "", "", Main),
    ("opencode-1.18.33/09", OC, OC_ANTH, "", "", Main),
    ("opencode-1.18.33/10", OC, OC_RESP, "", "", Side),
    ("opencode-1.18.33/11", OC, OC_RESP, "", "", Main),
    ("opencode-1.18.33/12", OC, OC_RESP, "", "", Main),
    (
        "opencode-1.18.33/13",
        OC,
        "ses_dc3d3464affeuzREj0lR2C5nhN",
        "",
        "",
        Main,
    ),
    (
        "opencode-1.18.33/14",
        OC,
        "ses_dc3d229d9ffeBqjgEzvB63TOpZ",
        "",
        "",
        Main,
    ),
];

/// The captures that are not API calls, skipped by name.
const NOT_API_CALLS: &[&str] = &["claude-code-2.1.197/06"];

struct Capture {
    /// `<dir>/<number>`, as in the table.
    key: String,
    api: Api,
    /// Names lowercased (as Envoy hands them over), values as bytes.
    headers: Vec<(String, Vec<u8>)>,
    /// The body as it was on the wire.
    body: Vec<u8>,
}

impl Capture {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| std::str::from_utf8(v).unwrap())
    }
}

fn captures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/real-harnesses")
}

/// Every capture that is an API call; the HEAD probe is checked to be the
/// one known and left out.
fn captures() -> Vec<Capture> {
    let mut all = Vec::new();
    let mut skipped = Vec::new();
    for dir in std::fs::read_dir(captures_dir()).unwrap() {
        let dir = dir.unwrap().path();
        if !dir.is_dir() {
            continue;
        }
        for file in std::fs::read_dir(&dir).unwrap() {
            let path = file.unwrap().path();
            if path.extension().is_none_or(|e| e != "json") {
                continue;
            }
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let key = format!("{}/{}", dir.file_name().unwrap().to_string_lossy(), &name[..2]);
            let text = std::fs::read_to_string(&path).unwrap();
            let capture: Value = serde_json::from_str(&text).unwrap();
            if capture["method"] == "HEAD" {
                assert_eq!(capture["body"], "", "{key}: a HEAD with a body");
                skipped.push(key);
                continue;
            }
            assert_eq!(capture["method"], "POST", "{key}");
            let headers = capture["headers"]
                .as_array()
                .unwrap()
                .iter()
                .map(|pair| {
                    // Each byte was written as one Latin-1 character.
                    let value = pair[1].as_str().unwrap().chars().map(|c| u8::try_from(c).unwrap());
                    (pair[0].as_str().unwrap().to_ascii_lowercase(), value.collect())
                })
                .collect();
            let body = wire_body(&text);
            assert_eq!(
                serde_json::from_slice::<Value>(&body).unwrap(),
                capture["body"],
                "{key}: body bytes"
            );
            let capture = Capture {
                api: Api::from_path(capture["path"].as_str().unwrap()).unwrap(),
                key,
                headers,
                body,
            };
            assert_eq!(
                capture.header("content-length").map(|n| n.parse::<usize>().unwrap()),
                Some(capture.body.len()),
                "{}: not the wire bytes",
                capture.key
            );
            all.push(capture);
        }
    }
    skipped.sort();
    assert_eq!(skipped, NOT_API_CALLS, "only the known HEAD probe is skipped");
    all.sort_by(|a, b| a.key.cmp(&b.key));
    all
}

/// The `body` member of a capture file as the CLI sent it: the file's own
/// text of it (key order and characters kept, unlike a `serde_json::Value`),
/// without the pretty-printer's whitespace outside strings.
fn wire_body(file: &str) -> Vec<u8> {
    let start = file.find("\n \"body\": ").unwrap() + "\n \"body\": ".len();
    let mut values = serde_json::Deserializer::from_str(&file[start..]).into_iter::<serde::de::IgnoredAny>();
    values.next().unwrap().unwrap();
    let raw = &file.as_bytes()[start..start + values.byte_offset()];
    let (mut out, mut in_string, mut escaped) = (Vec::with_capacity(raw.len()), false, false);
    for &b in raw {
        if in_string {
            out.push(b);
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
        } else if !b.is_ascii_whitespace() {
            in_string = b == b'"';
            out.push(b);
        }
    }
    out
}

fn understood(c: &Capture) -> Understood {
    understand(c.api, &c.headers, &c.body, false, &FilterConfig::default()).unwrap_or_else(|e| panic!("{}: {e}", c.key))
}

#[test]
fn every_capture_is_who_and_which_lane_the_table_says() {
    let captures = captures();
    let expected: BTreeMap<&str, &Row> = EXPECTED.iter().map(|row| (row.0, row)).collect();
    assert_eq!(expected.len(), EXPECTED.len(), "a row is repeated");
    let keys: Vec<&str> = captures.iter().map(|c| c.key.as_str()).collect();
    assert_eq!(
        keys,
        expected.keys().copied().collect::<Vec<_>>(),
        "captures and rows differ"
    );
    let mut wrong = Vec::new();
    for c in &captures {
        let &(_, harness, session, agent, parent, lane) = expected[c.key.as_str()];
        let u = understood(c);
        let id = &u.identity;
        let got = (
            id.harness,
            id.session_id.as_str(),
            id.agent_id.as_str(),
            id.parent_id.as_str(),
            u.lane,
        );
        let want = (harness, session, agent, parent, lane);
        if got != want {
            wrong.push(format!("{}: got {got:?}, want {want:?}", c.key));
        }
    }
    assert!(
        wrong.is_empty(),
        "{} of {}:\n{}",
        wrong.len(),
        captures.len(),
        wrong.join("\n")
    );
}

/// Where each harness shows its session in these captures, read here
/// without kvmesh's code: the table's ids are the captures' own.
fn visible_session(c: &Capture, harness: Harness) -> String {
    match harness {
        Harness::ClaudeCode => c.header("x-claude-code-session-id").unwrap().to_owned(),
        Harness::Codex => c.header("session-id").unwrap().to_owned(),
        Harness::OpenCode => c.header("x-session-id").unwrap().to_owned(),
        _ => {
            let text = std::str::from_utf8(&c.body).unwrap();
            let at = text.find("sessionId=").unwrap() + "sessionId=".len();
            text[at..].split(' ').next().unwrap().to_owned()
        }
    }
}

#[test]
fn the_table_s_ids_are_the_ids_the_captures_show() {
    for c in captures() {
        let row = EXPECTED.iter().find(|row| row.0 == c.key).unwrap();
        assert_eq!(visible_session(&c, row.1), row.2, "{}", c.key);
        // On Responses, Codex and OpenCode repeat it as the cache key.
        let body: Value = serde_json::from_slice(&c.body).unwrap();
        if let Some(key) = body["prompt_cache_key"].as_str() {
            assert_eq!(key, row.2, "{}", c.key);
        }
        if !row.3.is_empty() {
            let agent = c.header("x-claude-code-agent-id").or(c.header("thread-id"));
            assert_eq!(agent, Some(row.3), "{}", c.key);
        }
        // OpenClaw's affinity headers carry the prompt's id plus `:0`.
        if row.1 == Harness::OpenClaw
            && let Some(affinity) = c.header("x-session-affinity")
        {
            assert_eq!(affinity, format!("{}:0", row.2), "{}", c.key);
            assert_eq!(c.header("session_id"), Some(affinity), "{}", c.key);
        }
        // A subagent's trace is the trace of the turn that spawned it.
        if row.4.starts_with("trace:") {
            let trace = c.header("traceparent").unwrap().split('-').nth(1).unwrap();
            assert_eq!(format!("trace:{trace}"), row.4, "{}", c.key);
            let spawner = captures_of("openclaw-2026.9.6/02");
            assert!(spawner.header("traceparent").unwrap().contains(trace), "{}", c.key);
        }
    }
}

fn captures_of(key: &str) -> Capture {
    captures().into_iter().find(|c| c.key == key).unwrap()
}

#[test]
fn bodies_fed_in_chunks_are_understood_as_one() {
    let config = FilterConfig::default();
    for c in captures() {
        let whole = understood(&c);
        for chunk in [1024, 64 * 1024] {
            let mut request = ChunkedRequest::new(c.api, &c.headers, &config, None, c.body.len());
            for piece in c.body.chunks(chunk) {
                request.feed(piece);
            }
            let fed = request.finish(&c.headers, false, &config).unwrap();
            assert_eq!(fed, whole, "{} in {chunk}-byte chunks", c.key);
        }
    }
}

#[test]
fn a_body_cut_by_the_parse_cap_is_never_a_side_call_it_is_not() {
    // The filter parses the first `max_body_bytes` of a longer body. Cut
    // after its first 8 KiB, no capture turns into a side call, and a
    // session id it still finds is its own: an OpenClaw prompt cut before
    // its `Runtime:` line leaves only the affinity header's `<id>:0` (the
    // limit of reading the session from the prompt).
    for c in captures() {
        let whole = understood(&c);
        let cut = &c.body[..c.body.len().min(8 * 1024)];
        let Ok(u) = understand(c.api, &c.headers, cut, true, &FilterConfig::default()) else {
            continue;
        };
        assert!(u.lane == Lane::Main || u.lane == whole.lane, "{}: {:?}", c.key, u.lane);
        let session = u.identity.session_id.as_str();
        assert!(
            session.is_empty() || session == whole.identity.session_id || Some(session) == c.header("session_id"),
            "{}: {session}",
            c.key
        );
    }
}
