//! Validation, loading and persistence of the controller's bucket config.

use std::collections::BTreeSet;
use std::path::Path;

use grl_core::{CompileError, Table};
use schema::BucketFile;

use crate::proto::ConfigDoc;

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
}

/// Checks everything the controller requires before applying `doc`: a version, unique
/// service names, and per service positive finite limits, unique bucket names and at least a
/// caller or a procedure per bucket (the same checks the client's compile runs).
pub fn validate(doc: &ConfigDoc) -> Result<(), ConfigError> {
    if doc.version.trim().is_empty() {
        return Err(ConfigError::EmptyVersion);
    }
    let mut seen = BTreeSet::new();
    for f in &doc.services {
        if !seen.insert(f.service.as_str()) {
            return Err(ConfigError::DuplicateService(f.service.clone()));
        }
        Table::check(&f.service, &f.buckets)?;
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
    };
    validate(&doc)?;
    Ok(doc)
}

/// FNV-1a of `b`: a stable content hash for config versions.
pub(crate) fn fnv(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
        (h ^ x as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// Writes `bytes` to `path` atomically (temp file + rename), so a crash never leaves half a
/// state file behind.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}
