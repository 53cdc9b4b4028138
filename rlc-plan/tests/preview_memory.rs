//! A what-if preview of the whole fleet (`POST /v1/previews` without `services`) on a history
//! kept elsewhere (the daemon's ring on disk) holds no more than about one service's series at
//! once: the bytes allocated at the peak of the preview, counted by this binary's allocator,
//! stay far below the size of the whole history, which is what copying it into memory took.
//! One test in this binary, so that no other test allocates meanwhile.

use std::alloc::{GlobalAlloc, Layout, System};
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use chrono::{TimeZone, Utc};
use policies::RateSeries;
use rlc_plan::history::{History, Rejected, SeriesKey, SeriesSource, Unreadable};
use rlc_plan::pipeline::{self, Purpose, World};
use rlc_plan::whatif::{preview, Inputs};
use schema::{ConfigRepo, DaemonConfig};

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

const SERVICES: usize = 40;
const DAYS: usize = 28;
const START: i64 = 1_767_225_600;

/// The series of one service at a time, each read a copy (as the ring reads them from disk);
/// never whole.
struct OnDisk {
    history: History,
    reads: AtomicUsize,
}

impl SeriesSource for OnDisk {
    fn services(&self) -> Vec<String> {
        self.history.services()
    }
    fn rejected(&self) -> &[Rejected] {
        &self.history.rejected
    }
    fn source_error(&self) -> Option<&str> {
        None
    }
    fn service(&self, service: &str) -> Result<Cow<'_, History>, Unreadable> {
        self.reads.fetch_add(1, Ordering::Relaxed);
        let h = &self.history;
        Ok(Cow::Owned(History {
            start: h.start,
            step: h.step,
            len: h.len,
            series: h
                .service_series(service)
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            rejected: Vec::new(),
            source_error: None,
        }))
    }
}

#[test]
fn a_whole_fleet_preview_holds_about_one_service_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    let w = |p: &str, t: &str| {
        let p = dir.path().join(p);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, t).unwrap();
    };
    for i in 0..SERVICES {
        w(
            &format!("buckets/s{i:02}.yaml"),
            &format!("service: s{i:02}\nbuckets:\n  - name: web\n    caller: web\n    limit_rps: 100\n    mode: enforce\n    policy: peak\n"),
        );
    }
    w(
        "rlc/policies.yaml",
        "default:\n  policy: peak\n  headroom: 0.2\nservices:\n  s01:\n    policy: forecast\n",
    );
    let (repo, diags) = ConfigRepo::load(dir.path());
    assert!(diags.is_empty(), "{}", schema::Diagnostics(diags));
    let cfg: DaemonConfig =
        serde_yaml::from_str("history:\n  file: x.csv\nconfig_repo:\n  path: repo\n").unwrap();
    let len = DAYS * 1440;
    let mut series = BTreeMap::new();
    for i in 0..SERVICES {
        for caller in ["web", "mobile"] {
            let values = (0..len)
                .map(|t| 50.0 + i as f32 + ((t * 7 + i) % 60) as f32)
                .collect();
            let key = SeriesKey {
                service: format!("s{i:02}"),
                caller: Some(caller.into()),
                procedure: None,
            };
            series.insert(
                key,
                RateSeries {
                    start: START,
                    step: 60,
                    values,
                },
            );
        }
    }
    let history = History {
        start: START,
        step: 60,
        len,
        series,
        rejected: vec![],
        source_error: None,
    };
    let whole_bytes = history.series.len() * len * 4;
    let one_service = 2 * len * 4;
    let now = Utc
        .timestamp_opt(START + (DAYS as i64) * 86_400, 0)
        .unwrap();
    let world = World::none();
    let current = pipeline::plan(&cfg, &repo, &history, &world, now, Purpose::Run);
    let inputs = Inputs { cfg, repo, world };
    let source = OnDisk {
        history,
        reads: AtomicUsize::new(0),
    };
    let body = b"policies:\n  patch:\n    default:\n      headroom: 0.5\n";

    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    let a = preview(
        &inputs,
        &source,
        &current,
        body,
        Some("application/yaml"),
        now,
    )
    .unwrap();
    let peak = PEAK.load(Ordering::Relaxed) - before;

    // A real answer for every service: planned, changed by the what-if, backtested.
    assert_eq!(a.plan.buckets.len(), 2 * SERVICES, "{:?}", a.plan.skipped);
    assert_eq!(a.backtest.buckets.len(), 2 * SERVICES);
    assert!(a
        .backtest
        .buckets
        .iter()
        .all(|b| b.current.is_some() && b.what_if.is_some()));
    assert!(!a.diff.buckets.is_empty());
    assert!(source.reads.load(Ordering::Relaxed) >= SERVICES);
    // The whole history is 40 services' worth; the preview's peak is a few services' worth
    // (a service read, its training part, the policies' working copies, the plans).
    eprintln!(
        "peak {peak} bytes above the start; whole history {whole_bytes}, one service {one_service}"
    );
    assert!(
        peak < whole_bytes / 4,
        "the preview allocated {peak} bytes at its peak: the whole history is {whole_bytes}, one service {one_service}"
    );
}
