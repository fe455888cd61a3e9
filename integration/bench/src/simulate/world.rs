//! The simulated GPU cluster on a virtual clock: one engine model per
//! worker (the `kvmesh-sim` engine: prefix cache, LRU, counters) with its
//! timing model (a FIFO prefill queue, decode steps slowed by the batch).

use kvmesh_request::{Api, FilterConfig, understand};
use kvmesh_sim::api::{Api as SimApi, Call};
use kvmesh_sim::engine::{Engine, EngineConfig};
use kvmesh_sim::timing::TimingModel;
use serde_json::json;

use super::trace::Request;

/// A request as every policy sees it, prepared once.
#[derive(Debug, Clone)]
pub(crate) struct Prepared {
    pub(crate) index: usize,
    pub(crate) session: String,
    pub(crate) parent: String,
    pub(crate) text: String,
    /// kvmesh's view: the filter's own canonicalization and hashes.
    pub(crate) hashes: Vec<u64>,
    pub(crate) last_block_partial: bool,
    pub(crate) stream_bytes: u64,
    /// The block size the hashes were cut with (the filter config's).
    pub(crate) block_bytes: u32,
    /// The parts of the canonical stream, for the insight figures.
    pub(crate) sections: Vec<kvmesh_core::PromptSection>,
    /// The engine's view: its templated prompt.
    pub(crate) prompt: Vec<u8>,
    pub(crate) prompt_tokens: u64,
    pub(crate) output_tokens: u32,
}

impl Prepared {
    /// The request as kvmesh's router sees it at `now_ms`.
    pub(crate) fn pick_input(&self, now_ms: u64) -> kvmesh_core::PickInput<'_> {
        kvmesh_core::PickInput {
            block_hashes: &self.hashes,
            last_block_partial: self.last_block_partial,
            block_bytes: self.block_bytes,
            prompt_bytes: self.stream_bytes,
            session_id: &self.session,
            parent_id: &self.parent,
            model: "sim",
            now_ms,
            ..kvmesh_core::PickInput::default()
        }
    }
}

/// Turns a trace request into what the filter and the engine see of it:
/// an OpenAI chat call carrying the text, with the session in a header.
pub(crate) fn prepare(index: usize, r: &Request, config: &FilterConfig) -> anyhow::Result<Prepared> {
    let body =
        json!({"model": "sim", "messages": [{"role": "user", "content": r.text}], "max_tokens": r.output_tokens});
    let bytes = serde_json::to_vec(&body)?;
    let mut headers = Vec::new();
    if !r.session.is_empty() {
        headers.push(("x-session-id".to_owned(), r.session.clone()));
    }
    if !r.parent.is_empty() {
        headers.push(("x-parent-session-id".to_owned(), r.parent.clone()));
    }
    let understood = understand(Api::ChatCompletions, &headers, &bytes, false, config)?;
    let call = Call::parse(SimApi::Chat, &body, r.output_tokens).map_err(anyhow::Error::msg)?;
    Ok(Prepared {
        index,
        session: understood.identity.session_id,
        parent: understood.identity.parent_id,
        text: r.text.clone(),
        hashes: understood.hashes.hashes,
        last_block_partial: understood.hashes.last_partial,
        stream_bytes: understood.hashes.stream_bytes,
        block_bytes: u32::try_from(config.block_bytes).unwrap_or(u32::MAX),
        sections: understood.sections.iter().map(section).collect(),
        prompt_tokens: (call.prompt.len() as u64).div_ceil(4),
        prompt: call.prompt,
        output_tokens: r.output_tokens,
    })
}

fn section(s: &kvmesh_request::Section) -> kvmesh_core::PromptSection {
    kvmesh_core::PromptSection {
        kind: s.kind,
        index: s.index,
        start: s.start,
        digest: s.digest,
    }
}

#[derive(Debug)]
pub(crate) struct WorkerSim {
    pub(crate) engine: Engine,
    /// When the prefill queue frees up.
    prefill_free_at: f64,
    /// (first token, end, uncached tokens, prompt tokens) of admitted requests.
    admitted: Vec<(f64, f64, f64, f64)>,
    pub(crate) prefill_tokens: u64,
}

/// What a policy may look at when it picks.
#[derive(Debug)]
pub(crate) struct View<'a> {
    pub(crate) now: f64,
    workers: &'a [WorkerSim],
}

impl View<'_> {
    pub(crate) fn workers(&self) -> usize {
        self.workers.len()
    }

    /// Requests admitted and not finished.
    pub(crate) fn in_flight(&self, w: usize) -> usize {
        self.workers[w].admitted.iter().filter(|a| a.1 > self.now).count()
    }

    /// Requests still waiting for (or in) their prefill.
    pub(crate) fn waiting(&self, w: usize) -> usize {
        self.workers[w].admitted.iter().filter(|a| a.0 > self.now).count()
    }

    pub(crate) fn queued_prefill_tokens(&self, w: usize) -> f64 {
        self.workers[w]
            .admitted
            .iter()
            .filter(|a| a.0 > self.now)
            .map(|a| a.2)
            .sum()
    }

    /// Blocks cached over capacity, evictable ones included (not vLLM's
    /// `kv_cache_usage_perc`, which counts those as free).
    #[cfg(test)]
    pub(crate) fn kv_usage(&self, w: usize) -> f64 {
        let (used, capacity) = self.workers[w].engine.cache_blocks();
        used as f64 / capacity.max(1) as f64
    }

    /// The engine's true cache (only the peers fed its KV events may look:
    /// `dynamo*`, `llm_d_precise`).
    pub(crate) fn true_cached_tokens(&self, w: usize, prompt: &[u8]) -> u64 {
        self.workers[w].engine.peek_cached_tokens(prompt)
    }
}

/// What the peer ports read of an engine beyond the above, each what that
/// peer's own deployment reads (kept apart so the engine model can change
/// under them).
impl View<'_> {
    /// vLLM's `num_gpu_blocks` (the `vllm:cache_config_info` gauge's label):
    /// the engine's KV capacity in blocks, which GIE's AutoTune sizes its
    /// per-server LRU from.
    pub(crate) fn num_gpu_blocks(&self, w: usize) -> u64 {
        self.workers[w].engine.cache_blocks().1
    }
}

/// One request's fate.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Served {
    pub(crate) worker: usize,
    pub(crate) prompt_tokens: u64,
    pub(crate) cached_tokens: u64,
    pub(crate) ttft_ms: f64,
    pub(crate) end_ms: f64,
}

/// The cluster of simulated workers.
#[derive(Debug)]
pub(crate) struct World {
    pub(crate) workers: Vec<WorkerSim>,
    timing: TimingModel,
}

impl World {
    pub(crate) fn new(workers: usize, capacity_tokens: u64, timing: TimingModel) -> Self {
        Self {
            workers: (0..workers)
                .map(|_| WorkerSim {
                    engine: Engine::new(EngineConfig { capacity_tokens }),
                    prefill_free_at: 0.0,
                    admitted: Vec::new(),
                    prefill_tokens: 0,
                })
                .collect(),
            timing,
        }
    }

    pub(crate) fn view(&self, now: f64) -> View<'_> {
        View {
            now,
            workers: &self.workers,
        }
    }

    /// Runs `r` on worker `w` arriving at `now`: the cache is looked up and
    /// filled on admission, the prefill waits for the queue, decode steps
    /// last as long as the batch at its first token makes them.
    pub(crate) fn serve(&mut self, w: usize, r: &Prepared, now: f64) -> Served {
        let timing = self.timing;
        let worker = &mut self.workers[w];
        worker.admitted.retain(|a| a.1 > now);
        let served = worker.engine.admit(&r.prompt);
        worker.engine.finish();
        let uncached = served.uncached_tokens();
        let start = now.max(worker.prefill_free_at);
        let first_token = start + timing.prefill(uncached).as_secs_f64() * 1e3;
        worker.prefill_free_at = first_token;
        let running = worker.admitted.iter().filter(|a| a.1 > first_token).count() as u64 + 1;
        let end = first_token + f64::from(r.output_tokens) * timing.decode_step(running).as_secs_f64() * 1e3;
        worker
            .admitted
            .push((first_token, end, uncached as f64, served.prompt_tokens as f64));
        worker.prefill_tokens += uncached;
        Served {
            worker: w,
            prompt_tokens: served.prompt_tokens,
            cached_tokens: served.cached_tokens,
            ttft_ms: first_token - now,
            end_ms: end,
        }
    }
}
