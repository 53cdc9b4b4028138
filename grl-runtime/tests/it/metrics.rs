//! `/metrics` of real `grl` processes and of an embedded client, over HTTP on loopback: the
//! series the dashboards and alerting rules in `deploy/` read.

use std::sync::Arc;
use std::time::Duration;

use grl_client::client::{ClientOptions, GrlClient};
use serde_json::json;
use test_support::process::free_port;

use super::{eventually, put_config, start_aggregator, start_controller, REPORT_TOKEN};

/// Every sample line of `metric` (exact family sample name) in `text`.
fn samples<'a>(text: &'a str, metric: &str) -> Vec<&'a str> {
    text.lines()
        .filter(|l| {
            l.strip_prefix(metric)
                .is_some_and(|r| r.starts_with('{') || r.starts_with(' '))
        })
        .collect()
}

/// The value of the one sample of `metric` whose line contains every string of `labels`.
fn value(text: &str, metric: &str, labels: &[&str]) -> Option<f64> {
    let found: Vec<&str> = samples(text, metric)
        .into_iter()
        .filter(|l| labels.iter().all(|x| l.contains(x)))
        .collect();
    assert!(found.len() <= 1, "several series match: {found:?}");
    found.first()?.rsplit(' ').next()?.parse().ok()
}

async fn get(http: &reqwest::Client, url: &str) -> (String, String) {
    let r = http.get(url).send().await.unwrap();
    assert_eq!(r.status(), 200, "{url}");
    let ct = r.headers()["content-type"].to_str().unwrap().to_string();
    (ct, r.text().await.unwrap())
}

fn config(version: &str, mode: &str, limit: f64) -> serde_json::Value {
    json!({"version": version, "services": [{"service": "payments", "buckets": [
        {"name": "gw.charge", "caller": "gw", "procedure": "charge", "scope": "global",
         "limit_rps": limit, "mode": mode, "policy": "peak"}]}]})
}

async fn push(http: &reqwest::Client, base: &str, doc: &serde_json::Value) {
    let r = put_config(http, base, doc).await;
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
}

/// One zone report of `offered` requests (a tenth over the limit dropped or shadow-dropped).
async fn report(http: &reqwest::Client, base: &str, offered: u64, shadow: bool) {
    let over = offered / 10;
    let (dropped, shadow_dropped) = if shadow { (0, over) } else { (over, 0) };
    let r = http
        .post(format!("{base}/v1/aggregate"))
        .bearer_auth(REPORT_TOKEN)
        .json(
            &json!({"aggregator_id": "agg-z1", "region": "r1", "zone": "z1", "buckets": [
            {"service": "payments", "bucket": "gw.charge", "offered_rps": offered as f64,
             "admitted_rps": (offered - dropped) as f64, "dropped_rps": dropped as f64,
             "shadow_dropped_rps": shadow_dropped as f64,
             "counts": {"bucket": "gw.charge", "offered": offered, "admitted": offered - dropped,
                        "dropped": dropped, "shadow_dropped": shadow_dropped}}]}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
}

/// A bucket promoted from shadow to enforce: `grl_bucket_info` changes its `mode` label, the
/// request counters keep one series each (no `mode` label) and go on counting, and the
/// limit gauge follows the config.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mode_change_moves_bucket_info_without_splitting_the_counters() {
    let dir = tempfile::tempdir().unwrap();
    let (_ctl, _, base) = start_controller(&dir.path().join("state"), dir.path(), &[]).await;
    let http = reqwest::Client::new();
    push(&http, &base, &config("v1", "shadow", 100.0)).await;
    report(&http, &base, 1000, true).await;

    let (ct, m) = get(&http, &format!("{base}/metrics")).await;
    assert!(ct.starts_with("application/openmetrics-text"), "{ct}");
    assert!(m.ends_with("# EOF\n"), "{m}");
    let bucket = ["service=\"payments\"", "bucket=\"gw.charge\""];
    let info = samples(&m, "grl_bucket_info");
    assert_eq!(info.len(), 1, "{m}");
    assert!(
        info[0].contains("mode=\"shadow\"")
            && info[0].contains("scope=\"global\"")
            && info[0].contains("policy=\"peak\"")
            && info[0].ends_with(" 1"),
        "{m}"
    );
    assert_eq!(value(&m, "grl_bucket_limit_rps", &bucket), Some(100.0));
    assert_eq!(
        value(&m, "grl_requests_offered_total", &bucket),
        Some(1000.0)
    );
    assert_eq!(
        value(&m, "grl_requests_shadow_dropped_total", &bucket),
        Some(100.0)
    );
    assert_eq!(value(&m, "grl_config_info", &["version=\"v1\""]), Some(1.0));
    // The zone counts while it reported within the TTL (3 ticks): present, at most 1.
    assert!(
        value(&m, "grl_controller_zones", &[]).is_some_and(|z| z <= 1.0),
        "{m}"
    );
    assert!(
        value(&m, "grl_build_info", &["component=\"controller\""]) == Some(1.0),
        "{m}"
    );
    assert!(
        !m.contains("mode=\"shadow\",zone"),
        "mode on a counter: {m}"
    );

    // Promotion: enforce, and a new limit.
    push(&http, &base, &config("v2", "enforce", 150.0)).await;
    report(&http, &base, 500, false).await;
    let (_, m) = get(&http, &format!("{base}/metrics")).await;
    let info = samples(&m, "grl_bucket_info");
    assert_eq!(info.len(), 1, "the old mode's series must be gone: {m}");
    assert!(info[0].contains("mode=\"enforce\""), "{m}");
    assert_eq!(value(&m, "grl_bucket_limit_rps", &bucket), Some(150.0));
    for (metric, want) in [
        ("grl_requests_offered_total", 1500.0),
        ("grl_requests_admitted_total", 1450.0),
        ("grl_requests_dropped_total", 50.0),
        ("grl_requests_shadow_dropped_total", 100.0),
    ] {
        assert_eq!(samples(&m, metric).len(), 1, "{metric} split: {m}");
        assert_eq!(value(&m, metric, &bucket), Some(want), "{metric}: {m}");
    }
    assert_eq!(value(&m, "grl_config_info", &["version=\"v2\""]), Some(1.0));
    assert_eq!(samples(&m, "grl_config_info").len(), 1, "{m}");
}

/// The aggregator's `/metrics`: accepted reports, clients per service, forward latency; a
/// dead controller shows as forward failures.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aggregator_metrics_count_reports_clients_and_forwards() {
    let dir = tempfile::tempdir().unwrap();
    let (ctl, _, base) = start_controller(&dir.path().join("state"), dir.path(), &[]).await;
    let http = reqwest::Client::new();
    push(&http, &base, &config("v1", "enforce", 100.0)).await;
    let (_agg, aurl) = start_aggregator(&base, "agg-m", dir.path()).await;

    let mut clients = Vec::new();
    for i in 0..3 {
        let mut o = ClientOptions::new("payments", vec![aurl.clone()]);
        o.tick = Duration::from_millis(100);
        o.client_id = Some(format!("m{i}"));
        o.report_token = Some(super::CLIENT_TOKEN.into());
        clients.push(Arc::new(GrlClient::start(o)));
    }
    let url = format!("{aurl}/metrics");
    eventually("three clients and forwards counted", || {
        let (http, url) = (http.clone(), url.clone());
        async move {
            let (_, m) = get(&http, &url).await;
            value(&m, "grl_aggregator_clients", &["service=\"payments\""]) == Some(3.0)
                && value(&m, "grl_aggregator_forward_duration_seconds_count", &[])
                    .is_some_and(|n| n >= 3.0)
        }
    })
    .await;
    let (ct, m) = get(&http, &url).await;
    assert!(ct.starts_with("application/openmetrics-text"), "{ct}");
    assert!(
        value(&m, "grl_reports_accepted_total", &[]).unwrap() >= 3.0,
        "{m}"
    );
    assert_eq!(
        value(&m, "grl_aggregator_forward_failures_total", &[]),
        Some(0.0)
    );
    let age = value(&m, "grl_aggregator_directives_age_seconds", &[]).unwrap();
    assert!((0.0..5.0).contains(&age), "{m}");
    assert_eq!(
        value(&m, "grl_build_info", &["component=\"aggregator\""]),
        Some(1.0)
    );

    ctl.kill();
    eventually("forward failures counted", || {
        let (http, url) = (http.clone(), url.clone());
        async move {
            let (_, m) = get(&http, &url).await;
            value(&m, "grl_aggregator_forward_failures_total", &[]).is_some_and(|n| n >= 2.0)
        }
    })
    .await;
}

/// An embedded client's registry served by the embedding service (here an axum server on
/// loopback): a hostile service name is escaped, one series per metric, and the counters
/// read what the reporter counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_metrics_escape_hostile_label_values() {
    let hostile = "pay\"} 1\ngrl_client_failing_open{service=\"x\\";
    // No aggregator listens: the client counts errors and stays open.
    let mut o = ClientOptions::new(hostile, vec![format!("http://127.0.0.1:{}", free_port())]);
    o.tick = Duration::from_millis(100);
    let client = GrlClient::start(o);
    let registry = Arc::new(client.registry());
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let r = registry.clone();
            async move { grl_server::metrics::response(&r) }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    let http = reqwest::Client::new();
    let url = format!("http://{addr}/metrics");
    eventually("report errors counted", || {
        let (http, url) = (http.clone(), url.clone());
        async move {
            let (_, m) = get(&http, &url).await;
            value(&m, "grl_client_report_errors_total", &[]).is_some_and(|n| n >= 2.0)
        }
    })
    .await;
    let (_, m) = get(&http, &url).await;
    let escaped = "service=\"pay\\\"} 1\\ngrl_client_failing_open{service=\\\"x\\\\\"";
    let open = samples(&m, "grl_client_failing_open");
    assert_eq!(open.len(), 1, "a forged series: {m}");
    assert!(open[0].contains(escaped), "{m}");
    // Never answered: nothing to go stale from, and no age.
    assert_eq!(value(&m, "grl_client_reports_total", &[]), Some(0.0));
    assert!(
        samples(&m, "grl_client_directives_age_seconds").is_empty(),
        "{m}"
    );
    assert_eq!(
        value(&m, "grl_build_info", &["component=\"client\""]),
        Some(1.0)
    );
    server.abort();
}

/// The text of a client's registry (what its embedding service serves).
pub(crate) fn client_metrics(c: &GrlClient) -> String {
    grl_client::metrics::encode(&c.registry())
}

/// The value of a client series in [`client_metrics`]' text.
pub(crate) fn client_value(text: &str, metric: &str) -> f64 {
    value(text, metric, &[]).unwrap_or_else(|| panic!("no {metric}: {text}"))
}

/// Every request counted by (caller, procedure), matched by a bucket or not: an axum service
/// with `GrlLayer::for_client`, a real aggregator and a real controller bounded to two
/// labelled callers per service. The controller's `grl_calls_total` holds the exact counts;
/// the third caller is folded into `_other` and the fold is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_are_counted_matched_or_not_and_folded_beyond_the_bound() {
    let dir = tempfile::tempdir().unwrap();
    let (_ctl, _, base) = start_controller(
        &dir.path().join("state"),
        dir.path(),
        &["--calls-max-callers", "2"],
    )
    .await;
    let http = reqwest::Client::new();
    push(&http, &base, &config("v1", "enforce", 1000.0)).await;
    let (_agg, aurl) = start_aggregator(&base, "agg-calls", dir.path()).await;

    let mut o = ClientOptions::new("payments", vec![aurl.clone()]);
    o.tick = Duration::from_millis(100);
    o.report_token = Some(super::CLIENT_TOKEN.into());
    let client = GrlClient::start(o);
    let app = axum::Router::new()
        .route("/{proc}", axum::routing::get(|| async { "ok" }))
        .layer(
            grl_client::layer::GrlLayer::for_client(&client)
                .procedure_from(grl_client::layer::KeyFrom::PathSegment(0)),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    let call = |caller: &'static str, proc_: &'static str, n: usize| {
        let (http, url) = (http.clone(), format!("http://{addr}/{proc_}"));
        async move {
            for _ in 0..n {
                let r = http
                    .get(&url)
                    .header("x-caller", caller)
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status(), 200);
            }
        }
    };
    eventually("the client runs v1", || {
        let v = client.limiter().table().version().to_string();
        async move { v == "v1" }
    })
    .await;
    // gw.charge has a bucket; web's refunds and batch's charges match none.
    call("gw", "charge", 30).await;
    call("web", "refund", 20).await;
    // Two labelled callers are known before the third one arrives.
    let url = format!("{base}/metrics");
    eventually("gw and web labelled", || {
        let (http, url) = (http.clone(), url.clone());
        async move {
            let (_, m) = get(&http, &url).await;
            value(&m, "grl_calls_total", &["caller=\"web\""]) == Some(20.0)
        }
    })
    .await;
    call("batch", "charge", 5).await;
    call("gw", "refund", 2).await;
    eventually("every call at the controller", || {
        let (http, url) = (http.clone(), url.clone());
        async move {
            let (_, m) = get(&http, &url).await;
            let total: f64 = samples(&m, "grl_calls_total")
                .iter()
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum();
            total >= 57.0
        }
    })
    .await;
    let (_, m) = get(&http, &url).await;
    let svc = "service=\"payments\"";
    let calls = |caller: &str, procedure: &str| {
        value(
            &m,
            "grl_calls_total",
            &[
                svc,
                &format!("caller=\"{caller}\""),
                &format!("procedure=\"{procedure}\""),
            ],
        )
    };
    assert_eq!(calls("gw", "charge"), Some(30.0), "{m}");
    assert_eq!(calls("gw", "refund"), Some(2.0), "{m}");
    assert_eq!(calls("web", "refund"), Some(20.0), "{m}");
    assert_eq!(calls("_other", "charge"), Some(5.0), "{m}");
    assert_eq!(calls("batch", "charge"), None, "{m}");
    assert_eq!(samples(&m, "grl_calls_total").len(), 4, "{m}");
    assert_eq!(value(&m, "grl_calls_folded_total", &[svc]), Some(5.0));
    // The bucket counters see only the matched traffic.
    assert_eq!(
        value(&m, "grl_requests_offered_total", &["bucket=\"gw.charge\""]),
        Some(30.0)
    );

    // The real client sent its reports (calls included) in the binary encoding once the
    // aggregator announced protocol 3: every report after the first (sent before any answer,
    // in JSON) was binary.
    let (_, am) = get(&http, &format!("{aurl}/metrics")).await;
    let accepted = value(&am, "grl_reports_accepted_total", &[]).unwrap();
    let binary = value(&am, "grl_reports_binary_total", &[]).unwrap();
    assert!(accepted >= 3.0 && binary >= accepted - 2.0, "{am}");

    // A protocol-1 client (no grl-proto header, no calls) is still served, and told that
    // the aggregator's protocol version.
    let r = http
        .post(format!("{aurl}/v1/report"))
        .bearer_auth(super::CLIENT_TOKEN)
        .json(
            &json!({"client_id": "old", "service": "payments", "version": "", "interval_ms": 1000,
                      "buckets": []}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers()["grl-proto"],
        grl_wire::PROTO_VERSION.to_string().as_str()
    );
    server.abort();
}
