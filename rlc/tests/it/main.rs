//! Integration tests of the `rlc` binary (one test binary per crate).

mod validate;
