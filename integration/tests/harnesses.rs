//! The four real agent harness CLIs (Claude Code, Codex, OpenCode, OpenClaw,
//! at the versions `./dev setup-harnesses` pins) drive real sessions through
//! Envoy and kvmesh onto three scripted workers (`kvmesh-sim
//! --agent-script`): one session that spawns a subagent, then two sessions
//! at once. Each worker records what reached it; the test reads, from those
//! requests and with its own knowledge of each CLI (not kvmesh's), who each
//! call belongs to and which calls are side calls, and checks the sidecar's
//! view against it:
//!
//! - every call reached kvmesh with its harness's own session id, under the
//!   right harness label; a subagent with the right parent;
//! - side calls (OpenCode's title call) are counted as side calls, never as
//!   the session's break or move;
//! - each session's main-lane calls stay on one worker (three idle
//!   workers: light load), and no prefix break is reported where the prefix
//!   is stable (OpenClaw on Chat Completions moves one message at its tail
//!   on every call: a real break, reported as a message, never earlier);
//! - consecutive main-lane calls keep at least 0.99 of the earlier call's
//!   canonical stream.
//!
//! Each test prints one `harness-table:` line, the figures of
//! docs/harnesses/README.md's table.
#![allow(clippy::panic)] // a failure panics while the cluster lives, so its logs are kept

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use kvmesh_integration::harnesses::{
    CLI_TIMEOUT, Cli, OpenClawGateway, PROMPT_ONE_TOOL, PROMPT_SUBAGENT, ProviderApi, Scratch,
};
use kvmesh_integration::{Cluster, ClusterOptions};
use kvmesh_request::{Api, Envelope, canonical_stream};
use serde_json::Value;

/// Codex's automatic compaction limit in the compacting run: below its
/// first call's prompt (about 15,000 tokens on the simulated engine), so the
/// history is compacted once the first reply reports its usage.
const CODEX_COMPACT_TOKENS: u32 = 3000;

/// Requests each worker keeps for the test: far more than a test makes.
const RECORDED: &str = "10000";

/// One request as a worker received it.
#[derive(Debug, Clone)]
struct Received {
    received_us: u128,
    /// The worker that received it (its index in the cluster).
    worker: usize,
    path: String,
    headers: Vec<(String, String)>,
    body: String,
}

impl Received {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or(Value::Null)
    }
}

/// Who a call belongs to and what it is, read by the test from what the
/// CLI sent (docs/harnesses/).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Truth {
    session: String,
    /// The key the call's conversation is placed by: a subagent's own id
    /// (Claude Code's agent id, Codex's thread), else the session.
    routing_key: String,
    /// The routing key's parent, for a subagent.
    parent: Option<String>,
    side: bool,
    /// Codex's compaction call (`request_kind: compaction` in its turn
    /// metadata): the next call rebuilds the history.
    compaction: bool,
}

fn openclaw_session_id(body: &str) -> Option<String> {
    let at = body.find("sessionId=")? + "sessionId=".len();
    let id: String = body[at..]
        .chars()
        .take_while(|c| c.is_ascii_hexdigit() || *c == '-')
        .collect();
    (id.len() == 36).then_some(id)
}

fn trace_id(request: &Received) -> Option<String> {
    request.header("traceparent")?.split('-').nth(1).map(str::to_owned)
}

/// A call that declares no tools: a title or summary call beside the
/// session (Codex's tools may travel in an `additional_tools` input item).
fn declares_no_tools(body: &Value) -> bool {
    let tools = body
        .get("tools")
        .and_then(Value::as_array)
        .is_some_and(|t| !t.is_empty());
    let item_tools = body.get("input").and_then(Value::as_array).is_some_and(|items| {
        items
            .iter()
            .any(|i| i.get("type") == Some(&Value::from("additional_tools")))
    });
    !tools && !item_tools
}

/// The truth of every request, in arrival order. OpenClaw's subagent names
/// its parent only by its turn's trace id: the parent is the session whose
/// non-subagent calls carried that trace id.
fn truths(cli: Cli, requests: &[Received]) -> anyhow::Result<Vec<Truth>> {
    let mut out = Vec::new();
    for request in requests {
        let body = request.json();
        let side = declares_no_tools(&body);
        let compaction = request
            .header("x-codex-turn-metadata")
            .and_then(|m| serde_json::from_str::<Value>(m).ok())
            .is_some_and(|m| m["request_kind"] == "compaction");
        let header = |name: &str| request.header(name).map(str::to_owned);
        let truth = match cli {
            Cli::ClaudeCode => {
                let session = header("x-claude-code-session-id").context("a Claude Code call without its session")?;
                match header("x-claude-code-agent-id") {
                    Some(agent) => Truth {
                        routing_key: agent,
                        parent: Some(session.clone()),
                        session,
                        side,
                        compaction,
                    },
                    None => Truth {
                        routing_key: session.clone(),
                        parent: None,
                        session,
                        side,
                        compaction,
                    },
                }
            }
            Cli::Codex => {
                let session = header("session-id").context("a Codex call without its session")?;
                let thread = header("thread-id").unwrap_or_else(|| session.clone());
                Truth {
                    parent: header("x-codex-parent-thread-id"),
                    routing_key: if thread == session { session.clone() } else { thread },
                    session,
                    side,
                    compaction,
                }
            }
            Cli::OpenCode => {
                let session = header("x-session-id").context("an OpenCode call without its session")?;
                Truth {
                    routing_key: session.clone(),
                    parent: header("x-parent-session-id"),
                    session,
                    side,
                    compaction,
                }
            }
            Cli::OpenClaw => {
                let session = openclaw_session_id(&request.body).context("an OpenClaw call without a sessionId")?;
                let parent = if request.body.contains(":subagent:") {
                    let trace = trace_id(request).context("an OpenClaw subagent call without traceparent")?;
                    let parent = requests
                        .iter()
                        .filter(|r| !r.body.contains(":subagent:") && trace_id(r).as_deref() == Some(&trace))
                        .find_map(|r| openclaw_session_id(&r.body))
                        .context("no OpenClaw call carries the subagent's trace id")?;
                    Some(parent)
                } else {
                    None
                };
                Truth {
                    routing_key: session.clone(),
                    parent,
                    session,
                    side,
                    compaction,
                }
            }
        };
        out.push(truth);
    }
    Ok(out)
}

async fn get_json(url: String) -> anyhow::Result<Value> {
    let response = reqwest::get(&url).await.with_context(|| format!("GET {url}"))?;
    ensure!(response.status().is_success(), "GET {url}: {}", response.status());
    Ok(response.json().await?)
}

/// Every inference request the workers received, in arrival order.
async fn received(cluster: &Cluster) -> anyhow::Result<Vec<Received>> {
    let mut all = Vec::new();
    for (index, worker) in cluster.workers.iter().enumerate() {
        let requests = get_json(format!("http://{}/admin/requests", worker.addr)).await?;
        for r in requests.as_array().context("/admin/requests is not a list")? {
            all.push(Received {
                received_us: r["received_us"].as_u64().map_or(0, u128::from),
                worker: index,
                path: r["path"].as_str().unwrap_or_default().to_owned(),
                headers: r["headers"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|h| Some((h[0].as_str()?.to_owned(), h[1].as_str()?.to_owned())))
                    .collect(),
                body: r["body"].as_str().unwrap_or_default().to_owned(),
            });
        }
    }
    all.sort_by_key(|r| r.received_us);
    Ok(all)
}

/// Runs the CLI to its end. OpenClaw's `agent` can fail at admission when
/// two sessions of one gateway start at once ("Session canonical
/// validation schema changed during admission; retry the read", seen with
/// 2026.9.6 on a loaded machine): as it says, the command is run again, up
/// to [`OPENCLAW_ATTEMPTS`] times.
async fn run_to_end(
    cli: Cli,
    scratch: &Scratch,
    url: &str,
    prompt: &str,
    name: &str,
    dir: &std::path::Path,
    extra: &[String],
) -> anyhow::Result<String> {
    let mut attempt = 1;
    loop {
        let run = cli.start(scratch, url, prompt, &format!("{name}-{attempt}"), dir, extra)?;
        let (status, stdout) = tokio::task::spawn_blocking(move || run.finish(CLI_TIMEOUT)).await??;
        if status.success() {
            return Ok(stdout);
        }
        let retry = cli == Cli::OpenClaw && stdout.contains("retry") && attempt < OPENCLAW_ATTEMPTS;
        ensure!(retry, "the CLI exited {status}; stdout:\n{stdout}");
        eprintln!("{name}: attempt {attempt} ended {status}, run again: {stdout}");
        attempt += 1;
    }
}

/// Runs of one OpenClaw `agent` command at most (see [`run_to_end`]).
const OPENCLAW_ATTEMPTS: u32 = 3;

/// What the sidecar saw, per routing key: `/debug/sessions`' rows.
#[derive(Debug)]
struct Row {
    harness: String,
    parent: Option<String>,
    main: u64,
    side: u64,
    compaction: u64,
}

async fn sidecar_rows(cluster: &Cluster) -> anyhow::Result<BTreeMap<String, Row>> {
    let page = get_json(format!("http://{}/debug/sessions?limit=10000", cluster.sidecar_admin)).await?;
    let mut rows = BTreeMap::new();
    for s in page["sessions"].as_array().context("no sessions list")? {
        let lanes = &s["lanes"];
        rows.insert(
            s["session"].as_str().unwrap_or_default().to_owned(),
            Row {
                harness: s["harness"].as_str().unwrap_or_default().to_owned(),
                parent: s["parent"].as_str().map(str::to_owned),
                main: lanes["main"].as_u64().unwrap_or(0),
                side: lanes["side"].as_u64().unwrap_or(0),
                compaction: lanes["compaction"].as_u64().unwrap_or(0),
            },
        );
    }
    Ok(rows)
}

/// A call of OpenClaw's parent turn run when a subagent settles. OpenClaw
/// then changes its prompt before the tail: another tool set, and earlier
/// subagent-context user messages rewritten as an inter-session message
/// carrying the child's result (observed with 2026.9.6).
fn is_openclaw_settle_turn(request: &Received) -> bool {
    request.body.contains("sourceTool=subagent_settle")
}

/// The canonical stream kvmesh hashes for one request, and where its last
/// section starts.
fn canonical(request: &Received) -> anyhow::Result<(Vec<u8>, usize)> {
    let api = Api::from_path(&request.path).with_context(|| format!("no API at {}", request.path))?;
    let envelope = Envelope::parse(request.body.as_bytes(), false)?;
    let canonical = canonical_stream(api, &envelope, usize::MAX)?;
    let last = canonical
        .sections
        .last()
        .map_or(0, |s| usize::try_from(s.start).unwrap_or(usize::MAX));
    Ok((canonical.stream, last))
}

/// OpenClaw on Chat Completions and Messages appends an internal-context
/// user message last on every call and drops the previous call's: the
/// earlier call's last message is that one.
fn ends_with_openclaw_internal_context(request: &Received) -> bool {
    let body = request.json();
    body["messages"]
        .as_array()
        .and_then(|messages| messages.last())
        .is_some_and(|m| m["role"] == "user" && m["content"].to_string().contains("BEGIN_OPENCLAW_INTERNAL_CONTEXT"))
}

fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Waits until `done` holds for the workers' requests (OpenClaw's
/// subagent runs on after the `agent` command returns).
async fn wait_for_requests(cluster: &Cluster, what: &str, done: impl Fn(&[Received]) -> bool) -> anyhow::Result<()> {
    let deadline = Instant::now() + CLI_TIMEOUT;
    loop {
        if done(&received(cluster).await?) {
            return Ok(());
        }
        if Instant::now() >= deadline {
            let requests = received(cluster).await?;
            let last = requests
                .last()
                .map(|r| r.body.chars().rev().take(600).collect::<String>());
            bail!(
                "{what}: not seen within {CLI_TIMEOUT:?}; {} requests, the last ending (reversed) {last:?}",
                requests.len()
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// How one test runs a CLI.
#[derive(Debug, Clone, Copy)]
struct Setting {
    api: ProviderApi,
    /// The first session's prompt: one that makes the scripted model spawn a
    /// subagent (it says KVSPAWN).
    subagent_prompt: &'static str,
    /// The prompt of the two sessions run at once.
    plain_prompt: &'static str,
    /// The filter's `strip_preambles` (Claude Code's billing line).
    strip_preambles: bool,
}

impl Setting {
    /// What the suite runs: each CLI's usual API, the fixed prompts, and for
    /// Claude Code the billing line stripped (the simulated engine, unlike
    /// vLLM's `/v1/messages`, does not strip it).
    fn suite(cli: Cli) -> Self {
        Self {
            api: match cli {
                Cli::ClaudeCode => ProviderApi::Messages,
                Cli::Codex => ProviderApi::Responses,
                Cli::OpenCode | Cli::OpenClaw => ProviderApi::Chat,
            },
            subagent_prompt: PROMPT_SUBAGENT,
            plain_prompt: PROMPT_ONE_TOOL,
            strip_preambles: cli == Cli::ClaudeCode,
        }
    }
}

async fn drive(cli: Cli, setting: Setting) -> anyhow::Result<()> {
    let options = ClusterOptions {
        sim_args: vec![
            "--time-scale".into(),
            "0".into(),
            "--agent-script".into(),
            "--record-requests".into(),
            RECORDED.into(),
        ],
        plugin: serde_json::json!({"strip_preambles": setting.strip_preambles}),
        ..ClusterOptions::default()
    };
    let cluster = Cluster::start(options.patient()).await?;
    if let Err(err) = exercise(cli, setting, &cluster).await {
        // A panic, while the cluster lives, keeps its logs (and the CLIs').
        panic!("{err:?}");
    }
    Ok(())
}

async fn exercise(cli: Cli, setting: Setting, cluster: &Cluster) -> anyhow::Result<()> {
    let api = setting.api;
    let url = cluster.envoy_url.clone();
    let dir = cluster.dir.join("harness");
    std::fs::create_dir_all(&dir)?;
    let name = cli.name();
    let started = Instant::now();
    let phase = |what: &str| eprintln!("{name}: {what} after {:.1} s", started.elapsed().as_secs_f64());

    // One session that spawns a subagent.
    let first = Scratch::new(&dir, "first")?;
    cli.configure(&first, &url, api, &dir)?;
    phase("configured");
    let gateway = match cli {
        Cli::OpenClaw => Some(OpenClawGateway::start(&first, &dir)?),
        _ => None,
    };
    phase("ready");
    run_to_end(
        cli,
        &first,
        &url,
        setting.subagent_prompt,
        &format!("{name}-subagent"),
        &dir,
        &[],
    )
    .await?;
    if cli == Cli::OpenClaw {
        // The child runs in the gateway after `agent` returns: wait for its
        // final answer (its second call).
        wait_for_requests(cluster, "OpenClaw's subagent's two calls", |requests| {
            requests.iter().filter(|r| r.body.contains(":subagent:")).count() >= 2
        })
        .await?;
    }

    phase("subagent session done");
    // Two sessions at once (OpenClaw: two sessions of its gateway).
    let launches: Vec<(Scratch, String, Vec<String>)> = match cli {
        Cli::OpenClaw => [
            "3b9c8f00-0000-4000-8000-00000000000a",
            "3b9c8f00-0000-4000-8000-00000000000b",
        ]
        .iter()
        .map(|id| {
            let extra = vec!["--session-id".to_owned(), (*id).to_owned()];
            (first.clone(), format!("{name}-{id}"), extra)
        })
        .collect(),
        _ => {
            let mut launches = Vec::new();
            for user in ["second", "third"] {
                let scratch = Scratch::new(&dir, user)?;
                cli.configure(&scratch, &url, api, &dir)?;
                launches.push((scratch, format!("{name}-{user}"), Vec::new()));
            }
            launches
        }
    };
    let [a, b] = [&launches[0], &launches[1]]
        .map(|(scratch, run_name, extra)| run_to_end(cli, scratch, &url, setting.plain_prompt, run_name, &dir, extra));
    let (a, b) = tokio::join!(a, b);
    a?;
    b?;
    drop(gateway);
    if cli == Cli::Codex {
        // A session whose history Codex compacts (its automatic compaction,
        // at a token limit below the first call's prompt): a turn, the
        // compaction call, then a turn on the rebuilt history.
        let scratch = Scratch::new(&dir, "compacting")?;
        cli.configure(&scratch, &url, api, &dir)?;
        kvmesh_integration::harnesses::codex_auto_compact(&scratch, CODEX_COMPACT_TOKENS)?;
        run_to_end(
            cli,
            &scratch,
            &url,
            setting.plain_prompt,
            &format!("{name}-compacting"),
            &dir,
            &[],
        )
        .await?;
    }
    phase("two sessions done");

    // Every call has been answered and reported.
    cluster.wait_for_no_in_flight(Duration::from_secs(30)).await?;
    let requests = received(cluster).await?;
    let truths = truths(cli, &requests)?;
    ensure!(
        cluster.fail_opens().await? == (0, 0),
        "{name}: calls failed open (round robin), their placement proves nothing"
    );
    if cli == Cli::ClaudeCode && setting.strip_preambles {
        // `strip_preambles`: every call carried the billing line, and no
        // call reached a worker with it.
        let stripped = cluster.envoy_counter("wasmcustom.kvmesh.preamble.stripped").await?;
        ensure!(
            stripped == requests.len() as u64,
            "{name}: {stripped} billing lines stripped, {} calls",
            requests.len()
        );
        ensure!(
            requests.iter().all(|r| !r.body.contains("x-anthropic-billing-header")),
            "{name}: a billing line reached a worker"
        );
    }
    let rows = sidecar_rows(cluster).await?;

    // Every call reached kvmesh with its own session, harness and parent.
    let keys: BTreeSet<&str> = truths.iter().map(|t| t.routing_key.as_str()).collect();
    let sessions: BTreeSet<&str> = truths.iter().map(|t| t.session.as_str()).collect();
    ensure!(
        sessions.len() >= 3,
        "{name}: {} sessions in the workers' requests, want at least 3",
        sessions.len()
    );
    let seen: BTreeSet<&str> = rows.keys().map(String::as_str).collect();
    ensure!(
        seen == keys,
        "{name}: the sidecar saw sessions {seen:?}, the CLI's calls belong to {keys:?}"
    );
    let mut with_session = 0;
    for key in &keys {
        let row = &rows[*key];
        let calls: Vec<&Truth> = truths.iter().filter(|t| t.routing_key == *key).collect();
        let side = calls.iter().filter(|t| t.side).count() as u64;
        ensure!(row.harness == name, "{name}: session {key} labelled {}", row.harness);
        ensure!(
            row.main + row.side + row.compaction == calls.len() as u64,
            "{name}: session {key}: the sidecar counted {} calls, the workers received {}",
            row.main + row.side + row.compaction,
            calls.len()
        );
        ensure!(
            row.side == side,
            "{name}: session {key}: {} side calls counted, {side} sent",
            row.side
        );
        let compactions = calls.iter().filter(|t| t.compaction).count() as u64;
        ensure!(
            row.compaction == compactions,
            "{name}: session {key}: {} compaction calls counted, {compactions} sent",
            row.compaction
        );
        ensure!(
            row.parent == calls[0].parent,
            "{name}: session {key}: parent {:?}, want {:?}",
            row.parent,
            calls[0].parent
        );
        with_session += calls.len();
    }
    let subagents = keys.iter().filter(|k| rows[**k].parent.is_some()).count();
    ensure!(subagents >= 1, "{name}: no subagent was seen");
    let side_calls: u64 = rows.values().map(|r| r.side).sum();
    let compactions: u64 = rows.values().map(|r| r.compaction).sum();

    // Main-lane calls of each session: one worker, stable canonical prefix.
    let report = get_json(format!(
        "http://{}/debug/report?window_secs=3600",
        cluster.sidecar_admin
    ))
    .await?;
    let row = report["rows"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|r| r["harness"] == name)
        .with_context(|| format!("{name}: no report row: {report}"))?;
    let continuing = row["continuing_calls"].as_u64().unwrap_or(0);
    let same_worker = row["same_worker_calls"].as_u64().unwrap_or(0);
    ensure!(continuing > 0, "{name}: no continuing call in the report: {row}");
    let placements: Vec<String> = requests
        .iter()
        .zip(&truths)
        .map(|(r, t)| {
            format!(
                "{}{}@w{}",
                t.routing_key.get(..8).unwrap_or(&t.routing_key),
                if t.side { "(side)" } else { "" },
                r.worker
            )
        })
        .collect();
    ensure!(
        same_worker == continuing,
        "{name}: {same_worker} of {continuing} main-lane calls stayed on their session's worker: {row}\ncalls in order: {placements:?}"
    );
    let breaks: BTreeMap<String, u64> = row["prefix_breaks"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(k, v)| (k.clone(), v.as_u64().unwrap_or(0)))
        .filter(|(_, n)| *n > 0)
        .collect();
    let mut worst_kept = 1.0_f64;
    // OpenClaw's parent turn that takes in a finished subagent's result
    // rewrites its prompt before the tail: real breaks, which kvmesh must
    // report, and which no routing can save.
    let mut settle_turns = 0_u64;
    // OpenClaw's moved tail message (above), and what it cost.
    let mut tail_moves = 0_u64;
    let mut openclaw_worst_kept = 1.0_f64;
    let mut worst_at = String::new();
    // Calls after a compaction, which start a new prefix epoch.
    let mut new_epochs = 0_u64;
    for key in &keys {
        let main: Vec<(&Received, &Truth)> = requests
            .iter()
            .zip(&truths)
            .filter(|(_, t)| t.routing_key == *key && !t.side)
            .collect();
        for calls in main.windows(2) {
            if calls[0].1.compaction {
                // The history is rebuilt after a compaction: a new epoch,
                // not a prefix to keep.
                new_epochs += 1;
                continue;
            }
            let pair = [calls[0].0, calls[1].0];
            if cli == Cli::OpenClaw && is_openclaw_settle_turn(pair[1]) {
                settle_turns += 1;
                continue;
            }
            let ((earlier, earlier_last), (later, _)) = (canonical(pair[0])?, canonical(pair[1])?);
            let common = common_prefix(&earlier, &later);
            if cli == Cli::OpenClaw && ends_with_openclaw_internal_context(pair[0]) {
                // Everything but the moved message must be kept; the share
                // kept depends on how long the conversation is.
                ensure!(
                    common >= earlier_last,
                    "{name}: session {key} broke {} bytes before the internal-context message it moves: earlier {:?}, later {:?}",
                    earlier_last - common,
                    String::from_utf8_lossy(&earlier[common.saturating_sub(100)..(common + 300).min(earlier.len())]),
                    String::from_utf8_lossy(&later[common.saturating_sub(100)..(common + 300).min(later.len())]),
                );
                tail_moves += 1;
                openclaw_worst_kept = openclaw_worst_kept.min(common as f64 / earlier.len().max(1) as f64);
                continue;
            }
            let kept = common as f64 / earlier.len().max(1) as f64;
            if kept < worst_kept {
                worst_kept = kept;
                let around = |s: &[u8]| {
                    String::from_utf8_lossy(&s[common.saturating_sub(80)..(common + 120).min(s.len())]).into_owned()
                };
                let last_message = |r: &Received| {
                    let body = r.json();
                    let text = body["messages"]
                        .as_array()
                        .and_then(|m| m.iter().rev().find(|m| m["role"] == "user"))
                        .map(|m| m["content"].to_string())
                        .unwrap_or_default();
                    text.chars().take(300).collect::<String>()
                };
                worst_at = format!(
                    "session {key}: {common} of {} bytes; earlier {:?}; later {:?}; the later call's last user message {:?}",
                    earlier.len(),
                    around(&earlier),
                    around(&later),
                    last_message(pair[1]),
                );
            }
        }
    }
    ensure!(
        worst_kept >= 0.99,
        "{name}: consecutive main-lane calls kept {worst_kept:.4} of the canonical prefix ({worst_at})"
    );
    match cli {
        // Its internal-context message moves on every call: a real break
        // at a message, never at the tools or the system prompt.
        Cli::OpenClaw => {
            ensure!(
                settle_turns == 0 || !breaks.is_empty(),
                "{name}: {settle_turns} subagent settle calls rewrote the prompt, kvmesh reported no break"
            );
            ensure!(
                breaks.keys().all(|section| section == "message" || section == "tools"),
                "{name}: prefix breaks outside the tools and messages: {breaks:?}"
            );
        }
        _ => ensure!(
            breaks.is_empty(),
            "{name}: prefix breaks on a stable prefix: {breaks:?}"
        ),
    }
    if cli == Cli::Codex {
        ensure!(compactions >= 1, "{name}: Codex compacted no history");
        let epochs = row["prefix_epochs"].as_u64().unwrap_or(0);
        ensure!(
            epochs == new_epochs,
            "{name}: {new_epochs} calls after a compaction, kvmesh counted {epochs} new prefix epochs: {row}"
        );
    }
    println!(
        "harness-table: {name} | sessions {} | calls {} | with a session id {with_session} | subagents {subagents} | \
         side calls {side_calls} | compactions {compactions} (new epochs {new_epochs}) | same worker {same_worker}/{continuing} | prefix breaks {breaks:?} | \
         worst consecutive canonical prefix {worst_kept:.4} | settle turns {settle_turns} | \
         tail message moves {tail_moves} (worst kept {openclaw_worst_kept:.4})",
        sessions.len(),
        requests.len(),
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn claude_code_sessions_and_subagent_through_kvmesh() -> anyhow::Result<()> {
    drive(Cli::ClaudeCode, Setting::suite(Cli::ClaudeCode)).await
}

#[tokio::test(flavor = "multi_thread")]
async fn codex_sessions_and_subagent_through_kvmesh() -> anyhow::Result<()> {
    drive(Cli::Codex, Setting::suite(Cli::Codex)).await
}

#[tokio::test(flavor = "multi_thread")]
async fn opencode_sessions_subagent_and_title_calls_through_kvmesh() -> anyhow::Result<()> {
    drive(Cli::OpenCode, Setting::suite(Cli::OpenCode)).await
}

#[tokio::test(flavor = "multi_thread")]
async fn openclaw_sessions_and_subagent_through_kvmesh() -> anyhow::Result<()> {
    drive(Cli::OpenClaw, Setting::suite(Cli::OpenClaw)).await
}

/// A check against prompts and settings the tests above do not use (run by
/// hand, `cargo test -p kvmesh-integration --test harnesses -- --ignored
/// --nocapture`; its findings are in docs/harnesses/README.md): other
/// wording, Claude Code with the billing line left in, OpenCode over
/// Responses, OpenClaw over Messages.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "a hand-run check; its figures are in docs/harnesses/README.md"]
async fn harnesses_with_other_prompts_and_settings() -> anyhow::Result<()> {
    const SPAWN: &str =
        "KVSPAWN: look at README.md with the shell, ask a helper agent to double-check it, then summarise";
    const PLAIN: &str = "What is in this repository? Use the shell to look.";
    for (cli, api) in [
        (Cli::ClaudeCode, ProviderApi::Messages),
        (Cli::Codex, ProviderApi::Responses),
        (Cli::OpenCode, ProviderApi::Responses),
        (Cli::OpenClaw, ProviderApi::Messages),
    ] {
        let setting = Setting {
            api,
            subagent_prompt: SPAWN,
            plain_prompt: PLAIN,
            strip_preambles: false,
        };
        drive(cli, setting).await?;
    }
    Ok(())
}
