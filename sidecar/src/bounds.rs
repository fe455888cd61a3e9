//! The bounds of `kvmesh_vocab::limits`, enforced where messages enter the
//! sidecar. The filter never sends more; anything that does is a bug or a
//! client speaking gRPC directly, and must neither grow the sidecar's memory
//! (every string of a Pick is kept somewhere: sessions, pending picks,
//! traces) nor steer load (a claimed prompt size becomes queued prefill).

use kvmesh_core::{MAX_BYTES_PER_TOKEN, PickInput};
use kvmesh_proto::v1;
use kvmesh_vocab::limits::{
    MAX_BLOCK_BYTES, MAX_BLOCKS, MAX_ID_BYTES, MAX_NAME_BYTES, MAX_PROMPT_TOKENS, MAX_RETENTION_HORIZON_S,
    MAX_SECTIONS, MIN_BLOCK_BYTES,
};

/// The largest `prompt_bytes` a Pick may claim: a longer prompt is over
/// `MAX_PROMPT_TOKENS` at any bytes per token the router would learn. (256
/// MiB, eight times the request buffer of the shipped Envoy config.)
const MAX_PROMPT_BYTES: u64 = MAX_PROMPT_TOKENS * MAX_BYTES_PER_TOKEN;

/// A field of a Pick past its bound: the Pick is answered with no decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{field} is {got}, over its bound {max}")]
pub struct Violation {
    /// The field's name in the proto, a metric label.
    pub field: &'static str,
    pub got: u64,
    pub max: u64,
}

fn within(field: &'static str, got: usize, max: usize) -> Result<(), Violation> {
    if got <= max {
        return Ok(());
    }
    Err(Violation {
        field,
        got: got as u64,
        max: max as u64,
    })
}

/// Checks every bounded field of `req`; `input` is the same request as the
/// core reads it (its block size with the default applied).
pub fn check_pick(req: &v1::PickRequest, input: &PickInput<'_>) -> Result<(), Violation> {
    for (field, value) in [
        ("session_id", &req.session_id),
        ("parent_id", &req.parent_id),
        ("agent_id", &req.agent_id),
        ("tenant", &req.tenant),
        ("model", &req.model),
    ] {
        within(field, value.len(), MAX_ID_BYTES)?;
    }
    within("harness", req.harness.len(), MAX_NAME_BYTES)?;
    within("lane", req.lane.len(), MAX_NAME_BYTES)?;
    // `trace_id` is not refused: anything but 32 hex digits is no trace id
    // (`wire::pick_input`), so it is never kept at any length.
    within("block_hashes", req.block_hashes.len(), MAX_BLOCKS)?;
    within("sections", req.sections.len(), MAX_SECTIONS)?;
    // 0 is the proto's "the default size", which the core applies.
    let block_bytes = input.block_bytes();
    if !(MIN_BLOCK_BYTES..=MAX_BLOCK_BYTES).contains(&(block_bytes as usize)) {
        return Err(Violation {
            field: "block_bytes",
            got: u64::from(block_bytes),
            max: MAX_BLOCK_BYTES as u64,
        });
    }
    // The filter hashes the whole canonical stream up to its block cap and
    // reports the bytes it hashed, so the stream ends in the last block.
    let covered = (req.block_hashes.len() as u64 + 1).saturating_mul(u64::from(block_bytes));
    let max = covered.min(MAX_PROMPT_BYTES);
    if req.prompt_bytes > max {
        return Err(Violation {
            field: "prompt_bytes",
            got: req.prompt_bytes,
            max,
        });
    }
    Ok(())
}

/// Clamps the fields of a checked Pick that are bounded but not refused: a
/// declared retention horizon past a day is read as a day (a client's
/// claim, which may only weigh what its blocks are worth, not refuse it).
pub fn clamp_pick(input: &mut PickInput<'_>) {
    let max_ms = u64::from(MAX_RETENTION_HORIZON_S) * 1000;
    input.retention_horizon_ms = input.retention_horizon_ms.map(|ms| ms.min(max_ms));
}

/// Clears every string of `outcome` past its bound (the outcome still
/// releases its pick); returns the fields cleared.
pub fn clip_outcome(outcome: &mut v1::Outcome) -> Vec<&'static str> {
    let mut cleared = Vec::new();
    for (field, value, max) in [("destination", &mut outcome.destination, MAX_ID_BYTES)] {
        if value.len() > max {
            *value = String::new();
            cleared.push(field);
        }
    }
    cleared
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(req: &v1::PickRequest) -> PickInput<'_> {
        PickInput {
            block_hashes: &req.block_hashes,
            block_bytes: req.block_bytes,
            ..PickInput::default()
        }
    }

    fn check(req: &v1::PickRequest) -> Result<(), &'static str> {
        check_pick(req, &input(req)).map_err(|v| v.field)
    }

    #[test]
    fn each_bound_names_its_field() {
        let ok = v1::PickRequest {
            block_hashes: vec![1, 2, 3],
            block_bytes: 256,
            prompt_bytes: 700,
            model: "m".repeat(MAX_ID_BYTES),
            ..v1::PickRequest::default()
        };
        assert_eq!(check(&ok), Ok(()));
        let cases: [(v1::PickRequest, &str); 7] = [
            (
                v1::PickRequest {
                    model: "m".repeat(MAX_ID_BYTES + 1),
                    ..ok.clone()
                },
                "model",
            ),
            (
                v1::PickRequest {
                    harness: "h".repeat(MAX_NAME_BYTES + 1),
                    ..ok.clone()
                },
                "harness",
            ),
            (
                v1::PickRequest {
                    lane: "l".repeat(MAX_NAME_BYTES + 1),
                    ..ok.clone()
                },
                "lane",
            ),
            (
                v1::PickRequest {
                    block_bytes: 8,
                    ..ok.clone()
                },
                "block_bytes",
            ),
            (
                v1::PickRequest {
                    prompt_bytes: 4 * 256 + 1,
                    ..ok.clone()
                },
                "prompt_bytes",
            ),
            (
                v1::PickRequest {
                    block_bytes: 0,
                    prompt_bytes: u64::MAX,
                    ..ok.clone()
                },
                "prompt_bytes",
            ),
            (
                v1::PickRequest {
                    sections: vec![v1::PromptSection::default(); MAX_SECTIONS + 1],
                    ..ok.clone()
                },
                "sections",
            ),
        ];
        for (req, field) in cases {
            assert_eq!(check(&req), Err(field));
        }
    }

    #[test]
    fn a_retention_horizon_past_a_day_is_clamped_to_a_day() {
        let day_ms = 86_400_000;
        for (declared, kept) in [
            (None, None),
            (Some(300_000), Some(300_000)),
            (Some(day_ms), Some(day_ms)),
            (Some(day_ms + 1), Some(day_ms)),
            (Some(u64::MAX), Some(day_ms)),
        ] {
            let mut input = PickInput {
                retention_horizon_ms: declared,
                ..PickInput::default()
            };
            clamp_pick(&mut input);
            assert_eq!(input.retention_horizon_ms, kept, "{declared:?}");
        }
        // Over the wire the field is seconds: u32::MAX of them is clamped too.
        let req = v1::PickRequest {
            retention_horizon_s: Some(u32::MAX),
            ..v1::PickRequest::default()
        };
        let mut input = crate::wire::pick_input(&req, 0);
        clamp_pick(&mut input);
        assert_eq!(input.retention_horizon_ms, Some(day_ms));
    }

    #[test]
    fn oversized_outcome_strings_are_cleared() {
        let mut fine = v1::Outcome {
            destination: "10.0.0.1:8000".to_owned(),
            ..v1::Outcome::default()
        };
        assert!(clip_outcome(&mut fine).is_empty());
        assert_eq!(fine.destination, "10.0.0.1:8000");
        let mut outcome = v1::Outcome {
            destination: "d".repeat(MAX_ID_BYTES + 1),
            ..v1::Outcome::default()
        };
        assert_eq!(clip_outcome(&mut outcome), ["destination"]);
        assert_eq!(outcome.destination, "");
    }
}
