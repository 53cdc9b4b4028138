//! Per-bucket counters sharded by thread so that threads deciding in parallel do not bounce
//! one cache line. Each decision bumps exactly one counter: offered is derived as
//! admitted + dropped + shadow-dropped.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

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

static NEXT_SHARD: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static SHARD_ID: Cell<usize> = const { Cell::new(usize::MAX) };
}

#[inline]
fn shard_id() -> usize {
    SHARD_ID.with(|c| {
        let v = c.get();
        if v != usize::MAX {
            return v;
        }
        let v = NEXT_SHARD.fetch_add(1, Ordering::Relaxed);
        c.set(v);
        v
    })
}

pub(crate) struct Counters {
    shards: Box<[Shard]>,
    mask: usize,
}

impl Counters {
    pub(crate) fn new(buckets: usize) -> Self {
        let cpus = std::thread::available_parallelism().map_or(4, |n| n.get());
        let n = (cpus * 2).next_power_of_two().clamp(2, 64);
        let shards = (0..n)
            .map(|_| {
                // Two padding entries on each side keep neighbours' hot lines apart.
                let v: Box<[[AtomicU64; 3]]> =
                    (0..buckets + 4).map(|_| Default::default()).collect();
                CachePadded::new(v)
            })
            .collect();
        Counters {
            shards,
            mask: n - 1,
        }
    }

    #[inline]
    pub(crate) fn bump(&self, bucket: usize, which: usize) {
        let shard = &self.shards[shard_id() & self.mask];
        shard[bucket + 2][which].fetch_add(1, Ordering::Relaxed);
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
