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
            shed_below: None,
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

fn shed_below(id: &str, bucket: Option<&str>, tier: Criticality, expires_at: u64) -> Override {
    Override {
        id: id.into(),
        req: OverrideRequest {
            service: Some("svc".into()),
            bucket: bucket.map(Into::into),
            caller: None,
            procedure: None,
            limit_rps: None,
            drop_ratio: None,
            shed_below: Some(tier),
            ttl_secs: 60,
            reason: "INC-7".into(),
            who: "sre".into(),
        },
        created_at: 0,
        expires_at,
        credential: None,
    }
}

/// `shed_below CRITICAL` on a bucket under its limit (180 SHEDDABLE + 120 CRITICAL at 400):
/// SHEDDABLE drops everything, and the uniform ratio older clients get is that share (0.6).
/// Over the limit the bucket's own split and the floor combine (the floor wins while it
/// sheds more); the floor goes at its expiry.
#[test]
fn a_shed_below_override_drops_every_tier_below_its_floor() {
    let mut e = Engine::new(one_global(400.0), 3000);
    e.ingest(&report("z1", 300.0, Some([180.0, 0.0, 120.0, 0.0])), 0);
    e.recompute(0, 0);
    assert_eq!(shed_of(&e, "z1").0, 0.0);
    // A service-wide floor: every bucket of the service.
    e.set_overrides(vec![shed_below("ovr-1", None, Criticality::Critical, 100)]);
    assert_eq!(e.affected("ovr-1").len(), 1);
    e.recompute(1, 10);
    let (ratio, shed) = shed_of(&e, "z1");
    assert!((ratio - 0.6).abs() < 1e-9, "{ratio}");
    assert_eq!(
        shed,
        Some(TierShedMsg {
            threshold: Criticality::Critical,
            fraction: 0.0
        })
    );
    // 1,200 rps (540 SHEDDABLE, 660 CRITICAL) at 400: the split drops 800, which reaches
    // into CRITICAL: it sheds more than the floor and stays.
    e.ingest(&report("z1", 1200.0, Some([540.0, 0.0, 660.0, 0.0])), 2);
    e.recompute(2, 20);
    let (ratio, shed) = shed_of(&e, "z1");
    let shed = shed.expect("a split");
    assert_eq!(shed.threshold, Criticality::Critical);
    assert!((shed.fraction - 260.0 / 660.0).abs() < 1e-9, "{shed:?}");
    assert!((ratio - 800.0 / 1200.0).abs() < 1e-9, "{ratio}");
    // The bucket override on the bucket itself, with a mix unknown (a zone of older
    // clients): the floor tier drops the bucket's ratio, the tiers below everything.
    e.set_overrides(vec![shed_below(
        "ovr-2",
        Some("g"),
        Criticality::SheddablePlus,
        100,
    )]);
    e.ingest(&report("z2", 100.0, None), 3);
    e.recompute(3, 30);
    let (ratio, shed) = shed_of(&e, "z1");
    assert!((ratio - 900.0 / 1300.0).abs() < 1e-9, "{ratio}");
    assert_eq!(
        shed,
        Some(TierShedMsg {
            threshold: Criticality::SheddablePlus,
            fraction: ratio
        })
    );
    // Expired: the uniform ratio again (the mix is still unknown).
    e.recompute(4, 100);
    assert_eq!(shed_of(&e, "z1"), (ratio, None));
}

/// Several floors on one bucket (a service-wide one and the bucket's own): the highest is in
/// force; when it expires, the other one is again.
#[test]
fn of_several_floors_the_highest_wins() {
    let mut e = Engine::new(one_global(400.0), 3000);
    e.ingest(&report("z1", 300.0, Some([100.0, 80.0, 60.0, 60.0])), 0);
    e.set_overrides(vec![
        shed_below("ovr-low", None, Criticality::SheddablePlus, 200),
        shed_below("ovr-high", Some("g"), Criticality::CriticalPlus, 100),
    ]);
    e.recompute(1, 10);
    let (ratio, shed) = shed_of(&e, "z1");
    assert_eq!(
        shed,
        Some(TierShedMsg {
            threshold: Criticality::CriticalPlus,
            fraction: 0.0
        })
    );
    // Everything below CRITICAL_PLUS: 240 of 300.
    assert!((ratio - 240.0 / 300.0).abs() < 1e-9, "{ratio}");
    // The higher floor expired: the lower one is in force.
    e.recompute(2, 150);
    let (ratio, shed) = shed_of(&e, "z1");
    assert_eq!(shed.map(|s| s.threshold), Some(Criticality::SheddablePlus));
    assert!((ratio - 100.0 / 300.0).abs() < 1e-9, "{ratio}");
}

/// A zone report whose counts of bucket `g` carry `tiers` (each `[offered, admitted,
/// dropped, shadow_dropped]`) beside requests of clients without tiers (`untiered`).
fn counted(tiers: &[(Criticality, [u64; 4])], untiered: [u64; 4]) -> grl_wire::ZoneReport {
    let mut r = zone_report("z1", "r1", "z1", &[("g", 100.0)]);
    let c = &mut r.buckets[0].counts;
    let mut whole = untiered;
    for (tier, n) in tiers {
        for (w, x) in whole.iter_mut().zip(n) {
            *w += x;
        }
        c.tiers.push(grl_wire::TierCountsMsg {
            tier: *tier,
            offered: n[0],
            admitted: n[1],
            dropped: n[2],
            shadow_dropped: n[3],
        });
    }
    [c.offered, c.admitted, c.dropped, c.shadow_dropped] = whole;
    r
}

/// The `/metrics` text of an engine's collector.
fn metrics_of(e: Engine) -> String {
    let mut registry = prometheus_client::registry::Registry::default();
    registry.register_collector(Box::new(crate::metrics::EngineCollector::new(
        std::sync::Arc::new(std::sync::Mutex::new(e)),
    )));
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    text
}

/// The requests counted by tier reach the report rows (one entry per tier with requests) and
/// `grl_requests_*_total` (a `criticality` label; empty for clients that count no tiers);
/// tier counts that do not fit within the whole are not believed.
#[test]
fn counts_by_tier_reach_the_report_rows_and_the_metrics() {
    let mut e = Engine::new(one_global(200.0), 3000);
    let sheddable = (Criticality::Sheddable, [180, 80, 100, 0]);
    let critical = (Criticality::Critical, [120, 120, 0, 0]);
    e.ingest(&counted(&[sheddable, critical], [10, 10, 0, 0]), 0);
    e.recompute(0, 10);
    e.record_reports(10);
    let page = e.reports_after(0, 100);
    let c = page.reports[0].counts.clone().expect("counts");
    assert_eq!(
        [c.offered, c.admitted, c.dropped, c.shadow_dropped],
        [310, 210, 100, 0]
    );
    let tiers: Vec<_> = c
        .tiers
        .iter()
        .map(|t| (t.tier, t.offered, t.dropped))
        .collect();
    assert_eq!(
        tiers,
        [
            (Criticality::Sheddable, 180, 100),
            (Criticality::Critical, 120, 0)
        ]
    );
    // A report whose tiers claim more than its whole: counted, but untiered.
    let mut wrong = counted(&[(Criticality::CriticalPlus, [50, 50, 0, 0])], [0; 4]);
    wrong.buckets[0].counts.offered = 20;
    wrong.buckets[0].counts.admitted = 20;
    e.ingest(&wrong, 1000);
    e.recompute(1000, 11);
    e.record_reports(11);
    let page = e.reports_after(page.next.seq().unwrap(), 100);
    let c = page.reports[0].counts.clone().expect("counts");
    assert_eq!((c.offered, c.tiers.len()), (20, 0));

    let text = metrics_of(e);
    let sample = |tier: &str| -> Option<u64> {
        let label = format!("criticality=\"{tier}\"");
        text.lines()
            .filter(|l| l.starts_with("grl_requests_offered_total{") && l.contains(&label))
            .map(|l| l.rsplit(' ').next().unwrap().parse().unwrap())
            .reduce(|a: u64, b| a + b)
    };
    assert_eq!(sample("SHEDDABLE"), Some(180));
    assert_eq!(sample("CRITICAL"), Some(120));
    assert_eq!(sample(""), Some(30), "{text}");
    assert_eq!(sample("CRITICAL_PLUS"), None, "{text}");
    assert!(text.contains("grl_requests_dropped_total{service=\"svc\",bucket=\"g\",caller=\"g\",procedure=\"\",zone=\"z1\",criticality=\"SHEDDABLE\"} 100"), "{text}");
}

/// A bucket file's `criticality` section reaches a peer that says it reads it (`grl-proto: 9`)
/// and nobody else on the served view, what aggregators fetch (an aggregator or client before
/// 9 refuses unknown fields); the pushed view, what a person takes back to `PUT`, is whole. A
/// bad caller pattern refuses the push, naming it.
#[tokio::test]
async fn the_caps_are_served_to_peers_that_read_them() {
    const TOKEN: &str = "t0ken";
    let dir = tempfile::tempdir().unwrap();
    let c = crate::tests::anonymous_controller(dir.path().join("c"), TOKEN).await;
    let url = c.url();
    let http = reqwest::Client::new();
    let doc = |pattern: &str| {
        serde_json::json!({"version": "v1", "services": [{"service": "payments",
            "criticality": {"caps": {pattern: "sheddable"}},
            "buckets": [{"name": "charge", "procedure": "charge", "limit_rps": 10.0}]}]})
    };
    let put = |body: serde_json::Value| {
        http.put(format!("{url}/v1/config"))
            .bearer_auth(TOKEN)
            .json(&body)
            .send()
    };
    let r = put(doc("batch-*")).await.unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    let get = |query: &'static str, proto: Option<&'static str>| {
        let mut req = http.get(format!("{url}/v1/config{query}"));
        if let Some(p) = proto {
            req = req.header(grl_wire::PROTO_HEADER, p);
        }
        async move {
            req.send()
                .await
                .unwrap()
                .json::<serde_json::Value>()
                .await
                .unwrap()
        }
    };
    let caps = |v: &serde_json::Value| v["services"][0].get("criticality").cloned();
    let whole = Some(serde_json::json!({"caps": {"batch-*": "SHEDDABLE"}}));
    assert_eq!(caps(&get("", Some("9")).await), whole);
    assert_eq!(caps(&get("", Some("8")).await), None);
    let old = get("", None).await;
    assert_eq!(
        (caps(&old), &old["services"][0]["buckets"][0]["name"]),
        (None, &"charge".into())
    );
    assert_eq!(caps(&get("?view=pushed", None).await), whole);
    let r = put(doc("a*b")).await.unwrap();
    assert_eq!(r.status(), 422);
    let body = r.text().await.unwrap();
    assert!(
        body.contains("criticality.caps") && body.contains("a*b"),
        "{body}"
    );
    c.shutdown().await;
}
