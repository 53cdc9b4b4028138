//! Plugin loader tests against the real `example-plugin` cdylib, built here with cargo.

use std::path::Path;

use policies::{loader, Policy, PolicyError, PolicyInput, RateSeries};
use schema::{PolicyName, PolicySpec};

fn plugin_lib() -> &'static Path {
    test_support::plugin::example_plugin_lib()
}

/// A fresh plugin directory holding a copy of the plugin under `file_name`.
fn plugin_dir(file_name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(plugin_lib(), dir.path().join(file_name)).unwrap();
    dir
}

fn so(stem: &str) -> String {
    format!(
        "{}{stem}{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    )
}

fn series() -> RateSeries {
    RateSeries {
        start: 1_700_000_000,
        step: 60,
        values: vec![10.0, f32::NAN, 40.0, 20.0],
    }
}

fn compute(p: &dyn Policy, params: serde_json::Value) -> Result<policies::Proposal, PolicyError> {
    let s = series();
    let spec = PolicySpec {
        params: Some(params),
        ..Default::default()
    };
    p.compute(&PolicyInput {
        service: "maps",
        caller: Some("web"),
        procedure: Some("route"),
        series: &s,
        spec: &spec,
        capacity_share_rps: None,
        now: chrono::Utc::now(),
    })
}

/// One test, so that the environment variable faking the ABI version is never set while
/// another test loads a plugin.
#[test]
fn plugin_lifecycle() {
    wrong_abi_version_is_refused();
    loads_and_computes_and_fails_cleanly_per_call();
}

fn loads_and_computes_and_fails_cleanly_per_call() {
    let dir = plugin_dir(&so("example_plugin"));
    let p = loader::load(dir.path(), "example-plugin").expect("load");
    assert_eq!(p.description().name, "example");
    assert_eq!(p.name(), PolicyName::Plugin("example-plugin".into()));
    let ok = compute(p, serde_json::json!({"factor": 1.0})).unwrap();
    assert_eq!(ok.limit_rps, 80.0, "max 40 × (1 + 1)");
    assert_eq!(ok.peak_rps, 40.0);
    // The same library again comes from the registry.
    assert!(std::ptr::eq(
        p,
        loader::load(dir.path(), "example-plugin").unwrap()
    ));

    let panic = compute(p, serde_json::json!({"mode": "panic"})).unwrap_err();
    assert!(
        panic.to_string().contains("panicked") && panic.to_string().contains("asked to panic"),
        "{panic}"
    );
    let garbage = compute(p, serde_json::json!({"mode": "garbage"})).unwrap_err();
    assert!(garbage.to_string().contains("invalid JSON"), "{garbage}");
    let error = compute(p, serde_json::json!({"mode": "error"})).unwrap_err();
    assert!(error.to_string().contains("asked to fail"), "{error}");
    // After all that, the plugin still works.
    assert_eq!(compute(p, serde_json::json!({})).unwrap().limit_rps, 60.0);
}

fn wrong_abi_version_is_refused() {
    // A copy under another name is a separate library instance; the plugin reads the fake
    // version from the environment only when asked, which happens once, at load.
    let dir = plugin_dir(&so("badabi"));
    std::env::set_var("EXAMPLE_PLUGIN_ABI_VERSION", "999");
    let r = loader::load(dir.path(), "badabi");
    std::env::remove_var("EXAMPLE_PLUGIN_ABI_VERSION");
    let e = r.unwrap_err().to_string();
    assert!(e.contains("ABI version 999"), "{e}");
    // The failure is remembered, not retried.
    assert!(loader::load(dir.path(), "badabi").is_err());
}

#[test]
fn paths_outside_the_directory_are_rejected() {
    let outer = plugin_dir(&so("escape"));
    let dir = outer.path().join("plugins");
    std::fs::create_dir(&dir).unwrap();
    for name in ["../escape", "a/b", "", ".."] {
        let e = loader::load(&dir, name).unwrap_err().to_string();
        assert!(e.contains("no paths"), "{name}: {e}");
    }
    // A symlink pointing out of the directory is refused too.
    #[cfg(unix)]
    {
        std::os::unix::fs::symlink(outer.path().join(so("escape")), dir.join(so("linked")))
            .unwrap();
        let e = loader::load(&dir, "linked").unwrap_err().to_string();
        assert!(e.contains("outside the plugin directory"), "{e}");
    }
    let e = loader::load(&dir, "missing").unwrap_err().to_string();
    assert!(e.contains("no library"), "{e}");
}

#[test]
fn not_a_plugin_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join(so("junk")), b"not an ELF file").unwrap();
    let e = loader::load(dir.path(), "junk").unwrap_err().to_string();
    assert!(e.contains("cannot load"), "{e}");
}
