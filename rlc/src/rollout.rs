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
//! - [`observe`] and [`judge`]: counts in, verdicts out.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use rlc_plan::rollout::{could_refuse_more, digest, fingerprint, Aborted};
use schema::{Bucket, BucketFile, PoliciesFile, RolloutSettings};
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
                    "baking in region {} (stage {} of {}) since {}: {pct:.3} % virtual drops so far ({} of {} offered)",
                    regions.join(", "),
                    self.stage + 1,
                    self.stages.len(),
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
        if i > 0 && (s.len() - i) % 3 == 0 {
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
            let stages = resolve_stages(&settings, regions);
            if stages.is_empty() {
                continue;
            }
            let spec = |x: Option<&Bucket>| {
                x.map(|x| serde_json::to_string(x).unwrap_or_default())
                    .unwrap_or_default()
            };
            let id = format!(
                "rlc-{}",
                digest(
                    format!(
                        "{}\n{}\n{}\n{}\n{}",
                        f.service,
                        b.name,
                        spec(in_force.as_ref()),
                        spec(Some(b)),
                        base.doc.version
                    )
                    .as_bytes()
                )
            );
            created.push(Rollout {
                id,
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
        let mut f = StageFigures::default();
        for c in counts.iter().filter(|c| regions.contains(&c.region)) {
            f.offered += c.offered;
            f.virtual_dropped += c.virtual_dropped;
            f.enforced_dropped += c.enforced_dropped;
        }
        let baked = r.baked_seconds(now_ms);
        let rule = RolloutRule {
            bake: r.settings.bake,
            max_virtual_drop_share: r.settings.max_virtual_drop_share,
            min_offered: r.settings.min_offered,
            max_bake: r.settings.max_bake,
        };
        // Every region of the stage counts: the least-covered one's evaluation time, summed
        // over its controller's processes (none read yet: zero).
        let covered = regions
            .iter()
            .map(|region| {
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
        let verdict = verdict_of(&rule, &seen);
        let changed = f != r.figures;
        r.figures = f.clone();
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
                let silent = if silent.is_empty() {
                    String::new()
                } else {
                    format!(
                        "; no counts from region {} (its controller never ran the candidate, or could not be read)",
                        silent.join(", ")
                    )
                };
                let evidence = format!(
                    "{reason}; in region {} over {} of bake: {} of {} offered requests ({:.3} %) would have been refused by the candidate's {} rps (in force: {}; real drops meanwhile: {}){silent}",
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
}
