//! A child process started in its own session (`setsid`), whose readiness is
//! a line it prints, and which is stopped by its pid when dropped.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
pub use nix::sys::signal::Signal;
use nix::unistd::Pid;

/// A running child process.
#[derive(Debug)]
pub struct Process {
    name: String,
    child: Child,
    log: PathBuf,
    /// In a mutex only so a cluster can be shared between test tasks.
    lines: std::sync::Mutex<mpsc::Receiver<String>>,
}

impl Process {
    /// Starts `program args` under `setsid`, stdout captured line by line and
    /// stderr written to `log_dir/<name>.log`.
    pub fn spawn(name: &str, program: &Path, args: &[String], log_dir: &Path) -> anyhow::Result<Self> {
        let log = log_dir.join(format!("{name}.log"));
        let stderr = std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        // `setsid` execs the program in place (same pid) because the test
        // process's child is never a process-group leader.
        let mut child = Command::new("setsid")
            .arg(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(stderr))
            .spawn()
            .with_context(|| format!("starting {}", program.display()))?;
        let (tx, lines) = mpsc::channel();
        if let Some(stdout) = child.stdout.take() {
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            });
        }
        Ok(Self {
            name: name.to_owned(),
            child,
            log,
            lines: std::sync::Mutex::new(lines),
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for a stdout line containing `needle` and returns it.
    pub fn wait_for_line(&mut self, needle: &str, timeout: Duration) -> anyhow::Result<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let lines = self.lines.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner);
            match lines.recv_timeout(left.min(Duration::from_millis(100))) {
                Ok(line) if line.contains(needle) => return Ok(line),
                Ok(_) | Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    bail!("{} exited before printing {needle:?}:\n{}", self.name, self.log_tail())
                }
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                bail!(
                    "{} exited ({status}) before printing {needle:?}:\n{}",
                    self.name,
                    self.log_tail()
                );
            }
            if Instant::now() >= deadline {
                bail!(
                    "{} did not print {needle:?} within {timeout:?}:\n{}",
                    self.name,
                    self.log_tail()
                );
            }
        }
    }

    /// The process's whole stderr log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits up to `timeout` for the process to exit; its status, or `None`
    /// if it is still running.
    pub fn wait_exit(&mut self, timeout: Duration) -> anyhow::Result<Option<std::process::ExitStatus>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().context("waiting")? {
                return Ok(Some(status));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The last lines of the process's stderr log, for failure messages.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    /// Sends `signal` to this process, by its pid.
    pub fn signal(&self, signal: Signal) -> anyhow::Result<()> {
        let pid = Pid::from_raw(i32::try_from(self.pid())?);
        nix::sys::signal::kill(pid, signal).with_context(|| format!("kill -{signal} {pid}"))
    }

    /// Kills the process (SIGKILL) and reaps it.
    pub fn kill(&mut self) -> anyhow::Result<()> {
        // Resume first: a stopped process still dies of SIGKILL, but say so.
        let _ = self.signal(Signal::SIGCONT);
        self.child.kill().context("killing")?;
        self.child.wait().context("reaping")?;
        Ok(())
    }

    /// Asks the process to stop (SIGTERM), then kills it if it lingers.
    pub fn stop(&mut self) {
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return;
        }
        let _ = self.signal(Signal::SIGCONT);
        let _ = self.signal(Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.stop();
    }
}
