//! The controller's state machine without I/O: zone reports in, drop ratios per bucket and
//! scope key out. The HTTP controller and the simulator both drive this one type, so the
//! simulator runs the production math.

use std::collections::{BTreeMap, HashMap, VecDeque};

mod candidates;
mod directives;
mod ingest;
mod reports;

// Zones and their rates live in ordered maps: sums then run in one order, so the simulator's
// ratios (and so its random draws) are reproducible bit for bit.

use grl_core::control::{drop_ratio, scope_key};
use schema::criticality::TIERS;
use schema::{Bucket, Criticality, Scope};
use serde::Serialize;

use crate::frags::FragCache;
use crate::overrides::{combine, floor, materialize, Affected, Effect, Group, Override};
use grl_wire::{
    BucketCountsMsg, ConfigDoc, DirectiveMsg, ReplySession, ServiceDirectives, ZoneBucketMsg,
    ZoneDirectives, ZoneReport,
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
    /// The offered rate by criticality tier (least critical first), when every zone with
    /// traffic under the key reported its mix of tiers.
    pub tier_offered_rps: Option<[f64; TIERS]>,
    /// Interned id of `scope_key`.
    id: u32,
    /// Live zone reports that carry the key.
    zones: u32,
    /// The sums of the zones' [`Units`].
    sums: Units,
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
    /// Every tier below this one sheds everything (a `shed_below` override).
    pub floor: Option<Criticality>,
    /// State per scope key seen this round.
    pub keys: Vec<KeyState>,
}

use grl_wire::ReportCounts;

/// Requests counted by tier: `[offered, admitted, dropped, shadow_dropped]` of each tier,
/// least critical first, then (at `TIERS`) of the requests counted without a tier
/// ([`grl_wire::BucketCountsMsg::by_tier`]).
pub type Split = [[u64; 4]; TIERS + 1];

pub use grl_wire::reports::whole;
// The rows and pages of `GET /v1/reports` are wire types, shared with `rlc`.
use grl_wire::{ReportPage, ReportRow};

struct ZoneData {
    /// Interned ids of `region:<region>` and `zone:<zone>`.
    region_key: u32,
    zone_key: u32,
    at_ms: u64,
    /// The zone's forwarding interval as the engine estimates it from the gaps between its
    /// reports (ms; None until its second report; see [`crate::period`]).
    gap_ms: Option<u64>,
    /// The delta session `(id, seq)` of the last report applied (None: the zone sends full
    /// reports only, or its session was invalidated by a config change).
    session: Option<(u64, u64)>,
    /// [offered, admitted, dropped, shadow] rates (in [`RATE_UNIT`]s) by bucket index,
    /// resolved once per report (and remapped on a config change). The engine's per-key sums
    /// are the sums of these over the live zones: a report replaces its zone's previous
    /// contribution bucket by bucket.
    resolved: Vec<(usize, Units)>,
    /// Per candidate fed by calls (its index in the candidate list, in order), the rate of
    /// the zone's calls matching it: their count over the time they cover, from its last
    /// report that said (see `candidates`). Absent: none.
    calls_rps: Vec<(u32, f64)>,
    /// When `calls_rps` was set: it counts within the zone's horizon of it (a zone whose
    /// calls go to another replica keeps reporting its rates here, without calls).
    calls_at_ms: u64,
}

/// How long the engine remembers when a zone it forgot last reported (ms), so that the zone's
/// next report still tells its forwarding interval.
const FORGOTTEN_ZONE_MEMORY_MS: u64 = 600_000;

/// Rates are summed as integers of 1/1000 request per second: adding a zone's new report and
/// taking its previous one away is then exact, so the incremental sums never drift from the
/// sums a full pass would compute, and they do not depend on the order reports arrive in
/// (the simulator stays reproducible bit for bit).
const RATE_UNIT: f64 = 1000.0;
/// The most seconds one [`Engine::record_reports`] call writes rows for (a controller stalled
/// longer does not invent a long past at the rates of now).
pub const MAX_REPORT_SECONDS: u64 = 10;

/// The largest rate one zone reports per bucket that is counted (2^53 units, about 9·10^12
/// requests/s): far beyond any real rate, and sums of a thousand zones stay within an i64.
const RATE_MAX: f64 = 9_007_199_254_740_992.0;

/// What a zone contributes to a bucket's key: [offered, admitted, dropped, shadow] rates, the
/// offered rate by tier (least critical first), all in [`RATE_UNIT`]s, and 1 when the zone
/// has traffic but no mix of tiers (a key whose sum of that is above 0 has no known mix).
/// Integers, so that adding a report and taking its previous one away is exact.
pub(crate) type Units = [i64; 9];

/// Where [`Units`] holds the offered rate by tier, and the count of zones without a mix.
const TIER_AT: usize = 4;
const UNTIERED_AT: usize = 8;

fn to_units(x: f64) -> i64 {
    // Reports are checked finite and non-negative; NaN would become 0 here all the same.
    (x * RATE_UNIT).round().clamp(0.0, RATE_MAX) as i64
}

/// A reported bucket's [`Units`].
fn units(b: &ZoneBucketMsg) -> Units {
    let mut u = [0; 9];
    u[0] = to_units(b.offered_rps);
    u[1] = to_units(b.admitted_rps);
    u[2] = to_units(b.dropped_rps);
    u[3] = to_units(b.shadow_dropped_rps);
    // The zone's mix, scaled to its offered rate: no zone weighs in the fleet's mix more
    // than the traffic it reports.
    let sum: f64 = b.tier_offered_rps.map_or(0.0, |t| t.iter().sum());
    match b.tier_offered_rps {
        Some(t) if sum.is_finite() && sum > 0.0 && t.iter().all(|x| *x >= 0.0) => {
            for (j, x) in t.into_iter().enumerate() {
                u[TIER_AT + j] = to_units(b.offered_rps * x / sum);
            }
        }
        _ => u[UNTIERED_AT] = (u[0] > 0) as i64,
    }
    u
}

/// The offered rate by tier of a key's sums, scaled to its whole offered rate (so that no
/// zone's mix can make the tiers add up to more or less than what is offered); None when a
/// zone with traffic has no mix, or the tiers sum to nothing.
fn tier_offered(sums: &Units) -> Option<[f64; TIERS]> {
    let tiers = &sums[TIER_AT..TIER_AT + TIERS];
    let total: i64 = tiers.iter().sum();
    if sums[UNTIERED_AT] > 0 || total <= 0 {
        return None;
    }
    let scale = from_units(sums[0]) / total as f64;
    Some(std::array::from_fn(|j| tiers[j] as f64 * scale))
}

fn from_units(x: i64) -> f64 {
    x as f64 / RATE_UNIT
}

/// A fast, non-cryptographic hasher (the rustc "Fx" mix) for the bucket index: looking up a
/// report's buckets is the inner loop of ingestion, and only configured names are inserted.
#[derive(Default, Clone, Copy)]
struct Fx(u64);

impl std::hash::Hasher for Fx {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            self.add(u64::from_le_bytes(c.try_into().expect("8 bytes")));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut b = [0u8; 8];
            b[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(b) ^ ((rest.len() as u64) << 59));
        }
    }
    fn write_u8(&mut self, i: u8) {
        self.add(i as u64 | 0x100);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

impl Fx {
    #[inline]
    fn add(&mut self, w: u64) {
        self.0 = (self.0.rotate_left(5) ^ w).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

type FxBuild = std::hash::BuildHasherDefault<Fx>;
type Index = HashMap<String, HashMap<String, usize, FxBuild>, FxBuild>;

fn lookup(index: &Index, service: &str, bucket: &str) -> Option<usize> {
    index.get(service)?.get(bucket).copied()
}

/// Strings given small ids once (scope keys, zone names), so that the per-bucket state holds
/// ids instead of strings.
#[derive(Default)]
struct Interner {
    names: Vec<String>,
    ids: HashMap<String, u32>,
}

impl Interner {
    fn id(&mut self, s: &str) -> u32 {
        if let Some(&i) = self.ids.get(s) {
            return i;
        }
        let i = self.names.len() as u32;
        self.names.push(s.to_string());
        self.ids.insert(s.to_string(), i);
        i
    }
    fn name(&self, i: u32) -> &str {
        &self.names[i as usize]
    }
}

/// Whether a key had any traffic (it gets a report row).
fn busy(k: &KeyState) -> bool {
    k.offered_rps != 0.0
        || k.admitted_rps != 0.0
        || k.dropped_rps != 0.0
        || k.shadow_dropped_rps != 0.0
}

/// The share of `k`'s offered rate from the controller's own zones, when peers add to bucket
/// `i` (`peers` from [`Engine::global_zone_sums`] of the peers); `None` when it is all the
/// controller's own.
fn own_share(i: usize, k: &KeyState, peers: &BTreeMap<usize, Units>) -> Option<f64> {
    let peer = peers.get(&i)?[0];
    if peer <= 0 {
        return None;
    }
    let total = k.sums[0];
    if total <= 0 {
        return Some(0.0);
    }
    Some((1.0 - peer as f64 / total as f64).clamp(0.0, 1.0))
}

/// What [`Engine::ingest`] did with a report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ingested {
    /// The report's numbers are in.
    Applied,
    /// A delta report whose base is not the zone's last applied report (or a session this
    /// engine does not know): nothing changed; the zone must send a full report.
    Resync,
}

/// Bytes of serialized directives kept per entry of the directive log's bound (the
/// directives of about a quarter of the log's entries, at about 110 bytes each; 32 MB at 1M
/// buckets, the arena up to twice that between compactions).
const FRAG_BYTES_PER_LOG_ENTRY: usize = 32;

/// A directive-log entry's key for a change of the whole bucket (limit or fixed ratio).
const ALL_KEYS: u32 = u32::MAX;

/// Aggregator-id prefix of reports that come from a peer controller.
pub const PEER_PREFIX: &str = "region:";

/// The controller's state.
///
/// Incremental: a zone report replaces that zone's contribution to the per-key sums of the
/// buckets it carries (and of the ones its previous report carried) and marks those buckets
/// dirty; [`Engine::recompute`] recomputes the ratios of the dirty buckets only (and of the
/// traffic-override groups they belong to), so a report costs in proportion to its size, not
/// to the number of buckets. Bucket overrides are indexed by bucket.
pub struct Engine {
    /// The config as pushed (persisted, compared against pushes).
    base: ConfigDoc,
    /// The config served to clients: `base` plus what traffic overrides need (None: `base`
    /// itself, no second copy, when no traffic override is in force).
    config: Option<ConfigDoc>,
    overrides: Vec<Override>,
    /// Traffic-override groups over the served buckets, with their member indices.
    groups: Vec<(Group, Vec<usize>)>,
    /// Each group's ratio and limit from its members' offered rates at the last recompute.
    group_ratio: Vec<f64>,
    /// Bucket index → the groups it is a member of.
    bucket_groups: HashMap<usize, Vec<usize>>,
    /// Bucket index → the bucket overrides targeting it (indices into `overrides`).
    bucket_overrides: HashMap<usize, Vec<usize>>,
    /// The next unix second at which a bucket override starts or stops applying, and the
    /// unix second of the last recompute (a clock that goes back re-evaluates them all).
    overrides_change_at: u64,
    last_unix: u64,
    buckets: Vec<BucketState>,
    index: Index,
    zones: BTreeMap<String, ZoneData>,
    /// Scope keys (`global` is id 0) and zone names.
    keys: Interner,
    zone_names: Interner,
    /// Buckets whose sums changed since the last recompute (`dirty_flag` marks membership);
    /// `all_dirty` after a config or override change.
    dirty: Vec<usize>,
    dirty_flag: Vec<bool>,
    all_dirty: bool,
    /// Keys with traffic (the rows `record_reports` appends).
    busy_rows: usize,
    /// A zone's reports count for three of its forwarding intervals after its last one, and
    /// at least this long (three of the controller's ticks; see [`Engine::horizon`]).
    zone_ttl_ms: u64,
    /// Zones taken out of the sums by the TTL: when each last reported and its forwarding
    /// interval estimate. One entry per zone seen (a zone is here or in `zones`, never both),
    /// each dropped at the zone's next report or [`FORGOTTEN_ZONE_MEMORY_MS`] after its last.
    forgotten: HashMap<String, (u64, Option<u64>)>,
    reports: VecDeque<ReportRow>,
    report_cap: usize,
    /// The last second [`Engine::record_reports`] wrote rows for.
    reported_second: Option<u64>,
    /// Requests the zones counted since the last report row, per bucket index and scope key
    /// id, by tier ([`Split`]); `pending_in` lists the buckets that have some.
    pending: Vec<Vec<(u32, Split)>>,
    pending_in: Vec<usize>,
    seq: u64,
    /// Cumulative counts per bucket index, per zone name id (sorted by zone name), by tier,
    /// for `/metrics`.
    totals: Vec<Vec<(u32, Split)>>,
    /// Directive changes for delta replies: this engine instance's epoch, the directives'
    /// version (bumped by every recompute that changed something), the changes not yet
    /// versioned as (bucket, key id or [`ALL_KEYS`]), and the log of versioned changes
    /// (bounded: [`Engine::log_cap`]); `log_from`: every change after this version is in the
    /// log, an older version gets every directive.
    epoch: u64,
    dver: u64,
    changed: Vec<(u32, u32)>,
    log: VecDeque<(u64, u32, u32)>,
    log_from: u64,
    /// Directives serialized for delta replies, by bucket and key id: dropped whenever the
    /// bucket's limit or that key's rates or ratio change (wherever `changed` gets an entry),
    /// so the bytes are always those of the current directive.
    frags: FragCache,
    /// Each bucket's scope and service (an index into `service_names`), packed: a reply whose
    /// directives are all in `frags` reads no bucket state.
    scope_of: Vec<Scope>,
    service_of: Vec<u32>,
    service_names: Vec<String>,
    /// Candidate limits, evaluated beside the buckets, never served.
    candidates: candidates::Candidates,
}

impl Engine {
    /// An engine with `config`; a zone silent for three of its forwarding intervals, and at
    /// least `zone_ttl_ms`, is forgotten (the interval is learnt from the gaps between the
    /// zone's reports, at most 60 s).
    pub fn new(config: ConfigDoc, zone_ttl_ms: u64) -> Engine {
        let mut keys = Interner::default();
        keys.id("global");
        let mut e = Engine {
            base: ConfigDoc::default(),
            config: None,
            overrides: Vec::new(),
            groups: Vec::new(),
            group_ratio: Vec::new(),
            bucket_groups: HashMap::new(),
            bucket_overrides: HashMap::new(),
            overrides_change_at: u64::MAX,
            last_unix: 0,
            buckets: Vec::new(),
            index: HashMap::default(),
            zones: BTreeMap::new(),
            keys,
            zone_names: Interner::default(),
            dirty: Vec::new(),
            dirty_flag: Vec::new(),
            all_dirty: true,
            busy_rows: 0,
            zone_ttl_ms,
            forgotten: HashMap::new(),
            reports: VecDeque::new(),
            report_cap: 20_000,
            reported_second: None,
            pending: Vec::new(),
            pending_in: Vec::new(),
            seq: 0,
            totals: Vec::new(),
            epoch: {
                use std::hash::{BuildHasher, Hasher};
                // A random id per engine (std's per-process random keys, no extra crate),
                // below 2^53 so that any JSON reader keeps it exact.
                std::collections::hash_map::RandomState::new()
                    .build_hasher()
                    .finish()
                    & ((1 << 53) - 1)
            },
            dver: 0,
            changed: Vec::new(),
            log: VecDeque::new(),
            log_from: 0,
            frags: FragCache::default(),
            scope_of: Vec::new(),
            service_of: Vec::new(),
            service_names: Vec::new(),
            candidates: Default::default(),
        };
        e.set_config(config);
        e
    }

    /// The config served to clients (the pushed one plus traffic-override buckets).
    pub fn config(&self) -> &ConfigDoc {
        self.config.as_ref().unwrap_or(&self.base)
    }

    /// The config as pushed.
    pub fn base_config(&self) -> &ConfigDoc {
        &self.base
    }

    /// Replaces the config (already validated). Its candidates are kept apart (see
    /// [`Engine::candidates`]): neither the pushed nor the served config carries them, so no
    /// aggregator or client ever sees one.
    pub fn set_config(&mut self, mut config: ConfigDoc) {
        let candidates = std::mem::take(&mut config.candidates);
        self.base = config;
        self.rebuild();
        self.set_candidates(candidates);
    }

    /// The served buckets an override acts on (empty for an unknown id).
    pub fn affected(&self, id: &str) -> Vec<Affected> {
        if let Some(o) = self
            .overrides
            .iter()
            .find(|o| o.id == id && !o.is_traffic())
        {
            return self
                .targeted(o)
                .into_iter()
                .map(|i| &self.buckets[i])
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

    /// The buckets (in bucket order) a bucket or service-wide override targets.
    fn targeted(&self, o: &Override) -> Vec<usize> {
        let Some(svc) = o.req.service.as_deref() else {
            return Vec::new();
        };
        let mut idx: Vec<usize> = match o.req.bucket.as_deref() {
            Some(b) => lookup(&self.index, svc, b).into_iter().collect(),
            None => self
                .index
                .get(svc)
                .map(|m| m.values().copied().collect())
                .unwrap_or_default(),
        };
        idx.sort_unstable();
        idx
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
        self.group_ratio = vec![0.0; self.groups.len()];
        self.bucket_groups.clear();
        for (gi, (_, idx)) in self.groups.iter().enumerate() {
            for &i in idx {
                let v = self.bucket_groups.entry(i).or_default();
                if !v.contains(&gi) {
                    v.push(gi);
                }
            }
        }
        self.index_overrides();
    }

    /// Indexes the bucket overrides by bucket (after any change of the list or the config).
    fn index_overrides(&mut self) {
        for &i in self.bucket_overrides.keys() {
            if i < self.dirty_flag.len() && !self.dirty_flag[i] {
                self.dirty_flag[i] = true;
                self.dirty.push(i);
            }
        }
        self.bucket_overrides.clear();
        let targets: Vec<(usize, usize)> = (self.overrides.iter().enumerate())
            .filter(|(_, o)| !o.is_traffic())
            .flat_map(|(j, o)| self.targeted(o).into_iter().map(move |i| (j, i)))
            .collect();
        for (j, i) in targets {
            self.bucket_overrides.entry(i).or_default().push(j);
            self.mark(i);
        }
        // Re-evaluated at the next recompute, whatever its time.
        self.overrides_change_at = 0;
    }

    fn mark(&mut self, i: usize) {
        if !self.dirty_flag[i] {
            self.dirty_flag[i] = true;
            self.dirty.push(i);
        }
    }

    fn install(&mut self, config: ConfigDoc) {
        let old = std::mem::take(&mut self.buckets);
        let mut old_totals = std::mem::take(&mut self.totals);
        self.index.clear();
        for f in &config.services {
            // The service's name is copied once, not per bucket.
            let names = match self.index.get_mut(f.service.as_str()) {
                Some(m) => m,
                None => self.index.entry(f.service.clone()).or_default(),
            };
            names.reserve(f.buckets.len());
            for b in &f.buckets {
                names.insert(b.name.clone(), self.buckets.len());
                self.buckets.push(BucketState {
                    service: f.service.clone(),
                    bucket: b.clone(),
                    limit_rps: b.limit_rps,
                    fixed: None,
                    floor: None,
                    keys: Vec::new(),
                });
            }
        }
        // Reports already in, and the counters, follow their bucket by name to its new index.
        let remap: Vec<Option<usize>> = old
            .iter()
            .map(|b| lookup(&self.index, &b.service, &b.bucket.name))
            .collect();
        let mut zones = std::mem::take(&mut self.zones);
        for z in zones.values_mut() {
            z.resolved = z
                .resolved
                .iter()
                .filter_map(|&(i, r)| remap.get(i).copied().flatten().map(|j| (j, r)))
                .collect();
        }
        self.totals = vec![Vec::new(); self.buckets.len()];
        for (i, t) in old_totals.iter_mut().enumerate() {
            if let Some(Some(j)) = remap.get(i) {
                self.totals[*j] = std::mem::take(t);
            }
        }
        // Counts not reported yet follow their bucket too (a bucket gone loses them: its rows
        // would name a bucket the config no longer has).
        let mut old_pending = std::mem::take(&mut self.pending);
        self.pending = vec![Vec::new(); self.buckets.len()];
        let mut pending_in = Vec::new();
        for i in std::mem::take(&mut self.pending_in) {
            if let (Some(Some(j)), Some(p)) = (remap.get(i), old_pending.get_mut(i)) {
                if !p.is_empty() {
                    self.pending[*j] = std::mem::take(p);
                    pending_in.push(*j);
                }
            }
        }
        self.pending_in = pending_in;
        self.config = (config != self.base).then_some(config);
        // Every sum is rebuilt from the zones' reports, every ratio recomputed.
        self.dirty.clear();
        self.dirty_flag = vec![false; self.buckets.len()];
        self.all_dirty = true;
        self.busy_rows = 0;
        for z in zones.values_mut() {
            self.contribute(z, 1);
            // Delta reports name buckets the aggregator believes this engine holds: after a
            // config change (buckets dropped or added by name) the next report must be full.
            z.session = None;
        }
        self.zones = zones;
        // Every directive may have changed (indices too): older versions get a full reply.
        self.changed.clear();
        self.frags = FragCache::new(
            self.buckets.len(),
            FRAG_BYTES_PER_LOG_ENTRY * self.log_cap(),
        );
        self.scope_of = self.buckets.iter().map(|b| b.bucket.scope).collect();
        // Buckets are in service order: a service is one group of a reply.
        let (mut names, mut service_of) = (Vec::<String>::new(), Vec::new());
        for b in &self.buckets {
            if names.last() != Some(&b.service) {
                names.push(b.service.clone());
            }
            service_of.push(names.len() as u32 - 1);
        }
        (self.service_names, self.service_of) = (names, service_of);
        self.log.clear();
        self.dver += 1;
        self.log_from = self.dver;
    }

    /// The overrides (active or not yet purged).
    pub fn overrides(&self) -> &[Override] {
        &self.overrides
    }

    /// Replaces the override list.
    pub fn set_overrides(&mut self, list: Vec<Override>) {
        let traffic = list.iter().any(Override::is_traffic)
            || self.overrides.iter().any(Override::is_traffic);
        self.overrides = list;
        if traffic {
            self.rebuild();
        } else {
            // Bucket overrides do not change the served config: re-index them only.
            self.index_overrides();
        }
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
        let traffic = list.iter().any(Override::is_traffic)
            || self.overrides.iter().any(Override::is_traffic);
        let m = traffic.then(|| materialize(&self.base, &list));
        if let Some(m) = &m {
            self.check_served(&m.0)?;
        }
        if let Err(e) = persist(&list) {
            return Ok(Err(e));
        }
        self.overrides = list;
        match m {
            Some(m) => self.install_materialized(m),
            None => self.index_overrides(),
        }
        Ok(Ok(()))
    }

    /// Whether `list` could replace the overrides: the config it makes clients run must be
    /// valid (the check of [`Engine::try_set_overrides`], changing nothing).
    pub fn check_overrides(&self, list: &[Override]) -> Result<(), crate::config::ConfigError> {
        if list.iter().any(Override::is_traffic) {
            self.check_served(&materialize(&self.base, list).0)?;
        }
        Ok(())
    }

    /// A served config the overrides make: valid, and within [`crate::config::MAX_OVERRIDE_BUCKETS`]
    /// buckets more than the pushed one.
    fn check_served(&self, served: &ConfigDoc) -> Result<(), crate::config::ConfigError> {
        let count = |d: &ConfigDoc| d.services.iter().map(|f| f.buckets.len()).sum::<usize>();
        let added = count(served).saturating_sub(count(&self.base));
        if added > crate::config::MAX_OVERRIDE_BUCKETS {
            return Err(crate::config::ConfigError::TooManyOverrideBuckets {
                added,
                max: crate::config::MAX_OVERRIDE_BUCKETS,
            });
        }
        crate::config::validate(served)
    }

    /// Removes overrides expired at `unix_now` and returns them (for the audit log).
    pub fn purge_expired(&mut self, unix_now: u64) -> Vec<Override> {
        if self.overrides.iter().all(|o| o.active(unix_now)) {
            return Vec::new();
        }
        let (keep, gone): (Vec<Override>, Vec<Override>) = std::mem::take(&mut self.overrides)
            .into_iter()
            .partition(|o| o.active(unix_now));
        self.overrides = keep;
        if gone.iter().any(|o: &Override| o.is_traffic()) {
            self.rebuild();
        } else {
            self.index_overrides();
        }
        gone
    }

    /// Number of buckets.
    pub fn bucket_count(&self) -> usize {
        self.buckets.len()
    }

    /// Zones (aggregators) whose reports count in the sums (heard from within 3 of their
    /// forwarding intervals, at least the zone TTL) at the last `ingest`/`recompute`.
    pub fn zones_reporting(&self) -> usize {
        self.zones.len()
    }

    /// Zones forgotten (silent beyond their horizon) whose last report time is still kept.
    pub fn zones_remembered(&self) -> usize {
        self.forgotten.len()
    }

    /// How long zone `z`'s last report counts after it arrived (ms): three of the zone's
    /// forwarding intervals, and at least the TTL (three of the controller's ticks). A zone
    /// whose aggregator forwards every second to a controller ticking every 100 ms is still
    /// in the sums between its forwards (with a horizon of three ticks it dropped out 300 ms
    /// after each forward, and the other zones' answers in between carried ratios computed
    /// without its load). The interval is capped at [`crate::period::MAX_PERIOD_MS`]: a zone that stops
    /// reporting is forgotten within three minutes.
    fn horizon(&self, z: &ZoneData) -> u64 {
        crate::period::horizon_ms(self.zone_ttl_ms, z.gap_ms.unwrap_or(0))
    }

    /// Per-bucket state after the last `recompute`.
    pub fn buckets(&self) -> &[BucketState] {
        &self.buckets
    }

    /// This controller's own zones summed per `global` bucket, as a report for a peer
    /// controller of another region (see docs/grl-architecture.md). Data received from peers
    /// (aggregator ids starting with `region:`) is left out, so sums never echo back; counts
    /// are left at zero so that peers' `/metrics` do not count the same requests twice.
    pub fn regional_report(&self, region: &str) -> ZoneReport {
        let sums = self.global_zone_sums(false);
        ZoneReport {
            aggregator_id: format!("{PEER_PREFIX}{region}"),
            region: region.to_string(),
            zone: format!("{region}/*"),
            buckets: sums
                .into_iter()
                .map(|(i, r)| ZoneBucketMsg {
                    service: self.buckets[i].service.clone(),
                    bucket: self.buckets[i].bucket.name.clone(),
                    offered_rps: from_units(r[0]),
                    admitted_rps: from_units(r[1]),
                    dropped_rps: from_units(r[2]),
                    shadow_dropped_rps: from_units(r[3]),
                    counts: Default::default(),
                    gone: false,
                    counts_only: false,
                    // Peers are sent no tiers (an older peer refuses the field): a bucket
                    // peered across regions sheds by the uniform ratio.
                    tier_offered_rps: None,
                })
                .collect(),
            // Calls are exported by the controller their zones report to, never forwarded
            // to peers (each region's controller serves its own zones' calls).
            calls: Vec::new(),
            calls_ms: None,
            session: None,
        }
    }

    /// The four rates (in [`RATE_UNIT`]s) of each `global` bucket, by bucket index, summed over
    /// the zones of peer controllers (`from_peers`) or over the controller's own zones.
    fn global_zone_sums(&self, from_peers: bool) -> BTreeMap<usize, Units> {
        let mut sums: BTreeMap<usize, Units> = BTreeMap::new();
        for (id, z) in &self.zones {
            if id.starts_with(PEER_PREFIX) != from_peers {
                continue;
            }
            for &(i, r) in &z.resolved {
                if self.buckets[i].bucket.scope != Scope::Global {
                    continue;
                }
                let e = sums.entry(i).or_insert([0; 9]);
                for (e, r) in e.iter_mut().zip(r) {
                    *e = e.saturating_add(r);
                }
            }
        }
        sums
    }

    /// Cumulative counts for `/metrics`: per bucket, per zone, by tier ([`Split`]).
    pub fn totals(&self) -> impl Iterator<Item = (&BucketState, &str, &Split)> {
        let names = &self.zone_names;
        self.buckets
            .iter()
            .zip(&self.totals)
            .flat_map(move |(b, t)| t.iter().map(move |(z, c)| (b, names.name(*z), c)))
    }

    /// Brings the ratios up to date at `now_ms` / `unix_now`: zones silent for longer than
    /// their horizon (3 of their forwarding intervals, at least the zone TTL) are taken out of
    /// the sums (a delta report of theirs is then answered `resync`), and the buckets whose
    /// sums or overrides changed since the last call (with the traffic-override groups they
    /// belong to) get their limit and ratios recomputed. Buckets nothing touched are not
    /// visited.
    pub fn recompute(&mut self, now_ms: u64, unix_now: u64) {
        let expired: Vec<String> = self
            .zones
            .iter()
            .filter(|(_, z)| now_ms.saturating_sub(z.at_ms) > self.horizon(z))
            .map(|(id, _)| id.clone())
            .collect();
        for id in expired {
            if let Some(z) = self.zones.remove(&id) {
                self.contribute(&z, -1);
                self.forgotten.insert(id, (z.at_ms, z.gap_ms));
            }
        }
        if !self.forgotten.is_empty() {
            self.forgotten
                .retain(|_, (at, _)| now_ms.saturating_sub(*at) <= FORGOTTEN_ZONE_MEMORY_MS);
        }
        // Bucket overrides start or stop applying with time: their buckets are re-evaluated
        // when the next such moment has come (or the clock went back).
        if unix_now >= self.overrides_change_at || unix_now < self.last_unix {
            let ids: Vec<usize> = self.bucket_overrides.keys().copied().collect();
            for i in ids {
                self.mark(i);
            }
            self.overrides_change_at = self
                .overrides
                .iter()
                .filter(|o| !o.is_traffic() && o.expires_at > unix_now)
                .map(|o| o.expires_at)
                .min()
                .unwrap_or(u64::MAX);
        }
        self.last_unix = unix_now;
        let dirty: Vec<usize> = if self.all_dirty {
            self.all_dirty = false;
            for &i in &self.dirty {
                self.dirty_flag[i] = false;
            }
            self.dirty.clear();
            (0..self.buckets.len()).collect()
        } else {
            let d = std::mem::take(&mut self.dirty);
            for &i in &d {
                self.dirty_flag[i] = false;
            }
            d
        };
        if dirty.is_empty() {
            self.publish();
            return;
        }
        // Traffic overrides: each group touched gets its offered rate as a whole against its
        // limit; every member of such a group is settled again below.
        let mut settle = dirty;
        if !self.groups.is_empty() {
            // Only the groups of the dirty buckets: a report costs its buckets and their
            // groups, not a pass over every group or bucket. `dirty_flag` (all clear here)
            // marks what is already to be settled, and is cleared again below.
            let mut touched: Vec<usize> = settle
                .iter()
                .flat_map(|i| self.bucket_groups.get(i).into_iter().flatten().copied())
                .collect();
            touched.sort_unstable();
            touched.dedup();
            let seen = &mut self.dirty_flag;
            settle.iter().for_each(|&i| seen[i] = true);
            for gi in touched {
                let (g, idx) = &self.groups[gi];
                let offered: f64 = idx
                    .iter()
                    .flat_map(|&i| self.buckets[i].keys.iter())
                    .map(|k| k.offered_rps)
                    .sum();
                self.group_ratio[gi] = g
                    .drop_ratio
                    .unwrap_or_else(|| drop_ratio(offered, g.limit_rps.unwrap_or(f64::INFINITY)));
                for &i in idx {
                    if !seen[i] {
                        seen[i] = true;
                        settle.push(i);
                    }
                }
            }
        }
        for i in settle {
            self.dirty_flag[i] = false;
            self.settle(i, unix_now);
        }
        self.publish();
    }

    /// Versions the directive changes since the last recompute: one new version, appended to
    /// the bounded log (the oldest entries go first; replies older than them are full).
    fn publish(&mut self) {
        if self.changed.is_empty() {
            return;
        }
        self.dver += 1;
        let v = self.dver;
        let cap = self.log_cap();
        if self.changed.len() >= cap {
            // More changes than the log holds (full reports of a whole fleet): every reply
            // is full until the next version; no sort, no copy.
            self.log.clear();
            self.log_from = v;
            self.changed.clear();
        } else {
            // Duplicates (a key changed by two zones' reports) cost log room only: the replies
            // deduplicate their buckets.
            self.changed.dedup();
            self.log
                .extend(self.changed.drain(..).map(|(i, k)| (v, i, k)));
            while self.log.len() > cap {
                if let Some((old, _, _)) = self.log.pop_front() {
                    self.log_from = self.log_from.max(old);
                }
            }
        }
        if self.changed.capacity() > cap {
            self.changed.shrink_to(cap);
        }
    }

    /// The directive log's bound: one entry per bucket (at least 65,536), about 16 bytes each.
    fn log_cap(&self) -> usize {
        self.buckets.len().max(1 << 16)
    }

    /// One bucket's limit, fixed ratio and per-key ratios from its overrides and groups.
    fn settle(&mut self, i: usize, unix_now: u64) {
        let s = &mut self.buckets[i];
        let before = (s.limit_rps, s.fixed, s.floor);
        let mine =
            || (self.bucket_overrides.get(&i).into_iter().flatten()).map(|&j| &self.overrides[j]);
        let eff = combine(mine(), unix_now);
        s.floor = floor(mine(), unix_now);
        (s.limit_rps, s.fixed) = match eff {
            Effect::None => (s.bucket.limit_rps, None),
            Effect::Limit(l) => (l, None),
            Effect::Ratio(r) => (s.bucket.limit_rps, Some(r)),
        };
        // The strictest group wins; a group's limit replaces the member's own one.
        let mut group_limit: Option<f64> = None;
        for &g in self.bucket_groups.get(&i).into_iter().flatten() {
            let ratio = self.group_ratio[g];
            s.fixed = Some(s.fixed.map_or(ratio, |f| f.max(ratio)));
            if let Some(l) = self.groups[g].0.limit_rps {
                group_limit = Some(group_limit.map_or(l, |m| m.min(l)));
            }
        }
        if let Some(l) = group_limit {
            s.limit_rps = l;
        }
        for k in &mut s.keys {
            let ratio = s
                .fixed
                .unwrap_or_else(|| drop_ratio(k.offered_rps, s.limit_rps));
            if ratio.to_bits() != k.ratio.to_bits() {
                self.changed.push((i as u32, k.id));
                self.frags.drop_key(i, k.id);
            }
            k.ratio = ratio;
        }
        if before.0.to_bits() != s.limit_rps.to_bits()
            || before.1.map(f64::to_bits) != s.fixed.map(f64::to_bits)
            || before.2 != s.floor
        {
            self.changed.push((i as u32, ALL_KEYS));
            self.frags.drop_bucket(i);
        }
    }

    /// Directives whose bytes are kept (tests).
    #[cfg(test)]
    pub(crate) fn cached_directives(&self) -> usize {
        self.frags.len()
    }

    /// Whether the served config has buckets of `service`.
    pub fn has_service(&self, service: &str) -> bool {
        self.index.get(service).is_some_and(|m| !m.is_empty())
    }

    /// The scope of a configured bucket.
    pub fn scope_of(&self, service: &str, bucket: &str) -> Option<Scope> {
        lookup(&self.index, service, bucket).map(|i| self.buckets[i].bucket.scope)
    }
}
