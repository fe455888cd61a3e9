//! Priority to the engine, through the real Envoy, the real sidecar and a
//! `kvmesh-sim` that returns each body as it arrived (`/admin/last-body`):
//!
//! - with `priority_field` on, every API's body reaches the engine with the
//!   configured engine's `priority` right after its opening brace (or in
//!   place of the client's own), and every other byte as the client sent it,
//!   whether the body came in one piece or in many (HTTP/1 and HTTP/2);
//! - hostile priorities (huge, negative, not a number, a float, an object,
//!   the client's own `priority` member) are clamped or dropped, never
//!   forwarded raw;
//! - with it off, bodies are untouched, a client `priority` included;
//! - the retention horizon a request declares reaches the sidecar's core.

use std::time::Duration;

use kvmesh_integration::{Cluster, ClusterOptions, Reply};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// One body per API, each with some whitespace (kept byte for byte).
fn api_bodies() -> Vec<(&'static str, Vec<u8>)> {
    vec![
        (
            "/v1/chat/completions",
            br#"{"model":"qwen3", "messages":[{"role":"system","content":"You are a coding agent.\n"},{"role":"user","content":"read \"src/lib.rs\""}],"max_tokens":4}"#.to_vec(),
        ),
        (
            "/v1/completions",
            b"{\n  \"model\": \"qwen3\",\n  \"prompt\": \"fn main() {\",\n  \"max_tokens\": 4\n}".to_vec(),
        ),
        (
            "/v1/responses",
            br#"{"model":"qwen3","instructions":"Be brief.","input":[{"role":"user","content":"hi"}],"max_output_tokens":4}"#.to_vec(),
        ),
        (
            "/v1/messages",
            br#"{"model":"claude","system":[{"type":"text","text":"You are Claude Code.","cache_control":{"type":"ephemeral"}}],"messages":[{"role":"user","content":"hi"}],"max_tokens":4}"#.to_vec(),
        ),
    ]
}

async fn last_body(cluster: &Cluster) -> anyhow::Result<Vec<u8>> {
    let url = format!("http://{}/admin/last-body", cluster.workers[0].addr);
    Ok(reqwest::Client::builder()
        .no_proxy()
        .build()?
        .get(url)
        .send()
        .await?
        .bytes()
        .await?
        .to_vec())
}

async fn post(cluster: &Cluster, path: &str, headers: &[(&str, &str)], body: &[u8]) -> anyhow::Result<Reply> {
    let mut all = vec![("content-type", "application/json")];
    all.extend_from_slice(headers);
    cluster.send(reqwest::Method::POST, path, &all, body.to_vec()).await
}

/// POSTs `body` over HTTP/1.1 in writes of `chunk` bytes with pauses, so
/// Envoy hands it to the filter in many callbacks; returns the status.
/// After the first piece and before the last one it waits until Envoy has
/// read everything sent so far, so the body reaches the filter in at least
/// three callbacks however late Envoy runs.
async fn post_in_chunks(
    cluster: &Cluster,
    path: &str,
    priority: &str,
    body: &[u8],
    chunk: usize,
) -> anyhow::Result<u16> {
    let authority = cluster.envoy_url.trim_start_matches("http://").to_owned();
    let read_before = cluster.envoy_bytes_read().await?;
    let mut tcp = tokio::net::TcpStream::connect(&authority).await?;
    tcp.set_nodelay(true)?;
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: {authority}\r\ncontent-type: application/json\r\n\
         x-kvmesh-priority: {priority}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    tcp.write_all(head.as_bytes()).await?;
    let pieces: Vec<&[u8]> = body.chunks(chunk).collect();
    anyhow::ensure!(pieces.len() >= 3, "{path}: a body of {} pieces", pieces.len());
    let mut sent = head.len();
    for (n, piece) in pieces.iter().enumerate() {
        if n == 1 || n + 1 == pieces.len() {
            cluster
                .wait_for_envoy_to_read(read_before + sent as u64, Duration::from_secs(60))
                .await?;
        }
        tcp.write_all(piece).await?;
        sent += piece.len();
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let mut reply = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), tcp.read_to_end(&mut reply)).await??;
    let text = String::from_utf8_lossy(&reply);
    text.split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no status in {text:?}"))
}

/// `received` is `sent` with `"priority":<value>,` inserted right after its
/// first `{`: nothing else may differ.
fn assert_inserted(sent: &[u8], received: &[u8], value: &str, case: &str) {
    let open = sent.iter().position(|&b| b == b'{').map_or(0, |at| at + 1);
    let field = format!("\"priority\":{value},");
    let mut expected = sent[..open].to_vec();
    expected.extend_from_slice(field.as_bytes());
    expected.extend_from_slice(&sent[open..]);
    assert_eq!(
        String::from_utf8_lossy(received),
        String::from_utf8_lossy(&expected),
        "{case}: the engine got another body"
    );
}

async fn priority_counter(cluster: &Cluster, name: &str) -> anyhow::Result<u64> {
    cluster
        .envoy_counter(&format!("wasmcustom.kvmesh.priority.{name}"))
        .await
}

fn priority_cluster(engine: &str) -> ClusterOptions {
    ClusterOptions {
        workers: 1,
        plugin: json!({"priority_field": {"engine": engine}}),
        ..ClusterOptions::default()
    }
    .patient()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_engine_receives_its_field_and_polarity_and_every_other_byte_as_sent() -> anyhow::Result<()> {
    // kvmesh priority 200 (higher is sooner) in each engine's terms.
    for (engine, value) in [("vllm", "-200"), ("sglang", "200"), ("trtllm", "0.6")] {
        let cluster = Cluster::start(priority_cluster(engine)).await?;
        let mut written = 0;
        for (path, body) in api_bodies() {
            let reply = post(&cluster, path, &[("x-kvmesh-priority", "200")], &body).await?;
            assert_eq!(reply.status, 200, "{engine} {path}: {}", reply.body);
            let received = last_body(&cluster).await?;
            assert_eq!(
                reply.worker_body_bytes,
                Some(received.len()),
                "{engine} {path}: content-length"
            );
            assert_inserted(&body, &received, value, &format!("{engine} {path}"));
            written += 1;
            // The same body in 7-byte pieces: the buffered path edits the
            // same way.
            let chunks = cluster.envoy_counter("wasmcustom.kvmesh.body_chunks").await?;
            let status = post_in_chunks(&cluster, path, "200", &body, 7).await?;
            assert_eq!(status, 200, "{engine} {path} in pieces");
            let pieces = cluster.envoy_counter("wasmcustom.kvmesh.body_chunks").await? - chunks;
            assert!(pieces >= 3, "{engine} {path}: the body came in {pieces} callbacks");
            assert_inserted(
                &body,
                &last_body(&cluster).await?,
                value,
                &format!("{engine} {path} in pieces"),
            );
            written += 1;
        }
        // Over HTTP/2 too (the body's length then travels in frames).
        let (path, body) = &api_bodies()[0];
        let reply = cluster
            .send_bytes(
                reqwest::Method::POST,
                path,
                &[("content-type", b"application/json"), ("x-kvmesh-priority", b"200")],
                body.clone(),
                true,
            )
            .await?;
        assert_eq!(reply.status, 200, "{engine} over HTTP/2: {}", reply.body);
        assert_inserted(
            body,
            &last_body(&cluster).await?,
            value,
            &format!("{engine} over HTTP/2"),
        );
        written += 1;
        assert_eq!(
            cluster.envoy_counter("wasmcustom.kvmesh.priority.written").await?,
            written
        );
        assert_eq!(
            cluster.envoy_counter("wasmcustom.kvmesh.priority.not_written").await?,
            0
        );
        cluster.assert_no_vm_failure();
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_priorities_are_clamped_or_dropped_never_forwarded_raw() -> anyhow::Result<()> {
    let cluster = Cluster::start(priority_cluster("vllm")).await?;
    let chat = |extra: &str| format!(r#"{{"model":"qwen3",{extra}"messages":[{{"role":"user","content":"hi"}}]}}"#);
    // (case, priority header, body, the vLLM value the engine must see)
    let cases: Vec<(&str, Option<&str>, String, &str)> = vec![
        ("huge header", Some("99999999999999999999"), chat(""), "0"),
        ("over i32", Some("2147483648"), chat(""), "0"),
        ("over the scale", Some("5000"), chat(""), "-1000"),
        ("negative huge", Some("-2147483648"), chat(""), "1000"),
        ("not a number", Some("abc"), chat(""), "0"),
        ("a float", Some("1.5"), chat(""), "0"),
        (
            "hint float",
            None,
            chat(r#""nvext":{"agent_hints":{"priority":1.5}},"#),
            "0",
        ),
        (
            "hint object",
            None,
            chat(r#""nvext":{"agent_hints":{"priority":{"a":1}}},"#),
            "0",
        ),
        (
            "hint huge",
            None,
            chat(r#""nvext":{"agent_hints":{"priority":-1e300}},"#),
            "0",
        ),
        (
            "hint in range",
            None,
            chat(r#""nvext":{"agent_hints":{"priority":-3}},"#),
            "3",
        ),
    ];
    for (case, header, body, value) in &cases {
        let headers: Vec<(&str, &str)> = header.iter().map(|h| ("x-kvmesh-priority", *h)).collect();
        let reply = post(&cluster, "/v1/chat/completions", &headers, body.as_bytes()).await?;
        assert_eq!(reply.status, 200, "{case}: {}", reply.body);
        assert_inserted(body.as_bytes(), &last_body(&cluster).await?, value, case);
    }
    // The client's own `priority` member, in any shape or spelling, is
    // replaced in place: only its value differs from what was sent.
    let raw_cases = [
        (r#""priority":-99999,"#, "-99999"),
        (
            r#""priority":{"nested":[1,{"deep":-5}]},"#,
            r#"{"nested":[1,{"deep":-5}]}"#,
        ),
        (r#""priority":"abc","#, r#""abc""#),
        (r#""\u0070riority":-7,"#, "-7"),
    ];
    for (member, raw) in raw_cases {
        let body = chat(member);
        let reply = post(
            &cluster,
            "/v1/chat/completions",
            &[("x-kvmesh-priority", "40")],
            body.as_bytes(),
        )
        .await?;
        assert_eq!(reply.status, 200, "{member}: {}", reply.body);
        let received = String::from_utf8(last_body(&cluster).await?)?;
        let expected = body.replacen(&format!(":{raw},"), ":-40,", 1);
        assert_eq!(received, expected, "{member}");
        let parsed: Value = serde_json::from_str(&received)?;
        assert_eq!(parsed["priority"], json!(-40), "{member}");
    }
    // "huge header", "over i32", "not a number", "a float", and the three bad hints.
    assert_eq!(priority_counter(&cluster, "dropped").await?, 7);
    assert_eq!(priority_counter(&cluster, "clamped").await?, 2);
    assert_eq!(priority_counter(&cluster, "replaced").await?, raw_cases.len() as u64);
    assert_eq!(
        priority_counter(&cluster, "written").await?,
        (cases.len() + raw_cases.len()) as u64
    );
    cluster.assert_no_vm_failure();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_rewriting_off_bodies_reach_the_engine_untouched() -> anyhow::Result<()> {
    let cluster = Cluster::start(
        ClusterOptions {
            workers: 1,
            ..ClusterOptions::default()
        }
        .patient(),
    )
    .await?;
    let mut bodies = api_bodies();
    bodies.push((
        "/v1/chat/completions",
        br#"{"model":"qwen3","priority":-99999,"messages":[{"role":"user","content":"hi"}]}"#.to_vec(),
    ));
    for (path, body) in &bodies {
        let reply = post(&cluster, path, &[("x-kvmesh-priority", "500")], body).await?;
        assert_eq!(reply.status, 200, "{path}: {}", reply.body);
        assert_eq!(last_body(&cluster).await?, *body, "{path}: the body changed");
    }
    assert_eq!(cluster.envoy_counter("wasmcustom.kvmesh.priority.written").await?, 0);
    assert!(cluster.envoy_counter("wasmcustom.kvmesh.picks").await? >= bodies.len() as u64);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_declared_retention_horizon_reaches_the_sidecar() -> anyhow::Result<()> {
    let mut options = ClusterOptions {
        workers: 1,
        ..ClusterOptions::default()
    }
    .patient();
    options
        .sidecar_args
        .extend(["--log".to_owned(), "info,kvmesh_sidecar=debug".to_owned()]);
    let cluster = Cluster::start(options).await?;
    let messages = |system_marker: &str, session: &str| {
        format!(
            r#"{{"model":"claude","metadata":{{"user_id":"user_x_account_y_session_{session}"}},"system":[{{"type":"text","text":"You are Claude Code.","cache_control":{system_marker}}}],"messages":[{{"role":"user","content":[{{"type":"text","text":"hi","cache_control":{{"type":"ephemeral"}}}}]}}],"max_tokens":4}}"#
        )
    };
    let cases = [
        (
            "one-hour",
            messages(r#"{"type":"ephemeral","ttl":"1h"}"#, "one-hour"),
            "Some(3600000)",
        ),
        (
            "default",
            messages(r#"{"type":"ephemeral"}"#, "default"),
            "Some(300000)",
        ),
        (
            "over-a-day",
            messages(r#"{"type":"ephemeral","ttl":"72h"}"#, "over-a-day"),
            "Some(86400000)",
        ),
    ];
    for (session, body, _) in &cases {
        let reply = post(&cluster, "/v1/messages", &[], body.as_bytes()).await?;
        assert_eq!(reply.status, 200, "{session}: {}", reply.body);
    }
    let chat = br#"{"model":"qwen3","messages":[{"role":"user","content":"hi"}],"user":"no-marker"}"#;
    assert_eq!(post(&cluster, "/v1/chat/completions", &[], chat).await?.status, 200);
    let log = cluster.sidecar.plain_log();
    let horizon_of = |session: &str| {
        log.lines()
            .filter(|line| line.contains(" pick") && line.contains(&format!("session={session} ")))
            .find_map(|line| {
                line.split_whitespace()
                    .find_map(|field| field.strip_prefix("retention_horizon_ms="))
                    .map(str::to_owned)
            })
    };
    for (session, _, expected) in &cases {
        assert_eq!(horizon_of(session).as_deref(), Some(*expected), "{session}:\n{log}");
    }
    assert_eq!(horizon_of("no-marker").as_deref(), Some("None"));
    Ok(())
}
