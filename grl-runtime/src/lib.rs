//! GRL runtime, the `grl` binary's crate: its command line (controller, aggregator, sidecar,
//! overrides) and the simulator that runs the control plane's engine in virtual time
//! ([`sim`], [`realtime`], [`report`]). The control plane itself is `grl-control`, the
//! data-plane proxy `grl-sidecar`, the client a service embeds `grl-client`.

#![warn(missing_docs)]

pub mod realtime;
pub mod report;
pub mod sim;
#[cfg(test)]
mod tests;
