//! Isolation through the real Envoy: tenants never share prefix matches,
//! and no prompt text reaches logs, metrics or debug pages.

use kvmesh_integration::{AgentSession, Cluster, ClusterOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_never_share_prefix_matches() -> anyhow::Result<()> {
    let cluster = Cluster::start(ClusterOptions::default().patient()).await?;
    let session = AgentSession::new("acme/shared-prompt");
    let predicted = || cluster.sidecar_metric("kvmesh_predicted_cached_blocks_total");
    // Tenant a's prompt is cached after its first call...
    let team_a = [("authorization", "Bearer sk-team-a")];
    cluster.chat(&session.call(2), &team_a).await?;
    let base = predicted().await?;
    cluster.chat(&session.call(2), &team_a).await?;
    let same_tenant = predicted().await? - base;
    assert!(same_tenant > 0.0, "the same tenant's prefix was not matched");
    // ...but the identical prompt of another key matches nothing.
    let before_b = predicted().await?;
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

/// The tenant id the filter derives from a credential (`key:` and the first
/// 8 bytes of its SHA-256, in hex), which an attacker might try to claim.
fn tenant_of(credential: &str) -> String {
    use sha2::{Digest, Sha256};
    format!("key:{}", hex::encode(&Sha256::digest(credential.as_bytes())[..8]))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_sent_tenant_header_claims_no_other_tenants_cache() -> anyhow::Result<()> {
    let cluster = Cluster::start(ClusterOptions::default().patient()).await?;
    let session = AgentSession::new("acme/victim");
    let predicted = || cluster.sidecar_metric("kvmesh_predicted_cached_blocks_total");
    // The victim works on its session with its own key (and a tenant header,
    // which by default is nobody's word).
    let victim = [
        ("authorization", "Bearer sk-victim"),
        ("x-kvmesh-tenant", "acme"),
        ("x-session-id", "victim"),
    ];
    let mut home = None;
    for turn in 0..3 {
        let reply = cluster.chat(&session.call(turn), &victim).await?;
        assert_eq!(reply.status, 200, "{}", reply.body);
        home = reply.worker;
    }
    let home = home.unwrap_or_default();
    // Mallory, with keys of her own, claims the victim's tenant both ways: by the
    // name the victim sent and by the id the filter derives from its key.
    let victim_tenant = tenant_of("Bearer sk-victim");
    for (turn, claim) in [("acme"), (victim_tenant.as_str())].into_iter().enumerate() {
        let before = predicted().await?;
        // A fresh key per probe: her own earlier probe is hers to match.
        let key = format!("Bearer sk-mallory-{turn}");
        let reply = cluster
            .chat(
                &session.call(2),
                &[
                    ("authorization", key.as_str()),
                    ("x-kvmesh-tenant", claim),
                    ("x-session-id", &format!("probe-{turn}")),
                ],
            )
            .await?;
        assert_eq!(reply.status, 200, "{}", reply.body);
        assert_eq!(
            predicted().await? - before,
            0.0,
            "claiming {claim:?} matched the victim's prefix"
        );
        assert_ne!(
            reply.worker.as_deref(),
            Some(home.as_str()),
            "claiming {claim:?} moved onto the victim's worker"
        );
        assert_eq!(
            reply.cached_tokens(),
            Some(0),
            "claiming {claim:?} hit the victim's cache"
        );
    }
    assert_eq!(
        cluster.envoy_counter("wasmcustom.kvmesh.client_tenant_removed").await?,
        5
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_header_from_a_trusted_hop_names_the_tenant() -> anyhow::Result<()> {
    let cluster = Cluster::start(
        ClusterOptions {
            plugin: serde_json::json!({"trust_tenant_header": true}),
            ..ClusterOptions::default()
        }
        .patient(),
    )
    .await?;
    let session = AgentSession::new("acme/gateway");
    let predicted = || cluster.sidecar_metric("kvmesh_predicted_cached_blocks_total");
    // The gateway named the tenant: two callers of tenant acme, with their
    // own keys, share its cache; tenant team-b does not.
    cluster
        .chat(
            &session.call(2),
            &[("x-kvmesh-tenant", "acme"), ("authorization", "Bearer sk-1")],
        )
        .await?;
    let base = predicted().await?;
    cluster
        .chat(
            &session.call(2),
            &[("x-kvmesh-tenant", "acme"), ("authorization", "Bearer sk-2")],
        )
        .await?;
    assert!(predicted().await? - base > 0.0, "a trusted tenant header was not used");
    let before_b = predicted().await?;
    cluster
        .chat(
            &session.call(2),
            &[("x-kvmesh-tenant", "team-b"), ("authorization", "Bearer sk-1")],
        )
        .await?;
    assert_eq!(
        predicted().await? - before_b,
        0.0,
        "tenant team-b matched acme's prefix"
    );
    assert_eq!(
        cluster
            .envoy_counter("wasmcustom.kvmesh.client_tenant_removed")
            .await
            .unwrap_or(0),
        0
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_prompt_text_in_logs_metrics_or_debug_pages() -> anyhow::Result<()> {
    const MARKER: &str = "KVMESH-MARKER-7f3a9c21";
    let cluster = Cluster::start(ClusterOptions::default().patient()).await?;
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
