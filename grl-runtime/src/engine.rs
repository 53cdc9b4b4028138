//! The controller's state machine without I/O: zone reports in, drop ratios per bucket and
//! scope key out. The HTTP controller and the simulator both drive this one type, so the
//! simulator runs the production math.

use std::collections::{BTreeMap, HashMap, VecDeque};

// Zones and their rates live in ordered maps: sums then run in one order, so the simulator's
// ratios (and so its random draws) are reproducible bit for bit.

use grl_core::control::{drop_ratio, scope_key};
use schema::{Bucket, Scope};
use serde::Serialize;

use crate::overrides::{effect, materialize, Affected, Effect, Group, Override};
use crate::proto::{
    ConfigDoc, DirectiveMsg, ServiceDirectives, ZoneBucketMsg, ZoneDirectives, ZoneReport,
};

/// Rates of one scope key of a bucket, and its ratio.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct KeyState {
    /// `global`, `region:<r>` or `zone:<z>`.
    pub scope_key: String,
    /// Offered requests/s under the key.
    pub offered_rps: f64,
    /// Admitted requests/s.
    pub admitted_rps: f64,
    /// Dropped requests/s.
    pub dropped_rps: f64,
    /// Shadow-dropped requests/s.
    pub shadow_dropped_rps: f64,
    /// The drop ratio for clients under the key.
    pub ratio: f64,
    /// Seen in the current round.
    touched: bool,
}

/// One bucket with its effective limit and per-key state.
#[derive(Debug, Clone)]
pub struct BucketState {
    /// Callee service.
    pub service: String,
    /// The configured bucket.
    pub bucket: Bucket,
    /// Limit after overrides.
    pub limit_rps: f64,
    /// A fixed ratio from an override.
    pub fixed: Option<f64>,
    /// State per scope key seen this round.
    pub keys: Vec<KeyState>,
}

/// One row of `GET /v1/reports`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ReportRow {
    /// Monotonic sequence number (the cursor).
    pub seq: u64,
    /// Unix seconds.
    pub t: u64,
    /// Callee service.
    pub service: String,
    /// Bucket name.
    pub bucket: String,
    /// Caller matched by the bucket.
    pub caller: Option<String>,
    /// Procedure matched by the bucket.
    pub procedure: Option<String>,
    /// enforce | shadow.
    pub mode: &'static str,
    /// The scope key.
    pub scope_key: String,
    /// Offered requests/s.
    pub offered: f64,
    /// Admitted requests/s.
    pub admitted: f64,
    /// Dropped requests/s.
    pub dropped: f64,
    /// Shadow-dropped requests/s.
    pub shadow_dropped: f64,
    /// Effective limit.
    pub limit_rps: f64,
    /// Ratio in force.
    pub drop_ratio: f64,
}

/// One page of `GET /v1/reports`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ReportPage {
    /// The cursor to pass as `after` next time.
    pub next: u64,
    /// Rows with `seq > after`, oldest first.
    pub reports: Vec<ReportRow>,
    /// The cursor was beyond the newest row: this page starts at the oldest row kept.
    pub reset: bool,
    /// Rows between the cursor and the oldest row kept were lost (evicted or a restart).
    pub gap: bool,
}

struct ZoneData {
    region: String,
    zone: String,
    at_ms: u64,
    /// [offered, admitted, dropped, shadow] rates by bucket index, resolved once per report
    /// (and remapped on a config change) so that a recompute does no lookups.
    resolved: Vec<(usize, [f64; 4])>,
}

type Index = HashMap<String, HashMap<String, usize>>;

fn lookup(index: &Index, service: &str, bucket: &str) -> Option<usize> {
    index.get(service)?.get(bucket).copied()
}

/// Whether `key` is the scope key of `scope` in `region`/`zone` (without building it).
fn key_is(key: &str, scope: Scope, region: &str, zone: &str) -> bool {
    match scope {
        Scope::Global => key == "global",
        Scope::Region => key.strip_prefix("region:") == Some(region),
        Scope::Zone => key.strip_prefix("zone:") == Some(zone),
    }
}

/// Aggregator-id prefix of reports that come from a peer controller.
pub const PEER_PREFIX: &str = "region:";

/// The controller's state.
pub struct Engine {
    /// The config as pushed (persisted, compared against pushes).
    base: ConfigDoc,
    /// The config served to clients: `base` plus what traffic overrides need.
    config: ConfigDoc,
    overrides: Vec<Override>,
    /// Traffic-override groups over the served buckets, with their member indices.
    groups: Vec<(Group, Vec<usize>)>,
    buckets: Vec<BucketState>,
    index: Index,
    zones: BTreeMap<String, ZoneData>,
    /// A zone that has not reported for this long no longer counts.
    zone_ttl_ms: u64,
    reports: VecDeque<ReportRow>,
    report_cap: usize,
    seq: u64,
    /// Cumulative counts per bucket index, per zone (for `/metrics`).
    totals: Vec<BTreeMap<String, [u64; 4]>>,
}

impl Engine {
    /// An engine with `config`; zones silent for `zone_ttl_ms` are forgotten.
    pub fn new(config: ConfigDoc, zone_ttl_ms: u64) -> Engine {
        let mut e = Engine {
            base: ConfigDoc::default(),
            config: ConfigDoc::default(),
            overrides: Vec::new(),
            groups: Vec::new(),
            buckets: Vec::new(),
            index: HashMap::new(),
            zones: BTreeMap::new(),
            zone_ttl_ms,
            reports: VecDeque::new(),
            report_cap: 20_000,
            seq: 0,
            totals: Vec::new(),
        };
        e.set_config(config);
        e
    }

    /// The config served to clients (the pushed one plus traffic-override buckets).
    pub fn config(&self) -> &ConfigDoc {
        &self.config
    }

    /// The config as pushed.
    pub fn base_config(&self) -> &ConfigDoc {
        &self.base
    }

    /// Replaces the config (already validated).
    pub fn set_config(&mut self, config: ConfigDoc) {
        self.base = config;
        self.rebuild();
    }

    /// The served buckets an override acts on (empty for an unknown id).
    pub fn affected(&self, id: &str) -> Vec<Affected> {
        if let Some(o) = self
            .overrides
            .iter()
            .find(|o| o.id == id && !o.is_traffic())
        {
            return self
                .buckets
                .iter()
                .filter(|b| o.matches(&b.service, &b.bucket))
                .map(|b| Affected {
                    service: b.service.clone(),
                    bucket: b.bucket.name.clone(),
                    caller: b.bucket.caller.clone(),
                    procedure: b.bucket.procedure.clone(),
                    created: false,
                })
                .collect();
        }
        self.groups
            .iter()
            .find(|(g, _)| g.id == id)
            .map(|(g, _)| g.members.clone())
            .unwrap_or_default()
    }

    fn rebuild(&mut self) {
        let m = materialize(&self.base, &self.overrides);
        self.install_materialized(m);
    }

    fn install_materialized(&mut self, (served, groups): (ConfigDoc, Vec<Group>)) {
        self.install(served);
        self.groups = groups
            .into_iter()
            .map(|g| {
                let idx = g
                    .members
                    .iter()
                    .filter_map(|m| lookup(&self.index, &m.service, &m.bucket))
                    .collect();
                (g, idx)
            })
            .collect();
    }

    fn install(&mut self, config: ConfigDoc) {
        let old = std::mem::take(&mut self.buckets);
        let mut old_totals = std::mem::take(&mut self.totals);
        self.index.clear();
        for f in &config.services {
            for b in &f.buckets {
                self.index
                    .entry(f.service.clone())
                    .or_default()
                    .insert(b.name.clone(), self.buckets.len());
                self.buckets.push(BucketState {
                    service: f.service.clone(),
                    bucket: b.clone(),
                    limit_rps: b.limit_rps,
                    fixed: None,
                    keys: Vec::new(),
                });
            }
        }
        // Reports already in, and the counters, follow their bucket by name to its new index.
        let remap: Vec<Option<usize>> = old
            .iter()
            .map(|b| lookup(&self.index, &b.service, &b.bucket.name))
            .collect();
        for z in self.zones.values_mut() {
            z.resolved = z
                .resolved
                .iter()
                .filter_map(|&(i, r)| remap.get(i).copied().flatten().map(|j| (j, r)))
                .collect();
        }
        self.totals = vec![BTreeMap::new(); self.buckets.len()];
        for (i, t) in old_totals.iter_mut().enumerate() {
            if let Some(Some(j)) = remap.get(i) {
                self.totals[*j] = std::mem::take(t);
            }
        }
        self.config = config;
    }

    /// The overrides (active or not yet purged).
    pub fn overrides(&self) -> &[Override] {
        &self.overrides
    }

    /// Replaces the override list.
    pub fn set_overrides(&mut self, list: Vec<Override>) {
        self.overrides = list;
        self.rebuild();
    }

    /// Replaces the override list if the config it makes clients run is valid (an override
    /// whose buckets would not compile would do nothing); `persist` runs on the checked list
    /// before anything changes, and its error leaves the engine as it was. The overrides are
    /// expanded once.
    pub fn try_set_overrides<E>(
        &mut self,
        list: Vec<Override>,
        persist: impl FnOnce(&[Override]) -> Result<(), E>,
    ) -> Result<Result<(), E>, crate::config::ConfigError> {
        let m = materialize(&self.base, &list);
        crate::config::validate(&m.0)?;
        if let Err(e) = persist(&list) {
            return Ok(Err(e));
        }
        self.overrides = list;
        self.install_materialized(m);
        Ok(Ok(()))
    }

    /// Removes overrides expired at `unix_now` and returns them (for the audit log).
    pub fn purge_expired(&mut self, unix_now: u64) -> Vec<Override> {
        let (keep, gone) = std::mem::take(&mut self.overrides)
            .into_iter()
            .partition(|o| o.active(unix_now));
        self.overrides = keep;
        if gone.iter().any(|o: &Override| o.is_traffic()) {
            self.rebuild();
        }
        gone
    }

    /// Number of buckets.
    pub fn bucket_count(&self) -> usize {
        self.buckets.len()
    }

    /// Zones (aggregators) heard from within the zone TTL at the last `ingest`/`recompute`.
    pub fn zones_reporting(&self) -> usize {
        self.zones.len()
    }

    /// Per-bucket state after the last `recompute`.
    pub fn buckets(&self) -> &[BucketState] {
        &self.buckets
    }

    /// Records a zone's report received at `now_ms`. Unknown buckets are ignored (a client on an
    /// older config), counts go to the totals.
    pub fn ingest(&mut self, r: &ZoneReport, now_ms: u64) {
        let mut resolved = Vec::with_capacity(r.buckets.len());
        for b in &r.buckets {
            let Some(i) = lookup(&self.index, &b.service, &b.bucket) else {
                continue;
            };
            let c = &b.counts;
            if (c.offered | c.admitted | c.dropped | c.shadow_dropped) > 0 {
                let t = match self.totals[i].get_mut(&r.zone) {
                    Some(t) => t,
                    None => self.totals[i].entry(r.zone.clone()).or_default(),
                };
                // Saturating: a report with absurd counts must not wrap the totals (or, in a
                // debug build, panic with the engine lock held).
                t[0] = t[0].saturating_add(c.offered);
                t[1] = t[1].saturating_add(c.admitted);
                t[2] = t[2].saturating_add(c.dropped);
                t[3] = t[3].saturating_add(c.shadow_dropped);
            }
            resolved.push((
                i,
                [
                    b.offered_rps,
                    b.admitted_rps,
                    b.dropped_rps,
                    b.shadow_dropped_rps,
                ],
            ));
        }
        // Keyed by aggregator: replicas serving one zone each carry part of its clients.
        match self.zones.get_mut(&r.aggregator_id) {
            Some(z) => {
                z.resolved = resolved;
                z.at_ms = now_ms;
                if z.zone != r.zone || z.region != r.region {
                    z.zone = r.zone.clone();
                    z.region = r.region.clone();
                }
            }
            None => {
                self.zones.insert(
                    r.aggregator_id.clone(),
                    ZoneData {
                        region: r.region.clone(),
                        zone: r.zone.clone(),
                        at_ms: now_ms,
                        resolved,
                    },
                );
            }
        }
    }

    /// This controller's own zones summed per `global` bucket, as a report for a peer
    /// controller of another region (see docs/grl-architecture.md). Data received from peers
    /// (aggregator ids starting with `region:`) is left out, so sums never echo back; counts
    /// are left at zero so that peers' `/metrics` do not count the same requests twice.
    pub fn regional_report(&self, region: &str) -> ZoneReport {
        let mut sums: BTreeMap<usize, [f64; 4]> = BTreeMap::new();
        for (id, z) in &self.zones {
            if id.starts_with(PEER_PREFIX) {
                continue;
            }
            for &(i, r) in &z.resolved {
                if self.buckets[i].bucket.scope != Scope::Global {
                    continue;
                }
                let e = sums.entry(i).or_default();
                for j in 0..4 {
                    e[j] += r[j];
                }
            }
        }
        ZoneReport {
            aggregator_id: format!("{PEER_PREFIX}{region}"),
            region: region.to_string(),
            zone: format!("{region}/*"),
            buckets: sums
                .into_iter()
                .map(|(i, r)| ZoneBucketMsg {
                    service: self.buckets[i].service.clone(),
                    bucket: self.buckets[i].bucket.name.clone(),
                    offered_rps: r[0],
                    admitted_rps: r[1],
                    dropped_rps: r[2],
                    shadow_dropped_rps: r[3],
                    counts: Default::default(),
                })
                .collect(),
            // Calls are exported by the controller their zones report to, never forwarded
            // to peers (each region's controller serves its own zones' calls).
            calls: Vec::new(),
        }
    }

    /// Cumulative counts for `/metrics`: per bucket, per zone [offered, admitted, dropped,
    /// shadow-dropped].
    pub fn totals(&self) -> impl Iterator<Item = (&BucketState, &str, &[u64; 4])> {
        self.buckets
            .iter()
            .zip(&self.totals)
            .flat_map(|(b, t)| t.iter().map(move |(z, c)| (b, z.as_str(), c)))
    }

    /// Recomputes every bucket's per-key rates and ratios from the zones heard from within the
    /// zone TTL, with the overrides active at `unix_now`.
    pub fn recompute(&mut self, now_ms: u64, unix_now: u64) {
        let ttl = self.zone_ttl_ms;
        self.zones
            .retain(|_, z| now_ms.saturating_sub(z.at_ms) <= ttl);
        let no_overrides = self.overrides.is_empty();
        for s in &mut self.buckets {
            // Keys are reused from round to round (no allocation in steady state); a key no
            // zone reports any more is dropped below.
            for k in &mut s.keys {
                k.offered_rps = 0.0;
                k.admitted_rps = 0.0;
                k.dropped_rps = 0.0;
                k.shadow_dropped_rps = 0.0;
                k.touched = false;
            }
            let eff = if no_overrides {
                Effect::None
            } else {
                effect(&self.overrides, unix_now, &s.service, &s.bucket)
            };
            (s.limit_rps, s.fixed) = match eff {
                Effect::None => (s.bucket.limit_rps, None),
                Effect::Limit(l) => (l, None),
                Effect::Ratio(r) => (s.bucket.limit_rps, Some(r)),
            };
        }
        for z in self.zones.values() {
            for &(i, ref r) in &z.resolved {
                let s = &mut self.buckets[i];
                let scope = s.bucket.scope;
                let p = match s
                    .keys
                    .iter()
                    .position(|k| key_is(&k.scope_key, scope, &z.region, &z.zone))
                {
                    Some(p) => p,
                    None => {
                        s.keys.push(KeyState {
                            scope_key: scope_key(scope, &z.region, &z.zone),
                            ..Default::default()
                        });
                        s.keys.len() - 1
                    }
                };
                let k = &mut s.keys[p];
                k.offered_rps += r[0];
                k.admitted_rps += r[1];
                k.dropped_rps += r[2];
                k.shadow_dropped_rps += r[3];
                k.touched = true;
            }
        }
        for s in &mut self.buckets {
            if s.keys.iter().any(|k| !k.touched) {
                s.keys.retain(|k| k.touched);
            }
            if s.keys.len() > 1 && !s.keys.windows(2).all(|w| w[0].scope_key <= w[1].scope_key) {
                s.keys.sort_by(|a, b| a.scope_key.cmp(&b.scope_key));
            }
            for k in &mut s.keys {
                k.ratio = s
                    .fixed
                    .unwrap_or_else(|| drop_ratio(k.offered_rps, s.limit_rps));
            }
        }
        // Traffic overrides: each group's offered rate as a whole against its limit; the ratio
        // is fixed for every member in every zone (the strictest group wins). The override's
        // limit replaces a member's own one.
        let mut limited = vec![
            false;
            if self.groups.is_empty() {
                0
            } else {
                self.buckets.len()
            }
        ];
        for (g, idx) in &self.groups {
            let offered: f64 = idx
                .iter()
                .flat_map(|&i| self.buckets[i].keys.iter())
                .map(|k| k.offered_rps)
                .sum();
            let ratio = g
                .drop_ratio
                .unwrap_or_else(|| drop_ratio(offered, g.limit_rps.unwrap_or(f64::INFINITY)));
            for &i in idx {
                let s = &mut self.buckets[i];
                let r = s.fixed.map_or(ratio, |f| f.max(ratio));
                s.fixed = Some(r);
                if let Some(l) = g.limit_rps {
                    s.limit_rps = if limited[i] { s.limit_rps.min(l) } else { l };
                    limited[i] = true;
                }
                for k in &mut s.keys {
                    k.ratio = r;
                }
            }
        }
    }

    /// Directives for the clients of `zone` in `region`.
    pub fn directives_for(&self, region: &str, zone: &str) -> ZoneDirectives {
        let mut services: Vec<ServiceDirectives> = Vec::new();
        for s in &self.buckets {
            let k = s
                .keys
                .iter()
                .find(|k| key_is(&k.scope_key, s.bucket.scope, region, zone));
            let d = DirectiveMsg {
                bucket: s.bucket.name.clone(),
                ratio: s.fixed.unwrap_or(k.map_or(0.0, |k| k.ratio)),
                fleet_offered_rps: k.map_or(0.0, |k| k.offered_rps),
                limit_rps: s.limit_rps,
                fixed: s.fixed.is_some(),
            };
            match services.last_mut() {
                Some(sd) if sd.service == s.service => sd.directives.push(d),
                _ => services.push(ServiceDirectives {
                    service: s.service.clone(),
                    directives: vec![d],
                }),
            }
        }
        ZoneDirectives {
            version: self.config.version.clone(),
            services,
        }
    }

    /// Starts this run's report sequence after `base`. The controller passes its start time as
    /// `unix_ms << 10`, so cursors keep increasing across restarts without persisting anything
    /// (room for 1024 rows per millisecond of uptime; stays below 2^53 for JSON readers).
    pub fn set_report_seq_base(&mut self, base: u64) {
        self.seq = self.seq.max(base);
    }

    /// Appends one report row per bucket and scope key with traffic in the interval (call once
    /// per tick); keys whose zones reported nothing but zeros are skipped so that the bounded
    /// ring holds useful rows.
    pub fn record_reports(&mut self, unix_now: u64) {
        for s in &self.buckets {
            for k in &s.keys {
                if k.offered_rps == 0.0
                    && k.admitted_rps == 0.0
                    && k.dropped_rps == 0.0
                    && k.shadow_dropped_rps == 0.0
                {
                    continue;
                }
                self.seq += 1;
                self.reports.push_back(ReportRow {
                    seq: self.seq,
                    t: unix_now,
                    service: s.service.clone(),
                    bucket: s.bucket.name.clone(),
                    caller: s.bucket.caller.clone(),
                    procedure: s.bucket.procedure.clone(),
                    mode: s.bucket.mode.as_str(),
                    scope_key: k.scope_key.clone(),
                    offered: k.offered_rps,
                    admitted: k.admitted_rps,
                    dropped: k.dropped_rps,
                    shadow_dropped: k.shadow_dropped_rps,
                    limit_rps: s.limit_rps,
                    drop_ratio: k.ratio,
                });
            }
        }
        while self.reports.len() > self.report_cap {
            self.reports.pop_front();
        }
    }

    /// Up to `limit` report rows with `seq > after`, and the cursor to pass next.
    ///
    /// A cursor beyond the newest row (from a controller whose clock went back, or a cursor
    /// from another controller) cannot be answered as asked: the page then starts at the
    /// oldest row kept and says `reset`. A cursor older than the oldest row kept (rows evicted
    /// from the ring, or a restart in between) says `gap`: rows were lost.
    pub fn reports_after(&self, after: u64, limit: usize) -> ReportPage {
        let oldest = self.reports.front().map(|r| r.seq);
        let reset = after > self.seq;
        let from = if reset { 0 } else { after };
        let gap = !reset && after > 0 && oldest.is_some_and(|o| o > after + 1);
        // Rows are in seq order: skip to the first one after the cursor without a scan.
        let start = self.reports.partition_point(|r| r.seq <= from);
        let rows: Vec<ReportRow> = self.reports.range(start..).take(limit).cloned().collect();
        let next = rows
            .last()
            .map_or(if reset { self.seq } else { after }, |r| r.seq);
        ReportPage {
            next,
            reports: rows,
            reset,
            gap,
        }
    }

    /// The scope of a configured bucket.
    pub fn scope_of(&self, service: &str, bucket: &str) -> Option<Scope> {
        lookup(&self.index, service, bucket).map(|i| self.buckets[i].bucket.scope)
    }
}
