//! Candidate limits ([`grl_wire::Candidate`]): evaluated beside the limits in force, never
//! served. Every tick ([`Engine::evaluate_candidates`]) each candidate gets the drop ratio the
//! controller would compute for it, per scope key, with the production formula
//! ([`grl_core::control::drop_ratio`]), from one of two sources of offered rates:
//!
//! - **The in-force bucket** of the candidate's name when it matches the same caller and
//!   procedure (a changed limit, mode or scope): its offered rates from the zones' reports,
//!   regrouped by the candidate's scope when that differs (a narrower scope sees each region
//!   or zone apart).
//! - **The calls** the zones report per (service, caller, procedure) (protocol 2) otherwise (a
//!   new bucket, a changed caller or procedure): the requests matching the candidate that
//!   arrived since the previous tick, by the candidate's scope key of the zone that reported
//!   them, each judged at the key's rate. That rate is, as for a bucket's offered rate, the sum
//!   over the key's live zones of each zone's last rate: the calls of its last report over
//!   the time they cover (`calls_ms`, protocol 6: since the aggregator's last forward a
//!   controller took; else the time since the zone's previous report), kept until its next
//!   report or until the zone is forgotten. So the calls of a zone forwarding once a second to
//!   a controller ticking every 100 ms, or of forwards that failed for a while and arrive in
//!   one tick, are judged at the rate they were made at, not as if made within one tick.
//!   Only applied reports count (the calls of a report answered `resync` come again in full).
//!   Calls folded into `_other` by an aggregator's or a client's bound match only a candidate
//!   without that matcher; peer controllers forward no calls, so such a candidate of `global`
//!   scope sees this region's calls only.
//!
//! With peered regions, a `global` candidate of a `global` bucket counts the whole fleet (the
//! peers' sums are part of the bucket's `global` key, as for its ratio) at every region's
//! controller; a `region` or `zone` candidate regrouped from a `global` bucket counts this
//! region's zones only.
//!
//! Counts accumulate from the candidate's first evaluation by this engine: `offered` and
//! `virtual_dropped` in requests (rate × tick length, or counted calls), `enforced_dropped`
//! the in-force bucket's real drops over the same ticks (0 without one).

use std::collections::BTreeMap;

use grl_core::control::drop_ratio;
use grl_wire::{Candidate, CandidateReport, ZoneReport};
use schema::Scope;

use super::{lookup, Engine, RATE_UNIT};

/// One candidate's evaluation state.
#[derive(Debug, Clone)]
pub(super) struct CandEval {
    pub(super) c: Candidate,
    /// Engine time (`now_ms`) and unix ms of the first evaluation (None: not evaluated yet).
    last_ms: Option<u64>,
    since_unix_ms: u64,
    seconds: f64,
    offered: f64,
    virtual_dropped: f64,
    enforced_dropped: f64,
    /// Calls matching the candidate since the last evaluation, by scope key id.
    calls: Vec<(u32, u64)>,
}

impl CandEval {
    fn new(c: Candidate) -> CandEval {
        CandEval {
            c,
            last_ms: None,
            since_unix_ms: 0,
            seconds: 0.0,
            offered: 0.0,
            virtual_dropped: 0.0,
            enforced_dropped: 0.0,
            calls: Vec::new(),
        }
    }

    fn matches(&self, caller: &str, procedure: &str) -> bool {
        self.c.bucket.caller.as_deref().is_none_or(|c| c == caller)
            && self
                .c
                .bucket
                .procedure
                .as_deref()
                .is_none_or(|p| p == procedure)
    }
}

/// The candidates of an engine, their cumulative totals for `/metrics`.
#[derive(Debug, Default)]
pub(super) struct Candidates {
    pub(super) list: Vec<CandEval>,
    /// Per service, the candidates fed by calls (indices into `list`); rebuilt every tick
    /// (a config or override change moves bucket indices).
    by_service: BTreeMap<String, Vec<usize>>,
    /// `grl_candidate_{offered,virtual_dropped}_total{service,bucket}`: never decrease.
    totals: BTreeMap<(String, String), [f64; 2]>,
    /// Per candidate, the calls of the report being read (all 0 between reports).
    scratch: Vec<u64>,
}

/// The shortest time a zone's calls are rated over (ms): the calls of a report covering less
/// (a forward right after another) count, and the zone keeps its previous rate.
const MIN_CALLS_MS: u64 = 10;

/// The scope key id of `scope` for a zone with these region and zone key ids.
fn key_for(scope: Scope, region_key: u32, zone_key: u32) -> u32 {
    match scope {
        Scope::Global => 0,
        Scope::Region => region_key,
        Scope::Zone => zone_key,
    }
}

fn add_to(v: &mut Vec<(u32, f64)>, key: u32, x: f64) {
    match v.iter_mut().find(|e| e.0 == key) {
        Some(e) => e.1 += x,
        None => v.push((key, x)),
    }
}

impl Engine {
    /// Replaces the candidates; one of the same id and content keeps its counts.
    pub(super) fn set_candidates(&mut self, list: Vec<Candidate>) {
        let mut old: Vec<(usize, CandEval)> = std::mem::take(&mut self.candidates.list)
            .into_iter()
            .enumerate()
            .collect();
        // Old index -> new index of the candidates kept.
        let mut moved: Vec<Option<u32>> = vec![None; old.len()];
        self.candidates.list = list
            .into_iter()
            .enumerate()
            .map(|(j, c)| match old.iter().position(|o| o.1.c == c) {
                Some(p) => {
                    let (was, e) = old.swap_remove(p);
                    moved[was] = Some(j as u32);
                    e
                }
                None => CandEval::new(c),
            })
            .collect();
        // The zones' call rates follow their candidate.
        if moved.iter().enumerate().any(|(i, m)| *m != Some(i as u32)) {
            for z in self.zones.values_mut() {
                if z.calls_rps.is_empty() {
                    continue;
                }
                z.calls_rps = z
                    .calls_rps
                    .iter()
                    .filter_map(|&(j, r)| moved.get(j as usize).copied().flatten().map(|j| (j, r)))
                    .collect();
                z.calls_rps.sort_by_key(|e| e.0);
            }
        }
        self.index_candidates();
    }

    /// The candidates as pushed (never served).
    pub fn candidates(&self) -> impl Iterator<Item = &Candidate> {
        self.candidates.list.iter().map(|e| &e.c)
    }

    /// The in-force bucket a candidate is read from (same name, caller and procedure).
    fn candidate_source(&self, c: &Candidate) -> Option<usize> {
        lookup(&self.index, &c.service, &c.bucket.name).filter(|&i| {
            let b = &self.buckets[i].bucket;
            b.caller == c.bucket.caller && b.procedure == c.bucket.procedure
        })
    }

    /// Which candidates read calls, by service.
    fn index_candidates(&mut self) {
        let mut by: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        for (j, e) in self.candidates.list.iter().enumerate() {
            if self.candidate_source(&e.c).is_none() {
                by.entry(e.c.service.clone()).or_default().push(j);
            }
        }
        self.candidates.by_service = by;
    }

    /// Counts an applied zone report's calls for the candidates fed by calls, and sets the
    /// zone's rate of calls for each: their count over the time they cover (the report's
    /// `calls_ms`; else since `prev_at`, the zone's previous report; else, or below
    /// [`MIN_CALLS_MS`], left as it was).
    pub(super) fn candidate_calls(&mut self, r: &ZoneReport, now_ms: u64, prev_at: Option<u64>) {
        if self.candidates.by_service.is_empty() {
            return;
        }
        let covered_ms = r.calls_ms.or_else(|| {
            (!r.calls.is_empty())
                .then(|| prev_at.map(|at| now_ms.saturating_sub(at)))
                .flatten()
        });
        if r.calls.is_empty() && covered_ms.is_none() {
            return;
        }
        let cands = &mut self.candidates;
        cands.scratch.resize(cands.list.len(), 0);
        // The candidates these calls match, in order.
        let mut touched: Vec<usize> = Vec::new();
        for m in &r.calls {
            let Some(js) = cands.by_service.get(&m.service) else {
                continue;
            };
            for &j in js {
                if m.count == 0 || !cands.list[j].matches(&m.caller, &m.procedure) {
                    continue;
                }
                if cands.scratch[j] == 0 {
                    touched.push(j);
                }
                cands.scratch[j] = cands.scratch[j].saturating_add(m.count);
            }
        }
        touched.sort_unstable();
        let rates: Option<Vec<(u32, f64)>> =
            covered_ms.filter(|&ms| ms >= MIN_CALLS_MS).map(|ms| {
                let secs = ms as f64 / 1000.0;
                touched
                    .iter()
                    .map(|&j| (j as u32, cands.scratch[j] as f64 / secs))
                    .collect()
            });
        // Applied: the zone is in, with its scope keys.
        let Some(z) = self.zones.get_mut(&r.aggregator_id) else {
            touched.iter().for_each(|&j| self.candidates.scratch[j] = 0);
            return;
        };
        for &j in &touched {
            let n = std::mem::take(&mut self.candidates.scratch[j]);
            let e = &mut self.candidates.list[j];
            // Counted from the candidate's first evaluation on.
            if e.last_ms.is_none() {
                continue;
            }
            let key = key_for(e.c.bucket.scope, z.region_key, z.zone_key);
            match e.calls.iter_mut().find(|c| c.0 == key) {
                Some(c) => c.1 = c.1.saturating_add(n),
                None => e.calls.push((key, n)),
            }
        }
        if let Some(rates) = rates {
            z.calls_rps = rates;
            z.calls_at_ms = now_ms;
        }
    }

    /// Per candidate fed by calls (by index), the rate of the calls matching it per scope key:
    /// the sum of the live zones' last rates, each set within the zone's horizon.
    fn candidate_call_rates(&self, now_ms: u64) -> BTreeMap<usize, Vec<(u32, f64)>> {
        let mut out: BTreeMap<usize, Vec<(u32, f64)>> = BTreeMap::new();
        for z in self.zones.values() {
            if z.calls_rps.is_empty() || now_ms.saturating_sub(z.calls_at_ms) > self.horizon(z) {
                continue;
            }
            for &(j, rps) in &z.calls_rps {
                let Some(e) = self.candidates.list.get(j as usize) else {
                    continue;
                };
                let key = key_for(e.c.bucket.scope, z.region_key, z.zone_key);
                add_to(out.entry(j as usize).or_default(), key, rps);
            }
        }
        out
    }

    /// One evaluation of every candidate at `now_ms` (the engine's clock, as given to
    /// [`Engine::recompute`], which should run first) and `unix_ms`: the time since the
    /// previous evaluation at the rates and ratios of now. A candidate's first evaluation only
    /// starts its clock.
    pub fn evaluate_candidates(&mut self, now_ms: u64, unix_ms: u64) {
        self.index_candidates();
        let rates = if self.candidates.by_service.is_empty() {
            BTreeMap::new()
        } else {
            self.candidate_call_rates(now_ms)
        };
        let mut per_key: Vec<(u32, f64)> = Vec::new();
        for j in 0..self.candidates.list.len() {
            let Some(last) = self.candidates.list[j].last_ms else {
                let e = &mut self.candidates.list[j];
                e.last_ms = Some(now_ms);
                e.since_unix_ms = unix_ms;
                e.calls.clear();
                continue;
            };
            let dt = now_ms.saturating_sub(last) as f64 / 1000.0;
            if dt <= 0.0 {
                continue;
            }
            let c = self.candidates.list[j].c.clone();
            let c = &c;
            let limit = c.bucket.limit_rps;
            per_key.clear();
            let (offered, virtual_dropped);
            let named = lookup(&self.index, &c.service, &c.bucket.name);
            match self.candidate_source(c) {
                Some(i) => {
                    let b = &self.buckets[i];
                    if b.bucket.scope == c.bucket.scope {
                        per_key.extend(b.keys.iter().map(|k| (k.id, k.offered_rps)));
                    } else {
                        // A region or zone candidate is this region's: the sums peer
                        // controllers send (global buckets only) are theirs to judge.
                        let local_only = c.bucket.scope != Scope::Global;
                        for (id, z) in &self.zones {
                            if local_only && id.starts_with(super::PEER_PREFIX) {
                                continue;
                            }
                            if let Ok(p) = z.resolved.binary_search_by_key(&i, |e| e.0) {
                                let key = key_for(c.bucket.scope, z.region_key, z.zone_key);
                                add_to(&mut per_key, key, z.resolved[p].1[0] as f64 / RATE_UNIT);
                            }
                        }
                    }
                    self.candidates.list[j].calls.clear();
                    offered = per_key.iter().map(|k| k.1).sum::<f64>() * dt;
                    virtual_dropped = per_key
                        .iter()
                        .map(|&(_, rps)| drop_ratio(rps, limit) * rps)
                        .sum::<f64>()
                        * dt;
                }
                None => {
                    // Each call judged at its key's rate; without one (no report said over
                    // what time its calls were made), at its count over the tick.
                    let calls = std::mem::take(&mut self.candidates.list[j].calls);
                    let key_rates = rates.get(&j).map_or(&[][..], |v| v.as_slice());
                    offered = calls.iter().map(|c| c.1 as f64).sum();
                    virtual_dropped = calls
                        .iter()
                        .map(|&(key, n)| {
                            let rps = key_rates
                                .iter()
                                .find(|k| k.0 == key)
                                .map(|k| k.1)
                                .filter(|&r| r > 0.0)
                                .unwrap_or(n as f64 / dt);
                            drop_ratio(rps, limit) * n as f64
                        })
                        .sum();
                }
            }
            let enforced = named.map_or(0.0, |i| {
                self.buckets[i]
                    .keys
                    .iter()
                    .map(|k| k.dropped_rps)
                    .sum::<f64>()
                    * dt
            });
            let key = (c.service.clone(), c.bucket.name.clone());
            let e = &mut self.candidates.list[j];
            e.last_ms = Some(now_ms);
            e.seconds += dt;
            e.offered += offered;
            e.virtual_dropped += virtual_dropped;
            e.enforced_dropped += enforced;
            let t = self.candidates.totals.entry(key).or_default();
            t[0] += offered;
            t[1] += virtual_dropped;
        }
    }

    /// Every candidate's counts since its first evaluation (`GET /v1/candidates`).
    pub fn candidate_reports(&self) -> Vec<CandidateReport> {
        self.candidates
            .list
            .iter()
            .map(|e| CandidateReport {
                id: e.c.id.clone(),
                service: e.c.service.clone(),
                bucket: e.c.bucket.name.clone(),
                limit_rps: e.c.bucket.limit_rps,
                mode: e.c.bucket.mode,
                in_force_limit_rps: lookup(&self.index, &e.c.service, &e.c.bucket.name)
                    .map(|i| self.buckets[i].bucket.limit_rps),
                since_ms: e.since_unix_ms,
                seconds: e.seconds,
                offered: e.offered,
                virtual_dropped: e.virtual_dropped,
                enforced_dropped: e.enforced_dropped,
                virtual_drop_share: if e.offered > 0.0 {
                    e.virtual_dropped / e.offered
                } else {
                    0.0
                },
            })
            .collect()
    }

    /// `grl_candidate_{offered,virtual_dropped}_total` by (service, bucket): cumulative over
    /// this engine's life, candidates gone included.
    pub fn candidate_totals(&self) -> impl Iterator<Item = (&str, &str, [f64; 2])> {
        self.candidates
            .totals
            .iter()
            .map(|((s, b), t)| (s.as_str(), b.as_str(), *t))
    }
}
