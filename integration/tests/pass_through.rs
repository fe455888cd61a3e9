//! Requests kvmesh cannot or should not route on content reach a worker byte
//! for byte unchanged, and get that worker's own answer.

use kvmesh_integration::{Cluster, ClusterOptions};
use reqwest::Method;
use sha2::{Digest, Sha256};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_empty_get_and_non_json_requests_pass_through_untouched() -> anyhow::Result<()> {
    let cluster = Cluster::start(ClusterOptions::default()).await?;
    let cases: Vec<(&str, Method, &str, &str, Vec<u8>, u16)> = vec![
        // (case, method, path, content type, body, the worker's own status)
        ("malformed JSON", Method::POST, "/v1/chat/completions", "application/json", br#"{"model": "m", "messages": [{"role": "us"#.to_vec(), 400),
        ("invalid UTF-8", Method::POST, "/v1/chat/completions", "application/json", b"{\"model\": \"\xff\xfe\"}".to_vec(), 400),
        ("valid JSON of the wrong shape", Method::POST, "/v1/chat/completions", "application/json", br#"{"model": 5, "messages": "no"}"#.to_vec(), 400),
        ("empty body", Method::POST, "/v1/chat/completions", "application/json", Vec::new(), 400),
        ("GET", Method::GET, "/v1/models", "application/json", Vec::new(), 200),
        ("non-JSON content type", Method::POST, "/v1/chat/completions", "text/plain",
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#.to_vec(), 200),
        ("unknown path", Method::POST, "/v1/embeddings", "application/json", br#"{"input":"hi"}"#.to_vec(), 404),
    ];
    for (case, method, path, content_type, body, worker_status) in cases {
        let digest = hex::encode(Sha256::digest(&body));
        let reply = cluster.send(method, path, &[("content-type", content_type)], body).await?;
        assert!(reply.worker.is_some(), "{case}: no worker answered (status {}: {})", reply.status, reply.body);
        assert_eq!(reply.status, worker_status, "{case}: {}", reply.body);
        assert_eq!(reply.worker_body_sha256.as_deref(), Some(digest.as_str()), "{case}: body changed");
        assert_eq!(reply.saw_destination, None, "{case}: routed although not understood");
    }
    // The three bodies that looked like chat calls were counted, not routed.
    assert_eq!(cluster.envoy_counter("wasmcustom.kvmesh.fail_open.not_understood").await?, 3);
    assert_eq!(cluster.envoy_counter("wasmcustom.kvmesh.picks").await?, 0);
    Ok(())
}
