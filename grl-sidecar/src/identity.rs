//! Who calls and what they call, for a request the sidecar decides: the caller from a verified
//! client certificate (SPIFFE ID or another name, through patterns), else from a header the
//! operator trusts, else `unknown`; the procedure from the gRPC path, else a header, else the
//! method and a configured route template (unmatched paths fold into one value, so that a
//! scanner cannot create unbounded keys).

use std::borrow::Cow;

use http::{HeaderMap, HeaderName, Method};

/// The caller of a request no source names.
pub const UNKNOWN_CALLER: &str = "unknown";

/// The procedure of an HTTP request no route matches (the same fold as `grl_calls_total`).
pub const UNMATCHED_PROCEDURE: &str = grl_client::calls::OTHER;

/// Longest caller or procedure taken from a request; a longer one is cut (names in bucket files
/// are short; `grl_calls_total` folds longer ones anyway).
pub const MAX_KEY_LEN: usize = 256;

/// One piece of a [`NamePattern`].
#[derive(Debug, Clone, PartialEq)]
enum Piece {
    Lit(String),
    /// `*`: any run of characters without `/` (possibly empty).
    Star,
    /// `{caller}`: a non-empty run of characters without `/`, captured.
    Caller,
}

/// Why a caller pattern or a route is refused; each message quotes the text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PatternError {
    /// Braces around anything but `{caller}` in a caller pattern.
    #[error("{0:?}: only {{caller}} may stand in braces")]
    Braces(String),
    /// A caller pattern without `{caller}`, or with it twice.
    #[error("{0:?}: a caller pattern holds {{caller}} exactly once")]
    CallerCount(String),
    /// A route's method is not one.
    #[error("{text:?}: {method:?} is not an HTTP method")]
    Method {
        /// The route as given.
        text: String,
        /// Its first word.
        method: String,
    },
    /// A route template not starting with `/`.
    #[error("{0:?}: a route template starts with /")]
    NoSlash(String),
    /// A `{rest*}` parameter before the last segment.
    #[error("{text:?}: {{{name}}} must be the last segment")]
    RestNotLast {
        /// The route as given.
        text: String,
        /// The parameter's name.
        name: String,
    },
    /// A parameter sharing its segment with other characters.
    #[error("{0:?}: a parameter is a whole segment, {{name}}")]
    PartialParam(String),
}

/// A pattern mapping a certificate name to a caller, e.g. `spiffe://*/ns/*/sa/{caller}` (the
/// service account of a SPIFFE ID) or `{caller}.clients.example.com` (a DNS name). `*` matches
/// any characters but `/`; `{caller}` (exactly once) the caller name.
#[derive(Debug, Clone, PartialEq)]
pub struct NamePattern {
    text: String,
    pieces: Vec<Piece>,
}

impl NamePattern {
    /// Parses a pattern; it must hold `{caller}` exactly once.
    pub fn parse(text: &str) -> Result<NamePattern, PatternError> {
        let mut pieces = Vec::new();
        let mut lit = String::new();
        let mut rest = text;
        let mut callers = 0;
        while !rest.is_empty() {
            if let Some(r) = rest.strip_prefix("{caller}") {
                if !lit.is_empty() {
                    pieces.push(Piece::Lit(std::mem::take(&mut lit)));
                }
                pieces.push(Piece::Caller);
                callers += 1;
                rest = r;
            } else if let Some(r) = rest.strip_prefix('*') {
                if !lit.is_empty() {
                    pieces.push(Piece::Lit(std::mem::take(&mut lit)));
                }
                pieces.push(Piece::Star);
                rest = r;
            } else {
                let c = rest.chars().next().expect("not empty");
                if c == '{' || c == '}' {
                    return Err(PatternError::Braces(text.to_string()));
                }
                lit.push(c);
                rest = &rest[c.len_utf8()..];
            }
        }
        if !lit.is_empty() {
            pieces.push(Piece::Lit(lit));
        }
        if callers != 1 {
            return Err(PatternError::CallerCount(text.to_string()));
        }
        Ok(NamePattern {
            text: text.to_string(),
            pieces,
        })
    }

    /// The pattern as written.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The caller `name` maps to, if it matches.
    pub fn capture<'a>(&self, name: &'a str) -> Option<&'a str> {
        let mut out = None;
        matches(&self.pieces, name, &mut out)
            .then_some(out)
            .flatten()
    }
}

/// Whether `pieces` match all of `s`; the `{caller}` span goes to `out`.
fn matches<'a>(pieces: &[Piece], s: &'a str, out: &mut Option<&'a str>) -> bool {
    let Some((first, rest)) = pieces.split_first() else {
        return s.is_empty();
    };
    match first {
        Piece::Lit(l) => s
            .strip_prefix(l.as_str())
            .is_some_and(|r| matches(rest, r, out)),
        Piece::Star | Piece::Caller => {
            // The span ends at a `/` or at the end; try every end, shortest first.
            let limit = s.find('/').unwrap_or(s.len());
            let min = usize::from(*first == Piece::Caller);
            for end in (min..=limit).filter(|e| s.is_char_boundary(*e)) {
                if matches(rest, &s[end..], out) {
                    if *first == Piece::Caller {
                        *out = Some(&s[..end]);
                    }
                    return true;
                }
            }
            false
        }
    }
}

/// Where the caller comes from, first that applies.
#[derive(Debug, Clone)]
pub struct CallerFrom {
    /// Patterns tried in order on every name of a verified client certificate (URI SANs such
    /// as SPIFFE IDs, then DNS names); the first that matches names the caller.
    pub cert_patterns: Vec<NamePattern>,
    /// The header naming the caller (`rpc-caller` by default), or None to trust no header. A
    /// header is spoofable unless the mesh or the network guarantees who sets it. For
    /// `x-forwarded-client-cert` the `URI=` of the last element is taken and mapped through
    /// `cert_patterns` (the SPIFFE ID the mesh verified). Never read on a connection that
    /// presented a verified client certificate: there the certificate is the caller's word.
    pub header: Option<HeaderName>,
    /// The header in which the caller of a verified certificate is passed upstream (None: not
    /// passed). The caller's own value of it is never passed on.
    pub verified_header: Option<HeaderName>,
}

impl Default for CallerFrom {
    fn default() -> Self {
        CallerFrom {
            cert_patterns: vec![NamePattern::parse("spiffe://*/ns/*/sa/{caller}").expect("valid")],
            header: Some(HeaderName::from_static("rpc-caller")),
            verified_header: None,
        }
    }
}

impl CallerFrom {
    /// The caller of a request whose connection presented `cert_names` (empty without a
    /// verified client certificate) and whose headers are `headers`.
    /// With a certificate, the headers are not read: a caller whose certificate no pattern
    /// maps is [`UNKNOWN_CALLER`], never the name it claims.
    pub fn caller<'a>(&self, cert_names: &'a [String], headers: &'a HeaderMap) -> &'a str {
        self.caller_checked(cert_names, headers)
            .unwrap_or(UNKNOWN_CALLER)
    }

    /// [`CallerFrom::caller`], or None when the caller header would be read and is given
    /// more than once: which line names the caller is then a guess (a front proxy that
    /// appends leaves the client's line first), so the request is refused.
    /// `x-forwarded-client-cert` is exempt: proxies append to it by design and its last
    /// element is the nearest.
    pub fn caller_checked<'a>(
        &self,
        cert_names: &'a [String],
        headers: &'a HeaderMap,
    ) -> Option<&'a str> {
        if !cert_names.is_empty() {
            return Some(self.certified(cert_names).unwrap_or(UNKNOWN_CALLER));
        }
        let Some(h) = &self.header else {
            return Some(UNKNOWN_CALLER);
        };
        let xfcc = h.as_str() == XFCC;
        let mut lines = headers.get_all(h).iter();
        // Proxies append their element to x-forwarded-client-cert: its last line is the
        // nearest.
        let v = match xfcc {
            true => lines.next_back(),
            false => {
                let first = lines.next();
                if lines.next().is_some() {
                    return None;
                }
                first
            }
        };
        let Some(v) = v.and_then(|v| v.to_str().ok()) else {
            return Some(UNKNOWN_CALLER);
        };
        let v = if xfcc {
            match xfcc_uri(v) {
                Some(uri) => self.map(uri).unwrap_or(uri),
                None => "",
            }
        } else {
            v.trim()
        };
        if v.is_empty() {
            Some(UNKNOWN_CALLER)
        } else {
            Some(cut(v))
        }
    }

    /// The caller a certificate's names map to: URI names first (a SPIFFE ID says more than a
    /// DNS name), each through the patterns in order.
    fn certified<'a>(&self, cert_names: &'a [String]) -> Option<&'a str> {
        let uris = cert_names.iter().filter(|n| n.contains("://"));
        let dns = cert_names.iter().filter(|n| !n.contains("://"));
        uris.chain(dns).find_map(|name| self.map(name)).map(cut)
    }

    fn map<'a>(&self, name: &'a str) -> Option<&'a str> {
        self.cert_patterns.iter().find_map(|p| p.capture(name))
    }

    /// Fixes the identity headers of a request going upstream. On a connection with a verified
    /// certificate, the caller's identity headers (the caller header and
    /// `x-forwarded-client-cert`) are removed, and the certificate's caller is passed in the
    /// verified header when one is named. Without a certificate, only a caller's own value of the verified
    /// header is removed: the upstream must be able to trust it.
    pub fn pass_on(&self, cert_names: &[String], headers: &mut HeaderMap) {
        if let Some(v) = &self.verified_header {
            headers.remove(v);
        }
        if cert_names.is_empty() {
            return;
        }
        if let Some(h) = &self.header {
            headers.remove(h);
        }
        headers.remove(XFCC);
        if let Some(v) = &self.verified_header {
            let caller = self.certified(cert_names).unwrap_or(UNKNOWN_CALLER);
            if let Ok(value) = http::HeaderValue::from_str(caller) {
                headers.insert(v.clone(), value);
            }
        }
    }
}

const XFCC: &str = "x-forwarded-client-cert";

/// The `URI=` value of the last element of an `x-forwarded-client-cert` header (Envoy's format:
/// elements separated by `,`, key=value pairs by `;`, values optionally quoted, and a quoted
/// value may hold `,`, `;` and `=`: a certificate subject such as `"CN=a,URI=spiffe://x"` is
/// one value, never an element or a key of its own). A URI with a quote or a backslash in it is
/// none.
pub fn xfcc_uri(v: &str) -> Option<&str> {
    let last = last_element(v)?;
    split_unquoted(last, b';').find_map(|kv| {
        let (k, val) = kv.split_once('=')?;
        if !k.trim().eq_ignore_ascii_case("uri") {
            return None;
        }
        let val = val.trim();
        let val = match val.strip_prefix('"') {
            Some(quoted) => quoted.strip_suffix('"')?,
            None => val,
        };
        (!val.is_empty() && !val.contains(['"', '\\'])).then_some(val)
    })
}

/// The last element of an `x-forwarded-client-cert` value: after the last `,` outside quotes,
/// found from the end. The element the nearest proxy appended is well formed whatever the
/// caller put before it (an unclosed quote of the caller's swallows nothing of it); `None` when
/// the quotes of the last element do not close.
fn last_element(v: &str) -> Option<&str> {
    let b = v.as_bytes();
    let mut quoted = false;
    for i in (0..b.len()).rev() {
        match b[i] {
            b'"' => {
                let escapes = b[..i].iter().rev().take_while(|&&c| c == b'\\').count();
                if escapes % 2 == 0 {
                    quoted = !quoted;
                }
            }
            b',' if !quoted => return Some(&v[i + 1..]),
            _ => {}
        }
    }
    (!quoted).then_some(v)
}

/// `s` split at each `sep` outside double quotes (inside them, a backslash escapes the next
/// character).
fn split_unquoted(s: &str, sep: u8) -> impl Iterator<Item = &str> {
    let b = s.as_bytes();
    let (mut start, mut quoted, mut i) = (0, false, 0);
    std::iter::from_fn(move || {
        if start > b.len() {
            return None;
        }
        while i < b.len() {
            match b[i] {
                b'\\' if quoted => i += 1,
                b'"' => quoted = !quoted,
                c if c == sep && !quoted => {
                    let part = &s[start..i];
                    i += 1;
                    start = i;
                    return Some(part);
                }
                _ => {}
            }
            i += 1;
        }
        let last = &s[start.min(b.len())..];
        start = b.len() + 1;
        Some(last)
    })
}

fn cut(s: &str) -> &str {
    if s.len() <= MAX_KEY_LEN {
        return s;
    }
    let mut end = MAX_KEY_LEN;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// One segment of a route template.
#[derive(Debug, Clone, PartialEq)]
enum Seg {
    Lit(String),
    /// `{name}`: one segment.
    Param,
    /// `{name*}` (last): the rest of the path, possibly empty.
    Rest,
}

/// A route template, `GET /users/{id}` or `/static/{path*}` (every method): the procedure of a
/// matching HTTP request is the method and the template, `GET /users/{id}`.
#[derive(Debug, Clone, PartialEq)]
pub struct Route {
    method: Option<Method>,
    template: String,
    segs: Vec<Seg>,
    /// The procedure when the method is fixed.
    name: String,
}

/// Methods a route without one matches (an extension method folds into the unmatched value:
/// methods are chosen by the client).
const METHODS: [Method; 7] = [
    Method::GET,
    Method::HEAD,
    Method::POST,
    Method::PUT,
    Method::DELETE,
    Method::PATCH,
    Method::OPTIONS,
];

impl Route {
    /// Parses `[METHOD ]/path/{param}/…[/{rest*}]`.
    pub fn parse(text: &str) -> Result<Route, PatternError> {
        let (method, template) = match text.trim().split_once(' ') {
            Some((m, t)) => {
                let m = Method::from_bytes(m.as_bytes()).map_err(|_| PatternError::Method {
                    text: text.to_string(),
                    method: m.to_string(),
                })?;
                (Some(m), t.trim())
            }
            None => (None, text.trim()),
        };
        if !template.starts_with('/') {
            return Err(PatternError::NoSlash(text.to_string()));
        }
        let parts: Vec<&str> = template.split('/').skip(1).collect();
        let mut segs = Vec::new();
        for (i, p) in parts.iter().enumerate() {
            let seg = match p.strip_prefix('{').and_then(|p| p.strip_suffix('}')) {
                Some(name) if name.ends_with('*') => {
                    if i + 1 != parts.len() {
                        return Err(PatternError::RestNotLast {
                            text: text.to_string(),
                            name: name.to_string(),
                        });
                    }
                    Seg::Rest
                }
                Some(name) if !name.is_empty() && !name.contains(['{', '}']) => Seg::Param,
                _ if p.contains(['{', '}']) => {
                    return Err(PatternError::PartialParam(text.to_string()))
                }
                _ => Seg::Lit(p.to_string()),
            };
            segs.push(seg);
        }
        let name = match &method {
            Some(m) => format!("{m} {template}"),
            None => String::new(),
        };
        Ok(Route {
            method,
            template: template.to_string(),
            segs,
            name,
        })
    }

    fn matches_path(&self, path: &str, ignore_case: bool) -> bool {
        let mut parts = path.split('/').skip(1);
        for seg in &self.segs {
            match seg {
                Seg::Rest => return true,
                Seg::Lit(l) => {
                    let same = parts
                        .next()
                        .is_some_and(|p| p == l || (ignore_case && p.eq_ignore_ascii_case(l)));
                    if !same {
                        return false;
                    }
                }
                Seg::Param => {
                    if parts.next().is_none_or(str::is_empty) {
                        return false;
                    }
                }
            }
        }
        parts.next().is_none()
    }
}

/// Where the procedure comes from, first that applies.
#[derive(Debug, Clone)]
pub struct ProcedureFrom {
    /// The header naming the procedure of a non-gRPC request (`rpc-procedure` by default
    /// without routes; with routes the sidecar reads none unless the operator names one).
    pub header: Option<HeaderName>,
    /// Route templates tried in order.
    pub routes: Vec<Route>,
    /// Literal segments of routes match in any ASCII case (`/CHECKOUT` is `/checkout`), for
    /// services whose framework routes so (Express by default, ASP.NET).
    pub ignore_case: bool,
    /// A path ending in `/` matches the routes as without it (`/checkout/` is `/checkout`),
    /// for services whose framework routes so (Express by default, Flask's `strict_slashes`
    /// off).
    pub trailing_slash: bool,
}

impl Default for ProcedureFrom {
    fn default() -> Self {
        ProcedureFrom {
            header: Some(HeaderName::from_static("rpc-procedure")),
            routes: Vec::new(),
            ignore_case: false,
            trailing_slash: false,
        }
    }
}

impl ProcedureFrom {
    /// The procedure of a request: the gRPC method's path (`/pkg.Service/Method`) for gRPC,
    /// else the header, else `METHOD template` of the first matching route, else
    /// [`UNMATCHED_PROCEDURE`].
    pub fn procedure<'a>(
        &'a self,
        grpc: bool,
        method: &Method,
        path: &'a str,
        headers: &'a HeaderMap,
    ) -> Cow<'a, str> {
        self.procedure_checked(grpc, method, path, headers)
            .unwrap_or(Cow::Borrowed(UNMATCHED_PROCEDURE))
    }

    /// [`ProcedureFrom::procedure`], or None when the procedure header would be read and is
    /// given more than once (the request is refused).
    pub fn procedure_checked<'a>(
        &'a self,
        grpc: bool,
        method: &Method,
        path: &'a str,
        headers: &'a HeaderMap,
    ) -> Option<Cow<'a, str>> {
        if grpc {
            return Some(Cow::Borrowed(cut(path)));
        }
        if let Some(h) = &self.header {
            let mut lines = headers.get_all(h).iter();
            let first = lines.next();
            if lines.next().is_some() {
                return None;
            }
            if let Some(v) = first
                .and_then(|v| v.to_str().ok())
                .map(str::trim)
                .filter(|v| !v.is_empty())
            {
                return Some(Cow::Borrowed(cut(v)));
            }
        }
        if self.routes.is_empty() {
            return Some(Cow::Borrowed(UNMATCHED_PROCEDURE));
        }
        // Servers differ on `%2F`: Python's decode it into a separator, Go's keep it inside
        // its segment. The first route that matches either reading is the request's (a later
        // route matching the kept reading must not win over an earlier one matching the
        // decoded reading: `/static/..%2Fcheckout` is `/checkout` to nginx).
        let kept = self.slash(normalized(path, false));
        // Only a `%` left (an encoded slash) can read another way.
        let decoded = kept
            .contains('%')
            .then(|| self.slash(normalized(path, true)));
        Some(
            self.route(method, &kept, decoded.as_deref())
                .unwrap_or(Cow::Borrowed(UNMATCHED_PROCEDURE)),
        )
    }

    /// `path` without its trailing `/` (but `/`) when [`ProcedureFrom::trailing_slash`].
    fn slash<'p>(&self, path: Cow<'p, str>) -> Cow<'p, str> {
        if !self.trailing_slash || path.len() < 2 || !path.ends_with('/') {
            return path;
        }
        match path {
            Cow::Borrowed(p) => Cow::Borrowed(&p[..p.len() - 1]),
            Cow::Owned(mut p) => {
                p.pop();
                Cow::Owned(p)
            }
        }
    }

    /// The first route matching `method` and one of the readings of the path. A `HEAD`
    /// request matches `GET` routes too (and is keyed as one), as servers run the GET handler
    /// for it: else it would pass every `GET` bucket.
    fn route(&self, method: &Method, path: &str, other: Option<&str>) -> Option<Cow<'_, str>> {
        let case = self.ignore_case;
        let path_matches = |r: &Route| {
            r.matches_path(path, case) || other.is_some_and(|o| r.matches_path(o, case))
        };
        self.routes.iter().find_map(|r| match &r.method {
            Some(m)
                if (m == method || (*m == Method::GET && *method == Method::HEAD))
                    && path_matches(r) =>
            {
                Some(Cow::Borrowed(r.name.as_str()))
            }
            None if METHODS.contains(method) && path_matches(r) => {
                Some(Cow::Owned(format!("{method} {}", r.template)))
            }
            _ => None,
        })
    }
}

/// `path` as servers read it before they route it (nginx before it matches a location, Go's
/// `net/http` and most frameworks too): `%XX` decoded (`%2F` and `%5C` only when
/// `decode_slashes`: else a slash within a segment stays one segment), runs of `/` merged, `.`
/// and `..` segments resolved (never above the root). Most paths have nothing of these and are
/// returned as they are.
fn normalized(path: &str, decode_slashes: bool) -> Cow<'_, str> {
    let b = path.as_bytes();
    let plain = b
        .iter()
        .enumerate()
        .all(|(i, &c)| c != b'%' && !(c == b'/' && matches!(b.get(i + 1), Some(b'/' | b'.'))));
    if plain {
        return Cow::Borrowed(path);
    }
    let mut decoded = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        match (
            b[i],
            b.get(i + 1).and_then(|&c| hex(c)),
            b.get(i + 2).and_then(|&c| hex(c)),
        ) {
            // `%2F` and `%5C` stay as written: inside a segment, not separators.
            (b'%', Some(h), Some(l)) if decode_slashes || !matches!(h * 16 + l, 0x2F | 0x5C) => {
                decoded.push((h * 16 + l) as u8);
                i += 3;
            }
            (c, _, _) => {
                decoded.push(c);
                i += 1;
            }
        }
    }
    let decoded = String::from_utf8_lossy(&decoded);
    let mut segs: Vec<&str> = Vec::new();
    // Whether the last segment was empty or a dot one: the path ends with `/`.
    let mut trailing = false;
    for seg in decoded.split('/') {
        trailing = matches!(seg, "" | "." | "..");
        match seg {
            "" | "." => {}
            ".." => {
                segs.pop();
            }
            s => segs.push(s),
        }
    }
    let mut out = String::with_capacity(decoded.len());
    for s in &segs {
        out.push('/');
        out.push_str(s);
    }
    if trailing || segs.is_empty() {
        out.push('/');
    }
    Cow::Owned(out)
}

/// Whether a request is a gRPC call (`content-type: application/grpc[+proto|;…]`).
pub fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.strip_prefix("application/grpc")
                .is_some_and(|r| r.is_empty() || r.starts_with(['+', ';']))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(HeaderName::from_static(k), v.parse().unwrap());
        }
        h
    }

    #[test]
    fn patterns_map_names_to_callers() {
        let check = |pat: &str, name: &str, want: Option<&str>| {
            let p = NamePattern::parse(pat).unwrap();
            assert_eq!(p.capture(name), want, "{pat} on {name}");
        };
        check(
            "spiffe://*/ns/*/sa/{caller}",
            "spiffe://cluster.local/ns/shop/sa/checkout",
            Some("checkout"),
        );
        check(
            "spiffe://*/ns/*/sa/{caller}",
            "spiffe://cluster.local/ns/shop/sa/",
            None,
        );
        check(
            "spiffe://*/ns/*/sa/{caller}",
            "spiffe://cluster.local/ns/a/b/sa/x",
            None,
        );
        check(
            "spiffe://*/ns/*/sa/{caller}",
            "spiffe://td/ns/shop/sa/x/extra",
            None,
        );
        check(
            "{caller}.clients.example.com",
            "gw.clients.example.com",
            Some("gw"),
        );
        check(
            "{caller}.clients.example.com",
            "gw.clients.example.org",
            None,
        );
        check(
            "spiffe://td/{caller}",
            "spiffe://td/payments",
            Some("payments"),
        );
        for bad in [
            "spiffe://*/sa/*",
            "{caller}/{caller}",
            "{who}.x",
            "a{caller",
        ] {
            assert!(NamePattern::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn caller_comes_from_the_certificate_then_the_header_then_unknown() {
        let from = CallerFrom::default();
        let certs = vec![
            "gw.internal".to_string(),
            "spiffe://cluster.local/ns/shop/sa/checkout".to_string(),
        ];
        let h = headers(&[("rpc-caller", "spoofed")]);
        assert_eq!(from.caller(&certs, &h), "checkout");
        assert_eq!(from.caller(&[], &h), "spoofed");
        assert_eq!(from.caller(&[], &HeaderMap::new()), UNKNOWN_CALLER);
        assert_eq!(
            from.caller(&[], &headers(&[("rpc-caller", "  ")])),
            UNKNOWN_CALLER
        );
        // A certificate whose names match no pattern: unknown, never the header's claim.
        assert_eq!(from.caller(&["other.internal".into()], &h), UNKNOWN_CALLER);
        let none = CallerFrom {
            header: None,
            ..CallerFrom::default()
        };
        assert_eq!(none.caller(&[], &h), UNKNOWN_CALLER);
        let xfcc = CallerFrom {
            header: Some(HeaderName::from_static("x-forwarded-client-cert")),
            ..CallerFrom::default()
        };
        for (value, caller) in [
            (
                "By=spiffe://td/ns/a/sa/b;Hash=ab;URI=spiffe://td/ns/x/sa/edge,By=spiffe://td/ns/a/sa/b;Hash=cd;URI=\"spiffe://td/ns/shop/sa/checkout\"",
                "checkout",
            ),
            // A quoted subject holding `,URI=` or `;URI=` names nobody; the element's own URI
            // does.
            (
                "Hash=ab;Subject=\"CN=a,URI=spiffe://td/ns/a/sa/victim\";URI=spiffe://td/ns/shop/sa/checkout",
                "checkout",
            ),
            (
                "Hash=ab;Subject=\"CN=a;URI=spiffe://td/ns/a/sa/victim;O=b\";URI=spiffe://td/ns/shop/sa/checkout",
                "checkout",
            ),
            (
                "Hash=ab;Subject=\"CN=a;URI=spiffe://td/ns/a/sa/victim\\\",x\";DNS=b",
                UNKNOWN_CALLER,
            ),
            // A caller's unclosed quote before the element its proxy appended swallows nothing.
            (
                "URI=spiffe://td/ns/a/sa/victim;x=\",By=spiffe://td/ns/a/sa/b;Hash=ab;URI=spiffe://td/ns/shop/sa/checkout",
                "checkout",
            ),
        ] {
            let h = headers(&[("x-forwarded-client-cert", value)]);
            assert_eq!(xfcc.caller(&[], &h), caller, "{value}");
        }
        // Two lines: the last one's last element.
        let mut h = HeaderMap::new();
        h.append(
            "x-forwarded-client-cert",
            http::HeaderValue::from_static("URI=spiffe://td/ns/x/sa/edge"),
        );
        h.append(
            "x-forwarded-client-cert",
            http::HeaderValue::from_static("URI=spiffe://td/ns/shop/sa/checkout"),
        );
        assert_eq!(xfcc.caller(&[], &h), "checkout");
        let long = "x".repeat(1000);
        assert_eq!(
            from.caller(&[], &headers(&[("rpc-caller", &long)])).len(),
            MAX_KEY_LEN
        );
    }

    #[test]
    fn a_verified_certificate_replaces_the_callers_identity_headers() {
        let from = CallerFrom {
            verified_header: Some(HeaderName::from_static("x-verified-caller")),
            ..CallerFrom::default()
        };
        let certs = vec!["spiffe://cluster.local/ns/shop/sa/checkout".to_string()];
        let claims = || {
            headers(&[
                ("rpc-caller", "mallory"),
                ("x-forwarded-client-cert", "URI=spiffe://td/ns/a/sa/admin"),
                ("x-verified-caller", "admin"),
                ("accept", "*/*"),
            ])
        };
        let mut h = claims();
        from.pass_on(&certs, &mut h);
        assert_eq!(h.get("x-verified-caller").unwrap(), "checkout");
        assert!(h.get("rpc-caller").is_none() && h.get("x-forwarded-client-cert").is_none());
        assert_eq!(h.get("accept").unwrap(), "*/*");
        // A certificate no pattern maps: passed on as unknown, the claims still removed.
        let mut h = claims();
        from.pass_on(&["other.internal".to_string()], &mut h);
        assert_eq!(h.get("x-verified-caller").unwrap(), UNKNOWN_CALLER);
        assert!(h.get("rpc-caller").is_none());
        // No certificate: the header the upstream trusts is never the caller's own.
        let mut h = claims();
        from.pass_on(&[], &mut h);
        assert!(h.get("x-verified-caller").is_none());
        assert_eq!(h.get("rpc-caller").unwrap(), "mallory");
    }

    #[test]
    fn two_lines_of_an_identity_header_are_ambiguous() {
        let two = |name: &'static str| {
            let mut h = HeaderMap::new();
            h.append(name, http::HeaderValue::from_static("a"));
            h.append(name, http::HeaderValue::from_static("b"));
            h
        };
        let from = CallerFrom::default();
        assert_eq!(from.caller_checked(&[], &two("rpc-caller")), None);
        assert_eq!(
            from.caller_checked(&[], &headers(&[("rpc-caller", "a")])),
            Some("a")
        );
        // With a certificate the header is not read, so not ambiguous either.
        let cert = ["gw.internal".to_string()];
        assert_eq!(
            from.caller_checked(&cert, &two("rpc-caller")),
            Some(UNKNOWN_CALLER)
        );
        // Proxies append to x-forwarded-client-cert by design.
        let xfcc = CallerFrom {
            header: Some(HeaderName::from_static("x-forwarded-client-cert")),
            ..CallerFrom::default()
        };
        assert!(xfcc
            .caller_checked(&[], &two("x-forwarded-client-cert"))
            .is_some());
        let p = ProcedureFrom::default();
        let m = Method::POST;
        assert_eq!(
            p.procedure_checked(false, &m, "/x", &two("rpc-procedure")),
            None
        );
        assert!(p
            .procedure_checked(true, &m, "/x", &two("rpc-procedure"))
            .is_some());
        assert_eq!(
            p.procedure_checked(false, &m, "/x", &headers(&[("rpc-procedure", "a")])),
            Some(Cow::Borrowed("a"))
        );
    }

    #[test]
    fn case_and_trailing_slash_match_only_when_asked() {
        let routes: Vec<Route> = ["POST /checkout", "GET /users/{id}"]
            .iter()
            .map(|r| Route::parse(r).unwrap())
            .collect();
        let strict = ProcedureFrom {
            header: None,
            routes,
            ..ProcedureFrom::default()
        };
        let loose = ProcedureFrom {
            ignore_case: true,
            trailing_slash: true,
            ..strict.clone()
        };
        let none = HeaderMap::new();
        for (path, want_strict, want_loose) in [
            ("/checkout", "POST /checkout", "POST /checkout"),
            ("/CHECKOUT", UNMATCHED_PROCEDURE, "POST /checkout"),
            ("/checkout/", UNMATCHED_PROCEDURE, "POST /checkout"),
            ("/Checkout//", UNMATCHED_PROCEDURE, "POST /checkout"),
            ("/checkout/x", UNMATCHED_PROCEDURE, UNMATCHED_PROCEDURE),
            ("/", UNMATCHED_PROCEDURE, UNMATCHED_PROCEDURE),
        ] {
            assert_eq!(
                strict.procedure(false, &Method::POST, path, &none),
                want_strict,
                "{path}"
            );
            assert_eq!(
                loose.procedure(false, &Method::POST, path, &none),
                want_loose,
                "{path}"
            );
        }
        // A parameter keeps the caller's case; only literal segments fold.
        assert_eq!(
            loose.procedure(false, &Method::GET, "/USERS/Ann/", &none),
            "GET /users/{id}"
        );
    }

    #[test]
    fn procedure_comes_from_grpc_then_header_then_routes_and_folds_the_rest() {
        let from = ProcedureFrom {
            routes: ["GET /users/{id}", "/static/{path*}", "POST /orders"]
                .iter()
                .map(|r| Route::parse(r).unwrap())
                .collect(),
            ..ProcedureFrom::default()
        };
        let none = HeaderMap::new();
        let p = |grpc, m: Method, path: &str, h: &HeaderMap| {
            from.procedure(grpc, &m, path, h).into_owned()
        };
        assert_eq!(
            p(true, Method::POST, "/shop.Cart/Add", &none),
            "/shop.Cart/Add"
        );
        let named = headers(&[("rpc-procedure", "charge")]);
        assert_eq!(p(false, Method::GET, "/x", &named), "charge");
        assert_eq!(p(false, Method::GET, "/users/42", &none), "GET /users/{id}");
        assert_eq!(
            p(false, Method::DELETE, "/users/42", &none),
            UNMATCHED_PROCEDURE
        );
        assert_eq!(p(false, Method::GET, "/users/", &none), UNMATCHED_PROCEDURE);
        assert_eq!(
            p(false, Method::GET, "/users/42/x", &none),
            UNMATCHED_PROCEDURE
        );
        assert_eq!(
            p(false, Method::HEAD, "/static/a/b.css", &none),
            "HEAD /static/{path*}"
        );
        assert_eq!(p(false, Method::POST, "/orders", &none), "POST /orders");
        // HEAD runs the GET handler on servers: it is keyed to the GET route.
        assert_eq!(
            p(false, Method::HEAD, "/users/42", &none),
            "GET /users/{id}"
        );
        let odd = Method::from_bytes(b"SCAN").unwrap();
        assert_eq!(p(false, odd, "/static/x", &none), UNMATCHED_PROCEDURE);
        for path in ["/admin", "/.env", "/wp-login.php"] {
            assert_eq!(p(false, Method::GET, path, &none), UNMATCHED_PROCEDURE);
        }
        for bad in ["users/{id}", "GET /a/{b*}/c", "G@T /a", "/a/x{y}"] {
            assert!(Route::parse(bad).is_err(), "{bad}");
        }
    }

    /// The first route either reading of an encoded slash matches is the request's: a later
    /// wildcard route matching the kept reading does not win over an earlier route that the
    /// decoded reading matches (nginx serves `/static/..%2Fcheckout` as `/checkout`).
    #[test]
    fn the_first_route_either_reading_matches_wins() {
        let from = ProcedureFrom {
            routes: ["POST /checkout", "/static/{path*}"]
                .iter()
                .map(|r| Route::parse(r).unwrap())
                .collect(),
            ..ProcedureFrom::default()
        };
        let none = HeaderMap::new();
        let p = |m: Method, path: &str| from.procedure(false, &m, path, &none).into_owned();
        assert_eq!(p(Method::POST, "/static/..%2Fcheckout"), "POST /checkout");
        assert_eq!(p(Method::POST, "/static/..%2fcheckout"), "POST /checkout");
        assert_eq!(p(Method::POST, "/static/a%2Fb"), "POST /static/{path*}");
        assert_eq!(
            p(Method::GET, "/static/..%2Fcheckout"),
            "GET /static/{path*}"
        );
    }

    /// A path spelled another way than the route (percent-encoded, with dot segments or
    /// doubled slashes) matches it as the upstream will read it (as nginx matches its
    /// locations), instead of folding into `_other` and out of the route's bucket.
    #[test]
    fn a_route_matches_the_path_as_the_upstream_reads_it() {
        let from = ProcedureFrom {
            routes: ["POST /charge", "GET /users/{id}"]
                .iter()
                .map(|r| Route::parse(r).unwrap())
                .collect(),
            ..ProcedureFrom::default()
        };
        let none = HeaderMap::new();
        let charge = [
            "/char%67e",
            "/CHARGE/../charge",
            "/a/./../charge",
            "//charge",
            "/./charge",
            "/%63harge",
        ]
        .map(|p| (Method::POST, p, "POST /charge"));
        let user = [
            "/users/%34%32",
            "/users//42",
            "/x/../users/42",
            "/users/4%2F2",
        ]
        .map(|p| (Method::GET, p, "GET /users/{id}"));
        let other = ["/charge/x", "/../", "/%zz", "/users/4%2F2/x"]
            .map(|p| (Method::POST, p, UNMATCHED_PROCEDURE));
        for (method, path, want) in charge.into_iter().chain(user).chain(other) {
            assert_eq!(from.procedure(false, &method, path, &none), want, "{path}");
        }
        assert_eq!(normalized("/a/b?", false), "/a/b?");
        assert_eq!(normalized("/a/b/..", false), "/a/");
        assert_eq!(normalized("/a/%2e%2E/b", false), "/b");
        assert_eq!(normalized("/a%2Fb", false), "/a%2Fb");
        assert_eq!(normalized("/a%2Fb", true), "/a/b");
        // A slash written `%2F` matches a route either way servers read it.
        let from = ProcedureFrom {
            routes: vec![Route::parse("POST /v1/charge").unwrap()],
            ..ProcedureFrom::default()
        };
        assert_eq!(
            from.procedure(false, &Method::POST, "/v1%2Fcharge", &none),
            "POST /v1/charge"
        );
    }

    #[test]
    fn grpc_is_told_by_its_content_type() {
        for (ct, want) in [
            ("application/grpc", true),
            ("application/grpc+proto", true),
            ("application/grpc;charset=utf-8", true),
            ("application/grpc-web", false),
            ("application/json", false),
        ] {
            assert_eq!(is_grpc(&headers(&[("content-type", ct)])), want, "{ct}");
        }
        assert!(!is_grpc(&HeaderMap::new()));
    }
}
