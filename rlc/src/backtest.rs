//! `rlc backtest --config rlc.yaml [--holdout 7d] [--policy peak|forecast|all]`: fit each
//! policy on the history before the last `holdout`, score it on the holdout: the fraction of
//! requests it would have throttled and its slack (limit ÷ real peak), per bucket and overall.

use std::path::PathBuf;

use chrono::{TimeZone, Utc};
use policies::{Policy, PolicyInput};
use schema::{ConfigRepo, DaemonConfig, HumanDuration, PolicyName};
use serde::Serialize;

use crate::compute::{policy_for, spec_for};
use crate::history::History;
use crate::preview::{load_history, load_inputs, Format};

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
}

/// Score of one policy on one bucket.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct BucketScore {
    /// Callee.
    pub service: String,
    /// Bucket name.
    pub bucket: String,
    /// Policy scored (as asked; the evidence may show a fallback).
    pub policy: String,
    /// Limit fitted on the training part.
    pub limit_rps: f64,
    /// Highest rate in the holdout.
    pub holdout_peak_rps: f64,
    /// Requests over the limit ÷ all requests in the holdout.
    pub throttled_fraction: f64,
    /// limit ÷ holdout peak.
    pub slack: f64,
}

/// Totals of one policy.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PolicyTotals {
    /// Policy.
    pub policy: String,
    /// Requests throttled ÷ requests, over every bucket.
    pub throttled_fraction: f64,
    /// Mean of the per-bucket slack.
    pub mean_slack: f64,
    /// Buckets scored.
    pub buckets: usize,
    /// Buckets that failed (no training data, policy error).
    pub failed: usize,
}

/// The whole backtest.
#[derive(Debug, Clone, Serialize, PartialEq, Default)]
pub struct BacktestReport {
    /// Per bucket and policy.
    pub buckets: Vec<BucketScore>,
    /// Per policy.
    pub totals: Vec<PolicyTotals>,
}

/// Scores `policies` on `history`, holding out its last `holdout_secs`.
pub fn backtest(
    cfg: &DaemonConfig,
    repo: &ConfigRepo,
    history: &History,
    holdout_secs: i64,
    policies: &[PolicyName],
) -> BacktestReport {
    let split = history.end() - holdout_secs;
    let train_now = Utc.timestamp_opt(split, 0).single().unwrap_or_default();
    let mut report = BacktestReport::default();
    for name in policies {
        let policy: &dyn Policy = match policy_for(cfg, name) {
            Ok(Some(p)) => p,
            _ => continue,
        };
        let (mut over, mut total, mut slack_sum, mut n, mut failed) = (0.0, 0.0, 0.0, 0, 0);
        for (key, s) in &history.series {
            let train = s.slice(s.start, split);
            let test = s.slice(split, s.end());
            let Some(test_peak) = test.max() else {
                continue;
            };
            let mut spec = spec_for(repo, &key.service);
            spec.policy = Some(name.clone());
            let r = policy.compute(&PolicyInput {
                service: &key.service,
                caller: key.caller.as_deref(),
                procedure: key.procedure.as_deref(),
                series: &train,
                spec: &spec,
                capacity_share_rps: None,
                now: train_now,
            });
            let Ok(p) = r else {
                failed += 1;
                continue;
            };
            let limit = p.limit_rps.max(cfg.rails.floor_rps);
            let (mut o, mut t) = (0.0, 0.0);
            for &v in test.values.iter().filter(|v| !v.is_nan()) {
                let v = f64::from(v);
                t += v;
                o += (v - limit).max(0.0);
            }
            over += o;
            total += t;
            let slack = if test_peak > 0.0 {
                limit / test_peak
            } else {
                f64::INFINITY
            };
            if slack.is_finite() {
                slack_sum += slack;
                n += 1;
            }
            report.buckets.push(BucketScore {
                service: key.service.clone(),
                bucket: key.bucket_name(),
                policy: name.to_string(),
                limit_rps: limit,
                holdout_peak_rps: test_peak,
                throttled_fraction: if t > 0.0 { o / t } else { 0.0 },
                slack,
            });
        }
        report.totals.push(PolicyTotals {
            policy: name.to_string(),
            throttled_fraction: if total > 0.0 { over / total } else { 0.0 },
            mean_slack: if n > 0 { slack_sum / n as f64 } else { 0.0 },
            buckets: n,
            failed,
        });
    }
    report
}

/// Runs `rlc backtest`; exit code 1 when the history source failed.
pub async fn run(args: BacktestArgs) -> anyhow::Result<i32> {
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
