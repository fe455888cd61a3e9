//! The filter's JSON plugin configuration, parsed and validated once in
//! `on_configure`. Errors name the offending field so Envoy's log says what
//! to fix.

use kvmesh_vocab::limits::{MAX_BLOCK_BYTES, MAX_BLOCKS, MIN_BLOCK_BYTES};
use serde::Deserialize;

use crate::hashing::BlockHash;
use crate::priority::PriorityField;

/// Where an id is read from. Written in the configuration as a string:
/// `header:<name>`, `body:<json pointer>`, `claude_user_id` (the session part
/// of Anthropic `metadata.user_id`, in its legacy and JSON-string forms),
/// `codex_thread` (Codex's `thread-id` header when it differs from the
/// session id: only subagents send a different one), `openclaw_runtime` or
/// `openclaw_parent_trace`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(try_from = "String")]
pub enum IdSource {
    Header(String),
    Body(String),
    ClaudeUserId,
    CodexThread,
    /// The `sessionId=` of the `Runtime:` line OpenClaw writes into its
    /// prompt, read only from a prompt that carries OpenClaw's marker:
    /// OpenClaw sends no session header by default.
    OpenClawRuntime,
    /// For an OpenClaw subagent (session key `agent:<agent>:subagent:<uuid>`
    /// in its `Runtime:` line), `trace:<trace id>` of its `traceparent`:
    /// nothing else in its requests names the turn that spawned it, and the
    /// sidecar resolves that trace to the parent's session.
    OpenClawParentTrace,
}

impl IdSource {
    fn parse(text: &str) -> Result<Self, String> {
        if let Some(name) = text.strip_prefix("header:") {
            if !is_header_name(name) {
                return Err(format!("{text:?}: {name:?} is not a lowercase header name"));
            }
            return Ok(Self::Header(name.to_owned()));
        }
        if let Some(pointer) = text.strip_prefix("body:") {
            if !pointer.starts_with('/') || pointer.len() < 2 {
                return Err(format!(
                    "{text:?}: a body source is a JSON pointer such as body:/prompt_cache_key"
                ));
            }
            return Ok(Self::Body(pointer.to_owned()));
        }
        match text {
            "claude_user_id" => Ok(Self::ClaudeUserId),
            "codex_thread" => Ok(Self::CodexThread),
            "openclaw_runtime" => Ok(Self::OpenClawRuntime),
            "openclaw_parent_trace" => Ok(Self::OpenClawParentTrace),
            _ => Err(format!(
                "{text:?} is not a source (header:<name>, body:<json pointer>, claude_user_id, codex_thread, \
                 openclaw_runtime, openclaw_parent_trace)"
            )),
        }
    }
}

impl TryFrom<String> for IdSource {
    type Error = String;

    fn try_from(text: String) -> Result<Self, String> {
        Self::parse(&text)
    }
}

/// Plugin configuration. Every field has a default, so `{}` is valid.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FilterConfig {
    /// Envoy cluster (HTTP/2) of the kvmesh sidecar's gRPC.
    pub sidecar_cluster: String,
    /// How long a request may wait for a Pick before failing open.
    pub sidecar_timeout_ms: u64,
    /// The sidecar's shared secret (its `--token`), sent as
    /// `authorization: Bearer <token>` on every call; empty for none.
    pub sidecar_token: String,
    /// Bytes per prefix block (256 bytes is about 64 tokens).
    pub block_bytes: usize,
    /// Most blocks hashed per request; the rest routes on what was hashed.
    pub max_blocks: usize,
    /// Most body bytes parsed; a longer body routes on its first bytes.
    pub max_body_bytes: usize,
    /// The block hash. Every Envoy of one GPU cluster must use the same.
    pub hash: BlockHash,
    /// Sources of the session id, first present wins.
    pub session_sources: Vec<IdSource>,
    /// Sources of a subagent's own id within its session.
    pub agent_sources: Vec<IdSource>,
    /// Sources of a subagent's parent id (else the session id).
    pub parent_sources: Vec<IdSource>,
    /// Header naming the tenant, read only when `trust_tenant_header` is set.
    pub tenant_header: String,
    /// The tenant header is set by a trusted hop (a gateway that
    /// authenticates callers and strips the header from clients). Off by
    /// default: the tenant is a hash of the caller's credential, and a
    /// client-sent tenant header is removed, so no client can claim
    /// another tenant's cache.
    pub trust_tenant_header: bool,
    /// Header carrying a request priority (an integer, higher is sooner).
    pub priority_header: String,
    /// Extra client headers to remove because they steer routing; the
    /// destination header is always removed, and the tenant header too
    /// unless it is trusted.
    pub strip_headers: Vec<String>,
    /// Most bytes of a non-streamed response kept to find its `usage`; longer
    /// responses keep their tail, where engines put it.
    pub max_response_scan_bytes: usize,
    /// Write each request's priority into the body field of this GPU
    /// cluster's engine. Absent (the default): no body is ever rewritten.
    pub priority_field: Option<PriorityField>,
    /// Remove Claude Code's billing block from the `system` of the bodies
    /// sent upstream, for engines that do not strip it themselves (what is
    /// removed: `crate::preamble`). Off by default: the body is the
    /// client's. On or off, the block is out of the canonical stream.
    pub strip_preambles: bool,
}

/// The header the filter sets, and always removes from clients.
pub const DESTINATION_HEADER: &str = "x-kvmesh-destination";

/// Where Envoy's own header mutation filter, ahead of the Wasm filter in the
/// shipped configurations, moves a client's [`DESTINATION_HEADER`]: steering
/// stays closed if the VM is gone, and the filter still counts the attempt
/// (and removes this one too).
pub const FORGED_DESTINATION_HEADER: &str = "x-kvmesh-forged-destination";

fn header(name: &str) -> IdSource {
    IdSource::Header(name.to_owned())
}

impl Default for FilterConfig {
    fn default() -> Self {
        Self {
            sidecar_cluster: "kvmesh_sidecar".to_owned(),
            sidecar_timeout_ms: 50,
            sidecar_token: String::new(),
            block_bytes: 256,
            max_blocks: 16 * 1024,
            max_body_bytes: 8 * 1024 * 1024,
            hash: BlockHash::Xxh3,
            // The defaults follow what the harnesses send (HARNESSES.md, and
            // docs/harnesses/README.md for the versions captured): Dynamo,
            // Claude Code, Codex (both spellings), OpenCode, then the body's
            // cache key, Claude Code's metadata, the OpenAI `user`.
            // OpenClaw's prompt comes before `session_id`: with
            // `compat.sendSessionAffinityHeaders` OpenClaw 2026.9.6 sends
            // `session_id: <sessionId>:0`, and its session must be the same
            // id with the setting on or off. It is read only from a prompt
            // with OpenClaw's marker, so no other harness's session moves.
            session_sources: vec![
                header("x-dynamo-session-id"),
                header("x-claude-code-session-id"),
                header("session-id"),
                IdSource::OpenClawRuntime,
                header("session_id"),
                header("x-session-affinity"),
                header("x-session-id"),
                IdSource::Body("/prompt_cache_key".to_owned()),
                IdSource::ClaudeUserId,
                IdSource::Body("/user".to_owned()),
            ],
            agent_sources: vec![header("x-claude-code-agent-id"), IdSource::CodexThread],
            parent_sources: vec![
                header("x-dynamo-parent-session-id"),
                header("x-claude-code-parent-agent-id"),
                header("x-codex-parent-thread-id"),
                header("x-parent-session-id"),
                IdSource::OpenClawParentTrace,
            ],
            tenant_header: "x-kvmesh-tenant".to_owned(),
            trust_tenant_header: false,
            priority_header: "x-kvmesh-priority".to_owned(),
            strip_headers: Vec::new(),
            max_response_scan_bytes: 64 * 1024,
            priority_field: None,
            strip_preambles: false,
        }
    }
}

/// A configuration Envoy must reject.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("kvmesh plugin configuration: field `{field}`: {problem}")]
pub struct ConfigError {
    pub field: String,
    pub problem: String,
}

fn fail(field: &str, problem: impl Into<String>) -> Result<(), ConfigError> {
    Err(ConfigError {
        field: field.to_owned(),
        problem: problem.into(),
    })
}

impl FilterConfig {
    /// gRPC metadata for calls to the sidecar (the token, if any).
    pub fn sidecar_metadata(&self) -> Vec<(&'static str, Vec<u8>)> {
        if self.sidecar_token.is_empty() {
            Vec::new()
        } else {
            vec![("authorization", format!("Bearer {}", self.sidecar_token).into_bytes())]
        }
    }

    /// Parses and validates the plugin configuration. An empty one means defaults.
    pub fn from_json(bytes: &[u8]) -> Result<Self, ConfigError> {
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(Self::default());
        }
        let mut de = serde_json::Deserializer::from_slice(bytes);
        let config: Self = serde_path_to_error::deserialize(&mut de).map_err(|err| {
            let field = err.path().to_string();
            ConfigError {
                field: if field == "." { "(root)".to_owned() } else { field },
                problem: err.into_inner().to_string(),
            }
        })?;
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        if self.sidecar_cluster.trim().is_empty() {
            return fail("sidecar_cluster", "must name an Envoy cluster");
        }
        if self.sidecar_token.bytes().any(|b| !(0x21..=0x7e).contains(&b)) {
            return fail("sidecar_token", "must be printable ASCII without spaces");
        }
        if !(1..=60_000).contains(&self.sidecar_timeout_ms) {
            return fail("sidecar_timeout_ms", "must be between 1 and 60000");
        }
        if !(MIN_BLOCK_BYTES..=MAX_BLOCK_BYTES).contains(&self.block_bytes) {
            return fail(
                "block_bytes",
                format!("must be between {MIN_BLOCK_BYTES} and {MAX_BLOCK_BYTES}"),
            );
        }
        if !(1..=MAX_BLOCKS).contains(&self.max_blocks) {
            return fail("max_blocks", format!("must be between 1 and {MAX_BLOCKS}"));
        }
        if self.max_body_bytes < 1024 {
            return fail("max_body_bytes", "must be at least 1024");
        }
        if self.max_response_scan_bytes < 1024 {
            return fail("max_response_scan_bytes", "must be at least 1024");
        }
        for (field, name) in [
            ("tenant_header", &self.tenant_header),
            ("priority_header", &self.priority_header),
        ] {
            if !is_header_name(name) {
                return fail(field, "must be a lowercase header name");
            }
        }
        if let Some(field) = &self.priority_field {
            if !is_header_name(&field.background_header) {
                return fail("priority_field.background_header", "must be a lowercase header name");
            }
            if let Some((field, problem)) = field.problem() {
                return fail(&field, problem);
            }
        }
        if let Some(bad) = self.strip_headers.iter().find(|h| !is_header_name(h)) {
            return fail("strip_headers", format!("{bad:?} is not a lowercase header name"));
        }
        Ok(())
    }
}

/// Envoy hands headers to Wasm lowercased, so only lowercase names can match.
fn is_header_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-_.".contains(&b))
}
