//! The controller's state machine without I/O: zone reports in, drop ratios per bucket and
//! scope key out. The HTTP controller and the simulator both drive this one type, so the
//! simulator runs the production math.

use std::collections::{BTreeMap, HashMap, VecDeque};

// Zones and their rates live in ordered maps: sums then run in one order, so the simulator's
// ratios (and so its random draws) are reproducible bit for bit.

use grl_core::control::{drop_ratio, scope_key};
use schema::{Bucket, Scope};
use serde::Serialize;

use crate::overrides::{combine, materialize, Affected, Effect, Group, Override};
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
    /// Interned ids of `region:<region>` and `zone:<zone>`.
    region_key: u32,
    zone_key: u32,
    at_ms: u64,
    /// [offered, admitted, dropped, shadow] rates (in [`RATE_UNIT`]s) by bucket index,
    /// resolved once per report (and remapped on a config change). The engine's per-key sums
    /// are the sums of these over the live zones: a report replaces its zone's previous
    /// contribution bucket by bucket.
    resolved: Vec<(usize, [i64; 4])>,
}

/// Rates are summed as integers of 1/1000 request per second: adding a zone's new report and
/// taking its previous one away is then exact, so the incremental sums never drift from the
/// sums a full pass would compute, and they do not depend on the order reports arrive in
/// (the simulator stays reproducible bit for bit).
const RATE_UNIT: f64 = 1000.0;
/// The largest rate one zone reports per bucket that is counted (2^53 units, about 9·10^12
/// requests/s): far beyond any real rate, and sums of a thousand zones stay within an i64.
const RATE_MAX: f64 = 9_007_199_254_740_992.0;

fn to_units(x: f64) -> i64 {
    // Reports are checked finite and non-negative; NaN would become 0 here all the same.
    (x * RATE_UNIT).round().clamp(0.0, RATE_MAX) as i64
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

/// Whether `key` is the scope key of `scope` in `region`/`zone` (without building it).
fn key_is(key: &str, scope: Scope, region: &str, zone: &str) -> bool {
    match scope {
        Scope::Global => key == "global",
        Scope::Region => key.strip_prefix("region:") == Some(region),
        Scope::Zone => key.strip_prefix("zone:") == Some(zone),
    }
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
    /// A zone that has not reported for this long no longer counts.
    zone_ttl_ms: u64,
    reports: VecDeque<ReportRow>,
    report_cap: usize,
    seq: u64,
    /// Cumulative counts per bucket index, per zone name id (sorted by zone name) for
    /// `/metrics`.
    totals: Vec<Vec<(u32, [u64; 4])>>,
}

impl Engine {
    /// An engine with `config`; zones silent for `zone_ttl_ms` are forgotten.
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
        self.config.as_ref().unwrap_or(&self.base)
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
        self.config = (config != self.base).then_some(config);
        // Every sum is rebuilt from the zones' reports, every ratio recomputed.
        self.dirty.clear();
        self.dirty_flag = vec![false; self.buckets.len()];
        self.all_dirty = true;
        self.busy_rows = 0;
        for z in zones.values() {
            self.contribute(z, 1);
        }
        self.zones = zones;
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
            crate::config::validate(&m.0)?;
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
            crate::config::validate(&materialize(&self.base, list).0)?;
        }
        Ok(())
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

    /// Zones (aggregators) heard from within the zone TTL at the last `ingest`/`recompute`.
    pub fn zones_reporting(&self) -> usize {
        self.zones.len()
    }

    /// Per-bucket state after the last `recompute`.
    pub fn buckets(&self) -> &[BucketState] {
        &self.buckets
    }

    /// Records a zone's report received at `now_ms`: it replaces the zone's previous report
    /// in the per-key sums, at a cost in proportion to the two reports' sizes. Unknown buckets
    /// are ignored (a client on an older config), counts go to the totals. The ratios follow
    /// at the next [`Engine::recompute`].
    pub fn ingest(&mut self, r: &ZoneReport, now_ms: u64) {
        let zone_name = self.zone_names.id(&r.zone);
        let mut resolved = Vec::with_capacity(r.buckets.len());
        for b in &r.buckets {
            let Some(i) = lookup(&self.index, &b.service, &b.bucket) else {
                continue;
            };
            let c = &b.counts;
            if (c.offered | c.admitted | c.dropped | c.shadow_dropped) > 0 {
                let names = &self.zone_names;
                let totals = &mut self.totals[i];
                let t = match totals.iter().position(|(z, _)| *z == zone_name) {
                    Some(p) => &mut totals[p].1,
                    None => {
                        // Sorted by zone name, as `/metrics` lists them.
                        let at =
                            totals.partition_point(|(z, _)| names.name(*z) < names.name(zone_name));
                        totals.insert(at, (zone_name, [0; 4]));
                        &mut totals[at].1
                    }
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
                    to_units(b.offered_rps),
                    to_units(b.admitted_rps),
                    to_units(b.dropped_rps),
                    to_units(b.shadow_dropped_rps),
                ],
            ));
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
        let z = ZoneData {
            region_key: self.keys.id(&scope_key(Scope::Region, &r.region, &r.zone)),
            zone_key: self.keys.id(&scope_key(Scope::Zone, &r.region, &r.zone)),
            at_ms: now_ms,
            resolved,
        };
        // Keyed by aggregator: replicas serving one zone each carry part of its clients.
        match self.zones.remove(&r.aggregator_id) {
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
    }

    /// This controller's own zones summed per `global` bucket, as a report for a peer
    /// controller of another region (see docs/grl-architecture.md). Data received from peers
    /// (aggregator ids starting with `region:`) is left out, so sums never echo back; counts
    /// are left at zero so that peers' `/metrics` do not count the same requests twice.
    pub fn regional_report(&self, region: &str) -> ZoneReport {
        let mut sums: BTreeMap<usize, [i64; 4]> = BTreeMap::new();
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
                    e[j] = e[j].saturating_add(r[j]);
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
                    offered_rps: from_units(r[0]),
                    admitted_rps: from_units(r[1]),
                    dropped_rps: from_units(r[2]),
                    shadow_dropped_rps: from_units(r[3]),
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
        let names = &self.zone_names;
        self.buckets
            .iter()
            .zip(&self.totals)
            .flat_map(move |(b, t)| t.iter().map(move |(z, c)| (b, names.name(*z), c)))
    }

    /// Brings the ratios up to date at `now_ms` / `unix_now`: zones silent for longer than the
    /// zone TTL are taken out of the sums, and the buckets whose sums or overrides changed since
    /// the last call (with the traffic-override groups they belong to) get their limit and
    /// ratios recomputed. Buckets nothing touched are not visited.
    pub fn recompute(&mut self, now_ms: u64, unix_now: u64) {
        let ttl = self.zone_ttl_ms;
        let expired: Vec<String> = self
            .zones
            .iter()
            .filter(|(_, z)| now_ms.saturating_sub(z.at_ms) > ttl)
            .map(|(id, _)| id.clone())
            .collect();
        for id in expired {
            if let Some(z) = self.zones.remove(&id) {
                self.contribute(&z, -1);
            }
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
    }

    /// One bucket's limit, fixed ratio and per-key ratios from its overrides and groups.
    fn settle(&mut self, i: usize, unix_now: u64) {
        let s = &mut self.buckets[i];
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
            k.ratio = s
                .fixed
                .unwrap_or_else(|| drop_ratio(k.offered_rps, s.limit_rps));
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
            version: self.config().version.clone(),
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
        // Rows beyond the ring's capacity would be evicted at once: their sequence numbers are
        // used up (the count of keys with traffic is kept as sums change), but only the
        // newest `report_cap` rows are built, walking back from the last bucket.
        let keep = self.busy_rows.min(self.report_cap);
        let mut rows: Vec<ReportRow> = Vec::with_capacity(keep);
        'walk: for s in self.buckets.iter().rev() {
            for k in s.keys.iter().rev() {
                if rows.len() == keep {
                    break 'walk;
                }
                if !busy(k) {
                    continue;
                }
                rows.push(ReportRow {
                    seq: 0,
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
        self.seq += (self.busy_rows - keep) as u64;
        for mut row in rows.into_iter().rev() {
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
