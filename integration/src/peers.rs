//! Real peer routers, run as they ship, in front of the same workers as
//! kvmesh: for now the SGLang Model Gateway (`smg`, the Rust router that
//! succeeded `sglang-router`), as `./dev setup-peers` installs it into
//! `.tools/peers/smg` (integration/peers/setup.sh). Bound to loopback only,
//! started under `setsid` and stopped by its pid like every other process of
//! the harness; ready when its own `/workers` lists every worker as ready.
//!
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

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::Value;

use crate::paths;
use crate::process::{Process, SpawnOptions};
use crate::vllm::{free_port, http_get};

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
}
