//! Benchmark of `rlc preview` against a real Prometheus (docs/rlc-history-bench.md).
//!
//! `cargo run --release -p rlc --example bench_history -- N [DAYS] [DOWNSAMPLE] [options]`
//! backfills N gauge series `rpc_rps{service,caller,procedure}` × DAYS (28 default) with
//! promtool, one UTC day per OpenMetrics part (written, backfilled as one 24 h block, deleted:
//! temporary disk stays at about two days of text), starts a throwaway Prometheus on the
//! blocks, writes an rlc.yaml and config repo, then runs `/usr/bin/time -v RLC preview
//! --format json` against it and prints the wall time, CPU, peak memory and the plan's size and
//! digest; with DOWNSAMPLE (e.g. `1h`) it runs again with `history.prometheus.downsample` set.
//!
//! Options:
//! - `--data DIR`: keep the TSDB in DIR and reuse it when DIR already holds the same set
//!   (N, DAYS, `--every`): generation and backfill take minutes at 10,000 series.
//! - `--every SECS`: spacing of the generated samples (default 60; 3600 for an hourly set).
//! - `--step D`: `history.step` of the pulls (default `1m`).
//! - `--rlc PATH[@API]` (repeatable): the binaries to measure side by side, in turn on each
//!   pull (default: the `rlc` next to this example's directory, `target/release/rlc`); with
//!   `@API`, that run sets `history.prometheus.api` (`query_range`, `remote_read`, `auto`), so
//!   that one binary can be measured on both APIs in one run.
//! - `--no-raw`: skip the pull without downsample.
//! - `--repeat K`: run each (pull, binary) K times.
//! - `--extra YAML`: lines added under `history.prometheus` (e.g. `batch_series: 1000`).
//! - `--incremental K`: instead of `rlc preview`, measure `rlc serve`'s history snapshot in
//!   this process (docs/rlc-history-bench.md, "Incremental pulls"): a full pull of the
//!   lookback ending an hour ago, then K pulls 5 minutes apart (increments merged into the
//!   held history), then a full pull at the last one's end by a fresh snapshot; prints the
//!   wall and CPU seconds of each, the CPU share of the increments over K × 5 minutes, the
//!   RSS holding the history (and its peaks: during the increments, the plan, the fresh
//!   full pull), and the digests of both plans and histories. `--api API` sets
//!   `history.prometheus.api` for it. With `RUST_LOG=info` the daemon's log lines go to
//!   stderr (each increment's pull and write seconds).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context};
use rlc::history::synth::Profile;
use test_support::prometheus::{OpenMetricsWriter, Prometheus};

struct Args {
    n: usize,
    days: i64,
    downsample: Option<String>,
    data: Option<PathBuf>,
    every: i64,
    step: String,
    rlc: Vec<PathBuf>,
    raw: bool,
    repeat: usize,
    extra: String,
    incremental: Option<usize>,
    api: Option<String>,
}

fn args() -> anyhow::Result<Args> {
    let mut a = Args {
        n: 100,
        days: 28,
        downsample: None,
        data: None,
        every: 60,
        step: "1m".into(),
        rlc: Vec::new(),
        raw: true,
        repeat: 1,
        extra: String::new(),
        incremental: None,
        api: None,
    };
    let mut positional = 0;
    let mut it = std::env::args().skip(1);
    while let Some(x) = it.next() {
        let mut val = || it.next().with_context(|| format!("{x} needs a value"));
        match x.as_str() {
            "--data" => a.data = Some(val()?.into()),
            "--every" => a.every = val()?.parse()?,
            "--step" => a.step = val()?,
            "--rlc" => a.rlc.push(val()?.into()),
            "--no-raw" => a.raw = false,
            "--repeat" => a.repeat = val()?.parse()?,
            "--extra" => a.extra.push_str(&format!("    {}\n", val()?)),
            "--incremental" => a.incremental = Some(val()?.parse()?),
            "--api" => a.api = Some(val()?),
            _ if x.starts_with("--") => bail!("unknown option {x}"),
            _ => {
                match positional {
                    0 => a.n = x.parse()?,
                    1 => a.days = x.parse()?,
                    2 => a.downsample = Some(x),
                    _ => bail!("too many arguments"),
                }
                positional += 1;
            }
        }
    }
    if a.rlc.is_empty() {
        let exe = std::env::current_exe()?;
        a.rlc.push(
            exe.parent()
                .and_then(|p| p.parent())
                .map(|p| p.join("rlc"))
                .context("no rlc next to the example")?,
        );
    }
    Ok(a)
}

fn main() -> anyhow::Result<()> {
    let a = args()?;
    let dir = tempfile::Builder::new().prefix("rlc-bench-").tempdir()?;
    let data = a.data.clone().unwrap_or_else(|| dir.path().join("tsdb"));
    let marker = data.join(format!("bench-{}x{}d-every{}s", a.n, a.days, a.every));
    if marker.exists() {
        eprintln!("reusing {}", data.display());
    } else {
        if data.exists() && std::fs::read_dir(&data)?.next().is_some() {
            bail!(
                "{} holds another data set; remove it or name another --data",
                data.display()
            );
        }
        generate(&a, &data, dir.path())?;
        std::fs::write(&marker, "")?;
    }
    let t = Instant::now();
    let prom = Prometheus::on_data(&data, "24h")?;
    eprintln!("prometheus ready in {:.1?}", t.elapsed());

    let repo = dir.path().join("repo");
    std::fs::create_dir_all(repo.join("rlc"))?;
    std::fs::write(repo.join("rlc/policies.yaml"), "default:\n  policy: peak\n")?;
    if let Some(k) = a.incremental {
        return incremental(&a, &prom.url, dir.path(), k);
    }
    let mut pulls: Vec<(&str, Option<&str>)> = Vec::new();
    if a.raw {
        pulls.push(("raw", None));
    }
    if let Some(d) = &a.downsample {
        pulls.push(("downsample", Some(d)));
    }
    for (label, ds) in pulls {
        let cfg = dir.path().join(format!("rlc-{label}.yaml"));
        std::fs::write(
            &cfg,
            format!(
                "history:\n  prometheus:\n    url: {}\n    query: 'rpc_rps'\n{}{}  lookback: {}d\n  step: {}\nconfig_repo:\n  path: repo\n",
                prom.url,
                ds.map(|d| format!("    downsample: {d}\n")).unwrap_or_default(),
                a.extra,
                a.days,
                a.step,
            ),
        )?;
        for _ in 0..a.repeat {
            for rlc in &a.rlc {
                println!(
                    "== {} series, step {}, {label}{}: {}",
                    a.n,
                    a.step,
                    ds.map(|d| format!(" {d}")).unwrap_or_default(),
                    rlc.display()
                );
                let text = rlc.to_string_lossy();
                let (rlc, cfg) = match text.rsplit_once('@') {
                    Some((bin, api)) => {
                        let with_api = dir.path().join(format!("rlc-{label}-{api}.yaml"));
                        let base = std::fs::read_to_string(&cfg)?;
                        std::fs::write(
                            &with_api,
                            base.replacen(
                                "  prometheus:\n",
                                &format!("  prometheus:\n    api: {api}\n"),
                                1,
                            ),
                        )?;
                        (PathBuf::from(bin), with_api)
                    }
                    None => (rlc.clone(), cfg.clone()),
                };
                run(&rlc, &cfg)?;
            }
        }
    }
    Ok(())
}

/// Writes and backfills the set one UTC day at a time (each part one 24 h block), the next
/// part written while promtool backfills the previous one.
fn generate(a: &Args, data: &Path, tmp: &Path) -> anyhow::Result<()> {
    // The set runs 3 h past now, so that reruns within the session see full windows.
    let end = (chrono::Utc::now().timestamp() + 3 * 3600) / a.every * a.every;
    let start = end - a.days * 86_400 - 86_400;
    let t0 = Instant::now();
    let mut pending: Option<std::thread::JoinHandle<anyhow::Result<()>>> = None;
    let mut bytes = 0u64;
    for day in start.div_euclid(86_400)..=end.div_euclid(86_400) {
        let (from, to) = ((day * 86_400).max(start), ((day + 1) * 86_400 - 1).min(end));
        let path = tmp.join(format!("part-{day}.om"));
        let mut w = OpenMetricsWriter::create(&path)?;
        w.family("rpc_rps", "gauge")?;
        for i in 0..a.n {
            let (service, caller) = (format!("svc-{}", i / 20), format!("caller-{}", i % 20));
            let p = Profile {
                base_rps: 10.0 + (i % 97) as f64,
                noise: 0.05,
                ..Default::default()
            };
            let mut t = from.div_euclid(a.every) * a.every;
            if t < from {
                t += a.every;
            }
            while t <= to {
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
                t += a.every;
            }
        }
        let om = w.finish()?;
        bytes += std::fs::metadata(&om)?.len();
        if let Some(h) = pending.take() {
            h.join().expect("backfill thread")?;
        }
        let data = data.to_path_buf();
        pending = Some(std::thread::spawn(move || {
            let r = Prometheus::backfill(&om, &data, "24h");
            std::fs::remove_file(&om)?;
            r
        }));
    }
    if let Some(h) = pending.take() {
        h.join().expect("backfill thread")?;
    }
    eprintln!(
        "{} series × {} d every {} s: {:.1} GB of OpenMetrics written and backfilled in {:.1?}",
        a.n,
        a.days,
        a.every,
        bytes as f64 / 1e9,
        t0.elapsed()
    );
    Ok(())
}

fn run(rlc: &Path, cfg: &Path) -> anyhow::Result<()> {
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
        // rlc's own lines (its error), not the report of /usr/bin/time after them.
        let own: Vec<&str> = stderr
            .lines()
            .take_while(|l| !l.contains("Command being timed"))
            .collect();
        let tail = &own[own.len().saturating_sub(12)..];
        println!("rlc failed:\n{}", tail.join("\n"));
        return Ok(());
    }
    let plan: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    // The digest of what was planned, to show that the binaries compared plan the same.
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    plan["buckets"].to_string().hash(&mut h);
    plan["skipped"].to_string().hash(&mut h);
    println!(
        "plan: {} buckets, {} skipped, digest {:016x}",
        plan["buckets"].as_array().map_or(0, |a| a.len()),
        plan["skipped"].as_array().map_or(0, |a| a.len()),
        h.finish()
    );
    Ok(())
}

/// CPU seconds (user + system) of this process so far.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command's closing parenthesis: utime and stime are the 12th and 13th.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    (ticks(11) + ticks(12)) / hz
}

/// `VmRSS` and `VmHWM` of this process, in MB.
fn rss_mb() -> (f64, f64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kb = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
            / 1024.0
    };
    (kb("VmRSS:"), kb("VmHWM:"))
}

/// Resets `VmHWM` to the current RSS (`/proc/self/clear_refs`), so that the next peak read
/// is the peak since.
fn reset_peak() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// A digest of a plan's buckets and skipped list (as [`run`] prints for `rlc preview`).
fn plan_digest(plan: &rlc_plan::plan::Plan) -> anyhow::Result<String> {
    use std::hash::{Hash, Hasher};
    let v = serde_json::to_value(plan)?;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    v["buckets"].to_string().hash(&mut h);
    v["skipped"].to_string().hash(&mut h);
    Ok(format!("{:016x}", h.finish()))
}

/// A digest of a history's grid, series (values as bits) and rejected series, read one
/// service at a time (a history held on disk is not read into memory whole).
fn history_digest(h: &dyn rlc_plan::history::SeriesSource, grid: (i64, i64, usize)) -> String {
    use std::hash::{Hash, Hasher};
    let mut d = std::collections::hash_map::DefaultHasher::new();
    grid.hash(&mut d);
    for service in h.services() {
        let one = h.service(&service).expect("the history reads");
        for (k, s) in one.service_series(&service) {
            k.hash(&mut d);
            for v in &s.values {
                v.to_bits().hash(&mut d);
            }
        }
    }
    format!("{:?}", h.rejected()).hash(&mut d);
    format!("{:016x}", d.finish())
}

/// `rlc serve`'s snapshot in this process: a full pull, `k` increments 5 minutes apart, and a
/// fresh full pull at the last increment's end, each measured; both plans' digests.
fn incremental(a: &Args, url: &str, dir: &Path, k: usize) -> anyhow::Result<()> {
    use rlc::history::snapshot::HistoryCache;
    // The daemon's log lines (per pull: `history pulled`, `history increment written` with
    // its pull and write seconds, `history held on disk`) with RUST_LOG=info.
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .try_init();
    }
    let cfg_path = dir.join("rlc-incremental.yaml");
    std::fs::write(
        &cfg_path,
        format!(
            "history:\n  prometheus:\n    url: {url}\n    query: 'rpc_rps'\n{}{}  lookback: {}d\n  step: {}\nconfig_repo:\n  path: repo\n",
            a.api.as_ref().map(|x| format!("    api: {x}\n")).unwrap_or_default(),
            a.extra,
            a.days,
            a.step,
        ),
    )?;
    let (cfg, base) = rlc::config::load_config(&cfg_path)?;
    let (repo, diags) = schema::ConfigRepo::load(&dir.join("repo"));
    if !diags.is_empty() {
        bail!("config repo: {}", schema::Diagnostics(diags));
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let at = |t: i64| chrono::DateTime::<chrono::Utc>::from_timestamp(t, 0).expect("a time");
    // The set runs 3 h past the time it was generated: an hour ago and the hour after are in.
    let end0 = (chrono::Utc::now().timestamp() - 3600) / 60 * 60;
    let measure = |cache: &HistoryCache, t: i64| {
        let (c0, w0) = (cpu_seconds(), Instant::now());
        let snap = rt.block_on(cache.refresh_at(at(t)));
        (snap, w0.elapsed().as_secs_f64(), cpu_seconds() - c0)
    };
    let held = HistoryCache::new(cfg.clone(), &base);
    let (snap, wall, cpu) = measure(&held, end0);
    if let Some(e) = snap.history.source_error() {
        bail!("the full pull failed: {e}");
    }
    let (rss, hwm) = rss_mb();
    println!(
        "full pull ({}): {} series × {} points, wall {wall:.2} s, rlc CPU {cpu:.2} s; RSS {rss:.0} MB (peak {hwm:.0} MB)",
        snap.kind,
        snap.history.series_count(),
        snap.history.grid().2
    );
    // From here, the peaks are those since the full pull.
    reset_peak();
    let (mut walls, mut cpus) = (Vec::new(), Vec::new());
    let mut end = end0;
    for i in 1..=k {
        end += 300;
        let (snap, wall, cpu) = measure(&held, end);
        if let Some(e) = snap.history.source_error() {
            bail!("increment {i} failed: {e}");
        }
        let (rss, hwm) = rss_mb();
        println!(
            "pull {i} (+{} min, {}): wall {wall:.2} s, rlc CPU {cpu:.2} s; RSS {rss:.0} MB (peak since the full pull {hwm:.0} MB)",
            i * 5,
            snap.kind
        );
        walls.push(wall);
        cpus.push(cpu);
    }
    let total_cpu: f64 = cpus.iter().sum();
    let max_wall = walls.iter().cloned().fold(0.0, f64::max);
    println!(
        "increments: wall max {max_wall:.2} s, mean {:.2} s; rlc CPU {total_cpu:.2} s over {} min = {:.2} % of a core",
        walls.iter().sum::<f64>() / k.max(1) as f64,
        k * 5,
        100.0 * total_cpu / (k as f64 * 300.0)
    );
    let merged = held.latest().expect("a snapshot").history.clone();
    let (rss, _) = rss_mb();
    println!("RSS holding the history after the increments: {rss:.0} MB");
    reset_peak();
    let (c0, w0) = (cpu_seconds(), Instant::now());
    let plan_inc = rlc_plan::compute::compute_plan(&cfg, &repo, &*merged, at(end));
    println!(
        "plan from the held history: {} buckets, digest {}, computed in {:.2} s (CPU {:.2} s); history digest {}",
        plan_inc.buckets.len(),
        plan_digest(&plan_inc)?,
        w0.elapsed().as_secs_f64(),
        cpu_seconds() - c0,
        history_digest(&*merged, merged.grid())
    );
    drop(plan_inc);
    let (rss, hwm) = rss_mb();
    println!(
        "RSS holding the history (one snapshot, no pull in flight): {rss:.0} MB (peak while computing the plan {hwm:.0} MB)"
    );
    reset_peak();
    let fresh = HistoryCache::new(cfg.clone(), &base);
    let (snap, wall, cpu) = measure(&fresh, end);
    let peak_full = rss_mb().1;
    let plan_full = rlc_plan::compute::compute_plan(&cfg, &repo, &*snap.history, at(end));
    println!(
        "full pull at the same end ({}): wall {wall:.2} s, rlc CPU {cpu:.2} s; peak RSS {:.0} MB; plan digest {}, history digest {}",
        snap.kind,
        peak_full,
        plan_digest(&plan_full)?,
        history_digest(&*snap.history, snap.history.grid())
    );
    Ok(())
}
