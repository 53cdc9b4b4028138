//! End-to-end: `rlc run --once` and `rlc serve` against a real `grl controller` process and a
//! git remote served by `git daemon`.

// End-to-end scenarios read top to bottom; the size bound (clippy.toml) is for code outside
// tests.
#![allow(clippy::too_many_lines)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use test_support::git::GitRemote;

mod api;
mod closed_loop;
mod demo;
mod deploy;
mod fleet;
mod regions;
mod rollout;
use test_support::process::{free_port, Proc};

const TOKEN: &str = "e2e-token-0123456789";

/// Path of a workspace binary, built once per test run so that it is never stale.
fn bin(name: &str) -> PathBuf {
    static BUILT: OnceLock<()> = OnceLock::new();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf();
    BUILT.get_or_init(|| {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let ok = Command::new(cargo)
            .current_dir(&root)
            // The axum_service example (closed_loop.rs) in the same build: two builds with
            // different feature sets would rebuild each other's dependencies every run.
            .args([
                "build",
                "-q",
                "-p",
                "rlc",
                "-p",
                "grl-runtime",
                "-p",
                "grl-client",
                "--bins",
            ])
            .args(["--example", "axum_service"])
            .status()
            .expect("cargo runs")
            .success();
        assert!(ok, "building the rlc and grl binaries failed");
    });
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| root.join("target"));
    let p = target.join("debug").join(name);
    assert!(p.exists(), "{} missing after the build", p.display());
    p
}

fn start_controller(port: u16, state: &Path) -> Proc {
    start_controller_ticking(port, state, 200)
}

/// [`start_controller`] with a control-loop period of `tick_ms`.
fn start_controller_ticking(port: u16, state: &Path, tick_ms: u64) -> Proc {
    let mut cmd = Command::new(bin("grl"));
    cmd.args([
        "controller",
        "--listen",
        &format!("127.0.0.1:{port}"),
        "--tick-ms",
        &tick_ms.to_string(),
        "--state-dir",
    ])
    .arg(state)
    .env("GRL_TOKEN", TOKEN)
    // A controller refuses to start without a zone-report credential.
    .env("GRL_REPORT_TOKEN", fleet::ZONE_TOKEN)
    .stdout(Stdio::null())
    .stderr(Stdio::null());
    let p = Proc::spawn(&mut cmd).expect("grl starts");
    wait_until(Duration::from_secs(20), || {
        get(port, "/v1/status").is_some()
    });
    p
}

/// GET on loopback; the JSON body on 200, None otherwise (connection refused included).
fn get(port: u16, path: &str) -> Option<serde_json::Value> {
    serde_json::from_str(&get_text(port, path)?).ok()
}

/// GET on loopback; the body on 200, None otherwise.
fn get_text(port: u16, path: &str) -> Option<String> {
    get_text_as(port, path, None)
}

/// GET with a bearer token on loopback; the JSON body on 200, None otherwise.
fn get_auth(port: u16, path: &str, token: &str) -> Option<serde_json::Value> {
    serde_json::from_str(&get_text_as(port, path, Some(token))?).ok()
}

/// GET on loopback, with a bearer token if one is given; the body on 200, None otherwise.
fn get_text_as(port: u16, path: &str, token: Option<&str>) -> Option<String> {
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n{auth}\r\n").ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    let (head, body) = buf.split_once("\r\n\r\n")?;
    if !head.starts_with("HTTP/1.1 200") && !head.starts_with("HTTP/1.0 200") {
        return None;
    }
    Some(body.to_string())
}

/// `rlc serve --poll-secs 1` on a free port, in direct mode on the config repo at
/// `remote_url`, putting configs on the controller on `cport`, its state in `database_url`;
/// `history_and_rails` are the first keys of its `rlc.yaml`, which is written in `dir`, where
/// it logs to `rlc-serve.log`; `GRL_TOKEN` is the controller's token, `RLC_TOKEN` its own
/// (`rlc_token`). Waited for until it leads and the controller holds `version` (the base
/// branch it puts there first): the process and its port.
fn start_rlc_serve(
    dir: &Path,
    history_and_rails: &str,
    remote_url: &str,
    database_url: &str,
    cport: u16,
    rlc_token: &str,
    version: &str,
) -> (Proc, u16) {
    let controller =
        format!("controller:\n  url: http://127.0.0.1:{cport}\n  token_env: GRL_TOKEN\n");
    start_rlc_serve_on(
        dir,
        history_and_rails,
        remote_url,
        database_url,
        (&controller, &[cport]),
        rlc_token,
        version,
    )
}

/// [`start_rlc_serve`] with `controllers.0` as rlc.yaml's controller section, waited for until
/// every controller on the ports `controllers.1` holds `version`.
fn start_rlc_serve_on(
    dir: &Path,
    history_and_rails: &str,
    remote_url: &str,
    database_url: &str,
    controllers: (&str, &[u16]),
    rlc_token: &str,
    version: &str,
) -> (Proc, u16) {
    let rport = free_port();
    let (section, cports) = controllers;
    let rlc_yaml = dir.join("rlc.yaml");
    std::fs::write(
        &rlc_yaml,
        format!(
            "{history_and_rails}\
config_repo:\n  path: work\n  url: {remote_url}\n  branch: main\n  mode: direct\n\
{section}\
database_url: {database_url}\nserver:\n  listen: 127.0.0.1:{rport}\n  token_env: RLC_TOKEN\n"
        ),
    )
    .unwrap();
    let serve = Proc::spawn(
        Command::new(bin("rlc"))
            .args(["serve", "--poll-secs", "1", "--config"])
            .arg(&rlc_yaml)
            .env("GRL_TOKEN", TOKEN)
            .env("RLC_TOKEN", rlc_token)
            .stdout(Stdio::null())
            .stderr(Stdio::from(
                std::fs::File::create(dir.join("rlc-serve.log")).unwrap(),
            )),
    )
    .unwrap();
    wait_until(Duration::from_secs(60), || leader(rport) == Some(1));
    for cport in cports {
        wait_until(Duration::from_secs(30), || {
            get(*cport, "/v1/status").is_some_and(|s| s["version"] == version)
        });
    }
    (serve, rport)
}

/// Sum of a counter family's samples for `bucket="charge"` in a Prometheus text page.
fn charge_counter(metrics: &str, family: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(family) && l.contains("bucket=\"charge\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Writes `dir/history.csv`: the last two hours of `payments` called by `caller` at `rps`,
/// one sample a minute (rlc's history for the end-to-end runs).
fn write_steady_history(dir: &Path, caller: &str, rps: f64) {
    let now = chrono::Utc::now().timestamp() / 60 * 60;
    let mut csv = String::from("ts,service,caller,procedure,rps\n");
    for m in (0..=120).rev() {
        csv.push_str(&format!("{},payments,{caller},,{rps}\n", now - m * 60));
    }
    std::fs::write(dir.join("history.csv"), csv).unwrap();
}

/// Polls `cond` until it holds; panics after `limit` (a bound on waiting, not a speed claim).
fn wait_until(limit: Duration, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < limit,
            "condition not met within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
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

/// A deployment: a git remote made from the template, a history file and an rlc.yaml.
struct Deployment {
    dir: tempfile::TempDir,
    remote: GitRemote,
    controller_port: u16,
}

impl Deployment {
    fn new() -> Deployment {
        Deployment::with_database("sqlite://rlc.db")
    }

    fn with_database(database_url: &str) -> Deployment {
        Deployment::build(database_url, &[], "")
    }

    /// A deployment whose config repo has `overrides` (path, contents) on top of the template
    /// and whose rlc.yaml ends with `extra`.
    fn build(database_url: &str, overrides: &[(&str, &str)], extra: &str) -> Deployment {
        let mut files = template_files();
        for (path, text) in overrides {
            files.retain(|(p, _)| p != path);
            files.push((path.to_string(), text.to_string()));
        }
        let refs: Vec<(&str, &str)> = files
            .iter()
            .map(|(a, b)| (a.as_str(), b.as_str()))
            .collect();
        let remote = GitRemote::new("main", &refs).expect("git remote");
        let dir = tempfile::tempdir().unwrap();
        rlc::history::synth::generate(
            &dir.path().join("history.csv"),
            7,
            chrono::Utc::now(),
            28,
            60,
        )
        .unwrap();
        let controller_port = free_port();
        std::fs::write(
            dir.path().join("rlc.yaml"),
            format!(
                "history:\n  file: history.csv\nconfig_repo:\n  path: work\n  url: {}\n  branch: main\n  mode: direct\ncontroller:\n  url: http://127.0.0.1:{controller_port}\n  token_env: GRL_TOKEN\ndatabase_url: {database_url}\nserver:\n  listen: 127.0.0.1:0\n  token_env: RLC_TOKEN\n{extra}",
                remote.url()
            ),
        )
        .unwrap();
        Deployment {
            dir,
            remote,
            controller_port,
        }
    }

    fn rlc(&self, args: &[&str]) -> Command {
        let mut c = Command::new(bin("rlc"));
        c.args(args)
            .arg("--config")
            .arg(self.dir.path().join("rlc.yaml"))
            .env("GRL_TOKEN", TOKEN)
            .env("RLC_TOKEN", "rlc-e2e-token");
        c
    }
}

#[test]
fn run_once_puts_the_new_commit_on_a_real_controller() {
    let d = Deployment::new();
    let before = d.remote.head("main").unwrap();
    let _controller = start_controller(d.controller_port, &d.dir.path().join("grl-state"));

    let out = d.rlc(&["run", "--once"]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let head = d.remote.head("main").unwrap();
    assert_ne!(
        head, before,
        "the run must commit the computed quotas: {stdout}"
    );
    let status = get(d.controller_port, "/v1/status").unwrap();
    assert_eq!(status["version"], head, "controller runs the new commit");
    // The controller serves exactly the committed buckets.
    let committed = limits(&d.remote.read("main", "buckets/payments.yaml").unwrap());
    let config = get(d.controller_port, "/v1/config").unwrap();
    let served = config["services"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["service"] == "payments")
        .expect("payments served");
    let mut served_limits: Vec<(String, f64)> = served["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| {
            (
                b["name"].as_str().unwrap().to_string(),
                b["limit_rps"].as_f64().unwrap(),
            )
        })
        .collect();
    served_limits.sort_by(|a, b| a.0.cmp(&b.0));
    assert!(!committed.is_empty());
    assert_eq!(served_limits, committed);

    // Same history again: only decreases the rails held back move on (each capped per run),
    // until a run has nothing to change and makes no commit.
    let mut last = head;
    let mut converged = false;
    for _ in 0..8 {
        let out = d.rlc(&["run", "--once"]).output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert_eq!(out.status.code(), Some(0), "{stdout}");
        let now = d.remote.head("main").unwrap();
        if now == last {
            assert!(stdout.contains("unchanged"), "{stdout}");
            converged = true;
            break;
        }
        assert!(
            !stdout.contains(": raised ") && !stdout.contains(": added "),
            "only capped decreases continue: {stdout}"
        );
        last = now;
    }
    assert!(
        converged,
        "a run on unchanged history must eventually make no commit"
    );
    assert_eq!(
        get(d.controller_port, "/v1/status").unwrap()["version"],
        last.as_str()
    );
}

#[test]
fn serve_delivers_the_version_once_the_controller_is_back() {
    let d = Deployment::new();
    // Controller down: the commit stands, the push is pending (exit 2).
    let out = d.rlc(&["run", "--once"]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(out.status.code(), Some(2), "{stdout}");
    assert!(stdout.contains("push pending"), "{stdout}");
    let head = d.remote.head("main").unwrap();

    let serve = Proc::spawn(
        d.rlc(&["serve", "--poll-secs", "1"])
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    )
    .unwrap();
    // The daemon cannot reach the controller yet; then it comes up.
    std::thread::sleep(Duration::from_millis(1500));
    let _controller = start_controller(d.controller_port, &d.dir.path().join("grl-state"));
    wait_until(Duration::from_secs(60), || {
        get(d.controller_port, "/v1/status").is_some_and(|s| s["version"] == head.as_str())
    });
    drop(serve);
}

/// (bucket name, limit) pairs of a bucket file, sorted by name, read with the schema crate.
fn limits(yaml: &str) -> Vec<(String, f64)> {
    let f = schema::parse_str::<schema::BucketFile>(Path::new("payments.yaml"), yaml).unwrap();
    let mut v: Vec<_> = f
        .value
        .buckets
        .iter()
        .map(|b| (b.name.clone(), b.limit_rps))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// `rlc_leader` of the daemon on `port` (None while it is not answering).
fn leader(port: u16) -> Option<u8> {
    get_text(port, "/metrics")?
        .lines()
        .find_map(|l| l.strip_prefix("rlc_leader "))
        .and_then(|v| v.trim().parse().ok())
}

#[test]
fn replicas_on_one_postgres_elect_one_scheduler_and_fail_over() {
    let db = tokio::runtime::Runtime::new()
        .unwrap()
        .block_on(test_support::postgres::fresh_database())
        .expect("a throwaway Postgres (cargo xtask test provides DATABASE_URL)");
    let d = Deployment::with_database(&db.url);
    let ports = [free_port(), free_port()];
    let mut replicas: Vec<Option<Proc>> = ports
        .iter()
        .map(|p| {
            Some(
                Proc::spawn(
                    d.rlc(&[
                        "serve",
                        "--poll-secs",
                        "1",
                        "--listen",
                        &format!("127.0.0.1:{p}"),
                    ])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null()),
                )
                .unwrap(),
            )
        })
        .collect();
    let both = || (leader(ports[0]), leader(ports[1]));
    wait_until(
        Duration::from_secs(60),
        || matches!(both(), (Some(a), Some(b)) if a + b == 1),
    );
    // It stays one across several polls.
    for _ in 0..5 {
        std::thread::sleep(Duration::from_millis(400));
        let (a, b) = both();
        assert_eq!(a.unwrap() + b.unwrap(), 1, "exactly one active scheduler");
    }
    let active = if both().0 == Some(1) { 0 } else { 1 };
    replicas[active] = None; // killed: its session ends and the lock with it
    let other = ports[1 - active];
    wait_until(Duration::from_secs(60), || leader(other) == Some(1));
}

/// A deployment whose `maps` service uses a plugin that segfaults on every bucket and whose
/// `payments` service uses a well-behaved plugin, both run by the real `rlc` binary as host.
fn deployment_with_plugins() -> Deployment {
    let policies = "default:\n  policy: peak\n  headroom: 0.25\nservices:\n  maps:\n    policy: plugin:crashy\n    params: {mode: segfault}\n    mode: enforce\n  payments:\n    policy: plugin:steady\n    params: {factor: 0.5}\n  search:\n    policy: peak\n    headroom: 0.5\n    floor_rps: 10\n";
    let d = Deployment::build(
        "sqlite://rlc.db",
        &[("rlc/policies.yaml", policies)],
        "plugins:\n  dir: plugins\n  timeout: 5s\n  memory_limit_mb: 512\n",
    );
    let plugins = d.dir.path().join("plugins");
    std::fs::create_dir(&plugins).unwrap();
    for name in ["crashy", "steady"] {
        std::fs::copy(
            test_support::plugin::example_plugin_lib(),
            plugins.join(format!(
                "{}{name}{}",
                std::env::consts::DLL_PREFIX,
                std::env::consts::DLL_SUFFIX
            )),
        )
        .unwrap();
    }
    d
}

/// Pids of the plugin host processes serving plugins from `dir`.
fn plugin_hosts(dir: &Path) -> Vec<u32> {
    let needle = dir.to_string_lossy().into_owned();
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        if cmd.contains("__plugin-host") && cmd.contains(&needle) {
            out.push(pid);
        }
    }
    out
}

/// `maps` keeps its current quotas with the crash as the reason; the other services get
/// theirs (one of them from a plugin), the commit is made and pushed, the run is recorded.
#[test]
fn run_once_with_a_segfaulting_plugin_fails_only_its_buckets() {
    let d = deployment_with_plugins();
    let before = d.remote.head("main").unwrap();
    let maps_before = d.remote.read("main", "buckets/maps.yaml").unwrap();
    let payments_before = limits(&d.remote.read("main", "buckets/payments.yaml").unwrap());
    let _controller = start_controller(d.controller_port, &d.dir.path().join("grl-state"));

    let out = d.rlc(&["run", "--once", "--json"]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "rc {:?} (a plugin crash must not take rlc down)\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let outcome: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(outcome["status"], "success", "{outcome}");
    // The run record is written.
    let run_id = outcome["run_id"].as_i64().expect("run recorded");
    let store = tokio::runtime::Runtime::new().unwrap().block_on(async {
        let s = rlc::store::Store::connect("sqlite://rlc.db", d.dir.path())
            .await
            .unwrap();
        s.recent_runs(5).await.unwrap()
    });
    let rec = store.iter().find(|r| r.id == run_id).expect("stored run");
    assert!(
        rec.services.contains("plugin:crashy") && rec.services.contains("SIGSEGV"),
        "{}",
        rec.services
    );
    // maps' buckets are skipped with the cause, and its file is untouched.
    let skipped = outcome["skipped"].as_array().unwrap();
    let maps: Vec<&str> = skipped
        .iter()
        .filter(|s| s["service"] == "maps")
        .map(|s| s["reason"].as_str().unwrap())
        .collect();
    assert!(!maps.is_empty(), "{outcome}");
    for r in &maps {
        assert!(
            r.contains("plugin:crashy") && r.contains("died with signal 11 (SIGSEGV)")
                || r.contains("disabled"),
            "{r}"
        );
    }
    let head = d.remote.head("main").unwrap();
    assert_ne!(head, before, "the other services' quotas are committed");
    assert_eq!(
        d.remote.read("main", "buckets/maps.yaml").unwrap(),
        maps_before,
        "maps keeps its current quotas"
    );
    // payments got its quotas from the well-behaved plugin, search from peak.
    let payments = d.remote.read("main", "buckets/payments.yaml").unwrap();
    assert!(payments.contains("policy: \"plugin:steady\""), "{payments}");
    assert_ne!(limits(&payments), payments_before);
    assert!(d.remote.read("main", "buckets/search.yaml").is_ok());
    // And the controller runs it.
    assert_eq!(
        get(d.controller_port, "/v1/status").unwrap()["version"],
        head.as_str()
    );
}

/// `rlc serve` runs a cycle with a segfaulting plugin and keeps answering; when the daemon
/// is killed, its plugin hosts go with it.
#[test]
fn serve_survives_a_segfaulting_plugin() {
    let d = deployment_with_plugins();
    let _controller = start_controller(d.controller_port, &d.dir.path().join("grl-state"));
    let port = free_port();
    let serve = Proc::spawn(
        d.rlc(&[
            "serve",
            "--poll-secs",
            "1",
            "--listen",
            &format!("127.0.0.1:{port}"),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null()),
    )
    .unwrap();
    wait_until(Duration::from_secs(60), || {
        get_text(port, "/healthz").is_some()
    });
    wait_until(Duration::from_secs(60), || leader(port) == Some(1));
    let status = post(port, "/v1/runs", "rlc-e2e-token");
    assert_eq!(status, Some(202));
    // A run finishes and is recorded, with maps skipped because of the crash.
    let mut run = serde_json::Value::Null;
    wait_until(Duration::from_secs(120), || {
        let Some(runs) = get(port, "/v1/runs") else {
            return false;
        };
        // The API run, or one the daemon started by itself before it (a trigger queued
        // behind another is coalesced).
        match runs["runs"].as_array().and_then(|r| {
            r.iter()
                .find(|r| r["services"].to_string().contains("plugin:crashy"))
        }) {
            Some(r) => {
                run = r.clone();
                true
            }
            None => false,
        }
    });
    assert_eq!(run["status"], "success", "{run}");
    let text = run["services"].to_string();
    assert!(
        text.contains("plugin:crashy") && text.contains("SIGSEGV"),
        "{run}"
    );
    // The daemon is still there.
    assert_eq!(get_text(port, "/healthz").as_deref(), Some("ok\n"));
    // The well-behaved plugin's host stays up between runs; killing the daemon (SIGKILL, no
    // clean-up) takes it down too.
    let plugins = d.dir.path().join("plugins");
    let hosts = plugin_hosts(&plugins);
    assert!(!hosts.is_empty(), "the steady plugin's host runs");
    serve.kill();
    wait_until(Duration::from_secs(10), || {
        plugin_hosts(&plugins).is_empty()
    });
}

/// POST with a bearer token on loopback; the status code.
fn post(port: u16, path: &str, token: &str) -> Option<u16> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "POST {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\nContent-Length: 0\r\n\r\n"
    )
    .ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    buf.split_whitespace().nth(1)?.parse().ok()
}

mod dashboard;
