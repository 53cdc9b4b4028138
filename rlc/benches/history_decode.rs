//! What decoding a Prometheus answer costs a history pull: a `query_range` answer cut into its
//! series alone, then cut, parsed (serde) and put on the grid; and the same samples as a
//! remote-read answer (streamed XOR chunks) decoded onto the grid, side by side (see
//! docs/rlc-history-bench.md, "Decoding" and "Remote read").
//!
//! `cargo bench -p rlc --bench history_decode`

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use rlc::history::prometheus::bench;
use rlc::history::remote_read::bench as remote;

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

/// The same samples as a remote-read answer: raw samples at the steps, labels by name.
fn remote_answer() -> Vec<u8> {
    let series: Vec<_> = (0..SERIES)
        .map(|i| {
            let labels = [
                ("__name__", "rpc_rps".to_string()),
                ("caller", format!("caller-{}", i % 37)),
                ("procedure", format!("proc-{}", i % 11)),
                ("service", format!("svc-{}", i / 50)),
            ]
            .map(|(k, v)| (k.to_string(), v))
            .to_vec();
            let samples = (0..STEPS)
                .map(|k| {
                    let v =
                        ((i * 7919 + k * 104_729) % 100_000) as f64 / 64.0 + (i % 5) as f64 * 0.1;
                    ((START + k as i64 * STEP) * 1000, v)
                })
                .collect();
            (labels, samples)
        })
        .collect();
    remote::answer(&series)
}

fn decode(c: &mut Criterion) {
    let bodies = vec![answer()];
    let streamed = remote_answer();
    eprintln!(
        "query_range answer {} bytes, remote-read answer {} bytes ({} samples)",
        bodies[0].len(),
        streamed.len(),
        SERIES * STEPS
    );
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
    g.bench_function("remote_read_grid", |b| {
        b.iter(|| {
            let n = remote::decode(&streamed, START, STEP, STEPS);
            assert_eq!(n, SERIES);
        })
    });
    g.finish();
}

criterion_group!(benches, decode);
criterion_main!(benches);
