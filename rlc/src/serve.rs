//! `rlc serve`: the daemon. A cron schedule, a run as soon as the human-authored
//! `rlc/*.yaml` change on the base branch, and manual runs over HTTP (`POST /v1/runs`); it
//! also keeps the controller on the base branch's version (so a merged PR reaches it), stores
//! the controller's shadow reports, and serves `/healthz`, `/metrics`, the dashboard and the
//! run API, documented by the OpenAPI document at `/openapi.json` ([`openapi`]).
//!
//! Several replicas on one Postgres elect one active scheduler (`pg_try_advisory_lock`);
//! the others serve HTTP and refuse manual runs with 409. With SQLite there is one instance.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Router;
use chrono::Utc;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use schema::DaemonConfig;
use tokio::sync::{mpsc, watch};

use crate::config::load_config;
use crate::cycle::{Cycle, Planner, RunOutcome, RunStatus};
use crate::store::{Lease, Store};

pub mod auth;
pub mod dashboard;
mod examples;
pub mod limits;
pub mod openapi;
pub mod previews;
pub mod problem;
pub mod quotas;
mod reports;
pub mod runs;

pub use auth::Tokens;
pub use reports::ReportLimits;
pub use runs::RunRequest;

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
    /// On SIGTERM or SIGINT: how long a running cycle and in-flight requests may take to
    /// finish; a run still going then is abandoned (nothing half-written: see
    /// docs/rlc-api.md, "Shutdown").
    #[arg(long, default_value_t = 20_000)]
    pub shutdown_grace_ms: u64,
    /// How long one run or poll of the scheduler may take before `/readyz` says it is stuck
    /// (503 naming what: a git remote that never answers, a hung store...).
    #[arg(long, default_value_t = 600)]
    pub run_deadline_secs: u64,
}

/// The daemon's metrics (`GET /metrics`, OpenMetrics text through `prometheus-client`).
#[derive(Clone)]
struct Metrics {
    runs: Family<[(&'static str, &'static str); 1], Counter>,
    last_run_finished: Gauge,
    last_success: Gauge,
    run_seconds: Histogram,
    leader: Gauge,
    in_sync: Gauge,
    desired_version: grl_client::metrics::InfoGauge,
    push_failures: Counter,
    reports_stored: Counter,
    report_gaps: Counter,
    reports_buffered: Gauge,
    report_polls_paused: Counter,
    pending_records: Gauge,
    rollout_state: Family<Vec<(String, String)>, Gauge>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            runs: Family::default(),
            last_run_finished: Gauge::default(),
            last_success: Gauge::default(),
            run_seconds: Histogram::new(grl_client::metrics::RUN_BUCKETS),
            leader: Gauge::default(),
            in_sync: Gauge::default(),
            desired_version: grl_client::metrics::InfoGauge::new(
                "rlc_config_version_info",
                "1, labelled with the base branch's version rlc keeps the controller on.",
                "version",
            ),
            push_failures: Counter::default(),
            reports_stored: Counter::default(),
            report_gaps: Counter::default(),
            reports_buffered: Gauge::default(),
            report_polls_paused: Counter::default(),
            pending_records: Gauge::default(),
            rollout_state: Family::default(),
        }
    }
}

impl Metrics {
    fn registry(&self) -> Registry {
        let mut r = Registry::default();
        grl_client::metrics::register_build_info(&mut r, "rlc", "serve");
        r.register("rlc_runs", "Finished runs by status.", self.runs.clone());
        r.register(
            "rlc_last_run_finished_timestamp_seconds",
            "Unix time of the last finished run.",
            self.last_run_finished.clone(),
        );
        r.register(
            "rlc_last_successful_run_timestamp_seconds",
            "Unix time of the last run that ended `success` or `unchanged` (0: none since start).",
            self.last_success.clone(),
        );
        r.register(
            "rlc_run_duration_seconds",
            "Length of finished runs.",
            self.run_seconds.clone(),
        );
        r.register(
            "rlc_history_pull_duration_seconds",
            "Length of the history pulls of this process's runs.",
            crate::history::pull_seconds().clone(),
        );
        r.register(
            "rlc_history_pulls",
            "History pulls (runs and the quota API share one snapshot).",
            crate::history::pulls().clone(),
        );
        r.register(
            "rlc_history_pulls_by_kind",
            "Successful history pulls by kind: `full` (the whole lookback) or `incremental` (the minutes since the last pull, merged into the held history).",
            crate::history::pulls_by_kind().clone(),
        );
        r.register(
            "rlc_history_pulled_points",
            "Samples taken by successful history pulls, by kind.",
            crate::history::pulled_points().clone(),
        );
        r.register(
            "rlc_leader",
            "1 when this replica is the active scheduler.",
            self.leader.clone(),
        );
        r.register(
            "rlc_controller_in_sync",
            "1 when the controller runs the base branch's version.",
            self.in_sync.clone(),
        );
        r.register_collector(Box::new(self.desired_version.clone()));
        r.register(
            "rlc_pending_run_records",
            "Run records waiting for the store.",
            self.pending_records.clone(),
        );
        r.register(
            "rlc_controller_push_failures",
            "Failed controller reconcile attempts.",
            self.push_failures.clone(),
        );
        r.register(
            "rlc_shadow_reports_stored",
            "Controller reports stored (every mode; duplicates not counted).",
            self.reports_stored.clone(),
        );
        r.register(
            "rlc_shadow_reports_buffered",
            "Controller reports fetched but not yet stored (store down or slow).",
            self.reports_buffered.clone(),
        );
        r.register(
            "rlc_shadow_report_polls_paused",
            "Polls skipped because the report buffer was full (the store is down or slow).",
            self.report_polls_paused.clone(),
        );
        r.register(
            "rlc_rollout_state",
            "1 for the state of the newest rollout of each bucket (pending, baking, done, aborted, superseded), 0 for the other states.",
            self.rollout_state.clone(),
        );
        r.register(
            "rlc_shadow_report_gaps",
            "Polls that found shadow reports lost at the controller.",
            self.report_gaps.clone(),
        );
        r
    }
}

struct Inner {
    tokens: Tokens,
    trigger: mpsc::Sender<RunRequest>,
    /// Queued, running and recently finished runs, for `GET /v1/runs/{id}`.
    book: Mutex<runs::RunBook>,
    metrics: Metrics,
    registry: Registry,
    runs_done: watch::Sender<u64>,
    last: Mutex<Option<RunOutcome>>,
    /// Filled once the scheduler has connected; the read-only pages answer 503 until then.
    store: StoreSlot,
    /// How long one store query of a page may take (`store.query_timeout`).
    query_timeout: Duration,
    /// The quota API (`/v1/quotas…`); answers 503 without one.
    quotas: Option<Arc<quotas::Quotas>>,
    /// `POST /v1/previews`; answers 503 without one.
    previews: Option<previews::Previews>,
    /// How the pages link commits and pull requests.
    links: dashboard::Links,
    /// How long one run or poll may take before `/readyz` calls the scheduler stuck.
    run_deadline: Duration,
    /// What the scheduler is doing, and since when (none: waiting).
    busy: Mutex<Option<(String, std::time::Instant)>>,
}

/// The store the daemon's pages, the quota API and the scheduler share: empty until the
/// scheduler has connected (the daemon serves before the store answers), then the pool.
#[derive(Clone, Default)]
pub struct StoreSlot(Arc<RwLock<Option<Store>>>);

impl StoreSlot {
    /// A slot holding `store` already.
    pub fn with(store: Store) -> StoreSlot {
        let slot = StoreSlot::default();
        slot.set(store);
        slot
    }

    /// The store, once connected.
    pub fn get(&self) -> Option<Store> {
        self.0.read().unwrap().clone()
    }

    /// Fills the slot (a pool: cloning it is cheap).
    pub fn set(&self, store: Store) {
        *self.0.write().unwrap() = Some(store);
    }
}

/// Everything the HTTP API serves from, put together before the state is built: nothing is
/// filled in afterwards (but the store, which connects when it can).
pub struct AppParts {
    /// The API's tokens.
    pub tokens: Tokens,
    /// Where manual runs go (a sender whose receiver is gone: they are refused).
    pub trigger: mpsc::Sender<RunRequest>,
    /// The store.
    pub store: StoreSlot,
    /// How long one store query of a page may take.
    pub query_timeout: Duration,
    /// How the pages link commits and pull requests.
    pub links: dashboard::Links,
    /// The quota API (none: its endpoints answer 503).
    pub quotas: Option<Arc<quotas::Quotas>>,
    /// What-if previews (none: 503).
    pub previews: Option<previews::Previews>,
    /// How long one run or poll may take before `/readyz` calls the scheduler stuck.
    pub run_deadline: Duration,
}

impl Default for AppParts {
    /// No token (every mutating call refused), no run channel, no store yet, the default
    /// query timeout, plain-text links, no quota API nor previews.
    fn default() -> AppParts {
        AppParts {
            tokens: Tokens {
                write: None,
                read: None,
            },
            trigger: mpsc::channel(1).0,
            store: StoreSlot::default(),
            query_timeout: schema::StoreConfig::default().query_timeout.0,
            links: dashboard::Links::default(),
            quotas: None,
            previews: None,
            run_deadline: DEFAULT_RUN_DEADLINE,
        }
    }
}

impl AppParts {
    /// The parts of `rlc serve` for `cfg` (paths relative to `base_dir`): the quota API over
    /// a new history snapshot, what-if previews on it, the links and query timeout of
    /// rlc.yaml, sharing `store` with the scheduler.
    pub fn daemon(
        cfg: &DaemonConfig,
        base_dir: &Path,
        tokens: Tokens,
        trigger: mpsc::Sender<RunRequest>,
        store: StoreSlot,
    ) -> std::io::Result<AppParts> {
        let mut resolved = cfg.clone();
        crate::config::resolve_paths(&mut resolved, base_dir);
        let cache = Arc::new(crate::history::snapshot::HistoryCache::new(
            resolved.clone(),
            base_dir,
        ));
        let q = Arc::new(quotas::Quotas::new(
            resolved,
            base_dir,
            cache,
            quotas::DEFAULT_CONCURRENCY,
            store.clone(),
        )?);
        Ok(AppParts {
            tokens,
            trigger,
            query_timeout: cfg.store.query_timeout.0,
            links: dashboard::Links::from_forge(cfg.config_repo.forge.as_ref()),
            // What-if previews start from the quota API's plan, on the same snapshot.
            previews: Some(q.previews()),
            quotas: Some(q),
            store,
            run_deadline: DEFAULT_RUN_DEADLINE,
        })
    }
}

/// Shared state of the HTTP API and the scheduler.
#[derive(Clone)]
pub struct AppState {
    inner: Arc<Inner>,
}

impl AppState {
    /// The state made of `parts`.
    pub fn from_parts(parts: AppParts) -> AppState {
        let metrics = Metrics::default();
        AppState {
            inner: Arc::new(Inner {
                tokens: parts.tokens,
                trigger: parts.trigger,
                book: Mutex::new(runs::RunBook::default()),
                registry: metrics.registry(),
                metrics,
                runs_done: watch::channel(0).0,
                last: Mutex::new(None),
                store: parts.store,
                query_timeout: parts.query_timeout,
                quotas: parts.quotas,
                previews: parts.previews,
                links: parts.links,
                run_deadline: parts.run_deadline,
                busy: Mutex::new(None),
            }),
        }
    }

    /// State with the API's write `token` (None: every mutating call is refused), no read
    /// token, the channel manual triggers go to, and no quota API.
    pub fn new(token: Option<String>, trigger: mpsc::Sender<RunRequest>) -> AppState {
        AppState::from_parts(AppParts {
            tokens: Tokens {
                write: token,
                read: None,
            },
            trigger,
            ..AppParts::default()
        })
    }

    /// The state of `rlc serve` for `cfg` ([`AppParts::daemon`]) with the write `token`.
    pub fn daemon(
        cfg: &DaemonConfig,
        base_dir: &Path,
        token: Option<String>,
        trigger: mpsc::Sender<RunRequest>,
    ) -> std::io::Result<AppState> {
        let tokens = Tokens {
            write: token,
            read: None,
        };
        Ok(AppState::from_parts(AppParts::daemon(
            cfg,
            base_dir,
            tokens,
            trigger,
            StoreSlot::default(),
        )?))
    }

    /// Read-only state over `store` (dashboard and JSON pages; manual runs are refused): for
    /// tests and for embedding the pages elsewhere.
    pub fn with_store(store: Store) -> AppState {
        AppState::from_parts(AppParts {
            store: StoreSlot::with(store),
            ..AppParts::default()
        })
    }

    /// Gives the HTTP pages the store, once connected.
    pub fn set_store(&self, store: Store) {
        self.inner.store.set(store);
    }

    /// How long one store query of a page may take (`store.query_timeout`).
    pub fn query_timeout(&self) -> Duration {
        self.inner.query_timeout
    }

    /// The quota API, if this state serves one.
    pub fn quotas(&self) -> Option<Arc<quotas::Quotas>> {
        self.inner.quotas.clone()
    }

    /// How the pages link commits and pull requests.
    pub fn links(&self) -> dashboard::Links {
        self.inner.links.clone()
    }

    /// The store, once connected.
    pub fn store(&self) -> Option<Store> {
        self.inner.store.get()
    }

    /// The scheduler starts `what` (a run, a poll of the config repo...).
    fn busy(&self, what: impl Into<String>) {
        *self.inner.busy.lock().unwrap() = Some((what.into(), std::time::Instant::now()));
    }

    /// The scheduler waits for its next event.
    fn idle(&self) {
        *self.inner.busy.lock().unwrap() = None;
    }

    /// Marks this replica as the active scheduler or not.
    pub fn set_leader(&self, leader: bool) {
        self.inner.metrics.leader.set(leader as i64);
    }

    /// Whether this replica is the active scheduler.
    pub fn is_leader(&self) -> bool {
        self.inner.metrics.leader.get() == 1
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

    /// The API's tokens.
    pub fn tokens(&self) -> &Tokens {
        &self.inner.tokens
    }

    fn started(&self, req: &RunRequest) {
        self.inner.book.lock().unwrap().started(req);
    }

    fn finished(&self, out: &RunOutcome) {
        self.inner.book.lock().unwrap().finished(out);
        let m = &self.inner.metrics;
        m.runs
            .get_or_create(&[("status", out.status.as_str())])
            .inc();
        m.last_run_finished.set(out.finished_at.timestamp());
        if matches!(out.status, RunStatus::Success | RunStatus::Unchanged) {
            m.last_success.set(out.finished_at.timestamp());
        }
        let took = (out.finished_at - out.started_at).num_milliseconds().max(0);
        m.run_seconds.observe(took as f64 / 1000.0);
        *self.inner.last.lock().unwrap() = Some(out.clone());
        self.inner.runs_done.send_modify(|v| *v += 1);
    }
}

async fn healthz() -> &'static str {
    "ok\n"
}

/// How long `/readyz` waits for the store to answer.
const READY_STORE_TIMEOUT: Duration = Duration::from_secs(2);

/// `GET /readyz`: rlc.yaml loaded and the daemon started, the store answering, and this
/// replica's role (leader or standby: both are ready, a standby serves every read).
async fn readyz(State(s): State<AppState>) -> Response {
    let config = match &s.inner.quotas {
        Some(_) => Ok("loaded".to_string()),
        None => Err("not loaded yet".to_string()),
    };
    let store = match s.store() {
        None => Err("not connected yet".to_string()),
        Some(st) => match tokio::time::timeout(READY_STORE_TIMEOUT, st.ping()).await {
            Ok(Ok(())) => Ok(st.backend().to_string()),
            Ok(Err(e)) => Err(format!("{} unreachable: {e}", st.backend())),
            Err(_) => Err(format!(
                "{} did not answer within {} ms",
                st.backend(),
                READY_STORE_TIMEOUT.as_millis()
            )),
        },
    };
    let role = Ok(if s.is_leader() { "leader" } else { "standby" }.to_string());
    let deadline = s.inner.run_deadline;
    let scheduler = match s.inner.busy.lock().unwrap().as_ref() {
        None => Ok("waiting".to_string()),
        Some((what, since)) if since.elapsed() > deadline => Err(format!(
            "{what} busy for {}s, past the run deadline of {}s (--run-deadline-secs)",
            since.elapsed().as_secs(),
            deadline.as_secs()
        )),
        Some((what, since)) => Ok(format!("{what} for {}s", since.elapsed().as_secs())),
    };
    grl_server::http_util::Readiness::from_checks([
        ("config", config),
        ("role", role),
        ("scheduler", scheduler),
        ("store", store),
    ])
    .into_response()
}

async fn metrics(State(s): State<AppState>) -> Response {
    grl_server::metrics::response(&s.inner.registry).into_response()
}

/// The HTTP API: `/healthz`, `/metrics`, `/openapi.json`, `POST /v1/runs` (write token),
/// `GET /v1/runs/{id}`, `GET /v1/runs/last`, and the read-only shadow-mode dashboard: `GET /`
/// (HTML), `GET /v1/shadow`, `GET /v1/runs` (see [`dashboard`]); the routes are listed in
/// [`openapi::routes`].
pub fn app(state: AppState) -> Router {
    openapi::router(state)
}

/// Daemon settings not in rlc.yaml.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// Between polls of the repo, the controller and leadership.
    pub poll: Duration,
    /// Serve HTTPS with these files (reloaded when they change); None = plain HTTP.
    pub tls: Option<grl_server::tls::ServerTls>,
    /// After shutdown: how long a running cycle, the store backlog and in-flight requests
    /// may take before they are abandoned.
    pub grace: Duration,
    /// Controller reports held in memory while the store is down or slow, and fetched per
    /// `GET /v1/reports` call ([`ReportLimits::DEFAULT`]: 100,000 and 10,000).
    pub report_limits: ReportLimits,
}

impl ServeOptions {
    /// Polls every `poll`, plain HTTP, [`DEFAULT_GRACE`].
    pub fn new(poll: Duration) -> ServeOptions {
        ServeOptions {
            poll,
            tls: None,
            grace: DEFAULT_GRACE,
            report_limits: ReportLimits::DEFAULT,
        }
    }
}

/// What the last store writes of a shutdown get at least, when the grace is spent.
const LAST_TRY: Duration = Duration::from_secs(2);

/// The default of `--run-deadline-secs`.
pub const DEFAULT_RUN_DEADLINE: Duration = Duration::from_secs(600);

/// The default of `--shutdown-grace-ms`.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(20);

/// Runs `work`; once `shutdown` turns true, lets it go on for at most `grace` more, then
/// drops it (abandoned at its next await point). Returns its output when it finished.
async fn within_grace<F: std::future::Future>(
    work: F,
    shutdown: watch::Receiver<bool>,
    grace: Duration,
) -> Option<F::Output> {
    tokio::pin!(work);
    tokio::select! {
        out = &mut work => Some(out),
        _ = async {
            stopped(shutdown).await;
            tokio::time::sleep(grace).await
        } => None,
    }
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
    triggers: mpsc::Receiver<RunRequest>,
    shutdown: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let schedule = cfg
        .schedule
        .as_deref()
        .map(schema::parse_schedule)
        .transpose()?;
    let tls = opts
        .tls
        .as_ref()
        .map(grl_server::tls::ReloadingServerConfig::load)
        .transpose()?;
    let mut cycle = Cycle::new(cfg.clone(), base_dir);
    // One history snapshot: runs refresh it, the quota API computes from it.
    let q = state.quotas().ok_or_else(|| {
        anyhow::anyhow!("the daemon's state has no quota API: build it with AppParts::daemon")
    })?;
    cycle.history_cache = Some(q.cache.clone());
    // The dashboard's pages read the held history and never pull it themselves: pull it once
    // at start, in the background (the single-flight pull a run or the quota API shares), so
    // a restarted daemon's pages do not wait for the first run to have one.
    let warm = {
        let cache = q.cache.clone();
        tokio::spawn(async move {
            cache.get().await;
        })
    };
    let cycle = Arc::new(cycle);
    let grace = opts.grace;
    let (http_state, http_shutdown) = (state.clone(), shutdown.clone());
    let http = async move {
        let serve = grl_server::server::serve(
            listener,
            app(http_state),
            tls,
            stopped(http_shutdown.clone()),
        );
        within_grace(serve, http_shutdown, grace)
            .await
            .unwrap_or_else(|| {
                tracing::warn!(
                    grace_ms = grace.as_millis() as u64,
                    "requests still in flight after the shutdown grace: connections cut"
                );
                Ok(())
            })
    };
    let sched = scheduler(cycle, planner, schedule, opts, state, triggers, shutdown);
    let (h, ()) = tokio::join!(http, sched);
    warm.abort();
    h?;
    Ok(())
}

struct Loop {
    cycle: Arc<Cycle>,
    planner: Planner,
    state: AppState,
    /// One feed of reports per controller of `controller:` / `controllers:`.
    feeds: Vec<reports::Feed>,
    last_inputs: Option<String>,
    last_retention: Option<tokio::time::Instant>,
    last_rollup: Option<tokio::time::Instant>,
    /// Whether `rlc_last_successful_run_timestamp_seconds` was read from the store (once,
    /// when the store first answers: a restart must not reset it to 0 and fire the alert).
    last_success_loaded: bool,
}

impl Loop {
    async fn run(&mut self, trigger: &str) {
        let req = RunRequest {
            trigger: trigger.into(),
            run_uid: crate::cycle::new_run_uid(),
        };
        self.run_request(&req).await
    }

    async fn run_request(&mut self, req: &RunRequest) {
        tracing::info!(trigger = %req.trigger, run_uid = %req.run_uid, "run starting");
        self.state.started(req);
        self.state
            .busy(format!("run {} ({})", req.run_uid, req.trigger));
        let out = self
            .cycle
            .run_as(&self.planner, &req.trigger, &req.run_uid)
            .await;
        if out.version_pushed.is_some() {
            self.state.inner.metrics.in_sync.set(1);
        }
        self.state
            .inner
            .metrics
            .pending_records
            .set(self.cycle.pending_records().await as i64);
        self.state.finished(&out);
        self.state.idle();
    }

    /// Periodic work of the active scheduler: store backlog, input change, controller
    /// version, shadow reports.
    async fn tick(&mut self) {
        if !self.last_success_loaded {
            if let Ok(store) = self.cycle.store().await {
                match store.last_successful_run_at().await {
                    Ok(at) => {
                        self.last_success_loaded = true;
                        let g = &self.state.inner.metrics.last_success;
                        if let Some(at) = at.filter(|t| t.timestamp() > g.get()) {
                            g.set(at.timestamp());
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "cannot read the last successful run"),
                }
            }
        }
        self.state.busy("store backlog");
        self.cycle.flush_pending().await;
        // One fetch per poll; a second only when a run has just moved the base.
        self.state.busy("poll of the config repo");
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
        if let Ok(d) = &desired {
            self.state.inner.metrics.desired_version.set(&d.doc.version);
            // A pull request a person merged is recorded as applied now, not at the next run.
            if let Err(e) = self.cycle.record_merged(d).await {
                tracing::warn!(error = %format!("{e:#}"), "cannot record merged proposals; next poll");
            }
        }
        if !self.cycle.config().region_controllers().is_empty() {
            self.state.busy("controller reconcile and report poll");
            // Rollouts first: the candidates' counts and verdicts decide what each controller
            // runs; an abort's revert commit moves the base.
            let desired = if self.cycle.rollout_tick().await {
                self.cycle.desired().await
            } else {
                desired
            };
            match desired {
                Ok(desired) => {
                    let rep = self.cycle.push_all(&desired, None).await;
                    // During a rollout a controller runs `<commit>+c<digest>`: the version
                    // rlc keeps it on (GrlControllerVersionDiffers compares them).
                    if let Some(v) = rep.versions.values().next() {
                        self.state.inner.metrics.desired_version.set(v);
                    }
                    if rep.errors.is_empty() {
                        self.state.inner.metrics.in_sync.set(1);
                    } else {
                        self.state.inner.metrics.in_sync.set(0);
                        self.state.inner.metrics.push_failures.inc();
                        for e in &rep.errors {
                            tracing::warn!(version = %desired.doc.version, error = %e, "controller not reconciled; retrying next tick");
                        }
                    }
                }
                Err(e) => tracing::warn!(error = %e, "no desired config to reconcile"),
            }
            self.update_rollout_gauge().await;
        }
        self.poll_regions().await;
        self.state.busy("shadow roll-ups and retention");
        self.roll_up().await;
        self.retention().await;
        self.state.idle();
        self.state
            .inner
            .metrics
            .pending_records
            .set(self.cycle.pending_records().await as i64);
    }
}

/// The states `rlc_rollout_state` has a series for.
const ROLLOUT_STATES: [&str; 5] = ["pending", "baking", "done", "aborted", "superseded"];

impl Loop {
    /// `rlc_rollout_state` from the store: the newest rollout of each bucket.
    async fn update_rollout_gauge(&self) {
        let Ok(store) = self.cycle.store().await else {
            return;
        };
        let latest = match crate::rollout::latest_by_bucket(&store, 10_000).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the rollouts for rlc_rollout_state");
                return;
            }
        };
        let g = &self.state.inner.metrics.rollout_state;
        g.clear();
        let now = Utc::now();
        for ((service, bucket), r) in latest {
            let state = r.view(now).state;
            for st in ROLLOUT_STATES {
                g.get_or_create(&vec![
                    ("service".to_string(), service.clone()),
                    ("bucket".to_string(), bucket.clone()),
                    ("state".to_string(), st.to_string()),
                ])
                .set(i64::from(st == state));
            }
        }
    }
}

async fn scheduler(
    cycle: Arc<Cycle>,
    planner: Planner,
    schedule: Option<cron::Schedule>,
    opts: ServeOptions,
    state: AppState,
    mut triggers: mpsc::Receiver<RunRequest>,
    mut shutdown: watch::Receiver<bool>,
) {
    // When the shutdown came: the grace counts from there for everything that follows.
    let shutdown_at = Arc::new(std::sync::OnceLock::new());
    {
        let (at, rx) = (shutdown_at.clone(), shutdown.clone());
        tokio::spawn(async move {
            stopped(rx).await;
            let _ = at.set(tokio::time::Instant::now());
        });
    }
    // Reports and overrides come from every controller, one feed per region.
    let feeds = reports::feeds(&cycle, opts.report_limits);
    let sqlite = cycle.config().database_url.starts_with("sqlite:");
    let mut lp = Loop {
        cycle,
        planner,
        state,
        feeds,
        last_inputs: None,
        last_retention: None,
        last_rollup: None,
        last_success_loaded: false,
    };
    let mut lease: Option<Lease> = None;
    let mut next_cron = schedule.as_ref().and_then(|s| s.upcoming(Utc).next());
    let mut stop = false;
    let mut abandoned = false;
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
        if leader
            && within_grace(lp.tick(), shutdown.clone(), opts.grace)
                .await
                .is_none()
        {
            abandoned = true;
            break;
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
                    Some(t) if leader => {
                        if within_grace(lp.run_request(&t), shutdown.clone(), opts.grace).await.is_none() {
                            tracing::warn!(run_uid = %t.run_uid, "shutdown: the run was abandoned after the grace");
                            abandoned = true;
                            stop = true;
                            break;
                        }
                    }
                    Some(t) => lp.state.inner.book.lock().unwrap().dropped(&t),
                    None => {
                        stop = true;
                        break;
                    }
                },
                _ = tokio::time::sleep_until(cron_at.unwrap_or(poll_at)), if cron_first => {
                    if within_grace(lp.run("schedule"), shutdown.clone(), opts.grace).await.is_none() {
                        tracing::warn!("shutdown: the scheduled run was abandoned after the grace");
                        abandoned = true;
                        stop = true;
                        break;
                    }
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
    // Run records the store has not taken yet, then the lease: one last try each, within
    // what is left of the grace since the shutdown (at least `LAST_TRY`), so that the whole
    // shutdown stays within the grace plus a few seconds.
    let deadline = shutdown_at
        .get()
        .map_or_else(tokio::time::Instant::now, |t| *t + opts.grace)
        .max(tokio::time::Instant::now() + LAST_TRY);
    let flush = tokio::time::timeout_at(deadline, lp.cycle.flush_pending()).await;
    let left = lp.cycle.pending_records().await;
    if flush.is_err() || left > 0 {
        tracing::warn!(
            pending_records = left,
            "shutdown: run records not stored (the store is down or slow)"
        );
    }
    if let Some(l) = lease {
        let last = deadline.max(tokio::time::Instant::now() + LAST_TRY);
        let _ = tokio::time::timeout_at(last, l.release()).await;
    }
    tracing::info!(abandoned, "scheduler stopped");
}

/// `url` without the password of its user part (`postgres://rlc:***@db/rlc`), for logs.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    match rest[..end].rfind('@') {
        Some(at) => {
            let user = rest[..at].split(':').next().unwrap_or("");
            let hidden = if rest[..at].contains(':') { ":***" } else { "" };
            format!("{scheme}://{user}{hidden}{}", &rest[at..])
        }
        None => url.to_string(),
    }
}

/// Ctrl-C or SIGTERM turn the returned receiver true.
pub fn shutdown_signal() -> watch::Receiver<bool> {
    let (tx, rx) = watch::channel(false);
    tokio::spawn(async move {
        let signal = grl_server::http_util::shutdown_signal().await;
        tracing::info!(
            signal,
            "shutting down: the current run may finish within the grace"
        );
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
        read_token_env: None,
        tls: None,
    });
    // Flags (relative to the working directory) win over rlc.yaml (relative to the file).
    let tls = match grl_server::tls::ServerTls::from_flags(
        args.tls_cert.clone(),
        args.tls_key.clone(),
        args.tls_client_ca.clone(),
    )? {
        Some(t) => Some(t),
        None => server.tls.as_ref().map(|t| {
            grl_server::tls::ServerTls {
                client_ca: t.client_ca.as_ref().map(PathBuf::from),
                ..grl_server::tls::ServerTls::new(&t.cert, &t.key)
            }
            .relative_to(&base)
        }),
    };
    let listen = args.listen.clone().unwrap_or(server.listen.clone());
    let tokens = Tokens::from_env(&server.token_env, server.read_token_env.as_deref());
    if tokens.write.is_none() {
        tracing::warn!(env = %server.token_env, "no API token set: POST /v1/runs is not enabled (403)");
    }
    // Fail closed: a read token that was asked for but is missing never opens the reads.
    if let (Some(env), None) = (&server.read_token_env, &tokens.read) {
        anyhow::bail!(
            "server.read_token_env in {} names {env}, which is unset or empty: set it, or remove read_token_env to leave the read endpoints open",
            args.config.display()
        );
    }
    let listener = tokio::net::TcpListener::bind(&listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {listen}: {e}"))?;
    tracing::info!(
        listen = %listen,
        tls = tls.is_some(),
        config = %args.config.display(),
        config_repo = %cfg.config_repo.url.as_deref().map_or_else(
            || cfg.config_repo.path.clone(),
            redact_url
        ),
        branch = %cfg.config_repo.branch,
        mode = ?cfg.config_repo.mode,
        store = %redact_url(&cfg.database_url),
        schedule = cfg.schedule.as_deref().unwrap_or("none"),
        controller = cfg.controller.as_ref().map_or("none", |c| c.url.as_str()),
        history = %cfg.history.prometheus.as_ref().map_or_else(
            || cfg.history.file.clone().unwrap_or_default(),
            |p| redact_url(&p.url)
        ),
        poll_secs = args.poll_secs.max(1),
        read_token = tokens.read.is_some(),
        "rlc serve listening"
    );
    let (tx, rx) = mpsc::channel(1);
    let state = AppState::from_parts(AppParts {
        run_deadline: Duration::from_secs(args.run_deadline_secs.max(1)),
        ..AppParts::daemon(&cfg, &base, tokens, tx, StoreSlot::default())?
    });
    let opts = ServeOptions {
        poll: Duration::from_secs(args.poll_secs.max(1)),
        tls,
        grace: Duration::from_millis(args.shutdown_grace_ms),
        report_limits: ReportLimits::DEFAULT,
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
mod store_faults;
#[cfg(test)]
mod tests;
