//! The kvmesh proxy-wasm HTTP filter: thin glue between Envoy and the pure
//! `kvmesh-request` crate. Per request it strips client routing headers,
//! buffers the body, hashes its canonical prefix, asks the sidecar for a
//! destination over gRPC and sets `x-kvmesh-destination`; on the way back it
//! reads the engine's `usage` and reports the outcome. Every error path fails
//! open: the request continues unchanged and Envoy balances it.
//!
//! Picks and outcomes travel on long-lived gRPC streams owned by the root
//! context (see `sidecar`), with unary calls as the fallback.
//!
//! Nothing a client or an engine sends may panic here (a panic kills the VM
//! on that Envoy thread): every header is read as bytes through `host`,
//! whose module doc has the rule and the SDK calls it bans.
#![forbid(unsafe_code)]

mod host;
mod metrics;
mod sidecar;
mod timing;

use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Duration, SystemTime};

use kvmesh_proto::{method, v1};
use kvmesh_request::{
    Api, ChunkedRequest, DESTINATION_HEADER, FORGED_DESTINATION_HEADER, FilterConfig, NotUnderstood, Understood,
    UsageReader,
};
use kvmesh_vocab::limits::MAX_MESSAGE_BYTES;
use log::{debug, info, warn};
use prost::Message;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};

use crate::metrics::{FailOpen, Metrics};
use crate::sidecar::{PickCell, Streams, TICK, destination_value, resolve, send_on_stream};
use crate::timing::Phase;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|context_id| -> Box<dyn RootContext> {
        Box::new(Root { context_id, shared: None })
    });
}}

/// One per Envoy worker thread: holds the validated configuration and owns
/// the streams to the sidecar.
struct Root {
    context_id: u32,
    shared: Option<Rc<Shared>>,
}

/// What every request context of a thread reads: config, metric ids, and
/// the state of the sidecar streams.
#[derive(Debug)]
struct Shared {
    config: FilterConfig,
    /// gRPC metadata for every call to the sidecar (its token), built once.
    metadata: Vec<(&'static str, Vec<u8>)>,
    metrics: Metrics,
    streams: RefCell<Streams>,
    /// The model of the last request understood on this thread: a body that
    /// names its model only after its messages is hashed ahead with this
    /// one, and hashed again at the end if it was not.
    likely_model: RefCell<String>,
}

impl Shared {
    fn metadata(&self) -> Vec<(&'static str, &[u8])> {
        self.metadata.iter().map(|(k, v)| (*k, v.as_slice())).collect()
    }
}

impl Context for Root {
    fn on_grpc_stream_message(&mut self, token_id: u32, message_size: usize) {
        let Some(shared) = self.shared.clone() else { return };
        if !shared.streams.borrow().is_pick_stream(token_id) {
            return;
        }
        let reply = self
            .get_grpc_stream_message(0, message_size)
            .and_then(|bytes| v1::PickReply::decode(bytes.as_slice()).ok());
        let Some(reply) = reply else {
            shared.metrics.fail_open(FailOpen::BadReply);
            return;
        };
        // A reply for a request that timed out or went away is late: the
        // sidecar counted the pick as in flight, so give it back at once.
        let Some(pending) = shared.streams.borrow_mut().answered(token_id, reply.request_id) else {
            let abandoned = v1::Outcome {
                pick_id: reply.pick_id,
                ..v1::Outcome::default()
            };
            let token = shared.streams.borrow().report_token();
            if let Some(token) = token
                && proxy_wasm::hostcalls::send_grpc_stream_message(token, Some(&abandoned.encode_to_vec()), false)
                    .is_err()
            {
                shared.streams.borrow_mut().lost(token);
            }
            shared.metrics.inc(shared.metrics.late_replies);
            return;
        };
        timing::add(Phase::Wait, pending.cell.sent.get());
        match destination_value(&reply) {
            Ok(value) => {
                shared.metrics.inc(shared.metrics.picks);
                resolve(self.context_id, &pending, Some(&value), Some(reply.pick_id));
            }
            Err(why) => {
                shared.metrics.fail_open(why);
                resolve(self.context_id, &pending, None, None);
            }
        }
    }

    fn on_grpc_stream_close(&mut self, token_id: u32, status_code: u32) {
        let Some(shared) = self.shared.clone() else { return };
        let now = self.get_current_time();
        let waiting = shared.streams.borrow_mut().closed(token_id, now);
        if !waiting.is_empty() || status_code != 0 {
            debug!("kvmesh: sidecar stream {token_id} closed (gRPC status {status_code})");
        }
        for pending in waiting {
            shared.metrics.fail_open(FailOpen::SidecarError);
            resolve(self.context_id, &pending, None, None);
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let raw = self.get_plugin_configuration().unwrap_or_default();
        match FilterConfig::from_json(&raw) {
            Ok(config) => {
                info!(
                    "kvmesh filter configured: sidecar cluster {:?}, timeout {} ms, {}-byte blocks, {:?} hash",
                    config.sidecar_cluster, config.sidecar_timeout_ms, config.block_bytes, config.hash
                );
                let shared = Rc::new(Shared {
                    metadata: config.sidecar_metadata(),
                    config,
                    metrics: Metrics::define(),
                    streams: RefCell::new(Streams::new(self.context_id)),
                    likely_model: RefCell::new(String::new()),
                });
                shared.streams.borrow_mut().ensure_open(
                    &shared.config.sidecar_cluster,
                    &shared.metadata,
                    self.get_current_time(),
                );
                self.shared = Some(shared);
                self.set_tick_period(TICK);
                true
            }
            Err(err) => {
                // Returning false makes Envoy reject the configuration; the
                // log line names the field to fix.
                warn!("{err}");
                false
            }
        }
    }

    fn on_tick(&mut self) {
        let Some(shared) = self.shared.clone() else { return };
        let now = self.get_current_time();
        let expired = {
            let mut streams = shared.streams.borrow_mut();
            streams.ensure_open(&shared.config.sidecar_cluster, &shared.metadata, now);
            streams.expired(now)
        };
        for pending in expired {
            shared.metrics.fail_open(FailOpen::Timeout);
            resolve(self.context_id, &pending, None, None);
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        let shared = self.shared.clone()?;
        Some(Box::new(RequestFilter {
            context_id,
            shared,
            state: State::PassThrough,
            api: None,
            body: None,
            expected_len: None,
            started: None,
            asked: false,
            pick: Rc::new(PickCell::default()),
            first_byte: None,
            usage: None,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// Where one request is in the filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Not ours (or given up): never paused again.
    PassThrough,
    /// Headers held while the body buffers.
    Buffering,
    /// Waiting for the sidecar's Pick.
    AwaitingPick,
}

struct RequestFilter {
    context_id: u32,
    shared: Rc<Shared>,
    state: State,
    api: Option<Api>,
    /// The body so far, understood as it arrives (while buffering).
    body: Option<ChunkedRequest>,
    /// The body length announced (`content-length`, capped at the parse cap).
    expected_len: Option<usize>,
    started: Option<SystemTime>,
    /// A Pick was asked for this request: its outcome is reported, once.
    asked: bool,
    /// The sidecar's answer, written by whichever context receives it.
    pick: Rc<PickCell>,
    first_byte: Option<SystemTime>,
    /// Reads `usage` from a routed request's response.
    usage: Option<UsageReader>,
}

impl RequestFilter {
    fn config(&self) -> &FilterConfig {
        &self.shared.config
    }

    fn metrics(&self) -> &Metrics {
        &self.shared.metrics
    }

    /// Removes every header a client could use to steer routing or to
    /// claim a tenant. Envoy's own header mutation filter, ahead of this one
    /// in the shipped configurations, has already moved a client's
    /// destination aside (so a dead VM cannot reopen steering); this counts
    /// it, and removes it where no such filter runs.
    fn strip_routing_headers(&self) {
        let forged = [DESTINATION_HEADER, FORGED_DESTINATION_HEADER]
            .into_iter()
            .filter(|name| host::request_header(name).is_some())
            .inspect(|name| host::set_request_header(name, None))
            .count();
        if forged > 0 {
            self.metrics().inc(self.metrics().forged_destination);
        }
        if !self.config().trust_tenant_header && host::request_header(&self.config().tenant_header).is_some() {
            self.metrics().inc(self.metrics().client_tenant_removed);
            host::set_request_header(&self.config().tenant_header, None);
        }
        for name in &self.config().strip_headers {
            host::set_request_header(name, None);
        }
    }

    fn is_json(&self) -> bool {
        match host::request_header("content-type") {
            // Agents always send a content type; without one, try the body.
            None => true,
            Some(value) => {
                let essence = value.split(|b| *b == b';').next().unwrap_or_default().trim_ascii();
                essence.eq_ignore_ascii_case(b"application/json") || essence.to_ascii_lowercase().ends_with(b"+json")
            }
        }
    }

    fn fail_open(&mut self, why: FailOpen) -> Action {
        self.metrics().fail_open(why);
        self.body = None;
        self.state = State::PassThrough;
        Action::Continue
    }

    fn pick_request(&self, understood: Understood) -> v1::PickRequest {
        let Understood {
            api: _,
            model,
            identity,
            lane,
            hints,
            hashes,
            sections,
            body_truncated,
            body_edit: _,
        } = understood;
        v1::PickRequest {
            truncated: body_truncated || hashes.truncated,
            block_hashes: hashes.hashes,
            last_block_partial: hashes.last_partial,
            block_bytes: u32::try_from(self.config().block_bytes).unwrap_or(u32::MAX),
            prompt_bytes: hashes.stream_bytes,
            session_id: identity.session_id,
            parent_id: identity.parent_id,
            agent_id: identity.agent_id,
            tenant: identity.tenant,
            model,
            session_final: identity.session_final,
            retention_horizon_s: hints.retention_horizon_s,
            request_id: 0,
            harness: identity.harness.name().to_owned(),
            lane: lane.name().to_owned(),
            trace_id: identity.trace_id,
            sections: sections.iter().map(v1::PromptSection::from).collect(),
        }
    }

    /// The state of a body that comes in several pieces.
    fn chunked_request(&self) -> Option<ChunkedRequest> {
        let api = self.api?;
        // Only shapes how the body's buffer grows (never reserved ahead).
        let expected_len = self.expected_len.unwrap_or(0).min(self.config().max_body_bytes);
        let likely_model = self.shared.likely_model.borrow();
        let likely_model = (!likely_model.is_empty()).then_some(likely_model.as_str());
        Some(ChunkedRequest::new(
            api,
            &host::request_headers(),
            self.config(),
            likely_model,
            expected_len,
        ))
    }

    /// Feeds the body's bytes that arrived since the last call (up to the
    /// cap): the request crate scans and hashes what they complete.
    fn feed_body(&mut self, body_size: usize) {
        let upto = body_size.min(self.config().max_body_bytes);
        let Some(fed) = self.body.as_ref().map(ChunkedRequest::len) else {
            return;
        };
        if upto <= fed {
            return;
        }
        // A host that cannot give the range now is asked again with the
        // next chunk, or for the whole body at the end.
        let reading = timing::now();
        let chunk = self.get_http_request_body(fed, upto - fed);
        timing::add(Phase::Read, reading);
        if let Some(chunk) = chunk
            && chunk.len() == upto - fed
            && let Some(body) = self.body.as_mut()
        {
            body.feed(&chunk);
        }
    }

    /// Understands the (possibly cut) body and dispatches the Pick.
    fn ask_sidecar(&mut self, body_size: usize) -> Action {
        let Some(api) = self.api else {
            return self.fail_open(FailOpen::NotUnderstood);
        };
        let cap = self.config().max_body_bytes;
        let body_truncated = body_size > cap;
        if body_truncated {
            // Route on the first `cap` bytes; the body still goes whole.
            debug!("kvmesh: body of {body_size} bytes over {cap}, routed on its first {cap}");
        }
        let headers = host::request_headers();
        let understanding = timing::now();
        let understood = match self.body.take() {
            Some(body) if body.len() == body_size.min(cap) => {
                let (understood, ahead) = body.finish_counted(&headers, body_truncated, self.config());
                self.metrics().add(self.metrics().hashed_ahead_bytes, ahead);
                understood
            }
            // Not every chunk could be read as it came: read the body whole.
            _ => {
                let reading = timing::now();
                let body = self.get_http_request_body(0, body_size.min(cap)).unwrap_or_default();
                timing::add(Phase::Read, reading);
                kvmesh_request::understand(api, &headers, &body, body_truncated, self.config())
            }
        };
        timing::add(Phase::Understand, understanding);
        let sending = timing::now();
        if understood.is_err() && self.config().priority_field.is_some() {
            // Not understood: forwarded as the client sent it.
            self.metrics().inc(self.metrics().priority_not_written);
        }
        let understood = match understood {
            Ok(understood) => understood,
            Err(err @ NotUnderstood::ModelTooLong(_)) => {
                debug!("kvmesh: {} request not routed on content: {err}", api.name());
                return self.fail_open(FailOpen::Oversized);
            }
            Err(err) => {
                debug!("kvmesh: {} request not routed on content: {err}", api.name());
                self.metrics().parse_error(api);
                return self.fail_open(FailOpen::NotUnderstood);
            }
        };
        self.count_priority(&understood);
        if self.config().priority_field.is_some() || self.config().strip_preambles {
            self.write_body_edit(understood.body_edit.as_ref(), body_size);
        }
        if understood.body_truncated {
            self.metrics().inc(self.metrics().truncated_body);
        }
        if *self.shared.likely_model.borrow() != understood.model {
            self.shared.likely_model.replace(understood.model.clone());
        }
        if understood.hashes.truncated {
            self.metrics().inc(self.metrics().truncated_blocks);
        }
        let mut pick = self.pick_request(understood);
        // The request crate bounds every field, so this never trips; it
        // keeps a Pick the sidecar would refuse off the shared stream.
        if pick.encoded_len() > MAX_MESSAGE_BYTES {
            return self.fail_open(FailOpen::Oversized);
        }
        let timeout = Duration::from_millis(self.config().sidecar_timeout_ms);
        let sent_on_stream = self.send_on_pick_stream(&mut pick, timeout);
        self.asked = true;
        timing::add(Phase::EncodeSend, sending);
        if sent_on_stream {
            self.metrics().inc(self.metrics().picks_on_stream);
            self.state = State::AwaitingPick;
            return Action::Pause;
        }
        self.metrics().inc(self.metrics().picks_unary);
        let message = pick.encode_to_vec();
        let cluster = self.config().sidecar_cluster.clone();
        let shared = self.shared.clone();
        match self.dispatch_grpc_call(
            &cluster,
            method::SERVICE,
            method::PICK,
            shared.metadata(),
            Some(&message),
            timeout,
        ) {
            Ok(_token) => {
                self.state = State::AwaitingPick;
                Action::Pause
            }
            Err(status) => {
                debug!("kvmesh: cannot call sidecar cluster {cluster:?}: {status:?}");
                self.fail_open(FailOpen::Dispatch)
            }
        }
    }

    fn count_priority(&self, understood: &Understood) {
        let metrics = self.metrics();
        metrics.add(metrics.priority_dropped, usize::from(understood.hints.priority_dropped));
        if understood.hints.priority_clamped {
            metrics.inc(metrics.priority_clamped);
        }
    }

    /// Rewrites the body Envoy holds as the request crate's one edit says
    /// (the engine's priority field, the billing block out of `system`;
    /// only from `on_http_request_body`: see
    /// `host::replace_request_body_prefix`) and corrects `content-length`.
    /// Any doubt leaves the body as it came.
    fn write_body_edit(&self, edit: Option<&kvmesh_request::BodyEdit>, body_size: usize) {
        let metrics = self.metrics();
        let written = match edit {
            Some(edit) if edit.replace <= body_size && host::replace_request_body_prefix(edit.replace, &edit.with) => {
                Some(edit)
            }
            _ => None,
        };
        if let Some(edit) = written {
            // Headers are still held (paused in on_http_request_headers), so
            // the upstream sees the new length. Without one (HTTP/2, chunked
            // HTTP/1) Envoy frames the body itself.
            if host::request_header("content-length").is_some() {
                host::set_request_header("content-length", Some(&edit.new_len(body_size).to_string()));
            }
            if edit.preamble {
                metrics.inc(metrics.preamble_stripped);
            }
        }
        if self.config().priority_field.is_some() {
            match written.filter(|edit| edit.priority) {
                Some(edit) => {
                    metrics.inc(metrics.priority_written);
                    metrics.add(metrics.priority_replaced, edit.replaced);
                }
                None => metrics.inc(metrics.priority_not_written),
            }
        }
    }

    /// Sends the Pick on the root context's stream; `false` if it is down.
    fn send_on_pick_stream(&self, pick: &mut v1::PickRequest, timeout: Duration) -> bool {
        let Some((token, request_id)) = self.shared.streams.borrow_mut().next_pick() else {
            return false;
        };
        pick.request_id = request_id;
        let root_id = self.shared.streams.borrow().root_id;
        if !send_on_stream(root_id, self.context_id, token, &pick.encode_to_vec()) {
            self.shared.streams.borrow_mut().lost(token);
            return false;
        }
        self.pick.sent.set(timing::now());
        let deadline = self.get_current_time() + timeout;
        self.shared
            .streams
            .borrow_mut()
            .wait_for(request_id, self.context_id, deadline, self.pick.clone());
        true
    }

    /// A unary Pick's answer (the fallback path).
    fn apply_pick(&mut self, status_code: u32, response_size: usize) {
        if status_code != 0 {
            // Envoy reports a callout timeout as UNAVAILABLE (14), like a
            // refused connection, so the elapsed time tells them apart (the
            // status message is not read: see `host`). Envoy's timer may
            // fire a few ms before our clock says the timeout passed, so
            // the check keeps a margin.
            let waited = self
                .started
                .and_then(|t| self.get_current_time().duration_since(t).ok())
                .unwrap_or_default();
            let timeout = Duration::from_millis(self.config().sidecar_timeout_ms);
            let why = if waited >= timeout.mul_f64(0.9) {
                FailOpen::Timeout
            } else {
                FailOpen::SidecarError
            };
            debug!("kvmesh: Pick failed with gRPC status {status_code} after {waited:?}");
            self.metrics().fail_open(why);
            return;
        }
        let reply = self
            .get_grpc_call_response_body(0, response_size)
            .and_then(|bytes| v1::PickReply::decode(bytes.as_slice()).ok());
        let Some(reply) = reply else {
            self.metrics().fail_open(FailOpen::BadReply);
            return;
        };
        match destination_value(&reply) {
            Ok(value) => {
                host::set_request_header(DESTINATION_HEADER, Some(&value));
                self.metrics().inc(self.metrics().picks);
                self.pick.pick_id.set(Some(reply.pick_id));
            }
            Err(why) => self.metrics().fail_open(why),
        }
    }

    fn millis_since(&self, start: Option<SystemTime>, end: SystemTime) -> u32 {
        start
            .and_then(|s| end.duration_since(s).ok())
            .map_or(0, |d| u32::try_from(d.as_millis()).unwrap_or(u32::MAX))
    }

    /// Tells the sidecar how a routed request ended, so it releases the
    /// request's in-flight slot and learns what the engine had cached.
    /// Aborted and failed requests report too (status 0 or the error).
    /// Fire and forget: nothing waits on the answer.
    fn report_outcome(&mut self) {
        let (Some(pick_id), true) = (self.pick.pick_id.get(), std::mem::take(&mut self.asked)) else {
            return;
        };
        let usage = self.usage.take().map(UsageReader::finish).unwrap_or_default();
        if usage.prompt_tokens.is_some() {
            self.metrics().inc(self.metrics().outcomes_with_usage);
        }
        let destination = host::property_text(vec!["upstream", "address"]).unwrap_or_default();
        let outcome = v1::Outcome {
            pick_id,
            destination,
            prompt_tokens: usage.prompt_tokens,
            cached_tokens: usage.cached_tokens,
            ttfb_ms: self.first_byte.map_or(0, |t| self.millis_since(self.started, t)),
        };
        let message = outcome.encode_to_vec();
        let (token, root_id) = {
            let streams = self.shared.streams.borrow();
            (streams.report_token(), streams.root_id)
        };
        if let Some(token) = token {
            if send_on_stream(root_id, self.context_id, token, &message) {
                self.metrics().inc(self.metrics().outcomes_reported);
                return;
            }
            self.shared.streams.borrow_mut().lost(token);
        }
        // Reports are off the request path, so they may take longer than a Pick.
        let timeout = Duration::from_millis(self.config().sidecar_timeout_ms.max(1000));
        let cluster = self.config().sidecar_cluster.clone();
        let shared = self.shared.clone();
        match self.dispatch_grpc_call(
            &cluster,
            method::SERVICE,
            method::REPORT,
            shared.metadata(),
            Some(&message),
            timeout,
        ) {
            Ok(_) => self.metrics().inc(self.metrics().outcomes_reported),
            Err(_) => self.metrics().inc(self.metrics().report_failed),
        }
    }
}

impl Context for RequestFilter {
    fn on_grpc_call_response(&mut self, _token_id: u32, status_code: u32, response_size: usize) {
        // Report replies arrive here too: only a pending Pick resumes.
        if self.state != State::AwaitingPick {
            return;
        }
        self.apply_pick(status_code, response_size);
        self.pick.resolved.set(true);
        self.state = State::PassThrough;
        self.resume_http_request();
    }
}

impl HttpContext for RequestFilter {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        #[cfg(feature = "crash-test")]
        #[allow(clippy::panic)]
        if host::request_header("x-kvmesh-test-crash").is_some() {
            panic!("kvmesh crash-test build: x-kvmesh-test-crash");
        }
        self.strip_routing_headers();
        let method = host::request_header(":method").unwrap_or_default();
        // A path that is not UTF-8 names no inference API: it passes through.
        self.api = Api::from_path(&host::request_header_text(":path").unwrap_or_default());
        if method != b"POST" || self.api.is_none() || end_of_stream || !self.is_json() {
            self.metrics().inc(self.metrics().passed_through);
            return Action::Continue;
        }
        self.started = Some(self.get_current_time());
        self.state = State::Buffering;
        self.expected_len = host::request_header_text("content-length").and_then(|n| n.trim().parse().ok());
        // Needs `allow_on_headers_stop_iteration: true` in the Wasm filter
        // config, or Envoy never delivers the body and the request hangs.
        Action::Pause
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        match self.state {
            // The Pick is asked at end of stream, so no body follows it;
            // should any, hold it until the route is set.
            State::AwaitingPick if !self.pick.resolved.get() => return Action::Pause,
            State::AwaitingPick | State::PassThrough => return Action::Continue,
            State::Buffering => {}
        }
        // Each chunk is scanned and hashed as it arrives (Envoy keeps
        // buffering it: `body_size` is all of the body so far), so at the
        // last byte only the stream's tail is left to hash.
        self.metrics().inc(self.metrics().body_chunks);
        let called = timing::now();
        if end_of_stream {
            timing::add(Phase::Arrive, self.started);
            timing::add_n(Phase::Requests, 1);
        }
        // A body whole in its first callback takes the one-shot path: there
        // is nothing to do ahead of its last byte. (Over HTTP/1 Envoy ends
        // every body with an empty callback, so "whole" is also all the
        // announced bytes in.)
        if self.body.is_none() {
            if end_of_stream {
                return self.ask_sidecar(body_size);
            }
            if self.expected_len == Some(body_size) {
                return Action::Pause;
            }
        }
        if self.body.is_none() {
            self.body = self.chunked_request();
        }
        self.feed_body(body_size);
        if end_of_stream {
            timing::add(Phase::LastFeed, called);
        }
        // Ask only once the whole body is in: resuming while the client is
        // still sending races Envoy's deferred continue against the next
        // chunk, and under load the chunks reached the worker out of order.
        if !end_of_stream {
            timing::add(Phase::Chunks, called);
            return Action::Pause;
        }
        self.ask_sidecar(body_size)
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        // Inference APIs carry no trailers; never hold such a request.
        if self.state == State::Buffering {
            return self.fail_open(FailOpen::NotUnderstood);
        }
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        self.first_byte = Some(self.get_current_time());
        timing::add(Phase::AfterResume, self.pick.resumed.get());
        if self.pick.pick_id.get().is_some() {
            // A content type that is not UTF-8 is no JSON or SSE type.
            let content_type = host::response_header("content-type").map(|v| String::from_utf8(v).unwrap_or_default());
            self.usage = Some(UsageReader::new(
                content_type.as_deref(),
                self.config().max_response_scan_bytes,
            ));
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, _end_of_stream: bool) -> Action {
        // Each chunk is read as it passes; nothing is held back.
        if self.usage.is_some()
            && let Some(chunk) = self.get_http_response_body(0, body_size)
            && let Some(reader) = self.usage.as_mut()
        {
            reader.feed(&chunk);
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        self.shared.streams.borrow_mut().forget(self.context_id);
        self.report_outcome();
    }
}

impl Drop for RequestFilter {
    fn drop(&mut self) {
        // Never leave a Pick for the root context to resume on a dead stream.
        if let Ok(mut streams) = self.shared.streams.try_borrow_mut() {
            streams.forget(self.context_id);
        }
    }
}
