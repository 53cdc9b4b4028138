//! One computation: history + config repo → [`Plan`]. Runs each bucket's policy (a contract
//! first, then the service's policy), then the safety rails. Synchronous and pure apart from
//! loading plugins; call it from async code with `spawn_blocking` for large fleets.
//!
//! Services keep their current quotas (and are listed in `skipped`) when the history source
//! failed, when their coverage is below `history.min_coverage`, or when they have buckets but
//! no history at all. A bucket whose policy fails keeps its current quota, and is listed too.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use chrono::{DateTime, Utc};
use policies::rails::{self, Current};
use policies::{fixed, Policy, PolicyError, PolicyInput, Proposal};
use schema::{
    Bucket, ConfigRepo, Contract, DaemonConfig, PlannedEvent, PolicyName, PolicySpec, Scope,
};
use serde_json::json;

use crate::censor::{self, Censored, Observed};
use crate::evidence::{Evidence, PolicyEvidence};
use crate::history::{History, SeriesKey, SeriesSource};
use crate::plan::{Plan, PlannedBucket, Skipped};
use crate::plausibility::{all_zero, implausible_peak};

/// The effective policy spec of `service` (peak with default headroom when the repo has no
/// `rlc/policies.yaml`).
pub fn spec_for(repo: &ConfigRepo, service: &str) -> PolicySpec {
    match &repo.policies {
        Some(p) => p.value.for_service(service),
        None => PolicySpec {
            policy: Some(PolicyName::Peak),
            ..Default::default()
        },
    }
}

/// The policy object for a built-in or plugin name (`None` for `fixed`/`manual`). A plugin runs
/// in a host process of its own (`policies::isolated`), bounded by `plugins.timeout`,
/// `plugins.memory_limit_mb` and `plugins.max_restarts`.
pub fn policy_for(
    cfg: &DaemonConfig,
    name: &PolicyName,
) -> Result<Option<&'static dyn Policy>, PolicyError> {
    static PEAK: policies::peak::Peak = policies::peak::Peak;
    static FORECAST: policies::forecast::Forecast = policies::forecast::Forecast;
    match name {
        PolicyName::Peak => Ok(Some(&PEAK)),
        PolicyName::Forecast => Ok(Some(&FORECAST)),
        PolicyName::Fixed | PolicyName::Manual => Ok(None),
        PolicyName::Plugin(n) => {
            let plugin_err = |message: String| PolicyError::Plugin {
                name: n.clone(),
                message,
            };
            let p = cfg
                .plugins
                .as_ref()
                .ok_or_else(|| plugin_err("no `plugins.dir` in rlc.yaml".into()))?;
            let host = match &p.host {
                Some(h) => PathBuf::from(h),
                None => policies::isolated::default_host().map_err(plugin_err)?,
            };
            let settings = policies::isolated::Settings {
                host,
                timeout: p.timeout.0,
                memory_limit_bytes: p.memory_limit_mb.saturating_mul(1 << 20),
                max_restarts: p.max_restarts,
            };
            Ok(Some(
                policies::isolated::load(Path::new(&p.dir), n, &settings)? as &dyn Policy,
            ))
        }
    }
}

/// Computes the quota plan from `history` (read one service at a time, so that a history kept
/// on disk is never in memory whole). `now` decides which contracts are active. Relative
/// `plugins.dir` is taken from the working directory: resolve it first.
pub fn compute_plan(
    cfg: &DaemonConfig,
    repo: &ConfigRepo,
    history: &dyn SeriesSource,
    now: DateTime<Utc>,
) -> Plan {
    compute_plan_censored(cfg, repo, history, &Observed::default(), now)
}

/// [`compute_plan`] with what the controller observed ([`crate::censor`]): minutes under an
/// override and short throttling are left out of each series, sustained throttling counts and
/// says so.
pub fn compute_plan_censored(
    cfg: &DaemonConfig,
    repo: &ConfigRepo,
    history: &dyn SeriesSource,
    observed: &Observed,
    now: DateTime<Utc>,
) -> Plan {
    plan_services(cfg, repo, history, observed, now)
}

fn plan_services(
    cfg: &DaemonConfig,
    repo: &ConfigRepo,
    source: &dyn SeriesSource,
    observed: &Observed,
    now: DateTime<Utc>,
) -> Plan {
    let mut plan = Plan::default();
    let today = now.date_naive();
    let contracts: &[Contract] = repo.contracts.as_ref().map_or(&[], |c| &c.value.contracts);
    let mut services: BTreeSet<String> = repo.known_services();
    services.extend(source.services());
    services.extend(contracts.iter().map(|c| c.service.clone()));

    // Services whose history the source could not tell apart (series merged by its labels):
    // none of their series can be believed.
    let mut ambiguous: BTreeMap<String, String> = BTreeMap::new();
    for r in source.rejected() {
        if r.fails_service {
            if let Some(s) = &r.service {
                ambiguous
                    .entry(s.clone())
                    .or_insert_with(|| r.reason.clone());
            }
        }
        plan.skipped.push(Skipped {
            service: r.service.clone().unwrap_or_default(),
            caller: r.caller.clone(),
            procedure: r.procedure.clone(),
            reason: format!("series skipped: {}", r.reason),
        });
    }

    plan.history_error = source.source_error().map(str::to_string);
    for service in &services {
        if let Some(e) = source.source_error() {
            plan.history_failed.push(service.clone());
            keep_service(
                &mut plan,
                repo,
                service,
                &format!("history source failed: {e}; keeps current quotas"),
            );
            continue;
        }
        if let Some(why) = ambiguous.get(service) {
            plan.history_failed.push(service.clone());
            keep_service(
                &mut plan,
                repo,
                service,
                &format!("history ambiguous: {why}; keeps current quotas"),
            );
            continue;
        }
        // One service's series at a time (all of them for a history in memory).
        let history = match source.service(service) {
            Ok(h) => h,
            Err(e) => {
                plan.history_failed.push(service.clone());
                keep_service(
                    &mut plan,
                    repo,
                    service,
                    &format!("history unreadable: {e}; keeps current quotas"),
                );
                continue;
            }
        };
        let has_series = history.service_series(service).next().is_some();
        let has_contract = contracts.iter().any(|c| &c.service == service);
        if has_series {
            let cov = history.service_coverage(service);
            if cov < cfg.history.min_coverage {
                plan.history_failed.push(service.clone());
                keep_service(
                    &mut plan,
                    repo,
                    service,
                    &format!(
                        "history covers {:.1}% of the window, below min_coverage {:.0}%; keeps current quotas",
                        cov * 100.0,
                        cfg.history.min_coverage * 100.0
                    ),
                );
                continue;
            }
            // Every value 0 while quotas are in force: a broken query or recording rule, far
            // more likely than a whole service gone quiet (which would keep its quotas too).
            let in_force = repo
                .current(service)
                .is_some_and(|f| f.buckets.iter().any(|b| b.limit_rps > 0.0));
            if in_force && all_zero(history.service_series(service).map(|(_, s)| s)) {
                plan.history_failed.push(service.clone());
                keep_service(
                    &mut plan,
                    repo,
                    service,
                    "every sample of its history is 0 although it has quotas in force (a broken query or recording rule?): not plausible; keeps current quotas",
                );
                continue;
            }
        } else if !has_contract {
            if repo.current(service).is_some() {
                keep_service(
                    &mut plan,
                    repo,
                    service,
                    "no history for this service; keeps current quotas",
                );
            }
            continue;
        }
        compute_service(
            cfg, repo, &history, service, contracts, observed, today, now, &mut plan,
        );
    }
    plan.history_failed.sort();
    plan.history_failed.dedup();
    plan.history_refused.sort();
    plan.history_refused.dedup();
    plan.buckets
        .sort_by(|a, b| (&a.service, &a.bucket.name).cmp(&(&b.service, &b.bucket.name)));
    plan.skipped.sort_by(|a, b| {
        (&a.service, &a.caller, &a.procedure, &a.reason).cmp(&(
            &b.service,
            &b.caller,
            &b.procedure,
            &b.reason,
        ))
    });
    plan
}

/// Lists `service` in skipped and carries its current buckets over unchanged.
fn keep_service(plan: &mut Plan, repo: &ConfigRepo, service: &str, reason: &str) {
    tracing::warn!(service, reason, "service keeps its current quotas");
    plan.skipped.push(Skipped {
        service: service.into(),
        caller: None,
        procedure: None,
        reason: reason.into(),
    });
    if let Some(f) = repo.current(service) {
        for b in &f.buckets {
            plan.buckets.push(kept(service, b, reason));
        }
    }
}

fn kept(service: &str, b: &Bucket, reason: &str) -> PlannedBucket {
    PlannedBucket {
        service: service.into(),
        bucket: b.clone(),
        current_limit_rps: Some(b.limit_rps),
        evidence: Evidence::kept(reason),
        held: None,
    }
}

#[allow(clippy::too_many_arguments)]
fn compute_service(
    cfg: &DaemonConfig,
    repo: &ConfigRepo,
    history: &History,
    service: &str,
    contracts: &[Contract],
    observed: &Observed,
    today: chrono::NaiveDate,
    now: DateTime<Utc>,
    plan: &mut Plan,
) {
    let spec = spec_for(repo, service);
    let excluded: &[schema::Exclusion] = repo.policies.as_ref().map_or(&[], |p| &p.value.excluded);
    let current: HashMap<&str, &Bucket> = repo
        .current(service)
        .map(|f| f.buckets.iter().map(|b| (b.name.as_str(), b)).collect())
        .unwrap_or_default();
    let series: Vec<(&SeriesKey, &policies::RateSeries)> =
        history.service_series(service).collect();
    let peaks: Vec<f64> = series.iter().map(|(_, s)| s.max().unwrap_or(0.0)).collect();
    let peak_total: f64 = peaks.iter().sum();
    let mut peak_by_procedure: HashMap<Option<String>, f64> = HashMap::new();
    for ((k, _), p) in series.iter().zip(&peaks) {
        *peak_by_procedure.entry(k.procedure.clone()).or_default() += p;
    }
    let capacity = repo.capacity.as_ref().map(|c| &c.value);
    let floor = rails::floor(&cfg.rails, &spec);
    let mut done: BTreeSet<String> = BTreeSet::new();

    // Active contracts make their own buckets; they win over the service's policy.
    let caller_wide: BTreeSet<&str> = contracts
        .iter()
        .filter(|c| c.service == service && c.procedure.is_none() && c.active_on(today))
        .filter_map(|c| c.caller.as_deref())
        .collect();
    for c in contracts
        .iter()
        .filter(|c| c.service == service && c.active_on(today))
    {
        let key = SeriesKey {
            service: service.into(),
            caller: c.caller.clone(),
            procedure: c.procedure.clone(),
        };
        let name = key.bucket_name();
        if !done.insert(name.clone()) {
            continue; // a duplicate contract: the first listed wins (validate reports it)
        }
        let peak = series
            .iter()
            .zip(&peaks)
            .filter(|((k, _), _)| {
                k.caller == c.caller && (c.procedure.is_none() || k.procedure == c.procedure)
            })
            .map(|(_, p)| *p)
            .fold(None, |m: Option<f64>, p| Some(m.map_or(p, |m| m + p)));
        let proposal = fixed::proposal(c, peak);
        let cur = current.get(name.as_str()).copied();
        if let Err(why) =
            rails::check_proposal(proposal.limit_rps, peak.unwrap_or(0.0), None, floor, false)
        {
            refuse(plan, service, &key, cur, &proposal.policy, &why);
            continue;
        }
        // Contractual limits skip the damping rails.
        let railed = rails_for(cfg, &spec, cur, &proposal, false);
        push(
            plan,
            &spec,
            service,
            &key,
            cur,
            proposal,
            railed,
            Vec::new(),
            None,
            Censored::default(),
        );
        if peak.is_none_or(|p| p <= 0.0) {
            if let Some(b) = plan.buckets.last_mut() {
                let why = no_traffic(c);
                let e = &mut b.evidence;
                e.explain = Some(format!("{}; {why}", e.explain.take().unwrap_or_default()));
                e.no_traffic = Some(why);
            }
        }
    }

    // One policy for the whole service, resolved once (a plugin load is a filesystem lookup).
    let policy_name = spec.policy.clone().unwrap_or(PolicyName::Peak);
    let policy = policy_for(cfg, &policy_name);
    for (i, (key, s)) in series.iter().enumerate() {
        let name = key.bucket_name();
        if done.contains(&name) {
            // Either the contract bucket for this very key, or a different match whose name
            // comes out the same (`a.b`+`c` vs `a`+`b.c`, caller `x` vs procedure `x`).
            let same_key = plan.buckets.iter().any(|b| {
                b.service == service
                    && b.bucket.name == name
                    && b.bucket.caller == key.caller
                    && b.bucket.procedure == key.procedure
            });
            if !same_key {
                plan.skipped.push(Skipped {
                    service: service.into(),
                    caller: key.caller.clone(),
                    procedure: key.procedure.clone(),
                    reason: format!(
                        "its bucket name `{name}` is already taken by another match in this service; rename a caller or procedure"
                    ),
                });
            }
            continue;
        }
        if key
            .caller
            .as_deref()
            .is_some_and(|c| caller_wide.contains(c))
            && key.procedure.is_some()
        {
            continue; // covered by the caller's contract bucket
        }
        done.insert(name.clone());
        // A sample no instance could have sent is refused with its series: the bucket keeps
        // its quota and the run says so (its service counts as failed: exit 4).
        if let Some(why) = implausible_peak(s) {
            let cur = current.get(name.as_str()).copied();
            tracing::warn!(service, bucket = %name, %why, "history not plausible");
            plan.history_refused.push(service.into());
            let reason = format!("history {why}; keeps current quota");
            plan.skipped.push(Skipped {
                service: service.into(),
                caller: key.caller.clone(),
                procedure: key.procedure.clone(),
                reason: reason.clone(),
            });
            if let Some(b) = cur {
                plan.buckets.push(kept(service, b, &reason));
            }
            continue;
        }
        let expired: Vec<String> = fixed::contract_for(
            contracts,
            service,
            key.caller.as_deref(),
            key.procedure.as_deref(),
            today,
        )
        .expired
        .into_iter()
        .map(fixed::expired_note)
        .collect();
        let cur = current.get(name.as_str()).copied();
        let capacity_share = capacity.and_then(|cap| {
            let total_cap = cap.for_bucket(service, key.procedure.as_deref())?;
            let procedure_entry = key.procedure.as_deref().is_some_and(|p| {
                cap.capacity
                    .iter()
                    .any(|e| e.service == service && e.procedure.as_deref() == Some(p))
            });
            // The caller's share of the capacity that bounds it: of its procedure's, or of
            // the whole service's.
            let denom = if procedure_entry {
                peak_by_procedure
                    .get(&key.procedure)
                    .copied()
                    .unwrap_or(0.0)
            } else {
                peak_total
            };
            Some(if denom > 0.0 {
                total_cap * peaks[i] / denom
            } else {
                total_cap
            })
        });
        // Minutes that are not demand: throttled (unless sustained) and excluded windows.
        let censored = censor::censored(
            (service, key.caller.as_deref(), key.procedure.as_deref()),
            &name,
            &spec,
            excluded,
            observed,
            (s.start, s.end()),
        );
        let masked = (!censored.ignored.is_empty()).then(|| censor::apply(s, &censored.ignored));
        let (demand, left_out): (&policies::RateSeries, usize) =
            masked.as_ref().map_or((s, 0), |(m, n)| (m, *n));
        let result = match &policy {
            Ok(Some(p)) => p.compute(&PolicyInput {
                service,
                caller: key.caller.as_deref(),
                procedure: key.procedure.as_deref(),
                series: demand,
                left_out,
                spec: &spec,
                capacity_share_rps: capacity_share,
                now,
            }),
            Ok(None) => Err(PolicyError::Params(format!(
                "policy `{policy_name}` has no rule for this bucket (no active contract)"
            ))),
            Err(e) => Err(e.clone()),
        };
        let events: &[PlannedEvent] = capacity.map_or(&[], |c| &c.events);
        let result = result.map(|p| {
            with_events(
                p,
                events,
                EventCtx {
                    service,
                    key,
                    spec: &spec,
                    now,
                    peak: peaks[i],
                    series: &series,
                    peaks: &peaks,
                    capacity_share,
                },
            )
        });
        match result {
            Ok(p) => {
                // No policy's output reaches the rails unchecked.
                if let Err(why) =
                    rails::check_proposal(p.limit_rps, peaks[i], capacity_share, floor, true)
                {
                    refuse(plan, service, key, cur, &p.policy, &why);
                    continue;
                }
                // A gap in this series (not the service) must not lower its quota.
                let cov = s.coverage_since_first();
                let railed = rails_for(cfg, &spec, cur, &p, true);
                match cur {
                    Some(c) if railed.limit_rps < c.limit_rps && cov < cfg.history.min_coverage => {
                        let reason = format!(
                            "series covers {:.1}% of its window, below min_coverage {:.0}%: a decrease to {} rps is not applied; keeps its current quota",
                            cov * 100.0,
                            cfg.history.min_coverage * 100.0,
                            schema::format_rps(rails::round_limit(p.limit_rps))
                        );
                        plan.skipped.push(Skipped {
                            service: service.into(),
                            caller: key.caller.clone(),
                            procedure: key.procedure.clone(),
                            reason: reason.clone(),
                        });
                        plan.buckets.push(kept(service, c, &reason));
                    }
                    _ => {
                        // The time of the peak the evidence names: in the demand the
                        // policy saw (storms, throttled minutes and excluded windows out).
                        let peak_at = demand.argmax().map(|i| demand.datetime_of(i));
                        push(
                            plan, &spec, service, key, cur, p, railed, expired, peak_at, censored,
                        )
                    }
                }
            }
            Err(e) => {
                let reason = format!("policy {policy_name} failed: {e}; keeps current quota");
                tracing::warn!(service, bucket = %name, error = %e, "policy failed");
                plan.skipped.push(Skipped {
                    service: service.into(),
                    caller: key.caller.clone(),
                    procedure: key.procedure.clone(),
                    reason: reason.clone(),
                });
                if let Some(b) = cur {
                    plan.buckets.push(kept(service, b, &reason));
                }
            }
        }
    }

    // Expired contracts with no traffic of their own are reported here.
    for c in contracts
        .iter()
        .filter(|c| c.service == service && !c.active_on(today))
    {
        let key = SeriesKey {
            service: service.into(),
            caller: c.caller.clone(),
            procedure: c.procedure.clone(),
        };
        if !done.contains(&key.bucket_name()) {
            plan.skipped.push(Skipped {
                service: service.into(),
                caller: c.caller.clone(),
                procedure: c.procedure.clone(),
                reason: fixed::expired_note(c),
            });
        }
    }

    // A caller that went quiet (no series in the window) keeps its current quota, except
    // buckets a contract made or superseded: those follow the contracts.
    let mut rest: Vec<(&&str, &&Bucket)> = current.iter().collect();
    rest.sort_by_key(|(n, _)| **n);
    for (name, b) in rest {
        if done.contains(*name) {
            continue;
        }
        let superseded =
            b.procedure.is_some() && b.caller.as_deref().is_some_and(|c| caller_wide.contains(c));
        let ended = b.policy == PolicyName::Fixed
            && !contracts.iter().any(|c| {
                c.service == service
                    && c.active_on(today)
                    && c.caller == b.caller
                    && c.procedure == b.procedure
            });
        let reason = if superseded {
            Some("superseded by the caller-wide contract for this caller; bucket removed")
        } else if ended {
            Some("its contract expired or was removed and the caller sent no traffic; bucket removed")
        } else {
            None
        };
        match reason {
            Some(r) => plan.skipped.push(Skipped {
                service: service.into(),
                caller: b.caller.clone(),
                procedure: b.procedure.clone(),
                reason: r.into(),
            }),
            None => plan.buckets.push(kept(
                service,
                b,
                "no traffic in the lookback window; keeps its current quota",
            )),
        }
    }
}

/// A proposal refused by the sanity bound: the bucket keeps its current quota and is listed in
/// `skipped` with the reason.
fn refuse(
    plan: &mut Plan,
    service: &str,
    key: &SeriesKey,
    cur: Option<&Bucket>,
    policy: &PolicyName,
    why: &str,
) {
    let reason = format!("policy {policy} {why}: refused; keeps current quota");
    tracing::warn!(service, bucket = %key.bucket_name(), %reason, "proposal refused");
    plan.skipped.push(Skipped {
        service: service.into(),
        caller: key.caller.clone(),
        procedure: key.procedure.clone(),
        reason: reason.clone(),
    });
    if let Some(b) = cur {
        plan.buckets.push(kept(service, b, &reason));
    }
}

/// The rails applied to a proposal for a bucket whose current quota is `cur`.
fn rails_for(
    cfg: &DaemonConfig,
    spec: &PolicySpec,
    cur: Option<&Bucket>,
    p: &Proposal,
    damp: bool,
) -> rails::Railed {
    rails::apply(
        &cfg.rails,
        spec,
        cur.map(|b| Current {
            limit_rps: b.limit_rps,
            mode: b.mode,
        }),
        p.limit_rps,
        p.shadow,
        damp,
    )
}

#[allow(clippy::too_many_arguments)]
/// What a contract without traffic in the window is flagged with.
pub fn no_traffic(c: &Contract) -> String {
    format!(
        "no traffic from caller {} to {}{} in the window: does the contract name them as the traffic's labels do?",
        c.caller.as_deref().unwrap_or("(any)"),
        c.service,
        c.procedure.as_deref().map(|p| format!(" procedure {p}")).unwrap_or_default()
    )
}

/// The active contracts of `repo` (by index in `rlc/contracts.yaml`) whose caller and
/// procedure sent no traffic in `history`: what `rlc validate --history` flags.
pub fn contracts_without_traffic(
    repo: &ConfigRepo,
    history: &dyn SeriesSource,
    today: chrono::NaiveDate,
) -> Result<Vec<(usize, String)>, String> {
    if let Some(e) = history.source_error() {
        return Err(e.to_string());
    }
    let contracts: &[Contract] = repo.contracts.as_ref().map_or(&[], |c| &c.value.contracts);
    let mut out = Vec::new();
    for (i, c) in contracts
        .iter()
        .enumerate()
        .filter(|(_, c)| c.active_on(today))
    {
        let h = history.service(&c.service)?;
        let seen = h.service_series(&c.service).any(|(k, s)| {
            k.caller == c.caller
                && (c.procedure.is_none() || k.procedure == c.procedure)
                && s.max().is_some_and(|m| m > 0.0)
        });
        if !seen {
            out.push((i, no_traffic(c)));
        }
    }
    Ok(out)
}

// Ten inputs of one planned bucket; a struct of them is left for the plan's redesign.
#[allow(clippy::too_many_arguments)]
fn push(
    plan: &mut Plan,
    spec: &PolicySpec,
    service: &str,
    key: &SeriesKey,
    cur: Option<&Bucket>,
    p: Proposal,
    railed: rails::Railed,
    expired: Vec<String>,
    peak_at: Option<DateTime<Utc>>,
    censored: Censored,
) {
    // The owner's scope wins; otherwise a bucket keeps its scope (a region limit must not
    // silently become one fleet-wide limit); new buckets are global.
    let scope = spec.scope.or(cur.map(|b| b.scope)).unwrap_or(Scope::Global);
    // What set the limit, in one line (preview table, PR body): the policy's own line, else its
    // name and the limit it proposed; then what the rails did.
    let mut explain = p
        .evidence
        .get("explain")
        .and_then(|v| v.as_str())
        .map(str::to_string)
        .unwrap_or_else(|| format!("{} proposed {:.1} rps", p.policy, p.limit_rps));
    explain.push_str(&censor::explain(&censored));
    if !railed.notes.is_empty() {
        explain.push_str(&format!("; rails: {}", railed.notes.join(", ")));
    }
    let evidence = Evidence {
        ignored: censored.ignored,
        throttled: censored.throttled,
        explain: Some(explain),
        proposed_rps: Some(rails::round_limit(p.limit_rps)),
        peak_rps: Some((p.peak_rps * 1000.0).round() / 1000.0),
        confidence: Some((p.confidence * 100.0).round() / 100.0),
        rails: railed.notes.clone(),
        // The value a rail moved the limit from (floor, ceiling, per-run cap).
        capped_from: railed.capped_from,
        peak_at: peak_at.map(|at| at.to_rfc3339()),
        expired_contracts: expired,
        policy: Some(PolicyEvidence(p.evidence)),
        ..Evidence::default()
    };
    plan.buckets.push(PlannedBucket {
        service: service.into(),
        bucket: Bucket {
            name: key.bucket_name(),
            caller: key.caller.clone(),
            procedure: key.procedure.clone(),
            scope,
            limit_rps: railed.limit_rps,
            mode: railed.mode,
            policy: p.policy,
        },
        current_limit_rps: cur.map(|b| b.limit_rps),
        evidence,
        held: None,
    });
}

/// What [`with_events`] needs to know about a bucket.
struct EventCtx<'a> {
    service: &'a str,
    key: &'a SeriesKey,
    spec: &'a PolicySpec,
    now: DateTime<Utc>,
    peak: f64,
    series: &'a [(&'a SeriesKey, &'a policies::RateSeries)],
    peaks: &'a [f64],
    capacity_share: Option<f64>,
}

/// Raises a proposal for the planned events (`rlc/capacity.yaml` `events:`) of its bucket that
/// meet the horizon (`horizon`, 7 days by default, from `now`): × `factor`, or the bucket's
/// share (by observed peak, among the series the event matches) of the expected `rps` ×
/// (1 + headroom), whichever event asks most; still bounded by `ceiling_rps` and the planned
/// capacity share. An event that is over no longer counts, so the quota falls back with it
/// (through the rails' decrease cap).
fn with_events(mut p: Proposal, events: &[PlannedEvent], cx: EventCtx<'_>) -> Proposal {
    let (caller, procedure) = (cx.key.caller.as_deref(), cx.key.procedure.as_deref());
    let from = cx.now.timestamp();
    let horizon = cx
        .spec
        .horizon
        .map_or(policies::forecast::DEFAULT_HORIZON_SECS, |h| h.as_secs()) as i64;
    let mut best: Option<(f64, &PlannedEvent, String)> = None;
    for e in events
        .iter()
        .filter(|e| e.matches(cx.service, caller, procedure) && e.overlaps(from, from + horizon))
    {
        let (want, how) = match (e.factor, e.rps) {
            (Some(f), _) => (p.limit_rps * f, format!("× {f}")),
            (None, Some(r)) => {
                let total: f64 = cx
                    .series
                    .iter()
                    .zip(cx.peaks)
                    .filter(|((k, _), _)| {
                        e.matches(cx.service, k.caller.as_deref(), k.procedure.as_deref())
                    })
                    .map(|(_, p)| *p)
                    .sum();
                let share = if total > 0.0 { r * cx.peak / total } else { r };
                let h = policies::headroom(cx.spec);
                (
                    share * (1.0 + h),
                    format!(
                        "expected {} rps, this bucket's share {} rps × {:.2}",
                        schema::format_rps(r),
                        schema::format_rps(share),
                        1.0 + h
                    ),
                )
            }
            (None, None) => continue,
        };
        if want > p.limit_rps && best.as_ref().is_none_or(|b| want > b.0) {
            best = Some((want, e, how));
        }
    }
    let Some((want, e, how)) = best else {
        return p;
    };
    let mut limit = want;
    let mut capped = None;
    for (cap, why) in [
        (cx.spec.ceiling_rps, "ceiling_rps"),
        (cx.capacity_share, "planned capacity share"),
    ] {
        if let Some(c) = cap.filter(|c| limit > *c) {
            limit = c.max(p.limit_rps);
            capped = Some(why);
        }
    }
    let line = format!(
        "; event {} {}..{} {how}: {:.1} → {:.1} rps{}",
        e.name,
        e.from,
        e.until,
        p.limit_rps,
        limit,
        capped
            .map(|c| format!(" (capped by {c})"))
            .unwrap_or_default()
    );
    if let Some(o) = p.evidence.as_object_mut() {
        o.insert(
            "event".into(),
            json!({
                "name": e.name,
                "from": e.from,
                "until": e.until,
                "factor": e.factor,
                "rps": e.rps,
                "without_event_rps": (p.limit_rps * 1000.0).round() / 1000.0,
                "limit_rps": (limit * 1000.0).round() / 1000.0,
                "capped_by": capped,
            }),
        );
        let explain = o
            .get("explain")
            .and_then(|v| v.as_str())
            .map(str::to_string)
            .unwrap_or_else(|| format!("{} proposed {:.1} rps", p.policy, p.limit_rps));
        o.insert("explain".into(), json!(format!("{explain}{line}")));
    }
    p.limit_rps = limit;
    p
}
