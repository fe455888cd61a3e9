//! Hostile input through the real Envoy (corpus in `integration/hostile/`):
//! for every case Envoy stays up, the filter keeps working (no Wasm VM lost),
//! Envoy's memory stays bounded, and the request either reaches a worker
//! unchanged or gets a clear 4xx; a client-sent destination never routes.

use kvmesh_integration::paths::repo_root;
use kvmesh_integration::{AgentSession, Cluster, ClusterOptions, Reply};
use reqwest::Method;
use serde_json::Value;
use sha2::{Digest, Sha256};

struct Case {
    name: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

fn case(name: &str, body: Vec<u8>) -> Case {
    Case {
        name: name.to_owned(),
        headers: vec![("content-type".to_owned(), "application/json".to_owned())],
        body,
    }
}

fn corpus() -> anyhow::Result<Vec<Case>> {
    let dir = repo_root().join("integration/hostile");
    let mut cases = Vec::new();
    for file in [
        "malformed.json",
        "truncated.json",
        "invalid_utf8.bin",
        "deep_nesting.json",
    ] {
        cases.push(case(file, std::fs::read(dir.join(file))?));
    }
    for (i, line) in std::fs::read_to_string(dir.join("wrong_types.jsonl"))?
        .lines()
        .enumerate()
    {
        cases.push(case(&format!("wrong_types #{i}"), line.as_bytes().to_vec()));
    }
    // Too large to commit, built the same way every time.
    let tiny = vec![r#"{"role":"user","content":""}"#; 1_000_000].join(",");
    cases.push(case(
        "1,000,000 tiny messages",
        format!(r#"{{"model":"m","messages":[{tiny}]}}"#).into_bytes(),
    ));
    let big = "x".repeat(9 * 1024 * 1024);
    cases.push(case(
        "body over the 8 MiB parse cap",
        format!(r#"{{"model":"m","messages":[{{"role":"user","content":"{big}"}}]}}"#).into_bytes(),
    ));
    let normal = serde_json::to_vec(&AgentSession::new("acme/hostile").call(1))?;
    let mut huge_header = case("a 50 KB header value", normal.clone());
    huge_header
        .headers
        .push(("x-session-id".to_owned(), "h".repeat(50 * 1024)));
    cases.push(huge_header);
    let session = "s".repeat(1024 * 1024);
    cases.push(case(
        "a 1 MB session id in the body",
        format!(r#"{{"model":"m","prompt_cache_key":"{session}","messages":[{{"role":"user","content":"hi"}}]}}"#)
            .into_bytes(),
    ));
    Ok(cases)
}

async fn stats(cluster: &Cluster) -> anyhow::Result<String> {
    Ok(reqwest::Client::new()
        .get(format!("{}/stats?filter=wasm", cluster.envoy_admin))
        .send()
        .await?
        .text()
        .await?)
}

async fn allocated_bytes(cluster: &Cluster) -> anyhow::Result<u64> {
    let memory: Value = reqwest::Client::new()
        .get(format!("{}/memory", cluster.envoy_admin))
        .send()
        .await?
        .json()
        .await?;
    Ok(memory["allocated"].as_str().and_then(|s| s.parse().ok()).unwrap_or(0))
}

fn check(case: &str, sent: &[u8], reply: &Reply, workers: &[String]) {
    match &reply.worker {
        // A worker answered: it got the body byte for byte.
        Some(worker) => {
            assert!(workers.contains(worker), "{case}: answered by {worker}?");
            let digest = hex::encode(Sha256::digest(sent));
            assert_eq!(
                reply.worker_body_sha256.as_deref(),
                Some(digest.as_str()),
                "{case}: body changed: {} bytes sent, {:?} received, status {}",
                sent.len(),
                reply.worker_body_bytes,
                reply.status
            );
        }
        // Envoy itself refused it: a clear 4xx (413 too large, 431 headers).
        None => assert!(
            (400..500).contains(&reply.status),
            "{case}: {} {}",
            reply.status,
            reply.body
        ),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_requests_never_break_envoy_or_route_by_the_client() -> anyhow::Result<()> {
    let cluster = Cluster::start(ClusterOptions::default().patient()).await?;
    let workers = cluster.worker_names();
    let before = stats(&cluster).await?;
    let mut statuses = Vec::new();
    for c in corpus()? {
        let headers: Vec<(&str, &str)> = c.headers.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let reply = cluster
            .send(Method::POST, "/v1/chat/completions", &headers, c.body.clone())
            .await?;
        check(&c.name, &c.body, &reply, &workers);
        statuses.push(format!("{}: {}", c.name, reply.status));
        // Envoy is still up after each case.
        let ready = reqwest::get(format!("{}/ready", cluster.envoy_admin)).await?;
        assert!(ready.status().is_success(), "Envoy not ready after {}", c.name);
    }
    eprintln!("{}", statuses.join("\n"));

    // Forged destinations never route: not at another worker, not at the
    // sidecar, not at ssh, not outside the cluster.
    let session = AgentSession::new("acme/forger");
    let first = cluster.chat(&session.call(0), &[("x-session-id", "forger")]).await?;
    let home = first.worker.clone().unwrap_or_default();
    let sidecar = cluster.sidecar_grpc.to_string();
    let other = workers.iter().find(|w| **w != home).cloned().unwrap_or_default();
    for (turn, target) in [other.as_str(), sidecar.as_str(), "127.0.0.1:22", "198.51.100.9:8000"]
        .iter()
        .enumerate()
    {
        let reply = cluster
            .chat(
                &session.call(turn + 1),
                &[("x-session-id", "forger"), ("x-kvmesh-destination", target)],
            )
            .await?;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.worker.as_deref(), Some(home.as_str()), "forged {target}");
    }

    // The filter still works on every Envoy thread: normal calls are routed.
    for s in 0..8 {
        let reply = cluster
            .chat(&AgentSession::new(&format!("acme/after-{s}")).call(0), &[])
            .await?;
        assert!(
            reply.saw_destination.is_some(),
            "a normal call after the corpus was not routed"
        );
    }
    // No Wasm VM was lost or reloaded.
    let after = stats(&cluster).await?;
    for line in after
        .lines()
        .filter(|l| l.contains("vm_reload") || l.contains("runtime.v8.active"))
    {
        let name = line.split(':').next().unwrap_or_default();
        let old = before.lines().find(|l| l.starts_with(name)).unwrap_or_default();
        assert_eq!(line, old, "Wasm VM stats changed:\n{before}\n---\n{after}");
    }
    // Memory bounded: what Envoy holds after the corpus (tens of MB went by).
    let allocated = allocated_bytes(&cluster).await?;
    eprintln!("envoy allocated after the corpus: {} MB", allocated / 1_000_000);
    assert!(allocated < 256 * 1024 * 1024, "Envoy holds {allocated} bytes");
    Ok(())
}
