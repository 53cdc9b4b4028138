//! Rollouts through whole cycles against stand-in controllers that evaluate candidates like
//! the real one (150 rps offered; a candidate's virtual drops are what its limit refuses of
//! them), a real git remote and a SQLite store. The end-to-end tests with real controllers are
//! in `rlc/tests/it/rollouts.rs`.

use std::collections::BTreeMap;
use std::future::IntoFuture;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::HeaderMap;
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{json, Value};
use test_support::git::{git, GitRemote};

use super::*;
use crate::rollout::RolloutState;

const OFFERED: f64 = 150.0;

/// What a stand-in controller holds: the last config pushed, when each candidate arrived,
/// and every config it was given.
#[derive(Clone, Default)]
struct Ctl {
    doc: Arc<Mutex<Option<ConfigDoc>>>,
    since: Arc<Mutex<BTreeMap<String, Instant>>>,
    docs: Arc<Mutex<Vec<ConfigDoc>>>,
    /// `GET /v1/candidates` answers 503 while set (the counts cannot be read).
    blind: Arc<std::sync::atomic::AtomicBool>,
    /// Announces grl-proto 4 while set (a controller that predates candidates).
    old: Arc<std::sync::atomic::AtomicBool>,
    /// Announces grl-proto 9 while set (one that reads criticality caps); 5 otherwise.
    caps: Arc<std::sync::atomic::AtomicBool>,
    /// The rate its region offers to payments/gw ([`OFFERED`] when unset).
    rps: Arc<Mutex<Option<f64>>>,
}

impl Ctl {
    /// A stand-in controller whose region offers `rps` to payments/gw.
    fn offering(rps: f64) -> Ctl {
        let c = Ctl::default();
        *c.rps.lock().unwrap() = Some(rps);
        c
    }

    /// The rate its region offers.
    fn offered_rps(&self) -> f64 {
        self.rps.lock().unwrap().unwrap_or(OFFERED)
    }

    /// The limit of payments/gw in force (what clients get).
    fn limit(&self) -> Option<f64> {
        let d = self.doc.lock().unwrap();
        d.as_ref()?
            .services
            .iter()
            .find(|f| f.service == "payments")?
            .buckets
            .iter()
            .find(|b| b.name == "gw")
            .map(|b| b.limit_rps)
    }
}

async fn put_config(State(c): State<Ctl>, Json(doc): Json<ConfigDoc>) -> Json<Value> {
    let mut since = c.since.lock().unwrap();
    since.retain(|id, _| doc.candidates.iter().any(|x| &x.id == id));
    for x in &doc.candidates {
        since.entry(x.id.clone()).or_insert_with(Instant::now);
    }
    c.docs.lock().unwrap().push(doc.clone());
    *c.doc.lock().unwrap() = Some(doc);
    Json(json!({}))
}

async fn status(State(c): State<Ctl>) -> (HeaderMap, Json<Value>) {
    let mut h = HeaderMap::new();
    let proto = if c.old.load(std::sync::atomic::Ordering::SeqCst) {
        "4"
    } else if c.caps.load(std::sync::atomic::Ordering::SeqCst) {
        "9"
    } else {
        "5"
    };
    h.insert("grl-proto", proto.parse().unwrap());
    let v = c.doc.lock().unwrap().as_ref().map(|d| d.version.clone());
    (h, Json(json!({"version": v})))
}

async fn candidates(State(c): State<Ctl>) -> Result<Json<Value>, axum::http::StatusCode> {
    if c.blind.load(std::sync::atomic::Ordering::SeqCst) {
        return Err(axum::http::StatusCode::SERVICE_UNAVAILABLE);
    }
    let doc = c.doc.lock().unwrap().clone().unwrap_or_default();
    let since = c.since.lock().unwrap();
    let rps = c.offered_rps();
    // This region's traffic only, as a real controller counts a candidate read from a
    // `region` bucket or from the calls (its peers forward neither).
    let rows: Vec<Value> = doc
        .candidates
        .iter()
        .map(|x| {
            let s = since[&x.id].elapsed().as_secs_f64();
            let offered = rps * s;
            let refused = (rps - x.bucket.limit_rps).max(0.0) / rps * offered;
            json!({"id": x.id, "service": x.service, "bucket": x.bucket.name,
                   "limit_rps": x.bucket.limit_rps, "mode": "enforce", "seconds": s,
                   "offered": offered, "virtual_dropped": refused, "enforced_dropped": 0.0,
                   "virtual_drop_share": refused / offered.max(1e-9)})
        })
        .collect();
    Ok(Json(
        json!({"epoch": "e1", "now_ms": 0, "candidates": rows}),
    ))
}

async fn overrides() -> Json<Value> {
    Json(json!({"overrides": []}))
}

async fn spawn(c: Ctl) -> String {
    let app = Router::new()
        .route("/v1/config", axum::routing::put(put_config))
        .route("/v1/status", get(status))
        .route("/v1/candidates", get(candidates))
        .route("/v1/overrides", get(overrides))
        .with_state(c);
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(axum::serve(l, app).into_future());
    format!("http://{addr}")
}

/// A config repo with payments/gw at 3,470 rps and `rollout:` (bake 2s, `stages`).
fn remote(stages: &str) -> GitRemote {
    remote_with(&format!(
        "  bake: 2s\n  min_offered: 100\n  max_bake: 1m\n{stages}"
    ))
}

/// A config repo with payments/gw at 3,470 rps and `rollout:` with the keys `rollout`.
fn remote_with(rollout: &str) -> GitRemote {
    remote_gw(rollout, &gw_file("global", 3470.0))
}

/// `buckets/payments.yaml` with gw enforcing `limit` under `scope`.
fn gw_file(scope: &str, limit: f64) -> String {
    format!("service: payments\nbuckets:\n  - name: gw\n    caller: gw\n    scope: {scope}\n    limit_rps: {limit}\n    mode: enforce\n    policy: peak\n")
}

/// A config repo with `rollout:` with the keys `rollout` and `payments` as the payments file.
fn remote_gw(rollout: &str, payments: &str) -> GitRemote {
    let files = [
        (
            "rlc/policies.yaml".to_string(),
            format!("default:\n  policy: peak\n  headroom: 0.25\nrollout:\n{rollout}"),
        ),
        ("buckets/payments.yaml".to_string(), payments.to_string()),
    ];
    let refs: Vec<(&str, &str)> = files
        .iter()
        .map(|(a, b)| (a.as_str(), b.as_str()))
        .collect();
    GitRemote::new("main", &refs).unwrap()
}

fn config(remote: &GitRemote, controllers: &[(&str, &str)], extra: &str) -> DaemonConfig {
    std::env::set_var("RLC_TEST_GRL_TOKEN", "s3cret");
    let mut text = format!(
        "history:\n  file: history.csv\nconfig_repo:\n  path: wc\n  url: {}\n  author_name: rlc-bot\n  author_email: rlc@example.com\n{extra}rails:\n  decrease_interval: 1s\ndatabase_url: sqlite://rlc.db\ncontrollers:\n",
        remote.url()
    );
    for (r, u) in controllers {
        text.push_str(&format!(
            "  - region: {r}\n    url: {u}\n    token_env: RLC_TEST_GRL_TOKEN\n"
        ));
    }
    schema::parse_str::<DaemonConfig>(Path::new("rlc.yaml"), &text)
        .unwrap()
        .value
}

/// A stand-in controller for region `eu` and a cycle on `remote` (`extra`: more `config_repo`
/// keys): the controller, the cycle and its directory.
async fn eu_cycle(remote: &GitRemote, extra: &str) -> (Ctl, Cycle, std::path::PathBuf) {
    let ctl = Ctl::default();
    let url = spawn(ctl.clone()).await;
    let cfg = config(remote, &[("eu", &url)], extra);
    let dir = remote.scratch("");
    let cycle = Cycle::new(cfg, &dir);
    (ctl, cycle, dir)
}

/// [`eu_cycle`] in pull-request mode against a stand-in GitHub: the forge, the controller and
/// the cycle.
async fn pr_cycle(remote: &GitRemote) -> (crate::gitops::tests::FakeForge, Ctl, Cycle) {
    let (forge_url, forge) = crate::gitops::tests::spawn_forge().await;
    let extra = format!(
        "  mode: pull-request\n  forge:\n    kind: github\n    api_url: {forge_url}\n    repo: acme/config\n    token_env: RLC_TEST_FORGE_TOKEN\n"
    );
    std::env::set_var("RLC_TEST_FORGE_TOKEN", "forge-token");
    let (ctl, cycle, _) = eu_cycle(remote, &extra).await;
    (forge, ctl, cycle)
}

fn gw(limit: f64) -> Plan {
    let mut b = crate::gitops::tests::planned("payments", "gw", limit);
    b.current_limit_rps = Some(3470.0);
    crate::gitops::tests::plan(vec![b])
}

/// `rlc serve`'s poll, until the newest rollout of payments/gw satisfies `done`; returns it.
async fn poll_until(cycle: &Cycle, done: impl Fn(&rollout::Rollout) -> bool) -> rollout::Rollout {
    poll_bucket(cycle, ("payments", "gw"), Duration::from_secs(60), done).await
}

/// Waits for an aborted rollout's revert commit; the base's bucket file then holds `holds`.
async fn assert_reverted(cycle: &Cycle, remote: &GitRemote, holds: &str) -> rollout::Rollout {
    let r = poll_until(cycle, |r| !r.revert_pending).await;
    assert!(
        r.revert
            .as_deref()
            .unwrap()
            .starts_with("reverted by commit"),
        "{r:?}"
    );
    assert!(remote
        .read("main", "buckets/payments.yaml")
        .unwrap()
        .contains(holds));
    r
}

/// `rlc serve`'s poll, until the newest rollout of `bucket` (service, bucket) satisfies
/// `done`, for at most `within`; returns it.
async fn poll_bucket(
    cycle: &Cycle,
    bucket: (&str, &str),
    within: Duration,
    done: impl Fn(&rollout::Rollout) -> bool,
) -> rollout::Rollout {
    let store = cycle.store().await.unwrap();
    let deadline = Instant::now() + within;
    let key = (bucket.0.to_string(), bucket.1.to_string());
    loop {
        cycle.rollout_tick().await;
        let (_, base) = cycle.poll().await.unwrap();
        let rep = cycle.push_all(&base, None).await;
        assert!(rep.errors.is_empty(), "{:?}", rep.errors);
        let latest = rollout::latest_by_bucket(&store, 10).await.unwrap();
        let Some(r) = latest.get(&key).cloned() else {
            assert!(Instant::now() < deadline, "no rollout of {key:?}");
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        if done(&r) {
            return r;
        }
        assert!(Instant::now() < deadline, "rollout stuck: {r:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn a_lowering_is_a_candidate_aborted_with_a_revert_commit_and_not_proposed_again() {
    let remote = remote("");
    let (ctl, cycle, _) = eu_cycle(&remote, "").await;
    let out = cycle.apply(&gw(100.0), "once").await;
    assert_eq!(out.status, RunStatus::Success, "{out}");
    let lowered = remote.head("main").unwrap();
    assert!(
        out.version_pushed
            .as_deref()
            .unwrap()
            .starts_with(&format!("{lowered}+c")),
        "{out}"
    );
    assert_eq!(ctl.limit(), Some(3470.0), "the limit in force stays");
    let doc = ctl.doc.lock().unwrap().clone().unwrap();
    assert_eq!(doc.candidates.len(), 1);
    assert_eq!(doc.candidates[0].bucket.limit_rps, 100.0);
    assert_eq!(out.rollouts[0].state, "baking", "{out}");
    assert!(
        out.rollouts[0].summary.starts_with("baking in region eu"),
        "{out}"
    );

    let r = poll_until(&cycle, |r| {
        r.state == RolloutState::Aborted && !r.revert_pending
    })
    .await;
    let reason = r.reason.clone().unwrap();
    assert!(reason.contains("in region eu"), "{reason}");
    assert!(
        (r.figures.share() - 1.0 / 3.0).abs() < 1e-6,
        "a third: {r:?}"
    );
    // Never in force: every config the controller got kept 3,470.
    assert!(ctl
        .docs
        .lock()
        .unwrap()
        .iter()
        .all(|d| d.services[0].buckets[0].limit_rps == 3470.0));
    let msg = git(
        &remote.bare_path(),
        &["log", "-1", "--format=%B", "refs/heads/main"],
    )
    .unwrap();
    assert!(
        msg.starts_with("rlc: revert payments/gw to 3470 rps enforce: rollout aborted"),
        "{msg}"
    );
    assert!(msg.contains("would have been refused"), "{msg}");
    assert!(remote
        .read("main", "buckets/payments.yaml")
        .unwrap()
        .contains("limit_rps: 3470\n"));
    // Back in line: the controller runs the revert commit as it is, without candidates.
    let (_, base) = cycle.poll().await.unwrap();
    cycle.push_all(&base, None).await;
    let doc = ctl.doc.lock().unwrap().clone().unwrap();
    assert_eq!(Some(doc.version), remote.head("main"));
    assert!(doc.candidates.is_empty());

    let again = cycle.apply(&gw(100.0), "once").await;
    assert_eq!(again.status, RunStatus::Unchanged, "{again}");
    assert!(
        again
            .skipped
            .iter()
            .any(|s| s.reason.contains("its rollout was aborted")),
        "{again}"
    );
}

#[tokio::test]
async fn two_stages_promote_region_by_region_and_a_failure_never_leaves_the_first() {
    let remote = remote("  stages: [[a], [b]]\n");
    let (ca, cb) = (Ctl::default(), Ctl::default());
    let (ua, ub) = (spawn(ca.clone()).await, spawn(cb.clone()).await);
    let cfg = config(&remote, &[("a", &ua), ("b", &ub)], "");
    let cycle = Cycle::new(cfg, &remote.scratch(""));
    // Failing: only a evaluates it; b never sees it.
    let out = cycle.apply(&gw(100.0), "once").await;
    assert_eq!(out.status, RunStatus::Success, "{out}");
    poll_until(&cycle, |r| {
        r.state == RolloutState::Aborted && !r.revert_pending
    })
    .await;
    assert!(ca
        .docs
        .lock()
        .unwrap()
        .iter()
        .any(|d| !d.candidates.is_empty()));
    assert!(cb
        .docs
        .lock()
        .unwrap()
        .iter()
        .all(|d| d.candidates.is_empty() && d.services[0].buckets[0].limit_rps == 3470.0));
    // Passing: a first, b after a's bake.
    let out = cycle.apply(&gw(3000.0), "once").await;
    assert_eq!(out.status, RunStatus::Success, "{out}");
    let r = poll_until(&cycle, |r| r.state == RolloutState::Done).await;
    assert_eq!(r.stage, 2);
    let b_first = cb
        .docs
        .lock()
        .unwrap()
        .iter()
        .find(|d| !d.candidates.is_empty())
        .cloned()
        .expect("b evaluated the candidate");
    assert_eq!(b_first.services[0].buckets[0].limit_rps, 3470.0);
    // When b got the candidate, a already ran 3,000 (a's docs: the last with a candidate came
    // before the first with 3,000 in force, and that came before b's candidate).
    let a_docs = ca.docs.lock().unwrap().clone();
    let a_promoted = a_docs
        .iter()
        .position(|d| d.services[0].buckets[0].limit_rps == 3000.0)
        .expect("a ran 3,000");
    assert!(a_docs[a_promoted..].iter().all(|d| d.candidates.is_empty()));
    let (_, base) = cycle.poll().await.unwrap();
    cycle.push_all(&base, None).await;
    assert_eq!((ca.limit(), cb.limit()), (Some(3000.0), Some(3000.0)));
}

/// One stage of two regions, one of whose controllers cannot be read: the other's counts
/// alone do not pass the stage, however long they are; once both report the whole bake, it
/// passes.
#[tokio::test]
async fn a_stage_passes_only_on_the_counts_of_every_region_in_it() {
    let remote = remote("");
    let (ca, cb) = (Ctl::default(), Ctl::default());
    let (ua, ub) = (spawn(ca.clone()).await, spawn(cb.clone()).await);
    cb.blind.store(true, std::sync::atomic::Ordering::SeqCst);
    let cfg = config(&remote, &[("a", &ua), ("b", &ub)], "");
    let cycle = Cycle::new(cfg, &remote.scratch(""));
    let out = cycle.apply(&gw(3000.0), "once").await;
    assert_eq!(out.status, RunStatus::Success, "{out}");
    let store = cycle.store().await.unwrap();
    // Three bakes' time: a's counts pass the bar, b's are missing.
    let until = Instant::now() + Duration::from_secs(6);
    while Instant::now() < until {
        cycle.rollout_tick().await;
        let (_, base) = cycle.poll().await.unwrap();
        cycle.push_all(&base, None).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let latest = rollout::latest_by_bucket(&store, 10).await.unwrap();
    let r = &latest[&("payments".to_string(), "gw".to_string())];
    assert_eq!(r.state, RolloutState::Baking, "{r:?}");
    assert_eq!((ca.limit(), cb.limit()), (Some(3470.0), Some(3470.0)));
    // b can be read again: its counts cover the bake, the stage passes.
    cb.blind.store(false, std::sync::atomic::Ordering::SeqCst);
    poll_until(&cycle, |r| r.state == RolloutState::Done).await;
    let (_, base) = cycle.poll().await.unwrap();
    cycle.push_all(&base, None).await;
    assert_eq!((ca.limit(), cb.limit()), (Some(3000.0), Some(3000.0)));
}

#[tokio::test]
async fn without_rollout_changes_apply_at_once() {
    let remote = crate::gitops::tests::seeded_remote();
    let (ctl, cycle, _) = eu_cycle(&remote, "").await;
    let mut p = gw(50.0);
    p.buckets[0].current_limit_rps = Some(100.0);
    let out = cycle.apply(&p, "once").await;
    assert_eq!(out.status, RunStatus::Success, "{out}");
    assert_eq!(out.version_pushed, remote.head("main"), "{out}");
    assert_eq!(ctl.limit(), Some(50.0));
    assert!(out.rollouts.is_empty());
}

/// Pull-request mode: the lowering reaches the base branch when a person merges its pull
/// request; its candidate fails, the controllers keep 3,470 although the base holds 100, the
/// revert is pushed to a branch of its own and proposed in a pull request labelled
/// `rollout-aborted` that names the first, and the first gets a comment with the evidence, a
/// link to the revert and the label (the stand-in forge checks the credential and the
/// comment's size, and records the label). Once a person merges the revert, the base holds
/// 3,470 again.
#[tokio::test]
async fn pull_request_mode_proposes_the_revert_in_a_pull_request_of_its_own() {
    let remote = remote("");
    let (forge, ctl, cycle) = pr_cycle(&remote).await;
    let out = cycle.apply(&gw(100.0), "once").await;
    assert_eq!(out.pull_request.as_ref().map(|p| p.0), Some(1), "{out}");
    assert!(out.rollouts.is_empty(), "nothing on the base yet: {out}");
    let merged = remote.human_merge("rlc/quotas").unwrap();

    let r = poll_until(&cycle, |r| {
        r.state == RolloutState::Aborted && !r.revert_pending
    })
    .await;
    assert_eq!(r.version, merged);
    assert_eq!(
        r.revert.as_deref(),
        Some(
            "revert proposed in pull request #2, labelled `rollout-aborted`; commented on pull request #1"
        )
    );
    assert_eq!(
        remote.head("main").unwrap(),
        merged,
        "people merge the revert in PR mode"
    );
    let branch = format!(
        "rlc/quotas-revert-{}",
        r.id.replace(|c: char| !c.is_ascii_alphanumeric() && c != '-', "-")
    );
    assert!(remote
        .read(&branch, "buckets/payments.yaml")
        .unwrap()
        .contains("limit_rps: 3470\n"));
    {
        let prs = forge.prs.lock().unwrap();
        assert_eq!(prs.len(), 2, "{prs:?}");
        let revert = &prs[1];
        assert_eq!(revert["head"], branch.as_str(), "{revert}");
        assert_eq!(revert["base"], "main", "{revert}");
        let title = revert["title"].as_str().unwrap();
        assert!(
            title.starts_with("rlc: revert payments/gw to 3470 rps enforce: rollout aborted"),
            "{title}"
        );
        let body = revert["body"].as_str().unwrap();
        assert!(body.contains("would have been refused"), "{body}");
        assert!(body.contains("Reverts the change of #1."), "{body}");
        let comments = prs[0]["comments"].as_array().unwrap();
        let c = comments.last().unwrap().as_str().unwrap();
        assert!(
            c.starts_with("Rollout aborted by rlc: `payments/gw` lowered 3470 -> 100 rps"),
            "{c}"
        );
        assert!(c.contains("would have been refused"), "{c}");
        assert!(c.contains("The revert is proposed in #2"), "{c}");
    }
    let decorations = forge.decorations.lock().unwrap().clone();
    assert!(
        decorations.contains(&(1, json!({"labels": ["rollout-aborted"]}))),
        "{decorations:?}"
    );
    assert!(
        decorations.contains(&(2, json!({"labels": ["rollout-aborted"]}))),
        "{decorations:?}"
    );
    assert!(
        forge.problems.lock().unwrap().is_empty(),
        "{:?}",
        forge.problems.lock().unwrap()
    );
    // The controller keeps the limit in force while the base holds the aborted change.
    for _ in 0..3 {
        let (_, base) = cycle.poll().await.unwrap();
        assert!(cycle.push_all(&base, None).await.errors.is_empty());
    }
    assert!(ctl
        .docs
        .lock()
        .unwrap()
        .iter()
        .all(|d| d.services[0].buckets[0].limit_rps == 3470.0));
    assert!(ctl
        .doc
        .lock()
        .unwrap()
        .as_ref()
        .unwrap()
        .candidates
        .is_empty());
    // A person merges the revert: the base holds 3,470 again, and so do the controllers.
    remote.human_merge(&branch).unwrap();
    assert!(remote
        .read("main", "buckets/payments.yaml")
        .unwrap()
        .contains("limit_rps: 3470\n"));
    let (_, base) = cycle.poll().await.unwrap();
    assert!(cycle.push_all(&base, None).await.errors.is_empty());
    assert_eq!(ctl.limit(), Some(3470.0));
}

/// A pull request a person merges is recorded as applied at the next poll: the quota history
/// says `applied` for the merged proposal, once.
#[tokio::test]
async fn a_merged_pull_request_is_recorded_as_applied_by_the_next_poll() {
    let remote = remote("");
    let (_forge, _ctl, cycle) = pr_cycle(&remote).await;
    let out = cycle.apply(&gw(100.0), "once").await;
    assert_eq!(out.pull_request.as_ref().map(|p| p.0), Some(1), "{out}");
    let store = cycle.store().await.unwrap();
    let states = |h: Vec<crate::store::QuotaRecord>| h.iter().map(|q| q.state).collect::<Vec<_>>();
    let history = store.quota_history("payments", "gw").await.unwrap();
    assert_eq!(states(history), [ChangeState::Proposed]);
    // Not merged yet: nothing changes.
    let (_, base) = cycle.poll().await.unwrap();
    assert_eq!(cycle.record_merged(&base).await.unwrap(), 0);
    remote.human_merge("rlc/quotas").unwrap();
    let (_, base) = cycle.poll().await.unwrap();
    assert_eq!(cycle.record_merged(&base).await.unwrap(), 1);
    let history = store.quota_history("payments", "gw").await.unwrap();
    assert_eq!(states(history), [ChangeState::Applied]);
    assert_eq!(cycle.record_merged(&base).await.unwrap(), 0);
}

/// After an abort in pull-request mode the base holds the aborted 100 rps while the
/// controllers keep 3,470. A person then lowers the bucket again (90): the limit in force is
/// still 3,470, so the new change is a rollout from 3,470, baked as a candidate with 3,470
/// enforced, never 100 or 90 enforced because the base said 100.
#[tokio::test]
async fn after_an_abort_the_next_change_is_accounted_against_what_the_controllers_run() {
    let remote = remote("");
    let (_forge, ctl, cycle) = pr_cycle(&remote).await;
    let out = cycle.apply(&gw(100.0), "once").await;
    assert_eq!(out.pull_request.as_ref().map(|p| p.0), Some(1), "{out}");
    remote.human_merge("rlc/quotas").unwrap();
    let aborted = poll_until(&cycle, |r| {
        r.state == RolloutState::Aborted && !r.revert_pending
    })
    .await;
    assert_eq!(ctl.limit(), Some(3470.0));
    // A person lowers it further on the base branch.
    let seen = ctl.docs.lock().unwrap().len();
    let lowered = remote
        .human_commit(
            "main",
            &[(
                "buckets/payments.yaml",
                "service: payments\nbuckets:\n  - name: gw\n    caller: gw\n    scope: global\n    limit_rps: 90\n    mode: enforce\n    policy: peak\n",
            )],
            "lower gw to 90",
        )
        .unwrap();
    let next = poll_until(&cycle, |r| r.id != aborted.id).await;
    assert_eq!(next.version, lowered);
    assert_eq!(
        next.old.as_ref().map(|b| b.limit_rps),
        Some(3470.0),
        "the change is accounted against what the controllers run: {next:?}"
    );
    assert_eq!(next.new.limit_rps, 90.0);
    // Every config pushed since kept 3,470 in force.
    let docs = ctl.docs.lock().unwrap();
    assert!(docs.len() > seen);
    for d in &docs[seen..] {
        assert_eq!(d.services[0].buckets[0].limit_rps, 3470.0, "{d:?}");
    }
}

/// `stages` naming none of the configured regions (a typo, or `controller:` alone, which is
/// region `default`): the change is still a candidate, in every region as one stage, never
/// applied at once.
#[tokio::test]
async fn stages_that_name_no_configured_region_roll_out_everywhere_as_one_stage() {
    let remote = remote("  stages: [[eu-west], [us-east]]\n");
    let (ctl, cycle, _) = eu_cycle(&remote, "").await;
    let out = cycle.apply(&gw(100.0), "once").await;
    assert_eq!(out.status, RunStatus::Success, "{out}");
    assert_eq!(ctl.limit(), Some(3470.0), "applied at once");
    let store = cycle.store().await.unwrap();
    let latest = rollout::latest_by_bucket(&store, 10).await.unwrap();
    let r = &latest[&("payments".to_string(), "gw".to_string())];
    assert_eq!(r.stages, vec![vec!["eu".to_string()]]);
    assert_eq!(
        ctl.doc.lock().unwrap().as_ref().unwrap().candidates.len(),
        1
    );
}

/// With `rollout:` set and the store gone, rlc cannot know what is rolled out where: nothing is
/// pushed (the controllers keep what they run, candidate included), and the push says why.
#[tokio::test]
async fn with_rollout_set_and_the_store_gone_the_controllers_keep_what_they_run() {
    let remote = remote("");
    let (ctl, cycle, dir) = eu_cycle(&remote, "").await;
    let out = cycle.apply(&gw(100.0), "once").await;
    assert_eq!(out.status, RunStatus::Success, "{out}");
    let pushed = ctl.docs.lock().unwrap().len();
    std::fs::remove_file(dir.join("rlc.db")).unwrap();
    let (_, base) = cycle.poll().await.unwrap();
    let rep = cycle.push_all(&base, None).await;
    assert!(
        rep.errors
            .iter()
            .any(|e| e.contains("rollout state unavailable")),
        "{:?}",
        rep.errors
    );
    assert_eq!(ctl.docs.lock().unwrap().len(), pushed, "nothing pushed");
    assert_eq!(ctl.limit(), Some(3470.0));
    assert_eq!(
        ctl.doc.lock().unwrap().as_ref().unwrap().candidates.len(),
        1
    );
}

/// A stage whose controller never gets the candidate (it predates candidates: grl-proto 4)
/// does not hold the rollout forever: once the stage waited `max_bake` it is aborted, the
/// reason saying the candidate never ran, never earlier, and the config repo is brought back
/// in line. The controller kept the limit in force throughout.
#[tokio::test]
async fn a_stage_whose_controllers_never_get_the_candidate_is_aborted_at_max_bake() {
    let remote = remote_with("  bake: 1s\n  min_offered: 100\n  max_bake: 3s\n");
    let (ctl, cycle, _) = eu_cycle(&remote, "").await;
    ctl.old.store(true, std::sync::atomic::Ordering::SeqCst);
    let began = Instant::now();
    let out = cycle.apply(&gw(100.0), "once").await;
    assert_eq!(out.status, RunStatus::Success, "{out}");
    assert_eq!(out.rollouts[0].state, "pending", "{out}");
    assert!(
        out.rollouts[0].summary.contains("aborted if it has not by"),
        "{out}"
    );
    let r = poll_bucket(&cycle, ("payments", "gw"), Duration::from_secs(20), |r| {
        r.state != RolloutState::Baking
    })
    .await;
    assert!(
        began.elapsed() >= Duration::from_secs(3),
        "not before max_bake"
    );
    assert_eq!(r.state, RolloutState::Aborted, "{r:?}");
    let reason = r.reason.clone().unwrap();
    assert!(reason.starts_with("never ran"), "{reason}");
    assert!(
        reason.contains("never reached the controller(s)"),
        "{reason}"
    );
    assert!(reason.contains("in region eu"), "{reason}");
    assert_reverted(&cycle, &remote, "limit_rps: 3470\n").await;
    assert!(ctl
        .docs
        .lock()
        .unwrap()
        .iter()
        .all(|d| d.candidates.is_empty() && d.services[0].buckets[0].limit_rps == 3470.0));
}

/// The bucket files' criticality sections go only to a controller that reads them: one of
/// grl-proto 5 gets the config without them (its strict parser would refuse the whole
/// document), one of grl-proto 9 with them.
#[tokio::test]
async fn criticality_sections_go_only_to_controllers_that_read_them() {
    let capped = |tier: &str| {
        format!(
            "service: payments\ncriticality:\n  caps:\n    cron: {tier}\n{}",
            gw_file("global", 3470.0).trim_start_matches("service: payments\n")
        )
    };
    let remote = remote_gw("  enabled: false\n", &capped("SHEDDABLE"));
    let (ctl, cycle, _) = eu_cycle(&remote, "").await;
    let last_caps = || {
        let docs = ctl.docs.lock().unwrap();
        let d = docs.last().expect("a push");
        assert_eq!(d.services[0].buckets[0].limit_rps, 3470.0);
        d.services[0].criticality.caps.clone()
    };
    let (_, base) = cycle.poll().await.unwrap();
    let report = cycle.push_all(&base, None).await;
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert!(last_caps().is_empty());
    ctl.caps.store(true, std::sync::atomic::Ordering::SeqCst);
    remote
        .human_commit(
            "main",
            &[("buckets/payments.yaml", &capped("SHEDDABLE_PLUS"))],
            "cap cron higher",
        )
        .unwrap();
    let (_, base) = cycle.poll().await.unwrap();
    let report = cycle.push_all(&base, None).await;
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_eq!(
        last_caps().get("cron"),
        Some(&schema::Criticality::SheddablePlus)
    );
}

/// A person adds a new service whose only bucket enforces 100 rps (150 offered): its
/// candidate fails. Bringing the config repo back in line means removing the file the change
/// added (the spec in force is "no bucket"), not recording success while the base still holds
/// it.
#[tokio::test]
async fn an_aborted_new_service_is_reverted_by_removing_its_file() {
    let remote = remote("");
    let (ctl, cycle, _) = eu_cycle(&remote, "").await;
    // The base as it is is accounted (what is in force).
    let (_, base) = cycle.poll().await.unwrap();
    assert!(cycle.push_all(&base, None).await.errors.is_empty());
    let added = remote
        .human_commit(
            "main",
            &[(
                "buckets/billing.yaml",
                "service: billing\nbuckets:\n  - name: api\n    caller: web\n    scope: global\n    limit_rps: 100\n    mode: enforce\n    policy: peak\n",
            )],
            "add billing",
        )
        .unwrap();
    let r = poll_bucket(&cycle, ("billing", "api"), Duration::from_secs(60), |r| {
        r.state == RolloutState::Aborted && !r.revert_pending
    })
    .await;
    assert_eq!(r.version, added);
    assert_eq!(r.old, None, "a new bucket: {r:?}");
    let revert = r.revert.clone().unwrap();
    assert!(revert.starts_with("reverted by commit"), "{revert}");
    assert!(
        remote.read("main", "buckets/billing.yaml").is_err(),
        "the file the change added is gone"
    );
    assert!(remote
        .read("main", "buckets/payments.yaml")
        .unwrap()
        .contains("limit_rps: 3470\n"));
    let msg = git(
        &remote.bare_path(),
        &["log", "-1", "--format=%B", "refs/heads/main"],
    )
    .unwrap();
    assert!(
        msg.starts_with("rlc: revert billing/api to no bucket: rollout aborted"),
        "{msg}"
    );
    // Back in line: the controller runs the revert commit as it is, without billing.
    let (_, base) = cycle.poll().await.unwrap();
    assert!(cycle.push_all(&base, None).await.errors.is_empty());
    let doc = ctl.doc.lock().unwrap().clone().unwrap();
    assert_eq!(Some(doc.version.clone()), remote.head("main"));
    assert!(doc.candidates.is_empty());
    assert!(
        doc.services.iter().all(|f| f.service != "billing"),
        "{doc:?}"
    );
    // The enforcing 100 rps never reached the controller in force.
    assert!(ctl.docs.lock().unwrap().iter().all(|d| d
        .services
        .iter()
        .filter(|f| f.service == "billing")
        .all(|f| f.buckets.is_empty())));
}

/// A `global` limit is one limit over the whole fleet, but a region's controller counts a
/// candidate read from a `region` bucket (or from the calls) on its own region's traffic only:
/// its peers forward the sums of `global` buckets in force, and no calls. Three regions each
/// offering 600 rps and payments/gw changed from 3,470 rps per region to 1,000 rps global:
/// each controller sees 600 < 1,000 and counts no virtual drop, yet in force the fleet's
/// 1,800 rps would be cut to 1,000 (44 % refused). The candidate is judged on the sum of the
/// regions' rates: aborted at about 44 %, never in force anywhere. The rollout is one stage of
/// every region whatever `stages` says (a global limit in force in one region only would be
/// judged and enforced on that region's traffic). The same change at 2,000 rps (above the
/// fleet's 1,800) passes.
#[tokio::test]
async fn a_global_limit_is_judged_on_the_sum_of_every_region() {
    let remote = remote_gw(
        "  bake: 2s\n  min_offered: 100\n  max_bake: 1m\n  stages: [[a], [\"*\"]]\n",
        &gw_file("region", 3470.0),
    );
    let ctls: Vec<Ctl> = (0..3).map(|_| Ctl::offering(600.0)).collect();
    let mut urls = Vec::new();
    for c in &ctls {
        urls.push(spawn(c.clone()).await);
    }
    let cfg = config(
        &remote,
        &[("a", &urls[0]), ("b", &urls[1]), ("c", &urls[2])],
        "",
    );
    let cycle = Cycle::new(cfg, &remote.scratch(""));
    // The base as it is is accounted (what is in force).
    let (_, base) = cycle.poll().await.unwrap();
    assert!(cycle.push_all(&base, None).await.errors.is_empty());
    let in_force = |c: &Ctl| -> Vec<(f64, schema::Scope)> {
        c.docs
            .lock()
            .unwrap()
            .iter()
            .map(|d| {
                (
                    d.services[0].buckets[0].limit_rps,
                    d.services[0].buckets[0].scope,
                )
            })
            .collect()
    };

    let global = remote
        .human_commit(
            "main",
            &[("buckets/payments.yaml", gw_file("global", 1000.0).as_str())],
            "gw: one global limit",
        )
        .unwrap();
    let r = poll_until(&cycle, |r| r.state != RolloutState::Baking).await;
    assert_eq!(r.version, global, "{r:?}");
    assert_eq!(r.state, RolloutState::Aborted, "{r:?}");
    assert_eq!(
        r.stages,
        vec![vec!["a".to_string(), "b".to_string(), "c".to_string()]],
        "one stage of every region: {r:?}"
    );
    let share = r.figures.share();
    assert!(
        (share - 0.8 / 1.8).abs() < 0.01,
        "the fleet's 1,800 rps against 1,000: {share} {r:?}"
    );
    let reason = r.reason.clone().unwrap();
    assert!(reason.contains("in region a, b, c"), "{reason}");
    assert!(reason.contains("summed over every region"), "{reason}");
    for c in &ctls {
        assert!(
            c.docs
                .lock()
                .unwrap()
                .iter()
                .any(|d| !d.candidates.is_empty()),
            "every region evaluated the candidate"
        );
        assert!(
            in_force(c)
                .iter()
                .all(|x| *x == (3470.0, schema::Scope::Region)),
            "never in force: {:?}",
            in_force(c)
        );
    }
    assert_reverted(&cycle, &remote, "scope: region\n").await;

    // Above the fleet's demand: passes, and is in force everywhere at once.
    let above = remote
        .human_commit(
            "main",
            &[("buckets/payments.yaml", gw_file("global", 2000.0).as_str())],
            "gw: one global limit above demand",
        )
        .unwrap();
    let r = poll_until(&cycle, |r| {
        r.version == above && r.state != RolloutState::Baking
    })
    .await;
    assert_eq!(r.state, RolloutState::Done, "{r:?}");
    assert_eq!(r.figures.virtual_dropped, 0.0, "{r:?}");
    let (_, base) = cycle.poll().await.unwrap();
    assert!(cycle.push_all(&base, None).await.errors.is_empty());
    for c in &ctls {
        assert_eq!(c.limit(), Some(2000.0));
    }
}
