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
//! A bucket's counts (for the controller's Prometheus counters) ride with its next entry: a
//! bucket whose rates stay put has its counts delivered at the latest with its refresh, and
//! the last forward of a graceful stop carries every count.
//!
//! The directives a controller answers follow the same idea: the report names the
//! `(epoch, version)` of the directives the aggregator holds, and the reply carries only the
//! directives changed since (merged here by [`merge_directives`]) or all of them when the
//! controller cannot say (another controller, a restart, a config change, a version older
//! than its bounded change log).

use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};

use crate::proto::{
    BucketCountsMsg, ReportSession, ZoneBucketMsg, ZoneDirectives, ZoneReport, PROTO_DELTA,
};

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

/// A bucket's four rates in thousandths of a request per second (the controller's unit).
type Units = [i64; 4];

fn units(b: &ZoneBucketMsg) -> Units {
    [
        b.offered_rps,
        b.admitted_rps,
        b.dropped_rps,
        b.shadow_dropped_rps,
    ]
    .map(|x| (x * 1000.0).round().clamp(0.0, 9.0e15) as i64)
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
    /// Counts of the buckets left out of a delta: the caller puts them back into its pending
    /// counts once the report is acknowledged (they go with a later entry).
    pub held_back: Vec<((String, String), BucketCountsMsg)>,
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
    pub fn prepare(
        &mut self,
        full: &ZoneReport,
        round: u64,
        opts: DeltaOptions,
        flush: bool,
    ) -> Prepared {
        if self.proto < PROTO_DELTA {
            return Prepared {
                report: full.clone(),
                held_back: Vec::new(),
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
                held_back: Vec::new(),
                entries,
                full: true,
            };
        }
        let mut entries = Vec::new();
        let mut held_back = Vec::new();
        let mut present: HashSet<(&str, &str)> = HashSet::with_capacity(full.buckets.len());
        for b in &full.buckets {
            present.insert((&b.service, &b.bucket));
            let u = units(b);
            let c = &b.counts;
            let has_counts = (c.offered | c.admitted | c.dropped | c.shadow_dropped) > 0;
            let send = match self.held.get(&(b.service.clone(), b.bucket.clone())) {
                None => true,
                Some(old) => {
                    changed(old, &u, opts.threshold)
                        || (flush && has_counts)
                        || refresh_due(&b.service, &b.bucket, round, opts.refresh_ticks)
                }
            };
            if send {
                entries.push((key(b), Some(u)));
                report.buckets.push(b.clone());
            } else if has_counts {
                held_back.push((key(b), c.clone()));
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
            held_back,
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
        let mut place: Vec<(Option<usize>, crate::proto::DirectiveMsg)> = sd
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
    use crate::proto::{ReplySession, ZoneDirectives};

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
    fn deltas_carry_changes_gone_buckets_refreshes_and_held_back_counts() {
        let opts = DeltaOptions {
            threshold: 0.05,
            refresh_ticks: 3,
        };
        let mut up = Upstream::default();
        // Before the controller announced protocol 4: the report as it is, no session.
        let first = up.prepare(&zone(&[("a", 100.0)]), 0, opts, false);
        assert_eq!(first.report.session, None);
        up.proto = PROTO_DELTA;
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
        let mut held_a = 0u64;
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
            if n.contains(&("a".into(), false)) {
                sent_a += 1;
            } else {
                held_a += p
                    .held_back
                    .iter()
                    .filter(|(k, _)| k.1 == "a")
                    .map(|(_, c)| c.offered)
                    .sum::<u64>();
            }
            let reply = ack(&p);
            up.answered(p, &reply);
        }
        // Within `refresh_ticks` forwards, a is refreshed exactly once; the other forwards
        // hand its counts back to the caller.
        assert_eq!(sent_a, 1);
        assert_eq!(held_a, 2 * 102);
        // The last forward of a stop carries every bucket with counts.
        let p = up.prepare(&now, 10, opts, true);
        assert_eq!(p.report.buckets.len(), 3);
        assert!(p.held_back.is_empty());
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
}
