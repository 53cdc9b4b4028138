//! One bucket over a window: `GET /buckets/{service}/{bucket}?window=1h` (HTML with inline SVG
//! charts rendered on the server) and its JSON twin `GET /v1/shadow/{service}/{bucket}`.
//! Both read the per-minute roll-ups only. A minute without a report is a gap (no point, no
//! line through it), never zero traffic.

use std::collections::BTreeMap;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Response};
use axum::Json;
use chrono::{DateTime, Duration, Utc};
use maud::{html, Markup, DOCTYPE};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::super::limits::{Path, Query};
use super::chart::{dec1, path, step_path, Frame, CHART_CSS, LEFT, TOP, W};
use super::page::error_page;
use super::{
    encoded, load, parse_window, percent, problems_notice, pull_request_html, rate, when,
    DashError, Links, CSS, WINDOWS,
};
use crate::gitops::writer::BaseReadError;
use crate::serve::AppState;
use crate::store::{minute_of, ChangeState, QuotaChange, StepRow, Store};
use rlc_plan::readiness::{self, ShadowStats, Verdict};

/// Most points of a series: longer windows aggregate several minutes per point.
const MAX_POINTS: i64 = 360;
/// Most scope keys charted one by one (the rest are listed as cut).
const MAX_SCOPES: usize = 12;
/// Quota changes listed.
const MAX_CHANGES: i64 = 50;

/// Query string of the bucket page and its JSON twin.
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct BucketQuery {
    /// How far back, `15m` to `30d` (default `1h`): a number and a unit (s, m, h, d).
    #[schemars(regex(path = "super::WINDOW_PATTERN"))]
    pub window: Option<String>,
}

/// Path of the bucket page and its JSON twin.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct BucketPath {
    /// Callee service.
    pub service: String,
    /// Bucket name.
    pub bucket: String,
}

/// One point of a series: a step of `step_secs` starting at `t`. Every value is `null` when no
/// report arrived in the step (a gap in the report feed, not zero traffic).
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
pub struct Point {
    /// Start of the step.
    pub t: DateTime<Utc>,
    /// Offered rate (rps): the highest per-minute average in the step.
    pub offered_rps: Option<f64>,
    /// The limit of the step's latest report.
    pub limit_rps: Option<f64>,
    /// Virtual-drop rate (shadow), highest per-minute average in the step.
    pub virtual_drop_rps: Option<f64>,
    /// Real drop rate (enforce), highest per-minute average in the step.
    pub drop_rps: Option<f64>,
    /// Admitted rate: `offered_rps - drop_rps` (exact for a one-minute step; on longer steps
    /// the busiest minute's offered rate less the step's highest drop rate). Virtual drops
    /// are admitted.
    pub admitted_rps: Option<f64>,
}

/// The series of one scope key (`global`, a region or a zone).
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
pub struct Series {
    /// The scope key ('' or `global` for a global bucket).
    pub scope_key: String,
    /// One point per step of the window, oldest first.
    pub points: Vec<Point>,
}

/// One step of a criticality tier's series: the mean rates over the step (the part of it
/// elapsed), every scope key together. Every value is `null` when no request with a tier was
/// counted in the step (a gap, or clients that count no tiers); zero when other tiers had
/// requests and this one none.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
pub struct TierPoint {
    /// Start of the step.
    pub t: DateTime<Utc>,
    /// Offered rate (rps).
    pub offered_rps: Option<f64>,
    /// Admitted rate (virtual drops are admitted).
    pub admitted_rps: Option<f64>,
    /// Real drop rate (enforce).
    pub drop_rps: Option<f64>,
    /// Virtual-drop rate (shadow).
    pub virtual_drop_rps: Option<f64>,
}

/// The requests of one criticality tier over the window.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
pub struct TierSeries {
    /// `SHEDDABLE`, `SHEDDABLE_PLUS`, `CRITICAL` or `CRITICAL_PLUS`.
    pub tier: String,
    /// Requests offered over the window.
    pub offered: f64,
    /// Requests dropped (real and virtual) over the window.
    pub dropped: f64,
    /// One point per step of the window, oldest first.
    pub points: Vec<TierPoint>,
}

/// Readiness of the bucket over the window.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct Readiness {
    /// The figures (see `rlc_plan::readiness::ShadowStats`).
    pub stats: ShadowStats,
    /// Days in shadow at the window's end.
    pub days_in_shadow: f64,
    /// Virtual drops ÷ offered over the window.
    pub virtual_drop_share: f64,
    /// The rule the verdict applies: the service's `promotion:` rule of `rlc/policies.yaml`
    /// (as a run applies it), else the default rule.
    pub rule: RuleView,
    /// The verdict of `rule`.
    pub verdict: Verdict,
    /// The verdict in words.
    pub verdict_text: String,
}

/// The promotion rule of a bucket page's verdict.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct RuleView {
    /// `rlc/policies.yaml` (the service's `promotion:` rule on the config repo's base as last
    /// fetched, the one a run applies) or `default` (no `promotion:` section, or no config
    /// repo on this server).
    pub source: String,
    /// Minimum days in shadow.
    pub min_days_in_shadow: f64,
    /// Maximum virtual-drop share.
    pub max_virtual_drop_share: f64,
    /// Minimum coverage.
    pub min_coverage: f64,
    /// Oldest last report, in seconds.
    pub max_report_age_secs: i64,
    /// Why the default rule is used although a config repo is configured (it could not be
    /// read), if so.
    pub problem: Option<String>,
}

impl RuleView {
    fn new(rule: &readiness::Rule, from_file: bool, problem: Option<String>) -> RuleView {
        RuleView {
            source: if from_file {
                "rlc/policies.yaml".into()
            } else {
                "default".into()
            },
            min_days_in_shadow: rule.min_days_in_shadow,
            max_virtual_drop_share: rule.max_virtual_drop_share,
            min_coverage: rule.min_coverage,
            max_report_age_secs: rule.max_report_age.num_seconds(),
            problem,
        }
    }

    /// The rule in words.
    pub fn describe(&self) -> String {
        let age = if self.max_report_age_secs % 60 == 0 {
            format!("{} min", self.max_report_age_secs / 60)
        } else {
            format!("{} s", self.max_report_age_secs)
        };
        format!(
            "{} rule: ≥ {} days in shadow, coverage ≥ {}%, virtual drops ≤ {}%, last report ≤ {age} old",
            if self.source == "default" {
                "default"
            } else {
                "rlc/policies.yaml"
            },
            short(self.min_days_in_shadow),
            short(self.min_coverage * 100.0),
            short(self.max_virtual_drop_share * 100.0),
        )
    }
}

/// A number with at most four decimals and no trailing zeros (`0.01`, `90`, `7.5`).
fn short(v: f64) -> String {
    let s = format!("{v:.4}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// The readiness rule of `service` as a run resolves it ([`rlc_plan::promotion::readiness_rule`])
/// from the config repo's base as last fetched; the default rule without a config repo.
pub(in crate::serve) async fn service_rule(
    s: &AppState,
    service: &str,
) -> (readiness::Rule, RuleView) {
    let (policies, problem) = match s.quotas() {
        None => (None, None),
        Some(q) => match q.base_policies().await {
            Ok(p) => (p, None),
            Err(e) => (None, Some(e.to_string())),
        },
    };
    let (rule, from_file) = rlc_plan::promotion::readiness_rule(policies.as_ref(), service);
    let view = RuleView::new(&rule, from_file, problem);
    (rule, view)
}

/// `GET /v1/shadow/{service}/{bucket}?window=1h`.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct BucketDetail {
    /// Callee service.
    pub service: String,
    /// Bucket.
    pub bucket: String,
    /// The window as asked.
    pub window: String,
    /// Start of the window (a minute boundary).
    pub window_start: DateTime<Utc>,
    /// End of the window (the current minute's end).
    pub window_end: DateTime<Utc>,
    /// Seconds per point.
    pub step_secs: i64,
    /// The figures and the verdict; null when the store holds no report of the bucket.
    pub readiness: Option<Readiness>,
    /// One series per scope key (at most 12, the busiest first).
    pub series: Vec<Series>,
    /// Scope keys not charted (beyond 12).
    pub scopes_cut: usize,
    /// The requests by criticality tier (from the controllers' `counts.tiers`), least
    /// critical first: one series per tier with requests in the window; empty when the
    /// bucket's clients count no tiers (or the controller is older).
    pub tiers: Vec<TierSeries>,
    /// The bucket's quota changes recorded by runs, newest first (at most 50).
    pub quota_history: Vec<QuotaChange>,
    /// The limit in force now, as the controllers serve it: the bucket in the config repo's
    /// base branch as last fetched, except while a rollout keeps the spec in force before it
    /// (its candidate baking, or aborted and not yet reverted): then that spec; null without a
    /// config repo on this server, when the bucket is not in it, or when it is new and only a
    /// candidate so far.
    pub in_force: Option<InForce>,
    /// The candidate limit baking beside the limit in force (the base branch's new spec under
    /// a rollout), with its stage and bake progress; null when none bakes.
    pub candidate: Option<crate::rollout::CandidateView>,
    /// The incident overrides acting on the bucket now, as rlc last saw them on the
    /// controller.
    pub overrides: Vec<OverrideView>,
    /// The history the quota is computed from (the daemon's history snapshot), with what the
    /// latest computed plan read from it; null before the first pull, without a config repo,
    /// or when the history has no series of the bucket.
    pub lookback: Option<super::lookback::Lookback>,
    /// The bucket's newest rollout (`rollout:` in `rlc/policies.yaml`): pending, baking in
    /// which region since when with the virtual drops so far, done, aborted and why; null
    /// when it never had one (or the store could not say in time).
    pub rollout: Option<crate::rollout::RolloutView>,
    /// The regions whose controller rlc could not read at its last poll (empty: every
    /// region's reports are in): the figures miss their reports since `since`, and no
    /// candidate is promoted on them.
    pub incomplete: Vec<crate::store::UnreadRegion>,
}

/// The limit in force of a bucket: its entry in the config repo's base branch, or the spec a
/// rollout keeps in force meanwhile.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
pub struct InForce {
    /// Requests per second.
    pub limit_rps: f64,
    /// enforce | shadow.
    pub mode: String,
    /// The policy that set it.
    pub policy: String,
    /// The base branch's commit the config repo was read at.
    pub commit: String,
    /// The bucket's caller (null: any caller).
    pub caller: Option<String>,
    /// The bucket's procedure (null: any procedure).
    pub procedure: Option<String>,
}

/// An incident override acting on a bucket.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
pub struct OverrideView {
    /// Its id.
    pub id: String,
    /// Why on-call added it.
    pub reason: String,
    /// When it started.
    pub from: DateTime<Utc>,
    /// Until when it acts as rlc knows: its expiry, or when its controller stopped listing
    /// it (removed early), or shortly after rlc last saw it when rlc has not polled since.
    pub to: DateTime<Utc>,
    /// When it expires (its TTL's end).
    pub expires_at: DateTime<Utc>,
    /// Who added it (empty when not known).
    pub who: String,
    /// What it does, in words (`limit 50 rps`, `drop 90 %`; empty when not known).
    pub action: String,
    /// The region of the controller it acts in (empty when not known).
    pub region: String,
    /// How many buckets it acts on: more than one for a caller-wide override, whose limit is
    /// shared between them (not this bucket's own).
    pub buckets: usize,
}

/// The window's bounds: whole minutes, ending with the current one. Steps of an hour or
/// more are whole hours starting on a multiple of the step (unix time), so that each of the
/// store's hourly roll-ups lies in one step: the window then starts at the step boundary
/// at or before `now - window` (up to one step longer) and its last step is the current,
/// partial one (at most `MAX_POINTS + 1` steps).
fn bounds(window: &str) -> Result<(DateTime<Utc>, DateTime<Utc>, i64), DashError> {
    let span = parse_window(window).map_err(|e| DashError::BadRequest(e.to_string()))?;
    let end = minute_of(Utc::now()) + Duration::minutes(1);
    let minutes = ((span.num_seconds() + 59) / 60).max(1);
    let step_minutes = ((minutes + MAX_POINTS - 1) / MAX_POINTS).max(1);
    if step_minutes >= 60 {
        let step = (step_minutes + 59) / 60 * 3600;
        let from = (end - Duration::minutes(minutes)).timestamp();
        let start = DateTime::<Utc>::from_timestamp(from.div_euclid(step) * step, 0)
            .unwrap_or(end - Duration::minutes(minutes));
        return Ok((start, end, step));
    }
    let steps = (minutes + step_minutes - 1) / step_minutes;
    let start = end - Duration::minutes(steps * step_minutes);
    Ok((start, end, step_minutes * 60))
}

/// The steps of `[start, end)`: how many (the last one may be partial: hour-aligned steps end
/// with the current minute) and where step `i` starts.
fn step_grid(
    start: DateTime<Utc>,
    end: DateTime<Utc>,
    step_secs: i64,
) -> (usize, impl Fn(usize) -> DateTime<Utc>) {
    let n = ((end - start).num_seconds() + step_secs - 1)
        .div_euclid(step_secs)
        .max(0) as usize;
    (n, move |i: usize| {
        start + Duration::seconds(i as i64 * step_secs)
    })
}

/// Series per scope key from the steps of [`Store::bucket_steps`]: each point is the
/// highest per-minute average of its step (so a one-minute burst stays visible in a 30-day
/// view) and the limit of the step's newest minute; a step without a row is a gap (every
/// value null). The busiest scope keys first, at most `MAX_SCOPES` (the count of the others
/// is returned).
pub fn series_from_steps(
    steps: &[StepRow],
    start: DateTime<Utc>,
    end: DateTime<Utc>,
    step_secs: i64,
) -> (Vec<Series>, usize) {
    let (n, at) = step_grid(start, end, step_secs);
    let mut by_scope: BTreeMap<&str, (f64, Vec<Option<Point>>)> = BTreeMap::new();
    for r in steps {
        if r.step < 0 || r.step as usize >= n {
            continue;
        }
        let i = r.step as usize;
        let e = by_scope
            .entry(r.scope_key.as_str())
            .or_insert_with(|| (0.0, vec![None; n]));
        e.0 += r.offered;
        e.1[i] = Some(Point {
            t: at(i),
            offered_rps: Some(r.offered_rps),
            limit_rps: Some(r.limit_rps),
            virtual_drop_rps: Some(r.virtual_drop_rps),
            drop_rps: Some(r.drop_rps),
            admitted_rps: Some((r.offered_rps - r.drop_rps).max(0.0)),
        });
    }
    let mut scopes: Vec<_> = by_scope.into_iter().collect();
    // Busiest first, then by name.
    scopes.sort_by(|a, b| b.1 .0.total_cmp(&a.1 .0).then(a.0.cmp(b.0)));
    let cut = scopes.len().saturating_sub(MAX_SCOPES);
    scopes.truncate(MAX_SCOPES);
    let out = scopes
        .into_iter()
        .map(|(scope, (_, pts))| Series {
            scope_key: scope.to_string(),
            points: pts
                .into_iter()
                .enumerate()
                .map(|(i, p)| {
                    p.unwrap_or(Point {
                        t: at(i),
                        offered_rps: None,
                        limit_rps: None,
                        virtual_drop_rps: None,
                        drop_rps: None,
                        admitted_rps: None,
                    })
                })
                .collect(),
        })
        .collect();
    (out, cut)
}

/// Series per tier from the rows of [`Store::tier_steps`], least critical first: each
/// point the mean rates over its step, or over the part of it before `now`; a step without
/// any tier's row is a gap (every value null).
pub fn tier_series(
    rows: &[crate::store::TierStepRow],
    start: DateTime<Utc>,
    end: DateTime<Utc>,
    step_secs: i64,
    now: DateTime<Utc>,
) -> Vec<TierSeries> {
    let (n, at) = step_grid(start, end, step_secs);
    let mut seen = vec![false; n];
    let mut by_tier: BTreeMap<schema::Criticality, (String, Vec<[f64; 4]>)> = BTreeMap::new();
    for r in rows {
        if r.step < 0 || r.step as usize >= n {
            continue;
        }
        let i = r.step as usize;
        seen[i] = true;
        let e = by_tier
            .entry(r.tier)
            .or_insert_with(|| (r.tier.as_str().to_string(), vec![[0.0; 4]; n]));
        e.1[i] = [r.offered, r.admitted, r.dropped, r.shadow_dropped];
    }
    by_tier
        .into_values()
        .map(|(tier, sums)| TierSeries {
            tier,
            offered: sums.iter().map(|c| c[0]).sum(),
            dropped: sums.iter().map(|c| c[2] + c[3]).sum(),
            points: sums
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    let to = (at(i) + Duration::seconds(step_secs)).min(end).min(now);
                    let secs = (to - at(i)).num_seconds().max(1) as f64;
                    let v = |x: f64| seen[i].then_some(x / secs);
                    TierPoint {
                        t: at(i),
                        offered_rps: v(c[0]),
                        admitted_rps: v(c[1]),
                        drop_rps: v(c[2]),
                        virtual_drop_rps: v(c[3]),
                    }
                })
                .collect(),
        })
        .collect()
}

/// The parts of a bucket's answer that could not be loaded (each named in `errors`); a part
/// not loaded is empty in the [`BucketDetail`] and never shown as such.
#[derive(Debug, Default)]
struct Missing {
    readiness: bool,
    chart: bool,
    tiers: bool,
    history: bool,
    overrides: bool,
    /// Why the config repo's bucket could not be read, if it could not.
    config: Option<String>,
    /// Why the page has no lookback chart.
    no_lookback: &'static str,
    errors: Vec<DashError>,
}

/// The overrides of `windows` acting on `service`/`bucket` at `now`, each with the number of
/// buckets it acts on (more than one: a caller-wide override sharing its limit).
pub fn overrides_on(
    windows: &BTreeMap<(String, String), Vec<rlc_plan::censor::OverrideWindow>>,
    service: &str,
    bucket: &str,
    now: DateTime<Utc>,
) -> Vec<OverrideView> {
    let mut spread: BTreeMap<&str, usize> = BTreeMap::new();
    for w in windows.values().flatten() {
        *spread.entry(w.id.as_str()).or_default() += 1;
    }
    windows
        .get(&(service.to_string(), bucket.to_string()))
        .into_iter()
        .flatten()
        .filter(|w| w.from <= now && now < w.to)
        .map(|w| OverrideView {
            id: w.id.clone(),
            reason: w.reason.clone(),
            from: w.from,
            to: w.to,
            expires_at: w.expires_at,
            who: w.who.clone(),
            action: w.action.clone(),
            region: w.region.clone(),
            buckets: spread.get(w.id.as_str()).copied().unwrap_or(1),
        })
        .collect()
}

/// The bucket in the config repo's base branch as last fetched, with the commit: `Ok(None)`
/// without a config repo on this server or when the bucket is not in it, an error when it
/// cannot be read.
async fn base_bucket(
    s: &AppState,
    service: &str,
    bucket: &str,
) -> Result<Option<(String, schema::Bucket)>, BaseReadError> {
    let Some(q) = s.quotas() else {
        return Ok(None);
    };
    let (commit, files) = q.base_buckets().await?;
    Ok(files
        .into_iter()
        .filter(|f| f.service == service)
        .flat_map(|f| f.buckets)
        .find(|b| b.name == bucket)
        .map(|b| (commit, b)))
}

/// The limit in force as the controllers serve it ([`crate::rollout::enforced`]: the base
/// branch's spec, or the one the bucket's newest rollout keeps in force), and the candidate
/// baking beside it.
fn in_force_of(
    base: Option<&(String, schema::Bucket)>,
    rollout: Option<&crate::rollout::Rollout>,
    now: DateTime<Utc>,
) -> (Option<InForce>, Option<crate::rollout::CandidateView>) {
    let e = crate::rollout::enforced(base.map(|(_, b)| b), rollout, now);
    let in_force = e.spec.zip(base).map(|(b, (commit, _))| InForce {
        limit_rps: b.limit_rps,
        mode: b.mode.as_str().to_string(),
        policy: b.policy.to_string(),
        commit: commit.clone(),
        caller: b.caller.clone(),
        procedure: b.procedure.clone(),
    });
    (in_force, e.candidate)
}

/// The bucket's lookback from the quota API's latest plan and its snapshot (else the latest
/// snapshot alone), from memory; or why there is none.
fn lookback(
    s: &AppState,
    service: &str,
    bucket: &str,
    in_force: Option<&InForce>,
) -> Result<super::lookback::Lookback, &'static str> {
    let q = s
        .quotas()
        .ok_or("No config repo on this server: no history is read.")?;
    let computed = q.latest();
    let snapshot = computed
        .as_ref()
        .map(|c| c.snapshot().clone())
        .or_else(|| q.cache.latest())
        .ok_or(if q.cache.pulls() > 0 {
            "The history is being pulled (rlc serve pulls it at start); reload in a moment."
        } else {
            "No history pulled yet (rlc serve pulls it at start; so do a run and GET /v1/quotas)."
        })?;
    let planned = computed.as_ref().and_then(|c| {
        c.plan()
            .buckets
            .iter()
            .find(|b| b.service == service && b.bucket.name == bucket)
            .cloned()
    });
    let (caller, procedure) = match (in_force, &planned) {
        (Some(f), _) => (f.caller.clone(), f.procedure.clone()),
        (None, Some(p)) => (p.bucket.caller.clone(), p.bucket.procedure.clone()),
        (None, None) => return Err("The bucket is not in the config repo or the plan."),
    };
    // One service's series (read from disk when the daemon holds its history there).
    let history =
        rlc_plan::history::SeriesSource::service(&*snapshot.history, service).map_err(|e| {
            tracing::warn!(error = %e, service, "reading the held history");
            "The history could not be read (see the daemon's log)."
        })?;
    let (start, step, points, series) =
        super::lookback::from_history(&history, service, caller.as_deref(), procedure.as_deref())
            .ok_or("The history has no series of this bucket.")?;
    let at = |t: i64| DateTime::<Utc>::from_timestamp(t, 0).unwrap_or_default();
    Ok(super::lookback::Lookback {
        start: at(start),
        end: at(start + step * points.len() as i64),
        step_secs: step,
        points,
        series,
        pulled_at: snapshot.pulled_at,
        source: snapshot.source.clone(),
        computed: planned.zip(computed).map(|(p, c)| {
            let f = p
                .evidence
                .policy
                .as_ref()
                .map(|e| e.figures())
                .unwrap_or_default();
            super::lookback::Computed {
                policy: p.bucket.policy.to_string(),
                statistic: f.statistic,
                statistic_rps: f.value_rps,
                forecast_upper_bound_rps: f.upper_bound_rps,
                headroom: f.headroom,
                headroom_auto: f.headroom_auto,
                limit_rps: p.bucket.limit_rps,
                capped_from_rps: p.evidence.capped_from,
                explain: p.evidence.explain.clone(),
                computed_at: c.computed_at(),
            }
        }),
    })
}

/// Whether a bucket is unknown: not in the config repo (when there is one and it was read)
/// and without a report or a recorded change in the store.
fn unknown(d: &BucketDetail, missing: &Missing, config_read: bool, in_config: bool) -> bool {
    !in_config
        && d.readiness.is_none()
        && d.quota_history.is_empty()
        && !missing.readiness
        && !missing.history
        && config_read
}

impl Missing {
    /// The part's value, or None with its error recorded and its `flag` set.
    fn part<T>(
        &mut self,
        r: Result<T, DashError>,
        flag: fn(&mut Missing) -> &mut bool,
    ) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(e) => {
                *flag(self) = true;
                self.errors.push(e);
                None
            }
        }
    }
}

/// The readiness of a bucket from its shadow figures, judged by `rule` at `now`.
fn readiness_of(
    stats: ShadowStats,
    rule: readiness::Rule,
    rule_view: RuleView,
    now: DateTime<Utc>,
) -> Readiness {
    let verdict = readiness::verdict(&stats, &rule, now);
    Readiness {
        rule: rule_view,
        days_in_shadow: stats.days_in_shadow(now),
        virtual_drop_share: stats.drop_share(),
        // An enforced bucket's verdict says what it really drops, as the overview does.
        verdict_text: match verdict {
            Verdict::Enforced if stats.dropped > 0.0 => format!(
                "enforced: {}",
                super::overview::dropping(stats.dropped, stats.offered)
            ),
            _ => verdict.describe(),
        },
        verdict,
        stats,
    }
}

async fn detail(
    store: &Store,
    (rule, rule_view): (readiness::Rule, RuleView),
    service: &str,
    bucket: &str,
    window: &str,
    limit: std::time::Duration,
    base: Option<&(String, schema::Bucket)>,
) -> Result<(BucketDetail, Missing), DashError> {
    let (start, end, step_secs) = bounds(window)?;
    const AT: &str = "/v1/shadow/{service}/{bucket}";
    // The figures, the chart steps and the history, each within the query timeout (at once
    // where the store allows it).
    let stats = load(
        AT,
        "the readiness figures",
        limit,
        store.shadow_stats(service, bucket, start, end),
    );
    let steps = load(
        AT,
        "the chart",
        limit,
        store.bucket_steps(service, bucket, start, end, step_secs),
    );
    let tiers = load(
        AT,
        "the criticality chart",
        limit,
        store.tier_steps(service, bucket, start, end, step_secs),
    );
    let history = load(
        AT,
        "the quota history",
        limit,
        store.quota_changes(service, bucket, MAX_CHANGES),
    );
    let now = Utc::now();
    let overrides = load(
        AT,
        "the incident overrides",
        limit,
        store.override_windows(now),
    );
    let (stats, steps, tiers, history, overrides) = if store.concurrent() {
        tokio::join!(stats, steps, tiers, history, overrides)
    } else {
        (
            stats.await,
            steps.await,
            tiers.await,
            history.await,
            overrides.await,
        )
    };
    let mut missing = Missing::default();
    let stats = missing.part(stats, |m| &mut m.readiness).flatten();
    let steps = missing.part(steps, |m| &mut m.chart).unwrap_or_default();
    let tiers = missing.part(tiers, |m| &mut m.tiers).unwrap_or_default();
    let quota_history = missing
        .part(history, |m| &mut m.history)
        .unwrap_or_default();
    let overrides = missing
        .part(overrides, |m| &mut m.overrides)
        .unwrap_or_default();
    let rollout = crate::store::within(limit, store.recent_rollouts(Some((service, bucket)), 1))
        .await
        .ok()
        .and_then(|rows| rows.first().and_then(crate::rollout::Rollout::from_row));
    let (in_force, candidate) = in_force_of(base, rollout.as_ref(), now);
    let rollout = rollout.map(|r| r.view(now));
    let incomplete = load(AT, "the regions read", limit, store.unread_regions()).await;
    let incomplete = missing
        .part(incomplete, |m| &mut m.readiness)
        .unwrap_or_default();
    let (series, scopes_cut) = series_from_steps(&steps, start, end, step_secs);
    let overrides = overrides_on(&overrides, service, bucket, now);
    let detail = BucketDetail {
        service: service.into(),
        bucket: bucket.into(),
        window: window.into(),
        window_start: start,
        window_end: end,
        step_secs,
        readiness: stats.map(|stats| readiness_of(stats, rule, rule_view, now)),
        series,
        scopes_cut,
        tiers: tier_series(&tiers, start, end, step_secs, now),
        quota_history,
        in_force,
        candidate,
        overrides,
        lookback: None,
        rollout,
        incomplete,
    };
    Ok((detail, missing))
}

fn window_of(q: BucketQuery) -> String {
    super::window_or_default(q.window)
}

/// `GET /v1/shadow/{service}/{bucket}?window=1h`: see [`BucketDetail`]. 400 for a bad window,
/// 404 when the store holds no report of the bucket; 503 without a store, or when a part is
/// not loaded within `store.query_timeout` or the store is unreachable, 500 when the store
/// refuses a query (both naming the part).
pub(in crate::serve) async fn bucket_json(
    State(s): State<AppState>,
    Path(BucketPath { service, bucket }): Path<BucketPath>,
    Query(q): Query<BucketQuery>,
) -> Result<Json<BucketDetail>, DashError> {
    let window = window_of(q);
    let store = s.store().ok_or(DashError::NoStore)?;
    let rule = service_rule(&s, &service).await;
    let base = base_bucket(&s, &service, &bucket).await;
    let config_read = base.is_ok();
    let base = base.unwrap_or(None);
    let (d, missing) = detail(
        &store,
        rule,
        &service,
        &bucket,
        &window,
        s.query_timeout(),
        base.as_ref(),
    )
    .await?;
    if unknown(&d, &missing, config_read, base.is_some()) {
        return Err(not_found(&service, &bucket, s.quotas().is_some()));
    }
    let mut d = d;
    d.lookback = lookback(&s, &service, &bucket, d.in_force.as_ref()).ok();
    if let Some(e) = missing.errors.into_iter().next() {
        return Err(e);
    }
    Ok(Json(d))
}

/// `GET /buckets/{service}/{bucket}?window=1h`: the HTML page.
pub(in crate::serve) async fn bucket_page(
    State(s): State<AppState>,
    Path(BucketPath { service, bucket }): Path<BucketPath>,
    Query(q): Query<BucketQuery>,
) -> Response {
    let window = window_of(q);
    let mut config_problem = None;
    let mut base = None;
    let res = match s.store() {
        None => Err(DashError::NoStore),
        Some(store) => {
            let rule = service_rule(&s, &service).await;
            match base_bucket(&s, &service, &bucket).await {
                Ok(b) => base = b,
                Err(e) => config_problem = Some(e.to_string()),
            };
            detail(
                &store,
                rule,
                &service,
                &bucket,
                &window,
                s.query_timeout(),
                base.as_ref(),
            )
            .await
        }
    };
    let links = s.links();
    let (status, body) = match res {
        Ok((d, missing)) if unknown(&d, &missing, config_problem.is_none(), base.is_some()) => {
            let e = not_found(&service, &bucket, s.quotas().is_some());
            (
                e.status(),
                error_page(&format!("Bucket {service}/{bucket}"), &e.message()),
            )
        }
        Ok((mut d, mut missing)) => {
            if let Some(p) = config_problem {
                missing.config = Some(p);
            }
            match lookback(&s, &service, &bucket, d.in_force.as_ref()) {
                Ok(l) => d.lookback = Some(l),
                Err(why) => missing.no_lookback = why,
            }
            (
                missing
                    .errors
                    .first()
                    .map_or(StatusCode::OK, DashError::status),
                render(&service, &bucket, &window, &links, Ok((&d, &missing))),
            )
        }
        Err(e) => (
            e.status(),
            render(&service, &bucket, &window, &links, Err(&e.message())),
        ),
    };
    (status, Html(body)).into_response()
}

/// The 404 of an unknown bucket.
fn not_found(service: &str, bucket: &str, with_config: bool) -> DashError {
    DashError::NotFound(if with_config {
        format!(
            "no bucket `{bucket}` of service `{service}`: not in the config repo, and no report \
             or recorded change in the store"
        )
    } else {
        format!("no report of bucket `{bucket}` of service `{service}` in the store")
    })
}

/// Points drawn as markers when a series has at most this many values (a minute of data is
/// a visible dot, not a speck).
const MARKERS_UP_TO: usize = 90;
/// Height of a series chart (px).
const CHART_H: f64 = 250.0;

/// The series a chart draws: class, legend label, values, drawn as a step line or not.
type Line = (&'static str, &'static str, Vec<Option<f64>>, bool);

/// Runs of steps without a report, as `[first, end)`.
fn gaps(points: &[Point]) -> Vec<(usize, usize)> {
    let mut gaps = Vec::new();
    let mut i = 0;
    while i < points.len() {
        if points[i].offered_rps.is_none() {
            let j = (i..points.len())
                .find(|&j| points[j].offered_rps.is_some())
                .unwrap_or(points.len());
            gaps.push((i, j));
            i = j;
        } else {
            i += 1;
        }
    }
    gaps
}

/// The lines of a series' chart, in drawing order; the drop lines only when there were drops
/// (a flat zero line says nothing).
fn lines(points: &[Point]) -> Vec<Line> {
    let get = |f: fn(&Point) -> Option<f64>| points.iter().map(f).collect::<Vec<_>>();
    [
        ("limit", "limit", get(|p| p.limit_rps), true),
        // Admitted under offered, wider: where nothing was really dropped the two coincide,
        // and admitted shows as a band around the offered line.
        ("admitted", "admitted", get(|p| p.admitted_rps), false),
        ("offered", "offered", get(|p| p.offered_rps), false),
        (
            "virtual-drops",
            "virtual drops",
            get(|p| p.virtual_drop_rps),
            false,
        ),
        ("drops", "real drops", get(|p| p.drop_rps), false),
    ]
    .into_iter()
    .filter(|(name, _, values, _)| {
        !name.ends_with("drops") || values.iter().flatten().any(|v| *v > 0.0)
    })
    .collect()
}

/// One chart: offered, admitted, limit (a step line) and drops of a series, gaps shaded,
/// with a time axis, a rate axis in requests/s and a legend. Every text is escaped.
fn chart(s: &Series, d: &BucketDetail) -> Markup {
    let max = s
        .points
        .iter()
        .flat_map(|p| [p.offered_rps, p.limit_rps, p.virtual_drop_rps, p.drop_rps])
        .flatten()
        .fold(0.0f64, f64::max);
    let f = Frame::new(CHART_H, d.window_start, d.window_end, s.points.len(), max);
    let n = s.points.len().max(1);
    let px_per_sec = f.plot_w() / (n as f64 * d.step_secs as f64);
    // SVG elements get an end tag each: in HTML, `<line …>` without one would hold what
    // follows it.
    html! {
        figure class="chart" {
            figcaption { "Scope " code { (s.scope_key) } }
            svg xmlns="http://www.w3.org/2000/svg" viewBox={ "0 0 " (W) " " (f.height) } width=(W)
                height=(f.height) role="img" data-scope=(s.scope_key) data-t0=(d.window_start.timestamp())
                data-x0=(LEFT) data-px-per-sec=(px_per_sec) data-y0=(TOP + f.plot_h())
                data-px-per-rps=(f.plot_h() / f.top) {
                title { (d.service) "/" (d.bucket) " scope " (s.scope_key) ", requests/s" }
                // Gaps: steps without a report, shaded and labelled.
                @for (i, j) in gaps(&s.points) {
                    rect class="gap" x=(dec1(f.x(i))) y=(TOP) width=(dec1(f.x(j) - f.x(i)))
                        height=(f.plot_h()) {
                        title {
                            "no reports " (when(s.points[i].t)) " – "
                            (when(s.points[i].t + Duration::seconds((j - i) as i64 * d.step_secs)))
                            " UTC"
                        }
                    }
                }
                (f.axes())
                (series_lines(&f, s, &lines(&s.points)))
            }
        }
    }
}

/// The legend (above the plot) and the lines of a series' chart, with a marker per value
/// when there are few.
fn series_lines(f: &Frame, s: &Series, lines: &[Line]) -> Markup {
    let valued = s.points.iter().filter(|p| p.offered_rps.is_some()).count();
    let markers = valued <= MARKERS_UP_TO;
    let (x, mid, y) = (|i| f.x(i), |i| f.mid(i), |v| f.y(v));
    html! {
        @for (k, (name, label, _, _)) in lines.iter().enumerate() {
            @let lx = LEFT + k as f64 * 130.0;
            line class={ "key " (name) } x1=(dec1(lx)) x2=(dec1(lx + 22.0)) y1="12" y2="12" {}
            text class="legend" x=(dec1(lx + 28.0)) y="16" { (label) }
        }
        @for (name, _, values, step) in lines {
            @let p = if *step { step_path(values, x, y) } else { path(values, mid, y) };
            path class=(name) data-series=(name) d=(p) {}
            @if markers && !*step {
                @for (i, v) in values.iter().enumerate() {
                    @if let Some(v) = v {
                        circle class={ "marker " (name) } cx=(dec1(f.mid(i))) cy=(dec1(f.y(*v)))
                            r=(match *name { "admitted" => "7", "offered" => "4", _ => "3" }) {
                            title { (label_of(name)) " " (rate(*v)) " requests/s at " (when(s.points[i].t)) " UTC" }
                        }
                    }
                }
            }
        }
    }
}

/// A series' name in words.
fn label_of(name: &str) -> &str {
    match name {
        "virtual-drops" => "virtual drops",
        "drops" => "real drops",
        other => other,
    }
}

fn render(
    service: &str,
    bucket: &str,
    window: &str,
    links: &Links,
    d: Result<(&BucketDetail, &Missing), &str>,
) -> String {
    html! {
        (DOCTYPE)
        html lang="en" {
            (super::head(&format!("RLC bucket {service}/{bucket}"), &[CSS, CHART_CSS]))
            body {
                header {
                    h1 { "Bucket " code { (super::overview::name_html(bucket)) } " of " code { (super::overview::name_html(service)) } }
                    p {
                        a href={ "/?service=" (encoded(service)) "&window=" (encoded(window)) } {
                            "← all buckets"
                        }
                        " · last " (window)
                    }
                }
                main {
                    // The window choice: plain links, no script.
                    section {
                        nav class="windows" {
                            "Window: "
                            @for w in WINDOWS {
                                @if *w == window {
                                    b { (w) } " "
                                } @else {
                                    a href={
                                        "/buckets/" (encoded(service)) "/" (encoded(bucket))
                                        "?window=" (w)
                                    } { (w) }
                                    " "
                                }
                            }
                            "· "
                            a href={
                                "/v1/shadow/" (encoded(service)) "/" (encoded(bucket))
                                "?window=" (encoded(window))
                            } { "JSON" }
                        }
                    }
                    @match d {
                        Ok((d, missing)) => { (sections(d, missing, links)) }
                        Err(problem) => {
                            section class="notice" id="problem" {
                                h2 { "Could not load this bucket" }
                                p { (super::prose(problem)) }
                            }
                        }
                    }
                }
            }
        }
    }
    .into_string()
}

/// What loaded of the bucket, and a notice naming what did not.
fn sections(d: &BucketDetail, missing: &Missing, links: &Links) -> Markup {
    let mut problems: Vec<String> = missing.errors.iter().map(DashError::notice).collect();
    if let Some(p) = &missing.config {
        problems.push(format!(
            "The bucket in the config repo could not be read: {p}"
        ));
    }
    html! {
        (problems_notice(&problems))
        (super::incomplete_notice(&d.incomplete))
        (in_force_section(d, links))
        @if let Some(r) = &d.rollout {
            section id="rollout" class=[(r.state == "aborted").then_some("notice")] {
                h2 { "Rollout" }
                p { strong { (r.state) } " — " (super::prose(&r.change)) }
                p { (super::prose(&r.summary)) }
                @if let Some(how) = &r.revert { p class="muted" { (super::prose(how)) } }
            }
        }
        @if !d.overrides.is_empty() {
            (overrides_section(&d.overrides))
        }
        @match &d.readiness {
            None if missing.readiness => {}
            None => {
                section class="notice" id="problem" {
                    h2 { "No reports" }
                    p {
                        "The store holds no report of this bucket (never reported, or older than \
                         the roll-up retention)."
                    }
                }
            }
            Some(r) => { (readiness_section(r)) }
        }
        section {
            h2 { "Traffic" }
            p class="muted" {
                "Requests per second as the controller reported them, per-minute averages"
                @if d.step_secs > 60 {
                    " (each point: the busiest minute of its " (step_words(d.step_secs)) " step)"
                }
                "; the limit is a step line (the limit of each step's latest report); shaded: \
                 no reports (a gap in the report feed, not zero traffic)."
            }
            @if missing.chart {
                p class="err" id="chart-not-loaded" { "Not loaded (see above)." }
            } @else if d.series.is_empty() {
                p class="muted" id="no-series" { "No report in this window." }
            }
            @for s in &d.series {
                (chart(s, d))
            }
            @if d.scopes_cut > 0 {
                p class="muted" { (d.scopes_cut) " more scope keys not charted." }
            }
        }
        @if missing.tiers || !d.tiers.is_empty() {
            (tiers_section(d, missing.tiers))
        }
        (super::lookback::section(d.lookback.as_ref(), missing.no_lookback))
        section {
            h2 { "Quota history" }
            @if missing.history {
                p class="err" id="history-not-loaded" { "Not loaded (see above)." }
            } @else if d.quota_history.is_empty() {
                p class="muted" { "No change recorded by a run." }
            } @else {
                (quota_history(&d.quota_history, links))
            }
        }
    }
}

/// The requests by criticality tier: offered and dropped (real and virtual), each a chart
/// stacked by tier, least critical at the bottom, and the window's shares in a table.
fn tiers_section(d: &BucketDetail, not_loaded: bool) -> Markup {
    let offered: f64 = d.tiers.iter().map(|t| t.offered).sum();
    html! {
        section id="tiers" {
            h2 { "By criticality" }
            @if not_loaded {
                p class="err" id="tiers-not-loaded" { "Not loaded (see above)." }
            } @else {
                p class="muted" {
                    "Requests per second by criticality tier (the " code { "rpc-criticality" }
                    " header; none means CRITICAL), mean rates over each "
                    (step_words(d.step_secs)) " step, every scope key together. "
                    "Over its limit, the bucket sheds the least critical tiers first."
                }
                table class="tiers" {
                    thead { tr { th { "tier" } th { "offered" } th { "share of requests with a tier" } th { "dropped (real and virtual)" } } }
                    tbody {
                        @for t in d.tiers.iter().rev() {
                            tr data-tier=(t.tier) {
                                td { code { (t.tier) } }
                                td class="num" { (rate(t.offered)) }
                                td class="num" { (percent(t.offered / offered.max(1.0))) }
                                td class="num" { (rate(t.dropped)) " (" (percent(t.dropped / t.offered.max(1.0))) ")" }
                            }
                        }
                    }
                }
                (stacked_chart(d, "offered", "Offered by tier", |p| p.offered_rps))
                (stacked_chart(d, "dropped", "Dropped by tier (real and virtual)", |p| {
                    Some(p.drop_rps? + p.virtual_drop_rps?)
                }))
            }
        }
    }
}

/// A chart of one figure of every tier, stacked (least critical at the bottom), one bar per
/// step; a step without tiers is left empty.
fn stacked_chart(
    d: &BucketDetail,
    kind: &str,
    caption: &str,
    value: fn(&TierPoint) -> Option<f64>,
) -> Markup {
    let n = d.tiers.first().map_or(0, |t| t.points.len());
    let totals: Vec<f64> = (0..n)
        .map(|i| d.tiers.iter().filter_map(|t| value(&t.points[i])).sum())
        .collect();
    let max = totals.iter().copied().fold(0.0f64, f64::max);
    let f = Frame::new(CHART_H, d.window_start, d.window_end, n, max);
    // Each bar: its step, tier, value and the stack below it.
    let mut bars = Vec::new();
    for i in 0..n {
        let mut below = 0.0;
        for t in &d.tiers {
            if let Some(v) = value(&t.points[i]).filter(|v| *v > 0.0) {
                bars.push((i, t, v, below));
                below += v;
            }
        }
    }
    html! {
        figure class="chart" {
            figcaption { (caption) }
            svg xmlns="http://www.w3.org/2000/svg" viewBox={ "0 0 " (W) " " (f.height) } width=(W)
                height=(f.height) role="img" data-chart=(kind) {
                title { (d.service) "/" (d.bucket) " " (caption) ", requests/s" }
                (f.axes())
                @for (k, t) in d.tiers.iter().enumerate() {
                    @let lx = LEFT + k as f64 * 160.0;
                    rect class={ "key " (tier_class(&t.tier)) } x=(dec1(lx)) y="6" width="14" height="12" {}
                    text class="legend" x=(dec1(lx + 20.0)) y="16" { (t.tier) }
                }
                @for (i, t, v, below) in bars {
                    @let (y0, y1) = (f.y(below), f.y(below + v));
                    rect class={ "bar " (tier_class(&t.tier)) } data-tier=(t.tier) data-step=(i)
                        x=(dec1(f.x(i))) y=(dec1(y1)) width=(dec1((f.x(i + 1) - f.x(i)).max(0.5)))
                        height=(dec1(y0 - y1)) {
                        title { (t.tier) " " (rate(v)) " requests/s at " (when(t.points[i].t)) " UTC" }
                    }
                }
            }
        }
    }
}

/// The CSS class of a tier's bars (`tier-sheddable-plus`).
fn tier_class(tier: &str) -> String {
    format!("tier-{}", tier.to_ascii_lowercase().replace('_', "-"))
}

/// A step length in words (`1 min`, `28 min`, `2 h`).
fn step_words(secs: i64) -> String {
    if secs % 3_600 == 0 {
        format!("{} h", secs / 3_600)
    } else {
        format!("{} min", (secs / 60).max(1))
    }
}

/// The limit in force now (the config repo's base branch, or the spec a rollout keeps in
/// force), the candidate baking beside it, and the controller's latest report when it
/// differs.
fn in_force_section(d: &BucketDetail, links: &Links) -> Markup {
    let reported = d.readiness.as_ref().map(|r| r.stats.limit_rps);
    html! {
        section id="in-force" {
            h2 { "Limit in force" }
            @match &d.in_force {
                Some(f) => {
                    p {
                        span class="big" id="limit-in-force" { (rate(f.limit_rps)) " requests/s" }
                        " · " span class="badge mode" { (f.mode) } " · policy " code { (f.policy) }
                        " · config repo base at " (links.commit_html(&f.commit))
                    }
                    @if let Some(rep) = reported.filter(|r| (r - f.limit_rps).abs() > 0.005 * f.limit_rps.abs().max(1.0)) {
                        p class="muted" id="reported-limit" {
                            "The controller's latest report in this window says " (rate(rep))
                            " requests/s: it had not applied this limit yet then"
                            @if !d.overrides.is_empty() { ", or an incident override set it" }
                            ". The virtual and real drops and the verdict below were counted \
                             against the reported limit."
                        }
                    }
                }
                None => {
                    p class="muted" id="limit-in-force" {
                        @if d.candidate.is_some() {
                            "None yet: a new bucket, only a candidate so far"
                        } @else {
                            "Not in the config repo"
                        }
                        @if let Some(rep) = reported { " · latest report: " (rate(rep)) " requests/s" }
                        "."
                    }
                }
            }
            @if let Some(c) = &d.candidate {
                p id="candidate" {
                    span class="badge candidate" { "candidate" } " "
                    strong { (rate(c.limit_rps)) " requests/s" } " " (c.mode)
                    " (the config repo's base branch), " (c.state) " in region "
                    (c.regions.join(", ")) ", stage " (c.stage) " of " (c.stages) ": "
                    (format!("{:.0}", c.bake_progress * 100.0)) " % of the "
                    (step_words(c.bake_seconds as i64)) " bake"
                    @if !c.in_force_regions.is_empty() {
                        "; already in force in region " (c.in_force_regions.join(", "))
                    }
                    ". The controllers evaluate it without enforcing it until its stages pass."
                }
            }
        }
    }
}

/// The incident overrides acting on the bucket now; a caller-wide one says so.
fn overrides_section(overrides: &[OverrideView]) -> Markup {
    html! {
        section id="overrides" class="notice" {
            h2 { "Incident overrides in force" }
            ul {
                @for o in overrides {
                    li data-override=(o.id) {
                        code { (o.id) }
                        @if !o.action.is_empty() { " " strong { (o.action) } }
                        ": " (super::prose(&o.reason))
                        @if !o.who.is_empty() { " · by " (o.who) }
                        @if !o.region.is_empty() { " · region " (o.region) }
                        " · since " (when(o.from)) " UTC, expires " (when(o.expires_at)) " UTC"
                        @if o.buckets > 1 {
                            " · " b { "caller-wide" } ": acts on " (o.buckets)
                            " buckets and shares its limit between them; it is not this bucket's own limit"
                        }
                    }
                }
            }
            p class="muted" {
                "As rlc last saw them on the controllers (" code { "GET /v1/overrides" } ", read at each report poll)."
            }
        }
    }
}

/// What a proposed change's Change cell says on hover.
const PROPOSED_TITLE: &str =
    "on the pull-request branch, waiting for review: the limit in force is unchanged";

/// The bucket's recorded changes, each with the run, commit and pull request that made it; a
/// proposed change reads as a proposal (`lowered (proposed)`, row class `proposed`).
fn quota_history(changes: &[QuotaChange], links: &Links) -> Markup {
    let opt = |v: Option<f64>| v.map(rate).unwrap_or_else(|| "—".into());
    html! {
        table id="quota-history" {
            thead {
                tr {
                    th { "Recorded (UTC)" } th { "Change" }
                    th class="num" { "Limit rps" } th class="num" { "Before" }
                    th { "Mode" } th { "Policy" } th class="num" { "Run" }
                    th { "Commit" } th { "Pull request" }
                }
            }
            tbody {
                @for q in changes {
                    // A proposal waits for review on the pull-request branch: it did not change
                    // the limit in force, and the row says so.
                    @let proposed = q.state == ChangeState::Proposed;
                    tr class=[proposed.then_some("proposed")] {
                        td class="nowrap" { (when(q.recorded_at)) }
                        td title=[proposed.then_some(PROPOSED_TITLE)] {
                            (q.change)
                            @if proposed { " (proposed)" }
                        }
                        td class="num" { (opt(q.limit_rps)) }
                        td class="num" { (opt(q.previous_limit_rps)) }
                        td { (q.mode.as_deref().unwrap_or("")) }
                        td { (q.policy.as_deref().unwrap_or("")) }
                        // The run that made the change: its record (summary, commit, error).
                        td class="num" { a href={ "/runs/" (q.run_id) } { (q.run_id) } }
                        td {
                            @match q.commit_sha.as_deref() {
                                Some(c) => { (links.commit_html(c)) }
                                None => { "—" }
                            }
                        }
                        // The pull request that carries it (none: committed directly).
                        td {
                            @match &q.pull_request {
                                Some(pr) => { (pull_request_html(pr)) }
                                None => { "—" }
                            }
                        }
                    }
                }
            }
        }
    }
}

fn readiness_section(r: &Readiness) -> Markup {
    let s = &r.stats;
    let badge = match &r.verdict {
        Verdict::Ready => "ok",
        Verdict::Enforced if s.dropped > 0.0 => "dropping",
        Verdict::Enforced => "mode",
        _ => "warn",
    };
    let opt_when = |t: Option<DateTime<Utc>>| t.map(when).unwrap_or_else(|| "—".into());
    html! {
        section id="readiness" {
            h2 { "Readiness" }
            p {
                "Verdict: "
                span class={ "badge " (badge) } id="verdict" { (super::prose(&r.verdict_text)) }
                " "
                span class="muted" id="rule" { "(" (r.rule.describe()) ")" }
            }
            @if let Some(problem) = &r.rule.problem {
                p class="err" {
                    "The service's rule in rlc/policies.yaml could not be read (" (problem)
                    "); the default rule applies here."
                }
            }
            table class="facts" {
                tbody {
                    tr { th { "Mode" } td id="mode" { (s.mode) } }
                    tr {
                        th { "In shadow since" }
                        td id="shadow-since" {
                            (opt_when(s.shadow_since)) " (" (dec1(r.days_in_shadow)) " days)"
                        }
                    }
                    tr { th { "Coverage" } td id="coverage" { (percent(s.coverage)) } }
                    tr { th { "Offered" } td id="offered" { (rate(s.offered)) } }
                    tr {
                        th { "Virtual drops" }
                        td id="virtual-drops" {
                            (rate(s.virtual_dropped)) " (" (percent(r.virtual_drop_share)) ")"
                        }
                    }
                    tr {
                        th { "Real drops" }
                        td id="drops" {
                            (rate(s.dropped)) " (" (percent(super::overview::share(s.dropped, s.offered))) ")"
                        }
                    }
                    tr {
                        th { "Peak virtual-drop share (minute)" }
                        td id="peak" {
                            (percent(s.peak_drop_share)) " at " (opt_when(s.peak_drop_at))
                        }
                    }
                    tr {
                        th { "Limit in the latest report, rps" }
                        td id="limit" { (rate(s.limit_rps)) }
                    }
                    tr {
                        th { "Suggested limit rps (virtual drops ≤ 0.01%)" }
                        td id="suggested" {
                            (s.suggested_limit_rps.map(dec1).unwrap_or_else(|| "—".into()))
                        }
                    }
                    tr { th { "Last report" } td id="last-report" { (opt_when(s.last_report)) } }
                }
            }
        }
    }
}
