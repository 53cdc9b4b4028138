//! `fixed`: contractual quotas from `rlc/contracts.yaml`. A contract wins over the service's
//! policy for its bucket; an expired contract no longer applies and is reported.

use chrono::NaiveDate;
use schema::{Contract, PolicyName};
use serde_json::json;

use crate::Proposal;

/// The contracts of one bucket key, split into the one that applies and the expired ones.
#[derive(Debug, Default)]
pub struct ContractMatch<'a> {
    /// The active contract (the first listed, if several).
    pub active: Option<&'a Contract>,
    /// Contracts for the same key that expired before `today`.
    pub expired: Vec<&'a Contract>,
}

/// The contracts for exactly (`service`, `caller`, `procedure`) on `today`.
pub fn contract_for<'a>(
    contracts: &'a [Contract],
    service: &str,
    caller: Option<&str>,
    procedure: Option<&str>,
    today: NaiveDate,
) -> ContractMatch<'a> {
    let mut m = ContractMatch::default();
    for c in contracts.iter().filter(|c| {
        c.service == service && c.caller.as_deref() == caller && c.procedure.as_deref() == procedure
    }) {
        if c.active_on(today) {
            m.active.get_or_insert(c);
        } else {
            m.expired.push(c);
        }
    }
    m
}

/// The proposal of an active contract; `peak_rps` is the observed peak, if any history.
pub fn proposal(c: &Contract, peak_rps: Option<f64>) -> Proposal {
    Proposal {
        limit_rps: c.limit_rps,
        shadow: false,
        policy: PolicyName::Fixed,
        peak_rps: peak_rps.unwrap_or(0.0),
        confidence: 1.0,
        evidence: json!({
            "contract": c.reference,
            "limit_rps": c.limit_rps,
            "expires": c.expires.map(|d| d.to_string()),
            "peak_rps": peak_rps,
            "explain": format!(
                "contract {} at {} rps{}",
                c.reference.as_deref().unwrap_or("(no reference)"),
                c.limit_rps,
                c.expires.map(|d| format!(" until {d}")).unwrap_or_default()
            ),
        }),
    }
}

/// How an expired contract is described in evidence or `skipped`.
pub fn expired_note(c: &Contract) -> String {
    format!(
        "contract {} ({} rps) expired on {}; it no longer applies",
        c.reference.as_deref().unwrap_or("without reference"),
        c.limit_rps,
        c.expires.map(|d| d.to_string()).unwrap_or_default()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(caller: &str, expires: Option<&str>, limit: f64) -> Contract {
        Contract {
            service: "maps".into(),
            caller: Some(caller.into()),
            procedure: None,
            limit_rps: limit,
            expires: expires.map(|e| e.parse().unwrap()),
            reference: Some("MSA-1".into()),
        }
    }

    #[test]
    fn active_and_expired() {
        let today: NaiveDate = "2026-01-10".parse().unwrap();
        let list = vec![
            c("a", Some("2026-01-09"), 5.0),
            c("a", Some("2026-01-10"), 7.0),
            c("b", None, 9.0),
        ];
        let m = contract_for(&list, "maps", Some("a"), None, today);
        assert_eq!(m.active.unwrap().limit_rps, 7.0);
        assert_eq!(m.expired.len(), 1);
        assert!(expired_note(m.expired[0]).contains("expired on 2026-01-09"));
        assert!(contract_for(&list, "maps", Some("a"), Some("x"), today)
            .active
            .is_none());
        assert_eq!(proposal(m.active.unwrap(), Some(3.0)).limit_rps, 7.0);
    }
}
