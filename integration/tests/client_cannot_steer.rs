//! A client's own `x-kvmesh-destination` never chooses the upstream: the
//! filter removes it on every request, routed or passed through.

use kvmesh_integration::{AgentSession, Cluster, ClusterOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_destination_is_replaced_by_the_sidecars_pick() -> anyhow::Result<()> {
    let cluster = Cluster::start(ClusterOptions::default().patient()).await?;
    let session = AgentSession::new("acme/ledger");
    let first = cluster.chat(&session.call(0), &[("x-session-id", "forge-1")]).await?;
    let home = first.worker.clone().unwrap_or_default();
    let other_worker = cluster
        .worker_names()
        .into_iter()
        .find(|w| *w != home)
        .unwrap_or_default();
    let sidecar = cluster.sidecar_grpc.to_string();
    let forged = [
        other_worker.as_str(),
        "127.0.0.1:22",
        "203.0.113.7:443",
        sidecar.as_str(),
        "10.0.0.1:80,10.0.0.2:80",
    ];
    for (turn, target) in forged.iter().enumerate() {
        let reply = cluster
            .chat(
                &session.call(turn + 1),
                &[("x-session-id", "forge-1"), ("x-kvmesh-destination", target)],
            )
            .await?;
        assert_eq!(reply.status, 200, "forged {target}: {}", reply.body);
        assert_eq!(
            reply.worker.as_deref(),
            Some(home.as_str()),
            "forged {target} steered the request"
        );
        let seen = reply.saw_destination.unwrap_or_default();
        // The worker saw the sidecar's ranked list, led by the session's worker.
        assert_ne!(seen, *target);
        assert_eq!(seen.split(',').next(), Some(home.as_str()), "{seen:?}");
    }
    assert_eq!(
        cluster
            .envoy_counter("wasmcustom.kvmesh.forged_destination_removed")
            .await?,
        forged.len() as u64
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_destination_on_a_passed_through_request_is_removed_too() -> anyhow::Result<()> {
    let cluster = Cluster::start(ClusterOptions::default()).await?;
    let target = cluster.worker_names()[0].clone();
    let mut answered_by = std::collections::BTreeMap::<String, usize>::new();
    for _ in 0..6 {
        // GET and a non-JSON POST are not routed by kvmesh: Envoy balances them.
        for (method, content_type) in [
            (reqwest::Method::GET, "application/json"),
            (reqwest::Method::POST, "text/plain"),
        ] {
            let path = if method == reqwest::Method::GET {
                "/v1/models"
            } else {
                "/v1/chat/completions"
            };
            let body = if method == reqwest::Method::GET {
                Vec::new()
            } else {
                br#"{"model":"m","messages":[]}"#.to_vec()
            };
            let reply = cluster
                .send(
                    method,
                    path,
                    &[("x-kvmesh-destination", &target), ("content-type", content_type)],
                    body,
                )
                .await?;
            assert_eq!(reply.status, 200, "{}", reply.body);
            assert_eq!(reply.saw_destination, None, "the forged header reached the worker");
            *answered_by.entry(reply.worker.unwrap_or_default()).or_default() += 1;
        }
    }
    // Round robin, not the forged target, chose: all three workers answered.
    assert_eq!(answered_by.len(), 3, "{answered_by:?}");
    Ok(())
}
