//! GRL decision core: the bucket set compiled into a lookup, drop-by-ratio decisions, sharded
//! counters, fail-open on stale directives, and the controller's ratio math.
//!
//! Invariants (stated as absences): this crate does no I/O, spawns no threads, and takes no
//! lock and allocates nothing on the decision path (`Limiter::decide*`; only `install`
//! serializes installers on a mutex). The control plane in
//! `grl-runtime` and the simulator sit around it and call the same code.

#![warn(missing_docs)]

mod caps;
mod clock;
pub mod control;
mod counters;
pub mod criticality;
mod limiter;
mod lookup;
mod rng;

pub use clock::now_ms;
pub use counters::BucketCounts;
pub use limiter::{CompileError, Decision, Limiter, Table};
pub use rng::{seed_thread_rng, thread_rng_u64};

#[cfg(test)]
mod tests;
