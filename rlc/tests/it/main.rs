//! Integration tests of the `rlc` binary and library (one test binary per crate): validation,
//! history from a real Prometheus, compute_plan end to end, backtests, plugins.

// End-to-end scenarios read top to bottom; the size bound (clippy.toml) is for code outside
// tests.
#![allow(clippy::too_many_lines)]

mod agreement;
mod backtest;
mod cli;
mod compute;
mod faults;
mod git_faults;
mod history_bounds;
mod history_faults;
mod incremental;
mod layers;
mod learning;
mod one_plan;
mod ops;
mod previews;
mod prometheus;
mod quotas;
mod records;
mod rollouts;
mod support;
mod validate;
