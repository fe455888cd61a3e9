//! The canonical prefix stream: the prompt-bearing parts of a request in the
//! order a chat template puts them (tools, system, then each message), so that
//! a conversation that grows by appending keeps every earlier byte in place.
//!
//! Fields that never reach the prompt (`stream`, `temperature`, `max_tokens`,
//! `metadata`, ...) are not read. Object keys serialize sorted, so a client
//! that reorders keys between calls does not break its own prefix.

use serde_json::Value;

/// The inference APIs the filter understands. Other paths pass through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// OpenAI `/v1/chat/completions`.
    ChatCompletions,
    /// OpenAI `/v1/completions`.
    Completions,
    /// OpenAI `/v1/responses`.
    Responses,
    /// Anthropic `/v1/messages`.
    Messages,
}

impl Api {
    /// The API served at `path` (query string ignored), if any.
    pub fn from_path(path: &str) -> Option<Self> {
        let path = path.split_once('?').map_or(path, |(p, _)| p);
        match path.trim_end_matches('/') {
            "/v1/chat/completions" | "/chat/completions" => Some(Self::ChatCompletions),
            "/v1/completions" | "/completions" => Some(Self::Completions),
            "/v1/responses" | "/responses" => Some(Self::Responses),
            "/v1/messages" | "/messages" => Some(Self::Messages),
            _ => None,
        }
    }

    /// Stable lowercase name, for logs and metrics.
    pub fn name(self) -> &'static str {
        match self {
            Self::ChatCompletions => "chat_completions",
            Self::Completions => "completions",
            Self::Responses => "responses",
            Self::Messages => "messages",
        }
    }
}

/// A JSON body that is not the shape its API requires.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CanonicalError {
    #[error("body is not a JSON object")]
    NotAnObject,
    #[error("`{0}` is missing or has the wrong type")]
    MissingField(&'static str),
}

// Separators that cannot appear in serialized JSON or in its raw strings'
// structure, so sections and messages cannot run into each other.
const SECTION: u8 = 0x1e;
const FIELD: u8 = 0x1f;

/// Builds the canonical stream of `body` for `api`.
pub fn canonical_stream(api: Api, body: &Value) -> Result<Vec<u8>, CanonicalError> {
    let body = body.as_object().ok_or(CanonicalError::NotAnObject)?;
    let mut out = Vec::with_capacity(4096);
    match api {
        Api::ChatCompletions => {
            section(&mut out, "tools", body.get("tools"));
            push_messages(&mut out, body)?;
        }
        Api::Completions => match body.get("prompt") {
            Some(prompt @ (Value::String(_) | Value::Array(_))) => section(&mut out, "prompt", Some(prompt)),
            _ => return Err(CanonicalError::MissingField("prompt")),
        },
        Api::Responses => {
            section(&mut out, "tools", body.get("tools"));
            section(&mut out, "instructions", body.get("instructions"));
            match body.get("input") {
                Some(Value::Array(items)) => items.iter().for_each(|item| push_message(&mut out, item)),
                Some(text @ Value::String(_)) => section(&mut out, "input", Some(text)),
                None => {}
                Some(_) => return Err(CanonicalError::MissingField("input")),
            }
        }
        Api::Messages => {
            section(&mut out, "tools", body.get("tools"));
            section(&mut out, "system", body.get("system"));
            push_messages(&mut out, body)?;
        }
    }
    Ok(out)
}

/// The `messages` array both chat APIs require.
fn push_messages(out: &mut Vec<u8>, body: &serde_json::Map<String, Value>) -> Result<(), CanonicalError> {
    let messages = body
        .get("messages")
        .and_then(Value::as_array)
        .ok_or(CanonicalError::MissingField("messages"))?;
    for message in messages {
        push_message(out, message);
    }
    Ok(())
}

fn section(out: &mut Vec<u8>, name: &str, value: Option<&Value>) {
    let Some(value) = value.filter(|v| !v.is_null()) else {
        return;
    };
    out.push(SECTION);
    out.extend_from_slice(name.as_bytes());
    out.push(FIELD);
    push_value(out, value);
}

/// A message: its role, then its content, then anything else it carries
/// (tool calls, tool call ids, names), in sorted key order.
fn push_message(out: &mut Vec<u8>, message: &Value) {
    out.push(SECTION);
    let Some(fields) = message.as_object() else {
        push_value(out, message);
        return;
    };
    if let Some(role) = fields.get("role") {
        push_value(out, role);
    }
    out.push(FIELD);
    if let Some(content) = fields.get("content") {
        push_value(out, content);
    }
    for (key, value) in fields {
        if key == "role" || key == "content" || value.is_null() {
            continue;
        }
        out.push(FIELD);
        out.extend_from_slice(key.as_bytes());
        out.push(FIELD);
        push_value(out, value);
    }
}

/// Strings go in raw (their bytes approximate what the engine tokenizes);
/// anything else as compact JSON with sorted keys.
fn push_value(out: &mut Vec<u8>, value: &Value) {
    match value {
        Value::String(text) => out.extend_from_slice(text.as_bytes()),
        other => {
            // Serializing a `Value` into a Vec cannot fail.
            let _ = serde_json::to_writer(&mut *out, other);
        }
    }
}
