//! Overrides against real `grl controller` processes: a restored config never blocks them,
//! their ids never collide, and their number is bounded with a clear error.

use serde_json::{json, Value};
use test_support::process::free_port;

use super::{payments_config, spawn_controller, wait_up, TOKEN};

fn traffic_override(caller: &str) -> Value {
    json!({"service": "payments", "caller": caller, "limit_rps": 5.0, "ttl_secs": 600,
           "reason": "INC-1", "who": "oncall"})
}

async fn add(http: &reqwest::Client, base: &str, body: &Value) -> (u16, Value) {
    let r = http
        .post(format!("{base}/v1/overrides"))
        .bearer_auth(TOKEN)
        .json(body)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

async fn put(http: &reqwest::Client, base: &str, body: &Value) -> (u16, Value) {
    let r = http
        .put(format!("{base}/v1/config"))
        .bearer_auth(TOKEN)
        .json(body)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

async fn get(http: &reqwest::Client, url: &str) -> Value {
    http.get(url).send().await.unwrap().json().await.unwrap()
}

/// A controller's served config (`GET /v1/config`, which carries the `override:` buckets of
/// its traffic overrides) is refused by `PUT /v1/config` with a 422 that names the reserved
/// bucket and the way to restore a config, `GET /v1/config?view=pushed`, whose round trip
/// works; a fresh controller's overrides then get ids `ovr-1`, `ovr-2`… as usual. (Before:
/// the served config was accepted and every override afterwards failed with "duplicate bucket
/// name override:ovr-1", its id never advancing.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restored_config_never_blocks_overrides() {
    let dir = tempfile::tempdir().unwrap();
    let http = reqwest::Client::new();
    let (pa, pb) = (free_port(), free_port());
    let (a, b) = (
        format!("http://127.0.0.1:{pa}"),
        format!("http://127.0.0.1:{pb}"),
    );
    let _ca = spawn_controller(pa, &dir.path().join("a"), dir.path(), &[]);
    let _cb = spawn_controller(pb, &dir.path().join("b"), dir.path(), &[]);
    wait_up(&format!("{a}/v1/status")).await;
    wait_up(&format!("{b}/v1/status")).await;
    assert_eq!(put(&http, &a, &payments_config("v1", 200.0)).await.0, 200);
    let (s, o) = add(&http, &a, &traffic_override("batch")).await;
    assert_eq!(s, 201, "{o}");
    assert_eq!(o["id"], "ovr-1");

    // The served config carries the override's bucket: it is not a config to push.
    let served = get(&http, &format!("{a}/v1/config")).await;
    let names: Vec<&str> = served["services"][0]["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["name"].as_str().unwrap())
        .collect();
    assert!(names.contains(&"override:ovr-1"), "{served}");
    let (s, e) = put(&http, &b, &served).await;
    assert_eq!(s, 422, "{e}");
    let msg = e["error"].as_str().unwrap();
    assert!(
        msg.contains("override:ovr-1") && msg.contains("view=pushed"),
        "{msg}"
    );

    // The pushed config round-trips.
    let pushed = get(&http, &format!("{a}/v1/config?view=pushed")).await;
    assert_eq!(pushed, payments_config("v1", 200.0));
    let (s, e) = put(&http, &b, &pushed).await;
    assert_eq!(s, 200, "{e}");
    // Overrides on the restored controller: ids advance, nothing collides.
    for (caller, id) in [("batch", "ovr-1"), ("other", "ovr-2")] {
        let (s, o) = add(&http, &b, &traffic_override(caller)).await;
        assert_eq!(s, 201, "{o}");
        assert_eq!(o["id"], id);
    }
    // A config naming a reserved bucket by itself is refused the same way.
    let mut own = payments_config("v2", 200.0);
    own["services"][0]["buckets"][0]["name"] = json!("override:ovr-9");
    let (s, e) = put(&http, &b, &own).await;
    assert_eq!(s, 422, "{e}");
}

/// The number of overrides is bounded (`--max-overrides`): one more is refused with 422 saying
/// how many are active and what to do, nothing is added, and once one is removed the next add
/// goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_number_of_overrides_is_bounded_with_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let http = reqwest::Client::new();
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let _c = spawn_controller(
        port,
        &dir.path().join("state"),
        dir.path(),
        &["--max-overrides", "20"],
    );
    wait_up(&format!("{base}/v1/status")).await;
    assert_eq!(
        put(&http, &base, &payments_config("v1", 200.0)).await.0,
        200
    );
    for i in 0..20 {
        let (s, o) = add(&http, &base, &traffic_override(&format!("c{i}"))).await;
        assert_eq!(s, 201, "{i}: {o}");
    }
    let (s, e) = add(&http, &base, &traffic_override("one-too-many")).await;
    assert_eq!(s, 422, "{e}");
    let msg = e["error"].as_str().unwrap();
    assert!(
        msg.contains("20 overrides") && msg.contains("grl override rm"),
        "{msg}"
    );
    let status = get(&http, &format!("{base}/v1/status")).await;
    assert_eq!(status["overrides"], 20, "{status}");
    let r = http
        .delete(format!("{base}/v1/overrides/ovr-3"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let (s, o) = add(&http, &base, &traffic_override("one-too-many")).await;
    assert_eq!(s, 201, "{o}");
    assert_eq!(o["id"], "ovr-21");
}
