//! The Istio install (`envoy/istio/`): every overlay renders with
//! `kubectl kustomize` and validates (Istio resources against Istio's CRD
//! schemas, the rest against Kubernetes' own); the validator rejects broken
//! manifests; the parameters reach every resource; the sidecar's Deployment,
//! Service and NetworkPolicy say what the install promises, and the real
//! sidecar accepts their configuration.

use std::collections::BTreeSet;
use std::time::Duration;

use kvmesh_integration::istio::{self, OVERLAYS, documents, resource};
use kvmesh_integration::paths::{self, Profile};
use kvmesh_integration::process::Process;
use serde_yaml::Value;

#[test]
fn every_overlay_renders_and_validates() -> anyhow::Result<()> {
    // Every overlay on disk: the shipped ones and any a user added.
    let on_disk: BTreeSet<String> = std::fs::read_dir(istio::istio_dir().join("overlays"))?
        .filter_map(Result::ok)
        .filter(|e| e.path().join("kustomization.yaml").is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    let shipped: BTreeSet<String> = OVERLAYS.iter().map(|s| (*s).to_owned()).collect();
    assert!(on_disk.is_superset(&shipped), "{on_disk:?}");

    for overlay in &on_disk {
        let rendered = istio::render_overlay(overlay)?;
        let docs = documents(&rendered)?;
        let (ok, log) = istio::validate(&rendered)?;
        assert!(ok, "{overlay}:\n{log}");
        assert!(
            log.contains(&format!("{} resources valid", docs.len())),
            "{overlay}: {log}"
        );
        // The params resource is local configuration, never applied.
        assert!(resource(&docs, "ConfigMap", "kvmesh-params").is_err(), "{overlay}");
        for kind in ["EnvoyFilter", "Deployment", "Service", "ConfigMap", "NetworkPolicy"] {
            assert!(
                docs.iter().any(|d| d["kind"].as_str() == Some(kind)),
                "{overlay}: no {kind}"
            );
        }
    }
    Ok(())
}

fn set(docs: &mut [Value], kind: &str, name: &str, edit: impl FnOnce(&mut Value)) {
    let doc = docs
        .iter_mut()
        .find(|d| d["kind"].as_str() == Some(kind) && d["metadata"]["name"].as_str() == Some(name));
    assert!(doc.is_some(), "no {kind}/{name}");
    if let Some(doc) = doc {
        edit(doc);
    }
}

fn to_yaml(docs: &[Value]) -> anyhow::Result<String> {
    let mut out = String::new();
    for doc in docs {
        out.push_str("---\n");
        // As JSON, a subset of YAML that no YAML 1.1 reader takes for booleans.
        out.push_str(&serde_json::to_string(doc)?);
        out.push('\n');
    }
    Ok(out)
}

#[test]
fn the_validator_rejects_broken_manifests_naming_the_problem() -> anyhow::Result<()> {
    let good = documents(&istio::render_overlay("sidecar")?)?;
    type Edit = Box<dyn Fn(&mut [Value])>;
    let cases: Vec<(&str, Edit)> = vec![
        (
            "'CLUSTR' is not one of",
            Box::new(|d| {
                set(d, "EnvoyFilter", "kvmesh-gpu-cluster", |f| {
                    f["spec"]["configPatches"][0]["applyTo"] = "CLUSTR".into();
                });
            }),
        ),
        (
            "'serivce' was unexpected",
            Box::new(|d| {
                set(d, "EnvoyFilter", "kvmesh-gpu-cluster", |f| {
                    f["spec"]["configPatches"][0]["match"]["cluster"]["serivce"] = "x".into();
                });
            }),
        ),
        (
            "'MERGED' is not one of",
            Box::new(|d| {
                set(d, "EnvoyFilter", "kvmesh-filter", |f| {
                    f["spec"]["configPatches"][0]["patch"]["operation"] = "MERGED".into();
                });
            }),
        ),
        (
            "spec.replicas",
            Box::new(|d| {
                set(d, "Deployment", "kvmesh-sidecar", |f| {
                    f["spec"]["replicas"] = "two".into()
                });
            }),
        ),
        (
            "'imagePullPolice' was unexpected",
            Box::new(|d| {
                set(d, "Deployment", "kvmesh-sidecar", |f| {
                    f["spec"]["template"]["spec"]["containers"][0]["imagePullPolice"] = "Always".into();
                });
            }),
        ),
        (
            "no Kubernetes",
            Box::new(|d| {
                set(d, "NetworkPolicy", "kvmesh-sidecar", |f| {
                    f["kind"] = "NetworkPolicyy".into()
                })
            }),
        ),
    ];
    for (expect, edit) in cases {
        let mut docs = good.clone();
        edit(&mut docs);
        let (ok, log) = istio::validate(&to_yaml(&docs)?)?;
        assert!(!ok, "accepted a manifest that should fail with {expect:?}:\n{log}");
        assert!(log.contains(expect), "expected {expect:?} in:\n{log}");
    }
    // Unchanged, the same documents pass: the failures above are the edits'.
    let (ok, log) = istio::validate(&to_yaml(&good)?)?;
    assert!(ok, "{log}");
    Ok(())
}

#[test]
fn the_parameters_reach_every_resource() -> anyhow::Result<()> {
    // A copy of the base and components with a new overlay beside them
    // (kustomize takes relative paths only).
    let root = std::env::temp_dir().join(format!("kvmesh-istio-params-{}", std::process::id()));
    let istio_dir = istio::istio_dir();
    for part in ["base", "components/params"] {
        copy_dir(&istio_dir.join(part), &root.join(part))?;
    }
    let dir = root.join("overlays/test");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(
        dir.join("kustomization.yaml"),
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n\
         resources:\n- ../../base\n- params.yaml\ncomponents:\n- ../../components/params\n",
    )?;
    // The shipped params with every value changed.
    let shipped = std::fs::read_to_string(istio_dir.join("overlays/sidecar/params.yaml"))?;
    let mut params: Value = serde_yaml::from_str(&shipped)?;
    params["data"]["gpuService"] = "sglang".into();
    params["data"]["namespace"] = "inference".into();
    params["data"]["port"] = "30000".into();
    params["data"]["enginePort"] = "31000".into();
    params["data"]["gpuApp"] = "sglang-server".into();
    params["data"]["model"] = "llama-3.3-70b".into();
    params["data"]["proxyNamespace"] = "assistants".into();
    std::fs::write(dir.join("params.yaml"), serde_yaml::to_string(&params)?)?;
    let rendered = istio::kustomize(&dir);
    let _ = std::fs::remove_dir_all(&root);
    let rendered = rendered?;
    let docs = documents(&rendered)?;

    for doc in &docs {
        let ns = doc["metadata"]["namespace"].as_str();
        let expected = if doc["kind"].as_str() == Some("EnvoyFilter") {
            "assistants"
        } else {
            "inference"
        };
        assert_eq!(ns, Some(expected), "{:?}", doc["metadata"]);
    }
    let cluster_filter = resource(&docs, "EnvoyFilter", "kvmesh-gpu-cluster")?;
    let patches = &cluster_filter["spec"]["configPatches"];
    assert_eq!(
        patches[0]["match"]["cluster"]["service"].as_str(),
        Some("sglang.inference.svc.cluster.local")
    );
    assert_eq!(patches[0]["match"]["cluster"]["portNumber"].as_u64(), Some(30000));
    assert_eq!(
        patches[1]["patch"]["value"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
            ["socket_address"]["address"]
            .as_str(),
        Some("kvmesh-sidecar.inference.svc.cluster.local")
    );
    assert_eq!(patches[2]["match"]["listener"]["portNumber"].as_u64(), Some(30000));
    assert_eq!(patches[3]["match"]["listener"]["portNumber"].as_u64(), Some(30000));
    assert_eq!(
        patches[4]["match"]["routeConfiguration"]["portNumber"].as_u64(),
        Some(30000)
    );
    assert_eq!(
        patches[4]["match"]["routeConfiguration"]["vhost"]["name"].as_str(),
        Some("sglang.inference.svc.cluster.local:30000")
    );
    let filter = resource(&docs, "EnvoyFilter", "kvmesh-filter")?;
    assert_eq!(
        filter["spec"]["configPatches"][0]["match"]["listener"]["portNumber"].as_u64(),
        Some(30000)
    );
    let deployment = resource(&docs, "Deployment", "kvmesh-sidecar")?;
    let env = env_of(deployment);
    assert_eq!(
        env.get("KVMESH_WORKER_DNS").map(String::as_str),
        Some("kvmesh-workers.inference.svc.cluster.local:31000")
    );
    assert_eq!(env.get("KVMESH_CLUSTER").map(String::as_str), Some("llama-3.3-70b"));
    let workers = resource(&docs, "Service", "kvmesh-workers")?;
    assert_eq!(workers["spec"]["clusterIP"].as_str(), Some("None"));
    assert_eq!(workers["spec"]["selector"]["app"].as_str(), Some("sglang-server"));
    assert_eq!(workers["spec"]["ports"][0]["port"].as_u64(), Some(31000));
    assert_eq!(workers["spec"]["ports"][0]["targetPort"].as_u64(), Some(31000));
    // Nothing of the shipped example values is left anywhere.
    for leftover in ["vllm", ".llm.", "8000", "qwen3", "agents"] {
        assert!(!rendered.contains(leftover), "{leftover:?} left in:\n{rendered}");
    }
    let (ok, log) = istio::validate(&rendered)?;
    assert!(ok, "{log}");
    Ok(())
}

fn copy_dir(from: &std::path::Path, to: &std::path::Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        std::fs::copy(entry.path(), to.join(entry.file_name()))?;
    }
    Ok(())
}

fn env_of(deployment: &Value) -> std::collections::BTreeMap<String, String> {
    deployment["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_sequence()
        .into_iter()
        .flatten()
        .filter_map(|e| {
            Some((
                e["name"].as_str()?.to_owned(),
                e["value"].as_str().unwrap_or("(from a reference)").to_owned(),
            ))
        })
        .collect()
}

#[test]
fn the_sidecar_deployment_is_what_the_install_promises() -> anyhow::Result<()> {
    let docs = documents(&istio::render_overlay("sidecar")?)?;
    let deployment = resource(&docs, "Deployment", "kvmesh-sidecar")?;
    let spec = &deployment["spec"];
    assert_eq!(spec["replicas"].as_u64(), Some(2));
    let pod = &spec["template"]["spec"];
    let container = &pod["containers"][0];
    assert_eq!(container["readinessProbe"]["httpGet"]["path"].as_str(), Some("/readyz"));
    assert_eq!(container["readinessProbe"]["httpGet"]["port"].as_str(), Some("admin"));
    assert!(container["resources"]["requests"]["cpu"].is_string());
    assert!(container["resources"]["requests"]["memory"].is_string());
    assert_eq!(pod["securityContext"]["runAsNonRoot"].as_bool(), Some(true));
    assert_eq!(
        container["securityContext"]["readOnlyRootFilesystem"].as_bool(),
        Some(true)
    );
    assert_eq!(
        container["securityContext"]["allowPrivilegeEscalation"].as_bool(),
        Some(false)
    );
    // Envoy reaches it in plain HTTP/2, outside the mesh's mTLS.
    assert_eq!(
        spec["template"]["metadata"]["annotations"]["sidecar.istio.io/inject"].as_str(),
        Some("false")
    );
    let ports: Vec<(String, u64)> = container["ports"]
        .as_sequence()
        .into_iter()
        .flatten()
        .filter_map(|p| Some((p["name"].as_str()?.to_owned(), p["containerPort"].as_u64()?)))
        .collect();
    assert_eq!(ports, [("grpc".to_owned(), 50051), ("admin".to_owned(), 9902)]);

    // The Service (headless: the Envoy cluster sees every replica) selects the pods.
    let service = resource(&docs, "Service", "kvmesh-sidecar")?;
    assert_eq!(service["spec"]["clusterIP"].as_str(), Some("None"));
    let selector = service["spec"]["selector"].as_mapping().cloned().unwrap_or_default();
    assert!(!selector.is_empty());
    for (k, v) in &selector {
        assert_eq!(spec["template"]["metadata"]["labels"].get(k), Some(v));
    }
    // The EnvoyFilter's sidecar cluster is that Service, on its gRPC port,
    // and the filter's plugin configuration names that cluster.
    let added = istio::added_cluster(&docs, "kvmesh_sidecar")?;
    let socket = &added["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"];
    assert_eq!(socket["address"].as_str(), Some("kvmesh-sidecar.llm.svc.cluster.local"));
    assert_eq!(socket["port_value"].as_u64(), Some(50051));
    let filter = istio::inserted_http_filter(&docs, "kvmesh")?;
    let plugin: serde_json::Value = serde_json::from_str(
        filter["typed_config"]["config"]["configuration"]["value"]
            .as_str()
            .unwrap_or_default(),
    )?;
    assert_eq!(plugin["sidecar_cluster"].as_str(), added["name"].as_str());

    // gRPC only from the mesh's proxies, admin only from Prometheus.
    let policy = resource(&docs, "NetworkPolicy", "kvmesh-sidecar")?;
    let rules = policy["spec"]["ingress"].as_sequence().cloned().unwrap_or_default();
    assert_eq!(rules.len(), 2);
    assert_eq!(rules[0]["ports"][0]["port"].as_u64(), Some(50051));
    assert_eq!(
        rules[0]["from"][0]["podSelector"]["matchLabels"]["security.istio.io/tlsMode"].as_str(),
        Some("istio")
    );
    assert_eq!(rules[1]["ports"][0]["port"].as_u64(), Some(9902));
    assert_eq!(
        rules[1]["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/name"].as_str(),
        Some("prometheus")
    );
    assert_eq!(rules[1]["from"].as_sequence().map(Vec::len), Some(1));
    Ok(())
}

#[test]
fn the_real_sidecar_accepts_the_shipped_configuration() -> anyhow::Result<()> {
    let docs = documents(&istio::render_overlay("sidecar")?)?;
    let deployment = resource(&docs, "Deployment", "kvmesh-sidecar")?;
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    let config_map = resource(&docs, "ConfigMap", "kvmesh-sidecar")?;
    // The container reads the ConfigMap's TOML where the volume mounts it.
    let args: Vec<&str> = container["args"]
        .as_sequence()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    let mount = container["volumeMounts"][0]["mountPath"].as_str().unwrap_or_default();
    let data = config_map["data"].as_mapping().cloned().unwrap_or_default();
    let (key, toml) = data.iter().next().expect("a TOML in the ConfigMap");
    let key = key.as_str().unwrap_or_default();
    assert_eq!(args, ["--config", &format!("{mount}/{key}")]);

    // Every KVMESH_* variable the Deployment sets is one the sidecar reads.
    let sidecar = paths::binary("kvmesh-sidecar", Profile::Debug)?;
    let help = std::process::Command::new(&sidecar).arg("--help").output()?;
    let help = String::from_utf8_lossy(&help.stdout);
    let env = env_of(deployment);
    for name in env.keys() {
        assert!(
            help.contains(&format!("[env: {name}")),
            "the sidecar does not read {name}"
        );
    }

    // The sidecar starts with the TOML and the Deployment's cluster name.
    // Only what cannot work here is overridden (flags win over the file):
    // loopback listeners, and a literal worker instead of in-cluster DNS.
    let dir = std::env::temp_dir().join(format!("kvmesh-istio-sidecar-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let file = dir.join(key);
    std::fs::write(&file, toml.as_str().unwrap_or_default())?;
    let cluster = env.get("KVMESH_CLUSTER").cloned().unwrap_or_default();
    let mut process = Process::spawn(
        "sidecar",
        &sidecar,
        &[
            "--config".into(),
            file.display().to_string(),
            "--cluster".into(),
            cluster,
            "--grpc-listen".into(),
            "127.0.0.1:0".into(),
            "--admin-listen".into(),
            "127.0.0.1:0".into(),
            "--worker".into(),
            "127.0.0.1:9".into(),
        ],
        &dir,
    )?;
    // A start takes about a second; the deadline only bounds a hang.
    let started = process.wait_for_line("listening", Duration::from_secs(120));
    let log = process.log_tail();
    process.stop();
    let _ = std::fs::remove_dir_all(&dir);
    started.map_err(|e| anyhow::anyhow!("{e}:\n{log}"))?;
    Ok(())
}

#[test]
fn the_pod_patch_mounts_the_module_where_the_envoyfilter_loads_it() -> anyhow::Result<()> {
    // The shipped patch, applied by kustomize to a typical agent Deployment.
    let root = std::env::temp_dir().join(format!("kvmesh-istio-podpatch-{}", std::process::id()));
    std::fs::create_dir_all(&root)?;
    // `kubectl patch --patch-file` takes the body alone; kustomize wants the
    // resource's identity with it.
    let patch = std::fs::read_to_string(istio::istio_dir().join("examples/proxy-wasm-volume-patch.yaml"))?;
    std::fs::write(
        root.join("patch.yaml"),
        format!("apiVersion: apps/v1\nkind: Deployment\nmetadata: {{name: agent}}\n{patch}"),
    )?;
    std::fs::write(
        root.join("agent.yaml"),
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: agent, namespace: agents}\n\
         spec:\n  selector: {matchLabels: {app: agent}}\n  template:\n    metadata: {labels: {app: agent}}\n\
         \x20   spec: {containers: [{name: agent, image: agent:1}]}\n",
    )?;
    std::fs::write(
        root.join("kustomization.yaml"),
        "resources: [agent.yaml]\npatches:\n- path: patch.yaml\n  target: {kind: Deployment, name: agent}\n",
    )?;
    let rendered = istio::kustomize(&root);
    let _ = std::fs::remove_dir_all(&root);
    let rendered = rendered?;
    let (ok, log) = istio::validate(&rendered)?;
    assert!(ok, "{log}");
    let docs = documents(&rendered)?;
    let annotations = &resource(&docs, "Deployment", "agent")?["spec"]["template"]["metadata"]["annotations"];
    let volume: serde_json::Value =
        serde_json::from_str(annotations["sidecar.istio.io/userVolume"].as_str().unwrap_or_default())?;
    let mount: serde_json::Value = serde_json::from_str(
        annotations["sidecar.istio.io/userVolumeMount"]
            .as_str()
            .unwrap_or_default(),
    )?;
    assert_eq!(volume["kvmesh-filter"]["configMap"]["name"], "kvmesh-filter");
    let dir = mount["kvmesh-filter"]["mountPath"].as_str().unwrap_or_default();
    // Istio keeps the filter's stats: Envoy prefixes a Wasm module's own
    // metrics with `wasmcustom.`, and the filter's all start with `kvmesh.`;
    // Envoy's stats of the plugin's VM (`wasm.kvmesh.vm_reload_*`) too.
    let proxy: serde_json::Value =
        serde_json::from_str(annotations["proxy.istio.io/config"].as_str().unwrap_or_default())?;
    assert_eq!(
        proxy["proxyStatsMatcher"]["inclusionPrefixes"],
        serde_json::json!(["wasmcustom.kvmesh", "wasm.kvmesh"])
    );
    let metrics = std::fs::read_to_string(paths::repo_root().join("filter/src/metrics.rs"))?;
    assert!(metrics.contains("\"kvmesh.picks\""));

    // The EnvoyFilter loads <mountPath>/kvmesh_filter.wasm, the ConfigMap key
    // docs/deploy-istio.md creates.
    let docs = documents(&istio::render_overlay("sidecar")?)?;
    let filter = istio::inserted_http_filter(&docs, "kvmesh")?;
    assert_eq!(
        filter["typed_config"]["config"]["vm_config"]["code"]["local"]["filename"].as_str(),
        Some(format!("{dir}/kvmesh_filter.wasm").as_str())
    );
    let guide = std::fs::read_to_string(paths::repo_root().join("docs/deploy-istio.md"))?;
    assert!(guide.contains("create configmap kvmesh-filter"));
    assert!(guide.contains("--from-file=kvmesh_filter.wasm="));
    Ok(())
}

#[test]
fn the_remote_module_is_fetched_through_the_cluster_that_serves_its_url() -> anyhow::Result<()> {
    let docs = documents(&istio::render_overlay("sidecar-remote-module")?)?;
    let filter = istio::inserted_http_filter(&docs, "kvmesh")?;
    let remote = &filter["typed_config"]["config"]["vm_config"]["code"]["remote"];
    let uri = remote["http_uri"]["uri"].as_str().unwrap_or_default();
    let cluster_name = remote["http_uri"]["cluster"].as_str().unwrap_or_default();
    let cluster = istio::added_cluster(&docs, cluster_name)?;
    let socket =
        &cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"];
    let authority = uri
        .strip_prefix("http://")
        .and_then(|rest| rest.split('/').next())
        .unwrap_or_default();
    let (host, port) = authority.split_once(':').unwrap_or((authority, "80"));
    assert_eq!(socket["address"].as_str(), Some(host));
    assert_eq!(socket["port_value"].as_u64(), port.parse().ok());
    // A SHA-256 placeholder for `sha256sum` to fill in (docs/deploy-istio.md).
    let sha = remote["sha256"].as_str().unwrap_or_default();
    assert_eq!(sha.len(), 64);
    assert!(sha.bytes().all(|b| b.is_ascii_hexdigit()));
    Ok(())
}
