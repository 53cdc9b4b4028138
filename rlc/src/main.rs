//! The `rlc` command line.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "rlc",
    version,
    about = "Rate Limit Configurator: keeps quotas right from traffic history",
    after_help = rlc::exit::HELP
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Log lines on stderr as text or one JSON object per line (level: RUST_LOG; default
    /// info for `rlc serve`, warn otherwise; colours only on a terminal).
    #[arg(long, global = true, value_enum, default_value = "text")]
    log_format: grl_server::logging::LogFormat,
}

#[derive(Subcommand)]
enum Command {
    /// Check a config repo: every file, every rule; all problems with file:line.
    Validate {
        /// The config repo's root directory.
        dir: PathBuf,
        /// Output format.
        #[arg(long, default_value = "text", value_parser = ["text", "json"])]
        format: String,
        /// Also pull the history (the source of `--config`) and warn about every active
        /// contract whose caller and procedure sent no traffic in the window.
        #[arg(long)]
        history: bool,
        /// The daemon config whose history `--history` reads.
        #[arg(long, default_value = "rlc.yaml", requires = "history")]
        config: PathBuf,
    },
    /// Print the JSON Schema of every file format (for editors).
    Schema,
    /// Print the OpenAPI 3.1 document of `rlc serve`'s HTTP API (what it serves at
    /// /openapi.json; docs/openapi.json is this output).
    Openapi,
    /// Compute quotas and print them (table or JSON); writes nothing.
    #[command(after_help = PREVIEW_EXIT)]
    Preview(rlc::cmd::preview::PreviewArgs),
    /// One full cycle: history → policies → git → controller → store.
    #[command(after_help = rlc::exit::HELP)]
    Run(rlc::cmd::run::RunArgs),
    /// The daemon: schedule, input-change and API triggers, dashboard.
    Serve(rlc::serve::ServeArgs),
    /// Score policies on history they did not see.
    Backtest(rlc::cmd::backtest::BacktestArgs),
    /// Run the whole loop on embedded defaults: bundled history, a local config repo made
    /// from the template, an in-process GRL controller.
    Demo(rlc::cmd::demo::DemoArgs),
}

/// Exit codes of `rlc preview` (a subset of [`rlc::exit::HELP`]).
const PREVIEW_EXIT: &str = "\
Exit codes:
  0   done
  1   the history failed for every service (current quotas shown)
  4   the history failed for some services (they show their current quotas)
  64  usage error
  78  config error (rlc.yaml missing or invalid, config repo with problems)";

fn main() -> ExitCode {
    // `rlc __plugin-host …`: this process is the host of one policy plugin (hidden; started by
    // rlc itself, see docs/rlc-policies.md). Decided before anything else runs.
    let mut args = std::env::args_os().skip(1).peekable();
    if args.peek().is_some_and(|a| a == policies::host::HOST_ARG) {
        std::process::exit(policies::host::main(args));
    }
    policies::isolated::host_is_current_exe();
    grl_server::logging::quiet_on_closed_pipe();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // --help and --version print to stdout and succeed; every other parse error is a
            // usage error (EX_USAGE, not clap's 2, which means "push pending" here).
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() {
                rlc::exit::USAGE as u8
            } else {
                rlc::exit::OK as u8
            });
        }
    };
    // The daemon logs what it does at info; one-shot commands only warnings (their output
    // is the report).
    let level = if matches!(cli.command, Command::Serve(_)) {
        "info"
    } else {
        "warn"
    };
    grl_server::logging::init(cli.log_format, level);
    let result = match cli.command {
        Command::Validate {
            dir,
            format,
            history: false,
            ..
        } => rlc::cmd::validate::run(&dir, &format),
        Command::Validate {
            dir,
            format,
            config,
            ..
        } => on_runtime(rlc::cmd::validate::run_with_history(&dir, &format, &config)),
        Command::Schema => {
            println!(
                "{}",
                serde_json::to_string_pretty(&schema::json_schema()).expect("schema serialises")
            );
            Ok(0)
        }
        Command::Openapi => {
            print!("{}", rlc::serve::openapi::document_json());
            Ok(0)
        }
        Command::Preview(args) => on_runtime(rlc::cmd::preview::run(args)),
        Command::Run(args) => on_runtime(rlc::cmd::run::run(args, rlc::cycle::compute::planner())),
        Command::Serve(args) => on_runtime(rlc::serve::run(args, rlc::cycle::compute::planner())),
        Command::Backtest(args) => on_runtime(rlc::cmd::backtest::run(args)),
        Command::Demo(args) => on_runtime(rlc::cmd::demo::run(args)),
    };
    match result {
        Ok(code) => ExitCode::from(code as u8),
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(rlc::exit::code_of(&e) as u8)
        }
    }
}

/// Runs `work` to its end, then leaves: a blocking task still stuck (a git operation on a
/// remote that never answers, until its own timeout) does not keep the process alive past a
/// shutdown, whose work is finished or abandoned by then.
fn on_runtime<T>(work: impl std::future::Future<Output = T>) -> T {
    let rt = runtime();
    let out = rt.block_on(work);
    rt.shutdown_timeout(std::time::Duration::from_millis(500));
    out
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime starts")
}
