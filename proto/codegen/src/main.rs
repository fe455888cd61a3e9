//! Regenerates the Rust code of `proto/kvmesh/v1/kvmesh.proto` into
//! `proto/src/gen/`, or with `--check` fails when the committed code drifted.
//!
//! The code is committed (not built by a build script) so that the Wasm filter
//! builds without `protoc` and without this tool's dependencies. `protox`
//! compiles the proto in pure Rust, so no `protoc` binary is needed either.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};

const PROTO: &str = "kvmesh/v1/kvmesh.proto";
/// Messages only: what the Wasm filter compiles.
const MESSAGES_FILE: &str = "kvmesh.v1.rs";
/// The tonic service, referring to the messages by path: only native builds.
const SERVICE_FILE: &str = "kvmesh.v1.tonic.rs";

fn main() -> anyhow::Result<()> {
    let check = match std::env::args().nth(1).as_deref() {
        None => false,
        Some("--check") => true,
        Some("-h" | "--help") => {
            println!(
                "usage: kvmesh-proto-codegen [--check]\n\n\
                 Regenerates proto/src/gen from proto/kvmesh/v1/kvmesh.proto.\n  \
                 --check  regenerate into a temporary directory and fail if the\n           \
                 committed files differ"
            );
            return Ok(());
        }
        Some(other) => bail!("unknown argument {other:?} (try --help)"),
    };
    let proto_root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let committed = proto_root.join("src/gen");
    if check {
        check_committed(&proto_root)?;
        println!("proto/src/gen is up to date");
    } else {
        generate(&proto_root, &committed)?;
        println!("regenerated {}", committed.display());
    }
    Ok(())
}

/// Regenerates into a scratch directory and compares with the committed code.
fn check_committed(proto_root: &Path) -> anyhow::Result<()> {
    let scratch = std::env::temp_dir().join(format!("kvmesh-codegen-{}", std::process::id()));
    std::fs::create_dir_all(&scratch)?;
    let result = generate(proto_root, &scratch).and_then(|()| compare(&scratch, &proto_root.join("src/gen")));
    let _ = std::fs::remove_dir_all(&scratch);
    result
}

fn generate(proto_root: &Path, out_dir: &Path) -> anyhow::Result<()> {
    let descriptors = protox::compile([PROTO], [proto_root]).context("compiling kvmesh.proto")?;

    prost_build::Config::new()
        .out_dir(out_dir)
        .compile_fds(descriptors.clone())
        .context("generating messages")?;

    // A second pass for the service alone: `extern_path` makes it refer to the
    // messages generated above instead of emitting them again.
    let service_dir = out_dir.join("service");
    std::fs::create_dir_all(&service_dir)?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .build_transport(false)
        .extern_path(".kvmesh.v1", "crate::v1")
        .out_dir(&service_dir)
        .compile_fds(descriptors)
        .context("generating the tonic service")?;
    std::fs::rename(service_dir.join(MESSAGES_FILE), out_dir.join(SERVICE_FILE))?;
    std::fs::remove_dir_all(&service_dir)?;
    Ok(())
}

fn compare(generated: &Path, committed: &Path) -> anyhow::Result<()> {
    let mut drifted = Vec::new();
    for name in [MESSAGES_FILE, SERVICE_FILE] {
        let fresh = std::fs::read(generated.join(name))?;
        let old = std::fs::read(committed.join(name)).unwrap_or_default();
        if fresh != old {
            drifted.push(name);
        }
    }
    if !drifted.is_empty() {
        bail!(
            "generated code drifted from kvmesh.proto: {}; run `just codegen` and commit",
            drifted.join(", ")
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn committed_code_matches_the_proto() -> anyhow::Result<()> {
        let proto_root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
        super::check_committed(&proto_root)
    }
}
