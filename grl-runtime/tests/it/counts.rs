//! Every request counted once at the controller: trickles of a few requests a second (whose
//! rates barely move between ticks, so a delta zone report leaves the bucket out) through a
//! real `grl sidecar` and through `GrlLayer`, with a real aggregator and controller, each on
//! the default one-second tick.

use std::process::{Command, Stdio};
use std::time::Duration;

use grl_client::client::{ClientOptions, GrlClient};
use serde_json::json;
use test_support::process::{free_port, Proc};

use super::{
    eventually, get_text, log_file, put_config, spawn_aggregator_ticking, start_controller,
    wait_up, CLIENT_TOKEN,
};

/// A service answering `ok` to every path, for the sidecar to forward to.
async fn upstream() -> (String, tokio::task::JoinHandle<()>) {
    let app = axum::Router::new().fallback(|| async { "ok" });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    (format!("http://{addr}"), task)
}

/// `(offered, admitted)` of `bucket` in the controller's `/metrics`, summed over zones.
async fn totals(http: &reqwest::Client, base: &str, bucket: &str) -> (u64, u64) {
    let m = get_text(http, &format!("{base}/metrics")).await;
    let sum = |metric: &str| -> u64 {
        m.lines()
            .filter(|l| l.starts_with(&format!("{metric}{{")))
            .filter(|l| l.contains(&format!("bucket=\"{bucket}\"")))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    };
    (
        sum("grl_requests_offered_total"),
        sum("grl_requests_admitted_total"),
    )
}

/// `(offered, admitted)` of `bucket` at the controller once `offered` reached `sent`, or
/// after 15 s (a bound against hangs: counts arrive with the next forwards, about 2 s).
async fn counted(http: &reqwest::Client, base: &str, bucket: &str, sent: u64) -> (u64, u64) {
    let mut seen = (0, 0);
    for _ in 0..150 {
        seen = totals(http, base, bucket).await;
        if seen.0 >= sent {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    seen
}

/// `grl sidecar` for `payments` in front of `up`, reporting to the aggregator at `aurl`, and
/// waited for until it decides with config `version` (before, a request matches no bucket and
/// counts as a call only): the process, its port and its admin port.
async fn sidecar_deciding(
    http: &reqwest::Client,
    dir: &std::path::Path,
    up: &str,
    aurl: &str,
    version: &str,
) -> (Proc, u16, u16) {
    let (port, admin) = (free_port(), free_port());
    let p = Proc::spawn(
        Command::new(env!("CARGO_BIN_EXE_grl"))
            .args(["sidecar", "--listen", &format!("127.0.0.1:{port}")])
            .args(["--admin-listen", &format!("127.0.0.1:{admin}")])
            .args(["--upstream", up, "--service", "payments"])
            .args(["--zone", "z1", "--region", "r1", "--aggregator", aurl])
            .env("GRL_CLIENT_TOKEN", CLIENT_TOKEN)
            .stdout(Stdio::null())
            .stderr(log_file(dir, "sidecar")),
    )
    .unwrap();
    let metrics = format!("http://127.0.0.1:{admin}/metrics");
    wait_up(&format!("http://127.0.0.1:{admin}/healthz")).await;
    let want = format!("grl_client_config_info{{service=\"payments\",version=\"{version}\"}} 1");
    eventually("the sidecar decides with the config", || {
        let (http, metrics, want) = (http.clone(), metrics.clone(), want.clone());
        async move { get_text(&http, &metrics).await.contains(&want) }
    })
    .await;
    (p, port, admin)
}

/// Sends `n` requests, one every `1/rps` seconds, each answered 200.
async fn trickle(http: &reqwest::Client, url: &str, headers: &[(&str, &str)], rps: u64, n: u64) {
    let mut iv = tokio::time::interval(Duration::from_micros(1_000_000 / rps));
    for _ in 0..n {
        iv.tick().await;
        let mut req = http.get(url);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let r = req.send().await.unwrap();
        assert_eq!(r.status(), 200, "{url}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trickles_are_counted_exactly_through_the_sidecar_and_the_layer() {
    let dir = tempfile::tempdir().unwrap();
    let (_ctl, _, base) = start_controller(&dir.path().join("state"), dir.path(), &[]).await;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    // Limits far above the load: nothing is refused, every request is offered and admitted.
    let doc = json!({"version": "v1", "services": [{"service": "payments", "buckets": [
        {"name": "gw.charge", "caller": "gw", "procedure": "charge", "scope": "global",
         "limit_rps": 10000.0, "mode": "enforce", "policy": "peak"},
        {"name": "web.refund", "caller": "web", "procedure": "refund", "scope": "global",
         "limit_rps": 10000.0, "mode": "enforce", "policy": "peak"}]}]});
    let r = put_config(&http, &base, &doc).await;
    assert_eq!(r.status(), 200);
    let aport = free_port();
    let aurl = format!("http://127.0.0.1:{aport}");
    let _agg = spawn_aggregator_ticking(aport, &base, "agg-trickle", dir.path(), 1000);
    wait_up(&format!("{aurl}/v1/config")).await;

    // The sidecar, on its default tick, deciding with v1 before the first request.
    let (up, _up_task) = upstream().await;
    let (_sidecar, sport, _) = sidecar_deciding(&http, dir.path(), &up, &aurl, "v1").await;

    // GrlLayer in an axum service, its client on the default tick.
    let mut o = ClientOptions::new("payments", vec![aurl.clone()]);
    o.report_token = Some(CLIENT_TOKEN.into());
    let client = GrlClient::start(o);
    let app = axum::Router::new()
        .route("/{proc}", axum::routing::get(|| async { "ok" }))
        .layer(
            grl_client::layer::GrlLayer::for_client(&client)
                .procedure_from(grl_client::layer::KeyFrom::PathSegment(0)),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let _server = tokio::spawn(async move { axum::serve(listener, app).await });

    let sidecar_url = format!("http://127.0.0.1:{sport}/charge");
    let layer_url = format!("http://{addr}/refund");
    // Both clients run v1 before the first request (an earlier one matches no bucket).
    eventually("the layer's client runs v1", || {
        let v = client.limiter().table().version().to_string();
        async move { v == "v1" }
    })
    .await;

    let mut sent = 0u64;
    for rps in [1u64, 4, 7, 10] {
        let n = rps * 5;
        tokio::join!(
            trickle(
                &http,
                &sidecar_url,
                &[("rpc-caller", "gw"), ("rpc-procedure", "charge")],
                rps,
                n
            ),
            trickle(&http, &layer_url, &[("x-caller", "web")], rps, n),
        );
        sent += n;
        for bucket in ["gw.charge", "web.refund"] {
            let seen = counted(&http, &base, bucket, sent).await;
            // Never more than were sent either, and admitted as they were.
            assert_eq!(
                seen,
                (sent, sent),
                "(offered, admitted) of {bucket} at the controller after the {rps}/s trickle"
            );
        }
    }
}

/// A steady load, many requests in flight at once: 150 requests/s for 10 s through one
/// sidecar, every one counted once at the controller. The load starts once the sidecar says
/// (`grl_client_config_info`) that it decides with the bucket config: before, a request
/// matches no bucket and counts as a call only (sending on `grl_client_failing_open 0` alone
/// lost the first 20 to 30 requests of the bucket's counts).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_steady_concurrent_load_is_counted_exactly_through_the_sidecar() {
    let _heavy = super::HEAVY.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let (_ctl, _, base) = start_controller(&dir.path().join("state"), dir.path(), &[]).await;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let doc = json!({"version": "v1", "services": [{"service": "payments", "buckets": [
        {"name": "gw.charge", "caller": "gw", "scope": "global",
         "limit_rps": 10000.0, "mode": "shadow", "policy": "peak"}]}]});
    assert_eq!(put_config(&http, &base, &doc).await.status(), 200);
    let aport = free_port();
    let aurl = format!("http://127.0.0.1:{aport}");
    let _agg = spawn_aggregator_ticking(aport, &base, "agg-steady", dir.path(), 1000);
    wait_up(&format!("{aurl}/v1/config")).await;
    let (up, _up_task) = upstream().await;
    let (_sidecar, sport, sadmin) = sidecar_deciding(&http, dir.path(), &up, &aurl, "v1").await;
    let url = format!("http://127.0.0.1:{sport}/charge");
    let mut iv = tokio::time::interval(Duration::from_micros(1_000_000 / 150));
    let mut tasks = Vec::new();
    for _ in 0..1500 {
        iv.tick().await;
        let (http, url) = (http.clone(), url.clone());
        tasks.push(tokio::spawn(async move {
            http.get(&url)
                .header("rpc-caller", "gw")
                .send()
                .await
                .map(|r| r.status().as_u16())
        }));
    }
    let mut ok = 0u64;
    for t in tasks {
        if matches!(t.await.unwrap(), Ok(200)) {
            ok += 1;
        }
    }
    assert_eq!(ok, 1500, "every request answered");
    let seen = counted(&http, &base, "gw.charge", ok).await;
    let m = get_text(&http, &format!("http://127.0.0.1:{sadmin}/metrics")).await;
    let am = get_text(&http, &format!("{aurl}/metrics")).await;
    let am: Vec<&str> = am.lines().filter(|l| !l.starts_with('#')).collect();
    assert_eq!(
        seen,
        (ok, ok),
        "(offered, admitted) at the controller; the sidecar:\n{m}\nthe aggregator:\n{}",
        am.join("\n")
    );
}
