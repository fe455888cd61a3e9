//! The kvmesh routing core: where should this request go? Pure and
//! synchronous: no clock, no I/O, no async. The sidecar owns one `Router` and
//! feeds it Picks and Outcomes; the benchmark drives the very same code.
#![forbid(unsafe_code)]

mod lru;
mod router;

pub use lru::Lru;
pub use router::{Decision, Outcome, PickInput, Reason, Router, RouterConfig, WorkerId, WorkerView};

#[cfg(test)]
mod tests;
