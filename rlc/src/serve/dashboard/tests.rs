//! Dashboard handlers against a real SQLite store (no socket), and one real browser.

use std::future::IntoFuture;
use std::path::PathBuf;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use chrono::{TimeZone, Utc};
use tower::ServiceExt;

use super::*;
use crate::push::Report;
use crate::serve::app;

/// Bucket names come from config repos: this one must stay text everywhere.
const EVIL_BUCKET: &str = "<script>alert(\"x\")</script>";
/// A service name that tries to break out of an attribute.
const EVIL_SERVICE: &str = "x\"><img src=y onerror=alert(1)>";

/// A shadow report: virtual drops and drop ratio follow from `offered` and `limit`.
fn report(seq: i64, service: &str, bucket: &str, offered: f64, limit: f64) -> Report {
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
    }
}

/// A SQLite store with reports received now (plus one too old for a 1 h window) and two runs.
async fn filled_store(dir: &std::path::Path) -> Store {
    let store = Store::connect("sqlite://rlc.db", dir).await.unwrap();
    let now = Utc::now();
    store
        .insert_reports(
            &[report(1, "payments", "gw", 5000.0, 100.0)],
            now - chrono::Duration::hours(2),
        )
        .await
        .unwrap();
    store
        .insert_reports(
            &[
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
    assert_eq!(runs.len(), 2);
    assert_eq!(runs[0]["status"], "success");
    assert_eq!(
        runs[0]["commit_sha"],
        "0123456789abcdef0123456789abcdef01234567"
    );
    assert_eq!(runs[0]["services"][0]["service"], "payments", "parsed JSON");
    assert_eq!(runs[1]["error"], "push rejected <by> remote");
    let (_, v) = get_json(&state, "/v1/runs?limit=1").await;
    assert_eq!(v["runs"].as_array().unwrap().len(), 1);
    assert_eq!(v["runs"][0]["status"], "success");
}

#[tokio::test]
async fn without_a_store_the_pages_say_so() {
    let state = AppState::new(None, tokio::sync::mpsc::channel(1).0);
    for uri in ["/v1/shadow", "/v1/runs"] {
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
    // Manual runs keep their own rules: still refused without a token.
    let resp = app(state)
        .oneshot(Request::post("/v1/runs").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn html_dashboard_flags_buckets_and_escapes_names() {
    let dir = tempfile::tempdir().unwrap();
    let state = AppState::with_store(filled_store(dir.path()).await);
    let (status, html) = get(&state, "/").await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        html.contains(r#"<tr class="throttle" data-bucket="gw">"#),
        "{html}"
    );
    assert!(html.contains(r#"<tr class="ok" data-bucket="steady">"#));
    assert!(html.contains("33.33%"));
    assert!(html.contains("would throttle"));
    assert!(html.contains("<b>2</b> would throttle"), "gw and geo");
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
    assert!(!html.contains("second line"));

    let (status, html) = get(&state, "/?service=maps&window=6h").await;
    assert_eq!(status, StatusCode::OK);
    assert!(html.contains(r#"data-bucket="geo""#));
    assert!(!html.contains(r#"data-bucket="gw""#));
    assert!(html.contains(r#"<option value="maps" selected>"#));
    assert!(html.contains(r#"<option value="6h" selected>"#));

    let (status, html) = get(&state, "/?window=%3Cb%3E").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(!html.contains("<b>`"), "{html}");
    assert!(html.contains("window `&lt;b&gt;`"), "{html}");
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
        dom.contains(r#"<tr class="throttle" data-bucket="gw">"#),
        "{dom}"
    );
    assert!(dom.contains("would throttle"));
    // The browser parsed the evil bucket name as text: no script element in the DOM.
    assert!(!dom.contains("<script"), "{dom}");
    assert!(
        dom.contains("&lt;script&gt;alert(\"x\")&lt;/script&gt;"),
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
