//! Plugin tests against the real `example-plugin` cdylib (built here with cargo), run out of
//! process in the real `rlc-plugin-host` binary.

use std::path::{Path, PathBuf};
use std::sync::RwLock;
use std::time::{Duration, Instant};

use policies::isolated::{self, IsolatedPlugin, Settings};
use policies::{Policy, PolicyError, PolicyInput, RateSeries};
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

fn settings(timeout_ms: u64, max_restarts: u32) -> Settings {
    Settings {
        host: PathBuf::from(env!("CARGO_BIN_EXE_rlc-plugin-host")),
        timeout: Duration::from_millis(timeout_ms),
        memory_limit_bytes: 256 << 20,
        max_restarts,
    }
}

/// Held for reading by every test that starts a host, for writing while the environment
/// variable faking the ABI version is set (a host inherits the environment when it starts).
static ENV: RwLock<()> = RwLock::new(());

fn load(dir: &Path, name: &str, s: &Settings) -> Result<&'static IsolatedPlugin, String> {
    let _env = ENV.read().unwrap_or_else(|p| p.into_inner());
    isolated::load(dir, name, s).map_err(|e| e.to_string())
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
    let _env = ENV.read().unwrap_or_else(|p| p.into_inner());
    p.compute(&PolicyInput {
        left_out: 0,
        service: "maps",
        caller: Some("web"),
        procedure: Some("route"),
        series: &s,
        spec: &spec,
        capacity_share_rps: None,
        now: chrono::Utc::now(),
    })
}

/// Whether process `pid` still exists (a zombie counts: it was not reaped).
fn exists(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

#[test]
fn plugin_lifecycle() {
    wrong_abi_version_is_refused();
    misbehaviour_fails_only_the_call_and_the_host_is_restarted();
}

fn wrong_abi_version_is_refused() {
    let dir = plugin_dir(&so("badabi"));
    let r = {
        let _env = ENV.write().unwrap_or_else(|p| p.into_inner());
        std::env::set_var("EXAMPLE_PLUGIN_ABI_VERSION", "999");
        let r = isolated::load(dir.path(), "badabi", &settings(5000, 3)).map_err(|e| e.to_string());
        std::env::remove_var("EXAMPLE_PLUGIN_ABI_VERSION");
        r
    };
    let e = r.unwrap_err();
    assert!(e.contains("ABI version 999"), "{e}");
    assert!(
        e.starts_with("plugin `badabi`: ABI version 999"),
        "named once: {e}"
    );
}

fn misbehaviour_fails_only_the_call_and_the_host_is_restarted() {
    let dir = plugin_dir(&so("example_plugin"));
    let p = load(dir.path(), "example-plugin", &settings(2000, 20)).expect("load");
    assert_eq!(p.description().unwrap().name, "example");
    assert_eq!(p.name(), PolicyName::Plugin("example-plugin".into()));
    let ok = compute(p, serde_json::json!({"factor": 1.0})).unwrap();
    assert_eq!(ok.limit_rps, 80.0, "max 40 × (1 + 1)");
    assert_eq!(ok.peak_rps, 40.0);
    // The same plugin and settings again: the same instance and host.
    let host = p.host_pid().expect("a host runs");
    assert!(std::ptr::eq(
        p,
        load(dir.path(), "example-plugin", &settings(2000, 20)).unwrap()
    ));
    assert_eq!(p.host_pid(), Some(host));

    // Failures the plugin reports itself keep the host.
    let panic = compute(p, serde_json::json!({"mode": "panic"})).unwrap_err();
    assert!(
        panic.to_string().contains("panicked") && panic.to_string().contains("asked to panic"),
        "{panic}"
    );
    let garbage = compute(p, serde_json::json!({"mode": "garbage"})).unwrap_err();
    assert!(garbage.to_string().contains("invalid JSON"), "{garbage}");
    let error = compute(p, serde_json::json!({"mode": "error"})).unwrap_err();
    assert!(error.to_string().contains("asked to fail"), "{error}");
    assert_eq!(
        p.host_pid(),
        Some(host),
        "no restart for a reported failure"
    );
    // A plugin printing to stdout (even a forged answer) cannot corrupt the protocol.
    let printed = compute(p, serde_json::json!({"mode": "stdout"})).unwrap();
    assert_eq!(
        printed.limit_rps, 60.0,
        "its real answer, not the forged one"
    );

    // Failures that kill or block the process: each fails its call with the cause, the host
    // is reaped, and the next call gets a fresh host that works.
    let cases: [(&str, &[&str]); 4] = [
        ("segfault", &["died with signal 11 (SIGSEGV)"]),
        (
            "abort_panic",
            &[
                "died with signal 6 (SIGABRT)",
                "panicked: example plugin panics across the C boundary",
            ],
        ),
        ("hog", &["memory allocation", "(memory limit 256 MiB)"]),
        ("hang", &["timed out after 2s"]),
    ];
    for (mode, expect) in cases {
        let before = p.host_pid().expect("a host runs");
        let t = Instant::now();
        let e = compute(p, serde_json::json!({"mode": mode}))
            .unwrap_err()
            .to_string();
        let took = t.elapsed();
        assert!(e.starts_with("plugin `example-plugin`: "), "{mode}: {e}");
        for x in expect {
            assert!(e.contains(x), "{mode}: `{x}` missing in {e}");
        }
        assert!(took < Duration::from_secs(10), "{mode} took {took:?}");
        assert!(!exists(before), "{mode}: host {before} reaped");
        assert_eq!(p.host_pid(), None);
        assert_eq!(
            compute(p, serde_json::json!({})).unwrap().limit_rps,
            60.0,
            "after {mode}"
        );
        assert_ne!(p.host_pid(), Some(before));
    }
    // 1e308 is a number the plugin may answer; refusing it is the caller's sanity bound.
    let huge = compute(p, serde_json::json!({"mode": "huge"})).unwrap();
    assert_eq!(huge.limit_rps, 1e308);
}

#[test]
fn restarts_are_bounded() {
    let dir = plugin_dir(&so("crashy"));
    let p = load(dir.path(), "crashy", &settings(5000, 2)).unwrap();
    for _ in 0..3 {
        let e = compute(p, serde_json::json!({"mode": "segfault"}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("SIGSEGV"), "{e}");
    }
    assert_eq!(p.starts(), 3, "the first start and 2 restarts");
    let t = Instant::now();
    let e = compute(p, serde_json::json!({})).unwrap_err().to_string();
    assert!(t.elapsed() < Duration::from_millis(100), "fails at once");
    assert!(
        e.contains("disabled") && e.contains("max_restarts 2") && e.contains("SIGSEGV"),
        "{e}"
    );
    assert_eq!(p.starts(), 3, "no more starts");
    // New settings (as after an rlc.yaml change) make a new instance with a fresh budget.
    let p2 = load(dir.path(), "crashy", &settings(5000, 3)).unwrap();
    assert_eq!(compute(p2, serde_json::json!({})).unwrap().limit_rps, 60.0);
}

#[test]
fn a_missing_host_fails_the_plugin_only() {
    let dir = plugin_dir(&so("example_plugin"));
    let mut s = settings(5000, 0);
    s.host = dir.path().join("no-such-host");
    let e = load(dir.path(), "example-plugin", &s).unwrap_err();
    assert!(
        e.contains("cannot start the plugin host") && e.contains("no-such-host"),
        "{e}"
    );
}

#[test]
fn paths_outside_the_directory_are_rejected() {
    let outer = plugin_dir(&so("escape"));
    let dir = outer.path().join("plugins");
    std::fs::create_dir(&dir).unwrap();
    let s = settings(5000, 3);
    for name in ["../escape", "a/b", "", ".."] {
        let e = load(&dir, name, &s).unwrap_err();
        assert!(e.contains("no paths"), "{name}: {e}");
    }
    // A symlink pointing out of the directory is refused too.
    std::os::unix::fs::symlink(outer.path().join(so("escape")), dir.join(so("linked"))).unwrap();
    let e = load(&dir, "linked", &s).unwrap_err();
    assert!(e.contains("outside the plugin directory"), "{e}");
    let e = load(&dir, "missing", &s).unwrap_err();
    assert!(e.contains("no library"), "{e}");
}

#[test]
fn not_a_plugin_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join(so("junk")), b"not an ELF file").unwrap();
    let e = load(dir.path(), "junk", &settings(5000, 0)).unwrap_err();
    assert!(e.contains("cannot load"), "{e}");
}
