//! Failing open at a low request rate: the client's task expires stale directives on the real
//! clock, so the first decision after the staleness bound admits, however few decisions the
//! deciding thread made (its own clock is refreshed only every 64 decisions).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::routing::{get, post};
use axum::{Json, Router};
use grl_client::{ClientOptions, GrlClient, GrlLayer};
use grl_core::Decision;
use serde_json::{json, Value};

/// Polls `f` every 20 ms until it holds; panics with `what` after 30 s (a hang guard).
fn until(what: &str, mut f: impl FnMut() -> bool) {
    for _ in 0..1500 {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("timed out waiting for: {what}");
}

#[test]
fn a_client_at_a_low_rate_fails_open_at_the_staleness_bound() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    // A fake aggregator: a drop ratio of 1 for gw/charge while `up`, 503 after.
    let up = Arc::new(AtomicBool::new(true));
    let up2 = up.clone();
    let app = Router::new()
        .route(
            "/v1/report",
            post(move || {
                let up = up2.load(Ordering::Relaxed);
                async move {
                    if !up {
                        return Err(axum::http::StatusCode::SERVICE_UNAVAILABLE);
                    }
                    Ok(Json(json!({"version": "v1", "age_ms": 0, "directives": [
                        {"bucket": "gw.charge", "ratio": 1.0, "fleet_offered_rps": 10.0,
                         "limit_rps": 1.0, "fixed": true}]})))
                }
            }),
        )
        .route(
            "/v1/config",
            get(|| async {
                Json::<Value>(json!({"version": "v1", "services": [{"service": "payments",
                    "buckets": [{"name": "gw.charge", "caller": "gw", "procedure": "charge",
                                 "scope": "global", "limit_rps": 1.0, "mode": "enforce",
                                 "policy": "peak"}]}]}))
            }),
        );
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    rt.spawn(async move { axum::serve(listener, app).await });
    let _enter = rt.enter();
    let mut o = ClientOptions::new("payments", vec![format!("http://{addr}")]);
    o.tick = Duration::from_millis(50);
    o.stale_after = Duration::from_millis(400);
    o.report_token = Some("t".into());
    let client = GrlClient::start(o);
    let layer = GrlLayer::for_client(&client);

    // This thread decides (as a service's request thread would, a few times a second).
    until("the client drops gw", || {
        layer.decide("gw", "charge") == Decision::Drop
    });
    // 64 decisions: this thread's clock was refreshed among them, while the directives held.
    for _ in 0..64 {
        assert_eq!(layer.decide("gw", "charge"), Decision::Drop);
    }
    up.store(false, Ordering::Relaxed);
    until("the client reports failing open", || {
        client.stats().stale.load(Ordering::Relaxed)
    });
    // The very next decision on this thread admits (before: its clock, up to 63 decisions
    // old, still said the directives held, and it dropped for as many more decisions).
    assert_eq!(layer.decide("gw", "charge"), Decision::Admit);
    for _ in 0..200 {
        assert_eq!(layer.decide("gw", "charge"), Decision::Admit);
    }
    assert!(client.stats().fail_open_total.load(Ordering::Relaxed) >= 1);
    // The aggregator answers again: enforcing again.
    up.store(true, Ordering::Relaxed);
    until("the client drops gw again", || {
        layer.decide("gw", "charge") == Decision::Drop
    });
    client.shutdown();
}
