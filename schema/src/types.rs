//! The serde types of every user-facing file. Raw shapes only: cross-field and
//! cross-file checks live in `validate`.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use schemars::JsonSchema;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

mod daemon;
pub use daemon::*;

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

/// A policy's margin over the level it computed: a fixed share (`0.25`: limit = level × 1.25)
/// or `auto`, chosen per bucket by replaying its history.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Headroom {
    /// This share, the same for every bucket.
    Fixed(f64),
    /// Each bucket's own margin, from a replay of its history.
    Auto,
}

impl Headroom {
    /// The fixed share, `None` for `auto`.
    pub fn fixed(self) -> Option<f64> {
        match self {
            Headroom::Fixed(h) => Some(h),
            Headroom::Auto => None,
        }
    }
}

impl fmt::Display for Headroom {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Headroom::Fixed(h) => write!(f, "{h}"),
            Headroom::Auto => f.write_str("auto"),
        }
    }
}

impl From<f64> for Headroom {
    fn from(h: f64) -> Self {
        Headroom::Fixed(h)
    }
}

impl Serialize for Headroom {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Headroom::Fixed(h) => s.serialize_f64(*h),
            Headroom::Auto => s.serialize_str("auto"),
        }
    }
}

impl<'de> Deserialize<'de> for Headroom {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Headroom;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a number ≥ 0 or `auto`")
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Headroom, E> {
                Ok(Headroom::Fixed(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Headroom, E> {
                Ok(Headroom::Fixed(v as f64))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Headroom, E> {
                Ok(Headroom::Fixed(v as f64))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Headroom, E> {
                if v.trim().eq_ignore_ascii_case("auto") {
                    Ok(Headroom::Auto)
                } else {
                    Err(E::custom(format_args!(
                        "invalid headroom `{v}`: expected a number ≥ 0 or `auto`"
                    )))
                }
            }
        }
        d.deserialize_any(V)
    }
}

impl JsonSchema for Headroom {
    fn schema_name() -> String {
        "Headroom".into()
    }
    fn json_schema(_: &mut schemars::gen::SchemaGenerator) -> schemars::schema::Schema {
        let number = schemars::schema::SchemaObject {
            instance_type: Some(schemars::schema::InstanceType::Number.into()),
            number: Some(Box::new(schemars::schema::NumberValidation {
                minimum: Some(0.0),
                ..Default::default()
            })),
            ..Default::default()
        };
        let auto = schemars::schema::SchemaObject {
            enum_values: Some(vec!["auto".into()]),
            ..Default::default()
        };
        schemars::schema::SchemaObject {
            subschemas: Some(Box::new(schemars::schema::SubschemaValidation {
                any_of: Some(vec![number.into(), auto.into()]),
                ..Default::default()
            })),
            ..Default::default()
        }
        .into()
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
    /// How the service's requests are tiered: the highest tier each caller may claim. Written
    /// by hand (rlc keeps it as it is when it regenerates the file); served to clients of
    /// protocol 9 or more.
    #[serde(default, skip_serializing_if = "CriticalitySection::is_empty")]
    pub criticality: CriticalitySection,
}

impl BucketFile {
    /// A file of `service` with `buckets` and no criticality section.
    pub fn new(service: impl Into<String>, buckets: Vec<Bucket>) -> BucketFile {
        BucketFile {
            service: service.into(),
            buckets,
            criticality: CriticalitySection::default(),
        }
    }
}

/// The `criticality:` section of a bucket file.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CriticalitySection {
    /// Caller pattern → the highest tier its requests may claim (`CRITICAL_PLUS`, `CRITICAL`,
    /// `SHEDDABLE_PLUS`, `SHEDDABLE`): a request claiming more is decided at the cap. A
    /// pattern is a caller name, or a prefix ending in `*` (`batch-*`; `*` alone: every
    /// caller). A caller's exact name wins over prefixes, the longest prefix over shorter ones.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub caps: BTreeMap<String, crate::Criticality>,
}

impl CriticalitySection {
    /// Whether the section says nothing (it is then left out of the file).
    pub fn is_empty(&self) -> bool {
        self.caps.is_empty()
    }
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
    /// limit = peak × (1 + headroom); `auto` picks each bucket's margin from how much its own
    /// history surprised it (`target_throttled`, `min_headroom`, `max_headroom`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub headroom: Option<Headroom>,
    /// `headroom: auto`: the share of requests a replay of the bucket's history may throttle
    /// (default 0.0001, 0.01 %).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_throttled: Option<f64>,
    /// `headroom: auto`: the smallest margin it picks (default 0.03).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_headroom: Option<f64>,
    /// `headroom: auto`: the largest margin it picks (default 1.0); a bucket that needs more is
    /// flagged for review.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_headroom: Option<f64>,
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
            target_throttled: self.target_throttled.or(base.target_throttled),
            min_headroom: self.min_headroom.or(base.min_headroom),
            max_headroom: self.max_headroom.or(base.max_headroom),
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
