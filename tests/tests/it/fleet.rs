//! A GRL fleet on loopback for the end-to-end tests: one `grl aggregator` process per zone and
//! instances of an axum service embedding the GRL client through `GrlLayer` (the
//! `axum_service` example of grl-client: service `payments`, caller from `x-caller`,
//! procedure from the first path segment, routes `/charge` and `/refund`), and a load
//! generator whose callers each send at a set rate and count what the services answered.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use test_support::process::{free_port, Proc};

use super::{bin, get, get_text, wait_until};

/// The zone-report secret `start_controller` accepts.
pub const ZONE_TOKEN: &str = "e2e-zone-report-token";
/// The report credential the aggregators grant the `payments` instances.
pub const CLIENT_SECRET: &str = "fleet-payments-client-0123456789";

/// The `axum_service` example of grl-client, built once.
pub fn service_bin() -> PathBuf {
    // `bin` builds the example with the binaries.
    bin("grl")
        .parent()
        .unwrap()
        .join("examples")
        .join("axum_service")
}

/// Aggregators and service instances; every process is stopped (its process group killed)
/// when the fleet is dropped.
pub struct Fleet {
    /// `http://127.0.0.1:PORT` of every service instance, zone by zone.
    pub service_urls: Vec<String>,
    /// Port of each zone's aggregator.
    pub aggregator_ports: Vec<u16>,
    _procs: Vec<Proc>,
}

impl Fleet {
    /// One aggregator per zone of `zones` (region `r1`) reporting to the controller on
    /// `controller_port`, and `per_zone` service instances on each; every tier on a 1 s
    /// tick (the example's client reports every second). Logs go to `dir`.
    pub fn start(controller_port: u16, zones: &[&str], per_zone: usize, dir: &Path) -> Fleet {
        let log = |name: &str| Stdio::from(std::fs::File::create(dir.join(name)).unwrap());
        let creds = dir.join("client-credentials");
        std::fs::write(&creds, format!("payments payments {CLIENT_SECRET}\n")).unwrap();
        let mut procs = Vec::new();
        let mut service_urls = Vec::new();
        let mut aggregator_ports = Vec::new();
        for zone in zones {
            let aport = free_port();
            procs.push(
                Proc::spawn(
                    Command::new(bin("grl"))
                        .args(["aggregator", "--listen", &format!("127.0.0.1:{aport}")])
                        .args([
                            "--controller",
                            &format!("http://127.0.0.1:{controller_port}"),
                        ])
                        .args(["--zone", zone, "--region", "r1", "--tick-ms", "1000"])
                        .arg("--client-credentials")
                        .arg(&creds)
                        .env("GRL_REPORT_TOKEN", ZONE_TOKEN)
                        .stdout(Stdio::null())
                        .stderr(log(&format!("aggregator-{zone}.log"))),
                )
                .unwrap(),
            );
            wait_until(Duration::from_secs(20), || {
                get(aport, "/v1/config").is_some()
            });
            aggregator_ports.push(aport);
            for i in 0..per_zone {
                let sport = free_port();
                procs.push(
                    Proc::spawn(
                        Command::new(service_bin())
                            .arg(format!("http://127.0.0.1:{aport}"))
                            .env("LISTEN", format!("127.0.0.1:{sport}"))
                            .env("GRL_CLIENT_TOKEN", CLIENT_SECRET)
                            .stdout(Stdio::null())
                            .stderr(log(&format!("service-{zone}-{i}.log"))),
                    )
                    .unwrap(),
                );
                wait_until(Duration::from_secs(20), || {
                    get_text(sport, "/metrics").is_some()
                });
                service_urls.push(format!("http://127.0.0.1:{sport}"));
            }
        }
        Fleet {
            service_urls,
            aggregator_ports,
            _procs: procs,
        }
    }

    /// Waits until every aggregator holds config `version` (the instances fetch it from
    /// their aggregator on their next report).
    pub fn wait_for_version(&self, version: &str) {
        for port in &self.aggregator_ports {
            wait_until(Duration::from_secs(30), || {
                get(*port, "/v1/config").is_some_and(|c| c["version"] == version)
            });
        }
    }
}

/// One caller of the load generator: a target rate (changed while it runs) and what the
/// services answered.
pub struct Caller {
    pub name: &'static str,
    pub procedure: &'static str,
    /// Requests per second × 1000.
    milli_rps: AtomicU64,
    /// Requests sent.
    pub sent: AtomicU64,
    pub ok: AtomicU64,
    pub limited: AtomicU64,
    pub failed: AtomicU64,
}

impl Caller {
    pub fn new(name: &'static str, procedure: &'static str) -> Arc<Caller> {
        Arc::new(Caller {
            name,
            procedure,
            milli_rps: AtomicU64::new(0),
            sent: AtomicU64::new(0),
            ok: AtomicU64::new(0),
            limited: AtomicU64::new(0),
            failed: AtomicU64::new(0),
        })
    }

    pub fn set_rps(&self, rps: f64) {
        self.milli_rps
            .store((rps * 1000.0).round() as u64, Ordering::Relaxed);
    }

    /// (200s, 429s) so far.
    pub fn counts(&self) -> (u64, u64) {
        (
            self.ok.load(Ordering::Relaxed),
            self.limited.load(Ordering::Relaxed),
        )
    }
}

/// Sends `c`'s requests at its current rate, round robin over `urls`, each request on its
/// own task (a slow answer does not slow the pace; a late tick is caught up, so the number
/// sent over any interval is the rate × its length, ± 1).
pub async fn drive(c: Arc<Caller>, http: reqwest::Client, urls: Vec<String>) {
    let mut next = tokio::time::Instant::now();
    let mut i = 0usize;
    loop {
        let rps = c.milli_rps.load(Ordering::Relaxed) as f64 / 1000.0;
        if rps <= 0.0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
            next = tokio::time::Instant::now();
            continue;
        }
        next += Duration::from_secs_f64(1.0 / rps);
        tokio::time::sleep_until(next).await;
        let url = format!("{}/{}", urls[i % urls.len()], c.procedure);
        i += 1;
        c.sent.fetch_add(1, Ordering::Relaxed);
        let (c, http) = (c.clone(), http.clone());
        tokio::spawn(async move {
            match http.get(&url).header("x-caller", c.name).send().await {
                Ok(r) if r.status() == 200 => c.ok.fetch_add(1, Ordering::Relaxed),
                Ok(r) if r.status() == 429 => c.limited.fetch_add(1, Ordering::Relaxed),
                _ => c.failed.fetch_add(1, Ordering::Relaxed),
            };
        });
    }
}

/// The load generator: its own runtime (two workers) driving callers against service
/// instances; stopped when dropped.
pub struct Load {
    rt: Option<tokio::runtime::Runtime>,
    http: reqwest::Client,
    urls: Vec<String>,
}

impl Load {
    pub fn new(urls: &[String]) -> Load {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(5))
            .build()
            .unwrap();
        Load {
            rt: Some(rt),
            http,
            urls: urls.to_vec(),
        }
    }

    /// A caller of `procedure` named `name`, idle until its rate is set.
    pub fn caller(&self, name: &'static str, procedure: &'static str) -> Arc<Caller> {
        let c = Caller::new(name, procedure);
        self.rt
            .as_ref()
            .unwrap()
            .spawn(drive(c.clone(), self.http.clone(), self.urls.clone()));
        c
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}
