//! Example plugin.
