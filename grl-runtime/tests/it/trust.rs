//! Trust between the tiers, with real `grl` processes: forged reports, credential scopes and
//! rotation, least-privilege controller roles, bodies refused before they are read, TTL
//! bounds.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use grl_client::auth::TokenSource;
use grl_client::client::{ClientOptions, GrlClient};
use serde_json::{json, Value};
use test_support::process::free_port;

use super::{
    eventually, get_text, load_as, payments_config, push_config, put_config, spawn_aggregator_with,
    spawn_controller, start_controller, wait_up, REPORT_TOKEN, TOKEN,
};

const PAYMENTS_SECRET: &str = "payments-secret-aaaaaaaaaaaaaaaa";
const MAPS_SECRET: &str = "maps-secret-bbbbbbbbbbbbbbbbbbbbb";
const WRONG_SECRET: &str = "wrong-secret-cccccccccccccccccccc";

fn write(path: &Path, text: &str) {
    // Replaced atomically, as an operator's editor or config management would.
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// The value of the first sample of `metric` whose line contains every string of `labels`.
fn sample(metrics: &str, metric: &str, labels: &[&str]) -> Option<f64> {
    metrics
        .lines()
        .filter(|l| l.starts_with(metric) && labels.iter().all(|x| l.contains(x)))
        .find_map(|l| l.rsplit(' ').next()?.parse().ok())
}

fn forged(service: &str, offered: u64) -> Value {
    json!({"client_id": "intruder", "service": service, "version": "", "interval_ms": 100,
           "urgent": true,
           "buckets": [{"bucket": "gw.charge", "offered": offered, "admitted": offered,
                        "dropped": 0, "shadow_dropped": 0}]})
}

/// Forged client reports (no credential, a wrong one, another service's) are refused with
/// 401/403, counted, logged without the secret, and change no drop ratio: the real clients
/// keep admitting everything. The same report with the right credential does raise the ratio
/// (so the test would see a forgery that got through).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_client_reports_change_no_drop_ratio() {
    let dir = tempfile::tempdir().unwrap();
    let (_ctl, _, base) = start_controller(&dir.path().join("state"), dir.path(), &[]).await;
    let http = reqwest::Client::new();
    let r = put_config(&http, &base, &payments_config("v1", 200.0)).await;
    assert_eq!(r.status(), 200);
    let creds = dir.path().join("client-credentials");
    write(
        &creds,
        &format!("payments payments {PAYMENTS_SECRET}\nmaps maps {MAPS_SECRET}\n"),
    );
    let pa = free_port();
    let ua = format!("http://127.0.0.1:{pa}");
    let _agg = spawn_aggregator_with(
        pa,
        &base,
        "agg-f",
        dir.path(),
        100,
        &["--client-credentials", creds.to_str().unwrap()],
        &[("GRL_REPORT_TOKEN", REPORT_TOKEN)],
    );
    wait_up(&format!("{ua}/metrics")).await;

    // Two real clients at 2 × 50 rps against a limit of 200: nothing to drop.
    let stop = Arc::new(AtomicBool::new(false));
    let counts: Arc<[AtomicU64; 2]> = Arc::new(Default::default());
    let mut clients = Vec::new();
    for i in 0..2 {
        let mut o = ClientOptions::new("payments", vec![ua.clone()]);
        o.tick = Duration::from_millis(100);
        o.client_id = Some(format!("p{i}"));
        o.report_token = Some(PAYMENTS_SECRET.into());
        let c = Arc::new(GrlClient::start(o));
        load_as(
            c.clone(),
            ("gw", "charge"),
            50.0,
            stop.clone(),
            counts.clone(),
        );
        clients.push(c);
    }
    eventually("clients run v1 with fresh directives", || {
        let now = grl_core::now_ms();
        let ok = clients.iter().all(|c| {
            let t = c.limiter().table();
            t.version() == "v1" && !t.is_stale(now)
        });
        async move { ok }
    })
    .await;

    // 2 s of forged reports claiming 10^7 requests per 100 ms for the clients' bucket.
    let cases: [(Option<&str>, &str, u16); 3] = [
        (None, "payments", 401),
        (Some(WRONG_SECRET), "payments", 401),
        (Some(MAPS_SECRET), "payments", 403),
    ];
    let dropped_before = counts[1].load(Ordering::Relaxed);
    let offered_before = counts[0].load(Ordering::Relaxed);
    let start = Instant::now();
    let mut sent = 0u64;
    while start.elapsed() < Duration::from_secs(2) {
        for (token, service, status) in cases {
            let mut req = http
                .post(format!("{ua}/v1/report"))
                .json(&forged(service, 10_000_000));
            if let Some(t) = token {
                req = req.bearer_auth(t);
            }
            assert_eq!(req.send().await.unwrap().status(), status, "{token:?}");
            sent += 1;
        }
        for c in &clients {
            assert_eq!(
                c.limiter().table().ratio(0),
                0.0,
                "a forged report moved the ratio"
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Give a forwarded forgery time to come back as a ratio, then look again.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for c in &clients {
        assert_eq!(c.limiter().table().ratio(0), 0.0);
    }
    let offered = counts[0].load(Ordering::Relaxed) - offered_before;
    assert!(offered > 200, "the clients kept offering: {offered}");
    assert_eq!(
        counts[1].load(Ordering::Relaxed),
        dropped_before,
        "a real request was dropped"
    );
    let m = get_text(&http, &format!("{base}/metrics")).await;
    assert_eq!(
        sample(&m, "grl_drop_ratio", &["bucket=\"gw.charge\""]),
        Some(0.0),
        "{m}"
    );
    // Counted by reason at the aggregator.
    let am = get_text(&http, &format!("{ua}/metrics")).await;
    let n = sent as f64 / 3.0;
    for reason in ["missing_credential", "unknown_credential", "forbidden"] {
        assert_eq!(
            sample(&am, "grl_reports_refused_total", &[reason]),
            Some(n),
            "{reason}: {am}"
        );
    }
    assert!(sample(&am, "grl_reports_accepted_total", &[]).unwrap() > 10.0);

    // A zone report straight to the controller: none, wrong, and a credential without the
    // zone-report role (the API token) are refused too, and change nothing.
    let zone = json!({"aggregator_id": "intruder", "region": "r1", "zone": "z9",
        "buckets": [{"service": "payments", "bucket": "gw.charge", "offered_rps": 1e7,
                     "admitted_rps": 1e7, "dropped_rps": 0.0, "shadow_dropped_rps": 0.0,
                     "counts": {"bucket": "gw.charge", "offered": 0, "admitted": 0,
                                "dropped": 0, "shadow_dropped": 0}}]});
    for (token, status) in [(None, 401), (Some(WRONG_SECRET), 401), (Some(TOKEN), 403)] {
        let mut req = http.post(format!("{base}/v1/aggregate")).json(&zone);
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        assert_eq!(req.send().await.unwrap().status(), status, "{token:?}");
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    for c in &clients {
        assert_eq!(c.limiter().table().ratio(0), 0.0);
    }
    let m = get_text(&http, &format!("{base}/metrics")).await;
    for reason in ["missing_credential", "unknown_credential", "forbidden"] {
        assert_eq!(
            sample(&m, "grl_reports_refused_total", &[reason]),
            Some(1.0),
            "{reason}: {m}"
        );
    }

    // No secret in any log.
    for entry in std::fs::read_dir(dir.path()).unwrap() {
        let p = entry.unwrap().path();
        if p.extension().is_some_and(|e| e == "log") {
            let log = std::fs::read_to_string(&p).unwrap();
            for secret in [
                PAYMENTS_SECRET,
                MAPS_SECRET,
                WRONG_SECRET,
                TOKEN,
                REPORT_TOKEN,
            ] {
                assert!(!log.contains(secret), "{} shows a secret", p.display());
            }
        }
    }
    assert!(std::fs::read_to_string(dir.path().join("agg-f.log"))
        .unwrap()
        .contains("client report refused"));

    // Control: the same forgery with the service's own credential gets through, which is
    // what the refusals above prevented.
    let fire = {
        let (http, ua) = (http.clone(), ua.clone());
        tokio::spawn(async move {
            for _ in 0..100 {
                let _ = http
                    .post(format!("{ua}/v1/report"))
                    .bearer_auth(PAYMENTS_SECRET)
                    .json(&forged("payments", 10_000_000))
                    .send()
                    .await;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    eventually("an accepted forgery raises the ratio", || {
        let ok = clients.iter().all(|c| c.limiter().table().ratio(0) > 0.5);
        async move { ok }
    })
    .await;
    fire.abort();
    stop.store(true, Ordering::Relaxed);
}

/// Client and zone-report credentials rotated while traffic flows: the new credential is
/// added next to the old one, callers move to it (their token files change), the old one is
/// removed. No report is refused or lost on the way, and afterwards the old one is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotation_with_two_credentials_loses_no_report() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (old_c, new_c) = ("client-old-0123456789abcdef", "client-new-0123456789abcdef");
    let (old_z, new_z) = ("zone-old-0123456789abcdefgh", "zone-new-0123456789abcdefgh");
    let ctl_creds = d.join("controller-credentials");
    write(
        &ctl_creds,
        &format!(
            "api config,overrides,reports {TOKEN}-0123456789abcdef\nzone-old zone-report {old_z}\n"
        ),
    );
    let cport = free_port();
    let base = format!("http://127.0.0.1:{cport}");
    let _ctl = test_support::process::Proc::spawn(
        Command::new(env!("CARGO_BIN_EXE_grl"))
            .args(["controller", "--listen", &format!("127.0.0.1:{cport}")])
            .args(["--tick-ms", "100", "--state-dir"])
            .arg(d.join("state"))
            .arg("--credentials")
            .arg(&ctl_creds)
            .env_remove("GRL_TOKEN")
            .env_remove("GRL_REPORT_TOKEN")
            .stdout(std::process::Stdio::null())
            .stderr(super::log_file(d, "controller")),
    )
    .unwrap();
    wait_up(&format!("{base}/v1/status")).await;
    let http = reqwest::Client::new();
    let r = http
        .put(format!("{base}/v1/config"))
        .bearer_auth(format!("{TOKEN}-0123456789abcdef"))
        .json(&payments_config("v1", 200.0))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    let agg_creds = d.join("client-credentials");
    write(&agg_creds, &format!("payments-old payments {old_c}\n"));
    let zone_token = d.join("zone-token");
    write(&zone_token, &format!("{old_z}\n"));
    let pa = free_port();
    let ua = format!("http://127.0.0.1:{pa}");
    let _agg = spawn_aggregator_with(
        pa,
        &base,
        "agg-r",
        d,
        100,
        &["--client-credentials", agg_creds.to_str().unwrap()],
        &[("GRL_REPORT_TOKEN_FILE", zone_token.to_str().unwrap())],
    );
    wait_up(&format!("{ua}/metrics")).await;

    // 400 rps against 200: enforcement visible, so a lost report would show as stale.
    let client_token = d.join("client-token");
    write(&client_token, old_c);
    let stop = Arc::new(AtomicBool::new(false));
    let counts: Arc<[AtomicU64; 2]> = Arc::new(Default::default());
    let mut clients = Vec::new();
    for i in 0..2 {
        let mut o = ClientOptions::new("payments", vec![ua.clone()]);
        o.tick = Duration::from_millis(100);
        o.stale_after = Duration::from_millis(600);
        o.client_id = Some(format!("r{i}"));
        o.report_token = Some(TokenSource::file(&client_token).unwrap());
        let c = Arc::new(GrlClient::start(o));
        load_as(
            c.clone(),
            ("gw", "charge"),
            200.0,
            stop.clone(),
            counts.clone(),
        );
        clients.push(c);
    }
    eventually("clients enforce", || {
        let ok = clients.iter().all(|c| c.limiter().table().ratio(0) > 0.3);
        async move { ok }
    })
    .await;
    let ok_before: Vec<u64> = clients
        .iter()
        .map(|c| c.stats().reports_ok.load(Ordering::Relaxed))
        .collect();

    // Each step waits past the 1 s reload check of the files.
    let settle = Duration::from_millis(2500);
    write(
        &agg_creds,
        &format!("payments-old payments {old_c}\npayments-new payments {new_c}\n"),
    );
    write(
        &ctl_creds,
        &format!("api config,overrides,reports {TOKEN}-0123456789abcdef\nzone-old zone-report {old_z}\nzone-new zone-report {new_z}\n"),
    );
    tokio::time::sleep(settle).await;
    write(&client_token, new_c);
    write(&zone_token, new_z);
    tokio::time::sleep(settle).await;
    write(&agg_creds, &format!("payments-new payments {new_c}\n"));
    write(
        &ctl_creds,
        &format!(
            "api config,overrides,reports {TOKEN}-0123456789abcdef\nzone-new zone-report {new_z}\n"
        ),
    );
    tokio::time::sleep(settle).await;

    for (i, c) in clients.iter().enumerate() {
        let s = c.stats();
        assert_eq!(
            s.report_errors.load(Ordering::Relaxed),
            0,
            "client {i} lost reports"
        );
        assert_eq!(
            s.fail_open_total.load(Ordering::Relaxed),
            0,
            "client {i} went stale"
        );
        // 7.5 s at 10 reports a second.
        let sent = s.reports_ok.load(Ordering::Relaxed) - ok_before[i];
        assert!(
            sent >= 60,
            "client {i}: only {sent} reports during the rotation"
        );
        assert!(
            c.limiter().table().ratio(0) > 0.3,
            "client {i} stopped enforcing"
        );
    }
    let am = get_text(&http, &format!("{ua}/metrics")).await;
    assert_eq!(sample(&am, "grl_reports_refused_total", &[]), None, "{am}");
    let cm = get_text(&http, &format!("{base}/metrics")).await;
    assert_eq!(sample(&cm, "grl_reports_refused_total", &[]), None, "{cm}");

    // The old credentials are gone now; the new ones work.
    let report = json!({"client_id": "probe", "service": "payments", "version": "",
        "interval_ms": 100, "buckets": []});
    for (secret, status) in [(old_c, 401), (new_c, 200)] {
        let r = http
            .post(format!("{ua}/v1/report"))
            .bearer_auth(secret)
            .json(&report)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), status);
    }
    let zone = json!({"aggregator_id": "probe", "region": "r1", "zone": "zp", "buckets": []});
    for (secret, status) in [(old_z, 401), (new_z, 200)] {
        let r = http
            .post(format!("{base}/v1/aggregate"))
            .bearer_auth(secret)
            .json(&zone)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), status);
    }
    stop.store(true, Ordering::Relaxed);
}

/// Separate credentials for pushing configs, overrides and reading reports: each is refused
/// (403) where it has no role, and an override records the name of the credential that
/// added it, never the secret.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_roles_are_least_privilege() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (config, ovr, read) = (
        "config-token-0123456789abcdef",
        "override-token-0123456789abcd",
        "read-token-0123456789abcdefgh",
    );
    let alice = "alice-token-0123456789abcdefg";
    let creds = d.join("credentials");
    write(&creds, &format!("alice overrides {alice}\n"));
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let _ctl = test_support::process::Proc::spawn(
        Command::new(env!("CARGO_BIN_EXE_grl"))
            .args(["controller", "--listen", &format!("127.0.0.1:{port}")])
            .args(["--tick-ms", "100", "--state-dir"])
            .arg(d.join("state"))
            .env("GRL_CREDENTIALS_FILE", &creds)
            .env("GRL_CONFIG_TOKEN", config)
            .env("GRL_OVERRIDE_TOKEN", ovr)
            .env("GRL_READ_TOKEN", read)
            .env("GRL_REPORT_TOKEN", REPORT_TOKEN)
            .env_remove("GRL_TOKEN")
            .stdout(std::process::Stdio::null())
            .stderr(super::log_file(d, "controller")),
    )
    .unwrap();
    wait_up(&format!("{base}/v1/status")).await;
    let http = reqwest::Client::new();
    let put = |token: &str| {
        http.put(format!("{base}/v1/config"))
            .bearer_auth(token)
            .json(&payments_config("v1", 200.0))
            .send()
    };
    let ovr_body = json!({"service": "payments", "bucket": "gw.charge", "limit_rps": 10.0,
                          "ttl_secs": 600, "reason": "INC-9", "who": "oncall"});
    let add = |token: &str| {
        http.post(format!("{base}/v1/overrides"))
            .bearer_auth(token)
            .json(&ovr_body)
            .send()
    };
    let reports = |token: &str| {
        http.get(format!("{base}/v1/reports"))
            .bearer_auth(token)
            .send()
    };
    // Config push: only the config credential.
    for t in [ovr, read, alice, REPORT_TOKEN] {
        let r = put(t).await.unwrap();
        assert_eq!(r.status(), 403);
        let err = r.json::<Value>().await.unwrap()["error"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(err.contains("config") && !err.contains(t), "{err}");
    }
    assert_eq!(put("nope").await.unwrap().status(), 401);
    assert_eq!(put(config).await.unwrap().status(), 200);
    // Overrides: only override credentials (env or file), and the name is recorded.
    for t in [config, read, REPORT_TOKEN] {
        assert_eq!(add(t).await.unwrap().status(), 403);
    }
    let r = add(ovr).await.unwrap();
    assert_eq!(r.status(), 201);
    let first: Value = r.json().await.unwrap();
    assert_eq!(first["credential"], "GRL_OVERRIDE_TOKEN");
    let r = add(alice).await.unwrap();
    assert_eq!(r.status(), 201);
    let second: Value = r.json().await.unwrap();
    assert_eq!(second["credential"], "alice");
    let list: Value = http
        .get(format!("{base}/v1/overrides"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let names: Vec<&str> = list["overrides"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["credential"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["GRL_OVERRIDE_TOKEN", "alice"]);
    let id = first["id"].as_str().unwrap();
    let del = |token: &str| {
        http.delete(format!("{base}/v1/overrides/{id}"))
            .bearer_auth(token)
            .send()
    };
    assert_eq!(del(config).await.unwrap().status(), 403);
    assert_eq!(del(alice).await.unwrap().status(), 200);
    // Reports: only the read credential.
    assert_eq!(
        http.get(format!("{base}/v1/reports"))
            .send()
            .await
            .unwrap()
            .status(),
        401
    );
    for t in [config, ovr] {
        assert_eq!(reports(t).await.unwrap().status(), 403);
    }
    assert_eq!(reports(read).await.unwrap().status(), 200);
    // Zone reports: not with an API credential.
    let zone = json!({"aggregator_id": "a", "region": "r1", "zone": "z1", "buckets": []});
    for t in [config, ovr, read] {
        let r = http
            .post(format!("{base}/v1/aggregate"))
            .bearer_auth(t)
            .json(&zone)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 403);
    }
    // The state file and the log name credentials, never secrets.
    let state = std::fs::read_to_string(d.join("state/overrides.json")).unwrap();
    let saved: Value = serde_json::from_str(&state).unwrap();
    assert_eq!(saved["overrides"][0]["credential"], "alice", "{state}");
    let log = std::fs::read_to_string(d.join("controller.log")).unwrap();
    for secret in [config, ovr, read, alice, REPORT_TOKEN] {
        assert!(!state.contains(secret) && !log.contains(secret));
    }
    // (Field names and values are separated by colour codes in the log.)
    assert!(
        log.contains("config applied") && log.contains("GRL_CONFIG_TOKEN"),
        "{log}"
    );
}

/// Sends the head of a request announcing a 60 MB body and 64 KiB of it, then waits for the
/// answer: the status line when the server answered before the body was complete.
fn answer_before_body(port: u16, head: &str) -> Option<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(
        s,
        "{head} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 60000000\r\n\r\n"
    )
    .unwrap();
    let _ = s.write_all(&vec![b' '; 64 << 10]);
    let mut buf = [0u8; 256];
    let n = s.read(&mut buf).ok()?;
    let text = String::from_utf8_lossy(&buf[..n]);
    Some(text.lines().next()?.to_string())
}

fn rss_kb(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// A request without a valid credential is answered 401 from its headers, before its body
/// arrived (the server holds none of it), on every authenticated endpoint; a dozen
/// unauthenticated 60 MB uploads leave the controller's memory where it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unauthenticated_large_body_is_refused_before_it_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let cport = free_port();
    let base = format!("http://127.0.0.1:{cport}");
    let ctl = spawn_controller(cport, &dir.path().join("state"), dir.path(), &[]);
    wait_up(&format!("{base}/v1/status")).await;
    let pa = free_port();
    let _agg = super::spawn_aggregator(pa, &base, "agg-b", dir.path());
    wait_up(&format!("http://127.0.0.1:{pa}/metrics")).await;
    for (port, head) in [
        (cport, "PUT /v1/config"),
        (cport, "POST /v1/overrides"),
        (cport, "POST /v1/aggregate"),
        (pa, "POST /v1/report"),
    ] {
        let line = tokio::task::spawn_blocking(move || answer_before_body(port, head))
            .await
            .unwrap();
        assert_eq!(
            line.as_deref(),
            Some("HTTP/1.1 401 Unauthorized"),
            "{head}: no answer before the body was sent"
        );
    }
    let pid = ctl.0.id();
    let before = rss_kb(pid);
    let uploads: Vec<_> = (0..12)
        .map(|_| {
            std::thread::spawn(move || {
                let mut s = TcpStream::connect(("127.0.0.1", cport)).unwrap();
                s.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
                let _ = write!(
                    s,
                    "PUT /v1/config HTTP/1.1\r\nHost: x\r\nContent-Length: 60000000\r\n\r\n"
                );
                let chunk = vec![b'x'; 1 << 20];
                let mut sent = 0usize;
                while sent < 60_000_000 {
                    match s.write(&chunk) {
                        Ok(n) => sent += n,
                        Err(_) => break,
                    }
                }
                sent
            })
        })
        .collect();
    let sent: Vec<usize> = uploads.into_iter().map(|u| u.join().unwrap()).collect();
    let after = rss_kb(pid);
    eprintln!("controller RSS {before} kB before, {after} kB after 12 unauthenticated 60 MB uploads (bytes the clients got to send: {sent:?})");
    assert!(
        after < before + 20_000,
        "controller RSS {before} kB → {after} kB after 12 unauthenticated uploads (sent {sent:?})"
    );
    // An authenticated override body beyond its 64 KiB bound: 413, not buffered.
    let big = json!({"service": "payments", "caller": "x".repeat(100_000), "drop_ratio": 0.5,
                     "ttl_secs": 60, "reason": "r", "who": "w"});
    let r = reqwest::Client::new()
        .post(format!("{base}/v1/overrides"))
        .bearer_auth(TOKEN)
        .json(&big)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
}

/// TTLs are bounded (7 days): u64::MAX used to wrap into an override that expired before it
/// was created; now it is refused with 422 and nothing is added.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn override_ttl_beyond_seven_days_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let _ctl = spawn_controller(port, &dir.path().join("state"), dir.path(), &[]);
    wait_up(&format!("{base}/v1/status")).await;
    let http = reqwest::Client::new();
    push_config(&http, &base, &payments_config("v1", 200.0)).await;
    let add = |ttl: u64| {
        http.post(format!("{base}/v1/overrides"))
            .bearer_auth(TOKEN)
            .json(&json!({"caller": "gw", "drop_ratio": 0.5, "ttl_secs": ttl,
                          "reason": "INC-1", "who": "sre"}))
            .send()
    };
    for ttl in [u64::MAX, u64::MAX - 1_000_000_000, 604_801] {
        let r = add(ttl).await.unwrap();
        assert_eq!(r.status(), 422, "ttl {ttl}");
        let err = r.json::<Value>().await.unwrap()["error"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(err.contains("7 days"), "{err}");
    }
    let list: Value = http
        .get(format!("{base}/v1/overrides"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(list["overrides"], json!([]));
    let r = add(604_800).await.unwrap();
    assert_eq!(r.status(), 201, "{}", r.text().await.unwrap());
    let o: Value = r.json().await.unwrap();
    let (c, e) = (
        o["created_at"].as_u64().unwrap(),
        o["expires_at"].as_u64().unwrap(),
    );
    assert_eq!(e - c, 604_800);
}

/// Without a report credential the servers refuse to start (naming what to set); the
/// development opt-out starts them with a warning.
#[test]
fn servers_refuse_to_start_without_report_credentials() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_grl"))
        .args(["controller", "--listen", "127.0.0.1:0", "--state-dir"])
        .arg(dir.path().join("s1"))
        .env("GRL_TOKEN", TOKEN)
        .env_remove("GRL_REPORT_TOKEN")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("GRL_REPORT_TOKEN") && err.contains("--insecure-allow-anonymous-reports"),
        "{err}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_grl"))
        .args([
            "aggregator",
            "--listen",
            "127.0.0.1:0",
            "--controller",
            "http://127.0.0.1:9",
        ])
        .args(["--zone", "z", "--region", "r"])
        .env("GRL_REPORT_TOKEN", REPORT_TOKEN)
        .env_remove("GRL_CLIENT_CREDENTIALS_FILE")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--client-credentials"), "{err}");
    // A credentials file with a bad line: refused, naming file and line, not the secret.
    let creds = dir.path().join("creds");
    std::fs::write(
        &creds,
        "ok payments 0123456789abcdefXYZ\nbad payments short-secret\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_grl"))
        .args([
            "aggregator",
            "--listen",
            "127.0.0.1:0",
            "--controller",
            "http://127.0.0.1:9",
        ])
        .args(["--zone", "z", "--region", "r", "--client-credentials"])
        .arg(&creds)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("creds:2:") && !err.contains("short-secret"),
        "{err}"
    );

    // The opt-out: up, and loud about it.
    let port = free_port();
    let mut p = test_support::process::Proc::spawn(
        Command::new(env!("CARGO_BIN_EXE_grl"))
            .args([
                "controller",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--state-dir",
            ])
            .arg(dir.path().join("s2"))
            .arg("--insecure-allow-anonymous-reports")
            .env("GRL_TOKEN", TOKEN)
            .env_remove("GRL_REPORT_TOKEN")
            .stdout(std::process::Stdio::piped())
            .stderr(super::log_file(dir.path(), "insecure")),
    )
    .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(p.0.stdout.as_mut().unwrap()),
        &mut line,
    )
    .unwrap();
    assert!(line.starts_with("listening on"), "{line}");
    drop(p);
    let log = std::fs::read_to_string(dir.path().join("insecure.log")).unwrap();
    assert!(log.contains("INSECURE"), "{log}");
}
