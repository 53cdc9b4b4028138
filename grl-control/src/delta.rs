//! Delta zone reports and delta directives (protocol 4), the aggregator's side.
//!
//! An aggregator keeps one [`Upstream`] per controller it reports to (in [`Upstreams`], keyed
//! by the controller's base URL; the replica whose directives it serves and every standby
//! replica alike): the protocol version the controller announced and the delta session with
//! it. Once the controller announced protocol 4, a zone report carries only the
//! buckets whose rates changed materially since what that controller holds (the last report
//! it acknowledged), the buckets gone since, and a rolling share of the others (every bucket
//! at least every `refresh_ticks` forwards); the first report of a session, and the one after
//! a controller answered `resync`, is full. The controller keeps a bucket's last rates until
//! the zone reports it again, marks it gone, or the whole zone expires (silent for the zone
//! TTL: every report, a delta too, keeps the zone alive), so the sums it computes are those of
//! the full reports (exactly so with `threshold` 0).
//!
//! A bucket's counts (for the controller's Prometheus counters) go with every forward: a
//! bucket whose rates stay put but that has counts is sent as a counts-only entry (protocol
//! 7: the controller counts them and keeps the rates it holds), or whole to a controller of
//! protocols 4 to 6. Counts are never held back: a steady trickle, whose rates barely move,
//! was counted only at its refreshes, and its last counts were lost when it stopped.
//!
//! The directives a controller answers follow the same idea: the report names the
//! `(epoch, version)` of the directives the aggregator holds, and the reply carries only the
//! directives changed since (merged here by [`merge_directives`]) or all of them when the
//! controller cannot say (another controller, a restart, a config change, a version older
//! than its bounded change log).

use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};

use grl_wire::{
    BucketCountsMsg, ReportSession, ZoneBucketMsg, ZoneDirectives, ZoneReport, PROTO_COUNTS,
    PROTO_DELTA,
};

/// Counts clients reported that no controller has taken yet, by (service, bucket).
pub type Pending = HashMap<(String, String), BucketCountsMsg>;

/// Moves every pending count into the zone's entries: a bucket's into its entry, the counts
/// of buckets no client offers any more (the clients' last counts, or counts put back after
/// a forward no controller took) into entries of their own with rates 0, which is what the
/// zone contributes. `pending` is left empty; the entries end sorted by service and bucket.
pub fn attach_pending(buckets: &mut Vec<ZoneBucketMsg>, pending: &mut Pending) {
    for b in buckets.iter_mut() {
        if let Some(c) = pending.remove(&(b.service.clone(), b.bucket.clone())) {
            b.counts = c;
        }
    }
    buckets.extend(
        pending
            .drain()
            .map(|((service, bucket), counts)| ZoneBucketMsg {
                counts,
                service,
                bucket,
                ..Default::default()
            }),
    );
    buckets.sort_by(|a, b| (&a.service, &a.bucket).cmp(&(&b.service, &b.bucket)));
}

/// Puts the counts of `report` back into `pending` (a forward that no controller took).
pub fn restore_pending(pending: &mut Pending, report: &ZoneReport) {
    for b in &report.buckets {
        let c = &b.counts;
        if (c.offered | c.admitted | c.dropped | c.shadow_dropped) == 0 {
            continue;
        }
        let e = pending
            .entry((b.service.clone(), b.bucket.clone()))
            .or_default();
        if e.bucket.is_empty() {
            e.bucket = c.bucket.clone();
        }
        e.add(c);
    }
}

/// How zone reports shrink to deltas.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeltaOptions {
    /// A bucket is reported again when one of its four rates moved by more than this share of
    /// the larger of its old and new value (0: any change at all, 1/1000 rps being the unit).
    pub threshold: f64,
    /// Every bucket is reported at least every this many forwards (its refresh turn comes
    /// round by a hash of its name, so each forward refreshes about 1/`refresh_ticks` of
    /// the buckets). 0 or 1: every bucket every forward (full reports).
    pub refresh_ticks: u64,
}

impl Default for DeltaOptions {
    fn default() -> Self {
        DeltaOptions {
            threshold: 0.01,
            refresh_ticks: 30,
        }
    }
}

/// A bucket's four rates and its four offered rates by tier (-1 each when the zone's mix of
/// tiers is unknown), in thousandths of a request per second (the controller's unit).
type Units = [i64; 8];

fn units(b: &ZoneBucketMsg) -> Units {
    let unit = |x: f64| (x * 1000.0).round().clamp(0.0, 9.0e15) as i64;
    let rates = [
        b.offered_rps,
        b.admitted_rps,
        b.dropped_rps,
        b.shadow_dropped_rps,
    ];
    let tiers = b.tier_offered_rps.map_or([-1; 4], |t| t.map(unit));
    let mut u = [0; 8];
    u[..4].copy_from_slice(&rates.map(unit));
    u[4..].copy_from_slice(&tiers);
    u
}

fn changed(old: &Units, new: &Units, threshold: f64) -> bool {
    old.iter()
        .zip(new)
        .any(|(&o, &n)| o != n && (o - n).unsigned_abs() as f64 > threshold * o.max(n) as f64)
}

/// Whether `(service, bucket)`'s refresh turn is `round`.
fn refresh_due(service: &str, bucket: &str, round: u64, every: u64) -> bool {
    if every <= 1 {
        return true;
    }
    // SipHash with fixed keys: the same turn in every process.
    #[allow(deprecated)]
    let mut h = std::hash::SipHasher::new();
    (service, bucket).hash(&mut h);
    h.finish().wrapping_add(round).is_multiple_of(every)
}

/// A report prepared for one upstream: what it will hold once it applies it.
#[derive(Debug)]
pub struct Prepared {
    /// The report to send.
    pub report: ZoneReport,
    entries: Vec<((String, String), Option<Units>)>,
    full: bool,
}

/// One controller as an aggregator's forwarder sees it.
#[derive(Debug)]
pub struct Upstream {
    /// The protocol version the controller announced (1 until it answered).
    pub proto: u32,
    session: u64,
    next_seq: u64,
    /// The report the controller last applied; None: the next report is full.
    acked: Option<u64>,
    /// The rates the controller holds of this zone, by (service, bucket).
    held: HashMap<(String, String), Units>,
    /// The `(epoch, version)` of the controller's last reply. A standby replica's reports
    /// name it (the aggregator serves another replica's directives and drops the standby's),
    /// so that the standby answers with the directives changed since, not with all of them.
    pub seen: Option<(u64, u64)>,
}

impl Default for Upstream {
    fn default() -> Self {
        Upstream {
            proto: 1,
            // Below 2^53: any JSON reader keeps it exact.
            session: rand::random::<u64>() & ((1 << 53) - 1),
            next_seq: 1,
            acked: None,
            held: HashMap::new(),
            seen: None,
        }
    }
}

impl Upstream {
    /// The report to send this controller: `full` (every bucket the zone has, with every
    /// count) as it is for a controller before protocol 4 or without a session yet; else the
    /// buckets that changed, are gone or are due for refresh. `flush`: every bucket with
    /// counts goes too (the last forward of a graceful stop).
    /// An upstream before protocol 8 gets no tier fields (it refuses them).
    pub fn prepare(
        &mut self,
        full: &ZoneReport,
        round: u64,
        opts: DeltaOptions,
        flush: bool,
    ) -> Prepared {
        let mut p = self.prepare_rates(full, round, opts, flush);
        if self.proto < grl_wire::PROTO_TIERS {
            for b in &mut p.report.buckets {
                b.tier_offered_rps = None;
                b.counts.tiers.clear();
            }
        }
        p
    }

    fn prepare_rates(
        &mut self,
        full: &ZoneReport,
        round: u64,
        opts: DeltaOptions,
        flush: bool,
    ) -> Prepared {
        if self.proto < PROTO_DELTA {
            return Prepared {
                report: full.clone(),
                entries: Vec::new(),
                full: true,
            };
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        let mut report = ZoneReport {
            aggregator_id: full.aggregator_id.clone(),
            region: full.region.clone(),
            zone: full.zone.clone(),
            buckets: Vec::new(),
            calls: full.calls.clone(),
            calls_ms: full.calls_ms,
            session: Some(ReportSession {
                id: self.session,
                seq,
                base: self.acked,
                directives: None,
            }),
        };
        let key = |b: &ZoneBucketMsg| (b.service.clone(), b.bucket.clone());
        if self.acked.is_none() {
            report.buckets = full.buckets.clone();
            let entries = full
                .buckets
                .iter()
                .map(|b| (key(b), Some(units(b))))
                .collect();
            return Prepared {
                report,
                entries,
                full: true,
            };
        }
        let mut entries = Vec::new();
        let mut present: HashSet<(&str, &str)> = HashSet::with_capacity(full.buckets.len());
        for b in &full.buckets {
            present.insert((&b.service, &b.bucket));
            let u = units(b);
            let c = &b.counts;
            let has_counts = (c.offered | c.admitted | c.dropped | c.shadow_dropped) > 0;
            let counts_only = self.proto >= PROTO_COUNTS;
            let send = match self.held.get(&(b.service.clone(), b.bucket.clone())) {
                None => true,
                Some(old) => {
                    changed(old, &u, opts.threshold)
                        || (has_counts && (flush || !counts_only))
                        || refresh_due(&b.service, &b.bucket, round, opts.refresh_ticks)
                }
            };
            if send {
                entries.push((key(b), Some(u)));
                report.buckets.push(b.clone());
            } else if has_counts {
                report.buckets.push(ZoneBucketMsg {
                    service: b.service.clone(),
                    bucket: b.bucket.clone(),
                    counts: c.clone(),
                    counts_only: true,
                    ..Default::default()
                });
            }
        }
        for (service, bucket) in self.held.keys() {
            if !present.contains(&(service.as_str(), bucket.as_str())) {
                entries.push(((service.clone(), bucket.clone()), None));
                report.buckets.push(ZoneBucketMsg {
                    service: service.clone(),
                    bucket: bucket.clone(),
                    counts: BucketCountsMsg {
                        bucket: bucket.clone(),
                        ..Default::default()
                    },
                    gone: true,
                    ..Default::default()
                });
            }
        }
        Prepared {
            report,
            entries,
            full: false,
        }
    }

    /// Records the controller's answer to `sent`: what it applied is what it now holds; a
    /// `resync` means the next report is full. Without a session in the answer (a controller
    /// before protocol 4) nothing is held.
    pub fn answered(&mut self, sent: Prepared, reply: &ZoneDirectives) {
        self.seen = directives_held(reply);
        let Some(rs) = reply.session else {
            self.acked = None;
            self.held.clear();
            return;
        };
        let seq = sent.report.session.map(|s| s.seq);
        if rs.resync || rs.applied.is_none() || rs.applied != seq {
            self.acked = None;
            self.held.clear();
            return;
        }
        if sent.full {
            self.held.clear();
        }
        for (k, u) in sent.entries {
            match u {
                Some(u) => {
                    self.held.insert(k, u);
                }
                None => {
                    self.held.remove(&k);
                }
            }
        }
        // The map shrinks back when a zone lost most of its buckets.
        if self.held.capacity() > 2 * self.held.len() + 1024 {
            self.held.shrink_to_fit();
        }
        self.acked = seq;
    }

    /// A report got no answer: the controller may or may not have applied it, and its
    /// protocol version is unknown again; the next report is full.
    pub fn failed(&mut self) {
        self.proto = 1;
        self.seen = None;
        self.acked = None;
        self.held.clear();
    }

    /// Whether the next report to this controller is full.
    pub fn needs_full(&self) -> bool {
        self.acked.is_none()
    }
}

/// The upstream controllers of one aggregator, by base URL: the forwarder's and the standby
/// copies' (each replica keeps its own delta session), behind a lock each that a report holds
/// until its answer, so that one replica has at most one report in flight.
#[derive(Debug, Default)]
pub struct Upstreams {
    by_url: HashMap<String, std::sync::Arc<tokio::sync::Mutex<Upstream>>>,
}

impl Upstreams {
    /// The state of controller `url` (a new session the first time).
    pub fn get(&mut self, url: &str) -> std::sync::Arc<tokio::sync::Mutex<Upstream>> {
        self.by_url.entry(url.to_string()).or_default().clone()
    }
}

/// Applies a controller's reply to the directives an aggregator holds: a delta reply is
/// merged by service and bucket, any other reply replaces them.
pub fn merge_directives(held: &mut ZoneDirectives, reply: ZoneDirectives) {
    let delta = reply.session.is_some_and(|s| s.delta);
    if !delta {
        *held = reply;
        return;
    }
    held.version = reply.version;
    held.session = reply.session;
    for sd in reply.services {
        let Some(h) = held.services.iter_mut().find(|h| h.service == sd.service) else {
            held.services.push(sd);
            continue;
        };
        let pos: HashMap<&str, usize> = h
            .directives
            .iter()
            .enumerate()
            .map(|(p, d)| (d.bucket.as_str(), p))
            .collect();
        let mut place: Vec<(Option<usize>, grl_wire::DirectiveMsg)> = sd
            .directives
            .into_iter()
            .map(|d| (pos.get(d.bucket.as_str()).copied(), d))
            .collect();
        drop(pos);
        for (p, d) in place.drain(..) {
            match p {
                Some(p) => h.directives[p] = d,
                None => h.directives.push(d),
            }
        }
    }
}

/// What the aggregator sends as `ReportSession::directives`: the directives it holds.
pub fn directives_held(held: &ZoneDirectives) -> Option<(u64, u64)> {
    held.session.map(|s| (s.epoch, s.version))
}

#[cfg(test)]
mod tests {
    use super::*;
    use grl_wire::{ReplySession, ZoneDirectives};

    fn zone(rates: &[(&str, f64)]) -> ZoneReport {
        crate::tests::zone_report("agg", "r", "z", rates)
    }

    fn ack(p: &Prepared) -> ZoneDirectives {
        ZoneDirectives {
            session: Some(ReplySession {
                applied: p.report.session.map(|s| s.seq),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn names(p: &Prepared) -> Vec<(String, bool)> {
        p.report
            .buckets
            .iter()
            .map(|b| (b.bucket.clone(), b.gone))
            .collect()
    }

    #[test]
    fn deltas_carry_changes_gone_buckets_refreshes_and_every_count() {
        let opts = DeltaOptions {
            threshold: 0.05,
            refresh_ticks: 3,
        };
        let mut up = Upstream::default();
        // Before the controller announced protocol 4: the report as it is, no session.
        let first = up.prepare(&zone(&[("a", 100.0)]), 0, opts, false);
        assert_eq!(first.report.session, None);
        up.proto = PROTO_COUNTS;
        let full = up.prepare(
            &zone(&[("a", 100.0), ("b", 10.0), ("c", 5.0)]),
            0,
            opts,
            false,
        );
        assert_eq!(full.report.session.unwrap().base, None);
        assert_eq!(full.report.buckets.len(), 3);
        let reply = ack(&full);
        up.answered(full, &reply);
        // a moves 2% (held), b 20% (sent), c is gone, d is new; refresh turns aside.
        let now = zone(&[("a", 102.0), ("b", 12.0), ("d", 1.0)]);
        let mut sent_a = 0;
        let mut counted_a = 0u64;
        for round in 1..=3 {
            let p = up.prepare(&now, round, opts, false);
            let s = p.report.session.unwrap();
            assert_eq!(s.base, Some(s.seq - 1), "round {round}");
            let n = names(&p);
            if round == 1 {
                assert!(n.contains(&("b".into(), false)), "{n:?}");
                assert!(n.contains(&("c".into(), true)), "{n:?}");
                assert!(n.contains(&("d".into(), false)), "{n:?}");
            } else {
                // A gone bucket the controller acknowledged is not sent again.
                assert!(!n.iter().any(|(b, _)| b == "c"), "{n:?}");
            }
            let a: Vec<&ZoneBucketMsg> = p
                .report
                .buckets
                .iter()
                .filter(|b| b.bucket == "a")
                .collect();
            // Every forward carries a's counts: whole at its refresh, else counts only.
            assert_eq!(a.len(), 1, "round {round}");
            counted_a += a[0].counts.offered;
            if !a[0].counts_only {
                sent_a += 1;
                assert_eq!(a[0].offered_rps, 102.0);
            } else {
                assert_eq!(a[0].offered_rps, 0.0);
            }
            let reply = ack(&p);
            up.answered(p, &reply);
        }
        // Within `refresh_ticks` forwards, a is refreshed exactly once; every forward counts.
        assert_eq!(sent_a, 1);
        assert_eq!(counted_a, 3 * 102);
        // A counts-only entry changes nothing the upstream holds: a is still held at 102.
        assert_eq!(up.held[&("svc".to_string(), "a".to_string())][0], 102_000);
        // A controller of protocols 4 to 6 gets a bucket with counts whole every forward.
        up.proto = PROTO_DELTA;
        let p = up.prepare(&now, 5, opts, false);
        assert!(p.report.buckets.iter().all(|b| !b.counts_only));
        assert_eq!(p.report.buckets.len(), 3);
        // The last forward of a stop carries every bucket with counts.
        let p = up.prepare(&now, 10, opts, true);
        assert_eq!(p.report.buckets.len(), 3);
        // A resync answer: the next report is full.
        let mut reply = ack(&p);
        reply.session.as_mut().unwrap().resync = true;
        reply.session.as_mut().unwrap().applied = None;
        up.answered(p, &reply);
        assert!(up.needs_full());
        assert_eq!(
            up.prepare(&now, 11, opts, false)
                .report
                .session
                .unwrap()
                .base,
            None
        );
    }

    /// What became of a forward in [`counts_reach_the_controller_or_are_counted`].
    #[derive(Debug, Clone, Copy)]
    enum Outcome {
        /// Applied and answered.
        Answered,
        /// Never reached a controller: the counts go again with the next forward.
        Unreached,
        /// Applied, but the answer was lost: counted as unconfirmed.
        AnswerLost,
        /// The controller restarted before it (its counters start again from 0).
        Restarted,
    }

    fn outcome() -> impl proptest::strategy::Strategy<Value = Outcome> {
        use proptest::prelude::*;
        prop_oneof![
            6 => Just(Outcome::Answered),
            1 => Just(Outcome::Unreached),
            1 => Just(Outcome::AnswerLost),
            1 => Just(Outcome::Restarted),
        ]
    }

    proptest::proptest! {
        /// The count path from an aggregator's pending counts through delta sessions to the
        /// controller's totals, over random traffic (buckets that start, stop and hold
        /// steady), forwards that fail before or after the controller applied them, and
        /// controller restarts: every count the clients reported is at the controller, or
        /// (when an answer was lost) in the unconfirmed count, never twice.
        #[test]
        fn counts_reach_the_controller_or_are_counted(
            steps in proptest::collection::vec(
                (proptest::collection::vec(0u64..4, 3), outcome(), 1u64..4), 1..60),
            counts_only in proptest::bool::ANY,
            threshold in proptest::sample::select(vec![0.0, 0.01, 0.5]),
        ) {
            use crate::engine::Engine;
            use grl_wire::ConfigDoc;
            use schema::{BucketFile, Scope};
            let names = ["a", "b", "c"];
            let cfg = ConfigDoc {
                version: "v1".into(),
                services: vec![BucketFile {
                    criticality: Default::default(),
                    service: "svc".into(),
                    buckets: names
                        .iter()
                        .map(|n| crate::tests::bucket(n, Scope::Global, 1e6))
                        .collect(),
                }],
                candidates: Vec::new(),
            };
            let opts = DeltaOptions { threshold, refresh_ticks: 30 };
            let proto = if counts_only { PROTO_COUNTS } else { PROTO_DELTA };
            let mut engine = Engine::new(cfg.clone(), 60_000);
            let mut up = Upstream { proto, ..Default::default() };
            let mut pending = Pending::new();
            let (mut counted, mut unconfirmed, mut earlier_engines) = (0u64, 0u64, 0u64);
            let total = |e: &Engine| e.totals().map(|(_, _, c)| crate::engine::whole(c)[0]).sum::<u64>();
            let mut now = 0u64;
            // Two quiet forwards at the end: every bucket stops, what is pending goes.
            let quiet = [(vec![0, 0, 0], Outcome::Answered, 1), (vec![0, 0, 0], Outcome::Answered, 1)];
            for (round, (counts, outcome, scale)) in steps.iter().chain(quiet.iter()).enumerate() {
                now += 1000;
                let mut buckets = Vec::new();
                for (name, &c) in names.iter().zip(counts) {
                    let c = c * scale;
                    if c == 0 {
                        continue;
                    }
                    counted += c;
                    pending.entry(("svc".into(), (*name).into())).or_default().add(
                        &BucketCountsMsg { bucket: (*name).into(), offered: c, admitted: c, ..Default::default() });
                    buckets.push(ZoneBucketMsg {
                        service: "svc".into(),
                        bucket: (*name).into(),
                        offered_rps: c as f64,
                        admitted_rps: c as f64,
                        ..Default::default()
                    });
                }
                attach_pending(&mut buckets, &mut pending);
                let full = ZoneReport {
                    aggregator_id: "agg".into(),
                    region: "r".into(),
                    zone: "z".into(),
                    buckets,
                    calls: Vec::new(),
                    calls_ms: None,
                    session: None,
                };
                if let Outcome::Restarted = outcome {
                    earlier_engines += total(&engine);
                    engine = Engine::new(cfg.clone(), 60_000);
                }
                // `forward_to`: one more request after a `resync`.
                for _ in 0..2 {
                    let p = up.prepare(&full, round as u64, opts, false);
                    match outcome {
                        Outcome::Unreached => {
                            up.failed();
                            up.proto = proto;
                            restore_pending(&mut pending, &full);
                        }
                        Outcome::AnswerLost => {
                            engine.answer(&p.report, now, now / 1000);
                            up.failed();
                            up.proto = proto;
                            unconfirmed += full.buckets.iter().map(|b| b.counts.offered).sum::<u64>();
                        }
                        Outcome::Answered | Outcome::Restarted => {
                            let d = engine.answer(&p.report, now, now / 1000);
                            let resync = d.session.is_some_and(|r| r.resync);
                            up.answered(p, &d);
                            if resync {
                                continue;
                            }
                        }
                    }
                    break;
                }
            }
            proptest::prop_assert!(pending.is_empty());
            let at_controller = earlier_engines + total(&engine);
            proptest::prop_assert!(at_controller <= counted + unconfirmed,
                "{at_controller} at the controller, {counted} counted, {unconfirmed} unconfirmed");
            proptest::prop_assert!(at_controller + unconfirmed >= counted,
                "{at_controller} at the controller, {counted} counted, {unconfirmed} unconfirmed");
            if unconfirmed == 0 {
                proptest::prop_assert_eq!(at_controller, counted);
            }
        }
    }
}
