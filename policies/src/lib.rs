//! Quota policies: the [`Policy`] trait that built-ins and plugins implement, the built-in
//! `peak`, `forecast` and `fixed` policies, the safety [`rails`] applied after every policy, and
//! plugins: [`isolated`] runs each in a host process of its own ([`host`]), which loads it with
//! the [`loader`].
//!
//! This crate does no network or file I/O besides running plugins, and never depends on `rlc`:
//! it takes a bucket's history as a [`RateSeries`] and returns a [`Proposal`].

pub mod fixed;
pub mod forecast;
pub mod host;
pub mod isolated;
pub mod loader;
pub mod margin;
pub mod peak;
pub mod rails;
mod series;
pub mod spikes;

pub use series::RateSeries;

use chrono::{DateTime, Utc};
use schema::{Headroom, PolicyName, PolicySpec};
use serde::{Deserialize, Serialize};

/// Default headroom when the spec sets none: limit = peak × 1.25.
pub const DEFAULT_HEADROOM: f64 = 0.25;
/// Below this many days of history a bucket is "young": margin widened and kept in shadow.
pub const CONFIDENT_DAYS: f64 = 7.0;

/// Everything a policy gets for one bucket.
#[derive(Debug, Clone, Copy)]
pub struct PolicyInput<'a> {
    /// Callee service.
    pub service: &'a str,
    /// Calling service, if the bucket is per caller.
    pub caller: Option<&'a str>,
    /// Procedure, if the bucket is per procedure.
    pub procedure: Option<&'a str>,
    /// The bucket's per-step request rate over the lookback, minutes that were not demand
    /// (throttled, excluded) left out as missing.
    pub series: &'a RateSeries,
    /// How many steps of `series` were left out as not demand: observed, so they count as
    /// history (confidence, coverage), not as gaps.
    pub left_out: usize,
    /// The service's effective policy spec (parameters).
    pub spec: &'a PolicySpec,
    /// The planned capacity that bounds this bucket, already scaled by the caller's share of
    /// the procedure's traffic (`capacity.yaml`), if any.
    pub capacity_share_rps: Option<f64>,
    /// Time of the computation (end of the history).
    pub now: DateTime<Utc>,
}

/// A proposed limit and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Proposal {
    /// The proposed limit before safety rails.
    pub limit_rps: f64,
    /// Ask the rails to keep (or start) the bucket in shadow mode (e.g. too little history).
    #[serde(default)]
    pub shadow: bool,
    /// The policy that really produced the limit (e.g. `peak` when `forecast` fell back).
    pub policy: PolicyName,
    /// The observed peak over the window (what a service owner compares the limit with).
    pub peak_rps: f64,
    /// Confidence in [0, 1]: days of history ÷ the days a full confidence needs, capped.
    pub confidence: f64,
    /// Which numbers, which window, which confidence produced the limit.
    pub evidence: serde_json::Value,
}

/// Why a policy could not propose a limit for a bucket.
#[derive(Debug, Clone, thiserror::Error)]
pub enum PolicyError {
    /// The series has no sample at all.
    #[error("no samples in the history window")]
    NoData,
    /// A plugin failed (load, ABI, panic, bad output).
    #[error("plugin `{name}`: {message}")]
    Plugin {
        /// Plugin name.
        name: String,
        /// What went wrong.
        message: String,
    },
    /// The parameters do not make sense for this policy.
    #[error("invalid parameters: {0}")]
    Params(String),
}

/// A quota policy: takes a bucket's history and parameters, returns a limit with evidence.
/// Built-ins and plugins implement it; implementations must be deterministic.
pub trait Policy: Send + Sync {
    /// The name written as provenance in the bucket (`peak`, `forecast`, `plugin:x`, …).
    fn name(&self) -> PolicyName;
    /// Proposes a limit for one bucket.
    fn compute(&self, input: &PolicyInput<'_>) -> Result<Proposal, PolicyError>;
}

/// Bounds a computed limit by the spec's floor and ceiling and the caller's share of planned
/// capacity; returns the bounded limit and which bound applied (for the evidence).
pub fn bound(limit: f64, input: &PolicyInput<'_>) -> (f64, Option<&'static str>) {
    let mut limit = limit;
    let mut capped_by = None;
    if let Some(f) = input.spec.floor_rps {
        if limit < f {
            limit = f;
            capped_by = Some("floor_rps");
        }
    }
    for (cap, why) in [
        (input.spec.ceiling_rps, "ceiling_rps"),
        (input.capacity_share_rps, "planned capacity share"),
    ] {
        if let Some(c) = cap {
            if limit > c {
                limit = c;
                capped_by = Some(why);
            }
        }
    }
    (limit, capped_by)
}

/// The spike factor of a spec (an hour this many times above its usual value is a one-off
/// burst, left out), defaulting to [`spikes::DEFAULT_SPIKE_FACTOR`].
pub fn spike_factor(spec: &PolicySpec) -> f64 {
    spec.spike_factor
        .filter(|f| f.is_finite() && *f > 1.0)
        .unwrap_or(spikes::DEFAULT_SPIKE_FACTOR)
}

/// The fixed headroom of `spec`, at least 0 ([`DEFAULT_HEADROOM`] for `auto`, which the
/// policies resolve per bucket through [`margin::compute`] before they read it).
pub fn headroom(spec: &PolicySpec) -> f64 {
    spec.headroom
        .and_then(Headroom::fixed)
        .unwrap_or(DEFAULT_HEADROOM)
        .max(0.0)
}

/// The headroom a proposal was computed with (`auto` resolved: its evidence's `headroom`),
/// else the spec's.
pub fn headroom_of(p: &Proposal, spec: &PolicySpec) -> f64 {
    p.evidence["headroom"]
        .as_f64()
        .filter(|h| h.is_finite() && *h >= 0.0)
        .unwrap_or_else(|| headroom(spec))
}

/// Whether `spec` asks for `headroom: auto`.
pub fn is_auto(spec: &PolicySpec) -> bool {
    spec.headroom == Some(Headroom::Auto)
}

/// Rounds to 3 decimals for readable evidence.
pub(crate) fn round3(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}
