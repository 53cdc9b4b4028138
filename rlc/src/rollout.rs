//! Rollouts (`rollout:` in `rlc/policies.yaml`): every change of the base branch that could
//! refuse more traffic ([`rlc_plan::rollout::could_refuse_more`]) reaches the controllers as a
//! *candidate* beside the limit in force, stage by stage (`rollout.stages`, regions of the
//! controllers in rlc.yaml), and is promoted or aborted on the controllers' counts
//! (`GET /v1/candidates`) by [`grl_wire::rollout::judge`].
//!
//! rlc decides (it has the config repo, every region's controller and the store); a
//! controller only evaluates the candidates it is given. The state lives in the store
//! (`rollouts`, `rollout_counts`), so it survives restarts of rlc, and the counts are kept per
//! controller process (`epoch`), so a controller restart loses and double-counts nothing.
//!
//! - [`account`]: a new base version is compared with the last one accounted (the store's
//!   cursor `rollout.accounted`); each change that could refuse more becomes a rollout, an
//!   open rollout whose bucket changed again is superseded.
//! - [`desired_for`]: what one region's controller runs: the base, except that a bucket under
//!   a rollout keeps its spec in force until its region's stage passed, and the region of the
//!   current stage gets the new spec as a candidate.
//! - [`observe`] and [`judge`]: counts in, verdicts out. A `global` candidate that each
//!   controller counts on its own region's traffic only ([`judged_on_fleet`]) is one stage of
//!   every region and judged on their sum ([`FleetTally`]).

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use rlc_plan::rollout::{could_refuse_more, digest, fingerprint, Aborted};
use schema::{Bucket, BucketFile, PoliciesFile, RolloutSettings, Scope};
use serde::{Deserialize, Serialize};

use crate::push::CandidatesPage;
use crate::store::{CountRow, RolloutRow, Store, StoreError};
use grl_wire::ConfigDoc;

mod driver;
mod state;
#[cfg(test)]
mod tests;

pub use driver::*;
pub use state::*;
