//! The quota plan of rlc, without I/O: history, the config repo's state (documents and the
//! bucket files in force) and the evidence gathered before planning go in, a typed
//! [`plan::Plan`] comes out. No network, no git, no database, no clock of its own (`now` is
//! an input): what a plan depends on is in its arguments, so that a run, a preview, the quota
//! API, a what-if and a backtest given the same inputs compute the same plan. Policy plugins run in their own
//! host processes, behind `policies::isolated`.
//!
//! - [`history`]: the series a plan reads, one service at a time ([`history::SeriesSource`]).
//! - [`compute`]: a policy per bucket (a contract first), planned events, the rails.
//! - [`plan`]: the plan (the shape of `rlc preview --format json`).
//! - [`change`]: the vocabulary of change between bucket files (commit message, PR body).
//! - [`readiness`], [`promotion`]: whether a shadow bucket is ready to enforce; the direct-mode
//!   split of what needs review.
//! - [`backtest`]: fit before a held-out window, score on it.

pub mod backtest;
pub mod censor;
pub mod change;
pub mod compute;
pub mod corpus;
pub mod evidence;
pub mod guard;
pub mod history;
pub mod pipeline;
pub mod plan;
pub mod plausibility;
pub mod promotion;
pub mod readiness;
pub mod rollout;
pub mod whatif;
