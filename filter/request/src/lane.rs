//! Which lane of its session a request is: the conversation itself, a side
//! call beside it (a title, a summary, a small model's call), or a call that
//! compacts it. Side calls share the session id but not its prompt: counted
//! in the main lane, each one reads as a prefix break and a move.
//!
//! Everything kvmesh knows of how each harness marks these calls is here,
//! with the CLI version it was seen in (captures in
//! `tests/real-harnesses/`, explained per harness in docs/harnesses/):
//!
//! | harness | call | what marks it | seen in |
//! |---|---|---|---|
//! | Claude Code | title | `tools: []` (plus `output_config.format`, a `{title}` schema) | 2.1.197 |
//! | Codex | title thread | `x-codex-turn-metadata` `thread_source: thread_title` | 0.171.0 |
//! | Codex | `/compact` | `x-codex-turn-metadata` `request_kind: compaction` (mirrored in `client_metadata`) | 0.171.0 |
//! | Codex | compaction | `x-openai-subagent: compact` | documented (HARNESSES.md), not seen in 0.171.0 |
//! | OpenCode | title | no tools, on its `small_model`, on all three APIs | 1.18.33 |
//! | OpenClaw | none seen | | 2026.9.6 |
//!
//! Hence the rules: Codex's turn metadata, which says what a call is,
//! decides first, whatever the harness label; then a recognised harness's
//! call that declares no tools at all is a side call, since every one of
//! their main-lane and subagent calls declares tools (Codex 0.171.0 in an
//! `additional_tools` input item rather than `tools`). A harness kvmesh does
//! not recognise stays in the main lane: a client without tools may well be
//! a plain chat.
//!
//! Claude Code's `output_config.format` alone is not taken as a side call:
//! SDK clients may ask for structured output on main-lane calls with tools
//! (inferred, not seen).
//!
//! Headers are read as bytes: one that is not UTF-8 or not JSON is no
//! signal. Parsed JSON is bounded ([`MAX_METADATA_BYTES`]).

use kvmesh_vocab::{Harness, Lane};
use serde::Deserialize;

use crate::canonical::Envelope;
use crate::identity::{Headers, Identity};
use crate::scan;

/// The most bytes of turn metadata (header, or `client_metadata` member)
/// parsed; Codex 0.171.0 sends under 1 KB.
const MAX_METADATA_BYTES: usize = 16 * 1024;
/// Leading input items looked at for Codex's `additional_tools` item (it
/// is the first in 0.171.0).
const MAX_TOOL_ITEMS: usize = 8;

/// The lane of one request.
pub(crate) fn classify(headers: &impl Headers, envelope: &Envelope<'_>, identity: &Identity) -> Lane {
    if let Some(lane) = codex_turn_lane(headers, envelope) {
        return lane;
    }
    // Older Codex labels its compaction call's subagent (HARNESSES.md).
    if headers
        .bytes("x-openai-subagent")
        .is_some_and(|kind| kind.trim_ascii().eq_ignore_ascii_case(b"compact"))
    {
        return Lane::Compaction;
    }
    match identity.harness {
        Harness::Other => Lane::Main,
        Harness::ClaudeCode | Harness::Codex | Harness::OpenCode | Harness::OpenClaw => {
            if declares_no_tools(envelope) {
                Lane::Side
            } else {
                Lane::Main
            }
        }
    }
}

/// The fields of Codex's `x-codex-turn-metadata` that name a lane; the
/// others (ids, sandbox, workspace) are skipped unparsed.
#[derive(Deserialize)]
struct TurnMetadata {
    #[serde(default)]
    request_kind: Option<String>,
    #[serde(default)]
    thread_source: Option<String>,
}

/// The `client_metadata` member Codex mirrors the turn metadata into.
#[derive(Deserialize)]
struct ClientMetadata {
    #[serde(rename = "x-codex-turn-metadata", default)]
    turn: Option<String>,
}

/// The lane Codex's turn metadata names: from the header, else (header
/// absent or unreadable) from its mirror in the body's `client_metadata`.
/// `None` for a main-lane turn, or no readable metadata.
fn codex_turn_lane(headers: &impl Headers, envelope: &Envelope<'_>) -> Option<Lane> {
    let metadata = headers
        .bytes("x-codex-turn-metadata")
        .and_then(bounded_object::<TurnMetadata>)
        .or_else(|| {
            let mirror: ClientMetadata = bounded_object(envelope.raw("client_metadata")?)?;
            bounded_object(mirror.turn?.as_bytes())
        })?;
    if metadata.request_kind.as_deref() == Some("compaction") {
        Some(Lane::Compaction)
    } else if metadata.thread_source.as_deref() == Some("thread_title") {
        // Codex 0.171.0's title thread has its own session id, and its own
        // tools: only this field says it is a side call.
        Some(Lane::Side)
    } else {
        None
    }
}

/// A JSON object of at most [`MAX_METADATA_BYTES`] bytes, parsed as `T`.
fn bounded_object<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Option<T> {
    // Serde's derived structs also accept an array of their fields in
    // order: `["compaction"]` is no metadata.
    if bytes.len() > MAX_METADATA_BYTES || bytes.trim_ascii_start().first() != Some(&b'{') {
        return None;
    }
    serde_json::from_slice(bytes).ok()
}

/// The request declares no tools: `tools` (and the legacy Chat
/// `functions`) absent, `null` or `[]`, and no Codex `additional_tools`
/// input item.
fn declares_no_tools(envelope: &Envelope<'_>) -> bool {
    // A body cut at the parse cap may declare its tools after the cut (Chat
    // Completions clients often put `tools` after `messages`): unknown is
    // not none.
    if envelope.truncated() {
        return false;
    }
    let none = |key: &str| envelope.raw(key).is_none_or(is_null_or_empty_array);
    none("tools") && none("functions") && !has_additional_tools(envelope)
}

fn is_null_or_empty_array(raw: &[u8]) -> bool {
    raw == b"null"
        || raw
            .strip_prefix(b"[")
            .and_then(|rest| rest.strip_suffix(b"]"))
            .is_some_and(|inside| inside.iter().all(u8::is_ascii_whitespace))
}

/// One of the first input items is Codex's `{"type":"additional_tools",…}`
/// (0.171.0 with a code-mode model sends its tools there, not in `tools`).
fn has_additional_tools(envelope: &Envelope<'_>) -> bool {
    let Some(input) = envelope.raw("input").filter(|raw| raw.first() == Some(&b'[')) else {
        return false;
    };
    let (mut found, mut seen) = (false, 0);
    let _ = scan::for_each_element(input, 0..input.len(), |item| {
        let _ = scan::for_each_member(input, item, |key, value| {
            found |= &input[key] == b"type" && &input[value] == b"\"additional_tools\"";
        });
        seen += 1;
        !found && seen < MAX_TOOL_ITEMS
    });
    found
}
