//! docs/deploy-istio.md is followed as a new user would, as far as this
//! machine allows: every block marked ```` ```sh offline ```` runs exactly as
//! written, in order, from the root of a fresh copy of `envoy/` (with the
//! build output and tools of this checkout). The ```` ```sh build ```` block is
//! the build `just test` runs before the tests. Every other shell block must
//! need a cluster: each of its commands must be one that talks to Kubernetes.

use std::process::Command;

use kvmesh_integration::istio::{self, documents};
use kvmesh_integration::paths::{self, Profile};

/// The fenced blocks of a markdown file: (info string, body).
fn blocks(markdown: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut current: Option<(String, String)> = None;
    for line in markdown.lines() {
        match (&mut current, line.strip_prefix("```")) {
            (None, Some(info)) => current = Some((info.trim().to_owned(), String::new())),
            (Some(_), Some(rest)) if rest.trim().is_empty() => out.extend(current.take()),
            (Some((_, body)), _) => {
                body.push_str(line);
                body.push('\n');
            }
            (None, None) => {}
        }
    }
    out
}

/// The commands of a shell block, continuation lines joined.
fn commands(body: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut pending = String::new();
    for line in body.lines() {
        let line = line.trim();
        if pending.is_empty() && (line.is_empty() || line.starts_with('#')) {
            continue;
        }
        if let Some(head) = line.strip_suffix('\\') {
            pending.push_str(head);
            continue;
        }
        pending.push_str(line);
        out.push(std::mem::take(&mut pending));
    }
    out
}

/// Whether a command needs a running cluster.
fn needs_a_cluster(command: &str) -> bool {
    let words: Vec<&str> = command.split_whitespace().collect();
    match words.first().copied() {
        // Only ever against a port-forwarded pod.
        Some("curl") => command.contains("localhost:"),
        Some("kubectl") => {
            let mut rest = &words[1..];
            if rest.first() == Some(&"-n") {
                rest = rest.get(2..).unwrap_or_default();
            }
            matches!(
                rest.first().copied(),
                Some("apply" | "delete" | "get" | "logs" | "exec" | "patch" | "rollout" | "port-forward")
            )
        }
        _ => false,
    }
}

#[test]
fn every_command_of_the_istio_guide_that_needs_no_cluster_runs() -> anyhow::Result<()> {
    let root = paths::repo_root();
    let guide = std::fs::read_to_string(root.join("docs/deploy-istio.md"))?;
    let all = blocks(&guide);
    let mut offline = Vec::new();
    for (info, body) in &all {
        match info.as_str() {
            "sh offline" => offline.push(body.clone()),
            // What `just test` builds before any test runs.
            "sh build" => {
                assert_eq!(commands(body), ["./dev build"]);
                paths::filter_wasm()?;
                paths::binary("kvmesh-sidecar", Profile::Debug)?;
            }
            "sh" => {
                for command in commands(body) {
                    assert!(
                        needs_a_cluster(&command),
                        "needs no cluster, so mark its block `sh offline`: {command}"
                    );
                }
            }
            other => assert!(
                !other.starts_with("sh") && !other.starts_with("bash"),
                "unknown shell block `{other}`"
            ),
        }
    }
    assert!(offline.len() >= 5, "{} offline blocks", offline.len());

    // A fresh copy of the install, with this checkout's build and tools.
    let dir = std::env::temp_dir().join(format!("kvmesh-guide-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    kvmesh_integration::paths::copy_dir(&root.join("envoy"), &dir.join("envoy"))?;
    std::os::unix::fs::symlink(
        paths::filter_wasm()?
            .ancestors()
            .nth(3)
            .ok_or_else(|| anyhow::anyhow!("no target directory"))?,
        dir.join("target"),
    )?;
    std::os::unix::fs::symlink(root.join(".tools"), dir.join(".tools"))?;

    let mut failure = None;
    for (i, block) in offline.iter().enumerate() {
        let out = Command::new("bash")
            .args(["-euo", "pipefail", "-c", block])
            .current_dir(&dir)
            // No kubeconfig: nothing may reach a cluster, even on a machine with one.
            .env("KUBECONFIG", dir.join("no-kubeconfig"))
            .output()?;
        if !out.status.success() {
            failure = Some(format!(
                "offline block {i} failed:\n{block}\n--- stdout\n{}\n--- stderr\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ));
            break;
        }
    }
    let outputs = (
        std::fs::read_to_string(dir.join("kvmesh.yaml")),
        std::fs::read_to_string(dir.join("kvmesh-filter.yaml")),
    );
    let _ = std::fs::remove_dir_all(&dir);
    if let Some(failure) = failure {
        panic!("{failure}");
    }

    // What the guide produced is an install for the GPU Service it named,
    // and the module's ConfigMap lands where the EnvoyFilters patch.
    let install = documents(&outputs.0?)?;
    let filter = istio::resource(&install, "EnvoyFilter", "kvmesh-filter")?;
    let module = outputs.1?;
    // A ConfigMap holds at most 1 MiB.
    assert!(
        module.len() < 1 << 20,
        "the module's ConfigMap is {} bytes",
        module.len()
    );
    let module = documents(&module)?;
    let config_map = istio::resource(&module, "ConfigMap", "kvmesh-filter")?;
    assert_eq!(config_map["metadata"]["namespace"], filter["metadata"]["namespace"]);
    assert!(config_map["binaryData"]["kvmesh_filter.wasm"].is_string());
    assert_eq!(
        istio::resource(&install, "Deployment", "kvmesh-sidecar")?["metadata"]["namespace"],
        "llm"
    );
    Ok(())
}
