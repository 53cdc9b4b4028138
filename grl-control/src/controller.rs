//! The controller: config API, overrides, per-tick drop ratios, reports and metrics.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path as UrlPath, Query, State};
use axum::http::HeaderMap;
use axum::response::IntoResponse;
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

use crate::audit::Event;
use crate::config::{self, write_atomic};
use crate::engine::Engine;
use crate::overrides::{Override, OverrideRequest};
use grl_client::auth::{Credential, CredentialSet, LogGate, RefusalCounts, TokenSource};
use grl_client::http_util::unix_now;
use grl_server::http_util::{parse_json, read_body, ApiError};
use grl_wire::{ConfigDoc, ZoneReport};

mod routes;
mod state;

use routes::{
    add_override, aggregate, candidates, get_config, list_overrides, metrics, override_history,
    put_config, readyz, remove_override, reports, status,
};
use state::{db_sync_loop, load_start_state, lock_state_dir, DbCollector};

/// How to start a controller.
#[derive(Debug, Clone)]
pub struct ControllerOptions {
    /// Listen address (port 0 picks a free port).
    pub listen: SocketAddr,
    /// Where the last applied config and the overrides are persisted.
    pub state_dir: PathBuf,
    /// Legacy all-purpose API token (`GRL_TOKEN`): roles `config`, `overrides` and `reports`,
    /// recorded under the name `GRL_TOKEN`. Empty = none. Prefer `credentials`, one per role.
    pub token: String,
    /// Accepted credentials and their roles ([`ROLES`]), from environment variables and/or a
    /// credentials file re-read when it changes (see [`grl_client::auth`]).
    pub credentials: CredentialSet,
    /// Bucket YAML loaded at start when no config has been persisted yet.
    pub config_dir: Option<PathBuf>,
    /// Control-loop period.
    pub tick: Duration,
    /// This controller's region (needed with `peers`).
    pub region: Option<String>,
    /// Controllers of other regions: each tick they get this region's sums of `global`
    /// buckets, so every region computes global ratios over the whole fleet.
    pub peers: Vec<String>,
    /// Zone-report secret (`GRL_REPORT_TOKEN`): accepted on `POST /v1/aggregate` (role
    /// `zone-report`, name `GRL_REPORT_TOKEN`) and sent to the peers. More zone-report
    /// credentials (a rotation's next one) can be in `credentials`.
    pub report_token: Option<TokenSource>,
    /// Development only: accept zone reports that carry no credential (a warning is logged at
    /// start and every minute). Without it and without any `zone-report` credential the
    /// controller refuses to start.
    pub allow_anonymous_reports: bool,
    /// Serve HTTPS with these files (reloaded when they change); None = plain HTTP.
    pub tls: Option<grl_server::tls::ServerTls>,
    /// How this controller verifies (and identifies itself to) its peers.
    pub client_tls: grl_client::tls::ClientTls,
    /// `grl_calls_total`: labelled callers per service (the top ones by recent volume; the
    /// rest fold into `caller="_other"`).
    pub max_callers_per_service: usize,
    /// `grl_calls_total`: labelled procedures per service (the first seen; the rest fold
    /// into `procedure="_other"`).
    pub max_procedures_per_service: usize,
    /// Keep the config and the overrides in this Postgres database instead of the state
    /// directory, shared with the region's other controller replicas (see
    /// [`crate::state_db`]). None = the state directory.
    pub database: Option<DatabaseOptions>,
    /// Header and idle timeouts, connection cap and health connections of the listener.
    pub serve: grl_server::server::ServeLimits,
    /// A second listener serving `/healthz` and `/readyz` only (None: none).
    pub health_listen: Option<SocketAddr>,
    /// Overrides active at once; one more is refused (422).
    pub max_overrides: usize,
}

/// The default of [`ControllerOptions::max_overrides`].
pub const DEFAULT_MAX_OVERRIDES: usize = 1_000;

/// The shared state database of controller replicas.
#[derive(Debug, Clone)]
pub struct DatabaseOptions {
    /// `postgres://…` (its password is never logged).
    pub url: crate::state_db::DbUrl,
    /// Period of the fallback poll for changes (notifications carry them at once).
    pub poll: Duration,
    /// How long a starting controller retries reaching the database before it gives up.
    pub connect_timeout: Duration,
}

impl DatabaseOptions {
    /// Defaults: a 2 s poll, 30 s to reach the database at start.
    pub fn new(url: &str) -> DatabaseOptions {
        DatabaseOptions {
            url: crate::state_db::DbUrl(url.to_string()),
            poll: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(30),
        }
    }
}

/// The controller's roles: `config` (`PUT /v1/config`, held by rlc), `overrides`
/// (`POST`/`DELETE /v1/overrides`, held by on-call people), `reports` (`GET /v1/reports`, read
/// by rlc) and `zone-report` (`POST /v1/aggregate`, held by aggregators and peer controllers).
pub const ROLES: &[&str] = &["config", "overrides", "reports", "zone-report"];

/// The roles of the legacy all-purpose token (`GRL_TOKEN`): every role a person or rlc holds,
/// not `zone-report`.
pub const LEGACY_TOKEN_ROLES: &[&str] = &["config", "overrides", "reports"];

/// Largest `POST /v1/overrides` body.
const MAX_OVERRIDE_BODY: usize = 64 << 10;
/// Largest config or zone report (tens of thousands of buckets).
const MAX_BODY: usize = 64 << 20;

impl Default for ControllerOptions {
    fn default() -> Self {
        ControllerOptions {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            state_dir: PathBuf::from("grl-state"),
            token: String::new(),
            credentials: CredentialSet::default(),
            config_dir: None,
            tick: Duration::from_secs(1),
            region: None,
            peers: Vec::new(),
            report_token: None,
            allow_anonymous_reports: false,
            tls: None,
            client_tls: grl_client::tls::ClientTls::default(),
            max_callers_per_service: grl_client::calls::DEFAULT_MAX_CALLERS,
            max_procedures_per_service: grl_client::calls::DEFAULT_MAX_PROCEDURES,
            database: None,
            serve: Default::default(),
            health_listen: None,
            max_overrides: DEFAULT_MAX_OVERRIDES,
        }
    }
}

/// A running controller.
pub type ControllerHandle = grl_server::http_util::ServerHandle;

/// The lock file in a state directory.
pub const STATE_LOCK_FILE: &str = "controller.lock";

/// The override id counter; the overrides themselves live in the engine.
struct Persisted {
    next_id: u64,
}

#[derive(Serialize, Deserialize, Default)]
struct OverridesFile {
    next_id: u64,
    overrides: Vec<Override>,
}

struct Shared {
    engine: Arc<Mutex<Engine>>,
    /// Every request by (service, caller, procedure), as the zones report them.
    calls: Arc<Mutex<grl_client::calls::CallStats>>,
    /// `/metrics`: build info, refusals and the engine's series (read at scrape time).
    registry: prometheus_client::registry::Registry,
    persisted: Mutex<Persisted>,
    creds: CredentialSet,
    report_token: Option<TokenSource>,
    allow_anonymous_reports: bool,
    refused: RefusalCounts,
    refused_log: LogGate,
    state_dir: PathBuf,
    started: std::time::Instant,
    tick: Duration,
    /// [`Shared::now_ms`] at the end of the last tick (`u64::MAX`: none yet), for `/readyz`.
    last_tick_ms: std::sync::atomic::AtomicU64,
    /// The shared state database (replicas); None = the state directory.
    db: Option<Arc<DbSync>>,
    max_overrides: usize,
}

/// This replica's view of the state database.
struct DbSync {
    db: crate::state_db::StateDb,
    /// The revision applied to the engine. Held across a catch-up or a change of this
    /// replica's, so that they apply in revision order.
    applied: tokio::sync::Mutex<Applied>,
    /// Last contact with the database, for `/readyz` and `/v1/status`.
    health: Mutex<DbHealth>,
    errors_log: LogGate,
}

#[derive(Debug, Clone, Copy)]
struct Applied {
    rev: i64,
    config_rev: i64,
}

struct DbHealth {
    rev: i64,
    ok_at: std::time::Instant,
    error: Option<String>,
}

impl DbSync {
    fn ok(&self, rev: i64) {
        let mut h = self.health.lock().expect("db health lock");
        h.rev = rev;
        h.ok_at = std::time::Instant::now();
        h.error = None;
    }

    fn failed(&self, what: &str, e: &crate::state_db::DbError) {
        self.health.lock().expect("db health lock").error = Some(e.to_string());
        if self.errors_log.open() {
            tracing::warn!(error = %e, what, "state database unreachable or failing: serving the state held in memory; changes answer 503 (logged at most every 10 s)");
        }
    }

    /// A database error as the answer to a change: 503, nothing changed.
    fn refuse(&self, what: &str, e: crate::state_db::DbError) -> ApiError {
        self.failed(what, &e);
        ApiError::Unavailable(format!(
            "the state database cannot take the change now; nothing was changed, retry later ({what})"
        ))
    }
}

impl Shared {
    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// The request's credential when it holds `role`; 401 without a known credential, 403
    /// with one that lacks the role. Reads the headers only: call it before the body.
    fn authorize(
        &self,
        headers: &HeaderMap,
        role: &str,
        endpoint: &str,
    ) -> Result<Credential, ApiError> {
        match self.creds.authenticate(headers) {
            Ok(c) if c.covers(role) => Ok(c),
            Ok(c) => {
                tracing::warn!(credential = %c.name, endpoint, role, "credential lacks the role: refused (403)");
                Err(ApiError::Forbidden(format!(
                    "credential `{}` does not hold the `{role}` role needed by {endpoint}",
                    c.name
                )))
            }
            Err(r) => {
                if self.refused_log.open() {
                    tracing::warn!(
                        endpoint,
                        reason = r.reason(),
                        "unauthenticated request refused (401; logged at most every 10 s)"
                    );
                }
                Err(ApiError::Unauthorized)
            }
        }
    }

    /// A zone report refused: counted by reason (and logged, at most every 10 s).
    fn refuse_report(&self, reason: &'static str, err: ApiError) -> ApiError {
        self.refused.add(reason);
        if self.refused_log.open() {
            tracing::warn!(reason, error = %err, "zone report refused (logged at most every 10 s; see grl_reports_refused_total)");
        }
        err
    }

    fn save_overrides(&self, next_id: u64, overrides: &[Override]) -> Result<(), ApiError> {
        // The shape of `OverridesFile`, borrowed.
        #[derive(Serialize)]
        struct Borrowed<'a> {
            next_id: u64,
            overrides: &'a [Override],
        }
        let f = Borrowed { next_id, overrides };
        // Compact: rewritten whole at every change, up to --max-overrides of them.
        let bytes = serde_json::to_vec(&f).map_err(|e| ApiError::Internal(e.to_string()))?;
        write_atomic(&self.state_dir.join("overrides.json"), &bytes)
            .map_err(|e| ApiError::Internal(format!("write overrides: {e}")))
    }

    /// Appends `events` to the state directory's audit log. A failure is logged, not
    /// returned: the change it records is already in force and persisted.
    fn audit(&self, events: &[Event]) {
        let log = crate::audit::FileLog::in_dir(&self.state_dir);
        if let Err(e) = log.append(events) {
            for ev in events {
                tracing::error!(error = %e, file = %log.path().display(), id = %ev.id, action = ev.action.as_str(),
                    "cannot write the overrides' audit log");
            }
        }
    }
}

/// The controller as a router (for tests without sockets and for `start`).
fn app(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/v1/config", get(get_config).put(put_config))
        .route("/v1/status", get(status))
        .route("/v1/reports", get(reports))
        .route("/v1/candidates", get(candidates))
        .route("/v1/aggregate", post(aggregate))
        .route("/v1/overrides", get(list_overrides).post(add_override))
        .route("/v1/overrides/history", get(override_history))
        .route("/v1/overrides/{id}", delete(remove_override))
        .route("/metrics", get(metrics))
        .route("/healthz", get(grl_server::http_util::healthz))
        .route("/readyz", get(readyz))
        .with_state(shared)
        // Every answer announces the protocol version (rlc sends candidates only to a
        // controller that announced protocol 5; it reads it from GET /v1/status).
        .layer(axum::middleware::map_response(
            |mut r: axum::response::Response| async move {
                r.headers_mut()
                    .entry(grl_wire::PROTO_HEADER)
                    .or_insert_with(grl_wire::version_header);
                r
            },
        ))
}

/// The controller.
pub struct Controller;

impl Controller {
    /// Loads persisted state (or `config_dir`), binds, and starts serving and ticking.
    pub async fn start(opts: ControllerOptions) -> anyhow::Result<ControllerHandle> {
        use anyhow::Context;
        std::fs::create_dir_all(&opts.state_dir)
            .with_context(|| format!("create state dir {}", opts.state_dir.display()))?;
        let state_lock = lock_state_dir(&opts.state_dir).await?;
        let creds = start_credentials(&opts)?;
        let (cfg, ov, db) = load_start_state(&opts).await?;
        tracing::info!(version = %cfg.version, services = cfg.services.len(), overrides = ov.overrides.len(), "controller state loaded");
        let engine = start_engine(&opts, cfg, ov.overrides)?;
        let (shared, server_stats) = shared_state(&opts, creds, engine, ov.next_id, db.clone());
        // TLS files and the peer client are checked before binding: a controller does not
        // start on files that do not load.
        let tls = opts
            .tls
            .as_ref()
            .map(grl_server::tls::ReloadingServerConfig::load)
            .transpose()?;
        let http = opts
            .client_tls
            .http_client(opts.tick.max(Duration::from_millis(200)))
            .context("peer controller client")?;
        grl_client::tls::warn_plain_http(
            "peer controller URL",
            opts.peers.iter().map(String::as_str),
        );
        let scheme = if tls.is_some() { "https" } else { "http" };
        let listener = tokio::net::TcpListener::bind(opts.listen)
            .await
            .with_context(|| format!("bind {}", opts.listen))?;
        let addr = listener.local_addr()?;
        let health_routes = Router::new()
            .route("/healthz", get(grl_server::http_util::healthz))
            .route("/readyz", get(readyz))
            .with_state(shared.clone());
        let health = grl_server::http_util::spawn_health(
            opts.health_listen,
            health_routes,
            tls.clone(),
            opts.serve,
            "controller health",
        )
        .await?;
        let (stop, server) = grl_server::http_util::spawn_server(
            listener,
            app(shared.clone()),
            tls,
            opts.serve,
            server_stats,
            "controller",
        );
        let peering = match (&opts.region, opts.peers.is_empty()) {
            (_, true) => None,
            (Some(r), false) => Some((r.clone(), opts.peers.clone())),
            (None, false) => anyhow::bail!("peers need this controller's region"),
        };
        let (finish, finished) = oneshot::channel::<()>();
        let follower = match (&db, &opts.database) {
            (Some(sync), Some(dbo)) => Some(tokio::spawn(db_sync_loop(
                shared.clone(),
                sync.clone(),
                dbo.poll.max(Duration::from_millis(100)),
            ))),
            _ => None,
        };
        let ticker = tokio::spawn(tick_loop(
            shared, peering, http, finished, follower, state_lock,
        ));
        tracing::info!(%addr, scheme, "controller listening");
        Ok(ControllerHandle {
            addr,
            scheme,
            stop,
            server,
            finish,
            background: ticker,
            health,
        })
    }
}

/// The controller's credentials: `opts.credentials` with the legacy token and the report
/// token; refuses to start without a zone-report credential unless anonymous reports are
/// allowed, and warns for each role no credential holds.
fn start_credentials(opts: &ControllerOptions) -> anyhow::Result<CredentialSet> {
    let mut creds = opts.credentials.clone();
    if !opts.token.is_empty() {
        creds.add(
            "GRL_TOKEN",
            LEGACY_TOKEN_ROLES,
            TokenSource::fixed(&opts.token),
        );
    }
    if let Some(t) = &opts.report_token {
        creds.add("GRL_REPORT_TOKEN", &["zone-report"], t.clone());
    }
    if opts.allow_anonymous_reports {
        tracing::warn!("INSECURE: --insecure-allow-anonymous-reports: zone reports without a credential are accepted; anyone who reaches this port can make the fleet drop traffic (development only)");
    } else {
        anyhow::ensure!(
            creds.any_covers("zone-report"),
            "refusing to start: no zone-report credential (set GRL_REPORT_TOKEN or GRL_REPORT_TOKEN_FILE, or a `zone-report` line in the credentials file); --insecure-allow-anonymous-reports accepts anonymous reports for development"
        );
    }
    for role in LEGACY_TOKEN_ROLES {
        if !creds.any_covers(role) {
            tracing::warn!(
                role,
                "no credential holds this role: its endpoints answer 401"
            );
        }
    }
    Ok(creds)
}

/// The engine on the loaded config, with the loaded overrides (refused as a new override
/// would be) and report cursors monotonic across restarts.
fn start_engine(
    opts: &ControllerOptions,
    cfg: ConfigDoc,
    overrides: Vec<Override>,
) -> anyhow::Result<Engine> {
    // A zone counts for three of its own forwarding intervals (learnt by the engine from
    // the gaps between its reports), and at least three of this controller's ticks.
    let zone_ttl = (opts.tick * 3).as_millis() as u64;
    let mut engine = Engine::new(cfg, zone_ttl);
    // The same check as a new override gets: the config the overrides make clients run
    // must compile.
    if overrides.is_empty() {
        // Nothing to check (a fresh controller has no config version yet).
    } else if let Err(e) = engine.try_set_overrides(overrides, |_| Ok::<(), ()>(())) {
        let from = match &opts.database {
            Some(d) => format!("state database {:?}", d.url),
            None => format!(
                "state file {}",
                opts.state_dir.join("overrides.json").display()
            ),
        };
        anyhow::bail!("refusing to start: {from}: the overrides cannot be served: {e}");
    }
    // Report cursors stay monotonic across restarts (see Engine::set_report_seq_base).
    let start_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    engine.set_report_seq_base(start_ms << 10);
    Ok(engine)
}

/// The state the handlers and the tick share, with the metrics registry (the engine's,
/// the calls', the state database's and the server's series).
fn shared_state(
    opts: &ControllerOptions,
    creds: CredentialSet,
    engine: Engine,
    next_id: u64,
    db: Option<Arc<DbSync>>,
) -> (Arc<Shared>, Arc<grl_server::server::ServerStats>) {
    let engine = Arc::new(Mutex::new(engine));
    let refused = RefusalCounts::default();
    let mut registry = prometheus_client::registry::Registry::default();
    grl_client::metrics::register_build_info(&mut registry, "grl", "controller");
    refused.register(&mut registry);
    let server_stats = Arc::new(grl_server::server::ServerStats::default());
    server_stats.register(&mut registry);
    registry.register_collector(Box::new(crate::metrics::EngineCollector::new(
        engine.clone(),
    )));
    let calls = Arc::new(Mutex::new(grl_client::calls::CallStats::new(
        opts.max_callers_per_service,
        opts.max_procedures_per_service,
    )));
    registry.register_collector(Box::new(grl_client::calls::CallsCollector(calls.clone())));
    if let Some(sync) = &db {
        registry.register_collector(Box::new(DbCollector(sync.clone())));
    }
    let shared = Arc::new(Shared {
        engine,
        calls,
        registry,
        persisted: Mutex::new(Persisted { next_id }),
        creds,
        report_token: opts.report_token.clone(),
        allow_anonymous_reports: opts.allow_anonymous_reports,
        refused,
        refused_log: LogGate::new(Duration::from_secs(10)),
        state_dir: opts.state_dir.clone(),
        started: std::time::Instant::now(),
        tick: opts.tick,
        last_tick_ms: std::sync::atomic::AtomicU64::new(u64::MAX),
        db: db.clone(),
        max_overrides: opts.max_overrides,
    });
    (shared, server_stats)
}

/// Ticks until `finish` fires (or its sender is dropped), then logs the state it leaves on
/// disk: every change was persisted before it was acknowledged, so there is nothing to flush.
async fn tick_loop(
    shared: Arc<Shared>,
    peering: Option<(String, Vec<String>)>,
    http: reqwest::Client,
    mut finish: oneshot::Receiver<()>,
    follower: Option<tokio::task::JoinHandle<()>>,
    // Held until the loop ends: the state directory is this controller's until then.
    _state_lock: std::fs::File,
) {
    let mut iv = tokio::time::interval(shared.tick);
    iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let insecure_reminder = LogGate::new(Duration::from_secs(60));
    loop {
        tokio::select! {
            _ = iv.tick() => {}
            _ = &mut finish => {
                if let Some(f) = &follower {
                    f.abort();
                }
                let e = shared.engine.lock().expect("engine lock");
                tracing::info!(state_dir = %shared.state_dir.display(), version = %e.base_config().version,
                    overrides = e.overrides().len(), "controller stopped; config and overrides are persisted");
                return;
            }
        }
        if shared.allow_anonymous_reports && insecure_reminder.open() {
            tracing::warn!("INSECURE: anonymous zone reports are accepted (--insecure-allow-anonymous-reports)");
        }
        let now = unix_now();
        let (expired, remaining, regional) = {
            let mut e = shared.engine.lock().expect("engine lock");
            let gone = e.purge_expired(now);
            let remaining = (!gone.is_empty()).then(|| e.overrides().to_vec());
            e.recompute(shared.now_ms(), now);
            e.record_reports(now);
            e.evaluate_candidates(shared.now_ms(), unix_now_ms());
            let regional = peering
                .as_ref()
                .map(|(region, _)| e.regional_report(region));
            (gone, remaining, regional)
        };
        // The call counts need no engine: reports are not held behind their tick.
        shared.calls.lock().expect("calls lock").tick();
        if let (Some(report), Some((_, peers))) = (regional, &peering) {
            // Fire and forget: a slow or dead peer must not hold this region's tick.
            for p in peers {
                let (http, url, report) =
                    (http.clone(), format!("{p}/v1/aggregate"), report.clone());
                let token = shared.report_token.as_ref().map(|t| t.current());
                let timeout = shared.tick.max(Duration::from_millis(200));
                tokio::spawn(async move {
                    let mut req = http.post(&url).json(&report);
                    if let Some(t) = token.filter(|t| !t.is_empty()) {
                        req = req.bearer_auth(t);
                    }
                    if let Err(e) = req.send().await.and_then(|r| r.error_for_status()) {
                        let cause = grl_client::cause::describe(&e, timeout);
                        tracing::debug!(peer = %url, error = %cause, "peer controller unreachable");
                    }
                });
            }
        }
        for o in &expired {
            tracing::info!(id = %o.id, who = %o.req.who, reason = %o.req.reason, "override expired");
        }
        // With a state database, every replica expires by the clock and the follower deletes
        // the rows; the state directory is rewritten here.
        if let (Some(remaining), None) = (remaining, &shared.db) {
            let p = shared.persisted.lock().expect("persisted lock");
            if let Err(e) = shared.save_overrides(p.next_id, &remaining) {
                tracing::error!(error = %e, "cannot persist overrides after expiry");
            }
            shared.audit(&expired.iter().map(Event::expired).collect::<Vec<_>>());
        }
        shared
            .last_tick_ms
            .store(shared.now_ms(), std::sync::atomic::Ordering::Relaxed);
    }
}

/// Unix milliseconds now.
fn unix_now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod replica_tests {
    use super::*;
    use serde_json::{json, Value};

    const TOKEN: &str = "t0ken";

    async fn replica(url: &str, dir: &Path, name: &str) -> ControllerHandle {
        Controller::start(ControllerOptions {
            state_dir: dir.join(name),
            token: TOKEN.into(),
            allow_anonymous_reports: true,
            tick: Duration::from_millis(100),
            database: Some(DatabaseOptions {
                // A poll far beyond the test: what reaches the other replica within it came
                // by notification.
                poll: Duration::from_secs(600),
                ..DatabaseOptions::new(url)
            }),
            ..Default::default()
        })
        .await
        .unwrap()
    }

    fn config(version: &str) -> Value {
        json!({"version": version, "services": [{"service": "payments", "buckets": [
            {"name": "gw.charge", "caller": "gw", "procedure": "charge", "scope": "global",
             "limit_rps": 100.0, "mode": "enforce", "policy": "peak"}]}]})
    }

    /// Polls `f` every 50 ms until it holds; panics after 10 s (a hang guard).
    async fn until<F, Fut>(what: &str, mut f: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        for _ in 0..200 {
            if f().await {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("timed out waiting for: {what}");
    }

    async fn get(http: &reqwest::Client, url: String) -> Value {
        http.get(url).send().await.unwrap().json().await.unwrap()
    }

    /// A change whose notification never came (written here without `pg_notify`) is picked
    /// up by the periodic poll.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_change_without_notification_arrives_by_the_poll() {
        let db = test_support::postgres::fresh_database().await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let c = Controller::start(ControllerOptions {
            state_dir: dir.path().join("c"),
            token: TOKEN.into(),
            allow_anonymous_reports: true,
            tick: Duration::from_millis(100),
            database: Some(DatabaseOptions {
                poll: Duration::from_millis(200),
                ..DatabaseOptions::new(&db.url)
            }),
            ..Default::default()
        })
        .await
        .unwrap();
        let url = c.url();
        let state = crate::state_db::StateDb::connect(&db.url).await.unwrap();
        let doc: ConfigDoc = serde_json::from_value(config("quiet")).unwrap();
        let mut tx = state.pool().begin().await.unwrap();
        sqlx::query(
            "INSERT INTO configs (rev, version, doc, credential) VALUES (1, 'quiet', $1, 'test')",
        )
        .bind(serde_json::to_string(&doc).unwrap())
        .execute(&mut *tx)
        .await
        .unwrap();
        sqlx::query("UPDATE state SET rev = 1, config_rev = 1 WHERE id = 1")
            .execute(&mut *tx)
            .await
            .unwrap();
        tx.commit().await.unwrap();
        let http = reqwest::Client::new();
        until("the poll applies the quiet change", || {
            let (http, url) = (http.clone(), url.clone());
            async move { get(&http, format!("{url}/v1/config")).await["version"] == "quiet" }
        })
        .await;
        c.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn replicas_share_changes_and_refuse_them_when_the_database_is_gone() {
        let db = test_support::postgres::fresh_database().await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let a = replica(&db.url, dir.path(), "a").await;
        let b = replica(&db.url, dir.path(), "b").await;
        let (ua, ub) = (a.url(), b.url());
        let http = reqwest::Client::new();

        // A push to a reaches b by notification.
        let r = http
            .put(format!("{ua}/v1/config"))
            .bearer_auth(TOKEN)
            .json(&config("v1"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        until("b serves v1", || {
            let (http, ub) = (http.clone(), ub.clone());
            async move { get(&http, format!("{ub}/v1/config")).await["version"] == "v1" }
        })
        .await;

        // Overrides added on both replicas at once: every one accepted, ids unique, and both
        // replicas end with the same list.
        let adds = (0..6).map(|i| {
            let (http, url) = (http.clone(), if i % 2 == 0 { ua.clone() } else { ub.clone() });
            tokio::spawn(async move {
                http.post(format!("{url}/v1/overrides"))
                    .bearer_auth(TOKEN)
                    .json(&json!({"service": "payments", "bucket": "gw.charge",
                        "limit_rps": 50.0 + i as f64, "ttl_secs": 600, "reason": "INC", "who": "x"}))
                    .send()
                    .await
                    .unwrap()
            })
        });
        let mut ids = std::collections::BTreeSet::new();
        for add in adds {
            let r = add.await.unwrap();
            assert_eq!(r.status(), 201);
            let v: Value = r.json().await.unwrap();
            assert!(ids.insert(v["id"].as_str().unwrap().to_string()), "{v}");
        }
        let listed = |url: String| {
            let http = http.clone();
            async move {
                get(&http, format!("{url}/v1/overrides")).await["overrides"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|o| o["id"].as_str().unwrap().to_string())
                    .collect::<std::collections::BTreeSet<_>>()
            }
        };
        until("both replicas list the six overrides", || {
            let (la, lb, ids) = (listed(ua.clone()), listed(ub.clone()), ids.clone());
            async move { la.await == ids && lb.await == ids }
        })
        .await;
        // Removed on a: gone from b.
        let first = ids.iter().next().unwrap().clone();
        let r = http
            .delete(format!("{ua}/v1/overrides/{first}"))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        until("b no longer lists the removed override", || {
            let lb = listed(ub.clone());
            let first = first.clone();
            async move { !lb.await.contains(&first) }
        })
        .await;
        // One audit log for the replicas: b reads the removal a made, after six creations.
        let h = get(&http, format!("{ub}/v1/overrides/history")).await;
        let actions: Vec<&str> = h["events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["action"].as_str().unwrap())
            .collect();
        assert_eq!(actions[0], "removed", "{h}");
        assert_eq!(h["events"][0]["id"], first.as_str(), "{h}");
        assert_eq!(
            actions.iter().filter(|a| **a == "created").count(),
            6,
            "{h}"
        );

        // The database gone: changes answer 503 and change nothing; the data plane goes on.
        let admin = format!("{}/postgres", db.url.rsplit_once('/').unwrap().0);
        let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&admin)
            .await
            .unwrap();
        sqlx::query(&format!("DROP DATABASE \"{}\" WITH (FORCE)", db.name))
            .execute(&mut conn)
            .await
            .unwrap();
        let r = http
            .put(format!("{ua}/v1/config"))
            .bearer_auth(TOKEN)
            .json(&config("v2"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 503);
        let body: Value = r.json().await.unwrap();
        assert!(
            body["error"]
                .as_str()
                .unwrap()
                .contains("nothing was changed"),
            "{body}"
        );
        let r = http
            .post(format!("{ub}/v1/overrides"))
            .bearer_auth(TOKEN)
            .json(&json!({"caller": "gw", "drop_ratio": 0.5, "ttl_secs": 60, "reason": "r", "who": "x"}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 503);
        assert_eq!(get(&http, format!("{ua}/v1/config")).await["version"], "v1");
        assert_eq!(listed(ub.clone()).await.len(), 5);
        let report = json!({"aggregator_id": "agg", "region": "r1", "zone": "z1", "buckets": [
            {"service": "payments", "bucket": "gw.charge", "offered_rps": 200.0, "admitted_rps": 200.0,
             "dropped_rps": 0.0, "shadow_dropped_rps": 0.0,
             "counts": {"bucket": "gw.charge", "offered": 0, "admitted": 0, "dropped": 0, "shadow_dropped": 0}}]});
        let r = http
            .post(format!("{ub}/v1/aggregate"))
            .json(&report)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let d: Value = r.json().await.unwrap();
        assert_eq!(d["version"], "v1");
        let ratio = d["services"][0]["directives"][0]["ratio"].as_f64().unwrap();
        assert!(ratio > 0.5, "the overrides still apply: {d}");
        let ready = http.get(format!("{ub}/readyz")).send().await.unwrap();
        assert_eq!(ready.status(), 200, "the data plane is still ready");
        let detail = ready.json::<Value>().await.unwrap()["checks"]["database"]["detail"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(detail.contains("changes answer 503"), "{detail}");
        let metrics = http
            .get(format!("{ub}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(
            metrics.contains("grl_controller_state_database_up 0"),
            "{metrics}"
        );
        assert!(
            metrics.contains("grl_controller_state_revision 8"),
            "{metrics}"
        );
        a.shutdown().await;
        b.shutdown().await;
    }
}
