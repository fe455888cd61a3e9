//! The optional shared secret between the filter and the sidecar: with the
//! right token requests are routed; without it the sidecar refuses the
//! filter, which fails open; the admin pages want it too, the probes do not.

use kvmesh_integration::{AgentSession, Cluster, ClusterOptions};

fn options(filter_token: Option<&str>) -> ClusterOptions {
    let mut options = ClusterOptions::default();
    options
        .sidecar_args
        .extend(["--token".to_owned(), "s3cret-t0ken".to_owned()]);
    if let Some(token) = filter_token {
        options.plugin = serde_json::json!({ "sidecar_token": token });
    }
    options.patient()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_right_token_routes_and_guards_the_admin_pages() -> anyhow::Result<()> {
    let cluster = Cluster::start(options(Some("s3cret-t0ken"))).await?;
    let reply = cluster.chat(&AgentSession::new("acme/tokened").call(0), &[]).await?;
    assert_eq!(reply.status, 200);
    assert!(reply.saw_destination.is_some(), "not routed with the right token");
    let http = reqwest::Client::builder().no_proxy().build()?;
    let admin = cluster.sidecar_admin;
    let status = |path: &'static str, token: Option<&'static str>| {
        let mut request = http.get(format!("http://{admin}{path}"));
        if let Some(token) = token {
            request = request.header("authorization", format!("Bearer {token}"));
        }
        async move { request.send().await.map(|r| r.status().as_u16()) }
    };
    assert_eq!(status("/metrics", None).await?, 401);
    assert_eq!(status("/debug/sessions", Some("wrong")).await?, 401);
    assert_eq!(status("/metrics", Some("s3cret-t0ken")).await?, 200);
    assert_eq!(status("/healthz", None).await?, 200);
    assert_eq!(status("/readyz", None).await?, 200);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_filter_without_the_token_fails_open() -> anyhow::Result<()> {
    let cluster = Cluster::start(options(None)).await?;
    for turn in 0..4 {
        let reply = cluster
            .chat(&AgentSession::new("acme/no-token").call(turn), &[])
            .await?;
        assert_eq!(reply.status, 200, "a refused Pick must not fail the request");
        assert!(reply.saw_destination.is_none());
    }
    assert_eq!(cluster.envoy_counter("wasmcustom.kvmesh.picks").await?, 0);
    // Each failed open because the sidecar refused it, not on the timeout.
    assert_eq!(cluster.fail_opens().await?, (4, 0), "(sidecar errors, timeouts)");
    Ok(())
}
