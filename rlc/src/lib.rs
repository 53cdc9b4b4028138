//! The Rate Limit Configurator: pulls RPS history, runs policies, writes bucket YAML to a git
//! config repo, pushes it to the GRL controller and stores runs and shadow reports.
//!
//! Layers, each importing only those below it (ARCHITECTURE.md; checked by
//! `tests/it/layers.rs`):
//! 1. adapters: `cmd` (the one-shot commands: `run`, `preview`, `backtest`, `validate`,
//!    `demo`) and `serve` (the daemon, its HTTP API and dashboard);
//! 2. the orchestrator of a run: `cycle` (sync once → gather → plan → write → propose → push →
//!    record), with its computing step `cycle::compute`;
//! 3. readers and writers of the world: `gather` (everything a plan depends on, read once),
//!    `gitops` (the config repo, the forge), `store` (runs, quota history, shadow reports),
//!    `history` (Prometheus, files, the daemon's snapshot), `shadow` (shadow figures from the
//!    store), `journal` (run records on their way to the store), `push` (the controller);
//! 4. base: `config` (rlc.yaml), `retry` (the one backoff), `exit` (exit codes);
//! 5. the plan itself, without I/O: the `rlc-plan` crate ([`plan`], [`readiness`],
//!    [`whatif`] re-exported here).

use std::future::Future;
use std::pin::Pin;

pub mod cmd;
pub mod config;
pub mod cycle;
pub mod exit;
pub mod gather;
pub mod gitops;
pub mod history;
pub mod journal;
pub mod push;
pub mod quota_view;
pub mod retry;
pub mod rollout;
pub mod serve;
pub mod shadow;
pub mod store;

/// A boxed future, as the seams between layers return them.
pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;
