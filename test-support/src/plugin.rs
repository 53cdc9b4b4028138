//! The example policy plugin, built on demand.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// Builds `example-plugin` with cargo and returns the path of its cdylib, read from cargo's
/// JSON messages so that it works whatever the target directory. Built once per test binary.
pub fn example_plugin_lib() -> &'static Path {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| env!("CARGO").to_string());
        let out = Command::new(cargo)
            .args(["build", "-p", "example-plugin", "--message-format=json"])
            // The workspace of the package under test (cargo sets the variable when it runs
            // a test), else this crate's own.
            .current_dir(
                std::env::var_os("CARGO_MANIFEST_DIR")
                    .map(PathBuf::from)
                    .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR"))),
            )
            .output()
            .expect("run cargo build -p example-plugin");
        assert!(
            out.status.success(),
            "cargo build -p example-plugin failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8(out.stdout).unwrap();
        for line in text.lines() {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
                continue;
            };
            let name = &v["target"]["name"];
            if v["reason"] == "compiler-artifact"
                && (name == "example_plugin" || name == "example-plugin")
            {
                for f in v["filenames"].as_array().into_iter().flatten() {
                    let f = f.as_str().unwrap();
                    if f.ends_with(std::env::consts::DLL_SUFFIX) {
                        return PathBuf::from(f);
                    }
                }
            }
        }
        panic!("cargo did not report the example-plugin cdylib:\n{text}");
    })
}
