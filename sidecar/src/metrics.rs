//! Prometheus metrics of the sidecar's decisions, served on the admin port.

use std::time::Duration;

use kvmesh_core::{Reason, WorkerView};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkerLabel {
    worker: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KnownLabel {
    known: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EventLabel {
    event: &'static str,
}

/// All sidecar metrics. Per-worker gauges are refreshed at scrape time from
/// the router, so they can never drift from it.
#[derive(Debug)]
pub(crate) struct Metrics {
    registry: Registry,
    picks: Family<ReasonLabel, Counter>,
    pick_seconds: Histogram,
    request_blocks: Counter,
    predicted_cached_blocks: Counter,
    reports: Family<KnownLabel, Counter>,
    reported_prompt_tokens: Counter,
    reported_cached_tokens: Counter,
    worker_in_flight: Family<WorkerLabel, Gauge>,
    worker_cached_blocks: Family<WorkerLabel, Gauge>,
    worker_healthy: Family<WorkerLabel, Gauge>,
    worker_capacity_blocks: Family<WorkerLabel, Gauge>,
    worker_live_sessions: Family<WorkerLabel, Gauge>,
    worker_events: Family<EventLabel, Counter>,
    sessions: Gauge,
    index_entries: Gauge,
    index_bytes: Gauge,
}

impl Metrics {
    pub(crate) fn new() -> Self {
        let mut registry = Registry::with_prefix("kvmesh");
        let m = Self {
            picks: Family::default(),
            // 10 µs .. ~80 ms: a Pick is sub-millisecond; anything near the
            // filter's timeout (tens of ms) means a fail-open.
            pick_seconds: Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
                1e-5, 2.0, 14,
            )),
            request_blocks: Counter::default(),
            predicted_cached_blocks: Counter::default(),
            reports: Family::default(),
            reported_prompt_tokens: Counter::default(),
            reported_cached_tokens: Counter::default(),
            worker_in_flight: Family::default(),
            worker_cached_blocks: Family::default(),
            worker_healthy: Family::default(),
            worker_capacity_blocks: Family::default(),
            worker_live_sessions: Family::default(),
            worker_events: Family::default(),
            sessions: Gauge::default(),
            index_entries: Gauge::default(),
            index_bytes: Gauge::default(),
            registry: Registry::default(),
        };
        registry.register("picks", "Pick decisions by reason", m.picks.clone());
        registry.register(
            "pick_duration_seconds",
            "Time to decide one Pick",
            m.pick_seconds.clone(),
        );
        registry.register(
            "request_blocks",
            "Prefix blocks received in Picks",
            m.request_blocks.clone(),
        );
        registry.register(
            "predicted_cached_blocks",
            "Blocks predicted cached on the chosen worker",
            m.predicted_cached_blocks.clone(),
        );
        registry.register(
            "reports",
            "Outcome reports, by whether their pick was known",
            m.reports.clone(),
        );
        registry.register(
            "reported_prompt_tokens",
            "Prompt tokens reported by engines",
            m.reported_prompt_tokens.clone(),
        );
        registry.register(
            "reported_cached_tokens",
            "Cached prompt tokens reported by engines",
            m.reported_cached_tokens.clone(),
        );
        registry.register(
            "worker_in_flight",
            "Requests picked and not yet reported, per worker",
            m.worker_in_flight.clone(),
        );
        registry.register(
            "worker_cached_blocks",
            "Blocks the router believes each worker holds",
            m.worker_cached_blocks.clone(),
        );
        registry.register(
            "worker_healthy",
            "1 when the worker may be picked",
            m.worker_healthy.clone(),
        );
        registry.register("sessions", "Live sessions", m.sessions.clone());
        registry.register(
            "worker_capacity_blocks",
            "Blocks the router believes each worker can hold (corrected by outcomes)",
            m.worker_capacity_blocks.clone(),
        );
        registry.register(
            "worker_live_sessions",
            "Live sessions homed on each worker",
            m.worker_live_sessions.clone(),
        );
        registry.register(
            "worker_events",
            "Worker lifecycle events seen by the engine watcher (down, up, restart)",
            m.worker_events.clone(),
        );
        registry.register(
            "index_entries",
            "(block, worker) entries in the prefix index",
            m.index_entries.clone(),
        );
        registry.register(
            "index_bytes",
            "Heap bytes held by the prefix index",
            m.index_bytes.clone(),
        );
        Self { registry, ..m }
    }

    pub(crate) fn observe_pick(&self, reason: Reason, blocks: usize, predicted: u32, took: Duration) {
        self.picks
            .get_or_create(&ReasonLabel {
                reason: reason.as_str(),
            })
            .inc();
        self.pick_seconds.observe(took.as_secs_f64());
        self.request_blocks.inc_by(blocks as u64);
        self.predicted_cached_blocks.inc_by(u64::from(predicted));
    }

    pub(crate) fn observe_report(&self, known: bool, prompt_tokens: Option<u64>, cached_tokens: Option<u64>) {
        let known = if known { "true" } else { "false" };
        self.reports.get_or_create(&KnownLabel { known }).inc();
        self.reported_prompt_tokens.inc_by(prompt_tokens.unwrap_or(0));
        self.reported_cached_tokens.inc_by(cached_tokens.unwrap_or(0));
    }

    pub(crate) fn observe_worker_event(&self, event: &'static str) {
        self.worker_events.get_or_create(&EventLabel { event }).inc();
    }

    /// Prometheus text exposition, with the gauges taken from the router.
    pub(crate) fn render(
        &self,
        workers: &[WorkerView],
        sessions: usize,
        index_entries: usize,
        index_bytes: usize,
    ) -> String {
        for w in workers {
            let label = WorkerLabel {
                worker: w.address.clone(),
            };
            self.worker_in_flight.get_or_create(&label).set(i64::from(w.in_flight));
            self.worker_cached_blocks
                .get_or_create(&label)
                .set(i64::try_from(w.cached_blocks).unwrap_or(i64::MAX));
            self.worker_healthy.get_or_create(&label).set(i64::from(w.healthy));
            self.worker_capacity_blocks
                .get_or_create(&label)
                .set(i64::try_from(w.capacity_blocks).unwrap_or(i64::MAX));
            self.worker_live_sessions
                .get_or_create(&label)
                .set(i64::from(w.live_sessions));
        }
        let gauge = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        self.sessions.set(gauge(sessions));
        self.index_entries.set(gauge(index_entries));
        self.index_bytes.set(gauge(index_bytes));
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}
