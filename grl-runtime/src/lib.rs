//! GRL runtime.
