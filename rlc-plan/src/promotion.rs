//! The shadow-mode lifecycle inside a run: which shadow buckets are proposed for
//! `mode: enforce` (the `promotion:` rule of `rlc/policies.yaml` applied to their shadow figures,
//! [`crate::readiness`]), and which changes direct mode may commit without review
//! (`promotion.auto_merge`).
//!
//! The shadow figures are an input (gathered by whoever plans, from rlc's store): a candidate
//! without figures has no data, and no data is never ready: it is not promoted.

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Utc};
use schema::{BucketFile, ChangeClass, Mode, PoliciesFile, PromotionRule};

use crate::change::{self as summary, BucketChange, ChangeKind};
use crate::evidence::{Evidence, PromotionEvidence, ShadowFigures};
use crate::plan::{NeedsReview, Plan, PlannedBucket, PromotionNote};
use crate::readiness::{self, Rule, ShadowStats, Verdict};

/// How a promotion shows as a mode change (preview table, JSON, quota API).
pub const PROMOTED_MODE: &str = "shadow → enforce";

/// `(service, bucket)`.
pub type BucketKey = (String, String);

/// The promotion rule of `service` in `rlc/policies.yaml` (`promotion.default` merged under
/// `promotion.services.<service>`); `None` without a `promotion:` section. The one place the
/// rule is resolved: a run ([`rules`]) and the dashboard ([`readiness_rule`]) both call it.
pub fn rule_of(policies: Option<&PoliciesFile>, service: &str) -> Option<PromotionRule> {
    policies?.promotion_for(service)
}

/// The readiness rule of `service`: its promotion rule ([`rule_of`]) when
/// `rlc/policies.yaml` has a `promotion:` section, else the default rule; and whether it came
/// from the file.
pub fn readiness_rule(policies: Option<&PoliciesFile>, service: &str) -> (Rule, bool) {
    match rule_of(policies, service) {
        Some(r) => (Rule::from(&r), true),
        None => (Rule::default(), false),
    }
}

/// The promotion rule of every service, from the base's `rlc/policies.yaml` (empty without a
/// `promotion:` section).
pub fn rules(
    policies: Option<&PoliciesFile>,
    services: &BTreeSet<String>,
) -> BTreeMap<String, PromotionRule> {
    services
        .iter()
        .filter_map(|s| rule_of(policies, s).map(|r| (s.clone(), r)))
        .collect()
}

/// The planned buckets that may be promoted: in shadow in the repo and in the plan, in a
/// service with promotion enabled and no `mode` of its own in `rlc/policies.yaml` (an explicit
/// mode always wins).
pub fn candidates(
    plan: &Plan,
    base: &BTreeMap<String, BucketFile>,
    policies: Option<&PoliciesFile>,
    rules: &BTreeMap<String, PromotionRule>,
) -> Vec<BucketKey> {
    plan.buckets
        .iter()
        .filter(|b| b.bucket.mode == Mode::Shadow)
        .filter(|b| rules.get(&b.service).is_some_and(|r| r.enabled))
        .filter(|b| policies.is_none_or(|p| p.for_service(&b.service).mode.is_none()))
        .filter(|b| {
            base.get(&b.service).is_some_and(|f| {
                f.buckets
                    .iter()
                    .any(|c| c.name == b.bucket.name && c.mode == Mode::Shadow)
            })
        })
        .map(|b| (b.service.clone(), b.bucket.name.clone()))
        .collect()
}

/// The base's bucket files and policies of a loaded config repo, as `propose` takes them.
pub fn repo_inputs(
    repo: &schema::ConfigRepo,
) -> (BTreeMap<String, BucketFile>, Option<PoliciesFile>) {
    (
        repo.buckets
            .values()
            .map(|f| (f.value.service.clone(), f.value.clone()))
            .collect(),
        repo.policies.as_ref().map(|p| p.value.clone()),
    )
}

/// Buckets the plan switches from shadow to enforce without the promotion rule (a `mode:
/// enforce` set by hand in `rlc/policies.yaml`): their evidence gets the shadow figures the
/// rule would have read, or says there are none, so that the reviewer sees what the bucket
/// would have dropped before it drops anything.
pub fn annotate_manual(
    plan: &mut Plan,
    base: &BTreeMap<String, BucketFile>,
    policies: Option<&PoliciesFile>,
    stats: &BTreeMap<BucketKey, ShadowStats>,
    missing: &str,
    now: DateTime<Utc>,
) {
    for pb in plan.buckets.iter_mut() {
        if pb.bucket.mode != Mode::Enforce || pb.evidence.promotion.is_some() {
            continue;
        }
        let was_shadow = base.get(&pb.service).is_some_and(|f| {
            f.buckets
                .iter()
                .any(|b| b.name == pb.bucket.name && b.mode == Mode::Shadow)
        });
        if !was_shadow {
            continue;
        }
        let key = (pb.service.clone(), pb.bucket.name.clone());
        let rule = readiness_rule(policies, &pb.service).0;
        let verdict = match stats.get(&key) {
            Some(s) => readiness::verdict(s, &rule, now),
            None => Verdict::NotYet {
                reasons: vec![missing.to_string()],
            },
        };
        pb.evidence.promotion = Some(PromotionEvidence {
            promoted: true,
            reason: format!(
                "mode: enforce set by hand (rlc/policies.yaml), not by the promotion rule; the rule would say: {}",
                verdict.describe()
            ),
            verdict,
            figures: stats.get(&key).map(|s| ShadowFigures::of(s, now)),
        });
    }
}

/// Why a candidate without figures is not ready when the source answered.
pub const NO_REPORTS: &str = "no shadow reports";

/// Applies the verdicts to `plan`: ready candidates get `mode: enforce`; every candidate gets
/// `evidence.promotion` (verdict, reason, days in shadow, coverage, virtual-drop share, peak
/// drop share and minute, suggested limit, window); a candidate without figures is not yet
/// ready, for the reason `missing` ([`NO_REPORTS`], or why the source could not say). Returns
/// one note per candidate.
pub fn apply(
    plan: &mut Plan,
    candidates: &[BucketKey],
    rules: &BTreeMap<String, PromotionRule>,
    stats: &BTreeMap<BucketKey, ShadowStats>,
    missing: &str,
    now: DateTime<Utc>,
) -> Vec<PromotionNote> {
    let mut notes = Vec::new();
    for key in candidates {
        let Some(rule) = rules.get(&key.0) else {
            continue;
        };
        let rule = Rule::from(rule);
        let Some(pb) = plan
            .buckets
            .iter_mut()
            .find(|b| b.service == key.0 && b.bucket.name == key.1)
        else {
            continue;
        };
        let verdict = match stats.get(key) {
            Some(s) => readiness::verdict(s, &rule, now),
            None => Verdict::NotYet {
                reasons: vec![missing.to_string()],
            },
        };
        let promoted = verdict == Verdict::Ready;
        let reason = verdict.describe();
        pb.evidence.promotion = Some(PromotionEvidence {
            promoted,
            verdict: verdict.clone(),
            reason: reason.clone(),
            figures: stats.get(key).map(|s| ShadowFigures::of(s, now)),
        });
        if promoted {
            pb.bucket.mode = Mode::Enforce;
        }
        notes.push(PromotionNote {
            service: key.0.clone(),
            bucket: key.1.clone(),
            promoted,
            verdict,
            reason,
        });
    }
    notes
}

/// The class of one change, riskiest reading first: a new bucket enforcing at once, a
/// promotion (shadow → enforce, whatever the limit did), another mode, scope or match change,
/// a removal, a decrease, a raise, a new shadow bucket, or only the provenance.
pub fn classify(c: &BucketChange, throttled: bool) -> ChangeClass {
    match c.kind {
        // A raise of an enforced bucket its limit throttled in the window: growth or a storm
        // the rails did not recognise; a person looks first.
        ChangeKind::Raised if throttled && c.old_mode == Some(Mode::Enforce) => {
            ChangeClass::ThrottledRaise
        }
        ChangeKind::Added if c.new_mode == Some(Mode::Enforce) => ChangeClass::NewEnforcing,
        ChangeKind::Added => ChangeClass::NewShadow,
        ChangeKind::Removed => ChangeClass::Removal,
        _ if c.mode_changed() && c.new_mode == Some(Mode::Enforce) => ChangeClass::Promotion,
        _ if c.mode_changed() || c.scope_changed() || c.match_changed => {
            ChangeClass::ModeOrScopeChange
        }
        ChangeKind::Lowered => ChangeClass::Decrease,
        ChangeKind::Raised => ChangeClass::Raise,
        _ => ChangeClass::Other,
    }
}

/// The changes of `plan` that direct mode may not commit: every change (against `base`) whose
/// class is not in its service's `auto_merge`. Services without a rule commit everything but
/// a throttled raise (an enforced bucket raised after its limit refused demand).
pub fn review_list(
    plan: &Plan,
    base: &BTreeMap<String, BucketFile>,
    rules: &BTreeMap<String, PromotionRule>,
) -> Vec<NeedsReview> {
    let diff = summary::diff(base, &plan.bucket_files());
    let mut review = Vec::new();
    for s in &diff.services {
        let rule = rules.get(&s.service);
        for c in &s.changes {
            let class = classify(c, throttled_in(plan, &s.service, &c.bucket));
            let allowed = match rule {
                Some(r) => r.auto_merge.contains(&class),
                None => class != ChangeClass::ThrottledRaise,
            };
            if !allowed {
                review.push(NeedsReview {
                    service: s.service.clone(),
                    bucket: c.bucket.clone(),
                    class,
                    change: summary::describe(c),
                });
            }
        }
    }
    review
}

/// Whether the planned bucket `service/bucket` was throttled in the window.
pub fn throttled_in(plan: &Plan, service: &str, bucket: &str) -> bool {
    plan.buckets
        .iter()
        .find(|b| b.service == service && b.bucket.name == bucket)
        .is_some_and(|b| b.evidence.throttled.is_some())
}

/// What direct mode commits of `plan`: every change in `plan.needs_review` kept as in `base`
/// (a changed bucket as it was, an added one left out, a removed one kept).
pub fn committable(plan: &Plan, base: &BTreeMap<String, BucketFile>) -> Plan {
    let mut direct = plan.clone();
    for r in &plan.needs_review {
        let old = base
            .get(&r.service)
            .and_then(|f| f.buckets.iter().find(|b| b.name == r.bucket));
        let pos = direct
            .buckets
            .iter()
            .position(|b| b.service == r.service && b.bucket.name == r.bucket);
        match (old, pos) {
            // Changed: keep the base's bucket.
            (Some(o), Some(i)) => direct.buckets[i].bucket = o.clone(),
            // Added: leave it out.
            (None, Some(i)) => {
                direct.buckets.remove(i);
            }
            // Removed: keep it.
            (Some(o), None) => direct.buckets.push(PlannedBucket {
                service: r.service.clone(),
                bucket: o.clone(),
                current_limit_rps: Some(o.limit_rps),
                evidence: Evidence::kept("removal waits for review"),
                held: None,
            }),
            (None, None) => {}
        }
    }
    direct
        .buckets
        .sort_by(|a, b| (&a.service, &a.bucket.name).cmp(&(&b.service, &b.bucket.name)));
    direct.needs_review.clear();
    direct
}

/// The shadow buckets of `repo` (the base) that a plan could promote: in shadow, in a service
/// with promotion enabled and no `mode` of its own in `rlc/policies.yaml`, with the window
/// their figures are read over (the rule's `min_days_in_shadow`, at least a day). Whoever
/// plans gathers their figures first.
pub fn base_candidates(repo: &schema::ConfigRepo) -> Vec<(BucketKey, chrono::Duration)> {
    let policies = repo.policies.as_ref().map(|p| &p.value);
    let mut out = Vec::new();
    for f in repo.buckets.values() {
        let service = &f.value.service;
        // A service whose `mode: enforce` is set by hand enforces its shadow buckets without
        // the promotion rule: their figures go with the change, for the reviewer.
        let manual = policies.is_some_and(|p| p.for_service(service).mode == Some(Mode::Enforce));
        let days = match rule_of(policies, service).filter(|r| r.enabled) {
            _ if manual => readiness_rule(policies, service).0.min_days_in_shadow,
            Some(_) if policies.is_some_and(|p| p.for_service(service).mode.is_some()) => continue,
            Some(rule) => rule.min_days_in_shadow,
            None => continue,
        };
        let secs = (days.max(1.0) * 86_400.0).ceil() as i64;
        for b in f.value.buckets.iter().filter(|b| b.mode == Mode::Shadow) {
            out.push((
                (service.clone(), b.name.clone()),
                chrono::Duration::seconds(secs),
            ));
        }
    }
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Duration;
    use schema::PromotionSpec;

    fn planned(service: &str, name: &str, limit: f64) -> PlannedBucket {
        PlannedBucket {
            service: service.into(),
            bucket: schema::Bucket {
                name: name.into(),
                caller: Some(name.into()),
                procedure: None,
                scope: schema::Scope::Global,
                limit_rps: limit,
                mode: Mode::Enforce,
                policy: schema::PolicyName::Peak,
            },
            current_limit_rps: None,
            evidence: Evidence::default(),
            held: None,
        }
    }

    fn stats(
        service: &str,
        bucket: &str,
        now: DateTime<Utc>,
        days: i64,
        share: f64,
    ) -> ShadowStats {
        ShadowStats {
            service: service.into(),
            bucket: bucket.into(),
            mode: "shadow".into(),
            window_start: now - Duration::days(7),
            window_end: now,
            shadow_since: Some(now - Duration::days(days)),
            last_report: Some(now - Duration::minutes(1)),
            coverage: 0.99,
            offered: 1e6,
            virtual_dropped: 1e6 * share,
            dropped: 0.0,
            peak_drop_share: share * 3.0,
            peak_drop_at: Some(now - Duration::days(2)),
            limit_rps: 100.0,
            suggested_limit_rps: Some(80.0),
        }
    }

    fn shadow(service: &str, name: &str, limit: f64) -> PlannedBucket {
        let mut b = planned(service, name, limit);
        b.bucket.mode = Mode::Shadow;
        b.current_limit_rps = Some(limit);
        b
    }

    /// A shadow bucket enforced by a hand-set `mode: enforce` carries the figures the rule
    /// would have read (or says there are none); a bucket that was enforced already gets
    /// nothing.
    #[test]
    fn a_hand_set_enforce_carries_the_shadow_figures_or_says_there_are_none() {
        let now = Utc::now();
        let base_plan = Plan {
            buckets: vec![
                shadow("pay", "a", 100.0),
                shadow("pay", "b", 100.0),
                planned("pay", "c", 100.0),
            ],
            ..Plan::default()
        };
        let base: BTreeMap<String, BucketFile> =
            [("pay".to_string(), base_plan.bucket_files().remove(0))].into();
        let mut plan = Plan {
            buckets: vec![
                planned("pay", "a", 100.0),
                planned("pay", "b", 100.0),
                planned("pay", "c", 100.0),
            ],
            ..Plan::default()
        };
        let stats: BTreeMap<BucketKey, ShadowStats> =
            [(("pay".into(), "a".into()), stats("pay", "a", now, 8, 0.02))].into();
        annotate_manual(&mut plan, &base, None, &stats, NO_REPORTS, now);
        let a = plan.buckets[0].evidence.promotion.as_ref().unwrap();
        assert!(
            a.reason.starts_with("mode: enforce set by hand"),
            "{}",
            a.reason
        );
        assert!(a.reason.contains("would throttle"), "{}", a.reason);
        assert!((a.figures.as_ref().unwrap().virtual_drop_share - 0.02).abs() < 1e-9);
        let b = plan.buckets[1].evidence.promotion.as_ref().unwrap();
        assert!(
            b.figures.is_none() && b.reason.contains(NO_REPORTS),
            "{}",
            b.reason
        );
        assert!(plan.buckets[2].evidence.promotion.is_none());
    }

    #[test]
    fn only_ready_buckets_are_promoted_and_every_candidate_gets_its_reason() {
        let now = Utc::now();
        let mut plan = Plan {
            buckets: vec![
                shadow("pay", "a", 100.0),
                shadow("pay", "b", 100.0),
                shadow("pay", "c", 100.0),
            ],
            ..Plan::default()
        };
        let base: BTreeMap<String, BucketFile> =
            [("pay".to_string(), plan.bucket_files().remove(0))].into();
        let rules: BTreeMap<String, PromotionRule> =
            [("pay".to_string(), PromotionSpec::default().resolved())].into();
        let cands = candidates(&plan, &base, None, &rules);
        assert_eq!(cands.len(), 3);
        let stats: BTreeMap<BucketKey, ShadowStats> = [
            (("pay".into(), "a".into()), stats("pay", "a", now, 8, 1e-6)),
            (("pay".into(), "b".into()), stats("pay", "b", now, 8, 0.02)),
        ]
        .into();
        let notes = apply(&mut plan, &cands, &rules, &stats, NO_REPORTS, now);
        let got: Vec<(&str, bool, &str)> = notes
            .iter()
            .map(|n| (n.bucket.as_str(), n.promoted, n.reason.as_str()))
            .collect();
        assert_eq!(
            got,
            [
                ("a", true, "ready"),
                ("b", false, "would throttle 2.000% of requests"),
                ("c", false, "not yet: no shadow reports"),
            ]
        );
        assert_eq!(plan.buckets[0].bucket.mode, Mode::Enforce);
        assert_eq!(plan.buckets[1].bucket.mode, Mode::Shadow);
        let ev = plan.buckets[0].evidence.promotion.as_ref().unwrap();
        let figures = ev.figures.as_ref().unwrap();
        assert_eq!(figures.days_in_shadow, 8.0);
        assert_eq!(figures.suggested_limit_rps, Some(80.0));
        assert_eq!(ev.verdict, Verdict::Ready);
        // As the preview JSON shows it.
        let json = serde_json::to_value(ev).unwrap();
        assert_eq!(json["verdict"]["verdict"], "ready");
        assert_eq!(json["days_in_shadow"], 8.0);
        // An explicit mode in policies.yaml wins: no candidates.
        let policies: PoliciesFile = schema::parse_str(
            std::path::Path::new("p.yaml"),
            "default:\n  policy: peak\nservices:\n  pay:\n    mode: shadow\npromotion: {}\n",
        )
        .unwrap()
        .value;
        assert!(candidates(&plan, &base, Some(&policies), &rules).is_empty());
    }

    #[test]
    fn direct_mode_keeps_what_auto_merge_does_not_allow() {
        let mut old = planned("pay", "a", 100.0);
        old.bucket.mode = Mode::Shadow;
        let base_plan = Plan {
            buckets: vec![
                old.clone(),
                planned("pay", "b", 100.0),
                planned("pay", "gone", 5.0),
            ],
            ..Plan::default()
        };
        let base: BTreeMap<String, BucketFile> =
            [("pay".to_string(), base_plan.bucket_files().remove(0))].into();
        let mut promoted = old.clone();
        promoted.bucket.mode = Mode::Enforce;
        let mut plan = Plan {
            buckets: vec![
                promoted,
                planned("pay", "b", 150.0),
                planned("pay", "new", 10.0),
            ],
            ..Plan::default()
        };
        let rules: BTreeMap<String, PromotionRule> =
            [("pay".to_string(), PromotionSpec::default().resolved())].into();
        plan.needs_review = review_list(&plan, &base, &rules);
        let direct = committable(&plan, &base);
        let classes: Vec<(&str, ChangeClass)> = plan
            .needs_review
            .iter()
            .map(|r| (r.bucket.as_str(), r.class))
            .collect();
        assert_eq!(
            classes,
            [
                ("a", ChangeClass::Promotion),
                ("gone", ChangeClass::Removal),
                ("new", ChangeClass::NewEnforcing),
            ]
        );
        let d = summary::diff(&base, &direct.bucket_files());
        assert_eq!(d.counts_line(), "raised 1", "{d:?}");
    }
}
