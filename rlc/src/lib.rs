//! The Rate Limit Configurator: pulls RPS history, runs policies, writes bucket YAML to a git
//! config repo, pushes it to the GRL controller and stores runs and shadow reports.
//!
//! Module map (see ARCHITECTURE.md):
//! - `plan`: the computed quota set (what `preview` prints and `run` commits).
//! - `validate_cmd`: `rlc validate DIR`.
//! - `demo`: `rlc demo`, the whole loop on embedded defaults.
//! - `gitops`: git write-back (libgit2 writer, forge client for PRs, commit message/PR body).
//! - `push`: GRL controller client and the reconcile loop.
//! - `store`: runs, quota history, shadow reports (sqlx; Postgres or SQLite).
//! - `cycle`: apply a computed plan (render, validate, commit/PR, push, record); `rlc run --once`.
//! - `serve`: the daemon (`rlc serve`): schedule, input-change and API triggers, leader election.
//!   `serve::dashboard`: its read-only shadow-mode dashboard (`GET /`, `/v1/shadow`, `/v1/runs`).

pub mod cycle;
pub mod demo;
pub mod gitops;
pub mod plan;
pub mod push;
pub mod serve;
pub mod store;
pub mod validate_cmd;
