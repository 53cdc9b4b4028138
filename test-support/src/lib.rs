//! Throwaway real services for tests: Postgres (`postgres`), Prometheus backfilled with weeks
//! of generated history (`prometheus`), git repositories with a bare remote (`git`), and
//! throwaway certificate authorities (`tls`).
//!
//! Tests read service URLs from the environment (set by `cargo xtask test`); when a URL is
//! missing they start their own instance from the binaries on the machine, and fail with a
//! message saying how to provide it when that is impossible. Nothing is silently skipped: a
//! test that cannot run on this machine (a container runtime that cannot start containers)
//! says why through [`skip`], and `cargo xtask test` counts it as skipped, not passed.

pub mod cargo;
pub mod git;
pub mod overload;
pub mod plugin;
pub mod postgres;
pub mod process;
pub mod prometheus;
pub mod schemathesis;
pub mod tls;
pub mod venv;
pub mod wait;

/// The marker line `cargo xtask test` counts as a skipped test (written past libtest's
/// output capture, so it reaches the run's output).
pub const SKIP_MARKER: &str = "xtask-skip: ";

/// Declares the calling test skipped on this machine, and why; the test should return right
/// after. `cargo xtask test` counts it as skipped (not passed) and prints the reason.
pub fn skip(test: &str, reason: &str) {
    use std::io::Write;
    let line = format!("\n{SKIP_MARKER}{test}: {}\n", reason.replace('\n', " "));
    let _ = std::io::stdout().lock().write_all(line.as_bytes());
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}
