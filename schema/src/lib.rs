//! The user-facing file formats of the project: serde types, loading with errors
//! that name the file, line and key, whole-repo validation, deterministic rendering of bucket
//! files, and a JSON Schema for editors.
//!
//! Used by `rlc`, by the GRL controller and by `rlc validate` alike, so that what one accepts
//! the others accept too.

pub mod criticality;
pub mod duration;
mod lenient;
mod locate;
mod read;
mod render;
mod schedule;
mod types;
mod validate;

use std::fmt;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;

pub use criticality::Criticality;
pub use locate::{Locator, Pos};
pub use read::{kind_of, Limits};
pub use render::{format_rps, render_bucket_file};
pub use schedule::{parse_schedule, ScheduleError};
pub use types::*;
pub use validate::{
    load_bucket_dir, load_bucket_dir_with, load_daemon_config, validate_repo, CheckedDocuments,
    ConfigRepo, DocumentTexts,
};

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

/// One file parsed: the value if one could be built (with the parts that had problems
/// replaced, when `problems` is not empty) and every problem found while parsing.
#[derive(Debug, Clone)]
pub struct Parsed<T> {
    /// The value and the key positions; None when the file could not be read or is not YAML.
    pub located: Option<Located<T>>,
    /// Every problem, sorted; empty when the file parsed cleanly.
    pub problems: Vec<Diagnostic>,
}

impl<T> Parsed<T> {
    /// Whether a later check's diagnostic about `key` is a consequence of a parse problem of
    /// that key or of one of its ancestors (a replaced value, not the user's).
    pub fn explains(&self, key: &str) -> bool {
        self.problems.iter().any(|p| {
            !p.key.is_empty()
                && (key == p.key
                    || key.starts_with(&format!("{}.", p.key))
                    || key.starts_with(&format!("{}[", p.key)))
        })
    }

    fn refused(d: Diagnostic) -> Self {
        Parsed {
            located: None,
            problems: vec![d],
        }
    }
}

/// Parses YAML text read from `file` into `T` within `limits`, reporting every problem: the
/// nesting depth and node count are checked first in one linear pass (nothing else sees a
/// text that fails them), then serde_yaml decides; when it refuses, the file is walked again
/// leniently to find every other problem too.
pub fn parse_all<T: DeserializeOwned>(file: &Path, text: &str, limits: &Limits) -> Parsed<T> {
    parse_within(file, text, limits, u64::MAX).0
}

/// [`parse_all`] when the repo may have only `repo_left` more nodes; also returns the nodes
/// the file has (0 when refused).
pub(crate) fn parse_within<T: DeserializeOwned>(
    file: &Path,
    text: &str,
    limits: &Limits,
    repo_left: u64,
) -> (Parsed<T>, u64) {
    let scan_limits = locate::ScanLimits {
        max_depth: limits.max_depth,
        max_nodes: limits.max_nodes,
        repo_left,
        repo_max: limits.max_repo_nodes,
    };
    let locator = match locate::scan(text, scan_limits) {
        Ok(l) => l,
        Err((e, _)) => {
            return (
                Parsed::refused(Diagnostic {
                    file: file.to_path_buf(),
                    line: e.pos.line,
                    column: e.pos.column,
                    key: String::new(),
                    message: e.message,
                }),
                0,
            );
        }
    };
    let nodes = locator.nodes;
    (parse_located(file, text, locator), nodes)
}

fn parse_located<T: DeserializeOwned>(file: &Path, text: &str, locator: Locator) -> Parsed<T> {
    let first = match serde_yaml::from_str::<T>(text) {
        Ok(value) => {
            return Parsed {
                located: Some(Located {
                    file: file.to_path_buf(),
                    value,
                    locator,
                }),
                problems: Vec::new(),
            }
        }
        Err(e) => yaml_error(file, &locator, &e),
    };
    let Ok(tree) = serde_yaml::from_str::<serde_yaml::Value>(text) else {
        return Parsed::refused(first);
    };
    let (found, value) = lenient::collect::<T>(&tree);
    let mut problems: Vec<Diagnostic> = found
        .into_iter()
        .map(|p| {
            let pos = locator.pos(&p.path);
            Diagnostic {
                file: file.to_path_buf(),
                line: pos.line,
                column: pos.column,
                key: p.path,
                message: p.message,
            }
        })
        .collect();
    if !problems.iter().any(|p| p.key == first.key) {
        problems.push(first);
    }
    problems.sort();
    Parsed {
        located: value.map(|value| Located {
            file: file.to_path_buf(),
            value,
            locator,
        }),
        problems,
    }
}

/// Parses YAML text read from `file` into `T`, rejecting unknown keys; the first problem
/// when there is any (see [`parse_all`] for all of them).
pub fn parse_str<T: DeserializeOwned>(file: &Path, text: &str) -> Result<Located<T>, Diagnostic> {
    let p = parse_all::<T>(file, text, &Limits::DEFAULT);
    match (p.problems.into_iter().next(), p.located) {
        (None, Some(l)) => Ok(l),
        (Some(d), _) => Err(d),
        (None, None) => unreachable!("a file without problems has a value"),
    }
}

/// Reads and parses `file` (a regular file of at most [`Limits::max_file_bytes`]; symbolic
/// links are followed).
pub fn parse_file<T: DeserializeOwned>(file: &Path) -> Result<Located<T>, Diagnostic> {
    let text = read::Reader::anywhere(Limits::DEFAULT).read(file)?;
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
