//! The same store tests on SQLite and on a real throwaway Postgres.

use chrono::TimeZone;

use super::*;
use grl_wire::ReportRow;

fn run(trigger: &str, status: &str, minute: u32) -> RunRecord {
    RunRecord {
        id: 0,
        trigger: trigger.into(),
        started_at: Utc.with_ymd_and_hms(2026, 11, 30, 3, minute, 0).unwrap(),
        finished_at: Utc.with_ymd_and_hms(2026, 11, 30, 3, minute, 30).unwrap(),
        status: status.into(),
        commit_sha: Some("abc".into()),
        version_pushed: None,
        services: r#"[{"service":"payments","outcome":"committed"}]"#.into(),
        summary: "raised 1".into(),
        error: None,
        run_uid: None,
        pr_number: None,
        pr_url: None,
    }
}

fn quota(limit: f64, prev: Option<f64>) -> QuotaRecord {
    QuotaRecord {
        service: "payments".into(),
        bucket: "gw".into(),
        change: if prev.is_some() {
            rlc_plan::change::ChangeKind::Raised
        } else {
            rlc_plan::change::ChangeKind::Added
        },
        limit_rps: Some(limit),
        previous_limit_rps: prev,
        mode: Some("enforce".into()),
        policy: Some("peak".into()),
        commit_sha: Some("abc".into()),
        state: ChangeState::Applied,
        evidence: r#"{"peak_rps":80}"#.into(),
        recorded_at: Utc.with_ymd_and_hms(2026, 11, 30, 3, 0, 30).unwrap(),
        pr_number: None,
        pr_url: None,
    }
}

fn report(seq: i64, mode: &str) -> ReportRow {
    serde_json::from_value(serde_json::json!({
        "seq": seq, "t": 1_796_000_000.5, "service": "payments", "bucket": "gw", "caller": "gw",
        "procedure": null, "mode": mode, "scope_key": "global", "offered": 150.0,
        "admitted": 150.0, "dropped": 0.0, "shadow_dropped": 50.0, "limit_rps": 100.0,
        "drop_ratio": 0.333
    }))
    .unwrap()
}

async fn check_store(store: Store) {
    let id1 = store
        .record_run(&run("once", "success", 0), &[quota(100.0, None)])
        .await
        .unwrap();
    let mut failed = run("schedule", "failed", 5);
    failed.error = Some("remote rejected".into());
    failed.commit_sha = None;
    failed.run_uid = Some("0123456789abcdef0123456789abcdef".into());
    let id2 = store.record_run(&failed, &[]).await.unwrap();
    assert!(id2 > id1);
    // A run is found by the id given out before it ran, and by the store's id.
    let by_uid = store
        .run_by_uid("0123456789abcdef0123456789abcdef")
        .await
        .unwrap()
        .expect("found by run_uid");
    assert_eq!((by_uid.id, by_uid.status.as_str()), (id2, "failed"));
    assert_eq!(store.run_by_id(id1).await.unwrap().unwrap().run_uid, None);
    assert_eq!(store.run_by_uid("nope").await.unwrap(), None);
    assert_eq!(store.run_by_id(id2 + 100).await.unwrap(), None);
    // One record per run: recording it again (a retried buffered record) returns its id.
    assert_eq!(store.record_run(&failed, &[]).await.unwrap(), id2);
    store
        .record_run(&run("api", "success", 10), &[quota(150.0, Some(100.0))])
        .await
        .unwrap();

    let runs = store.recent_runs(2).await.unwrap();
    assert_eq!(runs.len(), 2);
    assert_eq!(runs[0].trigger, "api");
    assert_eq!(runs[1].id, id2);
    assert_eq!(runs[1].error.as_deref(), Some("remote rejected"));
    assert_eq!(runs[1].started_at, failed.started_at);
    assert_eq!(runs[1].commit_sha, None);

    let hist = store.quota_history("payments", "gw").await.unwrap();
    assert_eq!(
        hist.iter().map(|q| q.limit_rps).collect::<Vec<_>>(),
        vec![Some(100.0), Some(150.0)]
    );
    assert_eq!(hist[1], quota(150.0, Some(100.0)));
    assert!(store
        .quota_history("payments", "other")
        .await
        .unwrap()
        .is_empty());

    assert_eq!(
        store
            .insert_reports(&[report(1, "shadow"), report(2, "shadow")], Utc::now())
            .await
            .unwrap(),
        2
    );
    // Re-delivered reports are not duplicated.
    assert_eq!(
        store
            .insert_reports(&[report(2, "shadow"), report(3, "shadow")], Utc::now())
            .await
            .unwrap(),
        1
    );
    let stored = store.reports(Some("payments"), 10).await.unwrap();
    assert_eq!(
        stored.iter().map(|r| r.seq).collect::<Vec<_>>(),
        vec![1, 2, 3]
    );
    assert_eq!(
        stored[0].t,
        Utc.timestamp_millis_opt(1_796_000_000_500).unwrap()
    );
    assert_eq!(stored[0].shadow_dropped, 50.0);
    assert!(store.reports(Some("maps"), 10).await.unwrap().is_empty());
    assert_eq!(store.reports(None, 2).await.unwrap().len(), 2);

    assert_eq!(store.cursor("reports").await.unwrap(), None);
    store.set_cursor("reports", "3").await.unwrap();
    store.set_cursor("reports", "7").await.unwrap();
    assert_eq!(store.cursor("reports").await.unwrap().as_deref(), Some("7"));
}

/// A shadow report of `service`/`bucket` with the given rates; drop ratio and virtual drops
/// follow from the offered rate and the limit, as the controller computes them.
fn rates(
    seq: i64,
    service: &str,
    bucket: &str,
    scope: &str,
    offered: f64,
    limit: f64,
) -> ReportRow {
    let ratio = if offered > limit {
        (offered - limit) / offered
    } else {
        0.0
    };
    serde_json::from_value(serde_json::json!({
        "seq": seq, "t": seq, "service": service, "bucket": bucket, "caller": null,
        "procedure": "charge", "mode": "shadow", "scope_key": scope, "offered": offered,
        "admitted": offered, "dropped": 0.0, "shadow_dropped": (offered - limit).max(0.0),
        "limit_rps": limit, "drop_ratio": ratio
    }))
    .unwrap()
}

/// Stores `reports` as ticks at `t`.
async fn put(store: &Store, reports: &[ReportRow], t: DateTime<Utc>) -> u64 {
    let ticked: Vec<ReportRow> = reports
        .iter()
        .cloned()
        .map(|mut r| {
            r.t = grl_wire::Tick::Frac(t.timestamp() as f64);
            r
        })
        .collect();
    store.insert_reports(&ticked, t).await.unwrap()
}

async fn check_shadow_summary(store: Store) {
    let at = |h, m| Utc.with_ymd_and_hms(2026, 11, 30, h, m, 0).unwrap();
    // Before the window: must not count.
    put(
        &store,
        &[rates(1, "payments", "gw", "", 1000.0, 100.0)],
        at(1, 0),
    )
    .await;
    put(
        &store,
        &[
            // gw: 150 offered against 100 in two regions, then the limit is raised to 200.
            rates(2, "payments", "gw", "eu", 150.0, 100.0),
            rates(2, "payments", "gw", "us", 150.0, 100.0),
            rates(3, "payments", "gw", "eu", 100.0, 200.0),
            rates(2, "payments", "quiet", "", 50.0, 100.0),
            rates(2, "payments", "idle", "", 0.0, 100.0),
            rates(2, "maps", "geo", "", 120.0, 100.0),
        ],
        at(2, 30),
    )
    .await;
    put(
        &store,
        &[rates(4, "payments", "quiet", "", 70.0, 100.0)],
        at(2, 45),
    )
    .await;

    let since = at(2, 0);
    let all = store.shadow_summary(None, since, 10).await.unwrap();
    let names: Vec<_> = all
        .iter()
        .map(|b| format!("{}/{}", b.service, b.bucket))
        .collect();
    // Largest virtual-drop share first; ties by name.
    assert_eq!(
        names,
        ["payments/gw", "maps/geo", "payments/idle", "payments/quiet"]
    );
    let gw = &all[0];
    assert_eq!(gw.reports, 3);
    assert_eq!(gw.offered, 400.0);
    assert_eq!(gw.admitted, 400.0);
    assert_eq!(gw.dropped, 0.0);
    assert_eq!(gw.shadow_dropped, 100.0);
    assert_eq!(gw.virtual_drop_share, 0.25);
    assert_eq!(gw.peak_offered_rps, 150.0);
    assert!((gw.max_drop_ratio - 1.0 / 3.0).abs() < 1e-12);
    assert_eq!(gw.limit_rps, 200.0, "the latest limit");
    assert_eq!(gw.mode, "shadow");
    assert_eq!((gw.first_seen, gw.last_seen), (at(2, 30), at(2, 30)));
    let quiet = &all[3];
    assert_eq!((quiet.reports, quiet.offered), (2, 120.0));
    assert_eq!(quiet.virtual_drop_share, 0.0);
    assert_eq!((quiet.first_seen, quiet.last_seen), (at(2, 30), at(2, 45)));
    // No traffic: share 0, not a division by zero.
    assert_eq!(all[2].virtual_drop_share, 0.0);

    let maps = store.shadow_summary(Some("maps"), since, 10).await.unwrap();
    assert_eq!(maps.len(), 1);
    assert!((maps[0].virtual_drop_share - 20.0 / 120.0).abs() < 1e-12);
    // The limit keeps the first buckets of the order, with their latest limit and mode.
    let top = store.shadow_summary(None, since, 2).await.unwrap();
    let top_names: Vec<_> = top
        .iter()
        .map(|b| format!("{}/{}", b.service, b.bucket))
        .collect();
    assert_eq!(top_names, names[..2]);
    assert_eq!((top[0].limit_rps, top[0].mode.as_str()), (200.0, "shadow"));
    assert!(store
        .shadow_summary(None, at(3, 0), 10)
        .await
        .unwrap()
        .is_empty());
    // The old report counts when the window reaches back to it.
    let wide = store
        .shadow_summary(Some("payments"), at(0, 0), 10)
        .await
        .unwrap();
    assert_eq!(wide[0].reports, 4);

    assert_eq!(
        store.shadow_services(since, 10).await.unwrap(),
        ["maps", "payments"]
    );
    assert_eq!(store.shadow_services(since, 1).await.unwrap(), ["maps"]);
}

/// The decrease guard's query: only applied `lowered` records at or after `since` count; a
/// decrease only proposed on the pull-request branch is not one.
async fn check_applied_decreases(store: Store) {
    store
        .record_run(&run("once", "success", 0), &[quota(150.0, None)])
        .await
        .unwrap();
    let mut cut = quota(120.0, Some(150.0));
    cut.change = rlc_plan::change::ChangeKind::Lowered;
    cut.recorded_at = Utc.with_ymd_and_hms(2026, 11, 30, 4, 0, 0).unwrap();
    let mut proposed = cut.clone();
    proposed.bucket = "other".into();
    proposed.state = ChangeState::Proposed;
    proposed.recorded_at = Utc.with_ymd_and_hms(2026, 11, 30, 4, 10, 0).unwrap();
    let mut later = cut.clone();
    later.recorded_at = Utc.with_ymd_and_hms(2026, 11, 30, 4, 5, 0).unwrap();
    store
        .record_run(&run("api", "success", 20), &[cut.clone(), proposed])
        .await
        .unwrap();
    store
        .record_run(&run("api", "success", 25), &[later.clone()])
        .await
        .unwrap();
    let before = Utc.with_ymd_and_hms(2026, 11, 30, 3, 30, 0).unwrap();
    let after = Utc.with_ymd_and_hms(2026, 11, 30, 4, 30, 0).unwrap();
    let found = store.applied_decreases_since(before).await.unwrap();
    assert_eq!(
        found,
        [(
            ("payments".to_string(), "gw".to_string()),
            later.recorded_at
        )]
        .into(),
        "the latest applied decrease of gw; the proposed one of `other` does not count"
    );
    assert!(store
        .applied_decreases_since(after)
        .await
        .unwrap()
        .is_empty());
    let states: Vec<ChangeState> = store
        .quota_changes("payments", "other", 10)
        .await
        .unwrap()
        .iter()
        .map(|c| c.state)
        .collect();
    assert_eq!(states, [ChangeState::Proposed]);
    // The open proposal of `other`, once merged, is applied and then counts.
    let open = store.open_proposals().await.unwrap();
    assert_eq!(open.len(), 1, "{open:?}");
    let (id, service, bucket, limit, mode) = open[0].clone();
    assert_eq!(
        (service.as_str(), bucket.as_str(), limit),
        ("payments", "other", Some(120.0))
    );
    assert_eq!(mode.as_deref(), cut.mode.as_deref());
    store.mark_applied(&[id]).await.unwrap();
    assert!(store.open_proposals().await.unwrap().is_empty());
    let found = store.applied_decreases_since(before).await.unwrap();
    assert!(
        found.contains_key(&("payments".to_string(), "other".to_string())),
        "{found:?}"
    );
}

#[tokio::test]
async fn sqlite_applied_decreases() {
    let dir = tempfile::tempdir().unwrap();
    check_applied_decreases(Store::connect("sqlite://rlc.db", dir.path()).await.unwrap()).await;
}

#[tokio::test]
async fn postgres_applied_decreases() {
    let db = test_support::postgres::fresh_database().await.unwrap();
    check_applied_decreases(Store::connect(&db.url, Path::new("/")).await.unwrap()).await;
}

/// Rows that carry the requests counted (`counts`): the sums are those counts, exact however
/// the rates moved; the busiest second comes from the rates. Rows without counts (an older
/// controller) add their rates, as before.
async fn check_counted_rows(store: Store) {
    let at = |s| Utc.with_ymd_and_hms(2026, 11, 30, 3, 0, s).unwrap();
    let counted = |seq: i64, rate: f64, offered: u64, dropped: u64| {
        let mut r = rates(seq, "payments", "gw", "", rate, 100.0);
        r.counts = Some(grl_wire::ReportCounts {
            offered,
            admitted: offered - dropped,
            dropped,
            shadow_dropped: 0,
            tiers: Vec::new(),
        });
        r
    };
    // The counts arrive in lumps (a client reports every second): 0, 250, 50 requests while
    // the rates say 100, 150, 120 requests/s.
    put(&store, &[counted(1, 100.0, 0, 0)], at(1)).await;
    put(&store, &[counted(2, 150.0, 250, 40)], at(2)).await;
    put(&store, &[counted(3, 120.0, 50, 10)], at(3)).await;
    // An older controller's row: its rate counts as one second of requests.
    put(
        &store,
        &[rates(4, "payments", "gw", "", 30.0, 100.0)],
        at(4),
    )
    .await;
    let sum = store.shadow_summary(None, at(0), 10).await.unwrap();
    assert_eq!(sum.len(), 1, "{sum:?}");
    let gw = &sum[0];
    assert_eq!(gw.offered, 330.0, "{gw:?}");
    assert_eq!(gw.dropped, 50.0, "{gw:?}");
    assert_eq!(gw.peak_offered_rps, 150.0, "{gw:?}");
    assert_eq!(gw.reports, 4);
}

/// The tier counts of new rows reach `shadow_tier_minutes` once (a row stored again adds
/// nothing), every scope key together, per step and tier; rows without tiers add none; the
/// retention deletes them with the minutes.
async fn check_tier_counts(store: Store) {
    let at = |m, s| Utc.with_ymd_and_hms(2026, 11, 30, 3, m, s).unwrap();
    let tiered = |seq: i64, scope: &str, shed: [u64; 4], crit: [u64; 4]| {
        let mut r = rates(seq, "payments", "gw", scope, 100.0, 100.0);
        let split = [shed, [0; 4], crit, [0; 4], [5, 5, 0, 0]];
        r.counts = Some(grl_wire::ReportCounts::from_tiers(&split));
        r
    };
    let a = tiered(1, "zone:a", [180, 80, 100, 0], [120, 120, 0, 0]);
    let b = tiered(2, "zone:b", [30, 30, 0, 30], [0; 4]);
    // The same row twice in one batch: stored and counted once.
    assert_eq!(put(&store, &[a.clone(), b, a.clone()], at(0, 1)).await, 2);
    // Stored again (a poll that overlapped): nothing new, nothing added.
    assert_eq!(put(&store, &[a], at(0, 1)).await, 0);
    put(
        &store,
        &[tiered(3, "zone:a", [60, 60, 0, 0], [10, 10, 0, 0])],
        at(1, 5),
    )
    .await;
    // An older controller's row: no tiers.
    put(
        &store,
        &[rates(4, "payments", "gw", "zone:a", 30.0, 100.0)],
        at(2, 0),
    )
    .await;
    let steps = store
        .tier_steps("payments", "gw", at(0, 0), at(3, 0), 60)
        .await
        .unwrap();
    let got: Vec<(String, i64, [f64; 4])> = steps
        .iter()
        .map(|r| {
            let c = [r.offered, r.admitted, r.dropped, r.shadow_dropped];
            (r.tier.as_str().to_string(), r.step, c)
        })
        .collect();
    assert_eq!(
        got,
        [
            ("SHEDDABLE".to_string(), 0, [210.0, 110.0, 100.0, 30.0]),
            ("SHEDDABLE".to_string(), 1, [60.0, 60.0, 0.0, 0.0]),
            ("CRITICAL".to_string(), 0, [120.0, 120.0, 0.0, 0.0]),
            ("CRITICAL".to_string(), 1, [10.0, 10.0, 0.0, 0.0]),
        ]
    );
    // The minutes hold the row given twice once: 305 + 35 + 75, and the older controller's 30.
    let sum = store.shadow_summary(None, at(0, 0), 10).await.unwrap();
    assert_eq!(sum[0].offered, 305.0 + 35.0 + 75.0 + 30.0, "{sum:?}");
    // One step of three minutes: summed.
    let whole = store
        .tier_steps("payments", "gw", at(0, 0), at(3, 0), 180)
        .await
        .unwrap();
    assert_eq!(whole.len(), 2);
    assert_eq!(
        (whole[0].tier.as_str(), whole[0].offered),
        ("SHEDDABLE", 270.0)
    );
    assert!(store
        .tier_steps("payments", "other", at(0, 0), at(3, 0), 60)
        .await
        .unwrap()
        .is_empty());
    // The busiest minute of CRITICAL_PLUS + CRITICAL: minute 0, 120 requests (2 rps).
    let peaks = store.critical_peaks(at(0, 0)).await.unwrap();
    assert_eq!(
        peaks.get(&("payments".to_string(), "gw".to_string())),
        Some(&(2.0, at(0, 0)))
    );
    assert_eq!(peaks.len(), 1);
    let later = store.critical_peaks(at(1, 0)).await.unwrap();
    assert_eq!(later.values().next().map(|p| p.0), Some(10.0 / 60.0));
    store.apply_retention(at(1, 0), at(1, 0)).await.unwrap();
    let left = store
        .tier_steps("payments", "gw", at(0, 0), at(3, 0), 60)
        .await
        .unwrap();
    let left: Vec<(&str, i64, f64)> = left
        .iter()
        .map(|r| (r.tier.as_str(), r.step, r.offered))
        .collect();
    assert_eq!(left, [("SHEDDABLE", 1, 60.0), ("CRITICAL", 1, 10.0)]);
}

#[tokio::test]
async fn sqlite_tier_counts() {
    let dir = tempfile::tempdir().unwrap();
    check_tier_counts(Store::connect("sqlite://rlc.db", dir.path()).await.unwrap()).await;
}

#[tokio::test]
async fn postgres_tier_counts() {
    let db = test_support::postgres::fresh_database().await.unwrap();
    check_tier_counts(Store::connect(&db.url, Path::new("/")).await.unwrap()).await;
}

#[tokio::test]
async fn sqlite_counted_rows() {
    let dir = tempfile::tempdir().unwrap();
    check_counted_rows(Store::connect("sqlite://rlc.db", dir.path()).await.unwrap()).await;
}

#[tokio::test]
async fn postgres_counted_rows() {
    let db = test_support::postgres::fresh_database().await.unwrap();
    check_counted_rows(Store::connect(&db.url, Path::new("/")).await.unwrap()).await;
}

#[tokio::test]
async fn sqlite_shadow_summary() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::connect("sqlite://rlc.db", dir.path()).await.unwrap();
    check_shadow_summary(store).await;
}

#[tokio::test]
async fn postgres_shadow_summary() {
    let db = test_support::postgres::fresh_database().await.unwrap();
    let store = Store::connect(&db.url, Path::new("/")).await.unwrap();
    check_shadow_summary(store).await;
}

#[tokio::test]
async fn sqlite_store() {
    let dir = tempfile::tempdir().unwrap();
    // Relative to the base dir, as in rlc.yaml.
    let store = Store::connect("sqlite://rlc.db", dir.path()).await.unwrap();
    assert_eq!(store.backend(), "sqlite");
    check_store(store).await;
    assert!(dir.path().join("rlc.db").exists());
    // Reopening runs migrations again without harm and keeps the data.
    let store = Store::connect("sqlite://rlc.db", dir.path()).await.unwrap();
    assert_eq!(store.recent_runs(10).await.unwrap().len(), 3);
    assert!(store.try_lead().await.unwrap().is_some());
}

#[tokio::test]
async fn postgres_store() {
    let db = test_support::postgres::fresh_database().await.unwrap();
    let store = Store::connect(&db.url, Path::new("/")).await.unwrap();
    assert_eq!(store.backend(), "postgres");
    check_store(store).await;
}

#[tokio::test]
async fn postgres_elects_one_scheduler() {
    let db = test_support::postgres::fresh_database().await.unwrap();
    let a = Store::connect(&db.url, Path::new("/")).await.unwrap();
    let b = Store::connect(&db.url, Path::new("/")).await.unwrap();
    let mut lease = a.try_lead().await.unwrap().expect("first replica leads");
    assert!(
        b.try_lead().await.unwrap().is_none(),
        "second replica waits"
    );
    assert!(lease.alive().await);
    lease.release().await;
    assert!(
        b.try_lead().await.unwrap().is_some(),
        "second replica takes over once the first lets go"
    );
}

/// A report of `bucket` at tick `t` (unix seconds) with the given rates and mode.
#[allow(clippy::too_many_arguments)]
pub(super) fn tick(
    seq: i64,
    t: i64,
    bucket: &str,
    scope: &str,
    mode: &str,
    offered: f64,
    limit: f64,
) -> ReportRow {
    let over = (offered - limit).max(0.0);
    let (dropped, shadow) = if mode == "enforce" {
        (over, 0.0)
    } else {
        (0.0, over)
    };
    serde_json::from_value(serde_json::json!({
        "seq": seq, "t": t, "service": "payments", "bucket": bucket, "caller": null,
        "procedure": null, "mode": mode, "scope_key": scope, "offered": offered,
        "admitted": offered - dropped, "dropped": dropped, "shadow_dropped": shadow,
        "limit_rps": limit, "drop_ratio": if offered > 0.0 { over / offered } else { 0.0 }
    }))
    .unwrap()
}

/// Readiness figures from the roll-ups: a shadow bucket in two zones, 10 minutes, one burst,
/// one missing minute, an enforce period before; and an enforced bucket with real drops.
async fn check_shadow_stats(store: Store) {
    let t0 = Utc.with_ymd_and_hms(2026, 11, 30, 2, 0, 0).unwrap();
    let s0 = t0.timestamp();
    let mut seq = 0;
    let mut batch = Vec::new();
    // An hour before: the bucket was enforced for a minute.
    for k in 0..6 {
        seq += 1;
        batch.push(tick(
            seq,
            s0 - 3600 + k * 10,
            "gw",
            "eu",
            "enforce",
            100.0,
            120.0,
        ));
    }
    for minute in 0..10 {
        if minute == 7 {
            continue; // the report feed missed this minute
        }
        for k in 0..6 {
            for zone in ["eu", "us"] {
                seq += 1;
                let offered = if minute == 5 && zone == "eu" {
                    200.0
                } else {
                    100.0
                };
                let t = s0 + minute * 60 + k * 10;
                batch.push(tick(seq, t, "gw", zone, "shadow", offered, 120.0));
                batch.push(tick(seq, t, "api", zone, "enforce", 150.0, 120.0));
            }
        }
    }
    // Two batches, the second re-delivering part of the first: counted once.
    let half = batch.len() / 2;
    assert_eq!(
        store.insert_reports(&batch[..half], t0).await.unwrap() as usize,
        half
    );
    assert_eq!(
        store.insert_reports(&batch[half - 10..], t0).await.unwrap() as usize,
        batch.len() - half
    );

    let end = t0 + chrono::Duration::minutes(10);
    let gw = store
        .shadow_stats("payments", "gw", t0, end)
        .await
        .unwrap()
        .expect("gw has reports");
    assert_eq!(gw.mode, "shadow");
    assert_eq!(
        gw.shadow_since,
        Some(t0),
        "shadow since the end of the enforce period"
    );
    assert_eq!(
        gw.last_report,
        Some(t0 + chrono::Duration::seconds(9 * 60 + 50))
    );
    assert!((gw.coverage - 0.9).abs() < 1e-12, "{}", gw.coverage);
    // 9 minutes × 2 zones × 6 ticks × 100, the burst minute's eu ticks at 200.
    assert_eq!(gw.offered, 9.0 * 2.0 * 6.0 * 100.0 + 6.0 * 100.0);
    assert_eq!(gw.virtual_dropped, 6.0 * 80.0);
    assert_eq!(gw.dropped, 0.0);
    assert!((gw.peak_drop_share - 480.0 / 1800.0).abs() < 1e-12);
    assert_eq!(gw.peak_drop_at, Some(t0 + chrono::Duration::minutes(5)));
    assert_eq!(gw.limit_rps, 120.0);
    // 17 zone-minutes at 100 rps, one at 200: 1900 in all; 0.01 % = 0.19 may be lost.
    let l = gw.suggested_limit_rps.unwrap();
    assert!((l - (200.0 - 0.19)).abs() < 1e-9, "{l}");
    assert!(matches!(
        rlc_plan::readiness::verdict(&gw, &rlc_plan::readiness::Rule::default(), end),
        rlc_plan::readiness::Verdict::WouldThrottle { .. }
    ));

    let api = store
        .shadow_stats("payments", "api", t0, end)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(api.mode, "enforce");
    assert_eq!(api.shadow_since, None);
    assert_eq!(api.dropped, 9.0 * 2.0 * 6.0 * 30.0);
    assert_eq!(api.virtual_dropped, 0.0);
    assert_eq!(
        rlc_plan::readiness::verdict(&api, &rlc_plan::readiness::Rule::default(), end),
        rlc_plan::readiness::Verdict::Enforced
    );
    // A window without reports: zero coverage, no suggestion; an unknown bucket: None.
    let empty = store
        .shadow_stats("payments", "gw", end, end + chrono::Duration::hours(1))
        .await
        .unwrap()
        .unwrap();
    assert_eq!((empty.coverage, empty.suggested_limit_rps), (0.0, None));
    assert!(store
        .shadow_stats("payments", "nope", t0, end)
        .await
        .unwrap()
        .is_none());

    // Series: 9 minutes × 2 zones; minute 7 absent, not zero.
    let rows = store
        .bucket_minutes("payments", "gw", t0, end)
        .await
        .unwrap();
    assert_eq!(rows.len(), 18);
    assert!(rows
        .iter()
        .all(|r| r.minute != t0 + chrono::Duration::minutes(7)));
    let burst = rows
        .iter()
        .find(|r| r.minute == t0 + chrono::Duration::minutes(5) && r.scope_key == "eu")
        .unwrap();
    assert_eq!(
        (
            burst.reports,
            burst.offered_rps(),
            burst.shadow_dropped_rps()
        ),
        (6, 200.0, 80.0)
    );

    // Whole hours from the hourly roll-ups (api's hour is flat at 150 rps, gw's has the
    // burst): the same figures as from the minutes.
    let wide = (
        t0 - chrono::Duration::hours(1),
        t0 + chrono::Duration::hours(2),
    );
    let mut from_minutes = Vec::new();
    for b in ["gw", "api"] {
        from_minutes.push(
            store
                .shadow_stats("payments", b, wide.0, wide.1)
                .await
                .unwrap()
                .unwrap(),
        );
    }
    assert_eq!(
        store
            .roll_up_hours(t0 + chrono::Duration::hours(3))
            .await
            .unwrap(),
        2
    );
    for (b, want) in ["gw", "api"].into_iter().zip(from_minutes) {
        let got = store
            .shadow_stats("payments", b, wide.0, wide.1)
            .await
            .unwrap()
            .unwrap();
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * a.abs().max(1.0);
        assert!(
            close(got.offered, want.offered) && close(got.dropped, want.dropped),
            "{got:?} {want:?}"
        );
        let l = (
            got.suggested_limit_rps.unwrap(),
            want.suggested_limit_rps.unwrap(),
        );
        assert!(close(l.0, l.1), "{b}: {l:?}");
        let mut same = got.clone();
        (same.offered, same.dropped, same.virtual_dropped) =
            (want.offered, want.dropped, want.virtual_dropped);
        (same.suggested_limit_rps, same.peak_drop_share) =
            (want.suggested_limit_rps, want.peak_drop_share);
        assert_eq!(same, want);
    }

    // Retention: raw reports before t0 + 5 min and roll-ups before t0 go.
    let gone = store
        .apply_retention(t0 + chrono::Duration::minutes(5), t0)
        .await
        .unwrap();
    assert_eq!(gone.raw_deleted, 6 + 5 * 6 * 2 * 2);
    assert_eq!(gone.minutes_deleted, 1);
    assert_eq!(gone.hours_deleted, 1, "the hour before t0");
    assert_eq!(
        store
            .bucket_minutes("payments", "gw", t0, end)
            .await
            .unwrap()
            .len(),
        18,
        "roll-ups outlive raw reports"
    );
}

#[tokio::test]
async fn sqlite_shadow_stats() {
    let dir = tempfile::tempdir().unwrap();
    check_shadow_stats(Store::connect("sqlite://rlc.db", dir.path()).await.unwrap()).await;
}

#[tokio::test]
async fn postgres_shadow_stats() {
    let db = test_support::postgres::fresh_database().await.unwrap();
    check_shadow_stats(Store::connect(&db.url, Path::new("/")).await.unwrap()).await;
}

/// Migration 0003 keeps the reports stored before it: text tick times become timestamps and
/// the roll-ups are filled from them.
async fn check_migrated(store: Store) {
    let t = |s: i64| Utc.timestamp_opt(s, 0).unwrap();
    let stored = store.reports(None, 10).await.unwrap();
    assert_eq!(
        stored.iter().map(|r| (r.seq, r.t)).collect::<Vec<_>>(),
        vec![
            (1, t(1_796_000_000)),
            (2, t(1_796_000_030)),
            (3, t(1_796_000_090)),
            (4, Utc.with_ymd_and_hms(2026, 11, 30, 3, 0, 30).unwrap())
        ]
    );
    let rows = store
        .bucket_minutes("payments", "gw", t(1_795_999_980), t(1_796_000_100))
        .await
        .unwrap();
    assert_eq!(
        rows.iter()
            .map(|r| (r.minute, r.reports, r.offered, r.limit_rps))
            .collect::<Vec<_>>(),
        vec![
            (t(1_795_999_980), 2, 300.0, 110.0),
            (t(1_796_000_040), 1, 50.0, 120.0)
        ]
    );
    // Migration 0008 filled the bucket-wide days from the blocks: an overview from a UTC
    // midnight reads day rows only, and counts every report.
    let midnight = t(1_796_000_000 / 86_400 * 86_400 - 86_400);
    let all = store.shadow_summary(None, midnight, 10).await.unwrap();
    assert_eq!(
        all.iter()
            .map(|b| (b.bucket.as_str(), b.reports, b.offered))
            .collect::<Vec<_>>(),
        [("gw", 4, 360.0)]
    );
}

const OLD_ROW: &str = "INSERT INTO shadow_reports (seq, t, service, bucket, mode, scope_key, offered, admitted, dropped, shadow_dropped, limit_rps, drop_ratio, received_at) \
     VALUES ($1, $2, 'payments', 'gw', 'shadow', 'eu', $3, $3, 0, 0, $4, 0, $5)";

fn old_rows() -> Vec<(i64, &'static str, f64, f64)> {
    vec![
        (1, "1796000000", 100.0, 100.0),
        (2, "1796000030", 200.0, 110.0),
        (3, "1796000090", 50.0, 120.0),
        (4, "not a time", 10.0, 120.0),
    ]
}

/// A SQLite store in a temp dir (`rlc.db`) with the migrations before `version` applied: the
/// schema an older release left, to seed its rows and open it with today's [`Store`].
async fn sqlite_before(version: i64) -> (tempfile::TempDir, sqlx::SqlitePool) {
    let dir = tempfile::tempdir().unwrap();
    let pool = SqlitePoolOptions::new()
        .connect_with(
            SqliteConnectOptions::new()
                .filename(dir.path().join("rlc.db"))
                .create_if_missing(true),
        )
        .await
        .unwrap();
    let mut m = sqlx::migrate!("../migrations/sqlite");
    m.migrations.to_mut().retain(|x| x.version < version);
    m.run(&pool).await.unwrap();
    (dir, pool)
}

/// [`sqlite_before`] on a fresh throwaway Postgres database.
async fn postgres_before(version: i64) -> (test_support::postgres::TestDb, sqlx::PgPool) {
    let db = test_support::postgres::fresh_database().await.unwrap();
    let pool = PgPoolOptions::new().connect(&db.url).await.unwrap();
    let mut m = sqlx::migrate!("../migrations/postgres");
    m.migrations.to_mut().retain(|x| x.version < version);
    m.run(&pool).await.unwrap();
    (db, pool)
}

#[tokio::test]
async fn sqlite_migration_keeps_reports() {
    let (dir, pool) = sqlite_before(3).await;
    for (seq, t, offered, limit) in old_rows() {
        sqlx::query(OLD_ROW)
            .bind(seq)
            .bind(t)
            .bind(offered)
            .bind(limit)
            .bind(Utc.with_ymd_and_hms(2026, 11, 30, 3, 0, 30).unwrap())
            .execute(&pool)
            .await
            .unwrap();
    }
    pool.close().await;
    check_migrated(Store::connect("sqlite://rlc.db", dir.path()).await.unwrap()).await;
}

#[tokio::test]
async fn postgres_migration_keeps_reports() {
    let (db, pool) = postgres_before(3).await;
    for (seq, t, offered, limit) in old_rows() {
        sqlx::query(OLD_ROW)
            .bind(seq)
            .bind(t)
            .bind(offered)
            .bind(limit)
            .bind(Utc.with_ymd_and_hms(2026, 11, 30, 3, 0, 30).unwrap())
            .execute(&pool)
            .await
            .unwrap();
    }
    pool.close().await;
    check_migrated(Store::connect(&db.url, Path::new("/")).await.unwrap()).await;
}

/// The chart steps and readiness figures computed in SQL ([`Store::bucket_steps`],
/// [`Store::shadow_stats`]) and the overview over ten-minute blocks ([`Store::shadow_summary`])
/// give the numbers of the per-minute rows computed in Rust ([`steps_from_minutes`],
/// [`stats_from_minutes`]): three hours of a shadow bucket in two zones with varying rates
/// (several reports a minute, a one-minute burst, a limit changed mid-step), a 25-minute gap
/// of the whole feed and a 7-minute gap of one zone.
async fn check_sql_figures(store: Store) {
    let t0 = Utc.with_ymd_and_hms(2026, 11, 30, 1, 3, 0).unwrap();
    let s0 = t0.timestamp();
    let mut seq = 0;
    let mut batch = Vec::new();
    for minute in 0..180i64 {
        if (60..85).contains(&minute) {
            continue; // the whole feed missed these minutes
        }
        for zone in ["eu", "us"] {
            if zone == "us" && (120..127).contains(&minute) {
                continue; // one zone missed these
            }
            for k in 0..3 {
                seq += 1;
                let offered = match (minute, zone) {
                    (97, "eu") => 400.0 + k as f64, // the burst
                    _ => 80.0 + ((minute * 7 + k * 3) % 50) as f64,
                };
                let limit = if minute < 100 { 120.0 } else { 110.0 };
                let t = s0 + minute * 60 + k * 20;
                batch.push(tick(seq, t, "gw", zone, "shadow", offered, limit));
            }
        }
    }
    assert_eq!(
        store.insert_reports(&batch, t0).await.unwrap() as usize,
        batch.len()
    );
    let end = t0 + chrono::Duration::minutes(180);
    let rows = store
        .bucket_minutes("payments", "gw", t0, end)
        .await
        .unwrap();
    assert_eq!(rows.len(), 2 * (180 - 25) - 7);
    // First from the minutes only (every hour is dirty), then with the closed hours rolled
    // up: the same figures.
    for pass in 0..2 {
        if pass == 1 {
            assert_eq!(
                store.roll_up_hours(end).await.unwrap(),
                3,
                "01:00, 02:00, 03:00"
            );
            assert_eq!(store.roll_up_hours(end).await.unwrap(), 0);
        }
        for (start, step_secs) in [
            (t0, 60),
            (t0, 7 * 60),
            (t0 + chrono::Duration::minutes(2), 28 * 60),
            (t0 - chrono::Duration::minutes(30), 120 * 60),
            // Hour-aligned steps: the hourly roll-ups fill them.
            (t0 - chrono::Duration::minutes(3), 60 * 60),
            (t0 - chrono::Duration::minutes(63), 120 * 60),
        ] {
            let sql = store
                .bucket_steps("payments", "gw", start, end, step_secs)
                .await
                .unwrap();
            let rust = steps_from_minutes(
                &store
                    .bucket_minutes("payments", "gw", start, end)
                    .await
                    .unwrap(),
                start,
                step_secs,
            );
            assert_eq!(sql.len(), rust.len(), "step {step_secs}");
            for (a, b) in sql.iter().zip(&rust) {
                assert_eq!(
                    (
                        &a.scope_key,
                        a.step,
                        a.offered_rps,
                        a.virtual_drop_rps,
                        a.drop_rps,
                        a.limit_rps
                    ),
                    (
                        &b.scope_key,
                        b.step,
                        b.offered_rps,
                        b.virtual_drop_rps,
                        b.drop_rps,
                        b.limit_rps
                    ),
                    "step {step_secs}"
                );
                assert!((a.offered - b.offered).abs() < 1e-9, "{a:?} {b:?}");
            }
            // Gaps are absent steps, never zeros: with one-minute steps, exactly the minutes
            // without a row of the zone.
            if step_secs == 60 && start == t0 {
                let eu: Vec<i64> = sql
                    .iter()
                    .filter(|s| s.scope_key == "eu")
                    .map(|s| s.step)
                    .collect();
                assert_eq!(eu.len(), 155);
                assert!(!eu.iter().any(|i| (60..85).contains(i)));
                let us = sql.iter().filter(|s| s.scope_key == "us").count();
                assert_eq!(us, 148);
                assert!(sql.iter().all(|s| s.offered_rps > 0.0));
                let burst = sql
                    .iter()
                    .find(|s| s.scope_key == "eu" && s.step == 97)
                    .unwrap();
                assert_eq!(burst.offered_rps, 401.0, "(400 + 401 + 402) / 3");
                assert_eq!(burst.virtual_drop_rps, 281.0);
            }
        }
        // The readiness figures, over windows that cut minutes off either end.
        for (from, to) in [
            (t0, end),
            (
                t0 + chrono::Duration::minutes(13),
                end - chrono::Duration::minutes(5),
            ),
            (
                t0 + chrono::Duration::minutes(61),
                t0 + chrono::Duration::minutes(84),
            ),
        ] {
            let sql = store
                .shadow_stats("payments", "gw", from, to)
                .await
                .unwrap()
                .unwrap();
            let (_, rust) = store
                .bucket_window("payments", "gw", from, to)
                .await
                .unwrap();
            let rust = rust.unwrap();
            let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * a.abs().max(1.0);
            assert!(close(sql.offered, rust.offered), "{sql:?} {rust:?}");
            assert!(close(sql.virtual_dropped, rust.virtual_dropped));
            assert!(close(sql.dropped, rust.dropped));
            assert!(close(sql.peak_drop_share, rust.peak_drop_share));
            let (a, b) = (sql.suggested_limit_rps, rust.suggested_limit_rps);
            assert_eq!(a.is_some(), b.is_some());
            assert!(close(a.unwrap_or(0.0), b.unwrap_or(0.0)), "{a:?} {b:?}");
            if pass == 0 {
                assert_eq!(a, b, "exactly the reference's from the minutes alone");
            }
            let mut same = sql.clone();
            same.offered = rust.offered;
            same.virtual_dropped = rust.virtual_dropped;
            same.dropped = rust.dropped;
            same.peak_drop_share = rust.peak_drop_share;
            same.suggested_limit_rps = rust.suggested_limit_rps;
            assert_eq!(same, rust);
        }
    }
    // The burst minute is the peak; a window inside the gap has no coverage and no limit.
    let all = store
        .shadow_stats("payments", "gw", t0, end)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(all.peak_drop_at, Some(t0 + chrono::Duration::minutes(97)));
    let gap = store
        .shadow_stats(
            "payments",
            "gw",
            t0 + chrono::Duration::minutes(61),
            t0 + chrono::Duration::minutes(84),
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (gap.coverage, gap.offered, gap.suggested_limit_rps),
        (0.0, 0.0, None)
    );

    // The overview: whole blocks from `shadow_blocks`, the minutes before the first one from
    // `shadow_minutes`, the same sums as the minute rows.
    for since in [
        t0,
        t0 + chrono::Duration::minutes(4),
        t0 + chrono::Duration::minutes(7),
        t0 + chrono::Duration::minutes(90),
    ] {
        let got = store.shadow_summary(None, since, 10).await.unwrap();
        assert_eq!(got.len(), 1);
        let got = &got[0];
        let want: Vec<&MinuteRow> = rows.iter().filter(|r| r.minute >= since).collect();
        assert_eq!(got.reports, want.iter().map(|r| r.reports).sum::<i64>());
        let offered: f64 = want.iter().map(|r| r.offered).sum();
        let vd: f64 = want.iter().map(|r| r.shadow_dropped).sum();
        assert!((got.offered - offered).abs() < 1e-6, "{since}");
        assert!((got.shadow_dropped - vd).abs() < 1e-6, "{since}");
        let peak = want.iter().map(|r| r.max_offered).fold(0.0, f64::max);
        assert_eq!(got.peak_offered_rps, peak);
        let first = want.iter().map(|r| r.minute).min().unwrap();
        assert!(got.first_seen >= first && got.first_seen < first + chrono::Duration::minutes(1));
        assert_eq!(got.limit_rps, 110.0);
    }
}

#[tokio::test]
async fn sqlite_sql_figures_match_the_minutes() {
    let dir = tempfile::tempdir().unwrap();
    check_sql_figures(Store::connect("sqlite://rlc.db", dir.path()).await.unwrap()).await;
}

#[tokio::test]
async fn postgres_sql_figures_match_the_minutes() {
    let db = test_support::postgres::fresh_database().await.unwrap();
    check_sql_figures(Store::connect(&db.url, Path::new("/")).await.unwrap()).await;
}

/// The overview tiles its window with minutes, ten-minute blocks, bucket-wide hours and days
/// ([`Store::shadow_summary`]): over 28 hours across two UTC midnights, with windows starting
/// on a minute, a block, an hour, a day and before every report, two buckets (one enforced
/// part of the time) and a late report into a closed day, every figure equals the sums of
/// the minute rows; retention drops hour and day rows once all their minutes are gone.
async fn check_overview_tiles(store: Store) {
    let t0 = Utc.with_ymd_and_hms(2026, 11, 28, 22, 3, 0).unwrap();
    let end = t0 + chrono::Duration::hours(28);
    let mut seq = 0;
    let mut batch = Vec::new();
    let mut t = t0;
    while t < end {
        let m = (t - t0).num_minutes();
        for (bucket, zone) in [("gw", "eu"), ("gw", "us"), ("api", "global")] {
            seq += 1;
            let offered = 50.0 + ((m * 13 + seq) % 90) as f64;
            let mode = if bucket == "api" && (600..900).contains(&m) {
                "enforce"
            } else {
                "shadow"
            };
            batch.push(tick(seq, t.timestamp(), bucket, zone, mode, offered, 100.0));
        }
        t += chrono::Duration::minutes(7);
    }
    // In several batches, as polled pages arrive; the last one late, into the first day.
    for chunk in batch.chunks(97) {
        store.insert_reports(chunk, t0).await.unwrap();
    }
    let late = tick(
        seq + 1,
        (t0 + chrono::Duration::minutes(30)).timestamp(),
        "gw",
        "eu",
        "shadow",
        400.0,
        100.0,
    );
    assert_eq!(store.insert_reports(&[late], end).await.unwrap(), 1);

    let day = Utc.with_ymd_and_hms(2026, 11, 29, 0, 0, 0).unwrap();
    for since in [
        t0 - chrono::Duration::days(2),
        t0,
        t0 + chrono::Duration::minutes(4),
        t0 + chrono::Duration::minutes(7),
        t0 + chrono::Duration::minutes(57),
        day,
        day - chrono::Duration::minutes(50),
        day + chrono::Duration::minutes(13 * 60 + 37),
        day + chrono::Duration::hours(24),
        day + chrono::Duration::minutes(24 * 60 + 70),
    ] {
        let got = store.shadow_summary(None, since, 10).await.unwrap();
        assert_eq!(got.len(), 2, "{since}");
        for bucket in ["gw", "api"] {
            let g = got.iter().find(|b| b.bucket == bucket).unwrap();
            let want: Vec<MinuteRow> = store
                .bucket_minutes("payments", bucket, since, end + chrono::Duration::days(1))
                .await
                .unwrap();
            assert_eq!(
                g.reports,
                want.iter().map(|r| r.reports).sum::<i64>(),
                "{bucket} since {since}"
            );
            let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * a.abs().max(1.0);
            let sum = |f: fn(&MinuteRow) -> f64| want.iter().map(f).sum::<f64>();
            assert!(
                close(g.offered, sum(|r| r.offered)),
                "{bucket} since {since}"
            );
            assert!(
                close(g.admitted, sum(|r| r.admitted)),
                "{bucket} since {since}"
            );
            assert!(
                close(g.dropped, sum(|r| r.dropped)),
                "{bucket} since {since}"
            );
            assert!(
                close(g.shadow_dropped, sum(|r| r.shadow_dropped)),
                "{bucket} since {since}"
            );
            let max = |f: fn(&MinuteRow) -> f64| want.iter().map(f).fold(0.0, f64::max);
            assert_eq!(
                g.peak_offered_rps,
                max(|r| r.max_offered),
                "{bucket} since {since}"
            );
            assert_eq!(
                g.max_drop_ratio,
                max(|r| r.max_drop_ratio),
                "{bucket} since {since}"
            );
            assert_eq!(
                (g.first_seen, g.last_seen),
                (
                    // every tick is on a whole minute: the first tick is the first minute
                    want.iter().map(|r| r.minute).min().unwrap(),
                    want.iter().map(|r| r.last_t).max().unwrap()
                ),
                "{bucket} since {since}"
            );
        }
        assert_eq!(
            store.shadow_services(since, 10).await.unwrap(),
            ["payments"]
        );
    }
    // The late 400 rps report counts in windows from before it, not in later ones.
    let first_day = store
        .shadow_summary(None, t0 - chrono::Duration::days(2), 10)
        .await
        .unwrap();
    assert_eq!(
        first_day
            .iter()
            .find(|b| b.bucket == "gw")
            .unwrap()
            .peak_offered_rps,
        400.0
    );
    let later = store.shadow_summary(None, day, 10).await.unwrap();
    assert!(
        later
            .iter()
            .find(|b| b.bucket == "gw")
            .unwrap()
            .peak_offered_rps
            < 400.0
    );
    assert!(store
        .shadow_summary(None, end + chrono::Duration::hours(1), 10)
        .await
        .unwrap()
        .is_empty());
    assert!(store
        .shadow_services(end + chrono::Duration::hours(1), 10)
        .await
        .unwrap()
        .is_empty());

    // Retention at 2026-11-29 05:20: the first day (22:00–24:00) and its hours go, the second
    // day's row and the 05:00 hour stay (some of their minutes are kept).
    let gone = store
        .apply_retention(end, day + chrono::Duration::minutes(5 * 60 + 20))
        .await
        .unwrap();
    assert_eq!(gone.bucket_days_deleted, 2, "one day row per bucket");
    assert_eq!(
        gone.bucket_hours_deleted,
        2 * 7,
        "22:00 to 04:00 of both buckets"
    );
    assert_eq!(gone.blocks_deleted, 2 * (12 + 5 * 6 + 2));
}

#[tokio::test]
async fn sqlite_overview_tiles_match_the_minutes() {
    let dir = tempfile::tempdir().unwrap();
    check_overview_tiles(Store::connect("sqlite://rlc.db", dir.path()).await.unwrap()).await;
}

#[tokio::test]
async fn postgres_overview_tiles_match_the_minutes() {
    let db = test_support::postgres::fresh_database().await.unwrap();
    check_overview_tiles(Store::connect(&db.url, Path::new("/")).await.unwrap()).await;
}

#[test]
fn overview_windows_start_on_a_period_at_most_a_sixth_of_them() {
    let now = Utc.with_ymd_and_hms(2026, 11, 30, 13, 47, 31).unwrap();
    let at = |h, m| Utc.with_ymd_and_hms(2026, 11, 30, h, m, 0).unwrap();
    let (m, h, d) = (
        chrono::Duration::minutes,
        chrono::Duration::hours,
        chrono::Duration::days,
    );
    let cases = [
        ("15m", m(15), at(13, 32)),
        ("1h", h(1), at(12, 40)),
        ("6h", h(6), at(7, 0)),
        (
            "24h",
            h(24),
            Utc.with_ymd_and_hms(2026, 11, 29, 13, 0, 0).unwrap(),
        ),
        (
            "7d",
            d(7),
            Utc.with_ymd_and_hms(2026, 11, 23, 0, 0, 0).unwrap(),
        ),
        (
            "30d",
            d(30),
            Utc.with_ymd_and_hms(2026, 10, 31, 0, 0, 0).unwrap(),
        ),
    ];
    for (w, span, want) in cases {
        let got = window_start(now, span);
        assert_eq!(got, want, "{w}");
        assert!(got <= now - span && now - got <= span + span / 6, "{w}");
    }
}

/// A run recorded before migration 0007 (no pull request columns), with one quota change.
const OLD_RUN: &str =
    "INSERT INTO runs (trigger, started_at, finished_at, status, commit_sha, services, summary) \
     VALUES ('schedule', $1, $1, 'success', 'abc', '[]', 'old run') RETURNING id";
const OLD_QUOTA: &str = "INSERT INTO quota_history (run_id, recorded_at, service, bucket, change, limit_rps, commit_sha) \
     VALUES ($1, $2, 'payments', 'gw', 'added', 100, 'abc')";

/// Migration 0007 keeps the runs and quota changes recorded before it (without a pull
/// request), and from then on a run and the changes it proposed keep their pull request.
async fn check_pull_requests(store: Store, old_run: i64) {
    let old = store
        .run_by_id(old_run)
        .await
        .unwrap()
        .expect("old run kept");
    assert_eq!(old.summary, "old run");
    assert_eq!((old.pr_number, old.pull_request()), (None, None));

    let mut via_pr = run("schedule", "success", 20);
    via_pr.pr_number = Some(42);
    via_pr.pr_url = Some("https://forge.example/acme/config/pull/42".into());
    let mut q = quota(150.0, Some(100.0));
    q.pr_number = Some(42);
    q.pr_url = via_pr.pr_url.clone();
    let id = store.record_run(&via_pr, &[q.clone()]).await.unwrap();
    // A direct run in between: no pull request.
    let direct = store
        .record_run(
            &run("schedule", "success", 30),
            &[quota(160.0, Some(150.0))],
        )
        .await
        .unwrap();

    let pr = PullRequestRef {
        number: 42,
        url: Some("https://forge.example/acme/config/pull/42".into()),
    };
    let got = store.run_by_id(id).await.unwrap().unwrap();
    assert_eq!(got.pull_request(), Some(pr.clone()));
    assert_eq!(got, RunRecord { id, ..via_pr });
    assert_eq!(
        store
            .run_by_id(direct)
            .await
            .unwrap()
            .unwrap()
            .pull_request(),
        None
    );
    let recent = store.recent_runs(3).await.unwrap();
    assert_eq!(
        recent
            .iter()
            .map(|r| (r.id, r.pr_number))
            .collect::<Vec<_>>(),
        vec![(direct, None), (id, Some(42)), (old_run, None)]
    );
    // The bucket's history, newest first: the direct change, the one through PR #42, the old one.
    let changes = store.quota_changes("payments", "gw", 10).await.unwrap();
    assert_eq!(
        changes
            .iter()
            .map(|c| (c.run_id, c.limit_rps, c.pull_request.clone()))
            .collect::<Vec<_>>(),
        vec![
            (direct, Some(160.0), None),
            (id, Some(150.0), Some(pr)),
            (old_run, Some(100.0), None)
        ]
    );
    let hist = store.quota_history("payments", "gw").await.unwrap();
    assert_eq!(hist[1], q);
    assert_eq!((hist[0].pr_number, hist[2].pr_number), (None, None));
}

#[tokio::test]
async fn sqlite_migration_0007_keeps_runs_and_records_pull_requests() {
    let (dir, pool) = sqlite_before(7).await;
    let t = Utc.with_ymd_and_hms(2026, 11, 30, 2, 0, 0).unwrap();
    let (old,): (i64,) = sqlx::query_as(OLD_RUN)
        .bind(t)
        .fetch_one(&pool)
        .await
        .unwrap();
    sqlx::query(OLD_QUOTA)
        .bind(old)
        .bind(t)
        .execute(&pool)
        .await
        .unwrap();
    pool.close().await;
    let store = Store::connect("sqlite://rlc.db", dir.path()).await.unwrap();
    check_pull_requests(store, old).await;
}

#[tokio::test]
async fn postgres_migration_0007_keeps_runs_and_records_pull_requests() {
    let (db, pool) = postgres_before(7).await;
    let t = Utc.with_ymd_and_hms(2026, 11, 30, 2, 0, 0).unwrap();
    let (old,): (i64,) = sqlx::query_as(OLD_RUN)
        .bind(t)
        .fetch_one(&pool)
        .await
        .unwrap();
    sqlx::query(OLD_QUOTA)
        .bind(old)
        .bind(t)
        .execute(&pool)
        .await
        .unwrap();
    pool.close().await;
    check_pull_requests(Store::connect(&db.url, Path::new("/")).await.unwrap(), old).await;
}

/// Rollout rows and candidate counts: a rollout inserted once and updated in place over the
/// revision it was read at (a stale revision, or a second insert of its id, writes nothing),
/// listed by state and by bucket; the counts of one controller process (epoch) replaced by its
/// newer figures, those of another epoch kept beside them.
async fn check_rollouts(store: Store) {
    let row = |id: &str, state: &str, at: i64| RolloutRow {
        id: id.into(),
        service: "pay".into(),
        bucket: "charge".into(),
        state: state.into(),
        created_ms: at,
        updated_ms: at,
        doc: format!("{{\"id\":\"{id}\"}}"),
        rev: 0,
    };
    assert!(store.insert_rollout(&row("r1", "baking", 1)).await.unwrap());
    assert!(store.insert_rollout(&row("r2", "baking", 2)).await.unwrap());
    assert!(!store.insert_rollout(&row("r1", "done", 9)).await.unwrap());
    assert!(store
        .update_rollout(&row("r1", "aborted", 3))
        .await
        .unwrap());
    // Read at revision 0, written over revision 1: refused.
    assert!(!store.update_rollout(&row("r1", "done", 4)).await.unwrap());
    assert!(store
        .update_rollout(&RolloutRow {
            rev: 1,
            ..row("r1", "aborted", 3)
        })
        .await
        .unwrap());
    let baking = store.rollouts_in(&["baking"]).await.unwrap();
    assert_eq!(
        baking.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(),
        ["r2"]
    );
    let both = store.rollouts_in(&["baking", "aborted"]).await.unwrap();
    assert_eq!(both.len(), 2);
    assert_eq!(
        (both[0].id.as_str(), both[0].updated_ms, both[0].rev),
        ("r1", 3, 2)
    );
    let newest = store
        .recent_rollouts(Some(("pay", "charge")), 1)
        .await
        .unwrap();
    assert_eq!(newest[0].id, "r2");
    assert!(store
        .recent_rollouts(Some(("pay", "other")), 1)
        .await
        .unwrap()
        .is_empty());
    let count = |epoch: &str, offered: f64| CountRow {
        rollout_id: "r2".into(),
        region: "eu".into(),
        epoch: epoch.into(),
        seconds: offered / 150.0,
        offered,
        virtual_dropped: offered / 3.0,
        enforced_dropped: 0.0,
        updated_ms: 5,
    };
    store
        .record_candidate_counts(&[count("e1", 150.0)])
        .await
        .unwrap();
    store
        .record_candidate_counts(&[count("e1", 300.0), count("e2", 30.0)])
        .await
        .unwrap();
    let rows = store.candidate_counts("r2").await.unwrap();
    let offered: Vec<(String, f64)> = rows.iter().map(|r| (r.epoch.clone(), r.offered)).collect();
    assert_eq!(
        offered,
        [("e1".to_string(), 300.0), ("e2".to_string(), 30.0)]
    );
}

#[tokio::test]
async fn sqlite_rollouts() {
    let dir = tempfile::tempdir().unwrap();
    check_rollouts(Store::connect("sqlite://rlc.db", dir.path()).await.unwrap()).await;
}

#[tokio::test]
async fn postgres_rollouts() {
    let db = test_support::postgres::fresh_database().await.unwrap();
    check_rollouts(Store::connect(&db.url, Path::new("/")).await.unwrap()).await;
}

/// `store.rollout_retention`: finished rollouts last changed before the cutoff go with their
/// counts (done, superseded, aborted ones the base no longer holds, whose hold lifts); open
/// ones stay however old (baking, aborted while the base still holds the change), and so do
/// recent finished ones.
async fn check_rollout_retention(store: Store) {
    use crate::rollout::{self, Rollout, RolloutState};
    let day = 86_400_000;
    let now = Utc.with_ymd_and_hms(2026, 11, 30, 3, 0, 0).unwrap();
    let now_ms = now.timestamp_millis();
    let rollout = |id: &str, state: RolloutState, settled: bool, age_days: i64| Rollout {
        id: id.into(),
        service: "pay".into(),
        bucket: id.into(),
        old: Some(crate::gitops::tests::planned("pay", id, 3470.0).bucket),
        new: crate::gitops::tests::planned("pay", id, 100.0).bucket,
        change: "lowered 3470 -> 100 rps".into(),
        version: "abc".into(),
        settings: schema::RolloutSpec::default().resolved(),
        stages: vec![vec!["eu".into()]],
        stage: 0,
        stage_started_ms: Some(now_ms - age_days * day),
        stage_began_ms: Some(now_ms - age_days * day),
        state,
        reason: Some("why".into()),
        fingerprint: format!("fp-{id}"),
        created_ms: now_ms - age_days * day,
        updated_ms: now_ms - age_days * day,
        figures: Default::default(),
        revert: None,
        revert_pending: false,
        settled,
        fleet: None,
        rev: None,
    };
    let all = [
        rollout("done-old", RolloutState::Done, false, 100),
        rollout("superseded-old", RolloutState::Superseded, false, 100),
        rollout("aborted-settled-old", RolloutState::Aborted, true, 100),
        rollout("aborted-open-old", RolloutState::Aborted, false, 100),
        rollout("baking-old", RolloutState::Baking, false, 100),
        rollout("done-recent", RolloutState::Done, false, 10),
        rollout("aborted-settled-recent", RolloutState::Aborted, true, 10),
    ];
    for r in &all {
        assert!(store.insert_rollout(&r.row()).await.unwrap());
        store
            .record_candidate_counts(&[CountRow {
                rollout_id: r.id.clone(),
                region: "eu".into(),
                epoch: "e1".into(),
                seconds: 3600.0,
                offered: 1e6,
                virtual_dropped: 0.0,
                enforced_dropped: 0.0,
                updated_ms: r.updated_ms,
            }])
            .await
            .unwrap();
    }
    let held = |a: &[rlc_plan::rollout::Aborted]| {
        let mut v: Vec<String> = a.iter().map(|a| a.bucket.clone()).collect();
        v.sort();
        v
    };
    assert_eq!(
        held(&rollout::aborted_changes(&store).await.unwrap()),
        [
            "aborted-open-old",
            "aborted-settled-old",
            "aborted-settled-recent"
        ]
    );
    let gone = rollout::prune(&store, now - chrono::Duration::days(90))
        .await
        .unwrap();
    assert_eq!(gone, 3);
    let mut left: Vec<String> = store
        .recent_rollouts(None, 100)
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.id)
        .collect();
    left.sort();
    assert_eq!(
        left,
        [
            "aborted-open-old",
            "aborted-settled-recent",
            "baking-old",
            "done-recent"
        ]
    );
    for r in &all {
        let counts = store.candidate_counts(&r.id).await.unwrap().len();
        assert_eq!(counts, usize::from(left.contains(&r.id)), "{}", r.id);
    }
    assert_eq!(
        held(&rollout::aborted_changes(&store).await.unwrap()),
        ["aborted-open-old", "aborted-settled-recent"]
    );
    // Nothing more to delete.
    assert_eq!(
        rollout::prune(&store, now - chrono::Duration::days(90))
            .await
            .unwrap(),
        0
    );
}

#[tokio::test]
async fn sqlite_rollout_retention() {
    let dir = tempfile::tempdir().unwrap();
    check_rollout_retention(Store::connect("sqlite://rlc.db", dir.path()).await.unwrap()).await;
}

#[tokio::test]
async fn postgres_rollout_retention() {
    let db = test_support::postgres::fresh_database().await.unwrap();
    check_rollout_retention(Store::connect(&db.url, Path::new("/")).await.unwrap()).await;
}

/// Two processes on one store (`rlc run --once` beside `rlc serve`), each working on the
/// rollouts as it read them: a write made on a copy read before another process's write is
/// refused, never overwriting it. Last writer wins would bring a superseded rollout back to
/// baking (the daemon's judge writing new figures after the run superseded it), or an aborted
/// one (the run recording the stage start after the daemon aborted it).
async fn check_rollout_writers(store: Store) {
    use crate::rollout::{self, BaseInput, RolloutState};
    use grl_wire::ConfigDoc;
    let policies = schema::parse_str::<schema::PoliciesFile>(
        Path::new("rlc/policies.yaml"),
        "default:\n  policy: peak\nrollout:\n  bake: 1h\n  max_bake: 2h\n  min_offered: 1000\n",
    )
    .unwrap()
    .value;
    let doc = |limit: f64| ConfigDoc {
        version: format!("v{limit}"),
        services: vec![schema::BucketFile {
            criticality: Default::default(),
            service: "pay".into(),
            buckets: vec![crate::gitops::tests::planned("pay", "charge", limit).bucket],
        }],
        candidates: vec![],
    };
    let regions = ["eu".to_string()];
    let t0 = Utc.with_ymd_and_hms(2026, 11, 30, 3, 0, 0).unwrap();
    let account = |limit: f64, at| {
        let d = doc(limit);
        let store = store.clone();
        let policies = policies.clone();
        let regions = regions.clone();
        async move {
            let input = BaseInput {
                doc: &d,
                policies: Some(&policies),
                inputs: "inputs",
            };
            rollout::account(&store, &regions, &input, at).await
        }
    };
    assert!(account(3470.0, t0).await.unwrap().is_empty());
    let mut open = account(100.0, t0).await.unwrap();
    assert_eq!(open.len(), 1);
    rollout::reached(&store, &mut open, "eu", t0).await.unwrap();
    let first = open[0].id.clone();

    // The daemon reads the rollouts; meanwhile a run accounts a newer change of the bucket.
    let mut daemon = rollout::open(&store).await.unwrap();
    let t1 = t0 + chrono::Duration::seconds(10);
    let after = account(90.0, t1).await.unwrap();
    assert_eq!(after.len(), 1);
    assert_ne!(after[0].id, first);
    // The daemon judges its copy on new counts (too few yet: keeps baking, figures change).
    store
        .record_candidate_counts(&[CountRow {
            rollout_id: first.clone(),
            region: "eu".into(),
            epoch: "e1".into(),
            seconds: 10.0,
            offered: 100.0,
            virtual_dropped: 0.0,
            enforced_dropped: 0.0,
            updated_ms: t1.timestamp_millis(),
        }])
        .await
        .unwrap();
    let _ = rollout::judge(&store, &mut daemon, t1).await;
    let state = |id: String| {
        let store = store.clone();
        async move {
            store
                .recent_rollouts(Some(("pay", "charge")), 10)
                .await
                .unwrap()
                .into_iter()
                .find(|r| r.id == id)
                .map(|r| r.state)
                .unwrap()
        }
    };
    assert_eq!(state(first.clone()).await, "superseded");

    // A run reads the pending rollout of the newer change; meanwhile the daemon aborts it at
    // the stage's deadline (its candidate never reached a controller).
    let second = after[0].id.clone();
    let mut run = rollout::open(&store).await.unwrap();
    let mut daemon = rollout::open(&store).await.unwrap();
    let late = t1 + chrono::Duration::hours(3);
    rollout::judge(&store, &mut daemon, late).await.unwrap();
    assert_eq!(state(second.clone()).await, "aborted");
    // The run's push then reaches the controller and records the stage start on its copy.
    let _ = rollout::reached(&store, &mut run, "eu", late).await;
    assert_eq!(state(second.clone()).await, "aborted");
    let open = rollout::open(&store).await.unwrap();
    assert_eq!(open.len(), 1);
    assert_eq!(open[0].state, RolloutState::Aborted);
    assert!(open[0].reason.as_deref().unwrap().starts_with("never ran"));
}

#[tokio::test]
async fn sqlite_rollout_writers() {
    let dir = tempfile::tempdir().unwrap();
    check_rollout_writers(Store::connect("sqlite://rlc.db", dir.path()).await.unwrap()).await;
}

#[tokio::test]
async fn postgres_rollout_writers() {
    let db = test_support::postgres::fresh_database().await.unwrap();
    check_rollout_writers(Store::connect(&db.url, Path::new("/")).await.unwrap()).await;
}

/// A region stays unread from its first failed read until a good one, with the last error;
/// regions no longer configured are forgotten; and promotion gets no figures meanwhile.
async fn check_region_reads(store: Store) {
    let t0 = Utc.with_ymd_and_hms(2026, 12, 1, 10, 0, 0).unwrap();
    let regions = vec!["a".to_string(), "b".to_string()];
    store
        .record_region_read("a", t0, None, Some(&regions))
        .await
        .unwrap();
    store
        .record_region_read("b", t0, Some("connection refused"), Some(&regions))
        .await
        .unwrap();
    let later = t0 + chrono::Duration::seconds(30);
    store
        .record_region_read("b", later, Some("503 Service Unavailable"), Some(&regions))
        .await
        .unwrap();
    let unread = store.unread_regions().await.unwrap();
    assert_eq!(unread.len(), 1, "{unread:?}");
    assert_eq!(unread[0].region, "b");
    assert_eq!(unread[0].since, t0, "unread since the first failed read");
    assert_eq!(unread[0].error, "503 Service Unavailable");
    let q = crate::shadow::ShadowQuery {
        buckets: vec![("payments".into(), "gw".into())],
        window_start: t0 - chrono::Duration::days(7),
        now: later,
    };
    let e = crate::shadow::store_stats(&store, &q).await.unwrap_err();
    assert!(
        e.to_string()
            .contains("region b's controller cannot be read since 2026-12-01 10:00:00 UTC"),
        "{e}"
    );
    // A good read clears it; a region taken out of rlc.yaml is forgotten.
    store
        .record_region_read("b", later, None, Some(&regions))
        .await
        .unwrap();
    assert!(store.unread_regions().await.unwrap().is_empty());
    store
        .record_region_read("c", later, Some("timeout"), Some(&["c".to_string()]))
        .await
        .unwrap();
    let unread = store.unread_regions().await.unwrap();
    assert_eq!(unread.len(), 1);
    assert_eq!(unread[0].region, "c");
    store
        .record_region_read("c", later, None, Some(&["c".to_string()]))
        .await
        .unwrap();
    assert!(crate::shadow::store_stats(&store, &q).await.is_ok());
}

#[tokio::test]
async fn sqlite_region_reads() {
    let dir = tempfile::tempdir().unwrap();
    check_region_reads(Store::connect("sqlite://rlc.db", dir.path()).await.unwrap()).await;
}

#[tokio::test]
async fn postgres_region_reads() {
    let db = test_support::postgres::fresh_database().await.unwrap();
    check_region_reads(Store::connect(&db.url, Path::new("/")).await.unwrap()).await;
}

/// An override's author, action and expiry are kept; one its controller stops listing before
/// its expiry ends at that poll (not minutes later), and only for its own region.
async fn check_override_lifetimes(store: Store) {
    let t0 = Utc.with_ymd_and_hms(2026, 12, 1, 10, 0, 0).unwrap();
    let list = |id: &str, limit: Option<f64>| -> crate::push::OverrideList {
        serde_json::from_value(serde_json::json!({"overrides": [{
            "id": id, "reason": "INC-9", "created_at": t0.timestamp(),
            "expires_at": t0.timestamp() + 3600, "who": "alice", "limit_rps": limit,
            "drop_ratio": if limit.is_none() { Some(0.9) } else { None },
            "affects": [{"service": "pay", "bucket": "web", "created": false}]
        }]}))
        .unwrap()
    };
    let none = crate::push::OverrideList { overrides: vec![] };
    let sec = |n: i64| t0 + chrono::Duration::seconds(n);
    store
        .record_overrides("a", &list("ovr-1", Some(50.0)), sec(10))
        .await
        .unwrap();
    store
        .record_overrides("b", &list("ovr-2", None), sec(10))
        .await
        .unwrap();
    let w = store.override_windows(t0).await.unwrap();
    let web = &w[&("pay".to_string(), "web".to_string())];
    assert_eq!(web.len(), 2, "{web:?}");
    let a = web.iter().find(|o| o.id == "ovr-1").unwrap();
    assert_eq!(
        (a.who.as_str(), a.action.as_str(), a.region.as_str()),
        ("alice", "limit 50 rps", "a")
    );
    assert_eq!(a.expires_at, sec(3600));
    let b = web.iter().find(|o| o.id == "ovr-2").unwrap();
    assert_eq!(b.action, "drop 90 %");
    // Region a's controller no longer lists ovr-1 at 70 s: it ended then. Region b's poll
    // without ovr-1 does not touch it, and ovr-2 stays.
    store.record_overrides("a", &none, sec(70)).await.unwrap();
    store
        .record_overrides("b", &list("ovr-2", None), sec(70))
        .await
        .unwrap();
    let w = store.override_windows(t0).await.unwrap();
    let web = &w[&("pay".to_string(), "web".to_string())];
    assert_eq!(web.iter().find(|o| o.id == "ovr-1").unwrap().to, sec(70));
    assert_eq!(
        web.iter().find(|o| o.id == "ovr-2").unwrap().to,
        sec(70 + 300)
    );
}

#[tokio::test]
async fn sqlite_override_lifetimes() {
    let dir = tempfile::tempdir().unwrap();
    check_override_lifetimes(Store::connect("sqlite://rlc.db", dir.path()).await.unwrap()).await;
}

#[tokio::test]
async fn postgres_override_lifetimes() {
    let db = test_support::postgres::fresh_database().await.unwrap();
    check_override_lifetimes(Store::connect(&db.url, Path::new("/")).await.unwrap()).await;
}
