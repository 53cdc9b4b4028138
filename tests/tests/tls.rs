//! End-to-end over TLS: `rlc run --once` and `rlc serve` push to a real `grl controller` that
//! serves HTTPS and requires client certificates, and `rlc serve` itself serves HTTPS.
//! Certificates come from a throwaway CA made by the test.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use grl_client::tls::ClientTls;
use test_support::git::GitRemote;
use test_support::process::{free_port, Proc};
use test_support::tls::Ca;

/// The controller's `config` role (rlc's pushes), its `reports` role (rlc serve's dashboard
/// reads `GET /v1/reports`) and its zone-report credential, one secret each.
const CONFIG_TOKEN: &str = "e2e-config-token-0123456789";
const READ_TOKEN: &str = "e2e-read-token-0123456789";
const REPORT_TOKEN: &str = "e2e-zone-report-token";

/// Path of a workspace binary, built once per test run. `RLC_BIN` / `GRL_BIN` override it (a
/// copy taken right after the build, when several checkouts share one target directory).
fn bin(name: &str) -> PathBuf {
    if let Some(p) = std::env::var_os(format!("{}_BIN", name.to_uppercase())) {
        return PathBuf::from(p);
    }
    static BUILT: OnceLock<()> = OnceLock::new();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf();
    BUILT.get_or_init(|| {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let ok = Command::new(cargo)
            .current_dir(&root)
            .args(["build", "-q", "-p", "rlc", "-p", "grl-runtime", "--bins"])
            .status()
            .expect("cargo runs")
            .success();
        assert!(ok, "building the rlc and grl binaries failed");
    });
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| root.join("target"));
    target.join("debug").join(name)
}

fn template_files() -> Vec<(String, String)> {
    fn walk(dir: &Path, rel: &str, out: &mut Vec<(String, String)>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let e = e.unwrap();
            let name = e.file_name().to_string_lossy().into_owned();
            let r = if rel.is_empty() {
                name.clone()
            } else {
                format!("{rel}/{name}")
            };
            if e.file_type().unwrap().is_dir() {
                walk(&e.path(), &r, out);
            } else {
                out.push((r, std::fs::read_to_string(e.path()).unwrap()));
            }
        }
    }
    let mut out = Vec::new();
    walk(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("../config-repo-template"),
        "",
        &mut out,
    );
    out
}

async fn get_json(tls: &ClientTls, url: &str) -> Option<serde_json::Value> {
    let h = tls.http_client(Duration::from_secs(5)).unwrap();
    let r = h.get(url).send().await.ok()?;
    if !r.status().is_success() {
        return None;
    }
    r.json().await.ok()
}

async fn wait_for<F, Fut>(what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    for _ in 0..600 {
        if f().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("timed out waiting for: {what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rlc_pushes_to_a_mutual_tls_controller_and_serves_https() {
    let files = template_files();
    let refs: Vec<(&str, &str)> = files
        .iter()
        .map(|(a, b)| (a.as_str(), b.as_str()))
        .collect();
    let remote = GitRemote::new("main", &refs).expect("git remote");
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    rlc::history::synth::generate(&d.join("history.csv"), 7, chrono::Utc::now(), 28, 60).unwrap();

    let ca = Ca::new("e2e CA");
    ca.write(&d.join("ca.crt"));
    ca.server().write(d, "server");
    ca.client("rlc").write(d, "rlc-client");
    let (op_crt, op_key) = ca.client("operator").write(d, "operator");
    let rogue = Ca::new("rogue CA");
    rogue.write(&d.join("rogue.crt"));
    let operator = ClientTls {
        ca: Some(d.join("ca.crt")),
        cert: Some(op_crt),
        key: Some(op_key),
    };

    let cport = free_port();
    let _controller = Proc::spawn(
        Command::new(bin("grl"))
            .args(["controller", "--listen", &format!("127.0.0.1:{cport}")])
            .args(["--tick-ms", "200", "--state-dir"])
            .arg(d.join("grl-state"))
            .arg("--tls-cert")
            .arg(d.join("server.crt"))
            .arg("--tls-key")
            .arg(d.join("server.key"))
            .arg("--tls-client-ca")
            .arg(d.join("ca.crt"))
            .env("GRL_CONFIG_TOKEN", CONFIG_TOKEN)
            .env("GRL_READ_TOKEN", READ_TOKEN)
            .env("GRL_REPORT_TOKEN", REPORT_TOKEN)
            .env_remove("GRL_TOKEN")
            .env_remove("GRL_CREDENTIALS_FILE")
            .stdout(Stdio::null())
            .stderr(Stdio::from(
                std::fs::File::create(d.join("controller.log")).unwrap(),
            )),
    )
    .expect("grl starts");
    let status_url = format!("https://127.0.0.1:{cport}/v1/status");
    wait_for("controller up over https", || async {
        get_json(&operator, &status_url).await.is_some()
    })
    .await;

    // Paths in rlc.yaml are relative to it.
    let sport = free_port();
    let write_cfg = |ca_file: &str| {
        std::fs::write(
            d.join("rlc.yaml"),
            format!(
                "history:\n  file: history.csv\nconfig_repo:\n  path: work\n  url: {url}\n  branch: main\n  mode: direct\n\
                 controller:\n  url: https://127.0.0.1:{cport}\n  token_env: GRL_CONFIG_TOKEN\n  reports_token_env: GRL_READ_TOKEN\n  tls:\n    ca: {ca_file}\n    client_cert: rlc-client.crt\n    client_key: rlc-client.key\n\
                 database_url: sqlite://rlc.db\n\
                 server:\n  listen: 127.0.0.1:{sport}\n  token_env: RLC_TOKEN\n  tls:\n    cert: server.crt\n    key: server.key\n",
                url = remote.url()
            ),
        )
        .unwrap();
    };
    let rlc = |args: &[&str]| {
        let mut c = Command::new(bin("rlc"));
        c.args(args)
            .arg("--config")
            .arg(d.join("rlc.yaml"))
            .env("GRL_CONFIG_TOKEN", CONFIG_TOKEN)
            .env("GRL_READ_TOKEN", READ_TOKEN)
            .env_remove("GRL_TOKEN")
            .env("RLC_TOKEN", "rlc-e2e-token");
        c
    };

    // rlc trusting another CA: the commit stands, the push stays pending (exit 2).
    write_cfg("rogue.crt");
    let out = rlc(&["run", "--once"]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(out.status.code(), Some(2), "{stdout}");
    assert!(stdout.contains("push pending"), "{stdout}");
    let head = remote.head("main").unwrap();
    assert_ne!(
        get_json(&operator, &status_url).await.unwrap()["version"],
        head.as_str()
    );

    // Trusting the right CA, with its client certificate: the controller gets the commit.
    write_cfg("ca.crt");
    let serve = Proc::spawn(
        rlc(&["serve", "--poll-secs", "1"])
            .stdout(Stdio::null())
            .stderr(Stdio::from(
                std::fs::File::create(d.join("serve.log")).unwrap(),
            )),
    )
    .unwrap();
    wait_for("the controller runs the base branch's commit", || async {
        get_json(&operator, &status_url)
            .await
            .is_some_and(|s| s["version"] == head.as_str())
    })
    .await;

    // rlc serve answers over HTTPS to a client trusting the CA, and to nothing else.
    let health = format!("https://127.0.0.1:{sport}/healthz");
    let ca_only = ClientTls {
        ca: Some(d.join("ca.crt")),
        ..Default::default()
    };
    wait_for("rlc serve up over https", || async {
        let h = ca_only.http_client(Duration::from_secs(5)).unwrap();
        match h.get(&health).send().await {
            Ok(r) => r.text().await.is_ok_and(|t| t == "ok\n"),
            Err(_) => false,
        }
    })
    .await;
    let rogue_only = ClientTls {
        ca: Some(d.join("rogue.crt")),
        ..Default::default()
    };
    let h = rogue_only.http_client(Duration::from_secs(5)).unwrap();
    assert!(
        h.get(&health).send().await.is_err(),
        "untrusted server accepted"
    );
    let plain = reqwest::Client::new()
        .get(format!("http://127.0.0.1:{sport}/healthz"))
        .timeout(Duration::from_secs(5))
        .send()
        .await;
    assert!(
        plain.as_ref().map_or(true, |r| !r.status().is_success()),
        "plain HTTP answered: {plain:?}"
    );
    drop(serve);
}
