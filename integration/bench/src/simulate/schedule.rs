//! When each call of a workload is sent. Open loop: at its recorded time.
//! Closed loop: a session's next call goes out when its previous call
//! completes plus the recorded gap between them, so a slow engine slows
//! the agent down as it would a real one; a subagent's first call follows
//! its parent's call the same way. Both shift each root session's start by
//! a seeded jitter, so seeds differ on a fixed trace.
//!
//! The recorded gap is measured start to start: the traces record when each
//! call was sent, not when it finished. For `gen-agents` workloads that is
//! exact (their gaps are think and tool time only); for recorded traces the
//! recorded call's own duration counts as think time.

use std::collections::HashMap;

use super::trace::Request;

/// When one call is sent.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Release {
    /// At this time, ms from the start.
    At(f64),
    /// `gap_ms` after call `anchor` completes.
    After { anchor: usize, gap_ms: f64 },
}

/// Every call's release, by index in the workload.
#[derive(Debug, Clone)]
pub(crate) struct Schedule {
    pub(crate) releases: Vec<Release>,
    /// Calls released by each call's completion, with their gaps.
    pub(crate) followers: HashMap<usize, Vec<(usize, f64)>>,
    /// The most a root session's start moves for a seed: the mean gap
    /// between root session starts.
    pub(crate) jitter_span_ms: f64,
}

/// A session tree's root: the session at the top of its parent chain, or
/// the call's own index for calls without a session.
fn roots(requests: &[Request]) -> Vec<String> {
    let parent_of: HashMap<&str, &str> = requests
        .iter()
        .filter(|r| !r.session.is_empty() && !r.parent.is_empty())
        .map(|r| (r.session.as_str(), r.parent.as_str()))
        .collect();
    requests
        .iter()
        .enumerate()
        .map(|(i, r)| {
            if r.session.is_empty() {
                return format!("#call-{i}");
            }
            let mut root = r.session.as_str();
            // Bounded: a malformed trace may loop.
            for _ in 0..64 {
                match parent_of.get(root) {
                    Some(parent) if *parent != root => root = parent,
                    _ => break,
                }
            }
            root.to_owned()
        })
        .collect()
}

/// A uniform draw in [0, 1), fixed by the seed and the root session.
fn unit(seed: u64, key: &str) -> f64 {
    let h = key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    let mut z = h ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

impl Schedule {
    /// `requests` sorted by time (as `trace::load` returns them, already
    /// divided by the speed, so gaps and starts scale alike).
    pub(crate) fn new(requests: &[Request], closed_loop: bool, jitter_seed: Option<u64>) -> Self {
        let roots = roots(requests);
        // Each root's recorded start, and the mean gap between them.
        let mut starts: HashMap<&str, f64> = HashMap::new();
        for (r, root) in requests.iter().zip(&roots) {
            starts.entry(root).or_insert(r.at_ms);
        }
        let mut first: Vec<f64> = starts.values().copied().collect();
        first.sort_by(f64::total_cmp);
        let jitter_span_ms = match (first.first(), first.last(), jitter_seed) {
            (Some(a), Some(b), Some(_)) if first.len() > 1 => (b - a) / (first.len() - 1) as f64,
            _ => 0.0,
        };
        let jitter: HashMap<&str, f64> = starts
            .keys()
            .map(|root| (*root, unit(jitter_seed.unwrap_or(0), root) * jitter_span_ms))
            .collect();
        let shifted = |i: usize| requests[i].at_ms + jitter.get(roots[i].as_str()).copied().unwrap_or(0.0);
        let mut releases: Vec<Release> = (0..requests.len()).map(|i| Release::At(shifted(i))).collect();
        let mut followers: HashMap<usize, Vec<(usize, f64)>> = HashMap::new();
        if closed_loop {
            // Each session's calls so far, in order.
            let mut calls: HashMap<&str, Vec<usize>> = HashMap::new();
            for (i, r) in requests.iter().enumerate() {
                if r.session.is_empty() {
                    continue;
                }
                // The call this one follows: the session's previous call,
                // else (a subagent's first) its parent's latest call before
                // it. Only earlier calls, so the chain has no cycle.
                let anchor = match calls.get(r.session.as_str()).and_then(|c| c.last()) {
                    Some(&previous) => Some(previous),
                    None => calls.get(r.parent.as_str()).and_then(|c| c.last()).copied(),
                };
                if let Some(anchor) = anchor {
                    let gap_ms = (r.at_ms - requests[anchor].at_ms).max(0.0);
                    releases[i] = Release::After { anchor, gap_ms };
                    followers.entry(anchor).or_default().push((i, gap_ms));
                }
                calls.entry(&r.session).or_default().push(i);
            }
        }
        Self {
            releases,
            followers,
            jitter_span_ms,
        }
    }

    /// Calls sent at a fixed time, with it.
    pub(crate) fn fixed(&self) -> impl Iterator<Item = (usize, f64)> + '_ {
        self.releases.iter().enumerate().filter_map(|(i, r)| match r {
            Release::At(t) => Some((i, *t)),
            Release::After { .. } => None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(at_ms: f64, session: &str, parent: &str) -> Request {
        Request {
            at_ms,
            session: session.to_owned(),
            parent: parent.to_owned(),
            text: String::new(),
            output_tokens: 1,
            session_final: false,
        }
    }

    #[test]
    fn sessions_chain_and_subagents_follow_their_parents_call() {
        let requests = [
            call(0.0, "a", ""),
            call(100.0, "b", ""),
            call(1000.0, "a", ""),
            call(1200.0, "a-sub", "a"),
            call(1500.0, "a-sub", "a"),
            call(2000.0, "", ""),
        ];
        let s = Schedule::new(&requests, true, Some(1));
        assert!(matches!(s.releases[0], Release::At(_)));
        assert!(matches!(s.releases[1], Release::At(_)));
        assert_eq!(
            s.releases[2],
            Release::After {
                anchor: 0,
                gap_ms: 1000.0
            }
        );
        assert_eq!(
            s.releases[3],
            Release::After {
                anchor: 2,
                gap_ms: 200.0
            }
        );
        assert_eq!(
            s.releases[4],
            Release::After {
                anchor: 3,
                gap_ms: 300.0
            }
        );
        assert!(matches!(s.releases[5], Release::At(_)));
        // Open loop: every call at its recorded time plus its root's jitter,
        // the subagent moving with its parent.
        let open = Schedule::new(&requests, false, Some(1));
        let at = |i: usize| match open.releases[i] {
            Release::At(t) => t,
            Release::After { .. } => f64::NAN,
        };
        assert!((at(3) - at(2) - 200.0).abs() < 1e-9);
        assert!((at(2) - at(0) - 1000.0).abs() < 1e-9);
    }

    #[test]
    fn seeds_jitter_root_starts_within_the_mean_root_gap() {
        let requests: Vec<Request> = (0..20).map(|k| call(k as f64 * 500.0, &format!("s{k}"), "")).collect();
        let a = Schedule::new(&requests, true, Some(1));
        let b = Schedule::new(&requests, true, Some(2));
        assert_eq!(a.jitter_span_ms, 500.0);
        assert_ne!(a.releases, b.releases);
        assert_eq!(a.releases, Schedule::new(&requests, true, Some(1)).releases);
        for (i, t) in a.fixed() {
            let shift = t - requests[i].at_ms;
            assert!((0.0..500.0).contains(&shift), "{shift}");
        }
        // Without a jitter seed, every call at its recorded time.
        let recorded = Schedule::new(&requests, true, None);
        assert_eq!(recorded.jitter_span_ms, 0.0);
        assert!(recorded.fixed().all(|(i, t)| t == requests[i].at_ms));
    }
}
