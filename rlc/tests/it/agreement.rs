//! One plan, whoever asks: for random policies, histories and repo states, `rlc preview
//! --format json`, `GET /v1/quotas`, an empty `POST /v1/previews` and what `rlc run --once`
//! commits agree bucket by bucket: limit, mode, whether a decrease is held, whether a change
//! needs review. Real `rlc` binaries, a config repo served by `git daemon`, SQLite.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use proptest::prelude::*;
use serde_json::Value;
use test_support::git::GitRemote;
use test_support::process::{free_port, Proc};

const DAY: i64 = 86_400;
const STEP: i64 = 300;

/// One bucket of the repo before the runs.
#[derive(Debug, Clone)]
struct Bucket {
    caller: String,
    limit: f64,
    shadow: bool,
    /// Its traffic (constant, with a little noise), if it has any.
    rps: Option<f64>,
    /// The share of its shadow traffic over the limit in the store's reports (shadow only).
    over: f64,
}

/// One generated case.
#[derive(Debug, Clone)]
struct Case {
    services: Vec<(String, String, f64, Vec<Bucket>)>, // (name, policy, headroom, buckets)
    promotion: bool,
    pull_request: bool,
    run_before: bool,
}

fn bucket() -> impl Strategy<Value = Bucket> {
    (
        100.0..2000.0f64,
        any::<bool>(),
        prop::option::weighted(0.85, 50.0..1500.0f64),
        prop::sample::select(vec![0.0, 0.0, 0.2]),
    )
        .prop_map(|(limit, shadow, rps, over)| Bucket {
            caller: String::new(),
            limit: limit.round(),
            shadow,
            rps,
            over,
        })
}

fn case() -> impl Strategy<Value = Case> {
    (
        prop::collection::vec(
            (
                prop::sample::select(vec!["peak", "forecast"]),
                prop::sample::select(vec![0.1, 0.25, 0.5]),
                prop::collection::vec(bucket(), 1..4),
            ),
            1..3,
        ),
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(services, promotion, pull_request, run_before)| Case {
            services: services
                .into_iter()
                .enumerate()
                .map(|(i, (policy, headroom, mut buckets))| {
                    for (j, b) in buckets.iter_mut().enumerate() {
                        b.caller = format!("c{j}");
                    }
                    (format!("svc{i}"), policy.to_string(), headroom, buckets)
                })
                .collect(),
            promotion,
            pull_request,
            run_before,
        })
}

/// What one consumer says of one bucket.
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    limit: f64,
    mode: String,
    held: bool,
    review: bool,
}

fn files(case: &Case) -> Vec<(String, String)> {
    let mut policies = String::from("default:\n  policy: peak\n  headroom: 0.25\nservices:\n");
    for (name, policy, headroom, _) in &case.services {
        policies.push_str(&format!(
            "  {name}:\n    policy: {policy}\n    headroom: {headroom}\n"
        ));
    }
    if case.promotion {
        // Promotions and raises may be committed directly; decreases and the rest need review.
        policies.push_str(
            "promotion:\n  default:\n    min_days_in_shadow: 1\n    auto_merge: [promotion, raise, new_shadow, other]\n",
        );
    }
    let mut out = vec![("rlc/policies.yaml".to_string(), policies)];
    for (name, _, _, buckets) in &case.services {
        let mut f = format!("service: {name}\nbuckets:\n");
        for b in buckets {
            f.push_str(&format!(
                "  - name: {c}\n    caller: {c}\n    limit_rps: {}\n    mode: {}\n    policy: peak\n",
                b.limit,
                if b.shadow { "shadow" } else { "enforce" },
                c = b.caller
            ));
        }
        out.push((format!("buckets/{name}.yaml"), f));
    }
    out
}

/// Eight days of history at a 5-minute step, ending a few minutes ago.
fn history(case: &Case, path: &Path, end: i64) {
    let mut csv = String::from("ts,service,caller,procedure,rps\n");
    for (si, (name, _, _, buckets)) in case.services.iter().enumerate() {
        for (bi, b) in buckets.iter().enumerate() {
            let Some(rps) = b.rps else { continue };
            let mut t = end - 8 * DAY;
            let mut n = 0u64;
            while t <= end {
                let noise = rlc_plan::corpus::unit((si as u64) << 40 | (bi as u64) << 32 | n);
                csv.push_str(&format!(
                    "{t},{name},{},,{:.3}\n",
                    b.caller,
                    rps * (0.9 + 0.2 * noise)
                ));
                t += STEP;
                n += 1;
            }
        }
    }
    std::fs::write(path, csv).unwrap();
}

/// A day of one shadow report a minute for every shadow bucket with traffic, so that
/// promotion has figures to decide on.
async fn shadow_reports(case: &Case, dir: &Path) {
    let store = rlc::store::Store::connect("sqlite://rlc.db", dir)
        .await
        .unwrap();
    let now = chrono::Utc::now().timestamp() / 60 * 60;
    let mut seq = 0;
    let mut batch = Vec::new();
    for (name, _, _, buckets) in &case.services {
        for b in buckets.iter().filter(|b| b.shadow && b.rps.is_some()) {
            for m in 0..2 * 1440 {
                seq += 1;
                let offered = b.rps.unwrap();
                let over = offered * b.over;
                batch.push(
                    serde_json::from_value::<grl_wire::ReportRow>(serde_json::json!({
                        "seq": seq, "t": now - (2 * 1440 - 1 - m) * 60, "service": name,
                        "bucket": b.caller, "caller": b.caller, "procedure": null,
                        "mode": "shadow", "scope_key": "global", "offered": offered,
                        "admitted": offered, "dropped": 0.0, "shadow_dropped": over,
                        "limit_rps": b.limit, "drop_ratio": over / offered
                    }))
                    .unwrap(),
                );
            }
        }
    }
    store
        .insert_reports(&batch, chrono::Utc::now())
        .await
        .unwrap();
}

fn rlc(dir: &Path, args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_rlc"))
        .args(args)
        .arg("--config")
        .arg(dir.join("rlc.yaml"))
        .current_dir(dir)
        .env("RUST_LOG", "error")
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

fn json(text: &str) -> Value {
    let start = text.find('{').unwrap_or(0);
    serde_json::Deserializer::from_str(&text[start..])
        .into_iter::<Value>()
        .next()
        .unwrap()
        .unwrap_or_else(|e| panic!("{e}: {text}"))
}

/// Bucket by bucket, from a plan-shaped JSON (`buckets`, `needs_review`).
fn seen(plan: &Value) -> BTreeMap<String, Seen> {
    let review: Vec<String> = plan["needs_review"]
        .as_array()
        .map(|v| {
            v.iter()
                .map(|r| {
                    format!(
                        "{}/{}",
                        r["service"].as_str().unwrap(),
                        r["bucket"].as_str().unwrap()
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    plan["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| {
            let key = format!(
                "{}/{}",
                b["service"].as_str().unwrap(),
                b["name"].as_str().unwrap()
            );
            (
                key.clone(),
                Seen {
                    limit: b["limit_rps"].as_f64().unwrap(),
                    mode: b["mode"].as_str().unwrap().to_string(),
                    held: b["held"].is_object(),
                    review: review.contains(&key),
                },
            )
        })
        .collect()
}

/// What the run committed where the plan goes (the pull-request branch in pull-request
/// mode, the base branch in direct mode), with `held` and `review` from its outcome: a change
/// that needs review is not committed (its bucket stays as it was on the base branch).
fn committed(remote: &GitRemote, case: &Case, out: &Value) -> BTreeMap<String, Seen> {
    let branch = if case.pull_request {
        "rlc/quotas"
    } else {
        "main"
    };
    let review: Vec<String> = out["needs_review"]
        .as_array()
        .map(|v| {
            v.iter()
                .map(|r| {
                    format!(
                        "{}/{}",
                        r["service"].as_str().unwrap(),
                        r["bucket"].as_str().unwrap()
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    let held_reasons: Vec<(String, String)> = out["skipped"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| {
            let r = s["reason"].as_str().unwrap_or_default();
            r.contains("decrease held") || r.contains("already lowered")
        })
        .map(|s| {
            (
                s["service"].as_str().unwrap().to_string(),
                s["caller"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect();
    let mut map = BTreeMap::new();
    for (name, _, _, _) in &case.services {
        let text = remote
            .read(branch, &format!("buckets/{name}.yaml"))
            .or_else(|_| remote.read("main", &format!("buckets/{name}.yaml")))
            .unwrap();
        let file: schema::BucketFile = serde_yaml::from_str(&text).unwrap();
        for b in file.buckets {
            let key = format!("{name}/{}", b.name);
            map.insert(
                key.clone(),
                Seen {
                    limit: b.limit_rps,
                    mode: b.mode.as_str().to_string(),
                    held: held_reasons
                        .iter()
                        .any(|(s, c)| s == name && Some(c.as_str()) == b.caller.as_deref()),
                    review: review.contains(&key),
                },
            );
        }
    }
    map
}

fn check(case: &Case) {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let files = files(case);
    let refs: Vec<(&str, &str)> = files
        .iter()
        .map(|(a, b)| (a.as_str(), b.as_str()))
        .collect();
    let remote = GitRemote::new("main", &refs).unwrap();
    let end = chrono::Utc::now().timestamp() / STEP * STEP - 2 * STEP;
    history(case, &d.join("h.csv"), end);
    let port = free_port();
    let mode = if case.pull_request {
        "  mode: pull-request\n  forge:\n    kind: none\n"
    } else {
        ""
    };
    std::fs::write(
        d.join("rlc.yaml"),
        format!(
            "history:\n  file: h.csv\n  lookback: 8d\n  step: 5m\nconfig_repo:\n  path: wc\n  url: {}\n  author_name: rlc-bot\n  author_email: rlc@example.com\n{mode}database_url: sqlite://rlc.db\nserver:\n  listen: 127.0.0.1:{port}\n  token_env: RLC_TEST_AGREEMENT_TOKEN\n",
            remote.url()
        ),
    )
    .unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(shadow_reports(case, d));
    if case.run_before {
        // A first run lowers what it lowers; the next one must hold further decreases.
        let (code, out) = rlc(d, &["run", "--once", "--json"]);
        assert!(code == 0 || code == 4, "{out}");
        if case.pull_request {
            // What the first run proposed is merged by a person: applied now.
            if remote.head("rlc/quotas").is_some() {
                remote.human_merge("rlc/quotas").unwrap();
            }
        }
    }

    let (code, out) = rlc(d, &["preview", "--format", "json"]);
    assert!(code == 0 || code == 4, "{out}");
    let preview = seen(&json(&out));

    let serve = Proc::spawn(
        Command::new(env!("CARGO_BIN_EXE_rlc"))
            .args(["serve", "--poll-secs", "3600", "--config"])
            .arg(d.join("rlc.yaml"))
            .current_dir(d)
            .env("RUST_LOG", "error")
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    )
    .unwrap();
    let base = format!("http://127.0.0.1:{port}");
    let (quotas, what_if) = rt.block_on(async {
        let c = reqwest::Client::builder()
            .timeout(Duration::from_secs(60))
            .build()
            .unwrap();
        let mut ready = false;
        for _ in 0..600 {
            if let Ok(r) = c.get(format!("{base}/readyz")).send().await {
                if r.status() == 200 {
                    ready = true;
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(ready, "rlc serve never ready");
        let mut quotas = None;
        for _ in 0..600 {
            let r = c.get(format!("{base}/v1/quotas")).send().await.unwrap();
            if r.status() == 200 {
                quotas = Some(r.json::<Value>().await.unwrap());
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let r = c.post(format!("{base}/v1/previews")).send().await.unwrap();
        assert_eq!(r.status(), 200);
        (
            quotas.expect("GET /v1/quotas"),
            r.json::<Value>().await.unwrap(),
        )
    });
    drop(serve);
    assert_eq!(
        seen(&quotas),
        preview,
        "GET /v1/quotas vs rlc preview\n{case:?}"
    );
    assert_eq!(
        seen(&what_if["plan"]),
        preview,
        "empty what-if vs rlc preview\n{case:?}"
    );
    assert_eq!(
        what_if["diff"]["buckets"],
        serde_json::json!([]),
        "{case:?}"
    );

    let (code, out) = rlc(d, &["run", "--once", "--json"]);
    assert!(code == 0 || code == 4, "{out}");
    let out = json(&out);
    let run = committed(&remote, case, &out);
    // Direct mode does not commit what needs review: the bucket keeps the base's values.
    let mut expected = preview.clone();
    if !case.pull_request {
        for (k, s) in expected.iter_mut().filter(|(_, s)| s.review) {
            if let Some(was) = run.get(k) {
                s.limit = was.limit;
                s.mode = was.mode.clone();
            }
        }
        // A new bucket that needs review is not committed at all.
        expected.retain(|k, s| !s.review || run.contains_key(k));
    }
    assert_eq!(run, expected, "rlc run vs rlc preview\n{case:?}\n{out}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn preview_quota_api_what_if_and_run_agree(case in case()) {
        check(&case);
    }
}
