//! A real Prometheus (Debian's package, which `./dev` installs) scraping a
//! deployment, and the shipped Grafana dashboard's queries evaluated
//! through its HTTP API as Grafana would send them.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::Value;

use crate::paths::repo_root;
use crate::process::Process;

/// The dashboard shipped in `envoy/grafana/`.
pub fn dashboard() -> anyhow::Result<Value> {
    let path = repo_root().join("envoy/grafana/kvmesh-agents.json");
    let text = std::fs::read_to_string(&path).with_context(|| path.display().to_string())?;
    Ok(serde_json::from_str(&text)?)
}

/// Every PromQL expression of the dashboard: panel targets and variable queries.
pub fn expressions(dashboard: &Value) -> Vec<String> {
    let mut out = Vec::new();
    for panel in dashboard["panels"].as_array().into_iter().flatten() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            out.extend(target["expr"].as_str().map(str::to_owned));
        }
    }
    for var in dashboard["templating"]["list"].as_array().into_iter().flatten() {
        if var["type"] == "query" {
            out.extend(var["definition"].as_str().map(str::to_owned));
        }
    }
    out
}

/// The dashboard's expression as Grafana would send it with every variable
/// at "All" and a one-minute rate window (a test's data spans seconds,
/// scraped every second).
fn as_grafana_sends(expr: &str) -> String {
    expr.replace("$__rate_interval", "1m")
        .replace("$harness", ".*")
        .replace("$tenant", ".*")
        .replace("$gpu_cluster", ".*")
}

/// One scrape job: its name, metrics path and `HOST:PORT` targets.
#[derive(Debug)]
pub struct Job {
    pub name: &'static str,
    pub metrics_path: &'static str,
    pub targets: Vec<String>,
}

/// A running Prometheus, stopped (by pid) when dropped.
#[derive(Debug)]
pub struct Prometheus {
    pub api: String,
    http: reqwest::Client,
    _process: Process,
}

/// Prometheus: `$KVMESH_PROMETHEUS`, else `prometheus` on PATH.
fn binary() -> PathBuf {
    std::env::var_os("KVMESH_PROMETHEUS").map_or_else(|| "prometheus".into(), Into::into)
}

impl Prometheus {
    /// Starts Prometheus scraping `jobs` every second, data under `dir`, and
    /// waits until it is ready and has scraped every target twice (it hands
    /// new targets to its scrapers in batches, every 5 s), so that traffic
    /// sent after this falls between samples and rates see it.
    pub async fn start(dir: &Path, jobs: &[Job]) -> anyhow::Result<Self> {
        let mut config = "global: {scrape_interval: 1s, evaluation_interval: 1s}\nscrape_configs:\n".to_owned();
        for job in jobs {
            let targets: Vec<String> = job.targets.iter().map(|t| format!("'{t}'")).collect();
            config.push_str(&format!(
                "- {{job_name: {}, metrics_path: {}, static_configs: [{{targets: [{}]}}]}}\n",
                job.name,
                job.metrics_path,
                targets.join(", ")
            ));
        }
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join("prometheus.yml"), config)?;
        // Prometheus takes an address, not port 0.
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let process = Process::spawn(
            "prometheus",
            &binary(),
            &[
                format!("--config.file={}", dir.join("prometheus.yml").display()),
                format!("--storage.tsdb.path={}", dir.join("data").display()),
                format!("--web.listen-address=127.0.0.1:{port}"),
            ],
            dir,
        )
        .context("starting prometheus (Debian's package; ./dev installs it)")?;
        let prometheus = Self {
            api: format!("http://127.0.0.1:{port}"),
            http: reqwest::Client::builder().no_proxy().build()?,
            _process: process,
        };
        let started = Instant::now();
        while !prometheus
            .http
            .get(format!("{}/-/ready", prometheus.api))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
        {
            // About 1 s alone, several on a loaded machine: this only
            // bounds a hang.
            anyhow::ensure!(
                started.elapsed() < Duration::from_secs(120),
                "prometheus never became ready"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let targets: usize = jobs.iter().map(|j| j.targets.len()).sum();
        prometheus
            .wait_for("count(count_over_time(up[1m]) >= 2)", targets as f64)
            .await?;
        Ok(prometheus)
    }

    /// The value of a query that yields one number (0 when it yields none).
    pub async fn scalar(&self, query: &str) -> anyhow::Result<f64> {
        let reply: Value = self
            .http
            .get(format!("{}/api/v1/query", self.api))
            .query(&[("query", query)])
            .send()
            .await?
            .json()
            .await?;
        Ok(reply["data"]["result"][0]["value"][1]
            .as_str()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0))
    }

    /// Polls `query` until it yields at least `at_least` (120 s at most: a
    /// few scrapes take seconds, more on a loaded machine, so the deadline
    /// only bounds a hang).
    pub async fn wait_for(&self, query: &str, at_least: f64) -> anyhow::Result<()> {
        let started = Instant::now();
        while self.scalar(query).await? < at_least {
            anyhow::ensure!(
                started.elapsed() < Duration::from_secs(120),
                "{query} never reached {at_least}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Ok(())
    }

    /// Evaluates every query of the dashboard; fails on a query Prometheus
    /// refuses, and returns the ones that yielded no series (for a
    /// `label_values` variable: no values).
    pub async fn empty_dashboard_queries(&self) -> anyhow::Result<Vec<String>> {
        let mut empty = Vec::new();
        for expr in expressions(&dashboard()?) {
            if let Some(args) = expr.strip_prefix("label_values(").and_then(|e| e.strip_suffix(')')) {
                let (metric, label) = args.split_once(',').context("label_values without a label")?;
                let reply: Value = self
                    .http
                    .get(format!("{}/api/v1/label/{}/values", self.api, label.trim()))
                    .query(&[("match[]", metric.trim())])
                    .send()
                    .await?
                    .json()
                    .await?;
                anyhow::ensure!(reply["status"] == "success", "{expr}: {reply}");
                if reply["data"].as_array().is_none_or(Vec::is_empty) {
                    empty.push(expr);
                }
                continue;
            }
            let query = as_grafana_sends(&expr);
            let reply: Value = self
                .http
                .get(format!("{}/api/v1/query", self.api))
                .query(&[("query", query.as_str())])
                .send()
                .await?
                .json()
                .await?;
            anyhow::ensure!(reply["status"] == "success", "{query}: {reply}");
            if reply["data"]["result"].as_array().is_none_or(Vec::is_empty) {
                empty.push(query);
            }
        }
        Ok(empty)
    }
}

/// The scrape jobs of a deployment: the sidecar, Envoy and the workers.
pub fn jobs(cluster: &crate::Cluster) -> Vec<Job> {
    vec![
        Job {
            name: "kvmesh-sidecar",
            metrics_path: "/metrics",
            targets: vec![cluster.sidecar_admin.to_string()],
        },
        Job {
            name: "envoy",
            metrics_path: "/stats/prometheus",
            targets: vec![cluster.envoy_admin.trim_start_matches("http://").to_owned()],
        },
        Job {
            name: "workers",
            metrics_path: "/metrics",
            targets: cluster.worker_names(),
        },
    ]
}
