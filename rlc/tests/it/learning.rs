//! Quotas learned from demand, not from incidents, on a real Prometheus (backfilled with
//! promtool) and the real `rlc` binary: a one-off retry storm does not set the limit; minutes
//! the bucket was throttled (the controller's reports in the store) and windows
//! `rlc/policies.yaml` excludes are not demand; throttling that lasts days is growth, raised,
//! and in direct mode sent to review; `rails.max_increase` bounds a raise.

use std::path::Path;
use std::process::Command;

use serde_json::{json, Value};
use test_support::git::GitRemote;
use test_support::prometheus::{OpenMetricsWriter, Prometheus};

const DAY: i64 = 86_400;
const HOUR: i64 = 3_600;
const QUERY: &str = "sum by (service, caller, procedure) (rate(rpc_requests_total[2m]))";

/// One counter of the backfill: its labels and its rate (rps) at unix time `t`.
type Rate<'a> = (&'a str, &'a dyn Fn(i64) -> f64);

/// `days` of counters (`service="pay"`, `caller=NAME`) scraped every minute up to the last
/// whole minute; returns Prometheus and that end.
fn prometheus(dir: &Path, days: i64, callers: &[Rate<'_>]) -> (Prometheus, i64) {
    let end = chrono::Utc::now().timestamp() / 60 * 60 - 60;
    let mut w = OpenMetricsWriter::create(&dir.join("history.om")).unwrap();
    w.family("rpc_requests", "counter").unwrap();
    for (caller, rate) in callers {
        let labels = [("service", "pay"), ("caller", *caller)];
        let (mut t, mut value) = (end - days * DAY, 0.0);
        while t <= end {
            w.sample("rpc_requests_total", &labels, value, t).unwrap();
            value += rate(t) * 60.0;
            t += 60;
        }
    }
    (
        Prometheus::start(&w.finish().unwrap()).expect("start Prometheus"),
        end,
    )
}

/// An enforced `pay` bucket per `(caller, limit, policy)`.
fn pay(buckets: &[(&str, f64, &str)]) -> String {
    let mut s = "service: pay\nbuckets:\n".to_string();
    for (caller, limit, policy) in buckets {
        s += &format!(
            "  - name: {caller}\n    caller: {caller}\n    scope: global\n    limit_rps: {limit}\n    mode: enforce\n    policy: {policy}\n"
        );
    }
    s
}

/// The config repo (with `buckets/pay.yaml` and `policies` as `rlc/policies.yaml` when
/// given) on a remote, and rlc.yaml in `dir` (direct mode, `extra` appended).
fn setup(
    dir: &Path,
    prom: &Prometheus,
    pay_yaml: &str,
    policies: Option<&str>,
    lookback: &str,
    extra: &str,
) -> GitRemote {
    let mut files = test_support::git::minimal_repo_files(&[]);
    files.push(("buckets/pay.yaml".into(), pay_yaml.into()));
    if let Some(p) = policies {
        files.retain(|(path, _)| path != "rlc/policies.yaml");
        files.push(("rlc/policies.yaml".into(), p.into()));
    }
    let refs: Vec<(&str, &str)> = files
        .iter()
        .map(|(a, b)| (a.as_str(), b.as_str()))
        .collect();
    let remote = GitRemote::new("main", &refs).unwrap();
    std::fs::write(
        dir.join("rlc.yaml"),
        format!(
            "history:\n  prometheus:\n    url: {}\n    query: '{QUERY}'\n  lookback: {lookback}\n  step: 1m\n\
             config_repo:\n  path: wc\n  url: {}\n  author_name: rlc-bot\n  author_email: rlc@example.com\n\
             database_url: sqlite://rlc.db\n{extra}",
            prom.url,
            remote.url()
        ),
    )
    .unwrap();
    remote
}

fn rlc(dir: &Path, args: &[&str]) -> (i32, Value) {
    let out = Command::new(env!("CARGO_BIN_EXE_rlc"))
        .args(args)
        .arg("--config")
        .arg(dir.join("rlc.yaml"))
        .current_dir(dir)
        .env("RUST_LOG", "error")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let v: Value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("{e}: {text}\n{}", String::from_utf8_lossy(&out.stderr)));
    (out.status.code().unwrap_or(-1), v)
}

/// The planned bucket `name` of `rlc preview --format json`.
fn planned<'a>(preview: &'a Value, name: &str) -> &'a Value {
    preview["buckets"]
        .as_array()
        .and_then(|b| b.iter().find(|b| b["name"] == name))
        .unwrap_or_else(|| panic!("no bucket {name}: {preview}"))
}

fn limit(preview: &Value, name: &str) -> f64 {
    planned(preview, name)["limit_rps"].as_f64().unwrap()
}

fn explain(preview: &Value, name: &str) -> String {
    planned(preview, name)["evidence"]["explain"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// Enforced-mode controller reports for `caller`'s bucket: every 10 s of each `(minute,
/// offered, dropped)`.
async fn throttled(dir: &Path, caller: &str, minutes: &[(i64, f64, f64)]) {
    let store = rlc::store::Store::connect("sqlite://rlc.db", dir)
        .await
        .unwrap();
    let batch: Vec<grl_wire::ReportRow> = minutes
        .iter()
        .flat_map(|&(m, offered, dropped)| {
            (m..m + 60).step_by(10).map(move |t| (t, offered, dropped))
        })
        .map(|(t, offered, dropped)| {
            serde_json::from_value(json!({
                "seq": t, "t": t, "service": "pay", "bucket": caller, "caller": caller,
                "procedure": null, "mode": "enforce", "scope_key": "global", "offered": offered,
                "admitted": offered - dropped, "dropped": dropped, "shadow_dropped": 0.0,
                "limit_rps": offered - dropped, "drop_ratio": dropped / offered
            }))
            .unwrap()
        })
        .collect();
    for chunk in batch.chunks(10_000) {
        store
            .insert_reports(chunk, chrono::Utc::now())
            .await
            .unwrap();
    }
}

/// A caller at 100 rps from 12:00 to 16:00 and 50 rps otherwise, for four weeks, with one
/// 10-minute retry storm at 8× (800 rps) at 14:00 three weeks ago: its limit follows the 100
/// rps it reaches every day (×1.25 = 125, within 1.5× of it), not the storm (1,000 before,
/// capped by `max_increase` at 250); the evidence names the storm.
#[test]
fn a_retry_storm_does_not_raise_its_own_ceiling() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let end = chrono::Utc::now().timestamp() / 60 * 60 - 60;
    let storm_at = (end - 21 * DAY).div_euclid(DAY) * DAY + 14 * HOUR;
    let usual = |t: i64| {
        if (12 * HOUR..16 * HOUR).contains(&t.rem_euclid(DAY)) {
            100.0
        } else {
            50.0
        }
    };
    let stormy = move |t: i64| {
        if (storm_at..storm_at + 600).contains(&t) {
            800.0
        } else {
            usual(t)
        }
    };
    let (prom, _) = prometheus(d, 28, &[("web", &stormy)]);
    let _remote = setup(d, &prom, &pay(&[("web", 125.0, "peak")]), None, "28d", "");
    let (code, preview) = rlc(d, &["preview", "--format", "json"]);
    assert_eq!(code, 0, "{preview}");
    let web = limit(&preview, "web");
    assert!(
        web <= 150.0,
        "web limited at {web} for a 100 rps peak: {preview}"
    );
    assert!(web >= 100.0, "web limited below its peak: {web}");
    let why = explain(&preview, "web");
    assert!(why.contains("spike") && why.contains("discounted"), "{why}");
    assert_eq!(
        planned(&preview, "web")["evidence"]["policy"]["spikes"][0]["peak_rps"],
        800.0
    );
    drop(prom);
}

/// Three callers at 200 rps (batch 400) for eight days, each with one 3-hour burst at 2×
/// (under the spike filter's 3×): `web`'s burst was throttled (enforced-mode reports with
/// drops in the store), `batch`'s is a window `rlc/policies.yaml` excludes, `mobile`'s is
/// neither. Only `mobile` is raised (400 × 1.25 = 500); `web` and `batch` keep their limits
/// and their evidence names what was left out and why.
#[tokio::test]
async fn throttled_minutes_and_excluded_windows_are_not_demand() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let end = chrono::Utc::now().timestamp() / 60 * 60 - 60;
    let burst = |days: i64| {
        let from = (end - days * DAY).div_euclid(DAY) * DAY + 10 * HOUR;
        (from, from + 3 * HOUR)
    };
    let (web_burst, batch_burst) = (burst(2), burst(3));
    let rate = |base: f64, (from, to): (i64, i64)| {
        move |t: i64| {
            if (from..to).contains(&t) {
                2.0 * base
            } else {
                base
            }
        }
    };
    let (web, batch, mobile) = (
        rate(200.0, web_burst),
        rate(400.0, batch_burst),
        rate(200.0, web_burst),
    );
    let (prom, _) = prometheus(
        d,
        8,
        &[("web", &web), ("batch", &batch), ("mobile", &mobile)],
    );
    let at = |t: i64| chrono::DateTime::from_timestamp(t, 0).unwrap().to_rfc3339();
    let policies = format!(
        "default:\n  policy: peak\n  headroom: 0.25\nexcluded:\n  - service: pay\n    caller: batch\n    \
         from: {}\n    to: {}\n    reason: load test LT-7\n",
        at(batch_burst.0),
        at(batch_burst.1)
    );
    let remote = setup(
        d,
        &prom,
        &pay(&[
            ("web", 250.0, "peak"),
            ("batch", 500.0, "peak"),
            ("mobile", 250.0, "peak"),
        ]),
        Some(&policies),
        "7d",
        "",
    );
    // The controller refused 150 of web's 400 rps through its burst.
    let minutes: Vec<_> = (web_burst.0..web_burst.1)
        .step_by(60)
        .map(|t| (t, 400.0, 150.0))
        .collect();
    throttled(d, "web", &minutes).await;

    let (code, preview) = rlc(d, &["preview", "--format", "json"]);
    assert_eq!(code, 0, "{preview}");
    assert_eq!(limit(&preview, "mobile"), 500.0, "{preview}");
    assert_eq!(limit(&preview, "web"), 250.0, "{preview}");
    assert_eq!(limit(&preview, "batch"), 500.0, "{preview}");
    let w = &planned(&preview, "web")["evidence"];
    assert_eq!(w["throttled"]["minutes"], 180, "{w}");
    assert_eq!(w["throttled"]["sustained"], false, "{w}");
    assert_eq!(
        w["throttled"]["refused_requests"],
        180.0 * 60.0 * 150.0,
        "{w}"
    );
    assert_eq!(w["ignored"][0]["kind"], "throttled", "{w}");
    // The peak the evidence names is the demand's (200 rps), and so is its time: not a
    // minute of the throttled burst that was left out.
    assert_eq!(w["peak_rps"], 200.0, "{w}");
    let peak_at = chrono::DateTime::parse_from_rfc3339(w["peak_at"].as_str().unwrap())
        .unwrap()
        .timestamp();
    assert!(
        !(web_burst.0..web_burst.1).contains(&peak_at),
        "peak_at {peak_at} is in the left-out burst {web_burst:?}: {w}"
    );
    let why = explain(&preview, "web");
    assert!(
        why.contains("180 throttled minutes") && why.contains("left out"),
        "{why}"
    );
    let b = &planned(&preview, "batch")["evidence"];
    assert_eq!(b["ignored"][0]["kind"], "excluded", "{b}");
    assert!(explain(&preview, "batch").contains("load test LT-7"), "{b}");

    // The run commits what the preview showed.
    let (code, out) = rlc(d, &["run", "--once", "--json"]);
    assert_eq!(code, 0, "{out}");
    let pay = remote.read("main", "buckets/pay.yaml").unwrap();
    assert!(
        pay.contains("name: mobile\n    caller: mobile\n    scope: global\n    limit_rps: 500\n"),
        "{pay}"
    );
    assert!(
        pay.contains("name: web\n    caller: web\n    scope: global\n    limit_rps: 250\n"),
        "{pay}"
    );
    assert!(
        pay.contains("name: batch\n    caller: batch\n    scope: global\n    limit_rps: 500\n"),
        "{pay}"
    );
    drop(prom);
}

/// Four weeks of a caller whose 12:00–16:00 peak held at 200 rps for two weeks then grew
/// steadily to 400 rps (a launch's adoption); its enforced limit of 300 refused the excess on
/// each of the last days. Throttling on days is demand that outgrew its limit: the forecast
/// follows it (at least the 500 rps the trend reaches next week, so the next week is not
/// throttled; `max_increase` caps the raise at 600), and as a `throttled_raise` direct mode
/// without `auto_merge` leaves it on the base and proposes it for review, the evidence saying
/// how much was refused and for how long.
#[tokio::test]
async fn sustained_throttling_is_growth_raised_for_review() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let end = chrono::Utc::now().timestamp() / 60 * 60 - 60;
    let start = end - 28 * DAY;
    let peak = move |t: i64| {
        let day = (t - start) as f64 / DAY as f64;
        if day < 14.0 {
            200.0
        } else {
            200.0 + 200.0 * (day - 14.0) / 14.0
        }
    };
    let rate = move |t: i64| {
        if (12 * HOUR..16 * HOUR).contains(&t.rem_euclid(DAY)) {
            peak(t)
        } else {
            peak(t) / 2.0
        }
    };
    let (prom, _) = prometheus(d, 28, &[("web", &rate)]);
    let policies = "default:\n  policy: forecast\n  headroom: 0.25\n";
    let remote = setup(
        d,
        &prom,
        &pay(&[("web", 300.0, "forecast")]),
        Some(policies),
        "28d",
        "",
    );
    // Review proposals go to the `rlc/quotas` branch (no forge API).
    let yaml = std::fs::read_to_string(d.join("rlc.yaml"))
        .unwrap()
        .replace(
            "  author_email: rlc@example.com\n",
            "  author_email: rlc@example.com\n  forge:\n    kind: none\n",
        );
    std::fs::write(d.join("rlc.yaml"), yaml).unwrap();
    // Every minute over 300 rps was throttled to 300.
    let minutes: Vec<_> = (start..end)
        .step_by(60)
        .filter(|&t| rate(t) > 300.0)
        .map(|t| (t, rate(t), rate(t) - 300.0))
        .collect();
    throttled(d, "web", &minutes).await;
    let refused: f64 = minutes.iter().map(|m| m.2 * 60.0).sum();
    assert!(refused > 0.0);

    let (code, preview) = rlc(d, &["preview", "--format", "json"]);
    assert_eq!(code, 0, "{preview}");
    let raised = limit(&preview, "web");
    assert!(
        (500.0..=600.0).contains(&raised),
        "web at {raised}: {preview}"
    );
    let e = &planned(&preview, "web")["evidence"];
    assert_eq!(e["throttled"]["sustained"], true, "{e}");
    assert!(e["throttled"]["days"].as_u64().unwrap() >= 2, "{e}");
    let said = e["throttled"]["refused_requests"].as_f64().unwrap();
    assert!(
        (said - refused).abs() < refused * 1e-6,
        "{said} vs {refused}"
    );
    assert!(e["ignored"].as_array().is_none_or(|i| i.is_empty()), "{e}");
    assert!(
        explain(&preview, "web").contains("sustained demand, counted"),
        "{e}"
    );

    let (code, out) = rlc(d, &["run", "--once", "--json"]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(out["needs_review"][0]["class"], "throttled_raise", "{out}");
    assert_eq!(out["needs_review"][0]["bucket"], "web", "{out}");
    let base = remote.read("main", "buckets/pay.yaml").unwrap();
    assert!(
        base.contains("limit_rps: 300\n"),
        "kept on the base: {base}"
    );
    let proposed = remote.read("rlc/quotas", "buckets/pay.yaml").unwrap();
    assert!(
        proposed.contains(&format!("limit_rps: {raised}\n")),
        "proposed: {proposed}"
    );
    drop(prom);
}

/// `rails.max_increase: 0.5`: a caller whose peak doubled (200 → 400 rps, 500 wanted) is
/// raised from 250 to 375 and no further; the evidence says so.
#[test]
fn max_increase_bounds_a_raise() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let end = chrono::Utc::now().timestamp() / 60 * 60 - 60;
    let rate = move |t: i64| if t > end - DAY { 400.0 } else { 200.0 };
    let (prom, _) = prometheus(d, 8, &[("web", &rate)]);
    let remote = setup(
        d,
        &prom,
        &pay(&[("web", 250.0, "peak")]),
        None,
        "7d",
        "rails:\n  max_increase: 0.5\n",
    );
    let (code, preview) = rlc(d, &["preview", "--format", "json"]);
    assert_eq!(code, 0, "{preview}");
    assert_eq!(limit(&preview, "web"), 375.0, "{preview}");
    assert_eq!(
        planned(&preview, "web")["evidence"]["capped_from"],
        500.0,
        "{preview}"
    );
    let (code, out) = rlc(d, &["run", "--once", "--json"]);
    assert_eq!(code, 0, "{out}");
    assert!(remote
        .read("main", "buckets/pay.yaml")
        .unwrap()
        .contains("limit_rps: 375\n"));
    drop(prom);
}

/// Two callers at 200 rps for eight days with one 3-hour burst at 2× two days ago. An incident
/// override acted on `web` through its burst (rlc saw it in force then: the store has it);
/// `mobile` had none. `web` keeps its limit and its evidence names the override; `mobile` is
/// raised. And a run records the overrides a real controller has in force now
/// (`GET /v1/overrides`), so the minutes they act on are left out of later runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn minutes_under_an_incident_override_are_not_demand() {
    use grl_control::controller::{Controller, ControllerOptions};
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let end = chrono::Utc::now().timestamp() / 60 * 60 - 60;
    let from = (end - 2 * DAY).div_euclid(DAY) * DAY + 10 * HOUR;
    let burst = move |t: i64| {
        if (from..from + 3 * HOUR).contains(&t) {
            400.0
        } else {
            200.0
        }
    };
    let (prom, _) = prometheus(d, 8, &[("web", &burst), ("mobile", &burst)]);
    let buckets = pay(&[("web", 250.0, "peak"), ("mobile", 250.0, "peak")]);
    std::fs::create_dir_all(d.join("pushed")).unwrap();
    std::fs::write(d.join("pushed/pay.yaml"), &buckets).unwrap();
    let controller = Controller::start(ControllerOptions {
        state_dir: d.join("grl-state"),
        token: "ctl-s3cret".into(),
        report_token: Some("zone-s3cret".into()),
        config_dir: Some(d.join("pushed")),
        tick: std::time::Duration::from_millis(200),
        ..Default::default()
    })
    .await
    .unwrap();
    std::env::set_var("RLC_LEARNING_GRL_TOKEN", "ctl-s3cret");
    let _remote = setup(
        d,
        &prom,
        &buckets,
        None,
        "7d",
        &format!(
            "controller:\n  url: {}\n  token_env: RLC_LEARNING_GRL_TOKEN\n",
            controller.url()
        ),
    );
    // What `rlc serve` recorded while the incident lasted.
    let store = rlc::store::Store::connect("sqlite://rlc.db", d)
        .await
        .unwrap();
    let seen: rlc::push::OverrideList = serde_json::from_value(json!({"overrides": [{
        "id": "ovr-1", "reason": "INC-123 launch traffic", "created_at": from,
        "expires_at": from + 3 * HOUR,
        "affects": [{"service": "pay", "bucket": "web", "created": false}]
    }]}))
    .unwrap();
    let at = |t: i64| chrono::DateTime::from_timestamp(t, 0).unwrap();
    store
        .record_overrides("default", &seen, at(from + 3 * HOUR - 60))
        .await
        .unwrap();
    // On-call throttles mobile now.
    let added = reqwest::Client::new()
        .post(format!("{}/v1/overrides", controller.url()))
        .bearer_auth("ctl-s3cret")
        .json(
            &json!({"service": "pay", "bucket": "mobile", "limit_rps": 100.0,
                      "ttl_secs": 3600, "reason": "INC-124 mobile retry loop", "who": "test"}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(added.status(), 201, "{}", added.text().await.unwrap());

    let (code, preview) = rlc(d, &["preview", "--format", "json"]);
    assert_eq!(code, 0, "{preview}");
    assert_eq!(limit(&preview, "web"), 250.0, "{preview}");
    assert_eq!(limit(&preview, "mobile"), 500.0, "{preview}");
    let w = &planned(&preview, "web")["evidence"];
    assert_eq!(w["ignored"][0]["kind"], "override", "{w}");
    assert!(
        explain(&preview, "web").contains("override ovr-1: INC-123 launch traffic"),
        "{w}"
    );

    let (code, out) = rlc(d, &["run", "--once", "--json"]);
    assert_eq!(code, 0, "{out}");
    let windows = store.override_windows(at(end - DAY)).await.unwrap();
    let mobile = &windows[&("pay".to_string(), "mobile".to_string())];
    assert_eq!(mobile.len(), 1, "{windows:?}");
    assert!(mobile[0].reason.contains("INC-124"), "{windows:?}");
    assert!(mobile[0].from.timestamp() >= end - 120, "{windows:?}");
    controller.shutdown().await;
    drop(prom);
}
