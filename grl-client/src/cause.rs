//! Why a call to another tier failed, in words an operator can act on: "certificate expired on
//! 2025-01-01 00:00:00 UTC", "host name mismatch", "connection refused", "timed out after
//! 2000 ms", instead of reqwest's "error sending request for url (…)" whose cause is buried in
//! its source chain. Used wherever grl calls another tier: aggregator → controller, client →
//! aggregator, controller → peer, `grl override` → controller.

use std::error::Error as StdError;
use std::time::Duration;

use rustls::pki_types::UnixTime;
use rustls::{AlertDescription, CertificateError};

/// The cause of a failed HTTP call, with the URL it went to. `timeout` is the client's bound,
/// named when the call ran out of it.
pub fn describe(e: &reqwest::Error, timeout: Duration) -> String {
    let cause = cause_of(e, timeout);
    match e.url() {
        Some(u) => format!("{}: {cause}", without_query(u)),
        None => cause,
    }
}

/// [`describe`] for an error that may hold a `reqwest::Error` in its chain (an `anyhow` error
/// with context); others print their chain.
pub fn describe_any(e: &anyhow::Error, timeout: Duration) -> String {
    match e.downcast_ref::<reqwest::Error>() {
        Some(r) => describe(r, timeout),
        None => format!("{e:#}"),
    }
}

fn without_query(u: &reqwest::Url) -> String {
    let mut u = u.clone();
    u.set_query(None);
    u.to_string()
}

fn cause_of(e: &reqwest::Error, timeout: Duration) -> String {
    if let Some(status) = e.status() {
        return format!("answered {status}");
    }
    if let Some(c) = known_cause(e, timeout, e.is_timeout()) {
        return c;
    }
    if e.is_decode() || e.is_body() {
        return format!("unreadable answer ({})", chain(e));
    }
    chain(e)
}

/// Why any error (hyper's client, a connect) failed, in the words of [`describe`]: a TLS
/// certificate problem, a timeout, connection refused or reset; else its chain.
pub fn describe_error(e: &(dyn StdError + 'static), timeout: Duration) -> String {
    known_cause(e, timeout, false).unwrap_or_else(|| chain(e))
}

/// The most specific cause in the chain: a TLS certificate problem, then a timeout (`timed_out`:
/// the caller knows it timed out), then the I/O error.
fn known_cause(e: &(dyn StdError + 'static), timeout: Duration, timed_out: bool) -> Option<String> {
    let mut io_kind = None;
    let mut dns = None;
    for err in errors(e) {
        if let Some(t) = err.downcast_ref::<rustls::Error>() {
            return Some(tls(t));
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            // The innermost kind that says something (an outer one is often `Other`).
            if io_kind.is_none() || io.kind() != std::io::ErrorKind::Other {
                io_kind = Some(io.kind());
            }
        }
        let text = err.to_string();
        if dns.is_none() && text.starts_with("dns error") {
            dns = Some(text);
        }
    }
    if timed_out || io_kind == Some(std::io::ErrorKind::TimedOut) {
        return Some(format!("timed out after {} ms", timeout.as_millis()));
    }
    if let Some(d) = dns {
        return Some(format!("cannot resolve the host name ({d})"));
    }
    match io_kind {
        Some(std::io::ErrorKind::ConnectionRefused) => Some("connection refused".into()),
        Some(std::io::ErrorKind::ConnectionReset) => Some("connection reset by the server".into()),
        Some(std::io::ErrorKind::UnexpectedEof) => {
            Some("the server closed the connection before answering".into())
        }
        _ => None,
    }
}

/// `e` and every error under it: its `source` chain, and the errors an I/O error wraps (an
/// `io::Error`'s `source` skips the error it wraps, so those are reached through `get_ref`).
fn errors<'a>(e: &'a (dyn StdError + 'static)) -> Vec<&'a (dyn StdError + 'static)> {
    let mut out = Vec::new();
    let mut stack = vec![e];
    while let Some(err) = stack.pop() {
        if out.len() > 32 {
            break;
        }
        out.push(err);
        if let Some(inner) = err
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
        {
            stack.push(inner);
        } else if let Some(next) = err.source() {
            stack.push(next);
        }
    }
    out
}

/// Every message of the chain, joined (what is left when no cause is recognised).
fn chain(e: &(dyn StdError + 'static)) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut cur = Some(e);
    while let Some(err) = cur {
        let t = err.to_string();
        if !parts.iter().any(|p| p.contains(&t)) {
            parts.push(t);
        }
        cur = err.source();
    }
    parts.join(": ")
}

fn tls(e: &rustls::Error) -> String {
    match e {
        rustls::Error::InvalidCertificate(c) => certificate(c),
        rustls::Error::AlertReceived(a) => match a {
            AlertDescription::CertificateRequired => {
                "the server requires a client certificate (mutual TLS: --tls-client-cert and --tls-client-key)".into()
            }
            AlertDescription::BadCertificate
            | AlertDescription::UnknownCA
            | AlertDescription::CertificateExpired
            | AlertDescription::CertificateUnknown => {
                format!("the server refused this client's certificate (TLS alert {a:?})")
            }
            _ => format!("the server ended the TLS handshake (alert {a:?})"),
        },
        rustls::Error::InvalidMessage(_) | rustls::Error::InappropriateMessage { .. } => {
            format!("TLS handshake failed, is the server speaking TLS? ({e})")
        }
        other => format!("TLS handshake failed ({other})"),
    }
}

fn certificate(c: &CertificateError) -> String {
    match c {
        CertificateError::ExpiredContext { time, not_after } => format!(
            "server certificate expired on {} (now {})",
            date(*not_after),
            date(*time)
        ),
        CertificateError::Expired => "server certificate expired".into(),
        CertificateError::NotValidYetContext { time, not_before } => format!(
            "server certificate not valid before {} (now {})",
            date(*not_before),
            date(*time)
        ),
        CertificateError::NotValidYet => "server certificate not valid yet".into(),
        CertificateError::NotValidForNameContext {
            expected,
            presented,
        } => format!(
            "host name mismatch: the server certificate is for {}, not {}",
            if presented.is_empty() {
                "no name".to_string()
            } else {
                presented.join(", ")
            },
            expected.to_str()
        ),
        CertificateError::NotValidForName => {
            "host name mismatch: the server certificate is not for this host".into()
        }
        CertificateError::UnknownIssuer => {
            "server certificate not signed by a trusted CA (check --tls-ca)".into()
        }
        CertificateError::Revoked => "server certificate revoked".into(),
        other => format!("invalid server certificate ({other:?})"),
    }
}

/// A UTC date and time.
pub fn date(t: UnixTime) -> String {
    fmt_unix(t.as_secs() as i64)
}

/// Unix seconds as `YYYY-MM-DD HH:MM:SS UTC`.
pub fn fmt_unix(secs: i64) -> String {
    chrono::DateTime::from_timestamp(secs, 0)
        .map(|d| d.format("%Y-%m-%d %H:%M:%S UTC").to_string())
        .unwrap_or_else(|| format!("unix time {secs}"))
}
