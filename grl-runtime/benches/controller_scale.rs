//! The controller at fleet scale: 100k and 1M buckets × 20 zones (4 regions of 5 zones).
//!
//! Each zone's report carries the buckets its clients called in the interval: one bucket in
//! ten per zone (so every bucket is reported by two zones on average), or a small report of
//! 1,000 buckets. Measured:
//! - `report_small` / `report_10pct`: what `POST /v1/aggregate` does with the engine before
//!   it answers, `ingest` + `recompute`;
//! - `tick`: the controller's periodic work, `recompute` + `record_reports`;
//! - `round`: one tick's whole work: every zone's 10 % report, then the tick;
//! - `directives_one_zone`: the answer to one zone (every bucket, as the wire format wants).
//!
//! The file uses only the engine API the code before the incremental controller had, so the
//! same file runs against that commit as a baseline (see docs/grl-architecture.md):
//! `cargo bench -p grl-runtime --bench controller_scale -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use grl_runtime::engine::Engine;
use grl_runtime::proto::{BucketCountsMsg, ZoneBucketMsg, ZoneReport};

mod fixture;

const PER_SERVICE: usize = 1000;
const ZONES: usize = 20;

/// Zone `z`'s report over `n` buckets: every `every`-th bucket starting at `z`, at most `max`.
fn report(n: usize, z: usize, every: usize, max: usize, bump: f64) -> ZoneReport {
    let buckets = (z % every..n)
        .step_by(every)
        .take(max)
        .map(|i| {
            let (s, b) = (i / PER_SERVICE, i % PER_SERVICE);
            ZoneBucketMsg {
                service: format!("service-{s:04}"),
                bucket: format!("caller-{b:04}.proc"),
                offered_rps: 40.0 + (i % 7) as f64 + bump,
                admitted_rps: 40.0,
                dropped_rps: 0.0,
                shadow_dropped_rps: 0.0,
                counts: BucketCountsMsg {
                    bucket: String::new(),
                    offered: 40,
                    admitted: 40,
                    dropped: 0,
                    shadow_dropped: 0,
                },
            }
        })
        .collect();
    ZoneReport {
        aggregator_id: format!("agg-{z}"),
        region: format!("r{}", z / 5),
        zone: format!("z{z}"),
        buckets,
        calls: Vec::new(),
    }
}

fn scale(c: &mut Criterion, n: usize) {
    let mut e = Engine::new(fixture::fleet_config(n, PER_SERVICE), u64::MAX);
    let full: Vec<ZoneReport> = (0..ZONES).map(|z| report(n, z, 10, n, 0.0)).collect();
    for r in &full {
        e.ingest(r, 0);
    }
    e.recompute(0, 0);
    // Two versions of each report so that every iteration changes the rates.
    let full2: Vec<ZoneReport> = (0..ZONES).map(|z| report(n, z, 10, n, 20.0)).collect();
    let small = [report(n, 3, 10, 1000, 0.0), report(n, 3, 10, 1000, 20.0)];
    let label = if n >= 1_000_000 {
        format!("{}M", n / 1_000_000)
    } else {
        format!("{}k", n / 1000)
    };
    let mut g = c.benchmark_group(format!("controller-{label}-buckets-20-zones"));
    g.sample_size(10);
    let mut flip = 0usize;
    g.bench_function("report_small_1k", |b| {
        b.iter(|| {
            flip += 1;
            e.ingest(black_box(&small[flip % 2]), 0);
            e.recompute(0, 0);
        })
    });
    g.bench_function("report_10pct", |b| {
        b.iter(|| {
            flip += 1;
            let r = if flip % 2 == 0 { &full[3] } else { &full2[3] };
            e.ingest(black_box(r), 0);
            e.recompute(0, 0);
        })
    });
    g.bench_function("tick", |b| {
        b.iter(|| {
            e.recompute(0, 0);
            e.record_reports(0);
        })
    });
    g.bench_function("round", |b| {
        b.iter(|| {
            flip += 1;
            let set = if flip % 2 == 0 { &full } else { &full2 };
            for r in set {
                e.ingest(black_box(r), 0);
            }
            e.recompute(0, 0);
            e.record_reports(0);
        })
    });
    g.bench_function("directives_one_zone", |b| {
        b.iter(|| black_box(e.directives_for("r0", "z3")))
    });
    g.finish();
}

fn bench(c: &mut Criterion) {
    scale(c, 100_000);
    scale(c, 1_000_000);
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_secs(1));
    targets = bench
}
criterion_main!(benches);
