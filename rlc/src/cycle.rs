//! One RLC cycle around a computed [`Plan`]: render → validate → commit or PR → push to the
//! controller → record in the store; plus `rlc run --once`.
//!
//! Failure policy:
//! - git remote down or rejecting, or a render that fails validation: the run fails with the
//!   reason and nothing is written (the writer only moves refs after the remote accepted).
//! - controller down: the commit stands; the push is retried with bounded backoff, then left
//!   pending (the daemon's reconcile loop, or the next run, delivers it).
//! - store down: the git work and push complete; the run record waits in the journal
//!   (`store.journal_dir`, written right after the git write, so a kill does not lose it)
//!   and is written by the next run or poll that reaches the store (in `--once`, the run
//!   says where its record waits). A SQLite store deleted or replaced during the run is down
//!   too (never recreated).
//! - another run on the same working copy or Postgres store: this one waits for it (one run
//!   at a time, so a change is never written or recorded twice).
//! - history failed for every service: the run fails and writes nothing (exit 1); for some
//!   services: those keep their quotas and the run exits 4.
//! - the remote's ref moved during the push ("failed to update ref"): fetch, rebuild on top,
//!   push again, at most `git_attempts` times.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use chrono::{DateTime, Utc};
use schema::{DaemonConfig, RepoMode};
use serde::Serialize;
use tokio::sync::Mutex;

use rlc_plan::pipeline::{self, World};
use rlc_plan::plan::{NeedsReview, PromotionNote};

use crate::gather::{self, Base, StoreWitness};
use crate::gitops::short;
use crate::gitops::summary::{self, ChangeSummary, FORGE_BODY_LIMIT};
use crate::gitops::{Forge, PullRequest, WriteOutcome, WriteStatus, Writer, WriterConfig};
use crate::history::snapshot::HistoryCache;
use crate::journal::{Entry, Journal};
use crate::plan::{Plan, Skipped};
use crate::push::{self, Backoff, ConfigDoc, ControllerClient};
use crate::rollout;
use crate::shadow::ShadowSource;
use crate::store::{ChangeState, QuotaRecord, RunRecord, Store};
use rlc_plan::promotion;

/// How long a run waits for another run of the same config repo or store to finish.
const RUN_LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(600);

/// Held while a run works (dropped at its end, or when the process dies): one run at a time
/// per working copy (a file lock beside it) and per Postgres store (an advisory lock), so
/// that concurrent runs never write and record the same change twice.
struct RunGuard {
    _lock: FileLock,
    _lease: Option<crate::store::Lease>,
}

/// The working copy's lock file (`.<working copy>.rlc-lock`), open; an exclusive advisory
/// lock once [`FileLock::try_take`] took it, released when this is dropped.
///
/// Released explicitly (`flock(LOCK_UN)`), not by closing the file: a child process that any
/// thread of this process forks holds a copy of every descriptor until it execs, and a lock
/// left to the close would last as long as that copy, so that this process's next poll finds
/// its own run's lock still taken.
struct FileLock(std::fs::File);

impl FileLock {
    /// Opens `path`, created if missing, without taking the lock.
    fn open(path: &Path) -> std::io::Result<FileLock> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)?;
        Ok(FileLock(file))
    }

    /// Takes the lock if no one holds it: `Ok(false)` when someone does.
    fn try_take(&self) -> std::io::Result<bool> {
        match self.0.try_lock() {
            Ok(()) => Ok(true),
            Err(std::fs::TryLockError::WouldBlock) => Ok(false),
            Err(std::fs::TryLockError::Error(e)) => Err(e),
        }
    }
}

impl Drop for FileLock {
    fn drop(&mut self) {
        // Releases the lock of this open file, which copies inherited by children share;
        // never another holder's. Unlocking a file this one did not lock does nothing.
        let _ = self.0.unlock();
    }
}

/// How long after a poll's sync a run starting decides on it instead of fetching again.
const POLL_FRESH: std::time::Duration = std::time::Duration::from_secs(10);

/// What the computing step of a run gets: the config, and the config repo synced to the
/// remote base tip (read once, at the start of the run).
#[derive(Debug, Clone)]
pub struct PlanInput {
    /// The daemon config.
    pub cfg: DaemonConfig,
    /// Directory of rlc.yaml (relative paths start there).
    pub base_dir: PathBuf,
    /// The config repo working copy, at the base branch tip.
    pub repo_dir: PathBuf,
    /// The config repo at the base tip, loaded and valid.
    pub repo: Arc<schema::ConfigRepo>,
    /// Why this run happens.
    pub trigger: String,
    /// The daemon's history snapshot: the run's pull goes through it (shared with concurrent
    /// API pulls) and refreshes it. None: pull directly.
    pub history_cache: Option<Arc<HistoryCache>>,
    /// The evidence the run gathered on the base (past decreases, shadow figures, throttled
    /// minutes): the planner leaves throttled minutes out of what a policy learns, and the run
    /// finishes the plan with the same evidence.
    pub world: Arc<World>,
}

/// The base branch's tip as the controllers' desired config, with what rollouts read.
#[derive(Debug, Clone)]
pub struct BaseState {
    /// The tip's version and bucket files.
    pub doc: ConfigDoc,
    /// `rlc/policies.yaml` at the tip (its `rollout:` section).
    pub policies: Option<schema::PoliciesFile>,
    /// The digest of the tip's `rlc/*.yaml`.
    pub inputs: String,
}

impl BaseState {
    /// From the writer's base ref as last fetched.
    pub fn of(w: &Writer) -> Result<BaseState, crate::gitops::GitOpsError> {
        let (version, services) = w.base_buckets()?;
        Ok(BaseState {
            doc: ConfigDoc {
                version,
                services,
                ..ConfigDoc::default()
            },
            policies: w.base_policies()?,
            inputs: w.inputs_hash()?,
        })
    }
}

/// What a push to the controllers did ([`Cycle::push_all`]).
#[derive(Debug, Default)]
pub struct PushReport {
    /// The version each region's controller confirmed.
    pub versions: std::collections::BTreeMap<String, String>,
    /// Failures, `region: error`.
    pub errors: Vec<String>,
    /// The open rollouts afterwards.
    pub rollouts: Vec<rollout::Rollout>,
}

/// The label put on a pull request whose change's rollout was aborted.
pub const ROLLOUT_ABORTED_LABEL: &str = "rollout-aborted";

/// The branch that carries the revert of rollout `id` in pull-request mode.
fn revert_branch(pr_branch: &str, id: &str) -> String {
    let id: String = id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '-'
            }
        })
        .collect();
    format!("{pr_branch}-revert-{id}")
}

/// The base branch's files of `r`'s service with its bucket back to the spec in force before
/// it (gone when there was none: a service whose only bucket it was loses its file); None
/// when the base no longer holds the aborted change.
fn revert_plan(w: &mut Writer, r: &rollout::Rollout) -> anyhow::Result<Option<Plan>> {
    let (_, services) = w.base_buckets()?;
    let Some(file) = services.iter().find(|f| f.service == r.service) else {
        return Ok(None);
    };
    if file.buckets.iter().find(|b| b.name == r.bucket) != Some(&r.new) {
        return Ok(None);
    }
    let buckets = file
        .buckets
        .iter()
        .filter_map(|b| {
            let spec = if b.name == r.bucket {
                r.old.clone()?
            } else {
                b.clone()
            };
            Some(rlc_plan::plan::PlannedBucket {
                service: r.service.clone(),
                current_limit_rps: Some(b.limit_rps),
                bucket: spec,
                evidence: Default::default(),
                held: None,
            })
        })
        .collect::<Vec<_>>();
    if buckets.is_empty() {
        w.set_removing(vec![r.service.clone()]);
    }
    Ok(Some(Plan {
        buckets,
        ..Plan::default()
    }))
}

/// The message of a revert commit: the bucket, the spec it returns to, the evidence.
fn revert_message(r: &rollout::Rollout) -> String {
    let to = rollout::in_force_words(r);
    format!(
        "rlc: revert {}/{} to {to}: rollout aborted\n\nThe change ({}, from {}) was tried as a candidate beside the limit in force and aborted:\n{}\n\nRollout {}. rlc does not propose this change again until its inputs change.\n",
        r.service,
        r.bucket,
        r.change,
        short(&r.version),
        r.reason.as_deref().unwrap_or("no reason recorded"),
        r.id
    )
}

pub use crate::BoxFuture;

/// The computing step of a run's plan: history pulled, then a policy per bucket and the rails
/// ([`rlc_plan::compute`]); [`crate::cycle::compute::planner`] in production, a fixed plan in
/// tests. The run then finishes it with the evidence it gathered
/// ([`rlc_plan::pipeline::finish`]: decrease guard, promotions, review).
pub type Planner = Arc<dyn Fn(PlanInput) -> BoxFuture<anyhow::Result<Plan>> + Send + Sync>;

/// What the git write of a run did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GitOutcome {
    /// Nothing to write.
    Unchanged,
    /// Committed on the base branch (direct mode).
    Committed,
    /// The pull-request branch was pushed with the proposal.
    BranchPushed(String),
    /// The pull-request branch already held the proposal.
    BranchUpToDate(String),
    /// The pull-request branch is outdated and was left (its pull request could not be
    /// closed).
    BranchOutdated(String),
    /// The outdated pull-request branch was deleted.
    BranchWithdrawn {
        /// The branch.
        branch: String,
        /// Its tip before.
        was: String,
    },
    /// The pull-request branch has commits by people and was left alone.
    Held,
}

impl GitOutcome {
    /// Whether the run's changes went to the pull-request branch (proposed, not applied).
    pub fn proposed(&self) -> bool {
        matches!(
            self,
            GitOutcome::BranchPushed(_) | GitOutcome::BranchUpToDate(_)
        )
    }
}

impl std::fmt::Display for GitOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GitOutcome::Unchanged => f.write_str("unchanged"),
            GitOutcome::Committed => f.write_str("committed"),
            GitOutcome::BranchPushed(b) => write!(f, "pushed branch {b}"),
            GitOutcome::BranchUpToDate(b) => write!(f, "branch {b} already up to date"),
            GitOutcome::BranchOutdated(b) => write!(f, "branch {b} is outdated, left"),
            GitOutcome::BranchWithdrawn { branch, was } => {
                write!(f, "deleted outdated branch {branch} (was {})", short(was))
            }
            GitOutcome::Held => f.write_str("held"),
        }
    }
}

impl Serialize for GitOutcome {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl schemars::JsonSchema for GitOutcome {
    fn schema_name() -> String {
        "GitOutcome".into()
    }
    fn json_schema(g: &mut schemars::gen::SchemaGenerator) -> schemars::schema::Schema {
        String::json_schema(g)
    }
}

/// Overall result of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum RunStatus {
    /// Changes committed (or proposed) and the controller runs the base version.
    Success,
    /// Nothing to change; the controller runs the base version.
    Unchanged,
    /// Git work done, but the controller push (or the run record) is still pending.
    Pending,
    /// The PR branch has commits by people; left alone.
    Held,
    /// The run failed; nothing was written.
    Failed,
}

impl RunStatus {
    /// The word stored in `runs.status`.
    pub fn as_str(self) -> &'static str {
        match self {
            RunStatus::Success => "success",
            RunStatus::Unchanged => "unchanged",
            RunStatus::Pending => "pending",
            RunStatus::Held => "held",
            RunStatus::Failed => "failed",
        }
    }
}

/// Everything a run did, for people (`Display`), the store and the exit status.
#[derive(Debug, Clone, Serialize, schemars::JsonSchema)]
pub struct RunOutcome {
    /// Why it ran.
    pub trigger: String,
    /// Overall status.
    pub status: RunStatus,
    /// Start.
    pub started_at: DateTime<Utc>,
    /// End.
    pub finished_at: DateTime<Utc>,
    /// What the writer did, in words (`committed`, `unchanged`, `pushed branch rlc/quotas`,
    /// ...).
    pub git: Option<GitOutcome>,
    /// The commit made (direct) or the PR branch tip (pull-request).
    pub commit: Option<String>,
    /// The base branch tip the controller should run.
    pub base_commit: Option<String>,
    /// Attempts the writer needed.
    pub attempts: u32,
    /// The pull request opened or updated.
    pub pull_request: Option<(u64, Option<String>)>,
    /// Pull requests closed because their proposal became outdated (the plan equals the
    /// base branch again).
    pub closed_pull_requests: Vec<(u64, Option<String>)>,
    /// The version the controller confirmed.
    pub version_pushed: Option<String>,
    /// Why the controller push is pending.
    pub push_error: Option<String>,
    /// Why the run is not recorded (yet).
    pub store_error: Option<String>,
    /// Id of the stored run.
    pub run_id: Option<i64>,
    /// The id `rlc` gave the run before it started (see [`new_run_uid`]): what
    /// `POST /v1/runs` answers and `GET /v1/runs/{id}` takes; stored with the run.
    pub run_uid: String,
    /// Why the run failed.
    pub error: Option<String>,
    /// What changed.
    pub summary: ChangeSummary,
    /// What the plan skipped.
    pub skipped: Vec<Skipped>,
    /// Services whose history failed or was incomplete; they kept their current quotas
    /// (exit 4, or 1 when that is every service).
    pub history_failed: Vec<String>,
    /// Services with a series whose history is not plausible: those buckets kept their
    /// quotas, the others were computed (exit 4).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history_refused: Vec<String>,
    /// The verdict on every shadow bucket that could be promoted (`promotion:` in
    /// `rlc/policies.yaml`): proposed for `mode: enforce`, or why it stays in shadow.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub promotions: Vec<PromotionNote>,
    /// Direct mode: changes that `promotion.auto_merge` does not let rlc commit on the base
    /// branch (proposed on the pull-request branch when a forge is configured, else held).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub needs_review: Vec<NeedsReview>,
    /// Direct mode: what happened to the changes that need review, in words.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub review: Option<String>,
    /// Why the shadow figures could not be read (nothing was promoted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shadow_error: Option<String>,
    /// The rollouts open after the run's push (`rollout:` in `rlc/policies.yaml`): each
    /// change that could refuse more traffic, baking as a candidate (in which region, since
    /// when, the virtual drops so far), or aborted and why.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rollouts: Vec<rollout::RolloutView>,
    /// Set when the outcome was rebuilt from the store's record of the run (`GET
    /// /v1/runs/last` of a daemon that has not finished a run since it started): the record's
    /// summary in words. The record keeps the trigger, status, times, commit, pull request,
    /// pushed version, error and ids; the other fields (`git`, `base_commit`, `attempts`,
    /// `summary`, `skipped`, `history_failed`, `promotions`, …) are then empty, and this text
    /// says what they said. Absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_store: Option<String>,
    /// The full markdown report of the proposal (the pull request's body before truncation);
    /// stored with the run, never committed.
    #[serde(skip)]
    pub report: Option<String>,
}

/// A new run id: 32 random hex digits. Daemon replicas and restarts never share one
/// (128 random bits), so it needs no coordination and exists before the store has the run.
pub fn new_run_uid() -> String {
    format!("{:032x}", rand::random::<u128>())
}

impl RunOutcome {
    fn new(trigger: &str, run_uid: &str) -> RunOutcome {
        let now = Utc::now();
        RunOutcome {
            run_uid: run_uid.into(),
            trigger: trigger.into(),
            status: RunStatus::Failed,
            started_at: now,
            finished_at: now,
            git: None,
            commit: None,
            base_commit: None,
            attempts: 0,
            pull_request: None,
            closed_pull_requests: vec![],
            version_pushed: None,
            push_error: None,
            store_error: None,
            run_id: None,
            error: None,
            summary: ChangeSummary::default(),
            skipped: vec![],
            history_failed: vec![],
            history_refused: vec![],
            promotions: vec![],
            needs_review: vec![],
            review: None,
            shadow_error: None,
            rollouts: vec![],
            from_store: None,
            report: None,
        }
    }

    /// The outcome as far as the store's record of the run `r` keeps it ([`RunOutcome::from_store`]
    /// says so and holds the record's summary in words); None for a status word this version
    /// does not know.
    pub fn from_record(r: &crate::store::RunRecord) -> Option<RunOutcome> {
        let status = [
            RunStatus::Success,
            RunStatus::Unchanged,
            RunStatus::Pending,
            RunStatus::Held,
            RunStatus::Failed,
        ]
        .into_iter()
        .find(|s| s.as_str() == r.status)?;
        let mut out = RunOutcome::new(&r.trigger, r.run_uid.as_deref().unwrap_or_default());
        out.status = status;
        out.started_at = r.started_at;
        out.finished_at = r.finished_at;
        out.commit = r.commit_sha.clone();
        out.version_pushed = r.version_pushed.clone();
        out.run_id = Some(r.id);
        out.error = r.error.clone();
        out.pull_request = r
            .pr_number
            .and_then(|n| u64::try_from(n).ok())
            .map(|n| (n, r.pr_url.clone()));
        out.from_store = Some(r.summary.clone());
        Some(out)
    }

    /// Exit status of `rlc run --once` ([`crate::exit`]): 0 done (changed or not), 1 failed
    /// (nothing written; also when the history failed for every service), 2 git work done
    /// but the controller push or the run record is pending, 3 the PR branch is held by
    /// human commits, 4 done but some services kept their quotas because their history
    /// failed. When several apply, the first of 1, 3, 2, 4 wins.
    pub fn exit_code(&self) -> i32 {
        use crate::exit;
        match self.status {
            RunStatus::Failed => exit::FAILED,
            RunStatus::Held => exit::HELD,
            RunStatus::Pending => exit::PENDING,
            RunStatus::Success | RunStatus::Unchanged
                if !self.history_failed.is_empty() || !self.history_refused.is_empty() =>
            {
                exit::PARTIAL
            }
            RunStatus::Success | RunStatus::Unchanged => exit::OK,
        }
    }

    fn finish(&mut self) {
        self.finished_at = Utc::now();
        self.status = if self.error.is_some() {
            RunStatus::Failed
        } else if self.git == Some(GitOutcome::Held) {
            RunStatus::Held
        } else if self.push_error.is_some() || self.store_error.is_some() {
            RunStatus::Pending
        } else if self.summary.is_empty() && self.pull_request.is_none() {
            // (Direct mode may commit nothing and still propose what needs review.)
            RunStatus::Unchanged
        } else {
            RunStatus::Success
        };
    }

    fn services_json(&self) -> String {
        let mut v: Vec<serde_json::Value> = self
            .summary
            .services
            .iter()
            .map(|s| {
                serde_json::json!({
                    "service": s.service,
                    "outcome": if self.error.is_some() { "failed".to_string() } else { self.git.as_ref().map(ToString::to_string).unwrap_or_default() },
                    "changes": s.changes.len(),
                })
            })
            .collect();
        for sk in &self.skipped {
            v.push(serde_json::json!({
                "service": sk.service, "caller": sk.caller, "procedure": sk.procedure,
                "outcome": "skipped", "reason": sk.reason,
            }));
        }
        serde_json::Value::Array(v).to_string()
    }
}

impl std::fmt::Display for RunOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "rlc run ({}): {}", self.trigger, self.status.as_str())?;
        if let Some(e) = &self.error {
            writeln!(f, "  error: {e}")?;
        }
        if let Some(g) = &self.git {
            write!(f, "  git: {g}")?;
            if let Some(c) = &self.commit {
                write!(f, " {}", short(c))?;
            }
            if self.attempts > 1 {
                write!(f, " after {} attempts (the remote moved)", self.attempts)?;
            }
            writeln!(f, " — {}", self.summary.counts_line())?;
        }
        for s in &self.summary.services {
            for c in &s.changes {
                let fmt = |v: Option<f64>| v.map(schema::format_rps).unwrap_or_else(|| "-".into());
                write!(
                    f,
                    "    {}/{}: {} {} -> {}",
                    s.service,
                    c.bucket,
                    c.kind.as_str(),
                    fmt(c.old_limit_rps),
                    fmt(c.new_limit_rps)
                )?;
                // Mode and scope changes named, not hidden behind "modified".
                let details = c.details();
                if details.is_empty() {
                    writeln!(f)?;
                } else {
                    writeln!(f, " ({})", details.join(", "))?;
                }
            }
        }
        if let Some((n, url)) = &self.pull_request {
            writeln!(f, "  pull request: #{n} {}", url.as_deref().unwrap_or(""))?;
        }
        for (n, url) in &self.closed_pull_requests {
            writeln!(
                f,
                "  pull request: #{n} closed, its proposal is outdated {}",
                url.as_deref().unwrap_or("")
            )?;
        }
        match (&self.version_pushed, &self.push_error) {
            (Some(v), _) => writeln!(f, "  controller: running {}", short(v))?,
            (None, Some(e)) => writeln!(f, "  controller: push pending ({e}); the commit stands")?,
            _ => {}
        }
        match (&self.run_id, &self.store_error) {
            (Some(id), _) => writeln!(f, "  store: recorded as run {id}")?,
            (None, Some(e)) => writeln!(f, "  store: not recorded yet ({e})")?,
            _ => {}
        }
        for sk in &self.skipped {
            let what = sk.target();
            writeln!(f, "  skipped {what}: {}", sk.reason)?;
        }
        for p in &self.promotions {
            if p.promoted {
                writeln!(
                    f,
                    "  promotion {}/{}: proposed for mode enforce",
                    p.service, p.bucket
                )?;
            } else {
                writeln!(
                    f,
                    "  promotion {}/{}: stays in shadow ({})",
                    p.service, p.bucket, p.reason
                )?;
            }
        }
        if let Some(e) = &self.shadow_error {
            writeln!(f, "  shadow figures unavailable ({e}): nothing promoted")?;
        }
        for r in &self.rollouts {
            writeln!(
                f,
                "  rollout {}/{} ({}): {}",
                r.service, r.bucket, r.change, r.summary
            )?;
        }
        for r in &self.needs_review {
            writeln!(
                f,
                "  needs review {}/{} ({}): {}",
                r.service,
                r.bucket,
                r.class.as_str(),
                r.change
            )?;
        }
        if let Some(r) = &self.review {
            writeln!(f, "  review: {r}")?;
        }
        if !self.history_failed.is_empty() && self.error.is_none() {
            writeln!(
                f,
                "  history failed for {}: kept their current quotas",
                self.history_failed.join(", ")
            )?;
        }
        if !self.history_refused.is_empty() && self.error.is_none() {
            writeln!(
                f,
                "  history not plausible for some buckets of {}: they kept their quotas (see skipped)",
                self.history_refused.join(", ")
            )?;
        }
        Ok(())
    }
}

/// A reusable cycle runner: keeps the store connection and the records waiting for it.
pub struct Cycle {
    cfg: DaemonConfig,
    base_dir: PathBuf,
    store: Mutex<Option<Store>>,
    /// The SQLite file of the first connection (a reconnection must find the same file).
    opened: Mutex<Option<crate::store::SqliteFile>>,
    /// Run records on their way to the store.
    journal: Journal,
    /// Backoff of the controller push inside a run.
    pub push_backoff: Backoff,
    /// Attempts when the remote base moves underneath.
    pub git_attempts: u32,
    /// Where the shadow figures of promotion candidates come from (`None`: the store, through
    /// [`promotion::store_stats`]).
    shadow: Option<ShadowSource>,
    /// The daemon's history snapshot, handed to the planner (see [`PlanInput`]).
    pub history_cache: Option<Arc<HistoryCache>>,
    /// When [`Cycle::poll`] last synced the working copy (taken by the next run's sync).
    polled: std::sync::Mutex<Option<std::time::Instant>>,
    /// The version each region's controller last confirmed.
    pushed: std::sync::Mutex<std::collections::BTreeMap<String, String>>,
}

impl Cycle {
    /// A cycle for `cfg`; `base_dir` is the directory of rlc.yaml.
    pub fn new(cfg: DaemonConfig, base_dir: &Path) -> Cycle {
        Cycle {
            journal: Journal::of(&cfg, base_dir),
            cfg,
            base_dir: base_dir.to_path_buf(),
            store: Mutex::new(None),
            opened: Mutex::new(None),
            push_backoff: Backoff::default(),
            git_attempts: 3,
            shadow: None,
            history_cache: None,
            polled: std::sync::Mutex::new(None),
            pushed: Default::default(),
        }
    }

    /// Plugs in the source of shadow figures; without one, the figures come from the store
    /// (`promotion::store_stats`).
    pub fn set_shadow_source(&mut self, source: ShadowSource) {
        self.shadow = Some(source);
    }

    /// Where the shadow figures of promotion candidates come from: the set source, or the
    /// store (a store that is down gives none, and its error: nothing is promoted).
    async fn shadow_source(
        &self,
        store: &StoreWitness,
    ) -> Result<ShadowSource, gather::StoreUnavailable> {
        match &self.shadow {
            Some(s) => Ok(s.clone()),
            None => store.shadow_source(),
        }
    }

    /// The daemon config.
    pub fn config(&self) -> &DaemonConfig {
        &self.cfg
    }

    /// Directory of rlc.yaml.
    pub fn base_dir(&self) -> &Path {
        &self.base_dir
    }

    fn writer_config(&self) -> WriterConfig {
        let mut w = WriterConfig::from_config(&self.cfg.config_repo, &self.base_dir);
        w.max_attempts = self.git_attempts;
        w
    }

    /// The store, connecting (and migrating) on first use or after a failure.
    ///
    /// A SQLite store is created only by the first connection of this process; afterwards it
    /// must stay the same file: deleted or replaced underneath, it is an error
    /// ([`crate::store::StoreError::Vanished`]), never a silently created new database.
    pub async fn store(&self) -> Result<Store, crate::store::StoreError> {
        let mut g = self.store.lock().await;
        if let Some(s) = g.as_ref() {
            return Ok(s.clone());
        }
        let mut opened = self.opened.lock().await;
        let s = match opened.as_ref() {
            None => Store::connect(&self.cfg.database_url, &self.base_dir).await?,
            Some(f) => Store::reconnect(&self.cfg.database_url, &self.base_dir, Some(f)).await?,
        };
        if opened.is_none() {
            *opened = s.sqlite_file().cloned();
        }
        *g = Some(s.clone());
        Ok(s)
    }

    /// Run records waiting for the store (in the journal).
    pub async fn pending_records(&self) -> usize {
        self.journal.len()
    }

    /// Writes the journal's records to the store; returns how many were written.
    pub async fn flush_pending(&self) -> usize {
        if self.journal.is_empty() {
            return 0;
        }
        let Ok(store) = self.store().await else {
            return 0;
        };
        match self.journal.replay(&store).await {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(error = %e, "store still unavailable");
                *self.store.lock().await = None;
                0
            }
        }
    }

    /// The one fetch of a run: fetches the config repo, moves its working copy to the base
    /// tip, and reads the base there ([`gather::read_base`]: the config repo at the tip, its
    /// decreases). A working copy cloned just now is not fetched again.
    pub async fn sync_base(&self) -> anyhow::Result<(PathBuf, Base)> {
        let wcfg = self.writer_config();
        let dir = wcfg.path.clone();
        let cfg = self.cfg.clone();
        // The daemon's poll synced the working copy moments ago and found a reason to run:
        // the run decides on what that poll fetched instead of fetching again.
        let polled = self
            .polled
            .lock()
            .unwrap()
            .take()
            .is_some_and(|t| t.elapsed() < POLL_FRESH);
        tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
            let w = Writer::open(wcfg)?;
            if !polled {
                w.sync()?;
            }
            let base = gather::read_base(&w, &dir, &cfg, Utc::now())?;
            Ok((dir, base))
        })
        .await?
    }

    /// One fetch for the daemon's poll: syncs the working copy to the base tip and returns the
    /// hash of `rlc/*.yaml` there with the base's bucket files as the desired config.
    pub async fn poll(&self) -> anyhow::Result<(String, BaseState)> {
        // Not under another process's run (an `rlc run --once` beside the daemon): its working
        // copy is in use; the next poll will see what it did.
        let lock = FileLock::open(&self.lock_path());
        if let Ok(l) = &lock {
            if let Ok(false) = l.try_take() {
                anyhow::bail!("another rlc run works on the config repo; this poll is skipped");
            }
        }
        let wcfg = self.writer_config();
        let polled = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
            let w = Writer::open(wcfg)?;
            w.sync()?;
            let hash = w.inputs_hash()?;
            let base = BaseState::of(&w)?;
            Ok((hash, base))
        })
        .await??;
        *self.polled.lock().unwrap() = Some(std::time::Instant::now());
        Ok(polled)
    }

    /// Records as applied each bucket's newest proposed change that the base branch `base`
    /// now holds (a person merged its pull request): the quota history, the dashboard and
    /// the decrease guard see it at the next poll instead of the next run. Returns how many.
    pub async fn record_merged(&self, base: &BaseState) -> anyhow::Result<usize> {
        let store = self.store().await?;
        let proposals = store.open_proposals().await?;
        let held = |service: &str, bucket: &str| {
            base.doc
                .services
                .iter()
                .find(|f| f.service == service)
                .and_then(|f| f.buckets.iter().find(|b| b.name == bucket))
        };
        let merged: Vec<i64> = proposals
            .into_iter()
            .filter(
                |(_, service, bucket, limit, mode)| match (held(service, bucket), limit) {
                    (Some(b), Some(l)) => {
                        b.limit_rps == *l && mode.as_deref().is_none_or(|m| m == b.mode.as_str())
                    }
                    (None, None) => true,
                    _ => false,
                },
            )
            .map(|(id, ..)| id)
            .collect();
        if !merged.is_empty() {
            store.mark_applied(&merged).await?;
            tracing::info!(
                changes = merged.len(),
                version = %base.doc.version,
                "proposed changes found merged on the base branch: recorded as applied"
            );
        }
        Ok(merged.len())
    }

    /// The base tip's bucket files as the controller's desired config, as last fetched (a run
    /// moves the local base ref with what it pushed).
    pub async fn desired(&self) -> anyhow::Result<BaseState> {
        let wcfg = self.writer_config();
        tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
            let w = Writer::open(wcfg)?;
            Ok(BaseState::of(&w)?)
        })
        .await?
    }

    /// Brings every controller of rlc.yaml to the base `base`, through the rollouts
    /// ([`rollout`]): the base is accounted (a change that could refuse more traffic becomes
    /// a rollout) and each region's controller gets [`rollout::desired_for`] its region.
    /// `backoff`: retry each controller (a run); `None`: one attempt, and a controller that
    /// confirmed the same version before is not asked again (the daemon's poll). With
    /// `rollout:` set and the store unavailable nothing is pushed: the controllers keep what
    /// they run.
    pub async fn push_all(&self, base: &BaseState, backoff: Option<Backoff>) -> PushReport {
        let mut report = PushReport::default();
        let controllers = self.cfg.region_controllers();
        if controllers.is_empty() {
            return report;
        }
        let now = Utc::now();
        let regions: Vec<String> = controllers.iter().map(|(r, _)| r.clone()).collect();
        let wants = base.policies.as_ref().is_some_and(|p| p.rollout.is_some());
        let input = rollout::BaseInput {
            doc: &base.doc,
            policies: base.policies.as_ref(),
            inputs: &base.inputs,
        };
        let mut store = None;
        let mut open = Vec::new();
        let accounted = match self.store().await {
            Ok(st) => rollout::account(&st, &regions, &input, now)
                .await
                .map(|o| (st, o)),
            Err(e) => Err(e),
        };
        match accounted {
            Ok((st, o)) => {
                open = o;
                store = Some(st);
            }
            Err(e) if wants => {
                // A conflict (another rlc process wrote a rollout meanwhile) is no broken
                // connection: the next push accounts again on what the store holds.
                if !matches!(e, crate::store::StoreError::Conflict(_)) {
                    *self.store.lock().await = None;
                }
                report.errors.push(format!(
                    "rollout state unavailable ({e}): the controllers keep what they run"
                ));
                return report;
            }
            Err(e) => {
                tracing::warn!(error = %e, "store unavailable: the controllers get the base as it is (no rollout: in rlc/policies.yaml)");
            }
        }
        for (region, c) in controllers {
            let client = match ControllerClient::from_config(&c, &self.base_dir) {
                Ok(c) => c,
                Err(e) => {
                    report.errors.push(format!("{region}: {e}"));
                    continue;
                }
            };
            let mut doc = rollout::desired_for(&region, &base.doc, &open);
            if !doc.candidates.is_empty() {
                match client.status_proto().await {
                    Ok((_, p)) if p < 5 => {
                        tracing::warn!(region, proto = p, "controller predates candidates (grl-proto 5): it keeps the limits in force, the candidates wait");
                        doc.candidates.clear();
                    }
                    Ok(_) => {}
                    Err(e) => {
                        report.errors.push(format!("{region}: {e}"));
                        continue;
                    }
                }
            }
            if backoff.is_none() && self.pushed.lock().unwrap().get(&region) == Some(&doc.version) {
                // Confirmed before with these candidates: a stage start that could not be
                // recorded then (the store failed) is recorded now, or the stage would wait
                // for its deadline as if the candidate never arrived.
                if let (Some(st), false) = (&store, doc.candidates.is_empty()) {
                    if let Err(e) = rollout::reached(st, &mut open, &region, now).await {
                        tracing::warn!(error = %e, "cannot record the start of a rollout stage");
                    }
                }
                report.versions.insert(region, doc.version);
                continue;
            }
            let res = match backoff {
                Some(b) => push::reconcile(&client, &doc, b, |_, _| {}).await,
                None => client.reconcile_once(&doc).await,
            };
            match res {
                Ok(_) => {
                    self.pushed
                        .lock()
                        .unwrap()
                        .insert(region.clone(), doc.version.clone());
                    if let (Some(st), false) = (&store, doc.candidates.is_empty()) {
                        if let Err(e) = rollout::reached(st, &mut open, &region, now).await {
                            tracing::warn!(error = %e, "cannot record the start of a rollout stage");
                        }
                    }
                    report.versions.insert(region, doc.version);
                }
                Err(e) => {
                    self.pushed.lock().unwrap().remove(&region);
                    report.errors.push(format!("{region}: {e}"));
                }
            }
        }
        report.rollouts = open;
        report
    }

    /// The periodic rollout work of `rlc serve`: the candidates' counts from every
    /// controller, the verdicts ([`rollout::judge`]), and each aborted change's config repo
    /// brought back in line (a revert commit in direct mode, a comment and a label on its
    /// pull request in pull-request mode). Returns whether the base branch moved.
    pub async fn rollout_tick(&self) -> bool {
        let Ok(store) = self.store().await else {
            return false;
        };
        let mut open = match rollout::open(&store).await {
            Ok(o) => o,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the rollouts");
                return false;
            }
        };
        if open.is_empty() {
            return false;
        }
        let now = Utc::now();
        if open
            .iter()
            .any(|r| r.state == rollout::RolloutState::Baking)
        {
            for (region, c) in self.cfg.region_controllers() {
                let Ok(client) = ControllerClient::from_config(&c, &self.base_dir) else {
                    continue;
                };
                match client.candidates().await {
                    Ok(page) => {
                        if let Err(e) = rollout::observe(&store, &region, &page, &open, now).await {
                            tracing::warn!(region, error = %e, "cannot store the candidates' counts");
                        }
                    }
                    Err(e) => {
                        tracing::warn!(region, error = %e, "cannot read the controller's candidates")
                    }
                }
            }
            if let Err(e) = rollout::judge(&store, &mut open, now).await {
                tracing::warn!(error = %e, "cannot judge the rollouts");
            }
        }
        let mut moved = false;
        for r in open
            .iter_mut()
            .filter(|r| r.state == rollout::RolloutState::Aborted && r.revert_pending)
        {
            match self.bring_back(&store, r).await {
                Ok(m) => moved |= m,
                Err(e) => {
                    tracing::warn!(id = %r.id, error = %e, "the aborted change is not reverted yet; retrying next poll")
                }
            }
        }
        moved
    }

    /// Brings the config repo back in line with what is enforced after `r` was aborted.
    async fn bring_back(&self, store: &Store, r: &mut rollout::Rollout) -> anyhow::Result<bool> {
        let now = Utc::now();
        let _guard = self
            .exclusive(&StoreWitness::Store(store.clone()))
            .await
            .map_err(|e| anyhow::anyhow!(e))?;
        if self.cfg.config_repo.mode == RepoMode::PullRequest {
            let how = self.propose_revert(store, r).await?;
            rollout::reverted(store, r, how, now).await?;
            return Ok(false);
        }
        let mut wcfg = self.writer_config();
        wcfg.mode = RepoMode::Direct;
        let rr = r.clone();
        let message = revert_message(r);
        let commit = tokio::task::spawn_blocking(move || -> anyhow::Result<Option<String>> {
            let mut w = Writer::open(wcfg)?;
            w.sync()?;
            let Some(plan) = revert_plan(&mut w, &rr)? else {
                return Ok(None);
            };
            w.set_message(message);
            match w.write_as_fetched(&plan, false)?.status {
                WriteStatus::Committed { commit } => Ok(Some(commit)),
                // The base holds the change (checked above): a write that commits nothing did
                // not bring it back, whatever the reason; never recorded as done.
                other => anyhow::bail!(
                    "the revert of {}/{} committed nothing ({other:?}) although the base branch holds the aborted change",
                    rr.service,
                    rr.bucket
                ),
            }
        })
        .await??;
        let how = match &commit {
            Some(c) => format!("reverted by commit {}", short(c)),
            None => "the base branch no longer held the change".to_string(),
        };
        tracing::info!(id = %r.id, service = %r.service, bucket = %r.bucket, how, "config repo brought back in line after an aborted rollout");
        rollout::reverted(store, r, how, now).await?;
        Ok(commit.is_some())
    }

    /// Pull-request mode: the revert pushed to a branch of its own (`<pr_branch>-revert-<id>`)
    /// and proposed in a pull request labelled `rollout-aborted` that names the pull request
    /// which carried the aborted change (the newest one the store recorded for the bucket
    /// with that limit); that one gets a comment with the evidence, a link to the revert and
    /// the label. The controllers keep the limit in force until a person merges the revert.
    async fn propose_revert(&self, store: &Store, r: &rollout::Rollout) -> anyhow::Result<String> {
        let mut wcfg = self.writer_config();
        wcfg.mode = RepoMode::PullRequest;
        wcfg.pr_branch = revert_branch(&wcfg.pr_branch, &r.id);
        let branch = wcfg.pr_branch.clone();
        let rr = r.clone();
        let message = revert_message(r);
        let msg = message.clone();
        type Written = Option<(Plan, crate::gitops::WriteOutcome)>;
        let written = tokio::task::spawn_blocking(move || -> anyhow::Result<Written> {
            let mut w = Writer::open(wcfg)?;
            w.sync()?;
            let Some(plan) = revert_plan(&mut w, &rr)? else {
                return Ok(None);
            };
            w.set_message(msg);
            let out = w.write_as_fetched(&plan, false)?;
            Ok(Some((plan, out)))
        })
        .await??;
        let Some((plan, outcome)) = written else {
            return Ok("the base branch no longer held the change".into());
        };
        if !matches!(
            outcome.status,
            WriteStatus::BranchUpdated { .. } | WriteStatus::BranchUpToDate { .. }
        ) {
            anyhow::bail!(
                "the revert of {}/{} was not pushed to `{branch}` ({:?}) although the base branch holds the aborted change",
                r.service,
                r.bucket,
                outcome.status
            );
        }
        let history = store.quota_history(&r.service, &r.bucket).await?;
        let carried = history
            .iter()
            .rev()
            .filter(|q| q.limit_rps == Some(r.new.limit_rps))
            .find_map(|q| q.pr_number);
        let forge = match &self.cfg.config_repo.forge {
            Some(fc) => Forge::from_config(fc)?.map(|f| (fc, f)),
            None => None,
        };
        let Some((fc, forge)) = forge else {
            return Ok(format!(
                "revert pushed to branch `{branch}`: no forge configured to open its pull request"
            ));
        };
        let mut labels = fc.labels.clone();
        labels.push(ROLLOUT_ABORTED_LABEL.into());
        let forge = forge.decorated(crate::gitops::Decoration {
            labels,
            reviewers: fc.reviewers.clone(),
        });
        let (title, rest) = message.split_once('\n').unwrap_or((&message, ""));
        let mut body = rest.trim_start().to_string();
        if let Some(n) = carried {
            body.push_str(&format!("\nReverts the change of #{n}.\n"));
        }
        // The change as every pull request of rlc shows it: its table.
        let report = summary::report_with(
            &plan,
            &outcome.summary,
            &summary::ReportContext {
                promotions: &[],
                dashboard_url: fc.dashboard_url.as_deref(),
            },
        );
        body.push('\n');
        body.push_str(&report);
        let body = summary::truncate_body(&body, FORGE_BODY_LIMIT);
        let (PullRequest { number, .. }, _) = forge
            .upsert_pull_request(&branch, &self.cfg.config_repo.branch, title, &body)
            .await?;
        let Some(n) = carried else {
            return Ok(format!(
                "revert proposed in pull request #{number}, labelled `{ROLLOUT_ABORTED_LABEL}`"
            ));
        };
        let comment = format!(
            "Rollout aborted by rlc: `{}/{}` {} was tried as a candidate and {}\n\nThe controllers keep the limit in force. The revert is proposed in #{number} (rlc does not propose this change again until its inputs change).",
            r.service,
            r.bucket,
            r.change,
            r.reason.as_deref().unwrap_or("failed"),
        );
        forge
            .comment_and_label(n as u64, &comment, ROLLOUT_ABORTED_LABEL)
            .await?;
        Ok(format!(
            "revert proposed in pull request #{number}, labelled `{ROLLOUT_ABORTED_LABEL}`; commented on pull request #{n}"
        ))
    }

    /// Syncs the repo, asks `planner` for a plan, and applies it. Never returns an error: a
    /// failure is a failed outcome (recorded like any run).
    pub async fn run(&self, planner: &Planner, trigger: &str) -> RunOutcome {
        self.run_as(planner, trigger, &new_run_uid()).await
    }

    /// [`Cycle::run`] under the run id `run_uid` (given out before the run started).
    pub async fn run_as(&self, planner: &Planner, trigger: &str, run_uid: &str) -> RunOutcome {
        let (_guard, store, synced) = match self.begin(trigger, run_uid).await {
            Ok(x) => x,
            Err(out) => return *out,
        };
        let (repo_dir, base) = synced;
        for (region, c) in self.cfg.region_controllers() {
            if let Ok(client) = ControllerClient::from_config(&c, &self.base_dir) {
                // A controller that cannot answer is logged; its region is marked by the poll.
                let _ = self.record_overrides(&region, &client).await;
            }
        }
        tracing::info!(trigger, run_uid, base = %short(&base.commit), "config repo synced");
        let world = Arc::new(self.gather(&base, &store).await);
        tracing::info!(
            trigger,
            run_uid,
            throttled_buckets = world.observed.throttled.len(),
            overridden_buckets = world.observed.overrides.len(),
            "evidence gathered"
        );
        let planning = std::time::Instant::now();
        let input = PlanInput {
            cfg: self.cfg.clone(),
            base_dir: self.base_dir.clone(),
            repo_dir,
            repo: base.repo.clone(),
            trigger: trigger.to_string(),
            history_cache: self.history_cache.clone(),
            world: world.clone(),
        };
        match planner(input).await {
            Ok(plan) => {
                tracing::info!(
                    trigger,
                    run_uid,
                    buckets = plan.buckets.len(),
                    skipped = plan.skipped.len(),
                    seconds = format_args!("{:.1}", planning.elapsed().as_secs_f64()),
                    "plan computed"
                );
                self.apply_planned(plan, &base, &world, trigger, run_uid)
                    .await
            }
            Err(e) => {
                self.failed(trigger, run_uid, format!("computing the plan: {e:#}"))
                    .await
            }
        }
    }

    /// The start of every run: the store (opened first, so that one deleted or replaced
    /// during the run is noticed instead of being created anew at the end; one that is down
    /// is retried when needed), then the one fetch. A failed fetch is a failed run.
    async fn begin(
        &self,
        trigger: &str,
        run_uid: &str,
    ) -> Result<(RunGuard, StoreWitness, (PathBuf, Base)), Box<RunOutcome>> {
        let store: StoreWitness = self.store().await.into();
        if let StoreWitness::Unavailable(e) = &store {
            tracing::warn!(error = %e, "store unavailable at the start of the run");
        }
        let guard = match self.exclusive(&store).await {
            Ok(g) => g,
            Err(e) => return Err(Box::new(self.failed(trigger, run_uid, e).await)),
        };
        // Records of earlier runs the store could not take, before this run's.
        self.flush_pending().await;
        match self.sync_base().await {
            Ok(synced) => Ok((guard, store, synced)),
            Err(e) => Err(Box::new(
                self.failed(trigger, run_uid, format!("syncing the config repo: {e:#}"))
                    .await,
            )),
        }
    }

    /// The file beside the working copy whose lock a run holds.
    fn lock_path(&self) -> PathBuf {
        let wc = self.writer_config().path;
        let name = wc
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "config-repo".into());
        wc.with_file_name(format!(".{name}.rlc-lock"))
    }

    /// One run at a time: the working copy's lock (waiting up to [`RUN_LOCK_WAIT`] for a
    /// run of another process), then the store's (Postgres, for runs on other machines). A
    /// store that cannot answer gives no lock: its record waits in the journal anyway.
    async fn exclusive(&self, store: &StoreWitness) -> Result<RunGuard, String> {
        let path = self.lock_path();
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        }
        let lock = FileLock::open(&path)
            .map_err(|e| format!("opening the run lock {}: {e}", path.display()))?;
        let until = tokio::time::Instant::now() + RUN_LOCK_WAIT;
        let mut told = false;
        loop {
            match lock.try_take() {
                Ok(true) => break,
                Ok(false) => {
                    if tokio::time::Instant::now() >= until {
                        return Err(format!(
                            "another rlc run holds {} (waited {}s)",
                            path.display(),
                            RUN_LOCK_WAIT.as_secs()
                        ));
                    }
                    if !told {
                        tracing::info!(lock = %path.display(), "another rlc run works on this config repo: waiting for it");
                        told = true;
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
                Err(e) => return Err(format!("locking {}: {e}", path.display())),
            }
        }
        let lease = match store {
            StoreWitness::Store(s) => match s.lock_runs(RUN_LOCK_WAIT).await {
                Ok(Some(l)) => Some(l),
                Ok(None) => {
                    return Err(format!(
                        "another rlc run holds the store's run lock (waited {}s)",
                        RUN_LOCK_WAIT.as_secs()
                    ))
                }
                Err(e) => {
                    tracing::warn!(error = %e, "the store's run lock cannot be taken");
                    None
                }
            },
            _ => None,
        };
        Ok(RunGuard {
            _lock: lock,
            _lease: lease,
        })
    }

    async fn failed(&self, trigger: &str, run_uid: &str, error: String) -> RunOutcome {
        let mut out = RunOutcome::new(trigger, run_uid);
        tracing::error!(trigger, error = %error, "run failed");
        out.error = Some(error);
        out.finish();
        self.record(&mut out, &Plan::default(), &[]).await;
        out
    }

    /// Applies a computed `plan` (a fixed one: tests, embedding): syncs, gathers the evidence,
    /// finishes the plan with it (decrease guard, promotions, review) and writes, pushes and
    /// records it.
    pub async fn apply(&self, plan: &Plan, trigger: &str) -> RunOutcome {
        self.apply_as(plan, trigger, &new_run_uid()).await
    }

    /// [`Cycle::apply`] under the run id `run_uid`.
    pub async fn apply_as(&self, plan: &Plan, trigger: &str, run_uid: &str) -> RunOutcome {
        match self.begin(trigger, run_uid).await {
            Ok((_guard, store, (_, base))) => {
                let world = self.gather(&base, &store).await;
                self.apply_planned(plan.clone(), &base, &world, trigger, run_uid)
                    .await
            }
            Err(out) => *out,
        }
    }

    /// Records the incident overrides the controller has in force (`GET /v1/overrides`) in the
    /// store, so that the minutes they acted on are left out of what policies learn and the
    /// bucket pages show them. A controller that cannot answer is the error (the caller marks
    /// its region unread); a store that cannot record is logged and skipped: the next poll or
    /// run sees the overrides again while they last.
    pub async fn record_overrides(
        &self,
        region: &str,
        client: &ControllerClient,
    ) -> anyhow::Result<()> {
        let list = match client.overrides().await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the controller's overrides");
                return Err(e.into());
            }
        };
        // An empty list too: the overrides seen before are gone.
        match self.store().await {
            Ok(store) => {
                if let Err(e) = store.record_overrides(region, &list, Utc::now()).await {
                    tracing::warn!(error = %e, "cannot record the controller's overrides");
                }
            }
            Err(e) => tracing::warn!(error = %e, "cannot record the controller's overrides"),
        }
        Ok(())
    }

    /// The evidence of `base`: its past decreases, its candidates' shadow figures, the
    /// throttled and overridden minutes of its window ([`gather::world`]).
    async fn gather(&self, base: &Base, store: &StoreWitness) -> World {
        gather::world(
            &self.cfg,
            base,
            store,
            self.shadow_source(store),
            Utc::now(),
        )
        .await
    }

    /// Finishes `computed` with the evidence `world` gathered on `base` ([`pipeline::finish`]),
    /// then writes → proposes → pushes → records.
    async fn apply_planned(
        &self,
        computed: Plan,
        base: &Base,
        world: &World,
        trigger: &str,
        run_uid: &str,
    ) -> RunOutcome {
        let mut out = RunOutcome::new(trigger, run_uid);
        let now = Utc::now();
        let plan = pipeline::finish(&self.cfg, &base.repo, world, computed, now);
        out.skipped = plan.skipped.clone();
        out.history_failed = plan.history_failed.clone();
        out.history_refused = plan.history_refused.clone();
        out.promotions = plan.promotions.clone();
        out.shadow_error = plan.shadow_error.clone();
        out.needs_review = plan.needs_review.clone();
        // Nothing was computed: write nothing (an open proposal must not look outdated
        // because Prometheus is down) and fail the run.
        if plan.history_failed_everywhere() {
            out.error = Some(match &plan.history_error {
                Some(e) => format!(
                    "history source failed: {e}; nothing computed, every service keeps its current quotas"
                ),
                None => format!(
                    "history failed for every service ({}); nothing computed, every service keeps its current quotas",
                    plan.history_failed.join(", ")
                ),
            });
            out.finish();
            tracing::error!(
                trigger,
                error = out.error.as_deref().unwrap_or_default(),
                "history failed for every service; nothing written"
            );
            self.record(&mut out, &plan, &[]).await;
            return out;
        }
        let (base_files, _) = promotion::repo_inputs(&base.repo);
        // What the base held before this run's write is what is in force, unless rollouts
        // accounted an earlier version already.
        if let StoreWitness::Store(st) = &self.store().await.into() {
            let before = ConfigDoc {
                version: base.commit.clone(),
                services: base_files.values().cloned().collect(),
                ..ConfigDoc::default()
            };
            if let Err(e) = rollout::ensure_accounted(st, &before).await {
                tracing::warn!(error = %e, "cannot record the config in force before the run");
            }
        }
        // Direct mode commits what auto_merge allows; the rest is proposed after.
        let direct = (self.cfg.config_repo.mode == RepoMode::Direct
            && !plan.needs_review.is_empty())
        .then(|| promotion::committable(&plan, &base_files));
        let write_plan = direct.as_ref().unwrap_or(&plan);
        // In pull-request mode with a forge, an outdated proposal's PR is closed (with a
        // comment) before its branch is deleted: GitHub marks a PR whose head becomes part of
        // the base as merged, and closes one whose head is deleted without saying why.
        let forge_cfg = self
            .cfg
            .config_repo
            .forge
            .as_ref()
            .filter(|f| f.kind != "none" && self.cfg.config_repo.mode == RepoMode::PullRequest);
        let mut written = self.write(write_plan, forge_cfg.is_none()).await;
        if let (Ok((w, _)), Some(fc)) = (&written, forge_cfg) {
            if let WriteStatus::BranchOutdated { .. } = w.status {
                if let Err(e) = self.close_outdated(fc, &mut out).await {
                    // Withdraw the branch anyway: an outdated proposal must not stay
                    // mergeable (deleting the head closes the PR on the forge).
                    out.error = Some(format!(
                        "the pull request of outdated branch {} could not be closed: {e:#}",
                        self.cfg.config_repo.pr_branch
                    ));
                }
                written = self.write(write_plan, true).await;
            }
        }
        let (write, desired) = match written {
            Ok(x) => x,
            Err((e, attempts)) => {
                out.attempts = attempts;
                out.error = Some(e);
                out.finish();
                tracing::error!(
                    trigger,
                    error = out.error.as_deref().unwrap_or_default(),
                    "git write failed; nothing written"
                );
                self.record(&mut out, &plan, &[]).await;
                return out;
            }
        };
        out.attempts = write.attempts;
        out.base_commit = Some(desired.version.clone());
        out.summary = write.summary.clone();
        let branch = self.cfg.config_repo.pr_branch.clone();
        out.git = Some(match &write.status {
            WriteStatus::Unchanged => GitOutcome::Unchanged,
            WriteStatus::Committed { commit } => {
                out.commit = Some(commit.clone());
                GitOutcome::Committed
            }
            WriteStatus::BranchUpdated { commit } => {
                out.commit = Some(commit.clone());
                GitOutcome::BranchPushed(branch.clone())
            }
            WriteStatus::BranchUpToDate { commit } => {
                out.commit = Some(commit.clone());
                GitOutcome::BranchUpToDate(branch.clone())
            }
            WriteStatus::BranchOutdated { commit } => {
                // Only when the PR could not be closed and the branch moved meanwhile.
                out.commit = Some(commit.clone());
                GitOutcome::BranchOutdated(branch.clone())
            }
            WriteStatus::BranchWithdrawn { commit } => GitOutcome::BranchWithdrawn {
                branch: branch.clone(),
                was: commit.clone(),
            },
            WriteStatus::BranchHeldByHumans { authors } => {
                out.error = None;
                tracing::warn!(authors = %authors.join(", "), "PR branch left alone: it has commits by people");
                out.skipped.push(Skipped {
                    service: "*".into(),
                    caller: None,
                    procedure: None,
                    reason: format!(
                        "branch {branch} has commits by {}; not overwritten (merge or delete it)",
                        authors.join(", ")
                    ),
                });
                GitOutcome::Held
            }
        });
        let proposal = out.git.as_ref().is_some_and(GitOutcome::proposed);
        // The changes this run recorded: applied on the base branch, or proposed on the
        // pull-request branch.
        let mut recorded: Vec<(ChangeSummary, ChangeState, bool)> = Vec::new();
        match out.git {
            Some(GitOutcome::Committed) => {
                recorded.push((write.summary.clone(), ChangeState::Applied, false))
            }
            Some(GitOutcome::BranchPushed(_)) => {
                recorded.push((write.summary.clone(), ChangeState::Proposed, true))
            }
            _ => {}
        }
        if !recorded.is_empty() {
            // The changes are on the remote now: their record must survive whatever comes
            // next (a store that is down, a kill before the record). Replaced by the final
            // record at the end of the run.
            let mut provisional = out.clone();
            provisional.status = RunStatus::Pending;
            provisional.finished_at = Utc::now();
            provisional.store_error = Some(
                "the run was interrupted after its git write; recorded from the journal".into(),
            );
            if let Err(e) = self
                .journal
                .write(&self.record_of(&provisional, &plan, &recorded))
            {
                tracing::warn!(dir = %self.journal.dir().display(), error = %e, "cannot journal the run before its push");
            }
        }
        if direct.is_some() && out.error.is_none() {
            if let Some(proposed) = self.propose_for_review(&plan, &mut out).await {
                recorded.push((proposed, ChangeState::Proposed, true));
            }
        }
        if proposal && self.cfg.config_repo.mode == RepoMode::PullRequest {
            if let Err(e) = self
                .open_pull_request(&plan, &write.summary, &mut out)
                .await
            {
                out.error = Some(format!(
                    "branch {} pushed, but the pull request could not be opened or updated: {e}",
                    self.cfg.config_repo.pr_branch
                ));
            }
        }
        // The controllers run what the base branch holds (in PR mode: once a person merged),
        // a change that could refuse more traffic first as a candidate (`rollout:`).
        if out.error.is_none() && !self.cfg.region_controllers().is_empty() {
            let state = BaseState {
                doc: desired.clone(),
                policies: base.repo.policies.as_ref().map(|p| p.value.clone()),
                inputs: base.inputs.clone(),
            };
            let rep = self.push_all(&state, Some(self.push_backoff)).await;
            if rep.errors.is_empty() {
                out.version_pushed = rep.versions.values().next().cloned();
            } else {
                out.push_error = Some(rep.errors.join("; "));
            }
            let now = Utc::now();
            out.rollouts = rep.rollouts.iter().map(|r| r.view(now)).collect();
        }
        out.finish();
        self.record(&mut out, &plan, &recorded).await;
        tracing::info!(
            trigger,
            run_uid,
            status = out.status.as_str(),
            commit = out.commit.as_deref().unwrap_or("none"),
            version = out.version_pushed.as_deref().unwrap_or("none"),
            "run finished"
        );
        out
    }

    /// Renders and writes `plan` on the refs as fetched at the start of the run (withdrawing
    /// an outdated PR branch when `withdraw`), and reads the base tip's bucket files. A
    /// failure carries the attempts the writer made.
    async fn write(
        &self,
        plan: &Plan,
        withdraw: bool,
    ) -> Result<(WriteOutcome, ConfigDoc), (String, u32)> {
        self.write_as(plan, withdraw, self.cfg.config_repo.mode)
            .await
    }

    /// [`Cycle::write`] in `mode` (direct mode proposes the changes that need review on the
    /// pull-request branch).
    async fn write_as(
        &self,
        plan: &Plan,
        withdraw: bool,
        mode: RepoMode,
    ) -> Result<(WriteOutcome, ConfigDoc), (String, u32)> {
        let mut wcfg = self.writer_config();
        wcfg.mode = mode;
        let p = plan.clone();
        let written = tokio::task::spawn_blocking(move || {
            let mut w = match Writer::open(wcfg) {
                Ok(w) => w,
                Err(e) => return (Err(e), 0),
            };
            let res = w.write_as_fetched(&p, withdraw).and_then(|res| {
                let (version, services) = w.base_buckets()?;
                Ok((
                    res,
                    ConfigDoc {
                        version,
                        services,
                        ..ConfigDoc::default()
                    },
                ))
            });
            (res, w.attempts())
        })
        .await;
        match written {
            Ok((Ok(x), _)) => Ok(x),
            Ok((Err(e), attempts)) => Err((e.to_string(), attempts)),
            Err(e) => Err((format!("git task panicked: {e}"), 0)),
        }
    }

    /// Closes the open PR of the stable branch, saying why: the plan equals the base branch.
    async fn close_outdated(
        &self,
        fc: &schema::ForgeConfig,
        out: &mut RunOutcome,
    ) -> anyhow::Result<()> {
        let Some(forge) = Forge::from_config(fc)? else {
            return Ok(());
        };
        let repo = &self.cfg.config_repo;
        let comment = format!(
            "Closed by rlc: this proposal is outdated. The latest run computed quotas equal to \
             the ones on `{}` (for example, traffic came back), so merging this pull request \
             would apply changes that are no longer wanted. Branch `{}` is deleted; rlc opens a \
             new pull request when a change is needed again.",
            repo.branch, repo.pr_branch
        );
        let closed = forge.close_pull_requests(&repo.pr_branch, &comment).await?;
        out.closed_pull_requests = closed.into_iter().map(|p| (p.number, p.html_url)).collect();
        Ok(())
    }

    async fn open_pull_request(
        &self,
        plan: &Plan,
        summary: &ChangeSummary,
        out: &mut RunOutcome,
    ) -> anyhow::Result<()> {
        let Some(fc) = &self.cfg.config_repo.forge else {
            return Ok(());
        };
        let report = summary::report_with(
            plan,
            summary,
            &summary::ReportContext {
                promotions: &out.promotions,
                dashboard_url: fc.dashboard_url.as_deref(),
            },
        );
        let body = summary::truncate_body(&report, FORGE_BODY_LIMIT);
        out.report = Some(report);
        let Some(forge) = Forge::from_config(fc)? else {
            return Ok(());
        };
        let (PullRequest { number, html_url }, _) = forge
            .upsert_pull_request(
                &self.cfg.config_repo.pr_branch,
                &self.cfg.config_repo.branch,
                &summary.title(),
                &body,
            )
            .await?;
        out.pull_request = Some((number, html_url));
        Ok(())
    }

    /// Direct mode: proposes the whole plan (the changes `auto_merge` kept off the base branch)
    /// on the pull-request branch, on top of what was just committed, and opens or updates its
    /// pull request; an outdated proposal is closed and its branch deleted. Without
    /// `config_repo.forge` the changes are held and listed. A failure here leaves the commit
    /// standing and is listed in `skipped` and `review`. Returns the changes proposed on the
    /// branch, when it was pushed.
    async fn propose_for_review(&self, plan: &Plan, out: &mut RunOutcome) -> Option<ChangeSummary> {
        let branch = self.cfg.config_repo.pr_branch.clone();
        let Some(fc) = self.cfg.config_repo.forge.clone() else {
            if !out.needs_review.is_empty() {
                out.review = Some(format!(
                    "{} change(s) held: promotion.auto_merge does not allow them and config_repo.forge is not set",
                    out.needs_review.len()
                ));
                for r in &out.needs_review {
                    out.skipped.push(Skipped {
                        service: r.service.clone(),
                        caller: None,
                        procedure: None,
                        reason: format!(
                            "{}: {} needs review ({} is not in promotion.auto_merge); held",
                            r.bucket,
                            r.change,
                            r.class.as_str()
                        ),
                    });
                }
            }
            return None;
        };
        let mut written = self
            .write_as(plan, fc.kind == "none", RepoMode::PullRequest)
            .await;
        if let Ok((w, _)) = &written {
            if let WriteStatus::BranchOutdated { .. } = w.status {
                if let Err(e) = self.close_outdated(&fc, out).await {
                    tracing::warn!(error = %format!("{e:#}"), "closing the outdated review proposal failed");
                }
                written = self.write_as(plan, true, RepoMode::PullRequest).await;
            }
        }
        let failed = |out: &mut RunOutcome, e: String| {
            tracing::warn!(error = %e, "review proposal failed; the direct commit stands");
            out.review = Some(format!("failed: {e}"));
            out.skipped.push(Skipped {
                service: "*".into(),
                caller: None,
                procedure: None,
                reason: format!("the changes that need review were not proposed: {e}"),
            });
        };
        let w = match written {
            Ok((w, _)) => w,
            Err((e, _)) => {
                failed(out, e);
                return None;
            }
        };
        match &w.status {
            WriteStatus::BranchUpdated { .. } | WriteStatus::BranchUpToDate { .. } => {
                out.review = Some(format!("proposed on branch {branch}"));
                if let Err(e) = self.open_pull_request(plan, &w.summary, out).await {
                    failed(out, format!("branch {branch} pushed, but the pull request could not be opened or updated: {e:#}"));
                }
                if matches!(w.status, WriteStatus::BranchUpdated { .. }) {
                    return Some(w.summary.clone());
                }
            }
            WriteStatus::BranchWithdrawn { commit } => {
                out.review = Some(format!(
                    "deleted outdated branch {branch} (was {})",
                    short(commit)
                ));
            }
            WriteStatus::BranchHeldByHumans { authors } => {
                out.review = Some(format!(
                    "branch {branch} has commits by {}; left alone",
                    authors.join(", ")
                ));
            }
            _ => {}
        }
        None
    }

    /// The record of the run as it stands: the run and the changes it made, `recorded`
    /// holding each set of changes with whether it was applied (on the base branch) or
    /// proposed (on the pull-request branch), and whether the run's pull request carries it.
    fn record_of(
        &self,
        out: &RunOutcome,
        plan: &Plan,
        recorded: &[(ChangeSummary, ChangeState, bool)],
    ) -> Entry {
        // The pull request the run opened or updated: it carries the changes proposed on its
        // branch (not those direct mode committed).
        let pr_number = out
            .pull_request
            .as_ref()
            .and_then(|(n, _)| i64::try_from(*n).ok());
        let pr_url = out.pull_request.as_ref().and_then(|(_, u)| u.clone());
        let mut quotas: Vec<QuotaRecord> = Vec::new();
        for (summary, state, via_pr) in recorded {
            for s in &summary.services {
                for c in &s.changes {
                    let pb = plan
                        .buckets
                        .iter()
                        .find(|b| b.service == s.service && b.bucket.name == c.bucket);
                    quotas.push(QuotaRecord {
                        service: s.service.clone(),
                        bucket: c.bucket.clone(),
                        change: c.kind.as_str().into(),
                        limit_rps: c.new_limit_rps,
                        previous_limit_rps: c.old_limit_rps,
                        mode: c.new_mode.map(|m| m.as_str().to_string()),
                        policy: pb.map(|b| b.bucket.policy.to_string()),
                        commit_sha: out.commit.clone(),
                        state: *state,
                        evidence: pb
                            .map(|b| serde_json::to_string(&b.evidence).unwrap_or_default())
                            .unwrap_or_else(|| "{}".into()),
                        recorded_at: out.finished_at,
                        pr_number: pr_number.filter(|_| *via_pr),
                        pr_url: pr_url.clone().filter(|_| *via_pr),
                    });
                }
            }
        }
        let run = RunRecord {
            id: 0,
            trigger: out.trigger.clone(),
            started_at: out.started_at,
            finished_at: out.finished_at,
            status: out.status.as_str().into(),
            commit_sha: out.commit.clone(),
            version_pushed: out.version_pushed.clone(),
            services: out.services_json(),
            summary: match &out.report {
                Some(r) => format!("{out}\n{r}"),
                None => out.to_string(),
            },
            error: out.error.clone(),
            run_uid: Some(out.run_uid.clone()),
            pr_number,
            pr_url,
        };
        Entry { run, quotas }
    }

    /// Records the run with the changes it made ([`Cycle::record_of`]): first in the journal,
    /// then in the store (after the journal's older records), and out of the journal once the
    /// store has it. A store that cannot take it leaves it in the journal: the run is
    /// `pending` and says where its record waits.
    async fn record(
        &self,
        out: &mut RunOutcome,
        plan: &Plan,
        recorded: &[(ChangeSummary, ChangeState, bool)],
    ) {
        let entry = self.record_of(out, plan, recorded);
        let journaled = match self.journal.write(&entry) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(dir = %self.journal.dir().display(), error = %e, "cannot write the run record to the journal");
                false
            }
        };
        self.flush_pending().await;
        let res = match self.store().await {
            Ok(s) => s.record_run(&entry.run, &entry.quotas).await,
            Err(e) => Err(e),
        };
        match res {
            Ok(id) => {
                out.run_id = Some(id);
                self.journal.remove(&entry.run);
            }
            Err(e) => {
                *self.store.lock().await = None;
                let kept = if journaled {
                    format!(
                        "; kept in the journal {} until the store takes it",
                        self.journal.dir().display()
                    )
                } else {
                    "; the journal could not keep it either".to_string()
                };
                tracing::warn!(error = %e, journaled, "store unavailable: the run record waits");
                out.store_error = Some(format!("{e}{kept}"));
                if out.status != RunStatus::Failed && out.status != RunStatus::Held {
                    out.status = RunStatus::Pending;
                }
            }
        }
    }
}

/// Applies a computed plan once: render → validate → commit/PR → push → record.
/// `base_dir` is the directory of rlc.yaml (relative paths in it start there).
pub async fn apply_plan(
    cfg: &DaemonConfig,
    base_dir: &Path,
    plan: &Plan,
    trigger: &str,
) -> anyhow::Result<RunOutcome> {
    Ok(Cycle::new(cfg.clone(), base_dir).apply(plan, trigger).await)
}

pub mod compute;
#[cfg(test)]
mod rollout_tests;
#[cfg(test)]
pub(crate) mod tests;
