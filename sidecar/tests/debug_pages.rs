//! The admin server's debug pages over a real sidecar: `/debug/sessions`
//! pages its sessions, newest first, and caps a page whatever is asked;
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
            status: 200,
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
