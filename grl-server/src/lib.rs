//! The serving side shared by every daemon (controller, aggregator, sidecar, `rlc serve`):
//! the accept loop with connection caps, header and idle timeouts ([`server`]), server TLS
//! with certificate reload and client certificates ([`tls`]), the HTTP error type, bounded
//! body reads, token checks, health and readiness answers ([`http_util`]), the `/metrics`
//! answer ([`metrics`]) and the logging setup ([`logging`]).

#![warn(missing_docs)]

pub mod http_util;
pub mod logging;
pub mod metrics;
pub mod server;
pub mod tls;
