//! The planner that `rlc run`, `rlc serve` and `rlc demo` plug into the cycle: history →
//! policies and rails → decrease guard → [`Plan`] ([`crate::planner::effective_plan`], the
//! same function `rlc preview` and the quota API use). The cycle hands it a working copy
//! already synced to the base branch, so the plan is always computed against what is
//! committed there.

use std::path::Path;
use std::sync::Arc;

use anyhow::bail;
use schema::{ConfigRepo, Diagnostics};

use crate::compute::resolve_paths;
use crate::cycle::{PlanInput, Planner};
use crate::plan::Plan;
use crate::planner::{effective_plan, GitHistory};
use crate::preview::load_history;

/// The production planner.
pub fn planner() -> Planner {
    Arc::new(|input: PlanInput| Box::pin(plan(input)))
}

/// Computes the plan for one cycle. A config repo that does not validate is an error: nothing
/// is computed (and so nothing committed) on top of a broken repo.
pub async fn plan(input: PlanInput) -> anyhow::Result<Plan> {
    let mut cfg = input.cfg;
    resolve_paths(&mut cfg, &input.base_dir);
    cfg.config_repo.path = input.repo_dir.to_string_lossy().into_owned();
    let (repo, diags) = ConfigRepo::load(Path::new(&input.repo_dir));
    if !diags.is_empty() {
        bail!("the config repo has problems:\n{}", Diagnostics(diags));
    }
    // A failed source becomes a history that keeps every current quota (listed in `skipped`).
    // In the daemon the pull goes through its snapshot, which it refreshes.
    let history = match &input.history_cache {
        Some(cache) => cache.refresh().await.history.clone(),
        None => Arc::new(load_history(&cfg, &input.base_dir).await),
    };
    effective_plan(
        &cfg,
        &input.base_dir,
        Arc::new(repo),
        history,
        &input.store,
        GitHistory::Fetch,
        chrono::Utc::now(),
    )
    .await
}
