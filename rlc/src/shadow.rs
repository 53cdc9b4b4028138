//! The shadow figures of promotion candidates, from rlc's store: the seam ([`ShadowSource`])
//! through which whoever plans gathers them ([`crate::gather::shadow`]) before
//! [`rlc_plan::promotion`] decides on them.

use std::collections::BTreeMap;
use std::sync::Arc;

use chrono::{DateTime, Utc};
#[cfg(test)]
use rlc_plan::plan::Plan;
use rlc_plan::readiness::ShadowStats;

use rlc_plan::promotion::BucketKey;

use crate::BoxFuture;

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
/// left out, and so is not promoted. While a region's controller cannot be read the figures
/// are incomplete: an error naming the region, so that nothing is promoted on part of the
/// fleet.
pub async fn store_stats(
    store: &crate::store::Store,
    q: &ShadowQuery,
) -> anyhow::Result<BTreeMap<BucketKey, ShadowStats>> {
    let unread = store.unread_regions().await?;
    if !unread.is_empty() {
        anyhow::bail!("{}", crate::store::UnreadRegion::sentence(&unread));
    }
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

/// A [`ShadowSource`] over rlc's store ([`store_stats`]).
pub fn store_source(store: crate::store::Store) -> ShadowSource {
    Arc::new(move |q: ShadowQuery| {
        let store = store.clone();
        Box::pin(async move { store_stats(&store, &q).await }) as BoxFuture<_>
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gitops::tests::planned;
    use rlc_plan::pipeline::{self, ShadowEvidence, World};
    use schema::Mode;

    /// A config repo on disk with `pay/a` in shadow and a promotion rule.
    fn repo(dir: &std::path::Path) -> schema::ConfigRepo {
        std::fs::create_dir_all(dir.join("rlc")).unwrap();
        std::fs::create_dir_all(dir.join("buckets")).unwrap();
        std::fs::write(
            dir.join("rlc/policies.yaml"),
            "default:\n  policy: peak\npromotion: {}\n",
        )
        .unwrap();
        std::fs::write(
            dir.join("buckets/pay.yaml"),
            "service: pay\nbuckets:\n  - name: a\n    caller: a\n    limit_rps: 100\n    mode: shadow\n    policy: peak\n",
        )
        .unwrap();
        let (repo, diags) = schema::ConfigRepo::load(dir);
        assert!(diags.is_empty(), "{}", schema::Diagnostics(diags));
        repo
    }

    #[tokio::test]
    async fn a_failing_shadow_source_promotes_nothing_and_says_why() {
        let now = Utc::now();
        let dir = tempfile::tempdir().unwrap();
        let repo = repo(dir.path());
        let asked = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = asked.clone();
        let source: ShadowSource = Arc::new(move |q: ShadowQuery| {
            seen.lock()
                .unwrap()
                .push((q.now - q.window_start).num_days());
            Box::pin(async { Err(anyhow::anyhow!("shadow store down")) })
        });
        let shadow = crate::gather::shadow(&repo, async { Ok(source) }, now).await;
        assert_eq!(
            *asked.lock().unwrap(),
            [7],
            "one query over the rule's 7 days"
        );
        assert_eq!(
            shadow,
            ShadowEvidence::Unavailable("shadow store down".into())
        );
        // A store that cannot be opened at all: nothing is asked.
        let shadow = crate::gather::shadow(
            &repo,
            async { Err(crate::gather::StoreUnavailable("not connected yet".into())) },
            now,
        )
        .await;
        // Planned on, as runs and the quota API do: the reason is the failure, not "no shadow
        // reports".
        let mut a = planned("pay", "a", 100.0);
        a.bucket.mode = Mode::Shadow;
        a.current_limit_rps = Some(100.0);
        let computed = Plan {
            buckets: vec![a],
            ..Plan::default()
        };
        let cfg: schema::DaemonConfig =
            serde_yaml::from_str("history:\n  file: h.csv\nconfig_repo:\n  path: repo\n").unwrap();
        let world = World {
            shadow,
            ..World::none()
        };
        let plan = pipeline::finish(&cfg, &repo, &world, computed, now);
        assert_eq!(
            plan.shadow_error.as_deref(),
            Some("store unavailable: not connected yet")
        );
        let notes = &plan.promotions;
        assert!(!notes[0].promoted);
        assert_eq!(
            notes[0].reason,
            "not yet: shadow figures unavailable: store unavailable: not connected yet"
        );
        assert_eq!(plan.buckets[0].bucket.mode, Mode::Shadow);
        assert_eq!(
            plan.buckets[0]
                .evidence
                .promotion
                .as_ref()
                .map(|p| &p.verdict),
            Some(&rlc_plan::readiness::Verdict::NotYet {
                reasons: vec![
                    "shadow figures unavailable: store unavailable: not connected yet".into()
                ]
            })
        );
    }
}
