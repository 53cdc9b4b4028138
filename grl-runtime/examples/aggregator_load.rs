//! Aggregator throughput: one real aggregator (with a real controller behind it) on loopback,
//! driven by many simulated clients over real HTTP/1.1 with kept-alive connections.
//!
//! The server side (controller + aggregator, as `grl` runs them) runs in a child process of
//! this example (`--serve`), so that its CPU time is measured on its own and it can be pinned
//! to one core (`--pin`: server on CPU 0, load generator on CPU 1). Without `--pin` both share
//! every core.
//!
//! Each simulated client reports for one of `--services` services (20 by default, one
//! credential each in the aggregator's credentials file: authentication per request) with
//! `--buckets` buckets (8) and 4 call counts, every `--tick-ms` (open loop: a report is due
//! at its time whether or not the previous one was answered; latency is counted from the
//! due time, so a generator that falls behind shows it as latency, not as a lower rate).
//! Clients are spread over `--conns` connections (256), one request in flight on each.
//! The generator is a minimal HTTP/1.1 client over tokio's `TcpStream` (request bytes built
//! once per client, a response read to its `Content-Length`), so that it leaves the CPU to
//! the aggregator; the bodies are what `Reporter` sends (`ClientReport`, JSON or, with
//! `--encoding binary`, the binary encoding of `grl_wire::binary`).
//!
//! `cargo run --release -p grl-runtime --example aggregator_load -- --clients 10000 --tick-ms 200 --secs 10 --pin`
//! (`--codec` instead measures the report's decode and the reply's encode alone: report bytes,
//! reply bytes, µs per report.)
//!
//! Prints one Markdown table row: label, encoding, cores, clients, offered and accepted
//! reports/s, latency p50/p99/max (ms), the server's CPU (cores used, and µs per accepted
//! report), the generator's CPU (cores used), errors. `--tick-ms 0` runs a closed loop (each
//! connection sends as soon as it is answered): the capacity.

use std::io::{BufRead, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use grl_control::aggregator::{Aggregator, AggregatorOptions};
use grl_control::controller::{Controller, ControllerOptions};
use grl_wire::{BucketCountsMsg, CallCountMsg, ClientReport};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[path = "../benches/fixture/mod.rs"]
mod fixture;

const ZONE_SECRET: &str = "bench-zone-report-0123456789";
const CONFIG_TOKEN: &str = "bench-config-token-0123456789";
const BUCKETS_PER_SERVICE: usize = 16;

fn secret(service: usize) -> String {
    format!("bench-client-secret-{service:04}-0123456789")
}

#[derive(Clone)]
struct Args {
    serve: bool,
    codec: bool,
    clients: usize,
    tick_ms: u64,
    secs: u64,
    warmup_secs: u64,
    conns: usize,
    buckets: usize,
    services: usize,
    pin: bool,
    encoding: String,
    label: String,
}

fn args() -> Args {
    let mut a = Args {
        serve: false,
        codec: false,
        clients: 10_000,
        tick_ms: 200,
        secs: 10,
        warmup_secs: 3,
        conns: 256,
        buckets: 8,
        services: 20,
        pin: false,
        encoding: "json".into(),
        label: String::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().unwrap_or_else(|| panic!("{k} needs a value"));
        match k.as_str() {
            "--serve" => a.serve = true,
            "--codec" => a.codec = true,
            "--pin" => a.pin = true,
            "--clients" => a.clients = v().parse().expect("--clients"),
            "--tick-ms" => a.tick_ms = v().parse().expect("--tick-ms"),
            "--secs" => a.secs = v().parse().expect("--secs"),
            "--warmup-secs" => a.warmup_secs = v().parse().expect("--warmup-secs"),
            "--conns" => a.conns = v().parse().expect("--conns"),
            "--buckets" => a.buckets = v().parse().expect("--buckets"),
            "--services" => a.services = v().parse().expect("--services"),
            "--encoding" => a.encoding = v(),
            "--label" => a.label = v(),
            other => panic!("unknown argument {other}"),
        }
    }
    assert!(a.buckets <= BUCKETS_PER_SERVICE && a.conns > 0 && a.clients >= a.conns);
    a
}

/// Pins the calling thread (and the threads it starts later) to `cpu`.
fn pin_to(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes inside it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            panic!("sched_setaffinity: {}", std::io::Error::last_os_error());
        }
    }
}

/// User + system CPU seconds of process `pid` so far.
fn cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("/proc stat");
    // Fields after the command name (which ends at the last ')'): state is field 3; utime and
    // stime are fields 14 and 15.
    let rest = &stat[stat.rfind(')').expect("stat") + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap();
    // SAFETY: sysconf has no preconditions.
    ticks / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64
}

/// The 1-minute load average (`/proc/loadavg`), printed beside the figures: the machine's
/// other load weighs on them.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "?".into())
}

/// The child: controller + aggregator; prints the aggregator's URL, serves until stdin closes.
fn serve(a: &Args) -> anyhow::Result<()> {
    if a.pin {
        pin_to(0);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let dir = tempfile::tempdir()?;
        let creds = dir.path().join("client-credentials");
        let mut text = String::new();
        for s in 0..a.services {
            text += &format!("client-{s:04} service-{s:04} {}\n", secret(s));
        }
        std::fs::write(&creds, text)?;
        let ctl = Controller::start(ControllerOptions {
            state_dir: dir.path().join("state"),
            token: CONFIG_TOKEN.into(),
            report_token: Some(ZONE_SECRET.into()),
            tick: Duration::from_secs(1),
            ..Default::default()
        })
        .await?;
        let config = fixture::fleet_config(a.services * BUCKETS_PER_SERVICE, BUCKETS_PER_SERVICE);
        reqwest::Client::new()
            .put(format!("{}/v1/config", ctl.url()))
            .bearer_auth(CONFIG_TOKEN)
            .json(&config)
            .send()
            .await?
            .error_for_status()?;
        let agg = Aggregator::start(AggregatorOptions {
            controllers: vec![ctl.url()],
            zone: "z1".into(),
            region: "r1".into(),
            tick: Duration::from_secs(1),
            report_token: Some(ZONE_SECRET.into()),
            client_credentials: Some(creds),
            ..Default::default()
        })
        .await?;
        println!("{}", agg.addr());
        std::io::stdout().flush()?;
        // Until the parent closes our stdin.
        tokio::task::spawn_blocking(|| {
            let mut s = String::new();
            while std::io::stdin()
                .lock()
                .read_line(&mut s)
                .is_ok_and(|n| n > 0)
            {}
        })
        .await?;
        agg.shutdown().await;
        ctl.shutdown().await;
        anyhow::Ok(())
    })
}

/// Client `i`'s report request (headers and body), as `Reporter` would send it.
fn request(a: &Args, i: usize, host: &str) -> Vec<u8> {
    let s = i % a.services;
    let report = ClientReport {
        client_id: format!("service-{s:04}-{i:016x}"),
        service: format!("service-{s:04}"),
        version: "bench".into(),
        interval_ms: a.tick_ms.max(100),
        buckets: (0..a.buckets)
            .map(|k| {
                let b = (i + k) % BUCKETS_PER_SERVICE;
                let offered = 20 + (i * 7 + k * 13) as u64 % 200;
                let dropped = offered / 10;
                BucketCountsMsg {
                    bucket: format!("caller-{b:04}.proc"),
                    offered,
                    admitted: offered - dropped,
                    dropped,
                    shadow_dropped: 0,
                    tiers: Vec::new(),
                }
            })
            .collect(),
        urgent: false,
        calls: (0..4)
            .map(|k| CallCountMsg {
                caller: format!("caller-{:04}", (i + k) % BUCKETS_PER_SERVICE),
                procedure: "proc".into(),
                count: 20 + k as u64,
            })
            .collect(),
    };
    let (ctype, body) = encode(a, &report);
    let mut r = format!(
        "POST /v1/report HTTP/1.1\r\nhost: {host}\r\ncontent-type: {ctype}\r\ngrl-proto: {}\r\nauthorization: Bearer {}\r\ncontent-length: {}\r\n\r\n",
        proto_version(a),
        secret(s),
        body.len()
    )
    .into_bytes();
    r.extend_from_slice(&body);
    r
}

fn encode(a: &Args, r: &ClientReport) -> (&'static str, Vec<u8>) {
    match a.encoding.as_str() {
        "json" => ("application/json", serde_json::to_vec(r).unwrap()),
        "binary" => (
            grl_wire::binary::CONTENT_TYPE,
            grl_wire::binary::encode_report(r),
        ),
        e => panic!("--encoding json|binary, not {e}"),
    }
}

fn proto_version(_: &Args) -> u32 {
    grl_wire::PROTO_VERSION
}

#[derive(Default)]
struct Counts {
    ok: AtomicU64,
    errors: AtomicU64,
}

/// Reads one HTTP/1.1 response; returns its status.
async fn read_response(
    conn: &mut tokio::net::TcpStream,
    buf: &mut Vec<u8>,
) -> std::io::Result<u16> {
    buf.clear();
    let head_end = loop {
        if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break p + 4;
        }
        let mut chunk = [0u8; 4096];
        let n = conn.read(&mut chunk).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = std::str::from_utf8(&buf[..head_end]).map_err(std::io::Error::other)?;
    let status: u16 = head
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other("bad status line"))?;
    let len: usize = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())?
        })
        .ok_or_else(|| std::io::Error::other("no content-length"))?;
    let total = head_end + len;
    while buf.len() < total {
        let mut chunk = [0u8; 4096];
        let n = conn.read(&mut chunk).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    Ok(status)
}

/// One connection's clients, each reporting every tick (open loop); returns the latencies (µs)
/// of the reports due inside the measured window.
/// When reports are due: every `tick` from `start` (zero: closed loop); measured in `window`.
#[derive(Clone, Copy)]
struct Schedule {
    tick: Duration,
    start: Instant,
    window: (Instant, Instant),
}

async fn connection(
    addr: std::net::SocketAddr,
    reqs: Vec<Vec<u8>>,
    (k, conns): (usize, usize),
    plan: Schedule,
    counts: Arc<Counts>,
) -> Vec<u32> {
    let Schedule {
        tick,
        start,
        window,
    } = plan;
    let mut conn = tokio::net::TcpStream::connect(addr).await.expect("connect");
    conn.set_nodelay(true).unwrap();
    let n = reqs.len();
    // This connection's reports are spread evenly over a tick, offset by its index.
    // `--tick-ms 0`: closed loop, each connection sends its next report as soon as the
    // previous one is answered (the capacity; latency counted from the send).
    let closed = tick.is_zero();
    let step = tick / n as u32;
    let offset = tick.mul_f64(k as f64 / conns as f64) / n as u32;
    let mut lat = Vec::new();
    let mut buf = Vec::with_capacity(8192);
    let mut m: u64 = 0;
    loop {
        let due = if closed {
            Instant::now()
        } else {
            start + offset + step * (m as u32)
        };
        if due >= window.1 {
            return lat;
        }
        if due > Instant::now() {
            tokio::time::sleep_until(due.into()).await;
        }
        let req = &reqs[(m as usize) % n];
        let r = match conn.write_all(req).await {
            Ok(()) => read_response(&mut conn, &mut buf).await,
            Err(e) => Err(e),
        };
        let done = Instant::now();
        match r {
            Ok(200) => {
                // Throughput: answers within the window; latency: reports due within it.
                if done >= window.0 && done < window.1 {
                    counts.ok.fetch_add(1, Ordering::Relaxed);
                }
                if due >= window.0 {
                    lat.push(done.saturating_duration_since(due).as_micros() as u32);
                }
            }
            Ok(status) => {
                if counts.errors.fetch_add(1, Ordering::Relaxed) == 0 {
                    eprintln!(
                        "first error: HTTP {status}: {}",
                        String::from_utf8_lossy(&buf)
                    );
                }
            }
            Err(e) => {
                counts.errors.fetch_add(1, Ordering::Relaxed);
                eprintln!("connection {k}: {e}; reconnecting");
                conn = tokio::net::TcpStream::connect(addr).await.expect("connect");
                conn.set_nodelay(true).unwrap();
            }
        }
        m += 1;
    }
}

/// `--codec`: what the aggregator's decode of a report and encode of its reply cost per
/// report in each encoding, in this process (no HTTP), 200,000 times each.
fn codec(a: &Args) {
    use grl_wire::{ClientDirectives, DirectiveMsg};
    let body = |enc: &str| {
        let req = request(
            &Args {
                encoding: enc.into(),
                ..a.clone()
            },
            7,
            "h",
        );
        let at = req.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
        req[at..].to_vec()
    };
    let reply = ClientDirectives {
        version: "bench".into(),
        age_ms: Some(120),
        directives: (0..BUCKETS_PER_SERVICE)
            .map(|b| DirectiveMsg {
                bucket: format!("caller-{b:04}.proc"),
                ratio: 0.125,
                fleet_offered_rps: 1234.5,
                limit_rps: 100.0,
                fixed: false,
                shed: None,
            })
            .collect(),
    };
    let n = 200_000;
    for enc in ["json", "binary"] {
        let b = body(enc);
        let t = Instant::now();
        for _ in 0..n {
            let (r, o): (ClientReport, Vec<u8>) = if enc == "json" {
                (
                    serde_json::from_slice(&b).unwrap(),
                    serde_json::to_vec(&reply).unwrap(),
                )
            } else {
                (
                    grl_wire::binary::decode_report(&b).unwrap(),
                    grl_wire::binary::encode_directives(&reply),
                )
            };
            std::hint::black_box((r, o));
        }
        let us = t.elapsed().as_secs_f64() * 1e6 / n as f64;
        println!(
            "| {enc} | {} | {} | {us:.2} |",
            b.len(),
            if enc == "json" {
                serde_json::to_vec(&reply).unwrap().len()
            } else {
                grl_wire::binary::encode_directives(&reply).len()
            }
        );
    }
}

fn main() -> anyhow::Result<()> {
    let a = args();
    if a.serve {
        return serve(&a);
    }
    if a.codec {
        codec(&a);
        return Ok(());
    }
    let load_before = load_average();
    let mut child_args: Vec<String> = std::env::args().skip(1).collect();
    child_args.push("--serve".into());
    let mut child = std::process::Command::new(std::env::current_exe()?)
        .args(&child_args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line)?;
    let addr: std::net::SocketAddr = line.trim().parse()?;
    if a.pin {
        pin_to(1);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(if a.pin { 1 } else { 2 })
        .enable_all()
        .build()?;
    let host = addr.to_string();
    let reqs: Vec<Vec<u8>> = (0..a.clients).map(|i| request(&a, i, &host)).collect();
    let mut per_conn: Vec<Vec<Vec<u8>>> = vec![Vec::new(); a.conns];
    for (i, r) in reqs.into_iter().enumerate() {
        per_conn[i % a.conns].push(r);
    }
    let tick = Duration::from_millis(a.tick_ms);
    // A client's reports say its interval is the tick (100 ms in a closed loop).

    let counts = Arc::new(Counts::default());
    let start = Instant::now() + Duration::from_millis(200);
    let window = (
        start + Duration::from_secs(a.warmup_secs),
        start + Duration::from_secs(a.warmup_secs + a.secs),
    );
    let (lat, server_cpu, gen_cpu) = rt.block_on(async {
        let tasks: Vec<_> = per_conn
            .into_iter()
            .enumerate()
            .map(|(k, reqs)| {
                tokio::spawn(connection(
                    addr,
                    reqs,
                    (k, a.conns),
                    Schedule {
                        tick,
                        start,
                        window,
                    },
                    counts.clone(),
                ))
            })
            .collect();
        tokio::time::sleep_until(window.0.into()).await;
        let (s0, g0) = (cpu_secs(child.id()), cpu_secs(std::process::id()));
        tokio::time::sleep_until(window.1.into()).await;
        let (s1, g1) = (cpu_secs(child.id()), cpu_secs(std::process::id()));
        let mut lat = Vec::new();
        for t in tasks {
            lat.extend(t.await.expect("connection task"));
        }
        (lat, s1 - s0, g1 - g0)
    });
    drop(child.stdin.take());
    child.wait()?;
    let mut lat = lat;
    lat.sort_unstable();
    let secs = a.secs as f64;
    let q = |p: f64| {
        lat.get(((lat.len() as f64 * p) as usize).min(lat.len().saturating_sub(1)))
            .map_or(f64::NAN, |&us| us as f64 / 1000.0)
    };
    let ok = counts.ok.load(Ordering::Relaxed);
    eprintln!(
        "load average (1 min): {load_before} before, {} after",
        load_average()
    );
    println!(
        "| {} | {} | {} | {} | {:.0} | {:.0} | {:.2} | {:.2} | {:.2} | {:.2} | {:.1} | {:.2} | {} |",
        a.label,
        a.encoding,
        if a.pin { "1 + 1 (pinned)" } else { "2 shared" },
        a.clients,
        if a.tick_ms == 0 {
            f64::INFINITY
        } else {
            a.clients as f64 * 1000.0 / a.tick_ms as f64
        },
        ok as f64 / secs,
        q(0.5),
        q(0.99),
        lat.last().map_or(f64::NAN, |&us| us as f64 / 1000.0),
        server_cpu / secs,
        server_cpu * 1e6 / ok.max(1) as f64,
        gen_cpu / secs,
        counts.errors.load(Ordering::Relaxed),
    );
    Ok(())
}
