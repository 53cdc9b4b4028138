//! Why a bucket gets its limit: the numbers, window and confidence behind it ([`Evidence`]),
//! typed, serialised as the `evidence` object of the preview JSON, the quota API and the
//! store's quota history.
//!
//! The policy's own numbers ([`PolicyEvidence`]) are the policy's JSON as it gave them (a
//! plugin may add anything); [`PolicyEvidence::figures`] reads the ones rlc knows, typed, so
//! that no reader looks them up by string key.

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize};

use crate::readiness::{ShadowStats, Verdict};

/// Which numbers, window and confidence produced a limit.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct Evidence {
    /// What set the limit and what the rails did, in one line (the preview table's WHY).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub explain: Option<String>,
    /// A contract's bucket whose caller (and procedure) sent no traffic in the window: the
    /// contract may name the caller or procedure differently from the traffic's labels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub no_traffic: Option<String>,
    /// The policy's own numbers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<PolicyEvidence>,
    /// The limit the policy proposed, before the rails.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proposed_rps: Option<f64>,
    /// The highest rate the policy saw.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_rps: Option<f64>,
    /// When that peak was (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_at: Option<String>,
    /// 0–1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub confidence: Option<f64>,
    /// What the rails did, one note each.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(with = "Vec<String>")]
    pub rails: Vec<policies::rails::RailNote>,
    /// The value a rail moved the limit from (floor, ceiling, per-run cap).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capped_from: Option<f64>,
    /// Contracts of this bucket that expired (they no longer apply).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub expired_contracts: Vec<String>,
    /// Why the bucket keeps its current quota without a computation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kept_current: Option<String>,
    /// The shadow figures and verdict of a shadow bucket that could be promoted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub promotion: Option<PromotionEvidence>,
    /// Windows left out of the series because they were not demand (throttled minutes,
    /// `excluded` windows of `rlc/policies.yaml`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ignored: Vec<crate::censor::Ignored>,
    /// How much demand the bucket's limit refused in the window, if it refused any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub throttled: Option<crate::censor::ThrottledEvidence>,
    /// The limit against the busiest minute of the bucket's critical demand, when its
    /// clients count tiers (global buckets only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub critical_headroom: Option<CriticalHeadroom>,
}

/// A bucket's critical headroom: its limit over the peak of its CRITICAL_PLUS and CRITICAL
/// demand. Quotas are still learned from the whole demand; below 1, the less critical tiers
/// cannot cover the shed at that peak and critical requests would be refused.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct CriticalHeadroom {
    /// Requests/s of CRITICAL_PLUS and CRITICAL in their busiest minute of the window.
    pub peak_critical_rps: f64,
    /// When that minute began.
    pub peak_at: DateTime<Utc>,
    /// The planned limit ÷ `peak_critical_rps` (not rounded: below 1 is below 1).
    pub headroom: f64,
}

impl CriticalHeadroom {
    /// The headroom of `limit_rps` over a critical peak of `peak_rps` (None without one).
    pub fn of(limit_rps: f64, peak_rps: f64, peak_at: DateTime<Utc>) -> Option<CriticalHeadroom> {
        (peak_rps > 0.0 && limit_rps.is_finite()).then(|| CriticalHeadroom {
            peak_critical_rps: (peak_rps * 1000.0).round() / 1000.0,
            peak_at,
            headroom: limit_rps / peak_rps,
        })
    }

    /// Whether critical requests would be shed at the peak.
    pub fn short(&self) -> bool {
        self.headroom < 1.0
    }
}

impl Evidence {
    /// The evidence of a bucket that keeps its current quota, and why.
    pub fn kept(reason: impl Into<String>) -> Evidence {
        Evidence {
            kept_current: Some(reason.into()),
            ..Evidence::default()
        }
    }

    /// Whether the plan proposes `mode: enforce` for this shadow bucket.
    pub fn promoted(&self) -> bool {
        self.promotion.as_ref().is_some_and(|p| p.promoted)
    }

    /// The one line that says why: `explain`, else why the quota is kept.
    pub fn why(&self) -> Option<&str> {
        self.explain.as_deref().or(self.kept_current.as_deref())
    }

    /// Reads evidence stored as JSON text (the store's quota history); unreadable text gives
    /// empty evidence.
    pub fn from_stored(text: &str) -> Evidence {
        serde_json::from_str(text).unwrap_or_default()
    }
}

/// As the preview JSON shows it (for messages and logs).
impl std::fmt::Display for Evidence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&serde_json::to_string(self).map_err(|_| std::fmt::Error)?)
    }
}

/// A policy's own numbers, as it gave them.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, JsonSchema)]
#[serde(transparent)]
pub struct PolicyEvidence(pub serde_json::Value);

impl PolicyEvidence {
    /// The numbers rlc knows, typed; a field that is absent or of another type is `None`.
    pub fn figures(&self) -> PolicyFigures {
        PolicyFigures::deserialize(&self.0).unwrap_or_default()
    }
}

/// The numbers of the built-in policies that readers show (the quota API's `details`, the
/// store's reasons).
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct PolicyFigures {
    /// `max` or a percentile such as `p99.9` (peak).
    #[serde(default, deserialize_with = "lenient")]
    pub statistic: Option<String>,
    /// That statistic's value.
    #[serde(default, deserialize_with = "lenient")]
    pub value_rps: Option<f64>,
    /// When that value was reached (`max` only).
    #[serde(default, deserialize_with = "lenient")]
    pub value_at: Option<String>,
    /// The forecast's upper bound over the horizon.
    #[serde(default, deserialize_with = "lenient")]
    pub upper_bound_rps: Option<f64>,
    /// The headroom multiplied in.
    #[serde(default, deserialize_with = "lenient")]
    pub headroom: Option<f64>,
    /// The bucket's share of the planned capacity.
    #[serde(default, deserialize_with = "lenient")]
    pub capacity_share_rps: Option<f64>,
    /// What the policy's limit was capped by.
    #[serde(default, deserialize_with = "lenient")]
    pub capped_by: Option<String>,
    /// Share of the window with samples since the series' first one.
    #[serde(default, deserialize_with = "lenient")]
    pub coverage: Option<f64>,
    /// Days of history behind the limit.
    #[serde(default, deserialize_with = "lenient")]
    pub history_days: Option<f64>,
    /// The highest rate in the window.
    #[serde(default, deserialize_with = "lenient")]
    pub peak_rps: Option<f64>,
    /// When it was.
    #[serde(default, deserialize_with = "lenient")]
    pub peak_at: Option<String>,
    /// A contract's reference.
    #[serde(default, deserialize_with = "lenient")]
    pub reference: Option<String>,
    /// Forecast: what set the bound.
    #[serde(default, deserialize_with = "lenient")]
    pub set_by: Option<SetBy>,
    /// How `headroom: auto` chose the margin.
    #[serde(default, deserialize_with = "lenient")]
    pub headroom_auto: Option<HeadroomAuto>,
}

/// How `headroom: auto` chose a bucket's margin: the policy replayed at past origins of the
/// bucket's history, each origin's level against the week after it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct HeadroomAuto {
    /// The margin chosen (0.07 = +7 %).
    pub chosen: f64,
    /// The share of requests the replay may throttle at it.
    pub target_throttled: f64,
    /// The margins it may pick from.
    pub min_headroom: f64,
    /// The largest margin; a bucket that needs more is flagged for review.
    pub max_headroom: f64,
    /// Origins replayed (0: too little history, the default margin).
    pub origins: usize,
    /// The highest demand of a week after an origin ÷ that origin's level, the worst.
    #[serde(default)]
    pub worst_surprise: Option<f64>,
    /// The share of the replayed weeks' requests the chosen margin would have throttled.
    #[serde(default)]
    pub replayed_throttled: Option<f64>,
    /// The same from the extreme-value fit of the days' maxima.
    #[serde(default)]
    pub tail_throttled: Option<f64>,
    /// Each origin: its time, level, the next week's peak and their ratio.
    #[serde(default)]
    pub surprises: Vec<Surprise>,
    /// The bucket needed more than `max_headroom`: too noisy for a quota alone.
    pub review: bool,
    /// The choice in one line.
    pub why: String,
}

/// One replayed origin of `headroom: auto`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Surprise {
    /// When (RFC 3339).
    pub origin: Option<String>,
    /// The level the policy fitted on the history before it, without margin.
    pub level_rps: f64,
    /// The highest demand of the week after it.
    pub next_peak_rps: f64,
    /// `next_peak_rps ÷ level_rps`.
    pub surprise: f64,
}

/// What set a forecast's bound.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct SetBy {
    /// `forecast`, `grown_peak` or `recent_peak`.
    #[serde(default, deserialize_with = "lenient")]
    pub kind: Option<String>,
}

/// A field of a policy's (or a plugin's) JSON: `None` when it has another type.
fn lenient<'de, D: Deserializer<'de>, T: DeserializeOwned>(d: D) -> Result<Option<T>, D::Error> {
    let v = serde_json::Value::deserialize(d)?;
    Ok(serde_json::from_value(v).ok())
}

/// A shadow bucket's figures and verdict, when a plan could promote it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct PromotionEvidence {
    /// Whether the plan proposes `mode: enforce`.
    pub promoted: bool,
    /// The verdict of the promotion rule.
    pub verdict: Verdict,
    /// The verdict in words.
    pub reason: String,
    /// The shadow figures over the rule's window (absent without reports).
    #[serde(flatten, default, skip_serializing_if = "Option::is_none")]
    pub figures: Option<ShadowFigures>,
}

/// The shadow figures a promotion was decided on.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct ShadowFigures {
    /// Days in shadow without interruption.
    pub days_in_shadow: f64,
    /// Since when.
    pub shadow_since: Option<DateTime<Utc>>,
    /// Fraction of the window's minutes with a report.
    pub coverage: f64,
    /// Virtual drops ÷ offered over the window.
    pub virtual_drop_share: f64,
    /// Requests offered over the window.
    pub offered: f64,
    /// Requests that would have been dropped.
    pub virtual_dropped: f64,
    /// The largest per-minute virtual-drop share.
    pub peak_drop_share: f64,
    /// Its minute.
    pub peak_drop_at: Option<DateTime<Utc>>,
    /// The smallest limit that would have kept virtual drops under 0.01 %.
    pub suggested_limit_rps: Option<f64>,
    /// The bucket's limit in its latest report.
    pub shadow_limit_rps: f64,
    /// Start of the window.
    pub window_start: DateTime<Utc>,
    /// End of the window.
    pub window_end: DateTime<Utc>,
    /// The newest report.
    pub last_report: Option<DateTime<Utc>>,
}

impl ShadowFigures {
    /// The figures of `s` at `now`, rounded as shown.
    pub fn of(s: &ShadowStats, now: DateTime<Utc>) -> ShadowFigures {
        let round = |v: f64, k: f64| (v * k).round() / k;
        ShadowFigures {
            days_in_shadow: round(s.days_in_shadow(now), 100.0),
            shadow_since: s.shadow_since,
            coverage: round(s.coverage, 10_000.0),
            virtual_drop_share: s.drop_share(),
            offered: s.offered,
            virtual_dropped: s.virtual_dropped,
            peak_drop_share: s.peak_drop_share,
            peak_drop_at: s.peak_drop_at,
            suggested_limit_rps: s.suggested_limit_rps.map(|v| round(v, 1000.0)),
            shadow_limit_rps: s.limit_rps,
            window_start: s.window_start,
            window_end: s.window_end,
            last_report: s.last_report,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn figures_read_what_they_know_and_ignore_the_rest() {
        let p = PolicyEvidence(json!({
            "statistic": "max", "value_rps": 400.0, "headroom": "lots",
            "set_by": {"kind": "grown_peak"}, "plugin_field": [1, 2]
        }));
        let f = p.figures();
        assert_eq!(f.statistic.as_deref(), Some("max"));
        assert_eq!(f.value_rps, Some(400.0));
        assert_eq!(f.headroom, None, "a string is not a headroom");
        assert_eq!(f.set_by.and_then(|s| s.kind).as_deref(), Some("grown_peak"));
        assert_eq!(
            PolicyEvidence(json!("text")).figures(),
            PolicyFigures::default()
        );
    }

    #[test]
    fn stored_evidence_round_trips_and_old_rows_still_read() {
        let e = Evidence {
            explain: Some("max 400 rps × 1.25".into()),
            peak_rps: Some(400.0),
            rails: vec!["decrease capped".into()],
            ..Evidence::default()
        };
        let text = serde_json::to_string(&e).unwrap();
        assert_eq!(Evidence::from_stored(&text), e);
        // Rows written before: unknown keys are ignored, a number where a string is expected
        // gives empty evidence rather than an error.
        let old = Evidence::from_stored(r#"{"kept_current":"no traffic","held":"x"}"#);
        assert_eq!(old.why(), Some("no traffic"));
        assert_eq!(Evidence::from_stored("not json"), Evidence::default());
    }
}
