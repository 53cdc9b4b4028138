//! Minutes that are not demand, left out before a policy sees a series: the minutes an enforced
//! bucket was throttled (its limit refused requests: a storm, an overload — unless it lasted,
//! see below), and the windows `rlc/policies.yaml` excludes (`excluded:`: an incident, a load
//! test). A quota learned from offered load would otherwise learn from the incidents it exists
//! to stop: a retry storm would raise its own ceiling.
//!
//! Throttling on at least `sustained_throttling_days` distinct days of the window (or through
//! most of a window shorter than that) is demand that outgrew its limit: those minutes count
//! (the bucket is raised, a `throttled_raise` for review) and the evidence says how much was
//! refused and for how long.

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, TimeZone, Utc};
use policies::RateSeries;
use schema::{Exclusion, PolicySpec};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A rate over a range still carries a window's traffic after the window ends (the sample at
/// `t` of `rate(x[5m])` counts the five minutes before `t`): this many seconds after each
/// window are left out with it.
pub const LAG_SECS: i64 = 300;

/// The controller's clock and the history's may differ, and a window's first minute may be
/// stamped on the sample before it: this many seconds before each window are left out too.
pub const LEAD_SECS: i64 = 60;

/// The default of `sustained_throttling_days`.
pub const DEFAULT_SUSTAINED_THROTTLING_DAYS: u32 = 2;

/// The minutes one bucket was throttled in the window, from the controller's reports.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Throttled {
    /// Start (unix seconds) of every minute with real drops, sorted.
    pub minutes: Vec<i64>,
    /// Requests refused over those minutes.
    pub refused: f64,
}

/// The throttled minutes of every bucket, by `(service, bucket)`.
pub type ThrottledMinutes = BTreeMap<(String, String), Throttled>;

/// An incident override acting on one bucket, as rlc saw it on the controller.
#[derive(Debug, Clone, PartialEq)]
pub struct OverrideWindow {
    /// The override's id.
    pub id: String,
    /// When it started.
    pub from: DateTime<Utc>,
    /// When it ended (or will).
    pub to: DateTime<Utc>,
    /// Its reason.
    pub reason: String,
    /// Who added it (the override's `who`; empty when rlc did not see it).
    pub who: String,
    /// What it does, in words (`limit 50 rps`, `drop 90 %`; empty when rlc did not see it).
    pub action: String,
    /// When it expires (its TTL's end; `to` is earlier when it was removed before).
    pub expires_at: DateTime<Utc>,
    /// The region of the controller it was seen on (empty for rows recorded before regions).
    pub region: String,
}

/// What the controller's reports and overrides say of the window, by `(service, bucket)`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Observed {
    /// Minutes each enforced bucket refused requests.
    pub throttled: ThrottledMinutes,
    /// The incident overrides that acted on each bucket.
    pub overrides: BTreeMap<(String, String), Vec<OverrideWindow>>,
    /// The busiest minute of each bucket's critical demand (CRITICAL_PLUS and CRITICAL
    /// requests offered, from the controllers' counts by tier) in the window: its mean rate
    /// and when it began. Absent for buckets whose clients count no tiers.
    pub critical_peaks: BTreeMap<(String, String), (f64, DateTime<Utc>)>,
}

/// A window left out of a series.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Ignored {
    /// `throttled` (the bucket refused requests) or `excluded` (`rlc/policies.yaml`).
    pub kind: String,
    /// Start.
    pub from: DateTime<Utc>,
    /// End.
    pub to: DateTime<Utc>,
    /// Why, in words.
    pub reason: String,
}

/// How much demand the bucket's limit refused in the window.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ThrottledEvidence {
    /// Minutes with real drops.
    pub minutes: usize,
    /// Distinct days they fell on.
    pub days: usize,
    /// Requests refused.
    pub refused_requests: f64,
    /// First and last throttled minute.
    pub first: DateTime<Utc>,
    /// The last.
    pub last: DateTime<Utc>,
    /// Whether it lasted `sustained_throttling_days` (demand, counted) or not (left out).
    pub sustained: bool,
}

/// What is left out of one series, and what its throttling says.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Censored {
    /// The windows left out, in order.
    pub ignored: Vec<Ignored>,
    /// The bucket's throttling in the window, if any.
    pub throttled: Option<ThrottledEvidence>,
}

fn at(t: i64) -> DateTime<Utc> {
    Utc.timestamp_opt(t, 0).single().unwrap_or_default()
}

/// What is left out of the series of `(service, caller, procedure)` whose bucket is `bucket`
/// over `[start, end)`: the exclusions that cover it, the incident overrides that acted on it,
/// and its throttled minutes (outside overrides) unless they lasted `spec`'s
/// `sustained_throttling_days`.
pub fn censored(
    (service, caller, procedure): (&str, Option<&str>, Option<&str>),
    bucket: &str,
    spec: &PolicySpec,
    excluded: &[Exclusion],
    observed: &Observed,
    (start, end): (i64, i64),
) -> Censored {
    let key = (service.to_string(), bucket.to_string());
    let overrides: Vec<&OverrideWindow> = observed
        .overrides
        .get(&key)
        .into_iter()
        .flatten()
        .filter(|o| o.to.timestamp() > start && o.from.timestamp() < end)
        .collect();
    let mut out = Censored::default();
    for e in excluded
        .iter()
        .filter(|e| e.covers(service, caller, procedure))
        .filter(|e| e.to.timestamp() > start && e.from.timestamp() < end)
    {
        out.ignored.push(Ignored {
            kind: "excluded".into(),
            from: e.from,
            to: e.to,
            reason: e.reason.clone(),
        });
    }
    for o in &overrides {
        out.ignored.push(Ignored {
            kind: "override".into(),
            from: o.from,
            to: o.to,
            reason: format!("override {}: {}", o.id, o.reason),
        });
    }
    // Minutes under an override are the override's doing, not demand outgrowing the limit.
    let overridden = |m: i64| {
        overrides
            .iter()
            .any(|o| m + 60 > o.from.timestamp() && m < o.to.timestamp())
    };
    if let Some(t) = observed.throttled.get(&key) {
        let minutes: Vec<i64> = t
            .minutes
            .iter()
            .copied()
            .filter(|m| (start - LAG_SECS..end + LEAD_SECS).contains(m))
            .filter(|&m| !overridden(m))
            .collect();
        if let (Some(&first), Some(&last)) = (minutes.first(), minutes.last()) {
            let days: BTreeSet<i64> = minutes.iter().map(|m| m.div_euclid(86_400)).collect();
            // Over days, or over most of a window shorter than that (a trial with a lookback
            // of minutes: a limit that refused demand through it has been outgrown).
            let sustained = days.len() as u32
                >= spec
                    .sustained_throttling_days
                    .unwrap_or(DEFAULT_SUSTAINED_THROTTLING_DAYS)
                || minutes.len() as i64 * 60 * 2 >= end - start;
            if !sustained {
                // Consecutive minutes as one window.
                let mut runs: Vec<(i64, i64)> = Vec::new();
                for &m in &minutes {
                    match runs.last_mut() {
                        Some(r) if r.1 == m => r.1 = m + 60,
                        _ => runs.push((m, m + 60)),
                    }
                }
                for (from, to) in runs {
                    out.ignored.push(Ignored {
                        kind: "throttled".into(),
                        from: at(from),
                        to: at(to),
                        reason: "the bucket's limit refused requests: refused demand, not demand"
                            .into(),
                    });
                }
            }
            out.throttled = Some(ThrottledEvidence {
                minutes: minutes.len(),
                days: days.len(),
                refused_requests: t.refused.round(),
                first: at(first),
                last: at(last + 60),
                sustained,
            });
        }
    }
    out.ignored.sort_by_key(|i| i.from);
    out
}

/// `s` without the samples of `ignored`, the [`LEAD_SECS`] before and the [`LAG_SECS`] after
/// each (NaN: missing, never zero), and how many samples that left out.
pub fn apply(s: &RateSeries, ignored: &[Ignored]) -> (RateSeries, usize) {
    let mut out = s.clone();
    let mut left_out = 0;
    if ignored.is_empty() {
        return (out, 0);
    }
    for (i, v) in out.values.iter_mut().enumerate() {
        let t = s.time_of(i);
        if !v.is_nan()
            && ignored
                .iter()
                .any(|w| t >= w.from.timestamp() - LEAD_SECS && t < w.to.timestamp() + LAG_SECS)
        {
            *v = f32::NAN;
            left_out += 1;
        }
    }
    (out, left_out)
}

/// What the one-line why says of it.
pub fn explain(c: &Censored) -> String {
    let mut out = String::new();
    let minute = |t: DateTime<Utc>| t.format("%Y-%m-%d %H:%M").to_string();
    let excluded: Vec<&Ignored> = c.ignored.iter().filter(|i| i.kind == "excluded").collect();
    for e in excluded.iter().take(3) {
        out.push_str(&format!(
            "; excluded {}–{} UTC ({})",
            minute(e.from),
            e.to.format("%H:%M"),
            e.reason
        ));
    }
    if excluded.len() > 3 {
        out.push_str(&format!("; {} more exclusions", excluded.len() - 3));
    }
    let overrides: Vec<&Ignored> = c.ignored.iter().filter(|i| i.kind == "override").collect();
    for o in overrides.iter().take(3) {
        out.push_str(&format!(
            "; {} {}–{} UTC left out",
            o.reason,
            minute(o.from),
            o.to.format("%H:%M")
        ));
    }
    if overrides.len() > 3 {
        out.push_str(&format!("; {} more overrides", overrides.len() - 3));
    }
    if let Some(t) = &c.throttled {
        if t.sustained {
            out.push_str(&format!(
                "; throttled {} minutes on {} days ({} requests refused): sustained demand, counted",
                t.minutes,
                t.days,
                schema::format_rps(t.refused_requests)
            ));
        } else {
            out.push_str(&format!(
                "; {} throttled minute{} ({} {}–{} UTC, {} requests refused) left out",
                t.minutes,
                if t.minutes == 1 { "" } else { "s" },
                t.first.format("%Y-%m-%d"),
                t.first.format("%H:%M"),
                t.last.format("%H:%M"),
                schema::format_rps(t.refused_requests)
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: i64 = 86_400;

    fn exclusion(caller: Option<&str>, from: i64, to: i64) -> Exclusion {
        Exclusion {
            service: "pay".into(),
            caller: caller.map(str::to_string),
            procedure: None,
            from: at(from),
            to: at(to),
            reason: "INC-123".into(),
        }
    }

    #[test]
    fn short_throttling_and_exclusions_are_left_out_sustained_throttling_counts() {
        let start = 20_000 * DAY;
        let end = start + 28 * DAY;
        let key = ("pay", Some("web"), None);
        let mut observed = Observed::default();
        // Ten minutes one afternoon.
        observed.throttled.insert(
            ("pay".into(), "web".into()),
            Throttled {
                minutes: (0..10)
                    .map(|m| start + 3 * DAY + 14 * 3600 + m * 60)
                    .collect(),
                refused: 1234.4,
            },
        );
        let ex = [
            exclusion(Some("web"), start + DAY, start + DAY + 3600),
            exclusion(Some("other"), start, end),
        ];
        let spec = PolicySpec::default();
        let c = censored(key, "web", &spec, &ex, &observed, (start, end));
        let kinds: Vec<(&str, i64)> = c
            .ignored
            .iter()
            .map(|i| (i.kind.as_str(), (i.to - i.from).num_minutes()))
            .collect();
        assert_eq!(kinds, [("excluded", 60), ("throttled", 10)]);
        let t = c.throttled.as_ref().unwrap();
        assert_eq!(
            (t.minutes, t.days, t.sustained, t.refused_requests),
            (10, 1, false, 1234.0)
        );
        let why = explain(&c);
        assert!(why.contains("excluded") && why.contains("INC-123"), "{why}");
        assert!(
            why.contains("10 throttled minutes") && why.contains("left out"),
            "{why}"
        );
        // Masked: the series loses those samples, the minute before and the five minutes after
        // each window.
        let s = RateSeries {
            start,
            step: 60,
            values: vec![1.0; 28 * 1440],
        };
        let (masked, left_out) = apply(&s, &c.ignored);
        assert_eq!(masked.values.iter().filter(|v| v.is_nan()).count(), 82);
        assert_eq!(left_out, 82);
        // The same minutes on two days: sustained, counted.
        let mut two = observed.clone();
        two.throttled
            .get_mut(&("pay".into(), "web".into()))
            .unwrap()
            .minutes
            .push(start + 5 * DAY);
        let c = censored(key, "web", &spec, &[], &two, (start, end));
        assert!(c.ignored.is_empty());
        assert!(c.throttled.as_ref().unwrap().sustained);
        assert!(explain(&c).contains("sustained demand, counted"));
        // Unless the second day's throttling was an override's doing: left out with it.
        two.overrides.insert(
            ("pay".into(), "web".into()),
            vec![OverrideWindow {
                id: "ovr-7".into(),
                from: at(start + 5 * DAY - 600),
                to: at(start + 5 * DAY + 600),
                reason: "INC-123 shed load".into(),
                who: "oncall".into(),
                action: "drop 90 %".into(),
                expires_at: at(start + 5 * DAY + 600),
                region: String::new(),
            }],
        );
        let c = censored(key, "web", &spec, &[], &two, (start, end));
        let t = c.throttled.as_ref().unwrap();
        assert!(!t.sustained && t.minutes == 10, "{t:?}");
        assert!(
            c.ignored.iter().any(|i| i.kind == "override"),
            "{:?}",
            c.ignored
        );
        let why = explain(&c);
        assert!(why.contains("override ovr-7: INC-123 shed load"), "{why}");
    }
}
