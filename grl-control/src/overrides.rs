//! Incident overrides: a targeted limit or fixed drop ratio with a TTL, a reason and an author.
//!
//! Two kinds:
//! - a **bucket** override (`service` + `bucket`) replaces that bucket's limit (or ratio), per
//!   scope key as the bucket's own limit would apply, or sheds every criticality tier below
//!   one (`shed_below`; that one may also target a whole `service`: every bucket of it);
//! - a **traffic** override (`caller` and/or `procedure`, optionally one `service`) limits all
//!   that traffic *as a whole*, fleet-wide, whether or not a bucket matched it before. The
//!   controller materialises it in the config it serves (see [`materialize`]): clients look up
//!   the most specific bucket (caller+procedure, then procedure, then caller), so every bucket
//!   key that the targeted traffic can land on becomes a member of the override's group, and the
//!   keys it needs but that no bucket has are added as `override:<id>` buckets. The group's
//!   ratio comes from the sum of its members' offered rates against the override's limit and
//!   replaces the members' own ratios (the strictest group wins when several overlap).

use std::collections::HashMap;

use schema::{Bucket, BucketFile, Criticality, Mode, PolicyName, Scope};
use serde::{Deserialize, Serialize};

use grl_wire::ConfigDoc;

/// What an operator asks for (`POST /v1/overrides`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OverrideRequest {
    /// Restrict to one callee service (required with `bucket`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<String>,
    /// Target one bucket by name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bucket: Option<String>,
    /// Target the buckets of this caller.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub caller: Option<String>,
    /// Target the buckets of this procedure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub procedure: Option<String>,
    /// Replace the limit of the targeted buckets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit_rps: Option<f64>,
    /// Drop this fixed fraction instead of computing it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drop_ratio: Option<f64>,
    /// Drop every request of a criticality tier below this one (the bucket's own limit still
    /// applies to the rest); targets one bucket or every bucket of a service.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shed_below: Option<Criticality>,
    /// Seconds until it expires (1 to [`MAX_TTL_SECS`]).
    pub ttl_secs: u64,
    /// Why (incident link, ticket).
    pub reason: String,
    /// Who applied it.
    pub who: String,
}

/// The longest an override may last: 7 days. An incident measure that should outlive a week
/// belongs in the bucket files (reviewed, versioned); a longer TTL is refused with 422.
pub const MAX_TTL_SECS: u64 = 7 * 24 * 3600;

/// Why an override request is refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum OverrideError {
    /// No target at all.
    #[error("an override needs a bucket, a caller or a procedure")]
    NoTarget,
    /// A bucket without its service.
    #[error("a bucket override needs its service")]
    BucketWithoutService,
    /// Several actions or none.
    #[error("set exactly one of limit_rps, drop_ratio and shed_below")]
    Action,
    /// `shed_below` on caller or procedure traffic.
    #[error("shed_below targets one bucket (service and bucket) or a whole service, not caller or procedure traffic")]
    ShedTraffic,
    /// Out-of-range value.
    #[error("{0}")]
    Range(&'static str),
    /// Missing audit fields.
    #[error("reason and who must not be empty")]
    Audit,
    /// A bucket target mixed with a traffic target.
    #[error("a bucket override takes no caller or procedure (target one or the other)")]
    BucketAndTraffic,
}

impl OverrideRequest {
    /// Checks the request.
    pub fn validate(&self) -> Result<(), OverrideError> {
        let traffic = self.caller.is_some() || self.procedure.is_some();
        if self.shed_below.is_some() && traffic {
            return Err(OverrideError::ShedTraffic);
        }
        let service_wide = self.shed_below.is_some() && self.service.is_some();
        if self.bucket.is_none() && !traffic && !service_wide {
            return Err(OverrideError::NoTarget);
        }
        if self.bucket.is_some() && self.service.is_none() {
            return Err(OverrideError::BucketWithoutService);
        }
        if self.bucket.is_some() && traffic {
            return Err(OverrideError::BucketAndTraffic);
        }
        match (self.limit_rps, self.drop_ratio, self.shed_below) {
            (Some(l), None, None) if !(l.is_finite() && l >= 0.0) => {
                return Err(OverrideError::Range(
                    "limit_rps must be finite and not negative",
                ))
            }
            (None, Some(r), None) if !(0.0..=1.0).contains(&r) => {
                return Err(OverrideError::Range("drop_ratio must be within 0 and 1"))
            }
            (None, None, Some(Criticality::Sheddable)) => {
                return Err(OverrideError::Range(
                    "shed_below SHEDDABLE sheds nothing: no tier is below it",
                ))
            }
            (Some(_), None, None) | (None, Some(_), None) | (None, None, Some(_)) => {}
            _ => return Err(OverrideError::Action),
        }
        if self.ttl_secs == 0 {
            return Err(OverrideError::Range("ttl_secs must be positive"));
        }
        if self.ttl_secs > MAX_TTL_SECS {
            return Err(OverrideError::Range(
                "ttl_secs must be at most 604800 (7 days); put a lasting change in the bucket files",
            ));
        }
        if self.reason.trim().is_empty() || self.who.trim().is_empty() {
            return Err(OverrideError::Audit);
        }
        Ok(())
    }
}

/// What an override targets, in words: `bucket payments/charge`, `service payments` (every
/// bucket of it), or `traffic caller=gw procedure=/pay.Charge service=payments` (logs,
/// `grl override list`).
pub fn describe_target(
    service: Option<&str>,
    bucket: Option<&str>,
    caller: Option<&str>,
    procedure: Option<&str>,
) -> String {
    match (service, bucket, caller, procedure) {
        (Some(svc), Some(b), _, _) => return format!("bucket {svc}/{b}"),
        (Some(svc), None, None, None) => return format!("service {svc}"),
        _ => {}
    }
    let keys = [
        ("caller", caller),
        ("procedure", procedure),
        ("service", service),
    ];
    let parts: Vec<String> = keys
        .iter()
        .filter_map(|(k, v)| v.map(|v| format!("{k}={v}")))
        .collect();
    format!("traffic {}", parts.join(" "))
}

/// What an override does, in words: `limit 50 rps`, `drop 25%` or `shed below CRITICAL`.
pub fn describe_action(
    limit_rps: Option<f64>,
    drop_ratio: Option<f64>,
    shed_below: Option<Criticality>,
) -> String {
    match (limit_rps, drop_ratio, shed_below) {
        (Some(l), _, _) => format!("limit {l} rps"),
        (None, Some(r), _) => format!("drop {}%", (r * 1000.0).round() / 10.0),
        (None, None, Some(t)) => format!("shed below {t}"),
        (None, None, None) => "nothing".into(),
    }
}

impl OverrideRequest {
    /// [`describe_target`] of this request.
    pub fn target(&self) -> String {
        describe_target(
            self.service.as_deref(),
            self.bucket.as_deref(),
            self.caller.as_deref(),
            self.procedure.as_deref(),
        )
    }

    /// [`describe_action`] of this request.
    pub fn action(&self) -> String {
        describe_action(self.limit_rps, self.drop_ratio, self.shed_below)
    }
}

/// An applied override.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Override {
    /// Assigned id.
    pub id: String,
    /// The request it was made from.
    #[serde(flatten)]
    pub req: OverrideRequest,
    /// Unix seconds it was applied.
    pub created_at: u64,
    /// Unix seconds it stops applying.
    pub expires_at: u64,
    /// The name of the credential that added it (never the secret); absent for overrides
    /// added before credentials were named.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credential: Option<String>,
}

impl Override {
    /// Whether it still applies at `now` (unix seconds).
    pub fn active(&self, now: u64) -> bool {
        now < self.expires_at
    }

    /// Whether it is a bucket override targeting `bucket` of `service`, or a service-wide one
    /// of `service` (traffic overrides act through [`materialize`]'s groups instead).
    pub fn matches(&self, service: &str, bucket: &Bucket) -> bool {
        let r = &self.req;
        r.service.as_deref() == Some(service)
            && !self.is_traffic()
            && r.bucket.as_deref().is_none_or(|b| b == bucket.name)
    }

    /// Whether it targets traffic (caller and/or procedure) rather than buckets.
    pub fn is_traffic(&self) -> bool {
        self.req.bucket.is_none() && (self.req.caller.is_some() || self.req.procedure.is_some())
    }
}

/// One served bucket that a traffic override acts on.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Affected {
    /// Callee service.
    pub service: String,
    /// Bucket name.
    pub bucket: String,
    /// Its caller.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub caller: Option<String>,
    /// Its procedure.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub procedure: Option<String>,
    /// Added for the override (`override:<id>…`) rather than an existing bucket.
    pub created: bool,
}

/// The buckets a traffic override limits as a whole.
#[derive(Debug, Clone, PartialEq)]
pub struct Group {
    /// The override's id.
    pub id: String,
    /// Its limit for the whole group.
    pub limit_rps: Option<f64>,
    /// Or its fixed ratio.
    pub drop_ratio: Option<f64>,
    /// Member buckets.
    pub members: Vec<Affected>,
}

/// Where a service's buckets are, by what they match on (positions in bucket order).
#[derive(Default)]
struct KeyIndex {
    /// The first bucket of each (caller, procedure) key: the one a lookup finds.
    key: HashMap<(Option<String>, Option<String>), usize>,
    /// Caller+procedure buckets by caller.
    with_caller: HashMap<String, Vec<usize>>,
    /// Caller+procedure buckets by procedure.
    with_procedure: HashMap<String, Vec<usize>>,
    /// Procedure-only buckets.
    procedure_only: Vec<usize>,
}

impl KeyIndex {
    fn of(f: &BucketFile) -> KeyIndex {
        let mut ix = KeyIndex::default();
        for (i, b) in f.buckets.iter().enumerate() {
            ix.add(i, b);
        }
        ix
    }

    /// Notes bucket `b` at position `i` (after every bucket noted before).
    fn add(&mut self, i: usize, b: &Bucket) {
        self.key
            .entry((b.caller.clone(), b.procedure.clone()))
            .or_insert(i);
        match (&b.caller, &b.procedure) {
            (Some(c), Some(p)) => {
                self.with_caller.entry(c.clone()).or_default().push(i);
                self.with_procedure.entry(p.clone()).or_default().push(i);
            }
            (None, Some(_)) => self.procedure_only.push(i),
            _ => {}
        }
    }
}

/// Two ascending position lists merged, ascending.
fn merged<'a>(a: &'a [usize], b: &'a [usize]) -> impl Iterator<Item = usize> + 'a {
    let (mut x, mut y) = (0, 0);
    std::iter::from_fn(move || {
        let next = match (a.get(x), b.get(y)) {
            (Some(&p), Some(&q)) if p <= q => {
                x += 1;
                p
            }
            (_, Some(&q)) => {
                y += 1;
                q
            }
            (Some(&p), None) => {
                x += 1;
                p
            }
            (None, None) => return None,
        };
        Some(next)
    })
}

/// The config served to clients: `base` plus the buckets traffic overrides need, and the
/// groups they form. Without traffic overrides it is `base` unchanged (same version);
/// otherwise the version is `<base>+ovr.<hash>` so that clients fetch it, and changes again
/// when an override is added, removed or expires.
pub fn materialize(base: &ConfigDoc, overrides: &[Override]) -> (ConfigDoc, Vec<Group>) {
    if !overrides.iter().any(Override::is_traffic) {
        // The common case: no copy compared bucket by bucket.
        return (base.clone(), Vec::new());
    }
    let mut served = Served::of(base);
    let groups = overrides
        .iter()
        .filter(|o| o.is_traffic())
        .map(|o| served.apply(o))
        .collect();
    let mut doc = served.doc;
    if doc != *base {
        doc.version = overridden_version(&base.version, overrides);
    }
    (doc, groups)
}

/// `<base>+ovr.<hash>`: the served buckets follow from the pushed config and the traffic
/// overrides in order, so a hash of those names the served config without serializing it.
fn overridden_version(base: &str, overrides: &[Override]) -> String {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for o in overrides.iter().filter(|o| o.is_traffic()) {
        let req = serde_json::to_vec(&o.req).unwrap_or_default();
        for part in [o.id.as_bytes(), &[0], &req, &[0]] {
            h = crate::config::fnv_from(h, part);
        }
    }
    format!("{base}+ovr.{h:016x}")
}

/// A key that the traffic an override targets can be looked up under, with the name of the
/// bucket to add when none has that key (empty when one always has it).
struct TrafficKey {
    caller: Option<String>,
    procedure: Option<String>,
    new_name: String,
}

impl TrafficKey {
    fn new(caller: Option<String>, procedure: Option<String>, new_name: String) -> Self {
        TrafficKey {
            caller,
            procedure,
            new_name,
        }
    }
}

/// The served config while traffic overrides are applied to it, with, per service, where
/// each key and each kind of bucket is, kept up to date as override buckets are added: an
/// override costs the same with 3,000 others as with none.
struct Served {
    doc: ConfigDoc,
    index: Vec<KeyIndex>,
    service_at: HashMap<String, usize>,
}

impl Served {
    fn of(base: &ConfigDoc) -> Served {
        let doc = base.clone();
        let index = doc.services.iter().map(KeyIndex::of).collect();
        let service_at = doc
            .services
            .iter()
            .enumerate()
            .map(|(i, f)| (f.service.clone(), i))
            .collect();
        Served {
            doc,
            index,
            service_at,
        }
    }

    /// Adds the buckets traffic override `o` needs and returns the group it forms.
    fn apply(&mut self, o: &Override) -> Group {
        let r = &o.req;
        let mut members = Vec::new();
        for si in self.targets(r.service.as_deref()) {
            let keys = traffic_keys(o, &self.doc.services[si], &self.index[si]);
            for key in keys {
                self.enforce(si, key, r.limit_rps, &mut members);
            }
        }
        Group {
            id: o.id.clone(),
            limit_rps: r.limit_rps,
            drop_ratio: r.drop_ratio,
            members,
        }
    }

    /// The positions of the services an override of `service` (all when `None`) targets;
    /// a service the config lacks is added without buckets.
    fn targets(&mut self, service: Option<&str>) -> Vec<usize> {
        let Some(svc) = service else {
            return (0..self.doc.services.len()).collect();
        };
        if !self.service_at.contains_key(svc) {
            self.service_at
                .insert(svc.to_string(), self.doc.services.len());
            self.doc.services.push(BucketFile {
                criticality: Default::default(),
                service: svc.to_string(),
                buckets: Vec::new(),
            });
            self.index.push(KeyIndex::default());
        }
        vec![self.service_at[svc]]
    }

    /// Makes the bucket of `key` in service `si` (added when none has the key) enforce,
    /// and notes it among `members` once.
    fn enforce(
        &mut self,
        si: usize,
        key: TrafficKey,
        limit_rps: Option<f64>,
        members: &mut Vec<Affected>,
    ) {
        let f = &mut self.doc.services[si];
        let ix = &mut self.index[si];
        let TrafficKey {
            caller,
            procedure,
            new_name,
        } = key;
        let pos = ix.key.get(&(caller.clone(), procedure.clone())).copied();
        let created = pos.is_none();
        let i = match pos {
            Some(i) => i,
            None => {
                f.buckets.push(Bucket {
                    name: new_name,
                    caller: caller.clone(),
                    procedure: procedure.clone(),
                    scope: Scope::Global,
                    // Informational for clients (the group ratio decides); compile
                    // wants a positive limit even for a block-all override.
                    limit_rps: limit_rps.unwrap_or(1.0).max(0.001),
                    mode: Mode::Enforce,
                    policy: PolicyName::Manual,
                });
                let i = f.buckets.len() - 1;
                ix.add(i, &f.buckets[i]);
                i
            }
        };
        let b = &mut f.buckets[i];
        // An incident override enforces, even on a bucket still in shadow mode.
        b.mode = Mode::Enforce;
        if !members
            .iter()
            .any(|m: &Affected| m.bucket == b.name && m.service == f.service)
        {
            members.push(Affected {
                service: f.service.clone(),
                bucket: b.name.clone(),
                caller,
                procedure,
                created,
            });
        }
    }
}

/// The keys the traffic override `o` targets can be looked up under in service file `f`.
fn traffic_keys(o: &Override, f: &BucketFile, ix: &KeyIndex) -> Vec<TrafficKey> {
    let mut keys = Vec::new();
    let own = format!("override:{}", o.id);
    match (&o.req.caller, &o.req.procedure) {
        (Some(c), Some(p)) => keys.push(TrafficKey::new(Some(c.clone()), Some(p.clone()), own)),
        (None, Some(p)) => {
            keys.push(TrafficKey::new(None, Some(p.clone()), own));
            // The caller+procedure buckets under the procedure.
            for &i in ix.with_procedure.get(p).into_iter().flatten() {
                let caller = f.buckets[i].caller.clone();
                keys.push(TrafficKey::new(caller, Some(p.clone()), String::new()));
            }
        }
        (Some(c), None) => {
            keys.push(TrafficKey::new(Some(c.clone()), None, own.clone()));
            // In bucket order: the caller's own caller+procedure buckets (they win over
            // a caller key) and every procedure bucket (it wins over a caller key: the
            // caller's share of that procedure is split off into its own key).
            let mine = ix.with_caller.get(c).map_or(&[][..], Vec::as_slice);
            for i in merged(mine, &ix.procedure_only) {
                let b = &f.buckets[i];
                match (&b.caller, &b.procedure) {
                    (Some(_), Some(_)) => keys.push(TrafficKey::new(
                        Some(c.clone()),
                        b.procedure.clone(),
                        String::new(),
                    )),
                    (None, Some(p)) => keys.push(TrafficKey::new(
                        Some(c.clone()),
                        Some(p.clone()),
                        format!("{own}:{p}"),
                    )),
                    _ => {}
                }
            }
        }
        (None, None) => {}
    }
    keys
}

/// The effect of the active overrides on one bucket.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Effect {
    /// No override: the configured limit.
    None,
    /// The lowest overriding limit.
    Limit(f64),
    /// The highest fixed ratio (wins over limits: it is the blunter incident tool).
    Ratio(f64),
}

/// The combined effect of the overrides active at `now` on `bucket` of `service`.
pub fn effect(overrides: &[Override], now: u64, service: &str, bucket: &Bucket) -> Effect {
    combine(overrides.iter().filter(|o| o.matches(service, bucket)), now)
}

/// The tier below which those of `overrides` active at `now` shed everything (the most
/// critical of their `shed_below`), if any does.
pub fn floor<'a>(
    overrides: impl IntoIterator<Item = &'a Override>,
    now: u64,
) -> Option<Criticality> {
    overrides
        .into_iter()
        .filter(|o| o.active(now))
        .filter_map(|o| o.req.shed_below)
        .max()
}

/// The combined effect of those of `overrides` active at `now` (the controller passes the
/// bucket overrides it indexed under one bucket, so a recompute never scans the whole list).
/// A `shed_below` override has no effect here (see [`floor`]).
pub fn combine<'a>(overrides: impl IntoIterator<Item = &'a Override>, now: u64) -> Effect {
    let mut eff = Effect::None;
    for o in overrides.into_iter().filter(|o| o.active(now)) {
        eff = match (eff, o.req.limit_rps, o.req.drop_ratio) {
            (Effect::Ratio(a), _, Some(r)) => Effect::Ratio(a.max(r)),
            (Effect::Ratio(a), _, None) => Effect::Ratio(a),
            (_, _, Some(r)) => Effect::Ratio(r),
            (Effect::Limit(a), Some(l), None) => Effect::Limit(a.min(l)),
            (Effect::None, Some(l), None) => Effect::Limit(l),
            (e, None, None) => e,
        };
    }
    eff
}

#[cfg(test)]
mod tests {
    use super::*;
    use schema::{Mode, PolicyName, Scope};

    fn req(limit: Option<f64>, ratio: Option<f64>) -> OverrideRequest {
        OverrideRequest {
            service: Some("svc".into()),
            bucket: None,
            caller: Some("a".into()),
            procedure: None,
            limit_rps: limit,
            drop_ratio: ratio,
            shed_below: None,
            ttl_secs: 60,
            reason: "INC-1".into(),
            who: "sre".into(),
        }
    }

    fn bucket(caller: &str) -> Bucket {
        Bucket {
            name: format!("{caller}.x"),
            caller: Some(caller.into()),
            procedure: Some("x".into()),
            scope: Scope::Global,
            limit_rps: 100.0,
            mode: Mode::Enforce,
            policy: PolicyName::Manual,
        }
    }

    fn ovr(id: &str, r: OverrideRequest, expires_at: u64) -> Override {
        Override {
            id: id.into(),
            req: r,
            created_at: 0,
            expires_at,
            credential: None,
        }
    }

    fn on_bucket(r: OverrideRequest, name: &str) -> OverrideRequest {
        OverrideRequest {
            bucket: Some(name.into()),
            caller: None,
            ..r
        }
    }

    #[test]
    fn expiry_and_precedence() {
        let list = vec![
            ovr("1", on_bucket(req(Some(50.0), None), "a.x"), 100),
            ovr("2", on_bucket(req(Some(20.0), None), "a.x"), 50),
        ];
        let b = bucket("a");
        assert_eq!(effect(&list, 10, "svc", &b), Effect::Limit(20.0));
        // The stricter one expired: the other applies.
        assert_eq!(effect(&list, 50, "svc", &b), Effect::Limit(50.0));
        // Both expired: nothing applies.
        assert_eq!(effect(&list, 100, "svc", &b), Effect::None);
        // Other bucket and other service are not targeted.
        assert_eq!(effect(&list, 10, "svc", &bucket("b")), Effect::None);
        assert_eq!(effect(&list, 10, "other", &b), Effect::None);
        let mut with_ratio = list.clone();
        with_ratio.push(ovr("3", on_bucket(req(None, Some(0.5)), "a.x"), 100));
        assert_eq!(effect(&with_ratio, 10, "svc", &b), Effect::Ratio(0.5));
        // A traffic override does not act through `effect`.
        assert_eq!(
            effect(&[ovr("4", req(Some(1.0), None), 100)], 10, "svc", &b),
            Effect::None
        );
    }

    fn b(name: &str, caller: Option<&str>, procedure: Option<&str>, mode: Mode) -> Bucket {
        Bucket {
            name: name.into(),
            caller: caller.map(Into::into),
            procedure: procedure.map(Into::into),
            scope: Scope::Zone,
            limit_rps: 100.0,
            mode,
            policy: PolicyName::Peak,
        }
    }

    fn names(g: &Group) -> Vec<(&str, bool)> {
        g.members
            .iter()
            .map(|m| (m.bucket.as_str(), m.created))
            .collect()
    }

    #[test]
    fn materialize_covers_every_key_the_traffic_can_land_on() {
        let base = ConfigDoc {
            version: "v1".into(),
            services: vec![BucketFile {
                criticality: Default::default(),
                service: "svc".into(),
                buckets: vec![
                    b("a.x", Some("a"), Some("x"), Mode::Shadow),
                    b("y", None, Some("y"), Mode::Enforce),
                    b("c", Some("c"), None, Mode::Enforce),
                    b("c.y", Some("c"), Some("y"), Mode::Enforce),
                ],
            }],
            candidates: Vec::new(),
        };
        // Nothing targeted: the base config, same version.
        assert_eq!(materialize(&base, &[]).0, base);
        // A caller with a caller+procedure bucket, under a procedure bucket, and no caller bucket.
        let (doc, groups) = materialize(&base, &[ovr("ovr-1", req(Some(10.0), None), 100)]);
        assert!(doc.version.starts_with("v1+ovr."));
        assert_eq!(
            names(&groups[0]),
            [
                ("override:ovr-1", true),
                ("a.x", false),
                ("override:ovr-1:y", true)
            ]
        );
        let served = &doc.services[0].buckets;
        // The shadow bucket enforces while the override lasts.
        assert_eq!(served[0].mode, Mode::Enforce);
        assert_eq!(served.len(), 6);
        // Every (caller, procedure) pair of `a` resolves to a member: the table compiles.
        grl_core::Table::compile("svc", &doc.version, served).expect("served config compiles");
        // A caller that has a caller bucket: it becomes the member.
        let mut r = req(Some(10.0), None);
        r.caller = Some("c".into());
        let (_, groups) = materialize(&base, &[ovr("ovr-2", r, 100)]);
        assert_eq!(names(&groups[0]), [("c", false), ("c.y", false)]);
        // A procedure: its bucket and the caller+procedure buckets under it.
        let mut r = req(None, Some(0.5));
        r.caller = None;
        r.procedure = Some("y".into());
        let (_, groups) = materialize(&base, &[ovr("ovr-3", r, 100)]);
        assert_eq!(names(&groups[0]), [("y", false), ("c.y", false)]);
        // A service without any bucket file gets one.
        let mut r = req(Some(10.0), None);
        r.service = Some("new".into());
        let (doc, groups) = materialize(&base, &[ovr("ovr-4", r, 100)]);
        assert_eq!(doc.services[1].service, "new");
        assert_eq!(names(&groups[0]), [("override:ovr-4", true)]);
    }

    #[test]
    fn validation() {
        assert!(req(Some(1.0), None).validate().is_ok());
        assert_eq!(
            OverrideRequest {
                bucket: Some("b".into()),
                ..req(Some(1.0), None)
            }
            .validate(),
            Err(OverrideError::BucketAndTraffic)
        );
        assert_eq!(req(None, None).validate(), Err(OverrideError::Action));
        assert_eq!(
            req(Some(1.0), Some(0.1)).validate(),
            Err(OverrideError::Action)
        );
        assert!(req(None, Some(1.5)).validate().is_err());
        assert!(req(Some(f64::NAN), None).validate().is_err());
        let mut r = req(Some(1.0), None);
        r.caller = None;
        assert_eq!(r.validate(), Err(OverrideError::NoTarget));
        r.bucket = Some("b".into());
        r.service = None;
        assert_eq!(r.validate(), Err(OverrideError::BucketWithoutService));
        let mut r = req(Some(1.0), None);
        r.who = " ".into();
        assert_eq!(r.validate(), Err(OverrideError::Audit));
        let mut r = req(Some(1.0), None);
        r.ttl_secs = MAX_TTL_SECS;
        assert!(r.validate().is_ok());
        for ttl in [MAX_TTL_SECS + 1, u64::MAX] {
            r.ttl_secs = ttl;
            assert!(matches!(r.validate(), Err(OverrideError::Range(m)) if m.contains("7 days")));
        }
    }

    #[test]
    fn shed_below_targets_a_bucket_or_a_whole_service() {
        let shed = |bucket: Option<&str>, caller: Option<&str>, tier| OverrideRequest {
            bucket: bucket.map(Into::into),
            caller: caller.map(Into::into),
            shed_below: Some(tier),
            ..req(None, None)
        };
        let service_wide = shed(None, None, Criticality::Critical);
        assert_eq!(service_wide.validate(), Ok(()));
        assert_eq!(service_wide.target(), "service svc");
        assert_eq!(service_wide.action(), "shed below CRITICAL");
        assert_eq!(
            shed(Some("a.x"), None, Criticality::CriticalPlus).validate(),
            Ok(())
        );
        assert_eq!(
            shed(None, Some("a"), Criticality::Critical).validate(),
            Err(OverrideError::ShedTraffic)
        );
        assert!(matches!(
            shed(None, None, Criticality::Sheddable).validate(),
            Err(OverrideError::Range(m)) if m.contains("sheds nothing")
        ));
        let both = OverrideRequest {
            limit_rps: Some(5.0),
            ..service_wide.clone()
        };
        assert_eq!(both.validate(), Err(OverrideError::Action));
        // A service-wide floor matches every bucket of its service, and is not traffic.
        let o = ovr("1", service_wide, 100);
        assert!(!o.is_traffic());
        assert!(o.matches("svc", &bucket("a")) && o.matches("svc", &bucket("b")));
        assert!(!o.matches("other", &bucket("a")));
        assert_eq!(floor([&o], 10), Some(Criticality::Critical));
        assert_eq!(floor([&o], 100), None);
        assert_eq!(effect(&[o], 10, "svc", &bucket("a")), Effect::None);
        // Without a service and a bucket, a floor has no target.
        let none = OverrideRequest {
            service: None,
            ..shed(None, None, Criticality::Critical)
        };
        assert_eq!(none.validate(), Err(OverrideError::NoTarget));
    }
    /// The reference the indexed [`materialize`] must agree with: each key found by a scan of
    /// the service's buckets (quadratic in the overrides).
    fn materialize_naive(base: &ConfigDoc, overrides: &[Override]) -> (ConfigDoc, Vec<Group>) {
        if !overrides.iter().any(Override::is_traffic) {
            // The common case: no copy compared bucket by bucket.
            return (base.clone(), Vec::new());
        }
        let mut doc = base.clone();
        let mut groups = Vec::new();
        for o in overrides.iter().filter(|o| o.is_traffic()) {
            let r = &o.req;
            let mut members = Vec::new();
            if let Some(svc) = &r.service {
                if !doc.services.iter().any(|f| &f.service == svc) {
                    doc.services.push(BucketFile {
                        criticality: Default::default(),
                        service: svc.clone(),
                        buckets: Vec::new(),
                    });
                }
            }
            for f in doc
                .services
                .iter_mut()
                .filter(|f| r.service.as_ref().is_none_or(|s| s == &f.service))
            {
                // The keys the targeted traffic can be looked up under, with the name of the
                // bucket to add when none has that key.
                let mut keys: Vec<(Option<String>, Option<String>, String)> = Vec::new();
                let own = format!("override:{}", o.id);
                match (&r.caller, &r.procedure) {
                    (Some(c), Some(p)) => keys.push((Some(c.clone()), Some(p.clone()), own)),
                    (None, Some(p)) => {
                        keys.push((None, Some(p.clone()), own));
                        for b in f.buckets.iter().filter(|b| b.procedure.as_ref() == Some(p)) {
                            if b.caller.is_some() {
                                keys.push((b.caller.clone(), Some(p.clone()), String::new()));
                            }
                        }
                    }
                    (Some(c), None) => {
                        keys.push((Some(c.clone()), None, own.clone()));
                        for b in &f.buckets {
                            match (&b.caller, &b.procedure) {
                                // The caller's own caller+procedure buckets win over a caller key.
                                (Some(bc), Some(_)) if bc == c => {
                                    keys.push((Some(c.clone()), b.procedure.clone(), String::new()))
                                }
                                // A procedure bucket wins over a caller key: split the caller's
                                // share of that procedure off into its own key.
                                (None, Some(p)) => keys.push((
                                    Some(c.clone()),
                                    Some(p.clone()),
                                    format!("{own}:{p}"),
                                )),
                                _ => {}
                            }
                        }
                    }
                    (None, None) => {}
                }
                for (caller, procedure, new_name) in keys {
                    let pos = f
                        .buckets
                        .iter()
                        .position(|b| b.caller == caller && b.procedure == procedure);
                    let created = pos.is_none();
                    let b = match pos {
                        Some(i) => &mut f.buckets[i],
                        None => {
                            f.buckets.push(Bucket {
                                name: new_name,
                                caller: caller.clone(),
                                procedure: procedure.clone(),
                                scope: Scope::Global,
                                // Informational for clients (the group ratio decides); compile
                                // wants a positive limit even for a block-all override.
                                limit_rps: r.limit_rps.unwrap_or(1.0).max(0.001),
                                mode: Mode::Enforce,
                                policy: PolicyName::Manual,
                            });
                            f.buckets.last_mut().expect("just pushed")
                        }
                    };
                    // An incident override enforces, even on a bucket still in shadow mode.
                    b.mode = Mode::Enforce;
                    if !members
                        .iter()
                        .any(|m: &Affected| m.bucket == b.name && m.service == f.service)
                    {
                        members.push(Affected {
                            service: f.service.clone(),
                            bucket: b.name.clone(),
                            caller,
                            procedure,
                            created,
                        });
                    }
                }
            }
            groups.push(Group {
                id: o.id.clone(),
                limit_rps: r.limit_rps,
                drop_ratio: r.drop_ratio,
                members,
            });
        }
        if doc != *base {
            let text = serde_json::to_string(&doc.services).unwrap_or_default();
            let h = crate::config::fnv(text.as_bytes());
            doc.version = format!("{}+ovr.{h:016x}", base.version);
        }
        (doc, groups)
    }

    /// The indexed materialisation gives exactly the scanning one's buckets and groups, over
    /// overrides of every kind that pile on one another (procedure buckets added by one that
    /// a caller override then splits, overrides without a service, a new service).
    #[test]
    fn indexed_materialize_equals_the_scan() {
        let base = ConfigDoc {
            version: "v1".into(),
            services: vec![
                BucketFile {
                    criticality: Default::default(),
                    service: "svc".into(),
                    buckets: vec![
                        b("a.x", Some("a"), Some("x"), Mode::Shadow),
                        b("y", None, Some("y"), Mode::Enforce),
                        b("c", Some("c"), None, Mode::Enforce),
                        b("c.y", Some("c"), Some("y"), Mode::Enforce),
                    ],
                },
                BucketFile {
                    criticality: Default::default(),
                    service: "other".into(),
                    buckets: vec![b("z", None, Some("z"), Mode::Enforce)],
                },
            ],
            candidates: Vec::new(),
        };
        let (callers, procedures) = (["a", "c", "d"], ["x", "y", "z", "w"]);
        let mut list = Vec::new();
        for i in 0..60u64 {
            let mut r = req(Some(10.0), None);
            r.service = match i % 4 {
                0 => None,
                1 => Some("other".into()),
                2 => Some("fresh".into()),
                _ => Some("svc".into()),
            };
            let c = callers[(i as usize * 7) % 3];
            let p = procedures[(i as usize * 5) % 4];
            (r.caller, r.procedure) = match i % 3 {
                0 => (Some(c.into()), None),
                1 => (None, Some(p.into())),
                _ => (Some(c.into()), Some(p.into())),
            };
            list.push(ovr(&format!("ovr-{i}"), r, 100));
            let ((doc, groups), (want, want_groups)) =
                (materialize(&base, &list), materialize_naive(&base, &list));
            assert_eq!(doc.services, want.services, "after {} overrides", i + 1);
            assert_eq!(groups, want_groups, "after {} overrides", i + 1);
            // The version names the served config as the scan's did (by another hash).
            assert_eq!(doc.version == base.version, want.version == base.version);
        }
    }
}
