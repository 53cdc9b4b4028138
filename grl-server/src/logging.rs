//! The one logging setup of every binary (`grl`, `rlc`): `tracing` to stderr, as text or as
//! one JSON object per line (`--log-format json`), ANSI colours only when stderr is a terminal,
//! `RUST_LOG` overriding the default level.

use std::io::IsTerminal;

/// How log lines are written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line (`timestamp`, `level`, `fields`, `target`, spans).
    Json,
}

/// Installs the global subscriber: `default_level` (`info`, `warn`, …) unless `RUST_LOG`
/// says otherwise; colours only on a terminal.
pub fn init(format: LogFormat, default_level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    match format {
        LogFormat::Text => b.init(),
        LogFormat::Json => b.json().init(),
    }
}

/// Makes a command that prints to a closed pipe (`rlc openapi | head -1`) leave quietly, as
/// command-line tools do, instead of panicking with "failed printing to stdout: Broken pipe"
/// and a backtrace: that panic exits with status 141 (128 + SIGPIPE) and prints nothing. Any
/// other panic goes to the default hook.
pub fn quiet_on_closed_pipe() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or_default();
        if msg.contains("Broken pipe") && (msg.contains("stdout") || msg.contains("stderr")) {
            std::process::exit(141);
        }
        default(info);
    }));
}
