//! Zone reports into the engine's sums: a full report replaces its zone's data, a delta
//! changes only what it names, and every change moves the buckets' sums exactly.

use super::*;

impl Engine {
    /// Adds (`sign` 1) or takes away (`sign` -1) a zone's report from the per-key sums of the
    /// buckets it carries, and marks them dirty. A key no live report carries any more goes.
    pub(super) fn contribute(&mut self, z: &ZoneData, sign: i64) {
        for &(i, r) in &z.resolved {
            let id = self.key_of(i, z);
            self.apply_entry(i, id, r.map(|x| sign * x), sign as i32);
        }
    }

    /// The scope key id of bucket `i` for zone `z`.
    pub(super) fn key_of(&self, i: usize, z: &ZoneData) -> u32 {
        match self.buckets[i].bucket.scope {
            Scope::Global => 0,
            Scope::Region => z.region_key,
            Scope::Zone => z.zone_key,
        }
    }

    /// Replaces zone report `old` by `new` (same region and zone), walking both in bucket
    /// order: a bucket in both gets the difference, and is marked dirty only if it changed.
    pub(super) fn replace(&mut self, old: &ZoneData, new: &ZoneData) {
        let (a, b) = (&old.resolved, &new.resolved);
        let (mut x, mut y) = (0, 0);
        while x < a.len() || y < b.len() {
            let (i, delta, dz) = match (a.get(x), b.get(y)) {
                (Some(&(i, o)), Some(&(j, n))) if i == j => {
                    x += 1;
                    y += 1;
                    (i, std::array::from_fn(|j| n[j] - o[j]), 0)
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
    pub(super) fn apply_entry(&mut self, i: usize, id: u32, delta: Units, dz: i32) {
        if delta == [0; 9] && dz == 0 {
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
            k.tier_offered_rps = tier_offered(&k.sums);
            self.busy_rows = self.busy_rows + busy(k) as usize - was_busy as usize;
        }
        if !self.dirty_flag[i] {
            self.dirty_flag[i] = true;
            self.dirty.push(i);
        }
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
    pub(super) fn ingest_full(&mut self, r: &ZoneReport, now_ms: u64) -> Ingested {
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
    pub(super) fn count(
        &mut self,
        i: usize,
        zone_name: u32,
        keys: (u32, u32),
        c: &BucketCountsMsg,
    ) {
        if (c.offered | c.admitted | c.dropped | c.shadow_dropped) == 0 {
            return;
        }
        let id = match self.buckets[i].bucket.scope {
            Scope::Global => 0,
            Scope::Region => keys.0,
            Scope::Zone => keys.1,
        };
        let split = c.by_tier();
        let pending = &mut self.pending[i];
        if pending.is_empty() {
            self.pending_in.push(i);
        }
        let p = match pending.iter().position(|(k, _)| *k == id) {
            Some(p) => &mut pending[p].1,
            None => {
                pending.push((id, Split::default()));
                &mut pending.last_mut().expect("just pushed").1
            }
        };
        add_split(p, &split);
        let names = &self.zone_names;
        let totals = &mut self.totals[i];
        let t = match totals.iter().position(|(z, _)| *z == zone_name) {
            Some(p) => &mut totals[p].1,
            None => {
                // Sorted by zone name, as `/metrics` lists them.
                let at = totals.partition_point(|(z, _)| names.name(*z) < names.name(zone_name));
                totals.insert(at, (zone_name, Split::default()));
                &mut totals[at].1
            }
        };
        add_split(t, &split);
    }

    /// A delta report on top of session report `base`: the buckets it carries replace (or,
    /// marked gone, leave) the zone's previous numbers; the others keep theirs.
    pub(super) fn ingest_delta(
        &mut self,
        r: &ZoneReport,
        base: (u64, u64),
        seq: u64,
        now_ms: u64,
    ) -> Ingested {
        let Some((id, mut z)) = self.zones.remove_entry(&r.aggregator_id) else {
            return Ingested::Resync;
        };
        if z.session != Some(base) || !self.same_place(r, &z) {
            self.zones.insert(id, z);
            return Ingested::Resync;
        }
        let entries = self.delta_entries(r, &z);
        self.apply_delta(&mut z, entries);
        z.gap_ms = Some(crate::period::estimate(
            z.gap_ms,
            now_ms.saturating_sub(z.at_ms),
        ));
        z.at_ms = now_ms;
        z.session = Some((base.0, seq));
        self.zones.insert(id, z);
        Ingested::Applied
    }

    /// Whether report `r` comes from the region and zone of zone data `z` (same scope keys).
    fn same_place(&self, r: &ZoneReport, z: &ZoneData) -> bool {
        let ids = &self.keys.ids;
        ids.get(&scope_key(Scope::Region, &r.region, &r.zone)) == Some(&z.region_key)
            && ids.get(&scope_key(Scope::Zone, &r.region, &r.zone)) == Some(&z.zone_key)
    }

    /// Counts delta report `r`'s counts (see [`Engine::count`]) and returns its rates as
    /// (bucket, new rates or `None` when gone), in bucket order, the last of a bucket winning.
    fn delta_entries(&mut self, r: &ZoneReport, z: &ZoneData) -> Vec<(usize, Option<Units>)> {
        let zone_name = self.zone_names.id(&r.zone);
        let keys = (z.region_key, z.zone_key);
        let mut entries: Vec<(usize, Option<Units>)> = Vec::with_capacity(r.buckets.len());
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
        entries
    }

    /// Applies a delta's `entries` (in bucket order) to the sums and to zone `z`'s rates.
    fn apply_delta(&mut self, z: &mut ZoneData, entries: Vec<(usize, Option<Units>)>) {
        let mut added: Vec<(usize, Units)> = Vec::new();
        // Positions of the gone buckets (in order), taken out after the walk.
        let mut removed: Vec<usize> = Vec::new();
        for (i, new) in entries {
            let key = self.key_of(i, z);
            match (z.resolved.binary_search_by_key(&i, |e| e.0), new) {
                (Ok(p), Some(n)) => {
                    let o = z.resolved[p].1;
                    self.apply_entry(i, key, std::array::from_fn(|j| n[j] - o[j]), 0);
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
            remove_positions(&mut z.resolved, &removed);
        }
        if !added.is_empty() {
            z.resolved = merge_by_bucket(std::mem::take(&mut z.resolved), &added);
        }
    }
}

/// Takes the entries at `positions` (ascending) out of `resolved`.
fn remove_positions(resolved: &mut Vec<(usize, Units)>, positions: &[usize]) {
    let mut next = positions.iter().copied().peekable();
    let mut at = 0;
    resolved.retain(|_| {
        let gone = next.peek() == Some(&at);
        if gone {
            next.next();
        }
        at += 1;
        !gone
    });
}

/// `old` and `added` (both in bucket order, no bucket in both) merged in bucket order.
fn merge_by_bucket(old: Vec<(usize, Units)>, added: &[(usize, Units)]) -> Vec<(usize, Units)> {
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
    merged
}

/// Adds `x` to `sum`, saturating: a report with absurd counts must not wrap the totals (or,
/// in a debug build, panic with the engine lock held).
fn add_split(sum: &mut Split, x: &Split) {
    for (s, x) in sum.iter_mut().flatten().zip(x.iter().flatten()) {
        *s = s.saturating_add(*x);
    }
}
