//! Criticality tiers end to end: a controller, an aggregator and two `grl sidecar`s before
//! the Python HTTP service. One bucket (procedure `charge`, limit 40 rps) takes 24 rps of
//! CRITICAL traffic from caller `gw` (half with `rpc-criticality: CRITICAL`, half with no
//! tier at all) and 36 rps from `batch-1`, which claims CRITICAL_PLUS (half in the header,
//! half in `baggage`) but is capped at SHEDDABLE by `--criticality-cap batch-*=SHEDDABLE`.
//! The fleet admits the limit; the 20 rps to shed fall on batch-1 alone.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;

use super::sidecar::{paced_with, take, Counts, Fleet};

const LIMIT: f64 = 40.0;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_shed_falls_on_the_least_critical_tier_across_sidecars() {
    let fleet = Fleet::start(
        json!([{"name": "charge", "procedure": "charge", "scope": "global",
                "limit_rps": LIMIT, "mode": "enforce", "policy": "peak"}]),
        2,
        &["--criticality-cap", "batch-*=SHEDDABLE"],
    )
    .await;
    let ports = &fleet.ports;

    let stop = Arc::new(AtomicBool::new(false));
    let gw: Arc<Counts> = Arc::default();
    let batch: Arc<Counts> = Arc::default();
    let url = |i: usize| format!("http://127.0.0.1:{}/charge", ports[i].0);
    let tasks = [
        paced_with(
            url(0),
            "gw",
            &[("rpc-criticality", "CRITICAL")],
            12.0,
            gw.clone(),
            stop.clone(),
        ),
        paced_with(url(1), "gw", &[], 12.0, gw.clone(), stop.clone()),
        paced_with(
            url(0),
            "batch-1",
            &[("rpc-criticality", "critical_plus")],
            18.0,
            batch.clone(),
            stop.clone(),
        ),
        paced_with(
            url(1),
            "batch-1",
            &[("baggage", "team=data, criticality=CRITICAL_PLUS")],
            18.0,
            batch.clone(),
            stop.clone(),
        ),
    ];

    // Settle, then measure.
    tokio::time::sleep(Duration::from_secs(8)).await;
    take(&gw);
    take(&batch);
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(12)).await;
    let secs = t0.elapsed().as_secs_f64();
    let (gw_ok, gw_refused, gw_failed) = take(&gw);
    let (b_ok, b_refused, b_failed) = take(&batch);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    let admitted = (gw_ok + b_ok) as f64 / secs;
    eprintln!(
        "fleet admitted {admitted:.1} rps (limit {LIMIT}); gw ok/429 {gw_ok}/{gw_refused}, batch-1 ok/429 {b_ok}/{b_refused}"
    );
    assert_eq!((gw_failed, b_failed), (0, 0));
    assert!(
        (admitted - LIMIT).abs() <= 0.1 * LIMIT,
        "admitted {admitted:.1} rps, limit {LIMIT}"
    );
    // CRITICAL (and untiered) traffic: under 1 % refused.
    assert!(
        (gw_refused as f64) < 0.01 * (gw_ok + gw_refused) as f64,
        "gw refused {gw_refused} of {}",
        gw_ok + gw_refused
    );
    // The capped caller pays the excess: about 40 - 24 = 16 rps admitted of its 36.
    let b_rate = b_ok as f64 / secs;
    assert!(
        (b_rate - 16.0).abs() <= 4.0,
        "batch-1 admitted {b_rate:.1} rps"
    );
    drop(fleet);
}
