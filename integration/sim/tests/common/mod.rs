//! A running `kvmesh-sim` for the tests of this directory: started on a
//! loopback port it reports, spoken to over raw HTTP/1.1, killed when
//! dropped.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test helpers fail loudly by design

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;

/// A running `kvmesh-sim`, killed when dropped.
pub(crate) struct Sim {
    child: Child,
    addr: SocketAddr,
    /// Its stdout, kept open so that it never writes to a closed pipe.
    _stdout: BufReader<std::process::ChildStdout>,
}

impl Sim {
    pub(crate) fn start(args: &[&str], env: &[(&str, &str)]) -> Self {
        let mut command = Command::new(env!("CARGO_BIN_EXE_kvmesh-sim"));
        command
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .env_remove("KVMESH_SIM_AGENT_SCRIPT")
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        // Instant engines unless the test sets a time scale.
        if !args.contains(&"--time-scale") {
            command.args(["--time-scale", "0"]);
        }
        for (key, value) in env {
            command.env(key, value);
        }
        let mut child = command.spawn().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        let addr = line.trim().rsplit(' ').next().unwrap().parse().unwrap();
        Self {
            child,
            addr,
            _stdout: stdout,
        }
    }

    /// POSTs `body` to `path`; the status and the (de-chunked) body.
    pub(crate) fn post(&self, path: &str, body: &Value) -> (u16, String) {
        let body = body.to_string();
        let mut tcp = TcpStream::connect(self.addr).unwrap();
        tcp.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        write!(
            tcp,
            "POST {path} HTTP/1.1\r\nHost: sim\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut raw = Vec::new();
        tcp.read_to_end(&mut raw).unwrap();
        let raw = String::from_utf8(raw).unwrap();
        let (head, mut rest) = raw.split_once("\r\n\r\n").unwrap();
        let status = head.split(' ').nth(1).unwrap().parse().unwrap();
        if !head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
            return (status, rest.to_owned());
        }
        let mut body = String::new();
        loop {
            let (size, tail) = rest.split_once("\r\n").unwrap();
            let size = usize::from_str_radix(size, 16).unwrap();
            if size == 0 {
                return (status, body);
            }
            body.push_str(&tail[..size]);
            rest = &tail[size + 2..];
        }
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Sim {
    /// GETs `path`; its body (the sim answers these unchunked).
    pub(crate) fn get(&self, path: &str) -> String {
        let mut tcp = TcpStream::connect(self.addr).unwrap();
        tcp.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        write!(tcp, "GET {path} HTTP/1.1\r\nHost: sim\r\nConnection: close\r\n\r\n").unwrap();
        let mut raw = String::new();
        tcp.read_to_string(&mut raw).unwrap();
        raw.split_once("\r\n\r\n")
            .map(|(_, body)| body.to_owned())
            .unwrap_or_default()
    }

    /// Sends `body` to `path` and hangs up as soon as `ready` says so,
    /// without reading the reply.
    pub(crate) fn post_and_hang_up(&self, path: &str, body: &Value, ready: impl Fn() -> bool) {
        let body = body.to_string();
        let mut tcp = TcpStream::connect(self.addr).unwrap();
        write!(
            tcp,
            "POST {path} HTTP/1.1\r\nHost: sim\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while !ready() {
            assert!(std::time::Instant::now() < deadline, "the request never got ready");
            std::thread::sleep(Duration::from_millis(5));
        }
        drop(tcp);
    }
}
