//! postgres helpers.
