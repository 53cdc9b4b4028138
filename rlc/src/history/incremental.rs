//! Merging an increment into a held history: `rlc serve` keeps the history it pulled and, on
//! the next run or poll, pulls only the grid points since its last pull plus an overlap
//! ([`OVERLAP`], for samples that arrive late), then [`merge`]s them: the held points that
//! are still in the lookback, shifted onto the new grid, followed by the pulled ones. A point
//! Prometheus gives the same value for on both pulls is the same in the merged history and in
//! a full pull of the new lookback, so the plan is the same.
//!
//! What a merge cannot see, a full pull clears (`history.full_pull_every`, a day by default):
//! samples written later than the overlap after their time, and series rejected for a bad
//! value or for several label sets that have since left the lookback (they stay rejected,
//! so their buckets keep their quotas a little longer, never the other way round).

use std::collections::BTreeMap;

use super::{valid_name, History, RateSeries, Rejected, SeriesKey};

/// How far before the end of the held history an increment starts: samples written up to
/// this long after their time are in the merged history.
pub const OVERLAP_SECS: i64 = 600;
/// [`OVERLAP_SECS`] as a duration.
pub const OVERLAP: std::time::Duration = std::time::Duration::from_secs(OVERLAP_SECS as u64);

/// Where an increment of `held` starts: [`OVERLAP`] before its end, on its grid; `None` for a
/// history that cannot be continued (a failed source, no points).
pub fn since(held: &History) -> Option<i64> {
    if held.source_error.is_some() || held.len == 0 || held.step <= 0 {
        return None;
    }
    Some(held.end() - OVERLAP_SECS.div_euclid(held.step).max(1) * held.step)
}

/// The history a full pull of the lookback `grid` would give, from `held` (an earlier pull on
/// the same grid step) and `tail` (the points of `grid` from some point on, pulled now); `None`
/// when they do not fit together (another step, misaligned grids, a gap between them, a
/// lookback starting before the held history). A tail that is the whole lookback is returned
/// as it is.
pub fn merge(held: &History, tail: History, grid: (i64, i64, usize)) -> Option<History> {
    let (start, step, len) = grid;
    if tail.source_error.is_none() && tail.start == start && tail.len == len && tail.step == step {
        return Some(tail);
    }
    if held.source_error.is_some()
        || tail.source_error.is_some()
        || held.step != step
        || tail.step != step
        || tail.end() != start + len as i64 * step
        || tail.start < start
        || (tail.start - start) % step != 0
        || (held.start - start).rem_euclid(step) != 0
        || held.end() < tail.start
        || held.start > start
    {
        return None;
    }
    // Grid points [0, k) come from `held`, [k, len) from `tail`.
    let k = ((tail.start - start) / step) as usize;
    // Held point i is new point i - shift (shift ≥ 0: the held history starts no later).
    let shift = (start - held.start) / step;
    let rejected = union(&held.rejected, tail.rejected);
    // A series rejected for its values (or a key rejected outright) is not a series in a full
    // pull while its bad sample is in the lookback, whichever pull saw the bad sample.
    let barred = barred(&rejected);
    let mut tail_series = tail.series;
    let mut series = BTreeMap::new();
    let keys: Vec<SeriesKey> = held
        .series
        .keys()
        .chain(tail_series.keys())
        .cloned()
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    for key in keys {
        if barred.contains(&key) {
            tail_series.remove(&key);
            continue;
        }
        // One write per point: the held points still in the lookback, NaN where the held
        // grid ends before the tail starts (never: no gap is merged), then the tail.
        let mut values = Vec::with_capacity(len);
        if let Some(h) = held.series.get(&key) {
            let from = (shift as usize).min(h.values.len());
            let n = (h.values.len() - from).min(k);
            values.extend_from_slice(&h.values[from..from + n]);
        }
        values.resize(k, f32::NAN);
        match tail_series.remove(&key) {
            Some(t) => values.extend_from_slice(&t.values),
            None => values.resize(len, f32::NAN),
        }
        // A full pull lists a series only if it has a sample in the lookback.
        if values.iter().all(|v| v.is_nan()) {
            continue;
        }
        series.insert(
            key,
            RateSeries {
                start,
                step,
                values,
            },
        );
    }
    Some(History {
        start,
        step,
        len,
        series,
        rejected,
        source_error: None,
    })
}

/// The series that are not series of a full pull while `rejected` lists them: those rejected
/// for their values, or outright.
pub(crate) fn barred(rejected: &[Rejected]) -> std::collections::HashSet<SeriesKey> {
    rejected
        .iter()
        .filter(|r| !r.fails_service)
        .filter_map(key_of)
        .collect()
}

/// The series key a rejection names, when its labels form one.
fn key_of(r: &Rejected) -> Option<SeriesKey> {
    let service = r.service.clone().filter(|s| valid_name(s))?;
    if r.caller.is_none() && r.procedure.is_none() {
        return None;
    }
    if [&r.caller, &r.procedure]
        .into_iter()
        .flatten()
        .any(|v| !valid_name(v))
    {
        return None;
    }
    Some(SeriesKey {
        service,
        caller: r.caller.clone(),
        procedure: r.procedure.clone(),
    })
}

/// The rejections of both pulls, one per key for the ones that name a series (the held one
/// kept: a full pull names a series once), in the order a pull lists them.
pub(crate) fn union(held: &[Rejected], tail: Vec<Rejected>) -> Vec<Rejected> {
    let mut out: Vec<Rejected> = held.to_vec();
    let mut seen: std::collections::HashSet<(Option<SeriesKey>, bool, String)> =
        held.iter().map(ident).collect();
    for r in tail {
        if seen.insert(ident(&r)) {
            out.push(r);
        }
    }
    out.sort_by(|a, b| {
        (&a.service, &a.caller, &a.procedure, &a.reason).cmp(&(
            &b.service,
            &b.caller,
            &b.procedure,
            &b.reason,
        ))
    });
    out
}

/// What makes two rejections the same: the series and kind when it names one, else the text.
fn ident(r: &Rejected) -> (Option<SeriesKey>, bool, String) {
    match key_of(r) {
        Some(k) => (Some(k), r.fails_service, String::new()),
        None => (
            None,
            r.fails_service,
            format!(
                "{:?}/{:?}/{:?}/{}",
                r.service, r.caller, r.procedure, r.reason
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::fixtures::{self, key, tail_of};

    /// A "full pull" of callers `a`, `b` and `c` on the grid `(start, 60, len)`.
    fn pull(start: i64, len: usize, f: &dyn Fn(&str, i64) -> Option<f32>) -> History {
        fixtures::pull(&["a", "b", "c"], start, len, f)
    }

    fn same(a: &History, b: &History) {
        assert_eq!((a.start, a.step, a.len), (b.start, b.step, b.len));
        assert_eq!(
            a.series.keys().collect::<Vec<_>>(),
            b.series.keys().collect::<Vec<_>>()
        );
        for (k, s) in &a.series {
            let t = &b.series[k];
            assert_eq!(s.start, t.start);
            for (i, (x, y)) in s.values.iter().zip(&t.values).enumerate() {
                assert!(x.to_bits() == y.to_bits(), "{k:?} point {i}: {x} vs {y}");
            }
        }
        assert_eq!(a.rejected, b.rejected);
    }

    #[test]
    fn a_merged_increment_is_the_full_pull() {
        // Caller a throughout; b stops before the new lookback (it must leave); c starts in
        // the increment; gaps stay NaN.
        let f = |c: &str, t: i64| -> Option<f32> {
            match c {
                "a" if t % 420 != 0 => Some((t % 977) as f32 / 7.0),
                "b" if t < 10_000 + 30 * 60 => Some(1.0),
                "c" if t >= 10_000 + 118 * 60 => Some(2.5),
                _ => None,
            }
        };
        let len = 100;
        let held = pull(10_000, len, &f);
        assert!(held.series.contains_key(&key("b")));
        // 35 minutes later.
        let grid = (10_000 + 35 * 60, 60, len);
        let full = pull(grid.0, len, &f);
        let since = since(&held).expect("an increment fits");
        assert_eq!(since, held.end() - OVERLAP_SECS);
        let merged = merge(&held, tail_of(&full, since), grid).unwrap();
        same(&merged, &full);
        assert!(!merged.series.contains_key(&key("b")));
        assert!(merged.series.contains_key(&key("c")));
    }

    #[test]
    fn no_merge_when_the_grids_do_not_continue_each_other() {
        let f = |_: &str, _: i64| Some(1.0);
        let held = pull(0, 60, &f);
        assert_eq!(since(&held), Some(3000));
        assert_eq!(since(&History::unavailable("down")), None);
        let tail = |grid: (i64, i64, usize), from: i64| {
            let mut full = pull(grid.0, grid.2, &f);
            full.step = grid.1;
            tail_of(&full, from)
        };
        // A gap between the held history and the increment.
        assert!(merge(&held, tail((1200, 60, 60), 3660), (1200, 60, 60)).is_none());
        // A lookback starting before the held history (a longer lookback).
        assert!(merge(&held, tail((-600, 60, 80), 3000), (-600, 60, 80)).is_none());
        // Misaligned grids.
        assert!(merge(&held, tail((630, 60, 60), 3030), (630, 60, 60)).is_none());
        // An increment that does not reach the grid's end.
        let mut t = tail((600, 60, 60), 3000);
        t.len -= 1;
        assert!(merge(&held, t, (600, 60, 60)).is_none());
        // A tail that is the whole lookback is the full pull.
        let whole = pull(5000, 60, &f);
        let merged = merge(&held, whole.clone(), (5000, 60, 60)).unwrap();
        same(&merged, &whole);
    }

    #[test]
    fn rejections_carry_over_and_bar_their_series() {
        let f = |_: &str, _: i64| Some(1.0);
        let mut held = pull(0, 60, &f);
        let bad = fixtures::rejected_b();
        held.series.remove(&key("b"));
        held.rejected = vec![bad.clone()];
        let grid = (600, 60, 60);
        let mut tail = tail_of(&pull(600, 60, &f), since(&held).unwrap());
        // The increment sees b again (good values) and a label problem.
        let unlabeled = Rejected {
            service: None,
            caller: None,
            procedure: None,
            reason: "series without a `service` label: {}".into(),
            fails_service: false,
        };
        tail.rejected = vec![
            Rejected {
                reason: "non-finite or negative value NaN at 3000".into(),
                ..bad.clone()
            },
            unlabeled.clone(),
        ];
        let merged = merge(&held, tail, grid).unwrap();
        assert!(!merged.series.contains_key(&key("b")));
        assert!(merged.series.contains_key(&key("a")));
        assert_eq!(merged.rejected, vec![unlabeled, bad]);
    }
}
