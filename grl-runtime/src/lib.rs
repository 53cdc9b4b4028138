//! GRL runtime, the `grl` binary's crate: the control plane around the decision core. Zone
//! aggregators, a controller (config API, overrides, ratios, reports, metrics) and a simulator
//! that runs the same code in virtual time. The client a service embeds (`GrlClient`,
//! `GrlLayer`) is the `grl-client` crate and the wire types are `grl-wire`: both are
//! re-exported here under their old paths (`grl_runtime::layer::GrlLayer`,
//! `grl_runtime::proto::ConfigDoc`, ...).

#![warn(missing_docs)]

pub mod aggregator;
pub mod audit;
pub use grl_client::auth;
pub use grl_client::calls;
pub use grl_client::cause;
pub use grl_client::client;
pub mod config;
pub mod controller;
pub mod delta;
pub mod engine;
mod frags;
pub use grl_client::keys;
pub use grl_client::layer;
pub mod metrics;
pub mod overrides;
mod period;
pub use grl_wire as proto;
pub mod realtime;
pub mod report;
pub mod sim;
pub mod state_db;
#[cfg(test)]
mod tests;
