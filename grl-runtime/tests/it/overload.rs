//! Overload protection end to end: `grl sidecar --concurrency-limit auto` before a Python
//! service of 4 workers taking 20 ms a request (a capacity of 200 requests/s), offered
//! 120 requests/s of CRITICAL traffic and 240 of SHEDDABLE. Without protection the service's
//! queue grows without end; with it, the CRITICAL requests are answered at once, the sidecar
//! refuses the SHEDDABLE excess with 503, and the service stays busy. Then the service gets
//! three times slower, then the load falls below its capacity.

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use test_support::process::Proc;

use super::sidecar::lone_sidecar;
use super::{free_port, log_file, wait_up};

/// A service of a fixed pool of workers: each request takes one worker for the service
/// time (`POST /service?ms=N` changes it); requests beyond the workers wait for one, as in
/// any thread-pool server.
const PY_POOL: &str = r#"
import socket, sys, threading, time
from http.server import ThreadingHTTPServer, BaseHTTPRequestHandler
from urllib.parse import urlparse, parse_qs

workers = threading.Semaphore(int(sys.argv[2]))
service = [float(sys.argv[3]) / 1000.0]

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def setup(self):
        super().setup()
        # The head and the body are two writes: without this, Nagle holds the body back
        # until the client's delayed ACK (40 ms) of the head.
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def answer(self, body):
        self.send_response(200)
        self.send_header("content-type", "text/plain")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        with workers:
            time.sleep(service[0])
        self.answer(b"ok\n")

    def do_POST(self):
        q = parse_qs(urlparse(self.path).query)
        service[0] = float(q["ms"][0]) / 1000.0
        self.answer(b"set\n")

    def log_message(self, *args):
        pass

class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024

Server(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"#;

fn spawn_pool(dir: &Path, port: u16, workers: usize, service_ms: u64) -> Proc {
    let script = dir.join("pool.py");
    std::fs::write(&script, PY_POOL).unwrap();
    Proc::spawn(
        Command::new("/usr/bin/python3")
            .arg(&script)
            .args([
                port.to_string(),
                workers.to_string(),
                service_ms.to_string(),
            ])
            .stdout(Stdio::null())
            .stderr(log_file(dir, "py-pool")),
    )
    .unwrap()
}

/// One answer: the tier index (0 CRITICAL, 1 SHEDDABLE), the status (0: no answer) and the
/// latency.
type Answer = (usize, u16, Duration);

/// Sends `rps` requests a second of `tier` (0 CRITICAL, 1 SHEDDABLE) to `url` until `stop`,
/// each its own task, recording every answer.
fn paced(
    url: String,
    tier: usize,
    rps: Arc<Mutex<f64>>,
    log: Arc<Mutex<Vec<Answer>>>,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .pool_max_idle_per_host(512)
            .build()
            .unwrap();
        let header = ["CRITICAL", "SHEDDABLE"][tier];
        let mut next = Instant::now();
        while !stop.load(Ordering::Relaxed) {
            let rate = *rps.lock().unwrap();
            next += Duration::from_secs_f64(1.0 / rate);
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
                log.lock().unwrap().push((tier, status, t0.elapsed()));
            });
        }
    })
}

/// Of the answers of `tier`: (count, share answered 200, p99 latency in ms, 503s, others).
fn summary(answers: &[Answer], tier: usize) -> (usize, f64, f64, usize, usize) {
    let mine: Vec<&Answer> = answers.iter().filter(|a| a.0 == tier).collect();
    let ok = mine.iter().filter(|a| a.1 == 200).count();
    let overloaded = mine.iter().filter(|a| a.1 == 503).count();
    let mut ms: Vec<f64> = mine.iter().map(|a| a.2.as_secs_f64() * 1e3).collect();
    ms.sort_by(f64::total_cmp);
    let p99 = ms
        .get((ms.len() * 99 / 100).min(ms.len().saturating_sub(1)))
        .copied()
        .unwrap_or(0.0);
    let n = mine.len();
    (
        n,
        ok as f64 / n.max(1) as f64,
        p99,
        overloaded,
        n - ok - overloaded,
    )
}

/// The answers logged over the next `secs` seconds (the log emptied first).
async fn measure(log: &Mutex<Vec<Answer>>, secs: u64) -> Vec<Answer> {
    log.lock().unwrap().clear();
    tokio::time::sleep(Duration::from_secs(secs)).await;
    std::mem::take(&mut *log.lock().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overloaded_service_keeps_its_critical_traffic() {
    let dir = tempfile::tempdir().unwrap();
    let py_port = free_port();
    let py = spawn_pool(dir.path(), py_port, 4, 20);
    let upstream = format!("http://127.0.0.1:{py_port}");
    wait_up(&format!("{upstream}/")).await;
    let side = lone_sidecar(
        &upstream,
        &["--concurrency-limit", "auto", "--queue-timeout-ms", "100"],
        vec![py],
    )
    .await;
    let (port, admin) = (side.port, side.admin);
    let url = format!("http://127.0.0.1:{port}/");

    let stop = Arc::new(AtomicBool::new(false));
    let log: Arc<Mutex<Vec<Answer>>> = Arc::default();
    let crit_rps = Arc::new(Mutex::new(120.0));
    let shed_rps = Arc::new(Mutex::new(240.0));
    let tasks = [
        paced(url.clone(), 0, crit_rps.clone(), log.clone(), stop.clone()),
        paced(url.clone(), 1, shed_rps.clone(), log.clone(), stop.clone()),
    ];
    let http = reqwest::Client::new();

    // Overloaded: 360 requests/s at a capacity of 200.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let a = measure(&log, 10).await;
    let (cn, c_ok, c_p99, c_503, c_other) = summary(&a, 0);
    let (sn, s_ok, s_p99, s_503, s_other) = summary(&a, 1);
    let goodput = a.iter().filter(|x| x.1 == 200).count() as f64 / 10.0;
    eprintln!("overloaded: CRITICAL {cn} ok {c_ok:.4} p99 {c_p99:.0} ms 503 {c_503} other {c_other}; SHEDDABLE {sn} ok {s_ok:.3} p99 {s_p99:.0} ms 503 {s_503} other {s_other}; goodput {goodput:.1}/s");
    let metrics = super::sidecar::admin_metrics(admin).await;
    eprintln!(
        "{}",
        metrics
            .lines()
            .filter(|l| l.starts_with("grl_sidecar_concurrency")
                || l.starts_with("grl_sidecar_overload"))
            .collect::<Vec<_>>()
            .join("\n")
    );

    // Three times slower (a capacity of 67 requests/s, below the CRITICAL traffic alone).
    http.post(format!("{upstream}/service?ms=60"))
        .send()
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let b = measure(&log, 5).await;
    let (bn, b_ok, b_p99, b_503, b_other) = summary(&b, 0);
    eprintln!("slower: CRITICAL {bn} ok {b_ok:.3} p99 {b_p99:.0} ms 503 {b_503} other {b_other}");
    let mut ok_ms: Vec<f64> = b
        .iter()
        .filter(|x| x.0 == 0 && x.1 == 200)
        .map(|x| x.2.as_secs_f64() * 1e3)
        .collect();
    ok_ms.sort_by(f64::total_cmp);
    let pct = |p: usize| ok_ms.get(ok_ms.len() * p / 100).copied().unwrap_or(0.0);
    eprintln!(
        "slower, CRITICAL answered 200: p50 {:.0} p90 {:.0} p99 {:.0} ms",
        pct(50),
        pct(90),
        pct(99)
    );
    eprintln!(
        "{}",
        super::sidecar::admin_metrics(admin)
            .await
            .lines()
            .filter(|l| l.starts_with("grl_sidecar_concurrency_limit"))
            .collect::<Vec<_>>()
            .join(" ")
    );

    // Fast again, and 150 requests/s in all: below the capacity.
    http.post(format!("{upstream}/service?ms=20"))
        .send()
        .await
        .unwrap();
    *crit_rps.lock().unwrap() = 100.0;
    *shed_rps.lock().unwrap() = 50.0;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let c = measure(&log, 8).await;
    let refused = c.iter().filter(|x| x.1 != 200).count();
    eprintln!("below capacity: {} answers, {refused} not 200", c.len());
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }

    assert!(c_ok >= 0.99, "CRITICAL answered 200: {c_ok:.4}");
    assert!(c_p99 <= 250.0, "CRITICAL p99 {c_p99:.0} ms");
    assert!(goodput >= 170.0, "goodput {goodput:.1}/s");
    assert!(s_503 > 0, "the SHEDDABLE excess is refused with 503");
    assert!(
        b_p99 <= 250.0,
        "CRITICAL p99 {b_p99:.0} ms after the slow-down"
    );
    assert_eq!(refused, 0, "below capacity nothing is refused");
    assert!(
        metrics.contains("grl_sidecar_overload_refusals_total{criticality=\"SHEDDABLE\""),
        "{metrics}"
    );
}
