//! Chained SHA-256 block hashes over the canonical stream (design section 4).

use sha2::{Digest, Sha256};

/// The chained hashes of one request's canonical stream.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BlockHashes {
    /// `h_1..h_n` truncated to u64 (first 8 bytes, big-endian).
    pub hashes: Vec<u64>,
    /// The last hash covers fewer than `block_bytes` bytes.
    pub last_partial: bool,
    /// Length of the whole canonical stream.
    pub stream_bytes: u64,
    /// The block cap stopped hashing before the end of the stream.
    pub truncated: bool,
}

/// `h_0`: the seed every chain starts from. Tenant, model and `cache_salt`
/// are in it, so two tenants never share a hash even for equal prompts.
pub fn salt(tenant: &str, model: &str, cache_salt: &str) -> [u8; 32] {
    let mut h = Sha256::new();
    // Length-prefixed fields: ("ab","c") and ("a","bc") must differ.
    for part in ["kvmesh.v1", tenant, model, cache_salt] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    h.finalize().into()
}

/// `h_i = SHA-256(h_{i-1} || block_i)` over blocks of `block_bytes`, at most
/// `max_blocks` of them. A trailing partial block is hashed and flagged.
pub fn block_hashes(seed: &[u8; 32], stream: &[u8], block_bytes: usize, max_blocks: usize) -> BlockHashes {
    let block_bytes = block_bytes.max(1);
    let mut prev = *seed;
    let mut hashes = Vec::with_capacity(stream.len().div_ceil(block_bytes).min(max_blocks));
    let mut last_partial = false;
    for block in stream.chunks(block_bytes).take(max_blocks) {
        let mut h = Sha256::new();
        h.update(prev);
        h.update(block);
        prev = h.finalize().into();
        hashes.push(truncate(&prev));
        last_partial = block.len() < block_bytes;
    }
    BlockHashes {
        truncated: hashes.len() < stream.len().div_ceil(block_bytes),
        hashes,
        last_partial,
        stream_bytes: stream.len() as u64,
    }
}

fn truncate(digest: &[u8; 32]) -> u64 {
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(first)
}
