//! The Rate Limit Configurator: pulls RPS history, runs policies, writes bucket YAML to a git
//! config repo, pushes it to the GRL controller and stores runs and shadow reports.
//!
//! Module map (see ARCHITECTURE.md):
//! - `plan`: the computed quota set (what `preview` prints and `run` commits).
//! - `validate_cmd`: `rlc validate DIR`.

pub mod backtest;
pub mod compute;
pub mod history;
pub mod plan;
pub mod preview;
pub mod validate_cmd;
