//! What decoding a Prometheus `query_range` answer costs a history pull: cutting it into its
//! series alone, then cutting, parsing (serde) and putting the samples on the grid, side by
//! side (see docs/rlc-history-bench.md, "Decoding").
//!
//! `cargo bench -p rlc --bench history_decode`

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use rlc::history::prometheus::bench;

const START: i64 = 1_700_000_000;
const STEP: i64 = 60;
/// One request's worth of steps (12 h at 1 m), as a pull asks.
const STEPS: usize = 720;
const SERIES: usize = 500;

/// An answer as Prometheus writes it: labels sorted, `__name__` first, values in Go's shortest
/// float form.
fn answer() -> Vec<u8> {
    let mut s = String::from(r#"{"status":"success","data":{"resultType":"matrix","result":["#);
    for i in 0..SERIES {
        if i > 0 {
            s.push(',');
        }
        s.push_str(&format!(
            r#"{{"metric":{{"__name__":"rpc_rps","caller":"caller-{}","procedure":"proc-{}","service":"svc-{}"}},"values":["#,
            i % 37,
            i % 11,
            i / 50
        ));
        for k in 0..STEPS {
            if k > 0 {
                s.push(',');
            }
            let v = ((i * 7919 + k * 104_729) % 100_000) as f64 / 64.0 + (i % 5) as f64 * 0.1;
            s.push_str(&format!(r#"[{},"{}"]"#, START + k as i64 * STEP, v));
        }
        s.push_str("]}");
    }
    s.push_str("]}}");
    s.into_bytes()
}

fn decode(c: &mut Criterion) {
    let bodies = vec![answer()];
    let mut g = c.benchmark_group("history_decode");
    g.throughput(Throughput::Bytes(bodies[0].len() as u64));
    g.sample_size(20);
    g.bench_function("split_only", |b| b.iter(|| bench::split(&bodies[0])));
    g.bench_function("split_parse_grid", |b| {
        b.iter(|| {
            let n = bench::decode(&bodies, START, STEP, STEPS);
            assert_eq!(n, SERIES);
        })
    });
    g.finish();
}

criterion_group!(benches, decode);
criterion_main!(benches);
