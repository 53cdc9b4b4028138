//! prometheus helpers.
