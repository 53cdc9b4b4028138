//! Calls by (caller, procedure), matched by a bucket or not: the traffic RLC learns quotas
//! from, measured by GRL itself.
//!
//! - [`CallCounter`] (client): a fixed-capacity, lock-free table counted on the request path
//!   (one hash, a few atomic loads, one atomic add; a key's names are allocated once, when it
//!   is first seen). The reporter drains it every tick.
//! - [`PendingCalls`] (client and aggregator): counts waiting to be sent, bounded.
//! - [`CallStats`] (controller): `grl_calls_total{service,caller,procedure}` with a
//!   per-service cardinality bound: the top callers by recent volume keep their labels, the
//!   rest fold into `caller="_other"`, counted by `grl_calls_folded_total{service}`.
//!
//! Every structure is bounded: a client or an aggregator facing millions of distinct callers
//! keeps a fixed number of keys and folds the rest into `_other`.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use arc_swap::ArcSwap;

use crate::metrics::Label;

/// The caller (or procedure) label that stands for every name folded by a cardinality bound.
pub const OTHER: &str = "_other";

/// Longest caller or procedure name kept; longer names are counted as [`OTHER`].
pub const MAX_NAME_LEN: usize = 256;

/// Default number of distinct (caller, procedure) keys a client counts between rotations.
pub const DEFAULT_CLIENT_KEYS: usize = 1024;

/// Default number of distinct (service, caller, procedure) keys an aggregator holds between
/// forwards.
pub const DEFAULT_AGGREGATOR_KEYS: usize = 20_000;

/// Default labelled callers per service at the controller.
pub const DEFAULT_MAX_CALLERS: usize = 100;

/// Default labelled procedures per service at the controller.
pub const DEFAULT_MAX_PROCEDURES: usize = 200;

struct Slot {
    /// 0 = empty; otherwise the key's hash (never 0).
    hash: AtomicU64,
    key: OnceLock<(Box<str>, Box<str>)>,
    count: AtomicU64,
}

struct CallTable {
    slots: Box<[Slot]>,
    used: AtomicUsize,
    /// Counts of keys that found no room at all, reported as (`_other`, `_other`).
    overflow: AtomicU64,
}

impl CallTable {
    fn new(capacity: usize) -> CallTable {
        let n = (capacity.max(4) * 2).next_power_of_two();
        CallTable {
            slots: (0..n)
                .map(|_| Slot {
                    hash: AtomicU64::new(0),
                    key: OnceLock::new(),
                    count: AtomicU64::new(0),
                })
                .collect(),
            used: AtomicUsize::new(0),
            overflow: AtomicU64::new(0),
        }
    }
}

/// Probes before a key is considered not to fit.
const MAX_PROBES: usize = 32;

/// A client's counts of every request by (caller, procedure), lock-free. Memory is fixed by
/// the capacity: past 3/4 of it new callers are counted as (`_other`, procedure), past all
/// of it as (`_other`, `_other`). The reporter starts a fresh table when half of the keys are
/// used, so callers that stopped calling do not hold their slot for ever.
pub struct CallCounter {
    table: ArcSwap<CallTable>,
    capacity: usize,
    /// Seeded per process: the keys are callers' names, chosen by whoever calls, and a
    /// collision costs them their own slot only (counted as [`OTHER`] past the probes), never
    /// a decision. foldhash rather than std's SipHash, which is slower.
    hasher: foldhash::quality::RandomState,
}

impl std::fmt::Debug for CallCounter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CallCounter")
            .field("capacity", &self.capacity)
            .finish()
    }
}

impl CallCounter {
    /// A counter holding at most `capacity` keys per table.
    pub fn new(capacity: usize) -> CallCounter {
        let capacity = capacity.max(4);
        CallCounter {
            table: ArcSwap::from_pointee(CallTable::new(capacity)),
            capacity,
            hasher: Default::default(),
        }
    }

    fn hash(&self, caller: &str, procedure: &str) -> u64 {
        let mut h = self.hasher.build_hasher();
        caller.hash(&mut h);
        procedure.hash(&mut h);
        h.finish() | 1
    }

    /// Counts one request of `caller` to `procedure`.
    #[inline]
    pub fn count(&self, caller: &str, procedure: &str) {
        let t = self.table.load();
        let (caller, procedure) = (fold_long(caller), fold_long(procedure));
        if self.bump(&t, caller, procedure, self.capacity * 3 / 4) {
            return;
        }
        if self.bump(&t, OTHER, procedure, self.capacity) {
            return;
        }
        t.overflow.fetch_add(1, Ordering::Relaxed);
    }

    /// Adds one to the key's slot, inserting it while fewer than `room` keys are used.
    fn bump(&self, t: &CallTable, caller: &str, procedure: &str, room: usize) -> bool {
        let h = self.hash(caller, procedure);
        let mask = t.slots.len() - 1;
        let mut i = h as usize & mask;
        for _ in 0..MAX_PROBES {
            let s = &t.slots[i];
            let mut cur = s.hash.load(Ordering::Acquire);
            if cur == 0 {
                if t.used.load(Ordering::Relaxed) >= room {
                    return false;
                }
                match s
                    .hash
                    .compare_exchange(0, h, Ordering::AcqRel, Ordering::Acquire)
                {
                    Ok(_) => {
                        t.used.fetch_add(1, Ordering::Relaxed);
                        let _ = s.key.set((caller.into(), procedure.into()));
                        s.count.fetch_add(1, Ordering::Relaxed);
                        return true;
                    }
                    Err(v) => cur = v,
                }
            }
            if cur == h {
                match s.key.get() {
                    Some((c, p)) if &**c != caller || &**p != procedure => {}
                    // Ours, or being inserted by a thread that saw the same hash (the same
                    // key but for a 2^-63 chance).
                    _ => {
                        s.count.fetch_add(1, Ordering::Relaxed);
                        return true;
                    }
                }
            }
            i = (i + 1) & mask;
        }
        false
    }

    /// A drain state for the reporter (one per counter).
    pub fn drain(self: &Arc<Self>) -> CallDrain {
        let t = self.table.load_full();
        let n = t.slots.len();
        CallDrain {
            counter: self.clone(),
            current: t,
            prev: vec![0; n],
            prev_overflow: 0,
            retired: None,
        }
    }
}

/// The reporter's side of a [`CallCounter`]: counts since the previous drain.
pub struct CallDrain {
    counter: Arc<CallCounter>,
    current: Arc<CallTable>,
    prev: Vec<u64>,
    prev_overflow: u64,
    /// A table replaced at the previous drain, read once more for late increments.
    retired: Option<(Arc<CallTable>, Vec<u64>, u64)>,
}

impl std::fmt::Debug for CallDrain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CallDrain")
    }
}

fn read_table(t: &CallTable, prev: &mut [u64], prev_overflow: &mut u64, out: &mut PendingCalls) {
    for (i, s) in t.slots.iter().enumerate() {
        let Some((c, p)) = s.key.get() else {
            continue;
        };
        let now = s.count.load(Ordering::Relaxed);
        let d = now.saturating_sub(prev[i]);
        prev[i] = now;
        if d > 0 {
            out.add(c, p, d);
        }
    }
    let o = t.overflow.load(Ordering::Relaxed);
    let d = o.saturating_sub(*prev_overflow);
    *prev_overflow = o;
    if d > 0 {
        out.add(OTHER, OTHER, d);
    }
}

impl CallDrain {
    /// Adds the counts since the previous drain to `out`.
    pub fn drain_into(&mut self, out: &mut PendingCalls) {
        if let Some((t, mut prev, mut po)) = self.retired.take() {
            read_table(&t, &mut prev, &mut po, out);
        }
        read_table(&self.current, &mut self.prev, &mut self.prev_overflow, out);
        if self.current.used.load(Ordering::Relaxed) >= self.counter.capacity / 2 {
            let fresh = Arc::new(CallTable::new(self.counter.capacity));
            self.counter.table.store(fresh.clone());
            let n = fresh.slots.len();
            let old = std::mem::replace(&mut self.current, fresh);
            let prev = std::mem::replace(&mut self.prev, vec![0; n]);
            self.retired = Some((old, prev, std::mem::take(&mut self.prev_overflow)));
        }
    }
}

fn fold_long(s: &str) -> &str {
    if s.len() > MAX_NAME_LEN {
        OTHER
    } else {
        s
    }
}

/// Counts waiting to be sent, by (caller, procedure) — or, at an aggregator, by (service,
/// caller, procedure) with the service in the first element of the key. At most `max` keys:
/// past it a new key is counted as (`_other`, procedure) when that key exists, else as
/// (`_other`, `_other`), which is always kept.
#[derive(Debug, Clone, Default)]
pub struct PendingCalls {
    map: HashMap<(String, String), u64>,
    max: usize,
}

impl PendingCalls {
    /// Empty, holding at most `max` keys (plus the one fold key).
    pub fn new(max: usize) -> PendingCalls {
        PendingCalls {
            map: HashMap::new(),
            max: max.max(1),
        }
    }

    /// Adds `n` calls of `caller` to `procedure`.
    pub fn add(&mut self, caller: &str, procedure: &str, n: u64) {
        use crate::keys::StrPair;
        let (caller, procedure) = (fold_long(caller), fold_long(procedure));
        // Looked up by the borrowed names: a key is allocated only when new.
        if let Some(v) = self.map.get_mut(&(caller, procedure) as &dyn StrPair) {
            *v = v.saturating_add(n);
            return;
        }
        let key = if self.map.len() < self.max {
            (caller, procedure)
        } else if self.map.contains_key(&(OTHER, procedure) as &dyn StrPair) {
            (OTHER, procedure)
        } else {
            (OTHER, OTHER)
        };
        crate::keys::update(&mut self.map, key, |_| 0, |v| *v = v.saturating_add(n));
    }

    /// Number of keys held.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether nothing is pending.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Takes every count, sorted by key.
    pub fn take(&mut self) -> Vec<((String, String), u64)> {
        let mut v: Vec<_> = self.map.drain().collect();
        v.sort();
        v
    }
}

/// One service's calls at the controller.
#[derive(Debug, Default)]
struct ServiceCalls {
    /// Labelled callers: per procedure counts, and volume.
    callers: HashMap<String, CallerCalls>,
    /// Folded callers' counts per procedure.
    other: HashMap<String, u64>,
    /// Calls counted under `_other` (caller or procedure folded).
    folded: u64,
    /// Unlabelled callers' recent volume (decayed), at most `4 × max_callers`.
    candidates: HashMap<String, f64>,
    /// Procedures labelled so far.
    procedures: std::collections::HashSet<String>,
}

#[derive(Debug, Default)]
struct CallerCalls {
    procs: HashMap<String, u64>,
    /// Volume decayed per tick (the ranking for the cardinality bound).
    recent: f64,
    /// Calls since the last tick.
    tick: u64,
}

/// Per-tick decay of the volumes that rank callers: a half-life of 60 ticks.
const DECAY: f64 = 0.988_514_020_8;

/// The controller's `grl_calls_total` with its cardinality bound (see the module doc).
#[derive(Debug)]
pub struct CallStats {
    services: HashMap<String, ServiceCalls>,
    max_callers: usize,
    max_procedures: usize,
}

impl CallStats {
    /// At most `max_callers` labelled callers and `max_procedures` labelled procedures per
    /// service.
    pub fn new(max_callers: usize, max_procedures: usize) -> CallStats {
        CallStats {
            services: HashMap::new(),
            max_callers: max_callers.max(1),
            max_procedures: max_procedures.max(1),
        }
    }

    /// Counts `n` calls.
    pub fn add(&mut self, service: &str, caller: &str, procedure: &str, n: u64) {
        if n == 0 {
            return;
        }
        let s = match self.services.get_mut(service) {
            Some(s) => s,
            None => self.services.entry(service.to_string()).or_default(),
        };
        let mut folded = false;
        let procedure = if procedure.len() > MAX_NAME_LEN
            || procedure == OTHER
            || !s.procedures.contains(procedure) && s.procedures.len() >= self.max_procedures
        {
            folded = true;
            OTHER
        } else {
            if !s.procedures.contains(procedure) {
                s.procedures.insert(procedure.to_string());
            }
            procedure
        };
        let caller_ok = caller.len() <= MAX_NAME_LEN && caller != OTHER;
        if caller_ok && !s.callers.contains_key(caller) && s.callers.len() < self.max_callers {
            s.callers.insert(caller.to_string(), CallerCalls::default());
        }
        match s.callers.get_mut(caller).filter(|_| caller_ok) {
            Some(c) => {
                // Saturating: absurd counts in a report must not wrap (or panic in a debug
                // build with the lock held).
                let v = c.procs.entry(procedure.to_string()).or_default();
                *v = v.saturating_add(n);
                c.tick = c.tick.saturating_add(n);
            }
            None => {
                folded = true;
                let v = s.other.entry(procedure.to_string()).or_default();
                *v = v.saturating_add(n);
                if caller_ok {
                    match s.candidates.get_mut(caller) {
                        Some(v) => *v += n as f64,
                        None => {
                            let mut base = 0.0;
                            if s.candidates.len() >= 4 * self.max_callers {
                                // Space-saving: the newcomer replaces the smallest candidate
                                // and inherits its volume (an upper bound of its own).
                                if let Some(min) = s
                                    .candidates
                                    .iter()
                                    .min_by(|a, b| a.1.total_cmp(b.1))
                                    .map(|(k, v)| (k.clone(), *v))
                                {
                                    s.candidates.remove(&min.0);
                                    base = min.1;
                                }
                            }
                            s.candidates.insert(caller.to_string(), base + n as f64);
                        }
                    }
                }
            }
        }
        if folded {
            s.folded = s.folded.saturating_add(n);
        }
    }

    /// Once per tick: decays the volumes and lets a folded caller whose recent volume is more
    /// than twice the smallest labelled caller's take its label (at most one swap per
    /// service per tick). The caller that loses its label loses its series; its later calls
    /// count under `_other`.
    pub fn tick(&mut self) {
        for s in self.services.values_mut() {
            for c in s.callers.values_mut() {
                c.recent = c.recent * DECAY + c.tick as f64;
                c.tick = 0;
            }
            for v in s.candidates.values_mut() {
                *v *= DECAY;
            }
            s.candidates.retain(|_, v| *v >= 0.01);
            let best = s
                .candidates
                .iter()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .map(|(k, v)| (k.clone(), *v));
            let worst = s
                .callers
                .iter()
                .min_by(|a, b| a.1.recent.total_cmp(&b.1.recent))
                .map(|(k, c)| (k.clone(), c.recent));
            if let (Some((b, bv)), Some((w, wv))) = (best, worst) {
                if bv > 2.0 * wv && bv >= 1.0 {
                    let old = s.callers.remove(&w).expect("present");
                    s.candidates.remove(&b);
                    s.candidates.insert(w, old.recent);
                    s.callers.insert(
                        b,
                        CallerCalls {
                            recent: bv,
                            ..Default::default()
                        },
                    );
                }
            }
        }
    }

    /// Number of series `grl_calls_total` has for `service` (tests, bounds).
    pub fn series(&self, service: &str) -> usize {
        self.services.get(service).map_or(0, |s| {
            s.callers.values().map(|c| c.procs.len()).sum::<usize>() + s.other.len()
        })
    }

    /// Calls of a labelled `caller` to `procedure` (`_other` for the fold).
    pub fn get(&self, service: &str, caller: &str, procedure: &str) -> Option<u64> {
        let s = self.services.get(service)?;
        if caller == OTHER {
            return s.other.get(procedure).copied();
        }
        s.callers.get(caller)?.procs.get(procedure).copied()
    }

    /// Calls folded into `_other` for `service`.
    pub fn folded(&self, service: &str) -> u64 {
        self.services.get(service).map_or(0, |s| s.folded)
    }
}

/// `grl_calls_total{service,caller,procedure}` and `grl_calls_folded_total{service}`, read
/// from the controller's [`CallStats`] at every scrape.
pub struct CallsCollector(pub Arc<std::sync::Mutex<CallStats>>);

impl std::fmt::Debug for CallsCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CallsCollector")
    }
}

impl prometheus_client::collector::Collector for CallsCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> std::fmt::Result {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::counter::ConstCounter;
        use prometheus_client::metrics::MetricType;
        let st = self.0.lock().expect("calls lock");
        let mut services: Vec<_> = st.services.iter().collect();
        services.sort_by(|a, b| a.0.cmp(b.0));
        let mut fam = encoder.encode_descriptor(
            "grl_calls",
            "Requests received by (service, caller, procedure), matched by a bucket or not; callers beyond the per-service bound are folded into caller=\"_other\".",
            None,
            MetricType::Counter,
        )?;
        for (service, s) in &services {
            for (caller, c) in &s.callers {
                for (procedure, n) in &c.procs {
                    let labels = [
                        ("service", Label(service)),
                        ("caller", Label(caller)),
                        ("procedure", Label(procedure)),
                    ];
                    ConstCounter::new(*n).encode(fam.encode_family(&labels)?)?;
                }
            }
            for (procedure, n) in &s.other {
                let labels = [
                    ("service", Label(service)),
                    ("caller", Label(OTHER)),
                    ("procedure", Label(procedure)),
                ];
                ConstCounter::new(*n).encode(fam.encode_family(&labels)?)?;
            }
        }
        let mut fam = encoder.encode_descriptor(
            "grl_calls_folded",
            "Requests counted under caller or procedure \"_other\" because of the cardinality bound.",
            None,
            MetricType::Counter,
        )?;
        for (service, s) in &services {
            ConstCounter::new(s.folded)
                .encode(fam.encode_family(&[("service", Label(service))])?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counter_counts_every_key_and_drains_deltas() {
        let c = Arc::new(CallCounter::new(64));
        let mut d = c.drain();
        for _ in 0..5 {
            c.count("web", "/a");
        }
        c.count("batch", "/b");
        let mut out = PendingCalls::new(100);
        d.drain_into(&mut out);
        let got = out.take();
        assert_eq!(
            got,
            vec![
                (("batch".into(), "/b".into()), 1),
                (("web".into(), "/a".into()), 5)
            ]
        );
        c.count("web", "/a");
        d.drain_into(&mut out);
        assert_eq!(out.take(), vec![(("web".into(), "/a".into()), 1)]);
        d.drain_into(&mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn counter_folds_past_its_capacity_and_rotates() {
        let c = Arc::new(CallCounter::new(16));
        let mut d = c.drain();
        for i in 0..100 {
            c.count(&format!("caller-{i}"), "/p");
        }
        let mut out = PendingCalls::new(1000);
        d.drain_into(&mut out);
        let got = out.take();
        let total: u64 = got.iter().map(|(_, n)| n).sum();
        assert_eq!(total, 100, "no call lost: {got:?}");
        // 3/4 of 16 keys keep their caller; the rest fold into (_other, /p).
        assert_eq!(got.len(), 13, "{got:?}");
        let other = got
            .iter()
            .find(|(k, _)| k.0 == OTHER && k.1 == "/p")
            .unwrap()
            .1;
        assert_eq!(other, 88);
        // Half full: the next drain starts a fresh table, with room for new callers again.
        c.count("late", "/p");
        d.drain_into(&mut out);
        d.drain_into(&mut out);
        assert_eq!(out.take(), vec![(("late".into(), "/p".into()), 1)]);
    }

    #[test]
    fn pending_is_bounded() {
        let mut p = PendingCalls::new(3);
        p.add("a", "/x", 1);
        p.add("b", "/x", 1);
        p.add("c", "/y", 1);
        p.add("d", "/x", 2);
        p.add("e", "/z", 5);
        p.add("a", "/x", 1);
        assert_eq!(p.len(), 4);
        let got = p.take();
        assert_eq!(
            got,
            vec![
                ((OTHER.into(), OTHER.into()), 7),
                (("a".into(), "/x".into()), 2),
                (("b".into(), "/x".into()), 1),
                (("c".into(), "/y".into()), 1),
            ]
        );
    }

    #[test]
    fn stats_fold_callers_beyond_the_bound_and_count_the_fold() {
        let mut s = CallStats::new(2, 10);
        s.add("svc", "a", "/p", 10);
        s.add("svc", "b", "/p", 20);
        s.add("svc", "c", "/p", 5);
        s.add("svc", "d", "/q", 7);
        assert_eq!(s.get("svc", "a", "/p"), Some(10));
        assert_eq!(s.get("svc", "b", "/p"), Some(20));
        assert_eq!(s.get("svc", "c", "/p"), None);
        assert_eq!(s.get("svc", OTHER, "/p"), Some(5));
        assert_eq!(s.get("svc", OTHER, "/q"), Some(7));
        assert_eq!(s.folded("svc"), 12);
        // Caller "_other" from a client's own fold is folded too.
        s.add("svc", OTHER, "/p", 3);
        assert_eq!(s.get("svc", OTHER, "/p"), Some(8));
        assert_eq!(s.folded("svc"), 15);
        assert_eq!(s.series("svc"), 4);
        // Another service has its own bound.
        s.add("other-svc", "c", "/p", 1);
        assert_eq!(s.get("other-svc", "c", "/p"), Some(1));
    }

    #[test]
    fn stats_give_the_label_to_the_top_callers_by_volume() {
        let mut s = CallStats::new(2, 10);
        // a and b take the two labels; then c grows far above a.
        for _ in 0..5 {
            s.add("svc", "a", "/p", 1);
            s.add("svc", "b", "/p", 100);
            s.tick();
        }
        for _ in 0..5 {
            s.add("svc", "a", "/p", 1);
            s.add("svc", "b", "/p", 100);
            s.add("svc", "c", "/p", 50);
            s.tick();
        }
        // c took a's label at the first tick it was more than twice as busy; its later
        // calls count under its own label.
        assert_eq!(s.get("svc", "a", "/p"), None, "a lost its label");
        assert_eq!(s.get("svc", "b", "/p"), Some(1000));
        assert_eq!(s.get("svc", "c", "/p"), Some(200));
        s.add("svc", "c", "/p", 50);
        s.add("svc", "a", "/p", 1);
        assert_eq!(s.get("svc", "c", "/p"), Some(250));
        // Folded: c's first 50 before its label, and a's 5 calls after it lost its own.
        assert_eq!(s.folded("svc"), 55);
        assert_eq!(s.get("svc", OTHER, "/p"), Some(55));
        assert_eq!(s.series("svc"), 3);
    }

    #[test]
    fn stats_bound_procedures_and_candidates() {
        let mut s = CallStats::new(1, 2);
        s.add("svc", "a", "/1", 1);
        s.add("svc", "a", "/2", 1);
        s.add("svc", "a", "/3", 1);
        assert_eq!(s.get("svc", "a", OTHER), Some(1));
        for i in 0..1000 {
            s.add("svc", &format!("c{i}"), "/1", 1);
        }
        let sc = &s.services["svc"];
        assert!(sc.candidates.len() <= 4, "{}", sc.candidates.len());
        assert_eq!(s.get("svc", OTHER, "/1"), Some(1000));
        assert_eq!(s.folded("svc"), 1001);
    }

    #[test]
    fn absurd_counts_saturate() {
        let mut s = CallStats::new(1, 10);
        s.add("svc", "a", "/p", u64::MAX);
        s.add("svc", "a", "/p", u64::MAX);
        s.add("svc", "b", "/p", u64::MAX);
        s.add("svc", "b", "/p", u64::MAX);
        s.tick();
        assert_eq!(s.get("svc", "a", "/p"), Some(u64::MAX));
        assert_eq!(s.get("svc", OTHER, "/p"), Some(u64::MAX));
        assert_eq!(s.folded("svc"), u64::MAX);
    }

    #[test]
    fn collector_exports_the_series() {
        let stats = Arc::new(std::sync::Mutex::new(CallStats::new(1, 10)));
        stats.lock().unwrap().add("svc", "a", "/p", 3);
        stats.lock().unwrap().add("svc", "b\"x", "/p", 4);
        let mut reg = prometheus_client::registry::Registry::default();
        reg.register_collector(Box::new(CallsCollector(stats)));
        let text = crate::metrics::encode(&reg);
        assert!(text.contains("# TYPE grl_calls counter"), "{text}");
        assert!(
            text.contains("grl_calls_total{service=\"svc\",caller=\"a\",procedure=\"/p\"} 3"),
            "{text}"
        );
        assert!(
            text.contains("grl_calls_total{service=\"svc\",caller=\"_other\",procedure=\"/p\"} 4"),
            "{text}"
        );
        assert!(
            text.contains("grl_calls_folded_total{service=\"svc\"} 4"),
            "{text}"
        );
    }
}
