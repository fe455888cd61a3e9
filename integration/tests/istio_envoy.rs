//! What the Istio EnvoyFilters patch into a proxy works in the real Envoy.
//! The bootstrap is assembled from the rendered EnvoyFilters' patch values,
//! verbatim (`istio::bootstrap_from_manifests`); only addresses, ports and
//! the Wasm path are rewritten. The standalone `envoy/envoy.yaml` must carry
//! the same filter, cluster, listener and route settings, so neither can
//! drift from the other.

use std::net::SocketAddr;

use kvmesh_integration::envoy_config::{EnvoyOverrides, render, validate};
use kvmesh_integration::istio::{self, OVERLAYS, documents};
use kvmesh_integration::{AgentSession, Cluster, ClusterOptions, paths};
use serde_yaml::Value;
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The bootstrap of an overlay, rendered for loopback: workers, the sidecar
/// and (for a remote module) the module server at the given addresses.
fn bootstrap(overlay: &str, module_server: Option<SocketAddr>, sha256: Option<&str>) -> anyhow::Result<String> {
    bootstrap_with(overlay, module_server, sha256, None)
}

/// As `bootstrap`, optionally with fewer module fetch retries.
fn bootstrap_with(
    overlay: &str,
    module_server: Option<SocketAddr>,
    sha256: Option<&str>,
    fetch_retries: Option<u64>,
) -> anyhow::Result<String> {
    let mut doc = istio::bootstrap_from_manifests(&istio::render_overlay(overlay)?)?;
    let filter =
        doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
            .as_sequence_mut()
            .and_then(|filters| filters.iter_mut().find(|f| f["name"].as_str() == Some("kvmesh")))
            .ok_or_else(|| anyhow::anyhow!("no kvmesh filter"))?;
    if let Some(remote) = filter["typed_config"]["config"]["vm_config"]["code"].get_mut("remote") {
        if let Some(sha) = sha256 {
            remote["sha256"] = sha.into();
        }
        if let Some(retries) = fetch_retries {
            remote["retry_policy"]["num_retries"] = retries.into();
        }
    }
    if let Some(server) = module_server {
        let clusters = doc["static_resources"]["clusters"]
            .as_sequence_mut()
            .ok_or_else(|| anyhow::anyhow!("no clusters"))?;
        for cluster in clusters {
            if cluster["name"].as_str() == Some("kvmesh_module") {
                istio::point_cluster_at(cluster, server)?;
            }
        }
    }
    Ok(serde_yaml::to_string(&doc)?)
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

#[test]
fn every_overlay_gives_a_config_the_real_envoy_accepts() -> anyhow::Result<()> {
    let wasm = paths::filter_wasm()?;
    let digest = sha256_hex(&std::fs::read(&wasm)?);
    for overlay in OVERLAYS {
        let template = bootstrap(overlay, Some("127.0.0.1:9".parse()?), Some(&digest))?;
        let yaml = render(
            &template,
            &EnvoyOverrides {
                workers: &["127.0.0.1:1".parse()?, "127.0.0.1:2".parse()?],
                sidecars: &["127.0.0.1:3".parse()?],
                wasm: &wasm,
                plugin: serde_json::json!({}),
                baseline_listener: false,
            },
        )?;
        let (ok, log) = validate(&yaml, overlay)?;
        assert!(ok, "{overlay}:\n{log}\n{yaml}");
        assert!(
            !log.contains("Deprecated field"),
            "{overlay}: deprecated fields:\n{log}"
        );
        if !overlay.contains("remote") {
            assert!(
                log.contains("kvmesh filter configured"),
                "{overlay}: the filter's on_configure did not run:\n{log}"
            );
        }
    }
    Ok(())
}

/// An agent session through the Istio configuration: it sticks to one
/// worker, whose cache the engine confirms, and (with the route's retry
/// policy) a dead pick moves on.
async fn session_sticks_and_reuses_its_cache(cluster: &mut Cluster, retries: bool) -> anyhow::Result<()> {
    let session = AgentSession::new("acme/istio");
    let mut workers = Vec::new();
    let mut cached = Vec::new();
    for turn in 0..8 {
        let reply = cluster
            .chat(&session.call(turn), &[("x-session-id", "istio-a")])
            .await?;
        assert_eq!(reply.status, 200, "turn {turn}: {}", reply.body);
        let first_choice = reply.saw_destination.as_deref().and_then(|d| d.split(',').next());
        assert_eq!(first_choice, reply.worker.as_deref(), "turn {turn}");
        workers.push(reply.worker.clone().unwrap_or_default());
        cached.push(reply.cached_tokens().unwrap_or(0));
    }
    assert!(workers.iter().all(|w| *w == workers[0]), "moved: {workers:?}");
    assert_eq!(cached[0], 0);
    for turn in 1..cached.len() {
        assert!(cached[turn] > cached[turn - 1], "no reuse at turn {turn}: {cached:?}");
    }
    assert_eq!(cluster.envoy_counter("wasmcustom.kvmesh.picks").await?, 8);

    if !retries {
        return Ok(());
    }
    // The route's retry policy from the HTTP_ROUTE patch: the pick names
    // the dead worker first, Envoy moves on.
    let home = workers[0].clone();
    cluster.kill_worker_at(&home)?;
    let reply = cluster.chat(&session.call(8), &[("x-session-id", "istio-a")]).await?;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(
        reply.saw_destination.as_deref().and_then(|d| d.split(',').next()),
        Some(home.as_str())
    );
    assert_ne!(reply.worker.as_deref(), Some(home.as_str()));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_session_through_the_envoyfilters_sticks_and_reuses_its_cache() -> anyhow::Result<()> {
    let mut cluster = Cluster::start(
        ClusterOptions {
            envoy_template: Some(bootstrap("sidecar", None, None)?),
            ..ClusterOptions::default()
        }
        .patient(),
    )
    .await?;
    session_sticks_and_reuses_its_cache(&mut cluster, true).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_session_through_the_gateway_envoyfilters_sticks_and_reuses_its_cache() -> anyhow::Result<()> {
    // The gateway's route (and its retries) come from the user's
    // VirtualService, so only the routing is shown here.
    let mut cluster = Cluster::start(
        ClusterOptions {
            envoy_template: Some(bootstrap("gateway", None, None)?),
            ..ClusterOptions::default()
        }
        .patient(),
    )
    .await?;
    session_sticks_and_reuses_its_cache(&mut cluster, false).await
}

/// Serves `body` to every HTTP request on a loopback port until dropped.
async fn serve(body: Vec<u8>) -> anyhow::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let task = tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let body = body.clone();
            tokio::spawn(async move {
                let mut request = Vec::new();
                let mut buf = [0u8; 4096];
                while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => request.extend_from_slice(&buf[..n]),
                    }
                }
                let head = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/wasm\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                    body.len()
                );
                let _ = stream.write_all(head.as_bytes()).await;
                let _ = stream.write_all(&body).await;
                let _ = stream.shutdown().await;
            });
        }
    });
    Ok((addr, task))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_module_is_fetched_checked_and_routes() -> anyhow::Result<()> {
    let wasm = std::fs::read(paths::filter_wasm()?)?;
    let digest = sha256_hex(&wasm);
    let (server, task) = serve(wasm).await?;
    let mut cluster = Cluster::start(
        ClusterOptions {
            envoy_template: Some(bootstrap("sidecar-remote-module", Some(server), Some(&digest))?),
            ..ClusterOptions::default()
        }
        .patient(),
    )
    .await?;
    let result = session_sticks_and_reuses_its_cache(&mut cluster, true).await;
    task.abort();
    result
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_module_with_the_wrong_digest_is_not_loaded() -> anyhow::Result<()> {
    let wasm = std::fs::read(paths::filter_wasm()?)?;
    let wrong = sha256_hex(b"not the module");
    let (server, task) = serve(wasm).await?;
    let cluster = Cluster::start(ClusterOptions {
        // One retry instead of five: Envoy only becomes ready once it gave
        // up, and its backoff grows with every retry.
        envoy_template: Some(bootstrap_with(
            "sidecar-remote-module",
            Some(server),
            Some(&wrong),
            Some(1),
        )?),
        ..ClusterOptions::default()
    })
    .await;
    task.abort();
    // Envoy fetches the module, finds the digest wrong, retries, then gives
    // up on the plugin: no request is ever routed by it.
    let cluster = cluster?;
    let reply = cluster
        .chat(&AgentSession::new("acme/x").call(0), &[("x-session-id", "x")])
        .await?;
    // The data path stays up: the call passes through, unrouted.
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.saw_destination, None, "a module with a wrong digest routed");
    // With no VM at all, Envoy's own header mutation still keeps a client
    // from choosing its upstream: round robin answers, from every worker.
    let target = cluster.worker_names()[0].clone();
    let mut answered_by = std::collections::BTreeSet::new();
    for turn in 0..6 {
        let reply = cluster
            .chat(
                &AgentSession::new("acme/x").call(turn),
                &[("x-session-id", "x"), ("x-kvmesh-destination", target.as_str())],
            )
            .await?;
        assert_eq!(reply.status, 200, "{}", reply.body);
        assert_eq!(reply.saw_destination, None, "a forged destination reached the worker");
        answered_by.insert(reply.worker.unwrap_or_default());
    }
    assert_eq!(answered_by.len(), 3, "a forged destination steered: {answered_by:?}");
    assert_eq!(cluster.envoy_counter("wasmcustom.kvmesh.picks").await.unwrap_or(0), 0);
    let log = cluster.envoy.log_tail();
    assert!(log.contains("Plugin kvmesh failed to load"), "{log}");
    Ok(())
}

/// The parts of a Wasm filter config that must match: all but the module's
/// source, and for a module fetched at run time its failure policy (it fails
/// open rather than closed when the module does not arrive: see
/// `overlays/sidecar-remote-module/module.yaml`).
fn without_code(filter: &Value) -> Value {
    let mut filter = filter.clone();
    let remote = filter["typed_config"]["config"]["vm_config"]["code"]
        .get("remote")
        .is_some();
    if let Some(vm) = filter["typed_config"]["config"]["vm_config"].as_mapping_mut() {
        vm.remove("code");
    }
    if let Some(config) = filter["typed_config"]["config"].as_mapping_mut()
        && remote
    {
        assert_eq!(config.get("failure_policy").and_then(Value::as_str), Some("FAIL_OPEN"));
        config.remove("failure_policy");
        config.remove("reload_config");
    }
    filter
}

fn named<'a>(list: &'a Value, name: &str) -> anyhow::Result<&'a Value> {
    list.as_sequence()
        .and_then(|items| items.iter().find(|i| i["name"].as_str() == Some(name)))
        .ok_or_else(|| anyhow::anyhow!("no {name}"))
}

#[test]
fn the_standalone_envoy_yaml_carries_what_the_envoyfilters_patch_in() -> anyhow::Result<()> {
    let standalone: Value = serde_yaml::from_str(&std::fs::read_to_string(paths::envoy_yaml())?)?;
    let resources = &standalone["static_resources"];
    let listener = named(&resources["listeners"], "agents")?;
    let hcm = &listener["filter_chains"][0]["filters"][0]["typed_config"];
    let route = &hcm["route_config"]["virtual_hosts"][0]["routes"][0];
    let gpu = named(&resources["clusters"], "gpu_workers")?;
    let sidecar = named(&resources["clusters"], "kvmesh_sidecar")?;
    let standalone_filter = named(&hcm["http_filters"], "kvmesh")?;
    let standalone_strip = named(&hcm["http_filters"], "kvmesh_strip_destination")?;
    // Envoy moves a client's destination aside before the Wasm filter runs.
    let order: Vec<&str> = hcm["http_filters"]
        .as_sequence()
        .into_iter()
        .flatten()
        .filter_map(|f| f["name"].as_str())
        .collect();
    assert_eq!(
        order,
        ["kvmesh_strip_destination", "kvmesh", "envoy.filters.http.router"]
    );

    for overlay in OVERLAYS {
        let docs = documents(&istio::render_overlay(overlay)?)?;
        // The Wasm filter: identical but for where the module comes from.
        let filter = istio::inserted_http_filter(&docs, "kvmesh")?;
        let mut expected = without_code(standalone_filter);
        if overlay == "sidecar-remote-module"
            && let Some(config) = expected["typed_config"]["config"].as_mapping_mut()
        {
            config.remove("failure_policy");
            config.remove("reload_config");
        }
        assert_eq!(without_code(&filter), expected, "{overlay}");
        let strip = istio::inserted_http_filter(&docs, "kvmesh_strip_destination")?;
        assert_eq!(&strip, standalone_strip, "{overlay}");
        // The GPU cluster: every field the MERGE sets, and no other.
        let merge = istio::patch_value(&docs, "CLUSTER", "MERGE")?;
        let mut keys: Vec<&str> = merge
            .as_mapping()
            .into_iter()
            .flatten()
            .filter_map(|(k, _)| k.as_str())
            .collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            [
                "circuit_breakers",
                "load_balancing_policy",
                "per_connection_buffer_limit_bytes"
            ],
            "{overlay}"
        );
        for key in keys {
            assert_eq!(merge[key], gpu[key], "{overlay}: gpu cluster {key}");
        }
        // The sidecar's cluster: name, HTTP/2 and timeout.
        let added = istio::added_cluster(&docs, "kvmesh_sidecar")?;
        for key in ["name", "connect_timeout", "typed_extension_protocol_options"] {
            assert_eq!(added[key], sidecar[key], "{overlay}: sidecar cluster {key}");
        }
        // The listener's buffer limit.
        let listener_merge = istio::patch_value(&docs, "LISTENER", "MERGE")?;
        assert_eq!(
            listener_merge,
            serde_yaml::from_str::<Value>(&format!(
                "per_connection_buffer_limit_bytes: {}",
                listener["per_connection_buffer_limit_bytes"].as_u64().unwrap_or(0)
            ))?,
            "{overlay}"
        );
        // The HTTP connection manager's stream idle timeout.
        let hcm_merge = istio::patch_value(&docs, "NETWORK_FILTER", "MERGE")?;
        let mut hcm_keys: Vec<&str> = hcm_merge["typed_config"]
            .as_mapping()
            .into_iter()
            .flatten()
            .filter_map(|(k, _)| k.as_str())
            .collect();
        hcm_keys.sort_unstable();
        assert_eq!(hcm_keys, ["@type", "stream_idle_timeout"], "{overlay}");
        for key in hcm_keys {
            assert_eq!(
                hcm_merge["typed_config"][key], hcm[key],
                "{overlay}: connection manager {key}"
            );
        }
        // The route's retry policy and timeout (gateways take theirs from
        // their VirtualService, docs/deploy-istio.md).
        if overlay == "gateway" {
            assert!(istio::optional_patch_value(&docs, "HTTP_ROUTE", "MERGE")?.is_none());
        } else {
            let route_merge = istio::patch_value(&docs, "HTTP_ROUTE", "MERGE")?;
            for key in ["retry_policy", "timeout"] {
                assert_eq!(route_merge["route"][key], route["route"][key], "{overlay}: route {key}");
            }
        }
    }
    Ok(())
}
