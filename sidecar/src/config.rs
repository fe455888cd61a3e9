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
#[command(name = "kvmesh-sidecar", version, about, long_about)]
pub(crate) struct Args {
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

    /// Prefix blocks each worker's KV cache holds before it evicts [default: 65536].
    #[arg(long, env = "KVMESH_WORKER_CAPACITY_BLOCKS", value_name = "N")]
    pub(crate) worker_capacity_blocks: Option<usize>,

    /// Log filter, e.g. "info" or "kvmesh_sidecar=debug" [default: info].
    #[arg(long, env = "KVMESH_LOG", value_name = "FILTER")]
    pub(crate) log: Option<String>,
}

/// The TOML file: the same settings as the flags.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    grpc_listen: Option<String>,
    admin_listen: Option<String>,
    #[serde(default)]
    workers: Vec<String>,
    worker_capacity_blocks: Option<usize>,
    log: Option<String>,
}

/// Validated settings.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub(crate) grpc_listen: SocketAddr,
    pub(crate) admin_listen: SocketAddr,
    pub(crate) workers: Vec<SocketAddr>,
    pub(crate) worker_capacity_blocks: usize,
    pub(crate) log: String,
}

#[derive(Debug, thiserror::Error)]
#[error("invalid configuration:\n  - {}", .0.join("\n  - "))]
pub(crate) struct ConfigErrors(Vec<String>);

impl Settings {
    pub(crate) fn resolve(args: Args) -> Result<Self, ConfigErrors> {
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
        if workers.is_empty() {
            errors.push("no workers: give --worker IP:PORT (or KVMESH_WORKERS, or `workers` in the file)".to_owned());
        }
        let worker_capacity_blocks = args
            .worker_capacity_blocks
            .or(file.worker_capacity_blocks)
            .unwrap_or(64 * 1024);
        if worker_capacity_blocks == 0 {
            errors.push("worker_capacity_blocks must be at least 1".to_owned());
        }
        if !errors.is_empty() {
            return Err(ConfigErrors(errors));
        }
        Ok(Self {
            grpc_listen,
            admin_listen,
            workers,
            worker_capacity_blocks,
            log: args.log.or(file.log).unwrap_or_else(|| "info".to_owned()),
        })
    }
}
