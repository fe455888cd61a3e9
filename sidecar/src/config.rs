//! The sidecar's settings, from flags, `KVMESH_*` environment variables and a
//! TOML file, in that order of precedence, then built-in defaults. All
//! problems are gathered and reported together.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Parser;
use serde::Deserialize;

pub(crate) const DEFAULT_GRPC_LISTEN: &str = "127.0.0.1:50051";
/// 9901 is Envoy's customary admin port; the sidecar takes the next one.
pub(crate) const DEFAULT_ADMIN_LISTEN: &str = "127.0.0.1:9902";

/// kvmesh-sidecar: KV-cache and session aware routing decisions for the
/// kvmesh Envoy filter, one per GPU cluster.
///
/// Every flag can also be set by its KVMESH_* environment variable or in the
/// TOML file given by --config (keys as the long flag names, with
/// underscores). Flags win over the environment, which wins over the file.
/// Ports may be 0; the bound addresses are printed on stdout.
#[derive(Debug, Parser)]
#[command(
    name = "kvmesh-sidecar",
    version,
    about,
    long_about,
    args_conflicts_with_subcommands = true
)]
pub struct Args {
    #[command(subcommand)]
    pub command: Option<Command>,

    /// TOML configuration file.
    #[arg(long, env = "KVMESH_CONFIG", value_name = "FILE")]
    pub(crate) config: Option<PathBuf>,

    /// Address of the gRPC API (Pick, Report, grpc.health.v1) [default: 127.0.0.1:50051].
    #[arg(long, env = "KVMESH_GRPC_LISTEN", value_name = "ADDR")]
    pub(crate) grpc_listen: Option<String>,

    /// Address of the admin HTTP server (/metrics, /healthz, /readyz, /debug/workers)
    /// [default: 127.0.0.1:9902].
    #[arg(long, env = "KVMESH_ADMIN_LISTEN", value_name = "ADDR")]
    pub(crate) admin_listen: Option<String>,

    /// A GPU worker as a literal ip:port, the form Envoy's override_host
    /// matches. Repeat the flag, or give a comma-separated list.
    #[arg(
        long = "worker",
        env = "KVMESH_WORKERS",
        value_name = "IP:PORT",
        value_delimiter = ','
    )]
    pub(crate) workers: Vec<String>,

    /// Workers as DNS names with a port (a Kubernetes headless Service),
    /// re-resolved every --dns-interval-secs; every address is a worker.
    #[arg(
        long = "worker-dns",
        env = "KVMESH_WORKER_DNS",
        value_name = "HOST:PORT",
        value_delimiter = ','
    )]
    pub(crate) worker_dns: Vec<String>,

    /// Subscribe to a worker's KV cache events (vLLM's ZeroMQ publisher):
    /// WORKER=tcp://IP:PORT binds a SUB socket there, which the engine's
    /// `--kv-events-config` endpoint connects to. Port 0 binds a free port;
    /// every bound endpoint is printed on stdout. Repeat the flag, or give a
    /// comma-separated list.
    #[arg(
        long = "kv-events",
        env = "KVMESH_KV_EVENTS",
        value_name = "WORKER=tcp://IP:PORT",
        value_delimiter = ','
    )]
    pub(crate) kv_events: Vec<String>,

    /// Seconds between DNS re-resolutions of --worker-dns [default: 10].
    #[arg(long, env = "KVMESH_DNS_INTERVAL_SECS", value_name = "SECS")]
    pub(crate) dns_interval_secs: Option<u64>,

    /// Prefix blocks each worker's KV cache holds before it evicts, until
    /// the engine's metrics say [default: 65536].
    #[arg(long, env = "KVMESH_WORKER_CAPACITY_BLOCKS", value_name = "N")]
    pub(crate) worker_capacity_blocks: Option<usize>,

    /// Memory the prefix index may use, in MiB; past it the fullest
    /// worker's oldest blocks are forgotten first [default: 1024].
    #[arg(long, env = "KVMESH_INDEX_BUDGET_MB", value_name = "MIB")]
    pub(crate) index_budget_mb: Option<usize>,

    /// A worker's prefill throughput in tokens per millisecond until its
    /// responses teach its own [default: 10, about an H100 on a 30B model].
    #[arg(long, env = "KVMESH_PREFILL_TOKENS_PER_MS", value_name = "N")]
    pub(crate) prefill_tokens_per_ms: Option<f64>,

    /// A session idle this long is over [default: 1800].
    #[arg(long, env = "KVMESH_SESSION_TTL_SECS", value_name = "SECS")]
    pub(crate) session_ttl_secs: Option<u64>,

    /// Milliseconds between scrapes of each worker's metrics; 0 turns the
    /// engine watcher off [default: 1000].
    #[arg(long, env = "KVMESH_SCRAPE_INTERVAL_MS", value_name = "MS")]
    pub(crate) scrape_interval_ms: Option<u64>,

    /// Path of the engines' Prometheus metrics [default: /metrics].
    #[arg(long, env = "KVMESH_METRICS_PATH", value_name = "PATH")]
    pub(crate) metrics_path: Option<String>,

    /// Redis URL shared by the replicas of this GPU cluster (e.g.
    /// redis://redis:6379/0). Without it, state lives in memory only.
    #[arg(long, env = "KVMESH_REDIS", value_name = "URL")]
    pub(crate) redis: Option<String>,

    /// Name of this GPU cluster: scopes every Redis key [default: default].
    #[arg(long, env = "KVMESH_CLUSTER", value_name = "NAME")]
    pub(crate) cluster: Option<String>,

    /// Seconds between snapshots written to Redis for warm restarts
    /// [default: 30].
    #[arg(long, env = "KVMESH_SNAPSHOT_INTERVAL_SECS", value_name = "SECS")]
    pub(crate) snapshot_interval_secs: Option<u64>,

    /// A shared secret: when set, gRPC calls must carry
    /// `authorization: Bearer <token>` (the filter's `sidecar_token`), and so
    /// must the admin pages except /healthz and /readyz.
    #[arg(long, env = "KVMESH_TOKEN", value_name = "SECRET", hide_env_values = true)]
    pub(crate) token: Option<String>,

    /// KV-cache bytes one token holds on a GPU, for the retention cost of
    /// idle sessions: 2 × layers × KV heads × head size × bytes per value
    /// [default: 98304, a 48-layer model with 4 KV heads of 128 in bf16].
    #[arg(long, env = "KVMESH_KV_BYTES_PER_TOKEN", value_name = "BYTES")]
    pub(crate) kv_bytes_per_token: Option<f64>,

    /// Tenants given their own metric label; later ones are labelled
    /// "other" [default: 16].
    #[arg(long, env = "KVMESH_TENANT_LABELS", value_name = "N")]
    pub(crate) tenant_labels: Option<usize>,

    /// Milliseconds the sidecar may take to stop after SIGTERM or SIGINT:
    /// it stops routing and ends its streams at once, then flushes Redis and
    /// writes its snapshot; past this it exits regardless. A second signal
    /// exits at once [default: 5000].
    #[arg(long, env = "KVMESH_SHUTDOWN_GRACE_MS", value_name = "MS")]
    pub(crate) shutdown_grace_ms: Option<u64>,

    /// Log filter, e.g. "info" or "kvmesh_sidecar=debug" [default: info].
    #[arg(long, env = "KVMESH_LOG", value_name = "FILTER")]
    pub(crate) log: Option<String>,
}

/// Commands other than serving.
#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Print what agents gained over a window, per tenant and harness:
    /// tokens computed and reused, the GPU time saved, the cost of keeping
    /// idle sessions warm, the top prefix breakers, and per harness the
    /// return gaps, the hit rate kept, what more KV per worker would save
    /// (an estimate) and, given prices, the managed-API cost. Reads a
    /// running sidecar's admin port.
    Report(ReportArgs),
}

#[derive(Debug, clap::Args)]
pub struct ReportArgs {
    /// Admin URL of the sidecar.
    #[arg(
        long,
        env = "KVMESH_ADMIN_URL",
        default_value = "http://127.0.0.1:9902",
        value_name = "URL"
    )]
    pub(crate) admin: String,

    /// The window: seconds, or a number with s, m, h or d.
    #[arg(long, default_value = "1h", value_parser = parse_window, value_name = "DURATION")]
    pub(crate) window: std::time::Duration,

    /// The sidecar's --token, if it has one.
    #[arg(long, env = "KVMESH_TOKEN", value_name = "SECRET", hide_env_values = true)]
    pub(crate) token: Option<String>,

    /// Print the report as JSON instead of tables.
    #[arg(long)]
    pub(crate) json: bool,

    /// GB (10^9 bytes) of extra KV per worker to estimate the savings of.
    #[arg(long, default_value_t = crate::retention_report::DEFAULT_EXTRA_KV_GB, value_parser = parse_amount, value_name = "GB")]
    pub(crate) extra_kv_gb: f64,

    /// A managed API's input price, USD per million tokens: prices the same
    /// traffic (from your provider's price list; no default).
    #[arg(long, value_parser = parse_amount, value_name = "USD")]
    pub(crate) price_input: Option<f64>,

    /// Its price of cached input tokens, USD per million.
    #[arg(long, value_parser = parse_amount, value_name = "USD")]
    pub(crate) price_cached_input: Option<f64>,

    /// Its output price, USD per million tokens. The ledger does not count
    /// output tokens yet, so the report says it is not applied.
    #[arg(long, value_parser = parse_amount, value_name = "USD")]
    pub(crate) price_output: Option<f64>,
}

/// A price or a size: a finite number, zero or more.
pub(crate) fn parse_amount(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(x) if x.is_finite() && x >= 0.0 => Ok(x),
        _ => Err(format!("{text:?} is not a number of zero or more")),
    }
}

/// "90", "90s", "15m", "1h", "2d".
pub(crate) fn parse_window(text: &str) -> Result<std::time::Duration, String> {
    let text = text.trim();
    let (number, unit) = text
        .find(|c: char| !c.is_ascii_digit())
        .map_or((text, ""), |at| text.split_at(at));
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a duration such as 90s, 15m, 1h or 2d"))?;
    let seconds = match unit {
        "" | "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => return Err(format!("{text:?}: the unit must be s, m, h or d")),
    };
    Ok(std::time::Duration::from_secs(n.saturating_mul(seconds)))
}

/// `WORKER=tcp://IP:PORT`: the worker's ip:port and where to bind its SUB
/// socket (an IP literal: the socket binds, it resolves nothing).
fn parse_kv_events(text: &str) -> Result<(SocketAddr, SocketAddr), String> {
    let (worker, endpoint) = text.split_once('=').ok_or("expected WORKER=tcp://IP:PORT")?;
    let worker = worker
        .trim()
        .parse::<SocketAddr>()
        .map_err(|_| format!("worker {worker:?} is not a literal ip:port"))?;
    let bind = endpoint
        .trim()
        .strip_prefix("tcp://")
        .and_then(|addr| addr.parse::<SocketAddr>().ok())
        .ok_or_else(|| format!("endpoint {endpoint:?} is not tcp://IP:PORT"))?;
    Ok((worker, bind))
}

/// The TOML file: the same settings as the flags.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    grpc_listen: Option<String>,
    admin_listen: Option<String>,
    #[serde(default)]
    workers: Vec<String>,
    #[serde(default)]
    worker_dns: Vec<String>,
    dns_interval_secs: Option<u64>,
    #[serde(default)]
    kv_events: Vec<String>,
    worker_capacity_blocks: Option<usize>,
    index_budget_mb: Option<usize>,
    prefill_tokens_per_ms: Option<f64>,
    session_ttl_secs: Option<u64>,
    scrape_interval_ms: Option<u64>,
    metrics_path: Option<String>,
    redis: Option<String>,
    cluster: Option<String>,
    snapshot_interval_secs: Option<u64>,
    token: Option<String>,
    kv_bytes_per_token: Option<f64>,
    tenant_labels: Option<usize>,
    shutdown_grace_ms: Option<u64>,
    log: Option<String>,
}

/// Validated settings.
#[derive(Debug, Clone)]
pub struct Settings {
    pub(crate) grpc_listen: SocketAddr,
    pub(crate) admin_listen: SocketAddr,
    pub(crate) workers: Vec<SocketAddr>,
    pub(crate) worker_dns: Vec<String>,
    pub(crate) dns_interval: std::time::Duration,
    /// Workers whose KV events are read, and where each SUB socket binds.
    pub(crate) kv_events: Vec<(SocketAddr, SocketAddr)>,
    pub(crate) worker_capacity_blocks: usize,
    pub(crate) index_budget_bytes: usize,
    pub(crate) prefill_tokens_per_ms: f64,
    pub(crate) session_ttl_secs: u64,
    /// `None` when the engine watcher is off.
    pub(crate) scrape_interval: Option<std::time::Duration>,
    pub(crate) metrics_path: String,
    pub(crate) redis: Option<String>,
    pub(crate) cluster: String,
    pub(crate) snapshot_interval: std::time::Duration,
    pub(crate) token: Option<String>,
    pub(crate) kv_bytes_per_token: f64,
    pub(crate) tenant_labels: usize,
    pub(crate) shutdown_grace: std::time::Duration,
    pub log: String,
}

#[derive(Debug, thiserror::Error)]
#[error("invalid configuration:\n  - {}", .0.join("\n  - "))]
pub struct ConfigErrors(Vec<String>);

impl Settings {
    pub fn resolve(args: Args) -> Result<Self, ConfigErrors> {
        let mut errors = Vec::new();
        let file = match &args.config {
            None => FileConfig::default(),
            Some(path) => match std::fs::read_to_string(path) {
                Ok(text) => toml::from_str(&text).unwrap_or_else(|err| {
                    errors.push(format!("{}: {err}", path.display()));
                    FileConfig::default()
                }),
                Err(err) => {
                    errors.push(format!("cannot read {}: {err}", path.display()));
                    FileConfig::default()
                }
            },
        };
        let mut addr = |name: &str, value: Option<String>, default: &str| {
            let text = value.unwrap_or_else(|| default.to_owned());
            text.parse::<SocketAddr>().unwrap_or_else(|_| {
                errors.push(format!("{name}: {text:?} is not an ip:port address"));
                SocketAddr::from(([127, 0, 0, 1], 0))
            })
        };
        let grpc_listen = addr(
            "grpc_listen",
            args.grpc_listen.or(file.grpc_listen),
            DEFAULT_GRPC_LISTEN,
        );
        let admin_listen = addr(
            "admin_listen",
            args.admin_listen.or(file.admin_listen),
            DEFAULT_ADMIN_LISTEN,
        );
        let worker_texts = if args.workers.is_empty() {
            file.workers
        } else {
            args.workers
        };
        let mut workers = Vec::new();
        for text in worker_texts.iter().map(|w| w.trim()).filter(|w| !w.is_empty()) {
            match text.parse::<SocketAddr>() {
                Ok(addr) if workers.contains(&addr) => errors.push(format!("worker {text} is listed twice")),
                Ok(addr) => workers.push(addr),
                Err(_) => errors.push(format!(
                    "worker {text:?} is not a literal ip:port (Envoy's override_host never matches host names)"
                )),
            }
        }
        let worker_dns: Vec<String> = if args.worker_dns.is_empty() {
            file.worker_dns
        } else {
            args.worker_dns
        };
        for name in &worker_dns {
            if name
                .rsplit_once(':')
                .is_none_or(|(host, port)| host.is_empty() || port.parse::<u16>().is_err())
            {
                errors.push(format!("worker_dns {name:?} is not HOST:PORT"));
            }
        }
        if workers.is_empty() && worker_dns.is_empty() {
            errors.push(
                "no workers: give --worker IP:PORT or --worker-dns HOST:PORT (or KVMESH_WORKERS / KVMESH_WORKER_DNS, or the file)"
                    .to_owned(),
            );
        }
        let kv_event_texts = if args.kv_events.is_empty() {
            file.kv_events
        } else {
            args.kv_events
        };
        let mut kv_events: Vec<(SocketAddr, SocketAddr)> = Vec::new();
        for text in kv_event_texts.iter().map(|t| t.trim()).filter(|t| !t.is_empty()) {
            match parse_kv_events(text) {
                Ok((worker, _)) if kv_events.iter().any(|(w, _)| *w == worker) => {
                    errors.push(format!("kv_events: worker {worker} is listed twice"));
                }
                Ok((worker, _)) if worker_dns.is_empty() && !workers.contains(&worker) => {
                    errors.push(format!("kv_events: {worker} is not one of the workers"));
                }
                Ok(pair) => kv_events.push(pair),
                Err(err) => errors.push(format!("kv_events {text:?}: {err}")),
            }
        }
        let prefill_tokens_per_ms = args
            .prefill_tokens_per_ms
            .or(file.prefill_tokens_per_ms)
            .unwrap_or(10.0);
        if !(prefill_tokens_per_ms.is_finite() && prefill_tokens_per_ms > 0.0) {
            errors.push("prefill_tokens_per_ms must be a positive number".to_owned());
        }
        let metrics_path = args
            .metrics_path
            .or(file.metrics_path)
            .unwrap_or_else(|| "/metrics".to_owned());
        if !metrics_path.starts_with('/') {
            errors.push(format!("metrics_path {metrics_path:?} must start with /"));
        }
        let redis = args.redis.or(file.redis).filter(|r| !r.trim().is_empty());
        if let Some(url) = &redis
            && !(url.starts_with("redis://") || url.starts_with("rediss://") || url.starts_with("unix://"))
        {
            errors.push(format!("redis {url:?} is not a redis:// URL"));
        }
        let cluster = args.cluster.or(file.cluster).unwrap_or_else(|| "default".to_owned());
        if cluster.is_empty() || !cluster.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) {
            errors.push(format!("cluster {cluster:?} must be letters, digits, '-', '_' or '.'"));
        }
        let scrape_ms = args.scrape_interval_ms.or(file.scrape_interval_ms).unwrap_or(1000);
        let worker_capacity_blocks = args
            .worker_capacity_blocks
            .or(file.worker_capacity_blocks)
            .unwrap_or(64 * 1024);
        if worker_capacity_blocks == 0 {
            errors.push("worker_capacity_blocks must be at least 1".to_owned());
        }
        let index_budget_mb = args.index_budget_mb.or(file.index_budget_mb).unwrap_or(1024);
        if index_budget_mb < 4 {
            errors.push("index_budget_mb must be at least 4".to_owned());
        }
        let kv_bytes_per_token = args.kv_bytes_per_token.or(file.kv_bytes_per_token).unwrap_or(98_304.0);
        if !(kv_bytes_per_token.is_finite() && kv_bytes_per_token > 0.0) {
            errors.push("kv_bytes_per_token must be a positive number".to_owned());
        }
        let tenant_labels = args.tenant_labels.or(file.tenant_labels).unwrap_or(16);
        if tenant_labels > 1000 {
            errors.push("tenant_labels must be at most 1000 (each is a metric series per harness)".to_owned());
        }
        if !errors.is_empty() {
            return Err(ConfigErrors(errors));
        }
        Ok(Self {
            grpc_listen,
            admin_listen,
            workers,
            worker_dns,
            kv_events,
            dns_interval: std::time::Duration::from_secs(
                args.dns_interval_secs.or(file.dns_interval_secs).unwrap_or(10).max(1),
            ),
            worker_capacity_blocks,
            index_budget_bytes: index_budget_mb.saturating_mul(1 << 20),
            prefill_tokens_per_ms,
            session_ttl_secs: args.session_ttl_secs.or(file.session_ttl_secs).unwrap_or(1800),
            scrape_interval: (scrape_ms > 0).then(|| std::time::Duration::from_millis(scrape_ms)),
            metrics_path,
            redis,
            cluster,
            snapshot_interval: std::time::Duration::from_secs(
                args.snapshot_interval_secs
                    .or(file.snapshot_interval_secs)
                    .unwrap_or(30)
                    .max(1),
            ),
            token: args.token.or(file.token).filter(|t| !t.is_empty()),
            kv_bytes_per_token,
            tenant_labels,
            shutdown_grace: std::time::Duration::from_millis(
                args.shutdown_grace_ms.or(file.shutdown_grace_ms).unwrap_or(5000),
            ),
            log: args.log.or(file.log).unwrap_or_else(|| "info".to_owned()),
        })
    }
}
