//! `kvmesh-sidecar`: loads its settings, builds the router, serves gRPC and
//! admin HTTP, and prints the addresses it bound.
#![forbid(unsafe_code)]

mod admin;
mod auth;
mod bounds;
mod config;
mod engine_metrics;
mod metrics;
mod report;
mod service;
mod shutdown;
mod store;
mod watcher;

use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use kvmesh_core::{InsightConfig, Insights, Router, RouterConfig};
use kvmesh_proto::v1::router_server::RouterServer;
use kvmesh_vocab::limits::MAX_MESSAGE_BYTES;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::config::{Args, Settings};
use crate::metrics::Metrics;
use crate::service::{RouterService, Shared};

fn main() -> ExitCode {
    let mut args = Args::parse();
    if let Some(config::Command::Report(report)) = args.command.take() {
        return print_report(report);
    }
    let settings = match Settings::resolve(args) {
        Ok(settings) => settings,
        Err(err) => {
            eprintln!("kvmesh-sidecar: {err}");
            return ExitCode::from(2);
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_new(&settings.log).unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(err) => {
            eprintln!("kvmesh-sidecar: cannot start the runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(serve(settings)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            error!("{err:#}");
            ExitCode::FAILURE
        }
    }
}

/// `kvmesh-sidecar report`.
fn print_report(args: config::ReportArgs) -> ExitCode {
    let result = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(anyhow::Error::from)
        .and_then(|rt| rt.block_on(report::run(args)));
    match result {
        Ok(text) => {
            print!("{text}");
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("kvmesh-sidecar report: {err:#}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(settings: Settings) -> anyhow::Result<()> {
    // Before anything slow (Redis): a SIGTERM during start must not kill
    // the process without its shutdown.
    let signals = shutdown::Signals::register();
    let router = Router::new(
        RouterConfig {
            worker_capacity_blocks: settings.worker_capacity_blocks,
            index_budget_bytes: settings.index_budget_bytes,
            default_prefill_tokens_per_ms: settings.prefill_tokens_per_ms,
            session_ttl_ms: settings.session_ttl_secs.saturating_mul(1000),
            ..RouterConfig::default()
        },
        settings.workers.iter().map(ToString::to_string),
    );
    let insights = std::sync::Arc::new(std::sync::Mutex::new(Insights::new(InsightConfig {
        kv_bytes_per_token: settings.kv_bytes_per_token,
        tenant_labels: settings.tenant_labels,
        session_ttl_ms: settings.session_ttl_secs.saturating_mul(1000),
        ..InsightConfig::default()
    })));
    let shared = Shared::new(router, insights.clone(), Metrics::new(insights));
    if let Some(url) = &settings.redis {
        let ttl = std::time::Duration::from_secs(settings.session_ttl_secs);
        if let Some(store) = store::start(url, &settings.cluster, ttl, settings.snapshot_interval, shared.clone()).await
        {
            let _ = shared.store.set(store);
        }
    }

    let grpc = TcpListener::bind(settings.grpc_listen)
        .await
        .with_context(|| format!("binding gRPC on {}", settings.grpc_listen))?;
    let admin = TcpListener::bind(settings.admin_listen)
        .await
        .with_context(|| format!("binding admin HTTP on {}", settings.admin_listen))?;
    let grpc_addr = grpc.local_addr()?;
    let admin_addr = admin.local_addr()?;

    if let Some(interval) = settings.scrape_interval {
        tokio::spawn(watcher::watch_engines(
            shared.clone(),
            interval,
            settings.metrics_path.clone(),
        ));
    }
    if !settings.worker_dns.is_empty() {
        tokio::spawn(watcher::resolve_workers(
            shared.clone(),
            settings.worker_dns.clone(),
            settings.dns_interval,
        ));
    }
    tokio::spawn(watcher::expire_sessions(
        shared.clone(),
        std::time::Duration::from_secs(10),
    ));

    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    health_reporter.set_serving::<RouterServer<RouterService>>().await;
    tokio::spawn(shutdown::on_signals(
        signals,
        shared.clone(),
        health_reporter,
        settings.shutdown_grace,
    ));

    // Set on purpose, not left to tonic's default (which is the same 4 MiB
    // today): a Pick at every bound of kvmesh_vocab::limits encodes well
    // under it, so only a message no filter sends is refused undecoded, and
    // that fails its own stream, not the sidecar.
    let router_service = RouterServer::new(RouterService::new(shared.clone()))
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    let grpc_server = tonic::transport::Server::builder()
        .add_service(health_service)
        .add_service(tonic::service::interceptor::InterceptedService::new(
            router_service,
            auth::GrpcToken::new(settings.token.clone()),
        ))
        .serve_with_incoming_shutdown(
            // Picks are tiny request/response exchanges: with Nagle's algorithm
            // a reply can wait out the peer's delayed ACK (tens of ms), which
            // is longer than the filter's whole timeout.
            tonic::transport::server::TcpIncoming::from(grpc).with_nodelay(Some(true)),
            shared.shutdown.clone().cancelled_owned(),
        );
    // The admin server outlives the gRPC one: /readyz answers "shutting
    // down" while the streams end, and /metrics stays readable.
    let admin_stop = CancellationToken::new();
    let admin_server = axum::serve(admin, admin::routes(shared.clone(), settings.token.clone()))
        .with_graceful_shutdown(admin_stop.clone().cancelled_owned());
    let admin_task = tokio::spawn(async move { admin_server.await });

    info!(
        workers = settings.workers.len(),
        capacity_blocks = settings.worker_capacity_blocks,
        index_budget_mib = settings.index_budget_bytes >> 20,
        "kvmesh-sidecar serving gRPC on {grpc_addr}, admin HTTP on {admin_addr}"
    );
    // Machine-readable line for scripts and tests that bind port 0.
    println!("kvmesh-sidecar listening grpc={grpc_addr} admin={admin_addr}");

    let grpc_result = grpc_server.await;
    let began = std::time::Instant::now();
    info!("gRPC server stopped: no listener, every stream ended");
    if let Some(store) = shared.store.get() {
        match store.flush().await {
            Some(0) => info!("redis backlog flushed"),
            Some(left) => warn!(left, "redis unreachable: placements left unpublished"),
            None => warn!("redis publisher gone: backlog not flushed"),
        }
        store.write_snapshot(&shared).await;
        info!("snapshot written to redis");
    }
    admin_stop.cancel();
    let admin_result = admin_task.await;
    shutdown::log_figures(&shared);
    grpc_result.context("gRPC server")?;
    admin_result.context("admin server task")?.context("admin server")?;
    info!(
        after_grpc_ms = u64::try_from(began.elapsed().as_millis()).unwrap_or(u64::MAX),
        "kvmesh-sidecar stopped"
    );
    Ok(())
}
