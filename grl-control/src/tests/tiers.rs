//! The controller's split of a bucket's shed over criticality tiers.

use schema::Criticality;

use super::{one_global_bucket as one_global, zone_report};
use crate::engine::Engine;
use crate::overrides::{Override, OverrideRequest};
use grl_wire::{TierShedMsg, ZoneDirectives};

/// A zone report of bucket `g` at `offered` with the zone's offered rate by tier (None: an
/// aggregator that sends no tiers).
fn report(zone: &str, offered: f64, tiers: Option<[f64; 4]>) -> grl_wire::ZoneReport {
    let mut r = zone_report(zone, "r1", zone, &[("g", offered)]);
    r.buckets[0].tier_offered_rps = tiers;
    r
}

fn shed_of(e: &Engine, zone: &str) -> (f64, Option<TierShedMsg>) {
    let d = &e.directives_for("r1", zone).services[0].directives[0];
    (d.ratio, d.shed)
}

/// 300 rps (120 CRITICAL, 180 SHEDDABLE over two zones) at a limit of 200: the third to
/// shed falls on SHEDDABLE alone, the same split in every zone.
#[test]
fn a_known_mix_sheds_the_least_critical_tier_first() {
    let mut e = Engine::new(one_global(200.0), 3000);
    e.ingest(&report("z1", 200.0, Some([120.0, 0.0, 80.0, 0.0])), 0);
    e.ingest(&report("z2", 100.0, Some([60.0, 0.0, 40.0, 0.0])), 0);
    e.recompute(0, 0);
    for zone in ["z1", "z2"] {
        let (ratio, shed) = shed_of(&e, zone);
        assert!((ratio - 1.0 / 3.0).abs() < 1e-9);
        let shed = shed.expect("a split");
        assert_eq!(shed.threshold, Criticality::Sheddable);
        assert!((shed.fraction - 100.0 / 180.0).abs() < 1e-9, "{shed:?}");
    }
    // Under the limit: nothing shed, but the split says the tiers are in force.
    e.ingest(&report("z1", 50.0, Some([30.0, 0.0, 20.0, 0.0])), 1);
    e.ingest(&report("z2", 50.0, Some([30.0, 0.0, 20.0, 0.0])), 1);
    e.recompute(1, 0);
    let (ratio, shed) = shed_of(&e, "z1");
    assert_eq!(ratio, 0.0);
    assert_eq!(shed.map(|s| s.fraction), Some(0.0));
}

/// A zone with traffic but no mix of tiers (an older aggregator) makes the mix unknown: the
/// uniform ratio, never a split computed from part of the fleet. Once that zone's report is
/// taken away, the split comes back.
#[test]
fn a_zone_without_tiers_falls_back_to_the_uniform_ratio() {
    let mut e = Engine::new(one_global(200.0), 3000);
    e.ingest(&report("z1", 200.0, Some([120.0, 0.0, 80.0, 0.0])), 0);
    e.ingest(&report("z2", 100.0, None), 0);
    e.recompute(0, 0);
    let (ratio, shed) = shed_of(&e, "z1");
    assert!((ratio - 1.0 / 3.0).abs() < 1e-9);
    assert_eq!(shed, None);
    // z2 now reports tiers too (a mix whose tiers sum to more than its total is scaled to
    // it: 100 rps, a third of it CRITICAL).
    e.ingest(&report("z2", 100.0, Some([200.0, 0.0, 100.0, 0.0])), 1);
    e.recompute(1, 0);
    let shed = shed_of(&e, "z2").1.expect("a split");
    assert_eq!(shed.threshold, Criticality::Sheddable);
    // 100 rps to shed of 120 + 66.7 SHEDDABLE.
    assert!(
        (shed.fraction - 100.0 / (120.0 + 200.0 / 3.0)).abs() < 1e-6,
        "{shed:?}"
    );
}

/// An override's fixed ratio drops every tier alike; an aggregator before protocol 8 gets
/// no split in its JSON reply.
#[test]
fn fixed_ratios_and_older_aggregators_get_no_split() {
    let mut e = Engine::new(one_global(200.0), 3000);
    e.ingest(&report("z1", 300.0, Some([180.0, 0.0, 120.0, 0.0])), 0);
    e.recompute(0, 0);
    let json = |e: &mut Engine, tiers: bool| {
        let (bytes, _) = e.answer_json(
            &report("z1", 300.0, Some([180.0, 0.0, 120.0, 0.0])),
            0,
            0,
            tiers,
        );
        let d: ZoneDirectives = serde_json::from_slice(&bytes).unwrap();
        (
            String::from_utf8(bytes).unwrap(),
            d.services[0].directives[0].shed,
        )
    };
    let (text, shed) = json(&mut e, true);
    assert!(shed.is_some(), "{text}");
    let (text, shed) = json(&mut e, false);
    assert!(shed.is_none() && !text.contains("shed"), "{text}");
    e.set_overrides(vec![Override {
        id: "ovr-1".into(),
        req: OverrideRequest {
            service: Some("svc".into()),
            bucket: Some("g".into()),
            caller: None,
            procedure: None,
            limit_rps: None,
            drop_ratio: Some(0.5),
            ttl_secs: 60,
            reason: "incident".into(),
            who: "sre".into(),
        },
        created_at: 0,
        expires_at: 3600,
        credential: None,
    }]);
    e.recompute(1, 0);
    assert_eq!(shed_of(&e, "z1"), (0.5, None));
}
