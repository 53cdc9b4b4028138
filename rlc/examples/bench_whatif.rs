//! Benchmark of the what-if previews (`POST /v1/previews`, [`rlc_plan::whatif::preview`]) on a
//! generated fleet: a what-if for one service (a headroom patch) against the same what-if for
//! the whole fleet, side by side on the same inputs.
//!
//! ```sh
//! cargo run --release -p rlc --example bench_whatif -- [SERVICES] [STEP_SECS] [DAYS] [RUNS]
//! ```
//!
//! Defaults: 1,000 services × 10 buckets, a 15-minute grid over 28 days (the history of the
//! whole fleet stays in memory: 10,000 series), 20 runs of the one-service what-if. The time
//! of a one-service what-if grows with that service's points only: run with `100 60 28` for
//! the per-minute grid.

use std::time::{Duration, Instant};

use chrono::{TimeZone, Utc};
use policies::RateSeries;
use rlc::history::synth::Profile;
use rlc_plan::compute::compute_plan;
use rlc_plan::history::{History, SeriesKey};
use rlc_plan::whatif::{preview, Inputs};
use schema::{ConfigRepo, DaemonConfig};

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let mut next = |d: i64| -> anyhow::Result<i64> {
        Ok(args.next().map(|a| a.parse()).transpose()?.unwrap_or(d))
    };
    let (n, step, days, runs) = (
        next(1000)? as usize,
        next(900)?,
        next(28)?,
        next(20)? as usize,
    );
    let dir = tempfile::tempdir()?;
    std::fs::create_dir_all(dir.path().join("buckets"))?;
    std::fs::create_dir_all(dir.path().join("rlc"))?;
    std::fs::write(
        dir.path().join("rlc/policies.yaml"),
        "default:\n  policy: peak\n  headroom: 0.2\n",
    )?;
    let end = Utc::now().timestamp() / step * step;
    let len = (days * 86_400 / step) as usize;
    let start = end - len as i64 * step;
    let mut series = std::collections::BTreeMap::new();
    for i in 0..n {
        let service = format!("svc{i:04}");
        let mut f = schema::BucketFile {
            criticality: Default::default(),
            service: service.clone(),
            buckets: Vec::new(),
        };
        for j in 0..10 {
            let p = Profile {
                base_rps: 50.0 + (i * 10 + j) as f64 % 400.0,
                noise: 0.05,
                ..Default::default()
            };
            let values = (0..len)
                .map(|k| p.sample(start + k as i64 * step, start, 7, (i * 10 + j) as u64) as f32)
                .collect();
            series.insert(
                SeriesKey {
                    service: service.clone(),
                    caller: Some(format!("caller{j}")),
                    procedure: Some(format!("proc{j}")),
                },
                RateSeries {
                    start,
                    step,
                    values,
                },
            );
            f.buckets.push(schema::Bucket {
                name: format!("caller{j}.proc{j}"),
                caller: Some(format!("caller{j}")),
                procedure: Some(format!("proc{j}")),
                scope: schema::Scope::Global,
                limit_rps: 100.0,
                mode: schema::Mode::Enforce,
                policy: schema::PolicyName::Peak,
            });
        }
        std::fs::write(
            dir.path().join("buckets").join(format!("{service}.yaml")),
            schema::render_bucket_file(&f),
        )?;
    }
    let history = History {
        start,
        step,
        len,
        series,
        rejected: vec![],
        source_error: None,
    };
    let (repo, diags) = ConfigRepo::load(dir.path());
    anyhow::ensure!(diags.is_empty(), "{}", schema::Diagnostics(diags));
    let cfg: DaemonConfig = serde_yaml::from_str(&format!(
        "history:\n  file: x.csv\n  step: {step}s\n  lookback: {days}d\nconfig_repo:\n  path: repo\n"
    ))?;
    let now = Utc.timestamp_opt(end, 0).unwrap();
    let t = Instant::now();
    let current = compute_plan(&cfg, &repo, &history, now);
    let fleet_plan = t.elapsed();
    let inputs = Inputs {
        cfg,
        repo,
        world: rlc_plan::pipeline::World::none(),
    };

    let one = format!(
        r#"{{"services": ["svc{:04}"], "policies": {{"patch": {{"services": {{"svc{:04}": {{"headroom": 0.5}}}}}}}}}}"#,
        n / 2,
        n / 2
    );
    let all = r#"{"policies": {"patch": {"default": {"headroom": 0.5}}}}"#;
    let time = |body: &str, runs: usize| -> anyhow::Result<Vec<Duration>> {
        let mut v = Vec::with_capacity(runs);
        for _ in 0..runs {
            let t = Instant::now();
            let a = preview(
                &inputs,
                &history,
                &current,
                body.as_bytes(),
                Some("application/json"),
                now,
            )
            .map_err(|p| anyhow::anyhow!("{p}: {:?}", p.problems))?;
            v.push(t.elapsed());
            std::hint::black_box(a);
        }
        v.sort();
        Ok(v)
    };
    let one_t = time(&one, runs)?;
    let all_t = time(all, 3)?;
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let median = |v: &[Duration]| ms(v[v.len() / 2]);
    println!(
        "fleet: {n} services × 10 buckets, {len} points per series ({step} s grid, {days} days)"
    );
    println!(
        "current plan of the fleet (compute_plan): {:.1} ms",
        ms(fleet_plan)
    );
    println!(
        "what-if for one service: median {:.2} ms, max {:.2} ms over {runs} runs",
        median(&one_t),
        ms(*one_t.last().unwrap())
    );
    println!(
        "what-if for the whole fleet (baseline): median {:.1} ms over 3 runs",
        median(&all_t)
    );
    println!(
        "one service / whole fleet: {:.4}",
        median(&one_t) / median(&all_t)
    );
    Ok(())
}
