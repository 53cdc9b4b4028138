//! What a message's headers become on their way through the proxy: the hop-by-hop ones left
//! behind, the caller's address added to `x-forwarded-for`, an HTTP/2 caller's cookies
//! joined for an HTTP/1.1 upstream.

use http::{HeaderMap, HeaderName, HeaderValue};

/// Removes the hop-by-hop headers (RFC 9110 §7.6.1: [`is_hop_by_hop`] and those the
/// `Connection` header names), never forwarded; `te: trailers` is kept (gRPC needs it over
/// HTTP/2).
pub(crate) fn strip_hop_by_hop(h: &mut HeaderMap) {
    // One pass over the names (standard ones compare as a number) instead of a lookup, with
    // its hashing, for each of them; most messages carry none, or only `connection`.
    let (mut te, mut connection, mut coded) = (false, false, false);
    // The names are distinct, so at most the seven hop-by-hop ones.
    let mut gone: [Option<HeaderName>; 7] = Default::default();
    let mut k = 0;
    for n in h.keys() {
        if n == http::header::TE {
            te = true;
        } else if is_hop_by_hop(n) && k < gone.len() {
            connection |= n == http::header::CONNECTION;
            coded |= n == http::header::TRANSFER_ENCODING;
            gone[k] = Some(n.clone());
            k += 1;
        }
    }
    // `te: trailers` alone, as every gRPC call carries it, goes on as it came: rewriting it
    // to itself cost four lookups and a split (1.3 % of a proxied gRPC call).
    te = te && !is_trailers_alone(h);
    if k == 0 && !te {
        return;
    }
    // Headers the Connection header names are hop-by-hop too (`close` and `keep-alive` name
    // no header of their own but the one already listed).
    let mut named: Vec<HeaderName> = Vec::new();
    if connection {
        for v in h.get_all(http::header::CONNECTION) {
            // Most say only `keep-alive`: not split (splitting every value as bytes instead
            // measured dearer).
            if names_no_header(v.as_bytes()) {
                continue;
            }
            for n in v.to_str().unwrap_or("").split(',').map(str::trim) {
                if names_no_header(n.as_bytes()) {
                    continue;
                }
                if let Ok(n) = HeaderName::from_bytes(n.as_bytes()) {
                    named.push(n);
                }
            }
        }
    }
    // A length beside a transfer coding does not frame the message (the coding does), and
    // would frame it wrongly once the coding is gone: it stays behind too.
    if coded {
        h.remove(http::header::CONTENT_LENGTH);
    }
    for n in gone.into_iter().flatten().chain(named) {
        h.remove(n);
    }
    // Only `trailers` goes on (unless `connection` named `te`: then it is gone by now).
    if te && h.contains_key(http::header::TE) {
        let te_trailers = h
            .get_all(http::header::TE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|t| t.trim().eq_ignore_ascii_case("trailers"));
        h.remove(http::header::TE);
        if te_trailers {
            h.insert(http::header::TE, HeaderValue::from_static("trailers"));
        }
    }
}

/// Whether `te` is one line that says `trailers` and nothing else.
fn is_trailers_alone(h: &HeaderMap) -> bool {
    let mut lines = h.get_all(http::header::TE).iter();
    lines.next().is_some_and(|v| v == "trailers") && lines.next().is_none()
}

/// A `Connection` option that names no header of its own: `close`, `keep-alive`.
fn names_no_header(option: &[u8]) -> bool {
    option.eq_ignore_ascii_case(b"close") || option.eq_ignore_ascii_case(b"keep-alive")
}

/// Whether `n` is a hop-by-hop header (`connection`, `keep-alive`, `proxy-connection`,
/// `transfer-encoding`, `upgrade`, `proxy-authenticate`, `proxy-authorization`) or `te`
/// (rewritten to `trailers` or removed).
fn is_hop_by_hop(n: &HeaderName) -> bool {
    use http::header::{
        CONNECTION, PROXY_AUTHENTICATE, PROXY_AUTHORIZATION, TE, TRANSFER_ENCODING, UPGRADE,
    };
    n == CONNECTION
        || n == TE
        || n == TRANSFER_ENCODING
        || n == UPGRADE
        || n == PROXY_AUTHENTICATE
        || n == PROXY_AUTHORIZATION
        || n.as_str() == "keep-alive"
        || n.as_str() == "proxy-connection"
}

/// The `x-forwarded-for` value of a caller's address (IPv4 written digit by digit: the
/// formatting machinery cost more than the rest of the header handling).
fn forwarded_for(ip: std::net::IpAddr) -> Option<HeaderValue> {
    match ip {
        std::net::IpAddr::V4(v4) => {
            let mut buf = [0u8; 15];
            let mut n = 0;
            for (i, octet) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    buf[n] = b'.';
                    n += 1;
                }
                if octet >= 100 {
                    buf[n] = b'0' + octet / 100;
                    n += 1;
                }
                if octet >= 10 {
                    buf[n] = b'0' + octet / 10 % 10;
                    n += 1;
                }
                buf[n] = b'0' + octet % 10;
                n += 1;
            }
            HeaderValue::from_bytes(&buf[..n]).ok()
        }
        v6 => HeaderValue::from_str(&v6.to_string()).ok(),
    }
}

/// Adds the caller's address to `x-forwarded-for`: appended to what the caller sent, in one
/// line (an upstream reading one value of a header with several lines would read only the
/// caller's own, and take its first address for the caller's).
pub(crate) fn add_forwarded_for(h: &mut HeaderMap, ip: std::net::IpAddr) {
    let Some(v) = forwarded_for(ip) else {
        return;
    };
    match h.entry(HeaderName::from_static("x-forwarded-for")) {
        http::header::Entry::Vacant(e) => {
            e.insert(v);
        }
        http::header::Entry::Occupied(mut e) => {
            if let Some(v) = joined(e.iter().chain([&v]), b", ") {
                e.insert(v);
            }
        }
    }
}

/// Cookies split over several fields (as HTTP/2 sends them) joined into one with `; `, as an
/// HTTP/1.1 upstream expects them.
pub(crate) fn join_cookies(h: &mut HeaderMap) {
    if h.get_all(http::header::COOKIE).iter().nth(1).is_none() {
        return;
    }
    if let Some(v) = joined(h.get_all(http::header::COOKIE).iter(), b"; ") {
        h.insert(http::header::COOKIE, v);
    }
}

/// The lines of a header as one value, `sep` between them.
fn joined<'a>(lines: impl Iterator<Item = &'a HeaderValue>, sep: &[u8]) -> Option<HeaderValue> {
    let mut out = Vec::new();
    for (i, line) in lines.enumerate() {
        if i > 0 {
            out.extend_from_slice(sep);
        }
        out.extend_from_slice(line.as_bytes());
    }
    HeaderValue::from_bytes(&out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forwarded_for_writes_addresses_as_display_does() {
        for ip in [
            "127.0.0.1",
            "10.0.0.255",
            "192.168.100.9",
            "0.0.0.0",
            "255.255.255.255",
            "::1",
            "2001:db8::8a2e:370:7334",
        ] {
            let ip: std::net::IpAddr = ip.parse().unwrap();
            assert_eq!(forwarded_for(ip).unwrap(), ip.to_string().as_str());
        }
    }

    #[test]
    fn a_callers_forwarded_for_is_extended_in_one_line_and_split_cookies_are_joined() {
        let ip: std::net::IpAddr = "10.1.2.3".parse().unwrap();
        let mut h = HeaderMap::new();
        add_forwarded_for(&mut h, ip);
        assert_eq!(h.get_all("x-forwarded-for").iter().count(), 1);
        assert_eq!(h["x-forwarded-for"], "10.1.2.3");
        // The caller's own lines, joined with the peer last: one line, as upstreams read it.
        let mut h = HeaderMap::new();
        h.append("x-forwarded-for", HeaderValue::from_static("6.6.6.6"));
        h.append(
            "x-forwarded-for",
            HeaderValue::from_static("7.7.7.7, 8.8.8.8"),
        );
        add_forwarded_for(&mut h, ip);
        let all: Vec<_> = h.get_all("x-forwarded-for").iter().collect();
        assert_eq!(all, ["6.6.6.6, 7.7.7.7, 8.8.8.8, 10.1.2.3"]);
        // HTTP/2 sends cookies as several fields; HTTP/1.1 wants one line.
        let mut h = HeaderMap::new();
        h.append(http::header::COOKIE, HeaderValue::from_static("a=1"));
        h.append(http::header::COOKIE, HeaderValue::from_static("b=2"));
        join_cookies(&mut h);
        let all: Vec<_> = h.get_all(http::header::COOKIE).iter().collect();
        assert_eq!(all, ["a=1; b=2"]);
    }

    #[test]
    fn a_content_length_beside_a_transfer_encoding_stays_behind() {
        let mut h = HeaderMap::new();
        h.insert(
            http::header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        h.insert(http::header::CONTENT_LENGTH, HeaderValue::from_static("5"));
        h.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain"),
        );
        strip_hop_by_hop(&mut h);
        assert!(!h.contains_key(http::header::CONTENT_LENGTH));
        assert!(!h.contains_key(http::header::TRANSFER_ENCODING));
        assert!(h.contains_key(http::header::CONTENT_TYPE));
        let mut h = HeaderMap::new();
        h.insert(http::header::CONTENT_LENGTH, HeaderValue::from_static("5"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h[http::header::CONTENT_LENGTH], "5");
    }

    #[test]
    fn hop_by_hop_headers_stay_behind_and_te_trailers_goes_on() {
        let mut h = HeaderMap::new();
        h.insert(
            "connection",
            HeaderValue::from_static("keep-alive, x-secret-hop"),
        );
        h.insert("x-secret-hop", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("te", HeaderValue::from_static("gzip, trailers"));
        h.insert("rpc-caller", HeaderValue::from_static("gw"));
        strip_hop_by_hop(&mut h);
        let names: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        assert_eq!(names, ["rpc-caller", "te"]);
        assert_eq!(h["te"], "trailers");
        let mut h = HeaderMap::new();
        h.insert("te", HeaderValue::from_static("gzip"));
        strip_hop_by_hop(&mut h);
        assert!(h.is_empty());
        // An answer's usual `connection: keep-alive`, and every hop-by-hop name at once.
        let mut h = HeaderMap::new();
        h.insert("content-length", HeaderValue::from_static("2"));
        h.insert("connection", HeaderValue::from_static("keep-alive"));
        h.insert("date", HeaderValue::from_static("x"));
        strip_hop_by_hop(&mut h);
        let names: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        assert_eq!(names, ["content-length", "date"]);
        let mut h = HeaderMap::new();
        for n in [
            "connection",
            "keep-alive",
            "proxy-connection",
            "transfer-encoding",
            "upgrade",
            "proxy-authenticate",
            "proxy-authorization",
            "te",
            "x-kept",
        ] {
            h.insert(n, HeaderValue::from_static("te"));
        }
        strip_hop_by_hop(&mut h);
        let names: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        assert_eq!(names, ["x-kept"]);
    }

    #[test]
    fn a_message_h2_accepted_loses_only_its_proxy_credentials() {
        // Every subset of the headers h2 lets through (no connection-specific one, `te` only
        // as `trailers`): the proxy's credentials stay behind, the rest goes on as it came.
        let pool = [
            ("te", "trailers"),
            ("proxy-authorization", "Basic eA=="),
            ("proxy-authenticate", "Basic"),
            ("content-type", "application/grpc"),
            ("rpc-caller", "gw"),
        ];
        for mask in 0u32..(1 << pool.len()) {
            let mut h = HeaderMap::new();
            let mut want = HeaderMap::new();
            for (i, (n, v)) in pool.iter().enumerate() {
                if mask & (1 << i) != 0 {
                    h.insert(*n, HeaderValue::from_static(v));
                    if !n.starts_with("proxy-") {
                        want.insert(*n, HeaderValue::from_static(v));
                    }
                }
            }
            strip_hop_by_hop(&mut h);
            assert_eq!(h, want, "headers {mask:05b}");
        }
        // Two lines of `te: trailers` go on as one.
        let mut h = HeaderMap::new();
        h.append("te", HeaderValue::from_static("trailers"));
        h.append("te", HeaderValue::from_static("trailers"));
        strip_hop_by_hop(&mut h);
        let all: Vec<_> = h.get_all("te").iter().collect();
        assert_eq!(all, ["trailers"]);
    }
}
