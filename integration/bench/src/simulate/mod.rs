//! `kvmesh-bench simulate`: every policy on the same workload, on a virtual
//! clock, deterministic for a seed. kvmesh runs through the same core API as
//! the sidecar, each request hashed by the filter's own code; the engines are
//! the `kvmesh-sim` engine model.

mod bound;
mod oracle;
mod play;
mod plot;
mod policies;
mod radix;
mod schedule;
mod summary;
pub(crate) mod trace;
mod world;

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::bail;
use kvmesh_core::{Call, Cost, Decision, Holdings, InsightConfig, Insights, Totals, WorkerId};
use kvmesh_request::FilterConfig;
use kvmesh_sim::timing::TimingModel;
use serde_json::json;

use self::oracle::Picker;
use self::play::{Completion, Play};
use self::schedule::Schedule;
use self::world::{Prepared, Served, World};

#[derive(Debug, clap::Args)]
pub(crate) struct Options {
    #[command(flatten)]
    workload: trace::WorkloadArgs,
    #[arg(long, default_value_t = 8)]
    workers: usize,
    /// KV capacity per worker, in tokens.
    #[arg(long, default_value_t = 1_000_000)]
    capacity_tokens: u64,
    /// A host tier per worker of this many engine blocks (16 tokens each):
    /// blocks evicted from the GPU go there (LRU), and a hit there is loaded
    /// back instead of recomputed. 0: none.
    #[arg(long, default_value_t = 0)]
    host_tier_blocks: u64,
    /// Host → GPU load speed, in tokens per ms (default: 25 GB/s of PCIe at
    /// the engine model's 131,072 KV bytes per token, ~190.7).
    #[arg(long)]
    host_load_tokens_per_ms: Option<f64>,
    /// The engines' KV block, in tokens (a multiple of 16): vLLM's default
    /// on GPUs is 16, its CPU backend's 128.
    #[arg(long, default_value_t = 16)]
    engine_block_tokens: u64,
    /// The engines' prefill speed, uncached prompt tokens per ms (default:
    /// the H100 model's 20).
    #[arg(long)]
    prefill_tokens_per_ms: Option<f64>,
    /// A decode step's time with an empty batch, in ms (the weights' read;
    /// default: the H100 model's ~4.8).
    #[arg(long)]
    decode_step_ms: Option<f64>,
    /// Time before a prefill computes anything, in ms (default 5).
    #[arg(long)]
    first_token_ms: Option<f64>,
    /// Each prefill's and decode's time varies by a seeded log-normal
    /// factor of mean 1 and this σ (a real engine's run-to-run noise; 0:
    /// none, the default).
    #[arg(long, default_value_t = 0.0)]
    engine_jitter: f64,
    /// `all`, or a comma-separated list of policy names.
    #[arg(long, default_value = "all")]
    policies: String,
    /// One seed: the same as `--seeds N`.
    #[arg(long, conflicts_with = "seeds")]
    seed: Option<u64>,
    /// Seeds to run every policy on (`1-5`, `1,4,7`, `3`; default 1); the
    /// figures are their mean and range. A seed sets the policies'
    /// randomness and shifts each root session's start by up to the mean
    /// gap between root session starts; `{seed}` in `--trace` loads one
    /// workload per seed (e.g. `gen-agents --seed S` files).
    #[arg(long)]
    seeds: Option<String>,
    /// A session's next call is sent when its previous call completes plus
    /// the recorded gap (the default for text traces with sessions).
    #[arg(long, conflicts_with = "open_loop")]
    closed_loop: bool,
    /// Every call is sent at its recorded time, whatever the engines do
    /// (the default for traces without sessions, as Mooncake's).
    #[arg(long)]
    open_loop: bool,
    /// Root sessions start at their recorded times, as `replay` sends them
    /// (the seed then sets only the policies' randomness).
    #[arg(long)]
    no_jitter: bool,
    /// Write the results as JSON here (and a plot beside it, as .svg).
    #[arg(long)]
    json: Option<PathBuf>,
}

/// The simulated cluster's shape.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Fleet {
    pub(crate) workers: usize,
    pub(crate) capacity_tokens: u64,
    /// Each worker's host tier, in engine blocks (0: none).
    pub(crate) host_tier_blocks: u64,
    /// The engines' KV block, in tokens.
    pub(crate) block_tokens: u64,
    /// σ of the engines' log-normal noise (0: none).
    pub(crate) jitter: f64,
}

impl Fleet {
    /// Each worker's engine.
    fn engine(&self) -> kvmesh_sim::engine::EngineConfig {
        kvmesh_sim::engine::EngineConfig {
            capacity_tokens: self.capacity_tokens,
            block_tokens: self.block_tokens,
            host_capacity_blocks: self.host_tier_blocks,
        }
    }
}

/// The outcome as the filter would report it, to the insight ledger.
impl Completion {
    fn report_to(&self, insights: &mut Insights, prepared: &[Prepared]) {
        insights.on_outcome(
            self.index as u64,
            Some(prepared[self.index].prompt_tokens),
            Some(self.cached),
            Some(WorkerId(self.worker)),
            self.end as u64,
        );
    }
}

/// The simulated fleet as the insight ledger reads it: the engines' true
/// caches, not any policy's belief, so every policy is judged alike.
struct SimFleet<'a> {
    world: &'a World,
    now: f64,
    /// A session's last full block → that request, to ask the engine
    /// whether its prefix is still cached.
    last_blocks: &'a HashMap<u64, usize>,
    prepared: &'a [Prepared],
}

impl SimFleet<'_> {
    /// The ledger's questions, answered by the engines.
    fn holdings(&self, probes: &[(WorkerId, u64)]) -> Holdings {
        Holdings::new(
            probes
                .iter()
                .map(|&(worker, block)| ((worker, block), self.holds(worker, block))),
        )
    }

    fn holds(&self, worker: WorkerId, block: u64) -> bool {
        let Some(r) = self.last_blocks.get(&block).and_then(|&i| self.prepared.get(i)) else {
            return false;
        };
        let cached = self.world.view(self.now).true_cached_tokens(worker.0, &r.tokens);
        // Most of the prefix is still there.
        2 * cached >= r.prompt_tokens
    }
}

/// A call sent this long after its session's previous call ended returns
/// from a long tool wait (its KV had that long to be evicted).
const LONG_GAP_MS: f64 = 30_000.0;

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// One policy's run: its figures, its TTFTs (sorted), and each call's send
/// time and fate by index.
pub(crate) struct Run {
    pub(crate) result: serde_json::Value,
    pub(crate) ttft: Vec<f64>,
    /// Read by the closed-loop tests.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) calls: Vec<Option<(f64, Served)>>,
}

/// Plays the workload against one policy on the virtual clock: calls are
/// sent as the schedule releases them (a closed-loop call once the call it
/// follows has completed), the world advances event by event, and
/// completions reach the policy before anything later is picked.
pub(crate) fn run_policy(
    name: &str,
    prepared: &[Prepared],
    schedule: &Schedule,
    fleet: Fleet,
    seed: u64,
    timing: TimingModel,
) -> anyhow::Result<Run> {
    let Some(mut picker) = Picker::make(name, fleet, seed, timing) else {
        bail!("unknown policy {name:?}; known: {}", policies::ALL.join(", "));
    };
    picker.policy().workload(prepared, fleet.block_tokens);
    let world = World::with_engines(fleet.workers, fleet.engine(), timing).jittered(fleet.jitter, seed);
    if fleet.host_tier_blocks > 0 {
        picker
            .policy()
            .host_tier(fleet.host_tier_blocks.saturating_mul(fleet.block_tokens));
    }
    let mut play = Play::new(prepared, schedule, world);
    let mut insights = Insights::new(InsightConfig::default());
    let mut last_blocks: HashMap<u64, usize> = HashMap::new();
    let mut picked = 0usize;
    let progress = std::io::IsTerminal::is_terminal(&std::io::stderr());
    while let Some((r, now)) = play.next_call(picker.policy(), |c| c.report_to(&mut insights, prepared)) {
        picked += 1;
        if progress && (picked.is_multiple_of(256) || picked == prepared.len()) {
            eprint!("\r{name:<20} {:>5.1}%", 100.0 * picked as f64 / prepared.len() as f64);
        }
        let w = picker.pick(r, &play, now).min(fleet.workers - 1);
        let world = &play.world;
        let overlaps: Vec<usize> = (0..fleet.workers)
            .map(|x| world.view(now).true_cached_blocks(x, r))
            .collect();
        let sim_fleet = SimFleet {
            world,
            now,
            last_blocks: &last_blocks,
            prepared,
        };
        let input = r.pick_input(now as u64);
        let call = Call {
            input,
            harness: kvmesh_core::Harness::Other,
            tenant: "",
            sections: &r.sections,
        };
        let holdings = sim_fleet.holdings(insights.probe(&call).as_slice());
        // The record of the pick as the engines' truth has it.
        let record = Decision {
            pick_id: r.index as u64,
            ranked: vec![WorkerId(w)],
            predicted_cached_blocks: u32::try_from(overlaps.get(w).copied().unwrap_or(0)).unwrap_or(u32::MAX),
            predicted_cached_tokens: world.view(now).true_cached_tokens(w, &r.tokens),
            best_overlap: u32::try_from(overlaps.iter().copied().max().unwrap_or(0)).unwrap_or(u32::MAX),
            costs: vec![Some(Cost::default()); fleet.workers],
            overlaps,
            bytes_per_token: r.prompt_bytes as f64 / r.prompt_tokens.max(1) as f64,
            prefill_tokens_per_ms: timing.prefill_tokens_per_ms,
            ..Decision::default()
        };
        insights.on_pick(&call, &record, &holdings);
        if let Some(&last) = input.full_blocks().last() {
            last_blocks.insert(last, r.index);
        }
        play.send(r, w, now);
    }
    let Play { world, calls, sent, .. } = play;
    if progress {
        eprint!("\r{:<30}\r", "");
    }
    let served: Vec<Served> = calls.iter().flatten().map(|(_, s)| *s).collect();
    if served.len() != prepared.len() {
        bail!(
            "{name}: {} of {} calls were never served",
            prepared.len() - served.len(),
            prepared.len()
        );
    }
    let prompt: u64 = served.iter().map(|s| s.prompt_tokens).sum();
    let cached: u64 = served.iter().map(|s| s.cached_tokens).sum();
    let mut ttft: Vec<f64> = served.iter().map(|s| s.ttft_ms).collect();
    ttft.sort_by(f64::total_cmp);
    let first_sent = sent.iter().copied().fold(f64::INFINITY, f64::min);
    let end_ms = served.iter().map(|s| s.end_ms).fold(0.0, f64::max);
    let makespan_s = (end_ms - first_sent.min(end_ms)) / 1e3;
    let output: u64 = prepared.iter().map(|r| u64::from(r.output_tokens)).sum();
    let per_worker: Vec<f64> = world.workers.iter().map(|w| w.prefill_tokens as f64).collect();
    let mut calls_per_worker = vec![0usize; world.workers.len()];
    for s in &served {
        if let Some(n) = calls_per_worker.get_mut(s.worker) {
            *n += 1;
        }
    }
    let preemptions: u64 = world.workers.iter().map(|w| w.engine.preemptions()).sum();
    let host_loaded: u64 = world.workers.iter().map(|w| w.host_loaded_tokens).sum();
    let mean = per_worker.iter().sum::<f64>() / per_worker.len().max(1) as f64;
    let imbalance = per_worker.iter().copied().fold(0.0, f64::max) / mean.max(1.0);
    // Session affinity: the share of a session's later calls that went
    // where its previous call went.
    let mut last: HashMap<&str, usize> = HashMap::new();
    let (mut follow_ups, mut same) = (0usize, 0usize);
    // Continuing calls (a session's second and later), and those sent
    // `LONG_GAP_MS` or more after their session's previous call ended.
    let mut previous_end: HashMap<&str, f64> = HashMap::new();
    let mut continuing_ttft: Vec<f64> = Vec::new();
    let (mut long_gap_calls, mut long_gap_prompt, mut long_gap_cached) = (0usize, 0u64, 0u64);
    for ((r, s), call) in prepared.iter().zip(&served).zip(calls.iter()) {
        if r.session.is_empty() {
            continue;
        }
        if let Some(prev) = last.insert(&r.session, s.worker) {
            follow_ups += 1;
            same += usize::from(prev == s.worker);
            continuing_ttft.push(s.ttft_ms);
        }
        let sent_at = call.as_ref().map_or(f64::NAN, |(sent, _)| *sent);
        if let Some(end) = previous_end.insert(&r.session, s.end_ms)
            && sent_at - end >= LONG_GAP_MS
        {
            long_gap_calls += 1;
            long_gap_prompt += s.prompt_tokens;
            long_gap_cached += s.cached_tokens;
        }
    }
    continuing_ttft.sort_by(f64::total_cmp);
    // Idle sessions are charged up to the end.
    let sim_fleet = SimFleet {
        world: &world,
        now: end_ms,
        last_blocks: &last_blocks,
        prepared,
    };
    insights.tick(end_ms as u64, &sim_fleet.holdings(&insights.idle_probes()));
    let mut all = Totals::default();
    for (_, t) in insights.totals() {
        all.add(t);
    }
    let figures: serde_json::Map<String, serde_json::Value> = all
        .figures()
        .named()
        .into_iter()
        .map(|(name, value)| (name.to_owned(), json!(value)))
        .collect();
    let breaks: serde_json::Map<String, serde_json::Value> =
        all.breaks_by_section().map(|(s, n)| (s.to_owned(), json!(n))).collect();
    let breakers: Vec<serde_json::Value> = insights
        .break_points()
        .iter()
        .take(5)
        .map(|(p, s)| json!({"section": p.kind.name(), "index": p.index, "count": s.count, "first_block_min": s.first_block_min, "first_block_max": s.first_block_max}))
        .collect();
    let moves: serde_json::Map<String, serde_json::Value> =
        all.moves_by_reason().map(|(m, n)| (m.to_owned(), json!(n))).collect();
    let result = json!({
        "hit_rate": cached as f64 / prompt.max(1) as f64,
        "prefill_tokens": prompt - cached,
        // Cached tokens that came back from the host tier (0 without one).
        "host_loaded_tokens": host_loaded,
        "ttft_mean_ms": ttft.iter().sum::<f64>() / ttft.len().max(1) as f64,
        "ttft_p50_ms": percentile(&ttft, 0.5),
        "ttft_p99_ms": percentile(&ttft, 0.99),
        "throughput_tok_s": output as f64 / makespan_s.max(1e-9),
        "imbalance": imbalance,
        // The first seed's split (the mean of a split means little).
        "calls_per_worker": calls_per_worker.iter().map(usize::to_string).collect::<Vec<_>>().join("/"),
        "prefill_tokens_per_worker": per_worker,
        "preemptions": preemptions,
        "ttft_p99_continuing_ms": if continuing_ttft.is_empty() { serde_json::Value::Null } else { json!(percentile(&continuing_ttft, 0.99)) },
        "long_gap_calls": long_gap_calls,
        "long_gap_hit_rate": if long_gap_prompt == 0 { serde_json::Value::Null } else { json!(long_gap_cached as f64 / long_gap_prompt as f64) },
        "session_affinity": if follow_ups == 0 { serde_json::Value::Null } else { json!(same as f64 / follow_ups as f64) },
        // The figures the sidecar's report and metrics give a live
        // deployment, from the same ledger.
        "insights": {"figures": figures, "prefix_breaks": breaks, "moves": moves, "top_breakers": breakers},
    });
    Ok(Run { result, ttft, calls })
}

/// One seed's workload, prepared for every policy.
struct Workload {
    format: trace::Format,
    prepared: Vec<Prepared>,
    schedule: Schedule,
    /// The offline bounds on any policy's hit rate (`bound`).
    bounds: bound::Bounds,
}

fn load_workload(options: &Options, seed: u64) -> anyhow::Result<Workload> {
    let mut args = options.workload.clone();
    let path = args.trace.display().to_string();
    if path.contains("{seed}") {
        args.trace = PathBuf::from(path.replace("{seed}", &seed.to_string()));
    }
    let (format, requests) = args.load()?;
    let config = FilterConfig::default();
    let mut tokenizer = kvmesh_sim::tokenizer::Tokenizer::new()?;
    let prepared: Vec<Prepared> = requests
        .iter()
        .enumerate()
        .map(|(i, r)| world::prepare(i, r, &config, &mut tokenizer))
        .collect::<anyhow::Result<_>>()?;
    // Every worker's GPU and host tier, pooled.
    let block_tokens = options.engine_block_tokens;
    let per_worker_blocks = options.capacity_tokens / block_tokens.max(1) + options.host_tier_blocks;
    let pooled_blocks = per_worker_blocks.saturating_mul(options.workers as u64);
    let bounds = bound::bounds(prepared.iter().map(|r| &r.tokens[..]), pooled_blocks, block_tokens);
    let has_sessions = requests.iter().any(|r| !r.session.is_empty());
    let closed_loop = if options.open_loop {
        false
    } else {
        options.closed_loop || (format == trace::Format::Text && has_sessions)
    };
    Ok(Workload {
        format,
        prepared,
        schedule: Schedule::new(&requests, closed_loop, (!options.no_jitter).then_some(seed)),
        bounds,
    })
}

pub(crate) fn run(options: Options) -> anyhow::Result<()> {
    if options.workers == 0 {
        bail!("--workers must be at least 1");
    }
    let seeds = match (&options.seeds, options.seed) {
        (Some(list), _) => summary::parse_seeds(list)?,
        (None, Some(seed)) => vec![seed],
        (None, None) => vec![1],
    };
    let names: Vec<String> = if options.policies == "all" {
        policies::ALL.iter().map(|s| (*s).to_owned()).collect()
    } else {
        options.policies.split(',').map(|s| s.trim().to_owned()).collect()
    };
    if !(options.engine_jitter.is_finite() && (0.0..=2.0).contains(&options.engine_jitter)) {
        bail!("--engine-jitter must be between 0 and 2");
    }
    if options.engine_block_tokens == 0 || !options.engine_block_tokens.is_multiple_of(world::BLOCK_END_TOKENS) {
        bail!("--engine-block-tokens must be a positive multiple of 16");
    }
    let fleet = Fleet {
        workers: options.workers,
        capacity_tokens: options.capacity_tokens,
        host_tier_blocks: options.host_tier_blocks,
        block_tokens: options.engine_block_tokens,
        jitter: options.engine_jitter,
    };
    let mut timing = TimingModel::default();
    if let Some(rate) = options.host_load_tokens_per_ms {
        if !(rate.is_finite() && rate > 0.0) {
            bail!("--host-load-tokens-per-ms must be a positive number");
        }
        timing.host_load_tokens_per_ms = rate;
    }
    for (name, value) in [
        ("--prefill-tokens-per-ms", options.prefill_tokens_per_ms),
        ("--decode-step-ms", options.decode_step_ms),
        ("--first-token-ms", options.first_token_ms),
    ] {
        if value.is_some_and(|v| !(v.is_finite() && v >= 0.0)) {
            bail!("{name} must be a number, 0 or more");
        }
    }
    if let Some(rate) = options.prefill_tokens_per_ms {
        timing.prefill_tokens_per_ms = rate.max(1e-6);
    }
    if let Some(step) = options.decode_step_ms {
        timing.weight_bytes = step * timing.memory_bytes_per_ms;
    }
    if let Some(overhead) = options.first_token_ms {
        timing.first_token_overhead_ms = overhead;
    }
    // Per policy, each seed's figures; all seeds' TTFTs for the plot.
    let mut per_seed: HashMap<&str, Vec<serde_json::Value>> = HashMap::new();
    let mut ttfts: HashMap<&str, Vec<f64>> = HashMap::new();
    let (mut bounds, mut pooled_bounds, mut requests) = (Vec::new(), Vec::new(), Vec::new());
    for &seed in &seeds {
        let w = load_workload(&options, seed)?;
        println!(
            "seed {seed}: {} requests ({:?}, {}), roots jittered by up to {:.0} ms; infinite-cache hit rate {:.3}, pooled Belady {:.3}",
            w.prepared.len(),
            w.format,
            if w.schedule.followers.is_empty() {
                "open loop"
            } else {
                "closed loop"
            },
            w.schedule.jitter_span_ms,
            w.bounds.infinite_cache,
            w.bounds.pooled_belady
        );
        bounds.push(json!(w.bounds.infinite_cache));
        pooled_bounds.push(json!(w.bounds.pooled_belady));
        requests.push(w.prepared.len());
        for name in &names {
            let run = run_policy(name, &w.prepared, &w.schedule, fleet, seed, timing)?;
            per_seed.entry(name).or_default().push(run.result);
            ttfts.entry(name).or_default().extend(run.ttft);
        }
    }
    let bound = summary::mean(&bounds).as_f64().unwrap_or(0.0);
    let pooled_bound = summary::mean(&pooled_bounds).as_f64().unwrap_or(0.0);
    let mut results = serde_json::Map::new();
    for name in &names {
        let runs = per_seed.get(name.as_str()).map_or(&[][..], Vec::as_slice);
        let mut r = summary::mean(runs);
        if let Some(obj) = r.as_object_mut() {
            obj.insert("range".to_owned(), summary::range(runs));
        }
        results.insert(name.clone(), r);
    }
    let seed_list = seeds.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
    println!(
        "{} requests, {} workers × {} tokens, speed {}, seeds {seed_list}; infinite-cache hit rate {:.3}, pooled Belady {:.3}",
        requests.first().copied().unwrap_or(0),
        options.workers,
        options.capacity_tokens,
        options.workload.speed,
        bound,
        pooled_bound
    );
    let several = seeds.len() > 1;
    if several {
        println!("(means over the seeds; [min-max] where it fits)");
    }
    println!(
        "| policy | hit rate | prefill tokens | TTFT p50 | TTFT p99 | throughput tok/s | imbalance | session affinity |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let mut curves = Vec::new();
    for name in &names {
        let Some(r) = results.get(name) else { continue };
        let fig = |key: &str, digits: usize, unit: &str| summary::cell(r, key, digits, unit, several);
        curves.push((
            name.clone(),
            {
                let mut t = ttfts.remove(name.as_str()).unwrap_or_default();
                t.sort_by(f64::total_cmp);
                t
            },
            r["hit_rate"].as_f64().unwrap_or(0.0),
        ));
        println!(
            "| {name} | {} | {:.0} | {} | {} | {:.0} | {} | {} |",
            fig("hit_rate", 3, ""),
            r["prefill_tokens"].as_f64().unwrap_or(0.0),
            fig("ttft_p50_ms", 0, " ms"),
            fig("ttft_p99_ms", 0, " ms"),
            r["throughput_tok_s"].as_f64().unwrap_or(0.0),
            fig("imbalance", 2, ""),
            r["session_affinity"]
                .as_f64()
                .map_or("-".to_owned(), |a| format!("{a:.2}")),
        );
    }
    // Retention: how continuing calls and returns from long waits fared.
    println!(
        "\n| policy | prefill tokens | TTFT p99 of continuing calls | calls after a gap ≥ 30 s | their hit rate | preemptions | calls per worker |"
    );
    println!("|---|---|---|---|---|---|---|");
    for name in &names {
        let Some(r) = results.get(name) else { continue };
        let fig = |key: &str, digits: usize, unit: &str| summary::cell(r, key, digits, unit, several);
        println!(
            "| {name} | {} | {} | {} | {} | {} | {} |",
            fig("prefill_tokens", 0, ""),
            if r["ttft_p99_continuing_ms"].is_null() {
                "-".to_owned()
            } else {
                fig("ttft_p99_continuing_ms", 0, " ms")
            },
            fig("long_gap_calls", 0, ""),
            if r["long_gap_hit_rate"].is_null() {
                "-".to_owned()
            } else {
                fig("long_gap_hit_rate", 3, "")
            },
            fig("preemptions", 0, ""),
            r["calls_per_worker"].as_str().unwrap_or("-"),
        );
    }
    // The same figures the sidecar's report gives a live deployment.
    println!(
        "\n| policy | repeated prefix | reachable cached | reported cached | same worker | r/w ratio | prefix breaks | GPU s saved | idle KV GB·s |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for name in &names {
        let Some(r) = results.get(name) else { continue };
        let f = &r["insights"]["figures"];
        let num = |key: &str| f[key].as_f64().unwrap_or(0.0);
        let prompt = num("prompt_tokens").max(1.0);
        let breaks: f64 = r["insights"]["prefix_breaks"]
            .as_object()
            .map_or(0.0, |b| b.values().filter_map(serde_json::Value::as_f64).sum());
        println!(
            "| {name} | {:.3} | {:.3} | {:.3} | {:.2} | {:.1} | {breaks:.0} | {:.0} | {:.0} |",
            num("repeated_prefix_share"),
            num("reachable_cached_tokens") / prompt,
            num("cache_read_tokens") / num("reported_prompt_tokens").max(1.0),
            num("same_worker_rate"),
            num("read_write_ratio"),
            num("gpu_seconds_saved"),
            num("idle_kv_byte_seconds") / 1e9,
        );
    }
    if let Some(path) = &options.json {
        let out = json!({
            "trace": options.workload.trace.display().to_string(),
            "requests": requests.first().copied().unwrap_or(0),
            "requests_per_seed": requests,
            "workers": options.workers,
            "seeds": seeds,
            "bound": {
                "infinite_cache_hit_rate": bound,
                "range": summary::range(&bounds),
                "pooled_belady_hit_rate": pooled_bound,
                "pooled_belady_range": summary::range(&pooled_bounds),
            },
            "policies": results,
        });
        std::fs::write(path, serde_json::to_string_pretty(&out)?)?;
        let title = format!(
            "{} · {} requests · {} workers × {} tokens · speed {} · seeds {seed_list}",
            options.workload.trace.display(),
            requests.first().copied().unwrap_or(0),
            options.workers,
            options.capacity_tokens,
            options.workload.speed
        );
        std::fs::write(path.with_extension("svg"), plot::svg(&title, &curves, bound))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::schedule::Release;
    use super::trace::Request;
    use super::*;

    /// A session's `turns` calls 100 ms apart from `start_ms`, each its
    /// `context` grown by that turn's text.
    fn growing_session(
        requests: &mut Vec<Request>,
        session: &str,
        start_ms: f64,
        mut context: String,
        turns: usize,
        turn_text: impl Fn(usize) -> String,
    ) {
        for turn in 0..turns {
            context.push_str(&turn_text(turn));
            requests.push(Request {
                at_ms: start_ms + turn as f64 * 100.0,
                session: session.to_owned(),
                parent: String::new(),
                text: context.clone(),
                output_tokens: 20,
                session_final: false,
            });
        }
    }

    /// Three agent sessions and a subagent, each call a long prompt whose
    /// prefill (~400 ms) outlasts the recorded gap between calls (100 ms).
    fn agents() -> Vec<Request> {
        let mut requests = Vec::new();
        for s in 0..3 {
            let context = format!("session {s} ") + &"read the file and run the tests ".repeat(1000);
            growing_session(&mut requests, &format!("s{s}"), s as f64 * 10.0, context, 5, |turn| {
                format!(" turn {turn} result ").repeat(50)
            });
        }
        for turn in 0..3 {
            requests.push(Request {
                at_ms: 250.0 + turn as f64 * 100.0,
                session: "s0-sub".to_owned(),
                parent: "s0".to_owned(),
                text: "subagent ".repeat(4000 + turn * 100),
                output_tokens: 20,
                session_final: false,
            });
        }
        requests.sort_by(|a, b| a.at_ms.total_cmp(&b.at_ms));
        requests
    }

    fn play(requests: &[Request], closed_loop: bool, policy: &str) -> (Schedule, Run) {
        let fleet = Fleet {
            workers: 2,
            capacity_tokens: 200_000,
            host_tier_blocks: 0,
            block_tokens: 16,
            jitter: 0.0,
        };
        play_on(requests, closed_loop, policy, fleet)
    }

    fn play_on(requests: &[Request], closed_loop: bool, policy: &str, fleet: Fleet) -> (Schedule, Run) {
        let config = FilterConfig::default();
        let mut tokenizer = kvmesh_sim::tokenizer::Tokenizer::new().unwrap();
        let prepared: Vec<Prepared> = requests
            .iter()
            .enumerate()
            .map(|(i, r)| world::prepare(i, r, &config, &mut tokenizer).unwrap())
            .collect();
        let schedule = Schedule::new(requests, closed_loop, Some(1));
        let run = run_policy(policy, &prepared, &schedule, fleet, 1, TimingModel::default()).unwrap();
        (schedule, run)
    }

    /// KV below the working set (each session's ~9k-token context against
    /// 12k tokens per worker): a host tier of 2,000 blocks (32k tokens) per
    /// worker keeps what the GPU evicts, so sessions coming back load their
    /// prefix instead of recomputing it, for every policy.
    #[test]
    fn a_host_tier_lowers_prefill_on_a_pressured_run() {
        let requests = agents();
        for policy in ["round_robin", "kvmesh", "kvmesh_pick_time_cache"] {
            let fleet = |host_tier_blocks| Fleet {
                workers: 2,
                capacity_tokens: 12_000,
                host_tier_blocks,
                block_tokens: 16,
                jitter: 0.0,
            };
            let (_, plain) = play_on(&requests, true, policy, fleet(0));
            let (_, tiered) = play_on(&requests, true, policy, fleet(2_000));
            let figure = |run: &Run, name: &str| run.result[name].as_u64().unwrap();
            assert_eq!(figure(&plain, "host_loaded_tokens"), 0);
            assert!(figure(&tiered, "host_loaded_tokens") > 0, "{policy}");
            let (before, after) = (figure(&plain, "prefill_tokens"), figure(&tiered, "prefill_tokens"));
            assert!(after < before, "{policy}: prefill {before} → {after}");
        }
    }

    /// Two domains' sessions (tau-bench's shape): each call is its domain's
    /// long system prompt, then the session's growing conversation.
    #[test]
    fn engine_jitter_is_seeded_and_its_factor_has_mean_one() {
        let requests = agents();
        let fleet = |jitter| Fleet {
            workers: 2,
            capacity_tokens: 1_000_000,
            host_tier_blocks: 0,
            block_tokens: 16,
            jitter,
        };
        let ttfts = |jitter| play_on(&requests, true, "round_robin", fleet(jitter)).1.ttft;
        let (plain, noisy) = (ttfts(0.0), ttfts(0.3));
        assert_eq!(noisy, ttfts(0.3), "the same seed draws the same noise");
        assert_ne!(noisy, plain);
        // The factor has mean one (the waits it causes need not: variance
        // lengthens queues).
        let mut j = world::Jitter::new(0.3, 7, 0);
        let mean = (0..20_000).map(|_| j.factor()).sum::<f64>() / 20_000.0;
        assert!((mean - 1.0).abs() < 0.01, "{mean}");
    }

    fn domains() -> Vec<Request> {
        let mut requests = Vec::new();
        for s in 0..8 {
            let domain = if s % 2 == 0 { "airline" } else { "retail" };
            let context = format!("{domain} policy and tools ").repeat(600);
            growing_session(&mut requests, &format!("d{s}"), s as f64 * 300.0, context, 4, |turn| {
                format!(" session {s} turn {turn} ").repeat(40)
            });
        }
        requests.sort_by(|a, b| a.at_ms.total_cmp(&b.at_ms));
        requests
    }

    /// The pooled Belady bound is above every policy's hit rate, open and
    /// closed loop, on two pressured workloads, and below the infinite
    /// cache there (the pressure binds).
    #[test]
    fn no_policy_beats_the_pooled_belady_bound() {
        let config = FilterConfig::default();
        // Per worker: the pooled KV holds less than the workload reuses.
        for (name, requests, capacity_tokens) in [("agents", agents(), 12_000), ("domains", domains(), 2_500)] {
            let fleet = Fleet {
                workers: 2,
                capacity_tokens,
                host_tier_blocks: 0,
                block_tokens: 16,
                jitter: 0.0,
            };
            let mut tokenizer = kvmesh_sim::tokenizer::Tokenizer::new().unwrap();
            let prompts: Vec<Vec<u32>> = requests
                .iter()
                .enumerate()
                .map(|(i, r)| world::prepare(i, r, &config, &mut tokenizer).unwrap().tokens.to_vec())
                .collect();
            let b = bound::bounds(prompts.iter().map(Vec::as_slice), 2 * capacity_tokens / 16, 16);
            assert!(b.pooled_belady < b.infinite_cache, "{name}: {b:?}");
            for policy in policies::ALL {
                for closed_loop in [false, true] {
                    let (_, run) = play_on(&requests, closed_loop, policy, fleet);
                    let hit_rate = run.result["hit_rate"].as_f64().unwrap();
                    assert!(
                        hit_rate <= b.pooled_belady + 1e-9,
                        "{name}: {policy} (closed loop {closed_loop}) {hit_rate} above {b:?}"
                    );
                }
            }
        }
    }

    /// Each call's send time and end, by session, in order.
    /// Calls without sessions over three shared documents, each a
    /// document and a question (Mooncake's shape: reuse without sessions).
    fn shared_documents() -> Vec<Request> {
        (0..24)
            .map(|i| Request {
                at_ms: i as f64 * 40.0,
                session: String::new(),
                parent: String::new(),
                text: format!("document {} ", i % 3)
                    + &"the contract and its annexes ".repeat(300)
                    + &format!(" question {i}"),
                output_tokens: 20,
                session_final: false,
            })
            .collect()
    }

    /// `kvmesh_oracle` tries kvmesh's own choice among others and plays each
    /// to the end, so it never computes more prefill than kvmesh, open or
    /// closed loop, on three pressured workloads; and it finds better
    /// somewhere (it is not kvmesh under another name).
    #[test]
    fn the_oracle_never_computes_more_prefill_than_kvmesh() {
        let mut better = Vec::new();
        for (name, requests, capacity_tokens) in [
            ("agents", agents(), 12_000),
            ("domains", domains(), 2_500),
            ("documents", shared_documents(), 3_000),
        ] {
            for closed_loop in [false, true] {
                let fleet = Fleet {
                    workers: 3,
                    capacity_tokens,
                    host_tier_blocks: 0,
                    block_tokens: 16,
                    jitter: 0.0,
                };
                let figures = |policy| {
                    let run = play_on(&requests, closed_loop, policy, fleet).1;
                    let prefill = run.result["prefill_tokens"].as_u64().unwrap();
                    (prefill, run.ttft.iter().sum::<f64>())
                };
                let (kvmesh, oracle) = (figures("kvmesh"), figures(oracle::NAME));
                assert!(
                    oracle.0 < kvmesh.0 || (oracle.0 == kvmesh.0 && oracle.1 <= kvmesh.1),
                    "{name} (closed loop {closed_loop}): oracle {oracle:?} against kvmesh {kvmesh:?}"
                );
                if oracle != kvmesh {
                    better.push(format!("{name} {closed_loop}: {kvmesh:?} → {oracle:?}"));
                }
            }
        }
        eprintln!("{better:#?}");
        assert!(!better.is_empty(), "the oracle never differs from kvmesh");
    }

    fn by_session(requests: &[Request], run: &Run) -> HashMap<String, Vec<(usize, f64, f64)>> {
        let mut sessions: HashMap<String, Vec<(usize, f64, f64)>> = HashMap::new();
        for (i, r) in requests.iter().enumerate() {
            let (sent, served) = run.calls[i].unwrap();
            sessions
                .entry(r.session.clone())
                .or_default()
                .push((i, sent, served.end_ms));
        }
        sessions
    }

    #[test]
    fn a_closed_loop_session_has_one_call_in_flight_and_keeps_its_gaps() {
        let requests = agents();
        for policy in ["round_robin", "kvmesh"] {
            let (schedule, run) = play(&requests, true, policy);
            for (session, calls) in by_session(&requests, &run) {
                for pair in calls.windows(2) {
                    let ((a, _, a_end), (b, b_sent, _)) = (pair[0], pair[1]);
                    assert!(
                        b_sent >= a_end,
                        "{policy}: {session} sent call {b} at {b_sent} before {a} ended at {a_end}"
                    );
                    let gap = requests[b].at_ms - requests[a].at_ms;
                    assert!(
                        (b_sent - a_end - gap).abs() < 1e-6,
                        "{policy}: {session} call {b}: gap {gap} not kept"
                    );
                }
            }
            // The subagent's first call follows its parent's latest call
            // before it by the recorded gap.
            let first_child = requests.iter().position(|r| r.session == "s0-sub").unwrap();
            let Release::After { anchor, gap_ms } = schedule.releases[first_child] else {
                panic!("the subagent's first call is not chained to its parent");
            };
            assert_eq!(requests[anchor].session, "s0");
            let (sent, _) = run.calls[first_child].unwrap();
            let (_, parent_call) = run.calls[anchor].unwrap();
            assert!((sent - parent_call.end_ms - gap_ms).abs() < 1e-6);
        }
    }

    /// The same check fails open loop: calls are sent at their recorded
    /// times, before the previous call of their session has finished.
    #[test]
    fn an_open_loop_session_overlaps_its_calls_on_this_workload() {
        let requests = agents();
        let (_, run) = play(&requests, false, "round_robin");
        let overlapping = by_session(&requests, &run)
            .values()
            .flat_map(|calls| calls.windows(2).map(|p| p[1].1 < p[0].2).collect::<Vec<_>>())
            .filter(|&overlap| overlap)
            .count();
        assert!(overlapping > 0);
    }
}
