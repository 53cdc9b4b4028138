//! End-to-end tests live in `tests/it`: real `rlc` and `grl` processes, a real git remote,
//! talking HTTP on loopback. `cargo xtask test` builds both binaries first; run alone, the
//! tests build them (`cargo build -p rlc -p grl-runtime --bins`) before starting.
