//! A real vLLM (its CPU build) as a worker, serving the tiny random-weight
//! Llama that `./dev setup-vllm` builds into `.tools/vllm-model`
//! (docs/vllm.md): real prefix caching in 128-token blocks, real `usage`,
//! real `/metrics`, optionally real KV events and priority scheduling.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::paths;
use crate::process::{Process, SpawnOptions};

/// The name the workers serve the model under: requests' `model`.
pub const SERVED_MODEL: &str = "kvmesh-tiny";

/// Tokens per KV block of vLLM's CPU backend. Only full blocks are cached,
/// so every `cached_tokens` it reports is a multiple of this.
pub const BLOCK_SIZE_TOKENS: u64 = 128;

/// A start that binds a port someone took between our probe and vLLM's
/// bind is tried again on another, this many times in all.
const BIND_ATTEMPTS: usize = 3;

/// The default `VllmOptions::ready_timeout`: twice the slowest start
/// measured (132 s, the first after an install, at load 8) and over 5 times
/// a warm start at load 5-6 (45 s). Starts sharing the cores get it per
/// pair of them (`Cluster`).
pub const READY_TIMEOUT: Duration = Duration::from_secs(240);

/// How long one readiness or metrics GET may take: a loaded machine can
/// hold a busy API server's answer for seconds; the poll tries again.
const GET_TIMEOUT: Duration = Duration::from_secs(10);

/// How to start one vLLM.
#[derive(Debug, Clone)]
pub struct VllmOptions {
    /// KV capacity in 128-token blocks (`--num-gpu-blocks-override`); it
    /// must hold `max_model_len`.
    pub blocks: u32,
    /// `--max-model-len`: prompt plus completion, in tokens.
    pub max_model_len: u32,
    /// Publish KV events (ZMQ PUB) to this endpoint, e.g.
    /// `tcp://127.0.0.1:5557`. vLLM *connects* to a plain `tcp://host:port`,
    /// so the caller binds it first; events sent before it is up are lost.
    pub kv_events_endpoint: Option<String>,
    /// `--scheduling-policy priority`: a request's `priority` (lower runs
    /// first) orders the queue.
    pub priority_scheduling: bool,
    /// `--max-num-seqs`: how many requests run at once.
    pub max_num_seqs: Option<u32>,
    /// More `api_server` flags.
    pub extra_args: Vec<String>,
    /// More environment, e.g. `VLLM_SERVER_DEV_MODE=1` for
    /// `/reset_prefix_cache`.
    pub extra_env: Vec<(String, String)>,
    /// How long the start may take before it is a failure: only a bound on
    /// a hang (a start that fails exits, and is reported at once), so far
    /// above the normal time. Measured on 2 shared cores: 21-45 s warm,
    /// 132 s on the first start after an install while Python compiles the
    /// bytecode at load 8 (docs/vllm.md); at load 8 everything may be about
    /// 4 times slower than alone.
    pub ready_timeout: Duration,
}

impl Default for VllmOptions {
    fn default() -> Self {
        Self {
            blocks: 64,
            max_model_len: 4096,
            kv_events_endpoint: None,
            priority_scheduling: false,
            max_num_seqs: None,
            extra_args: Vec::new(),
            extra_env: Vec::new(),
            ready_timeout: READY_TIMEOUT,
        }
    }
}

/// Where `./dev setup-vllm` put the engine and the model.
#[derive(Debug, Clone)]
pub struct VllmInstall {
    pub python: PathBuf,
    pub model: PathBuf,
}

impl VllmInstall {
    /// The install under `.tools/`, or an error saying how to make it.
    pub fn find() -> anyhow::Result<Self> {
        let tools = paths::repo_root().join(".tools");
        let install = Self {
            python: tools.join("vllm/bin/python"),
            model: tools.join("vllm-model"),
        };
        // The stamps are written last: without one the step did not finish.
        if !tools.join("vllm/.kvmesh-installed").is_file() || !install.python.is_file() {
            bail!(
                "vLLM is not installed in {}: run ./dev setup-vllm",
                tools.join("vllm").display()
            );
        }
        if !install.model.join(".kvmesh-inputs").is_file() {
            bail!(
                "the tiny model is not built in {}: run ./dev setup-vllm",
                install.model.display()
            );
        }
        Ok(install)
    }
}

/// A running vLLM API server (with its engine-core and worker processes,
/// stopped together by its pid's process group).
#[derive(Debug)]
pub struct VllmWorker {
    pub addr: SocketAddr,
    pub process: Process,
    /// From spawn to the first healthy `/health` (and `/v1/models`).
    pub ready_after: Duration,
}

impl VllmWorker {
    /// Starts a vLLM on a free loopback port and waits until it serves.
    /// Its log is `dir/<name>.log`.
    pub fn start(name: &str, dir: &Path, options: &VllmOptions) -> anyhow::Result<Self> {
        let mut last = None;
        for _ in 0..BIND_ATTEMPTS {
            // vLLM takes a port number, not a listener: learn a free one and
            // release it, and try again if another process wins it first.
            let port = free_port()?;
            match Self::start_on(name, dir, port, options) {
                Ok(worker) => return Ok(worker),
                Err(StartError::PortTaken(error)) => last = Some(error),
                Err(StartError::Other(error)) => return Err(error),
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("no attempt to start {name}")))
            .context(format!("{name}: the port was taken {BIND_ATTEMPTS} times"))
    }

    /// Starts a vLLM on `127.0.0.1:port` (e.g. a restart on the old port).
    pub fn start_at(name: &str, dir: &Path, port: u16, options: &VllmOptions) -> anyhow::Result<Self> {
        Self::start_on(name, dir, port, options).map_err(StartError::into_inner)
    }

    fn start_on(name: &str, dir: &Path, port: u16, options: &VllmOptions) -> Result<Self, StartError> {
        let install = VllmInstall::find()?;
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let started = Instant::now();
        let mut process = Process::spawn_with(
            name,
            &install.python,
            &server_args(&install.model, port, options)?,
            &SpawnOptions {
                env: [
                    // Nothing may come from a hub: the model is local.
                    ("HF_HUB_OFFLINE".into(), "1".into()),
                    ("TRANSFORMERS_OFFLINE".into(), "1".into()),
                    // GiB for the KV cache; the block override sets the
                    // capacity actually used.
                    ("VLLM_CPU_KVCACHE_SPACE".into(), "1".into()),
                    ("VLLM_NO_USAGE_STATS".into(), "1".into()),
                    // With the `uni` executor below: see there.
                    ("VLLM_ENABLE_V1_MULTIPROCESSING".into(), "0".into()),
                    ("DO_NOT_TRACK".into(), "1".into()),
                ]
                .into_iter()
                .chain(options.extra_env.iter().cloned())
                .collect(),
                // vLLM logs to stdout; readiness is its /health.
                stdout_to_log: true,
                group: true,
            },
            dir,
        )?;
        let deadline = started + options.ready_timeout;
        loop {
            if let Ok(Some(status)) = process.wait_exit(Duration::ZERO) {
                let log = process.log();
                let tail = process.log_tail();
                let error = anyhow::anyhow!("{name} exited ({status}) before it was ready:\n{tail}");
                return Err(if log.contains("Address already in use") || log.contains("Errno 98") {
                    StartError::PortTaken(error)
                } else {
                    StartError::Other(error)
                });
            }
            // Healthy, and serving our model: not some other server that
            // won the port after vLLM failed to bind it.
            if matches!(http_get(addr, "/health"), Ok((200, _)))
                && matches!(http_get(addr, "/v1/models"), Ok((200, body)) if body.contains(SERVED_MODEL))
            {
                return Ok(Self {
                    addr,
                    process,
                    ready_after: started.elapsed(),
                });
            }
            if Instant::now() >= deadline {
                return Err(StartError::Other(anyhow::anyhow!(
                    "{name} was not ready within {:?}; its log is {}:\n{}",
                    options.ready_timeout,
                    dir.join(format!("{name}.log")).display(),
                    process.log_tail()
                )));
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

enum StartError {
    PortTaken(anyhow::Error),
    Other(anyhow::Error),
}

impl StartError {
    fn into_inner(self) -> anyhow::Error {
        match self {
            Self::PortTaken(error) | Self::Other(error) => error,
        }
    }
}

impl From<anyhow::Error> for StartError {
    fn from(error: anyhow::Error) -> Self {
        Self::Other(error)
    }
}

/// The `python` arguments that start the API server.
fn server_args(model: &Path, port: u16, options: &VllmOptions) -> anyhow::Result<Vec<String>> {
    if u64::from(options.blocks) * BLOCK_SIZE_TOKENS < u64::from(options.max_model_len) {
        bail!(
            "{} blocks of {BLOCK_SIZE_TOKENS} tokens cannot hold max_model_len {}",
            options.blocks,
            options.max_model_len
        );
    }
    // The `vllm` console script fails in this install (its distribution is
    // `vllm-cpu`, and it looks itself up as `vllm`); the module works.
    let mut args: Vec<String> = [
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        &model.display().to_string(),
        "--served-model-name",
        SERVED_MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        &port.to_string(),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--max-model-len",
        &options.max_model_len.to_string(),
        "--dtype",
        "float32",
        "--enforce-eager",
        // The model runs in the engine-core process instead of a third
        // process of its own: one torch import (~1 GB, a third of the
        // start's CPU) fewer; the scheduler and KV cache manager are the
        // same. On CPU vLLM turns `uni` back into `mp` unless
        // VLLM_ENABLE_V1_MULTIPROCESSING=0, and then no longer pins the
        // model's OpenMP threads to a core.
        "--distributed-executor-backend",
        "uni",
        "--num-gpu-blocks-override",
        &options.blocks.to_string(),
    ]
    .into_iter()
    .map(str::to_owned)
    .collect();
    if let Some(endpoint) = &options.kv_events_endpoint {
        let config = serde_json::json!({
            "enable_kv_cache_events": true,
            "publisher": "zmq",
            "endpoint": endpoint,
            "topic": "kv",
        });
        args.extend(["--kv-events-config".to_owned(), config.to_string()]);
    }
    if options.priority_scheduling {
        args.extend(["--scheduling-policy".to_owned(), "priority".to_owned()]);
    }
    if let Some(n) = options.max_num_seqs {
        args.extend(["--max-num-seqs".to_owned(), n.to_string()]);
    }
    args.extend(options.extra_args.iter().cloned());
    Ok(args)
}

/// A loopback port that was free a moment ago.
pub fn free_port() -> anyhow::Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").context("binding 127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}

/// The lowest port `free_port_outside_ephemeral` hands out.
const FIXED_PORTS_LOW: u16 = 20_000;
/// The first port of Linux's default ephemeral range
/// (`net.ipv4.ip_local_port_range`).
const EPHEMERAL_LOW: u16 = 32_768;

/// A loopback port below the kernel's ephemeral range (32768 and up, where
/// `free_port` and every outgoing connection's source port come from), free
/// when probed and never handed out before by this process. For a port that
/// must stay free from the probe until much later: a KV-events endpoint is
/// fixed when its vLLM starts and bound by the sidecar minutes after (and
/// again at each sidecar restart); an ephemeral port was taken in that gap
/// once in about 20 deployments ("binding KV events … Address already in
/// use"). Also Dynamo 1.6.1's `DYN_SYSTEM_PORT`, which it parses as an
/// `i16`. Probed from a point that differs by process and call, so that
/// processes starting at once rarely try the same ports.
pub fn free_port_outside_ephemeral() -> anyhow::Result<u16> {
    static HANDED_OUT: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut handed_out = HANDED_OUT.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let calls = u32::try_from(handed_out.len())?;
    let start = std::process::id()
        .wrapping_mul(7_919)
        .wrapping_add(calls.wrapping_mul(389));
    let port = next_fixed_port(start, &handed_out, |port| {
        TcpListener::bind(("127.0.0.1", port)).is_ok()
    })
    .with_context(|| format!("no free loopback port in {FIXED_PORTS_LOW}..{EPHEMERAL_LOW}"))?;
    handed_out.push(port);
    Ok(port)
}

/// The first port from `start` (wrapping within
/// `FIXED_PORTS_LOW..EPHEMERAL_LOW`) not in `handed_out` and `free`.
fn next_fixed_port(start: u32, handed_out: &[u16], free: impl Fn(u16) -> bool) -> Option<u16> {
    let low = u32::from(FIXED_PORTS_LOW);
    let span = u32::from(EPHEMERAL_LOW) - low;
    (0..span)
        .filter_map(|i| u16::try_from(low + (start.wrapping_add(i)) % span).ok())
        .find(|port| !handed_out.contains(port) && free(*port))
}

/// A plain HTTP/1.1 GET, for readiness polls from threads without a
/// runtime: the status and the raw body (not de-chunked).
pub fn http_get(addr: SocketAddr, path: &str) -> anyhow::Result<(u16, String)> {
    let timeout = GET_TIMEOUT;
    let mut stream = TcpStream::connect_timeout(&addr, timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut reply = String::new();
    stream.read_to_string(&mut reply)?;
    let status = reply
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .with_context(|| format!("no HTTP status in {:?}", reply.chars().take(80).collect::<String>()))?;
    let body = reply.split_once("\r\n\r\n").map_or("", |(_, body)| body);
    Ok((status, body.to_owned()))
}

/// The sum over label sets of the samples named exactly `name` in a
/// Prometheus text exposition (e.g. `vllm:request_success_total` over
/// every finish reason); `None` when there is none.
pub fn metric_sum(text: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else { continue };
        if !(rest.starts_with('{') || rest.starts_with(' ')) {
            continue;
        }
        let value = rest.rsplit_once('}').map_or(rest, |(_, value)| value);
        if let Some(value) = value.split_whitespace().next().and_then(|v| v.parse::<f64>().ok()) {
            found = Some(found.unwrap_or(0.0) + value);
        }
    }
    found
}

/// The labels of the first sample named `name`, e.g. `vllm:cache_config_info`.
pub fn metric_labels(text: &str, name: &str) -> Option<Vec<(String, String)>> {
    let line = text
        .lines()
        .find(|line| line.strip_prefix(name).is_some_and(|r| r.starts_with('{')))?;
    let inner = line.get(name.len() + 1..)?.rsplit_once('}')?.0;
    let mut labels = Vec::new();
    // vLLM's values here hold no quotes or commas; a general reader lives in
    // the sidecar.
    for pair in inner.split("\",") {
        let (key, value) = pair.split_once("=\"")?;
        labels.push((key.to_owned(), value.trim_end_matches('"').to_owned()));
    }
    Some(labels)
}

#[cfg(test)]
mod tests {
    use super::*;

    const METRICS: &str = "# HELP vllm:request_success_total Count.\n\
        vllm:request_success_total{engine=\"0\",finished_reason=\"stop\",model_name=\"m\"} 2.0\n\
        vllm:request_success_total{engine=\"0\",finished_reason=\"length\",model_name=\"m\"} 19.0\n\
        vllm:request_success_created{engine=\"0\",finished_reason=\"stop\",model_name=\"m\"} 1.7e+09\n\
        vllm:cache_config_info{block_size=\"128\",num_gpu_blocks=\"64\",enable_prefix_caching=\"True\"} 1.0\n\
        process_start_time_seconds 1.79614346093e+09\n";

    #[test]
    fn metric_sum_adds_every_label_set_of_exactly_that_name() {
        assert_eq!(metric_sum(METRICS, "vllm:request_success_total"), Some(21.0));
        assert_eq!(
            metric_sum(METRICS, "process_start_time_seconds"),
            Some(1.796_143_460_93e9)
        );
        assert_eq!(metric_sum(METRICS, "vllm:request_success"), None);
    }

    #[test]
    fn metric_labels_reads_the_cache_config() {
        let labels = metric_labels(METRICS, "vllm:cache_config_info").unwrap_or_default();
        assert!(
            labels.contains(&("num_gpu_blocks".to_owned(), "64".to_owned())),
            "{labels:?}"
        );
        assert!(
            labels.contains(&("block_size".to_owned(), "128".to_owned())),
            "{labels:?}"
        );
    }

    #[test]
    fn fixed_ports_skip_ports_in_use_or_handed_out_and_stay_below_the_ephemeral_range() {
        let low = FIXED_PORTS_LOW;
        assert_eq!(next_fixed_port(0, &[], |_| true), Some(low));
        assert_eq!(next_fixed_port(0, &[low], |p| p != low + 1), Some(low + 2));
        // Wraps at 32768 back to the bottom of the range.
        let last = 32_768 - u32::from(low) - 1;
        assert_eq!(next_fixed_port(last, &[], |_| true), Some(32_767));
        assert_eq!(next_fixed_port(last, &[32_767], |_| true), Some(low));
        assert_eq!(next_fixed_port(7, &[], |_| false), None);
        let a = free_port_outside_ephemeral().unwrap_or(0);
        let b = free_port_outside_ephemeral().unwrap_or(0);
        assert!(
            (low..32_768).contains(&a) && (low..32_768).contains(&b) && a != b,
            "{a} {b}"
        );
    }

    #[test]
    fn a_cache_smaller_than_the_model_length_is_refused() {
        let options = VllmOptions {
            blocks: 8,
            max_model_len: 4096,
            ..VllmOptions::default()
        };
        assert!(server_args(Path::new("m"), 1, &options).is_err());
        let ok = server_args(Path::new("m"), 1, &VllmOptions::default()).unwrap_or_default();
        assert!(
            ok.windows(2).any(|w| w == ["--num-gpu-blocks-override", "64"]),
            "{ok:?}"
        );
    }
}
