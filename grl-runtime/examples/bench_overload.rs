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

use test_support::overload::{paced, spawn_pool, Answer};
use test_support::process::{free_port, Proc};
use test_support::wait::wait_up;

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
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
        let _py = spawn_pool(dir.path(), py_port, 4, 20);
        let upstream = format!("http://127.0.0.1:{py_port}");
        wait_up(&format!("{upstream}/")).await;
        let (port, admin) = (free_port(), free_port());
        let _sidecar = spawn_sidecar(&grl, port, admin, &upstream, limit);
        wait_up(&format!("http://127.0.0.1:{admin}/healthz")).await;
        let url = format!("http://127.0.0.1:{port}/");
        let log: Arc<Mutex<Vec<Answer>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let tasks = [
            paced(
                url.clone(),
                0,
                Arc::new(Mutex::new(120.0)),
                log.clone(),
                stop.clone(),
            ),
            paced(
                url.clone(),
                1,
                Arc::new(Mutex::new(240.0)),
                log.clone(),
                stop.clone(),
            ),
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
