//! The reporter with criticality tiers: counts by tier in its reports, a directive's split
//! applied per tier, and a ratio the client raises on its own split over its own mix.

use std::sync::Arc;
use std::time::Duration;

use grl_client::client::Reporter;
use grl_core::{Decision, Limiter};
use grl_wire::{ClientDirectives, DirectiveMsg, TierShedMsg};
use schema::{Bucket, BucketFile, Criticality, Mode, PolicyName, Scope};

fn setup() -> (Arc<Limiter>, Reporter) {
    let limiter = Arc::new(Limiter::new("svc", Duration::from_secs(3)));
    let mut rep = Reporter::new(limiter.clone(), "c1", 0);
    let file = BucketFile {
        criticality: Default::default(),
        service: "svc".into(),
        buckets: vec![Bucket {
            name: "gw".into(),
            caller: Some("gw".into()),
            procedure: None,
            scope: Scope::Global,
            limit_rps: 200.0,
            mode: Mode::Enforce,
            policy: PolicyName::Manual,
        }],
    };
    rep.install("svc", Some(&file), "v1").unwrap();
    (limiter, rep)
}

/// `n` requests of `tier` at `now_ms`: how many were dropped.
fn offer(l: &Limiter, tier: Criticality, n: u32, now_ms: u64) -> u32 {
    (0..n)
        .filter(|_| l.decide_tier_at("gw", "x", tier, now_ms) == Decision::Drop)
        .count() as u32
}

fn directive(ratio: f64, shed: Option<TierShedMsg>) -> ClientDirectives {
    ClientDirectives {
        version: "v1".into(),
        age_ms: Some(0),
        directives: vec![DirectiveMsg {
            bucket: "gw".into(),
            ratio,
            fleet_offered_rps: 300.0,
            limit_rps: 200.0,
            fixed: false,
            shed,
        }],
    }
}

#[test]
fn reports_count_tiers_and_a_split_spares_critical_traffic() {
    let (l, mut rep) = setup();
    // One second: 60 CRITICAL (30 with no tier at all), 90 SHEDDABLE.
    offer(&l, Criticality::Critical, 30, 0);
    for _ in 0..30 {
        l.decide_at("gw", "x", 0);
    }
    offer(&l, Criticality::Sheddable, 90, 0);
    let r = rep.build_report(1000);
    let b = &r.buckets[0];
    assert_eq!(b.offered, 150);
    assert_eq!(b.tier_offered(), Some([90, 0, 60, 0]));

    // The controller's split: a third of 300 rps shed, all of it SHEDDABLE.
    let shed = TierShedMsg {
        threshold: Criticality::Sheddable,
        fraction: 100.0 / 180.0,
    };
    assert!(rep.apply(&directive(1.0 / 3.0, Some(shed)), 1000));
    assert_eq!(offer(&l, Criticality::Critical, 600, 1100), 0);
    let d = offer(&l, Criticality::Sheddable, 900, 1100);
    assert!((d as f64 - 500.0).abs() <= 2.0, "{d}");

    // Without a split (an older controller, or a mix it does not know): every tier pays.
    assert!(rep.apply(&directive(1.0 / 3.0, None), 1000));
    let d = offer(&l, Criticality::Critical, 600, 1100);
    assert!((d as f64 - 200.0).abs() <= 2.0, "{d}");
}

/// The client's own rate jumps: the ratio it raises on its own falls on its own least
/// critical traffic first, not on CRITICAL.
#[test]
fn a_ratio_raised_on_a_jump_is_split_over_the_clients_own_mix() {
    let (l, mut rep) = setup();
    offer(&l, Criticality::Critical, 40, 0);
    offer(&l, Criticality::Sheddable, 60, 0);
    rep.build_report(1000);
    // The fleet offers 300 against 200: a third shed, SHEDDABLE first.
    let shed = TierShedMsg {
        threshold: Criticality::Sheddable,
        fraction: 100.0 / 180.0,
    };
    assert!(rep.apply(&directive(1.0 / 3.0, Some(shed)), 1000));
    assert!(!rep.subtick(1000), "100 rps as before: no jump");
    // 160 rps over the next 250 ms, the same mix: the fleet is now 360, 44.4 % to shed.
    offer(&l, Criticality::Critical, 16, 1100);
    offer(&l, Criticality::Sheddable, 24, 1100);
    assert!(rep.subtick(1250));
    assert_eq!(offer(&l, Criticality::Critical, 400, 1300), 0);
    let d = offer(&l, Criticality::Sheddable, 600, 1300) as f64;
    let want = 600.0 * (160.0 / 360.0 * 100.0) / 60.0;
    assert!((d - want).abs() <= 3.0, "{d} vs {want}");
}

/// A SHEDDABLE rise beside steady CRITICAL traffic, under the limit until then (the
/// directive's split sheds nothing): the ratio the client raises at once is split over the
/// surge's own mix, so CRITICAL loses nothing even before the controller has seen it.
#[test]
fn a_sheddable_rise_is_shed_from_sheddable_before_the_controller_sees_it() {
    let (l, mut rep) = setup();
    offer(&l, Criticality::Critical, 40, 0);
    rep.build_report(1000);
    let none = TierShedMsg {
        threshold: Criticality::Sheddable,
        fraction: 0.0,
    };
    assert!(rep.apply(&directive(0.0, Some(none)), 1000));
    assert!(!rep.subtick(1000));
    // 140 rps over 250 ms, most of it new SHEDDABLE traffic: the fleet is now 400 against
    // 200, half to shed, all of it from SHEDDABLE (17.5 of its 25 requests a window).
    offer(&l, Criticality::Critical, 10, 1100);
    offer(&l, Criticality::Sheddable, 25, 1100);
    assert!(rep.subtick(1250));
    assert_eq!(offer(&l, Criticality::Critical, 100, 1300), 0);
    let d = offer(&l, Criticality::Sheddable, 1000, 1300) as f64;
    assert!((d - 700.0).abs() <= 3.0, "{d}");
}
