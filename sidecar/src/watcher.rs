//! The sidecar's background loops, at the I/O edge: scraping each engine's
//! Prometheus metrics (load, capacity, restarts, health), re-resolving
//! workers given as DNS names, and ending idle sessions.

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::time::Duration;

use kvmesh_core::WorkerState;
use tracing::{info, warn};

use crate::clock::now_ms;
use crate::engine_metrics::{self, EngineSnapshot};
use crate::state::Shared;

/// A worker is marked down after this many failed scrapes in a row (one
/// slow scrape of a busy engine is no outage).
const FAILURES_BEFORE_DOWN: u32 = 2;

#[derive(Debug, Default)]
struct Seen {
    last: Option<EngineSnapshot>,
    failures: u32,
    /// A scrape has succeeded since the watcher started: until then one
    /// failure marks the worker down (an engine still loading its model is
    /// not picked), after it `FAILURES_BEFORE_DOWN` do.
    up_once: bool,
}

/// Scrapes every worker's metrics each `interval`, feeding the router.
pub(crate) async fn watch_engines(shared: Shared, interval: Duration, metrics_path: String) {
    let client = match reqwest::Client::builder()
        .no_proxy()
        .timeout(interval.clamp(Duration::from_millis(200), Duration::from_secs(2)))
        .build()
    {
        Ok(client) => client,
        Err(err) => {
            warn!("engine watcher disabled: cannot build an HTTP client: {err}");
            return;
        }
    };
    let mut seen: HashMap<String, Seen> = HashMap::new();
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let addresses: Vec<String> = shared
            .workers()
            .into_iter()
            .filter(|w| w.state != WorkerState::Removed)
            .map(|w| w.address)
            .collect();
        let scrapes = addresses.iter().map(|address| {
            let url = format!("http://{address}{metrics_path}");
            let client = client.clone();
            async move {
                let text = client.get(url).send().await?.error_for_status()?.text().await?;
                Ok::<_, reqwest::Error>(engine_metrics::parse(&text))
            }
        });
        let results = futures_util::future::join_all(scrapes).await;
        for (address, result) in addresses.into_iter().zip(results) {
            let state = seen.entry(address.clone()).or_default();
            apply_scrape(&shared, &address, state, result);
        }
    }
}

/// Feeds one scrape to the router. What it does there is decided from
/// `seen` first; `seen` changes only if the router still knows the worker.
fn apply_scrape(shared: &Shared, address: &str, seen: &mut Seen, result: Result<EngineSnapshot, reqwest::Error>) {
    let limit = if seen.up_once { FAILURES_BEFORE_DOWN } else { 1 };
    match result {
        Err(err) => {
            let marks_down = seen.failures + 1 == limit;
            if !shared.engine_unreachable(address, marks_down) {
                return;
            }
            seen.failures += 1;
            if marks_down {
                warn!(worker = address, "worker marked down: metrics unreachable ({err})");
                shared.metrics.observe_worker_event("down");
            }
        }
        Ok(snapshot) => {
            let restarted = seen
                .last
                .as_ref()
                .is_some_and(|before| engine_metrics::restarted(before, &snapshot));
            let Some(dropped) = shared.engine_scraped(address, &snapshot, restarted) else {
                return;
            };
            if seen.failures >= limit {
                info!(worker = address, "worker back up");
                shared.metrics.observe_worker_event("up");
            }
            seen.failures = 0;
            seen.up_once = true;
            if restarted {
                info!(
                    worker = address,
                    dropped, "engine restarted or reset its cache: its blocks are forgotten"
                );
                shared.metrics.observe_worker_event("restart");
            }
            seen.last = Some(snapshot);
        }
    }
}

/// Re-resolves `names` (HOST:PORT) every `interval`: new addresses become
/// workers, vanished ones are removed (static workers are never touched).
pub(crate) async fn resolve_workers(shared: Shared, names: Vec<String>, interval: Duration) {
    let mut known: BTreeSet<SocketAddr> = BTreeSet::new();
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let mut current = BTreeSet::new();
        let mut failed = false;
        for name in &names {
            match tokio::net::lookup_host(name.as_str()).await {
                Ok(addrs) => current.extend(addrs),
                Err(err) => {
                    warn!("cannot resolve worker name {name}: {err}; keeping the last answer");
                    failed = true;
                }
            }
        }
        if failed {
            continue;
        }
        let appeared: Vec<String> = current.difference(&known).map(ToString::to_string).collect();
        let vanished: Vec<String> = known.difference(&current).map(ToString::to_string).collect();
        let (added, removed) = shared.add_and_remove_workers(&appeared, &vanished);
        for (addr, id) in appeared.iter().zip(added) {
            info!(worker = %addr, id = id.0, "worker discovered");
        }
        for addr in removed {
            info!(worker = %addr, "worker gone from DNS: removed");
        }
        known = current;
    }
}

/// Ends sessions idle past their TTL, every `interval`.
pub(crate) async fn expire_sessions(shared: Shared, interval: Duration) {
    let mut ticker = tokio::time::interval(interval);
    loop {
        ticker.tick().await;
        let now = now_ms();
        // Both off the async workers: each is tens of ms of steps and
        // pauses at 100,000 sessions, and the gRPC streams share those
        // threads. An expiry that panicked ended nothing.
        let expiring = shared.clone();
        let ended = tokio::task::spawn_blocking(move || end_idle_sessions(&expiring, now))
            .await
            .unwrap_or(0);
        let ticking = shared.clone();
        let _ = tokio::task::spawn_blocking(move || ticking.tick_insights()).await;
        if ended > 0 {
            info!(ended, "idle sessions ended");
        }
    }
}

/// Ends every session idle past its TTL at `now`, one step of
/// [`kvmesh_core::EXPIRE_STEP`] sessions per hold of the router's lock;
/// returns how many it ended.
fn end_idle_sessions(shared: &Shared, now: u64) -> usize {
    let mut ended = 0;
    loop {
        let step = shared.expire_sessions_step(now);
        ended += step;
        if step < kvmesh_core::EXPIRE_STEP {
            return ended;
        }
        // Another step follows. Taken again at once, the lock (not fair)
        // would stay with this thread while the Picks it woke are still
        // being scheduled, and a mass expiry would hold them for all its
        // steps: the pause lets them in, as in the ledger's tick.
        crate::state::between_locks();
    }
}
