//! The rollouts' driver: the state in the store (read, saved over the revision it was read
//! at), new base versions accounted, counts observed, stages judged and their transitions
//! saved and logged.

use super::state::*;
use super::*;

#[derive(Debug, Clone, Serialize, Deserialize)]
/// The store cursor [`ACCOUNTED`]: the base version last accounted and its bucket files.
struct Accounted {
    version: String,
    services: Vec<BucketFile>,
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
pub(super) async fn save_or_conflict(store: &Store, r: &mut Rollout) -> Result<(), StoreError> {
    if save(store, r).await? {
        Ok(())
    } else {
        Err(StoreError::Conflict(format!("rollout {}", r.id)))
    }
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
pub(super) async fn refleet(
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

pub(super) async fn set_accounted(store: &Store, doc: &ConfigDoc) -> Result<(), StoreError> {
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

/// Judges every baking rollout on its current stage's counts ([`judge_stage`]): promoted to
/// the next stage, done, or aborted with the evidence. Updates the store and `open`.
pub async fn judge(
    store: &Store,
    open: &mut [Rollout],
    now: DateTime<Utc>,
) -> Result<Vec<Transition>, StoreError> {
    let now_ms = now.timestamp_millis();
    let mut out = Vec::new();
    for slot in open.iter_mut() {
        if slot.state != RolloutState::Baking {
            continue;
        }
        let counts = store.candidate_counts(&slot.id).await?;
        // Judged on a copy: `open` keeps what the store holds when another process wrote the
        // rollout since it was read.
        let Some(Judgement {
            rollout: mut next,
            transition,
            figures,
        }) = judge_stage(slot, &counts, now_ms)
        else {
            continue;
        };
        if !save(store, &mut next).await? {
            tracing::warn!(id = %next.id, "rollout changed in the store meanwhile (another rlc process); judged again at the next poll");
            continue;
        }
        log_transition(slot, &next, &figures, transition.as_ref());
        *slot = next;
        out.extend(transition);
    }
    Ok(out)
}

/// The log line of a judgement that moved rollout `before` to `after` on the stage's figures
/// `f`.
pub(super) fn log_transition(
    before: &Rollout,
    after: &Rollout,
    f: &StageFigures,
    transition: Option<&Transition>,
) {
    let r = after;
    let regions = before.current_regions().join(",");
    match transition {
        Some(Transition::Aborted(_)) => {
            tracing::warn!(id = %r.id, service = %r.service, bucket = %r.bucket, reason = r.reason.as_deref().unwrap_or(""), "rollout aborted")
        }
        Some(Transition::Promoted { stage, .. }) => {
            tracing::info!(id = %r.id, service = %r.service, bucket = %r.bucket, stage, regions = %regions, offered = f.offered, virtual_dropped = f.virtual_dropped, "rollout stage passed")
        }
        Some(Transition::Done(_)) => {
            tracing::info!(id = %r.id, service = %r.service, bucket = %r.bucket, stage = r.stages.len(), regions = %regions, offered = f.offered, virtual_dropped = f.virtual_dropped, "rollout stage passed; done")
        }
        None => {}
    }
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
