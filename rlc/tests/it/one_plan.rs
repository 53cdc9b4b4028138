//! One plan per run, from one view of the world: a decrease proposed on the pull-request branch
//! is not mistaken for one applied, and a run goes to the config repo's remote once. Real
//! `rlc` binary, a real Prometheus (constant rates, so the numbers are exact) and a config
//! repo served by `git daemon`.

use std::path::Path;
use std::process::Command;

use serde_json::Value;
use test_support::git::GitRemote;
use test_support::prometheus::{OpenMetricsWriter, Prometheus};

const DAY: i64 = 86_400;
const QUERY: &str = "sum by (service, caller, procedure) (rate(rpc_requests_total[1m]))";
/// `pay`: `web` at 200 rps (limit 100 → 250), `batch` at 400 rps (limit 1000 → 750: 500
/// wanted, capped at 25% per run).
const PAY: &str = "service: pay\nbuckets:\n  - name: web\n    caller: web\n    scope: global\n    limit_rps: 100\n    mode: enforce\n    policy: peak\n  - name: batch\n    caller: batch\n    scope: global\n    limit_rps: 1000\n    mode: enforce\n    policy: peak\n";

/// Nine days of counters at constant rates, scraped every 30 s, up to now.
fn prometheus(dir: &Path) -> Prometheus {
    let end = chrono::Utc::now().timestamp() / 60 * 60 - 60;
    let mut w = OpenMetricsWriter::create(&dir.join("history.om")).unwrap();
    w.family("rpc_requests", "counter").unwrap();
    for (caller, rate) in [("web", 200.0), ("batch", 400.0)] {
        let labels = [("service", "pay"), ("caller", caller)];
        let mut t = end - 9 * DAY;
        let mut counter = 0.0;
        while t <= end {
            w.sample("rpc_requests_total", &labels, counter, t).unwrap();
            counter += rate * 30.0;
            t += 30;
        }
    }
    Prometheus::start(&w.finish().unwrap()).expect("start Prometheus")
}

/// A config repo with `pay` on a remote, and rlc.yaml in `dir` with `repo` (YAML lines under
/// `config_repo:`) on SQLite.
fn setup(dir: &Path, prom: &Prometheus, repo: &str) -> GitRemote {
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
            "history:\n  prometheus:\n    url: {}\n    query: '{QUERY}'\n  lookback: 8d\n  step: 5m\n\
             config_repo:\n  path: wc\n  url: {}\n  author_name: rlc-bot\n  author_email: rlc@example.com\n{repo}\
             database_url: sqlite://rlc.db\n",
            prom.url,
            remote.url()
        ),
    )
    .unwrap();
    remote
}

/// `rlc run --once --json` in `dir`: (exit code, outcome).
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

/// `limit_rps` of `bucket` in `buckets/pay.yaml` on `branch` of the remote.
fn limit(remote: &GitRemote, branch: &str, bucket: &str) -> f64 {
    let file: schema::BucketFile =
        serde_yaml::from_str(&remote.read(branch, "buckets/pay.yaml").unwrap()).unwrap();
    file.buckets
        .iter()
        .find(|b| b.name == bucket)
        .unwrap_or_else(|| panic!("no {bucket} on {branch}"))
        .limit_rps
}

/// A decrease proposed on the pull-request branch has not been applied: the next run (here
/// after an unrelated edit of `rlc/policies.yaml`, which triggers runs in `rlc serve`) proposes
/// it again instead of finding it "already lowered", and keeps the branch; the store records
/// it as proposed, not as a change of the limit in force.
#[test]
fn a_proposed_decrease_is_not_counted_as_applied() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let prom = prometheus(d);
    let remote = setup(d, &prom, "  mode: pull-request\n  forge:\n    kind: none\n");

    let (code, out) = run_once(d);
    assert_eq!(code, 0, "{out}");
    assert_eq!(limit(&remote, "rlc/quotas", "batch"), 750.0, "{out}");
    assert_eq!(limit(&remote, "main", "batch"), 1000.0, "main is unchanged");

    remote
        .human_commit(
            "main",
            &[(
                "rlc/policies.yaml",
                "# reviewed by the payments team\ndefault:\n  policy: peak\n",
            )],
            "policies: a comment",
        )
        .unwrap();
    let (code, out) = run_once(d);
    assert_eq!(code, 0, "{out}");
    assert!(
        remote.head("rlc/quotas").is_some(),
        "the proposal was withdrawn although main still holds the old limit: {out}"
    );
    assert_eq!(limit(&remote, "rlc/quotas", "batch"), 750.0, "{out}");
    assert_eq!(limit(&remote, "main", "batch"), 1000.0);
    let skipped = out["skipped"].to_string();
    assert!(!skipped.contains("already lowered"), "{out}");

    // The store knows the decrease as a proposal only.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let changes = rt.block_on(async {
        let store = rlc::store::Store::connect("sqlite://rlc.db", d)
            .await
            .unwrap();
        store.quota_changes("pay", "batch", 10).await.unwrap()
    });
    assert!(!changes.is_empty());
    for c in &changes {
        assert_eq!(c.state, rlc::store::ChangeState::Proposed, "{c:?}");
    }
}

/// A run fetches the config repo's remote once (the clone of the first run included), in
/// direct mode with a decrease (which the decrease guard checks against the repo's history)
/// and in pull-request mode with an open proposal.
#[test]
fn one_run_fetches_the_remote_once() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let prom = prometheus(d);
    let direct = setup(d, &prom, "");
    for run in 1..=2 {
        let before = direct.upload_packs();
        let (code, out) = run_once(d);
        assert_eq!(code, 0, "{out}");
        assert_eq!(direct.upload_packs() - before, 1, "direct run {run}: {out}");
    }
    assert_eq!(limit(&direct, "main", "batch"), 750.0);

    let pr = tempfile::tempdir().unwrap();
    let p = pr.path();
    let remote = setup(p, &prom, "  mode: pull-request\n  forge:\n    kind: none\n");
    for run in 1..=2 {
        let before = remote.upload_packs();
        let (code, out) = run_once(p);
        assert_eq!(code, 0, "{out}");
        assert_eq!(
            remote.upload_packs() - before,
            1,
            "pull-request run {run}: {out}"
        );
    }
    assert_eq!(limit(&remote, "rlc/quotas", "batch"), 750.0);
}
