//! `kvmesh-sim`: a simulated GPU inference worker. It speaks the OpenAI chat
//! completions API (JSON and SSE), keeps its own prefix cache over its own
//! token blocks (it knows nothing of kvmesh's hashes), reports `usage` with
//! cached tokens the way vLLM does, and exposes `/metrics` under vLLM's names
//! or SGLang's (`--metrics-names`). `POST /admin/restart` and
//! `POST /admin/reset-cache` simulate an engine restart and a cache reset;
//! `GET /admin/last-body` returns the last inference request's body as it
//! arrived.
//!
//! With `--agent-script` it answers Chat Completions, Responses and
//! Messages calls as a model driving a coding agent would
//! (`kvmesh_sim::agent`): a shell tool call, a subagent when asked, then a
//! final answer, so real harness CLIs can run sessions against it. The
//! timing, the cache and the usage are the same; only what the reply says
//! changes, and its decode steps are the reply's tokens.
//!
//! Timing is `kvmesh_sim::timing`, scaled by `--time-scale`: prefills one at
//! a time, each prompt looked up when its prefill starts and its blocks
//! cached chunk by chunk as they are computed; each decode step as long as
//! reading the weights and the running batch's KV takes.
#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use clap::{Parser, ValueEnum};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use kvmesh_sim::agent::{self, Script};
use kvmesh_sim::api::{Api, Call, Reply, ScriptedReply};
use kvmesh_sim::engine::{Engine, EngineConfig, Running, Served};
use kvmesh_sim::timing::{
    H100_8B_KV_BYTES_PER_TOKEN, H100_8B_WEIGHT_BYTES, H100_MEMORY_BYTES_PER_MS, PREFILL_CHUNK_TOKENS, TimingModel,
};
use kvmesh_sim::tokenizer::Tokenizer;

/// kvmesh-sim: a simulated OpenAI-compatible GPU worker with a prefix cache.
#[derive(Debug, Parser)]
#[command(name = "kvmesh-sim", version, about)]
struct Args {
    /// Address to serve on; port 0 picks a free one (printed on stdout).
    #[arg(long, default_value = "127.0.0.1:8000", env = "KVMESH_SIM_LISTEN")]
    listen: SocketAddr,
    /// Name reported in responses [default: the bound address].
    #[arg(long, env = "KVMESH_SIM_NAME")]
    name: Option<String>,
    /// KV cache capacity in tokens (a 30B model on one 80 GB GPU holds a few
    /// hundred thousand).
    #[arg(long, default_value_t = 200_000)]
    capacity_tokens: u64,
    /// Prefill throughput, uncached prompt tokens per millisecond (one H100
    /// on a ~30B model: about 20).
    #[arg(long, default_value_t = 20.0)]
    prefill_tokens_per_ms: f64,
    /// Model weights read by every decode step, in GB (an 8B model in
    /// BF16: 16.06).
    #[arg(long, default_value_t = H100_8B_WEIGHT_BYTES / 1e9)]
    weight_gb: f64,
    /// KV bytes per token of context (Llama-3.1-8B: 32 layers × 8 KV heads
    /// × 128 × K and V × 2 bytes).
    #[arg(long, default_value_t = H100_8B_KV_BYTES_PER_TOKEN)]
    kv_bytes_per_token: f64,
    /// GPU memory bandwidth in TB/s (H100 SXM HBM3: 3.35).
    #[arg(long, default_value_t = H100_MEMORY_BYTES_PER_MS * 1e3 / 1e12)]
    memory_tb_per_s: f64,
    /// Fixed time to the first token, in milliseconds.
    #[arg(long, default_value_t = 5.0)]
    first_token_ms: f64,
    /// Multiplies every simulated duration (0 = instant).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Output tokens when the request gives no max_tokens.
    #[arg(long, default_value_t = 16)]
    default_output_tokens: u32,
    /// Which engine's metric names `/metrics` uses.
    #[arg(long, value_enum, default_value_t = MetricsNames::Vllm)]
    metrics_names: MetricsNames,
    /// Answer as a model driving a coding agent (Claude Code, Codex,
    /// OpenCode, OpenClaw): a call to the request's shell tool running
    /// `echo hi`, then (when a user message says KVSPAWN) a call to its
    /// subagent tool, then a final answer; title and summary calls get
    /// text. Decided from each request alone.
    #[arg(
        long,
        env = "KVMESH_SIM_AGENT_SCRIPT",
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    agent_script: bool,
    /// Keep the last N inference requests (path, headers, body) for
    /// `GET /admin/requests`, so a test can see what a client sent through
    /// the proxy; at most 64 MiB of bodies are kept. 0: none.
    #[arg(long, default_value_t = 0)]
    record_requests: usize,
}

/// Bytes of request bodies `--record-requests` keeps at most: the oldest
/// requests are dropped first.
const RECORDED_BODY_BYTES_MAX: usize = 64 << 20;

/// One inference request as it arrived (`GET /admin/requests`).
#[derive(Debug, Clone)]
struct Recorded {
    /// When it arrived, in microseconds since the Unix epoch: a test orders
    /// the requests of several workers by it.
    received_us: u128,
    path: String,
    headers: Vec<(String, String)>,
    body: Bytes,
}

/// The engine whose Prometheus names the sim's `/metrics` speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum MetricsNames {
    Vllm,
    Sglang,
}

/// Faults injected through `POST /admin/fault`.
#[derive(Debug, Clone, Copy, Default, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
struct Fault {
    /// Every duration multiplied by this (1 or absent: normal speed).
    slow: Option<f64>,
    /// Every inference request answered with this status, no work done.
    error: Option<u16>,
}

#[derive(Debug, Clone)]
struct App {
    name: Arc<str>,
    engine: Arc<Mutex<Engine>>,
    /// Prefills run one at a time, in arrival order (tokio's mutex is
    /// fair): the engine's prefill queue.
    prefill_lane: Arc<tokio::sync::Mutex<()>>,
    /// Told when a request releases its blocks: the request at the head
    /// of the queue may fit now.
    freed: Arc<tokio::sync::Notify>,
    /// The engine's tokenizer, with its memo of what it has encoded.
    tokenizer: Arc<Mutex<Tokenizer>>,
    timing: TimingModel,
    fault: Arc<Mutex<Fault>>,
    args: Arc<Args>,
    /// The body of the last inference request, as it arrived
    /// (`GET /admin/last-body`): tests compare it with what the client sent.
    last_body: Arc<Mutex<Bytes>>,
    /// The last `--record-requests` inference requests, oldest first.
    recorded: Arc<Mutex<std::collections::VecDeque<Recorded>>>,
    /// Differs between processes: scripted replies' ids are made from it,
    /// the worker's name and the request number.
    id_nonce: u128,
}

impl App {
    fn engine(&self) -> std::sync::MutexGuard<'_, Engine> {
        self.engine.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn tokenizer(&self) -> std::sync::MutexGuard<'_, Tokenizer> {
        self.tokenizer.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn fault(&self) -> Fault {
        *self.fault.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The timing model with the current slow-down applied.
    fn timing(&self) -> TimingModel {
        let slow = self.fault().slow.unwrap_or(1.0).max(0.0);
        TimingModel {
            time_scale: self.timing.time_scale * slow,
            ..self.timing
        }
    }

    /// The scripted reply to `call`, with ids no other worker or run uses.
    fn scripted(&self, call: Call, served: Served, script: Script) -> ScriptedReply {
        let digest = Sha256::new()
            .chain_update(self.name.as_bytes())
            .chain_update(self.id_nonce.to_le_bytes())
            .chain_update(served.request_id.to_le_bytes())
            .finalize();
        let mut uid = hex::encode(digest);
        uid.truncate(24);
        let created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |since| since.as_secs());
        ScriptedReply {
            call,
            served,
            script,
            uid,
            created,
        }
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt().with_writer(std::io::stderr).init();
    let args = Args::parse();
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    let addr = listener.local_addr()?;
    let name: Arc<str> = args.name.clone().unwrap_or_else(|| addr.to_string()).into();
    let engine = Engine::new(EngineConfig {
        capacity_tokens: args.capacity_tokens,
        ..EngineConfig::default()
    });
    let timing = TimingModel {
        prefill_tokens_per_ms: args.prefill_tokens_per_ms,
        weight_bytes: args.weight_gb * 1e9,
        kv_bytes_per_token: args.kv_bytes_per_token,
        memory_bytes_per_ms: args.memory_tb_per_s * 1e12 / 1e3,
        first_token_overhead_ms: args.first_token_ms,
        host_load_tokens_per_ms: TimingModel::default().host_load_tokens_per_ms,
        time_scale: args.time_scale,
    };
    let app = App {
        name: name.clone(),
        engine: Arc::new(Mutex::new(engine)),
        prefill_lane: Arc::new(tokio::sync::Mutex::new(())),
        freed: Arc::new(tokio::sync::Notify::new()),
        tokenizer: Arc::new(Mutex::new(Tokenizer::new()?)),
        timing,
        fault: Arc::new(Mutex::new(Fault::default())),
        args: Arc::new(args),
        last_body: Arc::new(Mutex::new(Bytes::new())),
        recorded: Arc::default(),
        id_nonce: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |since| since.as_nanos())
            ^ u128::from(std::process::id()),
    };
    let mut routes = Router::new();
    for (path, api) in [
        ("/v1/chat/completions", Api::Chat),
        ("/v1/completions", Api::Completions),
        ("/v1/responses", Api::Responses),
        ("/v1/messages", Api::Messages),
    ] {
        routes = routes.route(
            path,
            post(
                move |State(app): State<App>, uri: axum::http::Uri, headers: HeaderMap, body: Bytes| {
                    record(&app, &uri, &headers, &body);
                    serve(app, api, headers, body)
                },
            ),
        );
    }
    let routes = routes
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics))
        .route("/admin/restart", post(restart))
        .route("/admin/reset-cache", post(reset_cache))
        .route("/admin/fault", post(set_fault))
        .route(
            "/admin/last-body",
            get(|State(app): State<App>| async move {
                app.last_body
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .clone()
            }),
        )
        .route("/admin/requests", get(recorded_requests))
        .route("/health", get(|| async { "ok" }))
        .fallback(fallback)
        // Engines take whole agent contexts (vLLM has no small body limit);
        // axum's default of 2 MB would refuse them.
        .layer(axum::extract::DefaultBodyLimit::max(64 * 1024 * 1024))
        .with_state(app);
    println!("kvmesh-sim {name} listening on {addr}");
    tracing::info!("kvmesh-sim {name} serving on {addr}");
    // No Nagle delay on small responses and SSE events.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, routes)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}

/// Headers every response carries, so tests can see what reached the worker.
fn tag(app: &App, request_headers: &HeaderMap, body: &[u8], mut response: Response) -> Response {
    let headers = response.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&app.name) {
        headers.insert("x-kvmesh-sim-worker", v);
    }
    if let Ok(v) = HeaderValue::from_str(&hex::encode(Sha256::digest(body))) {
        headers.insert("x-kvmesh-sim-body-sha256", v);
    }
    headers.insert("x-kvmesh-sim-body-bytes", HeaderValue::from(body.len()));
    if let Some(v) = request_headers.get("x-kvmesh-destination") {
        headers.insert("x-kvmesh-sim-saw-destination", v.clone());
    }
    // A misbehaving engine on request: the response's content type set to
    // the given bytes (tests send ones that are not UTF-8).
    if let Some(v) = request_headers.get("x-kvmesh-sim-content-type") {
        headers.insert(axum::http::header::CONTENT_TYPE, v.clone());
    }
    response
}

fn error(status: StatusCode, message: &str) -> Response {
    (
        status,
        axum::Json(json!({"error": {"message": message, "type": "invalid_request_error"}})),
    )
        .into_response()
}

/// Keeps the request for `GET /admin/requests` when `--record-requests`
/// asks, dropping the oldest beyond the count or the byte bound.
fn record(app: &App, uri: &axum::http::Uri, headers: &HeaderMap, body: &Bytes) {
    let keep = app.args.record_requests;
    if keep == 0 {
        return;
    }
    let request = Recorded {
        received_us: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |since| since.as_micros()),
        path: uri
            .path_and_query()
            .map_or_else(|| uri.path().to_owned(), ToString::to_string),
        headers: headers
            .iter()
            .map(|(name, value)| {
                (
                    name.as_str().to_owned(),
                    String::from_utf8_lossy(value.as_bytes()).into_owned(),
                )
            })
            .collect(),
        body: body.clone(),
    };
    let mut recorded = app.recorded.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    recorded.push_back(request);
    let mut bytes: usize = recorded.iter().map(|r| r.body.len()).sum();
    while recorded.len() > keep || (bytes > RECORDED_BODY_BYTES_MAX && recorded.len() > 1) {
        if let Some(dropped) = recorded.pop_front() {
            bytes -= dropped.body.len();
        }
    }
}

/// `GET /admin/requests`: the recorded requests, oldest first, each
/// `{"received_us", "path", "headers": [[name, value]], "body"}`, the body as the text it
/// was (not re-serialised: a test hashes the bytes the client sent).
async fn recorded_requests(State(app): State<App>) -> Response {
    let recorded: Vec<Recorded> = app
        .recorded
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .iter()
        .cloned()
        .collect();
    let requests: Vec<Value> = recorded
        .into_iter()
        .map(|r| json!({"received_us": r.received_us, "path": r.path, "headers": r.headers, "body": String::from_utf8_lossy(&r.body)}))
        .collect();
    axum::Json(Value::Array(requests)).into_response()
}

async fn serve(app: App, api: Api, headers: HeaderMap, body: Bytes) -> Response {
    *app.last_body.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = body.clone();
    let call = serde_json::from_slice::<Value>(&body)
        .map_err(|err| format!("invalid JSON body: {err}"))
        .and_then(|request| {
            let call = Call::parse(api, &request, app.args.default_output_tokens)?;
            let script = if app.args.agent_script {
                agent::decide(api, &request)
            } else {
                None
            };
            Ok((call, script))
        });
    let response = match call {
        Err(message) => error(StatusCode::BAD_REQUEST, &message),
        Ok((call, None)) => reply(&app, call).await,
        Ok((call, Some(script))) => reply_scripted(&app, call, script).await,
    };
    tag(&app, &headers, &body, response)
}

/// Waits for the prefill lane, looks the prompt up when its prefill starts,
/// and caches its blocks chunk by chunk as they are computed. The request
/// then decodes over its prompt's KV.
async fn prefill(app: &App, prompt: &[u8]) -> Hold {
    let tokens = app.tokenizer().encode(prompt);
    let mut queued = Queued::new(app);
    let lane = app.prefill_lane.lock().await;
    // Admitted once its blocks fit beside the running requests' (the lane
    // waits with it: first come, first served).
    let running = loop {
        let freed = app.freed.notified();
        let admitted = {
            let mut engine = app.engine();
            let admitted = engine.try_begin_prefill(&tokens);
            if admitted.is_some() {
                queued.leave(&mut engine);
            }
            admitted
        };
        match admitted {
            Some(running) => break running,
            None => freed.await,
        }
    };
    let served = running.served;
    let mut hold = Hold {
        app: app.clone(),
        running: Some(running),
        served,
        attended: 0,
    };
    let timing = app.timing();
    let uncached = served.uncached_tokens();
    tokio::time::sleep(timing.prefill(0)).await;
    let mut computed = 0;
    while computed < uncached {
        let chunk = PREFILL_CHUNK_TOKENS.min(uncached - computed);
        tokio::time::sleep(timing.prefill(chunk).saturating_sub(timing.prefill(0))).await;
        computed += chunk;
        if let Some(running) = hold.running.as_mut() {
            app.engine().cache_computed(running, computed);
        }
    }
    drop(lane);
    hold.attend(served.prompt_tokens);
    hold
}

/// A request's place in the engine's queue (`vllm:num_requests_waiting`),
/// left at its admission or when its handler is dropped before it.
struct Queued {
    app: Option<App>,
}

impl Queued {
    fn new(app: &App) -> Self {
        app.engine().enqueue();
        Self { app: Some(app.clone()) }
    }

    /// Admitted: out of the queue, under the engine's lock the admission
    /// holds.
    fn leave(&mut self, engine: &mut Engine) {
        if self.app.take().is_some() {
            engine.dequeue();
        }
    }
}

impl Drop for Queued {
    fn drop(&mut self) {
        if let Some(app) = self.app.take() {
            app.engine().dequeue();
        }
    }
}

/// A request's hold on its engine from its admission: its blocks, and the
/// KV its decode steps attend. Released when it is dropped, at the request's
/// end or when its handler is (a client that hung up before the reply), so
/// no block outlives its request and the queue's head is told there may be
/// room now.
struct Hold {
    app: App,
    running: Option<Running>,
    served: Served,
    /// KV tokens it added to what the decode steps attend.
    attended: u64,
}

impl Hold {
    fn attend(&mut self, tokens: u64) {
        self.app.engine().attend(tokens);
        self.attended += tokens;
    }

    /// One decode step, as long as the running batch's KV makes it; the
    /// request's own context grows by the token it generates.
    async fn decode_step(&mut self) {
        let attended = self.app.engine().attended_kv_tokens();
        tokio::time::sleep(self.app.timing().decode_step(attended)).await;
        self.attend(1);
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        if let Some(running) = self.running.take() {
            self.app.engine().finish(running, self.attended);
            self.app.freed.notify_waiters();
        }
    }
}

fn reply_text(app: &App, served: &Served) -> String {
    format!(
        "[{}] read {} prompt tokens, {} from cache.",
        app.name, served.prompt_tokens, served.cached_tokens
    )
}

/// The error every inference request gets while one is injected.
fn injected_fault(app: &App) -> Option<Response> {
    let status = app.fault().error?;
    Some(error(
        StatusCode::from_u16(status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE),
        "injected fault",
    ))
}

async fn reply(app: &App, call: Call) -> Response {
    if let Some(response) = injected_fault(app) {
        return response;
    }
    if !call.stream {
        let mut hold = prefill(app, &call.prompt).await;
        let served = hold.served;
        for _ in 0..call.output_tokens {
            hold.decode_step().await;
        }
        drop(hold);
        let text = reply_text(app, &served);
        let reply = Reply { call, served, text };
        return axum::Json(reply.json()).into_response();
    }
    let app = app.clone();
    let events = async_stream(move |tx| async move {
        let mut hold = prefill(&app, &call.prompt).await;
        let served = hold.served;
        let text = reply_text(&app, &served);
        let reply = Reply { call, served, text };
        for event in reply.sse_start() {
            let _ = tx.send(Bytes::from(event)).await;
        }
        let words: Vec<&str> = reply.text.split_inclusive(' ').collect();
        for i in 0..reply.call.output_tokens as usize {
            hold.decode_step().await;
            let word = words.get(i).copied().unwrap_or("");
            let _ = tx.send(Bytes::from(reply.sse_token(word))).await;
        }
        for event in reply.sse_end() {
            let _ = tx.send(Bytes::from(event)).await;
        }
        drop(hold);
    });
    sse_response(events)
}

/// `reply` under `--agent-script`: the same prefill and decode steps, one
/// step per token of the scripted reply, each sending its piece.
async fn reply_scripted(app: &App, call: Call, script: Script) -> Response {
    if let Some(response) = injected_fault(app) {
        return response;
    }
    if !call.stream {
        let mut hold = prefill(app, &call.prompt).await;
        let reply = app.scripted(call, hold.served, script);
        for _ in 0..reply.output_tokens() {
            hold.decode_step().await;
        }
        drop(hold);
        return axum::Json(reply.json()).into_response();
    }
    let app = app.clone();
    let events = async_stream(move |tx| async move {
        let mut hold = prefill(&app, &call.prompt).await;
        let reply = app.scripted(call, hold.served, script);
        let events = reply.sse();
        for event in events.start {
            let _ = tx.send(Bytes::from(event)).await;
        }
        for step in events.steps {
            hold.decode_step().await;
            for event in step {
                let _ = tx.send(Bytes::from(event)).await;
            }
        }
        for event in events.end {
            let _ = tx.send(Bytes::from(event)).await;
        }
        drop(hold);
    });
    sse_response(events)
}

fn sse_response(
    events: impl futures_util::Stream<Item = Result<Bytes, std::convert::Infallible>> + Send + 'static,
) -> Response {
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(events))
        .unwrap_or_else(|_| error(StatusCode::INTERNAL_SERVER_ERROR, "stream"))
}

/// `POST /admin/fault` with `{"slow": 5}`, `{"error": 503}`, or `{}` to clear.
async fn set_fault(State(app): State<App>, headers: HeaderMap, body: Bytes) -> Response {
    let response = match serde_json::from_slice::<Fault>(if body.is_empty() { b"{}" } else { &body }) {
        Ok(fault) => {
            *app.fault.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = fault;
            tracing::info!(?fault, "fault set");
            axum::Json(json!({"slow": fault.slow, "error": fault.error})).into_response()
        }
        Err(err) => error(StatusCode::BAD_REQUEST, &format!("bad fault: {err}")),
    };
    tag(&app, &headers, &body, response)
}

/// A byte stream fed by a task, so the response starts before the task ends.
fn async_stream<F, Fut>(produce: F) -> impl futures_util::Stream<Item = Result<Bytes, std::convert::Infallible>>
where
    F: FnOnce(tokio::sync::mpsc::Sender<Bytes>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    tokio::spawn(produce(tx));
    futures_util::StreamExt::map(tokio_stream::wrappers::ReceiverStream::new(rx), Ok)
}

async fn models(State(app): State<App>, headers: HeaderMap) -> Response {
    let body =
        axum::Json(json!({"object": "list", "data": [{"id": "sim", "object": "model", "owned_by": &*app.name}]}));
    tag(&app, &headers, b"", body.into_response())
}

async fn metrics(State(app): State<App>) -> String {
    match app.args.metrics_names {
        MetricsNames::Vllm => app.engine().render_vllm_metrics(),
        MetricsNames::Sglang => app.engine().render_sglang_metrics(),
    }
}

/// Simulates an engine restart: cache wiped, counters from zero, a new start time.
async fn restart(State(app): State<App>, headers: HeaderMap, body: Bytes) -> Response {
    let process_start_time = {
        let mut engine = app.engine();
        engine.restart();
        engine.process_start_time()
    };
    tracing::info!("kvmesh-sim {} restarted (simulated)", app.name);
    let reply = axum::Json(json!({"restarted": true, "process_start_time_seconds": process_start_time}));
    tag(&app, &headers, &body, reply.into_response())
}

/// Simulates a cache reset without a restart: the counters go on.
async fn reset_cache(State(app): State<App>, headers: HeaderMap, body: Bytes) -> Response {
    app.engine().reset_cache();
    tracing::info!("kvmesh-sim {} cache reset (simulated)", app.name);
    let reply = axum::Json(json!({"cache_reset": true}));
    tag(&app, &headers, &body, reply.into_response())
}

async fn fallback(State(app): State<App>, headers: HeaderMap, body: Bytes) -> Response {
    let response = error(StatusCode::NOT_FOUND, "no such endpoint");
    tag(&app, &headers, &body, response)
}
