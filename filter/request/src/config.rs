//! The filter's JSON plugin configuration, parsed and validated once in
//! `on_configure`. Errors name the offending field so Envoy's log says what
//! to fix.

use serde::Deserialize;

/// Plugin configuration. Every field has a default, so `{}` is valid.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FilterConfig {
    /// Envoy cluster (HTTP/2) of the kvmesh sidecar's gRPC.
    pub sidecar_cluster: String,
    /// How long a request may wait for a Pick before failing open.
    pub sidecar_timeout_ms: u64,
    /// Bytes per prefix block (256 bytes is about 64 tokens).
    pub block_bytes: usize,
    /// Most blocks hashed per request; the rest routes on what was hashed.
    pub max_blocks: usize,
    /// Most body bytes buffered and parsed; bigger bodies pass through unrouted.
    pub max_body_bytes: usize,
    /// Headers naming the session, first present wins.
    pub session_headers: Vec<String>,
    /// Headers naming a subagent within the session.
    pub agent_headers: Vec<String>,
    /// Headers naming the parent of a subagent.
    pub parent_headers: Vec<String>,
    /// Header naming the tenant; without it, a hash of the credential is used.
    pub tenant_header: String,
    /// Extra client headers to remove because they steer routing; the
    /// destination header is always removed.
    pub strip_headers: Vec<String>,
}

/// The header the filter sets, and always removes from clients.
pub const DESTINATION_HEADER: &str = "x-kvmesh-destination";

impl Default for FilterConfig {
    fn default() -> Self {
        let names = |list: &[&str]| list.iter().map(|s| (*s).to_owned()).collect();
        Self {
            sidecar_cluster: "kvmesh_sidecar".to_owned(),
            sidecar_timeout_ms: 50,
            block_bytes: 256,
            max_blocks: 16 * 1024,
            max_body_bytes: 8 * 1024 * 1024,
            session_headers: names(&[
                "x-dynamo-session-id",
                "x-claude-code-session-id",
                "session-id",
                "session_id",
                "x-session-affinity",
                "x-session-id",
            ]),
            agent_headers: names(&["x-claude-code-agent-id"]),
            parent_headers: names(&[
                "x-dynamo-parent-session-id",
                "x-claude-code-parent-agent-id",
                "x-codex-parent-thread-id",
                "x-parent-session-id",
            ]),
            tenant_header: "x-kvmesh-tenant".to_owned(),
            strip_headers: Vec::new(),
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

impl FilterConfig {
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
        let fail = |field: &str, problem: &str| {
            Err(ConfigError {
                field: field.to_owned(),
                problem: problem.to_owned(),
            })
        };
        if self.sidecar_cluster.trim().is_empty() {
            return fail("sidecar_cluster", "must name an Envoy cluster");
        }
        if !(1..=60_000).contains(&self.sidecar_timeout_ms) {
            return fail("sidecar_timeout_ms", "must be between 1 and 60000");
        }
        if !(16..=1 << 20).contains(&self.block_bytes) {
            return fail("block_bytes", "must be between 16 and 1048576");
        }
        if self.max_blocks == 0 {
            return fail("max_blocks", "must be at least 1");
        }
        if self.max_body_bytes == 0 {
            return fail("max_body_bytes", "must be at least 1");
        }
        for (field, list) in [
            ("session_headers", &self.session_headers),
            ("agent_headers", &self.agent_headers),
            ("parent_headers", &self.parent_headers),
            ("strip_headers", &self.strip_headers),
        ] {
            if let Some(bad) = list.iter().find(|h| !is_header_name(h)) {
                return fail(field, &format!("{bad:?} is not a lowercase header name"));
            }
        }
        if !is_header_name(&self.tenant_header) {
            return fail("tenant_header", "must be a lowercase header name");
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
