//! The directives a zone is answered: planned per zone from the keys it holds, rendered as
//! JSON from cached fragments.

use super::*;
use grl_core::criticality::TierShed;

impl Engine {
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
    pub(super) fn plan(
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
    pub(super) fn zone_keys(&self, region: &str, zone: &str) -> (Option<u32>, Option<u32>) {
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
    /// `tiers`: the aggregator reads the directives' tier splits (protocol 8); an older one
    /// is sent none (it refuses the field).
    pub fn answer_json(
        &mut self,
        r: &ZoneReport,
        now_ms: u64,
        unix_now: u64,
        tiers: bool,
    ) -> (Vec<u8>, Ingested) {
        let (idx, session, ingested) = self.answer_plan(r, now_ms, unix_now);
        (
            self.render_json(idx, &r.region, &r.zone, session, tiers),
            ingested,
        )
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
        self.render_json(idx, region, zone, Some(session), true)
    }

    pub(super) fn answer_plan(
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
    pub(super) fn wanted(
        &self,
        i: usize,
        region_id: Option<u32>,
        zone_id: Option<u32>,
    ) -> Option<&KeyState> {
        let s = &self.buckets[i];
        let want = match s.bucket.scope {
            Scope::Global => Some(0),
            Scope::Region => region_id,
            Scope::Zone => zone_id,
        };
        want.and_then(|w| s.keys.iter().find(|k| k.id == w))
    }

    /// Bucket `i`'s directive under key `k`. With the key's mix of tiers known, the shed
    /// (`ratio` × offered) is split strictly over the tiers, least critical first; an
    /// override's fixed ratio, or a key whose mix is not known, drops every tier alike. A
    /// `shed_below` override's floor drops every tier below it on top: with the mix known the
    /// sent ratio is what the split and the floor shed together (clients of the previous
    /// protocol drop that share alike); without it, the floor tier drops the bucket's ratio
    /// and the tiers above it drop nothing.
    pub(super) fn directive(&self, i: usize, k: Option<&KeyState>) -> DirectiveMsg {
        let s = &self.buckets[i];
        let mut ratio = s.fixed.unwrap_or(k.map_or(0.0, |k| k.ratio));
        let split = match (s.fixed, k) {
            // Sent at a ratio of 0 too: it tells the clients the tiers are in force, so a
            // ratio one raises on its own before the next directive is split as well.
            (None, Some(k)) => k
                .tier_offered_rps
                .map(|t| (grl_core::criticality::split(ratio * k.offered_rps, t), t)),
            _ => None,
        };
        let shed = match (split, s.floor) {
            (Some((sh, _)), None) => Some(sh),
            (Some((sh, t)), Some(b)) => {
                let sh = sh.max(TierShed {
                    threshold: b,
                    fraction: 0.0,
                });
                let offered: f64 = t.iter().sum();
                if offered > 0.0 {
                    ratio = (sh.dropped(t) / offered).clamp(0.0, 1.0);
                }
                Some(sh)
            }
            (None, Some(b)) => Some(TierShed {
                threshold: b,
                fraction: ratio,
            }),
            (None, None) => None,
        };
        DirectiveMsg {
            bucket: s.bucket.name.clone(),
            ratio,
            fleet_offered_rps: k.map_or(0.0, |k| k.offered_rps),
            limit_rps: s.limit_rps,
            fixed: s.fixed.is_some(),
            shed: shed.map(|sh| grl_wire::TierShedMsg {
                threshold: sh.threshold,
                fraction: sh.fraction,
            }),
        }
    }

    /// The directives of buckets `idx` (in bucket order) for `zone` in `region`.
    pub(super) fn directives_of(
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
    pub(super) fn render_json(
        &mut self,
        idx: Option<Vec<usize>>,
        region: &str,
        zone: &str,
        session: Option<ReplySession>,
        tiers: bool,
    ) -> Vec<u8> {
        // Serializing plain data into a Vec cannot fail.
        fn put<T: Serialize + ?Sized>(out: &mut Vec<u8>, v: &T) {
            serde_json::to_writer(&mut *out, v).expect("JSON into memory");
        }
        let (region_id, zone_id) = self.zone_keys(region, zone);
        // Only delta replies keep what they build: a full reply would flush the cache. The
        // cache holds the directives as protocol 8 reads them: a reply without tier splits
        // builds its own.
        let keep = idx.is_some() && tiers;
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
            if let Some(bytes) = want.filter(|_| tiers).and_then(|w| self.frags.get(i, w)) {
                out.extend_from_slice(bytes);
                continue;
            }
            let k = self.wanted(i, region_id, zone_id);
            scratch.clear();
            let mut d = self.directive(i, k);
            if !tiers {
                d.shed = None;
            }
            put(&mut scratch, &d);
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
}
