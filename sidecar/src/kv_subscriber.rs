//! The KV event edge: one ZeroMQ SUB socket per worker, bound where that
//! worker's engine publishes (vLLM *connects* its PUB to a plain
//! `tcp://host:port`), each message decoded by `kv_events` and applied to
//! the router. A message that does not decode is counted and dropped; a
//! break in the sequence is counted and resynced (see `kv_events::Gap`):
//! never a crash, and never a wait on the request path.

use std::net::SocketAddr;

use kvmesh_core::EngineCacheChange;
use tracing::{debug, info, warn};
use zeromq::{Socket, SocketRecv, SubSocket};

use crate::kv_events::{self, EngineCache, Gap};
use crate::state::Shared;

/// Binds every worker's SUB socket, then reads each in its own task.
/// Returns each worker with the endpoint actually bound (port 0 becomes a
/// free port), so `serve` can print them.
pub(crate) async fn start(
    shared: &Shared,
    subscriptions: &[(SocketAddr, SocketAddr)],
) -> anyhow::Result<Vec<(SocketAddr, String)>> {
    let mut bound = Vec::new();
    for &(worker, bind) in subscriptions {
        let mut socket = SubSocket::new();
        let endpoint = socket
            .bind(&format!("tcp://{bind}"))
            .await
            .map_err(|err| anyhow::anyhow!("binding KV events of {worker} on tcp://{bind}: {err}"))?;
        socket
            .subscribe("")
            .await
            .map_err(|err| anyhow::anyhow!("subscribing to KV events of {worker}: {err}"))?;
        let endpoint = endpoint.to_string();
        info!(worker = %worker, endpoint, "reading KV events");
        bound.push((worker, endpoint));
        tokio::spawn(read(shared.clone(), worker.to_string(), socket));
    }
    Ok(bound)
}

async fn read(shared: Shared, worker: String, mut socket: SubSocket) {
    let mut cache = EngineCache::new();
    loop {
        let message = tokio::select! {
            () = shared.shutdown.cancelled() => return,
            message = socket.recv() => message,
        };
        let message = match message {
            Ok(message) => message,
            Err(err) => {
                // A peer gone or a broken frame: the socket goes on.
                debug!(worker, "KV event socket: {err}");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let frames = message.into_vec();
        let refs: Vec<&[u8]> = frames.iter().map(AsRef::as_ref).collect();
        let batch = match kv_events::decode(&refs) {
            Ok(batch) => batch,
            Err(err) => {
                // Debug, not warn: whoever reaches the port could flood the log.
                debug!(worker, "KV event message refused: {err}");
                shared.metrics.observe_kv_error(&worker);
                continue;
            }
        };
        let applied = cache.apply(&batch);
        match applied.gap {
            Some(Gap::Missed { missed }) => warn!(
                worker,
                missed, "KV events lost: the engine's resident count restarts from what comes next"
            ),
            Some(Gap::Restarted) => info!(
                worker,
                seq = batch.seq,
                "KV event sequence went back: the engine restarted, its blocks are forgotten"
            ),
            None => {}
        }
        let change = EngineCacheChange {
            stored_blocks: applied.stored_blocks,
            removed_blocks: applied.removed_blocks,
            engine_block_tokens: applied.block_tokens.unwrap_or(0),
            cleared: applied.cleared || applied.gap == Some(Gap::Restarted),
            resident_blocks: cache.exact().then(|| cache.resident_blocks()),
            host_tier: applied.host_tier,
            removed_to_host_blocks: applied.removed_to_host_blocks,
            host_only_removed_blocks: applied.host_only_removed_blocks,
            host_only_blocks: (applied.host_tier && cache.exact()).then(|| cache.host_only_blocks()),
        };
        let Some(effect) = shared.apply_kv_events(&worker, &change) else {
            continue;
        };
        if effect.wiped > 0 {
            info!(
                worker,
                dropped = effect.wiped,
                "engine cleared its cache: its blocks are forgotten"
            );
        }
        shared
            .metrics
            .observe_kv_batch(&worker, effect.evicted, applied.gap.is_some());
    }
}
