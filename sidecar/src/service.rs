//! The gRPC edge: the `kvmesh.v1.Router` service. It hands each Pick and
//! Outcome to `Shared::pick` and `Shared::report` (which check, decide and
//! record) and turns their answers into replies and statuses. Once shutdown
//! begins it ends its streams (see `shutdown`).

use std::pin::Pin;

use kvmesh_proto::v1::{self, router_server};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};
use tracing::debug;

use crate::state::{Answer, Shared};

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

/// The PickStream reply to a rejected Pick: no destination, so the filter
/// fails open for that request alone.
fn rejected_reply(request_id: u64) -> v1::PickReply {
    v1::PickReply {
        reason: v1::PickReason::Rejected.into(),
        request_id,
        ..v1::PickReply::default()
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
