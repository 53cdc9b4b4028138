//! Maps keyed by a pair of strings (`(service, bucket)`, `(caller, procedure)`), looked up by
//! a pair of borrowed `&str` without building the owned key: a hit allocates nothing, only a
//! new key is allocated.
//!
//! `(String, String)` borrows as `dyn StrPair`, whose `Hash` and `Eq` are the tuple's (a
//! tuple hashes its fields in order), so `map.get_mut(&("svc", "b") as &dyn StrPair)` finds
//! the entry `("svc".to_string(), "b".to_string())` of a plain `HashMap<(String, String), V>`.

use std::borrow::Borrow;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};

/// Two strings, owned or borrowed.
pub trait StrPair {
    /// The first string.
    fn first(&self) -> &str;
    /// The second string.
    fn second(&self) -> &str;
}

impl StrPair for (String, String) {
    fn first(&self) -> &str {
        &self.0
    }
    fn second(&self) -> &str {
        &self.1
    }
}

impl StrPair for (&str, &str) {
    fn first(&self) -> &str {
        self.0
    }
    fn second(&self) -> &str {
        self.1
    }
}

impl<'a> Borrow<dyn StrPair + 'a> for (String, String) {
    fn borrow(&self) -> &(dyn StrPair + 'a) {
        self
    }
}

impl Hash for dyn StrPair + '_ {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // As `(String, String)` hashes: each field in order.
        self.first().hash(state);
        self.second().hash(state);
    }
}

impl PartialEq for dyn StrPair + '_ {
    fn eq(&self, other: &Self) -> bool {
        self.first() == other.first() && self.second() == other.second()
    }
}

impl Eq for dyn StrPair + '_ {}

/// Applies `f` to the entry of `(a, b)` in `map`, inserted with `new` (given the owned key)
/// when absent: the key is allocated only then.
pub fn update<V>(
    map: &mut HashMap<(String, String), V>,
    (a, b): (&str, &str),
    new: impl FnOnce(&(String, String)) -> V,
    f: impl FnOnce(&mut V),
) {
    match map.get_mut(&(a, b) as &dyn StrPair) {
        Some(v) => f(v),
        None => f(map
            .entry((a.to_string(), b.to_string()))
            .or_insert_with_key(new)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn borrowed_pairs_find_owned_keys() {
        let mut m: HashMap<(String, String), u64> = HashMap::new();
        update(&mut m, ("svc", "b"), |_| 0, |v| *v += 2);
        update(&mut m, ("svc", "b"), |_| 0, |v| *v += 3);
        // The split between the two strings matters: ("sv", "cb") is another key.
        update(&mut m, ("sv", "cb"), |k| k.0.len() as u64, |v| *v += 1);
        assert_eq!(m.len(), 2);
        assert_eq!(m[&("svc".to_string(), "b".to_string())], 5);
        assert_eq!(m[&("sv".to_string(), "cb".to_string())], 3);
        assert_eq!(m.get(&("svc", "x") as &dyn StrPair), None);
        assert_eq!(m.get(&("svc", "b") as &dyn StrPair), Some(&5));
    }
}
