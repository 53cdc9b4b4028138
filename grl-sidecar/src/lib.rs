//! `grl sidecar`: an inbound reverse proxy in front of one service instance, whatever its
//! language. Every request is decided by the GRL client before it reaches the instance, with
//! the decide path of `GrlLayer` (`grl_client::layer::GrlLayer::decide_at`, the clock read per request): the caller and the
//! procedure are read from the request ([`identity`]), a drop is answered by the sidecar
//! (HTTP 429 with `Retry-After` and the `RateLimit-Policy` / `RateLimit` headers, or for gRPC
//! `RESOURCE_EXHAUSTED` with `grpc-retry-pushback-ms`), everything else goes to the upstream
//! ([`upstream`]) with its body streamed both ways and its trailers passed through.
//!
//! One port serves HTTP/1.1 and HTTP/2 without TLS (h2c, prior knowledge, as gRPC clients
//! send it); gRPC goes upstream over h2c, everything else over HTTP/1.1. It serves through the serving loop of every daemon (`grl_server::server`: header and idle
//! timeouts, a connection cap below the open-file limit, graceful drain); with `--tls-cert` it
//! terminates TLS (HTTP/1.1 and HTTP/2, offered by ALPN: gRPC over TLS), and with `--tls-client-ca` the names of the verified client
//! certificate name the caller. The admin listener answers `/metrics`, `/healthz` and
//! `/readyz`. Without an answer from the aggregators the client fails open, as an embedded
//! one does.

#![warn(missing_docs)]

mod forward;
mod h2c;
pub mod identity;
mod metrics;
pub mod upstream;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use axum::body::Body;
use axum::extract::State;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use grl_client::client::{ClientOptions, GrlClient};
use grl_client::concurrency::ConcurrencyLimiter;
use grl_client::layer::GrlLayer;
use grl_client::tiers::TierFrom;
use grl_core::Decision;
use http::{HeaderName, HeaderValue, Method, Request, Response, StatusCode, Version};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use schema::Criticality;

use forward::{add_forwarded_for, join_cookies, strip_hop_by_hop};
use grl_server::http_util::{Readiness, ServerHandle};
use grl_server::server::{ServeLimits, ServerStats};
use grl_server::tls::{Peer, ServerTls};
use identity::{is_grpc, CallerFrom, ProcedureFrom};
use upstream::{Clients, Upstream, UpstreamError};

/// How the sidecar runs.
#[derive(Debug, Clone)]
pub struct SidecarOptions {
    /// Where callers connect.
    pub listen: SocketAddr,
    /// The service instance.
    pub upstream: Upstream,
    /// The GRL client: the service, the aggregators (failover in order), the report credential,
    /// how the aggregators are verified.
    pub client: ClientOptions,
    /// The zone and region the instance runs in (logs, `grl_sidecar_info`).
    pub zone: String,
    /// The region.
    pub region: String,
    /// `/metrics`, `/healthz`, `/readyz` (None: not served).
    pub admin_listen: Option<SocketAddr>,
    /// TLS terminated by the sidecar (its client CA: mutual TLS, the caller from the
    /// certificate).
    pub tls: Option<ServerTls>,
    /// Where the caller comes from.
    pub caller: CallerFrom,
    /// Where the procedure comes from.
    pub procedure: ProcedureFrom,
    /// Where a request's criticality tier comes from (and the callers' caps).
    pub tiers: TierFrom,
    /// The limit on requests in flight to the upstream and its queue (off by default).
    pub concurrency: grl_client::concurrency::Options,
    /// `Retry-After` seconds of a refusal (`grpc-retry-pushback-ms` is the same in ms).
    pub retry_after_secs: u64,
    /// The upstream must answer a request's head within this (then 504, or gRPC
    /// `DEADLINE_EXCEEDED`); bodies stream for as long as they last.
    pub upstream_timeout: Duration,
    /// A connection to the upstream must open within this (then 502, gRPC `UNAVAILABLE`).
    pub connect_timeout: Duration,
    /// Connections and timeouts of the main listener.
    pub serve: ServeLimits,
    /// Largest request head (HTTP/1.1 buffer, HTTP/2 header list).
    pub max_header_bytes: usize,
    /// Threads serving the connections, each a single-threaded runtime with its own upstream
    /// pools (see `grl_server::server::Workers`); None: one per core; 0: none (the connections are
    /// served on the runtime `start` is called on, with one shared pair of pools).
    pub workers: Option<usize>,
}

impl SidecarOptions {
    /// Defaults around the required parts.
    pub fn new(listen: SocketAddr, upstream: Upstream, client: ClientOptions) -> SidecarOptions {
        SidecarOptions {
            listen,
            upstream,
            client,
            zone: String::new(),
            region: String::new(),
            admin_listen: None,
            tls: None,
            caller: CallerFrom::default(),
            procedure: ProcedureFrom::default(),
            tiers: TierFrom::default(),
            concurrency: grl_client::concurrency::Options::default(),
            retry_after_secs: 1,
            upstream_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(5),
            serve: ServeLimits::default(),
            max_header_bytes: DEFAULT_MAX_HEADER_BYTES,
            workers: None,
        }
    }
}

/// Default bound of a request head.
pub const DEFAULT_MAX_HEADER_BYTES: usize = 64 << 10;

/// What the sidecar counted (read at scrape time; a histogram for the added latency).
#[derive(Debug, Default)]
struct Stats {
    /// [protocol: http, grpc][decision: admit, drop, shadow_drop].
    requests: [[AtomicU64; 3]; 2],
    /// Refusals the sidecar answered itself: rate_limited, upstream_unreachable,
    /// upstream_timeout, connection_share, overloaded.
    refusals: [AtomicU64; 5],
    /// Upstream failures: connect, timeout, other.
    upstream_errors: [AtomicU64; 3],
    /// Requests refused as malformed (400): target, body, identity.
    bad_requests: [AtomicU64; 3],
    /// Upstream answer heads received (the upstream's sign of life).
    answers: AtomicU64,
    /// When the readiness probe's `OPTIONS *` was last answered (ms since the epoch).
    answered_ms: AtomicU64,
    /// When a request sent upstream last timed out without any answer arriving from the
    /// upstream during its whole wait (ms since the epoch): the upstream stopped answering.
    silent_ms: AtomicU64,
    /// `answers` when it was found silent: an answer since ends the silence.
    silent_answers: AtomicU64,
}

/// Why a request was refused as malformed (an index of `Stats::bad_requests`).
#[derive(Debug, Clone, Copy)]
enum BadRequest {
    /// A target no upstream would read as meant.
    Target = 0,
    /// A request body that ended early or is malformed (a bad chunk size).
    Body = 1,
    /// An identity header given twice.
    Identity = 2,
}

const PROTOCOLS: [&str; 2] = ["http", "grpc"];
const DECISIONS: [&str; 3] = ["admit", "drop", "shadow_drop"];
const REFUSALS: [&str; 5] = [
    "rate_limited",
    "upstream_unreachable",
    "upstream_timeout",
    "connection_share",
    "overloaded",
];
/// The index of `overloaded` in [`REFUSALS`].
const OVERLOADED: usize = 4;

/// One caller connection's share of the upstream slots: this fraction of them (and at least
/// [`MIN_SHARE`]), so that a few connections holding answers they never read cannot take every
/// slot.
const SHARE_DIVISOR: usize = 16;
/// The smallest share of the upstream slots per caller connection.
const MIN_SHARE: usize = 8;
const UPSTREAM_ERRORS: [&str; 3] = ["connect", "timeout", "other"];
const BAD_REQUESTS: [&str; 3] = ["target", "body", "identity"];

/// Buckets (seconds) of the added-latency histogram: 10 µs … 50 ms.
const ADDED_LATENCY_BUCKETS: [f64; 12] = [
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
];

struct Shared {
    layer: GrlLayer,
    client: GrlClient,
    /// Upstream pools: one per worker thread (`grl_server::server::worker_index`), the last for
    /// requests served elsewhere.
    clients: Vec<Clients>,
    authority: http::uri::Authority,
    upstream: Upstream,
    caller: CallerFrom,
    procedure: ProcedureFrom,
    retry_after: HeaderValue,
    pushback_ms: HeaderValue,
    retry_after_secs: u64,
    upstream_timeout: Duration,
    connect_timeout: Duration,
    stats: Arc<Stats>,
    added: Histogram,
    registry: Registry,
    /// `--concurrency-limit` (None: off).
    concurrency: Option<Arc<ConcurrencyLimiter>>,
}

/// A running sidecar: the main listener's handle (drain on shutdown) and the admin address.
pub struct SidecarHandle {
    /// The main listener; its shutdown drains the connections, then stops the admin listener
    /// and the client.
    pub server: ServerHandle,
    /// Where `/metrics`, `/healthz` and `/readyz` are served.
    pub admin_addr: Option<SocketAddr>,
}

/// Starts the sidecar: the GRL client, the upstream pools, the main and the admin listeners.
pub async fn start(opts: SidecarOptions) -> anyhow::Result<SidecarHandle> {
    check_aggregators(&opts)?;
    let tls = opts
        .tls
        .as_ref()
        // h2 by ALPN as well: gRPC clients over TLS.
        .map(|t| grl_server::tls::ReloadingServerConfig::load_alpn(t, true))
        .transpose()?;
    let scheme = if tls.is_some() { "https" } else { "http" };
    let listener = tokio::net::TcpListener::bind(opts.listen)
        .await
        .with_context(|| format!("bind {}", opts.listen))?;
    let addr = listener.local_addr()?;
    let admin = match opts.admin_listen {
        Some(a) => Some(
            tokio::net::TcpListener::bind(a)
                .await
                .with_context(|| format!("bind the admin listener {a}"))?,
        ),
        None => None,
    };
    let admin_addr = admin.as_ref().map(|l| l.local_addr()).transpose()?;

    let client = GrlClient::start(opts.client.clone());
    let server_stats = Arc::new(ServerStats::default());
    let workers = start_workers(opts.workers)?;
    // Every caller connection may hold an upstream connection (an HTTP/1.1 request in flight
    // holds one; an HTTP/2 caller's requests share the slots), and the pools keep idle ones, as
    // many in all as the cap at most: three descriptors per connection are budgeted (the
    // caller's, one in use upstream, one idle), and the requests in flight upstream are as
    // many as the caller connections allowed (one waits for a slot within the upstream
    // timeout).
    let pools = workers.as_ref().map_or(0, |w| w.len()) + 1;
    let serve = grl_server::server::fit_to_fd_limit(opts.serve, 3);
    let clients = upstream_pools(&opts, pools, serve.max_connections);
    let shared = Arc::new(Shared::new(&opts, client, clients, &server_stats));
    let conn = grl_server::server::ConnOptions {
        h2c: true,
        max_header_bytes: Some(opts.max_header_bytes),
        workers,
        slots_per_connection: Some((serve.max_connections / SHARE_DIVISOR).max(MIN_SHARE)),
    };
    let (stop, server) = spawn_proxy(listener, shared.clone(), tls, serve, server_stats, conn);
    // The admin listener lives until the main one has drained: /metrics shows the drain.
    let admin_server = admin.map(|l| spawn_admin(l, shared.clone(), opts.serve));
    let (finish, finished) = tokio::sync::oneshot::channel::<()>();
    let background = tokio::spawn(async move {
        let _ = finished.await;
        if let Some((stop, server)) = admin_server {
            let _ = stop.send(());
            let _ = server.await;
        }
        drop(shared);
    });
    tracing::info!(
        %addr,
        scheme,
        admin = ?admin_addr,
        service = %opts.client.service,
        zone = %opts.zone,
        region = %opts.region,
        upstream = %opts.upstream.describe(),
        "sidecar listening (HTTP/1.1 and h2c)"
    );
    Ok(SidecarHandle {
        server: ServerHandle {
            addr,
            scheme,
            stop,
            server,
            finish,
            background,
            health: None,
        },
        admin_addr,
    })
}

/// Refuses options without an aggregator, and warns of reports that will be refused (no
/// credential) or sent in plain HTTP.
fn check_aggregators(opts: &SidecarOptions) -> anyhow::Result<()> {
    anyhow::ensure!(
        !opts.client.aggregators.is_empty(),
        "a sidecar needs at least one aggregator URL"
    );
    if opts.client.report_token.is_none() {
        tracing::warn!("no report credential (GRL_CLIENT_TOKEN or GRL_CLIENT_TOKEN_FILE): aggregators refuse the reports and the sidecar admits everything");
    }
    grl_client::tls::warn_plain_http(
        "aggregator URL",
        opts.client.aggregators.iter().map(String::as_str),
    );
    Ok(())
}

impl Shared {
    /// The state every request reads: `client`, the upstream pools `clients` and the
    /// sidecar's metrics (the server's `server_stats` among them).
    fn new(
        opts: &SidecarOptions,
        client: GrlClient,
        clients: Vec<Clients>,
        server_stats: &Arc<ServerStats>,
    ) -> Shared {
        let stats = Arc::new(Stats::default());
        let concurrency = ConcurrencyLimiter::new(opts.concurrency.clone());
        let (registry, added) = registry(opts, &client, &stats, server_stats, &concurrency);
        Shared {
            layer: GrlLayer::for_client(&client).tiers_from(opts.tiers.clone()),
            client,
            clients,
            authority: opts.upstream.authority(),
            upstream: opts.upstream.clone(),
            caller: opts.caller.clone(),
            procedure: opts.procedure.clone(),
            retry_after: HeaderValue::from(opts.retry_after_secs),
            pushback_ms: HeaderValue::from(opts.retry_after_secs.saturating_mul(1000)),
            retry_after_secs: opts.retry_after_secs,
            upstream_timeout: opts.upstream_timeout,
            connect_timeout: opts.connect_timeout,
            stats,
            added,
            registry,
            concurrency,
        }
    }
}

/// A spawned task and the sender that tells it to stop.
type Stoppable = (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
);

/// Serves the main listener until the returned sender fires (or is dropped): every request
/// goes to [`proxy`], without a router.
fn spawn_proxy(
    listener: tokio::net::TcpListener,
    shared: Arc<Shared>,
    tls: Option<Arc<grl_server::tls::ReloadingServerConfig>>,
    serve: ServeLimits,
    server_stats: Arc<ServerStats>,
    conn: grl_server::server::ConnOptions,
) -> Stoppable {
    let proxy = grl_server::server::Handler::Direct(Arc::new(
        move |req: Request<hyper::body::Incoming>, peer: &Peer| {
            Box::pin(proxy(shared.clone(), peer.clone(), req.map(Body::new)))
                as grl_server::server::DirectFuture
        },
    ));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        let r = grl_server::server::serve_with_options(
            listener,
            proxy,
            tls,
            serve,
            server_stats,
            conn,
            async {
                let _ = stopped.await;
            },
        )
        .await;
        if let Err(e) = r {
            tracing::error!(error = %e, "sidecar server failed");
        }
    });
    (stop, server)
}

/// The sidecar's metrics: the client's, the server's, the sidecar's counters and info, and
/// the added-latency histogram (returned: every request observes it).
fn registry(
    opts: &SidecarOptions,
    client: &GrlClient,
    stats: &Arc<Stats>,
    server_stats: &Arc<ServerStats>,
    concurrency: &Option<Arc<ConcurrencyLimiter>>,
) -> (Registry, Histogram) {
    let mut registry = Registry::default();
    grl_client::metrics::register_build_info(&mut registry, "grl", "sidecar");
    registry.register_collector(Box::new(client.metrics()));
    server_stats.register(&mut registry);
    registry.register_collector(Box::new(metrics::StatsCollector {
        stats: stats.clone(),
        concurrency: concurrency.clone(),
        info: [
            ("service", opts.client.service.clone()),
            ("zone", opts.zone.clone()),
            ("region", opts.region.clone()),
            ("upstream", opts.upstream.describe()),
        ],
    }));
    let added = Histogram::new(ADDED_LATENCY_BUCKETS);
    registry.register(
        "grl_sidecar_added_latency_seconds",
        "Time a request spends in the sidecar before it is sent upstream or refused (reading the caller and procedure, the decision, building the upstream request)",
        added.clone(),
    );
    (registry, added)
}

/// The worker threads: one per CPU by default, none for `Some(0)` (all on the runtime).
fn start_workers(workers: Option<usize>) -> anyhow::Result<Option<grl_server::server::Workers>> {
    let workers = match workers {
        None => Some(std::thread::available_parallelism().map_or(1, |n| n.get())),
        Some(0) => None,
        Some(n) => Some(n),
    };
    workers
        .map(|n| grl_server::server::Workers::start(n, "grl-sidecar"))
        .transpose()
        .context("start the worker threads")
}

/// One upstream pool per worker and one for the runtime, sharing `max_connections` slots;
/// the idle connections kept are as many in all as the slots at most.
fn upstream_pools(opts: &SidecarOptions, pools: usize, max_connections: usize) -> Vec<Clients> {
    let max_idle = (max_connections / pools).min(crate::upstream::MAX_IDLE);
    let slots = Arc::new(tokio::sync::Semaphore::new(max_connections));
    (0..pools)
        .map(|_| {
            Clients::with_slots(
                opts.upstream.clone(),
                opts.connect_timeout,
                opts.serve.idle_timeout,
                slots.clone(),
                max_idle,
            )
        })
        .collect()
}

/// Serves `/metrics`, `/healthz` and `/readyz` on the admin listener.
fn spawn_admin(l: tokio::net::TcpListener, shared: Arc<Shared>, serve: ServeLimits) -> Stoppable {
    let router = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(grl_server::http_util::healthz))
        .route("/readyz", get(readyz))
        .with_state(shared);
    let limits = ServeLimits {
        max_connections: 64,
        health_connections: 4,
        ..serve
    };
    grl_server::http_util::spawn_server(
        l,
        router,
        None,
        limits,
        Default::default(),
        "sidecar admin",
    )
}

async fn metrics(State(s): State<Arc<Shared>>) -> impl IntoResponse {
    grl_server::metrics::response(&s.registry)
}

/// How long a request that timed out without any answer from the upstream keeps `/readyz`
/// at 503, unless an answer (or the probe's) comes first.
const SILENT_HOLD_MS: u64 = 30_000;

/// Ready when the upstream accepts a connection and answers: after a request timed out with no
/// answer from the upstream during its whole wait (it accepts connections and answers nothing),
/// not ready until an answer arrives (a request's, or the `OPTIONS *` this probe then sends)
/// or for [`SILENT_HOLD_MS`]. The aggregators are not a condition (the client fails open
/// without them), their state is a detail.
async fn readyz(State(s): State<Arc<Shared>>) -> Readiness {
    let wait = s.connect_timeout.min(Duration::from_secs(2));
    let up = match s.upstream.connect(wait).await {
        Ok(_) => match silent_for(&s).await {
            None => Ok(s.upstream.describe()),
            Some(ago) => Err(format!(
                "{}: accepts connections but answered nothing: a request waited {} ms for it \
                 {:.1} s ago, and `OPTIONS *` got no answer within {} ms",
                s.upstream.describe(),
                s.upstream_timeout.as_millis(),
                ago as f64 / 1000.0,
                wait.as_millis(),
            )),
        },
        Err(e) => Err(format!("{}: {e}", s.upstream.describe())),
    };
    let st = s.client.stats();
    let agg = if st.stale.load(Ordering::Relaxed) {
        "failing open: no fresh drop ratios from the aggregators".to_string()
    } else {
        "drop ratios fresh".to_string()
    };
    Readiness::from_checks([("upstream", up), ("aggregators", Ok(agg))])
}

/// How long ago (ms) the upstream was last found silent, when no answer came since and that
/// was within [`SILENT_HOLD_MS`]; before saying so, `OPTIONS *` is sent over HTTP/1.1 (any
/// answer, even 4xx or 5xx, shows the upstream answers again).
async fn silent_for(s: &Shared) -> Option<u64> {
    let now = grl_core::now_ms();
    let silent = s.stats.silent_ms.load(Ordering::Relaxed);
    if silent == 0
        || s.stats.answers.load(Ordering::Relaxed) > s.stats.silent_answers.load(Ordering::Relaxed)
        || s.stats.answered_ms.load(Ordering::Relaxed) >= silent
        || now.saturating_sub(silent) >= SILENT_HOLD_MS
    {
        return None;
    }
    let mut req = Request::new(Body::empty());
    *req.method_mut() = Method::OPTIONS;
    *req.uri_mut() = http::Uri::from_static("*");
    if let Ok(v) = HeaderValue::from_str(s.authority.as_str()) {
        req.headers_mut().insert(http::header::HOST, v);
    }
    let pool = &s.clients.last().expect("one pool at least").h1;
    let wait = s.connect_timeout.min(Duration::from_secs(2));
    match tokio::time::timeout(wait, pool.request(req)).await {
        Ok(Ok(_)) => {
            s.stats.answered_ms.fetch_max(now, Ordering::Relaxed);
            None
        }
        _ => Some(now.saturating_sub(silent)),
    }
}

/// The request target passed upstream: the path and query (`/` when there is none), or `*`
/// for `OPTIONS`; `None` for anything else (`CONNECT`, `*` for another method, an HTTP/2
/// `:path` that starts with `?`: no request line an HTTP/1.1 upstream reads as meant).
fn origin_form(
    method: &Method,
    pq: Option<&http::uri::PathAndQuery>,
) -> Option<http::uri::PathAndQuery> {
    if method == Method::CONNECT {
        return None;
    }
    match pq {
        None => Some(http::uri::PathAndQuery::from_static("/")),
        Some(p) if p.as_str().starts_with('/') => Some(p.clone()),
        Some(p) if p.as_str() == "*" && method == Method::OPTIONS => Some(p.clone()),
        Some(_) => None,
    }
}

/// Every request: decide, then refuse or forward.
async fn proxy(s: Arc<Shared>, peer: Peer, req: Request<Body>) -> Response<Body> {
    let start = Instant::now();
    // A target no upstream would read as meant is refused before it is decided (and counted).
    let Some(path) = origin_form(req.method(), req.uri().path_and_query()) else {
        return bad_request(&s, BadRequest::Target, "bad request target\n");
    };
    // gRPC is HTTP/2: over HTTP/1.1 the content type is the caller's word only, and would
    // choose its procedure key (the raw path) and its upstream protocol.
    let grpc = req.version() == Version::HTTP_2 && is_grpc(req.headers());
    // The answer goes out in the sidecar's own version (RFC 9112 §2.3), whatever the
    // upstream's: an HTTP/1.0 upstream's version would close every caller's connection.
    // hyper answers an HTTP/1.0 caller in HTTP/1.0 by itself.
    let answer_version = if req.version() == Version::HTTP_2 {
        Version::HTTP_2
    } else {
        Version::HTTP_11
    };
    let mut tier = Criticality::Critical;
    if let Some(refused) = decide(&s, &peer, &req, grpc, start, &mut tier) {
        return refused;
    }
    let (mut parts, body) = req.into_parts();
    if let Some(bad) = upstream_head(&s, &peer, &mut parts, path, grpc) {
        return bad;
    }
    // A small body of a declared length is read whole first, so that the head and the body
    // are passed on together rather than the head first and the body after a wake-up of the
    // other side (not measured on its own: the instruction counts fell with the pool and the
    // header handling). gRPC and longer or chunked bodies stream.
    let small_request = !grpc && is_small(&body);
    close_after_stray_body(&mut parts, &body, grpc);
    let clients = worker_clients(&s);
    s.added.observe(start.elapsed().as_secs_f64());
    // The upstream timeout bounds the whole exchange up to the answer's head (and a small
    // answer's body): a small request body that arrives too slowly times out as the upstream
    // waiting for it would.
    // The connection's share of the upstream slots: a request beyond it waits for one of its
    // connection's requests to end, within the upstream timeout (503 after: the caller's
    // connection holds too much, not the upstream's fault).
    // An HTTP/1.1 connection has one request at a time: only HTTP/2 ones can reach the share.
    let share = match peer
        .share
        .as_ref()
        .filter(|_| answer_version == Version::HTTP_2)
    {
        None => None,
        Some(c) => match c.slots.try_acquire() {
            Ok(p) => Some(Share::hold(c, p)),
            Err(_) => match tokio::time::timeout(s.upstream_timeout, c.slots.acquire()).await {
                Ok(Ok(p)) => Some(Share::hold(c, p)),
                _ => return share_in_use(&s, grpc),
            },
        },
    };
    // Whether the request went upstream (its body read), and the upstream's answers before.
    let sent = std::sync::atomic::AtomicBool::new(false);
    let answers_before = s.stats.answers.load(Ordering::Relaxed);
    let exchange = async {
        let body = if small_request {
            whole(body).await.map_err(Failed::RequestBody)?
        } else {
            body
        };
        // Under `--concurrency-limit`: a slot once the request is ready to go (its
        // connection's share held, a small body read), kept until the answer's head (a small
        // answer's body) arrived, its latency the gradient's sample; or 503 after the
        // queue's timeout.
        let _slot = match &s.concurrency {
            None => None,
            Some(c) => match c.acquire(tier).await {
                Ok(p) => Some(p),
                Err(_) => return Ok(overloaded(&s, grpc)),
            },
        };
        sent.store(true, Ordering::Relaxed);
        let req = Request::from_parts(parts, body);
        let resp = if grpc {
            let r = clients.h2_for(peer.share.as_deref()).request(req).await;
            r.map(|r| r.map(Body::new))
        } else {
            let r = clients.h1.request(req).await;
            r.map(|r| r.map(Body::new))
        };
        let (mut parts, body) = resp.map_err(Failed::Upstream)?.into_parts();
        s.stats.answers.fetch_add(1, Ordering::Relaxed);
        parts.version = answer_version;
        strip_hop_by_hop(&mut parts.headers);
        // A small answer is read whole, freeing its upstream slot and the connection's share
        // at once; a longer one holds both until its body ends.
        let body = if !grpc && is_small(&body) {
            whole(body).await.map_err(Failed::ResponseBody)?
        } else {
            match share {
                Some(permit) => Body::new(Holding {
                    inner: body,
                    _permit: permit,
                }),
                None => body,
            }
        };
        Ok(Response::from_parts(parts, body))
    };
    match tokio::time::timeout(s.upstream_timeout, exchange).await {
        Ok(Ok(resp)) => resp,
        Ok(Err(failed)) => exchange_failed(&s, grpc, failed),
        Err(_) => upstream_timed_out(&s, grpc, sent.load(Ordering::Relaxed), answers_before),
    }
}

/// Decides the request by its caller and procedure (counted); `Some` is the answer to a
/// refused one (its added latency observed) or to one whose identity header came twice.
/// Not a `Result`: the answer is large, and boxing it would allocate per refusal.
#[inline]
fn decide(
    s: &Shared,
    peer: &Peer,
    req: &Request<Body>,
    grpc: bool,
    start: Instant,
    tier_out: &mut Criticality,
) -> Option<Response<Body>> {
    // Two values of an identity header: which one names the request is a guess.
    let (Some(caller), Some(procedure)) = (
        s.caller.caller_checked(&peer.cert_names, req.headers()),
        s.procedure
            .procedure_checked(grpc, req.method(), req.uri().path(), req.headers()),
    ) else {
        return Some(bad_request(
            s,
            BadRequest::Identity,
            "identity header given twice\n",
        ));
    };
    let tier = s.layer.tier_of(req.headers(), caller);
    if s.concurrency.is_some() {
        // The queue's tier under the bucket file's caps too (the decision applies them).
        *tier_out = s.layer.capped(tier, caller);
    }
    let d = s
        .layer
        .decide_tier_at(caller, &procedure, tier, grl_core::now_ms());
    if d == Decision::Drop {
        let resp = refusal(s, grpc, caller, &procedure);
        count(s, grpc, d);
        s.stats.refusals[0].fetch_add(1, Ordering::Relaxed);
        s.added.observe(start.elapsed().as_secs_f64());
        return Some(resp);
    }
    count(s, grpc, d);
    None
}

/// The request's head as the upstream gets it: hop-by-hop headers gone, the caller passed
/// on, `X-Forwarded-For` added; gRPC in HTTP/2 to the upstream's authority, everything
/// else in HTTP/1.1 origin form with a Host header. `Some` answers a target that makes no
/// URI (not a `Result`, as for [`decide`]).
#[inline]
fn upstream_head(
    s: &Shared,
    peer: &Peer,
    parts: &mut http::request::Parts,
    path: http::uri::PathAndQuery,
    grpc: bool,
) -> Option<Response<Body>> {
    strip_hop_by_hop(&mut parts.headers);
    s.caller.pass_on(&peer.cert_names, &mut parts.headers);
    add_forwarded_for(&mut parts.headers, peer.addr.ip());
    // gRPC goes upstream over HTTP/2 (h2c), everything else over HTTP/1.1, which every
    // application server speaks (an HTTP/2 caller's authority becomes the Host header).
    if parts.version == Version::HTTP_2 && !grpc && !parts.headers.contains_key(http::header::HOST)
    {
        if let Some(v) = parts
            .uri
            .authority()
            .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
        {
            parts.headers.insert(http::header::HOST, v);
        }
    }
    if grpc {
        parts.uri = match http::Uri::builder()
            .scheme("http")
            .authority(s.authority.clone())
            .path_and_query(path)
            .build()
        {
            Ok(u) => u,
            Err(_) => return Some(bad_request(s, BadRequest::Target, "bad request target\n")),
        };
        parts.version = Version::HTTP_2;
    } else {
        // Origin form, and a Host header (an HTTP/1.0 caller may send none); an HTTP/2
        // caller's cookies in one line.
        if parts.version == Version::HTTP_2 {
            join_cookies(&mut parts.headers);
        }
        parts.uri = http::Uri::from(path);
        parts.version = Version::HTTP_11;
        if !parts.headers.contains_key(http::header::HOST) {
            if let Ok(v) = HeaderValue::from_str(s.authority.as_str()) {
                parts.headers.insert(http::header::HOST, v);
            }
        }
    }
    None
}

/// A body on a method whose body has no meaning: servers that ignore it but keep the
/// connection would read it as their next request, one the sidecar never decided. Its
/// upstream connection is closed after the answer instead of reused.
#[inline]
fn close_after_stray_body(parts: &mut http::request::Parts, body: &Body, grpc: bool) {
    if !grpc && is_bodiless(&parts.method) && !hyper::body::Body::is_end_stream(body) {
        parts
            .headers
            .insert(http::header::CONNECTION, HeaderValue::from_static("close"));
    }
}

/// This worker's pools: the upstream connection is driven on this thread too.
#[inline]
fn worker_clients(s: &Shared) -> &Clients {
    grl_server::server::worker_index()
        .and_then(|i| s.clients.get(i))
        .unwrap_or_else(|| s.clients.last().expect("one pool at least"))
}

/// 503: the caller's connection has its share of the upstream slots in use beyond the
/// upstream timeout.
fn share_in_use(s: &Shared, grpc: bool) -> Response<Body> {
    s.stats.refusals[3].fetch_add(1, Ordering::Relaxed);
    let mut r = upstream_failure(
        grpc,
        StatusCode::SERVICE_UNAVAILABLE,
        14,
        "this connection has its share of the upstream slots in use; \
         read its answers or use another connection",
    );
    r.headers_mut()
        .insert(http::header::RETRY_AFTER, s.retry_after.clone());
    r
}

/// The answer to an exchange that failed within the upstream timeout.
fn exchange_failed(s: &Shared, grpc: bool, failed: Failed) -> Response<Body> {
    match failed {
        Failed::RequestBody(e) => {
            tracing::debug!(error = %e, "the caller's request body failed");
            bad_request(s, BadRequest::Body, "the request body ended early\n")
        }
        // A streamed body the caller malformed (a bad chunk size) fails the upstream request:
        // the caller's fault, answered 400 as nginx does, never an upstream error (whose 5xx
        // alerts any caller could set off).
        Failed::Upstream(e) if e.is_caller_body() => {
            tracing::debug!(error = %e, "the caller's request body failed on its way upstream");
            bad_request(s, BadRequest::Body, "malformed request body\n")
        }
        Failed::Upstream(e) => {
            let cause = grl_client::cause::describe_error(&e, s.connect_timeout);
            upstream_unreachable(s, grpc, e.is_connect(), &cause)
        }
        Failed::ResponseBody(e) => {
            tracing::debug!(error = %e, "upstream answer's body failed");
            upstream_unreachable(s, grpc, false, "the answer's body ended early")
        }
    }
}

/// 504: the upstream did not answer within the upstream timeout.
fn upstream_timed_out(s: &Shared, grpc: bool, sent: bool, answers_before: u64) -> Response<Body> {
    // Nothing at all came from the upstream while this request waited for it: it
    // stopped answering (`/readyz` says so), not merely slow on one request.
    if sent && s.stats.answers.load(Ordering::Relaxed) == answers_before {
        s.stats
            .silent_answers
            .store(answers_before, Ordering::Relaxed);
        s.stats
            .silent_ms
            .fetch_max(grl_core::now_ms(), Ordering::Relaxed);
    }
    s.stats.upstream_errors[1].fetch_add(1, Ordering::Relaxed);
    s.stats.refusals[2].fetch_add(1, Ordering::Relaxed);
    upstream_failure(
        grpc,
        StatusCode::GATEWAY_TIMEOUT,
        4,
        &format!(
            "upstream did not answer within {} ms",
            s.upstream_timeout.as_millis()
        ),
    )
}

/// One of a caller connection's share of the upstream slots, given back when dropped.
struct Share(Arc<grl_server::tls::ConnShare>);

impl Share {
    fn hold(c: &Arc<grl_server::tls::ConnShare>, p: tokio::sync::SemaphorePermit<'_>) -> Share {
        p.forget();
        Share(c.clone())
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        self.0.slots.add_permits(1);
    }
}

/// Methods whose requests have no body meaning (RFC 9110 §9.3: GET, HEAD, DELETE, OPTIONS,
/// TRACE), which servers often leave unread.
fn is_bodiless(m: &Method) -> bool {
    [
        Method::GET,
        Method::HEAD,
        Method::DELETE,
        Method::OPTIONS,
        Method::TRACE,
    ]
    .contains(m)
}

/// An answer's body holding one of its connection's share of the upstream slots until it
/// ends or is dropped.
struct Holding {
    inner: Body,
    _permit: Share,
}

impl hyper::body::Body for Holding {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<bytes::Bytes>, axum::Error>>> {
        std::pin::Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// 400 for a malformed request, counted by reason.
fn bad_request(s: &Shared, why: BadRequest, text: &'static str) -> Response<Body> {
    s.stats.bad_requests[why as usize].fetch_add(1, Ordering::Relaxed);
    plain(StatusCode::BAD_REQUEST, text)
}

/// 502 (gRPC `UNAVAILABLE`) for an upstream that gave no whole answer, counted by kind
/// (`connect`: no connection; else `other`).
fn upstream_unreachable(s: &Shared, grpc: bool, connect: bool, cause: &str) -> Response<Body> {
    s.stats.upstream_errors[if connect { 0 } else { 2 }].fetch_add(1, Ordering::Relaxed);
    s.stats.refusals[1].fetch_add(1, Ordering::Relaxed);
    tracing::debug!(upstream = %s.upstream.describe(), error = %cause, "upstream failed");
    upstream_failure(
        grpc,
        StatusCode::BAD_GATEWAY,
        14,
        &format!("upstream unreachable: {cause}"),
    )
}

/// Bodies of a declared length up to this many bytes are read whole before they are passed
/// on (at most this much per request in flight); longer ones, chunked ones and gRPC stream.
pub const SMALL_BODY_BYTES: u64 = 16 << 10;

/// Whether a body is small enough to read whole: its length is declared (`Content-Length`,
/// which hyper gives as the body's exact size) and at most [`SMALL_BODY_BYTES`].
fn is_small(body: &Body) -> bool {
    use hyper::body::Body as _;
    body.size_hint()
        .exact()
        .is_some_and(|n| n <= SMALL_BODY_BYTES)
}

/// Why an exchange with the upstream failed.
enum Failed {
    /// The caller's (small) body did not arrive whole.
    RequestBody(axum::Error),
    /// No answer from the upstream.
    Upstream(UpstreamError),
    /// The upstream's (small) answer body did not arrive whole.
    ResponseBody(axum::Error),
}

/// A body read whole (its length declared and small: the caller checked), trailers kept; a
/// body of one frame (most) is passed on without a copy.
async fn whole(body: Body) -> Result<Body, axum::Error> {
    use http_body_util::BodyExt as _;
    use hyper::body::Body as _;
    let mut body = std::pin::pin!(body);
    let mut data: Option<bytes::Bytes> = None;
    let mut more: Option<bytes::BytesMut> = None;
    let mut trailers = None;
    while let Some(frame) = std::future::poll_fn(|cx| body.as_mut().poll_frame(cx)).await {
        match frame?.into_data() {
            Ok(d) => match (&mut data, &mut more) {
                (None, _) => data = Some(d),
                (Some(first), None) => {
                    let mut m = bytes::BytesMut::with_capacity(first.len() + d.len());
                    m.extend_from_slice(first);
                    m.extend_from_slice(&d);
                    more = Some(m);
                }
                (Some(_), Some(m)) => m.extend_from_slice(&d),
            },
            Err(frame) => {
                if let Ok(t) = frame.into_trailers() {
                    trailers = Some(t);
                }
            }
        }
    }
    let data = match more {
        Some(m) => m.freeze(),
        None => data.unwrap_or_default(),
    };
    Ok(match trailers {
        None => Body::from(data),
        Some(t) => Body::new(
            http_body_util::Full::new(data).with_trailers(std::future::ready(Some(Ok::<
                _,
                std::convert::Infallible,
            >(
                t
            )))),
        ),
    })
}

fn count(s: &Shared, grpc: bool, d: Decision) {
    let di = match d {
        Decision::Admit => 0,
        Decision::Drop => 1,
        Decision::ShadowDrop => 2,
    };
    s.stats.requests[usize::from(grpc)][di].fetch_add(1, Ordering::Relaxed);
}

fn plain(status: StatusCode, text: &'static str) -> Response<Body> {
    let mut r = Response::new(Body::from(text));
    *r.status_mut() = status;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

/// A gRPC answer without a body: the status in the headers (a "trailers-only" response).
fn grpc_status(code: u8, message: &str) -> Response<Body> {
    let mut r = Response::new(Body::empty());
    let h = r.headers_mut();
    h.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    h.insert("grpc-status", HeaderValue::from(u16::from(code)));
    // grpc-message is percent-encoded; ours is ASCII without `%`.
    let msg: String = message
        .chars()
        .map(|c| {
            if c.is_ascii_graphic() || c == ' ' {
                c
            } else {
                '?'
            }
        })
        .filter(|c| *c != '%')
        .collect();
    if let Ok(v) = HeaderValue::from_str(&msg) {
        h.insert("grpc-message", v);
    }
    r
}

fn upstream_failure(
    grpc: bool,
    status: StatusCode,
    grpc_code: u8,
    message: &str,
) -> Response<Body> {
    if grpc {
        return grpc_status(grpc_code, message);
    }
    let mut r = Response::new(Body::from(format!("{message}\n")));
    *r.status_mut() = status;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

/// The answer to a dropped request: gRPC `RESOURCE_EXHAUSTED` (code 8, which clients do not
/// retry on their own, unlike `UNAVAILABLE`) with `grpc-retry-pushback-ms`; HTTP 429 with
/// `Retry-After` and the IETF RateLimit headers naming the bucket, its quota per window and
/// nothing left.
fn refusal(s: &Shared, grpc: bool, caller: &str, procedure: &str) -> Response<Body> {
    if grpc {
        let mut r = grpc_status(8, "rate limited");
        r.headers_mut()
            .insert("grpc-retry-pushback-ms", s.pushback_ms.clone());
        return r;
    }
    let mut r = plain(StatusCode::TOO_MANY_REQUESTS, "rate limited\n");
    let h = r.headers_mut();
    h.insert(http::header::RETRY_AFTER, s.retry_after.clone());
    let table = s.layer.limiter().table();
    if let Some(b) = table.find(caller, procedure).map(|i| &table.buckets()[i]) {
        let (q, w) = quota_window(b.limit_rps);
        let name = sf_string(&b.name);
        if let Ok(v) = HeaderValue::from_str(&format!("{name};q={q};w={w}")) {
            h.insert(HeaderName::from_static("ratelimit-policy"), v);
        }
        if let Ok(v) = HeaderValue::from_str(&format!("{name};r=0;t={}", s.retry_after_secs)) {
            h.insert(HeaderName::from_static("ratelimit"), v);
        }
    }
    r
}

/// The answer to a request that found no slot under `--concurrency-limit`: HTTP 503 with
/// `Retry-After`, gRPC `UNAVAILABLE` with `grpc-retry-pushback-ms` (distinct from a quota's
/// 429 / `RESOURCE_EXHAUSTED`: the service is overloaded, not the caller over its share).
fn overloaded(s: &Shared, grpc: bool) -> Response<Body> {
    s.stats.refusals[OVERLOADED].fetch_add(1, Ordering::Relaxed);
    if grpc {
        let mut r = grpc_status(14, "overloaded");
        r.headers_mut()
            .insert("grpc-retry-pushback-ms", s.pushback_ms.clone());
        return r;
    }
    let mut r = plain(StatusCode::SERVICE_UNAVAILABLE, "overloaded\n");
    r.headers_mut()
        .insert(http::header::RETRY_AFTER, s.retry_after.clone());
    r
}

/// A limit in requests per second as a whole quota per window: `q` requests per `w` seconds.
fn quota_window(limit_rps: f64) -> (u64, u64) {
    if !limit_rps.is_finite() || limit_rps <= 0.0 {
        return (0, 1);
    }
    if limit_rps >= 1.0 {
        (limit_rps.round() as u64, 1)
    } else {
        (1, (1.0 / limit_rps).ceil() as u64)
    }
}

/// A structured-field string (RFC 8941): printable ASCII, `"` and `\` escaped.
fn sf_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            ' '..='~' => out.push(c),
            _ => out.push('_'),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_become_whole_quotas_per_window() {
        assert_eq!(quota_window(100.0), (100, 1));
        assert_eq!(quota_window(2.4), (2, 1));
        assert_eq!(quota_window(0.5), (1, 2));
        assert_eq!(quota_window(0.3), (1, 4));
        assert_eq!(quota_window(f64::NAN), (0, 1));
        assert_eq!(sf_string("gw.charge"), "\"gw.charge\"");
        assert_eq!(sf_string("a\"b\\c\u{e9}"), "\"a\\\"b\\\\c_\"");
    }

    #[test]
    fn only_an_origin_form_target_goes_upstream() {
        let pq = |s: &str| http::uri::PathAndQuery::try_from(s).unwrap();
        let ok = |m: Method, t: Option<&str>| {
            origin_form(&m, t.map(pq).as_ref()).map(|p| p.as_str().to_string())
        };
        assert_eq!(ok(Method::GET, Some("/a?b=1")), Some("/a?b=1".into()));
        assert_eq!(ok(Method::GET, None), Some("/".into()));
        assert_eq!(ok(Method::OPTIONS, Some("*")), Some("*".into()));
        // An HTTP/2 `:path` that is a query alone: refused, never written as a request line
        // no HTTP/1.1 server reads (an absolute-form `:path` is refused by the http crate).
        assert_eq!(ok(Method::POST, Some("?charge=1")), None);
        assert_eq!(ok(Method::GET, Some("*")), None);
        assert_eq!(ok(Method::CONNECT, None), None);
    }

    #[tokio::test]
    async fn a_small_body_is_read_whole_with_its_trailers() {
        use http_body_util::BodyExt;
        let frames = vec![
            Ok::<_, std::convert::Infallible>(hyper::body::Frame::data(bytes::Bytes::from("ab"))),
            Ok(hyper::body::Frame::data(bytes::Bytes::from("cd"))),
            Ok(hyper::body::Frame::trailers({
                let mut t = http::HeaderMap::new();
                t.insert("grpc-status", HeaderValue::from_static("0"));
                t
            })),
        ];
        struct Frames(
            std::collections::VecDeque<
                Result<hyper::body::Frame<bytes::Bytes>, std::convert::Infallible>,
            >,
        );
        impl hyper::body::Body for Frames {
            type Data = bytes::Bytes;
            type Error = std::convert::Infallible;
            fn poll_frame(
                mut self: std::pin::Pin<&mut Self>,
                _: &mut std::task::Context<'_>,
            ) -> std::task::Poll<Option<Result<hyper::body::Frame<bytes::Bytes>, Self::Error>>>
            {
                std::task::Poll::Ready(self.0.pop_front())
            }
        }
        let body = Body::new(Frames(frames.into()));
        let c = whole(body).await.unwrap().collect().await.unwrap();
        assert_eq!(c.trailers().unwrap()["grpc-status"], "0");
        assert_eq!(c.to_bytes(), "abcd");
        let one = whole(Body::from("x".repeat(100))).await.unwrap();
        assert_eq!(one.collect().await.unwrap().to_bytes(), "x".repeat(100));
        assert!(is_small(&Body::from(vec![0u8; SMALL_BODY_BYTES as usize])));
        assert!(!is_small(&Body::from(vec![
            0u8;
            SMALL_BODY_BYTES as usize + 1
        ])));
    }
}
