//! Where a request's criticality tier comes from: a header (`rpc-criticality` by default; in
//! gRPC the same metadata key, which is a header on the wire), else the `criticality` member
//! of a W3C `baggage` header; values case-insensitive; absent or invalid means CRITICAL, so
//! traffic without a tier is decided exactly as before tiers. A caller may be capped to the
//! highest tier it may claim (a batch job cannot claim CRITICAL_PLUS).

use http::header::HeaderName;
use http::HeaderMap;
use schema::Criticality;

/// The default header naming a request's tier.
pub const DEFAULT_HEADER: &str = "rpc-criticality";

/// The W3C baggage header.
const BAGGAGE: HeaderName = HeaderName::from_static("baggage");

/// How a front end reads a request's tier.
#[derive(Debug, Clone)]
pub struct TierFrom {
    /// The header naming the tier; None: every request is CRITICAL (tiers ignored).
    header: Option<HeaderName>,
    /// (caller pattern, highest tier it may claim), the first match wins.
    caps: Vec<(CallerPattern, Criticality)>,
}

impl Default for TierFrom {
    fn default() -> Self {
        TierFrom {
            header: Some(HeaderName::from_static(DEFAULT_HEADER)),
            caps: Vec::new(),
        }
    }
}

/// A caller name, or a prefix of one ending in `*`.
#[derive(Debug, Clone, PartialEq, Eq)]
enum CallerPattern {
    Exact(String),
    Prefix(String),
}

impl CallerPattern {
    fn matches(&self, caller: &str) -> bool {
        match self {
            CallerPattern::Exact(c) => c == caller,
            CallerPattern::Prefix(p) => caller.starts_with(p.as_str()),
        }
    }
}

/// A `--criticality-cap` that does not read `CALLER=TIER`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CapError {
    /// No `=`, or an empty caller pattern.
    #[error("`{0}`: expected CALLER=TIER (CALLER a name, or a prefix ending in *)")]
    Shape(String),
    /// Not a tier.
    #[error("`{0}`: {1}")]
    Tier(String, schema::criticality::UnknownTier),
}

impl TierFrom {
    /// Every request is CRITICAL: tiers ignored.
    pub fn none() -> TierFrom {
        TierFrom {
            header: None,
            caps: Vec::new(),
        }
    }

    /// The tier from `header` (then baggage).
    pub fn header(header: HeaderName) -> TierFrom {
        TierFrom {
            header: Some(header),
            caps: Vec::new(),
        }
    }

    /// Caps the callers `pattern` names (a name, or a prefix ending in `*`) at `cap`.
    pub fn with_cap(mut self, pattern: &str, cap: Criticality) -> TierFrom {
        let p = match pattern.strip_suffix('*') {
            Some(prefix) => CallerPattern::Prefix(prefix.to_string()),
            None => CallerPattern::Exact(pattern.to_string()),
        };
        self.caps.push((p, cap));
        self
    }

    /// [`TierFrom::with_cap`] from `CALLER=TIER` (a command-line flag).
    pub fn with_cap_flag(self, flag: &str) -> Result<TierFrom, CapError> {
        let Some((pattern, tier)) = flag.split_once('=').filter(|(p, _)| !p.trim().is_empty())
        else {
            return Err(CapError::Shape(flag.to_string()));
        };
        let tier: Criticality = tier
            .parse()
            .map_err(|e| CapError::Tier(flag.to_string(), e))?;
        Ok(self.with_cap(pattern.trim(), tier))
    }

    /// The tier of a request of `caller` with `headers`. Allocates nothing.
    #[inline]
    pub fn tier(&self, headers: &HeaderMap, caller: &str) -> Criticality {
        let Some(name) = &self.header else {
            return Criticality::Critical;
        };
        let claimed = match headers.get(name) {
            Some(v) => Criticality::parse(v.as_bytes()),
            None => headers
                .get_all(BAGGAGE)
                .iter()
                .find_map(|v| Criticality::from_baggage(v.as_bytes())),
        }
        .unwrap_or_default();
        if self.caps.is_empty() {
            return claimed;
        }
        self.cap(caller).map_or(claimed, |cap| claimed.capped(cap))
    }

    #[cold]
    fn cap(&self, caller: &str) -> Option<Criticality> {
        self.caps
            .iter()
            .find(|(p, _)| p.matches(caller))
            .map(|&(_, c)| c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(h: &[(&'static str, &str)]) -> HeaderMap {
        let mut m = HeaderMap::new();
        for (k, v) in h {
            m.append(*k, v.parse().unwrap());
        }
        m
    }

    #[test]
    fn header_then_baggage_else_critical() {
        let t = TierFrom::default();
        let tier = |h: &[(&'static str, &str)]| t.tier(&headers(h), "gw");
        assert_eq!(tier(&[]), Criticality::Critical);
        assert_eq!(
            tier(&[("rpc-criticality", "sheddable")]),
            Criticality::Sheddable
        );
        assert_eq!(tier(&[("rpc-criticality", "bogus")]), Criticality::Critical);
        assert_eq!(
            tier(&[
                ("baggage", "a=b"),
                ("baggage", "criticality=SHEDDABLE_PLUS")
            ]),
            Criticality::SheddablePlus
        );
        // The header wins over baggage.
        assert_eq!(
            tier(&[
                ("rpc-criticality", "CRITICAL_PLUS"),
                ("baggage", "criticality=SHEDDABLE")
            ]),
            Criticality::CriticalPlus
        );
        let off = TierFrom::none();
        assert_eq!(
            off.tier(&headers(&[("rpc-criticality", "SHEDDABLE")]), "gw"),
            Criticality::Critical
        );
    }

    #[test]
    fn caps_hold_a_caller_below_what_it_claims() {
        let t = TierFrom::default()
            .with_cap_flag("batch-*=SHEDDABLE_PLUS")
            .unwrap()
            .with_cap_flag("cron=sheddable")
            .unwrap();
        let h = headers(&[("rpc-criticality", "CRITICAL_PLUS")]);
        assert_eq!(t.tier(&h, "batch-nightly"), Criticality::SheddablePlus);
        assert_eq!(t.tier(&h, "cron"), Criticality::Sheddable);
        assert_eq!(t.tier(&h, "cronx"), Criticality::CriticalPlus);
        // A cap never raises: a capped caller's SHEDDABLE stays SHEDDABLE.
        let low = headers(&[("rpc-criticality", "SHEDDABLE")]);
        assert_eq!(t.tier(&low, "batch-x"), Criticality::Sheddable);
        // Without a header a capped caller is CRITICAL, then capped.
        assert_eq!(
            t.tier(&HeaderMap::new(), "batch-x"),
            Criticality::SheddablePlus
        );
        for bad in ["nope", "=CRITICAL", "x=URGENT"] {
            let e = TierFrom::default()
                .with_cap_flag(bad)
                .unwrap_err()
                .to_string();
            assert!(e.contains(bad), "{e}");
        }
    }
}
