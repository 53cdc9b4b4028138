//! Forge clients for the one thing rlc needs: open or update the pull (merge) request of its
//! stable branch, with labels and reviewers, and close an outdated one with a comment saying
//! why. [`Forge`] is the one interface; [`GitHub`] (REST, `Authorization: Bearer`) and
//! [`GitLab`] (REST API v4, `PRIVATE-TOKEN`) implement it.

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

/// Labels and reviewers put on a pull request when it is opened or updated.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Decoration {
    /// Label names.
    pub labels: Vec<String>,
    /// Reviewers: user names (GitLab also takes numeric user ids).
    pub reviewers: Vec<String>,
}

/// The forge hosting the config repo's pull requests.
#[derive(Debug, Clone)]
pub enum Forge {
    /// GitHub or a GitHub-compatible API (Gitea, Forgejo).
    GitHub(GitHub),
    /// GitLab (merge requests, REST API v4).
    GitLab(GitLab),
}

impl Forge {
    /// A GitHub client: `api_url` like `https://api.github.com`, `repo` as `owner/name`.
    pub fn new(api_url: &str, repo: &str, token: String) -> Result<Forge, ForgeError> {
        GitHub::new(api_url, repo, token).map(Forge::GitHub)
    }

    /// From `config_repo.forge`; `Ok(None)` for kind `none` (branch only).
    pub fn from_config(f: &schema::ForgeConfig) -> Result<Option<Forge>, ForgeError> {
        let token = |default_env: &str| {
            let env = f.token_env.as_deref().unwrap_or(default_env);
            std::env::var(env)
                .map_err(|_| ForgeError::Config(format!("environment variable {env} is not set")))
        };
        let repo = || {
            f.repo
                .as_deref()
                .ok_or_else(|| ForgeError::Config("forge.repo is required".into()))
        };
        let deco = Decoration {
            labels: f.labels.clone(),
            reviewers: f.reviewers.clone(),
        };
        let forge = match f.kind.as_str() {
            "none" => return Ok(None),
            "github" => {
                let api = api_url(f).unwrap_or_default();
                Forge::GitHub(GitHub::new(api, repo()?, token("GITHUB_TOKEN")?)?)
            }
            "gitlab" => {
                let api = api_url(f).unwrap_or_default();
                Forge::GitLab(GitLab::new(api, repo()?, token("GITLAB_TOKEN")?)?)
            }
            k => return Err(ForgeError::Config(format!("unknown forge kind `{k}`"))),
        };
        Ok(Some(forge.decorated(deco)))
    }

    /// The same forge, putting `deco`'s labels and reviewers on the pull requests it opens or
    /// updates.
    pub fn decorated(self, deco: Decoration) -> Forge {
        match self {
            Forge::GitHub(mut g) => {
                g.deco = deco;
                Forge::GitHub(g)
            }
            Forge::GitLab(mut g) => {
                g.deco = deco;
                Forge::GitLab(g)
            }
        }
    }

    /// Opens the pull request from `head` into `base`, or updates the title, body, labels and
    /// reviewers of the open one. Returns it and whether it was created.
    pub async fn upsert_pull_request(
        &self,
        head: &str,
        base: &str,
        title: &str,
        body: &str,
    ) -> Result<(PullRequest, bool), ForgeError> {
        match self {
            Forge::GitHub(g) => g.upsert_pull_request(head, base, title, body).await,
            Forge::GitLab(g) => g.upsert_merge_request(head, base, title, body).await,
        }
    }

    /// Comments `body` on pull request `number` (open or merged) and labels it `label`.
    pub async fn comment_and_label(
        &self,
        number: u64,
        body: &str,
        label: &str,
    ) -> Result<(), ForgeError> {
        match self {
            Forge::GitHub(g) => g.comment_and_label(number, body, label).await,
            Forge::GitLab(g) => g.comment_and_label(number, body, label).await,
        }
    }

    /// Closes the open pull request(s) of `head`, each with `comment` saying why. Returns the
    /// closed ones (none when nothing is open).
    pub async fn close_pull_requests(
        &self,
        head: &str,
        comment: &str,
    ) -> Result<Vec<PullRequest>, ForgeError> {
        match self {
            Forge::GitHub(g) => g.close_pull_requests(head, comment).await,
            Forge::GitLab(g) => g.close_merge_requests(head, comment).await,
        }
    }
}

/// Whether `url` is an `http://` or `https://` URL (the only URLs the dashboard makes links of).
pub fn is_http_url(url: &str) -> bool {
    let lower = url.get(..8).unwrap_or(url).to_ascii_lowercase();
    lower.starts_with("http://") || lower.starts_with("https://")
}

/// The web base URL of a forge from its API URL: `https://api.github.com` is
/// `https://github.com`; otherwise a trailing `/api/v3` (GitHub Enterprise), `/api/v4`
/// (GitLab), `/api/v1` (Gitea, Forgejo) or `/api` is removed.
fn web_from_api(api: &str) -> String {
    let api = api.trim_end_matches('/');
    if api.eq_ignore_ascii_case("https://api.github.com") {
        return "https://github.com".into();
    }
    for suffix in ["/api/v3", "/api/v4", "/api/v1", "/api"] {
        if let Some(base) = api.strip_suffix(suffix) {
            return base.to_string();
        }
    }
    api.to_string()
}

/// The API URL of forge `f`: its `api_url`, else the public one of its kind (none for an
/// unknown kind).
fn api_url(f: &schema::ForgeConfig) -> Option<&str> {
    f.api_url.as_deref().or(match f.kind.as_str() {
        "github" => Some("https://api.github.com"),
        "gitlab" => Some("https://gitlab.com/api/v4"),
        _ => None,
    })
}

/// Where the config repo's commits are on the forge's web site: a commit's page is this
/// prefix followed by its SHA (`<web>/<owner>/<repo>/commit/` on GitHub,
/// `<web>/<project>/-/commit/` on GitLab, the web base from `forge.web_url` or derived from
/// `forge.api_url`). None for kind `none`, without `forge.repo`, or when the base is not an
/// http(s) URL.
pub fn commit_url_prefix(f: &schema::ForgeConfig) -> Option<String> {
    let commit_path = match f.kind.as_str() {
        "github" => "commit",
        "gitlab" => "-/commit",
        _ => return None,
    };
    let repo = f.repo.as_deref()?.trim_matches('/');
    if repo.is_empty() {
        return None;
    }
    let web = match &f.web_url {
        Some(w) => w.trim_end_matches('/').to_string(),
        None => web_from_api(api_url(f)?),
    };
    if !is_http_url(&web) {
        return None;
    }
    let repo: Vec<String> = repo.split('/').map(super::summary::url_segment).collect();
    Some(format!("{web}/{}/{commit_path}/", repo.join("/")))
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
    let mut cut = body.len().min(500);
    while !body.is_char_boundary(cut) {
        cut -= 1;
    }
    body.truncate(cut);
    Err(ForgeError::Status { status, what, body })
}

fn http() -> Result<reqwest::Client, ForgeError> {
    Ok(reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(30))
        .build()?)
}

/// A GitHub-compatible API for one repository.
#[derive(Clone)]
pub struct GitHub {
    http: reqwest::Client,
    api_url: String,
    owner: String,
    repo: String,
    token: String,
    deco: Decoration,
}

impl std::fmt::Debug for GitHub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GitHub")
            .field("api_url", &self.api_url)
            .field("repo", &format!("{}/{}", self.owner, self.repo))
            .finish_non_exhaustive()
    }
}

impl GitHub {
    /// `api_url` like `https://api.github.com`, `repo` as `owner/name`.
    pub fn new(api_url: &str, repo: &str, token: String) -> Result<GitHub, ForgeError> {
        let (owner, name) = repo
            .split_once('/')
            .ok_or_else(|| ForgeError::Config(format!("forge.repo `{repo}` is not owner/name")))?;
        Ok(GitHub {
            http: http()?,
            api_url: api_url.trim_end_matches('/').to_string(),
            owner: owner.to_string(),
            repo: name.to_string(),
            token,
            deco: Decoration::default(),
        })
    }

    fn req(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.http
            .request(method, format!("{}{path}", self.api_url))
            .bearer_auth(&self.token)
            .header("Accept", "application/vnd.github+json")
            .header("X-GitHub-Api-Version", "2022-11-28")
            .header("User-Agent", "rlc")
    }

    fn pulls_path(&self) -> String {
        format!("/repos/{}/{}/pulls", self.owner, self.repo)
    }

    /// The open pull requests of branch `head`.
    async fn open_for(&self, head: &str) -> Result<Vec<PullRequest>, ForgeError> {
        let resp = self
            .req(reqwest::Method::GET, &self.pulls_path())
            .query(&[
                ("head", format!("{}:{head}", self.owner)),
                ("state", "open".to_string()),
            ])
            .send()
            .await?;
        Ok(check(resp, "list pulls").await?.json().await?)
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
        let list = self.pulls_path();
        let open = self.open_for(head).await?;
        if let Some(pr) = open.into_iter().next() {
            let resp = self
                .req(reqwest::Method::PATCH, &format!("{list}/{}", pr.number))
                .json(&json!({"title": title, "body": body}))
                .send()
                .await?;
            let pr: PullRequest = check(resp, "update pull").await?.json().await?;
            tracing::info!(number = pr.number, "updated pull request");
            self.decorate(pr.number).await?;
            return Ok((pr, false));
        }
        let resp = self
            .req(reqwest::Method::POST, &list)
            .json(&json!({"title": title, "head": head, "base": base, "body": body}))
            .send()
            .await?;
        let pr: PullRequest = check(resp, "create pull").await?.json().await?;
        tracing::info!(number = pr.number, "opened pull request");
        self.decorate(pr.number).await?;
        Ok((pr, true))
    }

    /// Adds the labels (issue labels API) and requests the reviewers of PR `number`; both
    /// calls are idempotent, so an update repeats them.
    async fn decorate(&self, number: u64) -> Result<(), ForgeError> {
        if !self.deco.labels.is_empty() {
            self.add_labels(number, &self.deco.labels).await?;
        }
        if !self.deco.reviewers.is_empty() {
            let resp = self
                .req(
                    reqwest::Method::POST,
                    &format!(
                        "/repos/{}/{}/pulls/{number}/requested_reviewers",
                        self.owner, self.repo
                    ),
                )
                .json(&json!({ "reviewers": self.deco.reviewers }))
                .send()
                .await?;
            check(resp, "request reviewers").await?;
        }
        Ok(())
    }

    /// An issue comment on PR `number`, then `label` (issue labels API).
    pub async fn comment_and_label(
        &self,
        number: u64,
        body: &str,
        label: &str,
    ) -> Result<(), ForgeError> {
        self.comment(number, body).await?;
        self.add_labels(number, &[label]).await
    }

    /// An issue comment `body` on PR `number`.
    async fn comment(&self, number: u64, body: &str) -> Result<(), ForgeError> {
        let resp = self
            .req(
                reqwest::Method::POST,
                &format!(
                    "/repos/{}/{}/issues/{number}/comments",
                    self.owner, self.repo
                ),
            )
            .json(&json!({ "body": body }))
            .send()
            .await?;
        check(resp, "comment on pull").await?;
        Ok(())
    }

    /// Adds `labels` to PR `number` (issue labels API).
    async fn add_labels<L: serde::Serialize>(
        &self,
        number: u64,
        labels: &[L],
    ) -> Result<(), ForgeError> {
        let resp = self
            .req(
                reqwest::Method::POST,
                &format!("/repos/{}/{}/issues/{number}/labels", self.owner, self.repo),
            )
            .json(&json!({ "labels": labels }))
            .send()
            .await?;
        check(resp, "label pull").await?;
        Ok(())
    }

    /// Closes the open pull request(s) of `head`, each with `comment` saying why (an issue
    /// comment, then `state: closed`). Returns the closed ones (none when nothing is open).
    pub async fn close_pull_requests(
        &self,
        head: &str,
        comment: &str,
    ) -> Result<Vec<PullRequest>, ForgeError> {
        let list = self.pulls_path();
        let open = self.open_for(head).await?;
        let mut closed = Vec::new();
        for pr in open {
            self.comment(pr.number, comment).await?;
            let resp = self
                .req(reqwest::Method::PATCH, &format!("{list}/{}", pr.number))
                .json(&json!({"state": "closed"}))
                .send()
                .await?;
            let pr: PullRequest = check(resp, "close pull").await?.json().await?;
            tracing::info!(number = pr.number, "closed outdated pull request");
            closed.push(pr);
        }
        Ok(closed)
    }
}

/// A GitLab project's merge requests (REST API v4; the token goes in `PRIVATE-TOKEN`).
#[derive(Clone)]
pub struct GitLab {
    http: reqwest::Client,
    api_url: String,
    /// The project's full path, URL-encoded as one path segment (`group%2Fname`).
    project: String,
    token: String,
    deco: Decoration,
}

impl std::fmt::Debug for GitLab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GitLab")
            .field("api_url", &self.api_url)
            .field("project", &self.project)
            .finish_non_exhaustive()
    }
}

/// A merge request as GitLab returns it.
#[derive(Debug, Deserialize)]
struct MergeRequest {
    iid: u64,
    #[serde(default)]
    web_url: Option<String>,
}

impl From<MergeRequest> for PullRequest {
    fn from(m: MergeRequest) -> PullRequest {
        PullRequest {
            number: m.iid,
            html_url: m.web_url,
        }
    }
}

#[derive(Debug, Deserialize)]
struct User {
    id: u64,
}

impl GitLab {
    /// `api_url` like `https://gitlab.com/api/v4`, `project` as its full path
    /// (`group/subgroup/name`) or numeric id.
    pub fn new(api_url: &str, project: &str, token: String) -> Result<GitLab, ForgeError> {
        if project.trim().is_empty() {
            return Err(ForgeError::Config("forge.repo is empty".into()));
        }
        Ok(GitLab {
            http: http()?,
            api_url: api_url.trim_end_matches('/').to_string(),
            project: crate::gitops::summary::url_segment(project),
            token,
            deco: Decoration::default(),
        })
    }

    fn req(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.http
            .request(
                method,
                format!("{}/projects/{}{path}", self.api_url, self.project),
            )
            .header("PRIVATE-TOKEN", &self.token)
            .header("User-Agent", "rlc")
    }

    async fn open_for(&self, head: &str) -> Result<Vec<MergeRequest>, ForgeError> {
        let resp = self
            .req(reqwest::Method::GET, "/merge_requests")
            .query(&[("source_branch", head), ("state", "opened")])
            .send()
            .await?;
        Ok(check(resp, "list merge requests").await?.json().await?)
    }

    /// The reviewers as user ids: numbers are taken as ids, names looked up
    /// (`GET /users?username=`). An unknown name is an error naming it.
    async fn reviewer_ids(&self) -> Result<Vec<u64>, ForgeError> {
        let mut ids = Vec::new();
        for r in &self.deco.reviewers {
            if let Ok(id) = r.parse::<u64>() {
                ids.push(id);
                continue;
            }
            let resp = self
                .http
                .get(format!("{}/users", self.api_url))
                .query(&[("username", r.as_str())])
                .header("PRIVATE-TOKEN", &self.token)
                .header("User-Agent", "rlc")
                .send()
                .await?;
            let users: Vec<User> = check(resp, "look up reviewer").await?.json().await?;
            match users.first() {
                Some(u) => ids.push(u.id),
                None => {
                    return Err(ForgeError::Config(format!(
                        "forge.reviewers: no GitLab user `{r}`"
                    )))
                }
            }
        }
        Ok(ids)
    }

    /// Opens the merge request from `head` into `base`, or updates the open one (title,
    /// description, labels, reviewers). Returns it and whether it was created.
    pub async fn upsert_merge_request(
        &self,
        head: &str,
        base: &str,
        title: &str,
        body: &str,
    ) -> Result<(PullRequest, bool), ForgeError> {
        let mut fields = json!({"title": title, "description": body});
        if !self.deco.labels.is_empty() {
            fields["labels"] = json!(self.deco.labels.join(","));
        }
        if !self.deco.reviewers.is_empty() {
            fields["reviewer_ids"] = json!(self.reviewer_ids().await?);
        }
        if let Some(mr) = self.open_for(head).await?.into_iter().next() {
            let resp = self
                .req(reqwest::Method::PUT, &format!("/merge_requests/{}", mr.iid))
                .json(&fields)
                .send()
                .await?;
            let mr: MergeRequest = check(resp, "update merge request").await?.json().await?;
            tracing::info!(iid = mr.iid, "updated merge request");
            return Ok((mr.into(), false));
        }
        fields["source_branch"] = json!(head);
        fields["target_branch"] = json!(base);
        let resp = self
            .req(reqwest::Method::POST, "/merge_requests")
            .json(&fields)
            .send()
            .await?;
        let mr: MergeRequest = check(resp, "create merge request").await?.json().await?;
        tracing::info!(iid = mr.iid, "opened merge request");
        Ok((mr.into(), true))
    }

    /// A note on merge request `iid`, then `label` added (`add_labels`).
    pub async fn comment_and_label(
        &self,
        iid: u64,
        body: &str,
        label: &str,
    ) -> Result<(), ForgeError> {
        self.note(iid, body).await?;
        let resp = self
            .req(reqwest::Method::PUT, &format!("/merge_requests/{iid}"))
            .json(&json!({ "add_labels": label }))
            .send()
            .await?;
        check(resp, "label merge request").await?;
        Ok(())
    }

    /// A note `body` on merge request `iid`.
    async fn note(&self, iid: u64, body: &str) -> Result<(), ForgeError> {
        let resp = self
            .req(
                reqwest::Method::POST,
                &format!("/merge_requests/{iid}/notes"),
            )
            .json(&json!({ "body": body }))
            .send()
            .await?;
        check(resp, "note on merge request").await?;
        Ok(())
    }

    /// Closes the open merge request(s) of `head`, each with a note saying why, then
    /// `state_event: close`.
    pub async fn close_merge_requests(
        &self,
        head: &str,
        comment: &str,
    ) -> Result<Vec<PullRequest>, ForgeError> {
        let mut closed = Vec::new();
        for mr in self.open_for(head).await? {
            self.note(mr.iid, comment).await?;
            let resp = self
                .req(reqwest::Method::PUT, &format!("/merge_requests/{}", mr.iid))
                .json(&json!({"state_event": "close"}))
                .send()
                .await?;
            let mr: MergeRequest = check(resp, "close merge request").await?.json().await?;
            tracing::info!(iid = mr.iid, "closed outdated merge request");
            closed.push(mr.into());
        }
        Ok(closed)
    }
}
