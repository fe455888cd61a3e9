//! The closed loop: what each outcome teaches the router about a worker
//! (its prefill throughput, its effective cache capacity) and about a model
//! (its bytes per token), and which outcomes are believed at all.

use super::Router;
use super::decision::Outcome;
use crate::usage::{MAX_BYTES_PER_TOKEN, UsageError, check_usage};

/// The smallest prefill that teaches a worker's prefill throughput: below
/// it the fixed part of the time to first byte (routing, scheduling, the
/// first decode step) dominates and the rate would read far too slow.
const MIN_TOKENS_TO_LEARN_RATE: f64 = 1024.0;

/// Weight a learned rate keeps on each observation, and the weight the
/// observation gets (together 1; both written out so the arithmetic is
/// exactly that of `0.8 · old + 0.2 · new`). A time to first byte varies a
/// lot call to call (queueing, batch mix): about five observations make
/// the estimate, so one outlier moves it a fifth of the way.
pub(crate) const RATE_KEEP: f64 = 0.8;
pub(crate) const RATE_LEARN: f64 = 0.2;

/// Bounds of an observed prefill throughput, tokens per ms: a time to
/// first byte of 1 ms for a huge prefill, or of minutes for a tiny one, is
/// a measurement error, and one must not pin the learned rate.
const MIN_OBSERVED_TOKENS_PER_MS: f64 = 0.1;
const MAX_OBSERVED_TOKENS_PER_MS: f64 = 1e6;

/// The engine counts its own tokens in its own blocks, over its chat
/// template rather than kvmesh's canonical stream, so a prediction of
/// cached blocks is only good to a margin: this fraction of the prediction
/// (1/4), plus a few blocks. Inside it nothing is corrected (correcting
/// noise would shrink every worker a little on every call).
const PREDICTION_MARGIN_DIVISOR: usize = 4;
const PREDICTION_MARGIN_BLOCKS: usize = 2;

impl Router {
    /// Applies the outcome of a pick; unknown or repeated picks are ignored.
    ///
    /// The closed loop: when the engine cached fewer tokens than predicted
    /// for a call placed on its session's home, the model's picture of that
    /// worker is too big. Dropping just the
    /// missing blocks changes nothing (the request re-inserts them), so the
    /// shortfall is taken as evidence about the worker's effective capacity:
    /// under LRU, if the engine lost blocks the model still had, it lost
    /// every older block too. The oldest entries go, and the capacity
    /// estimate shrinks to what survives; it grows back slowly when the
    /// engine cached more than predicted.
    ///
    /// Usage that fails [`Router::check_usage`] releases the pick but
    /// teaches nothing.
    pub fn report(&mut self, outcome: Outcome) -> bool {
        self.report_answered(outcome, None)
    }

    /// `report` of an outcome that arrived at `answered_ms`: the session's
    /// idle time (what retention learns) starts there.
    pub fn report_at(&mut self, outcome: Outcome, answered_ms: u64) -> bool {
        self.report_answered(outcome, Some(answered_ms))
    }

    /// `report`, telling retention when the call was answered if known:
    /// the removed pending pick hands it its session (no copy of the id).
    fn report_answered(&mut self, outcome: Outcome, answered_ms: Option<u64>) -> bool {
        let usage_ok = self.check_usage(&outcome).is_ok();
        let Some(p) = self.pending.remove(&outcome.pick_id) else {
            return false;
        };
        if let Some(answered_ms) = answered_ms
            && let Some(session) = p.session
        {
            self.retention.on_answer(&mut self.sessions, session, answered_ms);
        }
        self.retire(outcome.pick_id, &p);
        // Prefill throughput: the uncached tokens over the time to first
        // byte (queueing included, so it errs towards slower).
        if outcome.ttfb_ms > 0
            && p.uncached_tokens >= MIN_TOKENS_TO_LEARN_RATE
            && let Some(w) = self.workers.get_mut(p.worker.0)
        {
            let observed = (p.uncached_tokens / f64::from(outcome.ttfb_ms))
                .clamp(MIN_OBSERVED_TOKENS_PER_MS, MAX_OBSERVED_TOKENS_PER_MS);
            let rate = &mut w.load.prefill_tokens_per_ms;
            *rate = if *rate > 0.0 {
                RATE_KEEP * *rate + RATE_LEARN * observed
            } else {
                observed
            };
        }
        if !usage_ok {
            return true;
        }
        if let Some(prompt_tokens) = outcome.prompt_tokens.filter(|t| *t > 0)
            && p.prompt_bytes > 0
        {
            let observed = (p.prompt_bytes as f64 / prompt_tokens as f64).clamp(1.0, MAX_BYTES_PER_TOKEN as f64);
            self.bytes_per_token.learn(&p.model, observed);
            self.convert_engine_capacity(p.worker);
        }
        if let Some(cached_tokens) = outcome.cached_tokens {
            let block_tokens = f64::from(p.block_bytes) / self.bytes_per_token(&p.model);
            let cached_blocks = (cached_tokens as f64 / block_tokens).floor() as usize;
            let worker = p.worker;
            let len = self.index.len(worker);
            let capacity = self.index.capacity(worker);
            let margin = p.predicted_blocks / PREDICTION_MARGIN_DIVISOR + PREDICTION_MARGIN_BLOCKS;
            // A shortfall shrinks the worker only on a session's own home.
            // Elsewhere the predicted blocks were another conversation's:
            // kvmesh's canonical stream puts the tools before the system
            // prompt, most chat templates put the system text first, so two
            // sessions whose tools match and whose system prompts differ
            // (Claude Code's carries the user's home directory) share blocks
            // in kvmesh's picture that the engine never shared. Measured with
            // the real Claude Code 2.1.197 on three simulated workers: the
            // shortfall on two new sessions' first calls shrank the worker
            // they shared, and their second calls moved away from the KV
            // their first calls had just computed (`eviction` moves).
            if p.on_home && cached_blocks + margin < p.predicted_blocks {
                let shortfall = p.predicted_blocks - cached_blocks;
                let survive = len.saturating_sub(shortfall).max(1);
                self.index.set_capacity(worker, survive.min(capacity));
            } else if cached_blocks > p.predicted_blocks + margin {
                let ceiling = self.workers.get(worker.0).map_or(capacity, |w| w.capacity_ceiling);
                let grown = capacity.saturating_add(cached_blocks - p.predicted_blocks);
                self.index.set_capacity(worker, grown.min(ceiling));
            }
        }
        true
    }

    /// The worker a pending pick was placed on.
    pub fn picked_worker(&self, pick_id: u64) -> Option<super::WorkerId> {
        self.pending.get(&pick_id).map(|p| p.worker)
    }

    /// Whether an outcome's usage can be believed: against the absolute
    /// bounds, and against its Pick's prompt when the pick is still pending
    /// and was not truncated.
    pub fn check_usage(&self, outcome: &Outcome) -> Result<(), UsageError> {
        let prompt_bytes = self
            .pending
            .get(&outcome.pick_id)
            .filter(|p| !p.truncated)
            .map(|p| p.prompt_bytes);
        check_usage(prompt_bytes, outcome.prompt_tokens, outcome.cached_tokens)
    }

    /// Bytes per token learned for `model` (else the default).
    pub fn bytes_per_token(&self, model: &str) -> f64 {
        self.bytes_per_token
            .get(model)
            .unwrap_or(self.config.default_bytes_per_token)
    }

    /// Models with a learned bytes per token (at most `max_models`).
    pub fn models(&self) -> usize {
        self.bytes_per_token.len()
    }
}
