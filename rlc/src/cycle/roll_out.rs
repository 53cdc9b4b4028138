//! Step 6, roll out: the open rollouts judged on the controllers' counts, promoted stage by
//! stage or aborted, an aborted change brought back (committed, or proposed as a revert
//! pull request).

use super::*;

/// The label put on a pull request whose change's rollout was aborted.
pub const ROLLOUT_ABORTED_LABEL: &str = "rollout-aborted";

/// The branch that carries the revert of rollout `id` in pull-request mode.
pub(super) fn revert_branch(pr_branch: &str, id: &str) -> String {
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
pub(super) fn revert_plan(w: &mut Writer, r: &rollout::Rollout) -> anyhow::Result<Option<Plan>> {
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
pub(super) fn revert_message(r: &rollout::Rollout) -> String {
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

impl Cycle {
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
    pub(super) async fn bring_back(
        &self,
        store: &Store,
        r: &mut rollout::Rollout,
    ) -> anyhow::Result<bool> {
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
    pub(super) async fn propose_revert(
        &self,
        store: &Store,
        r: &rollout::Rollout,
    ) -> anyhow::Result<String> {
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

    /// Accounts what the base held before this run's write as what is in force, unless
    /// rollouts accounted an earlier version already.
    pub(super) async fn account_in_force(
        &self,
        base: &Base,
        base_files: &std::collections::BTreeMap<String, schema::BucketFile>,
    ) {
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
    }
}
