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
            }
        }
        let w = policy.pick(r, &world.view(now)).min(options.workers - 1);
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
    let result = json!({
        "hit_rate": cached as f64 / prompt.max(1) as f64,
        "prefill_tokens": prompt - cached,
        "ttft_p50_ms": percentile(&ttft, 0.5),
        "ttft_p99_ms": percentile(&ttft, 0.99),
        "throughput_tok_s": output as f64 / makespan_s.max(1e-9),
        "imbalance": imbalance,
        "session_affinity": if follow_ups == 0 { serde_json::Value::Null } else { json!(same as f64 / follow_ups as f64) },
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
