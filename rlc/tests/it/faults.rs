//! Faults through the real `rlc` binary: exit codes a script can trust, a dead history
//! source that must not lower or commit anything, and a lost store that must not let a
//! second decrease through. A real git remote served by `git daemon` in each test.

use std::path::Path;
use std::process::Command;

use chrono::Utc;
use serde_json::Value;
use test_support::git::GitRemote;

const MAPS: &str = "service: maps\nbuckets:\n  - name: web.route\n    caller: web\n    procedure: route\n    limit_rps: 5000\n    policy: peak\n";

/// A config repo on a real remote (maps/web.route at 5000 rps) and an rlc.yaml in a temp dir
/// using `history` (YAML lines under `history:`), SQLite store `rlc.db`.
fn setup(history: &str) -> (GitRemote, tempfile::TempDir) {
    let remote = GitRemote::new(
        "main",
        &[
            ("rlc/policies.yaml", "default:\n  policy: peak\n"),
            ("buckets/maps.yaml", MAPS),
        ],
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("rlc.yaml"),
        format!(
            "history:\n{history}\nconfig_repo:\n  path: wc\n  url: {}\n  author_name: rlc-bot\n  author_email: rlc@example.com\ndatabase_url: sqlite://rlc.db\n",
            remote.url()
        ),
    )
    .unwrap();
    (remote, dir)
}

/// Four weeks of generated per-minute history for maps, payments and search.
fn synth(dir: &Path) {
    rlc::history::synth::generate(&dir.join("h.csv"), 1, Utc::now(), 28, 60).unwrap();
}

/// Runs the rlc binary from elsewhere; returns (exit code, stdout, stderr).
fn rlc(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_rlc"))
        .args(args)
        .current_dir(std::env::temp_dir())
        .env("RUST_LOG", "error")
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

fn run_once(dir: &Path) -> (i32, Value, String) {
    let cfg = dir.join("rlc.yaml");
    let (code, out, err) = rlc(&["run", "--once", "--json", "--config", cfg.to_str().unwrap()]);
    let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}\n{err}"));
    (code, v, err)
}

fn preview(dir: &Path) -> (i32, Value, String) {
    let cfg = dir.join("rlc.yaml");
    let (code, out, err) = rlc(&[
        "preview",
        "--format",
        "json",
        "--config",
        cfg.to_str().unwrap(),
    ]);
    let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}\n{err}"));
    (code, v, err)
}

#[test]
fn usage_and_config_errors_have_their_own_exit_codes() {
    // Usage errors: 64, whether clap or rlc finds them.
    let (code, _, err) = rlc(&["run"]);
    assert_eq!(code, 64, "{err}");
    assert!(err.contains("--once"), "{err}");
    let (code, _, err) = rlc(&["run", "--once", "--bogus"]);
    assert_eq!(code, 64, "{err}");
    let (code, _, err) = rlc(&[]);
    assert_eq!(code, 64, "{err}");
    let (code, _, err) = rlc(&["preview", "--format", "yaml"]);
    assert_eq!(code, 64, "{err}");
    // Help succeeds and documents every code.
    let (code, out, _) = rlc(&["--help"]);
    assert_eq!(code, 0);
    for c in ["0 ", "1 ", "2 ", "3 ", "4 ", "64 ", "78 "] {
        assert!(out.contains(&format!("\n  {c}")), "{c} missing in {out}");
    }
    let (code, out, _) = rlc(&["run", "--help"]);
    assert_eq!(code, 0);
    assert!(
        out.contains("push or the run record is pending") && out.contains("78"),
        "{out}"
    );
    let (code, out, _) = rlc(&["preview", "--help"]);
    assert_eq!(code, 0);
    assert!(out.contains("Exit codes") && out.contains("  4 "), "{out}");

    // A missing or invalid rlc.yaml: 78, naming the file.
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.yaml");
    for cmd in ["run", "preview"] {
        let mut args = vec![cmd, "--config", missing.to_str().unwrap()];
        if cmd == "run" {
            args.push("--once");
        }
        let (code, _, err) = rlc(&args);
        assert_eq!(code, 78, "{cmd}: {err}");
        assert!(err.contains("nope.yaml"), "{err}");
    }
    let bad = dir.path().join("rlc.yaml");
    std::fs::write(
        &bad,
        "histroy:\n  file: h.csv\nconfig_repo:\n  path: repo\n",
    )
    .unwrap();
    let (code, _, err) = rlc(&["run", "--once", "--config", bad.to_str().unwrap()]);
    assert_eq!(code, 78, "{err}");
    assert!(err.contains("rlc.yaml") && err.contains("histroy"), "{err}");
}

#[test]
fn prometheus_down_fails_the_run_and_lowers_and_commits_nothing() {
    let port = test_support::process::free_port();
    let (remote, dir) = setup(&format!(
        "  prometheus:\n    url: http://127.0.0.1:{port}\n    query: up\n    retries: 1"
    ));
    let before = remote.head("main");
    let (code, out, err) = run_once(dir.path());
    assert_eq!(code, 1, "{out}\n{err}");
    assert_eq!(out["status"], "failed", "{out}");
    let e = out["error"].as_str().unwrap();
    assert!(
        e.contains("history source failed") && e.contains(&port.to_string()),
        "{e}"
    );
    assert_eq!(out["history_failed"], serde_json::json!(["maps"]), "{out}");
    // No commit, no quota lowered.
    assert_eq!(remote.head("main"), before);
    assert_eq!(remote.read("main", "buckets/maps.yaml").unwrap(), MAPS);
    // preview says the same.
    let (code, plan, err) = preview(dir.path());
    assert_eq!(code, 1, "{err}");
    assert_eq!(plan["buckets"][0]["limit_rps"], 5000.0);
}

#[test]
fn history_failed_for_some_services_exits_4_and_they_keep_their_quotas() {
    let (remote, dir) = setup("  file: h.csv");
    synth(dir.path());
    // search keeps only its first and last samples: far below min_coverage.
    let csv = std::fs::read_to_string(dir.path().join("h.csv")).unwrap();
    let lines: Vec<&str> = csv.lines().collect();
    let search: Vec<usize> = (0..lines.len())
        .filter(|&i| lines[i].contains(",search,"))
        .collect();
    let (first, last) = (search[0], *search.last().unwrap());
    let kept: Vec<&str> = lines
        .iter()
        .enumerate()
        .filter(|(i, l)| !l.contains(",search,") || *i == first || *i == last)
        .map(|(_, l)| *l)
        .collect();
    std::fs::write(dir.path().join("h.csv"), kept.join("\n") + "\n").unwrap();

    let (code, out, err) = run_once(dir.path());
    assert_eq!(code, 4, "{out}\n{err}");
    assert_eq!(out["status"], "success", "{out}");
    assert_eq!(out["history_failed"], serde_json::json!(["search"]));
    assert!(out["skipped"].as_array().unwrap().iter().any(
        |s| s["service"] == "search" && s["reason"].as_str().unwrap().contains("min_coverage")
    ));
    // The others were computed and committed; search got no file.
    assert!(remote
        .read("main", "buckets/maps.yaml")
        .unwrap()
        .contains("limit_rps: 3750\n"));
    assert!(remote.read("main", "buckets/search.yaml").is_err());
    // preview (on the working copy the run made) exits 4 as well.
    let (code, plan, err) = preview(dir.path());
    assert_eq!(code, 4, "{err}");
    assert_eq!(plan["history_failed"], serde_json::json!(["search"]));
}

#[test]
fn deleting_the_store_between_runs_does_not_let_a_second_decrease_through() {
    let (remote, dir) = setup("  file: h.csv");
    synth(dir.path());
    let (code, out, err) = run_once(dir.path());
    assert_eq!(code, 0, "{out}\n{err}");
    // 5000 → 3750: the 25 % cap of one run.
    let maps = remote.read("main", "buckets/maps.yaml").unwrap();
    assert!(maps.contains("limit_rps: 3750\n"), "{maps}");
    let commits = remote.commit_count("main").unwrap();

    for _ in 0..2 {
        std::fs::remove_file(dir.path().join("rlc.db")).unwrap();
        let (code, out, err) = run_once(dir.path());
        assert_eq!(code, 0, "{out}\n{err}");
        assert_eq!(out["status"], "unchanged", "{out}");
        let reason = out["skipped"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["service"] == "maps")
            .map(|s| s["reason"].as_str().unwrap().to_string())
            .unwrap_or_default();
        assert!(
            reason.contains("already lowered") && reason.contains("config repo history"),
            "{out}"
        );
        assert!(remote
            .read("main", "buckets/maps.yaml")
            .unwrap()
            .contains("limit_rps: 3750\n"));
        assert_eq!(remote.commit_count("main").unwrap(), commits);
    }
}

#[test]
fn a_locked_store_holds_decreases_and_leaves_the_run_record_pending() {
    use sqlx::{Connection, Executor};
    let (remote, dir) = setup("  file: h.csv");
    synth(dir.path());
    let rt = tokio::runtime::Runtime::new().unwrap();
    // The store exists; another process's exclusive transaction holds it for the whole run.
    rt.block_on(rlc::store::Store::connect("sqlite://rlc.db", dir.path()))
        .unwrap();
    let mut holder = rt
        .block_on(sqlx::SqliteConnection::connect(&format!(
            "sqlite://{}",
            dir.path().join("rlc.db").display()
        )))
        .unwrap();
    rt.block_on(holder.execute("BEGIN EXCLUSIVE")).unwrap();

    let (code, out, err) = run_once(dir.path());
    // The new buckets of payments and search are committed; the record waits: 2.
    assert_eq!(code, 2, "{out}\n{err}");
    assert_eq!(out["status"], "pending", "{out}");
    assert!(
        out["store_error"].as_str().unwrap().contains("locked"),
        "{out}"
    );
    // The decrease of maps/web.route could not be checked against the store: held.
    assert!(remote
        .read("main", "buckets/maps.yaml")
        .unwrap()
        .contains("limit_rps: 5000\n"));
    assert!(
        out["skipped"]
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s["service"] == "maps"
                && s["reason"].as_str().unwrap().contains("locked")
                && s["reason"].as_str().unwrap().contains("decrease held")),
        "{out}"
    );
    assert!(remote.read("main", "buckets/payments.yaml").is_ok());

    // The record waits in the journal (not in the memory of a process that is gone).
    assert!(
        out["store_error"]
            .as_str()
            .unwrap()
            .contains("kept in the journal"),
        "{out}"
    );
    let first_commit = out["commit"].as_str().unwrap().to_string();

    rt.block_on(holder.execute("ROLLBACK")).unwrap();
    // Once the lock is gone, the next run lowers it (the repo history has no decrease yet)
    // and is recorded.
    let (code, out, err) = run_once(dir.path());
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out["run_id"].as_i64().is_some(), "{out}");
    assert!(remote
        .read("main", "buckets/maps.yaml")
        .unwrap()
        .contains("limit_rps: 3750\n"));
    // ... and the first run, with the changes it committed, is in the store too.
    let store = rt
        .block_on(rlc::store::Store::connect("sqlite://rlc.db", dir.path()))
        .unwrap();
    let runs = rt.block_on(store.recent_runs(10)).unwrap();
    assert_eq!(runs.len(), 2, "{runs:?}");
    assert_eq!(runs[1].commit_sha.as_deref(), Some(first_commit.as_str()));
    // What it did: committed and pushed; only its record came late.
    assert_eq!(runs[1].status, "success");
    let added = rt
        .block_on(store.quota_history("payments", "api-gateway.charge"))
        .unwrap();
    assert!(
        added.iter().any(|q| q.change.as_str() == "added"
            && q.commit_sha.as_deref() == Some(first_commit.as_str())),
        "{added:?}"
    );
    assert!(
        !dir.path().join("rlc-journal").exists()
            || std::fs::read_dir(dir.path().join("rlc-journal"))
                .unwrap()
                .next()
                .is_none()
    );
}
