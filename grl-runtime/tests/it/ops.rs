//! Operability of the daemons as real processes: `/healthz` and `/readyz` follow what the
//! controller and the aggregator can do, and the logs are JSON with `--log-format json` and
//! carry no ANSI colours when stderr is not a terminal.

use serde_json::Value;
use test_support::process::free_port;

use super::{eventually, spawn_aggregator, spawn_controller, wait_up};

/// `GET url`: status and JSON body (Null when not JSON).
async fn probe(http: &reqwest::Client, url: &str) -> Option<(u16, Value)> {
    let r = http.get(url).send().await.ok()?;
    let status = r.status().as_u16();
    let body = r.text().await.ok()?;
    Some((status, serde_json::from_str(&body).unwrap_or(Value::Null)))
}

async fn wait_probe(http: &reqwest::Client, url: &str, want: u16, what: &str) -> Value {
    let last = std::sync::Arc::new(std::sync::Mutex::new(Value::Null));
    eventually(what, || {
        let (http, url, last) = (http.clone(), url.to_string(), last.clone());
        async move {
            match probe(&http, &url).await {
                Some((s, v)) if s == want => {
                    *last.lock().unwrap() = v;
                    true
                }
                _ => false,
            }
        }
    })
    .await;
    let v = last.lock().unwrap().clone();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_follows_the_controller_and_logs_are_plain_or_json() {
    let dir = tempfile::tempdir().unwrap();
    let http = reqwest::Client::new();
    let (cport, aport) = (free_port(), free_port());
    let controller = format!("http://127.0.0.1:{cport}");

    // An aggregator whose controller is not up yet: alive, not ready.
    let _agg = spawn_aggregator(aport, &controller, "agg-ops", dir.path());
    let agg = format!("http://127.0.0.1:{aport}");
    wait_up(&format!("{agg}/healthz")).await;
    let (s, body) = probe(&http, &format!("{agg}/healthz")).await.unwrap();
    assert_eq!(s, 200);
    assert_eq!(body, Value::Null, "healthz is text");
    let (s, r) = probe(&http, &format!("{agg}/readyz")).await.unwrap();
    assert_eq!(s, 503, "{r}");
    assert_eq!(r["ready"], false);
    assert_eq!(r["checks"]["controller"]["ok"], false, "{r}");
    assert!(
        r["reason"]
            .as_str()
            .unwrap()
            .contains("controller: no controller has answered yet"),
        "{r}"
    );

    // The controller starts (JSON logs): both turn ready.
    let state = dir.path().join("state");
    let ctl = spawn_controller(cport, &state, dir.path(), &["--log-format", "json"]);
    let r = wait_probe(
        &http,
        &format!("{controller}/readyz"),
        200,
        "controller ready",
    )
    .await;
    assert_eq!(r["ready"], true, "{r}");
    assert!(r.get("reason").is_none(), "{r}");
    for c in ["config", "state_dir", "ticking"] {
        assert_eq!(r["checks"][c]["ok"], true, "{c}: {r}");
    }
    assert_eq!(r["checks"]["config"]["detail"], "no config pushed yet");
    let r = wait_probe(&http, &format!("{agg}/readyz"), 200, "aggregator ready").await;
    assert_eq!(r["checks"]["controller"]["ok"], true, "{r}");

    // The controller's state directory disappears: the controller is alive but not ready.
    std::fs::remove_dir_all(&state).unwrap();
    let r = wait_probe(
        &http,
        &format!("{controller}/readyz"),
        503,
        "controller unready",
    )
    .await;
    assert_eq!(r["checks"]["state_dir"]["ok"], false, "{r}");
    assert!(
        r["reason"].as_str().unwrap().starts_with("state_dir: "),
        "{r}"
    );
    assert_eq!(
        probe(&http, &format!("{controller}/healthz"))
            .await
            .unwrap()
            .0,
        200
    );

    // The controller dies: the aggregator's directives age past the bound, it turns unready.
    ctl.kill();
    let r = wait_probe(&http, &format!("{agg}/readyz"), 503, "aggregator unready").await;
    assert!(
        r["reason"]
            .as_str()
            .unwrap()
            .starts_with("controller: last answer"),
        "{r}"
    );

    // Logs: the controller's are JSON lines (INFO by default), the aggregator's plain text;
    // neither has colour escapes (stderr is a file).
    let clog = std::fs::read_to_string(dir.path().join(format!("controller-{cport}.log"))).unwrap();
    let lines: Vec<Value> = clog
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert!(
        lines
            .iter()
            .any(|l| l["level"] == "INFO" && l["fields"]["message"] == "controller listening"),
        "{clog}"
    );
    let alog = std::fs::read_to_string(dir.path().join("agg-ops.log")).unwrap();
    assert!(
        alog.contains(" INFO ") && alog.contains("aggregator listening"),
        "{alog}"
    );
    for (what, log) in [("controller", &clog), ("aggregator", &alog)] {
        assert!(
            !log.contains('\u{1b}'),
            "{what} log has ANSI escapes:\n{log}"
        );
    }
}
