//! The simulated GPU cluster on a virtual clock: one engine model per
//! worker (the `kvmesh-sim` engine: its own BPE tokenizer, KV blocks held
//! by running requests, a prefix cache of the rest, counters) with its
//! timing model (a FIFO prefill queue whose head is admitted when its
//! blocks fit beside the running requests', looked up when its prefill
//! starts and cached chunk by chunk as it computes; decode steps that read
//! the weights and the batch's KV, a block's worth of output taking a block; a
//! decoding request that needs a block when none is free preempts the
//! newest decoding request, which is queued again at the front and
//! recomputed, as vLLM's recompute preemption does). With a host
//! tier, a prompt's host hits are loaded back before its prefill computes:
//! the load holds the prefill lane for `tokens / host_load_tokens_per_ms`
//! (vLLM loads asynchronously and may schedule others meanwhile, so this
//! errs slow), and the GPU → host offload of evicted blocks is free (it is
//! asynchronous in vLLM and SGLang, and off the request's path).

use std::collections::VecDeque;
use std::sync::Arc;

use kvmesh_request::{Api, FilterConfig, understand};
use kvmesh_sim::api::{Api as SimApi, Call};
use kvmesh_sim::engine::{Engine, EngineConfig, Running};
use kvmesh_sim::timing::{PREFILL_CHUNK_TOKENS, TimingModel};
use kvmesh_sim::tokenizer::Tokenizer;
use serde_json::json;

use super::trace::Request;

/// `Prepared::block_ends`' step, in tokens: every engine block size the
/// simulator takes is a multiple of it.
pub(crate) const BLOCK_END_TOKENS: u64 = 16;

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
    /// The engine's view: its templated prompt's length in bytes, and its
    /// tokens.
    pub(crate) prompt_bytes: u64,
    pub(crate) tokens: Arc<[u32]>,
    /// Where each 16 tokens of `tokens` end in the templated prompt, in
    /// bytes (engine blocks are a multiple of 16 tokens).
    pub(crate) block_ends: Vec<u64>,
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
pub(crate) fn prepare(
    index: usize,
    r: &Request,
    config: &FilterConfig,
    tokenizer: &mut Tokenizer,
) -> anyhow::Result<Prepared> {
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
    let tokens = tokenizer.encode(&call.prompt);
    let block_ends = tokenizer
        .byte_ends(&tokens)
        .into_iter()
        .skip(BLOCK_END_TOKENS as usize - 1)
        .step_by(BLOCK_END_TOKENS as usize)
        .collect();
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
        sections: understood.sections.clone(),
        prompt_tokens: tokens.len() as u64,
        prompt_bytes: call.prompt.len() as u64,
        tokens: tokens.into(),
        block_ends,
        output_tokens: r.output_tokens,
    })
}

/// A request waiting for its worker's prefill lane.
#[derive(Debug, Clone)]
struct Waiting {
    index: usize,
    arrival: f64,
    tokens: Arc<[u32]>,
    output_tokens: u32,
    /// Output tokens generated before a preemption, recomputed with the
    /// prompt (0: never preempted; its first token is still to come).
    generated: u32,
}

/// The prefill running on a worker: its chunks are cached as they finish.
#[derive(Debug, Clone)]
struct Prefilling {
    index: usize,
    running: Running,
    /// When the lane took it, and how long loading its host hits took
    /// before it computed.
    start: f64,
    load_ms: f64,
    /// This prefill's jitter: its compute takes this many times the model's.
    slowdown: f64,
    computed_tokens: u64,
    /// Tokens the prefill computes: the uncached prompt, and the output a
    /// preempted request had generated.
    to_compute: u64,
}

/// A request decoding on a worker (its prefill may still be computing:
/// the first token comes when it is done).
#[derive(Debug, Clone)]
struct Decoding {
    index: usize,
    /// Taken from the prefill when it is done.
    running: Option<Running>,
    first_token: f64,
    end: f64,
    step_ms: f64,
    /// Output tokens before this run (a preempted request's), and in all.
    generated_before: u32,
    output_tokens: u32,
    /// Its place in the order requests were scheduled: the newest is
    /// preempted first.
    scheduled: u64,
    arrival: f64,
    tokens: Arc<[u32]>,
}

impl Decoding {
    /// Output tokens generated by `t`.
    fn generated_at(&self, t: f64) -> u32 {
        if t <= self.first_token {
            return self.generated_before;
        }
        let steps = ((t - self.first_token) / self.step_ms.max(1e-9)).floor();
        let more = u32::try_from(steps as u64).unwrap_or(u32::MAX);
        (self.generated_before + 1 + more).min(self.output_tokens)
    }

    /// When its output next needs a block it does not hold: when the token
    /// past its room is generated.
    fn next_block_at(&self) -> f64 {
        let Some(running) = &self.running else {
            return f64::INFINITY;
        };
        let room = running.output_room();
        if room >= u64::from(self.output_tokens) {
            return f64::INFINITY;
        }
        let need = u32::try_from(room + 1).unwrap_or(u32::MAX);
        // Token `need` (1-based) comes `need - before - 1` steps after the
        // first one of this run.
        let steps = f64::from(need.saturating_sub(self.generated_before + 1));
        self.first_token + steps * self.step_ms
    }
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

#[derive(Debug, Clone)]
pub(crate) struct WorkerSim {
    pub(crate) engine: Engine,
    /// Arrived requests waiting for the prefill lane, in arrival order.
    queue: VecDeque<Waiting>,
    prefilling: Option<Prefilling>,
    /// When the prefill lane frees up.
    prefill_free_at: f64,
    /// Requests past admission, not finished.
    decoding: Vec<Decoding>,
    /// Requests scheduled so far (orders `Decoding::scheduled`).
    scheduled: u64,
    /// The engine's noise, if any (`World::jittered`).
    jitter: Option<Jitter>,
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
    timing: TimingModel,
}

impl View<'_> {
    pub(crate) fn workers(&self) -> usize {
        self.workers.len()
    }

    /// `r`'s fate on worker `w` if it arrived there now, as far as it is
    /// known now (`WorkerSim::replay_forward`): `greedy_oracle`'s view.
    pub(crate) fn replay_forward(&self, w: usize, r: &Prepared) -> Option<(Served, Vec<[u8; 32]>)> {
        self.workers[w].replay_forward(&self.timing, r, self.now)
    }

    /// Time to compute one engine block, in ms.
    pub(crate) fn block_compute_ms(&self) -> f64 {
        self.timing.compute_ms(self.block_tokens())
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

    /// Blocks cached or held over capacity, evictable ones included (not
    /// vLLM's `kv_cache_usage_perc`, which counts those as free).
    #[cfg(test)]
    pub(crate) fn kv_usage(&self, w: usize) -> f64 {
        let (used, capacity) = self.workers[w].engine.cache_blocks();
        used as f64 / capacity.max(1) as f64
    }

    /// The engine's true cache (only the peers fed its KV events may look,
    /// `dynamo*` and `llm_d_precise`, and `kvmesh_pick_time_cache`, which stands for
    /// kvmesh with exact knowledge of each engine's cache).
    pub(crate) fn true_cached_tokens(&self, w: usize, tokens: &[u32]) -> u64 {
        self.workers[w].engine.peek_cached_tokens(tokens)
    }

    /// The engine's true cache on its GPU alone: what the peers fed KV
    /// events (`dynamo*`, `llm_d_precise`) see, their ports having no host
    /// tier (Dynamo's own router weighs host blocks at 0.75; its port does
    /// not yet), so a host tier leaves their view as it was without one.
    pub(crate) fn true_gpu_cached_tokens(&self, w: usize, tokens: &[u32]) -> u64 {
        self.workers[w].engine.peek_gpu_cached_tokens(tokens)
    }

    /// The engine's true cache for `r`, in kvmesh's blocks of `r`'s stream
    /// (the bytes of the prompt its cached tokens span, in kvmesh's block
    /// size): the overlap kvmesh's index estimates, as the engine knows it.
    pub(crate) fn true_cached_blocks(&self, w: usize, r: &Prepared) -> usize {
        self.true_cached_tier_blocks(w, r).0
    }

    /// `true_cached_blocks`, and how many of them the engine holds in its
    /// host tier only (`kvmesh_pick_time_cache`'s view of the tiers).
    pub(crate) fn true_cached_tier_blocks(&self, w: usize, r: &Prepared) -> (usize, usize) {
        let (tokens, host) = self.workers[w].engine.peek_cached_tiers(&r.tokens);
        let blocks = |t: u64| {
            let steps = usize::try_from(t / BLOCK_END_TOKENS).unwrap_or(usize::MAX);
            let bytes = steps
                .checked_sub(1)
                .and_then(|last| r.block_ends.get(last))
                .copied()
                .unwrap_or(0);
            usize::try_from(bytes / u64::from(r.block_bytes.max(1))).unwrap_or(usize::MAX)
        };
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

    /// vLLM's `kv_cache_usage_perc`: the share of blocks running requests
    /// hold.
    pub(crate) fn kv_cache_usage_perc(&self, w: usize) -> f64 {
        self.workers[w].engine.kv_usage()
    }

    /// The engines' block size in tokens (`vllm:cache_config_info`'s
    /// `block_size`; a router's `--block-size` is set to match it).
    pub(crate) fn block_tokens(&self) -> u64 {
        self.workers.first().map_or(16, |w| w.engine.block_tokens())
    }
}

/// One request's fate.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Served {
    pub(crate) worker: usize,
    pub(crate) prompt_tokens: u64,
    pub(crate) cached_tokens: u64,
    pub(crate) ttft_ms: f64,
    /// When it ended: its expected end while it runs, final once it has
    /// `Finished` (a preemption moves it later).
    pub(crate) end_ms: f64,
}

/// A request whose prefill has started: its first token's time is known.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Started {
    pub(crate) index: usize,
    pub(crate) served: Served,
}

/// What happened on a worker.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Event {
    /// A request's first prefill started (a preempted one's rerun is not
    /// reported again).
    Started(Started),
    /// A request generated its last token and released its blocks.
    Finished { index: usize, end_ms: f64 },
}

/// The cluster of simulated workers on a virtual clock, driven in time
/// order: `admit` a request at its arrival, `advance` to the next event
/// (`next_event_ms`: a prefill starting or a chunk done, a request
/// finishing or needing a block for its output).
#[derive(Debug, Clone)]
pub(crate) struct World {
    pub(crate) workers: Vec<WorkerSim>,
    timing: TimingModel,
}

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Slack for the float arithmetic of decode steps: a token due at `t` is
/// counted at `t`.
const STEP_EPSILON: f64 = 1e-6;

impl World {
    #[cfg(test)]
    pub(crate) fn new(workers: usize, capacity_tokens: u64, timing: TimingModel) -> Self {
        Self::with_engines(
            workers,
            EngineConfig {
                capacity_tokens,
                ..EngineConfig::default()
            },
            timing,
        )
    }

    /// `workers` engines of `engine`'s shape.
    pub(crate) fn with_engines(workers: usize, engine: EngineConfig, timing: TimingModel) -> Self {
        Self {
            workers: (0..workers)
                .map(|_| WorkerSim {
                    engine: Engine::new(engine),
                    queue: VecDeque::new(),
                    prefilling: None,
                    prefill_free_at: 0.0,
                    decoding: Vec::new(),
                    scheduled: 0,
                    jitter: None,
                    admitted: Vec::new(),
                    prefill_tokens: 0,
                    host_loaded_tokens: 0,
                })
                .collect(),
            timing,
        }
    }

    /// Every prefill's and every decode's time multiplied by a draw of
    /// `exp(σ·z − σ²/2)`, `z` standard normal (mean 1: a real engine's run
    /// to run noise), seeded per worker from `seed`. σ 0: none.
    pub(crate) fn jittered(mut self, sigma: f64, seed: u64) -> Self {
        if sigma > 0.0 {
            for (w, worker) in self.workers.iter_mut().enumerate() {
                worker.jitter = Some(Jitter::new(sigma, seed, w as u64));
            }
        }
        self
    }

    pub(crate) fn view(&self, now: f64) -> View<'_> {
        View {
            now,
            workers: &self.workers,
            timing: self.timing,
        }
    }

    /// `r` arrives on worker `w` at `now` (the world advanced to `now`): it
    /// joins the prefill queue, and starts at once if the lane is free and
    /// its blocks fit.
    pub(crate) fn admit(&mut self, w: usize, r: &Prepared, now: f64) -> Vec<Event> {
        let worker = &mut self.workers[w];
        worker.arrive(r, now);
        let mut events = Vec::new();
        worker.advance(&self.timing, w, now, &mut events);
        events
    }

    /// The earliest time something happens on some worker.
    pub(crate) fn next_event_ms(&self) -> Option<f64> {
        self.workers
            .iter()
            .filter_map(|w| w.next_event(&self.timing))
            .min_by(f64::total_cmp)
    }

    /// Everything due by `t` happens, on every worker.
    pub(crate) fn advance(&mut self, t: f64) -> Vec<Event> {
        let mut events = Vec::new();
        for (w, worker) in self.workers.iter_mut().enumerate() {
            worker.advance(&self.timing, w, t, &mut events);
        }
        events
    }
}

/// An engine's run-to-run noise: a seeded log-normal factor of mean 1.
#[derive(Debug, Clone)]
pub(crate) struct Jitter {
    sigma: f64,
    state: u64,
}

impl Jitter {
    pub(crate) fn new(sigma: f64, seed: u64, worker: u64) -> Self {
        let state =
            (seed ^ 0x9e37_79b9_7f4a_7c15).wrapping_mul(worker.wrapping_add(1).wrapping_mul(0xbf58_476d_1ce4_e5b9));
        Self {
            sigma,
            state: state | 1,
        }
    }

    /// Uniform in (0, 1) (xorshift64*).
    fn uniform(&mut self) -> f64 {
        self.state ^= self.state >> 12;
        self.state ^= self.state << 25;
        self.state ^= self.state >> 27;
        let x = self.state.wrapping_mul(0x2545_f491_4f6c_dd1d);
        ((x >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    pub(crate) fn factor(&mut self) -> f64 {
        // Box-Muller.
        let (u1, u2) = (self.uniform(), self.uniform());
        let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
        (self.sigma * z - self.sigma * self.sigma / 2.0).exp()
    }
}

/// When the running prefill's next chunk is computed.
fn chunk_done_at(timing: &TimingModel, p: &Prefilling) -> f64 {
    let next = (p.computed_tokens + PREFILL_CHUNK_TOKENS).min(p.to_compute);
    p.start + p.load_ms + ms(timing.prefill(next)) * p.slowdown
}

/// One worker's machinery: what `World` runs on each, and what a forward
/// replay runs on a copy of one.
impl WorkerSim {
    /// `r` joins the prefill queue at `now`.
    fn arrive(&mut self, r: &Prepared, now: f64) {
        self.admitted.retain(|a| a.end > now);
        let cached = self.engine.peek_cached_tokens(&r.tokens).min(r.prompt_tokens);
        self.admitted.push(Admitted {
            index: r.index,
            first_token: f64::INFINITY,
            end: f64::INFINITY,
            uncached: (r.prompt_tokens - cached) as f64,
            mean_attended_tokens: r.prompt_tokens as f64 + f64::from(r.output_tokens) / 2.0,
        });
        self.queue.push_back(Waiting {
            index: r.index,
            arrival: now,
            tokens: r.tokens.clone(),
            output_tokens: r.output_tokens,
            generated: 0,
        });
    }

    /// When something next happens here.
    fn next_event(&self, timing: &TimingModel) -> Option<f64> {
        let mut next = f64::INFINITY;
        if let Some(p) = &self.prefilling {
            next = next.min(chunk_done_at(timing, p));
        } else if let Some(q) = self.queue.front()
            && self.engine.admits(&q.tokens)
        {
            next = next.min(q.arrival.max(self.prefill_free_at));
        }
        for d in &self.decoding {
            if d.running.is_some() {
                next = next.min(d.end).min(d.next_block_at());
            }
        }
        next.is_finite().then_some(next)
    }

    /// Everything due here by `t` happens (`w`: this worker's index, for
    /// the events).
    fn advance(&mut self, timing: &TimingModel, w: usize, t: f64, events: &mut Vec<Event>) {
        loop {
            let Some(now) = self.next_event(timing) else {
                return;
            };
            if now > t {
                return;
            }
            let chunk_due = self
                .prefilling
                .as_ref()
                .is_some_and(|p| chunk_done_at(timing, p) <= now);
            self.grow_outputs(now);
            self.finish_due(now, events);
            if chunk_due {
                self.compute_chunk();
                continue;
            }
            if self.prefilling.is_none()
                && self.prefill_free_at <= now
                && self.queue.front().is_some_and(|q| q.arrival <= now)
                && let Some(event) = self.start_prefill(timing, w, now)
            {
                events.push(event);
            }
        }
    }

    /// What `r` would meet here arriving at `now`: this worker replayed
    /// forward on a copy (its queue, its engine's real evictions, the
    /// outputs growing) until `r`'s first token, beside the same worker
    /// replayed to that time without `r`. Arrivals after `now` are not
    /// known, so none is played. Returns `r`'s fate and the blocks the
    /// worker holds then without `r` and lacks with it: those `r` evicted.
    pub(crate) fn replay_forward(
        &self,
        timing: &TimingModel,
        r: &Prepared,
        now: f64,
    ) -> Option<(Served, Vec<[u8; 32]>)> {
        let mut with = self.clone();
        with.arrive(r, now);
        let mut events = Vec::new();
        let served = loop {
            if let Some(served) = events.iter().find_map(|e| match e {
                Event::Started(s) if s.index == r.index => Some(s.served),
                _ => None,
            }) {
                break served;
            }
            let next = with.next_event(timing)?;
            with.advance(timing, 0, next, &mut events);
        };
        let first_token = now + served.ttft_ms;
        with.advance(timing, 0, first_token, &mut events);
        let mut without = self.clone();
        without.advance(timing, 0, first_token, &mut events);
        let kept: std::collections::HashSet<&[u8; 32]> = with.engine.gpu_blocks().collect();
        let evicted = without
            .engine
            .gpu_blocks()
            .filter(|b| !kept.contains(b))
            .copied()
            .collect();
        Some((served, evicted))
    }

    /// Every decoding request takes the blocks its output has filled by
    /// `now`, oldest first; one that finds none free preempts the newest
    /// decoding request (itself, if it is the newest).
    fn grow_outputs(&mut self, now: f64) {
        let mut order: Vec<(u64, usize)> = self
            .decoding
            .iter()
            .filter(|d| d.running.is_some())
            .map(|d| (d.scheduled, d.index))
            .collect();
        order.sort_unstable();
        for (_, index) in order {
            while let Some(d) = self.decoding.iter_mut().find(|d| d.index == index) {
                let generated = u64::from(d.generated_at(now + STEP_EPSILON));
                let Some(running) = d.running.as_mut() else {
                    break;
                };
                if self.engine.grow(running, generated) {
                    break;
                }
                let Some(victim) = self
                    .decoding
                    .iter()
                    .filter(|d| d.running.is_some())
                    .max_by_key(|d| d.scheduled)
                    .map(|d| d.index)
                else {
                    break;
                };
                self.preempt(victim, now);
                if victim == index {
                    break;
                }
            }
        }
    }

    /// Recompute preemption: the request lets its blocks go and waits at
    /// the head of the queue, with the output it has generated so far.
    fn preempt(&mut self, index: usize, now: f64) {
        let Some(at) = self.decoding.iter().position(|d| d.index == index) else {
            return;
        };
        let d = self.decoding.swap_remove(at);
        let generated = d.generated_at(now + STEP_EPSILON);
        if let Some(running) = d.running {
            self.engine.preempt(running, 0);
        }
        if let Some(a) = self.admitted.iter_mut().rev().find(|a| a.index == index) {
            a.end = f64::INFINITY;
        }
        self.queue.push_front(Waiting {
            index,
            arrival: d.arrival,
            tokens: d.tokens,
            output_tokens: d.output_tokens,
            generated,
        });
    }

    /// The requests whose last token is due by `now` finish.
    fn finish_due(&mut self, now: f64, events: &mut Vec<Event>) {
        let mut i = 0;
        while i < self.decoding.len() {
            let d = &self.decoding[i];
            if d.running.is_none() || d.end > now {
                i += 1;
                continue;
            }
            let d = self.decoding.swap_remove(i);
            if let Some(running) = d.running {
                self.engine.finish(running, 0);
            }
            events.push(Event::Finished {
                index: d.index,
                end_ms: d.end,
            });
        }
    }

    /// The running prefill's next chunk is computed: its full blocks are
    /// cached; the last one hands the request to decode.
    fn compute_chunk(&mut self) {
        let Some(p) = self.prefilling.as_mut() else {
            return;
        };
        p.computed_tokens = (p.computed_tokens + PREFILL_CHUNK_TOKENS).min(p.to_compute);
        let finished = p.computed_tokens >= p.to_compute;
        let computed = if finished { u64::MAX } else { p.computed_tokens };
        self.engine.cache_computed(&mut p.running, computed);
        if finished && let Some(p) = self.prefilling.take() {
            if let Some(d) = self.decoding.iter_mut().find(|d| d.index == p.index) {
                d.running = Some(p.running);
            } else {
                self.engine.finish(p.running, 0);
            }
        }
    }

    /// The lane takes the queue's head at `start` if its blocks fit: the
    /// cache is looked up now, the first token comes after the uncached
    /// tokens are computed, and each decode step reads the weights and the
    /// KV of the batch decoding then.
    fn start_prefill(&mut self, timing: &TimingModel, w: usize, start: f64) -> Option<Event> {
        let waiting = self.queue.front()?;
        let mut running = self.engine.try_begin_prefill(&waiting.tokens)?;
        let waiting = self.queue.pop_front()?;
        let generated = u64::from(waiting.generated);
        if generated > 0 {
            // Room for the output it had generated (overcommitted if none).
            let _ = self.engine.grow(&mut running, generated);
        }
        let served = running.served;
        let uncached = served.uncached_tokens();
        let to_compute = uncached + generated;
        let load_ms = ms(timing.host_load(served.host_loaded_tokens));
        let slowdown = self.jitter.as_mut().map_or(1.0, Jitter::factor);
        let first_token = start + load_ms + ms(timing.prefill(to_compute)) * slowdown;
        self.prefill_free_at = first_token;
        let batch: f64 = self
            .admitted
            .iter()
            .filter(|a| a.first_token <= first_token && a.end > first_token)
            .map(|a| a.mean_attended_tokens)
            .sum();
        let own = served.prompt_tokens as f64 + f64::from(waiting.output_tokens) / 2.0;
        let step_ms =
            ms(timing.decode_step((batch + own).round() as u64)) * self.jitter.as_mut().map_or(1.0, Jitter::factor);
        let left = waiting.output_tokens.saturating_sub(waiting.generated);
        let end = first_token + f64::from(left) * step_ms;
        if let Some(a) = self.admitted.iter_mut().rev().find(|a| a.index == waiting.index) {
            if waiting.generated == 0 {
                a.first_token = first_token;
                a.uncached = uncached as f64;
            }
            a.end = end;
        }
        self.prefill_tokens += to_compute;
        self.host_loaded_tokens += served.host_loaded_tokens;
        self.scheduled += 1;
        let mut decoding = Decoding {
            index: waiting.index,
            running: None,
            first_token,
            end,
            step_ms,
            generated_before: waiting.generated,
            output_tokens: waiting.output_tokens,
            scheduled: self.scheduled,
            arrival: waiting.arrival,
            tokens: waiting.tokens,
        };
        if to_compute > 0 {
            self.prefilling = Some(Prefilling {
                index: waiting.index,
                running,
                start,
                load_ms,
                slowdown,
                computed_tokens: 0,
                to_compute,
            });
        } else {
            decoding.running = Some(running);
        }
        self.decoding.push(decoding);
        (waiting.generated == 0).then_some(Event::Started(Started {
            index: waiting.index,
            served: Served {
                worker: w,
                prompt_tokens: served.prompt_tokens,
                cached_tokens: served.cached_tokens,
                ttft_ms: first_token - waiting.arrival,
                end_ms: end,
            },
        }))
    }
}

impl World {
    /// Runs `r` on worker `w` arriving at `now`, and the worker on until
    /// `r`'s first token (its blocks are then cached): a request's fate in
    /// one call, for tests that set a scene.
    #[cfg(test)]
    pub(crate) fn serve(&mut self, w: usize, r: &Prepared, now: f64) -> Served {
        let mut events = self.admit(w, r, now);
        loop {
            let started = events.iter().find_map(|e| match e {
                Event::Started(s) if s.index == r.index => Some(s.served),
                _ => None,
            });
            if let Some(served) = started {
                let first_token = now + served.ttft_ms;
                let mut rest = Vec::new();
                self.workers[w].advance(&self.timing, w, first_token, &mut rest);
                return served;
            }
            let Some(next) = self.workers[w].next_event(&self.timing) else {
                unreachable!("request {} was admitted and never started", r.index);
            };
            self.workers[w].advance(&self.timing, w, next, &mut events);
        }
    }
}
