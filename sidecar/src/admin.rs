//! The admin HTTP server: Prometheus metrics, liveness, readiness and a debug
//! view of the workers (addresses and counts only, never prompt text).

use axum::Router as HttpRouter;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;

use crate::service::Shared;

pub(crate) fn routes(shared: Shared, token: Option<String>) -> HttpRouter {
    // Probes stay open (Kubernetes cannot send a secret with them); the
    // pages that describe the cluster need the token when one is set.
    let guarded = HttpRouter::new()
        .route("/metrics", get(metrics))
        .route("/debug/workers", get(workers))
        .route("/debug/sessions", get(sessions))
        .route_layer(axum::middleware::from_fn(
            move |request: axum::extract::Request, next: axum::middleware::Next| {
                let token = token.clone();
                async move {
                    if let Some(token) = token {
                        let header = request
                            .headers()
                            .get(header::AUTHORIZATION)
                            .and_then(|v| v.to_str().ok());
                        if !crate::auth::matches(header, &token) {
                            return (StatusCode::UNAUTHORIZED, "missing or wrong kvmesh token\n").into_response();
                        }
                    }
                    next.run(request).await
                }
            },
        ));
    HttpRouter::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .merge(guarded)
        .with_state(shared)
}

async fn metrics(State(shared): State<Shared>) -> impl IntoResponse {
    let (workers, sessions, entries, bytes) = {
        let router = shared.router();
        let index = router.index();
        (
            router.workers(),
            router.sessions().len(),
            index.entries(),
            index.memory_bytes(),
        )
    };
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        shared.metrics.render(&workers, sessions, entries, bytes),
    )
}

/// Session ids, homes and idle times: ids and counts only, never prompt text.
async fn sessions(State(shared): State<Shared>) -> impl IntoResponse {
    let now = crate::service::now_ms();
    let router = shared.router();
    let mut sessions: Vec<serde_json::Value> = router
        .sessions()
        .iter()
        .map(|(id, home, seen)| {
            serde_json::json!({
                "session": id,
                "home": router.address(home),
                "idle_ms": now.saturating_sub(seen),
                "parent": router.sessions().parent(id),
            })
        })
        .collect();
    sessions.sort_by_key(|s| s["idle_ms"].as_u64().unwrap_or(0));
    // A page of the most recent; the count is the whole table.
    let total = sessions.len();
    sessions.truncate(1000);
    axum::Json(serde_json::json!({ "count": total, "sessions": sessions }))
}

/// Ready once at least one worker may be picked.
async fn readyz(State(shared): State<Shared>) -> impl IntoResponse {
    let healthy = shared
        .router()
        .workers()
        .iter()
        .filter(|w| w.healthy && w.state == kvmesh_core::WorkerState::Active)
        .count();
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
                "state": format!("{:?}", w.state).to_lowercase(),
                "healthy": w.healthy,
                "in_flight": w.in_flight,
                "queued_prefill_tokens": w.queued_prefill_tokens.round(),
                "active_kv_tokens": w.active_kv_tokens.round(),
                "cached_blocks": w.cached_blocks,
                "capacity_blocks": w.capacity_blocks,
                "live_sessions": w.live_sessions,
            })
        })
        .collect();
    axum::Json(serde_json::json!({ "workers": workers }))
}
