//! Schemathesis (PyPI), the property-based API tester, at a pinned version in a venv of its
//! own, installed on first use: `~/.cache/grl-tests/schemathesis-<version>` (or under
//! `$GRL_TEST_CACHE`; see [`crate::venv`]).

use std::path::PathBuf;

use anyhow::Result;

/// The pinned version.
pub const VERSION: &str = "4.32.5";

/// The `schemathesis` executable, installing it when missing. Concurrent callers (test
/// binaries) take turns on a lock file; a finished install is marked by a file written last,
/// so an interrupted one is redone.
pub fn executable() -> Result<PathBuf> {
    crate::venv::tool("schemathesis", VERSION, "schemathesis")
}
