//! `rlc serve`'s history snapshot pulls only the new minutes (and an overlap) and merges them
//! into the history it holds, on a real Prometheus backfilled with promtool: the merged history
//! is, series for series and bit for bit, the one a full pull of the same lookback gives, and
//! so is the plan; over `query_range` (a PromQL expression), remote read (a plain selector) and
//! with `downsample`. A change of the history settings and `history.full_pull_every` force a
//! full pull; a failed increment keeps the held history and the next pull continues from it,
//! unless the held ring could not be restored: then the next pull is a full one.

use chrono::{DateTime, TimeZone, Utc};
use rlc::history::snapshot::HistoryCache;
use rlc::history::PullKind;
use rlc_plan::compute::compute_plan;
use rlc_plan::history::History;
use test_support::prometheus::{OpenMetricsWriter, Prometheus};

use crate::support::{daemon, repo};

const SCRAPE: i64 = 30;
const HOUR: i64 = 3600;

/// Counters `rpc_requests_total` every 30 s over `[start, end]`: three steady callers, one
/// that starts late (`new`), one that stops early (`gone`), and a series without caller or
/// procedure (rejected).
fn backfill(path: &std::path::Path, start: i64, end: i64, late: i64, stop: i64) -> Prometheus {
    let mut w = OpenMetricsWriter::create(path).unwrap();
    w.family("rpc_requests", "counter").unwrap();
    let callers = [
        ("shop", "web", "browse", 40.0),
        ("shop", "api", "browse", 7.5),
        ("maps", "web", "route", 120.0),
        ("maps", "new", "route", 30.0),
        ("maps", "gone", "route", 11.0),
    ];
    for (id, (service, caller, procedure, base)) in callers.into_iter().enumerate() {
        let mut counter = 100.0;
        let mut t = start;
        while t <= end {
            // A diurnal shape with some noise, so that every minute differs.
            let phase = (t % 86_400) as f64 / 86_400.0 * std::f64::consts::TAU;
            let wobble = ((t / SCRAPE) as f64 * 0.7 + id as f64).sin() * 0.1;
            counter += base * (1.0 + 0.5 * phase.sin() + wobble) * SCRAPE as f64;
            let present = match caller {
                "new" => t >= late,
                "gone" => t < stop,
                _ => true,
            };
            if present {
                let labels = [
                    ("service", service),
                    ("caller", caller),
                    ("procedure", procedure),
                ];
                w.sample(
                    "rpc_requests_total",
                    &labels,
                    (counter * 1000.0).round() / 1000.0,
                    t,
                )
                .unwrap();
            }
            t += SCRAPE;
        }
    }
    let mut t = start;
    while t <= end {
        w.sample(
            "rpc_requests_total",
            &[("service", "shop")],
            ((t - start) * 3) as f64,
            t,
        )
        .unwrap();
        t += SCRAPE;
    }
    Prometheus::start(&w.finish().unwrap()).expect("start Prometheus")
}

fn config(url: &str, query: &str, extra: &str) -> schema::DaemonConfig {
    daemon(&format!(
        "history:\n  prometheus:\n    url: {url}\n    query: '{query}'\n    retries: 2\n    timeout: 30s\n{extra}  lookback: 1d\n  step: 1m\n  full_pull_every: 2h"
    ))
}

/// Every series' values as bits (NaN compared as NaN), and the rejected series.
fn bits(
    h: &History,
) -> (
    Vec<(rlc_plan::history::SeriesKey, Vec<u32>)>,
    Vec<rlc_plan::history::Rejected>,
) {
    (
        h.series
            .iter()
            .map(|(k, s)| (k.clone(), s.values.iter().map(|v| v.to_bits()).collect()))
            .collect(),
        h.rejected.clone(),
    )
}

#[test]
fn incremental_pulls_give_the_full_pulls_history_and_plan() {
    let now = Utc::now().timestamp() / 60 * 60;
    // Data from 3 days ago to now; the pulls look at a day ending 6 h ago and later, so that
    // every pull's window is complete.
    let (start, end) = (now - 3 * 86_400, now);
    let t0 = now - 6 * HOUR;
    let dir = tempfile::tempdir().unwrap();
    // `new` starts within the first increment; `gone` stops within the lookback and leaves it
    // when the window moves on.
    let late = t0 + 2 * 60 + 13;
    let stop = t0 - 86_400 + 20 * 60;
    let prom = backfill(&dir.path().join("h.om"), start, end, late, stop);
    let repo_dir = dir.path().join("repo");
    let repo = repo(
        &repo_dir,
        &[(
            "rlc/policies.yaml",
            "default:\n  policy: peak\n  headroom: 0.25\n",
        )],
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    let at = |t: i64| -> DateTime<Utc> { Utc.timestamp_opt(t, 0).unwrap() };
    let plan_json = |cfg: &schema::DaemonConfig, h: &History, t: i64| {
        serde_json::to_string(&compute_plan(cfg, &repo, h, at(t))).unwrap()
    };
    let rate = "sum by (service, caller, procedure) (rate(rpc_requests_total[2m]))";
    for (what, cfg) in [
        ("query_range", config(&prom.url, rate, "")),
        (
            "remote_read",
            config(&prom.url, "rpc_requests_total", "    api: remote_read\n"),
        ),
        (
            "downsample",
            config(&prom.url, rate, "    downsample: 1h\n"),
        ),
    ] {
        let cache = HistoryCache::new(cfg.clone(), dir.path());
        let first = rt.block_on(cache.refresh_at(at(t0)));
        assert_eq!(first.kind, PullKind::Full, "{what}: the first pull");
        assert!(
            first.history.source_error.is_none(),
            "{what}: {:?}",
            first.history.source_error
        );
        assert!(first.history.series.len() >= 4, "{what}");
        // Every 5 minutes (and once after 47 minutes, a pull that was missed), then past
        // `full_pull_every` (2 h after the first, full) and one more increment.
        let mut t = t0;
        for (gap, kind) in [
            (300, PullKind::Incremental),
            (300, PullKind::Incremental),
            (47 * 60, PullKind::Incremental),
            (300, PullKind::Incremental),
            (2 * HOUR, PullKind::Full),
            (300, PullKind::Incremental),
        ] {
            t += gap;
            let snap = rt.block_on(cache.refresh_at(at(t)));
            assert_eq!(snap.kind, kind, "{what} at +{} s", t - t0);
            assert!(snap.history.source_error.is_none(), "{what}");
            let full = rt.block_on(HistoryCache::new(cfg.clone(), dir.path()).refresh_at(at(t)));
            assert_eq!(full.kind, PullKind::Full);
            let (merged, fresh) = (&snap.history, &full.history);
            assert_eq!(
                (merged.start, merged.step, merged.len),
                (fresh.start, fresh.step, fresh.len),
                "{what} at +{} s",
                t - t0
            );
            assert!(
                bits(merged) == bits(fresh),
                "{what} at +{} s: the merged history differs from a full pull",
                t - t0
            );
            assert_eq!(
                plan_json(&cfg, merged, t),
                plan_json(&cfg, fresh, t),
                "{what} at +{} s: the same plan",
                t - t0
            );
        }
        let last = cache.latest().unwrap();
        assert_eq!(
            last.history.rejected.len(),
            1,
            "{what}: {:?}",
            last.history.rejected
        );
        let keys: Vec<String> = last
            .history
            .series
            .keys()
            .map(|k| format!("{}/{}", k.service, k.bucket_name()))
            .collect();
        assert!(
            keys.contains(&"maps/new.route".to_string()),
            "{what}: {keys:?}"
        );
        assert!(
            !keys.contains(&"maps/gone.route".to_string()),
            "{what}: gone left the lookback: {keys:?}"
        );

        // Another query: a full pull, although the held history is minutes old.
        let mut other = cfg.clone();
        other.history.prometheus.as_mut().unwrap().query = match what {
            "remote_read" => "rpc_requests_total{service=\"maps\"}".into(),
            _ => format!("{rate} > 0"),
        };
        cache.set_config(other);
        t += 300;
        let snap = rt.block_on(cache.refresh_at(at(t)));
        assert_eq!(snap.kind, PullKind::Full, "{what}: another query");
        t += 300;
        let snap = rt.block_on(cache.refresh_at(at(t)));
        assert_eq!(
            snap.kind,
            PullKind::Incremental,
            "{what}: then increments again"
        );
    }

    // A failed increment (here: crossing `max_pull_bytes`, which bounds increments as it
    // bounds full pulls) keeps the held history; the next pull continues from it.
    let cfg = config(&prom.url, rate, "");
    let cache = HistoryCache::new(cfg.clone(), dir.path());
    assert_eq!(rt.block_on(cache.refresh_at(at(t0))).kind, PullKind::Full);
    let mut tight = cfg.clone();
    tight.history.prometheus.as_mut().unwrap().max_pull_bytes = 500;
    cache.set_config(tight);
    let failed = rt.block_on(cache.refresh_at(at(t0 + 300)));
    let why = failed
        .history
        .source_error
        .clone()
        .expect("the increment fails");
    assert!(why.contains("max_pull_bytes"), "{why}");
    assert_eq!(
        cache.latest().unwrap().generation,
        1,
        "the good snapshot stays"
    );
    cache.set_config(cfg.clone());
    let next = rt.block_on(cache.refresh_at(at(t0 + 900)));
    assert_eq!(
        next.kind,
        PullKind::Incremental,
        "continues from the held history"
    );
    let full = rt.block_on(HistoryCache::new(cfg.clone(), dir.path()).refresh_at(at(t0 + 900)));
    assert!(bits(&next.history) == bits(&full.history));
}

/// `rlc serve` holds a Prometheus history on disk (a ring per series in `spill_dir`): the
/// increments of a short lookback go round the ring several times and every one is the full
/// pull's history, bit for bit; views the ring moved past say so; the file goes with the
/// cache, and a restart (a new cache) pulls the whole lookback.
#[test]
fn the_held_history_is_a_ring_on_disk_and_a_restart_pulls_it_whole() {
    let now = Utc::now().timestamp() / 60 * 60;
    let (start, end) = (now - 86_400, now);
    let t0 = now - 6 * HOUR;
    let dir = tempfile::tempdir().unwrap();
    let prom = backfill(
        &dir.path().join("h.om"),
        start,
        end,
        t0 + 40 * 60 + 7,
        t0 + 20 * 60,
    );
    let held_dir = dir.path().join("held");
    let rate = "sum by (service, caller, procedure) (rate(rpc_requests_total[2m]))";
    // A 2-hour lookback and a full pull a day: 240 cells per series, the ring wraps every
    // 2 hours of increments.
    let cfg = daemon(&format!(
        "history:\n  prometheus:\n    url: {}\n    query: '{rate}'\n    retries: 2\n    timeout: 30s\n    spill_dir: {}\n  lookback: 2h\n  step: 1m\n  full_pull_every: 1d",
        prom.url,
        held_dir.display()
    ));
    let rt = tokio::runtime::Runtime::new().unwrap();
    let at = |t: i64| -> DateTime<Utc> { Utc.timestamp_opt(t, 0).unwrap() };
    let entries = || -> Vec<String> {
        std::fs::read_dir(&held_dir)
            .map(|d| {
                d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    };
    let cache = HistoryCache::new(cfg.clone(), dir.path());
    let first = rt.block_on(cache.refresh_at(at(t0)));
    assert_eq!(first.kind, PullKind::Full);
    let ring = first.history.ring().expect("held on disk").clone();
    let path = ring.path().to_path_buf();
    assert_eq!(std::fs::metadata(&path).unwrap().len(), ring.bytes());
    assert_eq!(ring.bytes(), ring.series_count() as u64 * 240 * 4);
    // The pull's spill is gone; the ring's directory stays.
    let names = entries();
    assert_eq!(names.len(), 1, "{names:?}");
    assert!(names[0].starts_with("rlc-held-"), "{names:?}");
    let mut t = t0;
    let mut keys_seen = std::collections::BTreeSet::new();
    for i in 0..40 {
        // Every 5 minutes, a missed one (47 minutes) on the way.
        t += if i == 13 { 47 * 60 } else { 300 };
        let snap = rt.block_on(cache.refresh_at(at(t)));
        assert_eq!(snap.kind, PullKind::Incremental, "at +{} s", t - t0);
        assert_eq!(
            snap.history.ring().unwrap().path(),
            path,
            "written in place"
        );
        let full = rt.block_on(HistoryCache::new(cfg.clone(), dir.path()).refresh_at(at(t)));
        assert_eq!(full.kind, PullKind::Full);
        assert_eq!(snap.history.grid(), full.history.grid());
        assert!(
            bits(&snap.history) == bits(&full.history),
            "at +{} s: the held history differs from a full pull",
            t - t0
        );
        keys_seen.extend(snap.history.series.keys().map(|k| k.bucket_name()));
    }
    // `gone` left the lookback, `new` came in.
    assert!(keys_seen.contains("gone.route") && keys_seen.contains("new.route"));
    let last = cache.latest().unwrap();
    assert!(!last
        .history
        .series
        .keys()
        .any(|k| k.bucket_name() == "gone.route"));
    // The first view's points were overwritten: reading it says so.
    let e = ring.service("maps").unwrap_err();
    assert!(matches!(e, rlc::history::DiskError::MovedOn { .. }), "{e}");
    assert!(e.to_string().contains("moved on"), "{e}");
    drop((first, ring, last));
    assert_eq!(entries().len(), 1, "one held history");
    drop(cache);
    assert!(
        entries().is_empty(),
        "the file goes with the cache: {:?}",
        entries()
    );

    // A restart: the new daemon pulls the whole lookback.
    let cache = HistoryCache::new(cfg.clone(), dir.path());
    let snap = rt.block_on(cache.refresh_at(at(t + 300)));
    assert_eq!(snap.kind, PullKind::Full);
    assert!(snap.history.source_error().is_none());
    let next = rt.block_on(cache.refresh_at(at(t + 600)));
    assert_eq!(next.kind, PullKind::Incremental);

    // A ring that refuses reads (an increment failed and could not be undone): the next
    // increment fails with why, and the pull after it reads the whole lookback again.
    next.history.ring().unwrap().break_for_test("disk gone");
    let failed = rt.block_on(cache.refresh_at(at(t + 900)));
    assert_eq!(failed.kind, PullKind::Incremental);
    assert_eq!(failed.history.source_error(), Some("disk gone"));
    let again = rt.block_on(cache.refresh_at(at(t + 1200)));
    assert_eq!(again.kind, PullKind::Full);
    assert!(again.history.source_error().is_none());
}
