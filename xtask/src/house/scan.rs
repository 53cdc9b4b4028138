//! What the non-test code of one file names (paths into the crate) and holds (functions,
//! string errors).

use std::collections::HashSet;

use syn::visit::{self, Visit};
use syn::{Block, ImplItem, Item, Signature, TraitItem, Type, Visibility};

use super::syntax::{
    absolute, ident, is_cfg_test, is_string_result, item_attrs, token_paths, use_leaves,
};
use super::tree::{ParsedFile, Tree};

/// A path of a file naming the crate, made absolute.
pub(super) struct Ref {
    pub(super) path: Vec<String>,
    pub(super) line: usize,
    /// As written.
    pub(super) text: String,
}

pub(super) struct FnSpan {
    pub(super) name: String,
    pub(super) line: usize,
    pub(super) lines: usize,
}

/// A `Result<_, String>`.
pub(super) struct StringError {
    pub(super) line: usize,
    /// The enclosing items (`Engine::run`).
    pub(super) context: String,
    /// Within a return type.
    pub(super) returned: bool,
}

/// What the non-test code of one file names and holds.
#[derive(Default)]
pub(super) struct FileScan {
    pub(super) refs: Vec<Ref>,
    pub(super) fns: Vec<FnSpan>,
    pub(super) string_errors: Vec<StringError>,
}

pub(super) fn scan(tree: &Tree, file: &ParsedFile) -> FileScan {
    let mut scanner = Scanner {
        tree,
        module: file.module.clone(),
        names: Vec::new(),
        in_return: false,
        scan: FileScan::default(),
    };
    scanner.visit_file(&file.ast);
    scanner.scan
}

/// Walks a file's non-test code.
pub(super) struct Scanner<'a> {
    pub(super) tree: &'a Tree,
    /// The current module, inline modules included.
    pub(super) module: Vec<String>,
    /// The enclosing types, traits and functions.
    pub(super) names: Vec<String>,
    /// Within a return type.
    pub(super) in_return: bool,
    pub(super) scan: FileScan,
}

impl Scanner<'_> {
    pub(super) fn add_ref(&mut self, path: Vec<String>, line: usize, min_len: usize) {
        if path.len() < min_len {
            return;
        }
        let none = HashSet::new();
        let children = self
            .tree
            .mods
            .get(&self.module)
            .map_or(&none, |m| &m.children);
        if let Some(absolute) = absolute(&self.module, &path, children) {
            let text = path.join("::");
            self.scan.refs.push(Ref {
                path: absolute,
                line,
                text,
            });
        }
    }

    pub(super) fn add_fn(&mut self, sig: &Signature, block: &Block) {
        let line = sig.fn_token.span.start().line;
        let end = block.brace_token.span.close().end().line;
        let name = self.qualified(&ident(&sig.ident));
        let lines = end + 1 - line;
        self.scan.fns.push(FnSpan { name, line, lines });
    }

    pub(super) fn qualified(&self, name: &str) -> String {
        let mut names = self.names.clone();
        names.push(name.to_string());
        names.join("::")
    }

    pub(super) fn within<F: FnOnce(&mut Self)>(&mut self, name: String, f: F) {
        self.names.push(name);
        f(self);
        self.names.pop();
    }
}

impl<'ast> Visit<'ast> for Scanner<'_> {
    fn visit_item(&mut self, item: &'ast Item) {
        if !is_cfg_test(item_attrs(item)) {
            visit::visit_item(self, item);
        }
    }

    fn visit_impl_item(&mut self, item: &'ast ImplItem) {
        let attrs = match item {
            ImplItem::Const(i) => &i.attrs,
            ImplItem::Fn(i) => &i.attrs,
            ImplItem::Type(i) => &i.attrs,
            ImplItem::Macro(i) => &i.attrs,
            _ => return,
        };
        if !is_cfg_test(attrs) {
            visit::visit_impl_item(self, item);
        }
    }

    fn visit_trait_item(&mut self, item: &'ast TraitItem) {
        let attrs = match item {
            TraitItem::Const(i) => &i.attrs,
            TraitItem::Fn(i) => &i.attrs,
            TraitItem::Type(i) => &i.attrs,
            TraitItem::Macro(i) => &i.attrs,
            _ => return,
        };
        if !is_cfg_test(attrs) {
            visit::visit_trait_item(self, item);
        }
    }

    fn visit_item_mod(&mut self, item: &'ast syn::ItemMod) {
        if item.content.is_some() {
            self.module.push(ident(&item.ident));
            visit::visit_item_mod(self, item);
            self.module.pop();
        }
    }

    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        if item.leading_colon.is_none() {
            for leaf in use_leaves(&item.tree) {
                self.add_ref(leaf.path, leaf.line, 1);
            }
        }
    }

    fn visit_visibility(&mut self, _: &'ast Visibility) {}

    fn visit_path(&mut self, path: &'ast syn::Path) {
        if path.leading_colon.is_none() {
            let segments: Vec<String> = path.segments.iter().map(|s| ident(&s.ident)).collect();
            let line = path.segments[0].ident.span().start().line;
            self.add_ref(segments, line, 2);
        }
        visit::visit_path(self, path);
    }

    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        visit::visit_macro(self, mac);
        let mut paths = Vec::new();
        token_paths(mac.tokens.clone(), &mut paths);
        for (path, line) in paths {
            self.add_ref(path, line, 2);
        }
    }

    fn visit_item_fn(&mut self, item: &'ast syn::ItemFn) {
        self.add_fn(&item.sig, &item.block);
        self.within(ident(&item.sig.ident), |s| visit::visit_item_fn(s, item));
    }

    fn visit_impl_item_fn(&mut self, item: &'ast syn::ImplItemFn) {
        self.add_fn(&item.sig, &item.block);
        self.within(ident(&item.sig.ident), |s| {
            visit::visit_impl_item_fn(s, item)
        });
    }

    fn visit_trait_item_fn(&mut self, item: &'ast syn::TraitItemFn) {
        if let Some(block) = &item.default {
            self.add_fn(&item.sig, block);
        }
        self.within(ident(&item.sig.ident), |s| {
            visit::visit_trait_item_fn(s, item)
        });
    }

    fn visit_item_impl(&mut self, item: &'ast syn::ItemImpl) {
        let name = match &*item.self_ty {
            Type::Path(t) => t
                .path
                .segments
                .last()
                .map_or(String::new(), |s| ident(&s.ident)),
            _ => "impl".to_string(),
        };
        self.within(name, |s| visit::visit_item_impl(s, item));
    }

    fn visit_item_trait(&mut self, item: &'ast syn::ItemTrait) {
        self.within(ident(&item.ident), |s| visit::visit_item_trait(s, item));
    }

    fn visit_type_path(&mut self, ty: &'ast syn::TypePath) {
        if is_string_result(&ty.path) {
            let line = ty
                .path
                .segments
                .last()
                .map_or(0, |s| s.ident.span().start().line);
            self.scan.string_errors.push(StringError {
                line,
                context: self.names.join("::"),
                returned: self.in_return,
            });
        }
        visit::visit_type_path(self, ty);
    }

    fn visit_return_type(&mut self, ty: &'ast syn::ReturnType) {
        let outer = std::mem::replace(&mut self.in_return, true);
        visit::visit_return_type(self, ty);
        self.in_return = outer;
    }

    fn visit_item_struct(&mut self, item: &'ast syn::ItemStruct) {
        self.within(ident(&item.ident), |s| visit::visit_item_struct(s, item));
    }

    fn visit_item_enum(&mut self, item: &'ast syn::ItemEnum) {
        self.within(ident(&item.ident), |s| visit::visit_item_enum(s, item));
    }

    fn visit_item_type(&mut self, item: &'ast syn::ItemType) {
        self.within(ident(&item.ident), |s| visit::visit_item_type(s, item));
    }

    fn visit_item_static(&mut self, item: &'ast syn::ItemStatic) {
        self.within(ident(&item.ident), |s| visit::visit_item_static(s, item));
    }

    fn visit_item_const(&mut self, item: &'ast syn::ItemConst) {
        self.within(ident(&item.ident), |s| visit::visit_item_const(s, item));
    }
}
