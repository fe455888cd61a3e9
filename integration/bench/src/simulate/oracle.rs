//! `kvmesh_oracle`: kvmesh's own router fed the engines' true overlaps
//! instead of its prefix index's estimate (`Router::pick_with_overlaps`,
//! the hook a precise mode would use), everything else as `kvmesh`. The
//! gap between the two is what the index's approximation costs.

use std::collections::HashMap;

use kvmesh_core::{Outcome, Router, RouterConfig, WorkerId};

use super::policies::Policy;
use super::world::{Prepared, View};

pub(crate) struct KvmeshOracle {
    router: Router,
    picks: HashMap<usize, u64>,
}

impl KvmeshOracle {
    /// The router exactly as the `kvmesh` policy builds it.
    pub(crate) fn new(workers: usize, capacity_tokens: u64, prefill_rate: f64) -> Self {
        let mut router = Router::new(
            RouterConfig {
                default_prefill_tokens_per_ms: prefill_rate,
                ..RouterConfig::default()
            },
            (0..workers).map(|w| format!("10.0.{}.{}:8000", w / 256, w % 256)),
        );
        for w in 0..workers {
            router.set_engine_capacity_tokens(WorkerId(w), capacity_tokens);
        }
        Self {
            router,
            picks: HashMap::new(),
        }
    }
}

impl Policy for KvmeshOracle {
    fn pick(&mut self, r: &Prepared, view: &View<'_>) -> usize {
        let overlaps: Vec<(WorkerId, usize)> = (0..view.workers())
            .map(|w| (WorkerId(w), view.true_cached_blocks(w, r)))
            .collect();
        let d = self.router.pick_with_overlaps(r.pick_input(view.now as u64), &overlaps);
        self.picks.insert(r.index, d.pick_id);
        d.ranked.first().map_or(0, |w| w.0)
    }

    fn completed(&mut self, _worker: usize, r: &Prepared, cached_tokens: u64, ttft_ms: f64) {
        if let Some(pick_id) = self.picks.remove(&r.index) {
            self.router.report(Outcome {
                pick_id,
                prompt_tokens: Some(r.prompt_tokens),
                cached_tokens: Some(cached_tokens),
                ttfb_ms: ttft_ms.round() as u32,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use kvmesh_request::FilterConfig;
    use kvmesh_sim::timing::TimingModel;

    use super::*;
    use crate::simulate::trace::Request;
    use crate::simulate::world::{World, prepare};

    fn request(index: usize, session: &str, text: &str) -> Prepared {
        let r = Request {
            at_ms: 0.0,
            session: session.to_owned(),
            parent: String::new(),
            text: text.to_owned(),
            output_tokens: 1,
        };
        prepare(index, &r, &FilterConfig::default()).unwrap()
    }

    /// The index believes the prefix is where kvmesh sent it; the engine
    /// that really holds it is another. The oracle follows the engine.
    #[test]
    fn the_oracle_follows_the_engines_cache_not_the_index() {
        let mut world = World::new(3, 1_000_000, TimingModel::default());
        let mut oracle = KvmeshOracle::new(3, 1_000_000, 20.0);
        let doc = "shared tool schemas and a long repository context ".repeat(200);
        let first = request(0, "a", &doc);
        let believed = oracle.pick(&first, &world.view(0.0));
        // Served elsewhere (as if the pick had failed over).
        let elsewhere = (believed + 1) % 3;
        let served = world.serve(elsewhere, &first, 0.0);
        oracle.completed(elsewhere, &first, served.cached_tokens, served.ttft_ms);
        let next = request(1, "b", &(doc + " and one more turn"));
        assert_eq!(oracle.pick(&next, &world.view(60_000.0)), elsewhere);
    }
}
