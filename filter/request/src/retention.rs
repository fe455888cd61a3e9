//! The retention horizon a request declares: how long its client says the
//! prefix is worth keeping. Anthropic's `cache_control` markers (which the
//! canonical form drops, since harnesses move them every call) carry it as a
//! TTL; OpenAI's `prompt_cache_retention` as a named policy. The longest one
//! a request declares is its horizon; the sidecar weighs it against the
//! return gaps it learns.

use kvmesh_vocab::limits::MAX_RETENTION_HORIZON_S;
use serde_json::Value;

use crate::canonical::{Envelope, json_string};

/// `{"type": "ephemeral"}` without a TTL: Anthropic's default lifetime.
pub const EPHEMERAL_DEFAULT_S: u32 = 5 * 60;

/// A marker longer than this is no `cache_control` a client writes (the
/// longest real one is about 40 bytes): it is ignored, never parsed.
const MAX_MARKER_BYTES: usize = 256;

/// The horizon a raw `cache_control` value declares, in seconds: its `ttl`
/// when that reads as `<n>s`, `<n>m` or `<n>h` (n > 0, clamped to 24 h),
/// else 5 minutes for `"type": "ephemeral"`, else none.
pub(crate) fn marker_horizon_s(raw: &[u8]) -> Option<u32> {
    if raw.len() > MAX_MARKER_BYTES || raw.first() != Some(&b'{') {
        return None;
    }
    let marker: Value = serde_json::from_slice(raw).ok()?;
    if let Some(ttl) = marker.get("ttl").and_then(Value::as_str).and_then(parse_ttl_s) {
        return Some(ttl);
    }
    (marker.get("type").and_then(Value::as_str) == Some("ephemeral")).then_some(EPHEMERAL_DEFAULT_S)
}

/// `<n>s`, `<n>m` or `<n>h` with n a positive decimal integer, in seconds,
/// clamped to [`MAX_RETENTION_HORIZON_S`]; anything else is no TTL.
pub fn parse_ttl_s(ttl: &str) -> Option<u32> {
    let (digits, unit) = [('s', 1u64), ('m', 60), ('h', 3600)]
        .into_iter()
        .find_map(|(suffix, unit)| Some((ttl.strip_suffix(suffix)?, unit)))?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    // Saturating: a thousand-digit TTL is simply "longer than the bound".
    let n = digits
        .bytes()
        .fold(0u64, |n, d| n.saturating_mul(10).saturating_add(u64::from(d - b'0')));
    if n == 0 {
        return None;
    }
    let seconds = n.saturating_mul(unit).min(u64::from(MAX_RETENTION_HORIZON_S));
    u32::try_from(seconds).ok()
}

/// What the top level of the body declares: Anthropic's request-wide
/// `cache_control`, and OpenAI's `prompt_cache_retention` (`"24h"`; its
/// `"in_memory"` default declares nothing beyond the engine's own).
pub(crate) fn top_level_horizon_s(envelope: &Envelope<'_>) -> Option<u32> {
    let marker = envelope.raw("cache_control").and_then(marker_horizon_s);
    let retention = envelope
        .raw("prompt_cache_retention")
        .and_then(json_string)
        .and_then(|policy| match policy.as_ref() {
            "in_memory" => None,
            other => parse_ttl_s(other),
        });
    marker.max(retention)
}
