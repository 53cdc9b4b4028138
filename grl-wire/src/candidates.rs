//! Candidate limits (protocol 5): a change that could refuse more traffic reaches the
//! controller as a [`Candidate`] beside the limit in force, in `PUT /v1/config`
//! ([`crate::ConfigDoc::candidates`]). The controller evaluates each candidate every tick (the
//! drop ratio it would apply, the requests it would have dropped) while clients keep enforcing
//! the limit in force, and reports the counts at `GET /v1/candidates` ([`CandidatesReply`]).
//! The controller never serves candidates in `GET /v1/config`: aggregators and clients (of any
//! protocol version) see the limit in force only.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

use schema::Bucket;

/// The most candidates one config may carry.
pub const MAX_CANDIDATES: usize = 10_000;

/// The longest candidate id, in bytes.
pub const MAX_CANDIDATE_ID: usize = 128;

/// A limit watched in shadow beside the one in force.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Candidate {
    /// Opaque, chosen by the proposer (stable per proposed change); unique in a config,
    /// at most [`MAX_CANDIDATE_ID`] bytes.
    pub id: String,
    /// Callee service.
    pub service: String,
    /// The bucket as it would be after the change. Its `name` is the in-force bucket it would
    /// replace, or a new name for a bucket not yet in force.
    pub bucket: Bucket,
}

/// A candidate that cannot be accepted: the field (`candidates[3].bucket.limit_rps`) and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct CandidateError {
    /// The field, as a path in the config document.
    pub field: String,
    /// What is wrong with it.
    pub message: String,
}

fn err(field: String, message: impl Into<String>) -> CandidateError {
    CandidateError {
        field,
        message: message.into(),
    }
}

/// The checks on candidates that need nothing but the candidates: at most
/// [`MAX_CANDIDATES`], ids non-empty, at most [`MAX_CANDIDATE_ID`] bytes and unique, a
/// service and a bucket name, a finite positive `limit_rps`, a caller or a procedure. The
/// controller adds its own (the bucket compiles beside the service's others).
pub fn check_candidates(candidates: &[Candidate]) -> Result<(), CandidateError> {
    if candidates.len() > MAX_CANDIDATES {
        return Err(err(
            "candidates".into(),
            format!(
                "{} candidates, more than {MAX_CANDIDATES}",
                candidates.len()
            ),
        ));
    }
    let mut ids = HashSet::with_capacity(candidates.len());
    for (i, c) in candidates.iter().enumerate() {
        let at = |f: &str| format!("candidates[{i}].{f}");
        if c.id.trim().is_empty() {
            return Err(err(at("id"), "must not be empty"));
        }
        if c.id.len() > MAX_CANDIDATE_ID {
            return Err(err(
                at("id"),
                format!("{} bytes, more than {MAX_CANDIDATE_ID}", c.id.len()),
            ));
        }
        if !ids.insert(c.id.as_str()) {
            return Err(err(at("id"), format!("`{}` appears twice", c.id)));
        }
        if c.service.trim().is_empty() {
            return Err(err(at("service"), "must not be empty"));
        }
        if c.bucket.name.trim().is_empty() {
            return Err(err(at("bucket.name"), "must not be empty"));
        }
        if !(c.bucket.limit_rps.is_finite() && c.bucket.limit_rps > 0.0) {
            return Err(err(
                at("bucket.limit_rps"),
                format!(
                    "must be a finite number above 0, not {}",
                    c.bucket.limit_rps
                ),
            ));
        }
        if c.bucket.caller.is_none() && c.bucket.procedure.is_none() {
            return Err(err(at("bucket"), "needs a caller or a procedure (or both)"));
        }
    }
    Ok(())
}

/// `GET /v1/candidates` on the controller (credential role `reports`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct CandidatesReply {
    /// A random id made at controller start: counts of another epoch are another series
    /// (a restarted controller counts from zero).
    pub epoch: String,
    /// The controller's clock (unix milliseconds).
    pub now_ms: u64,
    /// Every candidate of the config in force, in the order pushed.
    pub candidates: Vec<CandidateReport>,
}

/// One candidate's counts, cumulative since `since_ms`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct CandidateReport {
    /// [`Candidate::id`].
    pub id: String,
    /// Callee service.
    pub service: String,
    /// Bucket name.
    pub bucket: String,
    /// The candidate's limit.
    pub limit_rps: f64,
    /// The candidate's mode (`enforce` or `shadow`).
    pub mode: schema::Mode,
    /// The limit in force for the bucket of that name (None: no such bucket in force).
    pub in_force_limit_rps: Option<f64>,
    /// When this controller process began evaluating the candidate (unix milliseconds).
    pub since_ms: u64,
    /// Seconds evaluated (the ticks' lengths summed).
    pub seconds: f64,
    /// Requests offered to the candidate's match (rate × tick length, summed over ticks and
    /// scope keys).
    pub offered: f64,
    /// Requests the candidate's drop ratio would have dropped.
    pub virtual_dropped: f64,
    /// Requests the in-force bucket really dropped over the same ticks.
    pub enforced_dropped: f64,
    /// `virtual_dropped / offered` (0 when nothing was offered).
    pub virtual_drop_share: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(id: &str, limit: f64) -> Candidate {
        Candidate {
            id: id.into(),
            service: "payments".into(),
            bucket: Bucket {
                name: "charge".into(),
                caller: None,
                procedure: Some("Charge".into()),
                scope: Default::default(),
                limit_rps: limit,
                mode: Default::default(),
                policy: schema::PolicyName::Manual,
            },
        }
    }

    #[test]
    fn errors_name_the_field() {
        assert!(check_candidates(&[cand("a", 100.0), cand("b", 5.0)]).is_ok());
        let e = check_candidates(&[
            cand("a", 1.0),
            cand("b", 1.0),
            cand("c", 1.0),
            cand("d", f64::NAN),
        ])
        .unwrap_err();
        assert_eq!(e.field, "candidates[3].bucket.limit_rps");
        let e = check_candidates(&[cand("a", 1.0), cand("a", 2.0)]).unwrap_err();
        assert_eq!(e.field, "candidates[1].id");
        assert!(e.to_string().contains("twice"), "{e}");
        let e = check_candidates(&[cand(&"x".repeat(129), 1.0)]).unwrap_err();
        assert_eq!(e.field, "candidates[0].id");
        let mut c = cand("a", 1.0);
        c.bucket.procedure = None;
        assert_eq!(
            check_candidates(&[c]).unwrap_err().field,
            "candidates[0].bucket"
        );
        let many: Vec<_> = (0..=MAX_CANDIDATES)
            .map(|i| cand(&i.to_string(), 1.0))
            .collect();
        assert_eq!(check_candidates(&many).unwrap_err().field, "candidates");
    }

    #[test]
    fn unknown_fields_are_refused() {
        let e = serde_json::from_str::<Candidate>(
            r#"{"id":"a","service":"s","bucket":{"name":"b","procedure":"P","limit_rps":1},"extra":1}"#,
        )
        .unwrap_err();
        assert!(e.to_string().contains("extra"), "{e}");
    }
}
