//! Conversions between the `kvmesh.v1` messages and the routing core's
//! types: a Pick and an Outcome as the core reads them, the core's reason as
//! the filter reads it. Pure: no I/O, no bounds (see `bounds`), no defaults
//! beyond what the proto itself says (0 block bytes is "the default size",
//! which the core applies).

use kvmesh_core::{Outcome, PickInput, Reason, TraceId};
use kvmesh_proto::v1;

/// The Pick as the core reads it, decided at `now_ms`. A `trace_id` that is
/// not exactly 32 hex digits is none; a `lane` no version names is `Main`.
pub fn pick_input(req: &v1::PickRequest, now_ms: u64) -> PickInput<'_> {
    PickInput {
        block_hashes: &req.block_hashes,
        last_block_partial: req.last_block_partial,
        block_bytes: req.block_bytes,
        prompt_bytes: req.prompt_bytes,
        session_id: &req.session_id,
        agent_id: &req.agent_id,
        parent_id: &req.parent_id,
        model: &req.model,
        lane: req.lane(),
        trace_id: TraceId::parse(&req.trace_id),
        session_final: req.session_final,
        harness: req.harness(),
        tenant: &req.tenant,
        retention_horizon_ms: req.retention_horizon_s.map(|s| u64::from(s) * 1000),
        truncated: req.truncated,
        now_ms,
    }
}

/// The usage an Outcome reports, as the core learns from it.
pub fn outcome_from_wire(outcome: &v1::Outcome) -> Outcome {
    Outcome {
        pick_id: outcome.pick_id,
        prompt_tokens: outcome.prompt_tokens,
        cached_tokens: outcome.cached_tokens,
        ttfb_ms: outcome.ttfb_ms,
    }
}

/// Why the core chose, as the filter logs and counts it.
pub fn reason_to_wire(reason: Reason) -> v1::PickReason {
    match reason {
        Reason::PrefixMatch => v1::PickReason::PrefixMatch,
        Reason::LoadSpill => v1::PickReason::LoadSpill,
        Reason::SessionAffinity => v1::PickReason::SessionAffinity,
        Reason::ParentSeed => v1::PickReason::ParentSeed,
        Reason::LeastLoaded => v1::PickReason::LeastLoaded,
        Reason::NoWorkers => v1::PickReason::NoWorkers,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvmesh_core::PromptSection;

    #[test]
    fn pick_fields_reach_the_core_unchanged() {
        let req = v1::PickRequest {
            block_hashes: vec![7, 8],
            last_block_partial: true,
            block_bytes: 64,
            prompt_bytes: 100,
            session_id: "s".into(),
            agent_id: "a".into(),
            parent_id: "p".into(),
            model: "m".into(),
            session_final: true,
            truncated: true,
            retention_horizon_s: Some(3600),
            ..v1::PickRequest::default()
        };
        let input = pick_input(&req, 42);
        assert_eq!(input.retention_horizon_ms, Some(3_600_000));
        assert_eq!(pick_input(&v1::PickRequest::default(), 0).retention_horizon_ms, None);
        assert_eq!(input.block_hashes, [7, 8]);
        assert!(input.last_block_partial && input.session_final && input.truncated);
        assert_eq!((input.block_bytes, input.prompt_bytes, input.now_ms), (64, 100, 42));
        assert_eq!(
            (input.session_id, input.agent_id, input.parent_id, input.model),
            ("s", "a", "p", "m")
        );
    }

    #[test]
    fn the_lane_and_a_well_formed_trace_id_reach_the_core() {
        let hex = "4bf92f3577b34da6a3ce929d0e0e4736";
        let req = v1::PickRequest {
            lane: "side".into(),
            trace_id: hex.into(),
            ..v1::PickRequest::default()
        };
        let input = pick_input(&req, 0);
        assert_eq!(input.lane, kvmesh_core::Lane::Side);
        assert_eq!(input.trace_id, TraceId::parse(hex));
        assert!(input.trace_id.is_some());
        for (lane, trace_id) in [("", "4bf92f35"), ("title", &*format!("{hex}00")), ("main", "")] {
            let req = v1::PickRequest {
                lane: lane.into(),
                trace_id: trace_id.into(),
                ..v1::PickRequest::default()
            };
            let input = pick_input(&req, 0);
            assert_eq!(
                (input.lane, input.trace_id),
                (kvmesh_core::Lane::Main, None),
                "{lane:?} {trace_id:?}"
            );
        }
    }

    #[test]
    fn unknown_section_kinds_are_other() {
        let section = |kind: i32| {
            PromptSection::from(&v1::PromptSection {
                kind,
                ..v1::PromptSection::default()
            })
            .kind
        };
        for kind in kvmesh_core::SectionKind::ALL {
            assert_eq!(section(v1::SectionKind::from(kind).into()), kind);
        }
        assert_eq!(section(999), kvmesh_core::SectionKind::Other);
        assert_eq!(section(-1), kvmesh_core::SectionKind::Other);
    }

    #[test]
    fn outcome_usage_is_kept_as_reported() {
        let outcome = outcome_from_wire(&v1::Outcome {
            pick_id: 9,
            prompt_tokens: Some(100),
            cached_tokens: None,
            ttfb_ms: 12,
            ..v1::Outcome::default()
        });
        assert_eq!(
            (
                outcome.pick_id,
                outcome.prompt_tokens,
                outcome.cached_tokens,
                outcome.ttfb_ms
            ),
            (9, Some(100), None, 12)
        );
    }

    #[test]
    fn every_reason_has_its_own_wire_value() {
        let reasons = [
            Reason::PrefixMatch,
            Reason::LoadSpill,
            Reason::SessionAffinity,
            Reason::ParentSeed,
            Reason::LeastLoaded,
            Reason::NoWorkers,
        ];
        let wire: std::collections::BTreeSet<i32> = reasons.iter().map(|r| reason_to_wire(*r).into()).collect();
        assert_eq!(wire.len(), reasons.len());
        assert!(!wire.contains(&i32::from(v1::PickReason::Rejected)));
    }
}
