//! The zone aggregator: sums its clients' reports per bucket, forwards them to the controller
//! (as soon as every known client has reported, or at the tick), and serves the cached
//! directives and config back.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use tokio::sync::Notify;

use crate::http_util::{parse_json, ApiError};
use crate::proto::{
    BucketCountsMsg, ClientDirectives, ClientReport, ConfigDoc, ZoneBucketMsg, ZoneDirectives,
    ZoneReport,
};

/// How to start an aggregator.
#[derive(Debug, Clone)]
pub struct AggregatorOptions {
    /// Listen address (port 0 picks a free port).
    pub listen: SocketAddr,
    /// Controller base URLs, tried in order.
    pub controllers: Vec<String>,
    /// The zone served.
    pub zone: String,
    /// The zone's region.
    pub region: String,
    /// Forwarding period (at the latest).
    pub tick: Duration,
    /// Instance id (defaults to the listen address).
    pub id: Option<String>,
    /// Sent as `Authorization: Bearer <report_token>` with every zone report to the
    /// controllers (the controllers' `report_token`).
    pub report_token: Option<String>,
    /// Serve HTTPS with these files (reloaded when they change); None = plain HTTP.
    pub tls: Option<crate::tls::ServerTls>,
    /// How this aggregator verifies (and identifies itself to) the controllers.
    pub client_tls: crate::tls::ClientTls,
}

impl Default for AggregatorOptions {
    fn default() -> Self {
        AggregatorOptions {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            controllers: Vec::new(),
            zone: String::new(),
            region: String::new(),
            tick: Duration::from_secs(1),
            id: None,
            report_token: None,
            tls: None,
            client_tls: crate::tls::ClientTls::default(),
        }
    }
}

/// A running aggregator.
pub type AggregatorHandle = crate::http_util::ServerHandle;

struct ClientEntry {
    service: String,
    at: Instant,
    /// bucket → [offered, admitted, dropped, shadow] per second over the client's last interval.
    rates: Vec<(String, [f64; 4])>,
    fresh: bool,
}

#[derive(Default)]
struct AggState {
    clients: HashMap<String, ClientEntry>,
    pending: HashMap<(String, String), BucketCountsMsg>,
    directives: ZoneDirectives,
    directives_at: Option<Instant>,
    config: ConfigDoc,
}

struct Shared {
    opts: AggregatorOptions,
    id: String,
    state: Mutex<AggState>,
    all_in: Notify,
    http: reqwest::Client,
}

/// The aggregator.
pub struct Aggregator;

impl Aggregator {
    /// Binds and starts serving clients and forwarding to the controller.
    pub async fn start(opts: AggregatorOptions) -> anyhow::Result<AggregatorHandle> {
        use anyhow::Context;
        anyhow::ensure!(
            !opts.controllers.is_empty(),
            "an aggregator needs at least one controller URL"
        );
        let tls = opts
            .tls
            .as_ref()
            .map(crate::tls::ReloadingServerConfig::load)
            .transpose()?;
        let http = opts
            .client_tls
            .http_client(Duration::from_secs(2))
            .context("controller client")?;
        crate::tls::warn_plain_http(
            "controller URL",
            opts.controllers.iter().map(String::as_str),
        );
        let scheme = if tls.is_some() { "https" } else { "http" };
        let listener = tokio::net::TcpListener::bind(opts.listen)
            .await
            .with_context(|| format!("bind {}", opts.listen))?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            id: opts.id.clone().unwrap_or_else(|| format!("agg-{addr}")),
            opts,
            state: Mutex::new(AggState::default()),
            all_in: Notify::new(),
            http,
        });
        let router = Router::new()
            .route("/v1/report", post(report))
            .route("/v1/config", get(config))
            // Configs and zone reports for tens of thousands of buckets exceed axum's 2 MiB default.
            .layer(axum::extract::DefaultBodyLimit::max(64 << 20))
            .with_state(shared.clone());
        let (stop, server) = crate::http_util::spawn_server(listener, router, tls, "aggregator");
        let forwarder = tokio::spawn(forward_loop(shared.clone()));
        tracing::info!(%addr, scheme, zone = %shared.opts.zone, region = %shared.opts.region, "aggregator listening");
        Ok(AggregatorHandle {
            addr,
            scheme,
            stop,
            server,
            background: forwarder,
        })
    }
}

async fn report(State(s): State<Arc<Shared>>, body: Bytes) -> Result<impl IntoResponse, ApiError> {
    let r: ClientReport = parse_json(&body)?;
    if r.interval_ms == 0 || r.client_id.is_empty() || r.service.is_empty() {
        return Err(ApiError::Invalid(
            "interval_ms must be positive; client_id and service must not be empty".into(),
        ));
    }
    let mut st = s.state.lock().expect("aggregator lock");
    for b in &r.buckets {
        if b.admitted + b.dropped != b.offered || b.shadow_dropped > b.admitted {
            return Err(ApiError::Invalid(format!(
                "bucket `{}`: admitted + dropped must equal offered and shadow_dropped ≤ admitted",
                b.bucket
            )));
        }
    }
    for b in &r.buckets {
        let p = st
            .pending
            .entry((r.service.clone(), b.bucket.clone()))
            .or_insert_with(|| BucketCountsMsg {
                bucket: b.bucket.clone(),
                ..Default::default()
            });
        p.offered += b.offered;
        p.admitted += b.admitted;
        p.dropped += b.dropped;
        p.shadow_dropped += b.shadow_dropped;
    }
    let rates = r.rates();
    st.clients.insert(
        r.client_id.clone(),
        ClientEntry {
            service: r.service.clone(),
            at: Instant::now(),
            rates,
            fresh: true,
        },
    );
    let horizon = s.opts.tick * 3;
    if r.urgent
        || st
            .clients
            .values()
            .filter(|c| c.at.elapsed() <= horizon)
            .all(|c| c.fresh)
    {
        s.all_in.notify_one();
    }
    let directives = st
        .directives
        .services
        .iter()
        .find(|d| d.service == r.service)
        .map(|d| d.directives.clone())
        .unwrap_or_default();
    Ok(Json(ClientDirectives {
        version: st.directives.version.clone(),
        age_ms: st.directives_at.map(|t| t.elapsed().as_millis() as u64),
        directives,
    }))
}

#[derive(Deserialize)]
struct ConfigQuery {
    service: Option<String>,
}

async fn config(State(s): State<Arc<Shared>>, Query(q): Query<ConfigQuery>) -> Json<ConfigDoc> {
    let st = s.state.lock().expect("aggregator lock");
    let mut doc = st.config.clone();
    if let Some(svc) = q.service {
        doc.services.retain(|f| f.service == svc);
    }
    Json(doc)
}

fn build_report(s: &Shared) -> ZoneReport {
    let mut st = s.state.lock().expect("aggregator lock");
    let horizon = s.opts.tick * 3;
    st.clients.retain(|_, c| c.at.elapsed() <= horizon);
    let mut sums: HashMap<(String, String), [f64; 4]> = HashMap::new();
    for c in st.clients.values_mut() {
        c.fresh = false;
        for (b, r) in &c.rates {
            let e = sums.entry((c.service.clone(), b.clone())).or_default();
            for i in 0..4 {
                e[i] += r[i];
            }
        }
    }
    let mut pending = std::mem::take(&mut st.pending);
    let mut buckets: Vec<ZoneBucketMsg> = sums
        .into_iter()
        .map(|((service, bucket), r)| ZoneBucketMsg {
            counts: pending
                .remove(&(service.clone(), bucket.clone()))
                .unwrap_or_default(),
            service,
            bucket,
            offered_rps: r[0],
            admitted_rps: r[1],
            dropped_rps: r[2],
            shadow_dropped_rps: r[3],
        })
        .collect();
    buckets.sort_by(|a, b| (&a.service, &a.bucket).cmp(&(&b.service, &b.bucket)));
    ZoneReport {
        aggregator_id: s.id.clone(),
        region: s.opts.region.clone(),
        zone: s.opts.zone.clone(),
        buckets,
    }
}

async fn forward_loop(s: Arc<Shared>) {
    let mut iv = tokio::time::interval(s.opts.tick);
    iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut current = 0usize;
    loop {
        tokio::select! {
            _ = iv.tick() => {}
            _ = s.all_in.notified() => { iv.reset(); }
        }
        let report = build_report(&s);
        let n = s.opts.controllers.len();
        let mut done = false;
        for attempt in 0..n {
            let base = &s.opts.controllers[(current + attempt) % n];
            match post_report(&s, base, &report).await {
                Ok(d) => {
                    current = (current + attempt) % n;
                    let refetch =
                        s.state.lock().expect("aggregator lock").config.version != d.version;
                    if refetch {
                        match fetch_config(&s, base).await {
                            Ok(doc) => {
                                tracing::info!(version = %doc.version, "aggregator fetched config");
                                s.state.lock().expect("aggregator lock").config = doc;
                            }
                            Err(e) => {
                                tracing::warn!(controller = %base, error = %e, "config fetch failed")
                            }
                        }
                    }
                    let mut st = s.state.lock().expect("aggregator lock");
                    st.directives = d;
                    st.directives_at = Some(Instant::now());
                    done = true;
                    break;
                }
                Err(e) => {
                    tracing::warn!(controller = %base, error = %e, "forward to controller failed")
                }
            }
        }
        if !done {
            tracing::warn!(zone = %s.opts.zone, "no controller reachable; serving cached directives until they go stale");
        }
    }
}

async fn post_report(s: &Shared, base: &str, r: &ZoneReport) -> anyhow::Result<ZoneDirectives> {
    let mut req = s.http.post(format!("{base}/v1/aggregate")).json(r);
    if let Some(t) = s.opts.report_token.as_deref().filter(|t| !t.is_empty()) {
        req = req.bearer_auth(t);
    }
    let resp = req.send().await?.error_for_status()?;
    Ok(resp.json().await?)
}

async fn fetch_config(s: &Shared, base: &str) -> anyhow::Result<ConfigDoc> {
    let resp = s
        .http
        .get(format!("{base}/v1/config"))
        .send()
        .await?
        .error_for_status()?;
    Ok(resp.json().await?)
}
