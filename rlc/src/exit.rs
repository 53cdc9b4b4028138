//! Exit codes of the `rlc` commands: one code per outcome, so that scripts can tell "done"
//! from "some services kept their quotas" from "fix your rlc.yaml". The same table is in
//! README.md and in `rlc --help`.

/// Done: everything computed (and, for `rlc run`, committed or proposed and delivered).
pub const OK: i32 = 0;
/// Failed, nothing written: git refused or was unreachable, the plan could not be computed,
/// the history source failed for every service, `rlc validate` found problems.
pub const FAILED: i32 = 1;
/// `rlc run`: committed (or proposed), but the controller push or the run record is pending.
pub const PENDING: i32 = 2;
/// `rlc run`: the pull-request branch has commits by people and was left alone.
pub const HELD: i32 = 3;
/// Done, but the history failed or was incomplete for some services, which kept their
/// current quotas (listed in `skipped`; `history_failed` in the JSON).
pub const PARTIAL: i32 = 4;
/// Usage error: unknown or missing arguments (`rlc run` without `--once`), as EX_USAGE.
pub const USAGE: i32 = 64;
/// Config or input error: `rlc.yaml` missing or invalid, a config repo with problems
/// (`rlc preview`, `rlc backtest`); nothing ran (EX_CONFIG).
pub const CONFIG: i32 = 78;

/// The exit-code table printed by `rlc --help`.
pub const HELP: &str = "\
Exit codes:
  0   done
  1   failed, nothing written (git refused or unreachable, plan not computable,
      history failed for every service; validate: problems found)
  2   run: committed or proposed, but the controller push or the run record is pending
  3   run: the pull-request branch has commits by people and was left alone
  4   done, but the history failed for some services; they kept their current quotas
  64  usage error (unknown or missing arguments, `rlc run` without --once)
  78  config error (rlc.yaml missing or invalid; preview/backtest: config repo has problems)";

/// An error in what the user gave rlc (a missing or invalid `rlc.yaml`, a config repo with
/// problems): `main` exits with [`CONFIG`] when one is in an error's chain.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

/// The exit code for an error returned by a command: [`CONFIG`] for a [`ConfigError`]
/// anywhere in its chain, [`FAILED`] otherwise.
pub fn code_of(e: &anyhow::Error) -> i32 {
    if e.chain().any(|c| c.downcast_ref::<ConfigError>().is_some()) {
        CONFIG
    } else {
        FAILED
    }
}
