//! A thread-local xorshift64* generator: a few instructions, no allocation, no shared state.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

/// Distinct seeds per thread so that threads do not draw in lockstep.
static SEED: AtomicU64 = AtomicU64::new(0x9E37_79B9_7F4A_7C15);

thread_local! {
    static STATE: Cell<u64> = const { Cell::new(0) };
}

fn fresh_seed() -> u64 {
    let s = SEED.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed);
    splitmix(s) | 1
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Seeds this thread's generator (used by the simulator for reproducible runs).
pub fn seed_thread_rng(seed: u64) {
    STATE.with(|s| s.set(splitmix(seed) | 1));
}

/// The next 64 random bits of this thread's generator.
#[inline]
pub fn thread_rng_u64() -> u64 {
    STATE.with(|s| {
        let mut x = s.get();
        if x == 0 {
            x = fresh_seed();
        }
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        s.set(x);
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    })
}
