//! `kvmesh_oracle`: kvmesh improved by rollout. At each call it tries every
//! worker: places the call there, plays the rest of the workload forward on
//! a copy of the whole run (engines, queues, calls not yet sent, kvmesh's
//! router) with kvmesh picking every later call, and keeps the worker whose
//! run computes the fewest prompt tokens, then has the least total TTFT;
//! ties keep kvmesh's own choice. Every term is the world's own outcome:
//! the queues as they will run, the evictions as they will happen, the
//! arrivals as the closed loop will send them.
//!
//! Kvmesh's own choice is among those tried and the run is deterministic,
//! so the oracle never computes more prefill than kvmesh (rollout's cost
//! improvement: each step's chosen continuation costs at most kvmesh's from
//! there, and kvmesh's continuation from the next step is one of the next
//! step's candidates). It is an upper bound on what kvmesh's choices could
//! reach one call at a time, not on every policy: the pooled Belady bound
//! (`bound`) is that. Its price is a whole replay per worker per call.

use super::Fleet;
use super::play::Play;
use super::policies::{self, Kvmesh, Policy};
use super::world::Prepared;
use kvmesh_sim::timing::TimingModel;

/// The policy name.
pub(crate) const NAME: &str = "kvmesh_oracle";

/// kvmesh, and the rollout that overrides its picks.
pub(crate) struct Rollout {
    kvmesh: Kvmesh,
    workers: usize,
}

impl Rollout {
    /// The worker whose continuation costs least, from `play` just before
    /// `r` is sent at `now`; kvmesh records `r` there.
    fn choose(&mut self, r: &Prepared, play: &Play<'_>, now: f64) -> usize {
        let own = self.kvmesh.clone().pick(r, &play.world.view(now)).min(self.workers - 1);
        let (workers, base) = (self.workers, &self.kvmesh);
        let cost_of = |w: usize| {
            let (mut play, mut kvmesh) = (play.clone(), base.clone());
            kvmesh.place_on(r, now, w);
            play.send(r, w, now);
            while let Some((next, at)) = play.next_call(&mut kvmesh, |_| {}) {
                let x = kvmesh.pick(next, &play.world.view(at)).min(workers - 1);
                play.send(next, x, at);
            }
            play.cost()
        };
        let cost_of = &cost_of;
        let threads = std::thread::available_parallelism().map_or(1, usize::from).min(workers);
        let mut costs: Vec<(usize, (u64, f64))> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    scope.spawn(move || {
                        (t..workers)
                            .step_by(threads)
                            .map(|w| (w, cost_of(w)))
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            // A rollout that panicked is a bug to see, not a candidate to
            // drop: without kvmesh's own, the guarantee would not hold.
            handles
                .into_iter()
                .flat_map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
                .collect()
        });
        costs.sort_by(|(a, ca), (b, cb)| {
            ca.0.cmp(&cb.0)
                .then(ca.1.total_cmp(&cb.1))
                .then((*a != own).cmp(&(*b != own)))
                .then(a.cmp(b))
        });
        let best = costs.first().map_or(own, |&(w, _)| w);
        self.kvmesh.place_on(r, now, best);
        best
    }
}

/// Who picks a run's workers: a policy, or the oracle's rollout.
pub(crate) enum Picker {
    Policy(Box<dyn Policy>),
    Oracle(Box<Rollout>),
}

impl Picker {
    /// `None` for a name no policy has.
    pub(crate) fn make(name: &str, fleet: Fleet, seed: u64, timing: TimingModel) -> Option<Self> {
        if name == NAME {
            return Some(Self::Oracle(Box::new(Rollout {
                kvmesh: policies::kvmesh(fleet.workers, fleet.capacity_tokens, timing.prefill_tokens_per_ms),
                workers: fleet.workers.max(1),
            })));
        }
        policies::make(
            name,
            fleet.workers,
            fleet.capacity_tokens,
            seed,
            timing.prefill_tokens_per_ms,
        )
        .map(Self::Policy)
    }

    /// The policy that hears of completions and of the fleet.
    pub(crate) fn policy(&mut self) -> &mut dyn Policy {
        match self {
            Self::Policy(p) => p.as_mut(),
            Self::Oracle(o) => &mut o.kvmesh,
        }
    }

    /// The worker for `r`, sent at `now` from `play`'s state.
    pub(crate) fn pick(&mut self, r: &Prepared, play: &Play<'_>, now: f64) -> usize {
        match self {
            Self::Policy(p) => p.pick(r, &play.world.view(now)),
            Self::Oracle(o) => o.choose(r, play, now),
        }
    }
}
