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
    get_json_authorized(http, &format!("{base}/v1/candidates")).await
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
    let (ctl, cport, base) = start_controller(&state, dir.path(), &[]).await;
    let http = reqwest::Client::new();
    let doc = with_candidates("v1", 3470.0, &[("lower-to-100", 100.0)]);
    let r = put_config(&http, &base, &doc).await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers()["grl-proto"],
        grl_wire::PROTO_VERSION.to_string().as_str()
    );

    let (_agg, ua) = start_aggregator(&base, "agg-a", dir.path()).await;
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
        let text = get_text(&http, &url).await;
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
    let status = get_json(&http, &format!("{base}/v1/status")).await;
    assert_eq!(status["proto"], grl_wire::PROTO_VERSION);
    assert_eq!(status["candidates"], 1);
    let m = get_text(&http, &format!("{base}/metrics")).await;
    assert!(m.contains("# TYPE grl_candidate_offered counter"), "{m}");
    assert!(m.contains("grl_candidate_offered_total{service=\"payments\",bucket=\"gw.charge\"}"));
    assert!(m.contains(
        "grl_candidate_virtual_dropped_total{service=\"payments\",bucket=\"gw.charge\"}"
    ));
    assert!(m.contains("grl_candidates 1"), "{m}");

    // A restart keeps the candidate; its counts start over in a new epoch.
    stop.store(true, Ordering::Relaxed);
    ctl.kill();
    let ctl = start_controller_at(cport, &state, dir.path(), &[]).await;
    let after = candidates(&http, &base).await;
    assert_eq!(after["candidates"][0]["id"], "lower-to-100");
    assert_ne!(after["epoch"], epoch.as_str());
    assert!(after["candidates"][0]["offered"].as_f64().unwrap() < offered);
    // A push of the same services with other candidates is applied (another version).
    let doc = with_candidates("v1+c2", 3470.0, &[("lower-to-3000", 3000.0)]);
    let r = put_config(&http, &base, &doc).await;
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
    let (_ctl, _, base) = start_controller(&dir.path().join("state"), dir.path(), &[]).await;
    let http = reqwest::Client::new();
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
        let r = put_config(&http, &base, &doc).await;
        assert_eq!(r.status(), status);
        let err = r.json::<Value>().await.unwrap()["error"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(err.contains(want), "{want}: {err}");
    }
    let status = get_json(&http, &format!("{base}/v1/status")).await;
    assert_eq!(status["version"], "");
}

/// With a state database the candidates are stored with the config: a restarted controller
/// evaluates them again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn candidates_survive_a_restart_with_a_state_database() {
    let db = test_support::postgres::fresh_database().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let args = ["--database-url", db.url.as_str()];
    let (ctl, port, base) = start_controller(&dir.path().join("state-a"), dir.path(), &args).await;
    let http = reqwest::Client::new();
    let doc = with_candidates("v1", 3470.0, &[("lower-to-100", 100.0)]);
    let r = put_config(&http, &base, &doc).await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        candidates(&http, &base).await["candidates"][0]["id"],
        "lower-to-100"
    );
    ctl.kill();
    // Another state directory: the candidate comes from the database.
    let _ctl = start_controller_at(port, &dir.path().join("state-b"), dir.path(), &args).await;
    let after = candidates(&http, &base).await;
    assert_eq!(after["candidates"][0]["id"], "lower-to-100");
    assert_eq!(after["candidates"][0]["limit_rps"], 100.0);
    let text = get_text(&http, &format!("{base}/v1/config")).await;
    assert!(!text.contains("candidates"), "{text}");
}

/// `grl simulate` on a scenario with a candidate prints candidate lines beside the bucket
/// lines; the example scenario's candidate of 3,000 rps is promoted after its bake of a minute
/// and enforced from then on, and no request is refused at any time.
#[test]
fn simulate_cli_prints_candidate_lines_and_the_verdict() {
    let lines = json_lines(&simulate(&["--seed", "3"], "candidate-promote.yaml"));
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
