//! Fixtures the history tests share: a full pull made from a function of time per caller, and
//! the tail of it that an increment pulls.

use std::collections::BTreeMap;

use super::{History, RateSeries, Rejected, SeriesKey};

/// The series of caller `c`: service `maps`, but `other` for caller `z`.
pub(crate) fn key(c: &str) -> SeriesKey {
    SeriesKey {
        service: if c == "z" { "other" } else { "maps" }.into(),
        caller: Some(c.into()),
        procedure: None,
    }
}

/// The rejection of caller `b` of `maps` (a negative value), which bars its series.
pub(crate) fn rejected_b() -> Rejected {
    Rejected {
        service: Some("maps".into()),
        caller: Some("b".into()),
        procedure: None,
        reason: "non-finite or negative value -1 at 120".into(),
        fails_service: false,
    }
}

/// A "full pull" of the grid `(start, 60, len)` from a function of time per caller, one series
/// per caller of `callers` that has a point.
pub(crate) fn pull(
    callers: &[&str],
    start: i64,
    len: usize,
    f: &dyn Fn(&str, i64) -> Option<f32>,
) -> History {
    let mut series = BTreeMap::new();
    for &c in callers {
        let mut s = RateSeries::empty(start, 60, len);
        for i in 0..len {
            if let Some(v) = f(c, start + i as i64 * 60) {
                s.values[i] = v;
            }
        }
        if s.values.iter().any(|v| !v.is_nan()) {
            series.insert(key(c), s);
        }
    }
    History {
        start,
        step: 60,
        len,
        series,
        rejected: vec![],
        source_error: None,
    }
}

/// The points of `full` from `from` on, as an increment pulls them.
pub(crate) fn tail_of(full: &History, from: i64) -> History {
    let k = ((from - full.start) / full.step) as usize;
    let mut t = full.clone();
    t.start = from;
    t.len = full.len - k;
    t.series = full
        .series
        .iter()
        .filter_map(|(key, s)| {
            let mut s2 = RateSeries::empty(from, 60, t.len);
            s2.values = s.values[k..].to_vec();
            s2.values
                .iter()
                .any(|v| !v.is_nan())
                .then(|| (key.clone(), s2))
        })
        .collect();
    t
}
