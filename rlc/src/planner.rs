//! The plan a run would really do: [`compute_plan`](crate::compute::compute_plan) followed by the decrease guard (one
//! decrease per bucket per `rails.decrease_interval`). `rlc run` (through the pipeline's
//! planner, and again in `Cycle::apply`), `rlc preview` and the `rlc serve` quota API all call
//! [`effective_plan`], so a preview never shows a decrease the run would hold: a held bucket
//! keeps its current `limit_rps` and says why in `held` (and in `skipped`, as the run does).

use std::path::Path;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use schema::{ConfigRepo, DaemonConfig};

use crate::compute::compute_plan;
use crate::gitops::writer::DECREASE_HISTORY_MAX_COMMITS;
use crate::gitops::{Writer, WriterConfig};
use crate::history::PlanHistory;
use crate::plan::{Held, Plan, PlannedBucket, Skipped};
use crate::store::Store;

/// What the store can say about past decreases.
#[derive(Debug, Clone)]
pub enum StoreWitness {
    /// A connected store: its quota history is asked.
    Store(Store),
    /// No store exists yet (a SQLite file a run would create): it has recorded nothing.
    Empty,
    /// The store cannot say (down, deleted, replaced): every decrease is held.
    Unavailable(String),
}

impl From<Result<Store, crate::store::StoreError>> for StoreWitness {
    fn from(r: Result<Store, crate::store::StoreError>) -> StoreWitness {
        match r {
            Ok(s) => StoreWitness::Store(s),
            Err(e) => StoreWitness::Unavailable(e.to_string()),
        }
    }
}

/// The store of `cfg` for a reader that must write nothing (`rlc preview`): a SQLite file
/// that does not exist is [`StoreWitness::Empty`] (what a run would create), never created.
pub async fn open_store_for_reading(cfg: &DaemonConfig, base_dir: &Path) -> StoreWitness {
    let url = &cfg.database_url;
    if let Some(rest) = url.strip_prefix("sqlite:") {
        let rest = rest.trim_start_matches("//");
        let path = rest.split_once('?').map_or(rest, |(p, _)| p);
        if path != ":memory:" && !path.is_empty() && !base_dir.join(path).exists() {
            return StoreWitness::Empty;
        }
    }
    Store::connect(url, base_dir).await.into()
}

/// Where the config repo's history is read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GitHistory {
    /// Fetch the base branch first (what `rlc run` and `rlc preview` do).
    Fetch,
    /// Use the base branch as last fetched (the daemon's API: the scheduler fetches every
    /// poll, and the plan is keyed by that very tip).
    AsFetched,
}

/// The plan a run would do on `repo` with `history`: [`compute_plan`](crate::compute::compute_plan), then
/// [`hold_repeated_decreases`]. `cfg` must have its paths resolved
/// ([`crate::compute::resolve_paths`]); `base_dir` is the directory of rlc.yaml.
pub async fn effective_plan(
    cfg: &DaemonConfig,
    base_dir: &Path,
    repo: Arc<ConfigRepo>,
    history: impl Into<PlanHistory>,
    store: &StoreWitness,
    git: GitHistory,
    now: DateTime<Utc>,
) -> anyhow::Result<Plan> {
    let c = cfg.clone();
    let history = history.into();
    let plan = tokio::task::spawn_blocking(move || compute_plan(&c, &repo, &history, now))
        .await
        .map_err(|e| anyhow::anyhow!("computing the plan: {e}"))?;
    Ok(hold_repeated_decreases(cfg, base_dir, store, git, plan, now).await)
}

/// [`effective_plan`], then the promotions a run would propose on it
/// ([`crate::promotion::propose`]: ready shadow buckets of `repo` get `mode: enforce`, every
/// candidate its `evidence.promotion`), with the shadow figures of `store`: what `rlc preview`
/// and `GET /v1/quotas` show, so that they propose what `rlc run` writes. Returns the
/// promotion notes and the shadow source's error too.
pub async fn proposed_plan(
    cfg: &DaemonConfig,
    base_dir: &Path,
    repo: Arc<ConfigRepo>,
    history: impl Into<PlanHistory>,
    store: &StoreWitness,
    git: GitHistory,
    now: DateTime<Utc>,
) -> anyhow::Result<(Plan, Vec<crate::promotion::PromotionNote>, Option<String>)> {
    let (base, policies) = crate::promotion::repo_inputs(&repo);
    let mut plan = effective_plan(cfg, base_dir, repo, history, store, git, now).await?;
    let (_, notes, error) = crate::promotion::propose(
        &mut plan,
        &base,
        policies.as_ref(),
        || async { crate::promotion::witness_source(store) },
        now,
    )
    .await;
    Ok((plan, notes, error))
}

fn lowering(b: &PlannedBucket) -> bool {
    b.current_limit_rps
        .is_some_and(|cur| b.bucket.limit_rps < cur)
}

/// The plan with every decrease of a bucket already lowered within `rails.decrease_interval`
/// held back: the bucket keeps its current limit, `held` says what was proposed and why, and
/// `skipped` lists it. The per-run cap must not compound over frequent runs.
///
/// Two witnesses are asked, and either one holds a decrease:
/// - the config repo's history (the base branch's first-parent history of
///   `buckets/<service>.yaml`, at most [`DECREASE_HISTORY_MAX_COMMITS`] commits back). It
///   records every change, whoever made it, and cannot be lost with rlc's store: with the
///   SQLite file deleted between runs, the guard still holds. This is why the guard does not
///   merely hold decreases while the store is younger than the interval: a young store cannot
///   tell a first run from a lost history, the repo can.
/// - the store's quota history (which also knows decreases of runs whose commit was later
///   reverted).
///
/// When a witness cannot say (store down, deleted or replaced; history too long or
/// unreadable; no git repository), decreases are held too: a failed dependency never lowers
/// a quota. Applying it twice changes nothing (a held bucket no longer lowers).
pub async fn hold_repeated_decreases(
    cfg: &DaemonConfig,
    base_dir: &Path,
    store: &StoreWitness,
    git: GitHistory,
    plan: Plan,
    now: DateTime<Utc>,
) -> Plan {
    let interval = cfg.rails.decrease_interval.0;
    if interval.as_secs() <= 1 {
        return plan;
    }
    let mut services: Vec<String> = plan
        .buckets
        .iter()
        .filter(|b| lowering(b))
        .map(|b| b.service.clone())
        .collect();
    if services.is_empty() {
        return plan;
    }
    services.sort();
    services.dedup();
    let since = now - chrono::Duration::from_std(interval).unwrap_or(chrono::Duration::days(1));
    let wcfg = WriterConfig::from_config(&cfg.config_repo, base_dir);
    let since_s = since.timestamp();
    let from_git = tokio::task::spawn_blocking(move || {
        let w = match git {
            GitHistory::Fetch => Writer::open(wcfg)?,
            GitHistory::AsFetched => Writer::open_existing(wcfg)?,
        };
        if git == GitHistory::Fetch {
            w.fetch()?;
        }
        w.decreases_since(&services, since_s, DECREASE_HISTORY_MAX_COMMITS)
    })
    .await
    .map_err(|e| crate::gitops::GitOpsError::History(format!("task panicked: {e}")))
    .and_then(|r| r);
    let at = |t: DateTime<Utc>| t.format("%Y-%m-%d %H:%M UTC").to_string();
    let mut out = plan;
    for b in &mut out.buckets {
        let Some(cur) = b.current_limit_rps else {
            continue;
        };
        if b.bucket.limit_rps >= cur {
            continue;
        }
        let waits = |when: String, source: &str| {
            format!(
                "already lowered at {when} per {source} (one decrease per {}): the decrease to {} rps waits",
                cfg.rails.decrease_interval,
                schema::format_rps(b.bucket.limit_rps)
            )
        };
        let by_git = match &from_git {
            Ok(found) => found
                .get(&(b.service.clone(), b.bucket.name.clone()))
                .and_then(|t| DateTime::<Utc>::from_timestamp(*t, 0))
                .map(|t| waits(at(t), "the config repo history")),
            Err(e) => Some(format!("{e}: decrease held")),
        };
        let why = match by_git {
            Some(r) => Some(r),
            None => match store {
                StoreWitness::Store(s) => {
                    match s.lowered_since(&b.service, &b.bucket.name, since).await {
                        Ok(last) => last.map(|t| waits(at(t), "the store")),
                        Err(e) => Some(format!("quota history unavailable ({e}): decrease held")),
                    }
                }
                StoreWitness::Empty => None,
                StoreWitness::Unavailable(e) => {
                    Some(format!("store unavailable ({e}): decrease held"))
                }
            },
        };
        if let Some(reason) = why {
            out.skipped.push(Skipped {
                service: b.service.clone(),
                caller: b.bucket.caller.clone(),
                procedure: b.bucket.procedure.clone(),
                reason: reason.clone(),
            });
            b.held = Some(Held {
                proposed_limit_rps: b.bucket.limit_rps,
                reason,
            });
            b.bucket.limit_rps = cur;
        }
    }
    out
}
