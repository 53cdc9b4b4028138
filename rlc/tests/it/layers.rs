//! The layers of `rlc` (ARCHITECTURE.md): each module imports only modules of a layer below
//! its own, so that there is no import circle and the data flow reads top to bottom:
//! adapters → the orchestrator of a run → readers and writers of the world → base; the plan
//! itself is the `rlc-plan` crate, which has no I/O dependency at all.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Every top-level module of `rlc/src` and its layer (1 is the top).
const LAYERS: &[(&str, u32)] = &[
    // adapters
    ("cmd", 1),
    ("serve", 1),
    // the orchestrator of a run
    ("cycle", 2),
    // readers and writers of the world, the one that gathers them on top
    ("gather", 3),
    ("quota_view", 3),
    ("shadow", 4),
    ("journal", 4),
    ("rollout", 4),
    ("gitops", 5),
    ("store", 5),
    ("history", 5),
    ("push", 6),
    // base
    ("config", 7),
    ("retry", 7),
    ("exit", 8),
];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The modules of `crate::` that `text` names in code (comments left out: a doc may point
/// up, to who calls it), outside its test module.
fn imports(text: &str) -> BTreeSet<String> {
    let code: String = text
        .split("#[cfg(test)]\nmod tests")
        .next()
        .unwrap_or_default()
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n");
    let mut out = BTreeSet::new();
    let mut rest = code.as_str();
    while let Some(i) = rest.find("crate::") {
        rest = &rest[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for item in group[..end].split(',') {
                let name = item.trim().split("::").next().unwrap_or_default();
                if !name.is_empty() {
                    out.insert(name.to_string());
                }
            }
        } else {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() {
                out.insert(name);
            }
        }
    }
    out
}

#[test]
fn modules_import_only_the_layers_below() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let layer: BTreeMap<&str, u32> = LAYERS.iter().copied().collect();
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut seen: BTreeSet<String> = BTreeSet::new();
    let mut wrong = Vec::new();
    for f in &files {
        let rel = f.strip_prefix(&src).unwrap();
        let name = rel.to_string_lossy();
        // Unit-test files may reach anywhere.
        if name.ends_with("tests.rs") || name.ends_with("store_faults.rs") {
            continue;
        }
        let top = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_string();
        if top == "lib" || top == "main" {
            continue;
        }
        let Some(&mine) = layer.get(top.as_str()) else {
            wrong.push(format!("{name}: module `{top}` has no layer in this test"));
            continue;
        };
        seen.insert(top.clone());
        for dep in imports(&std::fs::read_to_string(f).unwrap()) {
            // Items of the crate root (re-exports of rlc-plan, BoxFuture) are below everything.
            let Some(&theirs) = layer.get(dep.as_str()) else {
                continue;
            };
            if dep != top && theirs <= mine {
                wrong.push(format!(
                    "{name} (`{top}`, layer {mine}) imports `{dep}` (layer {theirs})"
                ));
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    let listed: BTreeSet<String> = LAYERS.iter().map(|(m, _)| m.to_string()).collect();
    assert_eq!(seen, listed, "every listed module exists");
}

#[test]
fn the_plan_crate_has_no_io_dependency() {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../rlc-plan/Cargo.toml");
    let text = std::fs::read_to_string(manifest).unwrap();
    let deps = text
        .split("[dependencies]")
        .nth(1)
        .unwrap()
        .split("\n[")
        .next()
        .unwrap();
    for io in [
        "tokio",
        "reqwest",
        "git2",
        "sqlx",
        "axum",
        "hyper",
        "grl-runtime",
        "rlc",
    ] {
        assert!(
            !deps
                .lines()
                .any(|l| l.split(['.', ' ', '=']).next() == Some(io)),
            "rlc-plan depends on {io}"
        );
    }
}
