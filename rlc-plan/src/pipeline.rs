//! The one composition of a plan. Every consumer — `rlc run`, `rlc preview`, the quota API,
//! what-if previews, the pull-request body, backtests — calls [`plan`] (or [`finish`] on a
//! computed plan); what differs between them is what they pass in, never the steps:
//!
//! 1. compute: a policy per bucket, planned events, the rails ([`crate::compute`]);
//! 2. the decrease guard, on the evidence gathered before planning ([`crate::guard`]);
//! 3. promotions of ready shadow buckets, on their gathered figures ([`crate::promotion`]);
//! 4. changes whose rollout was aborted held until their inputs change ([`crate::rollout`]);
//! 5. in direct mode, the changes `promotion.auto_merge` leaves for review.
//!
//! A backtest ([`Purpose::Backtest`]) fits from no limit in force: the limits in the repo
//! today were set from the very traffic a backtest holds out, so damping against them (the
//! per-run cap, the small-change threshold, the decrease guard) would leak the held-out
//! window into the fit.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use schema::{ConfigRepo, DaemonConfig, RepoMode};

use crate::censor::Observed;
use crate::compute::compute_plan_censored;
use crate::guard::{self, Decreases};
use crate::history::SeriesSource;
use crate::plan::Plan;
use crate::promotion::{self, BucketKey, NO_REPORTS};
use crate::readiness::ShadowStats;

/// The shadow figures of the base's promotion candidates
/// ([`promotion::base_candidates`]), gathered before planning.
#[derive(Debug, Clone, PartialEq)]
pub enum ShadowEvidence {
    /// The figures of the candidates that have reports (one without is left out: not ready).
    Figures(BTreeMap<BucketKey, ShadowStats>),
    /// They could not be read, and why: nothing is promoted.
    Unavailable(String),
}

/// What a plan depends on besides history and the config repo, gathered before planning.
#[derive(Debug, Clone, PartialEq)]
pub struct World {
    /// Past decreases, for the decrease guard.
    pub decreases: Decreases,
    /// Shadow figures, for promotions.
    pub shadow: ShadowEvidence,
    /// What the controller observed in the window: the minutes each enforced bucket was
    /// throttled (refused demand, left out unless sustained) and the incident overrides that
    /// acted on it (left out): [`crate::censor`].
    pub observed: Observed,
    /// Changes whose rollout was aborted (`rollout:`), held while their inputs stay the same
    /// ([`crate::rollout::hold_aborted`]).
    pub aborted: Vec<crate::rollout::Aborted>,
    /// The digest of the base's `rlc/*.yaml` the aborted changes' fingerprints are checked
    /// against.
    pub inputs: String,
}

impl World {
    /// Nothing known: no past decrease, no shadow report.
    pub fn none() -> World {
        World {
            decreases: Decreases::none(),
            shadow: ShadowEvidence::Figures(BTreeMap::new()),
            observed: Observed::default(),
            aborted: Vec::new(),
            inputs: String::new(),
        }
    }
}

/// What a plan is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    /// What a run would commit: `rlc run`, `rlc preview`, the quota API, what-if previews.
    Run,
    /// A backtest: fitted from no limit in force (see the module's documentation).
    Backtest,
}

/// The plan of `repo` (the base: its documents and the bucket files in force) on `history`,
/// with the evidence of `world`, at `now`. `cfg` must have its paths resolved.
pub fn plan(
    cfg: &DaemonConfig,
    repo: &ConfigRepo,
    history: &dyn SeriesSource,
    world: &World,
    now: DateTime<Utc>,
    purpose: Purpose,
) -> Plan {
    match purpose {
        Purpose::Run => {
            let computed = compute_plan_censored(cfg, repo, history, &world.observed, now);
            finish(cfg, repo, world, computed, now)
        }
        Purpose::Backtest => {
            compute_plan_censored(cfg, &without_limits(repo), history, &world.observed, now)
        }
    }
}

/// Steps 2–4 on a `computed` plan (step 1's result, or a plan given whole): the decrease guard,
/// promotions, and in direct mode the changes that need review.
pub fn finish(
    cfg: &DaemonConfig,
    repo: &ConfigRepo,
    world: &World,
    computed: Plan,
    now: DateTime<Utc>,
) -> Plan {
    let mut plan =
        guard::hold_repeated_decreases(cfg.rails.decrease_interval.0, &world.decreases, computed);
    let (base, policies) = promotion::repo_inputs(repo);
    let services = plan.buckets.iter().map(|b| b.service.clone()).collect();
    let rules = promotion::rules(policies.as_ref(), &services);
    let candidates = promotion::candidates(&plan, &base, policies.as_ref(), &rules);
    let none = BTreeMap::new();
    let (stats, missing, error) = match &world.shadow {
        ShadowEvidence::Figures(m) => (m, NO_REPORTS.to_string(), None),
        // A bucket without figures because they could not be read says so.
        ShadowEvidence::Unavailable(e) => (
            &none,
            format!("shadow figures unavailable: {e}"),
            Some(e.clone()),
        ),
    };
    if !candidates.is_empty() {
        plan.promotions = promotion::apply(&mut plan, &candidates, &rules, stats, &missing, now);
        plan.shadow_error = error;
    }
    promotion::annotate_manual(&mut plan, &base, policies.as_ref(), stats, &missing, now);
    plan = crate::rollout::hold_aborted(plan, &base, &world.inputs, &world.aborted);
    if cfg.config_repo.mode == RepoMode::Direct {
        plan.needs_review = promotion::review_list(&plan, &base, &rules);
    }
    plan
}

/// `repo` without its bucket files: nothing is in force.
fn without_limits(repo: &ConfigRepo) -> ConfigRepo {
    ConfigRepo {
        root: repo.root.clone(),
        policies: repo.policies.clone(),
        contracts: repo.contracts.clone(),
        capacity: repo.capacity.clone(),
        services_complete: repo.services_complete,
        ..ConfigRepo::default()
    }
}
