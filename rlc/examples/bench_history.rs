//! Benchmark of `rlc preview` against a real Prometheus (docs/rlc-history-bench.md).
//!
//! `cargo run --release -p rlc --example bench_history -- N [DAYS]` backfills N gauge series
//! `rpc_rps{service,caller,procedure}` × DAYS (28 default) at 1 m with promtool, starts a
//! throwaway Prometheus, writes an rlc.yaml and config repo, then runs
//! `/usr/bin/time -v <target>/release/rlc preview --format json` against it and prints the wall
//! time, peak memory and the plan's size; with a third argument (e.g. `1h`) it runs again with
//! `history.prometheus.downsample` set. Build the binary first: `cargo build --release -p rlc`.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use rlc::history::synth::Profile;
use test_support::prometheus::{OpenMetricsWriter, Prometheus};

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(100);
    let days: i64 = args.next().map(|a| a.parse()).transpose()?.unwrap_or(28);
    // Optional: `downsample` value (e.g. 1h) for server-side reduction.
    let downsample = args.next();
    let dir = tempfile::Builder::new().prefix("rlc-bench-").tempdir()?;
    let end = chrono::Utc::now().timestamp() / 60 * 60 - 60;
    let start = end - days * 86_400 - 600;

    let t0 = Instant::now();
    let mut w = OpenMetricsWriter::create(&dir.path().join("h.om"))?;
    w.family("rpc_rps", "gauge")?;
    for i in 0..n {
        let (service, caller) = (format!("svc-{}", i / 20), format!("caller-{}", i % 20));
        let p = Profile {
            base_rps: 10.0 + (i % 97) as f64,
            noise: 0.05,
            ..Default::default()
        };
        let mut t = start;
        while t <= end {
            let v = (p.sample(t, start, 1, i as u64) * 1000.0).round() / 1000.0;
            w.sample(
                "rpc_rps",
                &[
                    ("service", &service),
                    ("caller", &caller),
                    ("procedure", "call"),
                ],
                v,
                t,
            )?;
            t += 60;
        }
    }
    let om = w.finish()?;
    let generated = t0.elapsed();
    let t1 = Instant::now();
    let prom = Prometheus::start(&om)?;
    let backfilled = t1.elapsed();
    std::fs::remove_file(&om)?;

    let repo = dir.path().join("repo");
    std::fs::create_dir_all(repo.join("rlc"))?;
    std::fs::write(repo.join("rlc/policies.yaml"), "default:\n  policy: peak\n")?;
    let cfg = dir.path().join("rlc.yaml");
    std::fs::write(
        &cfg,
        format!(
            "history:\n  prometheus:\n    url: {}\n    query: 'rpc_rps'\n{}  lookback: {days}d\n  step: 1m\nconfig_repo:\n  path: repo\n",
            prom.url,
            downsample.as_ref().map(|d| format!("    downsample: {d}\n")).unwrap_or_default()
        ),
    )?;
    let exe = std::env::current_exe()?;
    let rlc: PathBuf = exe
        .parent()
        .and_then(|p| p.parent())
        .map(|p| p.join("rlc"))
        .unwrap();
    eprintln!("{n} series × {days} d: generated in {generated:.1?}, backfilled + started in {backfilled:.1?}");
    for (label, ds) in [("per-minute", None), ("downsample", downsample.as_deref())] {
        if label == "downsample" && ds.is_none() {
            break;
        }
        let text = std::fs::read_to_string(&cfg)?;
        let text = match ds {
            None => text
                .lines()
                .filter(|l| !l.contains("downsample"))
                .collect::<Vec<_>>()
                .join("\n"),
            Some(_) => text,
        };
        let run_cfg = dir.path().join(format!("rlc-{label}.yaml"));
        std::fs::write(&run_cfg, text)?;
        println!("== {label}");
        run(&rlc, &run_cfg)?;
    }
    Ok(())
}

fn run(rlc: &std::path::Path, cfg: &std::path::Path) -> anyhow::Result<()> {
    let out = Command::new("/usr/bin/time")
        .arg("-v")
        .arg(rlc)
        .args(["preview", "--format", "json", "--config"])
        .arg(cfg)
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    for line in stderr.lines() {
        if line.contains("Elapsed (wall clock)")
            || line.contains("Maximum resident")
            || line.contains("Exit status")
            || line.contains("User time")
            || line.contains("System time")
        {
            println!("{}", line.trim());
        }
    }
    if !out.status.success() {
        let tail: Vec<&str> = stderr.lines().rev().take(12).collect();
        println!(
            "rlc failed:\n{}",
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
    }
    let plan: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    println!(
        "plan: {} buckets, {} skipped",
        plan["buckets"].as_array().map_or(0, |a| a.len()),
        plan["skipped"].as_array().map_or(0, |a| a.len())
    );
    Ok(())
}
