//! The admin HTTP server: Prometheus metrics, liveness, readiness and a debug
//! view of the workers (addresses and counts only, never prompt text).

use axum::Router as HttpRouter;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;

use crate::service::Shared;

pub(crate) fn routes(shared: Shared) -> HttpRouter {
    HttpRouter::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/debug/workers", get(workers))
        .with_state(shared)
}

async fn metrics(State(shared): State<Shared>) -> impl IntoResponse {
    let (workers, sessions) = {
        let router = shared.router();
        (router.workers(), router.session_count())
    };
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        shared.metrics.render(&workers, sessions),
    )
}

/// Ready once at least one worker may be picked.
async fn readyz(State(shared): State<Shared>) -> impl IntoResponse {
    let healthy = shared.router().workers().iter().filter(|w| w.healthy).count();
    if healthy > 0 {
        (StatusCode::OK, format!("ready: {healthy} healthy workers\n"))
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: no healthy workers\n".to_owned(),
        )
    }
}

async fn workers(State(shared): State<Shared>) -> impl IntoResponse {
    let workers: Vec<serde_json::Value> = shared
        .router()
        .workers()
        .into_iter()
        .map(|w| {
            serde_json::json!({
                "address": w.address,
                "healthy": w.healthy,
                "in_flight": w.in_flight,
                "cached_blocks": w.cached_blocks,
            })
        })
        .collect();
    axum::Json(serde_json::json!({ "workers": workers }))
}
