//! `rlc serve`: the daemon. A cron schedule, a run as soon as the human-authored
//! `rlc/*.yaml` change on the base branch, and manual runs over HTTP (`POST /v1/runs`); it
//! also keeps the controller on the base branch's version (so a merged PR reaches it), stores
//! the controller's shadow reports, and serves `/healthz` and `/metrics`.
//!
//! Several replicas on one Postgres elect one active scheduler (`pg_try_advisory_lock`);
//! the others serve HTTP and refuse manual runs with 409. With SQLite there is one instance.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use chrono::Utc;
use schema::DaemonConfig;
use serde_json::json;
use tokio::sync::{mpsc, watch};

use crate::cycle::{load_config, Cycle, Planner, RunOutcome};
use crate::push::{ControllerClient, Report};
use crate::store::{Lease, Store};

pub mod dashboard;
pub mod previews;
pub mod problem;

/// Reports fetched per `GET /v1/reports` call.
const REPORT_PAGE: u32 = 500;
/// Store cursor of the controller's report stream.
const REPORT_CURSOR: &str = "controller.reports";

/// `rlc serve`.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// The daemon config (rlc.yaml).
    #[arg(long, default_value = "rlc.yaml")]
    pub config: PathBuf,
    /// Seconds between polls of the config repo, the controller and leadership.
    #[arg(long, default_value_t = 30)]
    pub poll_secs: u64,
    /// Listen address (default: server.listen in rlc.yaml, else 127.0.0.1:8080).
    #[arg(long)]
    pub listen: Option<String>,
    /// Serve HTTPS with this certificate chain (PEM), re-read when it changes (default:
    /// server.tls.cert in rlc.yaml; neither = plain HTTP).
    #[arg(long)]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long)]
    pub tls_key: Option<PathBuf>,
    /// Mutual TLS: require client certificates signed by this CA (PEM).
    #[arg(long)]
    pub tls_client_ca: Option<PathBuf>,
}

pub use schema::parse_schedule;

#[derive(Default)]
struct Metrics {
    runs: Mutex<BTreeMap<&'static str, u64>>,
    last_run_finished: AtomicI64,
    leader: AtomicBool,
    in_sync: AtomicBool,
    push_failures: AtomicU64,
    reports_stored: AtomicU64,
    report_gaps: AtomicU64,
    pending_records: AtomicU64,
}

struct Inner {
    token: Option<String>,
    trigger: mpsc::Sender<String>,
    metrics: Metrics,
    runs_done: watch::Sender<u64>,
    last: Mutex<Option<RunOutcome>>,
    /// Set once the scheduler has connected; the read-only pages answer 503 until then.
    store: RwLock<Option<Store>>,
    /// `POST /v1/previews`; answers 503 until set.
    previews: RwLock<Option<previews::Previews>>,
}

/// Shared state of the HTTP API and the scheduler.
#[derive(Clone)]
pub struct AppState {
    inner: Arc<Inner>,
}

impl AppState {
    /// State with the API `token` (None: every mutating call is refused) and the channel
    /// manual triggers go to.
    pub fn new(token: Option<String>, trigger: mpsc::Sender<String>) -> AppState {
        AppState {
            inner: Arc::new(Inner {
                token,
                trigger,
                metrics: Metrics::default(),
                runs_done: watch::channel(0).0,
                last: Mutex::new(None),
                store: RwLock::new(None),
                previews: RwLock::new(None),
            }),
        }
    }

    /// Read-only state over `store` (dashboard and JSON pages; manual runs are refused): for
    /// tests and for embedding the pages elsewhere.
    pub fn with_store(store: Store) -> AppState {
        let state = AppState::new(None, mpsc::channel(1).0);
        state.set_store(store);
        state
    }

    /// Gives the HTTP pages the store (a pool: cloning it is cheap).
    pub fn set_store(&self, store: Store) {
        *self.inner.store.write().unwrap() = Some(store);
    }

    /// Sets what `POST /v1/previews` computes on.
    pub fn set_previews(&self, p: previews::Previews) {
        *self.inner.previews.write().unwrap() = Some(p);
    }

    /// The store, once connected.
    pub fn store(&self) -> Option<Store> {
        self.inner.store.read().unwrap().clone()
    }

    /// Marks this replica as the active scheduler or not.
    pub fn set_leader(&self, leader: bool) {
        self.inner.metrics.leader.store(leader, Ordering::Relaxed);
    }

    /// Whether this replica is the active scheduler.
    pub fn is_leader(&self) -> bool {
        self.inner.metrics.leader.load(Ordering::Relaxed)
    }

    /// Waits until at least `n` runs have finished since start.
    pub async fn wait_runs(&self, n: u64) -> RunOutcome {
        let mut rx = self.inner.runs_done.subscribe();
        let _ = rx.wait_for(|v| *v >= n).await;
        self.inner
            .last
            .lock()
            .unwrap()
            .clone()
            .expect("a run finished")
    }

    fn finished(&self, out: &RunOutcome) {
        let m = &self.inner.metrics;
        *m.runs
            .lock()
            .unwrap()
            .entry(out.status.as_str())
            .or_default() += 1;
        m.last_run_finished
            .store(out.finished_at.timestamp(), Ordering::Relaxed);
        *self.inner.last.lock().unwrap() = Some(out.clone());
        self.inner.runs_done.send_modify(|v| *v += 1);
    }

    fn authorized(&self, h: &HeaderMap) -> bool {
        // No token configured: every mutating call is refused.
        self.inner
            .token
            .as_deref()
            .is_some_and(|t| grl_runtime::http_util::check_token(h, t).is_ok())
    }
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn metrics(State(s): State<AppState>) -> impl IntoResponse {
    use std::fmt::Write;
    let m = &s.inner.metrics;
    let mut out = String::new();
    out.push_str("# HELP rlc_runs_total Finished runs by status.\n# TYPE rlc_runs_total counter\n");
    for (status, n) in m.runs.lock().unwrap().iter() {
        let _ = writeln!(out, "rlc_runs_total{{status=\"{status}\"}} {n}");
    }
    let gauges = [
        (
            "rlc_last_run_finished_timestamp_seconds",
            "Unix time of the last finished run.",
            m.last_run_finished.load(Ordering::Relaxed) as u64,
        ),
        (
            "rlc_leader",
            "1 when this replica is the active scheduler.",
            m.leader.load(Ordering::Relaxed) as u64,
        ),
        (
            "rlc_controller_in_sync",
            "1 when the controller runs the base branch's version.",
            m.in_sync.load(Ordering::Relaxed) as u64,
        ),
        (
            "rlc_pending_run_records",
            "Run records waiting for the store.",
            m.pending_records.load(Ordering::Relaxed),
        ),
    ];
    for (name, help, v) in gauges {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
    }
    let counters = [
        (
            "rlc_controller_push_failures_total",
            "Failed controller reconcile attempts.",
            m.push_failures.load(Ordering::Relaxed),
        ),
        (
            "rlc_shadow_reports_stored_total",
            "Shadow reports stored.",
            m.reports_stored.load(Ordering::Relaxed),
        ),
        (
            "rlc_shadow_report_gaps_total",
            "Polls that found shadow reports lost at the controller.",
            m.report_gaps.load(Ordering::Relaxed),
        ),
    ];
    for (name, help, v) in counters {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
        );
    }
    ([("content-type", "text/plain; version=0.0.4")], out)
}

async fn trigger_run(
    State(s): State<AppState>,
    h: HeaderMap,
) -> (StatusCode, Json<serde_json::Value>) {
    if !s.authorized(&h) {
        return (
            StatusCode::UNAUTHORIZED,
            Json(json!({"error": "missing or wrong bearer token"})),
        );
    }
    if !s.is_leader() {
        return (
            StatusCode::CONFLICT,
            Json(json!({"error": "this replica is not the active scheduler; ask another replica"})),
        );
    }
    match s.inner.trigger.try_send("api".into()) {
        Ok(()) => (StatusCode::ACCEPTED, Json(json!({"queued": true}))),
        // A run is already queued: it will see the same inputs, so this one coalesces.
        Err(mpsc::error::TrySendError::Full(_)) => (
            StatusCode::ACCEPTED,
            Json(json!({"queued": true, "coalesced": true})),
        ),
        Err(mpsc::error::TrySendError::Closed(_)) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"error": "shutting down"})),
        ),
    }
}

async fn last_run(State(s): State<AppState>) -> (StatusCode, Json<serde_json::Value>) {
    match s.inner.last.lock().unwrap().as_ref() {
        Some(o) => (
            StatusCode::OK,
            Json(serde_json::to_value(o).unwrap_or_default()),
        ),
        None => (StatusCode::NOT_FOUND, Json(json!({"error": "no run yet"}))),
    }
}

async fn post_previews(
    State(s): State<AppState>,
    h: HeaderMap,
    body: axum::body::Body,
) -> axum::response::Response {
    let p = s.inner.previews.read().unwrap().clone();
    match p {
        Some(p) => previews::answer(&p, &h, body).await,
        None => problem::Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "previews are not available yet",
        )
        .into_response(),
    }
}

/// The HTTP API: `/healthz`, `/metrics`, `POST /v1/runs` (token), `GET /v1/runs/last`,
/// `POST /v1/previews` (what-if previews, see [`previews`]) and the read-only shadow-mode
/// dashboard: `GET /` (HTML), `GET /v1/shadow`, `GET /v1/runs` (see [`dashboard`]).
pub fn app(state: AppState) -> Router {
    Router::new()
        .route("/", get(dashboard::page))
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .route("/v1/shadow", get(dashboard::shadow_json))
        .route("/v1/runs", get(dashboard::runs_json).post(trigger_run))
        .route("/v1/runs/last", get(last_run))
        .route("/v1/previews", axum::routing::post(post_previews))
        .with_state(state)
}

/// Daemon settings not in rlc.yaml.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// Between polls of the repo, the controller and leadership.
    pub poll: Duration,
    /// Serve HTTPS with these files (reloaded when they change); None = plain HTTP.
    pub tls: Option<grl_runtime::tls::ServerTls>,
}

/// Resolves when `shutdown` turns true (or its sender is gone).
async fn stopped(mut shutdown: watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|v| *v).await;
}

/// Runs the daemon on `listener` until `shutdown` turns true; the current run finishes
/// first. `state` must be made with the sender of `triggers`.
// Each argument is a separate piece the caller wires (tests inject their own channels).
#[allow(clippy::too_many_arguments)]
pub async fn serve_on(
    listener: tokio::net::TcpListener,
    cfg: DaemonConfig,
    base_dir: &Path,
    planner: Planner,
    opts: ServeOptions,
    state: AppState,
    triggers: mpsc::Receiver<String>,
    shutdown: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let schedule = cfg
        .schedule
        .as_deref()
        .map(parse_schedule)
        .transpose()
        .map_err(anyhow::Error::msg)?;
    let tls = opts
        .tls
        .as_ref()
        .map(grl_runtime::tls::ReloadingServerConfig::load)
        .transpose()?;
    if state.inner.previews.read().unwrap().is_none() {
        // PLACEHOLDER: to be fed by the daemon's snapshot (see previews::from_working_copy).
        state.set_previews(previews::from_working_copy(cfg.clone(), base_dir));
    }
    let cycle = Arc::new(Cycle::new(cfg, base_dir));
    let http =
        grl_runtime::tls::serve(listener, app(state.clone()), tls, stopped(shutdown.clone()));
    let sched = scheduler(cycle, planner, schedule, opts, state, triggers, shutdown);
    let (h, ()) = tokio::join!(http, sched);
    h?;
    Ok(())
}

struct Loop {
    cycle: Arc<Cycle>,
    planner: Planner,
    state: AppState,
    controller: Option<ControllerClient>,
    last_inputs: Option<String>,
    last_pushed: Option<String>,
}

impl Loop {
    async fn run(&mut self, trigger: &str) {
        tracing::info!(trigger, "run starting");
        let out = self.cycle.run(&self.planner, trigger).await;
        if out.version_pushed.is_some() {
            self.last_pushed = out.version_pushed.clone();
            self.state
                .inner
                .metrics
                .in_sync
                .store(true, Ordering::Relaxed);
        }
        self.state
            .inner
            .metrics
            .pending_records
            .store(self.cycle.pending_records().await as u64, Ordering::Relaxed);
        self.state.finished(&out);
    }

    /// Periodic work of the active scheduler: store backlog, input change, controller
    /// version, shadow reports.
    async fn tick(&mut self) {
        self.cycle.flush_pending().await;
        // One fetch per poll; a second only when a run has just moved the base.
        let desired = match self.cycle.poll().await {
            Ok((hash, desired)) => {
                let changed = self.last_inputs.as_ref().is_some_and(|h| *h != hash);
                self.last_inputs = Some(hash);
                if changed {
                    self.run("inputs-changed").await;
                    self.cycle.desired().await
                } else {
                    Ok(desired)
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot sync the config repo");
                Err(e)
            }
        };
        if let Some(client) = self.controller.clone() {
            match desired {
                Ok(desired) if self.last_pushed.as_deref() != Some(desired.version.as_str()) => {
                    match client.reconcile_once(&desired).await {
                        Ok(_) => {
                            self.last_pushed = Some(desired.version.clone());
                            self.state
                                .inner
                                .metrics
                                .in_sync
                                .store(true, Ordering::Relaxed);
                        }
                        Err(e) => {
                            self.state
                                .inner
                                .metrics
                                .in_sync
                                .store(false, Ordering::Relaxed);
                            self.state
                                .inner
                                .metrics
                                .push_failures
                                .fetch_add(1, Ordering::Relaxed);
                            tracing::warn!(version = %desired.version, error = %e, "controller not reconciled; retrying next tick");
                        }
                    }
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "no desired config to reconcile"),
            }
            if let Err(e) = self.poll_reports(&client).await {
                tracing::warn!(error = %e, "cannot poll controller reports");
            }
        }
        self.state
            .inner
            .metrics
            .pending_records
            .store(self.cycle.pending_records().await as u64, Ordering::Relaxed);
    }

    async fn poll_reports(&self, client: &ControllerClient) -> anyhow::Result<()> {
        let store = self.cycle.store().await?;
        let mut cursor = store.cursor(REPORT_CURSOR).await?;
        // Bounded: a large backlog is drained over several ticks.
        for _ in 0..20 {
            let page = client.reports(cursor.as_deref(), REPORT_PAGE).await?;
            if page.gap || page.reset {
                // Visible to operators: the dashboard misses some intervals.
                tracing::warn!(gap = page.gap, reset = page.reset, cursor = ?cursor, "shadow reports were lost between polls");
                self.state
                    .inner
                    .metrics
                    .report_gaps
                    .fetch_add(1, Ordering::Relaxed);
            }
            let got = page.reports.len();
            let shadow: Vec<Report> = page
                .reports
                .into_iter()
                .filter(|r| r.mode == "shadow")
                .collect();
            let n = store.insert_reports(&shadow, Utc::now()).await?;
            self.state
                .inner
                .metrics
                .reports_stored
                .fetch_add(n, Ordering::Relaxed);
            let next = match page.next {
                serde_json::Value::Null => None,
                serde_json::Value::String(s) => Some(s),
                v => Some(v.to_string()),
            };
            if let Some(next) = &next {
                store.set_cursor(REPORT_CURSOR, next).await?;
            }
            if got < REPORT_PAGE as usize || next.is_none() || next == cursor {
                break;
            }
            cursor = next;
        }
        Ok(())
    }
}

async fn scheduler(
    cycle: Arc<Cycle>,
    planner: Planner,
    schedule: Option<cron::Schedule>,
    opts: ServeOptions,
    state: AppState,
    mut triggers: mpsc::Receiver<String>,
    mut shutdown: watch::Receiver<bool>,
) {
    let controller = match cycle
        .config()
        .controller
        .as_ref()
        .map(|c| ControllerClient::from_config(c, cycle.base_dir()))
    {
        Some(Ok(c)) => Some(c),
        Some(Err(e)) => {
            tracing::error!(error = %e, "controller push disabled");
            None
        }
        None => None,
    };
    let sqlite = cycle.config().database_url.starts_with("sqlite:");
    let mut lp = Loop {
        cycle,
        planner,
        state,
        controller,
        last_inputs: None,
        last_pushed: None,
    };
    let mut lease: Option<Lease> = None;
    let mut next_cron = schedule.as_ref().and_then(|s| s.upcoming(Utc).next());
    let mut stop = false;
    loop {
        if stop || *shutdown.borrow() {
            break;
        }
        // Leadership: keep it while the lock's connection lives; try to take it otherwise.
        let alive = match lease.as_mut() {
            Some(l) => l.alive().await,
            None => false,
        };
        if !alive {
            lease = match lp.cycle.store().await {
                Ok(store) => {
                    // Every replica serves the dashboard, leader or not.
                    if lp.state.store().is_none() {
                        lp.state.set_store(store.clone());
                    }
                    store.try_lead().await.unwrap_or_else(|e| {
                        tracing::warn!(error = %e, "leader election failed");
                        None
                    })
                }
                Err(e) => {
                    tracing::warn!(error = %e, "store unavailable");
                    None
                }
            };
            // SQLite means a single instance: it leads even while its store is unavailable
            // (runs are buffered). With Postgres there is no safe election without it.
            let was = lp.state.is_leader();
            lp.state.set_leader(lease.is_some() || sqlite);
            if lp.state.is_leader() && !was {
                tracing::info!("active scheduler");
            }
        }
        let leader = lp.state.is_leader();
        if leader {
            lp.tick().await;
        }
        let now = tokio::time::Instant::now();
        let poll_at = now + opts.poll;
        let cron_at = next_cron.map(|t| now + (t - Utc::now()).to_std().unwrap_or(Duration::ZERO));
        let cron_first = leader && cron_at.is_some_and(|c| c <= poll_at);
        // Wait for the next event; manual runs may come several times before the poll.
        loop {
            tokio::select! {
                r = shutdown.changed() => {
                    if r.is_err() {
                        stop = true;
                    }
                    break;
                }
                t = triggers.recv() => match t {
                    Some(t) if leader => lp.run(&t).await,
                    Some(_) => {}
                    None => {
                        stop = true;
                        break;
                    }
                },
                _ = tokio::time::sleep_until(cron_at.unwrap_or(poll_at)), if cron_first => {
                    lp.run("schedule").await;
                    next_cron = schedule.as_ref().and_then(|s| s.after(&Utc::now()).next());
                    break;
                }
                _ = tokio::time::sleep_until(poll_at) => break,
            }
        }
        if next_cron.is_some_and(|t| t <= Utc::now()) {
            next_cron = schedule.as_ref().and_then(|s| s.after(&Utc::now()).next());
        }
    }
    if let Some(l) = lease {
        l.release().await;
    }
    tracing::info!("scheduler stopped");
}

/// Ctrl-C or SIGTERM turn the returned receiver true.
pub fn shutdown_signal() -> watch::Receiver<bool> {
    let (tx, rx) = watch::channel(false);
    tokio::spawn(async move {
        let signal = grl_runtime::http_util::shutdown_signal().await;
        tracing::info!(signal, "shutting down after the current run");
        let _ = tx.send(true);
    });
    rx
}

/// `rlc serve`: runs until SIGTERM or ctrl-c. Returns the exit status.
pub async fn run(args: ServeArgs, planner: Planner) -> anyhow::Result<i32> {
    let (cfg, base) = load_config(&args.config)?;
    let server = cfg.server.clone().unwrap_or(schema::ServerConfig {
        listen: "127.0.0.1:8080".into(),
        token_env: "RLC_TOKEN".into(),
        tls: None,
    });
    // Flags (relative to the working directory) win over rlc.yaml (relative to the file).
    let tls = match grl_runtime::tls::ServerTls::from_flags(
        args.tls_cert.clone(),
        args.tls_key.clone(),
        args.tls_client_ca.clone(),
    )? {
        Some(t) => Some(t),
        None => server.tls.as_ref().map(|t| {
            grl_runtime::tls::ServerTls {
                client_ca: t.client_ca.as_ref().map(PathBuf::from),
                ..grl_runtime::tls::ServerTls::new(&t.cert, &t.key)
            }
            .relative_to(&base)
        }),
    };
    let listen = args.listen.clone().unwrap_or(server.listen.clone());
    let token = std::env::var(&server.token_env)
        .ok()
        .filter(|t| !t.is_empty());
    if token.is_none() {
        tracing::warn!(env = %server.token_env, "no API token set: POST /v1/runs is refused");
    }
    let listener = tokio::net::TcpListener::bind(&listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {listen}: {e}"))?;
    tracing::info!(listen = %listen, tls = tls.is_some(), "rlc serve listening");
    let (tx, rx) = mpsc::channel(1);
    let state = AppState::new(token, tx);
    let opts = ServeOptions {
        poll: Duration::from_secs(args.poll_secs.max(1)),
        tls,
    };
    serve_on(
        listener,
        cfg,
        &base,
        planner,
        opts,
        state,
        rx,
        shutdown_signal(),
    )
    .await?;
    Ok(0)
}

#[cfg(test)]
mod tests;
