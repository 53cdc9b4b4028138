//! `rlc preview --config rlc.yaml [--service S] [--format table|json]`: compute, write nothing.
//! It shows the plan a run would do ([`crate::planner::effective_plan`]): a decrease the run
//! would hold (one per `rails.decrease_interval`, asked of the config repo's history and the
//! store named in rlc.yaml) keeps the current limit and says why (`held`).

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use anyhow::Context;
use schema::{ConfigRepo, DaemonConfig};

use crate::compute::resolve_paths;
use crate::history::{self, History, PlanHistory};
use crate::plan::Plan;

/// Output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Default)]
pub enum Format {
    /// A table for service owners.
    #[default]
    Table,
    /// The preview JSON (`rlc preview --format json`).
    Json,
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

/// Loads `rlc.yaml` with its relative paths resolved, and the config repo it names. A repo with
/// problems is an error (listing every problem).
pub fn load_inputs(config: &Path) -> anyhow::Result<(DaemonConfig, ConfigRepo, PathBuf)> {
    let (mut cfg, base) = crate::cycle::load_config(config)?;
    resolve_paths(&mut cfg, &base);
    let (repo, diags) = ConfigRepo::load(Path::new(&cfg.config_repo.path));
    if !diags.is_empty() {
        return Err(crate::exit::ConfigError(format!(
            "the config repo has problems:\n{}",
            schema::Diagnostics(diags)
        ))
        .into());
    }
    Ok((cfg, repo, base))
}

/// Pulls history, turning a source failure into a history that keeps every quota.
pub async fn load_history(cfg: &DaemonConfig, base: &Path) -> History {
    let terminal = std::io::stderr().is_terminal();
    let h = match history::load(&cfg.history, base, chrono::Utc::now()).await {
        Ok(h) => h,
        Err(e) => {
            tracing::error!(error = %e, "history source failed");
            History::unavailable(e.to_string())
        }
    };
    if terminal {
        eprintln!("history: {} series", h.series.len());
    }
    h
}

/// [`load_history`] for a plan ([`history::load_for_plan`]): a Prometheus pull is spilled to
/// disk and the plan computed service by service, so memory stays bounded by the largest
/// service. What `rlc preview` and `rlc run` (without `rlc serve`'s snapshot) compute from.
pub async fn load_plan_history(cfg: &DaemonConfig, base: &Path) -> PlanHistory {
    let h = match history::load_for_plan(&cfg.history, base, chrono::Utc::now()).await {
        Ok(h) => h,
        Err(e) => {
            tracing::error!(error = %e, "history source failed");
            History::unavailable(e.to_string()).into()
        }
    };
    if std::io::stderr().is_terminal() {
        eprintln!("history: {} series", h.series_count());
    }
    h
}

/// Runs `rlc preview`; returns the exit code ([`crate::exit`]): 0, 1 when the history failed
/// for every service (shown), 4 when it failed for some of them.
pub async fn run(args: PreviewArgs) -> anyhow::Result<i32> {
    let (cfg, repo, base) =
        load_inputs(&args.config).with_context(|| format!("loading {}", args.config.display()))?;
    let history = load_plan_history(&cfg, &base).await;
    let store = crate::planner::open_store_for_reading(&cfg, &base).await;
    let (mut plan, mut promotions, shadow_error) = crate::planner::proposed_plan(
        &cfg,
        &base,
        std::sync::Arc::new(repo),
        history,
        &store,
        crate::planner::GitHistory::Fetch,
        chrono::Utc::now(),
    )
    .await?;
    if let Some(e) = &shadow_error {
        tracing::warn!(error = %e, "shadow figures unavailable: nothing promoted");
    }
    if let Some(s) = &args.service {
        plan.buckets.retain(|b| &b.service == s);
        plan.skipped.retain(|b| &b.service == s);
        plan.history_failed.retain(|f| f == s);
        promotions.retain(|p| &p.service == s);
    }
    match args.format {
        Format::Json => println!("{}", serde_json::to_string_pretty(&plan)?),
        Format::Table => {
            print!("{}", table(&plan));
            print!("{}", promotions_table(&promotions, shadow_error.as_deref()));
        }
    }
    Ok(history_exit_code(&plan))
}

/// Whether the plan proposes `mode: enforce` for this shadow bucket
/// (`evidence.promotion.promoted`).
pub fn promoted(b: &crate::plan::PlannedBucket) -> bool {
    b.evidence.promoted()
}

/// The shadow buckets a run would promote or keep in shadow, with the reason: what the run
/// summary says of them.
pub fn promotions_table(
    notes: &[crate::promotion::PromotionNote],
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
                crate::promotion::PROMOTED_MODE
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
    } else if !plan.history_failed.is_empty() {
        crate::exit::PARTIAL
    } else {
        crate::exit::OK
    }
}

/// The plan as a table: service, bucket, current, proposed, change %, peak, policy, scope,
/// mode, confidence, why (the evidence's one line: what set the limit, what was discounted);
/// then the skipped list.
pub fn table(plan: &Plan) -> String {
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
        let cur = b.current_limit_rps;
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
            b.evidence
                .peak_rps
                .map(schema::format_rps)
                .unwrap_or_else(|| "-".into()),
            b.bucket.policy.to_string(),
            b.bucket.scope.as_str().into(),
            if promoted(b) {
                crate::promotion::PROMOTED_MODE.into()
            } else {
                b.bucket.mode.as_str().into()
            },
            b.evidence
                .confidence
                .map(|c| format!("{:.0}%", c * 100.0))
                .unwrap_or_else(|| "kept".into()),
            b.evidence
                .why()
                .unwrap_or("-")
                .replace(['\n', '\r'], " "),
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
