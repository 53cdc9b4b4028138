use chrono::{DateTime, TimeZone, Utc};

/// How late the newest samples of a history may be and still count as history (a scrape
/// interval, a recording rule's evaluation, a remote write's delay): 15 minutes.
pub const ARRIVAL_LAG_SECS: i64 = 900;

/// A regular per-step rate series. Missing samples are `NaN` (never zero), stored as `f32` to
/// keep 10,000 series × 40,320 minutes within a bounded memory.
#[derive(Debug, Clone, PartialEq)]
pub struct RateSeries {
    /// Unix time (seconds) of `values[0]`.
    pub start: i64,
    /// Seconds between two values.
    pub step: i64,
    /// One value per step; `NaN` = no sample.
    pub values: Vec<f32>,
}

impl RateSeries {
    /// A series of `len` missing values.
    pub fn empty(start: i64, step: i64, len: usize) -> Self {
        Self {
            start,
            step,
            values: vec![f32::NAN; len],
        }
    }

    /// Unix time of index `i`.
    pub fn time_of(&self, i: usize) -> i64 {
        self.start + i as i64 * self.step
    }

    /// Time of index `i` as a date.
    pub fn datetime_of(&self, i: usize) -> DateTime<Utc> {
        Utc.timestamp_opt(self.time_of(i), 0)
            .single()
            .unwrap_or_default()
    }

    /// Unix time just after the last value.
    pub fn end(&self) -> i64 {
        self.time_of(self.values.len())
    }

    /// Number of present samples.
    pub fn present(&self) -> usize {
        self.values.iter().filter(|v| !v.is_nan()).count()
    }

    /// Index of the first present sample.
    pub fn first_present(&self) -> Option<usize> {
        self.values.iter().position(|v| !v.is_nan())
    }

    /// Days covered by present samples (what the VPA calls confidence days).
    pub fn confidence_days(&self) -> f64 {
        self.present() as f64 * self.step as f64 / 86_400.0
    }

    /// [`RateSeries::confidence_days`] counting `left_out` steps (samples left out as not
    /// demand: they were observed, so they are history, not gaps) and the steps after the last
    /// sample up to [`ARRIVAL_LAG_SECS`] (minutes not scraped or not evaluated yet: a week of
    /// history read a minute after the hour is still a week).
    pub fn confidence_days_with(&self, left_out: usize) -> f64 {
        let last = self.values.iter().rposition(|v| !v.is_nan());
        let lag = last.map_or(0, |i| {
            let tail = self.values.len() - 1 - i;
            tail.min((ARRIVAL_LAG_SECS / self.step.max(1)) as usize)
        });
        (self.present() + left_out + lag) as f64 * self.step as f64 / 86_400.0
    }

    /// [`RateSeries::coverage_since_first`] counting `left_out` steps as covered.
    pub fn coverage_since_first_with(&self, left_out: usize) -> f64 {
        match self.first_present() {
            None => 0.0,
            Some(f) => {
                ((self.present() + left_out) as f64 / (self.values.len() - f) as f64).min(1.0)
            }
        }
    }

    /// Fraction of the steps since the first sample that have one (1 when none is missing).
    pub fn coverage_since_first(&self) -> f64 {
        match self.first_present() {
            None => 0.0,
            Some(f) => self.present() as f64 / (self.values.len() - f) as f64,
        }
    }

    /// The sub-series of values with time in `[from, to)`.
    pub fn slice(&self, from: i64, to: i64) -> RateSeries {
        let idx = |t: i64| (((t - self.start).max(0) + self.step - 1) / self.step) as usize;
        let a = idx(from).min(self.values.len());
        let b = idx(to).min(self.values.len()).max(a);
        RateSeries {
            start: self.time_of(a),
            step: self.step,
            values: self.values[a..b].to_vec(),
        }
    }

    /// Maximum of present values.
    pub fn max(&self) -> Option<f64> {
        self.values
            .iter()
            .filter(|v| !v.is_nan())
            .fold(None, |m: Option<f32>, &v| Some(m.map_or(v, |m| m.max(v))))
            .map(f64::from)
    }

    /// Index of the maximum present value.
    pub fn argmax(&self) -> Option<usize> {
        let mut best: Option<(usize, f32)> = None;
        for (i, &v) in self.values.iter().enumerate() {
            if !v.is_nan() && best.is_none_or(|(_, b)| v > b) {
                best = Some((i, v));
            }
        }
        best.map(|(i, _)| i)
    }

    /// The `p`-th percentile (0–100, nearest rank) of present values.
    pub fn percentile(&self, p: f64) -> Option<f64> {
        let mut v: Vec<f32> = self
            .values
            .iter()
            .copied()
            .filter(|v| !v.is_nan())
            .collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f32::total_cmp);
        let rank = ((p.clamp(0.0, 100.0) / 100.0) * v.len() as f64).ceil() as usize;
        Some(f64::from(v[rank.clamp(1, v.len()) - 1]))
    }

    /// Mean of present values.
    pub fn mean(&self) -> Option<f64> {
        let (s, n) = self
            .values
            .iter()
            .filter(|v| !v.is_nan())
            .fold((0.0f64, 0usize), |(s, n), &v| (s + f64::from(v), n + 1));
        (n > 0).then(|| s / n as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_is_not_zero() {
        let s = RateSeries {
            start: 0,
            step: 60,
            values: vec![1.0, f32::NAN, 3.0, f32::NAN],
        };
        assert_eq!(s.present(), 2);
        assert_eq!(s.max(), Some(3.0));
        assert_eq!(s.mean(), Some(2.0));
        assert_eq!(s.percentile(50.0), Some(1.0));
        assert_eq!(s.percentile(100.0), Some(3.0));
        assert_eq!(s.coverage_since_first(), 0.5);
        assert_eq!(s.slice(60, 180).values.len(), 2);
        assert_eq!(s.slice(60, 180).start, 60);
    }
}
