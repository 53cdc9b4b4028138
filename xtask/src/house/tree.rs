//! The module tree of a crate root: its files, found through `mod` declarations, and what
//! each module defines and imports.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fs;
use std::path::{Path, PathBuf};

use syn::Item;

use super::syntax::{absolute, ident, is_cfg_test, item_attrs, item_name, use_leaves};

/// The source files of one crate, by their path relative to `src/`.
pub(super) trait Source {
    fn read(&self, rel: &Path) -> Option<String>;
    fn exists(&self, rel: &Path) -> bool;
    /// Every `.rs` file, sorted.
    fn files(&self) -> Vec<PathBuf>;
}

pub(super) struct DirSource(pub(super) PathBuf);

impl Source for DirSource {
    fn read(&self, rel: &Path) -> Option<String> {
        fs::read_to_string(self.0.join(rel)).ok()
    }

    fn exists(&self, rel: &Path) -> bool {
        self.0.join(rel).is_file()
    }

    fn files(&self) -> Vec<PathBuf> {
        fn walk(base: &Path, rel: &Path, out: &mut Vec<PathBuf>) {
            let Ok(entries) = fs::read_dir(base.join(rel)) else {
                return;
            };
            for entry in entries.flatten() {
                let path = rel.join(entry.file_name());
                match entry.file_type() {
                    Ok(kind) if kind.is_dir() => walk(base, &path, out),
                    Ok(kind) if kind.is_file() && path.extension().is_some_and(|e| e == "rs") => {
                        out.push(path)
                    }
                    _ => {}
                }
            }
        }
        let mut out = Vec::new();
        walk(&self.0, Path::new(""), &mut out);
        out.sort();
        out
    }
}

/// `lib.rs`, `main.rs`, `bin/x.rs`, `bin/x/main.rs`.
pub(super) fn is_crate_root(rel: &Path) -> bool {
    let parts: Vec<&str> = rel.iter().filter_map(|c| c.to_str()).collect();
    matches!(
        parts.as_slice(),
        ["lib.rs"] | ["main.rs"] | ["bin", _] | ["bin", _, "main.rs"]
    )
}

/// `tests.rs`, `*_tests.rs`, or under a `tests/` directory.
pub(super) fn is_test_file(rel: &Path) -> bool {
    let name = rel.file_name().and_then(|n| n.to_str()).unwrap_or("");
    name == "tests.rs"
        || name.ends_with("_tests.rs")
        || rel
            .parent()
            .is_some_and(|dir| dir.iter().any(|c| c == "tests"))
}

/// The module path of a file from its place: `a/b.rs` and `a/b/mod.rs` are `a::b`.
pub(super) fn module_of(rel: &Path) -> Vec<String> {
    let mut module: Vec<String> = rel
        .with_extension("")
        .iter()
        .filter_map(|c| c.to_str())
        .map(str::to_string)
        .collect();
    if module.last().is_some_and(|m| m == "mod") {
        module.pop();
    }
    module
}

/// Where the `mod child;` declarations of a file find their files: `a.rs` → `a/`, `a/mod.rs`
/// and crate roots → `a/`.
pub(super) fn mod_dir(rel: &Path, crate_root: bool) -> PathBuf {
    let dir = rel.parent().unwrap_or(Path::new("")).to_path_buf();
    if crate_root || rel.file_name().is_some_and(|n| n == "mod.rs") {
        dir
    } else {
        dir.join(rel.file_stem().unwrap_or_default())
    }
}

/// A parsed file of a module tree.
pub(super) struct ParsedFile {
    /// Relative to `src/`.
    pub(super) rel: PathBuf,
    pub(super) module: Vec<String>,
    pub(super) lines: usize,
    pub(super) ast: syn::File,
}

/// What a module (file or inline) defines and imports, to follow re-exports.
#[derive(Default)]
pub(super) struct ModInfo {
    /// The index of its file.
    pub(super) file: usize,
    pub(super) defined: HashSet<String>,
    pub(super) children: HashSet<String>,
    /// `use` names (renamed ones by their new name) → their absolute path.
    pub(super) imports: HashMap<String, Vec<String>>,
    /// The absolute paths of `use …::*`.
    pub(super) globs: Vec<Vec<String>>,
    /// Names imported from other crates (`pub use grl_wire as proto;`): naming them is no
    /// use of this module's file.
    pub(super) external: HashSet<String>,
}

/// The files reachable from one crate root through (non-test) `mod` declarations.
#[derive(Default)]
pub(super) struct Tree {
    pub(super) files: Vec<ParsedFile>,
    /// Every module by its absolute path (`[]` is the crate root).
    pub(super) mods: HashMap<Vec<String>, ModInfo>,
    /// The files of test modules.
    pub(super) excluded: Vec<PathBuf>,
    pub(super) notes: Vec<String>,
}

/// Where a module's `mod child;` declarations are looked up.
pub(super) struct DirCtx {
    pub(super) file: usize,
    /// The declaring file, relative to `src/`.
    pub(super) source: PathBuf,
    /// The directory of the declaring file (`#[path]` outside inline modules).
    pub(super) file_dir: PathBuf,
    /// The directory of the module's children.
    pub(super) dir: PathBuf,
    pub(super) inline: bool,
}

impl Tree {
    /// Loads the file `root` (module path `module`, `[]` for a crate root) and every file its
    /// non-test `mod` declarations reach.
    pub(super) fn load(src: &dyn Source, root: &Path, module: Vec<String>) -> Tree {
        let mut tree = Tree::default();
        let mut queue = VecDeque::from([(root.to_path_buf(), module)]);
        let mut seen = HashSet::new();
        while let Some((rel, module)) = queue.pop_front() {
            if !seen.insert(rel.clone()) {
                continue;
            }
            let Some(text) = src.read(&rel) else {
                tree.notes
                    .push(format!("src/{}: declared but missing", rel.display()));
                continue;
            };
            let ast = match syn::parse_file(&text) {
                Ok(ast) => ast,
                Err(e) => {
                    let line = e.span().start().line;
                    let note = format!("src/{}:{line}: cannot parse: {e}", rel.display());
                    tree.notes.push(note);
                    continue;
                }
            };
            let ctx = DirCtx {
                file: tree.files.len(),
                source: rel.clone(),
                file_dir: rel.parent().unwrap_or(Path::new("")).to_path_buf(),
                dir: mod_dir(&rel, module.is_empty()),
                inline: false,
            };
            queue.extend(tree.declare(src, &ast.items, &module, &ctx));
            let lines = text.lines().count();
            tree.files.push(ParsedFile {
                rel,
                module,
                lines,
                ast,
            });
        }
        tree
    }

    /// Records the module `module` made of `items`; returns the files of its `mod child;`.
    pub(super) fn declare(
        &mut self,
        src: &dyn Source,
        items: &[Item],
        module: &[String],
        ctx: &DirCtx,
    ) -> Vec<(PathBuf, Vec<String>)> {
        let mut info = ModInfo {
            file: ctx.file,
            ..ModInfo::default()
        };
        let mut found = Vec::new();
        for item in items {
            if is_cfg_test(item_attrs(item)) {
                if let Item::Mod(m @ syn::ItemMod { content: None, .. }) = item {
                    self.excluded.extend(mod_file(src, m, ctx));
                }
                continue;
            }
            if let Some(name) = item_name(item) {
                info.defined.insert(name);
            }
            let Item::Mod(m) = item else { continue };
            let name = ident(&m.ident);
            info.children.insert(name.clone());
            let child = [module, std::slice::from_ref(&name)].concat();
            match (&m.content, mod_file(src, m, ctx)) {
                (Some((_, items)), _) => {
                    let inner = DirCtx {
                        source: ctx.source.clone(),
                        file_dir: ctx.file_dir.clone(),
                        dir: ctx.dir.join(&name),
                        inline: true,
                        ..*ctx
                    };
                    found.extend(self.declare(src, items, &child, &inner));
                }
                (None, Some(rel)) if is_test_file(&rel) => self.excluded.push(rel),
                (None, Some(rel)) => found.push((rel, child)),
                (None, None) => self
                    .notes
                    .push(format!("src/{}: mod {name}: no file", ctx.source.display())),
            }
        }
        for item in items {
            let Item::Use(u) = item else { continue };
            if is_cfg_test(&u.attrs) || u.leading_colon.is_some() {
                continue;
            }
            for leaf in use_leaves(&u.tree) {
                let Some(target) = absolute(module, &leaf.path, &info.children) else {
                    let local = leaf.path.first().is_some_and(|f| info.defined.contains(f));
                    if let Some(alias) = leaf.alias.filter(|_| !local) {
                        info.external.insert(alias);
                    }
                    continue;
                };
                match leaf.alias {
                    Some(alias) if alias == "_" => {}
                    Some(alias) => {
                        info.imports.insert(alias, target);
                    }
                    None => info.globs.push(target),
                }
            }
        }
        self.mods.insert(module.to_vec(), info);
        found
    }

    /// The file an absolute path names: the longest module prefix, followed through the
    /// module's imports and globs when the next name is not its own; none for a name imported
    /// from another crate.
    pub(super) fn resolve(&self, path: &[String], depth: usize) -> Option<usize> {
        let mut k = path.len();
        while k > 0 && !self.mods.contains_key(&path[..k]) {
            k -= 1;
        }
        let info = self.mods.get(&path[..k])?;
        let Some(name) = path.get(k) else {
            return Some(info.file);
        };
        if info.external.contains(name) && !info.defined.contains(name) {
            return None;
        }
        if depth < 8 && !info.defined.contains(name) {
            let next = match info.imports.get(name) {
                Some(target) => Some([target, &path[k + 1..]].concat()),
                None => info
                    .globs
                    .iter()
                    .find(|glob| {
                        self.mods.get(*glob).is_some_and(|m| {
                            m.defined.contains(name) || m.imports.contains_key(name)
                        })
                    })
                    .map(|glob| [glob, &path[k..]].concat()),
            };
            if let Some(found) = next.and_then(|next| self.resolve(&next, depth + 1)) {
                return Some(found);
            }
        }
        Some(info.file)
    }
}

/// The file of `mod name;`: its `#[path]`, `dir/name.rs` or `dir/name/mod.rs`.
pub(super) fn mod_file(src: &dyn Source, m: &syn::ItemMod, ctx: &DirCtx) -> Option<PathBuf> {
    let name = ident(&m.ident);
    let path_attr = m.attrs.iter().find_map(|attr| match &attr.meta {
        syn::Meta::NameValue(nv) if nv.path.is_ident("path") => match &nv.value {
            syn::Expr::Lit(syn::ExprLit {
                lit: syn::Lit::Str(s),
                ..
            }) => Some(s.value()),
            _ => None,
        },
        _ => None,
    });
    if let Some(path) = path_attr {
        let base = if ctx.inline { &ctx.dir } else { &ctx.file_dir };
        return Some(base.join(path));
    }
    [
        ctx.dir.join(format!("{name}.rs")),
        ctx.dir.join(&name).join("mod.rs"),
    ]
    .into_iter()
    .find(|rel| src.exists(rel))
}
