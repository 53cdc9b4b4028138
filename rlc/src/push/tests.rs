use std::future::IntoFuture;
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, put};
use axum::{Json, Router};
use schema::{Bucket, BucketFile, Mode, PolicyName, Scope};
use serde_json::{json, Value};

use super::*;

/// A stand-in controller that checks the auth header and body shape of every request.
#[derive(Clone, Default)]
pub(crate) struct Fake {
    pub(crate) version: Arc<Mutex<Option<String>>>,
    pub(crate) puts: Arc<Mutex<Vec<Value>>>,
    pub(crate) problems: Arc<Mutex<Vec<String>>>,
}

fn authed(h: &HeaderMap) -> bool {
    h.get("authorization").and_then(|v| v.to_str().ok()) == Some("Bearer s3cret")
}

async fn put_config(
    State(f): State<Fake>,
    h: HeaderMap,
    Json(body): Json<Value>,
) -> (StatusCode, Json<Value>) {
    if !authed(&h) {
        return (
            StatusCode::UNAUTHORIZED,
            Json(json!({"error": "bad token"})),
        );
    }
    let ok = body["version"].is_string()
        && body["services"].as_array().is_some_and(|s| {
            s.iter().all(|f| {
                f["service"].is_string()
                    && f["buckets"].as_array().is_some_and(|b| {
                        b.iter().all(|b| {
                            b["name"].is_string()
                                && b["limit_rps"].is_number()
                                && b["mode"].is_string()
                        })
                    })
            })
        });
    if !ok {
        f.problems.lock().unwrap().push(format!("bad body {body}"));
        return (StatusCode::BAD_REQUEST, Json(json!({"error": "bad body"})));
    }
    let v = body["version"].as_str().unwrap().to_string();
    let mut cur = f.version.lock().unwrap();
    if cur.as_deref() != Some(v.as_str()) {
        f.puts.lock().unwrap().push(body.clone());
        *cur = Some(v);
    }
    (StatusCode::OK, Json(json!({})))
}

async fn status(State(f): State<Fake>, h: HeaderMap) -> (StatusCode, Json<Value>) {
    if !authed(&h) {
        return (
            StatusCode::UNAUTHORIZED,
            Json(json!({"error": "bad token"})),
        );
    }
    (
        StatusCode::OK,
        Json(json!({"version": *f.version.lock().unwrap(), "buckets": 0})),
    )
}

pub(crate) fn app(f: Fake) -> Router {
    Router::new()
        .route("/v1/config", put(put_config))
        .route("/v1/status", get(status))
        .with_state(f)
}

fn desired(version: &str) -> ConfigDoc {
    ConfigDoc {
        version: version.into(),
        services: vec![BucketFile {
            criticality: Default::default(),
            service: "payments".into(),
            buckets: vec![Bucket {
                name: "gw".into(),
                caller: Some("gw".into()),
                procedure: None,
                scope: Scope::Global,
                limit_rps: 1250.0,
                mode: Mode::Enforce,
                policy: PolicyName::Peak,
            }],
        }],
        candidates: Vec::new(),
    }
}

#[tokio::test]
async fn controller_down_then_up_gets_the_version_once() {
    // Reserve a port, then free it so the first attempts are refused.
    let addr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let client = ControllerClient::new(&format!("http://{addr}"), "s3cret".into());
    let fake = Fake::default();
    let (down_tx, down_rx) = tokio::sync::oneshot::channel::<()>();
    let mut down_tx = Some(down_tx);
    let d = desired("abc123");
    let backoff = Backoff {
        min: Duration::from_millis(20),
        max: Duration::from_millis(100),
        attempts: None,
    };
    let task = {
        let client = client.clone();
        let d = d.clone();
        tokio::spawn(async move {
            reconcile(&client, &d, backoff, |_, e| {
                assert!(e.retryable(), "{e}");
                if let Some(tx) = down_tx.take() {
                    let _ = tx.send(());
                }
            })
            .await
        })
    };
    // Bring the controller up only after the loop saw it down.
    down_rx.await.unwrap();
    let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
    tokio::spawn(axum::serve(listener, app(fake.clone())).into_future());
    assert!(task.await.unwrap().unwrap(), "a PUT was sent");
    assert_eq!(fake.version.lock().unwrap().as_deref(), Some("abc123"));
    // Same version again: nothing sent.
    assert!(!reconcile(&client, &d, Backoff::default(), |_, _| {})
        .await
        .unwrap());
    assert_eq!(fake.puts.lock().unwrap().len(), 1);
    assert!(fake.problems.lock().unwrap().is_empty());
    let body = &fake.puts.lock().unwrap()[0];
    assert_eq!(
        body["services"][0]["buckets"][0]["limit_rps"],
        json!(1250.0)
    );
}

#[tokio::test]
async fn bad_token_is_not_retried() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(axum::serve(listener, app(Fake::default())).into_future());
    let client = ControllerClient::new(&format!("http://{addr}"), "wrong".into());
    let mut failures = 0;
    let err = reconcile(&client, &desired("v1"), Backoff::default(), |_, _| {
        failures += 1
    })
    .await
    .unwrap_err();
    assert!(matches!(err, PushError::Unauthorized), "{err}");
    assert_eq!(failures, 1);
    assert!(!err.to_string().contains("wrong"));
}

/// Against the real controller with one credential per role: rlc pushes with its `config`
/// credential read from `<token_env>_FILE` (re-read at every call, so a rotation needs no
/// restart) and reads reports with `reports_token_env`; a credential without the `reports`
/// role gets 403, named as such.
#[tokio::test]
async fn credentials_from_files_and_roles_against_the_real_controller() {
    use grl_client::auth::{write_secret_file, CredentialSet};
    use grl_control::controller::{Controller, ControllerOptions, ROLES};
    let dir = tempfile::tempdir().unwrap();
    let (cfg, read) = ("rlc-config-0123456789abcdef", "rlc-read-0123456789abcdefgh");
    let creds = dir.path().join("credentials");
    write_secret_file(
        &creds,
        &format!(
            "rlc config {cfg}\nreader reports {read}\nzone zone-report zone-0123456789abcdefgh\n"
        ),
    )
    .unwrap();
    let mut credentials = CredentialSet::default();
    credentials.add_file(&creds, Some(ROLES)).unwrap();
    let ctl = Controller::start(ControllerOptions {
        state_dir: dir.path().join("state"),
        credentials,
        ..Default::default()
    })
    .await
    .unwrap();
    let token_file = dir.path().join("rlc-token");
    write_secret_file(&token_file, &format!("{cfg}\n")).unwrap();
    std::env::remove_var("RLC_PUSH_TEST_CFG");
    std::env::set_var("RLC_PUSH_TEST_CFG_FILE", &token_file);
    std::env::set_var("RLC_PUSH_TEST_READ", read);
    let mut conf = schema::ControllerConfig {
        url: ctl.url(),
        region: None,
        token_env: "RLC_PUSH_TEST_CFG".into(),
        token_file: None,
        reports_token_env: Some("RLC_PUSH_TEST_READ".into()),
        tls: None,
    };
    let client = ControllerClient::from_config(&conf, dir.path()).unwrap();
    assert!(client.reconcile_once(&desired("v1")).await.unwrap());
    assert_eq!(
        client.status().await.unwrap().version.as_deref(),
        Some("v1")
    );
    client.reports(None, 10).await.unwrap();
    // The file is read at each call: a wrong secret there is refused at once, and the right
    // one works again without a new client.
    write_secret_file(&token_file, "not-the-secret-0123456789\n").unwrap();
    let err = client.put_config(&desired("v2")).await.unwrap_err();
    assert!(matches!(err, PushError::Unauthorized), "{err}");
    write_secret_file(&token_file, cfg).unwrap();
    client.put_config(&desired("v2")).await.unwrap();
    // Without reports_token_env the config credential is used for reports: 403, no role.
    conf.reports_token_env = None;
    let client = ControllerClient::from_config(&conf, dir.path()).unwrap();
    let err = client.reports(None, 10).await.unwrap_err();
    assert!(matches!(err, PushError::Forbidden(_)), "{err}");
    assert!(
        err.to_string().contains("reports") && !err.to_string().contains(cfg),
        "{err}"
    );
    // Neither variable set: the error names both.
    std::env::remove_var("RLC_PUSH_TEST_CFG_FILE");
    let err = ControllerClient::from_config(&conf, dir.path()).unwrap_err();
    assert!(err.to_string().contains("RLC_PUSH_TEST_CFG_FILE"), "{err}");
    // `token_file` (relative to rlc.yaml's directory) needs no variable at all.
    conf.token_file = Some("rlc-token".into());
    conf.reports_token_env = Some("RLC_PUSH_TEST_READ".into());
    let client = ControllerClient::from_config(&conf, dir.path()).unwrap();
    client.put_config(&desired("v3")).await.unwrap();
    assert_eq!(
        client.status().await.unwrap().version.as_deref(),
        Some("v3")
    );
    conf.token_file = Some("no-such-token".into());
    let err = ControllerClient::from_config(&conf, dir.path()).unwrap_err();
    assert!(err.to_string().contains("no-such-token"), "{err}");
    ctl.shutdown().await;
}
