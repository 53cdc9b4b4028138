//! TLS of a client's calls to other tiers, with rustls (ring provider; no OpenSSL):
//! [`ClientTls`] verifies servers against a configured CA file (and then only against it, not
//! the built-in public roots) and may present a client certificate. Also the PEM readers and
//! the expiry check the `grl` binary's servers use.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// What a client trusts and presents.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ClientTls {
    /// CA certificates (PEM, one or more) that server certificates must chain to. When set,
    /// the built-in public roots are not trusted. Unset: the public roots (for https URLs).
    pub ca: Option<PathBuf>,
    /// Client certificate chain (PEM) for servers that require mutual TLS.
    pub cert: Option<PathBuf>,
    /// The client certificate's key (PEM).
    pub key: Option<PathBuf>,
}

impl ClientTls {
    /// From command-line flags; a client certificate needs its key.
    pub fn from_flags(
        ca: Option<PathBuf>,
        cert: Option<PathBuf>,
        key: Option<PathBuf>,
    ) -> anyhow::Result<ClientTls> {
        match (&cert, &key) {
            (Some(_), None) => bail!("--tls-client-cert needs --tls-client-key"),
            (None, Some(_)) => bail!("--tls-client-key needs --tls-client-cert"),
            _ => Ok(ClientTls { ca, cert, key }),
        }
    }

    /// Whether nothing is configured.
    pub fn is_empty(&self) -> bool {
        self.ca.is_none() && self.cert.is_none() && self.key.is_none()
    }

    /// Makes relative paths relative to `base`.
    pub fn relative_to(self, base: &Path) -> ClientTls {
        ClientTls {
            ca: self.ca.map(|p| base.join(p)),
            cert: self.cert.map(|p| base.join(p)),
            key: self.key.map(|p| base.join(p)),
        }
    }

    /// Sets up `b` (rustls) with the CA and the client identity; errors name the file.
    pub fn configure(&self, b: reqwest::ClientBuilder) -> anyhow::Result<reqwest::ClientBuilder> {
        let mut b = b.use_rustls_tls();
        if let Some(ca) = &self.ca {
            for der in read_certs(ca)? {
                let c = reqwest::Certificate::from_der(&der)
                    .with_context(|| format!("{}: unusable CA certificate", ca.display()))?;
                b = b.add_root_certificate(c);
            }
            b = b.tls_built_in_root_certs(false);
        }
        match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => {
                // Parsed first so that a bad file is named; reqwest wants both in one PEM buffer.
                read_certs(cert)?;
                read_key(key)?;
                warn_if_expired("TLS client", cert);
                let mut pem = std::fs::read(cert)
                    .with_context(|| format!("{}: cannot read", cert.display()))?;
                pem.push(b'\n');
                pem.extend(
                    std::fs::read(key)
                        .with_context(|| format!("{}: cannot read", key.display()))?,
                );
                let id = reqwest::Identity::from_pem(&pem).with_context(|| {
                    format!(
                        "{} and {}: unusable client certificate",
                        cert.display(),
                        key.display()
                    )
                })?;
                b = b.identity(id);
            }
            (None, None) => {}
            _ => bail!("a client certificate needs both the certificate and the key file"),
        }
        Ok(b)
    }

    /// A reqwest client with `timeout` and this TLS setup.
    pub fn http_client(&self, timeout: Duration) -> anyhow::Result<reqwest::Client> {
        self.configure(reqwest::Client::builder().timeout(timeout))?
            .build()
            .context("build the HTTP client")
    }
}

/// Logs a warning for each `http://` URL that is not on loopback: such a hop is neither
/// encrypted nor authenticated.
pub fn warn_plain_http<'a>(what: &str, urls: impl IntoIterator<Item = &'a str>) {
    for u in urls {
        if let Some(rest) = u.strip_prefix("http://") {
            let host = rest.split(['/', '?']).next().unwrap_or("");
            let host = host.rsplit_once(':').map_or(host, |(h, _)| h);
            let loopback = host == "localhost"
                || host == "[::1]"
                || host
                    .parse::<std::net::Ipv4Addr>()
                    .is_ok_and(|a| a.is_loopback());
            if !loopback {
                tracing::warn!(url = %u, "{what} is plain HTTP to a host that is not loopback: use https:// with a CA (see docs/security.md)");
            }
        }
    }
}

/// Every certificate in a PEM file; at least one.
pub fn read_certs(path: &Path) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let bytes = std::fs::read(path).with_context(|| format!("{}: cannot read", path.display()))?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| anyhow::anyhow!("{}: not PEM certificates: {e}", path.display()))?;
    if certs.is_empty() {
        bail!(
            "{}: no certificate (expected -----BEGIN CERTIFICATE-----)",
            path.display()
        );
    }
    Ok(certs)
}

/// The first private key in a PEM file.
pub fn read_key(path: &Path) -> anyhow::Result<PrivateKeyDer<'static>> {
    let bytes = std::fs::read(path).with_context(|| format!("{}: cannot read", path.display()))?;
    PrivateKeyDer::from_pem_slice(&bytes)
        .map_err(|e| anyhow::anyhow!("{}: no usable private key: {e}", path.display()))
}

/// The end of an X.509 certificate's validity (`notAfter`, unix seconds), read from its DER
/// (`Certificate` → `tbsCertificate` → `validity`); None when it cannot be read.
pub fn not_after(der: &[u8]) -> Option<i64> {
    let (cert, _) = der_tlv(der, 0x30)?;
    let (mut tbs, _) = der_tlv(cert, 0x30)?;
    // version [0] EXPLICIT is optional
    if tbs.first() == Some(&0xa0) {
        tbs = der_tlv(tbs, 0xa0)?.1;
    }
    // serialNumber, signature, issuer
    for tag in [0x02, 0x30, 0x30] {
        tbs = der_tlv(tbs, tag)?.1;
    }
    let (validity, _) = der_tlv(tbs, 0x30)?;
    let (_, rest) = der_time(validity)?;
    Some(der_time(rest)?.0)
}

/// The content of the DER element with `tag` at the start of `b`, and what follows it.
fn der_tlv(b: &[u8], tag: u8) -> Option<(&[u8], &[u8])> {
    if *b.first()? != tag {
        return None;
    }
    let first = *b.get(1)?;
    let (len, at) = if first < 0x80 {
        (first as usize, 2)
    } else {
        let n = (first & 0x7f) as usize;
        if n == 0 || n > 4 {
            return None;
        }
        let len = b
            .get(2..2 + n)?
            .iter()
            .fold(0usize, |l, &x| (l << 8) | x as usize);
        (len, 2 + n)
    };
    let end = at.checked_add(len)?;
    Some((b.get(at..end)?, &b[end..]))
}

/// A UTCTime or GeneralizedTime at the start of `b` (unix seconds) and what follows it.
fn der_time(b: &[u8]) -> Option<(i64, &[u8])> {
    let (text, rest, year_digits) = match b.first()? {
        0x17 => (der_tlv(b, 0x17)?.0, der_tlv(b, 0x17)?.1, 2),
        0x18 => (der_tlv(b, 0x18)?.0, der_tlv(b, 0x18)?.1, 4),
        _ => return None,
    };
    let t = std::str::from_utf8(text).ok()?.strip_suffix('Z')?;
    let num = |r: std::ops::Range<usize>| t.get(r)?.parse::<u32>().ok();
    let y = num(0..year_digits)? as i32;
    // RFC 5280: two-digit years from 50 are 19YY.
    let year = match year_digits {
        2 if y >= 50 => 1900 + y,
        2 => 2000 + y,
        _ => y,
    };
    let o = year_digits;
    let date = chrono::NaiveDate::from_ymd_opt(year, num(o..o + 2)?, num(o + 2..o + 4)?)?;
    let at = date.and_hms_opt(num(o + 4..o + 6)?, num(o + 6..o + 8)?, num(o + 8..o + 10)?)?;
    Some((at.and_utc().timestamp(), rest))
}

/// Warns when the leaf certificate of `path` has expired: peers refuse it (the process still
/// starts or reloads, so that a renewal written later is picked up).
pub fn warn_if_expired(what: &str, path: &Path) {
    let Ok(certs) = read_certs(path) else {
        return;
    };
    let Some(end) = certs.first().and_then(|c| not_after(c)) else {
        return;
    };
    let now = crate::http_util::unix_now() as i64;
    if end < now {
        tracing::warn!(
            file = %path.display(),
            expired = %crate::cause::fmt_unix(end),
            "{what} certificate expired on {}: peers refuse it; renew it (a new file is picked up without a restart where the process reloads it)",
            crate::cause::fmt_unix(end)
        );
    }
}
