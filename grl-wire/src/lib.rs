//! Wire types between the tiers (JSON over HTTP; between clients and aggregators also the
//! binary encoding of [`binary`], once the aggregator announced protocol 3): the config
//! document the controller serves, client and zone reports, directives, the rows of
//! `GET /v1/reports` ([`reports`]) and the protocol versions. Every tier (`grl-client`, the
//! `grl` binary's aggregator and controller) and `rlc` use these types; serde only, no I/O.

#![warn(missing_docs)]

pub mod binary;
pub mod candidates;
pub mod reports;
pub mod rollout;

pub use candidates::{Candidate, CandidateReport, CandidatesReply};
pub use reports::{Cursor, ReportCounts, ReportPage, ReportRow, Tick};

use serde::{Deserialize, Serialize};

use schema::criticality::TIERS;
use schema::{BucketFile, Criticality};

/// Request and response header carrying the sender's protocol version. Versions only add
/// optional fields; a sender includes a field of version N only once the receiver has
/// answered with `grl-proto: N` or more, so peers of an older version (which refuse unknown
/// fields and ignore unknown headers) keep working.
pub const PROTO_HEADER: &str = "grl-proto";

/// This build's protocol version. 1: the original messages (no header); 2: `calls` in
/// [`ClientReport`] and [`ZoneReport`]; 3: an aggregator reads [`ClientReport`] in the
/// binary encoding ([`binary::CONTENT_TYPE`]) and answers it in the same encoding; 4: delta
/// zone reports and delta directives ([`ZoneReport::session`], [`ZoneBucketMsg::gone`],
/// [`ZoneDirectives::session`]); 5: candidates in `PUT /v1/config`
/// ([`ConfigDoc::candidates`]) and `GET /v1/candidates` on the controller; 6: the time a
/// zone report's calls cover ([`ZoneReport::calls_ms`]); 7: counts-only entries in delta zone
/// reports ([`ZoneBucketMsg::counts_only`]); 8: criticality tiers ([`PROTO_TIERS`]); 9: a
/// bucket file's `criticality.caps` in the config ([`PROTO_CAPS`]).
pub const PROTO_VERSION: u32 = 9;

/// The first protocol version whose aggregators read the binary encoding ([`binary`]).
pub const PROTO_BINARY: u32 = 3;

/// The first protocol version with delta zone reports and delta directives.
pub const PROTO_DELTA: u32 = 4;

/// The first protocol version whose controllers accept [`ConfigDoc::candidates`] and serve
/// `GET /v1/candidates`: send candidates only to a controller that announced it.
pub const PROTO_CANDIDATES: u32 = 5;

/// The first protocol version whose controllers accept [`ZoneReport::calls_ms`].
pub const PROTO_CALLS_MS: u32 = 6;

/// The first protocol version whose controllers accept [`ZoneBucketMsg::counts_only`].
pub const PROTO_COUNTS: u32 = 7;

/// The first protocol version that reads criticality tiers: counts by tier
/// ([`BucketCountsMsg::tiers`]), offered rates by tier ([`ZoneBucketMsg::tier_offered_rps`])
/// and a directive's split ([`DirectiveMsg::shed`]). A sender includes them only for a peer
/// that announced it.
pub const PROTO_TIERS: u32 = 8;

/// The first protocol version that reads a bucket file's `criticality` section
/// (`schema::CriticalitySection`) in [`ConfigDoc`]: `GET /v1/config` serves it only to a
/// peer that sent `grl-proto: 9` or more ([`ConfigDoc::for_peer`]), and rlc pushes it only to
/// a controller that announced it.
pub const PROTO_CAPS: u32 = 9;

/// [`PROTO_VERSION`] as a header value (made once).
pub fn version_header() -> http::HeaderValue {
    static V: std::sync::OnceLock<http::HeaderValue> = std::sync::OnceLock::new();
    V.get_or_init(|| http::HeaderValue::from(PROTO_VERSION))
        .clone()
}

/// The version a peer announced in a response's headers (1 when absent).
pub fn peer_version(headers: &http::HeaderMap) -> u32 {
    headers
        .get(PROTO_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(1)
}

/// Calls of one (caller, procedure) over one interval, matched by a bucket or not.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct CallCountMsg {
    /// Calling service (`_other`: callers folded by the client's bound).
    pub caller: String,
    /// Procedure.
    pub procedure: String,
    /// Requests.
    pub count: u64,
}

/// A zone's calls of one (service, caller, procedure) since the previous forward.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct ServiceCallCountMsg {
    /// Callee service.
    pub service: String,
    /// Calling service (`_other`: callers folded by a bound).
    pub caller: String,
    /// Procedure.
    pub procedure: String,
    /// Requests.
    pub count: u64,
}

/// The whole bucket config the controller serves: `PUT/GET /v1/config`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct ConfigDoc {
    /// Opaque version, e.g. a git sha.
    pub version: String,
    /// One bucket file per callee service.
    pub services: Vec<BucketFile>,
    /// Candidate limits watched beside the limits in force (protocol 5; `PUT` only: the
    /// controller keeps them with the config but never serves them in `GET /v1/config`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub candidates: Vec<Candidate>,
}

impl ConfigDoc {
    /// Whether a peer of protocol `version` can read every field of this document as it
    /// stands (see [`ConfigDoc::for_peer`]).
    pub fn readable_by(&self, version: u32) -> bool {
        (version >= PROTO_CANDIDATES || self.candidates.is_empty())
            && (version >= PROTO_CAPS || !self.has_caps())
    }

    /// Whether a bucket file has a `criticality` section.
    pub fn has_caps(&self) -> bool {
        self.services.iter().any(|f| !f.criticality.is_empty())
    }

    /// Leaves out what a peer of protocol `version` cannot read (it refuses unknown fields):
    /// candidates below [`PROTO_CANDIDATES`], the bucket files' `criticality` sections below
    /// [`PROTO_CAPS`] (such a peer decides every caller at the tier it claims, as before caps).
    pub fn for_peer(&mut self, version: u32) {
        if version < PROTO_CANDIDATES {
            self.candidates.clear();
        }
        if version < PROTO_CAPS {
            for f in &mut self.services {
                f.criticality = Default::default();
            }
        }
    }
}

/// A client's counts of one bucket over one interval.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct BucketCountsMsg {
    /// Bucket name.
    pub bucket: String,
    /// Requests offered.
    pub offered: u64,
    /// Requests admitted (shadow drops included).
    pub admitted: u64,
    /// Requests dropped.
    pub dropped: u64,
    /// Requests that would have been dropped (shadow).
    pub shadow_dropped: u64,
    /// The same counts by criticality tier, one entry per tier that saw requests (protocol 8;
    /// sent only to a peer that announced it). Empty: the sender does not count tiers.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tiers: Vec<TierCountsMsg>,
}

/// One tier's counts of a bucket over one interval.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TierCountsMsg {
    /// The tier.
    pub tier: Criticality,
    /// Requests offered.
    pub offered: u64,
    /// Requests admitted (shadow drops included).
    pub admitted: u64,
    /// Requests dropped.
    pub dropped: u64,
    /// Requests that would have been dropped (shadow).
    pub shadow_dropped: u64,
}

impl TierCountsMsg {
    fn add(&mut self, other: &TierCountsMsg) {
        self.offered = self.offered.saturating_add(other.offered);
        self.admitted = self.admitted.saturating_add(other.admitted);
        self.dropped = self.dropped.saturating_add(other.dropped);
        self.shadow_dropped = self.shadow_dropped.saturating_add(other.shadow_dropped);
    }
}

impl BucketCountsMsg {
    /// Adds `other`'s counts (saturating), tier by tier; the bucket name stays.
    pub fn add(&mut self, other: &BucketCountsMsg) {
        self.offered = self.offered.saturating_add(other.offered);
        self.admitted = self.admitted.saturating_add(other.admitted);
        self.dropped = self.dropped.saturating_add(other.dropped);
        self.shadow_dropped = self.shadow_dropped.saturating_add(other.shadow_dropped);
        for t in &other.tiers {
            match self.tiers.iter_mut().find(|m| m.tier == t.tier) {
                Some(m) => m.add(t),
                None => self.tiers.push(*t),
            }
        }
    }

    /// The tier counts merged by tier (a tier given twice counts once, summed), least critical
    /// first.
    pub fn tier_counts(&self) -> [Option<TierCountsMsg>; TIERS] {
        let mut out: [Option<TierCountsMsg>; TIERS] = [None; TIERS];
        for t in &self.tiers {
            match &mut out[t.tier as usize] {
                Some(m) => m.add(t),
                slot => *slot = Some(*t),
            }
        }
        out
    }

    /// Whether the tier counts fit within the whole: for each of offered, admitted, dropped
    /// and shadow-dropped, the tiers' sum is at most the whole's. Tiers that do not (a sender
    /// that is wrong about them, or counts an aggregator cut) are not believed.
    pub fn tiers_believed(&self) -> bool {
        let whole = [
            self.offered,
            self.admitted,
            self.dropped,
            self.shadow_dropped,
        ];
        let mut sum = [0u64; 4];
        for t in &self.tiers {
            let c = [t.offered, t.admitted, t.dropped, t.shadow_dropped];
            for (s, x) in sum.iter_mut().zip(c) {
                *s = s.saturating_add(x);
            }
        }
        sum.iter().zip(whole).all(|(s, w)| *s <= w)
    }

    /// The counts split by tier: `[offered, admitted, dropped, shadow_dropped]` of each tier,
    /// least critical first, then (at [`TIERS`]) of the requests counted without a tier (from
    /// clients that do not count tiers). Tiers not believed ([`Self::tiers_believed`]) are
    /// ignored: everything is then untiered.
    pub fn by_tier(&self) -> [[u64; 4]; TIERS + 1] {
        let mut out = [[0; 4]; TIERS + 1];
        out[TIERS] = [
            self.offered,
            self.admitted,
            self.dropped,
            self.shadow_dropped,
        ];
        if !self.tiers_believed() {
            return out;
        }
        let mut rest = out[TIERS];
        for (j, t) in self.tier_counts().into_iter().enumerate() {
            let Some(t) = t else { continue };
            out[j] = [t.offered, t.admitted, t.dropped, t.shadow_dropped];
            // Believed: the tiers' sums fit, so no count goes below zero.
            for (r, x) in rest.iter_mut().zip(out[j]) {
                *r -= x;
            }
        }
        out[TIERS] = rest;
        out
    }

    /// Offered requests by tier (least critical first), when the counts carry tiers.
    pub fn tier_offered(&self) -> Option<[u64; TIERS]> {
        (!self.tiers.is_empty()).then(|| self.tier_counts().map(|t| t.map_or(0, |t| t.offered)))
    }
}

/// Client → aggregator, every tick: `POST /v1/report`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClientReport {
    /// Unique per client instance.
    pub client_id: String,
    /// The callee service the client enforces for.
    pub service: String,
    /// The config version the client runs.
    pub version: String,
    /// Length of the counted interval.
    pub interval_ms: u64,
    /// Counts per bucket.
    pub buckets: Vec<BucketCountsMsg>,
    /// Sent between ticks because the client's own rate jumped: forward at once.
    #[serde(default)]
    pub urgent: bool,
    /// Every request since the previous report by (caller, procedure), matched or not
    /// (protocol 2; sent only to an aggregator that announced it).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub calls: Vec<CallCountMsg>,
}

impl ClientReport {
    /// Per-bucket rates over the report's interval: `[offered, admitted, dropped, shadow]`
    /// requests per second, as an aggregator keeps them.
    pub fn rates(&self) -> Vec<(String, [f64; 4])> {
        let mut out = Vec::new();
        self.rates_into(&mut out);
        out
    }

    /// [`Self::rates`] written over `out` (a client's previous rates): the names already
    /// there are kept when they match, so a client reporting the same buckets as last time
    /// allocates nothing.
    pub fn rates_into(&self, out: &mut Vec<(String, [f64; 4])>) {
        let secs = self.interval_ms as f64 / 1000.0;
        out.truncate(self.buckets.len());
        for (i, b) in self.buckets.iter().enumerate() {
            let r = [
                b.offered as f64 / secs,
                b.admitted as f64 / secs,
                b.dropped as f64 / secs,
                b.shadow_dropped as f64 / secs,
            ];
            match out.get_mut(i) {
                Some(e) => {
                    if e.0 != b.bucket {
                        e.0.clone_from(&b.bucket);
                    }
                    e.1 = r;
                }
                None => out.push((b.bucket.clone(), r)),
            }
        }
    }
}

/// One bucket's directive for one scope key.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DirectiveMsg {
    /// Bucket name.
    pub bucket: String,
    /// Drop ratio to apply.
    pub ratio: f64,
    /// The offered rate the ratio was computed from.
    pub fleet_offered_rps: f64,
    /// The effective limit (after overrides).
    pub limit_rps: f64,
    /// Set by an override: apply as-is.
    #[serde(default)]
    pub fixed: bool,
    /// How the shed falls on the bucket's criticality tiers (protocol 8; sent only to a peer
    /// that announced it). None: every tier drops `ratio` (the fleet's mix of tiers is not
    /// known, or nothing is shed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shed: Option<TierShedMsg>,
}

/// A bucket's shed split over its tiers: every tier below `threshold` drops all its requests,
/// `threshold` drops `fraction` of its own, every tier above drops none.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TierShedMsg {
    /// The tier that drops a fraction.
    pub threshold: Criticality,
    /// The fraction of the threshold tier dropped, in [0, 1].
    pub fraction: f64,
}

/// Aggregator → client: the reply to a report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct ClientDirectives {
    /// Current config version at the controller.
    pub version: String,
    /// How old the directives are (since the aggregator last heard from the controller);
    /// `None` when it never has.
    pub age_ms: Option<u64>,
    /// Directives for the client's service and zone.
    pub directives: Vec<DirectiveMsg>,
}

/// One bucket's sums over a zone's clients.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct ZoneBucketMsg {
    /// Callee service.
    pub service: String,
    /// Bucket name.
    pub bucket: String,
    /// Offered rate (sum of the clients' latest rates).
    pub offered_rps: f64,
    /// Admitted rate.
    pub admitted_rps: f64,
    /// Dropped rate.
    pub dropped_rps: f64,
    /// Shadow-dropped rate.
    pub shadow_dropped_rps: f64,
    /// Counts since the previous forward (for the Prometheus counters).
    pub counts: BucketCountsMsg,
    /// In a delta report (protocol 4): the zone no longer has this bucket; the controller
    /// takes it out of the zone's contribution (its rates are ignored, its counts count).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub gone: bool,
    /// In a delta report (protocol 7): the entry carries counts only; the controller counts
    /// them and keeps the rates it holds of the bucket (which moved too little to be sent).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub counts_only: bool,
    /// The offered rate by criticality tier, least critical first (protocol 8; sent only to a
    /// controller that announced it), present only when every client of the bucket in the
    /// zone counted tiers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tier_offered_rps: Option<[f64; TIERS]>,
}

/// A zone report's place in its delta session with one controller (protocol 4).
///
/// A session is one aggregator talking to one controller: `id` is drawn by the aggregator
/// for that controller, `seq` numbers its reports. A report with `base: None` is full: it
/// replaces everything the controller holds of the zone. A report with `base: Some(b)`
/// carries only the buckets that changed since report `b` (and the ones gone, marked
/// [`ZoneBucketMsg::gone`]); the controller applies it only when report `b` of the same
/// session is the last one it applied, and answers [`ReplySession::resync`] otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct ReportSession {
    /// Session id (the aggregator's, for this controller).
    pub id: u64,
    /// This report's number in the session.
    pub seq: u64,
    /// The report this one is a delta of; None: a full report.
    #[serde(default)]
    pub base: Option<u64>,
    /// The directives the aggregator holds: `(epoch, version)` from a previous
    /// [`ReplySession`]; the reply then carries only what changed since (None: all).
    #[serde(default)]
    pub directives: Option<(u64, u64)>,
}

/// The controller's side of a delta session, in its reply (only to a report that carried a
/// [`ReportSession`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct ReplySession {
    /// The report applied (its `seq`); None when it was not (see `resync`).
    #[serde(default)]
    pub applied: Option<u64>,
    /// The delta report was not applied (the controller restarted, expired the zone, changed
    /// its config, or last applied another report): send a full report.
    #[serde(default)]
    pub resync: bool,
    /// The controller's engine instance: versions of another epoch mean nothing here.
    pub epoch: u64,
    /// The directives' version this reply brings the aggregator to.
    pub version: u64,
    /// True: `services` holds only directives changed since the version the report named
    /// (merge them by service and bucket); false: every directive (replace).
    #[serde(default)]
    pub delta: bool,
}

/// Aggregator → controller: `POST /v1/aggregate`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct ZoneReport {
    /// Aggregator instance id.
    pub aggregator_id: String,
    /// Region of the zone.
    pub region: String,
    /// The zone.
    pub zone: String,
    /// Sums per bucket.
    pub buckets: Vec<ZoneBucketMsg>,
    /// The zone's calls since the previous forward (protocol 2; sent only to a controller
    /// that announced it; never to peer controllers).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub calls: Vec<ServiceCallCountMsg>,
    /// The time `calls` cover (ms): since the aggregator's last forward whose calls a
    /// controller took, so calls held back by failed forwards come with the whole time they
    /// were made over (protocol 6; sent only to a controller that announced it, with every
    /// report that could carry calls, none made included). None: not said (the controller
    /// takes the time since the zone's previous report).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calls_ms: Option<u64>,
    /// Delta session (protocol 4; sent only to a controller that announced it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<ReportSession>,
}

/// One service's directives in a zone.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct ServiceDirectives {
    /// Callee service.
    pub service: String,
    /// Its buckets' directives.
    pub directives: Vec<DirectiveMsg>,
}

/// Controller → aggregator: the reply to a zone report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct ZoneDirectives {
    /// Current config version.
    pub version: String,
    /// Directives for every service, for the zone's scope keys (or only the changed ones,
    /// see [`ReplySession::delta`]).
    pub services: Vec<ServiceDirectives>,
    /// Present only in the reply to a report that carried a [`ReportSession`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<ReplySession>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tier(tier: Criticality, c: [u64; 4]) -> TierCountsMsg {
        TierCountsMsg {
            tier,
            offered: c[0],
            admitted: c[1],
            dropped: c[2],
            shadow_dropped: c[3],
        }
    }

    /// The split by tier leaves the untiered rest; a tier given twice counts once, summed;
    /// tiers that do not fit the whole on any of the four counts are not believed.
    #[test]
    fn counts_split_by_tier_only_when_every_count_fits() {
        let mut b = BucketCountsMsg {
            bucket: "g".into(),
            offered: 100,
            admitted: 70,
            dropped: 30,
            shadow_dropped: 5,
            tiers: vec![
                tier(Criticality::Sheddable, [40, 10, 30, 5]),
                tier(Criticality::Critical, [20, 20, 0, 0]),
                tier(Criticality::Critical, [10, 10, 0, 0]),
            ],
        };
        assert!(b.tiers_believed());
        let s = b.by_tier();
        assert_eq!(s[Criticality::Sheddable as usize], [40, 10, 30, 5]);
        assert_eq!(s[Criticality::Critical as usize], [30, 30, 0, 0]);
        assert_eq!(s[TIERS], [30, 30, 0, 0]);
        // Offered fits, dropped does not: everything untiered.
        b.tiers[1].dropped = 1;
        assert!(!b.tiers_believed());
        let s = b.by_tier();
        assert_eq!(s[TIERS], [100, 70, 30, 5]);
        assert!(s[..TIERS].iter().all(|c| *c == [0; 4]));
        // Shadow drops beyond the whole's.
        b.tiers[1].dropped = 0;
        b.tiers[0].shadow_dropped = 6;
        assert!(!b.tiers_believed());
        // No tiers: believed, all untiered.
        b.tiers.clear();
        assert!(b.tiers_believed());
        assert_eq!(b.by_tier()[TIERS], [100, 70, 30, 5]);
    }

    /// A peer below protocol 9 gets the config without the `criticality` sections (its
    /// strict parser would refuse the whole document), below 5 without candidates too.
    #[test]
    fn a_peer_gets_only_the_fields_it_reads() {
        let mut f = BucketFile::new("pay", Vec::new());
        f.criticality.caps = [("batch-*".to_string(), Criticality::Sheddable)].into();
        let doc = ConfigDoc {
            version: "v1".into(),
            services: vec![f],
            candidates: Vec::new(),
        };
        let json = |d: &ConfigDoc| serde_json::to_string(d).unwrap();
        assert!(json(&doc).contains(r#""criticality":{"caps":{"batch-*":"SHEDDABLE"}}"#));
        assert!(doc.readable_by(PROTO_CAPS) && !doc.readable_by(PROTO_TIERS));
        let mut new = doc.clone();
        new.for_peer(PROTO_VERSION);
        assert_eq!(new, doc);
        let mut old = doc.clone();
        old.for_peer(PROTO_TIERS);
        assert!(!json(&old).contains("criticality"), "{}", json(&old));
        assert!(old.readable_by(1));
        assert_eq!(old.services[0].service, "pay");
    }

    fn report(interval_ms: u64, buckets: &[(&str, u64)]) -> ClientReport {
        ClientReport {
            client_id: "c".into(),
            service: "s".into(),
            version: "v".into(),
            interval_ms,
            buckets: buckets
                .iter()
                .map(|&(b, n)| BucketCountsMsg {
                    bucket: b.into(),
                    offered: n,
                    admitted: n / 2,
                    dropped: n - n / 2,
                    shadow_dropped: 0,
                    tiers: Vec::new(),
                })
                .collect(),
            urgent: false,
            calls: Vec::new(),
        }
    }

    /// Written over a client's previous rates, the rates are those of the new report whatever
    /// the previous ones held: more, fewer, other or the same buckets.
    #[test]
    fn rates_into_overwrites_previous_rates() {
        let first = report(500, &[("a", 10), ("b", 20), ("c", 30)]);
        let mut held = first.rates();
        assert_eq!(held[1], ("b".to_string(), [40.0, 20.0, 20.0, 0.0]));
        for next in [
            report(1000, &[("a", 4), ("b", 8), ("c", 2)]),
            report(1000, &[("x", 4), ("a", 8)]),
            report(250, &[("x", 1), ("a", 2), ("b", 3), ("d", 4)]),
            report(1000, &[]),
        ] {
            next.rates_into(&mut held);
            assert_eq!(held, next.rates());
        }
    }
}
