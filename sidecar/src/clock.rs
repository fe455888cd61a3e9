//! The sidecar's one clock. The routing core takes time as an argument;
//! every edge that hands it a time reads it here.

/// Wall-clock milliseconds, not a monotonic clock: session TTLs are shared
/// with the other replicas through Redis, so every replica must count from
/// the same epoch.
pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}
