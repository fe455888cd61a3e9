//! A child process started in its own session (`setsid`), whose readiness is
//! a line it prints, and which is stopped by its pid when dropped. One that
//! forks helpers of its own (vLLM's engine core and worker) can be stopped
//! with its whole process group, whose id is its pid.

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
    /// Signal the process group (`-pid`), not only the process.
    group: bool,
}

/// How to start a process, beyond its program and arguments.
#[derive(Debug, Clone, Default)]
pub struct SpawnOptions {
    /// Added to the inherited environment.
    pub env: Vec<(String, String)>,
    /// Write stdout to the log with stderr (for a program that logs to
    /// stdout and signals readiness some other way: no `wait_for_line`).
    pub stdout_to_log: bool,
    /// Stop and kill the whole process group, so that children the
    /// process forked go with it even when it is killed first.
    pub group: bool,
}

impl Process {
    /// Starts `program args` under `setsid`, stdout captured line by line and
    /// stderr written to `log_dir/<name>.log`.
    pub fn spawn(name: &str, program: &Path, args: &[String], log_dir: &Path) -> anyhow::Result<Self> {
        Self::spawn_with(name, program, args, &SpawnOptions::default(), log_dir)
    }

    /// As `spawn`, with `options`.
    pub fn spawn_with(
        name: &str,
        program: &Path,
        args: &[String],
        options: &SpawnOptions,
        log_dir: &Path,
    ) -> anyhow::Result<Self> {
        let log = log_dir.join(format!("{name}.log"));
        let stderr = std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let stdout = if options.stdout_to_log {
            Stdio::from(stderr.try_clone().context("sharing the log")?)
        } else {
            Stdio::piped()
        };
        // `setsid` execs the program in place (same pid) because the test
        // process's child is never a process-group leader.
        let mut child = Command::new("setsid")
            .arg(program)
            .args(args)
            .envs(options.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(stdout)
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
            group: options.group,
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

    /// The whole log without terminal colour codes (`ESC [ ... letter`),
    /// which tracing may write even to a file.
    pub fn plain_log(&self) -> String {
        without_colour(&self.log())
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

    /// Sends `signal` to this process's group (`-pid`): it and every
    /// process it forked. `setsid` made the group's id the pid.
    fn signal_group(&self, signal: Option<Signal>) -> nix::Result<()> {
        let pid = Pid::from_raw(i32::try_from(self.pid()).map_err(|_| nix::errno::Errno::ESRCH)?);
        nix::sys::signal::killpg(pid, signal)
    }

    /// Sends `signal` to what this process stops with: its group when
    /// started with `SpawnOptions::group`, else itself.
    fn signal_stop(&self, signal: Signal) {
        if self.group {
            let _ = self.signal_group(Some(signal));
        } else {
            let _ = self.signal(signal);
        }
    }

    /// Kills the process (SIGKILL; its group too with
    /// `SpawnOptions::group`) and reaps it.
    pub fn kill(&mut self) -> anyhow::Result<()> {
        // Resume first: a stopped process still dies of SIGKILL, but say so.
        self.signal_stop(Signal::SIGCONT);
        if self.group {
            // Before reaping: while the leader is unreaped its pid cannot
            // name anyone else's group.
            let _ = self.signal_group(Some(Signal::SIGKILL));
        }
        self.child.kill().context("killing")?;
        self.child.wait().context("reaping")?;
        Ok(())
    }

    /// Asks the process to stop (SIGTERM), then kills it if it lingers.
    /// With `SpawnOptions::group`, the same for every process of its group.
    pub fn stop(&mut self) {
        if !self.group && matches!(self.child.try_wait(), Ok(Some(_))) {
            return;
        }
        self.signal_stop(Signal::SIGCONT);
        self.signal_stop(Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            let leader_gone = matches!(self.child.try_wait(), Ok(Some(_)));
            // A group is gone when signal 0 finds no member. While one
            // lives, the group id stays its and cannot be reused.
            if leader_gone && (!self.group || self.signal_group(None).is_err()) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        if self.group {
            let _ = self.signal_group(Some(Signal::SIGKILL));
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

/// `text` without terminal colour codes (`ESC [ ... letter`).
pub fn without_colour(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// A process's resident set and its peak (VmRSS, VmHWM), in KiB, from
/// /proc; `None` once it is gone.
pub fn memory_kib(pid: u32) -> Option<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| -> Option<u64> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Gone, or a zombie waiting for init to reap it.
    fn is_gone(pid: u32) -> bool {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |stat| {
            stat.rsplit(')')
                .next()
                .is_some_and(|rest| rest.trim_start().starts_with('Z'))
        })
    }

    #[test]
    fn stopping_a_group_also_stops_the_children_it_forked() -> anyhow::Result<()> {
        let dir = std::env::temp_dir().join(format!("kvmesh-process-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        // A shell that forks a child, the way vLLM's
        // API server forks its engine core.
        let mut process = Process::spawn_with(
            "forker",
            Path::new("sh"),
            &["-c".to_owned(), "sleep 300 & echo child $!; wait".to_owned()],
            &SpawnOptions {
                group: true,
                ..SpawnOptions::default()
            },
            &dir,
        )?;
        let line = process.wait_for_line("child ", Duration::from_secs(10))?;
        let child: u32 = line.trim_start_matches("child ").trim().parse()?;
        assert!(!is_gone(child));
        drop(process);
        let deadline = Instant::now() + Duration::from_secs(5);
        while !is_gone(child) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(is_gone(child), "the forked child {child} outlived its group's stop");
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }
}
