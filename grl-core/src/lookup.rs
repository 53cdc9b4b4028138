//! The bucket set of one service compiled into hash maps keyed by borrowed `&str`, so that a
//! lookup allocates nothing. Precedence: caller+procedure, then procedure, then caller.

use std::hash::Hasher;

/// FxHash (rustc's hasher): keys are short service and procedure names chosen by our own
/// config, so a DoS-resistant hasher buys nothing and costs most of the budget.
#[derive(Default, Clone, Copy)]
pub(crate) struct FxHasher(u64);

const K: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl FxHasher {
    #[inline]
    fn word(&mut self, w: u64) {
        self.0 = (self.0.rotate_left(5) ^ w).wrapping_mul(K);
    }
}

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
        // Fx's last step is a multiply, whose low bits depend only on the input's low bits;
        // hashbrown picks buckets from the low bits, so names that differ in their last
        // characters would pile up. A final xor-shift-multiply spreads the high bits down.
        let h = self.0;
        let h = (h ^ (h >> 32)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        h ^ (h >> 29)
    }
}

/// FxHash over 8-byte words, the tail as one zero-padded word, seeded with the length (so
/// that "a" and "a\0" differ): three multiply rounds for a typical 17-byte name.
#[inline]
fn hash_str(s: &str) -> u64 {
    let b = s.as_bytes();
    let mut h = FxHasher(b.len() as u64);
    let mut chunks = b.chunks_exact(8);
    for c in &mut chunks {
        h.word(u64::from_le_bytes(c.try_into().expect("8 bytes")));
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        // Shifted in byte by byte: a variable-length copy would call libc's memcpy.
        let mut w = 0u64;
        for (j, &x) in rest.iter().enumerate() {
            w |= (x as u64) << (8 * j);
        }
        h.word(w);
    }
    h.finish()
}

/// Byte equality without a call into libc's `memcmp`: names are short, and the call costs
/// more than the comparison.
#[inline]
fn eq_str(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i + 8 <= a.len() {
        let x = u64::from_le_bytes(a[i..i + 8].try_into().expect("8 bytes"));
        let y = u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        if x != y {
            return false;
        }
        i += 8;
    }
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

struct Entry {
    hash: u64,
    caller: Box<str>,
    procedure: Box<str>,
    idx: u32,
}

const EMPTY: u32 = u32::MAX;

/// Open addressing with linear probing over full 64-bit hashes: a miss or a wrong slot is
/// rejected on the hash, strings are compared only on a hash match.
#[derive(Default)]
struct Map {
    slots: Box<[u32]>,
    mask: usize,
    entries: Vec<Entry>,
}

impl Map {
    fn build(entries: Vec<Entry>) -> Map {
        if entries.is_empty() {
            return Map::default();
        }
        let cap = (entries.len() * 2).next_power_of_two();
        let mut slots = vec![EMPTY; cap].into_boxed_slice();
        let mask = cap - 1;
        for (n, e) in entries.iter().enumerate() {
            let mut i = e.hash as usize & mask;
            while slots[i] != EMPTY {
                i = (i + 1) & mask;
            }
            slots[i] = n as u32;
        }
        Map {
            slots,
            mask,
            entries,
        }
    }

    #[inline]
    fn get(&self, hash: u64, caller: &str, procedure: &str) -> Option<u32> {
        if self.entries.is_empty() {
            return None;
        }
        let mut i = hash as usize & self.mask;
        loop {
            let s = self.slots[i];
            if s == EMPTY {
                return None;
            }
            let e = &self.entries[s as usize];
            if e.hash == hash && eq_str(&e.procedure, procedure) && eq_str(&e.caller, caller) {
                return Some(e.idx);
            }
            i = (i + 1) & self.mask;
        }
    }
}

#[inline]
fn pair(hc: u64, hp: u64) -> u64 {
    (hc.rotate_left(21) ^ hp).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// A bucket's matchers and index, before `seal` builds the maps.
type Pending = (Option<Box<str>>, Option<Box<str>>, u32);

/// Three maps, one per precedence level: caller+procedure, procedure only, caller only.
#[derive(Default)]
pub(crate) struct Lookup {
    pending: Vec<Pending>,
    exact: Map,
    by_procedure: Map,
    by_caller: Map,
}

impl Lookup {
    /// Adds bucket `idx`; returns false when neither matcher is set. Duplicates are the
    /// caller's concern (checked when compiling).
    pub(crate) fn insert(
        &mut self,
        caller: Option<&str>,
        procedure: Option<&str>,
        idx: u32,
    ) -> bool {
        if caller.is_none() && procedure.is_none() {
            return false;
        }
        self.pending
            .push((caller.map(Into::into), procedure.map(Into::into), idx));
        true
    }

    /// Builds the maps from what was inserted.
    pub(crate) fn seal(&mut self) {
        let (mut exact, mut by_p, mut by_c) = (Vec::new(), Vec::new(), Vec::new());
        for (c, p, idx) in self.pending.drain(..) {
            match (c, p) {
                (Some(c), Some(p)) => exact.push(Entry {
                    hash: pair(hash_str(&c), hash_str(&p)),
                    caller: c,
                    procedure: p,
                    idx,
                }),
                (None, Some(p)) => by_p.push(Entry {
                    hash: hash_str(&p),
                    caller: "".into(),
                    procedure: p,
                    idx,
                }),
                (Some(c), None) => by_c.push(Entry {
                    hash: hash_str(&c),
                    caller: c,
                    procedure: "".into(),
                    idx,
                }),
                (None, None) => {}
            }
        }
        self.exact = Map::build(exact);
        self.by_procedure = Map::build(by_p);
        self.by_caller = Map::build(by_c);
    }

    #[inline]
    pub(crate) fn find(&self, caller: &str, procedure: &str) -> Option<u32> {
        let hc = hash_str(caller);
        let hp = hash_str(procedure);
        self.exact
            .get(pair(hc, hp), caller, procedure)
            .or_else(|| self.by_procedure.get(hp, "", procedure))
            .or_else(|| self.by_caller.get(hc, caller, ""))
    }
}
