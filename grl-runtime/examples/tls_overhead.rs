//! What TLS costs on the client → aggregator hop: a real in-process aggregator (plain HTTP,
//! TLS, mutual TLS) answering `POST /v1/report` with a 10-bucket report, on loopback.
//! Sequential requests, on a kept-alive connection and on a new connection each time (a full
//! handshake). Certificates from a throwaway CA (ECDSA P-256, rcgen's default).
//!
//! `cargo run --release -p grl-runtime --example tls_overhead [N]`

use std::time::{Duration, Instant};

use grl_client::tls::ClientTls;
use grl_control::aggregator::{Aggregator, AggregatorOptions};
use grl_control::controller::{Controller, ControllerOptions};
use grl_server::tls::ServerTls;
use grl_wire::{BucketCountsMsg, ClientReport};
use test_support::tls::Ca;

/// The client report credential for `payments` (the aggregator's credentials file).
const CLIENT_SECRET: &str = "bench-client-secret-0123456789";
/// The zone-report credential the aggregator forwards with.
const ZONE_SECRET: &str = "bench-zone-report-0123456789";

async fn run(
    what: &str,
    http: &reqwest::Client,
    url: &str,
    report: &ClientReport,
    n: usize,
) -> anyhow::Result<()> {
    // Warm-up (and the first handshake of a kept-alive connection).
    for _ in 0..20 {
        http.post(url)
            .bearer_auth(CLIENT_SECRET)
            .json(report)
            .send()
            .await?
            .error_for_status()?;
    }
    let mut lat = Vec::with_capacity(n);
    let t0 = Instant::now();
    for _ in 0..n {
        let t = Instant::now();
        http.post(url)
            .bearer_auth(CLIENT_SECRET)
            .json(report)
            .send()
            .await?
            .error_for_status()?;
        lat.push(t.elapsed());
    }
    let total = t0.elapsed();
    lat.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    println!(
        "| {what} | {n} | {:.0} | {:.0} | {:.0} |",
        us(total) / n as f64,
        us(lat[n / 2]),
        us(lat[n * 99 / 100])
    );
    Ok(())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let n: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(2000);
    let dir = tempfile::tempdir()?;
    let d = dir.path();
    let ca = Ca::new("bench CA");
    let ca_file = ca.write(&d.join("ca.crt"));
    let (crt, key) = ca.server().write(d, "server");
    let (ccrt, ckey) = ca.client("bench-client").write(d, "client");
    let creds = d.join("client-credentials");
    std::fs::write(&creds, format!("bench payments {CLIENT_SECRET}\n"))?;
    let ctl = Controller::start(ControllerOptions {
        state_dir: d.join("state"),
        token: "t".into(),
        report_token: Some(ZONE_SECRET.into()),
        ..Default::default()
    })
    .await?;
    let report = ClientReport {
        client_id: "bench".into(),
        service: "payments".into(),
        version: String::new(),
        interval_ms: 1000,
        buckets: (0..10)
            .map(|i| BucketCountsMsg {
                bucket: format!("b{i}"),
                offered: 1000,
                admitted: 900,
                dropped: 100,
                shadow_dropped: 0,
                tiers: Vec::new(),
            })
            .collect(),
        urgent: false,
        calls: Vec::new(),
    };
    let server_tls = ServerTls::new(&crt, &key);
    let setups = [
        ("plain HTTP", None, ClientTls::default()),
        (
            "TLS",
            Some(server_tls.clone()),
            ClientTls {
                ca: Some(ca_file.clone()),
                ..Default::default()
            },
        ),
        (
            "mutual TLS",
            Some(ServerTls {
                client_ca: Some(ca_file.clone()),
                ..server_tls.clone()
            }),
            ClientTls {
                ca: Some(ca_file.clone()),
                cert: Some(ccrt.clone()),
                key: Some(ckey.clone()),
            },
        ),
    ];
    println!("| setup | requests | mean µs | p50 µs | p99 µs |\n|---|---|---|---|---|");
    for (what, tls, client) in setups {
        let agg = Aggregator::start(AggregatorOptions {
            controllers: vec![ctl.url()],
            zone: "z".into(),
            region: "r".into(),
            tls,
            report_token: Some(ZONE_SECRET.into()),
            client_credentials: Some(creds.clone()),
            ..Default::default()
        })
        .await?;
        let url = format!("{}/v1/report", agg.url());
        let kept = client.configure(reqwest::Client::builder())?.build()?;
        run(&format!("{what}, kept-alive"), &kept, &url, &report, n).await?;
        let fresh = client
            .configure(reqwest::Client::builder().pool_max_idle_per_host(0))?
            .build()?;
        run(
            &format!("{what}, new connection each"),
            &fresh,
            &url,
            &report,
            n / 4,
        )
        .await?;
        agg.shutdown().await;
    }
    ctl.shutdown().await;
    Ok(())
}
