//! The same store tests on SQLite and on a real throwaway Postgres.

use chrono::TimeZone;

use super::*;

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
    }
}

fn quota(limit: f64, prev: Option<f64>) -> QuotaRecord {
    QuotaRecord {
        service: "payments".into(),
        bucket: "gw".into(),
        change: if prev.is_some() { "raised" } else { "added" }.into(),
        limit_rps: Some(limit),
        previous_limit_rps: prev,
        mode: Some("enforce".into()),
        policy: Some("peak".into()),
        commit_sha: Some("abc".into()),
        evidence: r#"{"peak_rps":80}"#.into(),
        recorded_at: Utc.with_ymd_and_hms(2026, 11, 30, 3, 0, 30).unwrap(),
    }
}

fn report(seq: i64, mode: &str) -> Report {
    serde_json::from_value(serde_json::json!({
        "seq": seq, "t": 12.5, "service": "payments", "bucket": "gw", "caller": "gw",
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
    assert_eq!(stored[0].t, "12.5");
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
fn rates(seq: i64, service: &str, bucket: &str, scope: &str, offered: f64, limit: f64) -> Report {
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

async fn check_shadow_summary(store: Store) {
    let at = |h, m| Utc.with_ymd_and_hms(2026, 11, 30, h, m, 0).unwrap();
    // Before the window: must not count.
    store
        .insert_reports(&[rates(1, "payments", "gw", "", 1000.0, 100.0)], at(1, 0))
        .await
        .unwrap();
    store
        .insert_reports(
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
        .await
        .unwrap();
    store
        .insert_reports(&[rates(4, "payments", "quiet", "", 70.0, 100.0)], at(2, 45))
        .await
        .unwrap();

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
    assert_eq!(store.shadow_summary(None, since, 2).await.unwrap().len(), 2);
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

/// The decrease guard's query: only `lowered` records at or after `since` count.
async fn check_lowered_since(store: Store) {
    store
        .record_run(&run("once", "success", 0), &[quota(150.0, None)])
        .await
        .unwrap();
    let mut cut = quota(120.0, Some(150.0));
    cut.change = "lowered".into();
    cut.recorded_at = Utc.with_ymd_and_hms(2026, 11, 30, 4, 0, 0).unwrap();
    store
        .record_run(&run("api", "success", 20), &[cut.clone()])
        .await
        .unwrap();
    let before = Utc.with_ymd_and_hms(2026, 11, 30, 3, 30, 0).unwrap();
    let after = Utc.with_ymd_and_hms(2026, 11, 30, 4, 30, 0).unwrap();
    assert_eq!(
        store.lowered_since("payments", "gw", before).await.unwrap(),
        Some(cut.recorded_at)
    );
    assert_eq!(
        store.lowered_since("payments", "gw", after).await.unwrap(),
        None
    );
    assert_eq!(
        store
            .lowered_since("payments", "other", before)
            .await
            .unwrap(),
        None
    );
}

#[tokio::test]
async fn sqlite_lowered_since() {
    let dir = tempfile::tempdir().unwrap();
    check_lowered_since(Store::connect("sqlite://rlc.db", dir.path()).await.unwrap()).await;
}

#[tokio::test]
async fn postgres_lowered_since() {
    let db = test_support::postgres::fresh_database().await.unwrap();
    check_lowered_since(Store::connect(&db.url, Path::new("/")).await.unwrap()).await;
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
