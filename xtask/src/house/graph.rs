//! Import circles: the strongly connected sets of a module tree's file-level use graph.

use std::collections::BTreeMap;

use super::scan::FileScan;
use super::tree::Tree;

/// One strongly connected set of files of a module tree.
pub(super) struct Circle {
    /// `""` for the library, `[main.rs]` for a binary.
    pub(super) tree: String,
    /// Relative to `src/`, sorted.
    pub(super) files: Vec<String>,
    /// The uses between them: `a.rs:12 -> b.rs (crate::b::B)`.
    pub(super) uses: Vec<String>,
}

impl Tree {
    /// The circles (sets of more than one file) of the tree's file-level use graph. A file
    /// naming an item of one of its ancestor modules (`super::AppState` in `serve/auth.rs`)
    /// is no edge: a module's parent is its namespace, as a folder's `mod.rs` is; the
    /// circles that count run between siblings and cousins.
    pub(super) fn circles(&self, scans: &[FileScan]) -> Vec<Circle> {
        let mut uses: BTreeMap<(usize, usize), (usize, String)> = BTreeMap::new();
        for (from, scan) in scans.iter().enumerate() {
            for r in &scan.refs {
                let Some(to) = self.resolve(&r.path, 0).filter(|&to| to != from) else {
                    continue;
                };
                if self.files[from].module.starts_with(&self.files[to].module) {
                    continue;
                }
                let first = uses.entry((from, to)).or_insert((r.line, r.text.clone()));
                if r.line < first.0 {
                    *first = (r.line, r.text.clone());
                }
            }
        }
        let mut adjacency = vec![Vec::new(); self.files.len()];
        for &(from, to) in uses.keys() {
            adjacency[from].push(to);
        }
        let name = |i: usize| self.files[i].rel.display().to_string();
        let mut circles: Vec<Circle> = strongly_connected(&adjacency)
            .into_iter()
            .filter(|set| set.len() > 1)
            .map(|set| Circle {
                tree: String::new(),
                files: {
                    let mut files: Vec<String> = set.iter().map(|&i| name(i)).collect();
                    files.sort();
                    files
                },
                uses: {
                    let mut within: Vec<String> = uses
                        .iter()
                        .filter(|((from, to), _)| set.contains(from) && set.contains(to))
                        .map(|((from, to), (line, text))| {
                            format!("{}:{line} -> {} ({text})", name(*from), name(*to))
                        })
                        .collect();
                    within.sort();
                    within
                },
            })
            .collect();
        circles.sort_by(|a, b| a.files.cmp(&b.files));
        circles
    }
}

/// Tarjan's strongly connected components.
pub(super) fn strongly_connected(adjacency: &[Vec<usize>]) -> Vec<Vec<usize>> {
    struct Tarjan<'a> {
        adjacency: &'a [Vec<usize>],
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        on_stack: Vec<bool>,
        stack: Vec<usize>,
        next: usize,
        out: Vec<Vec<usize>>,
    }
    impl Tarjan<'_> {
        fn connect(&mut self, v: usize) {
            self.index[v] = Some(self.next);
            self.low[v] = self.next;
            self.next += 1;
            self.stack.push(v);
            self.on_stack[v] = true;
            let adjacency = self.adjacency;
            for &w in &adjacency[v] {
                match self.index[w] {
                    None => {
                        self.connect(w);
                        self.low[v] = self.low[v].min(self.low[w]);
                    }
                    Some(index) if self.on_stack[w] => self.low[v] = self.low[v].min(index),
                    Some(_) => {}
                }
            }
            if self.index[v] == Some(self.low[v]) {
                let mut set = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack[w] = false;
                    set.push(w);
                    if w == v {
                        break;
                    }
                }
                self.out.push(set);
            }
        }
    }
    let n = adjacency.len();
    let mut tarjan = Tarjan {
        adjacency,
        index: vec![None; n],
        low: vec![0; n],
        on_stack: vec![false; n],
        stack: Vec::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in 0..n {
        if tarjan.index[v].is_none() {
            tarjan.connect(v);
        }
    }
    tarjan.out
}
