//! Helpers of the sidecar's binary tests: start it on ephemeral ports, read
//! its ready line, fetch its admin pages.
#![allow(dead_code, clippy::unwrap_used, clippy::panic)] // each test file uses some; helpers fail loudly

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

pub(crate) const WORKERS: &str = "10.1.0.1:8000,10.1.0.2:8000,10.1.0.3:8000";

/// A running sidecar, killed when dropped.
pub(crate) struct Sidecar {
    pub(crate) child: Child,
    pub(crate) grpc: String,
    pub(crate) admin: String,
}

impl Sidecar {
    /// Still running (not exited, e.g. by a panic that aborted it).
    pub(crate) fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    pub(crate) async fn channel(&self) -> tonic::transport::Channel {
        tonic::transport::Endpoint::from_shared(format!("http://{}", self.grpc))
            .unwrap()
            .connect()
            .await
            .unwrap()
    }

    /// A sample of /metrics by its exact series (name and labels).
    pub(crate) fn metric(&self, series: &str) -> Option<f64> {
        let body = http_get(&self.admin, "/metrics");
        body.lines()
            .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
    }
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The sidecar's first stdout line: the addresses it bound, once it serves.
pub(crate) fn first_line(child: &mut Child) -> String {
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    line
}

fn value_of(line: &str, key: &str) -> String {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key))
        .unwrap_or_else(|| panic!("no {key} in {line:?}"))
        .to_owned()
}

/// Starts the sidecar on ephemeral ports with `args`; returns it once it
/// serves, with the value of `key=` from its ready line.
pub(crate) fn spawn(args: &[&str], key: &str) -> (Child, String) {
    let (child, line) = launch(args);
    let value = value_of(&line, key);
    (child, value)
}

/// The sidecar on free loopback ports with `args`, and its ready line.
fn launch(args: &[&str]) -> (Child, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvmesh-sidecar"))
        .args(["--grpc-listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
        .args(args)
        .env_remove("KVMESH_WORKERS")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let line = first_line(&mut child);
    (child, line)
}

/// The sidecar with three placeholder workers (nothing scraped).
pub(crate) fn start() -> Sidecar {
    let (child, line) = launch(&["--worker", WORKERS, "--scrape-interval-ms", "0"]);
    Sidecar {
        grpc: value_of(&line, "grpc="),
        admin: value_of(&line, "admin="),
        child,
    }
}

pub(crate) fn http_get(addr: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let Ok(mut stream) = std::net::TcpStream::connect(addr) else {
        return String::new();
    };
    let _ = write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    );
    let mut out = String::new();
    let _ = stream.read_to_string(&mut out);
    out
}
