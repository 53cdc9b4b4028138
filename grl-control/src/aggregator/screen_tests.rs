//! Client reports screened, against a real controller and aggregator over HTTP: what one
//! client claims (its calls, its buckets' counts) reaches the controller's counters
//! (`grl_calls_total`, `grl_requests_offered_total` and its siblings) no further than a
//! plausible instance could add, honest clients' pass untouched, and invented client ids
//! hold no more than their budget.

use super::*;
use serde_json::json;

const TOKEN: &str = "t0ken";

fn config() -> serde_json::Value {
    json!({"version": "v1", "services": [{"service": "payments", "buckets": [
        {"name": "gw.charge", "caller": "gw", "procedure": "charge", "scope": "global",
         "limit_rps": 100.0, "mode": "enforce", "policy": "peak"}]}]})
}

/// Posts one client report; its status.
async fn post_report(http: &reqwest::Client, url: &str, report: serde_json::Value) -> u16 {
    http.post(format!("{url}/v1/report"))
        .header(PROTO_HEADER, PROTO_VERSION.to_string())
        .json(&report)
        .send()
        .await
        .map(|r| r.status().as_u16())
        .unwrap_or(0)
}

/// A report of payments carrying `offered` requests of `gw.charge` over `interval_ms` (a
/// tenth of them dropped, a twentieth shadow-dropped).
fn counts_report(id: &str, interval_ms: u64, offered: u64) -> serde_json::Value {
    let dropped = offered / 10;
    json!({"client_id": id, "service": "payments", "version": "v1", "interval_ms": interval_ms,
        "buckets": [{"bucket": "gw.charge", "offered": offered, "admitted": offered - dropped,
        "dropped": dropped, "shadow_dropped": offered / 20}]})
}

/// The sum of the samples of `metric` whose labels include every one of `labels`
/// (`name="value"`).
fn total(metrics: &str, metric: &str, labels: &[&str]) -> u64 {
    let start = format!("{metric}{{");
    metrics
        .lines()
        .filter(|l| l.starts_with(&start) && labels.iter().all(|x| l.contains(x)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// `grl_calls_total` of `service` and `caller`, summed over procedures.
fn calls_total(metrics: &str, service: &str, caller: &str) -> u64 {
    let (s, c) = (
        format!("service=\"{service}\""),
        format!("caller=\"{caller}\""),
    );
    total(metrics, "grl_calls_total", &[&s, &c])
}

/// The controller's `grl_requests_{offered,admitted,dropped,shadow_dropped}_total` of
/// payments' `gw.charge`.
fn charge_totals(metrics: &str) -> [u64; 4] {
    ["offered", "admitted", "dropped", "shadow_dropped"].map(|c| {
        let name = format!("grl_requests_{c}_total");
        total(
            metrics,
            &name,
            &["service=\"payments\"", "bucket=\"gw.charge\""],
        )
    })
}

/// `charge_totals` once they stopped moving (two reads three forwards apart agree).
async fn settled_charge_totals(http: &reqwest::Client, url: &str) -> [u64; 4] {
    let mut last = charge_totals(&metrics(http, url).await);
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let now = charge_totals(&metrics(http, url).await);
        if now == last {
            break;
        }
        last = now;
    }
    last
}

async fn metrics(http: &reqwest::Client, url: &str) -> String {
    match http.get(format!("{url}/metrics")).send().await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

/// A controller and an aggregator forwarding every 100 ms (anonymous reports), every bucket
/// with its counts in every forward.
async fn fleet(
    dir: &std::path::Path,
    plausibility: screen::Plausibility,
) -> (grl_server::http_util::ServerHandle, AggregatorHandle) {
    let c = crate::tests::anonymous_controller(dir.join("c"), TOKEN).await;
    let r = reqwest::Client::new()
        .put(format!("{}/v1/config", c.url()))
        .bearer_auth(TOKEN)
        .json(&config())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let a = Aggregator::start(AggregatorOptions {
        controllers: vec![c.url()],
        zone: "z1".into(),
        region: "r1".into(),
        tick: Duration::from_millis(100),
        allow_anonymous_reports: true,
        delta: crate::delta::DeltaOptions {
            threshold: 0.0,
            refresh_ticks: 1,
        },
        plausibility,
        ..Default::default()
    })
    .await
    .unwrap();
    (c, a)
}

/// Honest clients `honest-0`, `honest-1`… each posting the report `make(id)` every 200 ms
/// (their interval) until `stop`; the reports each sent.
fn honest(
    http: &reqwest::Client,
    url: &str,
    clients: usize,
    stop: Arc<std::sync::atomic::AtomicBool>,
    make: impl Fn(&str) -> serde_json::Value + Send + 'static,
) -> tokio::task::JoinHandle<u64> {
    let (http, url) = (http.clone(), url.to_string());
    tokio::spawn(async move {
        let mut rounds = 0;
        let mut iv = tokio::time::interval(Duration::from_millis(200));
        // As a client does: a late tick is not made up for by a burst of reports (each
        // claiming 200 ms).
        iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            iv.tick().await;
            for i in 0..clients {
                let s = post_report(&http, &url, make(&format!("honest-{i}"))).await;
                assert_eq!(s, 200);
            }
            rounds += 1;
        }
        rounds
    })
}

/// A report of `service` carrying `count` calls of `caller` over `interval_ms`.
fn calls_report(
    service: &str,
    id: &str,
    interval_ms: u64,
    caller: &str,
    count: u64,
) -> serde_json::Value {
    json!({"client_id": id, "service": service, "version": "v1", "interval_ms": interval_ms,
        "buckets": [], "calls": [{"caller": caller, "procedure": "charge", "count": count}]})
}

/// Four honest clients of payments make 2,000 calls a second each (400 per 200 ms report);
/// one client holding the same credential claims 1,000 times that, in two ways: a 1 s interval
/// sent every 50 ms, and an hour's interval. The controller's `grl_calls_total` gets every
/// honest call, and of the liar's no more than one plausible instance adds: the largest of
/// 4 × its peers' mean (8,000 calls/s), 10 × the limit over the clients (200) and the
/// instance floor (5,000), over the time it reported (before: 2,000,000 per report).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_client_cannot_claim_more_calls_than_a_plausible_instance() {
    let dir = tempfile::tempdir().unwrap();
    let (c, a) = fleet(dir.path(), Default::default()).await;
    let http = reqwest::Client::new();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let honest_task = honest(&http, &a.url(), 4, stop.clone(), |id| {
        calls_report("payments", id, 200, "gw", 400)
    });
    // The forwards see the peers.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < Duration::from_secs(3) {
        n += 1;
        let (interval_ms, count) = if n.is_multiple_of(2) {
            (1000, 2_000_000)
        } else {
            (3_600_000, 2_000u64 * 1000 * 3600)
        };
        let report = calls_report("payments", "intruder", interval_ms, "evil", count);
        let s = post_report(&http, &a.url(), report).await;
        assert_eq!(s, 200);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let lied_for = start.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let sent = honest_task.await.unwrap() * 4 * 400;
    let mut m = String::new();
    for _ in 0..100 {
        m = metrics(&http, &c.url()).await;
        if calls_total(&m, "payments", "gw") >= sent {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(calls_total(&m, "payments", "gw"), sent, "honest calls: {m}");
    let evil = calls_total(&m, "payments", "evil") as f64;
    // The cap, and a new client's first allowance of at most 3 ticks of it.
    let cap = (4.0 * 2000.0f64).max(10.0 * 100.0 / 5.0).max(5000.0);
    let bound = cap * (lied_for + 0.3);
    eprintln!("liar: {evil} calls in {lied_for:.2} s, bound {bound}");
    assert!(
        evil <= bound * 1.05,
        "the liar added {evil} calls in {lied_for:.2} s, beyond {bound}"
    );
    assert!(
        evil >= 0.5 * 5000.0 * lied_for,
        "the liar's calls counted at all: {evil}"
    );
    let am = metrics(&http, &a.url()).await;
    assert!(
        am.lines()
            .any(|l| l.starts_with("grl_report_entries_refused_total{")
                && l.contains("reason=\"calls_capped\"")
                && l.contains("service=\"payments\"")),
        "{am}"
    );
    a.shutdown().await;
    c.shutdown().await;
}

/// A controller that records the calls of every zone report it takes (protocol 2: no delta
/// session), or answers 503 while `down`.
async fn recording_controller(
    calls: Arc<Mutex<HashMap<(String, String), u64>>>,
    down: Arc<std::sync::atomic::AtomicBool>,
) -> (String, tokio::task::JoinHandle<()>) {
    let app = Router::new().route(
        "/v1/aggregate",
        post(move |Json(r): Json<ZoneReport>| {
            let (calls, down) = (calls.clone(), down.clone());
            async move {
                if down.load(std::sync::atomic::Ordering::Relaxed) {
                    return axum::http::StatusCode::SERVICE_UNAVAILABLE.into_response();
                }
                let mut calls = calls.lock().unwrap();
                for c in r.calls {
                    *calls.entry((c.service, c.caller)).or_default() += c.count;
                }
                ([(PROTO_HEADER, "2")], Json(ZoneDirectives::default())).into_response()
            }
        }),
    );
    crate::tests::serve_on_free_port(app).await
}

/// Two clients of a service the config does not have (its calls are how it is learned) make
/// 4,000 calls a second each, near what a lone instance is trusted up to; for two seconds the
/// controller refuses the zone reports. The calls of the failed forward are put back as they
/// were taken, those reported meanwhile wait, and all go once the controller takes reports
/// again: every call arrives, once, none cut (held back, they are seconds of calls in one
/// forward, far above one client's allowance: they are screened once, as reported).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_held_back_by_failed_forwards_arrive_whole_and_once() {
    let seen = Arc::new(Mutex::new(HashMap::new()));
    let down = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (url, server) = recording_controller(seen.clone(), down.clone()).await;
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
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let task = honest(&http, &a.url(), 2, stop.clone(), |id| {
        calls_report("maps", id, 200, "gw", 800)
    });
    tokio::time::sleep(Duration::from_millis(1000)).await;
    down.store(true, std::sync::atomic::Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(2000)).await;
    let during = seen
        .lock()
        .unwrap()
        .get(&("maps".to_string(), "gw".to_string()))
        .copied()
        .unwrap_or(0);
    down.store(false, std::sync::atomic::Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let sent = task.await.unwrap() * 2 * 800;
    let key = ("maps".to_string(), "gw".to_string());
    let mut got = 0;
    for _ in 0..100 {
        got = seen.lock().unwrap().get(&key).copied().unwrap_or(0);
        if got >= sent {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(during > 0 && during + 2 * 4000 < sent, "{during} of {sent}");
    assert_eq!(got, sent);
    let am = metrics(&http, &a.url()).await;
    assert!(!am.contains("calls_capped"), "honest calls were cut: {am}");
    a.shutdown().await;
    server.abort();
}

/// Four honest clients of payments offer `gw.charge` 100 requests a second each (20 per 200 ms
/// report); one client holding the same credential claims counts its rate screen lets through
/// (at its cap, 400 rps: 4 × its peers' mean, above 10 × the limit over the 5 clients), in two
/// ways: a 1 s interval sent every 10 ms, and an hour's interval. The controller's request
/// counters get of the liar's no more than one plausible instance adds over the time it
/// reported, its counts cut alike (admitted + dropped = offered).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_client_cannot_claim_more_counts_than_a_plausible_instance() {
    let dir = tempfile::tempdir().unwrap();
    let (c, a) = fleet(dir.path(), Default::default()).await;
    let http = reqwest::Client::new();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let honest_task = honest(&http, &a.url(), 4, stop.clone(), |id| {
        counts_report(id, 200, 20)
    });
    // The forwards see the peers.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let cap = 400.0;
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < Duration::from_secs(3) {
        n += 1;
        let interval_ms = if n.is_multiple_of(2) { 1000 } else { 3_600_000 };
        let offered = (cap * interval_ms as f64 / 1000.0) as u64;
        let s = post_report(
            &http,
            &a.url(),
            counts_report("intruder", interval_ms, offered),
        )
        .await;
        assert_eq!(s, 200);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let lied_for = start.elapsed().as_secs_f64();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let honest_sent = honest_task.await.unwrap() * 4 * 20;
    let [offered, admitted, dropped, shadow] = settled_charge_totals(&http, &c.url()).await;
    assert!(
        offered >= honest_sent,
        "{offered} offered, {honest_sent} of them honest"
    );
    assert_eq!(admitted + dropped, offered);
    assert!(shadow <= admitted);
    let evil = (offered - honest_sent) as f64;
    // The cap, and a new client's first allowance of at most 3 ticks of it.
    let bound = cap * (lied_for + 0.3);
    eprintln!("liar: {evil} requests in {lied_for:.2} s ({n} reports), bound {bound}");
    assert!(
        evil <= bound * 1.05,
        "the liar added {evil} requests in {lied_for:.2} s, beyond {bound}"
    );
    assert!(
        evil >= 0.5 * cap * lied_for,
        "the liar's counts counted at all: {evil}"
    );
    let am = metrics(&http, &a.url()).await;
    assert!(
        am.lines()
            .any(|l| l.starts_with("grl_report_entries_refused_total{")
                && l.contains("reason=\"counts_capped\"")
                && l.contains("service=\"payments\"")),
        "{am}"
    );
    a.shutdown().await;
    c.shutdown().await;
}

/// Honest clients' counts reach the controller whole: from their first report on, one whose
/// reports arrive unevenly (50 ms, then 350 ms apart, each covering 200 ms), and one whose
/// reports failed for 400 ms and that then reports the 600 ms since its last one at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn honest_counts_pass_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let (c, a) = fleet(dir.path(), Default::default()).await;
    let http = reqwest::Client::new();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let steady = honest(&http, &a.url(), 2, stop.clone(), |id| {
        counts_report(id, 200, 20)
    });
    let uneven = {
        let (http, url, stop) = (http.clone(), a.url(), stop.clone());
        tokio::spawn(async move {
            let mut sent = 0;
            for n in 0u64.. {
                if stop.load(std::sync::atomic::Ordering::Relaxed) {
                    break;
                }
                let s = post_report(&http, &url, counts_report("uneven", 200, 20)).await;
                assert_eq!(s, 200);
                sent += 20;
                let gap = if n.is_multiple_of(2) { 50 } else { 350 };
                tokio::time::sleep(Duration::from_millis(gap)).await;
            }
            sent
        })
    };
    let catching_up = {
        let (http, url, stop) = (http.clone(), a.url(), stop.clone());
        tokio::spawn(async move {
            let mut sent = 0;
            for n in 0u64.. {
                if stop.load(std::sync::atomic::Ordering::Relaxed) {
                    break;
                }
                // Every eighth report follows two that failed.
                let (interval_ms, pause) = if n % 8 == 7 { (600, 600) } else { (200, 200) };
                tokio::time::sleep(Duration::from_millis(pause)).await;
                let offered = interval_ms / 10;
                let report = counts_report("catching-up", interval_ms, offered);
                assert_eq!(post_report(&http, &url, report).await, 200);
                sent += offered;
            }
            sent
        })
    };
    tokio::time::sleep(Duration::from_secs(4)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let sent = steady.await.unwrap() * 2 * 20 + uneven.await.unwrap() + catching_up.await.unwrap();
    let [offered, admitted, dropped, shadow] = settled_charge_totals(&http, &c.url()).await;
    assert_eq!(offered, sent, "requests offered");
    assert_eq!(dropped, sent / 10, "requests dropped");
    assert_eq!(admitted, sent - sent / 10);
    assert_eq!(shadow, sent / 20);
    let am = metrics(&http, &a.url()).await;
    assert!(
        !am.contains("counts_capped"),
        "honest counts were cut: {am}"
    );
    assert!(!am.contains("rate_capped"), "honest rates were cut: {am}");
    a.shutdown().await;
    c.shutdown().await;
}

/// Clients held by `a` (`grl_aggregator_clients`) for `service`.
async fn clients_held(http: &reqwest::Client, a: &AggregatorHandle, service: &str) -> u64 {
    let s = format!("service=\"{service}\"");
    total(
        &metrics(http, &a.url()).await,
        "grl_aggregator_clients",
        &[&s],
    )
}

/// A credential holder inventing client ids, with empty reports: of a service of the config,
/// and of services it is not (each id of a new service name). Each service holds at most
/// `max_clients_per_service` clients (those not in the config together); the next new one is
/// refused (429, `over_budget`), clients already held go on being accepted, and a client gone
/// quiet beyond its horizon makes room again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invented_client_ids_hold_no_more_than_the_budget() {
    let dir = tempfile::tempdir().unwrap();
    let p = screen::Plausibility {
        max_clients_per_service: 3,
        ..Default::default()
    };
    let (c, a) = fleet(dir.path(), p).await;
    let http = reqwest::Client::new();
    let empty = |service: &str, id: &str| {
        json!({"client_id": id, "service": service, "version": "v1", "interval_ms": 200,
            "buckets": []})
    };
    // The aggregator has fetched the config: payments is known.
    for _ in 0..100 {
        let r = http
            .get(format!("{}/v1/config", a.url()))
            .send()
            .await
            .unwrap();
        if !r.json::<ConfigDoc>().await.unwrap().services.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut statuses = Vec::new();
    for i in 0..10 {
        statuses.push(post_report(&http, &a.url(), empty("payments", &format!("id-{i}"))).await);
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429, 429, 429, 429, 429, 429]);
    let mut statuses = Vec::new();
    for i in 0..10 {
        let service = format!("invented-{i}");
        statuses.push(post_report(&http, &a.url(), empty(&service, "x")).await);
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429, 429, 429, 429, 429, 429]);
    // The clients held go on; the others go quiet beyond their horizon (3 of their 200 ms
    // periods) and the forwards recount them.
    for _ in 0..10 {
        assert_eq!(
            post_report(&http, &a.url(), empty("payments", "id-0")).await,
            200
        );
        assert_eq!(
            post_report(&http, &a.url(), empty("invented-1", "x")).await,
            200
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(clients_held(&http, &a, "payments").await, 1, "id-0 only");
    assert_eq!(
        post_report(&http, &a.url(), empty("payments", "new")).await,
        200
    );
    assert_eq!(
        post_report(&http, &a.url(), empty("invented-9", "x")).await,
        200
    );
    let am = metrics(&http, &a.url()).await;
    assert!(
        am.lines()
            .any(|l| l.starts_with("grl_reports_refused_total{") && l.contains("over_budget")),
        "{am}"
    );
    a.shutdown().await;
    c.shutdown().await;
}
