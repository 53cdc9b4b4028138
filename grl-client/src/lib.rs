//! The GRL client, the part a service embeds: [`client::GrlClient`] reports each tick to
//! zone aggregators (failover between them, fail-open when none answers) and applies the drop
//! ratios they return to a `grl_core::Limiter`; [`layer::GrlLayer`] decides every request of a
//! tower (axum, hyper) service with it and counts every call by (caller, procedure).
//!
//! Its dependency tree holds no database driver, no command-line parser and no server code
//! (checked by `tests/it/deps.rs` with `cargo tree`); the `grl` binary (`grl-runtime`) adds the
//! aggregator, the controller, the overrides and the sidecar on top of it and re-exports
//! these modules under their old paths (`grl_runtime::layer::GrlLayer`, ...).

#![warn(missing_docs)]

pub mod auth;
pub mod calls;
pub mod cause;
pub mod client;
pub mod concurrency;
pub mod http_util;
pub mod keys;
pub mod layer;
pub mod metrics;
pub mod tiers;
pub mod tls;

pub use client::{ClientOptions, GrlClient};
pub use layer::{GrlLayer, KeyFrom};
