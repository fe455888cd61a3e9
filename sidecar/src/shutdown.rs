//! Stopping promptly. tonic's graceful shutdown waits for every open stream
//! to end, and the filter keeps its PickStream open for as long as Envoy
//! runs: a sidecar that only stopped accepting went on routing for as long
//! as Envoy lived (55 s in the test that found it), even after a new
//! sidecar took over its ports. So the first SIGTERM or SIGINT cancels
//! `Shared::shutdown`, which readiness, health, every Pick and every stream
//! observe; a deadline (`--shutdown-grace-ms`) and a second signal bound
//! what is left (the Redis flush and the snapshot).

use std::time::Duration;

use kvmesh_proto::v1::router_server::SERVICE_NAME;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;
use tracing::{info, warn};

use crate::state::Shared;

/// SIGTERM and SIGINT, registered once at start so a signal that comes
/// early is not lost (or fatal: registration replaces the default action).
#[derive(Debug)]
pub(crate) struct Signals {
    #[cfg(unix)]
    term: Option<tokio::signal::unix::Signal>,
    #[cfg(unix)]
    interrupt: Option<tokio::signal::unix::Signal>,
}

impl Signals {
    pub(crate) fn register() -> Self {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            let listen = |kind: SignalKind, name: &str| match signal(kind) {
                Ok(s) => Some(s),
                Err(err) => {
                    warn!("cannot listen for {name}: {err}");
                    None
                }
            };
            Self {
                term: listen(SignalKind::terminate(), "SIGTERM"),
                interrupt: listen(SignalKind::interrupt(), "SIGINT"),
            }
        }
        #[cfg(not(unix))]
        Self {}
    }

    /// The name of the next signal received.
    async fn next(&mut self) -> &'static str {
        #[cfg(unix)]
        {
            async fn recv(signal: &mut Option<tokio::signal::unix::Signal>) {
                // A stream that cannot deliver (none registered, or
                // closed) never resolves, so the other signal still can.
                let delivered = match signal {
                    Some(s) => s.recv().await.is_some(),
                    None => false,
                };
                if !delivered {
                    std::future::pending::<()>().await;
                }
            }
            tokio::select! {
                () = recv(&mut self.term) => "SIGTERM",
                () = recv(&mut self.interrupt) => "SIGINT",
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
            "Ctrl-C"
        }
    }
}

/// Waits for the first signal and begins shutdown; then exits the process
/// at the second signal or when `grace` has passed, whichever is first
/// (the orderly path in `serve` usually ends the process before either).
pub(crate) async fn on_signals(mut signals: Signals, shared: Shared, health: HealthReporter, grace: Duration) {
    let first = signals.next().await;
    info!(
        grace_ms = u64::try_from(grace.as_millis()).unwrap_or(u64::MAX),
        "{first}: shutdown began: not ready, no more Picks decided, ending every stream"
    );
    shared.shutdown.cancel();
    // By the proto's service name, not the gRPC edge's type: an edge
    // imports no other edge.
    health.set_service_status(SERVICE_NAME, ServingStatus::NotServing).await;
    let why = tokio::select! {
        second = signals.next() => format!("{second} again: exiting at once"),
        () = tokio::time::sleep(grace) => format!("the shutdown grace of {grace:?} is over: exiting now"),
    };
    warn!("{why}");
    log_figures(&shared);
    std::process::exit(1);
}

/// The line tests and operators read: how many Picks were decided after
/// shutdown began (0 unless a Pick raced the signal by microseconds).
pub(crate) fn log_figures(shared: &Shared) {
    let (refused, answered) = shared.metrics.shutdown_figures();
    info!(
        refused,
        answered, "shutdown: {answered} picks answered after shutdown began, {refused} refused"
    );
}
