//! Plugin ABI.
