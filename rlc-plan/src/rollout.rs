//! Rollouts (`rollout:` in `rlc/policies.yaml`), the part without I/O: which changes could
//! refuse more traffic (they go out as candidates), the fingerprint of a change's inputs, and
//! holding a change whose rollout was aborted until those inputs change. `rlc` drives the
//! rollouts themselves (`rlc::rollout`).

use std::collections::BTreeMap;

use schema::{Bucket, BucketFile, Mode, Scope};

use crate::plan::{Held, Plan, Skipped};

/// 16 hex digits of FNV-1a (64 bit) over `bytes`: ids and fingerprints, stable across
/// versions and machines.
pub fn digest(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016x}")
}

fn breadth(s: Scope) -> u8 {
    match s {
        Scope::Zone => 0,
        Scope::Region => 1,
        Scope::Global => 2,
    }
}

/// Whether replacing `old` (the bucket in force; `None`: no bucket) by `new` could refuse a
/// request `old` admits: a lower limit, `shadow -> enforce`, a new enforcing bucket, a scope
/// under which the same limit counts more traffic (`zone -> region -> global`), or another
/// caller/procedure match. Raises, shadow buckets and provenance-only changes cannot.
pub fn could_refuse_more(old: Option<&Bucket>, new: &Bucket) -> bool {
    if new.mode == Mode::Shadow {
        return false;
    }
    let Some(old) = old else {
        return true;
    };
    old.mode == Mode::Shadow
        || new.limit_rps < old.limit_rps
        || breadth(new.scope) > breadth(old.scope)
        || old.caller != new.caller
        || old.procedure != new.procedure
}

/// The fingerprint of a change's inputs: the service and bucket, the bucket in force (`None`:
/// none) and the digest of the config repo's `rlc/*.yaml` (`inputs`). An aborted change is
/// not proposed again while its fingerprint stays the same.
pub fn fingerprint(service: &str, bucket: &str, in_force: Option<&Bucket>, inputs: &str) -> String {
    let spec = in_force
        .map(|b| serde_json::to_string(b).unwrap_or_default())
        .unwrap_or_default();
    digest(format!("{service}\n{bucket}\n{spec}\n{inputs}").as_bytes())
}

/// A change whose rollout was aborted.
#[derive(Debug, Clone, PartialEq)]
pub struct Aborted {
    /// Callee service.
    pub service: String,
    /// Bucket name.
    pub bucket: String,
    /// [`fingerprint`] of its inputs when it was proposed.
    pub fingerprint: String,
    /// The limit of its candidate: a later proposal at or below it (on the same inputs) is
    /// held; one above it is another change, tried as a candidate of its own.
    pub limit_rps: f64,
    /// Why it was aborted, with the evidence.
    pub reason: String,
}

/// `plan` with every change that could refuse more traffic and whose rollout was aborted on
/// the same inputs held (a proposal at or below the aborted candidate's limit): the bucket
/// stays as it is in force (`base`) and `held`/`skipped` name the abort; a new bucket is left
/// out. A proposal an earlier step held already (the decrease guard sees the aborted change's
/// own commit as a decrease) is judged by what it proposed, and its reason names the abort
/// instead. `inputs` is the digest of the base's `rlc/*.yaml`.
pub fn hold_aborted(
    mut plan: Plan,
    base: &BTreeMap<String, BucketFile>,
    inputs: &str,
    aborted: &[Aborted],
) -> Plan {
    if aborted.is_empty() {
        return plan;
    }
    let mut skipped = Vec::new();
    // Reasons of earlier holds that now name the abort: (the bucket's service, caller and
    // procedure as `skipped` names it, old reason, new reason).
    type Who = (String, Option<String>, Option<String>);
    let mut renamed: Vec<(Who, String, String)> = Vec::new();
    plan.buckets.retain_mut(|b| {
        let in_force = base
            .get(&b.service)
            .and_then(|f| f.buckets.iter().find(|x| x.name == b.bucket.name));
        let mut proposed = b.bucket.clone();
        if let Some(h) = &b.held {
            proposed.limit_rps = h.proposed_limit_rps;
        }
        if !could_refuse_more(in_force, &proposed) {
            return true;
        }
        let fp = fingerprint(&b.service, &b.bucket.name, in_force, inputs);
        let Some(a) = aborted.iter().find(|a| {
            a.service == b.service
                && a.bucket == b.bucket.name
                && a.fingerprint == fp
                && proposed.limit_rps <= a.limit_rps
        }) else {
            return true;
        };
        let reason = format!(
            "{}: its rollout was aborted ({}); not proposed again until its inputs change",
            b.bucket.name, a.reason
        );
        if let Some(h) = &mut b.held {
            // The guard put back the limit only: the rest of the aborted change (a mode, a
            // scope) goes back to the spec in force too.
            renamed.push((
                (
                    b.service.clone(),
                    b.bucket.caller.clone(),
                    b.bucket.procedure.clone(),
                ),
                std::mem::replace(&mut h.reason, reason.clone()),
                reason,
            ));
            if let Some(cur) = in_force {
                b.bucket = cur.clone();
            }
            return true;
        }
        skipped.push(Skipped {
            service: b.service.clone(),
            caller: b.bucket.caller.clone(),
            procedure: b.bucket.procedure.clone(),
            reason: reason.clone(),
        });
        match in_force {
            Some(cur) => {
                b.held = Some(Held {
                    proposed_limit_rps: b.bucket.limit_rps,
                    reason,
                });
                b.bucket = cur.clone();
                true
            }
            None => false,
        }
    });
    for s in &mut plan.skipped {
        let who = (s.service.clone(), s.caller.clone(), s.procedure.clone());
        if let Some((_, _, new)) = renamed
            .iter()
            .find(|(w, old, _)| *w == who && *old == s.reason)
        {
            s.reason = new.clone();
        }
    }
    plan.skipped.extend(skipped);
    plan
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::PlannedBucket;

    fn bucket(limit: f64, mode: Mode) -> Bucket {
        Bucket {
            name: "charge".into(),
            caller: None,
            procedure: None,
            scope: Scope::Global,
            limit_rps: limit,
            mode,
            policy: schema::PolicyName::Peak,
        }
    }

    #[test]
    fn what_could_refuse_more() {
        let e = |l| bucket(l, Mode::Enforce);
        assert!(could_refuse_more(Some(&e(3470.0)), &e(100.0)));
        assert!(!could_refuse_more(Some(&e(100.0)), &e(3470.0)));
        assert!(could_refuse_more(
            Some(&bucket(100.0, Mode::Shadow)),
            &e(100.0)
        ));
        assert!(!could_refuse_more(None, &bucket(100.0, Mode::Shadow)));
        assert!(could_refuse_more(None, &e(100.0)));
        let mut g = e(100.0);
        let mut r = e(100.0);
        r.scope = Scope::Region;
        assert!(could_refuse_more(Some(&r), &g));
        assert!(!could_refuse_more(Some(&g), &r));
        g.caller = Some("web".into());
        assert!(could_refuse_more(Some(&e(100.0)), &g));
    }

    #[test]
    fn an_aborted_change_is_held_until_its_inputs_change() {
        let cur = bucket(3470.0, Mode::Enforce);
        let base: BTreeMap<String, BucketFile> = [(
            "pay".to_string(),
            BucketFile {
                criticality: Default::default(),
                service: "pay".into(),
                buckets: vec![cur.clone()],
            },
        )]
        .into();
        let plan = Plan {
            buckets: vec![PlannedBucket {
                service: "pay".into(),
                bucket: bucket(100.0, Mode::Enforce),
                current_limit_rps: Some(3470.0),
                evidence: Default::default(),
                held: None,
            }],
            ..Plan::default()
        };
        let aborted = vec![Aborted {
            service: "pay".into(),
            bucket: "charge".into(),
            fingerprint: fingerprint("pay", "charge", Some(&cur), "in1"),
            limit_rps: 100.0,
            reason: "33 % virtual drops".into(),
        }];
        let held = hold_aborted(plan.clone(), &base, "in1", &aborted);
        assert_eq!(held.buckets[0].bucket.limit_rps, 3470.0);
        assert_eq!(
            held.buckets[0].held.as_ref().unwrap().proposed_limit_rps,
            100.0
        );
        assert!(held.skipped[0]
            .reason
            .contains("rollout was aborted (33 % virtual drops)"));
        // Held already by the decrease guard (the aborted change's own commit was a
        // decrease): the reason names the abort, not the guard.
        let mut guarded = plan.clone();
        let guard_reason = "already lowered at 2026-12-05 10:00 UTC per the config repo history";
        guarded.buckets[0].bucket.limit_rps = 3470.0;
        guarded.buckets[0].held = Some(Held {
            proposed_limit_rps: 100.0,
            reason: guard_reason.into(),
        });
        guarded.skipped.push(Skipped {
            service: "pay".into(),
            caller: None,
            procedure: None,
            reason: guard_reason.into(),
        });
        // The guard put back the limit only; the aborted change also widened the scope.
        guarded.buckets[0].bucket.scope = Scope::Region;
        let named = hold_aborted(guarded, &base, "in1", &aborted);
        assert_eq!(named.buckets[0].bucket, cur, "the whole spec in force");
        let h = named.buckets[0].held.as_ref().unwrap();
        assert_eq!(h.proposed_limit_rps, 100.0);
        assert!(
            h.reason
                .contains("rollout was aborted (33 % virtual drops)"),
            "{h:?}"
        );
        assert_eq!(named.skipped.len(), 1, "{:?}", named.skipped);
        assert_eq!(named.skipped[0].reason, h.reason);
        // A higher proposal is another change.
        let mut higher = plan.clone();
        higher.buckets[0].bucket.limit_rps = 3000.0;
        let tried = hold_aborted(higher, &base, "in1", &aborted);
        assert_eq!(tried.buckets[0].bucket.limit_rps, 3000.0);
        // Other inputs: proposed again.
        let again = hold_aborted(plan, &base, "in2", &aborted);
        assert_eq!(again.buckets[0].bucket.limit_rps, 100.0);
        assert!(again.skipped.is_empty());
    }
}
