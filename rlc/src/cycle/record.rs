//! Step 5, record: the run and its changes in the store, through the journal when the store
//! is down; merged proposals recorded as applied.

use super::*;

impl Cycle {
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

    pub(super) async fn failed(&self, trigger: &str, run_uid: &str, error: String) -> RunOutcome {
        let mut out = RunOutcome::new(trigger, run_uid);
        tracing::error!(trigger, error = %error, "run failed");
        out.error = Some(error);
        out.finish();
        self.record(&mut out, &Plan::default(), &[]).await;
        out
    }

    /// The record of the run as it stands: the run and the changes it made, `recorded`
    /// holding each set of changes with whether it was applied (on the base branch) or
    /// proposed (on the pull-request branch), and whether the run's pull request carries it.
    pub(super) fn record_of(
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
                        change: c.kind,
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
    pub(super) async fn record(
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

    /// Ends a run that wrote nothing (its `error` says why): finished, logged with `what`,
    /// recorded without changes.
    pub(super) async fn end_unwritten(
        &self,
        mut out: RunOutcome,
        plan: &Plan,
        what: &str,
    ) -> RunOutcome {
        out.finish();
        tracing::error!(
            trigger = %out.trigger,
            error = out.error.as_deref().unwrap_or_default(),
            "{what}"
        );
        self.record(&mut out, plan, &[]).await;
        out
    }

    /// The changes are on the remote now: their record must survive whatever comes next (a
    /// store that is down, a kill before the record). Journaled as a pending run, replaced
    /// by the final record at the end of the run.
    pub(super) fn journal_before_push(
        &self,
        out: &RunOutcome,
        plan: &Plan,
        recorded: &[(ChangeSummary, ChangeState, bool)],
    ) {
        if recorded.is_empty() {
            return;
        }
        let mut provisional = out.clone();
        provisional.status = RunStatus::Pending;
        provisional.finished_at = Utc::now();
        provisional.store_error =
            Some("the run was interrupted after its git write; recorded from the journal".into());
        if let Err(e) = self
            .journal
            .write(&self.record_of(&provisional, plan, recorded))
        {
            tracing::warn!(dir = %self.journal.dir().display(), error = %e, "cannot journal the run before its push");
        }
    }
}
