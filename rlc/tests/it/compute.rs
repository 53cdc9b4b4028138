//! compute_plan on in-memory and file histories: failures keep quotas, plugins fail alone,
//! contracts win, coverage guards.

use chrono::Utc;
use policies::RateSeries;
use rlc_plan::compute::compute_plan;
use rlc_plan::history::History;
use schema::Mode;

use crate::support::{daemon, history, plugin_lib, repo};

fn flat(days: usize, v: f32) -> RateSeries {
    let start = 1_700_000_000 / 86_400 * 86_400;
    RateSeries {
        start,
        step: 60,
        values: vec![v; days * 1440],
    }
}

const CFG: &str = "history:\n  file: h.csv\n  min_coverage: 0.5";

#[test]
fn failed_source_keeps_every_quota() {
    let dir = tempfile::tempdir().unwrap();
    let repo = repo(
        dir.path(),
        &[
            ("rlc/policies.yaml", "default:\n  policy: peak\n"),
            ("buckets/shop.yaml", "service: shop\nbuckets:\n  - name: web\n    caller: web\n    limit_rps: 100\n    policy: peak\n"),
        ],
    );
    let plan = compute_plan(
        &daemon(CFG),
        &repo,
        &History::unavailable("prometheus at http://x refused"),
        Utc::now(),
    );
    assert_eq!(plan.buckets.len(), 1);
    assert_eq!(plan.buckets[0].bucket.limit_rps, 100.0, "no quota lowered");
    assert_eq!(plan.skipped.len(), 1);
    assert_eq!(plan.skipped[0].service, "shop");
    assert!(
        plan.skipped[0]
            .reason
            .contains("history source failed: prometheus at http://x refused"),
        "{:?}",
        plan.skipped
    );
    // And the rendered file is byte-identical to what the repo holds.
    assert_eq!(
        plan.bucket_files()[0],
        repo.current("shop").unwrap().clone()
    );
}

#[test]
fn low_coverage_service_keeps_its_quotas_others_go_on() {
    let dir = tempfile::tempdir().unwrap();
    let repo = repo(
        dir.path(),
        &[
            ("rlc/policies.yaml", "default:\n  policy: peak\n"),
            ("buckets/shop.yaml", "service: shop\nbuckets:\n  - name: web\n    caller: web\n    limit_rps: 500\n    policy: peak\n"),
        ],
    );
    let mut holey = flat(28, 10.0);
    for (i, v) in holey.values.iter_mut().enumerate() {
        if i % 3 != 0 {
            *v = f32::NAN; // a third of the samples: 33% coverage
        }
    }
    let h = history(vec![
        ("shop", "web", "", holey),
        ("mail", "cron", "", flat(28, 40.0)),
    ]);
    let plan = compute_plan(&daemon(CFG), &repo, &h, Utc::now());
    let shop = plan.buckets.iter().find(|b| b.service == "shop").unwrap();
    assert_eq!(shop.bucket.limit_rps, 500.0);
    assert!(
        plan.skipped
            .iter()
            .any(|s| s.service == "shop" && s.reason.contains("below min_coverage")),
        "{:?}",
        plan.skipped
    );
    let mail = plan.buckets.iter().find(|b| b.service == "mail").unwrap();
    assert_eq!(
        (mail.bucket.limit_rps, mail.bucket.mode),
        (50.0, Mode::Shadow),
        "40 × 1.25, new → shadow"
    );
}

#[test]
fn contract_wins_and_expired_contract_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let repo = repo(
        dir.path(),
        &[
            ("rlc/policies.yaml", "default:\n  policy: peak\nservices:\n  maps: {}\n"),
            (
                "rlc/contracts.yaml",
                "contracts:\n  - service: maps\n    caller: partner-x\n    limit_rps: 600\n    reference: MSA-2291\n  - service: maps\n    caller: old\n    procedure: geocode\n    limit_rps: 5\n    expires: 2020-01-01\n    reference: MSA-1\n  - service: maps\n    caller: gone\n    limit_rps: 7\n    expires: 2020-01-01\n",
            ),
        ],
    );
    let h = history(vec![
        ("maps", "partner-x", "geocode", flat(28, 100.0)),
        ("maps", "partner-x", "route", flat(28, 50.0)),
        ("maps", "old", "geocode", flat(28, 20.0)),
    ]);
    let plan = compute_plan(&daemon(CFG), &repo, &h, Utc::now());
    let names: Vec<&str> = plan
        .buckets
        .iter()
        .map(|b| b.bucket.name.as_str())
        .collect();
    assert_eq!(
        names,
        ["old.geocode", "partner-x"],
        "the caller-wide contract covers its procedures"
    );
    let px = &plan.buckets[1];
    assert_eq!(
        (px.bucket.limit_rps, px.bucket.policy.to_string().as_str()),
        (600.0, "fixed")
    );
    assert_eq!(json(&px.evidence)["policy"]["contract"], "MSA-2291");
    assert_eq!(
        json(&px.evidence)["peak_rps"],
        150.0,
        "both procedures of the caller"
    );
    let old = &plan.buckets[0];
    assert_eq!(
        old.bucket.limit_rps, 25.0,
        "expired contract no longer applies: peak 20 × 1.25"
    );
    assert!(
        json(&old.evidence)["expired_contracts"][0]
            .as_str()
            .unwrap()
            .contains("MSA-1"),
        "{}",
        old.evidence
    );
    assert!(
        plan.skipped
            .iter()
            .any(|s| s.caller.as_deref() == Some("gone") && s.reason.contains("expired")),
        "{:?}",
        plan.skipped
    );
}

#[test]
fn plugin_failure_fails_only_its_buckets() {
    let dir = tempfile::tempdir().unwrap();
    let plugins = dir.path().join("plugins");
    std::fs::create_dir(&plugins).unwrap();
    let file = format!(
        "{}example_plugin{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    );
    std::fs::copy(plugin_lib(), plugins.join(file)).unwrap();
    let repo = repo(
        &dir.path().join("repo"),
        &[
            (
                "rlc/policies.yaml",
                "default:\n  policy: peak\nservices:\n  good:\n    policy: plugin:example-plugin\n    params: {factor: 1.0}\n  bad:\n    policy: plugin:example-plugin\n    params: {mode: panic}\n  ugly:\n    policy: plugin:example-plugin\n    params: {mode: garbage}\n  escape:\n    policy: plugin:nope\n",
            ),
            ("buckets/bad.yaml", "service: bad\nbuckets:\n  - name: web\n    caller: web\n    limit_rps: 77\n    policy: peak\n"),
        ],
    );
    let cfg = daemon(&format!(
        "{CFG}\nplugins:\n  dir: {}\n  host: {}",
        plugins.display(),
        env!("CARGO_BIN_EXE_rlc")
    ));
    let h = history(vec![
        ("good", "web", "", flat(28, 10.0)),
        ("bad", "web", "", flat(28, 10.0)),
        ("ugly", "web", "", flat(28, 10.0)),
        ("escape", "web", "", flat(28, 10.0)),
        ("plain", "web", "", flat(28, 10.0)),
    ]);
    let plan = compute_plan(&cfg, &repo, &h, Utc::now());
    let limit = |s: &str| {
        plan.buckets
            .iter()
            .find(|b| b.service == s)
            .map(|b| (b.bucket.limit_rps, b.bucket.policy.to_string()))
    };
    assert_eq!(limit("good"), Some((20.0, "plugin:example-plugin".into())));
    assert_eq!(
        limit("bad"),
        Some((77.0, "peak".into())),
        "keeps its current quota"
    );
    assert_eq!(limit("ugly"), None, "no current quota, nothing proposed");
    assert_eq!(limit("plain"), Some((12.5, "peak".into())));
    let reason = |s: &str| {
        plan.skipped
            .iter()
            .find(|k| k.service == s)
            .map(|k| k.reason.clone())
            .unwrap_or_default()
    };
    assert!(reason("bad").contains("panicked"), "{}", reason("bad"));
    assert!(
        reason("ugly").contains("invalid JSON"),
        "{}",
        reason("ugly")
    );
    assert!(
        reason("escape").contains("no library"),
        "{}",
        reason("escape")
    );
}

/// A plugin directory holding the example plugin under each of `names`.
fn plugin_dir(root: &std::path::Path, names: &[&str]) -> std::path::PathBuf {
    let plugins = root.join("plugins");
    std::fs::create_dir_all(&plugins).unwrap();
    for n in names {
        let file = format!(
            "{}{n}{}",
            std::env::consts::DLL_PREFIX,
            std::env::consts::DLL_SUFFIX
        );
        std::fs::copy(plugin_lib(), plugins.join(file)).unwrap();
    }
    plugins
}

/// Plugins that crash, abort, hang, exhaust memory or answer 1e308 fail only their own
/// buckets: those keep their current limit and are listed in `skipped` with the cause; every
/// other bucket (the same plugin's included) gets its quota. The hosts run in the `rlc` binary.
#[test]
fn misbehaving_plugins_fail_only_their_buckets() {
    let dir = tempfile::tempdir().unwrap();
    let plugins = plugin_dir(
        dir.path(),
        &["crashy", "aborty", "sleepy", "hungry", "absurd"],
    );
    let bucket = |service: &str, caller: &str, limit: u32| {
        (
            format!("buckets/{service}.yaml"),
            format!("service: {service}\nbuckets:\n  - name: {caller}\n    caller: {caller}\n    limit_rps: {limit}\n    policy: peak\n"),
        )
    };
    let files = [
        (
            "rlc/policies.yaml".to_string(),
            "default:\n  policy: peak\nservices:\n  maps:\n    policy: plugin:crashy\n    params: {mode: segfault, only_caller: bad, factor: 1.0}\n  abort:\n    policy: plugin:aborty\n    params: {mode: abort_panic}\n  slow:\n    policy: plugin:sleepy\n    params: {mode: hang}\n  hungry:\n    policy: plugin:hungry\n    params: {mode: hog}\n  absurd:\n    policy: plugin:absurd\n    params: {mode: huge}\n".to_string(),
        ),
        bucket("maps", "bad", 77),
        bucket("abort", "web", 50),
        bucket("slow", "web", 40),
        bucket("hungry", "web", 30),
        bucket("absurd", "web", 20),
    ];
    let refs: Vec<(&str, &str)> = files
        .iter()
        .map(|(a, b)| (a.as_str(), b.as_str()))
        .collect();
    let repo = repo(&dir.path().join("repo"), &refs);
    let cfg = daemon(&format!(
        "{CFG}\nplugins:\n  dir: {}\n  host: {}\n  timeout: 1s\n  memory_limit_mb: 256",
        plugins.display(),
        env!("CARGO_BIN_EXE_rlc")
    ));
    let h = history(vec![
        ("maps", "bad", "", flat(28, 10.0)),
        ("maps", "web", "", flat(28, 10.0)),
        ("abort", "web", "", flat(28, 10.0)),
        ("slow", "web", "", flat(28, 10.0)),
        ("hungry", "web", "", flat(28, 10.0)),
        ("absurd", "web", "", flat(28, 10.0)),
        ("plain", "web", "", flat(28, 10.0)),
    ]);
    let t = std::time::Instant::now();
    let plan = compute_plan(&cfg, &repo, &h, Utc::now());
    let took = t.elapsed();
    let limit = |s: &str, c: &str| {
        plan.buckets
            .iter()
            .find(|b| b.service == s && b.bucket.caller.as_deref() == Some(c))
            .map(|b| (b.bucket.limit_rps, b.bucket.policy.to_string()))
    };
    // Every other bucket gets its quota, the crashing plugin's good bucket included.
    assert_eq!(limit("maps", "web"), Some((20.0, "plugin:crashy".into())));
    assert_eq!(limit("plain", "web"), Some((12.5, "peak".into())));
    // The bad buckets keep their current limit...
    assert_eq!(limit("maps", "bad"), Some((77.0, "peak".into())));
    assert_eq!(limit("abort", "web"), Some((50.0, "peak".into())));
    assert_eq!(limit("slow", "web"), Some((40.0, "peak".into())));
    assert_eq!(limit("hungry", "web"), Some((30.0, "peak".into())));
    assert_eq!(limit("absurd", "web"), Some((20.0, "peak".into())));
    // ...and are listed in skipped, naming the plugin and what happened.
    let reason = |s: &str, c: &str| {
        plan.skipped
            .iter()
            .find(|k| k.service == s && k.caller.as_deref() == Some(c))
            .map(|k| k.reason.clone())
            .unwrap_or_else(|| panic!("{s}/{c} not in skipped: {:?}", plan.skipped))
    };
    let expect: [(&str, &str, &[&str]); 5] = [
        (
            "maps",
            "bad",
            &["plugin:crashy", "died with signal 11 (SIGSEGV)"],
        ),
        (
            "abort",
            "web",
            &[
                "plugin:aborty",
                "died with signal 6 (SIGABRT)",
                "panics across the C boundary",
            ],
        ),
        ("slow", "web", &["plugin:sleepy", "timed out after 1s"]),
        (
            "hungry",
            "web",
            &[
                "plugin:hungry",
                "memory allocation",
                "(memory limit 256 MiB)",
            ],
        ),
        (
            "absurd",
            "web",
            &[
                "plugin:absurd",
                "1e308",
                "sanity bound",
                "keeps current quota",
            ],
        ),
    ];
    for (s, c, words) in expect {
        let r = reason(s, c);
        for w in words {
            assert!(r.contains(w), "{s}/{c}: `{w}` missing in {r}");
        }
    }
    assert_eq!(plan.skipped.len(), 5, "{:?}", plan.skipped);
    assert!(took < std::time::Duration::from_secs(30), "took {took:?}");
}

#[test]
fn quickstart_file_previews() {
    let dir = tempfile::tempdir().unwrap();
    let end = Utc::now();
    rlc::history::synth::generate(&dir.path().join("h.csv"), 42, end, 28, 60).unwrap();
    let repo = repo(
        &dir.path().join("repo"),
        &[(
            "rlc/policies.yaml",
            "default:\n  policy: peak\nservices:\n  search:\n    policy: forecast\n",
        )],
    );
    let cfg = daemon(CFG);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let h = rt
        .block_on(rlc::history::load(&cfg.history, dir.path(), end))
        .unwrap();
    assert_eq!(h.series.len(), 8);
    assert!(h.series.values().all(|s| s.present() == 28 * 1440));
    let plan = compute_plan(&cfg, &repo, &h, end);
    assert_eq!(plan.buckets.len(), 8);
    let web = plan
        .buckets
        .iter()
        .find(|b| b.bucket.name == "web.route")
        .unwrap();
    // 800 rps base, 1.5 × at the daily peak, ±5% noise, × 1.25.
    assert!(
        (1400.0..=1580.0).contains(&web.bucket.limit_rps),
        "{:?}",
        web
    );
    let q = plan
        .buckets
        .iter()
        .find(|b| b.bucket.name == "web.query")
        .unwrap();
    assert_eq!(q.bucket.policy.to_string(), "forecast");
    assert!(rlc::cmd::preview::table(&plan).contains("web.route"));
}

/// The bucket `name` of `service` in a plan.
fn bucket<'a>(
    plan: &'a rlc_plan::plan::Plan,
    service: &str,
    name: &str,
) -> Option<&'a rlc_plan::plan::PlannedBucket> {
    plan.buckets
        .iter()
        .find(|b| b.service == service && b.bucket.name == name)
}

#[test]
fn a_bucket_keeps_its_scope_unless_the_owner_sets_one() {
    let dir = tempfile::tempdir().unwrap();
    let bucket_file = "service: maps\nbuckets:\n  - name: web.route\n    caller: web\n    procedure: route\n    scope: region\n    limit_rps: 100\n    policy: peak\n";
    let repo1 = repo(
        dir.path(),
        &[
            ("rlc/policies.yaml", "default:\n  policy: peak\n"),
            ("buckets/maps.yaml", bucket_file),
        ],
    );
    let h = history(vec![
        ("maps", "web", "route", flat(28, 200.0)),
        ("maps", "mobile", "route", flat(28, 50.0)),
    ]);
    let plan = compute_plan(&daemon(CFG), &repo1, &h, Utc::now());
    assert_eq!(
        bucket(&plan, "maps", "web.route").unwrap().bucket.scope,
        schema::Scope::Region
    );
    assert_eq!(
        bucket(&plan, "maps", "mobile.route").unwrap().bucket.scope,
        schema::Scope::Global,
        "new buckets are global"
    );

    let dir2 = tempfile::tempdir().unwrap();
    let repo2 = repo(
        dir2.path(),
        &[
            (
                "rlc/policies.yaml",
                "default:\n  policy: peak\n  scope: zone\n",
            ),
            ("buckets/maps.yaml", bucket_file),
        ],
    );
    let plan = compute_plan(&daemon(CFG), &repo2, &h, Utc::now());
    assert_eq!(
        bucket(&plan, "maps", "web.route").unwrap().bucket.scope,
        schema::Scope::Zone
    );
}

#[test]
fn policies_yaml_mode_promotes_shadow_buckets() {
    let dir = tempfile::tempdir().unwrap();
    let files = |mode: &'static str| {
        vec![
            ("rlc/policies.yaml", mode),
            ("buckets/maps.yaml", "service: maps\nbuckets:\n  - name: web.route\n    caller: web\n    procedure: route\n    limit_rps: 250\n    mode: shadow\n    policy: peak\n"),
        ]
    };
    let h = history(vec![
        ("maps", "web", "route", flat(28, 200.0)),
        ("maps", "new", "route", flat(28, 20.0)),
    ]);
    let r = repo(dir.path(), &files("default:\n  policy: peak\n"));
    let plan = compute_plan(&daemon(CFG), &r, &h, Utc::now());
    assert_eq!(
        bucket(&plan, "maps", "web.route").unwrap().bucket.mode,
        Mode::Shadow,
        "existing keeps its mode"
    );
    assert_eq!(
        bucket(&plan, "maps", "new.route").unwrap().bucket.mode,
        Mode::Shadow,
        "new starts in shadow"
    );

    let dir2 = tempfile::tempdir().unwrap();
    let r = repo(
        dir2.path(),
        &files("default:\n  policy: peak\nservices:\n  maps:\n    mode: enforce\n"),
    );
    let plan = compute_plan(&daemon(CFG), &r, &h, Utc::now());
    assert_eq!(
        bucket(&plan, "maps", "web.route").unwrap().bucket.mode,
        Mode::Enforce
    );
    assert_eq!(
        bucket(&plan, "maps", "new.route").unwrap().bucket.mode,
        Mode::Enforce
    );
}

#[test]
fn a_gap_in_one_series_does_not_lower_its_quota() {
    let dir = tempfile::tempdir().unwrap();
    let r = repo(
        dir.path(),
        &[
            ("rlc/policies.yaml", "default:\n  policy: peak\n"),
            ("buckets/pay.yaml", "service: pay\nbuckets:\n  - name: gw.charge\n    caller: gw\n    procedure: charge\n    limit_rps: 1250\n    policy: peak\n  - name: co.refund\n    caller: co\n    procedure: refund\n    limit_rps: 80\n    policy: peak\n"),
        ],
    );
    // gw.charge: 20 of 28 days missing (a broken scrape), what remains is low.
    let mut holey = flat(28, 300.0);
    for v in holey.values.iter_mut().skip(1440).take(20 * 1440) {
        *v = f32::NAN;
    }
    let h = history(vec![
        ("pay", "gw", "charge", holey),
        ("pay", "co", "refund", flat(28, 100.0)),
    ]);
    let plan = compute_plan(&daemon(CFG), &r, &h, Utc::now());
    assert_eq!(
        bucket(&plan, "pay", "gw.charge").unwrap().bucket.limit_rps,
        1250.0
    );
    assert!(
        plan.skipped
            .iter()
            .any(|s| s.caller.as_deref() == Some("gw") && s.reason.contains("min_coverage")),
        "{:?}",
        plan.skipped
    );
    // A complete series in the same service still moves.
    assert_ne!(
        bucket(&plan, "pay", "co.refund").unwrap().bucket.limit_rps,
        80.0
    );
}

#[test]
fn caller_wide_contract_supersedes_the_callers_procedure_buckets_and_ends_with_its_contract() {
    let dir = tempfile::tempdir().unwrap();
    let bucket_file = "service: pay\nbuckets:\n  - name: gw.charge\n    caller: gw\n    procedure: charge\n    limit_rps: 1250\n    policy: peak\n  - name: co.refund\n    caller: co\n    procedure: refund\n    limit_rps: 80\n    policy: peak\n";
    let r = repo(
        dir.path(),
        &[
            ("rlc/policies.yaml", "default:\n  policy: peak\n"),
            (
                "rlc/contracts.yaml",
                "contracts:\n  - service: pay\n    caller: gw\n    limit_rps: 3000\n",
            ),
            ("buckets/pay.yaml", bucket_file),
        ],
    );
    let h = history(vec![
        ("pay", "gw", "charge", flat(28, 900.0)),
        ("pay", "co", "refund", flat(28, 70.0)),
    ]);
    let plan = compute_plan(&daemon(CFG), &r, &h, Utc::now());
    assert_eq!(bucket(&plan, "pay", "gw").unwrap().bucket.limit_rps, 3000.0);
    assert!(
        bucket(&plan, "pay", "gw.charge").is_none(),
        "the procedure bucket would win by specificity: {:?}",
        plan.buckets
    );
    assert!(
        plan.skipped.iter().any(|s| s.reason.contains("superseded")),
        "{:?}",
        plan.skipped
    );

    // The contract ended and the caller is quiet: its fixed bucket goes.
    let dir2 = tempfile::tempdir().unwrap();
    let r = repo(
        dir2.path(),
        &[
            ("rlc/policies.yaml", "default:\n  policy: peak\n"),
            ("rlc/contracts.yaml", "contracts:\n  - service: pay\n    caller: gw\n    limit_rps: 3000\n    expires: 2020-01-01\n"),
            ("buckets/pay.yaml", "service: pay\nbuckets:\n  - name: gw\n    caller: gw\n    limit_rps: 3000\n    policy: fixed\n  - name: co.refund\n    caller: co\n    procedure: refund\n    limit_rps: 80\n    policy: peak\n"),
        ],
    );
    let h = history(vec![("pay", "co", "refund", flat(28, 70.0))]);
    let plan = compute_plan(&daemon(CFG), &r, &h, Utc::now());
    assert!(bucket(&plan, "pay", "gw").is_none(), "{:?}", plan.buckets);
    assert!(bucket(&plan, "pay", "co.refund").is_some());
}

#[test]
fn colliding_bucket_names_are_reported_not_dropped_silently() {
    let dir = tempfile::tempdir().unwrap();
    let r = repo(
        dir.path(),
        &[("rlc/policies.yaml", "default:\n  policy: peak\n")],
    );
    // caller-only `x` and procedure-only `x` would both be named `x`.
    let h = history(vec![
        ("svc", "x", "", flat(28, 10.0)),
        ("svc", "", "x", flat(28, 20.0)),
    ]);
    let plan = compute_plan(&daemon(CFG), &r, &h, Utc::now());
    assert_eq!(
        plan.buckets.iter().filter(|b| b.bucket.name == "x").count(),
        1
    );
    assert!(
        plan.skipped
            .iter()
            .any(|s| s.reason.contains("already taken")),
        "{:?}",
        plan.skipped
    );
}

/// Every bucket says in one line what set its limit (the preview table's WHY column); an
/// expected-rate event is split between the matching callers by their peaks.
#[test]
fn explain_line_and_expected_rate_event() {
    let dir = tempfile::tempdir().unwrap();
    let start = 1_700_000_000 / 86_400 * 86_400;
    let now = chrono::TimeZone::timestamp_opt(&Utc, start + 28 * 86_400, 0).unwrap();
    let day = |n: i64| (now + chrono::Duration::days(n)).date_naive();
    let repo = repo(
        dir.path(),
        &[
            (
                "rlc/policies.yaml",
                "default:\n  policy: peak\n  headroom: 0.25\nservices:\n  shop: {}\n  mail: {}\n",
            ),
            (
                "rlc/capacity.yaml",
                &format!("capacity: []\nevents:\n  - name: launch\n    service: shop\n    from: {}\n    until: {}\n    rps: 600\n", day(1), day(2)),
            ),
        ],
    );
    let h = history(vec![
        ("shop", "web", "", flat(28, 100.0)),
        ("shop", "app", "", flat(28, 50.0)),
        ("mail", "cron", "", flat(28, 40.0)),
    ]);
    let plan = compute_plan(&daemon(CFG), &repo, &h, now);
    let get = |s: &str, c: &str| {
        plan.buckets
            .iter()
            .find(|b| b.service == s && b.bucket.name == c)
            .unwrap()
    };
    // 600 rps split 2:1 by peak, × 1.25: web 500, app 250 (without the event: 125, 62.5).
    let web = get("shop", "web");
    assert_eq!(web.bucket.limit_rps, 500.0, "{}", web.evidence);
    assert_eq!(get("shop", "app").bucket.limit_rps, 250.0);
    assert_eq!(
        json(&web.evidence)["policy"]["event"]["without_event_rps"],
        125.0
    );
    let why = web.evidence.explain.as_deref().unwrap();
    assert!(
        why.starts_with("max 100.0 rps at ") && why.contains("event launch"),
        "{why}"
    );
    let mail = get("mail", "cron");
    assert_eq!(mail.bucket.limit_rps, 50.0);
    assert!(json(&mail.evidence)["policy"].get("event").is_none());
    let table = rlc::cmd::preview::table(&plan);
    assert!(table.lines().next().unwrap().ends_with("WHY"), "{table}");
    assert!(table.contains("event launch"), "{table}");
}

/// Evidence as the preview JSON shows it.
fn json(e: &rlc_plan::evidence::Evidence) -> serde_json::Value {
    serde_json::to_value(e).unwrap()
}
