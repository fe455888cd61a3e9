//! The sidecar binary as a gRPC server: health, Pick and Report over a real
//! socket, and its command line.
#![allow(clippy::unwrap_used, clippy::panic)] // test helpers fail loudly by design

mod common;

use std::process::{Command, Stdio};

use common::{WORKERS, first_line, http_get, spawn, start};
use kvmesh_proto::v1::router_client::RouterClient;
use kvmesh_proto::v1::{Outcome, PickReason, PickRequest};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

fn pick(hashes: &[u64], session: &str) -> PickRequest {
    PickRequest {
        block_hashes: hashes.to_vec(),
        session_id: session.to_owned(),
        block_bytes: 256,
        ..PickRequest::default()
    }
}

#[tokio::test]
async fn health_pick_and_report_over_grpc() {
    let sidecar = start();
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", sidecar.grpc))
        .unwrap()
        .connect()
        .await
        .unwrap();

    let health = HealthClient::new(channel.clone())
        .check(HealthCheckRequest {
            service: "kvmesh.v1.Router".to_owned(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(health.status(), ServingStatus::Serving);

    let mut router = RouterClient::new(channel);
    let first = router.pick(pick(&[1, 2, 3, 4], "s1")).await.unwrap().into_inner();
    assert_eq!(first.reason(), PickReason::LeastLoaded);
    assert_eq!(first.destinations.len(), 3);
    assert!(WORKERS.split(',').any(|w| w == first.destinations[0]));
    assert_eq!(first.predicted_cached_blocks, 0);

    let second = router.pick(pick(&[1, 2, 3, 4, 5, 6], "s1")).await.unwrap().into_inner();
    assert_eq!(second.reason(), PickReason::PrefixMatch);
    assert_eq!(second.destinations[0], first.destinations[0]);
    assert_eq!(second.predicted_cached_blocks, 4);
    assert_ne!(second.pick_id, first.pick_id);

    for id in [first.pick_id, second.pick_id] {
        router
            .report(Outcome {
                pick_id: id,
                ..Outcome::default()
            })
            .await
            .unwrap();
    }
}

#[test]
fn help_documents_flags_and_environment() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvmesh-sidecar"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "--worker",
        "KVMESH_WORKERS",
        "--grpc-listen",
        "127.0.0.1:50051",
        "--config",
        "--admin-listen",
    ] {
        assert!(help.contains(needle), "--help lacks {needle}:\n{help}");
    }
}

#[test]
fn bad_settings_are_all_reported_at_once() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvmesh-sidecar"))
        .args(["--worker", "gpu-0.example:8000", "--grpc-listen", "nowhere"])
        .env_remove("KVMESH_WORKERS")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("gpu-0.example:8000") && err.contains("grpc_listen"),
        "{err}"
    );
}

#[test]
fn a_toml_file_configures_and_flags_override_it() {
    let dir = std::env::temp_dir().join(format!("kvmesh-sidecar-toml-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("sidecar.toml");
    std::fs::write(
        &file,
        "workers = [\"10.0.0.9:80\"]\ngrpc_listen = \"127.0.0.1:0\"\nadmin_listen = \"not an address\"\n",
    )
    .unwrap();
    // The file's bad admin address is overridden by the flag: it starts.
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvmesh-sidecar"))
        .arg("--config")
        .arg(&file)
        .args(["--admin-listen", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let line = first_line(&mut child);
    let _ = child.kill();
    let _ = child.wait();
    assert!(line.contains("listening grpc=127.0.0.1:"), "{line:?}");
    // Without the flag, the file's error is reported.
    let out = Command::new(env!("CARGO_BIN_EXE_kvmesh-sidecar"))
        .arg("--config")
        .arg(&file)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("admin_listen"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn workers_given_as_dns_names_are_resolved_and_picked() {
    let (mut child, admin) = spawn(
        &[
            "--worker-dns",
            "localhost:8123",
            "--dns-interval-secs",
            "1",
            "--scrape-interval-ms",
            "0",
        ],
        "admin=",
    );
    // Poll the admin page (plain HTTP/1.1 over a std socket) until the
    // resolved address shows up as a worker.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let found = loop {
        let body = http_get(&admin, "/debug/workers");
        if body.contains("127.0.0.1:8123") || body.contains("[::1]:8123") {
            break true;
        }
        if std::time::Instant::now() > deadline {
            break false;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let _ = child.kill();
    let _ = child.wait();
    assert!(found, "localhost:8123 never became a worker");
}
