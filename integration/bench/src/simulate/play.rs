//! One run's moving parts on the virtual clock, apart from its policy: the
//! world, the calls due, the completions not yet told, each call's fate.
//! A `Play` is a value: `kvmesh_oracle` copies it to play each choice of
//! worker forward to the end of the workload.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use super::policies::Policy;
use super::schedule::Schedule;
use super::world::{self, Prepared, Served, World};

/// A finished request to feed back to its policy, ordered by end time.
#[derive(Debug, Clone)]
pub(crate) struct Completion {
    pub(crate) end: f64,
    pub(crate) index: usize,
    pub(crate) worker: usize,
    pub(crate) cached: u64,
    pub(crate) ttft: f64,
}

impl PartialEq for Completion {
    fn eq(&self, other: &Self) -> bool {
        self.end == other.end && self.index == other.index
    }
}
impl Eq for Completion {}
impl PartialOrd for Completion {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Completion {
    /// Earliest end first (a max-heap, reversed).
    fn cmp(&self, other: &Self) -> Ordering {
        other.end.total_cmp(&self.end).then(other.index.cmp(&self.index))
    }
}

/// A call released at a time (ordered earliest first in a max-heap).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Due {
    at: f64,
    index: usize,
}
impl Eq for Due {}
impl PartialOrd for Due {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Due {
    fn cmp(&self, other: &Self) -> Ordering {
        other.at.total_cmp(&self.at).then(other.index.cmp(&self.index))
    }
}

/// A workload being played: calls are sent as the schedule releases them
/// (a closed-loop call once the call it follows has completed), the world
/// advances event by event, and completions reach the policy before
/// anything later is picked.
#[derive(Debug, Clone)]
pub(crate) struct Play<'a> {
    pub(crate) prepared: &'a [Prepared],
    schedule: &'a Schedule,
    pub(crate) world: World,
    pending: BinaryHeap<Completion>,
    releases: BinaryHeap<Due>,
    /// Each call's send time and fate, once its prefill started.
    pub(crate) calls: Vec<Option<(f64, Served)>>,
    pub(crate) sent: Vec<f64>,
}

impl<'a> Play<'a> {
    pub(crate) fn new(prepared: &'a [Prepared], schedule: &'a Schedule, world: World) -> Self {
        Self {
            prepared,
            schedule,
            world,
            pending: BinaryHeap::new(),
            releases: schedule.fixed().map(|(index, at)| Due { at, index }).collect(),
            calls: vec![None; prepared.len()],
            sent: vec![f64::NAN; prepared.len()],
        }
    }

    /// Runs the clock to the next call to send, telling `policy` (and
    /// `told`, for the ledger) of each completion on the way: that call and
    /// its send time, `None` once every call has ended.
    pub(crate) fn next_call(
        &mut self,
        policy: &mut dyn Policy,
        mut told: impl FnMut(&Completion),
    ) -> Option<(&'a Prepared, f64)> {
        loop {
            let done_at = self.pending.peek().map_or(f64::INFINITY, |c| c.end);
            let world_at = self.world.next_event_ms().unwrap_or(f64::INFINITY);
            let release_at = self.releases.peek().map_or(f64::INFINITY, |d| d.at);
            if done_at.is_infinite() && world_at.is_infinite() && release_at.is_infinite() {
                return None;
            }
            if done_at <= world_at && done_at <= release_at {
                if let Some(c) = self.pending.pop() {
                    policy.completed(c.worker, &self.prepared[c.index], c.cached, c.ttft, c.end);
                    told(&c);
                }
                continue;
            }
            if world_at <= release_at {
                let events = self.world.advance(world_at);
                self.on_events(events);
                continue;
            }
            let Due { at, index } = self.releases.pop()?;
            if let Some(r) = self.prepared.get(index) {
                return Some((r, at));
            }
        }
    }

    /// Sends `r` to worker `w` at `now`.
    pub(crate) fn send(&mut self, r: &Prepared, w: usize, now: f64) {
        if let Some(slot) = self.sent.get_mut(r.index) {
            *slot = now;
        }
        let events = self.world.admit(w, r, now);
        self.on_events(events);
    }

    /// The prompt tokens computed so far (not served from a cache) and the
    /// sum of the started calls' TTFTs: what `kvmesh_oracle` minimizes, in
    /// that order.
    pub(crate) fn cost(&self) -> (u64, f64) {
        self.calls.iter().flatten().fold((0, 0.0), |(prefill, ttft), (_, s)| {
            (
                prefill + (s.prompt_tokens - s.cached_tokens.min(s.prompt_tokens)),
                ttft + s.ttft_ms,
            )
        })
    }

    /// A prefill started: its fate is known but for its end. A request
    /// finished: the policy will hear of it, the calls that follow it are
    /// due after its end.
    fn on_events(&mut self, events: Vec<world::Event>) {
        for event in events {
            match event {
                world::Event::Started(world::Started { index, served }) => {
                    if let Some(slot) = self.calls.get_mut(index) {
                        *slot = Some((self.sent.get(index).copied().unwrap_or(f64::NAN), served));
                    }
                }
                world::Event::Finished { index, end_ms } => {
                    let Some(Some((_, served))) = self.calls.get_mut(index) else {
                        continue;
                    };
                    served.end_ms = end_ms;
                    self.pending.push(Completion {
                        end: end_ms,
                        index,
                        worker: served.worker,
                        cached: served.cached_tokens,
                        ttft: served.ttft_ms,
                    });
                    for &(next, gap_ms) in self.schedule.followers.get(&index).map_or(&[][..], Vec::as_slice) {
                        self.releases.push(Due {
                            at: end_ms + gap_ms,
                            index: next,
                        });
                    }
                }
            }
        }
    }
}
