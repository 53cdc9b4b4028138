//! The strict split of a bucket's shed over its criticality tiers
//! ([`schema::Criticality`]): when a bucket must shed a total, [`split`] takes it from the
//! least critical tier upward: every tier below a threshold tier drops everything, the
//! threshold tier drops a fraction, every tier above drops nothing.

use schema::criticality::TIERS;
use schema::Criticality;

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

    /// Whichever of `self` and `other` sheds more: both take from the least critical tier
    /// upward, so the one with the higher threshold (or, at the same threshold, the higher
    /// fraction) drops at least as much on every tier.
    pub fn max(self, other: TierShed) -> TierShed {
        if (other.threshold, other.fraction) > (self.threshold, self.fraction) {
            other
        } else {
            self
        }
    }

    /// The drop probability of every tier, least critical first.
    pub fn probabilities(&self) -> [f64; TIERS] {
        Criticality::ALL.map(|t| self.probability(t))
    }

    /// The requests it drops of `offered` (per tier, least critical first).
    pub fn dropped(&self, offered: [f64; TIERS]) -> f64 {
        self.probabilities()
            .iter()
            .zip(offered)
            .map(|(p, o)| p * o)
            .sum()
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
            let dropped = s.dropped(offered);
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

    /// `max` of two splits drops at least as much as either on every tier.
    #[test]
    fn max_sheds_at_least_as_much_on_every_tier() {
        let mut pairs = values(0x2545_F491_4F6C_DD1D, 20_000);
        while let (Some((a, oa)), Some((b, ob))) = (pairs.next(), pairs.next()) {
            let (x, y) = (split(a, oa), split(b, ob));
            let m = x.max(y).probabilities();
            for (t, p) in m.iter().enumerate() {
                assert!(*p >= x.probabilities()[t] && *p >= y.probabilities()[t]);
            }
            assert!(m == x.probabilities() || m == y.probabilities());
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
