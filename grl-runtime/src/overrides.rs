//! Incident overrides: a targeted limit or fixed drop ratio with a TTL, a reason and an author.

use schema::Bucket;
use serde::{Deserialize, Serialize};

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
    /// Seconds until it expires.
    pub ttl_secs: u64,
    /// Why (incident link, ticket).
    pub reason: String,
    /// Who applied it.
    pub who: String,
}

/// Why an override request is refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum OverrideError {
    /// No target at all.
    #[error("an override needs a bucket, a caller or a procedure")]
    NoTarget,
    /// A bucket without its service.
    #[error("a bucket override needs its service")]
    BucketWithoutService,
    /// Both or neither action.
    #[error("set exactly one of limit_rps and drop_ratio")]
    Action,
    /// Out-of-range value.
    #[error("{0}")]
    Range(&'static str),
    /// Missing audit fields.
    #[error("reason and who must not be empty")]
    Audit,
}

impl OverrideRequest {
    /// Checks the request.
    pub fn validate(&self) -> Result<(), OverrideError> {
        if self.bucket.is_none() && self.caller.is_none() && self.procedure.is_none() {
            return Err(OverrideError::NoTarget);
        }
        if self.bucket.is_some() && self.service.is_none() {
            return Err(OverrideError::BucketWithoutService);
        }
        match (self.limit_rps, self.drop_ratio) {
            (Some(l), None) if !(l.is_finite() && l >= 0.0) => {
                return Err(OverrideError::Range(
                    "limit_rps must be finite and not negative",
                ))
            }
            (None, Some(r)) if !(0.0..=1.0).contains(&r) => {
                return Err(OverrideError::Range("drop_ratio must be within 0 and 1"))
            }
            (Some(_), None) | (None, Some(_)) => {}
            _ => return Err(OverrideError::Action),
        }
        if self.ttl_secs == 0 {
            return Err(OverrideError::Range("ttl_secs must be positive"));
        }
        if self.reason.trim().is_empty() || self.who.trim().is_empty() {
            return Err(OverrideError::Audit);
        }
        Ok(())
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
}

impl Override {
    /// Whether it still applies at `now` (unix seconds).
    pub fn active(&self, now: u64) -> bool {
        now < self.expires_at
    }

    /// Whether it targets `bucket` of `service`.
    pub fn matches(&self, service: &str, bucket: &Bucket) -> bool {
        let r = &self.req;
        if r.service.as_deref().is_some_and(|s| s != service) {
            return false;
        }
        if r.bucket.as_deref().is_some_and(|b| b != bucket.name) {
            return false;
        }
        if r.caller.is_some() && r.caller != bucket.caller {
            return false;
        }
        if r.procedure.is_some() && r.procedure != bucket.procedure {
            return false;
        }
        true
    }
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
    let mut eff = Effect::None;
    for o in overrides
        .iter()
        .filter(|o| o.active(now) && o.matches(service, bucket))
    {
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
        }
    }

    #[test]
    fn expiry_and_precedence() {
        let list = vec![
            ovr("1", req(Some(50.0), None), 100),
            ovr("2", req(Some(20.0), None), 50),
        ];
        let b = bucket("a");
        assert_eq!(effect(&list, 10, "svc", &b), Effect::Limit(20.0));
        // The stricter one expired: the other applies.
        assert_eq!(effect(&list, 50, "svc", &b), Effect::Limit(50.0));
        // Both expired: nothing applies.
        assert_eq!(effect(&list, 100, "svc", &b), Effect::None);
        // Other caller and other service are not targeted.
        assert_eq!(effect(&list, 10, "svc", &bucket("b")), Effect::None);
        assert_eq!(effect(&list, 10, "other", &b), Effect::None);
        let mut with_ratio = list.clone();
        with_ratio.push(ovr("3", req(None, Some(0.5)), 100));
        assert_eq!(effect(&with_ratio, 10, "svc", &b), Effect::Ratio(0.5));
    }

    #[test]
    fn validation() {
        assert!(req(Some(1.0), None).validate().is_ok());
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
    }
}
