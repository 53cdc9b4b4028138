use super::*;
use crate::history::fixtures::{self, key, tail_of};
use crate::history::incremental::{merge, OVERLAP_SECS};

const CALLERS: [&str; 6] = ["a", "b", "c", "d", "e", "z"];

/// A "full pull" of [`CALLERS`] (`z` in another service) on the grid `(start, 60, len)`.
fn pull(start: i64, len: usize, f: &dyn Fn(&str, i64) -> Option<f32>) -> History {
    fixtures::pull(&CALLERS, start, len, f)
}

/// A history to the bit: its series' values, rejections and grid.
type Bits = (Vec<(SeriesKey, Vec<u32>)>, Vec<Rejected>, (i64, i64, usize));

fn bits(h: &History) -> Bits {
    (
        h.series
            .iter()
            .map(|(k, s)| {
                assert_eq!((s.start, s.step, s.values.len()), (h.start, h.step, h.len));
                (k.clone(), s.values.iter().map(|v| v.to_bits()).collect())
            })
            .collect(),
        h.rejected.clone(),
        (h.start, h.step, h.len),
    )
}

/// The ring's history, read service by service, as one history.
fn read_by_service(r: &RingHistory) -> History {
    let mut h = History {
        start: r.start,
        step: r.step,
        len: r.len,
        rejected: r.rejected.clone(),
        ..History::default()
    };
    for s in r.services() {
        h.series.extend(r.service(&s).unwrap().series);
    }
    h
}

/// Caller a throughout (with gaps); b stops after a while; c starts late; d comes and goes
/// in bursts (whole lookbacks without a sample); e only in a few minutes (it leaves); z in
/// another service.
fn shape(c: &str, t: i64) -> Option<f32> {
    let m = t / 60;
    match c {
        "a" if m % 7 != 3 => Some((t % 977) as f32 / 7.0),
        "b" if m < 260 => Some(1.0 + (m % 5) as f32),
        "c" if m >= 330 => Some(2.5 + (m % 3) as f32),
        "d" if (m / 150) % 2 == 1 && m % 2 == 0 => Some(m as f32),
        "e" if (200..203).contains(&m) => Some(9.0),
        "z" => Some(0.5),
        _ => None,
    }
}

#[test]
fn increments_wrapping_around_the_ring_give_the_full_pulls() {
    let dir = tempfile::tempdir().unwrap();
    let len = 100;
    let every = 7 * 60;
    let cap = capacity(len, 60, every);
    // 100 points, slack for 7 minutes and the 10-minute overlap: the ring wraps every
    // few increments, many times over the run.
    assert_eq!(cap, len + (every + OVERLAP_SECS) as usize / 60 + 2);
    let mut start = 0;
    let mut held = RingHistory::from_history(&pull(start, len, &shape), dir.path(), cap).unwrap();
    let mut mem = pull(start, len, &shape);
    assert_eq!(bits(&held.to_history().unwrap()), bits(&mem));
    let mut views = vec![held.clone()];
    // 1- to 7-minute increments over 8 hours: 60 of them, ~15 turns of the ring.
    let mut n = 0;
    while start < 8 * 3600 {
        n += 1;
        start += 60 * (1 + n % 7);
        let grid = (start, 60, len);
        let full = pull(start, len, &shape);
        let since = mem.end() - OVERLAP_SECS;
        let tail = tail_of(&full, since);
        let next = held
            .apply(tail.clone(), grid)
            .expect("the increment fits the slack")
            .unwrap();
        // The full pull, the in-memory merge and the ring agree, point for point.
        assert_eq!(bits(&next.to_history().unwrap()), bits(&full), "at {start}");
        assert_eq!(bits(&read_by_service(&next)), bits(&full), "at {start}");
        mem = merge(&mem, tail, grid).unwrap();
        assert_eq!(bits(&mem), bits(&full));
        held = next;
        views.push(held.clone());
    }
    assert!(n > 50);
    assert_eq!(held.bytes() % (cap as u64 * 4), 0);
    // The series that left (b, e) and came back (d) took new slots; no more than that.
    assert!(held.bytes() <= 16 * cap as u64 * 4, "{}", held.bytes());
    // The previous view is still readable (its points are intact); the oldest were
    // overwritten and say so instead of giving other points.
    let prev = &views[views.len() - 2];
    let expect = pull(prev.start, len, &shape);
    assert_eq!(bits(&prev.to_history().unwrap()), bits(&expect));
    let e = views[0].service("maps").unwrap_err();
    assert!(matches!(e, DiskError::MovedOn { .. }), "{e}");
    assert!(e.to_string().contains("moved on past this view"), "{e}");
}

#[test]
fn an_increment_beyond_the_slack_or_off_the_grid_is_a_full_pull() {
    let dir = tempfile::tempdir().unwrap();
    let f = |_: &str, _: i64| Some(1.0);
    let len = 60;
    let cap = capacity(len, 60, 300);
    let held = RingHistory::from_history(&pull(0, len, &f), dir.path(), cap).unwrap();
    let tail = |grid: (i64, i64, usize), from: i64| tail_of(&pull(grid.0, grid.2, &f), from);
    // 47 minutes later: more than the slack (5 minutes and the overlap).
    let g = (47 * 60, 60, len);
    assert!(held.apply(tail(g, 3000), g).is_none());
    // A gap, a longer lookback, a misaligned grid, another step.
    assert!(held
        .apply(tail((1200, 60, 60), 3660), (1200, 60, 60))
        .is_none());
    assert!(held
        .apply(tail((-600, 60, 80), 3000), (-600, 60, 80))
        .is_none());
    assert!(held
        .apply(tail((630, 60, 60), 3030), (630, 60, 60))
        .is_none());
    let mut other = tail((300, 60, 60), 3000);
    other.step = 30;
    assert!(held.apply(other, (300, 30, 120)).is_none());
    // A tail that is the whole lookback makes a new ring, equal to it.
    let whole = pull(5000, len, &f);
    let r = held.apply(whole.clone(), (5000, 60, len)).unwrap().unwrap();
    assert_ne!(r.path(), held.path());
    assert_eq!(bits(&r.to_history().unwrap()), bits(&whole));
    // And within the slack, an increment.
    let g = (300, 60, len);
    let r = held.apply(tail(g, 3000), g).unwrap().unwrap();
    assert_eq!(r.path(), held.path());
    assert_eq!(bits(&r.to_history().unwrap()), bits(&pull(300, len, &f)));
}

#[test]
fn a_series_whose_last_sample_leaves_with_the_overlap_keeps_its_earlier_ones() {
    // The held pull saw e at minutes 40-41 and 55 (in the overlap); the increment no longer
    // does (the source dropped the late sample): e stays for its minutes 40-41, and leaves
    // with them. What the in-memory merge gives, point for point.
    let dir = tempfile::tempdir().unwrap();
    let len = 60;
    let cap = capacity(len, 60, 3600);
    let first = |c: &str, t: i64| match c {
        "a" => Some(1.0),
        "e" if [40, 41, 55].contains(&(t / 60)) => Some(3.0),
        _ => None,
    };
    let later = |c: &str, t: i64| match c {
        "e" if t / 60 == 55 => None,
        _ => first(c, t),
    };
    let mut mem = pull(0, len, &first);
    let mut held = RingHistory::from_history(&mem, dir.path(), cap).unwrap();
    for start in [300, 600, 2460, 2520] {
        let grid = (start, 60, len);
        let tail = tail_of(&pull(start, len, &later), mem.end() - OVERLAP_SECS);
        held = held.apply(tail.clone(), grid).unwrap().unwrap();
        mem = merge(&mem, tail, grid).unwrap();
        assert_eq!(bits(&held.to_history().unwrap()), bits(&mem), "at {start}");
    }
    assert!(!held.to_history().unwrap().series.contains_key(&key("e")));
    assert_eq!(held.series_count(), 1);
}

#[test]
fn rejections_bar_their_series_as_in_memory() {
    let dir = tempfile::tempdir().unwrap();
    let f = |_: &str, _: i64| Some(1.0);
    let len = 60;
    let mut mem = pull(0, len, &f);
    mem.series.remove(&key("b"));
    let bad = fixtures::rejected_b();
    mem.rejected = vec![bad.clone()];
    let held = RingHistory::from_history(&mem, dir.path(), capacity(len, 60, 600)).unwrap();
    let grid = (600, 60, len);
    let mut tail = tail_of(&pull(600, len, &f), mem.end() - OVERLAP_SECS);
    // The increment sees b again (good values), and c goes bad.
    tail.rejected = vec![Rejected {
        caller: Some("c".into()),
        ..bad.clone()
    }];
    tail.series.remove(&key("c"));
    let r = held.apply(tail.clone(), grid).unwrap().unwrap();
    let m = merge(&mem, tail, grid).unwrap();
    assert_eq!(bits(&r.to_history().unwrap()), bits(&m));
    let h = r.to_history().unwrap();
    assert!(!h.series.contains_key(&key("b")));
    assert!(!h.series.contains_key(&key("c")));
    assert!(h.series.contains_key(&key("a")));
}

#[test]
fn the_file_goes_with_the_last_view_and_a_broken_ring_refuses_reads() {
    let dir = tempfile::tempdir().unwrap();
    let f = |_: &str, _: i64| Some(1.0);
    let held = RingHistory::from_history(&pull(0, 60, &f), dir.path(), 70).unwrap();
    let path = held.path().to_path_buf();
    assert!(path.exists());
    assert_eq!(std::fs::metadata(&path).unwrap().len(), held.bytes());
    let next = held
        .apply(tail_of(&pull(60, 60, &f), 3000), (60, 60, 60))
        .unwrap()
        .unwrap();
    drop(held);
    assert!(path.exists(), "a view still reads it");
    next.break_for_test("disk gone");
    let e = next.service("maps").unwrap_err();
    assert!(matches!(e, DiskError::Broken(_)), "{e}");
    assert_eq!(e.to_string(), "disk gone");
    assert!(next
        .apply(tail_of(&pull(120, 60, &f), 3060), (120, 60, 60))
        .unwrap()
        .is_err());
    drop(next);
    assert!(!path.exists());
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

/// `POST /v1/previews` without `services` on a history held in the ring: read one service at
/// a time (the held history is never loaded whole), the same answer as on the same history in
/// memory.
#[test]
fn a_whole_fleet_preview_reads_the_ring_by_service_and_answers_as_in_memory() {
    use crate::history::snapshot::HeldHistory;
    use chrono::TimeZone;
    use rlc_plan::history::SeriesSource;
    use rlc_plan::pipeline::{self, Purpose, World};
    use rlc_plan::whatif::{preview, Inputs};

    let dir = tempfile::tempdir().unwrap();
    let w = |p: &str, t: &str| {
        let p = dir.path().join("repo").join(p);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, t).unwrap();
    };
    w(
        "buckets/maps.yaml",
        "service: maps\nbuckets:\n  - name: a\n    caller: a\n    limit_rps: 30\n    mode: enforce\n    policy: peak\n  - name: c\n    caller: c\n    limit_rps: 5\n    mode: shadow\n    policy: peak\n",
    );
    w(
        "rlc/policies.yaml",
        "default:\n  policy: peak\n  headroom: 0.2\nservices:\n  other:\n    policy: forecast\n",
    );
    let (repo, diags) = schema::ConfigRepo::load(&dir.path().join("repo"));
    assert!(diags.is_empty(), "{}", schema::Diagnostics(diags));
    let cfg: schema::DaemonConfig =
        serde_yaml::from_str("history:\n  file: x.csv\nconfig_repo:\n  path: repo\n").unwrap();
    // 8 days at 1 m, six series in two services, one with a gap every other hour.
    let (start, len) = (1_767_225_600, 8 * 1440);
    let f = |c: &str, t: i64| {
        (c != "e" || t % 7200 < 3600)
            .then(|| 10.0 + 5.0 * f32::from(c.as_bytes()[0] - b'a') + ((t / 60) % 50) as f32)
    };
    let mem = pull(start, len, &f);
    let ring = RingHistory::from_history(&mem, dir.path(), capacity(len, 60, 300)).unwrap();
    let on_disk = HeldHistory::from(ring);
    let in_memory = HeldHistory::from(mem);
    let now = chrono::Utc
        .timestamp_opt(start + len as i64 * 60, 0)
        .unwrap();
    let world = World::none();
    let current = pipeline::plan(&cfg, &repo, &in_memory, &world, now, Purpose::Run);
    let inputs = Inputs { cfg, repo, world };
    for body in [
        "",
        "policies:\n  patch:\n    default:\n      headroom: 0.5\n",
        "holdout: 2d\ncontracts:\n  replace:\n    contracts:\n      - service: other\n        caller: z\n        limit_rps: 70\n        reference: MSA-9\n",
    ] {
        let run = |h: &HeldHistory| {
            let a = preview(&inputs, h, &current, body.as_bytes(), Some("application/yaml"), now)
                .unwrap();
            serde_json::to_value(a).unwrap()
        };
        let (a, b) = (run(&on_disk), run(&in_memory));
        assert_eq!(a, b, "body {body:?}");
        assert_eq!(a["services"], serde_json::Value::Null);
        assert_eq!(a["backtest"]["buckets"].as_array().unwrap().len(), 6, "{a}");
    }
    assert!(
        on_disk.whole().is_none(),
        "the held history was read whole into memory"
    );
}
