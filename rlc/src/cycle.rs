//! One RLC run (`rlc run --once`, and every run of the daemon), as its steps, each in its
//! own file:
//!
//! 1. gather ([`gather`]): the store, the run lock ([`lock`]), the config repo synced, the
//!    controllers' overrides, the evidence the plan needs;
//! 2. plan ([`compute`], then [`pipeline::finish`] here): history pulled, a policy per
//!    bucket, the rails, the promotions;
//! 3. write ([`write`]): commit, or the pull-request branch and its PR;
//! 4. push ([`push`]): the base tip to every region's controller;
//! 5. record ([`record`]): the run and its changes in the store (through the journal);
//! 6. roll out ([`roll_out`]): candidates judged, promoted or aborted, aborts brought back.
//!
//! What a run did is its [`RunOutcome`] ([`outcome`]).
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

use crate::gather::{Base, StoreWitness};
use crate::gitops::short;
use crate::gitops::summary::{self, FORGE_BODY_LIMIT};
use crate::gitops::{Forge, PullRequest, WriteOutcome, WriteStatus, Writer, WriterConfig};
use crate::history::snapshot::HistoryCache;
use crate::journal::{Entry, Journal};
use crate::push::ControllerClient;
use crate::retry::Backoff;
use crate::rollout;
use crate::shadow::ShadowSource;
use crate::store::{ChangeState, QuotaRecord, RunRecord, Store};
use grl_wire::ConfigDoc;
use rlc_plan::change::ChangeSummary;
use rlc_plan::plan::{Plan, Skipped};
use rlc_plan::promotion;

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

use crate::BoxFuture;

/// The computing step of a run's plan: history pulled, then a policy per bucket and the rails
/// ([`rlc_plan::compute`]); [`crate::cycle::compute::planner`] in production, a fixed plan in
/// tests. The run then finishes it with the evidence it gathered
/// ([`rlc_plan::pipeline::finish`]: decrease guard, promotions, review).
pub type Planner = Arc<dyn Fn(PlanInput) -> BoxFuture<anyhow::Result<Plan>> + Send + Sync>;

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
        let world = self.gather_step(&base, &store, trigger, run_uid).await;
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

    /// Finishes `computed` with the evidence `world` gathered on `base` ([`pipeline::finish`]),
    /// then the run's steps: write → propose → push → record.
    async fn apply_planned(
        &self,
        computed: Plan,
        base: &Base,
        world: &World,
        trigger: &str,
        run_uid: &str,
    ) -> RunOutcome {
        let mut out = RunOutcome::new(trigger, run_uid);
        let plan = pipeline::finish(&self.cfg, &base.repo, world, computed, Utc::now());
        out.take_notes(&plan);
        // Nothing was computed: write nothing (an open proposal must not look outdated
        // because Prometheus is down) and fail the run.
        if plan.history_failed_everywhere() {
            out.error = Some(nothing_computed(&plan));
            return self
                .end_unwritten(
                    out,
                    &plan,
                    "history failed for every service; nothing written",
                )
                .await;
        }
        let (base_files, _) = promotion::repo_inputs(&base.repo);
        self.account_in_force(base, &base_files).await;
        // Direct mode commits what auto_merge allows; the rest is proposed after.
        let direct = (self.cfg.config_repo.mode == RepoMode::Direct
            && !plan.needs_review.is_empty())
        .then(|| promotion::committable(&plan, &base_files));
        let (write, desired) = match self
            .write_step(direct.as_ref().unwrap_or(&plan), &mut out)
            .await
        {
            Ok(x) => x,
            Err(()) => {
                return self
                    .end_unwritten(out, &plan, "git write failed; nothing written")
                    .await
            }
        };
        let mut recorded = out.take_write(&write, &desired, &self.cfg.config_repo.pr_branch);
        self.journal_before_push(&out, &plan, &recorded);
        self.propose_step(&plan, &write, direct.is_some(), &mut out, &mut recorded)
            .await;
        // The controllers run what the base branch holds (in PR mode: once a person merged),
        // a change that could refuse more traffic first as a candidate (`rollout:`).
        if out.error.is_none() && !self.cfg.region_controllers().is_empty() {
            self.push_step(desired, base, &mut out).await;
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
}

/// Why a run whose history failed for every service wrote nothing.
fn nothing_computed(plan: &Plan) -> String {
    match &plan.history_error {
        Some(e) => format!(
            "history source failed: {e}; nothing computed, every service keeps its current quotas"
        ),
        None => format!(
            "history failed for every service ({}); nothing computed, every service keeps its current quotas",
            plan.history_failed.join(", ")
        ),
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
mod gather;
mod lock;
mod outcome;
mod push;
mod record;
mod roll_out;
mod write;

use lock::RunGuard;
pub use outcome::{new_run_uid, GitOutcome, RunOutcome, RunStatus};
pub use push::{BaseState, PushReport};
pub use roll_out::ROLLOUT_ABORTED_LABEL;
#[cfg(test)]
mod rollout_tests;
#[cfg(test)]
pub(crate) mod tests;
