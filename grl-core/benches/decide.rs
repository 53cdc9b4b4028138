//! The decision hot path side by side with its peers, in one run:
//! `grl` (drop-by-ratio lookup + draw + counter), governor's direct (keyless) and keyed
//! limiters, and a Redis counter limiter (INCR + EXPIRE on a throwaway redis-server on
//! loopback). Single-threaded and with 2 threads.
//!
//! `cargo bench -p grl-core --bench decide -- --warm-up-time 1 --measurement-time 2`

use std::hint::black_box;
use std::num::NonZeroU32;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use governor::{Quota, RateLimiter};
use grl_core::{Limiter, Table};
use schema::{Bucket, Mode, PolicyName, Scope};

/// Realistic keys: 32 callers × 8 procedures; the table holds a bucket per (caller,
/// procedure) for half of them, per procedure and per caller for others.
fn keys() -> Vec<(&'static str, &'static str)> {
    let callers: Vec<&'static str> = (0..32)
        .map(|i| &*Box::leak(format!("caller-service-{i:02}").into_boxed_str()))
        .collect();
    let procs: Vec<&'static str> = (0..8)
        .map(|i| &*Box::leak(format!("Procedure.Method{i}").into_boxed_str()))
        .collect();
    let mut k = Vec::new();
    for c in &callers {
        for p in &procs {
            k.push((*c, *p));
        }
    }
    k
}

fn grl_limiter(keys: &[(&str, &str)]) -> Limiter {
    grl_limiter_capped(keys, &Default::default())
}

/// [`grl_limiter`] with the bucket file's `criticality.caps`.
fn grl_limiter_capped(
    keys: &[(&str, &str)],
    caps: &std::collections::BTreeMap<String, schema::Criticality>,
) -> Limiter {
    let mut buckets = Vec::new();
    for (i, (c, p)) in keys.iter().enumerate() {
        let (caller, procedure) = match i % 4 {
            0 | 1 => (Some(c.to_string()), Some(p.to_string())),
            _ => continue,
        };
        buckets.push(Bucket {
            name: format!("b{i}"),
            caller,
            procedure,
            scope: Scope::Global,
            limit_rps: 100.0,
            mode: Mode::Enforce,
            policy: PolicyName::Manual,
        });
    }
    for (i, p) in keys
        .iter()
        .map(|k| k.1)
        .collect::<std::collections::BTreeSet<_>>()
        .iter()
        .enumerate()
    {
        buckets.push(Bucket {
            name: format!("p{i}"),
            caller: None,
            procedure: Some(p.to_string()),
            scope: Scope::Global,
            limit_rps: 100.0,
            mode: Mode::Enforce,
            policy: PolicyName::Manual,
        });
    }
    let l = Limiter::new("bench", Duration::from_secs(3600));
    let mut file = schema::BucketFile::new("bench", buckets);
    file.criticality.caps = caps.clone();
    let t = Table::compile_file("v1", &file).unwrap();
    let buckets = file.buckets;
    for i in 0..buckets.len() {
        t.set_ratio(i, 0.33);
    }
    l.install(t);
    l.directives_received(grl_core::now_ms());
    l
}

fn quota() -> Quota {
    Quota::per_second(NonZeroU32::new(u32::MAX).unwrap())
}

/// Runs `f(i)` `iters` times on each of `threads` threads; returns the wall time divided by
/// the thread count, so that criterion's per-element figure is the throughput cost.
fn parallel<F: Fn(usize) + Sync>(threads: usize, iters: u64, f: &F) -> Duration {
    let start = Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads {
            s.spawn(move || {
                for i in 0..iters as usize {
                    f(i * 7 + t);
                }
            });
        }
    });
    start.elapsed() / threads as u32
}

struct Redis(Child);

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_redis() -> Option<(Redis, redis::Connection)> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .ok()?
        .local_addr()
        .ok()?
        .port();
    let child = Command::new("/usr/bin/redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let guard = Redis(child);
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/")).ok()?;
    for _ in 0..100 {
        if let Ok(c) = client.get_connection() {
            return Some((guard, c));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

fn bench(c: &mut Criterion) {
    let keys = keys();
    let n = keys.len();
    assert!(n.is_power_of_two(), "keys are indexed with a mask");
    let grl = Arc::new(grl_limiter(&keys));
    let direct = RateLimiter::direct(quota());
    let keyed = RateLimiter::keyed(quota());

    let mut g = c.benchmark_group("decide/1-thread");
    g.throughput(Throughput::Elements(1));
    let mut i = 0usize;
    g.bench_function("grl", |b| {
        b.iter(|| {
            i = i.wrapping_add(1);
            let (c, p) = keys[i & (n - 1)];
            black_box(grl.decide(black_box(c), black_box(p)))
        })
    });
    // The same decision with a request tier (read from a header by the callers): a tiered
    // directive's probabilities, one per tier, beside the uniform ratio above.
    let tiers = schema::Criticality::ALL;
    g.bench_function("grl-tiered", |b| {
        b.iter(|| {
            i = i.wrapping_add(1);
            let (c, p) = keys[i & (n - 1)];
            let t = tiers[(i >> 3) & 3];
            black_box(grl.decide_tier(black_box(c), black_box(p), black_box(t)))
        })
    });
    // The same with the bucket file's caps: 8 exact callers and 4 prefixes, two of which
    // match every caller, so that each decision finds its cap after a miss in the exact names.
    let caps = (0..8)
        .map(|k| (format!("batch-{k}"), schema::Criticality::Sheddable))
        .chain(
            ["cron-*", "batch-*", "caller-*", "caller-service-*"]
                .map(|p| (p.to_string(), schema::Criticality::SheddablePlus)),
        )
        .collect();
    let capped = grl_limiter_capped(&keys, &caps);
    g.bench_function("grl-capped", |b| {
        b.iter(|| {
            i = i.wrapping_add(1);
            let (c, p) = keys[i & (n - 1)];
            let t = tiers[(i >> 3) & 3];
            black_box(capped.decide_tier(black_box(c), black_box(p), black_box(t)))
        })
    });
    let table = grl.table();
    g.bench_function("grl-lookup-only", |b| {
        b.iter(|| {
            i = i.wrapping_add(1);
            let (c, p) = keys[i & (n - 1)];
            black_box(table.find(black_box(c), black_box(p)))
        })
    });
    g.bench_function("governor-direct", |b| {
        b.iter(|| black_box(direct.check().is_ok()))
    });
    g.bench_function("governor-keyed", |b| {
        b.iter(|| {
            i = i.wrapping_add(1);
            black_box(keyed.check_key(black_box(&keys[i & (n - 1)])).is_ok())
        })
    });
    if let Some((_guard, mut con)) = start_redis() {
        g.sample_size(10);
        g.bench_function("redis-incr-expire", |b| {
            b.iter(|| {
                i = i.wrapping_add(1);
                let (c, p) = keys[i & (n - 1)];
                let key = format!("rl:{c}:{p}");
                let (count,): (u64,) = redis::pipe()
                    .cmd("INCR")
                    .arg(&key)
                    .cmd("EXPIRE")
                    .arg(&key)
                    .arg(1)
                    .ignore()
                    .query(&mut con)
                    .unwrap();
                black_box(count <= 100)
            })
        });
    } else {
        eprintln!("redis-server not available: skipping the Redis peer");
    }
    g.finish();

    let mut g = c.benchmark_group("decide/2-threads");
    g.throughput(Throughput::Elements(1));
    g.bench_function("grl", |b| {
        b.iter_custom(|iters| {
            parallel(2, iters, &|i| {
                let (c, p) = keys[i & (n - 1)];
                black_box(grl.decide(c, p));
            })
        })
    });
    g.bench_function("governor-direct", |b| {
        b.iter_custom(|iters| {
            parallel(2, iters, &|_| {
                black_box(direct.check().is_ok());
            })
        })
    });
    g.bench_function("governor-keyed", |b| {
        b.iter_custom(|iters| {
            parallel(2, iters, &|i| {
                black_box(keyed.check_key(&keys[i & (n - 1)]).is_ok());
            })
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
