//! Whole cycles: real git remote, stand-in controller and forge, SQLite or Postgres store.

use std::future::IntoFuture;
use std::time::Duration;

use test_support::git::GitRemote;

use super::lock::FileLock;
use super::*;
use crate::cmd::run::{run, RunArgs};
use crate::gitops::tests::{plan, planned, seeded_remote, spawn_forge};
use crate::push::tests::{app as controller_app, Fake};

pub(crate) async fn spawn_controller() -> (String, Fake) {
    let fake = Fake::default();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(axum::serve(l, controller_app(fake.clone())).into_future());
    (format!("http://{addr}"), fake)
}

/// rlc.yaml in `dir` (relative paths), with the controller token in an env var.
pub(crate) fn config(remote: &GitRemote, controller: &str, extra: &str) -> DaemonConfig {
    // All tests use the same value, so setting it concurrently is harmless.
    std::env::set_var("RLC_TEST_GRL_TOKEN", "s3cret");
    std::env::set_var("RLC_TEST_FORGE_TOKEN", "forge-token");
    let text = format!(
        "history:\n  file: history.csv\nconfig_repo:\n  path: wc\n  url: {}\n  author_name: rlc-bot\n  author_email: rlc@example.com\n{extra}controller:\n  url: {controller}\n  token_env: RLC_TEST_GRL_TOKEN\ndatabase_url: sqlite://rlc.db\n",
        remote.url()
    );
    schema::parse_str::<DaemonConfig>(Path::new("rlc.yaml"), &text)
        .unwrap()
        .value
}

fn dead_url() -> String {
    let a = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    format!("http://{a}")
}

#[tokio::test]
async fn direct_mode_commits_pushes_and_records_once() {
    let remote = seeded_remote();
    let (url, ctl) = spawn_controller().await;
    let cfg = config(&remote, &url, "");
    let base = remote.scratch("");
    let p = plan(vec![planned("payments", "gw", 250.0)]);

    let out = apply_plan(&cfg, &base, &p, "once").await.unwrap();
    assert_eq!(out.status, RunStatus::Success, "{out}");
    assert_eq!(out.exit_code(), 0);
    let head = remote.head("main").unwrap();
    assert_eq!(out.commit.as_deref(), Some(head.as_str()));
    assert_eq!(out.version_pushed.as_deref(), Some(head.as_str()));
    assert_eq!(ctl.version.lock().unwrap().as_deref(), Some(head.as_str()));
    let text = out.to_string();
    assert!(text.contains("git: committed"), "{text}");
    assert!(text.contains("payments/gw: raised 100 -> 250"), "{text}");

    let again = apply_plan(&cfg, &base, &p, "once").await.unwrap();
    assert_eq!(again.status, RunStatus::Unchanged, "{again}");
    assert_eq!(remote.commit_count("main").unwrap(), 2);
    assert_eq!(
        ctl.puts.lock().unwrap().len(),
        1,
        "same version twice changes nothing"
    );

    let store = Store::connect("sqlite://rlc.db", &base).await.unwrap();
    let runs = store.recent_runs(10).await.unwrap();
    assert_eq!(runs.len(), 2);
    assert_eq!(runs[1].status, "success");
    assert_eq!(runs[1].version_pushed.as_deref(), Some(head.as_str()));
    assert_eq!(runs[0].status, "unchanged");
    let hist = store.quota_history("payments", "gw").await.unwrap();
    assert_eq!(hist.len(), 1);
    assert_eq!(hist[0].limit_rps, Some(250.0));
    assert_eq!(hist[0].previous_limit_rps, Some(100.0));
    assert!(hist[0].evidence.contains("peak_rps"));
    // Direct mode: no pull request.
    assert_eq!((runs[1].pull_request(), hist[0].pr_number), (None, None));
}

#[tokio::test]
async fn controller_down_leaves_the_commit_and_push_pending() {
    let remote = seeded_remote();
    let cfg = config(&remote, &dead_url(), "");
    let base = remote.scratch("");
    let mut cycle = Cycle::new(cfg, &base);
    cycle.push_backoff = Backoff {
        min: Duration::from_millis(10),
        max: Duration::from_millis(10),
        attempts: Some(2),
    };
    let out = cycle
        .apply(&plan(vec![planned("payments", "gw", 250.0)]), "once")
        .await;
    assert_eq!(out.status, RunStatus::Pending, "{out}");
    assert_eq!(out.exit_code(), 2);
    assert_eq!(out.commit, remote.head("main"), "the commit stands");
    assert!(
        out.push_error.as_deref().unwrap().contains("unreachable"),
        "{out}"
    );
    assert!(out.to_string().contains("push pending"));
}

#[tokio::test]
async fn rejected_push_fails_the_run_and_is_recorded() {
    let remote = seeded_remote();
    remote.reject_pushes("frozen").unwrap();
    let (url, ctl) = spawn_controller().await;
    let cfg = config(&remote, &url, "");
    let base = remote.scratch("");
    let out = apply_plan(
        &cfg,
        &base,
        &plan(vec![planned("payments", "gw", 250.0)]),
        "once",
    )
    .await
    .unwrap();
    assert_eq!(out.status, RunStatus::Failed);
    assert_eq!(out.exit_code(), 1);
    assert!(
        out.error
            .as_deref()
            .unwrap()
            .contains("pre-receive hook declined"),
        "{out}"
    );
    assert!(
        ctl.puts.lock().unwrap().is_empty(),
        "nothing pushed after a failed write"
    );
    let store = Store::connect("sqlite://rlc.db", &base).await.unwrap();
    let runs = store.recent_runs(1).await.unwrap();
    assert_eq!(runs[0].status, "failed");
    assert!(runs[0].error.as_deref().unwrap().contains("pre-receive"));
}

#[tokio::test]
async fn store_down_completes_git_work_and_records_later() {
    let remote = seeded_remote();
    let (url, _ctl) = spawn_controller().await;
    let mut cfg = config(&remote, &url, "");
    // A directory that does not exist yet: SQLite cannot open the file.
    cfg.database_url = "sqlite://later/rlc.db".into();
    let base = remote.scratch("");
    let cycle = Cycle::new(cfg, &base);
    let out = cycle
        .apply(&plan(vec![planned("payments", "gw", 250.0)]), "once")
        .await;
    assert_eq!(out.status, RunStatus::Pending, "{out}");
    assert_eq!(out.commit, remote.head("main"));
    assert!(out.store_error.is_some());
    assert_eq!(cycle.pending_records().await, 1);
    // The store comes back.
    std::fs::create_dir_all(base.join("later")).unwrap();
    assert_eq!(cycle.flush_pending().await, 1);
    let runs = cycle.store().await.unwrap().recent_runs(5).await.unwrap();
    assert_eq!(runs.len(), 1);
    assert_eq!(runs[0].commit_sha, remote.head("main"));
}

#[tokio::test]
async fn pull_request_mode_opens_a_pr_and_pushes_only_merged_config() {
    let remote = seeded_remote();
    let seed = remote.head("main").unwrap();
    let seed_tree = remote.tree("main").unwrap();
    let (ctl_url, ctl) = spawn_controller().await;
    let (forge_url, forge) = spawn_forge().await;
    let extra = format!(
        "  mode: pull-request\n  forge:\n    kind: github\n    api_url: {forge_url}\n    repo: acme/config\n    token_env: RLC_TEST_FORGE_TOKEN\n"
    );
    let cfg = config(&remote, &ctl_url, &extra);
    let base = remote.scratch("");
    let p = plan(vec![planned("payments", "gw", 250.0)]);

    let out = apply_plan(&cfg, &base, &p, "schedule").await.unwrap();
    assert_eq!(out.status, RunStatus::Success, "{out}");
    assert_eq!(out.pull_request.as_ref().map(|p| p.0), Some(1));
    assert_eq!(
        remote.head("main").as_deref(),
        Some(seed.as_str()),
        "base untouched"
    );
    assert_eq!(out.commit, remote.head("rlc/quotas"));
    // The controller keeps running the base branch until a person merges.
    assert_eq!(ctl.version.lock().unwrap().as_deref(), Some(seed.as_str()));
    {
        let prs = forge.prs.lock().unwrap();
        assert_eq!(prs.len(), 1);
        assert_eq!(prs[0]["head"], "rlc/quotas");
        assert_eq!(prs[0]["base"], "main");
        let body = prs[0]["body"].as_str().unwrap();
        assert!(
            body.contains("| gw | 100 | 250 | +150.0% | 200 | peak | 0.9 |"),
            "{body}"
        );
        // `rlc preview --format markdown` renders this very body from the plan and the base.
        let seed_dir = tempfile::tempdir().unwrap();
        test_support::git::git(
            seed_dir.path(),
            &["clone", "-q", &remote.bare_path().to_string_lossy(), "repo"],
        )
        .unwrap();
        let (seed_repo, problems) = schema::ConfigRepo::load(&seed_dir.path().join("repo"));
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(
            crate::cmd::preview::pull_request_body(&cfg, &seed_repo, &p),
            body
        );
        assert!(
            forge.problems.lock().unwrap().is_empty(),
            "{:?}",
            forge.problems.lock().unwrap()
        );
    }

    // Same plan: branch up to date, the PR is updated in place, not duplicated.
    let out = apply_plan(&cfg, &base, &p, "schedule").await.unwrap();
    assert_eq!(out.pull_request.as_ref().map(|p| p.0), Some(1), "{out}");
    assert_eq!(forge.prs.lock().unwrap().len(), 1);

    // A person merges: the next run pushes the merged config to the controller.
    let merged = remote.human_merge("rlc/quotas").unwrap();
    // Nothing but bucket files came with the merge: the run's report and summary went to the
    // pull request and the store, no file of any name to the base branch.
    assert_eq!(
        crate::gitops::tests::non_bucket_changes(&seed_tree, &remote.tree("main").unwrap()),
        Vec::<String>::new()
    );
    let out = apply_plan(&cfg, &base, &p, "schedule").await.unwrap();
    assert_eq!(out.status, RunStatus::Unchanged, "{out}");
    assert_eq!(out.version_pushed.as_deref(), Some(merged.as_str()));
    {
        let puts = ctl.puts.lock().unwrap();
        let last = puts.last().unwrap();
        assert_eq!(last["version"], merged.as_str());
        assert_eq!(last["services"][0]["buckets"][0]["limit_rps"], 250.0);
    }

    // The store keeps the pull request with the runs that opened or updated it, and with the
    // change it carries.
    let store = Store::connect("sqlite://rlc.db", &base).await.unwrap();
    let runs = store.recent_runs(10).await.unwrap();
    let pr = crate::store::PullRequestRef {
        number: 1,
        url: Some("http://forge/pr/1".into()),
    };
    assert_eq!(
        runs.iter()
            .map(|r| (r.status.as_str(), r.pull_request()))
            .collect::<Vec<_>>(),
        vec![
            ("unchanged", None),
            ("success", Some(pr.clone())),
            ("success", Some(pr.clone()))
        ]
    );
    let changes = store.quota_changes("payments", "gw", 10).await.unwrap();
    assert_eq!(changes.len(), 1);
    assert_eq!(changes[0].run_id, runs[2].id);
    assert_eq!(changes[0].commit_sha, runs[2].commit_sha);
    assert_eq!(changes[0].pull_request, Some(pr));
}

#[tokio::test]
async fn outdated_proposal_is_closed_with_a_comment_and_its_branch_deleted() {
    let remote = seeded_remote();
    let (ctl_url, ctl) = spawn_controller().await;
    let (forge_url, forge) = spawn_forge().await;
    let base = remote.scratch("");
    let back = plan(vec![planned("payments", "gw", 100.0)]);
    let cut = plan(vec![planned("payments", "gw", 75.0)]);
    // The base carries rlc's own rendering of the current quota (same working copy).
    let direct = config(&remote, &ctl_url, "");
    let out = apply_plan(&direct, &base, &back, "schedule").await.unwrap();
    assert_eq!(out.git, Some(GitOutcome::Committed), "{out}");
    let main = remote.head("main").unwrap();
    let extra = format!(
        "  mode: pull-request\n  forge:\n    kind: github\n    api_url: {forge_url}\n    repo: acme/config\n    token_env: RLC_TEST_FORGE_TOKEN\n"
    );
    let cfg = config(&remote, &ctl_url, &extra);

    // A 25% cut is proposed.
    let out = apply_plan(&cfg, &base, &cut, "schedule").await.unwrap();
    assert_eq!(out.pull_request.as_ref().map(|p| p.0), Some(1), "{out}");
    assert!(remote.head("rlc/quotas").is_some());

    // Traffic came back: the plan equals the base. The PR is closed, saying why, and the
    // branch is gone, so the cut can no longer be merged.
    let out = apply_plan(&cfg, &base, &back, "schedule").await.unwrap();
    assert_eq!(out.status, RunStatus::Unchanged, "{out}");
    assert_eq!(out.exit_code(), 0);
    assert_eq!(
        out.closed_pull_requests,
        vec![(1, Some("http://forge/pr/1".to_string()))]
    );
    let text = out.to_string();
    assert!(
        text.contains("deleted outdated branch rlc/quotas"),
        "{text}"
    );
    assert!(
        text.contains("#1 closed, its proposal is outdated"),
        "{text}"
    );
    assert_eq!(remote.head("rlc/quotas"), None);
    assert_eq!(remote.head("main").as_deref(), Some(main.as_str()));
    assert_eq!(ctl.version.lock().unwrap().as_deref(), Some(main.as_str()));
    {
        let prs = forge.prs.lock().unwrap();
        assert_eq!(prs[0]["state"], "closed");
        let comments = prs[0]["comments"].as_array().unwrap();
        assert_eq!(comments.len(), 1);
        let c = comments[0].as_str().unwrap();
        assert!(c.contains("outdated") && c.contains("`main`"), "{c}");
        let calls = forge.calls.lock().unwrap();
        let n = calls.len();
        assert_eq!(
            calls[n - 3..],
            [
                "GET acme/config head=Some(\"acme:rlc/quotas\") state=Some(\"open\")".to_string(),
                "COMMENT 1".to_string(),
                "PATCH 1 state=closed".to_string()
            ]
        );
        assert!(
            forge.problems.lock().unwrap().is_empty(),
            "{:?}",
            forge.problems.lock().unwrap()
        );
    }

    // Nothing left to withdraw: no more forge calls.
    let calls = forge.calls.lock().unwrap().len();
    let out = apply_plan(&cfg, &base, &back, "schedule").await.unwrap();
    assert_eq!(out.git, Some(GitOutcome::Unchanged), "{out}");
    assert!(out.closed_pull_requests.is_empty());
    assert_eq!(forge.calls.lock().unwrap().len(), calls);

    // A new cut opens a new PR on a fresh branch.
    let out = apply_plan(&cfg, &base, &cut, "schedule").await.unwrap();
    assert_eq!(out.pull_request.as_ref().map(|p| p.0), Some(2), "{out}");
    assert_eq!(forge.prs.lock().unwrap()[1]["state"], "open");
}

#[tokio::test]
async fn outdated_branch_without_a_forge_is_just_deleted() {
    let remote = seeded_remote();
    let (ctl_url, _ctl) = spawn_controller().await;
    let base = remote.scratch("");
    let back = plan(vec![planned("payments", "gw", 100.0)]);
    let direct = config(&remote, &ctl_url, "");
    apply_plan(&direct, &base, &back, "schedule").await.unwrap();
    let cfg = config(
        &remote,
        &ctl_url,
        "  mode: pull-request\n  forge:\n    kind: none\n",
    );
    let out = apply_plan(
        &cfg,
        &base,
        &plan(vec![planned("payments", "gw", 75.0)]),
        "schedule",
    )
    .await
    .unwrap();
    assert_eq!(out.status, RunStatus::Success, "{out}");
    assert!(remote.head("rlc/quotas").is_some());
    let out = apply_plan(&cfg, &base, &back, "schedule").await.unwrap();
    assert_eq!(out.status, RunStatus::Unchanged, "{out}");
    assert!(out.to_string().contains("deleted outdated branch"), "{out}");
    assert_eq!(remote.head("rlc/quotas"), None);
}

#[tokio::test]
async fn postgres_store_records_runs_too() {
    let db = test_support::postgres::fresh_database().await.unwrap();
    let remote = seeded_remote();
    let (url, _ctl) = spawn_controller().await;
    let mut cfg = config(&remote, &url, "");
    cfg.database_url = db.url.clone();
    let base = remote.scratch("");
    let out = apply_plan(
        &cfg,
        &base,
        &plan(vec![planned("payments", "gw", 250.0)]),
        "api",
    )
    .await
    .unwrap();
    assert_eq!(out.status, RunStatus::Success, "{out}");
    assert!(out.run_id.is_some());
    let store = Store::connect(&db.url, &base).await.unwrap();
    assert_eq!(
        store.quota_history("payments", "gw").await.unwrap().len(),
        1
    );
}

#[tokio::test]
async fn run_once_reads_rlc_yaml_with_relative_paths() {
    let remote = seeded_remote();
    let (url, ctl) = spawn_controller().await;
    std::env::set_var("RLC_TEST_GRL_TOKEN", "s3cret");
    let dir = remote.scratch("deploy");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("rlc.yaml"),
        format!(
            "history:\n  file: history.csv\nconfig_repo:\n  path: ./config-repo\n  url: {}\ncontroller:\n  url: {url}\n  token_env: RLC_TEST_GRL_TOKEN\ndatabase_url: sqlite://rlc.db\n",
            remote.url()
        ),
    )
    .unwrap();
    let planner: Planner = Arc::new(|input: PlanInput| {
        Box::pin(async move {
            assert!(input.repo_dir.ends_with("config-repo"));
            Ok(plan(vec![planned("payments", "gw", 250.0)]))
        })
    });
    let args = RunArgs {
        config: dir.join("rlc.yaml"),
        once: true,
        json: false,
    };
    assert_eq!(run(args.clone(), planner.clone()).await.unwrap(), 0);
    assert!(dir.join("config-repo/buckets/payments.yaml").exists());
    assert!(dir.join("rlc.db").exists());
    assert_eq!(ctl.version.lock().unwrap().clone(), remote.head("main"));
    // A planner failure fails the run with exit status 1 and nothing written.
    let failing: Planner =
        Arc::new(|_| Box::pin(async { anyhow::bail!("prometheus unreachable") }));
    assert_eq!(run(args, failing).await.unwrap(), 1);
    assert_eq!(remote.commit_count("main").unwrap(), 2);
}

#[test]
fn run_summary_names_mode_and_scope_changes() {
    let mut old = planned("pay", "gw", 10.0).bucket;
    old.mode = schema::Mode::Shadow;
    old.scope = schema::Scope::Region;
    let before: std::collections::BTreeMap<String, schema::BucketFile> = [(
        "pay".to_string(),
        schema::BucketFile {
            criticality: Default::default(),
            service: "pay".into(),
            buckets: vec![old],
        },
    )]
    .into();
    let mut out = RunOutcome::new("once", "test-run");
    out.git = Some(GitOutcome::Committed);
    out.summary = rlc_plan::change::diff(
        &before,
        &[schema::BucketFile {
            criticality: Default::default(),
            service: "pay".into(),
            buckets: vec![planned("pay", "gw", 10.0).bucket],
        }],
    );
    let text = out.to_string();
    assert!(
        text.contains("pay/gw: modified 10 -> 10 (mode shadow -> enforce, scope region -> global)"),
        "{text}"
    );
    assert!(
        text.contains("modified 1; mode changed 1, scope changed 1"),
        "{text}"
    );
}

/// A plan lowering `payments/gw` from `current` to `to`.
fn lowering(current: f64, to: f64) -> Plan {
    let mut b = planned("payments", "gw", to);
    b.current_limit_rps = Some(current);
    plan(vec![b])
}

#[tokio::test]
async fn one_decrease_per_bucket_per_interval() {
    let remote = seeded_remote();
    let (url, _ctl) = spawn_controller().await;
    let cfg = config(&remote, &url, "");
    let base = remote.scratch("");
    let cycle = Cycle::new(cfg.clone(), &base);

    let first = cycle.apply(&lowering(100.0, 80.0), "once").await;
    assert_eq!(first.status, RunStatus::Success, "{first}");
    assert!(remote
        .read("main", "buckets/payments.yaml")
        .unwrap()
        .contains("limit_rps: 80\n"));

    // A second run the same day may not compound the cut.
    let second = cycle.apply(&lowering(80.0, 60.0), "inputs-changed").await;
    assert_eq!(second.status, RunStatus::Unchanged, "{second}");
    assert!(remote
        .read("main", "buckets/payments.yaml")
        .unwrap()
        .contains("limit_rps: 80\n"));
    assert!(
        second
            .skipped
            .iter()
            .any(|s| s.reason.contains("already lowered")),
        "{:?}",
        second.skipped
    );
    // Increases are never held.
    let up = cycle.apply(&lowering(80.0, 120.0), "once").await;
    assert_eq!(up.status, RunStatus::Success, "{up}");

    // With the guard off, the next decrease goes through.
    let mut off = cfg;
    off.rails.decrease_interval = "1s".parse().unwrap();
    let cycle = Cycle::new(off, &base);
    let down = cycle.apply(&lowering(120.0, 90.0), "once").await;
    assert_eq!(down.status, RunStatus::Success, "{down}");
    assert!(remote
        .read("main", "buckets/payments.yaml")
        .unwrap()
        .contains("limit_rps: 90\n"));
}

#[tokio::test]
async fn a_decrease_is_held_when_the_store_cannot_say() {
    let remote = seeded_remote();
    let (url, _ctl) = spawn_controller().await;
    let mut cfg = config(&remote, &url, "");
    cfg.database_url = "sqlite://missing-dir/rlc.db".into();
    let base = remote.scratch("");
    let out = Cycle::new(cfg, &base)
        .apply(&lowering(100.0, 80.0), "once")
        .await;
    assert!(
        !remote
            .read("main", "buckets/payments.yaml")
            .unwrap()
            .contains("limit_rps: 80\n"),
        "{out}"
    );
    assert!(
        out.skipped
            .iter()
            .any(|s| s.reason.contains("store unavailable")),
        "{:?}",
        out.skipped
    );
}

#[tokio::test]
async fn a_push_race_that_never_ends_fails_the_run_and_reports_every_attempt() {
    let remote = seeded_remote();
    remote.race_pushes(10).unwrap();
    let (url, ctl) = spawn_controller().await;
    let cfg = config(&remote, &url, "");
    let base = remote.scratch("");
    let out = Cycle::new(cfg, &base)
        .apply(&plan(vec![planned("payments", "gw", 250.0)]), "once")
        .await;
    assert_eq!(out.status, RunStatus::Failed, "{out}");
    assert_eq!(out.exit_code(), 1);
    let json = serde_json::to_value(&out).unwrap();
    assert_eq!(json["attempts"], 3, "{json}");
    assert!(
        json["error"]
            .as_str()
            .unwrap()
            .contains("gave up after 3 attempts"),
        "{json}"
    );
    assert!(ctl.puts.lock().unwrap().is_empty());
    assert!(!remote
        .read("main", "buckets/payments.yaml")
        .unwrap()
        .contains("limit_rps: 250"));
}

#[tokio::test]
async fn a_decrease_is_held_after_the_store_is_lost_between_runs() {
    let remote = seeded_remote();
    let (url, _ctl) = spawn_controller().await;
    let cfg = config(&remote, &url, "");
    let base = remote.scratch("");

    let first = Cycle::new(cfg.clone(), &base)
        .apply(&lowering(100.0, 80.0), "once")
        .await;
    assert_eq!(first.status, RunStatus::Success, "{first}");
    // The store is lost (deleted, as by a careless clean-up or a fresh volume).
    std::fs::remove_file(base.join("rlc.db")).unwrap();

    // A new process with an empty store: the config repo's history still says "lowered".
    let second = Cycle::new(cfg.clone(), &base)
        .apply(&lowering(80.0, 60.0), "once")
        .await;
    assert_eq!(second.status, RunStatus::Unchanged, "{second}");
    assert!(remote
        .read("main", "buckets/payments.yaml")
        .unwrap()
        .contains("limit_rps: 80\n"));
    assert!(
        second
            .skipped
            .iter()
            .any(|s| s.reason.contains("already lowered")
                && s.reason.contains("config repo history")),
        "{:?}",
        second.skipped
    );

    // A person's decrease counts as well.
    remote
        .human_commit(
            "main",
            &[(
                "buckets/payments.yaml",
                "service: payments\nbuckets:\n  - name: gw\n    caller: gw\n    scope: global\n    limit_rps: 70\n    mode: enforce\n    policy: peak\n",
            )],
            "lower gw by hand",
        )
        .unwrap();
    std::fs::remove_file(base.join("rlc.db")).unwrap();
    let third = Cycle::new(cfg, &base)
        .apply(&lowering(70.0, 55.0), "once")
        .await;
    assert!(
        remote
            .read("main", "buckets/payments.yaml")
            .unwrap()
            .contains("limit_rps: 70\n"),
        "{third}"
    );
}

#[tokio::test]
async fn an_old_decrease_in_the_repo_history_does_not_hold_a_new_one() {
    let remote = seeded_remote();
    let (url, _ctl) = spawn_controller().await;
    let mut cfg = config(&remote, &url, "");
    let base = remote.scratch("");
    let first = Cycle::new(cfg.clone(), &base)
        .apply(&lowering(100.0, 80.0), "once")
        .await;
    assert_eq!(first.status, RunStatus::Success, "{first}");
    std::fs::remove_file(base.join("rlc.db")).unwrap();
    // With a 2 s interval the first decrease is outside it after 3 s.
    cfg.rails.decrease_interval = "2s".parse().unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let second = Cycle::new(cfg, &base)
        .apply(&lowering(80.0, 60.0), "once")
        .await;
    assert_eq!(second.status, RunStatus::Success, "{second}");
    assert!(remote
        .read("main", "buckets/payments.yaml")
        .unwrap()
        .contains("limit_rps: 60\n"));
}

/// A run whose planner makes `vanish` happen to the SQLite file of an open store.
async fn store_vanishes_mid_run(vanish: impl Fn(&Path) + Send + Sync + 'static, what: &str) {
    let remote = seeded_remote();
    let (url, _ctl) = spawn_controller().await;
    let cfg = config(&remote, &url, "");
    let base = remote.scratch("");
    let db = base.join("rlc.db");
    let cycle = Cycle::new(cfg.clone(), &base);
    cycle.store().await.unwrap();
    assert!(db.exists());
    let vanish = Arc::new(vanish);
    let d = db.clone();
    let planner: Planner = Arc::new(move |_input: PlanInput| {
        let (vanish, d) = (vanish.clone(), d.clone());
        Box::pin(async move {
            vanish(&d);
            Ok(lowering(100.0, 80.0))
        })
    });
    let out = cycle.run(&planner, "once").await;
    // The guard asked the store before the planner ran (the run gathers its evidence first):
    // the decrease is committed, and the record is what cannot be written.
    assert!(
        remote
            .read("main", "buckets/payments.yaml")
            .unwrap()
            .contains("limit_rps: 80\n"),
        "{out}"
    );
    // The run is not recorded into a new or substituted database, and says so.
    assert_eq!(out.status, RunStatus::Pending, "{out}");
    assert_eq!(out.exit_code(), 2);
    let e = out.store_error.as_deref().unwrap_or_default();
    assert!(e.contains(what) && e.contains("rlc.db"), "{e}");
    let again = cycle.store().await.unwrap_err().to_string();
    assert!(again.contains(what), "{again}");
    match what {
        "deleted" => assert!(!db.exists(), "a new database was created"),
        _ => {
            let other = Store::connect("sqlite://rlc.db", &base).await.unwrap();
            assert!(other.recent_runs(5).await.unwrap().is_empty());
        }
    }
}

#[tokio::test]
async fn a_store_deleted_during_a_run_is_an_error_not_a_new_database() {
    store_vanishes_mid_run(|db| std::fs::remove_file(db).unwrap(), "deleted").await;
}

#[tokio::test]
async fn a_store_replaced_during_a_run_is_an_error() {
    store_vanishes_mid_run(
        |db| {
            // Another (empty) SQLite database moved over the file, as a restore would.
            let other = db.with_file_name("other.db");
            std::fs::copy(db, &other).unwrap();
            std::fs::rename(&other, db).unwrap();
        },
        "replaced",
    )
    .await;
}

// ---------------------------------------------------------------------------------------------
// The working copy's lock and children forked meanwhile.

/// A child forked from this process that does nothing until it is killed (or 30 s passed): it
/// holds a copy of every descriptor this process had open at the fork, as a child that another
/// thread forks (a test's `git`) holds them until it execs. Killed and reaped when dropped.
struct ForkedChild(libc::pid_t);

impl ForkedChild {
    fn fork() -> ForkedChild {
        // SAFETY: the child calls only async-signal-safe functions (sleep, _exit) and never
        // returns into the parent's code.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            unsafe {
                libc::sleep(30);
                libc::_exit(0);
            }
        }
        ForkedChild(pid)
    }
}

impl Drop for ForkedChild {
    fn drop(&mut self) {
        // SAFETY: signals and reaps our own child, which nothing else waits for.
        unsafe {
            libc::kill(self.0, libc::SIGKILL);
            let mut status = 0;
            libc::waitpid(self.0, &mut status, 0);
        }
    }
}

/// A child forked while a run holds the working copy's lock keeps a copy of the lock's
/// descriptor until it execs (here, until it is killed). The run's end still releases the
/// lock: the daemon's next poll is not skipped as if another rlc run worked on the config repo
/// (it was, now and then, in the rollout tests, whose fixtures run `git` on other threads).
#[tokio::test]
async fn a_child_forked_during_a_run_does_not_keep_the_run_lock() {
    let remote = seeded_remote();
    let (url, _ctl) = spawn_controller().await;
    let cycle = Cycle::new(config(&remote, &url, ""), &remote.scratch(""));
    let child: Arc<std::sync::Mutex<Option<ForkedChild>>> = Default::default();
    let forked = child.clone();
    let planner: Planner = Arc::new(move |_input: PlanInput| {
        let forked = forked.clone();
        Box::pin(async move {
            *forked.lock().unwrap() = Some(ForkedChild::fork());
            Ok(plan(vec![planned("payments", "gw", 250.0)]))
        })
    });
    let out = cycle.run(&planner, "once").await;
    assert_eq!(out.status, RunStatus::Success, "{out}");
    assert!(child.lock().unwrap().is_some(), "forked during the run");
    let polled = cycle.poll().await.map(|(hash, _)| hash);
    assert!(polled.is_ok(), "{polled:?}");
    drop(child.lock().unwrap().take());
}

/// The lock a poll or a run releases is free at once for another open file, even though a
/// child forked while it was held still has the descriptor.
#[test]
fn a_released_lock_is_free_though_a_forked_child_has_its_descriptor() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(".wc.rlc-lock");
    let held = FileLock::open(&path).unwrap();
    assert!(held.try_take().unwrap());
    let other = FileLock::open(&path).unwrap();
    assert!(!other.try_take().unwrap(), "held");
    let child = ForkedChild::fork();
    drop(held);
    assert!(
        other.try_take().unwrap(),
        "released although the child still has the descriptor"
    );
    drop(child);
}

// ---------------------------------------------------------------------------------------------
// Promotion out of shadow over days of simulated shadow figures.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::shadow::ShadowQuery;
use rlc_plan::promotion::BucketKey;
use rlc_plan::readiness::ShadowStats;

const PROMOTION: &str = "promotion:\n  default:\n    min_days_in_shadow: 7\n";

/// A remote whose `payments` service has one enforced bucket and three in shadow: `steady`
/// (traffic well under its limit), `hot` (above its limit now and then) and `silent` (no
/// shadow reports at all).
fn shadow_remote(promotion: &str) -> GitRemote {
    // Rendered as rlc renders: an unchanged plan makes no commit.
    let buckets = schema::render_bucket_file(&shadow_plan().bucket_files()[0]);
    let policies = format!("default:\n  policy: peak\n  headroom: 0.25\n{promotion}");
    GitRemote::new(
        "main",
        &[
            ("rlc/policies.yaml", policies.as_str()),
            ("buckets/payments.yaml", buckets.as_str()),
        ],
    )
    .unwrap()
}

/// The plan of every run: the same limits as the repo (only promotions can change anything).
fn shadow_plan() -> Plan {
    let mut buckets = vec![planned("payments", "gw", 100.0)];
    for name in ["hot", "silent", "steady"] {
        let mut b = planned("payments", name, 100.0);
        b.bucket.mode = schema::Mode::Shadow;
        buckets.push(b);
    }
    for b in &mut buckets {
        b.current_limit_rps = Some(100.0);
        b.evidence = rlc_plan::evidence::Evidence {
            peak_rps: Some(80.0),
            confidence: Some(1.0),
            peak_at: Some("2026-11-20T14:03:00Z".into()),
            ..Default::default()
        };
    }
    plan(buckets)
}

/// Shadow figures of a bucket in shadow for `days` (capped to the window), from per-minute
/// offered rates `rate(minute)` under `limit`: what the shadow store computes from its
/// per-minute roll-ups.
fn simulate(
    key: &BucketKey,
    q: &ShadowQuery,
    days: u32,
    limit: f64,
    rate: impl Fn(usize) -> f64,
) -> ShadowStats {
    let since = q.now - chrono::Duration::days(days as i64);
    let start = since.max(q.window_start);
    let window_minutes = (q.now - q.window_start).num_minutes().max(1) as f64;
    let minutes = (q.now - start).num_minutes().max(0) as usize;
    let (mut offered, mut vdrop, mut peak, mut peak_at) = (0.0, 0.0, 0.0f64, None);
    let mut rates = Vec::with_capacity(minutes);
    for m in 0..minutes {
        let r = rate(m);
        rates.push(r);
        let d = (r - limit).max(0.0);
        offered += r * 60.0;
        vdrop += d * 60.0;
        if r > 0.0 && d / r > peak {
            peak = d / r;
            peak_at = Some(start + chrono::Duration::minutes(m as i64));
        }
    }
    ShadowStats {
        service: key.0.clone(),
        bucket: key.1.clone(),
        mode: "shadow".into(),
        window_start: q.window_start,
        window_end: q.now,
        shadow_since: Some(since),
        last_report: Some(q.now - chrono::Duration::seconds(30)),
        coverage: minutes as f64 / window_minutes,
        offered,
        virtual_dropped: vdrop,
        dropped: 0.0,
        peak_drop_share: peak,
        peak_drop_at: peak_at,
        limit_rps: limit,
        suggested_limit_rps: rlc_plan::readiness::suggested_limit(&rates, 1e-4),
    }
}

/// A shadow source simulating `day` days of shadow reports: `steady` at 40–60 rps, `hot`
/// at 80 rps with one minute in 50 at 160 rps, `silent` without reports. Counts the queries.
fn simulated_source(day: Arc<AtomicU32>, queries: Arc<AtomicU32>) -> ShadowSource {
    Arc::new(move |q: ShadowQuery| {
        let days = day.load(Ordering::SeqCst);
        queries.fetch_add(1, Ordering::SeqCst);
        Box::pin(async move {
            let mut out = BTreeMap::new();
            for k in &q.buckets {
                let s = match k.1.as_str() {
                    "steady" => simulate(k, &q, days, 100.0, |m| {
                        50.0 + 10.0 * ((m % 60) as f64 / 30.0 - 1.0)
                    }),
                    "hot" => simulate(
                        k,
                        &q,
                        days,
                        100.0,
                        |m| if m % 50 == 0 { 160.0 } else { 80.0 },
                    ),
                    _ => continue,
                };
                out.insert(k.clone(), s);
            }
            Ok(out)
        })
    })
}

/// The seam's two sides agree: days of shadow reports stored as `rlc serve` stores them (one
/// report a minute per bucket, rolled up by the hourly pass) give, through
/// [`crate::shadow::store_source`], the figures [`simulated_source`] gives for the same
/// traffic; so the promotion tests over simulated figures speak for the store too. A bucket
/// without reports gets no figures (never promoted).
#[tokio::test]
async fn days_of_stored_reports_give_the_simulated_figures() {
    let dir = tempfile::tempdir().unwrap();
    let store = crate::store::Store::connect("sqlite://rlc.db", dir.path())
        .await
        .unwrap();
    let now = crate::store::minute_of(Utc::now());
    let days = 8u32;
    let window_start = now - chrono::Duration::days(7);
    let steady = |m: usize| 50.0 + 10.0 * ((m % 60) as f64 / 30.0 - 1.0);
    let hot = |m: usize| if m.is_multiple_of(50) { 160.0 } else { 80.0 };
    // Minute k counts from the window's start (as `simulate` counts); the day before it
    // repeats the same pattern (3,000 minutes: a multiple of both periods).
    let mut batch: Vec<grl_wire::ReportRow> = Vec::new();
    let mut seq = 0;
    for k in -1440i64..(7 * 1440) {
        let t = window_start + chrono::Duration::minutes(k);
        let m = k.rem_euclid(3000) as usize;
        for (bucket, r) in [("steady", steady(m)), ("hot", hot(m))] {
            seq += 1;
            let over = (r - 100.0f64).max(0.0);
            batch.push(
                serde_json::from_value(serde_json::json!({
                    "seq": seq, "t": t.timestamp(), "service": "payments", "bucket": bucket,
                    "caller": null, "procedure": null, "mode": "shadow", "scope_key": "global",
                    "offered": r, "admitted": r, "dropped": 0.0, "shadow_dropped": over,
                    "limit_rps": 100.0, "drop_ratio": over / r
                }))
                .unwrap(),
            );
        }
    }
    for chunk in batch.chunks(20_000) {
        store.insert_reports(chunk, Utc::now()).await.unwrap();
    }
    while store.roll_up_hours(Utc::now()).await.unwrap() > 0 {}

    let key = |b: &str| ("payments".to_string(), b.to_string());
    let q = ShadowQuery {
        buckets: vec![key("steady"), key("hot"), key("silent")],
        window_start,
        now,
    };
    let got = (crate::shadow::store_source(store))(q.clone())
        .await
        .unwrap();
    assert!(
        got.get(&key("silent"))
            .is_none_or(|s| s.last_report.is_none()),
        "{got:?}"
    );
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0);
    for (b, want) in [
        ("steady", simulate(&key("steady"), &q, days, 100.0, steady)),
        ("hot", simulate(&key("hot"), &q, days, 100.0, hot)),
    ] {
        let g = &got[&key(b)];
        assert_eq!(g.mode, "shadow", "{b}");
        assert_eq!(g.limit_rps, want.limit_rps, "{b}");
        assert_eq!(g.shadow_since, want.shadow_since, "{b}");
        assert!(
            (g.coverage - want.coverage).abs() < 1e-3,
            "{b}: {g:?} vs {want:?}"
        );
        // The store sums per-report rates (requests at the controller's one report a
        // second); here one report stands for a minute, `simulate` counts its 60 seconds.
        assert!(
            close(g.offered * 60.0, want.offered),
            "{b}: {g:?} vs {want:?}"
        );
        assert!(
            close(g.virtual_dropped * 60.0, want.virtual_dropped),
            "{b}: {g:?} vs {want:?}"
        );
        assert!(
            close(g.peak_drop_share, want.peak_drop_share),
            "{b}: {g:?} vs {want:?}"
        );
        assert_eq!(g.peak_drop_at, want.peak_drop_at, "{b}");
        match (g.suggested_limit_rps, want.suggested_limit_rps) {
            (Some(x), Some(y)) => assert!(close(x, y), "{b}: {x} vs {y}"),
            (x, y) => assert_eq!(x, y, "{b}"),
        }
        // The same verdict either way.
        assert_eq!(
            g.drop_share() > 1e-4,
            want.drop_share() > 1e-4,
            "{b}: {g:?} vs {want:?}"
        );
    }
}

fn reasons(out: &RunOutcome) -> Vec<(String, bool, String)> {
    out.promotions
        .iter()
        .map(|p| (p.bucket.clone(), p.promoted, p.reason.clone()))
        .collect()
}

#[tokio::test]
async fn a_ready_shadow_bucket_is_proposed_once_in_a_pr_that_lists_it_first() {
    let remote = shadow_remote(PROMOTION);
    let seed = remote.head("main").unwrap();
    let (ctl_url, _ctl) = spawn_controller().await;
    let (forge_url, forge) = spawn_forge().await;
    let extra = format!(
        "  mode: pull-request\n  forge:\n    kind: github\n    api_url: {forge_url}\n    repo: acme/config\n    token_env: RLC_TEST_FORGE_TOKEN\n    dashboard_url: http://dash.example/\n"
    );
    let cfg = config(&remote, &ctl_url, &extra);
    let base = remote.scratch("");
    let day = Arc::new(AtomicU32::new(3));
    let queries = Arc::new(AtomicU32::new(0));
    let mut cycle = Cycle::new(cfg, &base);
    cycle.set_shadow_source(simulated_source(day.clone(), queries.clone()));
    let p = shadow_plan();

    // Day 3: nothing is ready; every shadow bucket says why.
    let out = cycle.apply(&p, "schedule").await;
    assert_eq!(out.status, RunStatus::Unchanged, "{out}");
    let r = reasons(&out);
    assert_eq!(r.len(), 3, "{r:?}");
    assert_eq!((r[0].0.as_str(), r[0].1), ("hot", false));
    assert!(r[0].2.contains("3.0 of 7 days in shadow"), "{r:?}");
    assert!(r[0].2.contains("virtual drops"), "{r:?}");
    assert_eq!(
        (r[1].0.as_str(), r[1].1, r[1].2.as_str()),
        ("silent", false, "not yet: no shadow reports")
    );
    assert_eq!((r[2].0.as_str(), r[2].1), ("steady", false));
    assert!(
        r[2].2.starts_with("not yet: coverage 42.9% < 90.0%"),
        "{r:?}"
    );
    assert!(
        out.to_string()
            .contains("promotion payments/silent: stays in shadow (not yet: no shadow reports)"),
        "{out}"
    );
    assert!(forge.prs.lock().unwrap().is_empty(), "{out}");
    assert_eq!(remote.head("rlc/quotas"), None);

    // Day 8: `steady` meets the rule and is proposed; `hot` would throttle; `silent` has
    // no data.
    day.store(8, Ordering::SeqCst);
    let out = cycle.apply(&p, "schedule").await;
    assert_eq!(out.status, RunStatus::Success, "{out}");
    assert_eq!(out.pull_request.as_ref().map(|p| p.0), Some(1), "{out}");
    let r = reasons(&out);
    assert_eq!(
        r.iter()
            .map(|(b, p, _)| (b.as_str(), *p))
            .collect::<Vec<_>>(),
        [("hot", false), ("silent", false), ("steady", true)]
    );
    // The 7-day window (10,080 minutes) has 202 minutes at 160 rps (minutes 0, 50, …) over a
    // 100 rps limit, the rest at 80.
    let hot_share = (202.0 * 60.0) / (202.0 * 160.0 + (10_080.0 - 202.0) * 80.0);
    assert_eq!(
        r[0].2,
        format!("would throttle {:.3}% of requests", hot_share * 100.0)
    );
    assert_eq!(
        remote.head("main").as_deref(),
        Some(seed.as_str()),
        "base untouched"
    );
    let branch = remote.read("rlc/quotas", "buckets/payments.yaml").unwrap();
    let modes: Vec<&str> = branch
        .lines()
        .filter_map(|l| l.trim().strip_prefix("mode: "))
        .collect();
    assert_eq!(
        modes,
        ["enforce", "shadow", "shadow", "enforce"],
        "{branch}"
    );
    {
        let prs = forge.prs.lock().unwrap();
        assert_eq!(prs.len(), 1);
        let body = prs[0]["body"].as_str().unwrap();
        let first = body.find("- **").expect(body);
        assert!(
            body[first..].starts_with("- **promotion** [payments/steady](http://dash.example/buckets/payments/steady): promotion shadow → enforce at 100 rps · limit ÷ peak 1.25 (peak 80 rps at 2026-11-20 14:03 UTC) · shadow: 8.0 days in shadow, coverage 100.0%, virtual drops 0.000%"),
            "{body}"
        );
        // The suggested limit keeps virtual drops ≤ 0.01 %: just under the 59.67 rps peak.
        let suggested: f64 = body[first..]
            .split("suggested limit ")
            .nth(1)
            .and_then(|r| r.split(' ').next())
            .and_then(|v| v.parse().ok())
            .expect(body);
        assert!(
            suggested > 59.0 && suggested <= 50.0 + 10.0 * (59.0 / 30.0 - 1.0),
            "{body}"
        );
        assert!(first < body.find("| bucket | current |").unwrap(), "{body}");
        assert!(
            body.contains("### Staying in shadow\n\n- payments/hot: would throttle"),
            "{body}"
        );
        assert!(
            body.contains("- payments/silent: not yet: no shadow reports"),
            "{body}"
        );
        assert!(!body.contains("**promotion** [payments/hot"), "{body}");
        assert!(
            forge.problems.lock().unwrap().is_empty(),
            "{:?}",
            forge.problems.lock().unwrap()
        );
    }
    // The stored run carries the full report (it is not committed anywhere).
    let runs = cycle.store().await.unwrap().recent_runs(1).await.unwrap();
    assert!(
        runs[0].summary.contains("**promotion**"),
        "{}",
        runs[0].summary
    );
    assert!(remote.read("rlc/quotas", "rlc/last-run.md").is_err());

    // Day 9: the proposal stands; the PR is updated, not duplicated.
    day.store(9, Ordering::SeqCst);
    let out = cycle.apply(&p, "schedule").await;
    assert_eq!(out.pull_request.as_ref().map(|p| p.0), Some(1), "{out}");
    assert_eq!(forge.prs.lock().unwrap().len(), 1);
    let posts = forge
        .calls
        .lock()
        .unwrap()
        .iter()
        .filter(|c| c.starts_with("POST"))
        .count();
    assert_eq!(posts, 1);

    // A person merges: the bucket is enforced and never proposed again.
    remote.human_merge("rlc/quotas").unwrap();
    day.store(10, Ordering::SeqCst);
    let out = cycle.apply(&p_after_merge(), "schedule").await;
    assert_eq!(out.status, RunStatus::Unchanged, "{out}");
    assert_eq!(
        reasons(&out)
            .iter()
            .map(|(b, _, _)| b.as_str())
            .collect::<Vec<_>>(),
        ["hot", "silent"]
    );
    assert_eq!(forge.prs.lock().unwrap().len(), 1);
    assert!(queries.load(Ordering::SeqCst) >= 4);
}

/// The plan once `steady` is enforced in the repo.
fn p_after_merge() -> Plan {
    let mut p = shadow_plan();
    for b in &mut p.buckets {
        if b.bucket.name == "steady" {
            b.bucket.mode = schema::Mode::Enforce;
        }
    }
    p
}

#[tokio::test]
async fn direct_mode_commits_a_promotion_once_when_auto_merge_allows_it() {
    let remote = shadow_remote("promotion:\n  default:\n    auto_merge: [raise, promotion]\n");
    let seed = remote.head("main").unwrap();
    let (ctl_url, _ctl) = spawn_controller().await;
    let cfg = config(&remote, &ctl_url, "");
    let base = remote.scratch("");
    let day = Arc::new(AtomicU32::new(8));
    let mut cycle = Cycle::new(cfg, &base);
    cycle.set_shadow_source(simulated_source(day, Arc::new(AtomicU32::new(0))));

    let out = cycle.apply(&shadow_plan(), "schedule").await;
    assert_eq!(out.status, RunStatus::Success, "{out}");
    let head = remote.head("main").unwrap();
    assert_ne!(head, seed);
    let file = remote.read("main", "buckets/payments.yaml").unwrap();
    assert!(file.contains("name: steady\n    caller: steady\n    scope: global\n    limit_rps: 100\n    mode: enforce"), "{file}");
    assert!(
        file.contains(
            "name: hot\n    caller: hot\n    scope: global\n    limit_rps: 100\n    mode: shadow"
        ),
        "{file}"
    );
    assert!(
        out.to_string()
            .contains("payments/steady: modified 100 -> 100 (mode shadow -> enforce)"),
        "{out}"
    );
    // The planner reads the new base: steady is enforced, so it is not a candidate.
    let out = cycle.apply(&p_after_merge(), "schedule").await;
    assert_eq!(out.status, RunStatus::Unchanged, "{out}");
    assert_eq!(remote.head("main").as_deref(), Some(head.as_str()));
    assert!(out.promotions.iter().all(|p| p.bucket != "steady"));
    // Even a planner that still says shadow cannot demote it: no candidate, no promotion, and
    // the change is a mode change that auto_merge does not allow.
    let out = cycle.apply(&shadow_plan(), "schedule").await;
    assert_eq!(remote.head("main").as_deref(), Some(head.as_str()), "{out}");
    assert_eq!(out.needs_review.len(), 1, "{out}");
}

#[tokio::test]
async fn direct_mode_holds_a_promotion_without_a_forge_and_proposes_it_with_one() {
    // Default auto_merge: promotions need review.
    let remote = shadow_remote(PROMOTION);
    let seed = remote.head("main").unwrap();
    let (ctl_url, _ctl) = spawn_controller().await;
    let day = Arc::new(AtomicU32::new(8));

    let mut held = Cycle::new(config(&remote, &ctl_url, ""), &remote.scratch("a"));
    held.set_shadow_source(simulated_source(day.clone(), Arc::new(AtomicU32::new(0))));
    let out = held.apply(&shadow_plan(), "schedule").await;
    assert_eq!(out.status, RunStatus::Unchanged, "{out}");
    assert_eq!(remote.head("main").as_deref(), Some(seed.as_str()), "{out}");
    assert_eq!(remote.head("main").as_deref(), Some(seed.as_str()));
    assert_eq!(out.needs_review.len(), 1);
    assert_eq!(out.needs_review[0].bucket, "steady");
    assert_eq!(out.needs_review[0].class, schema::ChangeClass::Promotion);
    let text = out.to_string();
    assert!(
        text.contains("needs review payments/steady (promotion)"),
        "{text}"
    );
    assert!(
        text.contains("held: promotion.auto_merge does not allow them"),
        "{text}"
    );

    // With a forge: the promotion goes to the PR branch, the base stays as it is.
    let (forge_url, forge) = spawn_forge().await;
    let extra = format!(
        "  forge:\n    kind: github\n    api_url: {forge_url}\n    repo: acme/config\n    token_env: RLC_TEST_FORGE_TOKEN\n"
    );
    let mut proposing = Cycle::new(config(&remote, &ctl_url, &extra), &remote.scratch("b"));
    proposing.set_shadow_source(simulated_source(day, Arc::new(AtomicU32::new(0))));
    let out = proposing.apply(&shadow_plan(), "schedule").await;
    assert_eq!(out.status, RunStatus::Success, "{out}");
    assert_eq!(remote.head("main").as_deref(), Some(seed.as_str()), "{out}");
    assert_eq!(out.pull_request.as_ref().map(|p| p.0), Some(1), "{out}");
    assert_eq!(out.review.as_deref(), Some("proposed on branch rlc/quotas"));
    let branch = remote.read("rlc/quotas", "buckets/payments.yaml").unwrap();
    assert!(branch.contains("name: steady\n    caller: steady\n    scope: global\n    limit_rps: 100\n    mode: enforce"), "{branch}");
    let body = forge.prs.lock().unwrap()[0]["body"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        body.contains("- **promotion** payments/steady: promotion shadow → enforce"),
        "{body}"
    );
}

#[tokio::test]
async fn pull_request_mode_on_gitlab_opens_a_merge_request_with_labels_and_reviewers() {
    let remote = shadow_remote(PROMOTION);
    let (ctl_url, _ctl) = spawn_controller().await;
    let (gl_url, gitlab) = crate::gitops::tests::spawn_gitlab().await;
    std::env::set_var("RLC_TEST_GITLAB_TOKEN", "gl-token");
    let extra = format!(
        "  mode: pull-request\n  forge:\n    kind: gitlab\n    api_url: {gl_url}\n    repo: acme/config\n    token_env: RLC_TEST_GITLAB_TOKEN\n    labels: [quotas]\n    reviewers: [alice]\n"
    );
    let mut cycle = Cycle::new(config(&remote, &ctl_url, &extra), &remote.scratch(""));
    cycle.set_shadow_source(simulated_source(
        Arc::new(AtomicU32::new(8)),
        Arc::new(AtomicU32::new(0)),
    ));
    let out = cycle.apply(&shadow_plan(), "schedule").await;
    assert_eq!(out.status, RunStatus::Success, "{out}");
    assert_eq!(
        out.pull_request,
        Some((
            1,
            Some("http://gitlab/acme/config/-/merge_requests/1".to_string())
        ))
    );
    // The run record keeps the merge request's iid and page.
    let rec = cycle
        .store()
        .await
        .unwrap()
        .run_by_id(out.run_id.expect("recorded"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (rec.pr_number, rec.pr_url.as_deref()),
        (
            Some(1),
            Some("http://gitlab/acme/config/-/merge_requests/1")
        )
    );
    let again = cycle.apply(&shadow_plan(), "schedule").await;
    assert_eq!(again.pull_request.as_ref().map(|p| p.0), Some(1), "{again}");
    let mrs = gitlab.mrs.lock().unwrap();
    assert_eq!(mrs.len(), 1);
    assert_eq!(mrs[0]["source_branch"], "rlc/quotas");
    assert_eq!(mrs[0]["target_branch"], "main");
    assert_eq!(mrs[0]["labels"], "quotas");
    assert_eq!(mrs[0]["reviewer_ids"], serde_json::json!([42]));
    let body = mrs[0]["description"].as_str().unwrap();
    assert!(
        body.contains("- **promotion** payments/steady: promotion shadow → enforce"),
        "{body}"
    );
    assert!(
        gitlab.problems.lock().unwrap().is_empty(),
        "{:?}",
        gitlab.problems.lock().unwrap()
    );
}
