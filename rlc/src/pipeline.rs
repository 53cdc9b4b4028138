//! The planner that `rlc run`, `rlc serve` and `rlc demo` plug into the cycle: history →
//! policies and rails → [`Plan`]. The cycle hands it a working copy already synced to the
//! base branch, so the plan is always computed against what is committed there.

use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context};
use schema::{ConfigRepo, Diagnostics};

use crate::compute::{compute_plan, resolve_paths};
use crate::cycle::{PlanInput, Planner};
use crate::plan::Plan;
use crate::preview::load_history;

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
    let t = std::time::Instant::now();
    let history = load_history(&cfg, &input.base_dir).await;
    history_pull_seconds().observe(t.elapsed().as_secs_f64());
    tokio::task::spawn_blocking(move || compute_plan(&cfg, &repo, &history, chrono::Utc::now()))
        .await
        .context("computing the plan")
}
