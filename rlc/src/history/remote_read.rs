//! History over Prometheus' remote-read API (`POST /api/v1/read`), for a query that is a plain
//! selector (a metric name with label matchers, e.g. a recording rule's series).
//!
//! Prometheus answers with the raw samples of each series as the compressed chunks of its
//! TSDB (`STREAMED_XOR_CHUNKS`: length-prefixed, CRC32C-checked protobuf frames), which moves
//! several times fewer bytes than `query_range`'s JSON and costs a few nanoseconds per sample
//! to decode instead of a JSON parse and a float parse. The value at each step of the grid is
//! the newest sample at most the server's lookback delta older than the step (read from
//! `/api/v1/status/flags`), stale markers excluded, as a `query_range` of the selector
//! evaluates it (the window's start included before Prometheus 3, excluded from 3 on).
//!
//! Frames are decoded as they arrive, on a blocking thread, field by field where they lie,
//! and each series goes on the grid once its last frame is read: a request holds one frame,
//! one series' labels and samples (compacted to about two per step, however many come) and the
//! network buffers. The answer's bytes count against the pull's bounds as `query_range`'s do.
//! Failures are handled as for `query_range`: retries with jittered backoff, a checksum
//! mismatch or a truncated answer is retried, what the server sent whole but rlc cannot read
//! fails at once, one failed time chunk fails the pull.

use std::collections::BTreeMap;
use std::ops::ControlFlow;
use std::sync::{Arc, Mutex};

use prost::Message;
use schema::PrometheusConfig;

use super::error::{chain, Corrupt, DecodeError, Unreadable, FRAME_MAX};
use super::http::{
    read_capped, read_failed, send, stream_blocking, Budget, Failed, ReadError, Tries,
    ERROR_BODY_MAX,
};
use super::{request_range, Bound, Builder, HistoryError, ParseError, RequestFailure, LABELS_MAX};

/// The content type of a streamed answer.
const STREAMED: &str = "application/x-streamed-protobuf";
/// Time covered by one remote-read request at least: answers carry whole TSDB chunks (2 hours),
/// so wider requests decode fewer samples twice at their edges.
pub(crate) const CHUNK_SECS: i64 = 86_400;

/// The Prometheus wire messages (`prompb`), the fields rlc reads.
mod proto {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ReadRequest {
        #[prost(message, repeated, tag = "1")]
        pub queries: Vec<Query>,
        #[prost(int32, repeated, tag = "2")]
        pub accepted_response_types: Vec<i32>,
    }
    /// `ReadRequest.ResponseType.STREAMED_XOR_CHUNKS`.
    pub const STREAMED_XOR_CHUNKS: i32 = 1;

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Query {
        #[prost(int64, tag = "1")]
        pub start_timestamp_ms: i64,
        #[prost(int64, tag = "2")]
        pub end_timestamp_ms: i64,
        #[prost(message, repeated, tag = "3")]
        pub matchers: Vec<LabelMatcher>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct LabelMatcher {
        /// EQ = 0, NEQ = 1, RE = 2, NRE = 3.
        #[prost(int32, tag = "1")]
        pub r#type: i32,
        #[prost(string, tag = "2")]
        pub name: String,
        #[prost(string, tag = "3")]
        pub value: String,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ChunkedReadResponse {
        #[prost(message, repeated, tag = "1")]
        pub chunked_series: Vec<ChunkedSeries>,
        #[prost(int64, tag = "2")]
        pub query_index: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ChunkedSeries {
        #[prost(message, repeated, tag = "1")]
        pub labels: Vec<Label>,
        #[prost(message, repeated, tag = "2")]
        pub chunks: Vec<Chunk>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Label {
        #[prost(string, tag = "1")]
        pub name: String,
        #[prost(string, tag = "2")]
        pub value: String,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Chunk {
        #[prost(int64, tag = "1")]
        pub min_time_ms: i64,
        #[prost(int64, tag = "2")]
        pub max_time_ms: i64,
        /// UNKNOWN = 0, XOR = 1, HISTOGRAM = 2, FLOAT_HISTOGRAM = 3.
        #[prost(int32, tag = "3")]
        pub r#type: i32,
        #[prost(bytes = "vec", tag = "4")]
        pub data: Vec<u8>,
    }
    /// `Chunk.Encoding.XOR`: float samples.
    pub const XOR: i32 = 1;
}

/// One label matcher of a selector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Matcher {
    /// `=`, `!=`, `=~` or `!~`.
    pub op: &'static str,
    /// Label name (`__name__` for the metric name).
    pub name: String,
    /// Value or regular expression.
    pub value: String,
}

impl Matcher {
    fn proto(&self) -> proto::LabelMatcher {
        let r#type = match self.op {
            "=" => 0,
            "!=" => 1,
            "=~" => 2,
            _ => 3,
        };
        proto::LabelMatcher {
            r#type,
            name: self.name.clone(),
            value: self.value.clone(),
        }
    }
}

/// The matchers of `query` when it is a plain selector (`name`, `name{l="v",...}` or
/// `{l="v",...}`, nothing else: no function, offset, range or operator), else `None`. Only
/// what is surely a selector is taken; anything else is left to `query_range`.
pub fn selector(query: &str) -> Option<Vec<Matcher>> {
    let s = query.trim_matches([' ', '\t', '\n', '\r']);
    let b = s.as_bytes();
    let mut i = 0;
    let ident = |i: &mut usize, metric: bool| {
        let st = *i;
        while *i < b.len()
            && (b[*i].is_ascii_alphabetic()
                || b[*i] == b'_'
                || (metric && b[*i] == b':')
                || (*i > st && b[*i].is_ascii_digit()))
        {
            *i += 1;
        }
        (*i > st).then(|| s[st..*i].to_string())
    };
    let skip_ws = |i: &mut usize| {
        while *i < b.len() && matches!(b[*i], b' ' | b'\t' | b'\n' | b'\r') {
            *i += 1;
        }
    };
    let mut matchers = Vec::new();
    if let Some(name) = ident(&mut i, true) {
        if KEYWORDS.contains(&name.to_ascii_lowercase().as_str()) {
            return None;
        }
        matchers.push(Matcher {
            op: "=",
            name: "__name__".into(),
            value: name,
        });
    }
    skip_ws(&mut i);
    if i < b.len() && b[i] == b'{' {
        i += 1;
        loop {
            skip_ws(&mut i);
            if i < b.len() && b[i] == b'}' {
                i += 1;
                break;
            }
            let name = ident(&mut i, false)?;
            skip_ws(&mut i);
            let op = ["=~", "!~", "!=", "="]
                .into_iter()
                .find(|op| s[i..].starts_with(op))?;
            i += op.len();
            skip_ws(&mut i);
            let (value, n) = string_literal(&s[i..])?;
            i += n;
            if name == "__name__" && matchers.iter().any(|m| m.name == "__name__") {
                return None; // the name given twice: PromQL refuses it
            }
            matchers.push(Matcher { op, name, value });
            skip_ws(&mut i);
            match b.get(i) {
                Some(b',') => i += 1,
                Some(b'}') => {}
                _ => return None,
            }
        }
    }
    skip_ws(&mut i);
    // PromQL wants a matcher that does not match the empty string; only the sure ones count
    // here (a name, or `=` with a value), so that a selector of every series never goes out.
    let anchored = matchers.iter().any(|m| m.op == "=" && !m.value.is_empty());
    (i == b.len() && anchored).then_some(matchers)
}

/// Words that PromQL does not read as a metric name.
const KEYWORDS: &[&str] = &[
    "and",
    "or",
    "unless",
    "atan2",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "offset",
    "start",
    "end",
    "inf",
    "nan",
    "sum",
    "avg",
    "count",
    "min",
    "max",
    "group",
    "stddev",
    "stdvar",
    "topk",
    "bottomk",
    "count_values",
    "quantile",
    "limitk",
    "limit_ratio",
];

/// A PromQL string literal at the start of `s` (`"…"`, `'…'` with the common escapes, or a
/// raw `` `…` ``): its value and length; `None` for anything unusual.
fn string_literal(s: &str) -> Option<(String, usize)> {
    let quote = s.chars().next()?;
    if !matches!(quote, '"' | '\'' | '`') {
        return None;
    }
    let mut out = String::new();
    let mut chars = s.char_indices().skip(1);
    while let Some((i, c)) = chars.next() {
        match c {
            c if c == quote => return Some((out, i + 1)),
            '\\' if quote != '`' => {
                let (_, e) = chars.next()?;
                out.push(match e {
                    '\\' => e,
                    e if e == quote => e,
                    'n' => '\n',
                    't' => '\t',
                    'r' => '\r',
                    _ => return None,
                });
            }
            '\n' if quote != '`' => return None,
            c => out.push(c),
        }
    }
    None
}

/// The request body: one query over `[from_ms, to_ms]`, streamed chunks accepted.
fn request(matchers: &[Matcher], from_ms: i64, to_ms: i64) -> Result<Vec<u8>, snap::Error> {
    let req = proto::ReadRequest {
        queries: vec![proto::Query {
            start_timestamp_ms: from_ms,
            end_timestamp_ms: to_ms,
            matchers: matchers.iter().map(Matcher::proto).collect(),
        }],
        accepted_response_types: vec![proto::STREAMED_XOR_CHUNKS],
    };
    snap::raw::Encoder::new().compress_vec(&req.encode_to_vec())
}

fn post(client: &reqwest::Client, url: &str, body: Vec<u8>) -> reqwest::RequestBuilder {
    client
        .post(url)
        .header("Content-Type", "application/x-protobuf")
        .header("Content-Encoding", "snappy")
        .header("X-Prometheus-Remote-Read-Version", "0.1.0")
        .body(body)
}

/// The remote-read endpoint of a Prometheus base URL.
pub fn endpoint(base: &str) -> String {
    format!("{}/api/v1/read", base.trim_end_matches('/'))
}

/// Whether the server answers remote read with streamed chunks: one request over the last
/// millisecond before `at_ms` for the query's series that also carry a label no series has,
/// so that the answer is empty. `Err` says why not (a server without remote read answers
/// 4xx; an unreachable one fails here and in `query_range` alike).
pub async fn probe(
    client: &reqwest::Client,
    url: &str,
    matchers: &[Matcher],
    at_ms: i64,
) -> Result<(), ProbeError> {
    let mut matchers = matchers.to_vec();
    matchers.push(Matcher {
        op: "=",
        name: "__rlc_probe__".into(),
        value: "none".into(),
    });
    let body = request(&matchers, at_ms - 1, at_ms)?;
    let resp = post(client, url, body)
        .send()
        .await
        .map_err(ProbeError::Send)?;
    let status = resp.status();
    let streamed = content_type(&resp).starts_with(STREAMED);
    let text = read_capped(resp, 256).await.unwrap_or_default();
    if status.is_success() && streamed {
        Ok(())
    } else {
        Err(ProbeError::NotStreamed {
            status,
            text: String::from_utf8_lossy(&text).trim().to_string(),
        })
    }
}

/// Why a server is not taken for one that answers remote read with streamed chunks
/// ([`probe`]).
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// The probe's body could not be compressed.
    #[error(transparent)]
    Request(#[from] snap::Error),
    /// The probe could not be sent, or no answer came.
    #[error("request failed: {}", chain(.0))]
    Send(#[source] reqwest::Error),
    /// An answer other than streamed chunks: the status and the start of the body.
    #[error("HTTP {status}, {text:?}")]
    NotStreamed {
        /// The answer's status.
        status: reqwest::StatusCode,
        /// Its first 256 bytes, trimmed.
        text: String,
    },
}

/// What of the server's settings remote read must follow to give what `query_range` gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rules {
    /// `--query.lookback-delta`.
    pub lookback_ms: i64,
    /// Before Prometheus 3, a sample exactly the lookback old still counts.
    pub include_start: bool,
}

/// Why remote read is not used or failed: the server could not be reached (worth a retry
/// later), or what it answered rules remote read out (the same again on a retry).
#[derive(Debug)]
pub enum Refusal {
    /// No answer (connection, timeout).
    Unreachable(String),
    /// An answer that rules remote read out, or one rlc cannot read.
    Final(String),
}

impl Refusal {
    /// The reason, whichever kind.
    pub fn why(self) -> String {
        match self {
            Refusal::Unreachable(w) | Refusal::Final(w) => w,
        }
    }
}

/// Reads the server's lookback delta (`/api/v1/status/flags`), version (`buildinfo`) and
/// external labels (`config`): remote read adds the external labels to every series and
/// rewrites matchers on them, so that any of them among the label names rlc reads or the
/// matchers would make the answer differ from `query_range`'s.
pub async fn rules(
    client: &reqwest::Client,
    base: &str,
    labels: &[&str],
    matchers: &[Matcher],
) -> Result<Rules, Refusal> {
    #[derive(serde::Deserialize)]
    struct Answer<T> {
        data: T,
    }
    #[derive(serde::Deserialize)]
    struct Build {
        version: String,
    }
    #[derive(serde::Deserialize)]
    struct Config {
        yaml: String,
    }
    async fn get<T: serde::de::DeserializeOwned>(
        client: &reqwest::Client,
        base: &str,
        path: &str,
    ) -> Result<T, Refusal> {
        let url = format!("{}{path}", base.trim_end_matches('/'));
        let unreachable = |e: reqwest::Error| Refusal::Unreachable(format!("{url}: {}", chain(&e)));
        let resp = client.get(&url).send().await.map_err(unreachable)?;
        let status = resp.status();
        let body = read_capped(resp, 4 << 20).await.map_err(unreachable)?;
        if !status.is_success() {
            return Err(Refusal::Final(format!("{url}: HTTP {status}")));
        }
        serde_json::from_slice::<Answer<T>>(&body)
            .map(|a| a.data)
            .map_err(|e| Refusal::Final(format!("{url}: {e}")))
    }
    let differs = Refusal::Final;
    let flags: BTreeMap<String, String> = get(client, base, "/api/v1/status/flags").await?;
    let delta = flags
        .get("query.lookback-delta")
        .ok_or_else(|| differs("the server's flags do not name query.lookback-delta".into()))?;
    let lookback_ms = prom_duration_ms(delta)
        .filter(|&ms| ms > 0)
        .ok_or_else(|| differs(format!("unreadable query.lookback-delta `{delta}`")))?;
    let build: Build = get(client, base, "/api/v1/status/buildinfo").await?;
    let major: u32 = build
        .version
        .split('.')
        .next()
        .and_then(|m| m.parse().ok())
        .ok_or_else(|| differs(format!("unreadable version `{}`", build.version)))?;
    let config: Config = get(client, base, "/api/v1/status/config").await?;
    let config: serde_yaml::Value = serde_yaml::from_str(&config.yaml)
        .map_err(|e| differs(format!("the server's config: {e}")))?;
    if let Some(ext) = config["global"]["external_labels"].as_mapping() {
        for name in ext.keys().filter_map(|k| k.as_str()) {
            if labels.contains(&name) || matchers.iter().any(|m| m.name == name) {
                return Err(differs(format!(
                    "the server's external label `{name}` is one rlc reads or matches: remote read would set it on every series"
                )));
            }
        }
    }
    Ok(Rules {
        lookback_ms,
        include_start: major < 3,
    })
}

/// A Prometheus duration (`5m`, `1m30s`, `300ms`, `1h`) in milliseconds.
fn prom_duration_ms(text: &str) -> Option<i64> {
    schema::duration::parse_ms(text, schema::duration::PROMETHEUS_UNITS)
        .ok()
        .and_then(|ms| i64::try_from(ms).ok())
}

fn content_type(resp: &reqwest::Response) -> String {
    resp.headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string()
}

/// The steps of one request: values at `from, from + step, …, to` (seconds).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Steps {
    pub from: i64,
    pub to: i64,
    pub step: i64,
    /// The server's lookback delta.
    pub lookback_ms: i64,
    /// Whether a sample exactly `lookback_ms` old still counts (Prometheus 2; not from 3 on).
    pub include_start: bool,
}

/// Pulls the steps `[from, to]` by remote read from `url` and puts them on the grid.
pub(crate) async fn fetch(
    (client, url, p): (&reqwest::Client, &str, &PrometheusConfig),
    matchers: &[Matcher],
    steps: Steps,
    b: &Arc<Mutex<Builder>>,
    budget: &Budget,
) -> Result<(), HistoryError> {
    let (from_ms, to_ms) = (steps.from * 1000 - steps.lookback_ms, steps.to * 1000);
    let body = request(matchers, from_ms, to_ms).map_err(|e| HistoryError::Parse {
        what: answer_of(p, steps),
        source: e.into(),
    })?;
    let mut tries = Tries::new(p, url);
    loop {
        match fetch_once((client, url, p), &body, steps, b, budget).await {
            Ok(()) => return Ok(()),
            Err(failed) => tries.after(failed).await?,
        }
    }
}

/// What the errors of a request for `steps` call its answer.
fn answer_of(p: &PrometheusConfig, steps: Steps) -> String {
    format!(
        "remote-read answer of {} for [{}, {}]",
        p.url, steps.from, steps.to
    )
}

/// One attempt of [`fetch`]: the whole request, streamed answer included, within
/// `max_request_duration` (the client's timeouts only bound the wait for each byte).
async fn fetch_once(
    (client, url, p): (&reqwest::Client, &str, &PrometheusConfig),
    body: &[u8],
    steps: Steps,
    b: &Arc<Mutex<Builder>>,
    budget: &Budget,
) -> Result<(), Failed> {
    let deadline = tokio::time::Instant::now() + p.max_request_duration.0;
    let too_long = |_| Failed::Retry(RequestFailure::TooLong(p.max_request_duration));
    let sent = tokio::time::timeout_at(deadline, send(post(client, url, body.to_vec()), p));
    let resp = sent.await.map_err(&too_long)?.map_err(Failed::Retry)?;
    if !resp.status().is_success() || !content_type(&resp).starts_with(STREAMED) {
        return Err(not_streamed(resp, deadline, p).await);
    }
    if !delimited(&resp) {
        return Err(Failed::GiveUp(RequestFailure::Undelimited));
    }
    let decoder = Frames::new(steps, b.clone());
    let streamed = stream_blocking(resp, decoder, Frames::push, budget);
    // Cut: what it put on the grid is a subset of the same answer (samples merge by
    // maximum), as for a corrupt one.
    let done = tokio::time::timeout_at(deadline, streamed)
        .await
        .map_err(&too_long)?;
    let done = done.map(|d| {
        d.map_err(|e| Bad::Corrupt(Corrupt::Decoder(e)))
            .and_then(Frames::finish)
    });
    match done {
        Ok(Ok(())) => Ok(()),
        Ok(Err(Bad::Exceeded(bound))) | Err(ReadError::Exceeded(bound)) => {
            Err(Failed::Fatal(HistoryError::Exceeded {
                url: p.url.clone(),
                request: request_range("remote read", steps.from, steps.to),
                bound,
            }))
        }
        // What the server sent whole but rlc cannot read: the same again on a retry.
        Ok(Err(Bad::Unreadable(e))) => Err(Failed::Fatal(HistoryError::Parse {
            what: answer_of(p, steps),
            source: ParseError::RemoteRead(e),
        })),
        // A corrupt or cut answer: retried (what it put on the grid is a subset of the
        // same answer, and samples merge by maximum).
        Ok(Err(Bad::Corrupt(e))) => Err(Failed::Retry(RequestFailure::Corrupt(e))),
        Err(ReadError::Http(e)) => Err(Failed::Retry(read_failed(e, p))),
    }
}

/// How an attempt answered with something other than streamed chunks fails: a client error
/// (429 aside) is refused at once, a server error is retried, and a success that is not
/// streamed gives up (the server will not stream: retrying changes nothing).
async fn not_streamed(
    resp: reqwest::Response,
    deadline: tokio::time::Instant,
    p: &PrometheusConfig,
) -> Failed {
    let status = resp.status();
    let content_type = content_type(&resp);
    let text = tokio::time::timeout_at(deadline, read_capped(resp, ERROR_BODY_MAX))
        .await
        .ok()
        .and_then(Result::ok)
        .unwrap_or_default();
    let text = String::from_utf8_lossy(&text[..text.len().min(300)])
        .trim()
        .to_string();
    if status.is_client_error() && status.as_u16() != 429 {
        return Failed::Fatal(HistoryError::Refused {
            url: p.url.clone(),
            status: status.as_u16(),
            error_type: "remote_read".into(),
            error: text,
        });
    }
    if status.is_success() {
        Failed::GiveUp(RequestFailure::NotStreamed {
            status,
            content_type,
        })
    } else {
        Failed::Retry(RequestFailure::ErrorText { status, text })
    }
}

/// Whether HTTP tells where the answer ends (a length, chunked encoding or HTTP/2): the
/// stream has no end marker, so otherwise a connection closed early would pass for a whole
/// answer.
fn delimited(resp: &reqwest::Response) -> bool {
    let chunked = resp
        .headers()
        .get(reqwest::header::TRANSFER_ENCODING)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("chunked"));
    chunked || resp.content_length().is_some() || resp.version() >= reqwest::Version::HTTP_2
}

/// What went wrong with a streamed answer.
#[derive(Debug, thiserror::Error)]
enum Bad {
    /// Corrupt or cut (a checksum, a frame cut short): retried.
    #[error(transparent)]
    Corrupt(#[from] Corrupt),
    /// Sent whole by the server but not readable by rlc: the same again on a retry.
    #[error(transparent)]
    Unreadable(#[from] Unreadable),
    /// A bound crossed: the pull fails at once.
    #[error("{0}")]
    Exceeded(Bound),
}

impl From<DecodeError> for Bad {
    /// A message that could not be decoded: the frame's checksum held, so this is what the
    /// server sent.
    fn from(e: DecodeError) -> Self {
        Bad::Unreadable(Unreadable::Frame(e))
    }
}

/// Series read whole are put on the grid at the end of each network piece (one lock per
/// piece), or once this many wait, or their points reach [`POINTS_MAX`] (a frame of many
/// small series).
const READY_MAX: usize = 1024;
/// See [`READY_MAX`]: 16 MB of points.
const POINTS_MAX: usize = 1 << 20;

/// Decodes the frames of a streamed answer as they arrive. What it holds is bounded whatever
/// the answer: a frame ([`FRAME_MAX`]), one series' labels ([`LABELS_MAX`]) and samples (at
/// most about two per step: see [`Frames::compact`]), and the points of [`READY_MAX`] series
/// or [`POINTS_MAX`] points.
struct Frames {
    steps: Steps,
    b: Arc<Mutex<Builder>>,
    /// Bytes of an incomplete frame.
    buf: Vec<u8>,
    /// The series being read (it can span several frames) and its samples so far.
    labels: Vec<proto::Label>,
    samples: Vec<(i64, f64)>,
    /// `samples` is compacted once it holds this many.
    compact_at: usize,
    /// The values at the steps of the series read whole and not yet on the grid.
    points: Vec<(f64, f64)>,
    /// Those series: labels and their values in `points`.
    ready: Vec<(BTreeMap<String, String>, std::ops::Range<usize>)>,
    /// The first error.
    failed: Option<Bad>,
}

impl Frames {
    fn new(steps: Steps, b: Arc<Mutex<Builder>>) -> Self {
        let n = ((steps.to - steps.from) / steps.step.max(1)).max(0) as usize + 1;
        Frames {
            steps,
            b,
            buf: Vec::new(),
            labels: Vec::new(),
            samples: Vec::new(),
            compact_at: (2 * (n + 1)).max(4096),
            points: Vec::new(),
            ready: Vec::new(),
            failed: None,
        }
    }

    /// Takes the next piece of the answer; `Break` once it failed (nothing more is read).
    fn push(&mut self, piece: &[u8]) -> ControlFlow<()> {
        if self.failed.is_some() {
            return ControlFlow::Break(());
        }
        self.buf.extend_from_slice(piece);
        // Out of `self` while its frames are decoded into `self`.
        let buf = std::mem::take(&mut self.buf);
        let mut at = 0;
        let r = loop {
            match frame(&buf[at..]) {
                // The frame's checksum held: what follows is what the server meant.
                Ok(Some((msg, n))) => {
                    if let Err(e) = self.frame(msg) {
                        break Err(e);
                    }
                    at += n;
                }
                Ok(None) => break Ok(()),
                Err(e) => break Err(Bad::Corrupt(Corrupt::Frame(e))),
            }
        };
        self.buf = buf;
        self.buf.drain(..at);
        match r.and_then(|()| self.deliver()) {
            Ok(()) => ControlFlow::Continue(()),
            Err(e) => {
                self.failed = Some(e);
                ControlFlow::Break(())
            }
        }
    }

    /// One frame (`ChunkedReadResponse`), read field by field where it lies: decoded whole,
    /// a frame of many empty parts would take some 24 times its size in memory.
    fn frame(&mut self, msg: &[u8]) -> Result<(), Bad> {
        for f in Fields(msg) {
            match f? {
                (1, Field::Bytes(series)) => self.series(series)?,
                (2, Field::Varint(0)) => {}
                (2, Field::Varint(q)) => {
                    return Err(Unreadable::OtherQuery((q as i64).wrapping_add(1)).into())
                }
                (1 | 2, _) => return Err(DecodeError::WrongType.into()),
                _ => {} // unknown fields are skipped, as protobuf does
            }
        }
        Ok(())
    }

    /// One `ChunkedSeries`: its labels first (wherever they lie in it), then its chunks.
    fn series(&mut self, s: &[u8]) -> Result<(), Bad> {
        let mut labels = Vec::new();
        let mut bytes = 0;
        for f in Fields(s) {
            match f? {
                (1, Field::Bytes(l)) => {
                    bytes += l.len();
                    if bytes > LABELS_MAX {
                        return Err(Bad::Exceeded(Bound::Labels(LABELS_MAX)));
                    }
                    labels.push(label(l)?);
                }
                (2, Field::Bytes(_)) => {}
                (1 | 2, _) => return Err(DecodeError::WrongType.into()),
                _ => {}
            }
        }
        if labels != self.labels {
            self.flush()?;
            self.labels = labels;
        }
        for f in Fields(s) {
            if let (2, Field::Bytes(c)) = f? {
                self.chunk(c)?;
            }
        }
        Ok(())
    }

    /// One chunk of the series being read: its samples in the request's range.
    fn chunk(&mut self, c: &[u8]) -> Result<(), Unreadable> {
        let (mut encoding, mut data) = (0, &[][..]);
        for f in Fields(c) {
            match f.map_err(Unreadable::Frame)? {
                (3, Field::Varint(v)) => encoding = v,
                (4, Field::Bytes(d)) => data = d,
                _ => {}
            }
        }
        if encoding != proto::XOR as u64 {
            return Err(Unreadable::Encoding {
                series: show(&self.labels),
                encoding: encoding as i32,
            });
        }
        let before = self.samples.len();
        decode_xor(data, &mut self.samples).map_err(|source| Unreadable::Chunk {
            series: show(&self.labels),
            source,
        })?;
        // Only what the steps can use: chunks overlap the range's edges.
        let (lo, hi) = (
            self.steps.from * 1000 - self.steps.lookback_ms,
            self.steps.to * 1000,
        );
        let mut w = before;
        for r in before..self.samples.len() {
            if (lo..=hi).contains(&self.samples[r].0) {
                self.samples[w] = self.samples[r];
                w += 1;
            }
        }
        self.samples.truncate(w);
        if self.samples.len() > self.compact_at {
            self.compact();
        }
        Ok(())
    }

    /// Keeps of the series' samples only those a step can take: the newest at or before each
    /// step and after the one before it (the newest of a millisecond being the last to come,
    /// as in [`Frames::flush`]). [`at_steps`] gives the same values from what is left, and a
    /// series holds at most about two samples per step however many the server sends
    /// (scrapes finer than the step, or an answer repeating its chunks).
    fn compact(&mut self) {
        if !self.samples.is_sorted_by_key(|s| s.0) {
            self.samples.sort_by_key(|s| s.0); // stable: equal times keep their order
        }
        let (first, step_ms) = (self.steps.from * 1000, self.steps.step.max(1) * 1000);
        // The step a sample counts for first: the one at or after it.
        let slot = |t: i64| {
            if t <= first {
                0
            } else {
                (t - first + step_ms - 1) / step_ms
            }
        };
        let s = &mut self.samples;
        let mut w = 0;
        for r in 0..s.len() {
            if r + 1 == s.len() || slot(s[r + 1].0) != slot(s[r].0) {
                s[w] = s[r];
                w += 1;
            }
        }
        s.truncate(w);
    }

    /// Puts the series read so far in `ready`, and on the grid once [`READY_MAX`] wait.
    fn flush(&mut self) -> Result<(), Bad> {
        if self.labels.is_empty() {
            self.samples.clear();
            return Ok(());
        }
        if !self.samples.is_sorted_by_key(|s| s.0) {
            // Chunks arrive in time order; should overlapping ones come, the newest sample
            // of a millisecond wins, as in Prometheus' merge.
            self.samples.sort_by_key(|s| s.0);
        }
        let from = self.points.len();
        at_steps(&self.samples, self.steps, &mut self.points);
        let labels = std::mem::take(&mut self.labels);
        self.samples.clear();
        if self.points.len() == from {
            // No value at any step (stopped before the range, say): `query_range` would
            // not list the series at all.
            return Ok(());
        }
        let metric: BTreeMap<String, String> =
            labels.into_iter().map(|l| (l.name, l.value)).collect();
        self.ready.push((metric, from..self.points.len()));
        if self.ready.len() >= READY_MAX || self.points.len() >= POINTS_MAX {
            self.deliver()?;
        }
        Ok(())
    }

    /// Puts the series read whole on the grid, under one lock (a lock per series made the
    /// decoders of concurrent requests wait on each other at 100,000 series).
    fn deliver(&mut self) -> Result<(), Bad> {
        if self.ready.is_empty() {
            return Ok(());
        }
        let mut b = self.b.lock().unwrap_or_else(|e| e.into_inner());
        for (metric, range) in self.ready.drain(..) {
            if let Some(key) = b.key(&metric) {
                b.add_many(&key, self.points[range].iter().copied());
            }
        }
        let exceeded = b.exceeded().cloned();
        drop(b);
        self.points.clear();
        exceeded.map_or(Ok(()), |bound| Err(Bad::Exceeded(bound)))
    }

    /// Puts the last series on the grid; called only once the whole answer was read (a
    /// series cut short would give its last sample to later steps than it should).
    fn finish(mut self) -> Result<(), Bad> {
        if let Some(e) = self.failed.take() {
            return Err(e);
        }
        if !self.buf.is_empty() {
            return Err(Corrupt::Cut(self.buf.len()).into());
        }
        self.flush()?;
        self.deliver()
    }
}

/// One field of a protobuf message: a varint, the bytes of a length-delimited field, or a
/// fixed-width value (which no field rlc reads has).
#[derive(Debug)]
enum Field<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
    Fixed,
}

/// The fields of a protobuf message as `(number, value)`, read where they lie; ends after
/// the first error.
struct Fields<'a>(&'a [u8]);

impl<'a> Iterator for Fields<'a> {
    type Item = Result<(u64, Field<'a>), DecodeError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.0.is_empty() {
            return None;
        }
        let f = self.field();
        if f.is_err() {
            self.0 = &[];
        }
        Some(f)
    }
}

impl<'a> Fields<'a> {
    fn field(&mut self) -> Result<(u64, Field<'a>), DecodeError> {
        let key = varint(&mut self.0)?;
        let value = match key & 7 {
            0 => Field::Varint(varint(&mut self.0)?),
            2 => {
                let n = usize::try_from(varint(&mut self.0)?)
                    .ok()
                    .filter(|&n| n <= self.0.len())
                    .ok_or(DecodeError::LengthPastEnd)?;
                let (v, rest) = self.0.split_at(n);
                self.0 = rest;
                Field::Bytes(v)
            }
            w @ (1 | 5) => {
                let n = if w == 1 { 8 } else { 4 };
                self.0 = self.0.get(n..).ok_or(DecodeError::FieldCut)?;
                Field::Fixed
            }
            w => return Err(DecodeError::WireType(w)),
        };
        Ok((key >> 3, value))
    }
}

/// A protobuf varint at the start of `b`, which is advanced past it.
fn varint(b: &mut &[u8]) -> Result<u64, DecodeError> {
    let mut x = 0u64;
    for k in 0..10 {
        let (&byte, rest) = b.split_first().ok_or(DecodeError::VarintCut)?;
        *b = rest;
        x |= u64::from(byte & 0x7f) << (7 * k);
        if byte < 0x80 {
            return Ok(x);
        }
    }
    Err(DecodeError::VarintTooLong)
}

/// A `Label` message.
fn label(l: &[u8]) -> Result<proto::Label, Bad> {
    let mut out = proto::Label::default();
    for f in Fields(l) {
        let (n, v) = f?;
        let text = |v: Field<'_>| match v {
            Field::Bytes(b) => String::from_utf8(b.to_vec()).map_err(|_| DecodeError::NotUtf8),
            _ => Err(DecodeError::WrongType),
        };
        match n {
            1 => out.name = text(v)?,
            2 => out.value = text(v)?,
            _ => {}
        }
    }
    Ok(out)
}

fn show(labels: &[proto::Label]) -> String {
    let inner: Vec<String> = labels
        .iter()
        .map(|l| format!("{}={:?}", l.name, l.value))
        .collect();
    format!("{{{}}}", inner.join(", "))
}

/// The first frame of `buf` (uvarint length, big-endian CRC32C of the message, message): the
/// message and the frame's length, `None` while incomplete.
fn frame(buf: &[u8]) -> Result<Option<(&[u8], usize)>, DecodeError> {
    let mut len: u64 = 0;
    let mut n = 0;
    loop {
        let Some(&byte) = buf.get(n) else {
            return Ok(None);
        };
        if n == 9 {
            return Err(DecodeError::FrameLength);
        }
        len |= u64::from(byte & 0x7f) << (7 * n);
        n += 1;
        if byte < 0x80 {
            break;
        }
    }
    let len = len as usize;
    if len > FRAME_MAX {
        return Err(DecodeError::FrameTooLarge(len));
    }
    let Some(msg) = buf.get(n + 4..n + 4 + len) else {
        return Ok(None);
    };
    let want = u32::from_be_bytes(buf[n..n + 4].try_into().expect("4 bytes"));
    if crc32c::crc32c(msg) != want {
        return Err(DecodeError::Checksum);
    }
    Ok(Some((msg, n + 4 + len)))
}

/// Prometheus' stale marker: a `NaN` with this bit pattern ends a series until its next
/// sample.
const STALE_NAN: u64 = 0x7ff0_0000_0000_0002;

/// The value at each step of `steps` from sorted `samples`: the newest sample at or before the
/// step, at most `lookback_ms` older, unless it is a stale marker.
pub(crate) fn at_steps(samples: &[(i64, f64)], steps: Steps, out: &mut Vec<(f64, f64)>) {
    let mut j = 0;
    let mut t = steps.from;
    while t <= steps.to {
        let tm = t * 1000;
        while j < samples.len() && samples[j].0 <= tm {
            j += 1;
        }
        if let Some(&(st, v)) = j.checked_sub(1).map(|k| &samples[k]) {
            let fresh = if steps.include_start {
                st >= tm - steps.lookback_ms
            } else {
                st > tm - steps.lookback_ms
            };
            if fresh && v.to_bits() != STALE_NAN {
                out.push((t as f64, v));
            }
        }
        t += steps.step;
    }
}

/// A big-endian bit reader.
struct Bits<'a> {
    b: &'a [u8],
    /// Position in bits.
    pos: usize,
}

impl Bits<'_> {
    /// The next `n` (1 to 64) bits.
    #[inline]
    fn read(&mut self, n: u32) -> Result<u64, DecodeError> {
        debug_assert!((1..=64).contains(&n));
        let end = self.pos + n as usize;
        if end > self.b.len() * 8 {
            return Err(DecodeError::ChunkCut);
        }
        let (byte, off) = (self.pos / 8, (self.pos % 8) as u32);
        let hi = match self.b.get(byte..byte + 8) {
            Some(w) => u64::from_be_bytes(w.try_into().expect("8 bytes")),
            None => {
                let mut w = [0u8; 8];
                let rest = &self.b[byte..];
                w[..rest.len()].copy_from_slice(rest);
                u64::from_be_bytes(w)
            }
        };
        let mut v = (hi << off) >> (64 - n);
        if off + n > 64 {
            let lo = u64::from(self.b.get(byte + 8).copied().unwrap_or(0));
            v |= lo >> (8 - (off + n - 64));
        }
        self.pos = end;
        Ok(v)
    }

    #[inline]
    fn bit(&mut self) -> Result<bool, DecodeError> {
        Ok(self.read(1)? == 1)
    }

    fn uvarint(&mut self) -> Result<u64, DecodeError> {
        let mut x = 0u64;
        for k in 0..10 {
            let byte = self.read(8)?;
            x |= (byte & 0x7f) << (7 * k);
            if byte < 0x80 {
                return Ok(x);
            }
        }
        Err(DecodeError::VarintTooLong)
    }
}

/// Appends the samples of a Prometheus XOR chunk (`tsdb/chunkenc`: a 2-byte sample count,
/// then the first timestamp as a varint and value as 64 bits, the second timestamp as a
/// delta, then delta-of-deltas and XORed values in variable bit widths).
pub(crate) fn decode_xor(data: &[u8], out: &mut Vec<(i64, f64)>) -> Result<(), DecodeError> {
    if data.len() < 2 {
        return Err(DecodeError::ChunkHeader);
    }
    let total = u16::from_be_bytes([data[0], data[1]]) as usize;
    let mut r = Bits {
        b: &data[2..],
        pos: 0,
    };
    out.reserve(total);
    let (mut t, mut delta, mut value) = (0i64, 0u64, 0u64);
    let (mut leading, mut trailing) = (0u32, 0u32);
    for k in 0..total {
        match k {
            0 => {
                let u = r.uvarint()?;
                t = ((u >> 1) as i64) ^ -((u & 1) as i64); // zig-zag
                value = r.read(64)?;
                out.push((t, f64::from_bits(value)));
                continue;
            }
            1 => {
                delta = r.uvarint()?;
                t = t.wrapping_add(delta as i64);
            }
            _ => {
                let mut d = 0u8;
                for _ in 0..4 {
                    d <<= 1;
                    if !r.bit()? {
                        break;
                    }
                    d |= 1;
                }
                let dod = match d {
                    0b0 => 0,
                    0b1111 => r.read(64)? as i64,
                    _ => {
                        let sz = match d {
                            0b10 => 14,
                            0b110 => 17,
                            _ => 20,
                        };
                        let mut bits = r.read(sz)?;
                        if bits > 1 << (sz - 1) {
                            bits = bits.wrapping_sub(1 << sz);
                        }
                        bits as i64
                    }
                };
                delta = (delta as i64).wrapping_add(dod) as u64;
                t = t.wrapping_add(delta as i64);
            }
        }
        if r.bit()? {
            if r.bit()? {
                leading = r.read(5)? as u32;
                let mut sig = r.read(6)? as u32;
                if sig == 0 {
                    sig = 64;
                }
                trailing = 64u32
                    .checked_sub(leading + sig)
                    .ok_or(DecodeError::XorWidths)?;
            }
            let sig = 64 - leading - trailing;
            if sig == 0 {
                return Err(DecodeError::XorWidths);
            }
            value ^= r.read(sig)? << trailing;
        }
        out.push((t, f64::from_bits(value)));
    }
    Ok(())
}

/// Encodes and decodes answers as Prometheus and a pull do, for `benches/history_decode.rs`
/// and the tests.
#[doc(hidden)]
pub mod bench {
    use super::*;

    /// A minimal XOR chunk encoder (Prometheus' `xorAppender`): the tests check the decoder on
    /// every width of delta-of-delta and value with it, the benchmark makes its answer with it.
    struct Enc {
        b: Vec<u8>,
        bits: usize,
    }
    impl Enc {
        fn put(&mut self, v: u64, n: u32) {
            for k in (0..n).rev() {
                if self.bits.is_multiple_of(8) {
                    self.b.push(0);
                }
                if (v >> k) & 1 == 1 {
                    *self.b.last_mut().unwrap() |= 1 << (7 - self.bits % 8);
                }
                self.bits += 1;
            }
        }
        fn uvarint(&mut self, mut x: u64) {
            while x >= 0x80 {
                self.put((x & 0x7f) | 0x80, 8);
                x >>= 7;
            }
            self.put(x, 8);
        }
    }
    /// Samples as one XOR chunk (at most 65,535).
    pub fn encode(samples: &[(i64, f64)]) -> Vec<u8> {
        let mut e = Enc {
            b: Vec::new(),
            bits: 0,
        };
        let (mut t, mut delta, mut v) = (0i64, 0i64, 0u64);
        let (mut lead, mut trail) = (0xffu32, 0u32);
        for (k, &(ts, val)) in samples.iter().enumerate() {
            let bits = val.to_bits();
            match k {
                0 => {
                    e.uvarint(((ts << 1) ^ (ts >> 63)) as u64);
                    e.put(bits, 64);
                    (t, v) = (ts, bits);
                    continue;
                }
                1 => {
                    delta = ts - t;
                    e.uvarint(delta as u64);
                }
                _ => {
                    let d = ts - t;
                    let dod = d - delta;
                    match dod {
                        0 => e.put(0, 1),
                        _ if (-8191..=8192).contains(&dod) => {
                            e.put(0b10, 2);
                            e.put(dod as u64 & 0x3fff, 14);
                        }
                        _ if (-65535..=65536).contains(&dod) => {
                            e.put(0b110, 3);
                            e.put(dod as u64 & 0x1ffff, 17);
                        }
                        _ if (-524287..=524288).contains(&dod) => {
                            e.put(0b1110, 4);
                            e.put(dod as u64 & 0xfffff, 20);
                        }
                        _ => {
                            e.put(0b1111, 4);
                            e.put(dod as u64, 64);
                        }
                    }
                    delta = d;
                }
            }
            t = ts;
            let x = bits ^ v;
            if x == 0 {
                e.put(0, 1);
            } else {
                let (l, tr) = (x.leading_zeros().min(31), x.trailing_zeros());
                if lead != 0xff && l >= lead && tr >= trail {
                    e.put(0b10, 2);
                    e.put(x >> trail, 64 - lead - trail);
                } else {
                    (lead, trail) = (l, tr);
                    let sig = 64 - l - tr;
                    e.put(0b11, 2);
                    e.put(l as u64, 5);
                    e.put(sig as u64 & 0x3f, 6);
                    e.put(x >> tr, sig);
                }
            }
            v = bits;
        }
        let mut out = (samples.len() as u16).to_be_bytes().to_vec();
        out.extend(e.b);
        out
    }

    /// One series of [`answer`]: its labels and samples `(ms, value)`.
    pub type Series = (Vec<(String, String)>, Vec<(i64, f64)>);

    /// A streamed answer: a frame per series, its samples in chunks of 120 as a TSDB cuts them.
    pub fn answer(series: &[Series]) -> Vec<u8> {
        let mut out = Vec::new();
        for (labels, samples) in series {
            let msg = proto::ChunkedReadResponse {
                chunked_series: vec![proto::ChunkedSeries {
                    labels: labels
                        .iter()
                        .map(|(name, value)| proto::Label {
                            name: name.clone(),
                            value: value.clone(),
                        })
                        .collect(),
                    chunks: samples
                        .chunks(120)
                        .map(|c| proto::Chunk {
                            min_time_ms: c[0].0,
                            max_time_ms: c[c.len() - 1].0,
                            r#type: proto::XOR,
                            data: encode(c),
                        })
                        .collect(),
                }],
                query_index: 0,
            }
            .encode_to_vec();
            prost::encoding::encode_varint(msg.len() as u64, &mut out);
            out.extend(crc32c::crc32c(&msg).to_be_bytes());
            out.extend(msg);
        }
        out
    }

    /// Puts the series of `body` on a grid in memory (`start`, `step` in seconds, `len`
    /// steps) as a pull does; returns how many series it holds.
    pub fn decode(body: &[u8], start: i64, step: i64, len: usize) -> usize {
        let b = Arc::new(Mutex::new(Builder::new(
            start,
            step,
            len,
            super::super::LabelNames::default(),
        )));
        let steps = Steps {
            from: start,
            to: start + (len as i64 - 1) * step,
            step,
            lookback_ms: 300_000,
            include_start: true,
        };
        let mut f = Frames::new(steps, b.clone());
        assert!(f.push(body).is_continue());
        f.finish().unwrap();
        let b = Arc::try_unwrap(b).ok().unwrap().into_inner().unwrap();
        b.finish().series.len()
    }
}

#[cfg(test)]
mod tests;
