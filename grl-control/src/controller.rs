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

/// Takes the state directory's exclusive lock (`controller.lock`, an advisory lock the OS
/// releases with the process) and writes who holds it. Two controllers on one state directory
/// would overwrite each other's config and overrides: the second refuses to start, naming the
/// holder. A lock released by a controller of this process that is still stopping is waited
/// for up to 2 s.
async fn lock_state_dir(dir: &Path) -> anyhow::Result<std::fs::File> {
    use std::io::{Read, Seek, Write};
    let path = dir.join(STATE_LOCK_FILE);
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| anyhow::anyhow!("refusing to start: cannot open {}: {e}", path.display()))?;
    let mut tries = 0;
    loop {
        match f.try_lock() {
            Ok(()) => break,
            Err(std::fs::TryLockError::WouldBlock) if tries < 20 => {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(std::fs::TryLockError::WouldBlock) => {
                let mut holder = String::new();
                let _ = (&f).take(1024).read_to_string(&mut holder);
                let holder = holder.trim();
                anyhow::bail!(
                    "refusing to start: state directory {} is in use by another controller ({}); stop it, or give this one its own --state-dir (replicas share a state through --database-url, not a directory)",
                    dir.display(),
                    if holder.is_empty() { "holder unknown" } else { holder }
                );
            }
            Err(std::fs::TryLockError::Error(e)) => {
                anyhow::bail!("refusing to start: cannot lock {}: {e}", path.display())
            }
        }
    }
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let holder = format!(
        "pid {} on {} since {}",
        std::process::id(),
        host.trim(),
        chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
    );
    f.set_len(0)?;
    f.rewind()?;
    f.write_all(holder.as_bytes())?;
    Ok(f)
}

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
            config::validate_pushed(&doc).map_err(|e| refuse(&path, e.to_string()))?;
            Some(doc)
        }
        None => None,
    };
    let ov = match read("overrides.json")? {
        Some((path, bytes)) => {
            let ov: OverridesFile =
                serde_json::from_slice(&bytes).map_err(|e| refuse(&path, e.to_string()))?;
            check_overrides(&ov).map_err(|p| refuse(&path, p))?;
            ov
        }
        None => OverridesFile::default(),
    };
    Ok((cfg, ov))
}

/// `grl_controller_state_revision` and `grl_controller_state_database_up`, read at scrape time
/// (registered only with a state database).
struct DbCollector(Arc<DbSync>);

impl std::fmt::Debug for DbCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DbCollector")
    }
}

impl prometheus_client::collector::Collector for DbCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> std::fmt::Result {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::gauge::ConstGauge;
        use prometheus_client::metrics::MetricType;
        let (rev, up) = {
            let h = self.0.health.lock().expect("db health lock");
            (h.rev, i64::from(h.error.is_none()))
        };
        let fam = encoder.encode_descriptor(
            "grl_controller_state_revision",
            "Revision of the shared state (config and overrides) this replica applied.",
            None,
            MetricType::Gauge,
        )?;
        ConstGauge::new(rev).encode(fam)?;
        let fam = encoder.encode_descriptor(
            "grl_controller_state_database_up",
            "1 while the last contact with the state database succeeded; 0 while it fails (changes answer 503).",
            None,
            MetricType::Gauge,
        )?;
        ConstGauge::new(up).encode(fam)?;
        Ok(())
    }
}

/// The checks of `POST /v1/overrides` on a stored override list: each request valid, ids
/// unique and `ovr-N` with N at most the id counter, an expiry after the creation.
fn check_overrides(ov: &OverridesFile) -> Result<(), String> {
    let mut ids = std::collections::BTreeSet::new();
    for o in &ov.overrides {
        let bad = |p: String| format!("override `{}`: {p}", o.id);
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
    Ok(())
}

/// A snapshot of the state database checked as the API checks a change (the config as
/// `PUT /v1/config`, the overrides as `POST /v1/overrides`).
fn check_snapshot(snap: &crate::state_db::Snapshot) -> Result<(), String> {
    if let Some(doc) = &snap.config {
        config::validate_pushed(doc).map_err(|e| format!("config `{}`: {e}", doc.version))?;
    }
    check_overrides(&OverridesFile {
        next_id: snap.next_override_id,
        overrides: snap.overrides.clone(),
    })
}

/// Connects to the state database, retrying until `opts.connect_timeout` (a replica started
/// while Postgres restarts waits for it instead of exiting at once).
async fn connect_db(opts: &DatabaseOptions) -> anyhow::Result<crate::state_db::StateDb> {
    let deadline = std::time::Instant::now() + opts.connect_timeout;
    let mut wait = Duration::from_millis(200);
    loop {
        match crate::state_db::StateDb::connect(&opts.url.0).await {
            Ok(db) => return Ok(db),
            Err(e) if std::time::Instant::now() + wait < deadline => {
                tracing::warn!(database = ?opts.url, error = %e, "state database not reachable yet; retrying");
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(5));
            }
            Err(e) => anyhow::bail!(
                "refusing to start: state database {:?}: {e} (gave up after {:?})",
                opts.url,
                opts.connect_timeout
            ),
        }
    }
}

/// Loads what changed in the state database since the applied revision into the engine.
/// True when something was applied. A snapshot that fails the API's checks is not applied
/// (logged; the replica keeps what it has).
async fn catch_up(
    s: &Shared,
    sync: &DbSync,
    applied: &mut Applied,
) -> Result<bool, crate::state_db::DbError> {
    let snap = match sync.db.load_since(applied.rev, applied.config_rev).await {
        Ok(Some(snap)) => snap,
        Ok(None) => {
            sync.ok(applied.rev);
            return Ok(false);
        }
        Err(e) => {
            sync.failed("catch up", &e);
            return Err(e);
        }
    };
    if let Err(p) = check_snapshot(&snap) {
        let e =
            crate::state_db::DbError::Corrupt(format!("revision {}: {p}; not applied", snap.rev));
        sync.failed("catch up", &e);
        return Err(e);
    }
    let now = unix_now();
    let mut e = s.engine.lock().expect("engine lock");
    if let Some(doc) = snap.config {
        tracing::info!(from = %e.base_config().version, to = %doc.version, rev = snap.config_rev, "config applied from the state database");
        e.set_config(doc);
    }
    let list: Vec<Override> = snap
        .overrides
        .into_iter()
        .filter(|o| o.active(now))
        .collect();
    if list != e.overrides() {
        let (before, after) = (e.overrides().len(), list.len());
        if let Err(err) = e.try_set_overrides(list, |_| Ok::<(), ()>(())) {
            let err = crate::state_db::DbError::Corrupt(format!(
                "revision {}: the overrides cannot be served: {err}; not applied",
                snap.rev
            ));
            drop(e);
            sync.failed("catch up", &err);
            return Err(err);
        }
        tracing::info!(
            before,
            after,
            rev = snap.rev,
            "overrides applied from the state database"
        );
    }
    e.recompute(s.now_ms(), now);
    drop(e);
    *applied = Applied {
        rev: snap.rev,
        config_rev: snap.config_rev,
    };
    sync.ok(snap.rev);
    Ok(true)
}

/// Follows the state database: a catch-up on each notification of a change and at every
/// `poll` (the fallback when a notification is lost, or the listening connection is down);
/// expired overrides are deleted at each poll. Runs until aborted.
async fn db_sync_loop(s: Arc<Shared>, sync: Arc<DbSync>, poll: Duration) {
    use sqlx::postgres::PgListener;
    let mut listener: Option<PgListener> = None;
    let mut iv = tokio::time::interval(poll);
    iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        if listener.is_none() {
            match PgListener::connect_with(sync.db.pool()).await {
                Ok(mut l) => match l.listen(crate::state_db::CHANNEL).await {
                    Ok(()) => listener = Some(l),
                    Err(e) => sync.failed("listen", &e.into()),
                },
                Err(e) => sync.failed("listen", &e.into()),
            }
        }
        let polled = tokio::select! {
            n = async {
                match listener.as_mut() {
                    Some(l) => l.try_recv().await,
                    None => std::future::pending().await,
                }
            } => {
                if let Err(e) = n {
                    // Reconnected at the next turn; the poll covers the meantime.
                    sync.failed("listen", &e.into());
                    listener = None;
                }
                false
            }
            _ = iv.tick() => true,
        };
        if polled {
            if let Err(e) = sync.db.purge_expired(unix_now()).await {
                sync.failed("purge expired overrides", &e);
            }
        }
        let mut applied = sync.applied.lock().await;
        let _ = catch_up(&s, &sync, &mut applied).await;
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
        let (cfg, ov, db) = match &opts.database {
            None => {
                let cfg = match (persisted_cfg, from_dir) {
                    (Some(c), _) => c,
                    (None, Some(doc)) => {
                        let bytes = serde_json::to_vec_pretty(&doc)?;
                        write_atomic(&opts.state_dir.join("config.json"), &bytes)?;
                        doc
                    }
                    (None, None) => ConfigDoc::default(),
                };
                (cfg, ov, None)
            }
            Some(dbo) => {
                let db = connect_db(dbo).await?;
                // An empty database takes what this controller had: its state directory's
                // files (a controller given a database for the first time), else its
                // --config-dir. A database that holds a state wins over both.
                let local_cfg = persisted_cfg.or(from_dir);
                if db
                    .import_if_empty(local_cfg.as_ref(), &ov.overrides, ov.next_id)
                    .await
                    .map_err(|e| anyhow::anyhow!("refusing to start: {e}"))?
                {
                    tracing::info!(
                        version = local_cfg.as_ref().map_or("none", |c| c.version.as_str()),
                        overrides = ov.overrides.len(),
                        "empty state database: imported this controller's state"
                    );
                }
                let snap = db
                    .load_since(-1, -1)
                    .await
                    .map_err(|e| anyhow::anyhow!("refusing to start: {e}"))?
                    .context("refusing to start: the state database has no revision")?;
                check_snapshot(&snap).map_err(|p| {
                    anyhow::anyhow!("refusing to start: state database {:?} at revision {}: {p} (the controller does not serve a state it would refuse over its API)", dbo.url, snap.rev)
                })?;
                tracing::info!(database = ?dbo.url, rev = snap.rev, "controller state loaded from the state database");
                let sync = DbSync {
                    db,
                    applied: tokio::sync::Mutex::new(Applied {
                        rev: snap.rev,
                        config_rev: snap.config_rev,
                    }),
                    health: Mutex::new(DbHealth {
                        rev: snap.rev,
                        ok_at: std::time::Instant::now(),
                        error: None,
                    }),
                    errors_log: LogGate::new(Duration::from_secs(10)),
                };
                let now = unix_now();
                let ov = OverridesFile {
                    next_id: snap.next_override_id,
                    overrides: snap
                        .overrides
                        .into_iter()
                        .filter(|o| o.active(now))
                        .collect(),
                };
                (snap.config.unwrap_or_default(), ov, Some(Arc::new(sync)))
            }
        };
        tracing::info!(version = %cfg.version, services = cfg.services.len(), overrides = ov.overrides.len(), "controller state loaded");
        // A zone counts for three of its own forwarding intervals (learnt by the engine from
        // the gaps between its reports), and at least three of this controller's ticks.
        let zone_ttl = (opts.tick * 3).as_millis() as u64;
        let mut engine = Engine::new(cfg, zone_ttl);
        // The same check as a new override gets: the config the overrides make clients run
        // must compile.
        if ov.overrides.is_empty() {
            // Nothing to check (a fresh controller has no config version yet).
        } else if let Err(e) = engine.try_set_overrides(ov.overrides, |_| Ok::<(), ()>(())) {
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
            db: db.clone(),
            max_overrides: opts.max_overrides,
        });
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

#[derive(Deserialize)]
struct ConfigView {
    view: Option<String>,
}

/// `GET /v1/config`: the served config (the pushed one plus the buckets of traffic overrides,
/// what aggregators and clients run); `?view=pushed`: the config as pushed, which
/// `PUT /v1/config` takes back (a served config's `override:` buckets are refused there).
async fn get_config(
    State(s): State<Arc<Shared>>,
    Query(q): Query<ConfigView>,
) -> Result<Json<ConfigDoc>, ApiError> {
    let e = s.engine.lock().expect("engine lock");
    match q.view.as_deref() {
        None | Some("served") => Ok(Json(e.config().clone())),
        Some("pushed") => Ok(Json(e.base_config().clone())),
        Some(v) => Err(ApiError::BadRequest(format!(
            "view `{v}`: expected `served` (the default) or `pushed`"
        ))),
    }
}

/// 422 when `max` overrides are active at `now` (expired ones not purged yet do not count).
fn room_for_one_more(e: &Engine, now: u64, max: usize) -> Result<(), ApiError> {
    let active = e.overrides().iter().filter(|o| o.active(now)).count();
    if active >= max {
        return Err(ApiError::Invalid(format!(
            "{active} overrides are active, the most this controller takes (--max-overrides {max}); remove one (grl override rm ID) or let one expire, and put lasting limits in the bucket files"
        )));
    }
    Ok(())
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
    config::validate_pushed(&doc).map_err(|e| ApiError::Invalid(e.to_string()))?;
    if let Some(sync) = &s.db {
        return put_config_db(&s, sync, doc, &cred.name).await.map(Json);
    }
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

/// `PUT /v1/config` with a state database: written in a transaction (unless its version is
/// the database's current one), then applied here; the other replicas apply it on the
/// notification.
async fn put_config_db(
    s: &Shared,
    sync: &DbSync,
    doc: ConfigDoc,
    credential: &str,
) -> Result<serde_json::Value, ApiError> {
    let mut applied = sync.applied.lock().await;
    let w = sync
        .db
        .put_config(&doc, credential)
        .await
        .map_err(|e| sync.refuse("PUT /v1/config", e))?;
    if !w.changed {
        // Already the current version; this replica may not have applied it yet.
        let _ = catch_up(s, sync, &mut applied).await;
        return Ok(serde_json::json!({"version": doc.version, "changed": false}));
    }
    let version = doc.version.clone();
    let buckets: usize = doc.services.iter().map(|f| f.buckets.len()).sum();
    if w.rev == applied.rev + 1 {
        // Nothing else changed in between: apply what was written.
        let mut e = s.engine.lock().expect("engine lock");
        tracing::info!(from = %e.base_config().version, to = %doc.version, buckets, rev = w.rev, credential, "config applied (state database)");
        e.set_config(doc);
        e.recompute(s.now_ms(), unix_now());
        *applied = Applied {
            rev: w.rev,
            config_rev: w.rev,
        };
        drop(e);
        sync.ok(w.rev);
    } else {
        tracing::info!(to = %doc.version, buckets, rev = w.rev, credential, "config stored (state database); catching up");
        // Committed: when this catch-up fails, the follower applies it at its next turn.
        let _ = catch_up(s, sync, &mut applied).await;
    }
    Ok(serde_json::json!({"version": version, "changed": true}))
}

/// `GET /readyz`: the persisted state loaded and its directory present, the control loop
/// ticking (a tick within 3 periods, at least 2 s); 503 with the reason otherwise. A
/// controller without a pushed config is ready (rlc pushes to it).
async fn readyz(State(s): State<Arc<Shared>>) -> grl_server::http_util::Readiness {
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
    let Some(sync) = &s.db else {
        return grl_server::http_util::Readiness::from_checks([
            ("config", config),
            ("state_dir", state_dir),
            ("ticking", ticking),
        ]);
    };
    // The state was loaded from the database before this answered at all; while the database
    // is unreachable the replica still enforces what it has (data plane fail-open, changes
    // answer 503), so that stays ready and the detail says so.
    let database = Ok(db_detail(sync));
    grl_server::http_util::Readiness::from_checks([
        ("config", config),
        ("database", database),
        ("ticking", ticking),
    ])
}

/// The state database as `/readyz` and `/v1/status` describe it.
fn db_detail(sync: &DbSync) -> String {
    let h = sync.health.lock().expect("db health lock");
    let ago = h.ok_at.elapsed().as_millis();
    match &h.error {
        None => format!("revision {} (in sync {ago} ms ago)", h.rev),
        Some(err) => format!(
            "failing since {ago} ms: {err}; serving revision {}, changes answer 503",
            h.rev
        ),
    }
}

async fn status(State(s): State<Arc<Shared>>) -> Json<serde_json::Value> {
    let state = match &s.db {
        Some(sync) => serde_json::json!({
            "backend": "postgres",
            "revision": sync.health.lock().expect("db health lock").rev,
            "detail": db_detail(sync),
        }),
        None => serde_json::json!({"backend": "state_dir"}),
    };
    let e = s.engine.lock().expect("engine lock");
    Json(serde_json::json!({
        "state": state,
        // The pushed version (what rlc reconciles against); clients run `served_version`,
        // which differs while traffic overrides add buckets.
        "version": e.base_config().version,
        "served_version": e.config().version,
        "buckets": e.bucket_count(),
        "services": e.config().services.len(),
        "overrides": e.overrides().len(),
        "candidates": e.candidates().count(),
        "tick_ms": s.tick.as_millis() as u64,
        "proto": grl_wire::PROTO_VERSION,
    }))
}

/// Unix milliseconds now.
fn unix_now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// `GET /v1/candidates`: role `reports`. Each candidate limit's counts since this controller
/// began evaluating it; `epoch` changes when the controller restarts (its counts start over).
async fn candidates(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
) -> Result<Json<grl_wire::CandidatesReply>, ApiError> {
    s.authorize(&headers, "reports", "GET /v1/candidates")?;
    let e = s.engine.lock().expect("engine lock");
    Ok(Json(grl_wire::CandidatesReply {
        epoch: format!("{:016x}", e.directives_version().0),
        now_ms: unix_now_ms(),
        candidates: e.candidate_reports(),
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
        Err(e @ ApiError::Timeout) => return Err(s.refuse_report("timeout", e)),
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
    let mut e = s.engine.lock().expect("engine lock");
    // The reply's ratios already include this report: a zone's fresh counts reach its
    // clients in the same round trip instead of waiting for the next tick.
    // Serialized under the lock: the directives' bytes are shared between the zones' replies.
    let (reply, ingested) = e.answer_json(&r, s.now_ms(), unix_now());
    drop(e);
    // The calls of a report answered `resync` come again with the full report the
    // aggregator sends at once: they count then, once.
    if !r.calls.is_empty() && ingested == crate::engine::Ingested::Applied {
        let mut c = s.calls.lock().expect("calls lock");
        for m in &r.calls {
            c.add(&m.service, &m.caller, &m.procedure, m.count);
        }
    }
    Ok((
        [
            (grl_wire::PROTO_HEADER, grl_wire::PROTO_VERSION.to_string()),
            (
                axum::http::header::CONTENT_TYPE.as_str(),
                "application/json".to_string(),
            ),
        ],
        reply,
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

#[derive(Deserialize)]
struct HistoryQuery {
    limit: Option<usize>,
}

/// `GET /v1/overrides/history?limit=N`: the overrides' audit log, newest first (100 events
/// unless `limit` says otherwise, at most [`crate::audit::MAX_PAGE`]); readable as
/// `GET /v1/overrides` is.
async fn override_history(
    State(s): State<Arc<Shared>>,
    Query(q): Query<HistoryQuery>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let limit = q.limit.unwrap_or(100).clamp(1, crate::audit::MAX_PAGE);
    let events = match &s.db {
        Some(sync) => sync
            .db
            .history(limit)
            .await
            .map_err(|e| sync.refuse("GET /v1/overrides/history", e))?,
        None => {
            let log = crate::audit::FileLog::in_dir(&s.state_dir);
            tokio::task::spawn_blocking(move || log.read(limit))
                .await
                .map_err(|e| ApiError::Internal(e.to_string()))?
                .map_err(|e| ApiError::Internal(format!("read the overrides' audit log: {e}")))?
        }
    };
    Ok(Json(serde_json::json!({ "events": events })))
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
    if let Some(sync) = &s.db {
        return add_override_db(&s, sync, req, &cred.name)
            .await
            .map(|v| (axum::http::StatusCode::CREATED, Json(v)));
    }
    let now = unix_now();
    let mut p = s.persisted.lock().expect("persisted lock");
    let mut e = s.engine.lock().expect("engine lock");
    room_for_one_more(&e, now, s.max_overrides)?;
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
    s.audit(&[Event::created(&o)]);
    tracing::info!(id = %o.id, who = %o.req.who, credential = %cred.name, reason = %o.req.reason,
        target = %o.req.target(), action = %o.req.action(), ttl_secs = o.req.ttl_secs, "override added");
    e.recompute(s.now_ms(), now);
    let affects = e.affected(&o.id);
    if o.is_traffic() {
        tracing::info!(id = %o.id, buckets = affects.len(), version = %e.config().version, "override materialised");
    }
    Ok((axum::http::StatusCode::CREATED, Json(with_affects(&o, &e))))
}

/// `POST /v1/overrides` with a state database: checked against this replica's state at the
/// database's revision (caught up first when another replica changed it meanwhile; at most
/// three tries), written in a transaction that hands out the id, then applied here.
async fn add_override_db(
    s: &Shared,
    sync: &DbSync,
    req: OverrideRequest,
    credential: &str,
) -> Result<serde_json::Value, ApiError> {
    let mut applied = sync.applied.lock().await;
    for _ in 0..3 {
        let now = unix_now();
        let made = sync
            .db
            .add_override(applied.rev, |next_id| {
                let o = Override {
                    id: format!("ovr-{next_id}"),
                    created_at: now,
                    expires_at: now.saturating_add(req.ttl_secs),
                    credential: Some(credential.to_string()),
                    req: req.clone(),
                };
                let e = s.engine.lock().expect("engine lock");
                room_for_one_more(&e, now, s.max_overrides)?;
                let mut list = e.overrides().to_vec();
                list.push(o.clone());
                e.check_overrides(&list).map(|()| o).map_err(|err| {
                    ApiError::Invalid(format!("the override cannot be served: {err}"))
                })
            })
            .await;
        let (o, rev) = match made {
            Err(crate::state_db::DbError::Stale(_)) => {
                catch_up(s, sync, &mut applied)
                    .await
                    .map_err(|e| sync.refuse("POST /v1/overrides", e))?;
                continue;
            }
            Err(e) => return Err(sync.refuse("POST /v1/overrides", e)),
            Ok(Err(err)) => return Err(err),
            Ok(Ok(made)) => made,
        };
        sync.ok(rev);
        let mut e = s.engine.lock().expect("engine lock");
        let mut list = e.overrides().to_vec();
        list.push(o.clone());
        // Checked against this very state in the transaction.
        if let Err(err) = e.try_set_overrides(list, |_| Ok::<(), ()>(())) {
            tracing::error!(id = %o.id, error = %err, "override stored but not applicable here");
        }
        *applied = Applied {
            rev,
            config_rev: applied.config_rev,
        };
        tracing::info!(id = %o.id, who = %o.req.who, credential, reason = %o.req.reason,
            target = %o.req.target(), action = %o.req.action(), ttl_secs = o.req.ttl_secs, rev, "override added (state database)");
        e.recompute(s.now_ms(), now);
        return Ok(with_affects(&o, &e));
    }
    Err(ApiError::Unavailable(
        "the state kept changing under this override (three tries); nothing was changed, retry"
            .into(),
    ))
}

/// `DELETE /v1/overrides/{id}` with a state database.
async fn remove_override_db(
    s: &Shared,
    sync: &DbSync,
    id: &str,
    q: &WhoQuery,
    credential: &str,
) -> Result<Override, ApiError> {
    let mut applied = sync.applied.lock().await;
    let Some((o, rev)) = sync
        .db
        .remove_override(
            id,
            unix_now(),
            q.who.as_deref().unwrap_or("unknown"),
            q.reason.as_deref().unwrap_or(""),
            credential,
        )
        .await
        .map_err(|e| sync.refuse("DELETE /v1/overrides", e))?
    else {
        return Err(ApiError::NotFound(format!("no override `{id}`")));
    };
    sync.ok(rev);
    tracing::info!(id = %o.id, removed_by = q.who.as_deref().unwrap_or("unknown"), credential, why = q.reason.as_deref().unwrap_or(""),
        added_by = %o.req.who, rev, "override removed (state database)");
    if rev == applied.rev + 1 {
        let mut e = s.engine.lock().expect("engine lock");
        let list = e
            .overrides()
            .iter()
            .filter(|x| x.id != id)
            .cloned()
            .collect();
        e.set_overrides(list);
        e.recompute(s.now_ms(), unix_now());
        applied.rev = rev;
    } else {
        let _ = catch_up(s, sync, &mut applied).await;
    }
    Ok(o)
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
    if let Some(sync) = &s.db {
        return remove_override_db(&s, sync, &id, &q, &cred.name)
            .await
            .map(Json);
    }
    let p = s.persisted.lock().expect("persisted lock");
    let mut e = s.engine.lock().expect("engine lock");
    let mut list = e.overrides().to_vec();
    let Some(pos) = list.iter().position(|o| o.id == id) else {
        return Err(ApiError::NotFound(format!("no override `{id}`")));
    };
    let o = list.remove(pos);
    s.save_overrides(p.next_id, &list)?;
    s.audit(&[Event::removed(
        &o,
        unix_now(),
        q.who.as_deref().unwrap_or("unknown"),
        q.reason.as_deref().unwrap_or(""),
        &cred.name,
    )]);
    tracing::info!(id = %o.id, removed_by = q.who.as_deref().unwrap_or("unknown"), credential = %cred.name, why = q.reason.as_deref().unwrap_or(""),
        added_by = %o.req.who, "override removed");
    e.set_overrides(list);
    e.recompute(s.now_ms(), unix_now());
    Ok(Json(o))
}

/// `GET /metrics` (see [`crate::metrics::EngineCollector`] for the per-bucket series).
async fn metrics(State(s): State<Arc<Shared>>) -> impl IntoResponse {
    grl_server::metrics::response(&s.registry)
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
