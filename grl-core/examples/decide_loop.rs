//! A fixed number of decisions on the benchmark's table, for instruction counts that do not
//! depend on the machine's load:
//!
//! ```text
//! cargo build --release -p grl-core --example decide_loop
//! for n in 0 1000000; do valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.$n \
//!   target/release/examples/decide_loop $n; done   # (Ir(1e6) − Ir(0)) / 1e6 = per decision
//! ```

use std::hint::black_box;
use std::time::Duration;

use grl_core::{Limiter, Table};
use schema::{Bucket, Mode, PolicyName, Scope};

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1_000_000);
    // The benchmark's keys: 32 callers × 8 procedures; half matched by caller+procedure, the
    // rest by procedure; ratio 0.33, fresh directives.
    let mut keys = Vec::new();
    for c in 0..32 {
        for p in 0..8 {
            keys.push((
                format!("caller-service-{c:02}"),
                format!("Procedure.Method{p}"),
            ));
        }
    }
    let bucket = |name: String, caller: Option<&str>, procedure: Option<&str>| Bucket {
        name,
        caller: caller.map(Into::into),
        procedure: procedure.map(Into::into),
        scope: Scope::Global,
        limit_rps: 100.0,
        mode: Mode::Enforce,
        policy: PolicyName::Manual,
    };
    let mut buckets = Vec::new();
    for (i, (c, p)) in keys.iter().enumerate() {
        if i % 4 < 2 {
            buckets.push(bucket(format!("b{i}"), Some(c), Some(p)));
        }
    }
    for p in 0..8 {
        buckets.push(bucket(
            format!("p{p}"),
            None,
            Some(&format!("Procedure.Method{p}")),
        ));
    }
    let l = Limiter::new("bench", Duration::from_secs(3600));
    let t = Table::compile("bench", "v1", &buckets).expect("compiles");
    for i in 0..buckets.len() {
        t.set_ratio(i, 0.33);
    }
    l.install(t);
    l.directives_received(grl_core::now_ms());
    let mut dropped = 0u64;
    for i in 0..n {
        let (c, p) = &keys[i & 255];
        dropped += !l.decide(black_box(c), black_box(p)).admitted() as u64;
    }
    println!("{n} decisions, {dropped} dropped");
}
