//! The daemon's last pulled history, kept in memory so that previews compute from it instead
//! of pulling Prometheus per request. Runs refresh it (the run's own pull goes through
//! [`HistoryCache::refresh`]); `?refresh=true` re-pulls; concurrent callers needing a pull
//! share one (single flight: the pull runs under one lock, and whoever waited for it takes
//! its result instead of pulling again).
//!
//! From Prometheus, a refresh pulls only the minutes since the held history's end and an
//! overlap ([`super::incremental`]) and merges them into it; it pulls the whole lookback on
//! the first pull, when the history settings changed (query, labels, step, downsample, API,
//! lookback, URL), when the increment does not fit the held grid, and once
//! `history.full_pull_every` passed since the last full pull.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use chrono::{DateTime, Utc};
use schema::DaemonConfig;

use super::{History, PullKind};

/// One pulled history.
#[derive(Debug)]
pub struct Snapshot {
    /// The history (a failed source is `History::unavailable`).
    pub history: Arc<History>,
    /// When the pull finished.
    pub pulled_at: DateTime<Utc>,
    /// Increases by one per stored snapshot (a plan computed from it is keyed by this).
    pub generation: u64,
    /// Where it came from (the Prometheus URL and query, or the file).
    pub source: String,
    /// Whether the pull read the whole lookback or an increment merged into the held history.
    pub kind: PullKind,
}

/// The history increments are merged into: the last good pull, with the settings it was
/// pulled with and when the last full pull ended.
struct Held {
    history: Arc<History>,
    settings: String,
    full_end: i64,
}

/// What the pull lock guards.
#[derive(Default)]
struct PullState {
    /// The result of the last pull (good or failed), shared with whoever waited for it.
    last: Option<Arc<Snapshot>>,
    held: Option<Held>,
}

/// The latest [`Snapshot`] and the single-flight pull.
pub struct HistoryCache {
    cfg: RwLock<DaemonConfig>,
    base_dir: PathBuf,
    latest: RwLock<Option<Arc<Snapshot>>>,
    pull: tokio::sync::Mutex<PullState>,
    pulls: AtomicU64,
    /// Pulls finished; a caller that saw `n` takes the result of any pull finishing after.
    finished: AtomicU64,
    last_error: RwLock<Option<String>>,
}

impl std::fmt::Debug for HistoryCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HistoryCache")
            .field("pulls", &self.pulls())
            .field("generation", &self.generation())
            .finish()
    }
}

/// How the history section of `cfg` names its source (no credentials: URLs and paths only).
fn describe(cfg: &DaemonConfig) -> String {
    match (&cfg.history.prometheus, &cfg.history.file) {
        (Some(p), _) => format!("prometheus {} ({})", p.url, p.query),
        (None, Some(f)) => format!("file {f}"),
        (None, None) => "none".into(),
    }
}

impl HistoryCache {
    /// A cache pulling with `cfg` (paths resolved) from `base_dir` (rlc.yaml's directory).
    pub fn new(cfg: DaemonConfig, base_dir: &Path) -> HistoryCache {
        HistoryCache {
            cfg: RwLock::new(cfg),
            base_dir: base_dir.to_path_buf(),
            latest: RwLock::new(None),
            pull: tokio::sync::Mutex::new(PullState::default()),
            pulls: AtomicU64::new(0),
            finished: AtomicU64::new(0),
            last_error: RwLock::new(None),
        }
    }

    /// Pulls with `cfg` from now on (paths resolved): the next pull is a full one if its
    /// history settings differ from those the held history was pulled with.
    pub fn set_config(&self, cfg: DaemonConfig) {
        *self.cfg.write().unwrap() = cfg;
    }

    /// The latest snapshot, if any pull finished.
    pub fn latest(&self) -> Option<Arc<Snapshot>> {
        self.latest.read().unwrap().clone()
    }

    /// Pulls made since start (`rlc_history_pulls_total`).
    pub fn pulls(&self) -> u64 {
        self.pulls.load(Ordering::Relaxed)
    }

    /// The generation of the latest snapshot (0: none yet).
    pub fn generation(&self) -> u64 {
        self.latest().map_or(0, |s| s.generation)
    }

    /// Why the last pull failed, when it did (the previous good snapshot is kept).
    pub fn last_error(&self) -> Option<String> {
        self.last_error.read().unwrap().clone()
    }

    /// The latest snapshot, pulling one first when there is none.
    pub async fn get(&self) -> Arc<Snapshot> {
        if let Some(s) = self.latest() {
            return s;
        }
        let pulled = self.refresh().await;
        self.latest().unwrap_or(pulled)
    }

    /// The result of a pull started after this call: a new pull, or the one that finished
    /// while this call waited for the pull in progress (concurrent refreshes share one pull).
    /// A failed pull is returned as such (a run must see it fail), but does not replace a
    /// good snapshot in [`HistoryCache::latest`]: previews keep computing from the last good
    /// history and report [`HistoryCache::last_error`] beside it.
    pub async fn refresh(&self) -> Arc<Snapshot> {
        self.refresh_at(Utc::now()).await
    }

    /// [`HistoryCache::refresh`] for a lookback ending at `end` (tests and benchmarks
    /// choose the time; the daemon pulls up to now).
    pub async fn refresh_at(&self, end: DateTime<Utc>) -> Arc<Snapshot> {
        // A pull in progress when this call came finishes after it: its result is shared.
        let seen = self.finished.load(Ordering::Acquire);
        let mut state = self.pull.lock().await;
        if self.finished.load(Ordering::Acquire) > seen {
            if let Some(s) = state.last.as_ref() {
                return s.clone();
            }
        }
        self.pulls.fetch_add(1, Ordering::Relaxed);
        super::pulls().inc();
        let cfg = self.cfg.read().unwrap().clone();
        let t = std::time::Instant::now();
        let (history, kind) = self.pull(&cfg, end, &mut state.held).await;
        super::pull_seconds().observe(t.elapsed().as_secs_f64());
        let previous = self.latest();
        let keep_previous = history.source_error.is_some()
            && previous
                .as_ref()
                .is_some_and(|p| p.history.source_error.is_none());
        *self.last_error.write().unwrap() = history.source_error.clone();
        let snap = Arc::new(Snapshot {
            history,
            pulled_at: Utc::now(),
            generation: previous.as_ref().map_or(1, |p| p.generation + 1),
            source: describe(&cfg),
            kind,
        });
        if !keep_previous {
            *self.latest.write().unwrap() = Some(snap.clone());
        }
        state.last = Some(snap.clone());
        self.finished.fetch_add(1, Ordering::Release);
        snap
    }

    /// One pull: an increment merged into `held` when it can be, else the whole lookback;
    /// `held` becomes the new history when the pull succeeded.
    async fn pull(
        &self,
        cfg: &DaemonConfig,
        end: DateTime<Utc>,
        held: &mut Option<Held>,
    ) -> (Arc<History>, PullKind) {
        let Some(p) = &cfg.history.prometheus else {
            *held = None;
            let h = super::load(&cfg.history, &self.base_dir, end).await;
            return (Arc::new(unavailable_on_error(h)), PullKind::Full);
        };
        let settings = settings(cfg);
        let every = cfg.history.full_pull_every.as_secs() as i64;
        let base = held
            .as_ref()
            .filter(|h| h.settings == settings && end.timestamp() - h.full_end < every);
        if let Some(base) = base {
            if let Some(since) = super::incremental::since(&base.history) {
                match super::prometheus::load_tail(p, &cfg.history, end, since).await {
                    Ok(tail) => {
                        let (old, grid) = (base.history.clone(), tail.grid);
                        let t = std::time::Instant::now();
                        let merged = tokio::task::spawn_blocking(move || {
                            super::incremental::merge(&old, tail.history, grid)
                        })
                        .await
                        .ok()
                        .flatten();
                        if let Some(m) = merged {
                            tracing::info!(
                                series = m.series.len(),
                                seconds = %format_args!("{:.2}", t.elapsed().as_secs_f64()),
                                "history increment merged"
                            );
                            let m = Arc::new(m);
                            let full_end = base.full_end;
                            *held = Some(Held {
                                history: m.clone(),
                                settings,
                                full_end,
                            });
                            return (m, PullKind::Incremental);
                        }
                        tracing::info!("the increment does not continue the held history: pulling the whole lookback");
                    }
                    Err(e) => {
                        // The held history stays: the next pull tries from it again.
                        tracing::error!(error = %e, "history source failed");
                        return (
                            Arc::new(History::unavailable(e.to_string())),
                            PullKind::Incremental,
                        );
                    }
                }
            }
        }
        let h = unavailable_on_error(
            super::prometheus::load_with_stats(p, &cfg.history, end)
                .await
                .map(|(h, _)| h),
        );
        if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
            eprintln!("history: {} series", h.series.len());
        }
        let h = Arc::new(h);
        if h.source_error.is_none() {
            *held = Some(Held {
                history: h.clone(),
                settings,
                full_end: end.timestamp(),
            });
        }
        (h, PullKind::Full)
    }
}

/// A failed pull as a history that keeps every quota (the error logged).
fn unavailable_on_error(h: Result<History, super::HistoryError>) -> History {
    h.unwrap_or_else(|e| {
        tracing::error!(error = %e, "history source failed");
        History::unavailable(e.to_string())
    })
}

/// The history settings a held history was pulled with: another value is another history,
/// which takes a full pull. Timeouts, concurrency and bounds change how a pull goes, not what
/// it gives, and are left out.
fn settings(cfg: &DaemonConfig) -> String {
    let h = &cfg.history;
    let p = h.prometheus.as_ref();
    serde_json::json!({
        "lookback": h.lookback.as_secs(),
        "step": h.step.as_secs(),
        "url": p.map(|p| p.url.as_str()),
        "query": p.map(|p| p.query.as_str()),
        "labels": p.map(|p| [&p.labels.service, &p.labels.caller, &p.labels.procedure]),
        "downsample": p.and_then(|p| p.downsample).map(|d| d.as_secs()),
        "api": p.map(|p| format!("{:?}", p.api)),
    })
    .to_string()
}
