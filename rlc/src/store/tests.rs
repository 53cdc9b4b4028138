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
    let id2 = store.record_run(&failed, &[]).await.unwrap();
    assert!(id2 > id1);
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
