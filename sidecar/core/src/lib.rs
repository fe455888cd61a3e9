//! The kvmesh routing core: where should this request go? Pure and
//! synchronous: no clock (time comes in as `now_ms`), no I/O, no async. The
//! sidecar owns one `Router` and feeds it Picks, Outcomes and engine
//! signals; the benchmark drives the very same code.
//!
//! Layout: `router` decides (and depends on `index`, `sessions`,
//! `lineage`, `models`, `usage`, `lru`); `insight` is the ledger, a
//! consumer downstream of the router that reads only its public record
//! types (`Decision`, `Holdings`). Nothing the router is made of imports
//! `insight`.
#![forbid(unsafe_code)]

mod index;
mod insight;
mod lineage;
mod lru;
mod models;
pub mod retention;
mod router;
mod seeded;
mod sessions;
mod usage;

pub use index::{PrefixIndex, Walk};
pub use insight::{
    BreakPoint, BreakStats, Call, Figure, Figures, Harness, IDLE_LIST_MAX, IdleSession, InsightConfig, Insights,
    LabelId, Lane, MoveReason, NO_TENANT, OTHER_TENANT, PromptSection, Report, Retention, SectionKind, SessionLanes,
    TickPass, TickSnapshot, TickStep, Totals,
};
pub use lineage::{MAX_TRACE_CARRIERS, TraceId};
pub use lru::{Lru, LruMap};
pub use router::{
    Cost, Decision, EngineCacheChange, EngineCacheEffect, Holdings, Outcome, ParentSource, PickInput, Reason, Router,
    RouterConfig, Snapshot, WorkerId, WorkerLoad, WorkerState, WorkerView,
};
pub use seeded::splitmix64;
pub use sessions::{EXPIRE_STEP, SessionId, SessionStore};
pub use usage::{MAX_BYTES_PER_TOKEN, TEMPLATE_TOKENS, UsageError, check_usage};

#[cfg(test)]
mod tests;
