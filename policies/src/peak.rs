//! `peak`: the max (or a percentile) of the per-step rate over the lookback × (1 + headroom),
//! with a floor and a ceiling from planned capacity. A one-off burst (a retry storm: an hour
//! above `spike_factor` × both the same hour of the other weeks and the hours around it,
//! [`crate::spikes`]) is left out and named: the peak is a level traffic reaches again, not a
//! storm it once was. Short history widens the margin by the VPA's `1 + 1/confidence_days` and
//! keeps the bucket in shadow.

use schema::PolicyName;
use serde_json::json;

use crate::{bound, headroom, round3, Policy, PolicyError, PolicyInput, Proposal, CONFIDENT_DAYS};

/// The built-in `peak` policy.
#[derive(Debug, Default, Clone, Copy)]
pub struct Peak;

impl Policy for Peak {
    fn name(&self) -> PolicyName {
        PolicyName::Peak
    }

    fn compute(&self, input: &PolicyInput<'_>) -> Result<Proposal, PolicyError> {
        if crate::is_auto(input.spec) {
            return crate::margin::compute(self, input);
        }
        let raw = input.series;
        let (h0, hours) = crate::spikes::hourly_maxima(raw);
        let spikes = crate::spikes::spikes(h0, &hours, crate::spike_factor(input.spec));
        let cleaned = (!spikes.is_empty()).then(|| crate::spikes::without(raw, &spikes));
        let s = cleaned.as_ref().unwrap_or(raw);
        let (stat, stat_name) = match input.spec.percentile {
            Some(p) if !(0.0..=100.0).contains(&p) => {
                return Err(PolicyError::Params(format!(
                    "percentile {p} is not within 0–100"
                )))
            }
            Some(p) => (s.percentile(p).ok_or(PolicyError::NoData)?, format!("p{p}")),
            None => (s.max().ok_or(PolicyError::NoData)?, "max".to_string()),
        };
        // The observed peak, storms included (what a reviewer compares the limit with).
        let peak = raw.max().unwrap_or(stat);
        let peak_at = raw.argmax().map(|i| raw.datetime_of(i).to_rfc3339());
        // When the level used was reached (the peak's time unless a spike was left out).
        let stat_at = s.argmax().map(|i| s.datetime_of(i).to_rfc3339());
        let history_days = raw.confidence_days_with(input.left_out);
        // In units of confident_history ÷ 7 (days at the default): the VPA's rule, scaled.
        let unit_days = input
            .spec
            .confident_history
            .map_or(1.0, |d| d.as_secs() as f64 / 86_400.0 / CONFIDENT_DAYS);
        let days = history_days / unit_days;
        let young = days < CONFIDENT_DAYS;
        // VPA recommender: bound × (1 + 1/confidence_days) while history is short.
        let widen = if young {
            1.0 + 1.0 / days.max(1.0 / 24.0)
        } else {
            1.0
        };
        let h = headroom(input.spec);
        let limit = stat * (1.0 + h) * widen;
        let (limit, capped_by) = bound(limit, input);
        let confidence = (days / CONFIDENT_DAYS).min(1.0);
        let mut explain = format!(
            "{stat_name} {stat:.1} rps{} × {:.2}",
            if stat_name == "max" {
                format!(" at {}", stat_at.as_deref().unwrap_or("?"))
            } else {
                String::new()
            },
            1.0 + h
        );
        if young {
            explain.push_str(&format!(
                " × {widen:.2} ({history_days:.1} days of history, shadow)"
            ));
        }
        explain.push_str(&crate::spikes::explain(&spikes));
        if let Some(c) = capped_by {
            explain.push_str(&format!("; capped by {c}"));
        }
        Ok(Proposal {
            limit_rps: limit,
            shadow: young,
            policy: PolicyName::Peak,
            peak_rps: peak,
            confidence,
            evidence: json!({
                "statistic": stat_name,
                "value_rps": round3(stat),
                // When the statistic was reached (a `max` only: a percentile has no one time).
                "value_at": if stat_name == "max" { stat_at.clone() } else { None },
                "peak_rps": round3(peak),
                "peak_at": peak_at,
                "window": {"from": s.datetime_of(0).to_rfc3339(), "to": s.datetime_of(s.values.len()).to_rfc3339()},
                "headroom": h,
                "history_days": round3(history_days),
                "coverage": round3(raw.coverage_since_first_with(input.left_out)),
                "short_history_margin": young.then_some(round3(widen)),
                "capped_by": capped_by,
                "capacity_share_rps": input.capacity_share_rps.map(round3),
                "spikes": crate::spikes::evidence(&spikes),
                "explain": explain,
            }),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RateSeries;
    use schema::PolicySpec;

    /// `days` at 10 rps with a one-minute `peak` at noon every day (recurring: a level the
    /// traffic reaches again, not a one-off) and one missing minute.
    fn series(days: usize, peak: f32) -> RateSeries {
        let n = days * 1440;
        let mut values = vec![10.0; n];
        for d in 0..days {
            values[d * 1440 + 720] = peak;
        }
        values[n / 3] = f32::NAN;
        RateSeries {
            start: 0,
            step: 60,
            values,
        }
    }

    fn run(s: &RateSeries, spec: &PolicySpec, cap: Option<f64>) -> Proposal {
        Peak.compute(&PolicyInput {
            left_out: 0,
            service: "s",
            caller: Some("c"),
            procedure: None,
            series: s,
            spec,
            capacity_share_rps: cap,
            now: chrono::Utc::now(),
        })
        .unwrap()
    }

    #[test]
    fn max_times_headroom() {
        let p = run(&series(28, 100.0), &PolicySpec::default(), None);
        assert!((p.limit_rps - 125.0).abs() < 1e-6, "{p:?}");
        assert!(!p.shadow);
        assert_eq!(p.confidence, 1.0);
    }

    #[test]
    fn a_one_off_storm_is_left_out_and_named() {
        // A 10-minute storm at 8× one afternoon of four weeks of noon peaks at 100 rps.
        let mut s = series(28, 100.0);
        for v in &mut s.values[7 * 1440 + 14 * 60..7 * 1440 + 14 * 60 + 10] {
            *v = 800.0;
        }
        let p = run(&s, &PolicySpec::default(), None);
        assert_eq!(p.limit_rps, 125.0, "{p:?}");
        assert_eq!(p.peak_rps, 800.0, "the observed peak is reported");
        assert_eq!(p.evidence["spikes"][0]["ratio"], 80.0, "{}", p.evidence);
        // Each figure names its own time: the observed peak the storm's, the max the limit
        // is built on a usual noon's.
        assert_eq!(p.evidence["peak_at"], "1970-01-08T14:00:00+00:00");
        let value_at = p.evidence["value_at"].as_str().unwrap();
        assert!(value_at.ends_with("T12:00:00+00:00"), "{}", p.evidence);
        let why = p.evidence["explain"].as_str().unwrap();
        assert!(
            why.contains("spike 1970-01-08T14:00:00+00:00 800.0 rps (80.0× usual) discounted"),
            "{why}"
        );
        // A higher spike factor keeps it.
        let spec = PolicySpec {
            spike_factor: Some(100.0),
            ..Default::default()
        };
        assert_eq!(run(&s, &spec, None).limit_rps, 1000.0);
    }

    #[test]
    fn percentile_option_ignores_rare_peak() {
        let spec = PolicySpec {
            percentile: Some(99.0),
            headroom: Some(0.0.into()),
            ..Default::default()
        };
        let p = run(&series(28, 100.0), &spec, None);
        assert_eq!(p.limit_rps, 10.0);
        assert_eq!(p.peak_rps, 100.0);
        assert!(
            p.evidence["value_at"].is_null(),
            "a percentile has no one time"
        );
    }

    #[test]
    fn short_history_widens_and_shadows() {
        let p = run(&series(3, 100.0), &PolicySpec::default(), None);
        // 3 days minus one missing minute: margin ≈ 1 + 1/3.
        assert!(
            p.limit_rps > 125.0 * 1.33 && p.limit_rps < 125.0 * 1.34,
            "{p:?}"
        );
        assert!(p.shadow);
    }

    /// A `lookback: 7d` grid whose last minutes have not arrived yet (scrape interval, rule
    /// evaluation, a run started just after the minute): a week of history, not a young bucket.
    #[test]
    fn the_minutes_not_yet_scraped_do_not_make_a_week_young() {
        let mut s = RateSeries {
            start: 0,
            step: 60,
            values: vec![100.0; 7 * 1440 + 1],
        };
        let n = s.values.len();
        for v in &mut s.values[n - 3..] {
            *v = f32::NAN;
        }
        let p = run(&s, &PolicySpec::default(), None);
        assert_eq!(p.limit_rps, 125.0, "{p:?}");
        assert!(!p.shadow);
        // A series that stopped a day ago has a day less of history.
        for v in &mut s.values[n - 1440..] {
            *v = f32::NAN;
        }
        assert!(run(&s, &PolicySpec::default(), None).shadow);
    }

    #[test]
    fn confident_history_scales_the_short_history_rule() {
        // 70 minutes of history at 1 min steps against confident_history 70m: confident.
        let s = RateSeries {
            start: 0,
            step: 60,
            values: vec![100.0; 70],
        };
        let spec = PolicySpec {
            confident_history: Some("70m".parse().unwrap()),
            ..Default::default()
        };
        let p = run(&s, &spec, None);
        assert_eq!(p.limit_rps, 125.0);
        assert!(!p.shadow);
        assert_eq!(p.confidence, 1.0);
        // 30 minutes of it: 3 units of 10 minutes, margin 1 + 1/3, shadow.
        let s = RateSeries {
            start: 0,
            step: 60,
            values: vec![100.0; 30],
        };
        let p = run(&s, &spec, None);
        assert!(
            (p.limit_rps - 125.0 * (1.0 + 1.0 / 3.0)).abs() < 1e-6,
            "{p:?}"
        );
        assert!(p.shadow);
        // The default (7 days) makes the same 30 minutes young by far.
        let p = run(&s, &PolicySpec::default(), None);
        assert!(p.limit_rps > 125.0 * 20.0, "{p:?}");
    }

    #[test]
    fn floor_and_capacity_cap() {
        let spec = PolicySpec {
            floor_rps: Some(500.0),
            ..Default::default()
        };
        assert_eq!(run(&series(28, 100.0), &spec, None).limit_rps, 500.0);
        assert_eq!(
            run(&series(28, 100.0), &PolicySpec::default(), Some(80.0)).limit_rps,
            80.0
        );
    }

    #[test]
    fn no_data_is_an_error() {
        let s = RateSeries::empty(0, 60, 10);
        let e = Peak.compute(&PolicyInput {
            left_out: 0,
            service: "s",
            caller: None,
            procedure: Some("p"),
            series: &s,
            spec: &PolicySpec::default(),
            capacity_share_rps: None,
            now: chrono::Utc::now(),
        });
        assert!(matches!(e, Err(PolicyError::NoData)));
    }
}
