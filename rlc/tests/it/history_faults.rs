//! Histories that must not become quotas, from a real Prometheus (backfilled with promtool):
//! one absurd sample, a query that reads every value as 0, series the query did not
//! aggregate. Each run refuses what it cannot believe, keeps the quotas in force, says why and
//! exits non-zero. Real `rlc` binary, config repo served by `git daemon`.

use std::path::Path;
use std::process::Command;

use serde_json::Value;
use test_support::git::GitRemote;
use test_support::prometheus::{OpenMetricsWriter, Prometheus};

const DAY: i64 = 86_400;
/// `pay`: `web` at 200 rps (limit 250), `batch` at 400 rps (limit 500): a run changes nothing.
const PAY: &str = "service: pay\nbuckets:\n  - name: web\n    caller: web\n    scope: global\n    limit_rps: 250\n    mode: enforce\n    policy: peak\n  - name: batch\n    caller: batch\n    scope: global\n    limit_rps: 500\n    mode: enforce\n    policy: peak\n";

/// One series of the backfill: labels, rate (rps), and an optional jump of the counter at
/// `at` seconds before the end (added once, so one scrape interval sees it).
struct Counter<'a> {
    labels: Vec<(&'a str, &'a str)>,
    rate: f64,
    jump: Option<(i64, f64)>,
}

/// Eight days of counters scraped every 30 s, up to now.
fn prometheus(dir: &Path, counters: &[Counter<'_>]) -> Prometheus {
    let end = chrono::Utc::now().timestamp() / 60 * 60 - 60;
    let mut w = OpenMetricsWriter::create(&dir.join("history.om")).unwrap();
    w.family("rpc_requests", "counter").unwrap();
    for c in counters {
        let mut t = end - 8 * DAY;
        let mut value = 0.0;
        while t <= end {
            w.sample("rpc_requests_total", &c.labels, value, t).unwrap();
            value += c.rate * 30.0;
            if let Some((at, by)) = c.jump {
                if t == end - at {
                    value += by;
                }
            }
            t += 30;
        }
    }
    Prometheus::start(&w.finish().unwrap()).expect("start Prometheus")
}

/// A config repo with `pay` on a remote, and rlc.yaml in `dir` reading `query`.
fn setup(dir: &Path, prom: &Prometheus, query: &str) -> GitRemote {
    let mut files = test_support::git::minimal_repo_files(&[]);
    files.push(("buckets/pay.yaml".into(), PAY.into()));
    let refs: Vec<(&str, &str)> = files
        .iter()
        .map(|(a, b)| (a.as_str(), b.as_str()))
        .collect();
    let remote = GitRemote::new("main", &refs).unwrap();
    std::fs::write(
        dir.join("rlc.yaml"),
        format!(
            "history:\n  prometheus:\n    url: {}\n    query: '{query}'\n  lookback: 7d\n  step: 1m\n\
             config_repo:\n  path: wc\n  url: {}\n  author_name: rlc-bot\n  author_email: rlc@example.com\n\
             database_url: sqlite://rlc.db\n",
            prom.url,
            remote.url()
        ),
    )
    .unwrap();
    remote
}

fn run_once(dir: &Path) -> (i32, Value) {
    let out = Command::new(env!("CARGO_BIN_EXE_rlc"))
        .args(["run", "--once", "--json", "--config"])
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

fn skipped(out: &Value) -> String {
    out["skipped"].to_string()
}

const SUMMED: &str = "sum by (service, caller, procedure) (rate(rpc_requests_total[1m]))";

/// One counter jump worth 1e12 rps for one minute, in a week of 200 rps: the bucket keeps its
/// limit (it was committed as ~1.25e12 rps before), the run says why and exits 4; the other
/// bucket is computed.
#[test]
fn one_absurd_sample_does_not_become_a_quota() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let prom = prometheus(
        d,
        &[
            Counter {
                labels: vec![("service", "pay"), ("caller", "web")],
                rate: 200.0,
                jump: Some((3 * DAY, 1e12 * 60.0)),
            },
            Counter {
                labels: vec![("service", "pay"), ("caller", "batch")],
                rate: 400.0,
                jump: None,
            },
        ],
    );
    let remote = setup(d, &prom, SUMMED);
    let (code, out) = run_once(d);
    assert_eq!(code, 4, "{out}");
    assert_eq!(out["history_refused"], serde_json::json!(["pay"]), "{out}");
    let why = skipped(&out);
    assert!(
        why.contains("not plausible") && why.contains("web"),
        "{out}"
    );
    let pay = remote.read("main", "buckets/pay.yaml").unwrap();
    assert!(
        pay.contains("limit_rps: 250\n"),
        "web kept its limit: {pay}"
    );
    assert_eq!(
        out["summary"]["services"],
        serde_json::json!([]),
        "no limit changed: {out}"
    );
}

/// Every value 0 (a broken recording rule): nothing is lowered, nothing committed, exit 1
/// (the only service's history is refused).
#[test]
fn an_all_zero_history_lowers_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let prom = prometheus(
        d,
        &[
            Counter {
                labels: vec![("service", "pay"), ("caller", "web")],
                rate: 0.0,
                jump: None,
            },
            Counter {
                labels: vec![("service", "pay"), ("caller", "batch")],
                rate: 0.0,
                jump: None,
            },
        ],
    );
    let remote = setup(d, &prom, SUMMED);
    let head = remote.head("main").unwrap();
    let (code, out) = run_once(d);
    assert_eq!(code, 1, "{out}");
    assert!(
        skipped(&out).contains("every sample of its history is 0"),
        "{out}"
    );
    assert_eq!(remote.head("main").unwrap(), head, "nothing committed");
}

/// A query without `sum by`: two instances per caller map to one bucket. Merging them would
/// compute quotas from one instance (half the traffic) and lower every bucket; the service
/// keeps its quotas, the reason names the label they differ in, exit 1.
#[test]
fn series_the_query_did_not_aggregate_are_named_not_merged() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut counters = Vec::new();
    for (caller, rate) in [("web", 100.0), ("batch", 200.0)] {
        for instance in ["a:9090", "b:9090"] {
            counters.push(Counter {
                labels: vec![
                    ("service", "pay"),
                    ("caller", caller),
                    ("instance", instance),
                ],
                rate,
                jump: None,
            });
        }
    }
    let prom = prometheus(d, &counters);
    let remote = setup(d, &prom, "rate(rpc_requests_total[1m])");
    let head = remote.head("main").unwrap();
    let (code, out) = run_once(d);
    assert_eq!(code, 1, "{out}");
    let why = skipped(&out);
    assert!(
        why.contains("several series map to pay/web") && why.contains("`instance`"),
        "{out}"
    );
    assert_eq!(remote.head("main").unwrap(), head, "nothing committed");
}
