//! The forecast policy beats peak on growing traffic in a backtest.

use policies::RateSeries;
use rlc::history::synth::Profile;
use rlc_plan::backtest::backtest;
use schema::PolicyName;

use crate::support::{daemon, history, repo};

fn series(profile: &Profile, days: usize) -> RateSeries {
    let start = 1_767_225_600; // 2026-01-01
    let values = (0..days * 1440)
        .map(|i| {
            let t = start + i as i64 * 60;
            profile.sample(t, start, 1, 0) as f32
        })
        .collect();
    RateSeries {
        start,
        step: 60,
        values,
    }
}

#[test]
fn forecast_beats_peak_on_growing_traffic() {
    let dir = tempfile::tempdir().unwrap();
    let repo = repo(
        dir.path(),
        &[(
            "rlc/policies.yaml",
            "default:\n  policy: peak\n  headroom: 0.1\n",
        )],
    );
    let growing = Profile {
        growth_per_day: 0.05,
        noise: 0.03,
        ..Default::default()
    };
    let steady = Profile {
        noise: 0.03,
        ..Default::default()
    };
    let h = history(vec![
        ("maps", "mobile", "route", series(&growing, 28)),
        ("maps", "web", "route", series(&steady, 28)),
    ]);
    let r = backtest(
        &daemon("history:\n  file: x.csv"),
        &repo,
        &h,
        7 * 86_400,
        &[PolicyName::Peak, PolicyName::Forecast],
    );
    let score = |p: &str, b: &str| {
        r.buckets
            .iter()
            .find(|s| s.policy == p && s.bucket == b)
            .unwrap()
            .clone()
    };
    let (peak, fc) = (
        score("peak", "mobile.route"),
        score("forecast", "mobile.route"),
    );
    assert!(
        peak.throttled_fraction > 0.001,
        "peak falls behind growth: {peak:?}"
    );
    assert!(
        fc.throttled_fraction < peak.throttled_fraction / 10.0,
        "forecast {fc:?} vs peak {peak:?}"
    );
    assert!(fc.throttled_fraction <= 0.0001, "≤ 0.01% throttled: {fc:?}");
    assert!(fc.slack < 1.5, "comparable slack: {fc:?}");
    // On steady traffic both hold, with comparable slack.
    let (ps, fs) = (score("peak", "web.route"), score("forecast", "web.route"));
    assert_eq!((ps.throttled_fraction, fs.throttled_fraction), (0.0, 0.0));
    assert!((fs.slack - ps.slack).abs() < 0.15, "{ps:?} {fs:?}");
    let totals: Vec<_> = r
        .totals
        .iter()
        .map(|t| (t.policy.as_str(), t.buckets))
        .collect();
    assert_eq!(totals, [("peak", 2), ("forecast", 2)]);
    assert!(r.totals[1].throttled_fraction < r.totals[0].throttled_fraction);
}

/// A plugin answering 1e308 is refused by the rails as in a run: it counts as failed, never
/// as a bucket that is never overloaded.
#[test]
fn a_plugin_answering_1e308_fails_instead_of_scoring() {
    let dir = tempfile::tempdir().unwrap();
    let plugins = dir.path().join("plugins");
    std::fs::create_dir(&plugins).unwrap();
    let file = format!(
        "{}example_plugin{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    );
    std::fs::copy(crate::support::plugin_lib(), plugins.join(file)).unwrap();
    let repo = repo(
        &dir.path().join("repo"),
        &[(
            "rlc/policies.yaml",
            "default:\n  policy: peak\n  params: {mode: huge}\n",
        )],
    );
    let cfg = daemon(&format!(
        "history:\n  file: x.csv\nplugins:\n  dir: {}\n  host: {}",
        plugins.display(),
        env!("CARGO_BIN_EXE_rlc")
    ));
    let steady = Profile {
        noise: 0.03,
        ..Default::default()
    };
    let h = history(vec![("maps", "web", "route", series(&steady, 28))]);
    let plugin = PolicyName::Plugin("example-plugin".into());
    let r = backtest(&cfg, &repo, &h, 7 * 86_400, &[plugin, PolicyName::Peak]);
    assert!(
        r.buckets.iter().all(|b| b.policy == "peak"),
        "no score for the plugin: {:?}",
        r.buckets
    );
    assert_eq!((r.totals[0].buckets, r.totals[0].failed), (0, 1));
    assert_eq!((r.totals[1].buckets, r.totals[1].failed), (1, 0));
}
