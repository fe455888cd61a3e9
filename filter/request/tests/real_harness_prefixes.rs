//! What two calls of the real harness CLIs share of their canonical stream,
//! on the requests they sent (`tests/real-harnesses`): the stream follows
//! what the engine tokenizes, so bytes the engine never sees (Codex's
//! client-made item ids, Claude Code's billing line) do not break it.
//!
//! `cargo test -p kvmesh-request --test real_harness_prefixes -- --ignored
//! --nocapture` prints the shares for the pairs of docs/harnesses/README.md.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;

use kvmesh_request::{Api, Canonical, Envelope, FilterConfig, SectionKind, Understood, canonical_stream, understand};

/// One captured request: its API, headers and the body bytes as sent.
struct Capture {
    api: Api,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

/// `dir/NN-*.json` of the captures.
fn capture(dir: &str, number: u32) -> Capture {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/real-harnesses")
        .join(dir);
    let prefix = format!("{number:02}-");
    let path = std::fs::read_dir(&root)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .find(|path| path.file_name().unwrap().to_string_lossy().starts_with(&prefix))
        .unwrap_or_else(|| panic!("no {dir}/{prefix}*"));
    let file = std::fs::read(&path).unwrap();
    let parsed: serde_json::Value = serde_json::from_slice(&file).unwrap();
    let api = Api::from_path(parsed["path"].as_str().unwrap()).unwrap();
    let headers: Vec<(String, String)> = parsed["headers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|pair| {
            (
                pair[0].as_str().unwrap().to_ascii_lowercase(),
                pair[1].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    // The file is the body pretty-printed, key order and characters as
    // sent (see the captures' README): without the whitespace outside its
    // strings it is the body as sent. (`serde_json::Value` would sort keys.)
    let raw = Envelope::parse(&file, false).unwrap().raw("body").unwrap().to_vec();
    let body = minified(&raw);
    let sent = headers.iter().find(|(name, _)| name == "content-length");
    assert!(
        sent.is_some_and(|(_, len)| len.parse::<usize>().ok() == Some(body.len())),
        "{dir}/{number:02}: not the bytes sent"
    );
    Capture { api, headers, body }
}

/// `json` without whitespace outside strings.
fn minified(json: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(json.len());
    let (mut in_string, mut escaped) = (false, false);
    for &b in json {
        if in_string {
            out.push(b);
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_string = false,
                _ => {}
            }
        } else if !matches!(b, b' ' | b'\n' | b'\r' | b'\t') {
            in_string = b == b'"';
            out.push(b);
        }
    }
    out
}

fn config() -> FilterConfig {
    FilterConfig::default()
}

fn stream(c: &Capture) -> Canonical {
    let config = config();
    let envelope = Envelope::parse(&c.body, false).unwrap();
    canonical_stream(c.api, &envelope, config.max_blocks * config.block_bytes).unwrap()
}

fn understood(c: &Capture) -> Understood {
    understand(c.api, &c.headers, &c.body, false, &config()).unwrap()
}

/// Bytes the two streams share from their start.
fn common(a: &Canonical, b: &Canonical) -> usize {
    a.stream.iter().zip(&b.stream).take_while(|(x, y)| x == y).count()
}

/// The share of `a`'s stream that `b` starts with.
fn share(a: &Canonical, b: &Canonical) -> f64 {
    common(a, b) as f64 / a.stream.len() as f64
}

/// Leading block hashes the two requests share.
fn shared_blocks(a: &Understood, b: &Understood) -> usize {
    a.hashes
        .hashes
        .iter()
        .zip(&b.hashes.hashes)
        .take_while(|(x, y)| x == y)
        .count()
}

/// Where in the stream the first section of `kind` starts.
fn section_start(c: &Canonical, kind: SectionKind) -> usize {
    c.sections
        .iter()
        .find(|s| s.kind == kind)
        .map(|s| s.start as usize)
        .unwrap()
}

#[test]
#[ignore = "prints a report; run with --ignored --nocapture"]
fn report_shared_prefixes() {
    let pairs = [
        (
            "codex-0.171.0",
            13,
            "codex-0.171.0",
            14,
            "Codex: two sessions, first calls",
        ),
        (
            "codex-0.171.0",
            10,
            "codex-0.171.0",
            11,
            "Codex: compaction -> next window",
        ),
        ("codex-0.171.0", 3, "codex-0.171.0", 4, "Codex: root -> forked subagent"),
        ("codex-0.171.0", 1, "codex-0.171.0", 2, "Codex: consecutive root calls"),
        (
            "codex-0.171.0",
            7,
            "codex-0.171.0",
            13,
            "Codex: sessions in two repositories",
        ),
        (
            "claude-code-2.1.197",
            10,
            "claude-code-2.1.197",
            11,
            "Claude Code: two sessions, one prompt",
        ),
        (
            "claude-code-2.1.197",
            1,
            "claude-code-2.1.197",
            10,
            "Claude Code: other prompt and HOME",
        ),
        (
            "claude-code-2.1.197",
            1,
            "claude-code-2.1.197",
            2,
            "Claude Code: consecutive main calls",
        ),
        (
            "opencode-1.18.33",
            11,
            "opencode-1.18.33",
            12,
            "OpenCode Responses: consecutive",
        ),
        (
            "openclaw-2026.9.6",
            15,
            "openclaw-2026.9.6",
            16,
            "OpenClaw Responses: consecutive",
        ),
    ];
    for (da, na, db, nb, what) in pairs {
        let (a, b) = (capture(da, na), capture(db, nb));
        let (sa, sb) = (stream(&a), stream(&b));
        let blocks = shared_blocks(&understood(&a), &understood(&b));
        println!(
            "{what:<42} {na:02} -> {nb:02}: {:>6} of {:>6} bytes ({:.4}), {blocks} blocks",
            common(&sa, &sb),
            sa.stream.len(),
            share(&sa, &sb)
        );
    }
    let (a, b) = (
        capture("claude-code-2.1.197", 10),
        other_prompt(&capture("claude-code-2.1.197", 11)),
    );
    let (sa, sb) = (stream(&a), stream(&b));
    println!(
        "{:<42} 10 -> 11': {:>6} of {:>6} bytes ({:.4}), system ends at {}",
        "Claude Code: two sessions, other prompts",
        common(&sa, &sb),
        sa.stream.len(),
        share(&sa, &sb),
        section_start(&sa, SectionKind::Message)
    );
}

/// Claude Code's second session as it would be with another first prompt:
/// another prompt text, and so other digits in the billing line (they
/// follow the first user message: docs/harnesses/claude-code.md).
fn other_prompt(c: &Capture) -> Capture {
    let text = String::from_utf8(c.body.clone()).unwrap();
    let prompt = "KV1: run echo hi in the shell and tell me what it printed";
    assert_eq!(text.matches(prompt).count(), 1);
    assert_eq!(text.matches("cc_version=2.1.197.c0a;").count(), 1);
    let body = text
        .replace(prompt, "KV3: list the files of this repository, largest first")
        .replace("cc_version=2.1.197.c0a;", "cc_version=2.1.197.4a8;");
    Capture {
        api: c.api,
        headers: c.headers.clone(),
        body: body.into_bytes(),
    }
}

fn codex(number: u32) -> Capture {
    capture("codex-0.171.0", number)
}

fn claude_code(number: u32) -> Capture {
    capture("claude-code-2.1.197", number)
}

#[test]
fn two_codex_sessions_of_one_prompt_share_their_whole_stream() {
    let (a, b) = (codex(13), codex(14));
    // Every input item of the two bodies has its own client-made id.
    assert_ne!(a.body, b.body);
    assert!(String::from_utf8_lossy(&a.body).contains(r#""id":"msg_"#));
    let (sa, sb) = (stream(&a), stream(&b));
    assert!(sa.stream.len() > 50_000);
    assert_eq!(
        sa.stream,
        sb.stream,
        "the streams differ from byte {}",
        common(&sa, &sb)
    );
    assert_eq!(sa.sections, sb.sections);
    // Same tenant (one key) and model: every block is the same block.
    let (ua, ub) = (understood(&a), understood(&b));
    assert_ne!(ua.identity.session_id, ub.identity.session_id);
    assert_eq!(ua.hashes, ub.hashes);
    // With another prompt, everything before the prompt's text is shared:
    // the tools, the developer messages, the environment.
    let text = String::from_utf8(b.body.clone()).unwrap();
    let prompt = "KV1: run echo hi in the shell and tell me what it printed";
    assert_eq!(text.matches(prompt).count(), 1);
    let other = Capture {
        body: text
            .replace(prompt, "KV3: list the files of this repository")
            .into_bytes(),
        ..b
    };
    let so = stream(&other);
    let at = common(&sa, &so);
    let expected = find(&sa.stream, prompt.as_bytes()) + "KV".len();
    assert_eq!(at, expected);
    assert!(at as f64 >= 0.99 * sa.stream.len().min(so.stream.len()) as f64, "{at}");
}

fn find(haystack: &[u8], needle: &[u8]) -> usize {
    haystack
        .windows(needle.len())
        .position(|w| w == needle)
        .unwrap_or_else(|| panic!("{:?} not found", String::from_utf8_lossy(needle)))
}

#[test]
fn codex_compaction_keeps_the_head_of_the_prompt_for_the_next_window() {
    // The call after `/compact` rebuilds the history with new ids for every
    // item, the tools item included; what it keeps is the prompt's head
    // (tools, developer messages, environment, first prompt).
    let (compaction, next) = (stream(&codex(10)), stream(&codex(11)));
    let kept = share(&compaction, &next);
    assert!(kept >= 0.95, "{kept}");
    let at = common(&compaction, &next) as u64;
    let broken = compaction.sections.iter().rposition(|s| s.start <= at).unwrap();
    assert_eq!(compaction.sections[..broken], next.sections[..broken]);
    assert_eq!(compaction.sections[broken].kind, SectionKind::Message);
}

#[test]
fn codex_tools_sent_as_an_input_item_are_the_tools_section() {
    for number in [1, 4, 8, 11, 13] {
        let c = codex(number);
        let s = stream(&c);
        // Codex's default model takes no `tools` member: the tools are the
        // first input item, then the developer messages, then the user's.
        assert!(Envelope::parse(&c.body, false).unwrap().raw("tools").is_none());
        let kinds: Vec<SectionKind> = s.sections.iter().map(|s| s.kind).collect();
        assert_eq!(kinds[0], SectionKind::Tools, "cx/{number:02}");
        assert_eq!(s.sections[0].index, 0);
        assert_eq!(&kinds[1..5], &[SectionKind::System; 4], "cx/{number:02}");
        assert_eq!(kinds[5], SectionKind::Message, "cx/{number:02}");
        assert!(kinds[1..].iter().all(|k| *k != SectionKind::Tools), "cx/{number:02}");
        // Through the whole path, the Pick's sections say the same.
        assert_eq!(understood(&c).sections[0].kind, SectionKind::Tools);
    }
}

#[test]
fn two_claude_code_sessions_share_the_tools_and_the_system_prompt() {
    let (a, b) = (claude_code(10), claude_code(11));
    let (sa, sb) = (stream(&a), stream(&b));
    assert_eq!(sa.stream, sb.stream);
    assert_eq!(
        shared_blocks(&understood(&a), &understood(&b)),
        understood(&a).hashes.hashes.len()
    );
    assert!(find_opt(&sa.stream, b"x-anthropic-billing-header").is_none());
    // Another first prompt gives other digits in the billing line: the
    // stream now goes on through the system prompt to the prompt's text.
    let other = other_prompt(&b);
    let so = stream(&other);
    let at = common(&sa, &so);
    assert!(at >= section_start(&sa, SectionKind::Message), "{at}");
    assert_eq!(at, find(&sa.stream, b"KV1: run echo") + "KV".len());
    // The captures of two runs with other prompts and other HOMEs: the
    // stream breaks where the system prompt names the HOME, no longer at
    // the billing line before it.
    let (first, tenth) = (stream(&claude_code(1)), sa);
    let at = common(&first, &tenth);
    assert!(at > section_start(&first, SectionKind::System));
    assert!(first.stream[..at].ends_with(b"/tmp/kvcap/home-cc-"), "broke at {at}");
}

fn find_opt(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// The captures as the filter gets them: in pieces of any size, the
/// understanding (blocks, sections, the body edit) is the whole body's.
#[test]
fn the_captures_fed_in_pieces_are_understood_as_whole_bodies() {
    let mut config = FilterConfig {
        strip_preambles: true,
        priority_field: serde_json::from_value(serde_json::json!({"engine": "vllm"})).ok(),
        ..FilterConfig::default()
    };
    let captures = (1..=14).map(|n| (format!("cx/{n:02}"), codex(n))).chain(
        (1..=11)
            .filter(|&n| n != 6)
            .map(|n| (format!("cc/{n:02}"), claude_code(n))),
    );
    for (name, c) in captures {
        for small in [false, true] {
            config.block_bytes = if small { 64 } else { 256 };
            let whole = understand(c.api, &c.headers, &c.body, false, &config).unwrap();
            // Every Claude Code call (the title call too) has the block.
            let edit = whole.body_edit.as_ref().unwrap();
            assert_eq!(edit.preamble, c.api == Api::Messages, "{name}");
            assert!(!String::from_utf8_lossy(&edit.apply(&c.body)).contains("x-anthropic-billing-header"));
            // 1-byte pieces for two captures (slow), larger ones for all.
            let sizes: &[usize] = if name == "cx/13" || name == "cc/01" {
                &[1, 7, 4096]
            } else {
                &[7, 4096]
            };
            for &size in sizes {
                let mut request = kvmesh_request::ChunkedRequest::new(c.api, &c.headers, &config, None, c.body.len());
                for piece in c.body.chunks(size) {
                    request.feed(piece);
                }
                assert_eq!(
                    request.finish(&c.headers, false, &config).unwrap(),
                    whole,
                    "{name} in {size}-byte pieces"
                );
            }
        }
    }
}

#[test]
fn strip_preambles_takes_only_the_billing_block_out_of_a_real_claude_code_body() {
    let c = claude_code(10);
    let config = FilterConfig {
        strip_preambles: true,
        ..FilterConfig::default()
    };
    let edit = understand(c.api, &c.headers, &c.body, false, &config)
        .unwrap()
        .body_edit
        .unwrap();
    let block =
        r#"{"type":"text","text":"x-anthropic-billing-header: cc_version=2.1.197.c0a; cc_entrypoint=sdk-cli;"},"#;
    let text = String::from_utf8(c.body.clone()).unwrap();
    assert_eq!(text.matches(block).count(), 1);
    let expected = text.replace(block, "");
    assert_eq!(String::from_utf8(edit.apply(&c.body)).unwrap(), expected);
    assert_eq!(edit.new_len(c.body.len()), c.body.len() - block.len());
    // The engine then sees the prompt the stream described.
    assert_eq!(
        stream(&c).stream,
        stream(&Capture {
            body: expected.into_bytes(),
            ..c
        })
        .stream
    );
}
