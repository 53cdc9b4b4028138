//! One bucket's plan as every view serves it: `GET /v1/quotas…` and `rlc preview --format
//! json` (the change, the confidence, the rail that held or capped it, the per-bucket
//! numbers, and the rollout that keeps another limit in force meanwhile).

use chrono::Utc;
use schema::ConfigRepo;
use schemars::JsonSchema;
use serde::Serialize;

use rlc_plan::plan::PlannedBucket;

/// How the limit a run would write differs from the current one.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct Change {
    /// `new` (no current bucket), `raised`, `lowered`, `unchanged`, or `held` (a decrease
    /// waits for the decrease interval: the current limit is kept).
    pub kind: &'static str,
    /// `limit_rps - current_limit_rps` (none for a new bucket).
    pub delta_rps: Option<f64>,
    /// The same in percent of the current limit (none for a new bucket or a current 0).
    pub percent: Option<f64>,
}

/// Numbers behind one bucket's limit, from its evidence (absent when the policy has none).
#[derive(Debug, Clone, Default, Serialize, JsonSchema)]
pub struct Details {
    /// The highest rate observed in the window.
    pub peak_rps: Option<f64>,
    /// When it happened.
    pub peak_at: Option<String>,
    /// The statistic the limit is based on: `max` or a percentile such as `p99.9` (peak).
    pub statistic: Option<String>,
    /// That statistic's value.
    pub statistic_rps: Option<f64>,
    /// When the statistic was reached (`max` only; differs from `peak_at` when a spike
    /// was left out).
    pub statistic_at: Option<String>,
    /// The forecast's upper bound over the horizon (forecast policy).
    pub forecast_upper_bound_rps: Option<f64>,
    /// The headroom multiplied in (0.25 = +25%).
    pub headroom: Option<f64>,
    /// How `headroom: auto` chose it (the replayed origins, their surprises, the throttling
    /// at the chosen margin; `review` when it needed more than `max_headroom`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub headroom_auto: Option<rlc_plan::evidence::HeadroomAuto>,
    /// The bucket's share of the planned capacity (`rlc/capacity.yaml`).
    pub capacity_share_rps: Option<f64>,
    /// What the policy's limit was capped by (planned capacity share, ...).
    pub capped_by: Option<String>,
    /// Share of the window with samples since the series' first one.
    pub coverage: Option<f64>,
    /// Days of history behind the limit.
    pub history_days: Option<f64>,
    /// The policy's limit before a rail moved it (floor, ceiling, per-run cap, small change).
    pub capped_from_rps: Option<f64>,
    /// The limit the policy proposed (before the rails).
    pub proposed_rps: Option<f64>,
    /// What set the limit and what was discounted, in one line (the preview table's WHY).
    pub explain: Option<String>,
    /// Forecast: what set the bound (`forecast`, `grown_peak` or `recent_peak`).
    pub set_by: Option<String>,
    /// Windows left out of what the policy learnt (throttled minutes, incident overrides,
    /// `excluded:` windows).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ignored: Vec<rlc_plan::censor::Ignored>,
    /// How much demand the bucket's limit refused in the window, if it refused any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub throttled: Option<rlc_plan::censor::ThrottledEvidence>,
    /// The limit over the busiest minute of the bucket's CRITICAL_PLUS and CRITICAL demand
    /// (global buckets whose clients count tiers); below 1, critical requests would be shed
    /// at that peak.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub critical_headroom: Option<rlc_plan::evidence::CriticalHeadroom>,
}

/// One bucket: the preview JSON's bucket (every field of `rlc preview --format json`), plus
/// the change, the confidence and the rail that held or capped it.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct QuotaBucket {
    /// The bucket as `rlc preview --format json` shows it; `limit_rps` is what the next run
    /// would write.
    #[serde(flatten)]
    pub planned: PlannedBucket,
    /// Current → proposed.
    pub change: Change,
    /// 0–1 (none when the bucket keeps its quota without a computation).
    pub confidence: Option<f64>,
    /// The rail or guard that held or capped the limit, in words, if any.
    pub rail: Option<String>,
    /// `shadow → enforce` when the next run would promote this shadow bucket (its shadow
    /// figures are in `evidence.promotion`, as in `rlc preview`); null otherwise.
    pub mode_change: Option<String>,
    /// Per-bucket numbers (only in `GET /v1/quotas/{service}`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub details: Option<Details>,
    /// The bucket's newest rollout (`rollout:` in `rlc/policies.yaml`): pending, baking in
    /// which region since when with the virtual drops so far, done, aborted and why; absent
    /// when the bucket never had one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<crate::rollout::RolloutView>,
    /// The candidate limit baking beside the limit in force (`current_limit_rps`), with its
    /// stage and bake progress; absent when none bakes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub candidate: Option<crate::rollout::CandidateView>,
}

/// Each bucket's newest rollout (`rollout`) and the limit the controllers enforce: while a
/// rollout holds the spec in force before it ([`crate::rollout::enforced`]: baking, or
/// aborted while the base branch still holds the new spec), `current_limit_rps` is that
/// spec's limit (not the base branch's new one) and `change` is counted from it, and a baking
/// candidate is `candidate`.
pub fn with_rollouts(
    buckets: &mut [QuotaBucket],
    rollouts: &std::collections::BTreeMap<(String, String), crate::rollout::Rollout>,
    repo: &ConfigRepo,
) {
    let now = Utc::now();
    for b in buckets {
        let key = (b.planned.service.clone(), b.planned.bucket.name.clone());
        let Some(r) = rollouts.get(&key) else {
            continue;
        };
        b.rollout = Some(r.view(now));
        let base = repo
            .buckets
            .values()
            .find(|f| f.value.service == key.0)
            .and_then(|f| f.value.buckets.iter().find(|x| x.name == key.1));
        let e = crate::rollout::enforced(base, Some(r), now);
        if e.spec != base {
            b.planned.current_limit_rps = e.spec.map(|x| x.limit_rps);
            b.change = change_of(&b.planned);
        }
        b.candidate = e.candidate;
    }
}

fn change_of(b: &PlannedBucket) -> Change {
    let Some(cur) = b.current_limit_rps else {
        return Change {
            kind: "new",
            delta_rps: None,
            percent: None,
        };
    };
    let delta = b.bucket.limit_rps - cur;
    let kind = if b.held.is_some() {
        "held"
    } else if delta > 0.0 {
        "raised"
    } else if delta < 0.0 {
        "lowered"
    } else {
        "unchanged"
    };
    let round = |v: f64| (v * 1000.0).round() / 1000.0;
    Change {
        kind,
        delta_rps: Some(round(delta)),
        percent: (cur > 0.0).then(|| (delta / cur * 1000.0).round() / 10.0),
    }
}

/// The rail or guard that held or capped the limit: the decrease guard, a rail's note, the
/// policy's cap, or why the bucket keeps its quota.
fn rail_of(b: &PlannedBucket) -> Option<String> {
    if let Some(h) = &b.held {
        return Some(h.reason.clone());
    }
    let e = &b.evidence;
    // The note of the rail that moved the limit, else the first one (mode, shadow start).
    let limit = e.rails.iter().find(|n| n.kind().moves_limit());
    if let Some(n) = limit.or(e.rails.first()) {
        return Some(n.to_string());
    }
    let figures = e.policy.as_ref().map(|p| p.figures()).unwrap_or_default();
    if let Some(c) = figures.capped_by {
        return Some(format!("capped by the {c}"));
    }
    e.kept_current.clone()
}

fn details_of(b: &PlannedBucket) -> Details {
    let e = &b.evidence;
    let f = e.policy.as_ref().map(|p| p.figures()).unwrap_or_default();
    Details {
        peak_rps: e.peak_rps.or(f.peak_rps),
        peak_at: e.peak_at.clone().or(f.peak_at),
        statistic: f.statistic,
        statistic_rps: f.value_rps,
        statistic_at: f.value_at,
        forecast_upper_bound_rps: f.upper_bound_rps,
        headroom: f.headroom,
        headroom_auto: f.headroom_auto,
        capacity_share_rps: f.capacity_share_rps,
        capped_by: f.capped_by,
        coverage: f.coverage,
        history_days: f.history_days,
        capped_from_rps: e.capped_from,
        proposed_rps: e.proposed_rps,
        explain: e.explain.clone(),
        set_by: f.set_by.and_then(|s| s.kind),
        ignored: e.ignored.clone(),
        throttled: e.throttled.clone(),
        critical_headroom: e.critical_headroom.clone(),
    }
}

/// `b` as the quota API and `rlc preview --format json` serve it; `details`: with the
/// per-bucket numbers (`GET /v1/quotas/{service}`).
pub fn view(b: &PlannedBucket, details: bool) -> QuotaBucket {
    QuotaBucket {
        planned: b.clone(),
        change: change_of(b),
        confidence: b.evidence.confidence,
        rail: rail_of(b),
        mode_change: b
            .evidence
            .promoted()
            .then(|| rlc_plan::promotion::PROMOTED_MODE.to_string()),
        details: details.then(|| details_of(b)),
        rollout: None,
        candidate: None,
    }
}
