//! Candidate limits on real processes: a controller evaluating a candidate beside the limit in
//! force while an aggregator and clients keep enforcing the limit in force; what older peers
//! read; restarts (state directory and state database); validation.

use super::*;

/// `payments_config` with candidates of `gw.charge` (`(id, limit_rps)`).
fn with_candidates(version: &str, limit: f64, candidates: &[(&str, f64)]) -> Value {
    let mut v = payments_config(version, limit);
    v["candidates"] = candidates
        .iter()
        .map(|(id, l)| {
            json!({"id": id, "service": "payments", "bucket":
                {"name": "gw.charge", "caller": "gw", "procedure": "charge", "scope": "global",
                 "limit_rps": l, "mode": "enforce", "policy": "peak"}})
        })
        .collect();
    v
}

async fn candidates(http: &reqwest::Client, base: &str) -> Value {
    http.get(format!("{base}/v1/candidates"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// The config document as a peer of protocol 4 reads it: unknown fields refused.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
struct OldConfigDoc {
    version: String,
    services: Vec<schema::BucketFile>,
}

/// A candidate of 100 rps beside an in-force limit of 3,470 rps with 150 rps offered: the
/// controller counts about a third of the offered requests as virtual drops, the clients
/// refuse nothing, the served config carries no candidate (a peer that refuses unknown fields
/// reads it), and a restart keeps the candidate (its counts start over in a new epoch).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn candidate_is_evaluated_beside_the_limit_in_force_and_never_served() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let cport = free_port();
    let base = format!("http://127.0.0.1:{cport}");
    let ctl = spawn_controller(cport, &state, dir.path(), &[]);
    wait_up(&format!("{base}/v1/status")).await;
    let http = reqwest::Client::new();
    let r = http
        .put(format!("{base}/v1/config"))
        .bearer_auth(TOKEN)
        .json(&with_candidates("v1", 3470.0, &[("lower-to-100", 100.0)]))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["grl-proto"], "5");

    let pa = free_port();
    let ua = format!("http://127.0.0.1:{pa}");
    let _agg = spawn_aggregator(pa, &base, "agg-a", dir.path());
    wait_up(&format!("{ua}/v1/config")).await;
    let stop = Arc::new(AtomicBool::new(false));
    let dropped = Arc::new(AtomicU64::new(0));
    let clients = alternating_clients(2, &ua, &ua);
    for c in &clients {
        load(c.clone(), 75.0, stop.clone(), dropped.clone());
    }

    // About 10 s of traffic seen by the candidate.
    let mut seen = Value::Null;
    for _ in 0..600 {
        seen = candidates(&http, &base).await;
        if seen["candidates"][0]["offered"].as_f64().unwrap_or(0.0) >= 1500.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        seen["candidates"][0]["offered"].as_f64().unwrap_or(0.0) >= 1500.0,
        "the candidate never saw 1,500 requests: {seen}"
    );
    let c = &seen["candidates"][0];
    assert_eq!(c["id"], "lower-to-100");
    assert_eq!(c["service"], "payments");
    assert_eq!(c["bucket"], "gw.charge");
    assert_eq!(c["limit_rps"], 100.0);
    assert_eq!(c["in_force_limit_rps"], 3470.0);
    assert_eq!(c["mode"], "enforce");
    let share = c["virtual_drop_share"].as_f64().unwrap();
    assert!((share - 1.0 / 3.0).abs() < 0.08, "{c}");
    let vd = c["virtual_dropped"].as_f64().unwrap();
    let offered = c["offered"].as_f64().unwrap();
    assert!((vd / offered - share).abs() < 1e-9, "{c}");
    assert_eq!(c["enforced_dropped"], 0.0);
    assert!(c["seconds"].as_f64().unwrap() > 0.0);
    let epoch = seen["epoch"].as_str().unwrap().to_string();
    assert!(!epoch.is_empty());
    assert!(seen["now_ms"].as_u64().unwrap() >= c["since_ms"].as_u64().unwrap());
    // The clients enforce the limit in force: nothing refused.
    assert_eq!(dropped.load(Ordering::Relaxed), 0);
    assert!(clients
        .iter()
        .all(|c| c.limiter().table().buckets()[0].limit_rps == 3470.0));

    // Never served: neither by the controller nor by the aggregator, and a peer that refuses
    // unknown fields reads both configs.
    for url in [
        format!("{base}/v1/config"),
        format!("{base}/v1/config?view=pushed"),
        format!("{ua}/v1/config"),
    ] {
        let text = http.get(&url).send().await.unwrap().text().await.unwrap();
        assert!(!text.contains("candidates"), "{url}: {text}");
        let old: OldConfigDoc = serde_json::from_str(&text).unwrap();
        assert_eq!(old.version, "v1");
    }
    // The role `reports`: refused without a credential.
    let r = http
        .get(format!("{base}/v1/candidates"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let status: Value = http
        .get(format!("{base}/v1/status"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(status["proto"], 5);
    assert_eq!(status["candidates"], 1);
    let m = http
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(m.contains("# TYPE grl_candidate_offered counter"), "{m}");
    assert!(m.contains("grl_candidate_offered_total{service=\"payments\",bucket=\"gw.charge\"}"));
    assert!(m.contains(
        "grl_candidate_virtual_dropped_total{service=\"payments\",bucket=\"gw.charge\"}"
    ));
    assert!(m.contains("grl_candidates 1"), "{m}");

    // A restart keeps the candidate; its counts start over in a new epoch.
    stop.store(true, Ordering::Relaxed);
    ctl.kill();
    let ctl = spawn_controller(cport, &state, dir.path(), &[]);
    wait_up(&format!("{base}/v1/status")).await;
    let after = candidates(&http, &base).await;
    assert_eq!(after["candidates"][0]["id"], "lower-to-100");
    assert_ne!(after["epoch"], epoch.as_str());
    assert!(after["candidates"][0]["offered"].as_f64().unwrap() < offered);
    // A push of the same services with other candidates is applied (another version).
    let r = http
        .put(format!("{base}/v1/config"))
        .bearer_auth(TOKEN)
        .json(&with_candidates(
            "v1+c2",
            3470.0,
            &[("lower-to-3000", 3000.0)],
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(r.json::<Value>().await.unwrap()["changed"], true);
    let after = candidates(&http, &base).await;
    assert_eq!(after["candidates"].as_array().unwrap().len(), 1);
    assert_eq!(after["candidates"][0]["id"], "lower-to-3000");
    drop(ctl);
    drop(clients);
}

/// Refused candidates name the field; nothing changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn candidate_validation_names_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let _ctl = spawn_controller(port, &dir.path().join("state"), dir.path(), &[]);
    wait_up(&format!("{base}/v1/status")).await;
    let http = reqwest::Client::new();
    let put = |doc: Value| {
        http.put(format!("{base}/v1/config"))
            .bearer_auth(TOKEN)
            .json(&doc)
            .send()
    };
    let bad_limit = with_candidates("v1", 3470.0, &[("a", 100.0), ("b", 0.0)]);
    let dup = with_candidates("v1", 3470.0, &[("a", 100.0), ("a", 50.0)]);
    let mut unknown = with_candidates("v1", 3470.0, &[("a", 100.0)]);
    unknown["candidates"][0]["extra"] = json!(1);
    let mut no_match = with_candidates("v1", 3470.0, &[("a", 100.0)]);
    no_match["candidates"][0]["bucket"]
        .as_object_mut()
        .unwrap()
        .retain(|k, _| k != "caller" && k != "procedure");
    let mut reserved = with_candidates("v1", 3470.0, &[("a", 100.0)]);
    reserved["candidates"][0]["bucket"]["name"] = json!("override:x");
    for (doc, status, want) in [
        (bad_limit, 422, "candidates[1].bucket.limit_rps"),
        (dup, 422, "candidates[1].id"),
        (unknown, 400, "extra"),
        (no_match, 422, "candidates[0].bucket"),
        (reserved, 422, "candidates[0].bucket.name"),
    ] {
        let r = put(doc).await.unwrap();
        assert_eq!(r.status(), status);
        let err = r.json::<Value>().await.unwrap()["error"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(err.contains(want), "{want}: {err}");
    }
    let status: Value = http
        .get(format!("{base}/v1/status"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(status["version"], "");
}

/// With a state database the candidates are stored with the config: a restarted controller
/// evaluates them again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn candidates_survive_a_restart_with_a_state_database() {
    let db = test_support::postgres::fresh_database().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let args = ["--database-url", db.url.as_str()];
    let ctl = spawn_controller(port, &dir.path().join("state-a"), dir.path(), &args);
    wait_up(&format!("{base}/v1/status")).await;
    let http = reqwest::Client::new();
    let r = http
        .put(format!("{base}/v1/config"))
        .bearer_auth(TOKEN)
        .json(&with_candidates("v1", 3470.0, &[("lower-to-100", 100.0)]))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        candidates(&http, &base).await["candidates"][0]["id"],
        "lower-to-100"
    );
    ctl.kill();
    // Another state directory: the candidate comes from the database.
    let _ctl = spawn_controller(port, &dir.path().join("state-b"), dir.path(), &args);
    wait_up(&format!("{base}/v1/status")).await;
    let after = candidates(&http, &base).await;
    assert_eq!(after["candidates"][0]["id"], "lower-to-100");
    assert_eq!(after["candidates"][0]["limit_rps"], 100.0);
    let text = http
        .get(format!("{base}/v1/config"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(!text.contains("candidates"), "{text}");
}

/// `grl simulate` on a scenario with a candidate prints candidate lines beside the bucket
/// lines; the example scenario's candidate of 3,000 rps is promoted after its bake of a minute
/// and enforced from then on, and no request is refused at any time.
#[test]
fn simulate_cli_prints_candidate_lines_and_the_verdict() {
    let scenario =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scenarios/candidate-promote.yaml");
    let out = Command::new(env!("CARGO_BIN_EXE_grl"))
        .args(["simulate", "--seed", "3", "--scenario"])
        .arg(&scenario)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let (cands, buckets): (Vec<&Value>, Vec<&Value>) =
        lines.iter().partition(|l| l.get("candidate").is_some());
    assert_eq!(buckets.len(), 90, "90 ticks of one bucket");
    assert!(buckets.iter().all(|b| b["dropped_rps"] == 0.0));
    let last = cands.last().unwrap();
    assert_eq!(last["verdict"], "promote", "{last}");
    assert_eq!(last["real_dropped"], 0);
    assert!(last["baked_s"].as_f64().unwrap() >= 60.0);
    assert!(cands[..cands.len() - 1]
        .iter()
        .all(|c| c["verdict"] == "baking"));
    assert_eq!(buckets.last().unwrap()["limit_rps"], 3000.0);
    assert_eq!(buckets[0]["limit_rps"], 3470.0);
}
