//! The two benchmark clients of docs/benchmarks.md, AIPerf and
//! inference-perf, each run by its own script (`integration/bench/aiperf.sh`,
//! `integration/bench/inference_perf.sh`) in its multi-turn mode through the
//! kvmesh listener on real vLLM workers, with tiny parameters: two workers,
//! two conversations of two turns. Each run exits 0 with no failed request;
//! the engines counted exactly the prompt tokens the client was told in
//! usage (so the traffic they served was the client's); and every
//! conversation's second turn hit its engine's cache for at least one whole
//! 128-token block, which through kvmesh needs the session header the
//! client sends (`X-Session-Affinity`, `x-session-id`) to keep a
//! conversation on one engine.
//!
//! The runs take turns (one pair of vLLM starts at a time on the machine's
//! cores); each is 60-90 s, most of it starting the engines and the client.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use kvmesh_integration::paths::{self, Profile};
use kvmesh_integration::process::{Process, SpawnOptions};
use kvmesh_integration::vllm::{BLOCK_SIZE_TOKENS, VllmInstall};
use serde_json::Value;

const CONVERSATIONS: u64 = 2;
const TURNS: usize = 2;
/// A failed run's bound, not its expected time: a run is 50-80 s alone,
/// and everything may be 4 times slower at load 8 (two vLLM starts, the
/// client's start and its requests); a hang is all this catches.
const RUN_TIMEOUT: Duration = Duration::from_secs(900);

static ONE_DEPLOYMENT_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Runs `script` with the smoke parameters through the kvmesh listener and
/// returns the summary line it wrote.
fn smoke_run(script: &str, venv: &str) -> anyhow::Result<Value> {
    let _turn = ONE_DEPLOYMENT_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let repo = paths::repo_root();
    // Fail before starting anything, naming the step that installs what is missing.
    VllmInstall::find()?;
    let stamp = repo.join(".tools").join(venv).join(".kvmesh-installed");
    ensure!(
        stamp.is_file(),
        "{} is not installed in .tools/{venv}: run ./dev setup-bench-clients",
        script
    );
    let bench = paths::binary("kvmesh-bench", Profile::Release).context("run `just build-release`")?;
    paths::binary("kvmesh-sidecar", Profile::Release).context("run `just build-release`")?;

    let dir = scratch_dir(script)?;
    let out = dir.join("results");
    let env = [
        ("WORKERS", "2".to_owned()),
        ("CONVERSATIONS", CONVERSATIONS.to_string()),
        ("TURNS", TURNS.to_string()),
        ("CONCURRENCY", "2".to_owned()),
        ("MODES", "kvmesh".to_owned()),
        ("KVMESH_BENCH", bench.display().to_string()),
    ];
    let started = Instant::now();
    // Its own process group: stopped with the client and `kvmesh-bench
    // serve` (which stops its vLLM groups on SIGTERM) if the test fails.
    let mut run = Process::spawn_with(
        script,
        &repo.join("integration/bench").join(script),
        &[out.display().to_string()],
        &SpawnOptions {
            env: env.iter().map(|(k, v)| ((*k).to_owned(), v.clone())).collect(),
            stdout_to_log: true,
            group: true,
        },
        &dir,
    )?;
    let status = run.wait_exit(RUN_TIMEOUT)?;
    ensure!(
        status.is_some_and(|s| s.success()),
        "{script} {}:\n{}\n(files in {})",
        status.map_or_else(|| format!("still running after {RUN_TIMEOUT:?}"), |s| s.to_string()),
        run.log_tail(),
        dir.display()
    );
    let summary = std::fs::read_to_string(out.join("kvmesh-summary.json"))
        .with_context(|| format!("{script} wrote no summary in {}", out.display()))?;
    let summary: Value = serde_json::from_str(&summary).context("the summary line")?;
    println!("{script}: {:.1}s: {summary}", started.elapsed().as_secs_f64());
    drop(run);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(summary)
}

fn scratch_dir(script: &str) -> anyhow::Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("kvmesh-bench-clients-{}-{script}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

fn numbers(summary: &Value, key: &str) -> anyhow::Result<Vec<u64>> {
    summary[key]
        .as_array()
        .with_context(|| format!("no {key} in {summary}"))?
        .iter()
        .map(|v| v.as_f64().map(|f| f as u64).with_context(|| format!("{key}: {v}")))
        .collect()
}

fn check(summary: &Value) -> anyhow::Result<()> {
    ensure!(summary["failed"] == 0, "failed requests: {summary}");
    let requests = summary["requests"].as_f64().unwrap_or_default() as u64;
    ensure!(
        requests == CONVERSATIONS * TURNS as u64,
        "{requests} requests, not {}: {summary}",
        CONVERSATIONS * TURNS as u64
    );
    let prompts = numbers(summary, "prompt_tokens_by_turn")?;
    let cached = numbers(summary, "cached_tokens_by_turn")?;
    ensure!(
        prompts.len() == TURNS && cached.len() == TURNS,
        "not {TURNS} turns: {summary}"
    );
    let engine_prompt = summary["engine_prompt_tokens"].as_u64().unwrap_or_default();
    ensure!(
        engine_prompt > 0 && engine_prompt == prompts.iter().sum::<u64>(),
        "the engines counted {engine_prompt} prompt tokens, the client's replies {prompts:?}"
    );
    for (turn, &hit) in cached.iter().enumerate().skip(1) {
        ensure!(
            hit >= CONVERSATIONS * BLOCK_SIZE_TOKENS,
            "turn {}: {hit} cached tokens over {CONVERSATIONS} conversations, not a block each: {summary}",
            turn + 1
        );
    }
    ensure!(
        summary["engine_cached_tokens"].as_u64() == Some(cached.iter().sum::<u64>()),
        "the engines' cached tokens differ from the client's replies: {summary}"
    );
    Ok(())
}

#[test]
fn aiperf_multi_turn_through_kvmesh_reuses_each_conversations_blocks() -> anyhow::Result<()> {
    check(&smoke_run("aiperf.sh", "aiperf")?)
}

#[test]
fn inference_perf_multi_turn_through_kvmesh_reuses_each_conversations_blocks() -> anyhow::Result<()> {
    check(&smoke_run("inference_perf.sh", "inference-perf")?)
}
