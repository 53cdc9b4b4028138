//! The one HTTP error type of the control plane: a closed map to status codes with a JSON
//! `{"error": "..."}` body, bounded request bodies, signals, health and readiness answers and
//! the serving handles of every daemon. Calls to other tiers (`call`, `CallError`) are
//! `grl_client::http_util`'s.

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
    /// A dependency (the state database) is unreachable: nothing was changed, retry later.
    #[error("{0}")]
    Unavailable(String),
    /// A bound of the server is reached (a service's budget of rates held): retry later.
    #[error("{0}")]
    TooMany(String),
    /// The body did not arrive within [`BODY_TIMEOUT`].
    #[error("request body not received within {} s", BODY_TIMEOUT.as_secs())]
    Timeout,
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
            ApiError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Timeout => StatusCode::REQUEST_TIMEOUT,
            ApiError::TooMany(_) => StatusCode::TOO_MANY_REQUESTS,
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

/// How long a request body may take to arrive (408 beyond): a client trickling its body holds
/// a connection for at most this long.
pub const BODY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Reads a request body of at most `limit` bytes (413 beyond) within [`BODY_TIMEOUT`] (408
/// beyond). Call it only once the request is authenticated: until then nothing of the body
/// is read.
pub async fn read_body(
    body: axum::body::Body,
    limit: usize,
) -> Result<axum::body::Bytes, ApiError> {
    let read = tokio::time::timeout(BODY_TIMEOUT, axum::body::to_bytes(body, limit));
    read.await.map_err(|_| ApiError::Timeout)?.map_err(|e| {
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
    let got = grl_client::auth::bearer(headers).ok_or(ApiError::Unauthorized)?;
    if grl_client::auth::ct_eq(got.as_bytes(), token.as_bytes()) && !token.is_empty() {
        Ok(())
    } else {
        Err(ApiError::Unauthorized)
    }
}

/// How long a shutdown waits for in-flight requests, and then for the background loop's last
/// work, unless told otherwise ([`ServerHandle::shutdown_within`]).
pub const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

/// Waits for SIGTERM or SIGINT (Ctrl-C) and returns which one came. A process that cannot
/// install the SIGTERM handler still stops on SIGINT.
pub async fn shutdown_signal() -> &'static str {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot handle SIGTERM; only SIGINT stops this process gracefully");
                std::future::pending::<()>().await
            }
        }
    };
    tokio::select! {
        _ = term => "SIGTERM",
        r = tokio::signal::ctrl_c() => {
            if let Err(e) = r {
                tracing::warn!(error = %e, "cannot handle SIGINT");
                std::future::pending::<()>().await;
            }
            "SIGINT"
        }
    }
}

/// A running HTTP server with one background loop (the controller's ticker, an aggregator's
/// forwarder): its address, and a way to stop both.
pub struct ServerHandle {
    /// The address it listens on.
    pub addr: std::net::SocketAddr,
    /// `https` when serving TLS, else `http`.
    pub scheme: &'static str,
    /// Stops accepting; in-flight requests finish.
    pub stop: tokio::sync::oneshot::Sender<()>,
    /// The serving task.
    pub server: tokio::task::JoinHandle<()>,
    /// Tells the background loop to do its last work (flush) and return.
    pub finish: tokio::sync::oneshot::Sender<()>,
    /// The background loop's task.
    pub background: tokio::task::JoinHandle<()>,
    /// The health listener (`/healthz`, `/readyz` only), when one was asked for.
    pub health: Option<HealthServer>,
}

/// A listener serving the health paths only, apart from the main one: an orchestrator's
/// probes reach it however many connections the main port holds.
pub struct HealthServer {
    addr: std::net::SocketAddr,
    stop: tokio::sync::oneshot::Sender<()>,
    server: tokio::task::JoinHandle<()>,
}

/// Connections the health listener serves at once.
const HEALTH_LISTENER_CONNECTIONS: usize = 64;

/// Binds `addr` (when given) and serves `health` on it: the routes `/healthz` and `/readyz`
/// of the server, with its TLS and timeouts and a cap of 64 connections.
pub async fn spawn_health(
    addr: Option<std::net::SocketAddr>,
    health: axum::Router,
    tls: Option<std::sync::Arc<crate::tls::ReloadingServerConfig>>,
    limits: crate::server::ServeLimits,
    what: &'static str,
) -> anyhow::Result<Option<HealthServer>> {
    use anyhow::Context;
    let Some(addr) = addr else {
        return Ok(None);
    };
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("bind the health listener {addr}"))?;
    let addr = listener.local_addr()?;
    let limits = crate::server::ServeLimits {
        max_connections: HEALTH_LISTENER_CONNECTIONS,
        health_connections: 0,
        ..limits
    };
    let (stop, server) = spawn_server(listener, health, tls, limits, Default::default(), what);
    tracing::info!(%addr, "health listener (/healthz, /readyz only)");
    Ok(Some(HealthServer { addr, stop, server }))
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

    /// The health listener's address, when one was asked for.
    pub fn health_addr(&self) -> Option<std::net::SocketAddr> {
        self.health.as_ref().map(|h| h.addr)
    }

    /// [`Self::shutdown_within`] with [`SHUTDOWN_GRACE`].
    pub async fn shutdown(self) -> bool {
        self.shutdown_within(SHUTDOWN_GRACE).await
    }

    /// Stops gracefully: stops accepting connections, lets in-flight requests finish for up to
    /// `grace` (then cuts the connections left), then lets the background loop do its last
    /// work (an aggregator forwards the counts it still holds) for up to `grace` again.
    /// Returns whether everything finished within the bounds.
    pub async fn shutdown_within(self, grace: std::time::Duration) -> bool {
        let _ = self.stop.send(());
        if let Some(h) = self.health {
            let _ = h.stop.send(());
            let mut server = h.server;
            if tokio::time::timeout(grace, &mut server).await.is_err() {
                server.abort();
            }
        }
        let mut clean = true;
        let mut server = self.server;
        if tokio::time::timeout(grace, &mut server).await.is_err() {
            tracing::warn!(
                grace_ms = grace.as_millis() as u64,
                "in-flight requests still running after the shutdown grace: connections cut"
            );
            server.abort();
            clean = false;
        }
        let _ = self.finish.send(());
        let mut background = self.background;
        if tokio::time::timeout(grace, &mut background).await.is_err() {
            tracing::warn!(
                grace_ms = grace.as_millis() as u64,
                "background loop did not finish within the shutdown grace: stopped"
            );
            background.abort();
            clean = false;
        }
        clean
    }
}

/// Serves `router` on `listener` (over TLS when `tls` is given, with `limits`, counting in
/// `stats`) in a task until the returned sender fires or drops; `what` names the server in
/// logs.
pub fn spawn_server(
    listener: tokio::net::TcpListener,
    router: axum::Router,
    tls: Option<std::sync::Arc<crate::tls::ReloadingServerConfig>>,
    limits: crate::server::ServeLimits,
    stats: std::sync::Arc<crate::server::ServerStats>,
    what: &'static str,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
) {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        let r = crate::server::serve_with(listener, router, tls, limits, stats, async {
            let _ = stopped.await;
        })
        .await;
        if let Err(e) = r {
            tracing::error!(error = %e, "{what} server failed");
        }
    });
    (stop, server)
}

/// `GET /healthz` of every daemon (liveness): the process answers.
pub async fn healthz() -> &'static str {
    "ok\n"
}

/// One check of a readiness answer.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
pub struct ReadinessCheck {
    /// Whether this check passes.
    pub ok: bool,
    /// What was found (`leader`, `config version abc…`, the error).
    pub detail: String,
}

/// The answer of `GET /readyz` (readiness) of every daemon: 200 when every check passes, 503
/// otherwise, with `reason` naming the failed checks.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
pub struct Readiness {
    /// Whether every check passes.
    pub ready: bool,
    /// The failed checks and why (`store: connection refused`); absent when ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Every check by name.
    pub checks: std::collections::BTreeMap<String, ReadinessCheck>,
}

impl Readiness {
    /// From `(name, Ok(detail) | Err(detail))` checks.
    pub fn from_checks<'a>(
        checks: impl IntoIterator<Item = (&'a str, Result<String, String>)>,
    ) -> Readiness {
        let mut map = std::collections::BTreeMap::new();
        let mut failed = Vec::new();
        for (name, r) in checks {
            let (ok, detail) = match r {
                Ok(d) => (true, d),
                Err(d) => {
                    failed.push(format!("{name}: {d}"));
                    (false, d)
                }
            };
            map.insert(name.to_string(), ReadinessCheck { ok, detail });
        }
        Readiness {
            ready: failed.is_empty(),
            reason: (!failed.is_empty()).then(|| failed.join("; ")),
            checks: map,
        }
    }
}

impl IntoResponse for Readiness {
    fn into_response(self) -> Response {
        let status = if self.ready {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        };
        (status, Json(self)).into_response()
    }
}
