//! The filter's two ways to reach the sidecar, and what both share.
//!
//! The fast way is one long-lived `PickStream` (and `ReportStream`) per
//! Envoy worker VM, owned by the root context: a request's Pick is one
//! message on it and the reply comes back tagged with the request's id. A
//! unary `dispatch_grpc_call` per request costs Envoy several times more (it
//! sets up a new HTTP/2 stream through its router each time), so it is only
//! the fallback while the stream is down (start-up, sidecar restarts).
//!
//! Streams have no per-message timeout, so the root context enforces the
//! Pick timeout itself on a short tick, and resumes timed-out requests.

use std::cell::Cell;
use std::collections::HashMap;
use std::rc::Rc;
use std::time::{Duration, SystemTime};

use kvmesh_proto::{method, v1};
use kvmesh_request::DESTINATION_HEADER;
use proxy_wasm::hostcalls;
use proxy_wasm::types::MapType;

use crate::metrics::FailOpen;

/// How often the root context checks Pick deadlines: a timed-out request
/// waits at most this much past the configured timeout.
pub(crate) const TICK: Duration = Duration::from_millis(5);
/// Wait before reopening a stream that closed: short at first (a sidecar
/// that drains for shutdown ends its streams, and the next replica should
/// take over at once), doubling while reopening keeps failing, up to
/// `REOPEN_MAX` (a sidecar that is down is not hammered every tick).
const REOPEN_FIRST: Duration = Duration::from_millis(10);
const REOPEN_MAX: Duration = Duration::from_secs(1);

/// One request's Pick, shared by its HTTP context and the root context that
/// may answer it.
#[derive(Debug, Default)]
pub(crate) struct PickCell {
    /// The request has been resumed (routed or failed open).
    pub(crate) resolved: Cell<bool>,
    /// The sidecar's pick id, when it routed the request.
    pub(crate) pick_id: Cell<Option<u64>>,
    /// When the Pick was sent and the request resumed (`timing`).
    pub(crate) sent: Cell<crate::timing::Stamp>,
    pub(crate) resumed: Cell<crate::timing::Stamp>,
}

#[derive(Debug)]
pub(crate) struct Pending {
    context_id: u32,
    deadline: SystemTime,
    pub(crate) cell: Rc<PickCell>,
}

/// Per-VM stream state, owned by the root context, reached by HTTP contexts
/// through `Shared`.
#[derive(Debug, Default)]
pub(crate) struct Streams {
    pub(crate) root_id: u32,
    pick: Option<u32>,
    report: Option<u32>,
    next_request_id: u64,
    pending: HashMap<u64, Pending>,
    reopen_at: Option<SystemTime>,
    /// The wait before the next reopen; back to `REOPEN_FIRST` once a reply
    /// arrives on the pick stream.
    reopen_backoff: Duration,
}

/// The destinations of a reply as the header value, or why there are none.
pub(crate) fn destination_value(reply: &v1::PickReply) -> Result<String, FailOpen> {
    // Only `ip:port` / `[v6]:port` reach the header: the only forms Envoy's
    // override_host matches. Anything else from the sidecar is dropped.
    let destinations: Vec<&str> = reply
        .destinations
        .iter()
        .map(String::as_str)
        .filter(|d| d.parse::<std::net::SocketAddr>().is_ok())
        .collect();
    if destinations.is_empty() {
        return Err(FailOpen::NoDestination);
    }
    Ok(destinations.join(","))
}

/// Runs `f` with `context_id` as Envoy's effective context, then returns to
/// `back_to`. `None` when that context no longer exists.
fn as_context<T>(context_id: u32, back_to: u32, f: impl FnOnce() -> T) -> Option<T> {
    hostcalls::set_effective_context(context_id).ok()?;
    let out = f();
    let _ = hostcalls::set_effective_context(back_to);
    Some(out)
}

/// Resumes a request waiting on a Pick, with `header` as its destination
/// if any. Called with no borrow of `Streams` held: resuming can run the
/// request's own callbacks synchronously (a local reply, its log).
pub(crate) fn resolve(root_id: u32, pending: &Pending, header: Option<&str>, pick_id: Option<u64>) {
    pending.cell.resolved.set(true);
    pending.cell.pick_id.set(pick_id);
    let resuming = crate::timing::now();
    as_context(pending.context_id, root_id, || {
        if let Some(value) = header {
            let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, DESTINATION_HEADER, Some(value));
        }
        pending.cell.resumed.set(crate::timing::now());
        let _ = hostcalls::resume_http_request();
    });
    crate::timing::add(crate::timing::Phase::Resume, resuming);
}

/// Sends `message` on stream `token` owned by the root context, from the
/// HTTP context `context_id`. Called with no borrow of `Streams` held.
pub(crate) fn send_on_stream(root_id: u32, context_id: u32, token: u32, message: &[u8]) -> bool {
    let sent = as_context(root_id, context_id, || {
        hostcalls::send_grpc_stream_message(token, Some(message), false)
    });
    matches!(sent, Some(Ok(())))
}

impl Streams {
    pub(crate) fn new(root_id: u32) -> Self {
        Self {
            root_id,
            reopen_backoff: REOPEN_FIRST,
            ..Self::default()
        }
    }

    /// Opens whichever stream is down, unless a recent close asks to wait.
    /// Must run in a root callback: the SDK ties a stream to the context
    /// active when it was opened.
    pub(crate) fn ensure_open(&mut self, cluster: &str, metadata: &[(&'static str, Vec<u8>)], now: SystemTime) {
        if self.reopen_at.is_some_and(|at| now < at) {
            return;
        }
        self.reopen_at = None;
        let metadata = || metadata.iter().map(|(k, v)| (*k, v.as_slice())).collect::<Vec<_>>();
        if self.pick.is_none() {
            self.pick = hostcalls::open_grpc_stream(cluster, method::SERVICE, method::PICK_STREAM, metadata()).ok();
        }
        if self.report.is_none() {
            self.report = hostcalls::open_grpc_stream(cluster, method::SERVICE, method::REPORT_STREAM, metadata()).ok();
        }
    }

    /// The open pick stream and a fresh request id for it.
    pub(crate) fn next_pick(&mut self) -> Option<(u32, u64)> {
        let token = self.pick?;
        self.next_request_id += 1;
        Some((token, self.next_request_id))
    }

    pub(crate) fn report_token(&self) -> Option<u32> {
        self.report
    }

    /// A send failed: the stream is gone (its close callback follows).
    pub(crate) fn lost(&mut self, token: u32) {
        if self.pick == Some(token) {
            self.pick = None;
        }
        if self.report == Some(token) {
            self.report = None;
        }
    }

    pub(crate) fn wait_for(&mut self, request_id: u64, context_id: u32, deadline: SystemTime, cell: Rc<PickCell>) {
        self.pending.insert(
            request_id,
            Pending {
                context_id,
                deadline,
                cell,
            },
        );
    }

    /// Forgets the Picks of an HTTP context that is going away, so nothing
    /// ever resumes a stream Envoy has already destroyed.
    pub(crate) fn forget(&mut self, context_id: u32) {
        self.pending.retain(|_, p| p.context_id != context_id);
    }

    /// The request a reply on `token` answers, if it is still waiting.
    pub(crate) fn answered(&mut self, token: u32, request_id: u64) -> Option<Pending> {
        if Some(token) != self.pick {
            return None;
        }
        // The stream works: a later close reopens quickly again.
        self.reopen_backoff = REOPEN_FIRST;
        self.pending.remove(&request_id)
    }

    pub(crate) fn is_pick_stream(&self, token: u32) -> bool {
        self.pick == Some(token)
    }

    /// Stream `token` closed: returns the requests that waited on it (they
    /// fail open), and reopens it after a pause.
    pub(crate) fn closed(&mut self, token: u32, now: SystemTime) -> Vec<Pending> {
        if self.report == Some(token) {
            self.report = None;
        }
        if self.pick != Some(token) {
            return Vec::new();
        }
        self.pick = None;
        self.reopen_at = Some(now + self.reopen_backoff);
        self.reopen_backoff = (self.reopen_backoff * 2).min(REOPEN_MAX);
        std::mem::take(&mut self.pending).into_values().collect()
    }

    /// The requests whose Pick is past its deadline.
    pub(crate) fn expired(&mut self, now: SystemTime) -> Vec<Pending> {
        let ids: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, p)| p.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        ids.into_iter().filter_map(|id| self.pending.remove(&id)).collect()
    }
}
