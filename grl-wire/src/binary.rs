//! The binary encoding of the client ↔ aggregator messages ([`ClientReport`] and its reply
//! [`ClientDirectives`]), used instead of JSON once an aggregator announced protocol 3
//! (`grl-proto: 3`) and marked by its content type [`CONTENT_TYPE`]. An aggregator answers in
//! the encoding it was sent, so JSON clients keep getting JSON.
//!
//! Layout (format version 1; every message starts with its format version byte):
//!
//! ```text
//! uvarint  LEB128 u64, at most 10 bytes
//! str      uvarint byte length, then that many bytes of UTF-8
//! f64      8 bytes, IEEE 754, little-endian
//!
//! ClientReport      u8 1 (format version), str client_id, str service, str version,
//!                   uvarint interval_ms, u8 flags (bit 0: urgent; other bits 0),
//!                   uvarint buckets, each: str bucket, uvarint offered, admitted, dropped,
//!                   shadow_dropped,
//!                   uvarint calls, each: str caller, str procedure, uvarint count
//! ClientDirectives  u8 1, str version, u8 0 | 1 then uvarint age_ms,
//!                   uvarint directives, each: str bucket, f64 ratio, f64 fleet_offered_rps,
//!                   f64 limit_rps, u8 fixed (0 | 1)
//! ```
//!
//! Format version 2 (criticality tiers) is version 1 with a section at the end:
//!
//! ```text
//! ClientReport      ... then for each bucket, in order: u8 tiers (0 to 4), each: u8 tier
//!                   (0 SHEDDABLE, 1 SHEDDABLE_PLUS, 2 CRITICAL, 3 CRITICAL_PLUS), uvarint
//!                   offered, admitted, dropped, shadow_dropped
//! ClientDirectives  ... then for each directive, in order: u8 255 (no split) | tier, then
//!                   after a tier f64 fraction
//! ```
//!
//! A message without tiers is written in version 1, byte for byte as before; version 2 only
//! when it carries tiers, which a sender does only for a peer of protocol 8 or later.
//!
//! A message ends exactly after its last field (trailing bytes are an error). A decoder
//! refuses another format version, a truncated body, an over-long varint, a count larger than
//! the bytes left could hold and invalid UTF-8, naming the field (`buckets[3].offered`). A
//! later format adds fields only at the end, under a new format version.

use schema::criticality::TIERS;
use schema::Criticality;

use super::{
    BucketCountsMsg, CallCountMsg, ClientDirectives, ClientReport, DirectiveMsg, TierCountsMsg,
    TierShedMsg,
};

/// The content type of a binary message (request and reply).
pub const CONTENT_TYPE: &str = "application/vnd.grl.binary";

/// The latest format version this build reads (it reads every earlier one too).
pub const FORMAT_VERSION: u8 = 2;

/// The format version of messages that carry criticality tiers.
pub const FORMAT_TIERS: u8 = 2;

/// No tier split in a version 2 directive.
const NO_SHED: u8 = u8::MAX;

/// Whether a `Content-Type` value names the binary encoding (parameters ignored).
pub fn is_binary(content_type: Option<&http::HeaderValue>) -> bool {
    content_type
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|t| t.trim().eq_ignore_ascii_case(CONTENT_TYPE))
}

/// Why a binary message was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("binary {what}: {reason}")]
pub struct DecodeError {
    what: &'static str,
    reason: String,
}

fn put_uvarint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    put_uvarint(out, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

/// A client report, encoded.
pub fn encode_report(r: &ClientReport) -> Vec<u8> {
    let names: usize = r.buckets.iter().map(|b| b.bucket.len() + 12).sum::<usize>()
        + r.calls
            .iter()
            .map(|c| c.caller.len() + c.procedure.len() + 6)
            .sum::<usize>();
    let mut out =
        Vec::with_capacity(24 + r.client_id.len() + r.service.len() + r.version.len() + names);
    let tiered = r.buckets.iter().any(|b| !b.tiers.is_empty());
    out.push(if tiered { FORMAT_TIERS } else { 1 });
    put_str(&mut out, &r.client_id);
    put_str(&mut out, &r.service);
    put_str(&mut out, &r.version);
    put_uvarint(&mut out, r.interval_ms);
    out.push(r.urgent as u8);
    put_uvarint(&mut out, r.buckets.len() as u64);
    for b in &r.buckets {
        put_str(&mut out, &b.bucket);
        for v in [b.offered, b.admitted, b.dropped, b.shadow_dropped] {
            put_uvarint(&mut out, v);
        }
    }
    put_uvarint(&mut out, r.calls.len() as u64);
    for c in &r.calls {
        put_str(&mut out, &c.caller);
        put_str(&mut out, &c.procedure);
        put_uvarint(&mut out, c.count);
    }
    if tiered {
        for b in &r.buckets {
            // At most one entry per tier (merged when given twice).
            let counts = b.tier_counts();
            out.push(counts.iter().flatten().count() as u8);
            for t in counts.into_iter().flatten() {
                out.push(t.tier as u8);
                for v in [t.offered, t.admitted, t.dropped, t.shadow_dropped] {
                    put_uvarint(&mut out, v);
                }
            }
        }
    }
    out
}

/// An aggregator's reply, encoded.
pub fn encode_directives(d: &ClientDirectives) -> Vec<u8> {
    EncodedDirectives::new(&d.version, &d.directives).with_age(d.age_ms)
}

/// A reply encoded but for its age: what an aggregator answers every client of one service
/// until the controller answers again, encoded once, with the age (which changes with every
/// report) put in per reply by [`Self::with_age`].
#[derive(Debug, Clone)]
pub struct EncodedDirectives {
    /// Format version and config version.
    head: Vec<u8>,
    /// The directives (count, then each).
    tail: Vec<u8>,
}

impl EncodedDirectives {
    /// Encodes `version` and `directives`.
    pub fn new(version: &str, directives: &[DirectiveMsg]) -> EncodedDirectives {
        let tiered = directives.iter().any(|m| m.shed.is_some());
        let mut head = Vec::with_capacity(11 + version.len());
        head.push(if tiered { FORMAT_TIERS } else { 1 });
        put_str(&mut head, version);
        let mut tail = Vec::with_capacity(
            10 + directives
                .iter()
                .map(|m| m.bucket.len() + 30)
                .sum::<usize>(),
        );
        put_uvarint(&mut tail, directives.len() as u64);
        for m in directives {
            put_str(&mut tail, &m.bucket);
            for v in [m.ratio, m.fleet_offered_rps, m.limit_rps] {
                tail.extend_from_slice(&v.to_le_bytes());
            }
            tail.push(m.fixed as u8);
        }
        if tiered {
            for m in directives {
                match m.shed {
                    Some(s) => {
                        tail.push(s.threshold as u8);
                        tail.extend_from_slice(&s.fraction.to_le_bytes());
                    }
                    None => tail.push(NO_SHED),
                }
            }
        }
        EncodedDirectives { head, tail }
    }

    /// The whole reply with `age_ms`.
    pub fn with_age(&self, age_ms: Option<u64>) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.head.len() + 11 + self.tail.len());
        out.extend_from_slice(&self.head);
        match age_ms {
            Some(a) => {
                out.push(1);
                put_uvarint(&mut out, a);
            }
            None => out.push(0),
        }
        out.extend_from_slice(&self.tail);
        out
    }
}

/// Reads fields off a message, naming the field in its errors.
struct Reader<'a> {
    what: &'static str,
    buf: &'a [u8],
    pos: usize,
    /// The message's format version.
    version: u8,
}

/// A field's name, built only when an error needs it.
trait Field {
    fn name(&self) -> String;
}

impl Field for &str {
    fn name(&self) -> String {
        self.to_string()
    }
}

impl<F: Fn() -> String> Field for F {
    fn name(&self) -> String {
        self()
    }
}

impl<'a> Reader<'a> {
    fn new(what: &'static str, buf: &'a [u8]) -> Result<Reader<'a>, DecodeError> {
        let mut r = Reader {
            what,
            buf,
            pos: 0,
            version: 0,
        };
        let v = r.u8(&"format version")?;
        if !(1..=FORMAT_VERSION).contains(&v) {
            return Err(r.err(format!(
                "format version {v} is not supported (this build reads versions 1 to {FORMAT_VERSION}; send JSON or one of those)"
            )));
        }
        r.version = v;
        Ok(r)
    }

    fn err(&self, reason: String) -> DecodeError {
        DecodeError {
            what: self.what,
            reason,
        }
    }

    fn truncated(&self, field: &dyn Field) -> DecodeError {
        self.err(format!(
            "truncated body: {} cut at byte {} of {}",
            field.name(),
            self.pos,
            self.buf.len()
        ))
    }

    fn u8(&mut self, field: &dyn Field) -> Result<u8, DecodeError> {
        let b = *self
            .buf
            .get(self.pos)
            .ok_or_else(|| self.truncated(field))?;
        self.pos += 1;
        Ok(b)
    }

    fn flag(&mut self, field: &dyn Field) -> Result<bool, DecodeError> {
        match self.u8(field)? {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(self.err(format!("{}: {b} is neither 0 nor 1", field.name()))),
        }
    }

    fn uvarint(&mut self, field: &dyn Field) -> Result<u64, DecodeError> {
        let mut v = 0u64;
        for i in 0..10 {
            let b = self.u8(field)?;
            if i == 9 && b > 1 {
                break;
            }
            v |= u64::from(b & 0x7f) << (7 * i);
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(self.err(format!(
            "{}: varint longer than a 64-bit number",
            field.name()
        )))
    }

    /// A count of entries of at least `min_bytes` each: never more than the bytes left hold.
    fn count(&mut self, field: &dyn Field, min_bytes: usize) -> Result<usize, DecodeError> {
        let n = self.uvarint(field)?;
        let left = (self.buf.len() - self.pos) as u64;
        if n.saturating_mul(min_bytes as u64) > left {
            return Err(self.err(format!(
                "truncated body: {} says {n} entries, only {left} bytes left",
                field.name()
            )));
        }
        Ok(n as usize)
    }

    fn str(&mut self, field: &dyn Field) -> Result<&'a str, DecodeError> {
        let n = self.uvarint(field)?;
        let left = self.buf.len() - self.pos;
        if n > left as u64 {
            return Err(self.err(format!(
                "truncated body: {} is {n} bytes long, only {left} left",
                field.name()
            )));
        }
        let bytes = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        std::str::from_utf8(bytes).map_err(|_| self.err(format!("{}: not UTF-8", field.name())))
    }

    fn tier(&mut self, field: &dyn Field) -> Result<Criticality, DecodeError> {
        let b = self.u8(field)?;
        Criticality::from_index(b as usize)
            .ok_or_else(|| self.err(format!("{}: {b} is not a tier (0 to 3)", field.name())))
    }

    fn f64(&mut self, field: &dyn Field) -> Result<f64, DecodeError> {
        let b = self
            .buf
            .get(self.pos..self.pos + 8)
            .ok_or_else(|| self.truncated(field))?;
        self.pos += 8;
        Ok(f64::from_le_bytes(b.try_into().expect("8 bytes")))
    }

    fn end(&self) -> Result<(), DecodeError> {
        if self.pos == self.buf.len() {
            Ok(())
        } else {
            Err(self.err(format!(
                "{} bytes after the last field (byte {} of {})",
                self.buf.len() - self.pos,
                self.pos,
                self.buf.len()
            )))
        }
    }
}

/// Decodes a client report.
pub fn decode_report(buf: &[u8]) -> Result<ClientReport, DecodeError> {
    let mut r = Reader::new("client report", buf)?;
    let client_id = r.str(&"client_id")?.to_string();
    let service = r.str(&"service")?.to_string();
    let version = r.str(&"version")?.to_string();
    let interval_ms = r.uvarint(&"interval_ms")?;
    let flags = r.u8(&"flags")?;
    if flags > 1 {
        return Err(r.err(format!("flags: unknown bits {flags:#04x}")));
    }
    // The smallest bucket: an empty name and four one-byte counts.
    let n = r.count(&"buckets", 5)?;
    let mut buckets = Vec::with_capacity(n);
    for i in 0..n {
        let bucket = r.str(&|| format!("buckets[{i}].bucket"))?.to_string();
        let mut v = [0u64; 4];
        for (k, name) in ["offered", "admitted", "dropped", "shadow_dropped"]
            .iter()
            .enumerate()
        {
            v[k] = r.uvarint(&|| format!("buckets[{i}].{name}"))?;
        }
        buckets.push(BucketCountsMsg {
            bucket,
            offered: v[0],
            admitted: v[1],
            dropped: v[2],
            shadow_dropped: v[3],
            tiers: Vec::new(),
        });
    }
    let n = r.count(&"calls", 3)?;
    let mut calls = Vec::with_capacity(n);
    for i in 0..n {
        calls.push(CallCountMsg {
            caller: r.str(&|| format!("calls[{i}].caller"))?.to_string(),
            procedure: r.str(&|| format!("calls[{i}].procedure"))?.to_string(),
            count: r.uvarint(&|| format!("calls[{i}].count"))?,
        });
    }
    if r.version >= FORMAT_TIERS {
        for (i, b) in buckets.iter_mut().enumerate() {
            b.tiers = read_tiers(&mut r, i)?;
        }
    }
    r.end()?;
    Ok(ClientReport {
        client_id,
        service,
        version,
        interval_ms,
        buckets,
        urgent: flags & 1 == 1,
        calls,
    })
}

/// The version 2 tier counts of bucket `i`.
fn read_tiers(r: &mut Reader<'_>, i: usize) -> Result<Vec<TierCountsMsg>, DecodeError> {
    let n = r.u8(&|| format!("buckets[{i}].tiers"))?;
    if n as usize > TIERS {
        return Err(r.err(format!("buckets[{i}].tiers: {n} entries, at most {TIERS}")));
    }
    let mut tiers = Vec::with_capacity(n as usize);
    for k in 0..n {
        let tier = r.tier(&|| format!("buckets[{i}].tiers[{k}].tier"))?;
        let mut v = [0u64; 4];
        for (j, name) in ["offered", "admitted", "dropped", "shadow_dropped"]
            .iter()
            .enumerate()
        {
            v[j] = r.uvarint(&|| format!("buckets[{i}].tiers[{k}].{name}"))?;
        }
        tiers.push(TierCountsMsg {
            tier,
            offered: v[0],
            admitted: v[1],
            dropped: v[2],
            shadow_dropped: v[3],
        });
    }
    Ok(tiers)
}

/// Decodes an aggregator's reply.
pub fn decode_directives(buf: &[u8]) -> Result<ClientDirectives, DecodeError> {
    let mut r = Reader::new("directives", buf)?;
    let version = r.str(&"version")?.to_string();
    let age_ms = if r.flag(&"age_ms present")? {
        Some(r.uvarint(&"age_ms")?)
    } else {
        None
    };
    // The smallest directive: an empty name, three f64 and the flag.
    let n = r.count(&"directives", 26)?;
    let mut directives = Vec::with_capacity(n);
    for i in 0..n {
        directives.push(DirectiveMsg {
            bucket: r.str(&|| format!("directives[{i}].bucket"))?.to_string(),
            ratio: r.f64(&|| format!("directives[{i}].ratio"))?,
            fleet_offered_rps: r.f64(&|| format!("directives[{i}].fleet_offered_rps"))?,
            limit_rps: r.f64(&|| format!("directives[{i}].limit_rps"))?,
            fixed: r.flag(&|| format!("directives[{i}].fixed"))?,
            shed: None,
        });
    }
    if r.version >= FORMAT_TIERS {
        for (i, d) in directives.iter_mut().enumerate() {
            let b = r.u8(&|| format!("directives[{i}].shed"))?;
            if b != NO_SHED {
                let threshold = Criticality::from_index(b as usize).ok_or_else(|| {
                    r.err(format!(
                        "directives[{i}].shed: {b} is not a tier (0 to 3) or 255"
                    ))
                })?;
                let fraction = r.f64(&|| format!("directives[{i}].shed.fraction"))?;
                d.shed = Some(TierShedMsg {
                    threshold,
                    fraction,
                });
            }
        }
    }
    r.end()?;
    Ok(ClientDirectives {
        version,
        age_ms,
        directives,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn report() -> ClientReport {
        ClientReport {
            client_id: "payments-01".into(),
            service: "payments".into(),
            version: "abc123".into(),
            interval_ms: 1000,
            buckets: vec![
                BucketCountsMsg {
                    bucket: "checkout.pay".into(),
                    offered: 300,
                    admitted: 290,
                    dropped: 10,
                    shadow_dropped: 5,
                    tiers: Vec::new(),
                },
                BucketCountsMsg {
                    bucket: "ünïcode".into(),
                    offered: u64::MAX,
                    admitted: u64::MAX,
                    dropped: 0,
                    shadow_dropped: 0,
                    tiers: Vec::new(),
                },
            ],
            urgent: true,
            calls: vec![CallCountMsg {
                caller: "checkout".into(),
                procedure: "pay".into(),
                count: 300,
            }],
        }
    }

    #[test]
    fn a_report_survives_the_round_trip_and_is_smaller_than_json() {
        let r = report();
        let b = encode_report(&r);
        assert_eq!(decode_report(&b).unwrap(), r);
        assert!(b.len() * 2 < serde_json::to_vec(&r).unwrap().len());
        let d = ClientDirectives {
            version: "v".into(),
            age_ms: Some(12),
            directives: vec![DirectiveMsg {
                bucket: "b".into(),
                ratio: 0.25,
                fleet_offered_rps: 1e6,
                limit_rps: f64::MAX,
                fixed: true,
                shed: None,
            }],
        };
        assert_eq!(decode_directives(&encode_directives(&d)).unwrap(), d);
        let none = ClientDirectives::default();
        assert_eq!(decode_directives(&encode_directives(&none)).unwrap(), none);
    }

    #[test]
    fn every_truncation_is_refused_naming_the_field() {
        let b = encode_report(&report());
        for n in 0..b.len() {
            let e = decode_report(&b[..n]).unwrap_err().to_string();
            assert!(
                e.starts_with("binary client report: truncated body"),
                "{n}: {e}"
            );
        }
        // Cut inside the second bucket's `offered` (u64::MAX: a 10-byte varint).
        let name = "ünïcode".as_bytes();
        let at = b.windows(name.len()).position(|w| w == name).unwrap() + name.len();
        let e = decode_report(&b[..at + 3]).unwrap_err().to_string();
        assert!(e.contains("buckets[1].offered cut at byte"), "{e}");
    }

    #[test]
    fn another_format_version_trailing_bytes_and_bad_fields_are_named() {
        let mut b = encode_report(&report());
        b[0] = 3;
        let e = decode_report(&b).unwrap_err().to_string();
        assert!(
            e.contains("format version 3 is not supported") && e.contains("versions 1 to 2"),
            "{e}"
        );
        b[0] = 1;
        b.push(0);
        let e = decode_report(&b).unwrap_err().to_string();
        assert!(e.contains("1 bytes after the last field"), "{e}");
        // An entry count no body could hold.
        let mut huge = vec![1, 0, 0, 0, 1, 0];
        put_uvarint(&mut huge, u64::MAX);
        let e = decode_report(&huge).unwrap_err().to_string();
        assert!(e.contains("buckets says") && e.contains("entries"), "{e}");
        // An over-long varint.
        let mut long = vec![1, 0, 0, 0];
        long.extend([0xff; 10]);
        long.push(1);
        let e = decode_report(&long).unwrap_err().to_string();
        assert!(e.contains("interval_ms: varint longer"), "{e}");
        // Invalid UTF-8 in a name.
        let e = decode_report(&[1, 1, 0xff]).unwrap_err().to_string();
        assert!(e.contains("client_id: not UTF-8"), "{e}");
        // Unknown flag bits.
        let e = decode_report(&[1, 0, 0, 0, 1, 2, 0, 0])
            .unwrap_err()
            .to_string();
        assert!(e.contains("flags: unknown bits"), "{e}");
    }

    /// Tiers travel in format 2; a message without them stays format 1, byte for byte; a
    /// tier section cut short or naming no tier is refused, naming the field.
    #[test]
    fn tiers_round_trip_in_format_2_and_bad_tiers_are_named() {
        let plain = report();
        assert_eq!(encode_report(&plain)[0], 1);
        let mut r = report();
        r.buckets[0].tiers = vec![
            TierCountsMsg {
                tier: Criticality::Sheddable,
                offered: 180,
                admitted: 80,
                dropped: 100,
                shadow_dropped: 0,
            },
            TierCountsMsg {
                tier: Criticality::Critical,
                offered: 120,
                admitted: 120,
                dropped: 0,
                shadow_dropped: 0,
            },
        ];
        let b = encode_report(&r);
        assert_eq!(b[0], FORMAT_TIERS);
        assert_eq!(decode_report(&b).unwrap(), r);
        let e = decode_report(&b[..b.len() - 1]).unwrap_err().to_string();
        assert!(e.contains("buckets[1].tiers cut at byte"), "{e}");
        // The first bucket's first tier byte, set to 7.
        let mut bad = b.clone();
        let at = bad.len() - 1 - (1 + 4 + 1 + 4) - 1;
        assert_eq!(bad[at - 1], 2, "two tiers in the first bucket");
        bad[at] = 7;
        let e = decode_report(&bad).unwrap_err().to_string();
        assert!(
            e.contains("buckets[0].tiers[0].tier: 7 is not a tier"),
            "{e}"
        );

        let mut d = ClientDirectives {
            version: "v".into(),
            age_ms: Some(5),
            directives: vec![
                DirectiveMsg {
                    bucket: "a".into(),
                    ratio: 1.0 / 3.0,
                    fleet_offered_rps: 300.0,
                    limit_rps: 200.0,
                    fixed: false,
                    shed: Some(TierShedMsg {
                        threshold: Criticality::Sheddable,
                        fraction: 100.0 / 180.0,
                    }),
                },
                DirectiveMsg {
                    bucket: "b".into(),
                    ratio: 0.0,
                    fleet_offered_rps: 1.0,
                    limit_rps: 2.0,
                    fixed: false,
                    shed: None,
                },
            ],
        };
        let b = encode_directives(&d);
        assert_eq!(b[0], FORMAT_TIERS);
        assert_eq!(decode_directives(&b).unwrap(), d);
        d.directives[0].shed = None;
        let b = encode_directives(&d);
        assert_eq!(b[0], 1);
        assert_eq!(decode_directives(&b).unwrap(), d);
    }

    #[test]
    fn content_type_is_matched_without_parameters() {
        let v = |s: &str| http::HeaderValue::from_str(s).unwrap();
        assert!(is_binary(Some(&v(CONTENT_TYPE))));
        assert!(is_binary(Some(&v("Application/Vnd.Grl.Binary; x=1"))));
        assert!(!is_binary(Some(&v("application/json"))));
        assert!(!is_binary(None));
    }

    proptest! {
        #[test]
        fn any_report_round_trips(
            id in ".{0,20}", svc in ".{0,20}", interval in any::<u64>(), urgent in any::<bool>(),
            buckets in proptest::collection::vec((".{0,12}", any::<[u64; 4]>()), 0..20),
            calls in proptest::collection::vec((".{0,8}", ".{0,8}", any::<u64>()), 0..8),
        ) {
            let r = ClientReport {
                client_id: id,
                service: svc,
                version: String::new(),
                interval_ms: interval,
                urgent,
                buckets: buckets.into_iter().map(|(bucket, v)| BucketCountsMsg {
                    bucket, offered: v[0], admitted: v[1], dropped: v[2], shadow_dropped: v[3], tiers: Vec::new(),
                }).collect(),
                calls: calls.into_iter().map(|(caller, procedure, count)| CallCountMsg {
                    caller, procedure, count,
                }).collect(),
            };
            prop_assert_eq!(decode_report(&encode_report(&r)).unwrap(), r);
        }

        #[test]
        fn arbitrary_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = decode_report(&b);
            let _ = decode_directives(&b);
        }
    }
}
