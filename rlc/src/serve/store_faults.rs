//! `rlc serve` with a store that hangs or goes down under it: a real Postgres (a table locked
//! by another session; a server of its own stopped and started again), a stand-in controller
//! that serves a report feed with the real one's cursor rules, and the whole daemon.

use std::collections::HashMap;
use std::future::IntoFuture;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::extract::Query;
use axum::Json;
use serde_json::{json, Value};
use sqlx::Connection;

use super::*;
use crate::cycle::tests::config;
use crate::gitops::tests::{plan, seeded_remote};
use crate::push::tests::{app as controller_app, Fake};
use test_support::wait::eventually_within;

/// The controller's report feed: reports with seq 1, 2, ..., served after a cursor as the
/// real controller does (`next` is the last seq served), at most `cap` per call.
#[derive(Clone)]
struct Feed {
    reports: Arc<Mutex<Vec<Value>>>,
    cap: usize,
    /// `GET /v1/reports` calls answered.
    fetches: Arc<AtomicU64>,
    /// The highest `after` asked.
    highest_after: Arc<AtomicU64>,
}

impl Feed {
    fn new(cap: usize) -> Feed {
        Feed {
            reports: Arc::default(),
            cap,
            fetches: Arc::default(),
            highest_after: Arc::default(),
        }
    }

    /// Appends reports up to seq `to`, ticks in the last ten minutes.
    fn extend_to(&self, to: i64) {
        let now = Utc::now().timestamp();
        let mut r = self.reports.lock().unwrap();
        for seq in r.len() as i64 + 1..=to {
            r.push(json!({
                "seq": seq, "t": now - 600 + seq, "service": "payments", "bucket": "gw",
                "caller": "gw", "procedure": null, "mode": "shadow", "scope_key": "eu",
                "offered": 10.0, "admitted": 10.0, "dropped": 0.0, "shadow_dropped": 1.0,
                "limit_rps": 9.0, "drop_ratio": 0.1
            }));
        }
    }
}

async fn feed_reports(
    axum::extract::State(f): axum::extract::State<Feed>,
    Query(q): Query<HashMap<String, String>>,
) -> Json<Value> {
    let after: u64 = q.get("after").and_then(|a| a.parse().ok()).unwrap_or(0);
    let limit: usize = q
        .get("limit")
        .and_then(|a| a.parse().ok())
        .unwrap_or(10_000);
    f.fetches.fetch_add(1, Ordering::SeqCst);
    f.highest_after.fetch_max(after, Ordering::SeqCst);
    let rows: Vec<Value> = f
        .reports
        .lock()
        .unwrap()
        .iter()
        .skip(after as usize)
        .take(limit.min(f.cap))
        .cloned()
        .collect();
    let next = rows.last().map_or(after, |r| r["seq"].as_u64().unwrap());
    Json(json!({"next": next, "reports": rows}))
}

/// A stand-in controller with the feed; its URL.
async fn spawn_controller(feed: Feed) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let app = controller_app(Fake::default()).route(
        "/v1/reports",
        axum::routing::get(feed_reports).with_state(feed),
    );
    tokio::spawn(axum::serve(l, app).into_future());
    url
}

/// A running daemon: its URL, its state, and how to stop it.
struct Daemon {
    url: String,
    state: AppState,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
    _remote: test_support::git::GitRemote,
}

impl Daemon {
    /// `rlc serve` on `database_url`, polling every 100 ms, with 1 s store timeouts and a
    /// report buffer of 30 reports fetched 10 at a time.
    async fn start(database_url: &str, controller: &str) -> Daemon {
        let remote = seeded_remote();
        let mut cfg = config(
            &remote,
            controller,
            "store:\n  query_timeout: 1s\n  write_timeout: 1s\n",
        );
        cfg.database_url = database_url.into();
        let base = remote.scratch("");
        let planner: Planner = Arc::new(|_| Box::pin(async { Ok(plan(vec![])) }));
        let (tx, rx) = mpsc::channel(1);
        let state = AppState::daemon(&cfg, &base, Some("api-token".into()), tx).unwrap();
        let (stop, stop_rx) = watch::channel(false);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let opts = ServeOptions {
            report_limits: ReportLimits {
                buffer: 30,
                page: 10,
            },
            ..ServeOptions::new(Duration::from_millis(100))
        };
        let task = {
            let state = state.clone();
            tokio::spawn(async move {
                serve_on(listener, cfg, &base, planner, opts, state, rx, stop_rx).await
            })
        };
        Daemon {
            url,
            state,
            stop,
            task,
            _remote: remote,
        }
    }

    /// GET `path`: status and body. A page that hangs fails the test (the store stays
    /// locked or down meanwhile, so only the query timeout ends the wait).
    async fn get(&self, path: &str) -> (u16, String) {
        let r = reqwest::Client::new()
            .get(format!("{}{path}", self.url))
            .timeout(Duration::from_secs(60))
            .send()
            .await
            .unwrap_or_else(|e| panic!("GET {path}: {e}"));
        (r.status().as_u16(), r.text().await.unwrap())
    }

    fn metrics(&self) -> &Metrics {
        &self.state.inner.metrics
    }

    async fn shutdown(self) {
        self.stop.send(true).unwrap();
        self.task.await.unwrap().unwrap();
    }
}

/// The stored reports' sequence numbers, in order (every one, duplicates too if any).
async fn stored_seqs(store: &Store) -> Vec<i64> {
    store
        .reports(None, 10_000)
        .await
        .map(|r| r.iter().map(|r| r.seq).collect())
        .unwrap_or_default()
}

/// A store that hangs (another session holds ACCESS EXCLUSIVE locks on the report tables):
/// writes are given up after `store.write_timeout` and the reports stay buffered; polling
/// stops at the buffer's bound (the controller is not asked further); the stored cursor stays
/// at what was stored; every page answers within `store.query_timeout`, naming what it could
/// not load and how many reports wait, with no figure standing in for them. Once the lock is
/// gone, everything buffered and everything after it is stored once, and the cursor follows.
#[tokio::test]
async fn a_hung_store_pauses_polling_at_the_bound_and_loses_nothing() {
    let db = test_support::postgres::fresh_database().await.unwrap();
    let feed = Feed::new(10);
    feed.extend_to(20);
    let ctl = spawn_controller(feed.clone()).await;
    let d = Daemon::start(&db.url, &ctl).await;
    let store = Store::connect(&db.url, Path::new("/")).await.unwrap();
    let st = &store;
    eventually_within(
        "the first 20 reports stored",
        Duration::from_secs(60),
        || async move { st.cursor(REPORT_CURSOR).await.unwrap().as_deref() == Some("20") },
    )
    .await;
    assert_eq!(stored_seqs(&store).await, (1..=20).collect::<Vec<_>>());

    // Another session locks the tables ingest writes and the pages read.
    let mut locker = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut locker).await.unwrap();
    sqlx::query(
        "LOCK TABLE shadow_reports, shadow_minutes, shadow_blocks IN ACCESS EXCLUSIVE MODE",
    )
    .execute(&mut locker)
    .await
    .unwrap();
    feed.extend_to(80);
    let m = d.metrics();
    eventually_within("polling paused", Duration::from_secs(60), || {
        std::future::ready(m.report_polls_paused.get() >= 1)
    })
    .await;
    // Three pages of 10 fetched (the bound is 30), none after: the controller keeps the rest.
    assert_eq!(d.metrics().reports_buffered.get(), 30);
    let (fetches, after) = (
        feed.fetches.load(Ordering::SeqCst),
        feed.highest_after.load(Ordering::SeqCst),
    );
    assert_eq!(after, 40, "the last page fetched was 41..=50");
    let paused = d.metrics().report_polls_paused.get();
    eventually_within("two more paused polls", Duration::from_secs(60), || {
        std::future::ready(m.report_polls_paused.get() >= paused + 2)
    })
    .await;
    assert_eq!(
        feed.fetches.load(Ordering::SeqCst),
        fetches,
        "no fetch while full"
    );
    assert_eq!(d.metrics().reports_buffered.get(), 30);
    assert_eq!(d.metrics().reports_stored.get(), 20);
    assert_eq!(
        store.cursor(REPORT_CURSOR).await.unwrap().as_deref(),
        Some("20"),
        "the stored cursor stays at what is stored"
    );

    // The overview: the waiting reports, and what could not be loaded instead of zeros.
    let (status, html) = d.get("/").await;
    assert_eq!(status, 503, "{html}");
    assert!(html.contains("id=\"buffered\""), "{html}");
    assert!(
        html.contains("30 controller reports are fetched but not stored yet"),
        "{html}"
    );
    assert!(
        html.contains("The bucket list could not be loaded: the store did not answer within 1s"),
        "{html}"
    );
    assert!(!html.contains("id=\"buckets\""), "no bucket table: {html}");
    assert!(!html.contains("No reports since"), "{html}");
    // The bucket page: the figures and the chart are named, none is drawn.
    let (status, html) = d.get("/buckets/payments/gw?window=1h").await;
    assert_eq!(status, 503, "{html}");
    for part in ["The readiness figures", "The chart"] {
        assert!(
            html.contains(&format!(
                "{part} could not be loaded: the store did not answer within 1s"
            )),
            "{part}: {html}"
        );
    }
    assert!(!html.contains("<svg"), "{html}");
    assert!(!html.contains("id=\"coverage\""), "{html}");
    // The JSON twins: problem details naming the part.
    for (path, part) in [
        ("/v1/shadow", "the bucket list"),
        ("/v1/shadow/payments/gw?window=1h", "the readiness figures"),
    ] {
        let (status, body) = d.get(path).await;
        assert_eq!(status, 503, "{path}: {body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            v["detail"],
            format!(
                "{part} could not be loaded: the store did not answer within 1s (down, \
                 unreachable or slow)"
            ),
            "{path}"
        );
    }

    // The lock goes: the backlog and the rest are stored once, and the cursor follows.
    sqlx::query("COMMIT").execute(&mut locker).await.unwrap();
    eventually_within(
        "every report stored",
        Duration::from_secs(60),
        || async move { st.cursor(REPORT_CURSOR).await.unwrap().as_deref() == Some("80") },
    )
    .await;
    assert_eq!(stored_seqs(&store).await, (1..=80).collect::<Vec<_>>());
    assert_eq!(d.metrics().reports_stored.get(), 80);
    assert_eq!(d.metrics().reports_buffered.get(), 0);
    // The roll-ups counted each report once.
    let sum = store
        .shadow_summary(None, Utc::now() - chrono::Duration::hours(2), 10)
        .await
        .unwrap();
    assert_eq!((sum.len(), sum[0].reports), (1, 80));
    let (status, html) = d.get("/").await;
    assert_eq!(status, 200, "{html}");
    assert!(!html.contains("id=\"buffered\"") && !html.contains("id=\"problem\""));
    assert!(html.contains("data-bucket=\"gw\""), "{html}");
    d.shutdown().await;
}

/// Postgres stops under a running daemon: every page and JSON answer says what it could not
/// load (503) instead of showing zeros, and leaks no URL. The reports sent meanwhile wait at
/// the controller (without the store no replica leads); once Postgres is back, they are
/// stored and the pages show them.
#[tokio::test]
async fn pages_say_what_a_stopped_postgres_could_not_load_and_recover() {
    let server = test_support::postgres::Server::start().unwrap();
    let db = server.fresh_database().await.unwrap();
    let feed = Feed::new(10);
    feed.extend_to(20);
    let ctl = spawn_controller(feed.clone()).await;
    let d = Daemon::start(&db.url, &ctl).await;
    // The test's own pool reconnects once the server is back.
    let store = Store::connect(&db.url, Path::new("/")).await.unwrap();
    let at = |want: &'static str| {
        let store = store.clone();
        move || {
            let store = store.clone();
            async move { store.cursor(REPORT_CURSOR).await.ok().flatten().as_deref() == Some(want) }
        }
    };
    eventually_within(
        "the first 20 reports stored",
        Duration::from_secs(60),
        at("20"),
    )
    .await;
    let (status, html) = d.get("/").await;
    assert_eq!(status, 200, "{html}");

    server.stop().unwrap();
    feed.extend_to(40);
    let (status, html) = d.get("/").await;
    assert_eq!(status, 503, "{html}");
    for part in ["The bucket list", "The service list", "The last runs"] {
        assert!(
            html.contains(&format!("{part} could not be loaded: ")),
            "{part}: {html}"
        );
    }
    assert!(!html.contains("id=\"buckets\"") && !html.contains("id=\"runs\""));
    let (status, html) = d.get("/buckets/payments/gw?window=1h").await;
    assert_eq!(status, 503, "{html}");
    for part in ["The readiness figures", "The chart", "The quota history"] {
        assert!(
            html.contains(&format!("{part} could not be loaded: ")),
            "{part}: {html}"
        );
    }
    assert!(!html.contains("<svg") && !html.contains("id=\"coverage\""));
    for (path, part) in [
        ("/v1/shadow", "the bucket list"),
        ("/v1/shadow/payments/gw?window=1h", "the readiness figures"),
        ("/v1/runs", "the runs"),
    ] {
        let (status, body) = d.get(path).await;
        assert_eq!(status, 503, "{path}: {body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        let detail = v["detail"].as_str().unwrap();
        assert!(
            detail.starts_with(&format!("{part} could not be loaded: ")),
            "{path}: {detail}"
        );
        assert!(!detail.contains("postgres://"), "{detail}");
    }

    server.resume().unwrap();
    eventually_within(
        "the reports sent meanwhile stored",
        Duration::from_secs(90),
        at("40"),
    )
    .await;
    assert_eq!(stored_seqs(&store).await, (1..=40).collect::<Vec<_>>());
    let (status, html) = d.get("/buckets/payments/gw?window=1h").await;
    assert_eq!(status, 200, "{html}");
    assert!(html.contains("id=\"coverage\"") && !html.contains("id=\"problem\""));
    d.shutdown().await;
}

/// A store that refuses a query (a table dropped under the daemon): the pages and the JSON
/// name the part and the store's error (500), and show what did load.
#[tokio::test]
async fn a_dropped_table_is_named_with_the_store_error() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::connect("sqlite://rlc.db", dir.path()).await.unwrap();
    let state = AppState::with_store(store.clone());
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(axum::serve(l, app(state)).into_future());
    let Store::Sqlite(pool, _) = &store else {
        unreachable!()
    };
    sqlx::query("DROP TABLE shadow_blocks")
        .execute(pool)
        .await
        .unwrap();
    let http = reqwest::Client::new();
    let html = http.get(format!("{url}/")).send().await.unwrap();
    assert_eq!(html.status(), 500);
    let html = html.text().await.unwrap();
    assert!(
        html.contains("The bucket list could not be loaded: store: "),
        "{html}"
    );
    assert!(html.contains("no such table: shadow_blocks"), "{html}");
    // The runs did load.
    assert!(html.contains("No run recorded yet."), "{html}");
    let r = http.get(format!("{url}/v1/shadow")).send().await.unwrap();
    assert_eq!(r.status(), 500);
    let v: Value = r.json().await.unwrap();
    assert!(
        v["detail"]
            .as_str()
            .unwrap()
            .starts_with("the bucket list could not be loaded: store: "),
        "{v}"
    );
    assert!(
        v["detail"].as_str().unwrap().contains("shadow_blocks"),
        "{v}"
    );
}
