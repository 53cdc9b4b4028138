//! The read endpoints of the quota preview API (JSON; errors as problem+json):
//!
//! - `GET /v1/quotas[?service=S][&refresh=true]`: every bucket of the latest computed plan
//!   (the plan a run would do now, [`rlc_plan::pipeline::plan`]) in the shape of
//!   `rlc preview --format json`, each bucket extended with `change`, `confidence` and `rail`.
//! - `GET /v1/quotas/{service}[?refresh=true]`: one service, each bucket with `details` (peak
//!   and when, statistic, forecast bound, headroom, capacity share, coverage, capped-from).
//! - `GET /v1/quotas/{service}/{bucket}/history`: the bucket's changes from the store.
//!
//! The plan is computed from the daemon's history snapshot (`crate::snapshot`) against the
//! config repo's base tip as last fetched, and cached until either changes. Concurrency is
//! bounded: a request that finds every slot taken gets 429 with `Retry-After`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock, RwLock};

use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use schema::{ConfigRepo, DaemonConfig};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::dashboard::bucket::BucketPath;
use super::limits::Path as UrlPath;
use super::limits::{ConcurrencyLimit, RETRY_AFTER_SECS};
use super::problem::Problem;
use super::AppState;
use crate::gather::StoreWitness;
use crate::gitops::writer::BaseReadError;
use crate::gitops::{GitOpsError, Writer, WriterConfig};
use crate::history::snapshot::{HistoryCache, Snapshot};
use crate::quota_view::QuotaBucket;
use crate::quota_view::{view, with_rollouts};
use rlc_plan::pipeline::Purpose;
use rlc_plan::plan::{Plan, PlannedBucket, Skipped};
use rlc_plan::whatif::InputProblem;

/// Requests of these endpoints served at once; more get 429.
pub const DEFAULT_CONCURRENCY: usize = 32;
/// Changes returned by the history endpoint at most (the most recent ones).
pub const HISTORY_MAX: i64 = 1000;

/// The quota API's state: the history snapshot, the latest computed plan, the limit.
pub struct Quotas {
    cfg: DaemonConfig,
    base_dir: PathBuf,
    /// The daemon's history snapshot (also refreshed by runs).
    pub cache: Arc<HistoryCache>,
    latest: RwLock<Option<Arc<Computed>>>,
    compute: tokio::sync::Mutex<()>,
    limit: ConcurrencyLimit,
    export: tempfile::TempDir,
    /// The daemon's store, once connected (shadow figures and decreases come from it).
    store: super::StoreSlot,
}

/// One computed plan and what it was computed from.
pub struct Computed {
    snapshot: Arc<Snapshot>,
    base_commit: String,
    computed_at: DateTime<Utc>,
    plan: Plan,
    /// Where each service's buckets are in `plan.buckets` (sorted by service).
    by_service: std::collections::HashMap<String, std::ops::Range<usize>>,
    /// The unfiltered `GET /v1/quotas` body and the last pull error it shows, rendered on
    /// first use and again when a later pull failed (or succeeded) differently.
    all: std::sync::Mutex<Option<(Option<String>, Bytes)>>,
    /// The config repo the plan was computed on.
    repo: Arc<ConfigRepo>,
    /// The evidence it was computed with (what-if previews plan with the same).
    world: rlc_plan::pipeline::World,
    /// What `POST /v1/previews` starts from, made on first use.
    preview: OnceLock<Arc<super::previews::Snapshot>>,
    /// Whether the store could be read when the plan was computed: a plan computed before the
    /// daemon's store was connected (no shadow figures, so nothing promoted) is not kept once
    /// the store is there.
    with_store: bool,
}

impl Quotas {
    /// The API over `cfg` (paths resolved against `base_dir`, the directory of rlc.yaml) and
    /// `cache`, serving at most `concurrency` requests at once.
    pub fn new(
        cfg: DaemonConfig,
        base_dir: &Path,
        cache: Arc<HistoryCache>,
        concurrency: usize,
        store: super::StoreSlot,
    ) -> std::io::Result<Quotas> {
        Ok(Quotas {
            cfg,
            base_dir: base_dir.to_path_buf(),
            cache,
            latest: RwLock::new(None),
            compute: tokio::sync::Mutex::new(()),
            limit: ConcurrencyLimit::new(concurrency, RETRY_AFTER_SECS),
            export: tempfile::Builder::new().prefix("rlc-quotas-").tempdir()?,
            store,
        })
    }

    /// What the store can say now: connected, or not yet.
    fn store_witness(&self) -> StoreWitness {
        match self.store.get() {
            Some(st) => StoreWitness::Store(st),
            None => StoreWitness::Unavailable("not connected yet".into()),
        }
    }

    /// The latest computed plan, if any.
    pub fn latest(&self) -> Option<Arc<Computed>> {
        self.latest.read().unwrap().clone()
    }

    fn writer_config(&self) -> WriterConfig {
        WriterConfig::from_config(&self.cfg.config_repo, &self.base_dir)
    }

    /// The plan for the base tip as last fetched and the latest snapshot: the cached one when
    /// neither changed, else computed (one computation at a time; waiters reuse it).
    async fn current(&self, store: StoreWitness) -> Result<Arc<Computed>, Problem> {
        let tip = self.base_tip().await?;
        let snapshot = self.cache.get().await;
        let with_store = matches!(store, StoreWitness::Store(_));
        let fresh = |c: &Arc<Computed>| {
            c.base_commit == tip
                && c.snapshot.generation == snapshot.generation
                && still_valid(c.with_store, with_store)
        };
        if let Some(c) = self.latest().filter(fresh) {
            return Ok(c);
        }
        let _one = self.compute.lock().await;
        if let Some(c) = self.latest().filter(fresh) {
            return Ok(c);
        }
        let now = Utc::now();
        let base = self.load_base(now).await?;
        let world = crate::gather::world(
            &self.cfg,
            &base,
            &store,
            async { store.shadow_source() },
            now,
        )
        .await;
        let (cfg, repo, history, w) = (
            self.cfg.clone(),
            base.repo.clone(),
            snapshot.history.clone(),
            world.clone(),
        );
        let plan = tokio::task::spawn_blocking(move || {
            rlc_plan::pipeline::plan(&cfg, &repo, history.as_ref(), &w, now, Purpose::Run)
        })
        .await
        .map_err(|e| Problem::new(StatusCode::SERVICE_UNAVAILABLE, format!("{e:#}")))?;
        let (commit, repo) = (base.commit, base.repo);
        let mut by_service: std::collections::HashMap<String, std::ops::Range<usize>> =
            Default::default();
        for (i, b) in plan.buckets.iter().enumerate() {
            by_service
                .entry(b.service.clone())
                .and_modify(|r| r.end = i + 1)
                .or_insert(i..i + 1);
        }
        let c = Arc::new(Computed {
            snapshot,
            base_commit: commit,
            computed_at: Utc::now(),
            plan,
            by_service,
            all: std::sync::Mutex::new(None),
            repo,
            world,
            preview: OnceLock::new(),
            with_store,
        });
        *self.latest.write().unwrap() = Some(c.clone());
        Ok(c)
    }

    /// What-if previews (`POST /v1/previews`) on the same plan, snapshot and evidence as this
    /// API: the what-if plan is computed as the current one is, with other documents.
    pub fn previews(self: &Arc<Self>) -> super::previews::Previews {
        let q = self.clone();
        let snapshot: super::previews::SnapshotFn = Arc::new(move || {
            let q = q.clone();
            Box::pin(async move {
                let c = q.current(q.store_witness()).await?;
                Ok(c.preview
                    .get_or_init(|| {
                        Arc::new(super::previews::Snapshot {
                            inputs: rlc_plan::whatif::Inputs {
                                cfg: q.cfg.clone(),
                                repo: (*c.repo).clone(),
                                world: c.world.clone(),
                            },
                            history: c.snapshot.history.clone(),
                            current: c.plan.clone(),
                        })
                    })
                    .clone())
            })
        });
        super::previews::Previews::new(snapshot)
    }

    /// `rlc/policies.yaml` of the base tip as last fetched (no network): `Ok(None)` without
    /// the file, an error when the working copy cannot be read.
    pub async fn base_policies(&self) -> Result<Option<schema::PoliciesFile>, BaseReadError> {
        let wcfg = self.writer_config();
        Ok(
            tokio::task::spawn_blocking(move || Writer::open_existing(wcfg)?.base_policies())
                .await??,
        )
    }

    /// The bucket files of the base tip as last fetched (no network) with its commit: what the
    /// controller should run. The dashboard lists every bucket from it.
    pub async fn base_buckets(&self) -> Result<(String, Vec<schema::BucketFile>), BaseReadError> {
        let wcfg = self.writer_config();
        Ok(
            tokio::task::spawn_blocking(move || Writer::open_existing(wcfg)?.base_buckets())
                .await??,
        )
    }

    async fn base_tip(&self) -> Result<String, Problem> {
        let wcfg = self.writer_config();
        tokio::task::spawn_blocking(move || Writer::open_existing(wcfg)?.base_tip())
            .await
            .map_err(|e| unavailable(format!("reading the config repo: {e}")))?
            .map_err(|e| {
                unavailable(format!(
                    "the config repo is not synced yet ({e}); try again after the first poll"
                ))
            })
    }

    /// The base tip's config repo, exported next to (never inside) the working copy the
    /// scheduler owns, and read as a run reads it ([`crate::gather::read_base`]: the config
    /// repo, its decreases) from the refs as last fetched (no network). A tip with problems
    /// answers 503 listing them.
    async fn load_base(&self, now: DateTime<Utc>) -> Result<crate::gather::Base, Problem> {
        let wcfg = self.writer_config();
        let root = self.export.path().to_path_buf();
        let cfg = self.cfg.clone();
        let res = tokio::task::spawn_blocking(move || export_and_read(wcfg, &root, &cfg, now))
            .await
            .map_err(|e| unavailable(format!("reading the config repo: {e}")))?
            .map_err(|e| unavailable(format!("reading the config repo: {e}")))?;
        match res {
            Ok(base) => Ok(base),
            Err(crate::gather::BaseError::Invalid { commit, problems }) => {
                let list = problems.0.iter().map(InputProblem::from).collect();
                Err(unavailable(format!(
                    "the config repo at {commit} has problems; no plan is computed on top of it"
                ))
                .with_problems(list))
            }
            Err(e) => Err(unavailable(format!("reading the config repo: {e}"))),
        }
    }
}

/// Why the base tip could not be exported: git or the file system (the words of either).
#[derive(Debug, thiserror::Error)]
enum ExportError {
    #[error(transparent)]
    Git(#[from] GitOpsError),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// Exports the base tip as last fetched into `root/<tip>` (once per tip; older exports are
/// removed) and reads it as a run reads it ([`crate::gather::read_base`]).
fn export_and_read(
    wcfg: WriterConfig,
    root: &Path,
    cfg: &DaemonConfig,
    now: DateTime<Utc>,
) -> Result<Result<crate::gather::Base, crate::gather::BaseError>, ExportError> {
    let w = Writer::open_existing(wcfg)?;
    let tip = w.base_tip()?;
    let dir = root.join(&tip);
    if !dir.exists() {
        let tmp = root.join(format!("{tip}.part"));
        let _ = std::fs::remove_dir_all(&tmp);
        w.export_base(&tmp)?;
        std::fs::rename(&tmp, &dir)?;
        // Older exports are no longer needed.
        if let Ok(entries) = std::fs::read_dir(root) {
            for e in entries.flatten() {
                if e.path() != dir {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
    }
    Ok(crate::gather::read_base(&w, &dir, cfg, now))
}

fn unavailable(detail: impl Into<String>) -> Problem {
    Problem::new(StatusCode::SERVICE_UNAVAILABLE, detail)
}

/// `?service=` and `?refresh=`; anything else is a 400.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct QuotasQuery {
    /// Only this service.
    pub service: Option<String>,
    /// Pull the history again before computing (concurrent refreshes share one pull).
    pub refresh: Option<bool>,
}

/// `?refresh=`; anything else is a 400.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RefreshQuery {
    /// Pull the history again before computing.
    pub refresh: Option<bool>,
}

/// The history snapshot a plan was computed from.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct HistoryInfo {
    /// When the pull finished.
    pub pulled_at: DateTime<Utc>,
    /// The snapshot's number (increases with every stored pull).
    pub generation: u64,
    /// The source (Prometheus URL and query, or file).
    pub source: String,
    /// Why the latest pull failed, when it did (the plan is from the last good snapshot).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_pull_error: Option<String>,
}

/// The newest rollout of each bucket (empty when the store cannot say within the query
/// timeout: logged).
pub async fn latest_rollouts(
    s: &AppState,
) -> std::collections::BTreeMap<(String, String), crate::rollout::Rollout> {
    let Some(store) = s.store() else {
        return Default::default();
    };
    match crate::store::within(
        s.query_timeout(),
        crate::rollout::latest_by_bucket(&store, 10_000),
    )
    .await
    {
        Ok(m) => m,
        Err(e) => {
            tracing::warn!(error = %e, "rollouts unavailable for the quota API");
            Default::default()
        }
    }
}

/// `GET /v1/quotas`: the preview JSON (`buckets`, `skipped`, `history_failed`,
/// `history_error`) with what it was computed from.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct QuotasResponse {
    /// The config repo's base commit the current limits come from.
    pub base_commit: String,
    /// When the plan was computed.
    pub computed_at: DateTime<Utc>,
    /// The history snapshot it was computed from.
    pub history: HistoryInfo,
    /// Every bucket, sorted by service then name.
    pub buckets: Vec<QuotaBucket>,
    /// Series or services that keep their current quotas, with the reason.
    pub skipped: Vec<Skipped>,
    /// Services whose history failed or was incomplete (absent when none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history_failed: Vec<String>,
    /// Why the whole history source failed, when it did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub history_error: Option<String>,
    /// Services with a series whose history is not plausible (those buckets keep their
    /// quotas; absent when none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history_refused: Vec<String>,
    /// Direct mode: the changes a run would not commit on the base branch because
    /// `promotion.auto_merge` does not allow them (they go to review); absent when none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub needs_review: Vec<rlc_plan::plan::NeedsReview>,
}

/// `GET /v1/quotas/{service}`.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct ServiceQuotas {
    /// The service.
    pub service: String,
    /// The config repo's base commit the current limits come from.
    pub base_commit: String,
    /// When the plan was computed.
    pub computed_at: DateTime<Utc>,
    /// The history snapshot it was computed from.
    pub history: HistoryInfo,
    /// The service's buckets, with `details`.
    pub buckets: Vec<QuotaBucket>,
    /// The service's skipped series, with the reason.
    pub skipped: Vec<Skipped>,
    /// Whether the service's history failed (it keeps its current quotas).
    pub history_failed: bool,
}

/// `GET /v1/quotas/{service}/{bucket}/history`.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct BucketHistory {
    /// The service.
    pub service: String,
    /// The bucket.
    pub bucket: String,
    /// Every recorded change (at most the latest 1000), oldest first.
    pub changes: Vec<HistoryChange>,
}

/// One recorded change of a bucket.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct HistoryChange {
    /// The stored row.
    #[serde(flatten)]
    pub change: crate::store::QuotaChange,
    /// Why, in words: the rails that acted, or the policy's numbers.
    pub reason: String,
}

fn history_info(q: &Quotas, c: &Computed) -> HistoryInfo {
    history_info_with(c, q.cache.last_error())
}

fn history_info_with(c: &Computed, last_pull_error: Option<String>) -> HistoryInfo {
    HistoryInfo {
        pulled_at: c.snapshot.pulled_at,
        generation: c.snapshot.generation,
        source: c.snapshot.source.clone(),
        last_pull_error,
    }
}

impl Computed {
    /// The history snapshot it was computed from.
    pub fn snapshot(&self) -> &Arc<Snapshot> {
        &self.snapshot
    }

    /// The plan.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// When it was computed.
    pub fn computed_at(&self) -> DateTime<Utc> {
        self.computed_at
    }

    fn response(&self, q: &Quotas, service: Option<&str>) -> QuotasResponse {
        self.response_with(service, q.cache.last_error())
    }

    /// The answer with `last_pull_error` as the history's last pull error.
    fn response_with(
        &self,
        service: Option<&str>,
        last_pull_error: Option<String>,
    ) -> QuotasResponse {
        let keep = |s: &str| service.is_none_or(|want| want == s);
        QuotasResponse {
            base_commit: self.base_commit.clone(),
            computed_at: self.computed_at,
            history: history_info_with(self, last_pull_error),
            buckets: self
                .buckets_of(service)
                .iter()
                .map(|b| view(b, false))
                .collect(),
            skipped: self
                .plan
                .skipped
                .iter()
                .filter(|s| keep(&s.service))
                .cloned()
                .collect(),
            history_failed: self
                .plan
                .history_failed
                .iter()
                .filter(|s| keep(s))
                .cloned()
                .collect(),
            history_error: self.plan.history_error.clone(),
            history_refused: self
                .plan
                .history_refused
                .iter()
                .filter(|s| keep(s))
                .cloned()
                .collect(),
            needs_review: self
                .plan
                .needs_review
                .iter()
                .filter(|r| keep(&r.service))
                .cloned()
                .collect(),
        }
    }

    /// The buckets of `service` (every bucket for `None`).
    fn buckets_of(&self, service: Option<&str>) -> &[PlannedBucket] {
        match service {
            None => &self.plan.buckets,
            Some(s) => self
                .by_service
                .get(s)
                .map_or(&[][..], |r| &self.plan.buckets[r.clone()]),
        }
    }

    /// Whether `service` is in this plan at all (buckets, skipped or failed history).
    fn knows(&self, service: &str) -> bool {
        self.by_service.contains_key(service)
            || self.plan.skipped.iter().any(|s| s.service == service)
            || self.plan.history_failed.iter().any(|s| s == service)
    }
}

fn json_bytes(body: Bytes) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        body,
    )
        .into_response()
}

fn bad_query(e: QueryRejection) -> Problem {
    Problem::new(
        StatusCode::BAD_REQUEST,
        format!(
            "invalid query string: {}; accepted: service=<name>, refresh=true|false",
            e.body_text()
        ),
    )
}

/// The quota API and a slot of its concurrency limit, or the answer to give instead.
fn enter(s: &AppState) -> Result<(Arc<Quotas>, tokio::sync::OwnedSemaphorePermit), Box<Response>> {
    let q = s.quotas().ok_or_else(|| {
        Box::new(unavailable("the quota API is not configured on this server").into_response())
    })?;
    let permit = q.limit.try_enter()?;
    Ok((q, permit))
}

/// Whether a plan computed with (`computed_with_store`) or without the store stands now that
/// the store is (`store_now`) or is not there: one computed without it is redone once it is.
fn still_valid(computed_with_store: bool, store_now: bool) -> bool {
    computed_with_store || !store_now
}

/// `GET /v1/quotas[?service=S][&refresh=true]`.
pub async fn list(
    State(s): State<AppState>,
    query: Result<Query<QuotasQuery>, QueryRejection>,
) -> Response {
    let (q, _permit) = match enter(&s) {
        Ok(x) => x,
        Err(r) => return *r,
    };
    let Query(query) = match query {
        Ok(x) => x,
        Err(e) => return bad_query(e).into_response(),
    };
    if query.refresh == Some(true) {
        q.cache.refresh().await;
    }
    let c = match q.current(q.store_witness()).await {
        Ok(c) => c,
        Err(p) => return p.into_response(),
    };
    let rollouts = latest_rollouts(&s).await;
    match query.service.as_deref() {
        None if !rollouts.is_empty() => {
            let mut body = c.response(&q, None);
            with_rollouts(&mut body.buckets, &rollouts, &c.repo);
            axum::Json(body).into_response()
        }
        None => {
            // The cached body is only good while the last pull error it shows is the last one.
            let error = q.cache.last_error();
            let mut cached = c.all.lock().unwrap();
            let body = match &*cached {
                Some((e, body)) if *e == error => body.clone(),
                _ => {
                    let body = Bytes::from(
                        serde_json::to_vec(&c.response_with(None, error.clone()))
                            .unwrap_or_default(),
                    );
                    *cached = Some((error, body.clone()));
                    body
                }
            };
            drop(cached);
            json_bytes(body)
        }
        Some(svc) if !c.knows(svc) => unknown_service(svc).into_response(),
        Some(svc) => {
            let mut body = c.response(&q, Some(svc));
            with_rollouts(&mut body.buckets, &rollouts, &c.repo);
            axum::Json(body).into_response()
        }
    }
}

fn unknown_service(service: &str) -> Problem {
    Problem::new(
        StatusCode::NOT_FOUND,
        format!(
            "no service `{service}` in the config repo or the history (GET /v1/quotas lists every service)"
        ),
    )
}

/// Path of `GET /v1/quotas/{service}`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct ServicePath {
    /// Callee service.
    pub service: String,
}

/// `GET /v1/quotas/{service}[?refresh=true]`.
pub async fn service(
    State(s): State<AppState>,
    UrlPath(ServicePath { service }): UrlPath<ServicePath>,
    query: Result<Query<RefreshQuery>, QueryRejection>,
) -> Response {
    let (q, _permit) = match enter(&s) {
        Ok(x) => x,
        Err(r) => return *r,
    };
    let Query(query) = match query {
        Ok(x) => x,
        Err(e) => return bad_query(e).into_response(),
    };
    if query.refresh == Some(true) {
        q.cache.refresh().await;
    }
    let c = match q.current(q.store_witness()).await {
        Ok(c) => c,
        Err(p) => return p.into_response(),
    };
    if !c.knows(&service) {
        return unknown_service(&service).into_response();
    }
    let rollouts = latest_rollouts(&s).await;
    let mut body = ServiceQuotas {
        service: service.clone(),
        base_commit: c.base_commit.clone(),
        computed_at: c.computed_at,
        history: history_info(&q, &c),
        buckets: c
            .buckets_of(Some(&service))
            .iter()
            .map(|b| view(b, true))
            .collect(),
        skipped: c
            .plan
            .skipped
            .iter()
            .filter(|x| x.service == service)
            .cloned()
            .collect(),
        history_failed: c.plan.history_failed.contains(&service),
    };
    with_rollouts(&mut body.buckets, &rollouts, &c.repo);
    axum::Json(body).into_response()
}

/// Why a recorded change was made, from its stored evidence.
fn reason_of(evidence: &str) -> String {
    let e = rlc_plan::evidence::Evidence::from_stored(evidence);
    let mut parts: Vec<String> = Vec::new();
    if let Some(k) = &e.kept_current {
        parts.push(k.clone());
    }
    let f = e.policy.as_ref().map(|p| p.figures()).unwrap_or_default();
    match (f.value_rps.or(f.upper_bound_rps), f.headroom) {
        (Some(v), Some(h)) => {
            let stat = f.statistic.as_deref().unwrap_or("forecast upper bound");
            parts.push(format!(
                "{stat} {} rps × (1 + headroom {h})",
                schema::format_rps(v)
            ));
        }
        _ => {
            if let Some(r) = &f.reference {
                parts.push(format!("contract {r}"));
            }
        }
    }
    parts.extend(e.rails.into_iter().map(String::from));
    parts.join("; ")
}

/// `GET /v1/quotas/{service}/{bucket}/history`.
pub async fn history(
    State(s): State<AppState>,
    UrlPath(BucketPath { service, bucket }): UrlPath<BucketPath>,
    query: Result<Query<BTreeMap<String, String>>, QueryRejection>,
) -> Response {
    let (q, _permit) = match enter(&s) {
        Ok(x) => x,
        Err(r) => return *r,
    };
    match query {
        Ok(Query(m)) if m.is_empty() => {}
        Ok(Query(m)) => {
            let names: Vec<&str> = m.keys().map(String::as_str).collect();
            return Problem::new(
                StatusCode::BAD_REQUEST,
                format!(
                    "unknown query parameter(s) {}: this endpoint takes none",
                    names.join(", ")
                ),
            )
            .into_response();
        }
        Err(e) => return bad_query(e).into_response(),
    }
    let Some(store) = s.store() else {
        return unavailable("the store is not connected yet").into_response();
    };
    let rows = match store.quota_changes(&service, &bucket, HISTORY_MAX).await {
        Ok(r) => r,
        Err(e) => return unavailable(format!("the store cannot answer: {e}")).into_response(),
    };
    if rows.is_empty() {
        // A bucket without recorded changes is still known when the plan has it.
        let latest = match q.latest() {
            Some(c) => c,
            None => match q.current(q.store_witness()).await {
                Ok(c) => c,
                Err(p) => return p.into_response(),
            },
        };
        let known = latest
            .plan
            .buckets
            .iter()
            .any(|b| b.service == service && b.bucket.name == bucket);
        if !known {
            return Problem::new(
                StatusCode::NOT_FOUND,
                format!("no bucket `{bucket}` of service `{service}`: no recorded change and none in the latest plan"),
            )
            .into_response();
        }
    }
    // The store answers newest first; the history reads oldest first.
    let changes = rows
        .into_iter()
        .rev()
        .map(|c| HistoryChange {
            reason: reason_of(&c.evidence),
            change: c,
        })
        .collect();
    axum::Json(BucketHistory {
        service,
        bucket,
        changes,
    })
    .into_response()
}

#[cfg(test)]
mod cache_tests {
    use super::still_valid;

    /// A plan computed before the daemon's store was connected (nothing promoted, for want of
    /// shadow figures) is computed again once the store is there; otherwise the cache stands.
    #[test]
    fn a_plan_computed_without_the_store_is_redone_once_the_store_is_there() {
        assert!(!still_valid(false, true));
        assert!(still_valid(false, false));
        assert!(still_valid(true, true));
        assert!(still_valid(true, false));
    }
}
