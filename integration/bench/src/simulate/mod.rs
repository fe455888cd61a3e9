//! `kvmesh-bench simulate`: every policy on the same workload, on a virtual
//! clock, deterministic for a seed. kvmesh runs through the same core API as
//! the sidecar, each request hashed by the filter's own code; the engines are
//! the `kvmesh-sim` engine model.

mod plot;
mod policies;
mod radix;
pub(crate) mod trace;
mod world;

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};
use std::path::PathBuf;

use anyhow::bail;
use kvmesh_core::{Call, Cost, Decision, Holdings, InsightConfig, Insights, Totals, WorkerId};
use kvmesh_request::FilterConfig;
use kvmesh_sim::engine::{Engine, EngineConfig};
use kvmesh_sim::timing::TimingModel;
use serde_json::json;

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
    /// `all`, or a comma-separated list of policy names.
    #[arg(long, default_value = "all")]
    policies: String,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Write the results as JSON here (and a plot beside it, as .svg).
    #[arg(long)]
    json: Option<PathBuf>,
}

/// A finished request to feed back to its policy, ordered by end time.
struct Completion {
    end: f64,
    index: usize,
    worker: usize,
    cached: u64,
    ttft: f64,
}

impl Completion {
    /// The outcome as the filter would report it, to the insight ledger.
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

impl PartialEq for Completion {
    fn eq(&self, other: &Self) -> bool {
        self.end == other.end && self.index == other.index
    }
}
impl Eq for Completion {}
impl PartialOrd for Completion {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Completion {
    /// Earliest end first (a max-heap, reversed).
    fn cmp(&self, other: &Self) -> Ordering {
        other.end.total_cmp(&self.end).then(other.index.cmp(&self.index))
    }
}

/// Engine bytes per token (the sim's) and kvmesh bytes per block: the
/// engine's truth in kvmesh's units, for the insight ledger.
const ENGINE_BYTES_PER_TOKEN: f64 = 4.0;
const BLOCK_BYTES: f64 = 256.0;

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
        let cached = self.world.view(self.now).true_cached_tokens(worker.0, &r.prompt);
        // Most of the prefix is still there.
        2 * cached >= r.prompt_tokens
    }
}

fn blocks_of_tokens(tokens: u64) -> usize {
    (tokens as f64 * ENGINE_BYTES_PER_TOKEN / BLOCK_BYTES) as usize
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn run_policy(
    name: &str,
    prepared: &[Prepared],
    arrivals: &[f64],
    options: &Options,
    timing: TimingModel,
) -> anyhow::Result<(serde_json::Value, Vec<f64>)> {
    let Some(mut policy) = policies::make(
        name,
        options.workers,
        options.capacity_tokens,
        options.seed,
        timing.prefill_tokens_per_ms,
    ) else {
        bail!("unknown policy {name:?}; known: {}", policies::ALL.join(", "));
    };
    let mut world = World::new(options.workers, options.capacity_tokens, timing);
    let mut insights = Insights::new(InsightConfig::default());
    let mut last_blocks: HashMap<u64, usize> = HashMap::new();
    let mut pending: BinaryHeap<Completion> = BinaryHeap::new();
    let mut served: Vec<Served> = Vec::with_capacity(prepared.len());
    let progress = std::io::IsTerminal::is_terminal(&std::io::stderr());
    for (i, (r, &now)) in prepared.iter().zip(arrivals).enumerate() {
        if progress && (i % 256 == 0 || i + 1 == prepared.len()) {
            eprint!("\r{name:<20} {:>5.1}%", 100.0 * (i + 1) as f64 / prepared.len() as f64);
        }
        while pending.peek().is_some_and(|c| c.end <= now) {
            if let Some(c) = pending.pop() {
                policy.completed(c.worker, &prepared[c.index], c.cached, c.ttft);
                c.report_to(&mut insights, prepared);
            }
        }
        let w = policy.pick(r, &world.view(now)).min(options.workers - 1);
        let overlaps: Vec<usize> = (0..options.workers)
            .map(|x| blocks_of_tokens(world.view(now).true_cached_tokens(x, &r.prompt)))
            .collect();
        let fleet = SimFleet {
            world: &world,
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
        let holdings = fleet.holdings(insights.probe(&call).as_slice());
        // The record of the pick as the engines' truth has it.
        let record = Decision {
            pick_id: r.index as u64,
            ranked: vec![WorkerId(w)],
            predicted_cached_blocks: u32::try_from(overlaps.get(w).copied().unwrap_or(0)).unwrap_or(u32::MAX),
            predicted_cached_tokens: world.view(now).true_cached_tokens(w, &r.prompt),
            best_overlap: u32::try_from(overlaps.iter().copied().max().unwrap_or(0)).unwrap_or(u32::MAX),
            costs: vec![Some(Cost::default()); options.workers],
            overlaps,
            bytes_per_token: ENGINE_BYTES_PER_TOKEN,
            prefill_tokens_per_ms: timing.prefill_tokens_per_ms,
            ..Decision::default()
        };
        insights.on_pick(&call, &record, &holdings);
        if let Some(&last) = input.full_blocks().last() {
            last_blocks.insert(last, r.index);
        }
        let s = world.serve(w, r, now);
        pending.push(Completion {
            end: s.end_ms,
            index: r.index,
            worker: w,
            cached: s.cached_tokens,
            ttft: s.ttft_ms,
        });
        served.push(s);
    }
    let prompt: u64 = served.iter().map(|s| s.prompt_tokens).sum();
    let cached: u64 = served.iter().map(|s| s.cached_tokens).sum();
    let mut ttft: Vec<f64> = served.iter().map(|s| s.ttft_ms).collect();
    ttft.sort_by(f64::total_cmp);
    let makespan_s = served.iter().map(|s| s.end_ms).fold(0.0, f64::max) / 1e3;
    let output: u64 = prepared.iter().map(|r| u64::from(r.output_tokens)).sum();
    let per_worker: Vec<f64> = world.workers.iter().map(|w| w.prefill_tokens as f64).collect();
    let mean = per_worker.iter().sum::<f64>() / per_worker.len().max(1) as f64;
    let imbalance = per_worker.iter().copied().fold(0.0, f64::max) / mean.max(1.0);
    // Session affinity: the share of a session's later calls that went
    // where its previous call went.
    let mut last: HashMap<&str, usize> = HashMap::new();
    let (mut follow_ups, mut same) = (0usize, 0usize);
    for (r, s) in prepared.iter().zip(&served) {
        if r.session.is_empty() {
            continue;
        }
        if let Some(prev) = last.insert(&r.session, s.worker) {
            follow_ups += 1;
            same += usize::from(prev == s.worker);
        }
    }
    if progress {
        eprint!("\r{:<30}\r", "");
    }
    // The rest finish, then idle sessions are charged up to the end.
    while let Some(c) = pending.pop() {
        c.report_to(&mut insights, prepared);
    }
    let end_ms = served.iter().map(|s| s.end_ms).fold(0.0, f64::max);
    let fleet = SimFleet {
        world: &world,
        now: end_ms,
        last_blocks: &last_blocks,
        prepared,
    };
    insights.tick(end_ms as u64, &fleet.holdings(&insights.idle_probes()));
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
        "ttft_p50_ms": percentile(&ttft, 0.5),
        "ttft_p99_ms": percentile(&ttft, 0.99),
        "throughput_tok_s": output as f64 / makespan_s.max(1e-9),
        "imbalance": imbalance,
        "session_affinity": if follow_ups == 0 { serde_json::Value::Null } else { json!(same as f64 / follow_ups as f64) },
        // The figures the sidecar's report and metrics give a live
        // deployment, from the same ledger.
        "insights": {"figures": figures, "prefix_breaks": breaks, "moves": moves, "top_breakers": breakers},
    });
    Ok((result, ttft))
}

pub(crate) fn run(options: Options) -> anyhow::Result<()> {
    if options.workers == 0 {
        bail!("--workers must be at least 1");
    }
    let (format, requests) = options.workload.load()?;
    let config = FilterConfig::default();
    let prepared: Vec<Prepared> = requests
        .iter()
        .enumerate()
        .map(|(i, r)| world::prepare(i, r, &config))
        .collect::<anyhow::Result<_>>()?;
    let arrivals: Vec<f64> = requests.iter().map(|r| r.at_ms).collect();
    // The bound: one engine with an infinite cache sees every prompt.
    let mut infinite = Engine::new(EngineConfig {
        capacity_tokens: u64::MAX / 2,
    });
    let (mut p, mut c) = (0u64, 0u64);
    for r in &prepared {
        let s = infinite.admit(&r.prompt);
        p += s.prompt_tokens;
        c += s.cached_tokens;
    }
    let bound = c as f64 / p.max(1) as f64;
    let names: Vec<String> = if options.policies == "all" {
        policies::ALL.iter().map(|s| (*s).to_owned()).collect()
    } else {
        options.policies.split(',').map(|s| s.trim().to_owned()).collect()
    };
    let timing = TimingModel::default();
    let mut results = serde_json::Map::new();
    let mut curves = Vec::new();
    println!(
        "{} requests ({format:?}), {} workers × {} tokens, speed {}, seed {}; infinite-cache hit rate {:.3}",
        prepared.len(),
        options.workers,
        options.capacity_tokens,
        options.workload.speed,
        options.seed,
        bound
    );
    println!(
        "| policy | hit rate | prefill tokens | TTFT p50 | TTFT p99 | throughput tok/s | imbalance | session affinity |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for name in &names {
        let (r, ttft) = run_policy(name, &prepared, &arrivals, &options, timing)?;
        curves.push((name.clone(), ttft, r["hit_rate"].as_f64().unwrap_or(0.0)));
        println!(
            "| {name} | {:.3} | {} | {:.0} ms | {:.0} ms | {:.0} | {:.2} | {} |",
            r["hit_rate"].as_f64().unwrap_or(0.0),
            r["prefill_tokens"],
            r["ttft_p50_ms"].as_f64().unwrap_or(0.0),
            r["ttft_p99_ms"].as_f64().unwrap_or(0.0),
            r["throughput_tok_s"].as_f64().unwrap_or(0.0),
            r["imbalance"].as_f64().unwrap_or(0.0),
            r["session_affinity"]
                .as_f64()
                .map_or("-".to_owned(), |a| format!("{a:.2}")),
        );
        results.insert(name.clone(), r);
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
        let breaks: u64 = r["insights"]["prefix_breaks"]
            .as_object()
            .map_or(0, |b| b.values().filter_map(serde_json::Value::as_u64).sum());
        println!(
            "| {name} | {:.3} | {:.3} | {:.3} | {:.2} | {:.1} | {breaks} | {:.0} | {:.0} |",
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
            "requests": prepared.len(),
            "workers": options.workers,
            "bound": {"infinite_cache_hit_rate": bound},
            "policies": results,
        });
        std::fs::write(path, serde_json::to_string_pretty(&out)?)?;
        let title = format!(
            "{} · {} requests · {} workers × {} tokens · speed {}",
            options.workload.trace.display(),
            prepared.len(),
            options.workers,
            options.capacity_tokens,
            options.workload.speed
        );
        std::fs::write(path.with_extension("svg"), plot::svg(&title, &curves, bound))?;
    }
    Ok(())
}
