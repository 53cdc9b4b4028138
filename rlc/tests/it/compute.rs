//! compute_plan on in-memory and file histories: failures keep quotas, plugins fail alone,
//! contracts win, coverage guards.

use chrono::Utc;
use policies::RateSeries;
use rlc::compute::compute_plan;
use rlc::history::History;
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
    assert_eq!(px.evidence["policy"]["contract"], "MSA-2291");
    assert_eq!(
        px.evidence["peak_rps"], 150.0,
        "both procedures of the caller"
    );
    let old = &plan.buckets[0];
    assert_eq!(
        old.bucket.limit_rps, 25.0,
        "expired contract no longer applies: peak 20 × 1.25"
    );
    assert!(
        old.evidence["expired_contracts"][0]
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
    let cfg = daemon(&format!("{CFG}\nplugins:\n  dir: {}", plugins.display()));
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
    assert!(rlc::preview::table(&plan).contains("web.route"));
}
