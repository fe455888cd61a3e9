//! The Istio install under `envoy/istio/`: renders its kustomize overlays with
//! `kubectl kustomize`, validates them, and assembles an Envoy bootstrap
//! from the rendered EnvoyFilters' patch values, taken verbatim, so the real
//! Envoy can run exactly what Istio would patch into its proxies.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, anyhow, bail};
use serde::Deserialize as _;
use serde_yaml::{Mapping, Value};

use crate::paths;

/// The overlays shipped under `envoy/istio/overlays/`, by directory name.
pub const OVERLAYS: [&str; 4] = ["sidecar", "sidecar-remote-module", "gateway", "sidecar-external-redis"];

/// `envoy/istio/`.
pub fn istio_dir() -> PathBuf {
    paths::repo_root().join("envoy/istio")
}

/// `kubectl`: `$KVMESH_KUBECTL`, else `kubectl` on PATH.
pub fn kubectl() -> PathBuf {
    std::env::var_os("KVMESH_KUBECTL").map_or_else(|| PathBuf::from("kubectl"), PathBuf::from)
}

/// The Python of `.tools/venv` (where `./dev` installs kubernetes-validate),
/// else `python3` on PATH.
pub fn python() -> PathBuf {
    let local = paths::repo_root().join(".tools/venv/bin/python");
    if local.is_file() {
        local
    } else {
        PathBuf::from("python3")
    }
}

/// `kubectl kustomize DIR`: the rendered multi-document YAML.
pub fn kustomize(dir: &Path) -> anyhow::Result<String> {
    let out = Command::new(kubectl())
        .arg("kustomize")
        .arg(dir)
        .output()
        .context("running kubectl kustomize (kubectl v1.32 or later must be on PATH)")?;
    if !out.status.success() {
        bail!(
            "kubectl kustomize {} failed:\n{}",
            dir.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    String::from_utf8(out.stdout).context("kustomize output is not UTF-8")
}

/// Renders `envoy/istio/overlays/<name>`.
pub fn render_overlay(name: &str) -> anyhow::Result<String> {
    kustomize(&istio_dir().join("overlays").join(name))
}

/// Runs `envoy/istio/validate.py` on `yaml`; returns success and its output.
pub fn validate(yaml: &str) -> anyhow::Result<(bool, String)> {
    use std::io::Write;
    let mut child = Command::new(python())
        .arg(istio_dir().join("validate.py"))
        .arg("-")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("running envoy/istio/validate.py")?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(yaml.as_bytes())?;
    }
    let out = child.wait_with_output()?;
    let log = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok((out.status.success(), log))
}

/// The documents of a multi-document YAML stream.
pub fn documents(yaml: &str) -> anyhow::Result<Vec<Value>> {
    let mut docs = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(yaml) {
        let value = Value::deserialize(doc).context("parsing rendered YAML")?;
        if !value.is_null() {
            docs.push(value);
        }
    }
    Ok(docs)
}

/// The resource of `kind` named `name`.
pub fn resource<'a>(docs: &'a [Value], kind: &str, name: &str) -> anyhow::Result<&'a Value> {
    docs.iter()
        .find(|d| d["kind"].as_str() == Some(kind) && d["metadata"]["name"].as_str() == Some(name))
        .ok_or_else(|| anyhow!("no {kind}/{name} in the rendered manifests"))
}

/// Every EnvoyFilter config patch in `docs`, in order.
pub fn config_patches(docs: &[Value]) -> Vec<&Value> {
    docs.iter()
        .filter(|d| d["kind"].as_str() == Some("EnvoyFilter"))
        .filter_map(|d| d["spec"]["configPatches"].as_sequence())
        .flatten()
        .collect()
}

/// The `patch.value` of the one patch applying to `apply_to` with `operation`.
pub fn patch_value(docs: &[Value], apply_to: &str, operation: &str) -> anyhow::Result<Value> {
    optional_patch_value(docs, apply_to, operation)?.ok_or_else(|| anyhow!("no {apply_to} {operation} patch"))
}

/// As `patch_value`, `None` when there is no such patch (more than one is an error).
pub fn optional_patch_value(docs: &[Value], apply_to: &str, operation: &str) -> anyhow::Result<Option<Value>> {
    let found: Vec<&Value> = config_patches(docs)
        .into_iter()
        .filter(|p| p["applyTo"].as_str() == Some(apply_to) && p["patch"]["operation"].as_str() == Some(operation))
        .collect();
    match found.as_slice() {
        [] => Ok(None),
        [one] => Ok(Some(one["patch"]["value"].clone())),
        _ => bail!("{} {apply_to} {operation} patches, expected one", found.len()),
    }
}

/// The `patch.value` of the HTTP_FILTER INSERT_BEFORE patch inserting the
/// HTTP filter `name` (the Wasm filter is `kvmesh`).
pub fn inserted_http_filter(docs: &[Value], name: &str) -> anyhow::Result<Value> {
    config_patches(docs)
        .into_iter()
        .filter(|p| {
            p["applyTo"].as_str() == Some("HTTP_FILTER") && p["patch"]["operation"].as_str() == Some("INSERT_BEFORE")
        })
        .map(|p| p["patch"]["value"].clone())
        .find(|v| v["name"].as_str() == Some(name))
        .ok_or_else(|| anyhow!("no HTTP_FILTER INSERT_BEFORE patch for {name}"))
}

/// The HTTP filter chain `[router]` after every HTTP_FILTER INSERT_BEFORE
/// patch, applied in order as Istio does: each value goes right before the
/// filter its `subFilter` names.
fn http_filters(docs: &[Value], router: Value) -> anyhow::Result<Vec<Value>> {
    let mut chain = vec![router];
    for patch in config_patches(docs).into_iter().filter(|p| {
        p["applyTo"].as_str() == Some("HTTP_FILTER") && p["patch"]["operation"].as_str() == Some("INSERT_BEFORE")
    }) {
        let before = patch["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"]
            .as_str()
            .ok_or_else(|| anyhow!("an HTTP_FILTER INSERT_BEFORE patch without a subFilter"))?;
        let at = chain
            .iter()
            .position(|f| f["name"].as_str() == Some(before))
            .ok_or_else(|| anyhow!("HTTP_FILTER INSERT_BEFORE {before}: no such filter (yet)"))?;
        chain.insert(at, patch["patch"]["value"].clone());
    }
    Ok(chain)
}

/// The `patch.value` of the CLUSTER ADD patch adding the cluster `name`.
pub fn added_cluster(docs: &[Value], name: &str) -> anyhow::Result<Value> {
    config_patches(docs)
        .into_iter()
        .filter(|p| p["applyTo"].as_str() == Some("CLUSTER") && p["patch"]["operation"].as_str() == Some("ADD"))
        .map(|p| p["patch"]["value"].clone())
        .find(|v| v["name"].as_str() == Some(name))
        .ok_or_else(|| anyhow!("no CLUSTER ADD patch for {name}"))
}

/// Merges `patch` into `target` as Istio's MERGE does (protobuf merge
/// semantics): messages merge field by field, repeated fields append,
/// scalars are replaced.
pub fn proto_merge(target: &mut Value, patch: &Value) {
    match (target, patch) {
        (Value::Mapping(t), Value::Mapping(p)) => {
            for (k, v) in p {
                match t.get_mut(k) {
                    Some(existing) => proto_merge(existing, v),
                    None => {
                        t.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        (Value::Sequence(t), Value::Sequence(p)) => t.extend(p.iter().cloned()),
        (t, p) => *t = p.clone(),
    }
}

fn yaml(text: &str) -> anyhow::Result<Value> {
    serde_yaml::from_str(text).context("parsing a bootstrap fragment")
}

/// Sets the address of every endpoint of a cluster to `addr`. The only
/// rewrite made to an added cluster: Kubernetes DNS names do not resolve here.
pub fn point_cluster_at(cluster: &mut Value, addr: std::net::SocketAddr) -> anyhow::Result<()> {
    let endpoints = cluster["load_assignment"]["endpoints"]
        .as_sequence_mut()
        .ok_or_else(|| anyhow!("cluster without load_assignment.endpoints"))?;
    for group in endpoints {
        let lbs = group["lb_endpoints"]
            .as_sequence_mut()
            .ok_or_else(|| anyhow!("cluster without lb_endpoints"))?;
        for lb in lbs {
            let socket = &mut lb["endpoint"]["address"]["socket_address"];
            if !socket.is_mapping() {
                bail!("endpoint without socket_address");
            }
            socket["address"] = addr.ip().to_string().into();
            socket["port_value"] = u64::from(addr.port()).into();
        }
    }
    Ok(())
}

/// Builds an Envoy bootstrap with the shape of `envoy/envoy.yaml` (listener
/// `agents`, clusters `gpu_workers` and `kvmesh_sidecar`) from the rendered
/// manifests of an overlay, the way Istio applies its EnvoyFilters to the
/// outbound listener, route and cluster of the GPU Service:
///
/// - each HTTP_FILTER INSERT_BEFORE value goes before its `subFilter`
///   (the Wasm filter before the router, the header mutation before it);
/// - the LISTENER MERGE value merges into the listener, the NETWORK_FILTER
///   MERGE value into its HTTP connection manager;
/// - the HTTP_ROUTE MERGE value, if any, merges into the route;
/// - the CLUSTER MERGE value merges into a STATIC `gpu_workers` cluster with
///   Istio's default `lb_policy` (LEAST_REQUEST), which it must override;
/// - every CLUSTER ADD value is added as is.
///
/// Everything else is Envoy's minimum. The endpoints are placeholders the
/// caller rewrites (`envoy_config::render`, `point_cluster_at`).
pub fn bootstrap_from_manifests(rendered: &str) -> anyhow::Result<Value> {
    let docs = documents(rendered)?;
    let listener_patch = patch_value(&docs, "LISTENER", "MERGE")?;
    let cluster_patch = patch_value(&docs, "CLUSTER", "MERGE")?;
    let route_patch = optional_patch_value(&docs, "HTTP_ROUTE", "MERGE")?;
    let hcm_patch = patch_value(&docs, "NETWORK_FILTER", "MERGE")?;

    let mut route = yaml("{match: {prefix: /}, route: {cluster: gpu_workers}}")?;
    if let Some(patch) = &route_patch {
        proto_merge(&mut route, patch);
    }
    let router = yaml(
        r#"{name: envoy.filters.http.router, typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}"#,
    )?;
    let mut hcm = yaml(
        r#"
name: envoy.filters.network.http_connection_manager
typed_config:
  "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
  stat_prefix: agents
  route_config:
    name: inference
    virtual_hosts:
    - name: inference
      domains: ["*"]
"#,
    )?;
    hcm["typed_config"]["route_config"]["virtual_hosts"][0]["routes"] = Value::Sequence(vec![route]);
    hcm["typed_config"]["http_filters"] = Value::Sequence(http_filters(&docs, router)?);
    proto_merge(&mut hcm, &hcm_patch);
    let mut listener = yaml("{name: agents, address: {socket_address: {address: 127.0.0.1, port_value: 10000}}}")?;
    listener["filter_chains"] = yaml("[{filters: []}]")?;
    listener["filter_chains"][0]["filters"] = Value::Sequence(vec![hcm]);
    proto_merge(&mut listener, &listener_patch);

    let mut gpu = yaml(
        r"
name: gpu_workers
type: STATIC
connect_timeout: 1s
lb_policy: LEAST_REQUEST
load_assignment:
  cluster_name: gpu_workers
  endpoints:
  - lb_endpoints:
    - endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: 8001}}}
",
    )?;
    proto_merge(&mut gpu, &cluster_patch);
    let mut clusters = vec![gpu];
    clusters.extend(
        config_patches(&docs)
            .into_iter()
            .filter(|p| p["applyTo"].as_str() == Some("CLUSTER") && p["patch"]["operation"].as_str() == Some("ADD"))
            .map(|p| p["patch"]["value"].clone()),
    );

    let mut doc = Mapping::new();
    doc.insert(
        "admin".into(),
        yaml("{address: {socket_address: {address: 127.0.0.1, port_value: 9901}}}")?,
    );
    let mut resources = Mapping::new();
    resources.insert("listeners".into(), Value::Sequence(vec![listener]));
    resources.insert("clusters".into(), Value::Sequence(clusters));
    doc.insert("static_resources".into(), Value::Mapping(resources));
    Ok(Value::Mapping(doc))
}
