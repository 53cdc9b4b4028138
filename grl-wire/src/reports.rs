//! `GET /v1/reports`: the controller's per-tick rows (one per bucket and scope key with
//! traffic), paged by a cursor. The controller writes them ([`ReportRow`] built by its engine);
//! `rlc` reads them into its store. A reader accepts what older or other controllers send: a
//! tick time in seconds (whole or fractional), as a numeric string or as an RFC 3339 text
//! ([`Tick`]), a cursor as a number or a string ([`Cursor`]), a missing or null scope key.

use std::borrow::Cow;

use schema::criticality::{Criticality, TIERS};
use serde::{Deserialize, Deserializer, Serialize};

/// When a report row was ticked, as the controller sent it. This controller sends whole unix
/// seconds ([`Tick::Secs`]); readers also accept fractional seconds and texts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Tick {
    /// Whole unix seconds (what `grl controller` sends).
    Secs(u64),
    /// Fractional (or negative) unix seconds.
    Frac(f64),
    /// A text: unix seconds as a number, or an RFC 3339 time (the reader parses it).
    Text(String),
}

impl From<u64> for Tick {
    fn from(secs: u64) -> Tick {
        Tick::Secs(secs)
    }
}

impl Tick {
    /// Unix seconds when the tick is a number or a numeric text (None: an RFC 3339 text or
    /// anything else, which the reader interprets).
    pub fn secs(&self) -> Option<f64> {
        match self {
            Tick::Secs(s) => Some(*s as f64),
            Tick::Frac(f) => Some(*f),
            Tick::Text(t) => t.parse().ok(),
        }
    }
}

/// The cursor of a report page: the `seq` of its last row, to pass as `after` next time.
/// This controller sends a number; readers also accept a string, and null (no cursor).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Cursor {
    /// A row's sequence number (what `grl controller` sends).
    Seq(u64),
    /// An opaque text.
    Text(String),
    /// No cursor (JSON null).
    None,
}

impl From<u64> for Cursor {
    fn from(seq: u64) -> Cursor {
        Cursor::Seq(seq)
    }
}

impl Cursor {
    /// The sequence number, when the cursor is one.
    pub fn seq(&self) -> Option<u64> {
        match self {
            Cursor::Seq(n) => Some(*n),
            _ => None,
        }
    }

    /// The cursor as the `after` query parameter (None: no cursor).
    pub fn as_param(&self) -> Option<String> {
        match self {
            Cursor::Seq(n) => Some(n.to_string()),
            Cursor::Text(s) => Some(s.clone()),
            Cursor::None => None,
        }
    }
}

/// Requests the zones counted for a row's bucket and scope key since the key's previous row
/// (exact, where the row's rates are the controller's estimates of the moment).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ReportCounts {
    /// Requests offered.
    pub offered: u64,
    /// Requests admitted (shadow drops included).
    pub admitted: u64,
    /// Requests dropped.
    pub dropped: u64,
    /// Requests that would have been dropped (shadow).
    pub shadow_dropped: u64,
    /// The same counts by criticality tier, one entry per tier that saw requests, least
    /// critical first (protocol 8). They cover the requests of clients that count tiers: what
    /// the entries leave of the whole came from clients that do not. Empty (and left out)
    /// when no counted request had a tier, and from controllers before this field.
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "lenient_tiers"
    )]
    pub tiers: Vec<crate::TierCountsMsg>,
}

/// A tier entry as a reader takes it: fields it does not know are ignored, and an entry of a
/// tier it does not know is skipped (a newer controller's), so a report page always parses.
#[derive(Deserialize)]
struct TierEntry {
    tier: String,
    #[serde(default)]
    offered: u64,
    #[serde(default)]
    admitted: u64,
    #[serde(default)]
    dropped: u64,
    #[serde(default)]
    shadow_dropped: u64,
}

fn lenient_tiers<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<crate::TierCountsMsg>, D::Error> {
    let entries = Option::<Vec<TierEntry>>::deserialize(d)?.unwrap_or_default();
    Ok(entries
        .into_iter()
        .filter_map(|e| {
            Some(crate::TierCountsMsg {
                tier: e.tier.parse().ok()?,
                offered: e.offered,
                admitted: e.admitted,
                dropped: e.dropped,
                shadow_dropped: e.shadow_dropped,
            })
        })
        .collect())
}

/// The whole of a split by tier ([`crate::BucketCountsMsg::by_tier`]): `[offered, admitted,
/// dropped, shadow_dropped]` of every tier and of the untiered requests (saturating).
pub fn whole(split: &[[u64; 4]; TIERS + 1]) -> [u64; 4] {
    let mut w = [0u64; 4];
    for c in split {
        for (w, x) in w.iter_mut().zip(c) {
            *w = w.saturating_add(*x);
        }
    }
    w
}

impl ReportCounts {
    /// The counts of a split as [`crate::BucketCountsMsg::by_tier`] gives it: the whole, and
    /// one entry per tier with requests.
    pub fn from_tiers(split: &[[u64; 4]; TIERS + 1]) -> ReportCounts {
        let tiers = Criticality::ALL
            .iter()
            .zip(split)
            .filter(|(_, c)| c.iter().any(|&x| x > 0))
            .map(|(&tier, c)| crate::TierCountsMsg {
                tier,
                offered: c[0],
                admitted: c[1],
                dropped: c[2],
                shadow_dropped: c[3],
            })
            .collect();
        let [offered, admitted, dropped, shadow_dropped] = whole(split);
        ReportCounts {
            offered,
            admitted,
            dropped,
            shadow_dropped,
            tiers,
        }
    }
}

/// One row of `GET /v1/reports`: a bucket's rates for one scope key over one second.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReportRow {
    /// Monotonic sequence number (the cursor).
    pub seq: u64,
    /// When the tick was (unix seconds from this controller).
    pub t: Tick,
    /// Callee service.
    pub service: String,
    /// Bucket name.
    pub bucket: String,
    /// Caller matched by the bucket.
    #[serde(default)]
    pub caller: Option<String>,
    /// Procedure matched by the bucket.
    #[serde(default)]
    pub procedure: Option<String>,
    /// `enforce` | `shadow` (a constant on the controller's side: no allocation per row).
    pub mode: Cow<'static, str>,
    /// The scope key (`global`, `region:…`, `zone:…`); empty when a sender left it out.
    #[serde(default, deserialize_with = "null_as_empty")]
    pub scope_key: String,
    /// Offered requests/s.
    pub offered: f64,
    /// Admitted requests/s.
    pub admitted: f64,
    /// Dropped requests/s.
    pub dropped: f64,
    /// Shadow-dropped requests/s (would have been dropped).
    pub shadow_dropped: f64,
    /// Effective limit (after overrides).
    pub limit_rps: f64,
    /// Drop ratio in force.
    pub drop_ratio: f64,
    /// The share of the rates that this controller's own zones offered, when some came from
    /// peer controllers of other regions (a `global` bucket of peered controllers); absent
    /// when every rate is the controller's own. A reader summing several regions' reports
    /// counts `share ×` each rate, so that a region's requests are counted once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub own_share: Option<f64>,
    /// The requests this controller's zones counted for the key since its previous row; absent
    /// from controllers before this field (a reader then sums the rates). Not scaled by
    /// `own_share`: they are this region's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub counts: Option<ReportCounts>,
}

impl ReportRow {
    /// The requests the row stands for, `[offered, admitted, dropped, shadow_dropped]`: its
    /// `counts`, or, from a controller without them, its rates (a row stands for one second).
    pub fn requests(&self) -> [f64; 4] {
        match &self.counts {
            Some(c) => [c.offered, c.admitted, c.dropped, c.shadow_dropped].map(|n| n as f64),
            None => [
                self.offered,
                self.admitted,
                self.dropped,
                self.shadow_dropped,
            ],
        }
    }
}

fn null_as_empty<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    Ok(Option::<String>::deserialize(d)?.unwrap_or_default())
}

/// One page of `GET /v1/reports?after=CURSOR&limit=N`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReportPage {
    /// The cursor to pass as `after` next time.
    pub next: Cursor,
    /// Rows with `seq > after`, oldest first.
    pub reports: Vec<ReportRow>,
    /// The cursor was beyond the newest row (a controller whose clock went back, or a cursor
    /// from another controller): this page starts at the oldest row kept.
    #[serde(default)]
    pub reset: bool,
    /// Rows between the cursor and the oldest row kept were lost (evicted, or a restart).
    #[serde(default)]
    pub gap: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the controller writes reads back as the same row; what other senders write
    /// (fractional or text times, string cursors, no scope key) reads too.
    #[test]
    fn rows_round_trip_and_lenient_fields_read() {
        let row = ReportRow {
            seq: 7,
            t: Tick::Secs(1_796_000_000),
            service: "payments".into(),
            bucket: "gw".into(),
            caller: Some("gw".into()),
            procedure: None,
            mode: Cow::Borrowed("shadow"),
            scope_key: "global".into(),
            offered: 1.5,
            admitted: 1.0,
            dropped: 0.5,
            shadow_dropped: 0.0,
            limit_rps: 1.0,
            drop_ratio: 0.25,
            own_share: None,
            counts: None,
        };
        let page = ReportPage {
            next: 7.into(),
            reports: vec![row.clone()],
            reset: false,
            gap: false,
        };
        let text = serde_json::to_string(&page).unwrap();
        assert!(
            text.contains(r#""next":7"#) && text.contains(r#""t":1796000000,"#),
            "{text}"
        );
        assert_eq!(serde_json::from_str::<ReportPage>(&text).unwrap(), page);

        let other: ReportPage = serde_json::from_value(serde_json::json!({
            "next": "2", "reports": [{
                "seq": 2, "t": "2026-12-01T00:00:00Z", "service": "s", "bucket": "b",
                "mode": "enforce", "scope_key": null, "offered": 1.0, "admitted": 1.0,
                "dropped": 0.0, "shadow_dropped": 0.0, "limit_rps": 2.0, "drop_ratio": 0.0
            }]
        }))
        .unwrap();
        assert_eq!(other.next.as_param().as_deref(), Some("2"));
        assert_eq!(other.reports[0].scope_key, "");
        assert_eq!(other.reports[0].t.secs(), None);
        assert_eq!(Tick::Frac(1.5).secs(), Some(1.5));
        assert_eq!(Tick::Text("12.5".into()).secs(), Some(12.5));
        let none: Cursor = serde_json::from_str("null").unwrap();
        assert_eq!(none.as_param(), None);
    }
}
