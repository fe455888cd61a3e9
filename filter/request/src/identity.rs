//! Who a request belongs to: session, agent, parent and tenant ids, read from
//! the ordered header and body sources of the plugin configuration.

use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::FilterConfig;

/// Read access to request headers by lowercase name.
pub trait Headers {
    fn get(&self, name: &str) -> Option<&str>;
}

impl Headers for [(String, String)] {
    fn get(&self, name: &str) -> Option<&str> {
        self.iter()
            .find(|(key, _)| key.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_str())
    }
}

impl Headers for Vec<(String, String)> {
    fn get(&self, name: &str) -> Option<&str> {
        Headers::get(self.as_slice(), name)
    }
}

/// The ids of one request. Empty strings mean "not given".
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Identity {
    pub session_id: String,
    pub agent_id: String,
    pub parent_id: String,
    pub tenant: String,
    /// `x-dynamo-session-final: true`: the session ends with this request.
    pub session_final: bool,
}

/// Longest id kept; longer values are cut (ids are keys, not payload).
const MAX_ID_BYTES: usize = 256;

/// Reads the ids of a request from its headers and parsed body.
pub fn identify(headers: &impl Headers, body: &Value, config: &FilterConfig) -> Identity {
    let session_id = first_header(headers, &config.session_headers)
        .map(str::to_owned)
        .or_else(|| session_from_body(body))
        .unwrap_or_default();
    let mut agent_id = first_header(headers, &config.agent_headers)
        .unwrap_or_default()
        .to_owned();
    // Codex sends `thread-id` on every call; it only names a subagent when it
    // differs from the root's `session-id`.
    if agent_id.is_empty()
        && let Some(thread) = headers.get("thread-id")
        && thread != session_id
    {
        agent_id = thread.to_owned();
    }
    let parent_id = first_header(headers, &config.parent_headers).unwrap_or_default();
    let tenant = tenant(headers, config);
    Identity {
        session_id: clip(&session_id),
        agent_id: clip(&agent_id),
        parent_id: clip(parent_id),
        tenant,
        session_final: headers
            .get("x-dynamo-session-final")
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("true")),
    }
}

fn first_header<'h>(headers: &'h impl Headers, names: &[String]) -> Option<&'h str> {
    names
        .iter()
        .filter_map(|name| headers.get(name))
        .map(str::trim)
        .find(|value| !value.is_empty())
}

/// Body sources, in order: `prompt_cache_key`, the session part of Anthropic
/// `metadata.user_id` (both its legacy string and its JSON-string form), `user`.
fn session_from_body(body: &Value) -> Option<String> {
    fn text(v: Option<&Value>) -> Option<&str> {
        v.and_then(Value::as_str).filter(|s| !s.is_empty())
    }
    text(body.get("prompt_cache_key"))
        .map(str::to_owned)
        .or_else(|| {
            let user_id = text(body.get("metadata").and_then(|m| m.get("user_id")))?;
            session_from_user_id(user_id)
        })
        .or_else(|| text(body.get("user")).map(str::to_owned))
}

fn session_from_user_id(user_id: &str) -> Option<String> {
    if let Some((_, session)) = user_id.rsplit_once("_session_") {
        return (!session.is_empty()).then(|| session.to_owned());
    }
    let parsed: Value = serde_json::from_str(user_id).ok()?;
    parsed
        .get("session_id")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
}

/// The tenant header if present, else a hash of the credential (never the key
/// itself), else empty.
fn tenant(headers: &impl Headers, config: &FilterConfig) -> String {
    if let Some(tenant) = headers.get(&config.tenant_header).filter(|t| !t.is_empty()) {
        return clip(tenant);
    }
    ["authorization", "x-api-key"]
        .iter()
        .find_map(|name| headers.get(name).filter(|v| !v.is_empty()))
        .map(|credential| {
            let digest = Sha256::digest(credential.as_bytes());
            let mut id = String::from("key:");
            for byte in &digest[..8] {
                id.push_str(&format!("{byte:02x}"));
            }
            id
        })
        .unwrap_or_default()
}

fn clip(id: &str) -> String {
    if id.len() <= MAX_ID_BYTES {
        return id.to_owned();
    }
    let mut end = MAX_ID_BYTES;
    while !id.is_char_boundary(end) {
        end -= 1;
    }
    id[..end].to_owned()
}
