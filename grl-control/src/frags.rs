//! The controller's cache of serialized directives (see `Engine::directives_json`): the JSON
//! bytes of one bucket's directive under one scope key, built once after each change and
//! copied into every delta reply that carries it.
//!
//! Laid out for the replies' walk in bucket order: a head per bucket (4 bytes), a short chain
//! of entries per bucket (one per key that has bytes), and the bytes in one arena, appended
//! in the order replies build them. Dropping an entry unlinks it; its bytes stay in the arena
//! until the arena holds twice the live bytes, when it is compacted. Bounded: an entry that
//! would take the live bytes beyond `max_bytes` first drops everything.

/// One entry: key id, the next entry of the bucket (index + 1; 0 = none), the bytes.
#[derive(Clone, Copy)]
struct Entry {
    key: u32,
    next: u32,
    at: u32,
    len: u32,
}

/// See the module documentation.
#[derive(Default)]
pub(crate) struct FragCache {
    head: Vec<u32>,
    entries: Vec<Entry>,
    bytes: Vec<u8>,
    live_entries: usize,
    live_bytes: usize,
    max_bytes: usize,
}

impl FragCache {
    /// An empty cache for `buckets` buckets holding at most `max_bytes` bytes.
    pub(crate) fn new(buckets: usize, max_bytes: usize) -> FragCache {
        FragCache {
            head: vec![0; buckets],
            max_bytes,
            ..Default::default()
        }
    }

    /// The bytes of bucket `i` under key `key`, if kept.
    pub(crate) fn get(&self, i: usize, key: u32) -> Option<&[u8]> {
        let mut e = *self.head.get(i)?;
        while e != 0 {
            let x = &self.entries[e as usize - 1];
            if x.key == key {
                return Some(&self.bytes[x.at as usize..(x.at + x.len) as usize]);
            }
            e = x.next;
        }
        None
    }

    /// Keeps `bytes` for bucket `i` under `key` (which has none).
    pub(crate) fn insert(&mut self, i: usize, key: u32, bytes: &[u8]) {
        if i >= self.head.len() || bytes.len() > self.max_bytes {
            return;
        }
        if self.live_bytes + bytes.len() > self.max_bytes
            || self.bytes.len() + bytes.len() > u32::MAX as usize
        {
            self.clear();
        }
        let at = self.bytes.len() as u32;
        self.bytes.extend_from_slice(bytes);
        self.entries.push(Entry {
            key,
            next: self.head[i],
            at,
            len: bytes.len() as u32,
        });
        self.head[i] = self.entries.len() as u32;
        self.live_entries += 1;
        self.live_bytes += bytes.len();
    }

    /// Drops bucket `i`'s bytes under `key`.
    pub(crate) fn drop_key(&mut self, i: usize, key: u32) {
        let Some(mut link) = self.head.get(i).copied() else {
            return;
        };
        let mut prev: Option<usize> = None;
        while link != 0 {
            let p = link as usize - 1;
            let x = self.entries[p];
            if x.key == key {
                match prev {
                    None => self.head[i] = x.next,
                    Some(q) => self.entries[q].next = x.next,
                }
                self.gone(x);
                self.maybe_compact();
                return;
            }
            prev = Some(p);
            link = x.next;
        }
    }

    /// Drops every key's bytes of bucket `i`.
    pub(crate) fn drop_bucket(&mut self, i: usize) {
        let Some(mut link) = self.head.get(i).copied() else {
            return;
        };
        self.head[i] = 0;
        while link != 0 {
            let x = self.entries[link as usize - 1];
            self.gone(x);
            link = x.next;
        }
        self.maybe_compact();
    }

    fn gone(&mut self, x: Entry) {
        self.live_entries -= 1;
        self.live_bytes -= x.len as usize;
    }

    /// Compacts when half the arena is garbage (and it is worth a pass).
    fn maybe_compact(&mut self) {
        if self.bytes.len() > (1 << 20) && self.bytes.len() > 2 * self.live_bytes {
            self.compact();
        }
    }

    /// Drops everything.
    pub(crate) fn clear(&mut self) {
        self.head.fill(0);
        self.entries.clear();
        self.bytes.clear();
        self.live_entries = 0;
        self.live_bytes = 0;
    }

    /// Rewrites the entries and the arena with the live entries only, in bucket order.
    fn compact(&mut self) {
        let mut entries = Vec::with_capacity(self.live_entries);
        let mut bytes = Vec::with_capacity(self.live_bytes);
        for h in self.head.iter_mut() {
            let mut link = std::mem::take(h);
            let mut last: Option<usize> = None;
            while link != 0 {
                let x = self.entries[link as usize - 1];
                let at = bytes.len() as u32;
                bytes.extend_from_slice(&self.bytes[x.at as usize..(x.at + x.len) as usize]);
                entries.push(Entry {
                    key: x.key,
                    next: 0,
                    at,
                    len: x.len,
                });
                let n = entries.len() as u32;
                match last {
                    None => *h = n,
                    Some(q) => entries[q].next = n,
                }
                last = Some(n as usize - 1);
                link = x.next;
            }
        }
        self.entries = entries;
        self.bytes = bytes;
    }

    /// Entries kept.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.live_entries
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_kept_dropped_compacted_and_bounded() {
        let mut c = FragCache::new(4, 1 << 30);
        c.insert(1, 7, b"one-seven");
        c.insert(1, 8, b"one-eight");
        c.insert(2, 0, b"two");
        assert_eq!(c.get(1, 7), Some(&b"one-seven"[..]));
        assert_eq!(c.get(1, 8), Some(&b"one-eight"[..]));
        assert_eq!(c.get(1, 0), None);
        assert_eq!(c.get(9, 0), None);
        c.drop_key(1, 8);
        assert_eq!(c.get(1, 8), None);
        assert_eq!(c.get(1, 7), Some(&b"one-seven"[..]));
        c.drop_bucket(1);
        assert_eq!((c.get(1, 7), c.len()), (None, 1));
        // Churn far beyond the arena's compaction threshold: the live bytes stay readable
        // and the arena stays within twice them (plus the threshold).
        let big = vec![b'x'; 4096];
        for round in 0..2000u32 {
            c.drop_key(3, round.wrapping_sub(1));
            c.insert(3, round, &big);
            assert_eq!(c.get(3, round).map(<[u8]>::len), Some(4096));
        }
        assert_eq!(c.get(2, 0), Some(&b"two"[..]));
        assert_eq!(c.len(), 2);
        assert!(
            c.bytes.len() <= 2 * 4099 + (1 << 20) + 4096,
            "{}",
            c.bytes.len()
        );
        // The bound: an entry beyond it drops the others first.
        let mut small = FragCache::new(2, 10);
        small.insert(0, 0, b"12345678");
        small.insert(1, 0, b"12345678");
        assert_eq!((small.get(0, 0), small.get(1, 0).is_some()), (None, true));
        assert_eq!(small.len(), 1);
    }
}
