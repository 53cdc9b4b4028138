//! What an aggregator takes from a client report before summing it, without I/O: only the
//! buckets the config serves for the report's service (unknown names and repeats dropped), each
//! rate cut to what one plausible instance can offer, within per-service budgets of rates and
//! clients held (the services not in the config share one budget of clients: an empty report
//! holds no rate, but its client id is held too). A client holding one service's credential
//! can then move only that service's ratios, and no further than one plausible instance of it
//! could; the zone report carries at most the configured buckets of each service, so one
//! service never pushes another out of it.
//!
//! The plausibility cap of a client's offered rate for a bucket is the largest of
//! - `limit_multiple × limit / clients`: the client's share (one of the service's clients
//!   heard in the zone) of a zone offering `limit_multiple` times the bucket's limit;
//! - `peer_multiple ×` the mean rate of the bucket's other clients at the last forward (the
//!   largest one left out, so a lone liar does not raise its own cap): an instance busier than
//!   its peers, and a fleet-wide surge once one forward has seen it;
//! - [`MIN_CAP_RPS`].
//!
//! Buckets under an incident override (`fixed` directives) are not capped: their ratio is the
//! operator's. An instance that really receives more than its cap still drops its own excess:
//! clients apply at least the ratio their own rate alone asks for
//! ([`grl_client::client::Reporter::apply`]).
//!
//! A report's calls (every request by caller and procedure, what `grl_calls_total` and the
//! quotas learned from it count) are screened alike, as a whole per client
//! (`Known::screen_calls`): a client's total call rate is capped at the largest of
//! - `peer_multiple ×` the mean total call rate of the service's other clients at the last
//!   forward (the largest left out), for any service;
//! - `limit_multiple ×` the sum of the service's bucket limits over its clients, for a service
//!   of the config;
//! - [`Plausibility::instance_rps`]: what a lone instance is trusted up to when nothing else
//!   is known (a new service, learned from its calls before it has a bucket).
//!
//! Calls and bucket counts are counts, summed over reports (the controller's
//! `grl_calls_total` and `grl_requests_*_total`): a client reporting often, or claiming a long
//! interval, must not add more than its caps over the time it really reported, whatever rate
//! each report claims. Each client has an allowance for its calls and one for its counts
//! (`Allowance`, in seconds at its caps): refilled by the time since its previous report on
//! the aggregator's clock, held up to the client's horizon (a new client starts with its
//! interval, at most three ticks), spent by what a report takes at its caps (its calls' total
//! over their cap; for counts, the most of any bucket's counts over that bucket's cap). A
//! report beyond it is cut to its caps over the seconds available: every (caller, procedure)
//! count scaled down alike, and each bucket over it cut (admitted + dropped = offered). The
//! counts of a bucket under an override are held to it too: the ratio is the operator's, the
//! counters stay history. The rates the ratios follow keep the cap per report above. Calls
//! held back by a failed forward are put back as they were taken, never screened again.

use std::collections::HashMap;

use grl_wire::{BucketCountsMsg, CallCountMsg, ClientReport, ConfigDoc, ZoneDirectives};

/// Rates below this are never cut (a request or two in a short interval).
pub const MIN_CAP_RPS: f64 = 10.0;

/// Rates of a report are computed over at least this interval: a client reports at most every
/// few milliseconds (its urgent reports), never faster.
pub const MIN_INTERVAL_MS: u64 = 10;

/// Client ids longer than this are refused (a client's id is `<service>-<16 hex digits>`).
pub const MAX_CLIENT_ID_LEN: usize = 256;

/// The bounds of what one client may claim.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Plausibility {
    /// A zone offers at most this many times a bucket's limit, shared by the service's clients.
    pub limit_multiple: f64,
    /// A client offers at most this many times its peers' mean rate for a bucket.
    pub peer_multiple: f64,
    /// Rate entries (one per client and bucket) held per service between forwards; a report
    /// that would pass it is refused (429).
    pub max_rates_per_service: usize,
    /// Clients held per service (those of services not in the config together); a report of
    /// a client that would pass it is refused (429).
    pub max_clients_per_service: usize,
    /// The total call rate (requests per second, by every caller) one client is trusted up
    /// to whatever else is known; for a lone instance of a service the config has no bucket
    /// for, the cap of its calls.
    pub instance_rps: f64,
}

impl Default for Plausibility {
    /// 10 × the limit over the service's clients, 4 × the peers' mean, 1,000,000 rates per
    /// service (about 90 MB), calls at 5,000 per second per instance.
    fn default() -> Self {
        Plausibility {
            limit_multiple: 10.0,
            peer_multiple: 4.0,
            max_rates_per_service: 1_000_000,
            max_clients_per_service: DEFAULT_MAX_CLIENTS_PER_SERVICE,
            instance_rps: DEFAULT_INSTANCE_RPS,
        }
    }
}

/// The default of [`Plausibility::max_clients_per_service`].
pub const DEFAULT_MAX_CLIENTS_PER_SERVICE: usize = 100_000;

/// The default of [`Plausibility::instance_rps`].
pub const DEFAULT_INSTANCE_RPS: f64 = 5_000.0;

/// Services whose calls an aggregator holds between forwards: the calls of more services
/// (possible only with a `*` client credential, or the credentials of many services) are
/// dropped until the next forward. Also the services not in the config whose calls' peer caps
/// are held.
pub(crate) const MAX_CALL_SERVICES: usize = 1024;

/// The rates of one bucket's (or one service's) clients at a forward, for a peer cap.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct PeerRates {
    sum: f64,
    n: u32,
    max: f64,
}

impl PeerRates {
    /// Counts one client's rate.
    pub(crate) fn add(&mut self, rate: f64) {
        self.sum += rate;
        self.n += 1;
        self.max = self.max.max(rate);
    }

    /// `multiple ×` the mean of the rates but the largest (0 with fewer than two): a lone
    /// liar does not raise its own cap.
    fn cap(&self, multiple: f64) -> f64 {
        if self.n < 2 {
            return 0.0;
        }
        multiple * (self.sum - self.max).max(0.0) / (self.n - 1) as f64
    }
}

/// A service's clients at a forward.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ServiceClients {
    /// Clients heard within the horizon.
    pub(crate) clients: usize,
    /// Their rate entries.
    pub(crate) entries: usize,
    /// The total call rates of those whose last report carried calls.
    pub(crate) calls: PeerRates,
}

/// The time a client's report had on the aggregator's clock.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Elapsed {
    /// Since its previous report; for a client new to the aggregator, its interval, at most
    /// three ticks.
    pub(crate) since_ms: u64,
    /// How long an allowance is held: the client's horizon; for a new client, three ticks.
    pub(crate) horizon_ms: u64,
    /// The client is new to the aggregator (it counts among its service's clients from now).
    pub(crate) new_client: bool,
}

/// What a client may still report of counts summed over reports (its calls, its buckets'
/// counts), in seconds at its cap: refilled by the time elapsed on the aggregator's clock,
/// held up to its horizon. A client reporting often, or claiming a long interval, gets no
/// more than its cap over the time it really reported.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Allowance {
    secs: f64,
}

impl Allowance {
    /// Refills it by `e.since_ms`, held up to `e.horizon_ms`; the seconds available.
    fn refill(&mut self, e: Elapsed) -> f64 {
        self.secs = (self.secs + e.since_ms as f64 / 1000.0).min(e.horizon_ms as f64 / 1000.0);
        self.secs
    }

    /// Takes `secs` of it (none below 0).
    fn spend(&mut self, secs: f64) {
        self.secs = (self.secs - secs).max(0.0);
    }
}

/// One client's calls as the screen follows them.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct ClientCalls {
    /// What it may still report.
    pub(crate) allowance: Allowance,
    /// Its total call rate in its last report, when that carried calls (at most its cap).
    pub(crate) rate: Option<f64>,
}

/// A bucket of the config served.
#[derive(Debug, Clone, Default)]
struct KnownBucket {
    /// The configured limit.
    limit_rps: f64,
    /// The effective limit of the last directive (an override's; 0: none).
    directive_limit: f64,
    /// `peer_multiple ×` the mean rate of the bucket's other clients at the last forward.
    peer_cap: f64,
    /// Under an incident override: not capped.
    fixed: bool,
    /// The report that last carried the bucket (a repeat in one report is dropped).
    seen: u64,
}

/// A service of the config served.
#[derive(Debug, Clone, Default)]
pub(crate) struct KnownService {
    buckets: HashMap<String, KnownBucket>,
    /// The service's clients heard within the horizon at the last forward (at least 1).
    clients: usize,
    /// Rate entries held for its clients.
    entries: usize,
    /// Its clients held: at the last forward, and those new since.
    held: usize,
    /// The sum of its buckets' limits (each the higher of the configured one and an
    /// override's).
    limit_sum: f64,
    /// `peer_multiple ×` the mean total call rate of its other clients at the last forward.
    calls_peer_cap: f64,
}

/// Why entries of a client report were dropped or cut: the `reason` label of
/// `grl_report_entries_refused_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EntryRefusal {
    /// A bucket the config does not serve for the report's service: dropped.
    UnknownBucket,
    /// A bucket named twice in one report: the repeat dropped.
    Duplicate,
    /// An offered rate above the plausibility cap: the bucket's counts cut to it.
    RateCapped,
    /// An interval below [`MIN_INTERVAL_MS`]: the report's rates computed over that instead.
    ShortInterval,
    /// A (caller, procedure) call count of a report whose calls were more than the client's
    /// allowance: scaled down with the report's other calls.
    CallsCapped,
    /// A bucket whose counts were more than the client's allowance: cut to it.
    CountsCapped,
}

impl EntryRefusal {
    /// The label value.
    pub fn reason(self) -> &'static str {
        match self {
            EntryRefusal::UnknownBucket => "unknown_bucket",
            EntryRefusal::Duplicate => "duplicate",
            EntryRefusal::RateCapped => "rate_capped",
            EntryRefusal::ShortInterval => "short_interval",
            EntryRefusal::CallsCapped => "calls_capped",
            EntryRefusal::CountsCapped => "counts_capped",
        }
    }
}

/// What `Known::screen` did to a report: entries dropped or cut, by reason.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Screened {
    /// Entries per reason (zero reasons left out).
    pub refused: Vec<(EntryRefusal, u64)>,
    /// Whether the report's service is in the config.
    pub known_service: bool,
    /// The time the counts kept take at their buckets' caps (s): the most of any bucket.
    pub(crate) counts_secs: f64,
}

impl Screened {
    /// Counts `n` entries dropped or cut for `why` (nothing for 0).
    pub fn add(&mut self, why: EntryRefusal, n: u64) {
        if n > 0 {
            self.refused.push((why, n));
        }
    }
}

/// The config's buckets by service, with the state the caps need.
#[derive(Debug, Default)]
pub(crate) struct Known {
    pub(crate) services: HashMap<String, KnownService>,
    reports: u64,
    /// The calls' peer caps of services not in the config, at the last forward (at most
    /// [`MAX_CALL_SERVICES`]).
    other_calls: HashMap<String, f64>,
    /// The clients held of services not in the config, all together: at the last forward,
    /// and those new since.
    other_clients: usize,
}

/// The budget a report would pass: it is refused (429) and changes nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OverBudget {
    /// The rates of its service ([`Plausibility::max_rates_per_service`]).
    Rates,
    /// The clients of its service ([`Plausibility::max_clients_per_service`]).
    Clients,
    /// The clients of the services not in the config, together.
    OtherClients,
}

impl OverBudget {
    /// What is over budget, for the log.
    pub(crate) fn what(self) -> &'static str {
        match self {
            OverBudget::Rates => "rates",
            OverBudget::Clients => "clients",
            OverBudget::OtherClients => "clients of services not in the config",
        }
    }

    /// The answer to a report of `service`.
    pub(crate) fn message(self, service: &str, p: &Plausibility) -> String {
        match self {
            OverBudget::Rates => format!(
                "service `{service}` holds {} rates in this zone, its budget; retry later",
                p.max_rates_per_service
            ),
            OverBudget::Clients => format!(
                "service `{service}` holds {} clients in this zone, its budget; retry later",
                p.max_clients_per_service
            ),
            OverBudget::OtherClients => format!(
                "services not in the config (`{service}` among them) hold {} clients in this zone, their budget; retry later",
                p.max_clients_per_service
            ),
        }
    }
}

impl Known {
    /// The buckets of `doc`, keeping the client counts and peer caps of `self` for the services
    /// and buckets that remain.
    pub(crate) fn rebuild(&mut self, doc: &ConfigDoc) {
        let mut services = HashMap::with_capacity(doc.services.len());
        for f in &doc.services {
            let old = self.services.remove(&f.service);
            let mut s = KnownService {
                buckets: HashMap::with_capacity(f.buckets.len()),
                clients: old.as_ref().map_or(1, |o| o.clients),
                entries: old.as_ref().map_or(0, |o| o.entries),
                held: old.as_ref().map_or(0, |o| o.held),
                limit_sum: 0.0,
                calls_peer_cap: old.as_ref().map_or(0.0, |o| o.calls_peer_cap),
            };
            for b in &f.buckets {
                let prev = old.as_ref().and_then(|o| o.buckets.get(&b.name));
                s.buckets.insert(
                    b.name.clone(),
                    KnownBucket {
                        limit_rps: b.limit_rps,
                        directive_limit: prev.map_or(0.0, |p| p.directive_limit),
                        peer_cap: prev.map_or(0.0, |p| p.peer_cap),
                        fixed: prev.is_some_and(|p| p.fixed),
                        seen: 0,
                    },
                );
            }
            s.sum_limits();
            // A service new to the config keeps the calls' peer cap it had as an unknown one.
            if old.is_none() {
                s.calls_peer_cap = self.other_calls.remove(&f.service).unwrap_or(0.0);
            }
            services.insert(f.service.clone(), s);
        }
        // The clients of services that left the config count with the others' until the
        // next forward recounts them.
        self.other_clients += self.services.values().map(|s| s.held).sum::<usize>();
        self.services = services;
    }

    /// Counts a report of `service` against its budgets, its client holding `held` rates
    /// (None: a client new to the aggregator) and the report carrying `rates`: a new client
    /// takes one of the service's clients (the services not in the config share one
    /// budget), and the client's rates replace those it held. Over a budget, nothing is
    /// counted.
    pub(crate) fn admit(
        &mut self,
        service: &str,
        held: Option<usize>,
        rates: usize,
        p: &Plausibility,
    ) -> Result<(), OverBudget> {
        let (clients, over, entries) = match self.services.get_mut(service) {
            Some(s) => (&mut s.held, OverBudget::Clients, Some(&mut s.entries)),
            None => (&mut self.other_clients, OverBudget::OtherClients, None),
        };
        if held.is_none() && *clients >= p.max_clients_per_service {
            return Err(over);
        }
        if let Some(e) = entries {
            let held = held.unwrap_or(0);
            let n = *e - held.min(*e) + rates;
            if rates > held && n > p.max_rates_per_service {
                return Err(OverBudget::Rates);
            }
            *e = n;
        }
        *clients += held.is_none() as usize;
        Ok(())
    }

    /// Follows a controller's answer (before it is merged into the directives held): a bucket
    /// under an override (`fixed`) is not capped, and the cap follows an overridden limit higher
    /// than the configured one. A delta answer names only the directives that changed.
    pub(crate) fn follow(&mut self, d: &ZoneDirectives) {
        if !d.session.is_some_and(|s| s.delta) {
            for s in self.services.values_mut() {
                for b in s.buckets.values_mut() {
                    (b.fixed, b.directive_limit) = (false, 0.0);
                }
            }
        }
        for sd in &d.services {
            let Some(s) = self.services.get_mut(&sd.service) else {
                continue;
            };
            for m in &sd.directives {
                if let Some(k) = s.buckets.get_mut(&m.bucket) {
                    k.fixed = m.fixed;
                    k.directive_limit = if m.limit_rps.is_finite() {
                        m.limit_rps
                    } else {
                        0.0
                    };
                }
            }
        }
        for s in self.services.values_mut() {
            s.sum_limits();
        }
    }

    /// Keeps in `r` only the buckets the config serves for its service, each once, with rates
    /// (over at least [`MIN_INTERVAL_MS`]) cut to the plausibility cap; sets `r.interval_ms` to
    /// the interval the rates are computed over. `new_client`: the report's client was not
    /// heard from within the horizon (it counts among the service's clients from now).
    pub(crate) fn screen(
        &mut self,
        r: &mut ClientReport,
        new_client: bool,
        p: &Plausibility,
    ) -> Screened {
        let mut out = Screened::default();
        if r.interval_ms < MIN_INTERVAL_MS {
            out.add(EntryRefusal::ShortInterval, r.buckets.len() as u64);
            r.interval_ms = MIN_INTERVAL_MS;
        }
        let Some(s) = self.services.get_mut(&r.service) else {
            out.add(EntryRefusal::UnknownBucket, r.buckets.len() as u64);
            r.buckets.clear();
            return out;
        };
        out.known_service = true;
        self.reports += 1;
        let this = self.reports;
        let share = s.share(new_client, p);
        let secs = r.interval_ms as f64 / 1000.0;
        let (mut unknown, mut repeated, mut capped, mut need) = (0, 0, 0, 0.0f64);
        r.buckets.retain_mut(|b| {
            let Some(k) = s.buckets.get_mut(b.bucket.as_str()) else {
                unknown += 1;
                return false;
            };
            if k.seen == this {
                repeated += 1;
                return false;
            }
            k.seen = this;
            let cap = k.cap(share);
            if !k.fixed && b.offered as f64 / secs > cap {
                cut(b, (cap * secs).floor() as u64);
                capped += 1;
            }
            need = need.max(b.offered as f64 / cap);
            true
        });
        out.add(EntryRefusal::UnknownBucket, unknown);
        out.add(EntryRefusal::Duplicate, repeated);
        out.add(EntryRefusal::RateCapped, capped);
        out.counts_secs = need;
        out
    }

    /// Cuts the counts of a report of `service` (its `buckets`, screened by [`Self::screen`]
    /// first, which found that they take `s.counts_secs` at their caps) to what its client
    /// may report, and follows the client's allowance `a` (see [`Allowance`]): each bucket
    /// gets its cap over the seconds available (under an override too: counts are the
    /// counters' history, not the ratio). A bucket over it is cut alike (admitted + dropped =
    /// offered). Returns the buckets cut. Nothing allocated; each bucket looked up again only
    /// when some are cut.
    pub(crate) fn screen_counts(
        &self,
        service: &str,
        buckets: &mut [BucketCountsMsg],
        a: &mut Allowance,
        e: Elapsed,
        s: &Screened,
        p: &Plausibility,
    ) -> u64 {
        let available = a.refill(e);
        let need = s.counts_secs;
        if need <= available {
            a.spend(need);
            return 0;
        }
        a.spend(available);
        let Some(svc) = self.services.get(service) else {
            return 0;
        };
        let share = svc.share(e.new_client, p);
        let mut capped = 0;
        for b in buckets {
            if let Some(k) = svc.buckets.get(b.bucket.as_str()) {
                let allowed = (k.cap(share) * available).floor();
                if b.offered as f64 > allowed {
                    cut(b, allowed as u64);
                    capped += 1;
                }
            }
        }
        capped
    }

    /// The cap of one client's total call rate for `service` (see the module doc).
    fn calls_cap(&self, service: &str, new_client: bool, p: &Plausibility) -> f64 {
        let known = match self.services.get(service) {
            Some(s) => (s.limit_sum * s.share(new_client, p)).max(s.calls_peer_cap),
            None => self.other_calls.get(service).copied().unwrap_or(0.0),
        };
        known.max(p.instance_rps)
    }

    /// Cuts the calls of `r` (screened by [`Self::screen`] first: its interval is at least
    /// [`MIN_INTERVAL_MS`]) to what its client may report, and follows the client in `c`: its
    /// allowance (see [`Allowance`]) at its calls' cap. A report over it has every count
    /// scaled down alike (rounded down, none raised). Returns the counts cut. Nothing
    /// allocated.
    pub(crate) fn screen_calls(
        &self,
        r: &mut ClientReport,
        c: &mut ClientCalls,
        e: Elapsed,
        p: &Plausibility,
    ) -> u64 {
        let cap = self.calls_cap(&r.service, e.new_client, p);
        let left = cap * c.allowance.refill(e);
        let total: u128 = r.calls.iter().map(|x| x.count as u128).sum();
        let (accepted, cut) = if total as f64 > left {
            cut_calls(&mut r.calls, left.floor() as u128, total)
        } else {
            (total, 0)
        };
        c.allowance.spend(accepted as f64 / cap);
        c.rate = (!r.calls.is_empty()).then(|| {
            let secs = r.interval_ms.max(e.since_ms).max(MIN_INTERVAL_MS) as f64 / 1000.0;
            (accepted as f64 / secs).min(cap)
        });
        cut
    }

    /// At a forward: the services' clients heard within the horizon, their rate entries and
    /// the calls' peer caps, and each bucket's peer cap from its clients' offered rates.
    pub(crate) fn forwarded<'a>(
        &mut self,
        clients: impl IntoIterator<Item = (&'a str, ServiceClients)>,
        offered: &HashMap<(String, String), PeerRates>,
        p: &Plausibility,
    ) {
        for s in self.services.values_mut() {
            s.clients = 1;
            s.entries = 0;
            s.held = 0;
            s.calls_peer_cap = 0.0;
            for b in s.buckets.values_mut() {
                b.peer_cap = 0.0;
            }
        }
        self.other_calls.clear();
        self.other_clients = 0;
        for (service, c) in clients {
            match self.services.get_mut(service) {
                Some(s) => {
                    s.clients = c.clients.max(1);
                    s.held = c.clients;
                    s.entries = c.entries;
                    s.calls_peer_cap = c.calls.cap(p.peer_multiple);
                }
                None => {
                    self.other_clients += c.clients;
                    if c.calls.n >= 2 && self.other_calls.len() < MAX_CALL_SERVICES {
                        self.other_calls
                            .insert(service.to_string(), c.calls.cap(p.peer_multiple));
                    }
                }
            }
        }
        for ((service, bucket), rates) in offered {
            if let Some(b) = self
                .services
                .get_mut(service)
                .and_then(|s| s.buckets.get_mut(bucket))
            {
                b.peer_cap = rates.cap(p.peer_multiple);
            }
        }
    }
}

impl KnownBucket {
    /// The plausibility cap of one client's offered rate, `share` its share of the limit.
    fn cap(&self, share: f64) -> f64 {
        let limit = self.limit_rps.max(self.directive_limit);
        (limit * share).max(self.peer_cap).max(MIN_CAP_RPS)
    }
}

impl KnownService {
    /// One client's share of `limit_multiple ×` a limit: over the service's clients, and the
    /// report's client when it is new.
    fn share(&self, new_client: bool, p: &Plausibility) -> f64 {
        p.limit_multiple / (self.clients.max(1) + new_client as usize) as f64
    }

    fn sum_limits(&mut self) {
        self.limit_sum = self
            .buckets
            .values()
            .map(|b| b.limit_rps.max(b.directive_limit))
            .filter(|l| l.is_finite())
            .sum();
    }
}

/// Scales every count of `calls` (summing to `total`) down to `allowed` in all, rounded down.
/// Returns the calls left and the counts changed.
fn cut_calls(calls: &mut [CallCountMsg], allowed: u128, total: u128) -> (u128, u64) {
    let (mut accepted, mut cut) = (0u128, 0u64);
    for c in calls {
        let n = (c.count as u128 * allowed / total.max(1)) as u64;
        if n < c.count {
            cut += 1;
        }
        c.count = n.min(c.count);
        accepted += c.count as u128;
    }
    (accepted, cut)
}

/// Cuts `b`'s counts to `offered` requests, keeping admitted + dropped = offered and the shares
/// of each. Its tier counts are cut in proportion (rounded down); when they no longer fit the
/// whole, they go (the requests are counted untiered).
fn cut(b: &mut BucketCountsMsg, offered: u64) {
    let f = offered as f64 / b.offered as f64;
    let admitted = ((b.admitted as f64 * f).round() as u64).min(offered);
    let shadow = ((b.shadow_dropped as f64 * f).round() as u64).min(admitted);
    b.offered = offered;
    b.admitted = admitted;
    b.dropped = offered - admitted;
    b.shadow_dropped = shadow;
    for t in &mut b.tiers {
        for n in [
            &mut t.offered,
            &mut t.admitted,
            &mut t.dropped,
            &mut t.shadow_dropped,
        ] {
            *n = (*n as f64 * f) as u64;
        }
    }
    if !b.tiers_believed() {
        b.tiers.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> ConfigDoc {
        serde_json::from_value(serde_json::json!({"version": "v1", "services": [
            {"service": "pay", "buckets": [
                {"name": "a", "caller": "a", "scope": "global", "limit_rps": 100.0,
                 "mode": "enforce", "policy": "peak"},
                {"name": "b", "caller": "b", "scope": "global", "limit_rps": 100.0,
                 "mode": "enforce", "policy": "peak"}]}]}))
        .unwrap()
    }

    fn report(service: &str, interval_ms: u64, buckets: &[(&str, u64)]) -> ClientReport {
        ClientReport {
            client_id: "c".into(),
            service: service.into(),
            version: "v1".into(),
            interval_ms,
            buckets: buckets
                .iter()
                .map(|&(b, n)| BucketCountsMsg {
                    bucket: b.into(),
                    offered: n,
                    admitted: n / 2,
                    dropped: n - n / 2,
                    shadow_dropped: n / 4,
                    tiers: Vec::new(),
                })
                .collect(),
            urgent: false,
            calls: Vec::new(),
        }
    }

    fn reasons(s: &Screened) -> Vec<(&'static str, u64)> {
        s.refused.iter().map(|(r, n)| (r.reason(), *n)).collect()
    }

    #[test]
    fn unknown_repeated_and_implausible_entries() {
        let mut k = Known::default();
        k.rebuild(&config());
        let p = Plausibility::default();
        // Another service's name, an invented one and a repeat are dropped; a plausible rate
        // stays as it is.
        let mut r = report("pay", 1000, &[("a", 50), ("x", 5), ("a", 50), ("b", 900)]);
        let s = k.screen(&mut r, false, &p);
        assert_eq!(reasons(&s), [("unknown_bucket", 1), ("duplicate", 1)]);
        assert_eq!(r.buckets.len(), 2);
        assert_eq!(r.buckets[0].offered, 50);
        // One client: 10 × 100 rps is its cap.
        let mut r = report("pay", 1000, &[("a", 5000)]);
        let s = k.screen(&mut r, false, &p);
        assert_eq!(reasons(&s), [("rate_capped", 1)]);
        let b = &r.buckets[0];
        assert_eq!(b.offered, 1000);
        assert_eq!(b.admitted + b.dropped, b.offered);
        assert!(b.shadow_dropped <= b.admitted);
        // A millisecond interval counts as ten.
        let mut r = report("pay", 1, &[("a", 5)]);
        let s = k.screen(&mut r, false, &p);
        assert_eq!(reasons(&s), [("short_interval", 1)]);
        assert_eq!(r.interval_ms, MIN_INTERVAL_MS);
        // A service the config does not have: everything dropped.
        let mut r = report("maps", 1000, &[("a", 5)]);
        let s = k.screen(&mut r, false, &p);
        assert!(!s.known_service);
        assert_eq!(reasons(&s), [("unknown_bucket", 1)]);
        assert!(r.buckets.is_empty());
    }

    #[test]
    fn caps_follow_clients_peers_and_overrides() {
        let mut k = Known::default();
        k.rebuild(&config());
        let p = Plausibility::default();
        // Four clients: the share is 10 × 100 / 4 = 250 rps; peers at 100 rps (the largest,
        // 5000, left out) allow 400.
        let mut rates = PeerRates::default();
        for r in [100.0, 100.0, 5000.0, 100.0] {
            rates.add(r);
        }
        let offered = HashMap::from([(("pay".to_string(), "a".to_string()), rates)]);
        let clients = ServiceClients {
            clients: 4,
            entries: 8,
            calls: PeerRates::default(),
        };
        k.forwarded([("pay", clients)], &offered, &p);
        let mut r = report("pay", 1000, &[("a", 5000), ("b", 5000)]);
        k.screen(&mut r, false, &p);
        assert_eq!(r.buckets[0].offered, 400);
        assert_eq!(r.buckets[1].offered, 250);
        // Under an override: as reported.
        let d: ZoneDirectives = serde_json::from_value(serde_json::json!({"version": "v1",
            "services": [{"service": "pay", "directives": [{"bucket": "b", "ratio": 0.5,
            "fleet_offered_rps": 1.0, "limit_rps": 1.0, "fixed": true}]}]}))
        .unwrap();
        k.follow(&d);
        let mut r = report("pay", 1000, &[("b", 5000)]);
        k.screen(&mut r, false, &p);
        assert_eq!(r.buckets[0].offered, 5000);
    }

    /// Screens `r` as the aggregator does: its rates, then its counts against `a` over `e`;
    /// the buckets whose counts were cut.
    fn screen_both(
        k: &mut Known,
        r: &mut ClientReport,
        a: &mut Allowance,
        e: Elapsed,
        p: &Plausibility,
    ) -> u64 {
        let s = k.screen(r, e.new_client, p);
        k.screen_counts(&r.service, &mut r.buckets, a, e, &s, p)
    }

    fn offered(r: &ClientReport) -> Vec<u64> {
        r.buckets.iter().map(|b| b.offered).collect()
    }

    #[test]
    fn counts_are_held_to_the_time_really_reported() {
        let mut k = Known::default();
        k.rebuild(&config());
        let p = Plausibility::default();
        // One client heard: its cap is 10 × 100 rps; a new one's, 10 × 100 / 2. A new client
        // claiming an hour at its cap gets its cap over three ticks (300 ms), every bucket
        // cut alike.
        let mut a = Allowance::default();
        let mut r = report("pay", 3_600_000, &[("a", 500 * 3600), ("b", 100 * 3600)]);
        // Bucket a's claim by tier: a quarter SHEDDABLE (its drops), the rest CRITICAL.
        let n = 500 * 3600;
        r.buckets[0].tiers = vec![
            grl_wire::TierCountsMsg {
                tier: schema::Criticality::Sheddable,
                offered: n / 2,
                admitted: 0,
                dropped: n / 2,
                shadow_dropped: 0,
            },
            grl_wire::TierCountsMsg {
                tier: schema::Criticality::Critical,
                offered: n / 2,
                admitted: n / 2,
                dropped: 0,
                shadow_dropped: n / 4,
            },
        ];
        assert!(r.buckets[0].tiers_believed());
        assert_eq!(screen_both(&mut k, &mut r, &mut a, first(300, 300), &p), 2);
        assert_eq!(offered(&r), [150, 150]);
        for b in &r.buckets {
            assert_eq!(b.admitted + b.dropped, b.offered);
            assert!(b.shadow_dropped <= b.admitted);
        }
        // Its tiers are cut in proportion and still fit the cut whole.
        let t = &r.buckets[0].tiers;
        assert_eq!(t.iter().map(|t| t.offered).collect::<Vec<_>>(), [75, 75]);
        assert!(r.buckets[0].tiers_believed());
        // Reporting every 10 ms, a second's counts at its cap each time: one second's in all.
        let mut got = 0;
        for _ in 0..100 {
            let mut r = report("pay", 1000, &[("a", 1000)]);
            screen_both(&mut k, &mut r, &mut a, el(10, 3000), &p);
            got += r.buckets[0].offered;
        }
        assert!((900..=1000).contains(&got), "{got} requests in one second");
        // Honest reports pass as they are: at a third of the cap, even arriving 500 ms after
        // a report covering a second (what it left unused carries over).
        for since_ms in [1000, 1000, 500, 1500, 500] {
            let mut r = report("pay", 1000, &[("a", 300), ("b", 100)]);
            assert_eq!(
                screen_both(&mut k, &mut r, &mut a, el(since_ms, 3000), &p),
                0
            );
            assert_eq!(offered(&r), [300, 100]);
        }
        // Held up to the horizon: after a minute of silence, 3 s at the cap.
        let mut r = report("pay", 3_600_000, &[("a", 1000 * 3600)]);
        screen_both(&mut k, &mut r, &mut a, el(60_000, 3000), &p);
        assert_eq!(offered(&r), [3000]);
        // Under an override the rate is not cut, the counts are.
        let d: ZoneDirectives = serde_json::from_value(serde_json::json!({"version": "v1",
            "services": [{"service": "pay", "directives": [{"bucket": "b", "ratio": 0.5,
            "fleet_offered_rps": 1.0, "limit_rps": 1.0, "fixed": true}]}]}))
        .unwrap();
        k.follow(&d);
        let mut r = report("pay", 1000, &[("b", 1_000_000)]);
        let s = k.screen(&mut r, false, &p);
        assert_eq!(
            offered(&r),
            [1_000_000],
            "a fixed bucket's rate as reported"
        );
        let cut = k.screen_counts("pay", &mut r.buckets, &mut a, el(1000, 3000), &s, &p);
        assert_eq!((cut, offered(&r)), (1, vec![1000]));
    }

    #[test]
    fn budgets_of_clients_and_rates() {
        let mut k = Known::default();
        k.rebuild(&config());
        let p = Plausibility {
            max_clients_per_service: 2,
            max_rates_per_service: 3,
            ..Default::default()
        };
        // Two new clients of pay, one with two rates, one with none; a third is refused.
        assert_eq!(k.admit("pay", None, 2, &p), Ok(()));
        assert_eq!(k.admit("pay", None, 0, &p), Ok(()));
        assert_eq!(k.admit("pay", None, 0, &p), Err(OverBudget::Clients));
        // A held client: its rates replace those it held, within the service's budget.
        assert_eq!(k.admit("pay", Some(0), 2, &p), Err(OverBudget::Rates));
        assert_eq!(k.admit("pay", Some(0), 1, &p), Ok(()));
        assert_eq!(k.admit("pay", Some(2), 1, &p), Ok(()));
        assert_eq!(k.services["pay"].entries, 2);
        // Services not in the config share one budget of clients.
        assert_eq!(k.admit("maps", None, 0, &p), Ok(()));
        assert_eq!(k.admit("geo", None, 0, &p), Ok(()));
        assert_eq!(k.admit("web", None, 0, &p), Err(OverBudget::OtherClients));
        assert_eq!(k.admit("maps", Some(0), 0, &p), Ok(()), "a held client");
        // A forward recounts the clients held.
        let one = ServiceClients {
            clients: 1,
            entries: 1,
            calls: PeerRates::default(),
        };
        k.forwarded([("pay", one), ("maps", one)], &HashMap::new(), &p);
        assert_eq!(k.admit("pay", None, 0, &p), Ok(()));
        assert_eq!(k.admit("pay", None, 0, &p), Err(OverBudget::Clients));
        assert_eq!(k.admit("web", None, 0, &p), Ok(()));
        assert_eq!(k.admit("geo", None, 0, &p), Err(OverBudget::OtherClients));
        // A service leaving the config takes its clients to the others' budget.
        let mut doc = config();
        doc.services[0].service = "orders".into();
        k.rebuild(&doc);
        assert_eq!(k.other_clients, 4);
    }

    fn with_calls(service: &str, interval_ms: u64, calls: &[(&str, u64)]) -> ClientReport {
        let mut r = report(service, interval_ms, &[]);
        r.calls = calls
            .iter()
            .map(|&(caller, count)| CallCountMsg {
                caller: caller.into(),
                procedure: "charge".into(),
                count,
            })
            .collect();
        r
    }

    fn el(since_ms: u64, horizon_ms: u64) -> Elapsed {
        Elapsed {
            since_ms,
            horizon_ms,
            new_client: false,
        }
    }

    /// A new client's first report.
    fn first(since_ms: u64, horizon_ms: u64) -> Elapsed {
        Elapsed {
            new_client: true,
            ..el(since_ms, horizon_ms)
        }
    }

    fn counts(r: &ClientReport) -> Vec<u64> {
        r.calls.iter().map(|c| c.count).collect()
    }

    /// The calls at a forward: `rates` are the clients' total call rates of `service`.
    fn forward_calls(k: &mut Known, service: &str, rates: &[f64], p: &Plausibility) {
        let mut calls = PeerRates::default();
        for &r in rates {
            calls.add(r);
        }
        let c = ServiceClients {
            clients: rates.len(),
            entries: 0,
            calls,
        };
        k.forwarded([(service, c)], &HashMap::new(), p);
    }

    #[test]
    fn calls_are_cut_alike_to_the_largest_cap() {
        let mut k = Known::default();
        k.rebuild(&config());
        let p = Plausibility {
            instance_rps: 50.0,
            ..Default::default()
        };
        // Four clients of pay at 150 calls/s and one claiming 10,000 (left out of its peers'
        // mean): the cap is 4 × 150 (above 10 × the 200 rps of limits over the 5 clients).
        forward_calls(&mut k, "pay", &[150.0, 150.0, 10_000.0, 150.0, 150.0], &p);
        let mut c = ClientCalls::default();
        let mut r = with_calls("pay", 1000, &[("a", 100), ("b", 50)]);
        assert_eq!(k.screen_calls(&mut r, &mut c, el(1000, 3000), &p), 0);
        assert_eq!(counts(&r), [100, 50], "an honest report passes as it is");
        assert_eq!(c.rate, Some(150.0));
        assert_eq!(
            c.allowance.secs,
            1.0 - 150.0 / 600.0,
            "seconds at its cap left"
        );
        // One second later: 450 + 600 left; 3,000 claimed are scaled down to 1,050, rounded
        // down, each count alike.
        let mut r = with_calls("pay", 1000, &[("a", 2000), ("b", 1000)]);
        assert_eq!(k.screen_calls(&mut r, &mut c, el(1000, 3000), &p), 2);
        assert_eq!(counts(&r), [700, 350]);
        assert_eq!(
            c.rate,
            Some(600.0),
            "the rate its peers see is at most its cap"
        );
        // Reporting every 10 ms with a one-hour interval does not add more: 6 calls per 10 ms.
        let mut got = 0;
        for _ in 0..100 {
            let mut r = with_calls("pay", 3_600_000, &[("a", 1 << 40)]);
            k.screen_calls(&mut r, &mut c, el(10, 3000), &p);
            got += r.calls[0].count;
        }
        assert!((599..=600).contains(&got), "{got} calls in one second");
        // The allowance is held up to the cap over the client's horizon: after a minute of
        // silence, 3 s of calls.
        let mut r = with_calls("pay", 1000, &[("a", 1 << 40)]);
        k.screen_calls(&mut r, &mut c, el(60_000, 3000), &p);
        assert!(
            (1799..=1800).contains(&r.calls[0].count),
            "{:?}",
            counts(&r)
        );
        // The limits, with few clients: 10 × 200 rps over 2 clients (and a new one).
        forward_calls(&mut k, "pay", &[10.0, 10.0], &p);
        let mut c = ClientCalls::default();
        let mut r = with_calls("pay", 1000, &[("a", 5000)]);
        k.screen_calls(&mut r, &mut c, first(1000, 3000), &p);
        assert_eq!(counts(&r), [666]);
        // Counts near u64::MAX neither overflow nor wrap (the cap: 10 × 200 over 2 clients).
        let mut c = ClientCalls::default();
        let mut r = with_calls("pay", 1000, &[("a", u64::MAX), ("b", u64::MAX), ("c", 0)]);
        assert_eq!(k.screen_calls(&mut r, &mut c, el(1000, 3000), &p), 2);
        assert_eq!(counts(&r), [500, 500, 0]);
    }

    #[test]
    fn calls_of_a_service_not_in_the_config_are_kept_within_the_floor_or_peers() {
        let mut k = Known::default();
        k.rebuild(&config());
        let p = Plausibility::default();
        // A lone client of a new service: what one instance is trusted up to.
        let mut c = ClientCalls::default();
        let mut r = with_calls("maps", 1000, &[("web", 3000), ("app", 1000)]);
        assert_eq!(k.screen_calls(&mut r, &mut c, first(1000, 3000), &p), 0);
        assert_eq!(counts(&r), [3000, 1000]);
        let mut r = with_calls("maps", 1000, &[("web", 30_000), ("app", 10_000)]);
        let mut c = ClientCalls::default();
        assert_eq!(k.screen_calls(&mut r, &mut c, first(1000, 3000), &p), 2);
        assert_eq!(counts(&r), [3750, 1250]);
        // Busy peers raise it.
        forward_calls(&mut k, "maps", &[20_000.0, 20_000.0, 20_000.0], &p);
        let mut c = ClientCalls::default();
        let mut r = with_calls("maps", 1000, &[("web", 30_000), ("app", 10_000)]);
        assert_eq!(k.screen_calls(&mut r, &mut c, el(1000, 3000), &p), 0);
        // Its peer cap stays when the service enters the config, until the next forward.
        let mut doc = config();
        let mut maps = doc.services[0].clone();
        maps.service = "maps".into();
        doc.services.push(maps);
        k.rebuild(&doc);
        let mut c = ClientCalls::default();
        let mut r = with_calls("maps", 1000, &[("web", 80_000), ("app", 10_000)]);
        assert_eq!(k.screen_calls(&mut r, &mut c, el(1000, 3000), &p), 2);
        assert_eq!(counts(&r).iter().sum::<u64>(), 79_999);
    }
}
