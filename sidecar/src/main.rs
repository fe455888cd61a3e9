//! `kvmesh-sidecar`: parses its command line, sets up logging and the
//! runtime, and runs the library's [`kvmesh_sidecar::serve`] (or its
//! `report` command); prints what failed and exits with its code.
#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::Parser;
use kvmesh_sidecar::{Args, Command, ReportArgs, Settings};
use tracing::error;

/// mimalloc, not glibc's malloc: at 100,000 sessions (`kvmesh-bench scale`)
/// glibc's per-thread arenas kept what one wave of sessions freed away from
/// the next, which grew RSS by 84-89 MiB (44 MiB with one arena). Built
/// without transparent huge pages (`no_thp`, in the workspace manifest):
/// with them, 165-300 MiB of the sidecar's RSS was huge pages, and a second
/// wave of sessions ended 3-13 MiB above the first (0-6 without).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let mut args = Args::parse();
    if let Some(Command::Report(report)) = args.command.take() {
        return print_report(report);
    }
    let settings = match Settings::resolve(args) {
        Ok(settings) => settings,
        Err(err) => {
            eprintln!("kvmesh-sidecar: {err}");
            return ExitCode::from(2);
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_new(&settings.log).unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(err) => {
            eprintln!("kvmesh-sidecar: cannot start the runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(kvmesh_sidecar::serve(settings)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            error!("{err:#}");
            ExitCode::FAILURE
        }
    }
}

/// `kvmesh-sidecar report`.
fn print_report(args: ReportArgs) -> ExitCode {
    let result = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(anyhow::Error::from)
        .and_then(|rt| rt.block_on(kvmesh_sidecar::report(args)));
    match result {
        Ok(text) => {
            print!("{text}");
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("kvmesh-sidecar report: {err:#}");
            ExitCode::FAILURE
        }
    }
}
