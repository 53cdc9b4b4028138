//! The decrease guard: a bucket is lowered at most once per `rails.decrease_interval`, so that
//! the per-run cap (`rails.max_decrease`) does not compound over frequent runs.
//!
//! It decides on evidence gathered before planning ([`Decreases`]): when each bucket was last
//! lowered, according to two witnesses, either of which holds a decrease:
//! - the config repo's history (the base branch's first-parent history of
//!   `buckets/<service>.yaml`): it records every change that reached the base branch, whoever
//!   made it, and survives the loss of rlc's store;
//! - rlc's store: the decreases it applied (committed on the base branch, or merged), also
//!   those whose commit was later reverted. A decrease only proposed on the pull-request
//!   branch is not one: it has not been applied.
//!
//! A witness that cannot say (store down, history too long or unreadable) holds every
//! decrease: a failed dependency never lowers a quota.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::plan::{Held, Plan, Skipped};

/// What one witness knows of past decreases.
#[derive(Debug, Clone, PartialEq)]
pub enum Witness {
    /// When each bucket (`(service, bucket)`) was last lowered within the interval; a bucket
    /// not listed was not.
    Known(BTreeMap<(String, String), DateTime<Utc>>),
    /// It cannot say, and why: every decrease is held.
    Unknown(String),
}

impl Witness {
    /// A witness that saw no decrease.
    pub fn none() -> Witness {
        Witness::Known(BTreeMap::new())
    }
}

/// The evidence the guard decides on, gathered before planning.
#[derive(Debug, Clone, PartialEq)]
pub struct Decreases {
    /// The config repo's history of the base branch.
    pub git: Witness,
    /// rlc's store: applied decreases only.
    pub store: Witness,
}

impl Decreases {
    /// No decrease known to either witness (a first run; a backtest, which has no history of
    /// its own).
    pub fn none() -> Decreases {
        Decreases {
            git: Witness::none(),
            store: Witness::none(),
        }
    }
}

/// The start of the window the witnesses are asked about: `now - interval`.
pub fn since(interval: Duration, now: DateTime<Utc>) -> DateTime<Utc> {
    now - chrono::Duration::from_std(interval).unwrap_or(chrono::Duration::days(1))
}

fn at(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%d %H:%M UTC").to_string()
}

/// `plan` with every decrease of a bucket already lowered within `interval` held back: the
/// bucket keeps its current limit, `held` says what was proposed and why, and `skipped` lists
/// it. The config repo's history is asked first, then the store. Applying it twice changes
/// nothing (a held bucket no longer lowers). An interval of a second or less holds nothing.
pub fn hold_repeated_decreases(interval: Duration, decreases: &Decreases, plan: Plan) -> Plan {
    if interval.as_secs() <= 1 {
        return plan;
    }
    let label = humantime_like(interval);
    let mut out = plan;
    let mut skipped = Vec::new();
    for b in &mut out.buckets {
        let Some(cur) = b.current_limit_rps else {
            continue;
        };
        if b.bucket.limit_rps >= cur {
            continue;
        }
        let key = (b.service.clone(), b.bucket.name.clone());
        let waits = |when: DateTime<Utc>, source: &str| {
            format!(
                "already lowered at {} per {source} (one decrease per {label}): the decrease to {} rps waits",
                at(when),
                schema::format_rps(b.bucket.limit_rps)
            )
        };
        let by_git = match &decreases.git {
            Witness::Known(found) => found
                .get(&key)
                .map(|t| waits(*t, "the config repo history")),
            Witness::Unknown(e) => Some(format!("{e}: decrease held")),
        };
        let why = by_git.or_else(|| match &decreases.store {
            Witness::Known(found) => found.get(&key).map(|t| waits(*t, "the store")),
            Witness::Unknown(e) => Some(format!("{e}: decrease held")),
        });
        if let Some(reason) = why {
            skipped.push(Skipped {
                service: b.service.clone(),
                caller: b.bucket.caller.clone(),
                procedure: b.bucket.procedure.clone(),
                reason: reason.clone(),
            });
            b.held = Some(Held {
                proposed_limit_rps: b.bucket.limit_rps,
                reason,
            });
            b.bucket.limit_rps = cur;
        }
    }
    out.skipped.extend(skipped);
    out
}

/// `interval` as `rails.decrease_interval` is written (`1d`, `12h`, `90m`).
fn humantime_like(interval: Duration) -> String {
    schema::HumanDuration(interval).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::PlannedBucket;

    fn lowering(name: &str, from: f64, to: f64) -> PlannedBucket {
        PlannedBucket {
            service: "pay".into(),
            bucket: schema::Bucket {
                name: name.into(),
                caller: Some(name.into()),
                procedure: None,
                scope: schema::Scope::Global,
                limit_rps: to,
                mode: schema::Mode::Enforce,
                policy: schema::PolicyName::Peak,
            },
            current_limit_rps: Some(from),
            evidence: Default::default(),
            held: None,
        }
    }

    #[test]
    fn either_witness_holds_and_one_that_cannot_say_holds_everything() {
        let day = Duration::from_secs(86_400);
        let now = Utc::now();
        let plan = Plan {
            buckets: vec![
                lowering("a", 100.0, 75.0),
                lowering("b", 100.0, 75.0),
                lowering("c", 100.0, 75.0),
                lowering("up", 100.0, 150.0),
            ],
            ..Plan::default()
        };
        let key = |n: &str| ("pay".to_string(), n.to_string());
        let decreases = Decreases {
            git: Witness::Known([(key("a"), now)].into()),
            store: Witness::Known([(key("b"), now)].into()),
        };
        let out = hold_repeated_decreases(day, &decreases, plan.clone());
        let held: Vec<(&str, f64, bool)> = out
            .buckets
            .iter()
            .map(|b| (b.bucket.name.as_str(), b.bucket.limit_rps, b.held.is_some()))
            .collect();
        assert_eq!(
            held,
            [
                ("a", 100.0, true),
                ("b", 100.0, true),
                ("c", 75.0, false),
                ("up", 150.0, false)
            ]
        );
        assert!(out.buckets[0]
            .held
            .as_ref()
            .unwrap()
            .reason
            .contains("config repo history"));
        assert!(out.buckets[1]
            .held
            .as_ref()
            .unwrap()
            .reason
            .contains("per the store"));
        assert_eq!(out.skipped.len(), 2);
        // Idempotent.
        assert_eq!(hold_repeated_decreases(day, &decreases, out.clone()), out);

        let blind = Decreases {
            git: Witness::none(),
            store: Witness::Unknown("store unavailable (locked)".into()),
        };
        let out = hold_repeated_decreases(day, &blind, plan.clone());
        assert_eq!(out.buckets.iter().filter(|b| b.held.is_some()).count(), 3);
        assert_eq!(
            out.buckets[2].held.as_ref().unwrap().reason,
            "store unavailable (locked): decrease held"
        );
        // No interval: nothing held.
        let out = hold_repeated_decreases(Duration::ZERO, &blind, plan);
        assert!(out.buckets.iter().all(|b| b.held.is_none()));
    }
}
