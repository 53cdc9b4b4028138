//! `rlc validate DIR`.
