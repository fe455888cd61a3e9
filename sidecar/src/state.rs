//! The sidecar's shared state, [`Shared`]: the router, the insight ledger,
//! the metrics, the Redis placement sink and the shutdown token, with the
//! one lock order they are taken in, and the two things every Pick and
//! Outcome goes through whichever edge brought it: `pick` (check, decide,
//! record, publish) and `report` (clip, learn, record).
//!
//! Below every edge: gRPC, admin HTTP, the Redis store, the engine watcher
//! and shutdown all import this module, and it imports none of them. The
//! store plugs in through [`PlacementSink`], so Pick can publish a placement
//! without knowing Redis.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use kvmesh_core::{Call, Decision, Insights, PromptSection, Report, Router};
use kvmesh_proto::v1;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::bounds::{self, Violation};
use crate::clock::now_ms;
use crate::lock::lock;
use crate::metrics::Metrics;
use crate::wire;

/// One placement decided by this replica, for the other replicas.
#[derive(Debug, Clone)]
pub(crate) struct Placement {
    pub(crate) worker: String,
    pub(crate) session: String,
    pub(crate) blocks: Vec<u64>,
}

/// Where Pick hands its placements (the Redis store). Never waits: Pick is
/// on the request path, the sink publishes in the background.
pub(crate) trait PlacementSink: std::fmt::Debug + Send + Sync {
    fn publish(&self, placement: Placement);
}

/// What became of one Pick.
#[derive(Debug)]
pub(crate) enum Answer {
    Decided(v1::PickReply),
    /// It broke a wire bound: no decision, nothing recorded.
    Rejected(Violation),
    /// Shutdown has begun: another replica (or fail-open) must answer it.
    Draining,
}

/// The routing state every edge shares: cloned into each (the clone is a
/// handful of `Arc`s).
///
/// Lock order: `ticks` (a pass of the ledger's tick), then `router` before
/// `insights`, never the reverse. The ledger
/// consumes each Pick's record after the router's lock is released (Picks
/// never wait on it), so the two are rarely held together; where they are
/// (a debug page reading both), the router comes first, and an edge that
/// locked the ledger first and then wanted the router could deadlock
/// against it. Nothing is locked
/// across an `.await`: both are std mutexes held for microseconds.
#[derive(Debug, Clone)]
pub(crate) struct Shared {
    router: Arc<Mutex<Router>>,
    /// Fed each pick's record after the router's lock is released; locked
    /// after `router` when both are needed, never before it.
    insights: Arc<Mutex<Insights>>,
    pub(crate) metrics: Arc<Metrics>,
    /// When the last pass of the ledger's tick ended and how long it took;
    /// held through a pass, so passes never overlap. Locked before
    /// `router` and `insights`.
    ticks: Arc<Mutex<Option<(Instant, std::time::Duration)>>>,
    /// The last window report built for a page: when, how long it took,
    /// its window and the report (see `ledger_report`). Locked before
    /// `insights`, never after it.
    reports: Arc<Mutex<Option<BuiltReport>>>,
    /// Set once Redis is connected (never, without `--redis`).
    pub(crate) store: Arc<std::sync::OnceLock<Box<dyn PlacementSink>>>,
    /// Cancelled when shutdown begins: from then on no Pick is decided and
    /// every stream ends.
    pub(crate) shutdown: CancellationToken,
}

impl Shared {
    pub(crate) fn new(router: Router, insights: Arc<Mutex<Insights>>, metrics: Metrics) -> Self {
        Self {
            router: Arc::new(Mutex::new(router)),
            insights,
            metrics: Arc::new(metrics),
            ticks: Arc::default(),
            reports: Arc::default(),
            store: Arc::new(std::sync::OnceLock::new()),
            shutdown: CancellationToken::new(),
        }
    }

    /// Shutdown has begun.
    pub(crate) fn draining(&self) -> bool {
        self.shutdown.is_cancelled()
    }

    /// The router (see `lock` on poisoning).
    pub(crate) fn router(&self) -> MutexGuard<'_, Router> {
        lock(&self.router)
    }

    /// The insight ledger (see `lock` on poisoning).
    pub(crate) fn insights(&self) -> MutexGuard<'_, Insights> {
        lock(&self.insights)
    }

    /// Charges idle sessions, ends the expired, and refreshes the retention
    /// figures and idle lists: one pass of the ledger's tick, in steps of
    /// [`TICK_STEP`] sessions with each lock released between them. Done
    /// whole under the ledger's lock (and the router's for the holdings),
    /// the walk cost 0.35 ms per 1,000 sessions, 33-42 ms at 100,000, and
    /// every Pick waited it out (the filter's timeout is 50 ms).
    pub(crate) fn tick_insights(&self) {
        let mut ticks = lock(&self.ticks);
        let started = Instant::now();
        let mut pass = self.insights().tick_begin(now_ms());
        loop {
            let step = self.insights().tick_step(&pass, TICK_STEP);
            let holdings = self.router().holdings(&step.probes);
            if self.insights().tick_apply(&mut pass, step, &holdings) {
                break;
            }
            between_locks();
        }
        *ticks = Some((Instant::now(), started.elapsed()));
    }

    /// The ledger's report over the last `window_ms`, for a page: a fresh
    /// one unless the last, for the same window, was built less than
    /// [`REPORT_DUTY`] times its own build time ago (and at most
    /// [`REPORT_MAX_AGE`]). Each build holds the ledger's lock, which every
    /// Pick takes, for its whole length (about 2 ms at 100,000 sessions): a
    /// page fetched in a loop held Picks to a p99 of 9.3 ms and a worst of
    /// 24 ms (`kvmesh-bench scale --pages /debug/report`). Reused, the lock
    /// is held at most about 1 % of the time.
    pub(crate) fn ledger_report(&self, window_ms: u64) -> Report {
        let mut reports = lock(&self.reports);
        if let Some(built) = reports.as_ref()
            && built.window_ms == window_ms
            && built.at.elapsed() < built.took.saturating_mul(REPORT_DUTY).min(REPORT_MAX_AGE)
        {
            return built.report.clone();
        }
        let started = Instant::now();
        let report = self.insights().report(now_ms(), window_ms);
        *reports = Some(BuiltReport {
            at: Instant::now(),
            took: started.elapsed(),
            window_ms,
            report: report.clone(),
        });
        report
    }

    /// A tick for a page or a scrape: a fresh one unless the last pass
    /// ended less than [`TICK_DUTY`] of its own time ago. A scrape or page
    /// fetched in a loop then spends at most a tenth of a core on passes
    /// (one took about 35 ms at 100,000 sessions), while a sidecar with few
    /// sessions (a pass of microseconds) is always fresh.
    pub(crate) fn fresh_insights(&self) {
        if let Some((ended, took)) = *lock(&self.ticks)
            && ended.elapsed() < took.saturating_mul(TICK_DUTY)
        {
            return;
        }
        self.tick_insights();
    }
}

/// A pause between two holds of the same lock in a loop. A std mutex is
/// not fair: a thread that unlocks and locks again at once keeps it while
/// the Picks it woke are still being scheduled. And on two cores a pass
/// that never sleeps takes a core from the Picks for its whole length: a
/// pass of a hundred steps (100,000 sessions, `kvmesh-bench scale`) held
/// Picks up to 216 ms with a 50 µs pause, though no step held a lock 1 ms.
/// At 500 µs a pass runs at most about 40 % of a core and lasts about
/// 100 steps × 0.85 ms.
pub(crate) fn between_locks() {
    std::thread::sleep(std::time::Duration::from_micros(500));
}

/// Sessions one step of the ledger's tick visits: about 0.35 ms under the
/// ledger's lock, then their holdings under the router's.
const TICK_STEP: usize = 1000;

/// A page reuses the last tick for this many times its duration.
const TICK_DUTY: u32 = 10;

/// A page reuses the last window report for this many times its build
/// time, and never when it is older than `REPORT_MAX_AGE`.
const REPORT_DUTY: u32 = 100;
const REPORT_MAX_AGE: std::time::Duration = std::time::Duration::from_secs(1);

/// One window report and how it was built.
#[derive(Debug)]
struct BuiltReport {
    at: Instant,
    took: std::time::Duration,
    window_ms: u64,
    report: Report,
}

impl Shared {
    /// Checks one Pick, then decides it and records it.
    pub(crate) fn pick(&self, req: &v1::PickRequest) -> Answer {
        if self.draining() {
            self.metrics.observe_refused_draining();
            return Answer::Draining;
        }
        let started = Instant::now();
        let now = now_ms();
        let mut input = wire::pick_input(req, now);
        if let Err(violation) = bounds::check_pick(req, &input) {
            // Debug, not warn: whoever can send Picks could flood the log.
            debug!(request_id = req.request_id, "pick rejected: {violation}");
            self.metrics.observe_rejected(violation.field);
            return Answer::Rejected(violation);
        }
        bounds::clamp_pick(&mut input);
        let sections: Vec<PromptSection> = req.sections.iter().map(PromptSection::from).collect();
        let call = Call {
            input,
            harness: req.harness(),
            tenant: &req.tenant,
            sections: &sections,
        };
        // The ledger's one question about the fleet, asked before the pick
        // and answered under the router's lock with the pick itself.
        let probe = self.insights().probe(&call);
        let (decision, holdings, destinations) = {
            let mut router = self.router();
            let decision: Decision = router.pick(input);
            let holdings = router.holdings(probe.as_slice());
            let destinations: Vec<String> = decision
                .ranked
                .iter()
                .filter_map(|id| router.address(*id).map(str::to_owned))
                .collect();
            (decision, holdings, destinations)
        };
        // The ledger consumes the record with the router's lock released.
        self.insights().on_pick(&call, &decision, &holdings);
        debug!(
            session = %req.session_id,
            blocks = req.block_hashes.len(),
            reason = decision.reason.as_str(),
            cached = decision.predicted_cached_blocks,
            cached_tokens = decision.predicted_cached_tokens,
            destination = destinations.first().map_or("", String::as_str),
            retention_horizon_ms = ?input.retention_horizon_ms,
            "pick"
        );
        if let (Some(store), Some(worker)) = (self.store.get(), destinations.first()) {
            store.publish(Placement {
                worker: worker.clone(),
                session: input.routing_key().to_owned(),
                blocks: input.full_blocks().to_vec(),
            });
        }
        self.metrics
            .observe_pick(&decision, req.block_hashes.len(), started.elapsed());
        // Measured where the answer leaves, not assumed: the shutdown check
        // above and this one are a few microseconds apart.
        if self.draining() {
            self.metrics.observe_answered_after_shutdown();
        }
        Answer::Decided(v1::PickReply {
            destinations,
            predicted_cached_blocks: decision.predicted_cached_blocks,
            reason: wire::reason_to_wire(decision.reason).into(),
            pick_id: decision.pick_id,
            request_id: req.request_id,
        })
    }

    /// Applies one Outcome. Oversized strings are ignored and implausible
    /// usage is dropped (counted), so neither reaches a counter or the
    /// router's learning; the outcome still releases its pick.
    pub(crate) fn report(&self, mut outcome: v1::Outcome) {
        for field in bounds::clip_outcome(&mut outcome) {
            debug!(
                pick_id = outcome.pick_id,
                field, "outcome field over its bound: ignored"
            );
            self.metrics.observe_outcome_field_dropped(field);
        }
        let (known, usage, served) = {
            let mut router = self.router();
            let mut core = wire::outcome_from_wire(&outcome);
            if let Err(err) = router.check_usage(&core) {
                debug!(pick_id = outcome.pick_id, "usage dropped: {err}");
                self.metrics.observe_usage_rejected(err.as_str());
                core.prompt_tokens = None;
                core.cached_tokens = None;
            }
            let served = router.worker_id(&outcome.destination);
            // A call Envoy retried on another worker (the picked one was
            // down) says nothing about the picked worker's cache: its
            // cached tokens must not shrink that worker's capacity estimate.
            let mut learned = core;
            if let (Some(served), Some(picked)) = (served, router.picked_worker(outcome.pick_id))
                && served != picked
            {
                learned.cached_tokens = None;
            }
            let known = router.report_at(learned, now_ms());
            (known, core, served)
        };
        // The ledger after the router's lock, as for a pick.
        self.insights().on_outcome(
            usage.pick_id,
            usage.prompt_tokens,
            usage.cached_tokens,
            served,
            now_ms(),
        );
        self.metrics
            .observe_report(known, usage.prompt_tokens, usage.cached_tokens);
    }
}
