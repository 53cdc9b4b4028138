//! The simulator: a fleet of client instances, zone sums and the controller engine in virtual
//! time. Clients are the real `Limiter` + `Reporter`; the controller is the real `Engine`; only
//! the transport is replaced by a fixed loop latency. Deterministic for a seed: one thread,
//! a seeded generator, ordered maps.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use grl_core::control::scope_key;
use grl_core::{seed_thread_rng, Decision, Limiter};
use schema::criticality::TIERS;
use schema::{Bucket, BucketFile, Criticality, Mode};
use serde::{Deserialize, Serialize};

use grl_client::client::Reporter;
use grl_control::aggregator::{tier_mix, TierSum};
use grl_control::engine::Engine;
use grl_wire::rollout::{judge, Observed, RolloutRule, Verdict};
use grl_wire::{
    Candidate, ClientDirectives, ConfigDoc, ServiceCallCountMsg, ZoneBucketMsg, ZoneReport,
};

/// A scenario file.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Free-form title.
    #[serde(default)]
    pub name: String,
    /// The callee service.
    pub service: String,
    /// Virtual seconds to run.
    pub duration_s: f64,
    /// Control-loop period.
    #[serde(default = "d_tick")]
    pub tick_ms: u64,
    /// Simulation step.
    #[serde(default = "d_step")]
    pub step_ms: u64,
    /// Client staleness bound.
    #[serde(default = "d_stale")]
    pub stale_after_ms: u64,
    /// Time from a tick's reports to the directives being in force at the clients.
    #[serde(default = "d_latency")]
    pub loop_latency_ms: u64,
    /// Clients raise their ratio between reports when their own rate jumps.
    #[serde(default = "d_true")]
    pub local_adjust: bool,
    /// Zones (default: one zone `z1` in region `r1`).
    #[serde(default)]
    pub zones: Vec<ZoneSpec>,
    /// The service's buckets.
    pub buckets: Vec<Bucket>,
    /// The calling fleets.
    pub callers: Vec<CallerSpec>,
    /// Token-bucket baseline parameters.
    #[serde(default)]
    pub token_bucket: TokenBucketSpec,
    /// Candidate limits for the scenario's buckets: evaluated by the controller engine beside
    /// the limits in force (which the clients keep enforcing) and judged every tick by
    /// [`grl_wire::rollout::judge`]; a promoted candidate becomes the limit in force, an
    /// aborted one is dropped (drop-by-ratio only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub candidates: Vec<SimCandidate>,
    /// How candidates are judged (default: the defaults of `rollout:`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<SimRollout>,
    /// Zones forward their clients' mix of criticality tiers (default true). `false` runs
    /// the scenario as aggregators of the previous protocol do: the controller knows no mix
    /// and every tier drops the bucket's ratio alike.
    #[serde(default = "d_true")]
    pub tiers: bool,
}

/// A candidate limit of a scenario.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SimCandidate {
    /// Its id (unique in the scenario).
    pub id: String,
    /// The bucket as it would be: its `name` is one of the scenario's buckets.
    pub bucket: Bucket,
}

/// The rollout rule of a scenario (see [`grl_wire::rollout::RolloutRule`]).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SimRollout {
    /// How long a candidate is watched before it may be promoted (default 1h).
    #[serde(default = "d_bake")]
    pub bake: schema::HumanDuration,
    /// The highest share of offered requests it may virtually drop (default 0.0001).
    #[serde(default = "d_share")]
    pub max_virtual_drop_share: f64,
    /// Requests it must have seen before any verdict (default 1000).
    #[serde(default = "d_min_offered")]
    pub min_offered: f64,
    /// How long a candidate with too little traffic waits before it is aborted (default 1d).
    #[serde(default = "d_max_bake")]
    pub max_bake: schema::HumanDuration,
}

fn d_bake() -> schema::HumanDuration {
    schema::HumanDuration(RolloutRule::default().bake)
}
fn d_share() -> f64 {
    RolloutRule::default().max_virtual_drop_share
}
fn d_min_offered() -> f64 {
    RolloutRule::default().min_offered
}
fn d_max_bake() -> schema::HumanDuration {
    schema::HumanDuration(RolloutRule::default().max_bake)
}

impl SimRollout {
    /// The rule it stands for.
    pub fn rule(&self) -> RolloutRule {
        RolloutRule {
            bake: self.bake.0,
            max_virtual_drop_share: self.max_virtual_drop_share,
            min_offered: self.min_offered,
            max_bake: self.max_bake.0,
        }
    }
}

/// A candidate over one tick: its counts since its evaluation began and the verdict on them.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct CandidateRow {
    /// Virtual seconds at the end of the tick.
    pub t: f64,
    /// The candidate's id.
    pub candidate: String,
    /// The bucket it would replace.
    pub bucket: String,
    /// Its limit.
    pub limit_rps: f64,
    /// The limit in force.
    pub in_force_limit_rps: f64,
    /// Seconds evaluated so far.
    pub baked_s: f64,
    /// Requests offered to it so far (the engine's count).
    pub offered: f64,
    /// Requests its drop ratio would have dropped so far.
    pub virtual_dropped: f64,
    /// `virtual_dropped / offered`.
    pub virtual_drop_share: f64,
    /// Requests the clients really dropped in the bucket since the evaluation began.
    pub real_dropped: u64,
    /// `baking`, `promote` or `abort`.
    pub verdict: String,
    /// Why it was aborted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

fn d_tick() -> u64 {
    1000
}
fn d_step() -> u64 {
    10
}
fn d_stale() -> u64 {
    3000
}
fn d_latency() -> u64 {
    50
}
fn d_true() -> bool {
    true
}

/// A zone and its region.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ZoneSpec {
    /// Zone name.
    pub name: String,
    /// Region name.
    pub region: String,
}

/// One offered-rate segment: from `at_s` on, the caller offers `rps` in total.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Segment {
    /// Start of the segment (virtual seconds).
    pub at_s: f64,
    /// Offered requests per second over all instances.
    pub rps: f64,
}

/// A temporary burst of one instance.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Burst {
    /// Instance index.
    pub instance: usize,
    /// Start.
    pub from_s: f64,
    /// End.
    pub to_s: f64,
    /// Multiplier of the instance's rate.
    pub factor: f64,
}

/// A calling service with its instances and load.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CallerSpec {
    /// Caller name.
    pub name: String,
    /// The procedure it calls.
    pub procedure: String,
    /// Instances (each one a GRL client).
    pub instances: usize,
    /// Zones the instances are spread over, round robin (default: all).
    #[serde(default)]
    pub zones: Vec<String>,
    /// Piecewise-constant offered load.
    pub schedule: Vec<Segment>,
    /// Relative load per instance, cycled (default: equal).
    #[serde(default)]
    pub weights: Vec<f64>,
    /// Temporary per-instance bursts.
    #[serde(default)]
    pub bursts: Vec<Burst>,
    /// Copies of this caller (named `<name>-<i>`), each with its rate scaled by
    /// `1 + jitter × u`, u uniform in [-1, 1] from the seed.
    #[serde(default = "d_one")]
    pub replicas: usize,
    /// See `replicas`.
    #[serde(default)]
    pub jitter: f64,
    /// The criticality tier of the caller's requests (default: none given, which counts as
    /// CRITICAL). A scenario where a caller gives one reports every tick per tier.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub criticality: Option<Criticality>,
}

fn d_one() -> usize {
    1
}

/// The seeds' first design, kept as a baseline.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TokenBucketSpec {
    /// Unused tokens are kept this long (the seeds' ring buffer: 10 s).
    pub burst_secs: f64,
    /// Refill in whole tokens per tick (per-second slots of the ring buffer); a host whose
    /// share of the limit is under one token per tick gets nothing.
    pub whole_tokens: bool,
}

impl Default for TokenBucketSpec {
    fn default() -> Self {
        TokenBucketSpec {
            burst_secs: 10.0,
            whole_tokens: true,
        }
    }
}

/// Which limiter the clients run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")] // printed as spelled on the command line
pub enum Algorithm {
    /// Drop-by-ratio (the GRL).
    DropByRatio,
    /// Per-host token bucket refilled at share × limit (baseline).
    TokenBucket,
}

/// Why a scenario cannot run.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// Invalid bucket set.
    #[error(transparent)]
    Buckets(#[from] grl_control::config::ConfigError),
    /// Invalid scenario value.
    #[error("scenario: {0}")]
    Invalid(String),
}

/// One output line: a bucket over one tick.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TickRow {
    /// Virtual seconds at the end of the tick.
    pub t: f64,
    /// Bucket name.
    pub bucket: String,
    /// Offered requests/s.
    pub offered_rps: f64,
    /// Admitted requests/s (shadow drops included).
    pub admitted_rps: f64,
    /// Dropped requests/s.
    pub dropped_rps: f64,
    /// Shadow-dropped requests/s.
    pub shadow_dropped_rps: f64,
    /// Ratio in force at the end of the tick (for the token bucket: the dropped fraction).
    pub drop_ratio: f64,
    /// The bucket's limit.
    pub limit_rps: f64,
    /// The algorithm.
    pub algorithm: Algorithm,
    /// The same by criticality tier, least critical first, for the tiers that saw requests
    /// (only in a scenario whose callers give a `criticality`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tiers: Vec<TierRow>,
}

/// One tier's rates in a [`TickRow`].
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TierRow {
    /// The tier.
    pub tier: Criticality,
    /// Offered requests/s.
    pub offered_rps: f64,
    /// Admitted requests/s (shadow drops included).
    pub admitted_rps: f64,
    /// Dropped requests/s.
    pub dropped_rps: f64,
    /// Shadow-dropped requests/s.
    pub shadow_dropped_rps: f64,
}

/// Fine-grained counts of one bucket over one window.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Window {
    /// Window end (virtual ms).
    pub end_ms: u64,
    /// Offered in the window.
    pub offered: u64,
    /// Admitted in the window.
    pub admitted: u64,
    /// Dropped in the window.
    pub dropped: u64,
    /// Shadow-dropped in the window.
    pub shadow_dropped: u64,
}

/// The whole run.
#[derive(Debug, Clone, Default)]
pub struct SimResult {
    /// Per tick per bucket.
    pub rows: Vec<TickRow>,
    /// Per bucket name: windows of `WINDOW_MS`.
    pub windows: BTreeMap<String, Vec<Window>>,
    /// Per caller name: (offered, admitted) of matched requests in the second half of the run.
    pub per_caller: BTreeMap<String, (u64, u64)>,
    /// Per tick per candidate being evaluated (up to and including its verdict's tick).
    pub candidates: Vec<CandidateRow>,
}

/// Width of the fine-grained windows.
pub const WINDOW_MS: u64 = 100;

struct TokenBucket {
    rate: f64,
    tokens: f64,
}

struct Instance {
    caller: usize,
    caller_name: String,
    procedure: String,
    zone: usize,
    /// Share of the caller's load.
    share: f64,
    index_in_caller: usize,
    scale: f64,
    limiter: Arc<Limiter>,
    reporter: Reporter,
    /// The tier of its requests.
    tier: Criticality,
    tb: Vec<TokenBucket>,
    carry: f64,
    tick_offered: Vec<u64>,
    /// Requests offered since the last tick, matched by a bucket or not (the calls an
    /// aggregator forwards).
    tick_calls: u64,
    urgent_sent: bool,
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn rate_at(schedule: &[Segment], t: f64) -> f64 {
    schedule
        .iter()
        .rfind(|s| s.at_s <= t)
        .map_or(0.0, |s| s.rps)
}

impl Scenario {
    /// Parses a scenario file (errors name the file and line).
    pub fn load(path: &std::path::Path) -> Result<Scenario, schema::Diagnostic> {
        schema::parse_file::<Scenario>(path).map(|l| l.value)
    }

    fn check(&self) -> Result<(), SimError> {
        if self.step_ms == 0 || self.tick_ms == 0 || !self.tick_ms.is_multiple_of(self.step_ms) {
            return Err(SimError::Invalid(
                "tick_ms must be a positive multiple of step_ms".into(),
            ));
        }
        if !WINDOW_MS.is_multiple_of(self.step_ms) {
            return Err(SimError::Invalid(format!(
                "step_ms must divide {WINDOW_MS}"
            )));
        }
        // Written negated so that NaN is refused too.
        #[allow(clippy::neg_cmp_op_on_partial_ord)]
        if !(self.duration_s > 0.0) {
            return Err(SimError::Invalid("duration_s must be positive".into()));
        }
        for c in &self.callers {
            if c.instances == 0 || c.schedule.is_empty() {
                return Err(SimError::Invalid(format!(
                    "caller `{}` needs instances and a schedule",
                    c.name
                )));
            }
            for z in &c.zones {
                if !self.zone_list().iter().any(|s| &s.name == z) {
                    return Err(SimError::Invalid(format!(
                        "caller `{}`: unknown zone `{z}`",
                        c.name
                    )));
                }
            }
        }
        for (i, c) in self.candidates.iter().enumerate() {
            if !self.buckets.iter().any(|b| b.name == c.bucket.name) {
                return Err(SimError::Invalid(format!(
                    "candidates[{i}].bucket.name: `{}` is not one of the scenario's buckets (the simulator evaluates candidates for buckets in force)",
                    c.bucket.name
                )));
            }
        }
        if let Some(r) = &self.rollout {
            #[allow(clippy::neg_cmp_op_on_partial_ord)]
            if !(r.max_virtual_drop_share >= 0.0 && r.max_virtual_drop_share <= 1.0) {
                return Err(SimError::Invalid(
                    "rollout.max_virtual_drop_share must be between 0 and 1".into(),
                ));
            }
            #[allow(clippy::neg_cmp_op_on_partial_ord)]
            if !(r.min_offered >= 0.0 && r.min_offered.is_finite()) {
                return Err(SimError::Invalid(
                    "rollout.min_offered must be a finite number, 0 or more".into(),
                ));
            }
        }
        Ok(())
    }

    /// The scenario's candidates as the controller gets them.
    fn wire_candidates(&self) -> Vec<Candidate> {
        self.candidates
            .iter()
            .map(|c| Candidate {
                id: c.id.clone(),
                service: self.service.clone(),
                bucket: c.bucket.clone(),
            })
            .collect()
    }

    fn zone_list(&self) -> Vec<ZoneSpec> {
        if self.zones.is_empty() {
            vec![ZoneSpec {
                name: "z1".into(),
                region: "r1".into(),
            }]
        } else {
            self.zones.clone()
        }
    }
}

/// Runs `sc` with `algo`, calling `emit` for every tick row as it is produced.
pub fn run(
    sc: &Scenario,
    seed: u64,
    algo: Algorithm,
    emit: impl FnMut(&TickRow),
) -> Result<SimResult, SimError> {
    run_with(sc, seed, algo, emit, |_| {})
}

/// [`run`], also calling `emit_candidate` for every candidate row as it is produced.
pub fn run_with(
    sc: &Scenario,
    seed: u64,
    algo: Algorithm,
    mut emit: impl FnMut(&TickRow),
    mut emit_candidate: impl FnMut(&CandidateRow),
) -> Result<SimResult, SimError> {
    sc.check()?;
    seed_thread_rng(seed);
    let mut run = SimRun::new(sc, seed, algo)?;
    let end_ms = (sc.duration_s * 1000.0).round() as u64;
    while run.now < end_ms {
        run.apply_due();
        run.offer_step();
        run.now += sc.step_ms;
        if run.now.is_multiple_of(WINDOW_MS) {
            run.close_window();
        }
        // Clients watch their own rate every step (the real client every 10 ms).
        if algo == Algorithm::DropByRatio && sc.local_adjust && !run.now.is_multiple_of(sc.tick_ms)
        {
            run.urgent_round();
        }
        if !run.now.is_multiple_of(sc.tick_ms) {
            continue;
        }
        // A tick: clients report, zones sum, the controller computes, directives go back.
        match algo {
            Algorithm::DropByRatio => run.control_tick(&mut emit_candidate)?,
            Algorithm::TokenBucket => run.token_bucket_tick(),
        }
        run.end_tick(&mut emit);
    }
    Ok(run.result)
}

/// A run in progress: the fleet of instances, the engine, the buckets in force and what has
/// been counted so far, in virtual time.
struct SimRun<'a> {
    sc: &'a Scenario,
    algo: Algorithm,
    zones: Vec<ZoneSpec>,
    /// The buckets in force: a promoted candidate replaces its bucket.
    buckets: Vec<Bucket>,
    file: BucketFile,
    doc: ConfigDoc,
    rule: RolloutRule,
    engine: Engine,
    /// Requests the clients dropped per bucket since the start.
    dropped_total: Vec<u64>,
    /// Per candidate, `dropped_total` of its bucket when its evaluation began.
    cand_start: BTreeMap<String, u64>,
    /// Config changes made by decided candidates (the version's suffix).
    changes: u32,
    /// Instances of every caller replica.
    instances: Vec<Instance>,
    /// Per caller replica: its name, its spec and its jitter scale.
    caller_specs: Vec<(String, &'a CallerSpec, f64)>,
    /// Per instance, the bucket its (caller, procedure) matches.
    bucket_of: Vec<Option<usize>>,
    half_ms: u64,
    result: SimResult,
    tick_counts: Vec<Window>,
    /// Per bucket, the tick's counts by tier.
    tier_counts: Vec<[Window; TIERS]>,
    win_counts: Vec<Window>,
    /// (apply_at_ms, zone index, directives)
    pending: Vec<(u64, usize, ClientDirectives)>,
    /// (apply_at_ms, per instance per bucket token-bucket rates)
    pending_tb: Vec<(u64, Vec<Vec<f64>>)>,
    /// Each instance's latest reported rates and mix of tiers, as an aggregator keeps them.
    latest: Vec<Latest>,
    /// The step in seconds.
    dt: f64,
    now: u64,
}

impl<'a> SimRun<'a> {
    /// Validates the scenario's config, builds the engine and every caller's instances.
    fn new(sc: &'a Scenario, seed: u64, algo: Algorithm) -> Result<Self, SimError> {
        let zones = sc.zone_list();
        let buckets = sc.buckets.clone();
        let file = BucketFile {
            criticality: Default::default(),
            service: sc.service.clone(),
            buckets: buckets.clone(),
        };
        let doc = ConfigDoc {
            version: "sim".into(),
            services: vec![file.clone()],
            candidates: sc.wire_candidates(),
        };
        grl_control::config::validate(&doc)?;
        let rule = sc
            .rollout
            .as_ref()
            .map(SimRollout::rule)
            .unwrap_or_default();
        let engine = Engine::new(doc.clone(), sc.tick_ms * 3);
        let nb = sc.buckets.len();
        let caller_specs = caller_replicas(sc, seed);
        let instances = build_instances(sc, &zones, &caller_specs, &file)?;
        let bucket_of = bucket_of(&instances);
        let end_ms = (sc.duration_s * 1000.0).round() as u64;
        let latest = vec![BTreeMap::new(); instances.len()];
        Ok(SimRun {
            sc,
            algo,
            zones,
            buckets,
            file,
            doc,
            rule,
            engine,
            dropped_total: vec![0u64; nb],
            cand_start: BTreeMap::new(),
            changes: 0,
            instances,
            caller_specs,
            bucket_of,
            half_ms: end_ms / 2,
            result: SimResult::default(),
            tick_counts: vec![Window::default(); nb],
            tier_counts: vec![[Window::default(); TIERS]; nb],
            win_counts: vec![Window::default(); nb],
            pending: Vec::new(),
            pending_tb: Vec::new(),
            latest,
            dt: sc.step_ms as f64 / 1000.0,
            now: 0,
        })
    }

    /// Directives and token-bucket rates whose latency has elapsed take effect.
    fn apply_due(&mut self) {
        let now = self.now;
        let instances = &mut self.instances;
        self.pending.retain(|(at, zone, d)| {
            if *at <= now {
                for inst in instances.iter_mut().filter(|i| i.zone == *zone) {
                    inst.reporter.apply(d, now);
                }
                false
            } else {
                true
            }
        });
        self.pending_tb.retain(|(at, rates)| {
            if *at <= now {
                for (i, inst) in instances.iter_mut().enumerate() {
                    for (b, tb) in inst.tb.iter_mut().enumerate() {
                        tb.rate = rates[i][b];
                    }
                }
                false
            } else {
                true
            }
        });
    }

    /// Offers this step's requests of every instance and counts the decisions.
    fn offer_step(&mut self) {
        let sc = self.sc;
        let algo = self.algo;
        let now = self.now;
        let t_s = now as f64 / 1000.0;
        let dt = self.dt;
        for (ii, inst) in self.instances.iter_mut().enumerate() {
            let (_, spec, _) = self.caller_specs[inst.caller];
            let mut rate = rate_at(&spec.schedule, t_s) * inst.share * inst.scale;
            for b in &spec.bursts {
                if b.instance == inst.index_in_caller && t_s >= b.from_s && t_s < b.to_s {
                    rate *= b.factor;
                }
            }
            let want = rate * dt + inst.carry;
            let n = want.floor() as u64;
            inst.carry = want - n as f64;
            inst.tick_calls += n;
            let Some(b) = self.bucket_of[ii] else {
                continue;
            };
            let shadow = self.buckets[b].mode == Mode::Shadow;
            let c = decide_n(inst, algo, b, shadow, n, now);
            inst.tick_offered[b] += c.offered;
            self.dropped_total[b] += c.dropped;
            let tier = &mut self.tier_counts[b][inst.tier as usize];
            for w in [&mut self.tick_counts[b], &mut self.win_counts[b], tier] {
                w.offered += c.offered;
                w.admitted += c.admitted;
                w.dropped += c.dropped;
                w.shadow_dropped += c.shadow_dropped;
            }
            if now >= self.half_ms {
                let e = self
                    .result
                    .per_caller
                    .entry(inst.caller_name.clone())
                    .or_default();
                e.0 += c.offered;
                e.1 += c.admitted;
            }
            if algo == Algorithm::TokenBucket && !sc.token_bucket.whole_tokens {
                let tb = &mut inst.tb[b];
                tb.tokens =
                    (tb.tokens + tb.rate * dt).min((tb.rate * sc.token_bucket.burst_secs).max(1.0));
            }
        }
    }

    /// Closes the fine-grained window that ends now.
    fn close_window(&mut self) {
        for (b, w) in self.win_counts.iter_mut().enumerate() {
            w.end_ms = self.now;
            self.result
                .windows
                .entry(self.buckets[b].name.clone())
                .or_default()
                .push(*w);
            *w = Window::default();
        }
    }

    /// Between ticks: the instances whose own rate jumped report at once (once per tick).
    fn urgent_round(&mut self) {
        let mut urgent = Vec::new();
        for (i, inst) in self.instances.iter_mut().enumerate() {
            if inst.reporter.subtick(self.now) && !inst.urgent_sent {
                inst.urgent_sent = true;
                urgent.push(i);
            }
        }
        if !urgent.is_empty() {
            self.control_round(&urgent, Vec::new());
        }
    }

    /// [`control_round`] over this run's fleet.
    fn control_round(&mut self, ids: &[usize], calls: Vec<Vec<ServiceCallCountMsg>>) {
        control_round(
            self.sc,
            &self.zones,
            &mut self.engine,
            &mut self.instances,
            &mut self.latest,
            ids,
            self.now,
            &mut self.pending,
            calls,
        );
    }

    /// A drop-by-ratio tick: every instance reports with the tick's calls, the engine
    /// recomputes and evaluates the candidates, and each candidate is judged.
    fn control_tick(
        &mut self,
        emit_candidate: &mut impl FnMut(&CandidateRow),
    ) -> Result<(), SimError> {
        let all: Vec<usize> = (0..self.instances.len()).collect();
        let calls = self.tick_calls();
        self.control_round(&all, calls);
        self.instances
            .iter_mut()
            .for_each(|i| i.urgent_sent = false);
        // The controller's tick evaluates the candidates; each is judged.
        self.engine.evaluate_candidates(self.now, self.now);
        let decided = self.judge_candidates(emit_candidate);
        if !decided.is_empty() {
            self.apply_decided(decided)?;
        }
        Ok(())
    }

    /// Every request since the last tick by (caller, procedure), per zone, as the zones'
    /// aggregators forward them.
    fn tick_calls(&mut self) -> Vec<Vec<ServiceCallCountMsg>> {
        let mut calls: Vec<BTreeMap<(String, String), u64>> =
            vec![BTreeMap::new(); self.zones.len()];
        for inst in self.instances.iter_mut() {
            if inst.tick_calls > 0 {
                *calls[inst.zone]
                    .entry((inst.caller_name.clone(), inst.procedure.clone()))
                    .or_default() += std::mem::take(&mut inst.tick_calls);
            }
        }
        calls
            .into_iter()
            .map(|m| {
                m.into_iter()
                    .map(|((caller, procedure), count)| ServiceCallCountMsg {
                        service: self.sc.service.clone(),
                        caller,
                        procedure,
                        count,
                    })
                    .collect()
            })
            .collect()
    }

    /// Judges every candidate the engine evaluates, emitting a row for each; returns the
    /// decided ones with the bucket a promoted one brings.
    fn judge_candidates(
        &mut self,
        emit_candidate: &mut impl FnMut(&CandidateRow),
    ) -> Vec<(String, Option<Bucket>)> {
        let now = self.now;
        let mut decided: Vec<(String, Option<Bucket>)> = Vec::new();
        for r in self.engine.candidate_reports() {
            let Some(b) = self.buckets.iter().position(|b| b.name == r.bucket) else {
                continue;
            };
            let start = *self
                .cand_start
                .entry(r.id.clone())
                .or_insert(self.dropped_total[b]);
            let verdict = judge(
                &self.rule,
                &Observed {
                    baked: Duration::from_secs_f64(r.seconds.max(0.0)),
                    // The candidate reaches the simulated controller when its stage
                    // begins.
                    waited: Duration::from_secs_f64(r.seconds.max(0.0)),
                    offered: r.offered,
                    virtual_dropped: r.virtual_dropped,
                    // One controller decides alone.
                    covered: Duration::from_secs_f64(r.seconds.max(0.0)),
                },
            );
            let (name, reason) = match &verdict {
                Verdict::Baking => ("baking", None),
                Verdict::Promote => ("promote", None),
                Verdict::Abort { reason } => ("abort", Some(reason.clone())),
            };
            let row = CandidateRow {
                t: now as f64 / 1000.0,
                candidate: r.id.clone(),
                bucket: r.bucket.clone(),
                limit_rps: r.limit_rps,
                in_force_limit_rps: self.buckets[b].limit_rps,
                baked_s: r.seconds,
                offered: r.offered,
                virtual_dropped: r.virtual_dropped,
                virtual_drop_share: r.virtual_drop_share,
                real_dropped: self.dropped_total[b] - start,
                verdict: name.into(),
                reason,
            };
            emit_candidate(&row);
            self.result.candidates.push(row);
            match verdict {
                Verdict::Baking => {}
                Verdict::Promote => {
                    let c = self.doc.candidates.iter().find(|c| c.id == r.id);
                    decided.push((r.id.clone(), c.map(|c| c.bucket.clone())));
                }
                Verdict::Abort { .. } => decided.push((r.id.clone(), None)),
            }
        }
        decided
    }

    /// Promoted candidates become the limits in force; decided ones leave. The new config
    /// goes to the engine and every instance.
    fn apply_decided(&mut self, decided: Vec<(String, Option<Bucket>)>) -> Result<(), SimError> {
        for (id, promoted) in decided {
            self.doc.candidates.retain(|c| c.id != id);
            if let Some(new) = promoted {
                if let Some(b) = self.buckets.iter_mut().find(|b| b.name == new.name) {
                    *b = new;
                }
            }
        }
        self.changes += 1;
        self.file.buckets = self.buckets.clone();
        self.doc.services = vec![self.file.clone()];
        self.doc.version = format!("sim+{}", self.changes);
        grl_control::config::validate(&self.doc)?;
        self.engine.set_config(self.doc.clone());
        for inst in self.instances.iter_mut() {
            inst.reporter
                .install(&self.sc.service, Some(&self.file), &self.doc.version)
                .map_err(|e| SimError::Invalid(e.to_string()))?;
        }
        self.bucket_of = bucket_of(&self.instances);
        Ok(())
    }

    /// A token-bucket tick: each host refills at (its share of the scope's offered load) ×
    /// limit, in force after the loop latency.
    fn token_bucket_tick(&mut self) {
        let sc = self.sc;
        let buckets = &self.buckets;
        let zones = &self.zones;
        let mut fleet: BTreeMap<(usize, String), u64> = BTreeMap::new();
        for inst in &self.instances {
            let z = &zones[inst.zone];
            for (b, &n) in inst.tick_offered.iter().enumerate() {
                *fleet
                    .entry((b, scope_key(buckets[b].scope, &z.region, &z.name)))
                    .or_default() += n;
            }
        }
        let mut rates = Vec::with_capacity(self.instances.len());
        for inst in &self.instances {
            let z = &zones[inst.zone];
            let row: Vec<f64> = (0..buckets.len())
                .map(|b| {
                    let total = fleet[&(b, scope_key(buckets[b].scope, &z.region, &z.name))];
                    if total == 0 {
                        inst.tb[b].rate
                    } else {
                        inst.tick_offered[b] as f64 / total as f64 * buckets[b].limit_rps
                    }
                })
                .collect();
            rates.push(row);
        }
        self.pending_tb.push((self.now + sc.loop_latency_ms, rates));
        if sc.token_bucket.whole_tokens {
            let tick_s = sc.tick_ms as f64 / 1000.0;
            for inst in self.instances.iter_mut() {
                for tb in inst.tb.iter_mut() {
                    let cap = (tb.rate * sc.token_bucket.burst_secs).floor();
                    tb.tokens = (tb.tokens + (tb.rate * tick_s).floor()).min(cap);
                }
            }
        }
    }

    /// Ends a tick: resets the instances' tick counters and emits a row per bucket.
    fn end_tick(&mut self, emit: &mut impl FnMut(&TickRow)) {
        for inst in self.instances.iter_mut() {
            inst.tick_offered.iter_mut().for_each(|x| *x = 0);
            inst.tick_calls = 0;
        }
        let secs = self.sc.tick_ms as f64 / 1000.0;
        let tiered = self.sc.callers.iter().any(|c| c.criticality.is_some());
        for (b, c) in self.tick_counts.iter_mut().enumerate() {
            let ratio = match self.algo {
                Algorithm::DropByRatio => self.engine.buckets()[b]
                    .keys
                    .iter()
                    .map(|k| k.ratio)
                    .fold(0.0, f64::max),
                Algorithm::TokenBucket => {
                    if c.offered == 0 {
                        0.0
                    } else {
                        (c.dropped + c.shadow_dropped) as f64 / c.offered as f64
                    }
                }
            };
            let row = TickRow {
                t: self.now as f64 / 1000.0,
                bucket: self.buckets[b].name.clone(),
                offered_rps: c.offered as f64 / secs,
                admitted_rps: c.admitted as f64 / secs,
                dropped_rps: c.dropped as f64 / secs,
                shadow_dropped_rps: c.shadow_dropped as f64 / secs,
                drop_ratio: ratio,
                limit_rps: self.buckets[b].limit_rps,
                algorithm: self.algo,
                tiers: Criticality::ALL
                    .iter()
                    .zip(std::mem::take(&mut self.tier_counts[b]))
                    .filter(|(_, w)| tiered && w.offered > 0)
                    .map(|(&tier, w)| TierRow {
                        tier,
                        offered_rps: w.offered as f64 / secs,
                        admitted_rps: w.admitted as f64 / secs,
                        dropped_rps: w.dropped as f64 / secs,
                        shadow_dropped_rps: w.shadow_dropped as f64 / secs,
                    })
                    .collect(),
            };
            emit(&row);
            self.result.rows.push(row);
            *c = Window::default();
        }
    }
}

/// Every caller replica: its name, its spec and its load scale (a seeded jitter).
fn caller_replicas(sc: &Scenario, seed: u64) -> Vec<(String, &CallerSpec, f64)> {
    let mut caller_specs: Vec<(String, &CallerSpec, f64)> = Vec::new();
    for c in &sc.callers {
        for r in 0..c.replicas {
            let name = if c.replicas == 1 {
                c.name.clone()
            } else {
                format!("{}-{r}", c.name)
            };
            let u = (splitmix(seed ^ splitmix(caller_specs.len() as u64 + 1)) >> 11) as f64
                / (1u64 << 53) as f64;
            let scale = (1.0 + c.jitter * (2.0 * u - 1.0)).max(0.0);
            caller_specs.push((name, c, scale));
        }
    }
    caller_specs
}

/// The instances of every caller replica, each a real limiter and reporter with `file`
/// installed; token buckets start with an equal share of each limit among the instances
/// that hit it.
fn build_instances(
    sc: &Scenario,
    zones: &[ZoneSpec],
    caller_specs: &[(String, &CallerSpec, f64)],
    file: &BucketFile,
) -> Result<Vec<Instance>, SimError> {
    let mut instances: Vec<Instance> = Vec::new();
    for (ci, (name, c, scale)) in caller_specs.iter().enumerate() {
        let weight = |i: usize| {
            if c.weights.is_empty() {
                1.0
            } else {
                c.weights[i % c.weights.len()]
            }
        };
        let wsum: f64 = (0..c.instances).map(weight).sum();
        let zone_names: Vec<String> = if c.zones.is_empty() {
            zones.iter().map(|z| z.name.clone()).collect()
        } else {
            c.zones.clone()
        };
        for i in 0..c.instances {
            let w = weight(i);
            let zone = zones
                .iter()
                .position(|z| z.name == zone_names[i % zone_names.len()])
                .expect("zones checked");
            let limiter = Arc::new(Limiter::new(
                &sc.service,
                Duration::from_millis(sc.stale_after_ms),
            ));
            let mut reporter = Reporter::new(limiter.clone(), &format!("{name}#{i}"), 0);
            reporter
                .install(&sc.service, Some(file), "sim")
                .map_err(|e| SimError::Invalid(e.to_string()))?;
            instances.push(Instance {
                caller: ci,
                caller_name: name.clone(),
                procedure: c.procedure.clone(),
                zone,
                share: w / wsum,
                index_in_caller: i,
                scale: *scale,
                limiter,
                reporter,
                tier: c.criticality.unwrap_or_default(),
                tb: Vec::new(),
                carry: 0.0,
                tick_offered: vec![0; sc.buckets.len()],
                tick_calls: 0,
                urgent_sent: false,
            });
        }
    }
    for b in 0..sc.buckets.len() {
        let hitting: Vec<usize> = (0..instances.len())
            .filter(|&i| {
                let t = instances[i].limiter.table();
                t.find(&instances[i].caller_name, &instances[i].procedure) == Some(b)
            })
            .collect();
        let n = hitting.len().max(1) as f64;
        for inst in instances.iter_mut() {
            let rate = sc.buckets[b].limit_rps / n;
            inst.tb.push(TokenBucket { rate, tokens: rate });
        }
    }
    Ok(instances)
}

/// Per instance, the bucket its (caller, procedure) matches in its installed table.
fn bucket_of(instances: &[Instance]) -> Vec<Option<usize>> {
    instances
        .iter()
        .map(|i| i.limiter.table().find(&i.caller_name, &i.procedure))
        .collect()
}

/// Decides `n` requests of `inst` matched by bucket `b` at `now`, by the limiter or by the
/// instance's token bucket, and counts them.
fn decide_n(
    inst: &mut Instance,
    algo: Algorithm,
    b: usize,
    shadow: bool,
    n: u64,
    now: u64,
) -> Window {
    let mut c = Window::default();
    for _ in 0..n {
        let d = match algo {
            Algorithm::DropByRatio => {
                inst.limiter
                    .decide_tier_at(&inst.caller_name, &inst.procedure, inst.tier, now)
            }
            Algorithm::TokenBucket => {
                // Keep the reporter's counters meaningful for the token bucket too:
                // the share it refills from is this host's offered count.
                let tb = &mut inst.tb[b];
                if tb.tokens >= 1.0 {
                    tb.tokens -= 1.0;
                    Decision::Admit
                } else if shadow {
                    Decision::ShadowDrop
                } else {
                    Decision::Drop
                }
            }
        };
        c.offered += 1;
        match d {
            Decision::Admit => c.admitted += 1,
            Decision::ShadowDrop => {
                c.admitted += 1;
                c.shadow_dropped += 1
            }
            Decision::Drop => c.dropped += 1,
        }
    }
    c
}

/// An instance's latest rates per bucket and their mix of tiers, as an aggregator keeps them.
type Latest = BTreeMap<String, ([f64; 4], Option<[f64; TIERS]>)>;

/// One control round: the instances in `ids` report (the others keep their latest rates, as
/// an aggregator does), every zone forwards its sums (and, when the scenario's zones forward
/// tiers, the offered rates by tier of a zone whose every client counted them), the engine
/// recomputes, and each zone's directives are queued to reach its clients after the loop
/// latency.
#[allow(clippy::too_many_arguments)]
fn control_round(
    sc: &Scenario,
    zones: &[ZoneSpec],
    engine: &mut Engine,
    instances: &mut [Instance],
    latest: &mut [Latest],
    ids: &[usize],
    now: u64,
    pending: &mut Vec<(u64, usize, ClientDirectives)>,
    // Per zone, the calls since the last tick (empty between ticks).
    mut calls: Vec<Vec<ServiceCallCountMsg>>,
) {
    for &i in ids {
        let r = instances[i].reporter.build_report(now);
        latest[i] = r
            .rates()
            .into_iter()
            .zip(&r.buckets)
            .map(|((b, rates), c)| (b, (rates, tier_mix(c))))
            .collect();
    }
    let mut per_zone: Vec<BTreeMap<String, (ZoneBucketMsg, TierSum)>> =
        (0..zones.len()).map(|_| BTreeMap::new()).collect();
    for (i, inst) in instances.iter().enumerate() {
        for (b, (r, mix)) in &latest[i] {
            let (e, tiers) = per_zone[inst.zone].entry(b.clone()).or_insert_with(|| {
                let m = ZoneBucketMsg {
                    service: sc.service.clone(),
                    bucket: b.clone(),
                    ..Default::default()
                };
                (m, TierSum::default())
            });
            e.offered_rps += r[0];
            e.admitted_rps += r[1];
            e.dropped_rps += r[2];
            e.shadow_dropped_rps += r[3];
            tiers.add(r[0], mix.as_ref());
        }
    }
    // A tick's calls cover the tick (an urgent round between ticks carries none and says
    // nothing).
    let calls_ms = (!calls.is_empty()).then_some(sc.tick_ms);
    for (zi, z) in zones.iter().enumerate() {
        let report = ZoneReport {
            aggregator_id: format!("sim-{}", z.name),
            region: z.region.clone(),
            zone: z.name.clone(),
            buckets: std::mem::take(&mut per_zone[zi])
                .into_values()
                .map(|(mut b, tiers)| {
                    b.tier_offered_rps = tiers.whole().filter(|_| sc.tiers);
                    b
                })
                .collect(),
            calls: calls.get_mut(zi).map(std::mem::take).unwrap_or_default(),
            calls_ms,
            session: None,
        };
        engine.ingest(&report, now);
    }
    engine.recompute(now, now / 1000);
    for (zi, z) in zones.iter().enumerate() {
        let zd = engine.directives_for(&z.region, &z.name);
        let directives = zd
            .services
            .into_iter()
            .find(|s| s.service == sc.service)
            .map(|s| s.directives)
            .unwrap_or_default();
        pending.push((
            now + sc.loop_latency_ms,
            zi,
            ClientDirectives {
                version: zd.version,
                age_ms: Some(0),
                directives,
            },
        ));
    }
}
