//! Request understanding for the kvmesh filter, with no proxy-wasm in it: which
//! inference API a request speaks, who it belongs to (session, agent, parent,
//! tenant) and the chained block hashes of its canonical prompt prefix.
//!
//! Everything here is pure and runs natively in tests and in the benchmark, so
//! the filter, the simulator and the bench hash the same bytes the same way.
#![forbid(unsafe_code)]

mod canonical;
mod config;
mod hashing;
mod identity;

pub use canonical::{Api, CanonicalError, canonical_stream};
pub use config::{ConfigError, DESTINATION_HEADER, FilterConfig};
pub use hashing::{BlockHashes, block_hashes, salt};
pub use identity::{Headers, Identity, identify};

/// Everything the filter learns from one request before asking for a route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Understood {
    pub api: Api,
    pub model: String,
    pub identity: Identity,
    pub hashes: BlockHashes,
    pub stream: bool,
    pub expected_output_tokens: Option<u32>,
}

/// Why a request is not routed on its content (it then passes through as is).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum NotUnderstood {
    #[error("body is not valid JSON")]
    InvalidJson,
    #[error(transparent)]
    Shape(#[from] CanonicalError),
}

/// Understands one buffered request of a known `api`.
///
/// `body` may be a prefix of the real body when the filter capped it; the
/// caller then passes `truncated_body = true` and the JSON will usually fail to
/// parse, which routes the request without a prefix (it is never changed).
pub fn understand(
    api: Api,
    headers: &impl Headers,
    body: &[u8],
    config: &FilterConfig,
) -> Result<Understood, NotUnderstood> {
    let json: serde_json::Value = serde_json::from_slice(body).map_err(|_| NotUnderstood::InvalidJson)?;
    let stream_bytes = canonical_stream(api, &json)?;
    let identity = identify(headers, &json, config);
    let model = json
        .get("model")
        .and_then(serde_json::Value::as_str)
        .unwrap_or_default()
        .to_owned();
    let cache_salt = json
        .get("cache_salt")
        .and_then(serde_json::Value::as_str)
        .unwrap_or_default();
    let seed = salt(&identity.tenant, &model, cache_salt);
    let hashes = block_hashes(&seed, &stream_bytes, config.block_bytes, config.max_blocks);
    Ok(Understood {
        api,
        model,
        identity,
        hashes,
        stream: json.get("stream").and_then(serde_json::Value::as_bool) == Some(true),
        expected_output_tokens: expected_output_tokens(&json),
    })
}

fn expected_output_tokens(json: &serde_json::Value) -> Option<u32> {
    ["max_completion_tokens", "max_output_tokens", "max_tokens"]
        .iter()
        .find_map(|key| json.get(*key).and_then(serde_json::Value::as_u64))
        .map(|n| u32::try_from(n).unwrap_or(u32::MAX))
}

#[cfg(test)]
mod tests;
