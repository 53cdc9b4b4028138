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

use crate::push::{CandidatesPage, ConfigDoc};
use crate::store::{CountRow, RolloutRow, Store, StoreError};

/// The store cursor holding the base version last accounted and its bucket files.
pub const ACCOUNTED: &str = "rollout.accounted";

/// Where a rollout is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum RolloutState {
    /// Its candidate is watched in the current stage's regions.
    Baking,
    /// Every stage passed: the new spec is in force everywhere.
    Done,
    /// A stage failed: the spec in force stays everywhere, and the config repo was (or is
    /// being) brought back in line.
    Aborted,
    /// The bucket changed again on the base branch before the rollout ended: a rollout of the
    /// newer change (or the change itself, when it cannot refuse more) replaced it.
    Superseded,
}

impl RolloutState {
    /// The word stored and shown.
    pub fn as_str(self) -> &'static str {
        match self {
            RolloutState::Baking => "baking",
            RolloutState::Done => "done",
            RolloutState::Aborted => "aborted",
            RolloutState::Superseded => "superseded",
        }
    }
}

/// The counts of the current stage (summed over its regions and their controller processes).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct StageFigures {
    /// Requests offered to the bucket while the candidate was watched.
    pub offered: f64,
    /// Requests the candidate would have refused.
    pub virtual_dropped: f64,
    /// Requests the limit in force refused meanwhile (real drops).
    pub enforced_dropped: f64,
}

impl StageFigures {
    /// `virtual_dropped / offered` (0 when nothing was offered).
    pub fn share(&self) -> f64 {
        if self.offered > 0.0 {
            self.virtual_dropped / self.offered
        } else {
            0.0
        }
    }
}

/// Whether the candidate `new`, replacing `old` (the spec in force; None: a new bucket), must
/// be judged on the sum of every region's counts: a `global` candidate that each region's
/// controller counts on its own region's traffic only. A controller reads a candidate from the
/// in-force bucket of its name when that matches the same caller and procedure, else from the
/// calls its zones report; its peers forward the sums of `global` buckets in force and no
/// calls. So a `global` candidate of a `global` bucket of the same match counts the whole
/// fleet at every controller (judged as it is), and any other `global` candidate — a new
/// bucket, a scope widened to `global`, another caller or procedure — counts one region.
pub fn judged_on_fleet(old: Option<&Bucket>, new: &Bucket) -> bool {
    new.scope == Scope::Global
        && !old.is_some_and(|o| {
            o.scope == Scope::Global && o.caller == new.caller && o.procedure == new.procedure
        })
}

/// The fleet's counts of a rollout judged on the sum of every region ([`judged_on_fleet`]),
/// taken interval by interval ([`fleet_step`]): what was offered fleet-wide, what the
/// candidate's limit would have refused of the fleet's rate, and where each controller
/// process's cumulative counts stood when they were last taken.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FleetTally {
    /// Requests offered in every region, up to the marks.
    pub offered: f64,
    /// Requests the candidate would have refused of the fleet's rate, up to the marks.
    pub virtual_dropped: f64,
    /// Each controller process's cumulative counts when they were last taken.
    #[serde(default)]
    pub marks: Vec<CountMark>,
}

/// A controller process's cumulative counts of a candidate at a point in time.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CountMark {
    /// Its region.
    pub region: String,
    /// Its process (`epoch`).
    pub epoch: String,
    /// Seconds evaluated.
    pub seconds: f64,
    /// Requests offered.
    pub offered: f64,
    /// Requests its own counting would have refused.
    pub virtual_dropped: f64,
}

/// One look at the counts of a stage judged on the fleet: `counts` (every controller
/// process's cumulative counts) since `t`'s marks, summed per region of `regions`.
///
/// When the controller of every region evaluated the candidate since the marks (its seconds
/// moved on), that interval is taken: the fleet's rate over it is the sum of the regions'
/// rates (requests offered over seconds evaluated), and the requests the candidate's `limit`
/// would have refused are the larger of `drop_ratio(fleet rate, limit) × offered` (the
/// controllers' formula, [`grl_core::control::drop_ratio`], on the fleet's rate) and the
/// regions' own virtual drops (each controller's, tick by tick, on its own region's rate).
/// Both are at most what the fleet would refuse (the ratio is convex in the rate, and no
/// region's rate is above the fleet's), so the judgement is never stricter than enforcement;
/// a peak shorter than the interval (rlc's poll) is seen only as far as one region's
/// controller saw it alone. Otherwise (a region's controller did not get the candidate or
/// could not be read) the marks stay and the counts since them add only the regions' own
/// virtual drops: no fleet rate without every region, and the stage cannot pass without
/// every region's counts anyway ([`grl_wire::rollout::COVERAGE`]).
///
/// Returns the tally and the stage's figures (`enforced_dropped`: the regions' real drops).
pub fn fleet_step(
    t: &FleetTally,
    counts: &[CountRow],
    regions: &[String],
    limit: f64,
) -> (FleetTally, StageFigures) {
    // Per region: seconds, offered and virtual drops since the marks.
    let mut since = vec![[0.0f64; 3]; regions.len()];
    let mut enforced = 0.0;
    let mut marks = Vec::new();
    for c in counts {
        let Some(i) = regions.iter().position(|r| *r == c.region) else {
            continue;
        };
        enforced += c.enforced_dropped;
        let now = [c.seconds, c.offered, c.virtual_dropped];
        // A process counted from zero again (its candidate dropped and given back) starts
        // from zero here too.
        let from = t
            .marks
            .iter()
            .find(|m| m.region == c.region && m.epoch == c.epoch)
            .map(|m| [m.seconds, m.offered, m.virtual_dropped])
            .filter(|m| (0..3).all(|k| now[k] >= m[k]))
            .unwrap_or_default();
        for k in 0..3 {
            since[i][k] += now[k] - from[k];
        }
        marks.push(CountMark {
            region: c.region.clone(),
            epoch: c.epoch.clone(),
            seconds: c.seconds,
            offered: c.offered,
            virtual_dropped: c.virtual_dropped,
        });
    }
    let offered: f64 = since.iter().map(|d| d[1]).sum();
    let own: f64 = since.iter().map(|d| d[2]).sum();
    if !regions.is_empty() && since.iter().all(|d| d[0] > 0.0) {
        let rate: f64 = since.iter().map(|d| d[1] / d[0]).sum();
        let fleet = grl_core::control::drop_ratio(rate, limit) * offered;
        let next = FleetTally {
            offered: t.offered + offered,
            virtual_dropped: t.virtual_dropped + fleet.max(own),
            marks,
        };
        let f = StageFigures {
            offered: next.offered,
            virtual_dropped: next.virtual_dropped,
            enforced_dropped: enforced,
        };
        (next, f)
    } else {
        let f = StageFigures {
            offered: t.offered + offered,
            virtual_dropped: t.virtual_dropped + own,
            enforced_dropped: enforced,
        };
        (t.clone(), f)
    }
}

/// One rollout, as the store keeps it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Rollout {
    /// Its id, also its candidate's id on the controllers.
    pub id: String,
    /// Callee service.
    pub service: String,
    /// Bucket.
    pub bucket: String,
    /// The spec in force before (None: a new bucket).
    pub old: Option<Bucket>,
    /// The spec of the base branch, rolled out.
    pub new: Bucket,
    /// The change in words (`lowered 3470 -> 100 rps`).
    pub change: String,
    /// The base version that brought the change.
    pub version: String,
    /// The settings it follows (from `rollout:` when it started).
    pub settings: RolloutSettings,
    /// The regions of each stage, in order.
    pub stages: Vec<Vec<String>>,
    /// The current stage (== `stages.len()` when done).
    pub stage: usize,
    /// When the current stage's candidate first reached a controller (Unix ms): the bake
    /// counts from there.
    pub stage_started_ms: Option<i64>,
    /// When the current stage began (Unix ms): the rollout was created, or the previous stage
    /// passed. `max_bake` counts from there, whether or not the candidate ever reached a
    /// controller. Absent in rows written before it existed: [`Rollout::stage_began`].
    #[serde(default)]
    pub stage_began_ms: Option<i64>,
    /// Where it is.
    pub state: RolloutState,
    /// Why it ended (aborted: the verdict and the evidence).
    #[serde(default)]
    pub reason: Option<String>,
    /// [`fingerprint`] of its inputs: an aborted change is not proposed again while they stay.
    pub fingerprint: String,
    /// Unix ms it was created.
    pub created_ms: i64,
    /// Unix ms of its last change.
    pub updated_ms: i64,
    /// The current (or last) stage's counts.
    #[serde(default)]
    pub figures: StageFigures,
    /// Aborted: how the config repo was brought back in line (the revert commit, the pull
    /// request comment), once done.
    #[serde(default)]
    pub revert: Option<String>,
    /// Aborted: the config repo still holds the new spec and must be brought back in line.
    #[serde(default)]
    pub revert_pending: bool,
    /// Aborted: the base branch no longer holds the new spec (reverted, or changed since);
    /// nothing is held on its account any more.
    #[serde(default)]
    pub settled: bool,
    /// Judged on the sum of every region's counts ([`judged_on_fleet`], more than one region):
    /// one stage of every region, and the fleet's counts so far. None: judged on the stage's
    /// counts as the controllers report them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fleet: Option<FleetTally>,
    /// The store row's revision it was read at (`None`: not stored yet): [`save`] writes it
    /// only over that revision, so a copy read before another process's write never
    /// overwrites it. Not part of the document.
    #[serde(skip)]
    pub rev: Option<i64>,
}

/// A rollout as `rlc run --json`, `GET /v1/quotas` and the dashboard show it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct RolloutView {
    /// Its id (the candidate's id on the controllers).
    pub id: String,
    /// Callee service.
    pub service: String,
    /// Bucket.
    pub bucket: String,
    /// The change in words.
    pub change: String,
    /// `baking`, `done`, `aborted` or `superseded` (`pending`: baking, its candidate not yet
    /// on a controller).
    pub state: String,
    /// The current stage, from 1 (`stages + 1` when done).
    pub stage: usize,
    /// How many stages.
    pub stages: usize,
    /// The regions of the current stage.
    pub regions: Vec<String>,
    /// When the current stage's bake began (RFC 3339).
    pub since: Option<DateTime<Utc>>,
    /// Seconds baked in the current stage.
    pub baked_seconds: f64,
    /// The bake each stage needs, in seconds.
    pub bake_seconds: f64,
    /// Requests offered in the current stage.
    pub offered: f64,
    /// Requests the candidate would have refused.
    pub virtual_dropped: f64,
    /// `virtual_dropped / offered`.
    pub virtual_drop_share: f64,
    /// Why it ended.
    pub reason: Option<String>,
    /// How the config repo was brought back in line after an abort.
    pub revert: Option<String>,
    /// The state in words: `baking in region a since 2026-12-01 22:00 UTC: 0.000 % virtual
    /// drops so far (0 of 1,200 offered)`.
    pub summary: String,
}

fn ms_time(ms: i64) -> Option<DateTime<Utc>> {
    DateTime::<Utc>::from_timestamp_millis(ms)
}

impl Rollout {
    /// Its row in the store.
    pub fn row(&self) -> RolloutRow {
        RolloutRow {
            id: self.id.clone(),
            service: self.service.clone(),
            bucket: self.bucket.clone(),
            state: self.state.as_str().into(),
            created_ms: self.created_ms,
            updated_ms: self.updated_ms,
            doc: serde_json::to_string(self).unwrap_or_default(),
            rev: self.rev.unwrap_or(0),
        }
    }

    /// From its row (None when the document cannot be read: logged).
    pub fn from_row(r: &RolloutRow) -> Option<Rollout> {
        match serde_json::from_str::<Rollout>(&r.doc) {
            Ok(x) => Some(Rollout {
                rev: Some(r.rev),
                ..x
            }),
            Err(e) => {
                tracing::warn!(id = %r.id, error = %e, "unreadable rollout in the store; ignored");
                None
            }
        }
    }

    /// The regions of the current stage (none when done).
    pub fn current_regions(&self) -> &[String] {
        self.stages
            .get(self.stage)
            .map(Vec::as_slice)
            .unwrap_or(&[])
    }

    /// The stage of `region` (None: no stage names it; it keeps the spec in force until the
    /// rollout is done).
    pub fn stage_of(&self, region: &str) -> Option<usize> {
        self.stages
            .iter()
            .position(|s| s.iter().any(|r| r == region))
    }

    /// When the current stage began (Unix ms). A row written before `stage_began_ms`
    /// existed: when its candidate first reached a controller, else its last change (a
    /// pending stage's row is written only when the stage begins).
    pub fn stage_began(&self) -> i64 {
        self.stage_began_ms
            .or(self.stage_started_ms)
            .unwrap_or(self.updated_ms)
    }

    /// Seconds baked in the current stage at `now_ms`.
    pub fn baked_seconds(&self, now_ms: i64) -> f64 {
        self.stage_started_ms
            .map(|s| ((now_ms - s).max(0)) as f64 / 1000.0)
            .unwrap_or(0.0)
    }

    /// The view at `now`.
    pub fn view(&self, now: DateTime<Utc>) -> RolloutView {
        let now_ms = now.timestamp_millis();
        let regions = self.current_regions().to_vec();
        let f = &self.figures;
        let pct = f.share() * 100.0;
        let state = match (self.state, self.stage_started_ms) {
            (RolloutState::Baking, None) => "pending".to_string(),
            (s, _) => s.as_str().to_string(),
        };
        let since = self.stage_started_ms.and_then(ms_time);
        let summary = match self.state {
            RolloutState::Baking => match since {
                None => {
                    let deadline = self.settings.max_bake.max(self.settings.bake);
                    let by = ms_time(self.stage_began())
                        .and_then(|t| Some(t + chrono::Duration::from_std(deadline).ok()?));
                    format!(
                        "pending: the candidate has not reached region {} yet{}",
                        regions.join(", "),
                        by.map(|t| format!(
                            " (aborted if it has not by {})",
                            t.format("%Y-%m-%d %H:%M:%S UTC")
                        ))
                        .unwrap_or_default()
                    )
                }
                Some(t) => format!(
                    "baking in region {} (stage {} of {}{}) since {}: {pct:.3} % virtual drops so far ({} of {} offered)",
                    regions.join(", "),
                    self.stage + 1,
                    self.stages.len(),
                    if self.fleet.is_some() {
                        "; a global limit, judged on the rate summed over every region"
                    } else {
                        ""
                    },
                    t.format("%Y-%m-%d %H:%M:%S UTC"),
                    fmt_count(f.virtual_dropped),
                    fmt_count(f.offered),
                ),
            },
            RolloutState::Done => format!(
                "done: in force in every region ({} stage(s))",
                self.stages.len()
            ),
            RolloutState::Aborted => format!(
                "aborted: {}",
                self.reason.as_deref().unwrap_or("no reason recorded")
            ),
            RolloutState::Superseded => format!(
                "superseded: {}",
                self.reason.as_deref().unwrap_or("the bucket changed again")
            ),
        };
        RolloutView {
            id: self.id.clone(),
            service: self.service.clone(),
            bucket: self.bucket.clone(),
            change: self.change.clone(),
            state,
            stage: self.stage + 1,
            stages: self.stages.len(),
            regions,
            since,
            baked_seconds: if self.state == RolloutState::Baking {
                self.baked_seconds(now_ms)
            } else {
                0.0
            },
            bake_seconds: self.settings.bake.as_secs_f64(),
            offered: f.offered,
            virtual_dropped: f.virtual_dropped,
            virtual_drop_share: f.share(),
            reason: self.reason.clone(),
            revert: self.revert.clone(),
            summary,
        }
    }

    /// As the plan's hold of an aborted change sees it.
    pub fn aborted(&self) -> Option<Aborted> {
        (self.state == RolloutState::Aborted).then(|| Aborted {
            service: self.service.clone(),
            bucket: self.bucket.clone(),
            fingerprint: self.fingerprint.clone(),
            limit_rps: self.new.limit_rps,
            reason: self.reason.clone().unwrap_or_default(),
        })
    }
}

/// A candidate limit baking beside the limit in force, as the views show it: `GET /v1/quotas`,
/// the dashboard's bucket page and its JSON twin, the overview and `rlc preview`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct CandidateView {
    /// The rollout's id (the candidate's id on the controllers).
    pub rollout_id: String,
    /// The candidate's limit (the base branch's new spec), requests per second.
    pub limit_rps: f64,
    /// The candidate's mode (`enforce` or `shadow`).
    pub mode: String,
    /// The current stage, from 1.
    pub stage: usize,
    /// How many stages.
    pub stages: usize,
    /// The regions of the current stage, where the candidate is evaluated.
    pub regions: Vec<String>,
    /// The regions whose stage passed: the candidate's limit is already in force there (empty
    /// in the first stage).
    pub in_force_regions: Vec<String>,
    /// `pending` (its candidate has not reached a controller of the stage yet) or `baking`.
    pub state: String,
    /// Share of the current stage's bake done, 0–1 (`baked_seconds / bake_seconds`, at most
    /// 1; a stage passes once every region of it evaluated the candidate long enough).
    pub bake_progress: f64,
    /// Seconds baked in the current stage.
    pub baked_seconds: f64,
    /// The bake each stage needs, in seconds.
    pub bake_seconds: f64,
}

/// What the controllers enforce of one bucket, as the views show it ([`enforced`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Enforced<'a> {
    /// The spec in force (None: not in force anywhere yet, a new bucket under rollout, or not
    /// in the config repo).
    pub spec: Option<&'a Bucket>,
    /// The candidate baking beside it, if any.
    pub candidate: Option<CandidateView>,
}

impl Rollout {
    /// Whether the controllers (those of the regions whose stage has not passed, for a
    /// baking one) still run the spec in force before it (`old`) instead of the base
    /// branch's `new`: baking, or aborted while the base branch still holds the new spec.
    /// The same rule as [`desired_for`].
    pub fn holds_spec_in_force(&self) -> bool {
        match self.state {
            RolloutState::Baking => true,
            RolloutState::Aborted => !self.settled,
            RolloutState::Done | RolloutState::Superseded => false,
        }
    }

    /// The candidate as the views show it (None unless baking).
    pub fn candidate_view(&self, now: DateTime<Utc>) -> Option<CandidateView> {
        if self.state != RolloutState::Baking {
            return None;
        }
        let bake = self.settings.bake.as_secs_f64();
        let baked = self.baked_seconds(now.timestamp_millis());
        Some(CandidateView {
            rollout_id: self.id.clone(),
            limit_rps: self.new.limit_rps,
            mode: self.new.mode.as_str().to_string(),
            stage: self.stage + 1,
            stages: self.stages.len(),
            regions: self.current_regions().to_vec(),
            in_force_regions: self.stages[..self.stage.min(self.stages.len())].concat(),
            state: if self.stage_started_ms.is_some() {
                "baking".into()
            } else {
                "pending".into()
            },
            bake_progress: if bake > 0.0 {
                (baked / bake).min(1.0)
            } else {
                1.0
            },
            baked_seconds: baked,
            bake_seconds: bake,
        })
    }
}

/// What the controllers enforce of a bucket whose spec on the base branch is `base` (None: not
/// there), given its newest rollout `newest`: the spec in force before a rollout that still
/// holds it ([`Rollout::holds_spec_in_force`]) and applies to the base's spec (as
/// [`desired_for`] decides: a rollout whose new spec the base no longer holds does not), with
/// its candidate while it bakes; else the base's spec.
pub fn enforced<'a>(
    base: Option<&'a Bucket>,
    newest: Option<&'a Rollout>,
    now: DateTime<Utc>,
) -> Enforced<'a> {
    match newest {
        Some(r) if base == Some(&r.new) && r.holds_spec_in_force() => Enforced {
            spec: r.old.as_ref(),
            candidate: r.candidate_view(now),
        },
        _ => Enforced {
            spec: base,
            candidate: None,
        },
    }
}

/// Stores `r`: inserted when it is not stored yet, else updated over the revision it was read
/// at ([`Rollout::rev`], moved on when written). `false`: nothing written, because another
/// process stored the rollout since (an insert of an id already stored, an update of a row
/// changed or deleted since): read it again rather than overwrite it.
pub async fn save(store: &Store, r: &mut Rollout) -> Result<bool, StoreError> {
    match r.rev {
        None => {
            let done = store.insert_rollout(&r.row()).await?;
            if done {
                r.rev = Some(0);
            }
            Ok(done)
        }
        Some(n) => {
            let done = store.update_rollout(&r.row()).await?;
            if done {
                r.rev = Some(n + 1);
            }
            Ok(done)
        }
    }
}

/// [`save`], a conflict being an error ([`StoreError::Conflict`]).
async fn save_or_conflict(store: &Store, r: &mut Rollout) -> Result<(), StoreError> {
    if save(store, r).await? {
        Ok(())
    } else {
        Err(StoreError::Conflict(format!("rollout {}", r.id)))
    }
}

/// A count as people read it (`1,200`, `0.5`).
pub fn fmt_count(v: f64) -> String {
    if v.fract().abs() > 1e-9 && v < 100.0 {
        return format!("{v:.1}");
    }
    let n = v.round() as i64;
    let s = n.abs().to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 {
        format!("-{out}")
    } else {
        out
    }
}

/// What the base branch holds, as rollouts read it.
#[derive(Debug, Clone)]
pub struct BaseInput<'a> {
    /// The base tip's bucket files and version.
    pub doc: &'a ConfigDoc,
    /// `rlc/policies.yaml` at the tip (its `rollout:` section).
    pub policies: Option<&'a PoliciesFile>,
    /// The digest of the tip's `rlc/*.yaml` (the fingerprint's inputs).
    pub inputs: &'a str,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Accounted {
    version: String,
    services: Vec<BucketFile>,
}

fn find<'a>(services: &'a [BucketFile], service: &str, bucket: &str) -> Option<&'a Bucket> {
    services
        .iter()
        .find(|f| f.service == service)
        .and_then(|f| f.buckets.iter().find(|b| b.name == bucket))
}

/// The change in words.
fn change_words(old: Option<&Bucket>, new: &Bucket) -> String {
    let rps = schema::format_rps;
    match old {
        None => format!("added {} rps ({})", rps(new.limit_rps), new.mode.as_str()),
        Some(o) => {
            let mut parts = Vec::new();
            if new.limit_rps < o.limit_rps {
                parts.push(format!(
                    "lowered {} -> {} rps",
                    rps(o.limit_rps),
                    rps(new.limit_rps)
                ));
            } else if new.limit_rps > o.limit_rps {
                parts.push(format!(
                    "raised {} -> {} rps",
                    rps(o.limit_rps),
                    rps(new.limit_rps)
                ));
            } else {
                parts.push(format!("{} rps", rps(new.limit_rps)));
            }
            if o.mode != new.mode {
                parts.push(format!("mode {} -> {}", o.mode.as_str(), new.mode.as_str()));
            }
            if o.scope != new.scope {
                parts.push(format!(
                    "scope {} -> {}",
                    o.scope.as_str(),
                    new.scope.as_str()
                ));
            }
            if o.caller != new.caller || o.procedure != new.procedure {
                parts.push("caller/procedure match changed".into());
            }
            parts.join(", ")
        }
    }
}

/// The stages of `settings` over the controllers' `regions`: each stage's regions, empty
/// stages left out; one stage of every region when none names a configured region.
pub fn resolve_stages(settings: &RolloutSettings, regions: &[String]) -> Vec<Vec<String>> {
    let stages: Vec<Vec<String>> = (0..settings.stages.len())
        .map(|i| {
            regions
                .iter()
                .filter(|r| settings.stage_of(r) == Some(i))
                .cloned()
                .collect::<Vec<_>>()
        })
        .filter(|s| !s.is_empty())
        .collect();
    if stages.is_empty() && !regions.is_empty() {
        // A typo, or `controller:` alone (region `default`): never a change applied at once
        // because no stage matched; every region bakes it, as one stage.
        tracing::warn!(stages = ?settings.stages, regions = ?regions, "rollout.stages names none of the configured regions: the change is rolled out to every region as one stage");
        return vec![regions.to_vec()];
    }
    stages
}

/// Whether a rollout of `new` replacing `old` over the controllers' `regions` is judged on
/// their sum: [`judged_on_fleet`], with more than one region (one region's counts are the
/// fleet's).
fn on_fleet(old: Option<&Bucket>, new: &Bucket, regions: &[String]) -> bool {
    regions.len() > 1 && judged_on_fleet(old, new)
}

/// Whether `r` must be judged on the fleet ([`judged_on_fleet`], its stages naming more than
/// one region) but is not (no `fleet`: started before rlc judged such candidates so, or
/// re-saved by an older rlc): [`judge`] never promotes it, whether or not the push that
/// restarts it ([`refleet`]) ran yet.
fn awaits_restart(r: &Rollout) -> bool {
    r.fleet.is_none()
        && r.stages.iter().map(Vec::len).sum::<usize>() > 1
        && judged_on_fleet(r.old.as_ref(), &r.new)
}

/// The stages of a rollout judged on the fleet: one stage of every region, whatever
/// `rollout.stages` says. A `global` limit in force in some regions only would be counted,
/// and enforced, on those regions' traffic alone (their peers forward nothing for it), so it
/// proves nothing about the fleet and protects nothing.
fn fleet_stages(
    service: &str,
    bucket: &str,
    settings: &RolloutSettings,
    regions: &[String],
) -> Vec<Vec<String>> {
    let all = vec![regions.to_vec()];
    if settings.stages.len() > 1 || settings.stages.concat().iter().all(|r| r != "*") {
        tracing::info!(service, bucket, stages = ?settings.stages, regions = ?regions, "a global candidate each controller counts on its own region's traffic is judged on every region's sum: one stage of every region, not rollout.stages");
    }
    all
}

/// A rollout's id (its candidate's id on the controllers): a digest of the bucket, the spec in
/// force, the new spec and the base version; with the regions when judged on their sum
/// (`fleet`), so that a fleet of other regions is another candidate, counted afresh.
fn rollout_id(
    service: &str,
    bucket: &str,
    old: Option<&Bucket>,
    new: &Bucket,
    version: &str,
    fleet: Option<&[String]>,
) -> String {
    let spec = |x: Option<&Bucket>| {
        x.map(|x| serde_json::to_string(x).unwrap_or_default())
            .unwrap_or_default()
    };
    let mut text = format!(
        "{service}\n{bucket}\n{}\n{}\n{version}",
        spec(old),
        spec(Some(new))
    );
    if let Some(regions) = fleet {
        let mut regions = regions.to_vec();
        regions.sort();
        text.push_str(&format!("\nfleet {}", regions.join(",")));
    }
    format!("rlc-{}", digest(text.as_bytes()))
}

/// The id of the rollout that restarts `superseded` ([`refleet`]): its change's
/// [`rollout_id`] (with `fleet`, the regions judged on their sum) and the superseded id. So it
/// is never an id already stored — not the superseded row's own (an older rlc re-saved it
/// without `fleet`), nor that of an earlier rollout of the change (the regions went
/// {a,b,c} -> {a,b} -> {a,b,c}) — while two rlc processes restarting the same row still make
/// the same one.
fn restart_id(superseded: &Rollout, fleet: Option<&[String]>) -> String {
    let change = rollout_id(
        &superseded.service,
        &superseded.bucket,
        superseded.old.as_ref(),
        &superseded.new,
        &superseded.version,
        fleet,
    );
    format!(
        "rlc-{}",
        digest(format!("{change}\nrestart of {}", superseded.id).as_bytes())
    )
}

/// Baking rollouts that must be judged on the fleet ([`judged_on_fleet`]) but are not one
/// stage of every configured region judged so — started before rlc judged such candidates on
/// the fleet, or the configured regions changed since — are superseded by a rollout of the
/// same change as one stage of every region, whose bake starts afresh (a region whose stage
/// had passed goes back to the spec in force meanwhile: it never refuses more than before).
/// With one region left, that is one stage of it without `fleet`: its controller's counts are
/// the fleet's, judged as they are.
///
/// The new rollout is stored before the old one is marked superseded, under an id of its own
/// ([`restart_id`]): the change is never left without a baking rollout holding it (which
/// would serve the new spec everywhere, un-gated). When another rlc process stored it first,
/// its row is taken as stored.
async fn refleet(
    store: &Store,
    open: &mut [Rollout],
    regions: &[String],
    now: DateTime<Utc>,
) -> Result<(), StoreError> {
    let now_ms = now.timestamp_millis();
    let mut want = regions.to_vec();
    want.sort();
    // With one region its controller's counts are the fleet's: one stage of it, judged on
    // them as they are.
    let fleet = regions.len() > 1;
    for slot in open.iter_mut() {
        if slot.state != RolloutState::Baking
            || regions.is_empty()
            || !judged_on_fleet(slot.old.as_ref(), &slot.new)
        {
            continue;
        }
        let mut have = slot.stages.concat();
        have.sort();
        if slot.fleet.is_some() == fleet && slot.stages.len() == 1 && have == want {
            continue;
        }
        let mut next = Rollout {
            id: restart_id(slot, fleet.then_some(regions)),
            stages: vec![regions.to_vec()],
            stage: 0,
            stage_started_ms: None,
            stage_began_ms: Some(now_ms),
            reason: None,
            created_ms: now_ms,
            updated_ms: now_ms,
            figures: StageFigures::default(),
            fleet: fleet.then(FleetTally::default),
            rev: None,
            ..slot.clone()
        };
        if !save(store, &mut next).await? {
            // Another process made it first (or this one, before a failure kept the old row
            // from being superseded): take it as stored.
            let stored = store
                .recent_rollouts(Some((&slot.service, &slot.bucket)), 1000)
                .await?
                .iter()
                .filter(|x| x.id == next.id)
                .find_map(Rollout::from_row);
            match stored {
                Some(x) => {
                    tracing::warn!(id = %x.id, "rollout restarted by another rlc process meanwhile");
                    next = x;
                }
                None => {
                    return Err(StoreError::Conflict(format!(
                        "rollout {} (the restart of {})",
                        next.id, slot.id
                    )))
                }
            }
        }
        let mut old = slot.clone();
        old.state = RolloutState::Superseded;
        old.reason = Some(if fleet {
            format!(
                "restarted as one stage of every region ({}) as rollout {}: a global candidate each controller counts on its own region's traffic is judged on their sum",
                regions.join(", "),
                next.id
            )
        } else {
            format!(
                "restarted as one stage of region {} as rollout {}: the only region left, its controller's counts are the fleet's",
                regions.join(", "),
                next.id
            )
        });
        old.updated_ms = now_ms;
        save_or_conflict(store, &mut old).await?;
        tracing::info!(superseded = %slot.id, id = %next.id, service = %next.service, bucket = %next.bucket, regions = %regions.join(","), fleet, "rollout restarted as one stage of every region (judged on their sum when more than one)");
        *slot = next;
    }
    Ok(())
}

/// Reads the rollouts in `states`.
pub async fn load(store: &Store, states: &[RolloutState]) -> Result<Vec<Rollout>, StoreError> {
    let names: Vec<&str> = states.iter().map(|s| s.as_str()).collect();
    Ok(store
        .rollouts_in(&names)
        .await?
        .iter()
        .filter_map(Rollout::from_row)
        .collect())
}

/// Whether `r` still acts on what the controllers run: baking, or aborted while the base
/// branch still holds its new spec.
fn is_open(r: &Rollout) -> bool {
    r.state == RolloutState::Baking || (r.state == RolloutState::Aborted && !r.settled)
}

/// The open rollouts: baking, or aborted while the base branch still holds the new spec
/// (the controllers keep the spec in force meanwhile).
pub async fn open(store: &Store) -> Result<Vec<Rollout>, StoreError> {
    let mut v = load(store, &[RolloutState::Baking, RolloutState::Aborted]).await?;
    v.retain(is_open);
    Ok(v)
}

/// Deletes the finished rollouts last changed before `before` (`store.rollout_retention`
/// ago), with their counts: done and superseded ones, and aborted ones no longer open (the
/// base branch no longer holds their change; such a change is no longer held back from
/// proposals once deleted). Open rollouts stay, however old. Returns how many went.
pub async fn prune(store: &Store, before: DateTime<Utc>) -> Result<u64, StoreError> {
    let before_ms = before.timestamp_millis();
    let mut n = 0;
    for st in [RolloutState::Done, RolloutState::Superseded] {
        n += store.delete_rollouts_before(st.as_str(), before_ms).await?;
    }
    let finished: Vec<String> = load(store, &[RolloutState::Aborted])
        .await?
        .into_iter()
        .filter(|r| !is_open(r) && r.updated_ms < before_ms)
        .map(|r| r.id)
        .collect();
    n += store.delete_rollouts(&finished).await?;
    Ok(n)
}

/// The aborted changes a plan holds ([`rlc_plan::rollout::hold_aborted`]).
pub async fn aborted_changes(store: &Store) -> Result<Vec<Aborted>, StoreError> {
    Ok(load(store, &[RolloutState::Aborted])
        .await?
        .iter()
        .filter_map(Rollout::aborted)
        .collect())
}

/// Records `doc` as accounted when nothing is yet (the first push with rollouts: what the
/// base held before is what is in force).
pub async fn ensure_accounted(store: &Store, doc: &ConfigDoc) -> Result<(), StoreError> {
    if store.cursor(ACCOUNTED).await?.is_none() {
        set_accounted(store, doc).await?;
    }
    Ok(())
}

async fn set_accounted(store: &Store, doc: &ConfigDoc) -> Result<(), StoreError> {
    let a = Accounted {
        version: doc.version.clone(),
        services: doc.services.clone(),
    };
    store
        .set_cursor(ACCOUNTED, &serde_json::to_string(&a).unwrap_or_default())
        .await
}

/// Accounts the base: compared with the version last accounted, each bucket change that could
/// refuse more traffic, of a service with `rollout:` settings, becomes a rollout (from the
/// spec in force: an open rollout's old spec, else the last accounted one); an open rollout
/// whose bucket changed again (or was removed) is superseded. `regions` are the controllers'
/// regions. Returns the open rollouts afterwards.
pub async fn account(
    store: &Store,
    regions: &[String],
    base: &BaseInput<'_>,
    now: DateTime<Utc>,
) -> Result<Vec<Rollout>, StoreError> {
    let mut open = open(store).await?;
    refleet(store, &mut open, regions, now).await?;
    // A restart another process stored first may have ended meanwhile.
    open.retain(is_open);
    let prev: Option<Accounted> = store
        .cursor(ACCOUNTED)
        .await?
        .and_then(|t| serde_json::from_str(&t).ok());
    let Some(prev) = prev else {
        set_accounted(store, base.doc).await?;
        return Ok(open);
    };
    if prev.version == base.doc.version {
        return Ok(open);
    }
    let now_ms = now.timestamp_millis();
    let mut changed: Vec<Rollout> = Vec::new();
    // Open rollouts whose bucket moved on.
    for r in open.iter_mut() {
        let cur = find(&base.doc.services, &r.service, &r.bucket);
        if cur == Some(&r.new) {
            continue;
        }
        match r.state {
            RolloutState::Baking => {
                r.state = RolloutState::Superseded;
                r.reason = Some(match cur {
                    Some(_) => format!(
                        "the bucket changed again at {}",
                        crate::gitops::short(&base.doc.version)
                    ),
                    None => format!(
                        "the bucket was removed at {}",
                        crate::gitops::short(&base.doc.version)
                    ),
                });
            }
            _ => {
                // Aborted: the base branch no longer holds the new spec (the revert, or
                // someone changed the bucket first).
                if r.revert_pending {
                    r.revert_pending = false;
                    r.revert = Some(format!(
                        "the bucket changed on the base branch at {} before rlc reverted it",
                        crate::gitops::short(&base.doc.version)
                    ));
                }
                r.settled = true;
            }
        }
        r.updated_ms = now_ms;
        changed.push(r.clone());
    }
    // What the controllers ran for the buckets whose rollout ends here: a superseded one's
    // old spec (never promoted everywhere), and an aborted one's (kept in force while the
    // base held the aborted change), not the spec the base held (`prev`).
    let ran: BTreeMap<(String, String), Option<Bucket>> = changed
        .iter()
        .filter(|r| matches!(r.state, RolloutState::Superseded | RolloutState::Aborted))
        .map(|r| ((r.service.clone(), r.bucket.clone()), r.old.clone()))
        .collect();
    let still_open: Vec<&Rollout> = open
        .iter()
        .filter(|r| r.state == RolloutState::Baking)
        .collect();
    let mut created = Vec::new();
    for f in &base.doc.services {
        let settings = base.policies.and_then(|p| p.rollout_for(&f.service));
        let Some(settings) = settings else { continue };
        for b in &f.buckets {
            if still_open
                .iter()
                .any(|r| r.service == f.service && r.bucket == b.name)
            {
                continue;
            }
            // The spec in force: what the controllers ran under a rollout ended just now,
            // else the one accounted last.
            let key = (f.service.clone(), b.name.clone());
            let in_force = match ran.get(&key) {
                Some(old) => old.clone(),
                None => find(&prev.services, &f.service, &b.name).cloned(),
            };
            if in_force.as_ref() == Some(b) || !could_refuse_more(in_force.as_ref(), b) {
                continue;
            }
            let fleet = on_fleet(in_force.as_ref(), b, regions);
            let stages = if fleet {
                fleet_stages(&f.service, &b.name, &settings, regions)
            } else {
                resolve_stages(&settings, regions)
            };
            if stages.is_empty() {
                continue;
            }
            created.push(Rollout {
                id: rollout_id(
                    &f.service,
                    &b.name,
                    in_force.as_ref(),
                    b,
                    &base.doc.version,
                    fleet.then_some(regions),
                ),
                service: f.service.clone(),
                bucket: b.name.clone(),
                change: change_words(in_force.as_ref(), b),
                fingerprint: fingerprint(&f.service, &b.name, in_force.as_ref(), base.inputs),
                old: in_force,
                new: b.clone(),
                version: base.doc.version.clone(),
                settings: settings.clone(),
                stages,
                stage: 0,
                stage_started_ms: None,
                stage_began_ms: Some(now_ms),
                state: RolloutState::Baking,
                reason: None,
                created_ms: now_ms,
                updated_ms: now_ms,
                figures: StageFigures::default(),
                revert: None,
                revert_pending: false,
                settled: false,
                fleet: fleet.then(FleetTally::default),
                rev: None,
            });
        }
    }
    // A rollout another process changed since it was read fails the accounting (the cursor
    // stays, so the next push accounts again on what the store then holds); one it created
    // already (the same change, the same id) is left as stored.
    for r in changed.iter_mut() {
        save_or_conflict(store, r).await?;
        tracing::info!(id = %r.id, service = %r.service, bucket = %r.bucket, state = r.state.as_str(), change = %r.change, "rollout");
    }
    for r in created.iter_mut() {
        if save(store, r).await? {
            tracing::info!(id = %r.id, service = %r.service, bucket = %r.bucket, state = r.state.as_str(), change = %r.change, "rollout");
        }
    }
    set_accounted(store, base.doc).await?;
    self::open(store).await
}

/// What the controller of `region` runs: `base`, with each bucket under an open rollout kept
/// at its spec in force (removed, for a new bucket) until the region's stage passed, and the
/// new spec as a candidate in the current stage's regions. The version is the base's, with
/// `+c<digest>` when the services or candidates differ from it.
pub fn desired_for(region: &str, base: &ConfigDoc, open: &[Rollout]) -> ConfigDoc {
    let mut doc = base.clone();
    let mut candidates = Vec::new();
    for r in open {
        if find(&base.services, &r.service, &r.bucket) != Some(&r.new) {
            continue;
        }
        let keep_old = match r.state {
            RolloutState::Baking => match r.stage_of(region) {
                Some(si) if si < r.stage => false,
                Some(si) => {
                    if si == r.stage {
                        candidates.push(grl_wire::Candidate {
                            id: r.id.clone(),
                            service: r.service.clone(),
                            bucket: r.new.clone(),
                        });
                    }
                    true
                }
                None => true,
            },
            RolloutState::Aborted => !r.settled,
            _ => false,
        };
        if !keep_old {
            continue;
        }
        if let Some(f) = doc.services.iter_mut().find(|f| f.service == r.service) {
            match &r.old {
                Some(old) => {
                    if let Some(b) = f.buckets.iter_mut().find(|b| b.name == r.bucket) {
                        *b = old.clone();
                    }
                }
                None => f.buckets.retain(|b| b.name != r.bucket),
            }
        }
    }
    candidates.sort_by(|a, b| a.id.cmp(&b.id));
    doc.candidates = candidates;
    if doc.services != base.services || !doc.candidates.is_empty() {
        let text = serde_json::to_string(&(&doc.services, &doc.candidates)).unwrap_or_default();
        doc.version = format!("{}+c{}", base.version, &digest(text.as_bytes())[..12]);
    }
    doc
}

/// Stores the counts `region`'s controller reported for the candidates rlc knows.
pub async fn observe(
    store: &Store,
    region: &str,
    page: &CandidatesPage,
    known: &[Rollout],
    now: DateTime<Utc>,
) -> Result<(), StoreError> {
    let rows: Vec<CountRow> = page
        .candidates
        .iter()
        .filter(|c| known.iter().any(|r| r.id == c.id))
        .map(|c| CountRow {
            rollout_id: c.id.clone(),
            region: region.to_string(),
            epoch: page.epoch.clone(),
            seconds: c.seconds,
            offered: c.offered,
            virtual_dropped: c.virtual_dropped,
            enforced_dropped: c.enforced_dropped,
            updated_ms: now.timestamp_millis(),
        })
        .collect();
    store.record_candidate_counts(&rows).await
}

/// What a judgement did to a rollout.
#[derive(Debug, Clone, PartialEq)]
pub enum Transition {
    /// Its stage passed; it bakes in the next one.
    Promoted {
        /// The rollout.
        id: String,
        /// The stage that passed (from 1).
        stage: usize,
    },
    /// Every stage passed.
    Done(String),
    /// A stage failed.
    Aborted(String),
}

/// Notes that the candidates of `region` reached its controller: a stage's bake starts when
/// its candidate first does.
pub async fn reached(
    store: &Store,
    open: &mut [Rollout],
    region: &str,
    now: DateTime<Utc>,
) -> Result<(), StoreError> {
    for slot in open.iter_mut() {
        if slot.state == RolloutState::Baking
            && slot.stage_started_ms.is_none()
            && slot.current_regions().iter().any(|x| x == region)
        {
            let mut r = slot.clone();
            r.stage_started_ms = Some(now.timestamp_millis());
            r.updated_ms = now.timestamp_millis();
            if save(store, &mut r).await? {
                *slot = r;
            } else {
                // Another process changed it since it was read (judged, superseded): what it
                // wrote stands; the next push reads it again.
                tracing::warn!(id = %slot.id, "rollout changed in the store meanwhile (another rlc process); its stage start is not recorded over it");
            }
        }
    }
    Ok(())
}

/// Judges every baking rollout on its current stage's counts ([`grl_wire::rollout::judge`]):
/// promoted to the next stage, done, or aborted with the evidence. A stage whose candidate
/// never reached a controller is judged too: aborted once it waited `max_bake` ("never ran").
/// Updates the store and `open`.
pub async fn judge(
    store: &Store,
    open: &mut [Rollout],
    now: DateTime<Utc>,
) -> Result<Vec<Transition>, StoreError> {
    use grl_wire::rollout::{judge as verdict_of, Observed, RolloutRule, Verdict};
    let now_ms = now.timestamp_millis();
    let mut out = Vec::new();
    for slot in open.iter_mut() {
        if slot.state != RolloutState::Baking {
            continue;
        }
        // Judged on a copy: `open` keeps what the store holds when another process wrote the
        // rollout since it was read.
        let mut next = slot.clone();
        let r = &mut next;
        let mut transition = None;
        let regions = r.current_regions().to_vec();
        let counts = store.candidate_counts(&r.id).await?;
        let (f, tally) = match &r.fleet {
            Some(t) => {
                let (t, f) = fleet_step(t, &counts, &regions, r.new.limit_rps);
                (f, Some(t))
            }
            None => {
                let mut f = StageFigures::default();
                for c in counts.iter().filter(|c| regions.contains(&c.region)) {
                    f.offered += c.offered;
                    f.virtual_dropped += c.virtual_dropped;
                    f.enforced_dropped += c.enforced_dropped;
                }
                (f, None)
            }
        };
        let baked = r.baked_seconds(now_ms);
        let rule = RolloutRule {
            bake: r.settings.bake,
            max_virtual_drop_share: r.settings.max_virtual_drop_share,
            min_offered: r.settings.min_offered,
            max_bake: r.settings.max_bake,
        };
        // Every region of the stage counts: the least-covered one's evaluation time, summed
        // over its controller's processes (none read yet: zero). A region's counts are current
        // only when its controller was read at this poll (`rlc serve` stores every region's
        // counts and judges at one time, `now`); one that could not be read covers nothing
        // until it is read again, so a region gone silent never lets the stage pass on the
        // seconds it covered before.
        let stale = |region: &String| {
            !counts
                .iter()
                .any(|c| &c.region == region && c.updated_ms >= now_ms)
        };
        let covered = regions
            .iter()
            .map(|region| {
                if stale(region) {
                    return 0.0;
                }
                counts
                    .iter()
                    .filter(|c| &c.region == region)
                    .map(|c| c.seconds)
                    .sum::<f64>()
            })
            .reduce(f64::min)
            .unwrap_or(0.0);
        let waited = ((now_ms - r.stage_began()).max(0)) as f64 / 1000.0;
        let seen = Observed {
            baked: std::time::Duration::from_secs_f64(baked),
            waited: std::time::Duration::from_secs_f64(waited),
            offered: f.offered,
            virtual_dropped: f.virtual_dropped,
            // A count that is not a finite positive number of seconds covers nothing.
            covered: std::time::Duration::try_from_secs_f64(covered).unwrap_or_default(),
        };
        let mut verdict = verdict_of(&rule, &seen);
        if verdict == Verdict::Promote && awaits_restart(r) {
            // Its stage's own counts prove nothing for a global limit (each controller counted
            // its own region): never promoted so; the next push restarts it on the fleet.
            tracing::warn!(id = %r.id, service = %r.service, bucket = %r.bucket, "a global candidate counted per region, not judged on the fleet yet: not promoted until restarted as one stage of every region");
            verdict = Verdict::Baking;
        }
        let changed = f != r.figures || (tally.is_some() && tally != r.fleet);
        r.figures = f.clone();
        if tally.is_some() {
            r.fleet = tally;
        }
        match verdict {
            Verdict::Baking => {
                if !changed {
                    continue;
                }
            }
            Verdict::Promote => {
                let passed = r.stage + 1;
                r.stage += 1;
                if r.stage >= r.stages.len() {
                    r.state = RolloutState::Done;
                    r.stage_started_ms = None;
                    transition = Some(Transition::Done(r.id.clone()));
                } else {
                    r.stage_started_ms = None;
                    r.stage_began_ms = Some(now_ms);
                    r.figures = StageFigures::default();
                    if r.fleet.is_some() {
                        r.fleet = Some(FleetTally::default());
                    }
                    transition = Some(Transition::Promoted {
                        id: r.id.clone(),
                        stage: passed,
                    });
                }
            }
            Verdict::Abort { reason }
                if r.stage_started_ms.is_none()
                    && !counts.iter().any(|c| regions.contains(&c.region)) =>
            {
                let evidence = format!(
                    "{reason}; in region {}: the candidate never reached the controller(s) in {} (unreachable, or older than grl-proto 5); they kept {}",
                    regions.join(", "),
                    schema::HumanDuration(std::time::Duration::from_secs(waited as u64)),
                    in_force_words(r),
                );
                r.state = RolloutState::Aborted;
                r.reason = Some(evidence);
                r.revert_pending = true;
                transition = Some(Transition::Aborted(r.id.clone()));
            }
            Verdict::Abort { reason } => {
                // The regions with no counts at all: their controller never got the
                // candidate, or could not be read.
                let silent: Vec<&str> = regions
                    .iter()
                    .filter(|x| !counts.iter().any(|c| &c.region == *x))
                    .map(String::as_str)
                    .collect();
                let mut silent = if silent.is_empty() {
                    String::new()
                } else {
                    format!(
                        "; no counts from region {} (its controller never ran the candidate, or could not be read)",
                        silent.join(", ")
                    )
                };
                let old_counts: Vec<&str> = regions
                    .iter()
                    .filter(|x| counts.iter().any(|c| &c.region == *x) && stale(x))
                    .map(String::as_str)
                    .collect();
                if !old_counts.is_empty() {
                    silent.push_str(&format!(
                        "; no current counts from region {} (its controller could not be read at this poll)",
                        old_counts.join(", ")
                    ));
                }
                let fleet = if r.fleet.is_some() {
                    " as one global limit on the rate summed over every region"
                } else {
                    ""
                };
                let evidence = format!(
                    "{reason}; in region {} over {} of bake: {} of {} offered requests ({:.3} %) would have been refused by the candidate's {} rps{fleet} (in force: {}; real drops meanwhile: {}){silent}",
                    regions.join(", "),
                    schema::HumanDuration(std::time::Duration::from_secs(baked.max(1.0) as u64)),
                    fmt_count(f.virtual_dropped),
                    fmt_count(f.offered),
                    f.share() * 100.0,
                    schema::format_rps(r.new.limit_rps),
                    in_force_words(r),
                    fmt_count(f.enforced_dropped),
                );
                r.state = RolloutState::Aborted;
                r.reason = Some(evidence);
                r.revert_pending = true;
                transition = Some(Transition::Aborted(r.id.clone()));
            }
        }
        r.updated_ms = now_ms;
        if !save(store, r).await? {
            tracing::warn!(id = %r.id, "rollout changed in the store meanwhile (another rlc process); judged again at the next poll");
            continue;
        }
        match &transition {
            Some(Transition::Aborted(_)) => {
                tracing::warn!(id = %r.id, service = %r.service, bucket = %r.bucket, reason = r.reason.as_deref().unwrap_or(""), "rollout aborted")
            }
            Some(Transition::Promoted { stage, .. }) => {
                tracing::info!(id = %r.id, service = %r.service, bucket = %r.bucket, stage, regions = %regions.join(","), offered = f.offered, virtual_dropped = f.virtual_dropped, "rollout stage passed")
            }
            Some(Transition::Done(_)) => {
                tracing::info!(id = %r.id, service = %r.service, bucket = %r.bucket, stage = r.stages.len(), regions = %regions.join(","), offered = f.offered, virtual_dropped = f.virtual_dropped, "rollout stage passed; done")
            }
            None => {}
        }
        *slot = next;
        out.extend(transition);
    }
    Ok(out)
}

/// The spec in force of `r` in words (`3470 rps enforce`, `no bucket`).
pub(crate) fn in_force_words(r: &Rollout) -> String {
    r.old
        .as_ref()
        .map(|o| {
            format!(
                "{} rps {}",
                schema::format_rps(o.limit_rps),
                o.mode.as_str()
            )
        })
        .unwrap_or_else(|| "no bucket".into())
}

/// Marks the config repo of aborted `r` as back in line (`how`: the revert commit or the
/// pull-request comment).
pub async fn reverted(
    store: &Store,
    r: &mut Rollout,
    how: String,
    now: DateTime<Utc>,
) -> Result<(), StoreError> {
    let mut next = r.clone();
    next.revert_pending = false;
    next.revert = Some(how);
    next.updated_ms = now.timestamp_millis();
    save_or_conflict(store, &mut next).await?;
    *r = next;
    Ok(())
}

/// The newest rollout of each bucket (for the quota API and the dashboard), and every recent
/// one for the state gauge.
pub async fn latest_by_bucket(
    store: &Store,
    limit: i64,
) -> Result<BTreeMap<(String, String), Rollout>, StoreError> {
    let mut out = BTreeMap::new();
    for row in store.recent_rollouts(None, limit).await? {
        if let Some(r) = Rollout::from_row(&row) {
            out.entry((r.service.clone(), r.bucket.clone()))
                .or_insert(r);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A rollout stored before `stage_began_ms` existed: its stage began when its candidate
    /// first reached a controller, else (pending: its row is written only when the stage
    /// begins) at its last change; so a stage pending since before an upgrade still ends.
    #[test]
    fn a_row_stored_before_stage_began_existed_begins_its_stage_at_its_last_change() {
        let r = Rollout {
            id: "rlc-1".into(),
            service: "pay".into(),
            bucket: "gw".into(),
            old: Some(crate::gitops::tests::planned("pay", "gw", 3470.0).bucket),
            new: crate::gitops::tests::planned("pay", "gw", 100.0).bucket,
            change: "lowered 3470 -> 100 rps".into(),
            version: "abc".into(),
            settings: schema::RolloutSpec::default().resolved(),
            stages: vec![vec!["eu".into()]],
            stage: 0,
            stage_started_ms: None,
            stage_began_ms: Some(1_000),
            state: RolloutState::Baking,
            reason: None,
            fingerprint: "fp".into(),
            created_ms: 1_000,
            updated_ms: 5_000,
            figures: StageFigures::default(),
            revert: None,
            revert_pending: false,
            settled: false,
            fleet: None,
            rev: Some(3),
        };
        assert_eq!(r.stage_began(), 1_000);
        let mut doc = serde_json::to_value(&r).unwrap();
        doc.as_object_mut().unwrap().remove("stage_began_ms");
        assert!(
            doc.get("rev").is_none(),
            "the revision is the row's, not the document's"
        );
        let old: Rollout = serde_json::from_value(doc).unwrap();
        assert_eq!(old.stage_began_ms, None);
        assert_eq!(old.stage_began(), 5_000);
        let reached = Rollout {
            stage_started_ms: Some(4_000),
            ..old
        };
        assert_eq!(reached.stage_began(), 4_000);
    }

    pub(super) fn gw(scope: Scope, limit: f64) -> Bucket {
        Bucket {
            scope,
            ..crate::gitops::tests::planned("payments", "gw", limit).bucket
        }
    }

    pub(super) fn regions(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    /// Cumulative counts of one controller process: `rps` offered for `seconds`, `own`
    /// virtually dropped by its own counting.
    fn count(region: &str, epoch: &str, seconds: f64, rps: f64, own: f64) -> CountRow {
        CountRow {
            rollout_id: "rlc-1".into(),
            region: region.into(),
            epoch: epoch.into(),
            seconds,
            offered: rps * seconds,
            virtual_dropped: own,
            enforced_dropped: 0.0,
            updated_ms: 0,
        }
    }

    /// Which `global` candidates each controller counts on its own region only: a new bucket,
    /// a scope widened to `global`, another caller; not a `global` bucket of the same match
    /// (its peers' sums are part of it), nor a narrower scope.
    #[test]
    fn a_global_candidate_counted_per_region_is_judged_on_the_fleet() {
        let global = gw(Scope::Global, 1000.0);
        assert!(judged_on_fleet(None, &global));
        assert!(judged_on_fleet(Some(&gw(Scope::Region, 3470.0)), &global));
        assert!(judged_on_fleet(Some(&gw(Scope::Zone, 3470.0)), &global));
        let other_caller = Bucket {
            caller: Some("web".into()),
            ..gw(Scope::Global, 3470.0)
        };
        assert!(judged_on_fleet(Some(&other_caller), &global));
        assert!(!judged_on_fleet(Some(&gw(Scope::Global, 3470.0)), &global));
        let shadow = Bucket {
            mode: schema::Mode::Shadow,
            ..gw(Scope::Global, 1000.0)
        };
        assert!(!judged_on_fleet(Some(&shadow), &global));
        assert!(!judged_on_fleet(None, &gw(Scope::Region, 1000.0)));
        // One region's counts are the fleet's.
        assert!(!on_fleet(None, &global, &regions(&["eu"])));
        assert!(on_fleet(None, &global, &regions(&["a", "b"])));
    }

    /// Three regions at 600 rps each against a global 1,000: every controller alone saw no
    /// virtual drop (600 < 1,000), which summed as counts passes the stage; on the regions'
    /// summed rate (1,800) the candidate refuses 800 of every 1,800 requests.
    #[test]
    fn three_regions_under_a_global_limit_alone_are_judged_on_their_rate_summed() {
        let abc = regions(&["a", "b", "c"]);
        let counts: Vec<CountRow> = ["a", "b", "c"]
            .iter()
            .map(|r| count(r, "e1", 10.0, 600.0, 0.0))
            .collect();
        let (t, f) = fleet_step(&FleetTally::default(), &counts, &abc, 1000.0);
        assert_eq!(f.offered, 18_000.0);
        assert!((f.share() - 800.0 / 1800.0).abs() < 1e-9, "{f:?}");
        assert_eq!(
            (t.offered, t.virtual_dropped),
            (f.offered, f.virtual_dropped)
        );
        assert_eq!(t.marks.len(), 3);
        // The next interval adds only what came since: 10 s more at 300 rps each (900 < 1,000).
        let later: Vec<CountRow> = ["a", "b", "c"]
            .iter()
            .map(|r| CountRow {
                offered: 6000.0 + 3000.0,
                ..count(r, "e1", 20.0, 0.0, 0.0)
            })
            .collect();
        let (t2, f2) = fleet_step(&t, &later, &abc, 1000.0);
        assert_eq!(f2.offered, 27_000.0);
        assert!(
            (f2.virtual_dropped - f.virtual_dropped).abs() < 1e-9,
            "{f2:?}"
        );
        assert_eq!(t2.marks[0].seconds, 20.0);
    }

    /// Without every region's counts since the last interval no fleet rate is taken: the
    /// marks stay and the figures add the regions' own virtual drops only; once the silent
    /// region's counts arrive, the whole interval is taken at the fleet's rate. A controller
    /// restarted (a new epoch) counts from zero; a process counting from zero again is taken
    /// from zero.
    #[test]
    fn the_fleet_rate_waits_for_every_region() {
        let abc = regions(&["a", "b", "c"]);
        let two = vec![
            count("a", "e1", 10.0, 600.0, 0.0),
            count("b", "e1", 10.0, 600.0, 0.0),
        ];
        let (t, f) = fleet_step(&FleetTally::default(), &two, &abc, 1000.0);
        assert_eq!(t, FleetTally::default());
        assert_eq!((f.offered, f.virtual_dropped), (12_000.0, 0.0));
        let mut all = two.clone();
        all.push(count("c", "e1", 10.0, 600.0, 0.0));
        let (t, f) = fleet_step(&t, &all, &abc, 1000.0);
        assert!((f.share() - 800.0 / 1800.0).abs() < 1e-9, "{f:?}");
        // b restarted: its old process's counts stay, a new one counts 10 s; c's process
        // counts from zero again (5 s).
        let mut next = vec![
            count("a", "e1", 20.0, 600.0, 0.0),
            count("b", "e1", 10.0, 600.0, 0.0),
            count("b", "e2", 10.0, 600.0, 0.0),
            count("c", "e1", 5.0, 600.0, 0.0),
        ];
        let (t2, f2) = fleet_step(&t, &next, &abc, 1000.0);
        assert_eq!(f2.offered, 18_000.0 + 6000.0 + 6000.0 + 3000.0);
        assert!((f2.share() - 800.0 / 1800.0).abs() < 1e-9, "{f2:?}");
        // A region's own virtual drops above the fleet estimate (a peak its controller saw
        // tick by tick within the interval) count.
        next = t2
            .marks
            .iter()
            .map(|m| CountRow {
                seconds: m.seconds + 10.0,
                offered: m.offered + 1000.0,
                virtual_dropped: m.virtual_dropped + if m.region == "a" { 700.0 } else { 0.0 },
                ..count(&m.region, &m.epoch, 0.0, 0.0, 0.0)
            })
            .collect();
        let (_, f3) = fleet_step(&t2, &next, &abc, 1000.0);
        assert!(
            (f3.virtual_dropped - f2.virtual_dropped - 700.0).abs() < 1e-9,
            "{f3:?}"
        );
    }

    /// A rollout of a global candidate counted per region started before rlc judged such
    /// candidates on the fleet (two stages, the first passed): superseded by a rollout of the
    /// same change as one stage of every region, judged on their sum, its bake afresh; the
    /// region whose stage had passed goes back to the spec in force with the candidate.
    #[tokio::test]
    async fn a_staged_rollout_of_a_global_candidate_is_restarted_as_one_stage_of_every_region() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::connect("sqlite://rlc.db", dir.path()).await.unwrap();
        let old = gw(Scope::Region, 3470.0);
        let new = gw(Scope::Global, 1000.0);
        let mut staged = Rollout {
            id: "rlc-staged".into(),
            service: "payments".into(),
            bucket: "gw".into(),
            old: Some(old.clone()),
            new: new.clone(),
            change: change_words(Some(&old), &new),
            version: "v2".into(),
            settings: schema::RolloutSpec::default().resolved(),
            stages: vec![regions(&["a"]), regions(&["b", "c"])],
            stage: 1,
            stage_started_ms: Some(2_000),
            stage_began_ms: Some(2_000),
            state: RolloutState::Baking,
            reason: None,
            fingerprint: "fp".into(),
            created_ms: 1_000,
            updated_ms: 2_000,
            figures: StageFigures::default(),
            revert: None,
            revert_pending: false,
            settled: false,
            fleet: None,
            rev: None,
        };
        assert!(save(&store, &mut staged).await.unwrap());
        let doc = ConfigDoc {
            version: "v2".into(),
            services: vec![BucketFile {
                service: "payments".into(),
                buckets: vec![new.clone()],
            }],
            ..Default::default()
        };
        let base = BaseInput {
            doc: &doc,
            policies: None,
            inputs: "in",
        };
        let abc = regions(&["a", "b", "c"]);
        let now = Utc::now();
        let open = account(&store, &abc, &base, now).await.unwrap();
        assert_eq!(open.len(), 1, "{open:?}");
        let r = &open[0];
        assert_ne!(r.id, staged.id);
        assert_eq!(r.stages, vec![abc.clone()]);
        assert_eq!((r.stage, r.stage_started_ms), (0, None));
        assert_eq!(r.fleet, Some(FleetTally::default()));
        assert_eq!((r.old.as_ref(), &r.new), (Some(&old), &new));
        let gone = Rollout::from_row(
            &store
                .recent_rollouts(Some(("payments", "gw")), 10)
                .await
                .unwrap()
                .into_iter()
                .find(|x| x.id == "rlc-staged")
                .unwrap(),
        )
        .unwrap();
        assert_eq!(gone.state, RolloutState::Superseded);
        assert!(gone
            .reason
            .unwrap()
            .starts_with("restarted as one stage of every region"));
        let a = desired_for("a", &doc, &open);
        assert_eq!(a.services[0].buckets[0], old, "back to the spec in force");
        assert_eq!(a.candidates.len(), 1);
        assert_eq!(a.candidates[0].id, r.id);
        // Accounted again: nothing changes.
        let again = account(&store, &abc, &base, now).await.unwrap();
        assert_eq!(again[0].id, r.id);
    }
}

#[cfg(test)]
mod fix_tests {
    //! The restart, judgement and coverage of rollouts judged on the fleet.
    use super::tests::{gw, regions};
    use super::*;

    /// A baking rollout of payments/gw from a `region` 3,470 to a `global` 1,000 over
    /// `stages`, begun (and its candidate on the controllers) at `t0`, judged on the fleet
    /// when `fleet`; its id is the one [`account`] gives it.
    fn baking(stages: &[&[&str]], fleet: bool, t0: i64) -> Rollout {
        let old = gw(Scope::Region, 3470.0);
        let new = gw(Scope::Global, 1000.0);
        let all: Vec<String> = stages.concat().iter().map(|s| s.to_string()).collect();
        Rollout {
            id: rollout_id(
                "payments",
                "gw",
                Some(&old),
                &new,
                "v2",
                fleet.then_some(all.as_slice()),
            ),
            service: "payments".into(),
            bucket: "gw".into(),
            change: change_words(Some(&old), &new),
            old: Some(old),
            new,
            version: "v2".into(),
            settings: schema::RolloutSpec::default().resolved(),
            stages: stages.iter().map(|s| regions(s)).collect(),
            stage: 0,
            stage_started_ms: Some(t0),
            stage_began_ms: Some(t0),
            state: RolloutState::Baking,
            reason: None,
            fingerprint: "fp".into(),
            created_ms: t0,
            updated_ms: t0,
            figures: StageFigures::default(),
            revert: None,
            revert_pending: false,
            settled: false,
            fleet: fleet.then(FleetTally::default),
            rev: None,
        }
    }

    fn doc() -> ConfigDoc {
        ConfigDoc {
            version: "v2".into(),
            services: vec![BucketFile {
                service: "payments".into(),
                buckets: vec![gw(Scope::Global, 1000.0)],
            }],
            ..Default::default()
        }
    }

    async fn store(dir: &tempfile::TempDir) -> Store {
        Store::connect("sqlite://rlc.db", dir.path()).await.unwrap()
    }

    /// `account` over the controllers' `regions` at `t` ms (the base already accounted).
    async fn account_at(store: &Store, names: &[&str], t: i64) -> Vec<Rollout> {
        let d = doc();
        let base = BaseInput {
            doc: &d,
            policies: None,
            inputs: "in",
        };
        account(store, &regions(names), &base, ms_time(t).unwrap())
            .await
            .unwrap()
    }

    /// What the store holds open, read afresh (what the next poll works on).
    async fn reread(store: &Store) -> Vec<Rollout> {
        open(store).await.unwrap()
    }

    const T0: i64 = 1_800_000_000_000;

    /// A restart whose id is already stored — the regions went {a,b,c} -> {a,b} -> {a,b,c}
    /// during the bake, or an older rlc re-saved the row without `fleet` — still leaves the
    /// change baking in the store: the controllers keep the spec in force, the candidate
    /// beside it, and the change is never served un-gated.
    #[tokio::test]
    async fn a_restart_onto_an_id_already_stored_leaves_the_change_baking() {
        let old = gw(Scope::Region, 3470.0);
        // Regions {a,b,c} -> {a,b} -> {a,b,c}.
        let dir = tempfile::tempdir().unwrap();
        let st = store(&dir).await;
        let mut first = baking(&[&["a", "b", "c"]], true, T0);
        assert!(save(&st, &mut first).await.unwrap());
        let two = account_at(&st, &["a", "b"], T0 + 60_000).await;
        assert_eq!(two.len(), 1);
        assert_eq!(two[0].stages, vec![regions(&["a", "b"])]);
        account_at(&st, &["a", "b", "c"], T0 + 120_000).await;
        let open = reread(&st).await;
        assert_eq!(open.len(), 1, "{open:?}");
        let r = &open[0];
        assert_eq!(r.state, RolloutState::Baking);
        assert_eq!(r.stages, vec![regions(&["a", "b", "c"])]);
        assert_eq!(r.fleet, Some(FleetTally::default()));
        assert!(r.id != first.id && r.id != two[0].id, "{}", r.id);
        let a = desired_for("a", &doc(), &open);
        assert_eq!(a.services[0].buckets[0], old, "the spec in force stays");
        assert_eq!(a.candidates.len(), 1);
        // Accounted again: the same rollout.
        account_at(&st, &["a", "b", "c"], T0 + 180_000).await;
        assert_eq!(reread(&st).await[0].id, r.id);

        // An older rlc re-saved the row without `fleet`: the restart rebuilds its own id.
        let dir = tempfile::tempdir().unwrap();
        let st = store(&dir).await;
        let mut resaved = baking(&[&["a", "b", "c"]], true, T0);
        resaved.fleet = None;
        assert!(save(&st, &mut resaved).await.unwrap());
        account_at(&st, &["a", "b", "c"], T0 + 60_000).await;
        let open = reread(&st).await;
        assert_eq!(open.len(), 1, "{open:?}");
        assert_eq!(open[0].state, RolloutState::Baking);
        assert_ne!(open[0].id, resaved.id);
        assert_eq!(open[0].fleet, Some(FleetTally::default()));
        assert_eq!(desired_for("b", &doc(), &open).services[0].buckets[0], old);
    }
    /// The counts `region`'s controller reported at `at` ms: `rps` for `seconds`, no
    /// virtual drop.
    async fn counted(store: &Store, id: &str, region: &str, seconds: f64, rps: f64, at: i64) {
        store
            .record_candidate_counts(&[CountRow {
                rollout_id: id.into(),
                region: region.into(),
                epoch: "e1".into(),
                seconds,
                offered: rps * seconds,
                virtual_dropped: 0.0,
                enforced_dropped: 0.0,
                updated_ms: at,
            }])
            .await
            .unwrap();
    }

    /// A rollout that must be judged on the fleet but has no `fleet` (baking in stages when
    /// rlc was upgraded, not restarted yet: the push that restarts it comes after the
    /// judgement, and is skipped while the config repo cannot be read) is never promoted on
    /// its stage's own counts.
    #[tokio::test]
    async fn a_rollout_to_be_judged_on_the_fleet_without_fleet_is_never_promoted() {
        let dir = tempfile::tempdir().unwrap();
        let st = store(&dir).await;
        let mut staged = baking(&[&["a"], &["b", "c"]], false, T0);
        assert!(save(&st, &mut staged).await.unwrap());
        // Region a alone offers 600 rps for the whole bake: no virtual drop at 1,000.
        let now = T0 + 3_700_000;
        counted(&st, &staged.id, "a", 3700.0, 600.0, now).await;
        let mut open = reread(&st).await;
        let out = judge(&st, &mut open, ms_time(now).unwrap()).await.unwrap();
        assert_eq!(out, vec![], "{open:?}");
        let r = &reread(&st).await[0];
        assert_eq!((r.state, r.stage), (RolloutState::Baking, 0));
        // Once restarted as one stage of every region it is judged (control: the same counts
        // of every region pass).
        let mut single = baking(&[&["a"]], false, T0);
        single.id = "rlc-one".into();
        assert!(save(&st, &mut single).await.unwrap());
        counted(&st, "rlc-one", "a", 3700.0, 600.0, now).await;
        let mut open = vec![single];
        let out = judge(&st, &mut open, ms_time(now).unwrap()).await.unwrap();
        assert_eq!(out, vec![Transition::Done("rlc-one".into())]);
    }
    /// A region whose controller went silent after covering 92 % of the bake does not let the
    /// stage pass on its stored seconds: every region's counts must be current.
    #[tokio::test]
    async fn a_region_gone_silent_holds_the_stage() {
        let dir = tempfile::tempdir().unwrap();
        let st = store(&dir).await;
        let mut r = baking(&[&["a", "b", "c"]], true, T0);
        assert!(save(&st, &mut r).await.unwrap());
        let id = r.id.clone();
        // Every region read at 92 % of the bake: 100 rps each (300 < 1,000).
        let early = T0 + 3_300_000;
        for x in ["a", "b", "c"] {
            counted(&st, &id, x, 3300.0, 100.0, early).await;
        }
        let mut open = reread(&st).await;
        assert_eq!(
            judge(&st, &mut open, ms_time(early).unwrap())
                .await
                .unwrap(),
            vec![]
        );
        // The bake is over; c could not be read since.
        let now = T0 + 3_700_000;
        for x in ["a", "b"] {
            counted(&st, &id, x, 3700.0, 100.0, now).await;
        }
        let mut open = reread(&st).await;
        let out = judge(&st, &mut open, ms_time(now).unwrap()).await.unwrap();
        assert_eq!(out, vec![], "passed on c's stale counts");
        assert_eq!(reread(&st).await[0].state, RolloutState::Baking);
        // c read again: the stage passes.
        let later = now + 10_000;
        for x in ["a", "b", "c"] {
            counted(&st, &id, x, 3710.0, 100.0, later).await;
        }
        let mut open = reread(&st).await;
        let out = judge(&st, &mut open, ms_time(later).unwrap())
            .await
            .unwrap();
        assert_eq!(out, vec![Transition::Done(id)]);
    }
    /// Down to one configured region: a rollout judged on the fleet is restarted as one stage
    /// of that region, judged on its controller's counts (the fleet's), and can end.
    #[tokio::test]
    async fn down_to_one_region_a_fleet_rollout_is_restarted_on_that_region() {
        let dir = tempfile::tempdir().unwrap();
        let st = store(&dir).await;
        let mut r = baking(&[&["a", "b"]], true, T0);
        assert!(save(&st, &mut r).await.unwrap());
        let open = account_at(&st, &["a"], T0 + 60_000).await;
        assert_eq!(open.len(), 1, "{open:?}");
        let next = open[0].clone();
        assert_ne!(next.id, r.id);
        assert_eq!(next.stages, vec![regions(&["a"])]);
        assert_eq!(next.fleet, None);
        assert_eq!(next.state, RolloutState::Baking);
        assert_eq!(desired_for("a", &doc(), &open).candidates[0].id, next.id);
        // Its candidate reaches a; a's counts over the bake pass it.
        let mut open = reread(&st).await;
        reached(&st, &mut open, "a", ms_time(T0 + 60_000).unwrap())
            .await
            .unwrap();
        let now = T0 + 60_000 + 3_700_000;
        counted(&st, &next.id, "a", 3700.0, 600.0, now).await;
        let mut open = reread(&st).await;
        let out = judge(&st, &mut open, ms_time(now).unwrap()).await.unwrap();
        assert_eq!(out, vec![Transition::Done(next.id.clone())]);
        // Accounted again over one region: nothing restarts.
        assert!(account_at(&st, &["a"], now + 1_000).await.is_empty());
    }
}
