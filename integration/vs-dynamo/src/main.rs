//! kvmesh's prefix lookup and Pick beside Dynamo's KV indexer
//! (`dynamo-kv-router` 1.6.1, its published crate), on
//! the same requests in one process, one request at a time on one thread:
//! `cargo run --release --manifest-path integration/vs-dynamo/Cargo.toml` (`--quick`: fewer
//! sessions and requests). Results in docs/benchmarks.md.
//!
//! Each row fills both indexes with the same sessions (session `s` on
//! worker `s mod W`; with a shared prefix, every session starts with the
//! same `shared` blocks, a fleet's common system prompt and tools, so every
//! worker holds them) and times the same requests: a session's cached
//! blocks plus 20 new ones (an agent's next call).
//!
//! - Dynamo: `RadixTree` (`src/indexer/radix_tree.rs`), filled by
//!   `apply_event` with one `Stored` event per session (each block's
//!   `tokens_hash` our block hash, its `block_hash` Dynamo's rolling hash
//!   of them, `compute_seq_hash_for_block`), timed on
//!   `find_matches(sequence, early_exit = false)` as the router calls it;
//!   the sequence is cloned before the clock starts (Dynamo's own
//!   microbench does the same).
//! - kvmesh lookup: `PrefixIndex::overlaps_by_tier`, the call `Router::pick`
//!   makes, on an index filled as the router's (a worker each, then the
//!   session's blocks); both return each worker's count of leading matched
//!   blocks.
//! - kvmesh Pick: the whole `Router::pick` (lookup, every worker's cost,
//!   the record and the placement), reported after each as the sidecar does.

use std::time::{Duration, Instant};

use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheStoreData, KvCacheStoredBlockData,
    LocalBlockHash, RouterEvent, compute_seq_hash_for_block,
};
use dynamo_kv_router::radix_tree::RadixTree;
use kvmesh_core::{Outcome, PickInput, PrefixIndex, Router, RouterConfig, WorkerId, splitmix64 as hash};

/// Blocks of each session, shared prefix included.
const SESSION_BLOCKS: u64 = 1600;
/// Blocks an agent's next call adds to its cached prefix.
const NEW_BLOCKS: u64 = 20;

fn session_blocks(session: u64, shared: u64, n: u64) -> Vec<u64> {
    (0..n)
        .map(|i| {
            if i < shared {
                hash(u64::MAX / 2 + i)
            } else {
                hash(session * 1_000_003 + i)
            }
        })
        .collect()
}

fn dynamo_event(worker: u64, event_id: u64, blocks: &[u64]) -> RouterEvent {
    let local: Vec<LocalBlockHash> = blocks.iter().map(|&b| LocalBlockHash(b)).collect();
    let sequence = compute_seq_hash_for_block(&local);
    let stored = local
        .iter()
        .zip(sequence)
        .map(|(&tokens_hash, s)| KvCacheStoredBlockData {
            block_hash: ExternalSequenceBlockHash(s),
            tokens_hash,
            mm_extra_info: None,
        })
        .collect();
    RouterEvent::new(
        worker,
        KvCacheEvent {
            event_id,
            data: KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash: None,
                start_position: None,
                blocks: stored,
            }),
            dp_rank: 0,
        },
    )
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted
        .get(((sorted.len().saturating_sub(1)) as f64 * p).round() as usize)
        .copied()
        .unwrap_or_default()
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// One row: `sessions` sessions over `workers`, each starting with
/// `shared` common blocks; `requests` timed after 100 untimed.
fn row(workers: usize, shared: u64, sessions: u64, requests: u64) {
    let addresses: Vec<String> = (0..workers)
        .map(|w| format!("10.{}.{}.{}:8000", w / 65536, (w / 256) % 256, w % 256))
        .collect();
    let mut router = Router::new(
        RouterConfig {
            worker_capacity_blocks: (sessions as usize / workers + 2) * SESSION_BLOCKS as usize * 2,
            max_sessions: 1_000_000,
            ..RouterConfig::default()
        },
        addresses.iter().cloned(),
    );
    let mut tree = RadixTree::new();
    let mut index = PrefixIndex::new();
    for _ in 0..workers {
        index.add_worker(router.config().worker_capacity_blocks);
    }
    for s in 0..sessions {
        let blocks = session_blocks(s, shared, SESSION_BLOCKS);
        let w = (s as usize) % workers;
        router.observe_placement(&addresses[w], &blocks, &format!("s{s}"), 0);
        index.insert(WorkerId(w), &blocks);
        if tree.apply_event(dynamo_event(w as u64, s, &blocks)).is_err() {
            eprintln!("Dynamo refused session {s}'s event");
        }
    }
    let entries = index.entries();
    let bytes_per_entry = index.memory_bytes() as f64 / entries.max(1) as f64;
    let (mut lookup, mut dynamo, mut pick) = (Vec::new(), Vec::new(), Vec::new());
    let mut overlaps = Vec::new();
    let mut host = Vec::new();
    let mut agree = true;
    for i in 0..requests + 100 {
        let s = hash(i) % sessions;
        let mut hashes = session_blocks(s, shared, SESSION_BLOCKS - NEW_BLOCKS);
        hashes.extend((0..NEW_BLOCKS).map(|k| hash(u64::MAX / 3 + i * 64 + k)));
        let sequence: Vec<LocalBlockHash> = hashes.iter().map(|&b| LocalBlockHash(b)).collect();

        let started = Instant::now();
        let scores = tree.find_matches(sequence, false);
        let dynamo_took = started.elapsed();

        // The index's own view of the request's full blocks, as Pick reads it.
        let full = &hashes[..hashes.len() - 1];
        let started = Instant::now();
        index.overlaps_by_tier(full, &mut overlaps, Some(&mut host));
        let lookup_took = started.elapsed();
        let home = s as usize % workers;
        let ours = overlaps.get(home).copied().unwrap_or(0);
        let theirs = scores
            .scores
            .iter()
            .filter(|(k, _)| k.worker_id == home as u64)
            .map(|(_, v)| *v as usize)
            .max()
            .unwrap_or(0);
        agree &= ours == theirs;

        let input = PickInput {
            block_hashes: &hashes,
            block_bytes: 256,
            prompt_bytes: hashes.len() as u64 * 256,
            session_id: "",
            now_ms: 1000 + i,
            ..PickInput::default()
        };
        let started = Instant::now();
        let d = router.pick(input);
        let pick_took = started.elapsed();
        router.report(Outcome {
            pick_id: d.pick_id,
            ..Outcome::default()
        });
        if i >= 100 {
            dynamo.push(dynamo_took);
            lookup.push(lookup_took);
            pick.push(pick_took);
        }
    }
    for v in [&mut dynamo, &mut lookup, &mut pick] {
        v.sort();
    }
    let (d99, l99) = (percentile(&dynamo, 0.99), percentile(&lookup, 0.99));
    println!(
        "| {workers} | {shared} | {entries} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2}x | {:.1} | {:.1} | {bytes_per_entry:.1} | {} |",
        micros(percentile(&dynamo, 0.5)),
        micros(d99),
        micros(percentile(&lookup, 0.5)),
        micros(l99),
        l99.as_secs_f64() / d99.as_secs_f64().max(1e-12),
        micros(percentile(&pick, 0.5)),
        micros(percentile(&pick, 0.99)),
        if agree { "yes" } else { "NO" },
    );
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let (requests, per_worker) = if quick { (200, 2) } else { (2000, 4) };
    println!(
        "| workers | shared blocks | kvmesh entries | Dynamo find_matches p50 µs | p99 | kvmesh lookup p50 µs | p99 | lookup p99 / Dynamo's | kvmesh Pick p50 µs | p99 | bytes per entry | same overlaps |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for workers in [64usize, 512] {
        for shared in [0u64, 100, 500] {
            row(workers, shared, (workers * per_worker) as u64, requests);
        }
    }
}
