//! The writer against real repositories: a bare remote served by `git daemon`, a working
//! clone made by the writer, and a "human" pushing from a second clone.

use std::future::IntoFuture;
use std::sync::{Arc, Mutex};

use axum::extract::{Path as AxPath, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, patch, post};
use axum::{Json, Router};
use schema::{Bucket, Mode, PolicyName, RepoMode, Scope};
use serde_json::{json, Value};
use test_support::git::{minimal_repo_files, GitRemote, HUMAN_EMAIL};

use super::*;
use rlc_plan::plan::{Plan, PlannedBucket};

pub(crate) fn seeded_remote() -> GitRemote {
    let files = minimal_repo_files(&[("payments", "gw", 100.0)]);
    let refs: Vec<(&str, &str)> = files
        .iter()
        .map(|(a, b)| (a.as_str(), b.as_str()))
        .collect();
    GitRemote::new("main", &refs).unwrap()
}

pub(crate) fn planned(service: &str, name: &str, limit: f64) -> PlannedBucket {
    PlannedBucket {
        service: service.into(),
        bucket: Bucket {
            name: name.into(),
            caller: Some(name.into()),
            procedure: None,
            scope: Scope::Global,
            limit_rps: limit,
            mode: Mode::Enforce,
            policy: PolicyName::Peak,
        },
        current_limit_rps: None,
        evidence: rlc_plan::evidence::Evidence {
            peak_rps: Some(limit / 1.25),
            confidence: Some(0.9),
            ..Default::default()
        },
        held: None,
    }
}

pub(crate) fn plan(buckets: Vec<PlannedBucket>) -> Plan {
    Plan {
        buckets,
        ..Plan::default()
    }
}

/// The files of `after` that are not in `before` with the same content, other than bucket
/// files (`buckets/<service>.yaml`): what a merge would put on the base branch besides quotas
/// (a run report, a summary, anything).
pub(crate) fn non_bucket_changes(
    before: &std::collections::BTreeMap<String, String>,
    after: &std::collections::BTreeMap<String, String>,
) -> Vec<String> {
    let bucket_file = |p: &str| {
        p.strip_prefix("buckets/")
            .and_then(|f| f.strip_suffix(".yaml"))
            .is_some_and(|svc| !svc.is_empty() && !svc.contains('/'))
    };
    after
        .iter()
        .filter(|(path, id)| !bucket_file(path) && before.get(*path) != Some(*id))
        .map(|(path, _)| path.clone())
        .collect()
}

fn writer_cfg(remote: &GitRemote, dir: &str, mode: RepoMode) -> WriterConfig {
    WriterConfig {
        path: remote.scratch(dir),
        url: Some(remote.url()),
        branch: "main".into(),
        mode,
        pr_branch: "rlc/quotas".into(),
        author_name: "rlc-bot".into(),
        author_email: "rlc@example.com".into(),
        token: None,
        max_attempts: 3,
        timeout: std::time::Duration::from_secs(30),
    }
}

#[test]
fn same_plan_twice_makes_exactly_one_commit() {
    let remote = seeded_remote();
    let p = plan(vec![
        planned("payments", "gw", 250.0),
        planned("maps", "web", 40.0),
    ]);
    let mut w = Writer::open(writer_cfg(&remote, "wc", RepoMode::Direct)).unwrap();
    let out = w.write(&p).unwrap();
    let WriteStatus::Committed { commit } = &out.status else {
        panic!("{:?}", out.status)
    };
    assert_eq!(remote.head("main").as_deref(), Some(commit.as_str()));
    assert_eq!(remote.commit_count("main").unwrap(), 2);
    let log = remote.log("main").unwrap();
    assert!(
        log[0].starts_with(
            "rlc-bot|rlc@example.com|rlc: update quotas for maps, payments (raised 1, added 1)"
        ),
        "{log:?}"
    );
    let text = remote.read("main", "buckets/payments.yaml").unwrap();
    assert!(text.contains("limit_rps: 250\n"), "{text}");
    assert_eq!(text, schema::render_bucket_file(&p.bucket_files()[1]));
    // The working copy follows the commit.
    let wc = std::fs::read_to_string(remote.scratch("wc").join("buckets/maps.yaml")).unwrap();
    assert!(wc.contains("limit_rps: 40"));

    // Again, from a reopened working copy: byte-identical, no commit.
    let mut w = Writer::open(writer_cfg(&remote, "wc", RepoMode::Direct)).unwrap();
    let out = w.write(&p).unwrap();
    assert_eq!(out.status, WriteStatus::Unchanged);
    assert!(out.summary.is_empty());
    assert_eq!(remote.commit_count("main").unwrap(), 2);
    // And from a fresh clone elsewhere.
    let mut w = Writer::open(writer_cfg(&remote, "wc2", RepoMode::Direct)).unwrap();
    assert_eq!(w.write(&p).unwrap().status, WriteStatus::Unchanged);
    assert_eq!(w.base_buckets().unwrap().0, remote.head("main").unwrap());
}

/// A bucket file's `criticality:` section is written by hand: a run that changes the
/// file's limits keeps it as the base has it, and the section alone never makes a change.
#[test]
fn the_criticality_section_is_kept_as_written() {
    let remote = seeded_remote();
    let hand = "service: payments\ncriticality:\n  caps:\n    \"batch-*\": SHEDDABLE\n    cron: sheddable_plus\nbuckets:\n  - name: gw\n    caller: gw\n    limit_rps: 100\n";
    remote
        .human_commit(
            "main",
            &[("buckets/payments.yaml", hand)],
            "cap the batch jobs",
        )
        .unwrap();
    let mut w = Writer::open(writer_cfg(&remote, "wc", RepoMode::Direct)).unwrap();
    let p = plan(vec![planned("payments", "gw", 250.0)]);
    let out = w.write(&p).unwrap();
    assert!(
        matches!(out.status, WriteStatus::Committed { .. }),
        "{:?}",
        out.status
    );
    assert_eq!(out.summary.counts_line(), "raised 1");
    let text = remote.read("main", "buckets/payments.yaml").unwrap();
    assert!(
        text.contains("criticality:  # written by hand: rlc keeps it as it is\n  caps:\n    \"batch-*\": SHEDDABLE\n    cron: SHEDDABLE_PLUS\n"),
        "{text}"
    );
    assert!(text.contains("limit_rps: 250\n"), "{text}");
    let (_, served) = w.base_buckets().unwrap();
    assert_eq!(
        served[0].criticality.caps.get("cron"),
        Some(&schema::Criticality::SheddablePlus)
    );
    // Again: nothing to commit.
    assert_eq!(w.write(&p).unwrap().status, WriteStatus::Unchanged);
}

#[test]
fn local_repo_without_remote_gets_commits_on_its_branch() {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("repo");
    test_support::git::git(dir.path(), &["init", "--quiet", "-b", "main", "repo"]).unwrap();
    for (path, text) in minimal_repo_files(&[("payments", "gw", 100.0)]) {
        std::fs::create_dir_all(repo.join(&path).parent().unwrap()).unwrap();
        std::fs::write(repo.join(&path), text).unwrap();
    }
    test_support::git::git(&repo, &["add", "-A"]).unwrap();
    test_support::git::git(&repo, &["commit", "--quiet", "-m", "seed"]).unwrap();
    let cfg = WriterConfig {
        path: repo.clone(),
        url: None,
        branch: "main".into(),
        mode: RepoMode::Direct,
        pr_branch: "rlc/quotas".into(),
        author_name: "rlc-bot".into(),
        author_email: "rlc@example.com".into(),
        token: None,
        max_attempts: 3,
        timeout: std::time::Duration::from_secs(30),
    };
    let p = plan(vec![planned("payments", "gw", 250.0)]);
    let mut w = Writer::open(cfg.clone()).unwrap();
    assert!(matches!(
        w.write(&p).unwrap().status,
        WriteStatus::Committed { .. }
    ));
    assert_eq!(w.write(&p).unwrap().status, WriteStatus::Unchanged);
    let count = test_support::git::git(&repo, &["rev-list", "--count", "HEAD"]).unwrap();
    assert_eq!(count.trim(), "2");
    // The working tree matches the commit (nothing left dirty).
    assert_eq!(
        test_support::git::git(&repo, &["status", "--porcelain"]).unwrap(),
        ""
    );
}

#[test]
fn remote_moved_underneath_is_retried_on_top() {
    let remote = Arc::new(seeded_remote());
    let mut w = Writer::open(writer_cfg(&remote, "wc", RepoMode::Direct)).unwrap();
    let r = remote.clone();
    let human = Arc::new(Mutex::new(None));
    let h = human.clone();
    w.set_before_push(Box::new(move |attempt| {
        if attempt == 1 {
            let id = r
                .human_commit(
                    "main",
                    &[("rlc/capacity.yaml", "capacity: []\n")],
                    "add capacity",
                )
                .unwrap();
            *h.lock().unwrap() = Some(id);
        }
    }));
    let out = w
        .write(&plan(vec![planned("payments", "gw", 300.0)]))
        .unwrap();
    assert_eq!(out.attempts, 2);
    let WriteStatus::Committed { commit } = &out.status else {
        panic!("{:?}", out.status)
    };
    assert_eq!(remote.head("main").as_deref(), Some(commit.as_str()));
    let parent =
        test_support::git::git(&remote.bare_path(), &["rev-parse", &format!("{commit}^")]).unwrap();
    assert_eq!(Some(parent.trim().to_string()), *human.lock().unwrap());
    assert_eq!(
        remote.read("main", "rlc/capacity.yaml").unwrap(),
        "capacity: []\n"
    );
    assert!(remote
        .read("main", "buckets/payments.yaml")
        .unwrap()
        .contains("limit_rps: 300"));
}

#[test]
fn push_rejected_by_the_remote_fails_with_the_reason() {
    let remote = seeded_remote();
    let before = remote.head("main");
    remote.reject_pushes("quota changes need approval").unwrap();
    let mut w = Writer::open(writer_cfg(&remote, "wc", RepoMode::Direct)).unwrap();
    let err = w
        .write(&plan(vec![planned("payments", "gw", 300.0)]))
        .unwrap_err();
    assert!(matches!(err, GitOpsError::Rejected { .. }), "{err}");
    assert!(
        err.to_string().contains("pre-receive hook declined"),
        "{err}"
    );
    assert_eq!(remote.head("main"), before);
    // Nothing half-written locally either: the working copy still has the old file.
    let wc = std::fs::read_to_string(remote.scratch("wc").join("buckets/payments.yaml")).unwrap();
    assert!(wc.contains("limit_rps: 100"), "{wc}");
}

#[test]
fn unreachable_remote_fails_with_the_reason() {
    let remote = seeded_remote();
    let mut w = Writer::open(writer_cfg(&remote, "wc", RepoMode::Direct)).unwrap();
    // Point origin at a port nobody listens on.
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    git2::Repository::open(remote.scratch("wc"))
        .unwrap()
        .remote_set_url("origin", &format!("git://{dead}/remote.git"))
        .unwrap();
    let err = w
        .write(&plan(vec![planned("payments", "gw", 300.0)]))
        .unwrap_err();
    assert!(
        matches!(err, GitOpsError::Remote { op: "fetch", .. }),
        "{err}"
    );
}

#[test]
fn invalid_render_is_never_committed() {
    let remote = seeded_remote();
    let before = remote.head("main");
    let mut w = Writer::open(writer_cfg(&remote, "wc", RepoMode::Direct)).unwrap();
    let err = w
        .write(&plan(vec![planned("payments", "gw", -5.0)]))
        .unwrap_err();
    assert!(matches!(err, GitOpsError::Invalid(_)), "{err}");
    assert!(err.to_string().contains("buckets/payments.yaml"), "{err}");
    assert_eq!(remote.head("main"), before);
}

#[test]
fn non_bucket_changes_lists_every_other_added_or_changed_file() {
    let tree = |files: &[(&str, &str)]| {
        files
            .iter()
            .map(|(p, id)| (p.to_string(), id.to_string()))
            .collect::<std::collections::BTreeMap<_, _>>()
    };
    let before = tree(&[("rlc/policies.yaml", "a"), ("buckets/payments.yaml", "b")]);
    let after = tree(&[
        ("rlc/policies.yaml", "a2"),
        ("buckets/payments.yaml", "b2"),
        ("buckets/maps.yaml", "c"),
        ("rlc/last-run.md", "d"),
        ("buckets/sub/x.yaml", "e"),
        ("RUN_REPORT.txt", "f"),
    ]);
    assert_eq!(
        non_bucket_changes(&before, &after),
        [
            "RUN_REPORT.txt",
            "buckets/sub/x.yaml",
            "rlc/last-run.md",
            "rlc/policies.yaml"
        ]
    );
    assert!(non_bucket_changes(&before, &before).is_empty());
}

#[test]
fn pull_request_branch_is_stable_and_human_commits_are_left_alone() {
    let remote = seeded_remote();
    let base = remote.head("main");
    let seed_tree = remote.tree("main").unwrap();
    let mut w = Writer::open(writer_cfg(&remote, "wc", RepoMode::PullRequest)).unwrap();
    let p1 = plan(vec![planned("payments", "gw", 250.0)]);
    let out = w.write(&p1).unwrap();
    let WriteStatus::BranchUpdated { commit } = &out.status else {
        panic!("{:?}", out.status)
    };
    assert_eq!(remote.head("rlc/quotas").as_deref(), Some(commit.as_str()));
    assert_eq!(
        remote.head("main"),
        base,
        "base branch untouched in PR mode"
    );
    // The report goes to the PR body and the store, never into the tree (a merge would put it
    // on the base branch): the branch differs from the base by bucket files only.
    let branch_tree = remote.tree("rlc/quotas").unwrap();
    assert_eq!(
        non_bucket_changes(&seed_tree, &branch_tree),
        Vec::<String>::new()
    );
    assert_ne!(branch_tree, seed_tree, "the bucket file changed");
    let report = crate::gitops::summary::report(&p1, &out.summary);
    assert!(
        report.contains("| gw | 100 | 250 | +150.0% | 200 | peak | 0.9 |"),
        "{report}"
    );

    // Same plan: the branch is up to date, nothing pushed.
    let out = w.write(&p1).unwrap();
    assert!(
        matches!(out.status, WriteStatus::BranchUpToDate { .. }),
        "{:?}",
        out.status
    );
    assert_eq!(remote.commit_count("rlc/quotas").unwrap(), 2);

    // Other plan: the branch is updated in place (still one commit on top of main).
    let out = w
        .write(&plan(vec![planned("payments", "gw", 400.0)]))
        .unwrap();
    assert!(
        matches!(out.status, WriteStatus::BranchUpdated { .. }),
        "{:?}",
        out.status
    );
    assert_eq!(remote.commit_count("rlc/quotas").unwrap(), 2);

    // A person adds a commit on the branch: rlc leaves it.
    let human = remote
        .human_commit(
            "rlc/quotas",
            &[(
                "buckets/payments.yaml",
                &remote
                    .read("rlc/quotas", "buckets/payments.yaml")
                    .unwrap()
                    .replace("400", "450"),
            )],
            "bump by hand",
        )
        .unwrap();
    let out = w
        .write(&plan(vec![planned("payments", "gw", 500.0)]))
        .unwrap();
    let WriteStatus::BranchHeldByHumans { authors } = &out.status else {
        panic!("{:?}", out.status)
    };
    assert!(authors[0].contains(HUMAN_EMAIL), "{authors:?}");
    assert_eq!(remote.head("rlc/quotas").as_deref(), Some(human.as_str()));

    // Once merged, the base carries the change and the next plan equal to it is a no-op.
    remote.human_merge("rlc/quotas").unwrap();
    // Every file on the base branch is a bucket file or one that was there before.
    assert_eq!(
        non_bucket_changes(&seed_tree, &remote.tree("main").unwrap()),
        Vec::<String>::new()
    );
    w.fetch().unwrap();
    let (version, files) = w.base_buckets().unwrap();
    assert_eq!(Some(version), remote.head("main"));
    assert_eq!(files[0].buckets[0].limit_rps, 450.0);
}

/// A stand-in GitHub API that checks every request and records what it got.
#[derive(Clone, Default)]
pub(crate) struct FakeForge {
    pub(crate) prs: Arc<Mutex<Vec<Value>>>,
    pub(crate) problems: Arc<Mutex<Vec<String>>>,
    pub(crate) calls: Arc<Mutex<Vec<String>>>,
    /// `(pr number, labels or reviewers body)` of the decoration calls.
    pub(crate) decorations: Arc<Mutex<Vec<(u64, Value)>>>,
}

impl FakeForge {
    fn check_auth(&self, h: &HeaderMap) -> bool {
        let ok = h.get("authorization").and_then(|v| v.to_str().ok()) == Some("Bearer forge-token");
        if !ok {
            self.problems
                .lock()
                .unwrap()
                .push("missing or wrong auth".into());
        }
        ok
    }
    fn check_body(&self, body: &Value) {
        let b = body["body"].as_str().unwrap_or_default();
        if b.chars().count() > summary::FORGE_BODY_LIMIT
            || !b.contains(
                "| bucket | current | proposed | change % | observed peak | policy | confidence |",
            )
        {
            self.problems
                .lock()
                .unwrap()
                .push(format!("bad body ({} chars)", b.len()));
        }
        if body["title"].as_str().unwrap_or_default().is_empty() {
            self.problems.lock().unwrap().push("empty title".into());
        }
    }
}

async fn list(
    State(f): State<FakeForge>,
    h: HeaderMap,
    AxPath((o, r)): AxPath<(String, String)>,
    Query(q): Query<std::collections::HashMap<String, String>>,
) -> (StatusCode, Json<Value>) {
    f.calls.lock().unwrap().push(format!(
        "GET {o}/{r} head={:?} state={:?}",
        q.get("head"),
        q.get("state")
    ));
    if !f.check_auth(&h) {
        return (
            StatusCode::UNAUTHORIZED,
            Json(json!({"message": "Bad credentials"})),
        );
    }
    let head = q.get("head").cloned().unwrap_or_default();
    let state = q.get("state").cloned().unwrap_or_else(|| "open".into());
    let open: Vec<Value> = f
        .prs
        .lock()
        .unwrap()
        .iter()
        .filter(|p| format!("{o}:{}", p["head"].as_str().unwrap()) == head)
        .filter(|p| state == "all" || p["state"] == state.as_str())
        .cloned()
        .collect();
    (StatusCode::OK, Json(Value::Array(open)))
}

async fn create(
    State(f): State<FakeForge>,
    h: HeaderMap,
    Json(body): Json<Value>,
) -> (StatusCode, Json<Value>) {
    f.calls
        .lock()
        .unwrap()
        .push(format!("POST head={} base={}", body["head"], body["base"]));
    if !f.check_auth(&h) {
        return (
            StatusCode::UNAUTHORIZED,
            Json(json!({"message": "Bad credentials"})),
        );
    }
    f.check_body(&body);
    let mut prs = f.prs.lock().unwrap();
    let n = prs.len() as u64 + 1;
    let mut pr = body.clone();
    pr["number"] = json!(n);
    pr["state"] = json!("open");
    pr["comments"] = json!([]);
    pr["html_url"] = json!(format!("http://forge/pr/{n}"));
    prs.push(pr.clone());
    (StatusCode::CREATED, Json(pr))
}

async fn update(
    State(f): State<FakeForge>,
    h: HeaderMap,
    AxPath((_o, _r, n)): AxPath<(String, String, u64)>,
    Json(body): Json<Value>,
) -> (StatusCode, Json<Value>) {
    match body["state"].as_str() {
        Some(state) => f
            .calls
            .lock()
            .unwrap()
            .push(format!("PATCH {n} state={state}")),
        None => f.calls.lock().unwrap().push(format!("PATCH {n}")),
    }
    if !f.check_auth(&h) {
        return (
            StatusCode::UNAUTHORIZED,
            Json(json!({"message": "Bad credentials"})),
        );
    }
    let mut prs = f.prs.lock().unwrap();
    let Some(pr) = prs.get_mut(n as usize - 1) else {
        return (StatusCode::NOT_FOUND, Json(json!({"message": "Not Found"})));
    };
    if let Some(state) = body["state"].as_str() {
        // Closing: `{"state": "closed"}` alone, on an open PR.
        if state != "closed" || body.as_object().is_some_and(|o| o.len() != 1) {
            f.problems
                .lock()
                .unwrap()
                .push(format!("unexpected state update {body}"));
        }
        if pr["state"] != "open" {
            f.problems
                .lock()
                .unwrap()
                .push(format!("closing PR {n}, which is {}", pr["state"]));
        }
        if pr["comments"].as_array().is_none_or(|c| c.is_empty()) {
            f.problems
                .lock()
                .unwrap()
                .push(format!("PR {n} closed without a comment saying why"));
        }
        pr["state"] = json!(state);
        return (StatusCode::OK, Json(pr.clone()));
    }
    f.check_body(&body);
    pr["body"] = body["body"].clone();
    pr["title"] = body["title"].clone();
    (StatusCode::OK, Json(pr.clone()))
}

async fn comment(
    State(f): State<FakeForge>,
    h: HeaderMap,
    AxPath((_o, _r, n)): AxPath<(String, String, u64)>,
    Json(body): Json<Value>,
) -> (StatusCode, Json<Value>) {
    f.calls.lock().unwrap().push(format!("COMMENT {n}"));
    if !f.check_auth(&h) {
        return (
            StatusCode::UNAUTHORIZED,
            Json(json!({"message": "Bad credentials"})),
        );
    }
    let text = body["body"].as_str().unwrap_or_default().to_string();
    if text.is_empty() || text.chars().count() > summary::FORGE_BODY_LIMIT {
        f.problems
            .lock()
            .unwrap()
            .push(format!("bad comment ({} chars)", text.len()));
    }
    let mut prs = f.prs.lock().unwrap();
    let Some(pr) = prs.get_mut(n as usize - 1) else {
        return (StatusCode::NOT_FOUND, Json(json!({"message": "Not Found"})));
    };
    pr["comments"].as_array_mut().unwrap().push(json!(text));
    (
        StatusCode::CREATED,
        Json(json!({"id": n * 100, "body": text})),
    )
}

async fn decorate(
    State(f): State<FakeForge>,
    h: HeaderMap,
    AxPath((_o, _r, n)): AxPath<(String, String, u64)>,
    Json(body): Json<Value>,
) -> (StatusCode, Json<Value>) {
    f.calls.lock().unwrap().push(format!("DECORATE {n}"));
    if !f.check_auth(&h) {
        return (
            StatusCode::UNAUTHORIZED,
            Json(json!({"message": "Bad credentials"})),
        );
    }
    if f.prs.lock().unwrap().get(n as usize - 1).is_none() {
        return (StatusCode::NOT_FOUND, Json(json!({"message": "Not Found"})));
    }
    f.decorations.lock().unwrap().push((n, body.clone()));
    (StatusCode::OK, Json(json!({})))
}

pub(crate) async fn spawn_forge() -> (String, FakeForge) {
    let f = FakeForge::default();
    let app = Router::new()
        .route("/repos/{o}/{r}/pulls", get(list).post(create))
        .route("/repos/{o}/{r}/pulls/{n}", patch(update))
        .route("/repos/{o}/{r}/issues/{n}/comments", post(comment))
        .route("/repos/{o}/{r}/issues/{n}/labels", post(decorate))
        .route(
            "/repos/{o}/{r}/pulls/{n}/requested_reviewers",
            post(decorate),
        )
        .with_state(f.clone());
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(axum::serve(l, app).into_future());
    (format!("http://{addr}"), f)
}

#[tokio::test]
async fn forge_creates_then_updates_the_pull_request() {
    let (url, fake) = spawn_forge().await;
    let forge = Forge::new(&url, "acme/config", "forge-token".into()).unwrap();
    let body = "| bucket | current | proposed | change % | observed peak | policy | confidence |\n";
    let (pr, created) = forge
        .upsert_pull_request("rlc/quotas", "main", "rlc: t", body)
        .await
        .unwrap();
    assert!(created);
    assert_eq!(pr.number, 1);
    let (pr, created) = forge
        .upsert_pull_request("rlc/quotas", "main", "rlc: t2", &format!("{body}x"))
        .await
        .unwrap();
    assert!(!created);
    assert_eq!(pr.number, 1);
    assert_eq!(fake.prs.lock().unwrap().len(), 1);
    assert_eq!(fake.prs.lock().unwrap()[0]["title"], json!("rlc: t2"));
    assert!(
        fake.problems.lock().unwrap().is_empty(),
        "{:?}",
        fake.problems.lock().unwrap()
    );
    let calls = fake.calls.lock().unwrap().clone();
    assert_eq!(
        calls[0],
        "GET acme/config head=Some(\"acme:rlc/quotas\") state=Some(\"open\")"
    );
    assert_eq!(calls[1], "POST head=\"rlc/quotas\" base=\"main\"");
    assert_eq!(calls[3], "PATCH 1");

    let bad = Forge::new(&url, "acme/config", "nope".into()).unwrap();
    let err = bad
        .upsert_pull_request("rlc/quotas", "main", "t", body)
        .await
        .unwrap_err();
    assert!(
        matches!(err, ForgeError::Status { status: 401, .. }),
        "{err}"
    );
}

#[tokio::test]
async fn refused_credentials_are_bounded_not_retried_forever() {
    // An https-like smart-HTTP remote that refuses every credential.
    let hits = Arc::new(Mutex::new(Vec::<Option<String>>::new()));
    let h = hits.clone();
    let app = Router::new().fallback(move |headers: HeaderMap| {
        let h = h.clone();
        async move {
            h.lock().unwrap().push(
                headers
                    .get("authorization")
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_string),
            );
            (
                StatusCode::UNAUTHORIZED,
                [("www-authenticate", "Basic realm=\"git\"")],
                "no",
            )
        }
    });
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(axum::serve(l, app).into_future());
    let dir = tempfile::tempdir().unwrap();
    let cfg = WriterConfig {
        path: dir.path().join("wc"),
        url: Some(format!("http://{addr}/acme/config.git")),
        branch: "main".into(),
        mode: RepoMode::Direct,
        pr_branch: "rlc/quotas".into(),
        author_name: "rlc-bot".into(),
        author_email: "rlc@example.com".into(),
        token: Some("tok-123".into()),
        max_attempts: 3,
        timeout: std::time::Duration::from_secs(30),
    };
    let err = tokio::task::spawn_blocking(move || Writer::open(cfg).err().unwrap())
        .await
        .unwrap();
    let msg = err.to_string();
    assert!(msg.contains("failed after 3 attempts"), "{msg}");
    assert!(!msg.contains("tok-123"), "the token never shows in errors");
    let hits = hits.lock().unwrap();
    assert!(hits.len() <= 4, "bounded: {} requests", hits.len());
    assert!(hits
        .iter()
        .any(|a| a.as_deref().is_some_and(|a| a.starts_with("Basic "))));
}

/// A PR-mode writer over a base whose `payments` file is rlc's own rendering of `gw` at
/// `limit` (committed in direct mode first, so that a plan at `limit` equals the base).
fn pr_writer_over_rendered_base(remote: &GitRemote, limit: f64) -> Writer {
    let mut direct = Writer::open(writer_cfg(remote, "wc-direct", RepoMode::Direct)).unwrap();
    direct
        .write(&plan(vec![planned("payments", "gw", limit)]))
        .unwrap();
    Writer::open(writer_cfg(remote, "wc", RepoMode::PullRequest)).unwrap()
}

#[test]
fn outdated_pull_request_branch_is_withdrawn_unless_people_committed_on_it() {
    let remote = seeded_remote();
    let mut w = pr_writer_over_rendered_base(&remote, 100.0);
    let base = remote.head("main");
    let back = plan(vec![planned("payments", "gw", 100.0)]);
    let cut = plan(vec![planned("payments", "gw", 75.0)]);

    // No proposal yet and nothing to propose: unchanged.
    assert_eq!(
        w.write_withdrawing(&back).unwrap().status,
        WriteStatus::Unchanged
    );

    // A 25% cut is proposed...
    let WriteStatus::BranchUpdated { commit } = w.write(&cut).unwrap().status else {
        panic!()
    };
    // ...then traffic comes back: the plan equals the base, the proposal is outdated.
    let out = w.write(&back).unwrap();
    assert_eq!(
        out.status,
        WriteStatus::BranchOutdated {
            commit: commit.clone()
        }
    );
    assert!(out.summary.is_empty());
    assert_eq!(
        remote.head("rlc/quotas").as_deref(),
        Some(commit.as_str()),
        "write() only reports it"
    );
    let out = w.write_withdrawing(&back).unwrap();
    assert_eq!(
        out.status,
        WriteStatus::BranchWithdrawn {
            commit: commit.clone()
        }
    );
    assert_eq!(
        remote.head("rlc/quotas"),
        None,
        "branch deleted on the remote"
    );
    assert_eq!(remote.head("main"), base, "base untouched");
    // Gone: the next run has nothing to do, and a new cut makes a fresh branch.
    assert_eq!(
        w.write_withdrawing(&back).unwrap().status,
        WriteStatus::Unchanged
    );
    assert!(matches!(
        w.write(&cut).unwrap().status,
        WriteStatus::BranchUpdated { .. }
    ));
    assert_eq!(
        remote.commit_count("rlc/quotas").unwrap(),
        base_count(&remote) + 1
    );

    // A person committed on the proposal: it is theirs, left alone even when outdated.
    let human = remote
        .human_commit("rlc/quotas", &[("NOTES.md", "keep the cut\n")], "note")
        .unwrap();
    let out = w.write_withdrawing(&back).unwrap();
    let WriteStatus::BranchHeldByHumans { authors } = &out.status else {
        panic!("{:?}", out.status)
    };
    assert!(authors[0].contains(HUMAN_EMAIL), "{authors:?}");
    assert_eq!(remote.head("rlc/quotas").as_deref(), Some(human.as_str()));

    // Merged proposals are not outdated ones: nothing beyond the base, nothing to withdraw.
    remote.human_merge("rlc/quotas").unwrap();
    let merged_tip = remote.head("rlc/quotas");
    let mut w = Writer::open(writer_cfg(&remote, "wc", RepoMode::PullRequest)).unwrap();
    w.fetch().unwrap();
    let (_, files) = w.base_buckets().unwrap();
    let same = plan(vec![planned(
        "payments",
        "gw",
        files[0].buckets[0].limit_rps,
    )]);
    assert_eq!(
        w.write_withdrawing(&same).unwrap().status,
        WriteStatus::Unchanged
    );
    assert_eq!(remote.head("rlc/quotas"), merged_tip);
}

fn base_count(remote: &GitRemote) -> usize {
    remote.commit_count("main").unwrap()
}

#[test]
fn a_commit_pushed_between_the_check_and_the_push_is_never_overwritten() {
    let remote = Arc::new(seeded_remote());
    let mut w = Writer::open(writer_cfg(&remote, "wc", RepoMode::PullRequest)).unwrap();
    assert!(matches!(
        w.write(&plan(vec![planned("payments", "gw", 250.0)]))
            .unwrap()
            .status,
        WriteStatus::BranchUpdated { .. }
    ));
    // The person pushes after rlc fetched and checked the branch, right before its push.
    let r = remote.clone();
    let human = Arc::new(Mutex::new(None));
    let h = human.clone();
    w.set_before_push(Box::new(move |attempt| {
        if attempt == 1 {
            let text = r
                .read("rlc/quotas", "buckets/payments.yaml")
                .unwrap()
                .replace("250", "260");
            let id = r
                .human_commit("rlc/quotas", &[("buckets/payments.yaml", &text)], "by hand")
                .unwrap();
            *h.lock().unwrap() = Some(id);
        }
    }));
    let out = w
        .write(&plan(vec![planned("payments", "gw", 400.0)]))
        .unwrap();
    assert_eq!(out.attempts, 2, "the lost lease makes it decide again");
    assert!(
        matches!(out.status, WriteStatus::BranchHeldByHumans { .. }),
        "{:?}",
        out.status
    );
    assert_eq!(remote.head("rlc/quotas"), *human.lock().unwrap());
    assert!(remote
        .read("rlc/quotas", "buckets/payments.yaml")
        .unwrap()
        .contains("limit_rps: 260"));
}

#[test]
fn a_branch_created_by_a_person_before_the_push_is_never_overwritten() {
    let remote = Arc::new(seeded_remote());
    let mut w = Writer::open(writer_cfg(&remote, "wc", RepoMode::PullRequest)).unwrap();
    let r = remote.clone();
    w.set_before_push(Box::new(move |attempt| {
        if attempt == 1 {
            r.human_commit("rlc/quotas", &[("NOTES.md", "mine\n")], "start")
                .unwrap();
        }
    }));
    let out = w
        .write(&plan(vec![planned("payments", "gw", 400.0)]))
        .unwrap();
    assert_eq!(out.attempts, 2);
    assert!(
        matches!(out.status, WriteStatus::BranchHeldByHumans { .. }),
        "{:?}",
        out.status
    );
    assert_eq!(remote.read("rlc/quotas", "NOTES.md").unwrap(), "mine\n");
}

#[test]
fn withdrawing_loses_the_lease_to_a_person_and_leaves_their_branch() {
    let remote = Arc::new(seeded_remote());
    let mut w = pr_writer_over_rendered_base(&remote, 100.0);
    let back = plan(vec![planned("payments", "gw", 100.0)]);
    assert!(matches!(
        w.write(&plan(vec![planned("payments", "gw", 75.0)]))
            .unwrap()
            .status,
        WriteStatus::BranchUpdated { .. }
    ));
    let r = remote.clone();
    let human = Arc::new(Mutex::new(None));
    let h = human.clone();
    w.set_before_push(Box::new(move |attempt| {
        if attempt == 1 {
            let id = r
                .human_commit("rlc/quotas", &[("NOTES.md", "keep\n")], "keep it")
                .unwrap();
            *h.lock().unwrap() = Some(id);
        }
    }));
    let out = w.write_withdrawing(&back).unwrap();
    assert_eq!(out.attempts, 2);
    assert!(
        matches!(out.status, WriteStatus::BranchHeldByHumans { .. }),
        "{:?}",
        out.status
    );
    assert_eq!(remote.head("rlc/quotas"), *human.lock().unwrap());
}

#[test]
fn a_branch_moved_by_another_rlc_run_is_decided_again_and_updated() {
    let remote = Arc::new(seeded_remote());
    let mut w = Writer::open(writer_cfg(&remote, "wc", RepoMode::PullRequest)).unwrap();
    w.write(&plan(vec![planned("payments", "gw", 250.0)]))
        .unwrap();
    // Another rlc (same author) pushes its own proposal in between.
    let r = remote.clone();
    w.set_before_push(Box::new(move |attempt| {
        if attempt == 1 {
            let mut other =
                Writer::open(writer_cfg(&r, "wc-other", RepoMode::PullRequest)).unwrap();
            other
                .write(&plan(vec![planned("payments", "gw", 300.0)]))
                .unwrap();
        }
    }));
    let out = w
        .write(&plan(vec![planned("payments", "gw", 400.0)]))
        .unwrap();
    assert_eq!(out.attempts, 2);
    let WriteStatus::BranchUpdated { commit } = &out.status else {
        panic!("{:?}", out.status)
    };
    assert_eq!(remote.head("rlc/quotas").as_deref(), Some(commit.as_str()));
    assert!(remote
        .read("rlc/quotas", "buckets/payments.yaml")
        .unwrap()
        .contains("limit_rps: 400"));
}

#[test]
fn a_ref_moved_by_a_server_hook_during_the_push_is_retried_on_top() {
    // A real `git daemon` whose pre-receive hook pushes another commit to main first: the
    // server then refuses rlc's push with "failed to update ref".
    let remote = seeded_remote();
    remote.race_pushes(1).unwrap();
    let mut w = Writer::open(writer_cfg(&remote, "wc", RepoMode::Direct)).unwrap();
    let out = w
        .write(&plan(vec![planned("payments", "gw", 300.0)]))
        .unwrap();
    assert_eq!(out.attempts, 2, "{:?}", out.status);
    assert_eq!(w.attempts(), 2);
    let WriteStatus::Committed { commit } = &out.status else {
        panic!("{:?}", out.status)
    };
    assert_eq!(remote.head("main").as_deref(), Some(commit.as_str()));
    // Rebuilt on top of the racing commit, which is kept.
    let log = remote.log("main").unwrap();
    assert!(log[0].starts_with("rlc-bot|"), "{log:?}");
    assert!(log[1].ends_with("|racer 1"), "{log:?}");
    assert_eq!(remote.read("main", "race/1.txt").unwrap(), "1\n");
    assert!(remote
        .read("main", "buckets/payments.yaml")
        .unwrap()
        .contains("limit_rps: 300"));
}

#[test]
fn a_ref_that_keeps_moving_gives_up_after_max_attempts_and_counts_them() {
    let remote = seeded_remote();
    remote.race_pushes(10).unwrap();
    let mut w = Writer::open(writer_cfg(&remote, "wc", RepoMode::Direct)).unwrap();
    let err = w
        .write(&plan(vec![planned("payments", "gw", 300.0)]))
        .unwrap_err();
    assert!(
        matches!(err, GitOpsError::TooManyConflicts { attempts: 3, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("failed to update ref"), "{err}");
    assert_eq!(w.attempts(), 3);
    // Three races happened (one per attempt), and no rlc commit landed.
    assert_eq!(
        std::fs::read_to_string(remote.bare_path().join("races-left")).unwrap(),
        "7\n"
    );
    let log = remote.log("main").unwrap();
    assert!(log.iter().all(|l| !l.starts_with("rlc-bot|")), "{log:?}");
    assert_eq!(log.len(), 4, "{log:?}");
}

#[test]
fn decreases_are_read_from_the_base_history_within_a_bound() {
    let remote = seeded_remote();
    let file = |limit: u32| {
        format!("service: payments\nbuckets:\n  - name: gw\n    caller: gw\n    scope: global\n    limit_rps: {limit}\n    mode: enforce\n    policy: peak\n")
    };
    let lowered = remote
        .human_commit("main", &[("buckets/payments.yaml", &file(90))], "lower")
        .unwrap();
    remote
        .human_commit("main", &[("buckets/payments.yaml", &file(95))], "raise")
        .unwrap();
    remote
        .human_commit("main", &[("rlc/capacity.yaml", "capacity: []\n")], "other")
        .unwrap();
    let w = Writer::open(writer_cfg(&remote, "wc", RepoMode::Direct)).unwrap();
    w.fetch().unwrap();
    let when: i64 = test_support::git::git(
        &remote.bare_path(),
        &["show", "-s", "--format=%ct", &lowered],
    )
    .unwrap()
    .trim()
    .parse()
    .unwrap();
    let services = vec!["payments".to_string(), "maps".to_string()];
    let found = w.decreases_since(&services, 0, 100).unwrap();
    assert_eq!(
        found.into_iter().collect::<Vec<_>>(),
        vec![(("payments".to_string(), "gw".to_string()), when)]
    );
    // Nothing inside a window that starts after the decrease.
    assert!(w
        .decreases_since(&services, when + 3600, 100)
        .unwrap()
        .is_empty());
    // More commits in the window than the bound: no answer (the caller holds decreases).
    let err = w.decreases_since(&services, 0, 2).unwrap_err();
    assert!(matches!(err, GitOpsError::History(_)), "{err}");
    assert!(err.to_string().contains("more than 2 commits"), "{err}");
}

#[tokio::test]
async fn github_pull_requests_get_the_configured_labels_and_reviewers() {
    let (url, fake) = spawn_forge().await;
    let forge = Forge::new(&url, "acme/config", "forge-token".into())
        .unwrap()
        .decorated(Decoration {
            labels: vec!["quotas".into(), "rlc".into()],
            reviewers: vec!["alice".into()],
        });
    let body = "| bucket | current | proposed | change % | observed peak | policy | confidence |\n";
    forge
        .upsert_pull_request("rlc/quotas", "main", "rlc: t", body)
        .await
        .unwrap();
    forge
        .upsert_pull_request("rlc/quotas", "main", "rlc: t2", body)
        .await
        .unwrap();
    let deco = fake.decorations.lock().unwrap().clone();
    assert_eq!(
        deco,
        [
            (1, json!({"labels": ["quotas", "rlc"]})),
            (1, json!({"reviewers": ["alice"]})),
            (1, json!({"labels": ["quotas", "rlc"]})),
            (1, json!({"reviewers": ["alice"]})),
        ]
    );
    assert!(fake.problems.lock().unwrap().is_empty());
}

/// A stand-in GitLab API v4 that checks every request (path with the URL-encoded project,
/// `PRIVATE-TOKEN`, bodies) and records what it got.
#[derive(Clone, Default)]
pub(crate) struct FakeGitLab {
    pub(crate) mrs: Arc<Mutex<Vec<Value>>>,
    pub(crate) problems: Arc<Mutex<Vec<String>>>,
    pub(crate) calls: Arc<Mutex<Vec<String>>>,
}

impl FakeGitLab {
    fn check(&self, h: &HeaderMap, uri: &axum::http::Uri) -> Result<(), (StatusCode, Json<Value>)> {
        let path = uri.path();
        if path != "/api/v4/users" && !path.starts_with("/api/v4/projects/acme%2Fconfig/") {
            self.problems
                .lock()
                .unwrap()
                .push(format!("unexpected path {path}"));
        }
        if h.get("private-token").and_then(|v| v.to_str().ok()) != Some("gl-token") {
            self.problems
                .lock()
                .unwrap()
                .push("missing or wrong PRIVATE-TOKEN".into());
            return Err((
                StatusCode::UNAUTHORIZED,
                Json(json!({"message": "401 Unauthorized"})),
            ));
        }
        Ok(())
    }
}

type GlReply = (StatusCode, Json<Value>);

async fn gl_list(
    State(f): State<FakeGitLab>,
    h: HeaderMap,
    uri: axum::http::Uri,
    Query(q): Query<std::collections::HashMap<String, String>>,
) -> GlReply {
    f.calls.lock().unwrap().push(format!(
        "GET source_branch={:?} state={:?}",
        q.get("source_branch"),
        q.get("state")
    ));
    if let Err(e) = f.check(&h, &uri) {
        return e;
    }
    let branch = q.get("source_branch").cloned().unwrap_or_default();
    let state = q.get("state").cloned().unwrap_or_default();
    let found: Vec<Value> = f
        .mrs
        .lock()
        .unwrap()
        .iter()
        .filter(|m| m["source_branch"] == branch.as_str() && m["state"] == state.as_str())
        .cloned()
        .collect();
    (StatusCode::OK, Json(Value::Array(found)))
}

async fn gl_create(
    State(f): State<FakeGitLab>,
    h: HeaderMap,
    uri: axum::http::Uri,
    Json(body): Json<Value>,
) -> GlReply {
    f.calls.lock().unwrap().push(format!(
        "POST {} -> {}",
        body["source_branch"], body["target_branch"]
    ));
    if let Err(e) = f.check(&h, &uri) {
        return e;
    }
    if body["title"].as_str().unwrap_or_default().is_empty()
        || body["description"].as_str().is_none()
    {
        f.problems
            .lock()
            .unwrap()
            .push(format!("create without title or description: {body}"));
    }
    let mut mrs = f.mrs.lock().unwrap();
    let iid = mrs.len() as u64 + 1;
    let mut mr = body.clone();
    mr["iid"] = json!(iid);
    mr["id"] = json!(1000 + iid);
    mr["state"] = json!("opened");
    mr["notes"] = json!([]);
    mr["web_url"] = json!(format!("http://gitlab/acme/config/-/merge_requests/{iid}"));
    mrs.push(mr.clone());
    (StatusCode::CREATED, Json(mr))
}

async fn gl_update(
    State(f): State<FakeGitLab>,
    h: HeaderMap,
    uri: axum::http::Uri,
    AxPath((_p, iid)): AxPath<(String, u64)>,
    Json(body): Json<Value>,
) -> GlReply {
    f.calls.lock().unwrap().push(format!("PUT {iid} {body}"));
    if let Err(e) = f.check(&h, &uri) {
        return e;
    }
    let mut mrs = f.mrs.lock().unwrap();
    let Some(mr) = mrs.get_mut(iid as usize - 1) else {
        return (
            StatusCode::NOT_FOUND,
            Json(json!({"message": "404 Not found"})),
        );
    };
    if body["state_event"] == "close" {
        if mr["notes"].as_array().is_none_or(|n| n.is_empty()) {
            f.problems
                .lock()
                .unwrap()
                .push(format!("MR {iid} closed without a note saying why"));
        }
        mr["state"] = json!("closed");
        return (StatusCode::OK, Json(mr.clone()));
    }
    for (k, v) in body.as_object().unwrap() {
        mr[k] = v.clone();
    }
    (StatusCode::OK, Json(mr.clone()))
}

async fn gl_note(
    State(f): State<FakeGitLab>,
    h: HeaderMap,
    uri: axum::http::Uri,
    AxPath((_p, iid)): AxPath<(String, u64)>,
    Json(body): Json<Value>,
) -> GlReply {
    f.calls.lock().unwrap().push(format!("NOTE {iid}"));
    if let Err(e) = f.check(&h, &uri) {
        return e;
    }
    let mut mrs = f.mrs.lock().unwrap();
    let Some(mr) = mrs.get_mut(iid as usize - 1) else {
        return (
            StatusCode::NOT_FOUND,
            Json(json!({"message": "404 Not found"})),
        );
    };
    mr["notes"]
        .as_array_mut()
        .unwrap()
        .push(body["body"].clone());
    (StatusCode::CREATED, Json(json!({"id": 1})))
}

async fn gl_users(
    State(f): State<FakeGitLab>,
    h: HeaderMap,
    uri: axum::http::Uri,
    Query(q): Query<std::collections::HashMap<String, String>>,
) -> GlReply {
    f.calls
        .lock()
        .unwrap()
        .push(format!("USERS {:?}", q.get("username")));
    if let Err(e) = f.check(&h, &uri) {
        return e;
    }
    let users = match q.get("username").map(String::as_str) {
        Some("alice") => json!([{"id": 42, "username": "alice"}]),
        _ => json!([]),
    };
    (StatusCode::OK, Json(users))
}

pub(crate) async fn spawn_gitlab() -> (String, FakeGitLab) {
    let f = FakeGitLab::default();
    let app = Router::new()
        .route(
            "/api/v4/projects/{p}/merge_requests",
            get(gl_list).post(gl_create),
        )
        .route(
            "/api/v4/projects/{p}/merge_requests/{iid}",
            axum::routing::put(gl_update),
        )
        .route(
            "/api/v4/projects/{p}/merge_requests/{iid}/notes",
            post(gl_note),
        )
        .route("/api/v4/users", get(gl_users))
        .with_state(f.clone());
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(axum::serve(l, app).into_future());
    (format!("http://{addr}/api/v4"), f)
}

#[tokio::test]
async fn gitlab_merge_requests_are_created_updated_and_closed_with_a_note() {
    let (url, fake) = spawn_gitlab().await;
    std::env::set_var("RLC_TEST_GITLAB_TOKEN", "gl-token");
    let cfg: schema::ForgeConfig = serde_yaml::from_str(&format!(
        "kind: gitlab\napi_url: {url}\nrepo: acme/config\ntoken_env: RLC_TEST_GITLAB_TOKEN\nlabels: [quotas, rlc]\nreviewers: [alice, \"7\"]\n"
    ))
    .unwrap();
    let forge = Forge::from_config(&cfg).unwrap().unwrap();
    assert!(matches!(forge, Forge::GitLab(_)));
    let (mr, created) = forge
        .upsert_pull_request("rlc/quotas", "main", "rlc: t", "body 1")
        .await
        .unwrap();
    assert!(created);
    assert_eq!(mr.number, 1);
    assert_eq!(
        mr.html_url.as_deref(),
        Some("http://gitlab/acme/config/-/merge_requests/1")
    );
    {
        let mrs = fake.mrs.lock().unwrap();
        assert_eq!(mrs[0]["source_branch"], "rlc/quotas");
        assert_eq!(mrs[0]["target_branch"], "main");
        assert_eq!(mrs[0]["description"], "body 1");
        assert_eq!(mrs[0]["labels"], "quotas,rlc");
        assert_eq!(mrs[0]["reviewer_ids"], json!([42, 7]));
    }
    // The open one is found by its source branch and updated, not duplicated.
    let (mr, created) = forge
        .upsert_pull_request("rlc/quotas", "main", "rlc: t2", "body 2")
        .await
        .unwrap();
    assert!(!created);
    assert_eq!(mr.number, 1);
    assert_eq!(fake.mrs.lock().unwrap().len(), 1);
    assert_eq!(fake.mrs.lock().unwrap()[0]["description"], "body 2");
    assert_eq!(fake.mrs.lock().unwrap()[0]["title"], "rlc: t2");
    // Closing: a note, then state_event close.
    let closed = forge
        .close_pull_requests("rlc/quotas", "outdated")
        .await
        .unwrap();
    assert_eq!(closed.len(), 1);
    {
        let mrs = fake.mrs.lock().unwrap();
        assert_eq!(mrs[0]["state"], "closed");
        assert_eq!(mrs[0]["notes"], json!(["outdated"]));
    }
    // Nothing open any more: nothing to close, and the next proposal is a new MR.
    assert!(forge
        .close_pull_requests("rlc/quotas", "outdated")
        .await
        .unwrap()
        .is_empty());
    let (mr, created) = forge
        .upsert_pull_request("rlc/quotas", "main", "rlc: t3", "body 3")
        .await
        .unwrap();
    assert!(created);
    assert_eq!(mr.number, 2);
    assert!(
        fake.problems.lock().unwrap().is_empty(),
        "{:?}",
        fake.problems.lock().unwrap()
    );
    let calls = fake.calls.lock().unwrap().clone();
    assert_eq!(
        calls[..4],
        [
            "USERS Some(\"alice\")",
            "GET source_branch=Some(\"rlc/quotas\") state=Some(\"opened\")",
            "POST \"rlc/quotas\" -> \"main\"",
            "USERS Some(\"alice\")",
        ]
    );

    // A wrong token is refused with the status; an unknown reviewer is named.
    let bad = Forge::GitLab(GitLab::new(&url, "acme/config", "nope".into()).unwrap());
    let err = bad
        .upsert_pull_request("rlc/quotas", "main", "t", "b")
        .await
        .unwrap_err();
    assert!(
        matches!(err, ForgeError::Status { status: 401, .. }),
        "{err}"
    );
    let who = forge.decorated(Decoration {
        labels: vec![],
        reviewers: vec!["mallory".into()],
    });
    let err = who
        .upsert_pull_request("rlc/quotas", "main", "t", "b")
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("no GitLab user `mallory`"),
        "{err}"
    );
}
