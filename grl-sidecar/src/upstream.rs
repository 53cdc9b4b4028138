//! The sidecar's upstream: one service instance over TCP or a Unix socket, through pooled
//! keep-alive connections, one set per worker thread: gRPC calls over HTTP/2 without TLS (h2c,
//! prior knowledge, through [`H2Conn`]), everything else over HTTP/1.1 (through [`H1Pool`]).

use std::path::PathBuf;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use bytes::Bytes;
use http::{Request, Response, Uri};
use hyper::body::{Body as _, Incoming};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpStream, UnixStream};
use tokio::sync::Semaphore;

pub use crate::h2c::H2Body;
use crate::h2c::H2Handle;

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

/// Why an `--upstream` is refused; each message starts with the text given.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamParseError {
    /// A Unix socket path that is not absolute.
    #[error("{0}: a Unix socket upstream is unix:/absolute/path")]
    UnixRelative(String),
    /// Not a URL.
    #[error("{text}: not a URL: {err}")]
    NotAUrl {
        /// The upstream as given.
        text: String,
        /// Why it does not parse.
        err: http::uri::InvalidUri,
    },
    /// A scheme other than `http`.
    #[error("{0}: the upstream is http://HOST:PORT or unix:/path (the sidecar speaks plain HTTP to the instance next to it)")]
    Scheme(String),
    /// A path or a query.
    #[error("{0}: the upstream URL takes no path")]
    Path(String),
    /// No host.
    #[error("{0}: no host")]
    NoHost(String),
    /// No port.
    #[error("{0}: name the port (http://HOST:PORT)")]
    NoPort(String),
}

impl Upstream {
    /// Parses `http://HOST:PORT` (no path) or `unix:PATH`.
    pub fn parse(s: &str) -> Result<Upstream, UpstreamParseError> {
        if let Some(p) = s.strip_prefix("unix:") {
            let p = p.strip_prefix("//").unwrap_or(p);
            if !p.starts_with('/') {
                return Err(UpstreamParseError::UnixRelative(s.to_string()));
            }
            return Ok(Upstream::Unix(PathBuf::from(p)));
        }
        let uri: Uri = s.parse().map_err(|err| UpstreamParseError::NotAUrl {
            text: s.to_string(),
            err,
        })?;
        if uri.scheme_str() != Some("http") {
            return Err(UpstreamParseError::Scheme(s.to_string()));
        }
        if uri.path() != "/" && !uri.path().is_empty() || uri.query().is_some() {
            return Err(UpstreamParseError::Path(s.to_string()));
        }
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| UpstreamParseError::NoHost(s.to_string()))?;
        if authority.port_u16().is_none() {
            return Err(UpstreamParseError::NoPort(s.to_string()));
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

/// The connections of one worker thread: HTTP/1.1 and h2c.
#[derive(Clone)]
pub struct Clients {
    /// HTTP/1.1 requests.
    pub h1: H1Pool,
    /// gRPC calls (h2c).
    pub h2: H2Conn,
}

/// Idle connections kept per pool.
pub const MAX_IDLE: usize = 256;

/// Largest read buffer of an upstream HTTP/1.1 connection: the longest answer head it reads,
/// and the largest piece of an answer's body held at once.
const H1_READ_BUF: usize = 16 << 10;

/// As many slots as a semaphore holds: no bound.
fn unbounded_slots() -> std::sync::Arc<Semaphore> {
    std::sync::Arc::new(Semaphore::new(Semaphore::MAX_PERMITS))
}

impl Clients {
    /// Connections to `upstream`, each opened within `connect_timeout`; idle ones close (or are
    /// replaced) after `idle`.
    pub fn new(upstream: Upstream, connect_timeout: Duration, idle: Duration) -> Clients {
        Clients::with_slots(upstream, connect_timeout, idle, unbounded_slots(), MAX_IDLE)
    }

    /// [`Clients::new`] whose HTTP/1.1 requests in flight each hold one of `slots` (shared by
    /// every worker's pools: the bound on upstream connections in use), with at most
    /// `max_idle` idle connections kept.
    pub fn with_slots(
        upstream: Upstream,
        connect_timeout: Duration,
        idle: Duration,
        slots: std::sync::Arc<Semaphore>,
        max_idle: usize,
    ) -> Clients {
        let upstream = std::sync::Arc::new(upstream);
        Clients {
            h1: H1Pool::new(upstream.clone(), connect_timeout, idle).with_slots(slots, max_idle),
            h2: H2Conn {
                upstream,
                connect_timeout,
                idle_timeout: idle,
                current: Default::default(),
                opening: Default::default(),
            },
        }
    }

    /// The h2c connection of a gRPC call from a caller connection with `share`: that
    /// connection's own (opened on its first call), so that flow control is the caller's own,
    /// and calls it never reads stall none of another caller's; else the shared one.
    #[inline]
    pub(crate) fn h2_for<'a>(
        &'a self,
        share: Option<&'a grl_server::tls::ConnShare>,
    ) -> &'a H2Conn {
        let own = share.and_then(|c| {
            c.local
                .get_or_init(|| Box::new(self.h2.fresh()))
                .downcast_ref::<H2Conn>()
        });
        own.unwrap_or(&self.h2)
    }
}

/// An h2c connection to the upstream, for gRPC calls: the sidecar opens one per caller
/// connection ([`H2Conn::fresh`]; one per worker thread for callers without one). It carries
/// every call in flight (HTTP/2 multiplexes them, up to the upstream's limit of
/// concurrent streams; calls beyond it wait for a stream), its task on the thread that opened
/// it. No lookup by host, no task per call: a call takes the connection's handle and sends
/// from its own task ([`crate::h2c`]). A closed connection is replaced at the next call, and a
/// call not yet sent on a cached connection that turned out closed goes on the new one; a
/// connection unused for the idle timeout is replaced at the next call (it closes once its
/// last call ends).
#[derive(Clone)]
pub struct H2Conn {
    upstream: std::sync::Arc<Upstream>,
    connect_timeout: Duration,
    idle_timeout: Duration,
    current: std::sync::Arc<std::sync::Mutex<Option<(H2Handle, Instant)>>>,
    /// Held while a connection is being opened: the calls that find none wait for that one
    /// instead of each opening its own.
    opening: std::sync::Arc<tokio::sync::Mutex<()>>,
}

impl H2Conn {
    /// A connection of its own to the same upstream, opened at its first call (one per caller
    /// connection: its calls' flow control is then that caller's alone).
    pub fn fresh(&self) -> H2Conn {
        H2Conn {
            current: Default::default(),
            opening: Default::default(),
            ..self.clone()
        }
    }

    /// Sends `req` (absolute URI, HTTP/2, without the hop-by-hop headers that HTTP/2 forbids)
    /// and waits for the answer's head.
    pub async fn request(&self, mut req: Request<Body>) -> Result<Response<H2Body>, UpstreamError> {
        loop {
            let (handle, cached) = match self.cached() {
                Some(h) => (h, true),
                None => {
                    let _opening = self.opening.lock().await;
                    match self.cached() {
                        Some(h) => (h, true),
                        None => (self.connect().await?, false),
                    }
                }
            };
            match handle.send(req).await {
                Ok(answer) => return answer.map_err(|e| UpstreamError::Request(Box::new(e))),
                // Never sent: the cached connection had closed; once on a new one.
                Err(r) if cached => {
                    self.forget(&handle);
                    req = r;
                }
                Err(_) => {
                    return Err(UpstreamError::Request(
                        "the new h2c connection took no stream".into(),
                    ))
                }
            }
        }
    }

    /// The current connection's handle, unless it closed or sat unused for the idle timeout.
    fn cached(&self) -> Option<H2Handle> {
        let mut current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        match &mut *current {
            Some((h, used)) if !h.is_closed() && now.duration_since(*used) <= self.idle_timeout => {
                *used = now;
                Some(h.clone())
            }
            _ => {
                *current = None;
                None
            }
        }
    }

    /// Drops the connection `used` if it is still the current one (another call may have
    /// replaced it).
    fn forget(&self, used: &H2Handle) {
        let mut current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        if current.as_ref().is_some_and(|(h, _)| h.same(used)) {
            *current = None;
        }
    }

    async fn connect(&self) -> Result<H2Handle, UpstreamError> {
        let io = self
            .upstream
            .connect(self.connect_timeout)
            .await
            .map_err(UpstreamError::Connect)?;
        // The sidecar opens one per caller connection ([`H2Conn::fresh`]): a call whose caller
        // stops reading holds what the upstream sent it, up to its stream window (256 KiB),
        // until the caller is cut as idle, and the connection's window (4 such windows, 1 MiB)
        // bounds what one caller connection's unread calls hold in the sidecar. Calls that
        // stop reading stall only their own connection's other calls.
        let handle = H2Handle::handshake(TokioIo::new(io))
            .await
            .map_err(|e| UpstreamError::Handshake(Box::new(e)))?;
        let mut current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        *current = Some((handle.clone(), Instant::now()));
        Ok(handle)
    }
}

/// HTTP/1.1 connections to the upstream, for one worker thread (a connection's task runs on
/// the thread that opened it): idle connections are kept newest last and the newest ready one
/// is reused, so a request costs no lookup by host, no lock held across threads and no task
/// of its own (hyper-util's pool spawns one per request to wait for the connection to be
/// free again). A connection goes back when its answer's body has ended; one dropped earlier
/// closes. A request not yet written to a reused connection that turns out closed goes on a
/// new one (the upstream closed it while idle); a fresh connection's failure is the answer.
/// Idle connections older than the idle timeout, or closed by the upstream, are dropped when
/// the pool is next used; at most `max_idle` (`MAX_IDLE` by default) are kept.
#[derive(Clone)]
pub struct H1Pool {
    upstream: std::sync::Arc<Upstream>,
    connect_timeout: Duration,
    idle_timeout: Duration,
    idle: std::sync::Arc<std::sync::Mutex<Vec<Idle>>>,
    /// One per request in flight, held until its answer's body is gone.
    slots: std::sync::Arc<Semaphore>,
    /// Idle connections kept at most.
    max_idle: usize,
}

struct Idle {
    tx: SendRequest<Body>,
    since: Instant,
}

/// Why the upstream did not answer a request.
#[derive(Debug)]
pub enum UpstreamError {
    /// No connection (refused, timed out).
    Connect(std::io::Error),
    /// A connection, but the HTTP/1.1 or HTTP/2 handshake failed.
    Handshake(Box<dyn std::error::Error + Send + Sync>),
    /// The request failed on its connection.
    Request(Box<dyn std::error::Error + Send + Sync>),
}

impl UpstreamError {
    /// Whether no connection could be opened.
    pub fn is_connect(&self) -> bool {
        match self {
            UpstreamError::Connect(_) | UpstreamError::Handshake(_) => true,
            UpstreamError::Request(_) => false,
        }
    }

    /// Whether the request failed on the caller's own body (hyper's "user body" error: the
    /// body stream the caller sent broke, such as a malformed chunk size), not the upstream.
    pub fn is_caller_body(&self) -> bool {
        matches!(self, UpstreamError::Request(e)
            if e.downcast_ref::<hyper::Error>().is_some_and(hyper::Error::is_user))
    }
}

impl std::fmt::Display for UpstreamError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            UpstreamError::Connect(_) => f.write_str("connect"),
            UpstreamError::Handshake(_) => f.write_str("handshake"),
            UpstreamError::Request(_) => f.write_str("request"),
        }
    }
}

impl std::error::Error for UpstreamError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            UpstreamError::Connect(e) => Some(e),
            UpstreamError::Handshake(e) | UpstreamError::Request(e) => Some(&**e),
        }
    }
}

impl H1Pool {
    /// A pool to `upstream`; connections open within `connect_timeout`, idle ones are dropped
    /// after `idle_timeout`.
    pub fn new(
        upstream: impl Into<std::sync::Arc<Upstream>>,
        connect_timeout: Duration,
        idle_timeout: Duration,
    ) -> H1Pool {
        H1Pool {
            upstream: upstream.into(),
            connect_timeout,
            idle_timeout,
            idle: Default::default(),
            slots: unbounded_slots(),
            max_idle: MAX_IDLE,
        }
    }

    /// The pool with its requests in flight bounded by `slots` (a request waits for one) and
    /// at most `max_idle` idle connections (one at least: a connection is kept to be reused).
    pub fn with_slots(self, slots: std::sync::Arc<Semaphore>, max_idle: usize) -> H1Pool {
        H1Pool {
            slots,
            max_idle: max_idle.max(1),
            ..self
        }
    }

    /// Sends `req` (origin-form target, `Host` set) and waits for the answer's head.
    pub async fn request(
        &self,
        mut req: Request<Body>,
    ) -> Result<Response<PooledBody>, UpstreamError> {
        // A slot for the request's connection, until its answer's body is gone: fast when
        // one is free, else wait (the caller's upstream timeout bounds the wait).
        let slot = (self.slots.clone().acquire_owned().await).expect("the slots are never closed");
        // Whether the request was already written once (and is being sent again).
        let mut replayed = false;
        loop {
            let (mut tx, reused) = match self.checkout() {
                Some(tx) => (tx, true),
                None => (self.connect().await?, false),
            };
            let again = if reused && !replayed {
                replayable(&req)
            } else {
                None
            };
            match tx.try_send_request(req).await {
                Ok(resp) => {
                    let back = CheckIn {
                        tx,
                        idle: self.idle.clone(),
                        max_idle: self.max_idle,
                    };
                    return Ok(resp.map(|inner| PooledBody {
                        inner,
                        back: Some(back),
                        _slot: slot,
                    }));
                }
                Err(mut e) => match (e.take_message(), again) {
                    // Never written: closed while idle. Each retry uses up an idle
                    // connection; a new one is not retried.
                    (Some(r), _) if reused => req = r,
                    // Written to a reused connection that closed before any answer (the
                    // upstream closed it while idle, and the close crossed the request): an
                    // idempotent request without a body is sent again, once, as nginx does
                    // (a request whose handling closes the connection runs twice, not once
                    // per idle connection).
                    (None, Some(head)) if !e.error().is_parse() && !e.error().is_user() => {
                        replayed = true;
                        req = head.map(|()| Body::empty())
                    }
                    _ => return Err(UpstreamError::Request(Box::new(e.into_error()))),
                },
            }
        }
    }

    /// The newest idle connection ready for a request, dropping the closed and expired ones.
    fn checkout(&self) -> Option<SendRequest<Body>> {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        idle.retain(|i| !i.tx.is_closed() && now.duration_since(i.since) <= self.idle_timeout);
        let at = idle.iter().rposition(|i| i.tx.is_ready())?;
        Some(idle.remove(at).tx)
    }

    async fn connect(&self) -> Result<SendRequest<Body>, UpstreamError> {
        let io = self
            .upstream
            .connect(self.connect_timeout)
            .await
            .map_err(UpstreamError::Connect)?;
        // The read buffer bounds what one answer holds in the sidecar at once (hyper's default
        // grows to about 400 KiB): an answer's head must fit, and its body moves in pieces no
        // larger, so a caller that stops reading holds little (measured in
        // docs/faults.md).
        let (tx, conn) = hyper::client::conn::http1::Builder::new()
            .writev(false)
            .max_buf_size(H1_READ_BUF)
            .handshake(io)
            .await
            .map_err(|e| UpstreamError::Handshake(Box::new(e)))?;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "upstream connection ended with an error");
            }
        });
        Ok(tx)
    }
}

/// A copy of `req`'s head when it may be sent again after its connection failed: an idempotent
/// method and no body.
fn replayable(req: &Request<Body>) -> Option<Request<()>> {
    if !req.method().is_idempotent() || req.body().size_hint().exact() != Some(0) {
        return None;
    }
    let mut r = Request::new(());
    *r.method_mut() = req.method().clone();
    *r.uri_mut() = req.uri().clone();
    *r.version_mut() = req.version();
    *r.headers_mut() = req.headers().clone();
    Some(r)
}

struct CheckIn {
    tx: SendRequest<Body>,
    idle: std::sync::Arc<std::sync::Mutex<Vec<Idle>>>,
    max_idle: usize,
}

impl CheckIn {
    fn back(self) {
        if self.tx.is_closed() {
            return;
        }
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() >= self.max_idle {
            idle.remove(0);
        }
        idle.push(Idle {
            tx: self.tx,
            since: Instant::now(),
        });
    }
}

/// An upstream answer's body; its connection goes back to the pool when it ends.
pub struct PooledBody {
    inner: Incoming,
    back: Option<CheckIn>,
    /// The request's slot, free again when the body is dropped.
    _slot: tokio::sync::OwnedSemaphorePermit,
}

impl Drop for PooledBody {
    fn drop(&mut self) {
        // An answer without a body (or one read to its end) is never polled to `None`.
        if self.inner.is_end_stream() {
            if let Some(b) = self.back.take() {
                b.back();
            }
        }
    }
}

impl hyper::body::Body for PooledBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        let r = Pin::new(&mut this.inner).poll_frame(cx);
        let ended = match &r {
            Poll::Ready(None) => true,
            Poll::Ready(Some(Ok(_))) => this.inner.is_end_stream(),
            // A failed body: its connection is not reused.
            Poll::Ready(Some(Err(_))) => {
                this.back = None;
                false
            }
            Poll::Pending => false,
        };
        if ended {
            if let Some(b) = this.back.take() {
                b.back();
            }
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper_util::rt::TokioExecutor;

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
            assert!(e.to_string().contains(why), "{bad}: {e}");
        }
    }
    /// A listener on a free port that counts the connections it accepts and serves each (with
    /// its number, from 0) on a task of its own.
    async fn counted_upstream<F, Fut>(
        serve: F,
    ) -> (Upstream, std::sync::Arc<std::sync::atomic::AtomicUsize>)
    where
        F: Fn(tokio::net::TcpStream, usize) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let accepted = std::sync::Arc::new(AtomicUsize::new(0));
        let n = accepted.clone();
        tokio::spawn(async move {
            loop {
                let (s, _) = l.accept().await.unwrap();
                tokio::spawn(serve(s, n.fetch_add(1, Ordering::SeqCst)));
            }
        });
        (
            Upstream::parse(&format!("http://{addr}")).unwrap(),
            accepted,
        )
    }

    /// An upstream answering `ok` (or `ok` then closing when the path is `/close`), counting
    /// the connections it accepted.
    async fn counting_upstream() -> (Upstream, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
        counted_upstream(|s, _| async move {
            let svc = hyper::service::service_fn(|req: Request<Incoming>| async move {
                let close = req.uri().path() == "/close";
                let mut r = Response::new(http_body_util::Full::new(Bytes::from_static(b"ok")));
                if close {
                    r.headers_mut()
                        .insert("connection", http::HeaderValue::from_static("close"));
                }
                Ok::<_, std::convert::Infallible>(r)
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(s), svc)
                .await;
        })
        .await
    }

    async fn get(pool: &H1Pool, path: &str) -> Response<PooledBody> {
        let req = Request::get(path)
            .header("host", "x")
            .body(Body::empty())
            .unwrap();
        pool.request(req).await.unwrap()
    }

    /// A raw HTTP/1.1 upstream reading request heads (the requests here have no body): each
    /// head is answered `ok`, or its connection closed unanswered when `close(connection,
    /// heads answered on it, head)` says so. Counts the connections.
    async fn heads_upstream(
        close: impl Fn(usize, usize, &[u8]) -> bool + Clone + Send + Sync + 'static,
    ) -> (Upstream, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        counted_upstream(move |mut s, nth| {
            let close = close.clone();
            async move {
                let mut buf = Vec::new();
                let mut answered = 0;
                loop {
                    let mut chunk = [0u8; 4096];
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(k) => buf.extend_from_slice(&chunk[..k]),
                    }
                    while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        let head: Vec<u8> = buf.drain(..end + 4).collect();
                        if close(nth, answered, &head) {
                            return;
                        }
                        answered += 1;
                        let a = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                        if s.write_all(a).await.is_err() {
                            return;
                        }
                    }
                }
            }
        })
        .await
    }

    /// An upstream whose first connection answers one request and closes when the next one
    /// arrives (an idle close crossing a request); later connections answer every request.
    async fn closing_upstream() -> (Upstream, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
        heads_upstream(|nth, answered, _| nth == 0 && answered == 1).await
    }

    #[tokio::test]
    async fn an_idempotent_request_crossing_an_idle_close_is_sent_again_on_a_new_connection() {
        use http_body_util::BodyExt;
        use std::sync::atomic::Ordering;
        for (method, body, again) in [
            (http::Method::GET, Body::empty(), true),
            (http::Method::POST, Body::from("x"), false),
        ] {
            let (up, accepted) = closing_upstream().await;
            let pool = H1Pool::new(up, Duration::from_secs(2), Duration::from_secs(60));
            let r = get(&pool, "/").await;
            assert_eq!(r.into_body().collect().await.unwrap().to_bytes(), "ok");
            let req = Request::builder()
                .method(method.clone())
                .uri("/")
                .header("host", "x")
                .body(body)
                .unwrap();
            match (pool.request(req).await, again) {
                (Ok(r), true) => {
                    assert_eq!(r.into_body().collect().await.unwrap().to_bytes(), "ok");
                    assert_eq!(accepted.load(Ordering::SeqCst), 2);
                }
                (Err(e), false) => assert!(!e.is_connect(), "{method}: {e:?}"),
                (r, _) => panic!("{method}: {:?}", r.map(|r| r.status())),
            }
        }
    }

    #[tokio::test]
    async fn a_request_that_kills_its_connection_is_sent_again_once_not_once_per_idle_connection() {
        use http_body_util::BodyExt;
        use std::sync::atomic::{AtomicUsize, Ordering};
        // An upstream answering `ok`, except that `GET /boom` closes its connection unanswered
        // (a handler that crashes the connection); it counts the `/boom` requests it read.
        let booms = std::sync::Arc::new(AtomicUsize::new(0));
        let b = booms.clone();
        let (up, _) = heads_upstream(move |_, _, head| {
            let boom = head.starts_with(b"GET /boom ");
            if boom {
                b.fetch_add(1, Ordering::SeqCst);
            }
            boom
        })
        .await;
        let pool = H1Pool::new(up, Duration::from_secs(2), Duration::from_secs(60));
        // Eight idle connections in the pool: eight answers held at once, then read.
        let mut held = Vec::new();
        for _ in 0..8 {
            held.push(get(&pool, "/").await);
        }
        for r in held {
            assert_eq!(r.into_body().collect().await.unwrap().to_bytes(), "ok");
        }
        let req = Request::get("/boom")
            .header("host", "x")
            .body(Body::empty())
            .unwrap();
        assert!(pool.request(req).await.is_err());
        assert_eq!(booms.load(Ordering::SeqCst), 2, "sent once and again once");
    }

    #[tokio::test]
    async fn the_h1_pool_reuses_a_connection_once_its_answer_is_read_and_never_one_in_use() {
        use http_body_util::BodyExt;
        use std::sync::atomic::Ordering;
        let (up, accepted) = counting_upstream().await;
        let pool = H1Pool::new(up, Duration::from_secs(2), Duration::from_secs(60));
        // One request at a time, each answer read to its end: one connection.
        for _ in 0..20 {
            let r = get(&pool, "/").await;
            assert_eq!(r.into_body().collect().await.unwrap().to_bytes(), "ok");
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
        // Answers held unread: their connections are busy, each request gets another.
        let held = [get(&pool, "/").await, get(&pool, "/").await];
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
        // Answers dropped before their end: their connections are not reused.
        drop(held);
        let r = get(&pool, "/").await;
        assert_eq!(r.into_body().collect().await.unwrap().to_bytes(), "ok");
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
        // The upstream closing after an answer: the next request is answered on a new one.
        let r = get(&pool, "/close").await;
        assert_eq!(r.into_body().collect().await.unwrap().to_bytes(), "ok");
        let before = accepted.load(Ordering::SeqCst);
        let r = get(&pool, "/").await;
        assert_eq!(r.into_body().collect().await.unwrap().to_bytes(), "ok");
        assert_eq!(accepted.load(Ordering::SeqCst), before + 1);
        // No upstream: a connect error.
        let pool = H1Pool::new(
            Upstream::parse("http://127.0.0.1:9").unwrap(),
            Duration::from_millis(200),
            Duration::from_secs(60),
        );
        match pool
            .request(Request::get("/").body(Body::empty()).unwrap())
            .await
        {
            Err(e) => assert!(e.is_connect(), "{e:?}"),
            Ok(_) => panic!("an answer from a closed port"),
        }
    }

    /// An h2c upstream on a free port answering `ok`; each connection closes (GOAWAY) after
    /// its first call when `close_after_one`. Counts the connections it accepted.
    async fn h2c_upstream(
        close_after_one: bool,
    ) -> (Upstream, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
        counted_upstream(move |s, _| async move {
            let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel::<()>();
            let svc = hyper::service::service_fn(move |_req: Request<Incoming>| {
                let _ = done_tx.send(());
                async move {
                    Ok::<_, std::convert::Infallible>(Response::new(http_body_util::Full::new(
                        Bytes::from_static(b"ok"),
                    )))
                }
            });
            let conn = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(s), svc);
            tokio::pin!(conn);
            let mut closing = false;
            loop {
                tokio::select! {
                    _ = conn.as_mut() => return,
                    Some(()) = done_rx.recv(), if close_after_one && !closing => {
                        closing = true;
                        conn.as_mut().graceful_shutdown();
                    }
                }
            }
        })
        .await
    }

    #[tokio::test]
    async fn an_idle_h2c_connection_replaced_closes_once_its_last_call_ends() {
        use http_body_util::BodyExt;
        use std::sync::atomic::{AtomicUsize, Ordering};
        // An h2c upstream whose answers send `a` and end when the test says so; it counts the
        // connections that ended.
        let closed = std::sync::Arc::new(AtomicUsize::new(0));
        let (end_tx, end_rx) = tokio::sync::watch::channel(false);
        let (c, e) = (closed.clone(), end_rx.clone());
        let (up, accepted) = counted_upstream(move |s, _| {
            let (closed, end_rx) = (c.clone(), e.clone());
            async move {
                let svc = hyper::service::service_fn(move |_req: Request<Incoming>| {
                    let mut end_rx = end_rx.clone();
                    async move {
                        let (mut tx, body) = http_body_util::channel::Channel::<Bytes>::new(1);
                        tokio::spawn(async move {
                            let _ = tx.send_data(Bytes::from_static(b"a")).await;
                            let _ = end_rx.wait_for(|end| *end).await;
                        });
                        Ok::<_, std::convert::Infallible>(Response::new(body))
                    }
                });
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
                closed.fetch_add(1, Ordering::SeqCst);
            }
        })
        .await;
        let h2 = Clients::new(up, Duration::from_secs(2), Duration::from_millis(100)).h2;
        let req = || {
            Request::post("http://x/pkg.Svc/Method")
                .version(http::Version::HTTP_2)
                .body(Body::from("x"))
                .unwrap()
        };
        // A call in flight (its answer's first bytes read, not its end) past the idle timeout.
        let mut held = h2.request(req()).await.unwrap().into_body();
        let first = held.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(first, "a");
        tokio::time::sleep(Duration::from_millis(300)).await;
        // The next call goes on a new connection; the first stays open for the held call.
        let mut next = h2.request(req()).await.unwrap().into_body();
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(closed.load(Ordering::SeqCst), 0, "closed under a call");
        // Every answer ends: the replaced connection closes, the current one stays.
        end_tx.send(true).unwrap();
        while held.frame().await.is_some() {}
        while next.frame().await.is_some() {}
        drop((held, next));
        for _ in 0..100 {
            if closed.load(Ordering::SeqCst) == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(closed.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_streamed_call_body_past_every_window_goes_on_after_the_answers_head() {
        use http_body_util::BodyExt;
        // An h2c upstream that answers the head at once, then reads the whole request body
        // and answers its length and its trailer.
        let (up, _) = counted_upstream(|s, _| async move {
            let svc = hyper::service::service_fn(|req: Request<Incoming>| async move {
                let (mut tx, body) = http_body_util::channel::Channel::<Bytes>::new(1);
                tokio::spawn(async move {
                    let (mut n, mut trailer) = (0, String::new());
                    let mut body = req.into_body();
                    while let Some(f) = body.frame().await {
                        match f.unwrap().into_data() {
                            Ok(d) => n += d.len(),
                            Err(f) => {
                                let t = f.into_trailers().unwrap();
                                trailer = t["x-end"].to_str().unwrap().to_owned();
                            }
                        }
                    }
                    let _ = tx.send_data(Bytes::from(format!("{n}"))).await;
                    let mut t = http::HeaderMap::new();
                    t.insert("x-end", trailer.parse().unwrap());
                    let _ = tx.send_trailers(t).await;
                });
                Ok::<_, std::convert::Infallible>(Response::new(body))
            });
            let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(s), svc)
                .await;
        })
        .await;
        let h2 = Clients::new(up, Duration::from_secs(2), Duration::from_secs(60)).h2;
        // 3 MiB: more than the upstream's stream and connection windows (1 MiB each, hyper's
        // server defaults), so the body waits for the upstream to read.
        let (mut tx, body) = http_body_util::channel::Channel::<Bytes, hyper::Error>::new(4);
        let req = Request::post("http://x/pkg.Svc/Upload")
            .version(http::Version::HTTP_2)
            .header("content-type", "application/grpc")
            .body(Body::new(body))
            .unwrap();
        let feed = tokio::spawn(async move {
            for _ in 0..192 {
                tx.send_data(Bytes::from(vec![7u8; 16 << 10]))
                    .await
                    .unwrap();
            }
            let mut t = http::HeaderMap::new();
            t.insert("x-end", "done".parse().unwrap());
            tx.send_trailers(t).await.unwrap();
        });
        let answer = tokio::time::timeout(Duration::from_secs(10), async {
            let mut body = h2.request(req).await.unwrap().into_body();
            let (mut data, mut trailers) = (Vec::new(), None);
            while let Some(f) = body.frame().await {
                match f.unwrap().into_data() {
                    Ok(d) => data.extend_from_slice(&d),
                    Err(f) => trailers = Some(f.into_trailers().unwrap()),
                }
            }
            (String::from_utf8(data).unwrap(), trailers.unwrap())
        })
        .await
        .expect("the call ended");
        assert_eq!(answer.0, (3 << 20).to_string());
        assert_eq!(answer.1["x-end"], "done");
        feed.await.unwrap();
    }

    /// An h2c upstream taking `max_streams` calls at once, each answered with `a` and ended
    /// when `end` says so; it counts the calls it got and notes the reason of each request
    /// body that failed.
    async fn held_upstream(
        max_streams: u32,
        end: tokio::sync::watch::Receiver<bool>,
    ) -> (
        Upstream,
        std::sync::Arc<std::sync::atomic::AtomicUsize>,
        std::sync::Arc<std::sync::Mutex<Vec<Option<h2::Reason>>>>,
    ) {
        use http_body_util::BodyExt;
        let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let resets = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (c, r) = (calls.clone(), resets.clone());
        let (up, _) = counted_upstream(move |s, _| {
            let (calls, resets, end) = (c.clone(), r.clone(), end.clone());
            async move {
                let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                    calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let (resets, mut end) = (resets.clone(), end.clone());
                    async move {
                        let (mut tx, body) = http_body_util::channel::Channel::<Bytes>::new(1);
                        tokio::spawn(async move {
                            let _ = tx.send_data(Bytes::from_static(b"a")).await;
                            let mut body = req.into_body();
                            while let Some(f) = body.frame().await {
                                if let Err(e) = f {
                                    let reason = std::error::Error::source(&e)
                                        .and_then(|s| s.downcast_ref::<h2::Error>())
                                        .and_then(h2::Error::reason);
                                    resets.lock().unwrap().push(reason);
                                    break;
                                }
                            }
                            let _ = end.wait_for(|end| *end).await;
                        });
                        Ok::<_, std::convert::Infallible>(Response::new(body))
                    }
                });
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .max_concurrent_streams(max_streams)
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            }
        })
        .await;
        (up, calls, resets)
    }

    /// A call on `h2` whose answer's first piece (`a`) came: its body, the rest unread.
    async fn started(h2: &H2Conn, body: Body) -> H2Body {
        use http_body_util::BodyExt;
        let mut answer = h2.request(call_request(body)).await.unwrap().into_body();
        let first = answer.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(first, "a");
        answer
    }

    fn call_request(body: Body) -> Request<Body> {
        Request::post("http://x/pkg.Svc/Method")
            .version(http::Version::HTTP_2)
            .header("content-type", "application/grpc")
            .body(body)
            .unwrap()
    }

    #[tokio::test]
    async fn calls_given_up_at_the_upstreams_stream_limit_do_not_reach_it() {
        use http_body_util::BodyExt;
        use std::sync::atomic::Ordering;
        let (end_tx, end_rx) = tokio::sync::watch::channel(false);
        let (up, calls, _) = held_upstream(1, end_rx).await;
        let h2 = Clients::new(up, Duration::from_secs(2), Duration::from_secs(60)).h2;
        // The one stream the upstream takes, held open.
        let mut held = started(&h2, Body::from("x")).await;
        // Three more calls wait for a stream, and their callers give up.
        let given_up = || {
            tokio::time::timeout(
                Duration::from_millis(300),
                h2.request(call_request(Body::from("y"))),
            )
        };
        let (a, b, c) = tokio::join!(given_up(), given_up(), given_up());
        assert!(
            a.is_err() && b.is_err() && c.is_err(),
            "a stream beyond the limit"
        );
        // The first ends. Of the given-up calls, only the one h2 held waiting for a stream
        // may go then (its head queued in h2, reset right after, as with hyper's client):
        // the others waited outside h2 and are gone with their callers.
        end_tx.send(true).unwrap();
        while held.frame().await.is_some() {}
        drop(held);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let sent = calls.load(Ordering::SeqCst);
        assert!(sent <= 2, "{} given-up calls were sent", sent - 1);
        // The connection serves the next call.
        started(&h2, Body::from("z")).await;
        assert_eq!(calls.load(Ordering::SeqCst), sent + 1);
    }

    #[tokio::test]
    async fn a_callers_reset_of_a_streaming_call_reaches_the_upstream_as_it_came() {
        let (_end_tx, end_rx) = tokio::sync::watch::channel(false);
        let (up, _, resets) = held_upstream(100, end_rx).await;
        let h2 = Clients::new(up, Duration::from_secs(2), Duration::from_secs(60)).h2;
        // Two calls whose bodies stream, answered at once; one caller cancels, the other's
        // body fails otherwise.
        type BoxError = Box<dyn std::error::Error + Send + Sync>;
        let cancel: BoxError = Box::new(h2::Error::from(h2::Reason::CANCEL));
        for (err, want) in [
            (cancel, h2::Reason::CANCEL),
            ("broken".into(), h2::Reason::INTERNAL_ERROR),
        ] {
            let (mut tx, body) = http_body_util::channel::Channel::<Bytes, BoxError>::new(1);
            tx.send_data(Bytes::from_static(b"x")).await.unwrap();
            let _answer = started(&h2, Body::new(body)).await;
            let before = resets.lock().unwrap().len();
            tx.abort(err);
            for _ in 0..100 {
                if resets.lock().unwrap().len() > before {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            assert_eq!(resets.lock().unwrap().get(before), Some(&Some(want)));
        }
    }

    async fn call(h2: &H2Conn) -> Result<Bytes, UpstreamError> {
        use http_body_util::BodyExt;
        let r = h2.request(call_request(Body::from("x"))).await?;
        Ok(r.into_body().collect().await.unwrap().to_bytes())
    }

    #[tokio::test]
    async fn grpc_calls_share_one_h2c_connection_and_a_closed_one_is_replaced() {
        use std::sync::atomic::Ordering;
        // Calls one after the other, and at once: one connection.
        let (up, accepted) = h2c_upstream(false).await;
        let h2 = Clients::new(up, Duration::from_secs(2), Duration::from_secs(60)).h2;
        for _ in 0..5 {
            assert_eq!(call(&h2).await.unwrap(), "ok");
        }
        let (a, b) = tokio::join!(call(&h2), call(&h2));
        assert_eq!(
            (a.unwrap(), b.unwrap()),
            (Bytes::from("ok"), Bytes::from("ok"))
        );
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
        // The upstream closing each connection after a call: every call still answered.
        let (up, accepted) = h2c_upstream(true).await;
        let h2 = Clients::new(up, Duration::from_secs(2), Duration::from_secs(60)).h2;
        for _ in 0..3 {
            assert_eq!(call(&h2).await.unwrap(), "ok");
            // The GOAWAY reaches the connection's task.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
        // Unused for longer than the idle timeout: replaced.
        let (up, accepted) = h2c_upstream(false).await;
        let h2 = Clients::new(up, Duration::from_secs(2), Duration::from_millis(100)).h2;
        assert_eq!(call(&h2).await.unwrap(), "ok");
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(call(&h2).await.unwrap(), "ok");
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
        // No upstream: a connect error.
        let h2 = Clients::new(
            Upstream::parse("http://127.0.0.1:9").unwrap(),
            Duration::from_millis(200),
            Duration::from_secs(60),
        )
        .h2;
        match call(&h2).await {
            Err(e) => assert!(e.is_connect(), "{e:?}"),
            Ok(_) => panic!("an answer from a closed port"),
        }
    }
}
