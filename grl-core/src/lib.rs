//! GRL decision core.
