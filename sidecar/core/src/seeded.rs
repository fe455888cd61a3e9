//! `splitmix64`: the seeded, dependency-free mix the workspace's tests,
//! benches and examples draw block hashes and choices from (one home: it
//! was written out five times).

/// splitmix64's output function of `seed`: uniform, and fixed by the seed.
pub fn splitmix64(seed: u64) -> u64 {
    let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
