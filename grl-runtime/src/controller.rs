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

use crate::auth::{Credential, CredentialSet, LogGate, RefusalCounts, TokenSource};
use crate::config::{self, write_atomic};
use crate::engine::Engine;
use crate::http_util::{parse_json, read_body, unix_now, ApiError};
use crate::overrides::{Override, OverrideRequest};
use crate::proto::{ConfigDoc, ZoneReport};

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
    /// credentials file re-read when it changes (see [`crate::auth`]).
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
    pub tls: Option<crate::tls::ServerTls>,
    /// How this controller verifies (and identifies itself to) its peers.
    pub client_tls: crate::tls::ClientTls,
    /// `grl_calls_total`: labelled callers per service (the top ones by recent volume; the
    /// rest fold into `caller="_other"`).
    pub max_callers_per_service: usize,
    /// `grl_calls_total`: labelled procedures per service (the first seen; the rest fold
    /// into `procedure="_other"`).
    pub max_procedures_per_service: usize,
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
            client_tls: crate::tls::ClientTls::default(),
            max_callers_per_service: crate::calls::DEFAULT_MAX_CALLERS,
            max_procedures_per_service: crate::calls::DEFAULT_MAX_PROCEDURES,
        }
    }
}

/// A running controller.
pub type ControllerHandle = crate::http_util::ServerHandle;

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
    calls: Arc<Mutex<crate::calls::CallStats>>,
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
        let f = OverridesFile {
            next_id,
            overrides: overrides.to_vec(),
        };
        let bytes = serde_json::to_vec_pretty(&f).map_err(|e| ApiError::Internal(e.to_string()))?;
        write_atomic(&self.state_dir.join("overrides.json"), &bytes)
            .map_err(|e| ApiError::Internal(format!("write overrides: {e}")))
    }
}

/// Reads and checks the persisted state of `dir`. The config must pass exactly the checks of
/// `PUT /v1/config` and every override those of `POST /v1/overrides` (its request, a unique id
/// below the id counter, an expiry after its creation); a state that does not is refused with
/// the file and the problem, never served: a controller that silently enforced nothing would
/// be worse than one that does not start. (A bucket override whose bucket a later config
/// removed is kept, as it is while running: it acts on nothing.) Only regular files of at most
/// [`config::MAX_STATE_FILE`] bytes are read.
fn load_state(dir: &Path) -> anyhow::Result<(Option<ConfigDoc>, OverridesFile)> {
    let read = |name: &str| -> anyhow::Result<Option<(PathBuf, Vec<u8>)>> {
        let path = dir.join(name);
        match config::read_state_file(&path, config::MAX_STATE_FILE) {
            Ok(b) => Ok(b.map(|b| (path, b))),
            Err(e) => anyhow::bail!("refusing to start: state file {e}"),
        }
    };
    let refuse = |path: &Path, problem: String| {
        anyhow::anyhow!(
            "refusing to start: state file {}: {problem} (fix or remove the file; the controller does not serve a state it would refuse over its API)",
            path.display()
        )
    };
    let cfg = match read("config.json")? {
        Some((path, bytes)) => {
            let doc: ConfigDoc =
                serde_json::from_slice(&bytes).map_err(|e| refuse(&path, e.to_string()))?;
            config::validate(&doc).map_err(|e| refuse(&path, e.to_string()))?;
            Some(doc)
        }
        None => None,
    };
    let ov = match read("overrides.json")? {
        Some((path, bytes)) => {
            let ov: OverridesFile =
                serde_json::from_slice(&bytes).map_err(|e| refuse(&path, e.to_string()))?;
            let mut ids = std::collections::BTreeSet::new();
            for o in &ov.overrides {
                let bad = |p: String| refuse(&path, format!("override `{}`: {p}", o.id));
                o.req.validate().map_err(|e| bad(e.to_string()))?;
                if !ids.insert(o.id.as_str()) {
                    return Err(bad("id appears twice".into()));
                }
                match o
                    .id
                    .strip_prefix("ovr-")
                    .and_then(|n| n.parse::<u64>().ok())
                {
                    Some(n) if n <= ov.next_id => {}
                    _ => {
                        return Err(bad(format!(
                            "id must be `ovr-N` with N at most next_id ({})",
                            ov.next_id
                        )))
                    }
                }
                if o.expires_at <= o.created_at {
                    return Err(bad("expires_at must be after created_at".into()));
                }
            }
            ov
        }
        None => OverridesFile::default(),
    };
    Ok((cfg, ov))
}

/// The controller as a router (for tests without sockets and for `start`).
fn app(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/v1/config", get(get_config).put(put_config))
        .route("/v1/status", get(status))
        .route("/v1/reports", get(reports))
        .route("/v1/aggregate", post(aggregate))
        .route("/v1/overrides", get(list_overrides).post(add_override))
        .route("/v1/overrides/{id}", delete(remove_override))
        .route("/metrics", get(metrics))
        .route("/healthz", get(crate::http_util::healthz))
        .route("/readyz", get(readyz))
        .with_state(shared)
}

/// The controller.
pub struct Controller;

impl Controller {
    /// Loads persisted state (or `config_dir`), binds, and starts serving and ticking.
    pub async fn start(opts: ControllerOptions) -> anyhow::Result<ControllerHandle> {
        use anyhow::Context;
        std::fs::create_dir_all(&opts.state_dir)
            .with_context(|| format!("create state dir {}", opts.state_dir.display()))?;
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
        let (persisted_cfg, ov) = load_state(&opts.state_dir)?;
        // A config dir given is checked even when persisted state wins: a controller never
        // starts on what `rlc validate` rejects.
        let from_dir = match &opts.config_dir {
            Some(dir) => Some(config::load_dir(dir).with_context(|| {
                format!("refusing to start: bucket files in {}", dir.display())
            })?),
            None => None,
        };
        let cfg = match (persisted_cfg, from_dir) {
            (Some(c), _) => c,
            (None, Some(doc)) => {
                let bytes = serde_json::to_vec_pretty(&doc)?;
                write_atomic(&opts.state_dir.join("config.json"), &bytes)?;
                doc
            }
            (None, None) => ConfigDoc::default(),
        };
        tracing::info!(version = %cfg.version, services = cfg.services.len(), overrides = ov.overrides.len(), "controller state loaded");
        let zone_ttl = (opts.tick * 3).as_millis() as u64;
        let mut engine = Engine::new(cfg, zone_ttl);
        // The same check as a new override gets: the config the overrides make clients run
        // must compile.
        if ov.overrides.is_empty() {
            // Nothing to check (a fresh controller has no config version yet).
        } else if let Err(e) = engine.try_set_overrides(ov.overrides, |_| Ok::<(), ()>(())) {
            anyhow::bail!(
                "refusing to start: state file {}: the overrides cannot be served: {e}",
                opts.state_dir.join("overrides.json").display()
            );
        }
        // Report cursors stay monotonic across restarts (see Engine::set_report_seq_base).
        let start_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        engine.set_report_seq_base(start_ms << 10);
        let engine = Arc::new(Mutex::new(engine));
        let refused = RefusalCounts::default();
        let mut registry = prometheus_client::registry::Registry::default();
        crate::metrics::register_build_info(&mut registry, "grl", "controller");
        refused.register(&mut registry);
        registry.register_collector(Box::new(crate::metrics::EngineCollector::new(
            engine.clone(),
        )));
        let calls = Arc::new(Mutex::new(crate::calls::CallStats::new(
            opts.max_callers_per_service,
            opts.max_procedures_per_service,
        )));
        registry.register_collector(Box::new(crate::calls::CallsCollector(calls.clone())));
        let shared = Arc::new(Shared {
            engine,
            calls,
            registry,
            persisted: Mutex::new(Persisted {
                next_id: ov.next_id,
            }),
            creds,
            report_token: opts.report_token.clone(),
            allow_anonymous_reports: opts.allow_anonymous_reports,
            refused,
            refused_log: LogGate::new(Duration::from_secs(10)),
            state_dir: opts.state_dir.clone(),
            started: std::time::Instant::now(),
            tick: opts.tick,
            last_tick_ms: std::sync::atomic::AtomicU64::new(u64::MAX),
        });
        // TLS files and the peer client are checked before binding: a controller does not
        // start on files that do not load.
        let tls = opts
            .tls
            .as_ref()
            .map(crate::tls::ReloadingServerConfig::load)
            .transpose()?;
        let http = opts
            .client_tls
            .http_client(opts.tick.max(Duration::from_millis(200)))
            .context("peer controller client")?;
        crate::tls::warn_plain_http("peer controller URL", opts.peers.iter().map(String::as_str));
        let scheme = if tls.is_some() { "https" } else { "http" };
        let listener = tokio::net::TcpListener::bind(opts.listen)
            .await
            .with_context(|| format!("bind {}", opts.listen))?;
        let addr = listener.local_addr()?;
        let (stop, server) =
            crate::http_util::spawn_server(listener, app(shared.clone()), tls, "controller");
        let peering = match (&opts.region, opts.peers.is_empty()) {
            (_, true) => None,
            (Some(r), false) => Some((r.clone(), opts.peers.clone())),
            (None, false) => anyhow::bail!("peers need this controller's region"),
        };
        let (finish, finished) = oneshot::channel::<()>();
        let ticker = tokio::spawn(tick_loop(shared, peering, http, finished));
        tracing::info!(%addr, scheme, "controller listening");
        Ok(ControllerHandle {
            addr,
            scheme,
            stop,
            server,
            finish,
            background: ticker,
        })
    }
}

/// Ticks until `finish` fires (or its sender is dropped), then logs the state it leaves on
/// disk: every change was persisted before it was acknowledged, so there is nothing to flush.
async fn tick_loop(
    shared: Arc<Shared>,
    peering: Option<(String, Vec<String>)>,
    http: reqwest::Client,
    mut finish: oneshot::Receiver<()>,
) {
    let mut iv = tokio::time::interval(shared.tick);
    iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let insecure_reminder = LogGate::new(Duration::from_secs(60));
    loop {
        tokio::select! {
            _ = iv.tick() => {}
            _ = &mut finish => {
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
                tokio::spawn(async move {
                    let mut req = http.post(&url).json(&report);
                    if let Some(t) = token.filter(|t| !t.is_empty()) {
                        req = req.bearer_auth(t);
                    }
                    if let Err(e) = req.send().await.and_then(|r| r.error_for_status()) {
                        tracing::debug!(peer = %url, error = %e, "peer controller unreachable");
                    }
                });
            }
        }
        if let Some(remaining) = remaining {
            let p = shared.persisted.lock().expect("persisted lock");
            for o in &expired {
                tracing::info!(id = %o.id, who = %o.req.who, reason = %o.req.reason, "override expired");
            }
            if let Err(e) = shared.save_overrides(p.next_id, &remaining) {
                tracing::error!(error = %e, "cannot persist overrides after expiry");
            }
        }
        shared
            .last_tick_ms
            .store(shared.now_ms(), std::sync::atomic::Ordering::Relaxed);
    }
}

async fn get_config(State(s): State<Arc<Shared>>) -> Json<ConfigDoc> {
    Json(s.engine.lock().expect("engine lock").config().clone())
}

/// `PUT /v1/config`: role `config` (rlc's credential).
async fn put_config(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Body,
) -> Result<impl IntoResponse, ApiError> {
    let cred = s.authorize(&headers, "config", "PUT /v1/config")?;
    let body = read_body(body, MAX_BODY).await?;
    let doc: ConfigDoc = parse_json(&body)?;
    config::validate(&doc).map_err(|e| ApiError::Invalid(e.to_string()))?;
    // Hold the engine lock across the write so that two pushes cannot interleave their
    // persist and apply.
    let mut e = s.engine.lock().expect("engine lock");
    if e.base_config().version == doc.version {
        return Ok(Json(
            serde_json::json!({"version": doc.version, "changed": false}),
        ));
    }
    let bytes = serde_json::to_vec_pretty(&doc).map_err(|e| ApiError::Internal(e.to_string()))?;
    write_atomic(&s.state_dir.join("config.json"), &bytes)
        .map_err(|e| ApiError::Internal(format!("persist config: {e}")))?;
    let buckets: usize = doc.services.iter().map(|f| f.buckets.len()).sum();
    tracing::info!(from = %e.base_config().version, to = %doc.version, buckets, credential = %cred.name, "config applied");
    let version = doc.version.clone();
    e.set_config(doc);
    e.recompute(s.now_ms(), unix_now());
    Ok(Json(
        serde_json::json!({"version": version, "changed": true}),
    ))
}

/// `GET /readyz`: the persisted state loaded and its directory present, the control loop
/// ticking (a tick within 3 periods, at least 2 s); 503 with the reason otherwise. A
/// controller without a pushed config is ready (rlc pushes to it).
async fn readyz(State(s): State<Arc<Shared>>) -> crate::http_util::Readiness {
    let version = s
        .engine
        .lock()
        .expect("engine lock")
        .base_config()
        .version
        .clone();
    let state_dir = if s.state_dir.is_dir() {
        Ok(s.state_dir.display().to_string())
    } else {
        Err(format!("{} is not a directory", s.state_dir.display()))
    };
    let last = s.last_tick_ms.load(std::sync::atomic::Ordering::Relaxed);
    let bound = (s.tick * 3).max(Duration::from_secs(2)).as_millis() as u64;
    let ticking = if last == u64::MAX {
        Err("no tick yet".to_string())
    } else {
        let age = s.now_ms().saturating_sub(last);
        if age <= bound {
            Ok(format!("last tick {age} ms ago"))
        } else {
            Err(format!("last tick {age} ms ago (more than {bound} ms)"))
        }
    };
    let config = Ok(if version.is_empty() {
        "no config pushed yet".to_string()
    } else {
        format!("config version {version}")
    });
    crate::http_util::Readiness::from_checks([
        ("config", config),
        ("state_dir", state_dir),
        ("ticking", ticking),
    ])
}

async fn status(State(s): State<Arc<Shared>>) -> Json<serde_json::Value> {
    let e = s.engine.lock().expect("engine lock");
    Json(serde_json::json!({
        // The pushed version (what rlc reconciles against); clients run `served_version`,
        // which differs while traffic overrides add buckets.
        "version": e.base_config().version,
        "served_version": e.config().version,
        "buckets": e.bucket_count(),
        "services": e.config().services.len(),
        "overrides": e.overrides().len(),
        "tick_ms": s.tick.as_millis() as u64,
    }))
}

#[derive(Deserialize)]
struct ReportsQuery {
    #[serde(default)]
    after: u64,
    #[serde(default = "default_limit")]
    limit: usize,
}

fn default_limit() -> usize {
    1000
}

/// `GET /v1/reports`: role `reports` (rlc's credential, or a read-only one).
async fn reports(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    Query(q): Query<ReportsQuery>,
) -> Result<Json<serde_json::Value>, ApiError> {
    s.authorize(&headers, "reports", "GET /v1/reports")?;
    let e = s.engine.lock().expect("engine lock");
    Ok(Json(
        serde_json::to_value(e.reports_after(q.after, q.limit.min(10_000))).unwrap_or_default(),
    ))
}

/// `POST /v1/aggregate`: role `zone-report` (aggregators, peer controllers).
async fn aggregate(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Body,
) -> Result<impl IntoResponse, ApiError> {
    // Checked from the headers before the body is read: an unauthenticated report changes
    // nothing and costs no memory.
    let anonymous =
        s.allow_anonymous_reports && headers.get(axum::http::header::AUTHORIZATION).is_none();
    if !anonymous {
        match s.creds.authenticate(&headers) {
            Ok(c) if c.covers("zone-report") => {}
            Ok(c) => {
                let e = ApiError::Forbidden(format!(
                    "credential `{}` does not hold the `zone-report` role",
                    c.name
                ));
                return Err(s.refuse_report("forbidden", e));
            }
            Err(r) => return Err(s.refuse_report(r.reason(), ApiError::Unauthorized)),
        }
    }
    let body = match read_body(body, MAX_BODY).await {
        Ok(b) => b,
        Err(e @ ApiError::TooLarge(_)) => return Err(s.refuse_report("too_large", e)),
        Err(e) => return Err(s.refuse_report("malformed", e)),
    };
    let r: ZoneReport = parse_json(&body).map_err(|e| s.refuse_report("malformed", e))?;
    if r.zone.is_empty() || r.region.is_empty() {
        return Err(s.refuse_report(
            "invalid",
            ApiError::Invalid("zone and region must not be empty".into()),
        ));
    }
    for b in &r.buckets {
        let rates = [
            b.offered_rps,
            b.admitted_rps,
            b.dropped_rps,
            b.shadow_dropped_rps,
        ];
        if rates.iter().any(|x| !x.is_finite() || *x < 0.0) {
            return Err(s.refuse_report(
                "invalid",
                ApiError::Invalid(format!(
                    "bucket `{}`: rates must be finite and not negative",
                    b.bucket
                )),
            ));
        }
    }
    if !r.calls.is_empty() {
        let mut c = s.calls.lock().expect("calls lock");
        for m in &r.calls {
            c.add(&m.service, &m.caller, &m.procedure, m.count);
        }
    }
    let mut e = s.engine.lock().expect("engine lock");
    // The reply's ratios already include this report: a zone's fresh counts reach its
    // clients in the same round trip instead of waiting for the next tick.
    let reply = e.answer(&r, s.now_ms(), unix_now());
    drop(e);
    Ok((
        [(
            crate::proto::PROTO_HEADER,
            crate::proto::PROTO_VERSION.to_string(),
        )],
        Json(reply),
    ))
}

/// An override with the served buckets it acts on (`affects`, empty for a bucket override).
fn with_affects(o: &Override, e: &Engine) -> serde_json::Value {
    let mut v = serde_json::to_value(o).unwrap_or_default();
    v["affects"] = serde_json::to_value(e.affected(&o.id)).unwrap_or_default();
    v
}

async fn list_overrides(State(s): State<Arc<Shared>>) -> Json<serde_json::Value> {
    let e = s.engine.lock().expect("engine lock");
    let now = unix_now();
    let list: Vec<serde_json::Value> = e
        .overrides()
        .iter()
        .filter(|o| o.active(now))
        .map(|o| with_affects(o, &e))
        .collect();
    Json(serde_json::json!({ "overrides": list }))
}

/// `POST /v1/overrides`: role `overrides` (on-call people); the credential's name is recorded.
async fn add_override(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Body,
) -> Result<impl IntoResponse, ApiError> {
    let cred = s.authorize(&headers, "overrides", "POST /v1/overrides")?;
    let body = read_body(body, MAX_OVERRIDE_BODY).await?;
    let req: OverrideRequest = parse_json(&body)?;
    req.validate()
        .map_err(|e| ApiError::Invalid(e.to_string()))?;
    if let (Some(svc), Some(b)) = (&req.service, &req.bucket) {
        // A bucket override on a name that does not exist would silently do nothing.
        if s.engine
            .lock()
            .expect("engine lock")
            .scope_of(svc, b)
            .is_none()
        {
            return Err(ApiError::Invalid(format!(
                "service `{svc}` has no bucket `{b}` (to limit traffic without a bucket, target --caller/--procedure)"
            )));
        }
    }
    let now = unix_now();
    let mut p = s.persisted.lock().expect("persisted lock");
    let mut e = s.engine.lock().expect("engine lock");
    let next_id = p.next_id + 1;
    let o = Override {
        id: format!("ovr-{next_id}"),
        created_at: now,
        // Validated above (at most MAX_TTL_SECS); saturating all the same.
        expires_at: now.saturating_add(req.ttl_secs),
        credential: Some(cred.name.clone()),
        req,
    };
    let mut list = e.overrides().to_vec();
    list.push(o.clone());
    e.try_set_overrides(list, |l| s.save_overrides(next_id, l))
        .map_err(|err| ApiError::Invalid(format!("the override cannot be served: {err}")))??;
    p.next_id = next_id;
    tracing::info!(id = %o.id, who = %o.req.who, credential = %cred.name, reason = %o.req.reason, service = ?o.req.service,
        bucket = ?o.req.bucket, caller = ?o.req.caller, procedure = ?o.req.procedure,
        limit_rps = ?o.req.limit_rps, drop_ratio = ?o.req.drop_ratio, ttl_secs = o.req.ttl_secs, "override added");
    e.recompute(s.now_ms(), now);
    let affects = e.affected(&o.id);
    if o.is_traffic() {
        tracing::info!(id = %o.id, buckets = affects.len(), version = %e.config().version, "override materialised");
    }
    Ok((axum::http::StatusCode::CREATED, Json(with_affects(&o, &e))))
}

#[derive(Deserialize)]
struct WhoQuery {
    who: Option<String>,
    reason: Option<String>,
}

async fn remove_override(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    UrlPath(id): UrlPath<String>,
    Query(q): Query<WhoQuery>,
) -> Result<impl IntoResponse, ApiError> {
    let cred = s.authorize(&headers, "overrides", "DELETE /v1/overrides/{id}")?;
    let p = s.persisted.lock().expect("persisted lock");
    let mut e = s.engine.lock().expect("engine lock");
    let mut list = e.overrides().to_vec();
    let Some(pos) = list.iter().position(|o| o.id == id) else {
        return Err(ApiError::NotFound(format!("no override `{id}`")));
    };
    let o = list.remove(pos);
    s.save_overrides(p.next_id, &list)?;
    tracing::info!(id = %o.id, removed_by = q.who.as_deref().unwrap_or("unknown"), credential = %cred.name, why = q.reason.as_deref().unwrap_or(""),
        added_by = %o.req.who, "override removed");
    e.set_overrides(list);
    e.recompute(s.now_ms(), unix_now());
    Ok(Json(o))
}

/// `GET /metrics` (see [`crate::metrics::EngineCollector`] for the per-bucket series).
async fn metrics(State(s): State<Arc<Shared>>) -> impl IntoResponse {
    crate::metrics::response(&s.registry)
}
