//! Writes rendered bucket files into the config repo with libgit2: builds the new tree in
//! memory on top of the remote base, validates it in a scratch directory, commits only when
//! bytes change, and pushes (base branch in `direct` mode, a stable branch in `pull-request`
//! mode). Nothing touches the working copy or the remote until the new tree is known valid,
//! so a failed run leaves nothing half-written.
//!
//! libgit2 is blocking: call these from `tokio::task::spawn_blocking`.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use git2::{
    Cred, CredentialType, ErrorCode, FetchOptions, ObjectType, Oid, PushOptions, RemoteCallbacks,
    Repository, Signature, Tree,
};
use schema::{BucketFile, ConfigRepoConfig, RepoMode};

use super::GitOpsError;
use rlc_plan::change::ChangeSummary;
use rlc_plan::plan::Plan;

/// libgit2 calls the credentials callback again after every refusal, forever; stop after this.
const MAX_CREDENTIAL_ATTEMPTS: u32 = 3;

/// At most this many commits of the base branch are read to find a bucket's last decrease
/// within `rails.decrease_interval`; with more commits in the interval the history cannot
/// prove that a decrease is allowed, and every decrease is held.
pub const DECREASE_HISTORY_MAX_COMMITS: usize = 2000;

/// The config repo's base tip could not be read off a request's path: its working copy
/// ([`Writer::open_existing`] and the reads after it), or the blocking task that read it.
#[derive(Debug, thiserror::Error)]
pub enum BaseReadError {
    #[error("reading the config repo: {0}")]
    Git(#[from] GitOpsError),
    #[error("reading the config repo: {0}")]
    Task(#[from] tokio::task::JoinError),
}

/// Where and how to write, resolved from `rlc.yaml` (paths made absolute, token read).
#[derive(Clone)]
pub struct WriterConfig {
    /// Local working copy.
    pub path: PathBuf,
    /// Remote URL (clone source and push target), if any.
    pub url: Option<String>,
    /// Base branch.
    pub branch: String,
    /// direct | pull-request.
    pub mode: RepoMode,
    /// Stable branch of pull-request mode.
    pub pr_branch: String,
    /// Commit author name.
    pub author_name: String,
    /// Commit author e-mail; commits by anyone else on the PR branch are left alone.
    pub author_email: String,
    /// HTTPS token (from the env var named by `token_env`). Never logged.
    pub token: Option<String>,
    /// Attempts when the remote base moves underneath (fetch, regenerate, push again).
    pub max_attempts: u32,
    /// Connect timeout, and longest silence of the remote while fetching or pushing.
    pub timeout: std::time::Duration,
}

impl std::fmt::Debug for WriterConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriterConfig")
            .field("path", &self.path)
            .field("url", &self.url)
            .field("branch", &self.branch)
            .field("mode", &self.mode)
            .field("pr_branch", &self.pr_branch)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

impl WriterConfig {
    /// From the `config_repo` section; relative paths are relative to `base_dir` (the
    /// directory of rlc.yaml).
    pub fn from_config(c: &ConfigRepoConfig, base_dir: &Path) -> WriterConfig {
        WriterConfig {
            path: base_dir.join(&c.path),
            url: c.url.clone(),
            branch: c.branch.clone(),
            mode: c.mode,
            pr_branch: c.pr_branch.clone(),
            author_name: c.author_name.clone(),
            author_email: c.author_email.clone(),
            token: c.token_env.as_ref().and_then(|v| std::env::var(v).ok()),
            max_attempts: 3,
            timeout: c.timeout.0,
        }
    }
}

/// What a write did.
#[derive(Debug, Clone, PartialEq)]
pub enum WriteStatus {
    /// Rendered files equal the ones in the repo (or the PR branch): no commit.
    Unchanged,
    /// Committed (and pushed when there is a remote) on the base branch.
    Committed {
        /// The new commit.
        commit: String,
    },
    /// The pull-request branch now carries `commit`.
    BranchUpdated {
        /// The branch tip.
        commit: String,
    },
    /// The PR branch already carries exactly these files.
    BranchUpToDate {
        /// The branch tip.
        commit: String,
    },
    /// Pull-request mode: the plan equals the base branch, but the PR branch (only rlc's
    /// commits) still proposes a change; it is outdated and its pull request should be
    /// closed. Nothing was pushed: close the PR, then call [`Writer::write_withdrawing`].
    BranchOutdated {
        /// The branch tip.
        commit: String,
    },
    /// Pull-request mode: the outdated PR branch was deleted on the remote.
    BranchWithdrawn {
        /// The tip it had.
        commit: String,
    },
    /// The PR branch has commits by people: left as it is.
    BranchHeldByHumans {
        /// `name <email>` of the other authors.
        authors: Vec<String>,
    },
}

/// The result of [`Writer::write`].
#[derive(Debug, Clone)]
pub struct WriteOutcome {
    /// What happened.
    pub status: WriteStatus,
    /// Base branch tip after the write (includes the new commit in direct mode).
    pub base_commit: String,
    /// What changed compared with the base branch.
    pub summary: ChangeSummary,
    /// Attempts used (more than 1 when the remote moved underneath).
    pub attempts: u32,
}

/// A fault-injection point called right before each push with the attempt number; tests use
/// it to move the remote underneath a run.
pub type BeforePush = Box<dyn FnMut(u32) + Send>;

/// The config repo's working copy with its remote.
pub struct Writer {
    repo: Repository,
    cfg: WriterConfig,
    before_push: std::sync::Mutex<Option<BeforePush>>,
    /// Attempts the last write started (also when it failed).
    attempts: u32,
    /// Whether [`Writer::open`] cloned the remote just now (the clone fetched every branch).
    cloned: bool,
    /// The commit message of the next writes instead of the change summary's (a rollout's
    /// revert names its evidence).
    message: Option<String>,
    /// Services whose `buckets/<service>.yaml` the next writes remove (a rollout's revert of
    /// a new service's only bucket).
    removing: Vec<String>,
}

enum PushFailure {
    /// The remote moved: fetch and retry.
    Conflict(String),
    /// Anything else: the run fails with this.
    Fatal(GitOpsError),
}

fn callbacks<'a>(token: Option<&'a str>, attempts: &'a Cell<u32>) -> RemoteCallbacks<'a> {
    let mut cb = RemoteCallbacks::new();
    cb.credentials(move |url, username, allowed| {
        let n = attempts.get() + 1;
        attempts.set(n);
        if n > MAX_CREDENTIAL_ATTEMPTS {
            return Err(git2::Error::from_str(&format!(
                "authentication to {url} failed after {MAX_CREDENTIAL_ATTEMPTS} attempts"
            )));
        }
        if allowed.contains(CredentialType::SSH_KEY) {
            let user = username.unwrap_or("git");
            // First the agent, then the usual key files.
            if n == 1 {
                return Cred::ssh_key_from_agent(user);
            }
            let home = std::env::var("HOME").unwrap_or_default();
            for key in ["id_ed25519", "id_rsa", "id_ecdsa"] {
                let p = Path::new(&home).join(".ssh").join(key);
                if p.exists() {
                    return Cred::ssh_key(user, None, &p, None);
                }
            }
            return Err(git2::Error::from_str(
                "no ssh agent identity or key accepted",
            ));
        }
        if allowed.contains(CredentialType::USER_PASS_PLAINTEXT) {
            if let Some(t) = token {
                return Cred::userpass_plaintext(username.unwrap_or("x-access-token"), t);
            }
            return Err(git2::Error::from_str(
                "the remote asks for credentials and config_repo.token_env is not set",
            ));
        }
        Cred::default()
    });
    cb
}

/// libgit2's connect and I/O timeouts are process-wide: set once, from the first working copy
/// opened (every writer of a process comes from one rlc.yaml).
fn set_network_timeouts(timeout: std::time::Duration) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let ms = i32::try_from(timeout.as_millis())
            .unwrap_or(i32::MAX)
            .max(1);
        // SAFETY: called once, before this process runs any other libgit2 operation
        // (`Writer::open` is the only way rlc reaches libgit2's network code).
        unsafe {
            if let Err(e) = git2::opts::set_server_connect_timeout_in_milliseconds(ms) {
                tracing::warn!(error = %e, "cannot set the git connect timeout");
            }
            if let Err(e) = git2::opts::set_server_timeout_in_milliseconds(ms) {
                tracing::warn!(error = %e, "cannot set the git I/O timeout");
            }
        }
    });
}

/// The remote's error, naming the timeout that ended it when it timed out.
fn remote_error(op: &'static str, e: &git2::Error, timeout: std::time::Duration) -> GitOpsError {
    let message = e.message().to_string();
    let timed_out =
        e.code() == ErrorCode::Timeout || message.to_ascii_lowercase().contains("timed out");
    GitOpsError::Remote {
        op,
        message: if timed_out {
            format!(
                "{message} (timed out after {}: config_repo.timeout)",
                schema::HumanDuration(timeout)
            )
        } else {
            message
        },
    }
}

/// A remote on this machine (a path, or a `file://` URL) that does not exist, named as such:
/// libgit2 reads a missing path as an "unsupported URL protocol".
fn missing_local_remote(op: &'static str, url: &str) -> Option<GitOpsError> {
    let path = match url.strip_prefix("file://") {
        Some(p) => p,
        None if url.starts_with('/') || url.starts_with("./") || url.starts_with("../") => url,
        None => return None,
    };
    (!Path::new(path).exists()).then(|| GitOpsError::Remote {
        op,
        message: format!("the remote path {path} does not exist (config_repo.url)"),
    })
}

impl Writer {
    /// Opens the working copy at `cfg.path`, cloning `cfg.url` into it when it does not exist.
    pub fn open(cfg: WriterConfig) -> Result<Writer, GitOpsError> {
        set_network_timeouts(cfg.timeout);
        let cloned = !(cfg.path.join(".git").exists() || cfg.path.join("HEAD").exists());
        let repo = if !cloned {
            let repo = Repository::open(&cfg.path)?;
            if let Some(url) = &cfg.url {
                if repo.find_remote("origin").is_err() {
                    repo.remote("origin", url)?;
                }
            }
            repo
        } else if let Some(url) = &cfg.url {
            if let Some(e) = missing_local_remote("clone", url) {
                return Err(e);
            }
            let attempts = Cell::new(0);
            let mut fo = FetchOptions::new();
            fo.remote_callbacks(callbacks(cfg.token.as_deref(), &attempts));
            let mut b = git2::build::RepoBuilder::new();
            b.fetch_options(fo).branch(&cfg.branch);
            b.clone(url, &cfg.path)
                .map_err(|e| remote_error("clone", &e, cfg.timeout))?
        } else {
            return Err(GitOpsError::NoRepo(cfg.path.clone()));
        };
        Ok(Writer {
            repo,
            cfg,
            before_push: std::sync::Mutex::new(None),
            attempts: 0,
            cloned,
            message: None,
            removing: Vec::new(),
        })
    }

    /// The commit message of the next writes (instead of the change summary's).
    pub fn set_message(&mut self, message: String) {
        self.message = Some(message);
    }

    /// The next writes also remove `buckets/<service>.yaml` of each of `services` (a service
    /// the plan leaves without a bucket: a file with no bucket is not written).
    pub fn set_removing(&mut self, services: Vec<String>) {
        self.removing = services;
    }

    /// Sets a hook called right before each push (fault injection in tests).
    pub fn set_before_push(&mut self, hook: BeforePush) {
        *self.before_push.lock().unwrap() = Some(hook);
    }

    /// Attempts the last [`Writer::write`] started, also when it failed (a push the remote
    /// kept racing counts every try).
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    fn has_remote(&self) -> bool {
        self.repo.find_remote("origin").is_ok()
    }

    /// Fetches the base and PR branches into `refs/remotes/origin/*`: one request to the
    /// remote (a missing PR branch is normal: its tracking ref is then removed).
    pub fn fetch(&self) -> Result<(), GitOpsError> {
        if !self.has_remote() {
            return Ok(());
        }
        let mut remote = self.repo.find_remote("origin")?;
        if let Some(e) = remote.url().and_then(|u| missing_local_remote("fetch", u)) {
            return Err(e);
        }
        let attempts = Cell::new(0);
        let mut fo = FetchOptions::new();
        fo.remote_callbacks(callbacks(self.cfg.token.as_deref(), &attempts));
        let specs = [
            format!("+refs/heads/{0}:refs/remotes/origin/{0}", self.cfg.branch),
            format!(
                "+refs/heads/{0}:refs/remotes/origin/{0}",
                self.cfg.pr_branch
            ),
        ];
        remote
            .fetch(&[specs[0].as_str(), specs[1].as_str()], Some(&mut fo), None)
            .map_err(|e| remote_error("fetch", &e, self.cfg.timeout))?;
        // The refs the remote advertised on that very connection.
        let has_pr = remote
            .list()
            .map(|heads| {
                heads
                    .iter()
                    .any(|h| h.name() == format!("refs/heads/{}", self.cfg.pr_branch))
            })
            .unwrap_or(true);
        if !has_pr {
            if let Ok(mut r) = self
                .repo
                .find_reference(&format!("refs/remotes/origin/{}", self.cfg.pr_branch))
            {
                r.delete()?;
            }
        }
        Ok(())
    }

    fn base_ref(&self) -> String {
        if self.has_remote() {
            format!("refs/remotes/origin/{}", self.cfg.branch)
        } else {
            format!("refs/heads/{}", self.cfg.branch)
        }
    }

    fn base_commit(&self) -> Result<git2::Commit<'_>, GitOpsError> {
        let r = self
            .repo
            .find_reference(&self.base_ref())
            .map_err(|_| GitOpsError::NoBranch(self.cfg.branch.clone()))?;
        Ok(r.peel_to_commit()?)
    }

    /// Fetches and moves the working copy to the base branch tip, so that what the policy
    /// computation reads is what the remote has. Local edits in the working copy are
    /// discarded: it belongs to rlc. Returns the base commit.
    pub fn sync(&self) -> Result<String, GitOpsError> {
        // A clone made by this very `open` has just fetched every branch.
        if !self.cloned {
            self.fetch()?;
        }
        let base = self.base_commit()?;
        let local = format!("refs/heads/{}", self.cfg.branch);
        self.repo
            .reference(&local, base.id(), true, "rlc: sync with remote")?;
        self.checkout_branch()?;
        Ok(base.id().to_string())
    }

    fn checkout_branch(&self) -> Result<(), GitOpsError> {
        if self.repo.is_bare() {
            return Ok(());
        }
        self.repo
            .set_head(&format!("refs/heads/{}", self.cfg.branch))?;
        let mut co = git2::build::CheckoutBuilder::new();
        co.force();
        self.repo.checkout_head(Some(&mut co))?;
        Ok(())
    }

    /// `rlc/policies.yaml` at the base branch tip, parsed; `None` when it is absent or does not
    /// parse (validation reports it; nothing is promoted then). Call after [`Writer::fetch`].
    pub fn base_policies(&self) -> Result<Option<schema::PoliciesFile>, GitOpsError> {
        let base = self.base_commit()?;
        let tree = base.tree()?;
        let Ok(entry) = tree.get_path(Path::new("rlc/policies.yaml")) else {
            return Ok(None);
        };
        let Ok(blob) = self.repo.find_blob(entry.id()) else {
            return Ok(None);
        };
        let text = String::from_utf8_lossy(blob.content());
        Ok(
            schema::parse_str::<schema::PoliciesFile>(Path::new("rlc/policies.yaml"), &text)
                .ok()
                .map(|f| f.value),
        )
    }

    /// The bucket files at the base branch tip (what the controller should run), with the
    /// commit id. Call after [`Writer::fetch`] or [`Writer::write`].
    pub fn base_buckets(&self) -> Result<(String, Vec<BucketFile>), GitOpsError> {
        let base = self.base_commit()?;
        let files = read_buckets(&self.repo, &base.tree()?)?;
        Ok((base.id().to_string(), files.into_values().collect()))
    }

    /// When each bucket of `services` was last lowered on the base branch at or after `since`
    /// (unix seconds, commit time), by `(service, bucket)`: the config repo's own record of
    /// every change, which survives the loss of rlc's store. Walks the first-parent history
    /// from the base tip (a merged pull request counts when it was merged) until a commit
    /// older than `since` or the root, reading at most `max_commits` commits; a lowered
    /// `limit_rps` of a bucket of the same name in `buckets/<service>.yaml` between a commit
    /// and its first parent is a decrease, whoever made it. An error when the history cannot
    /// answer (more commits in the window than `max_commits`, a missing parent in a shallow
    /// clone): the caller must then hold decreases. Call after [`Writer::fetch`].
    pub fn decreases_since(
        &self,
        services: &[String],
        since: i64,
        max_commits: usize,
    ) -> Result<BTreeMap<(String, String), i64>, GitOpsError> {
        let mut out: BTreeMap<(String, String), i64> = BTreeMap::new();
        let mut commit = self.base_commit()?;
        let mut read = 0usize;
        loop {
            let t = commit.time().seconds();
            if t < since || commit.parent_count() == 0 {
                return Ok(out);
            }
            read += 1;
            if read > max_commits {
                return Err(GitOpsError::History(format!(
                    "more than {max_commits} commits on `{}` within the decrease interval; cannot tell when a bucket was last lowered",
                    self.cfg.branch
                )));
            }
            let parent = commit.parent(0).map_err(|e| {
                GitOpsError::History(format!(
                    "parent of commit {} is missing (shallow clone?): {}",
                    commit.id(),
                    e.message()
                ))
            })?;
            let (tree, ptree) = (commit.tree()?, parent.tree()?);
            for service in services {
                let path = format!("buckets/{service}.yaml");
                let entry = |t: &Tree<'_>| t.get_path(Path::new(&path)).ok().map(|e| e.id());
                let (Some(new), Some(old)) = (entry(&tree), entry(&ptree)) else {
                    continue;
                };
                if new == old {
                    continue;
                }
                let (Some(new), Some(old)) = (
                    parse_bucket_blob(&self.repo, new, &path),
                    parse_bucket_blob(&self.repo, old, &path),
                ) else {
                    continue;
                };
                for b in &new.buckets {
                    let lowered = old
                        .buckets
                        .iter()
                        .any(|o| o.name == b.name && b.limit_rps < o.limit_rps);
                    if lowered {
                        out.entry((service.clone(), b.name.clone()))
                            .and_modify(|at| *at = (*at).max(t))
                            .or_insert(t);
                    }
                }
            }
            commit = parent;
        }
    }

    /// Opens the working copy at `cfg.path` only when it exists (never clones): for readers
    /// such as the preview API, which must not race the scheduler's first clone.
    pub fn open_existing(cfg: WriterConfig) -> Result<Writer, GitOpsError> {
        if !(cfg.path.join(".git").exists() || cfg.path.join("HEAD").exists()) {
            return Err(GitOpsError::NoRepo(cfg.path.clone()));
        }
        Writer::open(cfg)
    }

    /// The base branch tip as last fetched (no network).
    pub fn base_tip(&self) -> Result<String, GitOpsError> {
        Ok(self.base_commit()?.id().to_string())
    }

    /// Writes the files of the base tip's `rlc/` and `buckets/` into `dir` (created; regular
    /// files only, one level deep as the config repo has them) without touching the working
    /// copy, its index or HEAD; returns the commit. Readers load the config repo from there
    /// while the scheduler owns the working copy.
    pub fn export_base(&self, dir: &Path) -> Result<String, GitOpsError> {
        let base = self.base_commit()?;
        let tree = base.tree()?;
        std::fs::create_dir_all(dir)?;
        for top in ["rlc", "buckets"] {
            let Ok(entry) = tree.get_path(Path::new(top)) else {
                continue;
            };
            if entry.kind() != Some(ObjectType::Tree) {
                continue;
            }
            let sub = self.repo.find_tree(entry.id())?;
            let out = dir.join(top);
            std::fs::create_dir_all(&out)?;
            for e in sub.iter() {
                let (Some(name), Some(ObjectType::Blob)) = (e.name(), e.kind()) else {
                    continue;
                };
                // Symlinks and executables are not config files.
                if e.filemode() != i32::from(git2::FileMode::Blob) {
                    continue;
                }
                let blob = self.repo.find_blob(e.id())?;
                std::fs::write(out.join(name), blob.content())?;
            }
        }
        Ok(base.id().to_string())
    }

    /// A hash of the human-authored `rlc/*.yaml` at the base tip: a change triggers a run.
    pub fn inputs_hash(&self) -> Result<String, GitOpsError> {
        let base = self.base_commit()?;
        let tree = base.tree()?;
        let mut parts = String::new();
        if let Ok(entry) = tree.get_path(Path::new("rlc")) {
            let sub = self.repo.find_tree(entry.id())?;
            for e in sub.iter() {
                let name = e.name().unwrap_or_default();
                if name.ends_with(".yaml") || name.ends_with(".yml") {
                    parts.push_str(&format!("{name}:{}\n", e.id()));
                }
            }
        }
        Ok(Oid::hash_object(ObjectType::Blob, parts.as_bytes())?.to_string())
    }

    /// Renders `plan` on top of the base branch and commits/pushes it per the mode. Retries
    /// (fetch, regenerate) when the remote base or the PR branch moves underneath, up to
    /// `max_attempts`. An outdated PR branch is reported ([`WriteStatus::BranchOutdated`]),
    /// not touched.
    pub fn write(&mut self, plan: &Plan) -> Result<WriteOutcome, GitOpsError> {
        self.write_with(plan, false, true)
    }

    /// Like [`Writer::write`], but an outdated PR branch (the plan equals the base, the
    /// branch has only rlc's commits) is deleted on the remote
    /// ([`WriteStatus::BranchWithdrawn`]). With a forge, close its pull request first:
    /// GitHub marks a PR whose head becomes part of the base as merged, and one whose head
    /// is deleted as closed without a word.
    pub fn write_withdrawing(&mut self, plan: &Plan) -> Result<WriteOutcome, GitOpsError> {
        self.write_with(plan, true, true)
    }

    /// [`Writer::write`] (withdrawing an outdated PR branch when `withdraw`) on the refs as
    /// last fetched: a run fetches once, at its start, and decides on what it read then. A
    /// conflict (the remote moved) fetches again before the next attempt.
    pub fn write_as_fetched(
        &mut self,
        plan: &Plan,
        withdraw: bool,
    ) -> Result<WriteOutcome, GitOpsError> {
        self.write_with(plan, withdraw, false)
    }

    fn write_with(
        &mut self,
        plan: &Plan,
        withdraw: bool,
        fetch_first: bool,
    ) -> Result<WriteOutcome, GitOpsError> {
        let max = self.cfg.max_attempts.max(1);
        let mut last_conflict = String::new();
        self.attempts = 0;
        for attempt in 1..=max {
            self.attempts = attempt;
            if attempt > 1 || fetch_first {
                self.fetch()?;
            }
            match self.write_once(plan, attempt, withdraw) {
                Ok(out) => return Ok(out),
                Err(PushFailure::Conflict(msg)) => {
                    tracing::warn!(attempt, reason = %msg, "remote moved underneath; regenerating on top");
                    last_conflict = msg;
                }
                Err(PushFailure::Fatal(e)) => return Err(e),
            }
        }
        Err(GitOpsError::TooManyConflicts {
            attempts: max,
            message: last_conflict,
        })
    }

    fn write_once(
        &self,
        plan: &Plan,
        attempt: u32,
        withdraw: bool,
    ) -> Result<WriteOutcome, PushFailure> {
        let fatal = |e: GitOpsError| PushFailure::Fatal(e);
        let base = self.base_commit().map_err(fatal)?;
        let base_id = base.id();
        let base_tree = base.tree().map_err(|e| fatal(e.into()))?;
        let old = read_buckets(&self.repo, &base_tree).map_err(fatal)?;
        let mut new_files = plan.bucket_files();
        // The criticality section is written by hand: kept as the base has it.
        for f in &mut new_files {
            if let Some(o) = old.get(&f.service) {
                f.criticality = o.criticality.clone();
            }
        }
        // A removed service: no bucket left, so the summary names each of its buckets removed.
        for service in &self.removing {
            if !new_files.iter().any(|f| &f.service == service) {
                new_files.push(BucketFile {
                    criticality: Default::default(),
                    service: service.clone(),
                    buckets: Vec::new(),
                });
            }
        }
        let summary = rlc_plan::change::diff(&old, &new_files);

        let blobs: Vec<(String, Option<Vec<u8>>)> = new_files
            .iter()
            .map(|f| {
                let path = format!("buckets/{}.yaml", f.service);
                if f.buckets.is_empty() && self.removing.contains(&f.service) {
                    (path, None)
                } else {
                    (path, Some(schema::render_bucket_file(f).into_bytes()))
                }
            })
            .collect();
        let tree_id = build_tree(&self.repo, &base_tree, &blobs).map_err(fatal)?;
        let base_s = base_id.to_string();
        let done = |status, attempts| WriteOutcome {
            status,
            base_commit: base_s.clone(),
            summary: summary.clone(),
            attempts,
        };
        // The PR branch as fetched: every decision below (and the lease of the push that
        // follows it) is about this tip.
        let pr_ref = if self.has_remote() {
            format!("refs/remotes/origin/{}", self.cfg.pr_branch)
        } else {
            format!("refs/heads/{}", self.cfg.pr_branch)
        };
        let pr_tip = match self.repo.find_reference(&pr_ref) {
            Ok(r) => Some(r.peel_to_commit().map_err(|e| fatal(e.into()))?),
            Err(_) => None,
        };
        if tree_id == base_tree.id() {
            if self.cfg.mode == RepoMode::PullRequest {
                if let Some(tip) = &pr_tip {
                    if let Some(status) =
                        self.outdated_branch(tip.id(), base_id, withdraw, attempt)?
                    {
                        return Ok(done(status, attempt));
                    }
                }
            }
            return Ok(done(WriteStatus::Unchanged, attempt));
        }
        // Only the bucket files: the run's report goes to the pull request's body and the
        // store, never into the tree (it would land on the base branch with the merge).
        let tree = self.repo.find_tree(tree_id).map_err(|e| fatal(e.into()))?;
        validate_tree(&self.repo, &tree).map_err(fatal)?;

        let sig = Signature::now(&self.cfg.author_name, &self.cfg.author_email)
            .map_err(|e| fatal(e.into()))?;
        let message = self
            .message
            .clone()
            .unwrap_or_else(|| summary.commit_message());
        match self.cfg.mode {
            RepoMode::Direct => {
                let commit = self
                    .repo
                    .commit(None, &sig, &sig, &message, &tree, &[&base])
                    .map_err(|e| fatal(e.into()))?;
                if self.has_remote() {
                    let outgoing = "refs/rlc/outgoing";
                    self.repo
                        .reference(outgoing, commit, true, "rlc: outgoing")
                        .map_err(|e| fatal(e.into()))?;
                    // Never forced: the base branch only moves forward.
                    self.push(
                        &format!("{outgoing}:refs/heads/{}", self.cfg.branch),
                        attempt,
                        None,
                    )?;
                    self.repo
                        .reference(&self.base_ref(), commit, true, "rlc: pushed")
                        .map_err(|e| fatal(e.into()))?;
                }
                self.repo
                    .reference(
                        &format!("refs/heads/{}", self.cfg.branch),
                        commit,
                        true,
                        "rlc: commit",
                    )
                    .map_err(|e| fatal(e.into()))?;
                self.checkout_branch().map_err(fatal)?;
                Ok(WriteOutcome {
                    base_commit: commit.to_string(),
                    ..done(
                        WriteStatus::Committed {
                            commit: commit.to_string(),
                        },
                        attempt,
                    )
                })
            }
            RepoMode::PullRequest => {
                if let Some(tip) = &pr_tip {
                    let humans = self.foreign_authors(tip.id(), base_id).map_err(fatal)?;
                    if !humans.is_empty() {
                        tracing::warn!(branch = %self.cfg.pr_branch, authors = ?humans, "pull-request branch has commits by people; leaving it");
                        return Ok(done(
                            WriteStatus::BranchHeldByHumans { authors: humans },
                            attempt,
                        ));
                    }
                    if tip.tree_id() == tree_id {
                        return Ok(done(
                            WriteStatus::BranchUpToDate {
                                commit: tip.id().to_string(),
                            },
                            attempt,
                        ));
                    }
                }
                // Regenerated on the base tip each time, so the branch never conflicts.
                let commit = self
                    .repo
                    .commit(None, &sig, &sig, &message, &tree, &[&base])
                    .map_err(|e| fatal(e.into()))?;
                let local = format!("refs/heads/{}", self.cfg.pr_branch);
                self.repo
                    .reference(&local, commit, true, "rlc: proposal")
                    .map_err(|e| fatal(e.into()))?;
                if self.has_remote() {
                    // Forcing is fine on rlc's own branch (checked above for human commits),
                    // but only over the tip that was checked: a lease, so that a commit
                    // pushed since the fetch is never overwritten.
                    let lease = pr_tip.as_ref().map(|t| t.id());
                    self.push(&format!("+{local}:{local}"), attempt, Some(lease))?;
                    self.repo
                        .reference(&pr_ref, commit, true, "rlc: pushed")
                        .map_err(|e| fatal(e.into()))?;
                }
                Ok(done(
                    WriteStatus::BranchUpdated {
                        commit: commit.to_string(),
                    },
                    attempt,
                ))
            }
        }
    }

    /// In pull-request mode with a plan equal to the base: what to do with the PR branch at
    /// `tip`. `None` when it proposes nothing (absent, or merged: no commit beyond the base);
    /// held when people committed on it; otherwise it is outdated, and deleted on the
    /// remote (leased on `tip`) when `withdraw`.
    fn outdated_branch(
        &self,
        tip: Oid,
        base: Oid,
        withdraw: bool,
        attempt: u32,
    ) -> Result<Option<WriteStatus>, PushFailure> {
        let fatal = |e: GitOpsError| PushFailure::Fatal(e);
        let mut walk = self.repo.revwalk().map_err(|e| fatal(e.into()))?;
        walk.push(tip).map_err(|e| fatal(e.into()))?;
        walk.hide(base).map_err(|e| fatal(e.into()))?;
        if walk.next().is_none() {
            return Ok(None);
        }
        let humans = self.foreign_authors(tip, base).map_err(fatal)?;
        if !humans.is_empty() {
            tracing::warn!(branch = %self.cfg.pr_branch, authors = ?humans, "outdated pull-request branch has commits by people; leaving it");
            return Ok(Some(WriteStatus::BranchHeldByHumans { authors: humans }));
        }
        let commit = tip.to_string();
        if !withdraw {
            return Ok(Some(WriteStatus::BranchOutdated { commit }));
        }
        let local = format!("refs/heads/{}", self.cfg.pr_branch);
        if self.has_remote() {
            self.push(&format!(":{local}"), attempt, Some(Some(tip)))?;
            if let Ok(mut r) = self
                .repo
                .find_reference(&format!("refs/remotes/origin/{}", self.cfg.pr_branch))
            {
                r.delete().map_err(|e| fatal(e.into()))?;
            }
        }
        if let Ok(mut r) = self.repo.find_reference(&local) {
            r.delete().map_err(|e| fatal(e.into()))?;
        }
        tracing::info!(branch = %self.cfg.pr_branch, tip = %commit, "withdrew the outdated pull-request branch");
        Ok(Some(WriteStatus::BranchWithdrawn { commit }))
    }

    /// Authors other than rlc of commits on `tip` not on `base`.
    fn foreign_authors(&self, tip: Oid, base: Oid) -> Result<Vec<String>, GitOpsError> {
        let mut walk = self.repo.revwalk()?;
        walk.push(tip)?;
        walk.hide(base)?;
        let mut out = Vec::new();
        for id in walk {
            let c = self.repo.find_commit(id?)?;
            let a = c.author();
            if a.email() != Some(self.cfg.author_email.as_str()) {
                let who = format!("{} <{}>", a.name().unwrap_or("?"), a.email().unwrap_or("?"));
                if !out.contains(&who) {
                    out.push(who);
                }
            }
        }
        Ok(out)
    }

    /// Pushes `refspec`. With `lease: Some(expected)`, the push is a compare-and-swap on the
    /// destination ref (libgit2 has no `--force-with-lease`): the push-negotiation callback
    /// sees the remote's current value of the ref as advertised on the push connection
    /// itself, and the push is abandoned (a conflict: fetch and decide again) unless it is
    /// `expected` (`None`: the ref must not exist). The server then applies the update only
    /// if the ref still has that advertised value.
    fn push(
        &self,
        refspec: &str,
        attempt: u32,
        lease: Option<Option<Oid>>,
    ) -> Result<(), PushFailure> {
        if let Some(hook) = self.before_push.lock().unwrap().as_mut() {
            hook(attempt);
        }
        let moved: RefCell<Option<String>> = RefCell::new(None);
        let mut remote = self
            .repo
            .find_remote("origin")
            .map_err(|e| PushFailure::Fatal(e.into()))?;
        let attempts = Cell::new(0);
        let rejected: RefCell<Vec<(String, String)>> = RefCell::new(Vec::new());
        let result = {
            let mut cb = callbacks(self.cfg.token.as_deref(), &attempts);
            // Server-side rejections (hooks, protected branches, stale refs) are reported
            // only here; push() itself returns Ok for them.
            cb.push_update_reference(|refname, status| {
                if let Some(msg) = status {
                    rejected
                        .borrow_mut()
                        .push((refname.to_string(), msg.to_string()));
                }
                Ok(())
            });
            if let Some(expected) = lease {
                let expected = expected.unwrap_or_else(Oid::zero);
                let moved = &moved;
                cb.push_negotiation(move |updates| {
                    for u in updates {
                        if u.src() != expected {
                            let name = u.dst_refname().unwrap_or("?");
                            let found = if u.src().is_zero() {
                                "no branch".to_string()
                            } else {
                                u.src().to_string()
                            };
                            *moved.borrow_mut() = Some(format!(
                                "{name} moved on the remote since it was checked (expected {expected}, found {found})"
                            ));
                            return Err(git2::Error::from_str("lease lost"));
                        }
                    }
                    Ok(())
                });
            }
            let mut po = PushOptions::new();
            po.remote_callbacks(cb);
            remote.push(&[refspec], Some(&mut po))
        };
        if let Some(msg) = moved.into_inner() {
            return Err(PushFailure::Conflict(msg));
        }
        match result {
            Err(e) if e.code() == ErrorCode::NotFastForward => {
                return Err(PushFailure::Conflict(e.message().to_string()))
            }
            Err(e) => {
                return Err(PushFailure::Fatal(remote_error(
                    "push",
                    &e,
                    self.cfg.timeout,
                )))
            }
            Ok(()) => {}
        }
        let rejected = rejected.into_inner();
        if let Some((refname, msg)) = rejected.into_iter().next() {
            let lower = msg.to_ascii_lowercase();
            // "failed to update ref" / "failed to lock": the ref moved (or was locked by a
            // concurrent update) between the server's advertisement and its update, e.g. a
            // hook or another pusher got there first. That is a conflict like any other:
            // fetch, rebuild on top, push again (bounded by `max_attempts`).
            if lower.contains("non-fast-forward")
                || lower.contains("fetch first")
                || lower.contains("stale")
                || lower.contains("failed to update ref")
                || lower.contains("failed to lock")
                || lower.contains("cannot lock ref")
            {
                return Err(PushFailure::Conflict(format!("{refname}: {msg}")));
            }
            return Err(PushFailure::Fatal(GitOpsError::Rejected {
                refname,
                message: msg,
            }));
        }
        Ok(())
    }
}

/// `buckets/*.yaml` of `tree`, parsed, by service. Files that do not parse are left out: the
/// writer replaces them and validation reports the rest.
fn read_buckets(
    repo: &Repository,
    tree: &Tree<'_>,
) -> Result<BTreeMap<String, BucketFile>, GitOpsError> {
    let mut out = BTreeMap::new();
    let Ok(entry) = tree.get_path(Path::new("buckets")) else {
        return Ok(out);
    };
    let sub = repo.find_tree(entry.id())?;
    for e in sub.iter() {
        let Some(name) = e.name() else { continue };
        let Some(stem) = name.strip_suffix(".yaml") else {
            continue;
        };
        let blob = repo.find_blob(e.id())?;
        let text = String::from_utf8_lossy(blob.content());
        if let Ok(f) = schema::parse_str::<BucketFile>(Path::new(name), &text) {
            out.insert(stem.to_string(), f.value);
        }
    }
    Ok(out)
}

/// A bucket file blob, parsed; `None` when it does not parse (it tells nothing then).
fn parse_bucket_blob(repo: &Repository, id: Oid, path: &str) -> Option<BucketFile> {
    let blob = repo.find_blob(id).ok()?;
    let text = String::from_utf8_lossy(blob.content());
    schema::parse_str::<BucketFile>(Path::new(path), &text)
        .ok()
        .map(|f| f.value)
}

/// `base` with `files` (paths one directory deep, e.g. `buckets/x.yaml`) written in, or
/// removed (`None`; a directory left empty goes too).
fn build_tree(
    repo: &Repository,
    base: &Tree<'_>,
    files: &[(String, Option<Vec<u8>>)],
) -> Result<Oid, GitOpsError> {
    // Per directory: each file's name and its new bytes (None: removed).
    type Entries<'a> = Vec<(&'a str, Option<&'a [u8]>)>;
    let mut by_dir: BTreeMap<&str, Entries<'_>> = BTreeMap::new();
    for (path, bytes) in files {
        let (dir, name) = path.split_once('/').expect("generated paths are dir/file");
        by_dir
            .entry(dir)
            .or_default()
            .push((name, bytes.as_deref()));
    }
    let mut root = repo.treebuilder(Some(base))?;
    for (dir, entries) in by_dir {
        let existing = match base.get_name(dir) {
            Some(e) if e.kind() == Some(ObjectType::Tree) => Some(repo.find_tree(e.id())?),
            _ => None,
        };
        let mut sub = repo.treebuilder(existing.as_ref())?;
        for (name, bytes) in entries {
            match bytes {
                Some(bytes) => {
                    let blob = repo.blob(bytes)?;
                    sub.insert(name, blob, 0o100644)?;
                }
                None => {
                    if sub.get(name)?.is_some() {
                        sub.remove(name)?;
                    }
                }
            }
        }
        if sub.is_empty() {
            if root.get(dir)?.is_some() {
                root.remove(dir)?;
            }
        } else {
            root.insert(dir, sub.write()?, 0o040000)?;
        }
    }
    Ok(root.write()?)
}

/// Writes `buckets/` and `rlc/` of `tree` to a scratch directory and runs the same validation
/// as `rlc validate`.
fn validate_tree(repo: &Repository, tree: &Tree<'_>) -> Result<(), GitOpsError> {
    let tmp = tempfile::tempdir()?;
    for dir in ["buckets", "rlc"] {
        let Some(e) = tree.get_name(dir) else {
            continue;
        };
        let Ok(sub) = repo.find_tree(e.id()) else {
            continue;
        };
        std::fs::create_dir_all(tmp.path().join(dir))?;
        for f in sub.iter() {
            if f.kind() != Some(ObjectType::Blob) {
                continue;
            }
            let blob = repo.find_blob(f.id())?;
            std::fs::write(
                tmp.path().join(dir).join(f.name().unwrap_or("_")),
                blob.content(),
            )?;
        }
    }
    let diags = schema::validate_repo(tmp.path());
    if diags.is_empty() {
        return Ok(());
    }
    let lines: Vec<String> = diags
        .iter()
        .map(|d| {
            let mut d = d.clone();
            if let Ok(rel) = d.file.strip_prefix(tmp.path()) {
                d.file = rel.to_path_buf();
            }
            d.to_string()
        })
        .collect();
    Err(GitOpsError::Invalid(lines.join("\n")))
}
