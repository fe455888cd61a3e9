//! Prometheus metrics of the sidecar's decisions, served on the admin port.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvmesh_core::{Decision, Figures, Insights, Totals, WorkerView};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
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

/// A wire field, by its proto name: a closed set, never a value.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FieldLabel {
    field: &'static str,
}

/// How big the router's tables are, read at scrape time.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StateSizes {
    pub(crate) sessions: usize,
    pub(crate) index_entries: usize,
    pub(crate) index_bytes: usize,
    pub(crate) models: usize,
    pub(crate) trace_bytes: usize,
    /// Trace ids remembered to resolve parents named by trace.
    pub(crate) trace_carriers: usize,
    /// Sessions whose calls by lane the ledger keeps.
    pub(crate) lane_sessions: usize,
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
    evicted_blocks: Counter,
    evicted_value_blocks: Counter<f64, AtomicU64>,
    reports: Family<KnownLabel, Counter>,
    reported_prompt_tokens: Counter,
    reported_cached_tokens: Counter,
    worker_in_flight: Family<WorkerLabel, Gauge>,
    worker_cached_blocks: Family<WorkerLabel, Gauge>,
    worker_healthy: Family<WorkerLabel, Gauge>,
    worker_capacity_blocks: Family<WorkerLabel, Gauge>,
    worker_live_sessions: Family<WorkerLabel, Gauge>,
    /// The engine's own figures, as its metrics say (absent until it does).
    worker_engine_waiting: Family<WorkerLabel, Gauge<f64, std::sync::atomic::AtomicU64>>,
    worker_engine_running: Family<WorkerLabel, Gauge<f64, std::sync::atomic::AtomicU64>>,
    worker_engine_kv_usage: Family<WorkerLabel, Gauge<f64, std::sync::atomic::AtomicU64>>,
    worker_events: Family<EventLabel, Counter>,
    worker_engine_resident_blocks: Family<WorkerLabel, Gauge>,
    kv_event_batches: Family<WorkerLabel, Counter>,
    kv_event_errors: Family<WorkerLabel, Counter>,
    kv_event_gaps: Family<WorkerLabel, Counter>,
    kv_event_evicted_blocks: Family<WorkerLabel, Counter>,
    sessions: Gauge,
    index_entries: Gauge,
    index_bytes: Gauge,
    models: Gauge,
    trace_bytes: Gauge,
    trace_carriers: Gauge,
    lane_sessions: Gauge,
    picks_rejected: Family<FieldLabel, Counter>,
    usage_rejected: Family<ReasonLabel, Counter>,
    outcome_fields_dropped: Family<FieldLabel, Counter>,
    picks_refused_draining: Counter,
    picks_after_shutdown: Counter,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AgentLabel {
    harness: &'static str,
    tenant: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AgentDetailLabel {
    harness: &'static str,
    tenant: String,
    /// A move reason or a prompt section, per metric.
    reason: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SectionLabel {
    harness: &'static str,
    tenant: String,
    section: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HarnessLabel {
    harness: &'static str,
}

/// The insight ledger's figures, read at scrape time so they can never
/// drift from it. Labels are a closed set of harnesses and a bounded set of
/// tenants (`--tenant-labels`); never prompt text.
#[derive(Debug)]
struct InsightCollector {
    insights: Arc<Mutex<Insights>>,
}

fn counter(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    rows: &[(impl EncodeLabelSet, f64)],
) -> std::fmt::Result {
    let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (labels, value) in rows {
        ConstCounter::new(*value).encode(family.encode_family(labels)?)?;
    }
    Ok(())
}

fn gauge(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    rows: &[(impl EncodeLabelSet, f64)],
) -> std::fmt::Result {
    let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (labels, value) in rows {
        ConstGauge::new(*value).encode(family.encode_family(labels)?)?;
    }
    Ok(())
}

impl Collector for InsightCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> std::fmt::Result {
        let insights = crate::lock::lock(&self.insights);
        let mut rows: Vec<(AgentLabel, &Totals)> = insights
            .totals()
            .map(|(label, t)| {
                (
                    AgentLabel {
                        harness: label.harness.name(),
                        tenant: insights.tenant_name(label.tenant).to_owned(),
                    },
                    t,
                )
            })
            .collect();
        rows.sort_by(|a, b| (a.0.harness, &a.0.tenant).cmp(&(b.0.harness, &b.0.tenant)));
        // The ledger's one list of figures: those that are counters.
        for figure in Figures::ALL {
            let Some(name) = figure.counter else { continue };
            let values: Vec<(AgentLabel, f64)> = rows.iter().map(|(l, t)| (l.clone(), (figure.value)(t))).collect();
            counter(&mut encoder, name, figure.help.trim(), &values)?;
        }
        let moves: Vec<(AgentDetailLabel, f64)> = rows
            .iter()
            .flat_map(|(l, t)| {
                t.moves_by_reason().map(move |(reason, n)| {
                    (
                        AgentDetailLabel {
                            harness: l.harness,
                            tenant: l.tenant.clone(),
                            reason,
                        },
                        n as f64,
                    )
                })
            })
            .collect();
        counter(
            &mut encoder,
            "session_moves",
            "Continuing calls that went to another worker than the session's previous call, by why",
            &moves,
        )?;
        let breaks: Vec<(SectionLabel, f64)> = rows
            .iter()
            .flat_map(|(l, t)| {
                t.breaks_by_section().map(move |(section, n)| {
                    (
                        SectionLabel {
                            harness: l.harness,
                            tenant: l.tenant.clone(),
                            section,
                        },
                        n as f64,
                    )
                })
            })
            .collect();
        counter(
            &mut encoder,
            "prefix_breaks",
            "Continuing calls that shared less of the session's previous prompt than all of it, by the section where the prefix broke",
            &breaks,
        )?;
        let retention: Vec<_> = insights.retention().collect();
        let per_harness = |f: fn(&kvmesh_core::Retention) -> f64| -> Vec<(HarnessLabel, f64)> {
            retention
                .iter()
                .map(|(harness, r)| (HarnessLabel { harness }, f(r)))
                .collect()
        };
        gauge(
            &mut encoder,
            "idle_sessions",
            "Sessions with no call in flight whose prefix their worker still holds",
            &per_harness(|r| r.idle_sessions as f64),
        )?;
        gauge(
            &mut encoder,
            "idle_kv_bytes",
            "KV-cache bytes those idle sessions hold on their workers",
            &per_harness(|r| r.kv_bytes),
        )?;
        gauge(
            &mut encoder,
            "idle_recompute_seconds",
            "GPU prefill time to recompute those idle sessions if they were evicted",
            &per_harness(|r| r.recompute_ms / 1000.0),
        )?;
        gauge(
            &mut encoder,
            "idle_longest_seconds",
            "How long the longest-idle of them has waited",
            &per_harness(|r| r.max_idle_ms as f64 / 1000.0),
        )?;
        Ok(())
    }
}

impl Metrics {
    pub(crate) fn new(insights: Arc<Mutex<Insights>>) -> Self {
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
            evicted_blocks: Counter::default(),
            evicted_value_blocks: Counter::default(),
            reports: Family::default(),
            reported_prompt_tokens: Counter::default(),
            reported_cached_tokens: Counter::default(),
            worker_in_flight: Family::default(),
            worker_cached_blocks: Family::default(),
            worker_healthy: Family::default(),
            worker_capacity_blocks: Family::default(),
            worker_live_sessions: Family::default(),
            worker_engine_waiting: Family::default(),
            worker_engine_running: Family::default(),
            worker_engine_kv_usage: Family::default(),
            worker_events: Family::default(),
            worker_engine_resident_blocks: Family::default(),
            kv_event_batches: Family::default(),
            kv_event_errors: Family::default(),
            kv_event_gaps: Family::default(),
            kv_event_evicted_blocks: Family::default(),
            sessions: Gauge::default(),
            index_entries: Gauge::default(),
            index_bytes: Gauge::default(),
            models: Gauge::default(),
            trace_bytes: Gauge::default(),
            trace_carriers: Gauge::default(),
            lane_sessions: Gauge::default(),
            picks_rejected: Family::default(),
            usage_rejected: Family::default(),
            outcome_fields_dropped: Family::default(),
            picks_refused_draining: Counter::default(),
            picks_after_shutdown: Counter::default(),
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
            "evicted_blocks",
            "Cached blocks the chosen placements push out of their workers",
            m.evicted_blocks.clone(),
        );
        registry.register(
            "evicted_value_blocks",
            "Those blocks weighted by the chance their session returns: the reuse placements give up",
            m.evicted_value_blocks.clone(),
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
            "worker_engine_waiting",
            "Requests each worker's engine reports queued (its metrics)",
            m.worker_engine_waiting.clone(),
        );
        registry.register(
            "worker_engine_running",
            "Requests each worker's engine reports running (its metrics)",
            m.worker_engine_running.clone(),
        );
        registry.register(
            "worker_engine_kv_usage",
            "Share of its KV cache each worker's engine reports in use, 0 to 1 (its metrics)",
            m.worker_engine_kv_usage.clone(),
        );
        registry.register(
            "worker_events",
            "Worker lifecycle events seen by the engine watcher (down, up, restart)",
            m.worker_events.clone(),
        );
        registry.register(
            "worker_engine_resident_blocks",
            "Blocks resident in each worker's engine cache, in its own blocks, from its KV events (absent while unknown)",
            m.worker_engine_resident_blocks.clone(),
        );
        registry.register(
            "kv_event_batches",
            "KV event messages decoded, per worker",
            m.kv_event_batches.clone(),
        );
        registry.register(
            "kv_event_errors",
            "KV event messages refused as undecodable, per worker",
            m.kv_event_errors.clone(),
        );
        registry.register(
            "kv_event_gaps",
            "Breaks in a worker's KV event sequence (lost messages, or a restarted publisher)",
            m.kv_event_gaps.clone(),
        );
        registry.register(
            "kv_event_evicted_blocks",
            "Index blocks evicted in step with an engine's own removals, per worker",
            m.kv_event_evicted_blocks.clone(),
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
        registry.register(
            "models",
            "Models whose bytes per token the router has learned (bounded by its max_models)",
            m.models.clone(),
        );
        registry.register(
            "insight_trace_bytes",
            "Heap bytes of the sessions' last calls kept by the insight ledger (bounded by its budget)",
            m.trace_bytes.clone(),
        );
        registry.register(
            "trace_carriers",
            "Trace ids remembered with the session that carried them, to resolve parents named by trace (bounded by MAX_TRACE_CARRIERS)",
            m.trace_carriers.clone(),
        );
        registry.register(
            "insight_lane_sessions",
            "Sessions whose calls by lane the insight ledger keeps (bounded by its max sessions)",
            m.lane_sessions.clone(),
        );
        registry.register(
            "picks_rejected",
            "Picks answered with no decision because a field broke its wire bound, by field",
            m.picks_rejected.clone(),
        );
        registry.register(
            "usage_rejected",
            "Outcomes whose usage was implausible and dropped (never counted or learned from), by why",
            m.usage_rejected.clone(),
        );
        registry.register(
            "outcome_fields_dropped",
            "Outcome strings over their wire bound, ignored, by field",
            m.outcome_fields_dropped.clone(),
        );
        registry.register(
            "picks_refused_draining",
            "Picks that arrived after shutdown began and got no decision",
            m.picks_refused_draining.clone(),
        );
        registry.register(
            "picks_answered_after_shutdown",
            "Picks decided and answered after shutdown began (should stay 0)",
            m.picks_after_shutdown.clone(),
        );
        registry.register_collector(Box::new(InsightCollector { insights }));
        Self { registry, ..m }
    }

    pub(crate) fn observe_pick(&self, decision: &Decision, blocks: usize, took: Duration) {
        let (reason, predicted) = (decision.reason, decision.predicted_cached_blocks);
        self.evicted_blocks.inc_by(u64::from(decision.evicted_blocks));
        self.evicted_value_blocks.inc_by(decision.evicted_value_blocks.max(0.0));
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

    pub(crate) fn observe_rejected(&self, field: &'static str) {
        self.picks_rejected.get_or_create(&FieldLabel { field }).inc();
    }

    pub(crate) fn observe_usage_rejected(&self, reason: &'static str) {
        self.usage_rejected.get_or_create(&ReasonLabel { reason }).inc();
    }

    pub(crate) fn observe_outcome_field_dropped(&self, field: &'static str) {
        self.outcome_fields_dropped.get_or_create(&FieldLabel { field }).inc();
    }

    pub(crate) fn observe_refused_draining(&self) {
        self.picks_refused_draining.inc();
    }

    pub(crate) fn observe_answered_after_shutdown(&self) {
        self.picks_after_shutdown.inc();
    }

    /// Picks that got no decision since shutdown began, and those that did.
    pub(crate) fn shutdown_figures(&self) -> (u64, u64) {
        (self.picks_refused_draining.get(), self.picks_after_shutdown.get())
    }

    pub(crate) fn observe_worker_event(&self, event: &'static str) {
        self.worker_events.get_or_create(&EventLabel { event }).inc();
    }

    /// One decoded KV event message from `worker`, with the index blocks
    /// its removals evicted and whether it broke the sequence.
    pub(crate) fn observe_kv_batch(&self, worker: &str, evicted: usize, gap: bool) {
        let label = WorkerLabel {
            worker: worker.to_owned(),
        };
        self.kv_event_batches.get_or_create(&label).inc();
        if evicted > 0 {
            self.kv_event_evicted_blocks
                .get_or_create(&label)
                .inc_by(u64::try_from(evicted).unwrap_or(u64::MAX));
        }
        if gap {
            self.kv_event_gaps.get_or_create(&label).inc();
        }
    }

    pub(crate) fn observe_kv_error(&self, worker: &str) {
        self.kv_event_errors
            .get_or_create(&WorkerLabel {
                worker: worker.to_owned(),
            })
            .inc();
    }

    /// Prometheus text exposition, with the gauges taken from the router.
    pub(crate) fn render(&self, workers: &[WorkerView], state: StateSizes) -> String {
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
            self.worker_engine_waiting.get_or_create(&label).set(w.engine_waiting);
            if let Some(running) = w.engine_running {
                self.worker_engine_running.get_or_create(&label).set(running);
            }
            if let Some(usage) = w.engine_kv_usage {
                self.worker_engine_kv_usage.get_or_create(&label).set(usage);
            }
            match w.engine_resident_blocks {
                Some(blocks) => {
                    self.worker_engine_resident_blocks
                        .get_or_create(&label)
                        .set(i64::try_from(blocks).unwrap_or(i64::MAX));
                }
                None => {
                    self.worker_engine_resident_blocks.remove(&label);
                }
            }
        }
        let gauge = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        self.sessions.set(gauge(state.sessions));
        self.index_entries.set(gauge(state.index_entries));
        self.index_bytes.set(gauge(state.index_bytes));
        self.models.set(gauge(state.models));
        self.trace_bytes.set(gauge(state.trace_bytes));
        self.trace_carriers.set(gauge(state.trace_carriers));
        self.lane_sessions.set(gauge(state.lane_sessions));
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}
