//! The front ends tests start, shared by the test binaries: `grl sidecar` processes and the
//! Python services and clients they stand before.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::Value;
use test_support::process::{free_port, Proc};
use test_support::wait::wait_up;

/// The client report credential for service `payments` that the tests' aggregators accept.
pub(crate) const CLIENT_TOKEN: &str = "payments-client-0123456789";

/// A file in `dir` for the log of the process `name`.
pub(crate) fn log_file(dir: &Path, name: &str) -> Stdio {
    Stdio::from(std::fs::File::create(dir.join(format!("{name}.log"))).unwrap())
}

/// The grpcio release the gRPC tests install into their venv.
pub(crate) const GRPCIO: &str = "1.85.1";

/// Writes `text` to the script `name` in `dir`; its path.
pub(crate) fn write_script(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// A sidecar for `payments` on `port` (admin on `admin`) in front of `upstream`.
pub(crate) fn spawn_sidecar(
    dir: &Path,
    port: u16,
    admin: u16,
    upstream: &str,
    aggregators: &[&str],
    extra: &[&str],
) -> Proc {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_grl"));
    cmd.args(["sidecar", "--listen", &format!("127.0.0.1:{port}")])
        .args(["--admin-listen", &format!("127.0.0.1:{admin}")])
        .args(["--upstream", upstream, "--service", "payments"])
        .args(["--zone", "z1", "--region", "r1", "--tick-ms", "200"]);
    for a in aggregators {
        cmd.args(["--aggregator", a]);
    }
    Proc::spawn(
        cmd.args(extra)
            .env("GRL_CLIENT_TOKEN", CLIENT_TOKEN)
            .stdout(Stdio::null())
            .stderr(log_file(dir, &format!("sidecar-{port}"))),
    )
    .unwrap()
}

/// A sidecar (`extra` its flags; its aggregator a port nobody listens on: it fails open) in
/// front of `upstream`, answering, with the processes that stop when it is dropped.
pub(crate) struct Running {
    /// Stopped first (fields drop in order), while their log directories still exist.
    pub(crate) _procs: Vec<Proc>,
    pub(crate) _dirs: Vec<tempfile::TempDir>,
    pub port: u16,
    pub admin: u16,
}

pub(crate) async fn lone_sidecar(upstream: &str, extra: &[&str], mut procs: Vec<Proc>) -> Running {
    let dir = tempfile::tempdir().unwrap();
    let (port, admin) = (free_port(), free_port());
    let dead = format!("http://127.0.0.1:{}", free_port());
    procs.push(spawn_sidecar(
        dir.path(),
        port,
        admin,
        upstream,
        &[&dead],
        extra,
    ));
    wait_up(&format!("http://127.0.0.1:{admin}/healthz")).await;
    Running {
        _dirs: vec![dir],
        port,
        admin,
        _procs: procs,
    }
}

/// The Python of the grpcio test venv, or None with `test` marked skipped (the venv could not
/// be built here).
pub(crate) fn grpcio_python(test: &str) -> Option<PathBuf> {
    match test_support::venv::tool("grpcio", GRPCIO, "python") {
        Ok(p) => Some(p),
        Err(e) => {
            test_support::skip(test, &format!("grpcio venv: {e:#}"));
            None
        }
    }
}

/// Runs the Python `script` with `args` (blocking) and returns the JSON it prints; it must
/// exit 0.
pub(crate) fn run_py(python: &Path, script: &Path, args: &[&str]) -> Value {
    let out = Command::new(python)
        .arg(script)
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The page of `GET /metrics` on the admin port `admin`.
pub(crate) async fn admin_metrics(admin: u16) -> String {
    reqwest::get(format!("http://127.0.0.1:{admin}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}
