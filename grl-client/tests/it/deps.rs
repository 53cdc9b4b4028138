//! The client crate stays light enough to embed: its normal dependency tree (what a service
//! that adds `grl-client` compiles) holds no database driver, no command-line parser and no
//! server code. Read from `cargo tree` offline (the lock file already names every crate).

use test_support::cargo::{forbidden_in, tree};

#[test]
fn client_tree_has_no_database_cli_or_server_code() {
    let tree = tree(env!("CARGO_MANIFEST_DIR"), "grl-client");
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
    if let Some(name) = forbidden_in(&tree, &forbidden) {
        panic!("grl-client depends on {name}");
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
