//! The simulated engine's state: a prefix cache over 16-token blocks of the
//! templated prompt with LRU eviction inside a token capacity, the counters
//! vLLM and SGLang export (rendered under either engine's names), and the
//! faults a real engine goes through: a restart and a cache reset. Tokens are
//! approximated as 4 bytes each. A prompt is looked up when its prefill
//! starts (`begin_prefill`) and its blocks enter the cache as the prefill
//! computes them (`cache_computed`), as in vLLM, not when it arrives.
//!
//! An optional host tier (`host_capacity_blocks`) stands for KV offloaded
//! to host memory (vLLM's `--kv-offloading-size`, SGLang's HiCache): a block
//! the GPU cache evicts moves there, newest first, in its own LRU, instead of
//! disappearing; a prefix hit there is loaded back to the GPU (and leaves
//! the host tier) rather than recomputed, and counts as cached, as vLLM
//! reports it. The tier is exclusive: vLLM's native offloading writes every
//! computed block through to the CPU, so its host tier holds copies of GPU
//! blocks too and adds less capacity than this one of the same size.

use std::time::{SystemTime, UNIX_EPOCH};

use kvmesh_core::Lru;
use sha2::{Digest, Sha256};

/// Tokens per KV block, as vLLM's default block size.
pub const BLOCK_TOKENS: u64 = 16;
/// Bytes per token: a rough average of English text and code under BPE.
pub const BYTES_PER_TOKEN: u64 = 4;
const BLOCK_BYTES: usize = (BLOCK_TOKENS * BYTES_PER_TOKEN) as usize;

#[derive(Debug, Clone, Copy, Default)]
pub struct EngineConfig {
    pub capacity_tokens: u64,
    /// Blocks (16 tokens each) the host tier holds; 0: no host tier.
    pub host_capacity_blocks: u64,
}

/// One admitted request, as the engine accounted it.
#[derive(Debug, Clone, Copy)]
pub struct Served {
    pub request_id: u64,
    pub prompt_tokens: u64,
    /// Cached prompt tokens, those loaded from the host tier included.
    pub cached_tokens: u64,
    /// Of `cached_tokens`, those loaded back from the host tier.
    pub host_loaded_tokens: u64,
}

impl Served {
    pub fn uncached_tokens(&self) -> u64 {
        self.prompt_tokens - self.cached_tokens
    }
}

/// A prompt whose prefill has started: its block chain, and how much of it
/// the cache already held.
#[derive(Debug, Clone)]
pub struct Prefill {
    pub served: Served,
    blocks: Vec<[u8; 32]>,
    /// Blocks in the cache by now: the hits, then the computed ones.
    cached_blocks: usize,
}

impl Prefill {
    /// Whether every full block is computed and cached.
    pub fn done(&self) -> bool {
        self.cached_blocks == self.blocks.len()
    }
}

/// SGLang's page size as the sim reports it: the sim's own block size.
const SGLANG_PAGE_SIZE: u64 = BLOCK_TOKENS;

#[derive(Debug)]
pub struct Engine {
    cache: Lru<[u8; 32]>,
    capacity_blocks: u64,
    /// The host tier: blocks the GPU cache evicted (`None`: no host tier).
    host: Option<Lru<[u8; 32]>>,
    running: u64,
    /// KV tokens the running requests attend: what a decode step reads
    /// besides the weights.
    attended_kv_tokens: u64,
    /// Requests admitted and waiting for the prefill lane.
    waiting: u64,
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
    pub fn new(config: EngineConfig) -> Self {
        let capacity_blocks = (config.capacity_tokens / BLOCK_TOKENS).max(1);
        let host = (config.host_capacity_blocks > 0)
            .then(|| Lru::new(usize::try_from(config.host_capacity_blocks).unwrap_or(usize::MAX)));
        Self {
            cache: Lru::new(usize::try_from(capacity_blocks).unwrap_or(usize::MAX)),
            capacity_blocks,
            host,
            running: 0,
            attended_kv_tokens: 0,
            waiting: 0,
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
    pub fn restart(&mut self) {
        self.cache.clear();
        if let Some(host) = self.host.as_mut() {
            host.clear();
        }
        self.prefix_queries_tokens = 0;
        self.prefix_hits_tokens = 0;
        self.prompt_tokens = 0;
        // Two restarts within the clock's resolution must still show two
        // start times, or a watcher of an idle engine would miss the second.
        self.process_start_time = unix_now().max(self.process_start_time + 0.001);
    }

    /// A cache reset without a restart (vLLM's `/reset_prefix_cache`,
    /// SGLang's `/flush_cache`): the cache empties and the counters go on.
    pub fn reset_cache(&mut self) {
        self.cache.clear();
        if let Some(host) = self.host.as_mut() {
            host.clear();
        }
    }

    /// Whether the host tier holds `block`.
    fn on_host(&self, block: &[u8; 32]) -> bool {
        self.host.as_ref().is_some_and(|h| h.contains(block))
    }

    /// Puts `block` in the GPU cache as its newest entry; with a host tier,
    /// the entry it evicts moves there instead of disappearing.
    fn store(&mut self, block: [u8; 32]) {
        if let Some(host) = self.host.as_mut()
            && !self.cache.contains(&block)
            && self.cache.len() >= self.cache.capacity()
            && let Some(evicted) = self.cache.pop_oldest()
        {
            host.touch(evicted);
        }
        self.cache.touch(block);
    }

    pub fn process_start_time(&self) -> f64 {
        self.process_start_time
    }

    /// Cached leading tokens of `prompt`, without touching the cache (what a
    /// router that sees the engine's true cache would see).
    pub fn peek_cached_tokens(&self, prompt: &[u8]) -> u64 {
        self.peek_cached_tiers(prompt).0
    }

    /// `peek_cached_tokens`, and how many of those tokens are in the host
    /// tier only (a prefix runs on across tiers, as the engine reuses it).
    pub fn peek_cached_tiers(&self, prompt: &[u8]) -> (u64, u64) {
        let mut chain = [0u8; 32];
        let (mut hits, mut host) = (0, 0);
        for block in prompt.chunks_exact(BLOCK_BYTES) {
            chain = Sha256::new().chain_update(chain).chain_update(block).finalize().into();
            if self.cache.contains(&chain) {
                hits += 1;
            } else if self.on_host(&chain) {
                hits += 1;
                host += 1;
            } else {
                break;
            }
        }
        (hits * BLOCK_TOKENS, host * BLOCK_TOKENS)
    }

    /// Cached leading tokens of `prompt` on the GPU alone (what a router
    /// fed only the GPU tier's events would see).
    pub fn peek_gpu_cached_tokens(&self, prompt: &[u8]) -> u64 {
        let mut chain = [0u8; 32];
        let mut hits = 0;
        for block in prompt.chunks_exact(BLOCK_BYTES) {
            chain = Sha256::new().chain_update(chain).chain_update(block).finalize().into();
            if !self.cache.contains(&chain) {
                break;
            }
            hits += 1;
        }
        hits * BLOCK_TOKENS
    }

    /// Blocks in the host tier now, and its capacity in blocks.
    pub fn host_blocks(&self) -> (u64, u64) {
        self.host
            .as_ref()
            .map_or((0, 0), |h| (h.len() as u64, h.capacity() as u64))
    }

    /// Blocks cached now, and the capacity in blocks.
    pub fn cache_blocks(&self) -> (u64, u64) {
        (self.cache.len() as u64, self.capacity_blocks)
    }

    /// Looks the prompt up and caches all its full blocks at once: a prefill
    /// that starts and completes in one step (the infinite-cache bound,
    /// tests).
    pub fn admit(&mut self, prompt: &[u8]) -> Served {
        let mut prefill = self.begin_prefill(prompt);
        self.cache_computed(&mut prefill, u64::MAX);
        prefill.served
    }

    /// The prefill of `prompt` starts: its leading cached blocks are hits
    /// (and touched, as a running request holds them), the rest are still
    /// to compute. The request counts as running from here.
    pub fn begin_prefill(&mut self, prompt: &[u8]) -> Prefill {
        let prompt_tokens = (prompt.len() as u64).div_ceil(BYTES_PER_TOKEN);
        let blocks = block_chain(prompt);
        // Look every block up first, then touch: touching as it goes could
        // evict a later block of this very prompt before its lookup. The
        // GPU hits are touched first, so loading the host hits back (each
        // may push the GPU's oldest block out) does not evict them.
        let hits = blocks
            .iter()
            .take_while(|b| self.cache.contains(b) || self.on_host(b))
            .count();
        let mut loaded = Vec::new();
        for block in blocks[..hits].iter().rev() {
            if self.cache.contains(block) {
                self.cache.touch(*block);
            } else {
                loaded.push(*block);
            }
        }
        for block in &loaded {
            if let Some(host) = self.host.as_mut() {
                host.remove(block);
            }
            self.store(*block);
        }
        if !loaded.is_empty() {
            // The prompt's first block ends newest again, as without loads.
            for block in blocks[..hits].iter().rev() {
                if self.cache.contains(block) {
                    self.cache.touch(*block);
                }
            }
        }
        let host_loaded_tokens = loaded.len() as u64 * BLOCK_TOKENS;
        self.requests += 1;
        self.running += 1;
        let cached_tokens = hits as u64 * BLOCK_TOKENS;
        self.prefix_queries_tokens += prompt_tokens;
        self.prefix_hits_tokens += cached_tokens;
        self.prompt_tokens += prompt_tokens;
        Prefill {
            served: Served {
                request_id: self.requests,
                prompt_tokens,
                cached_tokens,
                host_loaded_tokens,
            },
            blocks,
            cached_blocks: hits,
        }
    }

    /// `computed_tokens` of the prefill's uncached tokens are computed by
    /// now: their full blocks enter the cache. When the last one does, the
    /// whole prompt is touched last block first, so its first block ends
    /// newest: like vLLM, which frees a finished request's blocks tail
    /// first, the end of a prefix is evicted before its shared beginning.
    pub fn cache_computed(&mut self, prefill: &mut Prefill, computed_tokens: u64) {
        let hits = prefill.served.cached_tokens / BLOCK_TOKENS;
        let computed_blocks = computed_tokens / BLOCK_TOKENS;
        let upto = usize::try_from(hits.saturating_add(computed_blocks))
            .unwrap_or(usize::MAX)
            .min(prefill.blocks.len());
        if upto <= prefill.cached_blocks {
            return;
        }
        let fresh = prefill.cached_blocks..upto;
        prefill.cached_blocks = upto;
        if prefill.done() {
            for i in (0..prefill.blocks.len()).rev() {
                self.store(prefill.blocks[i]);
            }
        } else {
            for i in fresh.rev() {
                self.store(prefill.blocks[i]);
            }
        }
    }

    /// Requests running: past the prefill queue, not finished.
    pub fn running(&self) -> u64 {
        self.running
    }

    /// KV tokens the decoding requests attend (see `TimingModel::decode_step`).
    pub fn attended_kv_tokens(&self) -> u64 {
        self.attended_kv_tokens
    }

    /// A request decodes over `tokens` more tokens of KV: its prompt when
    /// its decode starts, then one per token it generates.
    pub fn attend(&mut self, tokens: u64) {
        self.attended_kv_tokens = self.attended_kv_tokens.saturating_add(tokens);
    }

    /// Requests waiting for the prefill lane.
    pub fn waiting(&self) -> u64 {
        self.waiting
    }

    /// A request joins the prefill queue.
    pub fn enqueue(&mut self) {
        self.waiting += 1;
    }

    /// A request leaves the prefill queue (its prefill starts).
    pub fn dequeue(&mut self) {
        self.waiting = self.waiting.saturating_sub(1);
    }

    /// A request finishes; it attended `attended_tokens` (what it added
    /// through `attend`).
    pub fn finish(&mut self, attended_tokens: u64) {
        self.running = self.running.saturating_sub(1);
        self.attended_kv_tokens = self.attended_kv_tokens.saturating_sub(attended_tokens);
    }

    fn kv_usage(&self) -> f64 {
        self.cache.len() as f64 / self.capacity_blocks as f64
    }

    pub fn render_vllm_metrics(&self) -> String {
        let usage = self.kv_usage();
        format!(
            "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running {}\n\
             # TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting {}\n\
             # TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc {usage}\n\
             # TYPE vllm:prefix_cache_queries counter\nvllm:prefix_cache_queries_total {}\n\
             # TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total {}\n\
             # TYPE vllm:prompt_tokens counter\nvllm:prompt_tokens_total {}\n\
             # TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{block_size=\"{BLOCK_TOKENS}\",num_gpu_blocks=\"{}\"}} 1\n\
             # TYPE process_start_time_seconds gauge\nprocess_start_time_seconds {}\n",
            self.running(),
            self.waiting,
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
    pub fn render_sglang_metrics(&self) -> String {
        let usage = self.kv_usage();
        let capacity_tokens = self.capacity_blocks * BLOCK_TOKENS;
        format!(
            "# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{{model_name=\"sim\"}} {}\n\
             # TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs{{model_name=\"sim\"}} {}\n\
             # TYPE sglang:token_usage gauge\nsglang:token_usage{{model_name=\"sim\"}} {usage}\n\
             # TYPE sglang:max_total_num_tokens gauge\nsglang:max_total_num_tokens{{model_name=\"sim\"}} {capacity_tokens}\n\
             # TYPE sglang:page_size gauge\nsglang:page_size{{model_name=\"sim\"}} {SGLANG_PAGE_SIZE}\n\
             # TYPE sglang:cached_tokens counter\nsglang:cached_tokens_total{{cache_source=\"device\",model_name=\"sim\"}} {}\n\
             # TYPE sglang:prompt_tokens counter\nsglang:prompt_tokens_total{{model_name=\"sim\"}} {}\n\
             # TYPE process_start_time_seconds gauge\nprocess_start_time_seconds {}\n",
            self.running(),
            self.waiting,
            self.prefix_hits_tokens,
            self.prompt_tokens,
            self.process_start_time
        )
    }
}

/// The hashes of `prompt`'s full blocks, each chained over the ones before
/// it: equal hashes, equal prefixes (the engine's cache keys).
pub fn block_chain(prompt: &[u8]) -> Vec<[u8; 32]> {
    let mut chain = [0u8; 32];
    prompt
        .chunks_exact(BLOCK_BYTES)
        .map(|block| {
            chain = Sha256::new().chain_update(chain).chain_update(block).finalize().into();
            chain
        })
        .collect()
}

/// Unix time in seconds. A clock before 1970 reads as 0: the value only
/// needs to differ between restarts, which `Engine::restart` ensures.
fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |since_epoch| since_epoch.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` distinct 64-byte blocks (16 tokens each), starting from `seed`.
    fn prompt(seed: u8, n: usize) -> Vec<u8> {
        (0..n)
            .flat_map(|i| vec![seed.wrapping_add(i as u8); BLOCK_BYTES])
            .collect()
    }

    #[test]
    fn prefix_hits_and_lru_eviction_by_hand() {
        // Room for 4 blocks of 16 tokens.
        let mut engine = Engine::new(EngineConfig {
            capacity_tokens: 64,
            ..EngineConfig::default()
        });
        let a = prompt(1, 2);
        let b = prompt(100, 3);
        assert_eq!(engine.admit(&a).cached_tokens, 0);
        assert_eq!(engine.admit(&a).cached_tokens, 32);
        // B's 3 blocks need room: the oldest entry goes, which is A's second
        // block (A's first block was touched last).
        assert_eq!(engine.admit(&b).cached_tokens, 0);
        assert_eq!(engine.admit(&a).cached_tokens, 16);
        // A prompt that extends A reuses what is left of it.
        let mut a_longer = a.clone();
        a_longer.extend(prompt(50, 1));
        let served = engine.admit(&a_longer);
        assert_eq!((served.prompt_tokens, served.cached_tokens), (48, 32));
        // A partial block is never cached: 70 bytes are 18 tokens, 1 block.
        let odd = vec![7u8; 70];
        engine.admit(&odd);
        assert_eq!(engine.admit(&odd).cached_tokens, 16);
    }

    #[test]
    fn gpu_evictions_go_to_the_host_tier_and_come_back_as_hits() {
        // Room for 4 blocks on the GPU and 3 in host memory.
        let mut engine = Engine::new(EngineConfig {
            capacity_tokens: 64,
            host_capacity_blocks: 3,
        });
        let a = prompt(1, 3);
        let b = prompt(100, 3);
        engine.admit(&a);
        // B's 3 blocks push A's two oldest (its tail: A2, then A1) to the host.
        engine.admit(&b);
        assert_eq!(engine.cache_blocks().0, 4);
        assert_eq!(engine.host_blocks(), (2, 3));
        assert_eq!(engine.peek_cached_tiers(&a), (48, 32));
        // A again: all 3 blocks hit, 2 of them loaded back from the host
        // (pushing B's two oldest there in turn); nothing is recomputed.
        let served = engine.admit(&a);
        assert_eq!((served.cached_tokens, served.host_loaded_tokens), (48, 32));
        assert_eq!(engine.peek_cached_tiers(&a), (48, 0));
        assert_eq!(engine.peek_cached_tiers(&b), (48, 32));
        // The host tier is an LRU of its own: a fourth block there evicts
        // its oldest, which is then gone from both tiers.
        let c = prompt(200, 3);
        engine.admit(&c);
        assert_eq!(engine.host_blocks(), (3, 3));
        let (total, host) = engine.peek_cached_tiers(&b);
        assert!(total < 48 && host == total, "{total} {host}");
        // Without a host tier, the same eviction forgets.
        let mut plain = Engine::new(EngineConfig {
            capacity_tokens: 64,
            ..EngineConfig::default()
        });
        plain.admit(&a);
        plain.admit(&b);
        assert_eq!(plain.peek_cached_tiers(&a), (16, 0));
        assert_eq!(plain.host_blocks(), (0, 0));
    }

    #[test]
    fn blocks_enter_the_cache_as_the_prefill_computes_them() {
        let mut engine = Engine::new(EngineConfig {
            capacity_tokens: 1600,
            ..EngineConfig::default()
        });
        let a = prompt(1, 5);
        let mut prefill = engine.begin_prefill(&a);
        assert_eq!(prefill.served.cached_tokens, 0);
        // Started, nothing computed: a second request finds nothing yet.
        assert_eq!(engine.peek_cached_tokens(&a), 0);
        // 20 tokens computed: one full block.
        engine.cache_computed(&mut prefill, 20);
        assert_eq!(engine.peek_cached_tokens(&a), 16);
        engine.cache_computed(&mut prefill, 48);
        assert_eq!(engine.peek_cached_tokens(&a), 48);
        assert!(!prefill.done());
        engine.cache_computed(&mut prefill, 80);
        assert!(prefill.done());
        assert_eq!(engine.peek_cached_tokens(&a), 80);
        // The next prefill of a longer prompt hits the five, computes one.
        let mut longer = a.clone();
        longer.extend(prompt(50, 1));
        let mut next = engine.begin_prefill(&longer);
        assert_eq!(next.served.cached_tokens, 80);
        let uncached = next.served.uncached_tokens();
        engine.cache_computed(&mut next, uncached);
        assert_eq!(engine.peek_cached_tokens(&longer), 96);
    }

    #[test]
    fn attended_kv_follows_the_decoding_requests() {
        let mut engine = Engine::new(EngineConfig {
            capacity_tokens: 1600,
            ..EngineConfig::default()
        });
        engine.attend(1000);
        engine.attend(500);
        engine.attend(1);
        assert_eq!(engine.attended_kv_tokens(), 1501);
        engine.finish(1001);
        assert_eq!(engine.attended_kv_tokens(), 500);
    }

    #[test]
    fn metrics_and_usage_agree_with_what_it_did() {
        let mut engine = Engine::new(EngineConfig {
            capacity_tokens: 1600,
            ..EngineConfig::default()
        });
        let a = prompt(1, 10);
        let served = [engine.admit(&a), engine.admit(&a), engine.admit(&prompt(200, 5))];
        let prompt_total: u64 = served.iter().map(|s| s.prompt_tokens).sum();
        let cached_total: u64 = served.iter().map(|s| s.cached_tokens).sum();
        assert_eq!((prompt_total, cached_total), (400, 160));
        engine.finish(0);
        let text = engine.render_vllm_metrics();
        assert!(
            text.contains(&format!("vllm:prefix_cache_queries_total {prompt_total}\n")),
            "{text}"
        );
        assert!(
            text.contains(&format!("vllm:prefix_cache_hits_total {cached_total}\n")),
            "{text}"
        );
        assert!(text.contains("vllm:num_requests_running 2\n"), "{text}");
        assert!(text.contains("vllm:kv_cache_usage_perc 0.15\n"), "{text}");
        assert!(text.contains("num_gpu_blocks=\"100\""), "{text}");
        let sglang = engine.render_sglang_metrics();
        assert!(
            sglang.contains(&format!(
                "sglang:cached_tokens_total{{cache_source=\"device\",model_name=\"sim\"}} {cached_total}\n"
            )),
            "{sglang}"
        );
        engine.enqueue();
        assert!(engine.render_vllm_metrics().contains("vllm:num_requests_waiting 1\n"));
        engine.restart();
        assert_eq!(engine.admit(&a).cached_tokens, 0);
    }
}
