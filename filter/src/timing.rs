//! Measurement builds only (`--features phase-timing`): microseconds spent
//! in each phase of a buffered request, summed into counters
//! (`kvmesh.time_us.<phase>`), so a benchmark can tell where the filter's
//! added latency goes. The shipped module has none of this.

use std::time::SystemTime;

#[cfg(feature = "phase-timing")]
use proxy_wasm::hostcalls;
#[cfg(feature = "phase-timing")]
use proxy_wasm::types::MetricType;

#[cfg(feature = "phase-timing")]
use kvmesh_vocab::FILTER_TIME_PHASES as PHASES;

#[derive(Debug, Clone, Copy)]
pub(crate) enum Phase {
    /// Headers to the end-of-stream body callback (the body arriving).
    Arrive,
    /// Body callbacks before the last one (feeding the chunked state).
    Chunks,
    /// Feeding the last chunk, in the end-of-stream callback.
    LastFeed,
    /// Reading body bytes from Envoy (every callback).
    Read,
    /// Understanding at the last callback (finish or one-shot).
    Understand,
    /// Building, encoding and sending the Pick.
    EncodeSend,
    /// The Pick sent to its reply received.
    Wait,
    /// Setting the destination and resuming the request.
    Resume,
    /// The request resumed to its response headers.
    AfterResume,
    Requests,
}

// `Phase` indexes the counter names: one name per phase, in its order.
#[cfg(feature = "phase-timing")]
const _: () = assert!(Phase::Requests as usize + 1 == PHASES.len());

#[cfg(feature = "phase-timing")]
thread_local! {
    static IDS: [Option<u32>; PHASES.len()] =
        PHASES.map(|p| hostcalls::define_metric(MetricType::Counter, &format!("kvmesh.time_us.{p}")).ok());
}

/// A point in time to measure a phase from (nothing without the feature).
pub(crate) type Stamp = Option<SystemTime>;

#[cfg(feature = "phase-timing")]
pub(crate) fn now() -> Stamp {
    hostcalls::get_current_time().ok()
}

#[cfg(not(feature = "phase-timing"))]
pub(crate) fn now() -> Stamp {
    None
}

/// Adds the time since `since` to `phase`.
pub(crate) fn add(phase: Phase, since: Stamp) {
    if let (Some(since), Some(now)) = (since, now()) {
        let us = now.duration_since(since).map_or(0, |d| d.as_micros());
        add_n(phase, u64::try_from(us).unwrap_or(0));
    }
}

#[cfg(feature = "phase-timing")]
pub(crate) fn add_n(phase: Phase, n: u64) {
    IDS.with(|ids| {
        if let Some(Some(id)) = ids.get(phase as usize) {
            let _ = hostcalls::increment_metric(*id, i64::try_from(n).unwrap_or(0));
        }
    });
}

#[cfg(not(feature = "phase-timing"))]
pub(crate) fn add_n(_phase: Phase, _n: u64) {}
