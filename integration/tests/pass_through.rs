//! Requests kvmesh cannot or should not route on content reach a worker byte
//! for byte unchanged, and get that worker's own answer.

use kvmesh_integration::{Cluster, ClusterOptions};
use reqwest::Method;
use sha2::{Digest, Sha256};

/// One request, and the status the worker itself answers it with.
struct Case {
    name: &'static str,
    method: Method,
    path: &'static str,
    content_type: &'static str,
    body: &'static [u8],
    worker_status: u16,
}

impl Case {
    fn post(name: &'static str, content_type: &'static str, body: &'static [u8], worker_status: u16) -> Self {
        Self {
            name,
            method: Method::POST,
            path: "/v1/chat/completions",
            content_type,
            body,
            worker_status,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_empty_get_and_non_json_requests_pass_through_untouched() -> anyhow::Result<()> {
    let cluster = Cluster::start(ClusterOptions::default()).await?;
    let json = "application/json";
    let cases = [
        Case::post(
            "malformed JSON",
            json,
            br#"{"model": "m", "messages": [{"role": "us"#,
            400,
        ),
        Case::post("invalid UTF-8", json, b"{\"model\": \"\xff\xfe\"}", 400),
        Case::post(
            "valid JSON of the wrong shape",
            json,
            br#"{"model": 5, "messages": "no"}"#,
            400,
        ),
        Case::post("empty body", json, b"", 400),
        Case {
            method: Method::GET,
            path: "/v1/models",
            ..Case::post("GET", json, b"", 200)
        },
        Case::post(
            "non-JSON content type",
            "text/plain",
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
            200,
        ),
        Case {
            path: "/v1/embeddings",
            ..Case::post("unknown path", json, br#"{"input":"hi"}"#, 404)
        },
    ];
    for Case {
        name: case,
        method,
        path,
        content_type,
        body,
        worker_status,
    } in cases
    {
        let digest = hex::encode(Sha256::digest(body));
        let reply = cluster
            .send(method, path, &[("content-type", content_type)], body.to_vec())
            .await?;
        assert!(
            reply.worker.is_some(),
            "{case}: no worker answered (status {}: {})",
            reply.status,
            reply.body
        );
        assert_eq!(reply.status, worker_status, "{case}: {}", reply.body);
        assert_eq!(
            reply.worker_body_sha256.as_deref(),
            Some(digest.as_str()),
            "{case}: body changed"
        );
        assert_eq!(reply.saw_destination, None, "{case}: routed although not understood");
    }
    // The three bodies that looked like chat calls were counted, not routed.
    assert_eq!(
        cluster
            .envoy_counter("wasmcustom.kvmesh.fail_open.not_understood")
            .await?,
        3
    );
    assert_eq!(cluster.envoy_counter("wasmcustom.kvmesh.picks").await?, 0);
    Ok(())
}
