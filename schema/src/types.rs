//! The serde types of every user-facing file. Raw shapes only: cross-field and
//! cross-file checks live in `validate`.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use schemars::JsonSchema;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Where a limit applies: one limit for the whole fleet, per region or per zone.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    JsonSchema,
    Default,
)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// One limit for the whole fleet.
    #[default]
    Global,
    /// The limit applies in each region.
    Region,
    /// The limit applies in each zone.
    Zone,
}

impl Scope {
    /// The lowercase name used in files and labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Global => "global",
            Scope::Region => "region",
            Scope::Zone => "zone",
        }
    }
}

/// Whether drops are real or only counted.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    JsonSchema,
    Default,
)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Deny the requests over the limit.
    #[default]
    Enforce,
    /// Admit everything but count the drops that would have happened.
    Shadow,
}

impl Mode {
    /// The lowercase name used in files and labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Enforce => "enforce",
            Mode::Shadow => "shadow",
        }
    }
}

/// A policy name: `peak | forecast | fixed | plugin:<name>`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PolicyName {
    /// Historical peak plus headroom.
    Peak,
    /// Seasonal forecast with trend, capped by planned capacity.
    Forecast,
    /// Fixed contractual quota.
    Fixed,
    /// A dynamically loaded plugin.
    Plugin(String),
    /// A limit set by hand or by an incident override (provenance only).
    Manual,
}

impl fmt::Display for PolicyName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PolicyName::Peak => f.write_str("peak"),
            PolicyName::Forecast => f.write_str("forecast"),
            PolicyName::Fixed => f.write_str("fixed"),
            PolicyName::Manual => f.write_str("manual"),
            PolicyName::Plugin(n) => write!(f, "plugin:{n}"),
        }
    }
}

/// Why a string is not a [`PolicyName`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyNameError {
    /// `plugin:` with an empty name or other characters than letters, digits, - or _.
    #[error("invalid plugin name in `{0}`: expected plugin:<name> with letters, digits, - or _")]
    Plugin(String),
    /// None of the known policies.
    #[error("unknown policy `{0}`, expected one of peak, forecast, fixed, plugin:<name>")]
    Unknown(String),
}

impl FromStr for PolicyName {
    type Err = PolicyNameError;
    fn from_str(s: &str) -> Result<Self, PolicyNameError> {
        match s {
            "peak" => Ok(PolicyName::Peak),
            "forecast" => Ok(PolicyName::Forecast),
            "fixed" => Ok(PolicyName::Fixed),
            "manual" => Ok(PolicyName::Manual),
            _ => match s.strip_prefix("plugin:") {
                Some(n)
                    if !n.is_empty()
                        && n.chars()
                            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') =>
                {
                    Ok(PolicyName::Plugin(n.to_string()))
                }
                Some(_) => Err(PolicyNameError::Plugin(s.into())),
                None => Err(PolicyNameError::Unknown(s.into())),
            },
        }
    }
}

impl Serialize for PolicyName {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for PolicyName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_str(ParseVisitor::<PolicyName>::new("a policy name"))
    }
}

/// Parses a string inside the deserialiser (not after it), so that serde_yaml attaches the
/// scalar's own path and position to the error.
struct ParseVisitor<T>(&'static str, std::marker::PhantomData<T>);

impl<T> ParseVisitor<T> {
    fn new(what: &'static str) -> Self {
        Self(what, std::marker::PhantomData)
    }
}

impl<T: FromStr<Err: fmt::Display>> serde::de::Visitor<'_> for ParseVisitor<T> {
    type Value = T;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<T, E> {
        v.parse().map_err(E::custom)
    }
}

impl JsonSchema for PolicyName {
    fn schema_name() -> String {
        "PolicyName".into()
    }
    fn json_schema(_: &mut schemars::gen::SchemaGenerator) -> schemars::schema::Schema {
        let mut s = schemars::schema::SchemaObject {
            instance_type: Some(schemars::schema::InstanceType::String.into()),
            ..Default::default()
        };
        s.string().pattern = Some("^(peak|forecast|fixed|manual|plugin:[A-Za-z0-9_-]+)$".into());
        s.into()
    }
}

/// A duration written as a number and a unit: `30s`, `1m`, `1h`, `7d`, `2w`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HumanDuration(pub Duration);

impl HumanDuration {
    /// The duration in seconds.
    pub fn as_secs(self) -> u64 {
        self.0.as_secs()
    }
}

/// Why a string is not a [`HumanDuration`]; each names the text (trimmed).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HumanDurationError {
    /// Empty, or a part without its number.
    #[error("invalid duration `{0}`: expected e.g. 30s, 1m, 1h, 7d, 2w")]
    NoNumber(String),
    /// A unit other than s, m, h, d or w.
    #[error("invalid duration unit in `{0}`: expected s, m, h, d or w")]
    Unit(String),
    /// Longer than `u64` milliseconds.
    #[error("duration `{0}` is too long")]
    TooLong(String),
    /// Zero.
    #[error("duration `{0}` must be positive")]
    NotPositive(String),
}

impl FromStr for HumanDuration {
    type Err = HumanDurationError;
    fn from_str(s: &str) -> Result<Self, HumanDurationError> {
        let s = s.trim();
        let ms =
            crate::duration::parse_ms(s, crate::duration::HUMAN_UNITS).map_err(|e| match e {
                crate::duration::DurationError::NoNumber => HumanDurationError::NoNumber(s.into()),
                crate::duration::DurationError::Unit => HumanDurationError::Unit(s.into()),
                crate::duration::DurationError::TooLong => HumanDurationError::TooLong(s.into()),
            })?;
        if ms == 0 {
            return Err(HumanDurationError::NotPositive(s.into()));
        }
        Ok(HumanDuration(Duration::from_millis(ms)))
    }
}

impl fmt::Display for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.0.as_secs();
        for (unit, len) in [("d", 86_400), ("h", 3600), ("m", 60)] {
            if s.is_multiple_of(len) && s >= len {
                return write!(f, "{}{unit}", s / len);
            }
        }
        write!(f, "{s}s")
    }
}

impl Serialize for HumanDuration {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_str(ParseVisitor::<HumanDuration>::new(
            "a duration such as 30s, 1m, 7d",
        ))
    }
}

impl JsonSchema for HumanDuration {
    fn schema_name() -> String {
        "HumanDuration".into()
    }
    fn json_schema(_: &mut schemars::gen::SchemaGenerator) -> schemars::schema::Schema {
        let mut s = schemars::schema::SchemaObject {
            instance_type: Some(schemars::schema::InstanceType::String.into()),
            ..Default::default()
        };
        s.string().pattern = Some("^[0-9]+[smhdw]$".into());
        s.into()
    }
}

// ---------------------------------------------------------------------------------------------
// buckets/<service>.yaml

/// `buckets/<service>.yaml`: generated by RLC, consumed by the GRL controller.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BucketFile {
    /// The callee service; must equal the file's name.
    pub service: String,
    /// The buckets of this service.
    #[serde(default)]
    pub buckets: Vec<Bucket>,
}

/// One quota within a callee service.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Bucket {
    /// Unique within the service.
    pub name: String,
    /// Calling service; absent = any caller.
    #[serde(default)]
    pub caller: Option<String>,
    /// Procedure of the callee; absent = any procedure.
    #[serde(default)]
    pub procedure: Option<String>,
    /// Where the limit applies.
    #[serde(default)]
    pub scope: Scope,
    /// Requests per second allowed.
    pub limit_rps: f64,
    /// Enforce or shadow.
    #[serde(default)]
    pub mode: Mode,
    /// Provenance: which policy produced this limit.
    #[serde(default = "default_policy")]
    pub policy: PolicyName,
}

fn default_policy() -> PolicyName {
    PolicyName::Manual
}

// ---------------------------------------------------------------------------------------------
// rlc/policies.yaml

/// A window of one service's traffic (or of one caller or procedure of it) that is not
/// demand.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Exclusion {
    /// Callee service.
    pub service: String,
    /// Only this caller's traffic (default: every caller).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub caller: Option<String>,
    /// Only this procedure's traffic (default: every procedure).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub procedure: Option<String>,
    /// Start (RFC 3339, e.g. `2026-11-20T10:00:00Z`).
    pub from: chrono::DateTime<chrono::Utc>,
    /// End, after `from`.
    pub to: chrono::DateTime<chrono::Utc>,
    /// Why (an incident reference, what happened): shown wherever the window is.
    pub reason: String,
}

impl Exclusion {
    /// Whether it covers the series of `service` with `caller` and `procedure`.
    pub fn covers(&self, service: &str, caller: Option<&str>, procedure: Option<&str>) -> bool {
        self.service == service
            && self.caller.as_deref().is_none_or(|c| Some(c) == caller)
            && self
                .procedure
                .as_deref()
                .is_none_or(|p| Some(p) == procedure)
    }
}

/// `rlc/policies.yaml`: which policy each service uses.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PoliciesFile {
    /// The policy of every service not listed under `services`.
    pub default: PolicySpec,
    /// Per-service overrides; unset keys inherit from `default`.
    #[serde(default)]
    pub services: BTreeMap<String, PolicySpec>,
    /// When shadow buckets are promoted to `mode: enforce` on their own, and which kinds of
    /// change may be committed without review. Absent: no automatic promotion, and direct
    /// mode commits every change but a `throttled_raise` (which goes to review).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub promotion: Option<PromotionSection>,
    /// Windows whose traffic is not demand (an incident, a load test, a retry storm seen
    /// after the fact): left out of every computation, like throttled minutes, and named in
    /// the evidence.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub excluded: Vec<Exclusion>,
    /// How a change that could refuse more traffic (a lower limit, `shadow -> enforce`, a
    /// narrower scope, a new enforcing bucket) reaches the controllers: first as a candidate
    /// in shadow beside the limit in force, region by region, promoted after its bake or
    /// aborted. Absent: every change is enforced at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<RolloutSection>,
}

/// The `rollout:` section of `rlc/policies.yaml`: the settings of every service (the keys at
/// its top) and per-service overrides under `services`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RolloutSection {
    /// See [`RolloutSpec::enabled`] (every service).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// See [`RolloutSpec::bake`] (every service).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bake: Option<HumanDuration>,
    /// See [`RolloutSpec::max_virtual_drop_share`] (every service).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_virtual_drop_share: Option<f64>,
    /// See [`RolloutSpec::min_offered`] (every service).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_offered: Option<f64>,
    /// See [`RolloutSpec::max_bake`] (every service).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_bake: Option<HumanDuration>,
    /// See [`RolloutSpec::stages`] (every service).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stages: Option<Vec<Vec<String>>>,
    /// Per-service overrides; unset keys inherit from the section's top.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub services: BTreeMap<String, RolloutSpec>,
}

impl RolloutSection {
    /// The keys at the section's top, the settings of every service.
    pub fn default_spec(&self) -> RolloutSpec {
        RolloutSpec {
            enabled: self.enabled,
            bake: self.bake,
            max_virtual_drop_share: self.max_virtual_drop_share,
            min_offered: self.min_offered,
            max_bake: self.max_bake,
            stages: self.stages.clone(),
        }
    }
}

/// Rollout settings. Every key is optional; unset keys take the defaults documented on
/// [`RolloutSpec::resolved`].
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RolloutSpec {
    /// Roll changes out as candidates (default true; `false` turns it off for a service).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// How long a candidate is watched in a stage before it is promoted (default `1h`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bake: Option<HumanDuration>,
    /// The most the candidate may refuse: its virtual drops over its offered requests
    /// (0..=1, default 0.0001).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_virtual_drop_share: Option<f64>,
    /// Offered requests a stage must see before it is judged (default 1000): a candidate
    /// that saw fewer waits, up to `max_bake`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_offered: Option<f64>,
    /// The longest a stage lasts, from when it began (default `24h`, never shorter than
    /// `bake`): a candidate still short of `min_offered`, or of every controller's counts,
    /// is then aborted, and so is one that never reached the stage's controllers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_bake: Option<HumanDuration>,
    /// Regions rolled out in order, each list a stage (`[[eu-west], ["*"]]`); `*` is every
    /// region not named in an earlier stage (default one stage, `[["*"]]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stages: Option<Vec<Vec<String>>>,
}

/// A [`RolloutSpec`] with every default filled in.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RolloutSettings {
    /// See [`RolloutSpec::enabled`].
    pub enabled: bool,
    /// See [`RolloutSpec::bake`].
    pub bake: Duration,
    /// See [`RolloutSpec::max_virtual_drop_share`].
    pub max_virtual_drop_share: f64,
    /// See [`RolloutSpec::min_offered`].
    pub min_offered: f64,
    /// See [`RolloutSpec::max_bake`].
    pub max_bake: Duration,
    /// See [`RolloutSpec::stages`].
    pub stages: Vec<Vec<String>>,
}

impl RolloutSpec {
    /// `self` with unset keys taken from `base`.
    pub fn merged_over(&self, base: &RolloutSpec) -> RolloutSpec {
        RolloutSpec {
            enabled: self.enabled.or(base.enabled),
            bake: self.bake.or(base.bake),
            max_virtual_drop_share: self.max_virtual_drop_share.or(base.max_virtual_drop_share),
            min_offered: self.min_offered.or(base.min_offered),
            max_bake: self.max_bake.or(base.max_bake),
            stages: self.stages.clone().or_else(|| base.stages.clone()),
        }
    }

    /// Every key with its default: enabled, `1h`, 0.0001, 1000 requests, `24h`, `[["*"]]`.
    pub fn resolved(&self) -> RolloutSettings {
        RolloutSettings {
            enabled: self.enabled.unwrap_or(true),
            bake: self.bake.map(|d| d.0).unwrap_or(Duration::from_secs(3600)),
            max_virtual_drop_share: self.max_virtual_drop_share.unwrap_or(1e-4),
            min_offered: self.min_offered.unwrap_or(1000.0),
            max_bake: self
                .max_bake
                .map(|d| d.0)
                .unwrap_or(Duration::from_secs(24 * 3600)),
            stages: self
                .stages
                .clone()
                .unwrap_or_else(|| vec![vec!["*".to_string()]]),
        }
    }
}

impl RolloutSettings {
    /// The stage (index into `stages`) of `region`: the first stage naming it, else the first
    /// with `*`; `None` when no stage covers it (it is then never given the change, and
    /// keeps the limit in force until the rollout is done).
    pub fn stage_of(&self, region: &str) -> Option<usize> {
        self.stages
            .iter()
            .position(|s| s.iter().any(|r| r == region))
            .or_else(|| self.stages.iter().position(|s| s.iter().any(|r| r == "*")))
    }
}

impl DaemonConfig {
    /// Every controller rlc pushes to with its region: `controller:` (region `default`
    /// unless it names one) and those of `controllers:`.
    pub fn region_controllers(&self) -> Vec<(String, ControllerConfig)> {
        self.controller
            .iter()
            .chain(self.controllers.iter())
            .map(|c| {
                (
                    c.region.clone().unwrap_or_else(|| "default".to_string()),
                    c.clone(),
                )
            })
            .collect()
    }
}

impl PoliciesFile {
    /// The rollout settings of `service`; `None` without a `rollout:` section or when it is
    /// disabled for the service (every change enforced at once).
    pub fn rollout_for(&self, service: &str) -> Option<RolloutSettings> {
        let r = self.rollout.as_ref()?;
        let top = r.default_spec();
        let s = match r.services.get(service) {
            Some(s) => s.merged_over(&top).resolved(),
            None => top.resolved(),
        };
        s.enabled.then_some(s)
    }
}

/// The `promotion:` section of `rlc/policies.yaml`: a default and per-service overrides.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PromotionSection {
    /// The rule of every service not listed under `services`.
    #[serde(default)]
    pub default: PromotionSpec,
    /// Per-service overrides; unset keys inherit from `default`.
    #[serde(default)]
    pub services: BTreeMap<String, PromotionSpec>,
}

/// The promotion rule of a service. Every key is optional; unset keys take the defaults
/// documented on [`PromotionSpec::resolved`].
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PromotionSpec {
    /// Propose `mode: enforce` for shadow buckets that meet the rule (default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// Minimum days a bucket has been in shadow without interruption (default 7).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_days_in_shadow: Option<f64>,
    /// Maximum share (0..=1) of the offered requests the bucket would have dropped over the
    /// window (default 0.0001, i.e. 0.01 %).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_virtual_drop_share: Option<f64>,
    /// Minimum share (0..=1) of the window's minutes with a shadow report (default 0.9).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_coverage: Option<f64>,
    /// Reports older than this make the data stale: never promoted (default 15m).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_report_age: Option<HumanDuration>,
    /// Kinds of change direct mode commits on the base branch; every other kind goes to the
    /// pull-request branch for review (default `[raise, new_shadow, other]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auto_merge: Option<Vec<ChangeClass>>,
}

/// A kind of bucket change, by risk, for `promotion.auto_merge`.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum ChangeClass {
    /// A higher limit for an enforced bucket that was throttled in the window: demand its
    /// limit refused, which may be growth or a storm.
    ThrottledRaise,
    /// A new bucket that enforces at once.
    NewEnforcing,
    /// A shadow bucket switched to `mode: enforce`.
    Promotion,
    /// A lower limit.
    Decrease,
    /// Mode (other than a promotion), scope or caller/procedure match changed.
    ModeOrScopeChange,
    /// A bucket removed.
    Removal,
    /// A higher limit.
    Raise,
    /// A new bucket in shadow mode (drops nothing).
    NewShadow,
    /// Only the provenance (`policy`) changed.
    Other,
}

impl ChangeClass {
    /// Every class, riskiest first (the order of a pull request's body).
    pub const ALL: [ChangeClass; 9] = [
        ChangeClass::ThrottledRaise,
        ChangeClass::NewEnforcing,
        ChangeClass::Promotion,
        ChangeClass::Decrease,
        ChangeClass::ModeOrScopeChange,
        ChangeClass::Removal,
        ChangeClass::Raise,
        ChangeClass::NewShadow,
        ChangeClass::Other,
    ];

    /// The word used in `auto_merge`.
    pub fn as_str(self) -> &'static str {
        match self {
            ChangeClass::ThrottledRaise => "throttled_raise",
            ChangeClass::NewEnforcing => "new_enforcing",
            ChangeClass::Promotion => "promotion",
            ChangeClass::Decrease => "decrease",
            ChangeClass::ModeOrScopeChange => "mode_or_scope_change",
            ChangeClass::Removal => "removal",
            ChangeClass::Raise => "raise",
            ChangeClass::NewShadow => "new_shadow",
            ChangeClass::Other => "other",
        }
    }

    /// Whether a reviewer should look at it first: it can start dropping traffic or change
    /// what a limit counts.
    pub fn is_risky(self) -> bool {
        !matches!(
            self,
            ChangeClass::Raise | ChangeClass::NewShadow | ChangeClass::Other
        )
    }
}

/// A [`PromotionSpec`] with every default filled in.
#[derive(Debug, Clone, PartialEq)]
pub struct PromotionRule {
    /// See [`PromotionSpec::enabled`].
    pub enabled: bool,
    /// See [`PromotionSpec::min_days_in_shadow`].
    pub min_days_in_shadow: f64,
    /// See [`PromotionSpec::max_virtual_drop_share`].
    pub max_virtual_drop_share: f64,
    /// See [`PromotionSpec::min_coverage`].
    pub min_coverage: f64,
    /// See [`PromotionSpec::max_report_age`].
    pub max_report_age: Duration,
    /// See [`PromotionSpec::auto_merge`].
    pub auto_merge: Vec<ChangeClass>,
}

impl PromotionSpec {
    /// `self` with unset keys taken from `base`.
    pub fn merged_over(&self, base: &PromotionSpec) -> PromotionSpec {
        PromotionSpec {
            enabled: self.enabled.or(base.enabled),
            min_days_in_shadow: self.min_days_in_shadow.or(base.min_days_in_shadow),
            max_virtual_drop_share: self.max_virtual_drop_share.or(base.max_virtual_drop_share),
            min_coverage: self.min_coverage.or(base.min_coverage),
            max_report_age: self.max_report_age.or(base.max_report_age),
            auto_merge: self.auto_merge.clone().or_else(|| base.auto_merge.clone()),
        }
    }

    /// Every key with its default: enabled, 7 days, 0.0001, 0.9, 15m,
    /// `[raise, new_shadow, other]`.
    pub fn resolved(&self) -> PromotionRule {
        PromotionRule {
            enabled: self.enabled.unwrap_or(true),
            min_days_in_shadow: self.min_days_in_shadow.unwrap_or(7.0),
            max_virtual_drop_share: self.max_virtual_drop_share.unwrap_or(1e-4),
            min_coverage: self.min_coverage.unwrap_or(0.9),
            max_report_age: self
                .max_report_age
                .map(|d| d.0)
                .unwrap_or(Duration::from_secs(15 * 60)),
            auto_merge: self.auto_merge.clone().unwrap_or_else(|| {
                vec![
                    ChangeClass::Raise,
                    ChangeClass::NewShadow,
                    ChangeClass::Other,
                ]
            }),
        }
    }
}

impl PoliciesFile {
    /// The promotion rule of `service`; `None` without a `promotion:` section (no automatic
    /// promotion, every change may be committed directly).
    pub fn promotion_for(&self, service: &str) -> Option<PromotionRule> {
        let p = self.promotion.as_ref()?;
        Some(match p.services.get(service) {
            Some(s) => s.merged_over(&p.default).resolved(),
            None => p.default.resolved(),
        })
    }
}

/// A policy with its parameters. Every key is optional in a service entry.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PolicySpec {
    /// `peak | forecast | fixed | plugin:<name>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<PolicyName>,
    /// limit = peak × (1 + headroom).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub headroom: Option<f64>,
    /// Forecast horizon (forecast policy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub horizon: Option<HumanDuration>,
    /// Use this percentile (0–100) of the per-minute rate instead of the max.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub percentile: Option<f64>,
    /// Never propose less than this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub floor_rps: Option<f64>,
    /// Never propose more than this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ceiling_rps: Option<f64>,
    /// Scope of the generated buckets (default: a bucket keeps its current scope; new ones
    /// are global).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scope: Option<Scope>,
    /// Mode of the service's buckets: `enforce` promotes shadow buckets (new buckets start in
    /// shadow), `shadow` demotes them all. Absent: new buckets start in shadow, existing ones
    /// keep their mode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<Mode>,
    /// How much history makes a bucket's quota fully confident (`peak`; 7d default). Under
    /// it the bucket is young: the margin is widened by `1 + u / history` with
    /// `u = confident_history / 7` (the VPA's `1 + 1/days` at the default) and the bucket
    /// asks for shadow mode. Shorten it together with `history.lookback` when the history is
    /// minutes long (a trial, a test).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub confident_history: Option<HumanDuration>,
    /// Free-form parameters handed to a plugin as JSON.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub params: Option<serde_json::Value>,
    /// Time zone of the service's daily and weekly cycle (forecast policy), an IANA name such
    /// as `Europe/Berlin`; default `UTC`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timezone: Option<String>,
    /// Forecast policy: how long a lower level at the end of the history must last before it
    /// is the new normal (default `10d`); a shorter dip is discounted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub new_normal_after: Option<HumanDuration>,
    /// An hour of traffic this many times above both the same hour of the other weeks and
    /// the hours around it is a one-off burst (a retry storm): left out of the peak and the
    /// forecast, and named in the evidence (default 3; a recurring batch is never one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spike_factor: Option<f64>,
    /// Throttling (real drops of an enforced bucket) on at least this many days of the window
    /// (or in at least half its minutes) is demand that outgrew the limit: those minutes count and the bucket is raised (a
    /// `throttled_raise`, which direct mode commits only when `promotion.auto_merge` lists
    /// it); throttling on fewer days (an overload, a storm) is refused demand, left out
    /// (default 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sustained_throttling_days: Option<u32>,
}

impl PolicySpec {
    /// `self` with unset keys taken from `base`.
    pub fn merged_over(&self, base: &PolicySpec) -> PolicySpec {
        PolicySpec {
            policy: self.policy.clone().or_else(|| base.policy.clone()),
            headroom: self.headroom.or(base.headroom),
            horizon: self.horizon.or(base.horizon),
            percentile: self.percentile.or(base.percentile),
            floor_rps: self.floor_rps.or(base.floor_rps),
            ceiling_rps: self.ceiling_rps.or(base.ceiling_rps),
            scope: self.scope.or(base.scope),
            mode: self.mode.or(base.mode),
            confident_history: self.confident_history.or(base.confident_history),
            params: self.params.clone().or_else(|| base.params.clone()),
            timezone: self.timezone.clone().or_else(|| base.timezone.clone()),
            new_normal_after: self.new_normal_after.or(base.new_normal_after),
            spike_factor: self.spike_factor.or(base.spike_factor),
            sustained_throttling_days: self
                .sustained_throttling_days
                .or(base.sustained_throttling_days),
        }
    }
}

impl PoliciesFile {
    /// The effective policy of `service`.
    pub fn for_service(&self, service: &str) -> PolicySpec {
        match self.services.get(service) {
            Some(s) => s.merged_over(&self.default),
            None => self.default.clone(),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// rlc/contracts.yaml

/// `rlc/contracts.yaml`: fixed contractual quotas.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ContractsFile {
    /// The contracts.
    #[serde(default)]
    pub contracts: Vec<Contract>,
}

/// A contractual quota for a caller (and optionally one procedure) of a service.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Contract {
    /// Callee service.
    pub service: String,
    /// Calling service.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub caller: Option<String>,
    /// Procedure; whole service when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub procedure: Option<String>,
    /// The contractual limit.
    pub limit_rps: f64,
    /// Last day the contract applies (inclusive).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires: Option<chrono::NaiveDate>,
    /// Reference of the agreement (e.g. MSA-2291).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reference: Option<String>,
}

impl Contract {
    /// Whether the contract still applies on `today`.
    pub fn active_on(&self, today: chrono::NaiveDate) -> bool {
        self.expires.is_none_or(|e| today <= e)
    }
}

// ---------------------------------------------------------------------------------------------
// rlc/capacity.yaml

/// `rlc/capacity.yaml`: planned capacity per service or procedure.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CapacityFile {
    /// The planned capacities.
    #[serde(default)]
    pub capacity: Vec<CapacityEntry>,
    /// Planned events (a launch, a sale, a migration onto the service): quotas computed for a
    /// horizon that contains one are raised for it, and fall back once it is over.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub events: Vec<PlannedEvent>,
}

/// A dated event that raises the traffic of a service, or of one caller or procedure of it.
/// Exactly one of `factor` and `rps`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PlannedEvent {
    /// What it is (shown in the evidence).
    pub name: String,
    /// Callee service.
    pub service: String,
    /// Only this caller's buckets; every caller when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub caller: Option<String>,
    /// Only this procedure's buckets; every procedure when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub procedure: Option<String>,
    /// First day (UTC).
    pub from: chrono::NaiveDate,
    /// Last day (UTC, inclusive).
    pub until: chrono::NaiveDate,
    /// The traffic during the event is this × the usual (≥ 1): the limit is multiplied by it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub factor: Option<f64>,
    /// The expected rate of the matching traffic during the event; split between the matching
    /// buckets by their share of the observed peak, × (1 + headroom).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rps: Option<f64>,
}

impl PlannedEvent {
    /// Whether the event concerns the bucket `caller`/`procedure` of `service`.
    pub fn matches(&self, service: &str, caller: Option<&str>, procedure: Option<&str>) -> bool {
        self.service == service
            && self.caller.as_deref().is_none_or(|c| caller == Some(c))
            && self
                .procedure
                .as_deref()
                .is_none_or(|p| procedure == Some(p))
    }

    /// Unix times `[start, end)` of the event.
    pub fn window(&self) -> (i64, i64) {
        let t = |d: chrono::NaiveDate| d.and_time(chrono::NaiveTime::MIN).and_utc().timestamp();
        (t(self.from), t(self.until) + 86_400)
    }

    /// Whether `[from, to)` (unix times) meets the event.
    pub fn overlaps(&self, from: i64, to: i64) -> bool {
        let (a, b) = self.window();
        a < to && from < b
    }
}

/// Planned capacity of a service, or of one of its procedures.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CapacityEntry {
    /// Callee service.
    pub service: String,
    /// Procedure; whole service when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub procedure: Option<String>,
    /// Requests per second the service (or procedure) is provisioned for.
    pub rps: f64,
}

impl CapacityFile {
    /// The capacity that bounds `procedure` of `service`: the procedure's own entry, else the
    /// whole service's.
    pub fn for_bucket(&self, service: &str, procedure: Option<&str>) -> Option<f64> {
        let exact = procedure.and_then(|p| {
            self.capacity
                .iter()
                .find(|c| c.service == service && c.procedure.as_deref() == Some(p))
        });
        exact
            .or_else(|| {
                self.capacity
                    .iter()
                    .find(|c| c.service == service && c.procedure.is_none())
            })
            .map(|c| c.rps)
    }
}

// ---------------------------------------------------------------------------------------------
// rlc.yaml (daemon config)

/// `rlc.yaml`: the daemon's deployment-side configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DaemonConfig {
    /// Where RPS history comes from.
    pub history: HistoryConfig,
    /// The git config repository.
    pub config_repo: ConfigRepoConfig,
    /// The GRL controller to push to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub controller: Option<ControllerConfig>,
    /// Several GRL controllers, one per region (each with `region:`), instead of
    /// `controller:`: every one gets the base branch's config, and `rollout.stages` of
    /// `rlc/policies.yaml` names their regions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub controllers: Vec<ControllerConfig>,
    /// `sqlite://rlc.db` or `postgres://…`.
    #[serde(default = "default_database_url")]
    pub database_url: String,
    /// Cron expression (5 fields, UTC) for scheduled runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule: Option<String>,
    /// Safety rails applied after every policy.
    #[serde(default)]
    pub rails: RailsConfig,
    /// Plugin loading.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plugins: Option<PluginsConfig>,
    /// The daemon's HTTP API (`rlc serve`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server: Option<ServerConfig>,
    /// How long the store keeps shadow reports (`rlc serve` applies it periodically), and how
    /// long `rlc serve` waits for the store.
    #[serde(default)]
    pub store: StoreConfig,
}

/// Retention of the controller reports in the store, and how long `rlc serve` waits for it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StoreConfig {
    /// Reports kept at full resolution (one row per controller tick and scope key); 48h default.
    #[serde(default = "default_shadow_raw_retention")]
    pub shadow_raw_retention: HumanDuration,
    /// Per-minute roll-ups (per service, bucket and scope key) that the dashboard and the
    /// readiness figures read; 35d default. Must not be shorter than `shadow_raw_retention`.
    #[serde(default = "default_shadow_rollup_retention")]
    pub shadow_rollup_retention: HumanDuration,
    /// Finished rollouts (done, superseded, and aborted ones the base branch no longer holds)
    /// are kept this long after their last change, with their candidate counts, then deleted;
    /// an aborted change deleted so is no longer held back from proposals (it would be tried
    /// as a candidate again). Open rollouts are never deleted; 90d default.
    #[serde(default = "default_rollout_retention")]
    pub rollout_retention: HumanDuration,
    /// Longest wait for one store query of a dashboard request (`GET /`, `/buckets/...`,
    /// `/v1/shadow...`, `/v1/runs`): a part not loaded in time is named on the page (HTTP
    /// 503) instead of the page hanging on a store that is down or slow; 5s default.
    #[serde(default = "default_store_query_timeout")]
    pub query_timeout: HumanDuration,
    /// Longest wait for one store write of the report poll (a batch of up to 20,000
    /// reports, an hourly roll-up pass, a retention pass): the reports stay buffered and are
    /// written at a later poll; 30s default.
    #[serde(default = "default_store_write_timeout")]
    pub write_timeout: HumanDuration,
    /// Directory where a run writes its record before the store (relative to rlc.yaml's
    /// directory): a record the store could not take (down, locked, full), or of a run killed
    /// between its git write and its record, stays there and is written to the store at the
    /// next run or poll; `rlc-journal` by default.
    #[serde(default = "default_journal_dir")]
    pub journal_dir: String,
}

fn default_journal_dir() -> String {
    "rlc-journal".into()
}

impl Default for StoreConfig {
    fn default() -> StoreConfig {
        StoreConfig {
            shadow_raw_retention: default_shadow_raw_retention(),
            shadow_rollup_retention: default_shadow_rollup_retention(),
            rollout_retention: default_rollout_retention(),
            query_timeout: default_store_query_timeout(),
            write_timeout: default_store_write_timeout(),
            journal_dir: default_journal_dir(),
        }
    }
}

fn default_shadow_raw_retention() -> HumanDuration {
    HumanDuration(Duration::from_secs(48 * 3600))
}
fn default_shadow_rollup_retention() -> HumanDuration {
    HumanDuration(Duration::from_secs(35 * 86_400))
}
fn default_rollout_retention() -> HumanDuration {
    HumanDuration(Duration::from_secs(90 * 86_400))
}
fn default_store_query_timeout() -> HumanDuration {
    HumanDuration(Duration::from_secs(5))
}
fn default_store_write_timeout() -> HumanDuration {
    HumanDuration(Duration::from_secs(30))
}

fn default_database_url() -> String {
    "sqlite://rlc.db".into()
}

/// History source: a Prometheus-compatible API or a file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct HistoryConfig {
    /// A Prometheus-compatible HTTP API.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prometheus: Option<PrometheusConfig>,
    /// A saved `query_range` JSON response or a CSV file (`ts,service,caller,procedure,rps`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<String>,
    /// How far back to look (28d default).
    #[serde(default = "default_lookback")]
    pub lookback: HumanDuration,
    /// Resolution of the rate (1m default).
    #[serde(default = "default_step")]
    pub step: HumanDuration,
    /// Below this fraction of expected samples a service keeps its current quotas.
    #[serde(default = "default_min_coverage")]
    pub min_coverage: f64,
    /// `rlc serve` keeps the pulled history and pulls only the minutes since its last pull
    /// (plus a 10-minute overlap for late samples); it pulls the whole lookback again at most
    /// this long after the last full pull (1d default), and always after a start or a change
    /// of the history settings.
    #[serde(default = "default_full_pull_every")]
    pub full_pull_every: HumanDuration,
}

fn default_lookback() -> HumanDuration {
    HumanDuration(Duration::from_secs(28 * 86_400))
}
fn default_step() -> HumanDuration {
    HumanDuration(Duration::from_secs(60))
}
fn default_min_coverage() -> f64 {
    0.5
}
fn default_full_pull_every() -> HumanDuration {
    HumanDuration(Duration::from_secs(86_400))
}

/// Prometheus query settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PrometheusConfig {
    /// Base URL, e.g. `http://127.0.0.1:9090`.
    pub url: String,
    /// PromQL giving one RPS series per (service, caller, procedure). Default: GRL's own
    /// counts of every request, `sum by (service, caller, procedure)
    /// (rate(grl_calls_total[1m]))`; a mesh's metrics work too (with `labels`), e.g.
    /// `sum by (destination_service_name, source_workload, request_operation)
    /// (rate(istio_requests_total[1m]))`.
    #[serde(default = "default_query")]
    pub query: String,
    /// Label names in the result.
    #[serde(default)]
    pub labels: LabelNames,
    /// Maximum points per series in one request (11,000 for Prometheus).
    #[serde(default = "default_max_points")]
    pub max_points: u32,
    /// Concurrent requests at most.
    #[serde(default = "default_concurrency")]
    pub concurrency: u32,
    /// Per-request timeout. Over remote read, whose answer grows with the fleet, it is the
    /// longest wait for the next byte; `max_request_duration` bounds the request in all.
    #[serde(default = "default_timeout")]
    pub timeout: HumanDuration,
    /// How long one remote-read request may take in all, its streamed answer included: a
    /// server that keeps sending a few bytes at a time is cut there (and the request
    /// retried, up to `retries` attempts), so that a pull always ends.
    #[serde(default = "default_max_request_duration")]
    pub max_request_duration: HumanDuration,
    /// Attempts per request (with jittered backoff).
    #[serde(default = "default_retries")]
    pub retries: u32,
    /// Let Prometheus reduce the series server-side: `max_over_time((query)[D:step])` at step
    /// `D` keeps the per-step peak in lookback ÷ D points (e.g. `1h`: 672 points for 28 days).
    /// Much less data to move for large fleets; percentiles and backtests then work on these
    /// per-D maxima.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub downsample: Option<HumanDuration>,
    /// Directory for the temporary file that `rlc run` and `rlc preview` write the pulled
    /// series to as they stream in, so that the plan is computed one service at a time instead
    /// of holding the fleet's series in memory (lookback ÷ step × 4 bytes per series, e.g.
    /// 1.6 GB for 10,000 series × 28 days at 1 m). Relative to rlc.yaml's directory; the
    /// system's temporary directory (`$TMPDIR`) by default. The file is removed after the
    /// plan.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spill_dir: Option<String>,
    /// Which API the series are read with. `auto` (default): Prometheus' remote-read API
    /// (`/api/v1/read`, raw samples as compressed chunks: several times fewer bytes and far
    /// less decoding than JSON) when `query` is a plain selector (a metric name with optional
    /// label matchers, e.g. a recording rule's series) and `downsample` is not set, else
    /// `query_range`; a server without remote read (VictoriaMetrics), or whose lookback delta,
    /// version or external labels cannot be read, gets `query_range`. `query_range` and
    /// `remote_read` force one API.
    #[serde(default)]
    pub api: HistoryApi,
    /// Bytes one answer may carry at most (after the HTTP headers; error answers are cut at
    /// 64 KiB anyway). An answer that sends more fails the pull at once, not retried. The
    /// default, 2 GiB, is about 9 times a `query_range` answer of 10,000 series × 720 points
    /// (about 33 bytes a point: 240 MB) and above the largest answer Prometheus gives with its
    /// default `--query.max-samples` (50 million points: 1.65 GB).
    #[serde(default = "default_max_response_bytes")]
    pub max_response_bytes: u64,
    /// Bytes a whole pull may read at most, every answer and retry counted. The default,
    /// 32 GiB, is about 2.4 times a per-minute `query_range` pull of 10,000 series × 28 days
    /// (403 million points at about 33 bytes: 13.3 GB; remote read moves about a fifth of it).
    #[serde(default = "default_max_pull_bytes")]
    pub max_pull_bytes: u64,
    /// Distinct series a pull may hold at most (series rejected for their labels included):
    /// each one costs memory for its labels and index (and, in `rlc serve`, its grid:
    /// lookback ÷ step × 4 bytes). A pull with more fails at once.
    #[serde(default = "default_max_series")]
    pub max_series: u64,
}

/// How `history.prometheus` reads the series.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum HistoryApi {
    /// Remote read when the query is a plain selector and the server supports it, else
    /// `query_range`.
    #[default]
    Auto,
    /// PromQL over `/api/v1/query_range` (JSON).
    QueryRange,
    /// Prometheus' remote-read API; the query must be a plain selector.
    RemoteRead,
}

/// The default `history.prometheus.query`: the controller's `grl_calls_total`, every request
/// by (service, caller, procedure), matched by a bucket or not.
pub const DEFAULT_PROMETHEUS_QUERY: &str =
    "sum by (service, caller, procedure) (rate(grl_calls_total[1m]))";

fn default_query() -> String {
    DEFAULT_PROMETHEUS_QUERY.into()
}

fn default_max_points() -> u32 {
    11_000
}
fn default_concurrency() -> u32 {
    4
}
fn default_timeout() -> HumanDuration {
    HumanDuration(Duration::from_secs(60))
}
fn default_max_request_duration() -> HumanDuration {
    HumanDuration(Duration::from_secs(600))
}
fn default_retries() -> u32 {
    3
}
/// See [`PrometheusConfig::max_response_bytes`].
pub const DEFAULT_MAX_RESPONSE_BYTES: u64 = 2 << 30;
/// See [`PrometheusConfig::max_pull_bytes`].
pub const DEFAULT_MAX_PULL_BYTES: u64 = 32 << 30;
/// See [`PrometheusConfig::max_series`].
pub const DEFAULT_MAX_SERIES: u64 = 200_000;
fn default_max_response_bytes() -> u64 {
    DEFAULT_MAX_RESPONSE_BYTES
}
fn default_max_pull_bytes() -> u64 {
    DEFAULT_MAX_PULL_BYTES
}
fn default_max_series() -> u64 {
    DEFAULT_MAX_SERIES
}

/// Names of the labels carrying service, caller and procedure.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LabelNames {
    /// Callee service label.
    #[serde(default = "l_service")]
    pub service: String,
    /// Caller label.
    #[serde(default = "l_caller")]
    pub caller: String,
    /// Procedure label.
    #[serde(default = "l_procedure")]
    pub procedure: String,
}

fn l_service() -> String {
    "service".into()
}
fn l_caller() -> String {
    "caller".into()
}
fn l_procedure() -> String {
    "procedure".into()
}

impl Default for LabelNames {
    fn default() -> Self {
        Self {
            service: l_service(),
            caller: l_caller(),
            procedure: l_procedure(),
        }
    }
}

/// Commit mode of the writer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema, Default)]
#[serde(rename_all = "kebab-case")]
pub enum RepoMode {
    /// Commit on the base branch and push.
    #[default]
    Direct,
    /// Update a stable branch and open or update a pull request.
    PullRequest,
}

/// The git config repository.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ConfigRepoConfig {
    /// Local working copy.
    pub path: String,
    /// Remote to clone from and push to, when the working copy has none yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// Base branch.
    #[serde(default = "default_branch")]
    pub branch: String,
    /// direct | pull-request.
    #[serde(default)]
    pub mode: RepoMode,
    /// Branch used in pull-request mode.
    #[serde(default = "default_pr_branch")]
    pub pr_branch: String,
    /// Commit author name.
    #[serde(default = "default_author_name")]
    pub author_name: String,
    /// Commit author e-mail.
    #[serde(default = "default_author_email")]
    pub author_email: String,
    /// Environment variable holding an https token (never written to logs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_env: Option<String>,
    /// The forge API for pull requests.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forge: Option<ForgeConfig>,
    /// How long a connection to the remote may take to open, and how long it may stay
    /// silent while fetching or pushing: past it the git operation fails (a run fails with
    /// exit 1, nothing written) instead of hanging on a remote that never answers.
    #[serde(default = "default_git_timeout")]
    pub timeout: HumanDuration,
}

fn default_git_timeout() -> HumanDuration {
    HumanDuration(Duration::from_secs(30))
}

fn default_branch() -> String {
    "main".into()
}
fn default_pr_branch() -> String {
    "rlc/quotas".into()
}
fn default_author_name() -> String {
    "rlc".into()
}
fn default_author_email() -> String {
    "rlc@localhost".into()
}

/// The forge that hosts pull (merge) requests: GitHub, GitLab, or none (branch only).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ForgeConfig {
    /// `github` (default), `gitlab` or `none`.
    #[serde(default = "default_forge_kind")]
    pub kind: String,
    /// API base URL: `https://api.github.com` (default for github),
    /// `https://gitlab.com/api/v4` (default for gitlab).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_url: Option<String>,
    /// `owner/name` (github) or the project's full path `group/subgroup/name` (gitlab).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repo: Option<String>,
    /// Environment variable holding the API token (default `GITHUB_TOKEN` or `GITLAB_TOKEN`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_env: Option<String>,
    /// Labels put on the pull request.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub labels: Vec<String>,
    /// Reviewers asked on the pull request: user names (GitLab also takes numeric user ids).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reviewers: Vec<String>,
    /// Base URL of the rlc dashboard (`rlc serve`), e.g. `https://rlc.example.com`: pull
    /// requests link each bucket to `<dashboard_url>/buckets/<service>/<bucket>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dashboard_url: Option<String>,
    /// Web base URL of the forge, e.g. `https://github.com` or `https://gitlab.example.com`:
    /// the dashboard links a commit to `<web_url>/<repo>/commit/<sha>` (github) or
    /// `<web_url>/<repo>/-/commit/<sha>` (gitlab). Default: from `api_url`
    /// (`https://api.github.com` gives `https://github.com`; a trailing `/api/v3`, `/api/v4`,
    /// `/api/v1` or `/api` is removed). Not used with kind `none`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub web_url: Option<String>,
}

fn default_forge_kind() -> String {
    "github".into()
}

/// The GRL controller.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ControllerConfig {
    /// Base URL, e.g. `http://127.0.0.1:7070`.
    pub url: String,
    /// The region this controller serves (needed in `controllers:`; `default` when absent
    /// under `controller:`): what `rollout.stages` names.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub region: Option<String>,
    /// Environment variable holding the credential with the controller's `config` role
    /// (`PUT /v1/config`); `<VAR>_FILE`, when `<VAR>` is unset, names a file holding it.
    #[serde(default = "default_controller_token_env")]
    pub token_env: String,
    /// A file holding that credential (its first line), relative to rlc.yaml and re-read on
    /// every call; when set, it is used instead of `token_env` (what `rlc demo` writes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_file: Option<String>,
    /// Environment variable holding the credential with the `reports` role
    /// (`GET /v1/reports`); default: the `token_env` credential.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reports_token_env: Option<String>,
    /// How rlc verifies the controller (an `https://` url) and identifies itself to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<ClientTlsConfig>,
}

/// TLS of a client: the CA that server certificates must chain to, and an optional client
/// certificate for servers that require mutual TLS. Paths are relative to rlc.yaml.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ClientTlsConfig {
    /// CA certificates (PEM). When set, only they are trusted (not the public roots).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca: Option<String>,
    /// Client certificate chain (PEM), for mutual TLS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_cert: Option<String>,
    /// The client certificate's private key (PEM).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_key: Option<String>,
}

/// TLS of a server: certificate and key (re-read when the files change), and optionally the
/// CA whose client certificates are required (mutual TLS). Paths are relative to rlc.yaml.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ServerTlsConfig {
    /// Certificate chain (PEM, leaf first).
    pub cert: String,
    /// Private key (PEM).
    pub key: String,
    /// Require client certificates signed by this CA (PEM).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_ca: Option<String>,
}

fn default_controller_token_env() -> String {
    "GRL_TOKEN".into()
}

/// Safety rails applied after every policy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RailsConfig {
    /// Changes smaller than this fraction are skipped.
    #[serde(default = "default_min_change")]
    pub min_change: f64,
    /// A decrease is capped at this fraction of the current limit per run.
    #[serde(default = "default_max_decrease")]
    pub max_decrease: f64,
    /// An increase is capped at this fraction of the current limit per run (1.0: at most
    /// double), so that no bad sample or storm can lift a quota further than that in one
    /// run. Contracts are not capped.
    #[serde(default = "default_max_increase")]
    pub max_increase: f64,
    /// No limit goes below this.
    #[serde(default = "default_floor")]
    pub floor_rps: f64,
    /// New buckets start in shadow mode.
    #[serde(default = "default_true")]
    pub new_buckets_shadow: bool,
    /// At most one decrease per bucket within this interval (runs can be frequent: every
    /// change of `rlc/*.yaml` triggers one). `1s` turns the guard off.
    #[serde(default = "default_decrease_interval")]
    pub decrease_interval: HumanDuration,
}

fn default_decrease_interval() -> HumanDuration {
    HumanDuration(Duration::from_secs(86_400))
}

fn default_min_change() -> f64 {
    0.10
}
fn default_max_decrease() -> f64 {
    0.25
}
fn default_max_increase() -> f64 {
    1.0
}
fn default_floor() -> f64 {
    1.0
}
fn default_true() -> bool {
    true
}

impl Default for RailsConfig {
    fn default() -> Self {
        Self {
            min_change: default_min_change(),
            max_decrease: default_max_decrease(),
            max_increase: default_max_increase(),
            floor_rps: default_floor(),
            new_buckets_shadow: true,
            decrease_interval: default_decrease_interval(),
        }
    }
}

/// Plugin loading.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PluginsConfig {
    /// The only directory plugins are loaded from.
    pub dir: String,
    /// How long one call of a plugin (and its start) may take before its host process is
    /// killed and the bucket skipped.
    #[serde(default = "default_plugin_timeout")]
    pub timeout: HumanDuration,
    /// Address-space limit (`RLIMIT_AS`) of a plugin's host process, in MiB.
    #[serde(default = "default_plugin_memory_limit_mb")]
    pub memory_limit_mb: u64,
    /// How many times a plugin's host process is restarted after it died or was killed,
    /// within 10 minutes; beyond that the plugin's buckets fail at once until the window frees.
    #[serde(default = "default_plugin_max_restarts")]
    pub max_restarts: u32,
    /// The host program that loads plugins (the `rlc` binary or `rlc-plugin-host`); relative
    /// to rlc.yaml's directory. Default: `RLC_PLUGIN_HOST`, else the running `rlc` binary.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
}

fn default_plugin_timeout() -> HumanDuration {
    HumanDuration(Duration::from_secs(10))
}
fn default_plugin_memory_limit_mb() -> u64 {
    1024
}
fn default_plugin_max_restarts() -> u32 {
    3
}

/// The daemon's HTTP API.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    /// Listen address, e.g. `127.0.0.1:8080`.
    #[serde(default = "default_listen")]
    pub listen: String,
    /// Environment variable holding the write token: mutating endpoints (`POST /v1/runs`)
    /// need `Authorization: Bearer <write token>`; without it they are refused.
    #[serde(default = "default_server_token_env")]
    pub token_env: String,
    /// Environment variable holding the read token. When it is set (and the variable is not
    /// empty), the read endpoints (`GET /`, `GET /v1/...`) need `Authorization: Bearer <read
    /// or write token>`; when absent they are open. `/healthz`, `/readyz`, `/metrics` and
    /// `/openapi.json` stay open either way.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_token_env: Option<String>,
    /// Serve HTTPS (plain HTTP when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<ServerTlsConfig>,
}

fn default_listen() -> String {
    "127.0.0.1:8080".into()
}
fn default_server_token_env() -> String {
    "RLC_TOKEN".into()
}
