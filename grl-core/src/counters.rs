//! Per-bucket counters sharded by thread so that threads deciding in parallel do not bounce
//! one cache line. Each decision bumps exactly one counter: offered is derived as
//! admitted + dropped + shadow-dropped.
//!
//! A thread owns a shard while it lives when one is free (it then counts without a locked
//! instruction); threads beyond the shard count share shard 0 with atomic adds.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use crossbeam_utils::CachePadded;

/// Counts of one bucket since the limiter was built (monotonic).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BucketCounts {
    /// Requests that reached the bucket (before dropping).
    pub offered: u64,
    /// Requests let through, including shadow drops.
    pub admitted: u64,
    /// Requests denied (enforce mode).
    pub dropped: u64,
    /// Requests admitted that would have been dropped (shadow mode).
    pub shadow_dropped: u64,
}

impl BucketCounts {
    /// `self - earlier`, counter by counter (saturating).
    pub fn since(&self, earlier: &BucketCounts) -> BucketCounts {
        BucketCounts {
            offered: self.offered.saturating_sub(earlier.offered),
            admitted: self.admitted.saturating_sub(earlier.admitted),
            dropped: self.dropped.saturating_sub(earlier.dropped),
            shadow_dropped: self.shadow_dropped.saturating_sub(earlier.shadow_dropped),
        }
    }

    /// Adds `other` into `self`.
    pub fn add(&mut self, other: &BucketCounts) {
        self.offered += other.offered;
        self.admitted += other.admitted;
        self.dropped += other.dropped;
        self.shadow_dropped += other.shadow_dropped;
    }
}

pub(crate) const ADMIT: usize = 0;
pub(crate) const DROP: usize = 1;
pub(crate) const SHADOW: usize = 2;

/// One shard: a counter triple per bucket. A shard is padded at both ends so that its first
/// and last buckets do not share a line with a neighbouring shard.
type Shard = CachePadded<Box<[[AtomicU64; 3]]>>;

/// Shards per table, the same for every table in the process: 2 × CPUs rounded up to a
/// power of two, between 4 and 64 (one bit each in `OWNED`).
fn shard_count() -> usize {
    static N: OnceLock<usize> = OnceLock::new();
    *N.get_or_init(|| {
        let cpus = std::thread::available_parallelism().map_or(4, |n| n.get());
        (cpus * 2).next_power_of_two().clamp(4, 64)
    })
}

/// Shards 1.. are each owned by at most one live thread (bit set = owned); shard 0 is shared
/// by the threads that found none free.
static OWNED: AtomicU64 = AtomicU64::new(0);

/// A thread's shard; an owned one goes back to the pool when the thread exits.
struct ShardClaim {
    index: usize,
    owned: bool,
}

impl ShardClaim {
    fn claim() -> ShardClaim {
        let n = shard_count();
        let mut cur = OWNED.load(Ordering::Relaxed);
        loop {
            // Lowest free bit among shards 1..n.
            let free = !cur & !1 & (u64::MAX >> (64 - n));
            if free == 0 {
                return ShardClaim {
                    index: 0,
                    owned: false,
                };
            }
            let bit = free.trailing_zeros() as usize;
            // Acquire: see every count the previous owner wrote.
            match OWNED.compare_exchange_weak(
                cur,
                cur | 1 << bit,
                Ordering::Acquire,
                Ordering::Relaxed,
            ) {
                Ok(_) => {
                    return ShardClaim {
                        index: bit,
                        owned: true,
                    }
                }
                Err(now) => cur = now,
            }
        }
    }
}

impl Drop for ShardClaim {
    fn drop(&mut self) {
        if self.owned {
            // Release: the next owner continues from this thread's last counts.
            OWNED.fetch_and(!(1 << self.index), Ordering::Release);
        }
    }
}

thread_local! {
    static SHARD: ShardClaim = ShardClaim::claim();
}

/// Decisions counted in one shard's counters of a bucket.
#[inline(always)]
pub(crate) fn decisions(e: &[AtomicU64; 3]) -> u64 {
    e[ADMIT]
        .load(Ordering::Relaxed)
        .wrapping_add(e[DROP].load(Ordering::Relaxed))
        .wrapping_add(e[SHADOW].load(Ordering::Relaxed))
}

pub(crate) struct Counters {
    shards: Box<[Shard]>,
}

impl Counters {
    pub(crate) fn new(buckets: usize) -> Self {
        let shards = (0..shard_count())
            .map(|_| {
                // Two padding entries on each side keep neighbours' hot lines apart.
                let v: Box<[[AtomicU64; 3]]> =
                    (0..buckets + 4).map(|_| Default::default()).collect();
                CachePadded::new(v)
            })
            .collect();
        Counters { shards }
    }

    /// Counts one decision of `bucket` in this thread's shard: `decide` gets the shard's
    /// counters of the bucket (for [`decisions`], read only when needed) and returns the
    /// counter to bump (0 admit, 1 drop, 2 shadow drop), which is returned. An owned shard has
    /// a single writer, so a plain load and store replace the locked read-modify-write (which
    /// costs as much as the rest of the counting); readers still see whole values.
    #[inline(always)]
    pub(crate) fn count_with(
        &self,
        bucket: usize,
        decide: impl FnOnce(&[AtomicU64; 3]) -> usize,
    ) -> usize {
        let (index, owned) = SHARD.try_with(|s| (s.index, s.owned)).unwrap_or((0, false));
        let e = &self.shards[index][bucket + 2];
        let which = decide(e);
        let c = &e[which];
        if owned {
            c.store(c.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        } else {
            c.fetch_add(1, Ordering::Relaxed);
        }
        which
    }

    pub(crate) fn snapshot(&self, bucket: usize) -> BucketCounts {
        let mut c = BucketCounts::default();
        for s in self.shards.iter() {
            let e = &s[bucket + 2];
            c.admitted += e[ADMIT].load(Ordering::Relaxed);
            c.dropped += e[DROP].load(Ordering::Relaxed);
            c.shadow_dropped += e[SHADOW].load(Ordering::Relaxed);
        }
        c.admitted += c.shadow_dropped;
        c.offered = c.admitted + c.dropped;
        c
    }
}
