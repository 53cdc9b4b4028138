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
    /// `https` when serving TLS, else `http`.
    pub(crate) scheme: &'static str,
    pub(crate) stop: tokio::sync::oneshot::Sender<()>,
    pub(crate) server: tokio::task::JoinHandle<()>,
    pub(crate) background: tokio::task::JoinHandle<()>,
}

impl ServerHandle {
    /// Base URL, e.g. `http://127.0.0.1:7070` (`https://` when serving TLS).
    pub fn url(&self) -> String {
        format!("{}://{}", self.scheme, self.addr)
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

/// Serves `router` on `listener` (over TLS when `tls` is given) in a task until the returned
/// sender fires or drops; `what` names the server in logs.
pub(crate) fn spawn_server(
    listener: tokio::net::TcpListener,
    router: axum::Router,
    tls: Option<std::sync::Arc<crate::tls::ReloadingServerConfig>>,
    what: &'static str,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
) {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        let r = crate::tls::serve(listener, router, tls, async {
            let _ = stopped.await;
        })
        .await;
        if let Err(e) = r {
            tracing::error!(error = %e, "{what} server failed");
        }
    });
    (stop, server)
}
