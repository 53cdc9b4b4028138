//! The sidecar is data plane only: what `grl-sidecar` compiles holds no database driver, no
//! git, and none of the control plane (controller, aggregator, rlc).

use test_support::cargo::{forbidden_in, tree};

#[test]
fn sidecar_tree_has_no_database_git_or_control_plane() {
    let tree = tree(env!("CARGO_MANIFEST_DIR"), "grl-sidecar");
    // The tree is read: the sidecar's own dependencies are in it.
    for want in [
        "grl-sidecar",
        "grl-client",
        "grl-server",
        "grl-core",
        "hyper",
    ] {
        assert!(
            tree.iter().any(|(n, _)| n == want),
            "{want} missing from the tree: {tree:?}"
        );
    }
    let forbidden = [
        "sqlx",
        "tokio-postgres",
        "postgres",
        "libsqlite3-sys",
        "git2",
        "grl-runtime",
        "grl-control",
        "rlc",
        "rlc-plan",
        "policies",
    ];
    if let Some(name) = forbidden_in(&tree, &forbidden) {
        panic!("grl-sidecar depends on {name}");
    }
}
