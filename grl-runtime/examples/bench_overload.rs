//! Overload protection side by side: the same overloaded service behind `grl sidecar` with no
//! concurrency limit, with a fixed one and with `auto`, in one run.
//!
//! ```text
//! cargo build --release -p grl-runtime --bin grl --example bench_overload
//! target/release/examples/bench_overload --grl target/release/grl [--secs 15]
//! ```
//!
//! The service is Python's threading HTTP server with a pool of 4 workers taking 20 ms a
//! request (a capacity of 200 requests/s); requests beyond the workers wait for one, as in
//! any thread-pool server. It is offered 120 requests/s of CRITICAL traffic and 240 of
//! SHEDDABLE (open loop: each request its own task, 10 s client timeout), for `--secs`; then
//! the service takes 60 ms a request (a capacity of 67/s) for `--secs` more. For each variant
//! and phase: CRITICAL requests answered 200 per second and their share, CRITICAL p50 and
//! p99 latency (every CRITICAL request, refused ones included), all 200s per second
//! (goodput). The first 3 s of each phase are left out (the change settling). Output: a
//! Markdown table (docs/grl-architecture.md, "Overload protection").

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use test_support::process::{free_port, Proc};
use test_support::wait::wait_up;

const POOL: &str = r#"
import socket, sys, threading, time
from http.server import ThreadingHTTPServer, BaseHTTPRequestHandler
from urllib.parse import urlparse, parse_qs

workers = threading.Semaphore(4)
service = [0.020]

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def setup(self):
        super().setup()
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def answer(self, body):
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        with workers:
            time.sleep(service[0])
        self.answer(b"ok\n")

    def do_POST(self):
        service[0] = float(parse_qs(urlparse(self.path).query)["ms"][0]) / 1000.0
        self.answer(b"set\n")

    def log_message(self, *args):
        pass

class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 4096

Server(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"#;

/// (tier: 0 CRITICAL, 1 SHEDDABLE; status, 0 without an answer; latency; sent at).
type Answer = (usize, u16, Duration, Instant);

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn spawn_pool(dir: &Path, port: u16) -> Proc {
    let script = dir.join("pool.py");
    std::fs::write(&script, POOL).unwrap();
    Proc::spawn(
        Command::new("python3")
            .arg(&script)
            .arg(port.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    )
    .unwrap()
}

fn spawn_sidecar(grl: &Path, port: u16, admin: u16, upstream: &str, limit: &str) -> Proc {
    Proc::spawn(
        Command::new(grl)
            .args(["sidecar", "--listen", &format!("127.0.0.1:{port}")])
            .args(["--admin-listen", &format!("127.0.0.1:{admin}")])
            .args(["--upstream", upstream, "--service", "payments"])
            // No aggregator answers: quotas fail open, only the concurrency limit acts.
            .args(["--aggregator", &format!("http://127.0.0.1:{}", free_port())])
            .args(["--concurrency-limit", limit, "--queue-timeout-ms", "100"])
            .args(["--upstream-timeout-ms", "10000"])
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    )
    .unwrap()
}

/// Sends `rps` requests a second of `tier` to `url` until `stop`, logging every answer.
fn paced(
    url: String,
    tier: usize,
    rps: f64,
    log: Arc<Mutex<Vec<Answer>>>,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .pool_max_idle_per_host(1024)
            .build()
            .unwrap();
        let header = ["CRITICAL", "SHEDDABLE"][tier];
        let mut next = Instant::now();
        while !stop.load(Ordering::Relaxed) {
            next += Duration::from_secs_f64(1.0 / rps);
            tokio::time::sleep_until(next.into()).await;
            let (http, url, log) = (http.clone(), url.clone(), log.clone());
            tokio::spawn(async move {
                let t0 = Instant::now();
                let status = match http
                    .get(&url)
                    .header("rpc-caller", "gw")
                    .header("rpc-criticality", header)
                    .send()
                    .await
                {
                    Ok(r) => r.status().as_u16(),
                    Err(_) => 0,
                };
                log.lock().unwrap().push((tier, status, t0.elapsed(), t0));
            });
        }
    })
}

/// One phase's figures: CRITICAL 200s/s, their share, CRITICAL p50 and p99 (ms), goodput.
fn figures(answers: &[Answer], from: Instant, to: Instant) -> (f64, f64, f64, f64, f64) {
    let secs = to.duration_since(from).as_secs_f64();
    let inside: Vec<&Answer> = answers.iter().filter(|a| a.3 >= from && a.3 < to).collect();
    let crit: Vec<&&Answer> = inside.iter().filter(|a| a.0 == 0).collect();
    let crit_ok = crit.iter().filter(|a| a.1 == 200).count() as f64;
    let mut ms: Vec<f64> = crit.iter().map(|a| a.2.as_secs_f64() * 1e3).collect();
    ms.sort_by(f64::total_cmp);
    let pct = |p: usize| {
        ms.get((ms.len() * p / 100).min(ms.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0.0)
    };
    let ok = inside.iter().filter(|a| a.1 == 200).count() as f64;
    (
        crit_ok / secs,
        crit_ok / crit.len().max(1) as f64,
        pct(50),
        pct(99),
        ok / secs,
    )
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let grl = PathBuf::from(arg("--grl").unwrap_or_else(|| "target/release/grl".into()));
    let secs: u64 = arg("--secs").map_or(15, |s| s.parse().expect("--secs N"));
    let dir = tempfile::tempdir().unwrap();
    println!("| variant | phase | CRITICAL 200/s | CRITICAL answered | CRITICAL p50 | CRITICAL p99 | goodput |");
    println!("|---|---|---|---|---|---|---|");
    for (name, limit) in [("no limit", "off"), ("fixed 8", "8"), ("auto", "auto")] {
        let py_port = free_port();
        let _py = spawn_pool(dir.path(), py_port);
        let upstream = format!("http://127.0.0.1:{py_port}");
        wait_up(&format!("{upstream}/")).await;
        let (port, admin) = (free_port(), free_port());
        let _sidecar = spawn_sidecar(&grl, port, admin, &upstream, limit);
        wait_up(&format!("http://127.0.0.1:{admin}/healthz")).await;
        let url = format!("http://127.0.0.1:{port}/");
        let log: Arc<Mutex<Vec<Answer>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let tasks = [
            paced(url.clone(), 0, 120.0, log.clone(), stop.clone()),
            paced(url.clone(), 1, 240.0, log.clone(), stop.clone()),
        ];
        let settle = Duration::from_secs(3);
        let a0 = Instant::now();
        tokio::time::sleep(Duration::from_secs(secs)).await;
        let b0 = Instant::now();
        reqwest::Client::new()
            .post(format!("{upstream}/service?ms=60"))
            .send()
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_secs(secs)).await;
        let end = Instant::now();
        stop.store(true, Ordering::Relaxed);
        for t in tasks {
            t.await.unwrap();
        }
        // The answers still on their way (at most the client's timeout).
        tokio::time::sleep(Duration::from_secs(10)).await;
        let answers = log.lock().unwrap().clone();
        for (phase, from, to) in [("20 ms", a0 + settle, b0), ("60 ms", b0 + settle, end)] {
            let (c_rate, c_share, p50, p99, goodput) = figures(&answers, from, to);
            println!(
                "| {name} | {phase} | {c_rate:.1} | {:.1} % | {p50:.0} ms | {p99:.0} ms | {goodput:.1}/s |",
                c_share * 100.0
            );
        }
    }
}
