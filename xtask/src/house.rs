//! `cargo xtask house [--check]`: the house-keeping figures, measured over the
//! `src/` of every workspace member (the `members` of the root `Cargo.toml`):
//!
//! 1. import circles per crate at file level. Every `.rs` file is a module; file A uses file B
//!    when A's code names a path that resolves into B: `crate::…`, `super::…`, `self::…` or a
//!    child module's `child::…`, in code, in `use` trees (groups included) and in the arguments
//!    of macros. A path resolves to the longest module prefix that is a file, following `use`
//!    re-exports (`crate::Engine`, re-exported by `lib.rs` from `engine.rs`, is a use of
//!    `engine.rs`). A `mod child;` declaration alone is no use. The library and each binary
//!    (`main.rs`, `bin/*.rs`) are separate module trees;
//! 2. functions over 100 and over 200 lines, from `fn` to the closing brace (free functions,
//!    methods, trait default methods, nested functions);
//! 3. files over 1,000 and over 1,500 lines;
//! 4. string errors: `Result<_, String>` types.
//!
//! Test code is left out everywhere: items under `#[cfg(test)]`, and the files `tests.rs`,
//! `*_tests.rs`, those under a `tests/` directory and those declared under `#[cfg(test)]`.
//! With `--check` the command exits 1 when a figure is over its bounds.

mod graph;
mod scan;
mod syntax;
mod tree;

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use graph::Circle;
use scan::{scan, FileScan};
use tree::{is_crate_root, is_test_file, mod_dir, module_of, DirSource, Source, Tree};

/// A function this long is counted as long; at most [`MAX_LONG_FNS`] may be.
const LONG_FN: usize = 100;
/// No function may be longer.
const MAX_FN: usize = 200;
const MAX_LONG_FNS: usize = 15;
/// A file this long is counted.
const LONG_FILE: usize = 1_000;
/// No file may be longer.
const MAX_FILE: usize = 1_500;
const MAX_STRING_ERRORS: usize = 10;

/// `cargo xtask house [--check]`: prints the figures; with `--check`, 1 when one is over its
/// bound.
pub fn run(root: &Path, args: &[String]) -> Result<u8> {
    let check = match args {
        [] => false,
        [flag] if flag == "--check" => true,
        _ => bail!("usage: cargo xtask house [--check]"),
    };
    let reports = analyse_workspace(root)?;
    print!("{}", render(&reports));
    let failures = failures(&reports);
    if !check {
        return Ok(0);
    }
    if failures.is_empty() {
        println!("check: every figure within its bounds");
        return Ok(0);
    }
    for failure in &failures {
        println!("check failed: {failure}");
    }
    Ok(1)
}

/// The figures of one crate.
#[derive(Default)]
struct CrateReport {
    /// The member's path in the workspace (`grl-runtime`).
    name: String,
    circles: Vec<Circle>,
    /// Functions over [`LONG_FN`] lines.
    long_fns: Vec<FnSize>,
    /// Files over [`LONG_FILE`] lines.
    long_files: Vec<(String, usize)>,
    /// `Result<_, String>` as a return type (of a function, closure or `Fn` bound).
    string_errors: Vec<Site>,
    /// `Result<_, String>` elsewhere: fields, aliases, statics, bindings.
    other_string_errors: Vec<Site>,
    fn_count: usize,
    file_count: usize,
    /// Files declared but missing, unparsable or declared by no module.
    notes: Vec<String>,
}

struct FnSize {
    /// `file:line`, from the workspace root.
    site: String,
    name: String,
    lines: usize,
}

struct Site {
    /// `file:line`, from the workspace root.
    site: String,
    /// The enclosing functions and types (`Engine::run`).
    context: String,
}

fn analyse_workspace(root: &Path) -> Result<Vec<CrateReport>> {
    let manifest = fs::read_to_string(root.join("Cargo.toml")).context("reading Cargo.toml")?;
    Ok(members(&manifest)
        .into_iter()
        .filter(|member| root.join(member).join("src").is_dir())
        .map(|member| analyse_crate(&member, &DirSource(root.join(&member).join("src"))))
        .collect())
}

/// The `members = [...]` of a workspace manifest.
fn members(manifest: &str) -> Vec<String> {
    let Some(start) = manifest.lines().position(|line| {
        line.trim_start()
            .strip_prefix("members")
            .is_some_and(|rest| rest.trim_start().starts_with('='))
    }) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for line in manifest.lines().skip(start) {
        let code = line.split('#').next().unwrap_or("");
        out.extend(code.split('"').skip(1).step_by(2).map(str::to_string));
        if code.contains(']') {
            break;
        }
    }
    out
}

fn analyse_crate(name: &str, src: &dyn Source) -> CrateReport {
    let files = src.files();
    let mut report = CrateReport {
        name: name.to_string(),
        ..CrateReport::default()
    };
    let mut measured = BTreeSet::new();
    let mut excluded = Vec::new();
    for root in files.iter().filter(|rel| is_crate_root(rel)) {
        let tree = Tree::load(src, root, Vec::new());
        let scans: Vec<FileScan> = tree.files.iter().map(|f| scan(&tree, f)).collect();
        let label = if root == Path::new("lib.rs") {
            String::new()
        } else {
            format!("[{}]", root.display())
        };
        report
            .circles
            .extend(tree.circles(&scans).into_iter().map(|c| Circle {
                tree: label.clone(),
                ..c
            }));
        report.measure(&tree, &scans, &mut measured);
        excluded.extend(tree.excluded);
        report.notes.extend(tree.notes);
    }
    for rel in &files {
        let under_excluded = excluded
            .iter()
            .any(|e| rel == e || rel.starts_with(mod_dir(e, false)));
        if measured.contains(rel) || is_test_file(rel) || under_excluded {
            continue;
        }
        report.notes.push(format!(
            "{name}/src/{}: declared by no module (measured anyway)",
            rel.display()
        ));
        let tree = Tree::load(src, rel, module_of(rel));
        let scans: Vec<FileScan> = tree.files.iter().map(|f| scan(&tree, f)).collect();
        report.measure(&tree, &scans, &mut measured);
        report.notes.extend(tree.notes);
    }
    report.notes = report
        .notes
        .iter()
        .map(|n| format!("{name}: {n}"))
        .collect();
    report
}

impl CrateReport {
    /// Adds the sizes and string errors of the tree's files not measured yet.
    fn measure(&mut self, tree: &Tree, scans: &[FileScan], measured: &mut BTreeSet<PathBuf>) {
        for (file, scan) in tree.files.iter().zip(scans) {
            if !measured.insert(file.rel.clone()) {
                continue;
            }
            let path = format!("{}/src/{}", self.name, file.rel.display());
            self.file_count += 1;
            if file.lines > LONG_FILE {
                self.long_files.push((path.clone(), file.lines));
            }
            self.fn_count += scan.fns.len();
            let long = scan.fns.iter().filter(|f| f.lines > LONG_FN);
            self.long_fns.extend(long.map(|f| FnSize {
                site: format!("{path}:{}", f.line),
                name: f.name.clone(),
                lines: f.lines,
            }));
            for error in &scan.string_errors {
                let site = Site {
                    site: format!("{path}:{}", error.line),
                    context: error.context.clone(),
                };
                match error.returned {
                    true => self.string_errors.push(site),
                    false => self.other_string_errors.push(site),
                }
            }
        }
    }
}

fn render(reports: &[CrateReport]) -> String {
    let mut out = String::new();
    let mut line = |text: String| {
        out.push_str(&text);
        out.push('\n');
    };
    line("== import circles, file level, per crate".into());
    for report in reports {
        for circle in &report.circles {
            let (name, tree) = (&report.name, &circle.tree);
            line(format!(
                "{name}{tree}: circle: {}",
                circle.files.join(" <-> ")
            ));
            circle.uses.iter().for_each(|u| line(format!("    {u}")));
        }
        let n = report.circles.len();
        let s = if n == 1 { "" } else { "s" };
        line(format!("{}: {n} circle{s}", report.name));
    }
    let totals = Totals::of(reports);
    line(format!("circles in total: {}", totals.circles));
    line(String::new());
    let mut fns: Vec<&FnSize> = reports.iter().flat_map(|r| &r.long_fns).collect();
    fns.sort_by(|a, b| b.lines.cmp(&a.lines).then(a.site.cmp(&b.site)));
    line(format!(
        "== functions over {LONG_FN} lines: {} (over {MAX_FN}: {}), of {} functions",
        totals.long_fns, totals.huge_fns, totals.fns
    ));
    for f in fns {
        line(format!("{:>5}  {}  {}", f.lines, f.site, f.name));
    }
    line(String::new());
    let mut files: Vec<&(String, usize)> = reports.iter().flat_map(|r| &r.long_files).collect();
    files.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    line(format!(
        "== files over {MAX_FILE} lines: {} (over {LONG_FILE}: {}), of {} files",
        totals.huge_files,
        files.len(),
        totals.files
    ));
    for (file, lines) in files.iter().filter(|f| f.1 > MAX_FILE) {
        line(format!("{lines:>5}  {file}"));
    }
    line(String::new());
    line(format!(
        "== string errors (Result<_, String> as a return type): {}",
        totals.string_errors
    ));
    for site in reports.iter().flat_map(|r| &r.string_errors) {
        line(format!("  {}  {}", site.site, site.context));
    }
    let others: Vec<&Site> = reports
        .iter()
        .flat_map(|r| &r.other_string_errors)
        .collect();
    line(format!(
        "   and elsewhere (fields, aliases, statics, bindings; not counted): {}",
        others.len()
    ));
    for site in others {
        line(format!("  {}  {}", site.site, site.context));
    }
    let notes: Vec<&String> = reports.iter().flat_map(|r| &r.notes).collect();
    if !notes.is_empty() {
        line(String::new());
        line("== notes".into());
        notes.iter().for_each(|n| line(format!("  {n}")));
    }
    out
}

/// The workspace's figures.
struct Totals {
    circles: usize,
    fns: usize,
    long_fns: usize,
    huge_fns: usize,
    files: usize,
    huge_files: usize,
    string_errors: usize,
}

impl Totals {
    fn of(reports: &[CrateReport]) -> Totals {
        let sum = |f: &dyn Fn(&CrateReport) -> usize| reports.iter().map(f).sum();
        Totals {
            circles: sum(&|r| r.circles.len()),
            fns: sum(&|r| r.fn_count),
            long_fns: sum(&|r| r.long_fns.len()),
            huge_fns: sum(&|r| r.long_fns.iter().filter(|f| f.lines > MAX_FN).count()),
            files: sum(&|r| r.file_count),
            huge_files: sum(&|r| r.long_files.iter().filter(|f| f.1 > MAX_FILE).count()),
            string_errors: sum(&|r| r.string_errors.len()),
        }
    }
}

/// The figures over its bounds.
fn failures(reports: &[CrateReport]) -> Vec<String> {
    let totals = Totals::of(reports);
    let mut out = Vec::new();
    for report in reports.iter().filter(|r| !r.circles.is_empty()) {
        out.push(format!(
            "{}: {} import circle(s), want none",
            report.name,
            report.circles.len()
        ));
    }
    if totals.huge_fns > 0 {
        let n = totals.huge_fns;
        out.push(format!("{n} function(s) over {MAX_FN} lines, want none"));
    }
    if totals.long_fns > MAX_LONG_FNS {
        let n = totals.long_fns;
        out.push(format!(
            "{n} functions over {LONG_FN} lines, want at most {MAX_LONG_FNS}"
        ));
    }
    if totals.huge_files > 0 {
        let n = totals.huge_files;
        out.push(format!("{n} file(s) over {MAX_FILE} lines, want none"));
    }
    if totals.string_errors > MAX_STRING_ERRORS {
        let n = totals.string_errors;
        out.push(format!(
            "{n} string errors, want at most {MAX_STRING_ERRORS}"
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    impl Source for BTreeMap<PathBuf, String> {
        fn read(&self, rel: &Path) -> Option<String> {
            self.get(rel).cloned()
        }

        fn exists(&self, rel: &Path) -> bool {
            self.contains_key(rel)
        }

        fn files(&self) -> Vec<PathBuf> {
            self.keys().cloned().collect()
        }
    }

    fn analyse(files: &[(&str, &str)]) -> CrateReport {
        let src: BTreeMap<PathBuf, String> = files
            .iter()
            .map(|(path, text)| (PathBuf::from(path), text.to_string()))
            .collect();
        analyse_crate("fixture", &src)
    }

    fn circles(report: &CrateReport) -> Vec<String> {
        let files = report.circles.iter().map(|c| c.files.join(" <-> "));
        files.collect()
    }

    #[test]
    fn a_circle_between_two_files_is_found() {
        let report = analyse(&[
            ("lib.rs", "mod a;\nmod b;\n"),
            ("a.rs", "use crate::b::B;\npub struct A;\n"),
            ("b.rs", "pub struct B;\nfn f() -> super::a::A { todo!() }\n"),
        ]);
        assert_eq!(circles(&report), ["a.rs <-> b.rs"]);
        assert_eq!(
            report.circles[0].uses,
            [
                "a.rs:1 -> b.rs (crate::b::B)",
                "b.rs:2 -> a.rs (super::a::A)"
            ]
        );
    }

    #[test]
    fn uses_in_groups_macros_and_through_re_exports_count() {
        let report = analyse(&[
            ("lib.rs", "mod a;\nmod b;\nmod c;\npub use a::*;\n"),
            (
                "a.rs",
                "pub struct A;\nfn f() { println!(\"{}\", crate::b::g()); }\n",
            ),
            ("b.rs", "use crate::{c::{self}, A};\npub fn g() {}\n"),
            ("c.rs", "pub fn h() {}\n"),
        ]);
        // b → a through the glob re-export of lib.rs, a → b in a macro's arguments
        assert_eq!(circles(&report), ["a.rs <-> b.rs"]);
        let declared_only = analyse(&[
            ("lib.rs", "mod a;\npub struct Root;\n"),
            ("a.rs", "use crate::Root;\n"),
        ]);
        assert!(declared_only.circles.is_empty(), "`mod a;` is no use of a");
        let external = analyse(&[
            (
                "lib.rs",
                "mod a;\npub use std::collections as coll;\npub fn f() { a::g() }\n",
            ),
            ("a.rs", "use crate::coll::HashMap;\npub fn g() {}\n"),
        ]);
        assert!(
            external.circles.is_empty(),
            "a re-exported crate is no use of lib.rs"
        );
    }

    #[test]
    fn a_child_using_its_parent_is_no_circle_but_siblings_are() {
        let parent_child = analyse(&[
            ("lib.rs", "mod serve;\n"),
            (
                "serve.rs",
                "mod auth;\npub struct State;\npub fn f() { auth::g() }\n",
            ),
            ("serve/auth.rs", "use super::State;\npub fn g() {}\n"),
        ]);
        assert!(
            parent_child.circles.is_empty(),
            "{:?}",
            circles(&parent_child)
        );
        let siblings = analyse(&[
            ("lib.rs", "mod serve;\n"),
            ("serve.rs", "mod a;\nmod b;\n"),
            ("serve/a.rs", "use super::b::B;\npub struct A;\n"),
            ("serve/b.rs", "use super::a::A;\npub struct B;\n"),
        ]);
        assert_eq!(circles(&siblings), ["serve/a.rs <-> serve/b.rs"]);
    }

    #[test]
    fn test_code_is_ignored() {
        let report = analyse(&[
            ("lib.rs", "mod a;\nmod b;\n#[cfg(test)]\nmod helpers;\n"),
            (
                "a.rs",
                "use crate::b::B;\n#[cfg(test)]\nmod tests {\n    fn t() -> Result<u8, String> { Ok(1) }\n}\n",
            ),
            (
                "b.rs",
                "pub struct B;\n#[cfg(test)]\nmod tests {\n    use crate::a::*;\n}\n#[cfg(test)]\nmod more;\n",
            ),
            ("b/more.rs", "use crate::a::A;\n"),
            ("b/tests.rs", "use crate::a::A;\n"),
            ("b_tests.rs", "use crate::a::A;\n"),
            ("helpers.rs", "use crate::a::A;\n"),
        ]);
        assert!(report.circles.is_empty(), "{:?}", circles(&report));
        assert!(report.string_errors.is_empty());
        assert_eq!(report.fn_count, 0);
        assert_eq!(report.file_count, 3);
        assert!(report.notes.is_empty(), "{:?}", report.notes);
    }

    #[test]
    fn a_functions_lines_run_from_fn_to_its_closing_brace() {
        let long_body = "    let _x = 1;\n".repeat(LONG_FN);
        let text = format!(
            "/// doc\n#[inline]\npub fn short() {{\n    let _ = 1;\n}}\n\nfn long() {{\n{long_body}}}\nstruct S;\nimpl S {{\n    fn m(&self) {{}}\n}}\n"
        );
        let src: BTreeMap<PathBuf, String> = BTreeMap::from([("lib.rs".into(), text)]);
        let tree = Tree::load(&src, Path::new("lib.rs"), Vec::new());
        let fns = scan(&tree, &tree.files[0]).fns;
        let sizes: Vec<(&str, usize, usize)> = fns
            .iter()
            .map(|f| (f.name.as_str(), f.line, f.lines))
            .collect();
        assert_eq!(
            sizes,
            [
                ("short", 3, 3),
                ("long", 7, LONG_FN + 2),
                ("S::m", 11 + LONG_FN, 1)
            ]
        );
        let report = analyse_crate("fixture", &src);
        assert_eq!(report.long_fns.len(), 1);
        assert_eq!(report.long_fns[0].site, "fixture/src/lib.rs:7");
    }

    #[test]
    fn only_result_with_a_string_error_is_a_string_error() {
        let report = analyse(&[(
            "lib.rs",
            "pub struct MyError;\npub fn a() -> Result<u8, String> { Ok(1) }\npub fn b() -> Result<u8, MyError> { Ok(1) }\npub fn c() -> std::result::Result<(), std::string::String> { Ok(()) }\nstruct S { field: Result<u8, String> }\n",
        )]);
        let sites: Vec<&str> = report
            .string_errors
            .iter()
            .map(|s| s.site.as_str())
            .collect();
        assert_eq!(sites, ["fixture/src/lib.rs:2", "fixture/src/lib.rs:4"]);
        assert_eq!(report.string_errors[0].context, "a");
        let others = &report.other_string_errors;
        assert_eq!(others.len(), 1);
        assert_eq!(
            (others[0].site.as_str(), others[0].context.as_str()),
            ("fixture/src/lib.rs:5", "S")
        );
    }

    #[test]
    fn members_are_read_from_the_manifest() {
        let manifest = "[workspace]\nmembers = [\n    \"a\", # one\n    \"b\",\n]\ndefault-members = [\"c\"]\n";
        assert_eq!(members(manifest), ["a", "b"]);
    }

    /// No import circle between the files of any crate (a file may use its ancestors).
    #[test]
    fn no_import_circle_in_any_crate() {
        let reports = analyse_workspace(&crate::workspace_root()).expect("the workspace");
        let circles: Vec<String> = reports
            .iter()
            .flat_map(|r| {
                r.circles.iter().map(move |c| {
                    format!(
                        "{}{}: {}\n    {}",
                        r.name,
                        c.tree,
                        c.files.join(" <-> "),
                        c.uses.join("\n    ")
                    )
                })
            })
            .collect();
        assert!(
            circles.is_empty(),
            "import circles:\n{}",
            circles.join("\n")
        );
    }
}
