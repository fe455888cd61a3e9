//! Cost and choice: what placing one request on one worker costs, term by
//! term (the formula of the router's module doc, in one function), and the
//! ranking of the candidates with the reason for the winner.

use super::RouterConfig;
use super::decision::Reason;
use super::fleet::WorkerId;

/// The cost of one worker for one request, in prompt-token equivalents,
/// by term; `total` is their sum and is what the choice compares.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Cost {
    /// `prefill_weight · uncached(w)`: recomputing what it does not hold.
    pub prefill: f64,
    /// `prefill_weight · queued_prefill(w)`: prefill already waiting there.
    pub queue: f64,
    /// `decode_weight · (active_kv(w) + request_tokens)`.
    pub decode: f64,
    /// `session_weight · live_sessions(w)`, for a new session only.
    pub sessions: f64,
    /// `recent_weight · recent_prefill(w)`, for a new session only.
    pub recent: f64,
    /// `eviction_weight · tokens_evicted(w)` by placing the new blocks,
    /// each weighted by the chance its session returns (see `retention`).
    pub eviction: f64,
    /// `move_margin · request_tokens` off a continuing session's home.
    pub hysteresis: f64,
    pub total: f64,
}

/// What the cost of one (request, worker) pair weighs.
#[derive(Debug, Clone, Copy)]
pub(super) struct CostFacts {
    pub(super) request_tokens: f64,
    pub(super) block_tokens: f64,
    /// Leading blocks of the request the worker holds, on either tier.
    pub(super) overlap: usize,
    /// Of those, the blocks it holds in host memory only.
    pub(super) host_overlap: usize,
    /// Prompt tokens waiting for prefill there: kvmesh's fluid queue plus
    /// the engine's own queue in assumed requests.
    pub(super) queued_tokens: f64,
    pub(super) active_kv_tokens: f64,
    pub(super) recent_prefill_tokens: f64,
    /// The worker's share of recent time spent prefilling (0 to 1).
    pub(super) recent_utilization: f64,
    pub(super) live_sessions: u32,
    /// Cached blocks placing the request's new blocks would push out,
    /// each weighted by its retention value (1 each without retention).
    pub(super) evicted_blocks: f64,
    /// The session has no home yet.
    pub(super) new_session: bool,
    /// The worker is the session's home.
    pub(super) at_home: bool,
}

/// The prompt tokens a request shares with a worker's cache when `overlap`
/// of its leading blocks are there: the common prefix ends somewhere inside
/// the next block (or the prompt's tail), half way on average, since kvmesh
/// hashes whole blocks only.
pub(super) fn matched_tokens(overlap: usize, block_tokens: f64) -> f64 {
    if overlap == 0 {
        return 0.0;
    }
    (overlap as f64 + 0.5) * block_tokens
}

/// The prompt tokens the engine will report from its cache for a request
/// whose `matched_tokens` it holds: never more than the prompt, and only
/// whole engine blocks (an engine caches and reuses whole blocks; a match
/// ending inside one is recomputed from that block's start).
pub(super) fn engine_cached_tokens(matched_tokens: f64, request_tokens: f64, engine_block_tokens: Option<u32>) -> u64 {
    let tokens = matched_tokens.min(request_tokens).max(0.0);
    match engine_block_tokens {
        Some(block @ 2..) => ((tokens / f64::from(block)).floor() * f64::from(block)) as u64,
        _ => tokens.round() as u64,
    }
}

/// The prompt tokens a hit on `overlap` leading blocks saves, `host` of
/// them host-only: a GPU block saves its whole prefill, a host-only one
/// `host_hit_credit` of it (it must be loaded back first).
pub(super) fn credited_cached_tokens(
    c: &RouterConfig,
    overlap: usize,
    host: usize,
    block_tokens: f64,
    request_tokens: f64,
) -> f64 {
    let host = host.min(overlap);
    let gpu = (overlap - host) as f64;
    let credit = c.host_hit_credit.clamp(0.0, 1.0);
    ((gpu + credit * host as f64) * block_tokens).min(request_tokens)
}

/// The router's cost formula (see the module doc of `router`).
pub(super) fn cost(c: &RouterConfig, f: &CostFacts) -> Cost {
    let floor = c.spread_floor.clamp(0.0, 1.0);
    let spread = floor + (1.0 - floor) * f.recent_utilization.clamp(0.0, 1.0);
    let cached = credited_cached_tokens(c, f.overlap, f.host_overlap, f.block_tokens, f.request_tokens);
    let uncached = f.request_tokens - cached;
    let mut cost = Cost {
        prefill: c.prefill_weight * uncached,
        queue: c.prefill_weight * f.queued_tokens,
        decode: c.decode_weight * (f.active_kv_tokens + f.request_tokens),
        // Only a session without a home yet weighs where sessions live and
        // what workers did lately: for a continuing one, moving for balance
        // would recompute its prefix and flap back (its own departure
        // lightens its old home).
        sessions: if f.new_session {
            spread * c.session_weight * f64::from(f.live_sessions)
        } else {
            0.0
        },
        recent: if f.new_session {
            spread * c.recent_prefill_weight * f.recent_prefill_tokens
        } else {
            0.0
        },
        eviction: c.eviction_weight * f.evicted_blocks * f.block_tokens,
        hysteresis: if f.at_home {
            c.move_margin * f.request_tokens
        } else {
            0.0
        },
        total: 0.0,
    };
    // Summed in the documented order, so a cost is reproducible by hand
    // from its terms.
    cost.total =
        cost.queue + cost.prefill + cost.decode + cost.sessions + cost.recent + cost.eviction - cost.hysteresis;
    cost
}

/// Per-candidate figures of one pick: small, because they are sorted (the
/// terms live in the decision's `costs`; carrying them here made a Pick
/// over 512 workers a third slower).
#[derive(Debug, Clone, Copy)]
pub(super) struct Candidate {
    pub(super) id: WorkerId,
    pub(super) overlap: usize,
    /// The cost's total.
    pub(super) cost: f64,
    /// 0 the session's home, 1 its parent's, 2 any other.
    pub(super) preference: u8,
    pub(super) in_flight: u32,
}

/// The candidates with the best `keep` first, in order (the rest after
/// them in no particular order), with the reason the first won and the
/// longest overlap among them; `None` when there are none.
pub(super) fn rank(candidates: &mut [Candidate], tie_tolerance: f64, keep: usize) -> Option<(Reason, usize)> {
    let best_cost = candidates.iter().map(|c| c.cost).min_by(f64::total_cmp)?;
    let tolerance = tie_tolerance * best_cost.abs().max(1.0);
    // Ties first by preference, then by fewer requests, then by id:
    // deterministic, and documented in the module docs. A total order (ids
    // differ), so the best `keep` are the same however they are found:
    // selecting them and sorting only those, not all (sorting 512
    // candidates was a tenth of a Pick's instructions at 64 workers).
    let order = |a: &Candidate, b: &Candidate| {
        let a_tied = a.cost <= best_cost + tolerance;
        let b_tied = b.cost <= best_cost + tolerance;
        b_tied.cmp(&a_tied).then_with(|| {
            if a_tied && b_tied {
                a.preference
                    .cmp(&b.preference)
                    .then(a.in_flight.cmp(&b.in_flight))
                    .then(a.id.cmp(&b.id))
            } else {
                a.cost.total_cmp(&b.cost).then(a.id.cmp(&b.id))
            }
        })
    };
    let keep = keep.clamp(1, candidates.len());
    if keep < candidates.len() {
        candidates.select_nth_unstable_by(keep - 1, order);
    }
    candidates[..keep].sort_unstable_by(order);
    let chosen = candidates.first()?;
    let best_overlap = candidates.iter().map(|c| c.overlap).max().unwrap_or(0);
    let reason = if chosen.overlap > 0 && chosen.overlap == best_overlap {
        Reason::PrefixMatch
    } else if best_overlap > chosen.overlap {
        Reason::LoadSpill
    } else if chosen.preference == 0 {
        Reason::SessionAffinity
    } else if chosen.preference == 1 {
        Reason::ParentSeed
    } else {
        Reason::LeastLoaded
    };
    Some((reason, best_overlap))
}
