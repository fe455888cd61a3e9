//! The simulated GPU cluster on a virtual clock: one engine model per
//! worker (the `kvmesh-sim` engine: prefix cache, LRU, counters) with its
//! timing model (a FIFO prefill queue whose prompts are looked up when
//! their prefill starts and cached chunk by chunk as it computes them;
//! decode steps that read the weights and the batch's KV). With a host
//! tier, a prompt's host hits are loaded back before its prefill computes:
//! the load holds the prefill lane for `tokens / host_load_tokens_per_ms`
//! (vLLM loads asynchronously and may schedule others meanwhile, so this
//! errs slow), and the GPU → host offload of evicted blocks is free (it is
//! asynchronous in vLLM and SGLang, and off the request's path).

use std::collections::VecDeque;

use kvmesh_request::{Api, FilterConfig, understand};
use kvmesh_sim::api::{Api as SimApi, Call};
use kvmesh_sim::engine::{BYTES_PER_TOKEN, Engine, EngineConfig, Prefill};
use kvmesh_sim::timing::{PREFILL_CHUNK_TOKENS, TimingModel};
use serde_json::json;

use super::trace::Request;

/// A request as every policy sees it, prepared once.
#[derive(Debug, Clone)]
pub(crate) struct Prepared {
    pub(crate) index: usize,
    pub(crate) session: String,
    pub(crate) parent: String,
    pub(crate) session_final: bool,
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
            session_final: self.session_final,
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
    if r.session_final {
        headers.push(("x-dynamo-session-final".to_owned(), "true".to_owned()));
    }
    let understood = understand(Api::ChatCompletions, &headers, &bytes, false, config)?;
    let call = Call::parse(SimApi::Chat, &body, r.output_tokens).map_err(anyhow::Error::msg)?;
    Ok(Prepared {
        index,
        session: understood.identity.session_id,
        parent: understood.identity.parent_id,
        session_final: understood.identity.session_final,
        text: r.text.clone(),
        hashes: understood.hashes.hashes,
        last_block_partial: understood.hashes.last_partial,
        stream_bytes: understood.hashes.stream_bytes,
        block_bytes: u32::try_from(config.block_bytes).unwrap_or(u32::MAX),
        sections: understood.sections.iter().map(section).collect(),
        prompt_tokens: (call.prompt.len() as u64).div_ceil(BYTES_PER_TOKEN),
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

/// A request waiting for its worker's prefill lane.
#[derive(Debug)]
struct Waiting {
    index: usize,
    arrival: f64,
    prompt: Vec<u8>,
    output_tokens: u32,
}

/// The prefill running on a worker: its chunks are cached as they finish.
#[derive(Debug)]
struct Prefilling {
    prefill: Prefill,
    /// When the lane took it, and how long loading its host hits took
    /// before it computed.
    start: f64,
    load_ms: f64,
    computed_tokens: u64,
}

/// A request on a worker, from its arrival to its last token. Times not yet
/// known (its prefill has not started) are infinite.
#[derive(Debug, Clone, Copy)]
struct Admitted {
    index: usize,
    first_token: f64,
    end: f64,
    /// Uncached prompt tokens: the cache's answer at arrival until the
    /// prefill starts and looks it up for real.
    uncached: f64,
    /// KV a decode step reads for it, on average over its decode: its
    /// prompt and half its output.
    mean_attended_tokens: f64,
}

#[derive(Debug)]
pub(crate) struct WorkerSim {
    pub(crate) engine: Engine,
    /// Arrived requests waiting for the prefill lane, in arrival order.
    queue: VecDeque<Waiting>,
    prefilling: Option<Prefilling>,
    /// When the prefill lane frees up.
    prefill_free_at: f64,
    /// Requests admitted and not finished (some may have finished by the
    /// time a view looks: views filter by their time).
    admitted: Vec<Admitted>,
    pub(crate) prefill_tokens: u64,
    /// Prompt tokens loaded back from the host tier instead of computed.
    pub(crate) host_loaded_tokens: u64,
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
        self.workers[w].admitted.iter().filter(|a| a.end > self.now).count()
    }

    /// Requests still waiting for (or in) their prefill.
    pub(crate) fn waiting(&self, w: usize) -> usize {
        self.workers[w]
            .admitted
            .iter()
            .filter(|a| a.first_token > self.now)
            .count()
    }

    pub(crate) fn queued_prefill_tokens(&self, w: usize) -> f64 {
        self.workers[w]
            .admitted
            .iter()
            .filter(|a| a.first_token > self.now)
            .map(|a| a.uncached)
            .sum()
    }

    /// Blocks cached over capacity, evictable ones included (not vLLM's
    /// `kv_cache_usage_perc`, which counts those as free).
    #[cfg(test)]
    pub(crate) fn kv_usage(&self, w: usize) -> f64 {
        let (used, capacity) = self.workers[w].engine.cache_blocks();
        used as f64 / capacity.max(1) as f64
    }

    /// The engine's true cache (only the peers fed its KV events may look,
    /// `dynamo*` and `llm_d_precise`, and `kvmesh_pick_time_cache`, which stands for
    /// kvmesh with exact knowledge of each engine's cache).
    pub(crate) fn true_cached_tokens(&self, w: usize, prompt: &[u8]) -> u64 {
        self.workers[w].engine.peek_cached_tokens(prompt)
    }

    /// The engine's true cache on its GPU alone: what the peers fed KV
    /// events (`dynamo*`, `llm_d_precise`) see, their ports having no host
    /// tier (Dynamo's own router weighs host blocks at 0.75; its port does
    /// not yet), so a host tier leaves their view as it was without one.
    pub(crate) fn true_gpu_cached_tokens(&self, w: usize, prompt: &[u8]) -> u64 {
        self.workers[w].engine.peek_gpu_cached_tokens(prompt)
    }

    /// The engine's true cache for `r`, in kvmesh's blocks of `r`'s stream
    /// (the engine counts `BYTES_PER_TOKEN` bytes per token): the overlap
    /// kvmesh's index estimates, as the engine knows it.
    pub(crate) fn true_cached_blocks(&self, w: usize, r: &Prepared) -> usize {
        self.true_cached_tier_blocks(w, r).0
    }

    /// `true_cached_blocks`, and how many of them the engine holds in its
    /// host tier only (`kvmesh_pick_time_cache`'s view of the tiers).
    pub(crate) fn true_cached_tier_blocks(&self, w: usize, r: &Prepared) -> (usize, usize) {
        let (tokens, host) = self.workers[w].engine.peek_cached_tiers(&r.prompt);
        let blocks =
            |t: u64| usize::try_from(t * BYTES_PER_TOKEN / u64::from(r.block_bytes.max(1))).unwrap_or(usize::MAX);
        let (all, gpu) = (blocks(tokens), blocks(tokens - host));
        (all, all - gpu.min(all))
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

/// A request whose prefill has started: its fate is known from here.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Started {
    pub(crate) index: usize,
    pub(crate) served: Served,
}

/// The cluster of simulated workers on a virtual clock, driven in time
/// order: `admit` a request at its arrival, `advance` to the next event
/// (`next_event_ms`: a prefill starting or a prefill chunk done).
#[derive(Debug)]
pub(crate) struct World {
    pub(crate) workers: Vec<WorkerSim>,
    timing: TimingModel,
}

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

impl World {
    #[cfg(test)]
    pub(crate) fn new(workers: usize, capacity_tokens: u64, timing: TimingModel) -> Self {
        Self::tiered(workers, capacity_tokens, 0, timing)
    }

    /// `new`, each engine with a host tier of `host_capacity_blocks` blocks
    /// of 16 tokens (0: none).
    pub(crate) fn tiered(workers: usize, capacity_tokens: u64, host_capacity_blocks: u64, timing: TimingModel) -> Self {
        Self {
            workers: (0..workers)
                .map(|_| WorkerSim {
                    engine: Engine::new(EngineConfig {
                        capacity_tokens,
                        host_capacity_blocks,
                    }),
                    queue: VecDeque::new(),
                    prefilling: None,
                    prefill_free_at: 0.0,
                    admitted: Vec::new(),
                    prefill_tokens: 0,
                    host_loaded_tokens: 0,
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

    /// `r` arrives on worker `w` at `now` (the world advanced to `now`): it
    /// joins the prefill queue, and starts at once if the lane is free.
    pub(crate) fn admit(&mut self, w: usize, r: &Prepared, now: f64) -> Vec<Started> {
        let worker = &mut self.workers[w];
        worker.admitted.retain(|a| a.end > now);
        let cached = worker.engine.peek_cached_tokens(&r.prompt).min(r.prompt_tokens);
        worker.admitted.push(Admitted {
            index: r.index,
            first_token: f64::INFINITY,
            end: f64::INFINITY,
            uncached: (r.prompt_tokens - cached) as f64,
            mean_attended_tokens: r.prompt_tokens as f64 + f64::from(r.output_tokens) / 2.0,
        });
        worker.queue.push_back(Waiting {
            index: r.index,
            arrival: now,
            prompt: r.prompt.clone(),
            output_tokens: r.output_tokens,
        });
        let mut started = Vec::new();
        self.advance_worker(w, now, &mut started);
        started
    }

    /// The earliest time something happens on some worker.
    pub(crate) fn next_event_ms(&self) -> Option<f64> {
        self.workers
            .iter()
            .filter_map(|w| self.next_event_of(w))
            .min_by(f64::total_cmp)
    }

    fn next_event_of(&self, w: &WorkerSim) -> Option<f64> {
        if let Some(p) = &w.prefilling {
            return Some(self.chunk_done_at(p));
        }
        w.queue.front().map(|q| q.arrival.max(w.prefill_free_at))
    }

    /// When the running prefill's next chunk is computed.
    fn chunk_done_at(&self, p: &Prefilling) -> f64 {
        let uncached = p.prefill.served.uncached_tokens();
        let next = (p.computed_tokens + PREFILL_CHUNK_TOKENS).min(uncached);
        p.start + p.load_ms + ms(self.timing.prefill(next))
    }

    /// Everything due by `t` happens, on every worker: the prefills that
    /// start (returned, with their fate) and the chunks that are cached.
    pub(crate) fn advance(&mut self, t: f64) -> Vec<Started> {
        let mut started = Vec::new();
        for w in 0..self.workers.len() {
            self.advance_worker(w, t, &mut started);
        }
        started
    }

    fn advance_worker(&mut self, w: usize, t: f64, started: &mut Vec<Started>) {
        let timing = self.timing;
        loop {
            let Some(next) = self.next_event_of(&self.workers[w]) else {
                return;
            };
            if next > t {
                return;
            }
            let worker = &mut self.workers[w];
            if let Some(p) = worker.prefilling.as_mut() {
                let uncached = p.prefill.served.uncached_tokens();
                p.computed_tokens = (p.computed_tokens + PREFILL_CHUNK_TOKENS).min(uncached);
                let computed = if p.computed_tokens >= uncached {
                    u64::MAX
                } else {
                    p.computed_tokens
                };
                worker.engine.cache_computed(&mut p.prefill, computed);
                if p.prefill.done() || computed == u64::MAX {
                    worker.prefilling = None;
                }
                continue;
            }
            let Some(waiting) = worker.queue.pop_front() else {
                return;
            };
            started.push(Self::start_prefill(&timing, w, worker, waiting, next));
        }
    }

    /// The lane takes `waiting` at `start`: the cache is looked up now, the
    /// first token comes after the uncached tokens are computed, and each
    /// decode step reads the weights and the KV of the batch decoding then.
    fn start_prefill(timing: &TimingModel, w: usize, worker: &mut WorkerSim, waiting: Waiting, start: f64) -> Started {
        let prefill = worker.engine.begin_prefill(&waiting.prompt);
        // The world keeps its own account of running requests (`admitted`);
        // the engine's counter is for the server's metrics.
        worker.engine.finish(0);
        let served = prefill.served;
        let uncached = served.uncached_tokens();
        let load_ms = ms(timing.host_load(served.host_loaded_tokens));
        let first_token = start + load_ms + ms(timing.prefill(uncached));
        worker.prefill_free_at = first_token;
        let batch: f64 = worker
            .admitted
            .iter()
            .filter(|a| a.first_token <= first_token && a.end > first_token)
            .map(|a| a.mean_attended_tokens)
            .sum();
        let own = served.prompt_tokens as f64 + f64::from(waiting.output_tokens) / 2.0;
        let step = ms(timing.decode_step((batch + own).round() as u64));
        let end = first_token + f64::from(waiting.output_tokens) * step;
        if let Some(a) = worker.admitted.iter_mut().rev().find(|a| a.index == waiting.index) {
            a.first_token = first_token;
            a.end = end;
            a.uncached = uncached as f64;
        }
        worker.prefill_tokens += uncached;
        worker.host_loaded_tokens += served.host_loaded_tokens;
        if uncached > 0 {
            worker.prefilling = Some(Prefilling {
                prefill,
                start,
                load_ms,
                computed_tokens: 0,
            });
        }
        Started {
            index: waiting.index,
            served: Served {
                worker: w,
                prompt_tokens: served.prompt_tokens,
                cached_tokens: served.cached_tokens,
                ttft_ms: first_token - waiting.arrival,
                end_ms: end,
            },
        }
    }

    /// Runs `r` on worker `w` arriving at `now`, and the worker on until
    /// `r`'s first token (its blocks are then cached): a request's fate in
    /// one call, for tests that set a scene.
    #[cfg(test)]
    pub(crate) fn serve(&mut self, w: usize, r: &Prepared, now: f64) -> Served {
        let mut started = self.admit(w, r, now);
        loop {
            if let Some(s) = started.iter().find(|s| s.index == r.index) {
                let served = s.served;
                let first_token = now + served.ttft_ms;
                let mut rest = Vec::new();
                self.advance_worker(w, first_token, &mut rest);
                return served;
            }
            let Some(next) = self.next_event_of(&self.workers[w]) else {
                unreachable!("request {} was admitted and never started", r.index);
            };
            self.advance_worker(w, next, &mut started);
        }
    }
}
