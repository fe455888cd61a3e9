//! `kvmesh-bench`: kvmesh's benchmarks, one subcommand each.
//!
//! `filter-overhead` measures what the kvmesh filter adds to a request in the
//! real Envoy: one Envoy serves two identical listeners, one with the filter
//! (and so a sidecar round trip) and one without, in front of the same
//! instant simulated worker; requests alternate between them, so both see the
//! same machine noise, and the difference of their latency is the filter's.
#![forbid(unsafe_code)]

mod compare;
mod envoy_load;
mod flood;
mod gen_agents;
mod latency;
mod overhead;
mod pick_rtt;
mod replay;
mod scale;
mod simulate;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "kvmesh-bench", version, about = "kvmesh benchmarks")]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Added latency of the kvmesh filter in the real Envoy, by body size.
    FilterOverhead(overhead::Options),
    /// The sidecar's Pick round trip over gRPC, without Envoy.
    PickRtt(pick_rtt::Options),
    /// Sustained request rate through Envoy, with and without kvmesh.
    EnvoyLoad(envoy_load::Options),
    /// Unique prefixes from concurrent clients: Pick rate and the index budget.
    Flood(flood::Options),
    /// A busy cluster's load on a release sidecar: N live sessions, 2,000
    /// Picks/s with their Reports, scrapes and debug-page fetches.
    Scale(scale::Options),
    /// Every routing policy on one workload, on a virtual clock.
    Simulate(simulate::Options),
    /// Write a seeded workload of coding-agent sessions (text trace format).
    GenAgents(gen_agents::Options),
    /// Send a workload as real HTTP calls, through Envoy with kvmesh (or
    /// without it), to simulated or real vLLM workers.
    Replay(replay::Options),
    /// kvmesh, round robin and the real peer routers as arms in front of
    /// one deployment of real vLLM workers, each cold, rotated over rounds.
    Compare(compare::Options),
    /// Start the local deployment (Envoy with and without kvmesh, sidecar,
    /// workers), print its URLs as one JSON line, and wait for SIGINT/SIGTERM.
    Serve(replay::ServeOptions),
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    match Args::parse().command {
        Command::FilterOverhead(options) => overhead::run(options).await,
        Command::PickRtt(options) => pick_rtt::run(options).await,
        Command::Flood(options) => flood::run(options).await,
        Command::Scale(options) => scale::run(options).await,
        Command::EnvoyLoad(options) => envoy_load::run(options).await,
        Command::Simulate(options) => simulate::run(options),
        Command::GenAgents(options) => gen_agents::run(options),
        Command::Replay(options) => replay::run(options).await,
        Command::Serve(options) => replay::serve(options).await,
        Command::Compare(options) => compare::run(options).await,
    }
}
