//! Renders the shipped `envoy/envoy.yaml` for a test: the same document with
//! only its ports, worker endpoints, Wasm path and plugin settings rewritten.

use std::net::SocketAddr;
use std::path::Path;

use anyhow::{Context, anyhow};
use serde_yaml::{Mapping, Value};

/// What a test changes in the shipped configuration.
#[derive(Debug, Clone)]
pub struct EnvoyOverrides<'a> {
    pub workers: &'a [SocketAddr],
    /// The sidecar replicas: the `kvmesh_sidecar` cluster's endpoints.
    pub sidecars: &'a [SocketAddr],
    pub wasm: &'a Path,
    /// Merged over the plugin configuration JSON (e.g. `sidecar_timeout_ms`).
    pub plugin: serde_json::Value,
    /// Add a second listener, `agents_direct`, identical but without the
    /// kvmesh filter: the baseline of overhead benchmarks.
    pub baseline_listener: bool,
}

/// Name of the listener without the kvmesh filter.
pub const BASELINE_LISTENER: &str = "agents_direct";

fn get_mut<'v>(value: &'v mut Value, key: &str) -> anyhow::Result<&'v mut Value> {
    value.get_mut(key).ok_or_else(|| anyhow!("envoy.yaml: no `{key}`"))
}

fn named<'v>(list: &'v mut Value, name: &str) -> anyhow::Result<&'v mut Value> {
    list.as_sequence_mut()
        .and_then(|items| {
            items
                .iter_mut()
                .find(|item| item.get("name").and_then(Value::as_str) == Some(name))
        })
        .ok_or_else(|| anyhow!("envoy.yaml: no item named `{name}`"))
}

fn socket_address(addr: SocketAddr) -> Value {
    let mut socket = Mapping::new();
    socket.insert("address".into(), addr.ip().to_string().into());
    socket.insert("port_value".into(), u64::from(addr.port()).into());
    let mut address = Mapping::new();
    address.insert("socket_address".into(), Value::Mapping(socket));
    let mut endpoint = Mapping::new();
    endpoint.insert("address".into(), Value::Mapping(address));
    let mut lb = Mapping::new();
    lb.insert("endpoint".into(), Value::Mapping(endpoint));
    Value::Mapping(lb)
}

fn set_endpoints(cluster: &mut Value, addrs: &[SocketAddr]) -> anyhow::Result<()> {
    let endpoints = get_mut(get_mut(cluster, "load_assignment")?, "endpoints")?;
    let first = endpoints
        .get_mut(0)
        .ok_or_else(|| anyhow!("envoy.yaml: cluster without endpoints"))?;
    *get_mut(first, "lb_endpoints")? = Value::Sequence(addrs.iter().copied().map(socket_address).collect());
    Ok(())
}

/// Returns the rendered YAML.
pub fn render(shipped: &str, o: &EnvoyOverrides<'_>) -> anyhow::Result<String> {
    let mut doc: Value = serde_yaml::from_str(shipped).context("parsing envoy.yaml")?;
    *get_mut(
        get_mut(get_mut(get_mut(&mut doc, "admin")?, "address")?, "socket_address")?,
        "port_value",
    )? = 0.into();

    let resources = get_mut(&mut doc, "static_resources")?;
    let listener = named(get_mut(resources, "listeners")?, "agents")?;
    *get_mut(get_mut(get_mut(listener, "address")?, "socket_address")?, "port_value")? = 0.into();
    let manager = get_mut(listener, "filter_chains")?
        .get_mut(0)
        .ok_or_else(|| anyhow!("envoy.yaml: no filter chain"))?;
    let hcm = get_mut(manager, "filters")?
        .get_mut(0)
        .ok_or_else(|| anyhow!("envoy.yaml: no network filter"))?;
    let wasm = named(get_mut(get_mut(hcm, "typed_config")?, "http_filters")?, "kvmesh")?;
    let config = get_mut(get_mut(wasm, "typed_config")?, "config")?;
    // A module fetched from a URL (`remote`) is left as it is.
    if let Some(local) = get_mut(get_mut(config, "vm_config")?, "code")?.get_mut("local") {
        *get_mut(local, "filename")? = o.wasm.display().to_string().into();
    }
    let plugin = get_mut(get_mut(config, "configuration")?, "value")?;
    let mut json: serde_json::Value =
        serde_json::from_str(plugin.as_str().unwrap_or("{}")).context("plugin configuration JSON")?;
    if let (Some(base), Some(extra)) = (json.as_object_mut(), o.plugin.as_object()) {
        for (k, v) in extra {
            base.insert(k.clone(), v.clone());
        }
    }
    *plugin = json.to_string().into();

    if o.baseline_listener {
        let mut direct = named(get_mut(resources, "listeners")?, "agents")?.clone();
        direct["name"] = BASELINE_LISTENER.into();
        let filters = direct["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
            .as_sequence_mut()
            .ok_or_else(|| anyhow!("envoy.yaml: no http_filters"))?;
        // Plain Envoy: neither the Wasm filter nor the header mutation
        // that guards it.
        filters.retain(|f| {
            !f.get("name")
                .and_then(Value::as_str)
                .is_some_and(|name| name == "kvmesh" || name.starts_with("kvmesh_"))
        });
        get_mut(resources, "listeners")?
            .as_sequence_mut()
            .ok_or_else(|| anyhow!("envoy.yaml: listeners is not a list"))?
            .push(direct);
    }

    let clusters = get_mut(resources, "clusters")?;
    set_endpoints(named(clusters, "gpu_workers")?, o.workers)?;
    set_endpoints(named(clusters, "kvmesh_sidecar")?, o.sidecars)?;
    serde_yaml::to_string(&doc).context("writing envoy.yaml")
}

/// Runs `envoy --mode validate` on `yaml` (from the repository root, so the
/// shipped relative Wasm path resolves): success, and what Envoy logged.
pub fn validate(yaml: &str, name: &str) -> anyhow::Result<(bool, String)> {
    let dir = std::env::temp_dir().join(format!("kvmesh-validate-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let file = dir.join("envoy.yaml");
    std::fs::write(&file, yaml)?;
    let out = std::process::Command::new(crate::paths::envoy())
        .args(["--mode", "validate", "--disable-hot-restart", "-c"])
        .arg(&file)
        .current_dir(crate::paths::repo_root())
        .output()?;
    let _ = std::fs::remove_dir_all(&dir);
    let log = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok((out.status.success(), log))
}
