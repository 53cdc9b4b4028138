use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use schema::{Bucket, Mode, PolicyName, Scope};

use crate::control::{adjusted_ratio, drop_ratio, jain_index, Directive};
use crate::{Decision, Limiter, Table};

fn bucket(
    name: &str,
    caller: Option<&str>,
    procedure: Option<&str>,
    limit: f64,
    mode: Mode,
) -> Bucket {
    Bucket {
        name: name.into(),
        caller: caller.map(Into::into),
        procedure: procedure.map(Into::into),
        scope: Scope::Global,
        limit_rps: limit,
        mode,
        policy: PolicyName::Manual,
    }
}

fn precedence_table() -> Table {
    Table::compile(
        "svc",
        "v1",
        &[
            bucket("by-caller", Some("a"), None, 10.0, Mode::Enforce),
            bucket("by-proc", None, Some("p"), 10.0, Mode::Enforce),
            bucket("both", Some("a"), Some("p"), 10.0, Mode::Enforce),
            bucket("b-q", Some("b"), Some("q"), 10.0, Mode::Enforce),
        ],
    )
    .unwrap()
}

#[test]
fn match_precedence() {
    let t = precedence_table();
    let check = |caller: &str, procedure: &str, expect: Option<&str>| {
        let got = t
            .find(caller, procedure)
            .map(|i| t.buckets()[i].name.as_str());
        assert_eq!(got, expect, "caller={caller} procedure={procedure}");
    };
    check("a", "p", Some("both"));
    check("x", "p", Some("by-proc"));
    check("a", "other", Some("by-caller"));
    check("b", "q", Some("b-q"));
    check("b", "p", Some("by-proc"));
    check("c", "q", None);
    check("x", "y", None);
}

#[test]
fn compile_rejects_bad_buckets() {
    let bad = |b: Vec<Bucket>| Table::compile("svc", "v", &b).is_err();
    assert!(bad(vec![bucket("x", Some("a"), None, 0.0, Mode::Enforce)]));
    assert!(bad(vec![bucket(
        "x",
        Some("a"),
        None,
        f64::NAN,
        Mode::Enforce
    )]));
    assert!(bad(vec![bucket(
        "x",
        Some("a"),
        None,
        f64::INFINITY,
        Mode::Enforce
    )]));
    assert!(bad(vec![bucket("x", None, None, 1.0, Mode::Enforce)]));
    assert!(bad(vec![
        bucket("x", Some("a"), None, 1.0, Mode::Enforce),
        bucket("x", Some("b"), None, 1.0, Mode::Enforce)
    ]));
    assert!(bad(vec![
        bucket("x", Some("a"), None, 1.0, Mode::Enforce),
        bucket("y", Some("a"), None, 1.0, Mode::Enforce)
    ]));
    assert!(!bad(vec![bucket("x", Some("a"), None, 1.0, Mode::Enforce)]));
}

#[test]
fn ratio_formula() {
    let check = |offered: f64, limit: f64, expect: f64| {
        let r = drop_ratio(offered, limit);
        assert!(
            (r - expect).abs() < 1e-12,
            "offered={offered} limit={limit}: {r} != {expect}"
        );
    };
    check(150.0, 100.0, 1.0 / 3.0);
    check(100.0, 100.0, 0.0);
    check(50.0, 100.0, 0.0);
    check(0.0, 100.0, 0.0);
    check(1000.0, 100.0, 0.9);
    check(f64::NAN, 100.0, 0.0);
}

fn limiter_with(buckets: &[Bucket]) -> Limiter {
    let l = Limiter::new("svc", Duration::from_secs(3));
    l.install(Table::compile("svc", "v1", buckets).unwrap());
    l
}

#[test]
fn enforce_drops_about_the_ratio_and_counts() {
    let l = limiter_with(&[bucket("e", Some("a"), None, 10.0, Mode::Enforce)]);
    let t = l.table();
    t.set_ratio(0, 1.0 / 3.0);
    l.directives_received(0);
    let n = 30_000;
    let mut drops = 0;
    for _ in 0..n {
        if l.decide_at("a", "p", 1) == Decision::Drop {
            drops += 1;
        }
    }
    let c = t.counts(0);
    assert_eq!(c.offered, n);
    assert_eq!(c.dropped, drops);
    assert_eq!(c.admitted + c.dropped, c.offered);
    assert_eq!(c.shadow_dropped, 0);
    let frac = drops as f64 / n as f64;
    assert!((frac - 1.0 / 3.0).abs() < 0.02, "{frac}");
    // Unmatched requests pass and are not counted.
    assert_eq!(l.decide_at("zzz", "p", 1), Decision::Admit);
    assert_eq!(t.counts(0).offered, n);
}

#[test]
fn shadow_admits_everything_but_counts_virtual_drops() {
    let l = limiter_with(&[bucket("s", None, Some("p"), 10.0, Mode::Shadow)]);
    let t = l.table();
    t.set_ratio(0, 1.0 / 3.0);
    l.directives_received(0);
    let n = 30_000u64;
    for _ in 0..n {
        assert!(l.decide_at("x", "p", 1).admitted());
    }
    let c = t.counts(0);
    assert_eq!(c.offered, n);
    assert_eq!(c.admitted, n);
    assert_eq!(c.dropped, 0);
    let frac = c.shadow_dropped as f64 / n as f64;
    assert!((frac - 1.0 / 3.0).abs() < 0.02, "{frac}");
}

#[test]
fn fails_open_after_staleness_bound() {
    let l = limiter_with(&[bucket("e", Some("a"), None, 10.0, Mode::Enforce)]);
    l.table().set_ratio(0, 1.0);
    // No directive yet: stale from the start.
    assert_eq!(l.decide_at("a", "p", 0), Decision::Admit);
    l.directives_received(1_000);
    assert_eq!(l.decide_at("a", "p", 1_500), Decision::Drop);
    assert_eq!(l.decide_at("a", "p", 3_999), Decision::Drop);
    // 3 s after the last directive: stop dropping.
    assert_eq!(l.decide_at("a", "p", 4_000), Decision::Admit);
    assert!(l.table().is_stale(4_000));
    // A fresh directive resumes enforcement.
    l.directives_received(5_000);
    assert_eq!(l.decide_at("a", "p", 5_001), Decision::Drop);
}

#[test]
fn expire_stale_fails_open_whatever_the_thread_clock_says() {
    // The wall-clock path: a thread's clock is refreshed every 64 decisions, so at a low rate
    // it can lag the deadline by far; `expire_stale` (on the real clock) fails open at once.
    let l = Limiter::new("svc", Duration::from_millis(40));
    l.install(
        Table::compile(
            "svc",
            "v1",
            &[bucket("e", Some("a"), None, 10.0, Mode::Enforce)],
        )
        .unwrap(),
    );
    l.table().set_ratio(0, 1.0);
    l.directives_received(crate::now_ms());
    assert!(!l.expire_stale(crate::now_ms()));
    assert_eq!(l.decide("a", "p"), Decision::Drop);
    let deadline = crate::now_ms() + 40;
    while crate::now_ms() <= deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(l.expire_stale(crate::now_ms()));
    assert!(l.table().is_stale(0), "the deadline is gone");
    for _ in 0..200 {
        assert_eq!(l.decide("a", "p"), Decision::Admit);
    }
    // A fresh directive enforces again (on the thread's clock too).
    l.directives_received(crate::now_ms());
    assert!(!l.expire_stale(crate::now_ms()));
    assert_eq!(l.decide("a", "p"), Decision::Drop);
}

#[test]
fn install_keeps_ratios_of_surviving_buckets() {
    let l = limiter_with(&[bucket("e", Some("a"), None, 10.0, Mode::Enforce)]);
    l.table().set_ratio(0, 1.0);
    l.directives_received(0);
    l.install(
        Table::compile(
            "svc",
            "v2",
            &[
                bucket("new", Some("b"), None, 10.0, Mode::Enforce),
                bucket("e", Some("a"), None, 20.0, Mode::Enforce),
            ],
        )
        .unwrap(),
    );
    assert_eq!(l.table().version(), "v2");
    assert_eq!(l.decide_at("a", "p", 1), Decision::Drop);
    assert_eq!(l.decide_at("b", "p", 1), Decision::Admit);
}

#[test]
fn local_growth_raises_ratio_but_never_lowers_it() {
    let d = Directive {
        ratio: 0.0,
        fleet_offered_rps: 90.0,
        limit_rps: 100.0,
        local_offered_rps: 10.0,
        fixed: false,
    };
    assert_eq!(adjusted_ratio(&d, 10.0), 0.0);
    assert_eq!(adjusted_ratio(&d, 5.0), 0.0);
    // Own load +40 (5×, below 6× its allowance share of 11.1): only the lower bound, the
    // fleet is at least 130 → 30/130 must go.
    assert!((adjusted_ratio(&d, 50.0) - 30.0 / 130.0).abs() < 1e-9);
    assert!(!crate::control::far_above_share(&d, 50.0));
    // Own load 12× (far above its share): taken for a fleet-wide step, the client admits
    // only its share of the allowance, 100 × 10/90.
    let share = 100.0 * 10.0 / 90.0;
    assert!(crate::control::far_above_share(&d, 120.0));
    assert!((adjusted_ratio(&d, 120.0) - (1.0 - share / 120.0)).abs() < 1e-9);
    // An uneven instance bursting 8× while its fleet runs at half the limit is 4× its share:
    // no local drop at all.
    let half = Directive {
        fleet_offered_rps: 50.0,
        local_offered_rps: 5.0,
        ..d
    };
    assert_eq!(adjusted_ratio(&half, 40.0), 0.0);
    let fixed = Directive {
        fixed: true,
        ratio: 0.2,
        ..d
    };
    assert_eq!(adjusted_ratio(&fixed, 1000.0), 0.2);
}

#[test]
fn jain() {
    assert!((jain_index(&[1.0, 1.0, 1.0]) - 1.0).abs() < 1e-12);
    assert!((jain_index(&[1.0, 0.0, 0.0, 0.0]) - 0.25).abs() < 1e-12);
}

/// Threads decide while another thread swaps configs: every decision sees one whole table
/// (bucket "e" always drops in v-even, "e" does not exist in v-odd), nothing blocks, and the
/// counts of each table add up.
#[test]
fn config_swap_under_concurrent_decisions() {
    let l = Arc::new(limiter_with(&[bucket(
        "e",
        Some("a"),
        None,
        10.0,
        Mode::Enforce,
    )]));
    l.table().set_ratio(0, 1.0);
    l.directives_received(0);
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..3)
        .map(|_| {
            let l = l.clone();
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let t = l.table();
                    let d = l.decide_at("a", "p", 1);
                    // The table seen by `decide_at` may be newer than `t`, but it is one of the
                    // two shapes: either "a" drops (ratio 1) or "a" is unmatched (admit).
                    assert!(matches!(d, Decision::Drop | Decision::Admit));
                    let _ = t;
                    n += 1;
                }
                n
            })
        })
        .collect();
    let mut olds = Vec::new();
    for v in 0..2000 {
        let buckets = if v % 2 == 0 {
            vec![bucket("e", Some("a"), None, 10.0, Mode::Enforce)]
        } else {
            vec![bucket("f", Some("b"), None, 10.0, Mode::Enforce)]
        };
        let t = Table::compile("svc", &format!("v{v}"), &buckets).unwrap();
        if v % 2 == 0 {
            t.set_ratio(0, 1.0);
        }
        olds.push(l.install(t));
    }
    stop.store(true, Ordering::Relaxed);
    let decided: u64 = workers.into_iter().map(|w| w.join().unwrap()).sum();
    assert!(decided > 0);
    // Every counted request on a table with bucket "e" (ratio 1, fresh) was a drop.
    for t in olds.iter().chain(std::iter::once(&l.table())) {
        if let Some(i) = t.index_of("e") {
            let c = t.counts(i);
            assert_eq!(
                c.admitted,
                0,
                "table {} admitted on a ratio-1 bucket",
                t.version()
            );
            assert_eq!(c.offered, c.dropped);
        }
    }
}

/// The per-thread table cache: a thread that already decided on a table picks up a swapped one
/// on its next decision, and limiters sharing a cache entry (ids equal modulo its size) never
/// see each other's tables.
#[test]
fn cached_table_follows_swaps_and_limiters_do_not_mix() {
    let l = limiter_with(&[bucket("e", Some("a"), None, 10.0, Mode::Enforce)]);
    l.table().set_ratio(0, 1.0);
    l.directives_received(0);
    assert_eq!(l.decide_at("a", "p", 1), Decision::Drop);
    l.install(
        Table::compile(
            "svc",
            "v2",
            &[bucket("f", Some("b"), None, 10.0, Mode::Enforce)],
        )
        .unwrap(),
    );
    assert_eq!(l.decide_at("a", "p", 1), Decision::Admit);
    assert_eq!(l.table().counts(0).offered, 0);
    assert_eq!(l.decide_at("b", "p", 1), Decision::Admit);
    assert_eq!(l.table().counts(0).offered, 1);
    // Another thread sees the swap too.
    let t = std::thread::scope(|s| s.spawn(|| l.decide_at("a", "p", 1)).join().unwrap());
    assert_eq!(t, Decision::Admit);
    // More limiters than cache entries, used in turns on one thread: each decides on its own.
    let many: Vec<Limiter> = (0..150)
        .map(|i| {
            let l = limiter_with(&[bucket("e", Some("a"), None, 10.0, Mode::Enforce)]);
            l.table().set_ratio(0, (i % 2) as f64);
            l.directives_received(0);
            l
        })
        .collect();
    for _ in 0..3 {
        for (i, l) in many.iter().enumerate() {
            let expect = if i % 2 == 1 {
                Decision::Drop
            } else {
                Decision::Admit
            };
            assert_eq!(l.decide_at("a", "p", 1), expect, "limiter {i}");
        }
    }
    for l in &many {
        assert_eq!(l.table().counts(0).offered, 3);
    }
}

/// Names of every length the hash and the comparison treat differently (0–3, 4–7, 8–16,
/// 17–32, longer): each finds its own bucket, and a name differing in one byte finds nothing.
#[test]
fn lookup_by_every_name_length() {
    let name = |n: usize, last: u8| -> String {
        let mut s: Vec<u8> = (0..n).map(|i| b'a' + (i % 26) as u8).collect();
        if let Some(x) = s.last_mut() {
            *x = last;
        }
        String::from_utf8(s).unwrap()
    };
    let buckets: Vec<Bucket> = (1..70)
        .flat_map(|n| {
            [
                bucket(
                    &format!("c{n}"),
                    Some(&name(n, b'X')),
                    None,
                    1.0,
                    Mode::Enforce,
                ),
                bucket(
                    &format!("p{n}"),
                    None,
                    Some(&name(n, b'Y')),
                    1.0,
                    Mode::Enforce,
                ),
                bucket(
                    &format!("cp{n}"),
                    Some(&name(n, b'X')),
                    Some(&name(n, b'Y')),
                    1.0,
                    Mode::Enforce,
                ),
            ]
        })
        .collect();
    let t = Table::compile("svc", "v", &buckets).unwrap();
    let got = |c: &str, p: &str| t.find(c, p).map(|i| t.buckets()[i].name.clone());
    for n in 1..70 {
        let (c, p) = (name(n, b'X'), name(n, b'Y'));
        assert_eq!(got(&c, &p).as_deref(), Some(format!("cp{n}").as_str()));
        assert_eq!(got(&c, "").as_deref(), Some(format!("c{n}").as_str()));
        assert_eq!(got("", &p).as_deref(), Some(format!("p{n}").as_str()));
        assert_eq!(got(&name(n, b'Z'), &name(n, b'Z')), None, "length {n}");
        assert_eq!(
            got(&format!("{c}X"), &format!("{p}Y")),
            None,
            "length {n}+1"
        );
    }
}

/// A tiered directive: at 300 rps offered (120 CRITICAL, 180 SHEDDABLE) and a limit of 200,
/// the 100 rps to shed all fall on SHEDDABLE; a request without a tier is CRITICAL; the
/// counts are kept per tier and a table swap keeps the tiers' probabilities.
#[test]
fn tiered_shed_falls_on_the_least_critical_tier() {
    use crate::criticality::split;
    use schema::Criticality;
    let l = Limiter::new("svc", Duration::from_secs(5));
    l.install(
        Table::compile(
            "svc",
            "v1",
            &[bucket("gw", Some("gw"), None, 200.0, Mode::Enforce)],
        )
        .unwrap(),
    );
    let t = l.table();
    t.set_tier_shed(0, &split(100.0, [180.0, 0.0, 120.0, 0.0]));
    l.directives_received(1_000);
    let mut dropped = [0u32; 4];
    for _ in 0..1_000 {
        for (tier, n) in [(Criticality::Sheddable, 3), (Criticality::Critical, 2)] {
            for _ in 0..n {
                if l.decide_tier_at("gw", "x", tier, 1_500) == Decision::Drop {
                    dropped[tier as usize] += 1;
                }
            }
        }
        assert_eq!(
            l.decide_at("gw", "x", 1_500),
            Decision::Admit,
            "untiered is CRITICAL"
        );
    }
    assert_eq!(dropped[Criticality::Critical as usize], 0);
    // 100 of every 180 SHEDDABLE requests, within a request or two of the sequence.
    let want = 3_000.0 * 100.0 / 180.0;
    let got = dropped[Criticality::Sheddable as usize] as f64;
    assert!((got - want).abs() <= 2.0, "{got} vs {want}");
    let counts = t.tier_counts(0);
    assert_eq!(counts[Criticality::Sheddable as usize].offered, 3_000);
    assert_eq!(counts[Criticality::Critical as usize].offered, 3_000);
    assert_eq!(counts[Criticality::Critical as usize].dropped, 0);
    assert_eq!(t.counts(0).offered, 6_000);
    // A new table keeps the tiers' probabilities.
    l.install(
        Table::compile(
            "svc",
            "v2",
            &[bucket("gw", Some("gw"), None, 200.0, Mode::Enforce)],
        )
        .unwrap(),
    );
    let t2 = l.table();
    assert_eq!(t2.tier_ratio(0, Criticality::Critical), 0.0);
    assert_eq!(t2.tier_ratio(0, Criticality::SheddablePlus), 0.0);
    assert!((t2.tier_ratio(0, Criticality::Sheddable) - 100.0 / 180.0).abs() < 1e-9);
}

/// A file's `criticality.caps` hold a caller's requests at its cap: batch-nightly's
/// CRITICAL_PLUS is decided and counted as SHEDDABLE and pays the SHEDDABLE shed, while gw's
/// CRITICAL_PLUS loses nothing; a bad pattern refuses the file.
#[test]
fn capped_callers_are_decided_and_counted_at_their_cap() {
    use crate::criticality::split;
    use schema::{BucketFile, Criticality};
    let mut file = BucketFile::new(
        "svc",
        vec![bucket("all", None, Some("x"), 200.0, Mode::Enforce)],
    );
    file.criticality.caps = [
        ("batch-*".to_string(), Criticality::Sheddable),
        ("batch-vip".to_string(), Criticality::CriticalPlus),
    ]
    .into();
    let l = Limiter::new("svc", Duration::from_secs(5));
    l.install(Table::compile_file("v1", &file).unwrap());
    let t = l.table();
    assert_eq!(t.cap("batch-nightly"), Some(Criticality::Sheddable));
    assert_eq!(t.cap("gw"), None);
    // Shed every SHEDDABLE request, nothing above.
    t.set_tier_shed(0, &split(100.0, [100.0, 0.0, 0.0, 100.0]));
    l.directives_received(1_000);
    let plus = Criticality::CriticalPlus;
    let mut dropped = [0u32; 3];
    for _ in 0..100 {
        for (k, caller) in ["batch-nightly", "batch-vip", "gw"].iter().enumerate() {
            if l.decide_tier_at(caller, "x", plus, 1_500) == Decision::Drop {
                dropped[k] += 1;
            }
        }
    }
    assert_eq!(dropped, [100, 0, 0]);
    let counts = t.tier_counts(0);
    assert_eq!(counts[Criticality::Sheddable as usize].offered, 100);
    assert_eq!(counts[plus as usize].offered, 200);
    // An untiered request of a capped caller is CRITICAL, then capped.
    assert_eq!(l.decide_at("batch-x", "x", 1_500), Decision::Drop);
    file.criticality.caps = [("a*b".to_string(), Criticality::Sheddable)].into();
    let e = Table::compile_file("v2", &file).err().expect("refused");
    assert!(e.to_string().contains("a*b"), "{e}");
    assert!(Table::check_file(&file).is_err());
}
