//! git helpers.
