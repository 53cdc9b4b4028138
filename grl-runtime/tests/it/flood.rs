//! One compromised client against real `grl` processes: it holds a valid credential of one
//! service and floods its aggregator with invented bucket names or implausible rates. Another
//! service's limiting carries on, the aggregator's memory stays bounded, and its own
//! service's drop ratio moves no further than one plausible instance could move it.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use grl_client::client::{ClientOptions, GrlClient};
use grl_wire::{BucketCountsMsg, ClientReport};
use serde_json::{json, Value};
use test_support::process::free_port;

use super::{
    eventually, load_as, push_config, spawn_aggregator_with, spawn_controller, wait_up, TOKEN,
};

const PAYMENTS_SECRET: &str = "payments-secret-aaaaaaaaaaaaaaaa";
const MAPS_SECRET: &str = "maps-secret-bbbbbbbbbbbbbbbbbbbbb";

/// The aggregator's defaults for the plausibility cap (`--plausible-limit-multiple`,
/// `--plausible-peer-multiple`).
const LIMIT_MULTIPLE: f64 = 10.0;
const PEER_MULTIPLE: f64 = 4.0;

fn two_services(limit: f64) -> Value {
    let bucket = |name: &str, caller: &str, procedure: &str| {
        json!({"name": name, "caller": caller, "procedure": procedure, "scope": "global",
               "limit_rps": limit, "mode": "enforce", "policy": "peak"})
    };
    json!({"version": "v1", "services": [
        {"service": "payments", "buckets": [bucket("gw.charge", "gw", "charge")]},
        {"service": "maps", "buckets": [bucket("web.route", "web", "route")]},
    ]})
}

async fn text(http: &reqwest::Client, url: &str) -> String {
    match http.get(url).send().await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

/// The value of the first sample of `metric` whose line contains every string of `labels`.
fn sample(metrics: &str, metric: &str, labels: &[&str]) -> Option<f64> {
    metrics
        .lines()
        .filter(|l| l.starts_with(metric) && labels.iter().all(|x| l.contains(x)))
        .find_map(|l| l.rsplit(' ').next()?.parse().ok())
}

/// Resident memory of process `pid` in bytes.
fn rss(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// A controller ticking every `tick_ms` and an aggregator forwarding every `tick_ms`,
/// accepting the payments and maps credentials.
fn fleet(
    dir: &Path,
    tick_ms: u64,
) -> (
    test_support::process::Proc,
    test_support::process::Proc,
    String,
    String,
) {
    let cport = free_port();
    let base = format!("http://127.0.0.1:{cport}");
    let ctl = if tick_ms == 100 {
        spawn_controller(cport, &dir.join("state"), dir, &[])
    } else {
        test_support::process::Proc::spawn(
            std::process::Command::new(env!("CARGO_BIN_EXE_grl"))
                .args(["controller", "--listen", &format!("127.0.0.1:{cport}")])
                .args(["--tick-ms", &tick_ms.to_string(), "--state-dir"])
                .arg(dir.join("state"))
                .env("GRL_TOKEN", TOKEN)
                .env("GRL_REPORT_TOKEN", super::REPORT_TOKEN)
                .stdout(std::process::Stdio::null())
                .stderr(super::log_file(dir, "controller")),
        )
        .unwrap()
    };
    let creds = dir.join("client-credentials");
    std::fs::write(
        &creds,
        format!("payments payments {PAYMENTS_SECRET}\nmaps maps {MAPS_SECRET}\n"),
    )
    .unwrap();
    let pa = free_port();
    let agg = spawn_aggregator_with(
        pa,
        &base,
        "agg-flood",
        dir,
        tick_ms,
        &["--client-credentials", creds.to_str().unwrap()],
        &[("GRL_REPORT_TOKEN", super::REPORT_TOKEN)],
    );
    (ctl, agg, base, format!("http://127.0.0.1:{pa}"))
}

/// A client reporting every `tick_ms` (the aggregator's tick: it forgets clients not heard
/// within three).
fn client(ua: &str, service: &str, id: &str, secret: &str, tick_ms: u64) -> Arc<GrlClient> {
    let mut o = ClientOptions::new(service, vec![ua.to_string()]);
    o.tick = Duration::from_millis(tick_ms);
    o.stale_after = Duration::from_millis(3 * tick_ms.max(1000));
    o.client_id = Some(id.into());
    o.report_token = Some(secret.into());
    Arc::new(GrlClient::start(o))
}

/// A compromised payments client sends three binary reports a second, each carrying 300,000
/// invented bucket names. The names are counted and dropped (not forwarded), so the zone report
/// stays within the controller's limit and maps' drop ratio stays where maps' own traffic puts
/// it; the aggregator's memory stays bounded, also when sixteen such reports come at once
/// (before: the zone report grew past 64 MiB and was refused, maps' ratio went to 0, the
/// aggregator grew to 766 MB).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invented_bucket_names_of_one_service_leave_another_service_limited() {
    let dir = tempfile::tempdir().unwrap();
    // A 1 s forwarding tick, as in production: a zone report carries three ticks of clients.
    let (_ctl, agg, base, ua) = fleet(dir.path(), 1000);
    wait_up(&format!("{base}/v1/status")).await;
    wait_up(&format!("{ua}/healthz")).await;
    let http = reqwest::Client::new();
    push_config(&http, &base, &two_services(200.0)).await;

    // maps: 2 × 150 rps against 200 (ratio 1/3); payments: 50 rps (ratio 0).
    let stop = Arc::new(AtomicBool::new(false));
    let maps_counts: Arc<[AtomicU64; 2]> = Arc::new(Default::default());
    let pay_counts: Arc<[AtomicU64; 2]> = Arc::new(Default::default());
    let mut maps = Vec::new();
    for i in 0..2 {
        let c = client(&ua, "maps", &format!("m{i}"), MAPS_SECRET, 1000);
        load_as(
            c.clone(),
            ("web", "route"),
            150.0,
            stop.clone(),
            maps_counts.clone(),
        );
        maps.push(c);
    }
    let pay = client(&ua, "payments", "p0", PAYMENTS_SECRET, 1000);
    load_as(
        pay.clone(),
        ("gw", "charge"),
        50.0,
        stop.clone(),
        pay_counts.clone(),
    );
    let maps_ratio = |m: &str| sample(m, "grl_drop_ratio", &["bucket=\"web.route\""]);
    eventually("maps' ratio settles near 1/3", || {
        let (http, base) = (http.clone(), base.clone());
        async move {
            let m = text(&http, &format!("{base}/metrics")).await;
            maps_ratio(&m).is_some_and(|r| (r - 1.0 / 3.0).abs() < 0.08)
        }
    })
    .await;
    let rss_before = rss(agg.0.id());

    // 8 s of flood: three reports a second, each from a new client id with 300,000 new names.
    let flood = {
        let (http, ua) = (http.clone(), ua.clone());
        tokio::spawn(async move {
            let mut statuses = Vec::new();
            for i in 0..24u64 {
                let t = Instant::now();
                let r = ClientReport {
                    client_id: format!("flood-{i}"),
                    service: "payments".into(),
                    version: "v1".into(),
                    interval_ms: 1000,
                    buckets: (0..300_000u64)
                        .map(|j| BucketCountsMsg {
                            // Short, distinct names: a report stays within the 4 MiB body.
                            bucket: format!("{:x}", i * 300_000 + j),
                            offered: 1,
                            admitted: 1,
                            dropped: 0,
                            shadow_dropped: 0,
                            tiers: Vec::new(),
                        })
                        .collect(),
                    urgent: false,
                    calls: Vec::new(),
                };
                let body = grl_wire::binary::encode_report(&r);
                let s = http
                    .post(format!("{ua}/v1/report"))
                    .bearer_auth(PAYMENTS_SECRET)
                    .header("content-type", grl_wire::binary::CONTENT_TYPE)
                    .body(body)
                    .send()
                    .await
                    .map(|r| r.status().as_u16())
                    .unwrap_or(0);
                statuses.push(s);
                tokio::time::sleep(Duration::from_millis(333).saturating_sub(t.elapsed())).await;
            }
            statuses
        })
    };
    let (mut ratios, mut peak_rss, mut stale) = (Vec::new(), rss_before, false);
    while !flood.is_finished() {
        let m = text(&http, &format!("{base}/metrics")).await;
        ratios.push(maps_ratio(&m).unwrap_or(-1.0));
        peak_rss = peak_rss.max(rss(agg.0.id()));
        let now = grl_core::now_ms();
        stale |= maps.iter().any(|c| c.limiter().table().is_stale(now));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut statuses = flood.await.unwrap();
    // Then sixteen at once: large reports are decoded a few at a time, so memory stays bounded
    // however many connections send them.
    let bodies: Vec<Vec<u8>> = (0..16u64)
        .map(|i| {
            grl_wire::binary::encode_report(&ClientReport {
                client_id: format!("burst-{i}"),
                service: "payments".into(),
                version: "v1".into(),
                interval_ms: 1000,
                buckets: (0..300_000u64)
                    .map(|j| BucketCountsMsg {
                        bucket: format!("{:x}", (100 + i) * 300_000 + j),
                        offered: 1,
                        admitted: 1,
                        dropped: 0,
                        shadow_dropped: 0,
                        tiers: Vec::new(),
                    })
                    .collect(),
                urgent: false,
                calls: Vec::new(),
            })
        })
        .collect();
    let burst: Vec<_> = bodies
        .into_iter()
        .map(|body| {
            let (http, ua) = (http.clone(), ua.clone());
            tokio::spawn(async move {
                http.post(format!("{ua}/v1/report"))
                    .bearer_auth(PAYMENTS_SECRET)
                    .header("content-type", grl_wire::binary::CONTENT_TYPE)
                    .body(body)
                    .send()
                    .await
                    .map(|r| r.status().as_u16())
                    .unwrap_or(0)
            })
        })
        .collect();
    while burst.iter().any(|b| !b.is_finished()) {
        peak_rss = peak_rss.max(rss(agg.0.id()));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for b in burst {
        statuses.push(b.await.unwrap());
    }
    // Two more ticks for anything forwarded late.
    for _ in 0..10 {
        let m = text(&http, &format!("{base}/metrics")).await;
        ratios.push(maps_ratio(&m).unwrap_or(-1.0));
        peak_rss = peak_rss.max(rss(agg.0.id()));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop.store(true, Ordering::Relaxed);
    eprintln!(
        "aggregator RSS {:.1} MB before, {:.1} MB peak under the flood; maps ratios {ratios:?}",
        rss_before as f64 / 1e6,
        peak_rss as f64 / 1e6
    );
    // The reports were taken (the credential is valid): their invented names were dropped.
    assert!(statuses.iter().all(|&s| s == 200), "{statuses:?}");
    assert!(!stale, "maps' clients failed open during the flood");
    assert!(
        ratios.iter().all(|r| (r - 1.0 / 3.0).abs() < 0.12),
        "maps' ratio left 1/3 under the payments flood: {ratios:?}"
    );
    // The reports in flight (large ones decoded four at a time) and the rates held: about
    // 100 MB at most in a debug build, where it grew past 1 GB before.
    assert!(
        peak_rss < 200 << 20,
        "aggregator RSS {peak_rss} bytes under the flood"
    );
    let am = text(&http, &format!("{ua}/metrics")).await;
    let dropped = sample(
        &am,
        "grl_report_entries_refused_total",
        &["reason=\"unknown_bucket\"", "service=\"payments\""],
    )
    .unwrap_or(0.0);
    assert!(dropped >= 40.0 * 300_000.0, "{am}");
    // Refusals at the controller: none (no zone report too large).
    let cm = text(&http, &format!("{base}/metrics")).await;
    assert_eq!(
        sample(&cm, "grl_reports_refused_total", &["too_large"]),
        None,
        "{cm}"
    );
}

/// A compromised payments client claims a million requests per second (1,000 in 1 ms), then
/// 10^15 in a second, for the bucket the real clients use. Its claims are cut to what one
/// plausible instance can do (at most the bucket's limit times 10 over the service's clients
/// in the zone, or 4 times what its peers offer), counted by reason, so the bucket's ratio moves
/// no further than such an instance would move it (before: 0.9965 and 0.9999999996). A real
/// instance that does receive ten times the limit still drops its own excess.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_client_cannot_claim_more_than_a_plausible_instance() {
    let dir = tempfile::tempdir().unwrap();
    let (_ctl, _agg, base, ua) = fleet(dir.path(), 100);
    wait_up(&format!("{base}/v1/status")).await;
    wait_up(&format!("{ua}/healthz")).await;
    let http = reqwest::Client::new();
    let limit = 200.0;
    push_config(&http, &base, &two_services(limit)).await;
    let stop = Arc::new(AtomicBool::new(false));
    let counts: Arc<[AtomicU64; 2]> = Arc::new(Default::default());
    let mut real = Vec::new();
    for i in 0..2 {
        let c = client(&ua, "payments", &format!("p{i}"), PAYMENTS_SECRET, 100);
        load_as(
            c.clone(),
            ("gw", "charge"),
            150.0,
            stop.clone(),
            counts.clone(),
        );
        real.push(c);
    }
    let ratio = |m: &str| sample(m, "grl_drop_ratio", &["bucket=\"gw.charge\""]);
    eventually("the ratio settles near 1/3", || {
        let (http, base) = (http.clone(), base.clone());
        async move {
            let m = text(&http, &format!("{base}/metrics")).await;
            ratio(&m).is_some_and(|r| (r - 1.0 / 3.0).abs() < 0.08)
        }
    })
    .await;
    // The most a plausible third instance could add: the larger of its share of ten times the
    // limit and four times its peers' rate.
    let cap = (LIMIT_MULTIPLE * limit / 3.0).max(PEER_MULTIPLE * 150.0);
    let bound = (300.0 + cap - limit) / (300.0 + cap);
    for (offered, interval_ms) in [(1_000u64, 1u64), (1_000_000_000_000_000, 1000)] {
        let report = json!({"client_id": "intruder", "service": "payments", "version": "v1",
            "interval_ms": interval_ms, "urgent": true,
            "buckets": [{"bucket": "gw.charge", "offered": offered, "admitted": offered,
                         "dropped": 0, "shadow_dropped": 0}]});
        let start = Instant::now();
        let mut seen = Vec::new();
        while start.elapsed() < Duration::from_secs(3) {
            let r = http
                .post(format!("{ua}/v1/report"))
                .bearer_auth(PAYMENTS_SECRET)
                .json(&report)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            let m = text(&http, &format!("{base}/metrics")).await;
            seen.push(ratio(&m).unwrap_or(0.0));
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let max = seen.iter().cloned().fold(0.0, f64::max);
        assert!(
            max > 0.4,
            "offered {offered} in {interval_ms} ms: the claim counted at all ({seen:?})"
        );
        assert!(
            max <= bound + 0.03,
            "offered {offered} in {interval_ms} ms moved the ratio to {max}, beyond {bound} ({seen:?})"
        );
    }
    let am = text(&http, &format!("{ua}/metrics")).await;
    for reason in ["rate_capped", "short_interval"] {
        assert!(
            sample(
                &am,
                "grl_report_entries_refused_total",
                &[&format!("reason=\"{reason}\"")]
            )
            .is_some_and(|n| n > 0.0),
            "{reason}: {am}"
        );
    }

    // A real instance that receives ten times the limit on its own: the aggregator cuts its
    // claim like any other, and the instance still drops its own excess.
    let hot = client(&ua, "payments", "hot", PAYMENTS_SECRET, 100);
    let hot_counts: Arc<[AtomicU64; 2]> = Arc::new(Default::default());
    load_as(
        hot.clone(),
        ("gw", "charge"),
        10.0 * limit,
        stop.clone(),
        hot_counts.clone(),
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    let dropped = super::drop_fraction(&hot_counts, 2000).await;
    stop.store(true, Ordering::Relaxed);
    // Its own rate alone asks for a ratio of 0.9 (2,000 rps against 200).
    assert!(
        dropped >= 0.85,
        "the hot instance dropped only {dropped} of its requests"
    );
}
