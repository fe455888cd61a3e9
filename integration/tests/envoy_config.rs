//! The shipped Envoy configuration is valid for the real Envoy, with the real
//! filter loaded; a bad plugin configuration is rejected, naming the field.

use kvmesh_integration::envoy_config::{EnvoyOverrides, render, validate};
use kvmesh_integration::paths;

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
                sidecars: &["127.0.0.1:2".parse()?],
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
