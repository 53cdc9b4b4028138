//! Records that survive: a run killed between its git write and its record is still in the
//! run history (from the journal), and concurrent runs on one config repo and store write and
//! record each change once. Real `rlc` binaries, a `git daemon` remote, SQLite and Postgres.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use chrono::Utc;
use test_support::git::GitRemote;
use test_support::process::Proc;

const MAPS: &str = "service: maps\nbuckets:\n  - name: web.route\n    caller: web\n    procedure: route\n    limit_rps: 5000\n    policy: peak\n";

fn remote() -> GitRemote {
    GitRemote::new(
        "main",
        &[
            ("rlc/policies.yaml", "default:\n  policy: peak\n"),
            ("buckets/maps.yaml", MAPS),
        ],
    )
    .unwrap()
}

/// rlc.yaml in `dir` with the generated four weeks of history (maps, payments, search).
fn config(dir: &Path, remote: &GitRemote, extra: &str) {
    rlc::history::synth::generate(&dir.join("h.csv"), 1, Utc::now(), 28, 60).unwrap();
    std::fs::write(
        dir.join("rlc.yaml"),
        format!(
            "history:\n  file: h.csv\nconfig_repo:\n  path: wc\n  url: {}\n  author_name: rlc-bot\n  author_email: rlc@example.com\n{extra}",
            remote.url()
        ),
    )
    .unwrap();
}

fn rlc_run(dir: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_rlc"));
    c.args(["run", "--once", "--json", "--config"])
        .arg(dir.join("rlc.yaml"))
        .current_dir(dir)
        .env("RUST_LOG", "error")
        .env("RLC_RECORDS_TOKEN", "t0ken");
    c
}

#[test]
fn a_run_killed_between_its_push_and_its_record_is_recorded_by_the_next() {
    let remote = remote();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // A controller that never answers: the run sits in its push after the git write.
    let hole = crate::git_faults::BlackHole::start();
    config(
        d,
        &remote,
        &format!(
            "controller:\n  url: http://127.0.0.1:{}\n  token_env: RLC_RECORDS_TOKEN\ndatabase_url: sqlite://rlc.db\n",
            hole.port
        ),
    );
    let seed = remote.head("main").unwrap();
    let mut run = Proc::spawn(rlc_run(d).stdout(Stdio::null()).stderr(Stdio::null())).unwrap();
    // Killed once the commit is on the remote and the run has journaled it (right after its
    // git write, before the controller push): a whole entry, renamed into place, not the
    // `.json.part` being written (a kill then leaves no entry, and the test flaked).
    let journaled = || {
        std::fs::read_dir(d.join("rlc-journal"))
            .map(|r| {
                r.flatten()
                    .any(|e| e.path().extension().is_some_and(|x| x == "json"))
            })
            .unwrap_or(false)
    };
    let mut committed = None;
    for _ in 0..1200 {
        let head = remote.head("main").unwrap();
        if head != seed && journaled() {
            committed = Some(head);
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let committed = committed.expect("the run never committed and journaled");
    run.signal(libc::SIGKILL);
    run.wait_exit(Duration::from_secs(30)).expect("killed");

    // The next run (no controller now) records the killed one first.
    std::fs::write(
        d.join("rlc.yaml"),
        std::fs::read_to_string(d.join("rlc.yaml"))
            .unwrap()
            .replace(
                &format!(
                    "controller:\n  url: http://127.0.0.1:{}\n  token_env: RLC_RECORDS_TOKEN\n",
                    hole.port
                ),
                "",
            ),
    )
    .unwrap();
    let out = rlc_run(d).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    let store = rt
        .block_on(rlc::store::Store::connect("sqlite://rlc.db", d))
        .unwrap();
    let runs = rt.block_on(store.recent_runs(10)).unwrap();
    let killed = runs
        .iter()
        .find(|r| r.commit_sha.as_deref() == Some(committed.as_str()))
        .unwrap_or_else(|| panic!("the killed run is not in the history: {runs:?}"));
    assert_eq!(killed.status, "pending", "{killed:?}");
    assert!(
        killed.summary.contains("interrupted after its git write"),
        "{killed:?}"
    );
    let history = rt
        .block_on(store.quota_history("payments", "api-gateway.charge"))
        .unwrap();
    assert!(
        history
            .iter()
            .any(|q| q.change.as_str() == "added"
                && q.commit_sha.as_deref() == Some(committed.as_str())),
        "{history:?}"
    );
}

/// Three runs at once on one config repo and one Postgres store, two of them on the same
/// working copy: one commits, each change is recorded once.
#[test]
fn concurrent_runs_record_each_change_once() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let db = rt
        .block_on(test_support::postgres::fresh_database())
        .unwrap();
    let remote = remote();
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    for d in [a.path(), b.path()] {
        config(d, &remote, &format!("database_url: '{}'\n", db.url));
    }
    let procs: Vec<Proc> = [a.path(), a.path(), b.path()]
        .into_iter()
        .map(|d| Proc::spawn(rlc_run(d).stdout(Stdio::null()).stderr(Stdio::null())).unwrap())
        .collect();
    for mut p in procs {
        let st = p.wait_exit(Duration::from_secs(300)).expect("run ended");
        assert!(st.success(), "{st:?}");
    }
    assert_eq!(
        remote.commit_count("main").unwrap(),
        2,
        "one commit of changes"
    );
    let store = rt
        .block_on(rlc::store::Store::connect(&db.url, Path::new("/")))
        .unwrap();
    let runs = rt.block_on(store.recent_runs(10)).unwrap();
    assert_eq!(runs.len(), 3, "{runs:?}");
    let with_commit: Vec<_> = runs.iter().filter(|r| r.status == "success").collect();
    assert_eq!(with_commit.len(), 1, "{runs:?}");
    for (service, bucket) in [("payments", "api-gateway.charge"), ("maps", "web.route")] {
        let h = rt.block_on(store.quota_history(service, bucket)).unwrap();
        assert_eq!(h.len(), 1, "{service}/{bucket} recorded once: {h:?}");
    }
}
