//! Whether a history can be believed before a quota is computed from it. A single bad sample
//! (1e12 rps in one minute of 28 days) must not become a quota, and a broken query or
//! recording rule that reads every value as 0 must not lower every bucket: such a history is
//! refused, the buckets keep their quotas, and the run says why (exit 4, or 1 when it is every
//! service's history).

use chrono::{TimeZone, Utc};
use policies::RateSeries;

/// A sample more than this many times the highest daily peak of the series' other days is not
/// believed: a retry storm reaches a few times, 20× at most in the corpus; a bad sample or a
/// unit error millions of times.
pub const IMPLAUSIBLE_FACTOR: f64 = 100.0;

/// The other days' peak is taken as at least this, so that a caller that was quiet for weeks
/// and starts sending is not refused below 100 × this.
pub const IMPLAUSIBLE_FLOOR_RPS: f64 = 10.0;

/// Why the highest sample of `s` is not plausible, if it is not: it is more than
/// [`IMPLAUSIBLE_FACTOR`] × the highest peak of the series' other (UTC) days (at least
/// [`IMPLAUSIBLE_FLOOR_RPS`]). A series with a single day of samples has nothing to compare
/// with and is believed.
pub fn implausible_peak(s: &RateSeries) -> Option<String> {
    let top = s.argmax()?;
    let peak = f64::from(s.values[top]);
    let day_of = |i: usize| s.time_of(i).div_euclid(86_400);
    let top_day = day_of(top);
    let others = s
        .values
        .iter()
        .enumerate()
        .filter(|(i, v)| !v.is_nan() && day_of(*i) != top_day)
        .map(|(_, v)| f64::from(*v))
        .fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v))))?;
    let ceiling = IMPLAUSIBLE_FACTOR * others.max(IMPLAUSIBLE_FLOOR_RPS);
    (peak > ceiling).then(|| {
        let at = Utc
            .timestamp_opt(s.time_of(top), 0)
            .single()
            .unwrap_or_default()
            .format("%Y-%m-%d %H:%M UTC");
        format!(
            "sample of {} rps at {at} is over {IMPLAUSIBLE_FACTOR:.0}× the highest peak of its other days ({} rps): not plausible (a bad sample or unit?)",
            schema::format_rps(peak),
            schema::format_rps(others)
        )
    })
}

/// Whether every sample of every series is 0 (and there is at least one sample).
pub fn all_zero<'a>(series: impl IntoIterator<Item = &'a RateSeries>) -> bool {
    let mut any = false;
    for s in series {
        for v in s.values.iter().filter(|v| !v.is_nan()) {
            if *v != 0.0 {
                return false;
            }
            any = true;
        }
    }
    any
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: i64 = 86_400;

    /// Four days per minute at `rps`, with `spike` at minute `at` of the third day.
    fn series(rps: f32, spike: Option<(usize, f32)>) -> RateSeries {
        let mut values = vec![rps; 4 * 1440];
        if let Some((at, v)) = spike {
            values[2 * 1440 + at] = v;
        }
        RateSeries {
            start: 20_000 * DAY,
            step: 60,
            values,
        }
    }

    #[test]
    fn one_absurd_sample_is_refused_storms_and_growth_are_not() {
        let why = implausible_peak(&series(100.0, Some((600, 1e12)))).unwrap();
        assert!(
            why.contains("999999995904 rps") && why.contains("not plausible"),
            "{why}"
        );
        // A 20× retry storm, a steady series, a caller that starts at 900 rps after quiet
        // weeks: believed.
        assert_eq!(implausible_peak(&series(100.0, Some((600, 2000.0)))), None);
        assert_eq!(implausible_peak(&series(100.0, None)), None);
        assert_eq!(implausible_peak(&series(0.0, Some((600, 900.0)))), None);
        // Quiet weeks, then 1e6: refused.
        assert!(implausible_peak(&series(0.0, Some((600, 1e6)))).is_some());
        // One day of samples only: nothing to compare with.
        let mut young = series(100.0, Some((600, 1e12)));
        for v in &mut young.values[..2 * 1440] {
            *v = f32::NAN;
        }
        for v in &mut young.values[3 * 1440..] {
            *v = f32::NAN;
        }
        assert_eq!(implausible_peak(&young), None);
    }

    #[test]
    fn all_zero_needs_samples_and_only_zeros() {
        assert!(all_zero([&series(0.0, None)]));
        assert!(!all_zero([&series(0.0, Some((1, 0.5)))]));
        let empty = RateSeries {
            start: 0,
            step: 60,
            values: vec![f32::NAN; 10],
        };
        assert!(!all_zero([&empty]));
        assert!(!all_zero(Vec::<&RateSeries>::new()));
    }
}
