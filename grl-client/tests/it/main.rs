//! grl-client integration tests.

mod deps;
