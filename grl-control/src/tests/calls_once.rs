//! Calls counted once: a real controller and a real aggregator over HTTP, with clients posting
//! their reports; whatever the controller answers a zone report (`resync` after a config
//! install), `grl_calls_total` ends up with exactly the calls the clients made.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;

use crate::aggregator::{Aggregator, AggregatorOptions};
use grl_wire::{PROTO_HEADER, PROTO_VERSION};

const TOKEN: &str = "t0ken";

fn config(version: &str) -> serde_json::Value {
    json!({"version": version, "services": [{"service": "payments", "buckets": [
        {"name": "gw.charge", "caller": "gw", "procedure": "charge", "scope": "global",
         "limit_rps": 100.0, "mode": "enforce", "policy": "peak"}]}]})
}

async fn put_config(http: &reqwest::Client, url: &str, version: &str) {
    let r = http
        .put(format!("{url}/v1/config"))
        .bearer_auth(TOKEN)
        .json(&config(version))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
}

/// `grl_calls_total` of `service`, summed over callers and procedures.
fn calls_total(metrics: &str, service: &str) -> u64 {
    let s = format!("service=\"{service}\"");
    metrics
        .lines()
        .filter(|l| l.starts_with("grl_calls_total{") && l.contains(&s))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

async fn metrics(http: &reqwest::Client, url: &str) -> String {
    match http.get(format!("{url}/metrics")).send().await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

/// Clients `0..clients` of payments each reporting `per_report` calls of (gw, charge) every
/// 100 ms until `stop`; the calls the aggregator accepted.
fn clients(
    http: &reqwest::Client,
    url: &str,
    clients: usize,
    per_report: u64,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<u64> {
    let (http, url) = (http.clone(), url.to_string());
    tokio::spawn(async move {
        let mut sent = 0;
        let mut iv = tokio::time::interval(Duration::from_millis(100));
        while !stop.load(Ordering::Relaxed) {
            iv.tick().await;
            for i in 0..clients {
                let r = http
                    .post(format!("{url}/v1/report"))
                    .header(PROTO_HEADER, PROTO_VERSION.to_string())
                    .json(&json!({"client_id": format!("c{i}"), "service": "payments",
                        "version": "v1", "interval_ms": 100, "buckets": [],
                        "calls": [{"caller": "gw", "procedure": "charge", "count": per_report}]}))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status(), 200);
                sent += per_report;
            }
        }
        sent
    })
}

/// An aggregator sends delta reports; every config install makes the controller answer the
/// zone's next delta `resync`, and the aggregator sends a full report at once. The calls of
/// the report answered `resync` go again with the full one: the controller counts them once
/// (before: once per report, so twice).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_are_counted_once_when_a_delta_report_is_answered_resync() {
    let dir = tempfile::tempdir().unwrap();
    let c = crate::tests::anonymous_controller(dir.path().join("c"), TOKEN).await;
    let http = reqwest::Client::new();
    put_config(&http, &c.url(), "v1").await;
    let a = Aggregator::start(AggregatorOptions {
        controllers: vec![c.url()],
        zone: "z1".into(),
        region: "r1".into(),
        tick: Duration::from_millis(100),
        allow_anonymous_reports: true,
        ..Default::default()
    })
    .await
    .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let task = clients(&http, &a.url(), 2, 50, stop.clone());
    // Deltas flow (the controller announced protocol 4), then six installs, each followed by
    // a resync of the zone's session.
    tokio::time::sleep(Duration::from_millis(600)).await;
    for v in 2..8 {
        put_config(&http, &c.url(), &format!("v{v}")).await;
        tokio::time::sleep(Duration::from_millis(350)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let sent = task.await.unwrap();
    for _ in 0..60 {
        if calls_total(&metrics(&http, &c.url()).await, "payments") >= sent {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Every forward after the clients stopped is in (at most a tick or two).
    tokio::time::sleep(Duration::from_millis(400)).await;
    let m = metrics(&http, &c.url()).await;
    assert_eq!(calls_total(&m, "payments"), sent, "{m}");
    a.shutdown().await;
    c.shutdown().await;
}

/// `(calls, calls_ms)` of the zone reports a controller took.
type Seen = Arc<std::sync::Mutex<Vec<(u64, Option<u64>)>>>;

/// A controller of protocol 6 recording `(calls, calls_ms)` of every zone report it takes,
/// or answering 503 while `down`.
async fn recording_controller(
    seen: Seen,
    down: Arc<AtomicBool>,
) -> (String, tokio::task::JoinHandle<()>) {
    use axum::response::IntoResponse;
    let app = axum::Router::new().route(
        "/v1/aggregate",
        axum::routing::post(move |axum::Json(r): axum::Json<grl_wire::ZoneReport>| {
            let (seen, down) = (seen.clone(), down.clone());
            async move {
                if down.load(Ordering::Relaxed) {
                    return axum::http::StatusCode::SERVICE_UNAVAILABLE.into_response();
                }
                let n = r.calls.iter().map(|c| c.count).sum();
                seen.lock().unwrap().push((n, r.calls_ms));
                (
                    [(PROTO_HEADER, "6")],
                    axum::Json(grl_wire::ZoneDirectives::default()),
                )
                    .into_response()
            }
        }),
    );
    crate::tests::serve_on_free_port(app).await
}

/// Calls held back by failed forwards go with the time they cover: two clients make 1,000
/// calls a second together; the controller refuses the zone reports for two seconds, and the
/// report that brings the held calls says they cover those seconds (the controller then
/// rates them at 1,000 calls/s, not as if made within one forward). Every report's
/// `calls_ms` follow each other: together they cover the run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_back_calls_come_with_the_time_they_cover() {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let down = Arc::new(AtomicBool::new(false));
    let (url, server) = recording_controller(seen.clone(), down.clone()).await;
    let started = std::time::Instant::now();
    let a = Aggregator::start(AggregatorOptions {
        controllers: vec![url],
        zone: "z1".into(),
        region: "r1".into(),
        tick: Duration::from_millis(100),
        allow_anonymous_reports: true,
        ..Default::default()
    })
    .await
    .unwrap();
    let http = reqwest::Client::new();
    let stop = Arc::new(AtomicBool::new(false));
    let task = clients(&http, &a.url(), 2, 50, stop.clone());
    tokio::time::sleep(Duration::from_millis(1000)).await;
    down.store(true, Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(2000)).await;
    let before = seen.lock().unwrap().len();
    down.store(false, Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    stop.store(true, Ordering::Relaxed);
    let sent = task.await.unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    a.shutdown().await;
    let elapsed = started.elapsed().as_millis() as u64;
    server.abort();
    let seen = seen.lock().unwrap().clone();
    // Every call arrived once.
    assert_eq!(seen.iter().map(|r| r.0).sum::<u64>(), sent, "{seen:?}");
    // The first report after the outage carries no calls (the controller's protocol is
    // unknown again); the next brings the held ones, with the time since the last forward
    // the controller took: the outage and more.
    let (n, ms) = seen[before + 1..]
        .iter()
        .find(|r| r.1.is_some())
        .copied()
        .unwrap();
    let ms = ms.unwrap();
    assert!(ms >= 2000, "{ms} ms: {seen:?}");
    let rate = n as f64 / (ms as f64 / 1000.0);
    assert!(
        (rate - 1000.0).abs() < 150.0,
        "{n} calls over {ms} ms: {seen:?}"
    );
    // Reports saying nothing are those to a controller of unknown protocol (the first, and
    // the first after the outage); the others' times add up to the run.
    let covered: u64 = seen.iter().filter_map(|r| r.1).sum();
    assert!(
        covered <= elapsed && covered + 500 >= elapsed,
        "{covered} ms covered in {elapsed} ms: {seen:?}"
    );
    assert!(seen.iter().filter(|r| r.1.is_none()).all(|r| r.0 == 0));
}
