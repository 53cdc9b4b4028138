//! Run records written to a local directory before the store (`store.journal_dir`), so that no
//! change that reached the config repo or the controller is missing from the run history: a
//! record the store could not take (down, locked, full, read-only) stays in the journal, and so
//! does the record of a run killed between its git write and its record (written, provisional,
//! right after the write). Whoever reaches the store next — the next run, the daemon's poll —
//! writes the journal's records to it ([`Journal::replay`]); the store takes a run once
//! (by its `run_uid`), so a record written twice is stored once.
//!
//! One file per run, `<started at, ms>-<run_uid>.json`, written whole (a temporary file
//! renamed over it, then synced); at most [`JOURNAL_MAX`] files, the oldest dropped with a
//! warning beyond.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::store::{QuotaRecord, RunRecord, Store};

/// Records kept in the journal at most; the oldest are dropped beyond this.
pub const JOURNAL_MAX: usize = 1000;

/// One journaled run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    /// The run.
    pub run: RunRecord,
    /// Its quota changes.
    pub quotas: Vec<QuotaRecord>,
}

/// The journal directory.
#[derive(Debug, Clone)]
pub struct Journal {
    dir: PathBuf,
}

impl Journal {
    /// The journal at `dir` (created on first write).
    pub fn new(dir: impl Into<PathBuf>) -> Journal {
        Journal { dir: dir.into() }
    }

    /// The journal of rlc.yaml's `store.journal_dir`, relative to `base_dir`.
    pub fn of(cfg: &schema::DaemonConfig, base_dir: &Path) -> Journal {
        Journal::new(base_dir.join(&cfg.store.journal_dir))
    }

    /// Where it is.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path_of(&self, run: &RunRecord) -> Option<PathBuf> {
        let uid = run.run_uid.as_deref()?;
        Some(self.dir.join(format!(
            "{:013}-{uid}.json",
            run.started_at.timestamp_millis().max(0)
        )))
    }

    /// Writes (or replaces) the record of `entry.run`, whole and synced. A run without a
    /// `run_uid` cannot be told apart from another and is not journaled.
    pub fn write(&self, entry: &Entry) -> std::io::Result<()> {
        let Some(path) = self.path_of(&entry.run) else {
            return Ok(());
        };
        std::fs::create_dir_all(&self.dir)?;
        let tmp = path.with_extension("json.part");
        {
            use std::io::Write;
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&serde_json::to_vec(entry).map_err(std::io::Error::other)?)?;
            f.sync_all()?;
        }
        std::fs::rename(&tmp, &path)?;
        if let Ok(d) = std::fs::File::open(&self.dir) {
            let _ = d.sync_all();
        }
        self.bound();
        Ok(())
    }

    /// Forgets the record of `run` (the store has it).
    pub fn remove(&self, run: &RunRecord) {
        if let Some(path) = self.path_of(run) {
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "cannot remove a journaled run record")
                }
            }
        }
    }

    /// The journal's files, oldest first.
    fn files(&self) -> Vec<PathBuf> {
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        let mut files: Vec<PathBuf> = rd
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .collect();
        files.sort();
        files
    }

    /// Records waiting for the store.
    pub fn len(&self) -> usize {
        self.files().len()
    }

    /// Whether no record waits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops the oldest records beyond [`JOURNAL_MAX`].
    fn bound(&self) {
        let files = self.files();
        if files.len() > JOURNAL_MAX {
            for p in &files[..files.len() - JOURNAL_MAX] {
                tracing::warn!(path = %p.display(), max = JOURNAL_MAX, "run journal full: dropped the oldest record");
                let _ = std::fs::remove_file(p);
            }
        }
    }

    /// Writes every journaled record to `store`, oldest first, removing each once stored;
    /// stops at the first the store refuses (it is down: the rest waits too). Returns how
    /// many were stored, or the store's error. A file that cannot be read (cut, not JSON) is
    /// set aside as `*.bad` with a warning, never replayed and never blocking the others.
    pub async fn replay(&self, store: &Store) -> Result<usize, crate::store::StoreError> {
        let mut n = 0;
        for path in self.files() {
            let entry: Entry = match std::fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()))
            {
                Ok(e) => e,
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "unreadable run record in the journal: set aside");
                    let _ = std::fs::rename(&path, path.with_extension("json.bad"));
                    continue;
                }
            };
            store.record_run(&entry.run, &entry.quotas).await?;
            let _ = std::fs::remove_file(&path);
            n += 1;
        }
        if n > 0 {
            tracing::info!(records = n, dir = %self.dir.display(), "run records from the journal stored");
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Utc;

    fn run(uid: &str, secs: i64) -> RunRecord {
        let at = chrono::DateTime::<Utc>::from_timestamp(1_800_000_000 + secs, 0).unwrap();
        RunRecord {
            id: 0,
            trigger: "once".into(),
            started_at: at,
            finished_at: at,
            status: "pending".into(),
            commit_sha: Some("c0ffee".into()),
            version_pushed: None,
            services: "[]".into(),
            summary: "s".into(),
            error: None,
            run_uid: Some(uid.into()),
            pr_number: None,
            pr_url: None,
        }
    }

    #[tokio::test]
    async fn records_wait_in_order_replay_once_and_bad_files_are_set_aside() {
        let dir = tempfile::tempdir().unwrap();
        let j = Journal::new(dir.path().join("journal"));
        assert!(j.is_empty());
        for (uid, secs) in [("b", 20), ("a", 10)] {
            j.write(&Entry {
                run: run(uid, secs),
                quotas: vec![],
            })
            .unwrap();
        }
        // Rewriting a run replaces its record.
        let mut again = run("a", 10);
        again.status = "success".into();
        j.write(&Entry {
            run: again,
            quotas: vec![],
        })
        .unwrap();
        assert_eq!(j.len(), 2);
        std::fs::write(j.dir().join("0000000000000-cut.json"), b"{\"run\":").unwrap();
        let store = Store::connect("sqlite://rlc.db", dir.path()).await.unwrap();
        assert_eq!(j.replay(&store).await.unwrap(), 2);
        assert!(j.is_empty());
        assert!(j.dir().join("0000000000000-cut.json.bad").exists());
        let runs = store.recent_runs(10).await.unwrap();
        let got: Vec<(&str, &str)> = runs
            .iter()
            .map(|r| (r.run_uid.as_deref().unwrap(), r.status.as_str()))
            .collect();
        assert_eq!(got, [("b", "pending"), ("a", "success")], "oldest first");
        // Replayed again (a record stored but not removed): stored once.
        j.write(&Entry {
            run: run("b", 20),
            quotas: vec![],
        })
        .unwrap();
        j.replay(&store).await.unwrap();
        assert_eq!(store.recent_runs(10).await.unwrap().len(), 2);
    }
}
