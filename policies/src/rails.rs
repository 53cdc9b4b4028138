//! Safety rails applied after every policy: clamp to floor and ceiling, skip small changes,
//! apply increases at once but cap decreases per run, never fall to zero, and start new buckets
//! in shadow.

use schema::{Mode, PolicySpec, RailsConfig};
use serde::Serialize;

/// The current quota of a bucket, from the config repo.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Current {
    /// Limit in force.
    pub limit_rps: f64,
    /// Mode in force.
    pub mode: Mode,
}

/// The limit and mode after the rails, and which rails acted.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Railed {
    /// The final limit.
    pub limit_rps: f64,
    /// The final mode.
    pub mode: Mode,
    /// One line per rail that changed something.
    pub notes: Vec<String>,
}

/// Applies the rails to a proposed limit. `shadow_requested` comes from the policy (e.g. short
/// history). Fixed (contractual) limits skip the damping rails: pass `damp = false`.
pub fn apply(
    rails: &RailsConfig,
    spec: &PolicySpec,
    current: Option<Current>,
    proposed: f64,
    shadow_requested: bool,
    damp: bool,
) -> Railed {
    let mut notes = Vec::new();
    let mut limit = if proposed.is_finite() { proposed } else { 0.0 };
    let floor = rails.floor_rps.max(spec.floor_rps.unwrap_or(0.0));
    if limit < floor {
        notes.push(format!("raised to the floor of {floor} rps"));
        limit = floor;
    }
    if let Some(c) = spec.ceiling_rps {
        if limit > c {
            notes.push(format!("lowered to the ceiling of {c} rps"));
            limit = c;
        }
    }
    let mode = match (spec.mode, current) {
        // The service owner's choice in rlc/policies.yaml wins: this is how shadow buckets are
        // promoted to enforce once their virtual drops look right.
        (Some(m), cur) => {
            if cur.map(|c| c.mode) != Some(m) {
                notes.push(format!("mode {} set in rlc/policies.yaml", m.as_str()));
            }
            m
        }
        (None, Some(cur)) => cur.mode,
        (None, None) if rails.new_buckets_shadow => {
            notes.push("new bucket: starts in shadow".into());
            Mode::Shadow
        }
        (None, None) if shadow_requested => {
            notes.push("short history: starts in shadow".into());
            Mode::Shadow
        }
        (None, None) => Mode::Enforce,
    };
    if let (Some(cur), true) = (current, damp) {
        if cur.limit_rps > 0.0 {
            let change = (limit - cur.limit_rps) / cur.limit_rps;
            if change.abs() < rails.min_change {
                notes.push(format!(
                    "change of {:+.1}% is below the {:.0}% threshold: keeps {} rps",
                    change * 100.0,
                    rails.min_change * 100.0,
                    cur.limit_rps
                ));
                limit = cur.limit_rps;
            } else if change < -rails.max_decrease {
                let capped = (cur.limit_rps * (1.0 - rails.max_decrease)).max(floor);
                notes.push(format!(
                    "decrease of {:.1}% capped at {:.0}% per run: {} rps instead of {:.3}",
                    -change * 100.0,
                    rails.max_decrease * 100.0,
                    schema::format_rps(capped),
                    limit
                ));
                limit = capped;
            }
        }
    }
    Railed {
        limit_rps: round_limit(limit),
        mode,
        notes,
    }
}

/// Limits are written with at most 3 significant decimals so files stay stable.
pub fn round_limit(v: f64) -> f64 {
    if v >= 100.0 {
        v.round()
    } else {
        (v * 100.0).round() / 100.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(current: Option<f64>, proposed: f64, expect: f64, expect_mode: Mode) {
        let r = apply(
            &RailsConfig::default(),
            &PolicySpec::default(),
            current.map(|l| Current {
                limit_rps: l,
                mode: Mode::Enforce,
            }),
            proposed,
            false,
            true,
        );
        assert_eq!(
            (r.limit_rps, r.mode),
            (expect, expect_mode),
            "{current:?} → {proposed}: {:?}",
            r.notes
        );
    }

    #[test]
    fn rails_table() {
        check(Some(1000.0), 1050.0, 1000.0, Mode::Enforce); // below 10%: keep
        check(Some(1000.0), 950.0, 1000.0, Mode::Enforce);
        check(Some(1000.0), 2000.0, 2000.0, Mode::Enforce); // increase at once
        check(Some(1000.0), 100.0, 750.0, Mode::Enforce); // decrease capped at 25%
        check(Some(1000.0), 800.0, 800.0, Mode::Enforce);
        check(Some(1000.0), 0.0, 750.0, Mode::Enforce);
        check(None, 0.0, 1.0, Mode::Shadow); // never zero; new = shadow
        check(None, 123.456, 123.0, Mode::Shadow);
        check(None, f64::NAN, 1.0, Mode::Shadow);
    }

    #[test]
    fn fixed_is_not_damped_and_ceiling_applies() {
        let cur = Some(Current {
            limit_rps: 1000.0,
            mode: Mode::Shadow,
        });
        let r = apply(
            &RailsConfig::default(),
            &PolicySpec::default(),
            cur,
            100.0,
            false,
            false,
        );
        assert_eq!((r.limit_rps, r.mode), (100.0, Mode::Shadow));
        let spec = PolicySpec {
            ceiling_rps: Some(50.0),
            ..Default::default()
        };
        let r = apply(&RailsConfig::default(), &spec, None, 100.0, false, true);
        assert_eq!(r.limit_rps, 50.0);
    }
}
