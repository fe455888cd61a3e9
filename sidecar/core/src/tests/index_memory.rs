//! Memory the index frees is used again: waves of sessions of the same
//! size, each pushing the previous one out of the workers' caches, hold
//! the index's heap where the first wave left it (the arena reuses freed
//! nodes through its free list; the hash table, refreshed when tombstones
//! fill it, never grows past the size the first wave needed).

use crate::{PrefixIndex, WorkerId, splitmix64 as hash};

const WORKERS: usize = 4;
const CAPACITY: usize = 50_000;
const SESSION_BLOCKS: u64 = 500;
/// Each wave places three times what the caches hold.
const WAVE_SESSIONS: u64 = (3 * CAPACITY * WORKERS) as u64 / SESSION_BLOCKS;

/// Places wave `wave`'s sessions (their own blocks, each request a longer
/// prefix of the session, as agents' calls grow); returns the index's
/// largest heap during the wave and its heap at the end.
fn wave(index: &mut PrefixIndex, wave: u64) -> (usize, usize) {
    let mut peak = 0;
    for s in 0..WAVE_SESSIONS {
        let session = wave * 1_000_000 + s;
        let blocks: Vec<u64> = (0..SESSION_BLOCKS).map(|i| hash(session * 1_000_003 + i)).collect();
        let worker = WorkerId((s as usize) % WORKERS);
        for calls in [SESSION_BLOCKS / 2, SESSION_BLOCKS] {
            index.insert(worker, &blocks[..calls as usize]);
            peak = peak.max(index.memory_bytes());
        }
    }
    (peak, index.memory_bytes())
}

#[test]
fn a_second_wave_of_sessions_reuses_the_memory_of_the_first() {
    let mut index = PrefixIndex::new();
    for _ in 0..WORKERS {
        index.add_worker(CAPACITY);
    }
    let (first_peak, first_end) = wave(&mut index, 1);
    assert_eq!(index.entries(), CAPACITY * WORKERS);
    for w in 2..=4 {
        let (peak, end) = wave(&mut index, w);
        assert_eq!(index.entries(), CAPACITY * WORKERS);
        assert!(peak <= first_peak, "wave {w}: peak {peak} > first wave's {first_peak}");
        assert!(
            end <= first_end,
            "wave {w}: {end} bytes at its end > first wave's {first_end}"
        );
    }
}
