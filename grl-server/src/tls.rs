//! TLS on every hop of the control plane, with rustls (ring provider; no OpenSSL).
//!
//! Servers (controller, aggregator, `rlc serve`) are given a certificate chain and a key in PEM
//! files ([`ServerTls`]); the files are polled every few seconds and a changed pair is loaded
//! for new connections without a restart ([`ReloadingServerConfig`]). A server given a client
//! CA requires client certificates signed by it (mutual TLS); the names of a verified client
//! certificate reach the handlers as [`Peer::cert_names`].
//!
//! Clients (`grl_client::tls::ClientTls`) verify servers against a configured CA file (and then only against
//! it, not the built-in public roots) and may present a client certificate.
//!
//! No certificate given = plain HTTP, for loopback and tests.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context};
use arc_swap::ArcSwap;
use axum::extract::connect_info::Connected;
use axum::serve::IncomingStream;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::CertificateDer;
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use tokio::net::TcpListener;

use grl_client::tls::{read_certs, read_key, warn_if_expired};

/// Default period of the certificate file poll.
pub const DEFAULT_RELOAD_EVERY: Duration = Duration::from_secs(5);

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A server's certificate chain, key and optional client CA, as PEM files.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerTls {
    /// Certificate chain (leaf first), PEM.
    pub cert: PathBuf,
    /// Private key (PKCS#8, PKCS#1 or SEC1), PEM.
    pub key: PathBuf,
    /// When set, clients must present a certificate signed by one of these CAs (mutual TLS).
    pub client_ca: Option<PathBuf>,
    /// How often the files are checked for changes.
    pub reload_every: Duration,
}

impl ServerTls {
    /// TLS with `cert` and `key`, no client certificates, the default reload period.
    pub fn new(cert: impl Into<PathBuf>, key: impl Into<PathBuf>) -> ServerTls {
        ServerTls {
            cert: cert.into(),
            key: key.into(),
            client_ca: None,
            reload_every: DEFAULT_RELOAD_EVERY,
        }
    }

    /// From command-line flags: nothing given = plain HTTP; a certificate needs its key and a
    /// client CA needs a certificate.
    pub fn from_flags(
        cert: Option<PathBuf>,
        key: Option<PathBuf>,
        client_ca: Option<PathBuf>,
    ) -> anyhow::Result<Option<ServerTls>> {
        match (cert, key) {
            (None, None) => {
                if client_ca.is_some() {
                    bail!("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS)");
                }
                Ok(None)
            }
            (Some(_), None) => bail!("--tls-cert needs --tls-key"),
            (None, Some(_)) => bail!("--tls-key needs --tls-cert"),
            (Some(cert), Some(key)) => Ok(Some(ServerTls {
                client_ca,
                ..ServerTls::new(cert, key)
            })),
        }
    }

    /// Makes relative paths relative to `base` (the directory of the file that named them).
    pub fn relative_to(mut self, base: &Path) -> ServerTls {
        self.cert = base.join(&self.cert);
        self.key = base.join(&self.key);
        self.client_ca = self.client_ca.map(|p| base.join(p));
        self
    }

    fn files(&self) -> Vec<&Path> {
        let mut v = vec![self.cert.as_path(), self.key.as_path()];
        v.extend(self.client_ca.as_deref());
        v
    }
}

/// Builds the rustls server config from the files (checking that the key matches the
/// certificate).
pub fn server_config(t: &ServerTls) -> anyhow::Result<ServerConfig> {
    server_config_alpn(t, false)
}

/// [`server_config`], offering HTTP/2 (`h2`) before HTTP/1.1 by ALPN when `h2` (a server whose
/// connections speak both: `grl sidecar`, for gRPC clients over TLS).
pub fn server_config_alpn(t: &ServerTls, h2: bool) -> anyhow::Result<ServerConfig> {
    let certs = read_certs(&t.cert)?;
    let key = read_key(&t.key)?;
    let builder = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?;
    let builder = match &t.client_ca {
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for c in read_certs(ca)? {
                roots
                    .add(c)
                    .with_context(|| format!("{}: unusable CA certificate", ca.display()))?;
            }
            let v = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                .build()
                .with_context(|| format!("{}: client CA", ca.display()))?;
            builder.with_client_cert_verifier(v)
        }
        None => builder.with_no_client_auth(),
    };
    let mut cfg = builder.with_single_cert(certs, key).with_context(|| {
        format!(
            "{} and {}: certificate and key do not go together",
            t.cert.display(),
            t.key.display()
        )
    })?;
    // HTTP/1.1 only unless asked: the other servers are built without HTTP/2.
    cfg.alpn_protocols = if h2 {
        vec![b"h2".to_vec(), b"http/1.1".to_vec()]
    } else {
        vec![b"http/1.1".to_vec()]
    };
    Ok(cfg)
}

/// What identifies a version of a file on disk (a replaced or rewritten file changes it).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Stamp(Option<(std::time::SystemTime, u64, u64, i64)>);

fn stamp(p: &Path) -> Stamp {
    // metadata() follows symlinks: a Kubernetes secret volume swaps a symlinked directory.
    Stamp(std::fs::metadata(p).ok().map(|m| {
        #[cfg(unix)]
        let (ino, ctime) = {
            use std::os::unix::fs::MetadataExt;
            (m.ino(), m.ctime_nsec() + m.ctime() * 1_000_000_000)
        };
        #[cfg(not(unix))]
        let (ino, ctime) = (0, 0);
        (
            m.modified().unwrap_or(std::time::UNIX_EPOCH),
            m.len(),
            ino,
            ctime,
        )
    }))
}

/// A server config that follows its files: [`ReloadingServerConfig::check`] reloads them when
/// they changed; new connections get the new certificate, open ones keep theirs.
pub struct ReloadingServerConfig {
    files: ServerTls,
    current: ArcSwap<ServerConfig>,
    seen: Mutex<Vec<Stamp>>,
    reloads: AtomicU64,
    handshake_failures: AtomicU64,
    /// Offers h2 by ALPN (see [`server_config_alpn`]).
    h2: bool,
}

impl std::fmt::Debug for ReloadingServerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReloadingServerConfig")
            .field("files", &self.files)
            .finish_non_exhaustive()
    }
}

impl ReloadingServerConfig {
    /// Loads the files now (an error names the file: a server does not start on bad ones; an
    /// expired certificate is logged as a warning).
    pub fn load(files: &ServerTls) -> anyhow::Result<Arc<ReloadingServerConfig>> {
        Self::load_alpn(files, false)
    }

    /// [`ReloadingServerConfig::load`] offering h2 as well by ALPN (see
    /// [`server_config_alpn`]).
    pub fn load_alpn(files: &ServerTls, h2: bool) -> anyhow::Result<Arc<ReloadingServerConfig>> {
        let seen = files.files().iter().map(|p| stamp(p)).collect();
        let cfg = server_config_alpn(files, h2)?;
        warn_if_expired("TLS server", &files.cert);
        Ok(Arc::new(ReloadingServerConfig {
            files: files.clone(),
            current: ArcSwap::from_pointee(cfg),
            seen: Mutex::new(seen),
            reloads: AtomicU64::new(0),
            handshake_failures: AtomicU64::new(0),
            h2,
        }))
    }

    /// The config new connections get.
    pub fn current(&self) -> Arc<ServerConfig> {
        self.current.load_full()
    }

    /// The files.
    pub fn files(&self) -> &ServerTls {
        &self.files
    }

    /// Successful reloads since start.
    pub fn reloads(&self) -> u64 {
        self.reloads.load(Ordering::Relaxed)
    }

    /// Failed TLS handshakes since start (untrusted or missing client certificates, plain
    /// HTTP on the TLS port, timeouts).
    pub fn handshake_failures(&self) -> u64 {
        self.handshake_failures.load(Ordering::Relaxed)
    }

    /// Counts a failed handshake.
    pub(crate) fn handshake_failed(&self) {
        self.handshake_failures.fetch_add(1, Ordering::Relaxed);
    }

    /// Reloads when a file changed since the last look. A pair that does not load (a key
    /// written after its certificate, a truncated file) keeps the old config, with a warning,
    /// and is tried again when a file changes again. Returns whether the config was replaced.
    pub fn check(&self) -> bool {
        let now: Vec<Stamp> = self.files.files().iter().map(|p| stamp(p)).collect();
        {
            let mut seen = self.seen.lock().expect("tls stamps");
            if *seen == now {
                return false;
            }
            // Recorded before reading: a change during the read is seen next time.
            *seen = now;
        }
        match server_config_alpn(&self.files, self.h2) {
            Ok(cfg) => {
                self.current.store(Arc::new(cfg));
                self.reloads.fetch_add(1, Ordering::Relaxed);
                warn_if_expired("TLS server", &self.files.cert);
                tracing::info!(cert = %self.files.cert.display(), "TLS certificate reloaded; new connections use it");
                true
            }
            Err(e) => {
                tracing::warn!(
                    error = format!("{e:#}"),
                    "TLS files changed but do not load; still serving the previous certificate"
                );
                false
            }
        }
    }
}

/// Who is on the other end of a connection: its address and, under mutual TLS, the names
/// (DNS and URI subject alternative names) of its verified client certificate. Handlers get it
/// with `axum::extract::ConnectInfo<Peer>`.
#[derive(Debug, Clone)]
pub struct Peer {
    /// Remote address.
    pub addr: SocketAddr,
    /// Names of the verified client certificate; empty without one.
    pub cert_names: Arc<[String]>,
    /// What a proxy keeps for this connection (`ConnOptions::slots_per_connection`); None
    /// for other servers.
    pub share: Option<Arc<ConnShare>>,
}

/// What a proxy keeps per caller connection, dropped with the connection.
pub struct ConnShare {
    /// The connection's share of the upstream slots: one permit per request it has in flight
    /// upstream.
    pub slots: tokio::sync::Semaphore,
    /// The proxy's own state for the connection (`grl sidecar`: the connection's h2c
    /// connection upstream), set by its first request that needs it.
    pub local: std::sync::OnceLock<Box<dyn std::any::Any + Send + Sync>>,
}

impl ConnShare {
    /// A share of `slots` upstream slots (one at least).
    pub fn new(slots: usize) -> ConnShare {
        ConnShare {
            slots: tokio::sync::Semaphore::new(slots.max(1)),
            local: std::sync::OnceLock::new(),
        }
    }
}

impl std::fmt::Debug for ConnShare {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnShare")
            .field("slots_free", &self.slots.available_permits())
            .finish_non_exhaustive()
    }
}

impl Connected<IncomingStream<'_, TcpListener>> for Peer {
    fn connect_info(stream: IncomingStream<'_, TcpListener>) -> Peer {
        Peer {
            addr: *stream.remote_addr(),
            cert_names: Arc::from(Vec::new()),
            share: None,
        }
    }
}

/// DNS and URI subject alternative names of a certificate.
pub fn cert_names(der: &CertificateDer<'_>) -> Vec<String> {
    match webpki::EndEntityCert::try_from(der) {
        Ok(c) => c
            .valid_dns_names()
            .chain(c.valid_uri_names())
            .map(str::to_string)
            .collect(),
        Err(_) => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::serve;
    use axum::extract::ConnectInfo;
    use axum::Router;
    use grl_client::tls::{not_after, ClientTls};
    use rustls::pki_types::pem::PemObject;
    use test_support::tls::Ca;

    #[test]
    fn flags_go_in_pairs() {
        let p = |s: &str| Some(PathBuf::from(s));
        assert!(ServerTls::from_flags(None, None, None).unwrap().is_none());
        let e = ServerTls::from_flags(p("c"), None, None).unwrap_err();
        assert!(e.to_string().contains("--tls-key"), "{e}");
        let e = ServerTls::from_flags(None, None, p("ca")).unwrap_err();
        assert!(e.to_string().contains("--tls-client-ca needs"), "{e}");
        let t = ServerTls::from_flags(p("c"), p("k"), p("ca"))
            .unwrap()
            .unwrap();
        assert_eq!(t.client_ca, p("ca"));
        let e = ClientTls::from_flags(None, p("c"), None).unwrap_err();
        assert!(e.to_string().contains("--tls-client-key"), "{e}");
        let rel = ClientTls::from_flags(p("ca.pem"), None, None)
            .unwrap()
            .relative_to(Path::new("/etc/rlc"));
        assert_eq!(rel.ca, p("/etc/rlc/ca.pem"));
    }

    /// The end of a certificate's validity, in both encodings of RFC 5280 (UTCTime until 2049,
    /// GeneralizedTime after).
    #[test]
    fn not_after_reads_both_time_encodings() {
        let ca = Ca::new("unit CA");
        let der = |pem: &str| {
            CertificateDer::pem_slice_iter(pem.as_bytes())
                .next()
                .unwrap()
                .unwrap()
        };
        assert_eq!(
            not_after(&der(&ca.expired_server().cert_pem)),
            Some(1_609_459_200) // 2021-01-01
        );
        // rcgen's default: 4096-01-01.
        assert_eq!(not_after(&der(&ca.server().cert_pem)), Some(67_090_118_400));
        assert_eq!(not_after(b"\x30\x03\x02\x01"), None);
    }

    /// Under mutual TLS a handler sees the names of the client's certificate; a client
    /// without one never reaches it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn handlers_see_the_client_certificate_names() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let ca = Ca::new("unit CA");
        let ca_file = ca.write(&d.join("ca.crt"));
        let (crt, key) = ca.server().write(d, "server");
        let (ccrt, ckey) = ca.client("aggregator.z1").write(d, "client");
        let tls = ReloadingServerConfig::load(&ServerTls {
            client_ca: Some(ca_file.clone()),
            ..ServerTls::new(&crt, &key)
        })
        .unwrap();
        let router = Router::new().route(
            "/whoami",
            axum::routing::get(|ConnectInfo(p): ConnectInfo<Peer>| async move {
                p.cert_names.join(",")
            }),
        );
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(listener, router, Some(tls.clone()), async {
            let _ = stopped.await;
        }));
        let url = format!("https://127.0.0.1:{}/whoami", addr.port());
        let with_cert = ClientTls {
            ca: Some(ca_file.clone()),
            cert: Some(ccrt),
            key: Some(ckey),
        }
        .http_client(Duration::from_secs(5))
        .unwrap();
        let body = with_cert
            .get(&url)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert_eq!(body, "aggregator.z1");
        let without = ClientTls {
            ca: Some(ca_file),
            ..Default::default()
        }
        .http_client(Duration::from_secs(5))
        .unwrap();
        assert!(without.get(&url).send().await.is_err());
        // The refusal is counted (the server side of the handshake may finish a moment later).
        for _ in 0..50 {
            if tls.handshake_failures() >= 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(tls.handshake_failures() >= 1);
        let _ = stop.send(());
        server.await.unwrap().unwrap();
    }
}
