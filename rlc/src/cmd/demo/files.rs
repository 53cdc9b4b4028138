//! The files `rlc demo` leaves in its directory, and how a re-run treats them: every file the
//! demo writes is recorded with its git blob hash in `.rlc-demo-files`; a re-run rewrites a
//! file only while it still has the recorded hash, and keeps (with a message) one that was
//! edited since, or that the demo did not write.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::Context;

/// The manifest's name, in the demo directory.
pub const MANIFEST: &str = ".rlc-demo-files";

/// What [`Owned::write`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wrote {
    /// The file did not exist.
    Created,
    /// The demo's earlier version, unedited, replaced.
    Updated,
    /// Already this content.
    Same,
    /// Edited since the demo wrote it (or not written by the demo): left alone.
    Kept,
}

/// The demo directory's manifest: relative path → hash of the content the demo wrote.
#[derive(Debug)]
pub struct Owned {
    dir: PathBuf,
    hashes: BTreeMap<String, String>,
}

/// The git blob hash of `bytes` (what `git hash-object` prints).
pub fn hash(bytes: &[u8]) -> String {
    git2::Oid::hash_object(git2::ObjectType::Blob, bytes)
        .expect("hashing memory cannot fail")
        .to_string()
}

impl Owned {
    /// Reads the manifest of `dir` (none yet: empty).
    pub fn load(dir: &Path) -> anyhow::Result<Owned> {
        let path = dir.join(MANIFEST);
        let mut hashes = BTreeMap::new();
        match std::fs::read_to_string(&path) {
            Ok(text) => {
                for line in text.lines().filter(|l| !l.starts_with('#')) {
                    if let Some((h, rel)) = line.split_once(' ') {
                        hashes.insert(rel.to_string(), h.to_string());
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        }
        Ok(Owned {
            dir: dir.to_path_buf(),
            hashes,
        })
    }

    /// The demo directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether `rel` exists with the content the demo last wrote there.
    pub fn is_ours(&self, rel: &str) -> bool {
        match (std::fs::read(self.dir.join(rel)), self.hashes.get(rel)) {
            (Ok(bytes), Some(h)) => &hash(&bytes) == h,
            _ => false,
        }
    }

    /// Writes `content` to `rel` unless the file there was edited since the demo wrote it (or
    /// was not written by the demo): then it is kept. `secret` files get mode 600.
    pub fn write(&mut self, rel: &str, content: &str, secret: bool) -> anyhow::Result<Wrote> {
        let path = self.dir.join(rel);
        let wrote = match std::fs::read(&path) {
            Ok(bytes) if bytes == content.as_bytes() => Wrote::Same,
            Ok(_) if !self.is_ours(rel) => return Ok(Wrote::Kept),
            Ok(_) => Wrote::Updated,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Wrote::Created,
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        };
        if wrote != Wrote::Same {
            if secret {
                grl_client::auth::write_secret_file(&path, content)
            } else {
                std::fs::write(&path, content)
            }
            .with_context(|| format!("writing {}", path.display()))?;
        }
        self.hashes
            .insert(rel.to_string(), hash(content.as_bytes()));
        self.save()?;
        Ok(wrote)
    }

    /// Records the current content of `rel` as the demo's (after the demo changed it in place).
    pub fn record(&mut self, rel: &str) -> anyhow::Result<()> {
        let path = self.dir.join(rel);
        let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
        self.hashes.insert(rel.to_string(), hash(&bytes));
        self.save()
    }

    fn save(&self) -> anyhow::Result<()> {
        let mut text = String::from(
            "# Written by `rlc demo`: the files it wrote and their git blob hashes. A file whose\n\
             # hash no longer matches was edited and is kept by the next `rlc demo`.\n",
        );
        for (rel, h) in &self.hashes {
            text.push_str(&format!("{h} {rel}\n"));
        }
        let path = self.dir.join(MANIFEST);
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rewrites_its_own_files_and_keeps_edited_ones() {
        let d = tempfile::tempdir().unwrap();
        let mut o = Owned::load(d.path()).unwrap();
        assert_eq!(o.write("a.yaml", "one\n", false).unwrap(), Wrote::Created);
        assert_eq!(o.write("s", "secret\n", true).unwrap(), Wrote::Created);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(d.path().join("s"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        // A re-run (a new manifest reader): the demo's own file is rewritten.
        let mut o = Owned::load(d.path()).unwrap();
        assert_eq!(o.write("a.yaml", "one\n", false).unwrap(), Wrote::Same);
        assert_eq!(o.write("a.yaml", "two\n", false).unwrap(), Wrote::Updated);
        assert_eq!(
            std::fs::read_to_string(d.path().join("a.yaml")).unwrap(),
            "two\n"
        );
        // Edited by someone: kept, and kept on every later run.
        std::fs::write(d.path().join("a.yaml"), "mine\n").unwrap();
        let mut o = Owned::load(d.path()).unwrap();
        assert!(!o.is_ours("a.yaml"));
        assert_eq!(o.write("a.yaml", "three\n", false).unwrap(), Wrote::Kept);
        assert_eq!(o.write("a.yaml", "three\n", false).unwrap(), Wrote::Kept);
        assert_eq!(
            std::fs::read_to_string(d.path().join("a.yaml")).unwrap(),
            "mine\n"
        );
        // A file the demo never wrote is not its own either.
        std::fs::write(d.path().join("b"), "x").unwrap();
        assert_eq!(o.write("b", "y", false).unwrap(), Wrote::Kept);
        // Appended to by the demo itself and recorded: still its own.
        std::fs::write(d.path().join("s"), "secret\nmore\n").unwrap();
        assert!(!o.is_ours("s"));
        o.record("s").unwrap();
        assert!(Owned::load(d.path()).unwrap().is_ours("s"));
    }
}
