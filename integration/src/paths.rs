//! Where the artifacts under test live: the workspace's own binaries, the
//! Wasm filter, Envoy and the shipped `envoy/envoy.yaml`.

use std::path::PathBuf;

use anyhow::{Context, bail};

/// The repository root.
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map_or_else(|| PathBuf::from("."), PathBuf::from)
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| repo_root().join("target"), PathBuf::from)
}

/// Which build of the workspace's binaries to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Profile {
    /// `cargo build` (tests).
    Debug,
    /// `cargo build --release` (benchmarks).
    Release,
}

/// A workspace binary built with `profile`.
pub fn binary(name: &str, profile: Profile) -> anyhow::Result<PathBuf> {
    let (dir, build) = match profile {
        Profile::Debug => ("debug", "cargo build --workspace --bins"),
        Profile::Release => ("release", "cargo build --release --workspace --bins"),
    };
    let path = target_dir().join(dir).join(name);
    if !path.is_file() {
        bail!("{} is missing: run `{build}` first", path.display());
    }
    Ok(path)
}

/// The release build of the filter, as Envoy loads it.
pub fn filter_wasm() -> anyhow::Result<PathBuf> {
    let path = std::env::var_os("KVMESH_FILTER_WASM").map_or_else(
        || target_dir().join("wasm32-wasip1/release/kvmesh_filter.wasm"),
        PathBuf::from,
    );
    if !path.is_file() {
        bail!("{} is missing: run `just build` first", path.display());
    }
    path.canonicalize().context("resolving the Wasm path")
}

/// The filter built with its `crash-test` feature (by `just build`): it
/// panics on a request carrying `x-kvmesh-test-crash`, so tests can watch
/// Envoy rebuild a failed VM. Never shipped.
pub fn crash_test_wasm() -> anyhow::Result<PathBuf> {
    let path = target_dir().join("crash-test/wasm32-wasip1/release/kvmesh_filter.wasm");
    if !path.is_file() {
        bail!("{} is missing: run `just build` first", path.display());
    }
    path.canonicalize().context("resolving the Wasm path")
}

/// Envoy: `$KVMESH_ENVOY`, else the one `./dev` installs, else `envoy` on PATH.
pub fn envoy() -> PathBuf {
    if let Some(path) = std::env::var_os("KVMESH_ENVOY") {
        return PathBuf::from(path);
    }
    let local = repo_root().join(".tools/venv/bin/envoy");
    if local.is_file() { local } else { PathBuf::from("envoy") }
}

/// The shipped standalone Envoy configuration.
pub fn envoy_yaml() -> PathBuf {
    repo_root().join("envoy/envoy.yaml")
}

/// Copies the tree at `from` into `to` (created if missing).
pub fn copy_dir(from: &std::path::Path, to: &std::path::Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from).with_context(|| format!("reading {}", from.display()))? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_dir(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), &target)?;
        }
    }
    Ok(())
}
