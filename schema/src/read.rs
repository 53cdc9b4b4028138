//! The one reader of config-repo files. Every loader (`ConfigRepo::load`, `load_bucket_dir`,
//! which `grl controller --config-dir` uses too, and `load_daemon_config`) reads through it, so
//! that a hostile or unlucky repo cannot make any of them hang, run out of memory or print a
//! file from outside the repo:
//!
//! - only regular files: a FIFO, a device, a socket or a directory is refused without reading
//!   (checked before opening, and again with `fstat` on a descriptor opened with `O_NONBLOCK`
//!   and `O_NOFOLLOW`, so that nothing can block and a swapped path cannot slip through);
//! - inside the repo only: a symbolic link is followed only when it resolves inside the repo's
//!   root (a link to `/etc/passwd` or `/dev/zero` is refused, and the error names the link and
//!   its target, never the target's content);
//! - a size limit per file and per repo, checked before reading and while reading (a file that
//!   grows is cut at the limit and refused);
//! - then, before any deserialiser sees the text, one linear pass refuses nesting deeper than
//!   [`Limits::max_depth`] and more than [`Limits::max_nodes`] nodes (aliases count the nodes
//!   they repeat).
//!
//! Every refusal is a [`Diagnostic`] naming the file and the reason.

use std::io::Read;
use std::path::{Path, PathBuf};

use crate::Diagnostic;

/// The bounds on reading a config repo. The defaults are documented in the config repo's
/// README; they are far above what a real repo needs (1,000 services × 10 buckets is about
/// 1.2 MB and 10,000 buckets).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Bytes per file (default 4 MiB).
    pub max_file_bytes: u64,
    /// Bytes of all the files of one repo (or one `--config-dir`) together (default 64 MiB).
    pub max_repo_bytes: u64,
    /// Mappings and sequences nested inside each other (default 64).
    pub max_depth: usize,
    /// YAML nodes per file, an alias counting the nodes it repeats (default 1,000,000).
    pub max_nodes: u64,
    /// YAML nodes of all the files of one repo together (default 4,000,000).
    pub max_repo_nodes: u64,
    /// Buckets in all the files of `buckets/` together (default 100,000).
    pub max_buckets: usize,
    /// Entries of the `buckets/` directory (default 20,000).
    pub max_dir_entries: usize,
    /// Problems reported per file; the rest are counted in one last line (default 1,000).
    pub max_problems_per_file: usize,
}

impl Limits {
    /// The documented defaults.
    pub const DEFAULT: Limits = Limits {
        max_file_bytes: 4 << 20,
        max_repo_bytes: 64 << 20,
        max_depth: 64,
        max_nodes: 1_000_000,
        max_repo_nodes: 4_000_000,
        max_buckets: 100_000,
        max_dir_entries: 20_000,
        max_problems_per_file: 1_000,
    };
}

impl Default for Limits {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// Reads the files of one repo within its limits, counting the bytes read so far.
#[derive(Debug)]
pub(crate) struct Reader {
    /// The canonical root files must resolve into; None: anywhere (e.g. `rlc.yaml`).
    root: Option<PathBuf>,
    pub limits: Limits,
    used: u64,
    /// YAML nodes of the files parsed so far.
    pub nodes: u64,
}

pub(crate) fn file_diag(file: &Path, message: String) -> Diagnostic {
    Diagnostic {
        file: file.to_path_buf(),
        line: 1,
        column: 1,
        key: String::new(),
        message,
    }
}

/// What a file that is not a regular one is, for error messages ("a FIFO (named pipe)", …).
pub fn kind_of(ft: &std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if ft.is_dir() {
        "a directory"
    } else if ft.is_fifo() {
        "a FIFO (named pipe)"
    } else if ft.is_char_device() {
        "a character device"
    } else if ft.is_block_device() {
        "a block device"
    } else if ft.is_socket() {
        "a socket"
    } else if ft.is_symlink() {
        "a symbolic link"
    } else {
        "not a regular file"
    }
}

/// `n` bytes for people: `4 MiB`, `1536 bytes`.
pub(crate) fn bytes(n: u64) -> String {
    if n >= 1 << 20 && n.is_multiple_of(1 << 20) {
        format!("{} MiB", n >> 20)
    } else if n >= 1 << 10 && n.is_multiple_of(1 << 10) {
        format!("{} KiB", n >> 10)
    } else {
        format!("{n} bytes")
    }
}

impl Reader {
    /// A reader confined to `root` (which must exist).
    pub fn confined(root: &Path, limits: Limits) -> Result<Self, Diagnostic> {
        let root = std::fs::canonicalize(root)
            .map_err(|e| file_diag(root, format!("cannot read directory: {e}")))?;
        Ok(Self {
            root: Some(root),
            limits,
            used: 0,
            nodes: 0,
        })
    }

    /// A reader for a file that may live anywhere (symbolic links followed), with the same
    /// regular-file and size checks.
    pub fn anywhere(limits: Limits) -> Self {
        Self {
            root: None,
            limits,
            used: 0,
            nodes: 0,
        }
    }

    /// Where `path` really is, if it is inside the root (a directory or a file).
    pub fn resolve(&self, path: &Path) -> Result<PathBuf, Diagnostic> {
        let real = std::fs::canonicalize(path).map_err(|e| {
            let link = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink());
            if link {
                file_diag(
                    path,
                    format!("refused: a symbolic link that resolves to nothing readable ({e})"),
                )
            } else {
                file_diag(path, format!("cannot read file: {e}"))
            }
        })?;
        if let Some(root) = &self.root {
            if !real.starts_with(root) {
                return Err(file_diag(
                    path,
                    format!(
                        "refused: a symbolic link to {} outside the repo {} (only files inside the repo are read)",
                        real.display(),
                        root.display()
                    ),
                ));
            }
        }
        Ok(real)
    }

    /// Reads `path` as UTF-8 text within the limits; every refusal names the file and why.
    pub fn read(&mut self, path: &Path) -> Result<String, Diagnostic> {
        use std::os::unix::fs::OpenOptionsExt;
        let real = self.resolve(path)?;
        // Refuse what is not a regular file before opening it (opening a device can have
        // effects), and check again on the descriptor below.
        let meta = std::fs::metadata(&real)
            .map_err(|e| file_diag(path, format!("cannot read file: {e}")))?;
        self.check_meta(path, &meta)?;
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(&real)
            .map_err(|e| file_diag(path, format!("cannot read file: {e}")))?;
        let meta = f
            .metadata()
            .map_err(|e| file_diag(path, format!("cannot read file: {e}")))?;
        self.check_meta(path, &meta)?;
        let max = self.limits.max_file_bytes;
        let mut buf = Vec::with_capacity(meta.len().min(max) as usize);
        (&mut f)
            .take(max + 1)
            .read_to_end(&mut buf)
            .map_err(|e| file_diag(path, format!("cannot read file: {e}")))?;
        let n = buf.len() as u64;
        if n > max {
            return Err(self.too_big(path, n));
        }
        self.charge(path, n)?;
        String::from_utf8(buf).map_err(|e| {
            file_diag(
                path,
                format!(
                    "not UTF-8 text (invalid byte at offset {})",
                    e.utf8_error().valid_up_to()
                ),
            )
        })
    }

    fn check_meta(&self, path: &Path, meta: &std::fs::Metadata) -> Result<(), Diagnostic> {
        if !meta.file_type().is_file() {
            return Err(file_diag(
                path,
                format!(
                    "refused: {}, not a regular file (only regular files are read)",
                    kind_of(&meta.file_type())
                ),
            ));
        }
        if meta.len() > self.limits.max_file_bytes {
            return Err(self.too_big(path, meta.len()));
        }
        if self.used + meta.len() > self.limits.max_repo_bytes {
            return Err(self.over_budget(path));
        }
        Ok(())
    }

    fn too_big(&self, path: &Path, n: u64) -> Diagnostic {
        file_diag(
            path,
            format!(
                "refused: larger than {} (at least {n} bytes); a file may have at most {}",
                bytes(self.limits.max_file_bytes),
                bytes(self.limits.max_file_bytes)
            ),
        )
    }

    fn over_budget(&self, path: &Path) -> Diagnostic {
        file_diag(
            path,
            format!(
                "refused: not read, the files read before it and this one exceed {} together (the limit per repo)",
                bytes(self.limits.max_repo_bytes)
            ),
        )
    }

    fn charge(&mut self, path: &Path, n: u64) -> Result<(), Diagnostic> {
        if self.used + n > self.limits.max_repo_bytes {
            return Err(self.over_budget(path));
        }
        self.used += n;
        Ok(())
    }
}
