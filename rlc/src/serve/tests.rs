use std::future::IntoFuture;

use axum::extract::Query;
use chrono::{TimeZone, Utc};

use super::*;
use crate::cycle::tests::config;
use crate::cycle::RunStatus;
use crate::gitops::tests::{plan, planned, seeded_remote};
use crate::plan::Plan;
use crate::push::tests::{app as controller_app, Fake};

fn next(expr: &str, after: chrono::DateTime<Utc>) -> chrono::DateTime<Utc> {
    parse_schedule(expr).unwrap().after(&after).next().unwrap()
}

#[test]
fn five_field_cron_expressions() {
    // 2026-11-28 is a Saturday.
    let sat = Utc.with_ymd_and_hms(2026, 11, 28, 12, 0, 0).unwrap();
    let at = |d, h, m| Utc.with_ymd_and_hms(2026, 11, d, h, m, 0).unwrap();
    assert_eq!(next("0 3 * * *", sat), at(29, 3, 0));
    assert_eq!(next("*/15 * * * *", sat), at(28, 12, 15));
    assert_eq!(next("0 9 * * 1-5", sat), at(30, 9, 0), "Monday");
    assert_eq!(next("0 9 * * 0", sat), at(29, 9, 0), "Sunday is 0");
    assert_eq!(next("0 9 * * 7", sat), at(29, 9, 0), "and 7");
    assert_eq!(next("0 9 * * 5-7", sat), at(29, 9, 0), "Friday to Sunday");
    assert_eq!(next("30 1 * * MON", sat), at(30, 1, 30));
    assert!(parse_schedule("0 0 3 * * *")
        .unwrap_err()
        .contains("5 fields"));
    assert!(parse_schedule("61 * * * *").is_err());
}

async fn reports(
    Query(q): Query<std::collections::HashMap<String, String>>,
) -> Json<serde_json::Value> {
    let row = |seq: i64, mode: &str| {
        json!({"seq": seq, "t": 10, "service": "payments", "bucket": "gw", "caller": "gw",
               "procedure": null, "mode": mode, "scope_key": "global", "offered": 150.0,
               "admitted": 150.0, "dropped": 0.0, "shadow_dropped": 50.0, "limit_rps": 100.0,
               "drop_ratio": 0.33})
    };
    match q.get("after").map(String::as_str) {
        None => Json(json!({"next": "2", "reports": [row(1, "shadow"), row(2, "enforce")]})),
        Some(_) => Json(json!({"next": "2", "reports": []})),
    }
}

#[tokio::test]
async fn daemon_runs_on_request_and_on_input_change_and_shuts_down() {
    let remote = seeded_remote();
    let fake = Fake::default();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let ctl_url = format!("http://{}", l.local_addr().unwrap());
    let ctl_app = controller_app(fake.clone()).route("/v1/reports", axum::routing::get(reports));
    tokio::spawn(axum::serve(l, ctl_app).into_future());

    let cfg = config(&remote, &ctl_url, "");
    let base = remote.scratch("");
    let the_plan: Arc<Mutex<Plan>> =
        Arc::new(Mutex::new(plan(vec![planned("payments", "gw", 250.0)])));
    let p = the_plan.clone();
    let planner: Planner = Arc::new(move |input: crate::cycle::PlanInput| {
        let p = p.lock().unwrap().clone();
        Box::pin(async move {
            // The planner sees the synced working copy.
            assert!(input.repo_dir.join("rlc/policies.yaml").exists());
            Ok(p)
        })
    });
    let (tx, rx) = mpsc::channel(1);
    let state = AppState::new(Some("api-token".into()), tx);
    let (stop_tx, stop_rx) = watch::channel(false);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let opts = ServeOptions {
        poll: Duration::from_millis(100),
        tls: None,
    };
    let daemon = {
        let state = state.clone();
        let base = base.clone();
        tokio::spawn(async move {
            serve_on(listener, cfg, &base, planner, opts, state, rx, stop_rx).await
        })
    };

    let http = reqwest::Client::new();
    assert_eq!(
        http.get(format!("{url}/healthz"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    let r = http.post(format!("{url}/v1/runs")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let r = http
        .post(format!("{url}/v1/runs"))
        .bearer_auth("nope")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    // Until the scheduler has taken the lead, manual runs get 409: retry (bounded).
    let mut status = 0;
    for _ in 0..200 {
        let r = http
            .post(format!("{url}/v1/runs"))
            .bearer_auth("api-token")
            .send()
            .await
            .unwrap();
        status = r.status().as_u16();
        if status != 409 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(status, 202);
    let out = state.wait_runs(1).await;
    assert_eq!(out.trigger, "api");
    assert_eq!(out.status, RunStatus::Success, "{out}");
    let head = remote.head("main").unwrap();
    assert_eq!(out.commit.as_deref(), Some(head.as_str()));
    assert_eq!(fake.version.lock().unwrap().as_deref(), Some(head.as_str()));

    // A person edits rlc/*.yaml: the daemon notices and runs.
    *the_plan.lock().unwrap() = plan(vec![planned("payments", "gw", 300.0)]);
    let edit = remote
        .human_commit(
            "main",
            &[("rlc/contracts.yaml", "contracts: []\n")],
            "add contracts file",
        )
        .unwrap();
    let out = state.wait_runs(2).await;
    assert_eq!(out.trigger, "inputs-changed", "{out}");
    assert_eq!(out.status, RunStatus::Success, "{out}");
    let head = remote.head("main").unwrap();
    assert_eq!(
        test_support::git::git(&remote.bare_path(), &["rev-parse", &format!("{head}^")])
            .unwrap()
            .trim(),
        edit
    );
    assert_eq!(fake.version.lock().unwrap().as_deref(), Some(head.as_str()));

    // Shadow reports were stored (enforce ones are not).
    let store = crate::store::Store::connect("sqlite://rlc.db", &base)
        .await
        .unwrap();
    let stored = store.reports(None, 10).await.unwrap();
    assert_eq!(
        stored
            .iter()
            .map(|r| (r.seq, r.mode.as_str()))
            .collect::<Vec<_>>(),
        vec![(1, "shadow")]
    );
    // The daemon hands its store to the read-only dashboard.
    let v: serde_json::Value = http
        .get(format!("{url}/v1/shadow?window=1h"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["buckets"][0]["bucket"], "gw", "{v}");
    assert_eq!(v["buckets"][0]["virtual_drop_share"], 50.0 / 150.0, "{v}");
    let page = http.get(format!("{url}/")).send().await.unwrap();
    assert_eq!(page.status(), 200);
    assert!(page.text().await.unwrap().contains(r#"data-bucket="gw""#));

    let m = http
        .get(format!("{url}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(m.contains("rlc_runs_total{status=\"success\"} 2"), "{m}");
    assert!(m.contains("rlc_leader 1"), "{m}");
    assert!(m.contains("rlc_shadow_reports_stored_total 1"), "{m}");

    stop_tx.send(true).unwrap();
    daemon.await.unwrap().unwrap();
}

/// A Prometheus that accepts connections and never answers: a pull holds its request.
fn hung_prometheus() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for s in listener.incoming().take(16) {
            held.push(s);
        }
    });
    url
}

#[tokio::test]
async fn quota_api_answers_429_with_retry_after_when_every_slot_is_taken() {
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "history:\n  prometheus:\n    url: {}\n    query: up\n    timeout: 5s\n    retries: 1\nconfig_repo:\n  path: wc\n",
        hung_prometheus()
    );
    let cfg: DaemonConfig = schema::parse_str(Path::new("rlc.yaml"), &text)
        .unwrap()
        .value;
    let cache = Arc::new(crate::snapshot::HistoryCache::new(cfg.clone(), dir.path()));
    let q = quotas::Quotas::new(cfg, dir.path(), cache.clone(), 1).unwrap();
    let state = AppState::new(None, mpsc::channel(1).0);
    state.set_quotas(Arc::new(q));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(axum::serve(l, app(state)).into_future());
    let c = reqwest::Client::new();
    // The one slot is taken by a refresh waiting for the hung Prometheus.
    let busy = tokio::spawn({
        let (c, url) = (c.clone(), url.clone());
        async move { c.get(format!("{url}/v1/quotas?refresh=true")).send().await }
    });
    for _ in 0..100 {
        if cache.pulls() == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(cache.pulls(), 1, "the first request is pulling");
    for path in ["/v1/quotas", "/v1/quotas/pay", "/v1/quotas/pay/gw/history"] {
        let r = c.get(format!("{url}{path}")).send().await.unwrap();
        assert_eq!(r.status(), 429, "{path}");
        assert_eq!(r.headers()["retry-after"], "1");
        assert_eq!(r.headers()["content-type"], "application/problem+json");
        let body: serde_json::Value = r.json().await.unwrap();
        assert_eq!(body["status"], 429);
    }
    busy.abort();
}
