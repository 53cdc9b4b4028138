//! The client crate stays light enough to embed: its normal dependency tree (what a service
//! that adds `grl-client` compiles) holds no database driver, no command-line parser and no
//! server code. Read from `cargo tree` offline (the lock file already names every crate).

use std::process::Command;

/// `name version [features]` of every package in `grl-client`'s normal dependency tree.
fn tree() -> Vec<(String, Vec<String>)> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["tree", "--offline", "-p", "grl-client", "-e", "normal"])
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

#[test]
fn client_tree_has_no_database_cli_or_server_code() {
    let tree = tree();
    // The tree is read: the client's own dependencies are in it.
    for want in ["grl-client", "grl-core", "grl-wire", "reqwest", "tower"] {
        assert!(
            tree.iter().any(|(n, _)| n == want),
            "{want} missing from the tree: {tree:?}"
        );
    }
    let forbidden = [
        "sqlx",
        "clap",
        "axum",
        "tokio-postgres",
        "postgres",
        "libsqlite3-sys",
        "git2",
    ];
    for (name, _) in &tree {
        assert!(
            !forbidden
                .iter()
                .any(|f| name == f || name.starts_with(&format!("{f}-"))),
            "grl-client depends on {name}"
        );
    }
    // hyper and hyper-util come with reqwest, for its client side only.
    for (name, feats) in tree
        .iter()
        .filter(|(n, _)| n == "hyper" || n == "hyper-util")
    {
        assert!(
            !feats
                .iter()
                .any(|f| f == "server" || f.starts_with("server-")),
            "{name} built with server features: {feats:?}"
        );
    }
}
