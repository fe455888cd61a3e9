//! Bytes that are not UTF-8, wherever a client or an engine can put them,
//! through the real Envoy: in a request header over HTTP/1 and HTTP/2, in a
//! request trailer, in a response header from the engine. None of them
//! panics the filter's VM (Envoy never logs `Function: proxy_on_... failed`),
//! each request is answered as the same request without them would be, and
//! a forged destination sent afterwards on fresh connections (so on every
//! Envoy worker thread) still never steers.

use std::time::Duration;

use kvmesh_integration::{AgentSession, Cluster, ClusterOptions, Reply};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn chat_body(session: &AgentSession, turn: usize) -> anyhow::Result<Vec<u8>> {
    Ok(serde_json::to_vec(&session.call(turn))?)
}

/// What every hostile case must leave behind: no VM lost, nothing panicked.
fn assert_no_vm_failure(cluster: &Cluster) {
    let log = cluster.envoy.log();
    for needle in ["Function: proxy_on_", "panicked", "wasm trap"] {
        assert!(
            !log.contains(needle),
            "Envoy logged {needle:?}:\n{}",
            cluster.envoy.log_tail()
        );
    }
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
    let cluster = Cluster::start(ClusterOptions::default()).await?;
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

    // Routed API calls with hostile header values, both protocols.
    let mut turn = 0;
    for http2 in [false, true] {
        for (name, value) in [
            ("x-session-id", &b"\xff\xfe\xc3("[..]),
            ("x-anything", b"caf\xe9"),
            ("x-kvmesh-destination", b"\xff"),
            ("authorization", b"Bearer \xff\xfe"),
            ("user-agent", b"claude-cli/\xff"),
            ("x-kvmesh-priority", b"\xff"),
        ] {
            let case = format!("{name} over {}", if http2 { "HTTP/2" } else { "HTTP/1" });
            let reply = cluster
                .send_bytes(
                    reqwest::Method::POST,
                    "/v1/chat/completions",
                    &[json, (name, value), ("x-session-affinity", b"hostile-bytes")],
                    chat_body(&session, turn)?,
                    http2,
                )
                .await?;
            assert_routed(&reply, &case);
            assert_no_vm_failure(&cluster);
            turn += 1;
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
        assert_no_vm_failure(&cluster);
        turn += 1;
    }

    // A request trailer that is not UTF-8 (HTTP/2): inference APIs carry no
    // trailers, so the filter lets such a request pass unrouted, unharmed.
    let status = post_with_trailer(&cluster, &chat_body(&session, turn)?, b"\xff\xfe").await?;
    assert_eq!(status, 200);
    assert_no_vm_failure(&cluster);

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
    assert_no_vm_failure(&cluster);
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
