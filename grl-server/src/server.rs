//! The one HTTP serving loop of every daemon (controller, aggregator, `rlc serve`, `grl
//! sidecar`): HTTP/1.1 over plain TCP or TLS (and for the sidecar HTTP/2 without TLS on the
//! same port, [`ConnOptions`]), with every connection bounded in time and in number.
//!
//! - **Header timeout**: a request's head (request line and headers) must arrive within
//!   [`ServeLimits::header_timeout`] of the connection's accept (the TLS handshake included)
//!   or of its first byte; a client that trickles a byte a second is cut.
//! - **Idle timeout**: a kept-alive connection with no request in flight and no byte read or
//!   written for [`ServeLimits::idle_timeout`] is closed.
//! - **Connection cap**: at most [`ServeLimits::max_connections`] connections per listener.
//!   Beyond it, [`ServeLimits::health_connections`] more connections are served one request
//!   each, and only the health paths ([`HEALTH_PATHS`]; anything else gets 503 with
//!   `Retry-After`), with a short header timeout ([`HEALTH_HEADER_TIMEOUT`]): an orchestrator's
//!   probes still answer while the cap is reached. Connections beyond both are closed at once.
//!   The cap is kept below the process's file-descriptor limit ([`fit_to_fd_limit`]).
//!
//! Request bodies are bounded by the handlers ([`crate::http_util::read_body`]: size and time);
//! heads by hyper's buffer (about 400 KiB).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::ConnectInfo;
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch, Semaphore};
use tower::ServiceExt;

use crate::tls::{Peer, ReloadingServerConfig};

/// Paths served on a connection taken beyond the cap (every daemon's liveness and readiness).
pub const HEALTH_PATHS: &[&str] = &["/healthz", "/readyz"];

/// The header timeout of a connection served beyond the cap (a probe sends its request at
/// once), or [`ServeLimits::header_timeout`] when that is shorter.
pub const HEALTH_HEADER_TIMEOUT: Duration = Duration::from_secs(2);

/// File descriptors kept free beside the connections: state files, outgoing connections
/// (forwards, peers, the state database), logs.
const FD_RESERVE: u64 = 256;

/// Time and number bounds of a server's connections (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServeLimits {
    /// A request's head must arrive within this of the connection's accept or of its first
    /// byte.
    pub header_timeout: Duration,
    /// A connection with no request in flight and no I/O for this long is closed.
    pub idle_timeout: Duration,
    /// Connections served at once (TLS handshakes included).
    pub max_connections: usize,
    /// Connections beyond `max_connections` that still get the health paths.
    pub health_connections: usize,
}

impl Default for ServeLimits {
    /// 10 s header timeout, 60 s idle timeout, 10,000 connections plus 16 for health probes.
    fn default() -> Self {
        ServeLimits {
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            max_connections: 10_000,
            health_connections: 16,
        }
    }
}

/// What a server's connections did: `/metrics` of the controller and the aggregator export
/// it ([`ServerStats::register`]).
#[derive(Debug, Default)]
pub struct ServerStats {
    open: AtomicU64,
    accepted: AtomicU64,
    health_only: AtomicU64,
    refused: AtomicU64,
    header_timeouts: AtomicU64,
    idle_closed: AtomicU64,
    /// The cap in force (after [`fit_to_fd_limit`]).
    cap: AtomicU64,
}

impl ServerStats {
    /// Connections open now (health-only ones included).
    pub fn open(&self) -> u64 {
        self.open.load(Ordering::Relaxed)
    }

    /// Connections closed at accept because the cap and the health slots were taken.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Connections served beyond the cap, health paths only.
    pub fn health_only(&self) -> u64 {
        self.health_only.load(Ordering::Relaxed)
    }

    /// Connections cut because a request head did not arrive in time.
    pub fn header_timeouts(&self) -> u64 {
        self.header_timeouts.load(Ordering::Relaxed)
    }

    /// Connections closed after the idle timeout.
    pub fn idle_closed(&self) -> u64 {
        self.idle_closed.load(Ordering::Relaxed)
    }

    /// The connection cap in force (0 before the server started).
    pub fn cap(&self) -> u64 {
        self.cap.load(Ordering::Relaxed)
    }

    /// Registers `grl_http_connections`, `grl_http_connections_max`,
    /// `grl_http_connections_accepted_total` and `grl_http_connections_closed_total{reason}`
    /// (read at scrape time).
    pub fn register(self: &Arc<Self>, reg: &mut prometheus_client::registry::Registry) {
        reg.register_collector(Box::new(StatsCollector(self.clone())));
    }
}

#[derive(Debug)]
struct StatsCollector(Arc<ServerStats>);

impl prometheus_client::collector::Collector for StatsCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> std::fmt::Result {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::counter::ConstCounter;
        use prometheus_client::metrics::gauge::ConstGauge;
        use prometheus_client::metrics::MetricType;
        let s = &self.0;
        let fam = encoder.encode_descriptor(
            "grl_http_connections",
            "HTTP connections open now.",
            None,
            MetricType::Gauge,
        )?;
        ConstGauge::new(s.open() as i64).encode(fam)?;
        let fam = encoder.encode_descriptor(
            "grl_http_connections_max",
            "The cap on HTTP connections served at once (health-only connections come on top).",
            None,
            MetricType::Gauge,
        )?;
        ConstGauge::new(s.cap() as i64).encode(fam)?;
        let fam = encoder.encode_descriptor(
            "grl_http_connections_accepted",
            "HTTP connections accepted and served (health-only ones included).",
            None,
            MetricType::Counter,
        )?;
        ConstCounter::new(s.accepted.load(Ordering::Relaxed)).encode(fam)?;
        let mut fam = encoder.encode_descriptor(
            "grl_http_connections_closed",
            "HTTP connections closed by the server, by reason: refused (cap and health slots taken), health_only (served beyond the cap, health paths only), header_timeout, idle.",
            None,
            MetricType::Counter,
        )?;
        for (reason, v) in [
            ("refused", &s.refused),
            ("health_only", &s.health_only),
            ("header_timeout", &s.header_timeouts),
            ("idle", &s.idle_closed),
        ] {
            ConstCounter::new(v.load(Ordering::Relaxed))
                .encode(fam.encode_family(&[("reason", reason)])?)?;
        }
        Ok(())
    }
}

/// Keeps `limits.max_connections + limits.health_connections` (times `listeners`) plus a
/// reserve below the process's open-file limit: the soft limit is raised toward the hard one
/// when needed (as Go's runtime does at start), and when that is not enough the cap is lowered,
/// with a warning. Returns the limits in force.
pub fn fit_to_fd_limit(mut limits: ServeLimits, listeners: usize) -> ServeLimits {
    let per = (limits.max_connections + limits.health_connections) as u64;
    let want = per * listeners.max(1) as u64 + FD_RESERVE;
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct it is given and has no other effect.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) } != 0 {
        return limits;
    }
    if rl.rlim_cur < want as libc::rlim_t && rl.rlim_cur < rl.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: (want as libc::rlim_t).min(rl.rlim_max),
            rlim_max: rl.rlim_max,
        };
        // SAFETY: setrlimit reads the struct it is given; raising the soft limit up to the
        // hard one needs no privilege.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            rl.rlim_cur = raised.rlim_cur;
        }
    }
    #[allow(clippy::unnecessary_cast)] // rlim_t is not u64 everywhere
    let have = rl.rlim_cur as u64;
    if have < want {
        let room = have.saturating_sub(FD_RESERVE) / listeners.max(1) as u64;
        let cap = room.saturating_sub(limits.health_connections as u64).max(1) as usize;
        tracing::warn!(
            asked = limits.max_connections,
            cap,
            open_files_limit = have,
            "connection cap lowered to fit the open-file limit (raise it with ulimit -n or LimitNOFILE=)"
        );
        limits.max_connections = cap;
    }
    limits
}

/// Per connection: what its reads, writes and requests did, for the timeouts.
struct Activity {
    /// [`coarse_ms`] at the accept.
    origin: u64,
    /// Milliseconds since `origin` of the last byte read or written, or request finished.
    last_io: AtomicU64,
    /// Milliseconds since `origin` at which the head being awaited began ([`NONE`]: no head
    /// is being awaited; 0 at accept: the first head).
    head_since: AtomicU64,
    in_flight: AtomicU32,
    /// The connection speaks HTTP/2: it multiplexes, so there is no next head to await once
    /// its first request came, and the bytes it reads between requests (WINDOW_UPDATE, PING,
    /// another stream's frames) never start a header clock.
    h2: AtomicBool,
    /// HTTP/2 answers whose head went and whose body is still being sent ([`Answered`]).
    streaming: AtomicU32,
    /// Milliseconds since `origin` at which an HTTP/2 answer's body last gave a frame to send
    /// (the answers' progress; the connection's own writes include ping replies).
    last_progress: AtomicU64,
}

/// Milliseconds on the system's coarse monotonic clock (`CLOCK_MONOTONIC_COARSE`, advanced at
/// each scheduler tick: a few milliseconds), read at every read and write of a connection:
/// cheaper than `Instant::now` and its `Duration` arithmetic, and fine for timeouts of
/// seconds.
#[cfg(target_os = "linux")]
fn coarse_ms() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid `timespec` for the call to write. With a valid pointer the
    // only error is a clock the kernel lacks, and this one exists since Linux 2.6.32.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    ts.tv_sec as u64 * 1000 + ts.tv_nsec as u64 / 1_000_000
}

/// Milliseconds since the first call (elsewhere than Linux).
#[cfg(not(target_os = "linux"))]
fn coarse_ms() -> u64 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    START
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_millis() as u64
}

const NONE: u64 = u64::MAX;

#[derive(Debug, PartialEq)]
enum Verdict {
    Fine,
    HeaderTimeout,
    Idle,
}

impl Activity {
    fn new() -> Activity {
        Activity {
            origin: coarse_ms(),
            last_io: AtomicU64::new(0),
            head_since: AtomicU64::new(0),
            in_flight: AtomicU32::new(0),
            h2: AtomicBool::new(false),
            streaming: AtomicU32::new(0),
            last_progress: AtomicU64::new(0),
        }
    }

    fn now(&self) -> u64 {
        coarse_ms().saturating_sub(self.origin)
    }

    fn read(&self) {
        let now = self.now();
        self.last_io.store(now, Ordering::Relaxed);
        if self.in_flight.load(Ordering::Relaxed) == 0 && !self.h2.load(Ordering::Relaxed) {
            // The first byte of the next head starts its clock (body bytes arrive while the
            // request is in flight and do not).
            let _ =
                self.head_since
                    .compare_exchange(NONE, now, Ordering::Relaxed, Ordering::Relaxed);
        }
    }

    fn wrote(&self) {
        self.last_io.store(self.now(), Ordering::Relaxed);
    }

    fn request_started(&self, h2: bool) {
        if h2 {
            self.h2.store(true, Ordering::Relaxed);
        }
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        self.head_since.store(NONE, Ordering::Relaxed);
    }

    fn request_done(&self) {
        self.last_io.store(self.now(), Ordering::Relaxed);
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
    }

    fn verdict(&self, header_ms: u64, idle_ms: u64) -> Verdict {
        if self.in_flight.load(Ordering::Relaxed) > 0 {
            return Verdict::Fine;
        }
        let now = self.now();
        // HTTP/2 answers being sent: idle when none of them moved for the idle timeout,
        // whatever the caller sends meanwhile (pings, window updates) and the replies to it.
        if self.streaming.load(Ordering::Relaxed) > 0 {
            let stalled = now.saturating_sub(self.last_progress.load(Ordering::Relaxed)) > idle_ms;
            return if stalled {
                Verdict::Idle
            } else {
                Verdict::Fine
            };
        }
        match self.head_since.load(Ordering::Relaxed) {
            NONE if now.saturating_sub(self.last_io.load(Ordering::Relaxed)) > idle_ms => {
                Verdict::Idle
            }
            NONE => Verdict::Fine,
            since if now.saturating_sub(since) > header_ms => Verdict::HeaderTimeout,
            _ => Verdict::Fine,
        }
    }
}

/// An answer's body as the connection sends it: an HTTP/2 one with a body to send is counted
/// in [`Activity::streaming`] until it is dropped, and its frames are its progress.
struct Answered {
    inner: axum::body::Body,
    watch: Option<Arc<Activity>>,
}

impl Answered {
    fn new(inner: axum::body::Body, watch: Option<Arc<Activity>>) -> Answered {
        let watch = watch.filter(|_| !hyper::body::Body::is_end_stream(&inner));
        if let Some(act) = &watch {
            act.streaming.fetch_add(1, Ordering::Relaxed);
            act.last_progress.store(act.now(), Ordering::Relaxed);
        }
        Answered { inner, watch }
    }
}

impl Drop for Answered {
    fn drop(&mut self) {
        if let Some(act) = &self.watch {
            act.streaming.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl hyper::body::Body for Answered {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<bytes::Bytes>, axum::Error>>> {
        let r = std::pin::Pin::new(&mut self.inner).poll_frame(cx);
        if let (Some(act), std::task::Poll::Ready(Some(Ok(_)))) = (&self.watch, &r) {
            // hyper takes a frame, then waits for the caller's windows to send it before it
            // takes the next: frames taken are the answer's progress.
            act.last_progress.store(act.now(), Ordering::Relaxed);
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

/// Marks a request finished when dropped (its handler returned, or the connection was cut).
struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.request_done();
    }
}

/// A connection's stream, noting its reads and writes in its [`Activity`].
struct Watched<I> {
    inner: I,
    act: Arc<Activity>,
}

impl<I: AsyncRead + Unpin> AsyncRead for Watched<I> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = std::pin::Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(r, std::task::Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.act.read();
        }
        r
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Watched<I> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let r = std::pin::Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(r, std::task::Poll::Ready(Ok(n)) if n > 0) {
            self.act.wrote();
        }
        r
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let r = std::pin::Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(r, std::task::Poll::Ready(Ok(n)) if n > 0) {
            self.act.wrote();
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// How a server's connections speak HTTP (every daemon: HTTP/1.1 with hyper's bounds).
#[derive(Debug, Clone, Default)]
pub struct ConnOptions {
    /// Also HTTP/2 on the same port: without TLS with prior knowledge (h2c, as gRPC clients
    /// send it), told apart from HTTP/1.1 by its connection preface (`grl sidecar`).
    pub h2c: bool,
    /// Largest request head: HTTP/1.1's read buffer (at least 8 KiB) and HTTP/2's header list.
    /// None: hyper's defaults (about 400 KiB for HTTP/1.1).
    pub max_header_bytes: Option<usize>,
    /// Serve the connections on these single-threaded runtimes (round robin at accept)
    /// instead of the accepting runtime (`grl sidecar`, see [`Workers`]).
    pub workers: Option<Workers>,
    /// Each connection's share of a proxy's upstream slots: the requests one connection may
    /// have in flight upstream at once ([`Peer::share`]), so that one caller connection cannot
    /// hold every slot (`grl sidecar`). None: no share.
    pub slots_per_connection: Option<usize>,
}

/// Single-threaded runtimes, one thread each, that a proxy's connections are spread over: a
/// connection, the upstream connections it uses (see [`worker_index`]) and their timers then
/// live on one thread, so a request and its upstream call wake no other thread and take no
/// cross-thread scheduling (the multi-threaded runtime moved every request between its
/// workers, with a futex wake-up each time at low rates). The threads end when the last clone
/// is dropped.
#[derive(Clone)]
pub struct Workers {
    handles: Arc<[tokio::runtime::Handle]>,
    next: Arc<AtomicU64>,
    /// Dropped with the last clone: the threads' runtimes stop.
    _stop: Arc<watch::Sender<()>>,
}

impl std::fmt::Debug for Workers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Workers({})", self.handles.len())
    }
}

thread_local! {
    static WORKER: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// The index of the [`Workers`] thread this runs on (None elsewhere): per-worker state, such
/// as the sidecar's upstream pools, is picked by it.
pub fn worker_index() -> Option<usize> {
    WORKER.with(|w| w.get())
}

impl Workers {
    /// Starts `n` (at least 1) threads named `name-i`, each running a current-thread runtime.
    pub fn start(n: usize, name: &str) -> std::io::Result<Workers> {
        let (stop_tx, stop_rx) = watch::channel(());
        let mut handles = Vec::new();
        for i in 0..n.max(1) {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            handles.push(rt.handle().clone());
            let mut stopped = stop_rx.clone();
            std::thread::Builder::new()
                .name(format!("{name}-{i}"))
                .spawn(move || {
                    WORKER.with(|w| w.set(Some(i)));
                    // Until every sender is gone; the runtime (and what is left on it) is
                    // dropped on its own thread.
                    rt.block_on(async move { while stopped.changed().await.is_ok() {} });
                })?;
        }
        Ok(Workers {
            handles: handles.into(),
            next: Arc::new(AtomicU64::new(0)),
            _stop: Arc::new(stop_tx),
        })
    }

    /// How many threads.
    pub fn len(&self) -> usize {
        self.handles.len()
    }

    /// Whether there are none (never: `start` makes at least one).
    pub fn is_empty(&self) -> bool {
        self.handles.is_empty()
    }

    fn pick(&self) -> &tokio::runtime::Handle {
        let i = self.next.fetch_add(1, Ordering::Relaxed) as usize % self.handles.len();
        &self.handles[i]
    }
}

/// What answers a server's requests.
#[derive(Clone)]
pub enum Handler {
    /// An axum router; handlers can extract `ConnectInfo<Peer>`.
    Router(Router),
    /// One function for every request (`grl sidecar`'s proxy): none of the router's
    /// per-request work (its route lookup, the peer put in the request's extensions, a boxed
    /// body and service call).
    Direct(Arc<DirectFn>),
}

/// A [`Handler::Direct`] function: the request and the connection's peer to the answer.
pub type DirectFn = dyn Fn(http::Request<Incoming>, &Peer) -> DirectFuture + Send + Sync;

/// The answer of a [`DirectFn`].
pub type DirectFuture =
    std::pin::Pin<Box<dyn std::future::Future<Output = axum::response::Response> + Send>>;

impl From<Router> for Handler {
    fn from(r: Router) -> Handler {
        Handler::Router(r)
    }
}

/// Everything a connection task needs, shared by all of them.
struct Ctx {
    handler: Handler,
    tls: Option<Arc<ReloadingServerConfig>>,
    limits: ServeLimits,
    stats: Arc<ServerStats>,
    conn: ConnOptions,
}

/// Serves `router` on `listener` until `shutdown` resolves, with `limits` (see the module
/// documentation), over TLS when `tls` is given. Then stops accepting, lets every connection
/// finish its request in flight (idle ones close at once) and returns when all are closed.
/// Handlers can extract `ConnectInfo<Peer>`.
pub async fn serve_with(
    listener: TcpListener,
    router: Router,
    tls: Option<Arc<ReloadingServerConfig>>,
    limits: ServeLimits,
    stats: Arc<ServerStats>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_with_options(
        listener,
        router,
        tls,
        limits,
        stats,
        ConnOptions::default(),
        shutdown,
    )
    .await
}

/// [`serve_with`] with `conn` (HTTP/2 as well, a bound on request heads).
pub async fn serve_with_options(
    listener: TcpListener,
    handler: impl Into<Handler>,
    tls: Option<Arc<ReloadingServerConfig>>,
    limits: ServeLimits,
    stats: Arc<ServerStats>,
    conn: ConnOptions,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let limits = fit_to_fd_limit(limits, 1);
    stats
        .cap
        .store(limits.max_connections as u64, Ordering::Relaxed);
    let full = Arc::new(Semaphore::new(limits.max_connections));
    let health = Arc::new(Semaphore::new(limits.health_connections));
    // Connections watch `closing`; each holds a clone of `done`, so `done_rx` ends once
    // the last one is gone.
    let (closing_tx, closing_rx) = watch::channel(false);
    let (done_tx, mut done_rx) = mpsc::channel::<()>(1);
    let reload = tls.clone().map(|t| tokio::spawn(reload_loop(t)));
    let ctx = Arc::new(Ctx {
        handler: handler.into(),
        tls,
        limits,
        stats: stats.clone(),
        conn,
    });
    let mut logs = AcceptLogs::default();
    let drain = Drain {
        closing: closing_rx,
        done: done_tx,
    };
    tokio::pin!(shutdown);
    loop {
        let (sock, addr) = tokio::select! {
            _ = &mut shutdown => break,
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    // Out of file descriptors and the like: wait instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let Some(admitted) = admit(&full, &health, &stats) else {
            drop(sock);
            logs.refused(&stats, limits.max_connections);
            continue;
        };
        spawn_connection(&ctx, sock, addr, admitted, drain.clone());
        if let Some(t) = &ctx.tls {
            logs.handshakes(t);
        }
    }
    drop(listener);
    let _ = closing_tx.send(true);
    drop(drain);
    let _ = done_rx.recv().await;
    if let Some(r) = reload {
        r.abort();
    }
    Ok(())
}

/// A connection let in: its permit, and whether it was taken beyond the cap (health paths
/// only, one request).
struct Admitted {
    permit: tokio::sync::OwnedSemaphorePermit,
    health_only: bool,
}

/// Within the cap (`full`): every path, kept alive; beyond it (`health`): health paths only,
/// one request; `None` (counted as refused) when both are taken.
fn admit(full: &Arc<Semaphore>, health: &Arc<Semaphore>, stats: &ServerStats) -> Option<Admitted> {
    match full.clone().try_acquire_owned() {
        Ok(permit) => Some(Admitted {
            permit,
            health_only: false,
        }),
        Err(_) => match health.clone().try_acquire_owned() {
            Ok(permit) => {
                stats.health_only.fetch_add(1, Ordering::Relaxed);
                Some(Admitted {
                    permit,
                    health_only: true,
                })
            }
            Err(_) => {
                stats.refused.fetch_add(1, Ordering::Relaxed);
                None
            }
        },
    }
}

/// What a connection holds so that a stop can drain them all: `closing` turns true when the
/// server stops, and `done` ends once every connection dropped its clone.
#[derive(Clone)]
struct Drain {
    closing: watch::Receiver<bool>,
    done: mpsc::Sender<()>,
}

/// Serves `sock` on its own task (on a worker thread when there are some), counted as open
/// until it closes.
fn spawn_connection(
    ctx: &Arc<Ctx>,
    sock: TcpStream,
    addr: SocketAddr,
    admitted: Admitted,
    drain: Drain,
) {
    let _ = sock.set_nodelay(true);
    ctx.stats.accepted.fetch_add(1, Ordering::Relaxed);
    ctx.stats.open.fetch_add(1, Ordering::Relaxed);
    let ctx2 = ctx.clone();
    let Admitted {
        permit,
        health_only,
    } = admitted;
    let serve = move |sock: std::io::Result<TcpStream>| async move {
        match sock {
            Ok(sock) => connection(ctx2.clone(), sock, addr, health_only, drain.closing).await,
            Err(e) => tracing::warn!(error = %e, "cannot move a connection to a worker"),
        }
        drop(permit);
        ctx2.stats.open.fetch_sub(1, Ordering::Relaxed);
        drop(drain.done);
    };
    match &ctx.conn.workers {
        None => {
            tokio::spawn(serve(Ok(sock)));
        }
        // Registered again with the worker's reactor, on the worker.
        Some(w) => match sock.into_std() {
            Ok(std_sock) => {
                w.pick()
                    .spawn(async move { serve(TcpStream::from_std(std_sock)).await });
            }
            Err(e) => {
                tokio::spawn(serve(Err(e)));
            }
        },
    }
}

/// Summaries of refused connections and failed TLS handshakes, each at most every 10 s:
/// refused clients are visible without a log flood.
struct AcceptLogs {
    refused: grl_client::auth::LogGate,
    refused_logged: u64,
    handshakes: grl_client::auth::LogGate,
    handshakes_logged: u64,
}

impl Default for AcceptLogs {
    fn default() -> Self {
        AcceptLogs {
            refused: grl_client::auth::LogGate::new(Duration::from_secs(10)),
            refused_logged: 0,
            handshakes: grl_client::auth::LogGate::new(Duration::from_secs(10)),
            handshakes_logged: 0,
        }
    }
}

impl AcceptLogs {
    /// A connection was refused at the cap.
    fn refused(&mut self, stats: &ServerStats, max_connections: usize) {
        let n = stats.refused();
        if self.refused.open() {
            tracing::warn!(
                refused = n - self.refused_logged,
                max_connections,
                "connection cap reached: connections closed at accept (logged at most every 10 s; grl_http_connections_closed_total{{reason=\"refused\"}})"
            );
            self.refused_logged = n;
        }
    }

    /// The handshakes that failed since the last summary, if any.
    fn handshakes(&mut self, tls: &ReloadingServerConfig) {
        let failures = tls.handshake_failures();
        if failures > self.handshakes_logged && self.handshakes.open() {
            tracing::warn!(
                failed = failures - self.handshakes_logged,
                "TLS handshakes failed (untrusted or missing client certificate, plain HTTP, timeout); RUST_LOG=grl_runtime::tls=debug names the peers"
            );
            self.handshakes_logged = failures;
        }
    }
}

/// Re-reads the TLS files every `reload_every` (off the async threads) until aborted.
async fn reload_loop(tls: Arc<ReloadingServerConfig>) {
    let mut iv = tokio::time::interval(tls.files().reload_every.max(Duration::from_millis(50)));
    iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        iv.tick().await;
        let t = tls.clone();
        let _ = tokio::task::spawn_blocking(move || t.check()).await;
    }
}

/// One connection: the TLS handshake (within the header timeout), then HTTP/1.1 until the
/// client closes, a timeout cuts it, or the server shuts down.
async fn connection(
    ctx: Arc<Ctx>,
    sock: TcpStream,
    addr: SocketAddr,
    health_only: bool,
    closing: watch::Receiver<bool>,
) {
    let header_timeout = if health_only {
        ctx.limits.header_timeout.min(HEALTH_HEADER_TIMEOUT)
    } else {
        ctx.limits.header_timeout
    };
    let act = Arc::new(Activity::new());
    match &ctx.tls {
        None => {
            let peer = Peer {
                addr,
                cert_names: Arc::from(Vec::new()),
                share: share(&ctx.conn),
            };
            let io = Watched {
                inner: sock,
                act: act.clone(),
            };
            http(&ctx, io, peer, act, header_timeout, health_only, closing).await;
        }
        Some(tls) => {
            let acceptor = tokio_rustls::TlsAcceptor::from(tls.current());
            let stream = match tokio::time::timeout(header_timeout, acceptor.accept(sock)).await {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    tls.handshake_failed();
                    tracing::debug!(peer = %addr, error = %e, "TLS handshake failed");
                    return;
                }
                Err(_) => {
                    tls.handshake_failed();
                    ctx.stats.header_timeouts.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(peer = %addr, "TLS handshake timed out");
                    return;
                }
            };
            let (_, conn) = stream.get_ref();
            let peer = Peer {
                addr,
                cert_names: Arc::from(
                    conn.peer_certificates()
                        .and_then(|c| c.first())
                        .map(crate::tls::cert_names)
                        .unwrap_or_default(),
                ),
                share: share(&ctx.conn),
            };
            let io = Watched {
                inner: stream,
                act: act.clone(),
            };
            http(&ctx, io, peer, act, header_timeout, health_only, closing).await;
        }
    }
}

/// Largest buffer of one HTTP/2 stream's answer waiting for its caller's window.
const H2_SEND_BUF: usize = 32 << 10;

/// A new connection's share of the upstream slots, when the server gives one.
fn share(conn: &ConnOptions) -> Option<Arc<crate::tls::ConnShare>> {
    conn.slots_per_connection
        .map(|n| Arc::new(crate::tls::ConnShare::new(n)))
}

async fn http<I>(
    ctx: &Arc<Ctx>,
    io: Watched<I>,
    peer: Peer,
    act: Arc<Activity>,
    header_timeout: Duration,
    health_only: bool,
    closing: watch::Receiver<bool>,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let addr = peer.addr;
    let handler = ctx.handler.clone();
    let act2 = act.clone();
    let svc = hyper::service::service_fn(move |mut req: http::Request<Incoming>| {
        let h2 = req.version() == http::Version::HTTP_2;
        act2.request_started(h2);
        let done = InFlight(act2.clone());
        let answer = if health_only && !HEALTH_PATHS.contains(&req.uri().path()) {
            Answer::Now(at_capacity())
        } else {
            match &handler {
                Handler::Direct(f) => Answer::Direct(f(req, &peer)),
                Handler::Router(router) => {
                    req.extensions_mut().insert(ConnectInfo(peer.clone()));
                    Answer::Router(router.clone().oneshot(req.map(axum::body::Body::new)))
                }
            }
        };
        // An HTTP/2 answer is watched for progress (an HTTP/1.1 one is idle-checked by the
        // connection's own reads and writes).
        let watch = h2.then(|| act2.clone());
        async move {
            let _done = done;
            let resp = match answer {
                Answer::Now(r) => r,
                Answer::Direct(f) => f.await,
                Answer::Router(f) => f.await.unwrap_or_else(|e| match e {}),
            };
            Ok::<_, Infallible>(resp.map(|b| Answered::new(b, watch)))
        }
    });
    let io = TokioIo::new(io);
    let limits = (header_timeout, ctx.limits.idle_timeout);
    let max_head = ctx.conn.max_header_bytes;
    if ctx.conn.h2c {
        let mut builder =
            hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new());
        builder.http1().keep_alive(!health_only).writev(false);
        // What one stream's answer may buffer beyond what its caller's window lets through
        // (hyper's default is 400 KiB a stream): a caller that stops reading its streams holds
        // this much per stream, and its upstream's flow control holds the rest.
        builder.http2().max_send_buf_size(H2_SEND_BUF);
        if let Some(n) = max_head {
            builder.http1().max_buf_size(n.max(8192));
            builder
                .http2()
                .max_header_list_size(u32::try_from(n).unwrap_or(u32::MAX));
        }
        let conn = builder.serve_connection(io, svc);
        drive(ctx, conn, act, addr, limits, closing).await;
    } else {
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder.keep_alive(!health_only);
        if let Some(n) = max_head {
            builder.max_buf_size(n.max(8192));
        }
        let conn = builder.serve_connection(io, svc);
        drive(ctx, conn, act, addr, limits, closing).await;
    }
}

/// A request's answer on its way.
enum Answer {
    Now(axum::response::Response),
    Direct(DirectFuture),
    Router(tower::util::Oneshot<Router, http::Request<axum::body::Body>>),
}

/// Runs one connection until it ends, a timeout cuts it, or (on shutdown) it finishes its
/// requests in flight.
async fn drive<C>(
    ctx: &Arc<Ctx>,
    conn: C,
    act: Arc<Activity>,
    addr: SocketAddr,
    (header_timeout, idle_timeout): (Duration, Duration),
    mut closing: watch::Receiver<bool>,
) where
    C: hyper_util::server::graceful::GracefulConnection,
    C::Error: std::fmt::Display,
{
    tokio::pin!(conn);
    let (header_ms, idle_ms) = (
        header_timeout.as_millis() as u64,
        idle_timeout.as_millis() as u64,
    );
    let every = (header_timeout.min(idle_timeout) / 4)
        .clamp(Duration::from_millis(10), Duration::from_secs(1));
    let mut check = tokio::time::interval(every);
    check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut shutting = *closing.borrow();
    if shutting {
        conn.as_mut().graceful_shutdown();
    }
    // Ends when the server shuts down (or is gone).
    let mut shutdown = std::pin::pin!(async move {
        let _ = closing.wait_for(|c| *c).await;
    });
    // The check and the shutdown signal wake the task through their own waker, so that the
    // connection's own wake-ups (its socket's: nearly all) poll the connection only.
    let side = Arc::new(SideWaker {
        woken: std::sync::atomic::AtomicBool::new(true),
        task: atomic_waker::AtomicWaker::new(),
    });
    let side_waker = std::task::Waker::from(side.clone());
    // The task's waker as last registered: registered again when it changes (rarely) and
    // after a side wake-up, which takes it; the check and the signal are polled after that, so
    // what woke nobody in between is seen then.
    let mut registered: Option<std::task::Waker> = None;
    let cut = std::future::poll_fn(|cx| {
        if !registered.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            side.task.register(cx.waker());
            registered = Some(cx.waker().clone());
        }
        if side.woken.swap(false, Ordering::AcqRel) {
            side.task.register(cx.waker());
            let mut scx = std::task::Context::from_waker(&side_waker);
            if !shutting && std::future::Future::poll(shutdown.as_mut(), &mut scx).is_ready() {
                shutting = true;
                conn.as_mut().graceful_shutdown();
            }
            // Polled until pending, so that the next tick wakes the task.
            while check.poll_tick(&mut scx).is_ready() {
                match act.verdict(header_ms, idle_ms) {
                    Verdict::Fine => {}
                    cut => return std::task::Poll::Ready(Err(cut)),
                }
            }
        }
        conn.as_mut().poll(cx).map(Ok)
    })
    .await;
    match cut {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::debug!(peer = %addr, error = %e, "connection ended with an error"),
        // Dropping the connection closes the socket.
        Err(Verdict::HeaderTimeout) => {
            ctx.stats.header_timeouts.fetch_add(1, Ordering::Relaxed);
        }
        Err(_) => {
            ctx.stats.idle_closed.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// A connection task's waker for its idle check and shutdown signal: notes that one of them
/// fired, then wakes the task.
struct SideWaker {
    woken: std::sync::atomic::AtomicBool,
    task: atomic_waker::AtomicWaker,
}

impl std::task::Wake for SideWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        self.task.wake();
    }
}

/// The answer to anything but a health path on a connection served beyond the cap.
fn at_capacity() -> axum::response::Response {
    use axum::response::IntoResponse;
    (
        http::StatusCode::SERVICE_UNAVAILABLE,
        [
            (http::header::RETRY_AFTER, "1"),
            (http::header::CONNECTION, "close"),
        ],
        axum::Json(serde_json::json!({
            "error": "connection limit reached: only /healthz and /readyz are served on this connection; retry later"
        })),
    )
        .into_response()
}

/// Serves `router` on `listener` until `shutdown` resolves: over TLS when `tls` is given,
/// plain HTTP otherwise, with the default connection limits ([`ServeLimits`]:
/// header and idle timeouts, a connection cap with room for health probes). Handlers can
/// extract `ConnectInfo<Peer>` either way. [`serve_with`] takes other limits.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    tls: Option<Arc<ReloadingServerConfig>>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_with(
        listener,
        router,
        tls,
        ServeLimits::default(),
        Default::default(),
        shutdown,
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts() {
        let a = Activity::new();
        // A silent new connection: its first head is awaited from the accept.
        assert_eq!(a.verdict(1000, 1000), Verdict::Fine);
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(a.verdict(1, 1000), Verdict::HeaderTimeout);
        // A request in flight is never cut, however long it takes.
        a.request_started(false);
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(a.verdict(1, 1), Verdict::Fine);
        a.request_done();
        // Idle between requests: the idle bound, not the header one.
        assert_eq!(a.verdict(1, 1000), Verdict::Fine);
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(a.verdict(1, 1), Verdict::Idle);
        // The first byte of the next head starts the header clock.
        a.read();
        assert_eq!(a.verdict(1000, 1), Verdict::Fine);
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(a.verdict(1, 1000), Verdict::HeaderTimeout);
        // HTTP/2: once its first request came, what it reads between requests (flow control,
        // pings) keeps it from idling and starts no header clock.
        let a = Activity::new();
        a.request_started(true);
        a.request_done();
        std::thread::sleep(Duration::from_millis(5));
        a.read();
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(a.verdict(1, 1000), Verdict::Fine);
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(a.verdict(1000, 1), Verdict::Idle);
    }

    /// The serving function `rlc serve` calls ([`serve`], default limits) cuts a
    /// connection that never sends its request head after the default header timeout, and
    /// keeps answering requests meanwhile.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_default_serve_cuts_a_silent_connection_and_keeps_serving() {
        use std::io::{Read, Write};
        let router = Router::new().route("/healthz", axum::routing::get(|| async { "ok" }));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(listener, router, None, async {
            let _ = stopped.await;
        }));
        let (cut_after, answered) = tokio::task::spawn_blocking(move || {
            let start = std::time::Instant::now();
            let mut silent = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
            silent
                .set_read_timeout(Some(Duration::from_millis(200)))
                .unwrap();
            let mut answered = 0;
            let mut b = [0u8; 64];
            // A hang guard of three header timeouts, not a speed claim.
            while start.elapsed() < Duration::from_secs(30) {
                let cut = match silent.read(&mut b) {
                    Ok(_) => true,
                    Err(e) => !matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ),
                };
                if cut {
                    return (Some(start.elapsed()), answered);
                }
                let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
                s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    .unwrap();
                let mut out = String::new();
                let _ = s.read_to_string(&mut out);
                answered += out.starts_with("HTTP/1.1 200") as usize;
            }
            (None, answered)
        })
        .await
        .unwrap();
        let cut_after = cut_after.expect("the silent connection was never cut");
        assert!(
            cut_after >= Duration::from_secs(9),
            "cut after {cut_after:?}, before the header timeout"
        );
        assert!(answered > 10, "requests answered meanwhile: {answered}");
        let _ = stop.send(());
        server.await.unwrap().unwrap();
    }
}
