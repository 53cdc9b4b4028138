//! What adding an override costs as overrides accumulate: a controller (in process, real HTTP
//! on loopback, state directory on disk with its fsyncs) with 20 services of 11 buckets, and
//! N traffic overrides on distinct callers of one service added one after the other. Prints
//! the add latency (p50, p99, max) per range of overrides already active, the process's CPU
//! time per add (p50: what the add costs whatever else runs on the machine), the served
//! config's size and the process's RSS.
//!
//! `cargo run --release -p grl-runtime --example override_scale [N]` (N = 3000 by default)

use std::time::{Duration, Instant};

use grl_control::controller::{Controller, ControllerOptions};
use serde_json::json;

const TOKEN: &str = "override-scale-token";

fn rss_mb() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

/// User + system CPU time of this process, in milliseconds.
fn cpu_ms() -> f64 {
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage fills the struct it is given.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let ms = |t: libc::timeval| t.tv_sec as f64 * 1000.0 + t.tv_usec as f64 / 1000.0;
    ms(u.ru_utime) + ms(u.ru_stime)
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let n: usize = std::env::args()
        .nth(1)
        .map(|a| a.parse())
        .transpose()?
        .unwrap_or(3000);
    let dir = tempfile::tempdir()?;
    let c = Controller::start(ControllerOptions {
        state_dir: dir.path().join("state"),
        token: TOKEN.into(),
        allow_anonymous_reports: true,
        max_overrides: n,
        ..Default::default()
    })
    .await?;
    let services: Vec<_> = (0..20)
        .map(|s| {
            let mut buckets: Vec<_> = (0..10)
                .map(|b| {
                    json!({"name": format!("c{b}.p{b}"), "caller": format!("c{b}"),
                           "procedure": format!("p{b}"), "scope": "global", "limit_rps": 100.0,
                           "mode": "enforce", "policy": "peak"})
                })
                .collect();
            buckets.push(
                json!({"name": "search", "procedure": "search", "scope": "global",
                                "limit_rps": 100.0, "mode": "enforce", "policy": "peak"}),
            );
            json!({"service": format!("svc-{s}"), "buckets": buckets})
        })
        .collect();
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()?;
    let r = http
        .put(format!("{}/v1/config", c.url()))
        .bearer_auth(TOKEN)
        .json(&json!({"version": "v1", "services": services}))
        .send()
        .await?;
    anyhow::ensure!(r.status() == 200, "config: {}", r.text().await?);
    let ranges = [0, 500, 1000, 2000, 3000, usize::MAX];
    let mut lat: Vec<Vec<f64>> = vec![Vec::new(); ranges.len() - 1];
    let mut cpu: Vec<Vec<f64>> = vec![Vec::new(); ranges.len() - 1];
    for i in 0..n {
        let body = json!({"service": "svc-0", "caller": format!("batch-{i}"), "limit_rps": 5.0,
                          "ttl_secs": 3600, "reason": "scale", "who": "bench"});
        let (t, cpu0) = (Instant::now(), cpu_ms());
        let r = http
            .post(format!("{}/v1/overrides", c.url()))
            .bearer_auth(TOKEN)
            .json(&body)
            .send()
            .await?;
        let ms = t.elapsed().as_secs_f64() * 1000.0;
        let cpu_used = cpu_ms() - cpu0;
        anyhow::ensure!(r.status() == 201, "override {i}: {}", r.text().await?);
        let k = ranges
            .windows(2)
            .position(|w| i >= w[0] && i < w[1])
            .unwrap();
        lat[k].push(ms);
        cpu[k].push(cpu_used);
    }
    println!("| overrides active before the add | adds | p50 ms | p99 ms | max ms | CPU ms per add (p50) |");
    println!("|---|---:|---:|---:|---:|---:|");
    for (k, v) in lat.iter_mut().enumerate() {
        if v.is_empty() {
            continue;
        }
        let to = if ranges[k + 1] == usize::MAX {
            n
        } else {
            ranges[k + 1]
        };
        let (p50, p99) = (pct(v, 0.5), pct(v, 0.99));
        let max = v.iter().cloned().fold(0.0, f64::max);
        let c50 = pct(&mut cpu[k], 0.5);
        println!(
            "| {}–{} | {} | {p50:.2} | {p99:.2} | {max:.2} | {c50:.2} |",
            ranges[k],
            to - 1,
            v.len()
        );
    }
    let served = http
        .get(format!("{}/v1/config", c.url()))
        .send()
        .await?
        .bytes()
        .await?;
    println!(
        "served config {:.2} MB, RSS {:.0} MB",
        served.len() as f64 / 1e6,
        rss_mb()
    );
    c.shutdown().await;
    Ok(())
}
