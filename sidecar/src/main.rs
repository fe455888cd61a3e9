//! `kvmesh-sidecar`: loads its settings, builds the router, serves gRPC and
//! admin HTTP, and prints the addresses it bound.
#![forbid(unsafe_code)]

mod admin;
mod auth;
mod config;
mod engine_metrics;
mod metrics;
mod report;
mod service;
mod store;
mod watcher;

use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use kvmesh_core::{InsightConfig, Insights, Router, RouterConfig};
use kvmesh_proto::v1::router_server::RouterServer;
use tokio::net::TcpListener;
use tracing::{error, info};

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

    let grpc_server = tonic::transport::Server::builder()
        .add_service(health_service)
        .add_service(tonic::service::interceptor::InterceptedService::new(
            RouterServer::new(RouterService::new(shared.clone())),
            auth::GrpcToken::new(settings.token.clone()),
        ))
        .serve_with_incoming_shutdown(
            // Picks are tiny request/response exchanges: with Nagle's algorithm
            // a reply can wait out the peer's delayed ACK (tens of ms), which
            // is longer than the filter's whole timeout.
            tonic::transport::server::TcpIncoming::from(grpc).with_nodelay(Some(true)),
            shutdown_signal(),
        );
    let shared_for_shutdown = shared.clone();
    let admin_server =
        axum::serve(admin, admin::routes(shared, settings.token.clone())).with_graceful_shutdown(shutdown_signal());

    info!(
        workers = settings.workers.len(),
        capacity_blocks = settings.worker_capacity_blocks,
        index_budget_mib = settings.index_budget_bytes >> 20,
        "kvmesh-sidecar serving gRPC on {grpc_addr}, admin HTTP on {admin_addr}"
    );
    // Machine-readable line for scripts and tests that bind port 0.
    println!("kvmesh-sidecar listening grpc={grpc_addr} admin={admin_addr}");

    let (grpc_result, admin_result) = tokio::join!(grpc_server, async { admin_server.await });
    if let Some(store) = shared_for_shutdown.store.get() {
        store.write_snapshot(&shared_for_shutdown).await;
        info!("snapshot written to redis");
    }
    grpc_result.context("gRPC server")?;
    admin_result.context("admin server")?;
    info!("kvmesh-sidecar stopped");
    Ok(())
}

/// Resolves on SIGINT or SIGTERM, so both servers drain and stop.
async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(term) => term,
            Err(_) => return interrupt.await.unwrap_or(()),
        };
        tokio::select! {
            _ = interrupt => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = interrupt.await;
}
