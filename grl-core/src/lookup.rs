//! The bucket set of one service compiled into hash maps keyed by borrowed `&str`, so that a
//! lookup allocates nothing. Precedence: caller+procedure, then procedure, then caller.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// FxHash (rustc's hasher): keys are short service and procedure names chosen by our own
/// config, so a DoS-resistant hasher buys nothing and costs most of the budget.
#[derive(Default, Clone, Copy)]
pub(crate) struct FxHasher(u64);

const K: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl Hasher for FxHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut h = self.0;
        let mut b = bytes;
        while b.len() >= 8 {
            let w = u64::from_le_bytes(b[..8].try_into().unwrap());
            h = (h.rotate_left(5) ^ w).wrapping_mul(K);
            b = &b[8..];
        }
        if b.len() >= 4 {
            let w = u32::from_le_bytes(b[..4].try_into().unwrap()) as u64;
            h = (h.rotate_left(5) ^ w).wrapping_mul(K);
            b = &b[4..];
        }
        for &x in b {
            h = (h.rotate_left(5) ^ x as u64).wrapping_mul(K);
        }
        self.0 = h;
    }
    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.0 = (self.0.rotate_left(5) ^ i as u64).wrapping_mul(K);
    }
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

type FxMap<V> = HashMap<Box<str>, V, BuildHasherDefault<FxHasher>>;

#[derive(Default)]
struct ByProcedure {
    any_caller: Option<u32>,
    by_caller: FxMap<u32>,
}

#[derive(Default)]
pub(crate) struct Lookup {
    procedures: FxMap<ByProcedure>,
    callers: FxMap<u32>,
}

impl Lookup {
    /// Inserts bucket `idx`; returns false when the same (caller, procedure) is already taken.
    pub(crate) fn insert(
        &mut self,
        caller: Option<&str>,
        procedure: Option<&str>,
        idx: u32,
    ) -> bool {
        let slot = match (caller, procedure) {
            (Some(c), Some(p)) => self
                .procedures
                .entry(p.into())
                .or_default()
                .by_caller
                .entry(c.into())
                .or_insert(u32::MAX),
            (None, Some(p)) => self
                .procedures
                .entry(p.into())
                .or_default()
                .any_caller
                .get_or_insert(u32::MAX),
            (Some(c), None) => self.callers.entry(c.into()).or_insert(u32::MAX),
            (None, None) => return false,
        };
        if *slot != u32::MAX {
            return false;
        }
        *slot = idx;
        true
    }

    #[inline]
    pub(crate) fn find(&self, caller: &str, procedure: &str) -> Option<u32> {
        if let Some(p) = self.procedures.get(procedure) {
            if !p.by_caller.is_empty() {
                if let Some(&i) = p.by_caller.get(caller) {
                    return Some(i);
                }
            }
            if let Some(i) = p.any_caller {
                return Some(i);
            }
        }
        if self.callers.is_empty() {
            return None;
        }
        self.callers.get(caller).copied()
    }
}
