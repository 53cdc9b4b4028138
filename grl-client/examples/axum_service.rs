//! An axum service embedding the GRL client through `GrlLayer`.
//!
//! Run a controller and an aggregator, push a config with a bucket for service `payments`,
//! then: `cargo run -p grl-client --example axum_service -- http://127.0.0.1:7071` and call
//! `curl -H 'x-caller: gw' http://127.0.0.1:3000/charge`. Callers over their quota get 429
//! with `Retry-After`. `LISTEN` sets another address than 127.0.0.1:3000. The report credential (a secret the aggregator's client credentials
//! file grants for `payments`) comes from `GRL_CLIENT_TOKEN` or `GRL_CLIENT_TOKEN_FILE`.
//! Aggregators over HTTPS (`https://…`): `GRL_TLS_CA` names the CA to verify them against,
//! `GRL_TLS_CLIENT_CERT` / `GRL_TLS_CLIENT_KEY` the client certificate when they require one
//! (see docs/security.md).

use std::time::Duration;

use axum::routing::get;
use axum::Router;
use grl_client::client::{ClientOptions, GrlClient};
use grl_client::layer::{GrlLayer, KeyFrom};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();
    let aggregators: Vec<String> = std::env::args().skip(1).collect();
    let mut opts = ClientOptions::new("payments", aggregators).with_report_token_from_env()?;
    if opts.report_token.is_none() {
        tracing::warn!(
            "no GRL_CLIENT_TOKEN: aggregators will refuse the reports and the limiter stays open"
        );
    }
    opts.tick = Duration::from_secs(1);
    let path = |var: &str| std::env::var_os(var).map(std::path::PathBuf::from);
    opts.tls = grl_client::tls::ClientTls::from_flags(
        path("GRL_TLS_CA"),
        path("GRL_TLS_CLIENT_CERT"),
        path("GRL_TLS_CLIENT_KEY"),
    )?;
    let client = GrlClient::start(opts);
    // The client's series (fail-open, failovers, age of the drop ratios) on this service's
    // own /metrics, outside the limiter.
    let registry = std::sync::Arc::new(client.registry());
    let app = Router::new()
        .route("/charge", get(|| async { "charged\n" }))
        .route("/refund", get(|| async { "refunded\n" }))
        .layer(
            // Decides every request and counts it by (caller, procedure) for
            // `grl_calls_total`, the history rlc learns quotas from.
            GrlLayer::for_client(&client)
                .caller_from(KeyFrom::Header(http::HeaderName::from_static("x-caller")))
                .procedure_from(KeyFrom::PathSegment(0))
                .retry_after_secs(1),
        )
        .route(
            "/metrics",
            get(move || {
                let r = registry.clone();
                async move {
                    let ct = grl_client::metrics::CONTENT_TYPE_OPENMETRICS;
                    (
                        [(http::header::CONTENT_TYPE, ct)],
                        grl_client::metrics::encode(&r),
                    )
                }
            }),
        );
    let listen = std::env::var("LISTEN").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    tracing::info!(addr = %listener.local_addr()?, "serving");
    axum::serve(listener, app).await?;
    Ok(())
}
