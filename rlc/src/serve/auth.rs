//! Who may call what on `rlc serve`. Two bearer tokens, both read from environment variables
//! named in rlc.yaml (never from a flag, never logged):
//!
//! - the write token (`server.token_env`): mutating endpoints (`POST /v1/runs`) need it; without
//!   one configured they are not enabled (403, saying so);
//! - the read token (`server.read_token_env`, optional): when configured, the read endpoints
//!   (`GET /`, `GET /v1/...`) need it or the write token; when not, they are open.
//!
//! `/healthz`, `/metrics` and `/openapi.json` stay open (probes, Prometheus, API clients that
//! describe the API before they hold a token). No or an unknown token: 401 with
//! `WWW-Authenticate: Bearer`; the read token on a mutating endpoint: 403. Decided from the
//! headers before any body is read; tokens are compared in constant time
//! ([`grl_server::http_util::check_token`]).

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::problem::CompatProblem;
use super::AppState;

/// The tokens of the API.
#[derive(Clone, Default)]
pub struct Tokens {
    /// The write token (None: every mutating call is refused).
    pub write: Option<String>,
    /// The read token (None: the read endpoints are open).
    pub read: Option<String>,
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the secrets themselves.
        f.debug_struct("Tokens")
            .field("write", &self.write.is_some())
            .field("read", &self.read.is_some())
            .finish()
    }
}

/// What an endpoint needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Right {
    /// Reading: the read or the write token (or nothing when no read token is configured).
    Read,
    /// Changing something: the write token.
    Write,
}

impl Tokens {
    /// Reads both tokens from the environment variables `token_env` and `read_token_env`;
    /// an empty variable counts as unset.
    pub fn from_env(token_env: &str, read_token_env: Option<&str>) -> Tokens {
        let var = |v: &str| std::env::var(v).ok().filter(|t| !t.is_empty());
        Tokens {
            write: var(token_env),
            read: read_token_env.and_then(var),
        }
    }

    /// The strongest right the request's bearer token holds.
    fn held(&self, h: &HeaderMap) -> Option<Right> {
        let matches = |t: &Option<String>| {
            t.as_deref()
                .is_some_and(|t| grl_server::http_util::check_token(h, t).is_ok())
        };
        if matches(&self.write) {
            Some(Right::Write)
        } else if matches(&self.read) {
            Some(Right::Read)
        } else {
            None
        }
    }

    /// Whether a request with headers `h` may use an endpoint that needs `need`; why not
    /// otherwise.
    pub fn check(&self, h: &HeaderMap, need: Right) -> Result<(), Refusal> {
        if need == Right::Read && self.read.is_none() {
            return Ok(());
        }
        if need == Right::Write && self.write.is_none() {
            return Err(Refusal::NotEnabled);
        }
        match (self.held(h), need) {
            (Some(Right::Write), _) | (Some(Right::Read), Right::Read) => Ok(()),
            (Some(Right::Read), Right::Write) => Err(Refusal::Forbidden),
            (None, _) => Err(Refusal::Unauthorized {
                presented: h.contains_key(header::AUTHORIZATION),
            }),
        }
    }
}

/// Why a request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No credential, a malformed one or an unknown one (401); `presented`: an
    /// `Authorization` header was sent.
    Unauthorized { presented: bool },
    /// A known token without the right (403).
    Forbidden,
    /// A mutating endpoint on a server without a write token: not enabled, whatever the
    /// request carries (403).
    NotEnabled,
}

/// The detail of [`Refusal::NotEnabled`].
pub const NOT_ENABLED: &str = "runs and other changes through the API are not enabled on this \
     server: no write token is configured (rlc.yaml `server.token_env` names an environment \
     variable that is unset or empty when rlc serve starts)";

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        match self {
            Refusal::Forbidden => CompatProblem::new(
                StatusCode::FORBIDDEN,
                "the read token cannot do this; it needs the write token",
            )
            .into_response(),
            Refusal::NotEnabled => {
                CompatProblem::new(StatusCode::FORBIDDEN, NOT_ENABLED).into_response()
            }
            // The challenge of RFC 6750.
            Refusal::Unauthorized { presented } => {
                let mut r =
                    CompatProblem::new(StatusCode::UNAUTHORIZED, "missing or wrong bearer token")
                        .into_response();
                let challenge = if presented {
                    r#"Bearer realm="rlc", error="invalid_token""#
                } else {
                    r#"Bearer realm="rlc""#
                };
                r.headers_mut().insert(
                    header::WWW_AUTHENTICATE,
                    HeaderValue::from_static(challenge),
                );
                r
            }
        }
    }
}

/// Middleware of the read endpoints (`route_layer`).
pub async fn require_read(State(s): State<AppState>, req: Request, next: Next) -> Response {
    match s.tokens().check(req.headers(), Right::Read) {
        Ok(()) => next.run(req).await,
        Err(refusal) => refusal.into_response(),
    }
}

/// Middleware of the mutating endpoints (`route_layer`): runs before the body is read.
pub async fn require_write(State(s): State<AppState>, req: Request, next: Next) -> Response {
    match s.tokens().check(req.headers(), Right::Write) {
        Ok(()) => next.run(req).await,
        Err(refusal) => refusal.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(token: Option<&str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(t) = token {
            h.insert(
                header::AUTHORIZATION,
                format!("Bearer {t}").parse().unwrap(),
            );
        }
        h
    }

    fn status(r: Result<(), Refusal>) -> u16 {
        r.map_or_else(|r| r.into_response().status().as_u16(), |()| 200)
    }

    #[test]
    fn read_and_write_rights() {
        let both = Tokens {
            write: Some("write-secret".into()),
            read: Some("read-secret".into()),
        };
        let check = |t: &Tokens, tok, need| status(t.check(&with(tok), need));
        for (tok, read, write) in [
            (None, 401, 401),
            (Some("nope"), 401, 401),
            (Some("read-secret"), 200, 403),
            (Some("write-secret"), 200, 200),
            // A prefix of a token is not the token.
            (Some("write-secre"), 401, 401),
        ] {
            assert_eq!(check(&both, tok, Right::Read), read, "{tok:?} read");
            assert_eq!(check(&both, tok, Right::Write), write, "{tok:?} write");
        }
        // Without a read token reading is open; without a write token nothing is writable,
        // and the answer says it is not enabled rather than asking for a token.
        let none = Tokens::default();
        assert_eq!(check(&none, None, Right::Read), 200);
        for tok in [None, Some("x")] {
            let r = none
                .check(&with(tok), Right::Write)
                .unwrap_err()
                .into_response();
            assert_eq!(r.status(), 403, "{tok:?}");
            assert!(r.headers().get(header::WWW_AUTHENTICATE).is_none());
        }
        assert!(NOT_ENABLED.contains("not enabled") && NOT_ENABLED.contains("server.token_env"));
        // A malformed header (not `Bearer <token>`) is no credential.
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, "Basic d3JpdGU=".parse().unwrap());
        let r = both.check(&h, Right::Read).unwrap_err().into_response();
        assert_eq!(r.status(), 401);
        assert_eq!(
            r.headers()[header::WWW_AUTHENTICATE],
            r#"Bearer realm="rlc", error="invalid_token""#
        );
        let r = both
            .check(&HeaderMap::new(), Right::Read)
            .unwrap_err()
            .into_response();
        assert_eq!(
            r.headers()[header::WWW_AUTHENTICATE],
            r#"Bearer realm="rlc""#
        );
    }
}
