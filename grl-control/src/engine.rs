//! The controller's state machine without I/O: zone reports in, drop ratios per bucket and
//! scope key out. The HTTP controller and the simulator both drive this one type, so the
//! simulator runs the production math.

use std::collections::{BTreeMap, HashMap, VecDeque};

mod candidates;

// Zones and their rates live in ordered maps: sums then run in one order, so the simulator's
// ratios (and so its random draws) are reproducible bit for bit.

use grl_core::control::{drop_ratio, scope_key};
use schema::{Bucket, Scope};
use serde::Serialize;

use crate::frags::FragCache;
use crate::overrides::{combine, materialize, Affected, Effect, Group, Override};
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
    /// Interned id of `scope_key`.
    id: u32,
    /// Live zone reports that carry the key.
    zones: u32,
    /// The four rates' sums in [`RATE_UNIT`]s.
    sums: [i64; 4],
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

use grl_wire::ReportCounts;
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
    resolved: Vec<(usize, [i64; 4])>,
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
/// The counts of key `id` in a bucket's pending counts, taken out (zeros when none).
fn take_counts(pending: &mut Vec<(u32, [u64; 4])>, id: u32) -> [u64; 4] {
    match pending.iter().position(|(k, _)| *k == id) {
        Some(p) => pending.swap_remove(p).1,
        None => [0; 4],
    }
}

/// The report row of bucket `s`'s key `scope_key` at second `t`: the key's rates (zeros for a
/// key without any now) with their `own_share`, and the requests counted since its previous
/// row.
fn report_row(
    s: &BucketState,
    scope_key: &str,
    k: Option<&KeyState>,
    own_share: Option<f64>,
    counts: [u64; 4],
    t: u64,
) -> ReportRow {
    let [offered, admitted, dropped, shadow_dropped] = counts;
    ReportRow {
        seq: 0,
        t: t.into(),
        service: s.service.clone(),
        bucket: s.bucket.name.clone(),
        caller: s.bucket.caller.clone(),
        procedure: s.bucket.procedure.clone(),
        mode: std::borrow::Cow::Borrowed(s.bucket.mode.as_str()),
        scope_key: scope_key.to_string(),
        offered: k.map_or(0.0, |k| k.offered_rps),
        admitted: k.map_or(0.0, |k| k.admitted_rps),
        dropped: k.map_or(0.0, |k| k.dropped_rps),
        shadow_dropped: k.map_or(0.0, |k| k.shadow_dropped_rps),
        limit_rps: s.limit_rps,
        drop_ratio: k.map_or(0.0, |k| k.ratio),
        own_share,
        counts: Some(ReportCounts {
            offered,
            admitted,
            dropped,
            shadow_dropped,
        }),
    }
}

/// The most seconds one [`Engine::record_reports`] call writes rows for (a controller stalled
/// longer does not invent a long past at the rates of now).
pub const MAX_REPORT_SECONDS: u64 = 10;

/// The largest rate one zone reports per bucket that is counted (2^53 units, about 9·10^12
/// requests/s): far beyond any real rate, and sums of a thousand zones stay within an i64.
const RATE_MAX: f64 = 9_007_199_254_740_992.0;

fn to_units(x: f64) -> i64 {
    // Reports are checked finite and non-negative; NaN would become 0 here all the same.
    (x * RATE_UNIT).round().clamp(0.0, RATE_MAX) as i64
}

/// A reported bucket's four rates in [`RATE_UNIT`]s.
fn units(b: &ZoneBucketMsg) -> [i64; 4] {
    [
        to_units(b.offered_rps),
        to_units(b.admitted_rps),
        to_units(b.dropped_rps),
        to_units(b.shadow_dropped_rps),
    ]
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
fn own_share(i: usize, k: &KeyState, peers: &BTreeMap<usize, [i64; 4]>) -> Option<f64> {
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
    /// id ([offered, admitted, dropped, shadow-dropped]); `pending_in` lists the buckets that
    /// have some.
    pending: Vec<Vec<(u32, [u64; 4])>>,
    pending_in: Vec<usize>,
    seq: u64,
    /// Cumulative counts per bucket index, per zone name id (sorted by zone name) for
    /// `/metrics`.
    totals: Vec<Vec<(u32, [u64; 4])>>,
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
            let service = o.req.service.as_deref().unwrap_or_default();
            let bucket = o.req.bucket.as_deref().unwrap_or_default();
            return lookup(&self.index, service, bucket)
                .map(|i| &self.buckets[i])
                .map(|b| Affected {
                    service: b.service.clone(),
                    bucket: b.bucket.name.clone(),
                    caller: b.bucket.caller.clone(),
                    procedure: b.bucket.procedure.clone(),
                    created: false,
                })
                .into_iter()
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
        for (j, o) in self.overrides.iter().enumerate() {
            if o.is_traffic() {
                continue;
            }
            let (Some(svc), Some(b)) = (&o.req.service, &o.req.bucket) else {
                continue;
            };
            if let Some(i) = lookup(&self.index, svc, b) {
                self.bucket_overrides.entry(i).or_default().push(j);
                if !self.dirty_flag[i] {
                    self.dirty_flag[i] = true;
                    self.dirty.push(i);
                }
            }
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

    /// Adds (`sign` 1) or takes away (`sign` -1) a zone's report from the per-key sums of the
    /// buckets it carries, and marks them dirty. A key no live report carries any more goes.
    fn contribute(&mut self, z: &ZoneData, sign: i64) {
        for &(i, r) in &z.resolved {
            let id = self.key_of(i, z);
            self.apply_entry(i, id, r.map(|x| sign * x), sign as i32);
        }
    }

    /// The scope key id of bucket `i` for zone `z`.
    fn key_of(&self, i: usize, z: &ZoneData) -> u32 {
        match self.buckets[i].bucket.scope {
            Scope::Global => 0,
            Scope::Region => z.region_key,
            Scope::Zone => z.zone_key,
        }
    }

    /// Replaces zone report `old` by `new` (same region and zone), walking both in bucket
    /// order: a bucket in both gets the difference, and is marked dirty only if it changed.
    fn replace(&mut self, old: &ZoneData, new: &ZoneData) {
        let (a, b) = (&old.resolved, &new.resolved);
        let (mut x, mut y) = (0, 0);
        while x < a.len() || y < b.len() {
            let (i, delta, dz) = match (a.get(x), b.get(y)) {
                (Some(&(i, o)), Some(&(j, n))) if i == j => {
                    x += 1;
                    y += 1;
                    (i, [n[0] - o[0], n[1] - o[1], n[2] - o[2], n[3] - o[3]], 0)
                }
                (Some(&(i, o)), Some(&(j, _))) if i < j => {
                    x += 1;
                    (i, o.map(|v| -v), -1)
                }
                (Some(&(i, o)), None) => {
                    x += 1;
                    (i, o.map(|v| -v), -1)
                }
                (_, Some(&(j, n))) => {
                    y += 1;
                    (j, n, 1)
                }
                (None, None) => unreachable!(),
            };
            let id = self.key_of(i, new);
            self.apply_entry(i, id, delta, dz);
        }
    }

    /// Adds `delta` to the sums of bucket `i`'s key `id` and `dz` to the number of reports that
    /// carry it (a key reaching zero goes; a missing key is created by a report that adds it).
    fn apply_entry(&mut self, i: usize, id: u32, delta: [i64; 4], dz: i32) {
        if delta == [0; 4] && dz == 0 {
            return;
        }
        let s = &mut self.buckets[i];
        let p = match s.keys.iter().position(|k| k.id == id) {
            Some(p) => p,
            None if dz <= 0 => return,
            None => {
                let name = self.keys.name(id);
                let at = s.keys.partition_point(|k| k.scope_key.as_str() < name);
                s.keys.insert(
                    at,
                    KeyState {
                        scope_key: name.to_string(),
                        id,
                        ..Default::default()
                    },
                );
                at
            }
        };
        let k = &mut s.keys[p];
        let was_busy = busy(k);
        for (sum, x) in k.sums.iter_mut().zip(delta) {
            *sum = sum.saturating_add(x);
        }
        k.zones = k.zones.saturating_add_signed(dz);
        self.changed.push((i as u32, id));
        self.frags.drop_key(i, id);
        if k.zones == 0 {
            s.keys.remove(p);
            self.busy_rows -= was_busy as usize;
        } else {
            k.offered_rps = from_units(k.sums[0]);
            k.admitted_rps = from_units(k.sums[1]);
            k.dropped_rps = from_units(k.sums[2]);
            k.shadow_dropped_rps = from_units(k.sums[3]);
            self.busy_rows = self.busy_rows + busy(k) as usize - was_busy as usize;
        }
        if !self.dirty_flag[i] {
            self.dirty_flag[i] = true;
            self.dirty.push(i);
        }
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

    /// Records a zone's report received at `now_ms`: it replaces the zone's previous report
    /// in the per-key sums, at a cost in proportion to the two reports' sizes. Unknown buckets
    /// are ignored (a client on an older config), counts go to the totals. The ratios follow
    /// at the next [`Engine::recompute`].
    ///
    /// A delta report ([`grl_wire::ReportSession`] with a base) changes only the buckets
    /// it carries, at a cost in proportion to its own size; it is applied only on top of the
    /// report it names as its base (else [`Ingested::Resync`], and nothing changes). Applying
    /// a full report and then its deltas gives the same sums as applying the full reports
    /// they stand for (`delta_reports_match_full_reports`).
    ///
    /// The report's calls count for the candidates only when it is applied: a report answered
    /// `resync` is sent again in full, calls included.
    pub fn ingest(&mut self, r: &ZoneReport, now_ms: u64) -> Ingested {
        // When the zone last reported: the time its calls cover, when the report does not
        // say (an aggregator before protocol 6).
        let prev_at = (r.calls_ms.is_none() && !r.calls.is_empty())
            .then(|| match self.zones.get(&r.aggregator_id) {
                Some(z) => Some(z.at_ms),
                None => self.forgotten.get(&r.aggregator_id).map(|f| f.0),
            })
            .flatten();
        let done = match r.session.and_then(|s| s.base.map(|b| (s.id, b, s.seq))) {
            Some((id, base, seq)) => self.ingest_delta(r, (id, base), seq, now_ms),
            None => self.ingest_full(r, now_ms),
        };
        if done == Ingested::Applied {
            self.candidate_calls(r, now_ms, prev_at);
        }
        done
    }

    /// [`Engine::ingest`] of a report without a base.
    fn ingest_full(&mut self, r: &ZoneReport, now_ms: u64) -> Ingested {
        let zone_name = self.zone_names.id(&r.zone);
        let region_key = self.keys.id(&scope_key(Scope::Region, &r.region, &r.zone));
        let zone_key = self.keys.id(&scope_key(Scope::Zone, &r.region, &r.zone));
        let mut resolved = Vec::with_capacity(r.buckets.len());
        for b in &r.buckets {
            let Some(i) = lookup(&self.index, &b.service, &b.bucket) else {
                continue;
            };
            self.count(i, zone_name, (region_key, zone_key), &b.counts);
            if b.gone || b.counts_only {
                continue;
            }
            resolved.push((i, units(b)));
        }
        // In bucket order (reports usually are), a bucket reported twice summed: the previous
        // report and this one are then walked side by side.
        if !resolved.is_sorted_by_key(|e| e.0) {
            resolved.sort_by_key(|e| e.0);
        }
        resolved.dedup_by(|b, a| {
            if a.0 == b.0 {
                for j in 0..4 {
                    a.1[j] = a.1[j].saturating_add(b.1[j]);
                }
                true
            } else {
                false
            }
        });
        // The gap since the zone's previous report (kept while it counts, remembered for a
        // while after it was forgotten) tells how often it forwards.
        let prev = match self.zones.get(&r.aggregator_id) {
            Some(old) => Some((old.at_ms, old.gap_ms)),
            None => self.forgotten.remove(&r.aggregator_id),
        };
        let mut z = ZoneData {
            region_key,
            zone_key,
            at_ms: now_ms,
            gap_ms: prev.map(|(at, gap)| crate::period::estimate(gap, now_ms.saturating_sub(at))),
            session: r.session.map(|s| (s.id, s.seq)),
            resolved,
            calls_rps: Vec::new(),
            calls_at_ms: 0,
        };
        // Keyed by aggregator: replicas serving one zone each carry part of its clients.
        let mut old = self.zones.remove(&r.aggregator_id);
        if let Some(o) = old.as_mut() {
            // Until the calls of this report replace them.
            z.calls_rps = std::mem::take(&mut o.calls_rps);
            z.calls_at_ms = o.calls_at_ms;
        }
        match old {
            Some(old) if old.region_key == z.region_key && old.zone_key == z.zone_key => {
                self.replace(&old, &z)
            }
            Some(old) => {
                self.contribute(&old, -1);
                self.contribute(&z, 1);
            }
            None => self.contribute(&z, 1),
        }
        self.zones.insert(r.aggregator_id.clone(), z);
        Ingested::Applied
    }

    /// Adds a report's counts of bucket `i` to the zone's cumulative totals, and to the counts
    /// of the bucket's scope key for the zone (`keys`: its region and zone key ids) that the
    /// next report row carries.
    fn count(&mut self, i: usize, zone_name: u32, keys: (u32, u32), c: &BucketCountsMsg) {
        if (c.offered | c.admitted | c.dropped | c.shadow_dropped) == 0 {
            return;
        }
        let id = match self.buckets[i].bucket.scope {
            Scope::Global => 0,
            Scope::Region => keys.0,
            Scope::Zone => keys.1,
        };
        let pending = &mut self.pending[i];
        if pending.is_empty() {
            self.pending_in.push(i);
        }
        let p = match pending.iter().position(|(k, _)| *k == id) {
            Some(p) => &mut pending[p].1,
            None => {
                pending.push((id, [0; 4]));
                &mut pending.last_mut().expect("just pushed").1
            }
        };
        for (sum, x) in p
            .iter_mut()
            .zip([c.offered, c.admitted, c.dropped, c.shadow_dropped])
        {
            *sum = sum.saturating_add(x);
        }
        let names = &self.zone_names;
        let totals = &mut self.totals[i];
        let t = match totals.iter().position(|(z, _)| *z == zone_name) {
            Some(p) => &mut totals[p].1,
            None => {
                // Sorted by zone name, as `/metrics` lists them.
                let at = totals.partition_point(|(z, _)| names.name(*z) < names.name(zone_name));
                totals.insert(at, (zone_name, [0; 4]));
                &mut totals[at].1
            }
        };
        // Saturating: a report with absurd counts must not wrap the totals (or, in a debug
        // build, panic with the engine lock held).
        t[0] = t[0].saturating_add(c.offered);
        t[1] = t[1].saturating_add(c.admitted);
        t[2] = t[2].saturating_add(c.dropped);
        t[3] = t[3].saturating_add(c.shadow_dropped);
    }

    /// A delta report on top of session report `base`: the buckets it carries replace (or,
    /// marked gone, leave) the zone's previous numbers; the others keep theirs.
    fn ingest_delta(
        &mut self,
        r: &ZoneReport,
        base: (u64, u64),
        seq: u64,
        now_ms: u64,
    ) -> Ingested {
        let Some((id, mut z)) = self.zones.remove_entry(&r.aggregator_id) else {
            return Ingested::Resync;
        };
        let same_place = self
            .keys
            .ids
            .get(&scope_key(Scope::Region, &r.region, &r.zone))
            == Some(&z.region_key)
            && self
                .keys
                .ids
                .get(&scope_key(Scope::Zone, &r.region, &r.zone))
                == Some(&z.zone_key);
        if z.session != Some(base) || !same_place {
            self.zones.insert(id, z);
            return Ingested::Resync;
        }
        let zone_name = self.zone_names.id(&r.zone);
        let keys = (z.region_key, z.zone_key);
        // (bucket, new rates or None when gone), in bucket order, the last of a bucket wins.
        let mut entries: Vec<(usize, Option<[i64; 4]>)> = Vec::with_capacity(r.buckets.len());
        for b in &r.buckets {
            let Some(i) = lookup(&self.index, &b.service, &b.bucket) else {
                continue;
            };
            self.count(i, zone_name, keys, &b.counts);
            if b.counts_only {
                continue;
            }
            entries.push((i, (!b.gone).then(|| units(b))));
        }
        if !entries.is_sorted_by_key(|e| e.0) {
            entries.sort_by_key(|e| e.0);
        }
        entries.reverse();
        entries.dedup_by_key(|e| e.0);
        entries.reverse();
        let mut added: Vec<(usize, [i64; 4])> = Vec::new();
        // Positions of the gone buckets (in order), taken out after the walk.
        let mut removed: Vec<usize> = Vec::new();
        for (i, new) in entries {
            let key = self.key_of(i, &z);
            match (z.resolved.binary_search_by_key(&i, |e| e.0), new) {
                (Ok(p), Some(n)) => {
                    let o = z.resolved[p].1;
                    self.apply_entry(
                        i,
                        key,
                        [n[0] - o[0], n[1] - o[1], n[2] - o[2], n[3] - o[3]],
                        0,
                    );
                    z.resolved[p].1 = n;
                }
                (Ok(p), None) => {
                    let o = z.resolved[p].1;
                    self.apply_entry(i, key, o.map(|v| -v), -1);
                    removed.push(p);
                }
                (Err(_), Some(n)) => {
                    self.apply_entry(i, key, n, 1);
                    added.push((i, n));
                }
                (Err(_), None) => {}
            }
        }
        // A bucket set that changed costs one pass over the zone's buckets (rare in a steady
        // state: a bucket starts or stops being called); rates that changed cost their own.
        if !removed.is_empty() {
            let mut next = removed.iter().copied().peekable();
            let mut at = 0;
            z.resolved.retain(|_| {
                let gone = next.peek() == Some(&at);
                if gone {
                    next.next();
                }
                at += 1;
                !gone
            });
        }
        if !added.is_empty() {
            let old = std::mem::take(&mut z.resolved);
            let mut merged = Vec::with_capacity(old.len() + added.len());
            let (mut x, mut y) = (0, 0);
            while x < old.len() || y < added.len() {
                if y == added.len() || (x < old.len() && old[x].0 < added[y].0) {
                    merged.push(old[x]);
                    x += 1;
                } else {
                    merged.push(added[y]);
                    y += 1;
                }
            }
            z.resolved = merged;
        }
        z.gap_ms = Some(crate::period::estimate(
            z.gap_ms,
            now_ms.saturating_sub(z.at_ms),
        ));
        z.at_ms = now_ms;
        z.session = Some((base.0, seq));
        self.zones.insert(id, z);
        Ingested::Applied
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
    fn global_zone_sums(&self, from_peers: bool) -> BTreeMap<usize, [i64; 4]> {
        let mut sums: BTreeMap<usize, [i64; 4]> = BTreeMap::new();
        for (id, z) in &self.zones {
            if id.starts_with(PEER_PREFIX) != from_peers {
                continue;
            }
            for &(i, r) in &z.resolved {
                if self.buckets[i].bucket.scope != Scope::Global {
                    continue;
                }
                let e = sums.entry(i).or_default();
                for j in 0..4 {
                    e[j] = e[j].saturating_add(r[j]);
                }
            }
        }
        sums
    }

    /// Cumulative counts for `/metrics`: per bucket, per zone [offered, admitted, dropped,
    /// shadow-dropped].
    pub fn totals(&self) -> impl Iterator<Item = (&BucketState, &str, &[u64; 4])> {
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
        let before = (s.limit_rps, s.fixed);
        let eff = match self.bucket_overrides.get(&i) {
            None => Effect::None,
            Some(js) => combine(js.iter().map(|&j| &self.overrides[j]), unix_now),
        };
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
        {
            self.changed.push((i as u32, ALL_KEYS));
            self.frags.drop_bucket(i);
        }
    }

    /// Directives for the clients of `zone` in `region`.
    pub fn directives_for(&self, region: &str, zone: &str) -> ZoneDirectives {
        self.directives_of(0..self.buckets.len(), region, zone)
    }

    /// The reply to a zone report that named the directives it holds (`since`: the epoch and
    /// version of an earlier reply): only the directives that changed since, when this
    /// engine's log still covers that version; every directive otherwise. The cost is in
    /// proportion to the changes since `since` (filtered to the zone's scope keys), not to the
    /// number of buckets.
    pub fn directives_since(
        &self,
        region: &str,
        zone: &str,
        since: Option<(u64, u64)>,
    ) -> ZoneDirectives {
        let (idx, session) = self.plan(region, zone, since);
        let mut d = match idx {
            None => self.directives_for(region, zone),
            Some(idx) => self.directives_of(idx.into_iter(), region, zone),
        };
        d.session = Some(session);
        d
    }

    /// The `(epoch, version)` of the directives as they are now: what a reply built now names
    /// in its session.
    pub fn directives_version(&self) -> (u64, u64) {
        (self.epoch, self.dver)
    }

    /// Which buckets a reply to `zone` holding `since` carries (None: every bucket), and the
    /// reply's session.
    fn plan(
        &self,
        region: &str,
        zone: &str,
        since: Option<(u64, u64)>,
    ) -> (Option<Vec<usize>>, ReplySession) {
        let delta =
            since.filter(|&(epoch, v)| epoch == self.epoch && v >= self.log_from && v <= self.dver);
        let idx = delta.map(|(_, v)| {
            let (region_key, zone_key) = self.zone_keys(region, zone);
            let start = self.log.partition_point(|e| e.0 <= v);
            let mut idx: Vec<usize> = self
                .log
                .range(start..)
                .filter(|&&(_, _, k)| {
                    k == ALL_KEYS || k == 0 || Some(k) == region_key || Some(k) == zone_key
                })
                .map(|&(_, i, _)| i as usize)
                .collect();
            idx.sort_unstable();
            idx.dedup();
            idx
        });
        let session = ReplySession {
            applied: None,
            resync: false,
            epoch: self.epoch,
            version: self.dver,
            delta: delta.is_some(),
        };
        (idx, session)
    }

    /// The ids of `zone`'s region and zone scope keys (None: a key never interned is carried
    /// by no bucket).
    fn zone_keys(&self, region: &str, zone: &str) -> (Option<u32>, Option<u32>) {
        let id = |scope| self.keys.ids.get(&scope_key(scope, region, zone)).copied();
        (id(Scope::Region), id(Scope::Zone))
    }

    /// What `POST /v1/aggregate` does with a zone report: ingests it, recomputes (so that the
    /// reply already includes it) and answers the zone's directives: every one to a report
    /// without a delta session (an aggregator before protocol 4, a peer controller); to a
    /// report with one, the directives changed since the ones it holds, and whether the report
    /// was applied or a full one is needed (`resync`).
    pub fn answer(&mut self, r: &ZoneReport, now_ms: u64, unix_now: u64) -> ZoneDirectives {
        let (idx, session, _) = self.answer_plan(r, now_ms, unix_now);
        let mut d = match idx {
            None => self.directives_for(&r.region, &r.zone),
            Some(idx) => self.directives_of(idx.into_iter(), &r.region, &r.zone),
        };
        d.session = session;
        d
    }

    /// [`Engine::answer`] serialized as JSON: the same bytes as `serde_json::to_vec` of its
    /// reply, built from directives serialized once per change and shared by every zone's
    /// reply (see [`Engine::directives_json`]).
    /// Also says whether the report was applied: its calls count only then (a report answered
    /// `resync` comes again in full, calls included).
    pub fn answer_json(
        &mut self,
        r: &ZoneReport,
        now_ms: u64,
        unix_now: u64,
    ) -> (Vec<u8>, Ingested) {
        let (idx, session, ingested) = self.answer_plan(r, now_ms, unix_now);
        (self.render_json(idx, &r.region, &r.zone, session), ingested)
    }

    /// [`Engine::directives_since`] serialized as JSON: the same bytes as `serde_json::to_vec`
    /// of its reply. A directive is serialized once after each change of its bucket's limit or
    /// of the zone's key (its ratio and rates) and the bytes are kept for every later reply
    /// that carries it: a change of a `global` bucket goes to every zone, so in a steady state
    /// most of each delta reply is bytes another zone's reply already built. The kept bytes
    /// are bounded (`FRAG_BYTES_PER_LOG_ENTRY` per entry of the directive log's bound; all
    /// dropped when full); a full reply keeps nothing.
    pub fn directives_json(
        &mut self,
        region: &str,
        zone: &str,
        since: Option<(u64, u64)>,
    ) -> Vec<u8> {
        let (idx, session) = self.plan(region, zone, since);
        self.render_json(idx, region, zone, Some(session))
    }

    fn answer_plan(
        &mut self,
        r: &ZoneReport,
        now_ms: u64,
        unix_now: u64,
    ) -> (Option<Vec<usize>>, Option<ReplySession>, Ingested) {
        let ingested = self.ingest(r, now_ms);
        self.recompute(now_ms, unix_now);
        let Some(sess) = r.session else {
            return (None, None, ingested);
        };
        let (idx, mut rs) = self.plan(&r.region, &r.zone, sess.directives);
        rs.resync = ingested == Ingested::Resync;
        rs.applied = (!rs.resync).then_some(sess.seq);
        (idx, Some(rs), ingested)
    }

    /// Bucket `i`'s key that `zone`'s clients run under (None: no report carries it).
    fn wanted(&self, i: usize, region_id: Option<u32>, zone_id: Option<u32>) -> Option<&KeyState> {
        let s = &self.buckets[i];
        let want = match s.bucket.scope {
            Scope::Global => Some(0),
            Scope::Region => region_id,
            Scope::Zone => zone_id,
        };
        want.and_then(|w| s.keys.iter().find(|k| k.id == w))
    }

    /// Bucket `i`'s directive under key `k`.
    fn directive(&self, i: usize, k: Option<&KeyState>) -> DirectiveMsg {
        let s = &self.buckets[i];
        DirectiveMsg {
            bucket: s.bucket.name.clone(),
            ratio: s.fixed.unwrap_or(k.map_or(0.0, |k| k.ratio)),
            fleet_offered_rps: k.map_or(0.0, |k| k.offered_rps),
            limit_rps: s.limit_rps,
            fixed: s.fixed.is_some(),
        }
    }

    /// The directives of buckets `idx` (in bucket order) for `zone` in `region`.
    fn directives_of(
        &self,
        idx: impl Iterator<Item = usize>,
        region: &str,
        zone: &str,
    ) -> ZoneDirectives {
        let (region_id, zone_id) = self.zone_keys(region, zone);
        let mut services: Vec<ServiceDirectives> = Vec::new();
        for i in idx {
            let d = self.directive(i, self.wanted(i, region_id, zone_id));
            let service = &self.buckets[i].service;
            match services.last_mut() {
                Some(sd) if &sd.service == service => sd.directives.push(d),
                _ => services.push(ServiceDirectives {
                    service: service.clone(),
                    directives: vec![d],
                }),
            }
        }
        ZoneDirectives {
            version: self.config().version.clone(),
            services,
            session: None,
        }
    }

    /// Writes what `serde_json::to_vec` makes of [`Engine::directives_of`]`(idx)` with
    /// `session` (None: every bucket), field by field in the order of [`ZoneDirectives`]; each
    /// directive's bytes come from the shared cache when a delta reply built them before.
    fn render_json(
        &mut self,
        idx: Option<Vec<usize>>,
        region: &str,
        zone: &str,
        session: Option<ReplySession>,
    ) -> Vec<u8> {
        // Serializing plain data into a Vec cannot fail.
        fn put<T: Serialize + ?Sized>(out: &mut Vec<u8>, v: &T) {
            serde_json::to_writer(&mut *out, v).expect("JSON into memory");
        }
        let (region_id, zone_id) = self.zone_keys(region, zone);
        // Only delta replies keep what they build: a full reply would flush the cache.
        let keep = idx.is_some();
        let all = idx.is_none();
        let idx = idx.unwrap_or_default();
        let n = if all { self.buckets.len() } else { idx.len() };
        let mut out = Vec::with_capacity(64 + n * 112);
        out.extend_from_slice(b"{\"version\":");
        put(&mut out, &self.config().version);
        out.extend_from_slice(b",\"services\":[");
        let mut service: Option<u32> = None;
        let mut scratch = Vec::new();
        for i in (0..n).map(|p| if all { p } else { idx[p] }) {
            let svc = self.service_of[i];
            if service != Some(svc) {
                out.extend_from_slice(if service.is_some() { b"]},{" } else { b"{" });
                out.extend_from_slice(b"\"service\":");
                put(&mut out, &self.service_names[svc as usize]);
                out.extend_from_slice(b",\"directives\":[");
                service = Some(svc);
            } else {
                out.push(b',');
            }
            let want = match self.scope_of[i] {
                Scope::Global => Some(0),
                Scope::Region => region_id,
                Scope::Zone => zone_id,
            };
            if let Some(bytes) = want.and_then(|w| self.frags.get(i, w)) {
                out.extend_from_slice(bytes);
                continue;
            }
            let k = self.wanted(i, region_id, zone_id);
            scratch.clear();
            put(&mut scratch, &self.directive(i, k));
            out.extend_from_slice(&scratch);
            // A key absent from the bucket has no change to drop its bytes: not kept.
            if let (true, Some(k)) = (keep, k) {
                let id = k.id;
                self.frags.insert(i, id, &scratch);
            }
        }
        if service.is_some() {
            out.extend_from_slice(b"]}");
        }
        out.push(b']');
        if let Some(rs) = &session {
            out.extend_from_slice(b",\"session\":");
            put(&mut out, rs);
        }
        out.push(b'}');
        out
    }

    /// Directives whose bytes are kept (tests).
    #[cfg(test)]
    pub(crate) fn cached_directives(&self) -> usize {
        self.frags.len()
    }

    /// Starts this run's report sequence after `base`. The controller passes its start time as
    /// `unix_ms << 10`, so cursors keep increasing across restarts without persisting anything
    /// (room for 1024 rows per millisecond of uptime; stays below 2^53 for JSON readers).
    pub fn set_report_seq_base(&mut self, base: u64) {
        self.seq = self.seq.max(base);
    }

    /// Appends one report row per bucket and scope key with traffic for each second since the
    /// last call, up to `unix_now` (call once per tick): a row's rates stand for one second, so
    /// a reader summing them counts requests whatever the tick. Several ticks in one second
    /// write that second once; a tick longer than a second (or a late one) writes each second
    /// it covers, at most [`MAX_REPORT_SECONDS`], with the rates in force; a clock that went
    /// back starts again at `unix_now`. Keys whose zones reported nothing but zeros are
    /// skipped so that the bounded ring holds useful rows.
    pub fn record_reports(&mut self, unix_now: u64) {
        let from = match self.reported_second {
            Some(last) if last == unix_now => return,
            Some(last) if last < unix_now => {
                (last + 1).max(unix_now.saturating_sub(MAX_REPORT_SECONDS - 1))
            }
            _ => unix_now,
        };
        // The counts go on the newest second's rows: when the ring is over its cap, the oldest
        // rows go first, and those of earlier seconds carry no counts then.
        for second in from..=unix_now {
            self.record_second(second, second == unix_now);
        }
        self.reported_second = Some(unix_now);
    }

    /// The rows of one second (see [`Engine::record_reports`]).
    fn record_second(&mut self, unix_now: u64, with_counts: bool) {
        // Rows beyond the ring's capacity would be evicted at once: their sequence numbers are
        // used up (the count of keys with traffic is kept as sums change), but only the
        // newest `report_cap` rows are built, walking back from the last bucket.
        let keep = self.busy_rows.min(self.report_cap);
        let mut rows: Vec<ReportRow> = Vec::with_capacity(keep);
        let peers = self.global_zone_sums(true);
        let pending = &mut self.pending;
        'walk: for (i, s) in self.buckets.iter().enumerate().rev() {
            for k in s.keys.iter().rev() {
                if rows.len() == keep {
                    break 'walk;
                }
                if !busy(k) {
                    continue;
                }
                let counts = if with_counts {
                    take_counts(&mut pending[i], k.id)
                } else {
                    [0; 4]
                };
                let share = own_share(i, k, &peers);
                rows.push(report_row(
                    s,
                    &k.scope_key,
                    Some(k),
                    share,
                    counts,
                    unix_now,
                ));
            }
        }
        // Counts of keys without a row yet (their rates fell to zero, or the key is gone, or
        // the ring's cap left them out): a row each, so that every counted request is in a row.
        let mut late = Vec::new();
        if with_counts {
            let mut pending_in = std::mem::take(&mut self.pending_in);
            for &i in &pending_in {
                let s = &self.buckets[i];
                // Drained in place: the bucket's list keeps its capacity for the next second.
                let mut pending = std::mem::take(&mut self.pending[i]);
                for (id, c) in pending.drain(..) {
                    let k = s.keys.iter().find(|k| k.id == id);
                    let share = k.and_then(|k| own_share(i, k, &peers));
                    late.push(report_row(s, self.keys.name(id), k, share, c, unix_now));
                }
                self.pending[i] = pending;
            }
            pending_in.clear();
            self.pending_in = pending_in;
        }
        self.seq += (self.busy_rows - keep) as u64;
        for mut row in rows.into_iter().rev().chain(late) {
            self.seq += 1;
            row.seq = self.seq;
            self.reports.push_back(row);
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
            next: next.into(),
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
