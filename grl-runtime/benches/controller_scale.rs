//! The controller at fleet scale: 100k and 1M buckets × 20 zones (4 regions of 5 zones).
//!
//! Each zone's report carries the buckets its clients called in the interval: one bucket in
//! ten per zone (so every bucket is reported by two zones on average), or a small report of
//! 1,000 buckets. Measured:
//! - `report_small` / `report_10pct`: what `POST /v1/aggregate` does with the engine before
//!   it answers, `ingest` + `recompute`;
//! - `tick`: the controller's periodic work, `recompute` + `record_reports`;
//! - `round`: one tick's whole work: every zone's 10 % report, then the tick;
//! - `directives_one_zone`: the answer to one zone (every bucket, as protocol 2 wants).
//!
//! The steady state with delta reports (protocol 4), side by side in the same run:
//! - `round_delta_1pct` / `round_delta_5pct`: every zone sends a delta report carrying 1% / 5%
//!   of its buckets (changed rates) on top of the report the engine applied before; then the
//!   tick;
//! - `round_delta_5pct_answered`: the same, each report answered as `POST /v1/aggregate`
//!   did before the shared directive bytes (`Engine::answer`: ingest, recompute, the
//!   directives changed since the zone's; every reply serialized with serde_json);
//! - `round_delta_5pct_answered_shared`: the same answered as `POST /v1/aggregate` does now
//!   (`Engine::answer_json`: each directive serialized once per change, its bytes shared by
//!   the zones' replies);
//! - `directives_delta_one_zone`: the reply to one zone after a 5% round.
//!
//! The sizes of the messages (buckets and JSON bytes of one zone's report and of the reply)
//! are printed once per scale.
//! `cargo bench -p grl-runtime --bench controller_scale -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use grl_control::engine::Engine;
use grl_wire::{BucketCountsMsg, ReportSession, ZoneBucketMsg, ZoneReport};

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
                    tiers: Vec::new(),
                },
                gone: false,
                counts_only: false,
                tier_offered_rps: None,
            }
        })
        .collect();
    ZoneReport {
        aggregator_id: format!("agg-{z}"),
        region: format!("r{}", z / 5),
        zone: format!("z{z}"),
        buckets,
        calls: Vec::new(),
        calls_ms: None,
        session: None,
    }
}

/// Zone `z`'s delta report: `share` of its buckets (a slice starting at `from`), rates
/// bumped by `bump`.
fn delta(n: usize, z: usize, share: f64, from: usize, bump: f64) -> ZoneReport {
    let mut r = report(n, z, 10, n, bump);
    let k = ((r.buckets.len() as f64 * share) as usize).max(1);
    let from = from % r.buckets.len();
    r.buckets.rotate_left(from);
    r.buckets.truncate(k);
    r.buckets
        .sort_by(|a, b| (&a.service, &a.bucket).cmp(&(&b.service, &b.bucket)));
    r
}

/// Sets `r`'s session to report `seq` on top of `seq - 1` (session id = the zone number).
fn sequence(r: &mut ZoneReport, z: usize, seq: u64, held: Option<(u64, u64)>) {
    r.session = Some(ReportSession {
        id: z as u64,
        seq,
        base: Some(seq - 1),
        directives: held,
    });
}

fn directive_count(d: &grl_wire::ZoneDirectives) -> usize {
    d.services.iter().map(|s| s.directives.len()).sum()
}

/// The steady state with delta reports: one engine, every zone's full report once (session
/// report 1), then rounds of deltas.
fn steady(c: &mut Criterion, n: usize, label: &str) {
    let mut e = Engine::new(fixture::fleet_config(n, PER_SERVICE), u64::MAX);
    let mut seq = 1u64;
    for z in 0..ZONES {
        let mut r = report(n, z, 10, n, 0.0);
        r.session = Some(ReportSession {
            id: z as u64,
            seq,
            ..Default::default()
        });
        e.ingest(&r, 0);
    }
    e.recompute(0, 0);
    // Two versions of each share, alternating, so that every round changes the rates.
    let build = |share: f64, bump: f64| -> Vec<ZoneReport> {
        (0..ZONES)
            .map(|z| delta(n, z, share, z * 7919, bump))
            .collect()
    };
    let d1 = [build(0.01, 20.0), build(0.01, 0.0)];
    let d5 = [build(0.05, 20.0), build(0.05, 0.0)];
    let full_one = report(n, 3, 10, n, 0.0);
    let mut g = c.benchmark_group(format!("controller-{label}-buckets-20-zones"));
    g.sample_size(10);
    let mut flip = 0usize;
    for (name, set) in [("round_delta_1pct", &d1), ("round_delta_5pct", &d5)] {
        let mut set = set.clone();
        g.bench_function(name, |b| {
            b.iter(|| {
                flip += 1;
                seq += 1;
                for (z, r) in set[flip % 2].iter_mut().enumerate() {
                    sequence(r, z, seq, None);
                    e.ingest(black_box(r), 0);
                }
                e.recompute(0, 0);
                e.record_reports(0);
            })
        });
    }
    // Each zone holds the directives of its last answer. Every reply is serialized as the
    // controller sends it: `answer` + serde_json (before the shared directive bytes) or
    // `answer_json`.
    let mut held: Vec<Option<(u64, u64)>> = vec![None; ZONES];
    let mut sets = [d5[0].clone(), d5[1].clone()];
    let mut answered = |e: &mut Engine,
                        set: &mut [ZoneReport],
                        seq: u64,
                        shared: bool,
                        probe: bool|
     -> (usize, usize) {
        let mut last = (0, 0);
        for (z, r) in set.iter_mut().enumerate() {
            sequence(r, z, seq, held[z]);
            let bytes = if shared {
                let (bytes, _) = e.answer_json(black_box(r), 0, 0, true);
                held[z] = Some(e.directives_version());
                bytes
            } else {
                let d = e.answer(black_box(r), 0, 0);
                let s = d.session.expect("a session reply");
                assert!(!s.resync);
                held[z] = Some((s.epoch, s.version));
                serde_json::to_vec(&d).unwrap()
            };
            if probe && z == 3 {
                let d: grl_wire::ZoneDirectives = serde_json::from_slice(&bytes).unwrap();
                assert!(!d.session.unwrap().resync);
                last = (directive_count(&d), bytes.len());
            }
            black_box(bytes);
        }
        e.recompute(0, 0);
        e.record_reports(0);
        last
    };
    // Two rounds to reach the steady state: every zone holds the previous round's version.
    for _ in 0..2 {
        flip += 1;
        seq += 1;
        answered(&mut e, &mut sets[flip % 2], seq, false, false);
    }
    for (name, shared) in [
        ("round_delta_5pct_answered", false),
        ("round_delta_5pct_answered_shared", true),
    ] {
        g.bench_function(name, |b| {
            b.iter(|| {
                flip += 1;
                seq += 1;
                black_box(answered(&mut e, &mut sets[flip % 2], seq, shared, false));
            })
        });
    }
    flip += 1;
    seq += 1;
    let (reply_n, reply_bytes) = answered(&mut e, &mut sets[flip % 2], seq, true, true);
    let since = held[3];
    g.bench_function("directives_delta_one_zone", |b| {
        b.iter(|| black_box(e.directives_since("r0", "z3", since)))
    });
    g.finish();
    let full_reply = e.directives_for("r0", "z3");
    eprintln!(
        "{label}: zone report full {} buckets / {} bytes, 1% delta {} / {} bytes, 5% delta {} / {} bytes; \
         reply to one zone full {} directives / {} bytes, after a 5% round {} / {} bytes",
        full_one.buckets.len(),
        serde_json::to_vec(&full_one).unwrap().len(),
        d1[0][3].buckets.len(),
        serde_json::to_vec(&d1[0][3]).unwrap().len(),
        d5[0][3].buckets.len(),
        serde_json::to_vec(&d5[0][3]).unwrap().len(),
        directive_count(&full_reply),
        serde_json::to_vec(&full_reply).unwrap().len(),
        reply_n,
        reply_bytes,
    );
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
    let label = label(n);
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
            let r = if flip.is_multiple_of(2) {
                &full[3]
            } else {
                &full2[3]
            };
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
            let set = if flip.is_multiple_of(2) {
                &full
            } else {
                &full2
            };
            for r in set {
                black_box(e.ingest(black_box(r), 0));
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

fn label(n: usize) -> String {
    if n >= 1_000_000 {
        format!("{}M", n / 1_000_000)
    } else {
        format!("{}k", n / 1000)
    }
}

fn bench(c: &mut Criterion) {
    // The full rounds and the delta rounds in one run, one engine at a time (memory).
    for n in [100_000, 1_000_000] {
        scale(c, n);
        steady(c, n, &label(n));
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_secs(1));
    targets = bench
}
criterion_main!(benches);
