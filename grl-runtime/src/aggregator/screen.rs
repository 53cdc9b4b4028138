//! What an aggregator takes from a client report before summing it, without I/O: only the
//! buckets the config serves for the report's service (unknown names and repeats dropped), each
//! rate cut to what one plausible instance can offer, within a per-service budget of rates
//! held. A client holding one service's credential can then move only that service's ratios,
//! and no further than one plausible instance of it could; the zone report carries at most the
//! configured buckets of each service, so one service never pushes another out of it.
//!
//! The plausibility cap of a client's offered rate for a bucket is the largest of
//! - `limit_multiple × limit / clients`: the client's share (one of the service's clients
//!   heard in the zone) of a zone offering `limit_multiple` times the bucket's limit;
//! - `peer_multiple ×` the mean rate of the bucket's other clients at the last forward (the
//!   largest one left out, so a lone liar does not raise its own cap): an instance busier than
//!   its peers, and a fleet-wide surge once one forward has seen it;
//! - [`MIN_CAP_RPS`].
//!
//! Buckets under an incident override (`fixed` directives) are not capped: their ratio is the
//! operator's. An instance that really receives more than its cap still drops its own excess:
//! clients apply at least the ratio their own rate alone asks for
//! ([`crate::client::Reporter::apply`]).

use std::collections::HashMap;

use crate::proto::{BucketCountsMsg, ClientReport, ConfigDoc, ZoneDirectives};

/// Rates below this are never cut (a request or two in a short interval).
pub const MIN_CAP_RPS: f64 = 10.0;

/// Rates of a report are computed over at least this interval: a client reports at most every
/// few milliseconds (its urgent reports), never faster.
pub const MIN_INTERVAL_MS: u64 = 10;

/// Client ids longer than this are refused (a client's id is `<service>-<16 hex digits>`).
pub const MAX_CLIENT_ID_LEN: usize = 256;

/// The bounds of what one client may claim.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Plausibility {
    /// A zone offers at most this many times a bucket's limit, shared by the service's clients.
    pub limit_multiple: f64,
    /// A client offers at most this many times its peers' mean rate for a bucket.
    pub peer_multiple: f64,
    /// Rate entries (one per client and bucket) held per service between forwards; a report
    /// that would pass it is refused (429).
    pub max_rates_per_service: usize,
}

impl Default for Plausibility {
    /// 10 × the limit over the service's clients, 4 × the peers' mean, 1,000,000 rates per
    /// service (about 90 MB).
    fn default() -> Self {
        Plausibility {
            limit_multiple: 10.0,
            peer_multiple: 4.0,
            max_rates_per_service: 1_000_000,
        }
    }
}

/// A bucket of the config served.
#[derive(Debug, Clone, Default)]
struct KnownBucket {
    /// The configured limit.
    limit_rps: f64,
    /// The effective limit of the last directive (an override's; 0: none).
    directive_limit: f64,
    /// `peer_multiple ×` the mean rate of the bucket's other clients at the last forward.
    peer_cap: f64,
    /// Under an incident override: not capped.
    fixed: bool,
    /// The report that last carried the bucket (a repeat in one report is dropped).
    seen: u64,
}

/// A service of the config served.
#[derive(Debug, Clone, Default)]
pub(crate) struct KnownService {
    buckets: HashMap<String, KnownBucket>,
    /// The service's clients heard within the horizon at the last forward (at least 1).
    clients: usize,
    /// Rate entries held for its clients.
    pub(crate) entries: usize,
}

/// Why entries of a client report were dropped or cut: the `reason` label of
/// `grl_report_entries_refused_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EntryRefusal {
    /// A bucket the config does not serve for the report's service: dropped.
    UnknownBucket,
    /// A bucket named twice in one report: the repeat dropped.
    Duplicate,
    /// An offered rate above the plausibility cap: the bucket's counts cut to it.
    RateCapped,
    /// An interval below [`MIN_INTERVAL_MS`]: the report's rates computed over that instead.
    ShortInterval,
}

impl EntryRefusal {
    /// The label value.
    pub fn reason(self) -> &'static str {
        match self {
            EntryRefusal::UnknownBucket => "unknown_bucket",
            EntryRefusal::Duplicate => "duplicate",
            EntryRefusal::RateCapped => "rate_capped",
            EntryRefusal::ShortInterval => "short_interval",
        }
    }
}

/// What [`Known::screen`] did to a report: entries dropped or cut, by reason.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Screened {
    /// Entries per reason (zero reasons left out).
    pub refused: Vec<(EntryRefusal, u64)>,
    /// Whether the report's service is in the config.
    pub known_service: bool,
}

/// The config's buckets by service, with the state the caps need.
#[derive(Debug, Default)]
pub(crate) struct Known {
    pub(crate) services: HashMap<String, KnownService>,
    reports: u64,
}

impl Known {
    /// The buckets of `doc`, keeping the client counts and peer caps of `self` for the services
    /// and buckets that remain.
    pub(crate) fn rebuild(&mut self, doc: &ConfigDoc) {
        let mut services = HashMap::with_capacity(doc.services.len());
        for f in &doc.services {
            let old = self.services.remove(&f.service);
            let mut s = KnownService {
                buckets: HashMap::with_capacity(f.buckets.len()),
                clients: old.as_ref().map_or(1, |o| o.clients),
                entries: old.as_ref().map_or(0, |o| o.entries),
            };
            for b in &f.buckets {
                let prev = old.as_ref().and_then(|o| o.buckets.get(&b.name));
                s.buckets.insert(
                    b.name.clone(),
                    KnownBucket {
                        limit_rps: b.limit_rps,
                        directive_limit: prev.map_or(0.0, |p| p.directive_limit),
                        peer_cap: prev.map_or(0.0, |p| p.peer_cap),
                        fixed: prev.is_some_and(|p| p.fixed),
                        seen: 0,
                    },
                );
            }
            services.insert(f.service.clone(), s);
        }
        self.services = services;
    }

    /// Follows a controller's answer (before it is merged into the directives held): a bucket
    /// under an override (`fixed`) is not capped, and the cap follows an overridden limit higher
    /// than the configured one. A delta answer names only the directives that changed.
    pub(crate) fn follow(&mut self, d: &ZoneDirectives) {
        if !d.session.is_some_and(|s| s.delta) {
            for s in self.services.values_mut() {
                for b in s.buckets.values_mut() {
                    (b.fixed, b.directive_limit) = (false, 0.0);
                }
            }
        }
        for sd in &d.services {
            let Some(s) = self.services.get_mut(&sd.service) else {
                continue;
            };
            for m in &sd.directives {
                if let Some(k) = s.buckets.get_mut(&m.bucket) {
                    k.fixed = m.fixed;
                    k.directive_limit = if m.limit_rps.is_finite() {
                        m.limit_rps
                    } else {
                        0.0
                    };
                }
            }
        }
    }

    /// Keeps in `r` only the buckets the config serves for its service, each once, with rates
    /// (over at least [`MIN_INTERVAL_MS`]) cut to the plausibility cap; sets `r.interval_ms` to
    /// the interval the rates are computed over. `new_client`: the report's client was not
    /// heard from within the horizon (it counts among the service's clients from now).
    pub(crate) fn screen(
        &mut self,
        r: &mut ClientReport,
        new_client: bool,
        p: &Plausibility,
    ) -> Screened {
        let mut out = Screened::default();
        let mut count = |why: EntryRefusal, n: u64| {
            if n > 0 {
                out.refused.push((why, n));
            }
        };
        if r.interval_ms < MIN_INTERVAL_MS {
            count(EntryRefusal::ShortInterval, r.buckets.len() as u64);
            r.interval_ms = MIN_INTERVAL_MS;
        }
        let Some(s) = self.services.get_mut(&r.service) else {
            count(EntryRefusal::UnknownBucket, r.buckets.len() as u64);
            r.buckets.clear();
            return out;
        };
        out.known_service = true;
        self.reports += 1;
        let this = self.reports;
        let share = p.limit_multiple / (s.clients.max(1) + new_client as usize) as f64;
        let secs = r.interval_ms as f64 / 1000.0;
        let (mut unknown, mut repeated, mut capped) = (0, 0, 0);
        r.buckets.retain_mut(|b| {
            let Some(k) = s.buckets.get_mut(b.bucket.as_str()) else {
                unknown += 1;
                return false;
            };
            if k.seen == this {
                repeated += 1;
                return false;
            }
            k.seen = this;
            if !k.fixed {
                let limit = k.limit_rps.max(k.directive_limit);
                let cap = (limit * share).max(k.peer_cap).max(MIN_CAP_RPS);
                if b.offered as f64 / secs > cap {
                    cut(b, (cap * secs).floor() as u64);
                    capped += 1;
                }
            }
            true
        });
        count(EntryRefusal::UnknownBucket, unknown);
        count(EntryRefusal::Duplicate, repeated);
        count(EntryRefusal::RateCapped, capped);
        out
    }

    /// At a forward: the service's clients heard within the horizon, its rate entries, and each
    /// bucket's peer cap from its clients' offered rates (`(sum, count, max)` by service and
    /// bucket).
    pub(crate) fn forwarded<'a>(
        &mut self,
        clients: impl IntoIterator<Item = (&'a str, usize, usize)>,
        offered: &HashMap<(String, String), (f64, u32, f64)>,
        p: &Plausibility,
    ) {
        for s in self.services.values_mut() {
            s.clients = 1;
            s.entries = 0;
            for b in s.buckets.values_mut() {
                b.peer_cap = 0.0;
            }
        }
        for (service, n, entries) in clients {
            if let Some(s) = self.services.get_mut(service) {
                s.clients = n.max(1);
                s.entries = entries;
            }
        }
        for ((service, bucket), &(sum, n, max)) in offered {
            if n < 2 {
                continue;
            }
            if let Some(b) = self
                .services
                .get_mut(service)
                .and_then(|s| s.buckets.get_mut(bucket))
            {
                b.peer_cap = p.peer_multiple * (sum - max).max(0.0) / (n - 1) as f64;
            }
        }
    }
}

/// Cuts `b`'s counts to `offered` requests, keeping admitted + dropped = offered and the shares
/// of each.
fn cut(b: &mut BucketCountsMsg, offered: u64) {
    let f = offered as f64 / b.offered as f64;
    let admitted = ((b.admitted as f64 * f).round() as u64).min(offered);
    let shadow = ((b.shadow_dropped as f64 * f).round() as u64).min(admitted);
    b.offered = offered;
    b.admitted = admitted;
    b.dropped = offered - admitted;
    b.shadow_dropped = shadow;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> ConfigDoc {
        serde_json::from_value(serde_json::json!({"version": "v1", "services": [
            {"service": "pay", "buckets": [
                {"name": "a", "caller": "a", "scope": "global", "limit_rps": 100.0,
                 "mode": "enforce", "policy": "peak"},
                {"name": "b", "caller": "b", "scope": "global", "limit_rps": 100.0,
                 "mode": "enforce", "policy": "peak"}]}]}))
        .unwrap()
    }

    fn report(service: &str, interval_ms: u64, buckets: &[(&str, u64)]) -> ClientReport {
        ClientReport {
            client_id: "c".into(),
            service: service.into(),
            version: "v1".into(),
            interval_ms,
            buckets: buckets
                .iter()
                .map(|&(b, n)| BucketCountsMsg {
                    bucket: b.into(),
                    offered: n,
                    admitted: n / 2,
                    dropped: n - n / 2,
                    shadow_dropped: n / 4,
                })
                .collect(),
            urgent: false,
            calls: Vec::new(),
        }
    }

    fn reasons(s: &Screened) -> Vec<(&'static str, u64)> {
        s.refused.iter().map(|(r, n)| (r.reason(), *n)).collect()
    }

    #[test]
    fn unknown_repeated_and_implausible_entries() {
        let mut k = Known::default();
        k.rebuild(&config());
        let p = Plausibility::default();
        // Another service's name, an invented one and a repeat are dropped; a plausible rate
        // stays as it is.
        let mut r = report("pay", 1000, &[("a", 50), ("x", 5), ("a", 50), ("b", 900)]);
        let s = k.screen(&mut r, false, &p);
        assert_eq!(reasons(&s), [("unknown_bucket", 1), ("duplicate", 1)]);
        assert_eq!(r.buckets.len(), 2);
        assert_eq!(r.buckets[0].offered, 50);
        // One client: 10 × 100 rps is its cap.
        let mut r = report("pay", 1000, &[("a", 5000)]);
        let s = k.screen(&mut r, false, &p);
        assert_eq!(reasons(&s), [("rate_capped", 1)]);
        let b = &r.buckets[0];
        assert_eq!(b.offered, 1000);
        assert_eq!(b.admitted + b.dropped, b.offered);
        assert!(b.shadow_dropped <= b.admitted);
        // A millisecond interval counts as ten.
        let mut r = report("pay", 1, &[("a", 5)]);
        let s = k.screen(&mut r, false, &p);
        assert_eq!(reasons(&s), [("short_interval", 1)]);
        assert_eq!(r.interval_ms, MIN_INTERVAL_MS);
        // A service the config does not have: everything dropped.
        let mut r = report("maps", 1000, &[("a", 5)]);
        let s = k.screen(&mut r, false, &p);
        assert!(!s.known_service);
        assert_eq!(reasons(&s), [("unknown_bucket", 1)]);
        assert!(r.buckets.is_empty());
    }

    #[test]
    fn caps_follow_clients_peers_and_overrides() {
        let mut k = Known::default();
        k.rebuild(&config());
        let p = Plausibility::default();
        // Four clients: the share is 10 × 100 / 4 = 250 rps; peers at 100 rps (the largest,
        // 5000, left out) allow 400.
        let offered = HashMap::from([(
            ("pay".to_string(), "a".to_string()),
            (100.0 * 3.0 + 5000.0, 4, 5000.0),
        )]);
        k.forwarded([("pay", 4, 8)], &offered, &p);
        let mut r = report("pay", 1000, &[("a", 5000), ("b", 5000)]);
        k.screen(&mut r, false, &p);
        assert_eq!(r.buckets[0].offered, 400);
        assert_eq!(r.buckets[1].offered, 250);
        // Under an override: as reported.
        let d: ZoneDirectives = serde_json::from_value(serde_json::json!({"version": "v1",
            "services": [{"service": "pay", "directives": [{"bucket": "b", "ratio": 0.5,
            "fleet_offered_rps": 1.0, "limit_rps": 1.0, "fixed": true}]}]}))
        .unwrap();
        k.follow(&d);
        let mut r = report("pay", 1000, &[("b", 5000)]);
        k.screen(&mut r, false, &p);
        assert_eq!(r.buckets[0].offered, 5000);
    }
}
