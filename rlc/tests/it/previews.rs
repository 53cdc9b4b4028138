//! `POST /v1/previews` over real HTTP: `rlc serve`'s router on loopback, a config repo on disk
//! and a file history, as the daemon reads them.

use std::future::IntoFuture;
use std::io::Write;
use std::path::Path;

use rlc::serve::{app, previews, AppState};
use serde_json::{json, Value};

const DAY: i64 = 86_400;

/// A repo with `pay` (caller web, limit 100) and `maps` (caller mobile, limit 50), peak with
/// 20 % headroom, and 21 days of history: pay/web at 100 rps, maps/mobile at 40 rps.
fn setup(d: &Path) -> schema::DaemonConfig {
    let w = |p: &str, t: &str| {
        let p = d.join(p);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, t).unwrap();
    };
    w(
        "repo/buckets/pay.yaml",
        "service: pay\nbuckets:\n  - name: web\n    caller: web\n    limit_rps: 100\n    mode: enforce\n    policy: peak\n",
    );
    w(
        "repo/buckets/maps.yaml",
        "service: maps\nbuckets:\n  - name: mobile\n    caller: mobile\n    limit_rps: 50\n    mode: enforce\n    policy: peak\n",
    );
    w(
        "repo/rlc/policies.yaml",
        "default:\n  policy: peak\n  headroom: 0.2\n",
    );
    let end = chrono::Utc::now().timestamp() / 60 * 60;
    let mut csv = std::io::BufWriter::new(std::fs::File::create(d.join("h.csv")).unwrap());
    writeln!(csv, "ts,service,caller,procedure,rps").unwrap();
    for t in (end - 21 * DAY..=end).step_by(60) {
        writeln!(csv, "{t},pay,web,,100\n{t},maps,mobile,,40").unwrap();
    }
    csv.flush().unwrap();
    serde_yaml::from_str("history:\n  file: h.csv\n  lookback: 21d\nconfig_repo:\n  path: repo\n")
        .unwrap()
}

struct Server {
    url: String,
    _dir: tempfile::TempDir,
    http: reqwest::Client,
}

async fn server() -> Server {
    let dir = tempfile::tempdir().unwrap();
    let cfg = setup(dir.path());
    let state = AppState::from_parts(rlc::serve::AppParts {
        previews: Some(previews::from_directory(cfg, dir.path())),
        ..Default::default()
    });
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1/previews", l.local_addr().unwrap());
    tokio::spawn(axum::serve(l, app(state)).into_future());
    Server {
        url,
        _dir: dir,
        http: reqwest::Client::new(),
    }
}

impl Server {
    async fn post(&self, ct: Option<&str>, body: impl Into<reqwest::Body>) -> (u16, String, Value) {
        let mut r = self.http.post(&self.url).body(body);
        if let Some(ct) = ct {
            r = r.header("content-type", ct);
        }
        let resp = r.send().await.unwrap();
        let status = resp.status().as_u16();
        let ct = resp
            .headers()
            .get("content-type")
            .map(|v| v.to_str().unwrap().to_string())
            .unwrap_or_default();
        let v = resp.json().await.unwrap();
        (status, ct, v)
    }
}

fn bucket<'a>(v: &'a Value, service: &str) -> &'a Value {
    v.as_array()
        .unwrap()
        .iter()
        .find(|b| b["service"] == service)
        .unwrap_or_else(|| panic!("no {service} in {v}"))
}

#[tokio::test]
async fn a_headroom_patch_raises_limits_diff_and_backtest_slack() {
    let s = server().await;
    let body = json!({"policies": {"patch": {"default": {"headroom": 0.5}}}});
    let (status, _, v) = s.post(Some("application/json"), body.to_string()).await;
    assert_eq!(status, 200, "{v}");
    // 100 rps × 1.5 and 40 rps × 1.5, against 120 and 48 (50 kept: within 10 %) now.
    assert_eq!(bucket(&v["plan"]["buckets"], "pay")["limit_rps"], 150.0);
    assert_eq!(bucket(&v["plan"]["buckets"], "maps")["limit_rps"], 60.0);
    let pay = bucket(&v["diff"]["buckets"], "pay");
    assert_eq!(pay["change"], "changed");
    assert_eq!(pay["current"]["limit_rps"], 120.0);
    assert_eq!(pay["what_if"]["limit_rps"], 150.0);
    assert_eq!(pay["limit_factor"], 1.25);
    assert_eq!(bucket(&v["diff"]["buckets"], "maps")["limit_factor"], 1.2);
    assert_eq!(v["diff"]["unchanged"], 0);
    // Fitted on 14 days, scored on the last 7: the slack rises from 1.2 to 1.5.
    assert_eq!(v["backtest"]["holdout_secs"], 7 * DAY);
    let bt = bucket(&v["backtest"]["buckets"], "pay");
    let slack = |w: &str| bt[w]["slack"].as_f64().unwrap();
    assert!((slack("current") - 1.2).abs() < 1e-9, "{bt}");
    assert!((slack("what_if") - 1.5).abs() < 1e-9, "{bt}");
    assert_eq!(bt["what_if"]["throttled_fraction"], 0.0);
}

#[tokio::test]
async fn a_contract_sets_a_fixed_limit_for_one_service() {
    let s = server().await;
    let body = "services: [pay]\ncontracts:\n  replace:\n    contracts:\n      - service: pay\n        caller: web\n        limit_rps: 250\n";
    let (status, _, v) = s.post(Some("application/yaml"), body).await;
    assert_eq!(status, 200, "{v}");
    let planned = v["plan"]["buckets"].as_array().unwrap();
    assert_eq!(planned.len(), 1, "only pay: {v}");
    assert_eq!(planned[0]["limit_rps"], 250.0);
    assert_eq!(planned[0]["policy"], "fixed");
    let d = &v["diff"]["buckets"][0];
    assert_eq!(
        (
            d["current"]["policy"].as_str(),
            d["what_if"]["policy"].as_str()
        ),
        (Some("peak"), Some("fixed"))
    );
    assert_eq!(v["backtest"]["buckets"][0]["what_if"]["slack"], 2.5);
}

#[tokio::test]
async fn refusals_are_problem_details_with_every_problem() {
    let s = server().await;
    // 415: a media type that is neither JSON nor YAML.
    let (status, ct, v) = s.post(Some("text/plain"), "{}").await;
    assert_eq!(
        (status, ct.as_str()),
        (415, "application/problem+json"),
        "{v}"
    );
    assert_eq!(v["status"], 415);
    // 413: over 1 MiB.
    let big = format!("services: [{}]", "pay, ".repeat(300_000));
    let (status, _, v) = s.post(Some("application/yaml"), big).await;
    assert_eq!(status, 413, "{v}");
    // 400: YAML syntax, then a wrong type and an unknown key, each with line and key.
    let (status, _, v) = s.post(Some("application/yaml"), "policies: [\n").await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["problems"][0]["file"], "body");
    let body = "policies:\n  replace:\n    default:\n      policy: peak\n      headroom: lots\ncapacity:\n  patch:\n    capacity:\n      - service: pay\n        rps: 10\n        size: xl\n";
    let (status, _, v) = s.post(Some("application/x-yaml"), body).await;
    assert_eq!(status, 400, "{v}");
    let found: Vec<(u64, &str)> = v["problems"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["line"].as_u64().unwrap(), p["key"].as_str().unwrap()))
        .collect();
    assert_eq!(
        found,
        [
            (5, "policies.replace.default.headroom"),
            (11, "capacity.patch.capacity[0].size")
        ],
        "{v}"
    );
    // 422: parses, fails the checks (a negative headroom, a contract for an unknown service,
    // an unknown service asked for).
    let body = json!({
        "services": ["pay", "nobody"],
        "policies": {"patch": {"services": {"pay": {"headroom": -2}}}},
        "contracts": {"replace": {"contracts": [{"service": "ghost", "caller": "x", "limit_rps": 5}]}}
    });
    let text = serde_json::to_string_pretty(&body).unwrap();
    // Pretty JSON, one key a line: the problems point at the body's lines.
    let line_of = |needle: &str| 1 + text.lines().position(|l| l.contains(needle)).unwrap();
    let (status, _, v) = s.post(Some("application/json"), text.clone()).await;
    assert_eq!(status, 422, "{v}");
    let found: Vec<String> = v["problems"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            format!(
                "{}:{}:{}",
                p["file"].as_str().unwrap(),
                p["line"],
                p["key"].as_str().unwrap()
            )
        })
        .collect();
    assert_eq!(
        found,
        [
            format!(
                "body:{}:contracts.replace.contracts[0].service",
                line_of("\"ghost\"")
            ),
            format!(
                "body:{}:policies.patch.services.pay.headroom",
                line_of("-2")
            ),
            format!("body:{}:services[1]", line_of("\"nobody\"")),
        ],
        "{v}"
    );
    assert!(line_of("-2") > 1);
}
