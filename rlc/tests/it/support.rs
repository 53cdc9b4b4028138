//! Shared helpers: config repos on disk, daemon configs, the example plugin.

use std::path::Path;

use policies::RateSeries;
use rlc_plan::history::{History, SeriesKey};
use schema::{ConfigRepo, DaemonConfig};

/// Writes a config repo from `(relative path, contents)` pairs and loads it; panics on any
/// diagnostic so tests run on valid repos.
pub fn repo(dir: &Path, files: &[(&str, &str)]) -> ConfigRepo {
    for (p, text) in files {
        let p = dir.join(p);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }
    let (repo, diags) = ConfigRepo::load(dir);
    assert!(
        diags.is_empty(),
        "invalid test repo: {}",
        schema::Diagnostics(diags)
    );
    repo
}

/// A daemon config from YAML (history, rails, plugins…); `config_repo` is filled in.
pub fn daemon(yaml: &str) -> DaemonConfig {
    serde_yaml::from_str(&format!("{yaml}\nconfig_repo:\n  path: repo\n")).unwrap()
}

/// A history holding the given series (all on the same grid as the first).
pub fn history(series: Vec<(&str, &str, &str, RateSeries)>) -> History {
    let (start, step, len) = (
        series[0].3.start,
        series[0].3.step,
        series[0].3.values.len(),
    );
    History {
        start,
        step,
        len,
        series: series
            .into_iter()
            .map(|(s, c, p, r)| {
                let opt = |v: &str| (!v.is_empty()).then(|| v.to_string());
                (
                    SeriesKey {
                        service: s.into(),
                        caller: opt(c),
                        procedure: opt(p),
                    },
                    r,
                )
            })
            .collect(),
        rejected: vec![],
        source_error: None,
    }
}

/// The example plugin's cdylib (built on demand).
pub fn plugin_lib() -> &'static Path {
    test_support::plugin::example_plugin_lib()
}

/// The value of the first sample of `/metrics` at `base` whose line starts with `prefix` (a
/// name with `{` or a space) and contains every string of `with`; `None` if there is none.
pub async fn metric(base: &str, prefix: &str, with: &[&str]) -> Option<f64> {
    let text = reqwest::get(format!("{base}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find(|l| l.starts_with(prefix) && with.iter().all(|w| l.contains(w)))
        .and_then(|l| l.rsplit(' ').next())
        .map(|v| v.trim().parse().unwrap())
}
