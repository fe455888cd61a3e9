//! How long an engine takes, as functions of the work: prefill time grows
//! with the uncached prompt tokens, and each decode step grows with the
//! number of sequences decoding together (continuous batching shares the
//! GPU's memory bandwidth among them). Prefills queue behind each other.
//!
//! Defaults stand for one H100 (80 GB) serving a ~30B dense model in BF16
//! with vLLM: about 20,000 prompt tokens per second of prefill and about
//! 15 ms per decode step at small batch (≈ 65 tokens/s per sequence), each
//! further running sequence adding ~2 % to the step. Sources: vLLM's and
//! SGLang's published H100 benchmarks for 30B-class models (prefill 15-25k
//! tokens/s, single-stream decode 50-80 tokens/s); the contention slope is
//! the usual memory-bound fit (a step reads the weights once plus each
//! sequence's KV).

use std::time::Duration;

/// The engine's speed. All durations are multiplied by `time_scale`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimingModel {
    pub prefill_tokens_per_ms: f64,
    /// A decode step with one running sequence.
    pub decode_step_ms: f64,
    /// Extra step time per additional running sequence, as a fraction.
    pub contention_per_sequence: f64,
    /// Fixed time before the first token (scheduling, first step).
    pub first_token_overhead_ms: f64,
    pub time_scale: f64,
}

impl Default for TimingModel {
    fn default() -> Self {
        Self {
            prefill_tokens_per_ms: 20.0,
            decode_step_ms: 15.0,
            contention_per_sequence: 0.02,
            first_token_overhead_ms: 5.0,
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
        self.scaled(self.first_token_overhead_ms + uncached_tokens as f64 / self.prefill_tokens_per_ms.max(1e-9))
    }

    /// One decode step while `running` sequences decode together.
    pub fn decode_step(&self, running: u64) -> Duration {
        let others = running.saturating_sub(1) as f64;
        self.scaled(self.decode_step_ms * (1.0 + self.contention_per_sequence * others))
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
    fn decode_steps_slow_down_with_contention_and_scale() {
        let t = TimingModel::default();
        assert_eq!(t.decode_step(1), Duration::from_millis(15));
        assert_eq!(t.decode_step(51), Duration::from_millis(30));
        let fast = TimingModel { time_scale: 0.1, ..t };
        assert_eq!(fast.decode_step(1), Duration::from_micros(1500));
        let instant = TimingModel { time_scale: 0.0, ..t };
        assert_eq!(instant.prefill(1_000_000), Duration::ZERO);
    }
}
