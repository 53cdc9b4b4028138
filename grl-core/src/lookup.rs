//! The bucket set of one service compiled into hash maps keyed by borrowed `&str`, so that a
//! lookup allocates nothing. Precedence: caller+procedure, then procedure, then caller.
//!
//! Each request string is hashed once; the caller+procedure key is a combination of the two
//! string hashes, so the three maps cost two string hashes and at most three probes.

/// Folded multiply: the xor of the two halves of the 128-bit product. One `mul` whose output
/// bits each depend on every input bit (foldhash and wyhash build on it).
#[inline(always)]
fn fold(a: u64, b: u64) -> u64 {
    let p = (a as u128).wrapping_mul(b as u128);
    (p as u64) ^ ((p >> 64) as u64)
}

const K1: u64 = 0x243F_6A88_85A3_08D3;
const K2: u64 = 0x1319_8A2E_0370_7344;
const K3: u64 = 0xA409_3822_299F_31D0;

#[inline(always)]
fn r64(b: &[u8], i: usize) -> u64 {
    u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"))
}

#[inline(always)]
fn r32(b: &[u8], i: usize) -> u64 {
    u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes")) as u64
}

/// A non-keyed hash in the style of foldhash: strings of 8–16 bytes are two overlapping word
/// reads and one folded multiply, 17–32 bytes two multiplies. Keys are service and procedure
/// names chosen by our own config, and strings are compared on a hash match, so a
/// DoS-resistant hasher buys nothing and costs most of the budget.
#[inline(always)]
pub(crate) fn hash_str(s: &str) -> u64 {
    hash_bytes(s.as_bytes())
}

/// [`hash_str`] of a string's bytes.
#[inline(always)]
pub(crate) fn hash_bytes(b: &[u8]) -> u64 {
    let len = b.len();
    let seed = K3 ^ (len as u64).wrapping_mul(K1);
    if len <= 16 {
        let (lo, hi) = if len >= 8 {
            (r64(b, 0), r64(b, len - 8))
        } else if len >= 4 {
            (r32(b, 0), r32(b, len - 4))
        } else if len > 0 {
            (
                b[0] as u64 | (b[len / 2] as u64) << 8 | (b[len - 1] as u64) << 16,
                0,
            )
        } else {
            (0, 0)
        };
        fold(lo ^ K1, hi ^ seed)
    } else if len <= 32 {
        let h = fold(r64(b, 0) ^ K1, r64(b, 8) ^ seed);
        fold(r64(b, len - 16) ^ K2, r64(b, len - 8) ^ h)
    } else {
        let mut h = seed;
        let mut i = 0;
        while i + 16 < len {
            h = fold(r64(b, i) ^ K1, r64(b, i + 8) ^ h);
            i += 16;
        }
        fold(r64(b, len - 16) ^ K2, r64(b, len - 8) ^ h)
    }
}

/// The caller+procedure key from the two string hashes.
#[inline(always)]
fn pair(hc: u64, hp: u64) -> u64 {
    fold(hc ^ K2, hp ^ K3)
}

/// Byte equality without a call into libc's `memcmp` (names are short and the call costs more
/// than the comparison): whole words, overlapping at the end, up to 32 bytes without a branch.
#[inline(always)]
fn eq_bytes(a: &[u8], b: &[u8]) -> bool {
    let n = a.len();
    if n != b.len() {
        return false;
    }
    if (16..=32).contains(&n) {
        let d = (r64(a, 0) ^ r64(b, 0))
            | (r64(a, 8) ^ r64(b, 8))
            | (r64(a, n - 16) ^ r64(b, n - 16))
            | (r64(a, n - 8) ^ r64(b, n - 8));
        d == 0
    } else if (8..16).contains(&n) {
        (r64(a, 0) ^ r64(b, 0)) | (r64(a, n - 8) ^ r64(b, n - 8)) == 0
    } else if n >= 8 {
        let mut i = 0;
        while i + 8 < n {
            if r64(a, i) != r64(b, i) {
                return false;
            }
            i += 8;
        }
        r64(a, n - 8) == r64(b, n - 8)
    } else if n >= 4 {
        r32(a, 0) == r32(b, 0) && r32(a, n - 4) == r32(b, n - 4)
    } else {
        (0..n).all(|i| a[i] == b[i])
    }
}

struct Entry {
    hash: u64,
    caller: Box<str>,
    procedure: Box<str>,
    idx: u32,
}

const EMPTY: u32 = u32::MAX;

/// A table slot: the full hash, the bucket index and where the key's bytes are, so that a
/// probe reads the slot and, on a hash match, the key bytes, and nothing else.
#[derive(Clone, Copy)]
struct Slot {
    hash: u64,
    /// The bucket index, `EMPTY` for a free slot.
    idx: u32,
    /// Caller bytes then procedure bytes at `keys[off..]`.
    off: u32,
    caller_len: u32,
    procedure_len: u32,
}

/// Open addressing with linear probing over full 64-bit hashes: a miss or a wrong slot is
/// rejected on the hash, strings are compared only on a hash match.
#[derive(Default)]
struct Map {
    slots: Box<[Slot]>,
    mask: usize,
    /// Every entry's caller and procedure bytes, back to back.
    keys: Box<[u8]>,
}

impl Map {
    fn build(entries: Vec<Entry>) -> Map {
        if entries.is_empty() {
            return Map::default();
        }
        // At most a quarter full: a miss (most probes of the caller+procedure map) usually
        // stops at the first slot.
        let cap = (entries.len() * 4).next_power_of_two();
        let mut slots = vec![
            Slot {
                hash: 0,
                idx: EMPTY,
                off: 0,
                caller_len: 0,
                procedure_len: 0,
            };
            cap
        ]
        .into_boxed_slice();
        let mask = cap - 1;
        let mut keys = Vec::new();
        let len32 = |n: usize| u32::try_from(n).expect("bucket names fit in 4 GiB");
        for e in &entries {
            let mut i = e.hash as usize & mask;
            while slots[i].idx != EMPTY {
                i = (i + 1) & mask;
            }
            slots[i] = Slot {
                hash: e.hash,
                idx: e.idx,
                off: len32(keys.len()),
                caller_len: len32(e.caller.len()),
                procedure_len: len32(e.procedure.len()),
            };
            keys.extend_from_slice(e.caller.as_bytes());
            keys.extend_from_slice(e.procedure.as_bytes());
        }
        Map {
            slots,
            mask,
            keys: keys.into_boxed_slice(),
        }
    }

    #[inline(always)]
    fn get(&self, hash: u64, caller: &str, procedure: &str) -> Option<u32> {
        if self.slots.is_empty() {
            return None;
        }
        let (caller, procedure) = (caller.as_bytes(), procedure.as_bytes());
        let mut i = hash as usize & self.mask;
        loop {
            let s = self.slots[i];
            if s.idx == EMPTY {
                return None;
            }
            if s.hash == hash
                && s.caller_len as usize == caller.len()
                && s.procedure_len as usize == procedure.len()
            {
                let off = s.off as usize;
                let key = &self.keys[off..off + caller.len() + procedure.len()];
                let (c, p) = key.split_at(caller.len());
                if eq_bytes(p, procedure) && eq_bytes(c, caller) {
                    return Some(s.idx);
                }
            }
            i = (i + 1) & self.mask;
        }
    }
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

    #[inline(always)]
    pub(crate) fn find(&self, caller: &str, procedure: &str) -> Option<u32> {
        let hc = hash_str(caller);
        let hp = hash_str(procedure);
        if let Some(i) = self.exact.get(pair(hc, hp), caller, procedure) {
            return Some(i);
        }
        if let Some(i) = self.by_procedure.get(hp, "", procedure) {
            return Some(i);
        }
        self.by_caller.get(hc, caller, "")
    }
}
