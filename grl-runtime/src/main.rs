//! `grl`: the controller, the zone aggregator, incident overrides and the simulator.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Args, Parser, Subcommand};
use grl_runtime::aggregator::{Aggregator, AggregatorOptions};
use grl_runtime::controller::{Controller, ControllerOptions};
use grl_runtime::overrides::OverrideRequest;
use grl_runtime::sim::{self, Algorithm, Scenario};
use schema::HumanDuration;

#[derive(Parser)]
#[command(
    name = "grl",
    about = "Global rate limiter: control plane and simulator"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the controller (config API, overrides, ratios, reports, metrics).
    Controller {
        /// Listen address.
        #[arg(long, default_value = "127.0.0.1:7070")]
        listen: SocketAddr,
        /// Where the applied config and overrides are persisted.
        #[arg(long, default_value = "grl-state")]
        state_dir: PathBuf,
        /// Bearer token for mutating endpoints. Give it through the GRL_TOKEN environment
        /// variable: the --token flag (discouraged) shows the secret in `ps` to every user.
        #[arg(long, env = "GRL_TOKEN", hide_env_values = true)]
        token: Option<String>,
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
        /// Shared secret of zone reports: `POST /v1/aggregate` then needs it as a bearer
        /// token (aggregators and peer controllers send it). Unset = reports are not
        /// authenticated (a warning is logged).
        #[arg(long, env = "GRL_REPORT_TOKEN", hide_env_values = true)]
        report_token: Option<String>,
        #[command(flatten)]
        tls: ServeTlsArgs,
        /// How peer controllers (--peer https://…) are verified.
        #[command(flatten)]
        client_tls: ClientTlsArgs,
    },
    /// Run a zone aggregator.
    Aggregator {
        /// Listen address.
        #[arg(long, default_value = "127.0.0.1:7071")]
        listen: SocketAddr,
        /// Controller URL; repeat for failover.
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
        /// The controllers' report token, sent with every zone report.
        #[arg(long, env = "GRL_REPORT_TOKEN", hide_env_values = true)]
        report_token: Option<String>,
        #[command(flatten)]
        tls: ServeTlsArgs,
        /// How the controllers (--controller https://…) are verified.
        #[command(flatten)]
        client_tls: ClientTlsArgs,
    },
    /// Incident overrides on a controller.
    Override {
        #[command(subcommand)]
        cmd: OverrideCmd,
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

#[derive(Args)]
struct Remote {
    /// Controller URL.
    #[arg(long, env = "GRL_CONTROLLER", default_value = "http://127.0.0.1:7070")]
    controller: String,
    /// Bearer token.
    #[arg(long, env = "GRL_TOKEN", hide_env_values = true, default_value = "")]
    token: String,
    #[command(flatten)]
    tls: ClientTlsArgs,
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
    fn options(self) -> anyhow::Result<Option<grl_runtime::tls::ServerTls>> {
        let reload = Duration::from_secs(self.tls_reload_secs.max(1));
        Ok(grl_runtime::tls::ServerTls::from_flags(
            self.tls_cert,
            self.tls_key,
            self.tls_client_ca,
        )?
        .map(|t| grl_runtime::tls::ServerTls {
            reload_every: reload,
            ..t
        }))
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
    fn options(self) -> anyhow::Result<grl_runtime::tls::ClientTls> {
        grl_runtime::tls::ClientTls::from_flags(
            self.tls_ca,
            self.tls_client_cert,
            self.tls_client_key,
        )
    }
}

#[derive(Subcommand)]
enum OverrideCmd {
    /// Apply an override.
    Add {
        #[command(flatten)]
        remote: Remote,
        /// Callee service (required with --bucket).
        #[arg(long)]
        service: Option<String>,
        /// Bucket name.
        #[arg(long)]
        bucket: Option<String>,
        /// Caller.
        #[arg(long)]
        caller: Option<String>,
        /// Procedure.
        #[arg(long)]
        procedure: Option<String>,
        /// Replacement limit.
        #[arg(long)]
        limit_rps: Option<f64>,
        /// Fixed drop ratio.
        #[arg(long)]
        drop_ratio: Option<f64>,
        /// Time to live, e.g. 30m.
        #[arg(long)]
        ttl: HumanDuration,
        /// Why.
        #[arg(long)]
        reason: String,
        /// Who applies it, for the audit log (defaults to $USER; "unknown", with a warning,
        /// when that is unset).
        #[arg(long)]
        who: Option<String>,
    },
    /// List active overrides.
    List {
        #[command(flatten)]
        remote: Remote,
    },
    /// Remove an override.
    Rm {
        #[command(flatten)]
        remote: Remote,
        /// Override id.
        id: String,
        /// Who removes it.
        #[arg(long, env = "USER", default_value = "unknown")]
        who: String,
        /// Why.
        #[arg(long, default_value = "")]
        reason: String,
    },
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    init_tracing();
    match Cli::parse().cmd {
        Cmd::Controller {
            listen,
            state_dir,
            token,
            config_dir,
            tick_ms,
            region,
            peers,
            report_token,
            tls,
            client_tls,
        } => {
            let Some(token) = token.filter(|t| !t.is_empty()) else {
                bail!("set the bearer token in the GRL_TOKEN environment variable (must not be empty)");
            };
            let report_token = report_token.filter(|t| !t.is_empty());
            if report_token.is_none() {
                tracing::warn!("no --report-token (GRL_REPORT_TOKEN): anyone who reaches /v1/aggregate can report counts");
            }
            let h = Controller::start(ControllerOptions {
                listen,
                state_dir,
                token,
                config_dir,
                tick: Duration::from_millis(tick_ms.max(1)),
                region,
                peers,
                report_token,
                tls: tls.options()?,
                client_tls: client_tls.options()?,
            })
            .await?;
            println!("listening on {}", h.addr());
            tokio::signal::ctrl_c().await.context("wait for ctrl-c")?;
            h.shutdown().await;
        }
        Cmd::Aggregator {
            listen,
            controllers,
            zone,
            region,
            tick_ms,
            id,
            report_token,
            tls,
            client_tls,
        } => {
            let h = Aggregator::start(AggregatorOptions {
                listen,
                controllers,
                zone,
                region,
                tick: Duration::from_millis(tick_ms.max(1)),
                id,
                report_token: report_token.filter(|t| !t.is_empty()),
                tls: tls.options()?,
                client_tls: client_tls.options()?,
            })
            .await?;
            println!("listening on {}", h.addr());
            tokio::signal::ctrl_c().await.context("wait for ctrl-c")?;
            h.shutdown().await;
        }
        Cmd::Override { cmd } => override_cmd(cmd).await?,
        Cmd::Simulate {
            scenario,
            seed,
            algorithm,
            realtime,
        } => {
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
            let mut out = std::io::BufWriter::new(std::io::stdout().lock());
            let mut err = None;
            sim::run(&sc, seed, algorithm, |row| {
                use std::io::Write;
                if let Err(e) = serde_json::to_writer(&mut out, row)
                    .map_err(std::io::Error::from)
                    .and_then(|_| writeln!(out))
                {
                    err.get_or_insert(e);
                }
            })?;
            if let Some(e) = err {
                return Err(e).context("write output");
            }
        }
        Cmd::SimReport { scenarios, seed } => {
            print!("{}", grl_runtime::report::markdown(&scenarios, seed)?);
        }
    }
    Ok(())
}

/// `--who`, else $USER, else "unknown" with a warning (cron jobs and containers often run
/// without $USER; the override must still go through in an incident).
fn who_or_user(who: Option<String>) -> String {
    who.filter(|w| !w.trim().is_empty())
        .or_else(|| std::env::var("USER").ok().filter(|u| !u.trim().is_empty()))
        .unwrap_or_else(|| {
            eprintln!(
                "warning: --who not given and $USER unset: recording the author as \"unknown\""
            );
            "unknown".to_string()
        })
}

async fn override_cmd(mut cmd: OverrideCmd) -> anyhow::Result<()> {
    let tls = match &mut cmd {
        OverrideCmd::Add { remote, .. }
        | OverrideCmd::List { remote }
        | OverrideCmd::Rm { remote, .. } => std::mem::replace(
            &mut remote.tls,
            ClientTlsArgs {
                tls_ca: None,
                tls_client_cert: None,
                tls_client_key: None,
            },
        ),
    };
    let http = tls.options()?.http_client(Duration::from_secs(30))?;
    let (resp, what) = match cmd {
        OverrideCmd::Add {
            remote,
            service,
            bucket,
            caller,
            procedure,
            limit_rps,
            drop_ratio,
            ttl,
            reason,
            who,
        } => {
            let req = OverrideRequest {
                service,
                bucket,
                caller,
                procedure,
                limit_rps,
                drop_ratio,
                ttl_secs: ttl.as_secs(),
                reason,
                who: who_or_user(who),
            };
            req.validate()?;
            let r = http
                .post(format!("{}/v1/overrides", remote.controller))
                .bearer_auth(&remote.token)
                .json(&req)
                .send()
                .await
                .context("reach controller")?;
            (r, "add override")
        }
        OverrideCmd::List { remote } => {
            let r = http
                .get(format!("{}/v1/overrides", remote.controller))
                .send()
                .await
                .context("reach controller")?;
            (r, "list overrides")
        }
        OverrideCmd::Rm {
            remote,
            id,
            who,
            reason,
        } => {
            let r = http
                .delete(format!("{}/v1/overrides/{id}", remote.controller))
                .query(&[("who", who), ("reason", reason)])
                .bearer_auth(&remote.token)
                .send()
                .await
                .context("reach controller")?;
            (r, "remove override")
        }
    };
    let status = resp.status();
    let body = resp.text().await.unwrap_or_default();
    if !status.is_success() {
        bail!("{what}: controller answered {status}: {body}");
    }
    println!("{body}");
    Ok(())
}
