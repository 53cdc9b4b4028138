//! Step 1, gather: the store opened, the one run lock taken, the config repo synced to the
//! remote base, the controllers' overrides recorded, and the evidence the plan needs
//! ([`crate::crate::gather::world`]).

use super::*;

impl Cycle {
    /// Where the shadow figures of promotion candidates come from: the set source, or the
    /// store (a store that is down gives none, and its error: nothing is promoted).
    pub(super) async fn shadow_source(
        &self,
        store: &StoreWitness,
    ) -> Result<ShadowSource, crate::gather::StoreUnavailable> {
        match &self.shadow {
            Some(s) => Ok(s.clone()),
            None => store.shadow_source(),
        }
    }

    /// The one fetch of a run: fetches the config repo, moves its working copy to the base
    /// tip, and reads the base there ([`crate::gather::read_base`]: the config repo at the tip, its
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
            let base = crate::gather::read_base(&w, &dir, &cfg, Utc::now())?;
            Ok((dir, base))
        })
        .await?
    }

    /// The start of every run: the store (opened first, so that one deleted or replaced
    /// during the run is noticed instead of being created anew at the end; one that is down
    /// is retried when needed), then the one fetch. A failed fetch is a failed run.
    pub(super) async fn begin(
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
            Err(e) => return Err(Box::new(self.failed(trigger, run_uid, e.to_string()).await)),
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
    /// throttled and overridden minutes of its window ([`crate::gather::world`]).
    pub(super) async fn gather(&self, base: &Base, store: &StoreWitness) -> World {
        crate::gather::world(
            &self.cfg,
            base,
            store,
            self.shadow_source(store),
            Utc::now(),
        )
        .await
    }

    /// The evidence of a run on `base`: the controllers' overrides recorded, then the world
    /// the plan is finished with ([`crate::gather::world`]).
    pub(super) async fn gather_step(
        &self,
        base: &Base,
        store: &StoreWitness,
        trigger: &str,
        run_uid: &str,
    ) -> Arc<World> {
        for (region, c) in self.cfg.region_controllers() {
            if let Ok(client) = ControllerClient::from_config(&c, &self.base_dir) {
                // A controller that cannot answer is logged; its region is marked by the poll.
                let _ = self.record_overrides(&region, &client).await;
            }
        }
        tracing::info!(trigger, run_uid, base = %short(&base.commit), "config repo synced");
        let world = Arc::new(self.gather(base, store).await);
        tracing::info!(
            trigger,
            run_uid,
            throttled_buckets = world.observed.throttled.len(),
            overridden_buckets = world.observed.overrides.len(),
            "evidence gathered"
        );
        world
    }
}
