//! Calls counted once: a real controller and a real aggregator over HTTP, with clients posting
//! their reports; whatever the controller answers a zone report (`resync` after a config
//! install), `grl_calls_total` ends up with exactly the calls the clients made.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;

use crate::aggregator::{Aggregator, AggregatorOptions};
use crate::controller::{Controller, ControllerOptions};
use crate::proto::{PROTO_HEADER, PROTO_VERSION};

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
    let c = Controller::start(ControllerOptions {
        state_dir: dir.path().join("c"),
        token: TOKEN.into(),
        allow_anonymous_reports: true,
        tick: Duration::from_millis(50),
        ..Default::default()
    })
    .await
    .unwrap();
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
