//! The shadow figures of promotion candidates, from rlc's store: the seam ([`ShadowSource`])
//! through which a run asks for them, and [`propose`], which applies the verdicts of
//! [`rlc_plan::promotion`] to a plan.

use std::collections::BTreeMap;
use std::sync::Arc;

use chrono::{DateTime, Duration, Utc};
use rlc_plan::plan::Plan;
use rlc_plan::readiness::ShadowStats;
use schema::{BucketFile, PoliciesFile, PromotionRule};

pub use rlc_plan::promotion::*;

use crate::cycle::BoxFuture;

/// What a [`ShadowSource`] is asked: the figures of `buckets` over `[window_start, now]`.
#[derive(Debug, Clone, PartialEq)]
pub struct ShadowQuery {
    /// The buckets.
    pub buckets: Vec<BucketKey>,
    /// Start of the window.
    pub window_start: DateTime<Utc>,
    /// End of the window.
    pub now: DateTime<Utc>,
}

/// The seam to the shadow-report store: the figures of each asked bucket that has any (a
/// bucket without reports is left out of the map, or given with `last_report: None`).
pub type ShadowSource = Arc<
    dyn Fn(ShadowQuery) -> BoxFuture<anyhow::Result<BTreeMap<BucketKey, ShadowStats>>>
        + Send
        + Sync,
>;

/// The shadow figures of `q` from rlc's store: the seam the cycle uses when no other
/// [`ShadowSource`] is set.
///
/// The store's per-minute roll-ups ([`crate::store::Store::shadow_stats`]), one bucket at a
/// time (candidates are only the buckets in shadow); a bucket the store has no report of is
/// left out, and so is not promoted.
pub async fn store_stats(
    store: &crate::store::Store,
    q: &ShadowQuery,
) -> anyhow::Result<BTreeMap<BucketKey, ShadowStats>> {
    let mut out = BTreeMap::new();
    for (service, bucket) in &q.buckets {
        if let Some(s) = store
            .shadow_stats(service, bucket, q.window_start, q.now)
            .await?
        {
            out.insert((service.clone(), bucket.clone()), s);
        }
    }
    Ok(out)
}

/// Asks `source` for the figures of `candidates`, one query per window length (each service's
/// `min_days_in_shadow`, at least one day). A failed source gives no figures (never ready), and
/// its error.
pub async fn fetch_stats(
    source: &ShadowSource,
    candidates: &[BucketKey],
    rules: &BTreeMap<String, PromotionRule>,
    now: DateTime<Utc>,
) -> (BTreeMap<BucketKey, ShadowStats>, Option<String>) {
    let mut by_window: BTreeMap<i64, Vec<BucketKey>> = BTreeMap::new();
    for k in candidates {
        let days = rules
            .get(&k.0)
            .map_or(7.0, |r| r.min_days_in_shadow)
            .max(1.0);
        by_window
            .entry((days * 86_400.0).ceil() as i64)
            .or_default()
            .push(k.clone());
    }
    let mut out = BTreeMap::new();
    let mut error = None;
    for (secs, buckets) in by_window {
        let q = ShadowQuery {
            buckets,
            window_start: now - Duration::seconds(secs),
            now,
        };
        match source(q).await {
            Ok(m) => out.extend(m),
            Err(e) => {
                tracing::warn!(error = %e, "shadow figures unavailable: nothing promoted");
                error = Some(format!("{e:#}"));
            }
        }
    }
    (out, error)
}

/// What a run does to `plan` before it is written, and what `rlc preview` and
/// `GET /v1/quotas` show of it: the promotion rules of `policies` ([`rules`]), the candidates
/// among the shadow buckets of `base` ([`candidates`]), their figures from `source` (an error
/// instead of a source: nothing is promoted, and the error is returned) and the verdicts
/// ([`apply`]). Returns the rules, one note per candidate and the source's error.
pub async fn propose<F>(
    plan: &mut Plan,
    base: &BTreeMap<String, BucketFile>,
    policies: Option<&PoliciesFile>,
    source: impl FnOnce() -> F,
    now: DateTime<Utc>,
) -> (
    BTreeMap<String, PromotionRule>,
    Vec<PromotionNote>,
    Option<String>,
)
where
    F: std::future::Future<Output = Result<ShadowSource, String>>,
{
    let services = plan.buckets.iter().map(|b| b.service.clone()).collect();
    let rules = rules(policies, &services);
    let candidates = candidates(plan, base, policies, &rules);
    if candidates.is_empty() {
        return (rules, Vec::new(), None);
    }
    let (stats, error) = match source().await {
        Ok(source) => fetch_stats(&source, &candidates, &rules, now).await,
        Err(e) => (BTreeMap::new(), Some(e)),
    };
    // A bucket without figures because the source failed says so, not "no shadow reports".
    let missing = match &error {
        Some(e) => format!("shadow figures unavailable: {e}"),
        None => NO_REPORTS.to_string(),
    };
    let notes = apply(plan, &candidates, &rules, &stats, &missing, now);
    (rules, notes, error)
}

/// A [`ShadowSource`] over rlc's store ([`store_stats`]).
pub fn store_source(store: crate::store::Store) -> ShadowSource {
    Arc::new(move |q: ShadowQuery| {
        let store = store.clone();
        Box::pin(async move { store_stats(&store, &q).await }) as BoxFuture<_>
    })
}

/// The [`ShadowSource`] of a [`crate::planner::StoreWitness`]: the store's figures; none at
/// all for a store that does not exist yet (nothing is ready); the reason for one that cannot
/// be read (nothing is promoted).
pub fn witness_source(store: &crate::planner::StoreWitness) -> Result<ShadowSource, String> {
    match store {
        crate::planner::StoreWitness::Store(s) => Ok(store_source(s.clone())),
        crate::planner::StoreWitness::Empty => Ok(Arc::new(|_q: ShadowQuery| {
            Box::pin(async { Ok(BTreeMap::new()) }) as BoxFuture<_>
        })),
        crate::planner::StoreWitness::Unavailable(e) => Err(format!("store unavailable: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gitops::tests::planned;
    use schema::{Mode, PromotionSpec};

    fn shadow(service: &str, name: &str, limit: f64) -> rlc_plan::plan::PlannedBucket {
        let mut b = planned(service, name, limit);
        b.bucket.mode = Mode::Shadow;
        b.current_limit_rps = Some(limit);
        b
    }

    #[tokio::test]
    async fn a_failing_shadow_source_promotes_nothing_and_says_why() {
        let now = Utc::now();
        let mut plan = Plan {
            buckets: vec![shadow("pay", "a", 100.0)],
            ..Plan::default()
        };
        let rules: BTreeMap<String, PromotionRule> =
            [("pay".to_string(), PromotionSpec::default().resolved())].into();
        let cands = vec![("pay".to_string(), "a".to_string())];
        let asked = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = asked.clone();
        let source: ShadowSource = Arc::new(move |q: ShadowQuery| {
            seen.lock()
                .unwrap()
                .push((q.now - q.window_start).num_days());
            Box::pin(async { Err(anyhow::anyhow!("shadow store down")) })
        });
        let (stats, err) = fetch_stats(&source, &cands, &rules, now).await;
        assert_eq!(err.as_deref(), Some("shadow store down"));
        assert_eq!(
            *asked.lock().unwrap(),
            [7],
            "one query over the rule's 7 days"
        );
        assert!(stats.is_empty());
        // Through `propose`, as runs and the quota API call it: the reason is the failure,
        // not "no shadow reports".
        let base: BTreeMap<String, BucketFile> =
            [("pay".to_string(), plan.bucket_files().remove(0))].into();
        let policies: PoliciesFile = schema::parse_str(
            std::path::Path::new("p.yaml"),
            "default:\n  policy: peak\npromotion: {}\n",
        )
        .unwrap()
        .value;
        let (_, notes, error) = propose(
            &mut plan,
            &base,
            Some(&policies),
            || async { Err("store unavailable: not connected yet".to_string()) },
            now,
        )
        .await;
        assert_eq!(
            error.as_deref(),
            Some("store unavailable: not connected yet")
        );
        assert!(!notes[0].promoted);
        assert_eq!(
            notes[0].reason,
            "not yet: shadow figures unavailable: store unavailable: not connected yet"
        );
        assert_eq!(plan.buckets[0].bucket.mode, Mode::Shadow);
        assert_eq!(
            plan.buckets[0].evidence.promotion.as_ref().map(|p| &p.verdict),
            Some(&rlc_plan::readiness::Verdict::NotYet {
                reasons: vec!["shadow figures unavailable: store unavailable: not connected yet".into()]
            })
        );
    }
}
