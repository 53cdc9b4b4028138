//! The quota preview API of a real `rlc serve`, with a real Prometheus (backfilled, constant
//! rates so the numbers are exact), a config repo on a git remote, on SQLite and on Postgres:
//! the numbers of every endpoint, a held decrease with its reason, the history rows of a run,
//! one pull for many concurrent refreshes; and `rlc preview --format json`, `GET /v1/quotas`
//! and `rlc run --once` agreeing bucket for bucket.

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use test_support::git::GitRemote;
use test_support::process::{free_port, Proc};
use test_support::prometheus::{OpenMetricsWriter, Prometheus};

const DAY: i64 = 86_400;
const QUERY: &str = "sum by (service, caller, procedure) (rate(rpc_requests_total[1m]))";
/// `pay`: `web` at 200 rps (limit 100 → 250), `batch` at 400 rps (limit 1000 → 500 wanted,
/// capped at 750 by the 25% per-run cap).
const PAY: &str = "service: pay\nbuckets:\n  - name: web\n    caller: web\n    scope: global\n    limit_rps: 100\n    mode: enforce\n    policy: peak\n  - name: batch\n    caller: batch\n    scope: global\n    limit_rps: 1000\n    mode: enforce\n    policy: peak\n";

/// Nine days of counters at constant rates, scraped every 30 s, up to `end`.
fn prometheus(dir: &Path, end: i64) -> Prometheus {
    let mut w = OpenMetricsWriter::create(&dir.join("history.om")).unwrap();
    w.family("rpc_requests", "counter").unwrap();
    for (caller, rate) in [("web", 200.0), ("batch", 400.0)] {
        let labels = [("service", "pay"), ("caller", caller), ("procedure", "")];
        let labels: Vec<(&str, &str)> = labels.into_iter().filter(|l| !l.1.is_empty()).collect();
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

/// `delay_ms` of [`slow_proxy`] that makes it answer 503 instead of forwarding.
const FAIL: u64 = u64::MAX;

/// A pass-through proxy in front of Prometheus that waits `delay_ms` before forwarding each
/// request while it is set: a pull then lasts long enough for every concurrent request of a
/// test to come in while it runs, whatever the machine's speed. With [`FAIL`] it answers 503.
async fn slow_proxy(target: String, delay_ms: Arc<AtomicU64>) -> String {
    let client = reqwest::Client::new();
    let app = axum::Router::new().fallback(move |req: axum::extract::Request| {
        let (client, target, delay) = (client.clone(), target.clone(), delay_ms.clone());
        async move {
            let d = delay.load(Ordering::Relaxed);
            if d == FAIL {
                return (
                    axum::http::StatusCode::SERVICE_UNAVAILABLE,
                    axum::body::Bytes::from_static(b"prometheus is down"),
                );
            }
            if d > 0 {
                tokio::time::sleep(Duration::from_millis(d)).await;
            }
            let (parts, body) = req.into_parts();
            let body = axum::body::to_bytes(body, 1 << 20).await.unwrap();
            let mut fwd = client.request(parts.method, format!("{target}{}", parts.uri));
            if let Some(ct) = parts.headers.get("content-type") {
                fwd = fwd.header("content-type", ct.clone());
            }
            let r = fwd.body(body).send().await.unwrap();
            let status = r.status();
            (status, r.bytes().await.unwrap())
        }
    });
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    format!("http://{addr}")
}

fn rlc(dir: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_rlc"));
    c.args(args)
        .arg("--config")
        .arg(dir.join("rlc.yaml"))
        .current_dir(dir)
        .env("RLC_TEST_API_TOKEN", "quota-api-token");
    c
}

fn output(dir: &Path, args: &[&str]) -> (i32, String) {
    let out = rlc(dir, args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.code().is_some(), "{args:?} killed: {err}");
    (
        out.status.code().unwrap(),
        String::from_utf8(out.stdout).unwrap() + &err,
    )
}

fn json_of(text: &str) -> Value {
    let start = text.find('{').unwrap_or(0);
    let mut de = serde_json::Deserializer::from_str(&text[start..]).into_iter::<Value>();
    de.next().unwrap().unwrap_or_else(|e| panic!("{e}: {text}"))
}

/// `(service/name, limit_rps)` of every bucket of a plan-shaped JSON.
fn limits(plan: &Value) -> Vec<(String, f64)> {
    let mut v: Vec<(String, f64)> = plan["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| {
            (
                format!(
                    "{}/{}",
                    b["service"].as_str().unwrap(),
                    b["name"].as_str().unwrap()
                ),
                b["limit_rps"].as_f64().unwrap(),
            )
        })
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn bucket<'a>(plan: &'a Value, name: &str) -> &'a Value {
    plan["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["name"] == name)
        .unwrap_or_else(|| panic!("no bucket {name} in {plan}"))
}

async fn get(c: &reqwest::Client, url: &str) -> (u16, Option<String>, Value) {
    let r = c.get(url).send().await.unwrap();
    let status = r.status().as_u16();
    let ctype = r
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let text = r.text().await.unwrap();
    (
        status,
        ctype,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

async fn pulls(base: &str) -> u64 {
    crate::support::metric(base, "rlc_history_pulls_total ", &[])
        .await
        .expect("rlc_history_pulls_total in /metrics") as u64
}

fn scenario(database_url: &str) {
    let end = chrono::Utc::now().timestamp() / 60 * 60 - 60;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let prom = prometheus(d, end);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let delay = Arc::new(AtomicU64::new(0));
    let proxy = rt.block_on(slow_proxy(prom.url.clone(), delay.clone()));
    let mut files = test_support::git::minimal_repo_files(&[]);
    files.push(("buckets/pay.yaml".into(), PAY.into()));
    let refs: Vec<(&str, &str)> = files
        .iter()
        .map(|(a, b)| (a.as_str(), b.as_str()))
        .collect();
    let remote = GitRemote::new("main", &refs).unwrap();
    let port = free_port();
    std::fs::write(
        d.join("rlc.yaml"),
        format!(
            "history:\n  prometheus:\n    url: {proxy}\n    query: '{QUERY}'\n  lookback: 8d\n  step: 5m\n\
             rails:\n  max_increase: 2\n\
             config_repo:\n  path: wc\n  url: {}\n  author_name: rlc-bot\n  author_email: rlc@example.com\n\
             database_url: {database_url}\n\
             server:\n  listen: 127.0.0.1:{port}\n  token_env: RLC_TEST_API_TOKEN\n",
            remote.url()
        ),
    )
    .unwrap();

    // First run: web 100 → 250 (200 × 1.25; `max_increase: 2` lets it go beyond double),
    // batch 1000 → 750 (500 wanted, capped at 25%).
    let (code, out) = output(d, &["run", "--once"]);
    assert_eq!(code, 0, "{out}");
    let head = remote.head("main").unwrap();
    let pay = remote.read("main", "buckets/pay.yaml").unwrap();
    assert!(
        pay.contains("limit_rps: 250\n") && pay.contains("limit_rps: 750\n"),
        "{pay}"
    );

    // The CLI preview now shows what a second run would do: batch's next decrease (750 →
    // 563 after the cap) is held for a day, with the reason.
    let (code, out) = output(d, &["preview", "--format", "json"]);
    assert_eq!(code, 0, "{out}");
    let cli = json_of(&out);
    let batch = bucket(&cli, "batch");
    assert_eq!(batch["limit_rps"], 750.0, "{batch}");
    assert_eq!(batch["current_limit_rps"], 750.0, "{batch}");
    assert_eq!(batch["held"]["proposed_limit_rps"], 563.0, "{batch}");
    let reason = batch["held"]["reason"].as_str().unwrap();
    assert!(
        reason.contains("already lowered") && reason.contains("config repo history"),
        "{reason}"
    );
    assert_eq!(bucket(&cli, "web")["limit_rps"], 250.0);

    let serve = Proc::spawn(
        rlc(d, &["serve", "--poll-secs", "1"])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(d.join("serve.log")).unwrap()),
    )
    .unwrap();
    let base = format!("http://127.0.0.1:{port}");
    let rest = rt.block_on(async {
        let c = reqwest::Client::builder()
            .timeout(Duration::from_secs(60))
            .build()
            .unwrap();
        // Up, and the working copy synced (the first poll).
        let mut first = None;
        for _ in 0..600 {
            if let Ok(r) = c.get(format!("{base}/v1/quotas")).send().await {
                if r.status() == 200 {
                    first = Some(r.json::<Value>().await.unwrap());
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let all = first.unwrap_or_else(|| {
            panic!(
                "GET /v1/quotas never answered 200: {}",
                std::fs::read_to_string(d.join("serve.log")).unwrap_or_default()
            )
        });
        assert_eq!(all["base_commit"], head.as_str());
        assert!(all["history"]["source"].as_str().unwrap().contains(&proxy));
        let batch = bucket(&all, "batch");
        assert_eq!(batch["change"]["kind"], "held", "{batch}");
        assert_eq!(batch["change"]["delta_rps"], 0.0);
        assert!(
            batch["rail"].as_str().unwrap().contains("already lowered"),
            "{batch}"
        );
        assert_eq!(batch["held"]["proposed_limit_rps"], 563.0);
        // A what-if on the same snapshot and planner: 50 % headroom raises web, and batch's
        // decrease (600 under the 750 now) is held by the same guard a run applies.
        let r = c
            .post(format!("{base}/v1/previews"))
            .json(&serde_json::json!({"policies": {"patch": {"default": {"headroom": 0.5}}}}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let w: Value = r.json().await.unwrap();
        let in_plan = |name: &str| {
            w["plan"]["buckets"]
                .as_array()
                .unwrap()
                .iter()
                .find(|b| b["name"] == name)
                .unwrap_or_else(|| panic!("no {name} in {w}"))
                .clone()
        };
        let wweb = in_plan("web");
        let cur_web = bucket(&all, "web")["limit_rps"].as_f64().unwrap();
        assert_eq!(
            wweb["limit_rps"].as_f64().unwrap(),
            (cur_web / 1.25 * 1.5).round(),
            "{wweb}"
        );
        let wbatch = in_plan("batch");
        assert_eq!(wbatch["limit_rps"], 750.0, "{wbatch}");
        assert!(wbatch["held"]["reason"].is_string(), "{wbatch}");
        let dweb = w["diff"]["buckets"]
            .as_array()
            .unwrap()
            .iter()
            .find(|b| b["bucket"] == "web")
            .unwrap_or_else(|| panic!("no web in the diff: {w}"));
        assert_eq!(dweb["limit_factor"], 1.2, "{dweb}");
        // Its backtest answers the question asked: both sides fitted on the training part
        // from no limit in force (no decrease rail against today's limit, which the held-out
        // days set), so they differ exactly where the headroom does: 400 × 1.25 and × 1.5,
        // each × 1.25 for the short (four-day) training history.
        let bt = |name: &str| {
            w["backtest"]["buckets"]
                .as_array()
                .unwrap()
                .iter()
                .find(|b| b["bucket"] == name)
                .unwrap_or_else(|| panic!("no {name} in the backtest: {w}"))
                .clone()
        };
        let (bbatch, bweb) = (bt("batch"), bt("web"));
        assert_eq!(
            (
                bbatch["current"]["limit_rps"].as_f64(),
                bbatch["what_if"]["limit_rps"].as_f64()
            ),
            (Some(625.0), Some(750.0)),
            "{bbatch}"
        );
        assert_eq!(
            (
                bweb["current"]["limit_rps"].as_f64(),
                bweb["what_if"]["limit_rps"].as_f64()
            ),
            (Some(313.0), Some(375.0)),
            "{bweb}"
        );
        assert_eq!(w["backtest"]["holdout_secs"], 4 * DAY, "{w}");
        let web = bucket(&all, "web");
        assert_eq!(web["change"]["kind"], "unchanged", "{web}");
        assert_eq!(web["confidence"], 1.0, "{web}");
        assert_eq!(
            (web["mode"].as_str(), web["policy"].as_str()),
            (Some("enforce"), Some("peak"))
        );

        // One service, with the numbers behind each limit.
        let (status, _, svc) = get(&c, &format!("{base}/v1/quotas/pay")).await;
        assert_eq!(status, 200, "{svc}");
        let web = bucket(&svc, "web");
        let det = &web["details"];
        let peak = det["peak_rps"].as_f64().unwrap();
        assert!((peak - 200.0).abs() < 0.5, "{det}");
        assert_eq!(det["headroom"], 0.25);
        assert_eq!(det["statistic"], "max");
        assert_eq!(
            web["limit_rps"].as_f64().unwrap(),
            (peak * 1.25).round(),
            "{det}"
        );
        assert!(
            (det["coverage"].as_f64().unwrap() - 1.0).abs() < 0.01,
            "{det}"
        );
        let at = chrono::DateTime::parse_from_rfc3339(det["peak_at"].as_str().unwrap()).unwrap();
        assert!(
            at.timestamp() <= end && at.timestamp() >= end - 8 * DAY - 600,
            "{at}"
        );
        let bd = &bucket(&svc, "batch")["details"];
        assert!(
            (bd["peak_rps"].as_f64().unwrap() - 400.0).abs() < 0.5,
            "{bd}"
        );
        assert_eq!(bd["capped_from_rps"], 500.0, "{bd}");
        assert_eq!(svc["history_failed"], false);

        // The bucket's history: the first run's change, its run and commit.
        let (status, _, h) = get(&c, &format!("{base}/v1/quotas/pay/batch/history")).await;
        assert_eq!(status, 200, "{h}");
        let changes = h["changes"].as_array().unwrap();
        assert_eq!(changes.len(), 1, "{h}");
        let ch = &changes[0];
        assert_eq!(
            (
                ch["change"].as_str(),
                ch["previous_limit_rps"].as_f64(),
                ch["limit_rps"].as_f64()
            ),
            (Some("lowered"), Some(1000.0), Some(750.0)),
            "{ch}"
        );
        assert_eq!(ch["trigger"], "once");
        assert_eq!(ch["commit_sha"], head.as_str());
        assert!(ch["run_id"].as_i64().unwrap() >= 1);
        assert!(
            ch["reason"]
                .as_str()
                .unwrap()
                .contains("capped at 25% per run"),
            "{ch}"
        );

        // Unknown names: 404 problem details; odd query strings: 400.
        for path in [
            "/v1/quotas/nope",
            "/v1/quotas/pay/nope/history",
            "/v1/quotas?service=nope",
        ] {
            let (status, ctype, body) = get(&c, &format!("{base}{path}")).await;
            assert_eq!(status, 404, "{path}: {body}");
            assert_eq!(ctype.as_deref(), Some("application/problem+json"), "{path}");
            assert!(body["detail"].as_str().unwrap().contains("nope"), "{body}");
        }
        for path in [
            "/v1/quotas?refresh=maybe",
            "/v1/quotas?bogus=1",
            "/v1/quotas/pay?service=pay",
            "/v1/quotas/pay/web/history?x=1",
            "/v1/quotas?service=a&service=b",
        ] {
            let (status, ctype, body) = get(&c, &format!("{base}{path}")).await;
            assert_eq!(status, 400, "{path}: {body}");
            assert_eq!(ctype.as_deref(), Some("application/problem+json"), "{path}");
        }
        let (status, _, one) = get(&c, &format!("{base}/v1/quotas?service=pay")).await;
        assert_eq!(status, 200);
        assert_eq!(limits(&one), limits(&all));

        // Many concurrent refreshes share one pull. Warm connections first, so that every
        // request is in before the pull finishes.
        let before = pulls(&base).await;
        let warm = concurrently(&c, vec![format!("{base}/healthz"); 20]).await;
        assert!(warm.iter().all(|s| *s == 200));
        delay.store(1500, Ordering::Relaxed);
        let refreshed = concurrently(&c, vec![format!("{base}/v1/quotas?refresh=true"); 20]).await;
        assert!(refreshed.iter().all(|s| *s == 200), "{refreshed:?}");
        assert_eq!(pulls(&base).await, before + 1, "one pull for 20 refreshes");

        // A pull that fails after good ones: the whole-fleet body (cached per plan) says so as
        // the one-service answer does, and stops saying so after the next good pull.
        let (_, _, good) = get(&c, &format!("{base}/v1/quotas")).await;
        assert!(good["history"]["last_pull_error"].is_null(), "{good}");
        delay.store(FAIL, Ordering::Relaxed);
        let (status, _, failed) = get(&c, &format!("{base}/v1/quotas?refresh=true")).await;
        assert_eq!(status, 200, "{failed}");
        let error = failed["history"]["last_pull_error"].clone();
        assert!(error.is_string(), "{failed}");
        let (_, _, cached) = get(&c, &format!("{base}/v1/quotas")).await;
        assert_eq!(cached["history"]["last_pull_error"], error, "{cached}");
        let (_, _, one) = get(&c, &format!("{base}/v1/quotas?service=pay")).await;
        assert_eq!(one["history"]["last_pull_error"], error, "{one}");
        assert_eq!(
            cached["history"]["generation"], good["history"]["generation"],
            "the plan of the last good pull is kept"
        );
        delay.store(0, Ordering::Relaxed);
        let (status, _, good) = get(&c, &format!("{base}/v1/quotas?refresh=true")).await;
        assert_eq!(status, 200, "{good}");
        assert!(good["history"]["last_pull_error"].is_null(), "{good}");
        let (_, _, cached) = get(&c, &format!("{base}/v1/quotas")).await;
        assert!(cached["history"]["last_pull_error"].is_null(), "{cached}");
        // The daemon pulled the whole lookback once (its first pull); every later pull (the
        // refreshes above, the one after the failure included) took only the new minutes.
        let kind = |k: &'static str| {
            let base = base.clone();
            async move {
                let label = format!("kind=\"{k}\"");
                crate::support::metric(&base, "rlc_history_pulls_by_kind_total{", &[label.as_str()])
                    .await
                    .unwrap_or(0.0)
            }
        };
        assert_eq!(kind("full").await, 1.0);
        assert!(kind("incremental").await >= 2.0);
        let log = std::fs::read_to_string(d.join("serve.log")).unwrap();
        let pulled: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("history pulled"))
            .collect();
        assert!(
            pulled
                .iter()
                .any(|l| l.contains("kind=full") && l.contains("api=query_range")),
            "{log}"
        );
        let inc = pulled
            .iter()
            .find(|l| l.contains("kind=incremental"))
            .unwrap_or_else(|| panic!("no incremental pull logged: {log}"));
        for field in [
            "api=query_range",
            "series=2",
            "points=",
            "bytes=",
            "seconds=",
            "from=",
            "to=",
        ] {
            assert!(inc.contains(field), "{field} in {inc}");
        }
        assert!(!inc.contains("=None") && !inc.contains("=Some("), "{inc}");
        all
    });
    doc_examples(&base, d);
    drop(serve);

    // `rlc backtest` on the same history and holdout scores the limits the what-if's current
    // side showed.
    let (code, out) = output(
        d,
        &[
            "backtest",
            "--holdout",
            "4d",
            "--policy",
            "peak",
            "--format",
            "json",
        ],
    );
    assert_eq!(code, 0, "{out}");
    let scored = json_of(&out);
    let fitted = |name: &str| {
        scored["buckets"]
            .as_array()
            .unwrap()
            .iter()
            .find(|b| b["bucket"] == name)
            .unwrap_or_else(|| panic!("no {name} in {scored}"))["limit_rps"]
            .as_f64()
    };
    assert_eq!(
        (fitted("batch"), fitted("web")),
        (Some(625.0), Some(313.0)),
        "{scored}"
    );

    // Second run: writes exactly what both previews showed.
    let (code, out) = output(d, &["run", "--once"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("already lowered"), "{out}");
    assert_eq!(
        remote.head("main").unwrap(),
        head,
        "nothing to commit: {out}"
    );
    let written: Vec<(String, f64)> = {
        let file: schema::BucketFile =
            serde_yaml::from_str(&remote.read("main", "buckets/pay.yaml").unwrap()).unwrap();
        let mut v: Vec<_> = file
            .buckets
            .iter()
            .map(|b| (format!("pay/{}", b.name), b.limit_rps))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    };
    assert_eq!(limits(&cli), written, "CLI preview vs run");
    assert_eq!(limits(&rest), written, "REST preview vs run");
    assert_eq!(cli["buckets"].as_array().unwrap().len(), 2);
}

/// Runs every `curl` example of docs/rlc-api.md against the daemon at `base` (the examples'
/// `http://127.0.0.1:8080` replaced, `-f` added so an HTTP error fails), in `work` with the
/// docs' `what-if.yaml` written there, and checks the numbers of the what-ifs. (README.md's
/// examples use the services of `rlc demo` and run against the demo's daemon:
/// `tests/tests/it/demo.rs`.)
fn doc_examples(base: &str, work: &Path) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut commands = Vec::new();
    for doc in ["docs/rlc-api.md"] {
        let text = std::fs::read_to_string(root.join(doc)).unwrap();
        let mut block: Option<&str> = None;
        let mut pending = String::new();
        let mut joined = String::new();
        for line in text.lines() {
            if let Some(lang) = line.strip_prefix("```") {
                block = match block {
                    None => Some(lang),
                    Some(_) => None,
                };
                continue;
            }
            match block {
                Some("yaml") if line == "# what-if.yaml" || !pending.is_empty() => {
                    // The what-if file: its block up to the fence.
                    pending.push_str(line);
                    pending.push('\n');
                }
                Some("sh") => {
                    // A command may continue over lines ending with a backslash.
                    let l = line.trim();
                    match l.strip_suffix('\\') {
                        Some(part) => {
                            joined.push_str(part);
                            joined.push(' ');
                        }
                        None => {
                            joined.push_str(l);
                            if joined.starts_with("curl") {
                                commands.push((doc.to_string(), joined.clone()));
                            }
                            joined.clear();
                        }
                    }
                }
                None if !pending.is_empty() => {
                    std::fs::write(work.join("what-if.yaml"), &pending).unwrap();
                    pending.clear();
                }
                _ => {}
            }
        }
    }
    assert!(
        work.join("what-if.yaml").exists(),
        "docs/rlc-api.md shows what-if.yaml"
    );
    let examples: Vec<_> = commands
        .iter()
        .filter(|(_, c)| c.contains("http://127.0.0.1:8080/"))
        .collect();
    assert!(examples.len() >= 8, "{examples:?}");
    let mut answers = Vec::new();
    for (doc, c) in &examples {
        let cmd =
            c.replace("http://127.0.0.1:8080", base)
                .replacen("curl ", "curl -f --max-time 60 ", 1);
        let out = Command::new("bash")
            .arg("-c")
            .arg(&cmd)
            .current_dir(work)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{doc}: `{c}` failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let v: Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{doc}: `{c}` answered no JSON ({e})"));
        answers.push((c.clone(), v));
    }
    let web_limit = |v: &Value| {
        v["plan"]["buckets"]
            .as_array()
            .unwrap()
            .iter()
            .find(|b| b["name"] == "web")
            .unwrap_or_else(|| panic!("no web in {v}"))
            .clone()
    };
    let contract = answers
        .iter()
        .find(|(c, _)| c.contains("@what-if.yaml"))
        .expect("the contract example");
    let web = web_limit(&contract.1);
    assert_eq!(
        (web["limit_rps"].as_f64(), web["policy"].as_str()),
        (Some(333.0), Some("fixed")),
        "{web}"
    );
    let headroom: Vec<_> = answers
        .iter()
        .filter(|(c, _)| c.contains("\"headroom\": 0.5"))
        .collect();
    assert_eq!(headroom.len(), 1, "the API doc's");
    for (_, v) in headroom {
        assert_eq!(web_limit(v)["limit_rps"], 300.0, "200 rps × 1.5");
    }
}

/// GETs every URL at once (one task each); their statuses, in order.
async fn concurrently(c: &reqwest::Client, urls: Vec<String>) -> Vec<u16> {
    let tasks: Vec<_> = urls
        .into_iter()
        .map(|u| {
            let c = c.clone();
            tokio::spawn(async move { c.get(u).send().await.unwrap().status().as_u16() })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

#[test]
fn quota_api_on_sqlite_agrees_with_preview_and_run() {
    scenario("sqlite://rlc.db");
}

#[test]
fn quota_api_on_postgres_agrees_with_preview_and_run() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let db = rt
        .block_on(test_support::postgres::fresh_database())
        .expect("a throwaway Postgres");
    scenario(&db.url);
}

/// `pay` in shadow: `web` (limit 250 at 200 rps) and `batch` (limit 500 at 400 rps in the
/// history, but 600 offered in its shadow reports: it would throttle).
const PAY_SHADOW: &str = "service: pay\nbuckets:\n  - name: web\n    caller: web\n    scope: global\n    limit_rps: 250\n    mode: shadow\n    policy: peak\n  - name: batch\n    caller: batch\n    scope: global\n    limit_rps: 500\n    mode: shadow\n    policy: peak\n";

/// Promotion after two days in shadow; direct mode may commit promotions.
const PROMOTING_POLICIES: &str = "default:\n  policy: peak\n  headroom: 0.25\npromotion:\n  default:\n    min_days_in_shadow: 2\n    auto_merge: [promotion, raise, new_shadow, other]\n";

/// `(service/name, mode, limit_rps)` of every bucket of a plan-shaped JSON.
fn modes(plan: &Value) -> Vec<(String, String, f64)> {
    let mut v: Vec<(String, String, f64)> = plan["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| {
            (
                format!(
                    "{}/{}",
                    b["service"].as_str().unwrap(),
                    b["name"].as_str().unwrap()
                ),
                b["mode"].as_str().unwrap().to_string(),
                b["limit_rps"].as_f64().unwrap(),
            )
        })
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// `rlc preview` (table and JSON), `GET /v1/quotas` and `rlc run --once` propose the same
/// promotion: three days of shadow reports in the store (SQLite), `web` without virtual drops
/// is proposed for `mode: enforce` with its shadow figures, `batch` (virtual drops 1/6 of its
/// traffic) stays in shadow with the reason; the run then writes exactly that.
#[test]
fn preview_quota_api_and_run_propose_the_same_promotion() {
    let end = chrono::Utc::now().timestamp() / 60 * 60 - 60;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let prom = prometheus(d, end);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut files = test_support::git::minimal_repo_files(&[]);
    files.retain(|f| f.0 != "rlc/policies.yaml");
    files.push(("rlc/policies.yaml".into(), PROMOTING_POLICIES.into()));
    files.push(("buckets/pay.yaml".into(), PAY_SHADOW.into()));
    let refs: Vec<(&str, &str)> = files
        .iter()
        .map(|(a, b)| (a.as_str(), b.as_str()))
        .collect();
    let remote = GitRemote::new("main", &refs).unwrap();
    let port = free_port();
    std::fs::write(
        d.join("rlc.yaml"),
        format!(
            "history:\n  prometheus:\n    url: {}\n    query: '{QUERY}'\n  lookback: 8d\n  step: 5m\n\
             config_repo:\n  path: wc\n  url: {}\n  author_name: rlc-bot\n  author_email: rlc@example.com\n\
             database_url: sqlite://rlc.db\n\
             server:\n  listen: 127.0.0.1:{port}\n  token_env: RLC_TEST_API_TOKEN\n",
            prom.url,
            remote.url()
        ),
    )
    .unwrap();

    // rlc's working copy of the config repo (a run would clone it too).
    test_support::git::git(d, &["clone", "-q", &remote.url(), "wc"]).unwrap();

    // Three days of one report a minute per bucket, up to now.
    rt.block_on(async {
        let store = rlc::store::Store::connect("sqlite://rlc.db", d)
            .await
            .unwrap();
        let now = chrono::Utc::now().timestamp() / 60 * 60;
        let mut seq = 0;
        let mut batch = Vec::new();
        for m in 0..3 * 1440 {
            let t = now - (3 * 1440 - 1 - m) * 60;
            for (bucket, offered, limit) in [("web", 200.0f64, 250.0f64), ("batch", 600.0, 500.0)] {
                seq += 1;
                let over = (offered - limit).max(0.0);
                batch.push(
                    serde_json::from_value::<grl_wire::ReportRow>(serde_json::json!({
                        "seq": seq, "t": t, "service": "pay", "bucket": bucket, "caller": null,
                        "procedure": null, "mode": "shadow", "scope_key": "global",
                        "offered": offered, "admitted": offered, "dropped": 0.0,
                        "shadow_dropped": over, "limit_rps": limit, "drop_ratio": over / offered
                    }))
                    .unwrap(),
                );
            }
        }
        store
            .insert_reports(&batch, chrono::Utc::now())
            .await
            .unwrap();
    });

    let (code, out) = output(d, &["preview", "--format", "json"]);
    assert_eq!(code, 0, "{out}");
    let cli = json_of(&out);
    let web = bucket(&cli, "web");
    assert_eq!(web["mode"], "enforce", "{web}");
    let ev = &web["evidence"]["promotion"];
    assert_eq!(ev["promoted"], true, "{ev}");
    assert_eq!(ev["virtual_drop_share"], 0.0, "{ev}");
    assert_eq!(ev["shadow_limit_rps"], 250.0, "{ev}");
    assert!(
        (ev["days_in_shadow"].as_f64().unwrap() - 3.0).abs() < 0.05,
        "{ev}"
    );
    assert!(ev["coverage"].as_f64().unwrap() > 0.99, "{ev}");
    let batch = bucket(&cli, "batch");
    assert_eq!(batch["mode"], "shadow", "{batch}");
    let bev = &batch["evidence"]["promotion"];
    assert_eq!(bev["promoted"], false, "{bev}");
    assert_eq!(bev["reason"], "would throttle 16.667% of requests", "{bev}");

    let (code, table) = output(d, &["preview"]);
    assert_eq!(code, 0, "{table}");
    let web_row = table
        .lines()
        .find(|l| l.starts_with("pay") && l.split_whitespace().nth(1) == Some("web"))
        .unwrap_or_else(|| panic!("{table}"));
    assert!(web_row.contains("shadow → enforce"), "{table}");
    assert!(
        table.contains("pay/web: shadow → enforce (ready)"),
        "{table}"
    );
    assert!(
        table.contains("pay/batch: stays in shadow (would throttle 16.667% of requests)"),
        "{table}"
    );

    // The daemon's quota API proposes the same.
    let serve = Proc::spawn(
        rlc(d, &["serve", "--poll-secs", "1"])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(d.join("serve.log")).unwrap()),
    )
    .unwrap();
    let base = format!("http://127.0.0.1:{port}");
    let rest = rt.block_on(async {
        let c = reqwest::Client::new();
        // Ready first: the store connected (a plan asked before has no shadow figures).
        for _ in 0..600 {
            if let Ok(r) = c.get(format!("{base}/readyz")).send().await {
                if r.status() == 200 {
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        for _ in 0..600 {
            if let Ok(r) = c.get(format!("{base}/v1/quotas")).send().await {
                if r.status() == 200 {
                    return r.json::<Value>().await.unwrap();
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!(
            "GET /v1/quotas never answered 200: {}",
            std::fs::read_to_string(d.join("serve.log")).unwrap_or_default()
        )
    });
    // An empty what-if previews the current inputs: the same plan, promotion included, so
    // nothing is listed as changed.
    let empty = rt.block_on(async {
        let r = reqwest::Client::new()
            .post(format!("{base}/v1/previews"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        r.json::<Value>().await.unwrap()
    });
    drop(serve);
    assert_eq!(empty["diff"]["buckets"], serde_json::json!([]), "{empty}");
    assert_eq!(modes(&empty["plan"]), modes(&rest), "what-if vs REST");
    let log = std::fs::read_to_string(d.join("serve.log")).unwrap_or_default();
    assert_eq!(
        bucket(&rest, "web")["mode_change"],
        "shadow → enforce",
        "{rest}\nrlc serve's log:\n{log}"
    );
    assert!(bucket(&rest, "batch")["mode_change"].is_null(), "{rest}");
    assert_eq!(
        bucket(&rest, "web")["evidence"]["promotion"]["promoted"],
        true
    );
    assert_eq!(modes(&rest), modes(&cli), "REST vs CLI preview");

    // The run writes what both showed.
    let (code, out) = output(d, &["run", "--once"]);
    assert_eq!(code, 0, "{out}");
    let file: schema::BucketFile =
        serde_yaml::from_str(&remote.read("main", "buckets/pay.yaml").unwrap()).unwrap();
    let mut written: Vec<(String, String, f64)> = file
        .buckets
        .iter()
        .map(|b| {
            (
                format!("pay/{}", b.name),
                b.mode.as_str().to_string(),
                b.limit_rps,
            )
        })
        .collect();
    written.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(
        written,
        vec![
            ("pay/batch".to_string(), "shadow".to_string(), 500.0),
            ("pay/web".to_string(), "enforce".to_string(), 250.0)
        ],
        "{out}"
    );
    assert_eq!(modes(&cli), written, "CLI preview vs run");
}
