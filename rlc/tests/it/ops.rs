//! `rlc serve` as an operable daemon, a real process: it logs at info by default (JSON with
//! `--log-format json`, no colours on a file), `/healthz` and `/readyz` say what it can do
//! (config, store, leader or standby), and SIGTERM lets a running cycle finish within the
//! grace, or abandons it after the grace, and exits 0 either way.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use test_support::git::GitRemote;
use test_support::process::{free_port, Proc};

const TOKEN: &str = "ops-api-token";
const EMPTY_MATRIX: &str = r#"{"status":"success","data":{"resultType":"matrix","result":[]}}"#;

/// A Prometheus stand-in that holds every request until told to answer (then answers those
/// held and every later one with an empty matrix): a run stays in its history pull for as
/// long as the test wants.
#[derive(Clone)]
struct HeldPrometheus {
    port: u16,
    held: Arc<Mutex<Vec<TcpStream>>>,
    answering: Arc<Mutex<bool>>,
}

fn read_request(s: &mut TcpStream) {
    let mut r = BufReader::new(s.try_clone().unwrap());
    let mut len = 0usize;
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
            len = v.trim().parse().unwrap_or(0);
        }
        if line == "\r\n" {
            break;
        }
    }
    let mut body = vec![0; len];
    let _ = r.read_exact(&mut body);
}

fn answer(mut s: TcpStream) {
    let _ = write!(
        s,
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{EMPTY_MATRIX}",
        EMPTY_MATRIX.len()
    );
}

impl HeldPrometheus {
    fn start() -> HeldPrometheus {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let p = HeldPrometheus {
            port: l.local_addr().unwrap().port(),
            held: Arc::default(),
            answering: Arc::default(),
        };
        let q = p.clone();
        std::thread::spawn(move || {
            for s in l.incoming() {
                let Ok(mut s) = s else { continue };
                read_request(&mut s);
                if *q.answering.lock().unwrap() {
                    answer(s);
                } else {
                    q.held.lock().unwrap().push(s);
                }
            }
        });
        p
    }

    fn held(&self) -> usize {
        self.held.lock().unwrap().len()
    }

    fn answer_all(&self) {
        *self.answering.lock().unwrap() = true;
        for s in self.held.lock().unwrap().drain(..) {
            answer(s);
        }
    }
}

fn wait_for(what: &str, bound: Duration, mut f: impl FnMut() -> bool) {
    let t = std::time::Instant::now();
    while !f() {
        assert!(t.elapsed() < bound, "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `(status, body)` of a plain HTTP request.
pub(crate) fn http(
    port: u16,
    method: &str,
    path: &str,
    token: Option<&str>,
) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    let status = buf.get(9..12)?.parse().ok()?;
    let body = buf.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    // A chunked body: keep the JSON object only.
    let body = match (body.find('{'), body.rfind('}')) {
        (Some(a), Some(b)) if b > a => &body[a..=b],
        _ => body,
    };
    Some((status, body.to_string()))
}

fn json(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"))
}

struct Daemon {
    proc: Proc,
    port: u16,
    log: std::path::PathBuf,
}

fn start(d: &Path, prom: &HeldPrometheus, remote: &GitRemote, extra: &[&str]) -> Daemon {
    let port = free_port();
    std::fs::write(
        d.join("rlc.yaml"),
        format!(
            "history:\n  prometheus:\n    url: http://127.0.0.1:{}\n    query: 'sum by (service, caller, procedure) (rate(x_total[1m]))'\n    timeout: 10m\n    retries: 1\n  lookback: 1h\n  step: 1m\n\
             config_repo:\n  path: wc\n  url: {}\n\
             database_url: sqlite://rlc.db\n\
             server:\n  listen: 127.0.0.1:{port}\n  token_env: RLC_OPS_TOKEN\n",
            prom.port,
            remote.url()
        ),
    )
    .unwrap();
    let log = d.join(format!("serve-{port}.log"));
    let proc = Proc::spawn(
        Command::new(env!("CARGO_BIN_EXE_rlc"))
            .args(["serve", "--poll-secs", "1", "--config"])
            .arg(d.join("rlc.yaml"))
            .args(extra)
            .env("RLC_OPS_TOKEN", TOKEN)
            .env_remove("RUST_LOG")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap()),
    )
    .unwrap();
    Daemon { proc, port, log }
}

impl Daemon {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap()
    }

    fn ready(&self) -> Value {
        let mut last = None;
        wait_for("rlc serve ready", Duration::from_secs(60), || {
            last = http(self.port, "GET", "/readyz", None);
            last.as_ref().is_some_and(|(s, _)| *s == 200)
        });
        json(&last.unwrap().1)
    }

    /// Triggers a run and waits until it is in its history pull (held by `prom`): a pull of
    /// its own, or the pull `rlc serve` starts at start, still held, whose result the run
    /// waits for and shares.
    fn run_until_held(&self, prom: &HeldPrometheus) -> String {
        let before = prom.held();
        let (s, body) = http(self.port, "POST", "/v1/runs", Some(TOKEN)).unwrap();
        assert_eq!(s, 202, "{body}");
        let uid = json(&body)["run_uid"].as_str().unwrap().to_string();
        wait_for("the run's history pull", Duration::from_secs(60), || {
            prom.held() > before
                || (before > 0
                    && http(self.port, "GET", &format!("/v1/runs/{uid}"), None)
                        .is_some_and(|(_, b)| b.contains("\"state\":\"running\"")))
        });
        uid
    }
}

fn repo() -> GitRemote {
    let files = test_support::git::minimal_repo_files(&[("pay", "web", 100.0)]);
    let refs: Vec<(&str, &str)> = files
        .iter()
        .map(|(a, b)| (a.as_str(), b.as_str()))
        .collect();
    GitRemote::new("main", &refs).unwrap()
}

/// Every line of a JSON log, parsed.
fn json_lines(log: &str) -> Vec<Value> {
    log.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

#[test]
fn readyz_logs_and_sigterm_finishing_the_running_cycle() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let prom = HeldPrometheus::start();
    let remote = repo();
    let mut daemon = start(d, &prom, &remote, &["--log-format", "json"]);

    // Ready: config loaded, the SQLite store answering, and leader (a single instance).
    let r = daemon.ready();
    assert_eq!(r["ready"], true, "{r}");
    assert_eq!(r["checks"]["config"]["ok"], true, "{r}");
    assert_eq!(r["checks"]["store"]["detail"], "sqlite", "{r}");
    assert_eq!(r["checks"]["role"]["detail"], "leader", "{r}");
    assert_eq!(
        http(daemon.port, "GET", "/healthz", None).unwrap(),
        (200, "ok\n".to_string())
    );

    // The store file vanishes: alive, not ready, and the reason says why.
    let db = d.join("rlc.db");
    std::fs::rename(&db, d.join("rlc.db.moved")).unwrap();
    let (s, body) = http(daemon.port, "GET", "/readyz", None).unwrap();
    assert_eq!(s, 503, "{body}");
    let r = json(&body);
    assert_eq!(r["ready"], false);
    assert_eq!(r["checks"]["store"]["ok"], false, "{r}");
    assert!(
        r["reason"]
            .as_str()
            .unwrap()
            .starts_with("store: sqlite unreachable"),
        "{r}"
    );
    assert_eq!(http(daemon.port, "GET", "/healthz", None).unwrap().0, 200);
    std::fs::rename(d.join("rlc.db.moved"), &db).unwrap();
    daemon.ready();

    // A run is in its history pull when SIGTERM comes; the history answers afterwards and
    // the run finishes within the grace (20 s default): exit 0, the run logged as finished.
    let uid = daemon.run_until_held(&prom);
    daemon.proc.signal(libc::SIGTERM);
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        daemon.proc.0.try_wait().unwrap().is_none(),
        "rlc serve exited with a run in flight:\n{}",
        daemon.log()
    );
    prom.answer_all();
    let st = daemon
        .proc
        .wait_exit(Duration::from_secs(60))
        .expect("exit after SIGTERM");
    let log = daemon.log();
    assert_eq!(st.code(), Some(0), "{log}");
    assert!(!log.contains('\u{1b}'), "colour escapes in a file:\n{log}");
    let lines = json_lines(&log);
    let msg = |m: &str| {
        lines
            .iter()
            .filter(|l| l["fields"]["message"] == m)
            .collect::<Vec<_>>()
    };
    // The start line says where it listens and what it works on, at INFO by default, and
    // no secret.
    let started = msg("rlc serve listening");
    assert_eq!(started.len(), 1, "{log}");
    let f = &started[0]["fields"];
    assert_eq!(started[0]["level"], "INFO");
    assert_eq!(f["listen"], format!("127.0.0.1:{}", daemon.port), "{f}");
    assert_eq!(f["store"], "sqlite://rlc.db", "{f}");
    assert_eq!(f["schedule"], "none", "{f}");
    assert_eq!(f["config_repo"], remote.url(), "{f}");
    assert!(!log.contains(TOKEN), "{log}");
    let finished = msg("run finished");
    assert_eq!(finished.len(), 1, "{log}");
    assert_eq!(finished[0]["fields"]["run_uid"], uid.as_str(), "{log}");
    let stopped = msg("scheduler stopped");
    assert_eq!(stopped.len(), 1, "{log}");
    assert_eq!(stopped[0]["fields"]["abandoned"], false, "{log}");
}

#[test]
fn sigterm_abandons_a_run_still_going_after_the_grace_and_exits_0() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let prom = HeldPrometheus::start();
    let remote = repo();
    let mut daemon = start(d, &prom, &remote, &["--shutdown-grace-ms", "1000"]);
    daemon.ready();
    let uid = daemon.run_until_held(&prom);
    daemon.proc.signal(libc::SIGTERM);
    // The history pull would hang for 10 minutes; the grace is 1 s.
    let st = daemon
        .proc
        .wait_exit(Duration::from_secs(60))
        .expect("exit after SIGTERM within the grace");
    let log = daemon.log();
    assert_eq!(st.code(), Some(0), "{log}");
    // Text logs at INFO by default, without colours on a file.
    assert!(!log.contains('\u{1b}'), "{log}");
    assert!(
        log.contains(" INFO ") && log.contains("rlc serve listening"),
        "{log}"
    );
    let line = log
        .lines()
        .find(|l| l.contains("the run was abandoned"))
        .unwrap_or_else(|| panic!("no abandonment logged:\n{log}"));
    assert!(line.contains(&uid), "{line}");
    assert!(!log.contains("run finished"), "{log}");
    assert!(log.contains("scheduler stopped abandoned=true"), "{log}");
    // Nothing was committed by the abandoned run.
    assert_eq!(remote.commit_count("main").unwrap(), 1);
}
