//! Bounds on every field a Pick or an Outcome carries. The filter never sends
//! more than these (it hashes or drops what is longer), and the sidecar
//! rejects a Pick that claims more, so a client can neither grow the
//! sidecar's memory nor tear down a shared stream.
//!
//! A Pick at every bound encodes to well under [`MAX_MESSAGE_BYTES`]: 65,536
//! block hashes are 512 KiB, 4,096 sections about 80 KiB, the strings a few
//! KiB. The gRPC decode limit can therefore stay tonic's 4 MiB default and
//! still never be reached by the filter.

/// Longest session, agent, parent or tenant id, and longest model name.
/// Longer ids are replaced by a prefix and a hash of the whole (two distinct
/// long ids stay distinct); a longer model name is not routed on content.
pub const MAX_ID_BYTES: usize = 256;

/// Longest API or harness name ("chat_completions", "claude_code").
pub const MAX_NAME_BYTES: usize = 32;

/// Longest request path kept in a Pick.
pub const MAX_PATH_BYTES: usize = 2048;

/// Most block hashes one Pick may carry (the filter's `max_blocks` cap).
pub const MAX_BLOCKS: usize = 65_536;

/// Most prompt sections one Pick may carry; the filter keeps the first ones.
pub const MAX_SECTIONS: usize = 4096;

/// Block sizes the filter may cut the prompt into.
pub const MIN_BLOCK_BYTES: usize = 16;
pub const MAX_BLOCK_BYTES: usize = 1 << 20;

/// Most tokens one prompt may claim: 16 Mi tokens is above any context
/// window. An engine's `usage` beyond it (or beyond the prompt it was sent)
/// is dropped and counted, never added to a counter.
pub const MAX_PROMPT_TOKENS: u64 = 1 << 24;

/// Longest retention horizon a request may declare, in seconds: 24 h, the
/// longest any provider offers (OpenAI `prompt_cache_retention: "24h"`;
/// Anthropic's longest `cache_control` TTL is 1 h). A longer one is clamped
/// to it, by the filter and again by the sidecar: past a day, the figure
/// would only pin KV that no session is likely to come back for.
pub const MAX_RETENTION_HORIZON_S: u32 = 24 * 60 * 60;

/// kvmesh's request priority scale: an integer, higher runs sooner, 0 the
/// engine's default. Wide enough for a few classes and fine steps between
/// them, narrow enough to map onto every engine's field (TensorRT-LLM's is
/// a float in 0-1). A value outside is clamped to it.
pub const MIN_PRIORITY: i32 = -1000;
pub const MAX_PRIORITY: i32 = 1000;

/// Largest gRPC message the sidecar decodes, and the filter sends.
pub const MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;

/// `id` clipped to `max` bytes at a character boundary.
pub fn clip(id: &str, max: usize) -> &str {
    if id.len() <= max {
        return id;
    }
    let mut end = max;
    while !id.is_char_boundary(end) {
        end -= 1;
    }
    &id[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clip_keeps_whole_characters() {
        assert_eq!(clip("abc", 8), "abc");
        assert_eq!(clip("abcdef", 3), "abc");
        // "é" is two bytes: a cut in its middle moves back before it.
        assert_eq!(clip("aé", 2), "a");
    }
}
