// End-to-end scenarios read top to bottom; the size bound (clippy.toml) is for code outside
// tests.
#![allow(clippy::too_many_lines)]

use std::future::IntoFuture;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::extract::Query;
use axum::Json;
use chrono::{TimeZone, Utc};
use serde_json::json;

use super::*;
use crate::cycle::tests::config;
use crate::cycle::RunStatus;
use crate::gitops::tests::{plan, planned, seeded_remote};
use crate::push::tests::{app as controller_app, Fake};
use grl_wire::ReportRow;
use rlc_plan::plan::Plan;

fn next(expr: &str, after: chrono::DateTime<Utc>) -> chrono::DateTime<Utc> {
    schema::parse_schedule(expr)
        .unwrap()
        .after(&after)
        .next()
        .unwrap()
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
    assert!(schema::parse_schedule("0 0 3 * * *")
        .unwrap_err()
        .to_string()
        .contains("5 fields"));
    assert!(schema::parse_schedule("61 * * * *").is_err());
}

async fn reports(
    Query(q): Query<std::collections::HashMap<String, String>>,
) -> Json<serde_json::Value> {
    let t = chrono::Utc::now().timestamp();
    let row = |seq: i64, bucket: &str, mode: &str, dropped: f64, shadow: f64| {
        json!({"seq": seq, "t": t, "service": "payments", "bucket": bucket, "caller": "gw",
               "procedure": null, "mode": mode, "scope_key": "global", "offered": 150.0,
               "admitted": 150.0 - dropped, "dropped": dropped, "shadow_dropped": shadow,
               "limit_rps": 100.0, "drop_ratio": 0.33})
    };
    match q.get("after").map(String::as_str) {
        None => Json(json!({"next": "2", "reports": [
            row(1, "gw", "shadow", 0.0, 50.0),
            row(2, "api", "enforce", 50.0, 0.0),
        ]})),
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
    let state = AppState::daemon(&cfg, &base, Some("api-token".into()), tx).unwrap();
    let (stop_tx, stop_rx) = watch::channel(false);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let opts = ServeOptions::new(Duration::from_millis(100));
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
    let mut answer = None;
    for _ in 0..200 {
        let r = http
            .post(format!("{url}/v1/runs"))
            .bearer_auth("api-token")
            .send()
            .await
            .unwrap();
        if r.status() != 409 {
            answer = Some(r);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let r = answer.expect("the daemon took the lead");
    assert_eq!(r.status(), 202);
    let location = r.headers()["location"].to_str().unwrap().to_string();
    let queued: serde_json::Value = r.json().await.unwrap();
    let run_uid = queued["run_uid"].as_str().unwrap().to_string();
    assert_eq!(run_uid.len(), 32, "{queued}");
    assert_eq!(location, format!("/v1/runs/{run_uid}"));
    assert_eq!(queued["location"], location.as_str());
    assert_eq!(queued["queued"], true);
    let out = state.wait_runs(1).await;
    assert_eq!(out.trigger, "api");
    assert_eq!(out.status, RunStatus::Success, "{out}");
    // The run the POST queued is the one that ran, and its Location says so (from memory
    // and, by its store id, from the store).
    assert_eq!(out.run_uid, run_uid);
    let v: serde_json::Value = http
        .get(format!("{url}{location}"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["state"], "finished", "{v}");
    assert_eq!(v["status"], "success", "{v}");
    assert_eq!(
        v["outcome"]["commit"],
        out.commit.as_deref().unwrap(),
        "{v}"
    );
    let store_id = v["id"].as_i64().expect("recorded");
    assert_eq!(Some(store_id), out.run_id);
    assert_eq!(v["record"]["run_uid"], run_uid.as_str(), "{v}");
    let by_id: serde_json::Value = http
        .get(format!("{url}/v1/runs/{store_id}"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(by_id["run_uid"], run_uid.as_str(), "{by_id}");
    let r = http
        .get(format!("{url}/v1/runs/ffffffffffffffffffffffffffffffff"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(r.headers()["content-type"], "application/problem+json");
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

    // Reports of every mode were stored (the dashboard shows enforced buckets' real drops).
    let store = crate::store::Store::connect("sqlite://rlc.db", &base)
        .await
        .unwrap();
    let stored = store.reports(None, 10).await.unwrap();
    assert_eq!(
        stored
            .iter()
            .map(|r| (r.seq, r.mode.as_str()))
            .collect::<Vec<_>>(),
        vec![(1, "shadow"), (2, "enforce")]
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
    assert!(m.contains("rlc_shadow_reports_stored_total 2"), "{m}");
    assert!(m.contains("rlc_shadow_reports_buffered 0\n"), "{m}");
    assert!(m.contains("rlc_controller_in_sync 1\n"), "{m}");
    let last = out.finished_at.timestamp();
    assert!(
        m.contains(&format!(
            "rlc_last_successful_run_timestamp_seconds {last}\n"
        )),
        "{m}"
    );
    assert!(m.contains("rlc_run_duration_seconds_count 2\n"), "{m}");
    assert!(
        m.contains("# TYPE rlc_history_pull_duration_seconds histogram"),
        "{m}"
    );
    assert!(
        m.contains("rlc_build_info{component=\"serve\",version="),
        "{m}"
    );
    assert!(m.ends_with("# EOF\n"), "{m}");

    stop_tx.send(true).unwrap();
    daemon.await.unwrap().unwrap();

    // A restarted daemon reads its last successful run from the store: the metric does not
    // start at 0 (the shipped alert on it would fire after every deploy).
    let (tx, rx) = mpsc::channel(1);
    let cfg = config(&remote, &ctl_url, "");
    let state = AppState::daemon(&cfg, &base, Some("api-token".into()), tx).unwrap();
    let (stop_tx, stop_rx) = watch::channel(false);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let idle: Planner = Arc::new(|_| Box::pin(async { Ok(Plan::default()) }));
    let daemon = {
        let base = base.clone();
        tokio::spawn(async move {
            serve_on(
                listener,
                cfg,
                &base,
                idle,
                ServeOptions::new(Duration::from_millis(100)),
                state,
                rx,
                stop_rx,
            )
            .await
        })
    };
    let want = format!("rlc_last_successful_run_timestamp_seconds {last}\n");
    let mut seen = String::new();
    for _ in 0..200 {
        if let Ok(r) = http.get(format!("{url}/metrics")).send().await {
            seen = r.text().await.unwrap_or_default();
            if seen.contains(&want) {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(seen.contains(&want), "{seen}");
    stop_tx.send(true).unwrap();
    daemon.await.unwrap().unwrap();
}

/// Reports wait in the buffer while the store fails; the stored cursor only moves past what
/// was stored, and a store that is back takes the whole backlog.
#[tokio::test]
async fn report_buffer_keeps_reports_until_stored() {
    let row = |seq: i64| -> ReportRow {
        serde_json::from_value(json!({
            "seq": seq, "t": 1_796_000_000 + seq, "service": "payments", "bucket": "gw",
            "caller": null, "procedure": null, "mode": "shadow", "scope_key": "eu",
            "offered": 10.0, "admitted": 10.0, "dropped": 0.0, "shadow_dropped": 0.0,
            "limit_rps": 20.0, "drop_ratio": 0.0
        }))
        .unwrap()
    };
    let dir = tempfile::tempdir().unwrap();
    let store = Store::connect("sqlite://rlc.db", dir.path()).await.unwrap();
    let mut buf = super::reports::ReportBuffer::default();
    buf.push(vec![row(1), row(2)], Some("2".into()));
    buf.push(vec![row(3)], Some("3".into()));
    assert_eq!(buf.rows, 3);

    // The store's file is gone: nothing is stored, nothing is dropped, the cursor stays.
    std::fs::rename(dir.path().join("rlc.db"), dir.path().join("moved.db")).unwrap();
    let (stored, res) = buf.flush(&store, Duration::from_secs(5)).await;
    assert_eq!(stored, 0);
    assert!(res.is_err());
    assert_eq!((buf.rows, buf.pages.len()), (3, 2));

    // Back: the backlog is stored in one batch and the cursor moves past it.
    std::fs::rename(dir.path().join("moved.db"), dir.path().join("rlc.db")).unwrap();
    let (stored, res) = buf.flush(&store, Duration::from_secs(5)).await;
    res.unwrap();
    assert_eq!(stored, 3);
    assert_eq!((buf.rows, buf.pages.len()), (0, 0));
    assert_eq!(
        store.cursor(REPORT_CURSOR).await.unwrap().as_deref(),
        Some("3")
    );
    assert_eq!(store.reports(None, 10).await.unwrap().len(), 3);
}

/// `POST /v1/runs` answers the id of the run it queued; `GET /v1/runs/{id}` follows it from
/// queued to running to finished, and a request while one is queued joins that one.
#[tokio::test]
async fn run_ids_follow_a_run_from_queued_to_finished() {
    let remote = seeded_remote();
    let fake = Fake::default();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let ctl_url = format!("http://{}", l.local_addr().unwrap());
    let ctl_app = controller_app(fake.clone()).route("/v1/reports", axum::routing::get(reports));
    tokio::spawn(axum::serve(l, ctl_app).into_future());
    let cfg = config(&remote, &ctl_url, "");
    let base = remote.scratch("");
    // Each planner call waits for one permit: the test decides when a run may finish.
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let g = gate.clone();
    let planner: Planner = Arc::new(move |_input: crate::cycle::PlanInput| {
        let g = g.clone();
        Box::pin(async move {
            g.acquire().await.unwrap().forget();
            Ok(plan(vec![planned("payments", "gw", 250.0)]))
        })
    });
    let (tx, rx) = mpsc::channel(1);
    let state = AppState::daemon(&cfg, &base, Some("api-token".into()), tx).unwrap();
    let (stop_tx, stop_rx) = watch::channel(false);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let opts = ServeOptions::new(Duration::from_secs(3600));
    let daemon = {
        let state = state.clone();
        tokio::spawn(async move {
            serve_on(listener, cfg, &base, planner, opts, state, rx, stop_rx).await
        })
    };
    let http = reqwest::Client::new();
    let post = || async {
        for _ in 0..200 {
            let r = http
                .post(format!("{url}/v1/runs"))
                .bearer_auth("api-token")
                .send()
                .await
                .unwrap();
            if r.status() != 409 {
                assert_eq!(r.status(), 202);
                return r.json::<serde_json::Value>().await.unwrap();
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("the daemon never took the lead");
    };
    let state_of = |uid: String| {
        let http = http.clone();
        let url = url.clone();
        async move {
            http.get(format!("{url}/v1/runs/{uid}"))
                .send()
                .await
                .unwrap()
                .json::<serde_json::Value>()
                .await
                .unwrap()
        }
    };
    let wait_state = |uid: String, want: &'static str| async move {
        for _ in 0..500 {
            let v = state_of(uid.clone()).await;
            if v["state"] == want {
                return v;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("run {uid} never {want}");
    };

    let first = post().await;
    let a = first["run_uid"].as_str().unwrap().to_string();
    assert_eq!(first.get("coalesced"), None, "{first}");
    let v = wait_state(a.clone(), "running").await;
    assert_eq!(v["trigger"], "api", "{v}");
    assert!(v["started_at"].is_string(), "{v}");
    // While A runs, a request queues B; the next one joins B.
    let second = post().await;
    let b = second["run_uid"].as_str().unwrap().to_string();
    assert_ne!(a, b);
    let v = state_of(b.clone()).await;
    assert_eq!(v["state"], "queued", "{v}");
    let third = post().await;
    assert_eq!(third["run_uid"], b.as_str(), "{third}");
    assert_eq!(third["coalesced"], true, "{third}");

    gate.add_permits(1);
    let v = wait_state(a.clone(), "finished").await;
    assert_eq!(v["status"], "success", "{v}");
    assert_eq!(v["outcome"]["run_uid"], a.as_str(), "{v}");
    let v = wait_state(b.clone(), "running").await;
    assert_eq!(v["run_uid"], b.as_str());
    gate.add_permits(1);
    let v = wait_state(b.clone(), "finished").await;
    // Same plan again: nothing left to change.
    assert_eq!(v["status"], "unchanged", "{v}");
    assert_eq!(state.wait_runs(2).await.run_uid, b);
    // Both are in the store with their ids.
    let runs: serde_json::Value = http
        .get(format!("{url}/v1/runs"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let uids: Vec<&str> = runs["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["run_uid"].as_str().unwrap())
        .collect();
    assert_eq!(uids, [b.as_str(), a.as_str()], "{runs}");

    stop_tx.send(true).unwrap();
    daemon.await.unwrap().unwrap();
}

async fn spawn(router: Router) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(axum::serve(l, router).into_future());
    url
}

/// With a read token configured the read endpoints need it (or the write token); the
/// mutating ones need the write token (403 for the read token); probes, metrics and the
/// document stay open. Body bounds answer before anything runs.
#[tokio::test]
async fn read_and_write_tokens_over_http() {
    let state = AppState::from_parts(AppParts {
        tokens: Tokens {
            write: Some("write-token-0123456789".into()),
            read: Some("read-token-0123456789".into()),
        },
        ..AppParts::default()
    });
    let url = spawn(app(state)).await;
    let http = reqwest::Client::new();
    let get = |path: &str, token: Option<&str>| {
        let mut r = http.get(format!("{url}{path}"));
        if let Some(t) = token {
            r = r.bearer_auth(t);
        }
        r.send()
    };
    for open in ["/healthz", "/metrics", "/openapi.json"] {
        assert_eq!(get(open, None).await.unwrap().status(), 200, "{open}");
    }
    // Readiness is open too (probes carry no token); without a store it is not ready.
    let r = get("/readyz", None).await.unwrap();
    assert_eq!(r.status(), 503);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(
        v["reason"], "config: not loaded yet; store: not connected yet",
        "{v}"
    );
    let r = get("/v1/runs/last", None).await.unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(r.headers()["www-authenticate"], r#"Bearer realm="rlc""#);
    assert_eq!(r.headers()["content-type"], "application/problem+json");
    let p: serde_json::Value = r.json().await.unwrap();
    assert_eq!(p["status"], 401, "{p}");
    assert_eq!(p["error"], p["detail"], "{p}");
    let r = get("/v1/shadow", Some("wrong")).await.unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(
        r.headers()["www-authenticate"],
        r#"Bearer realm="rlc", error="invalid_token""#
    );
    // Read or write token: through to the handler (no run yet, no store yet).
    for t in ["read-token-0123456789", "write-token-0123456789"] {
        assert_eq!(get("/v1/runs/last", Some(t)).await.unwrap().status(), 404);
        assert_eq!(get("/v1/shadow", Some(t)).await.unwrap().status(), 503);
        assert_eq!(get("/", Some(t)).await.unwrap().status(), 503);
    }
    assert_eq!(get("/", None).await.unwrap().status(), 401);

    let post = |token: &str, body: Option<(&str, Vec<u8>)>| {
        let mut r = http.post(format!("{url}/v1/runs")).bearer_auth(token);
        if let Some((ct, b)) = body {
            r = r.header("content-type", ct).body(b);
        }
        r.send()
    };
    let status = |r: reqwest::Response| r.status().as_u16();
    assert_eq!(
        status(post("read-token-0123456789", None).await.unwrap()),
        403
    );
    assert_eq!(status(post("nope", None).await.unwrap()), 401);
    let w = "write-token-0123456789";
    // Authorised but not the scheduler (no scheduler runs here): 409, body or not.
    assert_eq!(status(post(w, None).await.unwrap()), 409);
    assert_eq!(
        status(
            post(w, Some(("application/json", b"{}".to_vec())))
                .await
                .unwrap()
        ),
        409
    );
    assert_eq!(
        status(post(w, Some(("text/plain", b"{}".to_vec()))).await.unwrap()),
        415
    );
    let r = post(w, Some(("application/json", br#"{"when": 1}"#.to_vec())))
        .await
        .unwrap();
    assert_eq!(r.status(), 422);
    let p: serde_json::Value = r.json().await.unwrap();
    assert!(p["detail"].as_str().unwrap().contains("when"), "{p}");
    assert_eq!(
        status(
            post(w, Some(("application/json", b"{".to_vec())))
                .await
                .unwrap()
        ),
        400
    );
    // An array is not the object the body must be (schemathesis found serde taking `[]`).
    assert_eq!(
        status(
            post(w, Some(("application/json", b"[]".to_vec())))
                .await
                .unwrap()
        ),
        422
    );
    let big = format!("{{\"x\": \"{}\"}}", "a".repeat(5000)).into_bytes();
    assert_eq!(
        status(
            post(w, Some(("application/json", big.clone())))
                .await
                .unwrap()
        ),
        413
    );
    // Without the write token the body is never looked at.
    assert_eq!(
        status(
            post("read-token-0123456789", Some(("application/json", big)))
                .await
                .unwrap()
        ),
        403
    );
}

/// The concurrency bound answers 429 with `Retry-After` while `max` requests are in flight,
/// and lets requests through again once they are done.
#[tokio::test]
async fn concurrency_limit_answers_429_with_retry_after() {
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let entered = Arc::new(AtomicU64::new(0));
    let (g, e) = (gate.clone(), entered.clone());
    let slow = axum::routing::get(move || {
        let (g, e) = (g.clone(), e.clone());
        async move {
            e.fetch_add(1, Ordering::SeqCst);
            g.acquire().await.unwrap().forget();
            "done"
        }
    });
    let router = Router::new()
        .route("/slow", slow)
        .route_layer(limits::ConcurrencyLimit::new(2, 3));
    let url = spawn(router).await;
    let http = reqwest::Client::new();
    let in_flight: Vec<_> = (0..2)
        .map(|_| tokio::spawn(http.get(format!("{url}/slow")).send()))
        .collect();
    // Both hold their permit (bounded wait), so a third is refused at once.
    for _ in 0..1000 {
        if entered.load(Ordering::SeqCst) == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(entered.load(Ordering::SeqCst), 2);
    let r = http.get(format!("{url}/slow")).send().await.unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "3");
    assert_eq!(r.headers()["content-type"], "application/problem+json");
    let p: serde_json::Value = r.json().await.unwrap();
    assert_eq!(p["status"], 429);
    // The refused request never reached the handler.
    assert_eq!(entered.load(Ordering::SeqCst), 2);
    gate.add_permits(2);
    for f in in_flight {
        assert_eq!(f.await.unwrap().unwrap().status(), 200);
    }
    // The permits are back: the next request goes through.
    gate.add_permits(1);
    assert_eq!(
        http.get(format!("{url}/slow"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    assert_eq!(entered.load(Ordering::SeqCst), 3);
}

/// `docs/openapi.json` is what the code generates.
#[test]
fn committed_openapi_document_is_current() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/openapi.json");
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    let generated = openapi::document_json();
    assert!(
        committed == generated,
        "{} is stale: regenerate it with `cargo run -p rlc -- openapi > docs/openapi.json`",
        path.display()
    );
    // Every endpoint is in it, with its methods.
    let doc: serde_json::Value = serde_json::from_str(&generated).unwrap();
    assert_eq!(doc["openapi"], "3.1.0");
    for (path, method) in [
        ("/", "get"),
        ("/healthz", "get"),
        ("/readyz", "get"),
        ("/metrics", "get"),
        ("/openapi.json", "get"),
        ("/v1/shadow", "get"),
        ("/v1/runs", "get"),
        ("/v1/runs", "post"),
        ("/v1/runs/last", "get"),
        ("/v1/runs/{id}", "get"),
        ("/runs/{id}", "get"),
        ("/docs", "get"),
    ] {
        assert!(doc["paths"][path][method].is_object(), "{method} {path}");
    }
    assert_eq!(
        doc["components"]["securitySchemes"]["bearer"]["scheme"],
        "bearer"
    );
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
    let cache = Arc::new(crate::history::snapshot::HistoryCache::new(
        cfg.clone(),
        dir.path(),
    ));
    let q = quotas::Quotas::new(cfg, dir.path(), cache.clone(), 1, StoreSlot::default()).unwrap();
    let state = AppState::from_parts(AppParts {
        quotas: Some(Arc::new(q)),
        ..AppParts::default()
    });
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

#[test]
fn logged_urls_hide_only_the_password() {
    use super::redact_url;
    assert_eq!(
        redact_url("postgres://rlc:pw@db/rlc"),
        "postgres://rlc:***@db/rlc"
    );
    assert_eq!(
        redact_url("https://user@h/repo.git"),
        "https://user@h/repo.git"
    );
    // An `@` after the authority is not a user part.
    assert_eq!(redact_url("http://h/?a=b@c"), "http://h/?a=b@c");
    assert_eq!(redact_url("sqlite://rlc.db"), "sqlite://rlc.db");
    assert_eq!(redact_url("rlc.db"), "rlc.db");
}

/// Every request and answer body of every operation has an example, and each conforms to its
/// schema (a checker of the schema keywords the document uses).
#[test]
fn every_body_in_the_document_has_an_example_of_its_schema() {
    let doc: serde_json::Value = serde_json::to_value(openapi::document()).unwrap();
    let schemas = doc["components"]["schemas"].as_object().unwrap().clone();
    let mut bodies = 0;
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            let mut media = Vec::new();
            if let Some(c) = op["requestBody"]["content"].as_object() {
                media.extend(c.iter().map(|(t, m)| (format!("request {t}"), m)));
            }
            for (status, r) in op["responses"].as_object().unwrap() {
                for (t, m) in r["content"].as_object().into_iter().flatten() {
                    media.push((format!("{status} {t}"), m));
                }
            }
            for (what, m) in media {
                bodies += 1;
                let at = format!("{method} {path} {what}");
                let example = m
                    .get("example")
                    .unwrap_or_else(|| panic!("{at}: no example"));
                if let Some(schema) = m.get("schema") {
                    examples::conforms(example, schema, &schemas, "$").unwrap_or_else(|e| {
                        panic!("{at}: the example does not conform: {e}\n{example:#}")
                    });
                }
            }
        }
    }
    assert!(bodies > 60, "{bodies}");
    // The checker refuses what does not conform.
    let queued = json!({"$ref": "#/components/schemas/Queued"});
    assert!(examples::conforms(&json!({"queued": true}), &queued, &schemas, "$").is_err());
    assert!(examples::conforms(
        &json!({"queued": 1, "run_uid": "r", "location": "/"}),
        &queued,
        &schemas,
        "$"
    )
    .is_err());
}

/// A path no endpoint takes is 404 and a method an endpoint does not take 405, both as
/// problem details (a browser gets an HTML 404 page); `/docs` is a page of this binary that
/// loads nothing from elsewhere.
#[tokio::test]
async fn router_errors_are_problem_details_and_the_docs_page_is_offline() {
    let state = AppState::new(None, tokio::sync::mpsc::channel(1).0);
    let url = spawn(app(state)).await;
    let http = reqwest::Client::new();
    let r = http
        .get(format!("{url}/v1/nothing-here"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(r.headers()["content-type"], "application/problem+json");
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["status"], 404);
    assert_eq!(v["title"], "Not Found");
    assert!(
        v["detail"]
            .as_str()
            .unwrap()
            .contains("GET /v1/nothing-here"),
        "{v}"
    );
    let r = http
        .get(format!("{url}/nothing"))
        .header("accept", "text/html,application/xhtml+xml")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    assert!(r.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/html"));
    assert!(r
        .text()
        .await
        .unwrap()
        .contains("no such endpoint: GET /nothing"));
    let r = http.delete(format!("{url}/v1/runs")).send().await.unwrap();
    assert_eq!(r.status(), 405);
    assert_eq!(r.headers()["content-type"], "application/problem+json");
    assert!(r.headers().contains_key("allow"), "{:?}", r.headers());
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["status"], 405);
    assert!(
        v["detail"]
            .as_str()
            .unwrap()
            .contains("/v1/runs does not take DELETE"),
        "{v}"
    );

    let r = http.get(format!("{url}/docs")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let page = r.text().await.unwrap();
    assert!(
        page.contains("fetch(\"/openapi.json\""),
        "renders the served document"
    );
    // No asset from elsewhere: no src or stylesheet link at all, and no absolute URL.
    for needle in [" src=", "<link", "http://", "https://", "@import", "url("] {
        assert!(!page.contains(needle), "{needle} in /docs");
    }
}

/// A daemon started over a store that already holds runs answers `GET /v1/runs/last` from
/// the store (before it finishes a run of its own), and its bucket pages get the history
/// without waiting for a run or a quota request: it pulls it at start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_daemon_reads_what_the_store_holds_and_pulls_the_history_at_start() {
    let remote = seeded_remote();
    let base = remote.scratch("");
    let end = Utc::now().timestamp() / 600 * 600;
    let mut csv = String::from("ts,service,caller,procedure,rps\n");
    let mut t = end - 86_400;
    while t <= end {
        csv.push_str(&format!("{t},payments,gw,,80\n"));
        t += 600;
    }
    std::fs::write(base.join("history.csv"), csv).unwrap();
    // A run recorded by the daemon's previous life.
    let store = crate::store::Store::connect("sqlite://rlc.db", &base)
        .await
        .unwrap();
    let at = Utc::now() - chrono::Duration::hours(1);
    let id = store
        .record_run(
            &crate::store::RunRecord {
                id: 0,
                trigger: "schedule".into(),
                started_at: at,
                finished_at: at + chrono::Duration::seconds(20),
                status: "success".into(),
                commit_sha: Some("0123456789abcdef0123456789abcdef01234567".into()),
                version_pushed: Some("0123456789abcdef0123456789abcdef01234567".into()),
                services: "[]".into(),
                summary: "rlc run (schedule): success\n  payments: raised gw 100 → 125".into(),
                error: None,
                run_uid: Some("ab".repeat(16)),
                pr_number: Some(7),
                pr_url: Some("https://example.com/pr/7".into()),
            },
            &[],
        )
        .await
        .unwrap();
    drop(store);

    // A controller that is not there: the daemon still serves its pages.
    let cfg = config(&remote, "http://127.0.0.1:9", "");
    let planner: Planner = Arc::new(|_input: crate::cycle::PlanInput| {
        Box::pin(async { Err(anyhow::anyhow!("no run in this test")) })
    });
    let (tx, rx) = mpsc::channel(1);
    let state = AppState::daemon(&cfg, &base, None, tx).unwrap();
    let (stop_tx, stop_rx) = watch::channel(false);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let opts = ServeOptions::new(Duration::from_secs(3600));
    let daemon = {
        let (state, base) = (state.clone(), base.clone());
        tokio::spawn(async move {
            serve_on(listener, cfg, &base, planner, opts, state, rx, stop_rx).await
        })
    };
    let http = reqwest::Client::new();
    let mut last = None;
    let mut page = String::new();
    for _ in 0..300 {
        if last.is_none() {
            let r = http
                .get(format!("{url}/v1/runs/last"))
                .send()
                .await
                .unwrap();
            if r.status() == 200 {
                last = Some(r.json::<serde_json::Value>().await.unwrap());
            }
        }
        page = http
            .get(format!("{url}/buckets/payments/gw"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        if last.is_some() && page.contains("id=\"lookback-chart\"") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let last = last.expect("GET /v1/runs/last answered the stored run");
    assert_eq!(last["run_id"], id, "{last}");
    assert_eq!(last["status"], "success", "{last}");
    assert_eq!(last["trigger"], "schedule", "{last}");
    assert_eq!(last["run_uid"], "ab".repeat(16), "{last}");
    assert_eq!(last["pull_request"][0], 7, "{last}");
    assert!(
        last["from_store"]
            .as_str()
            .unwrap()
            .contains("raised gw 100 → 125"),
        "{last}"
    );
    assert!(page.contains("id=\"lookback-chart\""), "{page}");
    assert!(!page.contains("No history pulled yet"), "{page}");
    assert!(state.store().is_some());
    stop_tx.send(true).unwrap();
    daemon.await.unwrap().unwrap();
}

/// Several regions: a key every region reports is stored per region, at the controller's own
/// share of the rates; a region's or zone's key is kept.
#[test]
fn rows_of_several_regions_are_stored_per_region_at_their_own_share() {
    let row = |scope: &str, own: Option<f64>| -> ReportRow {
        let mut r: ReportRow = serde_json::from_value(json!({
            "seq": 1, "t": 1_796_000_000, "service": "payments", "bucket": "charge",
            "mode": "shadow", "scope_key": scope, "offered": 300.0, "admitted": 300.0,
            "dropped": 0.0, "shadow_dropped": 30.0, "limit_rps": 270.0, "drop_ratio": 0.1
        }))
        .unwrap();
        r.own_share = own;
        r
    };
    let mut rows = vec![
        row("global", Some(0.5)),
        row("", None),
        row("region:b", None),
        row("zone:b1", None),
        row("global", Some(f64::NAN)),
    ];
    super::reports::localize(&mut rows, "b");
    let keys: Vec<&str> = rows.iter().map(|r| r.scope_key.as_str()).collect();
    assert_eq!(
        keys,
        ["global@b", "global@b", "region:b", "zone:b1", "global@b"]
    );
    assert_eq!((rows[0].offered, rows[0].shadow_dropped), (150.0, 15.0));
    assert_eq!(rows[1].offered, 300.0);
    // A share that is not a number counts the row whole, never as zero.
    assert_eq!(rows[4].offered, 300.0);
    assert!(rows.iter().all(|r| r.own_share.is_none()));
}
