//! Criticality tiers end to end: a controller, an aggregator and two `grl sidecar`s before
//! the Python HTTP service. One bucket (procedure `charge`, limit 40 rps) takes 24 rps of
//! CRITICAL traffic from caller `gw` (half with `rpc-criticality: CRITICAL`, half with no
//! tier at all) and 36 rps from `batch-1`, which claims CRITICAL_PLUS (half in the header,
//! half in `baggage`) but is capped at SHEDDABLE by `--criticality-cap batch-*=SHEDDABLE`.
//! The fleet admits the limit; the 20 rps to shed fall on batch-1 alone. Then an on-call
//! adds `grl override add --service payments --shed-below CRITICAL`: batch-1 is refused
//! entirely, `gw` still passes, and the override list says what it does.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;

use super::sidecar::{paced_with, take, Counts, Fleet};

const LIMIT: f64 = 40.0;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_shed_falls_on_the_least_critical_tier_across_sidecars() {
    let _heavy = super::HEAVY.lock().await;
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
    let floor = shed_below_critical(&fleet.controller, &gw, &batch).await;
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
    // Under the floor: nothing of batch-1 (SHEDDABLE by its cap) passes, gw all does.
    let ((gw_ok, gw_refused, _), (b_ok, b_refused, _)) = floor;
    eprintln!(
        "shed below CRITICAL: gw ok/429 {gw_ok}/{gw_refused}, batch-1 ok/429 {b_ok}/{b_refused}"
    );
    assert!(
        b_ok == 0 && b_refused > 100,
        "batch-1 ok/429 {b_ok}/{b_refused}"
    );
    assert!(
        gw_refused == 0 && gw_ok > 100,
        "gw ok/429 {gw_ok}/{gw_refused}"
    );
    drop(fleet);
}

/// Adds `shed_below CRITICAL` on the whole payments service with the CLI, lets it reach the
/// sidecars, and returns the two callers' counts over the next 6 s.
async fn shed_below_critical(
    controller: &str,
    gw: &Counts,
    batch: &Counts,
) -> ((u64, u64, u64), (u64, u64, u64)) {
    let grl = |args: &[&str]| {
        let out = super::overrides::grl(args);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        text
    };
    grl(&[
        "override",
        "add",
        "--controller",
        controller,
        "--service",
        "payments",
        "--shed-below",
        "CRITICAL",
        "--ttl",
        "5m",
        "--reason",
        "INC-7",
        "--who",
        "sre",
    ]);
    let list = grl(&["override", "list", "--controller", controller]);
    assert!(
        list.contains("service payments") && list.contains("shed below CRITICAL"),
        "{list}"
    );
    // The next directive (the aggregator forwards every second) and the sidecars' next poll.
    tokio::time::sleep(Duration::from_secs(4)).await;
    take(gw);
    take(batch);
    tokio::time::sleep(Duration::from_secs(6)).await;
    (take(gw), take(batch))
}

/// The same through `GrlLayer` in two in-process clients (real controller and aggregator
/// processes), at this sizing: limit 200 rps on procedure `charge`, 120 rps CRITICAL
/// from `gw` (half without a header) and 180 rps SHEDDABLE over the two: half from `gw` in
/// `baggage`, half from `batch-1`, which claims CRITICAL_PLUS but is capped at SHEDDABLE by
/// the bucket file's `criticality.caps`. The layer reads each request's tier from its
/// headers; CRITICAL loses under 1 %, SHEDDABLE keeps about 80 rps. The aggregator serves the
/// caps only to a client that says it reads them (`grl-proto: 9`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn grl_layer_sheds_the_least_critical_tier_first() {
    let _heavy = super::HEAVY.lock().await;
    use std::sync::atomic::{AtomicU64, Ordering};

    const LIMIT: f64 = 200.0;
    let dir = tempfile::tempdir().unwrap();
    let config = json!({"version": "v1", "services": [{"service": "payments",
        "criticality": {"caps": {"batch-*": "SHEDDABLE"}},
        "buckets": [{"name": "charge", "procedure": "charge", "scope": "global",
                     "limit_rps": LIMIT, "mode": "enforce", "policy": "peak"}]}]});
    let (_fleet, agg) = controller_and_aggregator(dir.path(), &config).await;
    let http = reqwest::Client::new();
    let served = |proto: Option<&'static str>| {
        let mut req = http
            .get(format!("{agg}/v1/config?service=payments"))
            .bearer_auth(super::CLIENT_TOKEN);
        if let Some(p) = proto {
            req = req.header("grl-proto", p);
        }
        async move {
            req.send()
                .await
                .unwrap()
                .json::<serde_json::Value>()
                .await
                .unwrap()
        }
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while served(None).await["version"] != "v1" && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let caps = &served(Some("9")).await["services"][0]["criticality"]["caps"];
    assert_eq!(caps["batch-*"], "SHEDDABLE", "{caps}");
    let old = served(None).await;
    assert!(old["services"][0].get("criticality").is_none(), "{old}");
    assert_eq!(old["services"][0]["buckets"][0]["name"], "charge");

    let stop = Arc::new(AtomicBool::new(false));
    // [ok, refused] for CRITICAL and SHEDDABLE.
    let counts: Arc<[[AtomicU64; 2]; 2]> = Arc::default();
    let mut clients = Vec::new();
    let mut tasks = Vec::new();
    for i in 0..2 {
        let (client, svc) = layer_client(&agg, &format!("layer{i}"));
        clients.push(client);
        // (requests/s, caller, extra header, tier index in `counts`)
        for (rps, caller, header, tier) in [
            (30.0, "gw", Some(("rpc-criticality", "CRITICAL")), 0),
            (30.0, "gw", None, 0),
            (
                45.0,
                "batch-1",
                Some(("rpc-criticality", "CRITICAL_PLUS")),
                1,
            ),
            (45.0, "gw", Some(("baggage", "criticality=sheddable")), 1),
        ] {
            let counts = counts.clone();
            let count = move |refused: bool| {
                counts[tier][refused as usize].fetch_add(1, Ordering::Relaxed);
            };
            let svc = svc.clone();
            tasks.push(paced_layer(svc, rps, caller, header, count, stop.clone()));
        }
    }
    let take = || {
        counts
            .each_ref()
            .map(|c| c.each_ref().map(|n| n.swap(0, Ordering::Relaxed)))
    };
    tokio::time::sleep(Duration::from_secs(6)).await;
    take();
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let secs = t0.elapsed().as_secs_f64();
    let [[c_ok, c_refused], [s_ok, s_refused]] = take();
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    drop(clients);
    let admitted = (c_ok + s_ok) as f64 / secs;
    eprintln!(
        "GrlLayer: admitted {admitted:.1} rps (limit {LIMIT}); CRITICAL ok/429 {c_ok}/{c_refused}, SHEDDABLE ok/429 {s_ok}/{s_refused}"
    );
    assert!(
        (admitted - LIMIT).abs() <= 0.05 * LIMIT,
        "admitted {admitted:.1} rps"
    );
    assert!(
        (c_refused as f64) < 0.01 * (c_ok + c_refused) as f64,
        "CRITICAL refused {c_refused} of {}",
        c_ok + c_refused
    );
    let s_rate = s_ok as f64 / secs;
    assert!(
        (s_rate - 80.0).abs() <= 10.0,
        "SHEDDABLE admitted {s_rate:.1} rps"
    );
}

/// Mixed versions, real controller and aggregator processes: a client of the previous
/// protocol (an emulated protocol-7 client: it reports its counts without tiers every 200 ms
/// and drops the uniform ratio of the reply) offers 100 rps beside a `GrlLayer` client of this
/// version offering 60 rps CRITICAL and 90 rps SHEDDABLE, against 200 rps. The zone's mix of
/// tiers is then unknown, so every tier drops the bucket's ratio (as before tiers existed) and
/// the bucket stays at its limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_of_the_previous_protocol_keeps_the_bucket_at_its_limit() {
    let _heavy = super::HEAVY.lock().await;
    use std::sync::atomic::{AtomicU64, Ordering};

    const LIMIT: f64 = 200.0;
    let dir = tempfile::tempdir().unwrap();
    let config = super::payments_config("v1", LIMIT);
    let (_fleet, agg) = controller_and_aggregator(dir.path(), &config).await;
    let stop = Arc::new(AtomicBool::new(false));

    // This version: [ok, refused] of CRITICAL and SHEDDABLE.
    let counts: Arc<[[AtomicU64; 2]; 2]> = Arc::default();
    let (client, svc) = layer_client(&agg, "layer-v8");
    let mut tasks = Vec::new();
    for (rps, tier, i) in [(60.0, "CRITICAL", 0), (90.0, "SHEDDABLE", 1)] {
        let counts = counts.clone();
        let count = move |refused: bool| {
            counts[i][refused as usize].fetch_add(1, Ordering::Relaxed);
        };
        let header = Some(("rpc-criticality", tier));
        tasks.push(paced_layer(
            svc.clone(),
            rps,
            "gw",
            header,
            count,
            stop.clone(),
        ));
    }

    // The previous protocol: 20 requests per 200 ms, the reply's ratio dropped (a carry keeps
    // the admitted count exact), counts reported without tiers under `grl-proto: 7`.
    let legacy_ok = Arc::new(AtomicU64::new(0));
    let legacy = {
        let (stop, ok, agg) = (stop.clone(), legacy_ok.clone(), agg.clone());
        tokio::spawn(async move {
            let http = reqwest::Client::new();
            let (mut ratio, mut carry) = (0.0f64, 0.0f64);
            let mut iv = tokio::time::interval(Duration::from_millis(200));
            while !stop.load(Ordering::Relaxed) {
                iv.tick().await;
                carry += 20.0 * (1.0 - ratio);
                let admitted = carry.floor();
                carry -= admitted;
                ok.fetch_add(admitted as u64, Ordering::Relaxed);
                let report = json!({
                    "client_id": "legacy-v7", "service": "payments", "version": "v1",
                    "interval_ms": 200,
                    "buckets": [{"bucket": "gw.charge", "offered": 20, "admitted": admitted as u64,
                                 "dropped": 20 - admitted as u64, "shadow_dropped": 0}]
                });
                let reply = http
                    .post(format!("{agg}/v1/report"))
                    .header("grl-proto", "7")
                    .bearer_auth(super::CLIENT_TOKEN)
                    .json(&report)
                    .timeout(Duration::from_secs(2))
                    .send()
                    .await;
                let Ok(reply) = reply else { continue };
                let Ok(d) = reply.json::<serde_json::Value>().await else {
                    continue;
                };
                // A client of protocol 7 reads the ratio alone; a split must not reach it.
                if let Some(dir) = d["directives"].as_array().and_then(|a| a.first()) {
                    assert!(dir.get("shed").is_none(), "{d}");
                    ratio = dir["ratio"].as_f64().unwrap_or(ratio);
                }
            }
        })
    };
    let take = || {
        let tiered = counts
            .each_ref()
            .map(|c| c.each_ref().map(|n| n.swap(0, Ordering::Relaxed)));
        (tiered, legacy_ok.swap(0, Ordering::Relaxed))
    };
    tokio::time::sleep(Duration::from_secs(6)).await;
    take();
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let secs = t0.elapsed().as_secs_f64();
    let ([[c_ok, c_refused], [s_ok, s_refused]], l_ok) = take();
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    legacy.await.unwrap();
    drop(client);
    let admitted = (c_ok + s_ok + l_ok) as f64 / secs;
    let share = |ok: u64, refused: u64| refused as f64 / (ok + refused).max(1) as f64;
    eprintln!(
        "mixed versions: admitted {admitted:.1} rps (limit {LIMIT}); legacy {:.1} rps; CRITICAL ok/429 {c_ok}/{c_refused}, SHEDDABLE ok/429 {s_ok}/{s_refused}",
        l_ok as f64 / secs
    );
    assert!(
        (admitted - LIMIT).abs() <= 0.05 * LIMIT,
        "admitted {admitted:.1} rps"
    );
    // The uniform fallback: both tiers of the new client lose about the bucket's fifth.
    for (tier, ok, refused) in [
        ("CRITICAL", c_ok, c_refused),
        ("SHEDDABLE", s_ok, s_refused),
    ] {
        let s = share(ok, refused);
        assert!((s - 0.2).abs() <= 0.07, "{tier} refused {s:.3}");
    }
}

/// A controller and an aggregator (real processes) serving `config`: the processes (kept
/// until dropped) and the aggregator's URL.
async fn controller_and_aggregator(
    dir: &std::path::Path,
    config: &serde_json::Value,
) -> (
    (test_support::process::Proc, test_support::process::Proc),
    String,
) {
    let (ctl, _, base) = super::start_controller(&dir.join("state"), dir, &[]).await;
    super::push_config(&reqwest::Client::new(), &base, config).await;
    let (agg, url) = super::start_aggregator(&base, "agg-a", dir).await;
    ((ctl, agg), url)
}

/// A `GrlClient` named `id` reporting to `agg` every 200 ms, and a `GrlLayer` of it (caller
/// from `rpc-caller`, procedure `charge`) before a service that answers 200.
fn layer_client(
    agg: &str,
    id: &str,
) -> (
    grl_client::client::GrlClient,
    impl tower::Service<
            http::Request<()>,
            Response = http::Response<String>,
            Error = std::convert::Infallible,
            Future: Send,
        > + Clone
        + Send
        + 'static,
) {
    use grl_client::client::{ClientOptions, GrlClient};
    use grl_client::layer::{GrlLayer, KeyFrom};
    use tower::Layer;

    let mut o = ClientOptions::new("payments", vec![agg.to_string()]);
    o.client_id = Some(id.into());
    o.report_token = Some(super::CLIENT_TOKEN.into());
    o.tick = Duration::from_millis(200);
    let client = GrlClient::start(o);
    let svc = GrlLayer::for_client(&client)
        .caller_from(KeyFrom::Header(http::HeaderName::from_static("rpc-caller")))
        .procedure_from(KeyFrom::Fixed("charge".into()))
        .layer(tower::service_fn(|_req: http::Request<()>| async {
            Ok::<_, std::convert::Infallible>(http::Response::new(String::new()))
        }));
    (client, svc)
}

/// Sends `rps` requests a second of `caller` (with `header`, if any) through `svc` until
/// `stop`, telling `count` of each whether it was refused (429).
fn paced_layer<S>(
    mut svc: S,
    rps: f64,
    caller: &'static str,
    header: Option<(&'static str, &'static str)>,
    count: impl Fn(bool) + Send + 'static,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<()>
where
    S: tower::Service<http::Request<()>, Response = http::Response<String>> + Send + 'static,
    S::Future: Send,
    S::Error: std::fmt::Debug,
{
    use tower::ServiceExt;
    tokio::spawn(async move {
        let mut iv = tokio::time::interval(Duration::from_secs_f64(1.0 / rps));
        iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            iv.tick().await;
            let mut req = http::Request::builder().header("rpc-caller", caller);
            if let Some((k, v)) = header {
                req = req.header(k, v);
            }
            let req = req.body(()).unwrap();
            let resp = svc.ready().await.unwrap().call(req).await.unwrap();
            count(resp.status() == http::StatusCode::TOO_MANY_REQUESTS);
        }
    })
}
