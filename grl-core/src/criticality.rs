//! Criticality tiers: which requests of a bucket over its limit pay first.
//!
//! A request carries one of four tiers (Google's names): `CRITICAL_PLUS`, `CRITICAL` (the
//! default: a request without a tier), `SHEDDABLE_PLUS`, `SHEDDABLE`. When a bucket must shed a
//! total, [`split`] takes it from the least critical tier upward: every tier below a threshold
//! tier drops everything, the threshold tier drops a fraction, every tier above drops nothing.

use std::fmt;

/// A request's criticality; ordered from the least to the most critical.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
#[repr(u8)]
pub enum Criticality {
    /// Shed first: prefetches, speculative work, batch jobs that retry later.
    Sheddable = 0,
    /// Shed before critical traffic.
    SheddablePlus = 1,
    /// What a user waits for; a request without a tier is this.
    #[default]
    Critical = 2,
    /// Shed last.
    CriticalPlus = 3,
}

/// The number of tiers.
pub const TIERS: usize = 4;

impl Criticality {
    /// Every tier, least critical first (index = `tier as usize`).
    pub const ALL: [Criticality; TIERS] = [
        Criticality::Sheddable,
        Criticality::SheddablePlus,
        Criticality::Critical,
        Criticality::CriticalPlus,
    ];

    /// The tier's name on the wire and in labels: `CRITICAL_PLUS`, `CRITICAL`,
    /// `SHEDDABLE_PLUS`, `SHEDDABLE`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Criticality::Sheddable => "SHEDDABLE",
            Criticality::SheddablePlus => "SHEDDABLE_PLUS",
            Criticality::Critical => "CRITICAL",
            Criticality::CriticalPlus => "CRITICAL_PLUS",
        }
    }

    /// The tier at `index` (0 = least critical).
    pub fn from_index(index: usize) -> Option<Criticality> {
        Criticality::ALL.get(index).copied()
    }

    /// A tier named in a header value, case-insensitively, surrounding spaces ignored; `None`
    /// for anything else (the caller then uses [`Criticality::Critical`]). Allocates nothing.
    pub fn parse(value: &[u8]) -> Option<Criticality> {
        let v = value.trim_ascii();
        Criticality::ALL
            .into_iter()
            .find(|c| v.eq_ignore_ascii_case(c.as_str().as_bytes()))
    }

    /// The tier in a W3C `baggage` header value: its `criticality` member (key matched
    /// case-sensitively as the spec's keys are, value as in [`Criticality::parse`]; member
    /// properties after `;` ignored). `None` without one or with an invalid value.
    pub fn from_baggage(value: &[u8]) -> Option<Criticality> {
        value.split(|&b| b == b',').find_map(|member| {
            let member = member.split(|&b| b == b';').next().unwrap_or_default();
            let eq = member.iter().position(|&b| b == b'=')?;
            let (key, val) = (member[..eq].trim_ascii(), &member[eq + 1..]);
            (key == b"criticality").then(|| Criticality::parse(val))?
        })
    }

    /// `self`, or `cap` when `self` is more critical than a caller may claim.
    pub fn capped(self, cap: Criticality) -> Criticality {
        self.min(cap)
    }
}

impl fmt::Display for Criticality {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Criticality {
    type Err = UnknownTier;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Criticality::parse(s.as_bytes()).ok_or_else(|| UnknownTier(s.to_string()))
    }
}

/// A name that is not one of the four tiers.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown criticality `{0}`: expected CRITICAL_PLUS, CRITICAL, SHEDDABLE_PLUS or SHEDDABLE")]
pub struct UnknownTier(pub String);

/// How a bucket's total to shed falls on its tiers: every tier below `threshold` drops all
/// its requests, `threshold` drops `fraction` of its own, every tier above drops none.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TierShed {
    /// The one tier that may drop a fraction.
    pub threshold: Criticality,
    /// The fraction of the threshold tier's requests dropped, in [0, 1].
    pub fraction: f64,
}

impl TierShed {
    /// Nothing shed.
    pub const NONE: TierShed = TierShed {
        threshold: Criticality::Sheddable,
        fraction: 0.0,
    };

    /// The drop probability of a request of `tier`.
    pub fn probability(&self, tier: Criticality) -> f64 {
        match tier.cmp(&self.threshold) {
            std::cmp::Ordering::Less => 1.0,
            std::cmp::Ordering::Equal => self.fraction,
            std::cmp::Ordering::Greater => 0.0,
        }
    }

    /// The drop probability of every tier, least critical first.
    pub fn probabilities(&self) -> [f64; TIERS] {
        Criticality::ALL.map(|t| self.probability(t))
    }
}

/// Takes `total` requests per second to shed from `offered` (per tier, least critical first)
/// strictly from the least critical tier upward. The drops sum to `total` (or to the whole
/// offered load when `total` is larger), never rise toward more critical tiers, and at most
/// one tier drops a fraction. Non-finite or negative inputs count as zero.
pub fn split(total: f64, offered: [f64; TIERS]) -> TierShed {
    let clean = |v: f64| if v.is_finite() && v > 0.0 { v } else { 0.0 };
    let mut left = clean(total);
    if left == 0.0 {
        return TierShed::NONE;
    }
    let all = TierShed {
        threshold: Criticality::CriticalPlus,
        fraction: 1.0,
    };
    if left >= offered.iter().map(|&o| clean(o)).sum::<f64>() {
        return all;
    }
    for tier in Criticality::ALL {
        let o = clean(offered[tier as usize]);
        if left < o {
            return TierShed {
                threshold: tier,
                fraction: (left / o).clamp(0.0, 1.0),
            };
        }
        left -= o;
    }
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_names_case_insensitively_and_nothing_else() {
        assert_eq!(
            Criticality::parse(b"critical_plus"),
            Some(Criticality::CriticalPlus)
        );
        assert_eq!(
            Criticality::parse(b" Sheddable "),
            Some(Criticality::Sheddable)
        );
        assert_eq!(
            Criticality::parse(b"SHEDDABLE_PLUS"),
            Some(Criticality::SheddablePlus)
        );
        assert_eq!(Criticality::parse(b"CRITICAL"), Some(Criticality::Critical));
        for bad in [&b""[..], b"critical-plus", b"CRIT", b"criticalx", b"\xff"] {
            assert_eq!(Criticality::parse(bad), None, "{bad:?}");
        }
        assert_eq!(Criticality::default(), Criticality::Critical);
        assert!("nope"
            .parse::<Criticality>()
            .unwrap_err()
            .to_string()
            .contains("nope"));
    }

    #[test]
    fn baggage_member() {
        let b = |v: &str| Criticality::from_baggage(v.as_bytes());
        assert_eq!(b("criticality=SHEDDABLE"), Some(Criticality::Sheddable));
        assert_eq!(
            b("userId=alice, criticality = sheddable_plus;prop=1,x=y"),
            Some(Criticality::SheddablePlus)
        );
        assert_eq!(b("userId=alice"), None);
        assert_eq!(b("criticality=bogus"), None);
        assert_eq!(b("Criticality=SHEDDABLE"), None);
        assert_eq!(b(""), None);
    }

    #[test]
    fn caps_lower_a_claim() {
        let cap = Criticality::SheddablePlus;
        assert_eq!(Criticality::CriticalPlus.capped(cap), cap);
        assert_eq!(Criticality::Sheddable.capped(cap), Criticality::Sheddable);
    }

    /// A small deterministic generator (xorshift) for the property checks.
    fn values(seed: u64, n: usize) -> impl Iterator<Item = (f64, [f64; TIERS])> {
        let mut s = seed;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        (0..n).map(move |_| {
            let mut tier = || match next() % 5 {
                0 => 0.0,
                _ => (next() % 10_000) as f64 / 7.0,
            };
            let offered = [tier(), tier(), tier(), tier()];
            let sum: f64 = offered.iter().sum();
            let total = match next() % 6 {
                0 => 0.0,
                1 => sum * 1.5,
                2 => sum,
                _ => sum * (next() % 1000) as f64 / 1000.0,
            };
            (total, offered)
        })
    }

    #[test]
    fn split_properties() {
        for (total, offered) in values(0x9E37_79B9_7F4A_7C15, 100_000) {
            let s = split(total, offered);
            let p = s.probabilities();
            let sum: f64 = offered.iter().sum();
            let dropped: f64 = p.iter().zip(offered).map(|(p, o)| p * o).sum();
            // The drops sum to the total (to everything offered when the total is larger).
            let want = total.min(sum);
            assert!(
                (dropped - want).abs() <= 1e-9 * sum.max(1.0),
                "{total} {offered:?} {s:?}"
            );
            // Never rising toward more critical tiers; at most one fraction.
            assert!(p.windows(2).all(|w| w[0] >= w[1]), "{p:?}");
            assert!(
                p.iter().filter(|&&x| x > 0.0 && x < 1.0).count() <= 1,
                "{p:?}"
            );
            if total == 0.0 {
                assert_eq!(p, [0.0; TIERS]);
            }
            if total >= sum && sum > 0.0 {
                for (t, o) in offered.iter().enumerate() {
                    assert!(*o == 0.0 || p[t] == 1.0, "{total} {offered:?} {p:?}");
                }
            }
        }
    }

    #[test]
    fn split_worked_example() {
        // 300 offered (120 CRITICAL, 180 SHEDDABLE) at a limit of 200: 100 to shed, all of
        // it SHEDDABLE.
        let s = split(100.0, [180.0, 0.0, 120.0, 0.0]);
        assert_eq!(s.threshold, Criticality::Sheddable);
        assert!((s.fraction - 100.0 / 180.0).abs() < 1e-12);
        assert_eq!(s.probability(Criticality::Critical), 0.0);
        // Bad inputs shed nothing rather than everything.
        assert_eq!(split(f64::NAN, [1.0; TIERS]), TierShed::NONE);
        assert_eq!(split(-1.0, [1.0; TIERS]), TierShed::NONE);
    }
}
