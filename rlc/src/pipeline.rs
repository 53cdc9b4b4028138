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
use crate::history::PlanHistory;
use crate::plan::Plan;
use crate::planner::{effective_plan, GitHistory};
use crate::preview::load_plan_history;

/// Lengths of the history pulls of this process's plans (`rlc_history_pull_duration_seconds`
/// on `rlc serve`'s `/metrics`): one histogram per process, as the pull happens inside the
/// planner the cycle calls.
pub fn history_pull_seconds() -> &'static prometheus_client::metrics::histogram::Histogram {
    static H: std::sync::OnceLock<prometheus_client::metrics::histogram::Histogram> =
        std::sync::OnceLock::new();
    H.get_or_init(|| {
        prometheus_client::metrics::histogram::Histogram::new(grl_runtime::metrics::RUN_BUCKETS)
    })
}

/// History pulls of this process (`rlc_history_pulls_total`): runs and the quota API's
/// snapshot together.
pub fn history_pulls() -> &'static prometheus_client::metrics::counter::Counter {
    static C: std::sync::OnceLock<prometheus_client::metrics::counter::Counter> =
        std::sync::OnceLock::new();
    C.get_or_init(Default::default)
}

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
    // Without the daemon's snapshot (`rlc run`), a Prometheus pull is spilled to disk and the
    // plan computed service by service (bounded memory); the snapshot holds its history whole,
    // as the quota API and what-if need it.
    let history: PlanHistory = match &input.history_cache {
        Some(cache) => cache.refresh().await.history.clone().into(),
        None => {
            let t = std::time::Instant::now();
            let h = load_plan_history(&cfg, &input.base_dir).await;
            history_pull_seconds().observe(t.elapsed().as_secs_f64());
            history_pulls().inc();
            h
        }
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
