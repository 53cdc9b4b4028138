//! Unit tests of the engine (controller math), the reports and the aggregator's deltas.

use schema::{Bucket, BucketFile, Mode, PolicyName, Scope};

use crate::engine::Engine;
use crate::overrides::{Override, OverrideRequest};
use grl_wire::{BucketCountsMsg, ConfigDoc, ZoneBucketMsg, ZoneReport};

mod calls_once;
mod tiers;

pub(crate) fn bucket(name: &str, scope: Scope, limit: f64) -> Bucket {
    Bucket {
        name: name.into(),
        caller: Some(name.into()),
        procedure: None,
        scope,
        limit_rps: limit,
        mode: Mode::Enforce,
        policy: PolicyName::Manual,
    }
}

/// A zone report of `svc` buckets at the given rates (counts = the rates, no calls).
pub(crate) fn zone_report(
    agg: &str,
    region: &str,
    zone: &str,
    rates: &[(&str, f64)],
) -> ZoneReport {
    ZoneReport {
        aggregator_id: agg.into(),
        region: region.into(),
        zone: zone.into(),
        buckets: rates
            .iter()
            .map(|(b, r)| ZoneBucketMsg {
                service: "svc".into(),
                bucket: (*b).into(),
                offered_rps: *r,
                admitted_rps: *r,
                counts: BucketCountsMsg {
                    bucket: (*b).into(),
                    offered: *r as u64,
                    admitted: *r as u64,
                    ..Default::default()
                },
                ..Default::default()
            })
            .collect(),
        calls: Vec::new(),
        calls_ms: None,
        session: None,
    }
}

fn ratio_of(e: &Engine, region: &str, zone: &str, bucket: &str) -> f64 {
    e.directives_for(region, zone).services[0]
        .directives
        .iter()
        .find(|d| d.bucket == bucket)
        .unwrap()
        .ratio
}

#[test]
fn engine_computes_each_scope_from_its_zones() {
    let cfg = ConfigDoc {
        version: "v1".into(),
        services: vec![BucketFile {
            criticality: Default::default(),
            service: "svc".into(),
            buckets: vec![
                bucket("g", Scope::Global, 150.0),
                bucket("r", Scope::Region, 100.0),
                bucket("z", Scope::Zone, 50.0),
            ],
        }],
        candidates: Vec::new(),
    };
    let mut e = Engine::new(cfg, 3000);
    let all = [("g", 100.0), ("r", 100.0), ("z", 100.0)];
    e.ingest(&zone_report("a1", "r1", "z1", &all), 0);
    e.ingest(&zone_report("a2", "r1", "z2", &all), 0);
    e.ingest(
        &zone_report("a3", "r2", "z3", &[("g", 100.0), ("r", 50.0), ("z", 40.0)]),
        0,
    );
    e.recompute(0, 0);
    // global: 300 offered vs 150 → 0.5 everywhere.
    assert!((ratio_of(&e, "r1", "z1", "g") - 0.5).abs() < 1e-9);
    assert!((ratio_of(&e, "r2", "z3", "g") - 0.5).abs() < 1e-9);
    // region: r1 has 200 vs 100 → 0.5; r2 has 50 → 0.
    assert!((ratio_of(&e, "r1", "z2", "r") - 0.5).abs() < 1e-9);
    assert_eq!(ratio_of(&e, "r2", "z3", "r"), 0.0);
    // zone: 100 vs 50 → 0.5 in z1 and z2; 40 in z3 → 0.
    assert!((ratio_of(&e, "r1", "z1", "z") - 0.5).abs() < 1e-9);
    assert_eq!(ratio_of(&e, "r2", "z3", "z"), 0.0);
    // A zone silent beyond the TTL stops counting.
    e.ingest(&zone_report("a1", "r1", "z1", &all), 5000);
    e.recompute(5000, 0);
    assert_eq!(ratio_of(&e, "r1", "z1", "g"), 0.0);
    assert!(e.totals().count() >= 9);
    assert!(e.totals().all(|(_, _, t)| crate::engine::whole(t)[0] >= 40));
}

#[test]
fn engine_applies_overrides_until_they_expire() {
    let cfg = ConfigDoc {
        version: "v1".into(),
        services: vec![BucketFile {
            criticality: Default::default(),
            service: "svc".into(),
            buckets: vec![bucket("g", Scope::Global, 1000.0)],
        }],
        candidates: Vec::new(),
    };
    let mut e = Engine::new(cfg, 3000);
    e.ingest(&zone_report("a1", "r1", "z1", &[("g", 200.0)]), 0);
    let req = OverrideRequest {
        service: Some("svc".into()),
        bucket: Some("g".into()),
        caller: None,
        procedure: None,
        limit_rps: Some(100.0),
        drop_ratio: None,
        shed_below: None,
        ttl_secs: 60,
        reason: "INC-7".into(),
        who: "sre".into(),
    };
    e.set_overrides(vec![Override {
        id: "ovr-1".into(),
        req,
        created_at: 1000,
        expires_at: 1060,
        credential: None,
    }]);
    e.recompute(0, 1000);
    assert!((ratio_of(&e, "r1", "z1", "g") - 0.5).abs() < 1e-9);
    assert_eq!(e.purge_expired(1059).len(), 0);
    let gone = e.purge_expired(1060);
    assert_eq!(gone.len(), 1);
    e.recompute(0, 1060);
    assert_eq!(ratio_of(&e, "r1", "z1", "g"), 0.0);
}

#[test]
fn engine_limits_a_caller_override_as_a_whole() {
    let mut ab = bucket("a.x", Scope::Zone, 1000.0);
    ab.caller = Some("a".into());
    ab.procedure = Some("x".into());
    let cfg = ConfigDoc {
        version: "v1".into(),
        services: vec![BucketFile {
            criticality: Default::default(),
            service: "svc".into(),
            buckets: vec![ab],
        }],
        candidates: Vec::new(),
    };
    let mut e = Engine::new(cfg, 3000);
    let req = OverrideRequest {
        service: Some("svc".into()),
        bucket: None,
        caller: Some("a".into()),
        procedure: None,
        limit_rps: Some(100.0),
        drop_ratio: None,
        shed_below: None,
        ttl_secs: 60,
        reason: "INC-8".into(),
        who: "sre".into(),
    };
    e.set_overrides(vec![Override {
        id: "ovr-1".into(),
        req,
        created_at: 1000,
        expires_at: 1060,
        credential: None,
    }]);
    // The served config has the ad-hoc bucket under a new version.
    assert!(e.config().version.starts_with("v1+ovr."));
    assert_eq!(e.base_config().version, "v1");
    let affected = e.affected("ovr-1");
    assert_eq!(affected.len(), 2);
    // 150 on the caller's own procedure bucket in z1, 50 on the ad-hoc one in z2: 200 as a
    // whole against 100 → 0.5 on both, in every zone.
    e.ingest(&zone_report("a1", "r1", "z1", &[("a.x", 150.0)]), 0);
    e.ingest(
        &zone_report("a2", "r1", "z2", &[("override:ovr-1", 50.0)]),
        0,
    );
    e.recompute(0, 1000);
    for (z, b) in [("z1", "a.x"), ("z2", "override:ovr-1"), ("z3", "a.x")] {
        assert!((ratio_of(&e, "r1", z, b) - 0.5).abs() < 1e-9, "{z} {b}");
    }
    // Expired: the ad-hoc bucket is gone and the version is the pushed one again.
    assert_eq!(e.purge_expired(1060).len(), 1);
    e.recompute(0, 1060);
    assert_eq!(e.config().version, "v1");
    assert_eq!(e.bucket_count(), 1);
    assert_eq!(ratio_of(&e, "r1", "z1", "a.x"), 0.0);
}

#[test]
fn report_cursors_survive_restarts_resets_and_gaps() {
    let cfg = ConfigDoc {
        version: "v1".into(),
        services: vec![BucketFile {
            criticality: Default::default(),
            service: "svc".into(),
            buckets: vec![
                bucket("busy", Scope::Global, 100.0),
                bucket("idle", Scope::Global, 100.0),
            ],
        }],
        candidates: Vec::new(),
    };
    let run = |base: u64| {
        let mut e = Engine::new(cfg.clone(), 3000);
        e.set_report_seq_base(base);
        e.ingest(
            &zone_report("a1", "r1", "z1", &[("busy", 50.0), ("idle", 0.0)]),
            0,
        );
        e.recompute(0, 0);
        e
    };
    let mut first = run(1000 << 10);
    first.record_reports(1);
    first.record_reports(2);
    let page = first.reports_after(0, 100);
    // Only the bucket with traffic has rows.
    assert_eq!(page.reports.len(), 2);
    assert!(page.reports.iter().all(|r| r.bucket == "busy"));
    assert!(!page.reset && !page.gap);
    let cursor = page.next.seq().unwrap();
    // A restart later: the new run's rows come after the old cursor; the rows the old run
    // had not served are lost, which the page says.
    let mut second = run(2000 << 10);
    second.record_reports(3);
    let page = second.reports_after(cursor - 1, 100);
    assert_eq!(page.reports.len(), 1);
    assert!(page.reports[0].seq > cursor);
    assert!(page.gap && !page.reset);
    // Caught up: nothing, the cursor stays, no flags.
    let again = second.reports_after(page.next.seq().unwrap(), 100);
    assert!(again.reports.is_empty() && again.next == page.next && !again.gap && !again.reset);
    // A cursor beyond the newest row: answered from the oldest row kept, flagged.
    let ahead = second.reports_after(u64::MAX / 2, 100);
    assert!(ahead.reset && !ahead.gap);
    assert_eq!(ahead.reports.len(), 1);
    assert_eq!(ahead.next.seq(), Some(ahead.reports[0].seq));
    // Pages follow the cursor.
    first.record_reports(3);
    let p1 = first.reports_after(0, 2);
    let p2 = first.reports_after(p1.next.seq().unwrap(), 2);
    assert_eq!(p2.reports.len(), 1);
    assert_eq!(p2.reports[0].t, 3.into());
}

/// A row's rates stand for one second, whatever the tick: four ticks in one second write it
/// once, a two-second tick writes both seconds, a long stall at most `MAX_REPORT_SECONDS`,
/// and a clock that went back starts again. So the rows of a steady 50 rps sum to the
/// requests of the seconds they cover.
#[test]
fn report_rows_stand_for_one_second_whatever_the_tick() {
    let mut e = Engine::new(one_global_bucket(100.0), 3000);
    e.ingest(&zone_report("a1", "r1", "z1", &[("g", 50.0)]), 0);
    e.recompute(0, 0);
    let rows = |e: &Engine| e.reports_after(0, usize::MAX).reports;
    // A 250 ms tick over seconds 100 to 109: ten rows, 500 requests.
    for tick in 0..40u64 {
        e.record_reports(100 + tick / 4);
    }
    let r = rows(&e);
    assert_eq!(r.len(), 10);
    assert_eq!(r.iter().map(|x| x.offered).sum::<f64>(), 500.0);
    let seconds: Vec<f64> = r.iter().map(|x| x.t.secs().unwrap()).collect();
    assert_eq!(seconds, (100..110).map(|s| s as f64).collect::<Vec<_>>());
    // A two-second tick: both seconds.
    e.record_reports(111);
    assert_eq!(rows(&e).len(), 12);
    // A stall of a minute: the last MAX_REPORT_SECONDS seconds only.
    e.record_reports(171);
    let r = rows(&e);
    assert_eq!(r.len(), 12 + crate::engine::MAX_REPORT_SECONDS as usize);
    assert_eq!(r.last().unwrap().t.secs(), Some(171.0));
    assert_eq!(
        r[12].t.secs(),
        Some((171 + 1 - crate::engine::MAX_REPORT_SECONDS) as f64)
    );
    // The clock went back: one row at the new second.
    e.record_reports(50);
    assert_eq!(rows(&e).last().unwrap().t.secs(), Some(50.0));
    // Every counted request is in exactly one row: the report's 50 in the first one.
    let counted = |e: &Engine| -> u64 {
        rows(e)
            .iter()
            .map(|x| x.counts.as_ref().expect("rows carry counts").offered)
            .sum()
    };
    assert_eq!(counted(&e), 50);
    assert_eq!(rows(&e)[0].counts.as_ref().unwrap().offered, 50);
    // The last counts of a caller that stopped (rates zero, so no busy key): a row of their
    // own, with zero rates.
    let mut last = zone_report("a1", "r1", "z1", &[("g", 0.0)]);
    last.buckets[0].counts.offered = 7;
    last.buckets[0].counts.admitted = 7;
    e.ingest(&last, 1000);
    e.recompute(1000, 51);
    e.record_reports(51);
    let r = rows(&e);
    let tail = r.last().unwrap();
    assert_eq!(
        (tail.offered, tail.counts.as_ref().unwrap().offered),
        (0.0, 7)
    );
    assert_eq!(tail.scope_key, "global");
    assert_eq!(counted(&e), 57);
    // Nothing pending: the next second writes nothing.
    e.record_reports(52);
    assert_eq!(rows(&e).len(), r.len());
    // A tick three seconds late: three rows at the rates in force, the counts on the newest
    // one (the ring drops the oldest rows first).
    e.ingest(&zone_report("a1", "r1", "z1", &[("g", 20.0)]), 2000);
    e.recompute(2000, 52);
    e.record_reports(55);
    let r = rows(&e);
    let tail: Vec<(Option<f64>, u64)> = r[r.len() - 3..]
        .iter()
        .map(|x| (x.t.secs(), x.counts.as_ref().unwrap().offered))
        .collect();
    assert_eq!(tail, [(Some(53.0), 0), (Some(54.0), 0), (Some(55.0), 20)]);
    assert_eq!(counted(&e), 77);
}

#[test]
fn peered_regions_compute_one_global_ratio_without_echo() {
    let cfg = ConfigDoc {
        version: "v1".into(),
        services: vec![BucketFile {
            criticality: Default::default(),
            service: "svc".into(),
            buckets: vec![
                bucket("g", Scope::Global, 100.0),
                bucket("r", Scope::Region, 100.0),
            ],
        }],
        candidates: Vec::new(),
    };
    let mut east = Engine::new(cfg.clone(), 3000);
    let mut west = Engine::new(cfg, 3000);
    east.ingest(
        &zone_report("a1", "east", "e1", &[("g", 100.0), ("r", 100.0)]),
        0,
    );
    west.ingest(
        &zone_report("a2", "west", "w1", &[("g", 100.0), ("r", 150.0)]),
        0,
    );
    let (to_west, to_east) = (east.regional_report("east"), west.regional_report("west"));
    // Only global buckets cross regions.
    assert_eq!(to_west.buckets.len(), 1);
    west.ingest(&to_west, 0);
    east.ingest(&to_east, 0);
    east.recompute(0, 0);
    west.recompute(0, 0);
    // 200 offered fleet-wide against 100: both regions drop half.
    assert!((ratio_of(&east, "east", "e1", "g") - 0.5).abs() < 1e-9);
    assert!((ratio_of(&west, "west", "w1", "g") - 0.5).abs() < 1e-9);
    // Region buckets stay regional.
    assert_eq!(ratio_of(&east, "east", "e1", "r"), 0.0);
    assert!((ratio_of(&west, "west", "w1", "r") - 1.0 / 3.0).abs() < 1e-9);
    // What a region forwards never includes what its peers sent it.
    let again = east.regional_report("east");
    assert_eq!(again.buckets[0].offered_rps, 100.0);
    // Each region's report rows say how much of a global rate is its own (east 100 of 200),
    // so that a reader of both regions counts every request once; a regional key is all its
    // own and says nothing.
    east.record_reports(1);
    let rows = east.reports_after(0, 100).reports;
    let g = rows.iter().find(|r| r.bucket == "g").expect("a row for g");
    assert_eq!(g.offered, 200.0);
    assert_eq!(g.own_share, Some(0.5));
    let r = rows.iter().find(|r| r.bucket == "r").expect("a row for r");
    assert_eq!(r.own_share, None);
    let text = serde_json::to_string(r).unwrap();
    assert!(!text.contains("own_share"), "{text}");
}

#[test]
fn reporter_carries_counts_across_a_config_change() {
    use std::sync::Arc;
    use std::time::Duration;

    use grl_core::Limiter;

    use grl_client::client::Reporter;
    use grl_wire::{ClientDirectives, DirectiveMsg};

    let limiter = Arc::new(Limiter::new("svc", Duration::from_secs(3)));
    let mut rep = Reporter::new(limiter.clone(), "c1", 0);
    let v1 = BucketFile {
        criticality: Default::default(),
        service: "svc".into(),
        buckets: vec![
            bucket("a", Scope::Global, 10.0),
            bucket("b", Scope::Global, 10.0),
        ],
    };
    rep.install("svc", Some(&v1), "v1").unwrap();
    for _ in 0..5 {
        limiter.decide_at("a", "x", 0);
        limiter.decide_at("b", "x", 0);
    }
    // v2 drops bucket b and keeps a: the 5 + 5 counted under v1 are still reported.
    let v2 = BucketFile {
        criticality: Default::default(),
        service: "svc".into(),
        buckets: vec![bucket("a", Scope::Global, 10.0)],
    };
    rep.install("svc", Some(&v2), "v2").unwrap();
    limiter.decide_at("a", "x", 0);
    let r = rep.build_report(1000);
    assert_eq!(r.version, "v2");
    let get = |n: &str| r.buckets.iter().find(|b| b.bucket == n).unwrap().offered;
    assert_eq!(get("a"), 6);
    assert_eq!(get("b"), 5);
    // The next report starts from zero.
    assert!(rep.build_report(2000).buckets.is_empty());

    // Fresh directives set the ratio and the deadline; stale ones (age over the bound) do not
    // extend it.
    let d = ClientDirectives {
        version: "v2".into(),
        age_ms: Some(100),
        directives: vec![DirectiveMsg {
            bucket: "a".into(),
            ratio: 1.0,
            fleet_offered_rps: 20.0,
            limit_rps: 10.0,
            fixed: false,
            shed: None,
        }],
    };
    assert!(rep.apply(&d, 5000));
    assert_eq!(limiter.decide_at("a", "x", 5000), grl_core::Decision::Drop);
    assert_eq!(
        limiter.decide_at("a", "x", 7_900),
        grl_core::Decision::Admit
    );
    let stale = ClientDirectives {
        age_ms: Some(10_000),
        ..d
    };
    assert!(!rep.apply(&stale, 8000));
    assert_eq!(limiter.decide_at("a", "x", 8000), grl_core::Decision::Admit);
}

/// The `global` offered rate of bucket `g` the engine sums (0 without traffic).
fn global_offered(e: &Engine) -> f64 {
    e.buckets()
        .iter()
        .find(|s| s.bucket.name == "g")
        .unwrap()
        .keys
        .iter()
        .map(|k| k.offered_rps)
        .sum()
}

pub(crate) fn one_global_bucket(limit: f64) -> ConfigDoc {
    ConfigDoc {
        version: "v1".into(),
        services: vec![BucketFile {
            criticality: Default::default(),
            service: "svc".into(),
            buckets: vec![bucket("g", Scope::Global, limit)],
        }],
        candidates: Vec::new(),
    }
}

/// A controller ticking every 100 ms (TTL 300 ms), a zone forwarding every 100 ms and one
/// every second: once the engine saw the slow zone's gap, it counts the slow zone at every
/// tick in between, and the fast zone's ratio is computed with its load.
#[test]
fn engine_keeps_a_zone_forwarding_less_often_than_its_ticks() {
    let mut e = Engine::new(one_global_bucket(150.0), 300);
    let mut fast_ratios = Vec::new();
    for t in (0..=5000u64).step_by(100) {
        e.ingest(&zone_report("fast", "r1", "z1", &[("g", 100.0)]), t);
        if t % 1000 == 0 {
            e.ingest(&zone_report("slow", "r1", "z2", &[("g", 100.0)]), t);
        }
        e.recompute(t, t / 1000);
        if t < 1000 {
            // Before its second report the slow zone's interval is unknown: it counts for the
            // TTL, and then is forgotten (but remembered).
            let want = if t <= 300 { 200.0 } else { 100.0 };
            assert_eq!(global_offered(&e), want, "t = {t} ms");
            assert_eq!(e.zones_remembered(), usize::from(t > 300), "t = {t} ms");
            continue;
        }
        assert_eq!(global_offered(&e), 200.0, "t = {t} ms");
        assert_eq!(e.zones_reporting(), 2, "t = {t} ms");
        assert_eq!(e.zones_remembered(), 0, "t = {t} ms");
        fast_ratios.push(ratio_of(&e, "r1", "z1", "g"));
    }
    // 200 offered against 150: a quarter dropped at every tick, not none between forwards.
    assert!(
        fast_ratios.iter().all(|r| (r - 0.25).abs() < 1e-9),
        "{fast_ratios:?}"
    );
}

/// A zone that stops reporting is still forgotten: after three of its forwarding intervals,
/// and after three minutes at most (the interval counts up to 60 s) however rarely it
/// forwarded. Its delta reports are then answered `resync` (and change nothing).
#[test]
fn engine_forgets_a_zone_that_stops_reporting() {
    use crate::engine::Ingested;
    use grl_wire::ReportSession;

    let mut e = Engine::new(one_global_bucket(150.0), 300);
    let session = |seq: u64, base: Option<u64>| {
        Some(ReportSession {
            id: 9,
            seq,
            base,
            directives: None,
        })
    };
    // Every second, the last at 2 s (a delta on the report before it).
    let mut r = zone_report("slow", "r1", "z1", &[("g", 100.0)]);
    r.session = session(1, None);
    assert_eq!(e.ingest(&r, 0), Ingested::Applied);
    r.session = session(2, Some(1));
    assert_eq!(e.ingest(&r, 1000), Ingested::Applied);
    r.session = session(3, Some(2));
    assert_eq!(e.ingest(&r, 2000), Ingested::Applied);
    e.recompute(5000, 5);
    assert_eq!(
        global_offered(&e),
        100.0,
        "three intervals after its last report"
    );
    e.recompute(5001, 5);
    assert_eq!(global_offered(&e), 0.0, "beyond three intervals");
    assert_eq!((e.zones_reporting(), e.zones_remembered()), (0, 1));
    // A forgotten zone's delta asks for a full report; the full report learns the gap.
    r.session = session(4, Some(3));
    assert_eq!(e.ingest(&r, 6000), Ingested::Resync);
    e.recompute(6000, 6);
    assert_eq!(global_offered(&e), 0.0);
    r.session = session(5, None);
    assert_eq!(e.ingest(&r, 6010), Ingested::Applied);
    e.recompute(6010, 6);
    assert_eq!(global_offered(&e), 100.0);
    assert_eq!((e.zones_reporting(), e.zones_remembered()), (1, 0));
    // The gap since its last report was 4,010 ms: it counts 12,030 ms, then goes.
    e.recompute(18_040, 18);
    assert_eq!(global_offered(&e), 100.0);
    e.recompute(18_041, 18);
    assert_eq!(global_offered(&e), 0.0);

    // A zone forwarding every five minutes counts for three minutes after each report.
    let mut e = Engine::new(one_global_bucket(150.0), 300);
    let rare = zone_report("rare", "r1", "z1", &[("g", 100.0)]);
    e.ingest(&rare, 0);
    e.recompute(301, 0);
    assert_eq!(global_offered(&e), 0.0);
    e.ingest(&rare, 300_000);
    e.recompute(300_000 + 180_000, 480);
    assert_eq!(global_offered(&e), 100.0);
    e.recompute(300_000 + 180_001, 480);
    assert_eq!(global_offered(&e), 0.0);
}

/// The engine remembers the zones it forgot (one entry per zone, however often it expired)
/// for ten minutes after their last report, and no longer.
#[test]
fn engine_remembers_forgotten_zones_for_ten_minutes() {
    let mut e = Engine::new(one_global_bucket(150.0), 300);
    // 40 zones report once each, 10 ms apart, and expire.
    for i in 0..40u64 {
        e.ingest(
            &zone_report(&format!("a{i}"), "r1", &format!("z{i}"), &[("g", 1.0)]),
            i * 10,
        );
    }
    e.recompute(1000, 1);
    assert_eq!((e.zones_reporting(), e.zones_remembered()), (0, 40));
    // One zone comes back and expires again, twice: still one entry for it.
    for t in [100_000, 300_000] {
        e.ingest(&zone_report("a0", "r1", "z0", &[("g", 1.0)]), t);
        e.recompute(t, t / 1000);
        assert_eq!(
            (e.zones_reporting(), e.zones_remembered()),
            (1, 39),
            "t = {t} ms"
        );
        // Its gap (100 s, then 200 s) counts as 60 s: it goes three minutes after.
        e.recompute(t + 180_000, t / 1000);
        assert_eq!(e.zones_reporting(), 1, "t = {t} ms");
        e.recompute(t + 180_001, t / 1000);
        assert_eq!(
            (e.zones_reporting(), e.zones_remembered()),
            (0, 40),
            "t = {t} ms"
        );
    }
    // Ten minutes after their last report (10 to 390 ms) the others are dropped; a0's (at
    // 300 s) is kept until 900 s.
    e.recompute(600_010, 600);
    assert_eq!(e.zones_remembered(), 40);
    e.recompute(600_391, 600);
    assert_eq!(e.zones_remembered(), 1);
    e.recompute(900_000, 900);
    assert_eq!(e.zones_remembered(), 1);
    e.recompute(900_001, 900);
    assert_eq!((e.zones_reporting(), e.zones_remembered()), (0, 0));
}

/// The incremental engine computes what a full pass over the live zones' latest reports
/// computes: zones report random subsets at random rates, some fall silent and expire, a
/// bucket override starts and stops applying, the config changes once; after every recompute
/// each bucket's keys are the sums over the zones heard from within their horizon (three of
/// their forwarding intervals, at least the TTL).
#[test]
fn incremental_engine_matches_a_full_pass() {
    use std::collections::BTreeMap;

    use grl_core::control::{drop_ratio, scope_key};

    let names: Vec<String> = (0..24).map(|i| format!("b{i}")).collect();
    let cfg = |version: &str, n: usize| ConfigDoc {
        version: version.into(),
        services: vec![BucketFile {
            criticality: Default::default(),
            service: "svc".into(),
            buckets: names[..n]
                .iter()
                .enumerate()
                .map(|(i, b)| bucket(b, [Scope::Global, Scope::Region, Scope::Zone][i % 3], 700.0))
                .collect(),
        }],
        candidates: Vec::new(),
    };
    let mut e = Engine::new(cfg("v1", 24), 1000);
    let mut x: u64 = 7;
    let mut rand = move |m: u64| {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (x >> 33) % m
    };
    // aggregator → (region, zone, at_ms, [(bucket, offered)])
    type Latest = (String, String, u64, Vec<(String, f64)>);
    let mut latest: BTreeMap<String, Latest> = BTreeMap::new();
    // aggregator → (last report at_ms, forwarding interval estimate, horizon)
    let mut pace: BTreeMap<String, (u64, Option<u64>, u64)> = BTreeMap::new();
    let mut expired = 0;
    let mut n_buckets = 24;
    let mut reported: Option<u64> = None;
    for step in 0..400u64 {
        let now = step * 100;
        if step == 150 {
            // A bucket override on b0 until unix second 25.
            e.set_overrides(vec![Override {
                id: "ovr-1".into(),
                req: OverrideRequest {
                    service: Some("svc".into()),
                    bucket: Some("b0".into()),
                    caller: None,
                    procedure: None,
                    limit_rps: Some(50.0),
                    drop_ratio: None,
                    shed_below: None,
                    ttl_secs: 60,
                    reason: "test".into(),
                    who: "test".into(),
                },
                created_at: 0,
                expires_at: 25,
                credential: None,
            }]);
        }
        if step == 300 {
            // Fewer buckets: reports already in follow their bucket by name.
            n_buckets = 20;
            e.set_config(cfg("v2", 20));
        }
        // Aggregators 0..3 report often, 4..5 rarely (they expire in between).
        let a = if rand(4) == 0 { 4 + rand(2) } else { rand(4) };
        let (region, zone) = (format!("r{}", a % 2), format!("z{a}"));
        let mut rates: Vec<(String, f64)> = Vec::new();
        for b in &names {
            if rand(2) == 0 {
                rates.push((b.clone(), rand(300_000) as f64 / 1000.0));
            }
        }
        let refs: Vec<(&str, f64)> = rates.iter().map(|(b, r)| (b.as_str(), *r)).collect();
        e.ingest(
            &zone_report(&format!("agg-{a}"), &region, &zone, &refs),
            now,
        );
        latest.insert(format!("agg-{a}"), (region, zone, now, rates));
        let p = pace.entry(format!("agg-{a}")).or_insert((now, None, 1000));
        if p.0 != now {
            let gap = (now - p.0).max(p.1.map_or(0, |g| g / 2));
            *p = (now, Some(gap), (3 * gap).max(1000));
        }
        if step % 3 != 0 {
            continue;
        }
        let unix = step / 10;
        e.recompute(now, unix);
        let live = latest.len();
        latest.retain(|a, (_, _, at, _)| now - *at <= pace[a].2);
        expired += live - latest.len();
        for s in e.buckets() {
            let mut want: BTreeMap<String, f64> = BTreeMap::new();
            for (region, zone, _, rates) in latest.values() {
                for (_, r) in rates.iter().filter(|(b, _)| *b == s.bucket.name) {
                    *want
                        .entry(scope_key(s.bucket.scope, region, zone))
                        .or_default() += r;
                }
            }
            let got: BTreeMap<String, f64> = s
                .keys
                .iter()
                .map(|k| (k.scope_key.clone(), k.offered_rps))
                .collect();
            assert_eq!(
                got.keys().collect::<Vec<_>>(),
                want.keys().collect::<Vec<_>>(),
                "step {step} bucket {}",
                s.bucket.name
            );
            let limit = if s.bucket.name == "b0" && (150..250).contains(&step) {
                50.0
            } else {
                700.0
            };
            assert_eq!(s.limit_rps, limit, "step {step} bucket {}", s.bucket.name);
            for (k, w) in &want {
                assert!(
                    (got[k] - w).abs() < 1e-6,
                    "step {step} {k}: {} vs {w}",
                    got[k]
                );
                let key = s.keys.iter().find(|x| &x.scope_key == k).unwrap();
                assert_eq!(key.ratio, drop_ratio(key.offered_rps, limit));
            }
        }
        assert_eq!(e.bucket_count(), n_buckets);
        // One report row per key with traffic.
        let busy: usize = e
            .buckets()
            .iter()
            .flat_map(|s| &s.keys)
            .filter(|k| k.offered_rps != 0.0 || k.admitted_rps != 0.0)
            .count();
        let before = e.reports_after(0, usize::MAX).next.seq().unwrap();
        e.record_reports(unix);
        let page = e.reports_after(before, usize::MAX);
        // A second is written once: at the first step that records it, with the keys busy
        // then.
        let want = if reported == Some(unix) { 0 } else { busy };
        reported = Some(unix);
        let (with_rates, counts_only): (Vec<_>, Vec<_>) = page
            .reports
            .iter()
            .partition(|r| r.offered != 0.0 || r.admitted != 0.0);
        assert_eq!(with_rates.len(), want, "step {step}");
        // The others carry the counts of keys whose rates are zero now: some, never none.
        assert!(
            counts_only
                .iter()
                .all(|r| r.counts.as_ref().is_some_and(|c| *c != Default::default())),
            "step {step}: {counts_only:?}"
        );
        if want == 0 {
            assert!(counts_only.is_empty(), "step {step}");
        }
    }
    // The rare zones did fall silent beyond their horizon now and then.
    assert!(expired > 0);
}

/// Directives as a map by (service, bucket): a merged delta keeps new buckets at the end.
fn directive_map(
    d: &grl_wire::ZoneDirectives,
) -> std::collections::BTreeMap<(String, String), grl_wire::DirectiveMsg> {
    d.services
        .iter()
        .flat_map(|s| {
            s.directives
                .iter()
                .map(|x| ((s.service.clone(), x.bucket.clone()), x.clone()))
        })
        .collect()
}

#[test]
fn delta_reports_match_full_reports() {
    use std::collections::BTreeMap;

    use crate::delta::{merge_directives, DeltaOptions, Upstream};
    use grl_wire::{ZoneDirectives, PROTO_DELTA};

    let names: Vec<String> = (0..24).map(|i| format!("b{i}")).collect();
    let cfg = |version: &str, n: usize| ConfigDoc {
        version: version.into(),
        services: vec![BucketFile {
            criticality: Default::default(),
            service: "svc".into(),
            buckets: names[..n]
                .iter()
                .enumerate()
                .map(|(i, b)| bucket(b, [Scope::Global, Scope::Region, Scope::Zone][i % 3], 700.0))
                .collect(),
        }],
        candidates: Vec::new(),
    };
    // `full` ingests every report whole; `exact` gets the deltas an aggregator's `Upstream`
    // makes of the same reports with threshold 0 (and a refresh too rare to matter);
    // `coarse` gets deltas with a 5% threshold and a refresh every 4 forwards.
    let mut full = Engine::new(cfg("v1", 24), 1000);
    let mut exact = Engine::new(cfg("v1", 24), 1000);
    let mut coarse = Engine::new(cfg("v1", 24), 1000);
    let exact_opts = DeltaOptions {
        threshold: 0.0,
        refresh_ticks: 1_000_000,
    };
    let coarse_opts = DeltaOptions {
        threshold: 0.05,
        refresh_ticks: 4,
    };
    let upstream = || {
        let mut u = Upstream::default();
        u.proto = PROTO_DELTA;
        u
    };
    let mut ups: Vec<(Upstream, Upstream)> = (0..6).map(|_| (upstream(), upstream())).collect();
    // The directives each aggregator holds from `exact`.
    let mut held: Vec<ZoneDirectives> = vec![ZoneDirectives::default(); 6];
    let mut x: u64 = 11;
    let mut rand = move |m: u64| {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (x >> 33) % m
    };
    let (mut resyncs, mut delta_replies, mut sent_delta, mut sent_full) = (0, 0, 0usize, 0usize);
    // Each aggregator's buckets and rates: most stay put from one report to the next.
    let mut rates: Vec<BTreeMap<String, f64>> = vec![BTreeMap::new(); 6];
    for step in 0..600u64 {
        let now = step * 100;
        let unix = step / 10;
        if step == 150 {
            let o = vec![Override {
                id: "ovr-1".into(),
                req: OverrideRequest {
                    service: Some("svc".into()),
                    bucket: Some("b0".into()),
                    caller: None,
                    procedure: None,
                    limit_rps: Some(50.0),
                    drop_ratio: None,
                    shed_below: None,
                    ttl_secs: 60,
                    reason: "test".into(),
                    who: "test".into(),
                },
                created_at: 0,
                expires_at: 25,
                credential: None,
            }];
            for e in [&mut full, &mut exact, &mut coarse] {
                e.set_overrides(o.clone());
            }
        }
        if step == 300 {
            for e in [&mut full, &mut exact, &mut coarse] {
                e.set_config(cfg("v2", 20));
            }
        }
        if step == 450 {
            // The controllers restart: every session and directive version is unknown (the
            // full one restarts too, so that the three hold the same zones again).
            full = Engine::new(cfg("v2", 20), 1000);
            exact = Engine::new(cfg("v2", 20), 1000);
            coarse = Engine::new(cfg("v2", 20), 1000);
        }
        let a = if rand(4) == 0 { 4 + rand(2) } else { rand(4) } as usize;
        let (region, zone) = (format!("r{}", a % 2), format!("z{a}"));
        for b in &names {
            match rand(10) {
                0 => {
                    rates[a].remove(b);
                }
                1 | 2 => {
                    rates[a].insert(b.clone(), rand(300_000) as f64 / 1000.0);
                }
                3 => {
                    if let Some(r) = rates[a].get_mut(b) {
                        *r *= 1.0 + (rand(41) as f64 - 20.0) / 1000.0;
                    }
                }
                _ => {}
            }
        }
        let refs: Vec<(&str, f64)> = rates[a].iter().map(|(b, r)| (b.as_str(), *r)).collect();
        let report = zone_report(&format!("agg-{a}"), &region, &zone, &refs);
        full.ingest(&report, now);
        let (up_exact, up_coarse) = &mut ups[a];
        for (e, up, opts, held) in [
            (&mut exact, up_exact, exact_opts, Some(&mut held[a])),
            (&mut coarse, up_coarse, coarse_opts, None),
        ] {
            for attempt in 0..2 {
                let mut p = up.prepare(&report, step, opts, false);
                if p.report.session.unwrap().base.is_some() {
                    sent_delta += p.report.buckets.len();
                } else {
                    sent_full += p.report.buckets.len();
                }
                if let Some(h) = &held {
                    p.report.session.as_mut().unwrap().directives =
                        crate::delta::directives_held(h);
                }
                let reply = e.answer(&p.report, now, unix);
                let rs = reply.session.unwrap();
                up.answered(p, &reply);
                if rs.resync {
                    assert_eq!(attempt, 0, "step {step}: a full report is never refused");
                    resyncs += 1;
                    continue;
                }
                if let Some(h) = held {
                    delta_replies += rs.delta as usize;
                    merge_directives(h, reply);
                    // The merged directives are the full ones.
                    let d = e.directives_for(&region, &zone);
                    assert_eq!(
                        directive_map(h),
                        directive_map(&d),
                        "step {step} zone {zone}"
                    );
                }
                break;
            }
        }
        if step % 3 != 0 {
            continue;
        }
        for e in [&mut full, &mut exact, &mut coarse] {
            e.recompute(now, unix);
        }
        assert_eq!(full.bucket_count(), exact.bucket_count());
        for ((f, x), c) in full
            .buckets()
            .iter()
            .zip(exact.buckets())
            .zip(coarse.buckets())
        {
            // Exact deltas: the same keys, sums, limits and ratios, bit for bit.
            assert_eq!(f.limit_rps, x.limit_rps, "step {step} {}", f.bucket.name);
            assert_eq!(f.fixed, x.fixed, "step {step} {}", f.bucket.name);
            assert_eq!(f.keys, x.keys, "step {step} {}", f.bucket.name);
            // 5% deltas: each zone's rate within 5% of the larger of it and its last full
            // report, so a sum within 5% of the two sums together.
            assert_eq!(
                f.keys.iter().map(|k| &k.scope_key).collect::<Vec<_>>(),
                c.keys.iter().map(|k| &k.scope_key).collect::<Vec<_>>(),
                "step {step} {}",
                f.bucket.name
            );
            for (fk, ck) in f.keys.iter().zip(&c.keys) {
                assert!(
                    (fk.offered_rps - ck.offered_rps).abs()
                        <= 0.05 * (fk.offered_rps + ck.offered_rps) + 0.01,
                    "step {step} {} {}: {} vs {}",
                    f.bucket.name,
                    fk.scope_key,
                    fk.offered_rps,
                    ck.offered_rps
                );
            }
        }
    }
    // Every path was taken: resyncs (expired zones, the config change, the restart), delta
    // directive replies, delta and full reports (180, 582, 10,068 and 2,804 buckets when
    // written: this test changes far more buckets per report than a steady state does).
    assert!(resyncs >= 3, "{resyncs} resyncs");
    assert!(delta_replies > 100, "{delta_replies} delta replies");
    assert!(sent_delta > 0 && sent_full > 0);
}

/// The replies `POST /v1/aggregate` sends (`Engine::answer_json`, whose directives' bytes are
/// shared between zones and kept across replies) are byte for byte `serde_json` of the
/// engine's reply built from scratch, through rate changes, bucket and traffic overrides
/// (fixed ratios, limits), zones expiring, a config change and stale or foreign versions.
#[test]
fn shared_directive_bytes_are_the_replies_built_from_scratch() {
    use grl_wire::{ReportSession, ZoneDirectives};

    let names: Vec<String> = (0..30).map(|i| format!("b{i}")).collect();
    let cfg = |version: &str, n: usize| ConfigDoc {
        version: version.into(),
        services: ["svc", "tsv"]
            .iter()
            .map(|svc| BucketFile {
                criticality: Default::default(),
                service: (*svc).into(),
                buckets: names[..n]
                    .iter()
                    .enumerate()
                    .map(|(i, b)| {
                        let mut b =
                            bucket(b, [Scope::Global, Scope::Region, Scope::Zone][i % 3], 500.0);
                        b.caller = Some(format!("c{}", i % 4));
                        b
                    })
                    .collect(),
            })
            .collect(),
        candidates: Vec::new(),
    };
    let mut e = Engine::new(cfg("v1", 30), 2000);
    let mut x: u64 = 7;
    let mut rand = move |m: u64| {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (x >> 33) % m
    };
    let zones = 6;
    // The (epoch, version) each zone holds, and its session (id, last applied seq).
    let mut held: Vec<Option<(u64, u64)>> = vec![None; zones];
    let mut seqs: Vec<Option<u64>> = vec![None; zones];
    let override_of = |id: &str,
                       bucket: Option<&str>,
                       caller: Option<&str>,
                       limit: Option<f64>,
                       ratio: Option<f64>| Override {
        id: id.into(),
        req: OverrideRequest {
            service: Some("svc".into()),
            bucket: bucket.map(Into::into),
            caller: caller.map(Into::into),
            procedure: None,
            limit_rps: limit,
            drop_ratio: ratio,
            shed_below: None,
            ttl_secs: 60,
            reason: "test".into(),
            who: "test".into(),
        },
        created_at: 0,
        expires_at: 40,
        credential: None,
    };
    let (mut delta_replies, mut checked) = (0, 0);
    let mut cached_seen = 0;
    for step in 0..400u64 {
        let now = step * 100;
        let unix = step / 10;
        match step {
            60 => e.set_overrides(vec![
                override_of("ovr-1", Some("b1"), None, Some(40.0), None),
                override_of("ovr-2", Some("b2"), None, None, Some(0.3)),
            ]),
            120 => e.set_overrides(vec![
                override_of("ovr-1", Some("b1"), None, Some(40.0), None),
                override_of("ovr-3", None, Some("c1"), Some(300.0), None),
            ]),
            250 => e.set_config(cfg("v2", 24)),
            _ => {}
        }
        let a = rand(zones as u64) as usize;
        // Zone 5 falls silent for a while: it expires.
        if a == 5 && (150..200).contains(&step) {
            continue;
        }
        let (region, zone) = (format!("r{}", a % 2), format!("z{a}"));
        let mut rates: Vec<(String, f64)> = Vec::new();
        // Two passes: each bucket goes to `svc` or `tsv` below by its place in the report.
        for _ in 0..2 {
            for b in &names {
                if rand(3) == 0 {
                    rates.push((b.clone(), rand(400_000) as f64 / 1000.0));
                }
            }
        }
        let refs: Vec<(&str, f64)> = rates.iter().map(|(b, r)| (b.as_str(), *r)).collect();
        let mut report = zone_report(&format!("agg-{a}"), &region, &zone, &refs);
        for (n, b) in report.buckets.iter_mut().enumerate() {
            if n % 2 == 1 {
                b.service = "tsv".into();
            }
        }
        report
            .buckets
            .sort_by(|p, q| (&p.service, &p.bucket).cmp(&(&q.service, &q.bucket)));
        report
            .buckets
            .dedup_by(|p, q| p.service == q.service && p.bucket == q.bucket);
        // Zones 0 and 3 send no session (older aggregators), the others full or delta reports
        // (a delta on a base the engine may not hold); now and then one names a version of
        // another engine.
        let sessioned = !a.is_multiple_of(3);
        if sessioned {
            let seq = seqs[a].map_or(1, |s| s + 1);
            let named = if rand(10) == 0 { Some((1, 1)) } else { held[a] };
            report.session = Some(ReportSession {
                id: a as u64,
                seq,
                base: seqs[a].filter(|_| rand(4) != 0),
                directives: named,
            });
        }
        let (bytes, _) = e.answer_json(&report, now, unix, true);
        let got: ZoneDirectives = serde_json::from_slice(&bytes).unwrap();
        let expected = match report.session {
            None => e.directives_for(&region, &zone),
            Some(sess) => {
                let rs = got.session.unwrap();
                if rs.resync {
                    assert_eq!(rs.applied, None);
                    seqs[a] = None;
                } else {
                    assert_eq!(rs.applied, Some(sess.seq));
                    seqs[a] = Some(sess.seq);
                }
                held[a] = Some((rs.epoch, rs.version));
                delta_replies += rs.delta as usize;
                let mut d = e.directives_since(&region, &zone, sess.directives);
                let s = d.session.as_mut().unwrap();
                (s.applied, s.resync) = (rs.applied, rs.resync);
                d
            }
        };
        assert_eq!(
            String::from_utf8(bytes).unwrap(),
            String::from_utf8(serde_json::to_vec(&expected).unwrap()).unwrap(),
            "step {step} zone {zone}"
        );
        cached_seen = cached_seen.max(e.cached_directives());
        // Every zone's reply as it would be now, from whatever it holds (every other step:
        // the engine changed by two reports in between).
        for z in (0..zones).filter(|_| step % 2 == 0) {
            let (region, zone) = (format!("r{}", z % 2), format!("z{z}"));
            for since in [held[z], None, Some((1, 1))] {
                let bytes = e.directives_json(&region, &zone, since);
                let d = e.directives_since(&region, &zone, since);
                assert_eq!(
                    bytes,
                    serde_json::to_vec(&d).unwrap(),
                    "step {step} zone {zone} since {since:?}"
                );
                checked += 1;
            }
        }
        if step % 5 == 0 {
            e.recompute(now, unix);
        }
    }
    assert!(delta_replies > 50, "{delta_replies} delta replies");
    assert!(cached_seen > 0, "directive bytes were kept");
    assert!(checked > 1000);
}

/// Candidates are evaluated with the controller's formula per scope key of the candidate's
/// scope (a narrower scope regroups the in-force bucket's zones), never served, and keep their
/// counts across a push that keeps them.
#[test]
fn engine_evaluates_candidates_per_scope_key_and_never_serves_them() {
    use grl_wire::Candidate;
    let g = bucket("g", Scope::Global, 1000.0);
    let cand = |id: &str, scope: Scope, limit: f64| Candidate {
        id: id.into(),
        service: "svc".into(),
        bucket: Bucket {
            scope,
            limit_rps: limit,
            ..g.clone()
        },
    };
    let cfg = |version: &str, cands: Vec<Candidate>| ConfigDoc {
        version: version.into(),
        services: vec![BucketFile {
            criticality: Default::default(),
            service: "svc".into(),
            buckets: vec![g.clone()],
        }],
        candidates: cands,
    };
    let mut e = Engine::new(
        cfg(
            "v1",
            vec![
                cand("global-150", Scope::Global, 150.0),
                cand("region-150", Scope::Region, 150.0),
            ],
        ),
        3000,
    );
    assert!(e.config().candidates.is_empty());
    assert!(e.base_config().candidates.is_empty());
    assert_eq!(e.candidates().count(), 2);
    // 200 rps in region r1, 100 rps in r2: globally 300 rps against 150 (half dropped); per
    // region, r1's 200 against 150 (a quarter) and r2's 100 under it.
    let mut at = 0;
    let mut step = |e: &mut Engine| {
        e.ingest(&zone_report("a1", "r1", "z1", &[("g", 200.0)]), at);
        e.ingest(&zone_report("a2", "r2", "z2", &[("g", 100.0)]), at);
        e.recompute(at, at / 1000);
        e.evaluate_candidates(at, at);
        at += 1000;
    };
    for _ in 0..11 {
        step(&mut e);
    }
    let r = e.candidate_reports();
    assert_eq!(r[0].seconds, 10.0);
    assert_eq!(r[0].offered, 3000.0);
    assert!((r[0].virtual_dropped - 1500.0).abs() < 1e-6, "{:?}", r[0]);
    assert!((r[0].virtual_drop_share - 0.5).abs() < 1e-9);
    assert_eq!(r[0].in_force_limit_rps, Some(1000.0));
    assert_eq!(r[0].enforced_dropped, 0.0);
    assert!((r[1].virtual_dropped - 500.0).abs() < 1e-6, "{:?}", r[1]);
    // The real bucket drops nothing (300 rps under 1000).
    assert!(e.buckets()[0].keys.iter().all(|k| k.ratio == 0.0));
    // A new version keeping one candidate keeps its counts; the other is gone.
    e.set_config(cfg("v2", vec![cand("region-150", Scope::Region, 150.0)]));
    let r = e.candidate_reports();
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].id, "region-150");
    assert_eq!(r[0].seconds, 10.0);
    // The metrics' totals never go down.
    let totals: Vec<_> = e.candidate_totals().collect();
    assert_eq!(totals.len(), 1);
    assert!((totals[0].2[0] - 6000.0).abs() < 1e-6, "{totals:?}");
}

/// With a peer region's sums in the engine, a global candidate counts them (as the global
/// ratio does) and a region candidate regrouped from the global bucket does not.
#[test]
fn engine_candidates_count_peer_sums_for_global_scope_only() {
    use grl_wire::Candidate;
    let g = bucket("g", Scope::Global, 1000.0);
    let cand = |id: &str, scope: Scope| Candidate {
        id: id.into(),
        service: "svc".into(),
        bucket: Bucket {
            scope,
            limit_rps: 50.0,
            ..g.clone()
        },
    };
    let cfg = ConfigDoc {
        version: "v1".into(),
        services: vec![BucketFile {
            criticality: Default::default(),
            service: "svc".into(),
            buckets: vec![g.clone()],
        }],
        candidates: vec![cand("global", Scope::Global), cand("region", Scope::Region)],
    };
    let mut e = Engine::new(cfg, 3000);
    for at in [0, 1000] {
        e.ingest(&zone_report("a1", "r1", "z1", &[("g", 100.0)]), at);
        e.ingest(&zone_report("region:r9", "r9", "r9/*", &[("g", 300.0)]), at);
        e.recompute(at, at / 1000);
        e.evaluate_candidates(at, at);
    }
    let r = e.candidate_reports();
    assert_eq!(r[0].offered, 400.0, "{:?}", r[0]);
    assert_eq!(r[1].offered, 100.0, "{:?}", r[1]);
    assert!((r[1].virtual_dropped - 50.0).abs() < 1e-9, "{:?}", r[1]);
}

/// A zone's calls of (caller, procedure) for service `svc`.
fn calls(list: &[(&str, &str, u64)]) -> Vec<grl_wire::ServiceCallCountMsg> {
    list.iter()
        .map(|(c, p, n)| grl_wire::ServiceCallCountMsg {
            service: "svc".into(),
            caller: (*c).into(),
            procedure: (*p).into(),
            count: *n,
        })
        .collect()
}

/// A candidate fed by calls counts the calls of a report answered `resync` once: the
/// aggregator sends them again with the full report that follows (before: counted with
/// both).
#[test]
fn engine_counts_the_calls_of_a_resynced_report_once() {
    use crate::engine::Ingested;
    use grl_wire::{Candidate, ReportSession};
    let g = Bucket {
        caller: Some("gw".into()),
        procedure: Some("charge".into()),
        ..bucket("g", Scope::Global, 1000.0)
    };
    // Every caller of charge: not the in-force bucket's match, so fed by the calls.
    let cand = Candidate {
        id: "c".into(),
        service: "svc".into(),
        bucket: Bucket {
            caller: None,
            limit_rps: 50.0,
            ..g.clone()
        },
    };
    let cfg = |version: &str| ConfigDoc {
        version: version.into(),
        services: vec![BucketFile {
            criticality: Default::default(),
            service: "svc".into(),
            buckets: vec![g.clone()],
        }],
        candidates: vec![cand.clone()],
    };
    let mut e = Engine::new(cfg("v1"), 3000);
    let report = |seq: u64, base: Option<u64>, n: u64| ZoneReport {
        calls: calls(&[("gw", "charge", n), ("web", "charge", n)]),
        session: Some(ReportSession {
            id: 7,
            seq,
            base,
            directives: None,
        }),
        ..zone_report("a1", "r1", "z1", &[("g", 100.0)])
    };
    assert_eq!(e.ingest(&report(1, None, 0), 0), Ingested::Applied);
    e.recompute(0, 0);
    e.evaluate_candidates(0, 0);
    assert_eq!(e.ingest(&report(2, Some(1), 100), 1000), Ingested::Applied);
    // A config install: the zone's next delta is answered resync, and its calls go again
    // with the full report.
    e.set_config(cfg("v2"));
    assert_eq!(e.ingest(&report(3, Some(2), 100), 2000), Ingested::Resync);
    assert_eq!(e.ingest(&report(4, None, 100), 2000), Ingested::Applied);
    e.recompute(2000, 2);
    e.evaluate_candidates(2000, 2000);
    let r = e.candidate_reports();
    assert_eq!(r[0].offered, 400.0, "{:?}", r[0]);
}

/// A controller in `state_dir` taking anonymous zone reports, ticking every 50 ms, its API
/// guarded by `token`.
pub(crate) async fn anonymous_controller(
    state_dir: std::path::PathBuf,
    token: &str,
) -> grl_server::http_util::ServerHandle {
    crate::controller::Controller::start(crate::controller::ControllerOptions {
        state_dir,
        token: token.into(),
        allow_anonymous_reports: true,
        tick: std::time::Duration::from_millis(50),
        ..Default::default()
    })
    .await
    .unwrap()
}

/// Serves `app` on a free loopback port: its URL and the server's task.
pub(crate) async fn serve_on_free_port(app: axum::Router) -> (String, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let server = tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    (url, server)
}

/// A config of service `svc` with bucket `g` (global, 1,000 rps, caller `gw`, procedure
/// `charge`) and candidate `c`: `g` for every caller at 100 rps, judged on calls.
fn calls_candidate_cfg() -> ConfigDoc {
    use grl_wire::Candidate;
    let g = Bucket {
        caller: Some("gw".into()),
        procedure: Some("charge".into()),
        ..bucket("g", Scope::Global, 1000.0)
    };
    let cand = Candidate {
        id: "c".into(),
        service: "svc".into(),
        bucket: Bucket {
            caller: None,
            limit_rps: 100.0,
            ..g.clone()
        },
    };
    ConfigDoc {
        version: "v1".into(),
        services: vec![BucketFile {
            criticality: Default::default(),
            service: "svc".into(),
            buckets: vec![g.clone()],
        }],
        candidates: vec![cand],
    }
}

/// A candidate fed by calls is judged at the rate those calls were made at, over the time they
/// cover, summed over the zones: two zones at 60 calls/s each forward every second, half a
/// second apart, to a controller ticking every 100 ms, so most ticks bring one zone's second
/// of calls (before: judged as 600 rps against the candidate's 100, a virtual-drop share of
/// 5/6 for a fleet at 120 rps, whose share is 1/6); then one zone's forwards fail for three
/// seconds and its four seconds of calls arrive in one tick, still at 60 calls/s.
#[test]
fn engine_rates_candidate_calls_over_the_time_they_cover() {
    let cfg = calls_candidate_cfg();
    // A zone TTL of 10 s: the silent zone's last rate still counts while it is held back.
    let mut e = Engine::new(cfg, 10_000);
    let report = |agg: &str, zone: &str, n: u64| ZoneReport {
        calls: calls(&[("web", "charge", n)]),
        ..zone_report(agg, "r1", zone, &[("g", 60.0)])
    };
    let (mut before, mut sent) = (None, 0);
    for t in (0..=20_000u64).step_by(100) {
        let mut n = 0;
        if t % 1000 == 0 {
            e.ingest(&report("a1", "z1", 60), t);
            n += 60;
        }
        // a2's forwards of 11.5 s to 13.5 s fail; the one of 14.5 s carries their calls.
        if t % 1000 == 500 && !(11_500..14_500).contains(&t) {
            let held = if t == 14_500 { 240 } else { 60 };
            e.ingest(&report("a2", "z2", held), t);
            n += held;
        }
        e.recompute(t, t / 1000);
        e.evaluate_candidates(t, t);
        if t == 2000 {
            before = Some(e.candidate_reports()[0].clone());
        } else if t > 2000 {
            sent += n;
        }
    }
    let (b, r) = (before.unwrap(), e.candidate_reports()[0].clone());
    let offered = r.offered - b.offered;
    let share = (r.virtual_dropped - b.virtual_dropped) / offered;
    assert_eq!(offered, sent as f64, "{r:?}");
    assert!((share - 1.0 / 6.0).abs() < 1e-9, "share {share}: {r:?}");
}

/// The time a report says its calls cover (`calls_ms`) is the one they are rated over: the
/// first report a restarted controller gets carries five seconds of calls (the engine knows
/// no previous report of the zone), and a later one two seconds of calls a second after the
/// zone's previous report (held back by a failed forward). At 80 calls/s against a
/// candidate of 100 rps, none is a virtual drop.
#[test]
fn engine_rates_candidate_calls_over_the_time_the_report_says() {
    let cfg = calls_candidate_cfg();
    let mut e = Engine::new(cfg, 3000);
    let report = |n: u64, ms: u64| ZoneReport {
        calls: calls(&[("web", "charge", n)]),
        calls_ms: Some(ms),
        ..zone_report("a1", "r1", "z1", &[("g", 80.0)])
    };
    e.evaluate_candidates(0, 0);
    let step = |e: &mut Engine, t: u64, r: Option<ZoneReport>| {
        if let Some(r) = r {
            e.ingest(&r, t);
        }
        e.recompute(t, t / 1000);
        e.evaluate_candidates(t, t);
    };
    step(&mut e, 100, Some(report(400, 5000)));
    step(&mut e, 1100, Some(report(80, 1000)));
    step(&mut e, 2100, Some(report(160, 2000)));
    step(&mut e, 2200, None);
    let r = &e.candidate_reports()[0];
    assert_eq!(r.offered, 640.0, "{r:?}");
    assert_eq!(r.virtual_dropped, 0.0, "{r:?}");
}

/// A zone's rate of calls counts within its horizon of the last report that set it: a zone
/// whose calls go to another controller replica (its reports here carry rates only) stops
/// counting in the rate other zones' calls are judged at.
#[test]
fn engine_forgets_a_zone_call_rate_no_report_renews() {
    let cfg = calls_candidate_cfg();
    let mut e = Engine::new(cfg, 3000);
    let report = |agg: &str, zone: &str, n: Option<u64>| ZoneReport {
        calls: n.map_or(Vec::new(), |n| calls(&[("web", "charge", n)])),
        calls_ms: n.map(|_| 1000),
        ..zone_report(agg, "r1", zone, &[("g", 60.0)])
    };
    let mut at5 = None;
    for t in (0..=10_000u64).step_by(1000) {
        e.ingest(&report("a1", "z1", Some(60)), t);
        e.ingest(&report("a2", "z2", (t <= 1000).then_some(60)), t);
        e.recompute(t, t / 1000);
        e.evaluate_candidates(t, t);
        if t == 1000 {
            // Both zones' calls, at 120 calls/s: a sixth over the candidate.
            let r = &e.candidate_reports()[0];
            assert!((r.virtual_dropped - 20.0).abs() < 1e-9, "{r:?}");
        }
        if t == 5000 {
            at5 = Some(e.candidate_reports()[0].virtual_dropped);
        }
    }
    let r = &e.candidate_reports()[0];
    assert_eq!(r.virtual_dropped, at5.unwrap(), "{r:?}");
}

/// A push that adds a candidate before one being evaluated keeps each zone's rate of calls
/// with its own candidate.
#[test]
fn engine_keeps_zone_call_rates_with_their_candidate_across_a_push() {
    use grl_wire::Candidate;
    let g = Bucket {
        caller: Some("gw".into()),
        procedure: Some("charge".into()),
        ..bucket("g", Scope::Global, 1000.0)
    };
    let cand = |id: &str, procedure: &str| Candidate {
        id: id.into(),
        service: "svc".into(),
        bucket: Bucket {
            caller: None,
            procedure: Some(procedure.into()),
            limit_rps: 100.0,
            ..g.clone()
        },
    };
    let cfg = |version: &str, candidates: Vec<Candidate>| ConfigDoc {
        version: version.into(),
        services: vec![BucketFile {
            criticality: Default::default(),
            service: "svc".into(),
            buckets: vec![g.clone()],
        }],
        candidates,
    };
    let mut e = Engine::new(cfg("v1", vec![cand("c", "charge")]), 3000);
    let report = |agg: &str, zone: &str| ZoneReport {
        calls: calls(&[("web", "charge", 60)]),
        calls_ms: Some(1000),
        ..zone_report(agg, "r1", zone, &[("g", 60.0)])
    };
    e.evaluate_candidates(0, 0);
    e.ingest(&report("a1", "z1"), 500);
    e.ingest(&report("a2", "z2"), 1000);
    e.recompute(1000, 1);
    e.evaluate_candidates(1000, 1000);
    let before = e.candidate_reports()[0].virtual_dropped;
    e.set_config(cfg(
        "v2",
        vec![cand("other", "refund"), cand("c", "charge")],
    ));
    // a1's calls are judged at both zones' 120 calls/s: a sixth over the candidate.
    e.ingest(&report("a1", "z1"), 1500);
    e.recompute(1500, 1);
    e.evaluate_candidates(1500, 1500);
    let r = &e.candidate_reports()[1];
    assert_eq!(r.id, "c");
    assert!((r.virtual_dropped - before - 10.0).abs() < 1e-9, "{r:?}");
}
