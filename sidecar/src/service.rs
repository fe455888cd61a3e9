//! The gRPC edge: decodes Pick and Report, runs them through the routing core
//! under a short lock, and records what was decided.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use kvmesh_core::{Decision, Outcome, PickInput, Reason, Router};
use kvmesh_proto::v1::{self, router_server};
use tonic::{Request, Response, Status};
use tracing::debug;

use crate::metrics::Metrics;

/// The routing state shared by the gRPC and admin servers.
#[derive(Debug, Clone)]
pub(crate) struct Shared {
    router: Arc<Mutex<Router>>,
    pub(crate) metrics: Arc<Metrics>,
}

impl Shared {
    pub(crate) fn new(router: Router, metrics: Metrics) -> Self {
        Self {
            router: Arc::new(Mutex::new(router)),
            metrics: Arc::new(metrics),
        }
    }

    /// The core never panics while holding the lock, but if it ever did, the
    /// state is still the best picture there is: keep routing with it.
    pub(crate) fn router(&self) -> MutexGuard<'_, Router> {
        self.router.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
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
        Reason::LeastLoaded => v1::PickReason::LeastLoaded,
        Reason::SessionAffinity => v1::PickReason::SessionAffinity,
        Reason::NoWorkers => v1::PickReason::NoWorkers,
    }
}

#[tonic::async_trait]
impl router_server::Router for RouterService {
    async fn pick(&self, request: Request<v1::PickRequest>) -> Result<Response<v1::PickReply>, Status> {
        let started = Instant::now();
        let req = request.into_inner();
        let (decision, destinations) = {
            let mut router = self.shared.router();
            let decision: Decision = router.pick(PickInput {
                block_hashes: &req.block_hashes,
                last_block_partial: req.last_block_partial,
                session_id: &req.session_id,
            });
            let destinations: Vec<String> = decision
                .ranked
                .iter()
                .filter_map(|id| router.address(*id).map(str::to_owned))
                .collect();
            (decision, destinations)
        };
        debug!(
            session = %req.session_id,
            blocks = req.block_hashes.len(),
            reason = decision.reason.as_str(),
            cached = decision.predicted_cached_blocks,
            destination = destinations.first().map_or("", String::as_str),
            "pick"
        );
        self.shared.metrics.observe_pick(
            decision.reason,
            req.block_hashes.len(),
            decision.predicted_cached_blocks,
            started.elapsed(),
        );
        Ok(Response::new(v1::PickReply {
            destinations,
            predicted_cached_blocks: decision.predicted_cached_blocks,
            reason: reason_to_wire(decision.reason).into(),
            pick_id: decision.pick_id,
        }))
    }

    async fn report(&self, request: Request<v1::Outcome>) -> Result<Response<v1::ReportReply>, Status> {
        let outcome = request.into_inner();
        let known = self.shared.router().report(Outcome {
            pick_id: outcome.pick_id,
        });
        self.shared
            .metrics
            .observe_report(known, outcome.prompt_tokens, outcome.cached_tokens);
        Ok(Response::new(v1::ReportReply {}))
    }
}
