//! One computation: history + config repo → [`Plan`]. Runs each bucket's policy (a contract
//! first, then the service's policy), then the safety rails. Synchronous and pure apart from
//! loading plugins; call it from async code with `spawn_blocking` for large fleets.
//!
//! Services keep their current quotas (and are listed in `skipped`) when the history source
//! failed, when their coverage is below `history.min_coverage`, or when they have buckets but
//! no history at all. A bucket whose policy fails keeps its current quota, and is listed too.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use chrono::{DateTime, Utc};
use policies::rails::{self, Current};
use policies::{fixed, Policy, PolicyError, PolicyInput, Proposal, RateSeries};
use schema::{
    Bucket, CapacityFile, ConfigRepo, Contract, DaemonConfig, PlannedEvent, PolicyName, PolicySpec,
    Scope,
};
use serde_json::json;

use crate::censor::{self, Censored, Observed};
use crate::evidence::{Evidence, PolicyEvidence};
use crate::history::{History, SeriesKey, SeriesSource, Unreadable};
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
                None => {
                    policies::isolated::default_host().map_err(|e| plugin_err(e.to_string()))?
                }
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
    let run = PlanInputs {
        cfg,
        repo,
        contracts: repo.contracts.as_ref().map_or(&[], |c| &c.value.contracts),
        observed,
        today: now.date_naive(),
        now,
    };
    let mut services: BTreeSet<String> = repo.known_services();
    services.extend(source.services());
    services.extend(run.contracts.iter().map(|c| c.service.clone()));
    let ambiguous = skip_rejected(source, &mut plan);
    plan.history_error = source.source_error().map(str::to_string);
    for service in &services {
        match service_history(&run, source, &ambiguous, service) {
            ServiceHistory::Plan(history) => compute_service(&run, &history, service, &mut plan),
            ServiceHistory::Failed(reason) => {
                plan.history_failed.push(service.clone());
                keep_service(&mut plan, repo, service, &reason);
            }
            ServiceHistory::Absent => {
                if repo.current(service).is_some() {
                    keep_service(
                        &mut plan,
                        repo,
                        service,
                        "no history for this service; keeps current quotas",
                    );
                }
            }
        }
    }
    critical_headroom(&mut plan, observed);
    sort_plan(&mut plan);
    plan
}

/// Each global bucket's critical headroom, where the controllers counted its tiers: the
/// planned limit over the busiest minute of its critical demand. (A region- or zone-scoped
/// limit holds per region or zone, and the counts by tier are the whole bucket's: no
/// headroom is claimed for them.)
fn critical_headroom(plan: &mut Plan, observed: &Observed) {
    for b in &mut plan.buckets {
        if b.bucket.scope != Scope::Global {
            continue;
        }
        let key = (b.service.clone(), b.bucket.name.clone());
        if let Some(&(peak, at)) = observed.critical_peaks.get(&key) {
            b.evidence.critical_headroom =
                crate::evidence::CriticalHeadroom::of(b.bucket.limit_rps, peak, at);
        }
    }
}

/// Lists the series the source rejected in skipped, and returns the services whose history
/// the source could not tell apart (series merged by its labels), with why: none of their
/// series can be believed.
fn skip_rejected(source: &dyn SeriesSource, plan: &mut Plan) -> BTreeMap<String, String> {
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
    ambiguous
}

/// What a service's history allows.
enum ServiceHistory<'h> {
    /// Plan the service from this history.
    Plan(Cow<'h, History>),
    /// The history cannot be believed: the service keeps its quotas, and counts as failed.
    Failed(String),
    /// No history and no contract: the service keeps its quotas, if it has any.
    Absent,
}

/// Reads the history of `service` (one service's series at a time; all of them for a history
/// in memory) and says whether it can be planned from.
fn service_history<'h>(
    run: &PlanInputs<'_>,
    source: &'h dyn SeriesSource,
    ambiguous: &BTreeMap<String, String>,
    service: &str,
) -> ServiceHistory<'h> {
    if let Some(e) = source.source_error() {
        return ServiceHistory::Failed(format!("history source failed: {e}; keeps current quotas"));
    }
    if let Some(why) = ambiguous.get(service) {
        return ServiceHistory::Failed(format!("history ambiguous: {why}; keeps current quotas"));
    }
    let history = match source.service(service) {
        Ok(h) => h,
        Err(e) => {
            return ServiceHistory::Failed(format!("history unreadable: {e}; keeps current quotas"))
        }
    };
    if history.service_series(service).next().is_none() {
        return if run.contracts.iter().any(|c| c.service == service) {
            ServiceHistory::Plan(history)
        } else {
            ServiceHistory::Absent
        };
    }
    let (cfg, repo) = (run.cfg, run.repo);
    let cov = history.service_coverage(service);
    if cov < cfg.history.min_coverage {
        return ServiceHistory::Failed(format!(
            "history covers {:.1}% of the window, below min_coverage {:.0}%; keeps current quotas",
            cov * 100.0,
            cfg.history.min_coverage * 100.0
        ));
    }
    // Every value 0 while quotas are in force: a broken query or recording rule, far
    // more likely than a whole service gone quiet (which would keep its quotas too).
    let in_force = repo
        .current(service)
        .is_some_and(|f| f.buckets.iter().any(|b| b.limit_rps > 0.0));
    if in_force && all_zero(history.service_series(service).map(|(_, s)| s)) {
        return ServiceHistory::Failed(
            "every sample of its history is 0 although it has quotas in force (a broken query or recording rule?): not plausible; keeps current quotas".into(),
        );
    }
    ServiceHistory::Plan(history)
}

/// Puts the plan in its order: failed and refused services listed once, buckets and skipped
/// entries sorted.
fn sort_plan(plan: &mut Plan) {
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

/// What every service of one plan reads: the daemon's configuration, the repo, its contracts,
/// what the controller observed, and the time the plan is for.
struct PlanInputs<'a> {
    cfg: &'a DaemonConfig,
    repo: &'a ConfigRepo,
    contracts: &'a [Contract],
    observed: &'a Observed,
    today: chrono::NaiveDate,
    now: DateTime<Utc>,
}

/// What planning one service reads, gathered once: its policy spec, its buckets in force, its
/// series and their peaks, the capacity document, the floor, and the callers that have a
/// caller-wide contract.
struct ServiceInputs<'a> {
    run: &'a PlanInputs<'a>,
    service: &'a str,
    spec: PolicySpec,
    excluded: &'a [schema::Exclusion],
    current: HashMap<&'a str, &'a Bucket>,
    series: Vec<(&'a SeriesKey, &'a RateSeries)>,
    peaks: Vec<f64>,
    peak_total: f64,
    peak_by_procedure: HashMap<Option<String>, f64>,
    capacity: Option<&'a CapacityFile>,
    floor: f64,
    /// Callers whose active contract covers all of the service's procedures.
    caller_wide: BTreeSet<&'a str>,
}

impl<'a> ServiceInputs<'a> {
    fn gather(run: &'a PlanInputs<'a>, history: &'a History, service: &'a str) -> Self {
        let (cfg, repo) = (run.cfg, run.repo);
        let spec = spec_for(repo, service);
        let series: Vec<(&SeriesKey, &RateSeries)> = history.service_series(service).collect();
        let peaks: Vec<f64> = series.iter().map(|(_, s)| s.max().unwrap_or(0.0)).collect();
        let mut peak_by_procedure: HashMap<Option<String>, f64> = HashMap::new();
        for ((k, _), p) in series.iter().zip(&peaks) {
            *peak_by_procedure.entry(k.procedure.clone()).or_default() += p;
        }
        let caller_wide = run
            .contracts
            .iter()
            .filter(|c| c.service == service && c.procedure.is_none() && c.active_on(run.today))
            .filter_map(|c| c.caller.as_deref())
            .collect();
        ServiceInputs {
            run,
            service,
            floor: rails::floor(&cfg.rails, &spec),
            spec,
            excluded: repo.policies.as_ref().map_or(&[], |p| &p.value.excluded),
            current: repo
                .current(service)
                .map(|f| f.buckets.iter().map(|b| (b.name.as_str(), b)).collect())
                .unwrap_or_default(),
            peak_total: peaks.iter().sum(),
            series,
            peaks,
            peak_by_procedure,
            capacity: repo.capacity.as_ref().map(|c| &c.value),
            caller_wide,
        }
    }

    /// The service's contracts, active on the plan's day or not.
    fn contracts(&self, active: bool) -> impl Iterator<Item = &'a Contract> + '_ {
        self.run
            .contracts
            .iter()
            .filter(move |c| c.service == self.service && c.active_on(self.run.today) == active)
    }

    /// The bucket in force named `name`.
    fn current(&self, name: &str) -> Option<&'a Bucket> {
        self.current.get(name).copied()
    }

    /// The key of the bucket a contract makes.
    fn contract_key(&self, c: &Contract) -> SeriesKey {
        SeriesKey {
            service: self.service.into(),
            caller: c.caller.clone(),
            procedure: c.procedure.clone(),
        }
    }

    /// The share of the planned capacity that bounds series `i`: of its procedure's, or of the
    /// whole service's, in proportion to its peak.
    fn capacity_share(&self, i: usize) -> Option<f64> {
        let (service, key) = (self.service, self.series[i].0);
        let cap = self.capacity?;
        let total_cap = cap.for_bucket(service, key.procedure.as_deref())?;
        let procedure_entry = key.procedure.as_deref().is_some_and(|p| {
            cap.capacity
                .iter()
                .any(|e| e.service == service && e.procedure.as_deref() == Some(p))
        });
        let denom = if procedure_entry {
            self.peak_by_procedure
                .get(&key.procedure)
                .copied()
                .unwrap_or(0.0)
        } else {
            self.peak_total
        };
        Some(if denom > 0.0 {
            total_cap * self.peaks[i] / denom
        } else {
            total_cap
        })
    }

    /// Lists a bucket in skipped with `reason`.
    fn skip(&self, plan: &mut Plan, key: &SeriesKey, reason: String) {
        plan.skipped.push(Skipped {
            service: self.service.into(),
            caller: key.caller.clone(),
            procedure: key.procedure.clone(),
            reason,
        });
    }

    /// Lists a bucket in skipped with `reason`, and keeps its quota in force (if it has one).
    fn skip_and_keep(
        &self,
        plan: &mut Plan,
        key: &SeriesKey,
        cur: Option<&Bucket>,
        reason: String,
    ) {
        if let Some(b) = cur {
            plan.buckets.push(kept(self.service, b, &reason));
        }
        self.skip(plan, key, reason);
    }
}

/// Plans the buckets of one service: its contracts' buckets first, then a bucket per series by
/// the service's policy, then what the window did not show (expired contracts, quiet callers).
fn compute_service(run: &PlanInputs<'_>, history: &History, service: &str, plan: &mut Plan) {
    let inputs = ServiceInputs::gather(run, history, service);
    // The bucket names planned so far: a name is planned once.
    let mut done: BTreeSet<String> = BTreeSet::new();
    plan_contracts(&inputs, &mut done, plan);
    plan_series(&inputs, &mut done, plan);
    report_expired_contracts(&inputs, &done, plan);
    carry_quiet_buckets(&inputs, &done, plan);
}

/// Active contracts make their own buckets; they win over the service's policy.
fn plan_contracts(inputs: &ServiceInputs<'_>, done: &mut BTreeSet<String>, plan: &mut Plan) {
    let (cfg, service, spec) = (inputs.run.cfg, inputs.service, &inputs.spec);
    for c in inputs.contracts(true) {
        let key = inputs.contract_key(c);
        let name = key.bucket_name();
        if !done.insert(name.clone()) {
            continue; // a duplicate contract: the first listed wins (validate reports it)
        }
        let peak = inputs
            .series
            .iter()
            .zip(&inputs.peaks)
            .filter(|((k, _), _)| {
                k.caller == c.caller && (c.procedure.is_none() || k.procedure == c.procedure)
            })
            .map(|(_, p)| *p)
            .fold(None, |m: Option<f64>, p| Some(m.map_or(p, |m| m + p)));
        let proposal = fixed::proposal(c, peak);
        let cur = inputs.current(&name);
        if let Err(why) = rails::check_proposal(
            proposal.limit_rps,
            peak.unwrap_or(0.0),
            None,
            inputs.floor,
            false,
        ) {
            refuse(plan, service, &key, cur, &proposal.policy, &why.to_string());
            continue;
        }
        // Contractual limits skip the damping rails.
        let railed = rails_for(cfg, spec, cur, &proposal, false);
        push(
            plan,
            spec,
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
}

/// A bucket per series not planned by a contract, by the service's policy.
fn plan_series(inputs: &ServiceInputs<'_>, done: &mut BTreeSet<String>, plan: &mut Plan) {
    // One policy for the whole service, resolved once (a plugin load is a filesystem lookup).
    let policy_name = inputs.spec.policy.clone().unwrap_or(PolicyName::Peak);
    let policy = ServicePolicy {
        loaded: policy_for(inputs.run.cfg, &policy_name),
        name: policy_name,
    };
    for i in 0..inputs.series.len() {
        let key = inputs.series[i].0;
        if let Some(name) = claim_bucket(inputs, key, done, plan) {
            plan_series_bucket(inputs, &policy, i, name, plan);
        }
    }
}

/// The bucket name of a series when it gets a bucket of its own: not when its name is planned
/// already (listed in skipped if by another match) or a caller-wide contract covers it.
fn claim_bucket(
    inputs: &ServiceInputs<'_>,
    key: &SeriesKey,
    done: &mut BTreeSet<String>,
    plan: &mut Plan,
) -> Option<String> {
    let name = key.bucket_name();
    if done.contains(&name) {
        // Either the contract bucket for this very key, or a different match whose name
        // comes out the same (`a.b`+`c` vs `a`+`b.c`, caller `x` vs procedure `x`).
        let same_key = plan.buckets.iter().any(|b| {
            b.service == inputs.service
                && b.bucket.name == name
                && b.bucket.caller == key.caller
                && b.bucket.procedure == key.procedure
        });
        if !same_key {
            inputs.skip(
                plan,
                key,
                format!(
                    "its bucket name `{name}` is already taken by another match in this service; rename a caller or procedure"
                ),
            );
        }
        return None;
    }
    if key
        .caller
        .as_deref()
        .is_some_and(|c| inputs.caller_wide.contains(c))
        && key.procedure.is_some()
    {
        return None; // covered by the caller's contract bucket
    }
    done.insert(name.clone());
    Some(name)
}

/// The service's policy, resolved once: `Ok(None)` for `fixed`/`manual`.
struct ServicePolicy {
    name: PolicyName,
    loaded: Result<Option<&'static dyn Policy>, PolicyError>,
}

/// One series' bucket on its way through the plan: what its policy saw and what the rails and
/// evidence need of it.
struct SeriesBucket<'s> {
    key: &'s SeriesKey,
    /// The index of the series (in the service's series and peaks).
    index: usize,
    name: String,
    cur: Option<&'s Bucket>,
    capacity_share: Option<f64>,
    /// The series as demand: throttled and excluded minutes left out.
    demand: &'s RateSeries,
    censored: Censored,
    /// Notes on the expired contracts of this bucket.
    expired: Vec<String>,
}

/// Plans series `i`'s bucket `name`: refuses history no instance could have sent, runs the
/// policy on the demand, raises it for planned events, and passes the proposal to the rails.
fn plan_series_bucket(
    inputs: &ServiceInputs<'_>,
    policy: &ServicePolicy,
    i: usize,
    name: String,
    plan: &mut Plan,
) {
    let (service, run) = (inputs.service, inputs.run);
    let (key, s) = inputs.series[i];
    let cur = inputs.current(&name);
    // A sample no instance could have sent is refused with its series: the bucket keeps
    // its quota and the run says so (its service counts as failed: exit 4).
    if let Some(why) = implausible_peak(s) {
        tracing::warn!(service, bucket = %name, %why, "history not plausible");
        plan.history_refused.push(service.into());
        inputs.skip_and_keep(
            plan,
            key,
            cur,
            format!("history {why}; keeps current quota"),
        );
        return;
    }
    let expired: Vec<String> = fixed::contract_for(
        run.contracts,
        service,
        key.caller.as_deref(),
        key.procedure.as_deref(),
        run.today,
    )
    .expired
    .into_iter()
    .map(fixed::expired_note)
    .collect();
    // Minutes that are not demand: throttled (unless sustained) and excluded windows.
    let censored = censor::censored(
        (service, key.caller.as_deref(), key.procedure.as_deref()),
        &name,
        &inputs.spec,
        inputs.excluded,
        run.observed,
        (s.start, s.end()),
    );
    let masked = (!censored.ignored.is_empty()).then(|| censor::apply(s, &censored.ignored));
    let (demand, left_out): (&RateSeries, usize) = masked.as_ref().map_or((s, 0), |(m, n)| (m, *n));
    let bucket = SeriesBucket {
        key,
        index: i,
        name,
        cur,
        capacity_share: inputs.capacity_share(i),
        demand,
        censored,
        expired,
    };
    match propose(inputs, policy, &bucket, left_out) {
        Ok(p) => guard_and_push(inputs, bucket, p, plan),
        Err(e) => {
            let reason = format!("policy {} failed: {e}; keeps current quota", policy.name);
            tracing::warn!(service, bucket = %bucket.name, error = %e, "policy failed");
            inputs.skip_and_keep(plan, key, cur, reason);
        }
    }
}

/// The service policy's proposal for a bucket, raised for the planned events that meet it.
fn propose(
    inputs: &ServiceInputs<'_>,
    policy: &ServicePolicy,
    b: &SeriesBucket<'_>,
    left_out: usize,
) -> Result<Proposal, PolicyError> {
    let (service, key) = (inputs.service, b.key);
    let proposal = match &policy.loaded {
        Ok(Some(p)) => p.compute(&PolicyInput {
            service,
            caller: key.caller.as_deref(),
            procedure: key.procedure.as_deref(),
            series: b.demand,
            left_out,
            spec: &inputs.spec,
            capacity_share_rps: b.capacity_share,
            now: inputs.run.now,
        })?,
        Ok(None) => {
            return Err(PolicyError::Params(format!(
                "policy `{}` has no rule for this bucket (no active contract)",
                policy.name
            )))
        }
        Err(e) => return Err(e.clone()),
    };
    let events: &[PlannedEvent] = inputs.capacity.map_or(&[], |c| &c.events);
    Ok(with_events(
        proposal,
        events,
        EventCtx {
            service,
            key,
            spec: &inputs.spec,
            now: inputs.run.now,
            peak: inputs.peaks[b.index],
            series: &inputs.series,
            peaks: &inputs.peaks,
            capacity_share: b.capacity_share,
        },
    ))
}

/// Passes a policy's proposal through the sanity bound and the rails, and plans the bucket:
/// a decrease the series' own coverage cannot back is not applied.
fn guard_and_push(inputs: &ServiceInputs<'_>, b: SeriesBucket<'_>, p: Proposal, plan: &mut Plan) {
    let (cfg, service) = (inputs.run.cfg, inputs.service);
    let (key, cur) = (b.key, b.cur);
    // No policy's output reaches the rails unchecked.
    let peak = inputs.peaks[b.index];
    if let Err(why) = rails::check_proposal(p.limit_rps, peak, b.capacity_share, inputs.floor, true)
    {
        refuse(plan, service, key, cur, &p.policy, &why.to_string());
        return;
    }
    // A gap in this series (not the service) must not lower its quota.
    let cov = inputs.series[b.index].1.coverage_since_first();
    let railed = rails_for(cfg, &inputs.spec, cur, &p, true);
    match cur {
        Some(c) if railed.limit_rps < c.limit_rps && cov < cfg.history.min_coverage => {
            let reason = format!(
                "series covers {:.1}% of its window, below min_coverage {:.0}%: a decrease to {} rps is not applied; keeps its current quota",
                cov * 100.0,
                cfg.history.min_coverage * 100.0,
                schema::format_rps(rails::round_limit(p.limit_rps))
            );
            inputs.skip_and_keep(plan, key, cur, reason);
        }
        _ => {
            // The time of the peak the evidence names: in the demand the policy saw (storms,
            // throttled minutes and excluded windows out).
            let peak_at = b.demand.argmax().map(|i| b.demand.datetime_of(i));
            push(
                plan,
                &inputs.spec,
                service,
                key,
                cur,
                p,
                railed,
                b.expired,
                peak_at,
                b.censored,
            )
        }
    }
}

/// Expired contracts with no traffic of their own are reported in skipped.
fn report_expired_contracts(inputs: &ServiceInputs<'_>, done: &BTreeSet<String>, plan: &mut Plan) {
    for c in inputs.contracts(false) {
        let key = inputs.contract_key(c);
        if !done.contains(&key.bucket_name()) {
            inputs.skip(plan, &key, fixed::expired_note(c));
        }
    }
}

/// A caller that went quiet (no series in the window) keeps its current quota, except
/// buckets a contract made or superseded: those follow the contracts.
fn carry_quiet_buckets(inputs: &ServiceInputs<'_>, done: &BTreeSet<String>, plan: &mut Plan) {
    let service = inputs.service;
    let mut rest: Vec<(&&str, &&Bucket)> = inputs.current.iter().collect();
    rest.sort_by_key(|(n, _)| **n);
    for (name, b) in rest {
        if done.contains(*name) {
            continue;
        }
        let superseded = b.procedure.is_some()
            && b.caller
                .as_deref()
                .is_some_and(|c| inputs.caller_wide.contains(c));
        let ended = b.policy == PolicyName::Fixed
            && !inputs
                .contracts(true)
                .any(|c| c.caller == b.caller && c.procedure == b.procedure);
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
) -> Result<Vec<(usize, String)>, Unreadable> {
    if let Some(e) = history.source_error() {
        return Err(Unreadable(e.to_string()));
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
        let notes: Vec<&str> = railed.notes.iter().map(|n| n.as_str()).collect();
        explain.push_str(&format!("; rails: {}", notes.join(", ")));
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
    series: &'a [(&'a SeriesKey, &'a RateSeries)],
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
                let h = policies::headroom_of(&p, cx.spec);
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

#[cfg(test)]
mod critical_tests {
    use super::*;

    fn bucket(yaml: &str) -> Bucket {
        serde_yaml::from_str(yaml).unwrap()
    }

    /// A global bucket with a critical peak gets its headroom (limit ÷ peak); a zone-scoped
    /// one (its limit holds per zone, the counts are the whole bucket's) and a bucket without
    /// tiers get none.
    #[test]
    fn critical_headroom_is_the_limit_over_the_critical_peak_of_global_buckets() {
        let at = DateTime::<Utc>::from_timestamp(1_796_000_000, 0).unwrap();
        let mut plan = Plan::default();
        for b in [
            "{name: gw, limit_rps: 100}",
            "{name: edge, limit_rps: 100, scope: zone}",
            "{name: quiet, limit_rps: 100}",
        ] {
            plan.buckets.push(kept("pay", &bucket(b), "test"));
        }
        let mut observed = Observed::default();
        for name in ["gw", "edge"] {
            observed
                .critical_peaks
                .insert(("pay".into(), name.into()), (120.0, at));
        }
        critical_headroom(&mut plan, &observed);
        let h = plan.buckets[0].evidence.critical_headroom.clone().unwrap();
        assert_eq!(
            (h.headroom, h.peak_critical_rps, h.peak_at),
            (100.0 / 120.0, 120.0, at)
        );
        assert!(h.short());
        // Just under the peak is short, however close.
        let close = crate::evidence::CriticalHeadroom::of(99.96, 100.0, at).unwrap();
        assert!(close.short() && close.headroom > 0.999);
        assert_eq!(plan.buckets[1].evidence.critical_headroom, None);
        assert_eq!(plan.buckets[2].evidence.critical_headroom, None);
    }
}
