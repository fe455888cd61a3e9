//! The gRPC edge: decodes Pick and Report, checks them against the wire
//! bounds, runs them through the routing core under a short lock, and
//! records what was decided. Once shutdown begins it decides nothing more
//! and ends its streams (see `shutdown`).

use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use kvmesh_core::{Call, Decision, Insights, Outcome, PickInput, PromptSection, Reason, Router, SectionKind};
use kvmesh_proto::v1::{self, router_server};
use tokio_stream::{Stream, StreamExt};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};
use tracing::debug;

use crate::bounds::{self, Violation};
use crate::metrics::Metrics;
use crate::store::{Placement, StoreHandle};

/// The routing state shared by the gRPC and admin servers.
#[derive(Debug, Clone)]
pub(crate) struct Shared {
    router: Arc<Mutex<Router>>,
    /// Fed each pick's record after the router's lock is released; locked
    /// after `router` when both are needed, never before it.
    insights: Arc<Mutex<Insights>>,
    pub(crate) metrics: Arc<Metrics>,
    /// Set once Redis is connected (never, without `--redis`).
    pub(crate) store: Arc<std::sync::OnceLock<StoreHandle>>,
    /// Cancelled when shutdown begins: from then on no Pick is decided and
    /// every stream ends.
    pub(crate) shutdown: CancellationToken,
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

impl Shared {
    pub(crate) fn new(router: Router, insights: Arc<Mutex<Insights>>, metrics: Metrics) -> Self {
        Self {
            router: Arc::new(Mutex::new(router)),
            insights,
            metrics: Arc::new(metrics),
            store: Arc::new(std::sync::OnceLock::new()),
            shutdown: CancellationToken::new(),
        }
    }

    /// Shutdown has begun.
    pub(crate) fn draining(&self) -> bool {
        self.shutdown.is_cancelled()
    }

    /// The core never panics while holding the lock, but if it ever did, the
    /// state is still the best picture there is: keep routing with it.
    pub(crate) fn router(&self) -> MutexGuard<'_, Router> {
        self.router.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The insight ledger (see `router` on poisoning).
    pub(crate) fn insights(&self) -> MutexGuard<'_, Insights> {
        lock_insights(&self.insights)
    }

    /// Charges idle sessions and refreshes the retention figures. The
    /// router is locked only to answer the ledger's questions (does each
    /// idle session's worker still hold its prefix), never while it runs.
    pub(crate) fn tick_insights(&self) {
        let probes = self.insights().idle_probes();
        let holdings = self.router().holdings(&probes);
        self.insights().tick(now_ms(), &holdings);
    }
}

pub(crate) fn lock_insights(insights: &Mutex<Insights>) -> MutexGuard<'_, Insights> {
    insights.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn section_from_wire(section: &v1::PromptSection) -> PromptSection {
    let kind = match v1::SectionKind::try_from(section.kind) {
        Ok(v1::SectionKind::Tools) => SectionKind::Tools,
        Ok(v1::SectionKind::System) => SectionKind::System,
        Ok(v1::SectionKind::Message) => SectionKind::Message,
        _ => SectionKind::Other,
    };
    PromptSection {
        kind,
        index: section.index,
        start: section.start_byte,
        digest: section.digest,
    }
}

/// The `kvmesh.v1.Router` gRPC service.
#[derive(Debug)]
pub(crate) struct RouterService {
    shared: Shared,
}

impl RouterService {
    pub(crate) fn new(shared: Shared) -> Self {
        Self { shared }
    }
}

fn reason_to_wire(reason: Reason) -> v1::PickReason {
    match reason {
        Reason::PrefixMatch => v1::PickReason::PrefixMatch,
        Reason::LoadSpill => v1::PickReason::LoadSpill,
        Reason::SessionAffinity => v1::PickReason::SessionAffinity,
        Reason::ParentSeed => v1::PickReason::ParentSeed,
        Reason::LeastLoaded => v1::PickReason::LeastLoaded,
        Reason::NoWorkers => v1::PickReason::NoWorkers,
    }
}

/// The PickStream reply to a rejected Pick: no destination, so the filter
/// fails open for that request alone.
fn rejected_reply(request_id: u64) -> v1::PickReply {
    v1::PickReply {
        reason: v1::PickReason::Rejected.into(),
        request_id,
        ..v1::PickReply::default()
    }
}

/// Wall-clock milliseconds: session TTLs and replicas share this clock.
pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
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
        let input = PickInput {
            block_hashes: &req.block_hashes,
            last_block_partial: req.last_block_partial,
            block_bytes: req.block_bytes,
            prompt_bytes: req.prompt_bytes,
            session_id: &req.session_id,
            agent_id: &req.agent_id,
            parent_id: &req.parent_id,
            model: &req.model,
            session_final: req.session_final,
            truncated: req.truncated,
            now_ms: now,
        };
        if let Err(violation) = bounds::check_pick(req, &input) {
            // Debug, not warn: whoever can send Picks could flood the log.
            debug!(request_id = req.request_id, "pick rejected: {violation}");
            self.metrics.observe_rejected(violation.field);
            return Answer::Rejected(violation);
        }
        let sections: Vec<PromptSection> = req.sections.iter().map(section_from_wire).collect();
        let call = Call {
            input,
            harness: &req.harness,
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
            destination = destinations.first().map_or("", String::as_str),
            "pick"
        );
        if let (Some(store), Some(worker)) = (self.store.get(), destinations.first()) {
            store.publish(Placement {
                worker: worker.clone(),
                session: input.routing_key().to_owned(),
                blocks: input.full_blocks().to_vec(),
            });
        }
        self.metrics.observe_pick(
            decision.reason,
            req.block_hashes.len(),
            decision.predicted_cached_blocks,
            started.elapsed(),
        );
        // Measured where the answer leaves, not assumed: the shutdown check
        // above and this one are a few microseconds apart.
        if self.draining() {
            self.metrics.observe_answered_after_shutdown();
        }
        Answer::Decided(v1::PickReply {
            destinations,
            predicted_cached_blocks: decision.predicted_cached_blocks,
            reason: reason_to_wire(decision.reason).into(),
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
            let mut core = Outcome {
                pick_id: outcome.pick_id,
                prompt_tokens: outcome.prompt_tokens,
                cached_tokens: outcome.cached_tokens,
                ttfb_ms: outcome.ttfb_ms,
            };
            if let Err(err) = router.check_usage(&core) {
                debug!(pick_id = outcome.pick_id, "usage dropped: {err}");
                self.metrics.observe_usage_rejected(err.as_str());
                core.prompt_tokens = None;
                core.cached_tokens = None;
            }
            let known = router.report(core);
            let served = router.worker_id(&outcome.destination);
            (known, core, served)
        };
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

type PickReplies = Pin<Box<dyn Stream<Item = Result<v1::PickReply, Status>> + Send>>;

#[tonic::async_trait]
impl router_server::Router for RouterService {
    async fn pick(&self, request: Request<v1::PickRequest>) -> Result<Response<v1::PickReply>, Status> {
        match self.shared.pick(&request.into_inner()) {
            Answer::Decided(reply) => Ok(Response::new(reply)),
            Answer::Rejected(violation) => Err(Status::invalid_argument(violation.to_string())),
            Answer::Draining => Err(Status::unavailable("kvmesh-sidecar is shutting down")),
        }
    }

    async fn report(&self, request: Request<v1::Outcome>) -> Result<Response<v1::ReportReply>, Status> {
        self.shared.report(request.into_inner());
        Ok(Response::new(v1::ReportReply {}))
    }

    type PickStreamStream = PickReplies;

    /// Each Pick on the stream is answered as soon as it is read; the reply
    /// carries the request's id, so the filter matches them up. A rejected
    /// Pick gets an empty reply and the stream goes on. At shutdown the
    /// stream ends (OK, at once, even between two Picks): tonic's graceful
    /// shutdown would otherwise wait on it for as long as Envoy keeps it.
    async fn pick_stream(
        &self,
        request: Request<Streaming<v1::PickRequest>>,
    ) -> Result<Response<Self::PickStreamStream>, Status> {
        if self.shared.draining() {
            return Err(Status::unavailable("kvmesh-sidecar is shutting down"));
        }
        let shared = self.shared.clone();
        let picks =
            futures_util::StreamExt::take_until(request.into_inner(), shared.shutdown.clone().cancelled_owned());
        let replies = picks.map_while(move |pick| match pick {
            Ok(pick) => match shared.pick(&pick) {
                Answer::Decided(reply) => Some(Ok(reply)),
                Answer::Rejected(_) => Some(Ok(rejected_reply(pick.request_id))),
                Answer::Draining => None,
            },
            Err(status) => Some(Err(status)),
        });
        Ok(Response::new(Box::pin(replies)))
    }

    async fn report_stream(
        &self,
        request: Request<Streaming<v1::Outcome>>,
    ) -> Result<Response<v1::ReportReply>, Status> {
        let mut outcomes = request.into_inner();
        loop {
            let outcome = tokio::select! {
                // Ends the stream at shutdown: the filter's next stream goes
                // to a replica still serving.
                () = self.shared.shutdown.cancelled() => break,
                outcome = outcomes.next() => outcome,
            };
            let Some(outcome) = outcome else { break };
            match outcome {
                Ok(outcome) => self.shared.report(outcome),
                // The filter's side went away (Envoy restart, reset): its
                // next stream carries on.
                Err(status) => {
                    debug!("report stream ended: {status}");
                    break;
                }
            }
        }
        Ok(Response::new(v1::ReportReply {}))
    }
}
