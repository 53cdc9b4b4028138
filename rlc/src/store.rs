//! The RLC store (sqlx): runs, quota history per bucket with its evidence, shadow reports
//! from the controller, and cursors. Postgres in production, SQLite as the embedded default;
//! both run the same queries (JSON kept as TEXT, `$n` placeholders) and pass the same tests.
//!
//! Several daemons on one Postgres elect the active scheduler with `pg_try_advisory_lock` on
//! a dedicated connection ([`Store::try_lead`]); with SQLite there is one instance.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use rlc_plan::change::ChangeKind;
use serde::{Deserialize, Serialize};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
use sqlx::{Connection, PgPool, SqlitePool};

/// Why a store call failed. Messages never include the database URL's password.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database refused or is unreachable.
    #[error("store: {0}")]
    Db(#[from] sqlx::Error),
    /// Migrations failed.
    #[error("store migrations: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// The URL is neither sqlite: nor postgres:.
    #[error("unsupported database_url scheme (expected sqlite:… or postgres://…)")]
    Scheme,
    /// The store did not answer within the time given ([`within`]): down, unreachable, or
    /// slow (a long query, a lock held by another session).
    #[error("the store did not answer within {} (down, unreachable or slow)", schema::HumanDuration(*.0))]
    TimedOut(Duration),
    /// The SQLite file was deleted or replaced while rlc was using it. rlc neither keeps
    /// writing into the unlinked file nor silently starts a new database (which would forget
    /// the quota history): the store is unavailable until rlc is restarted.
    #[error("store {path}: the SQLite file was {what} while rlc was running; not using it and not creating a new one (restart rlc to accept a new store)")]
    Vanished {
        /// The database file.
        path: PathBuf,
        /// deleted | replaced by another file.
        what: &'static str,
    },
    /// A row changed in the store since it was read (another rlc process wrote it, e.g.
    /// `rlc run --once` beside `rlc serve`): not overwritten; read it again.
    #[error(
        "store: {0} changed since it was read (another rlc process wrote it); not overwritten"
    )]
    Conflict(String),
}

impl StoreError {
    /// Whether the store is unavailable (down, unreachable, too slow, or its file gone) rather
    /// than refusing a statement: HTTP 503 rather than 500.
    pub fn unavailable(&self) -> bool {
        match self {
            StoreError::TimedOut(_) | StoreError::Vanished { .. } => true,
            StoreError::Db(e) => matches!(
                e,
                sqlx::Error::Io(_)
                    | sqlx::Error::Tls(_)
                    | sqlx::Error::Protocol(_)
                    | sqlx::Error::PoolTimedOut
                    | sqlx::Error::PoolClosed
                    | sqlx::Error::WorkerCrashed
            ),
            StoreError::Migrate(_) | StoreError::Scheme | StoreError::Conflict(_) => false,
        }
    }
}

/// Runs one store call, giving up after `limit` ([`StoreError::TimedOut`]): a store that is
/// down (the pool retries refused connections until its own acquire timeout) or slow (a
/// statement waiting on a lock) then costs the caller `limit`, never an unbounded wait. A
/// call given up is dropped at its await point: a transaction it had open is rolled back,
/// unless its COMMIT was already sent (report writes are idempotent: a retry of those
/// reports then adds nothing).
pub async fn within<T>(
    limit: Duration,
    call: impl std::future::Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    tokio::time::timeout(limit, call)
        .await
        .unwrap_or(Err(StoreError::TimedOut(limit)))
}

/// The SQLite file a store was opened on (device and inode), to notice it being deleted or
/// replaced underneath a running process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SqliteFile {
    path: PathBuf,
    dev: u64,
    ino: u64,
}

impl SqliteFile {
    fn of(path: &Path) -> std::io::Result<SqliteFile> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(path)?;
        Ok(SqliteFile {
            path: path.to_path_buf(),
            dev: m.dev(),
            ino: m.ino(),
        })
    }

    /// Ok while `path` is still the file the store was opened on.
    fn check(&self) -> Result<(), StoreError> {
        let what = match SqliteFile::of(&self.path) {
            Ok(now) if now == *self => return Ok(()),
            Ok(_) => "replaced by another file",
            Err(_) => "deleted",
        };
        Err(StoreError::Vanished {
            path: self.path.clone(),
            what,
        })
    }
}

/// Advisory-lock key of the active scheduler ("rlc-sched").
const SCHEDULER_LOCK_KEY: i64 = 0x726c_632d_7363_6864;
/// The advisory lock of one run at a time (`Store::lock_runs`): "rlc-runs".
const RUNS_LOCK_KEY: i64 = 0x726c_632d_7275_6e73;

/// A connected, migrated store.
#[derive(Clone, Debug)]
pub enum Store {
    /// Postgres.
    Postgres(PgPool),
    /// SQLite (a file next to rlc.yaml by default), with the file it was opened on (none
    /// for `:memory:`).
    Sqlite(SqlitePool, Option<Arc<SqliteFile>>),
}

/// One run, as recorded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, sqlx::FromRow)]
pub struct RunRecord {
    /// Assigned by the store (0 before insertion).
    pub id: i64,
    /// schedule | inputs-changed | api | once.
    pub trigger: String,
    /// Start.
    pub started_at: DateTime<Utc>,
    /// End.
    pub finished_at: DateTime<Utc>,
    /// success | unchanged | pending | held | failed (`cycle::RunStatus::as_str`).
    pub status: String,
    /// The commit made (or the PR branch tip), if any.
    pub commit_sha: Option<String>,
    /// The version the controller confirmed, if any.
    pub version_pushed: Option<String>,
    /// Per-service outcome as JSON (`[{"service", "outcome", ...}]`).
    pub services: String,
    /// The human-readable summary.
    pub summary: String,
    /// Why it failed, if it did.
    pub error: Option<String>,
    /// The id `rlc` gave the run when it was asked for or started (`POST /v1/runs` answers it;
    /// `GET /v1/runs/{id}` finds the run by it); null for runs recorded before run ids.
    #[sqlx(default)]
    #[serde(default)]
    pub run_uid: Option<String>,
    /// The number of the pull (merge) request the run opened or updated, if any.
    #[sqlx(default)]
    #[serde(default)]
    pub pr_number: Option<i64>,
    /// Its web page, when the forge gave one.
    #[sqlx(default)]
    #[serde(default)]
    pub pr_url: Option<String>,
}

impl RunRecord {
    /// The pull request the run opened or updated.
    pub fn pull_request(&self) -> Option<PullRequestRef> {
        PullRequestRef::of(self.pr_number, self.pr_url.as_deref())
    }
}

/// A pull (merge) request, as the store keeps it with a run or a quota change.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct PullRequestRef {
    /// Its number (GitHub) or iid (GitLab).
    pub number: i64,
    /// Its web page, when the forge gave one.
    pub url: Option<String>,
}

impl PullRequestRef {
    /// From the stored columns: none without a number.
    pub fn of(number: Option<i64>, url: Option<&str>) -> Option<PullRequestRef> {
        number.map(|number| PullRequestRef {
            number,
            url: url.map(str::to_string),
        })
    }
}

/// Whether a recorded change changed the limit in force.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ChangeState {
    /// On the base branch: committed there by rlc, or merged.
    Applied,
    /// On the pull-request branch, waiting for review: the limit in force is unchanged.
    Proposed,
}

impl ChangeState {
    /// The word stored in `quota_history.state`.
    pub fn as_str(self) -> &'static str {
        match self {
            ChangeState::Applied => "applied",
            ChangeState::Proposed => "proposed",
        }
    }
}

/// A `state` column holding neither `applied` nor `proposed`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown change state `{0}`")]
pub struct UnknownChangeState(pub String);

impl TryFrom<String> for ChangeState {
    type Error = UnknownChangeState;
    fn try_from(s: String) -> Result<ChangeState, UnknownChangeState> {
        match s.as_str() {
            "applied" => Ok(ChangeState::Applied),
            "proposed" => Ok(ChangeState::Proposed),
            _ => Err(UnknownChangeState(s)),
        }
    }
}

/// One recorded change of a bucket with the run that made it (`GET
/// /v1/quotas/{service}/{bucket}/history`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, sqlx::FromRow, schemars::JsonSchema)]
pub struct QuotaChange {
    /// Row id (increasing).
    pub id: i64,
    /// The run that made the change.
    pub run_id: i64,
    /// Why that run happened (schedule, inputs-changed, api, once).
    pub trigger: String,
    /// When it was recorded.
    pub recorded_at: DateTime<Utc>,
    /// added | removed | raised | lowered | modified.
    #[sqlx(try_from = "String")]
    pub change: ChangeKind,
    /// Limit before.
    pub previous_limit_rps: Option<f64>,
    /// Limit after (none when removed).
    pub limit_rps: Option<f64>,
    /// enforce | shadow.
    pub mode: Option<String>,
    /// The policy that computed it.
    pub policy: Option<String>,
    /// The commit made (or the PR branch tip).
    pub commit_sha: Option<String>,
    /// `applied` (on the base branch) or `proposed` (on the pull-request branch, waiting for
    /// review: the limit in force did not change).
    #[sqlx(try_from = "String")]
    pub state: ChangeState,
    /// The pull request that carries the change; null when it was committed on the base
    /// branch directly (or recorded before pull requests were).
    #[sqlx(skip)]
    pub pull_request: Option<PullRequestRef>,
    /// The evidence the run computed the limit with: a JSON object (the plan's `evidence`, as
    /// `GET /v1/quotas` shows it). Kept as the stored JSON text here; served as the object
    /// itself (`{"unreadable": "<text>"}` for a stored text that is not a JSON object).
    #[serde(serialize_with = "evidence_object", deserialize_with = "evidence_text")]
    #[schemars(with = "serde_json::Map<String, serde_json::Value>")]
    pub evidence: String,
}

/// Serializes stored evidence text as the JSON object it holds.
fn evidence_object<S: serde::Serializer>(text: &str, s: S) -> Result<S::Ok, S::Error> {
    use serde::Serialize;
    match serde_json::from_str::<serde_json::Value>(text) {
        Ok(v @ serde_json::Value::Object(_)) => v.serialize(s),
        _ => serde_json::json!({ "unreadable": text }).serialize(s),
    }
}

/// Reads evidence served as an object (or, as answers before it were, as JSON text) back to
/// the stored text.
fn evidence_text<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    use serde::Deserialize;
    Ok(match serde_json::Value::deserialize(d)? {
        serde_json::Value::String(t) => t,
        v => v.to_string(),
    })
}

/// One bucket change a run recorded (its page lists them).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, sqlx::FromRow)]
pub struct RunChange {
    /// Callee service.
    pub service: String,
    /// Bucket name.
    pub bucket: String,
    /// added | removed | raised | lowered | modified.
    #[sqlx(try_from = "String")]
    pub change: ChangeKind,
    /// Limit before.
    pub previous_limit_rps: Option<f64>,
    /// Limit after (none when removed).
    pub limit_rps: Option<f64>,
    /// enforce | shadow.
    pub mode: Option<String>,
    /// The policy that computed it.
    pub policy: Option<String>,
    /// Applied on the base branch, or proposed on the pull-request branch.
    #[sqlx(try_from = "String")]
    pub state: ChangeState,
}

/// A [`QuotaChange`] as read, with its pull request's columns.
#[derive(sqlx::FromRow)]
struct QuotaChangeRow {
    #[sqlx(flatten)]
    change: QuotaChange,
    pr_number: Option<i64>,
    pr_url: Option<String>,
}

/// One bucket change, with the evidence that produced it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, sqlx::FromRow)]
pub struct QuotaRecord {
    /// Callee service.
    pub service: String,
    /// Bucket name.
    pub bucket: String,
    /// added | removed | raised | lowered | modified.
    #[sqlx(try_from = "String")]
    pub change: ChangeKind,
    /// New limit (none when removed).
    pub limit_rps: Option<f64>,
    /// Limit before.
    pub previous_limit_rps: Option<f64>,
    /// enforce | shadow.
    pub mode: Option<String>,
    /// Policy that produced it.
    pub policy: Option<String>,
    /// Commit that carries it.
    pub commit_sha: Option<String>,
    /// Applied (on the base branch) or only proposed (on the pull-request branch).
    #[sqlx(try_from = "String")]
    pub state: ChangeState,
    /// Evidence JSON.
    pub evidence: String,
    /// When it was recorded.
    pub recorded_at: DateTime<Utc>,
    /// The number of the pull request that carries it (none: committed directly).
    #[sqlx(default)]
    #[serde(default)]
    pub pr_number: Option<i64>,
    /// That pull request's web page.
    #[sqlx(default)]
    #[serde(default)]
    pub pr_url: Option<String>,
}

/// A shadow report as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, sqlx::FromRow)]
pub struct StoredReport {
    /// Controller sequence number.
    pub seq: i64,
    /// Tick time.
    #[sqlx(try_from = "Ts")]
    pub t: DateTime<Utc>,
    /// Callee service.
    pub service: String,
    /// Bucket.
    pub bucket: String,
    /// Caller.
    pub caller: Option<String>,
    /// Procedure.
    pub procedure: Option<String>,
    /// Mode.
    pub mode: String,
    /// Scope key ('' for global).
    pub scope_key: String,
    /// Requests offered in the row's second (its counts; an older controller's row: its
    /// offered rate).
    pub offered: f64,
    /// Admitted rate.
    pub admitted: f64,
    /// Dropped rate.
    pub dropped: f64,
    /// Virtual drops.
    pub shadow_dropped: f64,
    /// Limit.
    pub limit_rps: f64,
    /// Drop ratio.
    pub drop_ratio: f64,
}

/// What the shadow reports of one bucket add up to over a window: the evidence a service
/// owner reads before a quota is enforced. Sums are sums of the per-report rates (one report
/// per controller tick and scope key), so with 1 s ticks they count requests.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, sqlx::FromRow, schemars::JsonSchema)]
pub struct BucketShadowSummary {
    /// Callee service.
    pub service: String,
    /// Bucket.
    pub bucket: String,
    /// Reports in the window (ticks × scope keys).
    pub reports: i64,
    /// Requests offered (sums of the rows' counts).
    pub offered: f64,
    /// Sum of admitted rates.
    pub admitted: f64,
    /// Sum of (enforced) dropped rates.
    pub dropped: f64,
    /// Sum of virtual drops.
    pub shadow_dropped: f64,
    /// `shadow_dropped / offered` (0 without traffic): the share of requests the quota would
    /// have refused had it been enforced.
    pub virtual_drop_share: f64,
    /// Highest offered rate in one report.
    pub peak_offered_rps: f64,
    /// Highest drop ratio the controller computed.
    pub max_drop_ratio: f64,
    /// The limit in the bucket's latest report.
    pub limit_rps: f64,
    /// The mode in the bucket's latest report.
    pub mode: String,
    /// The first tick of the window with a report.
    #[sqlx(try_from = "Ts")]
    pub first_seen: DateTime<Utc>,
    /// The newest tick with a report.
    #[sqlx(try_from = "Ts")]
    pub last_seen: DateTime<Utc>,
}

/// Held while this process is the active scheduler; dropping it releases the lock.
pub struct Lease {
    conn: Option<sqlx::PgConnection>,
}

impl Lease {
    /// Whether the lock is still held (its connection is alive). SQLite leases always are.
    pub async fn alive(&mut self) -> bool {
        match self.conn.as_mut() {
            None => true,
            Some(c) => c.ping().await.is_ok(),
        }
    }

    /// Releases the lock now (on shutdown) instead of when the server notices the closed
    /// connection.
    pub async fn release(mut self) {
        if let Some(mut c) = self.conn.take() {
            let _ = sqlx::query("SELECT pg_advisory_unlock($1)")
                .bind(SCHEDULER_LOCK_KEY)
                .execute(&mut c)
                .await;
            let _ = c.close().await;
        }
    }
}

/// Runs the same statement on whichever backend: each arm type-checks on its own.
macro_rules! on_pool {
    ($self:expr, $p:ident => $body:expr) => {
        match $self {
            Store::Postgres($p) => $body,
            Store::Sqlite($p, file) => {
                if let Some(f) = file {
                    f.check()?;
                }
                $body
            }
        }
    };
}

/// Raises `work_mem` to at least 16 MB on rlc's own connections (never lowers it): the
/// overview groups a row per bucket and day (310,000 at 10,000 buckets over 31 days), which
/// at Postgres' default of 4 MB sorts on disk. Measured in psql on `bench_shadow_store`'s data
/// (docs/rlc-dashboard.md): the overview statement 283 → 190 ms, the service list 138 → 68 ms.
/// At most 5 connections, a few sort or hash nodes each.
const WORK_MEM_FLOOR: &str = "SELECT set_config('work_mem', '16MB', false) \
     WHERE pg_size_bytes(current_setting('work_mem')) < 16 * 1024 * 1024";

impl Store {
    /// Connects and migrates. A relative SQLite path is relative to `base_dir` (the directory
    /// of rlc.yaml); the file is created when missing.
    pub async fn connect(url: &str, base_dir: &Path) -> Result<Store, StoreError> {
        Store::connect_to(url, base_dir, None).await
    }

    /// Connects again after a failure. A SQLite store must still be `previous`'s file: a
    /// file deleted or replaced meanwhile is [`StoreError::Vanished`], never a new database.
    pub async fn reconnect(
        url: &str,
        base_dir: &Path,
        previous: Option<&SqliteFile>,
    ) -> Result<Store, StoreError> {
        Store::connect_to(url, base_dir, previous).await
    }

    /// The SQLite file this store was opened on.
    pub fn sqlite_file(&self) -> Option<&SqliteFile> {
        match self {
            Store::Sqlite(_, Some(f)) => Some(f),
            _ => None,
        }
    }

    async fn connect_to(
        url: &str,
        base_dir: &Path,
        previous: Option<&SqliteFile>,
    ) -> Result<Store, StoreError> {
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            let opts = PgConnectOptions::from_str(url)?;
            let pool = PgPoolOptions::new()
                .max_connections(5)
                .acquire_timeout(Duration::from_secs(10))
                .after_connect(|conn, _| {
                    Box::pin(async move {
                        sqlx::query(WORK_MEM_FLOOR).execute(conn).await?;
                        Ok(())
                    })
                })
                .connect_with(opts)
                .await?;
            sqlx::migrate!("../migrations/postgres").run(&pool).await?;
            Ok(Store::Postgres(pool))
        } else if let Some(rest) = url.strip_prefix("sqlite:") {
            let rest = rest.trim_start_matches("//");
            let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
            let file = (path != ":memory:" && !path.is_empty()).then(|| base_dir.join(path));
            if let (Some(prev), Some(p)) = (previous, &file) {
                if *p == prev.path {
                    prev.check()?;
                }
            }
            let opts = if let Some(p) = &file {
                if previous.is_none() && !p.exists() {
                    tracing::warn!(path = %p.display(), "no store file: creating a new SQLite store (decreases are still checked against the config repo's history)");
                }
                let mut o = SqliteConnectOptions::new()
                    .filename(p)
                    .create_if_missing(previous.is_none());
                if query.contains("mode=ro") {
                    o = o.read_only(true);
                }
                o
            } else {
                SqliteConnectOptions::from_str("sqlite::memory:")?
            };
            // One writer at a time is what SQLite does anyway; a single connection also keeps
            // an in-memory database alive across calls.
            let pool = SqlitePoolOptions::new()
                .max_connections(1)
                .acquire_timeout(Duration::from_secs(10))
                .connect_with(opts.busy_timeout(Duration::from_secs(5)))
                .await?;
            // The file now exists: remember which one it is.
            let identity = match &file {
                Some(p) => Some(Arc::new(SqliteFile::of(p).map_err(|_| {
                    StoreError::Vanished {
                        path: p.clone(),
                        what: "deleted",
                    }
                })?)),
                None => None,
            };
            if let (Some(prev), Some(now)) = (previous, &identity) {
                if prev.path == now.path {
                    prev.check()?;
                }
            }
            sqlx::migrate!("../migrations/sqlite").run(&pool).await?;
            Ok(Store::Sqlite(pool, identity))
        } else {
            Err(StoreError::Scheme)
        }
    }

    /// One round trip to the database (`SELECT 1`); a SQLite file deleted or replaced is an
    /// error here too. For readiness probes.
    pub async fn ping(&self) -> Result<(), StoreError> {
        on_pool!(self, p => {
            sqlx::query("SELECT 1").execute(p).await?;
        });
        Ok(())
    }

    /// Which backend: `postgres` or `sqlite`.
    pub fn backend(&self) -> &'static str {
        match self {
            Store::Postgres(_) => "postgres",
            Store::Sqlite(..) => "sqlite",
        }
    }

    /// Records a finished run and its quota changes in one transaction; returns the run id.
    /// A run whose `run_uid` is already recorded is not recorded again (a buffered record
    /// retried after its first insert committed unacknowledged): its id is returned.
    pub async fn record_run(
        &self,
        run: &RunRecord,
        quotas: &[QuotaRecord],
    ) -> Result<i64, StoreError> {
        on_pool!(self, pool => {
            let mut tx = pool.begin().await?;
            if let Some(uid) = &run.run_uid {
                let known: Option<(i64,)> = sqlx::query_as("SELECT id FROM runs WHERE run_uid = $1")
                    .bind(uid)
                    .fetch_optional(&mut *tx)
                    .await?;
                if let Some((id,)) = known {
                    return Ok(id);
                }
            }
            let (id,): (i64,) = sqlx::query_as(
                "INSERT INTO runs (trigger, started_at, finished_at, status, commit_sha, version_pushed, services, summary, error, run_uid, pr_number, pr_url) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12) RETURNING id",
            )
            .bind(&run.trigger)
            .bind(run.started_at)
            .bind(run.finished_at)
            .bind(&run.status)
            .bind(&run.commit_sha)
            .bind(&run.version_pushed)
            .bind(&run.services)
            .bind(&run.summary)
            .bind(&run.error)
            .bind(&run.run_uid)
            .bind(run.pr_number)
            .bind(&run.pr_url)
            .fetch_one(&mut *tx)
            .await?;
            for q in quotas {
                sqlx::query(
                    "INSERT INTO quota_history (run_id, recorded_at, service, bucket, change, limit_rps, previous_limit_rps, mode, policy, commit_sha, evidence, pr_number, pr_url, state) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)",
                )
                .bind(id)
                .bind(q.recorded_at)
                .bind(&q.service)
                .bind(&q.bucket)
                .bind(q.change.as_str())
                .bind(q.limit_rps)
                .bind(q.previous_limit_rps)
                .bind(&q.mode)
                .bind(&q.policy)
                .bind(&q.commit_sha)
                .bind(&q.evidence)
                .bind(q.pr_number)
                .bind(&q.pr_url)
                .bind(q.state.as_str())
                .execute(&mut *tx)
                .await?;
            }
            tx.commit().await?;
            Ok(id)
        })
    }

    /// The most recent runs, newest first.
    pub async fn recent_runs(&self, limit: i64) -> Result<Vec<RunRecord>, StoreError> {
        on_pool!(self, pool => Ok(sqlx::query_as::<_, RunRecord>(
            "SELECT id, trigger, started_at, finished_at, status, commit_sha, version_pushed, services, summary, error, run_uid, pr_number, pr_url \
             FROM runs ORDER BY id DESC LIMIT $1",
        )
        .bind(limit)
        .fetch_all(pool)
        .await?))
    }

    /// When the newest successful (or unchanged) run finished, if any.
    pub async fn last_successful_run_at(&self) -> Result<Option<DateTime<Utc>>, StoreError> {
        let row: Option<(DateTime<Utc>,)> = on_pool!(self, pool => sqlx::query_as(
            "SELECT finished_at FROM runs WHERE status IN ('success', 'unchanged') ORDER BY id DESC LIMIT 1",
        )
        .fetch_optional(pool)
        .await?);
        Ok(row.map(|r| r.0))
    }

    /// The run recorded with `run_uid`, if any.
    pub async fn run_by_uid(&self, run_uid: &str) -> Result<Option<RunRecord>, StoreError> {
        on_pool!(self, pool => Ok(sqlx::query_as::<_, RunRecord>(
            "SELECT id, trigger, started_at, finished_at, status, commit_sha, version_pushed, services, summary, error, run_uid, pr_number, pr_url \
             FROM runs WHERE run_uid = $1",
        )
        .bind(run_uid)
        .fetch_optional(pool)
        .await?))
    }

    /// The run with the store's `id`, if any.
    pub async fn run_by_id(&self, id: i64) -> Result<Option<RunRecord>, StoreError> {
        on_pool!(self, pool => Ok(sqlx::query_as::<_, RunRecord>(
            "SELECT id, trigger, started_at, finished_at, status, commit_sha, version_pushed, services, summary, error, run_uid, pr_number, pr_url \
             FROM runs WHERE id = $1",
        )
        .bind(id)
        .fetch_optional(pool)
        .await?))
    }

    /// The quota history of one bucket, oldest first.
    pub async fn quota_history(
        &self,
        service: &str,
        bucket: &str,
    ) -> Result<Vec<QuotaRecord>, StoreError> {
        on_pool!(self, pool => Ok(sqlx::query_as::<_, QuotaRecord>(
            "SELECT service, bucket, change, limit_rps, previous_limit_rps, mode, policy, commit_sha, evidence, recorded_at, pr_number, pr_url, state \
             FROM quota_history WHERE service = $1 AND bucket = $2 ORDER BY id",
        )
        .bind(service)
        .bind(bucket)
        .fetch_all(pool)
        .await?))
    }

    /// The newest proposed change of each bucket that no applied change followed, when it
    /// changes the limit (`added`, `removed`, `raised`, `lowered`: a `modified` one, of scope
    /// or mode, cannot be told from the base by its limit and mode alone):
    /// `(id, service, bucket, limit_rps, mode)` (`limit_rps` null: a removal). What a merge of
    /// the pull request would apply.
    pub async fn open_proposals(
        &self,
    ) -> Result<Vec<(i64, String, String, Option<f64>, Option<String>)>, StoreError> {
        on_pool!(self, pool => Ok(sqlx::query_as::<_, (i64, String, String, Option<f64>, Option<String>)>(
            "SELECT q.id, q.service, q.bucket, q.limit_rps, q.mode FROM quota_history q \
             WHERE q.state = 'proposed' AND q.change IN ('added', 'removed', 'raised', 'lowered') \
             AND q.id = (SELECT MAX(n.id) FROM quota_history n \
             WHERE n.service = q.service AND n.bucket = q.bucket) ORDER BY q.id",
        )
        .fetch_all(pool)
        .await?))
    }

    /// Marks the changes `ids` applied (their pull request was merged).
    pub async fn mark_applied(&self, ids: &[i64]) -> Result<(), StoreError> {
        for id in ids {
            on_pool!(self, pool => {
                sqlx::query("UPDATE quota_history SET state = 'applied' WHERE id = $1 AND state = 'proposed'")
                    .bind(id)
                    .execute(pool)
                    .await?;
                Ok::<(), StoreError>(())
            })?;
        }
        Ok(())
    }

    /// The `limit` most recent changes of one bucket with the run that made them (id and
    /// trigger), newest first: the dashboard's quota history and `GET
    /// /v1/quotas/{service}/{bucket}/history`.
    pub async fn quota_changes(
        &self,
        service: &str,
        bucket: &str,
        limit: i64,
    ) -> Result<Vec<QuotaChange>, StoreError> {
        on_pool!(self, pool => {
            let rows = sqlx::query_as::<_, QuotaChangeRow>(
                "SELECT q.id, q.run_id, r.trigger, q.recorded_at, q.change, q.previous_limit_rps, q.limit_rps, \
                 q.mode, q.policy, q.commit_sha, q.evidence, q.pr_number, q.pr_url, q.state \
                 FROM quota_history q JOIN runs r ON r.id = q.run_id \
                 WHERE q.service = $1 AND q.bucket = $2 ORDER BY q.id DESC LIMIT $3",
            )
            .bind(service)
            .bind(bucket)
            .bind(limit)
            .fetch_all(pool)
            .await?;
            Ok(rows
                .into_iter()
                .map(|r| QuotaChange {
                    pull_request: PullRequestRef::of(r.pr_number, r.pr_url.as_deref()),
                    ..r.change
                })
                .collect())
        })
    }

    /// The changes run `run_id` recorded (at most `limit`), by service then bucket: the run's
    /// page.
    pub async fn run_changes(&self, run_id: i64, limit: i64) -> Result<Vec<RunChange>, StoreError> {
        on_pool!(self, pool => Ok(sqlx::query_as::<_, RunChange>(
            "SELECT service, bucket, change, previous_limit_rps, limit_rps, mode, policy, state \
             FROM quota_history WHERE run_id = $1 ORDER BY service, bucket, id LIMIT $2",
        )
        .bind(run_id)
        .bind(limit)
        .fetch_all(pool)
        .await?))
    }

    /// When each bucket was last lowered at or after `since` by an applied change (a change
    /// only proposed on the pull-request branch is not one), by `(service, bucket)`: one query
    /// for every bucket, what the decrease guard asks before planning.
    pub async fn applied_decreases_since(
        &self,
        since: DateTime<Utc>,
    ) -> Result<BTreeMap<(String, String), DateTime<Utc>>, StoreError> {
        on_pool!(self, pool => {
            let rows = sqlx::query_as::<_, (String, String, DateTime<Utc>)>(
                "SELECT service, bucket, recorded_at FROM quota_history \
                 WHERE change = 'lowered' AND state = 'applied' AND recorded_at >= $1",
            )
            .bind(since)
            .fetch_all(pool)
            .await?;
            let mut out: BTreeMap<(String, String), DateTime<Utc>> = BTreeMap::new();
            for (service, bucket, at) in rows {
                let e = out.entry((service, bucket)).or_insert(at);
                *e = (*e).max(at);
            }
            Ok(out)
        })
    }

    /// Per-bucket summary of the minute roll-ups from the minute of `since` on, optionally of one service:
    /// the buckets with the largest share of virtual drops first, at most `limit` of them.
    pub async fn shadow_summary(
        &self,
        service: Option<&str>,
        since: DateTime<Utc>,
        limit: i64,
    ) -> Result<Vec<BucketShadowSummary>, StoreError> {
        // The same sums as over every minute, from the coarsest roll-up rows that tile the
        // window ([`OverviewParts`]).
        let p = OverviewParts::from(since);
        // The limit and mode are those of the latest report (by controller sequence) in the
        // bucket's newest minute, so a quota changed during the window shows its current
        // value. The lookups run on the `limit` buckets kept, outside the grouping (in SQLite
        // too), and read one minute's rows through the primary key.
        let latest = |col: &str| {
            format!(
                "(SELECT l.{col} FROM shadow_minutes l WHERE l.service = a.service AND l.bucket = a.bucket \
                  AND l.minute = (SELECT MAX(m.minute) FROM shadow_minutes m \
                                  WHERE m.service = a.service AND m.bucket = a.bucket) \
                  ORDER BY l.last_seq DESC LIMIT 1) AS {col}"
            )
        };
        on_pool!(self, pool => Ok(sqlx::query_as::<_, BucketShadowSummary>(&format!(
            "SELECT a.service, a.bucket, a.reports, a.offered, a.admitted, a.dropped, a.shadow_dropped, \
                    a.virtual_drop_share, a.peak_offered_rps, a.max_drop_ratio, {limit_rps}, {mode}, \
                    a.first_seen, a.last_seen \
             FROM (SELECT service, bucket, CAST(SUM(reports) AS BIGINT) AS reports, SUM(offered) AS offered, SUM(admitted) AS admitted, \
                          SUM(dropped) AS dropped, SUM(shadow_dropped) AS shadow_dropped, \
                          CASE WHEN SUM(offered) > 0 THEN SUM(shadow_dropped) / SUM(offered) ELSE 0.0 END AS virtual_drop_share, \
                          MAX(max_offered) AS peak_offered_rps, MAX(max_drop_ratio) AS max_drop_ratio, \
                          MIN(first_t) AS first_seen, MAX(last_t) AS last_seen \
                   FROM ({parts}) u \
                   GROUP BY service, bucket \
                   ORDER BY virtual_drop_share DESC, service, bucket LIMIT $3) a \
             ORDER BY a.virtual_drop_share DESC, a.service, a.bucket",
            limit_rps = latest("limit_rps"),
            mode = latest("mode"),
            parts = OverviewParts::union(
                "service, bucket, reports, offered, admitted, dropped, shadow_dropped, \
                 max_offered, max_drop_ratio, first_t, last_t",
                " AND ($2 IS NULL OR service = $2)",
                "UNION ALL",
            ),
        ))
        .bind(Ts(p.since))
        .bind(service)
        .bind(limit)
        .bind(Ts(p.blocks))
        .bind(Ts(p.hours))
        .bind(Ts(p.days))
        .fetch_all(pool)
        .await?))
    }

    /// The services that sent reports since `since`, sorted (at most `limit`): the dashboard's
    /// filter choices.
    pub async fn shadow_services(
        &self,
        since: DateTime<Utc>,
        limit: i64,
    ) -> Result<Vec<String>, StoreError> {
        let p = OverviewParts::from(since);
        on_pool!(self, pool => Ok(sqlx::query_as::<_, (String,)>(&format!(
            "{} ORDER BY service LIMIT $3",
            OverviewParts::union("service", " AND ($2 IS NULL OR service = $2)", "UNION")
        ))
        .bind(Ts(p.since))
        .bind(Option::<&str>::None)
        .bind(limit)
        .bind(Ts(p.blocks))
        .bind(Ts(p.hours))
        .bind(Ts(p.days))
        .fetch_all(pool)
        .await?
        .into_iter()
        .map(|r| r.0)
        .collect()))
    }

    /// A named cursor (e.g. the controller's report position).
    pub async fn cursor(&self, name: &str) -> Result<Option<String>, StoreError> {
        on_pool!(self, pool => Ok(sqlx::query_as::<_, (String,)>("SELECT value FROM cursors WHERE name = $1")
            .bind(name)
            .fetch_optional(pool)
            .await?
            .map(|r| r.0)))
    }

    /// Sets a named cursor.
    pub async fn set_cursor(&self, name: &str, value: &str) -> Result<(), StoreError> {
        on_pool!(self, pool => {
            sqlx::query("INSERT INTO cursors (name, value) VALUES ($1, $2) ON CONFLICT (name) DO UPDATE SET value = excluded.value")
                .bind(name)
                .bind(value)
                .execute(pool)
                .await?;
            Ok(())
        })
    }

    /// The lock of one run at a time on this store (Postgres: a session advisory lock held
    /// by a connection of its own; SQLite: one process per file, no lock needed), waiting for
    /// it up to `wait`. `Ok(None)`: another run held it all that time.
    pub async fn lock_runs(&self, wait: Duration) -> Result<Option<Lease>, StoreError> {
        match self {
            Store::Sqlite(..) => Ok(Some(Lease { conn: None })),
            Store::Postgres(pool) => {
                let mut conn = pool.acquire().await?.detach();
                let until = std::time::Instant::now() + wait;
                loop {
                    let (got,): (bool,) = sqlx::query_as("SELECT pg_try_advisory_lock($1)")
                        .bind(RUNS_LOCK_KEY)
                        .fetch_one(&mut conn)
                        .await?;
                    if got {
                        return Ok(Some(Lease { conn: Some(conn) }));
                    }
                    if std::time::Instant::now() >= until {
                        return Ok(None);
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }

    /// Tries to become the active scheduler. `None`: another replica is. The lease holds a
    /// dedicated connection; the lock goes with it (also when the process dies).
    pub async fn try_lead(&self) -> Result<Option<Lease>, StoreError> {
        match self {
            Store::Sqlite(..) => Ok(Some(Lease { conn: None })),
            Store::Postgres(pool) => {
                let mut conn = pool.acquire().await?.detach();
                let (got,): (bool,) = sqlx::query_as("SELECT pg_try_advisory_lock($1)")
                    .bind(SCHEDULER_LOCK_KEY)
                    .fetch_one(&mut conn)
                    .await?;
                Ok(got.then_some(Lease { conn: Some(conn) }))
            }
        }
    }
}

/// How the overview tiles `[since, now]` with roll-up rows: the minutes of `[since, blocks)`,
/// the ten-minute blocks of `[blocks, hours)`, the bucket-wide hours of `[hours, days)` and
/// the bucket-wide days from `days` on (the current day's row holds everything stored up to
/// now). Each boundary is the first of its period at or after the one before, so a `since`
/// on a day boundary reads day rows only, and any `since` gives the sums of every minute.
struct OverviewParts {
    since: DateTime<Utc>,
    blocks: DateTime<Utc>,
    hours: DateTime<Utc>,
    days: DateTime<Utc>,
}

impl OverviewParts {
    fn from(since: DateTime<Utc>) -> OverviewParts {
        let since = minute_of(since);
        let blocks = shadow::BLOCKS.ceil(since);
        let hours = shadow::BUCKET_HOURS.ceil(blocks);
        let days = shadow::BUCKET_DAYS.ceil(hours);
        OverviewParts {
            since,
            blocks,
            hours,
            days,
        }
    }

    /// The four parts' `columns` joined by `union`, each filtered by `filter` (binds: `$1`
    /// since, `$4` blocks, `$5` hours, `$6` days; `$2` the service or none, `$3` free).
    fn union(columns: &str, filter: &str, union: &str) -> String {
        let [blocks, hours, days] = shadow::PERIODS;
        let part = |table: &str, column: &str, from: &str, to: Option<&str>| {
            let to = to
                .map(|to| format!(" AND {column} < {to}"))
                .unwrap_or_default();
            format!("SELECT {columns} FROM {table} WHERE {column} >= {from}{to}{filter}")
        };
        [
            part("shadow_minutes", "minute", "$1", Some("$4")),
            part(blocks.table, blocks.column, "$4", Some("$5")),
            part(hours.table, hours.column, "$5", Some("$6")),
            part(days.table, days.column, "$6", None),
        ]
        .join(&format!(" {union} "))
    }
}

mod rollouts;
pub use rollouts::{CountRow, RolloutRow};
mod shadow;
pub use shadow::{
    block_of, minute_of, stats_from_minutes, steps_from_minutes, tick_time, window_start,
    MinuteRow, Retained, StepRow, TierStepRow, Ts, UnreadRegion,
};

#[cfg(test)]
mod tests;
