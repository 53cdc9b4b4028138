//! `grl sidecar` in front of services in another language: a Python HTTP service and a Python
//! gRPC service (grpcio from PyPI, in a test venv), real `grl` controller, aggregator and
//! sidecar processes on loopback.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use test_support::process::{free_port, Proc};

pub(crate) use super::front::{
    admin_metrics, grpcio_python, lone_sidecar, run_py, spawn_sidecar, write_script, Running,
};
use super::{eventually, log_file, push_config, spawn_aggregator, spawn_controller, wait_up};

/// A Python HTTP/1.1 service (keep-alive) on a port or a Unix socket (an absolute path):
/// answers every method with `ok METHOD PATH read=N`, N the request body's bytes read;
/// `/slow?ms=N` answers after N ms; `/big?mb=N` answers N MiB (written 64 KiB at a time);
/// `?close=1` closes the connection right after the answer without saying so (no
/// `connection: close`), as a server that drops kept-alive connections does; `/headers`
/// answers the request's headers, one `name: value` line each.
const PY_HTTP: &str = r#"
import sys, time
from http.server import ThreadingHTTPServer, BaseHTTPRequestHandler
from urllib.parse import urlparse, parse_qs

class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a):
        pass
    def answer(self):
        u = urlparse(self.path)
        q = parse_qs(u.query)
        n = int(self.headers.get("content-length") or 0)
        read = 0
        while read < n:
            chunk = self.rfile.read(min(65536, n - read))
            if not chunk:
                break
            read += len(chunk)
        if u.path == "/slow":
            time.sleep(int(q.get("ms", ["1000"])[0]) / 1000)
        if u.path == "/big":
            size = int(q.get("mb", ["1"])[0]) << 20
            self.send_response(200)
            self.send_header("content-type", "application/octet-stream")
            self.send_header("content-length", str(size))
            self.end_headers()
            block = b"x" * 65536
            try:
                for _ in range(size // 65536):
                    self.wfile.write(block)
            except OSError:
                self.close_connection = True
            return
        body = ("ok %s %s read=%d\n" % (self.command, u.path, read)).encode()
        if u.path == "/headers":
            body = "".join("%s: %s\n" % (k.lower(), v) for k, v in self.headers.items()).encode()
        self.send_response(200)
        self.send_header("content-type", "text/plain")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        if q.get("close") == ["1"]:
            self.close_connection = True
    do_GET = do_POST = do_PUT = do_DELETE = answer

if sys.argv[1].startswith("/"):
    import socketserver
    class U(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
        daemon_threads = True
        def get_request(self):
            conn, _ = self.socket.accept()
            return conn, ("unix", 0)
    U(sys.argv[1], H).serve_forever()
ThreadingHTTPServer.daemon_threads = True
ThreadingHTTPServer.request_queue_size = 256
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"#;

/// A Python gRPC service: `/test.Echo/Say` (bytes in, bytes out) answers `hello CALLER REQ`
/// and sets the trailing metadata `x-echo-trailer: yes`.
const PY_GRPC_SERVER: &str = r#"
import sys, grpc
from concurrent import futures

def say(req, ctx):
    ctx.set_trailing_metadata((("x-echo-trailer", "yes"),))
    md = dict(ctx.invocation_metadata())
    return b"hello " + md.get("rpc-caller", "").encode() + b" " + req

handler = grpc.method_handlers_generic_handler("test.Echo", {"Say": grpc.unary_unary_rpc_method_handler(say)})
server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
server.add_generic_rpc_handlers((handler,))
server.add_insecure_port("127.0.0.1:" + sys.argv[1])
server.start()
print("ready", flush=True)
server.wait_for_termination()
"#;

/// A Python gRPC client: calls `/test.Echo/Say` as CALLER for SECS seconds through ADDR and
/// prints the status codes it got, the last reply, trailer and pushback, as JSON.
const PY_GRPC_CLIENT: &str = r#"
import sys, json, time, grpc
addr, caller, secs = sys.argv[1], sys.argv[2], float(sys.argv[3])
ch = grpc.insecure_channel(addr, options=[("grpc.enable_http_proxy", 0)])
say = ch.unary_unary("/test.Echo/Say")
out = {"codes": {}, "reply": None, "trailer": None, "pushback": None}
end = time.time() + secs
while time.time() < end:
    try:
        resp, call = say.with_call(b"x", metadata=(("rpc-caller", caller),), timeout=5)
        out["codes"]["OK"] = out["codes"].get("OK", 0) + 1
        out["reply"] = resp.decode()
        out["trailer"] = dict(call.trailing_metadata()).get("x-echo-trailer")
    except grpc.RpcError as e:
        c = e.code().name
        out["codes"][c] = out["codes"].get(c, 0) + 1
        if c == "RESOURCE_EXHAUSTED":
            out["pushback"] = dict(e.trailing_metadata() or ()).get("grpc-retry-pushback-ms")
    time.sleep(0.02)
print(json.dumps(out))
"#;

/// The Python HTTP service on `port`.
pub(crate) fn spawn_py_http(dir: &Path, port: u16) -> Proc {
    spawn_py_http_on(dir, &port.to_string())
}

/// The Python HTTP service on a port or a Unix socket path.
fn spawn_py_http_on(dir: &Path, at: &str) -> Proc {
    let script = write_script(dir, "service.py", PY_HTTP);
    Proc::spawn(
        Command::new("/usr/bin/python3")
            .arg(script)
            .arg(at)
            .stdout(Stdio::null())
            .stderr(log_file(dir, &format!("py-http-{}", at.replace('/', "_")))),
    )
    .unwrap()
}

/// Pushes payments' `buckets` as config `version` to the controller at `ctl`.
pub(crate) async fn push_payments(ctl: &str, version: &str, buckets: Value) {
    let doc =
        json!({"version": version, "services": [{"service": "payments", "buckets": buckets}]});
    push_config(&reqwest::Client::new(), ctl, &doc).await;
}

/// [`lone_sidecar`] in front of the Python HTTP service, both answering.
async fn py_sidecar(extra: &[&str]) -> Running {
    let dir = tempfile::tempdir().unwrap();
    let py_port = free_port();
    let py = spawn_py_http(dir.path(), py_port);
    wait_up(&format!("http://127.0.0.1:{py_port}/")).await;
    let mut running = lone_sidecar(&format!("http://127.0.0.1:{py_port}"), extra, vec![py]).await;
    running._dirs.push(dir);
    running
}

/// Waits until the sidecar behind `admin` has fresh drop ratios (it stopped failing open).
pub(crate) async fn wait_fresh(admin: u16) {
    let http = reqwest::Client::new();
    eventually("sidecar has fresh drop ratios", || {
        let http = http.clone();
        async move {
            match http
                .get(format!("http://127.0.0.1:{admin}/metrics"))
                .send()
                .await
            {
                Ok(r) => r
                    .text()
                    .await
                    .is_ok_and(|t| t.contains("grl_client_failing_open{service=\"payments\"} 0")),
                Err(_) => false,
            }
        }
    })
    .await;
}

/// A controller with payments' `buckets`, one aggregator, the Python HTTP service and `n`
/// sidecars in front of it (`extra` their flags), all answering with fresh drop ratios.
pub(crate) struct Fleet {
    pub dir: tempfile::TempDir,
    /// The controller's base URL.
    pub controller: String,
    /// (port, admin port) of each sidecar.
    pub ports: Vec<(u16, u16)>,
    pub aggregator: Proc,
    pub sidecars: Vec<Proc>,
    /// The controller and the service.
    pub others: Vec<Proc>,
}

impl Fleet {
    pub(crate) async fn start(buckets: Value, n: usize, extra: &[&str]) -> Fleet {
        let dir = tempfile::tempdir().unwrap();
        let (ctl_port, agg_port, py_port) = (free_port(), free_port(), free_port());
        let ctl_url = format!("http://127.0.0.1:{ctl_port}");
        let agg_url = format!("http://127.0.0.1:{agg_port}");
        let ctl = spawn_controller(ctl_port, &dir.path().join("state"), dir.path(), &[]);
        wait_up(&format!("{ctl_url}/v1/status")).await;
        push_payments(&ctl_url, "v1", buckets).await;
        let aggregator = spawn_aggregator(agg_port, &ctl_url, "agg-z1", dir.path());
        wait_up(&format!("{agg_url}/healthz")).await;
        let py = spawn_py_http(dir.path(), py_port);
        let upstream = format!("http://127.0.0.1:{py_port}");
        let mut sidecars = Vec::new();
        let mut ports = Vec::new();
        for _ in 0..n {
            let (port, admin) = (free_port(), free_port());
            sidecars.push(spawn_sidecar(
                dir.path(),
                port,
                admin,
                &upstream,
                &[&agg_url],
                extra,
            ));
            ports.push((port, admin));
        }
        for &(port, admin) in &ports {
            wait_up(&format!("http://127.0.0.1:{admin}/healthz")).await;
            wait_up(&format!("http://127.0.0.1:{port}/")).await;
            wait_fresh(admin).await;
        }
        Fleet {
            dir,
            controller: ctl_url,
            ports,
            aggregator,
            sidecars,
            others: vec![ctl, py],
        }
    }
}

/// Counts of one paced stream of requests.
#[derive(Default)]
pub(crate) struct Counts {
    ok: AtomicU64,
    limited: AtomicU64,
    other: AtomicU64,
}

/// Sends `rps` requests per second as `caller` to `url` until `stop`, counting the answers
/// into `counts` (read and reset by the test); each request is its own task, so a slow answer
/// does not slow the pace.
fn paced(
    url: String,
    caller: &'static str,
    rps: f64,
    counts: Arc<Counts>,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<()> {
    paced_with(url, caller, &[], rps, counts, stop)
}

/// [`paced`] with `extra` headers on every request.
pub(crate) fn paced_with(
    url: String,
    caller: &'static str,
    extra: &[(&'static str, &'static str)],
    rps: f64,
    counts: Arc<Counts>,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<()> {
    let extra = extra.to_vec();
    tokio::spawn(async move {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()
            .unwrap();
        let mut iv = tokio::time::interval(Duration::from_secs_f64(1.0 / rps));
        iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        while !stop.load(Ordering::Relaxed) {
            iv.tick().await;
            let (http, url, counts) = (http.clone(), url.clone(), counts.clone());
            let extra = extra.clone();
            tokio::spawn(async move {
                let mut req = http
                    .get(&url)
                    .header("rpc-caller", caller)
                    .header("rpc-procedure", "charge");
                for (k, v) in extra {
                    req = req.header(k, v);
                }
                let r = req.send().await;
                let c = match r.map(|r| r.status().as_u16()) {
                    Ok(200) => &counts.ok,
                    Ok(429) => &counts.limited,
                    _ => &counts.other,
                };
                c.fetch_add(1, Ordering::Relaxed);
            });
        }
    })
}

pub(crate) fn take(c: &Counts) -> (u64, u64, u64) {
    (
        c.ok.swap(0, Ordering::Relaxed),
        c.limited.swap(0, Ordering::Relaxed),
        c.other.swap(0, Ordering::Relaxed),
    )
}

/// Three sidecars in front of one Python service, one aggregator and one controller: caller
/// `gw` offers 1.5 times its global limit, unevenly over the three (60/30/10 %); the fleet
/// admits the limit within ±10 %, caller `web` is never refused, a refusal carries
/// `Retry-After` and the RateLimit headers, and when the aggregator dies the sidecars fail
/// open within a few seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_sidecars_hold_one_global_limit_and_fail_open_without_the_aggregator() {
    const LIMIT: f64 = 20.0;
    let fleet = Fleet::start(
        json!([{"name": "gw.charge", "caller": "gw", "procedure": "charge", "scope": "global",
                "limit_rps": LIMIT, "mode": "enforce", "policy": "peak"}]),
        3,
        &[],
    )
    .await;
    let (ports, agg) = (fleet.ports.clone(), fleet.aggregator);
    let _fleet_rest = (fleet.dir, fleet.others, fleet.sidecars);

    // The answer comes from the Python service, through the sidecar.
    let http = reqwest::Client::new();
    let body = http
        .post(format!("http://127.0.0.1:{}/charge", ports[0].0))
        .header("rpc-caller", "web")
        .body(vec![b'x'; 100_000])
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(body, "ok POST /charge read=100000\n");

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let gw: Vec<Arc<Counts>> = (0..3).map(|_| Arc::default()).collect();
    let web: Arc<Counts> = Arc::default();
    let mut tasks = Vec::new();
    for (i, share) in [0.6, 0.3, 0.1].iter().enumerate() {
        let url = format!("http://127.0.0.1:{}/charge", ports[i].0);
        tasks.push(paced(
            url,
            "gw",
            1.5 * LIMIT * share,
            gw[i].clone(),
            stop.clone(),
        ));
    }
    let web_url = format!("http://127.0.0.1:{}/charge", ports[2].0);
    tasks.push(paced(web_url, "web", 5.0, web.clone(), stop.clone()));

    // Settle, then measure.
    tokio::time::sleep(Duration::from_secs(8)).await;
    for c in gw.iter().chain([&web]) {
        take(c);
    }
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let secs = t0.elapsed().as_secs_f64();
    let per: Vec<(u64, u64, u64)> = gw.iter().map(|c| take(c)).collect();
    let (web_ok, web_limited, web_other) = take(&web);
    let admitted: u64 = per.iter().map(|p| p.0).sum();
    let limited: u64 = per.iter().map(|p| p.1).sum();
    let failed: u64 = per.iter().map(|p| p.2).sum();
    let rate = admitted as f64 / secs;
    eprintln!("gw admitted {rate:.1} rps over the fleet (limit {LIMIT}); per sidecar ok/429/failed {per:?}");
    assert_eq!(failed, 0, "gw requests failed: {per:?}");
    assert!(
        (rate - LIMIT).abs() <= 0.1 * LIMIT,
        "gw admitted {rate:.1} rps over the fleet, limit {LIMIT} (per sidecar ok/429: {per:?}, {limited} refused)"
    );
    assert!(limited > 0, "{per:?}");
    // Every sidecar both admitted and refused: one limit over the fleet, not per node.
    assert!(per.iter().all(|p| p.0 > 0), "{per:?}");
    assert_eq!(
        (web_limited, web_other),
        (0, 0),
        "web was refused ({web_ok} ok)"
    );
    assert!(web_ok > 0);

    // A refusal: 429, Retry-After and the RateLimit headers.
    let mut seen = None;
    for _ in 0..200 {
        let r = http
            .get(format!("http://127.0.0.1:{}/charge", ports[0].0))
            .header("rpc-caller", "gw")
            .header("rpc-procedure", "charge")
            .send()
            .await
            .unwrap();
        if r.status() == 429 {
            seen = Some(r);
            break;
        }
    }
    let r = seen.expect("a 429 while gw is over its limit");
    let h = |n: &str| r.headers().get(n).map(|v| v.to_str().unwrap().to_string());
    assert_eq!(h("retry-after").as_deref(), Some("1"));
    assert_eq!(
        h("ratelimit-policy").as_deref(),
        Some("\"gw.charge\";q=20;w=1")
    );
    assert_eq!(h("ratelimit").as_deref(), Some("\"gw.charge\";r=0;t=1"));

    // The admin listener counts what the sidecar decided.
    let m = http
        .get(format!("http://127.0.0.1:{}/metrics", ports[0].1))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let sample = |name: &str| -> f64 {
        m.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} missing:\n{m}"))
    };
    assert!(sample("grl_sidecar_requests_total{protocol=\"http\",decision=\"drop\"}") > 0.0);
    assert!(sample("grl_sidecar_requests_total{protocol=\"http\",decision=\"admit\"}") > 0.0);
    assert!(sample("grl_sidecar_refusals_total{reason=\"rate_limited\"}") > 0.0);
    assert!(sample("grl_sidecar_added_latency_seconds_count") > 0.0);
    assert!(
        m.contains("grl_sidecar_info{service=\"payments\",zone=\"z1\",region=\"r1\""),
        "{m}"
    );

    // The aggregator dies: the sidecars fail open (stale drop ratios stop dropping).
    agg.kill();
    let killed = Instant::now();
    let mut open_after = None;
    while killed.elapsed() < Duration::from_secs(20) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut all = true;
        for &(_, admin) in &ports {
            let m = http
                .get(format!("http://127.0.0.1:{admin}/metrics"))
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            all &= m.contains("grl_client_failing_open{service=\"payments\"} 1");
        }
        if all {
            open_after = Some(killed.elapsed());
            break;
        }
    }
    let open_after = open_after.expect("the sidecars never failed open after the aggregator died");
    // The staleness bound is 3 s; a report tick and the polling on top.
    assert!(
        open_after < Duration::from_secs(6),
        "failed open after {open_after:?}"
    );
    // Open: gw is admitted in full.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for c in &gw {
        take(c);
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let open: Vec<(u64, u64, u64)> = gw.iter().map(|c| take(c)).collect();
    assert!(
        open.iter().all(|p| p.0 > 0 && p.1 == 0 && p.2 == 0),
        "failing open, gw ok/429/failed per sidecar: {open:?}"
    );
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
}

/// A controller serving `buckets` for payments, an aggregator, the Python gRPC service and a
/// sidecar before it, the sidecar fresh and ready: the processes (kept until dropped), the
/// sidecar's port and its admin port.
async fn grpc_fleet(dir: &Path, python: &Path, buckets: Value) -> (Vec<Proc>, u16, u16) {
    let (ctl_port, agg_port, grpc_port) = (free_port(), free_port(), free_port());
    let ctl_url = format!("http://127.0.0.1:{ctl_port}");
    let agg_url = format!("http://127.0.0.1:{agg_port}");
    let ctl = spawn_controller(ctl_port, &dir.join("state"), dir, &[]);
    wait_up(&format!("{ctl_url}/v1/status")).await;
    push_payments(&ctl_url, "v1", buckets).await;
    let agg = spawn_aggregator(agg_port, &ctl_url, "agg-z1", dir);
    wait_up(&format!("{agg_url}/healthz")).await;
    let server = write_script(dir, "server.py", PY_GRPC_SERVER);
    let srv = Proc::spawn(
        Command::new(python)
            .arg(server)
            .arg(grpc_port.to_string())
            .stdout(Stdio::null())
            .stderr(log_file(dir, "py-grpc")),
    )
    .unwrap();
    let (port, admin) = (free_port(), free_port());
    let sc = spawn_sidecar(
        dir,
        port,
        admin,
        &format!("http://127.0.0.1:{grpc_port}"),
        &[&agg_url],
        &[],
    );
    wait_up(&format!("http://127.0.0.1:{admin}/healthz")).await;
    wait_fresh(admin).await;
    let http = reqwest::Client::new();
    eventually("the gRPC upstream is up", || {
        let http = http.clone();
        async move {
            http.get(format!("http://127.0.0.1:{admin}/readyz"))
                .send()
                .await
                .is_ok_and(|r| r.status() == 200)
        }
    })
    .await;
    (vec![ctl, agg, srv, sc], port, admin)
}

/// A Python gRPC service behind a sidecar: calls pass with their trailers; a caller over its
/// limit gets RESOURCE_EXHAUSTED with `grpc-retry-pushback-ms` (never UNAVAILABLE, which
/// clients retry on their own); another caller is untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_calls_pass_with_trailers_and_an_excess_caller_gets_resource_exhausted() {
    let Some(python) =
        grpcio_python("grpc_calls_pass_with_trailers_and_an_excess_caller_gets_resource_exhausted")
    else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (_procs, port, admin) = grpc_fleet(
        dir.path(),
        &python,
        json!([{"name": "gw.say", "caller": "gw", "procedure": "/test.Echo/Say", "scope": "global",
                "limit_rps": 10.0, "mode": "enforce", "policy": "peak"}]),
    )
    .await;
    let http = reqwest::Client::new();
    let client = write_script(dir.path(), "client.py", PY_GRPC_CLIENT);
    let run = move |caller: &str, secs: &str| {
        run_py(
            &python,
            &client,
            &[&format!("127.0.0.1:{port}"), caller, secs],
        )
    };
    let gw = tokio::task::spawn_blocking({
        let run = run.clone();
        move || run("gw", "5")
    });
    let web = tokio::task::spawn_blocking(move || run("web", "5"));
    let (gw, web) = (gw.await.unwrap(), web.await.unwrap());
    let codes = |v: &Value| -> BTreeMap<String, u64> {
        serde_json::from_value(v["codes"].clone()).unwrap()
    };
    let (gwc, webc) = (codes(&gw), codes(&web));
    assert!(gwc.get("OK").copied().unwrap_or(0) > 0, "{gw}");
    assert!(
        gwc.get("RESOURCE_EXHAUSTED").copied().unwrap_or(0) > 0,
        "{gw}"
    );
    assert_eq!(
        gwc.keys()
            .filter(|k| *k != "OK" && *k != "RESOURCE_EXHAUSTED")
            .count(),
        0,
        "{gw}"
    );
    assert_eq!(gw["pushback"], "1000", "{gw}");
    assert_eq!(gw["reply"], "hello gw x", "{gw}");
    assert_eq!(gw["trailer"], "yes", "the service's trailers pass: {gw}");
    assert_eq!(
        webc.keys().collect::<Vec<_>>(),
        ["OK"],
        "web was refused: {web}"
    );
    let m = http
        .get(format!("http://127.0.0.1:{admin}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        m.contains("grl_sidecar_requests_total{protocol=\"grpc\",decision=\"drop\"}"),
        "{m}"
    );
}

/// A Python gRPC client calling `/test.Echo/Say` as `caller` with `rpc-criticality` in its
/// metadata, paced at a rate, for some seconds; prints the calls by status code.
const PY_GRPC_TIER_CLIENT: &str = r#"
import sys, json, time, grpc
addr, caller, tier, rate, secs = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), float(sys.argv[5])
ch = grpc.insecure_channel(addr, options=[("grpc.enable_http_proxy", 0)])
say = ch.unary_unary("/test.Echo/Say")
codes = {}
start = time.time()
n = 0
while time.time() < start + secs:
    try:
        say(b"x", metadata=(("rpc-caller", caller), ("rpc-criticality", tier)), timeout=5)
        codes["OK"] = codes.get("OK", 0) + 1
    except grpc.RpcError as e:
        codes[e.code().name] = codes.get(e.code().name, 0) + 1
    n += 1
    time.sleep(max(0.0, start + n / rate - time.time()))
print(json.dumps({"codes": codes, "secs": time.time() - start}))
"#;

/// Criticality through gRPC metadata: a Python gRPC service behind a sidecar, limit 30 calls/s
/// on its procedure; `gw` calls at 15/s with `rpc-criticality: CRITICAL` in its metadata,
/// `batch` at 30/s with `SHEDDABLE`. Once the mix is known, the 15 calls/s to shed fall on
/// `batch` alone: CRITICAL refusals under 1 %, `batch` keeps about 15 calls/s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_metadata_criticality_sheds_the_sheddable_calls_first() {
    let Some(python) = grpcio_python("grpc_metadata_criticality_sheds_the_sheddable_calls_first")
    else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (_procs, port, _) = grpc_fleet(
        dir.path(),
        &python,
        json!([{"name": "say", "procedure": "/test.Echo/Say", "scope": "global",
                "limit_rps": 30.0, "mode": "enforce", "policy": "peak"}]),
    )
    .await;
    let client = write_script(dir.path(), "tier_client.py", PY_GRPC_TIER_CLIENT);
    // Both callers at once for `secs`: (calls by code, seconds) of each.
    let both = |secs: &'static str| {
        let run = |caller: &'static str, tier: &'static str, rate: &'static str| {
            let (python, client) = (python.clone(), client.clone());
            tokio::task::spawn_blocking(move || {
                let addr = format!("127.0.0.1:{port}");
                let v = run_py(&python, &client, &[&addr, caller, tier, rate, secs]);
                let codes: BTreeMap<String, u64> =
                    serde_json::from_value(v["codes"].clone()).unwrap();
                (codes, v["secs"].as_f64().unwrap())
            })
        };
        let (gw, batch) = (run("gw", "CRITICAL", "15"), run("batch", "SHEDDABLE", "30"));
        async move { (gw.await.unwrap(), batch.await.unwrap()) }
    };
    // The first seconds teach the controller the mix; then the measure.
    both("5").await;
    let ((gw, _), (batch, secs)) = both("10").await;
    eprintln!("gRPC tiers: gw {gw:?}, batch {batch:?} over {secs:.1} s");
    let code = |m: &BTreeMap<String, u64>, c: &str| m.get(c).copied().unwrap_or(0);
    for m in [&gw, &batch] {
        assert!(
            m.keys().all(|k| k == "OK" || k == "RESOURCE_EXHAUSTED"),
            "{m:?}"
        );
    }
    let (g_ok, g_refused) = (code(&gw, "OK"), code(&gw, "RESOURCE_EXHAUSTED"));
    assert!(g_ok > 100, "gw {gw:?}");
    assert!(
        (g_refused as f64) < 0.01 * (g_ok + g_refused) as f64,
        "CRITICAL refused: gw {gw:?}"
    );
    let b_rate = code(&batch, "OK") as f64 / secs;
    assert!(
        (b_rate - 15.0).abs() <= 4.0,
        "batch admitted {b_rate:.1} calls/s: {batch:?}"
    );
}

/// SIGTERM with requests in flight: they finish with the service's answer, new connections
/// are refused, the sidecar exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_requests_in_flight_and_exits_0() {
    let dir = tempfile::tempdir().unwrap();
    let (py_port, port, admin) = (free_port(), free_port(), free_port());
    let _py = spawn_py_http(dir.path(), py_port);
    // No aggregator answers: the sidecar fails open and proxies everything.
    let dead = format!("http://127.0.0.1:{}", free_port());
    let mut sc = spawn_sidecar(
        dir.path(),
        port,
        admin,
        &format!("http://127.0.0.1:{py_port}"),
        &[&dead],
        &["--shutdown-grace-ms", "10000"],
    );
    wait_up(&format!("http://127.0.0.1:{admin}/healthz")).await;
    wait_up(&format!("http://127.0.0.1:{py_port}/")).await;
    let http = reqwest::Client::new();
    let inflight: Vec<_> = (0..3)
        .map(|_| {
            // A connection each: the drain must wait for every one.
            let http = reqwest::Client::builder()
                .pool_max_idle_per_host(0)
                .build()
                .unwrap();
            tokio::spawn(async move {
                let r = http
                    .get(format!("http://127.0.0.1:{port}/slow?ms=2000"))
                    .send()
                    .await?;
                let status = r.status().as_u16();
                Ok::<_, reqwest::Error>((status, r.text().await?))
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    sc.signal(libc::SIGTERM);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        sc.0.try_wait().unwrap().is_none(),
        "exited with requests in flight"
    );
    assert!(
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err(),
        "a new connection was accepted after SIGTERM"
    );
    for t in inflight {
        let (status, body) = t.await.unwrap().expect("the request in flight is answered");
        assert_eq!((status, body.as_str()), (200, "ok GET /slow read=0\n"));
    }
    let st = sc
        .wait_exit(Duration::from_secs(20))
        .expect("exit after SIGTERM");
    let log = std::fs::read_to_string(dir.path().join(format!("sidecar-{port}.log"))).unwrap();
    assert_eq!(st.code(), Some(0), "exit {st}; log:\n{log}");
    assert!(
        log.contains("SIGTERM") && log.contains("sidecar shut down"),
        "{log}"
    );
    drop(http);
}

/// Mutual TLS: the verified client certificate names the caller (through a pattern), and a
/// header claiming another caller does not change it; the controller's `grl_calls_total`
/// counts the call under the certificate's caller, and the upstream gets the verified caller
/// (`--verified-caller-header`), never the caller's identity headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_verified_client_certificate_names_the_caller_over_any_header() {
    let dir = tempfile::tempdir().unwrap();
    let ca = test_support::tls::Ca::new("sidecar test CA");
    let ca_path = ca.write(&dir.path().join("ca.pem"));
    let (cert, key) = ca.server().write(dir.path(), "sidecar");
    let client = ca.client("gw.clients.test");
    let (ccert, ckey) = client.write(dir.path(), "client");
    let (ctl_port, agg_port, py_port) = (free_port(), free_port(), free_port());
    let ctl_url = format!("http://127.0.0.1:{ctl_port}");
    let agg_url = format!("http://127.0.0.1:{agg_port}");
    let _ctl = spawn_controller(ctl_port, &dir.path().join("state"), dir.path(), &[]);
    wait_up(&format!("{ctl_url}/v1/status")).await;
    push_payments(
        &ctl_url,
        "v1",
        json!([{"name": "gw.charge", "caller": "gw", "procedure": "charge", "scope": "global",
                "limit_rps": 1000.0, "mode": "shadow", "policy": "peak"}]),
    )
    .await;
    let _agg = spawn_aggregator(agg_port, &ctl_url, "agg-z1", dir.path());
    wait_up(&format!("{agg_url}/healthz")).await;
    let _py = spawn_py_http(dir.path(), py_port);
    let (port, admin) = (free_port(), free_port());
    let _sc = spawn_sidecar(
        dir.path(),
        port,
        admin,
        &format!("http://127.0.0.1:{py_port}"),
        &[&agg_url],
        &[
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
            "--tls-client-ca",
            ca_path.to_str().unwrap(),
            "--caller-cert-pattern",
            "{caller}.clients.test",
            "--verified-caller-header",
            "x-verified-caller",
        ],
    );
    wait_up(&format!("http://127.0.0.1:{admin}/healthz")).await;
    wait_up(&format!("http://127.0.0.1:{py_port}/")).await;
    let mut pem = client.cert_pem.clone().into_bytes();
    pem.extend_from_slice(client.key_pem.as_bytes());
    let _ = (ccert, ckey);
    let https = reqwest::Client::builder()
        .use_rustls_tls()
        .add_root_certificate(reqwest::Certificate::from_pem(ca.pem().as_bytes()).unwrap())
        .tls_built_in_root_certs(false)
        .identity(reqwest::Identity::from_pem(&pem).unwrap())
        .build()
        .unwrap();
    let url = format!("https://127.0.0.1:{port}/charge");
    for _ in 0..20 {
        let r = https
            .get(&url)
            .header("rpc-caller", "mallory")
            .header("rpc-procedure", "charge")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    // The upstream gets the verified caller, never the caller's claims.
    let seen = https
        .get(format!("https://127.0.0.1:{port}/headers"))
        .header("rpc-caller", "mallory")
        .header("x-forwarded-client-cert", "URI=spiffe://td/ns/a/sa/admin")
        .header("x-verified-caller", "admin")
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(seen.contains("x-verified-caller: gw\n"), "{seen}");
    for claim in ["mallory", "admin", "rpc-caller", "x-forwarded-client-cert"] {
        assert!(
            !seen.contains(claim),
            "{claim} reached the upstream: {seen}"
        );
    }
    // Without a client certificate the handshake is refused.
    let anonymous = reqwest::Client::builder()
        .use_rustls_tls()
        .add_root_certificate(reqwest::Certificate::from_pem(ca.pem().as_bytes()).unwrap())
        .tls_built_in_root_certs(false)
        .build()
        .unwrap();
    assert!(anonymous.get(&url).send().await.is_err());
    let http = reqwest::Client::new();
    eventually("the controller counts gw's calls", || {
        let http = http.clone();
        let u = format!("{ctl_url}/metrics");
        async move {
            let m = http.get(u).send().await.unwrap().text().await.unwrap();
            m.lines().any(|l| {
                l.starts_with(
                    "grl_calls_total{service=\"payments\",caller=\"gw\",procedure=\"charge\"}",
                ) && l.ends_with(" 20")
            }) && !m.contains("caller=\"mallory\"")
        }
    })
    .await;
}

/// A hung upstream answers 504 after `--upstream-timeout-ms` while other requests keep being
/// served; an upstream that is gone answers 502; both are counted by kind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_upstream_is_cut_after_the_timeout_and_a_gone_one_is_502() {
    let dir = tempfile::tempdir().unwrap();
    let (py_port, port, admin) = (free_port(), free_port(), free_port());
    let py = spawn_py_http(dir.path(), py_port);
    let dead = format!("http://127.0.0.1:{}", free_port());
    let _sc = spawn_sidecar(
        dir.path(),
        port,
        admin,
        &format!("http://127.0.0.1:{py_port}"),
        &[&dead],
        &["--upstream-timeout-ms", "500"],
    );
    wait_up(&format!("http://127.0.0.1:{admin}/healthz")).await;
    wait_up(&format!("http://127.0.0.1:{py_port}/")).await;
    let http = reqwest::Client::new();
    let base = format!("http://127.0.0.1:{port}");
    let hung = tokio::spawn({
        let (http, base) = (http.clone(), base.clone());
        async move {
            let r = http
                .get(format!("{base}/slow?ms=5000"))
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        }
    });
    // Served meanwhile.
    let r = http.get(format!("{base}/fast")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let (status, body) = hung.await.unwrap();
    assert_eq!(status, 504, "{body}");
    assert!(body.contains("did not answer within 500 ms"), "{body}");
    // The upstream is gone: 502, and /readyz says why.
    py.kill();
    let r = http.get(format!("{base}/fast")).send().await.unwrap();
    assert_eq!(r.status(), 502);
    let body = r.text().await.unwrap();
    assert!(body.contains("connection refused"), "{body}");
    let r = http
        .get(format!("http://127.0.0.1:{admin}/readyz"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    let m = http
        .get(format!("http://127.0.0.1:{admin}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for line in [
        "grl_sidecar_upstream_errors_total{kind=\"timeout\"} 1",
        "grl_sidecar_upstream_errors_total{kind=\"connect\"} 1",
        "grl_sidecar_refusals_total{reason=\"upstream_timeout\"} 1",
        "grl_sidecar_refusals_total{reason=\"upstream_unreachable\"} 1",
    ] {
        assert!(m.contains(line), "{line} missing:\n{m}");
    }
}

/// An upstream that accepts connections and never answers: a request times out (504), and
/// `/readyz` answers 503 saying the upstream answers nothing (it said ready: the upstream
/// accepts connections); once the upstream answers again (`OPTIONS *` gets an answer), ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_says_so_when_the_upstream_accepts_and_never_answers() {
    use std::sync::atomic::AtomicBool;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = l.local_addr().unwrap();
    let answering = Arc::new(AtomicBool::new(false));
    let server = tokio::spawn({
        let answering = answering.clone();
        async move {
            loop {
                let (mut s, _) = l.accept().await.unwrap();
                let answering = answering.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut b = [0u8; 4096];
                    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                        match s.read(&mut b).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&b[..n]),
                        }
                    }
                    if answering.load(Ordering::SeqCst) {
                        let _ = s
                            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\nconnection: close\r\n\r\nok\n")
                            .await;
                    } else {
                        tokio::time::sleep(Duration::from_secs(60)).await;
                    }
                });
            }
        }
    });
    let sc = lone_sidecar(
        &format!("http://{up}"),
        &["--upstream-timeout-ms", "500"],
        vec![],
    )
    .await;
    let http = reqwest::Client::new();
    let readyz = || {
        let http = http.clone();
        async move {
            let r = http
                .get(format!("http://127.0.0.1:{}/readyz", sc.admin))
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        }
    };
    let (status, body) = readyz().await;
    assert_eq!(status, 200, "{body}");
    let r = http
        .get(format!("http://127.0.0.1:{}/x", sc.port))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 504);
    let (status, body) = readyz().await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("answered nothing"), "{body}");
    answering.store(true, Ordering::SeqCst);
    let (status, body) = readyz().await;
    assert_eq!(status, 200, "{body}");
    server.abort();
}

/// A `GET` whose body holds a second request: an upstream that ignores `GET` bodies (as many
/// do) and keeps the connection would read that body as a request the sidecar never decided.
/// The sidecar closes such a request's upstream connection after the answer, so the upstream
/// reads one request only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_hidden_in_a_get_body_never_reaches_the_upstream() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = l.local_addr().unwrap();
    let seen = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    // An upstream reading request heads only (bodies ignored), kept alive unless told.
    let server = tokio::spawn({
        let seen = seen.clone();
        async move {
            loop {
                let (mut s, _) = l.accept().await.unwrap();
                let seen = seen.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut b = [0u8; 4096];
                    loop {
                        while let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            let head = String::from_utf8_lossy(&buf[..i]).to_string();
                            buf.drain(..i + 4);
                            seen.lock()
                                .unwrap()
                                .push(head.lines().next().unwrap_or("").to_string());
                            let close = head.to_ascii_lowercase().contains("connection: close");
                            if s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nok\n")
                                .await
                                .is_err()
                                || close
                            {
                                return;
                            }
                        }
                        match s.read(&mut b).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&b[..n]),
                        }
                    }
                });
            }
        }
    });
    let sc = lone_sidecar(&format!("http://{up}"), &[], vec![]).await;
    let hidden = "GET /smuggled HTTP/1.1\r\nhost: x\r\n\r\n";
    let r = reqwest::Client::new()
        .get(format!("http://127.0.0.1:{}/a", sc.port))
        .body(hidden)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // A plain GET afterwards: served as usual.
    let r = reqwest::get(format!("http://127.0.0.1:{}/b", sc.port))
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let seen = seen.lock().unwrap().clone();
    assert_eq!(
        seen,
        ["GET /a HTTP/1.1", "GET /b HTTP/1.1"],
        "the upstream read {seen:?}"
    );
    server.abort();
}

/// A sidecar whose report credential the aggregator refuses says so at most every 10 s: over
/// 3 s of reports every 200 ms, one warning (15 before), and its requests are served (fail
/// open).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_report_credential_is_logged_at_most_every_10_s() {
    let dir = tempfile::tempdir().unwrap();
    let (agg_port, py_port, port, admin) = (free_port(), free_port(), free_port(), free_port());
    let dead_ctl = format!("http://127.0.0.1:{}", free_port());
    let _agg = spawn_aggregator(agg_port, &dead_ctl, "agg-z1", dir.path());
    wait_up(&format!("http://127.0.0.1:{agg_port}/healthz")).await;
    let _py = spawn_py_http(dir.path(), py_port);
    let _sc = Proc::spawn(
        Command::new(env!("CARGO_BIN_EXE_grl"))
            .args(["sidecar", "--listen", &format!("127.0.0.1:{port}")])
            .args(["--admin-listen", &format!("127.0.0.1:{admin}")])
            .args(["--upstream", &format!("http://127.0.0.1:{py_port}")])
            .args(["--service", "payments", "--tick-ms", "200"])
            .args(["--aggregator", &format!("http://127.0.0.1:{agg_port}")])
            .env("GRL_CLIENT_TOKEN", "not-the-credential")
            .stdout(Stdio::null())
            .stderr(log_file(dir.path(), "refused-sidecar")),
    )
    .unwrap();
    wait_up(&format!("http://127.0.0.1:{admin}/healthz")).await;
    wait_up(&format!("http://127.0.0.1:{py_port}/")).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let r = reqwest::get(format!("http://127.0.0.1:{port}/x"))
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let metrics = admin_metrics(admin).await;
    let refused: u64 = metrics
        .lines()
        .find(|l| l.starts_with("grl_client_reports_refused_total"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    assert!(refused >= 5, "reports refused: {refused}\n{metrics}");
    let log = std::fs::read_to_string(dir.path().join("refused-sidecar.log")).unwrap();
    let warnings = log.matches("report refused").count();
    assert_eq!(warnings, 1, "{refused} reports refused, logged:\n{log}");
}

/// An upstream on a Unix socket: requests reach it over pooled connections, and `/readyz`
/// checks the socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unix_socket_upstream_is_served() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("app.sock");
    let _py = spawn_py_http_on(dir.path(), sock.to_str().unwrap());
    let (port, admin) = (free_port(), free_port());
    let dead = format!("http://127.0.0.1:{}", free_port());
    let _sc = spawn_sidecar(
        dir.path(),
        port,
        admin,
        &format!("unix:{}", sock.display()),
        &[&dead],
        &[],
    );
    let http = reqwest::Client::new();
    eventually("the sidecar is ready (the socket accepts)", || {
        let http = http.clone();
        async move {
            http.get(format!("http://127.0.0.1:{admin}/readyz"))
                .send()
                .await
                .is_ok_and(|r| r.status() == 200)
        }
    })
    .await;
    for i in 0..5 {
        let r = http
            .post(format!("http://127.0.0.1:{port}/items/{i}"))
            .body("abc")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(
            r.text().await.unwrap(),
            format!("ok POST /items/{i} read=3\n")
        );
    }
}

/// A Python gRPC client over TLS: calls `/test.Echo/Say` N times through ADDR (verifying the
/// server as `localhost` with CA), with a client certificate when CERT and KEY are not `-`,
/// claiming `rpc-caller: mallory`; prints the calls answered, the last reply and the errors.
const PY_GRPC_TLS_CLIENT: &str = r#"
import sys, json, grpc
addr, ca, cert, key, n = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
read = lambda p: open(p, "rb").read()
if cert == "-":
    creds = grpc.ssl_channel_credentials(root_certificates=read(ca))
else:
    creds = grpc.ssl_channel_credentials(root_certificates=read(ca), private_key=read(key),
                                         certificate_chain=read(cert))
ch = grpc.secure_channel(addr, creds, options=[("grpc.ssl_target_name_override", "localhost"),
                                               ("grpc.enable_http_proxy", 0)])
say = ch.unary_unary("/test.Echo/Say")
out = {"ok": 0, "reply": None, "trailer": None, "errors": []}
for i in range(n):
    try:
        resp, call = say.with_call(b"x", metadata=(("rpc-caller", "mallory"),), timeout=5)
        out["ok"] += 1
        out["reply"] = resp.decode()
        out["trailer"] = dict(call.trailing_metadata()).get("x-echo-trailer")
    except grpc.RpcError as e:
        out["errors"].append(e.code().name)
print(json.dumps(out))
"#;

/// gRPC over TLS: the sidecar's TLS listener offers h2 by ALPN, so a grpcio client with a
/// client certificate calls the Python gRPC service through it (trailers included); the
/// certificate names the caller over the `rpc-caller` header (the controller counts the calls
/// under `gw`, never `mallory`), the service reads `gw` in `rpc-caller`
/// (`--verified-caller-header rpc-caller`), and a client without a certificate is refused at
/// the handshake.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_over_tls_offers_h2_and_the_client_certificate_names_the_caller() {
    let Some(python) =
        grpcio_python("grpc_over_tls_offers_h2_and_the_client_certificate_names_the_caller")
    else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let ca = test_support::tls::Ca::new("sidecar grpc test CA");
    let ca_path = ca.write(&dir.path().join("ca.pem"));
    let (cert, key) = ca.server().write(dir.path(), "sidecar");
    let (ccert, ckey) = ca.client("gw.clients.test").write(dir.path(), "client");
    let (ctl_port, agg_port, grpc_port) = (free_port(), free_port(), free_port());
    let ctl_url = format!("http://127.0.0.1:{ctl_port}");
    let agg_url = format!("http://127.0.0.1:{agg_port}");
    let _ctl = spawn_controller(ctl_port, &dir.path().join("state"), dir.path(), &[]);
    wait_up(&format!("{ctl_url}/v1/status")).await;
    push_payments(
        &ctl_url,
        "v1",
        json!([{"name": "gw.say", "caller": "gw", "procedure": "/test.Echo/Say", "scope": "global",
                "limit_rps": 1000.0, "mode": "shadow", "policy": "peak"}]),
    )
    .await;
    let _agg = spawn_aggregator(agg_port, &ctl_url, "agg-z1", dir.path());
    wait_up(&format!("{agg_url}/healthz")).await;
    let server = write_script(dir.path(), "server.py", PY_GRPC_SERVER);
    let _srv = Proc::spawn(
        Command::new(&python)
            .arg(server)
            .arg(grpc_port.to_string())
            .stdout(Stdio::null())
            .stderr(log_file(dir.path(), "py-grpc")),
    )
    .unwrap();
    let (port, admin) = (free_port(), free_port());
    let _sc = spawn_sidecar(
        dir.path(),
        port,
        admin,
        &format!("http://127.0.0.1:{grpc_port}"),
        &[&agg_url],
        &[
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
            "--tls-client-ca",
            ca_path.to_str().unwrap(),
            "--caller-cert-pattern",
            "{caller}.clients.test",
            // The upstream reads rpc-caller: it gets the verified caller, not the claim.
            "--verified-caller-header",
            "rpc-caller",
        ],
    );
    let http = reqwest::Client::new();
    eventually("the sidecar is ready (the gRPC upstream accepts)", || {
        let http = http.clone();
        async move {
            http.get(format!("http://127.0.0.1:{admin}/readyz"))
                .send()
                .await
                .is_ok_and(|r| r.status() == 200)
        }
    })
    .await;
    let client = write_script(dir.path(), "tls_client.py", PY_GRPC_TLS_CLIENT);
    let run = |cert: &str, key: &str| {
        let addr = format!("127.0.0.1:{port}");
        run_py(
            &python,
            &client,
            &[&addr, ca_path.to_str().unwrap(), cert, key, "20"],
        )
    };
    let (c, k) = (ccert.to_str().unwrap(), ckey.to_str().unwrap());
    let with_cert = tokio::task::block_in_place(|| run(c, k));
    assert_eq!(with_cert["ok"], 20, "{with_cert}");
    assert_eq!(with_cert["reply"], "hello gw x", "{with_cert}");
    assert_eq!(with_cert["trailer"], "yes", "{with_cert}");
    let without = tokio::task::block_in_place(|| run("-", "-"));
    assert_eq!(without["ok"], 0, "{without}");
    assert!(
        without["errors"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e == "UNAVAILABLE"),
        "{without}"
    );
    eventually("the controller counts gw's gRPC calls", || {
        let http = http.clone();
        let u = format!("{ctl_url}/metrics");
        async move {
            let m = http.get(u).send().await.unwrap().text().await.unwrap();
            m.lines().any(|l| {
                l.starts_with(
                    "grl_calls_total{service=\"payments\",caller=\"gw\",procedure=\"/test.Echo/Say\"}",
                ) && l.ends_with(" 20")
            }) && !m.contains("caller=\"mallory\"")
        }
    })
    .await;
}

/// Peak resident memory of process `pid` (`VmHWM`, KiB).
fn peak_rss_kib(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no VmHWM in /proc/{pid}/status"))
}

/// Reads an HTTP/1.1 answer's head from `s` (and whatever of the body came with it).
async fn read_head(s: &mut tokio::net::TcpStream) -> (String, Vec<u8>) {
    use tokio::io::AsyncReadExt;
    let mut buf = Vec::new();
    let mut chunk = vec![0u8; 65536];
    loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..i]).to_string();
            return (head, buf[i + 4..].to_vec());
        }
        let n = s.read(&mut chunk).await.unwrap();
        assert!(n > 0, "connection closed before the answer's head: {buf:?}");
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// 256 MiB each way through the sidecar, streamed: a request body to the Python service (which
/// counts what it read) and an answer from it, while the sidecar's peak resident memory stays
/// a small fraction of either (it holds chunks, never a whole body).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_far_larger_than_memory_stream_through() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const MIB: u64 = 256;
    let dir = tempfile::tempdir().unwrap();
    let (py_port, port, admin) = (free_port(), free_port(), free_port());
    let _py = spawn_py_http(dir.path(), py_port);
    let dead = format!("http://127.0.0.1:{}", free_port());
    let sc = spawn_sidecar(
        dir.path(),
        port,
        admin,
        &format!("http://127.0.0.1:{py_port}"),
        &[&dead],
        &[],
    );
    wait_up(&format!("http://127.0.0.1:{admin}/healthz")).await;
    wait_up(&format!("http://127.0.0.1:{py_port}/")).await;
    let pid = sc.0.id();
    let before = peak_rss_kib(pid);

    // Up: a Content-Length body written 1 MiB at a time.
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let size = MIB << 20;
    s.write_all(
        format!("POST /upload HTTP/1.1\r\nhost: x\r\ncontent-length: {size}\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    let block = vec![b'y'; 1 << 20];
    for _ in 0..MIB {
        s.write_all(&block).await.unwrap();
    }
    let (head, mut body) = read_head(&mut s).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let want = format!("ok POST /upload read={size}\n");
    while body.len() < want.len() {
        let mut b = [0u8; 256];
        let n = s.read(&mut b).await.unwrap();
        assert!(n > 0);
        body.extend_from_slice(&b[..n]);
    }
    assert_eq!(String::from_utf8_lossy(&body), want);

    // Down: the answer read 64 KiB at a time, counted.
    s.write_all(format!("GET /big?mb={MIB} HTTP/1.1\r\nhost: x\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let (head, first) = read_head(&mut s).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        head.to_ascii_lowercase()
            .contains(&format!("content-length: {size}")),
        "{head}"
    );
    let mut got = first.len() as u64;
    let mut chunk = vec![0u8; 65536];
    while got < size {
        let n = s.read(&mut chunk).await.unwrap();
        assert!(n > 0, "closed after {got} of {size} bytes");
        got += n as u64;
    }
    assert_eq!(got, size);
    let peak = peak_rss_kib(pid);
    eprintln!("sidecar peak RSS: {before} KiB before, {peak} KiB after {MIB} MiB each way");
    assert!(
        peak < before + (48 << 10),
        "the sidecar's peak RSS grew from {before} KiB to {peak} KiB moving {MIB} MiB bodies"
    );
}

/// Callers that stop reading hold a bounded buffer each, whatever the answer's size: 64
/// connections that read the head of a 4 MiB answer and nothing more add less than 32 MB to
/// the sidecar's resident memory (0.45–0.8 MB each before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_that_stop_reading_hold_a_bounded_buffer_each() {
    use tokio::io::AsyncWriteExt;
    const CALLERS: usize = 64;
    let py = py_sidecar(&[]).await;
    let pid = py._procs.last().unwrap().0.id();
    let before = peak_rss_kib(pid);
    let mut held = Vec::new();
    for _ in 0..CALLERS {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", py.port))
            .await
            .unwrap();
        s.write_all(b"GET /big?mb=4 HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let (head, _) = read_head(&mut s).await;
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        held.push(s);
    }
    // Let every buffer on the way fill up.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let peak = peak_rss_kib(pid);
    eprintln!("sidecar peak RSS: {before} KiB before, {peak} KiB with {CALLERS} HTTP/1.1 callers not reading");
    assert!(
        peak < before + (32 << 10),
        "{CALLERS} callers that stop reading took the sidecar's peak RSS from {before} KiB to {peak} KiB"
    );
    // The same over HTTP/2: callers whose stream window (64 KiB) is never opened again.
    let before = peak;
    let mut builder =
        hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new());
    builder.initial_stream_window_size(65_535);
    let mut answers = Vec::new();
    for _ in 0..CALLERS {
        let (mut tx, conn) = h2_to::<http_body_util::Empty<bytes::Bytes>>(py.port, &builder).await;
        let req = hyper::Request::get(format!("http://127.0.0.1:{}/big?mb=4", py.port))
            .body(http_body_util::Empty::new())
            .unwrap();
        let r = tx.send_request(req).await.unwrap();
        assert_eq!(r.status(), 200);
        answers.push((tx, conn, r));
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let peak = peak_rss_kib(pid);
    eprintln!("sidecar peak RSS: {before} KiB before, {peak} KiB with {CALLERS} HTTP/2 callers not reading");
    assert!(
        peak < before + (32 << 10),
        "{CALLERS} HTTP/2 callers that stop reading took the sidecar's peak RSS from {before} KiB to {peak} KiB"
    );
    drop((held, answers));
}

/// HTTP/2 callers that never open their stream window and ask for answers too long to be read
/// whole hold at most their connection's share of the upstream slots (a sixteenth of them, 8 at
/// least): three such connections of 30 streams each against 64 slots leave slots for a
/// well-behaved caller (before: they held 64 slots, and it got 504 after the upstream
/// timeout); their streams beyond the share get 503 after the upstream timeout, counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_window_streams_hold_only_their_connections_share_of_the_slots() {
    use http_body_util::Empty;
    const CONNS: usize = 3;
    const STREAMS: usize = 30;
    let py = py_sidecar(&["--max-connections", "64", "--upstream-timeout-ms", "3000"]).await;
    let mut builder =
        hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new());
    builder.initial_stream_window_size(0);
    let mut calls = Vec::new();
    let mut conns = Vec::new();
    for _ in 0..CONNS {
        let (tx, conn) = h2_to::<Empty<bytes::Bytes>>(py.port, &builder).await;
        for _ in 0..STREAMS {
            let mut tx = tx.clone();
            let req = hyper::Request::get(format!("http://127.0.0.1:{}/big?mb=1", py.port))
                .body(Empty::new())
                .unwrap();
            calls.push(tokio::spawn(async move {
                tx.ready().await.unwrap();
                // Keep the answer (unread) so that its stream stays open.
                tx.send_request(req).await.map(|r| (r.status().as_u16(), r))
            }));
        }
        conns.push((tx, conn));
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let r = reqwest::get(format!("http://127.0.0.1:{}/fast", py.port))
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    let mut by_status = BTreeMap::new();
    let mut answers = Vec::new();
    for c in calls {
        let (status, answer) = c.await.unwrap().unwrap();
        *by_status.entry(status).or_insert(0) += 1;
        answers.push(answer);
    }
    assert_eq!(
        by_status,
        BTreeMap::from([(200, CONNS * 8), (503, CONNS * (STREAMS - 8))]),
        "answers by status"
    );
    let metrics = reqwest::get(format!("http://127.0.0.1:{}/metrics", py.admin))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let line = format!(
        "grl_sidecar_refusals_total{{reason=\"connection_share\"}} {}\n",
        CONNS * (STREAMS - 8)
    );
    assert!(metrics.contains(&line), "no {line} in {metrics}");
    drop((answers, conns));
}

/// Slow clients: one trickling its request body and one that stops reading a large answer do
/// not hold other requests up; the first gets 504 once the upstream (waiting for the body)
/// has not answered within `--upstream-timeout-ms`, the second's connection is cut once
/// nothing moved on it for `--http-idle-timeout-ms` (its answer's head is sent: no request in
/// flight), counted as `grl_http_connections_closed_total{reason="idle"}`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_hold_nothing_up_and_are_cut_as_documented() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let py = py_sidecar(&[
        "--upstream-timeout-ms",
        "500",
        "--http-idle-timeout-ms",
        "1000",
    ])
    .await;
    let (port, admin) = (py.port, py.admin);

    // A slow sender: the head and 10 of 1000 body bytes, then a byte now and then.
    let mut slow_up = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    slow_up
        .write_all(b"POST /upload HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\n0123456789")
        .await
        .unwrap();
    let trickle = tokio::spawn(async move {
        let mut answer = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            tokio::select! {
                r = slow_up.read(&mut buf) => match r {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        answer.extend_from_slice(&buf[..n]);
                        if answer.windows(4).any(|w| w == b"\r\n\r\n") {
                            break;
                        }
                    }
                },
                _ = tokio::time::sleep(Duration::from_millis(100)) => {
                    let _ = slow_up.write_all(b"z").await;
                }
            }
        }
        String::from_utf8_lossy(&answer).to_string()
    });
    // A slow reader: asks for 256 MiB and reads nothing.
    let mut slow_down = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    slow_down
        .write_all(b"GET /big?mb=256 HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();

    // Others are served meanwhile (each on its own connection, closed after it: no idle
    // connection of theirs is left to the server's idle timeout).
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    for i in 0..20 {
        let r = http
            .get(format!("http://127.0.0.1:{port}/fast/{i}"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(
            r.text().await.unwrap(),
            format!("ok GET /fast/{i} read=0\n")
        );
    }
    let answer = trickle.await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 504"), "{answer}");
    // The reader that stopped reading is cut (the only connection of the main port left
    // idle: the others closed after their request), and reading ends before the whole answer.
    eventually("the reader that stopped reading is cut", || {
        let http = http.clone();
        async move {
            let m = http
                .get(format!("http://127.0.0.1:{admin}/metrics"))
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            m.contains("grl_http_connections_closed_total{reason=\"idle\"} 1")
        }
    })
    .await;
    let mut buf = vec![0u8; 1 << 20];
    let mut got = 0u64;
    while got < 256 << 20 {
        match slow_down.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => got += n as u64,
        }
    }
    assert!(got < 256 << 20, "the stalled answer was not cut");
    // Still serving.
    let r = http
        .get(format!("http://127.0.0.1:{port}/after"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

/// An upstream that closes kept-alive connections after every answer without saying so: each
/// request through the sidecar is answered, by the service (the pool notices the close, or a
/// request not yet written is retried on a new connection) or with 502, never left hanging.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_closing_kept_alive_connections_never_hangs_a_request() {
    let py = py_sidecar(&["--upstream-timeout-ms", "5000"]).await;
    let port = py.port;
    // One kept-alive connection to the sidecar; the hang guard is the client's timeout, far
    // above the upstream timeout.
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .pool_max_idle_per_host(1)
        .build()
        .unwrap();
    let mut statuses: BTreeMap<u16, u64> = BTreeMap::new();
    for gap_ms in [0u64, 2, 20] {
        for i in 0..40 {
            let r = if i % 2 == 0 {
                http.get(format!("http://127.0.0.1:{port}/c/{i}?close=1"))
                    .send()
                    .await
            } else {
                http.post(format!("http://127.0.0.1:{port}/c/{i}?close=1"))
                    .body("abc")
                    .send()
                    .await
            };
            let r = r.unwrap_or_else(|e| panic!("request {i} (gap {gap_ms} ms) failed: {e}"));
            let status = r.status().as_u16();
            let body = r.text().await.unwrap();
            if status == 200 {
                let m = if i % 2 == 0 { "GET" } else { "POST" };
                let read = if i % 2 == 0 { 0 } else { 3 };
                assert_eq!(body, format!("ok {m} /c/{i} read={read}\n"));
            }
            *statuses.entry(status).or_default() += 1;
            tokio::time::sleep(Duration::from_millis(gap_ms)).await;
        }
    }
    eprintln!("answers by status: {statuses:?}");
    assert!(
        statuses.keys().all(|s| *s == 200 || *s == 502),
        "{statuses:?}"
    );
    assert!(
        statuses.get(&200).copied().unwrap_or(0) >= 60,
        "{statuses:?}"
    );
}

/// An HTTP/2 connection without TLS (h2c) to the sidecar on `port`, made by `builder`: its
/// request handle and the task driving it.
async fn h2_to<B>(
    port: u16,
    builder: &hyper::client::conn::http2::Builder<hyper_util::rt::TokioExecutor>,
) -> (
    hyper::client::conn::http2::SendRequest<B>,
    tokio::task::JoinHandle<hyper::Result<()>>,
)
where
    B: hyper::body::Body + Send + Unpin + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let (tx, conn) = builder
        .handshake(hyper_util::rt::TokioIo::new(tcp))
        .await
        .unwrap();
    (tx, tokio::spawn(conn))
}

/// Reads `path` through the sidecar on `port` over HTTP/2 without TLS (h2c) or HTTP/1.1,
/// pausing `pause` per 16 KiB read (a slow reader: over HTTP/2 it sends a WINDOW_UPDATE now
/// and then);
/// the bytes read, or the error that ended the answer.
async fn read_slowly(port: u16, path: &str, h2: bool, pause: Duration) -> Result<usize, String> {
    use http_body_util::BodyExt;
    use hyper_util::rt::{TokioExecutor, TokioIo};
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| e.to_string())?;
    let req = hyper::Request::get(format!("http://127.0.0.1:{port}{path}"))
        .header("rpc-caller", "web")
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .unwrap();
    let resp = if h2 {
        let (mut tx, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
            .initial_stream_window_size(65_535)
            .initial_connection_window_size(65_535)
            .handshake(TokioIo::new(tcp))
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        tx.send_request(req).await
    } else {
        let (mut tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        let mut req = req;
        *req.uri_mut() = path.parse().unwrap();
        req.headers_mut()
            .insert("host", hyper::header::HeaderValue::from_static("x"));
        tx.send_request(req).await
    };
    let mut body = resp.map_err(|e| e.to_string())?.into_body();
    let mut n = 0;
    while let Some(f) = body.frame().await {
        let f = f.map_err(|e| format!("after {n} bytes: {e}"))?;
        let len = f.data_ref().map_or(0, |d| d.len());
        n += len;
        tokio::time::sleep(pause * (len / 16384).max(1) as u32).await;
    }
    Ok(n)
}

#[tokio::test]
async fn an_answer_streaming_longer_than_the_header_timeout_is_not_cut() {
    let py = py_sidecar(&["--http-header-timeout-ms", "300"]).await;
    let port = py.port;
    // 4 MiB read 16 KiB every 3 ms: about a second, the answer's head long sent.
    for h2 in [false, true] {
        let t = Instant::now();
        let got = read_slowly(port, "/big?mb=4", h2, Duration::from_millis(3)).await;
        assert_eq!(got, Ok(4 << 20), "h2: {h2}, after {:?}", t.elapsed());
        assert!(
            t.elapsed() > Duration::from_millis(600),
            "{:?}",
            t.elapsed()
        );
    }
}

/// Two lines of the caller header: which names the caller is a guess (a front proxy that
/// appends leaves the client's first), so the request is refused 400 and counted. With routes,
/// the procedure header is not read unless named (two lines of it pass), and without a
/// certificate the caller's own value of the verified-caller header never reaches the upstream.
#[tokio::test]
async fn identity_headers_given_twice_are_refused_and_claims_are_not_passed_as_verified() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let py = py_sidecar(&[
        "--route",
        "GET /headers",
        "--verified-caller-header",
        "x-verified-caller",
    ])
    .await;
    let (port, admin) = (py.port, py.admin);
    let send = |lines: &'static str| async move {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        s.write_all(
            format!("GET /headers HTTP/1.1\r\nhost: x\r\nconnection: close\r\n{lines}\r\n")
                .as_bytes(),
        )
        .await
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    };
    let out = send("rpc-caller: mallory\r\nrpc-caller: gw\r\n").await;
    assert!(out.starts_with("HTTP/1.1 400"), "{out}");
    assert!(out.contains("identity header given twice"), "{out}");
    let out = send(
        "rpc-caller: gw\r\nrpc-procedure: a\r\nrpc-procedure: b\r\nx-verified-caller: admin\r\n",
    )
    .await;
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    assert!(out.contains("rpc-caller: gw\n"), "{out}");
    assert!(!out.contains("x-verified-caller"), "{out}");
    let metrics = admin_metrics(admin).await;
    let line = "grl_sidecar_bad_requests_total{reason=\"identity\"} 1\n";
    assert!(metrics.contains(line), "no {line} in {metrics}");
}

/// gRPC is HTTP/2: an HTTP/1.1 request saying `content-type: application/grpc` is plain HTTP,
/// its procedure from the routes (not its raw path, a key of the caller's choosing) and its
/// upstream the HTTP/1.1 one.
#[tokio::test]
async fn a_grpc_content_type_over_http1_is_plain_http() {
    let py = py_sidecar(&["--route", "POST /charge"]).await;
    let (port, admin) = (py.port, py.admin);
    let r = reqwest::Client::new()
        .post(format!("http://127.0.0.1:{port}/charge"))
        .header("content-type", "application/grpc")
        .header("rpc-caller", "web")
        .body("abc")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.text().await.unwrap(), "ok POST /charge read=3\n");
    let metrics = admin_metrics(admin).await;
    for (protocol, n) in [("http", 1), ("grpc", 0)] {
        let line = format!(
            "grl_sidecar_requests_total{{protocol=\"{protocol}\",decision=\"admit\"}} {n}\n"
        );
        assert!(metrics.contains(&line), "no {line} in {metrics}");
    }
}

/// gRPC calls held by callers that never open their receive window stall no other caller's
/// calls, and hold bounded memory: 4 caller connections of 150 such calls each (512 KiB
/// answers) on one worker, then 6 unary calls from other callers, all answered, and the
/// sidecar's peak RSS grows less than 32 MB. Before, the worker's one h2c connection upstream
/// carried every call: the held calls used up its window (64 MiB) and its streams, and the
/// other callers' calls timed out.
#[tokio::test]
async fn grpc_callers_that_stop_reading_do_not_stall_the_other_calls() {
    use bytes::Bytes;
    use http_body_util::{BodyExt, Full};
    use hyper_util::rt::{TokioExecutor, TokioIo};
    static BIG: [u8; 512 << 10] = [0; 512 << 10];
    const CONNS: usize = 4;
    const CALLS: usize = 150;
    // An h2c upstream: `/big.Svc/Stream` answers 512 KiB, anything else a 2-byte message.
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = l.local_addr().unwrap();
    let accepted = Arc::new(AtomicU64::new(0));
    let server = tokio::spawn({
        let accepted = accepted.clone();
        async move {
            loop {
                let (s, _) = l.accept().await.unwrap();
                accepted.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(
                        |req: hyper::Request<hyper::body::Incoming>| async move {
                            let big = req.uri().path() == "/big.Svc/Stream";
                            let _ = req.into_body().collect().await;
                            let body = if big {
                                Bytes::from_static(&BIG)
                            } else {
                                Bytes::from_static(&[0, 0, 0, 0, 2, b'o', b'k'])
                            };
                            let mut trailers = hyper::HeaderMap::new();
                            trailers.insert(
                                "grpc-status",
                                hyper::header::HeaderValue::from_static("0"),
                            );
                            let mut r = hyper::Response::new(
                                Full::new(body).with_trailers(async move { Some(Ok(trailers)) }),
                            );
                            r.headers_mut().insert(
                                "content-type",
                                hyper::header::HeaderValue::from_static("application/grpc"),
                            );
                            Ok::<_, std::convert::Infallible>(r)
                        },
                    );
                    let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(s), svc)
                        .await;
                });
            }
        }
    });
    let sc = lone_sidecar(&format!("http://{up}"), &["--workers", "1"], vec![]).await;
    let port = sc.port;
    let pid = sc._procs.last().unwrap().0.id();
    let before = peak_rss_kib(pid);
    let request = |path: &str| {
        hyper::Request::post(format!("http://127.0.0.1:{port}{path}"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .header("rpc-caller", "web")
            .body(Full::new(Bytes::from_static(&[0, 0, 0, 0, 1, b'x'])))
            .unwrap()
    };
    // Callers that never open their window: each call's answer stays in the windows on the
    // way.
    let mut stalled = hyper::client::conn::http2::Builder::new(TokioExecutor::new());
    stalled.initial_stream_window_size(0);
    let mut held = Vec::new();
    for _ in 0..CONNS {
        let (tx, conn) = h2_to(port, &stalled).await;
        let mut calls = Vec::new();
        for _ in 0..CALLS {
            let mut tx = tx.clone();
            let req = request("/big.Svc/Stream");
            calls.push(tokio::spawn(async move {
                tx.ready().await.unwrap();
                tx.send_request(req).await
            }));
        }
        held.push((tx, conn, calls));
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut answered = 0;
    for _ in 0..6 {
        let unary = async {
            let (mut tx, _) = h2_to(
                port,
                &hyper::client::conn::http2::Builder::new(TokioExecutor::new()),
            )
            .await;
            let resp = tx.send_request(request("/small.Svc/Unary")).await.unwrap();
            resp.into_body().collect().await.unwrap()
        };
        if let Ok(got) = tokio::time::timeout(Duration::from_secs(5), unary).await {
            assert_eq!(got.trailers().unwrap()["grpc-status"], "0");
            assert_eq!(got.to_bytes().as_ref(), &[0, 0, 0, 0, 2, b'o', b'k']);
            answered += 1;
        }
    }
    let peak = peak_rss_kib(pid);
    eprintln!("sidecar peak RSS: {before} KiB before, {peak} KiB with {} calls held unread; {} upstream connections", CONNS * CALLS, accepted.load(Ordering::SeqCst));
    assert_eq!(
        answered, 6,
        "other callers' calls answered behind the unread ones"
    );
    assert!(
        peak < before + (32 << 10),
        "{} unread calls took the sidecar's peak RSS from {before} KiB to {peak} KiB",
        CONNS * CALLS
    );
    drop(held);
    server.abort();
}

/// Upstream HTTP/1.1 connections in use are bounded by `--max-connections` (each request in
/// flight holds one): one HTTP/2 caller sending 20 requests at once to a slow upstream gets
/// all 20 answered, with at most 4 of them at the upstream at a time.
#[tokio::test]
async fn upstream_connections_in_use_are_bounded_by_the_connection_cap() {
    use bytes::Bytes;
    use http_body_util::{BodyExt, Full};
    use hyper_util::rt::{TokioExecutor, TokioIo};
    use std::sync::atomic::AtomicUsize;
    // An HTTP/1.1 upstream answering after 200 ms; it counts the requests it is handling and
    // the most at once.
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = l.local_addr().unwrap();
    let (open, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (o, m) = (open.clone(), most.clone());
    let server = tokio::spawn(async move {
        loop {
            let (s, _) = l.accept().await.unwrap();
            let (open, most) = (o.clone(), m.clone());
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(
                    move |_req: hyper::Request<hyper::body::Incoming>| {
                        let (open, most) = (open.clone(), most.clone());
                        async move {
                            let now = open.fetch_add(1, Ordering::SeqCst) + 1;
                            most.fetch_max(now, Ordering::SeqCst);
                            tokio::time::sleep(Duration::from_millis(200)).await;
                            open.fetch_sub(1, Ordering::SeqCst);
                            Ok::<_, std::convert::Infallible>(hyper::Response::new(Full::new(
                                Bytes::from_static(b"ok"),
                            )))
                        }
                    },
                );
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    let sc = lone_sidecar(&format!("http://{up}"), &["--max-connections", "4"], vec![]).await;
    let port = sc.port;
    let (tx, _) = h2_to(
        port,
        &hyper::client::conn::http2::Builder::new(TokioExecutor::new()),
    )
    .await;
    let calls = (0..20).map(|i| {
        let mut tx = tx.clone();
        async move {
            let req = hyper::Request::get(format!("http://127.0.0.1:{port}/r/{i}"))
                .header("rpc-caller", "web")
                .body(http_body_util::Empty::<Bytes>::new())
                .unwrap();
            let r = tx.send_request(req).await.unwrap();
            let status = r.status();
            (status, r.into_body().collect().await.unwrap().to_bytes())
        }
    });
    let answers = tokio::time::timeout(
        Duration::from_secs(20),
        tokio::task::JoinSet::from_iter(calls).join_all(),
    )
    .await
    .expect("answered");
    for (status, body) in answers {
        assert_eq!((status.as_u16(), body.as_ref()), (200, b"ok".as_ref()));
    }
    let most = most.load(Ordering::SeqCst);
    assert!(most <= 4, "{most} requests at the upstream at once");
    server.abort();
}

/// An HTTP/2 caller that stops reading its answers, and only pings, is cut once its answers
/// made no progress for the idle timeout (its upstream slots freed), while a slow reader is
/// not (`an_answer_streaming_longer_than_the_header_timeout_is_not_cut`).
#[tokio::test]
async fn an_http2_caller_that_only_pings_under_stalled_answers_is_cut_when_idle() {
    use hyper_util::rt::{TokioExecutor, TokioTimer};
    let py = py_sidecar(&["--http-idle-timeout-ms", "1000"]).await;
    let port = py.port;
    let mut builder = hyper::client::conn::http2::Builder::new(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .keep_alive_interval(Duration::from_millis(200))
        .keep_alive_while_idle(true);
    let (mut tx, conn) = h2_to(port, &builder).await;
    let req = hyper::Request::get(format!("http://127.0.0.1:{port}/big?mb=32"))
        .header("rpc-caller", "web")
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .unwrap();
    // The answer's head, then nothing read: its windows fill and the sidecar's writes stop.
    let held = tx.send_request(req).await.unwrap();
    assert_eq!(held.status(), 200);
    let t = Instant::now();
    let ended = tokio::time::timeout(Duration::from_secs(10), conn).await;
    assert!(ended.is_ok(), "still open after {:?}", t.elapsed());
    assert!(
        t.elapsed() >= Duration::from_millis(900),
        "{:?}",
        t.elapsed()
    );
    drop(held);
}

/// Behind `python3 -m http.server` (which answers HTTP/1.0 and closes), an HTTP/1.1 caller is
/// answered in HTTP/1.1 and keeps its connection for the next request (RFC 9112 §2.3: the
/// answer's version is the sidecar's, whatever the upstream's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http11_caller_is_answered_in_http11_behind_an_http10_upstream() {
    use tokio::io::AsyncWriteExt;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("hello.txt"), "hello\n").unwrap();
    let py_port = free_port();
    let py = Proc::spawn(
        Command::new("/usr/bin/python3")
            .args(["-m", "http.server", "--bind", "127.0.0.1"])
            .arg(py_port.to_string())
            .current_dir(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    )
    .unwrap();
    wait_up(&format!("http://127.0.0.1:{py_port}/hello.txt")).await;
    let sc = lone_sidecar(&format!("http://127.0.0.1:{py_port}"), &[], vec![py]).await;
    let mut conn = tokio::net::TcpStream::connect(("127.0.0.1", sc.port))
        .await
        .unwrap();
    for i in 0..3 {
        conn.write_all(b"GET /hello.txt HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let (head, _) = tokio::time::timeout(Duration::from_secs(10), read_head(&mut conn))
            .await
            .unwrap_or_else(|_| panic!("no answer to request {i}"));
        assert!(head.starts_with("HTTP/1.1 200"), "request {i}: {head}");
        assert!(
            !head.to_ascii_lowercase().contains("connection: close"),
            "request {i}: {head}"
        );
        // The body (6 bytes) may come after the head: read it before the next request.
        let mut rest = vec![0u8; 64];
        let _ = tokio::time::timeout(Duration::from_millis(200), async {
            use tokio::io::AsyncReadExt;
            conn.read(&mut rest).await
        })
        .await;
    }
}

/// A malformed request body (a chunk size that overflows) is the caller's fault: 400 and
/// `grl_sidecar_bad_requests_total{reason="body"}`, as nginx answers, never a 502 counted as an
/// upstream error (whose alerts any caller could set off).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_chunked_body_is_a_bad_request_not_an_upstream_error() {
    use tokio::io::AsyncWriteExt;
    let py = py_sidecar(&[]).await;
    let mut conn = tokio::net::TcpStream::connect(("127.0.0.1", py.port))
        .await
        .unwrap();
    conn.write_all(
        b"POST /x HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n\
          FFFFFFFFFFFFFFFFFFFF\r\nabc\r\n0\r\n\r\n",
    )
    .await
    .unwrap();
    let (head, _) = tokio::time::timeout(Duration::from_secs(10), read_head(&mut conn))
        .await
        .expect("an answer");
    assert!(head.starts_with("HTTP/1.1 400"), "{head}");
    let m = reqwest::get(format!("http://127.0.0.1:{}/metrics", py.admin))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        m.contains("grl_sidecar_bad_requests_total{reason=\"body\"} 1"),
        "{m}"
    );
    assert!(
        m.contains("grl_sidecar_upstream_errors_total{kind=\"other\"} 0"),
        "{m}"
    );
}
