//! The admin server's debug pages over a real sidecar: `/debug/sessions`
//! pages its sessions, newest first, and caps a page whatever is asked,
//! with each one's harness, calls by lane and resolved parent;
//! `/debug/report` carries the retention section and `kvmesh-sidecar
//! report` prices it.
#![allow(clippy::unwrap_used, clippy::panic)] // test helpers fail loudly by design

mod common;

use common::{http_get, start};
use kvmesh_proto::v1::PickRequest;
use kvmesh_proto::v1::router_client::RouterClient;

#[tokio::test]
async fn debug_sessions_pages_the_newest_first() {
    let sidecar = start();
    let mut client = RouterClient::new(sidecar.channel().await);
    // Five sessions, a few ms apart so their last-seen times differ.
    for i in 0..5u64 {
        client
            .pick(PickRequest {
                block_hashes: vec![i + 1],
                session_id: format!("s{i}"),
                block_bytes: 256,
                prompt_bytes: 256,
                ..PickRequest::default()
            })
            .await
            .unwrap();
        let seen = std::time::Instant::now();
        while seen.elapsed() < std::time::Duration::from_millis(3) {
            tokio::task::yield_now().await;
        }
    }
    let page = |query: &str| -> serde_json::Value {
        let reply = http_get(&sidecar.admin, &format!("/debug/sessions{query}"));
        let body = reply.split_once("\r\n\r\n").map_or("", |(_, body)| body);
        serde_json::from_str(body).unwrap_or_else(|err| panic!("{err}: {reply}"))
    };
    let ids = |v: &serde_json::Value| -> Vec<String> {
        v["sessions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["session"].as_str().unwrap().to_owned())
            .collect()
    };
    let all = page("");
    assert_eq!(all["count"], 5);
    assert_eq!(ids(&all), ["s4", "s3", "s2", "s1", "s0"]);
    assert_eq!(ids(&page("?limit=2")), ["s4", "s3"]);
    assert_eq!(ids(&page("?offset=2&limit=2")), ["s2", "s1"]);
    assert_eq!(ids(&page("?offset=4&limit=10")), ["s0"]);
    assert!(ids(&page("?offset=9")).is_empty());
    // Asking for more than a page may hold is capped, not refused.
    assert_eq!(page("?limit=1000000")["sessions"].as_array().unwrap().len(), 5);
}

/// `/debug/sessions` shows each session's harness, its calls by lane and
/// its parent as resolved (a parent named by trace is the session that
/// carried the trace, an unknown one none), beside what it showed before;
/// the per-harness counters count side calls and unknown trace parents.
#[tokio::test]
async fn debug_sessions_shows_lanes_and_trace_named_parents() {
    const TURN: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
    let sidecar = start();
    let mut client = RouterClient::new(sidecar.channel().await);
    let openclaw = |session: &str, lane: &str, parent: &str, block: u64| PickRequest {
        block_hashes: vec![block, block + 1],
        session_id: session.to_owned(),
        parent_id: parent.to_owned(),
        lane: lane.to_owned(),
        trace_id: TURN.to_owned(),
        harness: "openclaw".to_owned(),
        block_bytes: 256,
        prompt_bytes: 512,
        ..PickRequest::default()
    };
    let by_trace = format!("trace:{TURN}");
    let unknown = format!("trace:{}", "1".repeat(32));
    for pick in [
        openclaw("p", "main", "", 10),
        openclaw("p", "side", "", 20),
        openclaw("p", "compaction", "", 10),
        openclaw("p", "main", "", 30),
        openclaw("c", "main", &by_trace, 40),
        openclaw("u", "main", &unknown, 50),
    ] {
        client.pick(pick).await.unwrap();
    }
    let reply = http_get(&sidecar.admin, "/debug/sessions");
    let body = reply.split_once("\r\n\r\n").map_or("", |(_, body)| body);
    let page: serde_json::Value = serde_json::from_str(body).unwrap_or_else(|err| panic!("{err}: {reply}"));
    // The side call made no session of its own.
    assert_eq!(page["count"], 3, "{page:#}");
    let session = |id: &str| -> serde_json::Value {
        page["sessions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["session"] == id)
            .cloned()
            .unwrap_or_else(|| panic!("no {id} in {page:#}"))
    };
    let p = session("p");
    assert_eq!(p["harness"], "openclaw");
    assert_eq!(p["lanes"], serde_json::json!({"main": 2, "side": 1, "compaction": 1}));
    assert!(p["parent"].is_null());
    // The fields of earlier versions are all still there.
    for field in ["session", "home", "idle_ms", "parent"] {
        assert!(p.get(field).is_some(), "{field} in {p}");
    }
    assert_eq!(session("c")["parent"], "p");
    assert!(session("u")["parent"].is_null());
    assert_eq!(session("u")["lanes"]["main"], 1);

    let series = |name: &str| format!("kvmesh_{name}_total{{harness=\"openclaw\",tenant=\"none\"}}");
    assert_eq!(sidecar.metric(&series("side_calls")), Some(1.0));
    assert_eq!(sidecar.metric(&series("compaction_calls")), Some(1.0));
    assert_eq!(sidecar.metric(&series("prefix_epochs")), Some(1.0));
    assert_eq!(sidecar.metric(&series("trace_parents")), Some(1.0));
    assert_eq!(sidecar.metric(&series("unknown_trace_parents")), Some(1.0));
    assert_eq!(sidecar.metric("kvmesh_trace_carriers"), Some(1.0));
}

/// `/debug/report` carries the retention section at the extra KV asked
/// for, and `kvmesh-sidecar report` prices it when given prices (and says
/// how to get that line when not).
#[tokio::test]
async fn the_report_has_a_retention_section_and_prices_it() {
    use kvmesh_proto::v1::Outcome;
    let sidecar = start();
    let mut client = RouterClient::new(sidecar.channel().await);
    let reply = client
        .pick(PickRequest {
            block_hashes: vec![1, 2, 3, 4],
            session_id: "s".to_owned(),
            harness: "codex".to_owned(),
            block_bytes: 1000,
            prompt_bytes: 4000,
            ..PickRequest::default()
        })
        .await
        .unwrap()
        .into_inner();
    client
        .report(Outcome {
            pick_id: reply.pick_id,
            prompt_tokens: Some(1000),
            cached_tokens: Some(600),
            ..Outcome::default()
        })
        .await
        .unwrap();
    let reply = http_get(&sidecar.admin, "/debug/report?extra_kv_gb=2.5");
    let body = reply.split_once("\r\n\r\n").map_or("", |(_, body)| body);
    let report: serde_json::Value = serde_json::from_str(body).unwrap_or_else(|err| panic!("{err}: {reply}"));
    let codex = report["retention_by_harness"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["harness"] == "codex")
        .unwrap_or_else(|| panic!("{report:#}"));
    assert_eq!(codex["extra_kv"]["gb_per_worker"], 2.5);
    assert_eq!(codex["reported_prompt_tokens"], 1000.0);
    assert_eq!(codex["reported_cached_tokens"], 600.0);
    assert_eq!(codex["hit_rate"], 0.6);

    let run = |extra: &[&str]| -> String {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvmesh-sidecar"))
            .args(["report", "--admin", &format!("http://{}", sidecar.admin)])
            .args(extra)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let text = run(&[]);
    assert!(text.contains("retention by harness"), "{text}");
    assert!(text.contains("pass --price-input"), "{text}");
    // 1000 tokens at $2/M; 400 at $2 and 600 at $0.50; saved 600 × $1.50/M.
    let text = run(&["--price-input", "2", "--price-cached-input", "0.5"]);
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with("codex") && l.contains('$'))
        .unwrap_or_else(|| panic!("{text}"));
    assert_eq!(
        line.split_whitespace().collect::<Vec<_>>(),
        ["codex", "$0.0020", "$0.0011", "$0.0009"],
        "{text}"
    );
    let json: serde_json::Value =
        serde_json::from_str(&run(&["--json", "--price-input", "2", "--price-cached-input", "0.5"])).unwrap();
    assert_eq!(json["pricing"]["output_tokens_tracked"], false);
    assert!(json["retention_by_harness"].is_array());
    // A negative or non-numeric price is refused.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvmesh-sidecar"))
        .args([
            "report",
            "--admin",
            &format!("http://{}", sidecar.admin),
            "--price-input",
            "-1",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
}
