//! What agents gain, through the real Envoy: two harnesses' sessions on a
//! small scripted workload, one with a timestamp at the top of its system
//! prompt and one that appends cleanly. The sidecar's report and metrics
//! are checked against figures computed here by hand (canonical lengths,
//! the replies' usage and workers), the breaker is named at the right
//! section, and no prompt text shows up anywhere.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kvmesh_integration::paths::{self, Profile};
use kvmesh_integration::{Cluster, ClusterOptions};
use serde_json::{Value, json};

const MARKER: &str = "KVMESH-MARKER-5e1d0b77";
const BLOCK: usize = 256;
const CALLS: usize = 4;

/// One harness's scripted session.
struct Script {
    harness: &'static str,
    headers: Vec<(&'static str, String)>,
    /// The system prompt starts with a clock that changes on every call.
    timestamp: bool,
}

impl Script {
    fn body(&self, call: usize) -> Value {
        let clock = if self.timestamp {
            format!("Current Date & Time: 2026-11-30T05:{:02}:{:02}Z\n", 10 + call, 7 * call)
        } else {
            String::new()
        };
        let system = format!(
            "{clock}You are a coding agent. {}",
            "Read files before editing them and run the tests. ".repeat(30)
        );
        let mut messages = vec![
            json!({"role": "system", "content": system}),
            json!({"role": "user", "content": format!("Fix the bug; {MARKER} is a secret.")}),
        ];
        for t in 0..call {
            messages.push(json!({"role": "assistant", "content": format!("Reading module {t} now.")}));
            messages.push(json!({"role": "user", "content": format!("module {t}: {}", "fn f() {} ".repeat(40))}));
        }
        json!({
            "model": "qwen3-coder-30b",
            "max_tokens": 16,
            "messages": messages,
            // The harness's name comes first so that two harnesses share no block.
            "tools": [{"type": "function", "function": {
                "description": format!("{} reads a file", self.harness),
                "name": "read_file",
                "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}],
        })
    }

    /// The canonical stream as docs/routing.md defines it for chat
    /// completions: `\x1e tools \x1f <minified tools>`, then
    /// `\x1e item \x1f <minified message>` per message.
    fn canonical(&self, call: usize) -> Vec<u8> {
        let body = self.body(call);
        let mut out = b"\x1etools\x1f".to_vec();
        out.extend(serde_json::to_vec(&body["tools"]).unwrap_or_default());
        for message in body["messages"].as_array().into_iter().flatten() {
            out.extend(b"\x1eitem\x1f");
            out.extend(serde_json::to_vec(message).unwrap_or_default());
        }
        out
    }

    /// Bytes of call `call` that repeat a prefix an earlier call sent, in
    /// whole blocks: the leading blocks it shares with the previous call.
    fn repeated_bytes(&self, call: usize) -> usize {
        if call == 0 {
            return 0;
        }
        let (prev, cur) = (self.canonical(call - 1), self.canonical(call));
        let same = prev.iter().zip(&cur).take_while(|(a, b)| a == b).count();
        let common_blocks = same / BLOCK;
        // A clean append shares every full block of the previous call.
        (common_blocks * BLOCK).min(cur.len())
    }
}

/// What the replies said, per harness.
#[derive(Default, Debug)]
struct Observed {
    prompt_tokens: u64,
    cached_tokens: u64,
    same_worker: u64,
    continuing: u64,
}

fn row<'r>(report: &'r Value, harness: &str) -> anyhow::Result<&'r Value> {
    report["rows"]
        .as_array()
        .and_then(|rows| rows.iter().find(|r| r["harness"] == harness))
        .with_context(|| format!("no {harness} row in {report:#}"))
}

async fn fetch(http: &reqwest::Client, url: &str) -> anyhow::Result<String> {
    Ok(http.get(url).send().await?.error_for_status()?.text().await?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn insights_name_the_timestamp_breaker_and_match_hand_computed_figures() -> anyhow::Result<()> {
    // The tenant comes from a hop the operator trusts (a gateway).
    let cluster = Cluster::start(
        ClusterOptions {
            plugin: serde_json::json!({"trust_tenant_header": true}),
            ..ClusterOptions::default()
        }
        .patient(),
    )
    .await?;
    let scripts = [
        Script {
            harness: "openclaw",
            headers: vec![
                ("user-agent", "openclaw/2026.1.5".to_owned()),
                ("x-session-affinity", "claw-session-1".to_owned()),
            ],
            timestamp: true,
        },
        Script {
            harness: "codex",
            headers: vec![
                ("originator", "codex_cli_rs".to_owned()),
                ("session-id", "codex-session-1".to_owned()),
            ],
            timestamp: false,
        },
    ];
    let mut observed = [Observed::default(), Observed::default()];
    for (script, seen) in scripts.iter().zip(&mut observed) {
        let mut last_worker = None;
        for call in 0..CALLS {
            let mut headers: Vec<(&str, &str)> = script.headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
            headers.push(("x-kvmesh-tenant", "team-a"));
            let reply = cluster.chat(&script.body(call), &headers).await?;
            assert_eq!(reply.status, 200, "{}", reply.body);
            seen.prompt_tokens += reply.prompt_tokens().context("no usage")?;
            seen.cached_tokens += reply.cached_tokens().unwrap_or(0);
            if let Some(last) = &last_worker {
                seen.continuing += 1;
                seen.same_worker += u64::from(reply.worker.as_ref() == Some(last));
            }
            last_worker = reply.worker.clone();
        }
    }
    cluster.wait_for_no_in_flight(Duration::from_secs(10)).await?;

    let http = reqwest::Client::builder().no_proxy().build()?;
    let report_url = format!("http://{}/debug/report?window_secs=3600", cluster.sidecar_admin);
    // Outcome reports trail the responses a little.
    let deadline = Instant::now() + Duration::from_secs(10);
    let report: Value = loop {
        let report: Value = serde_json::from_str(&fetch(&http, &report_url).await?)?;
        let reported = |h| row(&report, h).map(|r| r["reported_calls"].as_u64()).ok().flatten();
        if reported("openclaw") == Some(CALLS as u64) && reported("codex") == Some(CALLS as u64) {
            break report;
        }
        if Instant::now() > deadline {
            bail!("outcomes never all arrived: {report:#}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };

    for (script, seen) in scripts.iter().zip(&observed) {
        let r = row(&report, script.harness)?;
        let h = script.harness;
        assert_eq!(r["tenant"], "team-a");
        assert_eq!(r["calls"], CALLS as u64, "{h}");
        // Repeated-prefix share: canonical bytes, computed here.
        let prompt: usize = (0..CALLS).map(|c| script.canonical(c).len()).sum();
        let repeated: usize = (0..CALLS).map(|c| script.repeated_bytes(c)).sum();
        assert_eq!(r["prompt_bytes"], prompt as u64, "{h}: prompt bytes");
        assert_eq!(r["repeated_prefix_bytes"], repeated as u64, "{h}: repeated bytes");
        let share = r["repeated_prefix_share"].as_f64().unwrap_or(-1.0);
        assert!(
            (share - repeated as f64 / prompt as f64).abs() < 1e-9,
            "{h}: share {share}"
        );
        // Read/write ratio: the engine's own usage, summed here.
        let written = seen.prompt_tokens - seen.cached_tokens;
        assert_eq!(r["cache_read_tokens"], seen.cached_tokens as f64, "{h}");
        assert_eq!(r["cache_written_tokens"], written as f64, "{h}");
        let rw = r["read_write_ratio"].as_f64().unwrap_or(-1.0);
        assert!(
            (rw - seen.cached_tokens as f64 / written as f64).abs() < 1e-9,
            "{h}: r/w {rw}"
        );
        // Same-worker rate: the workers the replies came from.
        assert_eq!(r["continuing_calls"], seen.continuing, "{h}");
        assert_eq!(r["same_worker_calls"], seen.same_worker, "{h}");
        assert_eq!(r["prefix_checks"], (CALLS - 1) as u64, "{h}");
    }
    // The clean session repeats far more of its prompt than the one whose
    // clock breaks its prefix right after the tools.
    let share = |h| row(&report, h).map(|r| r["repeated_prefix_share"].as_f64().unwrap_or(0.0));
    assert!(share("codex")? > 0.5 && share("openclaw")? < 0.25, "{report:#}");

    // The breaker: openclaw at its system prompt on every continuing call;
    // codex never.
    let breaks = |h| row(&report, h).map(|r| r["prefix_breaks"].clone());
    assert_eq!(
        breaks("openclaw")?,
        json!({"tools": 0, "system": CALLS - 1, "message": 0, "other": 0})
    );
    assert_eq!(
        breaks("codex")?,
        json!({"tools": 0, "system": 0, "message": 0, "other": 0})
    );
    let top = &report["breakers"][0];
    assert_eq!(
        (&top["harness"], &top["section"], &top["count"]),
        (&json!("openclaw"), &json!("system"), &json!(CALLS - 1)),
        "{report:#}"
    );
    assert_eq!(report["breakers"].as_array().map(Vec::len), Some(1), "{report:#}");
    // The block where it broke: the clock sits in the block that holds the
    // start of the system message.
    let script = &scripts[0];
    let diverge = script
        .canonical(0)
        .iter()
        .zip(&script.canonical(1))
        .take_while(|(a, b)| a == b)
        .count();
    assert_eq!(top["first_block_min"], (diverge / BLOCK) as u64);
    let points: Value =
        serde_json::from_str(&fetch(&http, &format!("http://{}/debug/prefix-breaks", cluster.sidecar_admin)).await?)?;
    assert_eq!(points["break_points"][0]["harness"], "openclaw");
    assert_eq!(points["break_points"][0]["section"], "system");

    // The same figures in Prometheus.
    let metric = |series: String| cluster.sidecar_metric_required(series);
    assert_eq!(
        metric(r#"kvmesh_prefix_breaks_total{harness="openclaw",tenant="team-a",section="system"}"#.into()).await?,
        (CALLS - 1) as f64
    );
    assert_eq!(
        metric(r#"kvmesh_prefix_breaks_total{harness="codex",tenant="team-a",section="system"}"#.into()).await?,
        0.0
    );
    assert_eq!(
        metric(r#"kvmesh_session_same_worker_calls_total{harness="codex",tenant="team-a"}"#.into()).await?,
        observed[1].same_worker as f64
    );
    assert_eq!(
        metric(r#"kvmesh_repeated_prefix_bytes_total{harness="codex",tenant="team-a"}"#.into()).await?,
        (0..CALLS).map(|c| scripts[1].repeated_bytes(c)).sum::<usize>() as f64
    );

    // Each idle session's hold on its worker: both sessions, on the worker
    // their last call went to, with their KV bytes and recompute cost.
    let sessions: Value =
        serde_json::from_str(&fetch(&http, &format!("http://{}/debug/sessions", cluster.sidecar_admin)).await?)?;
    for (session, harness) in [("claw-session-1", "openclaw"), ("codex-session-1", "codex")] {
        let idle = sessions["idle"]
            .as_array()
            .and_then(|all| all.iter().find(|s| s["session"] == session))
            .with_context(|| format!("{session} not idle in {sessions:#}"))?;
        assert_eq!(idle["harness"], harness);
        assert!(idle["kv_bytes"].as_f64().is_some_and(|b| b > 0.0), "{idle}");
        assert!(idle["recompute_ms"].as_f64().is_some(), "{idle}");
    }

    // The report command prints the same, and no prompt text anywhere.
    let sidecar = paths::binary("kvmesh-sidecar", Profile::Debug)?;
    let admin = format!("http://{}", cluster.sidecar_admin);
    let printed = std::process::Command::new(&sidecar)
        .args(["report", "--admin", &admin, "--window", "1h"])
        .output()?;
    assert!(printed.status.success(), "{}", String::from_utf8_lossy(&printed.stderr));
    let text = String::from_utf8(printed.stdout)?;
    let breaker_line = text
        .lines()
        .find(|l| l.contains("openclaw") && l.contains("system") && l.contains("breaks"))
        .with_context(|| format!("no breaker line in:\n{text}"))?;
    assert!(
        breaker_line.contains(&format!("{} breaks", CALLS - 1)),
        "{breaker_line}"
    );
    assert!(
        !text.lines().any(|l| l.contains("codex") && l.contains("breaks")),
        "codex named as a breaker:\n{text}"
    );
    let json_out = std::process::Command::new(&sidecar)
        .args(["report", "--admin", &admin, "--json"])
        .output()?;
    let mut pages = vec![
        ("report".to_owned(), text),
        ("report --json".to_owned(), String::from_utf8(json_out.stdout)?),
    ];
    for path in ["/metrics", "/debug/report", "/debug/prefix-breaks", "/debug/sessions"] {
        let url = format!("{admin}{path}");
        pages.push((url.clone(), fetch(&http, &url).await?));
    }
    for name in ["sidecar.log", "envoy.log"] {
        let path = cluster.dir.join(name);
        pages.push((path.display().to_string(), std::fs::read_to_string(&path)?));
    }
    for (source, text) in &pages {
        assert!(!text.contains(MARKER), "prompt text in {source}");
        assert!(!text.contains("Read files before editing"), "prompt text in {source}");
    }
    Ok(())
}
