//! Latency figures shared by the benchmarks: percentiles of sorted samples
//! and their units.

use std::time::Duration;

/// The `p` quantile (0..=1) of `sorted`, nearest rank; zero when empty.
pub(crate) fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let rank = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted.get(rank).copied().unwrap_or_default()
}

pub(crate) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

pub(crate) fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}
