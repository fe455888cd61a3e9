//! A real `redis-server` for tests, on a unix socket in the test's scratch
//! directory (no TCP port at all), stopped by its pid.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::bail;

use crate::process::Process;

/// A running redis-server.
#[derive(Debug)]
pub struct RedisServer {
    pub socket: PathBuf,
    process: Option<Process>,
    dir: PathBuf,
}

fn redis_binary() -> PathBuf {
    std::env::var_os("KVMESH_REDIS_SERVER").map_or_else(|| PathBuf::from("redis-server"), PathBuf::from)
}

impl RedisServer {
    pub fn start(dir: &Path) -> anyhow::Result<Self> {
        let mut server = Self {
            socket: dir.join("redis.sock"),
            process: None,
            dir: dir.to_path_buf(),
        };
        server.restart()?;
        Ok(server)
    }

    /// The URL sidecars connect with.
    pub fn url(&self) -> String {
        format!("unix://{}", self.socket.display())
    }

    /// Starts (again) an empty server on the same socket.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        let args: Vec<String> = [
            "--port",
            "0",
            "--unixsocket",
            &self.socket.display().to_string(),
            "--unixsocketperm",
            "700",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            &self.dir.display().to_string(),
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        self.process = Some(Process::spawn("redis", &redis_binary(), &args, &self.dir)?);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if ping(&self.socket) {
                return Ok(());
            }
            if Instant::now() > deadline {
                let tail = self.process.as_ref().map(Process::log_tail).unwrap_or_default();
                bail!("redis-server did not answer on {}:\n{tail}", self.socket.display());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sends `signal` to the server by its pid (SIGSTOP stalls it: sockets
    /// stay open and nothing is answered; SIGCONT resumes it).
    pub fn signal(&self, signal: crate::process::Signal) -> anyhow::Result<()> {
        match &self.process {
            Some(process) => process.signal(signal),
            None => bail!("redis-server is not running"),
        }
    }

    /// Kills the server (SIGKILL): everything in it is lost.
    pub fn kill(&mut self) -> anyhow::Result<()> {
        if let Some(mut process) = self.process.take() {
            process.kill()?;
        }
        let _ = std::fs::remove_file(&self.socket);
        Ok(())
    }
}

fn ping(socket: &Path) -> bool {
    let Ok(mut stream) = UnixStream::connect(socket) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
    if stream.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut reply = [0u8; 7];
    stream.read_exact(&mut reply).is_ok() && &reply == b"+PONG\r\n"
}
