//! How long an engine takes, as functions of the work: prefill time grows
//! with the uncached prompt tokens (prefills queue behind each other, and a
//! prompt's blocks become cacheable chunk by chunk as they are computed);
//! a decode step reads the weights once and every KV byte the running
//! batch attends, so it grows with the batch's context, not only its size.
//!
//! Defaults stand for one H100 SXM (80 GB, HBM3 at 3.35 TB/s) serving an
//! 8B dense model in BF16 (Llama-3.1-8B's shape) with vLLM; the figures and
//! their sources are in docs/simulator.md:
//! - weights: 8.03 B parameters × 2 bytes ≈ 16.06 GB read per step;
//! - KV per token: 32 layers × 8 KV heads × 128 head dim × 2 (K and V) × 2
//!   bytes = 131,072 bytes;
//! - prefill: 20,000 tokens/s, about a third of the H100's dense BF16
//!   989 TFLOPS at 2 × 8.03 GFLOP per token (attention over long agent
//!   contexts and kernel efficiency take the rest).
//!
//! A step with one 1,000-token sequence takes (16.06 GB + 0.13 GB) / 3.35
//! TB/s ≈ 4.8 ms; eight sequences of 17k tokens attend 17.8 GB more and take
//! ≈ 10.1 ms.

use std::time::Duration;

/// Prompt tokens computed per prefill chunk: a prompt's blocks enter the
/// cache a chunk at a time, as the engine computes them (the order of
/// vLLM's chunked-prefill token budget, `max_num_batched_tokens`).
pub const PREFILL_CHUNK_TOKENS: u64 = 2048;

/// The engine's speed. All durations are multiplied by `time_scale`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimingModel {
    pub prefill_tokens_per_ms: f64,
    /// Bytes of weights every decode step reads.
    pub weight_bytes: f64,
    /// KV bytes per token of context (layers × KV heads × head dim × K and
    /// V × bytes per value).
    pub kv_bytes_per_token: f64,
    /// Memory bandwidth, in bytes per ms.
    pub memory_bytes_per_ms: f64,
    /// Fixed time before the first token (scheduling, first step).
    pub first_token_overhead_ms: f64,
    /// Loading offloaded KV from host memory back to the GPU, in tokens per
    /// ms (the host tier's transfer cost; see `HOST_LOAD_BYTES_PER_MS`).
    pub host_load_tokens_per_ms: f64,
    pub time_scale: f64,
}

/// Llama-3.1-8B on one H100 SXM: see the module's note.
pub const H100_8B_WEIGHT_BYTES: f64 = 8.03e9 * 2.0;
pub const H100_8B_KV_BYTES_PER_TOKEN: f64 = 32.0 * 8.0 * 128.0 * 2.0 * 2.0;
/// 3.35 TB/s, in bytes per ms.
pub const H100_MEMORY_BYTES_PER_MS: f64 = 3.35e12 / 1e3;
/// Host → GPU copies at 25 GB/s, in bytes per ms: PCIe 4.0 x16 signals
/// 31.5 GB/s per direction and pinned-memory copies reach about 80 % of it
/// (PCIe 5.0 hosts, as an H100 SXM's, reach about twice that: the default
/// errs slow). At 131,072 KV bytes per token that is ~190.7 tokens per ms,
/// against 20 of prefill: a host hit costs ~10 % of recomputing.
pub const HOST_LOAD_BYTES_PER_MS: f64 = 25e9 / 1e3;

impl Default for TimingModel {
    fn default() -> Self {
        Self {
            prefill_tokens_per_ms: 20.0,
            weight_bytes: H100_8B_WEIGHT_BYTES,
            kv_bytes_per_token: H100_8B_KV_BYTES_PER_TOKEN,
            memory_bytes_per_ms: H100_MEMORY_BYTES_PER_MS,
            first_token_overhead_ms: 5.0,
            host_load_tokens_per_ms: HOST_LOAD_BYTES_PER_MS / H100_8B_KV_BYTES_PER_TOKEN,
            time_scale: 1.0,
        }
    }
}

impl TimingModel {
    fn scaled(&self, ms: f64) -> Duration {
        Duration::from_secs_f64((ms * self.time_scale.max(0.0)).max(0.0) / 1e3)
    }

    /// Prefill of `uncached_tokens` (cached ones cost nothing to recompute).
    pub fn prefill(&self, uncached_tokens: u64) -> Duration {
        self.scaled(self.first_token_overhead_ms + self.compute_ms(uncached_tokens))
    }

    /// Loading `tokens` of offloaded KV back from the host tier.
    pub fn host_load(&self, tokens: u64) -> Duration {
        self.scaled(self.host_load_ms(tokens))
    }

    /// `host_load`, in unscaled ms.
    pub fn host_load_ms(&self, tokens: u64) -> f64 {
        tokens as f64 / self.host_load_tokens_per_ms.max(1e-9)
    }

    /// Computing `tokens` prompt tokens, without the fixed overhead, in
    /// unscaled ms: when each chunk of a prefill is done.
    pub fn compute_ms(&self, tokens: u64) -> f64 {
        tokens as f64 / self.prefill_tokens_per_ms.max(1e-9)
    }

    /// One decode step while the running batch attends `attended_kv_tokens`
    /// tokens of KV in all (every sequence's context so far).
    pub fn decode_step(&self, attended_kv_tokens: u64) -> Duration {
        self.scaled(self.decode_step_ms(attended_kv_tokens))
    }

    /// `decode_step`, in unscaled ms.
    pub fn decode_step_ms(&self, attended_kv_tokens: u64) -> f64 {
        let bytes = self.weight_bytes + attended_kv_tokens as f64 * self.kv_bytes_per_token;
        bytes / self.memory_bytes_per_ms.max(1e-9)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_grows_with_uncached_tokens_only() {
        let t = TimingModel::default();
        assert_eq!(t.prefill(0), Duration::from_millis(5));
        assert_eq!(t.prefill(20_000), Duration::from_millis(1005));
        assert!(t.prefill(4_000) > t.prefill(2_000));
    }

    #[test]
    fn decode_steps_read_the_weights_and_every_attended_kv_byte() {
        let t = TimingModel::default();
        // The weights alone: 16.06 GB at 3.35 TB/s.
        let empty = t.decode_step_ms(0);
        assert!((empty - 4.794).abs() < 0.01, "{empty}");
        // 128 KiB per token: 100k attended tokens add 13.1 GB, 3.9 ms.
        let loaded = t.decode_step_ms(100_000);
        assert!((loaded - empty - 3.913).abs() < 0.01, "{loaded}");
        // Twice the context, twice the KV time.
        assert!((t.decode_step_ms(200_000) - empty - 2.0 * (loaded - empty)).abs() < 1e-9);
        let fast = TimingModel { time_scale: 0.1, ..t };
        assert!(fast.decode_step(0) < t.decode_step(0) / 9);
        let instant = TimingModel { time_scale: 0.0, ..t };
        assert_eq!(instant.prefill(1_000_000), Duration::ZERO);
        assert_eq!(instant.decode_step(1_000_000), Duration::ZERO);
    }
}
