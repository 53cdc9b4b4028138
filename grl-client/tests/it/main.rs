//! grl-client integration tests.

mod deps;
mod fail_open;
mod overload;
mod tiers;
