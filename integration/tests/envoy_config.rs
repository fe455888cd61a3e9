//! The shipped Envoy configuration is valid for the real Envoy, with the real
//! filter loaded; a bad plugin configuration is rejected, naming the field.

use std::process::Command;

use kvmesh_integration::envoy_config::{EnvoyOverrides, render};
use kvmesh_integration::paths;

fn validate(yaml: &str, name: &str) -> anyhow::Result<(bool, String)> {
    let dir = std::env::temp_dir().join(format!("kvmesh-validate-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let file = dir.join("envoy.yaml");
    std::fs::write(&file, yaml)?;
    let out = Command::new(paths::envoy())
        .args(["--mode", "validate", "--disable-hot-restart", "-c"])
        .arg(&file)
        .current_dir(paths::repo_root())
        .output()?;
    let _ = std::fs::remove_dir_all(&dir);
    let log = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok((out.status.success(), log))
}

#[test]
fn the_shipped_config_validates_as_is() -> anyhow::Result<()> {
    paths::filter_wasm()?;
    let shipped = std::fs::read_to_string(paths::envoy_yaml())?;
    let (ok, log) = validate(&shipped, "shipped")?;
    assert!(ok, "{log}");
    assert!(
        log.contains("kvmesh filter configured"),
        "the filter's on_configure did not run:\n{log}"
    );
    assert!(
        !log.contains("Deprecated field"),
        "deprecated Envoy fields in envoy.yaml:\n{log}"
    );
    Ok(())
}

#[test]
fn a_bad_plugin_configuration_is_rejected_naming_the_field() -> anyhow::Result<()> {
    let shipped = std::fs::read_to_string(paths::envoy_yaml())?;
    let wasm = paths::filter_wasm()?;
    for (field, bad) in [
        ("sidecar_timeout_ms", serde_json::json!({"sidecar_timeout_ms": "soon"})),
        ("block_bytes", serde_json::json!({"block_bytes": 1})),
        ("sidecar_clustr", serde_json::json!({"sidecar_clustr": "x"})),
    ] {
        let yaml = render(
            &shipped,
            &EnvoyOverrides {
                workers: &["127.0.0.1:1".parse()?],
                sidecar: "127.0.0.1:2".parse()?,
                wasm: &wasm,
                plugin: bad,
                baseline_listener: false,
            },
        )?;
        let (ok, log) = validate(&yaml, field)?;
        assert!(!ok, "Envoy accepted a bad {field}:\n{log}");
        assert!(
            log.contains(&format!("field `{field}`")),
            "the log does not name {field}:\n{log}"
        );
    }
    Ok(())
}
