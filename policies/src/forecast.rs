//! `forecast`: a seasonal (daily and weekly) model with a trend, forecasting the horizon (7 days
//! default), made robust to the shapes real traffic has. The limit is the upper bound of the
//! horizon × (1 + headroom), capped by the caller's share of planned capacity. With under two
//! weeks of history, or when the fit fails, it falls back to [`Peak`] and
//! says so in the evidence.
//!
//! The model works on hourly maxima of the per-step rate (the quantity a limit must cover), in
//! the service's time zone (`timezone`, default UTC, so daylight-saving time does not move the
//! daily peak between hour-of-week slots). Before the fit:
//! 1. **Spikes**: an hour above [`crate::spikes::DEFAULT_SPIKE_FACTOR`] × both the median of
//!    the same hour of the week in the other weeks and the median of the 12 hours around it is
//!    a one-off (a retry storm); it is left out of the fit and named in the evidence
//!    (`spikes`). A recurring batch is not a spike: its hour is high every week.
//! 2. **Dips and level shifts**: each local day's peak, divided by its weekday's usual share,
//!    gives a daily level. The longest run of days at the end of the history whose level is
//!    ≤ [`DIP_RATIO`] (or ≥ [`SHIFT_UP_RATIO`]) × the median level of the 7 days before it, and
//!    starts with a step of that size from the 3 days before (growth is a slope, not a step), is
//!    a change of level. A rise is the new level at once. A fall that has lasted
//!    `new_normal_after` (10 days default) is the new normal; a shorter one is a dip (a
//!    holiday, an outage) and is left out of the fit. The fit uses the new level: the history
//!    before a shift is scaled by its ratio. The evidence says which (`dip`, `level_shift`,
//!    with dates).
//!
//! The fit: `h(t) = trend(t) × s(hour of week)` for two trends, linear and exponential (least
//! squares on the log: growth of tens of percent a week compounds), `s` the **median** ratio of
//! the value to the trend for each of the 168 hours of the week; the trend is fitted on
//! `h / s` and `s` on `h / trend` in turn, so that the week's shape is not taken for a trend;
//! the upper bound × the 99th
//! percentile of the residual ratios. The bound of the horizon is the larger of the two models'
//! bounds, at most the highest cleaned hour grown by the trend to the end of the horizon, and
//! never under the highest cleaned hour of the last week of data (so a dip never pulls the limit
//! under the recurring peaks of the weeks before). Deterministic and cheap (no external crate).

use chrono::{Offset, TimeZone, Utc};
use schema::PolicyName;
use serde_json::{json, Value};

use crate::peak::Peak;
use crate::round3;
use crate::spikes::{median, Spike};
use crate::{bound, headroom, Policy, PolicyError, PolicyInput, Proposal};

/// Days of history the forecast needs; below that it falls back to `peak`.
pub const MIN_DAYS: f64 = 14.0;
/// Default horizon: 7 days.
pub const DEFAULT_HORIZON_SECS: u64 = 7 * 86_400;
/// Default time a lower level must last to be the new normal.
pub const DEFAULT_NEW_NORMAL_SECS: u64 = 10 * 86_400;
/// A day whose level is at most this × the week before is low (a dip or a fall).
pub const DIP_RATIO: f64 = 0.75;
/// A day whose level is at least this × the week before is a rise of level.
pub const SHIFT_UP_RATIO: f64 = 1.5;
const WEEK_HOURS: usize = 168;
const DAY: i64 = 86_400;

/// The built-in `forecast` policy.
#[derive(Debug, Default, Clone, Copy)]
pub struct Forecast;

/// A change of level at the end of the history.
#[derive(Debug, Clone, PartialEq)]
pub struct LevelChange {
    /// Unix time of the first day at the new level (local midnight).
    pub from: i64,
    /// Unix time of the end of the history.
    pub to: i64,
    /// Median level of the run ÷ median level of the 7 days before.
    pub ratio: f64,
    /// Days it has lasted.
    pub days: f64,
    /// `dip` (left out of the fit), `shift_down` (the new normal) or `shift_up`.
    pub kind: &'static str,
}

/// What the analysis found and the fit (exposed for tests and backtests).
#[derive(Debug, Clone, PartialEq)]
pub struct Fit {
    /// Intercept (rps) at hour index 0 of the history (linear trend).
    pub intercept: f64,
    /// Linear trend, rps per hour.
    pub slope_per_hour: f64,
    /// Exponential trend: ln(rps) at hour 0 and per hour.
    pub log_intercept: f64,
    /// Exponential trend: growth of ln(rps) per hour.
    pub log_slope_per_hour: f64,
    /// Median ratio to the linear trend for each local hour of the week (0 = Thursday 00:00).
    pub seasonal: Vec<f64>,
    /// The same against the exponential trend.
    pub seasonal_exp: Vec<f64>,
    /// 99th percentile of the residual ratios, linear model (≥ 1).
    pub residual_q99: f64,
    /// The same, exponential model.
    pub residual_q99_exp: f64,
    /// Unix time of hour index 0.
    pub start_hour: i64,
    /// Number of hours of history.
    pub hours: usize,
    /// The cleaned hourly maxima the fit used (NaN = missing or left out).
    pub cleaned: Vec<f64>,
    /// Spikes left out.
    pub spikes: Vec<Spike>,
    /// The change of level at the end of the history, if any.
    pub level: Option<LevelChange>,
    /// The time zone of the seasonal slots.
    pub tz: chrono_tz::Tz,
    /// Which trends forecast: `linear`, `exponential` or `both` (the larger, when they fit
    /// the last week of data about as well).
    pub trend: &'static str,
}

/// A fit's trends: the linear model's intercept and slope, the log-linear model's.
type Trend = (f64, f64, f64, f64);
/// A fit's weekly seasons: the linear model's index and its residual quantile, the
/// log-linear model's.
type Seasons = (Vec<f64>, f64, Vec<f64>, f64);

fn q99(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 1.0;
    }
    // The k-th smallest by selection: the same value as after a sort, in linear time.
    let k = ((v.len() as f64 * 0.99).ceil() as usize).clamp(1, v.len()) - 1;
    v.select_nth_unstable_by(k, f64::total_cmp).1.max(1.0)
}

fn offset(tz: &chrono_tz::Tz, t: i64) -> i64 {
    if *tz == chrono_tz::UTC {
        return 0;
    }
    let utc = Utc
        .timestamp_opt(t, 0)
        .single()
        .unwrap_or_default()
        .naive_utc();
    i64::from(tz.offset_from_utc_datetime(&utc).fix().local_minus_utc())
}

/// Local hour-of-week slot of unix time `t` (0 = Thursday 00:00 local, the epoch's weekday).
fn slot(tz: &chrono_tz::Tz, t: i64) -> usize {
    ((t + offset(tz, t)).div_euclid(3600)).rem_euclid(WEEK_HOURS as i64) as usize
}

fn rfc(t: i64) -> String {
    Utc.timestamp_opt(t, 0)
        .single()
        .unwrap_or_default()
        .to_rfc3339()
}

fn date(t: i64) -> String {
    Utc.timestamp_opt(t, 0)
        .single()
        .unwrap_or_default()
        .format("%Y-%m-%d")
        .to_string()
}

/// Ordinary least squares of y on x: (intercept, slope); `None` without two distinct x.
fn least_squares(pts: impl Iterator<Item = (f64, f64)> + Clone) -> Option<(f64, f64)> {
    let n = pts.clone().count() as f64;
    if n < 2.0 {
        return None;
    }
    let (sx, sy) = pts
        .clone()
        .fold((0.0, 0.0), |(a, b), (x, y)| (a + x, b + y));
    let (mx, my) = (sx / n, sy / n);
    let (sxx, sxy) = pts.fold((0.0, 0.0), |(a, b), (x, y)| {
        (a + (x - mx).powi(2), b + (x - mx) * (y - my))
    });
    (sxx > 0.0).then(|| (my - sxy / sxx * mx, sxy / sxx))
}

/// One fitted trend with its seasonal index and residual q99.
fn fit_seasonal(pts: &[(f64, f64, usize)], trend: impl Fn(f64) -> f64) -> Option<(Vec<f64>, f64)> {
    let mut by_slot: Vec<Vec<f64>> = vec![Vec::new(); WEEK_HOURS];
    for &(x, y, k) in pts {
        let t = trend(x);
        if !(t > 0.0 && t.is_finite()) {
            return None;
        }
        by_slot[k].push(y / t);
    }
    let seasonal: Vec<f64> = by_slot
        .iter_mut()
        .map(|v| median(v).unwrap_or(1.0))
        .collect();
    let res = pts
        .iter()
        .map(|&(x, y, k)| {
            let f = trend(x) * seasonal[k];
            if f > 0.0 {
                y / f
            } else {
                1.0
            }
        })
        .collect();
    Some((seasonal, q99(res)))
}

/// The peak of each local day of the hourly maxima `c` (hour 0 at `start_hour`): `(local day,
/// peak)`, for the days with at least 12 hours present and a peak above 0.
fn daily_peaks(c: &[f64], start_hour: i64, tz: &chrono_tz::Tz) -> Vec<(i64, f64)> {
    let mut days: Vec<(i64, f64, usize)> = Vec::new(); // (local day, peak, hours present)
    for (k, &v) in c.iter().enumerate() {
        let t = start_hour + k as i64 * 3600;
        let d = (t + offset(tz, t)).div_euclid(DAY);
        if days.last().is_none_or(|x| x.0 != d) {
            days.push((d, f64::NAN, 0));
        }
        let last = days.last_mut().expect("pushed");
        if !v.is_nan() {
            last.1 = if last.1.is_nan() { v } else { last.1.max(v) };
            last.2 += 1;
        }
    }
    days.into_iter()
        .filter(|d| d.2 >= 12 && d.1 > 0.0)
        .map(|d| (d.0, d.1))
        .collect()
}

/// The two trends and their seasonal indices on the cleaned hours `pts` (`(hour, value,
/// slot)`); `None` when not even the first round fits.
///
/// The trends are fitted on the values divided by their hour of the week's index, and the
/// indices on the values divided by the trends, in turn (backfitting): a trend fitted on the
/// raw hours sees growth in the week's shape itself when the history starts on a weekend and
/// ends on weekdays (or a fall the other way round). Starting from a flat index, a few rounds
/// settle.
fn backfit(pts: &[(f64, f64, usize)]) -> Option<(Trend, Seasons)> {
    let last_x = pts.last().map_or(0.0, |p| p.0);
    let first_x = pts.first().map_or(0.0, |p| p.0);
    let mean_y = pts.iter().map(|p| p.1).sum::<f64>() / pts.len() as f64;
    let flat = vec![1.0; WEEK_HOURS];
    let mut fitted: Option<(Trend, Seasons)> = None;
    for _ in 0..4 {
        let (season, season_exp) = match &fitted {
            Some((_, (s_lin, _, s_exp, _))) => (s_lin, s_exp),
            None => (&flat, &flat),
        };
        let (intercept, slope) = least_squares(
            pts.iter()
                .filter(|p| season[p.2] > 0.0)
                .map(|&(x, y, k)| (x, y / season[k])),
        )
        .unwrap_or((mean_y, 0.0));
        // A linear trend at or below zero cannot carry a multiplicative season: flat instead.
        let (intercept, slope) =
            if intercept + slope * first_x <= 0.0 || intercept + slope * last_x <= 0.0 {
                (mean_y, 0.0)
            } else {
                (intercept, slope)
            };
        let logs: Vec<(f64, f64)> = pts
            .iter()
            .filter(|p| p.1 > 0.0 && season_exp[p.2] > 0.0)
            .map(|&(x, y, k)| (x, (y / season_exp[k]).ln()))
            .collect();
        let (log_intercept, log_slope) = (logs.len() >= WEEK_HOURS)
            .then(|| least_squares(logs.into_iter()))
            .flatten()
            .unwrap_or((mean_y.max(f64::MIN_POSITIVE).ln(), 0.0));
        // A round that cannot fit (a trend overflowing) keeps the previous round's fit.
        let (Some((s_lin, q_lin)), Some((s_exp, q_exp))) = (
            fit_seasonal(pts, |x| intercept + slope * x),
            fit_seasonal(pts, |x| (log_intercept + log_slope * x).exp()),
        ) else {
            break;
        };
        fitted = Some((
            (intercept, slope, log_intercept, log_slope),
            (s_lin, q_lin, s_exp, q_exp),
        ));
    }
    fitted
}

/// The trend that fits the last week of `pts` better (mean |log residual|): `linear`,
/// `exponential`, or `both` (taking the larger) when neither is clearly better.
fn better_trend(
    pts: &[(f64, f64, usize)],
    linear: impl Fn(f64) -> f64,
    seasonal: &[f64],
    exponential: impl Fn(f64) -> f64,
    seasonal_exp: &[f64],
) -> &'static str {
    let last_x = pts.last().map_or(0.0, |p| p.0);
    let err = |tr: &dyn Fn(f64) -> f64, seas: &[f64]| {
        let tail: Vec<f64> = pts
            .iter()
            .filter(|p| p.0 + WEEK_HOURS as f64 > last_x)
            .filter(|p| p.1 > 0.0)
            .map(|&(x, y, k)| (y / (tr(x) * seas[k]).max(f64::MIN_POSITIVE)).ln().abs())
            .collect();
        tail.iter().sum::<f64>() / tail.len().max(1) as f64
    };
    let e_lin = err(&linear, seasonal);
    let e_exp = err(&exponential, seasonal_exp);
    if e_exp < 0.8 * e_lin {
        "exponential"
    } else if e_lin < 0.8 * e_exp {
        "linear"
    } else {
        "both"
    }
}

impl Fit {
    /// Fits the model on the hourly maxima of `s` in time zone `tz`, a fall of level lasting
    /// `new_normal_secs` being the new normal; `None` when there is too little data or the
    /// numbers are not finite.
    #[allow(clippy::self_named_constructors)]
    pub fn fit(
        s: &crate::RateSeries,
        tz: chrono_tz::Tz,
        new_normal_secs: i64,
        spike_factor: f64,
    ) -> Option<Fit> {
        let (start_hour, h) = crate::spikes::hourly_maxima(s);
        let hours = h.len();
        if h.iter().filter(|v| !v.is_nan()).count() < 2 * WEEK_HOURS {
            return None;
        }
        let time = |k: usize| start_hour + k as i64 * 3600;

        // 1. Spikes: above the spike factor × both the same hour in other weeks and the hours
        //    around.
        let spikes = crate::spikes::spikes(start_hour, &h, spike_factor);
        let mut c = h;
        for sp in &spikes {
            for (k, v) in c.iter_mut().enumerate() {
                if (sp.from..sp.to).contains(&time(k)) {
                    *v = f64::NAN;
                }
            }
        }

        // 2. Daily levels (local days), deseasonalised by the weekday's usual share: a dip is
        //    left out, the hours before a shift are scaled to the new level.
        let days = daily_peaks(&c, start_hour, &tz);
        let level = Self::level_change(&days, hours, start_hour, &tz, new_normal_secs);
        if let Some(l) = &level {
            for (k, v) in c.iter_mut().enumerate() {
                let t = time(k);
                match l.kind {
                    "dip" if t >= l.from => *v = f64::NAN,
                    "shift_up" | "shift_down" if t < l.from => *v *= l.ratio,
                    _ => {}
                }
            }
        }

        // 3. The two trends and their seasonal indices, on the cleaned hours.
        let pts: Vec<(f64, f64, usize)> = c
            .iter()
            .enumerate()
            .filter(|(_, v)| !v.is_nan())
            .map(|(i, &v)| (i as f64, v, slot(&tz, time(i))))
            .collect();
        if pts.len() < WEEK_HOURS {
            return None;
        }
        let (
            (intercept, slope, log_intercept, log_slope),
            (seasonal, residual_q99, seasonal_exp, residual_q99_exp),
        ) = backfit(&pts)?;
        let trend = better_trend(
            &pts,
            |x| intercept + slope * x,
            &seasonal,
            |x| (log_intercept + log_slope * x).exp(),
            &seasonal_exp,
        );
        let fit = Fit {
            trend,
            intercept,
            slope_per_hour: slope,
            log_intercept,
            log_slope_per_hour: log_slope,
            seasonal,
            seasonal_exp,
            residual_q99,
            residual_q99_exp,
            start_hour,
            hours,
            cleaned: c,
            spikes,
            level,
            tz,
        };
        [
            fit.intercept,
            fit.slope_per_hour,
            fit.log_intercept,
            fit.log_slope_per_hour,
            fit.residual_q99,
            fit.residual_q99_exp,
        ]
        .iter()
        .all(|v| v.is_finite())
        .then_some(fit)
    }

    /// The longest run of days at the end whose level is low (or high) against the 7 days
    /// before it.
    fn level_change(
        days: &[(i64, f64)],
        hours: usize,
        start_hour: i64,
        tz: &chrono_tz::Tz,
        new_normal_secs: i64,
    ) -> Option<LevelChange> {
        if days.len() < 9 {
            return None;
        }
        // Weekday share: median, over the days of that weekday, of the day's peak ÷ the median
        // peak of the 7 days around it (so that growth does not bias it).
        let nd = days.len();
        let ratios: Vec<(usize, f64)> = (0..nd)
            .filter_map(|i| {
                let lo = i.saturating_sub(3).min(nd - 7);
                let mut w: Vec<f64> = days[lo..lo + 7].iter().map(|d| d.1).collect();
                let m = median(&mut w)?;
                (m > 0.0).then(|| (days[i].0.rem_euclid(7) as usize, days[i].1 / m))
            })
            .collect();
        let mut share = [1.0; 7];
        for (wd, s) in share.iter_mut().enumerate() {
            let mut v: Vec<f64> = ratios.iter().filter(|r| r.0 == wd).map(|r| r.1).collect();
            if let Some(x) = median(&mut v) {
                if x > 0.0 {
                    *s = x;
                }
            }
        }
        let x: Vec<f64> = days
            .iter()
            .map(|d| d.1 / share[d.0.rem_euclid(7) as usize])
            .collect();
        let n = x.len();
        let mut found: Option<(usize, f64, bool)> = None; // (run length, ratio, up)
        for len in 1..=n.saturating_sub(7) {
            let run = &x[n - len..];
            let mut before: Vec<f64> = x[n - len - 7..n - len].to_vec();
            let Some(r) = median(&mut before) else {
                continue;
            };
            if r <= 0.0 {
                continue;
            }
            let mut runv = run.to_vec();
            let rm = median(&mut runv).unwrap_or(r);
            // A step, not a slope: the first day of the run against the 3 days before it.
            let mut prev: Vec<f64> = x[n - len - 3..n - len].to_vec();
            let jump = median(&mut prev).map_or(1.0, |p| run[0] / p);
            if jump <= DIP_RATIO && run.iter().all(|&v| v <= DIP_RATIO * r) {
                found = Some((len, rm / r, false));
            } else if jump >= SHIFT_UP_RATIO && run.iter().all(|&v| v >= SHIFT_UP_RATIO * r) {
                found = Some((len, rm / r, true));
            }
        }
        let (len, ratio, up) = found?;
        let day0 = days[n - len].0;
        // Local midnight of the run's first day, as unix time.
        let noon = day0 * DAY + DAY / 2;
        let from = day0 * DAY - offset(tz, noon);
        let to = start_hour + hours as i64 * 3600;
        let span = (to - from) as f64 / DAY as f64;
        let kind = if up {
            "shift_up"
        } else if (to - from) >= new_normal_secs {
            "shift_down"
        } else {
            "dip"
        };
        Some(LevelChange {
            from,
            to,
            ratio,
            days: span,
            kind,
        })
    }

    fn trend_lin(&self, x: f64) -> f64 {
        if self.trend == "exponential" {
            return 0.0;
        }
        (self.intercept + self.slope_per_hour * x).max(0.0)
    }

    fn trend_exp(&self, x: f64) -> f64 {
        if self.trend == "linear" {
            return 0.0;
        }
        (self.log_intercept + self.log_slope_per_hour * x).exp()
    }

    /// Point forecast of the hourly max at unix time `t` (the larger of the two models).
    pub fn predict(&self, t: i64) -> f64 {
        let x = (t - self.start_hour) as f64 / 3600.0;
        let k = slot(&self.tz, t);
        (self.trend_lin(x) * self.seasonal[k]).max(self.trend_exp(x) * self.seasonal_exp[k])
    }

    /// The bound of the max over `[from, to)` and what set it.
    pub fn bound_over(&self, from: i64, to: i64) -> Bound {
        let (mut upper, mut point, mut at) = (f64::NEG_INFINITY, 0.0, from);
        let mut t = from.div_euclid(3600) * 3600;
        while t < to {
            let x = (t - self.start_hour) as f64 / 3600.0;
            let k = slot(&self.tz, t);
            let lin = self.trend_lin(x) * self.seasonal[k];
            let exp = self.trend_exp(x) * self.seasonal_exp[k];
            let u = (lin * self.residual_q99).max(exp * self.residual_q99_exp);
            if u > upper {
                upper = u;
                point = lin.max(exp);
                at = t;
            }
            t += 3600;
        }
        // Each cleaned hour grown by the trend to the end of the horizon; the last week's peak.
        let xe = (to - self.start_hour) as f64 / 3600.0;
        let (mut grown, mut grown_at) = (0.0f64, None);
        let (mut recent, mut recent_at) = (0.0f64, None);
        let last = self.cleaned.iter().rposition(|v| !v.is_nan()).unwrap_or(0);
        for (k, &v) in self.cleaned.iter().enumerate() {
            if v.is_nan() {
                continue;
            }
            let x = k as f64;
            let g = [
                self.trend_lin(xe) / self.trend_lin(x),
                self.trend_exp(xe) / self.trend_exp(x),
            ]
            .into_iter()
            .filter(|g| g.is_finite() && *g > 0.0)
            .fold(1.0f64, f64::max);
            if v * g > grown {
                grown = v * g;
                grown_at = Some(k);
            }
            if k + WEEK_HOURS > last && v > recent {
                recent = v;
                recent_at = Some(k);
            }
        }
        let time = |k: Option<usize>| k.map(|k| self.start_hour + k as i64 * 3600);
        let (value, set_by, set_at) = if upper <= grown {
            (upper, "forecast", Some(at))
        } else {
            (grown, "grown_peak", time(grown_at))
        };
        let (value, set_by, set_at) = if recent > value {
            (recent, "recent_peak", time(recent_at))
        } else {
            (value, set_by, set_at)
        };
        Bound {
            value,
            upper,
            point,
            at,
            set_by,
            set_at,
        }
    }
}

/// The bound of the horizon and what set it.
#[derive(Debug, Clone, PartialEq)]
pub struct Bound {
    /// The bound the limit is built on.
    pub value: f64,
    /// The models' upper bound.
    pub upper: f64,
    /// The point forecast where the upper bound is.
    pub point: f64,
    /// Where the upper bound is.
    pub at: i64,
    /// `forecast` (the models' bound), `grown_peak` (the highest cleaned hour grown by the
    /// trend, when lower than the models' bound) or `recent_peak` (the last week's highest
    /// cleaned hour, when higher).
    pub set_by: &'static str,
    /// The hour that set it (the forecast's or the observed one).
    pub set_at: Option<i64>,
}

/// The forecast's settings from a bucket's policy spec.
#[derive(Debug, Clone, Copy)]
struct Settings {
    /// The horizon, seconds.
    horizon: i64,
    /// The time zone of the seasonal slots.
    tz: chrono_tz::Tz,
    /// How long a fall of level must last to be the new normal, seconds.
    new_normal: i64,
}

impl Settings {
    fn of(spec: &schema::PolicySpec) -> Result<Self, PolicyError> {
        let tz: chrono_tz::Tz = match &spec.timezone {
            None => chrono_tz::UTC,
            Some(name) => name
                .parse()
                .map_err(|_| PolicyError::Params(format!("unknown time zone `{name}`")))?,
        };
        Ok(Settings {
            horizon: spec.horizon.map_or(DEFAULT_HORIZON_SECS, |h| h.as_secs()) as i64,
            tz,
            new_normal: spec
                .new_normal_after
                .map_or(DEFAULT_NEW_NORMAL_SECS, |d| d.as_secs()) as i64,
        })
    }

    fn horizon_days(&self) -> f64 {
        self.horizon as f64 / 86_400.0
    }

    fn new_normal_days(&self) -> f64 {
        self.new_normal as f64 / 86_400.0
    }
}

/// The `peak` policy's proposal, saying that (and why) the forecast fell back to it.
fn fall_back(input: &PolicyInput<'_>, why: String) -> Result<Proposal, PolicyError> {
    let mut p = Peak.compute(input)?;
    if let Some(o) = p.evidence.as_object_mut() {
        o.insert("fallback_from".into(), json!("forecast"));
        o.insert("fallback_reason".into(), json!(why));
        if let Some(e) = o.get("explain").and_then(Value::as_str) {
            let e = format!("{e} (forecast fell back: {why})");
            o.insert("explain".into(), json!(e));
        }
    }
    Ok(p)
}

/// The evidence of a change of level: its kind, dates, ratio, and whether it was discounted.
fn level_evidence(l: &LevelChange, settings: Settings) -> Value {
    let why = match l.kind {
        "dip" => format!(
            "level {:.2}× the week before for {:.1} days, under new_normal_after {:.0}d: discounted, the fit ends before it",
            l.ratio, l.days, settings.new_normal_days()
        ),
        "shift_down" => format!(
            "level {:.2}× the week before for {:.1} days (≥ new_normal_after {:.0}d): the new normal, the fit uses it",
            l.ratio, l.days, settings.new_normal_days()
        ),
        _ => format!("level {:.2}× the week before: the fit uses the new level", l.ratio),
    };
    json!({
        "kind": l.kind,
        "from": rfc(l.from),
        "to": rfc(l.to),
        "ratio": round3(l.ratio),
        "days": round3(l.days),
        "discounted": l.kind == "dip",
        "why": why,
    })
}

/// The forecast's line in the plan: what set the bound, the headroom, the change of level,
/// the spikes left out, and what capped the limit.
fn explain(
    fit: &Fit,
    b: &Bound,
    settings: Settings,
    headroom: f64,
    capped_by: Option<&str>,
) -> String {
    let set_at = b.set_at.map(rfc);
    let set_at = set_at.as_deref().unwrap_or("?");
    let mut explain = match b.set_by {
        "forecast" => format!(
            "forecast bound {:.1} rps at {set_at} (horizon {:.0}d)",
            b.value,
            settings.horizon_days()
        ),
        "grown_peak" => format!(
            "observed hour {:.1} rps at {set_at} grown by the trend over the {:.0}d horizon",
            b.value,
            settings.horizon_days()
        ),
        _ => format!(
            "peak {:.1} rps at {set_at} of the last week of data used (above the forecast)",
            b.value
        ),
    };
    explain.push_str(&format!(" × {:.2}", 1.0 + headroom));
    if let Some(l) = &fit.level {
        explain.push_str(&match l.kind {
            "dip" => format!(
                "; dip {}..{} at {:.2}× discounted ({:.1}d < new normal {:.0}d)",
                date(l.from),
                date(l.to),
                l.ratio,
                l.days,
                settings.new_normal_days()
            ),
            "shift_down" => format!(
                "; level fell {:.2}× on {} ({:.1}d: the new normal)",
                l.ratio,
                date(l.from),
                l.days
            ),
            _ => format!(
                "; level rose {:.2}× on {} (fit on the new level)",
                l.ratio,
                date(l.from)
            ),
        });
    }
    explain.push_str(&crate::spikes::explain(&fit.spikes));
    if let Some(c) = capped_by {
        explain.push_str(&format!("; capped by {c}"));
    }
    explain
}

impl Policy for Forecast {
    fn name(&self) -> PolicyName {
        PolicyName::Forecast
    }

    fn compute(&self, input: &PolicyInput<'_>) -> Result<Proposal, PolicyError> {
        if crate::is_auto(input.spec) {
            return crate::margin::compute(self, input);
        }
        let s = input.series;
        let days = s.confidence_days_with(input.left_out);
        let settings = Settings::of(input.spec)?;
        if days < MIN_DAYS {
            return fall_back(
                input,
                format!("{:.1} days of history, the forecast needs {MIN_DAYS}", days),
            );
        }
        let spike_factor = crate::spike_factor(input.spec);
        let Some(fit) = Fit::fit(s, settings.tz, settings.new_normal, spike_factor) else {
            return fall_back(input, "the seasonal fit failed".into());
        };
        let end = s.end();
        let b = fit.bound_over(end, end + settings.horizon);
        if !b.value.is_finite() || b.value <= 0.0 {
            return fall_back(input, format!("the forecast is not usable ({})", b.value));
        }
        let peak = s.max().ok_or(PolicyError::NoData)?;
        let h = headroom(input.spec);
        let (limit, capped_by) = bound(b.value * (1.0 + h), input);
        Ok(Proposal {
            limit_rps: limit,
            shadow: false,
            policy: PolicyName::Forecast,
            peak_rps: peak,
            confidence: (days / 28.0).min(1.0),
            evidence: json!({
                "model": "hourly max (spikes, dips and level shifts handled) = max(linear, exponential trend × median hour-of-week index) × q99 of residual ratios; ≤ highest cleaned hour grown by the trend; ≥ last week's highest cleaned hour",
                "window": {"from": s.datetime_of(0).to_rfc3339(), "to": s.datetime_of(s.values.len()).to_rfc3339()},
                "horizon_days": round3(settings.horizon_days()),
                "timezone": settings.tz.name(),
                "trend": fit.trend,
                "trend_rps_per_day": round3(fit.slope_per_hour * 24.0),
                "growth_per_week": round3((fit.log_slope_per_hour * 168.0).exp() - 1.0),
                "forecast_max_rps": round3(b.point),
                "forecast_max_at": rfc(b.at),
                "upper_bound_rps": round3(b.upper),
                "residual_ratio_q99": round3(fit.residual_q99),
                "set_by": {"kind": b.set_by, "rps": round3(b.value), "at": b.set_at.map(rfc)},
                "spikes": crate::spikes::evidence(&fit.spikes),
                "level_change": fit.level.as_ref().map(|l| level_evidence(l, settings)),
                "explain": explain(&fit, &b, settings, h, capped_by),
                "peak_rps": round3(peak),
                "peak_at": s.argmax().map(|i| s.datetime_of(i).to_rfc3339()),
                "coverage": round3(s.coverage_since_first_with(input.left_out)),
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

    /// The forecast of `s` without headroom.
    pub(super) fn run(s: &RateSeries) -> Proposal {
        Forecast
            .compute(&PolicyInput {
                left_out: 0,
                service: "s",
                caller: Some("c"),
                procedure: None,
                series: s,
                spec: &PolicySpec {
                    headroom: Some(0.0.into()),
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

#[cfg(test)]
mod shape_tests {
    use super::tests::run;
    use crate::RateSeries;

    /// Diurnal (±50%, peak 15:00 UTC) and weekly (weekends 60%) traffic × `f(day)`.
    fn shaped(days: usize, f: impl Fn(f64) -> f64) -> RateSeries {
        shaped_with(0.6, days, f)
    }

    /// [`shaped`] with weekends at `weekend` × weekdays.
    fn shaped_with(weekend: f64, days: usize, f: impl Fn(f64) -> f64) -> RateSeries {
        let start = 1_700_000_000 / 86_400 * 86_400;
        let values = (0..days * 1440)
            .map(|i| {
                let t = start + i as i64 * 60;
                let d = i as f64 / 1440.0;
                let hour = t.rem_euclid(86_400) as f64 / 3600.0;
                let wd = (t.div_euclid(86_400) + 3).rem_euclid(7);
                let weekly = if wd >= 5 { weekend } else { 1.0 };
                let daily =
                    1.0 + 0.5 * (2.0 * std::f64::consts::PI * (hour - 15.0 + 6.0) / 24.0).sin();
                (100.0 * weekly * daily * f(d)) as f32
            })
            .collect();
        RateSeries {
            start,
            step: 60,
            values,
        }
    }

    /// Steady traffic with quiet weekends (30 % of weekdays), 28 days ending at every hour of
    /// the week in turn: no trend, whatever weekday the history starts and ends on (a trend
    /// fitted on the raw hours saw growth when the history started on a weekend and ended on
    /// weekdays), so the limit stays at the weekday peak (150).
    #[test]
    fn steady_weekly_traffic_has_no_trend_whatever_day_the_history_ends() {
        let full = shaped_with(0.3, 35, |_| 1.0);
        for shift_hours in (0..7 * 24).step_by(5) {
            let from = full.start + shift_hours * 3600 + 116 * 60;
            let p = run(&full.slice(from, from + 28 * 86_400));
            let per_day = p.evidence["trend_rps_per_day"].as_f64().unwrap();
            assert!(
                per_day.abs() < 0.2 && p.limit_rps > 145.0 && p.limit_rps < 160.0,
                "history from hour {shift_hours} of the week: {per_day} rps/day, limit {}; {}",
                p.limit_rps,
                p.evidence
            );
        }
    }

    /// 60% a week compounded: the next week's peak is 1.6× the last one's.
    #[test]
    fn fast_growth_is_covered() {
        let full = shaped(28, |d| 1.6f64.powf(d / 7.0));
        let train = full.slice(full.start, full.start + 21 * 86_400);
        let p = run(&train);
        let next = full.slice(train.end(), full.end()).max().unwrap();
        // Within 10% of next week's peak before any headroom (the default 0.25 covers it).
        assert!(
            p.limit_rps >= 0.9 * next && p.limit_rps < 1.2 * next,
            "{} vs next week's peak {next}",
            p.limit_rps
        );
        assert_eq!(p.evidence["trend"], "exponential");
    }

    /// Half the traffic for the last 5 days (a holiday): the fit ends before it, the limit stays
    /// at the recurring peak (150) and the evidence names the dip with its dates.
    #[test]
    fn a_dip_at_the_end_is_discounted() {
        let s = shaped(21, |d| if d >= 16.0 { 0.5 } else { 1.0 });
        let p = run(&s);
        assert!(p.limit_rps > 145.0 && p.limit_rps < 160.0, "{}", p.evidence);
        let l = &p.evidence["level_change"];
        assert_eq!(l["kind"], "dip", "{l}");
        assert_eq!(l["discounted"], true);
        assert_eq!(l["days"], 5.0);
        assert!(
            p.evidence["explain"]
                .as_str()
                .unwrap()
                .contains("dip 2023-11-30..2023-12-05"),
            "{}",
            p.evidence["explain"]
        );
    }

    /// The same fall lasting 12 days (over new_normal_after, 10d) is the new normal: ~75.
    #[test]
    fn a_long_fall_is_the_new_normal() {
        let s = shaped(21, |d| if d >= 9.0 { 0.5 } else { 1.0 });
        let p = run(&s);
        assert!(p.limit_rps > 72.0 && p.limit_rps < 85.0, "{}", p.evidence);
        assert_eq!(p.evidence["level_change"]["kind"], "shift_down");
    }

    /// A launch doubling traffic 4 days before the end: the fit is on the new level (~300).
    #[test]
    fn a_rise_is_the_new_level_at_once() {
        let s = shaped(21, |d| if d >= 17.0 { 2.0 } else { 1.0 });
        let p = run(&s);
        assert!(p.limit_rps > 295.0 && p.limit_rps < 330.0, "{}", p.evidence);
        assert_eq!(p.evidence["level_change"]["kind"], "shift_up");
    }

    /// A 6× retry storm for 20 minutes does not inflate the limit; the evidence names it.
    #[test]
    fn a_spike_is_discounted_and_named() {
        let mut s = shaped(21, |_| 1.0);
        let at = 9 * 1440 + 11 * 60;
        for v in &mut s.values[at..at + 20] {
            *v *= 6.0;
        }
        let p = run(&s);
        assert!(p.limit_rps > 145.0 && p.limit_rps < 160.0, "{}", p.evidence);
        let sp = &p.evidence["spikes"][0];
        assert_eq!(sp["discounted"], true, "{}", p.evidence);
        assert!(sp["ratio"].as_f64().unwrap() > 5.0, "{sp}");
        assert!(p.evidence["explain"].as_str().unwrap().contains("spike"));
    }
}
