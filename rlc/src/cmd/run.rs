//! `rlc run --config rlc.yaml --once [--json]`: one full cycle ([`crate::cycle::Cycle`]).

use std::path::PathBuf;

use crate::config::load_config;
use crate::cycle::{Cycle, Planner};

/// `rlc run`.
#[derive(Debug, Clone, clap::Args)]
pub struct RunArgs {
    /// The daemon config (rlc.yaml).
    #[arg(long, default_value = "rlc.yaml")]
    pub config: PathBuf,
    /// Run one full cycle and exit (the only mode of `rlc run`; `rlc serve` is the daemon).
    #[arg(long)]
    pub once: bool,
    /// Print the outcome as JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `rlc run --once`: one full cycle; prints a summary; returns the exit status
/// ([`crate::cycle::RunOutcome::exit_code`]).
pub async fn run(args: RunArgs, planner: Planner) -> anyhow::Result<i32> {
    if !args.once {
        eprintln!("rlc run needs --once (one cycle); use `rlc serve` for the scheduled daemon");
        return Ok(crate::exit::USAGE);
    }
    let (cfg, base) = load_config(&args.config)?;
    let cycle = Cycle::new(cfg, &base);
    let out = cycle.run(&planner, "once").await;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        print!("{out}");
    }
    Ok(out.exit_code())
}
