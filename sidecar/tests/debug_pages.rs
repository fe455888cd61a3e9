//! The admin server's debug pages over a real sidecar: `/debug/sessions`
//! pages its sessions, newest first, and caps a page whatever is asked.
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
