//! Policies.
