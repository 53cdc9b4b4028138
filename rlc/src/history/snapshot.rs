//! The daemon's last pulled history, kept in memory so that previews compute from it instead
//! of pulling Prometheus per request. Runs refresh it (the run's own pull goes through
//! [`HistoryCache::refresh`]); `?refresh=true` re-pulls; concurrent callers needing a pull
//! share one (single flight: the pull runs under one lock, and whoever waited for it takes
//! its result instead of pulling again).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use chrono::{DateTime, Utc};
use schema::DaemonConfig;

use super::History;

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
}

/// The latest [`Snapshot`] and the single-flight pull.
pub struct HistoryCache {
    cfg: DaemonConfig,
    base_dir: PathBuf,
    latest: RwLock<Option<Arc<Snapshot>>>,
    /// The result of the last pull (good or failed), shared with whoever waited for it.
    pull: tokio::sync::Mutex<Option<Arc<Snapshot>>>,
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
            cfg,
            base_dir: base_dir.to_path_buf(),
            latest: RwLock::new(None),
            pull: tokio::sync::Mutex::new(None),
            pulls: AtomicU64::new(0),
            finished: AtomicU64::new(0),
            last_error: RwLock::new(None),
        }
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
        // A pull in progress when this call came finishes after it: its result is shared.
        let seen = self.finished.load(Ordering::Acquire);
        let mut last = self.pull.lock().await;
        if self.finished.load(Ordering::Acquire) > seen {
            if let Some(s) = last.as_ref() {
                return s.clone();
            }
        }
        self.pulls.fetch_add(1, Ordering::Relaxed);
        super::pulls().inc();
        let t = std::time::Instant::now();
        let history = Arc::new(super::load_or_unavailable(&self.cfg, &self.base_dir).await);
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
            source: describe(&self.cfg),
        });
        if !keep_previous {
            *self.latest.write().unwrap() = Some(snap.clone());
        }
        *last = Some(snap.clone());
        self.finished.fetch_add(1, Ordering::Release);
        snap
    }
}
