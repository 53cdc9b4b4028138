//! Backtests: fit each policy on the history before the last `holdout`, score it on the
//! holdout: the fraction of requests it would have throttled and its slack (limit ÷ real
//! peak), per bucket and overall (`rlc backtest`).
//!
//! The scoring ([`score`]) and the split of a history ([`split`]) are shared with the what-if
//! previews (`crate::whatif`), which score whole plans computed on the training part
//! ([`score_plans`]), reading the history one service at a time ([`Training`]).
//! Every fitted limit passes `policies::rails::check_proposal` first, as in a run: a proposal
//! the rails would refuse (not finite, negative, far above the peak) scores as a failure, never
//! as a bucket that is never overloaded.

use chrono::{TimeZone, Utc};
use policies::rails;
use policies::{Policy, PolicyError, PolicyInput, Proposal, RateSeries};
use schema::{ConfigRepo, DaemonConfig, Headroom, PolicyName, PolicySpec};
use serde::Serialize;

use std::borrow::Cow;
use std::collections::BTreeMap;

use crate::history::{History, Rejected, SeriesKey, SeriesSource, Unreadable};
use crate::pipeline::{self, Purpose, World};
use crate::plan::{Plan, PlannedBucket};

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
    /// The margin scored, when margins are compared (`0.1`, `auto`); absent: as configured.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub headroom: Option<String>,
    /// The margin the limit was computed with (`auto` resolved), when the policy has one.
    pub margin: Option<f64>,
}

/// Totals of one policy.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PolicyTotals {
    /// Policy.
    pub policy: String,
    /// The margin scored, when margins are compared; absent: as configured.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub headroom: Option<String>,
    /// Median of the per-bucket slack.
    pub median_slack: f64,
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

/// How one limit fares on a holdout.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, schemars::JsonSchema)]
pub struct Score {
    /// The limit scored.
    pub limit_rps: f64,
    /// Highest rate in the holdout.
    pub holdout_peak_rps: f64,
    /// Requests over the limit ÷ all requests in the holdout.
    pub throttled_fraction: f64,
    /// limit ÷ holdout peak (infinite, serialised as null, when the holdout peak is 0).
    pub slack: f64,
    /// Requests over the limit (rate × samples, for totals).
    #[serde(skip)]
    pub over: f64,
    /// All requests (rate × samples, for totals).
    #[serde(skip)]
    pub total: f64,
}

/// Scores `limit` on the rates of a holdout (NaN = missing sample); None when the holdout has
/// no sample.
pub fn score(limit: f64, holdout: &[f32]) -> Option<Score> {
    let (mut over, mut total, mut peak) = (0.0, 0.0, None::<f64>);
    for &v in holdout.iter().filter(|v| !v.is_nan()) {
        let v = f64::from(v);
        total += v;
        over += (v - limit).max(0.0);
        peak = Some(peak.map_or(v, |p| p.max(v)));
    }
    let peak = peak?;
    Some(Score {
        limit_rps: limit,
        holdout_peak_rps: peak,
        throttled_fraction: if total > 0.0 { over / total } else { 0.0 },
        slack: if peak > 0.0 {
            limit / peak
        } else {
            f64::INFINITY
        },
        over,
        total,
    })
}

/// Splits `history` before its last `holdout_secs`: the training part (every series cut at
/// the split, on the same grid start) and the split time.
pub fn split(history: &History, holdout_secs: i64) -> (History, i64) {
    let split = split_at(history.end(), holdout_secs);
    let mut train = train_part(history, history.series.iter(), split);
    train.rejected = history.rejected.clone();
    train.source_error = history.source_error.clone();
    (train, split)
}

/// Where a history ending at `end` (unix seconds) is split to hold its last `holdout_secs`
/// out ([`split`], and [`Training`] for a history read one service at a time).
pub fn split_at(end: i64, holdout_secs: i64) -> i64 {
    end - holdout_secs.max(0)
}

/// `series` of `history` (on its grid) cut at `split`: the training part, on the same grid
/// start, without rejections or source error.
fn train_part<'a>(
    history: &History,
    series: impl Iterator<Item = (&'a SeriesKey, &'a RateSeries)>,
    split: i64,
) -> History {
    let len = if history.step > 0 {
        ((split - history.start).max(0) / history.step) as usize
    } else {
        0
    }
    .min(history.len);
    History {
        start: history.start,
        step: history.step,
        len,
        series: series
            .map(|(k, s)| (k.clone(), s.slice(s.start, split)))
            .collect(),
        rejected: Vec::new(),
        source_error: None,
    }
}

/// The training part of a history read one service at a time: each service's series cut at
/// `split`, as [`split`] cuts a whole history, so that a plan fitted before the split reads
/// no more than one service's series at once.
pub struct Training<'a> {
    /// The whole history.
    pub source: &'a dyn SeriesSource,
    /// Where the held-out window starts (unix seconds).
    pub split: i64,
}

impl SeriesSource for Training<'_> {
    fn services(&self) -> Vec<String> {
        self.source.services()
    }

    fn rejected(&self) -> &[Rejected] {
        self.source.rejected()
    }

    fn source_error(&self) -> Option<&str> {
        self.source.source_error()
    }

    fn service(&self, service: &str) -> Result<Cow<'_, History>, Unreadable> {
        let h = self.source.service(service)?;
        Ok(Cow::Owned(train_part(
            &h,
            h.service_series(service),
            self.split,
        )))
    }
}

/// The holdout rates (from `split` on) of the traffic a bucket of `service` matching `caller`
/// and `procedure` sees: the sum of the series it covers (a caller-wide bucket covers every
/// procedure of the caller), missing where all of them are.
pub fn holdout_rates(
    history: &History,
    service: &str,
    caller: Option<&str>,
    procedure: Option<&str>,
    split: i64,
) -> Vec<f32> {
    let mut sum: Vec<f32> = Vec::new();
    for (k, s) in history.service_series(service) {
        if k.caller.as_deref() != caller
            || (procedure.is_some() && k.procedure.as_deref() != procedure)
        {
            continue;
        }
        let test = s.slice(split, s.end());
        if sum.len() < test.values.len() {
            sum.resize(test.values.len(), f32::NAN);
        }
        for (a, v) in sum.iter_mut().zip(&test.values) {
            if !v.is_nan() {
                *a = if a.is_nan() { *v } else { *a + *v };
            }
        }
    }
    sum
}

/// Scores each bucket of `plan` (computed on the history before `split`) on the traffic it
/// covers from `split` on. Buckets without traffic there are left out.
pub fn score_plan(history: &History, plan: &Plan, split: i64) -> Scores {
    score_buckets(history, plan.buckets.iter(), split)
}

/// The scores of a plan's buckets: service, bucket, score.
pub type Scores = Vec<(String, String, Score)>;

/// [`score_plan`] of each of `plans` on a history read one service at a time: each service
/// with a bucket in one of them is read once, for every plan, and dropped before the next.
/// The scores come service by service, each plan's buckets of a service in the plan's order.
/// An error when a service cannot be read.
pub fn score_plans(
    source: &dyn SeriesSource,
    plans: &[&Plan],
    split: i64,
) -> Result<Vec<Scores>, Unreadable> {
    let mut by_service: BTreeMap<&str, Vec<Vec<&PlannedBucket>>> = BTreeMap::new();
    for (i, plan) in plans.iter().enumerate() {
        for b in &plan.buckets {
            by_service
                .entry(b.service.as_str())
                .or_insert_with(|| vec![Vec::new(); plans.len()])[i]
                .push(b);
        }
    }
    let mut out = vec![Vec::new(); plans.len()];
    for (service, buckets) in by_service {
        let history = source.service(service)?;
        for (scores, buckets) in out.iter_mut().zip(buckets) {
            scores.extend(score_buckets(&history, buckets.into_iter(), split));
        }
    }
    Ok(out)
}

fn score_buckets<'a>(
    history: &History,
    buckets: impl Iterator<Item = &'a PlannedBucket>,
    split: i64,
) -> Scores {
    buckets
        .filter_map(|b| {
            let rates = holdout_rates(
                history,
                &b.service,
                b.bucket.caller.as_deref(),
                b.bucket.procedure.as_deref(),
                split,
            );
            let s = score(b.bucket.limit_rps, &rates)?;
            Some((b.service.clone(), b.bucket.name.clone(), s))
        })
        .collect()
}

/// Why a policy's fit could not be scored.
#[derive(Debug, Clone, thiserror::Error)]
pub enum FitError {
    /// The policy failed on the training part.
    #[error("{0}")]
    Policy(#[from] PolicyError),
    /// The rails would refuse its proposal.
    #[error("{0}")]
    Refused(#[from] rails::Refused),
}

/// Fits `policy` on `full` before `split` and scores its limit (at least `floor`) on the rest,
/// as a run would: a proposal the rails would refuse is an error, never a score. `Ok(None)` when
/// the held-out part has no sample. The one scoring path of `rlc backtest` and the corpus
/// ([`crate::corpus`]).
pub fn fit_and_score(
    policy: &dyn Policy,
    spec: &PolicySpec,
    floor: f64,
    (service, caller, procedure): (&str, Option<&str>, Option<&str>),
    (full, left_out): (&RateSeries, usize),
    split: i64,
) -> Result<Option<(Score, Proposal)>, FitError> {
    let s = &full.slice(full.start, split);
    let test = full.slice(split, full.end()).values;
    if test.iter().all(|v| v.is_nan()) {
        return Ok(None);
    }
    let train_now = Utc.timestamp_opt(split, 0).single().unwrap_or_default();
    let p = policy.compute(&PolicyInput {
        left_out,
        service,
        caller,
        procedure,
        series: s,
        spec,
        capacity_share_rps: None,
        now: train_now,
    })?;
    // As in a run: no proposal is scored that the rails would refuse.
    rails::check_proposal(p.limit_rps, s.max().unwrap_or(0.0), None, floor, true)?;
    Ok(score(p.limit_rps.max(floor), &test).map(|sc| (sc, p)))
}

/// Scores `policies` on `history`, holding out its last `holdout_secs`: for each policy, the
/// plan a run would compute on the history before the split with every service on that
/// policy (contracts left out: a backtest scores policies), fitted from no limit in force
/// ([`Purpose::Backtest`]), each bucket scored on the traffic it sees after. The very
/// computation what-if previews backtest with, so that both give the same limits for the
/// same inputs. A series with held-out traffic but no bucket (no training data, a policy
/// error, a refused proposal) counts as failed.
pub fn backtest(
    cfg: &DaemonConfig,
    repo: &ConfigRepo,
    history: &History,
    holdout_secs: i64,
    policies: &[PolicyName],
) -> BacktestReport {
    backtest_margins(cfg, repo, history, holdout_secs, policies, &[])
}

/// [`backtest`] with every service at each of `margins` in turn (`headroom` set on every
/// policy spec), each policy and margin scored apart; no margins: as configured.
pub fn backtest_margins(
    cfg: &DaemonConfig,
    repo: &ConfigRepo,
    history: &History,
    holdout_secs: i64,
    policies: &[PolicyName],
    margins: &[Headroom],
) -> BacktestReport {
    let (train, split_at) = split(history, holdout_secs);
    let at = Utc.timestamp_opt(split_at, 0).single().unwrap_or_default();
    let mut report = BacktestReport::default();
    let margins: Vec<Option<Headroom>> = if margins.is_empty() {
        vec![None]
    } else {
        margins.iter().copied().map(Some).collect()
    };
    for (name, margin) in policies
        .iter()
        .flat_map(|p| margins.iter().map(move |m| (p, *m)))
    {
        let label = margin.map(|m| m.to_string());
        let on_policy = with_policy(repo, name, margin);
        let plan = pipeline::plan(
            cfg,
            &on_policy,
            &train,
            &World::none(),
            at,
            Purpose::Backtest,
        );
        let scored: BTreeMap<(String, String), Score> = score_plan(history, &plan, split_at)
            .into_iter()
            .map(|(s, b, sc)| ((s, b), sc))
            .collect();
        let (mut over, mut total, mut slack_sum, mut n, mut failed) = (0.0, 0.0, 0.0, 0, 0);
        let mut slacks = Vec::new();
        for (key, full) in &history.series {
            let bucket = key.bucket_name();
            let Some(sc) = scored.get(&(key.service.clone(), bucket.clone())) else {
                let held_out = full.slice(split_at, full.end()).values;
                if held_out.iter().any(|v| !v.is_nan()) {
                    failed += 1;
                }
                continue;
            };
            over += sc.over;
            total += sc.total;
            if sc.slack.is_finite() {
                slack_sum += sc.slack;
                slacks.push(sc.slack);
                n += 1;
            }
            let margin = plan
                .buckets
                .iter()
                .find(|b| b.service == key.service && b.bucket.name == bucket)
                .and_then(|b| b.evidence.policy.as_ref()?.figures().headroom);
            report.buckets.push(BucketScore {
                service: key.service.clone(),
                bucket,
                policy: name.to_string(),
                limit_rps: sc.limit_rps,
                holdout_peak_rps: sc.holdout_peak_rps,
                throttled_fraction: sc.throttled_fraction,
                slack: sc.slack,
                headroom: label.clone(),
                margin,
            });
        }
        report.totals.push(PolicyTotals {
            policy: name.to_string(),
            headroom: label,
            median_slack: policies::spikes::median(&mut slacks).unwrap_or(0.0),
            throttled_fraction: if total > 0.0 { over / total } else { 0.0 },
            mean_slack: if n > 0 { slack_sum / n as f64 } else { 0.0 },
            buckets: n,
            failed,
        });
    }
    report
}

/// `repo` with every service on `policy` (and at `margin`, when given; their other parameters
/// kept) and no contracts.
fn with_policy(repo: &ConfigRepo, policy: &PolicyName, margin: Option<Headroom>) -> ConfigRepo {
    let mut out = repo.clone();
    out.contracts = None;
    match &mut out.policies {
        Some(p) => {
            let specs = std::iter::once(&mut p.value.default).chain(p.value.services.values_mut());
            for spec in specs {
                spec.policy = Some(policy.clone());
                if margin.is_some() {
                    spec.headroom = margin;
                }
            }
        }
        None => {
            out.policies = Some(schema::Located {
                file: repo.root.join("rlc/policies.yaml"),
                value: schema::PoliciesFile {
                    default: PolicySpec {
                        policy: Some(policy.clone()),
                        headroom: margin,
                        ..PolicySpec::default()
                    },
                    services: Default::default(),
                    promotion: None,
                    excluded: Vec::new(),
                    rollout: None,
                },
                locator: Default::default(),
            })
        }
    }
    out
}
