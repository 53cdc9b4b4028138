//! The verdict on a candidate limit ([`crate::Candidate`]) from what it was seen doing:
//! pure, shared by whoever decides (`rlc serve` from the controllers' `GET /v1/candidates`)
//! and by `grl simulate` (the proof), so both decide alike.
//!
//! The rule, in order:
//! 1. **Abort** as soon as the candidate's virtual-drop share (`virtual_dropped / offered`)
//!    is above [`RolloutRule::max_virtual_drop_share`] and at least
//!    [`RolloutRule::min_offered`] requests were seen (enough to say so): not only at the end
//!    of the bake.
//! 2. **Promote** once baked for [`RolloutRule::bake`] with at least `min_offered` requests,
//!    the share at or below the bar, and every controller of the stage having evaluated the
//!    candidate for [`COVERAGE`] of the bake ([`Observed::covered`]): one controller's counts
//!    do not pass a stage for another that could not be read.
//! 3. **Abort** once the stage waited [`RolloutRule::max_bake`] (or `bake`, whichever is
//!    longer; [`Observed::waited`], counted from when the stage began, even if no controller
//!    ever got the candidate): never evaluated ("never ran"), with fewer than `min_offered`
//!    requests ("too little traffic"), or without every controller's counts ("no complete
//!    evidence"). A starved candidate, or one that never reached its controllers, does not
//!    hold a stage forever nor pass silently.
//! 4. Otherwise **Baking**.

use std::time::Duration;

/// How a candidate is baked and judged.
#[derive(Debug, Clone, PartialEq)]
pub struct RolloutRule {
    /// How long a candidate is watched before it may be promoted (default 1h).
    pub bake: Duration,
    /// The highest share of offered requests the candidate may have virtually dropped
    /// (default 0.0001).
    pub max_virtual_drop_share: f64,
    /// Requests the candidate must have seen before any verdict (default 1000).
    pub min_offered: f64,
    /// How long a candidate that saw fewer than `min_offered` requests waits before it is
    /// aborted (default 24h; never shorter than `bake`).
    pub max_bake: Duration,
}

impl Default for RolloutRule {
    fn default() -> Self {
        RolloutRule {
            bake: Duration::from_secs(3600),
            max_virtual_drop_share: 0.0001,
            min_offered: 1000.0,
            max_bake: Duration::from_secs(24 * 3600),
        }
    }
}

/// What a candidate was seen doing so far (in one stage: summed over its controllers).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Observed {
    /// How long it has been watched (since the candidate first reached a controller of the
    /// stage; zero when none ever got it).
    pub baked: Duration,
    /// How long the stage has waited for a verdict, since it began (when the rollout started
    /// or the previous stage passed), whether or not the candidate reached a controller:
    /// what [`RolloutRule::max_bake`] bounds. Never taken as shorter than `baked`.
    pub waited: Duration,
    /// Requests offered to its match.
    pub offered: f64,
    /// Requests its drop ratio would have dropped.
    pub virtual_dropped: f64,
    /// How long the stage's least-covered controller evaluated it (summed over that
    /// controller's processes): `baked` when one controller decides alone.
    pub covered: Duration,
}

/// The share of the bake every controller of a stage must have evaluated a candidate for
/// before it passes (its counts are read once in a while, so the newest lag a little).
pub const COVERAGE: f64 = 0.9;

impl Observed {
    /// `virtual_dropped / offered`; 0 when nothing was offered.
    pub fn share(&self) -> f64 {
        if self.offered > 0.0 {
            self.virtual_dropped / self.offered
        } else {
            0.0
        }
    }
}

/// The decision on a candidate.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// Keep watching.
    Baking,
    /// The candidate passed: it may become the limit in force.
    Promote,
    /// The candidate failed: the limit in force stays.
    Abort {
        /// Why, with the evidence (share, counts, bar).
        reason: String,
    },
}

/// Judges `seen` by `rule` (see the module doc for the order of the checks).
pub fn judge(rule: &RolloutRule, seen: &Observed) -> Verdict {
    let share = seen.share();
    let enough = seen.offered >= rule.min_offered;
    // NaN counts are never "under the bar".
    let over = !matches!(
        share.partial_cmp(&rule.max_virtual_drop_share),
        Some(std::cmp::Ordering::Less | std::cmp::Ordering::Equal)
    );
    if enough && over {
        return Verdict::Abort {
            reason: format!(
                "virtual-drop share {:.4}% is above the bar of {}% ({:.0} of {:.0} offered requests would have been refused after {}s)",
                share * 100.0,
                rule.max_virtual_drop_share * 100.0,
                seen.virtual_dropped,
                seen.offered,
                seen.baked.as_secs()
            ),
        };
    }
    let covered = seen.covered.as_secs_f64() >= COVERAGE * rule.bake.as_secs_f64();
    if enough && covered && seen.baked >= rule.bake {
        return Verdict::Promote;
    }
    let waited = seen.waited.max(seen.baked);
    if waited < rule.max_bake.max(rule.bake) {
        return Verdict::Baking;
    }
    if seen.baked.is_zero() {
        return Verdict::Abort {
            reason: format!(
                "never ran: no controller of the stage evaluated the candidate in the {}s the stage waited (max_bake {}s): it never reached them",
                waited.as_secs(),
                rule.max_bake.max(rule.bake).as_secs()
            ),
        };
    }
    if !enough {
        return Verdict::Abort {
            reason: format!(
                "too little traffic: {:.0} offered requests in {}s, fewer than the {:.0} required",
                seen.offered,
                seen.baked.as_secs(),
                rule.min_offered
            ),
        };
    }
    Verdict::Abort {
        reason: format!(
            "no complete evidence: a controller of the stage evaluated the candidate for {}s of the {}s bake (at least {:.0} % needed)",
            seen.covered.as_secs(),
            rule.bake.as_secs(),
            COVERAGE * 100.0
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(secs: u64, offered: f64, virtual_dropped: f64) -> Observed {
        Observed {
            baked: Duration::from_secs(secs),
            waited: Duration::from_secs(secs),
            offered,
            virtual_dropped,
            covered: Duration::from_secs(secs),
        }
    }

    /// The deadline counts from when the stage began, not from when the candidate reached a
    /// controller: a stage whose controllers never got it ends at `max_bake`, saying so.
    #[test]
    fn a_stage_ends_at_max_bake_after_it_began_even_if_never_evaluated() {
        let r = RolloutRule::default();
        let never = |waited| Observed {
            waited: Duration::from_secs(waited),
            ..Observed::default()
        };
        assert_eq!(judge(&r, &never(86_399)), Verdict::Baking);
        let v = judge(&r, &never(86_400));
        assert!(is_abort(&v, "never ran"), "{v:?}");
        // Reached late: baked 10 minutes of the day the stage waited, too little to judge.
        let late = Observed {
            waited: Duration::from_secs(86_400),
            ..seen(600, 500.0, 0.0)
        };
        assert!(is_abort(&judge(&r, &late), "too little traffic"));
        let late_busy = Observed {
            waited: Duration::from_secs(86_400),
            ..seen(600, 1e6, 0.0)
        };
        assert!(is_abort(&judge(&r, &late_busy), "no complete evidence"));
        // A waited shorter than baked (a caller that leaves it unset) is the bake.
        let unset = Observed {
            waited: Duration::ZERO,
            ..seen(86_400, 999.0, 0.0)
        };
        assert!(is_abort(&judge(&r, &unset), "too little traffic"));
    }

    #[test]
    fn a_stage_passes_only_once_every_controller_covered_the_bake() {
        let r = RolloutRule::default();
        let partial = |covered| Observed {
            covered: Duration::from_secs(covered),
            ..seen(3600, 1e6, 0.0)
        };
        assert_eq!(judge(&r, &partial(3240)), Verdict::Promote);
        assert_eq!(judge(&r, &partial(3239)), Verdict::Baking);
        let late = Observed {
            baked: Duration::from_secs(86_400),
            ..partial(0)
        };
        assert!(is_abort(&judge(&r, &late), "no complete evidence"));
        // Enough evidence of too many drops aborts whatever the coverage.
        assert!(is_abort(
            &judge(
                &r,
                &Observed {
                    covered: Duration::ZERO,
                    ..seen(10, 1500.0, 500.0)
                }
            ),
            "above the bar"
        ));
    }

    fn is_abort(v: &Verdict, word: &str) -> bool {
        matches!(v, Verdict::Abort { reason } if reason.contains(word))
    }

    #[test]
    fn defaults() {
        let r = RolloutRule::default();
        assert_eq!(r.bake, Duration::from_secs(3600));
        assert_eq!(r.max_virtual_drop_share, 0.0001);
        assert_eq!(r.min_offered, 1000.0);
        assert_eq!(r.max_bake, Duration::from_secs(86_400));
    }

    #[test]
    fn aborts_early_once_enough_traffic_shows_the_share_over_the_bar() {
        let r = RolloutRule::default();
        // A third dropped after 10 s with 1,500 requests: abort now, not at the bake's end.
        let v = judge(&r, &seen(10, 1500.0, 500.0));
        assert!(is_abort(&v, "33.3333%"), "{v:?}");
        // The same share with too few requests: keep watching.
        assert_eq!(judge(&r, &seen(10, 15.0, 5.0)), Verdict::Baking);
    }

    #[test]
    fn promotes_after_the_bake_with_enough_traffic_under_the_bar() {
        let r = RolloutRule::default();
        assert_eq!(judge(&r, &seen(3599, 1e6, 0.0)), Verdict::Baking);
        assert_eq!(judge(&r, &seen(3600, 1e6, 0.0)), Verdict::Promote);
        // At the bar exactly: passes; just above: aborts.
        assert_eq!(judge(&r, &seen(3600, 1e6, 100.0)), Verdict::Promote);
        assert!(is_abort(
            &judge(&r, &seen(3600, 1e6, 101.0)),
            "above the bar"
        ));
    }

    #[test]
    fn a_starved_candidate_waits_then_aborts() {
        let r = RolloutRule::default();
        assert_eq!(judge(&r, &seen(3600, 999.0, 0.0)), Verdict::Baking);
        assert_eq!(judge(&r, &seen(86_399, 999.0, 0.0)), Verdict::Baking);
        assert!(is_abort(
            &judge(&r, &seen(86_400, 999.0, 0.0)),
            "too little traffic"
        ));
        // Enough traffic arriving late promotes.
        assert_eq!(judge(&r, &seen(50_000, 1000.0, 0.0)), Verdict::Promote);
        // max_bake shorter than bake: the bake still runs.
        let short = RolloutRule {
            max_bake: Duration::from_secs(60),
            ..RolloutRule::default()
        };
        assert_eq!(judge(&short, &seen(600, 0.0, 0.0)), Verdict::Baking);
        assert!(is_abort(
            &judge(&short, &seen(3600, 0.0, 0.0)),
            "too little"
        ));
    }

    #[test]
    fn nan_counts_never_pass() {
        let r = RolloutRule::default();
        assert!(matches!(
            judge(&r, &seen(3600, 1e6, f64::NAN)),
            Verdict::Abort { .. }
        ));
    }
}
