//! Shared state through Redis, for several sidecar replicas of one GPU
//! cluster and for warm restarts. Pick never waits on it: decisions are
//! applied in memory first and published by a background task.
//!
//! - Placements (worker, session, blocks) go to the stream `events`; every
//!   replica applies the others' entries.
//! - Session bindings are also kept as keys with the session TTL.
//! - A periodic snapshot (and one at shutdown) plus the stream after it
//!   restore a restarted replica.
//! - Every key is `kvmesh:v1:<cluster>:...`.
//!
//! Redis down: routing goes on from memory; events wait in a bounded backlog
//! and are published when Redis returns (a Redis that came back empty is
//! read again from its start), so the replicas converge.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::streams::StreamReadReply;
use tokio::sync::{mpsc, oneshot};
use tracing::{info, warn};

use crate::clock::now_ms;
use crate::snapshot::{decode_snapshot, encode_snapshot};
use crate::state::{Placement, PlacementSink, Shared};

/// Events kept while Redis is unreachable; older ones are dropped first.
const BACKLOG: usize = 100_000;
/// Entries kept in the stream (approximately): enough for a replica that
/// restarts between two snapshots to catch up.
const STREAM_MAXLEN: usize = 1_000_000;

/// What the publisher is asked to do, in order.
#[derive(Debug)]
enum Event {
    Place(Placement),
    /// Publish everything queued before this now (at shutdown); answered
    /// with the number of placements still unpublished.
    Flush(oneshot::Sender<usize>),
}

/// What the rest of the sidecar holds of the store.
#[derive(Clone)]
pub(crate) struct StoreHandle {
    events: mpsc::Sender<Event>,
    conn: ConnectionManager,
    keys: Arc<Keys>,
    last_id: Arc<Mutex<String>>,
}

impl std::fmt::Debug for StoreHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreHandle")
            .field("keys", &self.keys)
            .finish_non_exhaustive()
    }
}

impl PlacementSink for StoreHandle {
    /// Queues a placement for publication; never waits.
    fn publish(&self, placement: Placement) {
        // Full channel: the publisher is behind (Redis slow); the placement
        // stays in this replica's memory and the next snapshot carries it.
        let _ = self.events.try_send(Event::Place(placement));
    }
}

impl StoreHandle {
    /// Publishes every placement queued so far; returns how many could not
    /// be (Redis down), or `None` if the publisher is gone. The caller
    /// bounds the wait.
    pub(crate) async fn flush(&self) -> Option<usize> {
        let (tx, rx) = oneshot::channel();
        self.events.send(Event::Flush(tx)).await.ok()?;
        rx.await.ok()
    }

    /// Writes a snapshot now (at shutdown, so a restart is warm).
    pub(crate) async fn write_snapshot(&self, shared: &Shared) {
        write_snapshot(&self.conn, &self.keys, shared, &self.last_id).await;
    }
}

#[derive(Debug)]
struct Keys {
    events: String,
    snapshot: String,
    session_prefix: String,
}

impl Keys {
    fn new(cluster: &str) -> Self {
        let base = format!("kvmesh:v1:{cluster}:");
        Self {
            events: format!("{base}events"),
            snapshot: format!("{base}snapshot"),
            session_prefix: format!("{base}session:"),
        }
    }
}

/// A stream entry id, `ms-seq`, comparable.
fn parse_id(id: &str) -> (u64, u64) {
    let (ms, seq) = id.split_once('-').unwrap_or((id, "0"));
    (ms.parse().unwrap_or(0), seq.parse().unwrap_or(0))
}

async fn connect(url: &str, response_timeout: Duration) -> redis::RedisResult<ConnectionManager> {
    let client = redis::Client::open(url)?;
    let config = ConnectionManagerConfig::new()
        .set_response_timeout(Some(response_timeout))
        .set_connection_timeout(Some(Duration::from_secs(1)))
        .set_number_of_retries(2)
        .set_max_delay(Duration::from_secs(1));
    ConnectionManager::new_with_config(client, config).await
}

/// Connects, restores the latest snapshot and the stream after it into the
/// router, and starts the publisher, reader and snapshot tasks. Returns
/// `None` (memory only) when Redis cannot be reached at start.
pub(crate) async fn start(
    url: &str,
    cluster: &str,
    session_ttl: Duration,
    snapshot_every: Duration,
    shared: Shared,
) -> Option<StoreHandle> {
    let keys = Arc::new(Keys::new(cluster));
    let replica = format!("{}-{}", std::process::id(), now_ms());
    let (writer, reader) = match tokio::try_join!(
        connect(url, Duration::from_secs(2)),
        connect(url, Duration::from_secs(5))
    ) {
        Ok(pair) => pair,
        Err(err) => {
            warn!("redis {url} unreachable at start ({err}): state stays in memory for this run");
            return None;
        }
    };
    let last_id = Arc::new(Mutex::new(restore(&writer, &keys, &shared).await));
    let (tx, rx) = mpsc::channel(16 * 1024);
    tokio::spawn(publish(writer.clone(), keys.clone(), replica.clone(), session_ttl, rx));
    tokio::spawn(read(reader, keys.clone(), replica, shared.clone(), last_id.clone()));
    tokio::spawn(snapshots(
        writer.clone(),
        keys.clone(),
        shared,
        last_id.clone(),
        snapshot_every,
    ));
    info!(cluster, "sharing state through redis");
    Some(StoreHandle {
        events: tx,
        conn: writer,
        keys,
        last_id,
    })
}

/// Loads the snapshot, if any; returns the stream id to read on from.
async fn restore(conn: &ConnectionManager, keys: &Keys, shared: &Shared) -> String {
    let mut conn = conn.clone();
    let stored: redis::RedisResult<Option<Vec<u8>>> =
        redis::cmd("GET").arg(&keys.snapshot).query_async(&mut conn).await;
    match stored {
        Ok(Some(bytes)) => match decode_snapshot(&bytes) {
            Some((id, snapshot)) => {
                shared.restore_routing(&snapshot);
                let blocks: usize = snapshot.workers.iter().map(|(_, b)| b.len()).sum();
                info!(blocks, sessions = snapshot.sessions.len(), from = %id, "warm start from the redis snapshot");
                id
            }
            None => {
                warn!("the redis snapshot is unreadable: starting cold and replaying the stream");
                "0-0".to_owned()
            }
        },
        Ok(None) => "0-0".to_owned(),
        Err(err) => {
            warn!("cannot read the redis snapshot ({err}): replaying the stream");
            "0-0".to_owned()
        }
    }
}

async fn publish(
    mut conn: ConnectionManager,
    keys: Arc<Keys>,
    replica: String,
    session_ttl: Duration,
    mut rx: mpsc::Receiver<Event>,
) {
    let mut backlog: VecDeque<Placement> = VecDeque::new();
    let mut down = false;
    let mut flush: Option<oneshot::Sender<usize>> = None;
    fn take(event: Event, backlog: &mut VecDeque<Placement>, flush: &mut Option<oneshot::Sender<usize>>) {
        match event {
            Event::Place(p) => backlog.push_back(p),
            Event::Flush(reply) => *flush = Some(reply),
        }
    }
    loop {
        // Wait for work, or retry the backlog each second while Redis is down.
        if backlog.is_empty() {
            match rx.recv().await {
                Some(event) => take(event, &mut backlog, &mut flush),
                None => return,
            }
        } else if down {
            tokio::select! {
                received = rx.recv() => match received {
                    Some(event) => take(event, &mut backlog, &mut flush),
                    None => return,
                },
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        }
        while let Ok(event) = rx.try_recv() {
            take(event, &mut backlog, &mut flush);
        }
        while backlog.len() > BACKLOG {
            backlog.pop_front();
        }
        // A flush is answered once everything before it is out, or Redis
        // is down (the caller is shutting down and will not wait for it).
        if backlog.is_empty() || down {
            if let Some(reply) = flush.take() {
                let _ = reply.send(backlog.len());
            }
            if backlog.is_empty() {
                continue;
            }
        }
        let batch: Vec<Placement> = backlog.iter().take(512).cloned().collect();
        let mut pipe = redis::pipe();
        for p in &batch {
            let mut blocks = Vec::with_capacity(p.blocks.len() * 8);
            for b in &p.blocks {
                blocks.extend_from_slice(&b.to_le_bytes());
            }
            pipe.cmd("XADD")
                .arg(&keys.events)
                .arg("MAXLEN")
                .arg("~")
                .arg(STREAM_MAXLEN)
                .arg("*")
                .arg("r")
                .arg(&replica)
                .arg("w")
                .arg(&p.worker)
                .arg("s")
                .arg(&p.session)
                .arg("b")
                .arg(blocks)
                .ignore();
            if !p.session.is_empty() {
                pipe.cmd("SET")
                    .arg(format!("{}{}", keys.session_prefix, p.session))
                    .arg(&p.worker)
                    .arg("PX")
                    .arg(u64::try_from(session_ttl.as_millis()).unwrap_or(u64::MAX).max(1))
                    .ignore();
            }
        }
        match pipe.query_async::<()>(&mut conn).await {
            Ok(()) => {
                backlog.drain(..batch.len());
                if down {
                    info!(
                        pending = backlog.len(),
                        "redis is back: publishing what was decided meanwhile"
                    );
                    down = false;
                }
            }
            Err(err) => {
                if !down {
                    warn!(
                        "redis unavailable ({err}): routing from memory, {} events held",
                        backlog.len()
                    );
                    down = true;
                }
                if let Some(reply) = flush.take() {
                    let _ = reply.send(backlog.len());
                }
            }
        }
        if backlog.is_empty()
            && let Some(reply) = flush.take()
        {
            let _ = reply.send(0);
        }
    }
}

async fn read(
    mut conn: ConnectionManager,
    keys: Arc<Keys>,
    replica: String,
    shared: Shared,
    last_id: Arc<Mutex<String>>,
) {
    let mut failing = false;
    loop {
        let from = last_id.lock().map(|id| id.clone()).unwrap_or_else(|_| "0-0".to_owned());
        let reply: redis::RedisResult<Option<StreamReadReply>> = redis::cmd("XREAD")
            .arg("COUNT")
            .arg(1000)
            .arg("BLOCK")
            .arg(1000)
            .arg("STREAMS")
            .arg(&keys.events)
            .arg(&from)
            .query_async(&mut conn)
            .await;
        match reply {
            Err(_) => {
                failing = true;
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Ok(reply) => {
                if failing {
                    failing = false;
                    // A Redis that restarted empty numbers its stream from
                    // scratch: read it again from the start.
                    let newest: redis::RedisResult<Vec<redis::Value>> = redis::cmd("XREVRANGE")
                        .arg(&keys.events)
                        .arg("+")
                        .arg("-")
                        .arg("COUNT")
                        .arg(1)
                        .query_async(&mut conn)
                        .await;
                    let behind = match newest.ok().and_then(|v| v.into_iter().next()) {
                        None => true,
                        Some(entry) => newest_id(&entry).is_some_and(|id| parse_id(&id) < parse_id(&from)),
                    };
                    if behind {
                        info!("the redis stream restarted: reading it from its start");
                        if let Ok(mut id) = last_id.lock() {
                            *id = "0-0".to_owned();
                        }
                        continue;
                    }
                }
                let Some(reply) = reply else { continue };
                let now = now_ms();
                // Decoded before the router's lock, applied in one hold of
                // it; the id read on from moves past them only then, so a
                // snapshot never claims entries the router lacks.
                let mut placements = Vec::new();
                let mut newest = None;
                for key in reply.keys {
                    for entry in key.ids {
                        let mine = entry.get::<String>("r").is_some_and(|r| r == replica);
                        if !mine
                            && let (Some(worker), Some(blocks)) = (entry.get::<String>("w"), entry.get::<Vec<u8>>("b"))
                        {
                            let session = entry.get::<String>("s").unwrap_or_default();
                            let blocks: Vec<u64> = blocks
                                .chunks_exact(8)
                                .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                                .collect();
                            placements.push(Placement {
                                worker,
                                session,
                                blocks,
                            });
                        }
                        newest = Some(entry.id);
                    }
                }
                shared.observe_placements(&placements, now);
                if let Some(newest) = newest
                    && let Ok(mut id) = last_id.lock()
                {
                    *id = newest;
                }
            }
        }
    }
}

fn newest_id(entry: &redis::Value) -> Option<String> {
    match entry {
        redis::Value::Array(parts) => match parts.first()? {
            redis::Value::BulkString(id) => String::from_utf8(id.clone()).ok(),
            redis::Value::SimpleString(id) => Some(id.clone()),
            _ => None,
        },
        _ => None,
    }
}

async fn snapshots(
    conn: ConnectionManager,
    keys: Arc<Keys>,
    shared: Shared,
    last_id: Arc<Mutex<String>>,
    every: Duration,
) {
    let mut ticker = tokio::time::interval(every);
    ticker.tick().await;
    loop {
        ticker.tick().await;
        write_snapshot(&conn, &keys, &shared, &last_id).await;
    }
}

/// Writes the router's state with the stream id it covers.
async fn write_snapshot(conn: &ConnectionManager, keys: &Keys, shared: &Shared, last_id: &Mutex<String>) {
    let id = last_id.lock().map(|id| id.clone()).unwrap_or_else(|_| "0-0".to_owned());
    let snapshot = shared.routing_snapshot();
    let bytes = encode_snapshot(&id, &snapshot);
    let mut conn = conn.clone();
    let written: redis::RedisResult<()> = redis::cmd("SET")
        .arg(&keys.snapshot)
        .arg(bytes)
        .query_async(&mut conn)
        .await;
    if let Err(err) = written {
        warn!("cannot write the redis snapshot: {err}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_ids_compare_numerically() {
        assert!(parse_id("10-2") < parse_id("9-5").max(parse_id("10-3")));
        assert!(parse_id("9-9") < parse_id("10-0"));
        assert_eq!(parse_id("garbage"), (0, 0));
    }
}
