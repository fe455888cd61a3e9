//! The simulated worker's fault commands, as the reliability tests use them:
//! error makes it answer every inference call with a status, slow stretches
//! its timing, and both clear.

use kvmesh_integration::{AgentSession, Cluster, ClusterOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_turn_on_and_off() -> anyhow::Result<()> {
    let cluster = Cluster::start(ClusterOptions {
        workers: 1,
        ..ClusterOptions::default()
    })
    .await?;
    let worker = cluster.workers[0].addr;
    let http = reqwest::Client::builder().no_proxy().build()?;
    let fault = |body: &'static str| {
        http.post(format!("http://{worker}/admin/fault"))
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    let body = AgentSession::new("acme/faulty").call(0);
    let call = || cluster.chat(&body, &[]);

    assert!(fault(r#"{"error": 503}"#).await?.status().is_success());
    let failed = call().await?;
    assert_eq!(failed.status, 503, "{}", failed.body);
    assert!(failed.body.contains("injected fault"));

    let set = fault(r#"{"slow": 4}"#).await?.json::<serde_json::Value>().await?;
    assert_eq!(set["slow"], 4.0);
    assert_eq!(call().await?.status, 200);

    assert!(fault("{}").await?.status().is_success());
    assert_eq!(call().await?.status, 200);
    assert_eq!(fault(r#"{"explode": true}"#).await?.status(), 400);
    Ok(())
}
