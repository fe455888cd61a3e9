//! The four real agent harness CLIs (Claude Code, Codex, OpenCode, OpenClaw),
//! as `./dev setup-harnesses` installs them into `.tools/harnesses`, run
//! non-interactively against a base URL: each in a scratch `HOME` and a
//! scratch git repository, with telemetry, update checks and analytics off,
//! stopped with its whole process group by its pid. What each CLI sends is
//! in docs/harnesses/.

use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::Duration;

use anyhow::{Context, bail};

use kvmesh_vocab::Harness;

use crate::paths::{self, copy_dir};
use crate::process::{Process, SpawnOptions};
use crate::vllm::free_port;

/// The versions `integration/harnesses/setup.sh` pins (docs/testing.md).
pub const VERSIONS: [(Cli, &str); 4] = [
    (Cli::ClaudeCode, "2.1.197"),
    (Cli::Codex, "0.171.0"),
    (Cli::OpenCode, "1.18.33"),
    (Cli::OpenClaw, "2026.9.6"),
];

/// A prompt the scripted model answers with one shell call, then text.
pub const PROMPT_ONE_TOOL: &str = "KV1: run echo hi in the shell and tell me what it printed";

/// A prompt the scripted model answers with a shell call, a call to the
/// harness's subagent tool, then text (the sim's `--agent-script` reacts to
/// `KVSPAWN`).
pub const PROMPT_SUBAGENT: &str =
    "KVSPAWN: run echo hi in the shell, then spawn a subagent to run echo sub, wait for it, then report";

/// One harness CLI.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cli {
    ClaudeCode,
    Codex,
    OpenCode,
    OpenClaw,
}

/// The API OpenCode and OpenClaw speak to their custom provider (Claude
/// Code always speaks Messages, Codex Responses).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProviderApi {
    Chat,
    Messages,
    Responses,
}

/// Where `.tools/harnesses` keeps Node 24 and the CLIs.
fn tools() -> anyhow::Result<PathBuf> {
    let dir = paths::repo_root().join(".tools/harnesses");
    if !dir.join(".kvmesh-installed").is_file() {
        bail!(
            "the harness CLIs are not installed in {}: run `./dev setup-harnesses`",
            dir.display()
        );
    }
    Ok(dir)
}

/// A scratch user: a `HOME` and a git repository with one commit, both
/// under `dir`.
#[derive(Debug, Clone)]
pub struct Scratch {
    pub home: PathBuf,
    pub repo: PathBuf,
}

impl Scratch {
    pub fn new(dir: &Path, name: &str) -> anyhow::Result<Self> {
        let home = dir.join(format!("home-{name}"));
        let repo = dir.join(format!("repo-{name}"));
        std::fs::create_dir_all(&home)?;
        std::fs::create_dir_all(&repo)?;
        std::fs::write(repo.join("README.md"), "hello\n")?;
        for args in [
            &["init", "-q"][..],
            &["add", "README.md"],
            &[
                "-c",
                "user.email=kvmesh@localhost",
                "-c",
                "user.name=kvmesh",
                "commit",
                "-qm",
                "init",
            ],
        ] {
            let status = std::process::Command::new("git")
                .args(args)
                .current_dir(&repo)
                .env("HOME", &home)
                .stdin(std::process::Stdio::null())
                .status()
                .context("running git")?;
            if !status.success() {
                bail!("git {args:?} failed in {}", repo.display());
            }
        }
        Ok(Self { home, repo })
    }
}

/// One run of a CLI: its process and where its stdout goes.
#[derive(Debug)]
pub struct Run {
    pub process: Process,
    pub stdout: PathBuf,
}

impl Run {
    /// Waits for the CLI to end; fails with its log if it does not within
    /// `timeout` (the process group is then stopped by its pid).
    pub fn finish(mut self, timeout: Duration) -> anyhow::Result<(ExitStatus, String)> {
        match self.process.wait_exit(timeout)? {
            Some(status) => {
                let stdout = std::fs::read_to_string(&self.stdout).unwrap_or_default();
                Ok((status, stdout))
            }
            None => {
                let log = self.process.log_tail();
                self.process.stop();
                bail!("the CLI did not end within {timeout:?}:\n{log}")
            }
        }
    }
}

/// The environment every CLI runs with: Node 24 first on `PATH`, the
/// scratch `HOME`, and every telemetry, update and analytics switch off.
fn env(scratch: &Scratch) -> anyhow::Result<Vec<(String, String)>> {
    let tools = tools()?;
    let path = format!(
        "{}:{}:{}",
        tools.join("node/bin").display(),
        tools.join("node_modules/.bin").display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut env: Vec<(String, String)> = vec![
        ("PATH".into(), path),
        ("HOME".into(), scratch.home.display().to_string()),
        (
            "XDG_CONFIG_HOME".into(),
            scratch.home.join(".config").display().to_string(),
        ),
        (
            "XDG_DATA_HOME".into(),
            scratch.home.join(".local/share").display().to_string(),
        ),
        (
            "XDG_CACHE_HOME".into(),
            scratch.home.join(".cache").display().to_string(),
        ),
        (
            "XDG_STATE_HOME".into(),
            scratch.home.join(".local/state").display().to_string(),
        ),
        ("NO_COLOR".into(), "1".into()),
        ("DO_NOT_TRACK".into(), "1".into()),
    ];
    // Claude Code.
    for key in [
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC",
        "DISABLE_TELEMETRY",
        "DISABLE_AUTOUPDATER",
        "DISABLE_ERROR_REPORTING",
        "IS_SANDBOX",
    ] {
        env.push((key.into(), "1".into()));
    }
    // OpenCode.
    for key in [
        "OPENCODE_DISABLE_AUTOUPDATE",
        "OPENCODE_DISABLE_MODELS_FETCH",
        "OPENCODE_DISABLE_LSP_DOWNLOAD",
        "OPENCODE_DISABLE_DEFAULT_PLUGINS",
        "OPENCODE_DISABLE_CLAUDE_CODE",
    ] {
        env.push((key.into(), "1".into()));
    }
    // OpenClaw.
    env.push(("OPENCLAW_NO_UPDATE_CHECK".into(), "1".into()));
    env.push(("OPENCLAW_DISABLE_TELEMETRY".into(), "1".into()));
    // Codex.
    env.push(("CODEX_HOME".into(), scratch.home.join(".codex").display().to_string()));
    env.push(("KV_API_KEY".into(), "sk-kvmesh-test".into()));
    // Claude Code's key; OpenCode's and OpenClaw's are in their configs.
    env.push(("ANTHROPIC_API_KEY".into(), "sk-ant-kvmesh-test".into()));
    Ok(env)
}

/// Starts `program args` in `scratch.repo` under `setsid`, stdout into a
/// file, stderr into the log, stopped with its group.
fn spawn(
    name: &str,
    scratch: &Scratch,
    extra_env: &[(&str, String)],
    program: &str,
    args: &[String],
    log_dir: &Path,
) -> anyhow::Result<Run> {
    let mut env = env(scratch)?;
    env.extend(extra_env.iter().map(|(k, v)| ((*k).to_owned(), v.clone())));
    let stdout = log_dir.join(format!("{name}.stdout"));
    // A shell that moves into the repository and puts stdout in a file,
    // then execs the CLI in its place (same pid, same group).
    let mut shell_args = vec![
        "-c".to_owned(),
        r#"cd "$0" && out="$1" && shift 2 && exec "$@" >"$out""#.to_owned(),
        scratch.repo.display().to_string(),
        stdout.display().to_string(),
        "--".to_owned(),
        program.to_owned(),
    ];
    shell_args.extend(args.iter().cloned());
    let options = SpawnOptions {
        env,
        stdout_to_log: true,
        group: true,
    };
    let process = Process::spawn_with(name, Path::new("bash"), &shell_args, &options, log_dir)?;
    Ok(Run { process, stdout })
}

impl Cli {
    /// The harness kvmesh should recognise the CLI as.
    pub fn harness(self) -> Harness {
        match self {
            Self::ClaudeCode => Harness::ClaudeCode,
            Self::Codex => Harness::Codex,
            Self::OpenCode => Harness::OpenCode,
            Self::OpenClaw => Harness::OpenClaw,
        }
    }

    /// The harness's name, as kvmesh labels it.
    pub fn name(self) -> &'static str {
        self.harness().name()
    }

    /// Writes the CLI's configuration into `scratch.home`: its model
    /// provider at `base_url` (scheme, host and port, no path), speaking
    /// `api` where the CLI lets one choose. OpenClaw's onboarding runs the
    /// CLI itself (up to a few minutes on a loaded machine).
    pub fn configure(self, scratch: &Scratch, base_url: &str, api: ProviderApi, log_dir: &Path) -> anyhow::Result<()> {
        match self {
            // Claude Code reads only its environment (`ANTHROPIC_BASE_URL`).
            Self::ClaudeCode => Ok(()),
            Self::Codex => {
                let dir = scratch.home.join(".codex");
                std::fs::create_dir_all(&dir)?;
                let config = format!(
                    "model_provider = \"kv\"\n\
                     check_for_update_on_startup = false\n\
                     [model_providers.kv]\n\
                     name = \"kv\"\n\
                     base_url = \"{base_url}/v1\"\n\
                     wire_api = \"responses\"\n\
                     env_key = \"KV_API_KEY\"\n\
                     [analytics]\n\
                     enabled = false\n\
                     [feedback]\n\
                     enabled = false\n\
                     [projects.\"{}\"]\n\
                     trust_level = \"trusted\"\n",
                    scratch.repo.display()
                );
                std::fs::write(dir.join("config.toml"), config)?;
                Ok(())
            }
            Self::OpenCode => {
                let dir = scratch.home.join(".config/opencode");
                std::fs::create_dir_all(&dir)?;
                // Its plugin package, so that it fetches nothing at run time.
                copy_dir(&tools()?.join("opencode-config"), &dir)?;
                let npm = match api {
                    ProviderApi::Chat => "@ai-sdk/openai-compatible",
                    ProviderApi::Messages => "@ai-sdk/anthropic",
                    ProviderApi::Responses => "@ai-sdk/openai",
                };
                let model = |name: &str| {
                    serde_json::json!({"name": name, "tool_call": true,
                        "limit": {"context": 200_000, "output": 8192}})
                };
                let config = serde_json::json!({
                    "autoupdate": false,
                    "share": "disabled",
                    "model": "kv/kv-model",
                    "small_model": "kv/kv-small",
                    "provider": {"kv": {
                        "npm": npm,
                        "name": "kvmesh",
                        "options": {"baseURL": format!("{base_url}/v1"), "apiKey": "sk-kvmesh-test"},
                        "models": {"kv-model": model("kv-model"), "kv-small": model("kv-small")},
                    }},
                });
                std::fs::write(dir.join("opencode.json"), serde_json::to_vec_pretty(&config)?)?;
                Ok(())
            }
            Self::OpenClaw => {
                let compatibility = match api {
                    ProviderApi::Chat => "openai",
                    ProviderApi::Messages => "anthropic",
                    ProviderApi::Responses => "openai-responses",
                };
                let gateway_port = free_port()?.to_string();
                let args: Vec<String> = [
                    "onboard",
                    "--non-interactive",
                    "--accept-risk",
                    "--mode",
                    "local",
                    "--flow",
                    "quickstart",
                    "--auth-choice",
                    "custom-api-key",
                    "--custom-base-url",
                    &format!("{base_url}/v1"),
                    "--custom-model-id",
                    "kv-model",
                    "--custom-api-key",
                    "sk-kvmesh-test",
                    "--custom-compatibility",
                    compatibility,
                    "--custom-text-input",
                    "--workspace",
                    &scratch.repo.display().to_string(),
                    "--skip-channels",
                    "--skip-daemon",
                    "--no-install-daemon",
                    "--skip-health",
                    "--skip-hooks",
                    "--skip-search",
                    "--skip-skills",
                    "--skip-ui",
                    "--gateway-auth",
                    "token",
                    "--gateway-token",
                    OPENCLAW_GATEWAY_TOKEN,
                    "--gateway-bind",
                    "loopback",
                    "--gateway-port",
                    &gateway_port,
                    "--tailscale",
                    "off",
                ]
                .iter()
                .map(|s| (*s).to_owned())
                .collect();
                let name = format!("openclaw-onboard-{}", file_name(&scratch.home));
                let (status, _) = spawn(&name, scratch, &[], "openclaw", &args, log_dir)?.finish(CLI_TIMEOUT)?;
                if !status.success() {
                    bail!(
                        "openclaw onboard failed ({status}):\n{}",
                        std::fs::read_to_string(log_dir.join(format!("{name}.log"))).unwrap_or_default()
                    );
                }
                Ok(())
            }
        }
    }

    /// Starts one non-interactive session of the CLI with `prompt`
    /// (OpenClaw: through its gateway, which must be running: see
    /// [`OpenClawGateway`]); `extra` arguments go after the CLI's own.
    pub fn start(
        self,
        scratch: &Scratch,
        base_url: &str,
        prompt: &str,
        name: &str,
        log_dir: &Path,
        extra: &[String],
    ) -> anyhow::Result<Run> {
        let prompt = prompt.to_owned();
        let with = |mut args: Vec<String>| {
            args.extend(extra.iter().cloned());
            args
        };
        match self {
            Self::ClaudeCode => spawn(
                name,
                scratch,
                &[("ANTHROPIC_BASE_URL", base_url.to_owned())],
                "claude",
                &with(vec![
                    "-p".into(),
                    prompt,
                    "--dangerously-skip-permissions".into(),
                    "--output-format".into(),
                    "json".into(),
                ]),
                log_dir,
            ),
            Self::Codex => spawn(
                name,
                scratch,
                &[],
                "codex",
                &with(vec![
                    "exec".into(),
                    "--skip-git-repo-check".into(),
                    "--dangerously-bypass-approvals-and-sandbox".into(),
                    prompt,
                ]),
                log_dir,
            ),
            Self::OpenCode => spawn(
                name,
                scratch,
                &[],
                "opencode",
                &with(vec!["run".into(), prompt]),
                log_dir,
            ),
            Self::OpenClaw => spawn(
                name,
                scratch,
                &[("OPENCLAW_GATEWAY_TOKEN", OPENCLAW_GATEWAY_TOKEN.to_owned())],
                "openclaw",
                &with(vec![
                    "agent".into(),
                    "--agent".into(),
                    "main".into(),
                    "-m".into(),
                    prompt,
                    "--json".into(),
                    "--timeout".into(),
                    CLI_TIMEOUT.as_secs().to_string(),
                ]),
                log_dir,
            ),
        }
    }
}

/// Turns on Codex's automatic compaction in `scratch` (configured by
/// [`Cli::configure`]): once a reply's usage passes `token_limit` tokens,
/// Codex compacts the history (a `request_kind: compaction` call) and goes
/// on with the rebuilt one.
pub fn codex_auto_compact(scratch: &Scratch, token_limit: u32) -> anyhow::Result<()> {
    let path = scratch.home.join(".codex/config.toml");
    let config = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    // Top-level keys go before the first table.
    let config = format!("model_auto_compact_token_limit = {token_limit}\nmodel_context_window = 40000\n{config}");
    std::fs::write(&path, config)?;
    Ok(())
}

/// How long one CLI run may take: node start-up, a few scripted calls, and
/// OpenClaw's onboarding, on a loaded 2-core machine (its slowest measured
/// local run took 254 s at load 4-8).
pub const CLI_TIMEOUT: Duration = Duration::from_secs(420);

/// The token of the scratch OpenClaw gateway (loopback only).
const OPENCLAW_GATEWAY_TOKEN: &str = "kvmesh-test-token";

/// OpenClaw's gateway, which runs its agents (its subagents need it), on a
/// loopback port of its own; stopped with its group by its pid when dropped.
#[derive(Debug)]
pub struct OpenClawGateway {
    pub process: Process,
    pub port: u16,
}

impl OpenClawGateway {
    /// Starts the gateway of `scratch` (configured by [`Cli::configure`])
    /// and waits until it accepts connections.
    pub fn start(scratch: &Scratch, log_dir: &Path) -> anyhow::Result<Self> {
        let port = free_port()?;
        // The port onboarding wrote is replaced by the one given here.
        let args: Vec<String> = [
            "gateway",
            "run",
            "--port",
            &port.to_string(),
            "--bind",
            "loopback",
            "--auth",
            "token",
            "--token",
            OPENCLAW_GATEWAY_TOKEN,
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        let name = format!("openclaw-gateway-{}", file_name(&scratch.home));
        let mut run = spawn(
            &name,
            scratch,
            &[("OPENCLAW_GATEWAY_TOKEN", OPENCLAW_GATEWAY_TOKEN.to_owned())],
            "openclaw",
            &args,
            log_dir,
        )?;
        let deadline = std::time::Instant::now() + CLI_TIMEOUT;
        loop {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                break;
            }
            if let Some(status) = run.process.wait_exit(Duration::from_millis(200))? {
                bail!("the OpenClaw gateway exited ({status}):\n{}", run.process.log_tail());
            }
            if std::time::Instant::now() >= deadline {
                bail!(
                    "the OpenClaw gateway did not listen on {port} within {CLI_TIMEOUT:?}:\n{}",
                    run.process.log_tail()
                );
            }
        }
        // Point `openclaw agent` at this port.
        let config_path = scratch.home.join(".openclaw/openclaw.json");
        let mut config: serde_json::Value = serde_json::from_slice(
            &std::fs::read(&config_path).with_context(|| format!("reading {}", config_path.display()))?,
        )?;
        config["gateway"]["port"] = port.into();
        std::fs::write(&config_path, serde_json::to_vec_pretty(&config)?)?;
        Ok(Self {
            process: run.process,
            port,
        })
    }
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}
