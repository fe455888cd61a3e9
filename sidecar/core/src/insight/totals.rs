//! The ledger's sums (`Totals`) and the headline figures read from them
//! (`Figures`). Each list is written once: the `Totals` fields in
//! `totals!` (which also writes `add`), and the figures in `figures!`
//! (which writes the typed `Figures`, `Totals::figures` and the table
//! `Figures::ALL` that the sidecar's metrics and reports iterate).

use super::{MoveReason, SectionKind};

/// Adding one label's or bucket's sum into another's.
trait Sum {
    fn sum(&mut self, other: &Self);
}

impl Sum for u64 {
    /// Saturating: a byte count from the wire must not wrap a counter.
    fn sum(&mut self, other: &Self) {
        *self = self.saturating_add(*other);
    }
}

impl Sum for f64 {
    fn sum(&mut self, other: &Self) {
        *self += *other;
    }
}

impl<const N: usize> Sum for [u64; N] {
    fn sum(&mut self, other: &Self) {
        for (a, b) in self.iter_mut().zip(other) {
            a.sum(b);
        }
    }
}

macro_rules! totals {
    ($(#[$outer:meta])* pub struct Totals { $( $(#[$meta:meta])* pub $field:ident : $ty:ty, )* }) => {
        $(#[$outer])*
        pub struct Totals { $( $(#[$meta])* pub $field: $ty, )* }

        impl Totals {
            /// Adds another label's or bucket's sums to these.
            pub fn add(&mut self, other: &Totals) {
                $( Sum::sum(&mut self.$field, &other.$field); )*
            }
        }
    };
}

totals! {
    /// Sums over calls; tokens are estimates from bytes unless named reported.
    #[derive(Debug, Clone, Default, PartialEq)]
    pub struct Totals {
        pub calls: u64,
        /// Canonical prompt bytes, and the leading ones that repeat an earlier
        /// call: the repeated-prefix share is their ratio (exact, whatever the
        /// tokenizer; tokens below are estimates from these bytes).
        pub prompt_bytes: u64,
        pub repeated_prefix_bytes: u64,
        /// Prompt tokens of every call (bytes ÷ the model's bytes per token).
        pub prompt_tokens: f64,
        /// Leading tokens an earlier call already sent: the session's previous
        /// call, or any call whose blocks a worker holds.
        pub repeated_prefix_tokens: f64,
        pub predicted_cached_tokens: f64,
        /// Cached on the best worker for the call: what routing could reach.
        pub reachable_cached_tokens: f64,
        /// Calls of a session that had a previous call on a known worker.
        pub continuing_calls: u64,
        pub same_worker_calls: u64,
        /// Continuing calls that moved, by [`MoveReason::ALL`] order.
        pub moves: [u64; MoveReason::ALL.len()],
        /// Continuing calls compared with their previous call's prefix.
        pub prefix_checks: u64,
        /// Those whose prefix broke, by [`SectionKind::ALL`] order.
        pub prefix_breaks: [u64; SectionKind::ALL.len()],
        /// Side calls of a session (a title, a summary): placed on their own
        /// merits, never compared with the session's prefix nor counted as
        /// its move.
        pub side_calls: u64,
        /// Calls that compacted their session's conversation.
        pub compaction_calls: u64,
        /// Main calls that began a new prefix after their session's
        /// compaction: not compared with the previous prefix, so never a
        /// break.
        pub prefix_epochs: u64,
        /// Calls whose parent was named by trace and resolved to a session,
        /// and those whose trace no live session carried (placed with no
        /// parent).
        pub trace_parents: u64,
        pub unknown_trace_parents: u64,
        pub outcomes: u64,
        /// Outcomes that reported usage.
        pub reported_calls: u64,
        pub reported_prompt_tokens: f64,
        /// Read from the cache.
        pub reported_cached_tokens: f64,
        /// Computed and written to the cache (prompt − cached).
        pub written_tokens: f64,
        /// GPU time the cached tokens saved, at the worker's prefill rate.
        pub prefill_saved_ms: f64,
        /// GPU time spent on the written tokens.
        pub prefill_computed_ms: f64,
        /// KV bytes held by idle sessions × the time they were idle.
        pub idle_kv_byte_ms: f64,
    }
}

impl Totals {
    /// Share of the prompt that repeats an earlier prefix.
    pub fn repeated_prefix_share(&self) -> f64 {
        ratio(self.repeated_prefix_bytes as f64, self.prompt_bytes as f64)
    }

    /// Share of a session's continuing calls that reached the same worker.
    pub fn same_worker_rate(&self) -> f64 {
        ratio(self.same_worker_calls as f64, self.continuing_calls as f64)
    }

    /// Tokens read from the cache per token written to it.
    pub fn read_write_ratio(&self) -> f64 {
        ratio(self.reported_cached_tokens, self.written_tokens)
    }

    /// Moves by reason, named as in metric labels and reports.
    pub fn moves_by_reason(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        MoveReason::ALL.iter().map(|r| (r.as_str(), self.moves[*r as usize]))
    }

    /// Prefix breaks by the section where they broke, named likewise.
    pub fn breaks_by_section(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        SectionKind::ALL
            .iter()
            .map(|s| (s.name(), self.prefix_breaks[*s as usize]))
    }
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 { a / b } else { 0.0 }
}

/// One headline figure, as the sidecar exports it.
#[derive(Debug, Clone, Copy)]
pub struct Figure {
    /// Its name in reports and in the benchmark's output.
    pub name: &'static str,
    /// The Prometheus counter it is also exported as (per harness and
    /// tenant), if any: ratios are not counters (a dashboard divides two).
    pub counter: Option<&'static str>,
    pub help: &'static str,
    /// Its value, unrounded (what a counter exports).
    pub value: fn(&Totals) -> f64,
}

macro_rules! figures {
    ($( $(#[doc = $doc:literal])* $name:ident : $ty:ident = $value:expr, $counter:expr; )*) => {
        /// The headline figures of some totals, as the sidecar's report and
        /// the benchmark both print them, so a simulation and a live
        /// deployment read the same way. Typed and named, so a report that
        /// reads one back fails to compile when it is renamed.
        #[derive(Debug, Clone, Copy, Default, PartialEq)]
        #[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
        pub struct Figures {
            $( $(#[doc = $doc])* pub $name: $ty, )*
        }

        impl Figures {
            /// Every figure, in report order.
            pub const ALL: &[Figure] = &[
                $( Figure {
                    name: stringify!($name),
                    counter: $counter,
                    help: concat!($($doc),*),
                    value: $value,
                }, )*
            ];

            /// (name, value) in report order.
            pub fn named(&self) -> Vec<(&'static str, f64)> {
                vec![ $( (stringify!($name), self.$name as f64), )* ]
            }
        }

        impl Totals {
            /// The headline figures: counts as counts, token figures
            /// rounded to whole tokens, times in seconds.
            pub fn figures(&self) -> Figures {
                Figures { $( $name: figures!(@shape $ty, { let value: fn(&Totals) -> f64 = $value; value(self) }), )* }
            }
        }
    };
    (@shape u64, $v:expr) => { $v as u64 };
    (@shape f64, $v:expr) => { $v };
    (@shape tokens, $v:expr) => { $v.round() };
}

/// A token figure printed to the whole token.
#[allow(non_camel_case_types)]
type tokens = f64;

figures! {
    /// Routed calls
    calls: u64 = |t| t.calls as f64, Some("calls");
    /// Canonical prompt bytes of routed calls (tools, system, messages as the filter hashes them)
    prompt_bytes: u64 = |t| t.prompt_bytes as f64, Some("prompt_bytes");
    /// Leading prompt bytes that an earlier call already sent; over prompt_bytes, the repeated-prefix share
    repeated_prefix_bytes: u64 = |t| t.repeated_prefix_bytes as f64, Some("repeated_prefix_bytes");
    /// Share of prompt bytes that repeat an earlier prefix
    repeated_prefix_share: f64 = Totals::repeated_prefix_share, None;
    /// Prompt tokens of routed calls, estimated from their bytes
    prompt_tokens: tokens = |t| t.prompt_tokens, Some("prompt_tokens");
    /// Leading prompt tokens that an earlier call already sent (the session's previous call, or a prefix a worker holds)
    repeated_prefix_tokens: tokens = |t| t.repeated_prefix_tokens, Some("repeated_prefix_tokens");
    /// Prompt tokens predicted cached on the chosen worker
    predicted_cached_tokens: tokens = |t| t.predicted_cached_tokens, Some("predicted_cached_tokens");
    /// Prompt tokens cached on the best worker for each call: what routing could reach
    reachable_cached_tokens: tokens = |t| t.reachable_cached_tokens, Some("reachable_cached_tokens");
    /// Outcomes that reported usage
    reported_calls: u64 = |t| t.reported_calls as f64, None;
    /// Prompt tokens the engines reported, for calls that reported usage
    reported_prompt_tokens: f64 = |t| t.reported_prompt_tokens, Some("usage_reported_prompt_tokens");
    /// Prompt tokens the engines reported served from their cache
    cache_read_tokens: f64 = |t| t.reported_cached_tokens, Some("cache_read_tokens");
    /// Prompt tokens the engines computed and wrote to their cache (prompt - cached)
    cache_written_tokens: f64 = |t| t.written_tokens, Some("cache_written_tokens");
    /// Tokens read from the cache per token written to it
    read_write_ratio: f64 = Totals::read_write_ratio, None;
    /// Calls of a session whose previous call went to a known worker
    continuing_calls: u64 = |t| t.continuing_calls as f64, Some("session_continuing_calls");
    /// Continuing calls that reached the worker of the session's previous call
    same_worker_calls: u64 = |t| t.same_worker_calls as f64, Some("session_same_worker_calls");
    /// Share of continuing calls that reached the same worker
    same_worker_rate: f64 = Totals::same_worker_rate, None;
    /// Continuing calls whose prefix was compared with the session's previous call
    prefix_checks: u64 = |t| t.prefix_checks as f64, Some("prefix_checks");
    /// Side calls of a session (a title, a summary, a small model's call), placed on their own merits: never a session's move or prefix break
    side_calls: u64 = |t| t.side_calls as f64, Some("side_calls");
    /// Calls that compacted their session's conversation
    compaction_calls: u64 = |t| t.compaction_calls as f64, Some("compaction_calls");
    /// Main calls that began a new prefix after their session's compaction, not counted as prefix breaks
    prefix_epochs: u64 = |t| t.prefix_epochs as f64, Some("prefix_epochs");
    /// Calls of a subagent whose parent was named by trace and resolved to the session that carried it
    trace_parents: u64 = |t| t.trace_parents as f64, Some("trace_parents");
    /// Calls of a subagent whose parent was named by a trace no live session carried, placed with no parent
    unknown_trace_parents: u64 = |t| t.unknown_trace_parents as f64, Some("unknown_trace_parents");
    /// Estimated GPU prefill time saved by cached tokens, at each worker's prefill rate
    gpu_seconds_saved: f64 = |t| t.prefill_saved_ms / 1000.0, Some("prefill_saved_seconds");
    /// Estimated GPU prefill time spent on computed tokens
    gpu_seconds_computed: f64 = |t| t.prefill_computed_ms / 1000.0, Some("prefill_computed_seconds");
    /// KV-cache bytes held by idle sessions on their workers, times the seconds they were idle: what keeping sessions warm costs
    idle_kv_byte_seconds: f64 = |t| t.idle_kv_byte_ms / 1000.0, Some("idle_kv_byte_seconds");
}
