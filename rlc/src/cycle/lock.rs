//! One run at a time: a file lock beside the working copy and, on Postgres, an advisory
//! lock, held for the whole run.

use super::*;

/// Why a run could not take its lock.
#[derive(Debug, thiserror::Error)]
pub(super) enum LockError {
    /// The lock file's directory cannot be created.
    #[error("creating {path}: {1}", path = .0.display())]
    Create(PathBuf, std::io::Error),
    /// The lock file cannot be opened.
    #[error("opening the run lock {path}: {1}", path = .0.display())]
    Open(PathBuf, std::io::Error),
    /// Another run held the working copy's lock for the whole wait (seconds).
    #[error("another rlc run holds {path} (waited {1}s)", path = .0.display())]
    Held(PathBuf, u64),
    /// Locking failed.
    #[error("locking {path}: {1}", path = .0.display())]
    Take(PathBuf, std::io::Error),
    /// Another run held the store's run lock for the whole wait (seconds).
    #[error("another rlc run holds the store's run lock (waited {0}s)")]
    StoreHeld(u64),
}

/// How long a run waits for another run of the same config repo or store to finish.
const RUN_LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(600);

/// Held while a run works (dropped at its end, or when the process dies): one run at a time
/// per working copy (a file lock beside it) and per Postgres store (an advisory lock), so
/// that concurrent runs never write and record the same change twice.
pub(super) struct RunGuard {
    _lock: FileLock,
    _lease: Option<crate::store::Lease>,
}

/// The working copy's lock file (`.<working copy>.rlc-lock`), open; an exclusive advisory
/// lock once [`FileLock::try_take`] took it, released when this is dropped.
///
/// Released explicitly (`flock(LOCK_UN)`), not by closing the file: a child process that any
/// thread of this process forks holds a copy of every descriptor until it execs, and a lock
/// left to the close would last as long as that copy, so that this process's next poll finds
/// its own run's lock still taken.
pub(super) struct FileLock(std::fs::File);

impl FileLock {
    /// Opens `path`, created if missing, without taking the lock.
    pub(super) fn open(path: &Path) -> std::io::Result<FileLock> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)?;
        Ok(FileLock(file))
    }

    /// Takes the lock if no one holds it: `Ok(false)` when someone does.
    pub(super) fn try_take(&self) -> std::io::Result<bool> {
        match self.0.try_lock() {
            Ok(()) => Ok(true),
            Err(std::fs::TryLockError::WouldBlock) => Ok(false),
            Err(std::fs::TryLockError::Error(e)) => Err(e),
        }
    }
}

impl Drop for FileLock {
    fn drop(&mut self) {
        // Releases the lock of this open file, which copies inherited by children share;
        // never another holder's. Unlocking a file this one did not lock does nothing.
        let _ = self.0.unlock();
    }
}

impl Cycle {
    /// The file beside the working copy whose lock a run holds.
    pub(super) fn lock_path(&self) -> PathBuf {
        let wc = self.writer_config().path;
        let name = wc
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "config-repo".into());
        wc.with_file_name(format!(".{name}.rlc-lock"))
    }

    /// One run at a time: the working copy's lock (waiting up to [`RUN_LOCK_WAIT`] for a
    /// run of another process), then the store's (Postgres, for runs on other machines). A
    /// store that cannot answer gives no lock: its record waits in the journal anyway.
    pub(super) async fn exclusive(&self, store: &StoreWitness) -> Result<RunGuard, LockError> {
        let path = self.lock_path();
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| LockError::Create(dir.to_path_buf(), e))?;
        }
        let lock = FileLock::open(&path).map_err(|e| LockError::Open(path.clone(), e))?;
        let until = tokio::time::Instant::now() + RUN_LOCK_WAIT;
        let mut told = false;
        loop {
            match lock.try_take() {
                Ok(true) => break,
                Ok(false) => {
                    if tokio::time::Instant::now() >= until {
                        return Err(LockError::Held(path, RUN_LOCK_WAIT.as_secs()));
                    }
                    if !told {
                        tracing::info!(lock = %path.display(), "another rlc run works on this config repo: waiting for it");
                        told = true;
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
                Err(e) => return Err(LockError::Take(path, e)),
            }
        }
        let lease = match store {
            StoreWitness::Store(s) => match s.lock_runs(RUN_LOCK_WAIT).await {
                Ok(Some(l)) => Some(l),
                Ok(None) => return Err(LockError::StoreHeld(RUN_LOCK_WAIT.as_secs())),
                Err(e) => {
                    tracing::warn!(error = %e, "the store's run lock cannot be taken");
                    None
                }
            },
            _ => None,
        };
        Ok(RunGuard {
            _lock: lock,
            _lease: lease,
        })
    }
}
