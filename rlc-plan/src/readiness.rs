//! Whether a shadow bucket is ready to enforce: the figures of its shadow reports over a window
//! ([`ShadowStats`], computed from the store), a promotion rule ([`Rule`], from the
//! `promotion:` section of `rlc/policies.yaml`) and the verdict ([`verdict`]) that the
//! dashboard shows and that a run acts on when it proposes `mode: enforce`.
//!
//! A bucket whose reports are missing or stale is never ready: no data is not good data.

use chrono::{DateTime, Duration, Utc};
use serde::{Deserialize, Serialize};

/// The virtual-drop share the suggested limit keeps a bucket under (0.01 %).
pub const SUGGESTED_LIMIT_DROP_SHARE: f64 = 1e-4;

/// One bucket's shadow-mode (or enforced) figures over a window.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct ShadowStats {
    /// Callee service.
    pub service: String,
    /// Bucket name.
    pub bucket: String,
    /// The bucket's mode in its latest report (`shadow` or `enforce`).
    pub mode: String,
    /// Start of the window the figures cover.
    pub window_start: DateTime<Utc>,
    /// End of the window (normally now).
    pub window_end: DateTime<Utc>,
    /// Since when the bucket has been in shadow mode without interruption (its earliest
    /// shadow report after its last enforce report), if it is in shadow.
    pub shadow_since: Option<DateTime<Utc>>,
    /// The newest report of the bucket.
    pub last_report: Option<DateTime<Utc>>,
    /// Fraction (0..=1) of the window's minutes that have a report.
    pub coverage: f64,
    /// Requests offered over the window.
    pub offered: f64,
    /// Requests that would have been dropped (shadow) over the window.
    pub virtual_dropped: f64,
    /// Requests really dropped (enforce) over the window.
    pub dropped: f64,
    /// The largest per-minute virtual-drop share (virtual drops ÷ offered) and its minute.
    pub peak_drop_share: f64,
    /// The minute of `peak_drop_share`.
    pub peak_drop_at: Option<DateTime<Utc>>,
    /// The bucket's limit in its latest report.
    pub limit_rps: f64,
    /// The smallest limit that would have kept virtual drops ≤ [`SUGGESTED_LIMIT_DROP_SHARE`]
    /// of the offered requests over the window (None without data).
    pub suggested_limit_rps: Option<f64>,
}

impl ShadowStats {
    /// Virtual drops ÷ offered over the window (0 without traffic).
    pub fn drop_share(&self) -> f64 {
        if self.offered > 0.0 {
            self.virtual_dropped / self.offered
        } else {
            0.0
        }
    }

    /// Days the bucket has been in shadow at `now` (0 when not in shadow).
    pub fn days_in_shadow(&self, now: DateTime<Utc>) -> f64 {
        self.shadow_since
            .map(|s| (now - s).num_seconds().max(0) as f64 / 86_400.0)
            .unwrap_or(0.0)
    }
}

/// When a shadow bucket may be proposed for `mode: enforce`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Rule {
    /// Minimum time in shadow, in days.
    pub min_days_in_shadow: f64,
    /// Maximum virtual-drop share over the window (0.0001 = 0.01 %).
    pub max_virtual_drop_share: f64,
    /// Minimum coverage of the window by reports (0..=1).
    pub min_coverage: f64,
    /// Reports older than this make the data stale.
    pub max_report_age: Duration,
}

impl Default for Rule {
    fn default() -> Rule {
        Rule {
            min_days_in_shadow: 7.0,
            max_virtual_drop_share: SUGGESTED_LIMIT_DROP_SHARE,
            min_coverage: 0.9,
            max_report_age: Duration::minutes(15),
        }
    }
}

impl From<&schema::PromotionRule> for Rule {
    /// The rule of a service's `promotion:` settings in `rlc/policies.yaml`.
    fn from(p: &schema::PromotionRule) -> Rule {
        Rule {
            min_days_in_shadow: p.min_days_in_shadow,
            max_virtual_drop_share: p.max_virtual_drop_share,
            min_coverage: p.min_coverage,
            max_report_age: Duration::from_std(p.max_report_age)
                .unwrap_or_else(|_| Rule::default().max_report_age),
        }
    }
}

/// The readiness of one bucket.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(tag = "verdict", rename_all = "snake_case")]
pub enum Verdict {
    /// Meets the rule: may be proposed for `mode: enforce`.
    Ready,
    /// Does not meet the rule yet, for these reasons (time, coverage, missing or stale data).
    NotYet {
        /// Every unmet condition, in words.
        reasons: Vec<String>,
    },
    /// Would throttle more than the rule allows: enforcing it now would drop legitimate
    /// traffic.
    WouldThrottle {
        /// Virtual drops ÷ offered over the window.
        drop_share: f64,
    },
    /// Already enforced.
    Enforced,
}

impl Verdict {
    /// One line for tables and PR bodies.
    pub fn describe(&self) -> String {
        match self {
            Verdict::Ready => "ready".into(),
            Verdict::NotYet { reasons } => format!("not yet: {}", reasons.join("; ")),
            Verdict::WouldThrottle { drop_share } => {
                format!("would throttle {:.3}% of requests", drop_share * 100.0)
            }
            Verdict::Enforced => "enforced".into(),
        }
    }
}

/// The verdict of `rule` on `stats` at `now`. Missing or stale data is never ready.
pub fn verdict(stats: &ShadowStats, rule: &Rule, now: DateTime<Utc>) -> Verdict {
    if stats.mode == "enforce" {
        return Verdict::Enforced;
    }
    let mut reasons = Vec::new();
    match stats.last_report {
        None => {
            return Verdict::NotYet {
                reasons: vec!["no shadow reports".into()],
            }
        }
        Some(last) if now - last > rule.max_report_age => reasons.push(format!(
            "reports stale: the last one is from {}",
            last.format("%Y-%m-%d %H:%M UTC")
        )),
        Some(_) => {}
    }
    if stats.coverage < rule.min_coverage {
        reasons.push(format!(
            "coverage {:.1}% < {:.1}%",
            stats.coverage * 100.0,
            rule.min_coverage * 100.0
        ));
    }
    let share = stats.drop_share();
    if reasons.is_empty() && share > rule.max_virtual_drop_share {
        return Verdict::WouldThrottle { drop_share: share };
    }
    let days = stats.days_in_shadow(now);
    if days < rule.min_days_in_shadow {
        reasons.push(format!(
            "{days:.1} of {} days in shadow",
            rule.min_days_in_shadow
        ));
    }
    if share > rule.max_virtual_drop_share {
        reasons.push(format!(
            "virtual drops {:.3}% > {:.3}%",
            share * 100.0,
            rule.max_virtual_drop_share * 100.0
        ));
    }
    if reasons.is_empty() {
        Verdict::Ready
    } else {
        Verdict::NotYet { reasons }
    }
}

/// The smallest limit (rps) under which the per-minute offered rates `rates` would have lost
/// at most `share` of their requests (each minute drops `max(0, rate - limit)`); None when
/// there is no traffic. Exact: the loss is piecewise linear in the limit between sorted rates.
pub fn suggested_limit(rates: &[f64], share: f64) -> Option<f64> {
    let mut r: Vec<f64> = rates
        .iter()
        .copied()
        .filter(|v| v.is_finite() && *v > 0.0)
        .collect();
    r.sort_by(|a, b| b.total_cmp(a)); // descending
    let total: f64 = r.iter().sum();
    let weighted: Vec<(f64, f64)> = r.into_iter().map(|v| (v, 1.0)).collect();
    limit_for_budget(&weighted, total * share)
}

/// The smallest limit under which `rates` (each `(rate, how many times it occurs)`) lose at
/// most `budget` in all (`None` without a finite rate above zero): [`suggested_limit`] with
/// the budget given, for rates of which only those that matter were fetched (the store's
/// hourly roll-ups).
pub fn limit_for_budget(rates: &[(f64, f64)], budget: f64) -> Option<f64> {
    let mut r: Vec<(f64, f64)> = rates
        .iter()
        .copied()
        .filter(|(v, n)| v.is_finite() && *v > 0.0 && *n > 0.0)
        .collect();
    if r.is_empty() {
        return None;
    }
    r.sort_by(|a, b| b.0.total_cmp(&a.0)); // descending
                                           // With limit L between r[k] and r[k+1] (descending), the loss is
                                           // sum_{i<=k}(n[i] r[i]) - (sum_{i<=k} n[i]) L.
    let (mut prefix, mut count) = (0.0, 0.0);
    for k in 0..r.len() {
        prefix += r[k].0 * r[k].1;
        count += r[k].1;
        let next = r.get(k + 1).map_or(0.0, |x| x.0);
        let loss_at_next = prefix - count * next;
        if loss_at_next > budget {
            // The limit lies in (next, r[k]]: solve prefix - count L = budget.
            return Some(((prefix - budget) / count).max(next));
        }
    }
    // The budget covers every request: any limit would do; say 0.
    Some(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(now: DateTime<Utc>) -> ShadowStats {
        ShadowStats {
            service: "s".into(),
            bucket: "b".into(),
            mode: "shadow".into(),
            window_start: now - Duration::days(7),
            window_end: now,
            shadow_since: Some(now - Duration::days(8)),
            last_report: Some(now - Duration::minutes(1)),
            coverage: 0.99,
            offered: 1e6,
            virtual_dropped: 10.0,
            dropped: 0.0,
            peak_drop_share: 0.001,
            peak_drop_at: Some(now - Duration::days(2)),
            limit_rps: 100.0,
            suggested_limit_rps: Some(90.0),
        }
    }

    #[test]
    fn verdicts() {
        let now = Utc::now();
        let rule = Rule::default();
        assert_eq!(verdict(&stats(now), &rule, now), Verdict::Ready);
        let mut s = stats(now);
        s.virtual_dropped = 1e4; // 1 %
        assert!(
            matches!(verdict(&s, &rule, now), Verdict::WouldThrottle { drop_share } if (drop_share - 0.01).abs() < 1e-12)
        );
        let mut s = stats(now);
        s.shadow_since = Some(now - Duration::days(2));
        assert!(
            matches!(verdict(&s, &rule, now), Verdict::NotYet { reasons } if reasons[0].contains("2.0 of 7 days"))
        );
        let mut s = stats(now);
        s.last_report = Some(now - Duration::hours(2));
        assert!(
            matches!(verdict(&s, &rule, now), Verdict::NotYet { reasons } if reasons[0].contains("stale"))
        );
        let mut s = stats(now);
        s.last_report = None;
        assert!(matches!(verdict(&s, &rule, now), Verdict::NotYet { .. }));
        let mut s = stats(now);
        s.mode = "enforce".into();
        assert_eq!(verdict(&s, &rule, now), Verdict::Enforced);
    }

    #[test]
    fn the_defaults_of_the_promotion_section_are_the_default_rule() {
        let resolved = schema::PromotionSpec::default().resolved();
        assert_eq!(Rule::from(&resolved), Rule::default());
        let spec = schema::PromotionSpec {
            min_days_in_shadow: Some(3.0),
            max_report_age: Some("1h".parse().unwrap()),
            ..Default::default()
        };
        let r = Rule::from(&spec.resolved());
        assert_eq!(r.min_days_in_shadow, 3.0);
        assert_eq!(r.max_report_age, Duration::hours(1));
    }

    #[test]
    fn suggested_limit_is_exact() {
        // 99 minutes at 10 rps and one at 110: total 1100; 1 % budget = 11 → the 110 minute may
        // lose 11, so the limit is 99.
        let mut r = vec![10.0; 99];
        r.push(110.0);
        let l = suggested_limit(&r, 0.01).unwrap();
        assert!((l - 99.0).abs() < 1e-9, "{l}");
        // Zero budget: the peak.
        assert_eq!(suggested_limit(&r, 0.0), Some(110.0));
        assert_eq!(suggested_limit(&[], 0.01), None);
        // A budget that covers everything but the floor.
        let l = suggested_limit(&[5.0, 5.0], 1.0).unwrap();
        assert!(l >= 0.0);
    }
}
