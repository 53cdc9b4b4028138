//! GitOps write-back: the git writer (`writer`), the forge client for pull requests
//! (`forge`), and the words of a change: commit message and PR body (`summary`).

pub mod forge;
pub mod summary;
pub mod writer;

use std::path::PathBuf;

pub use forge::{Decoration, Forge, ForgeError, GitHub, GitLab, PullRequest};

pub use writer::{WriteOutcome, WriteStatus, Writer, WriterConfig};

/// A commit id as people read it: its first 10 hex digits.
pub fn short(sha: &str) -> &str {
    &sha[..sha.len().min(10)]
}

/// Why a git write failed. Messages carry the remote's own words; never a token.
#[derive(Debug, thiserror::Error)]
pub enum GitOpsError {
    /// libgit2 failed locally.
    #[error("git: {0}")]
    Git(#[from] git2::Error),
    /// Scratch files for validation.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// No working copy and no URL to clone from.
    #[error("{0} is not a git repository and config_repo.url is not set")]
    NoRepo(PathBuf),
    /// The base branch does not exist.
    #[error("base branch `{0}` not found (locally or on the remote)")]
    NoBranch(String),
    /// The remote could not be reached or refused the operation.
    #[error("git {op} failed: {message}")]
    Remote {
        /// clone, fetch or push.
        op: &'static str,
        /// The transport's message.
        message: String,
    },
    /// The remote refused a ref update (hook, protection rule).
    #[error("the remote rejected the push of {refname}: {message}")]
    Rejected {
        /// The ref the remote refused.
        refname: String,
        /// What it said.
        message: String,
    },
    /// The base kept moving.
    #[error("the remote base branch kept moving: gave up after {attempts} attempts ({message})")]
    TooManyConflicts {
        /// Attempts made.
        attempts: u32,
        /// The last conflict.
        message: String,
    },
    /// The base branch's history cannot answer (too many commits in the window, a shallow
    /// clone's missing parent).
    #[error("config repo history: {0}")]
    History(String),
    /// The rendered repo fails `rlc validate`; nothing was committed.
    #[error("the rendered config repo fails validation, nothing committed:\n{0}")]
    Invalid(String),
}

#[cfg(test)]
pub(crate) mod tests;
