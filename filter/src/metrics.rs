//! The filter's counters, defined through the proxy-wasm metrics ABI so they
//! appear in Envoy's own stats (`wasmcustom.kvmesh.*`) next to its wasm stats.

use kvmesh_request::Api;
use proxy_wasm::hostcalls;
use proxy_wasm::types::MetricType;

/// Why a request went on without a destination.
#[derive(Debug, Clone, Copy)]
pub(crate) enum FailOpen {
    /// Not JSON, or not the shape of its API.
    NotUnderstood,
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
    /// A field over its bound (a model name longer than any model has), or
    /// a Pick over the sidecar's message limit: not asked at all.
    Oversized,
}

const FAIL_OPEN_REASONS: [&str; 7] = [
    "not_understood",
    "dispatch",
    "sidecar_error",
    "timeout",
    "bad_reply",
    "no_destination",
    "oversized",
];

/// Metric ids; `None` where the host refused to define one (never fatal).
#[derive(Debug)]
pub(crate) struct Metrics {
    pub(crate) picks: Option<u32>,
    /// Picks sent on the root context's stream, and as unary calls.
    pub(crate) picks_on_stream: Option<u32>,
    pub(crate) picks_unary: Option<u32>,
    pub(crate) passed_through: Option<u32>,
    pub(crate) forged_destination: Option<u32>,
    /// A client-sent tenant header removed (it is trusted only from a hop
    /// the operator configured).
    pub(crate) client_tenant_removed: Option<u32>,
    pub(crate) truncated_body: Option<u32>,
    pub(crate) truncated_blocks: Option<u32>,
    pub(crate) outcomes_reported: Option<u32>,
    pub(crate) outcomes_with_usage: Option<u32>,
    pub(crate) report_failed: Option<u32>,
    /// Pick replies that came after their request failed open.
    pub(crate) late_replies: Option<u32>,
    /// Stream bytes whose block hashes were computed before the body's
    /// last chunk came (and kept): work taken off the critical path.
    pub(crate) hashed_ahead_bytes: Option<u32>,
    /// Body callbacks of requests being buffered: with `picks`, how many
    /// pieces Envoy delivers a body in.
    pub(crate) body_chunks: Option<u32>,
    /// Bodies given the engine's priority field (`priority_field` on), and
    /// how many client-sent top-level `priority` members were replaced.
    pub(crate) priority_written: Option<u32>,
    pub(crate) priority_replaced: Option<u32>,
    /// `priority_field` on but the body left untouched: not understood,
    /// cut at the parse cap, or refused by the host.
    pub(crate) priority_not_written: Option<u32>,
    /// Client priorities ignored (header or agent hint not an integer, or
    /// outside i32), and ones clamped into kvmesh's -1000..=1000.
    pub(crate) priority_dropped: Option<u32>,
    pub(crate) priority_clamped: Option<u32>,
    /// Bodies sent upstream without Claude Code's billing block
    /// (`strip_preambles` on).
    pub(crate) preamble_stripped: Option<u32>,
    fail_open: [Option<u32>; FAIL_OPEN_REASONS.len()],
    parse_error: [Option<u32>; 4],
}

impl Metrics {
    pub(crate) fn define() -> Self {
        let counter = |name: &str| hostcalls::define_metric(MetricType::Counter, name).ok();
        Self {
            picks: counter("kvmesh.picks"),
            picks_on_stream: counter("kvmesh.sidecar.stream_calls"),
            picks_unary: counter("kvmesh.sidecar.unary_calls"),
            passed_through: counter("kvmesh.passed_through"),
            forged_destination: counter("kvmesh.forged_destination_removed"),
            client_tenant_removed: counter("kvmesh.client_tenant_removed"),
            truncated_body: counter("kvmesh.truncated.body"),
            truncated_blocks: counter("kvmesh.truncated.blocks"),
            outcomes_reported: counter("kvmesh.outcomes.reported"),
            outcomes_with_usage: counter("kvmesh.outcomes.with_usage"),
            report_failed: counter("kvmesh.outcomes.report_failed"),
            late_replies: counter("kvmesh.sidecar.late_replies"),
            hashed_ahead_bytes: counter("kvmesh.hashed_ahead_bytes"),
            body_chunks: counter("kvmesh.body_chunks"),
            priority_written: counter("kvmesh.priority.written"),
            priority_replaced: counter("kvmesh.priority.replaced"),
            priority_not_written: counter("kvmesh.priority.not_written"),
            priority_dropped: counter("kvmesh.priority.dropped"),
            priority_clamped: counter("kvmesh.priority.clamped"),
            preamble_stripped: counter("kvmesh.preamble.stripped"),
            fail_open: FAIL_OPEN_REASONS.map(|reason| counter(&format!("kvmesh.fail_open.{reason}"))),
            parse_error: Api::ALL.map(|api| counter(&format!("kvmesh.parse_error.{}", api.name()))),
        }
    }

    pub(crate) fn inc(&self, metric: Option<u32>) {
        self.add(metric, 1);
    }

    pub(crate) fn add(&self, metric: Option<u32>, by: usize) {
        if let Some(id) = metric
            && by > 0
        {
            let _ = hostcalls::increment_metric(id, i64::try_from(by).unwrap_or(i64::MAX));
        }
    }

    pub(crate) fn fail_open(&self, why: FailOpen) {
        self.inc(self.fail_open[why as usize]);
    }

    pub(crate) fn parse_error(&self, api: Api) {
        let index = Api::ALL.iter().position(|a| *a == api).unwrap_or(0);
        self.inc(self.parse_error[index]);
    }
}
