//! Throwaway real services for tests: Postgres (`postgres`), Prometheus backfilled with weeks
//! of generated history (`prometheus`), git repositories with a bare remote (`git`), and
//! throwaway certificate authorities (`tls`).
//!
//! Tests read service URLs from the environment (set by `cargo xtask test`); when a URL is
//! missing they start their own instance from the binaries on the machine, and fail with a
//! message saying how to provide it when that is impossible. Nothing is silently skipped.

pub mod git;
pub mod plugin;
pub mod postgres;
pub mod process;
pub mod prometheus;
pub mod schemathesis;
pub mod tls;
