//! Bodies that arrive in many pieces, through the real Envoy: a client that
//! writes a request 1 byte at a time, or 64 KB at a time, is hashed as the
//! same body sent at once. The sidecar is the judge: after a one-shot call,
//! the chunked call of the same session must match every full block the
//! one-shot call indexed (and the other way round), which it cannot if a
//! single block hash differs. A Pick sent straight to the sidecar with the
//! hashes `understand` computes natively from the same body then matches
//! them all too: through Envoy, the filter hashed what the golden fixtures
//! pin. The filter's `hashed_ahead_bytes` counter shows the blocks were
//! hashed before the last chunk came.

use std::time::Duration;

use kvmesh_integration::{Cluster, ClusterOptions};
use kvmesh_proto::v1::PickRequest;
use kvmesh_proto::v1::router_client::RouterClient;
use kvmesh_request::{Api, FilterConfig, understand};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// An agent's chat of about `bytes`, fields in the harnesses' order
/// (`model` first), or sorted as a client serialising a map would send
/// them (`model` after the messages).
fn agent_body(bytes: usize, model_first: bool) -> Vec<u8> {
    let mut messages = vec![json!({"role": "system", "content": "You are a coding agent.\n".repeat(80)})];
    let mut turn = 0;
    while serde_json::to_vec(&messages).map_or(0, |m| m.len()) < bytes {
        messages.push(json!({"role": "user", "content": format!("read src/f{turn}.rs")}));
        messages.push(json!({"role": "tool", "tool_call_id": format!("c{turn}"),
            "content": format!("// f{turn}\n{}", "pub fn f(x: u32) -> u32 { x * 2 }\n".repeat(40))}));
        turn += 1;
    }
    let messages = serde_json::to_string(&messages).unwrap_or_default();
    if model_first {
        format!(r#"{{"model":"qwen3-coder","stream":false,"messages":{messages},"max_tokens":4}}"#)
    } else {
        format!(r#"{{"max_tokens":4,"messages":{messages},"model":"qwen3-coder","stream":false}}"#)
    }
    .into_bytes()
}

/// The Pick the filter asks for `body`, computed natively, and its full
/// blocks.
fn native_pick(body: &[u8], session: &str) -> anyhow::Result<(PickRequest, usize)> {
    let headers = vec![("x-session-id".to_owned(), session.to_owned())];
    let u = understand(Api::ChatCompletions, &headers, body, false, &FilterConfig::default())?;
    let full = u.hashes.hashes.len() - usize::from(u.hashes.last_partial);
    let pick = PickRequest {
        block_bytes: 256,
        prompt_bytes: u.hashes.stream_bytes,
        last_block_partial: u.hashes.last_partial,
        block_hashes: u.hashes.hashes,
        session_id: u.identity.session_id,
        tenant: u.identity.tenant,
        model: u.model,
        ..PickRequest::default()
    };
    Ok((pick, full))
}

/// POSTs `body` over HTTP/1.1 on a fresh connection in writes of `chunk`
/// bytes, each on its own TCP segment, pausing now and then so that Envoy
/// reads it in many pieces. The last write waits until Envoy has read every
/// byte before it, so the filter has had all but the last piece before the
/// last piece comes, however late Envoy runs. Returns the status and the
/// worker that answered.
async fn post_in_chunks(cluster: &Cluster, body: &[u8], chunk: usize, session: &str) -> anyhow::Result<(u16, String)> {
    let authority = cluster.envoy_url.trim_start_matches("http://").to_owned();
    let read_before = cluster.envoy_bytes_read().await?;
    let mut tcp = tokio::net::TcpStream::connect(&authority).await?;
    tcp.set_nodelay(true)?;
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {authority}\r\ncontent-type: application/json\r\n\
         x-session-id: {session}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    tcp.write_all(head.as_bytes()).await?;
    let pieces: Vec<&[u8]> = body.chunks(chunk).collect();
    let (last, before_last) = pieces.split_last().ok_or_else(|| anyhow::anyhow!("an empty body"))?;
    for (n, piece) in before_last.iter().enumerate() {
        tcp.write_all(piece).await?;
        if chunk > 1 || n % 512 == 511 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    let sent = (head.len() + body.len() - last.len()) as u64;
    cluster
        .wait_for_envoy_to_read(read_before + sent, Duration::from_secs(60))
        .await?;
    tcp.write_all(last).await?;
    let mut reply = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), tcp.read_to_end(&mut reply)).await??;
    let text = String::from_utf8_lossy(&reply);
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no status in {text:?}"))?;
    let worker = text
        .lines()
        .find_map(|line| {
            line.to_ascii_lowercase()
                .strip_prefix("x-kvmesh-sim-worker:")
                .map(|w| w.trim().to_owned())
        })
        .unwrap_or_default();
    Ok((status, worker))
}

async fn post_at_once(cluster: &Cluster, body: &[u8], session: &str) -> anyhow::Result<(u16, String)> {
    let reply = cluster
        .send(
            reqwest::Method::POST,
            "/v1/chat/completions",
            &[("content-type", "application/json"), ("x-session-id", session)],
            body.to_vec(),
        )
        .await?;
    Ok((reply.status, reply.worker.unwrap_or_default()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_in_one_byte_and_64_kb_writes_hash_as_one_chunk() -> anyhow::Result<()> {
    // Engines with room for the largest body's prompt (600 KB is about
    // 240,000 tokens under the simulated engine's tokenizer, past its
    // default 200,000): the second call must find every block of the first.
    let mut options = ClusterOptions::default().patient();
    options
        .sim_args
        .extend(["--capacity-tokens".to_owned(), "1000000".to_owned()]);
    let cluster = Cluster::start(options).await?;
    let predicted = || cluster.sidecar_metric("kvmesh_predicted_cached_blocks_total");
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", cluster.sidecar_grpc))?
        .connect()
        .await?;
    let mut sidecar = RouterClient::new(channel);
    let cases = [
        // (model first, body size, write size, the chunked call first)
        (true, 12_000, 1, false),
        (false, 12_000, 1, true),
        (true, 600_000, 64 * 1024, false),
        (false, 600_000, 64 * 1024, true),
        (true, 300_000, 64 * 1024, true),
    ];
    for (n, &(model_first, size, chunk, chunked_first)) in cases.iter().enumerate() {
        let body = &agent_body(size, model_first);
        let session = format!("chunked-{n}");
        let (pick, blocks) = native_pick(body, &session)?;
        assert!(blocks > 30, "case {n}: only {blocks} blocks");
        let ahead = cluster.envoy_counter("wasmcustom.kvmesh.hashed_ahead_bytes").await?;
        let (first, second) = if chunked_first {
            let first = post_in_chunks(&cluster, body, chunk, &session).await?;
            let before = predicted().await?;
            let second = post_at_once(&cluster, body, &session).await?;
            assert_eq!(
                predicted().await? - before,
                blocks as f64,
                "case {n}: one-shot after chunked"
            );
            (first, second)
        } else {
            let first = post_at_once(&cluster, body, &session).await?;
            let before = predicted().await?;
            let second = post_in_chunks(&cluster, body, chunk, &session).await?;
            assert_eq!(
                predicted().await? - before,
                blocks as f64,
                "case {n}: chunked after one-shot"
            );
            (first, second)
        };
        assert_eq!((first.0, second.0), (200, 200), "case {n}");
        assert_eq!(first.1, second.1, "case {n}: the second call left the session's worker");
        let native = sidecar.pick(pick).await?.into_inner();
        assert_eq!(
            native.predicted_cached_blocks as usize, blocks,
            "case {n}: the natively hashed body does not match the blocks the filter sent"
        );
        // With the model ahead of the messages, the chunked call's blocks
        // were hashed as its chunks came. (A model sent after them is
        // assumed to be the last one the Envoy thread saw, which depends on
        // the thread a connection lands on.)
        let hashed_ahead = cluster.envoy_counter("wasmcustom.kvmesh.hashed_ahead_bytes").await? - ahead;
        if model_first {
            assert!(
                hashed_ahead as usize >= blocks * 256 / 2,
                "case {n}: only {hashed_ahead} bytes hashed ahead of the last chunk ({blocks} blocks)"
            );
        }
    }
    cluster.assert_no_vm_failure();
    Ok(())
}
