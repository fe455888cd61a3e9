//! The Grafana dashboard shipped in `envoy/grafana/`: a well-formed
//! dashboard of Grafana's classic JSON model, and every metric its queries
//! name is exported by a live sidecar, Envoy or engine after agent traffic.

use std::collections::BTreeSet;

use anyhow::{Context, bail};
use std::time::{Duration, Instant};

use kvmesh_integration::cluster::settled;
use kvmesh_integration::paths::repo_root;
use kvmesh_integration::prometheus::{self, Prometheus, dashboard, expressions};
use kvmesh_integration::{AgentSession, Cluster, ClusterOptions};
use serde_json::Value;

/// The metric names in a PromQL expression: identifiers outside label
/// matchers, grouping lists and ranges that are not functions or keywords.
fn metric_names(expr: &str) -> Vec<String> {
    const KEYWORDS: &[&str] = &[
        "sum",
        "rate",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "and",
        "or",
        "unless",
        "histogram_quantile",
        "label_values",
        "avg",
        "max",
        "min",
        "count",
        "irate",
        "increase",
    ];
    // Drop `{...}`, `[...]`, and the lists after by/without/on/ignoring.
    let mut cleaned = String::new();
    let mut depth = 0usize;
    for c in expr.chars() {
        match c {
            '{' | '[' => depth += 1,
            '}' | ']' => depth = depth.saturating_sub(1),
            _ if depth == 0 => cleaned.push(c),
            _ => {}
        }
    }
    let mut names = Vec::new();
    let mut skip_list = false;
    let tokens: Vec<&str> = cleaned
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':' || c == '(' || c == ')' || c == ','))
        .flat_map(|t| t.split_inclusive(['(', ')', ',']))
        .collect();
    for raw in tokens {
        let ident = raw.trim_end_matches(['(', ')', ',']);
        if skip_list {
            if raw.ends_with(')') {
                skip_list = false;
            }
            continue;
        }
        if ["by", "without", "on", "ignoring"].contains(&ident) {
            skip_list = true;
            continue;
        }
        let is_call = raw.ends_with('(');
        let starts_alpha = ident
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
        if !ident.is_empty() && starts_alpha && !is_call && !KEYWORDS.contains(&ident) && !ident.starts_with("__") {
            names.push(ident.to_owned());
        }
    }
    names
}

#[test]
fn metric_names_are_read_from_promql() {
    assert_eq!(
        metric_names(
            r#"sum by (harness, section) (rate(kvmesh_prefix_breaks_total{harness=~"$h"}[$__rate_interval]))"#
        ),
        ["kvmesh_prefix_breaks_total"]
    );
    assert_eq!(
        metric_names("histogram_quantile(0.99, sum by (le) (rate(kvmesh_pick_duration_seconds_bucket[5m])))"),
        ["kvmesh_pick_duration_seconds_bucket"]
    );
    assert_eq!(
        metric_names("label_values(envoy_cluster_upstream_rq_total, envoy_cluster_name)"),
        ["envoy_cluster_upstream_rq_total", "envoy_cluster_name"]
    );
}

#[test]
fn the_dashboard_is_a_well_formed_grafana_dashboard() -> anyhow::Result<()> {
    let d = dashboard()?;
    for key in ["title", "uid"] {
        assert!(d[key].as_str().is_some_and(|s| !s.is_empty()), "no {key}");
    }
    assert!(
        d["uid"].as_str().is_some_and(|u| u.len() <= 40),
        "uid longer than Grafana allows"
    );
    assert!(d["schemaVersion"].as_u64().is_some_and(|v| v >= 30));
    let panels = d["panels"].as_array().context("no panels")?;
    assert!(panels.len() >= 12, "a dashboard of {} panels", panels.len());
    let mut ids = BTreeSet::new();
    let mut cells = BTreeSet::new();
    let variables: BTreeSet<String> = d["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v["name"].as_str().map(str::to_owned))
        .collect();
    for p in panels {
        let title = p["title"].as_str().context("a panel without a title")?;
        assert!(
            ids.insert(p["id"].as_u64().context("panel id")?),
            "{title}: duplicate id"
        );
        let kind = p["type"].as_str().context("panel type")?;
        assert!(["row", "stat", "timeseries"].contains(&kind), "{title}: type {kind}");
        let g = &p["gridPos"];
        let (x, y, w, h) = (g["x"].as_u64(), g["y"].as_u64(), g["w"].as_u64(), g["h"].as_u64());
        let (Some(x), Some(y), Some(w), Some(h)) = (x, y, w, h) else {
            bail!("{title}: incomplete gridPos {g}");
        };
        assert!(w >= 1 && x + w <= 24 && h >= 1, "{title}: outside the 24-column grid");
        for cx in x..x + w {
            for cy in y..y + h {
                assert!(cells.insert((cx, cy)), "{title} overlaps another panel at ({cx}, {cy})");
            }
        }
        if kind == "row" {
            continue;
        }
        assert!(
            p["description"].as_str().is_some_and(|s| s.len() > 20),
            "{title}: no description"
        );
        let targets = p["targets"].as_array().context("targets")?;
        assert!(!targets.is_empty(), "{title}: no query");
        let mut refs = BTreeSet::new();
        for t in targets {
            assert!(
                refs.insert(t["refId"].as_str().context("refId")?),
                "{title}: duplicate refId"
            );
            assert_eq!(t["datasource"]["uid"], "${datasource}", "{title}");
            let expr = t["expr"].as_str().context("expr")?;
            // Every $variable a query uses is defined (Grafana's own ones aside).
            for var in expr.split('$').skip(1) {
                let name: String = var
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                assert!(
                    name.starts_with("__") || variables.contains(&name),
                    "{title}: undefined variable ${name}"
                );
            }
        }
    }
    Ok(())
}

fn exported_names(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_owned)
        .collect()
}

fn label_names(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| Some(l.split_once('{')?.1.split_once('}')?.0))
        .flat_map(|labels| {
            labels
                .split(',')
                .filter_map(|kv| kv.split_once('=').map(|(k, _)| k.trim().to_owned()))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_dashboard_queries_is_exported() -> anyhow::Result<()> {
    let cluster = Cluster::start(ClusterOptions::default().patient()).await?;
    let session = AgentSession::new("acme/dashboard");
    for turn in 0..3 {
        let reply = cluster
            .chat(
                &session.call(turn),
                &[("x-session-id", "dash-1"), ("user-agent", "opencode/1.0.120")],
            )
            .await?;
        assert_eq!(reply.status, 200);
    }
    // The series a report creates exist once the sidecar counted all three
    // (it releases a pick a moment before it counts the report).
    let reports = settled(&3.0, Duration::from_secs(60), || {
        cluster.sidecar_metric("kvmesh_reports_total{known=\"true\"}")
    })
    .await?;
    assert_eq!(reports, 3.0);
    cluster.wait_for_no_in_flight(Duration::from_secs(10)).await?;
    let http = reqwest::Client::builder().no_proxy().build()?;
    let sidecar = http
        .get(format!("http://{}/metrics", cluster.sidecar_admin))
        .send()
        .await?
        .text()
        .await?;
    let envoy = http
        .get(format!("{}/stats/prometheus", cluster.envoy_admin))
        .send()
        .await?
        .text()
        .await?;
    let mut exported = exported_names(&sidecar);
    exported.extend(exported_names(&envoy));
    let mut labels = label_names(&sidecar);
    labels.extend(label_names(&envoy));
    // The engines' own panels read the workers (here the simulated engine,
    // which exports vLLM's names; `vllm_apis.rs` scrapes real vLLM).
    for index in 0..cluster.workers.len() {
        let worker = cluster.worker_metrics(index).await?;
        exported.extend(exported_names(&worker));
        labels.extend(label_names(&worker));
    }
    let mut missing = BTreeSet::new();
    for expr in expressions(&dashboard()?) {
        for name in metric_names(&expr) {
            // label_values(metric, label): the second name is a label.
            let known = exported.contains(&name) || (expr.starts_with("label_values") && labels.contains(&name));
            if !known {
                missing.insert(name);
            }
        }
    }
    if !missing.is_empty() {
        let kvmesh_like: Vec<&String> = exported.iter().filter(|n| n.contains("kvmesh")).collect();
        bail!("the dashboard queries metrics nobody exports: {missing:?}\nexported kvmesh names: {kvmesh_like:?}");
    }
    Ok(())
}

#[test]
fn the_dashboard_ships_as_a_configmap_grafana_discovers() -> anyhow::Result<()> {
    use kvmesh_integration::istio;
    let rendered = istio::kustomize(&repo_root().join("envoy/grafana"))?;
    let (valid, log) = istio::validate(&rendered)?;
    assert!(valid, "{log}");
    let docs = istio::documents(&rendered)?;
    let map = istio::resource(&docs, "ConfigMap", "kvmesh-agents-dashboard")?;
    assert_eq!(map["metadata"]["labels"]["grafana_dashboard"], "1");
    let shipped: Value = serde_json::from_str(
        map["data"]["kvmesh-agents.json"]
            .as_str()
            .context("no dashboard in the ConfigMap")?,
    )?;
    assert_eq!(shipped, dashboard()?, "the ConfigMap's dashboard differs from the file");
    Ok(())
}

/// A real Prometheus scrapes the sidecar, Envoy and the workers while agent
/// sessions run; then every query of the dashboard, evaluated through its
/// HTTP API, parses and returns series, and every variable query has values.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_query_returns_series_in_a_real_prometheus() -> anyhow::Result<()> {
    let cluster = Cluster::start(ClusterOptions::default().patient()).await?;
    let prometheus = Prometheus::start(&cluster.dir.join("prometheus"), &prometheus::jobs(&cluster)).await?;
    for turn in 0..4 {
        for (session, agent) in [("prom-1", "opencode/1.0.120"), ("prom-2", "claude-cli/2.1.80")] {
            let reply = cluster
                .chat(
                    &AgentSession::new(session).call(turn),
                    &[("x-session-id", session), ("user-agent", agent)],
                )
                .await?;
            assert_eq!(reply.status, 200);
        }
    }
    cluster.wait_for_no_in_flight(Duration::from_secs(10)).await?;
    // Scraped since: the filter's 8 picks in Envoy's stats and the sidecar's.
    prometheus.wait_for("sum(kvmesh_picks)", 8.0).await?;
    prometheus.wait_for("sum(kvmesh_picks_total)", 8.0).await?;
    prometheus.wait_for("sum(kvmesh_calls_total)", 8.0).await?;
    // The sidecar creates a label's series on its first call, so a rate
    // needs two samples of it after the traffic: wait for three, however
    // slowly a loaded machine scrapes.
    for series in ["kvmesh_calls_total", "kvmesh_picks_total", "kvmesh_picks"] {
        prometheus
            .wait_for(&format!("min(count_over_time({series}[1m]))"), 3.0)
            .await?;
    }
    // A series the sidecar creates later than those (an idle session's, on
    // a later tick) needs its own samples: poll until every query returns
    // series. A metric nobody exports never does; the deadline only bounds
    // that wait.
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let empty = prometheus.empty_dashboard_queries().await?;
        if empty.is_empty() {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "{} dashboard queries returned no series after traffic:\n{}",
                empty.len(),
                empty.join("\n")
            );
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}
