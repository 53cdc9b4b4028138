//! The one HTTP error type of the control plane: a closed map to status codes with a JSON
//! `{"error": "..."}` body.

use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::de::DeserializeOwned;

/// An error answered to an HTTP client.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// Missing or wrong bearer token.
    #[error("missing or invalid bearer token")]
    Unauthorized,
    /// A valid credential that does not cover this request.
    #[error("{0}")]
    Forbidden(String),
    /// The body exceeds the endpoint's limit.
    #[error("request body larger than {0} bytes")]
    TooLarge(usize),
    /// The body is not the expected JSON.
    #[error("malformed request: {0}")]
    BadRequest(String),
    /// Well-formed but refused by validation.
    #[error("{0}")]
    Invalid(String),
    /// No such resource.
    #[error("{0}")]
    NotFound(String),
    /// A failure on our side (details logged, not returned).
    #[error("internal error")]
    Internal(String),
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = match &self {
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ApiError::Invalid(_) => StatusCode::UNPROCESSABLE_ENTITY,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::Internal(detail) => {
                tracing::error!(detail = %detail, "internal error");
                StatusCode::INTERNAL_SERVER_ERROR
            }
        };
        (
            status,
            Json(serde_json::json!({ "error": self.to_string() })),
        )
            .into_response()
    }
}

/// Parses a JSON body, turning serde's message into a 400 with the reason.
pub fn parse_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::BadRequest(e.to_string()))
}

/// Reads a request body of at most `limit` bytes (413 beyond). Call it only once the
/// request is authenticated: until then nothing of the body is read.
pub async fn read_body(
    body: axum::body::Body,
    limit: usize,
) -> Result<axum::body::Bytes, ApiError> {
    axum::body::to_bytes(body, limit).await.map_err(|e| {
        // axum wraps http-body-util's `LengthLimitError` ("length limit exceeded").
        let mut too_large = false;
        let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(&e);
        while let Some(err) = cur {
            too_large |= err.to_string().contains("length limit exceeded");
            cur = err.source();
        }
        if too_large {
            ApiError::TooLarge(limit)
        } else {
            ApiError::BadRequest(format!("reading the body: {e}"))
        }
    })
}

/// Checks `Authorization: Bearer <token>` in constant time over the token's length.
pub fn check_token(headers: &HeaderMap, token: &str) -> Result<(), ApiError> {
    let got = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .ok_or(ApiError::Unauthorized)?;
    let (a, b) = (got.as_bytes(), token.as_bytes());
    let same = a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0;
    if same && !token.is_empty() {
        Ok(())
    } else {
        Err(ApiError::Unauthorized)
    }
}

/// Unix seconds now.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A running HTTP server with one background loop (the controller's ticker, an aggregator's
/// forwarder): its address, and a way to stop both.
pub struct ServerHandle {
    pub(crate) addr: std::net::SocketAddr,
    pub(crate) stop: tokio::sync::oneshot::Sender<()>,
    pub(crate) server: tokio::task::JoinHandle<()>,
    pub(crate) background: tokio::task::JoinHandle<()>,
}

impl ServerHandle {
    /// Base URL, e.g. `http://127.0.0.1:7070`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The bound address.
    pub fn addr(&self) -> std::net::SocketAddr {
        self.addr
    }

    /// Stops the background loop and the server (in-flight requests finish).
    pub async fn shutdown(self) {
        let _ = self.stop.send(());
        self.background.abort();
        let _ = self.server.await;
    }
}
