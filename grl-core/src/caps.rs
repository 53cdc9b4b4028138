//! The caps of a bucket file's `criticality.caps`: caller pattern → the highest tier its
//! requests may claim. Looked up on the decision path only for requests a bucket matches, and
//! only in a service that has caps; allocates nothing.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use schema::Criticality;

/// A hasher for the exact caller names: the lookup's string hash (a caller name is hashed
/// once; `str`'s trailing `0xff` marker is ignored).
#[derive(Default)]
struct NameHasher(u64);

impl Hasher for NameHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        self.0 = crate::lookup::hash_bytes(bytes);
    }
    fn write_u8(&mut self, _: u8) {}
}

/// The compiled caps of one service.
#[derive(Default)]
pub(crate) struct Caps {
    exact: HashMap<Box<str>, Criticality, BuildHasherDefault<NameHasher>>,
    /// Prefixes (the pattern without its `*`), longest first.
    prefixes: Box<[(Box<str>, Criticality)]>,
}

impl Caps {
    /// Compiles `caps` (patterns checked by `schema::criticality::check_caller_pattern`);
    /// None when there are none.
    pub(crate) fn compile(caps: &BTreeMap<String, Criticality>) -> Result<Option<Caps>, String> {
        if caps.is_empty() {
            return Ok(None);
        }
        let mut c = Caps::default();
        let mut prefixes = Vec::new();
        for (pattern, &tier) in caps {
            schema::criticality::check_caller_pattern(pattern)?;
            match pattern.strip_suffix('*') {
                Some(prefix) => prefixes.push((Box::from(prefix), tier)),
                None => {
                    c.exact.insert(Box::from(pattern.as_str()), tier);
                }
            }
        }
        prefixes.sort_by(|a: &(Box<str>, _), b| b.0.len().cmp(&a.0.len()).then(a.0.cmp(&b.0)));
        c.prefixes = prefixes.into_boxed_slice();
        Ok(Some(c))
    }

    /// The cap of `caller`: its exact name, else the longest prefix of it.
    #[inline]
    pub(crate) fn cap(&self, caller: &str) -> Option<Criticality> {
        if let Some(&t) = self.exact.get(caller) {
            return Some(t);
        }
        self.prefixes
            .iter()
            .find(|(p, _)| caller.starts_with(&**p))
            .map(|&(_, t)| t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exact_name_then_the_longest_prefix() {
        let caps: BTreeMap<String, Criticality> = [
            ("*", Criticality::SheddablePlus),
            ("batch-*", Criticality::Sheddable),
            ("batch-billing-*", Criticality::Critical),
            ("batch-billing-eu", Criticality::SheddablePlus),
            ("gw", Criticality::CriticalPlus),
        ]
        .into_iter()
        .map(|(p, t)| (p.to_string(), t))
        .collect();
        let c = Caps::compile(&caps).unwrap().unwrap();
        assert_eq!(c.cap("gw"), Some(Criticality::CriticalPlus));
        assert_eq!(c.cap("gw2"), Some(Criticality::SheddablePlus));
        assert_eq!(c.cap("batch-x"), Some(Criticality::Sheddable));
        assert_eq!(c.cap("batch-billing-us"), Some(Criticality::Critical));
        assert_eq!(c.cap("batch-billing-eu"), Some(Criticality::SheddablePlus));
        assert!(Caps::compile(&BTreeMap::new()).unwrap().is_none());
        let only: BTreeMap<String, Criticality> =
            [("cron".to_string(), Criticality::Sheddable)].into();
        let c = Caps::compile(&only).unwrap().unwrap();
        assert_eq!(c.cap("cron"), Some(Criticality::Sheddable));
        assert_eq!(c.cap("cronx"), None);
        for bad in ["", "a*b*", "*x", " gw"] {
            let caps: BTreeMap<String, Criticality> =
                [(bad.to_string(), Criticality::Sheddable)].into();
            assert!(Caps::compile(&caps).is_err(), "{bad:?}");
        }
    }
}
