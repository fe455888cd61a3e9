//! The real SGLang Model Gateway (`smg` 1.13.0, `./dev setup-peers`) as a
//! peer router in front of two real vLLM engines (CPU build, the tiny model
//! of `./dev setup-vllm`): an agent-like session of four chat calls, each
//! resending the conversation so far behind a long stable system prompt, is
//! sent through smg's `cache_aware` policy, then another through its sticky
//! variant (`--routing-key-override` on a session header). Where each call
//! went and what it reused are read from the engines' own counters
//! (`vllm:request_success_total`, `vllm:prefix_cache_hits_total`), not from
//! smg: every call of a session reached one engine, its first call hit
//! nothing and each later one was served partly from that engine's prefix
//! cache. smg's own counts of its decisions are checked to agree.
//!
//! It also checks that smg's rewriting of the body changes nothing vLLM
//! computes: the session's last call, sent again straight to the engine
//! that served it, gives the same prompt tokens and the same sampling
//! parameters (vLLM's `--enable-log-requests` line) as through smg.
//!
//! One test function: a vLLM start is 20-45 s, so both routers use the same
//! two engines. `./dev test` installs smg first (`setup-peers`).

#![allow(clippy::panic)] // a reply without usage fails the test loudly

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use kvmesh_integration::peers::{self, Smg, SmgOptions, SmgPolicy};
use kvmesh_integration::vllm::{self, BLOCK_SIZE_TOKENS, READY_TIMEOUT, SERVED_MODEL, VllmOptions, VllmWorker};
use kvmesh_integration::workload::tool_loop_chat_messages;
use serde_json::{Value, json};

const TURNS: usize = 4;
/// Tokens generated per call: vLLM on CPU can starve the machine's other
/// work while it decodes.
const MAX_TOKENS: u64 = 4;
/// The session header of the sticky variant (and sent to both: plain
/// cache_aware ignores it).
const SESSION_HEADER: &str = "x-session-id";
/// Bounds a wait for an engine's counters to follow a reply: milliseconds
/// normally, far more at load 8. Only a hang reaches it.
const DEADLINE: Duration = Duration::from_secs(60);

/// About 800 tokens of the tiny model's tokenizer, the same on every call
/// of a session: six full 128-token blocks the engine can reuse. The repo
/// name sits in the first block, so two sessions share no block.
/// Call `turn` of session `repo`: the whole conversation so far plus one
/// more tool round trip. Greedy (nothing random to seed in what the engine
/// computes; the seed is there to see it pass through), and asking vLLM for
/// the prompt's token ids so the reply shows what it computed on.
fn body(repo: &str, turn: usize) -> Value {
    let messages = tool_loop_chat_messages(repo, turn);
    json!({"model": SERVED_MODEL, "messages": messages, "max_tokens": MAX_TOKENS,
           "temperature": 0, "seed": 7, "return_token_ids": true})
}

/// One engine's own counts.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Counts {
    finished: f64,
    /// Prefix cache lookups and hits, in tokens.
    queries: f64,
    hits: f64,
}

async fn counts(http: &reqwest::Client, engines: &[SocketAddr]) -> anyhow::Result<Vec<Counts>> {
    let mut all = Vec::new();
    for addr in engines {
        let text = http
            .get(format!("http://{addr}/metrics"))
            .send()
            .await?
            .error_for_status()?
            .text()
            .await?;
        let sum = |name| vllm::metric_sum(&text, name).unwrap_or(0.0);
        all.push(Counts {
            finished: sum("vllm:request_success_total"),
            queries: sum("vllm:prefix_cache_queries_total"),
            hits: sum("vllm:prefix_cache_hits_total"),
        });
    }
    Ok(all)
}

/// The engine that finished exactly one more request than in `before`, and
/// the prefix-cache tokens it looked up and hit meanwhile. vLLM does not
/// name itself in a reply, and its counters can follow the reply by a
/// moment, so they are polled until the engine has finished the call and
/// looked up at least its `prompt` tokens.
async fn served_by(
    http: &reqwest::Client,
    engines: &[SocketAddr],
    before: &[Counts],
    prompt: u64,
) -> anyhow::Result<(usize, Counts)> {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let now = counts(http, engines).await?;
        let delta: Vec<Counts> = now
            .iter()
            .zip(before)
            .map(|(n, b)| Counts {
                finished: n.finished - b.finished,
                queries: n.queries - b.queries,
                hits: n.hits - b.hits,
            })
            .collect();
        let grew: Vec<usize> = (0..delta.len()).filter(|i| delta[*i].finished > 0.0).collect();
        match grew.as_slice() {
            [] => {}
            [one] if delta[*one].finished == 1.0 => {
                if delta[*one].queries >= prompt as f64 {
                    return Ok((*one, delta[*one]));
                }
            }
            _ => anyhow::bail!("more than the one call finished: {before:?} -> {now:?}"),
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "no engine finished the call within {DEADLINE:?}: {before:?} -> {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `(prompt_tokens, cached_tokens)` of a chat reply's usage, as the engine
/// reported it.
fn usage(reply: &Value) -> (u64, u64) {
    let n = |p: &str| reply.pointer(p).and_then(Value::as_u64);
    n("/usage/prompt_tokens")
        .zip(n("/usage/prompt_tokens_details/cached_tokens").or(Some(0)))
        .unwrap_or_else(|| panic!("no usage in {reply}"))
}

async fn post(http: &reqwest::Client, base: &str, session: &str, body: &Value) -> anyhow::Result<Value> {
    let reply = http
        .post(format!("{base}/v1/chat/completions"))
        .header(SESSION_HEADER, session)
        .json(body)
        .send()
        .await?;
    let status = reply.status();
    let text = reply.text().await?;
    anyhow::ensure!(status.is_success(), "{base}: {status} {text}");
    Ok(serde_json::from_str(&text)?)
}

/// What one session through smg showed.
struct Session {
    engine: usize,
    last_reply: Value,
}

/// Sends the session `repo` through `smg`, call by call, and asserts from
/// the engines' counters that it stayed on one engine which served its
/// later calls from cache.
async fn session(
    http: &reqwest::Client,
    smg: &Smg,
    engines: &[SocketAddr],
    arm: &str,
    repo: &str,
) -> anyhow::Result<Session> {
    let (mut served, mut prompts, mut hits, mut cached) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut last_reply = Value::Null;
    for turn in 0..TURNS {
        let before = counts(http, engines).await?;
        let reply = post(http, &smg.url(), repo, &body(repo, turn)).await?;
        let (prompt, reported) = usage(&reply);
        let (engine, delta) = served_by(http, engines, &before, prompt).await?;
        served.push(engine);
        prompts.push(prompt);
        hits.push(delta.hits as u64);
        cached.push(reported);
        last_reply = reply;
    }
    eprintln!(
        "{arm}: engines {served:?}, prompt tokens {prompts:?}, prefix cache hits {hits:?}, usage cached {cached:?}"
    );
    assert!(
        served.iter().all(|e| *e == served[0]),
        "{arm}: the session moved between engines {served:?}"
    );
    assert!(
        prompts.windows(2).all(|w| w[1] > w[0]),
        "{arm}: the prompt did not grow {prompts:?}"
    );
    // The engine's own counter: nothing of the first call was cached (its
    // first block names this session's repo), and every later call reused
    // whole blocks of the earlier ones, never more than its prompt.
    assert_eq!(hits[0], 0, "{arm}: the first call hit the cache {hits:?}");
    for turn in 1..TURNS {
        assert!(
            hits[turn] > 0 && hits[turn] % BLOCK_SIZE_TOKENS == 0 && hits[turn] <= prompts[turn],
            "{arm} turn {turn}: prefix cache hits {hits:?} of prompts {prompts:?}"
        );
    }
    // And its reply says the same.
    assert_eq!(hits, cached, "{arm}: the engine's counter against its usage");
    Ok(Session {
        engine: served[0],
        last_reply,
    })
}

/// smg's own Prometheus samples whose series starts with `prefix`.
async fn smg_samples(http: &reqwest::Client, smg: &Smg, prefix: &str) -> anyhow::Result<Vec<(String, f64)>> {
    let text = http
        .get(smg.metrics_url())
        .send()
        .await?
        .error_for_status()?
        .text()
        .await?;
    Ok(text
        .lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            Some((series.to_owned(), value.parse().ok()?))
        })
        .collect())
}

async fn smg_sample(http: &reqwest::Client, smg: &Smg, series: &str) -> anyhow::Result<f64> {
    Ok(smg_samples(http, smg, series)
        .await?
        .into_iter()
        .find(|(s, _)| s == series)
        .map_or(0.0, |(_, v)| v))
}

/// The sampling parameters of the last `n` requests vLLM logged
/// (`--enable-log-requests`: "Received request <id>: params: ...").
fn logged_params(log: &str, n: usize) -> Vec<String> {
    let all: Vec<String> = log
        .lines()
        .filter(|l| l.contains("Received request "))
        .filter_map(|l| l.split_once(": params: ").map(|(_, p)| p.to_owned()))
        .collect();
    all[all.len().saturating_sub(n)..].to_vec()
}

fn start_engines(dir: &Path) -> anyhow::Result<Vec<VllmWorker>> {
    let options = VllmOptions {
        // 8,192 tokens each: a session's prompts fit many times over.
        blocks: 64,
        max_model_len: 4096,
        // Each request's sampling parameters in the log, to compare what
        // smg sent with a direct call.
        extra_args: vec!["--enable-log-requests".into()],
        // Two starts share the 2 cores: one start's time per pair
        // (kvmesh_integration::cluster does the same).
        ready_timeout: READY_TIMEOUT,
        ..VllmOptions::default()
    };
    let started: Vec<anyhow::Result<VllmWorker>> = std::thread::scope(|scope| {
        let starts: Vec<_> = (0..2)
            .map(|i| {
                let options = &options;
                scope.spawn(move || VllmWorker::start(&format!("worker{i}"), dir, options))
            })
            .collect();
        starts
            .into_iter()
            .map(|s| {
                s.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a vLLM start panicked")))
            })
            .collect()
    });
    // Collected first, so that one that started is stopped (dropped) when
    // the other failed.
    started.into_iter().collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smg_keeps_an_agent_session_on_one_vllm_engine_which_serves_it_from_cache() -> anyhow::Result<()> {
    let started = Instant::now();
    // Before the engines' 30 s start: fail at once when smg is missing.
    peers::smg_binary()?;
    let dir = std::env::temp_dir().join(format!("kvmesh-peer-smg-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    eprintln!("logs in {}", dir.display());
    let engines = {
        let dir = dir.clone();
        tokio::task::spawn_blocking(move || start_engines(&dir)).await??
    };
    for engine in &engines {
        eprintln!("vLLM {} ready in {:.1?}", engine.addr, engine.ready_after);
    }
    let addrs: Vec<SocketAddr> = engines.iter().map(|e| e.addr).collect();
    let urls: Vec<String> = engines.iter().map(VllmWorker::url).collect();
    let http = reqwest::Client::builder().timeout(Duration::from_secs(120)).build()?;

    // smg's default policy, as it ships but for loopback ports and a short
    // shutdown grace.
    let plain = {
        let (urls, dir) = (urls.clone(), dir.clone());
        let options = SmgOptions {
            policy: SmgPolicy::CacheAware,
            ..SmgOptions::default()
        };
        tokio::task::spawn_blocking(move || Smg::start(&urls, &options, &dir)).await??
    };
    eprintln!("smg cache_aware ready in {:.1?}", plain.ready_after);
    let repo = "acme/smg-cache-aware";
    let cache_aware = session(&http, &plain, &addrs, "cache_aware", repo).await?;
    // smg's view of it: the first call a miss sent to the least expected
    // wait, every later one a match in its prefix tree of the text.
    let branches = smg_samples(&http, &plain, "smg_cache_aware_policy_branch_total").await?;
    eprintln!("smg cache_aware branches: {branches:?}");
    let tree_matches = smg_sample(
        &http,
        &plain,
        "smg_cache_aware_policy_branch_total{branch=\"tree_match\"}",
    )
    .await?;
    assert_eq!(tree_matches, (TURNS - 1) as f64, "{branches:?}");
    assert_eq!(
        branches.iter().map(|(_, v)| v).sum::<f64>(),
        TURNS as f64,
        "{branches:?}"
    );

    // What smg's rewriting of the body does to what vLLM computes: the last
    // call again, straight to the engine that served it.
    let direct = post(&http, &urls[cache_aware.engine], repo, &body(repo, TURNS - 1)).await?;
    let through = &cache_aware.last_reply;
    eprintln!(
        "through smg: usage {}, text {}; direct: usage {}, text {}",
        through["usage"],
        through["choices"][0]["message"]["content"],
        direct["usage"],
        direct["choices"][0]["message"]["content"]
    );
    assert_eq!(
        usage(through).0,
        usage(&direct).0,
        "prompt tokens through smg and direct"
    );
    assert!(
        through["prompt_token_ids"].is_array(),
        "smg dropped vLLM's prompt_token_ids: {through}"
    );
    assert_eq!(
        through["prompt_token_ids"], direct["prompt_token_ids"],
        "the prompt vLLM tokenised through smg and direct"
    );
    let params = logged_params(&engines[cache_aware.engine].process.log(), 2);
    eprintln!("vLLM's sampling parameters, through smg then direct: {params:#?}");
    assert_eq!(params.len(), 2, "{params:?}");
    assert_eq!(params[0], params[1], "sampling parameters through smg and direct");
    drop(plain);

    // The sticky variant: the session header pins the session after its
    // first call, which cache_aware places.
    let sticky = {
        let (urls, dir) = (urls.clone(), dir.clone());
        let options = SmgOptions {
            policy: SmgPolicy::CacheAware,
            sticky_header: Some(SESSION_HEADER.into()),
            ..SmgOptions::default()
        };
        tokio::task::spawn_blocking(move || Smg::start(&urls, &options, &dir)).await??
    };
    eprintln!("smg cache_aware + sticky sessions ready in {:.1?}", sticky.ready_after);
    session(&http, &sticky, &addrs, "cache_aware+sticky", "acme/smg-sticky").await?;
    // smg's view: every call keyed by the header, the key new once and then
    // found pinned; only the first call went to cache_aware.
    let keyed = smg_sample(&http, &sticky, "smg_routing_key_source_total{source=\"header\"}").await?;
    let pins = smg_samples(&http, &sticky, "smg_manual_policy_branch_total").await?;
    eprintln!("smg sticky: {keyed} calls keyed by the header, pins {pins:?}");
    assert_eq!(keyed, TURNS as f64);
    assert_eq!(
        smg_sample(&http, &sticky, "smg_manual_policy_branch_total{branch=\"vacant\"}").await?,
        1.0,
        "{pins:?}"
    );
    assert_eq!(
        smg_sample(
            &http,
            &sticky,
            "smg_manual_policy_branch_total{branch=\"occupied_hit\"}"
        )
        .await?,
        (TURNS - 1) as f64,
        "{pins:?}"
    );
    drop(sticky);
    drop(engines);
    std::fs::remove_dir_all(&dir)?;
    eprintln!("whole test {:?}", started.elapsed());
    Ok(())
}
