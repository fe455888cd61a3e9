//! The sidecar's Pick round trip over gRPC from plain clients, without
//! Envoy: what the sidecar itself contributes to the filter's added latency.
//! With `--clients`, that many clients (each its own connection) send at
//! once, as a busy Envoy's worker threads do; with several `--sidecar-bin`,
//! the builds take turns run after run, so they share the machine's noise.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use kvmesh_integration::cluster::start_sidecar_binary;
use kvmesh_integration::paths::{self, Profile};
use kvmesh_proto::v1::PickRequest;
use kvmesh_proto::v1::router_client::RouterClient;

use crate::latency::{percentile, us};

#[derive(Debug, clap::Args)]
pub(crate) struct Options {
    /// Blocks per Pick (a 10 KB body is about 40, 400 KB about 1,600).
    #[arg(long, value_delimiter = ',', default_values_t = [40usize, 400, 1600])]
    blocks: Vec<usize>,
    /// Picks per size and client.
    #[arg(long, default_value_t = 2000)]
    requests: usize,
    /// Clients sending at once, each on its own connection, one Pick at a time.
    #[arg(long, default_value_t = 1)]
    clients: usize,
    /// Sidecar builds to compare (default: this tree's release build);
    /// repeat the flag for each.
    #[arg(long)]
    sidecar_bin: Vec<PathBuf>,
    /// Runs of every build, alternating.
    #[arg(long, default_value_t = 1)]
    runs: usize,
}

pub(crate) async fn run(options: Options) -> anyhow::Result<()> {
    let binaries = if options.sidecar_bin.is_empty() {
        vec![paths::binary("kvmesh-sidecar", Profile::Release)?]
    } else {
        options.sidecar_bin.clone()
    };
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("load average at start: {}", load.trim());
    println!("| sidecar | run | clients | blocks per Pick | picks | median | p99 |");
    println!("|---|---|---|---|---|---|---|");
    for run in 1..=options.runs {
        for binary in &binaries {
            measure(&options, binary, run).await?;
        }
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("load average at end: {}", load.trim());
    Ok(())
}

async fn measure(options: &Options, binary: &std::path::Path, run: usize) -> anyhow::Result<()> {
    let dir = std::env::temp_dir().join(format!("kvmesh-bench-rtt-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let workers: Vec<std::net::SocketAddr> = (1..=3)
        .map(|i| format!("10.0.0.{i}:8000").parse())
        .collect::<Result<_, _>>()?;
    let (mut sidecar, grpc, _) = start_sidecar_binary(binary, &dir, "127.0.0.1:0".parse()?, &workers, &[])?;
    let mut clients = Vec::new();
    for _ in 0..options.clients.max(1) {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{grpc}"))?
            .tcp_nodelay(true)
            .connect()
            .await?;
        clients.push(RouterClient::new(channel));
    }
    for &blocks in &options.blocks {
        let tasks: Vec<_> = clients
            .iter()
            .enumerate()
            .map(|(c, client)| {
                let mut client = client.clone();
                let requests = options.requests;
                let request = PickRequest {
                    block_hashes: (0..blocks as u64).collect(),
                    session_id: format!("rtt-{c}"),
                    block_bytes: 256,
                    ..PickRequest::default()
                };
                tokio::spawn(async move {
                    let mut took: Vec<Duration> = Vec::with_capacity(requests);
                    for i in 0..requests + 100 {
                        let started = Instant::now();
                        client.pick(request.clone()).await?;
                        if i >= 100 {
                            took.push(started.elapsed());
                        }
                    }
                    anyhow::Ok(took)
                })
            })
            .collect();
        let mut took = Vec::new();
        for task in tasks {
            took.extend(task.await??);
        }
        took.sort();
        let at = |p: f64| us(percentile(&took, p));
        println!(
            "| {} | {run} | {} | {blocks} | {} | {:.0} µs | {:.0} µs |",
            binary.display(),
            clients.len(),
            took.len(),
            at(0.5),
            at(0.99)
        );
    }
    sidecar.stop();
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
