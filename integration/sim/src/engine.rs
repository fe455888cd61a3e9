//! The simulated engine's state: its KV blocks as vLLM's block pool keeps
//! them, the counters vLLM and SGLang export (rendered under either engine's
//! names), and the faults a real engine goes through: a restart and a cache
//! reset. Prompts are token ids from the engine's own tokenizer
//! (`tokenizer`), cut into blocks of 16 tokens.
//!
//! KV memory, as vLLM's scheduler and block pool manage it
//! (`vllm/v1/core/sched/scheduler.py` `schedule`,
//! `kv_cache_manager.py` `allocate_slots`, `block_pool.py`):
//! - a running request holds its blocks: its prompt's (hits and computed)
//!   and those its output fills as it decodes; held blocks are never
//!   evicted. The prefix cache is what is left: blocks no request holds
//!   stay cached, in LRU order, until a new block needs their room;
//! - a request is admitted (`begin_prefill`) only if its prompt's blocks fit
//!   beside what the running requests hold (`try_begin_prefill` refuses it
//!   otherwise, and it waits); a cached block it reuses costs no room if
//!   another request already holds it;
//! - a decoding request that needs a block when none is free is preempted
//!   by the caller (`grow` says so): its blocks are released, those of its
//!   prompt stay cached, and it is recomputed when it runs again;
//! - a finished request's blocks are released tail first, so the end of a
//!   prefix is evicted before its shared beginning.
//!
//! The sim admits a whole prompt at once; vLLM allocates chunk by chunk,
//! so it can admit a long prompt sooner and preempt later.
//!
//! An optional host tier (`host_capacity_blocks`) stands for KV offloaded
//! to host memory (vLLM's `--kv-offloading-size`, SGLang's HiCache): a block
//! the GPU cache evicts moves there, newest first, in its own LRU, instead of
//! disappearing; a prefix hit there is loaded back to the GPU (and leaves
//! the host tier) rather than recomputed, and counts as cached, as vLLM
//! reports it. The tier is exclusive: vLLM's native offloading writes every
//! computed block through to the CPU, so its host tier holds copies of GPU
//! blocks too and adds less capacity than this one of the same size.

use std::collections::HashMap;
use std::time::{SystemTime, UNIX_EPOCH};

use kvmesh_core::Lru;
use sha2::{Digest, Sha256};

/// Tokens per KV block, as vLLM's default block size on GPUs (its CPU
/// backend's is 128).
pub const BLOCK_TOKENS: u64 = 16;

#[derive(Debug, Clone, Copy, Default)]
pub struct EngineConfig {
    pub capacity_tokens: u64,
    /// Tokens per KV block (0: `BLOCK_TOKENS`).
    pub block_tokens: u64,
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

/// A request the engine runs, from its prefill's start to its finish (or
/// preemption): its block chain, how much of it is cached by now, and the
/// blocks it holds.
#[derive(Debug, Clone)]
pub struct Running {
    pub served: Served,
    blocks: Vec<[u8; 32]>,
    /// Leading blocks in the cache by now, held by this request: the hits,
    /// then the computed ones.
    cached_blocks: usize,
    /// Blocks it holds that carry no cache key: prompt blocks still being
    /// computed, its partial last block, its output.
    held_unkeyed: u64,
    /// Output tokens it has room for.
    output_room: u64,
    /// The engine's epoch when it began (`Engine::restart`).
    epoch: u64,
}

impl Running {
    /// Whether every full block is computed and cached.
    pub fn done(&self) -> bool {
        self.cached_blocks == self.blocks.len()
    }

    /// Output tokens it has blocks for.
    pub fn output_room(&self) -> u64 {
        self.output_room
    }

    /// Blocks this request holds.
    pub fn held_blocks(&self) -> u64 {
        self.cached_blocks as u64 + self.held_unkeyed
    }
}

#[derive(Debug, Clone)]
pub struct Engine {
    /// Cached blocks no request holds, oldest first: vLLM's free queue of
    /// blocks that keep their hash until reused.
    cache: Lru<[u8; 32]>,
    /// Cached blocks running requests hold, with how many hold each.
    held: HashMap<[u8; 32], u32>,
    /// Blocks running requests hold that carry no cache key.
    held_unkeyed: u64,
    capacity_blocks: u64,
    /// Tokens per block (SGLang's page size, as the sim reports it).
    block_tokens: u64,
    /// Bumped by a restart: a request that began before it releases nothing.
    epoch: u64,
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
    /// Requests preempted to free blocks (vLLM's `num_preemptions`).
    preemptions: u64,
    prefix_queries_tokens: u64,
    prefix_hits_tokens: u64,
    prompt_tokens: u64,
    /// Unix seconds of the latest (simulated) process start.
    process_start_time: f64,
}

impl Engine {
    pub fn new(config: EngineConfig) -> Self {
        let block_tokens = if config.block_tokens == 0 {
            BLOCK_TOKENS
        } else {
            config.block_tokens
        };
        let capacity_blocks = (config.capacity_tokens / block_tokens).max(1);
        let host = (config.host_capacity_blocks > 0)
            .then(|| Lru::new(usize::try_from(config.host_capacity_blocks).unwrap_or(usize::MAX)));
        Self {
            cache: Lru::new(usize::try_from(capacity_blocks).unwrap_or(usize::MAX)),
            held: HashMap::new(),
            held_unkeyed: 0,
            capacity_blocks,
            block_tokens,
            epoch: 0,
            host,
            running: 0,
            attended_kv_tokens: 0,
            waiting: 0,
            requests: 0,
            preemptions: 0,
            prefix_queries_tokens: 0,
            prefix_hits_tokens: 0,
            prompt_tokens: 0,
            process_start_time: unix_now(),
        }
    }

    /// A simulated engine restart: the process comes back with an empty
    /// cache, counters from zero and a new start time. Requests already
    /// running still finish here (the sim keeps their connections), so
    /// `running` is kept for them to release; their blocks are gone.
    pub fn restart(&mut self) {
        self.reset_cache();
        self.held.clear();
        self.held_unkeyed = 0;
        self.epoch += 1;
        self.prefix_queries_tokens = 0;
        self.prefix_hits_tokens = 0;
        self.prompt_tokens = 0;
        // Two restarts within the clock's resolution must still show two
        // start times, or a watcher of an idle engine would miss the second.
        self.process_start_time = unix_now().max(self.process_start_time + 0.001);
    }

    /// A cache reset without a restart (vLLM's `/reset_prefix_cache`,
    /// SGLang's `/flush_cache`): the cache empties and the counters go on.
    /// Blocks running requests hold stay theirs.
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

    /// Whether the GPU holds `block` cached, held or not.
    fn on_gpu(&self, block: &[u8; 32]) -> bool {
        self.held.contains_key(block) || self.cache.contains(block)
    }

    /// Blocks held by running requests.
    fn held_blocks(&self) -> u64 {
        self.held.len() as u64 + self.held_unkeyed
    }

    /// Blocks a request may take: empty ones and cached ones no request
    /// holds (vLLM's `get_num_free_blocks`).
    pub fn free_blocks(&self) -> u64 {
        self.capacity_blocks.saturating_sub(self.held_blocks())
    }

    /// Evicts cached blocks nobody holds, oldest first (to the host tier if
    /// there is one), until the cache fits beside the held blocks.
    fn make_room(&mut self) {
        while self.cache.len() as u64 + self.held_blocks() > self.capacity_blocks {
            let Some(evicted) = self.cache.pop_oldest() else {
                return;
            };
            if let Some(host) = self.host.as_mut() {
                host.touch(evicted);
            }
        }
    }

    /// `block` is held once more (it leaves the evictable cache).
    fn hold(&mut self, block: [u8; 32]) {
        self.cache.remove(&block);
        *self.held.entry(block).or_insert(0) += 1;
    }

    /// `block` is held once less; when nobody holds it, it is cached as the
    /// newest evictable entry.
    fn release(&mut self, block: [u8; 32]) {
        match self.held.get_mut(&block) {
            Some(n) if *n > 1 => *n -= 1,
            Some(_) => {
                self.held.remove(&block);
                self.cache.touch(block);
            }
            None => {}
        }
    }

    pub fn process_start_time(&self) -> f64 {
        self.process_start_time
    }

    /// Cached leading tokens of `tokens`, without touching the cache (what a
    /// router that sees the engine's true cache would see).
    pub fn peek_cached_tokens(&self, tokens: &[u32]) -> u64 {
        self.peek_cached_tiers(tokens).0
    }

    /// `peek_cached_tokens`, and how many of those tokens are in the host
    /// tier only (a prefix runs on across tiers, as the engine reuses it).
    pub fn peek_cached_tiers(&self, tokens: &[u32]) -> (u64, u64) {
        let (mut hits, mut host) = (0, 0);
        for block in Chain::new(tokens, self.block_tokens) {
            if self.on_gpu(&block) {
                hits += 1;
            } else if self.on_host(&block) {
                hits += 1;
                host += 1;
            } else {
                break;
            }
        }
        (hits * self.block_tokens, host * self.block_tokens)
    }

    /// Cached leading tokens of `tokens` on the GPU alone (what a router
    /// fed only the GPU tier's events would see).
    pub fn peek_gpu_cached_tokens(&self, tokens: &[u32]) -> u64 {
        Chain::new(tokens, self.block_tokens)
            .take_while(|b| self.on_gpu(b))
            .count() as u64
            * self.block_tokens
    }

    /// Every block the GPU holds, cached or held by a running request.
    pub fn gpu_blocks(&self) -> impl Iterator<Item = &[u8; 32]> {
        self.held.keys().chain(self.cache.iter())
    }

    /// Tokens per block.
    pub fn block_tokens(&self) -> u64 {
        self.block_tokens
    }

    /// Blocks in the host tier now, and its capacity in blocks.
    pub fn host_blocks(&self) -> (u64, u64) {
        self.host
            .as_ref()
            .map_or((0, 0), |h| (h.len() as u64, h.capacity() as u64))
    }

    /// Blocks cached or held now, and the capacity in blocks.
    pub fn cache_blocks(&self) -> (u64, u64) {
        (self.cache.len() as u64 + self.held_blocks(), self.capacity_blocks)
    }

    /// Looks the prompt up, caches all its full blocks at once and finishes
    /// it: a request that runs alone in one step (the infinite-cache bound,
    /// tests).
    pub fn admit(&mut self, tokens: &[u32]) -> Served {
        let mut running = self.begin_prefill(tokens);
        self.cache_computed(&mut running, u64::MAX);
        let served = running.served;
        self.finish(running, 0);
        served
    }

    /// Blocks `tokens` would take from the free ones if admitted now: its
    /// blocks but the GPU hits somebody holds (a held hit costs nothing, an
    /// evictable one leaves the free queue, as in `allocate_slots`).
    fn admission_cost(&self, blocks: &[[u8; 32]], prompt_tokens: u64) -> u64 {
        let held_hits = blocks
            .iter()
            .take_while(|b| self.on_gpu(b) || self.on_host(b))
            .filter(|b| self.held.contains_key(*b))
            .count() as u64;
        prompt_tokens.div_ceil(self.block_tokens) - held_hits
    }

    /// `begin_prefill` if the prompt's blocks fit beside the held ones, or
    /// if nothing runs (a prompt bigger than the whole cache would be
    /// refused by a real engine's length limit; the sim runs it alone).
    /// `None`: refused, nothing changed; the request waits.
    pub fn try_begin_prefill(&mut self, tokens: &[u32]) -> Option<Running> {
        let blocks = block_chain(tokens, self.block_tokens);
        self.admits_blocks(&blocks, tokens.len() as u64)
            .then(|| self.begin_with(tokens, blocks))
    }

    /// Whether `try_begin_prefill` would admit `tokens` now.
    pub fn admits(&self, tokens: &[u32]) -> bool {
        self.admits_blocks(&block_chain(tokens, self.block_tokens), tokens.len() as u64)
    }

    fn admits_blocks(&self, blocks: &[[u8; 32]], prompt_tokens: u64) -> bool {
        self.held_blocks() == 0 || self.admission_cost(blocks, prompt_tokens) <= self.free_blocks()
    }

    /// The prefill of `tokens` starts, whatever it costs: its leading cached
    /// blocks are hits (held from now), the rest are still to compute. The
    /// request counts as running from here.
    pub fn begin_prefill(&mut self, tokens: &[u32]) -> Running {
        let blocks = block_chain(tokens, self.block_tokens);
        self.begin_with(tokens, blocks)
    }

    fn begin_with(&mut self, tokens: &[u32], blocks: Vec<[u8; 32]>) -> Running {
        let prompt_tokens = tokens.len() as u64;
        let hits = blocks.iter().take_while(|b| self.on_gpu(b) || self.on_host(b)).count();
        let mut host_loaded = 0u64;
        for block in &blocks[..hits] {
            if !self.on_gpu(block) {
                if let Some(host) = self.host.as_mut() {
                    host.remove(block);
                }
                host_loaded += 1;
            }
            self.hold(*block);
        }
        let held_unkeyed = prompt_tokens.div_ceil(self.block_tokens) - hits as u64;
        self.held_unkeyed += held_unkeyed;
        self.make_room();
        self.requests += 1;
        self.running += 1;
        let cached_tokens = hits as u64 * self.block_tokens;
        self.prefix_queries_tokens += prompt_tokens;
        self.prefix_hits_tokens += cached_tokens;
        self.prompt_tokens += prompt_tokens;
        Running {
            served: Served {
                request_id: self.requests,
                prompt_tokens,
                cached_tokens,
                host_loaded_tokens: host_loaded * self.block_tokens,
            },
            blocks,
            cached_blocks: hits,
            held_unkeyed,
            output_room: prompt_tokens.div_ceil(self.block_tokens) * self.block_tokens - prompt_tokens,
            epoch: self.epoch,
        }
    }

    /// `computed_tokens` of the prefill's uncached tokens are computed by
    /// now: their full blocks enter the cache, held by the request.
    pub fn cache_computed(&mut self, running: &mut Running, computed_tokens: u64) {
        if running.epoch != self.epoch {
            return;
        }
        let hits = running.served.cached_tokens / self.block_tokens;
        let computed_blocks = computed_tokens / self.block_tokens;
        let upto = usize::try_from(hits.saturating_add(computed_blocks))
            .unwrap_or(usize::MAX)
            .min(running.blocks.len());
        for i in running.cached_blocks..upto {
            self.hold(running.blocks[i]);
            running.held_unkeyed -= 1;
            self.held_unkeyed -= 1;
        }
        running.cached_blocks = running.cached_blocks.max(upto);
    }

    /// The request has generated `generated` output tokens: it takes the
    /// blocks they fill. `false`: no block is free, and the caller preempts
    /// a running request (vLLM preempts the one scheduled last) before
    /// this one goes on.
    pub fn grow(&mut self, running: &mut Running, generated: u64) -> bool {
        if running.epoch != self.epoch || generated <= running.output_room {
            return true;
        }
        let more = (generated - running.output_room).div_ceil(self.block_tokens);
        // A request running alone goes on past the capacity: preempting it
        // would free nothing it could use (a real engine's length limit
        // keeps a request within its cache).
        if more > self.free_blocks() && self.running > 1 {
            return false;
        }
        running.held_unkeyed += more;
        running.output_room += more * self.block_tokens;
        self.held_unkeyed += more;
        self.make_room();
        true
    }

    /// The request finished; it attended `attended_tokens` (what it added
    /// through `attend`). Its blocks are released tail first, so its first
    /// block ends the newest in the cache.
    pub fn finish(&mut self, running: Running, attended_tokens: u64) {
        self.release_blocks(running);
        self.running = self.running.saturating_sub(1);
        self.attended_kv_tokens = self.attended_kv_tokens.saturating_sub(attended_tokens);
    }

    /// The request is preempted to free its blocks (vLLM's recompute
    /// preemption): the cached ones stay cached, nobody holding them; it
    /// runs again from a new `begin_prefill`.
    pub fn preempt(&mut self, running: Running, attended_tokens: u64) {
        self.preemptions += 1;
        self.finish(running, attended_tokens);
    }

    fn release_blocks(&mut self, running: Running) {
        if running.epoch != self.epoch {
            return;
        }
        self.held_unkeyed = self.held_unkeyed.saturating_sub(running.held_unkeyed);
        for block in running.blocks[..running.cached_blocks].iter().rev() {
            self.release(*block);
        }
        self.make_room();
    }

    /// Requests preempted so far.
    pub fn preemptions(&self) -> u64 {
        self.preemptions
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

    /// vLLM's `kv_cache_usage_perc`: the share of blocks running requests
    /// hold (cached blocks nobody holds count as free).
    pub fn kv_usage(&self) -> f64 {
        self.held_blocks() as f64 / self.capacity_blocks as f64
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
             # TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{block_size=\"{}\",num_gpu_blocks=\"{}\"}} 1\n\
             # TYPE process_start_time_seconds gauge\nprocess_start_time_seconds {}\n",
            self.running(),
            self.waiting,
            self.prefix_queries_tokens,
            self.prefix_hits_tokens,
            self.prompt_tokens,
            self.block_tokens,
            self.capacity_blocks,
            self.process_start_time
        )
    }

    /// The same state under SGLang's names. SGLang's own `/metrics` has no
    /// process start time (it is in `/server_info`); the sim shows one anyway
    /// so both namings carry the same restart signal.
    pub fn render_sglang_metrics(&self) -> String {
        let usage = self.kv_usage();
        let capacity_tokens = self.capacity_blocks * self.block_tokens;
        format!(
            "# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{{model_name=\"sim\"}} {}\n\
             # TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs{{model_name=\"sim\"}} {}\n\
             # TYPE sglang:token_usage gauge\nsglang:token_usage{{model_name=\"sim\"}} {usage}\n\
             # TYPE sglang:max_total_num_tokens gauge\nsglang:max_total_num_tokens{{model_name=\"sim\"}} {capacity_tokens}\n\
             # TYPE sglang:page_size gauge\nsglang:page_size{{model_name=\"sim\"}} {}\n\
             # TYPE sglang:cached_tokens counter\nsglang:cached_tokens_total{{cache_source=\"device\",model_name=\"sim\"}} {}\n\
             # TYPE sglang:prompt_tokens counter\nsglang:prompt_tokens_total{{model_name=\"sim\"}} {}\n\
             # TYPE process_start_time_seconds gauge\nprocess_start_time_seconds {}\n",
            self.running(),
            self.waiting,
            self.block_tokens,
            self.prefix_hits_tokens,
            self.prompt_tokens,
            self.process_start_time
        )
    }
}

/// The chained hashes of `tokens`' full blocks, lazily: equal hashes,
/// equal prefixes (the engine's cache keys).
struct Chain<'a> {
    blocks: std::slice::ChunksExact<'a, u32>,
    prev: [u8; 32],
}

impl<'a> Chain<'a> {
    fn new(tokens: &'a [u32], block_tokens: u64) -> Self {
        Self {
            blocks: tokens.chunks_exact(usize::try_from(block_tokens.max(1)).unwrap_or(usize::MAX)),
            prev: [0; 32],
        }
    }
}

impl Iterator for Chain<'_> {
    type Item = [u8; 32];

    fn next(&mut self) -> Option<[u8; 32]> {
        let block = self.blocks.next()?;
        let mut hasher = Sha256::new().chain_update(self.prev);
        for t in block {
            hasher.update(t.to_le_bytes());
        }
        self.prev = hasher.finalize().into();
        Some(self.prev)
    }
}

/// The chained hashes of every full block of `tokens`.
pub fn block_chain(tokens: &[u32], block_tokens: u64) -> Vec<[u8; 32]> {
    Chain::new(tokens, block_tokens).collect()
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

    /// `n` distinct blocks of 16 tokens, starting from `seed`.
    fn prompt(seed: u32, n: usize) -> Vec<u32> {
        (0..n as u32)
            .flat_map(|i| vec![seed + i; BLOCK_TOKENS as usize])
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
        // A partial block is never cached: 18 tokens are 1 block.
        let odd = vec![7u32; 18];
        engine.admit(&odd);
        assert_eq!(engine.admit(&odd).cached_tokens, 16);
    }

    #[test]
    fn gpu_evictions_go_to_the_host_tier_and_come_back_as_hits() {
        // Room for 4 blocks on the GPU and 3 in host memory.
        let mut engine = Engine::new(EngineConfig {
            capacity_tokens: 64,
            host_capacity_blocks: 3,
            ..EngineConfig::default()
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
        let running = engine.begin_prefill(&prompt(1, 1));
        engine.finish(running, 1001);
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
        // One request still running, 15 of 100 blocks held: the usage vLLM
        // reports counts only those.
        let running = engine.begin_prefill(&prompt(300, 15));
        let text = engine.render_vllm_metrics();
        assert!(
            text.contains(&format!("vllm:prefix_cache_queries_total {}\n", prompt_total + 240)),
            "{text}"
        );
        assert!(
            text.contains(&format!("vllm:prefix_cache_hits_total {cached_total}\n")),
            "{text}"
        );
        assert!(text.contains("vllm:num_requests_running 1\n"), "{text}");
        assert!(text.contains("vllm:kv_cache_usage_perc 0.15\n"), "{text}");
        assert!(text.contains("num_gpu_blocks=\"100\""), "{text}");
        let sglang = engine.render_sglang_metrics();
        assert!(
            sglang.contains(&format!(
                "sglang:cached_tokens_total{{cache_source=\"device\",model_name=\"sim\"}} {cached_total}\n"
            )),
            "{sglang}"
        );
        engine.finish(running, 0);
        assert!(engine.render_vllm_metrics().contains("vllm:kv_cache_usage_perc 0\n"));
        engine.enqueue();
        assert!(engine.render_vllm_metrics().contains("vllm:num_requests_waiting 1\n"));
        engine.restart();
        assert_eq!(engine.admit(&a).cached_tokens, 0);
    }

    #[test]
    fn admission_is_refused_past_the_blocks_running_requests_hold() {
        // 10 blocks in all.
        let mut engine = Engine::new(EngineConfig {
            capacity_tokens: 160,
            ..EngineConfig::default()
        });
        let mut a = engine.begin_prefill(&prompt(1, 6));
        engine.cache_computed(&mut a, u64::MAX);
        assert_eq!(engine.free_blocks(), 4);
        // Five more blocks do not fit beside A's six: refused, nothing changed.
        assert!(engine.try_begin_prefill(&prompt(100, 5)).is_none());
        assert_eq!((engine.free_blocks(), engine.running()), (4, 1));
        // A prompt that extends A reuses A's held blocks at no cost: six
        // shared, two new, both fit.
        let mut a_longer = prompt(1, 6);
        a_longer.extend(prompt(50, 2));
        let b = engine.try_begin_prefill(&a_longer).expect("fits");
        assert_eq!(b.served.cached_tokens, 96);
        assert_eq!(engine.free_blocks(), 2);
        // A finishes: its blocks stay cached (B still holds them), and the
        // five-block prompt is still refused until B lets go too.
        engine.finish(a, 0);
        assert!(engine.try_begin_prefill(&prompt(100, 5)).is_none());
        engine.finish(b, 0);
        assert_eq!(engine.free_blocks(), 10);
        let c = engine.try_begin_prefill(&prompt(100, 5)).expect("fits now");
        // C's five blocks took the four empty ones and the oldest of A's
        // six cached ones: A's tail went, its beginning stayed.
        assert_eq!(c.served.cached_tokens, 0);
        assert_eq!(engine.peek_cached_tokens(&prompt(1, 6)), 80);
        // A prompt larger than the whole cache runs when it is alone.
        engine.finish(c, 0);
        assert!(engine.try_begin_prefill(&prompt(500, 12)).is_some());
    }

    #[test]
    fn a_decoding_request_that_needs_a_block_when_none_is_free_is_preempted() {
        let mut engine = Engine::new(EngineConfig {
            capacity_tokens: 160,
            ..EngineConfig::default()
        });
        let mut a = engine.try_begin_prefill(&prompt(1, 5)).expect("fits");
        engine.cache_computed(&mut a, u64::MAX);
        let mut b = engine.try_begin_prefill(&prompt(100, 4)).expect("fits");
        engine.cache_computed(&mut b, u64::MAX);
        assert_eq!(engine.free_blocks(), 1);
        // A's first 16 output tokens take the last free block.
        assert!(engine.grow(&mut a, 16));
        assert_eq!(engine.free_blocks(), 0);
        assert!(engine.grow(&mut a, 16), "within the block it holds");
        // Its 17th needs a block and none is free: the caller preempts B,
        // the request scheduled last, and A goes on.
        assert!(!engine.grow(&mut a, 17));
        engine.preempt(b, 0);
        assert_eq!(engine.preemptions(), 1);
        assert!(engine.grow(&mut a, 17));
        assert_eq!(a.held_blocks(), 7);
        // B's prompt stayed cached but for its tail, whose room A's second
        // output block took. Its cached blocks cost room to run again (they
        // leave the free queue), and there is not enough of it yet.
        assert_eq!(engine.peek_cached_tokens(&prompt(100, 4)), 48);
        assert!(engine.try_begin_prefill(&prompt(100, 4)).is_none());
        engine.finish(a, 0);
        let again = engine.try_begin_prefill(&prompt(100, 4)).expect("fits");
        assert_eq!(again.served.cached_tokens, 48);
    }
}
