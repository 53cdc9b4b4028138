//! GRL runtime: the control plane around the decision core. A client reporter per service
//! instance, zone aggregators, a controller (config API, overrides, ratios, reports,
//! metrics), a tower layer for axum services, and a simulator that runs the same code in
//! virtual time.

#![warn(missing_docs)]

pub mod aggregator;
pub mod audit;
pub mod auth;
pub mod calls;
pub mod cause;
pub mod client;
pub mod config;
pub mod controller;
pub mod delta;
pub mod engine;
mod frags;
pub mod http_util;
pub mod keys;
pub mod layer;
pub mod logging;
pub mod metrics;
pub mod overrides;
pub mod proto;

pub use http_util::ApiError;
pub mod realtime;
pub mod report;
pub mod server;
pub mod sim;
pub mod state_db;
#[cfg(test)]
mod tests;
pub mod tls;
