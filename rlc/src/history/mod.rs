//! RPS history: one regular series per (service, caller, procedure) over the lookback, from a
//! Prometheus-compatible API ([`prometheus`]) or a file ([`file`](mod@file)), plus a deterministic
//! generator for the quickstart ([`synth`]).
//!
//! Missing samples stay missing (`NaN` in [`RateSeries`]), never zero. Series that cannot be
//! used (missing labels, non-finite values) are listed in [`History::rejected`] with a reason.

mod error;
pub mod file;
#[cfg(test)]
pub(crate) mod fixtures;
mod http;
pub mod incremental;
pub mod prometheus;
pub mod remote_read;
pub mod ring;
pub mod snapshot;
pub mod spill;
pub mod synth;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::path::Path;
use std::sync::Arc;

use chrono::{DateTime, Utc};
pub use error::{
    Bound, Corrupt, CsvError, DecodeError, DecoderFailed, DiskError, HistoryError, ParseError,
    RequestFailure, Unreadable, Unrestored,
};
use policies::RateSeries;
use rlc_plan::history::{History, Rejected, SeriesKey, SeriesSource};
use schema::{HistoryConfig, LabelNames};
pub use spill::SpilledHistory;
use spill::{merge_max, SpillState, SpillWriter};

/// Whether a pull read the whole lookback or only its newest minutes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PullKind {
    /// The whole lookback.
    Full,
    /// The minutes since the previous pull (and an overlap), merged into the held history
    /// ([`incremental::merge`]).
    Incremental,
}

impl PullKind {
    /// `full` or `incremental` (the `kind` of logs and metrics).
    pub fn as_str(self) -> &'static str {
        match self {
            PullKind::Full => "full",
            PullKind::Incremental => "incremental",
        }
    }
}

impl std::fmt::Display for PullKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What one pull read, for its log line and metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PullStats {
    /// How the series were read: `query_range`, `remote_read` or `file`.
    pub api: &'static str,
    /// Whole lookback or increment.
    pub kind: PullKind,
    /// Series the pull took (rejected ones not counted).
    pub series: usize,
    /// Samples put on the grid.
    pub points: u64,
    /// Bytes read (answers over the network, or the file).
    pub bytes: u64,
    /// Unix time of the first and last grid point pulled.
    pub from: i64,
    /// See `from`.
    pub to: i64,
}

/// Logs a finished pull at info, its fields as text, and counts it in the metrics.
pub(crate) fn log_pull(s: &PullStats, seconds: f64) {
    let t = |ts: i64| {
        DateTime::<Utc>::from_timestamp(ts, 0).map_or_else(
            || ts.to_string(),
            |d| d.format("%Y-%m-%dT%H:%M:%SZ").to_string(),
        )
    };
    tracing::info!(
        kind = %s.kind,
        api = %s.api,
        series = s.series,
        points = s.points,
        bytes = s.bytes,
        seconds = %format_args!("{seconds:.2}"),
        from = %t(s.from),
        to = %t(s.to),
        "history pulled"
    );
    pulls_by_kind()
        .get_or_create(&KindLabel {
            kind: s.kind.as_str(),
        })
        .inc();
    pulled_points()
        .get_or_create(&KindLabel {
            kind: s.kind.as_str(),
        })
        .inc_by(s.points);
}

/// The label of the per-kind pull metrics.
#[derive(Debug, Clone, PartialEq, Eq, Hash, prometheus_client::encoding::EncodeLabelSet)]
pub struct KindLabel {
    /// `full` or `incremental`.
    pub kind: &'static str,
}

type KindCounters = prometheus_client::metrics::family::Family<
    KindLabel,
    prometheus_client::metrics::counter::Counter,
>;

/// Successful history pulls by kind (`rlc_history_pulls_by_kind_total{kind}`).
pub fn pulls_by_kind() -> &'static KindCounters {
    static F: std::sync::OnceLock<KindCounters> = std::sync::OnceLock::new();
    F.get_or_init(Default::default)
}

/// Samples taken by history pulls, by kind (`rlc_history_pulled_points_total{kind}`).
pub fn pulled_points() -> &'static KindCounters {
    static F: std::sync::OnceLock<KindCounters> = std::sync::OnceLock::new();
    F.get_or_init(Default::default)
}

/// The labels of one series take at most this many bytes in an answer (Prometheus sets no
/// limit of its own; a series' labels rarely take 1 KB).
pub const LABELS_MAX: usize = 64 << 10;

/// What a request of a pull asked for, for errors: the API and the time range.
pub(crate) fn request_range(api: &str, from: i64, to: i64) -> String {
    let t = |s: i64| {
        DateTime::<Utc>::from_timestamp(s, 0).map_or_else(
            || s.to_string(),
            |d| d.format("%Y-%m-%dT%H:%M:%SZ").to_string(),
        )
    };
    format!("{api} [{}, {}]", t(from), t(to))
}

/// Loads the configured history ending at `end` (rounded down to the step). Relative file
/// paths are taken from `base_dir` (the directory of `rlc.yaml`).
///
/// A file source is anchored at its own last sample instead of `end` when that is earlier, so
/// a saved history (quickstart, tests) keeps working later; the grid length is the lookback.
pub async fn load(
    cfg: &HistoryConfig,
    base_dir: &Path,
    end: DateTime<Utc>,
) -> Result<History, HistoryError> {
    if let Some(p) = &cfg.prometheus {
        prometheus::load(p, cfg, end).await
    } else if let Some(f) = &cfg.file {
        let path = base_dir.join(f);
        let cfg = cfg.clone();
        let began = std::time::Instant::now();
        let h = tokio::task::spawn_blocking(move || {
            let h = file::load(&path, &cfg, end)?;
            let bytes = std::fs::metadata(&path).map_or(0, |m| m.len());
            Ok::<_, HistoryError>((h, bytes))
        })
        .await
        .map_err(|e| HistoryError::Parse {
            what: "history file".into(),
            source: ParseError::Task(e),
        })?;
        let (h, bytes) = h?;
        let stats = PullStats {
            api: "file",
            kind: PullKind::Full,
            series: h.series.len(),
            points: h
                .series
                .values()
                .map(|s| s.values.iter().filter(|v| !v.is_nan()).count() as u64)
                .sum(),
            bytes,
            from: h.start,
            to: h.end() - h.step,
        };
        log_pull(&stats, began.elapsed().as_secs_f64());
        Ok(h)
    } else {
        Err(HistoryError::NoSource)
    }
}

/// Pulls history, turning a source failure into a history that keeps every quota.
pub async fn load_or_unavailable(cfg: &schema::DaemonConfig, base: &Path) -> History {
    let terminal = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let h = match load(&cfg.history, base, chrono::Utc::now()).await {
        Ok(h) => h,
        Err(e) => {
            tracing::error!(error = %e, "history source failed");
            History::unavailable(e.to_string())
        }
    };
    if terminal {
        eprintln!("history: {} series", h.series.len());
    }
    h
}

/// [`load_or_unavailable`] for a plan ([`load_for_plan`]): a Prometheus pull is spilled to
/// disk and the plan computed service by service, so memory stays bounded by the largest
/// service. What `rlc preview` and `rlc run` (without `rlc serve`'s snapshot) compute from.
pub async fn load_plan_or_unavailable(cfg: &schema::DaemonConfig, base: &Path) -> PlanHistory {
    let h = match load_for_plan(&cfg.history, base, chrono::Utc::now()).await {
        Ok(h) => h,
        Err(e) => {
            tracing::error!(error = %e, "history source failed");
            History::unavailable(e.to_string()).into()
        }
    };
    if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        eprintln!("history: {} series", h.series_count());
    }
    h
}

/// Lengths of the history pulls of this process's plans (`rlc_history_pull_duration_seconds`
/// on `rlc serve`'s `/metrics`): one histogram per process.
pub fn pull_seconds() -> &'static prometheus_client::metrics::histogram::Histogram {
    static H: std::sync::OnceLock<prometheus_client::metrics::histogram::Histogram> =
        std::sync::OnceLock::new();
    H.get_or_init(|| {
        prometheus_client::metrics::histogram::Histogram::new(grl_client::metrics::RUN_BUCKETS)
    })
}

/// History pulls of this process (`rlc_history_pulls_total`): runs and the quota API's
/// snapshot together.
pub fn pulls() -> &'static prometheus_client::metrics::counter::Counter {
    static C: std::sync::OnceLock<prometheus_client::metrics::counter::Counter> =
        std::sync::OnceLock::new();
    C.get_or_init(Default::default)
}

/// A history to compute a plan from: whole in memory, or spilled to disk and read service by
/// service (`rlc_plan::compute::compute_plan_from`).
#[derive(Debug, Clone)]
pub enum PlanHistory {
    /// Every series in memory.
    Whole(Arc<History>),
    /// Series on disk, one service in memory at a time.
    Spilled(Arc<SpilledHistory>),
    /// `rlc serve`'s held history (in memory, or on disk read service by service).
    Held(Arc<snapshot::HeldHistory>),
}

impl From<Arc<snapshot::HeldHistory>> for PlanHistory {
    fn from(h: Arc<snapshot::HeldHistory>) -> Self {
        PlanHistory::Held(h)
    }
}

impl From<Arc<History>> for PlanHistory {
    fn from(h: Arc<History>) -> Self {
        PlanHistory::Whole(h)
    }
}

impl From<History> for PlanHistory {
    fn from(h: History) -> Self {
        PlanHistory::Whole(Arc::new(h))
    }
}

impl PlanHistory {
    /// Series in the history.
    pub fn series_count(&self) -> usize {
        match self {
            PlanHistory::Whole(h) => h.series.len(),
            PlanHistory::Spilled(s) => s.series_count(),
            PlanHistory::Held(h) => h.series_count(),
        }
    }
}

/// [`load`] for computing a plan: a Prometheus pull is spilled to a temporary file under
/// `history.prometheus.spill_dir` (or the system's temporary directory) as it streams in, so
/// that neither the pull nor the plan holds the fleet's series in memory; a file source is
/// read whole (it is in memory as text anyway).
pub async fn load_for_plan(
    cfg: &HistoryConfig,
    base_dir: &Path,
    end: DateTime<Utc>,
) -> Result<PlanHistory, HistoryError> {
    match &cfg.prometheus {
        Some(p) => {
            let dir = p
                .spill_dir
                .as_ref()
                .map(|d| base_dir.join(d))
                .unwrap_or_else(std::env::temp_dir);
            prometheus::load_spilled(p, cfg, end, &dir)
                .await
                .map(|s| PlanHistory::Spilled(Arc::new(s)))
        }
        None => load(cfg, base_dir, end).await.map(PlanHistory::from),
    }
}

/// The grid `[start, end)` for a lookback ending at `end`.
pub(crate) fn grid(cfg: &HistoryConfig, end: i64) -> (i64, i64, usize) {
    let step = cfg.step.as_secs().max(1) as i64;
    let end = end.div_euclid(step) * step;
    let len = (cfg.lookback.as_secs() as i64 / step).max(1) as usize;
    (end - len as i64 * step, step, len)
}

/// Accumulates samples from any source onto the grid.
pub(crate) struct Builder {
    start: i64,
    step: i64,
    len: usize,
    labels: LabelNames,
    series: HashMap<SeriesKey, RateSeries>,
    /// Set when the series go to disk instead of `series`.
    spill: Option<SpillState>,
    bad: HashMap<SeriesKey, String>,
    rejected: Vec<Rejected>,
    /// The in-range samples `(grid step, value)` of the series being added.
    scratch: Vec<(usize, f32)>,
    /// The label set each key was first seen with: another label set with the same key is a
    /// series the labels rlc reads cannot tell apart.
    first_labels: HashMap<SeriesKey, FirstLabels>,
    /// Keys seen with several label sets, and the labels those differ in.
    merged: BTreeMap<SeriesKey, std::collections::BTreeSet<String>>,
    /// Distinct label sets the builder takes at most ([`Builder::bounded`]).
    max_series: usize,
    /// Hashes of the label sets seen (a few bytes per series, whatever its labels).
    label_sets: HashSet<u64>,
    /// Runs one key may have in the spill: one per request and attempt of the pull.
    max_runs: usize,
    /// The first bound crossed; nothing is added after it.
    exceeded: Option<Bound>,
    /// Hashes of the entries of `rejected`, so that a repeated one is found in constant time.
    rejected_seen: HashSet<u64>,
    /// Samples put on the grid (or in the spill), for the pull's log line.
    points: u64,
}

/// A rejected series' label set is cut to this much in its reason: what is kept per rejected
/// series stays small whatever the answer's labels.
const REJECTED_LABELS_MAX: usize = 512;
/// Label names kept per key that several label sets map to.
const MERGED_NAMES_MAX: usize = 16;
/// The first label set of a key is kept as text up to this size, for naming the labels a
/// second set differs in; a longer one is kept as its hash only.
const FIRST_LABELS_MAX: usize = 1024;

/// The label set a key was first seen with, kept small whatever the answer's labels: its hash,
/// and its text (`name\0value\0…`) when short.
struct FirstLabels {
    hash: u64,
    text: Option<Box<str>>,
}

impl FirstLabels {
    fn of(metric: &BTreeMap<String, String>, hash: u64) -> FirstLabels {
        let len: usize = metric.iter().map(|(k, v)| k.len() + v.len() + 2).sum();
        let text = (len <= FIRST_LABELS_MAX).then(|| {
            let mut t = String::with_capacity(len);
            for (k, v) in metric {
                t.push_str(k);
                t.push('\0');
                t.push_str(v);
                t.push('\0');
            }
            t.into_boxed_str()
        });
        FirstLabels { hash, text }
    }

    /// The names of the labels `metric` differs in from this set.
    fn differing(&self, metric: &BTreeMap<String, String>) -> Vec<String> {
        let Some(text) = &self.text else {
            return vec![format!(
                "(the first one's labels, over {FIRST_LABELS_MAX} bytes)"
            )];
        };
        let mut parts = text.split('\0');
        let mut first = BTreeMap::new();
        while let (Some(k), Some(v)) = (parts.next(), parts.next()) {
            first.insert(k, v);
        }
        let mut names: Vec<String> = first
            .iter()
            .filter(|(k, v)| metric.get(**k).map(String::as_str) != Some(**v))
            .map(|(k, _)| k.to_string())
            .collect();
        names.extend(
            metric
                .keys()
                .filter(|k| !first.contains_key(k.as_str()))
                .cloned(),
        );
        names
    }
}

impl Builder {
    pub(crate) fn new(start: i64, step: i64, len: usize, labels: LabelNames) -> Self {
        Self {
            start,
            step,
            len,
            labels,
            series: HashMap::new(),
            spill: None,
            bad: HashMap::new(),
            rejected: Vec::new(),
            scratch: Vec::new(),
            first_labels: HashMap::new(),
            merged: BTreeMap::new(),
            max_series: usize::MAX,
            label_sets: HashSet::new(),
            max_runs: usize::MAX,
            exceeded: None,
            rejected_seen: HashSet::new(),
            points: 0,
        }
    }

    /// Samples taken so far (on the grid or in the spill).
    pub(crate) fn points(&self) -> u64 {
        self.points
    }

    /// Series held so far (on the grid or in the spill's index).
    pub(crate) fn series_count(&self) -> usize {
        match &self.spill {
            Some(sp) => sp.index.len(),
            None => self.series.len(),
        }
    }

    /// The builder of a pull: at most `max_series` series (distinct label sets, rejected ones
    /// included), and in the spill at most `max_runs` runs per key (one per request and attempt). Past a
    /// bound nothing more is added and [`Builder::exceeded`] says which.
    pub(crate) fn bounded(mut self, max_series: usize, max_runs: usize) -> Self {
        self.max_series = max_series;
        self.max_runs = max_runs;
        self
    }

    /// The first bound crossed, if any: the pull must fail.
    pub(crate) fn exceeded(&self) -> Option<&Bound> {
        self.exceeded.as_ref()
    }

    /// Counts the label set `metric`; `false` (the bound recorded) when it is one more than
    /// `max_series`. Each series costs memory (its key, its first labels, its index or grid),
    /// so a pull must not take series without end.
    fn count(&mut self, metric: &BTreeMap<String, String>) -> Option<u64> {
        let mut h = std::hash::DefaultHasher::new();
        metric.hash(&mut h);
        let id = h.finish();
        if self.label_sets.contains(&id) {
            return Some(id);
        }
        if self.label_sets.len() >= self.max_series {
            self.exceeded
                .get_or_insert(Bound::Series(self.max_series as u64));
            return None;
        }
        self.label_sets.insert(id);
        Some(id)
    }

    /// A builder writing the series to a new spill file under `dir`
    /// ([`Builder::finish_spilled`]).
    pub(crate) fn spilled(
        start: i64,
        step: i64,
        len: usize,
        labels: LabelNames,
        dir: &Path,
    ) -> Result<Self, HistoryError> {
        let writer = SpillWriter::create(dir).map_err(|source| HistoryError::Spill {
            path: dir.to_path_buf(),
            source,
        })?;
        tracing::debug!(dir = %writer.dir().display(), "spilling the history pull");
        Ok(Self {
            spill: Some(SpillState::new(writer)),
            ..Self::new(start, step, len, labels)
        })
    }

    /// The key for a label set, or `None` (recorded as rejected) when labels are missing.
    pub(crate) fn key(&mut self, metric: &BTreeMap<String, String>) -> Option<SeriesKey> {
        if self.exceeded.is_some() {
            return None;
        }
        let id = self.count(metric)?;
        let get = |n: &str| metric.get(n).filter(|v| !v.is_empty()).cloned();
        let (service, caller, procedure) = (
            get(&self.labels.service),
            get(&self.labels.caller),
            get(&self.labels.procedure),
        );
        let reason = match (&service, &caller, &procedure) {
            (None, _, _) => Some(format!(
                "series without a `{}` label: {}",
                self.labels.service,
                shorten(format!("{metric:?}"), REJECTED_LABELS_MAX)
            )),
            (Some(_), None, None) => Some(format!(
                "series without a `{}` or `{}` label",
                self.labels.caller, self.labels.procedure
            )),
            _ => [
                (&self.labels.service, &service),
                (&self.labels.caller, &caller),
                (&self.labels.procedure, &procedure),
            ]
            .into_iter()
            .find_map(|(label, v)| {
                v.as_deref().filter(|v| !valid_name(v)).map(|v| {
                    format!(
                        "label `{label}` value `{}` is not a valid name (letters, digits, `.`, `_`, `-`, `:`; at most 128)",
                        shorten(v.to_string(), REJECTED_LABELS_MAX)
                    )
                })
            }),
        };
        if let Some(reason) = reason {
            let r = Rejected {
                service,
                caller,
                procedure,
                reason,
                fails_service: false,
            };
            let mut h = std::hash::DefaultHasher::new();
            (&r.service, &r.caller, &r.procedure, &r.reason).hash(&mut h);
            if self.rejected_seen.insert(h.finish()) {
                self.rejected.push(r);
            }
            return None;
        }
        let key = SeriesKey {
            service: service.unwrap(),
            caller,
            procedure,
        };
        match self.first_labels.get(&key) {
            None => {
                self.first_labels
                    .insert(key.clone(), FirstLabels::of(metric, id));
            }
            Some(first) if first.hash != id => {
                let differ = first.differing(metric);
                let names = self.merged.entry(key.clone()).or_default();
                // The names are for the message: a few tell what to aggregate by.
                for k in differ {
                    if names.len() >= MERGED_NAMES_MAX {
                        break;
                    }
                    names.insert(shorten(k, 128));
                }
            }
            Some(_) => {}
        }
        Some(key)
    }

    /// Adds samples of one series (one map lookup for all of them); a `NaN`, infinite or
    /// negative value marks the whole series unusable.
    pub(crate) fn add_many(&mut self, key: &SeriesKey, samples: impl Iterator<Item = (f64, f64)>) {
        if self.bad.contains_key(key) || self.exceeded.is_some() {
            return;
        }
        if self.spill.is_some() && self.merged.contains_key(key) {
            // Several label sets map to this key: its service keeps its quotas whatever its
            // values, so its runs (one per label set and request) are not written.
            return;
        }
        let (start, step, len) = (self.start, self.step, self.len);
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.clear();
        for (ts, value) in samples {
            if !value.is_finite() || value < 0.0 {
                self.series.remove(key);
                if let Some(sp) = &mut self.spill {
                    sp.index.remove(key);
                }
                self.bad.insert(
                    key.clone(),
                    format!("non-finite or negative value {value} at {ts}"),
                );
                self.scratch = scratch;
                return;
            }
            let i = ((ts - start as f64) / step as f64).round();
            if i >= 0.0 && i < len as f64 {
                scratch.push((i as usize, value as f32));
            }
        }
        self.points += scratch.len() as u64;
        match &mut self.spill {
            Some(sp) => {
                if !sp.add(key, &scratch, self.max_runs) {
                    self.exceeded.get_or_insert(Bound::Repeated {
                        series: [
                            Some(key.service.as_str()),
                            key.caller.as_deref(),
                            key.procedure.as_deref(),
                        ]
                        .into_iter()
                        .flatten()
                        .collect::<Vec<_>>()
                        .join("/"),
                        max: self.max_runs,
                    });
                }
            }
            None => {
                if !self.series.contains_key(key) {
                    self.series
                        .insert(key.clone(), RateSeries::empty(start, step, len));
                }
                let s = self.series.get_mut(key).expect("inserted above");
                // Several samples in one step (a file finer than the step): keep the peak.
                for &(i, x) in &scratch {
                    merge_max(&mut s.values[i], x);
                }
            }
        }
        self.scratch = scratch;
    }

    /// The rejected series, bad values included, in order.
    fn all_rejected(&mut self) -> Vec<Rejected> {
        let mut rejected = std::mem::take(&mut self.rejected);
        for (k, reason) in self.bad.drain() {
            rejected.push(Rejected {
                service: Some(k.service),
                caller: k.caller,
                procedure: k.procedure,
                reason,
                fails_service: false,
            });
        }
        // Several series for one (service, caller, procedure): merging them (by max, or by
        // sum) would compute a quota from one instance, or count a series twice. The rule:
        // such a service keeps its quotas, named with the labels the series differ in, until
        // the query aggregates them (`sum by (service, caller, procedure)`).
        for (k, labels) in std::mem::take(&mut self.merged) {
            let labels: Vec<String> = labels.into_iter().map(|l| format!("`{l}`")).collect();
            rejected.push(Rejected {
                reason: format!(
                    "several series map to {}: they differ in {}; aggregate them in the query (`sum by ({}, {}, {})`)",
                    [Some(k.service.as_str()), k.caller.as_deref(), k.procedure.as_deref()]
                        .into_iter()
                        .flatten()
                        .collect::<Vec<_>>()
                        .join("/"),
                    labels.join(", "),
                    self.labels.service,
                    self.labels.caller,
                    self.labels.procedure
                ),
                service: Some(k.service),
                caller: k.caller,
                procedure: k.procedure,
                fails_service: true,
            });
        }
        rejected.sort_by(|a, b| {
            (&a.service, &a.caller, &a.procedure, &a.reason).cmp(&(
                &b.service,
                &b.caller,
                &b.procedure,
                &b.reason,
            ))
        });
        rejected
    }

    /// The spilled history ([`Builder::spilled`]); an error when a write to the spill failed.
    pub(crate) fn finish_spilled(mut self) -> Result<SpilledHistory, HistoryError> {
        let rejected = self.all_rejected();
        let Some(sp) = self.spill.take() else {
            return Err(HistoryError::Parse {
                what: "history".into(),
                source: ParseError::NotSpilled,
            });
        };
        let index = sp.index.into_iter().collect();
        sp.writer
            .finish((self.start, self.step, self.len), index, rejected)
            .map_err(|(path, source)| HistoryError::Spill { path, source })
    }

    pub(crate) fn finish(mut self) -> History {
        let rejected = self.all_rejected();
        History {
            start: self.start,
            step: self.step,
            len: self.len,
            series: self.series.into_iter().collect(),
            rejected,
            source_error: None,
        }
    }
}

/// `text` cut to at most `max` bytes (at a character boundary), marked with `…` when cut.
fn shorten(mut text: String, max: usize) -> String {
    if text.len() > max {
        let mut end = max;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push('…');
    }
    text
}

/// Whether a label value can name a service, caller or procedure: it becomes a file name
/// (`buckets/<service>.yaml`) and part of a bucket name, so no path separators or spaces.
pub fn valid_name(v: &str) -> bool {
    !v.is_empty()
        && v.len() <= 128
        && !v.starts_with('.')
        && v.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | ':'))
}

impl SeriesSource for PlanHistory {
    fn services(&self) -> Vec<String> {
        match self {
            PlanHistory::Whole(h) => h.services(),
            PlanHistory::Spilled(s) => s.services(),
            PlanHistory::Held(h) => h.services(),
        }
    }

    fn rejected(&self) -> &[Rejected] {
        match self {
            PlanHistory::Whole(h) => &h.rejected,
            PlanHistory::Spilled(s) => &s.rejected,
            PlanHistory::Held(h) => SeriesSource::rejected(&**h),
        }
    }

    fn source_error(&self) -> Option<&str> {
        match self {
            PlanHistory::Whole(h) => h.source_error.as_deref(),
            PlanHistory::Spilled(_) => None,
            PlanHistory::Held(h) => SeriesSource::source_error(&**h),
        }
    }

    fn service(
        &self,
        service: &str,
    ) -> Result<std::borrow::Cow<'_, History>, rlc_plan::history::Unreadable> {
        match self {
            PlanHistory::Whole(h) => Ok(std::borrow::Cow::Borrowed(h)),
            PlanHistory::Spilled(s) => s
                .service(service)
                .map(std::borrow::Cow::Owned)
                .map_err(rlc_plan::history::Unreadable::from),
            PlanHistory::Held(h) => SeriesSource::service(&**h, service),
        }
    }
}

#[cfg(test)]
mod tests;
