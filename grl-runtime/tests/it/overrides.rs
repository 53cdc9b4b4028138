//! Overrides against real `grl controller` processes: a restored config never blocks them,
//! their ids never collide, and their number is bounded with a clear error.

use serde_json::{json, Value};
use test_support::process::free_port;

use super::{get_json, get_text, payments_config, spawn_controller, wait_up, TOKEN};

fn traffic_override(caller: &str) -> Value {
    json!({"service": "payments", "caller": caller, "limit_rps": 5.0, "ttl_secs": 600,
           "reason": "INC-1", "who": "oncall"})
}

async fn add(http: &reqwest::Client, base: &str, body: &Value) -> (u16, Value) {
    let r = http
        .post(format!("{base}/v1/overrides"))
        .bearer_auth(TOKEN)
        .json(body)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

async fn put(http: &reqwest::Client, base: &str, body: &Value) -> (u16, Value) {
    let r = http
        .put(format!("{base}/v1/config"))
        .bearer_auth(TOKEN)
        .json(body)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

/// A controller's served config (`GET /v1/config`, which carries the `override:` buckets of
/// its traffic overrides) is refused by `PUT /v1/config` with a 422 that names the reserved
/// bucket and the way to restore a config, `GET /v1/config?view=pushed`, whose round trip
/// works; a fresh controller's overrides then get ids `ovr-1`, `ovr-2`… as usual. (Before:
/// the served config was accepted and every override afterwards failed with "duplicate bucket
/// name override:ovr-1", its id never advancing.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restored_config_never_blocks_overrides() {
    let dir = tempfile::tempdir().unwrap();
    let http = reqwest::Client::new();
    let (pa, pb) = (free_port(), free_port());
    let (a, b) = (
        format!("http://127.0.0.1:{pa}"),
        format!("http://127.0.0.1:{pb}"),
    );
    let _ca = spawn_controller(pa, &dir.path().join("a"), dir.path(), &[]);
    let _cb = spawn_controller(pb, &dir.path().join("b"), dir.path(), &[]);
    wait_up(&format!("{a}/v1/status")).await;
    wait_up(&format!("{b}/v1/status")).await;
    assert_eq!(put(&http, &a, &payments_config("v1", 200.0)).await.0, 200);
    let (s, o) = add(&http, &a, &traffic_override("batch")).await;
    assert_eq!(s, 201, "{o}");
    assert_eq!(o["id"], "ovr-1");

    // The served config carries the override's bucket: it is not a config to push.
    let served = get_json(&http, &format!("{a}/v1/config")).await;
    let names: Vec<&str> = served["services"][0]["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["name"].as_str().unwrap())
        .collect();
    assert!(names.contains(&"override:ovr-1"), "{served}");
    let (s, e) = put(&http, &b, &served).await;
    assert_eq!(s, 422, "{e}");
    let msg = e["error"].as_str().unwrap();
    assert!(
        msg.contains("override:ovr-1") && msg.contains("view=pushed"),
        "{msg}"
    );

    // The pushed config round-trips.
    let pushed = get_json(&http, &format!("{a}/v1/config?view=pushed")).await;
    assert_eq!(pushed, payments_config("v1", 200.0));
    let (s, e) = put(&http, &b, &pushed).await;
    assert_eq!(s, 200, "{e}");
    // Overrides on the restored controller: ids advance, nothing collides.
    for (caller, id) in [("batch", "ovr-1"), ("other", "ovr-2")] {
        let (s, o) = add(&http, &b, &traffic_override(caller)).await;
        assert_eq!(s, 201, "{o}");
        assert_eq!(o["id"], id);
    }
    // A config naming a reserved bucket by itself is refused the same way.
    let mut own = payments_config("v2", 200.0);
    own["services"][0]["buckets"][0]["name"] = json!("override:ovr-9");
    let (s, e) = put(&http, &b, &own).await;
    assert_eq!(s, 422, "{e}");
}

/// The number of overrides is bounded (`--max-overrides`): one more is refused with 422 saying
/// how many are active and what to do, nothing is added, and once one is removed the next add
/// goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_number_of_overrides_is_bounded_with_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let http = reqwest::Client::new();
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let _c = spawn_controller(
        port,
        &dir.path().join("state"),
        dir.path(),
        &["--max-overrides", "20"],
    );
    wait_up(&format!("{base}/v1/status")).await;
    assert_eq!(
        put(&http, &base, &payments_config("v1", 200.0)).await.0,
        200
    );
    for i in 0..20 {
        let (s, o) = add(&http, &base, &traffic_override(&format!("c{i}"))).await;
        assert_eq!(s, 201, "{i}: {o}");
    }
    let (s, e) = add(&http, &base, &traffic_override("one-too-many")).await;
    assert_eq!(s, 422, "{e}");
    let msg = e["error"].as_str().unwrap();
    assert!(
        msg.contains("20 overrides") && msg.contains("grl override rm"),
        "{msg}"
    );
    let status = get_json(&http, &format!("{base}/v1/status")).await;
    assert_eq!(status["overrides"], 20, "{status}");
    let r = http
        .delete(format!("{base}/v1/overrides/ovr-3"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let (s, o) = add(&http, &base, &traffic_override("one-too-many")).await;
    assert_eq!(s, 201, "{o}");
    assert_eq!(o["id"], "ovr-21");
}

/// `grl` with the test's override credential.
pub(crate) fn grl(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_grl"))
        .args(args)
        .env("GRL_OVERRIDE_TOKEN", TOKEN)
        .env_remove("GRL_TOKEN")
        .output()
        .unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// An on-call's day with the CLI: `grl override list` is a table (and JSON on request),
/// every override added, removed or expired is in the audit log, which outlives the overrides
/// and the controller's restart (`GET /v1/overrides/history`, `grl override history`);
/// `/metrics` counts the active overrides by kind with their time left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overrides_leave_an_audit_trail_and_the_cli_reads_as_a_table() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let http = reqwest::Client::new();
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let mut c = spawn_controller(port, &state, dir.path(), &[]);
    wait_up(&format!("{base}/v1/status")).await;
    assert_eq!(
        put(&http, &base, &payments_config("v1", 200.0)).await.0,
        200
    );

    // A traffic override (the CLI), a bucket override that expires in 2 s (the API).
    let out = grl(&[
        "override",
        "add",
        "--controller",
        &base,
        "--service",
        "payments",
        "--caller",
        "gw",
        "--limit-rps",
        "50",
        "--ttl",
        "30m",
        "--reason",
        "INC-7 retry storm",
        "--who",
        "alice",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let (s, o) = add(
        &http,
        &base,
        &json!({"service": "payments", "bucket": "gw.charge", "drop_ratio": 0.5,
                "ttl_secs": 2, "reason": "INC-8", "who": "bob"}),
    )
    .await;
    assert_eq!(s, 201, "{o}");

    let out = grl(&["override", "list", "--controller", &base]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let table = text(&out.stdout);
    let lines: Vec<&str> = table.lines().collect();
    assert!(
        lines[0].starts_with("ID") && lines[0].contains("EXPIRES IN"),
        "{table}"
    );
    let ovr1 = lines
        .iter()
        .find(|l| l.starts_with("ovr-1"))
        .expect("ovr-1 listed");
    assert!(
        ovr1.contains("traffic caller=gw service=payments (as a whole, over 2 buckets)")
            && ovr1.contains("limit 50 rps")
            && ovr1.contains("alice")
            && ovr1.contains("INC-7 retry storm"),
        "{table}"
    );
    assert!(
        ovr1.ends_with("29m 59s") || ovr1.ends_with("30m 0s") || ovr1.ends_with("29m 58s"),
        "{table}"
    );
    let out = grl(&[
        "override",
        "list",
        "--controller",
        &base,
        "--format",
        "json",
    ]);
    let list: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(list["overrides"].as_array().unwrap().len(), 2, "{list}");

    let metrics = get_text(&http, &format!("{base}/metrics")).await;
    assert!(
        metrics.contains("grl_overrides_active{kind=\"bucket\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("grl_overrides_active{kind=\"traffic\"} 1"),
        "{metrics}"
    );
    let left: f64 = metrics
        .lines()
        .find(|l| l.starts_with("grl_override_expires_in_seconds{id=\"ovr-1\""))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .expect("a countdown for ovr-1");
    assert!((1790.0..=1800.0).contains(&left), "{left}");

    // The bucket override expires; the traffic one is removed.
    // Expired once the tick that purges it has written its event (listing it as gone comes
    // earlier: the list filters by the clock).
    super::eventually("ovr-2 expired", || {
        let http = http.clone();
        let url = format!("{base}/v1/overrides/history");
        async move {
            get_json(&http, &url).await["events"]
                .as_array()
                .unwrap()
                .iter()
                .any(|e| e["action"] == "expired")
        }
    })
    .await;
    let out = grl(&[
        "override",
        "rm",
        "--controller",
        &base,
        "ovr-1",
        "--who",
        "carol",
        "--reason",
        "storm over",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let metrics = get_text(&http, &format!("{base}/metrics")).await;
    assert!(
        metrics.contains("grl_overrides_active{kind=\"traffic\"} 0"),
        "{metrics}"
    );
    assert!(
        !metrics.contains("grl_override_expires_in_seconds{"),
        "{metrics}"
    );

    // The trail outlives the overrides and the controller.
    drop(c);
    c = spawn_controller(port, &state, dir.path(), &[]);
    wait_up(&format!("{base}/v1/status")).await;
    let h = get_json(&http, &format!("{base}/v1/overrides/history")).await;
    let events: Vec<(String, String, String, String)> = h["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let s = |k: &str| e[k].as_str().unwrap_or("").to_string();
            (s("action"), s("id"), s("by"), s("reason"))
        })
        .collect();
    let want = |a: &str, id: &str, by: &str, why: &str| {
        (
            a.to_string(),
            id.to_string(),
            by.to_string(),
            why.to_string(),
        )
    };
    assert_eq!(
        events,
        [
            want("removed", "ovr-1", "carol", "storm over"),
            want("expired", "ovr-2", "expiry", "INC-8"),
            want("created", "ovr-2", "bob", "INC-8"),
            want("created", "ovr-1", "alice", "INC-7 retry storm"),
        ],
        "{h}"
    );
    assert_eq!(
        h["events"][0]["override"]["limit_rps"], 50.0,
        "what it was: {h}"
    );
    assert_eq!(h["events"][0]["credential"], "GRL_TOKEN", "{h}");
    let out = grl(&["override", "history", "--controller", &base, "--limit", "2"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let t = text(&out.stdout);
    let lines: Vec<&str> = t.lines().collect();
    assert_eq!(lines.len(), 3, "a header and two events: {t}");
    assert!(
        lines[1].contains("removed")
            && lines[1].contains("carol")
            && lines[1].contains("storm over"),
        "{t}"
    );
    assert!(
        lines[2].contains("expired")
            && lines[2].contains("bucket payments/gw.charge")
            && lines[2].contains("drop 50%"),
        "{t}"
    );
    drop(c);
}

/// Two controllers on one state directory would overwrite each other's overrides: the second
/// refuses to start, naming the holder. A user error is one line, even with RUST_BACKTRACE=1;
/// a closed pipe ends a command quietly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_dir_has_one_controller_and_errors_are_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let c = spawn_controller(port, &state, dir.path(), &[]);
    wait_up(&format!("{base}/v1/status")).await;
    let pid = c.0.id();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_grl"))
        .args(["controller", "--listen", "127.0.0.1:0", "--state-dir"])
        .arg(&state)
        .env("GRL_TOKEN", TOKEN)
        .env("GRL_REPORT_TOKEN", "r")
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    let last = err.lines().last().unwrap_or("");
    assert!(
        last.starts_with("error: refusing to start: state directory")
            && last.contains("in use by another controller")
            && last.contains(&format!("pid {pid} ")),
        "{err}"
    );
    assert!(
        !err.contains("Stack backtrace") && !err.contains("stack backtrace"),
        "{err}"
    );

    // A user error: one line, no backtrace.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_grl"))
        .args(["override", "add", "--controller", &base, "--caller", "gw"])
        .args([
            "--limit-rps",
            "5",
            "--ttl",
            "8d",
            "--reason",
            "x",
            "--who",
            "x",
        ])
        .env("RUST_BACKTRACE", "1")
        .env("GRL_OVERRIDE_TOKEN", TOKEN)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.starts_with("error: --ttl is at most 7d"), "{err}");

    // The state directory is free again once the controller has stopped.
    drop(c);
    let port2 = free_port();
    let _c2 = spawn_controller(port2, &state, dir.path(), &[]);
    wait_up(&format!("http://127.0.0.1:{port2}/v1/status")).await;

    // A closed pipe (`grl override history | head -0`): a quiet exit 141, as command-line
    // tools do.
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_grl"))
        .args(["override", "history", "--format", "json", "--controller"])
        .arg(format!("http://127.0.0.1:{port2}"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(141), "{}", text(&out.stderr));
    assert_eq!(text(&out.stderr), "", "quiet");
}
