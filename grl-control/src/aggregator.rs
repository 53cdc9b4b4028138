//! The zone aggregator: sums its clients' reports per bucket, forwards them to the controller
//! (as soon as every known client has reported, or at the tick), and serves the cached
//! directives and config back.
//!
//! Client reports need a client credential (see [`grl_client::auth`]) whose scope covers the
//! report's service: 401 without a known credential, 403 for another service's report, both
//! decided from the headers and the service before anything is recorded. A refused report is
//! never summed nor forwarded.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use schema::criticality::TIERS;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Query, State};
use axum::http::HeaderMap;
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use tokio::sync::{oneshot, Notify};

use grl_client::auth::{CredentialSet, LogGate, RefusalCounts, TokenSource};
use grl_client::calls::PendingCalls;
use grl_server::http_util::{parse_json, read_body, ApiError};
use grl_wire::{
    BucketCountsMsg, ClientDirectives, ClientReport, ConfigDoc, DirectiveMsg, ServiceCallCountMsg,
    ZoneBucketMsg, ZoneDirectives, ZoneReport, PROTO_HEADER, PROTO_VERSION,
};

mod report;
pub use report::tier_mix;
pub mod screen;

use screen::MAX_CALL_SERVICES;

#[cfg(test)]
mod screen_tests;

/// How to start an aggregator.
#[derive(Debug, Clone)]
pub struct AggregatorOptions {
    /// Listen address (port 0 picks a free port).
    pub listen: SocketAddr,
    /// Controller base URLs: the replicas of the region's controller. Each zone report goes to
    /// every one of them (see `send_to_standbys`); the directives served are those of the
    /// first that answers, tried in order from the last one that did.
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
    /// controllers (a credential with their `zone-report` role).
    pub report_token: Option<TokenSource>,
    /// The client credentials accepted on `POST /v1/report`: a credentials file whose scopes
    /// are service names (`*` = every service), re-read when it changes.
    pub client_credentials: Option<PathBuf>,
    /// Development only: accept client reports that carry no credential (a warning is logged
    /// at start and every minute). Without it and without `client_credentials` the aggregator
    /// refuses to start.
    pub allow_anonymous_reports: bool,
    /// Serve HTTPS with these files (reloaded when they change); None = plain HTTP.
    pub tls: Option<grl_server::tls::ServerTls>,
    /// How this aggregator verifies (and identifies itself to) the controllers.
    pub client_tls: grl_client::tls::ClientTls,
    /// Distinct (caller, procedure) keys per service held between forwards; beyond, new
    /// callers count as `_other` (see [`grl_client::calls`]).
    pub max_call_keys: usize,
    /// Delta zone reports to controllers that announced protocol 4 (see [`crate::delta`]).
    pub delta: crate::delta::DeltaOptions,
    /// Header and idle timeouts, connection cap and health connections of the listener.
    pub serve: grl_server::server::ServeLimits,
    /// A second listener serving `/healthz` and `/readyz` only (None: none).
    pub health_listen: Option<SocketAddr>,
    /// What one client may claim (see [`screen`]).
    pub plausibility: screen::Plausibility,
}

/// Largest client report (one service's buckets).
const MAX_REPORT_BODY: usize = 4 << 20;

/// A client report is a few KiB; one larger than this (or of unknown length) is read and
/// decoded only [`LARGE_REPORTS_AT_ONCE`] at a time, since decoded it takes about eight times
/// its size: reports in flight hold at most about 150 MB, however many connections send them.
const LARGE_REPORT: u64 = 256 << 10;

/// Large reports read and decoded at once.
const LARGE_REPORTS_AT_ONCE: usize = 4;

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
            client_credentials: None,
            allow_anonymous_reports: false,
            tls: None,
            client_tls: grl_client::tls::ClientTls::default(),
            max_call_keys: grl_client::calls::DEFAULT_AGGREGATOR_KEYS,
            delta: Default::default(),
            serve: Default::default(),
            health_listen: None,
            plausibility: Default::default(),
        }
    }
}

/// A running aggregator.
pub type AggregatorHandle = grl_server::http_util::ServerHandle;

/// One client's last report; keyed by (service, client id).
struct ClientEntry {
    at: Instant,
    /// How long the client's rates count after its last report: three of its own reporting
    /// periods, at least three of the aggregator's ticks (see [`client_horizon`]).
    horizon: Duration,
    /// The client's reporting period as the aggregator estimates it (ms).
    period_ms: u64,
    /// bucket → [offered, admitted, dropped, shadow] per second over the client's last interval.
    rates: Vec<(String, [f64; 4])>,
    /// Beside each of `rates`: the shares of its offered rate by criticality tier (least
    /// critical first, summing to 1), when the client counted tiers.
    tier_mix: Vec<Option<[f64; TIERS]>>,
    /// Its allowance of calls and its last total call rate (see [`screen::Known::screen_calls`]).
    calls: screen::ClientCalls,
    /// Its allowance of bucket counts (see [`screen::Known::screen_counts`]).
    counts: screen::Allowance,
    fresh: bool,
}

#[derive(Default)]
struct AggState {
    /// Keyed by (service, client id): a client of one service cannot replace another
    /// service's client by reusing its id.
    clients: HashMap<(String, String), ClientEntry>,
    pending: HashMap<(String, String), BucketCountsMsg>,
    /// Calls by service since the last forward (bounded).
    calls: HashMap<String, PendingCalls>,
    /// When `calls` began: the last forward whose calls a controller took (or the start).
    /// Calls held back by failed forwards go with the whole time since (`calls_ms`).
    calls_since: Option<Instant>,
    directives: ZoneDirectives,
    directives_at: Option<Instant>,
    /// What clients are answered, built at the first report after `directives_at` changed.
    replies: Option<Replies>,
    /// Clients not heard from since the last forward (`fresh == false`), counted when
    /// `build_report` cleared them and as they report; see `report`.
    waiting: usize,
    waiting_counted: Option<Instant>,
    config: ConfigDoc,
    /// The buckets of `config` by service, with the state of the plausibility caps.
    known: screen::Known,
}

/// How long a client's last rates count in the zone's sums: three of its reporting periods
/// ([`crate::period`], from the intervals its reports cover), and at least three of the
/// aggregator's ticks. A client reporting every second to an aggregator ticking every 100 ms
/// is still part of every forward in between (with a horizon of three ticks it dropped out
/// 300 ms after each report, and the controller computed its ratio without it).
fn client_horizon(tick: Duration, period_ms: u64) -> Duration {
    Duration::from_millis(crate::period::horizon_ms(
        (tick * 3).as_millis() as u64,
        period_ms,
    ))
}

/// The replies to client reports since the controller's last answer (`at`), by service.
struct Replies {
    at: Option<Instant>,
    by_service: HashMap<String, Arc<ServiceReply>>,
    /// For a service the controller sent no directives for.
    none: Arc<ServiceReply>,
}

/// One service's reply but for its age (which changes with every report), shared by all its
/// clients until the controller answers again: indexed once per answer instead of searched
/// per report, and encoded once per answer instead of per report.
struct ServiceReply {
    version: String,
    directives: Vec<DirectiveMsg>,
    /// The binary encodings with and without the tier splits, made at the first binary
    /// report of a client that reads them (protocol 8) or does not.
    binary: [std::sync::OnceLock<grl_wire::binary::EncodedDirectives>; 2],
}

impl ServiceReply {
    fn new(version: &str, directives: Vec<DirectiveMsg>) -> Arc<ServiceReply> {
        Arc::new(ServiceReply {
            version: version.to_string(),
            directives,
            binary: Default::default(),
        })
    }

    /// The reply's body with `age_ms`, in the binary encoding or JSON; with the directives'
    /// tier splits for a client that reads them (`tiers`), without for an older one.
    fn body(&self, age_ms: Option<u64>, binary: bool, tiers: bool) -> Vec<u8> {
        let directives = || {
            let mut d = self.directives.clone();
            if !tiers {
                d.iter_mut().for_each(|m| m.shed = None);
            }
            d
        };
        if binary {
            self.binary[tiers as usize]
                .get_or_init(|| {
                    grl_wire::binary::EncodedDirectives::new(&self.version, &directives())
                })
                .with_age(age_ms)
        } else {
            serde_json::to_vec(&ClientDirectives {
                version: self.version.clone(),
                age_ms,
                directives: directives(),
            })
            .expect("directives serialize")
        }
    }
}

impl AggState {
    /// The reply to a client of `service`.
    fn service_reply(&mut self, service: &str) -> Arc<ServiceReply> {
        if self
            .replies
            .as_ref()
            .is_none_or(|r| r.at != self.directives_at)
        {
            let version = &self.directives.version;
            self.replies = Some(Replies {
                at: self.directives_at,
                by_service: self
                    .directives
                    .services
                    .iter()
                    .map(|d| {
                        (
                            d.service.clone(),
                            ServiceReply::new(version, d.directives.clone()),
                        )
                    })
                    .collect(),
                none: ServiceReply::new(version, Vec::new()),
            });
        }
        let r = self.replies.as_ref().expect("built above");
        r.by_service.get(service).unwrap_or(&r.none).clone()
    }
}

struct Shared {
    opts: AggregatorOptions,
    id: String,
    state: Arc<Mutex<AggState>>,
    all_in: Notify,
    http: reqwest::Client,
    creds: CredentialSet,
    refused: RefusalCounts,
    refused_log: LogGate,
    /// `grl_report_entries_refused_total{service, reason}`.
    entries_refused: EntryCounts,
    entries_log: LogGate,
    /// Permits to read and decode a large report ([`LARGE_REPORT`]).
    large_reports: tokio::sync::Semaphore,
    metrics: AggMetrics,
    registry: prometheus_client::registry::Registry,
}

/// The aggregator's own counters (the per-service client counts are read at scrape time by
/// [`ClientsCollector`]).
#[derive(Default, Clone)]
struct AggMetrics {
    accepted: prometheus_client::metrics::counter::Counter,
    accepted_binary: prometheus_client::metrics::counter::Counter,
    forward_seconds: ForwardHistogram,
    forward_failures: prometheus_client::metrics::counter::Counter,
    standby_failures: prometheus_client::metrics::counter::Counter,
    counts_unconfirmed: prometheus_client::metrics::counter::Counter,
}

#[derive(Clone)]
struct ForwardHistogram(prometheus_client::metrics::histogram::Histogram);

impl Default for ForwardHistogram {
    fn default() -> Self {
        ForwardHistogram(prometheus_client::metrics::histogram::Histogram::new(
            grl_client::metrics::LATENCY_BUCKETS,
        ))
    }
}

impl AggMetrics {
    fn registry(
        &self,
        state: Arc<Mutex<AggState>>,
        horizon: Duration,
    ) -> prometheus_client::registry::Registry {
        let mut reg = prometheus_client::registry::Registry::default();
        grl_client::metrics::register_build_info(&mut reg, "grl", "aggregator");
        reg.register(
            "grl_reports_accepted",
            "Client reports accepted.",
            self.accepted.clone(),
        );
        reg.register(
            "grl_reports_binary",
            "Client reports accepted in the binary encoding (protocol 3); the rest were JSON.",
            self.accepted_binary.clone(),
        );
        reg.register(
            "grl_aggregator_forward_duration_seconds",
            "Zone reports forwarded to a controller: time until its answer.",
            self.forward_seconds.0.clone(),
        );
        reg.register(
            "grl_aggregator_forward_failures",
            "Failed forwards of a zone report (each controller tried counts).",
            self.forward_failures.clone(),
        );
        reg.register(
            "grl_aggregator_standby_failures",
            "Failed copies of a zone report to a standby controller replica (no answer in time, an error status, or a full report refused).",
            self.standby_failures.clone(),
        );
        reg.register(
            "grl_aggregator_counts_unconfirmed",
            "Offered requests of zone reports that no controller answered in full (a timeout, an answer cut short): a controller may have counted them, so they are not sent again. Counts of a forward that no controller received, or that one refused, are sent again with the next forward.",
            self.counts_unconfirmed.clone(),
        );
        reg.register_collector(Box::new(ClientsCollector { state, horizon }));
        reg
    }
}

/// `grl_aggregator_clients{service}` (clients whose rates count: heard from within 3 of their
/// reporting periods, at least 3 ticks) and
/// `grl_aggregator_directives_age_seconds` (since the last answer of a controller).
struct ClientsCollector {
    state: Arc<Mutex<AggState>>,
    horizon: Duration,
}

impl std::fmt::Debug for ClientsCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClientsCollector")
    }
}

impl prometheus_client::collector::Collector for ClientsCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> std::fmt::Result {
        use grl_client::metrics::Label;
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::gauge::ConstGauge;
        use prometheus_client::metrics::MetricType;
        let st = self.state.lock().expect("aggregator lock");
        let mut per_service: std::collections::BTreeMap<&str, i64> = Default::default();
        for ((service, _), c) in &st.clients {
            if c.at.elapsed() <= self.horizon.max(c.horizon) {
                *per_service.entry(service.as_str()).or_default() += 1;
            }
        }
        let mut fam = encoder.encode_descriptor(
            "grl_aggregator_clients",
            "Clients whose rates count in the zone's sums (heard from within 3 of their reporting periods, at least 3 ticks), by service.",
            None,
            MetricType::Gauge,
        )?;
        for (service, n) in per_service {
            ConstGauge::new(n).encode(fam.encode_family(&[("service", Label(service))])?)?;
        }
        if let Some(at) = st.directives_at {
            let fam = encoder.encode_descriptor(
                "grl_aggregator_directives_age_seconds",
                "Seconds since a controller last answered a zone report.",
                None,
                MetricType::Gauge,
            )?;
            ConstGauge::new(at.elapsed().as_secs_f64()).encode(fam)?;
        }
        Ok(())
    }
}

/// Entries of accepted client reports dropped or cut, by service (a configured one, else
/// `_unknown`) and reason.
#[derive(Default, Clone)]
struct EntryCounts(
    prometheus_client::metrics::family::Family<
        [(&'static str, String); 2],
        prometheus_client::metrics::counter::Counter,
    >,
);

impl EntryCounts {
    fn register(&self, reg: &mut prometheus_client::registry::Registry) {
        reg.register(
            "grl_report_entries_refused",
            "Entries of accepted client reports dropped or cut, by service and reason: unknown_bucket (a bucket not in the config served for the service: dropped), duplicate (a bucket named twice in one report: dropped), rate_capped (a bucket's offered rate above what one instance plausibly offers: cut to it), short_interval (interval below 10 ms: bucket rates computed over 10 ms), calls_capped (a (caller, procedure) call count of a report whose calls were more than one instance plausibly makes over the time the client reported: scaled down with the report's other calls), counts_capped (a bucket's counts more than one instance plausibly offers over the time the client reported: cut to it).",
            self.0.clone(),
        );
    }
}

impl Shared {
    /// Counts and logs (at most every 10 s) what screening a client report dropped or cut.
    fn count_screened(&self, r: &ClientReport, s: &screen::Screened) {
        if s.refused.is_empty() {
            return;
        }
        let service = if s.known_service {
            r.service.clone()
        } else {
            "_unknown".to_string()
        };
        for (why, n) in &s.refused {
            self.entries_refused
                .0
                .get_or_create(&[
                    ("service", service.clone()),
                    ("reason", why.reason().into()),
                ])
                .inc_by(*n);
        }
        if self.entries_log.open() {
            let client: String = r.client_id.chars().take(64).collect();
            let refused: Vec<String> = s
                .refused
                .iter()
                .map(|(why, n)| format!("{}={n}", why.reason()))
                .collect();
            tracing::warn!(service = %service, client = %client, refused = %refused.join(" "),
                "client report entries dropped or cut (logged at most every 10 s; see grl_report_entries_refused_total)");
        }
    }

    /// A client report refused: counted by reason and logged (at most every 10 s) without
    /// the credential.
    fn refuse(&self, reason: &'static str, detail: &str, err: ApiError) -> ApiError {
        self.refused.add(reason);
        if self.refused_log.open() {
            tracing::warn!(reason, detail, error = %err, "client report refused (logged at most every 10 s; see grl_reports_refused_total)");
        }
        err
    }
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
        let creds = client_credentials(&opts)?;
        if opts.report_token.is_none() {
            tracing::warn!("no report token (GRL_REPORT_TOKEN): controllers will refuse this aggregator's zone reports");
        }
        let tls = opts
            .tls
            .as_ref()
            .map(grl_server::tls::ReloadingServerConfig::load)
            .transpose()?;
        let http = opts
            .client_tls
            .http_client(CONTROLLER_TIMEOUT)
            .context("controller client")?;
        grl_client::tls::warn_plain_http(
            "controller URL",
            opts.controllers.iter().map(String::as_str),
        );
        let scheme = if tls.is_some() { "https" } else { "http" };
        let listener = tokio::net::TcpListener::bind(opts.listen)
            .await
            .with_context(|| format!("bind {}", opts.listen))?;
        let addr = listener.local_addr()?;
        let server_stats = Arc::new(grl_server::server::ServerStats::default());
        let shared = Arc::new(Shared::new(opts, addr, http, creds, &server_stats));
        let health = grl_server::http_util::spawn_health(
            shared.opts.health_listen,
            health_routes(&shared),
            tls.clone(),
            shared.opts.serve,
            "aggregator health",
        )
        .await?;
        let (stop, server) = grl_server::http_util::spawn_server(
            listener,
            routes(&shared),
            tls,
            shared.opts.serve,
            server_stats,
            "aggregator",
        );
        let (finish, finished) = oneshot::channel::<()>();
        let forwarder = tokio::spawn(forward_loop(shared.clone(), finished));
        tracing::info!(%addr, scheme, zone = %shared.opts.zone, region = %shared.opts.region, "aggregator listening");
        Ok(AggregatorHandle {
            addr,
            scheme,
            stop,
            server,
            finish,
            background: forwarder,
            health,
        })
    }
}

/// The credentials client reports must carry; none (with a warning) only when anonymous
/// reports are allowed.
fn client_credentials(opts: &AggregatorOptions) -> anyhow::Result<CredentialSet> {
    let mut creds = CredentialSet::default();
    if let Some(path) = &opts.client_credentials {
        creds
            .add_file(path, None)
            .map_err(|e| anyhow::anyhow!("client credentials: {e}"))?;
    }
    if opts.allow_anonymous_reports {
        tracing::warn!("INSECURE: --insecure-allow-anonymous-reports: client reports without a credential are accepted; anyone who reaches this port can make the fleet drop traffic (development only)");
    } else {
        anyhow::ensure!(
            !creds.is_empty(),
            "refusing to start: no client credentials (set --client-credentials FILE or GRL_CLIENT_CREDENTIALS_FILE); --insecure-allow-anonymous-reports accepts anonymous reports for development"
        );
    }
    Ok(creds)
}

impl Shared {
    /// The state of an aggregator bound to `addr`, with its metrics registered (the
    /// server's `server_stats` among them).
    fn new(
        opts: AggregatorOptions,
        addr: SocketAddr,
        http: reqwest::Client,
        creds: CredentialSet,
        server_stats: &Arc<grl_server::server::ServerStats>,
    ) -> Shared {
        let state = Arc::new(Mutex::new(AggState {
            calls_since: Some(Instant::now()),
            ..Default::default()
        }));
        let metrics = AggMetrics::default();
        let refused = RefusalCounts::default();
        let mut registry = metrics.registry(state.clone(), opts.tick * 3);
        refused.register(&mut registry);
        let entries_refused = EntryCounts::default();
        entries_refused.register(&mut registry);
        server_stats.register(&mut registry);
        Shared {
            id: opts.id.clone().unwrap_or_else(|| format!("agg-{addr}")),
            opts,
            state,
            all_in: Notify::new(),
            http,
            creds,
            refused,
            refused_log: LogGate::new(Duration::from_secs(10)),
            entries_refused,
            entries_log: LogGate::new(Duration::from_secs(10)),
            large_reports: tokio::sync::Semaphore::new(LARGE_REPORTS_AT_ONCE),
            metrics,
            registry,
        }
    }
}

/// The routes served to clients (and Prometheus).
fn routes(shared: &Arc<Shared>) -> Router {
    Router::new()
        .route("/v1/report", post(report::report))
        .route("/v1/config", get(config))
        .route("/metrics", get(serve_metrics))
        .route("/healthz", get(grl_server::http_util::healthz))
        .route("/readyz", get(readyz))
        .with_state(shared.clone())
}

/// The routes of the separate health listener.
fn health_routes(shared: &Arc<Shared>) -> Router {
    Router::new()
        .route("/healthz", get(grl_server::http_util::healthz))
        .route("/readyz", get(readyz))
        .with_state(shared.clone())
}

/// `GET /readyz`: a controller answered a forward within 3 ticks (at least 2 s): the
/// directives and config served to clients are current. 503 with the reason otherwise (no
/// controller answered yet, or the last answer is too old: clients are better served by
/// another aggregator, or fail open).
async fn readyz(State(s): State<Arc<Shared>>) -> grl_server::http_util::Readiness {
    let (at, version) = {
        let st = s.state.lock().expect("aggregator lock");
        (st.directives_at, st.config.version.clone())
    };
    let bound = (s.opts.tick * 3).max(Duration::from_secs(2));
    let controller = match at {
        None => Err("no controller has answered yet".to_string()),
        Some(t) if t.elapsed() <= bound => {
            Ok(format!("answered {} ms ago", t.elapsed().as_millis()))
        }
        Some(t) => Err(format!(
            "last answer {} ms ago (more than {} ms)",
            t.elapsed().as_millis(),
            bound.as_millis()
        )),
    };
    let config = Ok(if version.is_empty() {
        "no config version yet".to_string()
    } else {
        format!("config version {version}")
    });
    grl_server::http_util::Readiness::from_checks([("config", config), ("controller", controller)])
}

/// `GET /metrics`: reports accepted and refused, clients, forward latency and failures.
async fn serve_metrics(State(s): State<Arc<Shared>>) -> impl IntoResponse {
    grl_server::metrics::response(&s.registry)
}

#[derive(Deserialize)]
struct ConfigQuery {
    service: Option<String>,
}

/// `GET /v1/config[?service=S]`: the controller's config (one service's file), without what a
/// client below `grl-proto: 9` cannot read (`ConfigDoc::for_peer`).
async fn config(
    State(s): State<Arc<Shared>>,
    Query(q): Query<ConfigQuery>,
    headers: HeaderMap,
) -> Json<ConfigDoc> {
    let st = s.state.lock().expect("aggregator lock");
    let mut doc = ConfigDoc {
        version: st.config.version.clone(),
        services: match q.service {
            Some(svc) => st
                .config
                .services
                .iter()
                .filter(|f| f.service == svc)
                .cloned()
                .collect(),
            None => st.config.services.clone(),
        },
        candidates: st.config.candidates.clone(),
    };
    drop(st);
    doc.for_peer(grl_wire::peer_version(&headers));
    Json(doc)
}

/// A bucket's offered rate by tier over the zone's clients, and whether some client with
/// traffic counted no tiers (the zone's mix is then unknown).
#[derive(Debug, Default)]
pub struct TierSum {
    offered: [f64; TIERS],
    untiered: bool,
}

impl TierSum {
    /// Adds a client's offered rate with its mix of tiers ([`tier_mix`]; None: the client
    /// counts no tiers).
    pub fn add(&mut self, offered: f64, mix: Option<&[f64; TIERS]>) {
        match mix {
            Some(m) => {
                for (o, share) in self.offered.iter_mut().zip(m) {
                    *o += offered * share;
                }
            }
            None => self.untiered |= offered > 0.0,
        }
    }

    /// The sums, when every client with traffic counted tiers.
    pub fn whole(&self) -> Option<[f64; TIERS]> {
        (!self.untiered && self.offered.iter().any(|&o| o > 0.0)).then_some(self.offered)
    }
}

fn build_report(s: &Shared) -> ZoneReport {
    let mut guard = s.state.lock().expect("aggregator lock");
    let st = &mut *guard;
    st.clients.retain(|_, c| c.at.elapsed() <= c.horizon);
    // Rates (and offered rates by tier) summed by bucket, with the offered rates' sum, count
    // and largest for the peer caps (and the clients' total call rates by service).
    let mut sums: HashMap<(String, String), ([f64; 4], TierSum)> = HashMap::new();
    let mut offered: HashMap<(String, String), screen::PeerRates> = HashMap::new();
    let mut per_service: HashMap<&str, screen::ServiceClients> = HashMap::new();
    for ((service, _), c) in st.clients.iter_mut() {
        c.fresh = false;
        let n = per_service.entry(service.as_str()).or_default();
        n.clients += 1;
        n.entries += c.rates.len();
        if let Some(r) = c.calls.rate {
            n.calls.add(r);
        }
        for ((b, r), mix) in c.rates.iter().zip(&c.tier_mix) {
            // Under the lock that client reports wait on: the names are allocated once per
            // bucket, not per client.
            grl_client::keys::update(
                &mut sums,
                (service, b),
                |_| Default::default(),
                |(e, tiers)| {
                    for i in 0..4 {
                        e[i] += r[i];
                    }
                    tiers.add(r[0], mix.as_ref());
                },
            );
            grl_client::keys::update(
                &mut offered,
                (service, b),
                |_| Default::default(),
                |e| e.add(r[0]),
            );
        }
    }
    st.known
        .forwarded(per_service, &offered, &s.opts.plausibility);
    st.waiting = st.clients.len();
    let mut buckets: Vec<ZoneBucketMsg> = sums
        .into_iter()
        .map(|((service, bucket), (r, tiers))| ZoneBucketMsg {
            service,
            bucket,
            offered_rps: r[0],
            admitted_rps: r[1],
            dropped_rps: r[2],
            shadow_dropped_rps: r[3],
            tier_offered_rps: tiers.whole(),
            ..Default::default()
        })
        .collect();
    crate::delta::attach_pending(&mut buckets, &mut st.pending);
    ZoneReport {
        aggregator_id: s.id.clone(),
        region: s.opts.region.clone(),
        zone: s.opts.zone.clone(),
        buckets,
        calls: Vec::new(),
        calls_ms: None,
        session: None,
    }
}

/// The calls held since the last forward, taken, with the time they cover: since
/// `calls_since` (till now, returned: once a controller took them, the next calls begin then).
fn take_calls(st: &mut AggState) -> (Vec<ServiceCallCountMsg>, u64, Instant) {
    let now = Instant::now();
    let covered = now
        .saturating_duration_since(st.calls_since.unwrap_or(now))
        .as_millis() as u64;
    let mut out = Vec::new();
    let mut services: Vec<_> = st.calls.drain().collect();
    services.sort_by(|a, b| a.0.cmp(&b.0));
    for (service, mut p) in services {
        for ((caller, procedure), count) in p.take() {
            out.push(ServiceCallCountMsg {
                service: service.clone(),
                caller,
                procedure,
                count,
            });
        }
    }
    (out, covered, now)
}

/// Puts back calls that were not forwarded (they go with a later forward).
fn restore_calls(s: &Shared, calls: Vec<ServiceCallCountMsg>) {
    let mut st = s.state.lock().expect("aggregator lock");
    let max = s.opts.max_call_keys;
    for c in calls {
        if !st.calls.contains_key(&c.service) && st.calls.len() >= MAX_CALL_SERVICES {
            continue;
        }
        st.calls
            .entry(c.service)
            .or_insert_with(|| PendingCalls::new(max))
            .add(&c.caller, &c.procedure, c.count);
    }
}

/// The bucket counts of a report that no controller took: back into the pending counts (they
/// go with the next forward) when no controller can have applied it; else counted in
/// `grl_aggregator_counts_unconfirmed_total`, not sent twice.
fn restore_counts(s: &Shared, report: &ZoneReport, unsure: bool) {
    if unsure {
        let offered: u64 = report.buckets.iter().map(|b| b.counts.offered).sum();
        s.metrics.counts_unconfirmed.inc_by(offered);
        return;
    }
    let mut st = s.state.lock().expect("aggregator lock");
    crate::delta::restore_pending(&mut st.pending, report);
}

/// Forwards at every tick or as soon as every client reported, until `finish` fires (or its
/// sender is dropped); then forwards once more what the clients reported since the last
/// forward, so that a graceful stop loses no counts.
async fn forward_loop(s: Arc<Shared>, mut finish: oneshot::Receiver<()>) {
    let mut iv = tokio::time::interval(s.opts.tick);
    iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut rounds = Rounds::default();
    let insecure_reminder = LogGate::new(Duration::from_secs(60));
    let mut last = false;
    while !last {
        tokio::select! {
            _ = iv.tick() => {}
            _ = s.all_in.notified() => { iv.reset(); }
            _ = &mut finish => { last = true; }
        }
        if s.opts.allow_anonymous_reports && insecure_reminder.open() {
            tracing::warn!("INSECURE: anonymous client reports are accepted (--insecure-allow-anonymous-reports)");
        }
        let mut report = build_report(&s);
        rounds.round += 1;
        if last && !last_counts_left(&s, &report) {
            return;
        }
        send_to_standbys(
            &s,
            &report,
            rounds.current,
            &mut rounds.upstreams,
            rounds.round,
        );
        let sent = forward_round(&s, &mut rounds, &mut report, last).await;
        if !sent.done {
            keep_unforwarded(&s, &mut report, sent.unsure);
        }
        log_round(&s, sent.done, last);
    }
}

/// What the forward loop keeps from round to round.
#[derive(Default)]
struct Rounds {
    /// The controller replica tried first: the last one that answered.
    current: usize,
    /// The protocol version each controller announced (1 until it answers) and its delta
    /// session.
    upstreams: crate::delta::Upstreams,
    /// Rounds so far.
    round: u64,
}

/// What became of one round's report.
struct RoundOutcome {
    /// A controller answered: its directives are served.
    done: bool,
    /// A controller may have applied a report it did not answer.
    unsure: bool,
}

/// At a graceful stop: whether the clients reported anything since the last forward (logged
/// either way).
fn last_counts_left(s: &Shared, report: &ZoneReport) -> bool {
    let counted: u64 = report.buckets.iter().map(|b| b.counts.offered).sum();
    if report.buckets.is_empty() && s.state.lock().expect("aggregator lock").calls.is_empty() {
        tracing::info!(zone = %s.opts.zone, "aggregator stopped; nothing left to forward");
        return false;
    }
    tracing::info!(zone = %s.opts.zone, buckets = report.buckets.len(), offered = counted,
        "aggregator stopping: forwarding the last counts");
    true
}

/// Sends `report` to the controller replicas in turn, from the one that answered last, until
/// one answers; its directives (and its config, when the version changed) are then served.
async fn forward_round(
    s: &Arc<Shared>,
    rounds: &mut Rounds,
    report: &mut ZoneReport,
    last: bool,
) -> RoundOutcome {
    let n = s.opts.controllers.len();
    let mut unsure = false;
    // The calls in `report` (taken for a controller of protocol 2 or later) and when
    // they were taken.
    let mut taken: Option<(u64, Instant)> = None;
    for attempt in 0..n {
        let idx = (rounds.current + attempt) % n;
        let base = &s.opts.controllers[idx];
        // Waits for a standby copy in flight to this replica (one report at a time per
        // session).
        let up = rounds.upstreams.get(base);
        let mut up = up.lock().await;
        attach_calls(s, report, &mut taken, up.proto);
        let sent = forward_timed(s, &mut up, base, report, rounds.round, last).await;
        drop(up);
        match sent {
            Ok(d) => {
                rounds.current = idx;
                serve_answer(s, base, d, taken).await;
                return RoundOutcome { done: true, unsure };
            }
            Err(e) => {
                unsure |= !grl_client::http_util::CallError::never_applied_any(&e);
                tracing::warn!(controller = %base, error = %e, "forward to controller failed")
            }
        }
    }
    RoundOutcome {
        done: false,
        unsure,
    }
}

/// Calls go only to a controller that announced protocol 2 (an older one refuses the field);
/// until then they wait, bounded. Takes them into `report` for the first such controller
/// (`taken`), and puts them back when the next one tried is older.
fn attach_calls(
    s: &Shared,
    report: &mut ZoneReport,
    taken: &mut Option<(u64, Instant)>,
    proto: u32,
) {
    if proto >= 2 {
        if taken.is_none() {
            let (calls, ms, at) = take_calls(&mut s.state.lock().expect("aggregator lock"));
            report.calls = calls;
            *taken = Some((ms, at));
        }
        // The time they cover, to a controller that reads it (it rates them over it).
        report.calls_ms = taken
            .filter(|_| proto >= grl_wire::PROTO_CALLS_MS)
            .map(|t| t.0);
    } else if taken.take().is_some() {
        restore_calls(s, std::mem::take(&mut report.calls));
        report.calls_ms = None;
    }
}

/// [`forward_to`] the replica whose directives are served, timed in the forward latency
/// histogram (or counted as a forward failure).
async fn forward_timed(
    s: &Shared,
    up: &mut crate::delta::Upstream,
    base: &str,
    report: &ZoneReport,
    round: u64,
    last: bool,
) -> anyhow::Result<ZoneDirectives> {
    let t = Instant::now();
    let sent = forward_to(s, up, base, report, round, last, Held::Served).await;
    match &sent {
        Ok(_) => s
            .metrics
            .forward_seconds
            .0
            .observe(t.elapsed().as_secs_f64()),
        Err(_) => {
            s.metrics.forward_failures.inc();
        }
    }
    sent
}

/// Serves the directives controller `base` answered, after fetching its config when the
/// version changed; the calls `taken` for it count from the time they were taken.
async fn serve_answer(s: &Shared, base: &str, d: ZoneDirectives, taken: Option<(u64, Instant)>) {
    let refetch = s.state.lock().expect("aggregator lock").config.version != d.version;
    if refetch {
        match fetch_config(s, base).await {
            Ok(doc) => {
                tracing::info!(version = %doc.version, "aggregator fetched config");
                let mut st = s.state.lock().expect("aggregator lock");
                st.known.rebuild(&doc);
                st.config = doc;
            }
            Err(e) => {
                tracing::warn!(controller = %base, error = %e, "config fetch failed")
            }
        }
    }
    let mut st = s.state.lock().expect("aggregator lock");
    if let Some((_, at)) = taken {
        st.calls_since = Some(at);
    }
    st.known.follow(&d);
    crate::delta::merge_directives(&mut st.directives, d);
    st.directives_at = Some(Instant::now());
}

/// A report no controller took: its calls go back (with the next forward, `calls_since`
/// unchanged), its counts as [`restore_counts`] says.
fn keep_unforwarded(s: &Shared, report: &mut ZoneReport, unsure: bool) {
    if !report.calls.is_empty() {
        restore_calls(s, std::mem::take(&mut report.calls));
    }
    restore_counts(s, report, unsure);
}

/// Logs how a round ended when it matters: the last one, or none reachable.
fn log_round(s: &Shared, done: bool, last: bool) {
    if last {
        if done {
            tracing::info!(zone = %s.opts.zone, "aggregator stopped; last counts forwarded");
        } else {
            tracing::warn!(zone = %s.opts.zone, "aggregator stopped; no controller reachable for the last counts");
        }
    } else if !done {
        tracing::warn!(zone = %s.opts.zone, "no controller reachable; serving cached directives until they go stale");
    }
}

/// Sends a copy of `report` to every controller replica but `primary` (fire and forget, at most
/// one report in flight per replica): a standby computes the same ratios from the same zone
/// rates, so when the aggregator fails over to it the clients' directives carry on within the
/// tick. The copy carries the rates only: counts and calls go to the replica whose directives
/// are served (and to the next one when it fails), so that each request is counted once over
/// the replicas' `/metrics`. Each standby has its own delta session ([`crate::delta::Upstream`]):
/// once it announced protocol 4 it gets deltas like the serving replica, a full report first
/// and again after a `resync` or a failed copy, and it answers with the directives changed
/// since its own last reply (dropped here). Failed copies count in
/// `grl_aggregator_standby_failures_total`.
fn send_to_standbys(
    s: &Arc<Shared>,
    report: &ZoneReport,
    primary: usize,
    upstreams: &mut crate::delta::Upstreams,
    round: u64,
) {
    let n = s.opts.controllers.len();
    if n < 2 {
        return;
    }
    let mut copy: Option<Arc<ZoneReport>> = None;
    for (idx, base) in s.opts.controllers.iter().enumerate() {
        if idx == primary % n {
            continue;
        }
        // A copy still in flight: this one is skipped (the next carries the rates anew).
        let Ok(mut up) = upstreams.get(base).try_lock_owned() else {
            continue;
        };
        let copy = copy
            .get_or_insert_with(|| {
                let mut c = ZoneReport {
                    aggregator_id: report.aggregator_id.clone(),
                    region: report.region.clone(),
                    zone: report.zone.clone(),
                    buckets: report.buckets.clone(),
                    calls: Vec::new(),
                    calls_ms: None,
                    session: None,
                };
                for b in &mut c.buckets {
                    b.counts = BucketCountsMsg {
                        bucket: b.bucket.clone(),
                        ..Default::default()
                    };
                }
                Arc::new(c)
            })
            .clone();
        let (s, base) = (s.clone(), base.clone());
        tokio::spawn(async move {
            if let Err(e) = forward_to(&s, &mut up, &base, &copy, round, false, Held::Own).await {
                s.metrics.standby_failures.inc();
                tracing::debug!(controller = %base, error = %e, "standby controller replica did not take the zone report (see grl_aggregator_standby_failures_total)");
            }
        });
    }
}

/// Which directives a report names as held (`ReportSession::directives`).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Held {
    /// Those served to the clients (the replica whose directives are served).
    Served,
    /// The upstream's own last reply (a standby, whose replies are dropped).
    Own,
}

/// Sends `full` to controller `base` as its upstream state wants it (full, or a delta once
/// it announced protocol 4; full again at once when it answers `resync`), and records the
/// answer.
async fn forward_to(
    s: &Shared,
    up: &mut crate::delta::Upstream,
    base: &str,
    full: &ZoneReport,
    round: u64,
    flush: bool,
    held: Held,
) -> anyhow::Result<ZoneDirectives> {
    // A resync costs one more request, at most one per forward.
    for _ in 0..2 {
        let mut p = up.prepare(full, round, s.opts.delta, flush);
        if let Some(sess) = &mut p.report.session {
            sess.directives = match held {
                Held::Served => crate::delta::directives_held(
                    &s.state.lock().expect("aggregator lock").directives,
                ),
                Held::Own => up.seen,
            };
        }
        let sent = post_report(s, base, &p.report).await;
        let (d, v) = match sent {
            Ok(x) => x,
            Err(e) => {
                up.failed();
                return Err(e);
            }
        };
        up.proto = v;
        let resync = d.session.is_some_and(|r| r.resync);
        up.answered(p, &d);
        if resync {
            continue;
        }
        return Ok(d);
    }
    anyhow::bail!("controller {base} asked for a full report twice in a row")
}

async fn post_report(
    s: &Shared,
    base: &str,
    r: &ZoneReport,
) -> anyhow::Result<(ZoneDirectives, u32)> {
    let mut req = s
        .http
        .post(format!("{base}/v1/aggregate"))
        .header(PROTO_HEADER, PROTO_VERSION)
        .json(r);
    if let Some(t) = s
        .opts
        .report_token
        .as_ref()
        .map(|t| t.current())
        .filter(|t| !t.is_empty())
    {
        req = req.bearer_auth(t);
    }
    // A delta is answered within the tick by a live controller: one that has not started
    // answering by then is taken as hung and the next replica gets the report (a dead one
    // refuses the connection at once). A full report (first contact, after a resync) may
    // take longer and has the client's whole timeout; so does reading the answer.
    let call = grl_client::http_util::call(req, CONTROLLER_TIMEOUT, MAX_ANSWER);
    let answer = match r.session.and_then(|sess| sess.base) {
        Some(_) => {
            let bound = delta_answer_timeout(s.opts.tick);
            tokio::time::timeout(bound, call).await.map_err(|_| {
                anyhow::anyhow!(
                    "{base}: no answer to a delta report within {} ms (controller hung?)",
                    bound.as_millis()
                )
            })??
        }
        None => call.await?,
    };
    let version = grl_wire::peer_version(&answer.headers);
    Ok((answer.json()?, version))
}

/// The largest answer read from a controller (every service's directives, or the served
/// config with the buckets of overrides).
const MAX_ANSWER: usize = 128 << 20;

/// How long a controller may take to start answering a delta report before the aggregator
/// gives up on it: one tick, at least [`MIN_DELTA_ANSWER`] (a loaded controller's lock), at
/// most the client's timeout.
fn delta_answer_timeout(tick: Duration) -> Duration {
    tick.clamp(MIN_DELTA_ANSWER, CONTROLLER_TIMEOUT)
}

/// The floor of [`delta_answer_timeout`].
const MIN_DELTA_ANSWER: Duration = Duration::from_millis(500);

/// The controller client's timeout (a whole request, the answer read included).
const CONTROLLER_TIMEOUT: Duration = Duration::from_secs(2);

async fn fetch_config(s: &Shared, base: &str) -> anyhow::Result<ConfigDoc> {
    let req = s
        .http
        .get(format!("{base}/v1/config"))
        .header(PROTO_HEADER, PROTO_VERSION);
    Ok(
        grl_client::http_util::call(req, CONTROLLER_TIMEOUT, MAX_ANSWER)
            .await?
            .json()?,
    )
}

#[cfg(test)]
mod standby_tests {
    use super::*;
    use crate::engine::Engine;
    use serde_json::json;

    const TOKEN: &str = "t0ken";

    fn config() -> serde_json::Value {
        json!({"version": "v1", "services": [{"service": "payments", "buckets": [
            {"name": "gw.charge", "caller": "gw", "procedure": "charge", "scope": "global",
             "limit_rps": 100.0, "mode": "enforce", "policy": "peak"},
            {"name": "gw.refund", "caller": "gw", "procedure": "refund", "scope": "zone",
             "limit_rps": 100.0, "mode": "enforce", "policy": "peak"}]}]})
    }

    /// What a standby replica received, and whether its replies were deltas.
    #[derive(Default)]
    struct Seen {
        reports: Vec<ZoneReport>,
        delta_replies: usize,
    }

    /// A standby replica: the controller's engine behind `POST /v1/aggregate` (protocol 4),
    /// recording every report.
    async fn standby(seen: Arc<Mutex<Seen>>) -> (String, tokio::task::JoinHandle<()>) {
        let doc: ConfigDoc = serde_json::from_value(config()).unwrap();
        let engine = Arc::new(Mutex::new(Engine::new(doc, 60_000)));
        let app = Router::new().route(
            "/v1/aggregate",
            post(move |Json(r): Json<ZoneReport>| {
                let (engine, seen) = (engine.clone(), seen.clone());
                async move {
                    let d = engine.lock().unwrap().answer(&r, 0, 0);
                    let mut seen = seen.lock().unwrap();
                    seen.delta_replies += d.session.is_some_and(|s| s.delta) as usize;
                    seen.reports.push(r);
                    ([(PROTO_HEADER, PROTO_VERSION.to_string())], Json(d))
                }
            }),
        );
        crate::tests::serve_on_free_port(app).await
    }

    /// Standby replicas get delta reports carrying rates only, answered with deltas, through
    /// their own session; a standby that cannot be reached counts in
    /// `grl_aggregator_standby_failures_total`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn standbys_get_deltas_of_rates_and_failed_copies_are_counted() {
        let dir = tempfile::tempdir().unwrap();
        let c = crate::tests::anonymous_controller(dir.path().join("c"), TOKEN).await;
        let http = reqwest::Client::new();
        let r = http
            .put(format!("{}/v1/config", c.url()))
            .bearer_auth(TOKEN)
            .json(&config())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let seen = Arc::new(Mutex::new(Seen::default()));
        let (standby_url, standby_server) = standby(seen.clone()).await;
        // A replica that refuses connections (a port bound, then released).
        let dead = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            format!("http://{}", l.local_addr().unwrap())
        };
        let a = Aggregator::start(AggregatorOptions {
            controllers: vec![c.url(), standby_url, dead],
            zone: "z1".into(),
            region: "r1".into(),
            tick: Duration::from_millis(50),
            allow_anonymous_reports: true,
            // Every changed rate goes (the reports below change one bucket each time).
            delta: crate::delta::DeltaOptions {
                threshold: 0.0,
                refresh_ticks: 1000,
            },
            ..Default::default()
        })
        .await
        .unwrap();
        let report = |n: u64| {
            json!({"client_id": "c1", "service": "payments", "version": "v1", "interval_ms": 1000,
                "buckets": [
                    {"bucket": "gw.charge", "offered": 50 + n, "admitted": 50 + n, "dropped": 0, "shadow_dropped": 0},
                    {"bucket": "gw.refund", "offered": 7, "admitted": 7, "dropped": 0, "shadow_dropped": 0}]})
        };
        let mut n = 0;
        for _ in 0..200 {
            n += 1;
            let r = http
                .post(format!("{}/v1/report", a.url()))
                .json(&report(n))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            tokio::time::sleep(Duration::from_millis(30)).await;
            if seen.lock().unwrap().reports.len() >= 8 {
                break;
            }
        }
        {
            let seen = seen.lock().unwrap();
            let reports = &seen.reports;
            assert!(
                reports.len() >= 8,
                "{} copies reached the standby",
                reports.len()
            );
            // Before the standby announced protocol 4: a full copy without a session; then a
            // full report opening the session, then deltas on top of the last one applied.
            assert_eq!(reports[0].session, None);
            let s1 = reports[1]
                .session
                .expect("a session once protocol 4 was announced");
            assert_eq!(s1.base, None);
            for (i, r) in reports.iter().enumerate().skip(2) {
                let s = r.session.unwrap();
                assert_eq!(s.id, s1.id, "one session");
                assert_eq!(
                    s.base,
                    Some(s.seq - 1),
                    "report {i}: a delta of the previous one"
                );
                assert!(
                    s.directives.is_some(),
                    "report {i} names the standby's directives"
                );
            }
            // gw.refund's rate stays put: the standby gets it once (in the full report or in
            // the first delta after it appeared), never again.
            let refunds = reports[1..]
                .iter()
                .filter(|r| r.buckets.iter().any(|b| b.bucket == "gw.refund"))
                .count();
            assert_eq!(refunds, 1, "gw.refund sent {refunds} times");
            // Rates only: counts and calls go to the serving replica.
            for r in reports {
                assert!(r.calls.is_empty());
                assert!(r
                    .buckets
                    .iter()
                    .all(|b| b.counts.offered == 0 && b.counts.admitted == 0));
            }
            assert!(
                seen.delta_replies >= reports.len() - 2,
                "{} delta replies",
                seen.delta_replies
            );
        }
        let metrics = http
            .get(format!("{}/metrics", a.url()))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let failures: f64 = metrics
            .lines()
            .find_map(|l| l.strip_prefix("grl_aggregator_standby_failures_total "))
            .expect("the standby failures counter is exported")
            .trim()
            .parse()
            .unwrap();
        assert!(failures >= 1.0, "{metrics}");
        a.shutdown().await;
        c.shutdown().await;
        standby_server.abort();
    }
}
