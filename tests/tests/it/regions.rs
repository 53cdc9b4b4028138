//! Two regions on real processes, on loopback: a `grl controller` per region (peered, as
//! `global` buckets need), an aggregator and a `grl sidecar` in each, a Python HTTP service
//! behind them, and one `rlc serve` reading both controllers (`controllers:` in rlc.yaml).
//!
//! Asserted: rlc's shadow totals are the two controllers' counters summed (exactly), not one
//! region's, nor twice the fleet (each peered controller's report rows carry the peers' rates
//! too); an override set on region b's controller shows on the bucket's page; and a
//! controller that can no longer be read marks the figures incomplete, naming its region.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use test_support::git::GitRemote;
use test_support::process::{free_port, Proc};

use super::fleet::{Load, CLIENT_SECRET, ZONE_TOKEN};
use super::{
    bin, charge_counter, get, get_text, start_rlc_serve_on, wait_until, write_steady_history, TOKEN,
};

const RLC_TOKEN: &str = "regions-e2e-rlc-token";

/// What rlc's `GET /v1/shadow` counts as offered to payments/charge.
fn rlc_offered(rport: u16) -> Option<f64> {
    let s = get(rport, "/v1/shadow?service=payments&window=1h")?;
    s["buckets"]
        .as_array()?
        .iter()
        .find(|b| b["bucket"] == "charge")?["offered"]
        .as_f64()
}

#[test]
fn two_regions_are_summed_and_a_region_that_cannot_be_read_is_named() {
    let started = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path();
    let log = |name: &str| Stdio::from(std::fs::File::create(logs.join(name)).unwrap());

    // A global shadow bucket far above the load: nothing is refused.
    let payments = "service: payments\nbuckets:\n  - name: charge\n    caller: charge\n    scope: global\n    limit_rps: 3470\n    mode: shadow\n    policy: peak\n";
    let remote = GitRemote::new(
        "main",
        &[
            ("rlc/policies.yaml", "default:\n  policy: peak\n"),
            ("buckets/payments.yaml", payments),
        ],
    )
    .expect("git remote");
    let version = remote.head("main").unwrap();
    write_steady_history(dir.path(), "charge", 150.0);

    // One controller per region, each the other's peer, ticking every second (a report row's
    // rates then sum to its requests).
    let (ca, cb) = (free_port(), free_port());
    let controller = |region: &str, port: u16, peer: u16| {
        let p = Proc::spawn(
            Command::new(bin("grl"))
                .args(["controller", "--listen", &format!("127.0.0.1:{port}")])
                .args(["--tick-ms", "1000", "--region", region])
                .args(["--peer", &format!("http://127.0.0.1:{peer}")])
                .arg("--state-dir")
                .arg(dir.path().join(format!("state-{region}")))
                .env("GRL_TOKEN", TOKEN)
                .env("GRL_REPORT_TOKEN", ZONE_TOKEN)
                .stdout(Stdio::null())
                .stderr(log(&format!("controller-{region}.log"))),
        )
        .unwrap();
        wait_until(Duration::from_secs(20), || {
            get(port, "/v1/status").is_some()
        });
        p
    };
    let _ctl_a = controller("a", ca, cb);
    let mut ctl_b = Some(controller("b", cb, ca));

    // In each region an aggregator and a sidecar in front of one Python service.
    let creds = dir.path().join("client-credentials");
    std::fs::write(&creds, format!("payments payments {CLIENT_SECRET}\n")).unwrap();
    let py_port = free_port();
    let _service = Proc::spawn(
        Command::new("python3")
            .args(["-m", "http.server", "--bind", "127.0.0.1"])
            .arg(py_port.to_string())
            .current_dir(dir.path())
            .stdout(Stdio::null())
            .stderr(log("service.log")),
    )
    .unwrap();
    let mut procs = Vec::new();
    let mut sidecars = Vec::new();
    for (region, cport) in [("a", ca), ("b", cb)] {
        let aport = free_port();
        procs.push(
            Proc::spawn(
                Command::new(bin("grl"))
                    .args(["aggregator", "--listen", &format!("127.0.0.1:{aport}")])
                    .args(["--controller", &format!("http://127.0.0.1:{cport}")])
                    .args(["--zone", &format!("z{region}"), "--region", region])
                    .arg("--client-credentials")
                    .arg(&creds)
                    .env("GRL_REPORT_TOKEN", ZONE_TOKEN)
                    .stdout(Stdio::null())
                    .stderr(log(&format!("aggregator-{region}.log"))),
            )
            .unwrap(),
        );
        wait_until(Duration::from_secs(20), || {
            get_text(aport, "/healthz").is_some()
        });
        let (port, admin) = (free_port(), free_port());
        procs.push(
            Proc::spawn(
                Command::new(bin("grl"))
                    .args(["sidecar", "--listen", &format!("127.0.0.1:{port}")])
                    .args(["--admin-listen", &format!("127.0.0.1:{admin}")])
                    .args(["--upstream", &format!("http://127.0.0.1:{py_port}")])
                    .args(["--service", "payments", "--caller-header", "x-caller"])
                    .args(["--zone", &format!("z{region}"), "--region", region])
                    .args(["--aggregator", &format!("http://127.0.0.1:{aport}")])
                    .env("GRL_CLIENT_TOKEN", CLIENT_SECRET)
                    .stdout(Stdio::null())
                    .stderr(log(&format!("sidecar-{region}.log"))),
            )
            .unwrap(),
        );
        sidecars.push((format!("http://127.0.0.1:{port}"), admin));
    }

    let controllers = format!(
        "controllers:\n  - {{region: a, url: \"http://127.0.0.1:{ca}\", token_env: GRL_TOKEN}}\n  - {{region: b, url: \"http://127.0.0.1:{cb}\", token_env: GRL_TOKEN}}\n"
    );
    let (_serve, rport) = start_rlc_serve_on(
        dir.path(),
        "history:\n  file: history.csv\n  lookback: 1h\n  step: 1m\n",
        &remote.url(),
        "sqlite://rlc.db",
        (&controllers, &[ca, cb]),
        RLC_TOKEN,
        &version,
    );
    // Each sidecar decides with the pushed config (before, requests match no bucket).
    for (_, admin) in &sidecars {
        wait_until(Duration::from_secs(30), || {
            get_text(*admin, "/metrics").is_some_and(|t| {
                t.contains(&format!(
                    "grl_client_config_info{{service=\"payments\",version=\"{version}\"}} 1"
                ))
            })
        });
    }

    // 300 rps as caller `charge`, round robin over the two regions' sidecars, for 10 s (report
    // rows carry the requests counted, so rlc's figures are exact whatever the length).
    let urls: Vec<String> = sidecars.iter().map(|(u, _)| u.clone()).collect();
    let load = Load::new(&urls);
    let charge = load.caller("charge", "hello.txt");
    std::fs::write(dir.path().join("hello.txt"), "hello\n").unwrap();
    charge.set_rps(300.0);
    std::thread::sleep(Duration::from_secs(10));
    charge.set_rps(0.0);
    let (ok, limited) = charge.counts();
    drop(load);
    assert_eq!(limited, 0, "a shadow bucket refuses nothing");

    // The controllers' counters once settled: each region counts its own requests.
    let offered = |port: u16| {
        get_text(port, "/metrics").map(|m| charge_counter(&m, "grl_requests_offered_total"))
    };
    // Settled: the same over three reads 2 s apart (a sidecar reports every second, its
    // aggregator forwards every second, the controller counts at its tick).
    let mut reads: Vec<(f64, f64)> = Vec::new();
    wait_until(Duration::from_secs(40), || {
        std::thread::sleep(Duration::from_secs(2));
        reads.push((offered(ca).unwrap_or(0.0), offered(cb).unwrap_or(0.0)));
        let n = reads.len();
        n >= 3 && reads[n - 1] == reads[n - 3] && reads[n - 1].0 > 0.0 && reads[n - 1].1 > 0.0
    });
    eprintln!("regions: controller counts after the load: {reads:?}");
    let last = *reads.last().unwrap();
    let (in_a, in_b) = last;
    let fleet = in_a + in_b;
    // Every request the sidecars decided is counted once, in its own region.
    let decided: f64 = sidecars
        .iter()
        .map(|(_, admin)| {
            let m = get_text(*admin, "/metrics").unwrap_or_default();
            m.lines()
                .filter(|l| l.starts_with("grl_sidecar_requests_total{"))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum::<f64>()
        })
        .sum();
    assert_eq!(
        fleet, decided,
        "controllers counted {in_a} (a) + {in_b} (b); the sidecars decided {decided}"
    );

    // rlc's total: both regions, each request once.
    let mut seen = None;
    let within = |v: f64| v == fleet;
    let waited = wait_until_or(Duration::from_secs(30), || {
        seen = rlc_offered(rport);
        seen.is_some_and(within)
    });
    assert!(
        waited,
        "rlc counts {seen:?} offered to payments/charge; the controllers {in_a} (a) + {in_b} (b) = {fleet}"
    );

    // An incident override set on region b only: on the bucket's page.
    let out = Command::new(bin("grl"))
        .args([
            "override",
            "add",
            "--controller",
            &format!("http://127.0.0.1:{cb}"),
        ])
        .args([
            "--service",
            "payments",
            "--caller",
            "charge",
            "--limit-rps",
            "50",
        ])
        .args([
            "--ttl",
            "10m",
            "--reason",
            "INC-REGION-B",
            "--who",
            "oncall",
        ])
        .env("GRL_TOKEN", TOKEN)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut detail = Value::Null;
    wait_until(Duration::from_secs(30), || {
        detail = get(rport, "/v1/shadow/payments/charge?window=1h").unwrap_or(Value::Null);
        detail["overrides"]
            .as_array()
            .is_some_and(|o| o.iter().any(|o| o["reason"] == "INC-REGION-B"))
    });
    assert_eq!(detail["incomplete"], serde_json::json!([]), "{detail}");
    let page = get_text(rport, "/buckets/payments/charge").unwrap_or_default();
    assert!(page.contains("INC-REGION-B"), "{page}");

    // Region b's controller stops: the figures say they miss region b, and why.
    drop(ctl_b.take());
    let mut summary = Value::Null;
    wait_until(Duration::from_secs(30), || {
        summary = get(rport, "/v1/shadow?service=payments&window=1h").unwrap_or(Value::Null);
        summary["incomplete"]
            .as_array()
            .is_some_and(|r| r.len() == 1 && r[0]["region"] == "b")
    });
    assert!(
        summary["incomplete"][0]["error"]
            .as_str()
            .is_some_and(|e| !e.is_empty()),
        "{summary}"
    );
    let page = get_text(rport, "/buckets/payments/charge").unwrap_or_default();
    assert!(
        page.contains("Figures incomplete") && page.contains("cannot be read since"),
        "{page}"
    );
    let overview = get_text(rport, "/").unwrap_or_default();
    assert!(overview.contains("Figures incomplete"), "{overview}");
    eprintln!(
        "regions: {:.0} s; {ok} served; controllers {in_a} (a) + {in_b} (b); rlc {seen:?}",
        started.elapsed().as_secs_f64()
    );
    drop(procs);
}

/// Polls `cond` until it holds or `limit` passes; whether it held.
fn wait_until_or(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while !cond() {
        if start.elapsed() >= limit {
            return false;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    true
}
