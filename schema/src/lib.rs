//! The user-facing file formats of the project (DESIGN §3): serde types, loading with errors
//! that name the file, line and key, whole-repo validation, deterministic rendering of bucket
//! files, and a JSON Schema for editors.
//!
//! Used by `rlc`, by the GRL controller and by `rlc validate` alike, so that what one accepts
//! the others accept too.

mod locate;
mod render;
mod schedule;
mod types;
mod validate;

use std::fmt;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;

pub use locate::{Locator, Pos};
pub use render::{format_rps, render_bucket_file};
pub use schedule::parse_schedule;
pub use types::*;
pub use validate::{load_bucket_dir, load_daemon_config, validate_repo, ConfigRepo};

/// One problem in one file, at one line, about one key.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Diagnostic {
    /// The file, as given by the caller (relative paths stay relative).
    pub file: PathBuf,
    /// 1-based line.
    pub line: usize,
    /// 1-based column.
    pub column: usize,
    /// The YAML path of the key, e.g. `buckets[1].limit_rps` (empty for the whole file).
    pub key: String,
    /// What is wrong, lowercase, no trailing period.
    pub message: String,
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}: ", self.file.display(), self.line, self.column)?;
        if !self.key.is_empty() {
            write!(f, "{}: ", self.key)?;
        }
        f.write_str(&self.message)
    }
}

impl std::error::Error for Diagnostic {}

/// Several diagnostics as one error (displayed one per line).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnostics(pub Vec<Diagnostic>);

impl fmt::Display for Diagnostics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{d}")?;
        }
        Ok(())
    }
}

impl std::error::Error for Diagnostics {}

/// A parsed file together with the positions of its keys.
#[derive(Debug, Clone)]
pub struct Located<T> {
    /// The file it was read from.
    pub file: PathBuf,
    /// The parsed value.
    pub value: T,
    /// Key positions, for later checks.
    pub locator: Locator,
}

impl<T> Located<T> {
    /// A diagnostic about `key` of this file.
    pub fn diag(&self, key: impl Into<String>, message: impl Into<String>) -> Diagnostic {
        let key = key.into();
        let pos = self.locator.pos(&key);
        Diagnostic {
            file: self.file.clone(),
            line: pos.line,
            column: pos.column,
            key,
            message: message.into(),
        }
    }
}

/// Parses YAML text read from `file` into `T`, rejecting unknown keys.
pub fn parse_str<T: DeserializeOwned>(file: &Path, text: &str) -> Result<Located<T>, Diagnostic> {
    let locator = Locator::new(text);
    match serde_yaml::from_str::<T>(text) {
        Ok(value) => Ok(Located {
            file: file.to_path_buf(),
            value,
            locator,
        }),
        Err(e) => Err(yaml_error(file, &locator, &e)),
    }
}

/// Reads and parses `file`.
pub fn parse_file<T: DeserializeOwned>(file: &Path) -> Result<Located<T>, Diagnostic> {
    let text = std::fs::read_to_string(file).map_err(|e| Diagnostic {
        file: file.to_path_buf(),
        line: 1,
        column: 1,
        key: String::new(),
        message: format!("cannot read file: {e}"),
    })?;
    parse_str(file, &text)
}

/// Turns a serde_yaml error into a diagnostic: its message carries the key path as a prefix
/// (`buckets[0].scope: unknown variant ...`) and its position as a suffix.
fn yaml_error(file: &Path, locator: &Locator, e: &serde_yaml::Error) -> Diagnostic {
    let mut msg = e.to_string();
    if let Some(i) = msg.find(" at line ") {
        msg.truncate(i);
    }
    let (key, message) = match msg.split_once(": ") {
        Some((k, m)) if is_path(k) => (k.to_string(), m.to_string()),
        _ => (String::new(), msg.clone()),
    };
    // An unknown or missing field is best named by the field itself.
    let key = match field_named(&message) {
        Some(f) if key.is_empty() => f.to_string(),
        Some(f) => format!("{key}.{f}"),
        None => key,
    };
    let pos = match e.location() {
        Some(l) => Pos {
            line: l.line(),
            column: l.column(),
        },
        None => locator.pos(&key),
    };
    Diagnostic {
        file: file.to_path_buf(),
        line: pos.line,
        column: pos.column,
        key,
        message,
    }
}

fn is_path(s: &str) -> bool {
    !s.is_empty()
        && !s.contains(' ')
        && s.chars()
            .all(|c| c.is_alphanumeric() || matches!(c, '_' | '-' | '.' | '[' | ']'))
}

fn field_named(message: &str) -> Option<&str> {
    let rest = message
        .strip_prefix("unknown field `")
        .or_else(|| message.strip_prefix("missing field `"))?;
    rest.split('`').next()
}

/// The JSON Schema of every file format, keyed by file.
pub fn json_schema() -> serde_json::Value {
    let gen = || schemars::gen::SchemaSettings::draft07().into_generator();
    serde_json::json!({
        "buckets/<service>.yaml": gen().into_root_schema_for::<BucketFile>(),
        "rlc/policies.yaml": gen().into_root_schema_for::<PoliciesFile>(),
        "rlc/contracts.yaml": gen().into_root_schema_for::<ContractsFile>(),
        "rlc/capacity.yaml": gen().into_root_schema_for::<CapacityFile>(),
        "rlc.yaml": gen().into_root_schema_for::<DaemonConfig>(),
    })
}

#[cfg(test)]
mod tests;
