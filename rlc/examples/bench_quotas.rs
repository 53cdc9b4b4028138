//! Benchmark of the quota preview API (docs/rlc-api.md): `GET /v1/quotas` latency over a
//! large fleet served from the history snapshot, and the single-flight pull.
//!
//! `cargo run --release -p rlc --example bench_quotas -- [SERVICES] [REQUESTS]` writes a config
//! repo of SERVICES (1000 default) × 10 buckets (a git repository, as the daemon's working
//! copy), a CSV history with one series per bucket (2 days at 1 h), and serves `rlc serve`'s
//! router in process over loopback HTTP. It prints: the first request (pull + plan), then
//! REQUESTS (200 default) sequential requests each of `GET /v1/quotas` (whole fleet),
//! `GET /v1/quotas?service=…` and `GET /v1/quotas/{service}` (p50, p99, max), and the pulls
//! caused by 50 concurrent `?refresh=true` (1 expected).

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rlc::history::snapshot::HistoryCache;
use rlc::serve::{app, quotas::Quotas, AppState};

const BUCKETS: usize = 10;

fn write_repo(dir: &Path, services: usize) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir.join("rlc"))?;
    std::fs::create_dir_all(dir.join("buckets"))?;
    std::fs::write(
        dir.join("rlc/policies.yaml"),
        "default:\n  policy: peak\n  headroom: 0.25\n",
    )?;
    for i in 0..services {
        let f = schema::BucketFile {
            criticality: Default::default(),
            service: format!("svc{i:04}"),
            buckets: (0..BUCKETS)
                .map(|j| schema::Bucket {
                    name: format!("caller{j}"),
                    caller: Some(format!("caller{j}")),
                    procedure: None,
                    scope: schema::Scope::Global,
                    limit_rps: 100.0 + j as f64,
                    mode: schema::Mode::Enforce,
                    policy: schema::PolicyName::Peak,
                })
                .collect(),
        };
        std::fs::write(
            dir.join(format!("buckets/svc{i:04}.yaml")),
            schema::render_bucket_file(&f),
        )?;
    }
    for args in [
        &["init", "-q", "-b", "main"][..],
        &["add", "-A"],
        &["commit", "-q", "-m", "generated"],
    ] {
        test_support::git::git(dir, args)?;
    }
    Ok(())
}

fn write_history(path: &Path, services: usize) -> anyhow::Result<()> {
    use std::io::Write;
    let mut w = std::io::BufWriter::new(std::fs::File::create(path)?);
    writeln!(w, "ts,service,caller,procedure,rps")?;
    let end = chrono::Utc::now().timestamp() / 3600 * 3600;
    for h in 0..48 {
        let t = end - (48 - h) * 3600;
        for i in 0..services {
            for j in 0..BUCKETS {
                let rps = 50.0 + ((i * 7 + j * 13 + h as usize) % 40) as f64;
                writeln!(w, "{t},svc{i:04},caller{j},,{rps}")?;
            }
        }
    }
    w.flush()?;
    Ok(())
}

fn percentiles(mut v: Vec<Duration>) -> String {
    v.sort();
    let at = |q: f64| v[((v.len() as f64 * q) as usize).min(v.len() - 1)];
    format!(
        "p50 {:>7.2} ms  p99 {:>7.2} ms  max {:>7.2} ms",
        at(0.50).as_secs_f64() * 1e3,
        at(0.99).as_secs_f64() * 1e3,
        v[v.len() - 1].as_secs_f64() * 1e3
    )
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let services: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(1000);
    let requests: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(200);
    let dir = tempfile::Builder::new()
        .prefix("rlc-bench-quotas-")
        .tempdir()?;
    let d = dir.path();
    write_repo(&d.join("repo"), services)?;
    write_history(&d.join("h.csv"), services)?;
    let text = "history:\n  file: h.csv\n  lookback: 2d\n  step: 1h\n  min_coverage: 0.5\nconfig_repo:\n  path: repo\ndatabase_url: sqlite://rlc.db\n";
    let mut cfg: schema::DaemonConfig = schema::parse_str(Path::new("rlc.yaml"), text)?.value;
    rlc::config::resolve_paths(&mut cfg, d);
    let cache = Arc::new(HistoryCache::new(cfg.clone(), d));
    let store =
        rlc::serve::StoreSlot::with(rlc::store::Store::connect(&cfg.database_url, d).await?);
    let quotas = Arc::new(Quotas::new(
        cfg.clone(),
        d,
        cache.clone(),
        64,
        store.clone(),
    )?);
    let state = AppState::from_parts(rlc::serve::AppParts {
        quotas: Some(quotas),
        store,
        ..Default::default()
    });
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", l.local_addr()?);
    tokio::spawn(async move { axum::serve(l, app(state)).await });
    let c = reqwest::Client::new();

    println!(
        "fleet: {services} services × {BUCKETS} buckets = {} buckets",
        services * BUCKETS
    );
    let t = Instant::now();
    let r = c.get(format!("{base}/v1/quotas")).send().await?;
    anyhow::ensure!(r.status() == 200, "first GET: {}", r.text().await?);
    let body = r.bytes().await?;
    println!(
        "first GET /v1/quotas (pull + plan + render): {:.0} ms, {} bytes",
        t.elapsed().as_secs_f64() * 1e3,
        body.len()
    );
    let mid = format!("svc{:04}", services / 2);
    for path in [
        "/v1/quotas".to_string(),
        format!("/v1/quotas?service={mid}"),
        format!("/v1/quotas/{mid}"),
    ] {
        let mut times = Vec::with_capacity(requests);
        for _ in 0..requests {
            let t = Instant::now();
            let r = c.get(format!("{base}{path}")).send().await?;
            anyhow::ensure!(r.status() == 200, "{path}: {}", r.status());
            r.bytes().await?;
            times.push(t.elapsed());
        }
        println!("GET {path:<32} × {requests}: {}", percentiles(times));
    }

    let before = cache.pulls();
    let t = Instant::now();
    let tasks: Vec<_> = (0..50)
        .map(|_| {
            let (c, u) = (c.clone(), format!("{base}/v1/quotas?refresh=true"));
            tokio::spawn(async move { c.get(u).send().await.map(|r| r.status().as_u16()) })
        })
        .collect();
    let mut ok = 0;
    for t in tasks {
        if t.await?? == 200 {
            ok += 1;
        }
    }
    println!(
        "50 concurrent GET /v1/quotas?refresh=true: {ok} × 200, {} pull(s), {:.0} ms",
        cache.pulls() - before,
        t.elapsed().as_secs_f64() * 1e3
    );
    Ok(())
}
