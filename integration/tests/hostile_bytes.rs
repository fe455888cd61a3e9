//! Bytes that are not UTF-8, wherever a client or an engine can put them,
//! through the real Envoy: in a request header over HTTP/1 and HTTP/2, in a
//! request trailer, in a response header from the engine. None of them
//! panics the filter's VM (Envoy never logs `Function: proxy_on_... failed`),
//! each request is answered as the same request without them would be, and
//! a forged destination sent afterwards on fresh connections (so on every
//! Envoy worker thread) still never steers.

use std::time::Duration;

use kvmesh_integration::paths::repo_root;
use kvmesh_integration::{AgentSession, Cluster, ClusterOptions, Reply};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The header cases of the corpus: (case, header name, value bytes).
fn header_corpus() -> anyhow::Result<Vec<(String, String, Vec<u8>)>> {
    let text = std::fs::read_to_string(repo_root().join("integration/hostile/header_values.jsonl"))?;
    text.lines()
        .map(|line| {
            let case: serde_json::Value = serde_json::from_str(line)?;
            let field = |key: &str| case[key].as_str().unwrap_or_default().to_owned();
            Ok((field("case"), field("header"), hex::decode(field("hex"))?))
        })
        .collect()
}

fn chat_body(session: &AgentSession, turn: usize) -> anyhow::Result<Vec<u8>> {
    Ok(serde_json::to_vec(&session.call(turn))?)
}

/// A routed request: answered by a worker that the sidecar named.
fn assert_routed(reply: &Reply, case: &str) {
    assert_eq!(reply.status, 200, "{case}: {}", reply.body);
    let destination = reply.saw_destination.clone().unwrap_or_default();
    assert!(
        reply
            .worker
            .as_deref()
            .is_some_and(|w| destination.split(',').next() == Some(w)),
        "{case}: not routed by the sidecar (worker {:?}, destination {destination:?})",
        reply.worker
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_that_are_not_utf8_never_panic_the_filter_and_never_reopen_steering() -> anyhow::Result<()> {
    let cluster = Cluster::start(ClusterOptions::default().patient()).await?;
    let session = AgentSession::new("acme/hostile-bytes");
    let json: (&str, &[u8]) = ("content-type", b"application/json");

    // The finding: a forged destination that is not UTF-8, on a path the
    // filter does not route, twice (once per Envoy worker thread).
    for _ in 0..2 {
        let reply = cluster
            .send_bytes(
                reqwest::Method::GET,
                "/v1/models",
                &[("x-kvmesh-destination", b"\xff")],
                Vec::new(),
                false,
            )
            .await?;
        assert_eq!(reply.status, 200, "{}", reply.body);
        assert_eq!(reply.saw_destination, None);
    }

    // Routed API calls with each hostile header value of the corpus
    // (`integration/hostile/header_values.jsonl`), both protocols.
    let mut turn = 0;
    for http2 in [false, true] {
        for (case, name, value) in header_corpus()? {
            let case = format!("{case} over {}", if http2 { "HTTP/2" } else { "HTTP/1" });
            let mut headers = vec![
                (name.as_str(), value.as_slice()),
                ("x-session-affinity", b"hostile-bytes"),
            ];
            if name != "content-type" {
                headers.push(json);
            }
            let reply = cluster
                .send_bytes(
                    reqwest::Method::POST,
                    "/v1/chat/completions",
                    &headers,
                    chat_body(&session, turn)?,
                    http2,
                )
                .await?;
            turn += 1;
            cluster.assert_no_vm_failure();
            if name == "content-type" {
                // Not a JSON content type: passed through, unrouted.
                assert_eq!(reply.status, 200, "{case}: {}", reply.body);
                continue;
            }
            assert_routed(&reply, &case);
        }
    }

    // An engine answering with a content type that is not UTF-8: the
    // filter reads it to find `usage`, and the 200 stays a 200.
    for http2 in [false, true] {
        let reply = cluster
            .send_bytes(
                reqwest::Method::POST,
                "/v1/chat/completions",
                &[
                    json,
                    ("x-session-affinity", b"hostile-bytes"),
                    ("x-kvmesh-sim-content-type", b"\xff\xfe"),
                ],
                chat_body(&session, turn)?,
                http2,
            )
            .await?;
        assert_routed(&reply, "a response content type that is not UTF-8");
        cluster.assert_no_vm_failure();
        turn += 1;
    }

    // A request trailer that is not UTF-8 (HTTP/2): inference APIs carry no
    // trailers, so the filter lets such a request pass unrouted, unharmed.
    let status = post_with_trailer(&cluster, &chat_body(&session, turn)?, b"\xff\xfe").await?;
    assert_eq!(status, 200);
    cluster.assert_no_vm_failure();

    // A header *name* with such a byte never reaches the Wasm filter:
    // Envoy's codec refuses the request itself.
    let status = raw_http1_status(&cluster, b"x-caf\xe9: 1\r\n").await?;
    assert_eq!(status, 400, "Envoy accepted a header name that is not a token");

    // Afterwards the filter still runs on every thread: a forged destination
    // at another worker, on fresh connections, never moves the session.
    let home = cluster
        .chat(&session.call(turn), &[("x-session-affinity", "hostile-bytes")])
        .await?
        .worker
        .unwrap_or_default();
    let other = cluster
        .worker_names()
        .into_iter()
        .find(|w| *w != home)
        .unwrap_or_default();
    for i in 0..8 {
        let reply = cluster
            .send_bytes(
                reqwest::Method::POST,
                "/v1/chat/completions",
                &[
                    json,
                    ("x-session-affinity", b"hostile-bytes"),
                    ("x-kvmesh-destination", other.as_bytes()),
                ],
                chat_body(&session, turn + 1 + i)?,
                i % 2 == 1,
            )
            .await?;
        assert_routed(&reply, "a forged destination after the hostile bytes");
        assert_eq!(
            reply.worker.as_deref(),
            Some(home.as_str()),
            "a forged destination steered"
        );
    }
    cluster.assert_no_vm_failure();
    assert!(
        cluster
            .envoy_counter("wasmcustom.kvmesh.forged_destination_removed")
            .await?
            >= 8
    );
    Ok(())
}

/// POSTs `body` over HTTP/2 with a trailer `x-trailer: <value>`; the status.
async fn post_with_trailer(cluster: &Cluster, body: &[u8], value: &[u8]) -> anyhow::Result<u16> {
    let authority = cluster.envoy_url.trim_start_matches("http://").to_owned();
    let tcp = tokio::net::TcpStream::connect(&authority).await?;
    let (client, connection) = h2::client::handshake(tcp).await?;
    let driver = tokio::spawn(connection);
    let mut client = client.ready().await?;
    let request = http::Request::post(format!("http://{authority}/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("x-session-affinity", "hostile-bytes")
        .body(())?;
    let (response, mut stream) = client.send_request(request, false)?;
    stream.send_data(body.to_vec().into(), false)?;
    let mut trailers = http::HeaderMap::new();
    trailers.insert("x-trailer", http::HeaderValue::from_bytes(value)?);
    stream.send_trailers(trailers)?;
    let response = tokio::time::timeout(Duration::from_secs(10), response).await??;
    let status = response.status().as_u16();
    let mut body = response.into_body();
    while let Some(chunk) = body.data().await {
        let chunk = chunk?;
        let _ = body.flow_control().release_capacity(chunk.len());
    }
    driver.abort();
    Ok(status)
}

/// Sends a raw HTTP/1.1 GET with `extra` header lines; the status Envoy answers.
async fn raw_http1_status(cluster: &Cluster, extra: &[u8]) -> anyhow::Result<u16> {
    let authority = cluster.envoy_url.trim_start_matches("http://").to_owned();
    let mut tcp = tokio::net::TcpStream::connect(&authority).await?;
    let mut request = format!("GET /v1/models HTTP/1.1\r\nhost: {authority}\r\nconnection: close\r\n").into_bytes();
    request.extend_from_slice(extra);
    request.extend_from_slice(b"\r\n");
    tcp.write_all(&request).await?;
    let mut head = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), tcp.read_to_end(&mut head)).await??;
    let line = String::from_utf8_lossy(&head);
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no status in {line:?}"))?;
    Ok(status)
}

/// A model name of 5 MB (over the 4 MiB gRPC limit that tore down the
/// shared Pick stream when such a name reached the sidecar) fails open that
/// request alone: it is never asked about, and the calls around it, sharing
/// the filter's stream, are routed as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_5_mb_model_name_fails_open_alone_and_the_stream_stays_up() -> anyhow::Result<()> {
    let cluster = Cluster::start(ClusterOptions::default().patient()).await?;
    let session = AgentSession::new("acme/huge-model");
    let headers = [("x-session-id", "huge-model")];
    let before = cluster.chat(&session.call(0), &headers).await?;
    assert_routed(&before, "before");
    let mut huge = session.call(1);
    huge["model"] = serde_json::json!("m".repeat(5 * 1024 * 1024));
    let beside = session.call(1);
    let (huge_reply, during) = tokio::join!(
        cluster.chat(&huge, &[("x-session-id", "huge-model-2")]),
        cluster.chat(&beside, &headers)
    );
    let huge_reply = huge_reply?;
    assert_eq!(huge_reply.status, 200, "{}", huge_reply.body);
    assert_eq!(huge_reply.saw_destination, None, "a 5 MB model name was routed on");
    assert_routed(&during?, "beside it");
    let after = cluster.chat(&session.call(2), &headers).await?;
    assert_routed(&after, "after");
    assert_eq!(after.worker, before.worker, "the session moved");
    assert_eq!(cluster.envoy_counter("wasmcustom.kvmesh.fail_open.oversized").await?, 1);
    assert_eq!(
        cluster
            .envoy_counter("wasmcustom.kvmesh.fail_open.sidecar_error")
            .await?,
        0
    );
    assert_eq!(cluster.envoy_counter("wasmcustom.kvmesh.sidecar.unary_calls").await?, 0);
    cluster.assert_no_vm_failure();
    Ok(())
}
