//! `rlc backtest --config rlc.yaml [--holdout 7d] [--policy peak|forecast|all]
//! [--headroom auto,0.1,0.25]`: the command around [`rlc_plan::backtest`] (fit each policy, at
//! each margin asked, on the history before the last `holdout`, score it on the holdout), and
//! `rlc backtest --corpus [--headroom …]`.

use std::path::PathBuf;

use rlc_plan::backtest::backtest_margins;
use schema::{Headroom, HumanDuration, PolicyName};

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
    /// Compare margins: every service at each of these in turn (numbers or `auto`, comma
    /// separated, e.g. `auto,0.1,0.25`). With `--corpus`: each shape's default policy at each.
    #[arg(long, value_delimiter = ',', value_parser = parse_headroom)]
    pub headroom: Vec<Headroom>,
}

/// A margin on the command line: a number ≥ 0 or `auto`.
fn parse_headroom(s: &str) -> Result<Headroom, String> {
    let s = s.trim();
    if s.eq_ignore_ascii_case("auto") {
        return Ok(Headroom::Auto);
    }
    match s.parse::<f64>() {
        Ok(h) if h.is_finite() && h >= 0.0 => Ok(Headroom::Fixed(h)),
        _ => Err(format!("`{s}` is not a margin: a number ≥ 0 or `auto`")),
    }
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
        let margins = args.headroom.clone();
        let rows = tokio::task::spawn_blocking(move || {
            if margins.is_empty() {
                rlc_plan::corpus::run(&rlc_plan::corpus::builtin())
            } else {
                rlc_plan::corpus::run_margins(&margins, rlc_plan::corpus::SEED)
            }
        })
        .await?;
        match args.format {
            Format::Json => println!("{}", serde_json::to_string_pretty(&rows)?),
            Format::Table if args.headroom.is_empty() => {
                print!("{}", rlc_plan::corpus::markdown(&rows))
            }
            Format::Table => print!("{}", rlc_plan::corpus::markdown_margins(&rows)),
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
    let margins = args.headroom.clone();
    let report = tokio::task::spawn_blocking(move || {
        backtest_margins(&cfg, &repo, &history, holdout, &policies, &margins)
    })
    .await?;
    let label = |h: &Option<String>| match h {
        Some(h) => format!("{h:<7}"),
        None => format!("{:<7}", "-"),
    };
    match args.format {
        Format::Json => println!("{}", serde_json::to_string_pretty(&report)?),
        Format::Table => {
            println!(
                "{:<12} {:<28} {:<9} {:>10} {:>10} {:>11} {:>6} {:>6} ASKED",
                "SERVICE", "BUCKET", "POLICY", "LIMIT", "PEAK", "THROTTLED", "SLACK", "MARGIN"
            );
            for b in &report.buckets {
                println!(
                    "{:<12} {:<28} {:<9} {:>10.1} {:>10.1} {:>10.4}% {:>6.2} {:>6} {}",
                    b.service,
                    b.bucket,
                    b.policy,
                    b.limit_rps,
                    b.holdout_peak_rps,
                    b.throttled_fraction * 100.0,
                    b.slack,
                    b.margin.map_or("-".into(), |m| format!("{m:.2}")),
                    label(&b.headroom).trim_end(),
                );
            }
            println!();
            for t in &report.totals {
                println!(
                    "{:<9} {}throttled {:.4}% of requests, mean slack {:.2}, median slack {:.2}, {} buckets, {} failed",
                    t.policy,
                    t.headroom.as_ref().map_or(String::new(), |h| format!("at {h}: ")),
                    t.throttled_fraction * 100.0,
                    t.mean_slack,
                    t.median_slack,
                    t.buckets,
                    t.failed
                );
            }
        }
    }
    Ok(0)
}
