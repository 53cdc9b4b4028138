//! rlc integration tests: history from a real Prometheus, compute_plan end to end, backtests,
//! plugins through compute_plan.

mod backtest;
mod cli;
mod compute;
mod prometheus;
mod support;
