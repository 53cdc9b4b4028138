//! Maps YAML paths (`buckets[2].limit_rps`) to the line and column where they stand, so that
//! checks made after deserialisation can still point at the offending line; and checks the
//! cheap structural limits (nesting depth, node count with aliases expanded) in the same single
//! pass, before any deserialiser sees the text.
//!
//! The pass pulls yaml-rust2 events one at a time (no recursion, linear in the text) and keeps
//! one 64-bit hash per path, not the path itself, so that memory stays proportional to the
//! number of nodes whatever the length of the keys.

use std::collections::HashMap;

use yaml_rust2::parser::{Event, Parser};
use yaml_rust2::scanner::Marker;

/// A 1-based line and column in a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Pos {
    /// 1-based line.
    pub line: usize,
    /// 1-based column.
    pub column: usize,
}

/// Path → position of every key and sequence item of one YAML document.
#[derive(Debug, Default, Clone)]
pub struct Locator {
    positions: Positions,
    /// Nodes counted by the scan (an alias counting the nodes it repeats).
    pub(crate) nodes: u64,
}

/// Why a text was refused before deserialisation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ScanError {
    pub pos: Pos,
    pub message: String,
    /// A limit was exceeded (as opposed to a YAML syntax error).
    pub limit: bool,
}

/// The structural limits the scan enforces.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ScanLimits {
    pub max_depth: usize,
    pub max_nodes: u64,
    /// Nodes the repo may still have, and its limit (for the message).
    pub repo_left: u64,
    pub repo_max: u64,
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

fn fnv(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
    }
    h
}

/// The hash of a path string (`""` is the document itself).
pub(crate) fn path_hash(path: &str) -> u64 {
    fnv(FNV_OFFSET, path.as_bytes())
}

/// The hash of `parent.key` (or `key` at the root) from the parent's hash.
pub(crate) fn key_hash(parent: u64, parent_is_root: bool, key: &str) -> u64 {
    let h = if parent_is_root {
        parent
    } else {
        fnv(parent, b".")
    };
    fnv(h, key.as_bytes())
}

/// The hash of `parent[index]` from the parent's hash (no allocation: one per item adds up).
pub(crate) fn index_hash(parent: u64, index: usize) -> u64 {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    let mut n = index;
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    let h = fnv(parent, b"[");
    let h = fnv(h, &digits[i..]);
    fnv(h, b"]")
}

/// The keys are hashes already: used as they are.
#[derive(Default, Clone, Copy, Debug)]
pub(crate) struct Identity(u64);

impl std::hash::Hasher for Identity {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | b as u64;
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type Positions = HashMap<u64, (u32, u32), std::hash::BuildHasherDefault<Identity>>;

impl Locator {
    /// Builds the map; a document that does not parse gives the positions seen before the
    /// syntax error (the deserialiser reports the error with its own position).
    pub fn new(text: &str) -> Self {
        match scan(
            text,
            ScanLimits {
                max_depth: 1024,
                max_nodes: u64::MAX,
                repo_left: u64::MAX,
                repo_max: u64::MAX,
            },
        ) {
            Ok(l) => l,
            Err((_, l)) => l,
        }
    }

    /// The position of `path`, or of its nearest ancestor that has one, or line 1.
    pub fn pos(&self, path: &str) -> Pos {
        let mut p = path;
        loop {
            if let Some(&(line, column)) = self.positions.get(&path_hash(p)) {
                return Pos {
                    line: line as usize,
                    column: column as usize,
                };
            }
            match p.rfind(['.', '[']) {
                Some(i) => p = &p[..i],
                None => return Pos { line: 1, column: 1 },
            }
        }
    }
}

enum Frame {
    /// `key`: the hash of the pending key's path, once the key was read.
    Map {
        hash: u64,
        root: bool,
        key: Option<u64>,
    },
    Seq {
        hash: u64,
        index: usize,
    },
}

fn pos_of(mark: &Marker) -> Pos {
    Pos {
        line: mark.line(),
        column: mark.col() + 1,
    }
}

fn deeper(max: usize) -> String {
    format!(
        "nesting deeper than {max} levels (mappings and sequences inside each other); refused before parsing"
    )
}

/// The path hash of the node an event starts, recording a sequence item's position; None
/// when the event is a mapping key.
fn value_hash(stack: &mut [Frame], positions: &mut Positions, pos: Pos) -> Option<(u64, bool)> {
    match stack.last_mut() {
        None => Some((FNV_OFFSET, true)),
        Some(Frame::Map { key: None, .. }) => None,
        Some(Frame::Map { key, .. }) => key.take().map(|h| (h, false)),
        Some(Frame::Seq { hash, index }) => {
            let h = index_hash(*hash, *index);
            *index += 1;
            positions
                .entry(h)
                .or_insert((pos.line as u32, pos.column as u32));
            Some((h, false))
        }
    }
}

/// One pass over the events of `text`: positions of every key and item, refusing nesting
/// deeper than `max_depth` and more than `max_nodes` nodes (an alias counts the nodes it
/// repeats). On an error the positions gathered so far come back with it.
pub(crate) fn scan(text: &str, limits: ScanLimits) -> Result<Locator, (ScanError, Locator)> {
    let mut scan = Scan::default();
    let mut parser = Parser::new_from_str(text);
    loop {
        let (ev, mark) = match parser.next_token() {
            Ok(x) => x,
            Err(e) => {
                // yaml-rust2's own bound (255 flow levels) is met scanning ahead.
                let limit = e.info() == "recursion limit exceeded";
                let message = if limit {
                    deeper(limits.max_depth)
                } else {
                    e.info().to_string()
                };
                return Err(scan.fail(pos_of(e.marker()), message, limit));
            }
        };
        let pos = pos_of(&mark);
        match ev {
            Event::StreamEnd => break,
            Event::Scalar(value, _, anchor, _) => scan.scalar(&value, anchor, pos),
            Event::Alias(id) => scan.alias(id, pos),
            Event::MappingStart(anchor, _) | Event::SequenceStart(anchor, _) => {
                scan.start(anchor, matches!(ev, Event::MappingStart(..)), pos);
                if scan.stack.len() > limits.max_depth {
                    return Err(scan.fail(pos, deeper(limits.max_depth), true));
                }
            }
            Event::MappingEnd | Event::SequenceEnd => scan.end(),
            _ => {}
        }
        if let Some(message) = too_many_nodes(scan.nodes, limits) {
            return Err(scan.fail(pos, message, true));
        }
    }
    Ok(Locator {
        positions: scan.positions,
        nodes: scan.nodes,
    })
}

/// Why `nodes` nodes are refused, if they are: more than the file's or the repo's limit.
fn too_many_nodes(nodes: u64, limits: ScanLimits) -> Option<String> {
    if nodes > limits.max_nodes {
        return Some(format!(
            "more than {} YAML nodes (an alias counts the nodes it repeats); refused before parsing",
            limits.max_nodes
        ));
    }
    if nodes > limits.repo_left {
        return Some(format!(
            "the files read before it and this one have more than {} YAML nodes together (the limit per repo); refused before parsing",
            limits.repo_max
        ));
    }
    None
}

/// The state of [`scan`] between events.
#[derive(Default)]
struct Scan {
    positions: Positions,
    stack: Vec<Frame>,
    /// (anchor id, node count when the anchored collection started)
    anchors: Vec<(usize, u64)>,
    /// Nodes under each anchor, the anchored node included.
    sizes: HashMap<usize, u64>,
    nodes: u64,
}

impl Scan {
    /// The error, with the positions gathered so far.
    fn fail(self, pos: Pos, message: String, limit: bool) -> (ScanError, Locator) {
        (
            ScanError {
                pos,
                message,
                limit,
            },
            Locator {
                positions: self.positions,
                nodes: 0,
            },
        )
    }

    /// A scalar: a value, or a mapping key (its path's position recorded).
    fn scalar(&mut self, value: &str, anchor: usize, pos: Pos) {
        self.nodes += 1;
        if anchor != 0 {
            self.sizes.insert(anchor, 1);
        }
        if value_hash(&mut self.stack, &mut self.positions, pos).is_none() {
            if let Some(Frame::Map { hash, root, key }) = self.stack.last_mut() {
                let h = key_hash(*hash, *root, value);
                self.positions
                    .entry(h)
                    .or_insert((pos.line as u32, pos.column as u32));
                *key = Some(h);
            }
        }
    }

    /// An alias: counts the nodes of its anchor.
    fn alias(&mut self, id: usize, pos: Pos) {
        self.nodes = self
            .nodes
            .saturating_add(self.sizes.get(&id).copied().unwrap_or(1));
        if value_hash(&mut self.stack, &mut self.positions, pos).is_none() {
            // An alias as a mapping key: no path below it.
            if let Some(Frame::Map { hash, key, .. }) = self.stack.last_mut() {
                *key = Some(fnv(*hash, b"*"));
            }
        }
    }

    /// The start of a mapping (`is_map`) or a sequence.
    fn start(&mut self, anchor: usize, is_map: bool, pos: Pos) {
        self.nodes += 1;
        let (hash, root) = match value_hash(&mut self.stack, &mut self.positions, pos) {
            Some(x) => x,
            // A collection as a mapping key: its value gets the path `parent.?`.
            None => match self.stack.last_mut() {
                Some(Frame::Map { hash, key, .. }) => {
                    let h = fnv(*hash, b".?");
                    *key = Some(h);
                    (h, false)
                }
                _ => (FNV_OFFSET, true),
            },
        };
        self.anchors.push((anchor, self.nodes));
        self.stack.push(if is_map {
            Frame::Map {
                hash,
                root,
                key: None,
            }
        } else {
            Frame::Seq { hash, index: 0 }
        });
    }

    /// The end of a mapping or a sequence: its anchor's size known.
    fn end(&mut self) {
        self.stack.pop();
        if let Some((anchor, start)) = self.anchors.pop() {
            if anchor != 0 {
                self.sizes.insert(anchor, self.nodes - start + 1);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_nested_keys_and_items() {
        let text =
            "service: a\nbuckets:\n  - name: x\n    limit_rps: 5\n  - name: y\n    limit_rps: 6\n";
        let l = Locator::new(text);
        assert_eq!(l.pos("service").line, 1);
        assert_eq!(l.pos("buckets").line, 2);
        assert_eq!(l.pos("buckets[0]").line, 3);
        assert_eq!(l.pos("buckets[1].limit_rps").line, 6);
        assert_eq!(l.pos("buckets[1].limit_rps").column, 5);
        // Unknown child falls back to its parent.
        assert_eq!(l.pos("buckets[1].nope").line, 5);
        assert_eq!(l.pos("zzz").line, 1);
    }

    #[test]
    fn deep_nesting_and_alias_bombs_are_refused_in_linear_time() {
        let limits = ScanLimits {
            max_depth: 64,
            max_nodes: 100_000,
            repo_left: u64::MAX,
            repo_max: u64::MAX,
        };
        for text in [
            format!("a: {}{}\n", "[".repeat(200_000), "]".repeat(200_000)),
            format!("a: {}{}\n", "{a: ".repeat(100_000), "}".repeat(100_000)),
            format!("a:\n{}x\n", "- ".repeat(200_000)),
        ] {
            let t = std::time::Instant::now();
            let (e, _) = scan(&text, limits).expect_err("refused");
            assert!(
                e.limit && e.message.contains("nesting deeper than 64"),
                "{e:?}"
            );
            assert!(t.elapsed() < std::time::Duration::from_secs(2));
        }
        let mut bomb = String::from("a0: &a0 [x,x,x,x,x,x,x,x,x,x]\n");
        for i in 1..9 {
            let p = i - 1;
            bomb.push_str(&format!(
                "a{i}: &a{i} [{}]\n",
                vec![format!("*a{p}"); 10].join(",")
            ));
        }
        let (e, _) = scan(&bomb, limits).expect_err("refused");
        assert!(e.message.contains("more than 100000 YAML nodes"), "{e:?}");
    }
}
