//! Unit tests of the simulator (fixed seeds): the engine's control loop in virtual time.

use std::path::PathBuf;

use crate::report::{fairness, premature, seeds_loop, steady, step};
use crate::sim::{run, Algorithm, Scenario};

fn scenario(name: &str) -> Scenario {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("scenarios")
        .join(name);
    Scenario::load(&p).unwrap()
}

#[test]
fn sim_steady_overload_admits_the_limit() {
    let sc = scenario("steady-1.5x.yaml");
    let limit = sc.buckets[0].limit_rps;
    for seed in [1, 7] {
        let r = run(&sc, seed, Algorithm::DropByRatio, |_| {}).unwrap();
        let s = steady(&r, &sc.buckets[0].name, limit, 5.0);
        assert!(
            s.error.abs() <= 0.03,
            "seed {seed}: admitted {} vs limit {limit}",
            s.admitted_rps
        );
        // The first directive lands after the first tick: from t = 2 s on, the whole tick runs
        // at the right ratio (per-tick admitted counts are binomial noise around the limit).
        let at2 = r.rows.iter().find(|row| row.t == 2.0).unwrap();
        assert!(
            (at2.drop_ratio - 1.0 / 3.0).abs() < 0.01,
            "{}",
            at2.drop_ratio
        );
        assert!(
            ((at2.admitted_rps - limit) / limit).abs() < 0.08,
            "{}",
            at2.admitted_rps
        );
    }
}

#[test]
fn sim_shadow_admits_everything_and_counts_a_third() {
    let sc = scenario("shadow-1.5x.yaml");
    let r = run(&sc, 3, Algorithm::DropByRatio, |_| {}).unwrap();
    for row in &r.rows {
        assert_eq!(row.dropped_rps, 0.0);
        assert_eq!(row.admitted_rps, row.offered_rps);
    }
    let s = steady(&r, &sc.buckets[0].name, sc.buckets[0].limit_rps, 3.0);
    assert!(
        (s.shadow_fraction - 1.0 / 3.0).abs() < 0.03,
        "{}",
        s.shadow_fraction
    );
}

#[test]
fn sim_is_deterministic_for_a_seed() {
    let sc = scenario("step-15x.yaml");
    let a = run(&sc, 42, Algorithm::DropByRatio, |_| {}).unwrap();
    let b = run(&sc, 42, Algorithm::DropByRatio, |_| {}).unwrap();
    let c = run(&sc, 43, Algorithm::DropByRatio, |_| {}).unwrap();
    assert_eq!(a.rows, b.rows);
    assert_ne!(a.rows, c.rows);
}

#[test]
fn sim_fast_loop_beats_the_seeds_lag_on_a_step() {
    let sc = scenario("step-15x.yaml");
    let b = &sc.buckets[0];
    let fast = step(
        &run(&sc, 1, Algorithm::DropByRatio, |_| {}).unwrap(),
        &b.name,
        b.limit_rps,
        10.0,
    );
    let slow = step(
        &run(&seeds_loop(&sc), 1, Algorithm::DropByRatio, |_| {}).unwrap(),
        &b.name,
        b.limit_rps,
        10.0,
    );
    let (f, s) = (fast.catch_up_s.unwrap(), slow.catch_up_s.unwrap());
    assert!(f < s, "fast {f} slow {s}");
    assert!(fast.mean_overshoot < slow.mean_overshoot);
}

#[test]
fn sim_drop_by_ratio_is_fairer_than_token_bucket() {
    let sc = scenario("fairness.yaml");
    let limit = sc.buckets[0].limit_rps;
    let grl = fairness(
        &run(&sc, 1, Algorithm::DropByRatio, |_| {}).unwrap(),
        limit,
        sc.duration_s,
    );
    let tb = fairness(
        &run(&sc, 1, Algorithm::TokenBucket, |_| {}).unwrap(),
        limit,
        sc.duration_s,
    );
    assert!(grl.jain > tb.jain, "grl {} tb {}", grl.jain, tb.jain);
    assert_eq!(grl.starved, 0);
    assert!(
        (grl.capacity_used - 1.0).abs() < 0.05,
        "{}",
        grl.capacity_used
    );

    let sc = scenario("uneven.yaml");
    let b = &sc.buckets[0];
    let p = premature(
        &run(&sc, 1, Algorithm::DropByRatio, |_| {}).unwrap(),
        &b.name,
        b.limit_rps,
    );
    assert_eq!(p.dropped, 0);
}

/// The 15× step is enforced within a second: the first second after it admits at most 150%
/// of the limit (clients far above their share of the allowance drop at once), and every
/// whole second after that at most 105%.
#[test]
fn sim_step_is_enforced_within_a_second() {
    let sc = scenario("step-15x.yaml");
    let b = &sc.buckets[0];
    for seed in [1, 2, 3] {
        let st = step(
            &run(&sc, seed, Algorithm::DropByRatio, |_| {}).unwrap(),
            &b.name,
            b.limit_rps,
            10.0,
        );
        assert!(
            st.first_second <= 1.5,
            "seed {seed}: first second {}",
            st.first_second
        );
        assert!(
            st.later_seconds_max <= 1.05,
            "seed {seed}: later seconds {}",
            st.later_seconds_max
        );
        // Not by starving it: the seconds after the step still use the limit.
        assert!(
            st.capacity_used >= 0.95,
            "seed {seed}: {}",
            st.capacity_used
        );
    }
}

/// Steady overload: every tick after the loop settled admits the limit within ±3% (no
/// oscillation between over- and under-admitting).
#[test]
fn sim_steady_overload_does_not_oscillate() {
    let sc = scenario("steady-1.5x.yaml");
    let limit = sc.buckets[0].limit_rps;
    for seed in [1, 2] {
        let r = run(&sc, seed, Algorithm::DropByRatio, |_| {}).unwrap();
        for row in r.rows.iter().filter(|row| row.t > 3.0) {
            assert!(
                ((row.admitted_rps - limit) / limit).abs() <= 0.03,
                "seed {seed} t {}: admitted {}",
                row.t,
                row.admitted_rps
            );
        }
    }
}

/// More callers than quota share a procedure bucket fairly (Jain's index ≥ 0.99), and an
/// uneven fleet under quota (a hot instance, an 8× burst) is never dropped.
#[test]
fn sim_fairness_index_and_no_premature_drops() {
    let sc = scenario("fairness.yaml");
    let limit = sc.buckets[0].limit_rps;
    for seed in [1, 2, 3] {
        let f = fairness(
            &run(&sc, seed, Algorithm::DropByRatio, |_| {}).unwrap(),
            limit,
            sc.duration_s,
        );
        assert!(f.jain >= 0.99, "seed {seed}: Jain {}", f.jain);
        assert_eq!(f.starved, 0);
    }
    let sc = scenario("uneven.yaml");
    let b = &sc.buckets[0];
    for seed in [1, 2, 3] {
        let r = run(&sc, seed, Algorithm::DropByRatio, |_| {}).unwrap();
        let p = premature(&r, &b.name, b.limit_rps);
        assert_eq!(p.dropped, 0, "seed {seed}");
        assert!(
            r.rows.iter().all(|row| row.dropped_rps == 0.0),
            "seed {seed}"
        );
    }
}

/// The proof of candidate limits: a fleet at 150 rps on a 3,470 rps limit and a candidate of
/// 100 rps. No request is refused while the candidate is watched, the candidate's virtual-drop
/// share is about a third, and the rollout rule aborts it (as soon as enough traffic showed
/// it); the limit in force stays.
#[test]
fn sim_candidate_below_the_traffic_is_aborted_without_refusing_anything() {
    let sc = scenario("candidate-abort.yaml");
    for seed in [1, 9] {
        let r = run(&sc, seed, Algorithm::DropByRatio, |_| {}).unwrap();
        assert!(!r.candidates.is_empty());
        for c in &r.candidates {
            assert_eq!(c.real_dropped, 0, "{c:?}");
        }
        for row in &r.rows {
            assert_eq!(row.dropped_rps, 0.0, "{row:?}");
            assert_eq!(row.limit_rps, 3470.0, "the limit in force stays: {row:?}");
        }
        let last = r.candidates.last().unwrap();
        assert_eq!(last.verdict, "abort", "{last:?}");
        assert!(
            (last.virtual_drop_share - 1.0 / 3.0).abs() < 0.03,
            "{last:?}"
        );
        assert!(last.offered >= 1000.0, "{last:?}");
        assert!(
            last.reason.as_deref().unwrap().contains("above the bar"),
            "{last:?}"
        );
        // Aborted before the bake's end: enough traffic showed it early.
        assert!(last.baked_s < 60.0, "{last:?}");
        let baking = &r.candidates[..r.candidates.len() - 1];
        assert!(baking.iter().all(|c| c.verdict == "baking"));
    }
}

/// A candidate of 3,000 rps beside the same fleet is promoted after the bake, and from then on
/// enforced: no request is refused at any time.
#[test]
fn sim_candidate_above_the_traffic_is_promoted_after_the_bake() {
    let sc = scenario("candidate-promote.yaml");
    let r = run(&sc, 1, Algorithm::DropByRatio, |_| {}).unwrap();
    for row in &r.rows {
        assert_eq!(row.dropped_rps, 0.0, "{row:?}");
    }
    let last = r.candidates.last().unwrap();
    assert_eq!(last.verdict, "promote", "{last:?}");
    assert_eq!(last.virtual_dropped, 0.0, "{last:?}");
    assert_eq!(last.real_dropped, 0, "{last:?}");
    assert!(last.baked_s >= 60.0, "{last:?}");
    assert!(r.candidates[..r.candidates.len() - 1]
        .iter()
        .all(|c| c.verdict == "baking"));
    // Promoted: the candidate's limit is the one in force afterwards.
    let after: Vec<_> = r.rows.iter().filter(|row| row.t > last.t).collect();
    assert!(!after.is_empty());
    assert!(after.iter().all(|row| row.limit_rps == 3000.0));
    let before: Vec<_> = r.rows.iter().filter(|row| row.t < last.t).collect();
    assert!(before.iter().all(|row| row.limit_rps == 3470.0));
}

/// A candidate matching other callers than the bucket in force (here: every caller of the
/// procedure) is fed by the calls the zones report: the same share.
#[test]
fn sim_candidate_with_another_match_reads_the_calls() {
    let mut sc = scenario("candidate-abort.yaml");
    sc.candidates[0].bucket.caller = None;
    let r = run(&sc, 2, Algorithm::DropByRatio, |_| {}).unwrap();
    let last = r.candidates.last().unwrap();
    assert_eq!(last.verdict, "abort", "{last:?}");
    assert!(
        (last.virtual_drop_share - 1.0 / 3.0).abs() < 0.05,
        "{last:?}"
    );
    assert!(r.rows.iter().all(|row| row.dropped_rps == 0.0));
}

/// Scenario candidates are checked like pushed ones: the error names the field.
#[test]
fn sim_candidate_errors_name_the_field() {
    let mut sc = scenario("candidate-abort.yaml");
    sc.candidates[0].bucket.limit_rps = -1.0;
    let e = run(&sc, 1, Algorithm::DropByRatio, |_| {}).unwrap_err();
    assert!(
        e.to_string().contains("candidates[0].bucket.limit_rps"),
        "{e}"
    );
    let mut sc = scenario("candidate-abort.yaml");
    sc.candidates[0].bucket.name = "nope".into();
    let e = run(&sc, 1, Algorithm::DropByRatio, |_| {}).unwrap_err();
    assert!(e.to_string().contains("candidates[0].bucket.name"), "{e}");
}

/// A SHEDDABLE surge of 12× beside flat CRITICAL traffic: with the mix of tiers known, the
/// CRITICAL traffic is admitted on every tick and the admitted total is within ±2% of the
/// limit within 3 ticks; without it (aggregators of the previous protocol), CRITICAL loses
/// as much as SHEDDABLE, at the same total.
#[test]
fn sim_tiers_keep_critical_traffic_through_a_sheddable_surge() {
    use crate::report::{settle_ticks, tier_figures};
    use schema::Criticality::{Critical, Sheddable};
    let sc = scenario("tiers-surge-12x.yaml");
    let (name, limit) = (sc.buckets[0].name.clone(), sc.buckets[0].limit_rps);
    for seed in [1, 7] {
        let r = run(&sc, seed, Algorithm::DropByRatio, |_| {}).unwrap();
        let crit = tier_figures(&r, &name, Critical, 10.0).unwrap();
        assert!(crit.min_availability >= 0.99, "seed {seed}: {crit:?}");
        let shed = tier_figures(&r, &name, Sheddable, 13.0).unwrap();
        assert!(
            (shed.admitted_rps - 400.0).abs() < 20.0,
            "seed {seed}: {shed:?}"
        );
        let settled = settle_ticks(&r, &name, limit, 10.0, 0.02);
        assert!(settled.is_some_and(|n| n <= 3), "seed {seed}: {settled:?}");
        // Rows carry the tiers.
        let row = r.rows.iter().find(|row| row.t == 20.0).unwrap();
        let tiers: Vec<_> = row.tiers.iter().map(|t| t.tier).collect();
        assert_eq!(tiers, [Sheddable, Critical]);
    }
    let mut untiered = sc.clone();
    untiered.tiers = false;
    let r = run(&untiered, 1, Algorithm::DropByRatio, |_| {}).unwrap();
    let crit = tier_figures(&r, &name, Critical, 13.0).unwrap();
    // 1000 of 4200: every tier keeps about 24%.
    assert!(
        (crit.mean_availability - 1000.0 / 4200.0).abs() < 0.03,
        "{crit:?}"
    );
    let st = steady(&r, &name, limit, 13.0);
    assert!(st.error.abs() <= 0.02, "{st:?}");
}
