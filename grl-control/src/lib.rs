//! The GRL control plane: the engine that turns the fleet's offered load into drop ratios
//! every tick ([`engine`]), the controller that serves it (config API, incident overrides,
//! per-second reports, metrics: [`controller`]), the zone aggregator between clients and the
//! controller ([`aggregator`]), and the controller's state database ([`state_db`], [`audit`]).
//! The client a service embeds is `grl-client`; the wire types are `grl-wire`; the serving
//! loop, TLS and HTTP helpers are `grl-server`.

#![warn(missing_docs)]

pub mod aggregator;
pub mod audit;
pub mod config;
pub mod controller;
pub mod delta;
pub mod engine;
mod frags;
pub mod metrics;
pub mod overrides;
mod period;
pub mod state_db;
#[cfg(test)]
mod tests;
