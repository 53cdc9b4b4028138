//! What a run did ([`RunOutcome`]): its status, what happened in git, the push, the
//! rollouts, and its report as text and JSON.

use super::*;

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
    pub(super) fn new(trigger: &str, run_uid: &str) -> RunOutcome {
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

    pub(super) fn finish(&mut self) {
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

    pub(super) fn services_json(&self) -> String {
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

impl RunOutcome {
    /// Takes the plan's notes: what was skipped, refused or failed, the promotions, the
    /// shadow figures' error, the changes that need review.
    pub(super) fn take_notes(&mut self, plan: &Plan) {
        self.skipped = plan.skipped.clone();
        self.history_failed = plan.history_failed.clone();
        self.history_refused = plan.history_refused.clone();
        self.promotions = plan.promotions.clone();
        self.shadow_error = plan.shadow_error.clone();
        self.needs_review = plan.needs_review.clone();
    }

    /// Takes what the git write did (`branch` is the pull-request branch) and returns the
    /// changes this run records: applied on the base branch, or proposed on the
    /// pull-request branch.
    pub(super) fn take_write(
        &mut self,
        write: &WriteOutcome,
        desired: &ConfigDoc,
        branch: &str,
    ) -> Vec<(ChangeSummary, ChangeState, bool)> {
        self.attempts = write.attempts;
        self.base_commit = Some(desired.version.clone());
        self.summary = write.summary.clone();
        let git = self.git_outcome(&write.status, branch);
        let recorded = match &git {
            GitOutcome::Committed => vec![(write.summary.clone(), ChangeState::Applied, false)],
            GitOutcome::BranchPushed(_) => {
                vec![(write.summary.clone(), ChangeState::Proposed, true)]
            }
            _ => Vec::new(),
        };
        self.git = Some(git);
        recorded
    }

    /// The git outcome of a write's `status`, noting its commit (and, for a branch people
    /// committed to, why it was left alone).
    fn git_outcome(&mut self, status: &WriteStatus, branch: &str) -> GitOutcome {
        let branch = branch.to_string();
        match status {
            WriteStatus::Unchanged => GitOutcome::Unchanged,
            WriteStatus::Committed { commit } => {
                self.commit = Some(commit.clone());
                GitOutcome::Committed
            }
            WriteStatus::BranchUpdated { commit } => {
                self.commit = Some(commit.clone());
                GitOutcome::BranchPushed(branch)
            }
            WriteStatus::BranchUpToDate { commit } => {
                self.commit = Some(commit.clone());
                GitOutcome::BranchUpToDate(branch)
            }
            WriteStatus::BranchOutdated { commit } => {
                // Only when the PR could not be closed and the branch moved meanwhile.
                self.commit = Some(commit.clone());
                GitOutcome::BranchOutdated(branch)
            }
            WriteStatus::BranchWithdrawn { commit } => GitOutcome::BranchWithdrawn {
                branch,
                was: commit.clone(),
            },
            WriteStatus::BranchHeldByHumans { authors } => {
                self.error = None;
                tracing::warn!(authors = %authors.join(", "), "PR branch left alone: it has commits by people");
                self.skipped.push(Skipped {
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
        }
    }
}
