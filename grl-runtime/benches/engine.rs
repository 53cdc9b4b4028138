//! The controller's tick over many buckets (target: 100,000 buckets in milliseconds).
//!
//! `cargo bench -p grl-runtime --bench engine -- --warm-up-time 1 --measurement-time 2`

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use grl_runtime::engine::Engine;
use grl_runtime::proto::{ConfigDoc, ZoneBucketMsg, ZoneReport};
use schema::{Bucket, BucketFile, Mode, PolicyName, Scope};

const SERVICES: usize = 100;
const PER_SERVICE: usize = 1000;
const ZONES: usize = 6;

fn config() -> ConfigDoc {
    let services = (0..SERVICES)
        .map(|s| BucketFile {
            service: format!("service-{s:03}"),
            buckets: (0..PER_SERVICE)
                .map(|b| Bucket {
                    name: format!("caller-{b:04}.proc"),
                    caller: Some(format!("caller-{b:04}")),
                    procedure: Some("proc".into()),
                    scope: [Scope::Global, Scope::Region, Scope::Zone][b % 3],
                    limit_rps: 100.0,
                    mode: Mode::Enforce,
                    policy: PolicyName::Manual,
                })
                .collect(),
        })
        .collect();
    ConfigDoc {
        version: "bench".into(),
        services,
    }
}

fn report(z: usize) -> ZoneReport {
    let mut buckets = Vec::with_capacity(SERVICES * PER_SERVICE);
    for s in 0..SERVICES {
        for b in 0..PER_SERVICE {
            buckets.push(ZoneBucketMsg {
                service: format!("service-{s:03}"),
                bucket: format!("caller-{b:04}.proc"),
                offered_rps: 40.0 + (b % 7) as f64,
                admitted_rps: 40.0,
                ..Default::default()
            });
        }
    }
    ZoneReport {
        aggregator_id: format!("agg-{z}"),
        region: format!("r{}", z % 2),
        zone: format!("z{z}"),
        buckets,
    }
}

fn bench(c: &mut Criterion) {
    let mut e = Engine::new(config(), u64::MAX);
    let reports: Vec<ZoneReport> = (0..ZONES).map(report).collect();
    for r in &reports {
        e.ingest(r, 0);
    }
    let mut g = c.benchmark_group("controller-100k-buckets-6-zones");
    g.sample_size(10);
    g.bench_function("recompute", |b| b.iter(|| e.recompute(black_box(0), 0)));
    g.bench_function("directives_for_one_zone", |b| {
        b.iter(|| black_box(e.directives_for("r0", "z0")))
    });
    g.bench_function("ingest_one_zone_report", |b| {
        b.iter(|| e.ingest(black_box(&reports[0]), 0))
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
