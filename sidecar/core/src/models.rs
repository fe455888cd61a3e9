//! What the router learns per model (bytes per token), bounded. The model
//! name comes from the client, so every distinct name must not cost memory
//! for the life of the process.

use hashbrown::HashMap;

use crate::router::learning::{RATE_KEEP, RATE_LEARN};

/// Learned bytes per token, for at most `capacity` models: a model taught
/// when the table is full replaces the one taught least recently. A
/// forgotten model falls back to the router's default until its outcomes
/// teach it again (a few calls), so the bound costs accuracy, never
/// correctness. Memory is at most `capacity` × (a name of
/// `kvmesh_vocab::limits::MAX_ID_BYTES` + 40 bytes).
#[derive(Debug, Clone)]
pub(crate) struct ModelRates {
    capacity: usize,
    clock: u64,
    /// Model → (bytes per token, when it was last taught).
    rates: HashMap<String, (f64, u64)>,
}

impl ModelRates {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            clock: 0,
            rates: HashMap::new(),
        }
    }

    pub(crate) fn get(&self, model: &str) -> Option<f64> {
        self.rates.get(model).map(|(rate, _)| *rate)
    }

    /// Moves the model's rate towards `observed` (the first observation is
    /// taken as is).
    pub(crate) fn learn(&mut self, model: &str, observed: f64) {
        self.clock += 1;
        if let Some((rate, at)) = self.rates.get_mut(model) {
            *rate = RATE_KEEP * *rate + RATE_LEARN * observed;
            *at = self.clock;
            return;
        }
        if self.rates.len() >= self.capacity {
            // A scan, not a second ordered structure kept in sync: it runs
            // only when a new model arrives at a full table, over at most
            // `capacity` entries.
            let oldest = self
                .rates
                .iter()
                .min_by_key(|(_, (_, at))| *at)
                .map(|(name, _)| name.clone());
            if let Some(oldest) = oldest {
                self.rates.remove(&oldest);
            }
        }
        self.rates.insert(model.to_owned(), (observed, self.clock));
    }

    pub(crate) fn len(&self) -> usize {
        self.rates.len()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::float_cmp)]

    use super::*;

    #[test]
    fn a_full_table_forgets_the_model_taught_least_recently() {
        let mut rates = ModelRates::new(2);
        rates.learn("a", 4.0);
        rates.learn("b", 3.0);
        rates.learn("a", 4.0);
        rates.learn("c", 2.0);
        assert_eq!(rates.len(), 2);
        assert_eq!(rates.get("b"), None);
        assert_eq!(rates.get("a"), Some(4.0));
        assert_eq!(rates.get("c"), Some(2.0));
    }
}
