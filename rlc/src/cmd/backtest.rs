//! `rlc backtest --config rlc.yaml [--holdout 7d] [--policy peak|forecast|all]`: the command
//! around [`rlc_plan::backtest`] (fit each policy on the history before the last `holdout`,
//! score it on the holdout), and `rlc backtest --corpus`.

use std::path::PathBuf;

use rlc_plan::backtest::backtest;
use schema::{HumanDuration, PolicyName};

use std::path::Path;

use schema::{ConfigRepo, DaemonConfig};

/// Output format of `rlc backtest`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Default)]
pub enum Format {
    /// A table (the corpus: a markdown table).
    #[default]
    Table,
    /// JSON.
    Json,
}
use crate::config::resolve_paths;
use crate::history::load_or_unavailable as load_history;

/// Which policies to compare.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Which {
    /// `peak` only.
    Peak,
    /// `forecast` only.
    Forecast,
    /// Both, side by side.
    All,
}

/// Arguments of `rlc backtest`.
#[derive(Debug, Clone, clap::Args)]
pub struct BacktestArgs {
    /// The daemon config.
    #[arg(long, default_value = "rlc.yaml")]
    pub config: PathBuf,
    /// The last part of the history held out for scoring.
    #[arg(long, default_value = "7d")]
    pub holdout: HumanDuration,
    /// Policies to score.
    #[arg(long, value_enum, default_value_t = Which::All)]
    pub policy: Which,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
    /// Score the built-in policies on the generated corpus of traffic shapes instead of the
    /// configured history (`--config` is not read): the table of docs/rlc-policies.md.
    #[arg(long)]
    pub corpus: bool,
}

/// Loads `rlc.yaml` with its relative paths resolved, and the config repo it names. A repo with
/// problems is an error (listing every problem).
pub fn load_inputs(config: &Path) -> anyhow::Result<(DaemonConfig, ConfigRepo, PathBuf)> {
    let (mut cfg, base) = crate::config::load_config(config)?;
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

/// Runs `rlc backtest`; exit code 1 when the history source failed.
pub async fn run(args: BacktestArgs) -> anyhow::Result<i32> {
    if args.corpus {
        let rows =
            tokio::task::spawn_blocking(|| rlc_plan::corpus::run(&rlc_plan::corpus::builtin()))
                .await?;
        match args.format {
            Format::Json => println!("{}", serde_json::to_string_pretty(&rows)?),
            Format::Table => print!("{}", rlc_plan::corpus::markdown(&rows)),
        }
        return Ok(0);
    }
    let (cfg, repo, base) = load_inputs(&args.config)?;
    let history = load_history(&cfg, &base).await;
    if let Some(e) = &history.source_error {
        eprintln!("error: {e}");
        return Ok(1);
    }
    let policies = match args.policy {
        Which::Peak => vec![PolicyName::Peak],
        Which::Forecast => vec![PolicyName::Forecast],
        Which::All => vec![PolicyName::Peak, PolicyName::Forecast],
    };
    let holdout = args.holdout.as_secs() as i64;
    let report =
        tokio::task::spawn_blocking(move || backtest(&cfg, &repo, &history, holdout, &policies))
            .await?;
    match args.format {
        Format::Json => println!("{}", serde_json::to_string_pretty(&report)?),
        Format::Table => {
            println!(
                "{:<12} {:<28} {:<9} {:>10} {:>10} {:>11} {:>6}",
                "SERVICE", "BUCKET", "POLICY", "LIMIT", "PEAK", "THROTTLED", "SLACK"
            );
            for b in &report.buckets {
                println!(
                    "{:<12} {:<28} {:<9} {:>10.1} {:>10.1} {:>10.4}% {:>6.2}",
                    b.service,
                    b.bucket,
                    b.policy,
                    b.limit_rps,
                    b.holdout_peak_rps,
                    b.throttled_fraction * 100.0,
                    b.slack
                );
            }
            println!();
            for t in &report.totals {
                println!(
                    "{:<9} throttled {:.4}% of requests, mean slack {:.2}, {} buckets, {} failed",
                    t.policy,
                    t.throttled_fraction * 100.0,
                    t.mean_slack,
                    t.buckets,
                    t.failed
                );
            }
        }
    }
    Ok(0)
}
