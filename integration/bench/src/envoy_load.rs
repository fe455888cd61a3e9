//! Closed-loop load through the real Envoy: N clients each sending agent
//! calls back to back, to the kvmesh listener and to the same Envoy's
//! listener without the filter, alternating by level. Reports the sustained
//! request rate and latency of each, and what kvmesh adds.

use std::time::{Duration, Instant};

use kvmesh_integration::paths::Profile;
use kvmesh_integration::{Cluster, ClusterOptions};

use crate::latency::{ms, percentile};
use crate::overhead::agent_body;

#[derive(Debug, clap::Args)]
pub(crate) struct Options {
    /// Concurrent clients, one level after another.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 4, 16, 64])]
    clients: Vec<usize>,
    /// Seconds per level and listener.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Request body size in KB (a coding agent's call).
    #[arg(long, default_value_t = 40)]
    body_kb: usize,
    /// Simulated workers behind Envoy (instant engines).
    #[arg(long, default_value_t = 4)]
    workers: usize,
}

struct Level {
    rate: f64,
    p50: Duration,
    p99: Duration,
    errors: usize,
}

async fn run_level(url: &str, clients: usize, seconds: u64, body: &[u8]) -> anyhow::Result<Level> {
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..clients {
        let url = url.to_owned();
        let body = body.to_vec();
        tasks.push(tokio::spawn(async move {
            let client = reqwest::Client::builder().no_proxy().build()?;
            let (mut took, mut errors) = (Vec::new(), 0usize);
            let mut turn = 0;
            while Instant::now() < deadline {
                let sent = Instant::now();
                let response = client
                    .post(&url)
                    .header("content-type", "application/json")
                    .header("x-session-id", format!("load-{c}-{}", turn / 20))
                    .body(body.clone())
                    .send()
                    .await;
                let ok = match response {
                    Ok(r) => r.status().is_success() && r.bytes().await.is_ok(),
                    Err(_) => false,
                };
                if ok {
                    took.push(sent.elapsed());
                } else {
                    errors += 1;
                }
                turn += 1;
            }
            anyhow::Ok((took, errors))
        }));
    }
    let (mut took, mut errors) = (Vec::new(), 0);
    for task in tasks {
        let (t, e) = task.await??;
        took.extend(t);
        errors += e;
    }
    let elapsed = started.elapsed().as_secs_f64();
    took.sort();
    let at = |p: f64| percentile(&took, p);
    Ok(Level {
        rate: took.len() as f64 / elapsed,
        p50: at(0.5),
        p99: at(0.99),
        errors,
    })
}

pub(crate) async fn run(options: Options) -> anyhow::Result<()> {
    let cluster = Cluster::start(ClusterOptions {
        workers: options.workers,
        baseline_listener: true,
        profile: Profile::Release,
        ..ClusterOptions::default()
    })
    .await?;
    let with_filter = format!("{}/v1/chat/completions", cluster.envoy_url);
    let direct = format!("{}/v1/chat/completions", cluster.direct_url.clone().unwrap_or_default());
    let body = agent_body(options.body_kb * 1024);
    println!(
        "| clients | req/s without | req/s with kvmesh | ratio | p50 without | p50 with | p50 added | p99 without | p99 with | p99 added | errors |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for &clients in &options.clients {
        let without = run_level(&direct, clients, options.seconds, &body).await?;
        let with = run_level(&with_filter, clients, options.seconds, &body).await?;
        println!(
            "| {clients} | {:.0} | {:.0} | {:.2} | {:.2} ms | {:.2} ms | {:+.2} ms | {:.2} ms | {:.2} ms | {:+.2} ms | {} |",
            without.rate,
            with.rate,
            with.rate / without.rate.max(f64::MIN_POSITIVE),
            ms(without.p50),
            ms(with.p50),
            ms(with.p50) - ms(without.p50),
            ms(without.p99),
            ms(with.p99),
            ms(with.p99) - ms(without.p99),
            without.errors + with.errors,
        );
    }
    Ok(())
}
