//! The overrides' audit log: every override created, removed or expired, with who, when, what
//! and why, kept after the override itself is gone (`GET /v1/overrides/history`,
//! `grl override history`).
//!
//! A controller with a state directory appends one JSON line per event to
//! `overrides-audit.jsonl` there; with a state database the events are rows of
//! `override_audit`, written in the transaction of the change (an expiry by whichever replica
//! deletes the row), so every replica reads the same log. Both keep at most the newest
//! [`KEPT_EVENTS`] events: the file is compacted to half of [`MAX_FILE_BYTES`] when it passes
//! that size, and reads never take more than that.

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::overrides::Override;

/// Events kept (older ones are dropped at compaction).
pub const KEPT_EVENTS: usize = 10_000;
/// The file is compacted to its newest [`KEPT_EVENTS`] events beyond this size, and a read
/// takes at most this many bytes from its end.
pub const MAX_FILE_BYTES: u64 = 16 << 20;
/// The most events one `GET /v1/overrides/history` returns.
pub const MAX_PAGE: usize = 1_000;

/// What happened to an override.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// Added (`POST /v1/overrides`).
    Created,
    /// Removed before its expiry (`DELETE /v1/overrides/{id}`).
    Removed,
    /// Reached its `expires_at`.
    Expired,
}

impl Action {
    /// Its name in the log.
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Created => "created",
            Action::Removed => "removed",
            Action::Expired => "expired",
        }
    }
}

/// One entry of the log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// Unix seconds it happened.
    pub at: u64,
    /// What happened.
    pub action: Action,
    /// The override's id.
    pub id: String,
    /// Who did it: the author for `created`, the remover for `removed`, `expiry` for
    /// `expired`.
    pub by: String,
    /// The name of the credential used (never the secret); absent for an expiry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credential: Option<String>,
    /// Why: the override's reason when created or expired, the removal's reason when removed.
    pub reason: String,
    /// The override as it was (target, limit or ratio, TTL, author, reason).
    #[serde(rename = "override")]
    pub overrides: Override,
}

impl Event {
    /// `o` created at its `created_at` by its author (through its credential).
    pub fn created(o: &Override) -> Event {
        Event {
            at: o.created_at,
            action: Action::Created,
            id: o.id.clone(),
            by: o.req.who.clone(),
            credential: o.credential.clone(),
            reason: o.req.reason.clone(),
            overrides: o.clone(),
        }
    }

    /// `o` removed at `at` by `by` for `reason`.
    pub fn removed(o: &Override, at: u64, by: &str, reason: &str, credential: &str) -> Event {
        Event {
            at,
            action: Action::Removed,
            id: o.id.clone(),
            by: by.to_string(),
            credential: Some(credential.to_string()),
            reason: reason.to_string(),
            overrides: o.clone(),
        }
    }

    /// `o` expired (at its `expires_at`).
    pub fn expired(o: &Override) -> Event {
        Event {
            at: o.expires_at,
            action: Action::Expired,
            id: o.id.clone(),
            by: "expiry".to_string(),
            credential: None,
            reason: o.req.reason.clone(),
            overrides: o.clone(),
        }
    }
}

/// The log in a state directory.
#[derive(Debug, Clone)]
pub struct FileLog {
    path: PathBuf,
}

impl FileLog {
    /// The log of state directory `dir`.
    pub fn in_dir(dir: &Path) -> FileLog {
        FileLog {
            path: dir.join("overrides-audit.jsonl"),
        }
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends `events` (one line each, synced), then compacts the file when it passed
    /// [`MAX_FILE_BYTES`] (to its newest events within half of it).
    pub fn append(&self, events: &[Event]) -> std::io::Result<()> {
        if events.is_empty() {
            return Ok(());
        }
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .read(true)
            .append(true)
            .open(&self.path)?;
        let mut buf = Vec::new();
        // A line cut by a crash is ended first, so that it does not swallow the next event.
        let mut last = [0u8];
        if f.seek(SeekFrom::End(-1)).is_ok() && f.read_exact(&mut last).is_ok() && last[0] != b'\n'
        {
            buf.push(b'\n');
        }
        for e in events {
            serde_json::to_writer(&mut buf, e).map_err(std::io::Error::other)?;
            buf.push(b'\n');
        }
        f.write_all(&buf)?;
        f.sync_data()?;
        if f.metadata()?.len() > MAX_FILE_BYTES {
            // Down to half the bound, so that the next compaction is many events away.
            let mut lines = Vec::new();
            let mut size = 0;
            for e in self.read(KEPT_EVENTS)? {
                let mut line = serde_json::to_vec(&e).map_err(std::io::Error::other)?;
                line.push(b'\n');
                size += line.len() as u64;
                if size > MAX_FILE_BYTES / 2 {
                    break;
                }
                lines.push(line);
            }
            let text: Vec<u8> = lines.into_iter().rev().flatten().collect();
            crate::config::write_atomic(&self.path, &text)?;
        }
        Ok(())
    }

    /// The newest `limit` events, newest first (at most [`MAX_FILE_BYTES`] read from the
    /// file's end; a line that does not parse, such as a line cut by a crash, is skipped).
    pub fn read(&self, limit: usize) -> std::io::Result<Vec<Event>> {
        let mut f = match std::fs::File::open(&self.path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e),
        };
        let len = f.metadata()?.len();
        let start = len.saturating_sub(MAX_FILE_BYTES);
        f.seek(SeekFrom::Start(start))?;
        let mut bytes = Vec::new();
        f.take(MAX_FILE_BYTES).read_to_end(&mut bytes)?;
        // Reading from the middle of the file: its first (partial) line is not an event.
        let text = if start > 0 {
            match bytes.iter().position(|&b| b == b'\n') {
                Some(i) => &bytes[i + 1..],
                None => &[][..],
            }
        } else {
            &bytes[..]
        };
        Ok(text
            .split(|&b| b == b'\n')
            .rev()
            .filter(|l| !l.is_empty())
            .filter_map(|l| serde_json::from_slice(l).ok())
            .take(limit)
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::overrides::OverrideRequest;

    fn ovr(id: u64) -> Override {
        Override {
            id: format!("ovr-{id}"),
            req: OverrideRequest {
                service: Some("payments".into()),
                bucket: Some("charge".into()),
                caller: None,
                procedure: None,
                limit_rps: Some(10.0),
                drop_ratio: None,
                shed_below: None,
                ttl_secs: 60,
                reason: format!("INC-{id}"),
                who: "alice".into(),
            },
            created_at: 1_000 + id,
            expires_at: 1_060 + id,
            credential: Some("oncall".into()),
        }
    }

    #[test]
    fn events_are_read_back_newest_first_and_a_cut_line_is_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let log = FileLog::in_dir(dir.path());
        assert!(log.read(10).unwrap().is_empty(), "no file, no event");
        let o = ovr(1);
        log.append(&[Event::created(&o)]).unwrap();
        log.append(&[Event::removed(&o, 1_030, "bob", "resolved", "oncall")])
            .unwrap();
        // A crash in the middle of a line.
        std::fs::OpenOptions::new()
            .append(true)
            .open(log.path())
            .unwrap()
            .write_all(b"{\"at\":12")
            .unwrap();
        log.append(&[Event::expired(&ovr(2))]).unwrap();
        let got = log.read(10).unwrap();
        let seen: Vec<(Action, &str, &str)> = got
            .iter()
            .map(|e| (e.action, e.id.as_str(), e.by.as_str()))
            .collect();
        assert_eq!(
            seen,
            [
                (Action::Expired, "ovr-2", "expiry"),
                (Action::Removed, "ovr-1", "bob"),
                (Action::Created, "ovr-1", "alice"),
            ]
        );
        assert_eq!(got[1].reason, "resolved");
        assert_eq!(got[2].overrides.req.limit_rps, Some(10.0));
        assert_eq!(log.read(1).unwrap().len(), 1);
    }

    #[test]
    fn the_file_is_compacted_to_the_newest_events() {
        let dir = tempfile::tempdir().unwrap();
        let log = FileLog::in_dir(dir.path());
        // A long reason makes each line about 4 KiB: the bound is crossed after ~4,100 lines.
        let mut o = ovr(0);
        o.req.reason = "x".repeat(4_000);
        let batch: Vec<Event> = (0..500)
            .map(|i| {
                let mut o = o.clone();
                o.id = format!("ovr-{i}");
                Event::created(&o)
            })
            .collect();
        for _ in 0..10 {
            log.append(&batch).unwrap();
        }
        let len = std::fs::metadata(log.path()).unwrap().len();
        assert!(len <= MAX_FILE_BYTES, "compacted: {len} bytes");
        let got = log.read(usize::MAX).unwrap();
        assert!(!got.is_empty() && got.len() <= KEPT_EVENTS);
        assert_eq!(got[0].id, "ovr-499", "the newest event is kept");
    }
}
