//! The KV event edge over a real socket: the sidecar binds a SUB socket for
//! a worker (`--kv-events WORKER=tcp://127.0.0.1:0`), prints where, and a
//! ZeroMQ publisher standing in for vLLM connects and replays the eight
//! messages captured from a real vLLM 0.32. The sidecar follows the
//! engine's resident blocks to the captured run's 2, counts a garbage
//! message as an error and a replayed sequence 0 as a gap, and keeps
//! serving. Bad `--kv-events` values are reported with the others.
#![allow(clippy::unwrap_used, clippy::panic)] // test helpers fail loudly by design

mod common;

mod kv_fixtures;

use kv_fixtures::FIXTURES;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{Sidecar, http_get};
use zeromq::{Socket, SocketSend, ZmqMessage};

const WORKER: &str = "10.1.0.1:8000";

fn message(fixture: &[u8]) -> ZmqMessage {
    let mut frames = Vec::new();
    let mut rest = fixture;
    while let Some((len, tail)) = rest.split_first_chunk::<4>() {
        let len = u32::from_be_bytes(*len) as usize;
        frames.push(Bytes::copy_from_slice(&tail[..len]));
        rest = &tail[len..];
    }
    ZmqMessage::try_from(frames).unwrap()
}

fn resident(sidecar: &Sidecar) -> Option<u64> {
    let body = http_get(&sidecar.admin, "/debug/workers");
    let json = body.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    let value: serde_json::Value = serde_json::from_str(json).unwrap_or_default();
    value["workers"][0]["engine_resident_blocks"].as_u64()
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "{what} never held");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn captured_vllm_messages_reach_the_router_through_a_bound_sub_socket() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvmesh-sidecar"))
        .args(["--grpc-listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
        .args(["--worker", WORKER, "--scrape-interval-ms", "0"])
        .args(["--kv-events", &format!("{WORKER}=tcp://127.0.0.1:0")])
        .env_remove("KVMESH_WORKERS")
        .env_remove("KVMESH_KV_EVENTS")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let kv_line = lines.next().unwrap().unwrap();
    let ready = lines.next().unwrap().unwrap();
    let value = |line: &str, key: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(key))
            .unwrap_or_else(|| panic!("no {key} in {line:?}"))
            .to_owned()
    };
    assert_eq!(value(&kv_line, "worker="), WORKER, "{kv_line}");
    let endpoint = value(&kv_line, "endpoint=");
    assert!(
        endpoint.starts_with("tcp://127.0.0.1:") && !endpoint.ends_with(":0"),
        "{endpoint}"
    );
    let sidecar = Sidecar {
        grpc: value(&ready, "grpc="),
        admin: value(&ready, "admin="),
        child,
    };

    // vLLM's side: a PUB that connects.
    let mut publisher = zeromq::PubSocket::new();
    publisher.connect(&endpoint).await.unwrap();
    // A PUB drops what it sends before the subscription reaches it: send
    // garbage (counted as an error, nothing else) until one arrives.
    let errors = format!("kvmesh_kv_event_errors_total{{worker=\"{WORKER}\"}}");
    let garbage = || ZmqMessage::try_from(vec![Bytes::from_static(b"kv"), Bytes::from_static(b"short")]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while sidecar.metric(&errors).is_none() {
        assert!(Instant::now() < deadline, "the subscription never joined");
        publisher.send(garbage()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Any probe still on its way lands before what follows (one connection).
    for fixture in FIXTURES {
        publisher.send(message(fixture)).await.unwrap();
    }
    let batches = format!("kvmesh_kv_event_batches_total{{worker=\"{WORKER}\"}}");
    wait_until("eight batches", || sidecar.metric(&batches) == Some(8.0));
    assert_eq!(resident(&sidecar), Some(2));
    let resident_series = format!("kvmesh_worker_engine_resident_blocks{{worker=\"{WORKER}\"}}");
    assert_eq!(sidecar.metric(&resident_series), Some(2.0));

    // Garbage: counted, dropped.
    let before = sidecar.metric(&errors).unwrap_or(0.0);
    publisher.send(garbage()).await.unwrap();
    wait_until("one more error", || sidecar.metric(&errors) == Some(before + 1.0));

    // Sequence 0 again: a restarted publisher, a gap, resynced exactly.
    publisher.send(message(FIXTURES[0])).await.unwrap();
    let gaps = format!("kvmesh_kv_event_gaps_total{{worker=\"{WORKER}\"}}");
    wait_until("one gap", || sidecar.metric(&gaps) == Some(1.0));
    assert_eq!(resident(&sidecar), Some(4));
    // A lost message (seq 2 after 0): a gap, and residency unknown.
    publisher.send(message(FIXTURES[2])).await.unwrap();
    wait_until("two gaps", || sidecar.metric(&gaps) == Some(2.0));
    assert_eq!(resident(&sidecar), None);
    assert_eq!(sidecar.metric(&resident_series), None);
    let mut sidecar = sidecar;
    assert!(sidecar.alive());
}

#[test]
fn bad_kv_events_are_reported_with_the_other_errors() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvmesh-sidecar"))
        .args(["--worker", WORKER, "--grpc-listen", "nowhere"])
        .args(["--kv-events", "10.9.9.9:1=tcp://127.0.0.1:0"])
        .args(["--kv-events", &format!("{WORKER}=ipc:///tmp/x")])
        .env_remove("KVMESH_WORKERS")
        .env_remove("KVMESH_KV_EVENTS")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("grpc_listen")
            && err.contains("10.9.9.9:1 is not one of the workers")
            && err.contains("ipc:///tmp/x"),
        "{err}"
    );
}
