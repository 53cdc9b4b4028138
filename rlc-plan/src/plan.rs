//! The result of one computation: proposed buckets with their evidence, and what was skipped.
//! `rlc preview` prints it, `rlc run` renders it into `buckets/<service>.yaml`.

use std::collections::BTreeMap;

use schema::{Bucket, BucketFile, ChangeClass};
use schemars::JsonSchema;

use crate::evidence::Evidence;
use crate::readiness::Verdict;
use serde::{Deserialize, Serialize};

/// All proposed buckets and all skipped series/services of one computation.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct Plan {
    /// Proposed buckets, sorted by service then name.
    pub buckets: Vec<PlannedBucket>,
    /// Series or services that keep their current quotas, with the reason.
    pub skipped: Vec<Skipped>,
    /// Services that keep their current quotas because their history failed or was
    /// incomplete (also listed in `skipped`): `rlc run`/`rlc preview` exit 4 when there are
    /// any, 1 when every service is.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history_failed: Vec<String>,
    /// Services with a series whose history is not plausible (a sample no instance could have
    /// sent): those buckets keep their quotas (listed in `skipped`), the service's other
    /// buckets are computed; `rlc run`/`rlc preview` exit 4.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history_refused: Vec<String>,
    /// Why the whole history source failed, when it did (every service keeps its quotas).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub history_error: Option<String>,
    /// The verdict on every shadow bucket that could be promoted (`promotion:` in
    /// `rlc/policies.yaml`): proposed for `mode: enforce`, or why it stays in shadow.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub promotions: Vec<PromotionNote>,
    /// Why the shadow figures could not be read (nothing was promoted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shadow_error: Option<String>,
    /// Direct mode: the changes `promotion.auto_merge` does not let rlc commit on the base
    /// branch (they go to review).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub needs_review: Vec<NeedsReview>,
}

/// The verdict on one shadow bucket in a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct PromotionNote {
    /// Callee service.
    pub service: String,
    /// Bucket name.
    pub bucket: String,
    /// Whether the run proposes `mode: enforce` for it.
    pub promoted: bool,
    /// The verdict of the rule.
    pub verdict: Verdict,
    /// The verdict in words (`ready`, `not yet: …`, `would throttle …`).
    pub reason: String,
}

/// A change direct mode may not commit: it waits for review.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct NeedsReview {
    /// Callee service.
    pub service: String,
    /// Bucket name.
    pub bucket: String,
    /// Its class.
    pub class: ChangeClass,
    /// The change in words.
    pub change: String,
}

/// One proposed bucket (flattened into the preview JSON shape).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct PlannedBucket {
    /// Callee service.
    pub service: String,
    /// The bucket as it will be written.
    #[serde(flatten)]
    pub bucket: Bucket,
    /// The limit in the config repo now, if any. `GET /v1/quotas` and `rlc preview` show the
    /// limit in force instead: the spec a rollout keeps in force while its candidate (the
    /// config repo's new value, in `candidate`) bakes, or after an abort until the config repo
    /// is back in line.
    pub current_limit_rps: Option<f64>,
    /// Which numbers, window and confidence produced the limit.
    pub evidence: Evidence,
    /// Set when a decrease is held back by the one-decrease-per-`rails.decrease_interval`
    /// guard: `limit_rps` is then the current limit (what the run writes), and this says what
    /// the policy and rails proposed and why it waits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held: Option<Held>,
}

/// A decrease the run would not apply yet.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, JsonSchema)]
pub struct Held {
    /// The limit the policy and rails proposed (lower than the current one).
    pub proposed_limit_rps: f64,
    /// Why it waits (the last decrease and who recorded it, or which witness could not say).
    pub reason: String,
}

/// A series or a whole service left as it is, and why.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, JsonSchema)]
pub struct Skipped {
    /// Callee service.
    pub service: String,
    /// Caller, when one series was skipped.
    pub caller: Option<String>,
    /// Procedure, when one series was skipped.
    pub procedure: Option<String>,
    /// Why, in words a service owner understands.
    pub reason: String,
}

impl Skipped {
    /// `service/caller/procedure`, leaving out what is absent.
    pub fn target(&self) -> String {
        [
            Some(self.service.as_str()),
            self.caller.as_deref(),
            self.procedure.as_deref(),
        ]
        .into_iter()
        .flatten()
        .collect::<Vec<_>>()
        .join("/")
    }
}

impl Plan {
    /// Whether no service could be computed because of its history: the source failed, or
    /// every service in the plan is in `history_failed`.
    pub fn history_failed_everywhere(&self) -> bool {
        if self.history_error.is_some() {
            return true;
        }
        if self.history_failed.is_empty() {
            return false;
        }
        self.buckets
            .iter()
            .map(|b| b.service.as_str())
            .chain(self.skipped.iter().map(|s| s.service.as_str()))
            .filter(|s| !s.is_empty() && *s != "*")
            .all(|s| self.history_failed.iter().any(|f| f == s))
    }

    /// The bucket files this plan renders to, one per service, sorted by service.
    pub fn bucket_files(&self) -> Vec<BucketFile> {
        let mut by_service: BTreeMap<&str, Vec<Bucket>> = BTreeMap::new();
        for b in &self.buckets {
            by_service
                .entry(b.service.as_str())
                .or_default()
                .push(b.bucket.clone());
        }
        by_service
            .into_iter()
            .map(|(service, mut buckets)| {
                buckets.sort_by(|a, b| a.name.cmp(&b.name));
                BucketFile {
                    criticality: Default::default(),
                    service: service.to_string(),
                    buckets,
                }
            })
            .collect()
    }
}
