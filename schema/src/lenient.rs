//! Every problem of a file, not only the first: a deserialiser over the parsed YAML tree that
//! records a problem and carries on where serde_yaml stops. It runs only on files that
//! serde_yaml refused (what is accepted is always serde_yaml's decision); it returns the
//! problems, each with its YAML path, and the value with the faulty parts replaced, so that
//! the checks made after parsing still run on the rest of the file.
//!
//! - A wrong type, an unknown key or an unknown enum variant is recorded and replaced on the
//!   spot (a neutral value of the requested type, the key skipped, the first variant).
//! - A missing required field is recorded and a neutral value injected on the next pass.
//! - An error raised inside a type's own parser (a policy name, a duration, a date) is recorded
//!   and its key treated as absent on the next pass.
//!
//! The number of passes is bounded ([`MAX_PASSES`]); problems found in earlier passes stay.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::de::{
    self, DeserializeOwned, DeserializeSeed, IntoDeserializer, MapAccess, SeqAccess, Unexpected,
    Visitor,
};
use serde_yaml::Value;

/// Passes at most (each is one walk of the tree).
pub(crate) const MAX_PASSES: usize = 32;

/// One problem: the YAML path and the message.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Problem {
    pub path: String,
    pub message: String,
}

#[derive(Default)]
struct State {
    problems: BTreeMap<String, String>,
    /// Paths treated as absent.
    holes: BTreeSet<String>,
    /// (struct path, field) given a neutral value.
    inject: BTreeSet<(String, &'static str)>,
    /// Paths whose own problem was recorded: errors from inside them are consequences.
    faulty: BTreeSet<String>,
}

impl State {
    fn record(&mut self, path: &str, message: String) {
        if self.problems.len() < 100_000 {
            self.problems.entry(path.to_string()).or_insert(message);
        }
        self.faulty.insert(path.to_string());
    }
}

/// An error on its way up: where it arose and whether it is a missing field.
#[derive(Debug)]
pub(crate) struct Error {
    msg: String,
    path: Option<String>,
    missing: Option<&'static str>,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.msg)
    }
}

impl std::error::Error for Error {}

impl de::Error for Error {
    fn custom<T: fmt::Display>(msg: T) -> Self {
        Error {
            msg: msg.to_string(),
            path: None,
            missing: None,
        }
    }
    fn missing_field(field: &'static str) -> Self {
        Error {
            msg: format!("missing field `{field}`"),
            path: None,
            missing: Some(field),
        }
    }
}

fn at(path: &str) -> impl FnOnce(Error) -> Error + '_ {
    move |mut e| {
        if e.path.is_none() {
            e.path = Some(path.to_string());
        }
        e
    }
}

fn child_key(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

fn key_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        Value::Bool(b) => b.to_string(),
        Value::Null => "null".into(),
        _ => "?".into(),
    }
}

fn unexpected(v: &Value) -> Unexpected<'_> {
    match v {
        Value::Null => Unexpected::Unit,
        Value::Bool(b) => Unexpected::Bool(*b),
        Value::Number(n) => match (n.as_u64(), n.as_i64(), n.as_f64()) {
            (Some(u), _, _) => Unexpected::Unsigned(u),
            (_, Some(i), _) => Unexpected::Signed(i),
            (_, _, Some(f)) => Unexpected::Float(f),
            _ => Unexpected::Other("number"),
        },
        Value::String(s) => Unexpected::Str(s),
        Value::Sequence(_) => Unexpected::Seq,
        Value::Mapping(_) => Unexpected::Map,
        Value::Tagged(_) => Unexpected::Enum,
    }
}

static NULL: Value = Value::Null;

/// The deserialiser of one node. `hole`: a neutral value for whatever is asked, silently.
struct De<'a> {
    v: &'a Value,
    path: String,
    st: &'a RefCell<State>,
    hole: bool,
}

impl<'a> De<'a> {
    fn new(v: &'a Value, path: String, st: &'a RefCell<State>) -> Self {
        let v = match v {
            Value::Tagged(t) => &t.value,
            v => v,
        };
        De {
            v,
            path,
            st,
            hole: false,
        }
    }

    /// Records that this node is not what `exp` expects (unless it is a hole).
    fn wrong(&self, exp: &dyn de::Expected) {
        if !self.hole {
            let e: Error = de::Error::invalid_type(unexpected(self.v), exp);
            self.st.borrow_mut().record(&self.path, e.msg);
        }
    }
}

macro_rules! number {
    ($name:ident, $visit:ident, $get:ident, $zero:expr) => {
        fn $name<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
            if let Value::Number(n) = self.v {
                if let Some(x) = n.$get() {
                    return visitor.$visit(x).map_err(at(&self.path));
                }
            }
            self.wrong(&visitor);
            visitor.$visit($zero).map_err(at(&self.path))
        }
    };
}

impl<'de> de::Deserializer<'de> for De<'_> {
    type Error = Error;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        let path = self.path.clone();
        match self.v {
            Value::Null => visitor.visit_unit(),
            Value::Bool(b) => visitor.visit_bool(*b),
            Value::Number(n) => match (n.as_u64(), n.as_i64(), n.as_f64()) {
                (Some(u), _, _) => visitor.visit_u64(u),
                (_, Some(i), _) => visitor.visit_i64(i),
                (_, _, Some(f)) => visitor.visit_f64(f),
                _ => visitor.visit_unit(),
            },
            Value::String(s) => visitor.visit_str(s),
            Value::Sequence(_) => return self.deserialize_seq(visitor),
            Value::Mapping(_) => return self.deserialize_map(visitor),
            Value::Tagged(_) => visitor.visit_unit(),
        }
        .map_err(at(&path))
    }

    fn deserialize_bool<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        if let Value::Bool(b) = self.v {
            return visitor.visit_bool(*b).map_err(at(&self.path));
        }
        self.wrong(&visitor);
        visitor.visit_bool(false).map_err(at(&self.path))
    }

    number!(deserialize_i8, visit_i64, as_i64, 0);
    number!(deserialize_i16, visit_i64, as_i64, 0);
    number!(deserialize_i32, visit_i64, as_i64, 0);
    number!(deserialize_i64, visit_i64, as_i64, 0);
    number!(deserialize_u8, visit_u64, as_u64, 0);
    number!(deserialize_u16, visit_u64, as_u64, 0);
    number!(deserialize_u32, visit_u64, as_u64, 0);
    number!(deserialize_u64, visit_u64, as_u64, 0);
    number!(deserialize_f32, visit_f64, as_f64, 0.0);
    number!(deserialize_f64, visit_f64, as_f64, 0.0);

    fn deserialize_char<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        self.deserialize_str(visitor)
    }

    fn deserialize_str<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        // Any scalar reads as its text, as in serde_yaml.
        let text = match self.v {
            Value::String(s) => Some(s.clone()),
            Value::Number(n) => Some(n.to_string()),
            Value::Bool(b) => Some(b.to_string()),
            Value::Null if !self.hole => Some("~".to_string()),
            _ => None,
        };
        match text {
            Some(t) => visitor.visit_str(&t).map_err(at(&self.path)),
            None => {
                self.wrong(&visitor);
                visitor.visit_str("").map_err(at(&self.path))
            }
        }
    }

    fn deserialize_string<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        self.deserialize_str(visitor)
    }

    fn deserialize_bytes<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        self.deserialize_seq(visitor)
    }

    fn deserialize_byte_buf<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        self.deserialize_seq(visitor)
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        if matches!(self.v, Value::Null) {
            visitor.visit_none().map_err(at(&self.path))
        } else {
            let path = self.path.clone();
            visitor.visit_some(self).map_err(at(&path))
        }
    }

    fn deserialize_unit<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        if !matches!(self.v, Value::Null) {
            self.wrong(&visitor);
        }
        visitor.visit_unit().map_err(at(&self.path))
    }

    fn deserialize_unit_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        visitor: V,
    ) -> Result<V::Value, Error> {
        self.deserialize_unit(visitor)
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        visitor: V,
    ) -> Result<V::Value, Error> {
        let path = self.path.clone();
        visitor.visit_newtype_struct(self).map_err(at(&path))
    }

    fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        let items: &[Value] = match self.v {
            Value::Sequence(s) if !self.hole => s,
            _ => {
                self.wrong(&visitor);
                &[]
            }
        };
        let acc = Seq {
            items,
            i: 0,
            path: &self.path,
            st: self.st,
        };
        visitor.visit_seq(acc).map_err(at(&self.path))
    }

    fn deserialize_tuple<V: Visitor<'de>>(self, _: usize, visitor: V) -> Result<V::Value, Error> {
        self.deserialize_seq(visitor)
    }

    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        _: usize,
        visitor: V,
    ) -> Result<V::Value, Error> {
        self.deserialize_seq(visitor)
    }

    fn deserialize_map<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        self.map(None, visitor)
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Error> {
        self.map(Some(fields), visitor)
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Error> {
        let first = variants.first().copied().unwrap_or("");
        let name: &str = match self.v {
            Value::String(s) if variants.contains(&s.as_str()) => s,
            Value::String(s) => {
                if !self.hole {
                    let e: Error = de::Error::unknown_variant(s, variants);
                    self.st.borrow_mut().record(&self.path, e.msg);
                }
                first
            }
            _ => {
                self.wrong(&visitor);
                first
            }
        };
        let d: de::value::StrDeserializer<'_, Error> = name.into_deserializer();
        visitor.visit_enum(d).map_err(at(&self.path))
    }

    fn deserialize_identifier<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        self.deserialize_str(visitor)
    }

    fn deserialize_ignored_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_unit()
    }
}

impl<'a> De<'a> {
    fn map<'de, V: Visitor<'de>>(
        self,
        fields: Option<&'static [&'static str]>,
        visitor: V,
    ) -> Result<V::Value, Error> {
        let mut entries: Vec<(String, &Value)> = Vec::new();
        match self.v {
            Value::Mapping(m) if !self.hole => {
                let st = self.st.borrow();
                for (k, v) in m {
                    let key = key_text(k);
                    let path = child_key(&self.path, &key);
                    if st.holes.contains(&path) {
                        continue;
                    }
                    entries.push((key, v));
                }
            }
            Value::Mapping(_) => {}
            _ => self.wrong(&visitor),
        }
        let mut injected = BTreeSet::new();
        if let Some(fields) = fields {
            let mut st = self.st.borrow_mut();
            entries.retain(|(k, _)| {
                if fields.contains(&k.as_str()) {
                    return true;
                }
                let e: Error = de::Error::unknown_field(k, fields);
                let p = child_key(&self.path, k);
                st.record(&p, e.msg);
                false
            });
            let wanted: Vec<&'static str> = st
                .inject
                .range((self.path.clone(), "")..)
                .take_while(|(p, _)| *p == self.path)
                .map(|(_, f)| *f)
                .collect();
            for f in wanted {
                if !entries.iter().any(|(k, _)| k == f) {
                    entries.push((f.to_string(), &NULL));
                    injected.insert(f.to_string());
                }
            }
        }
        let acc = Map {
            entries,
            i: 0,
            path: &self.path,
            st: self.st,
            injected,
        };
        visitor.visit_map(acc).map_err(at(&self.path))
    }
}

struct Seq<'a> {
    items: &'a [Value],
    i: usize,
    path: &'a str,
    st: &'a RefCell<State>,
}

impl<'de> SeqAccess<'de> for Seq<'_> {
    type Error = Error;
    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, Error> {
        loop {
            let Some(v) = self.items.get(self.i) else {
                return Ok(None);
            };
            let path = format!("{}[{}]", self.path, self.i);
            self.i += 1;
            if self.st.borrow().holes.contains(&path) {
                continue;
            }
            return seed.deserialize(De::new(v, path, self.st)).map(Some);
        }
    }
}

struct Map<'a> {
    entries: Vec<(String, &'a Value)>,
    i: usize,
    path: &'a str,
    st: &'a RefCell<State>,
    injected: BTreeSet<String>,
}

impl<'de> MapAccess<'de> for Map<'_> {
    type Error = Error;
    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, Error> {
        let Some((k, _)) = self.entries.get(self.i) else {
            return Ok(None);
        };
        let d: de::value::StrDeserializer<'_, Error> = k.as_str().into_deserializer();
        seed.deserialize(d)
            .map(Some)
            .map_err(at(&child_key(self.path, k)))
    }
    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, Error> {
        let Some((k, v)) = self.entries.get(self.i) else {
            return Err(de::Error::custom("a value without a key"));
        };
        self.i += 1;
        let mut de = De::new(v, child_key(self.path, k), self.st);
        de.hole = self.injected.contains(k);
        seed.deserialize(de)
    }
}

/// Deserialises `T` from `value` leniently: every problem found (with its path, in path
/// order) and the value with the faulty parts replaced, if one could be built.
pub(crate) fn collect<T: DeserializeOwned>(value: &Value) -> (Vec<Problem>, Option<T>) {
    let st = RefCell::new(State::default());
    let mut seen_errors: BTreeSet<(String, String)> = BTreeSet::new();
    let mut out = None;
    for _ in 0..MAX_PASSES {
        let r = T::deserialize(De::new(value, String::new(), &st));
        match r {
            Ok(v) => {
                out = Some(v);
                break;
            }
            Err(e) => {
                let path = e.path.clone().unwrap_or_default();
                if !seen_errors.insert((path.clone(), e.msg.clone())) {
                    break; // the same error again: no progress possible
                }
                let mut s = st.borrow_mut();
                // Is the error a consequence of a problem already recorded at or above it?
                let consequence = s.faulty.iter().any(|f| {
                    path == *f
                        || path.starts_with(&format!("{f}."))
                        || path.starts_with(&format!("{f}["))
                });
                match e.missing {
                    Some(field) => {
                        if !consequence {
                            let p = child_key(&path, field);
                            s.problems.entry(p).or_insert(e.msg.clone());
                        }
                        s.inject.insert((path, field));
                    }
                    None => {
                        if !consequence {
                            s.record(&path, e.msg.clone());
                        }
                        if path.is_empty() {
                            break;
                        }
                        s.holes.insert(path);
                    }
                }
            }
        }
    }
    let st = st.into_inner();
    let problems = st
        .problems
        .into_iter()
        .map(|(path, message)| Problem { path, message })
        .collect();
    (problems, out)
}
