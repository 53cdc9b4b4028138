//! A coarse monotonic clock for the fail-open check. Reading the OS clock costs about as much
//! as a whole decision, so each thread reads it once every `REFRESH` decisions and otherwise
//! reuses its cached value; the staleness bound is seconds, so the error does not matter.

use std::cell::Cell;
use std::sync::OnceLock;
use std::time::Instant;

static EPOCH: OnceLock<Instant> = OnceLock::new();

const REFRESH: u32 = 64;

thread_local! {
    static CACHED: Cell<(u32, u64)> = const { Cell::new((0, 0)) };
}

/// Milliseconds since a process-wide epoch (monotonic).
pub fn now_ms() -> u64 {
    EPOCH.get_or_init(Instant::now).elapsed().as_millis() as u64
}

/// `now_ms`, refreshed every `REFRESH` calls on this thread.
#[inline]
pub(crate) fn coarse_now_ms() -> u64 {
    CACHED.with(|c| {
        let (n, t) = c.get();
        if n == 0 {
            let t = now_ms();
            c.set((REFRESH - 1, t));
            t
        } else {
            c.set((n - 1, t));
            t
        }
    })
}
