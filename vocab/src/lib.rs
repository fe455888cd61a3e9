//! The vocabulary every kvmesh crate shares, with no dependencies: what the
//! filter, the sidecar, the simulator and the fuzz targets must all spell the
//! same way, each defined once here and converted to the wire once (in
//! `kvmesh-proto`'s `vocab` feature).
//!
//! - [`SectionKind`]: which part of a prompt a section of the canonical
//!   stream holds (where a session's prefix breaks);
//! - [`PromptSection`]: one part of a request's canonical stream;
//! - [`Harness`]: the agent harness that sent a request (a metric label);
//! - [`Lane`]: which lane of its session a request is (main, side, compaction);
//! - [`DEFAULT_BLOCK_BYTES`]: the filter's default prefix block size;
//! - [`limits`]: the bounds on every field that crosses the wire;
//! - [`FILTER_TIME_PHASES`]: the counters of the filter's measurement build.
#![forbid(unsafe_code)]

pub mod limits;

/// The phases a `phase-timing` build of the filter times, in microseconds,
/// each summed in the counter `kvmesh.time_us.<phase>`; the last counts the
/// requests timed. The filter defines the counters and the overhead bench
/// reads them by these names.
pub const FILTER_TIME_PHASES: [&str; 10] = [
    "arrive",
    "chunks",
    "last_feed",
    "read",
    "understand",
    "encode_send",
    "wait",
    "resume",
    "after_resume",
    "requests",
];

/// Bytes per prefix block unless the filter is configured otherwise (256
/// bytes of canonical JSON are about 64 tokens). Only a default: every Pick
/// carries the block size it was cut with, and the sidecar converts with
/// that one.
pub const DEFAULT_BLOCK_BYTES: usize = 256;

/// Which part of the prompt a section of the canonical stream holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SectionKind {
    /// The tool definitions.
    Tools,
    /// The system prompt: Anthropic's `system`, the Responses API's
    /// `instructions`, or a leading `system`/`developer` message.
    System,
    /// Message (or input item) `index` of the conversation; a completions
    /// prompt is message 0.
    Message,
    /// Anything else that starts the chain (`previous_response_id`).
    Other,
}

impl SectionKind {
    /// Every kind, in the order of the canonical stream; arrays indexed by
    /// `kind as usize` follow it.
    pub const ALL: [Self; 4] = [Self::Tools, Self::System, Self::Message, Self::Other];

    /// Stable lowercase name, for metric labels and reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::Tools => "tools",
            Self::System => "system",
            Self::Message => "message",
            Self::Other => "other",
        }
    }
}

/// One part of a request's canonical stream: which part, where it starts,
/// and a digest of its bytes, so that two calls of a session can tell which
/// part changed without either of them keeping any prompt text. The filter
/// cuts them, the wire carries them, the insight ledger reads them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptSection {
    pub kind: SectionKind,
    /// The element's position in `messages` / `input` (0 for the others).
    pub index: u32,
    /// Byte offset of the section in the stream.
    pub start: u64,
    /// XXH3 of the section's bytes in the stream, low 32 bits.
    pub digest: u32,
}

/// The agent harness that sent a request, from the headers it is known to
/// send (design/HARNESSES.md). A closed set, so it can label metrics; on the
/// wire it travels as its [`Harness::name`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub enum Harness {
    ClaudeCode,
    Codex,
    OpenCode,
    OpenClaw,
    #[default]
    Other,
}

impl Harness {
    /// Every harness; arrays indexed by `harness as usize` follow it.
    pub const ALL: [Self; 5] = [
        Self::ClaudeCode,
        Self::Codex,
        Self::OpenCode,
        Self::OpenClaw,
        Self::Other,
    ];

    /// Stable lowercase name, for the wire and for metric labels.
    pub fn name(self) -> &'static str {
        match self {
            Self::ClaudeCode => "claude_code",
            Self::Codex => "codex",
            Self::OpenCode => "opencode",
            Self::OpenClaw => "openclaw",
            Self::Other => "other",
        }
    }

    /// The harness of a name from [`Harness::name`] (any case, trimmed);
    /// anything else is `Other`.
    pub fn from_name(name: &str) -> Self {
        Self::ALL
            .into_iter()
            .find(|h| h.name().eq_ignore_ascii_case(name.trim()))
            .unwrap_or(Self::Other)
    }
}

/// A parent id that names its parent by trace: `trace:<32 hex>`, the
/// W3C trace id of the turn that spawned the subagent. OpenClaw's subagent
/// requests name no parent session, only carry their parent turn's
/// `traceparent` trace id; the sidecar resolves such an id to the session
/// whose main-lane calls carried that trace id.
pub const PARENT_BY_TRACE_PREFIX: &str = "trace:";

/// Which lane of its session a request belongs to. A harness's side calls
/// (a title, a summary, a call on its small model) share the session's id
/// but not its prompt: they are placed on their own merits and never
/// counted as the session's prefix break or move. A compaction call ends a
/// prefix epoch: the call after it starts a new prefix without a break
/// being blamed. On the wire it travels as its [`Lane::name`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub enum Lane {
    /// The conversation itself (and a subagent's own conversation).
    #[default]
    Main,
    /// A call beside the conversation: a title, a summary, a small model.
    Side,
    /// A call that compacts the conversation into a summary; the next main
    /// call rebuilds the history.
    Compaction,
}

impl Lane {
    /// Every lane; arrays indexed by `lane as usize` follow it.
    pub const ALL: [Self; 3] = [Self::Main, Self::Side, Self::Compaction];

    /// Stable lowercase name, for the wire and for metric labels.
    pub fn name(self) -> &'static str {
        match self {
            Self::Main => "main",
            Self::Side => "side",
            Self::Compaction => "compaction",
        }
    }

    /// The lane of a name from [`Lane::name`] (any case, trimmed); anything
    /// else (an older filter sends none) is `Main`.
    pub fn from_name(name: &str) -> Self {
        Self::ALL
            .into_iter()
            .find(|l| l.name().eq_ignore_ascii_case(name.trim()))
            .unwrap_or(Self::Main)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_harness_round_trips_through_its_name() {
        for harness in Harness::ALL {
            assert_eq!(Harness::from_name(harness.name()), harness);
            assert_eq!(Harness::ALL[harness as usize], harness);
        }
        assert_eq!(Harness::from_name(" Claude_Code "), Harness::ClaudeCode);
        assert_eq!(Harness::from_name("cursor"), Harness::Other);
    }

    #[test]
    fn every_lane_round_trips_through_its_name() {
        for lane in Lane::ALL {
            assert_eq!(Lane::from_name(lane.name()), lane);
            assert_eq!(Lane::ALL[lane as usize], lane);
        }
        assert_eq!(Lane::from_name(" Side "), Lane::Side);
        assert_eq!(Lane::from_name(""), Lane::Main);
        assert_eq!(Lane::from_name("title"), Lane::Main);
    }

    #[test]
    fn kinds_index_their_arrays_in_stream_order() {
        for kind in SectionKind::ALL {
            assert_eq!(SectionKind::ALL[kind as usize], kind);
        }
        let names: Vec<&str> = SectionKind::ALL.iter().map(|k| k.name()).collect();
        assert_eq!(names, ["tools", "system", "message", "other"]);
    }
}
