//! The sidecar's Pick round trip over gRPC from a plain client, without
//! Envoy: what the sidecar itself contributes to the filter's added latency.

use std::time::{Duration, Instant};

use kvmesh_integration::cluster::start_sidecar;
use kvmesh_integration::paths::Profile;
use kvmesh_proto::v1::PickRequest;
use kvmesh_proto::v1::router_client::RouterClient;

use crate::latency::{percentile, us};

#[derive(Debug, clap::Args)]
pub(crate) struct Options {
    /// Blocks per Pick (a 10 KB body is about 40, 400 KB about 1,600).
    #[arg(long, value_delimiter = ',', default_values_t = [40usize, 400, 1600])]
    blocks: Vec<usize>,
    /// Picks per size.
    #[arg(long, default_value_t = 2000)]
    requests: usize,
}

pub(crate) async fn run(options: Options) -> anyhow::Result<()> {
    let dir = std::env::temp_dir().join(format!("kvmesh-bench-rtt-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let workers: Vec<std::net::SocketAddr> = (1..=3)
        .map(|i| format!("10.0.0.{i}:8000").parse())
        .collect::<Result<_, _>>()?;
    let (mut sidecar, grpc, _) = start_sidecar(&dir, Profile::Release, "127.0.0.1:0".parse()?, &workers, &[])?;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{grpc}"))?
        .tcp_nodelay(true)
        .connect()
        .await?;
    let mut client = RouterClient::new(channel);
    println!("| blocks per Pick | picks | median | p99 |");
    println!("|---|---|---|---|");
    for &blocks in &options.blocks {
        let request = PickRequest {
            block_hashes: (0..blocks as u64).collect(),
            session_id: "rtt".to_owned(),
            block_bytes: 256,
            ..PickRequest::default()
        };
        let mut took: Vec<Duration> = Vec::with_capacity(options.requests);
        for i in 0..options.requests + 100 {
            let started = Instant::now();
            client.pick(request.clone()).await?;
            if i >= 100 {
                took.push(started.elapsed());
            }
        }
        took.sort();
        let at = |p: f64| us(percentile(&took, p));
        println!(
            "| {blocks} | {} | {:.0} µs | {:.0} µs |",
            options.requests,
            at(0.5),
            at(0.99)
        );
    }
    sidecar.stop();
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
