//! Criticality tiers: a request's importance when its bucket is over its limit.
//!
//! A request carries one of four tiers (Google's names): `CRITICAL_PLUS`, `CRITICAL` (the
//! default: a request without a tier), `SHEDDABLE_PLUS`, `SHEDDABLE`. The controller sheds a
//! bucket's excess from the least critical tier upward (`grl_core::criticality::split`).

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

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

/// Checks a caller pattern of a cap: a caller name, or a prefix ending in `*` (`*` alone:
/// every caller); no other `*`, no surrounding spaces.
pub fn check_caller_pattern(pattern: &str) -> Result<(), String> {
    let name = pattern.strip_suffix('*').unwrap_or(pattern);
    if pattern.is_empty() {
        Err("an empty caller pattern: expected a caller name, or a prefix ending in *".into())
    } else if name.contains('*') {
        Err(format!(
            "`{pattern}`: `*` may only end a pattern (a prefix of caller names)"
        ))
    } else if name.trim() != name {
        Err(format!("`{pattern}`: spaces around a caller name"))
    } else {
        Ok(())
    }
}

/// A name that is not one of the four tiers.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown criticality `{0}`: expected CRITICAL_PLUS, CRITICAL, SHEDDABLE_PLUS or SHEDDABLE")]
pub struct UnknownTier(pub String);

impl Serialize for Criticality {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for Criticality {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl schemars::JsonSchema for Criticality {
    fn schema_name() -> String {
        "Criticality".into()
    }
    fn json_schema(_: &mut schemars::gen::SchemaGenerator) -> schemars::schema::Schema {
        schemars::schema::SchemaObject {
            instance_type: Some(schemars::schema::InstanceType::String.into()),
            enum_values: Some(
                Criticality::ALL
                    .iter()
                    .rev()
                    .map(|c| c.as_str().into())
                    .collect(),
            ),
            ..Default::default()
        }
        .into()
    }
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

    #[test]
    fn serialized_as_its_name() {
        let json = serde_json::to_string(&Criticality::SheddablePlus).unwrap();
        assert_eq!(json, "\"SHEDDABLE_PLUS\"");
        assert_eq!(
            serde_json::from_str::<Criticality>("\"critical\"").unwrap(),
            Criticality::Critical
        );
        assert!(serde_json::from_str::<Criticality>("\"urgent\"").is_err());
    }
}
