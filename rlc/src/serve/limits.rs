//! Bounds of the API, reusable by every route: [`BoundedJson`] reads a JSON body of at most
//! `N` bytes (413 beyond, 415 for another media type, 400 for malformed JSON, 422 for JSON
//! of the wrong shape, all problem details), and [`ConcurrencyLimit`] answers 429 with
//! `Retry-After` once `max` requests of an endpoint group are in flight, instead of queueing
//! them (a plain count: no request waits, memory stays bounded).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::extract::{FromRequest, OptionalFromRequest, Request};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use tokio::sync::Semaphore;

use super::problem::Problem;

/// Default bound of a JSON request body: 64 KiB.
pub const MAX_JSON_BODY: usize = 64 * 1024;

/// A JSON request body of at most `N` bytes. Refusals are problem details: 415 unless the
/// content type is `application/json` (parameters such as `charset` allowed), 413 when the
/// body is longer than `N` (from `Content-Length` before reading, else while reading: never
/// more than `N` bytes are held), 400 for malformed JSON, 422 for JSON that does not fit `T`.
/// As `Option<BoundedJson<T>>` an empty body without a content type is `None`.
#[derive(Debug, Clone)]
pub struct BoundedJson<T, const N: usize = MAX_JSON_BODY>(pub T);

fn is_json(h: &HeaderMap) -> bool {
    h.get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json"))
}

fn declared_len(h: &HeaderMap) -> Option<u64> {
    h.get(header::CONTENT_LENGTH)?.to_str().ok()?.parse().ok()
}

/// 413: the body is longer than `n` bytes.
pub(crate) fn too_large(n: usize) -> Problem {
    Problem::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        format!("the request body is longer than {n} bytes"),
    )
}

/// The body, never holding more than `n` bytes: 413 when `Content-Length` says it is longer
/// (before reading) or when it turns out longer while reading, 408 when it does not arrive
/// within 30 s (a client trickling its body would hold the request open), 400 when it cannot
/// be read.
pub async fn read_bounded(
    headers: &HeaderMap,
    body: axum::body::Body,
    n: usize,
) -> Result<axum::body::Bytes, Problem> {
    if declared_len(headers).is_some_and(|l| l > n as u64) {
        return Err(too_large(n));
    }
    let timeout = grl_server::http_util::BODY_TIMEOUT;
    let read = tokio::time::timeout(timeout, axum::body::to_bytes(body, n))
        .await
        .map_err(|_| {
            Problem::new(
                StatusCode::REQUEST_TIMEOUT,
                format!(
                    "the request body did not arrive within {} s",
                    timeout.as_secs()
                ),
            )
        })?;
    read.map_err(|e| {
        let too_big = std::error::Error::source(&e)
            .is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
        if too_big {
            too_large(n)
        } else {
            Problem::new(
                StatusCode::BAD_REQUEST,
                format!("cannot read the body: {e}"),
            )
        }
    })
}

impl<T, S, const N: usize> FromRequest<S> for BoundedJson<T, N>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = Problem;

    async fn from_request(req: Request, _state: &S) -> Result<Self, Problem> {
        if !is_json(req.headers()) {
            return Err(Problem::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "the request body must be JSON (Content-Type: application/json)",
            ));
        }
        let (parts, body) = req.into_parts();
        let body = read_bounded(&parts.headers, body, N).await?;
        let de = &mut serde_json::Deserializer::from_slice(&body);
        serde_path_to_error::deserialize(de)
            .map(BoundedJson)
            .map_err(|e| {
                let inner = e.inner();
                let status = if inner.is_data() {
                    StatusCode::UNPROCESSABLE_ENTITY
                } else {
                    StatusCode::BAD_REQUEST
                };
                let key = e.path().to_string();
                let problem = rlc_plan::whatif::InputProblem {
                    file: "body".into(),
                    line: inner.line(),
                    column: inner.column(),
                    key: if key == "." { String::new() } else { key },
                    message: inner.to_string(),
                };
                Problem::new(status, format!("invalid JSON body: {inner}"))
                    .with_problems(vec![problem])
            })
    }
}

impl<T, S, const N: usize> OptionalFromRequest<S> for BoundedJson<T, N>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = Problem;

    async fn from_request(req: Request, state: &S) -> Result<Option<Self>, Problem> {
        let h = req.headers();
        if !h.contains_key(header::CONTENT_TYPE) && declared_len(h).unwrap_or(0) == 0 {
            // No body announced; a chunked one without a content type is refused below.
            if !h.contains_key(header::TRANSFER_ENCODING) {
                return Ok(None);
            }
        }
        <Self as FromRequest<S>>::from_request(req, state)
            .await
            .map(Some)
    }
}

impl<T: JsonSchema, const N: usize> aide::OperationInput for BoundedJson<T, N> {
    fn operation_input(
        ctx: &mut aide::generate::GenContext,
        operation: &mut aide::openapi::Operation,
    ) {
        <axum::Json<T> as aide::OperationInput>::operation_input(ctx, operation);
    }

    fn inferred_early_responses(
        ctx: &mut aide::generate::GenContext,
        operation: &mut aide::openapi::Operation,
    ) -> Vec<(Option<u16>, aide::openapi::Response)> {
        let mut out = Vec::new();
        for (status, what) in [
            (400, "Malformed JSON."),
            (413, "The body is too long."),
            (415, "The body is not `application/json`."),
            (422, "The JSON does not fit the request's shape."),
        ] {
            if let Some(mut r) =
                <Problem as aide::OperationOutput>::operation_response(ctx, operation)
            {
                r.description = what.into();
                out.push((Some(status), r));
            }
        }
        out
    }
}

/// Seconds a client is told to wait after a 429, on every bounded endpoint.
pub const RETRY_AFTER_SECS: u64 = 1;

/// A bound on the requests in flight through the routes it wraps (`route_layer`): the
/// `max + 1`-th concurrent request is answered at once with 429, `Retry-After` and problem
/// details. Clones share one count, so one limit can guard several routes.
#[derive(Clone)]
pub struct ConcurrencyLimit {
    permits: Arc<Semaphore>,
    retry_after_secs: u64,
}

impl ConcurrencyLimit {
    /// At most `max` requests in flight; refusals ask to retry after `retry_after_secs`.
    pub fn new(max: usize, retry_after_secs: u64) -> ConcurrencyLimit {
        ConcurrencyLimit {
            permits: Arc::new(Semaphore::new(max)),
            retry_after_secs,
        }
    }

    /// A slot, held until the permit is dropped, or the refusal to answer instead: for a
    /// handler that bounds only part of its work (the layer bounds a whole request).
    pub fn try_enter(&self) -> Result<tokio::sync::OwnedSemaphorePermit, Box<Response>> {
        self.permits
            .clone()
            .try_acquire_owned()
            .map_err(|_| Box::new(self.saturated()))
    }

    /// The refusal: 429, `Retry-After`, problem details.
    fn saturated(&self) -> Response {
        let mut r = Problem::new(
            StatusCode::TOO_MANY_REQUESTS,
            format!(
                "too many requests in flight on this endpoint; retry after {} s",
                self.retry_after_secs
            ),
        )
        .into_response();
        r.headers_mut().insert(
            header::RETRY_AFTER,
            HeaderValue::from(self.retry_after_secs),
        );
        r
    }
}

impl<S> tower::Layer<S> for ConcurrencyLimit {
    type Service = Limited<S>;

    fn layer(&self, inner: S) -> Limited<S> {
        Limited {
            inner,
            limit: self.clone(),
        }
    }
}

/// The service of [`ConcurrencyLimit`].
#[derive(Clone)]
pub struct Limited<S> {
    inner: S,
    limit: ConcurrencyLimit,
}

impl<S> tower::Service<Request> for Limited<S>
where
    S: tower::Service<Request, Response = Response> + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request) -> Self::Future {
        match self.limit.try_enter() {
            Ok(permit) => {
                let fut = self.inner.call(req);
                Box::pin(async move {
                    let r = fut.await;
                    drop(permit);
                    r
                })
            }
            Err(refusal) => Box::pin(async move { Ok(*refusal) }),
        }
    }
}

/// `axum::extract::Query` whose refusal (a query string that does not fit `T`) is problem
/// details (400) like every other error of the API, instead of plain text.
#[derive(Debug, Clone, Default)]
pub struct Query<T>(pub T);

impl<T, S> axum::extract::FromRequestParts<S> for Query<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = Problem;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, Problem> {
        axum::extract::Query::<T>::from_request_parts(parts, state)
            .await
            .map(|q| Query(q.0))
            .map_err(|e| Problem::new(StatusCode::BAD_REQUEST, e.body_text()))
    }
}

impl<T: JsonSchema> aide::OperationInput for Query<T> {
    fn operation_input(
        ctx: &mut aide::generate::GenContext,
        operation: &mut aide::openapi::Operation,
    ) {
        <axum::extract::Query<T> as aide::OperationInput>::operation_input(ctx, operation);
    }
}

/// `axum::extract::Path` whose refusal is problem details (400).
#[derive(Debug, Clone)]
pub struct Path<T>(pub T);

impl<T, S> axum::extract::FromRequestParts<S> for Path<T>
where
    T: DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = Problem;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, Problem> {
        axum::extract::Path::<T>::from_request_parts(parts, state)
            .await
            .map(|p| Path(p.0))
            .map_err(|e| Problem::new(StatusCode::BAD_REQUEST, e.body_text()))
    }
}

impl<T: JsonSchema> aide::OperationInput for Path<T> {
    fn operation_input(
        ctx: &mut aide::generate::GenContext,
        operation: &mut aide::openapi::Operation,
    ) {
        <axum::extract::Path<T> as aide::OperationInput>::operation_input(ctx, operation);
    }
}
