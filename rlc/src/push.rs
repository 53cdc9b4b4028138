//! The GRL controller client (`PUT /v1/config`, `GET /v1/status`, `GET /v1/reports`) and the
//! reconcile loop that brings the controller to the desired config version, retrying with
//! bounded backoff while it is down.
//!
//! Credentials (never logged): `controller.token_env` names the variable holding the
//! credential with the controller's `config` role (`PUT /v1/config`), or `<VAR>_FILE` a file
//! holding it, re-read on every call so that a rotation needs no restart (or
//! `controller.token_file`, a file named in rlc.yaml, relative to it);
//! `controller.reports_token_env` (default: the same credential) the one with the `reports`
//! role (`GET /v1/reports`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use grl_client::tls::ClientTls;
use serde::{Deserialize, Serialize};

// The wire types rlc shares with the controller: the config it pushes (`PUT /v1/config`, the
// base branch's commit and every bucket file at it) and the pages of `GET /v1/reports`.
use grl_wire::{ConfigDoc, ReportPage};

/// Why a controller call failed. Never carries the token.
#[derive(Debug, thiserror::Error)]
pub enum PushError {
    /// Could not reach the controller (down, refused, timed out, a certificate it or rlc
    /// refused), with the cause in words: worth retrying.
    #[error("controller unreachable: {0}")]
    Unreachable(String),
    /// 401: the token is wrong or missing.
    #[error("controller refused the token (401); check the env var named by controller.token_env")]
    Unauthorized,
    /// 403: the credential is known but lacks the endpoint's role.
    #[error("controller refused the credential for this endpoint (403): {0}; rlc needs the `config` role (controller.token_env) and the `reports` role (controller.reports_token_env, default the same credential)")]
    Forbidden(String),
    /// 4xx: the controller refuses this config; retrying the same config will not help.
    #[error("controller rejected the config ({status}): {message}")]
    Rejected {
        /// HTTP status.
        status: u16,
        /// The controller's `error` field.
        message: String,
    },
    /// 5xx or an unreadable answer: worth retrying.
    #[error("controller error ({status}): {message}")]
    Server {
        /// HTTP status.
        status: u16,
        /// Body, truncated.
        message: String,
    },
    /// The controller token env var is not set.
    #[error("neither environment variable {0} nor {0}_FILE is set (controller.token_env / controller.reports_token_env)")]
    NoToken(String),
    /// controller.tls names files that do not load.
    #[error("controller.tls: {0}")]
    Tls(String),
    /// The token file named by `<VAR>_FILE` cannot be read or is empty.
    #[error("controller token file: {0}")]
    TokenFile(String),
}

/// Longest wait for one controller call.
pub const TIMEOUT: Duration = Duration::from_secs(30);

/// Largest controller answer read (a page of reports is a few MB).
pub const MAX_ANSWER_BYTES: usize = 64 << 20;

impl PushError {
    /// A failed call, its cause named ("server certificate expired on DATE", "host name
    /// mismatch", "connection refused", "timed out after N ms").
    fn unreachable(e: reqwest::Error) -> PushError {
        PushError::Unreachable(grl_client::cause::describe(&e, TIMEOUT))
    }

    /// Whether trying again later can succeed without a config change.
    pub fn retryable(&self) -> bool {
        matches!(self, PushError::Unreachable(_) | PushError::Server { .. })
    }
}

/// `GET /v1/status`, the part rlc reads.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
pub struct ControllerStatus {
    /// Active config version (a commit id), if any.
    #[serde(default)]
    pub version: Option<String>,
}

/// One incident override of `GET /v1/overrides`, the part rlc reads.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
pub struct ActiveOverride {
    /// Its id.
    pub id: String,
    /// Why on-call added it.
    #[serde(default)]
    pub reason: String,
    /// Unix seconds it was applied.
    pub created_at: i64,
    /// Unix seconds it stops applying.
    pub expires_at: i64,
    /// Who added it.
    #[serde(default)]
    pub who: String,
    /// The limit it sets, if it sets one.
    #[serde(default)]
    pub limit_rps: Option<f64>,
    /// The drop ratio it sets, if it sets one.
    #[serde(default)]
    pub drop_ratio: Option<f64>,
    /// The criticality tier below which it sheds everything, if it sets one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shed_below: Option<String>,
    /// The served buckets it acts on.
    #[serde(default)]
    pub affects: Vec<OverrideTarget>,
}

impl ActiveOverride {
    /// What it does, in words: `limit 50 rps`, `drop 90 %`, `shed below CRITICAL`.
    pub fn action(&self) -> String {
        match (self.limit_rps, self.drop_ratio, &self.shed_below) {
            (Some(l), _, _) => format!("limit {} rps", schema::format_rps(l)),
            (None, Some(d), _) => format!("drop {} %", (d * 1000.0).round() / 10.0),
            (None, None, Some(t)) => format!("shed below {t}"),
            (None, None, None) => String::new(),
        }
    }
}

/// A bucket an override acts on.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
pub struct OverrideTarget {
    /// Callee service.
    pub service: String,
    /// Bucket name.
    pub bucket: String,
    /// Added for the override (`override:<id>…`) rather than a bucket of the config.
    #[serde(default)]
    pub created: bool,
}

/// `GET /v1/overrides`.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
pub struct OverrideList {
    /// The overrides in force.
    pub overrides: Vec<ActiveOverride>,
}

/// One candidate of `GET /v1/candidates`, the part rlc reads.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
pub struct CandidateCounts {
    /// The candidate's id.
    pub id: String,
    /// Seconds this controller process evaluated it.
    #[serde(default)]
    pub seconds: f64,
    /// Requests offered (cumulative in this epoch).
    #[serde(default)]
    pub offered: f64,
    /// Requests the candidate would have refused.
    #[serde(default)]
    pub virtual_dropped: f64,
    /// Real drops of the bucket in force.
    #[serde(default)]
    pub enforced_dropped: f64,
}

/// `GET /v1/candidates`.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
pub struct CandidatesPage {
    /// The controller process.
    pub epoch: String,
    /// The candidates it evaluates, with their counts.
    #[serde(default)]
    pub candidates: Vec<CandidateCounts>,
}

/// A credential: a value, or a file read at each use.
#[derive(Clone)]
enum Secret {
    Value(String),
    File(PathBuf),
}

impl Secret {
    /// `var`, else the file named by `<var>_FILE`.
    fn from_env(var: &str) -> Result<Secret, PushError> {
        if let Some(v) = std::env::var(var).ok().filter(|v| !v.trim().is_empty()) {
            return Ok(Secret::Value(v.trim().to_string()));
        }
        match std::env::var_os(format!("{var}_FILE")).filter(|v| !v.is_empty()) {
            Some(p) => {
                let s = Secret::file(PathBuf::from(p));
                s.get()?;
                Ok(s)
            }
            None => Err(PushError::NoToken(var.to_string())),
        }
    }

    /// A token file, with a warning when every user can read it.
    fn file(p: PathBuf) -> Secret {
        grl_client::auth::warn_if_world_readable(&p);
        Secret::File(p)
    }

    fn get(&self) -> Result<String, PushError> {
        match self {
            Secret::Value(v) => Ok(v.clone()),
            Secret::File(p) => {
                // Never the content in errors: only the file and what is wrong.
                let text = grl_client::auth::read_secret_file(p)
                    .map_err(|e| PushError::TokenFile(e.to_string()))?;
                let t = text.lines().next().unwrap_or("").trim().to_string();
                if t.is_empty() {
                    return Err(PushError::TokenFile(format!("{}: empty", p.display())));
                }
                Ok(t)
            }
        }
    }
}

/// A client for one controller.
#[derive(Clone)]
pub struct ControllerClient {
    http: reqwest::Client,
    url: String,
    token: Secret,
    reports_token: Option<Secret>,
}

impl std::fmt::Debug for ControllerClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControllerClient")
            .field("url", &self.url)
            .finish_non_exhaustive()
    }
}

impl ControllerClient {
    /// A client for `url` with `token`.
    pub fn new(url: &str, token: String) -> ControllerClient {
        ControllerClient {
            http: reqwest::Client::builder()
                .timeout(TIMEOUT)
                .build()
                .expect("a default reqwest client builds"),
            url: url.trim_end_matches('/').to_string(),
            token: Secret::Value(token),
            reports_token: None,
        }
    }

    /// A client for `url` with `token` that verifies the controller (and presents a client
    /// certificate) as `tls` says.
    pub fn with_tls(
        url: &str,
        token: String,
        tls: &ClientTls,
    ) -> Result<ControllerClient, PushError> {
        let http = tls
            .http_client(TIMEOUT)
            .map_err(|e| PushError::Tls(format!("{e:#}")))?;
        grl_client::tls::warn_plain_http("controller.url", [url]);
        Ok(ControllerClient {
            http,
            url: url.trim_end_matches('/').to_string(),
            token: Secret::Value(token),
            reports_token: None,
        })
    }

    /// From `controller` in rlc.yaml (TLS paths relative to `base_dir`, the directory of
    /// rlc.yaml), reading the credentials from their env vars (or the files their `_FILE`
    /// variables name).
    pub fn from_config(
        c: &schema::ControllerConfig,
        base_dir: &Path,
    ) -> Result<ControllerClient, PushError> {
        let token = match &c.token_file {
            Some(f) => {
                let s = Secret::file(base_dir.join(f));
                s.get()?;
                s
            }
            None => Secret::from_env(&c.token_env)?,
        };
        let reports_token = match &c.reports_token_env {
            Some(var) => Some(Secret::from_env(var)?),
            None => None,
        };
        let tls = c
            .tls
            .as_ref()
            .map(|t| {
                ClientTls {
                    ca: t.ca.as_ref().map(PathBuf::from),
                    cert: t.client_cert.as_ref().map(PathBuf::from),
                    key: t.client_key.as_ref().map(PathBuf::from),
                }
                .relative_to(base_dir)
            })
            .unwrap_or_default();
        let mut client = ControllerClient::with_tls(&c.url, String::new(), &tls)?;
        client.token = token;
        client.reports_token = reports_token;
        Ok(client)
    }

    async fn check(resp: reqwest::Response) -> Result<reqwest::Response, PushError> {
        let status = resp.status();
        if status.is_success() {
            return Ok(resp);
        }
        if status.as_u16() == 401 {
            return Err(PushError::Unauthorized);
        }
        // The error body: its first 64 KiB.
        let mut resp = resp;
        let mut raw = Vec::new();
        while let Ok(Some(piece)) = resp.chunk().await {
            raw.extend_from_slice(&piece[..piece.len().min((64 << 10) - raw.len())]);
            if raw.len() >= 64 << 10 {
                break;
            }
        }
        let text = String::from_utf8_lossy(&raw).into_owned();
        let message = serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(str::to_string))
            .unwrap_or_else(|| text.chars().take(500).collect());
        if status.as_u16() == 403 {
            return Err(PushError::Forbidden(message));
        }
        if status.is_client_error() {
            Err(PushError::Rejected {
                status: status.as_u16(),
                message,
            })
        } else {
            Err(PushError::Server {
                status: status.as_u16(),
                message,
            })
        }
    }

    /// `PUT /v1/config`: the same version twice is a no-op on the controller.
    pub async fn put_config(&self, desired: &ConfigDoc) -> Result<(), PushError> {
        let resp = self
            .http
            .put(format!("{}/v1/config", self.url))
            .bearer_auth(self.token.get()?)
            .json(desired)
            .send()
            .await
            .map_err(PushError::unreachable)?;
        Self::check(resp).await?;
        Ok(())
    }

    /// `GET {path}` with `query`, decoded as JSON; `what` names the answer in errors.
    async fn get_json<T: serde::de::DeserializeOwned>(
        &self,
        path: &str,
        query: &[(&str, String)],
        what: &str,
        token: &Secret,
    ) -> Result<T, PushError> {
        let resp = self
            .http
            .get(format!("{}{path}", self.url))
            .bearer_auth(token.get()?)
            .query(query)
            .send()
            .await
            .map_err(PushError::unreachable)?;
        let mut resp = Self::check(resp).await?;
        let unreadable = |message: String| PushError::Server {
            status: 200,
            message: format!("unreadable {what}: {message}"),
        };
        if resp
            .content_length()
            .is_some_and(|n| n > MAX_ANSWER_BYTES as u64)
        {
            return Err(unreadable(format!("larger than {MAX_ANSWER_BYTES} bytes")));
        }
        let mut body = Vec::new();
        while let Some(piece) = resp.chunk().await.map_err(PushError::unreachable)? {
            if body.len() + piece.len() > MAX_ANSWER_BYTES {
                return Err(unreadable(format!("larger than {MAX_ANSWER_BYTES} bytes")));
            }
            body.extend_from_slice(&piece);
        }
        serde_json::from_slice(&body).map_err(|e| unreadable(e.to_string()))
    }

    /// `GET /v1/overrides`: the incident overrides in force.
    pub async fn overrides(&self) -> Result<OverrideList, PushError> {
        self.get_json("/v1/overrides", &[], "overrides", &self.token)
            .await
    }

    /// `GET /v1/status`.
    pub async fn status(&self) -> Result<ControllerStatus, PushError> {
        self.get_json("/v1/status", &[], "status", &self.token)
            .await
    }

    /// `GET /v1/status` with the protocol version the controller announced (`grl-proto`
    /// header; 1 when absent): candidates go only to a controller of protocol 5 or more.
    pub async fn status_proto(&self) -> Result<(ControllerStatus, u32), PushError> {
        let resp = self
            .http
            .get(format!("{}/v1/status", self.url))
            .bearer_auth(self.token.get()?)
            .send()
            .await
            .map_err(PushError::unreachable)?;
        let resp = Self::check(resp).await?;
        let proto = resp
            .headers()
            .get(grl_wire::PROTO_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u32>().ok())
            .unwrap_or(1);
        let body = resp.bytes().await.map_err(PushError::unreachable)?;
        let st = serde_json::from_slice(&body).map_err(|e| PushError::Server {
            status: 200,
            message: format!("unreadable status: {e}"),
        })?;
        Ok((st, proto))
    }

    /// `GET /v1/candidates`: the counts of the candidates the controller evaluates (`reports`
    /// role).
    pub async fn candidates(&self) -> Result<CandidatesPage, PushError> {
        let token = self.reports_token.as_ref().unwrap_or(&self.token);
        self.get_json("/v1/candidates", &[], "candidates", token)
            .await
    }

    /// `GET /v1/reports?after=CURSOR&limit=N`.
    pub async fn reports(&self, after: Option<&str>, limit: u32) -> Result<ReportPage, PushError> {
        let mut q = vec![("limit", limit.to_string())];
        if let Some(a) = after {
            q.push(("after", a.to_string()));
        }
        let token = self.reports_token.as_ref().unwrap_or(&self.token);
        self.get_json("/v1/reports", &q, "reports", token).await
    }

    /// One reconcile step: reads the active version and pushes `desired` unless the
    /// controller already runs it. Returns whether a PUT was sent.
    pub async fn reconcile_once(&self, desired: &ConfigDoc) -> Result<bool, PushError> {
        let st = self.status().await?;
        if st.version.as_deref() == Some(desired.version.as_str()) {
            return Ok(false);
        }
        self.put_config(desired).await?;
        Ok(true)
    }
}

use crate::retry::Backoff;

/// Brings the controller to `desired`, retrying retryable failures with `backoff`.
/// `on_failure` sees every failed attempt (the daemon counts them in metrics; tests use it to
/// know the controller was really down). Returns whether a PUT was sent.
pub async fn reconcile(
    client: &ControllerClient,
    desired: &ConfigDoc,
    backoff: Backoff,
    mut on_failure: impl FnMut(u32, &PushError),
) -> Result<bool, PushError> {
    let mut attempt = 0u32;
    loop {
        attempt += 1;
        match client.reconcile_once(desired).await {
            Ok(sent) => {
                tracing::info!(version = %desired.version, sent, attempt, "controller reconciled");
                return Ok(sent);
            }
            Err(e) => {
                tracing::warn!(version = %desired.version, attempt, error = %e, "controller push failed");
                on_failure(attempt, &e);
                if !e.retryable() || backoff.exhausted(attempt) {
                    return Err(e);
                }
            }
        }
        tokio::time::sleep(backoff.delay(attempt + 1)).await;
    }
}

#[cfg(test)]
pub(crate) mod tests;
