//! `grl simulate --realtime`: the scenario over real HTTP in wall-clock time. A controller and
//! one aggregator per zone run in this process on loopback; every instance is a real
//! `GrlClient`; one thread offers the load. Not deterministic (real time, real sockets): use
//! it to see the whole stack move, and the virtual-time simulator for measurements.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use grl_core::Decision;
use schema::{BucketFile, Mode};

use crate::sim::{Algorithm, Scenario, TickRow};
use grl_client::client::{ClientOptions, GrlClient};
use grl_control::aggregator::{Aggregator, AggregatorHandle, AggregatorOptions};
use grl_control::controller::{Controller, ControllerHandle, ControllerOptions};
use grl_wire::ConfigDoc;

struct Inst {
    client: GrlClient,
    caller: String,
    procedure: String,
    rate_share: f64,
    spec: usize,
    index_in_caller: usize,
    done: f64,
}

/// Runs `sc` in real time over loopback HTTP, calling `emit` per bucket per tick.
pub async fn run_realtime(
    sc: &Scenario,
    seed: u64,
    mut emit: impl FnMut(&TickRow),
) -> anyhow::Result<()> {
    grl_core::seed_thread_rng(seed);
    let plane = Plane::prepare(sc, seed)?;
    let ctl = plane.start_controller().await?;
    let zones = scenario_zones(sc);
    let aggs = plane.start_aggregators(&zones, &ctl.url()).await?;
    let mut insts = start_instances(sc, &plane, &zones, &aggs)?;
    let sc2 = sc.clone();
    let (tx, rx) = std::sync::mpsc::channel::<TickRow>();
    // The load runs on its own thread: deciding is synchronous and must not stall the
    // runtime that carries the control plane.
    let load = tokio::task::spawn_blocking(move || offer_load(&sc2, &mut insts, tx));
    let rows = tokio::task::spawn_blocking(move || rx.into_iter().collect::<Vec<_>>());
    load.await??;
    for r in rows.await? {
        emit(&r);
    }
    for (_, a) in aggs {
        a.shutdown().await;
    }
    ctl.shutdown().await;
    let _ = std::fs::remove_dir_all(&plane.state);
    Ok(())
}

/// The control plane of a realtime run: its state directory (the scenario's config in it),
/// its tick, and the credentials its tiers use.
struct Plane {
    state: PathBuf,
    tick: Duration,
    seed: u64,
    /// The clients' credential, and the file of the aggregators that lists it.
    client_token: String,
    client_creds: PathBuf,
}

impl Plane {
    /// Writes the scenario's config (validated) and the client credentials into a fresh
    /// state directory.
    fn prepare(sc: &Scenario, seed: u64) -> anyhow::Result<Plane> {
        let state =
            std::env::temp_dir().join(format!("grl-realtime-{}-{seed}", std::process::id()));
        std::fs::create_dir_all(&state).with_context(|| format!("create {}", state.display()))?;
        let doc = ConfigDoc {
            version: "realtime".into(),
            services: vec![BucketFile {
                criticality: Default::default(),
                service: sc.service.clone(),
                buckets: sc.buckets.clone(),
            }],
            candidates: Vec::new(),
        };
        grl_control::config::validate(&doc)?;
        std::fs::write(state.join("config.json"), serde_json::to_vec(&doc)?)?;
        // Clients authenticate to the aggregators as in production: one credential for the
        // scenario's service, in a credentials file only this user can read.
        let client_token = format!("{:032x}", rand::random::<u128>());
        let client_creds = state.join("client-credentials");
        grl_client::auth::write_secret_file(
            &client_creds,
            &format!("realtime {} {client_token}\n", sc.service),
        )?;
        Ok(Plane {
            state,
            tick: Duration::from_millis(sc.tick_ms),
            seed,
            client_token,
            client_creds,
        })
    }

    /// The controller, on loopback.
    async fn start_controller(&self) -> anyhow::Result<ControllerHandle> {
        Controller::start(ControllerOptions {
            listen: LOOPBACK,
            state_dir: self.state.clone(),
            token: format!("realtime-{}", self.seed),
            credentials: Default::default(),
            config_dir: None,
            tick: self.tick,
            region: None,
            peers: Vec::new(),
            report_token: Some(self.report_token().into()),
            allow_anonymous_reports: false,
            ..Default::default()
        })
        .await
    }

    /// One aggregator per (zone, region) of `zones`, by zone, forwarding to `controller`.
    async fn start_aggregators(
        &self,
        zones: &[(String, String)],
        controller: &str,
    ) -> anyhow::Result<BTreeMap<String, AggregatorHandle>> {
        let mut aggs = BTreeMap::new();
        for (zone, region) in zones {
            let a = Aggregator::start(AggregatorOptions {
                listen: LOOPBACK,
                controllers: vec![controller.to_string()],
                zone: zone.clone(),
                region: region.clone(),
                tick: self.tick,
                id: Some(format!("agg-{zone}")),
                report_token: Some(self.report_token().into()),
                client_credentials: Some(self.client_creds.clone()),
                allow_anonymous_reports: false,
                ..Default::default()
            })
            .await?;
            aggs.insert(zone.clone(), a);
        }
        Ok(aggs)
    }

    /// The aggregators' credential at the controller.
    fn report_token(&self) -> String {
        format!("realtime-report-{}", self.seed)
    }
}

/// Loopback, any port.
const LOOPBACK: SocketAddr = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0));

/// The scenario's (zone, region) pairs; one zone `z1` in region `r1` when it names none.
fn scenario_zones(sc: &Scenario) -> Vec<(String, String)> {
    if sc.zones.is_empty() {
        vec![("z1".to_string(), "r1".to_string())]
    } else {
        sc.zones
            .iter()
            .map(|z| (z.name.clone(), z.region.clone()))
            .collect()
    }
}

/// A client per instance of every caller, spread over the caller's zones (all by default)
/// and reporting to their aggregator, with the caller's rate shared out by weight.
fn start_instances(
    sc: &Scenario,
    plane: &Plane,
    zones: &[(String, String)],
    aggs: &BTreeMap<String, AggregatorHandle>,
) -> anyhow::Result<Vec<Inst>> {
    let mut insts = Vec::new();
    for (si, c) in sc.callers.iter().enumerate() {
        let weight = |i: usize| {
            if c.weights.is_empty() {
                1.0
            } else {
                c.weights[i % c.weights.len()]
            }
        };
        let wsum: f64 = (0..c.instances).map(weight).sum();
        let zone_names: Vec<String> = if c.zones.is_empty() {
            zones.iter().map(|z| z.0.clone()).collect()
        } else {
            c.zones.clone()
        };
        for i in 0..c.instances {
            let zone = &zone_names[i % zone_names.len()];
            let agg = aggs
                .get(zone)
                .with_context(|| format!("unknown zone `{zone}`"))?;
            let mut o = ClientOptions::new(&sc.service, vec![agg.url()]);
            o.tick = plane.tick;
            o.stale_after = Duration::from_millis(sc.stale_after_ms);
            o.client_id = Some(format!("{}#{i}", c.name));
            o.report_token = Some(plane.client_token.as_str().into());
            insts.push(Inst {
                client: GrlClient::start(o),
                caller: c.name.clone(),
                procedure: c.procedure.clone(),
                rate_share: weight(i) / wsum,
                spec: si,
                index_in_caller: i,
                done: 0.0,
            });
        }
    }
    Ok(insts)
}

fn offer_load(
    sc: &Scenario,
    insts: &mut [Inst],
    tx: std::sync::mpsc::Sender<TickRow>,
) -> anyhow::Result<()> {
    let start = Instant::now();
    let end = Duration::from_secs_f64(sc.duration_s);
    let nb = sc.buckets.len();
    let mut counts = vec![[0u64; 4]; nb];
    let mut next_tick = Duration::from_millis(sc.tick_ms);
    let mut last = Duration::ZERO;
    while last < end {
        std::thread::sleep(Duration::from_millis(sc.step_ms));
        let now = start.elapsed().min(end);
        let dt = (now - last).as_secs_f64();
        let t = now.as_secs_f64();
        for inst in insts.iter_mut() {
            let spec = &sc.callers[inst.spec];
            let mut rate = spec
                .schedule
                .iter()
                .rfind(|s| s.at_s <= t)
                .map_or(0.0, |s| s.rps)
                * inst.rate_share;
            for b in &spec.bursts {
                if b.instance == inst.index_in_caller && t >= b.from_s && t < b.to_s {
                    rate *= b.factor;
                }
            }
            inst.done += rate * dt;
            let n = inst.done.floor() as u64;
            inst.done -= n as f64;
            let limiter = inst.client.limiter();
            let table = limiter.table();
            let Some(b) = table.find(&inst.caller, &inst.procedure) else {
                continue;
            };
            for _ in 0..n {
                let c = &mut counts[b];
                c[0] += 1;
                let tier = spec.criticality.unwrap_or_default();
                match limiter.decide_tier(&inst.caller, &inst.procedure, tier) {
                    Decision::Admit => c[1] += 1,
                    Decision::Drop => c[2] += 1,
                    Decision::ShadowDrop => {
                        c[1] += 1;
                        c[3] += 1
                    }
                }
            }
        }
        last = now;
        if now >= next_tick || now >= end {
            let secs = sc.tick_ms as f64 / 1000.0;
            for (b, c) in counts.iter_mut().enumerate() {
                let ratio = insts
                    .iter()
                    .map(|i| i.client.limiter().table().ratio(b))
                    .fold(0.0, f64::max);
                let row = TickRow {
                    t: (now.as_secs_f64() * 1000.0).round() / 1000.0,
                    bucket: sc.buckets[b].name.clone(),
                    offered_rps: c[0] as f64 / secs,
                    admitted_rps: c[1] as f64 / secs,
                    dropped_rps: c[2] as f64 / secs,
                    shadow_dropped_rps: c[3] as f64 / secs,
                    drop_ratio: if sc.buckets[b].mode == Mode::Shadow || c[0] > 0 {
                        ratio
                    } else {
                        0.0
                    },
                    limit_rps: sc.buckets[b].limit_rps,
                    algorithm: Algorithm::DropByRatio,
                    // Real processes: the rows are per bucket only.
                    tiers: Vec::new(),
                };
                if tx.send(row).is_err() {
                    return Ok(());
                }
                *c = [0; 4];
            }
            next_tick += Duration::from_millis(sc.tick_ms);
        }
    }
    Ok(())
}
