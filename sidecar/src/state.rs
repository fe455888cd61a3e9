//! The sidecar's shared state, [`Shared`]: the router, the insight ledger,
//! the metrics, the Redis placement sink and the shutdown token, with the
//! one lock order they are taken in, and the two things every Pick and
//! Outcome goes through whichever edge brought it: `pick` (check, decide,
//! record, publish) and `report` (clip, learn, record).
//!
//! It is the router's one owner: no other module locks it. An edge reads
//! or changes the router through a narrow method of `Shared`, one hold of
//! the lock with owned data out, so every hold a Pick may wait on is here.
//!
//! Below every edge: gRPC, admin HTTP, the Redis store, the engine watcher
//! and shutdown all import this module, and it imports none of them. The
//! store plugs in through [`PlacementSink`], so Pick can publish a placement
//! without knowing Redis.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use kvmesh_core::{
    Call, Decision, EngineCacheChange, EngineCacheEffect, Insights, PromptSection, Report, Router, Snapshot, WorkerId,
    WorkerView,
};
use kvmesh_proto::v1;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::bounds::{self, Violation};
use crate::clock::now_ms;
use crate::engine_metrics::EngineSnapshot;
use crate::lock::lock;
use crate::metrics::{Metrics, StateSizes};
use crate::retention_report::FleetSnapshot;
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
/// The router's lock is taken in this module alone, by `pick`, `report`,
/// the ledger's tick and the narrow methods the edges call
/// (`tests/one_owner.rs` checks it), so each hold's length and place in
/// the lock order can be seen here.
///
/// Lock order: `ticks` (a pass of the ledger's tick), then `router` before
/// `insights`, never the reverse. The ledger
/// consumes each Pick's record after the router's lock is released (Picks
/// never wait on it), so the two are rarely held together; where they are
/// (the figures of a metrics scrape), the router comes first, and a method
/// that locked the ledger first and then wanted the router could deadlock
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

    /// The router (see `lock` on poisoning). Private: edges go through the
    /// narrow methods below.
    fn router(&self) -> MutexGuard<'_, Router> {
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

/// One session of a `/debug/sessions` page, as the router has it.
#[derive(Debug)]
pub(crate) struct SessionView {
    pub(crate) session: String,
    pub(crate) home: WorkerId,
    pub(crate) last_seen_ms: u64,
    /// As the router resolved it.
    pub(crate) parent: Option<String>,
}

/// What each edge reads of the router or does to it: one hold of the
/// router's lock per call, with what the edge did under that hold and in
/// the same order, owned data out. A loop that holds it in steps calls
/// [`between_locks`] between them.
impl Shared {
    /// The workers (readiness, the engine watcher's scrape list).
    pub(crate) fn workers(&self) -> Vec<WorkerView> {
        self.router().workers()
    }

    /// The workers with their prefill queues drained to `now` (a page read
    /// while no Pick arrives shows what is still queued).
    pub(crate) fn worker_views(&self, now: u64) -> Vec<WorkerView> {
        self.router().workers_at(now)
    }

    /// What a metrics scrape renders: the workers as of now and the sizes
    /// of the router's and the ledger's tables, read in one hold of both.
    pub(crate) fn scrape_figures(&self) -> (Vec<WorkerView>, StateSizes) {
        let router = self.router();
        let index = router.index();
        // Router first, then the ledger: the order documented on `Shared`.
        // One guard: a second lock of the ledger in the same expression
        // would wait on the first forever.
        let insights = self.insights();
        (
            router.workers_at(now_ms()),
            StateSizes {
                sessions: router.sessions().len(),
                index_entries: index.entries(),
                index_bytes: index.memory_bytes(),
                models: router.models(),
                trace_carriers: router.sessions().traces(),
                trace_bytes: insights.trace_memory_bytes(),
                lane_sessions: insights.lane_sessions(),
            },
        )
    }

    /// How many sessions the router follows, and the workers' addresses
    /// (indexed by worker id), read together.
    pub(crate) fn session_count_and_addresses(&self) -> (usize, Vec<String>) {
        let router = self.router();
        let addresses: Vec<String> = router.workers().into_iter().map(|w| w.address).collect();
        (router.sessions().len(), addresses)
    }

    /// Up to `want` sessions seen before `cursor` (`u64::MAX`: the newest),
    /// newest first, and the cursor to go on from.
    pub(crate) fn sessions_before(&self, cursor: u64, want: usize) -> (Vec<SessionView>, u64) {
        let router = self.router();
        let table = router.sessions();
        let (found, resume) = table.newest_before(cursor, want);
        let sessions = found
            .iter()
            .map(|&(id, home, seen)| SessionView {
                session: id.to_owned(),
                home,
                last_seen_ms: seen,
                parent: table.parent(id).map(str::to_owned),
            })
            .collect();
        (sessions, resume)
    }

    /// As [`Shared::sessions_before`], counting the sessions without
    /// copying them (a page's offset, skipped).
    pub(crate) fn count_sessions_before(&self, cursor: u64, want: usize) -> (usize, u64) {
        let router = self.router();
        let (found, resume) = router.sessions().newest_before(cursor, want);
        (found.len(), resume)
    }

    /// One worker's retention residents: its session blocks and their
    /// value in blocks. Walks that worker's live sessions.
    pub(crate) fn worker_retention(&self, worker: WorkerId, now: u64) -> (usize, f64) {
        self.router().retention().worker_value(worker, now)
    }

    /// The return-gap histograms the agent report's retention section needs.
    pub(crate) fn fleet_snapshot(&self) -> FleetSnapshot {
        FleetSnapshot::take(&self.router())
    }

    /// A failed scrape of the worker at `address`: marked down when
    /// `mark_down`. False when the router does not know the worker.
    pub(crate) fn engine_unreachable(&self, address: &str, mark_down: bool) -> bool {
        let mut router = self.router();
        let Some(id) = router.worker_id(address) else {
            return false;
        };
        if mark_down {
            router.set_healthy(id, false);
        }
        true
    }

    /// A successful scrape of the worker at `address`: marked healthy, its
    /// blocks forgotten when the engine `restarted`, then its engine's
    /// figures. Returns the blocks the restart forgot (0 without one), or
    /// `None` when the router does not know the worker.
    pub(crate) fn engine_scraped(&self, address: &str, snapshot: &EngineSnapshot, restarted: bool) -> Option<usize> {
        let mut router = self.router();
        let id = router.worker_id(address)?;
        router.set_healthy(id, true);
        let dropped = if restarted { router.restart(id) } else { 0 };
        if let Some(waiting) = snapshot.waiting {
            router.set_engine_waiting(id, waiting);
        }
        router.set_engine_activity(id, snapshot.running, snapshot.kv_usage);
        if let Some(tokens) = snapshot.block_size_tokens {
            router.set_engine_block_tokens(id, tokens);
        }
        if let Some(tokens) = snapshot.capacity_tokens {
            router.set_engine_capacity_tokens(id, tokens);
        }
        Some(dropped)
    }

    /// Adds the workers at `appeared` and removes those at `vanished`, in
    /// one hold. Returns the added workers' ids (in the order of
    /// `appeared`) and the vanished addresses the router knew.
    pub(crate) fn add_and_remove_workers<'a>(
        &self,
        appeared: &[String],
        vanished: &'a [String],
    ) -> (Vec<WorkerId>, Vec<&'a str>) {
        let mut router = self.router();
        let added = appeared.iter().map(|address| router.add_worker(address)).collect();
        let mut removed = Vec::new();
        for address in vanished {
            if let Some(id) = router.worker_id(address) {
                router.remove(id);
                removed.push(address.as_str());
            }
        }
        (added, removed)
    }

    /// Ends up to [`kvmesh_core::EXPIRE_STEP`] sessions idle past their TTL
    /// at `now`; returns how many it ended.
    pub(crate) fn expire_sessions_step(&self, now: u64) -> usize {
        self.router().expire_sessions(now)
    }

    /// Applies one batch of the KV events of the engine at `worker`, or
    /// `None` when the router does not know that worker.
    pub(crate) fn apply_kv_events(&self, worker: &str, change: &EngineCacheChange) -> Option<EngineCacheEffect> {
        let mut router = self.router();
        let id = router.worker_id(worker)?;
        Some(router.engine_events(id, change))
    }

    /// Everything needed to restart warm (see [`Router::snapshot`]).
    pub(crate) fn routing_snapshot(&self) -> Snapshot {
        self.router().snapshot()
    }

    /// Loads a snapshot taken by [`Shared::routing_snapshot`], here or on
    /// another replica.
    pub(crate) fn restore_routing(&self, snapshot: &Snapshot) {
        self.router().restore(snapshot);
    }

    /// Other replicas' placements, applied in order in one hold.
    pub(crate) fn observe_placements(&self, placements: &[Placement], now: u64) {
        let mut router = self.router();
        for placement in placements {
            router.observe_placement(&placement.worker, &placement.blocks, &placement.session, now);
        }
    }
}
