//! The client side: a `Reporter` state machine (no I/O, shared with the simulator) and
//! `GrlClient`, which runs it against zone aggregators over HTTP.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use grl_core::control::{adjusted_ratio, Directive};
use grl_core::criticality::{split, TierShed};
use grl_core::{now_ms, BucketCounts, CompileError, Limiter, Table};
use schema::criticality::TIERS;
use schema::{BucketFile, Criticality};
use tokio::task::JoinHandle;

use crate::auth::TokenSource;
use crate::calls::{CallCounter, CallDrain, PendingCalls};
use grl_wire::{
    BucketCountsMsg, CallCountMsg, ClientDirectives, ClientReport, ConfigDoc, TierCountsMsg,
    TierShedMsg,
};

/// Sub-tick windows with fewer requests than this are too noisy to act on.
const MIN_SUBTICK_REQUESTS: u64 = 20;
/// The sub-tick window of the lower-bound adjustment (see `grl_core::control::adjusted_ratio`).
const SUBTICK_WINDOW_MS: u64 = 250;
/// The short window in which a client spots a fleet-wide step: its own rate far above its
/// share of the allowance (`grl_core::control::far_above_share`) drops at once, not a sub-tick
/// later. A 15× step of a client at 27 rps shows as 9 requests in 20 ms.
const FAST_WINDOW_MS: u64 = 20;
/// How long a ratio a client raised on its own holds against directives that do not show its
/// jump yet (computed from reports before it): until one does, or this long.
const JUMP_HOLD_MS: u64 = 2000;
/// Fewer requests than this in a short window say nothing.
const MIN_FAST_REQUESTS: u64 = 8;
/// In a short window the rate must also be this many times the client's own previous rate:
/// Poisson noise over 20 ms of a steady client stays well below it.
const FAST_JUMP: f64 = 3.0;

/// What a client does each tick, without the transport: turn counters into a report, apply
/// the directives that come back, install new configs, and between reports raise a bucket's
/// ratio when the client's own offered rate jumps (the controller sees that a loop later).
pub struct Reporter {
    limiter: Arc<Limiter>,
    client_id: String,
    table: Arc<Table>,
    /// Each bucket's counts by tier at the last report.
    prev: Vec<[BucketCounts; TIERS]>,
    /// Counts of replaced tables not reported yet, by bucket name.
    carry: HashMap<String, BucketCounts>,
    /// Where the next report's interval starts (moved back when a report was not taken).
    last_report_ms: u64,
    /// When the last report was built: the local rates are those since.
    last_built_ms: u64,
    /// Own offered rate per bucket over the last reported interval.
    local_rps: Vec<f64>,
    /// The same by criticality tier (least critical first).
    local_tier_rps: Vec<[f64; TIERS]>,
    directives: Vec<Option<Directive>>,
    /// The tier split of each bucket's last directive (None: every tier drops the ratio).
    sheds: Vec<Option<TierShedMsg>>,
    /// The ratio of the bucket's whole offered load the limiter drops now, whatever its tiers.
    applied: Vec<f64>,
    /// Offered counts by tier at the start of the long and the short window.
    sub_prev: Vec<[u64; TIERS]>,
    sub_prev_ms: u64,
    /// Every request by (caller, procedure), when counted (see [`Reporter::with_calls`]).
    calls: Option<CallDrain>,
    /// Calls drained but not sent yet (bounded).
    pending_calls: PendingCalls,
    fast_prev: Vec<[u64; TIERS]>,
    fast_prev_ms: u64,
    /// A ratio raised on the client's own jump, per bucket: see [`Hold`].
    hold: Vec<Option<Hold>>,
}

/// A ratio a client raised because its own rate jumped. A directive computed before the
/// controller saw the jump (its fleet rate below `fleet_min`, the last known fleet rate plus
/// this client's own growth) would set the old ratio again and let the jump through for
/// another loop: such a directive does not lower the ratio, until `until_ms`.
#[derive(Debug, Clone, Copy)]
struct Hold {
    ratio: f64,
    fleet_min: f64,
    until_ms: u64,
}

impl Hold {
    /// The hold after raising the ratio to `ratio` on a local rate `rate` against `d`: the
    /// first jump sets the deadline (later windows of the same jump do not extend it). A
    /// directive shows the jump when its fleet rate grew by at least half this client's own
    /// growth (rates of different windows differ a little).
    fn raised(prev: Option<Hold>, d: &Directive, rate: f64, ratio: f64, now_ms: u64) -> Hold {
        let fleet_min = d.fleet_offered_rps + 0.5 * (rate - d.local_offered_rps);
        match prev {
            Some(h) => Hold {
                ratio: h.ratio.max(ratio),
                fleet_min: h.fleet_min.max(fleet_min),
                until_ms: h.until_ms,
            },
            None => Hold {
                ratio,
                fleet_min,
                until_ms: now_ms + JUMP_HOLD_MS,
            },
        }
    }
}

impl Reporter {
    /// A reporter for `limiter`, starting its first interval at `now_ms`.
    pub fn new(limiter: Arc<Limiter>, client_id: &str, now_ms: u64) -> Reporter {
        let table = limiter.table();
        let n = table.buckets().len();
        Reporter {
            limiter,
            client_id: client_id.into(),
            prev: (0..n).map(|i| table.tier_counts(i)).collect(),
            table,
            carry: HashMap::new(),
            last_report_ms: now_ms,
            last_built_ms: now_ms,
            local_rps: vec![0.0; n],
            local_tier_rps: vec![[0.0; TIERS]; n],
            directives: vec![None; n],
            sheds: vec![None; n],
            applied: vec![0.0; n],
            sub_prev: vec![[0; TIERS]; n],
            sub_prev_ms: now_ms,
            fast_prev: vec![[0; TIERS]; n],
            fast_prev_ms: now_ms,
            hold: vec![None; n],
            calls: None,
            pending_calls: PendingCalls::new(crate::calls::DEFAULT_CLIENT_KEYS),
        }
    }

    /// Also reports the calls `counter` counts, holding at most `max_keys` (caller,
    /// procedure) keys between reports.
    pub fn with_calls(mut self, counter: &Arc<CallCounter>, max_keys: usize) -> Reporter {
        self.calls = Some(counter.drain());
        self.pending_calls = PendingCalls::new(max_keys);
        self
    }

    /// The calls counted since they were last taken (drained at every report), for a report
    /// to an aggregator that takes them.
    pub fn take_calls(&mut self) -> Vec<CallCountMsg> {
        self.pending_calls
            .take()
            .into_iter()
            .map(|((caller, procedure), count)| CallCountMsg {
                caller,
                procedure,
                count,
            })
            .collect()
    }

    /// Puts back calls that could not be sent (they go with a later report).
    pub fn restore_calls(&mut self, calls: Vec<CallCountMsg>) {
        for c in calls {
            self.pending_calls.add(&c.caller, &c.procedure, c.count);
        }
    }

    /// The limiter driven.
    pub fn limiter(&self) -> &Arc<Limiter> {
        &self.limiter
    }

    /// The config version running.
    pub fn version(&self) -> &str {
        self.table.version()
    }

    /// Counts since the previous report, as a report.
    pub fn build_report(&mut self, now_ms: u64) -> ClientReport {
        let interval_ms = now_ms.saturating_sub(self.last_report_ms).max(1);
        let fresh_ms = now_ms.saturating_sub(self.last_built_ms).max(1);
        if let Some(d) = &mut self.calls {
            d.drain_into(&mut self.pending_calls);
        }
        let mut buckets = Vec::with_capacity(self.prev.len() + self.carry.len());
        for (i, b) in self.table.buckets().iter().enumerate() {
            let now = self.table.tier_counts(i);
            let tiers: [BucketCounts; TIERS] =
                std::array::from_fn(|t| now[t].since(&self.prev[i][t]));
            self.prev[i] = now;
            let mut d = BucketCounts::default();
            for t in &tiers {
                d.add(t);
            }
            let per_sec = 1000.0 / fresh_ms as f64;
            self.local_rps[i] = d.offered as f64 * per_sec;
            self.local_tier_rps[i] = tiers.map(|t| t.offered as f64 * per_sec);
            if let Some(c) = self.carry.remove(&b.name) {
                d.add(&c);
            }
            if d.offered > 0 {
                let mut m = msg(&b.name, &d);
                m.tiers = tier_msgs(&tiers);
                buckets.push(m);
            }
        }
        // Buckets that disappeared with a config change still report their last counts.
        for (name, d) in self.carry.drain() {
            if d.offered > 0 {
                buckets.push(msg(&name, &d));
            }
        }
        self.last_report_ms = now_ms;
        self.last_built_ms = now_ms;
        ClientReport {
            client_id: self.client_id.clone(),
            service: self.table.service().to_string(),
            version: self.table.version().to_string(),
            interval_ms,
            buckets,
            urgent: false,
            calls: Vec::new(),
        }
    }

    /// Takes back the counts of `report` (the last one built) that no aggregator took: they
    /// go with the next report, whose interval then starts where this one's did, so that
    /// the rates an aggregator computes from them stay right.
    pub fn unsend(&mut self, report: &ClientReport) {
        for b in &report.buckets {
            let c = self.carry.entry(b.bucket.clone()).or_default();
            c.add(&BucketCounts {
                offered: b.offered,
                admitted: b.admitted,
                dropped: b.dropped,
                shadow_dropped: b.shadow_dropped,
            });
        }
        self.last_report_ms = self.last_report_ms.saturating_sub(report.interval_ms);
    }

    /// Applies the directives of a reply received at `now_ms`. Returns whether they were fresh
    /// (the aggregator heard from the controller within the staleness bound).
    pub fn apply(&mut self, d: &ClientDirectives, now_ms: u64) -> bool {
        let mut seen = vec![false; self.directives.len()];
        for m in &d.directives {
            let Some(i) = self.table.index_of(&m.bucket) else {
                continue;
            };
            seen[i] = true;
            if let Some(h) = self.hold[i] {
                if !m.fixed && now_ms < h.until_ms && m.fleet_offered_rps < h.fleet_min {
                    // Computed before the controller saw this client's jump: the raised ratio
                    // and the directive it was computed from stay.
                    self.sheds[i] = m.shed;
                    self.set_shed(i, m.ratio.max(h.ratio), m.ratio);
                    continue;
                }
                self.hold[i] = None;
            }
            let dir = Directive {
                ratio: m.ratio,
                fleet_offered_rps: m.fleet_offered_rps,
                limit_rps: m.limit_rps,
                local_offered_rps: self.local_rps[i],
                fixed: m.fixed,
            };
            // At least the ratio this instance's own rate alone asks for: an aggregator cuts a
            // claim above what one instance plausibly offers (`aggregator::screen`), so the
            // fleet's ratio can understate the excess of an instance that really receives it.
            // Never above the fleet-wide formula's: its own rate is part of the fleet's.
            let own = if m.fixed {
                0.0
            } else {
                grl_core::control::drop_ratio(self.local_rps[i], m.limit_rps)
            };
            self.sheds[i] = m.shed;
            self.set_shed(i, dir.ratio.max(own), m.ratio);
            self.directives[i] = Some(dir);
        }
        for (i, s) in seen.iter().enumerate() {
            if !s {
                self.sheds[i] = None;
                self.set_shed(i, 0.0, 0.0);
                self.directives[i] = None;
                self.hold[i] = None;
            }
        }
        match d.age_ms {
            Some(age) if age < self.limiter.stale_after_ms() => {
                self.limiter.directives_received(now_ms.saturating_sub(age));
                true
            }
            _ => false,
        }
    }

    /// Drops `ratio` of bucket `i`'s whole offered load. Under a tier split (the directive's
    /// [`TierShedMsg`]): as the controller split it when `ratio` is the directive's own
    /// `directed` ratio; when the client raised it on its own (its own rate jumped), the same
    /// strict split over the client's own mix of tiers, so that the extra shed falls on the
    /// least critical tiers too. Without a split: every tier drops `ratio`.
    fn set_shed(&mut self, i: usize, ratio: f64, directed: f64) {
        self.set_shed_over(i, ratio, directed, self.local_tier_rps[i]);
    }

    /// [`Reporter::set_shed`] with the client's own `mix` of tiers given (a window's).
    fn set_shed_over(&mut self, i: usize, ratio: f64, directed: f64, mix: [f64; TIERS]) {
        self.applied[i] = ratio;
        let total: f64 = mix.iter().sum();
        let split_of = self.sheds[i].map(|s| TierShed {
            threshold: s.threshold,
            fraction: s.fraction,
        });
        match split_of {
            Some(s) if ratio <= directed => self.table.set_tier_shed(i, &s),
            // Never less on any tier than the controller's split (a `shed_below` floor).
            Some(s) if total > 0.0 => self
                .table
                .set_tier_shed(i, &split(ratio * total, mix).max(s)),
            _ => self.table.set_ratio(i, ratio),
        }
    }

    /// Installs `file` (or an empty bucket set when the service has none) at `version`.
    pub fn install(
        &mut self,
        service: &str,
        file: Option<&BucketFile>,
        version: &str,
    ) -> Result<(), CompileError> {
        let t = match file {
            Some(f) => Table::compile_file(version, f)?,
            None => Table::compile(service, version, &[])?,
        };
        let old = self.limiter.install(t);
        for (i, b) in old.buckets().iter().enumerate() {
            let now = old.tier_counts(i);
            let carry = self.carry.entry(b.name.clone()).or_default();
            for (t, prev) in now.iter().zip(&self.prev[i]) {
                carry.add(&t.since(prev));
            }
        }
        self.table = self.limiter.table();
        let n = self.table.buckets().len();
        self.prev = vec![[BucketCounts::default(); TIERS]; n];
        self.local_rps = vec![0.0; n];
        self.local_tier_rps = vec![[0.0; TIERS]; n];
        self.directives = vec![None; n];
        self.sheds = vec![None; n];
        self.applied = vec![0.0; n];
        self.sub_prev = vec![[0; TIERS]; n];
        self.fast_prev = vec![[0; TIERS]; n];
        self.hold = vec![None; n];
        Ok(())
    }

    /// Between reports: raises a bucket's ratio when this client's own offered rate has jumped
    /// since the directive (see `grl_core::control::adjusted_ratio`). Call it often (every
    /// 10 to 20 ms): short windows (`FAST_WINDOW_MS`) catch a fleet-wide step at once, and
    /// every `SUBTICK_WINDOW_MS` the longer window takes the smaller jumps. Returns whether
    /// some bucket jumped, in which case the caller should report at once instead of at the
    /// tick.
    pub fn subtick(&mut self, now_ms: u64) -> bool {
        let fast_dt = now_ms.saturating_sub(self.fast_prev_ms);
        let long_dt = now_ms.saturating_sub(self.sub_prev_ms);
        let fast = fast_dt >= FAST_WINDOW_MS;
        let long = long_dt >= SUBTICK_WINDOW_MS;
        if !fast && !long {
            return false;
        }
        let mut jumped = false;
        for i in 0..self.sub_prev.len() {
            let now = self.table.tier_counts(i).map(|c| c.offered);
            let d = self.directives[i];
            if fast {
                let win = window(now, &mut self.fast_prev[i]);
                let n: u64 = win.iter().sum();
                if let Some(d) = &d {
                    let rate = n as f64 * 1000.0 / fast_dt as f64;
                    if n >= MIN_FAST_REQUESTS
                        && rate > d.local_offered_rps * FAST_JUMP
                        && grl_core::control::far_above_share(d, rate)
                    {
                        jumped = true;
                        let r = adjusted_ratio(d, rate);
                        if r > self.applied[i] {
                            self.set_shed_over(i, r, d.ratio, win.map(|c| c as f64));
                            self.hold[i] = Some(Hold::raised(self.hold[i], d, rate, r, now_ms));
                        }
                    }
                }
            }
            if long {
                let win = window(now, &mut self.sub_prev[i]);
                let n: u64 = win.iter().sum();
                let Some(d) = &d else {
                    continue;
                };
                if n < MIN_SUBTICK_REQUESTS {
                    continue;
                }
                let rate = n as f64 * 1000.0 / long_dt as f64;
                let jump = grl_core::control::jumped(d, rate);
                jumped |= jump;
                let r = adjusted_ratio(d, rate);
                if r > self.applied[i] {
                    self.set_shed_over(i, r, d.ratio, win.map(|c| c as f64));
                    self.hold[i] = Some(Hold::raised(self.hold[i], d, rate, r, now_ms));
                }
            }
        }
        if fast {
            self.fast_prev_ms = now_ms;
        }
        if long {
            self.sub_prev_ms = now_ms;
        }
        jumped
    }
}

/// The offered counts by tier since `prev` (a window's start), which becomes `now`.
fn window(now: [u64; TIERS], prev: &mut [u64; TIERS]) -> [u64; TIERS] {
    let w = std::array::from_fn(|t| now[t].saturating_sub(prev[t]));
    *prev = now;
    w
}

/// The tiers that saw requests, as sent in a report.
fn tier_msgs(tiers: &[BucketCounts; TIERS]) -> Vec<TierCountsMsg> {
    Criticality::ALL
        .into_iter()
        .zip(tiers)
        .filter(|(_, c)| c.offered > 0)
        .map(|(tier, c)| TierCountsMsg {
            tier,
            offered: c.offered,
            admitted: c.admitted,
            dropped: c.dropped,
            shadow_dropped: c.shadow_dropped,
        })
        .collect()
}

fn msg(name: &str, d: &BucketCounts) -> BucketCountsMsg {
    BucketCountsMsg {
        bucket: name.to_string(),
        offered: d.offered,
        admitted: d.admitted,
        dropped: d.dropped,
        shadow_dropped: d.shadow_dropped,
        tiers: Vec::new(),
    }
}

/// How to start a client.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// The callee service this client enforces for.
    pub service: String,
    /// Zone aggregator URLs, in order of preference; the client fails over between them.
    pub aggregators: Vec<String>,
    /// Reporting period.
    pub tick: Duration,
    /// Directives older than this stop dropping: the client's task checks the deadline every
    /// eighth of it (between 5 and 100 ms), whatever the request rate.
    pub stale_after: Duration,
    /// Instance id (random when absent).
    pub client_id: Option<String>,
    /// How the aggregators are verified (CA) and how this client identifies itself (client
    /// certificate) over https. A file that does not load leaves the limiter open (logged).
    pub tls: crate::tls::ClientTls,
    /// The report credential sent to the aggregators (a secret covering `service`). Without
    /// one, aggregators refuse the reports (unless started for development with
    /// `--insecure-allow-anonymous-reports`) and the limiter stays open.
    pub report_token: Option<TokenSource>,
    /// Distinct (caller, procedure) keys counted between reports; beyond, new callers count
    /// as `_other` (see [`crate::calls`]).
    pub max_call_keys: usize,
}

impl ClientOptions {
    /// Options with a 1 s tick and a 3 s staleness bound.
    pub fn new(service: &str, aggregators: Vec<String>) -> ClientOptions {
        ClientOptions {
            service: service.into(),
            aggregators,
            tick: Duration::from_secs(1),
            stale_after: Duration::from_secs(3),
            client_id: None,
            tls: crate::tls::ClientTls::default(),
            report_token: None,
            max_call_keys: crate::calls::DEFAULT_CLIENT_KEYS,
        }
    }

    /// Sets `report_token` from the environment: `GRL_CLIENT_TOKEN` (the secret) or
    /// `GRL_CLIENT_TOKEN_FILE` (a file holding it, re-read when it changes, so that a rotation
    /// needs no restart). Errors name the variable, never the secret.
    pub fn with_report_token_from_env(
        mut self,
    ) -> Result<ClientOptions, crate::auth::SecretFileError> {
        self.report_token = TokenSource::from_env("GRL_CLIENT_TOKEN")?;
        Ok(self)
    }
}

/// Client health, for metrics and tests.
#[derive(Debug, Default)]
pub struct ClientStats {
    /// Reports answered.
    pub reports_ok: AtomicU64,
    /// Report attempts that failed (each endpoint tried counts).
    pub report_errors: AtomicU64,
    /// Of those, refused for the credential (401 or 403).
    pub reports_refused: AtomicU64,
    /// Offered requests of reports that no aggregator answered in full (a timeout, an answer
    /// cut short): an aggregator may have counted them, so they are not sent again. Counts
    /// of a report no aggregator received, or that one refused, go with the next report.
    pub counts_unconfirmed: AtomicU64,
    /// Times the client moved to another aggregator.
    pub failovers: AtomicU64,
    /// Times the client went from fresh to stale directives (failing open).
    pub fail_open_total: AtomicU64,
    /// Whether directives are stale now.
    pub stale: AtomicBool,
    /// Index of the aggregator in use.
    pub aggregator: AtomicUsize,
    /// When the drop ratios in force were computed (`grl_core::now_ms` clock; 0 = never):
    /// the reply's time less the age the aggregator reported.
    pub directives_from_ms: AtomicU64,
    /// Why the last failed report attempt failed ("server certificate expired on …",
    /// "connection refused", "answered 401 Unauthorized"…); None before any failure.
    pub last_error: std::sync::Mutex<Option<String>>,
}

/// A running client: the limiter to call per request, and its reporter task.
pub struct GrlClient {
    limiter: Arc<Limiter>,
    calls: Arc<CallCounter>,
    stats: Arc<ClientStats>,
    task: JoinHandle<()>,
}

impl GrlClient {
    /// Starts the reporter on the current tokio runtime.
    pub fn start(opts: ClientOptions) -> GrlClient {
        let limiter = Arc::new(Limiter::new(&opts.service, opts.stale_after));
        let stats = Arc::new(ClientStats::default());
        let calls = Arc::new(CallCounter::new(opts.max_call_keys));
        let watch = watch_staleness(
            limiter.clone(),
            stats.clone(),
            opts.service.clone(),
            opts.stale_after,
        );
        let run = run(opts, limiter.clone(), calls.clone(), stats.clone());
        // One task: the watch goes on while a report waits on a slow aggregator.
        let task = tokio::spawn(async move {
            tokio::join!(run, watch);
        });
        GrlClient {
            limiter,
            calls,
            stats,
            task,
        }
    }

    /// The limiter (call `decide` on it per request).
    pub fn limiter(&self) -> &Arc<Limiter> {
        &self.limiter
    }

    /// Every request's (caller, procedure), matched by a bucket or not: call
    /// [`CallCounter::count`] once per request next to `limiter().decide(…)` (`GrlLayer::for_client`
    /// does both). Reported to the aggregators, exported by the controller as `grl_calls_total`.
    pub fn calls(&self) -> &Arc<CallCounter> {
        &self.calls
    }

    /// Counts the request and decides it: what a service that does not use `GrlLayer` calls
    /// per request.
    #[inline]
    pub fn decide(&self, caller: &str, procedure: &str) -> grl_core::Decision {
        self.calls.count(caller, procedure);
        self.limiter.decide(caller, procedure)
    }

    /// Health counters.
    pub fn stats(&self) -> &Arc<ClientStats> {
        &self.stats
    }

    /// The client's metrics as a `prometheus-client` collector, for the embedding service's
    /// own registry:
    ///
    /// ```no_run
    /// # async fn f(client: grl_client::client::GrlClient) {
    /// use grl_client::metrics::prometheus_client::registry::Registry;
    /// let mut registry = Registry::default();
    /// registry.register_collector(Box::new(client.metrics()));
    /// // in the service's `GET /metrics` handler:
    /// let body = grl_client::metrics::encode(&registry);
    /// # }
    /// ```
    ///
    /// Series (label `service`): `grl_client_failing_open` (1 while the drop ratios are
    /// stale and the limiter admits everything), `grl_client_directives_age_seconds`,
    /// `grl_client_fail_open_total`, `grl_client_failovers_total`, `grl_client_reports_total`,
    /// `grl_client_report_errors_total`, `grl_client_reports_refused_total`,
    /// `grl_client_config_info{version}`. Read from counters the reporter task keeps; nothing
    /// is counted per request.
    pub fn metrics(&self) -> ClientMetrics {
        ClientMetrics {
            service: self.limiter.table().service().to_string(),
            stats: self.stats.clone(),
            limiter: self.limiter.clone(),
        }
    }

    /// A registry with `grl_build_info{component="client"}` and [`GrlClient::metrics`], for a
    /// service that serves nothing else on its `/metrics`
    /// (`grl_client::metrics::encode(&registry)` as the body).
    pub fn registry(&self) -> prometheus_client::registry::Registry {
        let mut reg = prometheus_client::registry::Registry::default();
        crate::metrics::register_build_info(&mut reg, "grl", "client");
        reg.register_collector(Box::new(self.metrics()));
        reg
    }

    /// Stops reporting (the limiter fails open once directives go stale).
    pub fn shutdown(self) {
        self.task.abort();
    }
}

impl Drop for GrlClient {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The client's metrics (see [`GrlClient::metrics`]).
#[derive(Clone)]
pub struct ClientMetrics {
    service: String,
    stats: Arc<ClientStats>,
    /// For the version of the buckets in force.
    limiter: Arc<Limiter>,
}

impl std::fmt::Debug for ClientMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientMetrics")
            .field("service", &self.service)
            .finish_non_exhaustive()
    }
}

impl prometheus_client::collector::Collector for ClientMetrics {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> std::fmt::Result {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::counter::ConstCounter;
        use prometheus_client::metrics::gauge::ConstGauge;
        use prometheus_client::metrics::MetricType;
        let labels = [("service", crate::metrics::Label(&self.service))];
        let st = &self.stats;
        let mut fam = encoder.encode_descriptor(
            "grl_client_failing_open",
            "1 while the drop ratios are stale and the limiter admits everything.",
            None,
            MetricType::Gauge,
        )?;
        ConstGauge::new(st.stale.load(Ordering::Relaxed) as i64)
            .encode(fam.encode_family(&labels)?)?;
        // The buckets in force: until a config arrives the client knows no bucket, and its
        // requests count as calls only.
        let table = self.limiter.table();
        if !table.version().is_empty() {
            let mut fam = encoder.encode_descriptor(
                "grl_client_config_info",
                "1 for the version of the bucket config the client decides with (absent until one arrived: requests then match no bucket and count as calls only).",
                None,
                MetricType::Gauge,
            )?;
            let labels = [
                ("service", crate::metrics::Label(&self.service)),
                ("version", crate::metrics::Label(table.version())),
            ];
            ConstGauge::new(1i64).encode(fam.encode_family(&labels)?)?;
        }
        let from = st.directives_from_ms.load(Ordering::Relaxed);
        if from > 0 {
            let mut fam = encoder.encode_descriptor(
                "grl_client_directives_age_seconds",
                "Age of the drop ratios in force (since the controller computed them).",
                None,
                MetricType::Gauge,
            )?;
            let age = now_ms().saturating_sub(from) as f64 / 1000.0;
            ConstGauge::new(age).encode(fam.encode_family(&labels)?)?;
        }
        let counters = [
            (
                "grl_client_fail_open",
                "Times the drop ratios went stale (the limiter started failing open).",
                &st.fail_open_total,
            ),
            (
                "grl_client_failovers",
                "Times the client moved to another aggregator.",
                &st.failovers,
            ),
            ("grl_client_reports", "Reports answered.", &st.reports_ok),
            (
                "grl_client_report_errors",
                "Report attempts that failed (each aggregator tried counts).",
                &st.report_errors,
            ),
            (
                "grl_client_reports_refused",
                "Report attempts refused for the credential (401 or 403).",
                &st.reports_refused,
            ),
            (
                "grl_client_counts_unconfirmed",
                "Offered requests of reports that no aggregator answered in full (a timeout, an answer cut short): an aggregator may have counted them, so they are not sent again.",
                &st.counts_unconfirmed,
            ),
        ];
        for (name, help, v) in counters {
            let mut fam = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            ConstCounter::new(v.load(Ordering::Relaxed)).encode(fam.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

const SUBTICKS: u32 = 4;
/// How often the client loop watches its own rate between reports.
const SUBTICK_EVERY: Duration = Duration::from_millis(10);

async fn run(
    opts: ClientOptions,
    limiter: Arc<Limiter>,
    calls: Arc<CallCounter>,
    stats: Arc<ClientStats>,
) {
    let client_id = client_id(&opts);
    let timeout = opts.tick.max(Duration::from_millis(200));
    let http = match opts.tls.http_client(timeout) {
        Ok(h) => h,
        Err(e) => {
            // Fail-open: a client that cannot reach its aggregators never drops.
            tracing::error!(
                error = format!("{e:#}"),
                "cannot build the http client; limiter stays open"
            );
            return;
        }
    };
    crate::tls::warn_plain_http(
        "aggregator URL",
        opts.aggregators.iter().map(String::as_str),
    );
    let mut rep =
        Reporter::new(limiter.clone(), &client_id, now_ms()).with_calls(&calls, opts.max_call_keys);
    let mut uplink = Uplink {
        opts: &opts,
        http,
        timeout,
        stats: &stats,
        logs: ReportLogs {
            failed: crate::auth::LogGate::new(Duration::from_secs(10)),
            refused: crate::auth::LogGate::new(Duration::from_secs(10)),
        },
        proto: vec![1u32; opts.aggregators.len()],
        current: 0,
    };
    // The loop wakes every few milliseconds to watch the client's own rate (see
    // `Reporter::subtick`) and reports every tick.
    let mut iv = tokio::time::interval((opts.tick / SUBTICKS).min(SUBTICK_EVERY));
    iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let tick_ms = (opts.tick.as_millis() as u64).max(1);
    let mut next_report = now_ms() + tick_ms;
    let mut urgent_sent = false;
    loop {
        iv.tick().await;
        let now = now_ms();
        let urgent = now < next_report;
        if urgent {
            // A jump of our own rate is reported at once (once per tick): the aggregator
            // forwards urgent reports immediately, so the fleet reacts within a sub-tick.
            if !rep.subtick(now) || urgent_sent {
                continue;
            }
        } else {
            next_report = (next_report + tick_ms).max(now + tick_ms / 2);
        }
        urgent_sent = urgent;
        let mut report = rep.build_report(now);
        report.urgent = urgent;
        let (sent, unsure) = uplink.send(&mut rep, &mut report).await;
        if !sent {
            settle_unsent(&mut rep, &mut report, unsure, &stats);
        }
        check_staleness(&limiter, &stats, &opts.service);
    }
}

/// The client's id: the configured one, else the service's name and a random suffix.
fn client_id(opts: &ClientOptions) -> String {
    opts.client_id
        .clone()
        // From the OS's randomness: grl-core's generator starts from the same seed in every
        // process, and instances of a service sharing an id would overwrite each other's
        // counts at their aggregator.
        .unwrap_or_else(|| format!("{}-{:016x}", opts.service, rand::random::<u64>()))
}

/// The aggregators a client reports to, and what it learnt of them.
struct Uplink<'a> {
    opts: &'a ClientOptions,
    http: reqwest::Client,
    timeout: Duration,
    stats: &'a ClientStats,
    logs: ReportLogs,
    /// The protocol version each aggregator announced (1 until it answers).
    proto: Vec<u32>,
    /// The aggregator tried first: the last one that answered.
    current: usize,
}

impl Uplink<'_> {
    /// Sends `report` to the aggregators in turn, from the one that answered last, until one
    /// answers, and applies its reply. Returns whether one answered, and whether one may have
    /// taken the report without answering.
    async fn send(&mut self, rep: &mut Reporter, report: &mut ClientReport) -> (bool, bool) {
        let opts = self.opts;
        let k = opts.aggregators.len();
        // Whether an aggregator may have taken a report it did not answer.
        let mut unsure = false;
        for attempt in 0..k {
            let idx = (self.current + attempt) % k;
            let base = &opts.aggregators[idx];
            attach_calls(self.proto[idx], rep, report);
            if self.proto[idx] < grl_wire::PROTO_TIERS {
                // An older aggregator refuses the field: the totals go without it.
                report.buckets.iter_mut().for_each(|b| b.tiers.clear());
            }
            let token = opts.report_token.as_ref().map(|t| t.current());
            let token = token.as_deref().map(String::as_str);
            // The binary encoding goes only to an aggregator that announced it.
            let binary = self.proto[idx] >= grl_wire::PROTO_BINARY;
            match exchange(&self.http, base, report, token, binary, self.timeout).await {
                Ok((reply, version)) => {
                    self.proto[idx] = version;
                    self.answered_by(idx);
                    self.stats.reports_ok.fetch_add(1, Ordering::Relaxed);
                    self.apply_reply(rep, &reply, base, token).await;
                    return (true, unsure);
                }
                Err(e) => {
                    self.proto[idx] = 1;
                    unsure |= !crate::http_util::CallError::never_applied_any(&e);
                    record_report_error(self.stats, &self.logs, base, &e);
                }
            }
        }
        (false, unsure)
    }

    /// Aggregator `idx` answered: when it is not the current one, the client failed over.
    fn answered_by(&mut self, idx: usize) {
        if idx != self.current {
            self.stats.failovers.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(from = %self.opts.aggregators[self.current], to = %self.opts.aggregators[idx], "client failed over to another aggregator");
            self.current = idx;
            self.stats.aggregator.store(idx, Ordering::Relaxed);
        }
    }

    /// Applies aggregator `base`'s `reply`: the config it announces first, when new, then
    /// its drop ratios.
    async fn apply_reply(
        &self,
        rep: &mut Reporter,
        reply: &ClientDirectives,
        base: &str,
        token: Option<&str>,
    ) {
        if !reply.version.is_empty() && reply.version != rep.version() {
            let to = ConfigSource {
                http: &self.http,
                base,
                token,
                timeout: self.timeout,
            };
            sync_config(&to, &self.opts.service, &reply.version, rep).await;
        }
        let at = now_ms();
        if rep.apply(reply, at) {
            let from = at.saturating_sub(reply.age_ms.unwrap_or(0)).max(1);
            self.stats.directives_from_ms.store(from, Ordering::Relaxed);
        }
    }
}

/// Calls go only to an aggregator that announced protocol 2 (an older one refuses the
/// field); until then they wait, bounded: taken into `report` for one that did, put back
/// for one that did not.
fn attach_calls(proto: u32, rep: &mut Reporter, report: &mut ClientReport) {
    if proto >= 2 {
        if report.calls.is_empty() {
            report.calls = rep.take_calls();
        }
    } else if !report.calls.is_empty() {
        rep.restore_calls(std::mem::take(&mut report.calls));
    }
}

/// Where a client fetches a new config from: the aggregator that announced it.
struct ConfigSource<'a> {
    http: &'a reqwest::Client,
    base: &'a str,
    token: Option<&'a str>,
    timeout: Duration,
}

/// Fetches and installs the config `version` an aggregator announced; an aggregator that has
/// not caught up yet is retried on the next tick.
async fn sync_config(from: &ConfigSource<'_>, service: &str, version: &str, rep: &mut Reporter) {
    match fetch_config(from.http, from.base, service, from.token, from.timeout).await {
        Ok(doc) if doc.version == version => {
            let file = doc.services.iter().find(|f| f.service == service);
            match rep.install(service, file, &doc.version) {
                Ok(()) => {
                    tracing::info!(version = %doc.version, "client installed config")
                }
                Err(e) => tracing::error!(error = %e, "client refused config"),
            }
        }
        Ok(_) => {} // the aggregator has not caught up yet; retry next tick
        Err(e) => {
            tracing::warn!(aggregator = %from.base, error = %e, "config fetch failed")
        }
    }
}

/// The rate limits on the client's report-failure logs.
struct ReportLogs {
    failed: crate::auth::LogGate,
    refused: crate::auth::LogGate,
}

/// Counts a failed report attempt at `base`, logs it (rate-limited; a refused credential
/// apart) and keeps its cause as the last error.
fn record_report_error(stats: &ClientStats, logs: &ReportLogs, base: &str, e: &anyhow::Error) {
    stats.report_errors.fetch_add(1, Ordering::Relaxed);
    let cause = e.to_string();
    let refused = matches!(
        e.downcast_ref::<crate::http_util::CallError>(),
        Some(crate::http_util::CallError::Status { status, .. })
            if *status == 401 || *status == 403
    );
    if refused {
        stats.reports_refused.fetch_add(1, Ordering::Relaxed);
        if logs.refused.open() {
            tracing::warn!(aggregator = %base, error = %cause, "report refused: check the report credential (GRL_CLIENT_TOKEN) (logged at most every 10 s; see grl_client_reports_refused_total)");
        }
    } else if logs.failed.open() {
        tracing::warn!(aggregator = %base, error = %cause, "report failed (logged at most every 10 s; another aggregator is tried, and the client fails open once its directives are stale)");
    }
    *stats.last_error.lock().expect("client stats lock") = Some(cause);
}

/// A report no aggregator answered: its calls wait for the next report, and its counts are
/// sent again unless an aggregator may have taken them (then they count as unconfirmed).
fn settle_unsent(rep: &mut Reporter, report: &mut ClientReport, unsure: bool, stats: &ClientStats) {
    if !report.calls.is_empty() {
        rep.restore_calls(std::mem::take(&mut report.calls));
    }
    if unsure {
        let offered: u64 = report.buckets.iter().map(|b| b.offered).sum();
        stats
            .counts_unconfirmed
            .fetch_add(offered, Ordering::Relaxed);
    } else {
        rep.unsend(report);
    }
}

/// Fails the limiter open once its directives are stale (on the real clock: deciding reads a
/// per-thread clock refreshed every 64 decisions, which at a low request rate lags by far),
/// and keeps `stats.stale` and the fail-open count.
fn check_staleness(limiter: &Limiter, stats: &ClientStats, service: &str) {
    let stale = limiter.expire_stale(now_ms());
    let was = stats.stale.swap(stale, Ordering::Relaxed);
    if stale && !was {
        stats.fail_open_total.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(service = %service, stale_after_ms = limiter.stale_after_ms(), "directives stale: failing open");
    } else if !stale && was {
        tracing::info!(service = %service, "directives fresh again: enforcing");
    }
}

/// How often the client checks its directives' deadline: an eighth of the staleness bound,
/// between 5 and 100 ms. A client fails open at most this long after the bound.
fn staleness_check_every(stale_after: Duration) -> Duration {
    (stale_after / 8).clamp(Duration::from_millis(5), Duration::from_millis(100))
}

/// [`check_staleness`] every [`staleness_check_every`], beside the report loop (which may
/// wait seconds on an aggregator that does not answer).
async fn watch_staleness(
    limiter: Arc<Limiter>,
    stats: Arc<ClientStats>,
    service: String,
    stale_after: Duration,
) {
    let mut iv = tokio::time::interval(staleness_check_every(stale_after));
    iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        iv.tick().await;
        // Before the first fresh directives the table is open anyway (no deadline), and the
        // report loop says so after its first attempt: nothing went stale yet.
        if stats.directives_from_ms.load(Ordering::Relaxed) != 0 {
            check_staleness(&limiter, &stats, &service);
        }
    }
}

/// Posts a report (in the binary encoding when `binary`, else JSON) and reads the reply in
/// the encoding the aggregator answered with; returns it and the aggregator's protocol version.
pub(crate) async fn exchange(
    http: &reqwest::Client,
    base: &str,
    r: &ClientReport,
    token: Option<&str>,
    binary: bool,
    timeout: Duration,
) -> anyhow::Result<(ClientDirectives, u32)> {
    use grl_wire::binary;
    let mut req = http
        .post(format!("{base}/v1/report"))
        .header(grl_wire::PROTO_HEADER, grl_wire::PROTO_VERSION);
    req = if binary {
        req.header(reqwest::header::CONTENT_TYPE, binary::CONTENT_TYPE)
            .body(binary::encode_report(r))
    } else {
        req.json(r)
    };
    if let Some(t) = token.filter(|t| !t.is_empty()) {
        req = req.bearer_auth(t);
    }
    let a = crate::http_util::call(req, timeout, MAX_ANSWER).await?;
    let version = grl_wire::peer_version(&a.headers);
    let reply = if binary::is_binary(a.headers.get(reqwest::header::CONTENT_TYPE)) {
        binary::decode_directives(&a.body)?
    } else {
        a.json()?
    };
    Ok((reply, version))
}

/// The largest answer a client reads from an aggregator (its service's directives or config).
const MAX_ANSWER: usize = 64 << 20;

async fn fetch_config(
    http: &reqwest::Client,
    base: &str,
    service: &str,
    token: Option<&str>,
    timeout: Duration,
) -> anyhow::Result<ConfigDoc> {
    let mut req = http
        .get(format!("{base}/v1/config"))
        .header(grl_wire::PROTO_HEADER, grl_wire::PROTO_VERSION)
        .query(&[("service", service)]);
    if let Some(t) = token.filter(|t| !t.is_empty()) {
        req = req.bearer_auth(t);
    }
    Ok(crate::http_util::call(req, timeout, MAX_ANSWER)
        .await?
        .json()?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use grl_core::Limiter;
    use grl_wire::{DirectiveMsg, TierShedMsg};

    /// A client whose own rate asks for more than the controller's ratio sheds by its own
    /// mix of tiers, but never less on any tier than the controller's split: a `shed_below`
    /// floor stays whole even when the client's own split would spare the tiers below it.
    #[test]
    fn a_client_shedding_more_on_its_own_never_undoes_the_directed_split() {
        let limiter = Arc::new(Limiter::new("payments", Duration::from_secs(3)));
        let mut r = Reporter::new(limiter.clone(), "c1", 0);
        let file: BucketFile = serde_json::from_value(serde_json::json!({
            "service": "payments",
            "buckets": [{"name": "g", "caller": "gw", "limit_rps": 350.0, "mode": "enforce"}]
        }))
        .unwrap();
        r.install("payments", Some(&file), "v1").unwrap();
        // One second of its own traffic: 300 SHEDDABLE_PLUS and 100 CRITICAL requests.
        for (tier, n) in [
            (Criticality::SheddablePlus, 300),
            (Criticality::Critical, 100),
        ] {
            for _ in 0..n {
                limiter.decide_tier_at("gw", "charge", tier, 500);
            }
        }
        r.build_report(1000);
        // The fleet's directive: a ratio of 0.1 with a floor dropping every tier below
        // CRITICAL. This client alone offers 400 rps at a limit of 350 (its own ratio 0.125,
        // whose split over its mix would drop 1/6 of SHEDDABLE_PLUS only).
        let d = ClientDirectives {
            version: "v1".into(),
            age_ms: Some(0),
            directives: vec![DirectiveMsg {
                bucket: "g".into(),
                ratio: 0.1,
                fleet_offered_rps: 4000.0,
                limit_rps: 350.0,
                fixed: false,
                shed: Some(TierShedMsg {
                    threshold: Criticality::Critical,
                    fraction: 0.0,
                }),
            }],
        };
        r.apply(&d, 1000);
        let t = limiter.table();
        let i = t.index_of("g").unwrap();
        assert_eq!(t.tier_ratio(i, Criticality::SheddablePlus), 1.0);
        assert_eq!(t.tier_ratio(i, Criticality::Critical), 0.0);
        // Without the floor, the client's own split: 50 of its 300 SHEDDABLE_PLUS requests.
        let mut open = d.clone();
        open.directives[0].shed = Some(TierShedMsg {
            threshold: Criticality::Sheddable,
            fraction: 0.1,
        });
        r.apply(&open, 1000);
        let p = limiter.table().tier_ratio(i, Criticality::SheddablePlus);
        assert!((p - 50.0 / 300.0).abs() < 1e-6, "{p}");
    }
}
