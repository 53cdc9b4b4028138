//! A package's normal dependency tree, read from `cargo tree` offline (the lock file already
//! names every crate): what a user who adds the package compiles.

use std::process::Command;

/// `(name, features)` of every package in `package`'s normal dependency tree, run from
/// `manifest_dir` (a crate's `CARGO_MANIFEST_DIR`).
pub fn tree(manifest_dir: &str, package: &str) -> Vec<(String, Vec<String>)> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(manifest_dir)
        .args(["tree", "--offline", "-p", package, "-e", "normal"])
        .args(["--prefix", "none", "-f", "{p} [{f}]"])
        .output()
        .expect("cargo tree runs");
    assert!(
        out.status.success(),
        "cargo tree failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .expect("UTF-8")
        .lines()
        .filter_map(|l| {
            let name = l.split_whitespace().next()?.to_string();
            let feats = l.rsplit_once('[')?.1.split(']').next()?;
            let feats = feats
                .split(',')
                .filter(|f| !f.is_empty())
                .map(str::to_string)
                .collect();
            Some((name, feats))
        })
        .collect()
}

/// The first package of `tree` named one of `forbidden` (exactly, or as `<name>-…`).
pub fn forbidden_in<'a>(tree: &'a [(String, Vec<String>)], forbidden: &[&str]) -> Option<&'a str> {
    tree.iter().map(|(n, _)| n.as_str()).find(|name| {
        forbidden
            .iter()
            .any(|f| name == f || name.starts_with(&format!("{f}-")))
    })
}
