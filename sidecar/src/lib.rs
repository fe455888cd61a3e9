//! `kvmesh-sidecar` as a library: everything the sidecar does except parse
//! its command line, set up logging and the runtime, and exit (that is
//! `main.rs`). One sidecar per GPU cluster answers the filter's Pick and
//! Report from the routing core (`kvmesh-core`).
//!
//! Modules, in three layers; a module imports only from layers below it,
//! and an edge never imports another edge (`tests/module_graph.rs` checks
//! both, and that the graph has no cycle):
//!
//! - pure, no I/O and no tokio, public so fuzz targets and tools can reuse
//!   them: [`engine_metrics`] (an engine's Prometheus text into load and
//!   capacity), [`kv_events`] (an engine's KV cache events decoded, and its
//!   resident blocks followed from them), [`snapshot`] (the router snapshot's byte codec), [`bounds`]
//!   (the wire bounds a Pick or Outcome must keep), [`wire`] (proto messages
//!   into core types and back). They build without the `server` feature.
//! - shared, below every edge: `state` (`Shared`, the router's one owner
//!   and the only module that locks it, its lock order, `pick` and
//!   `report`), `metrics` (Prometheus), `clock` (`now_ms`), `lock`
//!   (poison-tolerant locking), `config` (flags, environment, file),
//!   `auth` (the shared token), `report` (rendering the agent report),
//!   `retention_report` (its retention section: return gaps, hit rate, what
//!   more KV would save, managed-API prices).
//! - edges, each at one kind of I/O: `service` (gRPC), `admin` (admin HTTP
//!   and the `report` command's client of it), `store` (Redis), `watcher`
//!   (engine scrapes, DNS, session expiry), `kv_subscriber` (engines' KV
//!   events over ZeroMQ), `shutdown` (signals).
//!
//! This file is the composition root: `serve` builds the state and starts
//! every edge; it is the only place that knows them all.
#![forbid(unsafe_code)]

pub mod bounds;
pub mod engine_metrics;
pub mod kv_events;
pub mod snapshot;
pub mod wire;

#[cfg(feature = "server")]
mod admin;
#[cfg(feature = "server")]
mod auth;
#[cfg(feature = "server")]
mod clock;
#[cfg(feature = "server")]
mod config;
#[cfg(feature = "server")]
mod kv_subscriber;
#[cfg(feature = "server")]
mod lock;
#[cfg(feature = "server")]
mod metrics;
#[cfg(feature = "server")]
mod report;
#[cfg(feature = "server")]
mod retention_report;
#[cfg(feature = "server")]
mod service;
#[cfg(feature = "server")]
mod shutdown;
#[cfg(feature = "server")]
mod state;
#[cfg(feature = "server")]
mod store;
#[cfg(feature = "server")]
mod watcher;

#[cfg(feature = "server")]
pub use crate::config::{Args, Command, ConfigErrors, ReportArgs, Settings};

/// `kvmesh-sidecar report`: fetches a running sidecar's agent report and
/// renders it (tables, or JSON with `--json`).
#[cfg(feature = "server")]
pub async fn report(args: ReportArgs) -> anyhow::Result<String> {
    admin::fetch_report(args).await
}

/// Serves until shutdown: binds the gRPC and admin ports, starts every edge's
/// tasks, prints `kvmesh-sidecar listening grpc=… admin=…` on stdout once
/// both are bound, and returns once the gRPC server has stopped and the
/// Redis backlog and snapshot are written. Needs a Tokio runtime with I/O
/// and time enabled.
#[cfg(feature = "server")]
pub async fn serve(settings: Settings) -> anyhow::Result<()> {
    use anyhow::Context;
    use kvmesh_core::{InsightConfig, Insights, Router, RouterConfig};
    use kvmesh_proto::v1::router_server::RouterServer;
    use kvmesh_vocab::limits::MAX_MESSAGE_BYTES;
    use tokio::net::TcpListener;
    use tokio_util::sync::CancellationToken;
    use tracing::{info, warn};

    use crate::metrics::Metrics;
    use crate::service::RouterService;
    use crate::state::Shared;

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
    // Kept here as well as in `shared`: Pick only publishes through it, the
    // orderly stop below also flushes it and writes the last snapshot.
    let mut store = None;
    if let Some(url) = &settings.redis {
        let ttl = std::time::Duration::from_secs(settings.session_ttl_secs);
        store = store::start(url, &settings.cluster, ttl, settings.snapshot_interval, shared.clone()).await;
        if let Some(store) = &store {
            let _ = shared.store.set(Box::new(store.clone()));
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

    // Bound before the listening line, so a test that reads it can point
    // its engines at these endpoints.
    for (worker, endpoint) in kv_subscriber::start(&shared, &settings.kv_events).await? {
        println!("kvmesh-sidecar kv-events worker={worker} endpoint={endpoint}");
    }
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
    if let Some(store) = &store {
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
