//! Maps YAML paths (`buckets[2].limit_rps`) to the line and column where they stand, so that
//! checks made after deserialisation can still point at the offending line.

use std::collections::HashMap;

use yaml_rust2::parser::{Event, MarkedEventReceiver, Parser};
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
    positions: HashMap<String, Pos>,
}

impl Locator {
    /// Builds the map; a document that does not parse gives an empty map (the deserialiser
    /// reports the syntax error with its own position).
    pub fn new(text: &str) -> Self {
        let mut rx = Receiver::default();
        let mut parser = Parser::new_from_str(text);
        if parser.load(&mut rx, false).is_err() {
            return Self::default();
        }
        Self {
            positions: rx.positions,
        }
    }

    /// The position of `path`, or of its nearest ancestor that has one, or line 1.
    pub fn pos(&self, path: &str) -> Pos {
        let mut p = path.to_string();
        loop {
            if let Some(pos) = self.positions.get(&p) {
                return *pos;
            }
            match p.rfind(['.', '[']) {
                Some(i) => p.truncate(i),
                None => return Pos { line: 1, column: 1 },
            }
        }
    }
}

enum Frame {
    Map { path: String, key: Option<String> },
    Seq { path: String, index: usize },
}

#[derive(Default)]
struct Receiver {
    stack: Vec<Frame>,
    positions: HashMap<String, Pos>,
}

fn join(parent: &str, key: &str) -> String {
    if parent.is_empty() {
        key.to_string()
    } else {
        format!("{parent}.{key}")
    }
}

impl Receiver {
    /// Path of the value about to be read at the top of the stack, recording its position.
    /// Returns None when the event is a mapping key.
    fn value_path(&mut self, mark: Marker) -> Option<String> {
        let pos = Pos {
            line: mark.line(),
            column: mark.col() + 1,
        };
        match self.stack.last_mut() {
            None => Some(String::new()),
            Some(Frame::Map { key: None, .. }) => None,
            Some(Frame::Map { path, key }) => {
                let p = join(path, key.as_deref().unwrap_or_default());
                *key = None;
                Some(p)
            }
            Some(Frame::Seq { path, index }) => {
                let p = format!("{path}[{index}]");
                *index += 1;
                self.positions.entry(p.clone()).or_insert(pos);
                Some(p)
            }
        }
    }
}

impl MarkedEventReceiver for Receiver {
    fn on_event(&mut self, ev: Event, mark: Marker) {
        match ev {
            Event::Scalar(value, ..) => {
                if self.value_path(mark).is_none() {
                    // A mapping key: remember it and where it stands.
                    if let Some(Frame::Map { path, key }) = self.stack.last_mut() {
                        let full = join(path, &value);
                        self.positions.entry(full).or_insert(Pos {
                            line: mark.line(),
                            column: mark.col() + 1,
                        });
                        *key = Some(value);
                    }
                }
            }
            Event::MappingStart(..) => {
                let path = self.value_path(mark).unwrap_or_default();
                self.stack.push(Frame::Map { path, key: None });
            }
            Event::SequenceStart(..) => {
                let path = self.value_path(mark).unwrap_or_default();
                self.stack.push(Frame::Seq { path, index: 0 });
            }
            Event::MappingEnd | Event::SequenceEnd => {
                self.stack.pop();
            }
            Event::Alias(_) => {
                self.value_path(mark);
            }
            _ => {}
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
}
