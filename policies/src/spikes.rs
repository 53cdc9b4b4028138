//! One-off bursts (retry storms) that must not set a quota: on hourly maxima of the per-step
//! rate, an hour above `factor` × both the median of the same hour of the week in the other
//! weeks and the median of the 12 hours around it. A recurring batch is not a spike: its hour
//! is high every week. Needs the same hour in another week, so a history under a week has none.
//! Shared by `peak` (which leaves the spike's minutes out of its statistic) and `forecast`
//! (which leaves the hour out of its fit).

use crate::RateSeries;

/// The default `spike_factor`: an hour this many times above its usual value is a spike.
pub const DEFAULT_SPIKE_FACTOR: f64 = 3.0;

/// A one-off spike.
#[derive(Debug, Clone, PartialEq)]
pub struct Spike {
    /// Unix time of its first hour.
    pub from: i64,
    /// Unix time just after its last hour.
    pub to: i64,
    /// Its highest rate.
    pub peak_rps: f64,
    /// The usual rate of that hour (the larger of the two medians it was compared with).
    pub usual_rps: f64,
}

/// The median of `v` (sorted in place); `None` when empty.
pub fn median(v: &mut [f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// The hourly maxima of `s` (NaN where no sample): unix time of hour 0, and one value an hour.
pub fn hourly_maxima(s: &RateSeries) -> (i64, Vec<f64>) {
    let per_hour = (3600 / s.step.max(1)).max(1) as usize;
    let start_hour = s.start.div_euclid(3600) * 3600;
    let offset0 = ((s.start - start_hour) / s.step.max(1)) as usize;
    let hours = (offset0 + s.values.len()).div_ceil(per_hour);
    let mut h = vec![f64::NAN; hours];
    for (i, &v) in s.values.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        let k = (offset0 + i) / per_hour;
        let v = f64::from(v);
        if h[k].is_nan() || v > h[k] {
            h[k] = v;
        }
    }
    (start_hour, h)
}

/// The spikes of hourly maxima `h` (hour 0 at unix time `start_hour`), consecutive spike hours
/// merged into one.
pub fn spikes(start_hour: i64, h: &[f64], factor: f64) -> Vec<Spike> {
    let hours = h.len();
    let time = |k: usize| start_hour + k as i64 * 3600;
    let mut out: Vec<Spike> = Vec::new();
    // At most 12 hours around and 16 same hours of other weeks: no allocation per hour.
    let (mut near, mut same) = ([0.0; 12], [0.0; 16]);
    for k in 0..hours {
        let v = h[k];
        if v.is_nan() || v <= 0.0 {
            continue;
        }
        let mut n = 0;
        for j in (k.saturating_sub(6)..(k + 7).min(hours)).filter(|&j| j != k) {
            if !h[j].is_nan() {
                near[n] = h[j];
                n += 1;
            }
        }
        // Most hours are not above the hours around them: the weeks are not read for those.
        let Some(b) = median(&mut near[..n]).filter(|b| v > factor * b) else {
            continue;
        };
        let mut m = 0;
        for j in (1..=8)
            .flat_map(|w| [k as i64 - w * 168, k as i64 + w * 168])
            .filter(|&j| j >= 0 && (j as usize) < hours)
        {
            if !h[j as usize].is_nan() {
                same[m] = h[j as usize];
                m += 1;
            }
        }
        let Some(a) = median(&mut same[..m]) else {
            continue;
        };
        let usual = a.max(b);
        if v > factor * usual {
            match out.last_mut() {
                Some(sp) if sp.to == time(k) => {
                    sp.to = time(k + 1);
                    if v > sp.peak_rps {
                        sp.peak_rps = v;
                        sp.usual_rps = usual;
                    }
                }
                _ => out.push(Spike {
                    from: time(k),
                    to: time(k + 1),
                    peak_rps: v,
                    usual_rps: usual,
                }),
            }
        }
    }
    out
}

fn rfc(t: i64) -> String {
    chrono::DateTime::<chrono::Utc>::from_timestamp(t, 0)
        .unwrap_or_default()
        .to_rfc3339()
}

/// The spikes as the evidence lists them (`spikes`).
pub fn evidence(spikes: &[Spike]) -> Vec<serde_json::Value> {
    spikes
        .iter()
        .map(|sp| {
            serde_json::json!({
                "from": rfc(sp.from),
                "to": rfc(sp.to),
                "peak_rps": crate::round3(sp.peak_rps),
                "usual_rps": crate::round3(sp.usual_rps),
                "ratio": crate::round3(sp.peak_rps / sp.usual_rps),
                "discounted": true,
                "why": format!("{:.1}× the usual rate of that hour, not recurring: a one-off", sp.peak_rps / sp.usual_rps),
            })
        })
        .collect()
}

/// What the one-line why says of the spikes: the first three, then how many more.
pub fn explain(spikes: &[Spike]) -> String {
    let mut out = String::new();
    for sp in spikes.iter().take(3) {
        out.push_str(&format!(
            "; spike {} {:.1} rps ({:.1}× usual) discounted",
            rfc(sp.from),
            sp.peak_rps,
            sp.peak_rps / sp.usual_rps
        ));
    }
    if spikes.len() > 3 {
        out.push_str(&format!("; {} more spikes discounted", spikes.len() - 3));
    }
    out
}

/// `s` with the samples of `spikes` missing (NaN).
pub fn without(s: &RateSeries, spikes: &[Spike]) -> RateSeries {
    let mut out = s.clone();
    for sp in spikes {
        for (i, v) in out.values.iter_mut().enumerate() {
            let t = s.time_of(i);
            if t >= sp.from && t < sp.to {
                *v = f32::NAN;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three weeks per minute at 100 rps, with a burst of `x` × for `minutes` at `at`.
    fn series(at: usize, minutes: usize, x: f32) -> RateSeries {
        let mut values = vec![100.0f32; 21 * 1440];
        for v in &mut values[at..at + minutes] {
            *v *= x;
        }
        RateSeries {
            start: 1_700_000_000 / 86_400 * 86_400,
            step: 60,
            values,
        }
    }

    #[test]
    fn a_storm_is_a_spike_a_weekly_batch_is_not() {
        let s = series(3 * 1440 + 14 * 60, 10, 8.0);
        let (h0, h) = hourly_maxima(&s);
        let sp = spikes(h0, &h, DEFAULT_SPIKE_FACTOR);
        assert_eq!(sp.len(), 1, "{sp:?}");
        assert_eq!((sp[0].peak_rps, sp[0].usual_rps), (800.0, 100.0));
        let clean = without(&s, &sp);
        assert_eq!(clean.max(), Some(100.0));
        // The same burst every week: a batch, kept.
        let mut batch = series(3 * 1440 + 14 * 60, 10, 8.0);
        for w in 1..3 {
            let at = 3 * 1440 + 14 * 60 + w * 7 * 1440;
            for v in &mut batch.values[at..at + 10] {
                *v *= 8.0;
            }
        }
        let (h0, h) = hourly_maxima(&batch);
        assert!(spikes(h0, &h, DEFAULT_SPIKE_FACTOR).is_empty());
        // Under the factor: kept.
        let (h0, h) = hourly_maxima(&series(3 * 1440 + 14 * 60, 10, 2.0));
        assert!(spikes(h0, &h, DEFAULT_SPIKE_FACTOR).is_empty());
    }
}
