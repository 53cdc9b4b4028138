//! A rollout on real processes, on loopback: a `grl controller`, one `grl aggregator`, two
//! `grl sidecar`s in front of a Python HTTP service, `rlc serve` in direct mode with a git
//! remote served by `git daemon`, and a load generator sending 150 rps as caller `charge`
//! through the sidecars (issue 29's proof, end to end).
//!
//! The story: `payments/charge` is in force at 3,470 rps; someone commits a contract fixing it
//! at 100 rps; rlc lowers the bucket in git, and with `rollout:` set the controller gets 100
//! rps as a candidate beside 3,470. Asserted: the controller never serves anything but 3,470
//! and no request through the sidecars is refused; the candidate's virtual-drop share is about
//! a third; rlc aborts the rollout, the remote gets a revert commit naming the abort with the
//! bucket back at 3,470, and the controller runs that commit.

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use serde_json::Value;
use test_support::git::{git, GitRemote};
use test_support::process::{free_port, Proc};

use super::fleet::{Load, CLIENT_SECRET, ZONE_TOKEN};
use super::{
    bin, charge_counter, get, get_auth, get_text, start_controller_ticking, start_rlc_serve,
    wait_until, write_steady_history, TOKEN,
};

const RLC_TOKEN: &str = "rollout-e2e-rlc-token";

/// A threaded Python HTTP/1.1 service (keep-alive) answering `ok` to every GET.
const PY_HTTP: &str = r#"
import sys
from http.server import ThreadingHTTPServer, BaseHTTPRequestHandler

class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a):
        pass
    def do_GET(self):
        body = b"ok\n"
        self.send_response(200)
        self.send_header("content-type", "text/plain")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

ThreadingHTTPServer.daemon_threads = True
ThreadingHTTPServer.request_queue_size = 256
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"#;

/// The limit of payments/charge the controller serves (what the clients enforce).
fn served_limit(config: &Value) -> Option<f64> {
    config["services"]
        .as_array()?
        .iter()
        .find(|s| s["service"] == "payments")?["buckets"]
        .as_array()?
        .iter()
        .find(|b| b["name"] == "charge")?["limit_rps"]
        .as_f64()
}

/// The message of the newest commit on the remote's main branch.
fn head_message(remote: &GitRemote) -> String {
    git(
        &remote.bare_path(),
        &["log", "-1", "--format=%B", "refs/heads/main"],
    )
    .unwrap()
}

#[test]
fn a_lowered_limit_is_tried_as_a_candidate_through_sidecars_and_reverted() {
    let started = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path();
    let log = |name: &str| Stdio::from(std::fs::File::create(logs.join(name)).unwrap());

    // The config repo: payments/charge in force at 3,470 rps; `rollout:` with a 10 s bake,
    // judged from 300 requests on.
    let policies = "default:\n  policy: peak\n  headroom: 0.25\n\
                    rollout:\n  bake: 10s\n  min_offered: 300\n  max_bake: 2m\n";
    let payments = "service: payments\nbuckets:\n  - name: charge\n    caller: charge\n    scope: global\n    limit_rps: 3470\n    mode: enforce\n    policy: peak\n";
    let remote = GitRemote::new(
        "main",
        &[
            ("rlc/policies.yaml", policies),
            ("buckets/payments.yaml", payments),
        ],
    )
    .expect("git remote");
    let before = remote.head("main").unwrap();

    // rlc's history: the last two hours of charge at 150 rps, one sample a minute.
    write_steady_history(dir.path(), "charge", 150.0);

    // Controller and one aggregator, every tier on a 200 ms tick.
    let cport = free_port();
    let _controller = start_controller_ticking(cport, &dir.path().join("grl-state"), 200);
    let creds = dir.path().join("client-credentials");
    std::fs::write(&creds, format!("payments payments {CLIENT_SECRET}\n")).unwrap();
    let aport = free_port();
    let _aggregator = Proc::spawn(
        Command::new(bin("grl"))
            .args(["aggregator", "--listen", &format!("127.0.0.1:{aport}")])
            .args(["--controller", &format!("http://127.0.0.1:{cport}")])
            .args(["--zone", "z1", "--region", "r1", "--tick-ms", "200"])
            .arg("--client-credentials")
            .arg(&creds)
            .env("GRL_REPORT_TOKEN", ZONE_TOKEN)
            .stdout(Stdio::null())
            .stderr(log("aggregator.log")),
    )
    .unwrap();
    wait_until(Duration::from_secs(20), || {
        get_text(aport, "/healthz").is_some()
    });

    // The service (Python) and two sidecars in front of it; the caller from `x-caller`.
    let py_port = free_port();
    let script = dir.path().join("service.py");
    std::fs::write(&script, PY_HTTP).unwrap();
    let _service = Proc::spawn(
        Command::new("python3")
            .arg(&script)
            .arg(py_port.to_string())
            .stdout(Stdio::null())
            .stderr(log("service.log")),
    )
    .unwrap();
    let mut sidecars = Vec::new();
    let mut sidecar_urls = Vec::new();
    let mut admins = Vec::new();
    for i in 0..2 {
        let (port, admin) = (free_port(), free_port());
        sidecars.push(
            Proc::spawn(
                Command::new(bin("grl"))
                    .args(["sidecar", "--listen", &format!("127.0.0.1:{port}")])
                    .args(["--admin-listen", &format!("127.0.0.1:{admin}")])
                    .args(["--upstream", &format!("http://127.0.0.1:{py_port}")])
                    .args(["--service", "payments", "--caller-header", "x-caller"])
                    .args(["--zone", "z1", "--region", "r1", "--tick-ms", "200"])
                    .args(["--aggregator", &format!("http://127.0.0.1:{aport}")])
                    .env("GRL_CLIENT_TOKEN", CLIENT_SECRET)
                    .stdout(Stdio::null())
                    .stderr(log(&format!("sidecar-{i}.log"))),
            )
            .unwrap(),
        );
        sidecar_urls.push(format!("http://127.0.0.1:{port}"));
        admins.push(admin);
    }

    // rlc serve: direct mode on the remote, the controller, SQLite, polling every second.
    // The daemon puts the base branch (3,470 rps) on the controller, and the sidecars get it.
    let (_serve, rport) = start_rlc_serve(
        dir.path(),
        "history:\n  file: history.csv\n  lookback: 1h\n  step: 1m\n\
rails:\n  decrease_interval: 1s\n",
        &remote.url(),
        "sqlite://rlc.db",
        cport,
        RLC_TOKEN,
        &before,
    );
    assert_eq!(
        served_limit(&get(cport, "/v1/config").unwrap()),
        Some(3470.0)
    );
    for admin in &admins {
        wait_until(Duration::from_secs(30), || {
            get_text(*admin, "/metrics")
                .is_some_and(|t| t.contains("grl_client_failing_open{service=\"payments\"} 0"))
        });
    }

    // 150 rps as caller `charge`, round robin over the two sidecars, until the controller
    // has counted two seconds of it.
    let load = Load::new(&sidecar_urls);
    let charge = load.caller("charge", "charge");
    charge.set_rps(150.0);
    wait_until(Duration::from_secs(30), || {
        get_text(cport, "/metrics")
            .is_some_and(|m| charge_counter(&m, "grl_requests_offered_total") >= 300.0)
    });
    eprintln!(
        "rollout: everything up after {:.1} s",
        started.elapsed().as_secs_f64()
    );

    // Someone commits a contract fixing charge at 100 rps: rlc lowers the bucket in git, and
    // the controller gets the lower limit as a candidate.
    let contract = remote
        .human_commit(
            "main",
            &[(
                "rlc/contracts.yaml",
                "contracts:\n  - service: payments\n    caller: charge\n    limit_rps: 100\n    reference: MSA-100\n",
            )],
            "contract: payments/charge at 100 rps",
        )
        .unwrap();
    let t_contract = Instant::now();

    // Until rlc has aborted the rollout and the revert is on the remote: what the controller
    // served, the candidate it evaluated, the rollout as GET /v1/quotas shows it.
    let mut served = Vec::new();
    let mut evaluated: Vec<Value> = Vec::new();
    let mut rollout = Value::Null;
    let mut lowered_seen = false;
    wait_until(Duration::from_secs(60), || {
        if let Some(c) = get(cport, "/v1/config") {
            served.push(served_limit(&c));
        }
        if let Some(c) = get_auth(cport, "/v1/candidates", TOKEN) {
            evaluated.extend(
                c["candidates"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|c| c["service"] == "payments" && c["bucket"] == "charge")
                    .cloned(),
            );
        }
        lowered_seen |= remote
            .read("main", "buckets/payments.yaml")
            .is_ok_and(|t| t.contains("limit_rps: 100\n"));
        if let Some(q) = get(rport, "/v1/quotas?service=payments") {
            if let Some(r) = q["buckets"]
                .as_array()
                .and_then(|b| b.iter().find(|b| b["name"] == "charge"))
                .map(|b| b["rollout"].clone())
            {
                rollout = r;
            }
        }
        rollout["state"] == "aborted"
            && rollout["revert"].is_string()
            && head_message(&remote).starts_with("rlc: revert")
    });
    let to_abort = t_contract.elapsed().as_secs_f64();
    let (ok, limited) = charge.counts();
    let failed = charge.failed.load(Ordering::Relaxed);
    let sent = charge.sent.load(Ordering::Relaxed);
    drop(load);

    // No request through the sidecars was refused; the controller never served less than
    // 3,470 rps.
    assert_eq!(limited, 0, "requests refused through the sidecars");
    assert_eq!(failed, 0, "requests that got neither 200 nor 429");
    assert!(ok > 0);
    assert!(!served.is_empty());
    assert!(
        served.iter().all(|l| *l == Some(3470.0)),
        "the controller served another limit: {served:?}"
    );
    assert!(
        lowered_seen,
        "rlc committed the lower limit before the revert"
    );

    // The candidate: 100 rps beside 3,470, about a third of what was offered virtually
    // dropped, nothing really dropped.
    let last = evaluated
        .iter()
        .rfind(|c| c["offered"].as_f64().unwrap_or(0.0) > 0.0)
        .cloned()
        .unwrap_or_else(|| panic!("the controller evaluated no candidate: {evaluated:?}"));
    assert_eq!(last["limit_rps"].as_f64(), Some(100.0), "{last}");
    assert_eq!(last["in_force_limit_rps"].as_f64(), Some(3470.0), "{last}");
    assert_eq!(last["enforced_dropped"].as_f64(), Some(0.0), "{last}");
    let share = last["virtual_drop_share"].as_f64().unwrap();
    assert!((0.2..0.45).contains(&share), "about a third: {last}");

    // rlc aborted it, with the evidence.
    let reason = rollout["reason"].as_str().unwrap_or_default().to_string();
    assert!(reason.contains("would have been refused"), "{rollout}");
    assert_eq!(rollout["change"], "lowered 3470 -> 100 rps", "{rollout}");
    let rlc_share = rollout["virtual_drop_share"].as_f64().unwrap();
    assert!((0.2..0.45).contains(&rlc_share), "{rollout}");

    // The revert commit: it names the abort and its bucket file holds 3,470 again.
    let head = remote.head("main").unwrap();
    let msg = head_message(&remote);
    assert!(
        msg.starts_with("rlc: revert payments/charge to 3470 rps enforce: rollout aborted"),
        "{msg}"
    );
    assert!(msg.contains("would have been refused"), "{msg}");
    let file = remote.read("main", "buckets/payments.yaml").unwrap();
    let f = schema::parse_str::<schema::BucketFile>(Path::new("payments.yaml"), &file).unwrap();
    assert_eq!(f.value.buckets.len(), 1, "{file}");
    assert_eq!(f.value.buckets[0].limit_rps, 3470.0, "{file}");
    assert_eq!(f.value.buckets[0].mode.as_str(), "enforce", "{file}");
    // The commit before it is rlc's lowering, on top of the contract.
    let parent = git(&remote.bare_path(), &["rev-parse", "refs/heads/main~1"]).unwrap();
    let lowered = git(
        &remote.bare_path(),
        &["show", &format!("{}:buckets/payments.yaml", parent.trim())],
    )
    .unwrap();
    assert!(lowered.contains("limit_rps: 100\n"), "{lowered}");
    let grandparent = git(&remote.bare_path(), &["rev-parse", "refs/heads/main~2"]).unwrap();
    assert_eq!(grandparent.trim(), contract);

    // The controller runs the revert commit, with the old limit.
    wait_until(Duration::from_secs(30), || {
        get(cport, "/v1/status").is_some_and(|s| s["version"] == head.as_str())
    });
    assert_eq!(
        served_limit(&get(cport, "/v1/config").unwrap()),
        Some(3470.0)
    );
    // The gauge the `RlcRolloutAborted` alert reads (deploy/prometheus/rules.yml).
    wait_until(Duration::from_secs(30), || {
        get_text(rport, "/metrics").is_some_and(|m| {
            m.contains(r#"rlc_rollout_state{service="payments",bucket="charge",state="aborted"} 1"#)
        })
    });
    eprintln!(
        "rollout: {:.0} s; {sent} sent, {ok} 200s, {limited} 429s; candidate {last}; aborted {to_abort:.1} s after the contract commit: {}",
        started.elapsed().as_secs_f64(),
        rollout["summary"]
    );
    drop(sidecars);
}
