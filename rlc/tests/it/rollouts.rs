//! Rollouts end to end (`rollout:` in rlc/policies.yaml): real controllers (in process, on
//! their own ports and state directories), a real git remote, and the cycle `rlc serve`
//! drives every poll (push through the rollouts, candidate counts, verdicts, revert). Zone
//! reports of 150 rps offered reach each controller every 100 ms, as an aggregator's would.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use grl_control::controller::{Controller, ControllerHandle, ControllerOptions};
use rlc::cycle::{Cycle, RunStatus};
use rlc::rollout::{Rollout, RolloutState};
use rlc_plan::plan::{Plan, PlannedBucket};
use serde_json::{json, Value};
use test_support::git::{git, GitRemote};

const TOKEN: &str = "ctl-s3cret";
const ZONE_TOKEN: &str = "zone-s3cret";
const OFFERED_RPS: f64 = 150.0;

fn bucket(limit: f64) -> schema::Bucket {
    schema::Bucket {
        name: "charge".into(),
        caller: Some("charge".into()),
        procedure: None,
        scope: schema::Scope::Global,
        limit_rps: limit,
        mode: schema::Mode::Enforce,
        policy: schema::PolicyName::Peak,
    }
}

fn lower_to(limit: f64) -> Plan {
    Plan {
        buckets: vec![PlannedBucket {
            service: "payments".into(),
            bucket: bucket(limit),
            current_limit_rps: Some(3470.0),
            evidence: Default::default(),
            held: None,
        }],
        ..Plan::default()
    }
}

fn remote(stages: &str) -> GitRemote {
    remote_scoped(stages, "global")
}

/// [`remote`] with payments/charge counted under `scope`.
fn remote_scoped(stages: &str, scope: &str) -> GitRemote {
    let files = [
        (
            "rlc/policies.yaml",
            format!(
                "default:\n  policy: peak\n  headroom: 0.25\nrollout:\n  bake: 5s\n  min_offered: 300\n  max_bake: 2m\n{stages}"
            ),
        ),
        (
            "buckets/payments.yaml",
            format!("service: payments\nbuckets:\n  - name: charge\n    caller: charge\n    scope: {scope}\n    limit_rps: 3470\n    mode: enforce\n    policy: peak\n"),
        ),
    ];
    let files: Vec<(&str, &str)> = files.iter().map(|(p, t)| (*p, t.as_str())).collect();
    GitRemote::new("main", &files).unwrap()
}

async fn controller(d: &Path, region: &str, port: u16) -> ControllerHandle {
    peered_controller(d, region, port, vec![]).await
}

/// [`controller`] sending its region's sums of `global` buckets to `peers` every tick.
async fn peered_controller(
    d: &Path,
    region: &str,
    port: u16,
    peers: Vec<String>,
) -> ControllerHandle {
    Controller::start(ControllerOptions {
        listen: format!("127.0.0.1:{port}").parse().unwrap(),
        state_dir: d.join(format!("grl-{region}")),
        token: TOKEN.into(),
        report_token: Some(ZONE_TOKEN.to_string().into()),
        region: Some(region.into()),
        peers,
        tick: Duration::from_millis(200),
        ..Default::default()
    })
    .await
    .unwrap()
}

/// rlc.yaml: the git remote, `controllers` (region, url) and a SQLite store in `d`.
fn config(d: &Path, remote: &GitRemote, controllers: &[(&str, String)]) -> schema::DaemonConfig {
    std::env::set_var("RLC_ROLLOUT_GRL_TOKEN", TOKEN);
    let mut text = format!(
        "history:\n  file: history.csv\nconfig_repo:\n  path: wc\n  url: {}\n  author_name: rlc-bot\n  author_email: rlc@example.com\nrails:\n  decrease_interval: 1s\ndatabase_url: sqlite://rlc.db\n",
        remote.url()
    );
    if let [(region, url)] = controllers {
        text.push_str(&format!(
            "controller:\n  url: {url}\n  region: {region}\n  token_env: RLC_ROLLOUT_GRL_TOKEN\n"
        ));
    } else {
        text.push_str("controllers:\n");
        for (region, url) in controllers {
            text.push_str(&format!(
                "  - region: {region}\n    url: {url}\n    token_env: RLC_ROLLOUT_GRL_TOKEN\n"
            ));
        }
    }
    let path = d.join("rlc.yaml");
    std::fs::write(&path, &text).unwrap();
    schema::load_daemon_config(&path).unwrap()
}

/// Zone reports of 150 rps offered for payments/charge to every url, every 100 ms, until the
/// returned flag is set.
fn traffic(urls: Vec<(String, String)>) -> Arc<AtomicBool> {
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    tokio::spawn(async move {
        let http = reqwest::Client::new();
        while !s.load(Ordering::Relaxed) {
            for (region, url) in &urls {
                let n = (OFFERED_RPS / 10.0) as u64;
                let _ = http
                    .post(format!("{url}/v1/aggregate"))
                    .bearer_auth(ZONE_TOKEN)
                    .json(
                        &json!({"aggregator_id": format!("agg-{region}"), "region": region,
                        "zone": format!("{region}-1"), "buckets": [
                        {"service": "payments", "bucket": "charge", "offered_rps": OFFERED_RPS,
                         "admitted_rps": OFFERED_RPS, "dropped_rps": 0.0, "shadow_dropped_rps": 0.0,
                         "counts": {"bucket": "charge", "offered": n, "admitted": n,
                                    "dropped": 0, "shadow_dropped": 0}}]}),
                    )
                    .send()
                    .await;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    stop
}

async fn get(url: &str, path: &str) -> Value {
    let r = reqwest::Client::new()
        .get(format!("{url}{path}"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{path}: {}", r.status());
    r.json().await.unwrap()
}

/// The limit of payments/charge the controller at `url` serves (what clients enforce).
async fn served_limit(url: &str) -> Option<f64> {
    let c = get(url, "/v1/config").await;
    c["services"]
        .as_array()?
        .iter()
        .find(|s| s["service"] == "payments")?["buckets"]
        .as_array()?
        .iter()
        .find(|b| b["name"] == "charge")?["limit_rps"]
        .as_f64()
}

/// The candidates the controller at `url` evaluates.
async fn candidates(url: &str) -> Vec<Value> {
    get(url, "/v1/candidates").await["candidates"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// What the controller of each region served and evaluated at one poll.
#[derive(Debug, Clone)]
struct Seen {
    limits: Vec<Option<f64>>,
    candidates: Vec<Vec<Value>>,
    rollout: Option<Rollout>,
}

/// Drives the daemon's poll (rollouts, then push) every 300 ms until `done` holds for the
/// newest rollout of payments/charge (bounded: a rollout that never ends fails the test),
/// recording what every controller served at each poll.
async fn drive(cycle: &Cycle, urls: &[String], done: impl Fn(&Rollout) -> bool) -> Vec<Seen> {
    let store = cycle.store().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut seen = Vec::new();
    loop {
        cycle.rollout_tick().await;
        let (_, base) = cycle.poll().await.unwrap();
        let rep = cycle.push_all(&base, None).await;
        assert!(rep.errors.is_empty(), "{:?}", rep.errors);
        let latest = rlc::rollout::latest_by_bucket(&store, 10).await.unwrap();
        let r = latest
            .get(&("payments".to_string(), "charge".to_string()))
            .cloned();
        let mut s = Seen {
            limits: vec![],
            candidates: vec![],
            rollout: r.clone(),
        };
        for u in urls {
            s.limits.push(served_limit(u).await);
            s.candidates.push(candidates(u).await);
        }
        seen.push(s);
        if r.as_ref().is_some_and(&done) {
            return seen;
        }
        assert!(
            Instant::now() < deadline,
            "the rollout did not end within 90 s: {:?}",
            seen.last()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

fn commit_message(remote: &GitRemote) -> String {
    git(
        &remote.bare_path(),
        &["log", "-1", "--format=%B", "refs/heads/main"],
    )
    .unwrap()
}

/// A candidate of 100 rps beside 3,470 with 150 rps offered: the controller keeps serving
/// 3,470 (no request is refused), the candidate's virtual drops are about a third of what is
/// offered, the rollout is aborted, the config repo gets a revert commit naming the evidence,
/// and the same change is not proposed again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_candidate_that_would_refuse_traffic_is_aborted_and_reverted() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let remote = remote("");
    let ctl = controller(d, "eu", test_support::process::free_port()).await;
    let cfg = config(d, &remote, &[("eu", ctl.url())]);
    let cycle = Cycle::new(cfg, d);
    let (_, base) = cycle.poll().await.unwrap();
    assert!(cycle.push_all(&base, None).await.errors.is_empty());
    assert_eq!(served_limit(&ctl.url()).await, Some(3470.0));
    let stop = traffic(vec![("eu".into(), ctl.url())]);

    let out = cycle.apply(&lower_to(100.0), "once").await;
    assert_eq!(out.status, RunStatus::Success, "{out}");
    let lowered = out.commit.clone().unwrap();
    assert!(remote
        .read("main", "buckets/payments.yaml")
        .unwrap()
        .contains("limit_rps: 100\n"));
    assert_eq!(out.rollouts.len(), 1, "{out}");
    assert_eq!(out.rollouts[0].change, "lowered 3470 -> 100 rps", "{out}");
    assert!(out.to_string().contains("rollout payments/charge"), "{out}");
    let json = serde_json::to_value(&out).unwrap();
    assert_eq!(json["rollouts"][0]["state"], "baking", "{json}");

    let seen = drive(&cycle, &[ctl.url()], |r| {
        r.state == RolloutState::Aborted && !r.revert_pending
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    // Nothing was ever enforced below 3,470: clients saw the limit in force only.
    assert!(seen.iter().all(|s| s.limits[0] == Some(3470.0)), "{seen:?}");
    let evaluated = seen
        .iter()
        .flat_map(|s| s.candidates[0].iter())
        .rfind(|c| c["virtual_dropped"].as_f64().unwrap_or(0.0) > 0.0)
        .cloned()
        .expect("the controller evaluated the candidate");
    assert_eq!(
        evaluated["enforced_dropped"].as_f64(),
        Some(0.0),
        "{evaluated}"
    );
    let r = seen.last().unwrap().rollout.clone().unwrap();
    let share = r.figures.share();
    assert!((0.25..0.4).contains(&share), "about a third: {r:?}");
    let reason = r.reason.clone().unwrap();
    assert!(reason.contains("in region eu"), "{reason}");
    assert!(reason.contains("would have been refused"), "{reason}");
    assert!(
        r.revert
            .as_deref()
            .unwrap()
            .starts_with("reverted by commit"),
        "{r:?}"
    );

    // The config repo is back in line: a revert commit on the remote, naming the evidence.
    let head = remote.head("main").unwrap();
    assert_ne!(head, lowered);
    let msg = commit_message(&remote);
    assert!(
        msg.starts_with("rlc: revert payments/charge to 3470 rps enforce: rollout aborted"),
        "{msg}"
    );
    assert!(msg.contains("in region eu"), "{msg}");
    assert!(msg.contains("would have been refused"), "{msg}");
    assert!(remote
        .read("main", "buckets/payments.yaml")
        .unwrap()
        .contains("limit_rps: 3470\n"));
    // Once reverted, the controller runs the base as it is.
    let (_, base) = cycle.poll().await.unwrap();
    cycle.push_all(&base, None).await;
    let st = get(&ctl.url(), "/v1/status").await;
    assert_eq!(st["version"], head.as_str(), "{st}");

    // The same change on the same inputs is held, with the abort as the reason.
    let again = cycle.apply(&lower_to(100.0), "once").await;
    assert_eq!(again.status, RunStatus::Unchanged, "{again}");
    assert_eq!(remote.head("main").unwrap(), head);
    assert!(
        again
            .skipped
            .iter()
            .any(|s| s.reason.contains("its rollout was aborted")),
        "{again}"
    );
    ctl.shutdown().await;
}

/// A candidate well above demand (3,000 rps for 150 offered) is promoted after its bake: the
/// controller serves 3,470 while it bakes, then 3,000. The rollout state lives in the store:
/// a new cycle (an `rlc serve` restart) and a controller restart (a new epoch) in the middle
/// of the bake change nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_candidate_above_demand_is_promoted_after_its_bake_across_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let remote = remote("");
    let port = test_support::process::free_port();
    let ctl = controller(d, "eu", port).await;
    let url = ctl.url();
    let cfg = config(d, &remote, &[("eu", url.clone())]);
    let cycle = Cycle::new(cfg.clone(), d);
    let (_, base) = cycle.poll().await.unwrap();
    assert!(cycle.push_all(&base, None).await.errors.is_empty());
    let stop = traffic(vec![("eu".into(), url.clone())]);
    let out = cycle.apply(&lower_to(3000.0), "once").await;
    assert_eq!(out.status, RunStatus::Success, "{out}");
    assert_eq!(out.rollouts.len(), 1, "{out}");
    // Some counts, then both restart.
    drive(&cycle, std::slice::from_ref(&url), |r| {
        r.figures.offered > 0.0
    })
    .await;
    let epoch = get(&url, "/v1/candidates").await["epoch"].clone();
    drop(cycle);
    assert!(ctl.shutdown().await);
    let ctl = controller(d, "eu", port).await;
    assert_ne!(get(&url, "/v1/candidates").await["epoch"], epoch);
    let cycle = Cycle::new(cfg, d);
    let seen = drive(&cycle, std::slice::from_ref(&url), |r| {
        r.state == RolloutState::Done
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    let r = seen.last().unwrap().rollout.clone().unwrap();
    assert_eq!(r.stage, 1, "{r:?}");
    let baking: Vec<&Seen> = seen
        .iter()
        .filter(|s| s.rollout.as_ref().unwrap().state == RolloutState::Baking)
        .collect();
    assert!(!baking.is_empty());
    assert!(
        baking.iter().all(|s| s.limits[0] == Some(3470.0)),
        "{seen:?}"
    );
    // The promotion is in force at the next push.
    let (_, base) = cycle.poll().await.unwrap();
    cycle.push_all(&base, None).await;
    assert_eq!(served_limit(&url).await, Some(3000.0));
    assert!(candidates(&url).await.is_empty());
    let st = get(&url, "/v1/status").await;
    assert_eq!(st["version"], remote.head("main").unwrap().as_str(), "{st}");
    assert!(remote
        .read("main", "buckets/payments.yaml")
        .unwrap()
        .contains("limit_rps: 3000\n"));
    ctl.shutdown().await;
}

/// Two regions, stages `[[a], [b]]`: a failing candidate is evaluated in `a` and never
/// reaches `b` (neither as a candidate nor in force); a passing one reaches `b` only after
/// `a`'s bake passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_regions_a_failing_candidate_never_reaches_the_second() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let remote = remote("  stages: [[a], [b]]\n");
    let a = controller(d, "a", test_support::process::free_port()).await;
    let b = controller(d, "b", test_support::process::free_port()).await;
    let urls = [a.url(), b.url()];
    let cfg = config(d, &remote, &[("a", a.url()), ("b", b.url())]);
    let cycle = Cycle::new(cfg, d);
    let (_, base) = cycle.poll().await.unwrap();
    assert!(cycle.push_all(&base, None).await.errors.is_empty());
    let stop = traffic(vec![("a".into(), a.url()), ("b".into(), b.url())]);

    // Failing: 100 rps for 150 offered.
    let out = cycle.apply(&lower_to(100.0), "once").await;
    assert_eq!(out.status, RunStatus::Success, "{out}");
    let seen = drive(&cycle, &urls, |r| {
        r.state == RolloutState::Aborted && !r.revert_pending
    })
    .await;
    assert!(
        seen.iter().any(|s| !s.candidates[0].is_empty()),
        "a evaluated it"
    );
    assert!(
        seen.iter()
            .all(|s| s.candidates[1].is_empty() && s.limits[1] == Some(3470.0)),
        "b never saw the failing change: {seen:?}"
    );
    assert!(seen.iter().all(|s| s.limits[0] == Some(3470.0)), "{seen:?}");

    // Passing: 3,000 rps (other inputs than the aborted change: a new limit).
    let out = cycle.apply(&lower_to(3000.0), "once").await;
    assert_eq!(out.status, RunStatus::Success, "{out}");
    let seen = drive(&cycle, &urls, |r| r.state == RolloutState::Done).await;
    stop.store(true, Ordering::Relaxed);
    let first_b = seen
        .iter()
        .position(|s| !s.candidates[1].is_empty())
        .expect("b evaluated the candidate");
    // When b first had the candidate, a's stage had passed: a ran the new limit.
    assert_eq!(seen[first_b].limits[0], Some(3000.0), "{seen:?}");
    assert_eq!(seen[first_b].rollout.as_ref().unwrap().stage, 1, "{seen:?}");
    assert!(seen[..first_b]
        .iter()
        .all(|s| s.limits[1] == Some(3470.0) && s.candidates[1].is_empty()));
    let (_, base) = cycle.poll().await.unwrap();
    cycle.push_all(&base, None).await;
    assert_eq!(served_limit(&a.url()).await, Some(3000.0));
    assert_eq!(served_limit(&b.url()).await, Some(3000.0));
    a.shutdown().await;
    b.shutdown().await;
}

/// Two peered regions with payments/charge at 3,470 rps per region and 150 rps offered in
/// each; the change to 200 rps `global`. Each controller counts the candidate on its own
/// region's 150 rps (its peer forwards the sums of `global` buckets in force only, none for a
/// `region` bucket) and shows no virtual drop, yet in force the fleet's 300 rps would be cut
/// to 200, a third refused. rlc judges the candidate on the sum of the regions' rates: it is
/// aborted and never in force. The same change at 1,000 rps passes and is in force in both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_peered_regions_a_global_limit_is_judged_on_their_sum() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let remote = remote_scoped("", "region");
    let (pa, pb) = (
        test_support::process::free_port(),
        test_support::process::free_port(),
    );
    let url = |p: u16| format!("http://127.0.0.1:{p}");
    let a = peered_controller(d, "a", pa, vec![url(pb)]).await;
    let b = peered_controller(d, "b", pb, vec![url(pa)]).await;
    let urls = [a.url(), b.url()];
    let cfg = config(d, &remote, &[("a", a.url()), ("b", b.url())]);
    let cycle = Cycle::new(cfg, d);
    let (_, base) = cycle.poll().await.unwrap();
    assert!(cycle.push_all(&base, None).await.errors.is_empty());
    let stop = traffic(vec![("a".into(), a.url()), ("b".into(), b.url())]);

    let out = cycle.apply(&lower_to(200.0), "once").await;
    assert_eq!(out.status, RunStatus::Success, "{out}");
    assert_eq!(
        out.rollouts[0].change, "lowered 3470 -> 200 rps, scope region -> global",
        "{out}"
    );
    let seen = drive(&cycle, &urls, |r| r.state != RolloutState::Baking).await;
    let r = seen.last().unwrap().rollout.clone().unwrap();
    assert_eq!(r.state, RolloutState::Aborted, "{r:?}");
    let share = r.figures.share();
    assert!((0.25..0.4).contains(&share), "about a third: {share} {r:?}");
    let reason = r.reason.clone().unwrap();
    assert!(reason.contains("summed over every region"), "{reason}");
    // What each controller counted alone: its region's traffic, no virtual drop.
    for i in 0..2 {
        let last = seen
            .iter()
            .flat_map(|s| s.candidates[i].iter())
            .last()
            .cloned()
            .expect("every region evaluated the candidate");
        assert!(last["offered"].as_f64().unwrap() > 0.0, "{last}");
        assert_eq!(last["virtual_dropped"].as_f64(), Some(0.0), "{last}");
    }
    assert!(
        seen.iter()
            .all(|s| s.limits == vec![Some(3470.0), Some(3470.0)]),
        "never in force: {seen:?}"
    );
    drive(&cycle, &urls, |r| !r.revert_pending).await;

    // Above the fleet's 300 rps: promoted, in force in both regions.
    let out = cycle.apply(&lower_to(1000.0), "once").await;
    assert_eq!(out.status, RunStatus::Success, "{out}");
    let seen = drive(&cycle, &urls, |r| {
        r.new.limit_rps == 1000.0 && r.state != RolloutState::Baking
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    let r = seen.last().unwrap().rollout.clone().unwrap();
    assert_eq!(r.state, RolloutState::Done, "{r:?}");
    let (_, base) = cycle.poll().await.unwrap();
    cycle.push_all(&base, None).await;
    assert_eq!(served_limit(&a.url()).await, Some(1000.0));
    assert_eq!(served_limit(&b.url()).await, Some(1000.0));
    a.shutdown().await;
    b.shutdown().await;
}
