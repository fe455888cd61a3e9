//! Isolation through the real Envoy: tenants never share prefix matches,
//! and no prompt text reaches logs, metrics or debug pages.

use kvmesh_integration::{AgentSession, Cluster, ClusterOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_never_share_prefix_matches() -> anyhow::Result<()> {
    let cluster = Cluster::start(ClusterOptions::default()).await?;
    let session = AgentSession::new("acme/shared-prompt");
    let predicted = || cluster.sidecar_metric("kvmesh_predicted_cached_blocks_total");
    // Tenant a's prompt is cached after its first call...
    cluster.chat(&session.call(2), &[("x-kvmesh-tenant", "team-a")]).await?;
    let base = predicted().await?;
    cluster.chat(&session.call(2), &[("x-kvmesh-tenant", "team-a")]).await?;
    let same_tenant = predicted().await? - base;
    assert!(same_tenant > 0.0, "the same tenant's prefix was not matched");
    // ...but the identical prompt of tenant b matches nothing, and neither
    // does a different API key without a tenant header.
    let before_b = predicted().await?;
    cluster.chat(&session.call(2), &[("x-kvmesh-tenant", "team-b")]).await?;
    cluster
        .chat(&session.call(2), &[("authorization", "Bearer sk-other-tenant")])
        .await?;
    assert_eq!(
        predicted().await? - before_b,
        0.0,
        "a tenant matched another tenant's prefix"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_prompt_text_in_logs_metrics_or_debug_pages() -> anyhow::Result<()> {
    const MARKER: &str = "KVMESH-MARKER-7f3a9c21";
    let cluster = Cluster::start(ClusterOptions::default()).await?;
    let mut body = AgentSession::new("acme/secret").call(1);
    body["messages"][1]["content"] = serde_json::json!(format!("please handle {MARKER} carefully"));
    for _ in 0..3 {
        let reply = cluster.chat(&body, &[("x-session-id", "secret-session")]).await?;
        assert_eq!(reply.status, 200);
    }
    let http = reqwest::Client::builder().no_proxy().build()?;
    let mut pages = Vec::new();
    for url in [
        format!("http://{}/metrics", cluster.sidecar_admin),
        format!("http://{}/debug/workers", cluster.sidecar_admin),
        format!("http://{}/debug/sessions", cluster.sidecar_admin),
        format!("{}/stats", cluster.envoy_admin),
    ] {
        pages.push((url.clone(), http.get(url).send().await?.text().await?));
    }
    for name in ["sidecar.log", "envoy.log"] {
        let path = cluster.dir.join(name);
        pages.push((
            path.display().to_string(),
            std::fs::read_to_string(path).unwrap_or_default(),
        ));
    }
    // The debug page does show the session id (ids are not prompt text).
    assert!(pages.iter().any(|(_, text)| text.contains("secret-session")));
    for (source, text) in &pages {
        assert!(!text.contains(MARKER), "prompt text leaked into {source}");
    }
    Ok(())
}
