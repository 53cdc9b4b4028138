//! A git remote that accepts TCP and never answers (a TCP black hole): `rlc run --once` fails
//! within `config_repo.timeout` with exit 1 and says so; `rlc serve` stays alive, says it is
//! not ready while its poll is stuck past the deadline, and SIGTERM ends it within the grace
//! whatever git is doing.

use std::io::Read;
use std::net::TcpListener;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use test_support::process::{free_port, Proc};

/// Accepts connections and holds them without a byte, until dropped.
pub(crate) struct BlackHole {
    pub(crate) port: u16,
    _held: std::thread::JoinHandle<()>,
}

impl BlackHole {
    pub(crate) fn start() -> BlackHole {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let held = std::thread::spawn(move || {
            let mut conns = Vec::new();
            for s in l.incoming().flatten() {
                // Read what comes (so the peer's writes never block), answer nothing.
                let mut s2 = s.try_clone().unwrap();
                std::thread::spawn(move || {
                    let mut buf = [0u8; 1024];
                    while matches!(s2.read(&mut buf), Ok(n) if n > 0) {}
                });
                conns.push(s);
            }
        });
        BlackHole { port, _held: held }
    }
}

fn write_config(d: &Path, hole: &BlackHole, extra: &str) {
    rlc::history::synth::generate(&d.join("h.csv"), 1, chrono::Utc::now(), 28, 60).unwrap();
    std::fs::write(
        d.join("rlc.yaml"),
        format!(
            "history:\n  file: h.csv\nconfig_repo:\n  path: wc\n  url: git://127.0.0.1:{}/remote.git\n  timeout: 2s\ndatabase_url: sqlite://rlc.db\n{extra}",
            hole.port
        ),
    )
    .unwrap();
}

#[test]
fn a_hung_git_remote_fails_the_run_within_its_timeout() {
    let hole = BlackHole::start();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write_config(d, &hole, "");
    let mut run = Proc::spawn(
        Command::new(env!("CARGO_BIN_EXE_rlc"))
            .args(["run", "--once", "--json", "--config"])
            .arg(d.join("rlc.yaml"))
            .current_dir(d)
            .env("RUST_LOG", "error")
            .stdout(std::fs::File::create(d.join("out.json")).unwrap())
            .stderr(Stdio::null()),
    )
    .unwrap();
    // A bound far above the 2 s timeout: the run must end, it is not a speed check.
    let st = run
        .wait_exit(Duration::from_secs(120))
        .expect("rlc run still hanging on a silent git remote");
    let out = std::fs::read_to_string(d.join("out.json")).unwrap();
    assert_eq!(st.code(), Some(1), "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let error = v["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("timed out") && error.contains("config_repo.timeout"),
        "{out}"
    );
}

#[test]
fn rlc_serve_on_a_hung_git_remote_is_not_ready_and_stops_on_sigterm() {
    let hole = BlackHole::start();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let port = free_port();
    // A git timeout longer than the run deadline: the poll is seen stuck before it ends.
    write_config(
        d,
        &hole,
        &format!("server:\n  listen: 127.0.0.1:{port}\n  token_env: RLC_GIT_FAULTS_TOKEN\n"),
    );
    let yaml = std::fs::read_to_string(d.join("rlc.yaml"))
        .unwrap()
        .replace("timeout: 2s", "timeout: 10m");
    std::fs::write(d.join("rlc.yaml"), yaml).unwrap();
    let mut serve = Proc::spawn(
        Command::new(env!("CARGO_BIN_EXE_rlc"))
            .args([
                "serve",
                "--poll-secs",
                "1",
                "--run-deadline-secs",
                "2",
                "--shutdown-grace-ms",
                "1000",
                "--config",
            ])
            .arg(d.join("rlc.yaml"))
            .current_dir(d)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(d.join("serve.log")).unwrap()),
    )
    .unwrap();
    let get = |path: &str| crate::ops::http(port, "GET", path, None);
    let mut stuck = None;
    for _ in 0..600 {
        if let Some((503, body)) = get("/readyz") {
            let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
            if v["checks"]["scheduler"]["ok"] == false {
                stuck = Some(v["checks"]["scheduler"]["detail"].to_string());
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let log = || std::fs::read_to_string(d.join("serve.log")).unwrap_or_default();
    let body = stuck.unwrap_or_else(|| panic!("never reported the stuck poll:\n{}", log()));
    assert!(
        body.contains("poll of the config repo") && body.contains("past the run deadline"),
        "{body}"
    );
    assert_eq!(get("/healthz").map(|r| r.0), Some(200), "alive all along");
    serve.signal(libc::SIGTERM);
    let st = serve
        .wait_exit(Duration::from_secs(30))
        .unwrap_or_else(|| panic!("rlc serve did not stop after SIGTERM:\n{}", log()));
    assert_eq!(st.code(), Some(0), "{}", log());
}

/// A remote path that does not exist is named as such (libgit2 alone says "unsupported URL
/// protocol").
#[test]
fn a_missing_remote_path_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    rlc::history::synth::generate(&d.join("h.csv"), 1, chrono::Utc::now(), 28, 60).unwrap();
    let missing = d.join("nowhere/remote.git");
    std::fs::write(
        d.join("rlc.yaml"),
        format!(
            "history:\n  file: h.csv\nconfig_repo:\n  path: wc\n  url: {}\ndatabase_url: sqlite://rlc.db\n",
            missing.display()
        ),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_rlc"))
        .args(["run", "--once", "--json", "--config"])
        .arg(d.join("rlc.yaml"))
        .current_dir(d)
        .env("RUST_LOG", "error")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let error = v["error"].as_str().unwrap_or_default();
    assert!(
        error.contains(&format!(
            "the remote path {} does not exist",
            missing.display()
        )),
        "{text}"
    );
}
