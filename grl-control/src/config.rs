//! Validation, loading and persistence of the controller's bucket config.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use grl_core::{CompileError, Table};
use schema::BucketFile;

use grl_wire::ConfigDoc;

/// Why a config cannot be applied.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A bucket set does not compile.
    #[error(transparent)]
    Bucket(#[from] CompileError),
    /// Two files for one service.
    #[error("service `{0}` appears twice")]
    DuplicateService(String),
    /// An empty version string.
    #[error("version must not be empty")]
    EmptyVersion,
    /// Problems in the bucket files, each with file, line and key (one per line). Not a
    /// `source`: the diagnostics are the message, so chains print them once.
    #[error("{0}")]
    Files(schema::Diagnostics),
    /// A pushed bucket named like the buckets the controller adds for traffic overrides.
    #[error("service `{service}`, bucket `{bucket}`: names starting with `{RESERVED_PREFIX}` are reserved for the buckets the controller adds for traffic overrides; a config read from GET /v1/config carries them (restore GET /v1/config?view=pushed, the config as pushed, instead)")]
    Reserved {
        /// The service.
        service: String,
        /// The bucket.
        bucket: String,
    },
    /// A candidate limit that cannot be evaluated; the message names the field
    /// (`candidates[3].bucket.limit_rps`).
    #[error("{0}")]
    Candidate(#[from] grl_wire::candidates::CandidateError),
    /// Traffic overrides would add too many buckets to the served config.
    #[error("the overrides would add {added} buckets to the served config, more than {max}; target a service or a procedure, or put the limit in the bucket files")]
    TooManyOverrideBuckets {
        /// Buckets the overrides would add.
        added: usize,
        /// The bound ([`MAX_OVERRIDE_BUCKETS`]).
        max: usize,
    },
}

/// Bucket names starting with this are the controller's: the buckets it adds to the served
/// config for traffic overrides (`override:<id>`, `override:<id>:<procedure>`). A pushed config
/// may not use it, so that an override's bucket never collides with a pushed one.
pub const RESERVED_PREFIX: &str = "override:";

/// The most buckets traffic overrides may add to the served config (as many as a config repo
/// may hold).
pub const MAX_OVERRIDE_BUCKETS: usize = 100_000;

/// [`validate`], and what only a pushed config (`PUT /v1/config`, `--config-dir`, the persisted
/// `config.json`) must also satisfy: no bucket name starting with [`RESERVED_PREFIX`].
pub fn validate_pushed(doc: &ConfigDoc) -> Result<(), ConfigError> {
    validate(doc)?;
    for f in &doc.services {
        if let Some(b) = f
            .buckets
            .iter()
            .find(|b| b.name.starts_with(RESERVED_PREFIX))
        {
            return Err(ConfigError::Reserved {
                service: f.service.clone(),
                bucket: b.name.clone(),
            });
        }
    }
    Ok(())
}

/// Checks everything the controller requires before applying `doc`: a version, unique
/// service names, and per service positive finite limits, unique bucket names and at least a
/// caller or a procedure per bucket (the same checks the client's compile runs); and its
/// candidates ([`check_candidates`]).
pub fn validate(doc: &ConfigDoc) -> Result<(), ConfigError> {
    if doc.version.trim().is_empty() {
        return Err(ConfigError::EmptyVersion);
    }
    let mut seen = BTreeSet::new();
    for f in &doc.services {
        if !seen.insert(f.service.as_str()) {
            return Err(ConfigError::DuplicateService(f.service.clone()));
        }
        Table::check_file(f)?;
    }
    check_candidates(doc)?;
    Ok(())
}

/// The candidates of `doc`: the checks of [`grl_wire::candidates::check_candidates`] (count,
/// ids, limits, a matcher), a bucket name not starting with [`RESERVED_PREFIX`], and a bucket
/// that compiles in place of the service's bucket of that name (or beside the service's
/// buckets when it is new: no two buckets with one caller and procedure). A candidate's
/// service need not have a bucket file yet (the first enforced bucket of a new service is a
/// candidate too). Errors name the field (`candidates[3].bucket.limit_rps`).
pub fn check_candidates(doc: &ConfigDoc) -> Result<(), ConfigError> {
    use grl_wire::candidates::CandidateError;
    grl_wire::candidates::check_candidates(&doc.candidates)?;
    if doc.candidates.is_empty() {
        return Ok(());
    }
    type Match<'a> = (Option<&'a str>, Option<&'a str>);
    let by_match: std::collections::HashMap<(&str, Match), &str> = doc
        .services
        .iter()
        .flat_map(|f| {
            f.buckets.iter().map(|b| {
                (
                    (
                        f.service.as_str(),
                        (b.caller.as_deref(), b.procedure.as_deref()),
                    ),
                    b.name.as_str(),
                )
            })
        })
        .collect();
    for (i, c) in doc.candidates.iter().enumerate() {
        let bad = |field: &str, message: String| CandidateError {
            field: format!("candidates[{i}].{field}"),
            message,
        };
        if c.bucket.name.starts_with(RESERVED_PREFIX) {
            return Err(bad(
                "bucket.name",
                format!("names starting with `{RESERVED_PREFIX}` are reserved for the buckets the controller adds for traffic overrides"),
            )
            .into());
        }
        Table::check(&c.service, std::slice::from_ref(&c.bucket))
            .map_err(|e| bad("bucket", e.to_string()))?;
        let key = (c.bucket.caller.as_deref(), c.bucket.procedure.as_deref());
        if let Some(other) = by_match
            .get(&(c.service.as_str(), key))
            .filter(|n| **n != c.bucket.name)
        {
            return Err(bad(
                "bucket",
                format!("matches the same caller and procedure as bucket `{other}` of service `{}`; a candidate replaces the bucket of its name", c.service),
            )
            .into());
        }
    }
    Ok(())
}

/// Loads the bucket files of `dir` exactly as `rlc validate` does ([`schema::load_bucket_dir`]:
/// `*.yaml` only, unknown keys refused, `service` equal to the file name, …) and refuses on
/// any problem, reporting all of them with file and line. The version is
/// `dir:<hash of the contents>` so that an unchanged dir is the same version.
pub fn load_dir(dir: &Path) -> Result<ConfigDoc, ConfigError> {
    let (files, diags) = schema::load_bucket_dir(dir);
    if !diags.is_empty() {
        return Err(ConfigError::Files(schema::Diagnostics(diags)));
    }
    let services: Vec<BucketFile> = files.into_iter().map(|f| f.value).collect();
    let text = serde_json::to_string(&services).unwrap_or_default();
    let doc = ConfigDoc {
        version: format!("dir:{:016x}", fnv(text.as_bytes())),
        services,
        candidates: Vec::new(),
    };
    validate_pushed(&doc)?;
    Ok(doc)
}

/// FNV-1a of `b`: a stable content hash for config versions.
pub(crate) fn fnv(b: &[u8]) -> u64 {
    fnv_from(0xcbf2_9ce4_8422_2325u64, b)
}

/// FNV-1a of `b` continued from `h` (the hash of what came before).
pub(crate) fn fnv_from(h: u64, b: &[u8]) -> u64 {
    b.iter()
        .fold(h, |h, &x| (h ^ x as u64).wrapping_mul(0x100_0000_01b3))
}

/// Writes `bytes` to `path` atomically and durably: a temp file beside it is written and
/// fsynced, renamed over `path`, and the directory is fsynced, so that once this returns the
/// new content survives a crash or power loss, and a crash at any point leaves either the old
/// or the new file, never half of one.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, path)?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    std::fs::File::open(dir)?.sync_all()
}

/// The largest state file the controller reads back (`config.json`, `overrides.json`): four
/// times the largest config body `PUT /v1/config` accepts, for the pretty-printed form.
pub const MAX_STATE_FILE: u64 = 256 << 20;

/// Why a state file is not read back; each message names the file.
#[derive(Debug, thiserror::Error)]
pub enum StateFileError {
    /// It could not be examined, opened or read.
    #[error("{}: {err}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What the system said.
        err: std::io::Error,
    },
    /// A symlink, a FIFO, a device or a directory.
    #[error("{}: not a regular file ({kind}); state files must be plain files", path.display())]
    NotRegular {
        /// The file.
        path: PathBuf,
        /// What it is instead.
        kind: &'static str,
    },
    /// Larger than the limit when examined.
    #[error("{}: {len} bytes, more than the {max} bytes a state file may have", path.display())]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// Grew past the limit between the check and the read.
    #[error("{}: grew past the {max} bytes a state file may have", path.display())]
    Grew {
        /// The file.
        path: PathBuf,
        /// The limit.
        max: u64,
    },
}

/// Reads a state file: `None` when it does not exist; an error naming the file when it is not
/// a regular file (a symlink, a FIFO, a device) or is larger than `max` bytes. Nothing is
/// opened before the checks, so a FIFO never blocks and `/dev/zero` is never read.
pub fn read_state_file(path: &Path, max: u64) -> Result<Option<Vec<u8>>, StateFileError> {
    use std::io::Read;
    let io = |err| StateFileError::Io {
        path: path.to_path_buf(),
        err,
    };
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io(e)),
    };
    if !meta.file_type().is_file() {
        return Err(StateFileError::NotRegular {
            path: path.to_path_buf(),
            kind: schema::kind_of(&meta.file_type()),
        });
    }
    if meta.len() > max {
        return Err(StateFileError::TooLarge {
            path: path.to_path_buf(),
            len: meta.len(),
            max,
        });
    }
    let f = std::fs::File::open(path).map_err(io)?;
    // Bounded even if the file grows between the check and the read.
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    f.take(max + 1).read_to_end(&mut bytes).map_err(io)?;
    if bytes.len() as u64 > max {
        return Err(StateFileError::Grew {
            path: path.to_path_buf(),
            max,
        });
    }
    Ok(Some(bytes))
}
