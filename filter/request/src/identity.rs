//! Who a request belongs to: session, agent, parent and tenant ids, read from
//! the ordered sources of the plugin configuration, the harness that sent it,
//! and the scheduling hints a request carries.

mod openclaw;

use std::cell::OnceCell;

use serde_json::Value;
use sha2::{Digest, Sha256};

use kvmesh_vocab::limits::{MAX_ID_BYTES, clip};
use kvmesh_vocab::{Harness, PARENT_BY_TRACE_PREFIX};

use crate::FilterConfig;
use crate::canonical::Envelope;
use crate::config::IdSource;

/// Read access to request headers by lowercase name.
///
/// Header values are bytes: HTTP allows any octet but controls in a value,
/// and a client can send `\xff`. Only [`Headers::bytes`] is required; text
/// reads ([`Headers::get`]) see a value that is not UTF-8 as absent, so a
/// hostile value is never an id, and never a panic.
pub trait Headers {
    /// The raw value of the first header named `name` (ASCII, any case).
    fn bytes(&self, name: &str) -> Option<&[u8]>;

    /// The value as text, `None` if absent or not UTF-8.
    fn get(&self, name: &str) -> Option<&str> {
        self.bytes(name).and_then(|v| std::str::from_utf8(v).ok())
    }
}

/// Headers as the filter reads them from Envoy: names (which Envoy's codecs
/// only accept as HTTP tokens) with byte values.
impl Headers for [(String, Vec<u8>)] {
    fn bytes(&self, name: &str) -> Option<&[u8]> {
        self.iter()
            .find(|(key, _)| key.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_slice())
    }
}

impl Headers for Vec<(String, Vec<u8>)> {
    fn bytes(&self, name: &str) -> Option<&[u8]> {
        Headers::bytes(self.as_slice(), name)
    }
}

/// Text headers, as tests and the simulator build them.
impl Headers for [(String, String)] {
    fn bytes(&self, name: &str) -> Option<&[u8]> {
        self.iter()
            .find(|(key, _)| key.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_bytes())
    }
}

impl Headers for Vec<(String, String)> {
    fn bytes(&self, name: &str) -> Option<&[u8]> {
        Headers::bytes(self.as_slice(), name)
    }
}

/// Reads the harness from the request headers. An explicit
/// `x-kvmesh-harness` wins (for agents kvmesh cannot recognise). OpenClaw
/// sends no header of its own: [`identify`] recognises it by its prompt.
pub fn detect_harness(headers: &impl Headers) -> Harness {
    harness_from_headers(headers).unwrap_or(Harness::Other)
}

/// The harness the headers name or show, `None` when they say nothing.
fn harness_from_headers(headers: &impl Headers) -> Option<Harness> {
    if let Some(declared) = headers.get("x-kvmesh-harness") {
        return Some(Harness::from_name(declared));
    }
    let agent = headers.get("user-agent").unwrap_or_default().to_ascii_lowercase();
    let originator = headers.get("originator").unwrap_or_default();
    // `claude-cli/<ver> (external, cli | sdk-cli)` (2.1.197); `originator:
    // codex_exec` / `codex-tui` (0.171.0), `codex_cli_rs` (0.58.0); OpenCode
    // `opencode/<ver> ai-sdk/…` (1.18.33). OpenClaw 2026.9.6 sends its SDK's
    // user agent (`OpenAI/JS`, `undici`), which names no harness.
    if agent.starts_with("claude-cli/") || headers.get("x-claude-code-session-id").is_some() {
        Some(Harness::ClaudeCode)
    } else if originator.starts_with("codex") || agent.starts_with("codex") {
        Some(Harness::Codex)
    } else if agent.starts_with("opencode/") || headers.get("x-opencode-session").is_some() {
        Some(Harness::OpenCode)
    } else if agent.contains("openclaw") {
        Some(Harness::OpenClaw)
    } else {
        None
    }
}

/// The ids of one request. Empty strings mean "not given".
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Identity {
    /// The conversation (for Claude Code and Codex, shared by its subagents).
    pub session_id: String,
    /// A subagent's own id within the session.
    pub agent_id: String,
    /// A subagent's parent: its parent agent, else the session.
    pub parent_id: String,
    pub tenant: String,
    /// `x-dynamo-session-final: true`: the session ends with this request.
    pub session_final: bool,
    pub harness: Harness,
    /// The trace id of the W3C `traceparent` (32 lowercase hex digits),
    /// empty when absent or malformed. OpenClaw's subagent calls carry the
    /// trace id of the parent turn that spawned them.
    pub trace_id: String,
}

/// Scheduling hints of one request.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Hints {
    /// kvmesh's priority (higher is sooner, clamped to
    /// `MIN_PRIORITY..=MAX_PRIORITY`): the priority header, else
    /// `nvext.agent_hints.priority`, else, with `priority_field`
    /// configured, the class of the request's harness and role.
    pub priority: Option<i32>,
    /// Client priorities ignored (not an integer, or outside i32), and
    /// whether the one used was clamped: the filter counts both.
    pub priority_dropped: u8,
    pub priority_clamped: bool,
    /// The longest retention horizon the request declares, in seconds
    /// (Anthropic `cache_control` TTLs, OpenAI `prompt_cache_retention`),
    /// at most `MAX_RETENTION_HORIZON_S`.
    pub retention_horizon_s: Option<u32>,
}

/// What one request offers its id sources. The OpenClaw prompt is read at
/// most once, and only when a source or the harness needs it.
struct Request<'r, 'a, H> {
    headers: &'r H,
    envelope: &'r Envelope<'a>,
    trace_id: &'r str,
    openclaw: OnceCell<Option<openclaw::OpenClaw>>,
}

impl<H: Headers> Request<'_, '_, H> {
    fn openclaw(&self) -> Option<&openclaw::OpenClaw> {
        self.openclaw.get_or_init(|| openclaw::read(self.envelope)).as_ref()
    }
}

fn read<H: Headers>(source: &IdSource, request: &Request<'_, '_, H>, session: &str) -> Option<String> {
    let (headers, envelope) = (request.headers, request.envelope);
    let found = match source {
        IdSource::Header(name) => headers.get(name).map(|v| v.trim().to_owned()),
        IdSource::Body(pointer) => body_string(envelope, pointer),
        IdSource::ClaudeUserId => envelope
            .value("metadata")
            .and_then(|m| m.get("user_id").and_then(Value::as_str).and_then(session_from_user_id)),
        IdSource::CodexThread => headers
            .get("thread-id")
            .map(str::trim)
            .filter(|thread| *thread != session)
            .map(str::to_owned),
        IdSource::OpenClawRuntime => request.openclaw().map(|found| found.session_id.clone()),
        IdSource::OpenClawParentTrace => request
            .openclaw()
            .filter(|found| found.subagent && !request.trace_id.is_empty())
            .map(|_| format!("{PARENT_BY_TRACE_PREFIX}{}", request.trace_id)),
    };
    found.filter(|id| !id.is_empty()).map(|id| bounded_id(&id))
}

/// A string at a JSON pointer of the body. The first segment is found by the
/// scanner; only that member is parsed, and only when the pointer goes deeper.
fn body_string(envelope: &Envelope<'_>, pointer: &str) -> Option<String> {
    let rest = pointer.strip_prefix('/')?;
    let (first, deeper) = rest.split_once('/').map_or((rest, None), |(f, d)| (f, Some(d)));
    let key = first.replace("~1", "/").replace("~0", "~");
    match deeper {
        None => envelope.string(&key).map(|s| s.into_owned()),
        Some(deeper) => envelope
            .value(&key)?
            .pointer(&format!("/{deeper}"))
            .and_then(Value::as_str)
            .map(str::to_owned),
    }
}

/// Claude Code's `metadata.user_id`: `user_<hash>_account_<uuid>_session_<uuid>`
/// up to v2.1.77, a JSON string with `session_id` since v2.1.78.
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

fn first<H: Headers>(sources: &[IdSource], request: &Request<'_, '_, H>, session: &str) -> String {
    sources
        .iter()
        .find_map(|source| read(source, request, session))
        .unwrap_or_default()
}

/// Reads the ids of a request from its headers and body.
pub fn identify(headers: &impl Headers, envelope: &Envelope<'_>, config: &FilterConfig) -> Identity {
    let trace_id = trace_id(headers);
    let request = Request {
        headers,
        envelope,
        trace_id: &trace_id,
        openclaw: OnceCell::new(),
    };
    let session_id = first(&config.session_sources, &request, "");
    let agent_id = first(&config.agent_sources, &request, &session_id);
    let mut parent_id = first(&config.parent_sources, &request, &session_id);
    // A subagent with no parent header descends from its session (Dynamo's
    // mapping of Claude Code and Codex).
    if parent_id.is_empty() && !agent_id.is_empty() {
        parent_id = session_id.clone();
    }
    // The headers first: a harness they name never costs a prompt scan,
    // and no other harness's label can move to OpenClaw.
    let harness = harness_from_headers(headers).unwrap_or_else(|| {
        if request.openclaw().is_some() {
            Harness::OpenClaw
        } else {
            Harness::Other
        }
    });
    Identity {
        harness,
        tenant: tenant(headers, config),
        session_final: headers
            .get("x-dynamo-session-final")
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("true")),
        trace_id,
        session_id,
        agent_id,
        parent_id,
    }
}

/// The trace id of a W3C `traceparent` (`00-<32 hex>-<16 hex>-<2 hex>`),
/// lowercase; empty when the header is absent, malformed or all zeros (an
/// invalid trace id by the spec).
fn trace_id(headers: &impl Headers) -> String {
    let Some(value) = headers.bytes("traceparent") else {
        return String::new();
    };
    let mut parts = value.trim_ascii().split(|b| *b == b'-');
    let (Some(version), Some(trace), Some(span)) = (parts.next(), parts.next(), parts.next()) else {
        return String::new();
    };
    let hex = |part: &[u8], len: usize| part.len() == len && part.iter().all(u8::is_ascii_hexdigit);
    if !hex(version, 2) || !hex(trace, 32) || !hex(span, 16) || trace.iter().all(|b| *b == b'0') {
        return String::new();
    }
    trace.iter().map(|b| char::from(b.to_ascii_lowercase())).collect()
}

/// Reads the scheduling hints of a request of `identity` (its role picks
/// its class priority). The retention horizon is the canonical stream's to
/// fill: its markers are read as the stream is built.
pub fn hints(headers: &impl Headers, envelope: &Envelope<'_>, config: &FilterConfig, identity: &Identity) -> Hints {
    let agent_hints = envelope
        .value("nvext")
        .and_then(|nvext| nvext.get("agent_hints").cloned())
        .unwrap_or(Value::Null);
    let priority = crate::priority::read(
        headers,
        &config.priority_header,
        &agent_hints,
        identity,
        config.priority_field.as_ref(),
    );
    Hints {
        priority: priority.value,
        priority_dropped: priority.dropped,
        priority_clamped: priority.clamped,
        retention_horizon_s: None,
    }
}

/// The tenant: the tenant header when the operator trusts it (a hop in
/// front, such as a gateway, sets it after authenticating the caller and
/// strips what clients send), else a hash of the credential (never the key
/// itself), else empty. A client cannot name another tenant: by default its
/// header is not read (and the filter removes it).
pub(crate) fn tenant(headers: &impl Headers, config: &FilterConfig) -> String {
    if config.trust_tenant_header
        && let Some(tenant) = headers
            .get(&config.tenant_header)
            .map(str::trim)
            .filter(|t| !t.is_empty())
    {
        return bounded_id(tenant);
    }
    ["authorization", "x-api-key"]
        .iter()
        .find_map(|name| headers.bytes(name).filter(|v| !v.is_empty()))
        .map(|credential| {
            let digest = Sha256::digest(credential);
            let mut id = String::from("key:");
            for byte in &digest[..8] {
                id.push_str(&format!("{byte:02x}"));
            }
            id
        })
        .unwrap_or_default()
}

/// Bytes of the hash suffix of a bounded id: `#` and 16 hex digits.
const ID_HASH_SUFFIX_BYTES: usize = 17;

/// `id` itself when it fits [`MAX_ID_BYTES`]; else its first bytes and a
/// hash of the whole, `MAX_ID_BYTES` long at most. Ids are keys, not
/// payload, and two long ids that share their first 239 bytes stay distinct.
pub fn bounded_id(id: &str) -> String {
    if id.len() <= MAX_ID_BYTES {
        return id.to_owned();
    }
    let hash = xxhash_rust::xxh3::xxh3_64(id.as_bytes());
    format!("{}#{hash:016x}", clip(id, MAX_ID_BYTES - ID_HASH_SUFFIX_BYTES))
}
