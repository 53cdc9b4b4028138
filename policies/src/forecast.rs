//! `forecast`: a seasonal (daily and weekly) model with a linear trend, forecasting the horizon
//! (7 days default). The limit is the upper prediction bound × (1 + headroom), capped by the
//! caller's share of planned capacity. With under two weeks of history, or when the fit fails,
//! it falls back to [`Peak`](crate::peak::Peak) and says so in the evidence.
//!
//! The model works on hourly maxima of the per-step rate (the quantity a limit must cover):
//! `h(t) = (a + b·t) × s(hour of week)`, `a`, `b` by least squares, `s` the mean ratio of the
//! value to the trend for each of the 168 hours of the week (so it carries the daily shape and
//! the weekly one; multiplicative because traffic peaks grow with the traffic), and the upper
//! bound multiplies by the 99th percentile of the in-sample residual ratios. Simple, deterministic and
//! cheap (no external crate): 10,000 series fit in well under a second.

use schema::PolicyName;
use serde_json::json;

use crate::peak::{round3, Peak};
use crate::{bound, headroom, Policy, PolicyError, PolicyInput, Proposal};

/// Days of history the forecast needs; below that it falls back to `peak`.
pub const MIN_DAYS: f64 = 14.0;
/// Default horizon: 7 days.
pub const DEFAULT_HORIZON_SECS: u64 = 7 * 86_400;
const WEEK_HOURS: usize = 168;

/// The built-in `forecast` policy.
#[derive(Debug, Default, Clone, Copy)]
pub struct Forecast;

/// A fitted model (exposed for tests and backtests).
#[derive(Debug, Clone, PartialEq)]
pub struct Fit {
    /// Intercept (rps) at hour index 0 of the history.
    pub intercept: f64,
    /// Trend, rps per hour.
    pub slope_per_hour: f64,
    /// Mean ratio to the trend for each hour of the week (0 = Thursday 00:00 UTC, the epoch's).
    pub seasonal: Vec<f64>,
    /// 99th percentile of the residual ratios (≥ 1).
    pub residual_q99: f64,
    /// Unix time of hour index 0.
    pub start_hour: i64,
    /// Number of hours fitted.
    pub hours: usize,
}

impl Fit {
    /// Fits the model on the hourly maxima of `s`; `None` when there is too little data or the
    /// numbers are not finite.
    #[allow(clippy::self_named_constructors)]
    pub fn fit(s: &crate::RateSeries) -> Option<Fit> {
        let per_hour = (3600 / s.step.max(1)).max(1) as usize;
        let start_hour = s.start.div_euclid(3600) * 3600;
        let offset = ((s.start - start_hour) / s.step.max(1)) as usize;
        let hours = (offset + s.values.len()).div_ceil(per_hour);
        let mut h = vec![f64::NAN; hours];
        for (i, &v) in s.values.iter().enumerate() {
            if v.is_nan() {
                continue;
            }
            let k = (offset + i) / per_hour;
            let v = f64::from(v);
            if h[k].is_nan() || v > h[k] {
                h[k] = v;
            }
        }
        let pts: Vec<(f64, f64)> = h
            .iter()
            .enumerate()
            .filter(|(_, v)| !v.is_nan())
            .map(|(i, &v)| (i as f64, v))
            .collect();
        if pts.len() < 2 * WEEK_HOURS {
            return None;
        }
        let n = pts.len() as f64;
        let mx = pts.iter().map(|p| p.0).sum::<f64>() / n;
        let my = pts.iter().map(|p| p.1).sum::<f64>() / n;
        let sxx: f64 = pts.iter().map(|p| (p.0 - mx).powi(2)).sum();
        let sxy: f64 = pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
        let slope = if sxx > 0.0 { sxy / sxx } else { 0.0 };
        let intercept = my - slope * mx;
        let slot =
            |i: usize| ((start_hour / 3600 + i as i64).rem_euclid(WEEK_HOURS as i64)) as usize;
        let mut sum = vec![0.0; WEEK_HOURS];
        let mut cnt = vec![0usize; WEEK_HOURS];
        let trend = |x: f64| intercept + slope * x;
        // A trend at or below zero anywhere in the window cannot carry a multiplicative season.
        if trend(0.0) <= 0.0 || trend(hours as f64) <= 0.0 {
            return None;
        }
        for &(x, y) in &pts {
            let k = slot(x as usize);
            sum[k] += y / trend(x);
            cnt[k] += 1;
        }
        let seasonal: Vec<f64> = sum
            .iter()
            .zip(&cnt)
            .map(|(s, &c)| if c > 0 { s / c as f64 } else { 1.0 })
            .collect();
        let mut res: Vec<f64> = pts
            .iter()
            .map(|&(x, y)| {
                let f = trend(x) * seasonal[slot(x as usize)];
                if f > 0.0 {
                    y / f
                } else {
                    1.0
                }
            })
            .collect();
        res.sort_by(f64::total_cmp);
        let q = res[((res.len() as f64 * 0.99).ceil() as usize).clamp(1, res.len()) - 1].max(1.0);
        let fit = Fit {
            intercept,
            slope_per_hour: slope,
            seasonal,
            residual_q99: q,
            start_hour,
            hours,
        };
        (fit.intercept.is_finite() && fit.slope_per_hour.is_finite() && q.is_finite())
            .then_some(fit)
    }

    /// Point forecast of the hourly max at unix time `t`.
    pub fn predict(&self, t: i64) -> f64 {
        let x = (t - self.start_hour) as f64 / 3600.0;
        let slot = (t.div_euclid(3600)).rem_euclid(WEEK_HOURS as i64) as usize;
        (self.intercept + self.slope_per_hour * x).max(0.0) * self.seasonal[slot]
    }

    /// Upper prediction bound of the max over `[from, to)`, and the point forecast there.
    pub fn upper_over(&self, from: i64, to: i64) -> (f64, f64) {
        let mut best = f64::NEG_INFINITY;
        let mut t = from.div_euclid(3600) * 3600;
        while t < to {
            best = best.max(self.predict(t));
            t += 3600;
        }
        (best * self.residual_q99, best)
    }
}

impl Policy for Forecast {
    fn name(&self) -> PolicyName {
        PolicyName::Forecast
    }

    fn compute(&self, input: &PolicyInput<'_>) -> Result<Proposal, PolicyError> {
        let s = input.series;
        let days = s.confidence_days();
        let horizon = input
            .spec
            .horizon
            .map_or(DEFAULT_HORIZON_SECS, |h| h.as_secs()) as i64;
        let fallback = |why: String| -> Result<Proposal, PolicyError> {
            let mut p = Peak.compute(input)?;
            if let Some(o) = p.evidence.as_object_mut() {
                o.insert("fallback_from".into(), json!("forecast"));
                o.insert("fallback_reason".into(), json!(why));
            }
            Ok(p)
        };
        if days < MIN_DAYS {
            return fallback(format!(
                "{:.1} days of history, the forecast needs {MIN_DAYS}",
                days
            ));
        }
        let Some(fit) = Fit::fit(s) else {
            return fallback("the seasonal fit failed".into());
        };
        let end = s.end();
        let (upper, point) = fit.upper_over(end, end + horizon);
        if !upper.is_finite() || upper <= 0.0 {
            return fallback(format!("the forecast is not usable ({upper})"));
        }
        let peak = s.max().ok_or(PolicyError::NoData)?;
        let h = headroom(input.spec);
        let limit = upper * (1.0 + h);
        let (limit, capped_by) = bound(limit, input);
        Ok(Proposal {
            limit_rps: limit,
            shadow: false,
            policy: PolicyName::Forecast,
            peak_rps: peak,
            confidence: (days / 28.0).min(1.0),
            evidence: json!({
                "model": "hourly max = linear trend × hour-of-week seasonal index; upper bound = × q99 of residual ratios",
                "window": {"from": s.datetime_of(0).to_rfc3339(), "to": s.datetime_of(s.values.len()).to_rfc3339()},
                "horizon_days": round3(horizon as f64 / 86_400.0),
                "trend_rps_per_day": round3(fit.slope_per_hour * 24.0),
                "forecast_max_rps": round3(point),
                "upper_bound_rps": round3(upper),
                "residual_ratio_q99": round3(fit.residual_q99),
                "peak_rps": round3(peak),
                "peak_at": s.argmax().map(|i| s.datetime_of(i).to_rfc3339()),
                "coverage": round3(s.coverage_since_first()),
                "headroom": h,
                "history_days": round3(days),
                "capped_by": capped_by,
                "capacity_share_rps": input.capacity_share_rps.map(round3),
            }),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RateSeries;
    use schema::PolicySpec;

    fn growing(days: usize, base: f64, per_day: f64) -> RateSeries {
        let start = 1_700_000_000 / 86_400 * 86_400;
        let values = (0..days * 1440)
            .map(|i| {
                let d = i as f64 / 1440.0;
                let diurnal = 1.0 + 0.5 * (2.0 * std::f64::consts::PI * d).sin();
                ((base + per_day * d) * diurnal) as f32
            })
            .collect();
        RateSeries {
            start,
            step: 60,
            values,
        }
    }

    fn run(s: &RateSeries) -> Proposal {
        Forecast
            .compute(&PolicyInput {
                service: "s",
                caller: Some("c"),
                procedure: None,
                series: s,
                spec: &PolicySpec {
                    headroom: Some(0.0),
                    ..Default::default()
                },
                capacity_share_rps: None,
                now: chrono::Utc::now(),
            })
            .unwrap()
    }

    #[test]
    fn follows_a_trend() {
        let s = growing(28, 100.0, 5.0);
        let p = run(&s);
        assert_eq!(p.policy, PolicyName::Forecast);
        // Day 35 peak: (100 + 5·35) · 1.5 = 412.5; observed peak ≈ (100 + 5·28) · 1.5 = 360.
        assert!(p.limit_rps > 400.0 && p.limit_rps < 440.0, "{p:?}");
        let slope = p.evidence["trend_rps_per_day"].as_f64().unwrap();
        assert!(slope > 4.5 && slope < 5.5, "{slope}");
    }

    #[test]
    fn flat_traffic_stays_near_peak() {
        let p = run(&growing(28, 100.0, 0.0));
        assert!(p.limit_rps > 145.0 && p.limit_rps < 155.0, "{p:?}");
    }

    #[test]
    fn short_history_falls_back_to_peak() {
        let p = run(&growing(10, 100.0, 5.0));
        assert_eq!(p.policy, PolicyName::Peak);
        assert_eq!(p.evidence["fallback_from"], "forecast");
    }
}
