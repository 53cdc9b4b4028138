//! Error answers of the `/v1/quotas` and `/v1/previews` endpoints as RFC 9457 problem details
//! (`application/problem+json`): a status, a title, a detail in words, and for invalid input
//! every problem found (file, line, key, message), so a caller fixes them all at once.
//! The endpoints that answered `{"error": "..."}` before problem details answer
//! [`CompatProblem`]: the same problem with that `error` member kept.

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use schemars::JsonSchema;
use serde::Serialize;

/// The media type of problem details.
pub const PROBLEM_JSON: &str = "application/problem+json";

use rlc_plan::whatif::InputProblem;

/// An RFC 9457 problem details body.
#[derive(Debug, Clone, Serialize, JsonSchema)]
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
    // `default` tells the schema the member is optional.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
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

/// A [`Problem`] that keeps the `error` member (the same text as `detail`) of the endpoints
/// that answered `{"error": "..."}` before problem details, so their callers keep working.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct CompatProblem {
    /// The problem.
    #[serde(flatten)]
    pub problem: Problem,
    /// The same text as `detail` (absent from the refusals of a request's form: query,
    /// path, body).
    #[serde(default)]
    pub error: String,
}

impl CompatProblem {
    /// A problem with `status` and `detail`, `error` repeating `detail`.
    pub fn new(status: StatusCode, detail: impl Into<String>) -> CompatProblem {
        let problem = Problem::new(status, detail);
        CompatProblem {
            error: problem.detail.clone(),
            problem,
        }
    }
}

impl IntoResponse for CompatProblem {
    fn into_response(self) -> Response {
        let status =
            StatusCode::from_u16(self.problem.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = serde_json::to_vec(&self).unwrap_or_default();
        (status, [(header::CONTENT_TYPE, PROBLEM_JSON)], body).into_response()
    }
}

/// The OpenAPI response of a problem type: `application/problem+json` with its schema.
fn problem_response<T: JsonSchema>(
    ctx: &mut aide::generate::GenContext,
) -> aide::openapi::Response {
    let schema = ctx.schema.subschema_for::<T>().into_object();
    aide::openapi::Response {
        description: "Problem details (RFC 9457).".into(),
        content: [(
            PROBLEM_JSON.to_string(),
            aide::openapi::MediaType {
                schema: Some(aide::openapi::SchemaObject {
                    json_schema: schema.into(),
                    example: None,
                    external_docs: None,
                }),
                ..Default::default()
            },
        )]
        .into_iter()
        .collect(),
        ..Default::default()
    }
}

impl aide::OperationOutput for Problem {
    type Inner = Self;

    fn operation_response(
        ctx: &mut aide::generate::GenContext,
        _operation: &mut aide::openapi::Operation,
    ) -> Option<aide::openapi::Response> {
        Some(problem_response::<Problem>(ctx))
    }
}

impl aide::OperationOutput for CompatProblem {
    type Inner = Self;

    fn operation_response(
        ctx: &mut aide::generate::GenContext,
        _operation: &mut aide::openapi::Operation,
    ) -> Option<aide::openapi::Response> {
        Some(problem_response::<CompatProblem>(ctx))
    }
}
