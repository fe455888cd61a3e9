//! The simulated engine's state: a prefix cache over 16-token blocks of the
//! templated prompt with LRU eviction inside a token capacity, and the
//! counters vLLM exports. Tokens are approximated as 4 bytes each.

use kvmesh_core::Lru;
use sha2::{Digest, Sha256};

/// Tokens per KV block, as vLLM's default block size.
const BLOCK_TOKENS: u64 = 16;
/// Bytes per token: a rough average of English text and code under BPE.
const BYTES_PER_TOKEN: u64 = 4;
const BLOCK_BYTES: usize = (BLOCK_TOKENS * BYTES_PER_TOKEN) as usize;

#[derive(Debug, Clone, Copy)]
pub(crate) struct EngineConfig {
    pub(crate) capacity_tokens: u64,
}

/// One admitted request, as the engine accounted it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Served {
    pub(crate) request_id: u64,
    pub(crate) prompt_tokens: u64,
    pub(crate) cached_tokens: u64,
}

impl Served {
    pub(crate) fn uncached_tokens(&self) -> u64 {
        self.prompt_tokens - self.cached_tokens
    }
}

#[derive(Debug)]
pub(crate) struct Engine {
    cache: Lru<[u8; 32]>,
    capacity_blocks: u64,
    running: u64,
    requests: u64,
    prefix_queries_tokens: u64,
    prefix_hits_tokens: u64,
    prompt_tokens: u64,
}

impl Engine {
    pub(crate) fn new(config: EngineConfig) -> Self {
        let capacity_blocks = (config.capacity_tokens / BLOCK_TOKENS).max(1);
        Self {
            cache: Lru::new(usize::try_from(capacity_blocks).unwrap_or(usize::MAX)),
            capacity_blocks,
            running: 0,
            requests: 0,
            prefix_queries_tokens: 0,
            prefix_hits_tokens: 0,
            prompt_tokens: 0,
        }
    }

    /// Looks the prompt up in the cache, then caches all its full blocks, as
    /// vLLM's automatic prefix caching does once the prefill completes.
    pub(crate) fn admit(&mut self, prompt: &[u8]) -> Served {
        let prompt_tokens = (prompt.len() as u64).div_ceil(BYTES_PER_TOKEN);
        let mut chain = [0u8; 32];
        let mut hits = 0u64;
        let mut still_hitting = true;
        for block in prompt.chunks_exact(BLOCK_BYTES) {
            chain = Sha256::new().chain_update(chain).chain_update(block).finalize().into();
            if still_hitting && self.cache.contains(&chain) {
                hits += 1;
            } else {
                still_hitting = false;
            }
            self.cache.touch(chain);
        }
        self.requests += 1;
        self.running += 1;
        let cached_tokens = hits * BLOCK_TOKENS;
        self.prefix_queries_tokens += prompt_tokens;
        self.prefix_hits_tokens += cached_tokens;
        self.prompt_tokens += prompt_tokens;
        Served {
            request_id: self.requests,
            prompt_tokens,
            cached_tokens,
        }
    }

    pub(crate) fn finish(&mut self) {
        self.running = self.running.saturating_sub(1);
    }

    pub(crate) fn render_vllm_metrics(&self) -> String {
        let usage = self.cache.len() as f64 / self.capacity_blocks as f64;
        format!(
            "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running {}\n\
             # TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0\n\
             # TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc {usage}\n\
             # TYPE vllm:prefix_cache_queries counter\nvllm:prefix_cache_queries_total {}\n\
             # TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total {}\n\
             # TYPE vllm:prompt_tokens counter\nvllm:prompt_tokens_total {}\n\
             # TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{block_size=\"{BLOCK_TOKENS}\",num_gpu_blocks=\"{}\"}} 1\n",
            self.running, self.prefix_queries_tokens, self.prefix_hits_tokens, self.prompt_tokens, self.capacity_blocks
        )
    }
}
