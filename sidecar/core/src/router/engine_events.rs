//! What an engine's own KV cache events tell the router: its resident
//! blocks, the blocks it evicts as it evicts them, and cache wipes. The
//! engine's blocks are its tokens and kvmesh's are bytes of the canonical
//! stream, so no block can be matched to another; counts can, converted at
//! the worker's engine tokens per kvmesh block (as its capacity is).

use super::Router;
use super::fleet::WorkerId;

/// One batch of an engine's KV events, summarised by the edge that reads
/// them (it dedupes hashes, so a block stored twice counts once).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineCacheChange {
    /// Blocks newly resident, and blocks the engine removed from its
    /// primary cache, after the last clear in the batch.
    pub stored_blocks: u64,
    pub removed_blocks: u64,
    /// The engine's tokens per block (vLLM's CPU backend: 128); 0 when the
    /// events have not said yet.
    pub engine_block_tokens: u32,
    /// The engine dropped its whole cache (`AllBlocksCleared`, or a
    /// restarted publisher).
    pub cleared: bool,
    /// The engine's resident blocks after the batch, when the events are
    /// known complete; `None` after a lost message.
    pub resident_blocks: Option<u64>,
    /// The engine has a host tier: its events named one (vLLM's medium
    /// "CPU"), in this batch or before.
    pub host_tier: bool,
    /// Of `removed_blocks`, those whose host copy stays: off the GPU, still
    /// a (partial) hit.
    pub removed_to_host_blocks: u64,
    /// Host copies removed while the GPU held none: host-only blocks gone.
    pub host_only_removed_blocks: u64,
    /// The engine's host-only blocks after the batch, when known complete.
    pub host_only_blocks: Option<u64>,
}

/// What applying one change did to the index.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineCacheEffect {
    /// Blocks forgotten because the cache was cleared.
    pub wiped: usize,
    /// Oldest blocks evicted in step with the engine's removals (moved to
    /// the host tier or forgotten).
    pub evicted: usize,
    /// Of those, the ones moved to the host tier.
    pub demoted: usize,
    /// Host-only blocks forgotten in step with the engine's host removals.
    pub host_evicted: usize,
}

impl Router {
    /// Applies one batch of worker `id`'s KV events. A clear wipes the
    /// worker as a restart does, but for the newest blocks kvmesh placed
    /// that the same batch stored after it. Removals evict the worker's oldest blocks
    /// in step with the engine, instead of waiting for a miss to shrink the
    /// estimate: down to the engine's resident blocks converted to kvmesh
    /// blocks (at `engine tokens per block / tokens per kvmesh block`) when
    /// the events know them; else `removed` converted the same way
    /// (fractions carried to the next batch). Never more: an index already
    /// held to the capacity evicted on insert, and evicting again for the
    /// same removal would empty it.
    pub fn engine_events(&mut self, id: WorkerId, change: &EngineCacheChange) -> EngineCacheEffect {
        let mut effect = EngineCacheEffect::default();
        if id.0 >= self.workers.len() {
            return effect;
        }
        let tokens_per_block = self.tokens_per_block(id);
        let Some(worker) = self.workers.get_mut(id.0) else {
            return effect;
        };
        let placed_since = std::mem::take(&mut worker.placed_since_events);
        if change.engine_block_tokens > 0 {
            worker.engine_block_tokens = Some(change.engine_block_tokens);
        }
        // The engine's block size, unknown until its events name it; none
        // either while the bytes per token are not sane.
        let engine_block_tokens = worker
            .engine_block_tokens
            .filter(|_| tokens_per_block > 0.0 && tokens_per_block.is_finite())
            .map(f64::from);
        if change.cleared {
            worker.removal_carry = 0.0;
            worker.host_removal_carry = 0.0;
            // vLLM publishes a reset with the events of its next step, the
            // first after it: by then kvmesh may have placed the requests
            // of that step, whose blocks the same batch stores. They are
            // the newest kvmesh placed there, since the worker's previous
            // batch, and stay; wiping them too sent a session's second
            // call away from the blocks its first had just computed
            // (docs/benchmarks.md, the agents run). At most what the batch
            // stored, and only blocks placed since the previous batch: an
            // older block was stored before the reset.
            let stored_since = change.resident_blocks.unwrap_or(change.stored_blocks);
            let stored = engine_block_tokens.map_or(0, |tokens| {
                (stored_since as f64 * tokens / tokens_per_block).floor() as usize
            });
            effect.wiped = self.forget_cache_keeping_newest(id, stored.min(placed_since));
        }
        let Some(worker) = self.workers.get_mut(id.0) else {
            return effect;
        };
        worker.engine_host_only_blocks = change.host_only_blocks;
        worker.engine_resident_blocks = change.resident_blocks;
        let Some(engine_block_tokens) = engine_block_tokens else {
            return effect;
        };
        let per_engine_block = engine_block_tokens / tokens_per_block;
        worker.removal_carry += change.removed_blocks as f64 * per_engine_block;
        let due = worker.removal_carry.floor();
        worker.removal_carry -= due;
        let due = due as usize;
        let len = self.index.len(id);
        let evict = match change.resident_blocks {
            // The engine is evicting, so it is full: it holds exactly its
            // resident blocks, and the index can hold no more than those
            // converted. It placed more (a prompt's partial tail block,
            // which the engine never caches; the template's tokens): they go.
            Some(resident) if change.removed_blocks > 0 => {
                len.saturating_sub((resident as f64 * per_engine_block).ceil() as usize)
            }
            // Not evicting: nothing to follow.
            Some(_) => 0,
            // Residency unknown (a lost message): follow the removals alone.
            None => due,
        };
        // The engine keeps a host copy of some of what it removes: as many
        // of the evicted blocks move to the host tier, the oldest first.
        let keep = if change.removed_blocks == 0 {
            0
        } else {
            let kept = change.removed_to_host_blocks.min(change.removed_blocks) as f64 / change.removed_blocks as f64;
            (evict as f64 * kept).round() as usize
        };
        if change.host_tier && self.index.host_capacity(id) == 0 {
            // The events bound the host list (below); the index's budget
            // bounds it whatever they say.
            self.index.set_host_capacity(id, usize::MAX);
        }
        effect.demoted = if change.host_tier {
            self.index.demote_oldest(id, keep)
        } else {
            0
        };
        effect.evicted = effect.demoted + self.index.drop_oldest(id, evict - effect.demoted);
        if change.host_tier {
            effect.host_evicted = self.follow_host_removals(id, change, per_engine_block);
        }
        effect
    }

    /// Holds the worker's host-only blocks to the engine's, converted, when
    /// the events know them, else drops as many as the engine removed.
    fn follow_host_removals(&mut self, id: WorkerId, change: &EngineCacheChange, per_engine_block: f64) -> usize {
        let Some(worker) = self.workers.get_mut(id.0) else {
            return 0;
        };
        worker.host_removal_carry += change.host_only_removed_blocks as f64 * per_engine_block;
        let due = worker.host_removal_carry.floor();
        worker.host_removal_carry -= due;
        let host_len = self.index.host_len(id);
        let drop = match change.host_only_blocks {
            Some(resident) => host_len.saturating_sub((resident as f64 * per_engine_block).ceil() as usize),
            None => due as usize,
        };
        self.index.drop_oldest_host(id, drop)
    }
}
