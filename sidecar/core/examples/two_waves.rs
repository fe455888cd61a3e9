//! The routing core's live heap over waves of agent sessions (three by
//! default), as the scale bench drives the sidecar (`kvmesh-bench scale`):
//! 64 workers, a wave of sessions whose calls resend a growing prefix,
//! every session expired, then a wave of as many new ones, and so on. Counted by dhat's
//! allocator, which tracks live bytes, so the figures are the core's own and
//! not the allocator's retained pages: `cargo run --release -p kvmesh-core
//! --example two_waves [-- SESSIONS [ledger|no-ledger [WAVES]]]`.

use kvmesh_core::{
    Call, Harness, InsightConfig, Insights, Outcome, PickInput, Router, RouterConfig, splitmix64 as hash,
};

#[global_allocator]
static ALLOCATOR: dhat::Alloc = dhat::Alloc;

const WORKERS: usize = 64;
const CAPACITY_BLOCKS: usize = 32_768;
const TTL_MS: u64 = 60_000;
/// The scale bench's shape: shared blocks, a session's first blocks, what
/// each call adds.
const SHARED_BLOCKS: u64 = 8;
const FIRST_BLOCKS: u64 = 24;
const BLOCKS_PER_CALL: u64 = 3;
const CALLS: u64 = 8;

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

struct Fleet {
    router: Router,
    insights: Option<Insights>,
    now_ms: u64,
}

impl Fleet {
    fn call(&mut self, wave: u64, session: u64, call: u64) {
        let key = (wave << 40) | session;
        let own = FIRST_BLOCKS + call * BLOCKS_PER_CALL;
        let hashes: Vec<u64> = (0..SHARED_BLOCKS)
            .map(|i| hash(u64::MAX - i))
            .chain((0..own).map(|i| hash(key * 1_000_003 + i)))
            .collect();
        let id = format!("agent-{wave}-{session}");
        let call = Call {
            input: PickInput {
                block_hashes: &hashes,
                block_bytes: 256,
                prompt_bytes: hashes.len() as u64 * 256,
                session_id: &id,
                model: "m",
                now_ms: self.now_ms,
                ..PickInput::default()
            },
            harness: Harness::ClaudeCode,
            tenant: "t",
            sections: &[],
        };
        let probe = self.insights.as_ref().and_then(|l| l.probe(&call));
        let d = self.router.pick(call.input);
        let holdings = self.router.holdings(probe.as_slice());
        if let Some(insights) = &mut self.insights {
            insights.on_pick(&call, &d, &holdings);
            insights.on_outcome(d.pick_id, None, None, d.chosen(), self.now_ms);
        }
        self.router.report_at(
            Outcome {
                pick_id: d.pick_id,
                ..Outcome::default()
            },
            self.now_ms,
        );
        self.now_ms += 1;
    }

    fn wave(&mut self, wave: u64, sessions: u64) {
        for call in 0..CALLS {
            for s in 0..sessions {
                self.call(wave, s, call);
            }
        }
    }

    fn expire(&mut self) {
        self.now_ms += 2 * TTL_MS;
        while self.router.expire_sessions(self.now_ms) > 0 {}
        if let Some(insights) = &mut self.insights {
            insights.tick(self.now_ms, &self.router.holdings(&[]));
        }
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let sessions: u64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(100_000);
    let ledger = args.next().is_none_or(|a| a != "no-ledger");
    let waves: u64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(3);
    // `DHAT_SITES=1`: also write dhat-heap.json, the live bytes of every
    // allocation site at the end (dh_view.html reads it).
    let _profiler = if std::env::var_os("DHAT_SITES").is_some() {
        dhat::Profiler::new_heap()
    } else {
        dhat::Profiler::builder().testing().build()
    };
    let mut fleet = Fleet {
        router: Router::new(
            RouterConfig {
                worker_capacity_blocks: CAPACITY_BLOCKS,
                session_ttl_ms: TTL_MS,
                ..RouterConfig::default()
            },
            (0..WORKERS).map(|w| format!("10.0.0.{w}:8000")),
        ),
        insights: ledger.then(|| {
            Insights::new(InsightConfig {
                session_ttl_ms: TTL_MS,
                ..InsightConfig::default()
            })
        }),
        now_ms: 1,
    };
    let report = |what: &str, fleet: &Fleet| {
        let stats = dhat::HeapStats::get();
        println!(
            "{what:>16}: live {:8.1} MiB in {:9} blocks, peak so far {:8.1} MiB; index {:8.1} MiB",
            mib(stats.curr_bytes),
            stats.curr_blocks,
            mib(stats.max_bytes),
            mib(fleet.router.index().memory_bytes()),
        );
    };
    println!("{sessions} sessions x {CALLS} calls, {WORKERS} workers, ledger {ledger}");
    for wave in 1..=waves {
        fleet.wave(wave, sessions);
        report(&format!("wave {wave}"), &fleet);
        if wave < waves {
            fleet.expire();
            report(&format!("wave {wave} expired"), &fleet);
        }
    }
    println!(
        "index entries {}, sessions {}, retention deadlines {}",
        fleet.router.index().entries(),
        fleet.router.sessions().len(),
        fleet.router.sessions().pending_deadlines()
    );
    // Kept to the end, so that dhat's t-end shows what the core holds.
    std::mem::forget(fleet);
}
