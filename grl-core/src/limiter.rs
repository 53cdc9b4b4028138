//! The limiter: a compiled bucket table swapped in atomically, and the per-request decision.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use schema::{Bucket, BucketFile, Mode};

use crate::caps::Caps;
use crate::clock::coarse_now_ms;
use crate::counters::{BucketCounts, Counters};
use crate::criticality::TierShed;
use crate::lookup::Lookup;
use crate::rng::thread_rng_u64;
use schema::criticality::TIERS;
use schema::Criticality;

/// The outcome of one decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Let the request through (also for requests no bucket matches).
    Admit,
    /// Deny the request (enforce mode).
    Drop,
    /// Let the request through but count it as a virtual drop (shadow mode).
    ShadowDrop,
}

impl Decision {
    /// Whether the request goes through.
    pub fn admitted(self) -> bool {
        !matches!(self, Decision::Drop)
    }
}

/// Why a bucket set cannot be compiled.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CompileError {
    /// A limit that is zero, negative, NaN or infinite.
    #[error("service `{service}` bucket `{bucket}`: limit_rps must be a positive finite number, got {value}")]
    BadLimit {
        /// The callee service.
        service: String,
        /// The bucket.
        bucket: String,
        /// The offending value.
        value: f64,
    },
    /// Neither caller nor procedure set.
    #[error("service `{service}` bucket `{bucket}`: needs a caller, a procedure or both")]
    NoMatcher {
        /// The callee service.
        service: String,
        /// The bucket.
        bucket: String,
    },
    /// Two buckets with one name.
    #[error("service `{service}`: duplicate bucket name `{bucket}`")]
    DuplicateName {
        /// The callee service.
        service: String,
        /// The bucket.
        bucket: String,
    },
    /// Two buckets matching the same (caller, procedure).
    #[error(
        "service `{service}` bucket `{bucket}`: same caller and procedure as bucket `{other}`"
    )]
    DuplicateMatch {
        /// The callee service.
        service: String,
        /// The bucket.
        bucket: String,
        /// The bucket it collides with.
        other: String,
    },
    /// An empty name.
    #[error("service `{service}`: a bucket or service name is empty")]
    EmptyName {
        /// The callee service.
        service: String,
    },
    /// A caller pattern of `criticality.caps` that is not a name or a prefix ending in `*`.
    #[error("service `{service}` criticality.caps: {message}")]
    BadCap {
        /// The callee service.
        service: String,
        /// What is wrong with the pattern.
        message: String,
    },
}

/// Per-bucket hot state: read on every decision, written once per directive.
struct Slot {
    /// P(drop) of a request of tier `t` = `thresholds[t]` / 2^64 (all four equal under a
    /// uniform ratio).
    thresholds: [AtomicU64; TIERS],
    shadow: bool,
    /// Start of the bucket's drop sequence (random per table, see [`spread`]).
    phase: u64,
}

/// The `k`-th point of a bucket's drop sequence: request `k` of a thread's shard is dropped
/// when it is below the threshold. An additive sequence with the golden-ratio step (a Weyl
/// sequence) instead of independent draws: over any run of consecutive requests the dropped
/// fraction stays within a request or two of the ratio, so a caller with few requests loses
/// the same fraction as a big one (fairness) and a tick's admitted count has no binomial noise.
/// The phase is random per table, so instances do not drop in step.
#[inline(always)]
fn spread(k: u64, phase: u64) -> u64 {
    k.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(phase)
}

/// One service's bucket set compiled for lookup, with its directives and counters.
pub struct Table {
    service: String,
    version: String,
    buckets: Box<[Bucket]>,
    by_name: HashMap<String, usize>,
    slots: Box<[Slot]>,
    lookup: Lookup,
    /// The service's `criticality.caps` (None: no caller is capped).
    caps: Option<Box<Caps>>,
    /// Directives are honoured until this instant (ms on the decision clock); after it the
    /// table fails open.
    valid_until_ms: AtomicU64,
    counters: Counters,
    /// Unique in the process, set when the table is installed (0 before): the key of the
    /// per-thread table cache.
    generation: u64,
}

/// 2⁶⁴: ratios are thresholds on a uniform u64 draw.
const TWO_POW_64: f64 = 18_446_744_073_709_551_616.0;

/// Maps a ratio in [0, 1] to a threshold on a uniform u64.
fn threshold(ratio: f64) -> u64 {
    if ratio.is_nan() || ratio <= 0.0 {
        0
    } else if ratio >= 1.0 {
        u64::MAX
    } else {
        (ratio * TWO_POW_64) as u64
    }
}

impl Table {
    /// Checks `file` as [`Table::compile_file`] would: its buckets ([`Table::check`]) and
    /// its `criticality.caps`.
    pub fn check_file(file: &BucketFile) -> Result<(), CompileError> {
        Self::check(&file.service, &file.buckets)?;
        // The patterns only: nothing is built for a mere check.
        for pattern in file.criticality.caps.keys() {
            schema::criticality::check_caller_pattern(pattern).map_err(|message| {
                CompileError::BadCap {
                    service: file.service.clone(),
                    message,
                }
            })?;
        }
        Ok(())
    }

    fn caps_of(file: &BucketFile) -> Result<Option<Box<Caps>>, CompileError> {
        Caps::compile(&file.criticality.caps)
            .map(|c| c.map(Box::new))
            .map_err(|message| CompileError::BadCap {
                service: file.service.clone(),
                message,
            })
    }

    /// Compiles `file` at `version`: [`Table::compile`] with the file's `criticality.caps`,
    /// which hold each matching caller's requests at its cap.
    pub fn compile_file(version: &str, file: &BucketFile) -> Result<Table, CompileError> {
        let caps = Self::caps_of(file)?;
        let mut t = Self::compile(&file.service, version, &file.buckets)?;
        t.caps = caps;
        Ok(t)
    }

    /// Checks `buckets` of `service` as [`Table::compile`] would (limits, names, matchers),
    /// without building the lookup or allocating counters: for validating a config push.
    pub fn check(service: &str, buckets: &[Bucket]) -> Result<(), CompileError> {
        Self::checked(service, buckets, false).map(|_| ())
    }

    /// The checks of `compile`; with `build`, also the lookup and the name index (nothing is
    /// built or copied for a mere check: a controller checks every config it serves).
    fn checked(
        service: &str,
        buckets: &[Bucket],
        build: bool,
    ) -> Result<(Lookup, HashMap<String, usize>), CompileError> {
        if service.is_empty() {
            return Err(CompileError::EmptyName {
                service: service.into(),
            });
        }
        let mut lookup = Lookup::default();
        let mut by_name = HashMap::new();
        let mut names: HashSet<&str> = HashSet::with_capacity(buckets.len());
        let mut by_match: HashMap<(Option<&str>, Option<&str>), &str> =
            HashMap::with_capacity(buckets.len());
        for (i, b) in buckets.iter().enumerate() {
            if b.name.is_empty() {
                return Err(CompileError::EmptyName {
                    service: service.into(),
                });
            }
            if !(b.limit_rps.is_finite() && b.limit_rps > 0.0) {
                return Err(CompileError::BadLimit {
                    service: service.into(),
                    bucket: b.name.clone(),
                    value: b.limit_rps,
                });
            }
            if b.caller.is_none() && b.procedure.is_none() {
                return Err(CompileError::NoMatcher {
                    service: service.into(),
                    bucket: b.name.clone(),
                });
            }
            if !names.insert(b.name.as_str()) {
                return Err(CompileError::DuplicateName {
                    service: service.into(),
                    bucket: b.name.clone(),
                });
            }
            let key = (b.caller.as_deref(), b.procedure.as_deref());
            if let Some(other) = by_match.insert(key, &b.name) {
                return Err(CompileError::DuplicateMatch {
                    service: service.into(),
                    bucket: b.name.clone(),
                    other: other.into(),
                });
            }
            if build {
                lookup.insert(b.caller.as_deref(), b.procedure.as_deref(), i as u32);
                by_name.insert(b.name.clone(), i);
            }
        }
        Ok((lookup, by_name))
    }

    /// Compiles `buckets` of `service`, validating limits, names and matchers.
    pub fn compile(
        service: &str,
        version: &str,
        buckets: &[Bucket],
    ) -> Result<Table, CompileError> {
        let (mut lookup, by_name) = Self::checked(service, buckets, true)?;
        lookup.seal();
        let slots = buckets
            .iter()
            .map(|b| Slot {
                thresholds: Default::default(),
                shadow: b.mode == Mode::Shadow,
                phase: thread_rng_u64(),
            })
            .collect();
        Ok(Table {
            service: service.into(),
            version: version.into(),
            buckets: buckets.into(),
            by_name,
            slots,
            lookup,
            caps: None,
            valid_until_ms: AtomicU64::new(0),
            counters: Counters::new(buckets.len() * TIERS),
            generation: 0,
        })
    }

    /// The callee service.
    pub fn service(&self) -> &str {
        &self.service
    }

    /// The config version the table was compiled from.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// The buckets, in index order.
    pub fn buckets(&self) -> &[Bucket] {
        &self.buckets
    }

    /// The index of the bucket named `name`.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }

    /// The highest tier `caller` may claim in this service (`criticality.caps`), if capped.
    pub fn cap(&self, caller: &str) -> Option<Criticality> {
        self.caps.as_ref().and_then(|c| c.cap(caller))
    }

    /// The bucket a request falls into (most specific wins), if any.
    #[inline]
    pub fn find(&self, caller: &str, procedure: &str) -> Option<usize> {
        self.lookup.find(caller, procedure).map(|i| i as usize)
    }

    /// Sets the drop ratio of bucket `idx` (clamped to [0, 1]), the same for every tier.
    pub fn set_ratio(&self, idx: usize, ratio: f64) {
        self.set_probabilities(idx, [ratio; TIERS]);
    }

    /// Sets bucket `idx`'s drop probabilities by tier from `shed` (see
    /// [`crate::criticality::split`]).
    pub fn set_tier_shed(&self, idx: usize, shed: &TierShed) {
        self.set_probabilities(idx, shed.probabilities());
    }

    fn set_probabilities(&self, idx: usize, p: [f64; TIERS]) {
        if let Some(s) = self.slots.get(idx) {
            for (t, p) in s.thresholds.iter().zip(p) {
                t.store(threshold(p), Ordering::Relaxed);
            }
        }
    }

    /// The drop ratio currently set on bucket `idx` for [`Criticality::Critical`] requests
    /// (the uniform ratio when no tiers are in force).
    pub fn ratio(&self, idx: usize) -> f64 {
        self.tier_ratio(idx, Criticality::Critical)
    }

    /// The drop probability currently set on bucket `idx` for requests of `tier`.
    pub fn tier_ratio(&self, idx: usize, tier: Criticality) -> f64 {
        self.slots.get(idx).map_or(0.0, |s| {
            s.thresholds[tier as usize].load(Ordering::Relaxed) as f64 / TWO_POW_64
        })
    }

    /// Directives stay in force until `until_ms` on the decision clock.
    pub fn set_valid_until(&self, until_ms: u64) {
        self.valid_until_ms.store(until_ms, Ordering::Release);
    }

    /// Whether the table fails open at `now_ms` (no fresh directive).
    pub fn is_stale(&self, now_ms: u64) -> bool {
        now_ms >= self.valid_until_ms.load(Ordering::Acquire)
    }

    /// The counter cell of bucket `idx` for tier `t`: tier-major, so that one tier's cells
    /// of all buckets lie side by side as the untiered cells did (traffic of one tier touches
    /// no more cache lines than before).
    #[inline(always)]
    fn cell(&self, idx: usize, t: usize) -> usize {
        t * self.slots.len() + idx
    }

    /// Cumulative counts of bucket `idx` since the table was compiled, all tiers.
    pub fn counts(&self, idx: usize) -> BucketCounts {
        let mut c = BucketCounts::default();
        for t in self.tier_counts(idx) {
            c.add(&t);
        }
        c
    }

    /// Cumulative counts of bucket `idx` by tier (least critical first).
    pub fn tier_counts(&self, idx: usize) -> [BucketCounts; TIERS] {
        std::array::from_fn(|t| self.counters.snapshot(self.cell(idx, t)))
    }

    /// `now_ms` is only called when the bucket has a non-zero ratio: most requests on a
    /// healthy fleet never read the clock.
    #[inline(always)]
    fn decide_with(
        &self,
        caller: &str,
        procedure: &str,
        tier: Criticality,
        now_ms: impl FnOnce() -> u64,
    ) -> Decision {
        let Some(i) = self.lookup.find(caller, procedure) else {
            return Decision::Admit;
        };
        let i = i as usize;
        let tier = match &self.caps {
            None => tier,
            Some(caps) => caps.cap(caller).map_or(tier, |cap| tier.capped(cap)),
        };
        let slot = &self.slots[i];
        let t = slot.thresholds[tier as usize].load(Ordering::Relaxed);
        // Each tier counts apart, with its own drop sequence.
        let which = self.counters.count_with(self.cell(i, tier as usize), |e| {
            // Fail-open: a stale directive never drops. No clock read or count at ratio 0.
            let hit = t != 0
                && (now_ms() < self.valid_until_ms.load(Ordering::Relaxed))
                    & (spread(crate::counters::decisions(e), slot.phase) < t);
            // Without branches on the draw: 0 = admit, 1 = drop, 2 = shadow drop.
            hit as usize * (1 + slot.shadow as usize)
        });
        const OUTCOME: [Decision; 3] = [Decision::Admit, Decision::Drop, Decision::ShadowDrop];
        OUTCOME[which]
    }
}

/// Table generations, unique in the process (0 = never installed).
static NEXT_GENERATION: AtomicU64 = AtomicU64::new(1);
/// Limiter ids, which pick a limiter's entry in the per-thread cache.
static NEXT_LIMITER: AtomicUsize = AtomicUsize::new(0);

/// Entries in each thread's table cache: limiters with ids equal modulo this share an entry.
const CACHE_ENTRIES: usize = 64;

thread_local! {
    /// Each thread's last-seen table per limiter (by id modulo `CACHE_ENTRIES`). A hit costs
    /// one load of the limiter's generation and a compare, where `ArcSwap::load` costs a
    /// debt-slot write and a fence; a miss (first decision after a swap) reloads it.
    static TABLES: RefCell<[Option<Arc<Table>>; CACHE_ENTRIES]> =
        const { RefCell::new([const { None }; CACHE_ENTRIES]) };
}

/// A service's limiter: the current table behind an atomic pointer swap. Deciding never waits
/// for a config change or a directive; it uses whichever table is current.
///
/// Each thread caches the current table per limiter and checks it against the limiter's
/// generation (one atomic load) on every decision, so a swapped table is picked up on the
/// thread's next decision. A thread's cache keeps an old table alive until the thread decides
/// again on that limiter (or on another limiter sharing the cache entry) or exits.
pub struct Limiter {
    table: ArcSwap<Table>,
    /// The generation of the table in `table`, stored after the swap.
    generation: AtomicU64,
    /// Serializes `install` so that `generation` always ends on the current table's.
    installing: Mutex<()>,
    cache_entry: usize,
    stale_after_ms: u64,
}

impl Limiter {
    /// A limiter for `service` with no buckets yet (everything passes). Directives older than
    /// `stale_after` stop dropping.
    pub fn new(service: &str, stale_after: Duration) -> Limiter {
        let empty = Table::compile(service, "", &[]).unwrap_or_else(|_| {
            // An empty service name cannot compile; keep a table that matches nothing anyway.
            Table::compile("-", "", &[]).expect("empty table compiles")
        });
        let mut empty = empty;
        empty.generation = NEXT_GENERATION.fetch_add(1, Ordering::Relaxed);
        Limiter {
            generation: AtomicU64::new(empty.generation),
            table: ArcSwap::from_pointee(empty),
            installing: Mutex::new(()),
            cache_entry: NEXT_LIMITER.fetch_add(1, Ordering::Relaxed) % CACHE_ENTRIES,
            stale_after_ms: stale_after.as_millis() as u64,
        }
    }

    /// The staleness bound in milliseconds.
    pub fn stale_after_ms(&self) -> u64 {
        self.stale_after_ms
    }

    /// The current table.
    pub fn table(&self) -> Arc<Table> {
        self.table.load_full()
    }

    /// The highest tier `caller` may claim in the current table (`criticality.caps`), without
    /// taking a reference to the table (a front end's per-request use).
    pub fn cap(&self, caller: &str) -> Option<Criticality> {
        self.table.load().cap(caller)
    }

    /// Swaps in `table`, carrying over the ratios of buckets that keep their name and the
    /// directive deadline, so that a config change does not open the gates for a tick.
    /// Returns the previous table so the caller can collect its last counts.
    pub fn install(&self, table: Table) -> Arc<Table> {
        let mut table = table;
        // Only installers take this lock; deciding never does.
        let _installing = self.installing.lock().unwrap_or_else(|e| e.into_inner());
        let old = self.table.load_full();
        for (i, b) in table.buckets.iter().enumerate() {
            if let Some(j) = old.index_of(&b.name) {
                for (new, old) in table.slots[i]
                    .thresholds
                    .iter()
                    .zip(&old.slots[j].thresholds)
                {
                    new.store(old.load(Ordering::Relaxed), Ordering::Relaxed);
                }
            }
        }
        table.set_valid_until(old.valid_until_ms.load(Ordering::Acquire));
        table.generation = NEXT_GENERATION.fetch_add(1, Ordering::Relaxed);
        let generation = table.generation;
        let previous = self.table.swap(Arc::new(table));
        // After the swap: a thread that sees the new generation loads the new table.
        self.generation.store(generation, Ordering::Release);
        previous
    }

    /// Decides on the current table through this thread's cache (the table is reloaded only
    /// after a swap).
    #[inline(always)]
    fn decide_cached(
        &self,
        caller: &str,
        procedure: &str,
        tier: Criticality,
        now_ms: impl FnOnce() -> u64 + Copy,
    ) -> Decision {
        let generation = self.generation.load(Ordering::Acquire);
        TABLES
            .try_with(|cache| {
                let mut cache = cache.borrow_mut();
                let entry = &mut cache[self.cache_entry];
                match entry {
                    Some(t) if t.generation == generation => {
                        t.decide_with(caller, procedure, tier, now_ms)
                    }
                    _ => self
                        .refresh(entry)
                        .decide_with(caller, procedure, tier, now_ms),
                }
            })
            // The thread's cache is already destroyed (a decision from another thread-local's
            // destructor): go through the swap directly.
            .unwrap_or_else(|_| {
                self.table
                    .load()
                    .decide_with(caller, procedure, tier, now_ms)
            })
    }

    /// Replaces this thread's cached table with the current one (after a swap, or when
    /// another limiter used the entry).
    #[cold]
    #[inline(never)]
    fn refresh<'a>(&self, entry: &'a mut Option<Arc<Table>>) -> &'a Table {
        entry.insert(self.table.load_full())
    }

    /// Records that fresh directives arrived at `now_ms`: they stay in force for the staleness
    /// bound.
    pub fn directives_received(&self, now_ms: u64) {
        self.table
            .load()
            .set_valid_until(now_ms + self.stale_after_ms);
    }

    /// Fails the limiter open now if its directives are stale at `now_ms` (read on the real
    /// clock): the deadline is set to 0, which every thread's cached clock is past, so the next
    /// decision on any thread admits. Returns whether the directives are stale. The decision's
    /// own clock is refreshed only every 64 decisions per thread, which at a few requests per
    /// second lags by many seconds: a client calls this every few tens of milliseconds so that
    /// it fails open within the staleness bound whatever its request rate. A deadline set
    /// concurrently by [`Limiter::directives_received`] is never undone.
    pub fn expire_stale(&self, now_ms: u64) -> bool {
        let t = self.table.load();
        let until = t.valid_until_ms.load(Ordering::Acquire);
        if now_ms < until {
            return false;
        }
        if until != 0 {
            let _ =
                t.valid_until_ms
                    .compare_exchange(until, 0, Ordering::AcqRel, Ordering::Relaxed);
        }
        true
    }

    /// Decides one request on the wall clock (the production path), as
    /// [`Criticality::Critical`] (a request without a tier).
    #[inline]
    pub fn decide(&self, caller: &str, procedure: &str) -> Decision {
        self.decide_cached(caller, procedure, Criticality::Critical, coarse_now_ms)
    }

    /// Decides one request of `tier` on the wall clock.
    #[inline]
    pub fn decide_tier(&self, caller: &str, procedure: &str, tier: Criticality) -> Decision {
        self.decide_cached(caller, procedure, tier, coarse_now_ms)
    }

    /// Decides one request at `now_ms` on the decision clock (tests and the simulator's virtual
    /// time).
    #[inline]
    pub fn decide_at(&self, caller: &str, procedure: &str, now_ms: u64) -> Decision {
        self.decide_cached(caller, procedure, Criticality::Critical, || now_ms)
    }

    /// [`Limiter::decide_at`] for a request of `tier`.
    #[inline]
    pub fn decide_tier_at(
        &self,
        caller: &str,
        procedure: &str,
        tier: Criticality,
        now_ms: u64,
    ) -> Decision {
        self.decide_cached(caller, procedure, tier, || now_ms)
    }
}
