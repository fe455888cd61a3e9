//! The filter's counters, defined through the proxy-wasm metrics ABI so they
//! appear in Envoy's own stats (`/stats`, Prometheus) next to its wasm stats.

use proxy_wasm::hostcalls;
use proxy_wasm::types::MetricType;

/// Why a request went on without a destination.
#[derive(Debug, Clone, Copy)]
pub(crate) enum FailOpen {
    /// Not JSON, or not the shape of its API.
    NotUnderstood,
    BodyTooLarge,
    /// Envoy refused to start the gRPC call (e.g. unknown cluster).
    Dispatch,
    /// The sidecar answered with an error or could not be reached.
    SidecarError,
    /// The sidecar did not answer within the timeout.
    Timeout,
    /// The reply did not decode.
    BadReply,
    /// The reply named no usable destination.
    NoDestination,
}

/// Metric ids; `None` where the host refused to define one (never fatal).
#[derive(Debug)]
pub(crate) struct Metrics {
    pub(crate) picks: Option<u32>,
    pub(crate) passed_through: Option<u32>,
    pub(crate) forged_destination: Option<u32>,
    pub(crate) blocks_capped: Option<u32>,
    pub(crate) report_failed: Option<u32>,
    fail_open: [Option<u32>; 7],
}

impl Metrics {
    pub(crate) fn define() -> Self {
        let counter = |name: &str| hostcalls::define_metric(MetricType::Counter, name).ok();
        Self {
            picks: counter("kvmesh.picks"),
            passed_through: counter("kvmesh.passed_through"),
            forged_destination: counter("kvmesh.forged_destination_removed"),
            blocks_capped: counter("kvmesh.blocks_capped"),
            report_failed: counter("kvmesh.report_failed"),
            fail_open: [
                "not_understood",
                "body_too_large",
                "dispatch",
                "sidecar_error",
                "timeout",
                "bad_reply",
                "no_destination",
            ]
            .map(|reason| counter(&format!("kvmesh.fail_open.{reason}"))),
        }
    }

    pub(crate) fn inc(&self, metric: Option<u32>) {
        if let Some(id) = metric {
            let _ = hostcalls::increment_metric(id, 1);
        }
    }

    pub(crate) fn fail_open(&self, why: FailOpen) {
        self.inc(self.fail_open[why as usize]);
    }
}
