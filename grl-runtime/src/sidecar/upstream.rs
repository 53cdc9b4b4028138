//! The sidecar's upstream: one service instance over TCP or a Unix socket, through pooled
//! keep-alive connections (hyper-util's client): gRPC calls over HTTP/2 without TLS (h2c, prior
//! knowledge), everything else over HTTP/1.1.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use http::Uri;
use hyper_util::client::legacy::connect::{Connected, Connection};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::{TcpStream, UnixStream};

/// Where the service instance listens.
#[derive(Debug, Clone, PartialEq)]
pub enum Upstream {
    /// `http://HOST:PORT`.
    Tcp {
        /// `HOST:PORT`.
        authority: http::uri::Authority,
    },
    /// `unix:/path/to/socket` (or `unix:///path`).
    Unix(PathBuf),
}

impl Upstream {
    /// Parses `http://HOST:PORT` (no path) or `unix:PATH`.
    pub fn parse(s: &str) -> Result<Upstream, String> {
        if let Some(p) = s.strip_prefix("unix:") {
            let p = p.strip_prefix("//").unwrap_or(p);
            if !p.starts_with('/') {
                return Err(format!(
                    "{s}: a Unix socket upstream is unix:/absolute/path"
                ));
            }
            return Ok(Upstream::Unix(PathBuf::from(p)));
        }
        let uri: Uri = s.parse().map_err(|e| format!("{s}: not a URL: {e}"))?;
        if uri.scheme_str() != Some("http") {
            return Err(format!(
                "{s}: the upstream is http://HOST:PORT or unix:/path (the sidecar speaks plain HTTP to the instance next to it)"
            ));
        }
        if uri.path() != "/" && !uri.path().is_empty() || uri.query().is_some() {
            return Err(format!("{s}: the upstream URL takes no path"));
        }
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| format!("{s}: no host"))?;
        if authority.port_u16().is_none() {
            return Err(format!("{s}: name the port (http://HOST:PORT)"));
        }
        Ok(Upstream::Tcp { authority })
    }

    /// The authority requests carry upstream (`localhost` for a Unix socket).
    pub fn authority(&self) -> http::uri::Authority {
        match self {
            Upstream::Tcp { authority } => authority.clone(),
            Upstream::Unix(_) => http::uri::Authority::from_static("localhost"),
        }
    }

    /// For logs and metrics.
    pub fn describe(&self) -> String {
        match self {
            Upstream::Tcp { authority } => format!("http://{authority}"),
            Upstream::Unix(p) => format!("unix:{}", p.display()),
        }
    }

    /// Opens one connection within `timeout` (the readiness check and the connector).
    pub async fn connect(&self, timeout: Duration) -> std::io::Result<UpstreamIo> {
        let connect = async {
            match self {
                Upstream::Tcp { authority } => {
                    let port = authority.port_u16().unwrap_or(80);
                    let s = TcpStream::connect((authority.host(), port)).await?;
                    let _ = s.set_nodelay(true);
                    Ok(UpstreamIo::Tcp(TokioIo::new(s)))
                }
                Upstream::Unix(p) => Ok(UpstreamIo::Unix(TokioIo::new(
                    UnixStream::connect(p).await?,
                ))),
            }
        };
        match tokio::time::timeout(timeout, connect).await {
            Ok(r) => r,
            Err(_) => Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("connect timed out after {} ms", timeout.as_millis()),
            )),
        }
    }
}

/// A connection to the upstream.
pub enum UpstreamIo {
    /// Over TCP.
    Tcp(TokioIo<TcpStream>),
    /// Over a Unix socket.
    Unix(TokioIo<UnixStream>),
}

impl Connection for UpstreamIo {
    fn connected(&self) -> Connected {
        Connected::new()
    }
}

impl hyper::rt::Read for UpstreamIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            UpstreamIo::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            UpstreamIo::Unix(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl hyper::rt::Write for UpstreamIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            UpstreamIo::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            UpstreamIo::Unix(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            UpstreamIo::Tcp(s) => Pin::new(s).poll_flush(cx),
            UpstreamIo::Unix(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            UpstreamIo::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            UpstreamIo::Unix(s) => Pin::new(s).poll_shutdown(cx),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            UpstreamIo::Tcp(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            UpstreamIo::Unix(s) => Pin::new(s).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            UpstreamIo::Tcp(s) => s.is_write_vectored(),
            UpstreamIo::Unix(s) => s.is_write_vectored(),
        }
    }
}

/// Connects every pooled connection to the one upstream, whatever the request's URI says.
#[derive(Clone)]
pub struct Connector {
    upstream: std::sync::Arc<Upstream>,
    timeout: Duration,
}

impl tower::Service<Uri> for Connector {
    type Response = UpstreamIo;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = std::io::Result<UpstreamIo>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Uri) -> Self::Future {
        let (up, timeout) = (self.upstream.clone(), self.timeout);
        Box::pin(async move { up.connect(timeout).await })
    }
}

/// The two pools: HTTP/1.1 and h2c.
#[derive(Clone)]
pub struct Clients {
    /// HTTP/1.1 requests.
    pub h1: Client<Connector, Body>,
    /// gRPC calls (h2c).
    pub h2: Client<Connector, Body>,
}

/// Idle connections kept per pool.
const MAX_IDLE: usize = 256;

impl Clients {
    /// Pools to `upstream`, each connection opened within `connect_timeout`; idle ones close
    /// after `idle`.
    pub fn new(upstream: Upstream, connect_timeout: Duration, idle: Duration) -> Clients {
        let c = Connector {
            upstream: std::sync::Arc::new(upstream),
            timeout: connect_timeout,
        };
        let mut b = Client::builder(TokioExecutor::new());
        b.pool_idle_timeout(idle)
            .pool_max_idle_per_host(MAX_IDLE)
            .pool_timer(hyper_util::rt::TokioTimer::new());
        let h1 = b.build(c.clone());
        b.http2_only(true);
        let h2 = b.build(c);
        Clients { h1, h2 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstreams_parse_or_say_why_not() {
        assert_eq!(
            Upstream::parse("http://127.0.0.1:8080").unwrap().describe(),
            "http://127.0.0.1:8080"
        );
        assert_eq!(
            Upstream::parse("unix:/run/app.sock").unwrap(),
            Upstream::Unix("/run/app.sock".into())
        );
        assert_eq!(
            Upstream::parse("unix:///run/app.sock").unwrap(),
            Upstream::Unix("/run/app.sock".into())
        );
        for (bad, why) in [
            ("https://x:1", "plain HTTP"),
            ("http://x", "port"),
            ("http://x:1/api", "no path"),
            ("unix:run.sock", "absolute"),
        ] {
            let e = Upstream::parse(bad).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }
}
