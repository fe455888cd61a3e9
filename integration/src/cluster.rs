//! A whole kvmesh deployment on loopback: N workers (simulated, or real vLLM
//! engines), the sidecar and a real Envoy running the shipped configuration
//! with the kvmesh filter.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::Value;

use crate::envoy_config::{self, EnvoyOverrides};
use crate::paths::{self, Profile};
use crate::process::Process;
use crate::redis::RedisServer;
use crate::vllm::{self, VllmOptions, VllmWorker};

/// How long a worker, the sidecar or Envoy may take to report ready: a
/// start takes 1-5 s, more when a test binary starts several clusters at
/// once on a loaded machine (a cluster took 4-5 s at load 8 on 2 cores), so
/// this only bounds a hang.
const START_TIMEOUT: Duration = Duration::from_secs(120);

/// The filter's wait for a Pick in tests that need every call routed:
/// the shipped 50 ms is a latency budget a loaded machine can exceed (a Pick
/// crosses Envoy, the sidecar and Envoy again, each waiting for a core), and
/// a Pick that misses it fails open to round robin, by design (`fail_open.rs`
/// tests that budget). With this the wait only bounds a hang, so a test of
/// where calls go does not also test how fast the machine is.
pub const PATIENT_SIDECAR_TIMEOUT_MS: u64 = 5_000;

/// What serves as a worker.
#[derive(Debug, Clone, Default)]
pub enum Engine {
    /// `kvmesh-sim`, with `ClusterOptions::sim_args`.
    #[default]
    Sim,
    /// A real vLLM (CPU build) per worker, serving the tiny model of
    /// `./dev setup-vllm`; `ClusterOptions::sim_args` is unused.
    Vllm(VllmOptions),
}

/// How to start a cluster.
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    pub workers: usize,
    pub engine: Engine,
    /// Merged over the shipped plugin configuration.
    pub plugin: Value,
    /// Extra `kvmesh-sim` flags (e.g. timing).
    pub sim_args: Vec<String>,
    /// Also serve a listener without the kvmesh filter (`direct_url`).
    pub baseline_listener: bool,
    /// Debug builds for tests, release builds for benchmarks.
    pub profile: Profile,
    /// Extra `kvmesh-sidecar` flags.
    pub sidecar_args: Vec<String>,
    /// Sidecar replicas (at least 1), all listed in Envoy's
    /// `kvmesh_sidecar` cluster; the first is `Cluster::sidecar`, the
    /// others `Cluster::more_sidecars`.
    pub sidecar_replicas: usize,
    /// Start a redis-server and give it to the sidecar (`--redis`).
    pub redis: bool,
    /// The Envoy configuration to render instead of the shipped
    /// `envoy/envoy.yaml` (same shape: listener `agents`, clusters
    /// `gpu_workers` and `kvmesh_sidecar`), e.g. one assembled from the
    /// Istio EnvoyFilters.
    pub envoy_template: Option<String>,
    /// The Wasm module Envoy loads instead of the release build of the
    /// filter (e.g. `paths::crash_test_wasm`).
    pub filter_wasm: Option<PathBuf>,
    /// With vLLM workers: each publishes its KV events to an endpoint of its
    /// own, which the sidecar binds (`--kv-events`). Ignored for the sim.
    pub kv_events: bool,
}

impl Default for ClusterOptions {
    fn default() -> Self {
        Self {
            workers: 3,
            engine: Engine::Sim,
            plugin: serde_json::json!({}),
            // Instant engines: routing tests measure where calls go, not GPU time.
            sim_args: vec!["--time-scale".into(), "0".into()],
            baseline_listener: false,
            profile: Profile::Debug,
            // The simulated engines prefill 100 tokens per ms at time scale
            // 0.2 (their 50 µs per token, scaled); scrape them often.
            sidecar_args: vec![
                "--prefill-tokens-per-ms".into(),
                "100".into(),
                "--scrape-interval-ms".into(),
                "200".into(),
            ],
            redis: false,
            envoy_template: None,
            filter_wasm: None,
            sidecar_replicas: 1,
            kv_events: false,
        }
    }
}

impl ClusterOptions {
    /// These options with the filter waiting up to
    /// [`PATIENT_SIDECAR_TIMEOUT_MS`] for each Pick (`sidecar_timeout_ms`,
    /// merged into `plugin`).
    #[must_use]
    pub fn patient(mut self) -> Self {
        if !self.plugin.is_object() {
            self.plugin = serde_json::json!({});
        }
        if let Some(plugin) = self.plugin.as_object_mut() {
            plugin.insert("sidecar_timeout_ms".to_owned(), PATIENT_SIDECAR_TIMEOUT_MS.into());
        }
        self
    }
}

/// One worker (a `kvmesh-sim`, or a vLLM whose process group stops with it).
#[derive(Debug)]
pub struct Worker {
    pub addr: SocketAddr,
    pub process: Process,
}

/// What came back for one request.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    /// The worker that answered (`x-kvmesh-sim-worker`), if one did.
    pub worker: Option<String>,
    /// The `x-kvmesh-destination` the worker received, if any.
    pub saw_destination: Option<String>,
    /// SHA-256 of the body the worker received.
    pub worker_body_sha256: Option<String>,
    /// How many body bytes the worker received.
    pub worker_body_bytes: Option<usize>,
    pub body: String,
    /// From sending the request to the end of the reply's body.
    pub latency: Duration,
    /// From sending the request to the first SSE event carrying an output
    /// token (time to first token), when read by [`Reply::read_streamed`]
    /// and the stream carried one; `None` otherwise.
    pub first_token: Option<Duration>,
}

impl Reply {
    /// Sends `request` and reads what came back.
    pub async fn read(request: reqwest::RequestBuilder) -> anyhow::Result<Self> {
        let started = Instant::now();
        let response = request.send().await.context("request through Envoy")?;
        let mut reply = Self::head(&response);
        reply.body = response.text().await.context("reading the reply")?;
        reply.latency = started.elapsed();
        Ok(reply)
    }

    /// Sends `request` (a streamed Chat Completions call) and reads its
    /// body chunk by chunk as it arrives, noting when the first output
    /// token came ([`Reply::first_token`]): the whole-body [`Reply::read`]
    /// only sees the end, which a long decode dominates.
    pub async fn read_streamed(request: reqwest::RequestBuilder) -> anyhow::Result<Self> {
        let started = Instant::now();
        let mut response = request.send().await.context("request through Envoy")?;
        let mut reply = Self::head(&response);
        let mut body = Vec::new();
        // Only whole lines are looked at (an event may span chunks); the
        // bytes before `scanned` were.
        let mut scanned = 0;
        while let Some(chunk) = response.chunk().await.context("reading the streamed reply")? {
            body.extend_from_slice(&chunk);
            if reply.first_token.is_some() {
                continue;
            }
            if let Some(end) = body.iter().rposition(|&b| b == b'\n') {
                let lines = String::from_utf8_lossy(&body[scanned..end]);
                if lines.lines().any(carries_output_token) {
                    reply.first_token = Some(started.elapsed());
                }
                scanned = end + 1;
            }
        }
        reply.latency = started.elapsed();
        reply.body = String::from_utf8_lossy(&body).into_owned();
        Ok(reply)
    }

    /// The status and the headers the sim tags its replies with; the body
    /// and the timings are the reader's to fill.
    fn head(response: &reqwest::Response) -> Self {
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        Self {
            status: response.status().as_u16(),
            worker: header("x-kvmesh-sim-worker"),
            saw_destination: header("x-kvmesh-sim-saw-destination"),
            worker_body_sha256: header("x-kvmesh-sim-body-sha256"),
            worker_body_bytes: header("x-kvmesh-sim-body-bytes").and_then(|v| v.parse().ok()),
            body: String::new(),
            latency: Duration::ZERO,
            first_token: None,
        }
    }

    /// The OpenAI `usage` object: a JSON reply's, or a streamed reply's
    /// last one (the chunk `stream_options.include_usage` adds before
    /// `[DONE]`; vLLM sends `"usage": null` on the others).
    pub fn usage(&self) -> Option<Value> {
        if let Ok(json) = serde_json::from_str::<Value>(&self.body) {
            return json.get("usage").cloned();
        }
        sse_data(&self.body)
            .filter_map(|data| serde_json::from_str::<Value>(data).ok())
            .filter_map(|mut event| event.get_mut("usage").map(Value::take))
            .filter(Value::is_object)
            .last()
    }

    /// `usage.prompt_tokens_details.cached_tokens` of a JSON or streamed
    /// reply.
    pub fn cached_tokens(&self) -> Option<u64> {
        self.usage()?.pointer("/prompt_tokens_details/cached_tokens")?.as_u64()
    }

    /// `usage.prompt_tokens` of a JSON or streamed reply.
    pub fn prompt_tokens(&self) -> Option<u64> {
        self.usage()?.get("prompt_tokens")?.as_u64()
    }
}

/// The payloads of an SSE body's `data:` lines, `[DONE]` included.
fn sse_data(body: &str) -> impl Iterator<Item = &str> {
    body.lines()
        .filter_map(|line| line.strip_prefix("data:"))
        .map(str::trim)
}

/// Whether one SSE line is a Chat Completions chunk carrying output: a
/// choice whose delta has text or a tool call. The role chunk a stream
/// opens with (`"content": ""`, sent by the sim when its prefill is done)
/// and the final usage chunk (no choices) do not.
fn carries_output_token(line: &str) -> bool {
    let Some(data) = sse_data(line).next() else {
        return false;
    };
    let Ok(chunk) = serde_json::from_str::<Value>(data) else {
        return false;
    };
    let choices = chunk
        .get("choices")
        .and_then(Value::as_array)
        .map_or(&[][..], Vec::as_slice);
    choices.iter().any(|choice| {
        let delta = &choice["delta"];
        delta["content"].as_str().is_some_and(|text| !text.is_empty())
            || delta["tool_calls"].as_array().is_some_and(|calls| !calls.is_empty())
    })
}

/// A sidecar replica beyond the first.
#[derive(Debug)]
pub struct SidecarReplica {
    pub process: Process,
    pub grpc: SocketAddr,
    pub admin: SocketAddr,
}

/// A running deployment. Dropping it stops every process by pid.
#[derive(Debug)]
pub struct Cluster {
    pub dir: PathBuf,
    pub workers: Vec<Worker>,
    pub sidecar: Process,
    pub sidecar_grpc: SocketAddr,
    pub sidecar_admin: SocketAddr,
    /// Replicas 2.. (`ClusterOptions::sidecar_replicas`).
    pub more_sidecars: Vec<SidecarReplica>,
    // Envoy goes before the sidecar and workers it talks to.
    pub envoy: Process,
    pub envoy_url: String,
    /// The listener without the kvmesh filter, when asked for.
    pub direct_url: Option<String>,
    pub envoy_admin: String,
    /// The redis-server, when asked for.
    pub redis: Option<RedisServer>,
    profile: Profile,
    sidecar_args: Vec<String>,
    sim_args: Vec<String>,
    engine: Engine,
    /// Each vLLM worker's KV event endpoint (`ClusterOptions::kv_events`),
    /// kept for its restart.
    pub kv_endpoints: Vec<Option<String>>,
    http: reqwest::Client,
}

static NEXT_DIR: AtomicU32 = AtomicU32::new(0);

fn scratch_dir() -> anyhow::Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!(
        "kvmesh-it-{}-{}",
        std::process::id(),
        NEXT_DIR.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// Starts `kvmesh-sim` number `index` on `listen` and waits for its address.
fn spawn_worker(
    index: usize,
    listen: SocketAddr,
    sim_args: &[String],
    profile: Profile,
    dir: &std::path::Path,
) -> anyhow::Result<Worker> {
    let mut args = vec!["--listen".to_owned(), listen.to_string()];
    args.extend(sim_args.iter().cloned());
    let mut process = Process::spawn(
        &format!("worker{index}"),
        &paths::binary("kvmesh-sim", profile)?,
        &args,
        dir,
    )?;
    let line = process.wait_for_line("listening on", START_TIMEOUT)?;
    let addr = line
        .rsplit(' ')
        .next()
        .unwrap_or_default()
        .parse()
        .with_context(|| format!("bad sim line {line:?}"))?;
    Ok(Worker { addr, process })
}

fn addr_after(line: &str, key: &str) -> anyhow::Result<SocketAddr> {
    let value = line
        .split_whitespace()
        .find_map(|word| word.strip_prefix(key))
        .with_context(|| format!("no {key} in {line:?}"))?;
    value.parse().with_context(|| format!("bad address in {line:?}"))
}

/// Starts the sidecar on `grpc` (port 0 for any) for `workers`.
pub fn start_sidecar(
    dir: &std::path::Path,
    profile: Profile,
    grpc: SocketAddr,
    workers: &[SocketAddr],
    extra_args: &[String],
) -> anyhow::Result<(Process, SocketAddr, SocketAddr)> {
    start_sidecar_binary(
        &paths::binary("kvmesh-sidecar", profile)?,
        dir,
        grpc,
        workers,
        extra_args,
    )
}

/// [`start_sidecar`] with a given binary: a benchmark runs another commit's
/// build side by side with this one.
pub fn start_sidecar_binary(
    binary: &std::path::Path,
    dir: &std::path::Path,
    grpc: SocketAddr,
    workers: &[SocketAddr],
    extra_args: &[String],
) -> anyhow::Result<(Process, SocketAddr, SocketAddr)> {
    let worker_list = workers.iter().map(ToString::to_string).collect::<Vec<_>>().join(",");
    let mut sidecar = Process::spawn(
        "sidecar",
        binary,
        &[
            "--grpc-listen".into(),
            grpc.to_string(),
            "--admin-listen".into(),
            "127.0.0.1:0".into(),
            "--worker".into(),
            worker_list,
        ]
        .into_iter()
        // The caller's `--log` replaces the default: the sidecar takes it once.
        .chain(
            (!extra_args.iter().any(|a| a == "--log"))
                .then(|| ["--log".to_owned(), "info".to_owned()])
                .into_iter()
                .flatten(),
        )
        .chain(extra_args.iter().cloned())
        .collect::<Vec<String>>(),
        dir,
    )?;
    let line = sidecar.wait_for_line("listening", START_TIMEOUT)?;
    Ok((sidecar, addr_after(&line, "grpc=")?, addr_after(&line, "admin=")?))
}

/// Starts `count` vLLM workers at once, stopping those that started if one
/// fails. A start is mostly CPU-bound imports (20-45 s alone on 2 cores), so
/// starts sharing the cores each get the time of one start per pair of them:
/// three at once took 132 s with other builds running (docs/vllm.md).
/// `kv_endpoints[i]`, when given, is worker `i`'s KV event endpoint.
fn start_vllm_workers(
    count: usize,
    options: &VllmOptions,
    kv_endpoints: &[Option<String>],
    dir: &std::path::Path,
) -> anyhow::Result<Vec<Worker>> {
    let shared = VllmOptions {
        ready_timeout: options.ready_timeout * u32::try_from(count.div_ceil(2).max(1))?,
        ..options.clone()
    };
    let per_worker: Vec<VllmOptions> = (0..count)
        .map(|i| VllmOptions {
            kv_events_endpoint: kv_endpoints
                .get(i)
                .cloned()
                .flatten()
                .or_else(|| shared.kv_events_endpoint.clone()),
            ..shared.clone()
        })
        .collect();
    let started: Vec<anyhow::Result<VllmWorker>> = std::thread::scope(|scope| {
        let starts: Vec<_> = per_worker
            .iter()
            .enumerate()
            .map(|(i, options)| scope.spawn(move || VllmWorker::start(&format!("worker{i}"), dir, options)))
            .collect();
        starts
            .into_iter()
            .map(|start| {
                start
                    .join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a vLLM start panicked")))
            })
            .collect()
    });
    let mut workers = Vec::new();
    for worker in started {
        let worker = worker?;
        eprintln!("vLLM {} ready in {:.1?}", worker.addr, worker.ready_after);
        workers.push(Worker {
            addr: worker.addr,
            process: worker.process,
        });
    }
    Ok(workers)
}

impl Cluster {
    /// What every test of hostile or unusual input must leave behind in
    /// Envoy's log: no Wasm VM lost, nothing panicked, no trap.
    pub fn assert_no_vm_failure(&self) {
        let log = self.envoy.log();
        for needle in ["Function: proxy_on_", "panicked", "wasm trap"] {
            assert!(
                !log.contains(needle),
                "Envoy logged {needle:?}:\n{}",
                self.envoy.log_tail()
            );
        }
    }

    pub async fn start(options: ClusterOptions) -> anyhow::Result<Self> {
        let dir = scratch_dir()?;
        let mut workers = Vec::new();
        let mut kv_endpoints: Vec<Option<String>> = Vec::new();
        match &options.engine {
            Engine::Sim => {
                for i in 0..options.workers {
                    let listen = "127.0.0.1:0".parse()?;
                    workers.push(spawn_worker(i, listen, &options.sim_args, options.profile, &dir)?);
                }
            }
            Engine::Vllm(vllm_options) => {
                if options.kv_events {
                    // vLLM connects to the endpoint and the sidecar binds it
                    // once the workers' addresses are known (and again at
                    // each restart): a port nobody is handed meanwhile.
                    for _ in 0..options.workers {
                        let port = vllm::free_port_outside_ephemeral()?;
                        kv_endpoints.push(Some(format!("tcp://127.0.0.1:{port}")));
                    }
                }
                let (count, vllm_options, at) = (options.workers, vllm_options.clone(), dir.clone());
                let endpoints = kv_endpoints.clone();
                workers =
                    tokio::task::spawn_blocking(move || start_vllm_workers(count, &vllm_options, &endpoints, &at))
                        .await??;
            }
        }
        let addrs: Vec<SocketAddr> = workers.iter().map(|w| w.addr).collect();
        let mut options = options;
        for (worker, endpoint) in workers.iter().zip(&kv_endpoints) {
            if let Some(endpoint) = endpoint {
                options
                    .sidecar_args
                    .extend(["--kv-events".to_owned(), format!("{}={endpoint}", worker.addr)]);
            }
        }
        let redis = if options.redis {
            let server = RedisServer::start(&dir)?;
            options.sidecar_args.extend(["--redis".to_owned(), server.url()]);
            Some(server)
        } else {
            None
        };
        let mut replicas = Vec::new();
        for _ in 0..options.sidecar_replicas.max(1) {
            let (process, grpc, admin) = start_sidecar(
                &dir,
                options.profile,
                "127.0.0.1:0".parse()?,
                &addrs,
                &options.sidecar_args,
            )?;
            replicas.push(SidecarReplica { process, grpc, admin });
        }
        let first = replicas.remove(0);
        let (sidecar, sidecar_grpc, sidecar_admin) = (first.process, first.grpc, first.admin);
        let more_sidecars = replicas;
        let sidecar_addrs: Vec<SocketAddr> = std::iter::once(sidecar_grpc)
            .chain(more_sidecars.iter().map(|r| r.grpc))
            .collect();

        let wasm = match &options.filter_wasm {
            Some(path) => path.clone(),
            None => paths::filter_wasm()?,
        };
        let shipped = match &options.envoy_template {
            Some(template) => template.clone(),
            None => std::fs::read_to_string(paths::envoy_yaml())?,
        };
        let rendered = envoy_config::render(
            &shipped,
            &EnvoyOverrides {
                workers: &addrs,
                sidecars: &sidecar_addrs,
                wasm: &wasm,
                plugin: options.plugin.clone(),
                baseline_listener: options.baseline_listener,
            },
        )?;
        let config = dir.join("envoy.yaml");
        std::fs::write(&config, rendered)?;
        let admin_path = dir.join("envoy-admin-address");
        let envoy = Process::spawn(
            "envoy",
            &paths::envoy(),
            &[
                "-c".into(),
                config.display().to_string(),
                "--admin-address-path".into(),
                admin_path.display().to_string(),
                // Tests run several Envoys at once: no shared hot-restart memory.
                "--disable-hot-restart".into(),
                "--concurrency".into(),
                "2".into(),
                "--log-level".into(),
                "info".into(),
            ],
            &dir,
        )?;
        let http = reqwest::Client::builder()
            .no_proxy()
            .pool_max_idle_per_host(0)
            .build()?;
        let envoy_admin = wait_for_admin(&envoy, &admin_path, &http).await?;
        let envoy_url = format!(
            "http://127.0.0.1:{}",
            listener_port(&http, &envoy_admin, "agents").await?
        );
        let direct_url = if options.baseline_listener {
            let port = listener_port(&http, &envoy_admin, envoy_config::BASELINE_LISTENER).await?;
            Some(format!("http://127.0.0.1:{port}"))
        } else {
            None
        };
        Ok(Self {
            dir,
            workers,
            sidecar,
            sidecar_grpc,
            sidecar_admin,
            more_sidecars,
            envoy,
            envoy_url,
            direct_url,
            envoy_admin,
            redis,
            profile: options.profile,
            sidecar_args: options.sidecar_args.clone(),
            sim_args: options.sim_args.clone(),
            engine: options.engine.clone(),
            kv_endpoints,
            http,
        })
    }

    pub fn worker_names(&self) -> Vec<String> {
        self.workers.iter().map(|w| w.addr.to_string()).collect()
    }

    /// Sends `body` (raw bytes) to `path` through Envoy.
    pub async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        headers: &[(&str, &str)],
        body: Vec<u8>,
    ) -> anyhow::Result<Reply> {
        let mut request = self.http.request(method, format!("{}{path}", self.envoy_url));
        for (k, v) in headers {
            request = request.header(*k, *v);
        }
        Reply::read(request.body(body)).await
    }

    /// As `send`, with header values given as bytes (any octet HTTP allows
    /// in a value, `\xff` included), over HTTP/2 (prior knowledge) when
    /// `http2`, on a fresh connection either way.
    pub async fn send_bytes(
        &self,
        method: reqwest::Method,
        path: &str,
        headers: &[(&str, &[u8])],
        body: Vec<u8>,
        http2: bool,
    ) -> anyhow::Result<Reply> {
        let builder = reqwest::Client::builder().pool_max_idle_per_host(0);
        let client = if http2 {
            builder.http2_prior_knowledge()
        } else {
            builder.http1_only()
        }
        .build()?;
        let mut map = reqwest::header::HeaderMap::new();
        for (k, v) in headers {
            map.append(
                reqwest::header::HeaderName::from_bytes(k.as_bytes())?,
                reqwest::header::HeaderValue::from_bytes(v)?,
            );
        }
        Reply::read(
            client
                .request(method, format!("{}{path}", self.envoy_url))
                .headers(map)
                .body(body),
        )
        .await
    }

    /// Sends a JSON chat completion with extra headers.
    pub async fn chat(&self, body: &Value, headers: &[(&str, &str)]) -> anyhow::Result<Reply> {
        let mut all = vec![("content-type", "application/json")];
        all.extend_from_slice(headers);
        self.send(
            reqwest::Method::POST,
            "/v1/chat/completions",
            &all,
            serde_json::to_vec(body)?,
        )
        .await
    }

    /// A counter from Envoy's stats (`wasmcustom.kvmesh.picks`, ...).
    pub async fn envoy_counter(&self, name: &str) -> anyhow::Result<u64> {
        let text = self
            .http
            .get(format!(
                "{}/stats?filter=^{}$",
                self.envoy_admin,
                name.replace('.', "\\.")
            ))
            .send()
            .await?
            .text()
            .await?;
        text.lines()
            .find_map(|line| line.strip_prefix(&format!("{name}: ")))
            .with_context(|| format!("no stat {name} in {text:?}"))?
            .trim()
            .parse()
            .context("stat value")
    }

    /// The filter's fail-opens on the way to the sidecar: (sidecar errors,
    /// timeouts). A test of where calls go asserts (0, 0): a call that
    /// failed open went round robin.
    pub async fn fail_opens(&self) -> anyhow::Result<(u64, u64)> {
        Ok((
            self.envoy_counter("wasmcustom.kvmesh.fail_open.sidecar_error").await?,
            self.envoy_counter("wasmcustom.kvmesh.fail_open.timeout").await?,
        ))
    }

    /// Bytes Envoy has read from the clients of the kvmesh listener
    /// (`http.agents.downstream_cx_rx_bytes_total`), counted at each read.
    pub async fn envoy_bytes_read(&self) -> anyhow::Result<u64> {
        self.envoy_counter("http.agents.downstream_cx_rx_bytes_total").await
    }

    /// Polls until Envoy has read at least `bytes` from the clients of the
    /// kvmesh listener (`envoy_bytes_read`), or fails after `timeout`.
    /// Envoy reads a connection on one thread and hands each read to the
    /// filters before it reads again, so what a client sends after this
    /// reaches the filter in a later body callback than what was read
    /// before: a test can force where a body is split, however slowly Envoy
    /// is scheduled.
    pub async fn wait_for_envoy_to_read(&self, bytes: u64, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let read = self.envoy_bytes_read().await?;
            if read >= bytes {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("Envoy read {read} bytes from clients, not {bytes}, within {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// The sidecar's `/debug/workers` view.
    pub async fn sidecar_workers(&self) -> anyhow::Result<Vec<Value>> {
        let view: Value = self
            .http
            .get(format!("http://{}/debug/workers", self.sidecar_admin))
            .send()
            .await?
            .json()
            .await?;
        Ok(view["workers"].as_array().cloned().unwrap_or_default())
    }

    /// A sample from the sidecar's Prometheus `/metrics`, by its exact
    /// series name with labels, e.g. `kvmesh_reports_total{known="true"}`;
    /// 0 when the series is not exported (yet).
    pub async fn sidecar_metric(&self, series: &str) -> anyhow::Result<f64> {
        Ok(self.sidecar_sample(series).await?.unwrap_or(0.0))
    }

    /// Like `sidecar_metric`, but a series that is not exported is an error
    /// (so a zero is a real zero).
    pub async fn sidecar_metric_required(&self, series: String) -> anyhow::Result<f64> {
        self.sidecar_sample(&series)
            .await?
            .with_context(|| format!("no series {series} in the sidecar's /metrics"))
    }

    async fn sidecar_sample(&self, series: &str) -> anyhow::Result<Option<f64>> {
        Ok(self
            .sidecar_samples_at(self.sidecar_admin, series)
            .await?
            .first()
            .map(|(_, v)| *v))
    }

    /// Every sample of the sidecar at `admin` whose series starts with
    /// `prefix` (e.g. `kvmesh_picks_total{` for all reasons), with its
    /// series.
    pub async fn sidecar_samples_at(&self, admin: SocketAddr, prefix: &str) -> anyhow::Result<Vec<(String, f64)>> {
        let text = self
            .http
            .get(format!("http://{admin}/metrics"))
            .send()
            .await?
            .text()
            .await?;
        Ok(text
            .lines()
            .filter(|line| line.starts_with(prefix))
            .filter_map(|line| {
                let (series, value) = line.rsplit_once(' ')?;
                Some((series.to_owned(), value.trim().parse().ok()?))
            })
            .collect())
    }

    /// Polls until every worker's in-flight count is back to zero (outcome
    /// reports arrive just after the responses), or fails after `timeout`.
    pub async fn wait_for_no_in_flight(&self, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let workers = self.sidecar_workers().await?;
            if workers.iter().all(|w| w["in_flight"].as_u64() == Some(0)) {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("in-flight requests never drained: {workers:?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Kills the sidecar (SIGKILL) and waits for it to be gone.
    pub fn kill_sidecar(&mut self) -> anyhow::Result<()> {
        self.sidecar.kill()
    }

    /// Kills the worker listening on `addr` ("ip:port", as replies name it).
    pub fn kill_worker_at(&mut self, addr: &str) -> anyhow::Result<()> {
        let worker = self
            .workers
            .iter_mut()
            .find(|w| w.addr.to_string() == addr)
            .with_context(|| format!("unknown worker {addr}"))?;
        worker.process.kill()
    }

    /// Starts worker `index` again, a new process on its old address: its
    /// cache starts empty, as a restarted engine's does.
    pub fn restart_worker(&mut self, index: usize) -> anyhow::Result<()> {
        let addr = self.workers.get(index).context("no such worker")?.addr;
        let worker = match &self.engine {
            Engine::Sim => spawn_worker(index, addr, &self.sim_args, self.profile, &self.dir)?,
            Engine::Vllm(options) => {
                let name = format!("worker{index}-restarted");
                let options = VllmOptions {
                    kv_events_endpoint: self
                        .kv_endpoints
                        .get(index)
                        .cloned()
                        .flatten()
                        .or_else(|| options.kv_events_endpoint.clone()),
                    ..options.clone()
                };
                let vllm = VllmWorker::start_at(&name, &self.dir, addr.port(), &options)?;
                Worker {
                    addr: vllm.addr,
                    process: vllm.process,
                }
            }
        };
        self.workers[index] = worker;
        Ok(())
    }

    /// Worker `index`'s own Prometheus `/metrics` text.
    pub async fn worker_metrics(&self, index: usize) -> anyhow::Result<String> {
        let addr = self.workers.get(index).context("no such worker")?.addr;
        Ok(self
            .http
            .get(format!("http://{addr}/metrics"))
            .send()
            .await?
            .error_for_status()?
            .text()
            .await?)
    }

    /// Requests each vLLM worker has finished, by its own count
    /// (`vllm:request_success_total` over every finish reason).
    /// A worker whose metrics cannot be read (killed, restarting) counts 0.
    pub async fn engine_requests_finished(&self) -> anyhow::Result<Vec<f64>> {
        let mut counts = Vec::new();
        for index in 0..self.workers.len() {
            let text = self.worker_metrics(index).await.unwrap_or_default();
            counts.push(vllm::metric_sum(&text, "vllm:request_success_total").unwrap_or(0.0));
        }
        Ok(counts)
    }

    /// Which worker finished exactly one more request than in `before`
    /// (`engine_requests_finished`): how a test learns where a call to
    /// real engines went, since vLLM does not name itself in a reply. The
    /// count can follow the reply by a moment, so it is polled.
    pub async fn engine_that_served(&self, before: &[f64], timeout: Duration) -> anyhow::Result<usize> {
        let deadline = Instant::now() + timeout;
        loop {
            let now = self.engine_requests_finished().await?;
            let grew: Vec<usize> = (0..now.len())
                .filter(|i| now[*i] > before.get(*i).copied().unwrap_or(0.0))
                .collect();
            let added: f64 = grew
                .iter()
                .map(|i| now[*i] - before.get(*i).copied().unwrap_or(0.0))
                .sum();
            match grew.as_slice() {
                [one] if added == 1.0 => return Ok(*one),
                [] => {}
                _ => bail!("more than one request finished: {before:?} -> {now:?}"),
            }
            if Instant::now() > deadline {
                bail!("no worker finished the request within {timeout:?}: {before:?} -> {now:?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Starts a fresh sidecar on the same gRPC address as before.
    pub fn restart_sidecar(&mut self) -> anyhow::Result<()> {
        let addrs: Vec<SocketAddr> = self.workers.iter().map(|w| w.addr).collect();
        let (sidecar, grpc, admin) =
            start_sidecar(&self.dir, self.profile, self.sidecar_grpc, &addrs, &self.sidecar_args)?;
        self.sidecar = sidecar;
        self.sidecar_grpc = grpc;
        self.sidecar_admin = admin;
        Ok(())
    }
}

/// Reads `read` until it returns `expected`, or until `timeout` has passed,
/// and returns the last value read, for the caller to assert on. For
/// counters that trail the replies a test waited for: an Outcome reaches
/// the sidecar just after its response, and the sidecar releases the pick
/// (what `wait_for_no_in_flight` sees) a moment before it counts the
/// report. The deadline only bounds the wait for a value that never comes.
pub async fn settled<T, F, Fut>(expected: &T, timeout: Duration, mut read: F) -> anyhow::Result<T>
where
    T: PartialEq,
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        let value = read().await?;
        if value == *expected || Instant::now() > deadline {
            return Ok(value);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn wait_for_admin(envoy: &Process, path: &std::path::Path, http: &reqwest::Client) -> anyhow::Result<String> {
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        if let Ok(addr) = std::fs::read_to_string(path)
            && !addr.trim().is_empty()
        {
            let admin = format!("http://{}", addr.trim());
            if let Ok(response) = http.get(format!("{admin}/ready")).send().await
                && response.status().is_success()
            {
                return Ok(admin);
            }
        }
        if Instant::now() > deadline {
            bail!("Envoy did not become ready:\n{}", envoy.log_tail());
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

async fn listener_port(http: &reqwest::Client, admin: &str, name: &str) -> anyhow::Result<u16> {
    let listeners: Value = http
        .get(format!("{admin}/listeners?format=json"))
        .send()
        .await?
        .json()
        .await?;
    let port = listeners["listener_statuses"]
        .as_array()
        .and_then(|all| all.iter().find(|l| l["name"] == name))
        .and_then(|l| l.pointer("/local_address/socket_address/port_value"))
        .and_then(Value::as_u64)
        .with_context(|| format!("no listener {name} in {listeners}"))?;
    Ok(u16::try_from(port)?)
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.envoy.stop();
        self.sidecar.stop();
        for replica in &mut self.more_sidecars {
            replica.process.stop();
        }
        for worker in &mut self.workers {
            worker.process.stop();
        }
        if let Some(redis) = &mut self.redis {
            let _ = redis.kill();
        }
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        } else {
            eprintln!("kvmesh test logs kept in {}", self.dir.display());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(body: &str) -> Reply {
        Reply {
            status: 200,
            worker: None,
            saw_destination: None,
            worker_body_sha256: None,
            worker_body_bytes: None,
            body: body.to_owned(),
            latency: Duration::ZERO,
            first_token: None,
        }
    }

    /// A stream as the sim sends it: the role chunk, tokens, the stop
    /// chunk, the usage chunk, `[DONE]`.
    const STREAM: &str = concat!(
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"[w0] \"}}]}\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":null}\n\n",
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":941,\"prompt_tokens_details\":{\"cached_tokens\":928}}}\n\n",
        "data: [DONE]\n\n",
    );

    #[test]
    fn only_chunks_with_text_or_tool_calls_carry_a_token() {
        let carrying: Vec<bool> = STREAM.lines().map(carries_output_token).collect();
        assert_eq!(carrying.iter().filter(|c| **c).count(), 1, "{carrying:?}");
        assert!(carries_output_token(
            "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}"
        ));
        assert!(carries_output_token(
            "data:{\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0}]}}]}"
        ));
        assert!(!carries_output_token(
            "data: {\"choices\":[{\"delta\":{\"content\":null}}]}"
        ));
        assert!(!carries_output_token("event: ping"));
        assert!(!carries_output_token("data: {not json"));
    }

    #[test]
    fn usage_is_read_from_a_json_or_a_streamed_reply() {
        let streamed = reply(STREAM);
        assert_eq!(streamed.prompt_tokens(), Some(941));
        assert_eq!(streamed.cached_tokens(), Some(928));
        let json = reply(r#"{"usage":{"prompt_tokens":5,"prompt_tokens_details":{"cached_tokens":2}}}"#);
        assert_eq!((json.prompt_tokens(), json.cached_tokens()), (Some(5), Some(2)));
        assert_eq!(reply("data: {\"choices\":[]}\n\ndata: [DONE]\n\n").usage(), None);
    }
}
