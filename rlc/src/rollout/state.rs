//! The rollouts' state machine, without I/O: a rollout's stages, views and ids, what each
//! region's controller runs ([`desired_for`]), the fleet's tally, and one judgement of a
//! stage on its counts ([`judge_stage`]).

use super::*;

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

pub(super) fn ms_time(ms: i64) -> Option<DateTime<Utc>> {
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

pub(super) fn find<'a>(
    services: &'a [BucketFile],
    service: &str,
    bucket: &str,
) -> Option<&'a Bucket> {
    services
        .iter()
        .find(|f| f.service == service)
        .and_then(|f| f.buckets.iter().find(|b| b.name == bucket))
}

/// The change in words.
pub(super) fn change_words(old: Option<&Bucket>, new: &Bucket) -> String {
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
pub(super) fn on_fleet(old: Option<&Bucket>, new: &Bucket, regions: &[String]) -> bool {
    regions.len() > 1 && judged_on_fleet(old, new)
}

/// Whether `r` must be judged on the fleet ([`judged_on_fleet`], its stages naming more than
/// one region) but is not (no `fleet`: started before rlc judged such candidates so, or
/// re-saved by an older rlc): [`judge`] never promotes it, whether or not the push that
/// restarts it ([`refleet`]) ran yet.
pub(super) fn awaits_restart(r: &Rollout) -> bool {
    r.fleet.is_none()
        && r.stages.iter().map(Vec::len).sum::<usize>() > 1
        && judged_on_fleet(r.old.as_ref(), &r.new)
}

/// The stages of a rollout judged on the fleet: one stage of every region, whatever
/// `rollout.stages` says. A `global` limit in force in some regions only would be counted,
/// and enforced, on those regions' traffic alone (their peers forward nothing for it), so it
/// proves nothing about the fleet and protects nothing.
pub(super) fn fleet_stages(
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
pub(super) fn rollout_id(
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
pub(super) fn restart_id(superseded: &Rollout, fleet: Option<&[String]>) -> String {
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

/// Whether `r` still acts on what the controllers run: baking, or aborted while the base
/// branch still holds its new spec.
pub(super) fn is_open(r: &Rollout) -> bool {
    r.state == RolloutState::Baking || (r.state == RolloutState::Aborted && !r.settled)
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

/// What one judgement of a stage gives ([`judge_stage`]).
#[derive(Debug, Clone)]
pub struct Judgement {
    /// The rollout as it is to be stored.
    pub rollout: Rollout,
    /// What happened to it, if anything but new figures.
    pub transition: Option<Transition>,
    /// The figures the stage was judged on (a promoted rollout starts the next stage's
    /// afresh).
    pub figures: StageFigures,
}

/// One judgement of baking rollout `r` on its counts at `now_ms`
/// ([`grl_wire::rollout::judge`]), or None when nothing changed. A stage whose candidate
/// never reached a controller is judged too: aborted once it waited `max_bake` ("never
/// ran"). No I/O.
pub fn judge_stage(r: &Rollout, counts: &[CountRow], now_ms: i64) -> Option<Judgement> {
    use grl_wire::rollout::{judge as verdict_of, Observed, Verdict};
    let mut next = r.clone();
    let regions = r.current_regions().to_vec();
    let (f, tally) = stage_figures(r, counts, &regions);
    let baked = r.baked_seconds(now_ms);
    let covered = covered_seconds(counts, &regions, now_ms);
    let waited = ((now_ms - r.stage_began()).max(0)) as f64 / 1000.0;
    let seen = Observed {
        baked: std::time::Duration::from_secs_f64(baked),
        waited: std::time::Duration::from_secs_f64(waited),
        offered: f.offered,
        virtual_dropped: f.virtual_dropped,
        // A count that is not a finite positive number of seconds covers nothing.
        covered: std::time::Duration::try_from_secs_f64(covered).unwrap_or_default(),
    };
    let mut verdict = verdict_of(&r.rule(), &seen);
    if verdict == Verdict::Promote && awaits_restart(r) {
        // Its stage's own counts prove nothing for a global limit (each controller counted
        // its own region): never promoted so; the next push restarts it on the fleet.
        tracing::warn!(id = %r.id, service = %r.service, bucket = %r.bucket, "a global candidate counted per region, not judged on the fleet yet: not promoted until restarted as one stage of every region");
        verdict = Verdict::Baking;
    }
    let changed = f != r.figures || (tally.is_some() && tally != r.fleet);
    next.figures = f.clone();
    if tally.is_some() {
        next.fleet = tally;
    }
    let transition = match verdict {
        Verdict::Baking if !changed => return None,
        Verdict::Baking => None,
        Verdict::Promote => Some(next.promote(now_ms)),
        Verdict::Abort { reason } => {
            let never_ran =
                r.stage_started_ms.is_none() && !counts.iter().any(|c| regions.contains(&c.region));
            let evidence = if never_ran {
                format!(
                    "{reason}; in region {}: the candidate never reached the controller(s) in {} (unreachable, or older than grl-proto 5); they kept {}",
                    regions.join(", "),
                    schema::HumanDuration(std::time::Duration::from_secs(waited as u64)),
                    in_force_words(r),
                )
            } else {
                abort_evidence(&reason, r, &f, counts, now_ms)
            };
            next.state = RolloutState::Aborted;
            next.reason = Some(evidence);
            next.revert_pending = true;
            Some(Transition::Aborted(next.id.clone()))
        }
    };
    next.updated_ms = now_ms;
    Some(Judgement {
        rollout: next,
        transition,
        figures: f,
    })
}

/// The figures of `r`'s current stage (`regions`) from its candidate's `counts`: summed over
/// those regions, or stepped on the fleet's tally for a rollout judged on the fleet.
fn stage_figures(
    r: &Rollout,
    counts: &[CountRow],
    regions: &[String],
) -> (StageFigures, Option<FleetTally>) {
    match &r.fleet {
        Some(t) => {
            let (t, f) = fleet_step(t, counts, regions, r.new.limit_rps);
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
    }
}

/// Whether `region`'s counts are not current: its controller was not read at this poll.
pub(super) fn stale(counts: &[CountRow], region: &str, now_ms: i64) -> bool {
    !counts
        .iter()
        .any(|c| c.region == region && c.updated_ms >= now_ms)
}

/// The evaluation time the stage's counts cover: every region of the stage counts, the
/// least-covered one's, summed over its controller's processes (none read yet: zero). A
/// region's counts are current only when its controller was read at this poll (`rlc serve`
/// stores every region's counts and judges at one time, `now`); one that could not be read
/// covers nothing until it is read again, so a region gone silent never lets the stage pass
/// on the seconds it covered before.
pub(super) fn covered_seconds(counts: &[CountRow], regions: &[String], now_ms: i64) -> f64 {
    regions
        .iter()
        .map(|region| {
            if stale(counts, region, now_ms) {
                return 0.0;
            }
            counts
                .iter()
                .filter(|c| &c.region == region)
                .map(|c| c.seconds)
                .sum::<f64>()
        })
        .reduce(f64::min)
        .unwrap_or(0.0)
}

/// Why the stage of `r` was aborted, with its evidence `f`: what the candidate would have
/// refused, and the regions that sent no (current) counts.
pub(super) fn abort_evidence(
    reason: &str,
    r: &Rollout,
    f: &StageFigures,
    counts: &[CountRow],
    now_ms: i64,
) -> String {
    let regions = r.current_regions();
    // The regions with no counts at all: their controller never got the candidate, or could
    // not be read.
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
        .filter(|x| counts.iter().any(|c| &c.region == *x) && stale(counts, x, now_ms))
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
    let baked = r.baked_seconds(now_ms);
    format!(
        "{reason}; in region {} over {} of bake: {} of {} offered requests ({:.3} %) would have been refused by the candidate's {} rps{fleet} (in force: {}; real drops meanwhile: {}){silent}",
        regions.join(", "),
        schema::HumanDuration(std::time::Duration::from_secs(baked.max(1.0) as u64)),
        fmt_count(f.virtual_dropped),
        fmt_count(f.offered),
        f.share() * 100.0,
        schema::format_rps(r.new.limit_rps),
        in_force_words(r),
        fmt_count(f.enforced_dropped),
    )
}

impl Rollout {
    /// The rule its stages are judged by.
    fn rule(&self) -> grl_wire::rollout::RolloutRule {
        grl_wire::rollout::RolloutRule {
            bake: self.settings.bake,
            max_virtual_drop_share: self.settings.max_virtual_drop_share,
            min_offered: self.settings.min_offered,
            max_bake: self.settings.max_bake,
        }
    }

    /// Its stage passed: on to the next stage, or done after the last.
    fn promote(&mut self, now_ms: i64) -> Transition {
        let passed = self.stage + 1;
        self.stage += 1;
        if self.stage >= self.stages.len() {
            self.state = RolloutState::Done;
            self.stage_started_ms = None;
            return Transition::Done(self.id.clone());
        }
        self.stage_started_ms = None;
        self.stage_began_ms = Some(now_ms);
        self.figures = StageFigures::default();
        if self.fleet.is_some() {
            self.fleet = Some(FleetTally::default());
        }
        Transition::Promoted {
            id: self.id.clone(),
            stage: passed,
        }
    }
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
