//! The simulated engine's state: a prefix cache over 16-token blocks of the
//! templated prompt with LRU eviction inside a token capacity, the counters
//! vLLM and SGLang export (rendered under either engine's names), and the
//! faults a real engine goes through: a restart and a cache reset. Tokens are
//! approximated as 4 bytes each.

use std::time::{SystemTime, UNIX_EPOCH};

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

/// SGLang's page size as the sim reports it: the sim's own block size.
const SGLANG_PAGE_SIZE: u64 = BLOCK_TOKENS;

#[derive(Debug)]
pub(crate) struct Engine {
    cache: Lru<[u8; 32]>,
    capacity_blocks: u64,
    running: u64,
    /// Requests ever admitted; it numbers response ids, so it survives a
    /// restart (ids that repeat would confuse a test matching them up).
    requests: u64,
    prefix_queries_tokens: u64,
    prefix_hits_tokens: u64,
    prompt_tokens: u64,
    /// Unix seconds of the latest (simulated) process start.
    process_start_time: f64,
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
            process_start_time: unix_now(),
        }
    }

    /// A simulated engine restart: the process comes back with an empty
    /// cache, counters from zero and a new start time. Requests already
    /// running still finish here (the sim keeps their connections), so
    /// `running` is kept for them to release.
    pub(crate) fn restart(&mut self) {
        self.cache.clear();
        self.prefix_queries_tokens = 0;
        self.prefix_hits_tokens = 0;
        self.prompt_tokens = 0;
        // Two restarts within the clock's resolution must still show two
        // start times, or a watcher of an idle engine would miss the second.
        self.process_start_time = unix_now().max(self.process_start_time + 0.001);
    }

    /// A cache reset without a restart (vLLM's `/reset_prefix_cache`,
    /// SGLang's `/flush_cache`): the cache empties and the counters go on.
    pub(crate) fn reset_cache(&mut self) {
        self.cache.clear();
    }

    pub(crate) fn process_start_time(&self) -> f64 {
        self.process_start_time
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

    fn kv_usage(&self) -> f64 {
        self.cache.len() as f64 / self.capacity_blocks as f64
    }

    pub(crate) fn render_vllm_metrics(&self) -> String {
        let usage = self.kv_usage();
        format!(
            "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running {}\n\
             # TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0\n\
             # TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc {usage}\n\
             # TYPE vllm:prefix_cache_queries counter\nvllm:prefix_cache_queries_total {}\n\
             # TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total {}\n\
             # TYPE vllm:prompt_tokens counter\nvllm:prompt_tokens_total {}\n\
             # TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{block_size=\"{BLOCK_TOKENS}\",num_gpu_blocks=\"{}\"}} 1\n\
             # TYPE process_start_time_seconds gauge\nprocess_start_time_seconds {}\n",
            self.running,
            self.prefix_queries_tokens,
            self.prefix_hits_tokens,
            self.prompt_tokens,
            self.capacity_blocks,
            self.process_start_time
        )
    }

    /// The same state under SGLang's names. SGLang's own `/metrics` has no
    /// process start time (it is in `/server_info`); the sim shows one anyway
    /// so both namings carry the same restart signal.
    pub(crate) fn render_sglang_metrics(&self) -> String {
        let usage = self.kv_usage();
        let capacity_tokens = self.capacity_blocks * BLOCK_TOKENS;
        format!(
            "# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{{model_name=\"sim\"}} {}\n\
             # TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs{{model_name=\"sim\"}} 0\n\
             # TYPE sglang:token_usage gauge\nsglang:token_usage{{model_name=\"sim\"}} {usage}\n\
             # TYPE sglang:max_total_num_tokens gauge\nsglang:max_total_num_tokens{{model_name=\"sim\"}} {capacity_tokens}\n\
             # TYPE sglang:page_size gauge\nsglang:page_size{{model_name=\"sim\"}} {SGLANG_PAGE_SIZE}\n\
             # TYPE sglang:cached_tokens counter\nsglang:cached_tokens_total{{cache_source=\"device\",model_name=\"sim\"}} {}\n\
             # TYPE sglang:prompt_tokens counter\nsglang:prompt_tokens_total{{model_name=\"sim\"}} {}\n\
             # TYPE process_start_time_seconds gauge\nprocess_start_time_seconds {}\n",
            self.running, self.prefix_hits_tokens, self.prompt_tokens, self.process_start_time
        )
    }
}

/// Unix time in seconds. A clock before 1970 reads as 0: the value only
/// needs to differ between restarts, which `Engine::restart` ensures.
fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |since_epoch| since_epoch.as_secs_f64())
}
