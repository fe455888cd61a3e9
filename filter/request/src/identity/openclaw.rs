//! OpenClaw's identity, read from its prompt: OpenClaw sends no header of
//! its own and, by default, no session header or field, so its system
//! prompt's marker names the harness and the `Runtime:` line it writes into
//! the prompt names the session. Everything kvmesh knows of that text is
//! here; the scans are bounded (a window at the head or the tail of one
//! text, the first few messages and parts), run on the raw JSON, and never
//! panic.
//!
//! Seen in OpenClaw 2026.9.6 (tests/real-harnesses/openclaw-2026.9.6, on all
//! three of its APIs):
//! - the system prompt starts `<!-- openclaw:attempt:STABLE -->` then
//!   `You are a personal assistant running inside OpenClaw.`. It is the
//!   leading `system` message on Chat Completions, the `system` blocks on
//!   Messages (two: STABLE, then DYNAMIC) and the leading `system` input
//!   item on Responses (a custom provider gets no `instructions`);
//! - `Runtime: agent=main | session=agent:main:main | sessionId=<uuid> | host=…`
//!   ends the first user message on Chat Completions, and is the last line
//!   of the system prompt (before `<!-- /openclaw:attempt:DYNAMIC -->`) on
//!   Messages and Responses;
//! - a subagent's session key is `agent:<agent>:subagent:<uuid>` and its
//!   `sessionId` is its own; `--session-id <id>` gives
//!   `agent:<agent>:explicit:<id>`.

use memchr::memmem;

use crate::canonical::Envelope;
use crate::scan;

/// What marks OpenClaw's system prompt, looked for in its first bytes only.
/// Either line will do: the HTML-comment marker is the first line, the
/// sentence the second, and a serializer may escape `<` and `>` (not these
/// letters).
const MARKERS: [&[u8]; 2] = [b"openclaw:attempt:STABLE", b"running inside OpenClaw."];
/// Raw bytes of the system prompt's first text searched for a marker.
const MARKER_WINDOW: usize = 512;
/// Raw bytes at the end of a text searched for the `Runtime:` line. The
/// line is about 400 bytes plus its paths and OpenClaw writes it last, so
/// the end is where it is: a long system prompt (41 KB in 2026.9.6) or a
/// long pasted first message leaves it in this window.
const RUNTIME_WINDOW: usize = 8 * 1024;
const RUNTIME: &[u8] = b"Runtime: agent=";
/// Leading items read to find the system prompt and the first user message:
/// a conversation is never walked to its end.
const MAX_ITEMS: usize = 16;
/// Parts of one message's content read for their text.
const MAX_PARTS: usize = 16;

/// An OpenClaw request, as its prompt says.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct OpenClaw {
    /// The `sessionId=` of its `Runtime:` line, empty when there is none
    /// (unbounded here: the id sources bound it).
    pub(crate) session_id: String,
    /// Its session key is a subagent's (`agent:<agent>:subagent:<uuid>`).
    pub(crate) subagent: bool,
}

/// `Some` when the request's system prompt starts as OpenClaw's does.
pub(crate) fn read(envelope: &Envelope<'_>) -> Option<OpenClaw> {
    // The common case, any other client, costs the first item and a window.
    let system = system_texts(envelope);
    let head = system.first()?;
    let head = &head[..head.len().min(MARKER_WINDOW)];
    if !MARKERS.iter().any(|marker| memmem::find(head, marker).is_some()) {
        return None;
    }
    // The system prompt first: on Messages and Responses the line is
    // there, and a user message that quotes one does not win over it.
    let line = system.iter().rev().find_map(|text| runtime_line(text)).or_else(|| {
        first_user_texts(envelope)
            .iter()
            .rev()
            .find_map(|text| runtime_line(text))
    });
    Some(line.map(|line| parse_runtime(&line)).unwrap_or_default())
}

/// The conversation's items: `messages` (Chat Completions, Messages) or
/// `input` (Responses).
fn items<'a>(envelope: &Envelope<'a>) -> Option<&'a [u8]> {
    envelope.raw("messages").or_else(|| envelope.raw("input"))
}

/// The raw JSON texts of the system prompt: `system` (Messages),
/// `instructions` (Responses), else a leading `system` or `developer`
/// item (Chat Completions, and Responses without `instructions`).
fn system_texts<'a>(envelope: &Envelope<'a>) -> Vec<&'a [u8]> {
    if let Some(raw) = envelope.raw("system").or_else(|| envelope.raw("instructions")) {
        return texts(raw);
    }
    let Some(first) = items(envelope).and_then(|raw| elements(raw, 1).into_iter().next()) else {
        return Vec::new();
    };
    match role_and_content(first) {
        (Some(b"\"system\"" | b"\"developer\""), Some(content)) => texts(content),
        _ => Vec::new(),
    }
}

/// The raw JSON texts of the first user message among the first
/// [`MAX_ITEMS`] items.
fn first_user_texts<'a>(envelope: &Envelope<'a>) -> Vec<&'a [u8]> {
    let Some(raw) = items(envelope) else {
        return Vec::new();
    };
    let (mut found, mut seen) = (Vec::new(), 0);
    let _ = scan::for_each_element(raw, 0..raw.len(), |item| {
        if let (Some(b"\"user\""), content) = role_and_content(&raw[item]) {
            found = content.map(texts).unwrap_or_default();
            return false;
        }
        seen += 1;
        seen < MAX_ITEMS
    });
    found
}

/// The first `max` elements of the raw JSON array `raw` (fewer if it is
/// malformed or cut: those before the fault).
fn elements(raw: &[u8], max: usize) -> Vec<&[u8]> {
    let mut found = Vec::new();
    let _ = scan::for_each_element(raw, 0..raw.len(), |element| {
        found.push(&raw[element]);
        found.len() < max
    });
    found
}

/// The raw `role` and `content` of a message or input item.
fn role_and_content(item: &[u8]) -> (Option<&[u8]>, Option<&[u8]>) {
    let (mut role, mut content) = (None, None);
    let _ = scan::for_each_member(item, 0..item.len(), |key, value| match &item[key] {
        b"role" => role = Some(&item[value]),
        b"content" => content = Some(&item[value]),
        _ => {}
    });
    (role, content)
}

/// The raw JSON strings of a content value: the string itself, or the
/// `text` of each of its first parts (Anthropic `text` blocks, Responses
/// `input_text` parts, Chat `text` parts).
fn texts(raw: &[u8]) -> Vec<&[u8]> {
    match raw.first() {
        Some(b'"') => vec![raw],
        Some(b'[') => elements(raw, MAX_PARTS)
            .into_iter()
            .filter_map(|part| {
                let mut text = None;
                let _ = scan::for_each_member(part, 0..part.len(), |key, value| {
                    if &part[key] == b"text" && part.get(value.start) == Some(&b'"') {
                        text = Some(&part[value]);
                    }
                });
                text
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// The last `Runtime:` line in the tail of the raw JSON string `text`,
/// decoded.
fn runtime_line(text: &[u8]) -> Option<String> {
    // Without its closing quote (a string cut with the body keeps its end).
    let inner = text.strip_suffix(b"\"").unwrap_or(text);
    let tail = &inner[inner.len().saturating_sub(RUNTIME_WINDOW)..];
    let at = memmem::rfind(tail, RUNTIME)?;
    // From the `R` on, the raw bytes are a whole JSON string's content (no
    // escape is cut): quoted, they decode as one, escapes and all.
    let mut quoted = Vec::with_capacity(tail.len() - at + 2);
    quoted.push(b'"');
    quoted.extend_from_slice(&tail[at..]);
    quoted.push(b'"');
    let decoded: String = serde_json::from_slice(&quoted).ok()?;
    decoded.lines().next().map(str::to_owned)
}

/// The fields of a `Runtime:` line (`key=value` separated by `|`).
fn parse_runtime(line: &str) -> OpenClaw {
    let mut found = OpenClaw::default();
    for field in line.split('|').map(str::trim) {
        if let Some(id) = field.strip_prefix("sessionId=") {
            // The first one counts, as the first source does.
            if found.session_id.is_empty() {
                found.session_id = id.trim().to_owned();
            }
        } else if let Some(key) = field.strip_prefix("session=") {
            found.subagent |= key.starts_with("agent:") && key.contains(":subagent:");
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_body(body: &str) -> Option<OpenClaw> {
        let envelope = Envelope::parse(body.as_bytes(), false).ok()?;
        read(&envelope)
    }

    const SYSTEM: &str =
        "<!-- openclaw:attempt:STABLE -->\\nYou are a personal assistant running inside OpenClaw.\\n## Tooling";

    #[test]
    fn the_runtime_line_is_read_where_each_api_puts_it() {
        let line = "Runtime: agent=main | session=agent:main:main | sessionId=abc-1 | host=vm | shell=bash";
        let chat = format!(
            r#"{{"messages":[{{"role":"system","content":"{SYSTEM}"}},{{"role":"user","content":"[Thu] hi\n\n{line}"}}]}}"#
        );
        let messages = format!(
            r#"{{"system":[{{"type":"text","text":"{SYSTEM}"}},{{"type":"text","text":"x\n{line}\n<!-- /openclaw:attempt:DYNAMIC -->"}}],"messages":[{{"role":"user","content":"hi"}}]}}"#
        );
        let responses = format!(
            r#"{{"input":[{{"type":"message","role":"system","content":[{{"type":"input_text","text":"{SYSTEM}\n{line}"}}]}}]}}"#
        );
        let instructions = format!(r#"{{"instructions":"{SYSTEM}\n{line}","input":"hi"}}"#);
        for body in [chat, messages, responses, instructions] {
            let found = read_body(&body).unwrap_or_else(|| panic!("not OpenClaw: {body}"));
            assert_eq!(found.session_id, "abc-1", "{body}");
            assert!(!found.subagent);
        }
    }

    #[test]
    fn a_prompt_without_the_marker_is_not_read() {
        let line = "Runtime: agent=main | session=agent:main:main | sessionId=abc-1";
        let body = format!(
            r#"{{"messages":[{{"role":"system","content":"You help."}},{{"role":"user","content":"{line}"}}]}}"#
        );
        assert_eq!(read_body(&body), None);
        // The marker counts only at the start of the system prompt.
        let late = format!(
            r#"{{"messages":[{{"role":"system","content":"{}{SYSTEM}"}},{{"role":"user","content":"{line}"}}]}}"#,
            "x".repeat(MARKER_WINDOW)
        );
        assert_eq!(read_body(&late), None);
    }

    #[test]
    fn the_last_runtime_line_of_the_tail_wins_and_escapes_decode() {
        // A user who quotes a Runtime line before OpenClaw appends its own.
        let body = format!(
            r#"{{"messages":[{{"role":"system","content":"{SYSTEM}"}},{{"role":"user","content":"Runtime: agent=x | sessionId=quoted\n\nRuntime: agent=main | session=agent:main:subagent:9f | sessionId=s\u0031 | repo=C:\\x"}}]}}"#
        );
        let found = read_body(&body).unwrap();
        assert_eq!(found.session_id, "s1");
        assert!(found.subagent);
    }

    #[test]
    fn a_line_past_the_window_or_without_a_session_is_no_session() {
        let far = format!(
            r#"{{"messages":[{{"role":"system","content":"{SYSTEM}"}},{{"role":"user","content":"Runtime: agent=main | sessionId=early\n{}"}}]}}"#,
            "y".repeat(RUNTIME_WINDOW)
        );
        assert_eq!(read_body(&far), Some(OpenClaw::default()));
        let bare = format!(
            r#"{{"messages":[{{"role":"system","content":"{SYSTEM}"}},{{"role":"user","content":"Runtime: agent=main | session=agent:main:main | sessionId= | host=vm"}}]}}"#
        );
        assert_eq!(read_body(&bare), Some(OpenClaw::default()));
    }

    #[test]
    fn malformed_shapes_are_no_signal_never_a_panic() {
        for body in [
            r#"{"messages":7}"#,
            r#"{"messages":[7,"x",null]}"#,
            r#"{"system":{"text":"openclaw:attempt:STABLE"}}"#,
            r#"{"system":[{"text":7}]}"#,
            r#"{"messages":[{"role":"system","content":[{"type":"text","text":"openclaw:attempt:STABLE"}]},{"role":"user","content":"Runtime: agent=\u00"}]}"#,
        ] {
            let _ = read_body(body);
        }
        // A body cut by the parse cap: a whole first user message is read,
        // a cut one is not (its id could be cut short).
        let whole = format!(
            r#"{{"messages":[{{"role":"system","content":"{SYSTEM}"}},{{"role":"user","content":"Runtime: agent=main | sessionId=cut-1"}},{{"role":"assistant","content":"lo"#
        );
        let envelope = Envelope::parse(whole.as_bytes(), true).unwrap();
        assert_eq!(read(&envelope).map(|o| o.session_id), Some("cut-1".to_owned()));
        let cut = &whole[..whole.find("cut-1").unwrap() + 3];
        let envelope = Envelope::parse(cut.as_bytes(), true).unwrap();
        assert_eq!(read(&envelope), Some(OpenClaw::default()));
    }
}
