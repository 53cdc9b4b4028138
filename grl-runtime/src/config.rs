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
    /// A bucket file that does not parse.
    #[error("{0}")]
    File(#[from] schema::Diagnostic),
    /// The config directory cannot be read.
    #[error("cannot read config dir {path}: {source}")]
    Dir {
        /// The directory.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
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
        Table::compile(&f.service, &doc.version, &f.buckets)?;
    }
    Ok(())
}

/// Loads every `*.yaml`/`*.yml` in `dir` as a bucket file (sorted by name, errors name the file
/// and line); the version is `dir:<hash of the contents>` so that an unchanged dir is the same
/// version.
pub fn load_dir(dir: &Path) -> Result<ConfigDoc, ConfigError> {
    let rd = std::fs::read_dir(dir).map_err(|e| ConfigError::Dir {
        path: dir.display().to_string(),
        source: e,
    })?;
    let mut paths: Vec<_> = rd
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| matches!(p.extension().and_then(|x| x.to_str()), Some("yaml" | "yml")))
        .collect();
    paths.sort();
    let mut services = Vec::new();
    for p in &paths {
        let f = schema::parse_file::<BucketFile>(p)?;
        services.push(f.value);
    }
    let text = serde_json::to_string(&services).unwrap_or_default();
    let doc = ConfigDoc {
        version: format!("dir:{:016x}", fnv(text.as_bytes())),
        services,
    };
    validate(&doc)?;
    Ok(doc)
}

fn fnv(b: &[u8]) -> u64 {
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
