//! A GitHub-compatible REST client for the one thing rlc needs: open or update the pull
//! request of its stable branch.

use serde::Deserialize;
use serde_json::json;

/// Why a forge call failed. Never carries the token.
#[derive(Debug, thiserror::Error)]
pub enum ForgeError {
    /// Could not reach the API.
    #[error("forge request failed: {0}")]
    Http(#[from] reqwest::Error),
    /// The API answered with an error status.
    #[error("forge answered {status} to {what}: {body}")]
    Status {
        /// HTTP status.
        status: u16,
        /// Which call.
        what: &'static str,
        /// Response body (truncated).
        body: String,
    },
    /// Configuration is incomplete.
    #[error("forge configuration: {0}")]
    Config(String),
}

/// An open pull request.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct PullRequest {
    /// Its number.
    pub number: u64,
    /// Its web page, when the API gives one.
    #[serde(default)]
    pub html_url: Option<String>,
}

/// A GitHub-compatible API for one repository.
#[derive(Clone)]
pub struct Forge {
    http: reqwest::Client,
    api_url: String,
    owner: String,
    repo: String,
    token: String,
}

impl std::fmt::Debug for Forge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Forge")
            .field("api_url", &self.api_url)
            .field("repo", &format!("{}/{}", self.owner, self.repo))
            .finish_non_exhaustive()
    }
}

impl Forge {
    /// `api_url` like `https://api.github.com`, `repo` as `owner/name`.
    pub fn new(api_url: &str, repo: &str, token: String) -> Result<Forge, ForgeError> {
        let (owner, name) = repo
            .split_once('/')
            .ok_or_else(|| ForgeError::Config(format!("forge.repo `{repo}` is not owner/name")))?;
        Ok(Forge {
            http: reqwest::Client::builder()
                .timeout(std::time::Duration::from_secs(30))
                .build()?,
            api_url: api_url.trim_end_matches('/').to_string(),
            owner: owner.to_string(),
            repo: name.to_string(),
            token,
        })
    }

    /// From `config_repo.forge`; `Ok(None)` for kind `none` (branch only).
    pub fn from_config(f: &schema::ForgeConfig) -> Result<Option<Forge>, ForgeError> {
        if f.kind == "none" {
            return Ok(None);
        }
        let repo = f
            .repo
            .as_deref()
            .ok_or_else(|| ForgeError::Config("forge.repo is required".into()))?;
        let env = f.token_env.as_deref().unwrap_or("GITHUB_TOKEN");
        let token = std::env::var(env)
            .map_err(|_| ForgeError::Config(format!("environment variable {env} is not set")))?;
        let api = f.api_url.as_deref().unwrap_or("https://api.github.com");
        Forge::new(api, repo, token).map(Some)
    }

    fn req(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.http
            .request(method, format!("{}{path}", self.api_url))
            .bearer_auth(&self.token)
            .header("Accept", "application/vnd.github+json")
            .header("X-GitHub-Api-Version", "2022-11-28")
            .header("User-Agent", "rlc")
    }

    async fn check(
        resp: reqwest::Response,
        what: &'static str,
    ) -> Result<reqwest::Response, ForgeError> {
        if resp.status().is_success() {
            return Ok(resp);
        }
        let status = resp.status().as_u16();
        let mut body = resp.text().await.unwrap_or_default();
        body.truncate(500);
        Err(ForgeError::Status { status, what, body })
    }

    /// Opens the PR from `head` into `base`, or updates the title and body of the open one.
    /// Returns the PR and whether it was created.
    pub async fn upsert_pull_request(
        &self,
        head: &str,
        base: &str,
        title: &str,
        body: &str,
    ) -> Result<(PullRequest, bool), ForgeError> {
        let list = format!("/repos/{}/{}/pulls", self.owner, self.repo);
        let resp = self
            .req(reqwest::Method::GET, &list)
            .query(&[
                ("head", format!("{}:{head}", self.owner)),
                ("state", "open".to_string()),
            ])
            .send()
            .await?;
        let open: Vec<PullRequest> = Self::check(resp, "list pulls").await?.json().await?;
        if let Some(pr) = open.into_iter().next() {
            let resp = self
                .req(reqwest::Method::PATCH, &format!("{list}/{}", pr.number))
                .json(&json!({"title": title, "body": body}))
                .send()
                .await?;
            let pr: PullRequest = Self::check(resp, "update pull").await?.json().await?;
            tracing::info!(number = pr.number, "updated pull request");
            return Ok((pr, false));
        }
        let resp = self
            .req(reqwest::Method::POST, &list)
            .json(&json!({"title": title, "head": head, "base": base, "body": body}))
            .send()
            .await?;
        let pr: PullRequest = Self::check(resp, "create pull").await?.json().await?;
        tracing::info!(number = pr.number, "opened pull request");
        Ok((pr, true))
    }

    /// Closes the open pull request(s) of `head`, each with `comment` saying why (an issue
    /// comment, then `state: closed`). Returns the closed ones (none when nothing is open).
    pub async fn close_pull_requests(
        &self,
        head: &str,
        comment: &str,
    ) -> Result<Vec<PullRequest>, ForgeError> {
        let list = format!("/repos/{}/{}/pulls", self.owner, self.repo);
        let resp = self
            .req(reqwest::Method::GET, &list)
            .query(&[
                ("head", format!("{}:{head}", self.owner)),
                ("state", "open".to_string()),
            ])
            .send()
            .await?;
        let open: Vec<PullRequest> = Self::check(resp, "list pulls").await?.json().await?;
        let mut closed = Vec::new();
        for pr in open {
            let resp = self
                .req(
                    reqwest::Method::POST,
                    &format!(
                        "/repos/{}/{}/issues/{}/comments",
                        self.owner, self.repo, pr.number
                    ),
                )
                .json(&json!({ "body": comment }))
                .send()
                .await?;
            Self::check(resp, "comment on pull").await?;
            let resp = self
                .req(reqwest::Method::PATCH, &format!("{list}/{}", pr.number))
                .json(&json!({"state": "closed"}))
                .send()
                .await?;
            let pr: PullRequest = Self::check(resp, "close pull").await?.json().await?;
            tracing::info!(number = pr.number, "closed outdated pull request");
            closed.push(pr);
        }
        Ok(closed)
    }
}
