//! The controller: config API, overrides, per-tick drop ratios, reports and metrics.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path as UrlPath, Query, State};
use axum::http::HeaderMap;
use axum::response::IntoResponse;
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};

use crate::config::{self, write_atomic};
use crate::engine::Engine;
use crate::http_util::{check_token, parse_json, unix_now, ApiError};
use crate::overrides::{Override, OverrideRequest};
use crate::proto::{ConfigDoc, ZoneReport};

/// How to start a controller.
#[derive(Debug, Clone)]
pub struct ControllerOptions {
    /// Listen address (port 0 picks a free port).
    pub listen: SocketAddr,
    /// Where the last applied config and the overrides are persisted.
    pub state_dir: PathBuf,
    /// Bearer token for mutating endpoints.
    pub token: String,
    /// Bucket YAML loaded at start when no config has been persisted yet.
    pub config_dir: Option<PathBuf>,
    /// Control-loop period.
    pub tick: Duration,
    /// This controller's region (needed with `peers`).
    pub region: Option<String>,
    /// Controllers of other regions: each tick they get this region's sums of `global`
    /// buckets, so every region computes global ratios over the whole fleet.
    pub peers: Vec<String>,
    /// Shared secret of the zone reports: when set, `POST /v1/aggregate` needs
    /// `Authorization: Bearer <report_token>` (401 otherwise), and this controller sends it to
    /// its peers. Aggregators and peer controllers are configured with the same value.
    pub report_token: Option<String>,
    /// Serve HTTPS with these files (reloaded when they change); None = plain HTTP.
    pub tls: Option<crate::tls::ServerTls>,
    /// How this controller verifies (and identifies itself to) its peers.
    pub client_tls: crate::tls::ClientTls,
}

impl Default for ControllerOptions {
    fn default() -> Self {
        ControllerOptions {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            state_dir: PathBuf::from("grl-state"),
            token: String::new(),
            config_dir: None,
            tick: Duration::from_secs(1),
            region: None,
            peers: Vec::new(),
            report_token: None,
            tls: None,
            client_tls: crate::tls::ClientTls::default(),
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
    engine: Mutex<Engine>,
    persisted: Mutex<Persisted>,
    token: String,
    report_token: Option<String>,
    state_dir: PathBuf,
    started: std::time::Instant,
    tick: Duration,
}

impl Shared {
    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
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

fn load_state(dir: &Path) -> anyhow::Result<(Option<ConfigDoc>, OverridesFile)> {
    use anyhow::Context;
    let cfg_path = dir.join("config.json");
    let cfg = if cfg_path.exists() {
        let bytes =
            std::fs::read(&cfg_path).with_context(|| format!("read {}", cfg_path.display()))?;
        let doc: ConfigDoc = serde_json::from_slice(&bytes)
            .with_context(|| format!("parse {}", cfg_path.display()))?;
        Some(doc)
    } else {
        None
    };
    let ov_path = dir.join("overrides.json");
    let ov = if ov_path.exists() {
        let bytes =
            std::fs::read(&ov_path).with_context(|| format!("read {}", ov_path.display()))?;
        serde_json::from_slice(&bytes).with_context(|| format!("parse {}", ov_path.display()))?
    } else {
        OverridesFile::default()
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
        // Configs and zone reports for tens of thousands of buckets exceed axum's 2 MiB default.
        .layer(axum::extract::DefaultBodyLimit::max(64 << 20))
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
        engine.set_overrides(ov.overrides);
        // Report cursors stay monotonic across restarts (see Engine::set_report_seq_base).
        let start_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        engine.set_report_seq_base(start_ms << 10);
        let shared = Arc::new(Shared {
            engine: Mutex::new(engine),
            persisted: Mutex::new(Persisted {
                next_id: ov.next_id,
            }),
            token: opts.token.clone(),
            report_token: opts.report_token.clone().filter(|t| !t.is_empty()),
            state_dir: opts.state_dir.clone(),
            started: std::time::Instant::now(),
            tick: opts.tick,
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
        let ticker = tokio::spawn(tick_loop(shared, peering, http));
        tracing::info!(%addr, scheme, "controller listening");
        Ok(ControllerHandle {
            addr,
            scheme,
            stop,
            server,
            background: ticker,
        })
    }
}

async fn tick_loop(
    shared: Arc<Shared>,
    peering: Option<(String, Vec<String>)>,
    http: reqwest::Client,
) {
    let mut iv = tokio::time::interval(shared.tick);
    iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        iv.tick().await;
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
        if let (Some(report), Some((_, peers))) = (regional, &peering) {
            // Fire and forget: a slow or dead peer must not hold this region's tick.
            for p in peers {
                let (http, url, report) =
                    (http.clone(), format!("{p}/v1/aggregate"), report.clone());
                let token = shared.report_token.clone();
                tokio::spawn(async move {
                    let mut req = http.post(&url).json(&report);
                    if let Some(t) = &token {
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
    }
}

async fn get_config(State(s): State<Arc<Shared>>) -> Json<ConfigDoc> {
    Json(s.engine.lock().expect("engine lock").config().clone())
}

async fn put_config(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    check_token(&headers, &s.token)?;
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
    tracing::info!(from = %e.base_config().version, to = %doc.version, buckets, "config applied");
    let version = doc.version.clone();
    e.set_config(doc);
    e.recompute(s.now_ms(), unix_now());
    Ok(Json(
        serde_json::json!({"version": version, "changed": true}),
    ))
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

async fn reports(
    State(s): State<Arc<Shared>>,
    Query(q): Query<ReportsQuery>,
) -> Json<serde_json::Value> {
    let e = s.engine.lock().expect("engine lock");
    Json(serde_json::to_value(e.reports_after(q.after, q.limit.min(10_000))).unwrap_or_default())
}

async fn aggregate(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    // Checked before parsing: an unauthenticated report changes nothing.
    if let Some(t) = &s.report_token {
        check_token(&headers, t)?;
    }
    let r: ZoneReport = parse_json(&body)?;
    if r.zone.is_empty() || r.region.is_empty() {
        return Err(ApiError::Invalid(
            "zone and region must not be empty".into(),
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
            return Err(ApiError::Invalid(format!(
                "bucket `{}`: rates must be finite and not negative",
                b.bucket
            )));
        }
    }
    let mut e = s.engine.lock().expect("engine lock");
    e.ingest(&r, s.now_ms());
    // Answer with ratios that already include this report: a zone's fresh counts reach its
    // clients in the same round trip instead of waiting for the next tick.
    e.recompute(s.now_ms(), unix_now());
    Ok(Json(e.directives_for(&r.region, &r.zone)))
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

async fn add_override(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    check_token(&headers, &s.token)?;
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
        expires_at: now + req.ttl_secs,
        req,
    };
    let mut list = e.overrides().to_vec();
    list.push(o.clone());
    e.try_set_overrides(list, |l| s.save_overrides(next_id, l))
        .map_err(|err| ApiError::Invalid(format!("the override cannot be served: {err}")))??;
    p.next_id = next_id;
    tracing::info!(id = %o.id, who = %o.req.who, reason = %o.req.reason, service = ?o.req.service,
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
    check_token(&headers, &s.token)?;
    let p = s.persisted.lock().expect("persisted lock");
    let mut e = s.engine.lock().expect("engine lock");
    let mut list = e.overrides().to_vec();
    let Some(pos) = list.iter().position(|o| o.id == id) else {
        return Err(ApiError::NotFound(format!("no override `{id}`")));
    };
    let o = list.remove(pos);
    s.save_overrides(p.next_id, &list)?;
    tracing::info!(id = %o.id, removed_by = q.who.as_deref().unwrap_or("unknown"), why = q.reason.as_deref().unwrap_or(""),
        added_by = %o.req.who, "override removed");
    e.set_overrides(list);
    e.recompute(s.now_ms(), unix_now());
    Ok(Json(o))
}

fn esc(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

async fn metrics(State(s): State<Arc<Shared>>) -> impl IntoResponse {
    let e = s.engine.lock().expect("engine lock");
    let mut out = String::new();
    let names = [
        (
            "grl_requests_offered_total",
            "Requests offered to a bucket (before dropping).",
        ),
        (
            "grl_requests_admitted_total",
            "Requests admitted (shadow drops included).",
        ),
        (
            "grl_requests_dropped_total",
            "Requests dropped in enforce mode.",
        ),
        (
            "grl_requests_shadow_dropped_total",
            "Requests that shadow mode would have dropped.",
        ),
    ];
    let label = |b: &crate::engine::BucketState, zone: &str| -> String {
        format!(
            "service=\"{}\",bucket=\"{}\",caller=\"{}\",procedure=\"{}\",mode=\"{}\",zone=\"{}\"",
            esc(&b.service),
            esc(&b.bucket.name),
            esc(b.bucket.caller.as_deref().unwrap_or("")),
            esc(b.bucket.procedure.as_deref().unwrap_or("")),
            b.bucket.mode.as_str(),
            esc(zone)
        )
    };
    for (i, (name, help)) in names.iter().enumerate() {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
        for (b, zone, t) in e.totals() {
            let _ = writeln!(out, "{name}{{{}}} {}", label(b, zone), t[i]);
        }
    }
    let _ = writeln!(
        out,
        "# HELP grl_drop_ratio Drop ratio in force per bucket and scope key.\n# TYPE grl_drop_ratio gauge"
    );
    for b in e.buckets() {
        for k in &b.keys {
            let zone = k.scope_key.strip_prefix("zone:").unwrap_or("");
            let _ = writeln!(
                out,
                "grl_drop_ratio{{{},scope_key=\"{}\"}} {}",
                label(b, zone),
                esc(&k.scope_key),
                k.ratio
            );
        }
    }
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        out,
    )
}
