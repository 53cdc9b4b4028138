//! Dashboard handlers against a real SQLite store (no socket), and one real browser.

use std::future::IntoFuture;
use std::path::PathBuf;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use chrono::{TimeZone, Utc};
use tower::ServiceExt;

use super::*;
use crate::serve::app;
use grl_wire::ReportRow;

/// Bucket names come from config repos: this one must stay text everywhere.
const EVIL_BUCKET: &str = "<script>alert(\"x\")</script>";
/// A service name that tries to break out of an attribute.
const EVIL_SERVICE: &str = "x\"><img src=y onerror=alert(1)>";

/// A shadow report: virtual drops and drop ratio follow from `offered` and `limit`.
fn report(seq: i64, service: &str, bucket: &str, offered: f64, limit: f64) -> ReportRow {
    let shadow = (offered - limit).max(0.0);
    serde_json::from_value(serde_json::json!({
        "seq": seq, "t": seq, "service": service, "bucket": bucket, "caller": "gw",
        "procedure": null, "mode": "shadow", "scope_key": "global", "offered": offered,
        "admitted": offered, "dropped": 0.0, "shadow_dropped": shadow, "limit_rps": limit,
        "drop_ratio": if offered > 0.0 { shadow / offered } else { 0.0 }
    }))
    .unwrap()
}

fn run(status: &str, minute: u32, commit: Option<&str>, error: Option<&str>) -> RunRecord {
    RunRecord {
        id: 0,
        trigger: "schedule".into(),
        started_at: Utc.with_ymd_and_hms(2026, 11, 30, 3, minute, 0).unwrap(),
        finished_at: Utc.with_ymd_and_hms(2026, 11, 30, 3, minute, 20).unwrap(),
        status: status.into(),
        commit_sha: commit.map(Into::into),
        version_pushed: None,
        services: r#"[{"service":"payments","outcome":"committed"}]"#.into(),
        summary: format!("payments: raised 1 bucket ({status})\nsecond line"),
        error: error.map(Into::into),
        run_uid: None,
        pr_number: None,
        pr_url: None,
    }
}

/// `reports` as ticks at `t`.
fn at(reports: Vec<ReportRow>, t: chrono::DateTime<Utc>) -> Vec<ReportRow> {
    reports
        .into_iter()
        .map(|mut r| {
            r.t = grl_wire::Tick::Frac(t.timestamp() as f64);
            r
        })
        .collect()
}

/// A SQLite store with reports received now (plus one too old for a 1 h window) and two runs.
async fn filled_store(dir: &std::path::Path) -> Store {
    let store = Store::connect("sqlite://rlc.db", dir).await.unwrap();
    let now = Utc::now();
    store
        .insert_reports(
            &at(
                vec![report(1, "payments", "gw", 5000.0, 100.0)],
                now - chrono::Duration::hours(2),
            ),
            now - chrono::Duration::hours(2),
        )
        .await
        .unwrap();
    store
        .insert_reports(
            &at(
                vec![
                    // gw: 150 offered against a limit of 100, twice: a third would be dropped.
                    report(2, "payments", "gw", 150.0, 100.0),
                    report(3, "payments", "gw", 150.0, 100.0),
                    report(2, "payments", "steady", 90.0, 100.0),
                    // 1 in 201 would be dropped: under the 1% flag.
                    report(2, "payments", EVIL_BUCKET, 201.0, 200.0),
                    report(2, "maps", "geo", 120.0, 100.0),
                    report(2, EVIL_SERVICE, "b", 10.0, 100.0),
                ],
                now,
            ),
            now,
        )
        .await
        .unwrap();
    store
        .record_run(
            &run("failed", 0, None, Some("push rejected <by> remote")),
            &[],
        )
        .await
        .unwrap();
    // A run whose push is pending: its page says why (the rest of its record).
    let mut pending = run(
        "pending",
        3,
        Some("fedcba9876543210fedcba9876543210fedcba98"),
        None,
    );
    pending.summary =
        "rlc run (schedule): pending\n  controller: push pending (controller <down>); the commit stands"
            .into();
    store.record_run(&pending, &[]).await.unwrap();
    store
        .record_run(
            &run(
                "success",
                5,
                Some("0123456789abcdef0123456789abcdef01234567"),
                None,
            ),
            &[],
        )
        .await
        .unwrap();
    store
}

async fn get(state: &AppState, uri: &str) -> (StatusCode, String) {
    let resp = app(state.clone())
        .oneshot(Request::get(uri).body(Body::empty()).unwrap())
        .await
        .unwrap();
    let status = resp.status();
    let body = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .unwrap();
    (status, String::from_utf8(body.to_vec()).unwrap())
}

async fn get_json(state: &AppState, uri: &str) -> (StatusCode, serde_json::Value) {
    let (status, body) = get(state, uri).await;
    (
        status,
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}")),
    )
}

fn bucket<'a>(v: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    v["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["bucket"] == name)
        .unwrap_or_else(|| panic!("bucket {name} in {v:#}"))
}

#[tokio::test]
async fn shadow_json_sums_each_bucket_over_the_window() {
    let dir = tempfile::tempdir().unwrap();
    let state = AppState::with_store(filled_store(dir.path()).await);

    let (status, v) = get_json(&state, "/v1/shadow?window=1h").await;
    assert_eq!(status, StatusCode::OK, "{v:#}");
    assert_eq!(v["window"], "1h");
    assert_eq!(v["service"], serde_json::Value::Null);
    assert_eq!(v["would_throttle_share"], 0.01);
    assert_eq!(v["truncated"], false);
    assert_eq!(v["buckets"].as_array().unwrap().len(), 5);
    // Largest share of virtual drops first.
    assert_eq!(v["buckets"][0]["bucket"], "gw");
    let gw = bucket(&v, "gw");
    // The report from two hours ago is outside the window.
    assert_eq!(gw["reports"], 2);
    assert_eq!(gw["offered"], 300.0);
    assert_eq!(gw["admitted"], 300.0);
    assert_eq!(gw["shadow_dropped"], 100.0);
    assert!((gw["virtual_drop_share"].as_f64().unwrap() - 1.0 / 3.0).abs() < 1e-9);
    assert_eq!(gw["peak_offered_rps"], 150.0);
    assert_eq!(gw["limit_rps"], 100.0);
    assert_eq!(gw["mode"], "shadow");
    assert_eq!(gw["would_throttle"], true);
    assert_eq!(bucket(&v, "geo")["would_throttle"], true);
    assert_eq!(bucket(&v, "steady")["would_throttle"], false);
    assert_eq!(bucket(&v, "steady")["virtual_drop_share"], 0.0);
    let evil = bucket(&v, EVIL_BUCKET);
    assert!((evil["virtual_drop_share"].as_f64().unwrap() - 1.0 / 201.0).abs() < 1e-9);
    assert_eq!(evil["would_throttle"], false);

    // A window long enough reaches the old report.
    let (_, v) = get_json(&state, "/v1/shadow?window=3h&service=payments").await;
    assert_eq!(bucket(&v, "gw")["reports"], 3);

    let (_, v) = get_json(&state, "/v1/shadow?service=maps").await;
    assert_eq!(v["window"], "1h", "default window");
    assert_eq!(v["service"], "maps");
    assert_eq!(v["buckets"].as_array().unwrap().len(), 1);
    assert_eq!(v["buckets"][0]["bucket"], "geo");

    let (_, v) = get_json(&state, "/v1/shadow?limit=1").await;
    assert_eq!(v["buckets"].as_array().unwrap().len(), 1);
    assert_eq!(v["truncated"], true);

    for bad in ["2x", "h", "0m", "31d", "-1h"] {
        let (status, v) = get_json(&state, &format!("/v1/shadow?window={bad}")).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}: {v}");
        assert!(v["error"].as_str().unwrap().contains("window"), "{v}");
    }
}

#[test]
fn windows() {
    let secs = |s| parse_window(s).map(|d| d.num_seconds());
    assert_eq!(secs("90s"), Ok(90));
    assert_eq!(secs("15m"), Ok(900));
    assert_eq!(secs("1h"), Ok(3_600));
    assert_eq!(secs("30d"), Ok(30 * 86_400));
    for bad in ["", "1", "1w", "1.5h", "99999999999999999d", "é"] {
        assert!(parse_window(bad).is_err(), "{bad}");
    }
    // The bounds WINDOW_PATTERN (the API document) encodes, and the forms it refuses.
    for (ok, bad) in [
        ("2592000s", "2592001s"),
        ("43200m", "43201m"),
        ("720h", "721h"),
        ("30d", "31d"),
        ("1s", "0s"),
        ("1h", "01h"),
        ("5m", "+5m"),
        ("9d", " 9d"),
    ] {
        assert!(parse_window(ok).is_ok(), "{ok}");
        assert!(parse_window(bad).is_err(), "{bad}");
    }
}

#[tokio::test]
async fn runs_json_lists_recent_runs_newest_first() {
    let dir = tempfile::tempdir().unwrap();
    let state = AppState::with_store(filled_store(dir.path()).await);
    let (status, v) = get_json(&state, "/v1/runs").await;
    assert_eq!(status, StatusCode::OK);
    let runs = v["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 3);
    assert_eq!(runs[0]["status"], "success");
    assert_eq!(
        runs[0]["commit_sha"],
        "0123456789abcdef0123456789abcdef01234567"
    );
    assert_eq!(runs[0]["services"][0]["service"], "payments", "parsed JSON");
    assert_eq!(runs[1]["status"], "pending");
    assert_eq!(runs[2]["error"], "push rejected <by> remote");
    let (_, v) = get_json(&state, "/v1/runs?limit=1").await;
    assert_eq!(v["runs"].as_array().unwrap().len(), 1);
    assert_eq!(v["runs"][0]["status"], "success");
}

#[tokio::test]
async fn without_a_store_the_pages_say_so() {
    let state = AppState::new(None, tokio::sync::mpsc::channel(1).0);
    for uri in ["/v1/shadow", "/v1/runs", "/v1/shadow/payments/gw?window=7d"] {
        let (status, v) = get_json(&state, uri).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{uri}");
        assert!(
            v["error"]
                .as_str()
                .unwrap()
                .contains("store is not available"),
            "{v}"
        );
    }
    let (status, html) = get(&state, "/").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(html.contains("store is not available"), "{html}");
    assert!(html.contains("What is shadow mode?"));
    // The bucket page says what it could not load, and shows no figure.
    let (status, html) = get(&state, "/buckets/payments/gw?window=7d").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(html.contains("Could not load this bucket"), "{html}");
    assert!(html.contains("store is not available"), "{html}");
    assert!(!html.contains("<svg"), "{html}");
    // Manual runs keep their own rules: with no write token configured
    // they are not enabled at all.
    let resp = app(state)
        .oneshot(Request::post("/v1/runs").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::FORBIDDEN);
}

#[tokio::test]
async fn html_dashboard_flags_buckets_and_escapes_names() {
    let dir = tempfile::tempdir().unwrap();
    let state = AppState::with_store(filled_store(dir.path()).await);
    let (status, html) = get(&state, "/").await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        html.contains(
            r#"<tr class="would-throttle" data-bucket="gw" data-service="payments" data-verdict="would-throttle">"#
        ),
        "{html}"
    );
    assert!(html.contains(r#"<tr class="ok" data-bucket="steady" data-service="payments""#));
    assert!(html.contains("would throttle 33.33%"));
    assert!(html.contains("<b>2</b> would throttle"), "gw and geo");
    assert!(
        html.contains(r#"id="no-config""#),
        "says only reported buckets are listed"
    );
    // Names are text, never markup: no script element, no injected attribute.
    assert!(!html.contains("<script"), "{html}");
    assert!(!html.contains("<img"), "{html}");
    assert!(html.contains("&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;"));
    assert!(html.contains(r#"<option value="x&quot;&gt;&lt;img src=y onerror=alert(1)&gt;">"#));
    assert!(html.contains("push rejected &lt;by&gt; remote"));
    // The link to a service's view is percent-encoded, then escaped.
    assert!(html.contains(
        "href=\"/?service=x%22%3E%3Cimg%20src%3Dy%20onerror%3Dalert%281%29%3E&amp;window=1h\""
    ));
    // Last runs: status, short commit, first line of the summary.
    assert!(html.contains(r#"<span class="badge success">success</span>"#));
    assert!(html.contains(">0123456789ab</code>"));
    assert!(html.contains("payments: raised 1 bucket (success)"));
    // The rest of a record only for a run that did not succeed: why it failed.
    assert_eq!(
        html.matches("<li>second line</li>").count(),
        1,
        "the failed run's, not the successful one's"
    );
    assert!(html.contains(&format!(
        r#"<span class="badge {0}">{0}</span>"#,
        crate::cycle::RunStatus::Pending.as_str()
    )));
    assert!(
        html.contains(
            "<li>controller: push pending (controller &lt;down&gt;); the commit stands</li>"
        ),
        "why the push is pending"
    );

    let (status, html) = get(&state, "/?service=maps&window=6h").await;
    assert_eq!(status, StatusCode::OK);
    assert!(html.contains(r#"data-bucket="geo""#));
    assert!(!html.contains(r#"data-bucket="gw""#));
    assert!(html.contains(r#"<option value="maps" selected>"#));
    assert!(html.contains(r#"<option value="6h" selected>"#));

    let (status, html) = get(&state, "/?window=%3Cb%3E").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(!html.contains("<b>`"), "{html}");
    assert!(html.contains("window <code>&lt;b&gt;</code>"), "{html}");
}

/// The Debian package `chromium` installs it there.
fn chromium() -> PathBuf {
    let path = std::env::var_os("CHROMIUM")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/bin/chromium"));
    assert!(
        path.exists(),
        "headless Chromium is needed for this test and {} is missing: \
         install it with `apt-get install chromium` (Debian package `chromium`), \
         or run `cargo xtask test`, which installs it",
        path.display()
    );
    path
}

/// Runs headless Chromium with `extra` arguments on `url`; kills it after 60 s so a hung
/// browser fails the test instead of hanging the suite.
async fn chromium_run(extra: &[String], url: &str) -> String {
    let profile = tempfile::tempdir().unwrap();
    let mut cmd = tokio::process::Command::new(chromium());
    cmd.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
    ])
    .arg(format!("--user-data-dir={}", profile.path().display()))
    .args(extra)
    .arg(url)
    .stdin(std::process::Stdio::null())
    .stdout(std::process::Stdio::piped())
    .stderr(std::process::Stdio::piped())
    .kill_on_drop(true);
    let child = cmd.spawn().expect("chromium starts");
    let out = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
        .await
        .expect("chromium did not finish within 60 s (killed)")
        .unwrap();
    assert!(
        out.status.success(),
        "chromium failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_renders_in_headless_chromium() {
    let dir = tempfile::tempdir().unwrap();
    let state = AppState::with_store(filled_store(dir.path()).await);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/", listener.local_addr().unwrap());
    tokio::spawn(axum::serve(listener, app(state)).into_future());

    let dom = chromium_run(&["--dump-dom".into()], &url).await;
    assert!(dom.contains("Rate Limit Configurator"), "{dom}");
    for b in ["gw", "steady", "geo", "b"] {
        assert!(dom.contains(&format!("data-bucket=\"{b}\"")), "{b}: {dom}");
    }
    assert!(
        dom.contains(r#"<tr class="would-throttle" data-bucket="gw""#),
        "{dom}"
    );
    assert!(dom.contains("would throttle"));
    // The browser parsed the evil bucket name as text: no script element in the DOM.
    assert!(!dom.contains("<script"), "{dom}");
    // (A line may break after its `/`: a `<wbr>` there, never inside a word.)
    assert!(
        dom.contains("&lt;script&gt;alert(\"x\")&lt;/<wbr>script&gt;"),
        "{dom}"
    );

    // For a person to look at: RLC_DASHBOARD_SCREENSHOT=/tmp/dash.png cargo test -p rlc chromium
    if let Some(file) = std::env::var_os("RLC_DASHBOARD_SCREENSHOT") {
        chromium_run(
            &[
                format!("--screenshot={}", PathBuf::from(file).display()),
                "--window-size=1280,900".into(),
                "--hide-scrollbars".into(),
            ],
            &url,
        )
        .await;
    }
}

/// Where the test run writes screenshots: `$CARGO_TARGET_DIR/screenshots/` (else the target
/// directory of this test binary).
fn screenshot_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let exe = std::env::current_exe().unwrap();
            exe.ancestors().nth(3).unwrap().to_path_buf()
        });
    let dir = target.join("screenshots");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A report of one zone-minute.
fn zone_minute(
    seq: i64,
    t: chrono::DateTime<Utc>,
    (service, bucket, zone, mode): (&str, &str, &str, &str),
    offered: f64,
    limit: f64,
) -> ReportRow {
    let over = (offered - limit).max(0.0);
    let (dropped, shadow) = if mode == "enforce" {
        (over, 0.0)
    } else {
        (0.0, over)
    };
    serde_json::from_value(serde_json::json!({
        "seq": seq, "t": t.timestamp(), "service": service, "bucket": bucket, "caller": null,
        "procedure": null, "mode": mode, "scope_key": zone, "offered": offered,
        "admitted": offered - dropped, "dropped": dropped, "shadow_dropped": shadow,
        "limit_rps": limit, "drop_ratio": over / offered
    }))
    .unwrap()
}

/// What [`eight_days`] put in the store.
struct Days {
    burst: chrono::DateTime<Utc>,
    gap: (chrono::DateTime<Utc>, chrono::DateTime<Utc>),
}

const ZONES: [&str; 3] = ["eu-1", "eu-2", "us-1"];

/// Eight days of simulated reports, one per zone and minute, through the store API:
/// - `checkout/gw` (shadow, limit 150): 100 rps per zone, a one-minute burst to 400 rps in
///   eu-1 two days ago, no report at all for two hours three days ago;
/// - `checkout/api` (enforced, limit 150): 200 rps per zone, so 50 rps really dropped;
/// - `search/<script>` (shadow, limit 80): 100 rps per zone, would throttle 20 %.
async fn eight_days(store: &Store) -> Days {
    let now = crate::store::minute_of(Utc::now());
    let burst = now - chrono::Duration::days(2);
    let gap = (
        now - chrono::Duration::days(3),
        now - chrono::Duration::days(3) + chrono::Duration::hours(2),
    );
    let mut seq = 0;
    let mut batch = Vec::new();
    let mut t = now - chrono::Duration::days(8);
    while t <= now {
        if !(gap.0 <= t && t < gap.1) {
            for zone in ZONES {
                seq += 1;
                let gw = if t == burst && zone == "eu-1" {
                    400.0
                } else {
                    100.0
                };
                batch.push(zone_minute(
                    seq,
                    t,
                    ("checkout", "gw", zone, "shadow"),
                    gw,
                    150.0,
                ));
                batch.push(zone_minute(
                    seq,
                    t,
                    ("checkout", "api", zone, "enforce"),
                    200.0,
                    150.0,
                ));
                batch.push(zone_minute(
                    seq,
                    t,
                    ("search", EVIL_BUCKET, zone, "shadow"),
                    100.0,
                    80.0,
                ));
            }
        }
        if batch.len() >= 30_000 {
            store.insert_reports(&batch, Utc::now()).await.unwrap();
            batch.clear();
        }
        t += chrono::Duration::minutes(1);
    }
    store.insert_reports(&batch, Utc::now()).await.unwrap();
    // The closed hours rolled up, as `rlc serve` does every minute: the pages read them.
    while store.roll_up_hours(Utc::now()).await.unwrap() > 0 {}
    // A run that raised gw, for the quota history link.
    let mut q = crate::store::QuotaRecord {
        service: "checkout".into(),
        bucket: "gw".into(),
        change: rlc_plan::change::ChangeKind::Raised,
        limit_rps: Some(150.0),
        previous_limit_rps: Some(120.0),
        mode: Some("shadow".into()),
        policy: Some("peak".into()),
        commit_sha: Some("feedfacefeedfacefeedfacefeedfacefeedface".into()),
        state: crate::store::ChangeState::Applied,
        evidence: "{}".into(),
        recorded_at: now - chrono::Duration::days(1),
        // Proposed through merge request !12.
        pr_number: Some(12),
        pr_url: Some(MR_URL.into()),
    };
    let mut held = run("held", 1, None, None);
    held.summary = "rlc run (schedule): held\n  git: held — the PR branch has human commits".into();
    store.record_run(&held, &[]).await.unwrap();
    q.recorded_at = now - chrono::Duration::days(1);
    let mut via_mr = run("success", 2, q.commit_sha.as_deref(), None);
    via_mr.pr_number = q.pr_number;
    via_mr.pr_url = q.pr_url.clone();
    store.record_run(&via_mr, &[q]).await.unwrap();
    Days { burst, gap }
}

/// The bucket JSON twin: series with gaps as nulls, readiness figures with numbers.
async fn check_bucket_json(state: &AppState, days: &Days) {
    let (status, v) = get_json(state, "/v1/shadow/checkout/gw?window=7d").await;
    assert_eq!(status, StatusCode::OK, "{v:#}");
    assert_eq!(v["step_secs"], 28 * 60, "10080 minutes in 360 steps of 28");
    let series = v["series"].as_array().unwrap();
    assert_eq!(series.len(), 3);
    assert_eq!(series[0]["scope_key"], "eu-1", "the busiest zone first");
    let pts = series[0]["points"].as_array().unwrap();
    assert_eq!(pts.len(), 360);
    // The burst: the highest offered point is the step that holds it.
    let (i, top) = pts
        .iter()
        .enumerate()
        .max_by(|a, b| {
            a.1["offered_rps"]
                .as_f64()
                .unwrap_or(0.0)
                .total_cmp(&b.1["offered_rps"].as_f64().unwrap_or(0.0))
        })
        .unwrap();
    assert_eq!(top["offered_rps"], 400.0);
    assert_eq!(top["virtual_drop_rps"], 250.0);
    let step_start: chrono::DateTime<Utc> = serde_json::from_value(pts[i]["t"].clone()).unwrap();
    assert!(step_start <= days.burst && days.burst < step_start + chrono::Duration::minutes(28));

    // 30 days: two-hour steps on two-hour boundaries, from the hourly roll-ups; the burst
    // shows in the step of its minute, the days before the first report are gaps.
    let (status, v30) = get_json(state, "/v1/shadow/checkout/gw?window=30d").await;
    assert_eq!(status, StatusCode::OK, "{v30:#}");
    assert_eq!(v30["step_secs"], 7200);
    let start: chrono::DateTime<Utc> = serde_json::from_value(v30["window_start"].clone()).unwrap();
    assert_eq!(start.timestamp() % 7200, 0);
    let pts30 = v30["series"][0]["points"].as_array().unwrap();
    assert!(pts30.len() == 360 || pts30.len() == 361, "{}", pts30.len());
    assert!(pts30[0]["offered_rps"].is_null(), "no report 30 days ago");
    let top30 = pts30
        .iter()
        .max_by(|a, b| {
            a["offered_rps"]
                .as_f64()
                .unwrap_or(0.0)
                .total_cmp(&b["offered_rps"].as_f64().unwrap_or(0.0))
        })
        .unwrap();
    assert_eq!(top30["offered_rps"], 400.0);
    let t30: chrono::DateTime<Utc> = serde_json::from_value(top30["t"].clone()).unwrap();
    assert!(t30 <= days.burst && days.burst < t30 + chrono::Duration::hours(2));
    // About 34,200 zone-minutes at 100 rps and one at 400 (the budget, 0.01 % of ~3.42
    // million, is ~342): the burst loses 300 above 100, the 100s share the remaining ~42, so
    // the limit is 100 - 42 / 34,200 ≈ 99.9988 (without the burst it would be 99.99).
    let limit = v30["readiness"]["stats"]["suggested_limit_rps"]
        .as_f64()
        .unwrap();
    assert!((limit - 99.9988).abs() < 1e-4, "{limit}");
    // The two-hour gap: whole steps inside it have no value at all (not zero).
    let empty: Vec<_> = pts.iter().filter(|p| p["offered_rps"].is_null()).collect();
    assert!((3..=4).contains(&empty.len()), "{}", empty.len());
    for p in empty {
        let t: chrono::DateTime<Utc> = serde_json::from_value(p["t"].clone()).unwrap();
        assert!(
            days.gap.0 - chrono::Duration::minutes(28) < t && t < days.gap.1,
            "{t}"
        );
        assert!(p["limit_rps"].is_null() && p["virtual_drop_rps"].is_null());
    }

    let r = &v["readiness"];
    let s = &r["stats"];
    assert_eq!(s["mode"], "shadow");
    // Shadow since the first report, eight days ago.
    assert!(
        (r["days_in_shadow"].as_f64().unwrap() - 8.0).abs() < 0.01,
        "{r}"
    );
    // Every minute of the window but the gap's 120 (± the minute the clock may have turned).
    let cov = s["coverage"].as_f64().unwrap();
    assert!(
        (cov - (10_080.0 - 120.0) / 10_080.0).abs() <= 1.5 / 10_080.0,
        "{cov}"
    );
    let offered = s["offered"].as_f64().unwrap();
    let minutes = (offered - 300.0) / 300.0; // the burst adds 300 once
    assert!((minutes - (10_080.0 - 120.0)).abs() <= 1.0, "{offered}");
    assert_eq!(s["virtual_dropped"], 250.0);
    assert_eq!(s["dropped"], 0.0);
    assert!((s["peak_drop_share"].as_f64().unwrap() - 250.0 / 600.0).abs() < 1e-12);
    let peak_at: chrono::DateTime<Utc> = serde_json::from_value(s["peak_drop_at"].clone()).unwrap();
    assert_eq!(peak_at, days.burst);
    // The burst minute may lose 0.01 % of all offered requests: 400 − 1e-4 × offered.
    let suggested = s["suggested_limit_rps"].as_f64().unwrap();
    assert!(
        (suggested - (400.0 - 1e-4 * offered)).abs() < 1e-6,
        "{suggested}"
    );
    assert_eq!(r["verdict"]["verdict"], "ready", "{r}");
    assert_eq!(v["quota_history"][0]["limit_rps"], 150.0);
    assert_eq!(
        v["quota_history"][0]["commit_sha"],
        "feedfacefeedfacefeedfacefeedfacefeedface"
    );

    let (_, api) = get_json(state, "/v1/shadow/checkout/api?window=24h").await;
    assert_eq!(api["readiness"]["verdict"]["verdict"], "enforced");
    // 50 of 200 rps per zone really dropped: the page says so, as the overview does.
    assert_eq!(
        api["readiness"]["verdict_text"],
        "enforced: dropping 25.00% of requests"
    );
    let d = api["readiness"]["stats"]["dropped"].as_f64().unwrap();
    assert!(
        (d / 150.0 - 1440.0).abs() <= 1.0,
        "50 rps × 3 zones a minute: {d}"
    );
    assert_eq!(api["series"][0]["points"][0]["drop_rps"], 50.0);

    let evil = format!("/v1/shadow/search/{}?window=24h", encoded(EVIL_BUCKET));
    let (status, e) = get_json(state, &evil).await;
    assert_eq!(status, StatusCode::OK, "{e}");
    assert_eq!(e["bucket"], EVIL_BUCKET);
    assert_eq!(e["readiness"]["verdict"]["verdict"], "would_throttle");
    assert!((e["readiness"]["virtual_drop_share"].as_f64().unwrap() - 0.2).abs() < 1e-12);

    let (status, _) = get_json(state, "/v1/shadow/checkout/nope").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, _) = get_json(state, "/v1/shadow/checkout/gw?window=40d").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}

/// The points of an SVG path `d` ("M x y L x y ...").
fn path_points(d: &str) -> Vec<(char, f64, f64)> {
    let toks: Vec<&str> = d.split_whitespace().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i + 1 < toks.len() {
        let (cmd, x) = toks[i].split_at(1);
        let c = cmd.chars().next().unwrap();
        if c == 'M' || c == 'L' {
            out.push((c, x.parse().unwrap(), toks[i + 1].parse().unwrap()));
        }
        i += 2;
    }
    out
}

/// The value of attribute `name` in the first tag of `html` after `from`.
fn attr<'a>(html: &'a str, from: usize, name: &str) -> &'a str {
    let key = format!("{name}=\"");
    let s = from + html[from..].find(&key).unwrap_or_else(|| panic!("{name}")) + key.len();
    &html[s..s + html[s..].find('"').unwrap()]
}

/// The merge request of the change in [`eight_days`].
const MR_URL: &str = "https://git.example.com/acme/config/-/merge_requests/12";

async fn check_bucket_pages(store: Store, label: &str) {
    let days = eight_days(&store).await;
    let state = AppState::from_parts(crate::serve::AppParts {
        store: crate::serve::StoreSlot::with(store),
        links: Links::from_forge(Some(&forge(
            "kind: gitlab\napi_url: https://git.example.com/api/v4\nrepo: acme/config\n",
        ))),
        ..Default::default()
    });
    check_bucket_json(&state, &days).await;

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(axum::serve(listener, app(state.clone())).into_future());

    // Overview: links to bucket pages; the enforced bucket's real drops are a column.
    let dom = chromium_run(&["--dump-dom".into()], &format!("{base}/?window=24h")).await;
    assert!(
        dom.contains("href=\"/buckets/checkout/gw?window=24h\""),
        "{dom}"
    );
    let evil_link = format!(
        "href=\"/buckets/search/{}?window=24h\"",
        encoded(EVIL_BUCKET)
    );
    assert!(dom.contains(&evil_link), "{dom}");
    assert!(!dom.contains("<script"), "{dom}");
    // Why the held run was held.
    assert!(dom.contains("the PR branch has human commits"), "{dom}");

    // The shadow bucket over 7 days.
    let url = format!("{base}/buckets/checkout/gw?window=7d");
    let dom = chromium_run(&["--dump-dom".into()], &url).await;
    assert!(
        dom.contains(r#"<span class="badge ok" id="verdict">ready</span>"#),
        "{dom}"
    );
    let svg = dom.find("<svg").expect("a chart");
    let scope = attr(&dom, svg, "data-scope");
    assert_eq!(scope, "eu-1");
    let t0: f64 = attr(&dom, svg, "data-t0").parse().unwrap();
    let x0: f64 = attr(&dom, svg, "data-x0").parse().unwrap();
    let px_per_sec: f64 = attr(&dom, svg, "data-px-per-sec").parse().unwrap();
    let offered = dom[svg..].find("data-series=\"offered\"").unwrap() + svg;
    let pts = path_points(attr(&dom, offered.saturating_sub(200), "d"));
    // The chart's highest point (smallest y) is at the burst's time, within one step.
    let (_, x, _) = pts
        .iter()
        .copied()
        .min_by(|a, b| a.2.total_cmp(&b.2))
        .unwrap();
    let t = t0 + (x - x0) / px_per_sec;
    assert!(
        (t - days.burst.timestamp() as f64).abs() <= 28.0 * 60.0,
        "burst drawn at {t}"
    );
    // The gap breaks the line (a second "M"), and is shaded.
    assert_eq!(pts.iter().filter(|p| p.0 == 'M').count(), 2, "{pts:?}");
    let gap = dom[svg..].find("<rect class=\"gap\"").unwrap() + svg;
    let gx: f64 = attr(&dom, gap, "x").parse().unwrap();
    let gw: f64 = attr(&dom, gap, "width").parse().unwrap();
    let mid = (days.gap.0.timestamp() + 3600) as f64;
    assert!(t0 + (gx - x0) / px_per_sec <= mid && mid <= t0 + (gx + gw - x0) / px_per_sec);
    let suggested = dom.find("id=\"suggested\">").unwrap();
    let value: f64 = dom[suggested + 15..][..dom[suggested + 15..].find('<').unwrap()]
        .parse()
        .unwrap();
    assert!((value - 101.2).abs() < 0.11, "{value}");
    assert!(dom.contains("href=\"/v1/shadow/checkout/gw?window=7d\""));
    assert!(
        dom.contains(">feedfacefeed</code>"),
        "quota history with its commit"
    );
    // The commit and the merge request link to the forge (hrefs only: nothing is fetched).
    assert!(
        dom.contains(
            "href=\"https://git.example.com/acme/config/-/commit/feedfacefeedfacefeedfacefeedfacefeedface\""
        ),
        "{dom}"
    );
    assert!(dom.contains(&format!("href=\"{MR_URL}\">#12</a>")), "{dom}");
    // The change links to the run that made it, whose record names the same commit.
    let at = dom.find("href=\"/runs/").expect("a link to the run's page") + 6;
    let link = &dom[at..][..dom[at..].find('"').unwrap()];
    let (status, page) = get(&state, link).await;
    assert_eq!(status, StatusCode::OK, "{link}");
    assert!(
        page.contains(">feedfacefeed</code>"),
        "the run page names its commit: {page}"
    );
    let (status, run) = get_json(&state, &format!("/v1{link}")).await;
    assert_eq!(status, StatusCode::OK, "{link}");
    assert_eq!(
        run["record"]["commit_sha"], "feedfacefeedfacefeedfacefeedfacefeedface",
        "{run}"
    );
    let dir = screenshot_dir();
    let shots = [
        ("bucket-shadow", url.clone()),
        (
            "bucket-enforced",
            format!("{base}/buckets/checkout/api?window=24h"),
        ),
        ("overview", format!("{base}/?window=24h")),
    ];
    // The enforced bucket: real drops drawn and counted.
    let dom = chromium_run(&["--dump-dom".into()], &shots[1].1).await;
    assert!(
        dom.contains(r#"id="verdict">enforced: dropping 25.00% of requests</span>"#),
        "{dom}"
    );
    assert!(
        dom.contains(r#"<span class="badge dropping" id="verdict">"#),
        "{dom}"
    );
    assert!(dom.contains(r#"data-series="drops""#), "{dom}");
    assert!(!dom.contains(r#"data-series="virtual-drops""#), "{dom}");
    // The hostile bucket name: text in the page and in the SVG title.
    let dom = chromium_run(
        &["--dump-dom".into()],
        &format!("{base}/buckets/search/{}?window=24h", encoded(EVIL_BUCKET)),
    )
    .await;
    assert!(!dom.contains("<script"), "{dom}");
    assert!(
        dom.contains("search/&lt;script&gt;alert(\"x\")&lt;/script&gt; scope eu-1"),
        "{dom}"
    );
    assert!(dom.contains("would throttle 20.000% of requests"), "{dom}");
    for (name, url) in shots {
        let file = dir.join(format!("{name}-{label}.png"));
        chromium_run(
            &[
                format!("--screenshot={}", file.display()),
                "--window-size=1280,1600".into(),
                "--hide-scrollbars".into(),
            ],
            &url,
        )
        .await;
        assert!(
            std::fs::metadata(&file).unwrap().len() > 10_000,
            "{}",
            file.display()
        );
        println!("screenshot: {}", file.display());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bucket_pages_in_headless_chromium_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::connect("sqlite://rlc.db", dir.path()).await.unwrap();
    check_bucket_pages(store, "sqlite").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bucket_pages_in_headless_chromium_postgres() {
    let db = test_support::postgres::fresh_database().await.unwrap();
    let store = Store::connect(&db.url, std::path::Path::new("/"))
        .await
        .unwrap();
    check_bucket_pages(store, "postgres").await;
}

/// The bucket page's verdict applies the service's `promotion:` rule of the config repo's
/// `rlc/policies.yaml` (base branch), resolved as a run resolves it: `checkout` needs 10 days
/// in shadow (gw has 8: not yet), every other service takes the `default:` section (search
/// tolerates 50 % virtual drops: its 20 % is ready). Without a config repo: the default rule.
#[tokio::test]
async fn bucket_verdict_applies_the_services_promotion_rule() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::connect("sqlite://rlc.db", dir.path()).await.unwrap();
    eight_days(&store).await;
    let policies = "default:\n  policy: peak\npromotion:\n  default:\n    max_virtual_drop_share: 0.5\n  services:\n    checkout:\n      min_days_in_shadow: 10\n";
    let wc = dir.path().join("wc");
    std::fs::create_dir_all(wc.join("rlc")).unwrap();
    std::fs::write(wc.join("rlc/policies.yaml"), policies).unwrap();
    let git = |args: &[&str]| test_support::git::git(&wc, args).unwrap();
    git(&["init", "-q", "-b", "main"]);
    git(&["add", "-A"]);
    git(&[
        "-c",
        "user.name=t",
        "-c",
        "user.email=t@example.com",
        "commit",
        "-q",
        "-m",
        "policies",
    ]);
    let cfg: schema::DaemonConfig = schema::parse_str(
        std::path::Path::new("rlc.yaml"),
        "history:\n  prometheus:\n    url: http://127.0.0.1:9\n    query: up\nconfig_repo:\n  path: wc\n",
    )
    .unwrap()
    .value;
    let cache = std::sync::Arc::new(crate::history::snapshot::HistoryCache::new(
        cfg.clone(),
        dir.path(),
    ));
    let slot = crate::serve::StoreSlot::with(store.clone());
    let state = AppState::from_parts(crate::serve::AppParts {
        quotas: Some(std::sync::Arc::new(
            crate::serve::quotas::Quotas::new(cfg, dir.path(), cache, 4, slot.clone()).unwrap(),
        )),
        store: slot,
        ..Default::default()
    });

    // The run's resolution of the same file.
    let file: schema::PoliciesFile =
        schema::parse_str(std::path::Path::new("rlc/policies.yaml"), policies)
            .unwrap()
            .value;
    let (run_rule, from_file) = rlc_plan::promotion::readiness_rule(Some(&file), "checkout");
    assert!(from_file);
    assert_eq!(run_rule.min_days_in_shadow, 10.0);

    let (status, v) = get_json(&state, "/v1/shadow/checkout/gw?window=7d").await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let r = &v["readiness"];
    assert_eq!(r["rule"]["source"], "rlc/policies.yaml", "{r}");
    assert_eq!(r["rule"]["min_days_in_shadow"], 10.0);
    assert_eq!(r["rule"]["max_virtual_drop_share"], 0.5);
    assert_eq!(r["rule"]["min_coverage"], 0.9);
    assert_eq!(r["verdict"]["verdict"], "not_yet", "{r}");
    assert_eq!(
        r["verdict"]["reasons"],
        serde_json::json!(["8.0 of 10 days in shadow"]),
        "{r}"
    );
    let (_, html) = get(&state, "/buckets/checkout/gw?window=7d").await;
    assert!(
        html.contains("rlc/policies.yaml rule: ≥ 10 days in shadow, coverage ≥ 90%, virtual drops ≤ 50%, last report ≤ 15 min old"),
        "{html}"
    );
    assert!(html.contains("not yet: 8.0 of 10 days in shadow"));

    let evil = format!("/v1/shadow/search/{}?window=7d", encoded(EVIL_BUCKET));
    let (_, e) = get_json(&state, &evil).await;
    assert_eq!(e["readiness"]["rule"]["min_days_in_shadow"], 7.0, "{e}");
    assert_eq!(e["readiness"]["verdict"]["verdict"], "ready", "{e}");

    // Without a config repo: the default rule, said so.
    let (_, d) = get_json(
        &AppState::with_store(store),
        "/v1/shadow/checkout/gw?window=7d",
    )
    .await;
    assert_eq!(d["readiness"]["rule"]["source"], "default");
    assert_eq!(d["readiness"]["verdict"]["verdict"], "ready", "{d}");
}

fn forge(yaml: &str) -> schema::ForgeConfig {
    serde_yaml::from_str(yaml).unwrap()
}

#[test]
fn commit_links_follow_the_forge_config() {
    let sha = "0123456789abcdef0123456789abcdef01234567";
    let url = |yaml: &str| Links::from_forge(Some(&forge(yaml))).commit_url(sha);
    assert_eq!(
        url("kind: github\nrepo: acme/config\n"),
        Some(format!("https://github.com/acme/config/commit/{sha}"))
    );
    // GitHub Enterprise and Gitea APIs live under /api/v3 and /api/v1 of the web site.
    assert_eq!(
        url("kind: github\napi_url: https://ghe.example.com/api/v3/\nrepo: acme/config\n"),
        Some(format!("https://ghe.example.com/acme/config/commit/{sha}"))
    );
    assert_eq!(
        url("kind: github\napi_url: https://gitea.example.com/api/v1\nrepo: acme/config\n"),
        Some(format!(
            "https://gitea.example.com/acme/config/commit/{sha}"
        ))
    );
    assert_eq!(
        url("kind: gitlab\nrepo: group/sub/config\n"),
        Some(format!(
            "https://gitlab.com/group/sub/config/-/commit/{sha}"
        ))
    );
    assert_eq!(
        url("kind: gitlab\napi_url: https://git.example.com/api/v4\nrepo: group/config\n"),
        Some(format!(
            "https://git.example.com/group/config/-/commit/{sha}"
        ))
    );
    // forge.web_url wins over the API URL.
    assert_eq!(
        url("kind: github\napi_url: http://127.0.0.1:1/\nweb_url: https://code.example.com/\nrepo: acme/config\n"),
        Some(format!("https://code.example.com/acme/config/commit/{sha}"))
    );
    // Path segments are percent-encoded; no forge, kind none or a non-http base: no link.
    assert_eq!(
        url("kind: github\nrepo: \"a b/c\\\"d\"\n"),
        Some(format!("https://github.com/a%20b/c%22d/commit/{sha}"))
    );
    assert_eq!(url("kind: none\nrepo: acme/config\n"), None);
    assert_eq!(url("kind: github\n"), None);
    assert_eq!(
        url("kind: github\nweb_url: \"javascript:alert(1)//\"\nrepo: a/b\n"),
        None
    );
    assert_eq!(Links::from_forge(None).commit_url(sha), None);
    // Only commit ids are linked.
    let links = Links::from_forge(Some(&forge("kind: github\nrepo: acme/config\n")));
    for bad in ["", "abc", "../../evil", "0123456789abcdef\"><x>"] {
        assert_eq!(links.commit_url(bad), None, "{bad}");
    }
}

const PR_SHA: &str = "c0ffeec0ffeec0ffeec0ffeec0ffeec0ffeec0ff";
const PR_URL: &str = "https://github.com/acme/config/pull/7";

/// [`filled_store`] plus a run that opened pull request #7 (and the change of payments/gw it
/// carries), and a run whose stored pull request URL and commit are hostile.
async fn store_with_pull_requests(dir: &std::path::Path) -> (Store, i64) {
    let store = filled_store(dir).await;
    let mut via_pr = run("success", 10, Some(PR_SHA), None);
    via_pr.pr_number = Some(7);
    via_pr.pr_url = Some(PR_URL.into());
    let q = crate::store::QuotaRecord {
        service: "payments".into(),
        bucket: "gw".into(),
        change: rlc_plan::change::ChangeKind::Raised,
        limit_rps: Some(150.0),
        previous_limit_rps: Some(100.0),
        mode: Some("shadow".into()),
        policy: Some("peak".into()),
        commit_sha: Some(PR_SHA.into()),
        state: crate::store::ChangeState::Applied,
        evidence: "{}".into(),
        recorded_at: Utc::now(),
        pr_number: Some(7),
        pr_url: Some(PR_URL.into()),
    };
    let id = store.record_run(&via_pr, &[q]).await.unwrap();
    let mut evil = run("success", 11, Some("\"><img src=x onerror=alert(2)>"), None);
    evil.pr_number = Some(8);
    evil.pr_url = Some("javascript:alert(1)".into());
    store.record_run(&evil, &[]).await.unwrap();
    (store, id)
}

#[tokio::test]
async fn pages_link_commits_and_pull_requests_to_the_forge() {
    let dir = tempfile::tempdir().unwrap();
    let (store, id) = store_with_pull_requests(dir.path()).await;
    let state = AppState::from_parts(crate::serve::AppParts {
        store: crate::serve::StoreSlot::with(store),
        links: Links::from_forge(Some(&forge("kind: github\nrepo: acme/config\n"))),
        ..Default::default()
    });
    let commit_url = format!("https://github.com/acme/config/commit/{PR_SHA}");
    let commit_link = format!(
        "<a class=\"commit\" href=\"{commit_url}\"><code title=\"{PR_SHA}\">c0ffeec0ffee</code></a>"
    );
    let pr_link = format!("<a class=\"pr\" href=\"{PR_URL}\">#7</a>");

    // The overview's runs table: the commit and the pull request link to the forge, the
    // run to its record; the hostile URL and commit stay text.
    let (status, html) = get(&state, "/").await;
    assert_eq!(status, StatusCode::OK, "{html}");
    let row = &html[html
        .find(&format!("<tr data-run=\"{id}\">"))
        .expect("run row")..];
    let row = &row[..row.find("</tr>").unwrap()];
    assert!(row.contains(&commit_link), "{row}");
    assert!(row.contains(&pr_link), "{row}");
    assert!(
        row.contains(&format!("<a href=\"/runs/{id}\">{id}</a>")),
        "{row}"
    );
    assert!(html.contains("<span class=\"pr\">#8</span>"), "{html}");
    assert!(!html.contains("javascript:"), "{html}");
    assert!(!html.contains("<img"), "{html}");
    assert!(html.contains("&quot;&gt;&lt;img src=x"), "{html}");
    // Runs without a pull request or commit say so.
    assert_eq!(html.matches("<a class=\"pr\"").count(), 1, "{html}");
    assert_eq!(html.matches("<a class=\"commit\"").count(), 3, "{html}");

    // The JSON of the runs and of one run.
    let (_, v) = get_json(&state, "/v1/runs").await;
    let listed = v["runs"].as_array().unwrap();
    let r = listed.iter().find(|r| r["id"] == id).unwrap();
    assert_eq!(
        r["pull_request"],
        serde_json::json!({"number": 7, "url": PR_URL})
    );
    assert_eq!(r["commit_url"], commit_url.as_str());
    assert_eq!(
        listed[0]["pull_request"]["url"], "javascript:alert(1)",
        "stored as given"
    );
    assert_eq!(
        listed[0]["commit_url"],
        serde_json::Value::Null,
        "not a commit id"
    );
    assert_eq!(listed[2]["pull_request"], serde_json::Value::Null);
    let (status, one) = get_json(&state, &format!("/v1/runs/{id}")).await;
    assert_eq!(status, StatusCode::OK, "{one}");
    assert_eq!(one["record"]["pull_request"]["number"], 7);
    assert_eq!(one["record"]["pull_request"]["url"], PR_URL);
    assert_eq!(one["record"]["commit_url"], commit_url.as_str());
    assert_eq!(one["record"]["commit_sha"], PR_SHA, "existing fields kept");

    // The bucket page's quota history: the change, its run, commit and pull request.
    let (status, html) = get(&state, "/buckets/payments/gw?window=1h").await;
    assert_eq!(status, StatusCode::OK, "{html}");
    let table = &html[html.find("id=\"quota-history\"").expect("quota history")..];
    let row = &table[table.find("<tbody><tr>").unwrap()..];
    let row = &row[..row.find("</tr>").unwrap()];
    assert!(
        row.contains(&format!("<a href=\"/runs/{id}\">{id}</a>")),
        "{row}"
    );
    assert!(row.contains(&commit_link), "{row}");
    assert!(row.contains(&pr_link), "{row}");
    let (_, v) = get_json(&state, "/v1/shadow/payments/gw?window=1h").await;
    assert_eq!(
        v["quota_history"][0]["pull_request"],
        serde_json::json!({"number": 7, "url": PR_URL})
    );

    // Without a forge: plain SHAs, no commit link; the pull request keeps its stored page.
    let plain = AppState::with_store(state.store().unwrap());
    let (_, html) = get(&plain, "/").await;
    assert!(!html.contains("class=\"commit\""), "{html}");
    assert!(html.contains(&format!("<code title=\"{PR_SHA}\">c0ffeec0ffee</code>")));
    assert!(html.contains(&pr_link), "{html}");
    let (_, v) = get_json(&plain, &format!("/v1/runs/{id}")).await;
    assert_eq!(v["record"]["commit_url"], serde_json::Value::Null);
}

/// A change of `payments/gw` as a run records it.
fn change(
    kind: &str,
    limit: f64,
    before: f64,
    state: crate::store::ChangeState,
) -> crate::store::QuotaRecord {
    crate::store::QuotaRecord {
        service: "payments".into(),
        bucket: "gw".into(),
        change: kind.parse().unwrap(),
        limit_rps: Some(limit),
        previous_limit_rps: Some(before),
        mode: Some("enforce".into()),
        policy: Some("peak".into()),
        commit_sha: Some(PR_SHA.into()),
        state,
        evidence: "{}".into(),
        recorded_at: Utc::now(),
        pr_number: Some(7),
        pr_url: Some(PR_URL.into()),
    }
}

/// The quota history tells a proposal (pushed to the pull-request branch, waiting for review)
/// from a change of the limit in force.
#[tokio::test]
async fn quota_history_shows_proposals_as_proposals() {
    use crate::store::ChangeState::{Applied, Proposed};
    let dir = tempfile::tempdir().unwrap();
    let store = Store::connect("sqlite://rlc.db", dir.path()).await.unwrap();
    let changes = [
        change("raised", 150.0, 100.0, Applied),
        change("lowered", 120.0, 150.0, Proposed),
    ];
    store
        .record_run(&run("success", 0, Some(PR_SHA), None), &changes)
        .await
        .unwrap();
    let (status, html) = get(
        &AppState::with_store(store),
        "/buckets/payments/gw?window=1h",
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{html}");
    let table = &html[html.find("id=\"quota-history\"").expect("quota history")..];
    let body = &table[table.find("<tbody>").unwrap() + 7..table.find("</tbody>").unwrap()];
    let rows: Vec<&str> = body.split("</tr>").filter(|r| !r.is_empty()).collect();
    assert_eq!(rows.len(), 2, "{body}");
    let row = |change: &str| {
        *rows
            .iter()
            .find(|r| r.contains(&format!(">{change}")))
            .unwrap_or_else(|| panic!("no {change} row: {body}"))
    };
    let proposed = row("lowered");
    assert!(
        proposed.starts_with("<tr class=\"proposed\">"),
        "{proposed}"
    );
    assert!(proposed.contains(">lowered (proposed)</td>"), "{proposed}");
    let applied = row("raised");
    assert!(applied.starts_with("<tr><td"), "no class: {applied}");
    assert!(applied.contains("<td>raised</td>"), "{applied}");
    assert!(!applied.contains("proposed"), "{applied}");
}

/// Links percent-encode everything but RFC 3986 unreserved characters, as the PR body does.
#[test]
fn link_segments_keep_only_unreserved_characters() {
    for b in 0u8..=127 {
        let c = b as char;
        let want = if c.is_ascii_alphanumeric() || "-._~".contains(c) {
            c.to_string()
        } else {
            format!("%{b:02X}")
        };
        assert_eq!(encoded(&c.to_string()).to_string(), want, "{b}");
    }
    assert_eq!(encoded("é/ü").to_string(), "%C3%A9%2F%C3%BC");
    assert_eq!(
        encoded("a b&c").to_string(),
        crate::gitops::summary::url_segment("a b&c")
    );
}

/// The operator's view: a config repo whose base branch has `payments` (five buckets) and a
/// store whose reports disagree with it in the ways that used to mislead.
struct OperatorView {
    _dir: tempfile::TempDir,
    state: AppState,
    /// The run that raised gw to 173.
    run_id: i64,
}

const PAYMENTS_YAML: &str = "service: payments
buckets:
  - name: gw
    limit_rps: 173
    mode: shadow
    policy: peak
  - name: steady
    limit_rps: 100
    mode: shadow
  - name: enforced.api-gateway
    limit_rps: 100
    mode: enforce
  - name: quiet-bucket
    limit_rps: 50
    mode: enforce
  - name: old
    limit_rps: 100
    mode: shadow
";

/// A config repo (git, branch main) with `files`, and a state serving it with `store`.
fn config_state(dir: &std::path::Path, store: Store, files: &[(&str, &str)]) -> AppState {
    config_state_with(
        dir,
        store,
        files,
        "history:\n  prometheus:\n    url: http://127.0.0.1:9\n    query: up\nconfig_repo:\n  path: wc\n",
    )
}

/// [`config_state`] with this rlc.yaml.
fn config_state_with(
    dir: &std::path::Path,
    store: Store,
    files: &[(&str, &str)],
    rlc_yaml: &str,
) -> AppState {
    let wc = dir.join("wc");
    for (path, text) in files {
        let p = wc.join(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }
    let git = |args: &[&str]| test_support::git::git(&wc, args).unwrap();
    git(&["init", "-q", "-b", "main"]);
    git(&["add", "-A"]);
    git(&[
        "-c",
        "user.name=t",
        "-c",
        "user.email=t@example.com",
        "commit",
        "-q",
        "-m",
        "buckets",
    ]);
    let cfg: schema::DaemonConfig = schema::parse_str(std::path::Path::new("rlc.yaml"), rlc_yaml)
        .unwrap()
        .value;
    let cache = std::sync::Arc::new(crate::history::snapshot::HistoryCache::new(
        cfg.clone(),
        dir,
    ));
    let slot = crate::serve::StoreSlot::with(store);
    AppState::from_parts(crate::serve::AppParts {
        quotas: Some(std::sync::Arc::new(
            crate::serve::quotas::Quotas::new(cfg, dir, cache, 4, slot.clone()).unwrap(),
        )),
        store: slot,
        links: Links::from_forge(Some(&forge("kind: github\nrepo: acme/config\n"))),
        ..Default::default()
    })
}

/// The store of [`OperatorView`]: in the last minute, `payments/enforced.api-gateway`
/// (enforced) really dropped a third, `payments/gw` (shadow) would drop a third against the
/// 98.4 its reports still carry although a run raised it to 173, `maps/geo` (not in the config
/// repo) would drop a sixth, `payments/steady` is fine; `payments/old` last reported 40
/// minutes ago; `payments/quiet-bucket` never reported. A caller-wide override acts on gw and
/// steady.
async fn operator_view() -> OperatorView {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::connect("sqlite://rlc.db", dir.path()).await.unwrap();
    let now = crate::store::minute_of(Utc::now());
    let old = now - chrono::Duration::minutes(40);
    let reports = vec![
        zone_minute(
            1,
            now,
            ("payments", "enforced.api-gateway", "global", "enforce"),
            150.0,
            100.0,
        ),
        zone_minute(1, now, ("payments", "gw", "global", "shadow"), 147.6, 98.4),
        zone_minute(1, now, ("maps", "geo", "global", "shadow"), 120.0, 100.0),
        zone_minute(
            1,
            now,
            ("payments", "steady", "global", "shadow"),
            90.0,
            100.0,
        ),
        zone_minute(1, old, ("payments", "old", "global", "shadow"), 50.0, 100.0),
    ];
    store.insert_reports(&reports, Utc::now()).await.unwrap();
    let list = crate::push::OverrideList {
        overrides: vec![crate::push::ActiveOverride {
            id: "ov-7".into(),
            reason: "INC-7 retry storm from web".into(),
            created_at: (Utc::now() - chrono::Duration::minutes(10)).timestamp(),
            expires_at: (Utc::now() + chrono::Duration::hours(1)).timestamp(),
            who: "alice".into(),
            limit_rps: Some(50.0),
            drop_ratio: None,
            shed_below: None,
            affects: ["gw", "steady"]
                .into_iter()
                .map(|b| crate::push::OverrideTarget {
                    service: "payments".into(),
                    bucket: b.into(),
                    created: false,
                })
                .collect(),
        }],
    };
    store
        .record_overrides("default", &list, Utc::now())
        .await
        .unwrap();
    let mut raised = run(
        "held",
        1,
        Some("0123456789abcdef0123456789abcdef01234567"),
        None,
    );
    raised.summary = "rlc run (schedule): held\n  payments: raised gw 98.4 → 173\n  needs review: \
                      payments/steady lowered (decrease held until the decrease interval)"
        .into();
    let q = crate::store::QuotaRecord {
        service: "payments".into(),
        bucket: "gw".into(),
        change: rlc_plan::change::ChangeKind::Raised,
        limit_rps: Some(173.0),
        previous_limit_rps: Some(98.4),
        mode: Some("shadow".into()),
        policy: Some("peak".into()),
        commit_sha: raised.commit_sha.clone(),
        state: crate::store::ChangeState::Applied,
        evidence: "{}".into(),
        recorded_at: Utc::now(),
        pr_number: None,
        pr_url: None,
    };
    let run_id = store.record_run(&raised, &[q]).await.unwrap();
    let state = config_state(
        dir.path(),
        store,
        &[("buckets/payments.yaml", PAYMENTS_YAML)],
    );
    OperatorView {
        _dir: dir,
        state,
        run_id,
    }
}

/// The `data-bucket` of each overview row, in order.
fn row_buckets(html: &str) -> Vec<String> {
    html.split("<tr class=\"")
        .skip(1)
        .filter_map(|r| r.split("data-bucket=\"").nth(1))
        .filter_map(|r| r.split('"').next())
        .map(str::to_string)
        .collect()
}

#[tokio::test]
async fn overview_lists_every_bucket_by_attention() {
    let v = operator_view().await;
    let (status, html) = get(&v.state, "/?window=1h").await;
    assert_eq!(status, StatusCode::OK, "{html}");
    // Every bucket of the config repo, and the reported one that is not in it, most urgent
    // first: really dropping, would drop (largest share first), stale, silent, fine.
    assert_eq!(
        row_buckets(&html),
        [
            "enforced.api-gateway",
            "gw",
            "geo",
            "old",
            "quiet-bucket",
            "steady"
        ],
        "{html}"
    );
    // The enforced bucket that dropped a third says so, not "ok".
    assert!(
        html.contains(r#"<span class="badge dropping">dropping 33.33% of requests</span>"#),
        "{html}"
    );
    assert!(html.contains(r#"<span class="badge would-throttle">would throttle 33.33%</span>"#));
    // 40 minutes before the minute the fixture was built in: 41 when the page is rendered in
    // the next minute (a full run once crossed it).
    assert!(
        ["40", "41"].iter().any(|m| html.contains(&format!(
            r#"<span class="badge stale">stale: last report {m} min ago</span>"#
        ))),
        "{html}"
    );
    assert!(html.contains(r#"<span class="badge silent">no reports in the last 1h</span>"#));
    assert!(html.contains("not in the config repo"), "maps/geo");
    // The limit in force is the config repo's; the reports' older one is named as such.
    let gw = html
        .split("data-bucket=\"gw\"")
        .nth(1)
        .unwrap()
        .split("</tr>")
        .next()
        .unwrap();
    assert!(gw.contains(">173<div class=\"muted small\""), "{gw}");
    assert!(gw.contains("reported 98.4"), "{gw}");
    // The caller-wide override, as what it is.
    assert!(gw.contains("override (caller-wide, 2 buckets)"), "{gw}");
    assert!(gw.contains("INC-7 retry storm from web"), "{gw}");
    // Names break only after separators, never inside a word.
    assert!(html.contains("enforced.<wbr>api-<wbr>gateway"), "{html}");
    assert!(!html.contains("overflow-wrap: anywhere"));
    assert!(html.contains("<b>1</b> dropping"), "{html}");
    // Runs link to their page.
    assert!(
        html.contains(&format!("href=\"/runs/{}\"", v.run_id)),
        "{html}"
    );

    // Filters: by mode, by verdict, by service; a bad value names the accepted ones.
    let (_, html) = get(&v.state, "/?mode=enforce").await;
    assert_eq!(row_buckets(&html), ["enforced.api-gateway", "quiet-bucket"]);
    assert!(html.contains(r#"<option value="enforce" selected>"#));
    let (_, html) = get(&v.state, "/?verdict=would-throttle").await;
    assert_eq!(row_buckets(&html), ["gw", "geo"]);
    let (_, html) = get(&v.state, "/?service=maps").await;
    assert_eq!(row_buckets(&html), ["geo"]);
    let (_, html) = get(&v.state, "/?verdict=silent&service=payments&mode=enforce").await;
    assert_eq!(row_buckets(&html), ["quiet-bucket"]);
    let (status, html) = get(&v.state, "/?verdict=bad").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        html.contains("verdict <code>bad</code>: expected one of dropping, would-throttle"),
        "{html}"
    );
    let (status, _) = get(&v.state, "/?mode=both").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}

/// The buckets `GET /v1/shadow` lists (those that reported, then the silent ones), sorted.
fn json_buckets(v: &serde_json::Value) -> Vec<String> {
    let mut names: Vec<String> = ["buckets", "silent"]
        .iter()
        .flat_map(|k| v[k].as_array().unwrap().iter())
        .map(|b| b["bucket"].as_str().unwrap().to_string())
        .collect();
    names.sort();
    names
}

#[tokio::test]
async fn shadow_json_lists_what_the_overview_lists_with_its_filters() {
    let v = operator_view().await;
    for query in [
        "window=1h",
        "mode=enforce",
        "mode=shadow",
        "verdict=would-throttle",
        "verdict=silent",
        "verdict=dropping",
        "verdict=stale",
        "service=maps",
        "verdict=silent&service=payments&mode=enforce",
    ] {
        let (status, html) = get(&v.state, &format!("/?{query}")).await;
        assert_eq!(status, StatusCode::OK, "{html}");
        let mut page = row_buckets(&html);
        page.sort();
        let (status, json) = get_json(&v.state, &format!("/v1/shadow?{query}")).await;
        assert_eq!(status, StatusCode::OK, "{json}");
        assert_eq!(json_buckets(&json), page, "{query}: {json}");
    }
    // Every bucket carries the overview's verdict; a silent one its limit and mode in force.
    let (_, all) = get_json(&v.state, "/v1/shadow?window=1h").await;
    let verdict_of = |name: &str| {
        ["buckets", "silent"]
            .iter()
            .flat_map(|k| all[k].as_array().unwrap().iter())
            .find(|b| b["bucket"] == name)
            .map(|b| (b["verdict"].clone(), b["verdict_text"].clone()))
            .unwrap()
    };
    assert_eq!(
        verdict_of("enforced.api-gateway"),
        (
            serde_json::json!("dropping"),
            serde_json::json!("dropping 33.33% of requests")
        )
    );
    assert_eq!(
        verdict_of("quiet-bucket"),
        (
            serde_json::json!("silent"),
            serde_json::json!("no reports in the last 1h")
        )
    );
    let quiet = &all["silent"][0];
    assert_eq!(quiet["mode"], "enforce", "{all}");
    assert!(quiet["limit_rps"].as_f64().is_some(), "{all}");
    assert!(all["config_error"].is_null(), "{all}");
    let (status, e) = get_json(&v.state, "/v1/shadow?verdict=bad").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        e.to_string()
            .contains("expected one of dropping, would-throttle"),
        "{e}"
    );
    let (status, _) = get_json(&v.state, "/v1/shadow?mode=both").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn bucket_page_shows_the_limit_in_force_overrides_and_readable_charts() {
    let v = operator_view().await;
    let (status, html) = get(&v.state, "/buckets/payments/gw?window=1h").await;
    assert_eq!(status, StatusCode::OK, "{html}");
    // The limit in force is the one its quota history ends with, not the reports'.
    assert!(
        html.contains(r#"<span class="big" id="limit-in-force">173 requests/s</span>"#),
        "{html}"
    );
    assert!(
        html.contains(r#"id="reported-limit""#) && html.contains("says 98.4"),
        "{html}"
    );
    assert!(
        html.contains("href=\"https://github.com/acme/config/commit/"),
        "{html}"
    );
    // The caller-wide override is shown as caller-wide, not as the bucket's limit.
    let ov = html
        .split("id=\"overrides\"")
        .nth(1)
        .expect("overrides section");
    assert!(ov.contains("<b>caller-wide</b>: acts on 2 buckets"), "{ov}");
    assert!(ov.contains("INC-7 retry storm from web"));
    // What it does, who added it, and its expiry (not the last sighting plus five minutes).
    // (The fixture's "in an hour" was taken a moment ago: this minute or the one before.)
    let in_an_hour = |ago: i64| {
        (Utc::now() + chrono::Duration::hours(1) - chrono::Duration::minutes(ago))
            .format("%H:%M")
            .to_string()
    };
    assert!(
        ov.contains("<strong>limit 50 rps</strong>") && ov.contains(" · by alice"),
        "{ov}"
    );
    assert!(
        ov.contains("expires ") && (ov.contains(&in_an_hour(0)) || ov.contains(&in_an_hour(1))),
        "{ov}"
    );
    // The chart: unit, legend, several labelled times, the limit as a step line, one minute
    // of data drawn as visible markers, admitted traffic drawn.
    let svg = &html[html.find("<svg").unwrap()..html.find("</svg>").unwrap()];
    assert!(svg.contains(">requests/s</text>"), "{svg}");
    for legend in [
        ">offered</text>",
        ">admitted</text>",
        ">limit</text>",
        ">virtual drops</text>",
    ] {
        assert!(svg.contains(legend), "{legend}: {svg}");
    }
    let times = svg.matches("class=\"tick time\"").count();
    assert!((4..=9).contains(&times), "{times} time ticks: {svg}");
    assert!(svg.contains(">UTC</text>"));
    let limit = attr(svg, svg.find("data-series=\"limit\"").unwrap() - 60, "d");
    let pts = path_points(limit);
    assert_eq!(pts.len(), 2, "one step held flat: {limit}");
    assert_eq!(pts[0].2, pts[1].2, "{limit}");
    assert!(pts[1].1 > pts[0].1, "{limit}");
    assert!(svg.contains("<circle class=\"marker offered\""), "{svg}");
    assert!(svg.contains("<circle class=\"marker admitted\""), "{svg}");
    assert!(svg.contains("data-series=\"admitted\""));
    // The quota history links to the run's page.
    assert!(
        html.contains(&format!("href=\"/runs/{}\"", v.run_id)),
        "{html}"
    );

    // A bucket of the config repo without a report: 200, its limit, no chart.
    let (status, html) = get(&v.state, "/buckets/payments/quiet-bucket").await;
    assert_eq!(status, StatusCode::OK, "{html}");
    assert!(html.contains(">50 requests/s</span>"), "{html}");
    let (status, j) = get_json(&v.state, "/v1/shadow/payments/quiet-bucket").await;
    assert_eq!(status, StatusCode::OK, "{j}");
    assert_eq!(j["in_force"]["limit_rps"], 50.0);
    assert!(j["readiness"].is_null());
    let (_, j) = get_json(&v.state, "/v1/shadow/payments/gw").await;
    assert_eq!(j["overrides"][0]["buckets"], 2, "{j}");
    assert_eq!(j["in_force"]["limit_rps"], 173.0, "{j}");
    // An unknown bucket: 404, an HTML page for the page and problem details for the JSON.
    let (status, html) = get(&v.state, "/buckets/payments/nope").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(
        html.contains("no bucket <code>nope</code> of service <code>payments</code>"),
        "{html}"
    );
    let resp = app(v.state.clone())
        .oneshot(
            Request::get("/v1/shadow/payments/nope")
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
    assert_eq!(resp.headers()["content-type"], "application/problem+json");
}

#[test]
fn rate_ticks_are_round_and_above_the_highest_value() {
    for (max, want_step) in [
        (144.0, 50.0),
        (98.4, 25.0),
        (1.0, 0.25),
        (3180.0, 1000.0),
        (0.0, 0.25),
    ] {
        let (ticks, top) = chart::rate_ticks(max);
        assert_eq!(ticks[0], 0.0);
        assert_eq!(ticks[1], want_step, "{max}: {ticks:?}");
        assert!((4..=7).contains(&ticks.len()), "{max}: {ticks:?}");
        assert!(
            top >= max && top == *ticks.last().unwrap(),
            "{max}: {ticks:?}"
        );
    }
}

#[test]
fn time_ticks_are_round_and_few() {
    let t = |h: u32, m: u32| Utc.with_ymd_and_hms(2026, 11, 30, h, m, 0).unwrap();
    let ticks = chart::time_ticks(t(10, 3), t(11, 3));
    let labels: Vec<&str> = ticks.iter().map(|(_, l)| l.as_str()).collect();
    assert_eq!(
        labels,
        ["10:10", "10:20", "10:30", "10:40", "10:50", "11:00"]
    );
    let ticks = chart::time_ticks(t(10, 0), t(10, 0) + chrono::Duration::days(30));
    assert!((4..=8).contains(&ticks.len()), "{ticks:?}");
    assert!(
        ticks[0].1.starts_with("Dec ") || ticks[0].1.starts_with("Nov "),
        "{ticks:?}"
    );
    let ticks = chart::time_ticks(t(10, 0), t(10, 15));
    assert_eq!(ticks.len(), 8, "every two minutes: {ticks:?}");
}

#[tokio::test]
async fn run_page_says_what_changed_and_why_it_was_held() {
    let v = operator_view().await;
    let (status, html) = get(&v.state, &format!("/runs/{}", v.run_id)).await;
    assert_eq!(status, StatusCode::OK, "{html}");
    assert!(
        html.contains(r#"<span class="badge held" id="status">held</span>"#),
        "{html}"
    );
    let changes = html.split("id=\"changes\"").nth(1).unwrap();
    assert!(changes.contains("data-bucket=\"gw\""), "{changes}");
    assert!(
        changes.contains(">98.4</td>") && changes.contains(">173</td>"),
        "{changes}"
    );
    let held = html.split("id=\"held\"").nth(1).expect("held section");
    assert!(
        held.contains("needs review: payments/steady lowered"),
        "{held}"
    );
    assert!(html.contains(
        "href=\"https://github.com/acme/config/commit/0123456789abcdef0123456789abcdef01234567\""
    ));
    let (status, html) = get(&v.state, "/runs/999999").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(html.contains("no run with id 999999"), "{html}");
    assert!(html.starts_with("<!DOCTYPE html>"));
}

/// Headless Chromium on the overview, a bucket page, a run page and the API page: what a
/// person sees, with screenshots in the test's output (`target/screenshots/`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_pages_in_headless_chromium() {
    let v = operator_view().await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(axum::serve(listener, app(v.state.clone())).into_future());
    let pages = [
        ("operator-overview", format!("{base}/?window=1h")),
        (
            "operator-bucket",
            format!("{base}/buckets/payments/gw?window=1h"),
        ),
        ("operator-run", format!("{base}/runs/{}", v.run_id)),
        ("operator-api-docs", format!("{base}/docs#op-get-v1-shadow")),
    ];
    let dom = chromium_run(&["--dump-dom".into()], &pages[0].1).await;
    assert_eq!(
        row_buckets(&dom),
        [
            "enforced.api-gateway",
            "gw",
            "geo",
            "old",
            "quiet-bucket",
            "steady"
        ]
    );
    assert!(dom.contains("dropping 33.33% of requests"), "{dom}");
    let dom = chromium_run(&["--dump-dom".into()], &pages[1].1).await;
    assert!(dom.contains("173 requests/s"), "{dom}");
    assert!(dom.contains("caller-wide"), "{dom}");
    assert!(dom.contains("requests/s</text>"), "{dom}");
    let dom = chromium_run(&["--dump-dom".into()], &pages[2].1).await;
    assert!(
        dom.contains("needs review: payments/steady lowered"),
        "{dom}"
    );
    // The API page renders the served document with its script (a virtual time budget lets
    // the fetch finish before the DOM is dumped): every operation, with examples.
    let dom = chromium_run(
        &["--dump-dom".into(), "--virtual-time-budget=10000".into()],
        &pages[3].1,
    )
    .await;
    let ops: usize = dom
        .split("data-operations=\"")
        .nth(1)
        .and_then(|r| r.split('"').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("operations rendered: {dom}"));
    let doc = crate::serve::openapi::document();
    let expected: usize = doc
        .paths
        .iter()
        .flat_map(|p| p.paths.values())
        .map(|i| match i {
            aide::openapi::ReferenceOr::Item(i) => [
                i.get.is_some(),
                i.post.is_some(),
                i.put.is_some(),
                i.delete.is_some(),
            ]
            .into_iter()
            .filter(|b| *b)
            .count(),
            _ => 0,
        })
        .sum();
    assert_eq!(ops, expected, "{dom}");
    assert!(dom.contains("id=\"op-get-v1-shadow\""), "{dom}");
    assert!(dom.contains("class=\"example\""), "{dom}");
    assert!(dom.contains("Send GET"), "{dom}");
    // Trying a GET from the page: `?send` sends the operation's request at once; the answer
    // (status, type, body) is shown in the page.
    let dom = chromium_run(
        &["--dump-dom".into(), "--virtual-time-budget=10000".into()],
        &format!("{base}/docs?send#op-get-v1-runs"),
    )
    .await;
    let result = dom
        .split("id=\"op-get-v1-runs\"")
        .nth(1)
        .and_then(|s| s.split("<pre class=\"result\">").nth(1))
        .and_then(|s| s.split("</pre>").next())
        .unwrap_or_else(|| panic!("the answer shown: {dom}"));
    assert!(result.starts_with("GET /v1/runs\n200 OK"), "{result}");
    assert!(
        result.contains("content-type: application/json"),
        "{result}"
    );
    assert!(
        result.contains("\"status\": \"held\""),
        "the run in the answer: {result}"
    );
    let dir = screenshot_dir();
    for (name, url) in pages {
        let file = dir.join(format!("{name}.png"));
        chromium_run(
            &[
                format!("--screenshot={}", file.display()),
                "--window-size=1280,2000".into(),
                "--hide-scrollbars".into(),
                "--virtual-time-budget=5000".into(),
            ],
            &url,
        )
        .await;
        assert!(
            std::fs::metadata(&file).unwrap().len() > 10_000,
            "{}",
            file.display()
        );
        println!("screenshot: {}", file.display());
    }
}

/// The bucket page charts the history its quota is computed from: eight days of 10-minute
/// samples (one burst), at most 360 points each holding the busiest sample of its step, with
/// the level the plan read from it and the limit it proposes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bucket_page_charts_the_history_the_quota_is_computed_from() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::connect("sqlite://rlc.db", dir.path()).await.unwrap();
    let end = Utc::now().timestamp() / 600 * 600;
    let burst = end - 3 * 86_400;
    let mut csv = String::from("ts,service,caller,procedure,rps\n");
    let mut t = end - 8 * 86_400;
    while t <= end {
        let rps = if t == burst { 300.0 } else { 100.0 };
        csv.push_str(&format!("{t},payments,web,charge,{rps}\n"));
        t += 600;
    }
    std::fs::write(dir.path().join("history.csv"), csv).unwrap();
    let state = config_state_with(
        dir.path(),
        store,
        &[
            (
                "buckets/payments.yaml",
                "service: payments\nbuckets:\n  - name: web.charge\n    caller: web\n    procedure: charge\n    limit_rps: 90\n    mode: shadow\n    policy: peak\n",
            ),
            ("rlc/policies.yaml", "default:\n  policy: peak\n  headroom: 0.25\n"),
        ],
        "history:\n  file: history.csv\n  lookback: 8d\n  step: 10m\nconfig_repo:\n  path: wc\n",
    );
    // Before any pull: the page says so, nothing is pulled for it.
    let (_, html) = get(&state, "/buckets/payments/web.charge").await;
    assert!(html.contains(r#"id="no-lookback""#), "{html}");
    assert!(html.contains("No history pulled yet"), "{html}");
    // The quota API computes a plan (pulling the history).
    let (status, q) = get_json(&state, "/v1/quotas").await;
    assert_eq!(status, StatusCode::OK, "{q}");
    let (status, v) = get_json(&state, "/v1/shadow/payments/web.charge").await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let l = &v["lookback"];
    let points = l["points"].as_array().unwrap();
    assert!(
        points.len() <= 360 && points.len() >= 280,
        "{}",
        points.len()
    );
    assert_eq!(l["step_secs"].as_i64().unwrap() % 600, 0);
    let top = points.iter().filter_map(|p| p.as_f64()).fold(0.0, f64::max);
    assert_eq!(top, 300.0, "the burst stays visible: {l}");
    let planned = q["buckets"][0]["limit_rps"].as_f64().unwrap();
    assert_eq!(l["computed"]["limit_rps"].as_f64(), Some(planned), "{l}");
    assert_eq!(l["computed"]["policy"], "peak");
    assert_eq!(l["computed"]["headroom"], 0.25, "{l}");
    let stat = l["computed"]["statistic_rps"]
        .as_f64()
        .expect("the statistic");
    let (_, html) = get(&state, "/buckets/payments/web.charge?window=1h").await;
    let chart = html
        .split("id=\"lookback-chart\"")
        .nth(1)
        .expect("lookback chart");
    let chart = &chart[..chart.find("</svg>").unwrap()];
    assert!(chart.contains("data-level=\"statistic\""), "{chart}");
    assert!(chart.contains("data-level=\"proposed\""), "{chart}");
    assert!(
        chart.contains(&format!("proposed limit {} (headroom +25%)", rate(planned))),
        "{chart}"
    );
    // A rail that moved the policy's limit is named with the figure it moved it from.
    if let Some(from) = l["computed"]["capped_from_rps"].as_f64() {
        assert!(
            chart.contains(&format!("capped from {} by a rail", rate(from))),
            "{chart}"
        );
    }
    if planned > stat {
        assert!(chart.contains("<rect class=\"headroom\""), "{chart}");
    }
    assert!(chart.matches("class=\"tick time\"").count() >= 4, "{chart}");
    assert!(chart.contains(">requests/s</text>"));
    // For a person to look at: the page in a browser, in the test's screenshots.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!(
        "http://{}/buckets/payments/web.charge?window=7d",
        listener.local_addr().unwrap()
    );
    tokio::spawn(axum::serve(listener, app(state)).into_future());
    let file = screenshot_dir().join("bucket-lookback.png");
    chromium_run(
        &[
            format!("--screenshot={}", file.display()),
            "--window-size=1280,1400".into(),
            "--hide-scrollbars".into(),
        ],
        &url,
    )
    .await;
    assert!(std::fs::metadata(&file).unwrap().len() > 10_000);
}

/// A rollout of `payments/web.charge` from 600 to the base branch's 300 (`base`), baking in
/// region eu (stage 1 of 2) for 30 minutes of a one-hour bake.
fn baking_rollout(base: &schema::Bucket) -> crate::rollout::Rollout {
    let now_ms = Utc::now().timestamp_millis();
    let mut old = base.clone();
    old.limit_rps = 600.0;
    crate::rollout::Rollout {
        id: "rlc-web-charge".into(),
        service: "payments".into(),
        bucket: "web.charge".into(),
        old: Some(old),
        new: base.clone(),
        change: "lowered 600 -> 300 rps".into(),
        version: "abc".into(),
        settings: schema::RolloutSpec::default().resolved(),
        stages: vec![vec!["eu".into()], vec!["us".into()]],
        stage: 0,
        stage_started_ms: Some(now_ms - 30 * 60_000),
        stage_began_ms: Some(now_ms - 30 * 60_000),
        state: crate::rollout::RolloutState::Baking,
        reason: None,
        fingerprint: "fp".into(),
        created_ms: now_ms - 30 * 60_000,
        updated_ms: now_ms - 30 * 60_000,
        figures: Default::default(),
        revert: None,
        revert_pending: false,
        settled: false,
        fleet: None,
        rev: None,
    }
}

/// While a lowered limit (600 → 300) bakes as a candidate, the controllers enforce 600: every
/// view says 600 is in force and shows 300 as a candidate with its stage and bake progress;
/// once the rollout is done, 300 is in force and no candidate is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_baking_candidate_is_shown_as_a_candidate_beside_the_limit_in_force() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::connect("sqlite://rlc.db", dir.path()).await.unwrap();
    let end = Utc::now().timestamp() / 600 * 600;
    let mut csv = String::from("ts,service,caller,procedure,rps\n");
    let mut t = end - 2 * 86_400;
    while t <= end {
        csv.push_str(&format!("{t},payments,web,charge,100\n"));
        t += 600;
    }
    std::fs::write(dir.path().join("history.csv"), csv).unwrap();
    let yaml = "service: payments\nbuckets:\n  - name: web.charge\n    caller: web\n    procedure: charge\n    limit_rps: 300\n    mode: enforce\n    policy: peak\n";
    let file: schema::BucketFile = schema::parse_str(std::path::Path::new("payments.yaml"), yaml)
        .unwrap()
        .value;
    let mut rollout = baking_rollout(&file.buckets[0]);
    assert!(store.insert_rollout(&rollout.row()).await.unwrap());
    let state = config_state_with(
        dir.path(),
        store.clone(),
        &[
            ("buckets/payments.yaml", yaml),
            ("rlc/policies.yaml", "default:\n  policy: peak\n"),
        ],
        "history:\n  file: history.csv\n  lookback: 2d\n  step: 10m\nconfig_repo:\n  path: wc\n",
    );
    let close = |v: &serde_json::Value, want: f64| (v.as_f64().unwrap() - want).abs() < 0.02;

    // The bucket page and its JSON twin.
    let (status, html) = get(&state, "/buckets/payments/web.charge").await;
    assert_eq!(status, StatusCode::OK, "{html}");
    assert!(
        html.contains(r#"<span class="big" id="limit-in-force">600 requests/s</span>"#),
        "{html}"
    );
    let cand = html.split("id=\"candidate\"").nth(1).expect("candidate");
    let cand = &cand[..cand.find("</p>").unwrap()];
    assert!(cand.contains("300 requests/s"), "{cand}");
    assert!(cand.contains("stage 1 of 2"), "{cand}");
    assert!(cand.contains("50 % of the 1 h bake"), "{cand}");
    let (status, j) = get_json(&state, "/v1/shadow/payments/web.charge").await;
    assert_eq!(status, StatusCode::OK, "{j}");
    assert_eq!(j["in_force"]["limit_rps"], 600.0, "{j}");
    assert_eq!(j["candidate"]["limit_rps"], 300.0, "{j}");
    assert_eq!(j["candidate"]["stage"], 1, "{j}");
    assert_eq!(j["candidate"]["stages"], 2, "{j}");
    assert_eq!(j["candidate"]["regions"], serde_json::json!(["eu"]), "{j}");
    assert!(close(&j["candidate"]["bake_progress"], 0.5), "{j}");
    assert_eq!(j["rollout"]["state"], "baking", "{j}");

    // The overview: 600 in force, the candidate marked as one.
    let (_, html) = get(&state, "/?window=1h").await;
    let row = html
        .split("data-bucket=\"web.charge\"")
        .nth(1)
        .unwrap()
        .split("</tr>")
        .next()
        .unwrap();
    assert!(row.contains(">600<"), "{row}");
    assert!(
        row.contains("candidate 300 · stage 1/2 · 50% baked"),
        "{row}"
    );

    // The quota API.
    let (status, q) = get_json(&state, "/v1/quotas").await;
    assert_eq!(status, StatusCode::OK, "{q}");
    let b = &q["buckets"][0];
    assert_eq!(b["name"], "web.charge", "{q}");
    assert_eq!(b["current_limit_rps"], 600.0, "{b}");
    assert_eq!(b["candidate"]["limit_rps"], 300.0, "{b}");
    assert_eq!(b["candidate"]["stage"], 1, "{b}");
    assert!(close(&b["candidate"]["bake_progress"], 0.5), "{b}");
    let planned = b["limit_rps"].as_f64().unwrap();
    assert_eq!(
        b["change"]["delta_rps"].as_f64(),
        Some(planned - 600.0),
        "{b}"
    );
    let (_, s) = get_json(&state, "/v1/quotas/payments").await;
    assert_eq!(s["buckets"][0]["current_limit_rps"], 600.0, "{s}");
    assert_eq!(s["buckets"][0]["candidate"]["limit_rps"], 300.0, "{s}");

    // Done: 300 is in force everywhere, no candidate.
    rollout.stage = 2;
    rollout.state = crate::rollout::RolloutState::Done;
    rollout.rev = Some(0);
    assert!(crate::rollout::save(&store, &mut rollout).await.unwrap());
    let (_, j) = get_json(&state, "/v1/shadow/payments/web.charge").await;
    assert_eq!(j["in_force"]["limit_rps"], 300.0, "{j}");
    assert!(j["candidate"].is_null(), "{j}");
    let (_, html) = get(&state, "/buckets/payments/web.charge").await;
    assert!(
        html.contains(r#"<span class="big" id="limit-in-force">300 requests/s</span>"#),
        "{html}"
    );
    assert!(!html.contains("id=\"candidate\""), "{html}");
    let (_, q) = get_json(&state, "/v1/quotas").await;
    assert_eq!(q["buckets"][0]["current_limit_rps"], 300.0, "{q}");
    assert!(q["buckets"][0].get("candidate").is_none(), "{q}");
}

/// A recorded change's evidence is a JSON object in both JSON answers that carry the quota
/// history, not JSON text inside a string.
#[tokio::test]
async fn quota_history_serves_the_evidence_as_an_object() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::connect("sqlite://rlc.db", dir.path()).await.unwrap();
    let mut c = change("lowered", 375.0, 500.0, crate::store::ChangeState::Applied);
    c.evidence = r#"{"capped_from":300.0,"confidence":1.0,"explain":"max 240 rps × 1.25"}"#.into();
    store
        .record_run(&run("success", 0, Some(PR_SHA), None), &[c])
        .await
        .unwrap();
    let state = config_state(
        dir.path(),
        store,
        &[("buckets/payments.yaml", PAYMENTS_YAML)],
    );
    let (status, v) = get_json(&state, "/v1/shadow/payments/gw").await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let e = &v["quota_history"][0]["evidence"];
    assert_eq!(e["capped_from"], 300.0, "{v}");
    assert_eq!(e["explain"], "max 240 rps × 1.25", "{v}");
    let (status, v) = get_json(&state, "/v1/quotas/payments/gw/history").await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let c = &v["changes"][0];
    assert_eq!(c["evidence"]["confidence"], 1.0, "{v}");
    assert_eq!(c["evidence"]["capped_from"], 300.0, "{v}");
}

/// Backticks in text shared with Markdown become code on the pages, never literal marks;
/// everything stays escaped, and an unbalanced backtick is shown as it is.
#[test]
fn backticks_in_shared_text_become_code_on_pages() {
    let html = prose("commented and labelled `rlc-rollout-aborted` on <b>#7</b>").into_string();
    assert_eq!(
        html,
        "commented and labelled <code>rlc-rollout-aborted</code> on &lt;b&gt;#7&lt;/b&gt;"
    );
    assert_eq!(prose("a ` b").into_string(), "a ` b");
    assert_eq!(prose("`<x>`").into_string(), "<code>&lt;x&gt;</code>");
}

/// A bucket whose controller counts tiers: `GET /v1/shadow/{service}/{bucket}` has one series
/// per tier with the mean rates of each minute, and the page stacks them by tier (least
/// critical at the bottom); a bucket without tier counts has neither.
#[tokio::test]
async fn bucket_answers_split_the_requests_by_tier() {
    let dir = tempfile::tempdir().unwrap();
    let store = filled_store(dir.path()).await;
    let now = Utc::now();
    let minute = crate::store::minute_of(now - chrono::Duration::minutes(3));
    // One minute: SHEDDABLE 1,800 offered, 1,000 of them virtually dropped; CRITICAL 1,200;
    // 60 requests of clients without tiers (in the whole, in no tier).
    let mut r = report(10, "payments", "tiered", 51.0, 50.0);
    let split = [
        [1800, 1800, 0, 1000],
        [0; 4],
        [1200, 1200, 0, 0],
        [0; 4],
        [60, 60, 0, 0],
    ];
    r.counts = Some(grl_wire::ReportCounts::from_tiers(&split));
    let t = minute + chrono::Duration::seconds(30);
    store.insert_reports(&at(vec![r], t), t).await.unwrap();
    let state = AppState::with_store(store);

    let (status, v) = get_json(&state, "/v1/shadow/payments/tiered?window=15m").await;
    assert_eq!(status, StatusCode::OK, "{v:#}");
    let tiers = v["tiers"].as_array().unwrap();
    let names: Vec<&str> = tiers.iter().map(|t| t["tier"].as_str().unwrap()).collect();
    assert_eq!(names, ["SHEDDABLE", "CRITICAL"]);
    assert_eq!(tiers[0]["offered"], 1800.0);
    assert_eq!(tiers[0]["dropped"], 1000.0);
    let point = |t: &serde_json::Value, at: chrono::DateTime<Utc>| {
        t["points"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["t"] == serde_json::json!(at))
            .cloned()
            .unwrap_or_else(|| panic!("no point at {at}: {t:#}"))
    };
    let shed = point(&tiers[0], minute);
    assert_eq!(shed["offered_rps"], 30.0);
    assert_eq!(shed["virtual_drop_rps"], 1000.0 / 60.0);
    assert_eq!(shed["drop_rps"], 0.0);
    assert_eq!(point(&tiers[1], minute)["offered_rps"], 20.0);
    // The minute before: no tier counted, a gap in every tier.
    let before = point(&tiers[1], minute - chrono::Duration::minutes(1));
    assert!(before["offered_rps"].is_null(), "{before}");
    // A bucket without tier counts.
    let (_, gw) = get_json(&state, "/v1/shadow/payments/gw?window=15m").await;
    assert_eq!(gw["tiers"], serde_json::json!([]));

    let (status, page) = get(&state, "/buckets/payments/tiered?window=15m").await;
    assert_eq!(status, StatusCode::OK);
    let at = page.find("id=\"tiers\"").expect("a criticality section");
    let section = &page[at..];
    assert!(section.contains("data-chart=\"offered\""), "{section}");
    // The offered chart's bars of the minute: SHEDDABLE at the bottom, CRITICAL on top of it,
    // heights in proportion (30 and 20 requests/s).
    let bar = |tier: &str| -> (f64, f64) {
        let from = section
            .find(&format!("class=\"bar tier-{}\"", tier.to_lowercase()))
            .unwrap_or_else(|| panic!("no {tier} bar: {section}"));
        let y: f64 = attr(section, from, "y").parse().unwrap();
        let h: f64 = attr(section, from, "height").parse().unwrap();
        (y, h)
    };
    let (ys, hs) = bar("SHEDDABLE");
    let (yc, hc) = bar("CRITICAL");
    assert!((ys - (yc + hc)).abs() < 0.11, "stacked: {ys} {yc} {hc}");
    assert!((hs / hc - 1.5).abs() < 0.02, "{hs} {hc}");
    assert!(
        section.contains("<td class=\"num\">60.00%</td>"),
        "{section}"
    );
    let (_, plain) = get(&state, "/buckets/payments/gw?window=15m").await;
    assert!(!plain.contains("id=\"tiers\""));
}
