//! The controller's tick over many buckets (target: 100,000 buckets in milliseconds).
//!
//! `cargo bench -p grl-runtime --bench engine -- --warm-up-time 1 --measurement-time 2`

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use grl_control::engine::Engine;
use grl_wire::{ZoneBucketMsg, ZoneReport};

mod fixture;

const SERVICES: usize = 100;
const PER_SERVICE: usize = 1000;
const ZONES: usize = 6;

fn report(z: usize) -> ZoneReport {
    let mut buckets = Vec::with_capacity(SERVICES * PER_SERVICE);
    for s in 0..SERVICES {
        for b in 0..PER_SERVICE {
            buckets.push(ZoneBucketMsg {
                service: format!("service-{s:04}"),
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
        calls: Vec::new(),
        calls_ms: None,
        session: None,
    }
}

fn bench(c: &mut Criterion) {
    let mut e = Engine::new(
        fixture::fleet_config(SERVICES * PER_SERVICE, PER_SERVICE),
        u64::MAX,
    );
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
    // GET /metrics: every bucket's counters per zone, ratios, limits and info, encoded by
    // prometheus-client under the engine lock.
    let engine = std::sync::Arc::new(std::sync::Mutex::new(e));
    let mut registry = prometheus_client::registry::Registry::default();
    registry.register_collector(Box::new(grl_control::metrics::EngineCollector::new(
        engine.clone(),
    )));
    let text = grl_client::metrics::encode(&registry);
    eprintln!(
        "metrics text: {} bytes, {} lines",
        text.len(),
        text.lines().count()
    );
    g.bench_function("metrics_render", |b| {
        b.iter(|| black_box(grl_client::metrics::encode(&registry)))
    });
    g.bench_function("metrics_render_baseline_format", |b| {
        b.iter(|| black_box(baseline_render(&engine.lock().unwrap())))
    });
    g.finish();
}

/// The baseline: the hand-formatted text the controller wrote before the registry crate
/// (the same counters and ratios, with `mode` on every series; no limit or info series).
fn baseline_render(e: &Engine) -> String {
    use std::fmt::Write as _;
    fn esc(v: &str) -> String {
        v.replace('\\', "\\\\")
            .replace('"', "\\\"")
            .replace('\n', "\\n")
    }
    let mut out = String::new();
    let names = [
        "grl_requests_offered_total",
        "grl_requests_admitted_total",
        "grl_requests_dropped_total",
        "grl_requests_shadow_dropped_total",
    ];
    let label = |b: &grl_control::engine::BucketState, zone: &str| -> String {
        format!(
            "service=\"{}\",bucket=\"{}\",caller=\"{}\",procedure=\"{}\",mode=\"{}\",zone=\"{}\"",
            esc(&b.service),
            esc(&b.bucket.name),
            esc(b.bucket.caller.as_deref().unwrap_or("")),
            esc(b.bucket.procedure.as_deref().unwrap_or("")),
            b.bucket.mode.as_str(),
            esc(zone)
        )
    };
    for (i, name) in names.iter().enumerate() {
        let _ = writeln!(out, "# TYPE {name} counter");
        for (b, zone, t) in e.totals() {
            let _ = writeln!(
                out,
                "{name}{{{}}} {}",
                label(b, zone),
                grl_control::engine::whole(t)[i]
            );
        }
    }
    let _ = writeln!(out, "# TYPE grl_drop_ratio gauge");
    for b in e.buckets() {
        for k in &b.keys {
            let zone = k.scope_key.strip_prefix("zone:").unwrap_or("");
            let _ = writeln!(
                out,
                "grl_drop_ratio{{{},scope_key=\"{}\"}} {}",
                label(b, zone),
                esc(&k.scope_key),
                k.ratio
            );
        }
    }
    out
}

criterion_group!(benches, bench);
criterion_main!(benches);
