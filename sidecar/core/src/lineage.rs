//! Parents named by trace. OpenClaw's subagent requests name no parent
//! session: they only carry, in their W3C `traceparent`, the trace id of the
//! parent turn that spawned them, and the filter sends such a parent as
//! `trace:<32 hex>` (`kvmesh_vocab::PARENT_BY_TRACE_PREFIX`). The router
//! resolves it to the session whose main-lane Picks carried that trace id
//! most recently, which `TraceCarriers` remembers.
//!
//! - [`TraceId`]: a trace id as a client sends it, parsed once (exactly 32
//!   hex digits, not all zero, or nothing);
//! - `ParentName`: what a Pick's `parent_id` names;
//! - `TraceCarriers`: each trace id's session, owned by the `SessionStore`,
//!   which drops a session's entry with the session.

use kvmesh_vocab::PARENT_BY_TRACE_PREFIX;

use crate::lru::LruMap;
use crate::sessions::SessionId;

/// A W3C trace id: 16 bytes, sent as 32 hex digits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TraceId(u128);

impl TraceId {
    /// Digits of a trace id as it travels.
    const HEX_DIGITS: usize = 32;

    /// The trace id `hex` spells: exactly 32 hex digits (either case), not
    /// all zero (the W3C's invalid id). Anything else is no trace id, so a
    /// client can neither grow a table with it nor make two spellings of
    /// one id differ.
    pub fn parse(hex: &str) -> Option<Self> {
        if hex.len() != Self::HEX_DIGITS || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        // Checked above: 32 hex digits always fit, and no sign is left for
        // `from_str_radix` to accept.
        let id = u128::from_str_radix(hex, 16).ok()?;
        (id != 0).then_some(Self(id))
    }
}

/// What a Pick's `parent_id` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ParentName<'a> {
    /// No parent.
    None,
    /// The parent session (or agent) by its id.
    Session(&'a str),
    /// The parent by the trace id of the turn that spawned the request;
    /// `None` when what follows the prefix is no trace id (then the request
    /// has no parent: a malformed name is not kept as a session id).
    Trace(Option<TraceId>),
}

impl<'a> ParentName<'a> {
    pub(crate) fn of(parent_id: &'a str) -> Self {
        if parent_id.is_empty() {
            return Self::None;
        }
        match parent_id.strip_prefix(PARENT_BY_TRACE_PREFIX) {
            Some(hex) => Self::Trace(TraceId::parse(hex)),
            None => Self::Session(parent_id),
        }
    }
}

/// Trace ids remembered, each with the session that carried it last.
///
/// A trace id is needed from the parent turn's first call until its
/// subagents' first calls, seconds to minutes later; after that each
/// subagent's session holds its resolved parent. And a session keeps only
/// the entry of its latest trace (the turn it is in), so there are never
/// more entries than live sessions. 65,536 is far more OpenClaw turns than
/// one sidecar has in progress at once, at 16 bytes of trace id and 8 of
/// session id an entry (the name stays in the session's record); past it
/// the least recently carried trace is forgotten first.
pub const MAX_TRACE_CARRIERS: usize = 65_536;

/// Each remembered trace id's session. One owner, the `SessionStore`: an
/// entry goes when its session ends, when the session carries a newer
/// trace, or by LRU at `MAX_TRACE_CARRIERS`.
#[derive(Debug, Clone)]
pub(crate) struct TraceCarriers {
    sessions: LruMap<TraceId, SessionId>,
}

impl TraceCarriers {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            sessions: LruMap::new(capacity),
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.sessions.len()
    }

    /// The session that carried `trace` last.
    pub(crate) fn carrier(&self, trace: TraceId) -> Option<SessionId> {
        self.sessions.get(&trace).copied()
    }

    /// `session` carried `trace`: it is that trace's session from now on,
    /// and the newest entry.
    pub(crate) fn claim(&mut self, trace: TraceId, session: SessionId) {
        if self.carrier(trace) == Some(session) {
            self.sessions.touch(&trace);
        } else {
            self.sessions.insert(trace, session);
        }
    }

    /// Forgets `trace` if `session` is still its carrier (another session
    /// may have carried it since).
    pub(crate) fn release(&mut self, trace: TraceId, session: SessionId) {
        if self.carrier(trace) == Some(session) {
            self.sessions.remove(&trace);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEX: &str = "4bf92f3577b34da6a3ce929d0e0e4736";

    #[test]
    fn a_trace_id_is_exactly_32_hex_digits_and_not_zero() {
        let id = TraceId::parse(HEX);
        assert!(id.is_some());
        assert_eq!(TraceId::parse(&HEX.to_uppercase()), id);
        for bad in [
            "",
            &HEX[1..],
            &format!("{HEX}0"),
            "+bf92f3577b34da6a3ce929d0e0e4736",
            "4bf92f3577b34da6a3ce929d0e0e473g",
            "00000000000000000000000000000000",
            "4bf92f35-7b34-4da6-a3ce-929d0e0e",
        ] {
            assert_eq!(TraceId::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_parent_id_names_a_session_or_a_trace() {
        assert_eq!(ParentName::of(""), ParentName::None);
        assert_eq!(ParentName::of("ses_1"), ParentName::Session("ses_1"));
        assert_eq!(
            ParentName::of(&format!("{PARENT_BY_TRACE_PREFIX}{HEX}")),
            ParentName::Trace(TraceId::parse(HEX))
        );
        assert_eq!(
            ParentName::of(&format!("{PARENT_BY_TRACE_PREFIX}xyz")),
            ParentName::Trace(None)
        );
    }

    #[test]
    fn a_released_trace_goes_only_from_its_own_carrier() {
        let trace = TraceId(7);
        let mut store = crate::sessions::SessionStore::new(4, 1_000);
        let [a, b] = ["a", "b"].map(|s| store.bind(s, None, crate::WorkerId(0), 0).unwrap());
        let mut carriers = TraceCarriers::new(4);
        carriers.claim(trace, a);
        carriers.claim(trace, b);
        carriers.release(trace, a);
        assert_eq!(carriers.carrier(trace), Some(b));
        carriers.release(trace, b);
        assert_eq!(carriers.carrier(trace), None);
    }
}
