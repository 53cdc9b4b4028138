//! Reading the world once, before planning: the config repo's base (its documents and the
//! bucket files in force) and its history of decreases from the working copy as last fetched,
//! the store's applied decreases, and the shadow figures of promotion candidates. What is read
//! here is what [`rlc_plan::pipeline`] decides on; nothing is read again while planning, so one
//! run (or one preview) sees one state of the world.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use chrono::{DateTime, Utc};
use rlc_plan::censor::Observed;
use rlc_plan::guard::{self, Decreases, Witness};
use rlc_plan::pipeline::{ShadowEvidence, World};
use rlc_plan::promotion::{self, BucketKey};
use rlc_plan::readiness::ShadowStats;
use schema::{ConfigRepo, DaemonConfig};

use crate::gitops::writer::DECREASE_HISTORY_MAX_COMMITS;
use crate::gitops::{Writer, WriterConfig};
use crate::shadow::{ShadowQuery, ShadowSource};
use crate::store::Store;

/// The config repo's base branch as read after the one fetch.
#[derive(Debug, Clone)]
pub struct Base {
    /// The base branch's tip.
    pub commit: String,
    /// The config repo at that tip, loaded and valid.
    pub repo: Arc<ConfigRepo>,
    /// When each bucket was last lowered on the base branch within `rails.decrease_interval`.
    pub decreases: Witness,
    /// The digest of the base's `rlc/*.yaml` ([`crate::gitops::Writer::inputs_hash`]): the
    /// inputs an aborted rollout's fingerprint names.
    pub inputs: String,
}

/// Why the base could not be read.
#[derive(Debug, thiserror::Error)]
pub enum BaseError {
    /// git failed (the remote, the working copy, the branch).
    #[error(transparent)]
    Git(#[from] crate::gitops::GitOpsError),
    /// The config repo at the base tip has problems: nothing is planned on top of it.
    #[error("the config repo at {commit} has problems:\n{problems}")]
    Invalid {
        /// The base tip.
        commit: String,
        /// Every problem, as `rlc validate` prints them.
        problems: schema::Diagnostics,
    },
}

/// Reads the base from `w`'s refs as last fetched (no network): the tip, the config repo at
/// it (from `dir`, where the tip's files are: the working copy after a sync, or an export),
/// and the decreases on its history within `rails.decrease_interval` before `now`, for every
/// service of the repo. Blocking (git and files).
pub fn read_base(
    w: &Writer,
    dir: &Path,
    cfg: &DaemonConfig,
    now: DateTime<Utc>,
) -> Result<Base, BaseError> {
    let commit = w.base_tip()?;
    let (repo, diags) = ConfigRepo::load(dir);
    if !diags.is_empty() {
        return Err(BaseError::Invalid {
            commit: crate::gitops::short(&commit).to_string(),
            problems: schema::Diagnostics(diags),
        });
    }
    let services: Vec<String> = repo.buckets.keys().cloned().collect();
    let since = guard::since(cfg.rails.decrease_interval.0, now);
    let decreases =
        match w.decreases_since(&services, since.timestamp(), DECREASE_HISTORY_MAX_COMMITS) {
            Ok(found) => Witness::Known(
                found
                    .into_iter()
                    .filter_map(|(k, t)| DateTime::<Utc>::from_timestamp(t, 0).map(|t| (k, t)))
                    .collect(),
            ),
            Err(e) => Witness::Unknown(e.to_string()),
        };
    Ok(Base {
        commit,
        repo: Arc::new(repo),
        decreases,
        inputs: w.inputs_hash().unwrap_or_default(),
    })
}

/// What the store can say about past decreases.
#[derive(Debug, Clone)]
pub enum StoreWitness {
    /// A connected store: its quota history is asked.
    Store(Store),
    /// No store exists yet (a SQLite file a run would create): it has recorded nothing.
    Empty,
    /// The store cannot say (down, deleted, replaced): every decrease is held.
    Unavailable(String),
}

impl From<Result<Store, crate::store::StoreError>> for StoreWitness {
    fn from(r: Result<Store, crate::store::StoreError>) -> StoreWitness {
        match r {
            Ok(s) => StoreWitness::Store(s),
            Err(e) => StoreWitness::Unavailable(e.to_string()),
        }
    }
}

/// Why a store gives no shadow figures: it cannot be read (its error, as
/// [`StoreWitness::Unavailable`] holds it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("store unavailable: {0}")]
pub struct StoreUnavailable(pub String);

impl StoreWitness {
    /// The shadow figures this store gives: its own; none at all for a store that does not
    /// exist yet (nothing is ready); the reason for one that cannot be read.
    pub fn shadow_source(&self) -> Result<ShadowSource, StoreUnavailable> {
        match self {
            StoreWitness::Store(s) => Ok(crate::shadow::store_source(s.clone())),
            StoreWitness::Empty => Ok(Arc::new(|_q: ShadowQuery| {
                Box::pin(async { Ok(BTreeMap::new()) }) as crate::BoxFuture<_>
            })),
            StoreWitness::Unavailable(e) => Err(StoreUnavailable(e.clone())),
        }
    }
}

/// The store of `cfg` for a reader that must write nothing (`rlc preview`): a SQLite file
/// that does not exist is [`StoreWitness::Empty`] (what a run would create), never created.
pub async fn open_store_for_reading(cfg: &DaemonConfig, base_dir: &Path) -> StoreWitness {
    let url = &cfg.database_url;
    if let Some(rest) = url.strip_prefix("sqlite:") {
        let rest = rest.trim_start_matches("//");
        let path = rest.split_once('?').map_or(rest, |(p, _)| p);
        if path != ":memory:" && !path.is_empty() && !base_dir.join(path).exists() {
            return StoreWitness::Empty;
        }
    }
    Store::connect(url, base_dir).await.into()
}

/// The applied decreases the store knows within `rails.decrease_interval` before `now`.
pub async fn store_decreases(
    cfg: &DaemonConfig,
    store: &StoreWitness,
    now: DateTime<Utc>,
) -> Witness {
    if cfg.rails.decrease_interval.0.as_secs() <= 1 {
        return Witness::none();
    }
    let since = guard::since(cfg.rails.decrease_interval.0, now);
    match store {
        StoreWitness::Store(s) => match s.applied_decreases_since(since).await {
            Ok(found) => Witness::Known(found),
            Err(e) => Witness::Unknown(format!("quota history unavailable ({e})")),
        },
        StoreWitness::Empty => Witness::none(),
        StoreWitness::Unavailable(e) => Witness::Unknown(format!("store unavailable ({e})")),
    }
}

/// The shadow figures of `repo`'s promotion candidates ([`promotion::base_candidates`]) from
/// `source`, one query per window length. No candidate: nothing is asked.
pub async fn shadow(
    repo: &ConfigRepo,
    source: impl std::future::Future<Output = Result<ShadowSource, StoreUnavailable>>,
    now: DateTime<Utc>,
) -> ShadowEvidence {
    let candidates = promotion::base_candidates(repo);
    if candidates.is_empty() {
        return ShadowEvidence::Figures(BTreeMap::new());
    }
    let source = match source.await {
        Ok(s) => s,
        Err(e) => return ShadowEvidence::Unavailable(e.to_string()),
    };
    let mut by_window: BTreeMap<chrono::Duration, Vec<BucketKey>> = BTreeMap::new();
    for (key, window) in candidates {
        by_window.entry(window).or_default().push(key);
    }
    let mut out: BTreeMap<BucketKey, ShadowStats> = BTreeMap::new();
    for (window, buckets) in by_window {
        let q = ShadowQuery {
            buckets,
            window_start: now - window,
            now,
        };
        match source(q).await {
            Ok(m) => out.extend(m),
            Err(e) => {
                tracing::warn!(error = %format!("{e:#}"), "shadow figures unavailable: nothing promoted");
                return ShadowEvidence::Unavailable(format!("{e:#}"));
            }
        }
    }
    ShadowEvidence::Figures(out)
}

/// The world of a plan on `base`: its decreases (the repo's history and the store's applied
/// ones) and its candidates' shadow figures (from `shadow_source`).
pub async fn world(
    cfg: &DaemonConfig,
    base: &Base,
    store: &StoreWitness,
    shadow_source: impl std::future::Future<Output = Result<ShadowSource, StoreUnavailable>>,
    now: DateTime<Utc>,
) -> World {
    let decreases = Decreases {
        git: base.decreases.clone(),
        store: store_decreases(cfg, store, now).await,
    };
    World {
        decreases,
        shadow: shadow(&base.repo, shadow_source, now).await,
        observed: observed(cfg, store, now).await,
        aborted: aborted(store).await,
        inputs: base.inputs.clone(),
    }
}

/// The changes whose rollout was aborted (held while their inputs stay the same). A store
/// that cannot answer holds none, with a warning: the rollout of such a change is aborted
/// again by its candidate phase, never enforced unproven.
pub async fn aborted(store: &StoreWitness) -> Vec<rlc_plan::rollout::Aborted> {
    let StoreWitness::Store(s) = store else {
        return Vec::new();
    };
    crate::rollout::aborted_changes(s).await.unwrap_or_else(|e| {
        tracing::warn!(error = %e, "aborted rollouts unavailable: their changes may be proposed again");
        Vec::new()
    })
}

/// Most throttled minute rows read for one plan (a minute of one bucket's scope key; tens of
/// bytes each, a few tens of MB at most).
pub const MAX_THROTTLED_MINUTES: usize = 2_000_000;

/// What the controller observed in the history window: the minutes an enforced bucket refused
/// requests (its reports in the store) and the incident overrides that acted on it, left out
/// of what its policy learns. A store that cannot answer leaves them in, with a warning: the
/// one-off-spike filter still keeps a short storm out, and the raise rails still bound the rest.
pub async fn observed(cfg: &DaemonConfig, store: &StoreWitness, now: DateTime<Utc>) -> Observed {
    let since = guard::since(cfg.history.lookback.0, now);
    let s = match store {
        StoreWitness::Store(s) => s,
        StoreWitness::Empty => return Observed::default(),
        StoreWitness::Unavailable(e) => {
            tracing::warn!(error = %e, "store unavailable: throttled and overridden minutes learned from as demand");
            return Observed::default();
        }
    };
    let throttled = match s.throttled_minutes(since, MAX_THROTTLED_MINUTES).await {
        Ok((found, truncated)) => {
            if truncated {
                tracing::warn!(
                    max = MAX_THROTTLED_MINUTES,
                    "more throttled minutes than read: the newest are learned from as demand"
                );
            }
            found
        }
        Err(e) => {
            tracing::warn!(error = %e, "throttled minutes unavailable: learned from as demand");
            Default::default()
        }
    };
    let overrides = s.override_windows(since).await.unwrap_or_else(|e| {
        tracing::warn!(error = %e, "override windows unavailable: learned from as demand");
        Default::default()
    });
    // Bounded by the store's query timeout: the scan grows with buckets × minutes of the
    // window, and the evidence goes without the headroom rather than the run waiting.
    let peaks = crate::store::within(cfg.store.query_timeout.0, s.critical_peaks(since)).await;
    let critical_peaks = peaks.unwrap_or_else(|e| {
        tracing::warn!(error = %e, "critical demand by tier unavailable: no critical headroom in the evidence");
        Default::default()
    });
    Observed {
        throttled,
        overrides,
        critical_peaks,
    }
}

/// A working copy to read the base from without writing anything where rlc.yaml points: the
/// existing working copy (fetched), or, when there is none yet, a clone in a temporary
/// directory (`rlc preview` writes nothing).
pub struct ReadOnlyCopy {
    /// The writer over it.
    pub writer: Writer,
    /// Where the base tip's files are exported.
    pub export: tempfile::TempDir,
    _clone: Option<tempfile::TempDir>,
}

impl ReadOnlyCopy {
    /// Opens (or clones aside) the working copy of `cfg` (paths resolved against
    /// `base_dir`), fetches once and exports the base tip. Blocking.
    pub fn open(
        cfg: &DaemonConfig,
        base_dir: &Path,
    ) -> Result<ReadOnlyCopy, crate::gitops::GitOpsError> {
        let mut wcfg = WriterConfig::from_config(&cfg.config_repo, base_dir);
        let exists = wcfg.path.join(".git").exists() || wcfg.path.join("HEAD").exists();
        let clone = if !exists && wcfg.url.is_some() {
            let dir = tempfile::Builder::new().prefix("rlc-preview-").tempdir()?;
            wcfg.path = dir.path().join("repo");
            Some(dir)
        } else {
            None
        };
        let writer = Writer::open(wcfg)?;
        if clone.is_none() {
            if let Err(e) = writer.fetch() {
                tracing::warn!(error = %e, "cannot fetch the config repo: reading its base branch as last fetched");
            }
        }
        let export = tempfile::Builder::new().prefix("rlc-base-").tempdir()?;
        writer.export_base(export.path())?;
        Ok(ReadOnlyCopy {
            writer,
            export,
            _clone: clone,
        })
    }

    /// The directory holding the base tip's `rlc/` and `buckets/`.
    pub fn dir(&self) -> PathBuf {
        self.export.path().to_path_buf()
    }
}

/// The base a run would plan on, read without writing anything where rlc.yaml points: the
/// working copy fetched once (a fetch that fails leaves it as last fetched, with a warning),
/// or a clone aside when there is none yet; a config repo that is a plain directory (no git,
/// no URL) is read as it is, and its decreases cannot be told (held). A repo with problems
/// is a configuration error.
pub async fn read_base_aside(
    cfg: &DaemonConfig,
    base_dir: &Path,
    now: DateTime<Utc>,
) -> anyhow::Result<Base> {
    let (cfg, base_dir) = (cfg.clone(), base_dir.to_path_buf());
    tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
        let read = match ReadOnlyCopy::open(&cfg, &base_dir) {
            Ok(copy) => read_base(&copy.writer, &copy.dir(), &cfg, now),
            Err(e @ crate::gitops::GitOpsError::NoRepo(_)) => {
                let dir = Path::new(&cfg.config_repo.path);
                let (repo, diags) = ConfigRepo::load(dir);
                if diags.is_empty() {
                    Ok(Base {
                        commit: String::new(),
                        repo: std::sync::Arc::new(repo),
                        decreases: rlc_plan::guard::Witness::Unknown(e.to_string()),
                        inputs: String::new(),
                    })
                } else {
                    Err(BaseError::Invalid {
                        commit: dir.display().to_string(),
                        problems: schema::Diagnostics(diags),
                    })
                }
            }
            Err(e) => Err(e.into()),
        };
        match read {
            Ok(b) => Ok(b),
            Err(e @ BaseError::Invalid { .. }) => {
                Err(crate::exit::ConfigError(e.to_string()).into())
            }
            Err(e) => Err(e.into()),
        }
    })
    .await?
}
