//! The sidecar's shared state, [`Shared`]: the router, the insight ledger,
//! the metrics, the Redis placement sink and the shutdown token, with the
//! one lock order they are taken in, and the two things every Pick and
//! Outcome goes through whichever edge brought it: `pick` (check, decide,
//! record, publish) and `report` (clip, learn, record).
//!
//! The router itself is owned by one thread (`owner.rs`), fed in order
//! through a channel; this module is the only one that sends it commands.
//! An edge reads or changes the router through a narrow method of
//! `Shared`, one command with owned data in and out, so every command a
//! Pick may wait behind is here. Reads for readiness, metrics and the
//! engine watcher's scrape list come from the view the owner's thread
//! publishes, and send no command.
//!
//! Below every edge: gRPC, admin HTTP, the Redis store, the engine watcher
//! and shutdown all import this module, and it imports none of them. The
//! store plugs in through [`PlacementSink`], so Pick can publish a placement
//! without knowing Redis.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use kvmesh_core::{
    Call, EngineCacheChange, EngineCacheEffect, Holdings, Insights, PromptSection, Report, Router, Snapshot, WorkerId,
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
use crate::owner::RouterOwner;
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
/// handful of `Arc`s and the owner's sender).
///
/// The router is owned by one thread (`owner.rs`) that applies commands
/// in the order they arrive. This module alone sends them, from `pick`,
/// `report`, the ledger's tick and the narrow methods the edges call
/// (`tests/one_owner.rs` checks it), so each command's length and what
/// waits behind it can be seen here. `workers` and `scrape_figures` read
/// the view the owner's thread publishes instead: at most about 100 ms
/// old (current as to the worker set), which readiness, the watcher's
/// scrape list and metrics can afford.
///
/// Lock order: `ticks` (a pass of the ledger's tick), then `reports`,
/// then `insights`. No command locks anything: a command that locked the
/// ledger would wait on a thread that may itself be waiting on the
/// router, so the ledger consumes each Pick's record after the router's
/// command has answered, and is never locked inside one. Sending a
/// command while holding the ledger's lock would make every Pick wait on
/// the router's queue too: nothing does. Nothing is locked across an
/// `.await`: the locks are std mutexes held for microseconds, and a
/// command is waited for on the calling thread, like a lock.
#[derive(Debug, Clone)]
pub(crate) struct Shared {
    owner: RouterOwner,
    /// Fed each pick's record after the router's command has answered;
    /// never locked inside a command.
    insights: Arc<Mutex<Insights>>,
    pub(crate) metrics: Arc<Metrics>,
    /// When the last pass of the ledger's tick ended and how long it took;
    /// held through a pass, so passes never overlap. Locked before
    /// `insights`, and held while the pass sends the router commands.
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
    /// Moves `router` onto its owner's thread. Fails only when the OS
    /// refuses that thread.
    pub(crate) fn new(router: Router, insights: Arc<Mutex<Insights>>, metrics: Metrics) -> std::io::Result<Self> {
        Ok(Self {
            owner: RouterOwner::start(router)?,
            insights,
            metrics: Arc::new(metrics),
            ticks: Arc::default(),
            reports: Arc::default(),
            store: Arc::new(std::sync::OnceLock::new()),
            shutdown: CancellationToken::new(),
        })
    }

    /// Shutdown has begun.
    pub(crate) fn draining(&self) -> bool {
        self.shutdown.is_cancelled()
    }

    /// Runs `f` on the router's thread, after every command sent before
    /// it, or answers `lost()` when no reply comes back. A lost reply is a
    /// bug: the command panicked in the core (the panic hook printed why;
    /// the owner's thread lives on) or the thread is gone. Each caller
    /// picks the answer that does least harm, documented where it calls.
    /// Private: edges go through the narrow methods below.
    fn on_router<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Router) -> T + Send + 'static,
        lost: impl FnOnce() -> T,
    ) -> T {
        self.owner.run(f).unwrap_or_else(|_| lost())
    }

    /// As [`Shared::on_router`], and the view is published before it
    /// answers: for a command that changes the worker set or its health,
    /// so readiness and the watcher's scrape list see it at once.
    fn on_router_then_publish<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Router) -> T + Send + 'static,
        lost: impl FnOnce() -> T,
    ) -> T {
        self.owner.run_and_publish(f).unwrap_or_else(|_| lost())
    }

    /// The insight ledger (see `lock` on poisoning).
    pub(crate) fn insights(&self) -> MutexGuard<'_, Insights> {
        lock(&self.insights)
    }

    /// Charges idle sessions, ends the expired, and refreshes the retention
    /// figures and idle lists: one pass of the ledger's tick, in steps of
    /// [`TICK_STEP`] sessions, each step one hold of the ledger's lock and
    /// one command to the router. Done whole under the ledger's lock (and
    /// the router's for the holdings, when it had one), the walk cost
    /// 0.35 ms per 1,000 sessions, 33-42 ms at 100,000, and every Pick
    /// waited it out (the filter's timeout is 50 ms).
    pub(crate) fn tick_insights(&self) {
        let mut ticks = lock(&self.ticks);
        let started = Instant::now();
        let mut pass = self.insights().tick_begin(now_ms());
        loop {
            let mut step = self.insights().tick_step(&pass, TICK_STEP);
            // The step's other parts stay here for `tick_apply`, which
            // does not read the probes.
            let probes = std::mem::take(&mut step.probes);
            // A lost reply answers nothing held: this step's idle sessions
            // are charged as if their prefix were gone, until the next pass.
            let holdings = self.on_router(move |router| router.holdings(&probes), || Holdings::new([]));
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

/// A pause between two holds of the same lock, or two commands to the
/// router, in a loop. A std mutex is not fair: a thread that unlocks and
/// locks again at once keeps it while the Picks it woke are still being
/// scheduled. The router's channel is fair (commands apply in arrival
/// order), but on two cores a pass that never sleeps takes a core from the
/// Picks for its whole length: a
/// pass of a hundred steps (100,000 sessions, `kvmesh-bench scale`) held
/// Picks up to 216 ms with a 50 µs pause, though no step held a lock 1 ms.
/// At 500 µs a pass runs at most about 40 % of a core and lasts about
/// 100 steps × 0.85 ms.
pub(crate) fn between_locks() {
    std::thread::sleep(std::time::Duration::from_micros(500));
}

/// Sessions one step of the ledger's tick visits: about 0.35 ms under the
/// ledger's lock, then their holdings in one command to the router.
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
    /// Checks one Pick, then decides it and records it. The request moves
    /// into the router's command (its input borrows it) and comes back
    /// with the decision, for the ledger, the log and the store.
    pub(crate) fn pick(&self, req: v1::PickRequest) -> Answer {
        if self.draining() {
            self.metrics.observe_refused_draining();
            return Answer::Draining;
        }
        let started = Instant::now();
        let now = now_ms();
        let sections: Vec<PromptSection> = req.sections.iter().map(PromptSection::from).collect();
        let probe = {
            let mut input = wire::pick_input(&req, now);
            if let Err(violation) = bounds::check_pick(&req, &input) {
                // Debug, not warn: whoever can send Picks could flood the log.
                debug!(request_id = req.request_id, "pick rejected: {violation}");
                self.metrics.observe_rejected(violation.field);
                return Answer::Rejected(violation);
            }
            bounds::clamp_pick(&mut input);
            let call = Call {
                input,
                harness: req.harness(),
                tenant: &req.tenant,
                sections: &sections,
            };
            // The ledger's one question about the fleet, asked before the
            // pick and answered in the router's command with the pick itself.
            self.insights().probe(&call)
        };
        let request_id = req.request_id;
        let routed = self.owner.run(move |router| {
            // Built again from the checked request: `pick_input` and
            // `clamp_pick` (a `min`) give the input checked above.
            let mut input = wire::pick_input(&req, now);
            bounds::clamp_pick(&mut input);
            let decision = router.pick(input);
            let holdings = router.holdings(probe.as_slice());
            let destinations: Vec<String> = decision
                .ranked
                .iter()
                .filter_map(|id| router.address(*id).map(str::to_owned))
                .collect();
            (req, decision, holdings, destinations)
        });
        let Ok((req, decision, holdings, destinations)) = routed else {
            // A lost reply (see `on_router`): no decision, nothing recorded.
            // No destination, as for a Pick with no workers: the filter
            // lets Envoy balance the request, as when the sidecar is down.
            return Answer::Decided(v1::PickReply {
                request_id,
                ..v1::PickReply::default()
            });
        };
        let mut input = wire::pick_input(&req, now);
        bounds::clamp_pick(&mut input);
        let call = Call {
            input,
            harness: req.harness(),
            tenant: &req.tenant,
            sections: &sections,
        };
        // The ledger consumes the record once the router has answered.
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
        let reported = wire::outcome_from_wire(&outcome);
        let destination = std::mem::take(&mut outcome.destination);
        let (known, usage, served, refused) = self.on_router(
            move |router| {
                let mut core = reported;
                let refused = router.check_usage(&core).err();
                if refused.is_some() {
                    core.prompt_tokens = None;
                    core.cached_tokens = None;
                }
                let served = router.worker_id(&destination);
                // A call Envoy retried on another worker (the picked one was
                // down) says nothing about the picked worker's cache: its
                // cached tokens must not shrink that worker's capacity
                // estimate.
                let mut learned = core;
                if let (Some(served), Some(picked)) = (served, router.picked_worker(core.pick_id))
                    && served != picked
                {
                    learned.cached_tokens = None;
                }
                let known = router.report_at(learned, now_ms());
                (known, core, served, refused)
            },
            // A lost reply (see `on_router`): counted as an unknown pick;
            // the ledger still releases its record below.
            || (false, reported, None, None),
        );
        if let Some(err) = refused {
            debug!(pick_id = outcome.pick_id, "usage dropped: {err}");
            self.metrics.observe_usage_rejected(err.as_str());
        }
        // The ledger once the router has answered, as for a pick.
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

/// What each edge reads of the router or does to it: one command per call
/// (or a read of the published view, where said), with what the edge did
/// in the same order, owned data in and out. A loop that sends commands in
/// steps calls [`between_locks`] between them. Each says what a lost reply
/// (see `on_router`) answers.
impl Shared {
    /// The workers (readiness, the engine watcher's scrape list), from the
    /// published view: at most about 100 ms old, and current as to which
    /// workers exist (adding or removing one publishes).
    pub(crate) fn workers(&self) -> Vec<WorkerView> {
        self.owner.view().workers.clone()
    }

    /// The workers with their prefill queues drained to `now` (a page read
    /// while no Pick arrives shows what is still queued). Lost: the
    /// published view's workers.
    pub(crate) fn worker_views(&self, now: u64) -> Vec<WorkerView> {
        self.on_router(move |router| router.workers_at(now), || self.workers())
    }

    /// What a metrics scrape renders: the workers and the sizes of the
    /// router's tables from the published view (at most about 100 ms old),
    /// and the ledger's sizes as of now. The workers' prefill queues are as
    /// of the last Pick (metrics render no queue).
    pub(crate) fn scrape_figures(&self) -> (Vec<WorkerView>, StateSizes) {
        let view = self.owner.view();
        let insights = self.insights();
        (
            view.workers.clone(),
            StateSizes {
                sessions: view.sessions,
                index_entries: view.index_entries,
                index_bytes: view.index_bytes,
                models: view.models,
                trace_carriers: view.trace_carriers,
                trace_bytes: insights.trace_memory_bytes(),
                lane_sessions: insights.lane_sessions(),
            },
        )
    }

    /// How many sessions the router follows, and the workers' addresses
    /// (indexed by worker id), read together in one command. Not from the
    /// published view: `/debug/sessions` reports this count beside rows it
    /// reads by command, and a count up to 100 ms old disagreed with them
    /// (0 beside 5 rows in `tests/debug_pages.rs`). Lost: the published
    /// view's.
    pub(crate) fn session_count_and_addresses(&self) -> (usize, Vec<String>) {
        let addresses = |workers: Vec<WorkerView>| workers.into_iter().map(|w| w.address).collect();
        self.on_router(
            move |router| (router.sessions().len(), addresses(router.workers())),
            || {
                let view = self.owner.view();
                (view.sessions, addresses(view.workers.clone()))
            },
        )
    }

    /// Up to `want` sessions seen before `cursor` (`u64::MAX`: the newest),
    /// newest first, and the cursor to go on from. Lost: none, and
    /// `cursor` again, which ends a page's walk.
    pub(crate) fn sessions_before(&self, cursor: u64, want: usize) -> (Vec<SessionView>, u64) {
        self.on_router(
            move |router| {
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
            },
            || (Vec::new(), cursor),
        )
    }

    /// As [`Shared::sessions_before`], counting the sessions without
    /// copying them (a page's offset, skipped). Lost: none, and `cursor`.
    pub(crate) fn count_sessions_before(&self, cursor: u64, want: usize) -> (usize, u64) {
        self.on_router(
            move |router| {
                let (found, resume) = router.sessions().newest_before(cursor, want);
                (found.len(), resume)
            },
            || (0, cursor),
        )
    }

    /// One worker's retention residents: its session blocks and their
    /// value in blocks. Walks that worker's live sessions. Lost: none.
    pub(crate) fn worker_retention(&self, worker: WorkerId, now: u64) -> (usize, f64) {
        self.on_router(move |router| router.retention().worker_value(worker, now), || (0, 0.0))
    }

    /// The return-gap histograms the agent report's retention section
    /// needs. Lost: none (the section shows no gaps).
    pub(crate) fn fleet_snapshot(&self) -> FleetSnapshot {
        self.on_router(|router| FleetSnapshot::take(router), FleetSnapshot::default)
    }

    /// A failed scrape of the worker at `address`: marked down when
    /// `mark_down` (published at once, for readiness). False when the
    /// router does not know the worker, or the reply was lost.
    pub(crate) fn engine_unreachable(&self, address: &str, mark_down: bool) -> bool {
        let address = address.to_owned();
        let command = move |router: &mut Router| {
            let Some(id) = router.worker_id(&address) else {
                return false;
            };
            if mark_down {
                router.set_healthy(id, false);
            }
            true
        };
        if mark_down {
            self.on_router_then_publish(command, || false)
        } else {
            self.on_router(command, || false)
        }
    }

    /// A successful scrape of the worker at `address`: marked healthy, its
    /// blocks forgotten when the engine `restarted`, then its engine's
    /// figures. Returns the blocks the restart forgot (0 without one), or
    /// `None` when the router does not know the worker or the reply was
    /// lost. A worker the view shows down is published up at once.
    pub(crate) fn engine_scraped(&self, address: &str, snapshot: &EngineSnapshot, restarted: bool) -> Option<usize> {
        // The watcher keeps its snapshot to compare the next with; a copy
        // is a dozen numbers.
        let snapshot = snapshot.clone();
        let address = address.to_owned();
        let comes_up = self
            .owner
            .view()
            .workers
            .iter()
            .any(|w| w.address == address && !w.healthy);
        let command = move |router: &mut Router| {
            let id = router.worker_id(&address)?;
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
        };
        if comes_up {
            self.on_router_then_publish(command, || None)
        } else {
            self.on_router(command, || None)
        }
    }

    /// Adds the workers at `appeared` and removes those at `vanished`, in
    /// one command, and publishes the view before answering (the watcher
    /// scrapes the new list at once). Returns the added workers' ids (in
    /// the order of `appeared`) and the indices into `vanished` of the
    /// addresses the router knew. Lost: none added, none removed.
    pub(crate) fn add_and_remove_workers(
        &self,
        appeared: &[String],
        vanished: &[String],
    ) -> (Vec<WorkerId>, Vec<usize>) {
        // Copied: the watcher logs them once the router has answered.
        let (appeared, vanished) = (appeared.to_vec(), vanished.to_vec());
        self.on_router_then_publish(
            move |router| {
                let added = appeared.iter().map(|address| router.add_worker(address)).collect();
                let mut removed = Vec::new();
                for (i, address) in vanished.iter().enumerate() {
                    if let Some(id) = router.worker_id(address) {
                        router.remove(id);
                        removed.push(i);
                    }
                }
                (added, removed)
            },
            || (Vec::new(), Vec::new()),
        )
    }

    /// Ends up to [`kvmesh_core::EXPIRE_STEP`] sessions idle past their TTL
    /// at `now`; returns how many it ended. Lost: 0 (the pass stops).
    pub(crate) fn expire_sessions_step(&self, now: u64) -> usize {
        self.on_router(move |router| router.expire_sessions(now), || 0)
    }

    /// Applies one batch of the KV events of the engine at `worker`, or
    /// `None` when the router does not know that worker or the reply was
    /// lost.
    pub(crate) fn apply_kv_events(&self, worker: &str, change: EngineCacheChange) -> Option<EngineCacheEffect> {
        let worker = worker.to_owned();
        self.on_router(
            move |router| {
                let id = router.worker_id(&worker)?;
                Some(router.engine_events(id, &change))
            },
            || None,
        )
    }

    /// Everything needed to restart warm (see [`Router::snapshot`]). Lost:
    /// `None`, and no snapshot is written (an empty one would replace the
    /// last good one).
    pub(crate) fn routing_snapshot(&self) -> Option<Snapshot> {
        self.on_router(|router| Some(router.snapshot()), || None)
    }

    /// Loads a snapshot taken by [`Shared::routing_snapshot`], here or on
    /// another replica. Lost: nothing loaded (the replica starts cold).
    pub(crate) fn restore_routing(&self, snapshot: Snapshot) {
        self.on_router(move |router| router.restore(&snapshot), || ());
    }

    /// Other replicas' placements, applied in order in one command. Lost:
    /// none applied.
    pub(crate) fn observe_placements(&self, placements: Vec<Placement>, now: u64) {
        self.on_router(
            move |router| {
                for placement in &placements {
                    router.observe_placement(&placement.worker, &placement.blocks, &placement.session, now);
                }
            },
            || (),
        );
    }
}
