//! Step 4, push: the base branch's tip to every region's controller, each change that
//! could refuse more traffic as a candidate of its rollout.

use super::lock::FileLock;
use super::*;

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

impl Cycle {
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
            // Candidates or criticality sections: only for a controller that reads them.
            if !doc.readable_by(1) {
                match client.status_proto().await {
                    Ok((_, p)) if !doc.readable_by(p) => {
                        if p < grl_wire::PROTO_CANDIDATES && !doc.candidates.is_empty() {
                            tracing::warn!(region, proto = p, "controller predates candidates (grl-proto 5): it keeps the limits in force, the candidates wait");
                        }
                        if p < grl_wire::PROTO_CAPS && doc.has_caps() {
                            tracing::warn!(region, proto = p, "controller predates criticality caps (grl-proto 9): pushed without the bucket files' criticality sections");
                        }
                        doc.for_peer(p);
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
                Some(b) => crate::push::reconcile(&client, &doc, b, |_, _| {}).await,
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

    /// Pushes the base tip the write left (`desired`) to every region's controller.
    pub(super) async fn push_step(&self, desired: ConfigDoc, base: &Base, out: &mut RunOutcome) {
        let state = BaseState {
            doc: desired,
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
}
