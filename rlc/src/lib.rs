//! The Rate Limit Configurator: pulls RPS history, runs policies, writes bucket YAML to a git
//! config repo, pushes it to the GRL controller and stores runs and shadow reports.
//!
//! Module map (see ARCHITECTURE.md):
//! - `history`: RPS history from Prometheus or a file; `history::synth` makes the quickstart's.
//! - `compute`: policies and rails per bucket → a `Plan`; `preview` and `backtest` print it.
//! - `pipeline`: the planner `run`/`serve`/`demo` use: history → compute → plan.
//! - `planner`: the plan a run would really do (compute + the decrease guard), shared by
//!   `run`, `preview` and the quota API.
//! - `snapshot`: the daemon's in-memory history snapshot (single-flight pulls).
//! - `plan`: the computed quota set (what `preview` prints and `run` commits).
//! - `validate_cmd`: `rlc validate DIR`.
//! - `whatif`: what-if previews (`POST /v1/previews`): a plan for changed `rlc/*.yaml`, its diff
//!   from the current plan and the backtest of both; writes nothing.
//! - `exit`: the exit codes of every command.
//! - `demo`: `rlc demo`, the whole loop on embedded defaults.
//! - `gitops`: git write-back (libgit2 writer, forge client for PRs, commit message/PR body).
//! - `push`: GRL controller client and the reconcile loop.
//! - `readiness`: whether a shadow bucket is ready to enforce (dashboard verdict, promotion).
//! - `store`: runs, quota history, shadow reports (sqlx; Postgres or SQLite).
//! - `cycle`: apply a computed plan (render, validate, commit/PR, push, record); `rlc run --once`.
//! - `serve`: the daemon (`rlc serve`): schedule, input-change and API triggers, leader election.
//!   `serve::dashboard`: its read-only shadow-mode dashboard (`GET /`, `/v1/shadow`, `/v1/runs`).

pub mod backtest;
pub mod compute;
pub mod corpus;
pub mod cycle;
pub mod demo;
pub mod exit;
pub mod gather;
pub mod gitops;
pub mod history;
pub mod pipeline;
pub mod preview;
pub mod promotion;
pub mod push;
pub mod serve;
pub mod snapshot;
pub mod store;
pub mod validate_cmd;

pub use rlc_plan::{plan, readiness, whatif};
