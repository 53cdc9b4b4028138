//! An overloadable service and an open-loop load by criticality tier, shared by the overload
//! end-to-end tests and the side-by-side benchmark: a Python HTTP server with a fixed pool of
//! workers (requests beyond them wait for one, as in any thread-pool server), and paced
//! requests of one tier each in its own task, every answer logged.

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::process::Proc;

/// `pool.py PORT WORKERS SERVICE_MS`: each GET takes a worker for the service time;
/// `POST /service?ms=N` changes the service time.
const POOL: &str = r#"
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
        service[0] = float(parse_qs(urlparse(self.path).query)["ms"][0]) / 1000.0
        self.answer(b"set\n")

    def log_message(self, *args):
        pass

class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 4096

Server(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"#;

/// Starts the pool service on `port` with `workers` workers taking `service_ms` a request
/// (its script and log in `dir`).
pub fn spawn_pool(dir: &Path, port: u16, workers: usize, service_ms: u64) -> Proc {
    let script = dir.join("pool.py");
    std::fs::write(&script, POOL).expect("write pool.py");
    let log = std::fs::File::create(dir.join("py-pool.log")).expect("create py-pool.log");
    Proc::spawn(
        Command::new("/usr/bin/python3")
            .arg(&script)
            .args([
                port.to_string(),
                workers.to_string(),
                service_ms.to_string(),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::from(log)),
    )
    .expect("start python3")
}

/// One answer: the tier's index (0 CRITICAL, 1 SHEDDABLE), the status (0: none within the
/// client's 10 s), the latency and when the request was sent.
pub type Answer = (usize, u16, Duration, Instant);

/// Sends `rps` requests a second (read before each: it may change) of caller `gw` and tier
/// `tier` (0 CRITICAL, 1 SHEDDABLE) to `url` until `stop`, each in its own task, logging
/// every answer into `log`.
pub fn paced(
    url: String,
    tier: usize,
    rps: Arc<Mutex<f64>>,
    log: Arc<Mutex<Vec<Answer>>>,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .pool_max_idle_per_host(1024)
            .build()
            .expect("a client");
        let header = ["CRITICAL", "SHEDDABLE"][tier];
        let mut next = Instant::now();
        while !stop.load(Ordering::Relaxed) {
            let rate = *rps.lock().expect("rate");
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
                log.lock()
                    .expect("log")
                    .push((tier, status, t0.elapsed(), t0));
            });
        }
    })
}
