//! Safety rails applied after every policy: clamp to floor and ceiling, skip small changes,
//! apply increases at once but cap decreases per run, never fall to zero, and start new buckets
//! in shadow.

use std::fmt;

use schema::{Mode, PolicySpec, RailsConfig};
use serde::{Deserialize, Serialize};

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
    /// One note per rail that changed something.
    pub notes: Vec<RailNote>,
    /// The limit the policy proposed when a rail held it lower (the ceiling, or the cap on
    /// decreases per run), so a reviewer sees what it was capped from.
    pub capped_from: Option<f64>,
}

/// Which rail acted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RailKind {
    /// Raised to the floor.
    Floor,
    /// Lowered to the ceiling.
    Ceiling,
    /// The mode set in `rlc/policies.yaml`.
    ModeSet,
    /// A new bucket, or one with a short history, starts in shadow.
    ShadowStart,
    /// A change below the threshold: the current limit is kept.
    BelowThreshold,
    /// An increase capped per run.
    IncreaseCapped,
    /// A decrease capped per run.
    DecreaseCapped,
    /// A note this version did not write (stored by another one).
    Other,
}

impl RailKind {
    /// Whether this rail moved or held the limit (rather than setting the mode).
    pub fn moves_limit(self) -> bool {
        !matches!(self, RailKind::ModeSet | RailKind::ShadowStart)
    }

    /// The kind of a stored note: the one place a note's words are read back, matched
    /// against what [`RailNote`]'s constructors write (a test holds them together).
    fn of(text: &str) -> RailKind {
        const PREFIXES: [(&str, RailKind); 6] = [
            ("raised to the floor ", RailKind::Floor),
            ("lowered to the ceiling ", RailKind::Ceiling),
            ("mode ", RailKind::ModeSet),
            ("change of ", RailKind::BelowThreshold),
            ("increase of ", RailKind::IncreaseCapped),
            ("decrease of ", RailKind::DecreaseCapped),
        ];
        if text.ends_with(": starts in shadow") {
            return RailKind::ShadowStart;
        }
        PREFIXES
            .iter()
            .find(|(p, _)| text.starts_with(p))
            .map_or(RailKind::Other, |&(_, k)| k)
    }
}

/// What one rail did, in the words a reviewer reads. Serialized as those words (the
/// `rails` of a bucket's evidence is a list of strings), read back with its kind.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(into = "String", from = "String")]
pub struct RailNote {
    kind: RailKind,
    text: String,
}

impl RailNote {
    fn new(kind: RailKind, text: String) -> Self {
        debug_assert_eq!(RailKind::of(&text), kind, "{text}");
        RailNote { kind, text }
    }

    /// Which rail acted.
    pub fn kind(&self) -> RailKind {
        self.kind
    }

    /// The note's words.
    pub fn as_str(&self) -> &str {
        &self.text
    }
}

impl From<String> for RailNote {
    fn from(text: String) -> Self {
        RailNote {
            kind: RailKind::of(&text),
            text,
        }
    }
}

impl From<&str> for RailNote {
    fn from(text: &str) -> Self {
        RailNote::from(text.to_string())
    }
}

impl From<RailNote> for String {
    fn from(n: RailNote) -> String {
        n.text
    }
}

impl fmt::Display for RailNote {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// The lowest limit a bucket of this policy may get: the larger of the global and the
/// service's floor.
pub fn floor(rails: &RailsConfig, spec: &PolicySpec) -> f64 {
    rails.floor_rps.max(spec.floor_rps.unwrap_or(0.0))
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
    let mut capped_from = None;
    let mut limit = if proposed.is_finite() { proposed } else { 0.0 };
    let floor = floor(rails, spec);
    if limit < floor {
        notes.push(RailNote::new(
            RailKind::Floor,
            format!("raised to the floor of {floor} rps"),
        ));
        limit = floor;
    }
    if let Some(c) = spec.ceiling_rps {
        if limit > c {
            notes.push(RailNote::new(
                RailKind::Ceiling,
                format!("lowered to the ceiling of {c} rps"),
            ));
            capped_from = Some(round_limit(limit));
            limit = c;
        }
    }
    let mode = mode_of(rails, spec, current, shadow_requested, &mut notes);
    if let (Some(cur), true) = (current, damp) {
        if let Some((damped, note)) = damped(rails, cur, limit, floor) {
            if note.kind() != RailKind::BelowThreshold {
                capped_from = Some(round_limit(limit));
            }
            notes.push(note);
            limit = damped;
        }
    }
    Railed {
        limit_rps: round_limit(limit),
        mode,
        notes,
        capped_from,
    }
}

/// The bucket's mode: the one set in `rlc/policies.yaml`, else the current one, else shadow
/// for a new bucket (or one the policy asked to start in shadow).
fn mode_of(
    rails: &RailsConfig,
    spec: &PolicySpec,
    current: Option<Current>,
    shadow_requested: bool,
    notes: &mut Vec<RailNote>,
) -> Mode {
    match (spec.mode, current) {
        // The service owner's choice in rlc/policies.yaml wins: this is how shadow buckets are
        // promoted to enforce once their virtual drops look right.
        (Some(m), cur) => {
            if cur.map(|c| c.mode) != Some(m) {
                notes.push(RailNote::new(
                    RailKind::ModeSet,
                    format!("mode {} set in rlc/policies.yaml", m.as_str()),
                ));
            }
            m
        }
        (None, Some(cur)) => cur.mode,
        (None, None) if rails.new_buckets_shadow => {
            notes.push(RailNote::new(
                RailKind::ShadowStart,
                "new bucket: starts in shadow".into(),
            ));
            Mode::Shadow
        }
        (None, None) if shadow_requested => {
            notes.push(RailNote::new(
                RailKind::ShadowStart,
                "short history: starts in shadow".into(),
            ));
            Mode::Shadow
        }
        (None, None) => Mode::Enforce,
    }
}

/// The damping rails against the current limit: a change below the threshold keeps it, an
/// increase or a decrease beyond its cap per run is capped. `None` when the change passes.
fn damped(rails: &RailsConfig, cur: Current, limit: f64, floor: f64) -> Option<(f64, RailNote)> {
    if cur.limit_rps <= 0.0 {
        return None;
    }
    let change = (limit - cur.limit_rps) / cur.limit_rps;
    if change.abs() < rails.min_change {
        let note = format!(
            "change of {:+.1}% is below the {:.0}% threshold: keeps {} rps",
            change * 100.0,
            rails.min_change * 100.0,
            cur.limit_rps
        );
        Some((cur.limit_rps, RailNote::new(RailKind::BelowThreshold, note)))
    } else if change > rails.max_increase {
        let capped = cur.limit_rps * (1.0 + rails.max_increase);
        let note = format!(
            "increase of {:.1}% capped at {:.0}% per run: {} rps instead of {:.3}",
            change * 100.0,
            rails.max_increase * 100.0,
            schema::format_rps(capped),
            limit
        );
        Some((capped, RailNote::new(RailKind::IncreaseCapped, note)))
    } else if change < -rails.max_decrease {
        let capped = (cur.limit_rps * (1.0 - rails.max_decrease)).max(floor);
        let note = format!(
            "decrease of {:.1}% capped at {:.0}% per run: {} rps instead of {:.3}",
            -change * 100.0,
            rails.max_decrease * 100.0,
            schema::format_rps(capped),
            limit
        );
        Some((capped, RailNote::new(RailKind::DecreaseCapped, note)))
    } else {
        None
    }
}

/// A proposal above this multiple of max(observed peak, planned capacity share, floor) is
/// refused (see [`check_proposal`]). The built-in `peak` policy reaches at most
/// 25 × (1 + headroom) of the peak, for a series one hour old.
pub const SANITY_FACTOR: f64 = 100.0;

/// Why a proposal is refused before the rails (see [`check_proposal`]).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Refused {
    /// Not a finite number.
    #[error("proposed {0} rps, not a finite number")]
    NotFinite(f64),
    /// Below zero.
    #[error("proposed a negative limit ({0} rps)")]
    Negative(f64),
    /// 0 for a bucket that saw traffic.
    #[error("proposed 0 rps for a bucket whose peak is {} rps", schema::format_rps(*.peak_rps))]
    Zero { peak_rps: f64 },
    /// Above [`SANITY_FACTOR`] × max(peak, capacity share, floor).
    #[error(
        "proposed {} rps, above the sanity bound of {SANITY_FACTOR} × max(peak {} rps, capacity share {}, floor {} rps) = {} rps",
        show(*.proposed),
        show(*.peak_rps),
        .capacity_share_rps.map(|c| format!("{} rps", show(c))).unwrap_or_else(|| "none".into()),
        show(*.floor_rps),
        show(*.bound),
        SANITY_FACTOR = SANITY_FACTOR
    )]
    AboveBound {
        proposed: f64,
        /// The peak the bound was taken from (a non-finite or negative peak counts as 0).
        peak_rps: f64,
        capacity_share_rps: Option<f64>,
        floor_rps: f64,
        bound: f64,
    },
}

/// The sanity bound every policy's proposal passes before the rails: a limit that is not a
/// finite number, is negative, is 0 for a bucket that saw traffic, or (when `relative`, i.e.
/// for every policy but contracts) exceeds [`SANITY_FACTOR`] × max(`peak_rps`,
/// `capacity_share_rps`, `floor_rps`) is refused with the reason. A refused bucket keeps its
/// current limit.
pub fn check_proposal(
    proposed: f64,
    peak_rps: f64,
    capacity_share_rps: Option<f64>,
    floor_rps: f64,
    relative: bool,
) -> Result<(), Refused> {
    if !proposed.is_finite() {
        return Err(Refused::NotFinite(proposed));
    }
    if proposed < 0.0 {
        return Err(Refused::Negative(proposed));
    }
    if proposed == 0.0 && peak_rps > 0.0 {
        return Err(Refused::Zero { peak_rps });
    }
    if relative {
        let peak = if peak_rps.is_finite() {
            peak_rps.max(0.0)
        } else {
            0.0
        };
        let cap = capacity_share_rps.filter(|c| c.is_finite()).unwrap_or(0.0);
        let basis = peak.max(cap).max(floor_rps);
        let bound = SANITY_FACTOR * basis;
        if proposed > bound {
            return Err(Refused::AboveBound {
                proposed,
                peak_rps: peak,
                capacity_share_rps,
                floor_rps,
                bound,
            });
        }
    }
    Ok(())
}

fn show(v: f64) -> String {
    if v.abs() >= 1e15 {
        format!("{v:e}")
    } else {
        schema::format_rps(v)
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
    fn every_note_reads_back_as_its_kind() {
        let rails = RailsConfig::default();
        let spec = |mode, ceiling| PolicySpec {
            mode,
            ceiling_rps: ceiling,
            ..PolicySpec::default()
        };
        let cur = |l| {
            Some(Current {
                limit_rps: l,
                mode: Mode::Enforce,
            })
        };
        let cases = [
            (
                apply(&rails, &spec(None, None), None, 0.0, false, true),
                RailKind::Floor,
            ),
            (
                apply(
                    &rails,
                    &spec(None, Some(10.0)),
                    cur(10.0),
                    50.0,
                    false,
                    false,
                ),
                RailKind::Ceiling,
            ),
            (
                apply(
                    &rails,
                    &spec(Some(Mode::Shadow), None),
                    cur(10.0),
                    10.0,
                    false,
                    true,
                ),
                RailKind::ModeSet,
            ),
            (
                apply(&rails, &spec(None, None), None, 10.0, true, true),
                RailKind::ShadowStart,
            ),
            (
                apply(&rails, &spec(None, None), cur(1000.0), 1010.0, false, true),
                RailKind::BelowThreshold,
            ),
            (
                apply(&rails, &spec(None, None), cur(1000.0), 1e6, false, true),
                RailKind::IncreaseCapped,
            ),
            (
                apply(&rails, &spec(None, None), cur(1000.0), 10.0, false, true),
                RailKind::DecreaseCapped,
            ),
        ];
        for (railed, kind) in cases {
            let note = railed.notes.iter().find(|n| n.kind() == kind);
            let note = note.unwrap_or_else(|| panic!("{kind:?} not in {:?}", railed.notes));
            let json = serde_json::to_string(note).unwrap();
            let back: RailNote = serde_json::from_str(&json).unwrap();
            assert_eq!(&back, note, "{json}");
            assert_eq!(
                back.kind().moves_limit(),
                !matches!(kind, RailKind::ModeSet | RailKind::ShadowStart)
            );
        }
        assert_eq!(RailNote::from("decrease capped").kind(), RailKind::Other);
    }

    #[test]
    fn rails_table() {
        check(Some(1000.0), 1050.0, 1000.0, Mode::Enforce); // below 10%: keep
        check(Some(1000.0), 950.0, 1000.0, Mode::Enforce);
        check(Some(1000.0), 2000.0, 2000.0, Mode::Enforce); // doubling at once
        check(Some(1000.0), 1e12, 2000.0, Mode::Enforce); // increase capped at +100%
        check(Some(1000.0), 3470.0, 2000.0, Mode::Enforce);
        check(Some(1000.0), 100.0, 750.0, Mode::Enforce); // decrease capped at 25%
        check(Some(1000.0), 800.0, 800.0, Mode::Enforce);
        check(Some(1000.0), 0.0, 750.0, Mode::Enforce);
        check(None, 0.0, 1.0, Mode::Shadow); // never zero; new = shadow
        check(None, 123.456, 123.0, Mode::Shadow);
        check(None, f64::NAN, 1.0, Mode::Shadow);
    }

    #[test]
    fn sanity_bound() {
        let ok = |p: f64, peak: f64, cap: Option<f64>| {
            check_proposal(p, peak, cap, 1.0, true).map_err(|e| e.to_string())
        };
        assert_eq!(ok(1250.0, 1000.0, None), Ok(()));
        assert_eq!(ok(100_000.0, 1000.0, None), Ok(()), "exactly 100 × peak");
        let e = ok(100_001.0, 1000.0, None).unwrap_err();
        assert!(
            e.contains("sanity bound") && e.contains("100000 rps"),
            "{e}"
        );
        assert_eq!(
            ok(400_000.0, 1000.0, Some(5000.0)),
            Ok(()),
            "capacity widens it"
        );
        assert!(ok(1e308, 10.0, None).unwrap_err().contains("1e308"));
        assert!(ok(f64::INFINITY, 10.0, None)
            .unwrap_err()
            .contains("not a finite"));
        assert!(ok(f64::NAN, 10.0, None)
            .unwrap_err()
            .contains("not a finite"));
        assert!(ok(-5.0, 10.0, None).unwrap_err().contains("negative"));
        assert!(ok(0.0, 10.0, None).unwrap_err().contains("peak is 10"));
        assert_eq!(
            ok(0.0, 0.0, None),
            Ok(()),
            "an idle bucket may go to the floor"
        );
        assert_eq!(ok(50.0, 0.0, None), Ok(()), "100 × the floor");
        // Contracts are not bounded by traffic, only by sense.
        assert_eq!(check_proposal(1e6, 1.0, None, 1.0, false), Ok(()));
        assert!(check_proposal(f64::NAN, 1.0, None, 1.0, false).is_err());
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
