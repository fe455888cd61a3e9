//! A request's priority, and writing it into the body field its engine
//! reads.
//!
//! kvmesh's scale is an integer, higher runs sooner, clamped to
//! [`MIN_PRIORITY`]..=[`MAX_PRIORITY`], 0 being the engine's default. It
//! comes from the priority header, else Dynamo's `nvext.agent_hints.priority`,
//! else (when the operator turned rewriting on) a class per harness and
//! role. Each engine reads its own field with its own polarity; the mapping
//! is [`engine_priority_json`].
//!
//! The rewrite is opt-in (`priority_field` in the plugin configuration):
//! without it no body is touched. With it, the body keeps every byte but the
//! top-level `priority`: inserted right after the opening `{`, or, where the
//! client sent its own, that value replaced, so a client cannot jump the
//! queue with a raw engine value.
//!
//! [`BodyEdit`] is also how `strip_preambles` takes Claude Code's billing
//! block out of `system` (`crate::preamble`): both may apply to one body, so
//! each asks for its changes and [`compose`] makes them one rewrite.

use std::collections::BTreeMap;
use std::ops::Range;

use kvmesh_vocab::Harness;
use kvmesh_vocab::limits::{MAX_PRIORITY, MIN_PRIORITY};
use serde::Deserialize;
use serde_json::Value;

use crate::canonical::{Api, Envelope};
use crate::identity::{Headers, Identity};

/// The engines whose priority field the filter can write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Engine {
    /// vLLM: `priority`, an integer, lower runs first; read only with
    /// `--scheduling-policy priority` (otherwise accepted and ignored).
    Vllm,
    /// SGLang: `priority`, an integer, higher runs first; read only with
    /// `--enable-priority-scheduling`.
    Sglang,
    /// TensorRT-LLM (`trtllm-serve`): `priority`, a float in 0-1, higher
    /// first, 0.5 by default; read only with the `priority` waiting queue
    /// policy.
    Trtllm,
}

/// Class priorities by role, each on kvmesh's scale; unset ones fall back.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RoleClasses {
    pub lead: Option<i32>,
    pub subagent: Option<i32>,
    pub background: Option<i32>,
}

/// `priority_field` of the plugin configuration: write each request's
/// priority into its body, in `engine`'s field and polarity.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PriorityField {
    /// The engine of this GPU cluster (required: the field and its polarity).
    pub engine: Engine,
    /// A lead agent's requests (no agent or parent id): someone waits on them.
    #[serde(default)]
    pub lead: i32,
    /// A subagent's (an agent or parent id): the lead waits on them too, so
    /// they rank with it by default.
    #[serde(default)]
    pub subagent: i32,
    /// Background work (the background header set to `true`: titles,
    /// summaries, batch jobs a gateway marks): nobody waits on it.
    #[serde(default = "default_background")]
    pub background: i32,
    /// Per-harness overrides of the three classes, by harness name
    /// (`claude_code`, `codex`, `opencode`, `openclaw`, `other`).
    #[serde(default)]
    pub harness: BTreeMap<String, RoleClasses>,
    /// The header that marks a request as background (`true`).
    #[serde(default = "default_background_header")]
    pub background_header: String,
}

fn default_background() -> i32 {
    -100
}

fn default_background_header() -> String {
    "x-kvmesh-background".to_owned()
}

impl PriorityField {
    /// The first problem with the values, as (field, problem).
    pub(crate) fn problem(&self) -> Option<(String, String)> {
        let range = MIN_PRIORITY..=MAX_PRIORITY;
        let out_of_range = |field: String, value: Option<i32>| {
            value
                .filter(|v| !range.contains(v))
                .map(|_| (field, format!("must be between {MIN_PRIORITY} and {MAX_PRIORITY}")))
        };
        let base = [
            ("lead", self.lead),
            ("subagent", self.subagent),
            ("background", self.background),
        ];
        for (role, value) in base {
            if let Some(problem) = out_of_range(format!("priority_field.{role}"), Some(value)) {
                return Some(problem);
            }
        }
        for (name, classes) in &self.harness {
            if !Harness::ALL.iter().any(|h| h.name() == name) {
                return Some((
                    format!("priority_field.harness.{name}"),
                    "is not a harness (claude_code, codex, opencode, openclaw, other)".to_owned(),
                ));
            }
            for (role, value) in [
                ("lead", classes.lead),
                ("subagent", classes.subagent),
                ("background", classes.background),
            ] {
                if let Some(problem) = out_of_range(format!("priority_field.harness.{name}.{role}"), value) {
                    return Some(problem);
                }
            }
        }
        None
    }

    /// The class priority of a request of `harness` in `role`.
    fn class(&self, harness: Harness, role: Role) -> i32 {
        let classes = self.harness.get(harness.name());
        let (own, base) = match role {
            Role::Lead => (classes.and_then(|c| c.lead), self.lead),
            Role::Subagent => (classes.and_then(|c| c.subagent), self.subagent),
            Role::Background => (classes.and_then(|c| c.background), self.background),
        };
        own.unwrap_or(base)
    }
}

/// What a request is to its agent fleet, for its class priority.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Lead,
    Subagent,
    Background,
}

impl Role {
    fn of(headers: &impl Headers, identity: &Identity, field: &PriorityField) -> Self {
        if headers
            .get(&field.background_header)
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("true"))
        {
            Self::Background
        } else if !identity.agent_id.is_empty() || !identity.parent_id.is_empty() {
            Self::Subagent
        } else {
            Self::Lead
        }
    }
}

/// How the request's priority was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct PriorityRead {
    /// kvmesh's priority, clamped to its scale.
    pub(crate) value: Option<i32>,
    /// Client-given priorities ignored: not an integer, or outside i32.
    pub(crate) dropped: u8,
    /// The one used was outside kvmesh's scale and clamped into it.
    pub(crate) clamped: bool,
}

/// An integer of JSON or of a header, outside i32 or not an integer at all:
/// `None`.
fn integer(value: &Value) -> Option<i32> {
    value.as_i64().and_then(|p| i32::try_from(p).ok())
}

/// Reads the request's priority: the header, else the agent hint, else
/// (with `field`) the class of its harness and role.
pub(crate) fn read(
    headers: &impl Headers,
    header: &str,
    agent_hints: &Value,
    identity: &Identity,
    field: Option<&PriorityField>,
) -> PriorityRead {
    let mut read = PriorityRead::default();
    let mut given = None;
    // Bytes that are not UTF-8 are as good as absent (never a priority).
    if let Some(text) = headers.get(header) {
        match text.trim().parse::<i32>() {
            Ok(p) => given = Some(p),
            Err(_) => read.dropped += 1,
        }
    }
    if given.is_none() {
        match agent_hints.get("priority") {
            None | Some(Value::Null) => {}
            Some(hint) => match integer(hint) {
                Some(p) => given = Some(p),
                None => read.dropped += 1,
            },
        }
    }
    if let Some(p) = given {
        let clamped = p.clamp(MIN_PRIORITY, MAX_PRIORITY);
        read.clamped = clamped != p;
        read.value = Some(clamped);
    } else if let Some(field) = field {
        read.value = Some(field.class(identity.harness, Role::of(headers, identity, field)));
    }
    read
}

/// kvmesh's `priority` (clamped to its scale first) as the JSON value
/// `engine` reads in its `priority` field, with its polarity:
///
/// - vLLM runs lower values first (`PriorityRequestQueue` in
///   `vllm/v1/core/sched/request_queue.py`, a heap ordered by
///   `Request.__lt__` on `(priority, arrival_time)`), default 0: the value
///   is negated, so kvmesh's 0 stays vLLM's default.
/// - SGLang runs higher values first by default: `SchedulePolicy.__init__`
///   in `python/sglang/srt/managers/schedule_policy.py` sets
///   `priority_sign = -1` unless `--schedule-low-priority-values-first`,
///   and `_sort_by_priority_and_fcfs` sorts on `priority * priority_sign`.
///   A request without one gets the lowest of all
///   (`Scheduler._set_or_validate_priority`), so writing every request keeps
///   them comparable. The value is kvmesh's own.
/// - TensorRT-LLM's `trtllm-serve` takes a float in [0, 1], higher first,
///   0.5 when unset (`ChatCompletionRequest.priority` and
///   `CompletionRequest.priority` in `tensorrt_llm/serve/openai_protocol.py`,
///   validated `ge=0.0, le=1.0`): -1000..=1000 maps linearly onto 0..=1, 0 to
///   0.5, in steps of 0.0005 (written exactly, at most 4 decimals).
pub fn engine_priority_json(engine: Engine, priority: i32) -> String {
    let p = priority.clamp(MIN_PRIORITY, MAX_PRIORITY);
    match engine {
        Engine::Vllm => (-p).to_string(),
        Engine::Sglang => p.to_string(),
        Engine::Trtllm => {
            // (p + 1000) / 2000 in ten-thousandths: 0..=10_000, exact.
            let steps =
                (i64::from(p) - i64::from(MIN_PRIORITY)) * 10_000 / (i64::from(MAX_PRIORITY) - i64::from(MIN_PRIORITY));
            let fraction = format!("{:04}", steps % 10_000);
            let fraction = fraction.trim_end_matches('0');
            format!(
                "{}.{}",
                steps / 10_000,
                if fraction.is_empty() { "0" } else { fraction }
            )
        }
    }
}

/// A rewrite of the body: its first `replace` bytes become `with`, the rest
/// stays as it is (Envoy's body buffer can only be rewritten from its start).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BodyEdit {
    pub replace: usize,
    pub with: Vec<u8>,
    /// The request's priority is written in its engine's field
    /// (`priority_field`).
    pub priority: bool,
    /// Top-level `priority` members of the client's that were replaced.
    pub replaced: usize,
    /// Claude Code's billing block is taken out of `system`
    /// (`strip_preambles`).
    pub preamble: bool,
}

impl BodyEdit {
    /// The whole body after the edit (for tests and the native paths).
    pub fn apply(&self, body: &[u8]) -> Vec<u8> {
        let mut out = self.with.clone();
        out.extend_from_slice(body.get(self.replace..).unwrap_or_default());
        out
    }

    /// The body's length after the edit.
    pub fn new_len(&self, body_len: usize) -> usize {
        body_len.saturating_sub(self.replace).saturating_add(self.with.len())
    }
}

/// One change a setting asks of the body: the bytes of `range` become `with`.
#[derive(Debug)]
struct Splice {
    range: Range<usize>,
    with: Vec<u8>,
}

/// The edit writing `value` (JSON) as the body's top-level `priority`
/// alone (see [`compose`]).
#[cfg(test)]
pub(crate) fn edit(envelope: &Envelope<'_>, value: &str) -> Option<BodyEdit> {
    compose(Api::ChatCompletions, envelope, Some(value), false)
}

/// The one rewrite doing what the settings ask of a body of `api`: write
/// `priority` (JSON) as its top-level `priority`, and with `strip_preambles`
/// take the billing block out of a Messages `system`. `None` when nothing is
/// to change, and for a body cut at the parse cap, whose members after the
/// cut are unknown (a client's `priority` there would win over an inserted
/// one, a later `system` over the one stripped).
pub(crate) fn compose(
    api: Api,
    envelope: &Envelope<'_>,
    priority: Option<&str>,
    strip_preambles: bool,
) -> Option<BodyEdit> {
    if envelope.truncated() {
        return None;
    }
    let body = envelope.body();
    let mut splices = Vec::new();
    let mut replaced = 0;
    if let Some(value) = priority {
        replaced = priority_splices(envelope, value, &mut splices)?;
    }
    let mut preamble = false;
    if strip_preambles && api == Api::Messages {
        // The member the engine reads: the last, in any spelling of its key.
        let billing = envelope
            .spans_of("system")
            .pop()
            .and_then(|system| crate::preamble::billing_block(body, system));
        if let Some(range) = billing {
            splices.push(Splice {
                range,
                with: Vec::new(),
            });
            preamble = true;
        }
    }
    if splices.is_empty() {
        return None;
    }
    // The brace, the top-level `priority` values and bytes inside `system`
    // never overlap; a body where they would is left as it is (the copy
    // between two overlapping changes is an inverted range: `None`).
    splices.sort_by_key(|splice| (splice.range.start, splice.range.end));
    let end = splices.last().map_or(0, |splice| splice.range.end);
    let mut with = Vec::with_capacity(end + splices.iter().map(|s| s.with.len()).sum::<usize>());
    let mut at = 0;
    for splice in &splices {
        with.extend_from_slice(body.get(at..splice.range.start)?);
        with.extend_from_slice(&splice.with);
        at = splice.range.end;
    }
    Some(BodyEdit {
        replace: at,
        with,
        priority: priority.is_some(),
        replaced,
        preamble,
    })
}

/// Adds the changes writing `value` as the top-level `priority`: right
/// after the opening brace, or in place of each value the client sent.
/// Returns how many it replaced.
fn priority_splices(envelope: &Envelope<'_>, value: &str, splices: &mut Vec<Splice>) -> Option<usize> {
    let body = envelope.body();
    let spans: Vec<Range<usize>> = envelope.spans_of("priority");
    if spans.is_empty() {
        // Right after the opening brace: what precedes it is whitespace.
        let open = body.iter().position(|&b| b == b'{')?;
        let mut with = b"\"priority\":".to_vec();
        with.extend_from_slice(value.as_bytes());
        if !envelope.is_empty() {
            with.push(b',');
        }
        splices.push(Splice {
            range: open + 1..open + 1,
            with,
        });
        return Some(0);
    }
    let replaced = spans.len();
    splices.extend(spans.into_iter().map(|range| Splice {
        range,
        with: value.as_bytes().to_vec(),
    }));
    Some(replaced)
}
