//! Integration tests of the `rlc` binary and library (one test binary per crate): validation,
//! history from a real Prometheus, compute_plan end to end, backtests, plugins.

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
