//! Integration tests: the built `grl` binary as real controller and aggregator processes on
//! loopback, with in-process clients (the library a service embeds).

// End-to-end scenarios read top to bottom; the size bound (clippy.toml) is for code outside
// tests.
#![allow(clippy::too_many_lines)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use grl_client::client::{ClientOptions, GrlClient};
use grl_core::Decision;
use serde_json::{json, Value};
use test_support::process::{free_port, Proc};
use test_support::wait::{eventually, wait_up};

#[path = "../front/mod.rs"]
mod front;
use front::{log_file, CLIENT_TOKEN};

mod candidates;
mod config_dir_faults;
mod connections;
mod counts;
mod criticality;
mod flood;
mod ha;
mod metrics;
mod ops;
mod overrides;
mod sidecar;
mod trust;
mod wire_props;

const TOKEN: &str = "s3cret";
/// The zone-report secret every controller and aggregator of the tests shares.
const REPORT_TOKEN: &str = "r3port";
/// Held by the tests that offer hundreds of requests a second and measure rates or
/// latencies: on a 2-core machine two of them at once would measure the machine, so they take
/// turns (the other tests still run beside them).
static HEAVY: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn spawn_controller(port: u16, state: &Path, logs: &Path, extra: &[&str]) -> Proc {
    Proc::spawn(
        Command::new(env!("CARGO_BIN_EXE_grl"))
            .args([
                "controller",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--tick-ms",
                "100",
                "--state-dir",
            ])
            .arg(state)
            .args(extra)
            .env("GRL_TOKEN", TOKEN)
            .env("GRL_REPORT_TOKEN", REPORT_TOKEN)
            .stdout(Stdio::null())
            .stderr(log_file(logs, &format!("controller-{port}"))),
    )
    .unwrap()
}

/// An aggregator accepting `CLIENT_TOKEN` for `payments` (from a credentials file in `logs`).
fn spawn_aggregator(port: u16, controller: &str, id: &str, logs: &Path) -> Proc {
    spawn_aggregator_ticking(port, controller, id, logs, 100)
}

/// [`spawn_aggregator`] forwarding every `tick_ms`.
fn spawn_aggregator_ticking(
    port: u16,
    controller: &str,
    id: &str,
    logs: &Path,
    tick_ms: u64,
) -> Proc {
    let creds = logs.join("client-credentials");
    std::fs::write(&creds, format!("payments payments {CLIENT_TOKEN}\n")).unwrap();
    spawn_aggregator_with(
        port,
        controller,
        id,
        logs,
        tick_ms,
        &["--client-credentials", creds.to_str().unwrap()],
        &[("GRL_REPORT_TOKEN", REPORT_TOKEN)],
    )
}

fn spawn_aggregator_with(
    port: u16,
    controller: &str,
    id: &str,
    logs: &Path,
    tick_ms: u64,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Proc {
    Proc::spawn(
        Command::new(env!("CARGO_BIN_EXE_grl"))
            .args([
                "aggregator",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--controller",
                controller,
            ])
            .args([
                "--zone",
                "z1",
                "--region",
                "r1",
                "--tick-ms",
                &tick_ms.to_string(),
                "--id",
                id,
            ])
            .args(extra)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(log_file(logs, id)),
    )
    .unwrap()
}

/// [`spawn_controller`] on a free port, waited for until its `/v1/status` answers: the
/// process, its port (to start it again on with [`start_controller_at`]) and its base URL.
async fn start_controller(state: &Path, logs: &Path, extra: &[&str]) -> (Proc, u16, String) {
    let port = free_port();
    let ctl = start_controller_at(port, state, logs, extra).await;
    (ctl, port, format!("http://127.0.0.1:{port}"))
}

/// [`spawn_controller`] on `port`, waited for until its `/v1/status` answers.
async fn start_controller_at(port: u16, state: &Path, logs: &Path, extra: &[&str]) -> Proc {
    let ctl = spawn_controller(port, state, logs, extra);
    wait_up(&format!("http://127.0.0.1:{port}/v1/status")).await;
    ctl
}

/// The body of `GET url` with the operator token, as JSON.
async fn get_json_authorized(http: &reqwest::Client, url: &str) -> Value {
    http.get(url)
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// [`spawn_aggregator`] on a free port, reporting to the controller at `controller` and waited
/// for until its `/v1/config` answers: the process and its base URL.
async fn start_aggregator(controller: &str, id: &str, logs: &Path) -> (Proc, String) {
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let agg = spawn_aggregator(port, controller, id, logs);
    wait_up(&format!("{url}/v1/config")).await;
    (agg, url)
}

/// `PUT {base}/v1/config` of `doc` with the operator token: the response, unchecked.
async fn put_config(http: &reqwest::Client, base: &str, doc: &Value) -> reqwest::Response {
    http.put(format!("{base}/v1/config"))
        .bearer_auth(TOKEN)
        .json(doc)
        .send()
        .await
        .unwrap()
}

/// `PUT {base}/v1/config` of `doc` with the operator token; fails the test unless it is taken.
async fn push_config(http: &reqwest::Client, base: &str, doc: &Value) {
    let r = put_config(http, base, doc).await;
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
}

/// The body of `GET url` (no credential) as JSON.
async fn get_json(http: &reqwest::Client, url: &str) -> Value {
    http.get(url).send().await.unwrap().json().await.unwrap()
}

/// The body of `GET url` (no credential) as text.
async fn get_text(http: &reqwest::Client, url: &str) -> String {
    http.get(url).send().await.unwrap().text().await.unwrap()
}

/// The standard output of `grl simulate ARGS --scenario scenarios/SCENARIO`; fails the test,
/// with the standard error, when it exits non-zero.
fn simulate(args: &[&str], scenario: &str) -> String {
    let scenario = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("scenarios")
        .join(scenario);
    let out = succeeded(
        Command::new(env!("CARGO_BIN_EXE_grl"))
            .arg("simulate")
            .args(args)
            .arg("--scenario")
            .arg(&scenario),
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The output of `cmd`, run to its end; fails the test, with the standard error, when it
/// exits non-zero.
fn succeeded(cmd: &mut Command) -> std::process::Output {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// One JSON value per line of `text`.
fn json_lines(text: &str) -> Vec<Value> {
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn payments_config(version: &str, limit: f64) -> Value {
    json!({
        "version": version,
        "services": [{
            "service": "payments",
            "buckets": [
                {"name": "gw.charge", "caller": "gw", "procedure": "charge", "scope": "global",
                 "limit_rps": limit, "mode": "enforce", "policy": "peak"}
            ]
        }]
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_api_validates_persists_and_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let ctl = spawn_controller(port, &state, dir.path(), &[]);
    wait_up(&format!("{base}/v1/status")).await;
    let http = reqwest::Client::new();
    let put = |body: String, token: Option<&str>| {
        let mut r = http
            .put(format!("{base}/v1/config"))
            .header("content-type", "application/json")
            .body(body);
        if let Some(t) = token {
            r = r.bearer_auth(t);
        }
        r.send()
    };
    let good = payments_config("v1", 200.0).to_string();

    assert_eq!(put(good.clone(), None).await.unwrap().status(), 401);
    assert_eq!(
        put(good.clone(), Some("wrong")).await.unwrap().status(),
        401
    );

    let r = put("{not json".into(), Some(TOKEN)).await.unwrap();
    assert_eq!(r.status(), 400);
    assert!(r.json::<Value>().await.unwrap()["error"]
        .as_str()
        .unwrap()
        .contains("malformed"));

    let r = put(payments_config("v0", -1.0).to_string(), Some(TOKEN))
        .await
        .unwrap();
    assert_eq!(r.status(), 422);
    assert!(r.json::<Value>().await.unwrap()["error"]
        .as_str()
        .unwrap()
        .contains("limit_rps"));

    let mut dup = payments_config("v0", 10.0);
    let svc = dup["services"][0].clone();
    dup["services"].as_array_mut().unwrap().push(svc);
    let r = put(dup.to_string(), Some(TOKEN)).await.unwrap();
    assert_eq!(r.status(), 422);
    assert!(r.json::<Value>().await.unwrap()["error"]
        .as_str()
        .unwrap()
        .contains("twice"));

    let mut no_match = payments_config("v0", 10.0);
    no_match["services"][0]["buckets"][0]
        .as_object_mut()
        .unwrap()
        .retain(|k, _| k != "caller" && k != "procedure");
    assert_eq!(
        put(no_match.to_string(), Some(TOKEN))
            .await
            .unwrap()
            .status(),
        422
    );

    // Nothing changed by the refused pushes.
    let cfg: Value = http
        .get(format!("{base}/v1/config"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(cfg["version"], "");

    let r = put(good.clone(), Some(TOKEN)).await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap()["changed"], true);
    let r = put(good.clone(), Some(TOKEN)).await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap()["changed"], false);

    let status: Value = http
        .get(format!("{base}/v1/status"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(status["version"], "v1");
    assert_eq!(status["buckets"], 1);

    // Overrides: token required, validated, listed.
    let ovr = json!({"service": "payments", "bucket": "gw.charge", "limit_rps": 50.0, "ttl_secs": 3600,
                     "reason": "INC-42", "who": "alice"});
    let r = http
        .post(format!("{base}/v1/overrides"))
        .json(&ovr)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = http
        .post(format!("{base}/v1/overrides"))
        .bearer_auth(TOKEN)
        .json(&json!({"caller": "gw", "ttl_secs": 60, "reason": "x", "who": "y"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 422);
    let r = http
        .post(format!("{base}/v1/overrides"))
        .bearer_auth(TOKEN)
        .json(&ovr)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let id = r.json::<Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();

    let metrics = http
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    // OpenMetrics: the family is named without `_total`, its samples with it.
    assert!(metrics.contains("# TYPE grl_requests_offered counter"));
    assert!(metrics.contains("# TYPE grl_drop_ratio gauge"));

    // Restart: config and override come back from the state dir.
    ctl.kill();
    let ctl = spawn_controller(port, &state, dir.path(), &[]);
    wait_up(&format!("{base}/v1/status")).await;
    let cfg: Value = http
        .get(format!("{base}/v1/config"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(cfg, payments_config("v1", 200.0));
    let list: Value = http
        .get(format!("{base}/v1/overrides"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(list["overrides"][0]["id"], id.as_str());
    assert_eq!(list["overrides"][0]["who"], "alice");

    // Removal needs the token, then the override is gone.
    let r = http
        .delete(format!("{base}/v1/overrides/{id}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = http
        .delete(format!("{base}/v1/overrides/{id}"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let list: Value = http
        .get(format!("{base}/v1/overrides"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(list["overrides"].as_array().unwrap().len(), 0);
    drop(ctl);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_loads_config_dir_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("buckets");
    std::fs::create_dir_all(&cfg).unwrap();
    std::fs::write(
        cfg.join("maps.yaml"),
        "service: maps\nbuckets:\n  - name: a\n    caller: a\n    limit_rps: 5\n  - name: b\n    procedure: route\n    limit_rps: 7\n    mode: shadow\n",
    )
    .unwrap();
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let _ctl = spawn_controller(
        port,
        &dir.path().join("state"),
        dir.path(),
        &["--config-dir", cfg.to_str().unwrap()],
    );
    wait_up(&format!("{base}/v1/status")).await;
    let status: Value = reqwest::get(format!("{base}/v1/status"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(status["buckets"], 2);
    assert!(status["version"].as_str().unwrap().starts_with("dir:"));
}

#[test]
fn controller_refuses_a_config_dir_that_rlc_validate_rejects() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("buckets");
    std::fs::create_dir_all(&cfg).unwrap();
    let file = |name: &str, text: &str| std::fs::write(cfg.join(name), text).unwrap();
    file(
        "x.yaml",
        "service: y\nbuckets:\n  - name: a\n    caller: a\n    limit_rps: 5\n",
    );
    file(
        "typo.yaml",
        "service: typo\nbuckets:\n  - name: a\n    caller: a\n    limit_rps: 5\n    colour: red\n",
    );
    file("old.yml", "service: old\nbuckets: []\n");
    let out = Command::new(env!("CARGO_BIN_EXE_grl"))
        .args(["controller", "--listen", "127.0.0.1:0", "--state-dir"])
        .arg(dir.path().join("state"))
        .arg("--config-dir")
        .arg(&cfg)
        .env("GRL_TOKEN", TOKEN)
        .env("GRL_REPORT_TOKEN", REPORT_TOKEN)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    // Every problem, each once, with file:line.
    assert!(err.contains("x.yaml:1:"), "{err}");
    assert!(err.contains("typo.yaml:6:"), "{err}");
    assert!(err.contains("old.yml:1:"), "{err}");
    assert_eq!(err.matches("unknown field").count(), 1, "{err}");
    // Nothing was persisted from the refused dir.
    assert!(!dir.path().join("state/config.json").exists());
}

/// Offers `rps` requests per second of caller `gw` to `client`'s limiter until `stop`.
fn load(client: Arc<GrlClient>, rps: f64, stop: Arc<AtomicBool>, dropped: Arc<AtomicU64>) {
    std::thread::spawn(move || {
        let start = std::time::Instant::now();
        let mut done = 0u64;
        while !stop.load(Ordering::Relaxed) {
            let due = (start.elapsed().as_secs_f64() * rps) as u64;
            while done < due {
                if client.limiter().decide("gw", "charge") == Decision::Drop {
                    dropped.fetch_add(1, Ordering::Relaxed);
                }
                done += 1;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    });
}

async fn reports_after(http: &reqwest::Client, base: &str, after: u64) -> (u64, Vec<Value>) {
    let v: Value = match http
        .get(format!("{base}/v1/reports?after={after}&limit=1000"))
        .bearer_auth(TOKEN)
        .send()
        .await
    {
        Ok(r) => r.json().await.unwrap_or(Value::Null),
        Err(_) => Value::Null,
    };
    let next = v["next"].as_u64().unwrap_or(after);
    let rows = v["reports"].as_array().cloned().unwrap_or_default();
    (next, rows)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fleet_enforces_fails_over_fails_open_and_recovers() {
    // 400 requests/s of load and timed waits: not beside the other rate-measuring tests (two
    // of them at once failed both on a loaded run).
    let _heavy = HEAVY.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let state: PathBuf = dir.path().join("state");
    let cport = free_port();
    let base = format!("http://127.0.0.1:{cport}");
    let ctl = spawn_controller(cport, &state, dir.path(), &[]);
    wait_up(&format!("{base}/v1/status")).await;
    let http = reqwest::Client::new();
    push_config(&http, &base, &payments_config("v1", 200.0)).await;

    let (pa, pb) = (free_port(), free_port());
    let (ua, ub) = (
        format!("http://127.0.0.1:{pa}"),
        format!("http://127.0.0.1:{pb}"),
    );
    let agg_a = spawn_aggregator(pa, &base, "agg-a", dir.path());
    let _agg_b = spawn_aggregator(pb, &base, "agg-b", dir.path());
    wait_up(&format!("{ua}/v1/config")).await;
    wait_up(&format!("{ub}/v1/config")).await;

    let stop = Arc::new(AtomicBool::new(false));
    let clients = alternating_clients(4, &ua, &ub);
    for c in &clients {
        load(c.clone(), 100.0, stop.clone(), Arc::new(AtomicU64::new(0)));
    }

    // 1. Enforcement: 400 rps offered against 200 → the controller's reports settle at the
    //    limit (mean of the recent rows, which are noisy at 100 ms).
    let mut cursor = 0;
    let mut recent: Vec<Value> = Vec::new();
    let mut settled = false;
    for _ in 0..300 {
        let (next, rows) = reports_after(&http, &base, cursor).await;
        cursor = next;
        recent.extend(rows.into_iter().filter(|r| r["bucket"] == "gw.charge"));
        let n = recent.len();
        if n >= 20 {
            let tail = &recent[n - 20..];
            let mean = |k: &str| tail.iter().map(|r| r[k].as_f64().unwrap()).sum::<f64>() / 20.0;
            let (offered, admitted) = (mean("offered"), mean("admitted"));
            if offered > 300.0 && ((admitted - 200.0) / 200.0).abs() < 0.2 {
                settled = true;
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        settled,
        "admitted never settled at the limit: {:?}",
        recent.iter().rev().take(5).collect::<Vec<_>>()
    );
    assert!(clients
        .iter()
        .all(|c| c.limiter().table().version() == "v1"));

    // 2. Kill one aggregator: its clients fail over and keep enforcing.
    agg_a.kill();
    eventually("clients fail over", || {
        let ok = clients[0].stats().failovers.load(Ordering::Relaxed) >= 1
            && clients[2].stats().failovers.load(Ordering::Relaxed) >= 1;
        async move { ok }
    })
    .await;
    // What the embedding service's /metrics shows: the same failovers, not failing open.
    for c in [&clients[0], &clients[2]] {
        let m = metrics::client_metrics(c);
        let failovers = c.stats().failovers.load(Ordering::Relaxed) as f64;
        assert!(failovers >= 1.0);
        assert!(
            metrics::client_value(&m, "grl_client_failovers_total") >= failovers,
            "{m}"
        );
        assert_eq!(
            metrics::client_value(&m, "grl_client_failing_open"),
            0.0,
            "{m}"
        );
        assert!(
            metrics::client_value(&m, "grl_client_directives_age_seconds") < 5.0,
            "{m}"
        );
    }
    let now = grl_core::now_ms();
    for c in &clients {
        let t = c.limiter().table();
        assert!(!t.is_stale(now), "a client went stale after failover");
        assert!(t.ratio(0) > 0.2, "ratio {}", t.ratio(0));
    }

    // 3. Kill the controller (SIGKILL, under traffic): every client fails open within the
    //    staleness bound. An override in force before the crash (the configured limit, so the
    //    ratios stay as they are) must come back with the controller.
    let r = http
        .post(format!("{base}/v1/overrides"))
        .bearer_auth(TOKEN)
        .json(
            &json!({"service": "payments", "bucket": "gw.charge", "limit_rps": 200.0,
                      "ttl_secs": 3600, "reason": "INC-0", "who": "carol"}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let before_crash: Value = r.json().await.unwrap();
    ctl.kill();
    eventually("clients fail open", || {
        let now = grl_core::now_ms();
        let ok = clients.iter().all(|c| {
            c.limiter().table().is_stale(now)
                && c.stats().fail_open_total.load(Ordering::Relaxed) >= 1
        });
        async move { ok }
    })
    .await;
    for c in &clients {
        for _ in 0..1000 {
            assert_ne!(c.limiter().decide("gw", "charge"), Decision::Drop);
        }
        let m = metrics::client_metrics(c);
        assert_eq!(
            metrics::client_value(&m, "grl_client_failing_open"),
            1.0,
            "{m}"
        );
        assert!(
            metrics::client_value(&m, "grl_client_fail_open_total") >= 1.0,
            "{m}"
        );
    }

    // 4. Restart the controller: it serves the persisted config and enforcement resumes.
    let _ctl = spawn_controller(cport, &state, dir.path(), &[]);
    wait_up(&format!("{base}/v1/status")).await;
    eventually("clients enforce again", || {
        let now = grl_core::now_ms();
        let ok = clients.iter().all(|c| {
            let t = c.limiter().table();
            !t.is_stale(now) && t.ratio(0) > 0.2
        });
        async move { ok }
    })
    .await;
    let cfg: Value = http
        .get(format!("{base}/v1/config"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(cfg["version"], "v1");
    let list: Value = http
        .get(format!("{base}/v1/overrides"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(list["overrides"].as_array().unwrap().len(), 1, "{list}");
    assert_eq!(list["overrides"][0]["id"], before_crash["id"]);
    assert_eq!(list["overrides"][0]["reason"], "INC-0");
    let r = http
        .delete(format!(
            "{base}/v1/overrides/{}",
            before_crash["id"].as_str().unwrap()
        ))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    // 5. An incident override (here through the CLI) reaches the clients within a few ticks.
    succeeded(
        Command::new(env!("CARGO_BIN_EXE_grl"))
            .args(["override", "add", "--controller", &base, "--caller", "gw"])
            .args([
                "--drop-ratio",
                "0.9",
                "--ttl",
                "10m",
                "--reason",
                "INC-1",
                "--who",
                "bob",
            ])
            .env("GRL_TOKEN", TOKEN),
    );
    eventually("override in force at the clients", || {
        let ok = clients
            .iter()
            .all(|c| (c.limiter().table().ratio(0) - 0.9).abs() < 1e-6);
        async move { ok }
    })
    .await;
    let out = Command::new(env!("CARGO_BIN_EXE_grl"))
        .args([
            "override",
            "list",
            "--controller",
            &base,
            "--format",
            "json",
        ])
        .output()
        .unwrap();
    let list: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(list["overrides"][0]["reason"], "INC-1");
    stop.store(true, Ordering::Relaxed);
}

/// Clients that report once a second (`GrlClient`'s default period, `grl sidecar --tick-ms
/// 1000`) to an aggregator that forwards every 100 ms: the aggregator keeps each client's rates
/// for a few of the client's own periods, not a few of its ticks, so the controller sees the
/// whole fleet and every client gets a ratio. (Before: every client was forgotten 300 ms after
/// each report, each got the ratio computed without itself, and nothing was dropped.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_reporting_less_often_than_the_aggregator_ticks_still_enforce() {
    let dir = tempfile::tempdir().unwrap();
    let (_ctl, _, base) = start_controller(&dir.path().join("state"), dir.path(), &[]).await;
    const LIMIT: f64 = 200.0;
    let http = reqwest::Client::new();
    let r = put_config(&http, &base, &payments_config("v1", LIMIT)).await;
    assert_eq!(r.status(), 200);
    let (_agg, ua) = start_aggregator(&base, "agg-a", dir.path()).await;

    let stop = Arc::new(AtomicBool::new(false));
    let mut counts = Vec::new();
    // 1.5 times the limit, 60/30/10 % over three clients.
    for (i, share) in [0.6, 0.3, 0.1].iter().enumerate() {
        let mut o = ClientOptions::new("payments", vec![ua.clone()]);
        assert_eq!(o.tick, Duration::from_secs(1), "the default period");
        o.client_id = Some(format!("slow{i}"));
        o.report_token = Some(CLIENT_TOKEN.into());
        let c = Arc::new(GrlClient::start(o));
        let n: Arc<[AtomicU64; 2]> = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
        load_as(
            c,
            ("gw", "charge"),
            1.5 * LIMIT * share,
            stop.clone(),
            n.clone(),
        );
        counts.push(n);
    }
    // Windows of 4 s until the fleet admits the limit (±10 %) with every client dropping its
    // share; the bound is a hang guard (the loop settles within a few report periods).
    let seen = settle_at(&counts, LIMIT, 10).await;
    stop.store(true, Ordering::Relaxed);
    assert!(
        seen.is_ok(),
        "never settled at the limit:\n{}",
        seen.unwrap_err().join("\n")
    );
}

/// A zone whose aggregator forwards every second to a controller ticking every 100 ms still
/// counts between its forwards: with a zone TTL of three controller ticks the slow zone
/// dropped out 300 ms after each forward, and the fast zone's answers in between carried
/// ratios computed without the slow zone's load (the fleet admitted well over the limit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zones_forwarding_less_often_than_the_controller_ticks_still_enforce() {
    let dir = tempfile::tempdir().unwrap();
    let (_ctl, _, base) = start_controller(&dir.path().join("state"), dir.path(), &[]).await;
    const LIMIT: f64 = 200.0;
    let http = reqwest::Client::new();
    let r = put_config(&http, &base, &payments_config("v1", LIMIT)).await;
    assert_eq!(r.status(), 200);
    // One aggregator at the controller's pace, one forwarding every second.
    let (_fast, fast_url) = start_aggregator(&base, "agg-fast", dir.path()).await;
    let slow_port = free_port();
    let slow_url = format!("http://127.0.0.1:{slow_port}");
    let _slow = spawn_aggregator_ticking(slow_port, &base, "agg-slow", dir.path(), 1000);
    wait_up(&format!("{slow_url}/v1/config")).await;

    let stop = Arc::new(AtomicBool::new(false));
    let mut counts = Vec::new();
    // 1.5 times the limit, half through each aggregator (two clients each). The aggregator
    // forwards as soon as all its clients reported: the slow zone's clients report at its
    // pace (every second, the default), the fast zone's every 100 ms.
    for (i, (url, tick_ms)) in [
        (&fast_url, 100),
        (&fast_url, 100),
        (&slow_url, 1000),
        (&slow_url, 1000),
    ]
    .into_iter()
    .enumerate()
    {
        let mut o = ClientOptions::new("payments", vec![url.clone()]);
        o.tick = Duration::from_millis(tick_ms);
        o.client_id = Some(format!("c{i}"));
        o.report_token = Some(CLIENT_TOKEN.into());
        let c = Arc::new(GrlClient::start(o));
        let n: Arc<[AtomicU64; 2]> = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
        load_as(
            c,
            ("gw", "charge"),
            1.5 * LIMIT / 4.0,
            stop.clone(),
            n.clone(),
        );
        counts.push(n);
    }
    // Windows of 4 s until the fleet admits the limit (±10 %) with every client dropping its
    // share; the bound is a hang guard (the loop settles within a few forwards). Clients:
    // fast, fast, slow, slow.
    let seen = settle_at(&counts, LIMIT, 8).await;
    stop.store(true, Ordering::Relaxed);
    assert!(
        seen.is_ok(),
        "never settled at the limit:\n{}",
        seen.unwrap_err().join("\n")
    );
}

/// Counts 4-second windows of `counts` (offered, dropped per client) until the fleet admits
/// `limit` (±10 %) with every client dropping some, at most `windows` of them: the windows
/// seen (fleet rate, per-client counts) as the error when it never did.
async fn settle_at(
    counts: &[Arc<[AtomicU64; 2]>],
    limit: f64,
    windows: usize,
) -> Result<(), Vec<String>> {
    let take = |c: &[AtomicU64; 2]| [0, 1].map(|i| c[i].swap(0, Ordering::Relaxed));
    let mut seen = Vec::new();
    for _ in 0..windows {
        for c in counts {
            take(c);
        }
        let t0 = std::time::Instant::now();
        tokio::time::sleep(Duration::from_secs(4)).await;
        let secs = t0.elapsed().as_secs_f64();
        let per: Vec<[u64; 2]> = counts.iter().map(|c| take(c)).collect();
        let admitted: u64 = per.iter().map(|p| p[0] - p[1]).sum();
        let rate = admitted as f64 / secs;
        seen.push(format!(
            "fleet admitted {rate:.1}/s of limit {limit}; offered/dropped per client {per:?}"
        ));
        if (rate - limit).abs() <= 0.1 * limit && per.iter().all(|p| p[1] > 0) {
            return Ok(());
        }
    }
    Err(seen)
}

/// Offers `rps` requests per second of `caller`/`procedure` to `client`'s limiter until
/// `stop`, counting what it offered and what was dropped.
fn load_as(
    client: Arc<GrlClient>,
    key: (&'static str, &'static str),
    rps: f64,
    stop: Arc<AtomicBool>,
    counts: Arc<[AtomicU64; 2]>,
) {
    std::thread::spawn(move || {
        let start = std::time::Instant::now();
        let mut done = 0u64;
        while !stop.load(Ordering::Relaxed) {
            let due = (start.elapsed().as_secs_f64() * rps) as u64;
            while done < due {
                counts[0].fetch_add(1, Ordering::Relaxed);
                if client.limiter().decide(key.0, key.1) == Decision::Drop {
                    counts[1].fetch_add(1, Ordering::Relaxed);
                }
                done += 1;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    });
}

/// The fraction of requests dropped over the next `ms` milliseconds.
async fn drop_fraction(counts: &[AtomicU64; 2], ms: u64) -> f64 {
    let before = [0, 1].map(|i| counts[i].load(Ordering::Relaxed));
    tokio::time::sleep(Duration::from_millis(ms)).await;
    let after = [0, 1].map(|i| counts[i].load(Ordering::Relaxed));
    let offered = (after[0] - before[0]).max(1) as f64;
    (after[1] - before[1]) as f64 / offered
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn override_on_a_caller_without_bucket_throttles_it_until_removed_or_expired() {
    let dir = tempfile::tempdir().unwrap();
    let state: PathBuf = dir.path().join("state");
    let (ctl, cport, base) = start_controller(&state, dir.path(), &[]).await;
    let http = reqwest::Client::new();
    let r = put_config(&http, &base, &payments_config("v1", 200.0)).await;
    assert_eq!(r.status(), 200);
    let (_agg, ua) = start_aggregator(&base, "agg-o", dir.path()).await;

    // Two instances of payments; `ghost` (no bucket) floods them at 2 × 100 rps, `gw` stays
    // under its bucket's limit.
    let stop = Arc::new(AtomicBool::new(false));
    let ghost: Arc<[AtomicU64; 2]> = Arc::new(Default::default());
    let gw: Arc<[AtomicU64; 2]> = Arc::new(Default::default());
    let mut clients = Vec::new();
    for i in 0..2 {
        let mut o = ClientOptions::new("payments", vec![ua.clone()]);
        o.tick = Duration::from_millis(100);
        o.client_id = Some(format!("o{i}"));
        o.report_token = Some(CLIENT_TOKEN.into());
        let c = Arc::new(GrlClient::start(o));
        load_as(
            c.clone(),
            ("ghost", "refund"),
            100.0,
            stop.clone(),
            ghost.clone(),
        );
        load_as(c.clone(), ("gw", "charge"), 50.0, stop.clone(), gw.clone());
        clients.push(c);
    }
    let versions = |clients: &[Arc<GrlClient>]| -> Vec<String> {
        clients
            .iter()
            .map(|c| c.limiter().table().version().to_string())
            .collect()
    };
    eventually("clients on v1", || {
        let ok = versions(&clients).iter().all(|v| v == "v1");
        async move { ok }
    })
    .await;
    assert_eq!(drop_fraction(&ghost, 500).await, 0.0);

    // The README's command, through the CLI, without $USER: author "unknown", with a warning.
    let out = Command::new(env!("CARGO_BIN_EXE_grl"))
        .args(["override", "add", "--controller", &base])
        .args([
            "--service",
            "payments",
            "--caller",
            "ghost",
            "--limit-rps",
            "50",
        ])
        .args(["--ttl", "30m", "--reason", "INC-123", "--format", "json"])
        .env_remove("USER")
        .env("GRL_TOKEN", TOKEN)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("unknown"), "{stderr}");
    let added: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(added["who"], "unknown");
    let id = added["id"].as_str().unwrap().to_string();
    // The answer says what it acts on: a new bucket for the caller as a whole.
    assert_eq!(
        added["affects"],
        json!([{"service": "payments", "bucket": format!("override:{id}"), "caller": "ghost",
                "created": true}])
    );

    // Status keeps the pushed version (rlc reconciles against it) and shows the served one.
    let status: Value = http
        .get(format!("{base}/v1/status"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(status["version"], "v1");
    assert!(status["served_version"]
        .as_str()
        .unwrap()
        .starts_with("v1+ovr."));
    // Within a few ticks the clients run the served config and drop ~75% of ghost's 200 rps.
    eventually("ghost throttled at the clients", || {
        let ok = versions(&clients).iter().all(|v| v.starts_with("v1+ovr."));
        let ghost = ghost.clone();
        async move { ok && (drop_fraction(&ghost, 500).await - 0.75).abs() < 0.12 }
    })
    .await;
    // Other callers are not touched.
    assert_eq!(drop_fraction(&gw, 300).await, 0.0);

    // A restart keeps the override and its bucket.
    let served: Value = http
        .get(format!("{base}/v1/config"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let mut cursor = reports_after(&http, &base, 0).await.0;
    assert!(cursor > 0);
    ctl.kill();
    let ctl = start_controller_at(cport, &state, dir.path(), &[]).await;
    let again: Value = http
        .get(format!("{base}/v1/config"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(again, served);
    // Report cursors survive the restart: rows after the old cursor keep coming.
    eventually("reports after a restart", || {
        let (http, base) = (http.clone(), base.clone());
        async move {
            let v = get_json_authorized(&http, &format!("{base}/v1/reports?after={cursor}")).await;
            v["reports"].as_array().is_some_and(|r| !r.is_empty()) && v["reset"] == false
        }
    })
    .await;
    cursor = reports_after(&http, &base, cursor).await.0;
    let beyond = cursor + 1_000_000_000;
    let v = get_json_authorized(&http, &format!("{base}/v1/reports?after={beyond}")).await;
    assert_eq!(v["reset"], true);
    assert!((drop_fraction(&ghost, 500).await - 0.75).abs() < 0.15);

    // Removal: the ad-hoc bucket goes, the clients return to v1 and stop dropping.
    let r = http
        .delete(format!("{base}/v1/overrides/{id}"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    eventually("override removed at the clients", || {
        let ok = versions(&clients).iter().all(|v| v == "v1");
        async move { ok }
    })
    .await;
    assert_eq!(drop_fraction(&ghost, 500).await, 0.0);

    // Expiry: a short override throttles, then lapses by itself.
    let r = http
        .post(format!("{base}/v1/overrides"))
        .bearer_auth(TOKEN)
        .json(
            &json!({"service": "payments", "caller": "ghost", "drop_ratio": 0.5,
                      "ttl_secs": 3, "reason": "INC-124", "who": "carol"}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    eventually("short override in force", || {
        let ghost = ghost.clone();
        async move { (drop_fraction(&ghost, 300).await - 0.5).abs() < 0.15 }
    })
    .await;
    eventually("short override expired at the clients", || {
        let ok = versions(&clients).iter().all(|v| v == "v1");
        async move { ok }
    })
    .await;
    assert_eq!(drop_fraction(&ghost, 500).await, 0.0);
    let list: Value = http
        .get(format!("{base}/v1/overrides"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(list["overrides"], json!([]));

    // A bucket override on a bucket that does not exist is refused rather than doing nothing.
    let r = http
        .post(format!("{base}/v1/overrides"))
        .bearer_auth(TOKEN)
        .json(
            &json!({"service": "payments", "bucket": "nope", "limit_rps": 1.0,
                      "ttl_secs": 60, "reason": "x", "who": "y"}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 422);
    stop.store(true, Ordering::Relaxed);
    drop(ctl);
}

mod layer {
    use std::sync::Arc;
    use std::time::Duration;

    use axum::body::Body;
    use axum::routing::get;
    use axum::Router;
    use grl_client::layer::{GrlLayer, KeyFrom};
    use grl_core::{Limiter, Table};
    use http::Request;
    use schema::{Bucket, Mode, PolicyName, Scope};
    use tower::ServiceExt;

    fn limiter(mode: Mode, ratio: f64) -> Arc<Limiter> {
        let l = Arc::new(Limiter::new("payments", Duration::from_secs(60)));
        let b = Bucket {
            name: "gw.charge".into(),
            caller: Some("gw".into()),
            procedure: Some("charge".into()),
            scope: Scope::Global,
            limit_rps: 1.0,
            mode,
            policy: PolicyName::Manual,
        };
        l.install(Table::compile("payments", "v1", &[b]).unwrap());
        l.table().set_ratio(0, ratio);
        l.directives_received(grl_core::now_ms());
        l
    }

    fn app(l: Arc<Limiter>) -> Router {
        Router::new()
            .route("/charge", get(|| async { "ok" }))
            .layer(
                GrlLayer::new(l)
                    .procedure_from(KeyFrom::PathSegment(0))
                    .retry_after_secs(2),
            )
    }

    fn req(caller: &str) -> Request<Body> {
        Request::get("/charge")
            .header("x-caller", caller)
            .body(Body::empty())
            .unwrap()
    }

    #[tokio::test]
    async fn drop_answers_429_with_retry_after() {
        let app = app(limiter(Mode::Enforce, 1.0));
        let r = app.clone().oneshot(req("gw")).await.unwrap();
        assert_eq!(r.status(), 429);
        assert_eq!(r.headers()["retry-after"], "2");
        // Another caller is not in the bucket: it passes.
        let r = app.oneshot(req("other")).await.unwrap();
        assert_eq!(r.status(), 200);
    }

    #[tokio::test]
    async fn shadow_passes_through_and_counts() {
        let l = limiter(Mode::Shadow, 1.0);
        let app = app(l.clone());
        for _ in 0..10 {
            assert_eq!(app.clone().oneshot(req("gw")).await.unwrap().status(), 200);
        }
        let c = l.table().counts(0);
        assert_eq!(c.offered, 10);
        assert_eq!(c.shadow_dropped, 10);
    }
}

#[test]
fn simulate_cli_prints_one_json_line_per_bucket_per_tick() {
    let run = |algo: &str| simulate(&["--seed", "5", "--algorithm", algo], "steady-1.5x.yaml");
    let a = run("drop-by-ratio");
    assert_eq!(a, run("drop-by-ratio"), "same seed, same output");
    let lines = json_lines(&a);
    assert_eq!(lines.len(), 30, "30 ticks of one bucket");
    for k in [
        "t",
        "bucket",
        "offered_rps",
        "admitted_rps",
        "dropped_rps",
        "shadow_dropped_rps",
        "drop_ratio",
    ] {
        assert!(lines[0].get(k).is_some(), "missing {k}");
    }
    let last = &lines[29];
    assert!((last["drop_ratio"].as_f64().unwrap() - 1.0 / 3.0).abs() < 0.01);
    // The algorithm as spelled on the command line.
    assert_eq!(last["algorithm"], "drop-by-ratio");
    let tb = json_lines(&run("token-bucket"));
    assert_eq!(tb.len(), 30);

    // A scenario with an unknown key is refused with its file and line.
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.yaml");
    std::fs::write(
        &bad,
        "service: s\nduration_s: 1\nbogus: 1\nbuckets: []\ncallers: []\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_grl"))
        .args(["simulate", "--scenario"])
        .arg(&bad)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bad.yaml:3") && err.contains("bogus"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peered_region_controllers_share_global_load() {
    let dir = tempfile::tempdir().unwrap();
    let (pe, pw) = (free_port(), free_port());
    let (ue, uw) = (
        format!("http://127.0.0.1:{pe}"),
        format!("http://127.0.0.1:{pw}"),
    );
    let _east = spawn_controller(
        pe,
        &dir.path().join("east"),
        dir.path(),
        &["--region", "east", "--peer", &uw],
    );
    let _west = spawn_controller(
        pw,
        &dir.path().join("west"),
        dir.path(),
        &["--region", "west", "--peer", &ue],
    );
    let http = reqwest::Client::new();
    for u in [&ue, &uw] {
        wait_up(&format!("{u}/v1/status")).await;
        push_config(&http, u, &payments_config("v1", 200.0)).await;
    }
    // Each region's aggregator reports 300 rps: alone each is at 1.5x; together at 3x.
    let report = |region: &str| {
        json!({"aggregator_id": format!("agg-{region}"), "region": region, "zone": format!("{region}-1"),
               "buckets": [{"service": "payments", "bucket": "gw.charge", "offered_rps": 300.0,
                            "admitted_rps": 300.0, "dropped_rps": 0.0, "shadow_dropped_rps": 0.0,
                            "counts": {"bucket": "gw.charge", "offered": 30, "admitted": 30,
                                       "dropped": 0, "shadow_dropped": 0}}]})
    };
    let mut seen = None;
    for _ in 0..200 {
        let mut ratios = Vec::new();
        for (u, region) in [(&ue, "east"), (&uw, "west")] {
            let d: Value = http
                .post(format!("{u}/v1/aggregate"))
                .bearer_auth(REPORT_TOKEN)
                .json(&report(region))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            ratios.push(d["services"][0]["directives"][0]["ratio"].as_f64().unwrap());
        }
        // 600 offered fleet-wide against 200 → 2/3 in both regions (1/3 if they did not peer).
        if ratios.iter().all(|r| (r - 2.0 / 3.0).abs() < 1e-6) {
            seen = Some(ratios);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        seen.is_some(),
        "regions never converged on the global ratio"
    );

    // Unauthenticated zone reports are refused before anything is read and change nothing:
    // 30,000 rps injected in east would push the global ratio to ~0.99.
    let mut flood = report("east");
    flood["aggregator_id"] = json!("intruder");
    flood["buckets"][0]["offered_rps"] = json!(30_000.0);
    for token in [None, Some("wrong"), Some("")] {
        let mut req = http.post(format!("{ue}/v1/aggregate")).json(&flood);
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        let r = req.send().await.unwrap();
        assert_eq!(r.status(), 401, "token {token:?}");
    }
    // At once: zone data is forgotten after 3 ticks of silence.
    let d: Value = http
        .post(format!("{ue}/v1/aggregate"))
        .bearer_auth(REPORT_TOKEN)
        .json(&report("east"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ratio = d["services"][0]["directives"][0]["ratio"].as_f64().unwrap();
    assert!(
        (ratio - 2.0 / 3.0).abs() < 1e-6,
        "an unauthenticated report changed the ratio: {ratio}"
    );

    // Malformed zone reports are refused with a reason and change nothing.
    let r = http
        .post(format!("{ue}/v1/aggregate"))
        .bearer_auth(REPORT_TOKEN)
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let mut bad = report("east");
    bad["buckets"][0]["offered_rps"] = json!(-5.0);
    let r = http
        .post(format!("{ue}/v1/aggregate"))
        .bearer_auth(REPORT_TOKEN)
        .json(&bad)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 422);
    assert!(r.json::<Value>().await.unwrap()["error"]
        .as_str()
        .unwrap()
        .contains("negative"));
}

#[test]
fn simulate_realtime_runs_the_real_stack() {
    let rows = json_lines(&simulate(&["--realtime"], "realtime-smoke.yaml"));
    assert!(rows.len() >= 10, "{} rows", rows.len());
    // Second half: 1000 rps offered against 500 → about half admitted.
    let tail = &rows[rows.len() / 2..];
    let offered: f64 = tail
        .iter()
        .map(|r| r["offered_rps"].as_f64().unwrap())
        .sum();
    let admitted: f64 = tail
        .iter()
        .map(|r| r["admitted_rps"].as_f64().unwrap())
        .sum();
    let frac = admitted / offered;
    assert!((frac - 0.5).abs() < 0.1, "admitted fraction {frac}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aggregator_refuses_malformed_reports() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    // No controller behind it: it must still answer clients (with no fresh directives).
    let _agg = spawn_aggregator(
        port,
        &format!("http://127.0.0.1:{}", free_port()),
        "agg-x",
        dir.path(),
    );
    wait_up(&format!("{url}/v1/config")).await;
    let http = reqwest::Client::new();
    let post = |body: Value| {
        http.post(format!("{url}/v1/report"))
            .bearer_auth(CLIENT_TOKEN)
            .json(&body)
            .send()
    };
    let r = http
        .post(format!("{url}/v1/report"))
        .bearer_auth(CLIENT_TOKEN)
        .body("nope")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert!(r.json::<Value>().await.unwrap()["error"].is_string());
    let report = |offered: u64, admitted: u64, interval: u64| {
        json!({"client_id": "c1", "service": "payments", "version": "", "interval_ms": interval,
               "buckets": [{"bucket": "gw.charge", "offered": offered, "admitted": admitted,
                            "dropped": 0, "shadow_dropped": 0}]})
    };
    assert_eq!(post(report(10, 7, 100)).await.unwrap().status(), 422);
    assert_eq!(post(report(10, 10, 0)).await.unwrap().status(), 422);
    let r = post(report(10, 10, 100)).await.unwrap();
    assert_eq!(r.status(), 200);
    let d: Value = r.json().await.unwrap();
    assert!(d["age_ms"].is_null(), "never heard from a controller: {d}");
    assert_eq!(d["directives"].as_array().unwrap().len(), 0);
}

/// Protocol 3: the aggregator reads a client report in JSON (old clients) or in the binary
/// encoding (its content type) and answers in the same encoding; a truncated binary body,
/// another format version or an oversized body are refused naming what is wrong, and none of
/// them is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aggregator_reads_json_and_binary_reports_and_refuses_bad_binary() {
    use grl_wire::{binary, BucketCountsMsg, ClientReport};
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let _agg = spawn_aggregator(
        port,
        &format!("http://127.0.0.1:{}", free_port()),
        "agg-bin",
        dir.path(),
    );
    wait_up(&format!("{url}/v1/config")).await;
    let http = reqwest::Client::new();
    let report = ClientReport {
        client_id: "c1".into(),
        service: "payments".into(),
        version: String::new(),
        interval_ms: 100,
        buckets: vec![BucketCountsMsg {
            bucket: "gw.charge".into(),
            offered: 10,
            admitted: 10,
            dropped: 0,
            shadow_dropped: 0,
            tiers: Vec::new(),
        }],
        urgent: false,
        calls: Vec::new(),
    };
    let post_binary = |body: Vec<u8>| {
        http.post(format!("{url}/v1/report"))
            .bearer_auth(CLIENT_TOKEN)
            .header("content-type", binary::CONTENT_TYPE)
            .body(body)
            .send()
    };
    // A protocol-2 client: JSON in, JSON out, told the aggregator's version.
    let r = http
        .post(format!("{url}/v1/report"))
        .bearer_auth(CLIENT_TOKEN)
        .header("grl-proto", "2")
        .json(&report)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers()["grl-proto"],
        grl_wire::PROTO_VERSION.to_string().as_str()
    );
    assert!(r.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("application/json"));
    let d: Value = r.json().await.unwrap();
    assert!(d["directives"].is_array(), "{d}");
    // Binary in, binary out.
    let r = post_binary(binary::encode_report(&report)).await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], binary::CONTENT_TYPE);
    let d = binary::decode_directives(&r.bytes().await.unwrap()).unwrap();
    assert_eq!(d.age_ms, None, "never heard from a controller");
    // Truncated: 400 naming the field cut.
    let full = binary::encode_report(&report);
    let r = post_binary(full[..full.len() - 3].to_vec()).await.unwrap();
    assert_eq!(r.status(), 400);
    let e = r.json::<Value>().await.unwrap()["error"].to_string();
    assert!(
        e.contains("truncated body") && e.contains("buckets[0]."),
        "{e}"
    );
    // Another format version: 400 saying which versions are read.
    let mut v9 = full.clone();
    v9[0] = 9;
    let r = post_binary(v9).await.unwrap();
    assert_eq!(r.status(), 400);
    let e = r.json::<Value>().await.unwrap()["error"].to_string();
    assert!(
        e.contains("format version 9 is not supported") && e.contains("versions 1 to 2"),
        "{e}"
    );
    // Validation is the same as for JSON.
    let mut bad = report.clone();
    bad.buckets[0].admitted = 7;
    let r = post_binary(binary::encode_report(&bad)).await.unwrap();
    assert_eq!(r.status(), 422);
    // Only the two good reports were accepted, one of them binary.
    let m = http
        .get(format!("{url}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(m.contains("grl_reports_accepted_total 2\n"), "{m}");
    assert!(m.contains("grl_reports_binary_total 1\n"), "{m}");
    assert!(
        m.contains("grl_reports_refused_total{reason=\"malformed\"} 2\n"),
        "{m}"
    );
    // The body bound holds for binary bodies too (on a connection of its own: the aggregator
    // closes it without reading the rest).
    let r = reqwest::Client::new()
        .post(format!("{url}/v1/report"))
        .bearer_auth(CLIENT_TOKEN)
        .header("content-type", binary::CONTENT_TYPE)
        .body(vec![1u8; 5 << 20])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
}

/// Starts a controller on `state` that is expected to refuse to start; returns its log.
fn refused_start(state: &Path, logs: &Path, name: &str) -> String {
    let port = free_port();
    let mut p = spawn_controller(port, state, logs, &[]);
    let st = p
        .wait_exit(Duration::from_secs(30))
        .unwrap_or_else(|| panic!("{name}: the controller started on an invalid state"));
    let log = std::fs::read_to_string(logs.join(format!("controller-{port}.log"))).unwrap();
    assert!(!st.success(), "{name}: exit {st}, log:\n{log}");
    log
}

#[test]
fn controller_refuses_to_start_on_invalid_persisted_state() {
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path();
    let valid = payments_config("v1", 200.0);
    let cases: Vec<(&str, Value, Option<Value>, &[&str])> = vec![
        (
            "negative limit",
            payments_config("v1", -1.0),
            None,
            &["config.json", "limit_rps"],
        ),
        (
            "empty version",
            payments_config("", 200.0),
            None,
            &["config.json", "version must not be empty"],
        ),
        (
            "duplicate service",
            {
                let mut d = valid.clone();
                let svc = d["services"][0].clone();
                d["services"].as_array_mut().unwrap().push(svc);
                d
            },
            None,
            &["config.json", "twice"],
        ),
        (
            "override with a drop ratio above 1",
            valid.clone(),
            Some(
                json!({"next_id": 1, "overrides": [{"id": "ovr-1", "caller": "gw",
                "drop_ratio": 2.0, "ttl_secs": 60, "reason": "x", "who": "y",
                "created_at": 1, "expires_at": 61}]}),
            ),
            &["overrides.json", "ovr-1", "drop_ratio"],
        ),
        (
            "override without an author",
            valid.clone(),
            Some(
                json!({"next_id": 1, "overrides": [{"id": "ovr-1", "caller": "gw",
                "drop_ratio": 0.5, "ttl_secs": 60, "reason": "x", "who": " ",
                "created_at": 1, "expires_at": 61}]}),
            ),
            &["overrides.json", "who"],
        ),
        (
            "override id the counter would hand out again",
            valid.clone(),
            Some(
                json!({"next_id": 0, "overrides": [{"id": "ovr-1", "caller": "gw",
                "drop_ratio": 0.5, "ttl_secs": 60, "reason": "x", "who": "y",
                "created_at": 1, "expires_at": 61}]}),
            ),
            &["overrides.json", "next_id"],
        ),
    ];
    for (name, cfg, ov, expect) in cases {
        let state = dir.path().join(name.replace(' ', "-"));
        std::fs::create_dir_all(&state).unwrap();
        std::fs::write(state.join("config.json"), cfg.to_string()).unwrap();
        if let Some(ov) = ov {
            std::fs::write(state.join("overrides.json"), ov.to_string()).unwrap();
        }
        let log = refused_start(&state, logs, name);
        for e in expect {
            assert!(log.contains(e), "{name}: no `{e}` in the error:\n{log}");
        }
        assert!(log.contains("refusing to start"), "{name}:\n{log}");
    }

    // Not regular files: a FIFO would block the read forever, /dev/zero would fill memory.
    let fifo_state = dir.path().join("fifo");
    std::fs::create_dir_all(&fifo_state).unwrap();
    let fifo = fifo_state.join("config.json");
    let st = Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(st.success());
    let log = refused_start(&fifo_state, logs, "fifo");
    assert!(
        log.contains("config.json") && log.contains("not a regular file"),
        "{log}"
    );

    let zero_state = dir.path().join("zero");
    std::fs::create_dir_all(&zero_state).unwrap();
    std::os::unix::fs::symlink("/dev/zero", zero_state.join("overrides.json")).unwrap();
    let log = refused_start(&zero_state, logs, "symlink to /dev/zero");
    assert!(
        log.contains("overrides.json") && log.contains("not a regular file"),
        "{log}"
    );
}

/// Raw HTTP/1.1 on loopback: lets a test hold a request half-sent.
async fn raw_request_head(
    port: u16,
    method: &str,
    path: &str,
    body_len: usize,
) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\nContent-Length: {body_len}\r\nConnection: close\r\n\r\n"
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_sigterm_finishes_the_push_in_flight_persists_and_exits_0() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let mut ctl = spawn_controller(port, &state, dir.path(), &[]);
    wait_up(&format!("{base}/v1/status")).await;
    let http = reqwest::Client::new();
    push_config(&http, &base, &payments_config("v1", 200.0)).await;
    let r = http
        .post(format!("{base}/v1/overrides"))
        .bearer_auth(TOKEN)
        .json(&json!({"caller": "gw", "drop_ratio": 0.5, "ttl_secs": 3600, "reason": "INC-9", "who": "dana"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);

    // A push of v2 is in flight (half its body sent) when SIGTERM arrives.
    let body = payments_config("v2", 300.0).to_string();
    let (first, rest) = body.as_bytes().split_at(body.len() / 2);
    let mut s = raw_request_head(port, "PUT", "/v1/config", body.len()).await;
    s.write_all(first).await.unwrap();
    s.flush().await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    ctl.signal(libc::SIGTERM);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        ctl.0.try_wait().unwrap().is_none(),
        "the controller exited with a request in flight"
    );
    // It no longer accepts new connections.
    assert!(
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err(),
        "a new connection was accepted after SIGTERM"
    );
    s.write_all(rest).await.unwrap();
    let mut answer = String::new();
    tokio::time::timeout(Duration::from_secs(20), s.read_to_string(&mut answer))
        .await
        .expect("answer to the request in flight")
        .unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains("\"changed\":true"), "{answer}");

    let st = ctl
        .wait_exit(Duration::from_secs(20))
        .expect("exit after SIGTERM");
    let log = std::fs::read_to_string(dir.path().join(format!("controller-{port}.log"))).unwrap();
    assert_eq!(st.code(), Some(0), "exit {st}; log:\n{log}");
    assert!(
        log.contains("SIGTERM") && log.contains("controller shut down"),
        "{log}"
    );

    // The pushed config and the override are on disk and come back.
    let _ctl = spawn_controller(port, &state, dir.path(), &[]);
    wait_up(&format!("{base}/v1/status")).await;
    let on_disk: Value =
        serde_json::from_slice(&std::fs::read(state.join("config.json")).unwrap()).unwrap();
    assert_eq!(on_disk, payments_config("v2", 300.0));
    let status: Value = http
        .get(format!("{base}/v1/status"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(status["version"], "v2", "{status}");
    let list: Value = http
        .get(format!("{base}/v1/overrides"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(list["overrides"][0]["reason"], "INC-9", "{list}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_sigterm_cuts_a_stalled_request_after_the_grace_and_exits_0() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let port = free_port();
    let mut ctl = spawn_controller(port, &state, dir.path(), &["--shutdown-grace-ms", "1000"]);
    wait_up(&format!("http://127.0.0.1:{port}/v1/status")).await;
    // Headers announce a body that never comes.
    let _s = raw_request_head(port, "PUT", "/v1/config", 1000).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t = std::time::Instant::now();
    ctl.signal(libc::SIGTERM);
    let st = ctl
        .wait_exit(Duration::from_secs(20))
        .expect("exit after SIGTERM");
    assert_eq!(st.code(), Some(0), "exit {st}");
    // The grace bounds the stop (a hang guard, generous for a loaded machine).
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "took {:?}",
        t.elapsed()
    );
    let log = std::fs::read_to_string(dir.path().join(format!("controller-{port}.log"))).unwrap();
    assert!(log.contains("connections cut"), "{log}");
}

fn offered_total(metrics: &str, bucket: &str, zone: &str) -> Option<u64> {
    metrics
        .lines()
        .filter(|l| l.starts_with("grl_requests_offered_total{"))
        .filter(|l| {
            l.contains(&format!("bucket=\"{bucket}\"")) && l.contains(&format!("zone=\"{zone}\""))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .reduce(|a, b| a + b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aggregator_sigterm_forwards_the_counts_it_holds_and_exits_0() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let cport = free_port();
    let base = format!("http://127.0.0.1:{cport}");
    let _ctl = spawn_controller(cport, &state, dir.path(), &[]);
    wait_up(&format!("{base}/v1/status")).await;
    let http = reqwest::Client::new();
    push_config(&http, &base, &payments_config("v1", 200.0)).await;
    // A long tick: nothing is forwarded on the timer during the test.
    let aport = free_port();
    let aurl = format!("http://127.0.0.1:{aport}");
    let mut agg = spawn_aggregator_ticking(aport, &base, "agg-t", dir.path(), 600_000);
    // Up is not enough: a report is screened by the config the aggregator holds, and with a
    // 10-minute tick a report it screened out before fetching `v1` is not sent again (seen
    // failing on a loaded machine).
    eventually("the aggregator holds config v1", || async {
        match http.get(format!("{aurl}/v1/config")).send().await {
            Ok(r) => r.json::<Value>().await.is_ok_and(|v| v["version"] == "v1"),
            Err(_) => false,
        }
    })
    .await;
    let report = |client: &str, offered: u64| {
        json!({"client_id": client, "service": "payments", "version": "v1", "interval_ms": 1000,
               "buckets": [{"bucket": "gw.charge", "offered": offered, "admitted": offered,
                            "dropped": 0, "shadow_dropped": 0}]})
    };
    let metrics = || async {
        let m = http
            .get(format!("{base}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        offered_total(&m, "gw.charge", "z1")
    };
    // The only client reported: forwarded at once.
    let r = http
        .post(format!("{aurl}/v1/report"))
        .bearer_auth(CLIENT_TOKEN)
        .json(&report("a", 5))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    eventually("first counts at the controller", || async {
        metrics().await == Some(5)
    })
    .await;
    // A second client's counts wait for the tick (client a has not reported again)...
    let r = http
        .post(format!("{aurl}/v1/report"))
        .bearer_auth(CLIENT_TOKEN)
        .json(&report("b", 7))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        metrics().await,
        Some(5),
        "the second report was forwarded before the stop"
    );
    // ...and SIGTERM must not lose them.
    agg.signal(libc::SIGTERM);
    let st = agg
        .wait_exit(Duration::from_secs(20))
        .expect("exit after SIGTERM");
    let log = std::fs::read_to_string(dir.path().join("agg-t.log")).unwrap();
    assert_eq!(st.code(), Some(0), "exit {st}; log:\n{log}");
    assert_eq!(metrics().await, Some(12), "log:\n{log}");
    assert!(
        log.contains("SIGTERM") && log.contains("last counts forwarded"),
        "{log}"
    );
}

/// `n` `payments` clients (ids `c0`, `c1`, …; 100 ms ticks, stale after 600 ms) whose first
/// aggregator alternates between `ua` and `ub`, each failing over to the other.
fn alternating_clients(n: usize, ua: &str, ub: &str) -> Vec<Arc<GrlClient>> {
    (0..n)
        .map(|i| {
            let aggs = if i % 2 == 0 { [ua, ub] } else { [ub, ua] };
            let mut o = ClientOptions::new("payments", aggs.map(String::from).to_vec());
            o.tick = Duration::from_millis(100);
            o.stale_after = Duration::from_millis(600);
            o.client_id = Some(format!("c{i}"));
            o.report_token = Some(CLIENT_TOKEN.into());
            Arc::new(GrlClient::start(o))
        })
        .collect()
}
