//! `rlc preview --config rlc.yaml [--service S] [--format table|json|markdown]`: compute,
//! write nothing.
//! It shows the plan a run would do ([`rlc_plan::pipeline::plan`]): a decrease the run
//! would hold (one per `rails.decrease_interval`, asked of the config repo's history and the
//! store named in rlc.yaml) keeps the current limit and says why (`held`).

use std::path::PathBuf;

use anyhow::Context;

use crate::config::resolve_paths;
use rlc_plan::pipeline::Purpose;
use rlc_plan::plan::Plan;

/// Output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Default)]
pub enum Format {
    /// A table for service owners.
    #[default]
    Table,
    /// The preview JSON (`rlc preview --format json`).
    Json,
    /// The body the pull request would get (the same renderer as the forge's).
    Markdown,
}

/// Arguments of `rlc preview`.
#[derive(Debug, Clone, clap::Args)]
pub struct PreviewArgs {
    /// The daemon config.
    #[arg(long, default_value = "rlc.yaml")]
    pub config: PathBuf,
    /// Only this service.
    #[arg(long)]
    pub service: Option<String>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
}

/// Runs `rlc preview`; returns the exit code ([`crate::exit`]): 0, 1 when the history failed
/// for every service (shown), 4 when it failed for some of them.
///
/// It computes what the next run would: the config repo at the base branch's tip (fetched
/// once; the working copy is not touched, and one that does not exist yet is cloned aside),
/// its decreases, the store's applied decreases and shadow figures, then
/// [`rlc_plan::pipeline::plan`].
pub async fn run(args: PreviewArgs) -> anyhow::Result<i32> {
    let (mut cfg, base_dir) = crate::config::load_config(&args.config)?;
    resolve_paths(&mut cfg, &base_dir);
    let now = chrono::Utc::now();
    let base = crate::gather::read_base_aside(&cfg, &base_dir, now)
        .await
        .with_context(|| format!("loading {}", args.config.display()))?;
    let history = crate::history::load_plan_or_unavailable(&cfg, &base_dir).await;
    let store = crate::gather::open_store_for_reading(&cfg, &base_dir).await;
    let world =
        crate::gather::world(&cfg, &base, &store, async { store.shadow_source() }, now).await;
    let repo = base.repo.clone();
    let c = cfg.clone();
    let mut plan = tokio::task::spawn_blocking(move || {
        rlc_plan::pipeline::plan(&c, &repo, &history, &world, now, Purpose::Run)
    })
    .await?;
    if let Some(e) = &plan.shadow_error {
        tracing::warn!(error = %e, "shadow figures unavailable: nothing promoted");
    }
    if let Some(s) = &args.service {
        plan = rlc_plan::whatif::restrict_plan(&plan, Some(&[s.clone()].into()));
    }
    // What the controllers enforce while a rollout's candidate bakes: the limit in force is
    // not the base branch's new value yet.
    let rollouts = match &store {
        crate::gather::StoreWitness::Store(s) => crate::rollout::latest_by_bucket(s, 10_000)
            .await
            .unwrap_or_else(|e| {
                tracing::warn!(error = %e, "rollouts unavailable: limits under a rollout show the base branch's value");
                Default::default()
            }),
        _ => Default::default(),
    };
    let in_force = in_force(&base.repo, &rollouts, now);
    match args.format {
        Format::Json => println!(
            "{}",
            serde_json::to_string_pretty(&preview_json(&plan, &rollouts, &base.repo)?)?
        ),
        Format::Markdown => print!("{}", pull_request_body(&cfg, &base.repo, &plan)),
        Format::Table => {
            print!("{}", table_in_force(&plan, &in_force));
            print!("{}", candidates_table(&in_force));
            print!(
                "{}",
                promotions_table(&plan.promotions, plan.shadow_error.as_deref())
            );
        }
    }
    Ok(history_exit_code(&plan))
}

/// A bucket whose limit in force is not the base branch's: a rollout keeps the spec in force
/// before it ([`crate::rollout::enforced`]).
#[derive(Debug, Clone, PartialEq)]
pub struct InForceNow {
    /// The limit the controllers enforce (None: a new bucket, only a candidate so far).
    pub limit_rps: Option<f64>,
    /// The candidate baking beside it.
    pub candidate: Option<crate::rollout::CandidateView>,
}

/// The buckets of the base `repo` whose limit in force differs from the base branch's, given
/// the newest rollout of each bucket, by (service, bucket).
pub fn in_force(
    repo: &schema::ConfigRepo,
    rollouts: &std::collections::BTreeMap<(String, String), crate::rollout::Rollout>,
    now: chrono::DateTime<chrono::Utc>,
) -> std::collections::BTreeMap<(String, String), InForceNow> {
    let mut out = std::collections::BTreeMap::new();
    for f in repo.buckets.values() {
        for b in &f.value.buckets {
            let key = (f.value.service.clone(), b.name.clone());
            let e = crate::rollout::enforced(Some(b), rollouts.get(&key), now);
            if e.spec != Some(b) || e.candidate.is_some() {
                out.insert(
                    key,
                    InForceNow {
                        limit_rps: e.spec.map(|s| s.limit_rps),
                        candidate: e.candidate,
                    },
                );
            }
        }
    }
    out
}

/// The preview JSON: `plan`, each bucket in the shape `GET /v1/quotas/{service}` serves it
/// (`change`, `confidence`, `rail`, `mode_change`, `details`, and under a rollout
/// `current_limit_rps` the limit in force, `rollout` and `candidate`): one shape for a bucket's
/// plan wherever it is served.
pub fn preview_json(
    plan: &Plan,
    rollouts: &std::collections::BTreeMap<(String, String), crate::rollout::Rollout>,
    repo: &schema::ConfigRepo,
) -> anyhow::Result<serde_json::Value> {
    let mut v = serde_json::to_value(plan)?;
    let mut buckets: Vec<crate::quota_view::QuotaBucket> = plan
        .buckets
        .iter()
        .map(|b| crate::quota_view::view(b, true))
        .collect();
    crate::quota_view::with_rollouts(&mut buckets, rollouts, repo);
    if let Some(obj) = v.as_object_mut() {
        obj.insert("buckets".into(), serde_json::to_value(buckets)?);
    }
    Ok(v)
}

/// The candidates baking beside the limit in force, one line each (empty when none).
pub fn candidates_table(
    in_force: &std::collections::BTreeMap<(String, String), InForceNow>,
) -> String {
    let mut out = String::new();
    for ((service, bucket), f) in in_force {
        let Some(c) = &f.candidate else { continue };
        if out.is_empty() {
            out.push_str("\ncandidates baking beside the limit in force (not enforced yet):\n");
        }
        out.push_str(&format!(
            "  {service}/{bucket}: candidate {} rps {}, {} in region {} (stage {} of {}), {:.0}% of the {}s bake; in force: {}\n",
            schema::format_rps(c.limit_rps),
            c.mode,
            c.state,
            c.regions.join(", "),
            c.stage,
            c.stages,
            c.bake_progress * 100.0,
            c.bake_seconds,
            f.limit_rps
                .map(|l| format!("{} rps", schema::format_rps(l)))
                .unwrap_or_else(|| "none (a new bucket)".into()),
        ));
    }
    out
}

/// The body of the pull request `plan` would get against the base `repo`: the renderer and
/// the length bound of the forge path.
pub fn pull_request_body(
    cfg: &schema::DaemonConfig,
    repo: &schema::ConfigRepo,
    plan: &Plan,
) -> String {
    use crate::gitops::summary;
    let (base_files, _) = rlc_plan::promotion::repo_inputs(repo);
    let changes = rlc_plan::change::diff(&base_files, &plan.bucket_files());
    let report = summary::report_with(
        plan,
        &changes,
        &summary::ReportContext {
            promotions: &plan.promotions,
            dashboard_url: cfg
                .config_repo
                .forge
                .as_ref()
                .and_then(|f| f.dashboard_url.as_deref()),
        },
    );
    summary::truncate_body(&report, summary::FORGE_BODY_LIMIT)
}

/// The shadow buckets a run would promote or keep in shadow, with the reason: what the run
/// summary says of them.
pub fn promotions_table(
    notes: &[rlc_plan::plan::PromotionNote],
    shadow_error: Option<&str>,
) -> String {
    let mut out = String::new();
    if notes.is_empty() && shadow_error.is_none() {
        return out;
    }
    out.push_str(
        "
shadow buckets (promotion rule of rlc/policies.yaml):
",
    );
    for n in notes {
        out.push_str(&format!(
            "  {}/{}: {} ({})
",
            n.service,
            n.bucket,
            if n.promoted {
                rlc_plan::promotion::PROMOTED_MODE
            } else {
                "stays in shadow"
            },
            n.reason
        ));
    }
    if let Some(e) = shadow_error {
        out.push_str(&format!(
            "  shadow figures unavailable, nothing promoted: {e}
"
        ));
    }
    out
}

/// [`crate::exit::FAILED`] when the history failed for every service of `plan`,
/// [`crate::exit::PARTIAL`] when for some, [`crate::exit::OK`] otherwise.
pub fn history_exit_code(plan: &Plan) -> i32 {
    if plan.history_failed_everywhere() {
        crate::exit::FAILED
    } else if !plan.history_failed.is_empty() || !plan.history_refused.is_empty() {
        crate::exit::PARTIAL
    } else {
        crate::exit::OK
    }
}

/// The PEAK cell: the peak the policy used (its statistic's value: `p99.9` leaves a lone spike
/// out), with the highest rate seen beside it when that differs (`1,575 (max 6,300)`).
fn peak_cell(e: &rlc_plan::evidence::Evidence) -> String {
    let used = e.policy.as_ref().and_then(|p| p.figures().value_rps);
    match (used, e.peak_rps) {
        (Some(u), Some(p)) if (p - u).abs() > 1e-9 * p.abs().max(1.0) => {
            format!("{} (max {})", schema::format_rps(u), schema::format_rps(p))
        }
        (Some(u), _) => schema::format_rps(u),
        (None, Some(p)) => schema::format_rps(p),
        (None, None) => "-".into(),
    }
}

/// The plan as a table: service, bucket, current, proposed, change %, peak, policy, scope,
/// mode, confidence, why (the evidence's one line: what set the limit, what was discounted);
/// then the skipped list. No bucket under a rollout: [`table_in_force`].
pub fn table(plan: &Plan) -> String {
    table_in_force(plan, &Default::default())
}

/// [`table`] with CURRENT the limit in force (`in_force`'s, for the buckets under a rollout)
/// and the change counted from it.
pub fn table_in_force(
    plan: &Plan,
    in_force: &std::collections::BTreeMap<(String, String), InForceNow>,
) -> String {
    let mut rows: Vec<[String; 11]> = vec![[
        "SERVICE",
        "BUCKET",
        "CURRENT",
        "PROPOSED",
        "CHANGE",
        "PEAK",
        "POLICY",
        "SCOPE",
        "MODE",
        "CONFIDENCE",
        "WHY",
    ]
    .map(String::from)];
    for b in &plan.buckets {
        let cur = match in_force.get(&(b.service.clone(), b.bucket.name.clone())) {
            Some(f) => f.limit_rps,
            None => b.current_limit_rps,
        };
        let change = match cur {
            // The run keeps the current limit; `skipped` below says why.
            Some(c) if c > 0.0 && b.held.is_some() => {
                let p = b.held.as_ref().map_or(c, |h| h.proposed_limit_rps);
                format!("held ({:+.1}%)", (p - c) / c * 100.0)
            }
            Some(c) if c > 0.0 => format!("{:+.1}%", (b.bucket.limit_rps - c) / c * 100.0),
            Some(_) => "-".into(),
            None => "new".into(),
        };
        rows.push([
            b.service.clone(),
            b.bucket.name.clone(),
            cur.map(schema::format_rps).unwrap_or_else(|| "-".into()),
            schema::format_rps(b.bucket.limit_rps),
            change,
            peak_cell(&b.evidence),
            b.bucket.policy.to_string(),
            b.bucket.scope.as_str().into(),
            if b.evidence.promoted() {
                rlc_plan::promotion::PROMOTED_MODE.into()
            } else {
                b.bucket.mode.as_str().into()
            },
            b.evidence
                .confidence
                .map(|c| format!("{:.0}%", c * 100.0))
                .unwrap_or_else(|| "kept".into()),
            b.evidence.why().unwrap_or("-").replace(['\n', '\r'], " "),
        ]);
    }
    let mut width = [0usize; 11];
    for r in &rows {
        for (w, c) in width.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut out = String::new();
    for r in &rows {
        let line: Vec<String> = r
            .iter()
            .zip(width)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    if !plan.skipped.is_empty() {
        out.push_str("\nskipped (current quotas kept):\n");
        for s in &plan.skipped {
            let what = s.target();
            out.push_str(&format!("  {what}: {}\n", s.reason));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peak_cell_is_the_peak_the_policy_used() {
        let e = |policy: serde_json::Value, peak: Option<f64>| rlc_plan::evidence::Evidence {
            policy: Some(rlc_plan::evidence::PolicyEvidence(policy)),
            peak_rps: peak,
            ..Default::default()
        };
        let spiky = e(
            serde_json::json!({"statistic": "p99.9", "value_rps": 1574.7}),
            Some(6300.0),
        );
        assert_eq!(
            peak_cell(&spiky),
            format!(
                "{} (max {})",
                schema::format_rps(1574.7),
                schema::format_rps(6300.0)
            )
        );
        let flat = e(
            serde_json::json!({"statistic": "max", "value_rps": 80.0}),
            Some(80.0),
        );
        assert_eq!(peak_cell(&flat), schema::format_rps(80.0));
        let forecast = e(serde_json::json!({"upper_bound_rps": 90.0}), Some(70.0));
        assert_eq!(peak_cell(&forecast), schema::format_rps(70.0));
        assert_eq!(peak_cell(&Default::default()), "-");
    }
}
