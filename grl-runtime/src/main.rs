//! `grl`: the controller, the zone aggregator, the sidecar, incident overrides and the simulator.

/// mimalloc: the sidecar allocates and frees a few dozen blocks per proxied request (heads,
/// header maps, futures), on the hot path of every request.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Args, Parser, Subcommand};
use grl_client::auth::{CredentialSet, TokenSource};
use grl_control::aggregator::{Aggregator, AggregatorOptions};
use grl_control::controller::{Controller, ControllerOptions};
use grl_runtime::sim::{self, Algorithm, Scenario};

mod override_cli;

#[derive(Parser)]
#[command(
    name = "grl",
    about = "Global rate limiter: control plane and simulator"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
    /// Log lines on stderr as text or one JSON object per line (level: RUST_LOG, default
    /// info; colours only on a terminal).
    #[arg(long, global = true, value_enum, default_value = "text")]
    log_format: grl_server::logging::LogFormat,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the controller (config API, overrides, ratios, reports, metrics).
    ///
    /// Credentials come from the environment or files, never from flags (`ps` shows flags to
    /// every user): GRL_CONFIG_TOKEN (role `config`: PUT /v1/config, what rlc holds),
    /// GRL_OVERRIDE_TOKEN (`overrides`: POST/DELETE /v1/overrides, what on-call people hold),
    /// GRL_READ_TOKEN (`reports`: GET /v1/reports), GRL_REPORT_TOKEN (`zone-report`:
    /// POST /v1/aggregate, also sent to --peer controllers); each also as NAME_FILE
    /// (GRL_CONFIG_TOKEN_FILE, ...), a file holding the secret, re-read when it changes.
    /// GRL_TOKEN (legacy) holds config, overrides and reports at once. More credentials, and
    /// rotations, go in --credentials.
    ///
    /// Replicas: run two or more controllers of a region on one Postgres database
    /// (GRL_DATABASE_URL, or GRL_DATABASE_URL_FILE holding it; --database-url for a URL
    /// without a password): the config and the overrides are kept there instead of
    /// --state-dir, every replica serves the same ones, and the region's aggregators list
    /// every replica with --controller.
    Controller(ControllerArgs),
    /// Run a zone aggregator.
    ///
    /// Client reports need a credential from --client-credentials; zone reports to the
    /// controllers carry GRL_REPORT_TOKEN (or the content of GRL_REPORT_TOKEN_FILE, re-read
    /// when it changes).
    Aggregator(AggregatorArgs),
    /// Run an inbound reverse proxy in front of one service instance (any language): every
    /// request is decided by the GRL client, refused ones are answered here (HTTP 429, gRPC
    /// RESOURCE_EXHAUSTED), the rest go to --upstream with their bodies streamed. HTTP/1.1 and
    /// HTTP/2 without TLS (h2c, gRPC) on one port.
    ///
    /// The report credential (a secret the aggregators' client credentials file grants for
    /// --service) comes from GRL_CLIENT_TOKEN or GRL_CLIENT_TOKEN_FILE, never from a flag.
    Sidecar(Box<SidecarArgs>),
    /// Print a new credential line (`NAME SCOPE SECRET`, 256 random bits) for a credentials
    /// file.
    GenCredential {
        /// Its name (recorded in logs and overrides; not secret).
        #[arg(long)]
        name: String,
        /// Services (aggregator file) or roles (controller file), comma-separated, or *.
        #[arg(long)]
        scope: String,
    },
    /// Incident overrides on a controller.
    Override {
        #[command(subcommand)]
        cmd: override_cli::OverrideCmd,
    },
    /// Simulate a fleet over a scenario; one JSON line per bucket per tick.
    Simulate {
        /// Scenario YAML.
        #[arg(long)]
        scenario: PathBuf,
        /// Random seed.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Limiter run by the clients.
        #[arg(long, value_enum, default_value = "drop-by-ratio")]
        algorithm: Algorithm,
        /// Over real HTTP on loopback in wall-clock time (controller, aggregators and clients in
        /// this process).
        #[arg(long)]
        realtime: bool,
    },
    /// Run the comparison scenarios and print the markdown report (docs/grl-control-loop.md).
    SimReport {
        /// Directory with the scenario files.
        #[arg(long, default_value = "grl-runtime/scenarios")]
        scenarios: PathBuf,
        /// Random seed.
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
}

// The `grl controller` flags. (no doc comment: the variant's is the subcommand's help).
#[derive(Args)]
struct ControllerArgs {
    /// Listen address.
    #[arg(long, default_value = "127.0.0.1:7070")]
    listen: SocketAddr,
    /// Where the applied config and overrides are persisted.
    #[arg(long, default_value = "grl-state")]
    state_dir: PathBuf,
    /// Credentials file: one `NAME ROLES SECRET` per line, roles among config,
    /// overrides, reports, zone-report (comma-separated, or *); re-read when it changes.
    #[arg(long, env = "GRL_CREDENTIALS_FILE")]
    credentials: Option<PathBuf>,
    /// Bucket YAML directory loaded when nothing was persisted yet.
    #[arg(long)]
    config_dir: Option<PathBuf>,
    /// Control-loop period in milliseconds.
    #[arg(long, default_value_t = 1000)]
    tick_ms: u64,
    /// This controller's region (required with --peer).
    #[arg(long)]
    region: Option<String>,
    /// Controller of another region to share global-bucket sums with; repeat.
    #[arg(long = "peer")]
    peers: Vec<String>,
    #[command(flatten)]
    tls: ServeTlsArgs,
    #[command(flatten)]
    limits: ServeLimitArgs,
    /// How peer controllers (--peer https://…) are verified.
    #[command(flatten)]
    client_tls: ClientTlsArgs,
    /// DEVELOPMENT ONLY: accept zone reports that carry no credential. Anyone who
    /// reaches the port can then make the fleet drop traffic.
    #[arg(long)]
    insecure_allow_anonymous_reports: bool,
    /// On SIGTERM or SIGINT: how long in-flight requests may take to finish.
    #[arg(long, default_value_t = 10_000)]
    shutdown_grace_ms: u64,
    /// `grl_calls_total`: callers per service that keep their label (the top ones by
    /// recent volume); the others are folded into caller="_other".
    #[arg(long, default_value_t = grl_client::calls::DEFAULT_MAX_CALLERS)]
    calls_max_callers: usize,
    /// `grl_calls_total`: procedures per service that keep their label (the first
    /// seen); the others are folded into procedure="_other".
    #[arg(long, default_value_t = grl_client::calls::DEFAULT_MAX_PROCEDURES)]
    calls_max_procedures: usize,
    /// Postgres URL of the state shared by the region's controller replicas, when it holds
    /// no password (ps shows flags to every user: a password goes in GRL_DATABASE_URL,
    /// GRL_DATABASE_URL_FILE or PGPASSWORD). Without one: --state-dir.
    #[arg(long)]
    database_url: Option<String>,
    /// With a database: seconds between polls for changes of other replicas (a fallback;
    /// changes are notified at once).
    #[arg(long, default_value_t = 2)]
    database_poll_secs: u64,
    /// With a database: how long a starting controller waits for it before giving up.
    #[arg(long, default_value_t = 30)]
    database_connect_timeout_secs: u64,
    /// Overrides active at once; one more is refused (422) until one is removed or
    /// expires.
    #[arg(long, default_value_t = grl_control::controller::DEFAULT_MAX_OVERRIDES)]
    max_overrides: usize,
}

// The `grl aggregator` flags. (no doc comment: the variant's is the subcommand's help).
#[derive(Args)]
struct AggregatorArgs {
    /// Listen address.
    #[arg(long, default_value = "127.0.0.1:7071")]
    listen: SocketAddr,
    /// Controller URL; repeat for the replicas of the region's controller: every zone
    /// report goes to each of them (a standby stays warm), and the clients get the
    /// directives of the first that answers (failover in order).
    #[arg(long = "controller", required = true)]
    controllers: Vec<String>,
    /// Zone served.
    #[arg(long)]
    zone: String,
    /// Region of the zone.
    #[arg(long)]
    region: String,
    /// Forwarding period in milliseconds.
    #[arg(long, default_value_t = 1000)]
    tick_ms: u64,
    /// Instance id.
    #[arg(long)]
    id: Option<String>,
    #[command(flatten)]
    tls: ServeTlsArgs,
    #[command(flatten)]
    limits: ServeLimitArgs,
    /// How the controllers (--controller https://…) are verified.
    #[command(flatten)]
    client_tls: ClientTlsArgs,
    /// Client credentials file: one `NAME SERVICES SECRET` per line (services
    /// comma-separated, or * for every service); re-read when it changes.
    #[arg(long, env = "GRL_CLIENT_CREDENTIALS_FILE")]
    client_credentials: Option<PathBuf>,
    /// DEVELOPMENT ONLY: accept client reports that carry no credential. Anyone who
    /// reaches the port can then make the fleet drop traffic.
    #[arg(long)]
    insecure_allow_anonymous_reports: bool,
    /// On SIGTERM or SIGINT: how long in-flight requests, then the last forward of the
    /// counts held, may take.
    #[arg(long, default_value_t = 10_000)]
    shutdown_grace_ms: u64,
    /// Delta zone reports (to controllers of protocol 4): a bucket is reported again when
    /// one of its rates moved by more than this share since the controller last got it
    /// (0 = any change).
    #[arg(long, default_value_t = 0.01)]
    report_change_threshold: f64,
    /// Delta zone reports: every bucket is reported at least every this many forwards
    /// (its counts ride along; 1 = every bucket every forward).
    #[arg(long, default_value_t = 30)]
    report_refresh_ticks: u64,
    /// Plausibility: a client's offered rate for a bucket is cut to the largest of this
    /// many times the bucket's limit divided by the service's clients in the zone, ...
    /// (its total call rate: this many times the sum of the service's limits, ...)
    #[arg(long, default_value_t = 10.0)]
    plausible_limit_multiple: f64,
    /// ... this many times the mean rate of the bucket's other clients (the largest left
    /// out), and 10 rps. Buckets under an incident override are not cut. (Calls: this
    /// many times the mean total call rate of the service's other clients, and
    /// --plausible-instance-rps.)
    #[arg(long, default_value_t = 4.0)]
    plausible_peer_multiple: f64,
    /// The total call rate (requests per second, every caller and procedure together)
    /// one client is trusted up to whatever else is known: the cap of a lone instance of a
    /// service with no bucket in the config. Calls beyond a client's cap, over the time it
    /// really reported, are scaled down.
    #[arg(long, default_value_t = grl_control::aggregator::screen::DEFAULT_INSTANCE_RPS)]
    plausible_instance_rps: f64,
    /// Rates held per service (one per client and bucket); a report that would pass it is
    /// refused with 429.
    #[arg(long, default_value_t = 1_000_000)]
    max_rates_per_service: usize,
    /// Clients held per service (one per client id heard within its horizon; the services
    /// not in the config share one such budget); a report of a new client that would pass
    /// it is refused with 429.
    #[arg(long, default_value_t = grl_control::aggregator::screen::DEFAULT_MAX_CLIENTS_PER_SERVICE)]
    max_clients_per_service: usize,
}

// The `grl sidecar` flags. (no doc comment: the variant's is the subcommand's help).
#[derive(Args)]
struct SidecarArgs {
    /// Where callers connect.
    #[arg(long, default_value = "0.0.0.0:8080")]
    listen: SocketAddr,
    /// The service instance: http://HOST:PORT or unix:/path/to/socket.
    #[arg(long)]
    upstream: String,
    /// The callee service (its buckets in the controller's config).
    #[arg(long)]
    service: String,
    /// The zone the instance runs in (logs, grl_sidecar_info).
    #[arg(long, default_value = "")]
    zone: String,
    /// The region.
    #[arg(long, default_value = "")]
    region: String,
    /// Zone aggregator URL; repeat for failover, in order of preference.
    #[arg(long = "aggregator", required = true)]
    aggregators: Vec<String>,
    /// /metrics, /healthz and /readyz on this address (keep it off the callers' network).
    #[arg(long, default_value = "127.0.0.1:9901")]
    admin_listen: SocketAddr,
    /// Caller from a verified client certificate (with --tls-client-ca): a pattern tried on
    /// its SPIFFE ID and SANs, `*` any characters but `/`, {caller} the caller; repeat,
    /// first match wins.
    #[arg(
        long = "caller-cert-pattern",
        default_value = "spiffe://*/ns/*/sa/{caller}"
    )]
    caller_cert_patterns: Vec<String>,
    /// Else the caller from this header (x-caller, l5d-client-id, x-forwarded-client-cert:
    /// its URI= through the patterns); `none` trusts no header. A header is spoofable
    /// unless the mesh or the network guarantees who sets it.
    #[arg(long, default_value = "rpc-caller")]
    caller_header: String,
    /// With a verified client certificate, pass its caller upstream in this header (the
    /// caller's own value of it is always removed). Default: not passed.
    #[arg(long)]
    verified_caller_header: Option<String>,
    /// A request's criticality tier from this header (gRPC: the same metadata key), else a
    /// `criticality` member of `baggage`; absent or invalid is CRITICAL; `none` ignores
    /// tiers. Callers can set it: cap those who may not with --criticality-cap.
    #[arg(long, default_value = "rpc-criticality")]
    criticality_header: String,
    /// CALLER=TIER: the highest tier a caller may claim (CALLER a name, or a prefix ending
    /// in `*`); repeat, the first match wins.
    #[arg(long = "criticality-cap")]
    criticality_caps: Vec<String>,
    /// A limit on the requests in flight to the upstream: `auto` learns it from the
    /// upstream's latency, N fixes it, `off` (the default) has none. Requests beyond it wait
    /// (the more critical tiers first), then get 503 (gRPC UNAVAILABLE).
    #[arg(long, default_value = "off")]
    concurrency_limit: grl_client::concurrency::Mode,
    /// How long a request may wait for a slot under --concurrency-limit.
    #[arg(long, default_value_t = 100)]
    queue_timeout_ms: u64,
    /// The procedure of a non-gRPC request from this header (`none`: no header). Default:
    /// `rpc-procedure` without --route, none with --route (routes decide, not the caller).
    #[arg(long)]
    procedure_header: Option<String>,
    /// Else method and route template of the first matching route: `GET /users/{id}`,
    /// `/static/{path*}` (any method); repeat. Unmatched requests fold into `_other`.
    #[arg(long = "route")]
    routes: Vec<String>,
    /// Match the routes' literal segments in any ASCII case (`/CHECKOUT` is `/checkout`),
    /// as Express and ASP.NET route by default.
    #[arg(long)]
    route_ignore_case: bool,
    /// Match a path ending in `/` as without it (`/checkout/` is `/checkout`), as Express
    /// routes by default.
    #[arg(long)]
    route_trailing_slash: bool,
    /// Retry-After seconds of a refusal (grpc-retry-pushback-ms: the same in ms).
    #[arg(long, default_value_t = 1)]
    retry_after_secs: u64,
    /// The upstream must answer a request's head within this (504, gRPC DEADLINE_EXCEEDED).
    #[arg(long, default_value_t = 30_000)]
    upstream_timeout_ms: u64,
    /// A connection to the upstream must open within this (502, gRPC UNAVAILABLE).
    #[arg(long, default_value_t = 5_000)]
    upstream_connect_timeout_ms: u64,
    /// Largest request head (HTTP/1.1 buffer, HTTP/2 header list).
    #[arg(long, default_value_t = grl_sidecar::DEFAULT_MAX_HEADER_BYTES)]
    max_header_bytes: usize,
    /// Reporting period in milliseconds.
    #[arg(long, default_value_t = 200)]
    tick_ms: u64,
    /// Threads serving the connections, each with its own single-threaded runtime and
    /// upstream pools (default: one per core); 0: none, the connections are served on the
    /// process's multi-threaded runtime with one shared pool.
    #[arg(long)]
    workers: Option<usize>,
    /// Drop ratios older than this stop dropping (fail-open), in milliseconds.
    #[arg(long, default_value_t = 3000)]
    stale_after_ms: u64,
    /// Instance id (random when absent).
    #[arg(long)]
    id: Option<String>,
    #[command(flatten)]
    tls: ServeTlsArgs,
    #[command(flatten)]
    limits: ServeLimitArgs,
    /// How the aggregators (--aggregator https://…) are verified.
    #[command(flatten)]
    client_tls: ClientTlsArgs,
    /// On SIGTERM or SIGINT: how long requests in flight may take to finish.
    #[arg(long, default_value_t = 10_000)]
    shutdown_grace_ms: u64,
}

#[derive(Args)]
struct Remote {
    /// Controller URL.
    #[arg(long, env = "GRL_CONTROLLER", default_value = "http://127.0.0.1:7070")]
    controller: String,
    #[command(flatten)]
    tls: ClientTlsArgs,
    /// Give up on the controller after this many seconds.
    #[arg(long, default_value_t = 30)]
    timeout_secs: u64,
}

/// A server's TLS (controller, aggregator). No certificate = plain HTTP (loopback, tests).
#[derive(Args)]
struct ServeTlsArgs {
    /// Serve HTTPS with this certificate chain (PEM, leaf first). Re-read when it changes:
    /// new connections get the new certificate, no restart.
    #[arg(long, env = "GRL_TLS_CERT")]
    tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, env = "GRL_TLS_KEY")]
    tls_key: Option<PathBuf>,
    /// Mutual TLS: refuse clients without a certificate signed by this CA (PEM).
    #[arg(long, env = "GRL_TLS_CLIENT_CA")]
    tls_client_ca: Option<PathBuf>,
    /// Seconds between checks of the TLS files for changes.
    #[arg(long, default_value_t = 5)]
    tls_reload_secs: u64,
}

impl ServeTlsArgs {
    fn options(self) -> anyhow::Result<Option<grl_server::tls::ServerTls>> {
        let reload = Duration::from_secs(self.tls_reload_secs.max(1));
        Ok(
            grl_server::tls::ServerTls::from_flags(
                self.tls_cert,
                self.tls_key,
                self.tls_client_ca,
            )?
            .map(|t| grl_server::tls::ServerTls {
                reload_every: reload,
                ..t
            }),
        )
    }
}

/// A server's connection limits (controller, aggregator): see `grl_server::server`.
#[derive(Args)]
struct ServeLimitArgs {
    /// A request's head (request line and headers) must arrive within this many milliseconds
    /// of the connection's accept (TLS handshake included) or of its first byte; else the
    /// connection is cut.
    #[arg(long, default_value_t = 10_000)]
    http_header_timeout_ms: u64,
    /// A kept-alive connection with no request in flight and no traffic for this many
    /// milliseconds is closed.
    #[arg(long, default_value_t = 60_000)]
    http_idle_timeout_ms: u64,
    /// Connections served at once; beyond, --health-connections more get /healthz and /readyz
    /// only, and the rest are closed at accept. Lowered, with a warning, to fit the open-file
    /// limit.
    #[arg(long, default_value_t = 10_000)]
    max_connections: usize,
    /// Connections beyond --max-connections that still get /healthz and /readyz (one request
    /// each, 2 s to send it), so that probes answer while the cap is reached.
    #[arg(long, default_value_t = 16)]
    health_connections: usize,
    /// Also serve /healthz and /readyz (only) on this address, with its own 64 connections:
    /// probes reach it however many connections hold the main port (keep it off the
    /// network that reaches the main port).
    #[arg(long)]
    health_listen: Option<SocketAddr>,
}

impl ServeLimitArgs {
    fn limits(&self) -> anyhow::Result<grl_server::server::ServeLimits> {
        anyhow::ensure!(
            self.http_header_timeout_ms > 0 && self.http_idle_timeout_ms > 0,
            "--http-header-timeout-ms and --http-idle-timeout-ms must be positive"
        );
        anyhow::ensure!(
            self.max_connections > 0,
            "--max-connections must be positive"
        );
        Ok(grl_server::server::ServeLimits {
            header_timeout: Duration::from_millis(self.http_header_timeout_ms),
            idle_timeout: Duration::from_millis(self.http_idle_timeout_ms),
            max_connections: self.max_connections,
            health_connections: self.health_connections,
        })
    }
}

/// How this process verifies the servers it calls, and its client certificate.
#[derive(Args)]
struct ClientTlsArgs {
    /// Verify https servers against this CA (PEM) only, instead of the public roots.
    #[arg(long, env = "GRL_TLS_CA")]
    tls_ca: Option<PathBuf>,
    /// Client certificate (PEM) for servers that require mutual TLS.
    #[arg(long, env = "GRL_TLS_CLIENT_CERT")]
    tls_client_cert: Option<PathBuf>,
    /// The private key of --tls-client-cert (PEM).
    #[arg(long, env = "GRL_TLS_CLIENT_KEY")]
    tls_client_key: Option<PathBuf>,
}

impl ClientTlsArgs {
    fn options(self) -> anyhow::Result<grl_client::tls::ClientTls> {
        grl_client::tls::ClientTls::from_flags(
            self.tls_ca,
            self.tls_client_cert,
            self.tls_client_key,
        )
    }
}

fn main() -> std::process::ExitCode {
    grl_server::logging::quiet_on_closed_pipe();
    let cli = Cli::parse();
    grl_server::logging::init(cli.log_format, "info");
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(cli)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e)
            if e.chain().any(|c| {
                c.downcast_ref::<std::io::Error>()
                    .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
            }) =>
        {
            // The reader went away (`grl simulate … | head`): leave quietly, as
            // command-line tools do (128 + SIGPIPE).
            std::process::ExitCode::from(141)
        }
        Err(e) => {
            // One line for the user; the chain of causes with its backtrace only when debug
            // logs are asked for (RUST_LOG=debug).
            if tracing::enabled!(tracing::Level::DEBUG) {
                eprintln!("error: {e:?}");
            } else {
                eprintln!("error: {e:#}");
            }
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.cmd {
        Cmd::Controller(args) => controller(args).await?,
        Cmd::Aggregator(args) => aggregator(args).await?,
        Cmd::Sidecar(args) => sidecar(*args).await?,
        Cmd::Override { cmd } => override_cli::run(cmd).await?,
        Cmd::GenCredential { name, scope } => {
            anyhow::ensure!(
                !name.is_empty() && !name.contains(char::is_whitespace),
                "--name must be one word"
            );
            anyhow::ensure!(
                !scope.is_empty() && !scope.contains(char::is_whitespace),
                "--scope must be one word (comma-separated items, or *)"
            );
            let secret: String = rand::random::<[u8; 32]>()
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            println!("{name} {scope} {secret}");
        }
        Cmd::Simulate {
            scenario,
            seed,
            algorithm,
            realtime,
        } => simulate(scenario, seed, algorithm, realtime).await?,
        Cmd::SimReport { scenarios, seed } => {
            print!("{}", grl_runtime::report::markdown(&scenarios, seed)?);
        }
    }
    Ok(())
}

/// `grl controller`: checks the credentials and the database, serves until stopped.
async fn controller(args: ControllerArgs) -> anyhow::Result<()> {
    let ControllerArgs {
        listen,
        state_dir,
        credentials,
        config_dir,
        tick_ms,
        region,
        peers,
        tls,
        limits,
        client_tls,
        insecure_allow_anonymous_reports,
        shutdown_grace_ms,
        calls_max_callers,
        calls_max_procedures,
        database_url,
        database_poll_secs,
        database_connect_timeout_secs,
        max_overrides,
    } = args;
    let database = database_options(
        database_url,
        database_poll_secs,
        database_connect_timeout_secs,
    )?;
    let creds = controller_credentials(credentials.as_deref())?;
    let report_token = TokenSource::from_env("GRL_REPORT_TOKEN")?;
    let h = Controller::start(ControllerOptions {
        listen,
        state_dir,
        token: String::new(),
        credentials: creds,
        config_dir,
        tick: Duration::from_millis(tick_ms.max(1)),
        region,
        peers,
        report_token,
        tls: tls.options()?,
        client_tls: client_tls.options()?,
        allow_anonymous_reports: insecure_allow_anonymous_reports,
        max_callers_per_service: calls_max_callers,
        max_procedures_per_service: calls_max_procedures,
        database,
        serve: limits.limits()?,
        health_listen: limits.health_listen,
        max_overrides,
    })
    .await?;
    stop_gracefully("controller", h, shutdown_grace_ms).await;
    Ok(())
}

/// `grl aggregator`: checks the plausibility bounds, serves until stopped.
async fn aggregator(args: AggregatorArgs) -> anyhow::Result<()> {
    let AggregatorArgs {
        listen,
        controllers,
        zone,
        region,
        tick_ms,
        id,
        tls,
        limits,
        client_tls,
        client_credentials,
        insecure_allow_anonymous_reports,
        shutdown_grace_ms,
        report_change_threshold,
        report_refresh_ticks,
        plausible_limit_multiple,
        plausible_peer_multiple,
        plausible_instance_rps,
        max_rates_per_service,
        max_clients_per_service,
    } = args;
    anyhow::ensure!(
        plausible_limit_multiple.is_finite()
            && plausible_limit_multiple >= 1.0
            && plausible_peer_multiple.is_finite()
            && plausible_peer_multiple >= 1.0,
        "--plausible-limit-multiple and --plausible-peer-multiple must be at least 1"
    );
    anyhow::ensure!(
        plausible_instance_rps.is_finite() && plausible_instance_rps >= 1.0,
        "--plausible-instance-rps must be at least 1"
    );
    anyhow::ensure!(
        report_change_threshold.is_finite() && (0.0..1.0).contains(&report_change_threshold),
        "--report-change-threshold must be at least 0 and below 1"
    );
    let h = Aggregator::start(AggregatorOptions {
        listen,
        controllers,
        zone,
        region,
        tick: Duration::from_millis(tick_ms.max(1)),
        id,
        tls: tls.options()?,
        client_tls: client_tls.options()?,
        report_token: TokenSource::from_env("GRL_REPORT_TOKEN")?,
        client_credentials,
        allow_anonymous_reports: insecure_allow_anonymous_reports,
        delta: grl_control::delta::DeltaOptions {
            threshold: report_change_threshold,
            refresh_ticks: report_refresh_ticks,
        },
        serve: limits.limits()?,
        health_listen: limits.health_listen,
        plausibility: grl_control::aggregator::screen::Plausibility {
            limit_multiple: plausible_limit_multiple,
            peer_multiple: plausible_peer_multiple,
            max_rates_per_service,
            max_clients_per_service,
            instance_rps: plausible_instance_rps,
        },
        ..Default::default()
    })
    .await?;
    stop_gracefully("aggregator", h, shutdown_grace_ms).await;
    Ok(())
}

/// `grl sidecar`: builds the identity rules and the client, proxies until stopped.
async fn sidecar(args: SidecarArgs) -> anyhow::Result<()> {
    let SidecarArgs {
        listen,
        upstream,
        service,
        zone,
        region,
        aggregators,
        admin_listen,
        caller_cert_patterns,
        caller_header,
        verified_caller_header,
        criticality_header,
        criticality_caps,
        concurrency_limit,
        queue_timeout_ms,
        procedure_header,
        route_ignore_case,
        route_trailing_slash,
        routes,
        retry_after_secs,
        upstream_timeout_ms,
        upstream_connect_timeout_ms,
        max_header_bytes,
        tick_ms,
        workers,
        stale_after_ms,
        id,
        tls,
        limits,
        client_tls,
        shutdown_grace_ms,
    } = args;
    if limits.health_listen.is_some() {
        bail!("grl sidecar serves /healthz and /readyz on --admin-listen (no --health-listen)");
    }
    let upstream = grl_sidecar::upstream::Upstream::parse(&upstream)
        .map_err(|e| anyhow::anyhow!("--upstream {e}"))?;
    let caller = caller_from(
        &caller_cert_patterns,
        &caller_header,
        verified_caller_header.as_deref(),
    )?;
    let tiers = tiers_from(&criticality_header, &criticality_caps)?;
    let procedure = procedure_from(
        procedure_header,
        &routes,
        route_ignore_case,
        route_trailing_slash,
    )?;
    anyhow::ensure!(
        max_header_bytes >= 1024,
        "--max-header-bytes must be at least 1024"
    );
    let mut client = grl_client::client::ClientOptions::new(&service, aggregators)
        .with_report_token_from_env()?;
    client.tick = Duration::from_millis(tick_ms.max(1));
    client.stale_after = Duration::from_millis(stale_after_ms.max(1));
    client.tls = client_tls.options()?;
    client.client_id = Some(
        id.unwrap_or_else(|| format!("{service}-{zone}-{}-{}", hostname(), std::process::id())),
    );
    let opts = grl_sidecar::SidecarOptions {
        zone,
        region,
        admin_listen: Some(admin_listen),
        tls: tls.options()?,
        caller,
        procedure,
        tiers,
        concurrency: grl_client::concurrency::Options {
            mode: concurrency_limit,
            queue_timeout: Duration::from_millis(queue_timeout_ms),
            ..Default::default()
        },
        retry_after_secs: retry_after_secs.max(1),
        upstream_timeout: Duration::from_millis(upstream_timeout_ms.max(1)),
        connect_timeout: Duration::from_millis(upstream_connect_timeout_ms.max(1)),
        serve: limits.limits()?,
        max_header_bytes,
        workers,
        ..grl_sidecar::SidecarOptions::new(listen, upstream, client)
    };
    let h = grl_sidecar::start(opts).await?;
    stop_gracefully("sidecar", h.server, shutdown_grace_ms).await;
    Ok(())
}

/// `grl simulate`: JSON lines of a scenario run in virtual time, or over real HTTP with
/// `--realtime`.
async fn simulate(
    scenario: PathBuf,
    seed: u64,
    algorithm: Algorithm,
    realtime: bool,
) -> anyhow::Result<()> {
    let sc = Scenario::load(&scenario)?;
    if realtime {
        if algorithm != Algorithm::DropByRatio {
            bail!("--realtime runs the real GRL stack: only --algorithm drop-by-ratio");
        }
        return grl_runtime::realtime::run_realtime(&sc, seed, |row| {
            if let Ok(line) = serde_json::to_string(row) {
                println!("{line}");
            }
        })
        .await;
    }
    let out = std::cell::RefCell::new(std::io::BufWriter::new(std::io::stdout().lock()));
    let err = std::cell::RefCell::new(None);
    // Tick rows, and candidate rows (a `candidate` key instead of `algorithm`) when the
    // scenario has candidates: one JSON object per line, in time order.
    let line = |row: &dyn erased::Row| {
        use std::io::Write;
        let mut out = out.borrow_mut();
        if let Err(e) = row
            .write(&mut *out)
            .map_err(std::io::Error::from)
            .and_then(|_| writeln!(out))
        {
            err.borrow_mut().get_or_insert(e);
        }
    };
    sim::run_with(&sc, seed, algorithm, |row| line(row), |row| line(row))?;
    drop(out);
    let err = err.into_inner();
    if let Some(e) = err {
        return Err(e).context("write output");
    }
    Ok(())
}

/// The controller's database, from --database-url (refused when it carries a password) or
/// GRL_DATABASE_URL(_FILE); `None` keeps the state in --state-dir.
fn database_options(
    database_url: Option<String>,
    poll_secs: u64,
    connect_timeout_secs: u64,
) -> anyhow::Result<Option<grl_control::controller::DatabaseOptions>> {
    Ok(match database_url {
        Some(url) if grl_control::state_db::has_password(&url) => bail!(
            "--database-url carries a password, which every user sees in ps: put the URL in GRL_DATABASE_URL or GRL_DATABASE_URL_FILE, or the password in PGPASSWORD"
        ),
        Some(url) => Some(url),
        None => TokenSource::from_env("GRL_DATABASE_URL")?
            .map(|t| t.current().trim().to_string()),
    }
    .map(|url| grl_control::controller::DatabaseOptions {
        poll: Duration::from_secs(poll_secs.max(1)),
        connect_timeout: Duration::from_secs(connect_timeout_secs),
        ..grl_control::controller::DatabaseOptions::new(&url)
    }))
}

/// The controller's credentials: the role tokens from the environment, then the
/// --credentials file; one must grant `config`.
fn controller_credentials(credentials: Option<&std::path::Path>) -> anyhow::Result<CredentialSet> {
    let mut creds = CredentialSet::default();
    for (var, roles) in [
        ("GRL_CONFIG_TOKEN", &["config"][..]),
        ("GRL_OVERRIDE_TOKEN", &["overrides"][..]),
        ("GRL_READ_TOKEN", &["reports"][..]),
        ("GRL_TOKEN", grl_control::controller::LEGACY_TOKEN_ROLES),
    ] {
        if let Some(t) = TokenSource::from_env(var)? {
            if var == "GRL_TOKEN" {
                tracing::warn!("GRL_TOKEN holds the config, overrides and reports roles at once; prefer GRL_CONFIG_TOKEN, GRL_OVERRIDE_TOKEN and GRL_READ_TOKEN");
            }
            creds.add(var, roles, t);
        }
    }
    if let Some(path) = credentials {
        creds
            .add_file(path, Some(grl_control::controller::ROLES))
            .map_err(|e| anyhow::anyhow!("credentials: {e}"))?;
    }
    if !creds.any_covers("config") {
        bail!("no credential for PUT /v1/config: set GRL_CONFIG_TOKEN (or the legacy GRL_TOKEN), or a `config` line in --credentials FILE");
    }
    Ok(creds)
}

/// A header-name flag's value: `none` for no header.
fn header_flag(flag: &str, v: &str) -> anyhow::Result<Option<http::HeaderName>> {
    if v == "none" {
        return Ok(None);
    }
    http::HeaderName::from_bytes(v.as_bytes())
        .map(Some)
        .map_err(|_| anyhow::anyhow!("{flag} {v:?}: not a header name"))
}

/// Where the sidecar reads the caller's name: certificate patterns, then headers.
fn caller_from(
    caller_cert_patterns: &[String],
    caller_header: &str,
    verified_caller_header: Option<&str>,
) -> anyhow::Result<grl_sidecar::identity::CallerFrom> {
    use grl_sidecar::identity::{CallerFrom, NamePattern};
    Ok(CallerFrom {
        cert_patterns: caller_cert_patterns
            .iter()
            .map(|p| NamePattern::parse(p))
            .collect::<Result<_, _>>()
            .map_err(|e| anyhow::anyhow!("--caller-cert-pattern {e}"))?,
        header: header_flag("--caller-header", caller_header)?,
        verified_header: match verified_caller_header {
            Some(v) => header_flag("--verified-caller-header", v)?,
            None => None,
        },
    })
}

/// Where the sidecar reads a request's criticality tier, and the callers' caps.
fn tiers_from(header: &str, caps: &[String]) -> anyhow::Result<grl_client::tiers::TierFrom> {
    use grl_client::tiers::TierFrom;
    let mut t = match header_flag("--criticality-header", header)? {
        Some(h) => TierFrom::header(h),
        None => TierFrom::none(),
    };
    for c in caps {
        t = t
            .with_cap_flag(c)
            .map_err(|e| anyhow::anyhow!("--criticality-cap {e}"))?;
    }
    Ok(t)
}

/// Where the sidecar reads the procedure: a header (by default `rpc-procedure` when there
/// are no routes) or the path's routes.
fn procedure_from(
    procedure_header: Option<String>,
    routes: &[String],
    route_ignore_case: bool,
    route_trailing_slash: bool,
) -> anyhow::Result<grl_sidecar::identity::ProcedureFrom> {
    use grl_sidecar::identity::{ProcedureFrom, Route};
    let procedure_header = procedure_header.unwrap_or_else(|| {
        if routes.is_empty() {
            "rpc-procedure"
        } else {
            "none"
        }
        .to_string()
    });
    Ok(ProcedureFrom {
        header: header_flag("--procedure-header", &procedure_header)?,
        routes: routes
            .iter()
            .map(|r| Route::parse(r))
            .collect::<Result<_, _>>()
            .map_err(|e| anyhow::anyhow!("--route {e}"))?,
        ignore_case: route_ignore_case,
        trailing_slash: route_trailing_slash,
    })
}

/// Prints where `h` listens, serves until SIGTERM or SIGINT, then stops `h` gracefully
/// (in-flight requests finish within `grace_ms`, then the last flush) and logs it. Exits 0
/// either way: the stop was asked for.
async fn stop_gracefully(what: &str, h: grl_server::http_util::ServerHandle, grace_ms: u64) {
    println!("listening on {}", h.addr());
    let signal = grl_server::http_util::shutdown_signal().await;
    tracing::info!(
        signal,
        grace_ms,
        "{what} shutting down: no new connections, in-flight requests finish"
    );
    let clean = h
        .shutdown_within(Duration::from_millis(grace_ms.max(1)))
        .await;
    tracing::info!(clean, "{what} shut down");
}

/// This host's name, for the sidecar's default client id (empty when unreadable).
fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default()
}

/// The rows `grl simulate` prints, as one type.
mod erased {
    /// A row written as one JSON object.
    pub trait Row {
        fn write(&self, w: &mut dyn std::io::Write) -> serde_json::Result<()>;
    }
    impl<T: serde::Serialize> Row for T {
        fn write(&self, w: &mut dyn std::io::Write) -> serde_json::Result<()> {
            serde_json::to_writer(w, self)
        }
    }
}
