//! A late report that marks an hour dirty again between a reader's two reads (the dirty
//! hours, then the hour rows): the reader takes that hour's minutes, never its stale row.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::hook::{Hook, AFTER_CLEAN_HOURS};
use super::*;
use crate::store::tests::tick;

/// A hook that stores `late` once, through `store`.
fn store_once(store: &Store, late: ReportRow) -> Hook {
    let (store, done) = (store.clone(), Arc::new(AtomicBool::new(false)));
    Arc::new(move || {
        let (store, late, done) = (store.clone(), late.clone(), done.clone());
        Box::pin(async move {
            if !done.swap(true, Ordering::SeqCst) {
                assert_eq!(store.insert_reports(&[late], Utc::now()).await.unwrap(), 1);
            }
        })
    })
}

async fn check_late_report_between_reads(store: Store) {
    // Three closed hours of one report a minute, rolled up: every hour clean.
    let t0 = hour_of(Utc::now()) - Duration::hours(4);
    let s0 = t0.timestamp();
    let batch: Vec<ReportRow> = (0..180)
        .map(|m| {
            tick(
                m + 1,
                s0 + m * 60 + 10,
                "gw",
                "eu",
                "shadow",
                10.0 + (m % 7) as f64,
                12.0,
            )
        })
        .collect();
    assert_eq!(store.insert_reports(&batch, Utc::now()).await.unwrap(), 180);
    assert_eq!(store.roll_up_hours(Utc::now()).await.unwrap(), 3);
    let end = t0 + Duration::hours(3);

    // The readiness figures: a burst arrives late in the second hour, right after the reader
    // found it clean.
    let late = tick(1_000, s0 + 90 * 60 + 30, "gw", "eu", "shadow", 500.0, 12.0);
    let got = AFTER_CLEAN_HOURS
        .scope(
            store_once(&store, late),
            store.shadow_stats("payments", "gw", t0, end),
        )
        .await
        .unwrap()
        .unwrap();
    let (_, want) = store
        .bucket_window("payments", "gw", t0, end)
        .await
        .unwrap();
    let want = want.unwrap();
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * a.abs().max(1.0);
    assert!(close(got.offered, want.offered), "{got:?} {want:?}");
    assert!(
        close(got.virtual_dropped, want.virtual_dropped),
        "{got:?} {want:?}"
    );
    assert!(
        close(got.peak_drop_share, want.peak_drop_share),
        "{got:?} {want:?}"
    );
    assert_eq!(got.peak_drop_at, want.peak_drop_at);
    assert_eq!(got.coverage, want.coverage);
    let (a, b) = (got.suggested_limit_rps, want.suggested_limit_rps);
    assert!(close(a.unwrap(), b.unwrap()), "{a:?} {b:?}");

    // The chart, in hour steps: another late burst, in the third hour.
    let late = tick(1_001, s0 + 150 * 60 + 30, "gw", "eu", "shadow", 700.0, 12.0);
    assert_eq!(
        store.roll_up_hours(Utc::now()).await.unwrap(),
        1,
        "the second hour"
    );
    let got = AFTER_CLEAN_HOURS
        .scope(
            store_once(&store, late),
            store.bucket_steps("payments", "gw", t0, end, 3600),
        )
        .await
        .unwrap();
    let want = steps_from_minutes(
        &store
            .bucket_minutes("payments", "gw", t0, end)
            .await
            .unwrap(),
        t0,
        3600,
    );
    assert_eq!(got.len(), 3);
    assert_eq!(got.len(), want.len());
    for (a, b) in got.iter().zip(&want) {
        assert_eq!(
            (a.step, a.offered_rps, a.virtual_drop_rps, a.limit_rps),
            (b.step, b.offered_rps, b.virtual_drop_rps, b.limit_rps),
        );
        assert!(close(a.offered, b.offered), "{a:?} {b:?}");
    }
    // The late burst shares its minute with that minute's report (offered 13): (13 + 700) / 2.
    assert_eq!(
        got[2].offered_rps, 356.5,
        "the late burst, not the stale hour"
    );
}

#[tokio::test]
async fn sqlite_a_late_report_between_the_reads_is_not_missed() {
    let dir = tempfile::tempdir().unwrap();
    check_late_report_between_reads(Store::connect("sqlite://rlc.db", dir.path()).await.unwrap())
        .await;
}

#[tokio::test]
async fn postgres_a_late_report_between_the_reads_is_not_missed() {
    let db = test_support::postgres::fresh_database().await.unwrap();
    check_late_report_between_reads(
        Store::connect(&db.url, std::path::Path::new("/"))
            .await
            .unwrap(),
    )
    .await;
}
