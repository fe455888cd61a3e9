//! The sidecar under a flood of unique prefixes from concurrent gRPC
//! clients: sustained Pick rate, latency, and whether the prefix index
//! stays within its byte budget (index bytes and the process's RSS).

use std::time::{Duration, Instant};

use kvmesh_integration::cluster::start_sidecar;
use kvmesh_integration::paths::Profile;
use kvmesh_integration::process::memory_kib;
use kvmesh_proto::v1::PickRequest;
use kvmesh_proto::v1::router_client::RouterClient;

use crate::latency::{percentile, us};

#[derive(Debug, clap::Args)]
pub(crate) struct Options {
    /// The sidecar's --index-budget-mb.
    #[arg(long, default_value_t = 64)]
    budget_mb: usize,
    /// Concurrent gRPC clients (each its own connection).
    #[arg(long, default_value_t = 8)]
    clients: usize,
    /// Blocks per Pick, every one new.
    #[arg(long, default_value_t = 400)]
    blocks: usize,
    /// How long to flood.
    #[arg(long, default_value_t = 30)]
    seconds: u64,
    /// Simulated workers the sidecar routes over.
    #[arg(long, default_value_t = 16)]
    workers: usize,
}

pub(crate) async fn run(options: Options) -> anyhow::Result<()> {
    let dir = std::env::temp_dir().join(format!("kvmesh-bench-flood-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let workers: Vec<std::net::SocketAddr> = (1..=options.workers)
        .map(|i| format!("10.0.{}.{}:8000", i / 250, i % 250 + 1).parse())
        .collect::<Result<_, _>>()?;
    let extra = ["--index-budget-mb".to_owned(), options.budget_mb.to_string()];
    let (mut sidecar, grpc, admin) = start_sidecar(&dir, Profile::Release, "127.0.0.1:0".parse()?, &workers, &extra)?;
    let pid = sidecar.pid();
    let deadline = Instant::now() + Duration::from_secs(options.seconds);
    let mut tasks = Vec::new();
    for client_index in 0..options.clients as u64 {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{grpc}"))?
            .tcp_nodelay(true)
            .connect()
            .await?;
        let blocks = options.blocks as u64;
        tasks.push(tokio::spawn(async move {
            let mut client = RouterClient::new(channel);
            let mut took = Vec::new();
            // Disjoint hash ranges per client and per Pick: every block is new.
            let mut next = client_index << 48;
            while Instant::now() < deadline {
                let request = PickRequest {
                    block_hashes: (next..next + blocks)
                        .map(|h| h.wrapping_mul(0x9e37_79b9_7f4a_7c15))
                        .collect(),
                    session_id: format!("flood-{client_index}-{next}"),
                    block_bytes: 256,
                    prompt_bytes: blocks * 256,
                    ..PickRequest::default()
                };
                next += blocks;
                let started = Instant::now();
                client.pick(request).await?;
                took.push(started.elapsed());
            }
            anyhow::Ok(took)
        }));
    }
    let flood_started = Instant::now();
    let mut peak_rss_kib = 0;
    while Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        peak_rss_kib = peak_rss_kib.max(memory_kib(pid).map_or(0, |(rss, _)| rss));
    }
    let mut took = Vec::new();
    for task in tasks {
        took.extend(task.await??);
    }
    let elapsed = flood_started.elapsed().as_secs_f64();
    let metrics = reqwest::get(format!("http://{admin}/metrics")).await?.text().await?;
    let gauge = |name: &str| {
        metrics
            .lines()
            .find(|l| l.starts_with(name) && !l.starts_with('#'))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
    };
    took.sort();
    let at = |p: f64| us(percentile(&took, p));
    println!(
        "| budget | clients | blocks/Pick | Picks/s | p50 | p99 | blocks offered | index entries | index bytes | peak RSS |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    println!(
        "| {} MiB | {} | {} | {:.0} | {:.0} µs | {:.0} µs | {} | {:.0} | {:.1} MiB | {:.1} MiB |",
        options.budget_mb,
        options.clients,
        options.blocks,
        took.len() as f64 / elapsed,
        at(0.5),
        at(0.99),
        took.len() * options.blocks,
        gauge("kvmesh_index_entries").unwrap_or(f64::NAN),
        gauge("kvmesh_index_bytes").unwrap_or(f64::NAN) / f64::from(1 << 20),
        peak_rss_kib as f64 / 1024.0,
    );
    sidecar.stop();
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
