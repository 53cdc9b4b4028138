//! Helpers over syn's syntax trees: attributes, names, `use` trees and paths.

use std::collections::HashSet;

use proc_macro2::{Spacing, TokenStream, TokenTree};
use syn::{Attribute, GenericArgument, Item, PathArguments, Type, UseTree};

/// One leaf of a `use` tree: `use a::{b, c as d, e::*}` has `a::b` (as `b`), `a::c` (as `d`)
/// and the glob `a::e` (no alias).
pub(super) struct UseLeaf {
    pub(super) path: Vec<String>,
    pub(super) alias: Option<String>,
    pub(super) line: usize,
}

pub(super) fn use_leaves(tree: &UseTree) -> Vec<UseLeaf> {
    fn walk(tree: &UseTree, prefix: &mut Vec<String>, out: &mut Vec<UseLeaf>) {
        let leaf = |prefix: &[String], name: &syn::Ident, alias: &syn::Ident| {
            let mut path = prefix.to_vec();
            if name != "self" {
                path.push(ident(name));
            }
            let alias = if alias == "self" {
                prefix.last().cloned()
            } else {
                Some(ident(alias))
            };
            let line = name.span().start().line;
            UseLeaf { path, alias, line }
        };
        match tree {
            UseTree::Path(p) => {
                prefix.push(ident(&p.ident));
                walk(&p.tree, prefix, out);
                prefix.pop();
            }
            UseTree::Name(n) => out.push(leaf(prefix, &n.ident, &n.ident)),
            UseTree::Rename(r) => out.push(leaf(prefix, &r.ident, &r.rename)),
            UseTree::Glob(g) => out.push(UseLeaf {
                path: prefix.clone(),
                alias: None,
                line: g.star_token.spans[0].start().line,
            }),
            UseTree::Group(g) => {
                for item in &g.items {
                    walk(item, prefix, out);
                }
            }
        }
    }
    let mut out = Vec::new();
    walk(tree, &mut Vec::new(), &mut out);
    out
}

/// The absolute module path of `path` written in module `module`, when it names the crate:
/// `crate::…`, `self::…`, `super::…` or `child::…` (a child module of `module`).
pub(super) fn absolute(
    module: &[String],
    path: &[String],
    children: &HashSet<String>,
) -> Option<Vec<String>> {
    let first = path.first()?;
    let (mut base, rest) = match first.as_str() {
        "crate" => (Vec::new(), &path[1..]),
        "self" => (module.to_vec(), &path[1..]),
        "super" => {
            let mut base = module.to_vec();
            let supers = path.iter().take_while(|s| *s == "super").count();
            for _ in 0..supers {
                base.pop()?;
            }
            (base, &path[supers..])
        }
        name if children.contains(name) => (module.to_vec(), path),
        _ => return None,
    };
    base.extend(rest.iter().cloned());
    Some(base)
}

/// Whether a path is `Result<_, String>`.
pub(super) fn is_string_result(path: &syn::Path) -> bool {
    let Some(last) = path.segments.last() else {
        return false;
    };
    let PathArguments::AngleBracketed(args) = &last.arguments else {
        return false;
    };
    let types: Vec<&Type> = args
        .args
        .iter()
        .filter_map(|arg| match arg {
            GenericArgument::Type(ty) => Some(ty),
            _ => None,
        })
        .collect();
    last.ident == "Result"
        && matches!(types.as_slice(), [_, Type::Path(error)] if error.qself.is_none()
        && error.path.segments.last().is_some_and(|s| {
            s.ident == "String" && s.arguments.is_none()
        }))
}

/// The paths `a::b::c` in macro tokens (not parsed by syn) with the line of their first name.
pub(super) fn token_paths(tokens: TokenStream, out: &mut Vec<(Vec<String>, usize)>) {
    let tokens: Vec<TokenTree> = tokens.into_iter().collect();
    let colons = |j: usize| {
        matches!((tokens.get(j), tokens.get(j + 1)),
            (Some(TokenTree::Punct(a)), Some(TokenTree::Punct(b)))
                if a.as_char() == ':' && a.spacing() == Spacing::Joint && b.as_char() == ':')
    };
    let mut i = 0;
    while i < tokens.len() {
        match &tokens[i] {
            TokenTree::Group(group) => token_paths(group.stream(), out),
            TokenTree::Ident(first) if !(i >= 2 && colons(i - 2)) => {
                let mut path = vec![first.to_string()];
                let mut j = i + 1;
                while colons(j) {
                    let Some(TokenTree::Ident(next)) = tokens.get(j + 2) else {
                        break;
                    };
                    path.push(next.to_string());
                    j += 3;
                }
                if path.len() > 1 {
                    out.push((path, first.span().start().line));
                    i = j - 1;
                }
            }
            _ => {}
        }
        i += 1;
    }
}

/// Whether the attributes hold `#[cfg(test)]` or `#[cfg(all(test, …))]`.
pub(super) fn is_cfg_test(attrs: &[Attribute]) -> bool {
    attrs.iter().any(|attr| match &attr.meta {
        syn::Meta::List(list) if list.path.is_ident("cfg") => {
            let tokens: Vec<TokenTree> = list.tokens.clone().into_iter().collect();
            match tokens.as_slice() {
                [TokenTree::Ident(pred)] => pred == "test",
                [TokenTree::Ident(all), TokenTree::Group(group)] if all == "all" => group
                    .stream()
                    .into_iter()
                    .any(|t| matches!(t, TokenTree::Ident(pred) if pred == "test")),
                _ => false,
            }
        }
        _ => false,
    })
}

pub(super) fn item_attrs(item: &Item) -> &[Attribute] {
    match item {
        Item::Const(i) => &i.attrs,
        Item::Enum(i) => &i.attrs,
        Item::ExternCrate(i) => &i.attrs,
        Item::Fn(i) => &i.attrs,
        Item::ForeignMod(i) => &i.attrs,
        Item::Impl(i) => &i.attrs,
        Item::Macro(i) => &i.attrs,
        Item::Mod(i) => &i.attrs,
        Item::Static(i) => &i.attrs,
        Item::Struct(i) => &i.attrs,
        Item::Trait(i) => &i.attrs,
        Item::TraitAlias(i) => &i.attrs,
        Item::Type(i) => &i.attrs,
        Item::Union(i) => &i.attrs,
        Item::Use(i) => &i.attrs,
        _ => &[],
    }
}

/// The name an item defines in its module.
pub(super) fn item_name(item: &Item) -> Option<String> {
    let name = match item {
        Item::Const(i) => &i.ident,
        Item::Enum(i) => &i.ident,
        Item::ExternCrate(i) => i.rename.as_ref().map_or(&i.ident, |(_, r)| r),
        Item::Fn(i) => &i.sig.ident,
        Item::Macro(i) => i.ident.as_ref()?,
        Item::Mod(i) => &i.ident,
        Item::Static(i) => &i.ident,
        Item::Struct(i) => &i.ident,
        Item::Trait(i) => &i.ident,
        Item::TraitAlias(i) => &i.ident,
        Item::Type(i) => &i.ident,
        Item::Union(i) => &i.ident,
        _ => return None,
    };
    Some(ident(name))
}

/// An identifier without its `r#`.
pub(super) fn ident(ident: &syn::Ident) -> String {
    let name = ident.to_string();
    name.strip_prefix("r#").map_or(name.clone(), str::to_string)
}
