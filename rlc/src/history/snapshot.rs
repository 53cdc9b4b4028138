//! The daemon's last pulled history, kept so that previews compute from it instead of
//! pulling Prometheus per request. Runs refresh it (the run's own pull goes through
//! [`HistoryCache::refresh`]); `?refresh=true` re-pulls; concurrent callers needing a pull
//! share one (single flight: the pull runs under one lock, and whoever waited for it takes
//! its result instead of pulling again).
//!
//! From Prometheus, the history is held on disk ([`super::ring`]: a ring of `f32` per series
//! in one file, an index in memory), read one service at a time by the plans, the quota API
//! and the dashboard, so that the daemon's memory does not grow with the fleet's history. A
//! full pull is spilled as it streams in ([`super::spill`]) and written to a new ring, which
//! replaces the held one only once it is whole. A refresh pulls only the minutes since the
//! held history's end and an overlap ([`super::incremental`]) and writes them over the
//! ring's oldest cells in place; it pulls the whole lookback on the first pull (a restart
//! too: the ring lives as long as the process), when the history settings changed (query,
//! labels, step, downsample, API, lookback, URL), when the increment does not fit the held
//! grid, and once `history.full_pull_every` passed since the last full pull. A file source is
//! held in memory.

use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, RwLock};

use chrono::{DateTime, Utc};
use schema::{DaemonConfig, HistoryConfig, PrometheusConfig};

use super::ring::RingHistory;
use super::{DiskError, History, HistoryError, PullKind, Rejected, SeriesSource};

/// The history of a [`Snapshot`]: in memory (a file source, a failed pull), or on disk
/// ([`RingHistory`]) and read service by service through [`SeriesSource`].
///
/// It dereferences to a [`History`] for callers that need every series at once (tests,
/// small histories): on disk, that reads the whole history into memory once and keeps it
/// with the snapshot, so the daemon reads through [`SeriesSource`] instead.
pub struct HeldHistory {
    ring: Option<RingHistory>,
    whole: OnceLock<History>,
}

impl std::fmt::Debug for HeldHistory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.ring {
            Some(r) => r.fmt(f),
            None => f
                .debug_struct("HeldHistory")
                .field("series", &self.series_count())
                .field("source_error", &self.source_error())
                .finish(),
        }
    }
}

impl From<History> for HeldHistory {
    fn from(h: History) -> Self {
        HeldHistory {
            ring: None,
            whole: OnceLock::from(h),
        }
    }
}

impl From<RingHistory> for HeldHistory {
    fn from(r: RingHistory) -> Self {
        HeldHistory {
            ring: Some(r),
            whole: OnceLock::new(),
        }
    }
}

impl std::ops::Deref for HeldHistory {
    type Target = History;

    /// The whole history in memory (read from disk once; a read error is a history whose
    /// source failed).
    fn deref(&self) -> &History {
        self.whole.get_or_init(|| match &self.ring {
            Some(r) => r
                .to_history()
                .unwrap_or_else(|e| History::unavailable(e.to_string())),
            None => History::default(),
        })
    }
}

impl HeldHistory {
    /// The ring holding it, when on disk.
    pub fn ring(&self) -> Option<&RingHistory> {
        self.ring.as_ref()
    }

    /// Why the source failed, if it did.
    pub fn source_error(&self) -> Option<&str> {
        match &self.ring {
            Some(_) => None,
            None => self.whole.get().and_then(|h| h.source_error.as_deref()),
        }
    }

    /// Series in the history.
    pub fn series_count(&self) -> usize {
        match &self.ring {
            Some(r) => r.series_count(),
            None => self.whole.get().map_or(0, |h| h.series.len()),
        }
    }

    /// The grid: first point, step, points.
    pub fn grid(&self) -> (i64, i64, usize) {
        match &self.ring {
            Some(r) => (r.start, r.step, r.len),
            None => self
                .whole
                .get()
                .map_or((0, 0, 0), |h| (h.start, h.step, h.len)),
        }
    }
}

impl SeriesSource for HeldHistory {
    fn services(&self) -> Vec<String> {
        match &self.ring {
            Some(r) => r.services(),
            None => self.whole.get().map(History::services).unwrap_or_default(),
        }
    }

    fn rejected(&self) -> &[Rejected] {
        match &self.ring {
            Some(r) => &r.rejected,
            None => self.whole.get().map_or(&[], |h| &h.rejected),
        }
    }

    fn source_error(&self) -> Option<&str> {
        HeldHistory::source_error(self)
    }

    fn service(&self, service: &str) -> Result<Cow<'_, History>, rlc_plan::history::Unreadable> {
        match (&self.ring, self.whole.get()) {
            // Already in memory (read whole once): no second read.
            (_, Some(h)) => Ok(Cow::Borrowed(h)),
            (Some(r), None) => r
                .service(service)
                .map(Cow::Owned)
                .map_err(rlc_plan::history::Unreadable::from),
            (None, None) => Ok(Cow::Owned(History::default())),
        }
    }

    fn whole(&self) -> Option<&History> {
        self.whole.get()
    }
}

/// One pulled history.
#[derive(Debug)]
pub struct Snapshot {
    /// The history (a failed source is `History::unavailable`).
    pub history: Arc<HeldHistory>,
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
    history: Arc<HeldHistory>,
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
        let keep_previous = history.source_error().is_some()
            && previous
                .as_ref()
                .is_some_and(|p| p.history.source_error().is_none());
        *self.last_error.write().unwrap() = history.source_error().map(str::to_string);
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

    /// One pull: an increment written into `held` when it can be, else the whole lookback;
    /// `held` becomes the new history when the pull succeeded.
    async fn pull(
        &self,
        cfg: &DaemonConfig,
        end: DateTime<Utc>,
        held: &mut Option<Held>,
    ) -> (Arc<HeldHistory>, PullKind) {
        let Some(p) = &cfg.history.prometheus else {
            *held = None;
            let h = super::load(&cfg.history, &self.base_dir, end).await;
            return (Arc::new(unavailable_on_error(h).into()), PullKind::Full);
        };
        let settings = settings(cfg);
        let every = cfg.history.full_pull_every.as_secs() as i64;
        let base = held
            .as_ref()
            .filter(|h| h.settings == settings && end.timestamp() - h.full_end < every);
        if let Some((full_end, ring)) =
            base.and_then(|b| b.history.ring().map(|r| (b.full_end, r.clone())))
        {
            match increment(p, &cfg.history, end, ring).await {
                Some(Ok(r)) => {
                    let m = Arc::new(HeldHistory::from(r));
                    *held = Some(Held {
                        history: m.clone(),
                        settings,
                        full_end,
                    });
                    return (m, PullKind::Incremental);
                }
                Some(Err(e)) => {
                    if let HistoryError::Disk(_) = e {
                        // The held history stays (restored) unless it could not be: then
                        // the next pull is a full one.
                        tracing::error!(error = %e, "history increment failed");
                        let ring = held.as_ref().and_then(|h| h.history.ring());
                        if ring.is_none_or(RingHistory::broken) {
                            *held = None;
                        }
                    } else {
                        // The held history stays: the next pull tries from it again.
                        tracing::error!(error = %e, "history source failed");
                    }
                    return (
                        Arc::new(History::unavailable(e.to_string()).into()),
                        PullKind::Incremental,
                    );
                }
                None => tracing::info!(
                    "the increment does not continue the held history: pulling the whole lookback"
                ),
            }
        }
        let h: HeldHistory = match self.pull_whole(p, &cfg.history, end, every).await {
            Ok(r) => r.into(),
            Err(e) => {
                tracing::error!(error = %e, "history source failed");
                History::unavailable(e.to_string()).into()
            }
        };
        if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
            eprintln!("history: {} series", h.series_count());
        }
        let h = Arc::new(h);
        if h.source_error().is_none() {
            *held = Some(Held {
                history: h.clone(),
                settings,
                full_end: end.timestamp(),
            });
        }
        (h, PullKind::Full)
    }

    /// Pulls the whole lookback ending at `end`, spilled as it streams in, into a new ring
    /// with room for the increments of `every` seconds (`history.full_pull_every`).
    async fn pull_whole(
        &self,
        p: &PrometheusConfig,
        h: &HistoryConfig,
        end: DateTime<Utc>,
        every: i64,
    ) -> Result<RingHistory, HistoryError> {
        let dir = p
            .spill_dir
            .as_ref()
            .map(|d| self.base_dir.join(d))
            .unwrap_or_else(std::env::temp_dir);
        let spilled = super::prometheus::load_spilled(p, h, end, &dir).await?;
        let cap = super::ring::capacity(spilled.len, spilled.step, every);
        let t = std::time::Instant::now();
        let r = tokio::task::spawn_blocking(move || RingHistory::from_spilled(&spilled, &dir, cap))
            .await
            .unwrap_or_else(|source| {
                Err(DiskError::Panicked {
                    writing: "the held history",
                    source,
                })
            })?;
        tracing::info!(
            series = r.series_count(),
            bytes = r.bytes(),
            seconds = %format_args!("{:.2}", t.elapsed().as_secs_f64()),
            path = %r.path().display(),
            "history held on disk"
        );
        Ok(r)
    }
}

/// Pulls the minutes since the end of the held `ring` and an overlap, and writes them into it
/// in place ([`RingHistory::apply`]): the new view; `None` when they do not continue it; an
/// error when the pull failed, or the write ([`HistoryError::Disk`]).
async fn increment(
    p: &PrometheusConfig,
    h: &HistoryConfig,
    end: DateTime<Utc>,
    ring: RingHistory,
) -> Option<Result<RingHistory, HistoryError>> {
    let (start, step, len) = (ring.start, ring.step, ring.len);
    let since = (start + len as i64 * step)
        - super::incremental::OVERLAP_SECS.div_euclid(step).max(1) * step;
    let t = std::time::Instant::now();
    let tail = match super::prometheus::load_tail(p, h, end, since).await {
        Ok(tail) => tail,
        Err(e) => return Some(Err(e)),
    };
    let pulled = t.elapsed().as_secs_f64();
    let grid = tail.grid;
    let t = std::time::Instant::now();
    let written = tokio::task::spawn_blocking(move || ring.apply(tail.history, grid))
        .await
        .unwrap_or_else(|source| {
            Some(Err(DiskError::Panicked {
                writing: "the increment",
                source,
            }))
        });
    if let Some(Ok(r)) = &written {
        tracing::info!(
            series = r.series_count(),
            pull_seconds = %format_args!("{pulled:.2}"),
            write_seconds = %format_args!("{:.2}", t.elapsed().as_secs_f64()),
            "history increment written"
        );
    }
    written.map(|w| w.map_err(HistoryError::from))
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
