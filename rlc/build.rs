//! Embeds `config-repo-template/` in the binary (`TEMPLATE` in `$OUT_DIR/template.rs`), so
//! that `rlc demo` works from any directory.

use std::path::{Path, PathBuf};

fn walk(root: &Path, dir: &Path, out: &mut Vec<(String, PathBuf, bool)>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.expect("directory entry"))
        .collect();
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let path = e.path();
        let meta = std::fs::metadata(&path).expect("metadata");
        if meta.is_dir() {
            walk(root, &path, out);
        } else {
            use std::os::unix::fs::PermissionsExt;
            let rel = path
                .strip_prefix(root)
                .unwrap()
                .to_string_lossy()
                .into_owned();
            out.push((rel, path.clone(), meta.permissions().mode() & 0o111 != 0));
        }
    }
}

fn main() {
    // The manifest directory of this build, read when the script runs: `env!` would bake in
    // the directory the script was compiled in, and cargo reuses a compiled build script
    // for a checkout at another path (a second worktree sharing the target directory).
    let manifest = std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR (set by cargo)");
    let root = Path::new(&manifest)
        .join("../config-repo-template")
        .canonicalize()
        .expect("config-repo-template/ next to rlc/");
    println!("cargo:rerun-if-changed={}", root.display());
    let mut files = Vec::new();
    walk(&root, &root, &mut files);
    let mut src = String::from(
        "/// `config-repo-template/`: (path relative to it, contents, executable).\n\
         pub static TEMPLATE: &[(&str, &[u8], bool)] = &[\n",
    );
    for (rel, path, exec) in &files {
        println!("cargo:rerun-if-changed={}", path.display());
        src.push_str(&format!(
            "    ({rel:?}, include_bytes!({:?}), {exec}),\n",
            path.display().to_string()
        ));
    }
    src.push_str("];\n");
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap()).join("template.rs");
    std::fs::write(out, src).expect("writing template.rs");
}
