//! One proxy hop measured side by side: a direct call, Debian's nginx as a plain reverse proxy,
//! nginx with `limit_req`, and `grl sidecar` (with a real controller and aggregator), all in
//! front of the same upstream, in one run. Then the accuracy of a global limit over three
//! replicas with uneven load (60/30/10 %) at 1.5 × the limit: three sidecars sharing one GRL
//! tier against three nginx with `limit_req` at a third of the limit each.
//!
//! ```text
//! cargo build --release -p grl-runtime --bin grl --example bench_sidecar
//! target/release/examples/bench_sidecar --grl target/release/grl [--nginx /usr/sbin/nginx]
//!     [--secs 10] [--rates 1000,10000] [--rounds 5] [--pin] [--grl-baseline OTHER/grl]
//!     [--accept-instructions]
//! ```
//!
//! The hop's peers include the sidecar with `--concurrency-limit auto` and, with
//! `--grl-baseline`, the sidecar of another build (an earlier commit's) in the same run.
//!
//! Latency is measured by an open-loop generator (requests sent at a fixed rate over pooled
//! keep-alive connections, 1 KiB request bodies, whatever the answers' pace), from the send to
//! the last byte of the answer; "added" is a peer's percentile minus the direct call's. Each
//! path's `--secs` are measured in `--rounds` slices, the paths taking turns (a different one
//! first in each round), so that a machine whose speed drifts during the run weighs on every
//! path alike; a path's percentiles are those of all its slices' requests together. With
//! `--pin` every proxy measured runs on the last CPU and this process (generator, upstreams,
//! GRL tier) on the others: one core per proxy, nginx's and the sidecar's alike. The
//! saturation figure is requests per second of a closed loop (64 in flight) over the proxy's
//! CPU seconds (`/proc`, every process of the proxy), i.e. requests/s per core. The upstream
//! and the generator run in this process; nginx gets one worker. gRPC: the same for unary calls
//! (1 KiB messages over h2c) to an in-process gRPC upstream, direct, through nginx `grpc_pass`
//! and through a sidecar. Instructions: the sidecar's instructions per HTTP/1.1 request and per
//! gRPC call, counted under callgrind (Debian's `valgrind`), beside the figures of the last
//! accepted commit (`grl-runtime/benches/sidecar-instructions.json`; `--accept-instructions`
//! writes this run's there), so that a change that makes a request dearer is seen.
//! `BENCH_ONLY=hop|grpc|instructions|accuracy` runs one part; `BENCH_KEEP=1` keeps the run's
//! directories (logs, nginx's configuration, the callgrind dumps `callgrind-*.out.1` for
//! `benches/callgrind_groups.py`). Output: Markdown tables (docs/grl-sidecar-bench.md).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::{TokioExecutor, TokioIo};
use test_support::process::{free_port, Proc};
use test_support::wait::wait_up;

const TOKEN: &str = "bench-config-token";
const REPORT: &str = "bench-report-token";
const CLIENT: &str = "bench-payments-client-token";

struct Args {
    grl: PathBuf,
    /// Another build of `grl` whose sidecar is measured beside this one's (`--grl-baseline`).
    baseline: Option<PathBuf>,
    /// Write this run's instruction counts as the accepted ones (`--accept-instructions`).
    accept_instructions: bool,
    nginx: PathBuf,
    secs: u64,
    rates: Vec<u64>,
    rounds: u64,
    /// The CPU the proxies measured run on (`--pin`: the last one).
    pin: Option<usize>,
}

fn args() -> Args {
    let mut a = Args {
        grl: PathBuf::from("target/release/grl"),
        baseline: None,
        accept_instructions: false,
        nginx: PathBuf::from("/usr/sbin/nginx"),
        secs: 10,
        rates: vec![1_000, 10_000],
        rounds: 5,
        pin: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        if k == "--accept-instructions" {
            a.accept_instructions = true;
            continue;
        }
        if k == "--pin" {
            let cpus = allowed_cpus();
            assert!(
                cpus.len() >= 2,
                "--pin needs two CPUs at least, has {cpus:?}"
            );
            a.pin = cpus.last().copied();
            continue;
        }
        let v = it.next().unwrap_or_else(|| panic!("{k} needs a value"));
        match k.as_str() {
            "--grl" => a.grl = v.into(),
            "--grl-baseline" => a.baseline = Some(v.into()),
            "--nginx" => a.nginx = v.into(),
            "--secs" => a.secs = v.parse().expect("--secs N"),
            "--rounds" => a.rounds = v.parse::<u64>().expect("--rounds N").max(1),
            "--rates" => {
                a.rates = v
                    .split(',')
                    .map(|r| r.parse().expect("--rates N,M"))
                    .collect()
            }
            _ => panic!("unknown flag {k}"),
        }
    }
    a
}

/// The upstream every peer proxies to: reads the body, answers 200 with 2 bytes.
async fn upstream() -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else {
                continue;
            };
            let _ = s.set_nodelay(true);
            tokio::spawn(async move {
                let svc =
                    hyper::service::service_fn(|req: Request<hyper::body::Incoming>| async move {
                        let _ = req.into_body().collect().await;
                        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
                    });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    addr
}

/// A gRPC upstream (h2c): every unary call is answered with the message `ok` and
/// `grpc-status: 0` in the trailers, after reading the request.
async fn grpc_upstream() -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else {
                continue;
            };
            let _ = s.set_nodelay(true);
            tokio::spawn(async move {
                let svc =
                    hyper::service::service_fn(|req: Request<hyper::body::Incoming>| async move {
                        let _ = req.into_body().collect().await;
                        let mut trailers = hyper::HeaderMap::new();
                        trailers
                            .insert("grpc-status", hyper::header::HeaderValue::from_static("0"));
                        // One length-prefixed message: not compressed, 2 bytes, "ok".
                        let body = Full::new(Bytes::from_static(&[0, 0, 0, 0, 2, b'o', b'k']))
                            .with_trailers(async move { Some(Ok(trailers)) });
                        let mut r = Response::new(body);
                        r.headers_mut().insert(
                            "content-type",
                            hyper::header::HeaderValue::from_static("application/grpc"),
                        );
                        Ok::<_, Infallible>(r)
                    });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    addr
}

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// HTTP/1.1 keep-alive connections, or for gRPC HTTP/2 without TLS (h2c).
fn client_for(grpc: bool) -> HttpClient {
    let mut c = HttpConnector::new();
    c.set_nodelay(true);
    let mut b = Client::builder(TokioExecutor::new());
    b.pool_max_idle_per_host(1024);
    if grpc {
        b.http2_only(true);
    }
    b.build(c)
}

fn client() -> HttpClient {
    client_for(false)
}

/// One request as `caller`; its status, or 0 for a transport error.
async fn call(c: &HttpClient, url: &str, caller: &str, body: &Bytes) -> u16 {
    let req = Request::post(url)
        .header("rpc-caller", caller)
        .header("content-type", "application/octet-stream")
        .body(Full::new(body.clone()))
        .unwrap();
    match c.request(req).await {
        Ok(r) => {
            let s = r.status().as_u16();
            let _ = r.into_body().collect().await;
            s
        }
        Err(_) => 0,
    }
}

/// One unary gRPC call (`url` names the method) as `caller`, `body` the message; 200 when it
/// ended with `grpc-status: 0`, else 0.
async fn call_grpc(c: &HttpClient, url: &str, caller: &str, body: &Bytes) -> u16 {
    let mut framed = Vec::with_capacity(body.len() + 5);
    framed.push(0);
    framed.extend_from_slice(&(body.len() as u32).to_be_bytes());
    framed.extend_from_slice(body);
    let req = Request::post(url)
        .header("rpc-caller", caller)
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(Full::new(Bytes::from(framed)))
        .unwrap();
    let Ok(r) = c.request(req).await else {
        return 0;
    };
    let in_head = r.headers().get("grpc-status").cloned();
    match r.into_body().collect().await {
        Ok(b) => {
            let status = b
                .trailers()
                .and_then(|t| t.get("grpc-status").cloned())
                .or(in_head);
            if status.is_some_and(|s| s == "0") {
                200
            } else {
                0
            }
        }
        Err(_) => 0,
    }
}

/// A request of the kind measured: HTTP (1 KiB POST) or a unary gRPC call (1 KiB message).
async fn call_kind(grpc: bool, c: &HttpClient, url: &str, caller: &str, body: &Bytes) -> u16 {
    if grpc {
        call_grpc(c, url, caller, body).await
    } else {
        call(c, url, caller, body).await
    }
}

struct Latency {
    p50: f64,
    p90: f64,
    p99: f64,
    errors: u64,
}

/// Latencies (µs) of the requests answered, and the count of those that were not.
#[derive(Default)]
struct Samples {
    us: Vec<u32>,
    errors: u64,
}

impl Samples {
    fn latency(mut self) -> Latency {
        let v = &mut self.us;
        v.sort_unstable();
        let q = |p: f64| {
            v.get(((v.len() as f64 - 1.0) * p) as usize)
                .copied()
                .unwrap_or(0) as f64
        };
        Latency {
            p50: q(0.50),
            p90: q(0.90),
            p99: q(0.99),
            errors: self.errors,
        }
    }
}

/// `rate` requests/s (gRPC calls when `grpc`) for `secs` seconds, open loop, added to `into`.
async fn open_loop(url: &str, rate: u64, secs: f64, grpc: bool, into: &mut Samples) {
    let c = client_for(grpc);
    let body = Bytes::from(vec![b'x'; 1024]);
    // Warm the pool.
    for _ in 0..32 {
        call_kind(grpc, &c, url, "bench", &body).await;
    }
    let total = (rate as f64 * secs) as u64;
    let lat = Arc::new(std::sync::Mutex::new(Vec::with_capacity(total as usize)));
    let errors = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    let mut sent = 0u64;
    while sent < total {
        let due = ((start.elapsed().as_secs_f64() * rate as f64) as u64).min(total);
        while sent < due {
            let (c, url, body, lat, errors) = (
                c.clone(),
                url.to_string(),
                body.clone(),
                lat.clone(),
                errors.clone(),
            );
            tasks.spawn(async move {
                let t = Instant::now();
                let s = call_kind(grpc, &c, &url, "bench", &body).await;
                let us = t.elapsed().as_micros() as u32;
                if s == 200 {
                    lat.lock().unwrap().push(us);
                } else {
                    errors.fetch_add(1, Ordering::Relaxed);
                }
            });
            sent += 1;
        }
        while tasks.try_join_next().is_some() {}
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
    while tasks.join_next().await.is_some() {}
    into.us.append(&mut lat.lock().unwrap());
    into.errors += errors.load(Ordering::Relaxed);
}

/// Every path at `rate` for `secs` seconds in all: a 2-second pass warms each (its pool, the
/// peer, the generator), then `rounds` slices each, the paths taking turns, a different one
/// first in each round.
async fn measure(paths: &[&str], rate: u64, secs: u64, rounds: u64, grpc: bool) -> Vec<Latency> {
    let mut samples: Vec<Samples> = paths.iter().map(|_| Samples::default()).collect();
    for url in paths {
        open_loop(url, rate, 2.0, grpc, &mut Samples::default()).await;
    }
    let slice = secs as f64 / rounds as f64;
    for r in 0..rounds as usize {
        for k in 0..paths.len() {
            let i = (r + k) % paths.len();
            open_loop(paths[i], rate, slice, grpc, &mut samples[i]).await;
        }
    }
    samples.into_iter().map(Samples::latency).collect()
}

/// The latency table of `peers` (name, URL, pid) at `rate`, measured with [`measure`]; the
/// first peer is the baseline of the "added" columns.
async fn latency_table(peers: &[(&str, String, Option<u32>)], rate: u64, a: &Args, grpc: bool) {
    println!("| path | p50 µs | p90 µs | p99 µs | added p50 µs | added p99 µs | errors |");
    println!("|---|---|---|---|---|---|---|");
    let urls: Vec<&str> = peers.iter().map(|p| p.1.as_str()).collect();
    let lats = measure(&urls, rate, a.secs, a.rounds, grpc).await;
    let Some((b50, b99)) = lats.first().map(|l| (l.p50, l.p99)) else {
        return;
    };
    for ((name, _, _), l) in peers.iter().zip(lats) {
        println!(
            "| {name} | {:.0} | {:.0} | {:.0} | {:+.0} | {:+.0} | {} |",
            l.p50,
            l.p90,
            l.p99,
            l.p50 - b50,
            l.p99 - b99,
            l.errors
        );
    }
    println!();
}

/// Runs `cmd`'s process on `cpus` when set (else on this process's).
fn pinned(cmd: &mut Command, cpus: Option<Vec<usize>>) -> &mut Command {
    use std::os::unix::process::CommandExt as _;
    if let Some(cpus) = cpus {
        // SAFETY: sched_setaffinity is async-signal-safe and reads only the closure's vector.
        unsafe {
            cmd.pre_exec(move || match set_affinity(&cpus) {
                true => Ok(()),
                false => Err(std::io::Error::last_os_error()),
            });
        }
    }
    cmd
}

/// Restricts the calling thread (and what it starts afterwards) to `cpus`; false if refused.
fn set_affinity(cpus: &[usize]) -> bool {
    // SAFETY: a zeroed cpu_set_t is the empty set; the pointer is to a live local.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cpus {
            libc::CPU_SET(c, &mut set);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    }
}

/// The CPUs this process may run on (a cpuset or a container may allow fewer, or others, than
/// the machine has).
fn allowed_cpus() -> Vec<usize> {
    // SAFETY: a zeroed cpu_set_t is the empty set; sched_getaffinity fills the local.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect()
    }
}

/// CPU seconds used so far by `pid` and its children (utime + stime).
fn cpu_secs(pid: u32) -> f64 {
    let tick = 100.0; // USER_HZ on Linux
    let mut total = 0u64;
    let stat = |p: &Path| -> Option<(u32, u64)> {
        let s = std::fs::read_to_string(p).ok()?;
        let rest = &s[s.rfind(')')? + 2..];
        let f: Vec<&str> = rest.split_whitespace().collect();
        Some((
            f[1].parse().ok()?,
            f[11].parse::<u64>().ok()? + f[12].parse::<u64>().ok()?,
        ))
    };
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(p) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if let Some((ppid, t)) = stat(&e.path().join("stat")) {
            if p == pid || ppid == pid {
                total += t;
            }
        }
    }
    total as f64 / tick
}

/// Requests/s of a closed loop (64 in flight) for 5 s, and the proxy's requests per CPU second.
async fn saturation(url: &str, pid: Option<u32>, grpc: bool) -> (f64, Option<f64>) {
    let c = client_for(grpc);
    let body = Bytes::from(vec![b'x'; 1024]);
    let done = Arc::new(AtomicU64::new(0));
    let end = Instant::now() + Duration::from_secs(5);
    let cpu0 = pid.map(cpu_secs);
    let t0 = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..64 {
        let (c, url, body, done) = (c.clone(), url.to_string(), body.clone(), done.clone());
        set.spawn(async move {
            while Instant::now() < end {
                if call_kind(grpc, &c, &url, "bench", &body).await == 200 {
                    done.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
    }
    while set.join_next().await.is_some() {}
    let wall = t0.elapsed().as_secs_f64();
    let n = done.load(Ordering::Relaxed) as f64;
    let per_core = match (pid, cpu0) {
        (Some(p), Some(c0)) => Some(n / (cpu_secs(p) - c0).max(0.01)),
        _ => None,
    };
    (n / wall, per_core)
}

/// Requests nginx serves on one connection, callers' and upstream ones, before it closes it:
/// its default (1,000) closed the generator's pooled connections and the upstream
/// keep-alive ones every 1,000 requests, which the sidecar never does (in-flight gRPC calls
/// failed on the GOAWAY, hundreds a run at 10,000 calls/s).
const KEEPALIVE_REQUESTS: u64 = 1_000_000_000;

/// nginx: `plain` proxies to `up`, each of `limited` with `limit_req`, and with `grpc` = (port,
/// gRPC upstream) a plain-text HTTP/2 port with `grpc_pass`.
fn nginx_conf(
    dir: &Path,
    up: SocketAddr,
    plain: u16,
    limited: &[(u16, f64)],
    grpc: Option<(u16, SocketAddr)>,
) -> PathBuf {
    let mut servers = format!(
        "server {{ listen 127.0.0.1:{plain}; location / {{ proxy_pass http://up; proxy_http_version 1.1; proxy_set_header Connection \"\"; }} }}\n"
    );
    let mut grpc_up = String::new();
    if let Some((port, gup)) = grpc {
        grpc_up = format!(
            "upstream grpcup {{ server {gup}; keepalive 256; keepalive_requests {KEEPALIVE_REQUESTS}; }}\n"
        );
        servers.push_str(&format!(
            "server {{ listen 127.0.0.1:{port} http2; location / {{ grpc_pass grpc://grpcup; }} }}\n"
        ));
    }
    let mut zones = String::new();
    for (i, (port, rate)) in limited.iter().enumerate() {
        // A rate limit in requests/s per replica; a burst of a tenth of a second.
        let r = (*rate).round() as u64;
        zones.push_str(&format!(
            "limit_req_zone $server_port zone=z{i}:1m rate={r}r/s;\n"
        ));
        servers.push_str(&format!(
            "server {{ listen 127.0.0.1:{port}; location / {{ limit_req zone=z{i} burst={} nodelay; limit_req_status 429; proxy_pass http://up; proxy_http_version 1.1; proxy_set_header Connection \"\"; }} }}\n",
            (r / 10).max(1)
        ));
    }
    let d = dir.display();
    let conf = format!(
        "worker_processes 1;\ndaemon off;\npid {d}/nginx.pid;\nerror_log {d}/nginx-error.log warn;\nevents {{ worker_connections 4096; }}\nhttp {{\naccess_log off;\nclient_body_temp_path {d}/body;\nproxy_temp_path {d}/proxy;\nfastcgi_temp_path {d}/fastcgi;\nuwsgi_temp_path {d}/uwsgi;\nscgi_temp_path {d}/scgi;\nkeepalive_requests {KEEPALIVE_REQUESTS};\nupstream up {{ server {up}; keepalive 256; keepalive_requests {KEEPALIVE_REQUESTS}; }}\n{grpc_up}{zones}{servers}}}\n"
    );
    let path = dir.join("nginx.conf");
    std::fs::write(&path, conf).unwrap();
    path
}

/// A GRL tier: controller (config: payments' caller `gw` limited to `limit`, caller `bench`
/// unlimited) and one aggregator; its aggregator URL.
async fn tier(grl: &Path, dir: &Path, limit: f64, procs: &mut Vec<Proc>) -> String {
    std::fs::create_dir_all(dir).unwrap();
    let (cp, ap) = (free_port(), free_port());
    procs.push(
        Proc::spawn(
            Command::new(grl)
                .args([
                    "controller",
                    "--listen",
                    &format!("127.0.0.1:{cp}"),
                    "--tick-ms",
                    "100",
                    "--state-dir",
                ])
                .arg(dir.join("state"))
                .env("GRL_TOKEN", TOKEN)
                .env("GRL_REPORT_TOKEN", REPORT)
                .stdout(Stdio::null())
                .stderr(log_to(dir, "controller")),
        )
        .unwrap(),
    );
    let creds = dir.join("client-credentials");
    std::fs::write(&creds, format!("payments payments {CLIENT}\n")).unwrap();
    let controller = format!("http://127.0.0.1:{cp}");
    wait_up(&format!("{controller}/healthz")).await;
    procs.push(
        Proc::spawn(
            Command::new(grl)
                .args([
                    "aggregator",
                    "--listen",
                    &format!("127.0.0.1:{ap}"),
                    "--controller",
                    &controller,
                ])
                .args([
                    "--zone",
                    "z1",
                    "--region",
                    "r1",
                    "--tick-ms",
                    "100",
                    "--client-credentials",
                ])
                .arg(&creds)
                .env("GRL_REPORT_TOKEN", REPORT)
                .stdout(Stdio::null())
                .stderr(log_to(dir, "aggregator")),
        )
        .unwrap(),
    );
    let doc = serde_json::json!({"version": "bench", "services": [{"service": "payments", "buckets": [
        {"name": "gw", "caller": "gw", "scope": "global", "limit_rps": limit, "mode": "enforce", "policy": "peak"}]}]});
    let r = reqwest::Client::new()
        .put(format!("{controller}/v1/config"))
        .bearer_auth(TOKEN)
        .json(&doc)
        .send()
        .await
        .unwrap();
    assert!(
        r.status().is_success(),
        "config refused: {}",
        r.text().await.unwrap_or_default()
    );
    let agg = format!("http://127.0.0.1:{ap}");
    wait_up(&format!("{agg}/healthz")).await;
    agg
}

/// The flags of a sidecar named `name` on `port` (admin on `admin`) in front of `up`.
fn sidecar_args(port: u16, admin: u16, up: SocketAddr, agg: &str, name: &str) -> Vec<String> {
    let mut v: Vec<String> = [
        "sidecar",
        "--listen",
        &format!("127.0.0.1:{port}"),
        "--upstream",
        &format!("http://{up}"),
        "--service",
        "payments",
        "--zone",
        "z1",
        "--region",
        "r1",
        "--aggregator",
        agg,
        "--admin-listen",
        &format!("127.0.0.1:{admin}"),
        "--id",
        name,
    ]
    .map(String::from)
    .to_vec();
    // The default reporting period unless BENCH_SIDECAR_TICK says otherwise.
    if let Ok(t) = std::env::var("BENCH_SIDECAR_TICK") {
        v.extend(["--tick-ms".to_string(), t]);
    }
    v
}

/// A sidecar in front of `up` (on `cpus` when set); its listen port and process id.
#[allow(clippy::too_many_arguments)]
fn sidecar(
    grl: &Path,
    dir: &Path,
    up: SocketAddr,
    agg: &str,
    name: &str,
    procs: &mut Vec<Proc>,
    extra: &[&str],
    cpus: Option<Vec<usize>>,
) -> (u16, u32) {
    let (port, admin) = (free_port(), free_port());
    let p = Proc::spawn(
        pinned(&mut Command::new(grl), cpus)
            .args(sidecar_args(port, admin, up, agg, name))
            .args(extra)
            .env("GRL_CLIENT_TOKEN", CLIENT)
            .stdout(Stdio::null())
            .stderr(log_to(dir, name)),
    )
    .unwrap();
    let pid = p.0.id();
    procs.push(p);
    (port, pid)
}

/// A log file `name.log` in `dir`.
fn log_to(dir: &Path, name: &str) -> Stdio {
    Stdio::from(std::fs::File::create(dir.join(format!("{name}.log"))).unwrap())
}

/// Offers `rate` requests/s of caller `gw` to `url` for `secs` s; admitted (200) per second
/// over the last `measure` seconds.
async fn offer(url: String, rate: f64, secs: u64, measure: u64) -> f64 {
    let c = client();
    let body = Bytes::from(vec![b'x'; 1024]);
    let ok = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let from = Duration::from_secs(secs - measure);
    let mut sent = 0u64;
    let total = (rate * secs as f64) as u64;
    let mut set = tokio::task::JoinSet::new();
    while sent < total {
        let due = ((start.elapsed().as_secs_f64() * rate) as u64).min(total);
        while sent < due {
            let (c, url, body, ok) = (c.clone(), url.clone(), body.clone(), ok.clone());
            let counted = start.elapsed() >= from;
            set.spawn(async move {
                if call(&c, &url, "gw", &body).await == 200 && counted {
                    ok.fetch_add(1, Ordering::Relaxed);
                }
            });
            sent += 1;
        }
        while set.try_join_next().is_some() {}
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    while set.join_next().await.is_some() {}
    ok.load(Ordering::Relaxed) as f64 / measure as f64
}

fn main() {
    let a = args();
    if let Some(cpu) = a.pin {
        // The generator, the upstreams and the GRL tier on the other CPUs.
        let others: Vec<usize> = allowed_cpus().into_iter().filter(|&c| c != cpu).collect();
        assert!(set_affinity(&others), "cannot run on CPUs {others:?}");
    }
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(run(a));
}

async fn run(a: Args) {
    // With --pin: the proxies measured on one CPU; the accuracy part's on all of them.
    let proxy_cpu = a.pin.map(|c| vec![c]);
    let all_cpus = a.pin.map(|c| {
        let mut all: Vec<usize> = allowed_cpus();
        all.push(c);
        all
    });
    let dir = tempfile::tempdir().unwrap();
    let up = upstream().await;
    let gup = grpc_upstream().await;
    let mut procs = Vec::new();

    // Peers for the hop: nginx (plain, limit_req far above the load, grpc_pass) and sidecars.
    let (ng_plain, ng_limited, ng_grpc) = (free_port(), free_port(), free_port());
    let conf = nginx_conf(
        dir.path(),
        up,
        ng_plain,
        &[(ng_limited, 1e6)],
        Some((ng_grpc, gup)),
    );
    let nginx = Proc::spawn(
        pinned(&mut Command::new(&a.nginx), proxy_cpu.clone())
            .arg("-c")
            .arg(&conf)
            .arg("-p")
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    )
    .unwrap();
    let nginx_pid = nginx.0.id();
    procs.push(nginx);
    let agg = tier(&a.grl, dir.path(), 1e9, &mut procs).await;
    let (sc, sc_pid) = sidecar(
        &a.grl,
        dir.path(),
        up,
        &agg,
        "sidecar",
        &mut procs,
        &[],
        proxy_cpu.clone(),
    );
    // The same on the multi-threaded runtime with one shared pool (how it served before
    // --workers): the structural change, side by side.
    let (sc0, sc0_pid) = sidecar(
        &a.grl,
        dir.path(),
        up,
        &agg,
        "sidecar-workers-0",
        &mut procs,
        &["--workers", "0"],
        proxy_cpu.clone(),
    );
    // With the concurrency limit on (the upstream answers at once: nothing waits).
    let (scl, scl_pid) = sidecar(
        &a.grl,
        dir.path(),
        up,
        &agg,
        "sidecar-limit-auto",
        &mut procs,
        &["--concurrency-limit", "auto"],
        proxy_cpu.clone(),
    );
    let base = a.baseline.as_ref().map(|b| {
        sidecar(
            b,
            dir.path(),
            up,
            &agg,
            "sidecar-baseline",
            &mut procs,
            &[],
            proxy_cpu.clone(),
        )
    });
    let (gsc, gsc_pid) = sidecar(
        &a.grl,
        dir.path(),
        gup,
        &agg,
        "sidecar-grpc",
        &mut procs,
        &[],
        proxy_cpu.clone(),
    );
    // BENCH_ONLY: accuracy, hop (HTTP), grpc, instructions; unset: all four.
    let only = std::env::var("BENCH_ONLY").ok();
    let part = |p: &str| only.as_deref().is_none_or(|o| o == p);
    let skip_hop = !part("hop");
    let peers: Vec<(&str, String, Option<u32>)> = if skip_hop {
        vec![]
    } else {
        vec![
            ("direct", format!("http://{up}/"), None),
            (
                "nginx (proxy_pass)",
                format!("http://127.0.0.1:{ng_plain}/"),
                Some(nginx_pid),
            ),
            (
                "nginx (limit_req)",
                format!("http://127.0.0.1:{ng_limited}/"),
                Some(nginx_pid),
            ),
            (
                "grl sidecar",
                format!("http://127.0.0.1:{sc}/"),
                Some(sc_pid),
            ),
            (
                "grl sidecar --workers 0",
                format!("http://127.0.0.1:{sc0}/"),
                Some(sc0_pid),
            ),
            (
                "grl sidecar --concurrency-limit auto",
                format!("http://127.0.0.1:{scl}/"),
                Some(scl_pid),
            ),
        ]
        .into_iter()
        .chain(base.map(|(port, pid)| {
            (
                "grl sidecar, baseline build",
                format!("http://127.0.0.1:{port}/"),
                Some(pid),
            )
        }))
        .collect()
    };
    for (_, url, _) in &peers {
        wait_up(url).await;
    }
    if !skip_hop {
        hop_part(&peers, &a).await;
    }
    if part("grpc") {
        grpc_part(&a, gup, (ng_grpc, nginx_pid), (gsc, gsc_pid)).await;
    }
    if part("instructions") {
        instructions_part(&a, up, gup, dir.path()).await;
    }
    if part("accuracy") {
        accuracy_part(&a, up, all_cpus, &mut procs).await;
    }
    drop(procs);
    keep_if_asked(dir);
}

/// Keeps a run's directory (and says where) when `BENCH_KEEP` is set; otherwise it goes.
fn keep_if_asked(dir: tempfile::TempDir) {
    if std::env::var_os("BENCH_KEEP").is_some() {
        eprintln!("kept: {}", dir.keep().display());
    }
}

/// The HTTP/1.1 hop: latency at each rate (open loop), then saturation (closed loop).
async fn hop_part(peers: &[(&str, String, Option<u32>)], a: &Args) {
    println!(
        "## One hop, 1 KiB POST bodies, keep-alive, loopback ({} s per rate)\n",
        a.secs
    );
    for &rate in &a.rates {
        println!("### {rate} requests/s (open loop)\n");
        latency_table(peers, rate, a, false).await;
    }
    println!("### Saturation (closed loop, 64 in flight, 5 s)\n");
    println!("| path | requests/s | requests/s per CPU second of the proxy |");
    println!("|---|---|---|");
    for (name, url, pid) in peers {
        let (rps, per_core) = saturation(url, *pid, false).await;
        let pc = per_core.map_or("–".to_string(), |v| format!("{v:.0}"));
        println!("| {name} | {rps:.0} | {pc} |");
    }
    println!();
}

/// gRPC unary calls: direct (h2c), nginx grpc_pass, the sidecar.
async fn grpc_part(a: &Args, gup: SocketAddr, nginx: (u16, u32), sidecar: (u16, u32)) {
    let ((ng_grpc, nginx_pid), (gsc, gsc_pid)) = (nginx, sidecar);
    let method = "test.Echo/Say";
    let gpeers: Vec<(&str, String, Option<u32>)> = vec![
        ("direct", format!("http://{gup}/{method}"), None),
        (
            "nginx (grpc_pass)",
            format!("http://127.0.0.1:{ng_grpc}/{method}"),
            Some(nginx_pid),
        ),
        (
            "grl sidecar",
            format!("http://127.0.0.1:{gsc}/{method}"),
            Some(gsc_pid),
        ),
    ];
    let c = client_for(true);
    let body = Bytes::from_static(b"x");
    for (name, url, _) in &gpeers {
        let mut up = false;
        for _ in 0..200 {
            if call_grpc(&c, url, "bench", &body).await == 200 {
                up = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(up, "{name}: {url} never answered a gRPC call");
    }
    println!(
        "## gRPC unary calls, 1 KiB messages, HTTP/2 without TLS, loopback ({} s per rate)\n",
        a.secs
    );
    for &rate in &a.rates {
        println!("### {rate} calls/s (open loop)\n");
        latency_table(&gpeers, rate, a, true).await;
    }
    println!("### gRPC saturation (closed loop, 64 calls in flight, 5 s)\n");
    println!("| path | calls/s | calls/s per CPU second of the proxy |");
    println!("|---|---|---|");
    for (name, url, pid) in &gpeers {
        let (rps, per_core) = saturation(url, *pid, true).await;
        let pc = per_core.map_or("–".to_string(), |v| format!("{v:.0}"));
        println!("| {name} | {rps:.0} | {pc} |");
    }
    println!();
}

/// Accuracy: a global limit over three replicas with uneven load, grl sidecars against
/// nginx's per-node limit_req.
async fn accuracy_part(
    a: &Args,
    up: SocketAddr,
    all_cpus: Option<Vec<usize>>,
    procs: &mut Vec<Proc>,
) {
    let limit: f64 = std::env::var("BENCH_LIMIT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(600.0);
    let offered = [0.6, 0.3, 0.1].map(|s| s * 1.5 * limit);
    let limited: Vec<(u16, f64)> = (0..3).map(|_| (free_port(), limit / 3.0)).collect();
    let dir2 = tempfile::tempdir().unwrap();
    let conf = nginx_conf(dir2.path(), up, free_port(), &limited, None);
    procs.push(
        Proc::spawn(
            pinned(&mut Command::new(&a.nginx), all_cpus.clone())
                .arg("-c")
                .arg(&conf)
                .arg("-p")
                .arg(dir2.path())
                .stdout(Stdio::null())
                .stderr(Stdio::null()),
        )
        .unwrap(),
    );
    let agg2 = tier(&a.grl, &dir2.path().join("grl"), limit, procs).await;
    let sidecars: Vec<u16> = (0..3)
        .map(|i| {
            sidecar(
                &a.grl,
                dir2.path(),
                up,
                &agg2,
                &format!("replica-{i}"),
                procs,
                &[],
                all_cpus.clone(),
            )
            .0
        })
        .collect();
    for p in &sidecars {
        wait_up(&format!("http://127.0.0.1:{p}/")).await;
    }
    for &(p, _) in &limited {
        wait_up(&format!("http://127.0.0.1:{p}/")).await;
    }
    let (secs, measure) = (30, 20);
    let run = |ports: Vec<u16>| {
        let tasks: Vec<_> = ports
            .into_iter()
            .zip(offered)
            .map(|(p, r)| tokio::spawn(offer(format!("http://127.0.0.1:{p}/"), r, secs, measure)))
            .collect();
        async move {
            let mut out = Vec::new();
            for t in tasks {
                out.push(t.await.unwrap());
            }
            out
        }
    };
    let grl = run(sidecars).await;
    let ngx = run(limited.iter().map(|l| l.0).collect()).await;
    println!("## Accuracy: a global limit of {limit} requests/s, offered 1.5 × over three replicas (60/30/10 %), admitted over the last {measure} of {secs} s\n");
    println!(
        "| replica | offered | grl sidecar admitted | nginx limit_req ({:.0} r/s each) admitted |",
        limit / 3.0
    );
    println!("|---|---|---|---|");
    for i in 0..3 {
        println!(
            "| {i} | {:.0} | {:.1} | {:.1} |",
            offered[i], grl[i], ngx[i]
        );
    }
    let (g, n): (f64, f64) = (grl.iter().sum(), ngx.iter().sum());
    println!(
    "| **fleet** | {:.0} | **{g:.1}** ({:+.1} % of the limit) | **{n:.1}** ({:+.1} % of the limit) |",
    offered.iter().sum::<f64>(),
    (g / limit - 1.0) * 100.0,
    (n / limit - 1.0) * 100.0
);
    keep_if_asked(dir2);
}

/// Where the instruction counts of the last accepted commit are kept (`--accept-instructions`
/// writes this run's).
const ACCEPTED: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/benches/sidecar-instructions.json"
);
/// Requests counted per path, one at a time over one connection (after 500 to warm up).
const COUNTED: u64 = 5_000;

/// The instruction counts of a commit.
#[derive(serde::Serialize, serde::Deserialize)]
struct Accepted {
    commit: String,
    http1: f64,
    grpc: f64,
}

/// Instructions per request of the sidecar on the HTTP/1.1 and gRPC paths, counted by
/// callgrind (the same on a busy machine, unlike time), beside the last accepted commit's.
async fn instructions_part(a: &Args, up: SocketAddr, gup: SocketAddr, dir: &Path) {
    if Command::new("valgrind").arg("--version").output().is_err() {
        println!("## Instructions per request\n\nvalgrind not found (Debian's `valgrind`): not counted.\n");
        return;
    }
    let http1 = count_instructions(&a.grl, dir, up, false).await;
    let grpc = count_instructions(&a.grl, dir, gup, true).await;
    let accepted: Option<Accepted> = std::fs::read_to_string(ACCEPTED)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok());
    println!(
        "## Instructions per request (callgrind; {COUNTED} requests one at a time, 1 KiB bodies, no aggregator)\n"
    );
    let then = accepted
        .as_ref()
        .map_or("–".to_string(), |x| x.commit.clone());
    println!("| path | this build | {then} | change |");
    println!("|---|---:|---:|---:|");
    for (name, now, before) in [
        ("HTTP/1.1 POST", http1, accepted.as_ref().map(|x| x.http1)),
        ("gRPC unary call", grpc, accepted.as_ref().map(|x| x.grpc)),
    ] {
        let (b, change) = match before {
            Some(b) => {
                let pct = (now / b - 1.0) * 100.0;
                let mark = if pct > 3.0 { " **more**" } else { "" };
                (format!("{b:.0}"), format!("{pct:+.1} %{mark}"))
            }
            None => ("–".into(), "–".into()),
        };
        println!("| {name} | {now:.0} | {b} | {change} |");
    }
    println!();
    if a.accept_instructions {
        let commit = Command::new("git")
            .args(["rev-parse", "--short", "HEAD"])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .ok()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .filter(|c| !c.is_empty())
            .unwrap_or_else(|| "unknown".into());
        let doc = Accepted {
            commit,
            http1: http1.round(),
            grpc: grpc.round(),
        };
        std::fs::write(ACCEPTED, serde_json::to_string_pretty(&doc).unwrap() + "\n").unwrap();
        println!("(written to {ACCEPTED})\n");
    }
}

/// The sidecar's instructions per request on one path: the sidecar under callgrind (its
/// aggregator a port nobody listens on: it decides failing open), 500 requests to warm up,
/// then the counters zeroed, [`COUNTED`] requests, a dump, and the dump's total over the
/// requests the sidecar counted in between.
async fn count_instructions(grl: &Path, dir: &Path, up: SocketAddr, grpc: bool) -> f64 {
    let (port, admin) = (free_port(), free_port());
    let name = if grpc {
        "callgrind-grpc"
    } else {
        "callgrind-http1"
    };
    let out = dir.join(format!("{name}.out"));
    let dead = format!("http://127.0.0.1:{}", free_port());
    let p = Proc::spawn(
        Command::new("valgrind")
            .arg("--tool=callgrind")
            .arg(format!("--callgrind-out-file={}", out.display()))
            .arg(grl)
            .args(sidecar_args(port, admin, up, &dead, name))
            .env("GRL_CLIENT_TOKEN", CLIENT)
            .stdout(Stdio::null())
            .stderr(log_to(dir, name)),
    )
    .unwrap();
    let pid = p.0.id().to_string();
    wait_up(&format!("http://127.0.0.1:{admin}/healthz")).await;
    let c = client_for(grpc);
    let url = if grpc {
        format!("http://127.0.0.1:{port}/test.Echo/Say")
    } else {
        format!("http://127.0.0.1:{port}/charge")
    };
    let body = Bytes::from(vec![b'x'; 1024]);
    for _ in 0..500 {
        call_kind(grpc, &c, &url, "gw", &body).await;
    }
    let n0 = proxied(admin).await;
    let control = |flag: &str| {
        let ok = Command::new("callgrind_control")
            .args([flag, &pid])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "callgrind_control {flag} {pid} failed");
    };
    control("-z");
    for _ in 0..COUNTED {
        call_kind(grpc, &c, &url, "gw", &body).await;
    }
    control("-d");
    let n1 = proxied(admin).await;
    drop(p);
    let dump = format!("{}.1", out.display());
    let text = std::fs::read_to_string(&dump).unwrap_or_else(|e| panic!("{dump}: {e}"));
    let total: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("summary:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("{dump}: no summary line"));
    assert!(n1 > n0, "the sidecar counted no request ({n0} then {n1})");
    total / (n1 - n0) as f64
}

/// The requests the sidecar on `admin` proxied (`grl_sidecar_requests_total`, every label).
async fn proxied(admin: u16) -> u64 {
    let req = Request::get(format!("http://127.0.0.1:{admin}/metrics"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let r = client().request(req).await.unwrap();
    let page = r.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8_lossy(&page)
        .lines()
        .filter(|l| l.starts_with("grl_sidecar_requests_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}
