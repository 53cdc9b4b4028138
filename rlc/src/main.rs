//! The `rlc` binary (minimal: the lead owns the full CLI).

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "rlc", about = "Rate Limit Configurator")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Compute quotas and print them; writes nothing.
    Preview(rlc::preview::PreviewArgs),
    /// Score policies on held-out history.
    Backtest(rlc::backtest::BacktestArgs),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let code = match Cli::parse().command {
        Command::Preview(a) => rlc::preview::run(a).await?,
        Command::Backtest(a) => rlc::backtest::run(a).await?,
    };
    std::process::exit(code)
}
