//! Error answers of the `/v1/quotas` and `/v1/previews` endpoints as RFC 9457 problem details
//! (`application/problem+json`): a status, a title, a detail in words, and for invalid input
//! every problem found (file, line, key, message), so a caller fixes them all at once.

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

/// The media type of problem details.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// One problem of an input, as `rlc validate` reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct InputProblem {
    /// The file the problem is in (`rlc/policies.yaml`, `body`, ...).
    pub file: String,
    /// 1-based line (0 when the problem is about the whole input).
    pub line: usize,
    /// 1-based column (0 when unknown).
    pub column: usize,
    /// The YAML path of the key, e.g. `defaults.headroom` (empty for the whole file).
    pub key: String,
    /// What is wrong.
    pub message: String,
}

impl From<&schema::Diagnostic> for InputProblem {
    fn from(d: &schema::Diagnostic) -> InputProblem {
        InputProblem {
            file: d.file.to_string_lossy().into_owned(),
            line: d.line,
            column: d.column,
            key: d.key.clone(),
            message: d.message.clone(),
        }
    }
}

/// An RFC 9457 problem details body.
#[derive(Debug, Clone, Serialize)]
pub struct Problem {
    /// `about:blank`: the status says what kind of problem it is.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The status's reason phrase.
    pub title: String,
    /// The HTTP status.
    pub status: u16,
    /// What went wrong, in words.
    pub detail: String,
    /// Every problem of the input, for 400 and 422.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub problems: Vec<InputProblem>,
}

impl Problem {
    /// A problem with `status` and `detail`.
    pub fn new(status: StatusCode, detail: impl Into<String>) -> Problem {
        Problem {
            kind: "about:blank",
            title: status.canonical_reason().unwrap_or("Error").to_string(),
            status: status.as_u16(),
            detail: detail.into(),
            problems: Vec::new(),
        }
    }

    /// Adds the problems of an input.
    pub fn with_problems(mut self, problems: Vec<InputProblem>) -> Problem {
        self.problems = problems;
        self
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = serde_json::to_vec(&self).unwrap_or_default();
        (status, [(header::CONTENT_TYPE, PROBLEM_JSON)], body).into_response()
    }
}
