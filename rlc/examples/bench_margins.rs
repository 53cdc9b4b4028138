//! What `headroom: auto` costs a run: the plan of a generated fleet (`compute_plan`, the
//! computation of `rlc run` and `rlc preview` once the history is pulled) with a fixed margin
//! and with `auto`, side by side on the same history, for `peak` and `forecast`.
//!
//! ```sh
//! cargo run --release -p rlc --example bench_margins -- [SERVICES] [DAYS] [RUNS]
//! ```
//!
//! Defaults: 1,000 services × 10 buckets (10,000 series) at one minute over 28 days, 3 runs of
//! each side, alternated, each run's history 5 minutes later than the one before (the window
//! slides, as a daemon's on a `*/5` schedule). Prints the fixed margin's median wall time,
//! `auto`'s first run (every bucket replayed) and its later runs (the day's margins found in
//! the memo), and the ratios.

use std::time::{Duration, Instant};

use chrono::{TimeZone, Utc};
use policies::RateSeries;
use rlc::history::synth::Profile;
use rlc_plan::compute::compute_plan;
use rlc_plan::history::{History, SeriesKey};
use schema::{ConfigRepo, DaemonConfig};

/// The fleet's history over `days` ending at `end` (one minute a step).
fn fleet(n: usize, days: i64, end: i64) -> History {
    let step = 60;
    let len = (days * 86_400 / step) as usize;
    let start = end - len as i64 * step;
    let mut series = std::collections::BTreeMap::new();
    for i in 0..n {
        for j in 0..10 {
            let p = Profile {
                base_rps: 50.0 + (i * 10 + j) as f64 % 400.0,
                noise: 0.05,
                growth_per_day: if j % 3 == 0 { 0.01 } else { 0.0 },
                ..Default::default()
            };
            // Anchored at a fixed origin: a later window sees the same values where it overlaps.
            let origin = end.div_euclid(86_400) * 86_400 - 40 * 86_400;
            let values = (0..len)
                .map(|k| p.sample(start + k as i64 * step, origin, 7, (i * 10 + j) as u64) as f32)
                .collect();
            series.insert(
                SeriesKey {
                    service: format!("svc{i:04}"),
                    caller: Some(format!("caller{j}")),
                    procedure: Some(format!("proc{j}")),
                },
                RateSeries {
                    start,
                    step,
                    values,
                },
            );
        }
    }
    History {
        start,
        step,
        len,
        series,
        rejected: vec![],
        source_error: None,
    }
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let mut next = |d: i64| -> anyhow::Result<i64> {
        Ok(args.next().map(|a| a.parse()).transpose()?.unwrap_or(d))
    };
    let (n, days, runs) = (next(1000)? as usize, next(28)?, next(3)? as usize);
    // Noon of today (UTC); run r sees the history 5 × r minutes later, as a daemon on a
    // `*/5` schedule does.
    let noon = Utc::now().timestamp().div_euclid(86_400) * 86_400 + 43_200;
    let histories: Vec<History> = (0..runs as i64)
        .map(|r| fleet(n, days, noon + r * 300))
        .collect();
    let cfg: DaemonConfig = serde_yaml::from_str(&format!(
        "history:\n  file: x.csv\n  step: 60s\n  lookback: {days}d\nconfig_repo:\n  path: repo\n"
    ))?;
    println!(
        "fleet: {n} services × 10 buckets, {} points per series (1 m grid, {days} days)",
        histories[0].len
    );
    for policy in ["peak", "forecast"] {
        let mut sides = Vec::new();
        for headroom in ["0.25", "auto"] {
            let dir = tempfile::tempdir()?;
            std::fs::create_dir_all(dir.path().join("rlc"))?;
            std::fs::write(
                dir.path().join("rlc/policies.yaml"),
                format!("default:\n  policy: {policy}\n  headroom: {headroom}\n"),
            )?;
            let (repo, diags) = ConfigRepo::load(dir.path());
            anyhow::ensure!(diags.is_empty(), "{}", schema::Diagnostics(diags));
            sides.push((headroom, dir, repo, Vec::<Duration>::new()));
        }
        let mut margins = Vec::new();
        for (r, history) in histories.iter().enumerate() {
            let now = Utc.timestamp_opt(noon + r as i64 * 300, 0).unwrap();
            for (_, _, repo, times) in sides.iter_mut() {
                let t = Instant::now();
                let plan = compute_plan(&cfg, repo, history, now);
                times.push(t.elapsed());
                margins = plan
                    .buckets
                    .iter()
                    .filter_map(|b| b.evidence.policy.as_ref()?.figures().headroom)
                    .collect::<Vec<f64>>();
                std::hint::black_box(plan);
            }
        }
        let median = |v: &[Duration]| {
            let mut v = v.to_vec();
            v.sort();
            v[v.len() / 2].as_secs_f64()
        };
        let fixed = median(&sides[0].3);
        // The first auto run replays every bucket; the later ones find the day's margins in
        // the memo (as a daemon's runs after the day's first do).
        let cold = sides[1].3[0].as_secs_f64();
        let warm = (runs > 1).then(|| median(&sides[1].3[1..]));
        margins.sort_by(f64::total_cmp);
        println!(
            "{policy:<8} headroom 0.25: {fixed:.2} s; auto, first run of the day: {cold:.2} s ({:.1}×), later runs: {}; auto margins: median {:.3}, max {:.3}",
            cold / fixed,
            warm.map_or("-".into(), |w| format!("{w:.2} s ({:.2}×)", w / fixed)),
            margins.get(margins.len() / 2).copied().unwrap_or(f64::NAN),
            margins.last().copied().unwrap_or(f64::NAN)
        );
    }
    Ok(())
}
