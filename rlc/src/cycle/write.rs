//! Step 3, write: the plan rendered and committed to the base branch or pushed to the
//! pull-request branch, the outdated proposal closed, the pull request opened or updated,
//! the changes auto-merge does not allow proposed for review.

use super::*;

impl Cycle {
    /// Renders and writes `plan` on the refs as fetched at the start of the run (withdrawing
    /// an outdated PR branch when `withdraw`), and reads the base tip's bucket files. A
    /// failure carries the attempts the writer made.
    pub(super) async fn write(
        &self,
        plan: &Plan,
        withdraw: bool,
    ) -> Result<(WriteOutcome, ConfigDoc), (String, u32)> {
        self.write_as(plan, withdraw, self.cfg.config_repo.mode)
            .await
    }

    /// [`Cycle::write`] in `mode` (direct mode proposes the changes that need review on the
    /// pull-request branch).
    pub(super) async fn write_as(
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
    pub(super) async fn close_outdated(
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

    pub(super) async fn open_pull_request(
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
    pub(super) async fn propose_for_review(
        &self,
        plan: &Plan,
        out: &mut RunOutcome,
    ) -> Option<ChangeSummary> {
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

    /// Writes `plan` (in pull-request mode with a forge, an outdated proposal's PR is closed
    /// first). A failure is noted in `out` (its error and the writer's attempts).
    pub(super) async fn write_step(
        &self,
        plan: &Plan,
        out: &mut RunOutcome,
    ) -> Result<(WriteOutcome, ConfigDoc), ()> {
        // In pull-request mode with a forge, an outdated proposal's PR is closed (with a
        // comment) before its branch is deleted: GitHub marks a PR whose head becomes part of
        // the base as merged, and closes one whose head is deleted without saying why.
        let forge_cfg = self
            .cfg
            .config_repo
            .forge
            .as_ref()
            .filter(|f| f.kind != "none" && self.cfg.config_repo.mode == RepoMode::PullRequest);
        let mut written = self.write(plan, forge_cfg.is_none()).await;
        if let (Ok((w, _)), Some(fc)) = (&written, forge_cfg) {
            if let WriteStatus::BranchOutdated { .. } = w.status {
                if let Err(e) = self.close_outdated(fc, out).await {
                    // Withdraw the branch anyway: an outdated proposal must not stay
                    // mergeable (deleting the head closes the PR on the forge).
                    out.error = Some(format!(
                        "the pull request of outdated branch {} could not be closed: {e:#}",
                        self.cfg.config_repo.pr_branch
                    ));
                }
                written = self.write(plan, true).await;
            }
        }
        written.map_err(|(e, attempts)| {
            out.attempts = attempts;
            out.error = Some(e);
        })
    }

    /// Proposes what the write did not commit: in direct mode, the changes auto-merge does
    /// not allow (`direct`); in pull-request mode, the pushed branch's pull request.
    pub(super) async fn propose_step(
        &self,
        plan: &Plan,
        write: &WriteOutcome,
        direct: bool,
        out: &mut RunOutcome,
        recorded: &mut Vec<(ChangeSummary, ChangeState, bool)>,
    ) {
        let proposal = out.git.as_ref().is_some_and(GitOutcome::proposed);
        if direct && out.error.is_none() {
            if let Some(proposed) = self.propose_for_review(plan, out).await {
                recorded.push((proposed, ChangeState::Proposed, true));
            }
        }
        if proposal && self.cfg.config_repo.mode == RepoMode::PullRequest {
            if let Err(e) = self.open_pull_request(plan, &write.summary, out).await {
                out.error = Some(format!(
                    "branch {} pushed, but the pull request could not be opened or updated: {e}",
                    self.cfg.config_repo.pr_branch
                ));
            }
        }
    }
}
