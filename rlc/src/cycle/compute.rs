//! The computing step a run plugs into its cycle: history pulled (or refreshed in the
//! daemon's snapshot), then a policy per bucket and the rails ([`rlc_plan::compute`]). The run
//! finishes the plan with the evidence it gathered ([`rlc_plan::pipeline::finish`]), so that
//! it is the very plan `rlc preview`, the quota API and what-if previews compute
//! ([`rlc_plan::pipeline::plan`]).

use std::sync::Arc;

use rlc_plan::plan::Plan;

use super::{PlanInput, Planner};
use crate::config::resolve_paths;
use crate::history::{self, PlanHistory};
use rlc_plan::history::SeriesSource as _;

/// The production planner.
pub fn planner() -> Planner {
    Arc::new(|input: PlanInput| Box::pin(compute(input)))
}

/// Pulls the history and computes the plan on the config repo the run read at its base tip.
pub async fn compute(input: PlanInput) -> anyhow::Result<Plan> {
    let mut cfg = input.cfg;
    resolve_paths(&mut cfg, &input.base_dir);
    cfg.config_repo.path = input.repo_dir.to_string_lossy().into_owned();
    // A failed source becomes a history that keeps every current quota (listed in `skipped`).
    // In the daemon the pull goes through its snapshot, which it refreshes.
    // Without the daemon's snapshot (`rlc run`), a Prometheus pull is spilled to disk and the
    // plan computed service by service (bounded memory); the snapshot holds its history whole,
    // as the quota API and what-if need it.
    let history: PlanHistory = match &input.history_cache {
        Some(cache) => cache.refresh().await.history.clone().into(),
        None => {
            let t = std::time::Instant::now();
            let h = history::load_plan_or_unavailable(&cfg, &input.base_dir).await;
            history::pull_seconds().observe(t.elapsed().as_secs_f64());
            history::pulls().inc();
            // A pull that worked logged its own line (`history pulled`: kind, API, series,
            // points, bytes, seconds).
            if let Some(e) = h.source_error() {
                tracing::warn!(
                    seconds = %format_args!("{:.1}", t.elapsed().as_secs_f64()),
                    error = e,
                    "history pull failed: every service keeps its quotas"
                );
            }
            h
        }
    };
    let repo = input.repo;
    let world = input.world;
    let now = chrono::Utc::now();
    tokio::task::spawn_blocking(move || {
        rlc_plan::compute::compute_plan_censored(&cfg, &repo, &history, &world.observed, now)
    })
    .await
    .map_err(|e| anyhow::anyhow!("computing the plan: {e}"))
}
