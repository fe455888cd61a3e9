//! The admin HTTP edge: Prometheus metrics, liveness, readiness and debug
//! views of the workers, sessions and agents (addresses, ids and counts
//! only, never prompt text); and its one client, `kvmesh-sidecar report`,
//! kept beside the route it reads so the two cannot drift apart.

use axum::Router as HttpRouter;
use axum::extract::{Query, State};
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use kvmesh_core::{WorkerId, WorkerView};

use crate::clock::now_ms;
use crate::config::ReportArgs;
use crate::state::Shared;

pub(crate) fn routes(shared: Shared, token: Option<String>) -> HttpRouter {
    // Probes stay open (Kubernetes cannot send a secret with them); the
    // pages that describe the cluster need the token when one is set.
    let guarded = HttpRouter::new()
        .route("/metrics", get(metrics))
        .route("/debug/workers", get(workers))
        .route("/debug/sessions", get(sessions))
        .route("/debug/report", get(report))
        .route("/debug/prefix-breaks", get(prefix_breaks))
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

/// Runs a page's work on a blocking thread, off the async workers the gRPC
/// streams run on: with two of them (one per core), a page built on one
/// (a ledger pass, a thousand rows of JSON, 2-5 ms) held every Pick queued
/// behind it on that thread.
async fn off_workers<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> Result<T, StatusCode> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)
}

async fn metrics(State(shared): State<Shared>) -> Result<impl IntoResponse, StatusCode> {
    let text = off_workers(move || metrics_text(&shared)).await?;
    Ok((
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        text,
    ))
}

fn metrics_text(shared: &Shared) -> String {
    shared.fresh_insights();
    let (workers, sizes) = shared.scrape_figures();
    shared.metrics.render(&workers, sizes)
}

/// A page of `/debug/sessions`: `offset` and `limit` count sessions from the
/// most recently seen.
#[derive(Debug, serde::Deserialize)]
struct Page {
    offset: Option<usize>,
    limit: Option<usize>,
}

/// Sessions per page unless asked, and at most.
const PAGE_DEFAULT: usize = 1000;
const PAGE_MAX: usize = 10_000;

/// Sessions copied per hold of the router's lock: about 0.1 ms.
const ROWS_PER_LOCK: usize = 1000;

/// Session ids, homes, idle times, parents, harnesses and calls by lane:
/// ids and counts only, never prompt text.
///
/// Every Pick waits on the router's lock, so this reads at most
/// [`ROWS_PER_LOCK`] sessions per hold of it (`Shared::sessions_before`,
/// with a pause between holds), walking the session table from
/// the most recently seen: a page costs its offset and rows, not the table
/// (copying and sorting every session took 310-390 ms at 100,000, and
/// fetched in a loop held Picks to about 25/s). A session seen again while
/// the page is read moves to the front and may drop out of a deep page.
/// The idle sessions are the ledger's last tick's list, which holds the
/// largest [`kvmesh_core::IDLE_LIST_MAX`]. The harness and calls by lane
/// are the ledger's, read after the router's lock is released,
/// [`ROWS_PER_LOCK`] sessions per hold of the ledger's lock.
async fn sessions(State(shared): State<Shared>, Query(page): Query<Page>) -> Result<impl IntoResponse, StatusCode> {
    off_workers(move || axum::Json(sessions_page(&shared, &page))).await
}

fn sessions_page(shared: &Shared, page: &Page) -> serde_json::Value {
    let now = now_ms();
    let offset = page.offset.unwrap_or(0);
    let limit = page.limit.unwrap_or(PAGE_DEFAULT).min(PAGE_MAX);
    let (total, addresses) = shared.session_count_and_addresses();
    let mut cursor = u64::MAX;
    let mut skip = offset.min(total);
    let mut rows: Vec<SessionRow> = Vec::with_capacity(limit.min(total));
    while rows.len() < limit {
        let resume = if skip > 0 {
            let (found, resume) = shared.count_sessions_before(cursor, skip.min(ROWS_PER_LOCK));
            skip -= found;
            resume
        } else {
            let want = (limit - rows.len()).min(ROWS_PER_LOCK);
            let (found, resume) = shared.sessions_before(cursor, want);
            rows.extend(found.into_iter().map(|s| SessionRow {
                home: addresses.get(s.home.0).cloned(),
                idle_ms: now.saturating_sub(s.last_seen_ms),
                session: s.session,
                parent: s.parent,
                lanes: None,
            }));
            resume
        };
        // The walk reached the oldest session.
        if resume == cursor {
            break;
        }
        cursor = resume;
        crate::state::between_locks();
    }
    // The ledger after the router, never both at once.
    for (i, chunk) in rows.chunks_mut(ROWS_PER_LOCK).enumerate() {
        if i > 0 {
            crate::state::between_locks();
        }
        let insights = shared.insights();
        for row in chunk {
            row.lanes = insights.session_lanes(&row.session);
        }
    }
    let sessions: Vec<serde_json::Value> = rows.into_iter().map(SessionRow::into_json).collect();
    // What idle sessions hold while their agents wait on tools.
    shared.fresh_insights();
    let tick = shared.insights().last_tick();
    let since_tick = now.saturating_sub(tick.taken_ms);
    let idle: Vec<serde_json::Value> = tick
        .idle
        .iter()
        .skip(offset)
        .take(limit)
        .map(|s| {
            serde_json::json!({
                "session": s.session,
                "model": s.model,
                "harness": s.harness,
                "worker": addresses.get(s.worker.0),
                "kv_bytes": s.kv_bytes.round(),
                "idle_ms": s.idle_ms + since_tick,
                "recompute_ms": s.recompute_ms.round(),
            })
        })
        .collect();
    serde_json::json!({
        "count": total,
        "offset": offset,
        "sessions": sessions,
        "idle_count": tick.idle_count,
        "idle": idle,
    })
}

/// One session of `/debug/sessions`: the router's view, then the ledger's.
#[derive(Debug)]
struct SessionRow {
    session: String,
    home: Option<String>,
    idle_ms: u64,
    /// As the router resolved it (a parent named by trace is the session
    /// that carried the trace).
    parent: Option<String>,
    /// Its harness and calls by lane, while the ledger follows it.
    lanes: Option<kvmesh_core::SessionLanes>,
}

impl SessionRow {
    /// Its JSON: the fields of earlier versions, then `harness` and
    /// `lanes` (null and zeros when the ledger no longer follows it).
    fn into_json(self) -> serde_json::Value {
        let lanes = self.lanes.unwrap_or_default();
        let calls: serde_json::Map<String, serde_json::Value> = kvmesh_core::Lane::ALL
            .iter()
            .map(|lane| (lane.name().to_owned(), lanes.calls(*lane).into()))
            .collect();
        serde_json::json!({
            "session": self.session,
            "home": self.home,
            "idle_ms": self.idle_ms,
            "parent": self.parent,
            "harness": self.lanes.map(|l| l.harness.name()),
            "lanes": calls,
        })
    }
}

#[derive(Debug, serde::Deserialize)]
struct ReportQuery {
    /// Seconds of history; one hour when absent.
    window_secs: Option<u64>,
    /// Extra KV per worker whose savings the retention section estimates.
    extra_kv_gb: Option<f64>,
}

/// What agents gained over a window, per tenant and harness (`kvmesh-sidecar report`).
///
/// Under the router's lock only the return-gap histograms (about 20
/// buckets per harness) are copied; the evicted idle sessions come from the
/// ledger's last tick, and the ledger builds the report under its own lock,
/// after.
async fn report(
    State(shared): State<Shared>,
    Query(query): Query<ReportQuery>,
) -> Result<impl IntoResponse, StatusCode> {
    off_workers(move || axum::Json(report_page(&shared, &query))).await
}

fn report_page(shared: &Shared, query: &ReportQuery) -> crate::report::AgentReport {
    shared.fresh_insights();
    let window_ms = query.window_secs.unwrap_or(3600).saturating_mul(1000);
    let extra_kv_gb = query
        .extra_kv_gb
        .filter(|gb| gb.is_finite() && *gb >= 0.0)
        .unwrap_or(crate::retention_report::DEFAULT_EXTRA_KV_GB);
    // The evicted idle sessions are the last tick's: it asked the fleet.
    let fleet = shared.fleet_snapshot();
    let tick = shared.insights().last_tick();
    let report = shared.ledger_report(window_ms);
    let retention = crate::retention_report::sections(&report, &fleet, &tick.evicted, extra_kv_gb);
    crate::report::to_json(&report, retention)
}

/// Where sessions' prefixes broke since the start, most frequent first:
/// harness, section and block positions, never prompt text.
async fn prefix_breaks(State(shared): State<Shared>) -> impl IntoResponse {
    let points: Vec<serde_json::Value> = shared
        .insights()
        .break_points()
        .into_iter()
        .take(100)
        .map(|(point, stats)| {
            serde_json::json!({
                "harness": point.harness.name(),
                "section": point.kind.name(),
                "index": point.index,
                "count": stats.count,
                "first_block_min": stats.first_block_min,
                "first_block_max": stats.first_block_max,
            })
        })
        .collect();
    axum::Json(serde_json::json!({ "break_points": points }))
}

/// Ready once at least one worker may be picked, until shutdown begins.
async fn readyz(State(shared): State<Shared>) -> impl IntoResponse {
    if shared.draining() {
        return (StatusCode::SERVICE_UNAVAILABLE, "not ready: shutting down\n".to_owned());
    }
    let healthy = shared
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

async fn workers(State(shared): State<Shared>) -> Result<impl IntoResponse, StatusCode> {
    off_workers(move || axum::Json(workers_page(&shared))).await
}

fn workers_page(shared: &Shared) -> serde_json::Value {
    let now = now_ms();
    let views: Vec<WorkerView> = shared.worker_views(now);
    // One worker's retention residents per hold of the router's lock: all
    // of them at once walked every live session under it.
    let retained: Vec<(usize, f64)> = (0..views.len())
        .map(|i| {
            let value = shared.worker_retention(WorkerId(i), now);
            crate::state::between_locks();
            value
        })
        .collect();
    let workers: Vec<serde_json::Value> = views
        .into_iter()
        .zip(retained)
        .map(|(w, (session_blocks, value_blocks))| {
            serde_json::json!({
                "session_blocks": session_blocks,
                "retained_value_blocks": value_blocks,
                "address": w.address,
                "state": format!("{:?}", w.state).to_lowercase(),
                "healthy": w.healthy,
                "in_flight": w.in_flight,
                "queued_prefill_tokens": w.queued_prefill_tokens.round(),
                "active_kv_tokens": w.active_kv_tokens.round(),
                "cached_blocks": w.cached_blocks,
                "capacity_blocks": w.capacity_blocks,
                "live_sessions": w.live_sessions,
                "engine_capacity_tokens": w.engine_capacity_tokens,
                "tokens_per_block": w.tokens_per_block,
                "block_bytes": w.block_bytes,
                "bytes_per_token": w.bytes_per_token,
                "engine_waiting": w.engine_waiting,
                "engine_running": w.engine_running,
                "engine_kv_usage": w.engine_kv_usage,
                "engine_resident_blocks": w.engine_resident_blocks,
                "engine_block_tokens": w.engine_block_tokens,
                "host_blocks": w.host_blocks,
                "host_capacity_blocks": w.host_capacity_blocks,
                "engine_host_only_blocks": w.engine_host_only_blocks,
            })
        })
        .collect();
    serde_json::json!({ "workers": workers })
}

/// `kvmesh-sidecar report`: fetches the report and prints it.
pub(crate) async fn fetch_report(args: ReportArgs) -> anyhow::Result<String> {
    let url = format!(
        "{}/debug/report?window_secs={}&extra_kv_gb={}",
        args.admin.trim_end_matches('/'),
        args.window.as_secs(),
        args.extra_kv_gb,
    );
    let client = reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(10))
        .build()?;
    let mut request = client.get(&url);
    if let Some(token) = &args.token {
        request = request.bearer_auth(token);
    }
    let response = request
        .send()
        .await
        .map_err(|err| anyhow::anyhow!("cannot reach the sidecar's admin port at {}: {err}", args.admin))?;
    let status = response.status();
    if !status.is_success() {
        let body = response.text().await.unwrap_or_default();
        anyhow::bail!("{url}: HTTP {status}: {}", body.trim());
    }
    let mut report: serde_json::Value = response.json().await?;
    let prices = crate::retention_report::Prices {
        input: args.price_input,
        cached_input: args.price_cached_input,
        output: args.price_output,
    };
    if args.json && prices.input.is_none() {
        return Ok(format!("{report:#}\n"));
    }
    // A sidecar of another version may name its figures otherwise: say so
    // rather than print zeros.
    let mut typed: crate::report::AgentReport = serde_json::from_value(report.clone())
        .map_err(|err| anyhow::anyhow!("{url}: not a report this version can read: {err}"))?;
    typed.pricing = crate::retention_report::Pricing::of(&typed.retention_by_harness, prices);
    if args.json {
        if let (Some(object), Some(pricing)) = (report.as_object_mut(), &typed.pricing) {
            object.insert("pricing".to_owned(), serde_json::to_value(pricing)?);
        }
        return Ok(format!("{report:#}\n"));
    }
    Ok(crate::report::render_text(&typed))
}
