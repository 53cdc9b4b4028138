//! Why a history pull failed: [`HistoryError`], the last failure of a request that no attempt
//! got through ([`RequestFailure`]), what was wrong with a file or an answer ([`ParseError`]),
//! the bounds on what a pull reads ([`Bound`]); why a history on disk could not be written or
//! read ([`DiskError`]).

use std::path::PathBuf;
use std::sync::Arc;

use reqwest::StatusCode;
use schema::HumanDuration;

use super::SeriesKey;

/// Why history could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum HistoryError {
    /// `history` names no source.
    #[error("history: no source configured (need `prometheus` or `file`)")]
    NoSource,
    /// A file could not be read.
    #[error("cannot read history file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The temporary file a pull spills its series to could not be created or written.
    #[error("cannot write the history spill {path}: {source}")]
    Spill {
        /// The file, or the directory it was to be created in.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A file or response could not be parsed.
    #[error("cannot parse {what}: {source}")]
    Parse {
        /// What was parsed.
        what: String,
        /// Why it failed.
        source: ParseError,
    },
    /// Prometheus answered with an error it will answer again (bad query, too many points…).
    #[error("prometheus at {url} refused the query (HTTP {status}, {error_type}): {error}")]
    Refused {
        /// Base URL.
        url: String,
        /// HTTP status.
        status: u16,
        /// Prometheus `errorType`.
        error_type: String,
        /// Prometheus `error`.
        error: String,
    },
    /// Prometheus could not be reached or kept failing after every retry.
    #[error("prometheus at {url} failed after {attempts} attempts: {source}")]
    Unavailable {
        /// Base URL.
        url: String,
        /// Attempts made.
        attempts: u32,
        /// The last failure.
        source: RequestFailure,
    },
    /// `history` asks for something that cannot be done (the message names the field).
    #[error("{0}")]
    Config(String),
    /// An answer crossed a bound on what a pull reads: the pull stops at once (a server that
    /// sent it would send it again, so it is not retried) and fails as a whole.
    #[error("prometheus at {url}: {bound}, in the answer to {request}{}", bound.advice())]
    Exceeded {
        /// Base URL.
        url: String,
        /// The request: API and time range.
        request: String,
        /// The bound crossed.
        bound: Bound,
    },
    /// The history could not be written to disk or read back.
    #[error(transparent)]
    Disk(#[from] DiskError),
}

/// The last failure of a request to Prometheus that no attempt got through
/// ([`HistoryError::Unavailable`]).
#[derive(Debug, thiserror::Error)]
pub enum RequestFailure {
    /// The request could not be sent, or no answer came within the timeout.
    #[error("request failed: {}", cause(.source, .timeout))]
    Send {
        /// The cause.
        source: reqwest::Error,
        /// `history.prometheus.timeout`.
        timeout: HumanDuration,
    },
    /// The answer could not be read whole.
    #[error("reading the response failed: {}", cause(.source, .timeout))]
    Read {
        /// The cause.
        source: reqwest::Error,
        /// `history.prometheus.timeout`.
        timeout: HumanDuration,
    },
    /// A `query_range` answer some storage nodes did not contribute to (`isPartial`).
    #[error("partial response (isPartial: some storage nodes did not answer)")]
    Partial,
    /// A `query_range` answer with an error status.
    #[error("HTTP {status}: {error_type} {error}")]
    Status {
        /// The status.
        status: StatusCode,
        /// Prometheus' `errorType`, if any.
        error_type: String,
        /// Prometheus' `error`, if any.
        error: String,
    },
    /// A `query_range` answer that is no answer (a proxy's page, a cut body).
    #[error("HTTP {status}, unreadable body ({source}): {body}")]
    UnreadableBody {
        /// The status.
        status: StatusCode,
        /// Why the body is no answer.
        source: serde_json::Error,
        /// Its first 200 bytes.
        body: String,
    },
    /// A remote-read answer with an error status.
    #[error("HTTP {status}: {text}")]
    ErrorText {
        /// The status.
        status: StatusCode,
        /// The first 300 bytes of the body, trimmed.
        text: String,
    },
    /// A remote-read answer that is not streamed chunks.
    #[error("HTTP {status} with `{content_type}` instead of streamed chunks (Prometheus 2.13 or later answers remote read with them)")]
    NotStreamed {
        /// The status.
        status: StatusCode,
        /// Its `Content-Type`.
        content_type: String,
    },
    /// A streamed answer whose end HTTP does not tell (no length, no chunked encoding).
    #[error("a streamed answer without a length or chunked encoding: a cut could not be told from its end (a proxy in between?)")]
    Undelimited,
    /// A remote-read request past `history.prometheus.max_request_duration`.
    #[error("the request took longer than history.prometheus.max_request_duration ({0})")]
    TooLong(HumanDuration),
    /// A streamed answer corrupt or cut on its way.
    #[error("bad answer: {0}")]
    Corrupt(#[source] Corrupt),
    /// The server's settings, which remote read follows, could not be read.
    #[error("reading the server's settings failed: {0}")]
    Settings(String),
    /// The HTTP client could not be built.
    #[error(transparent)]
    Client(reqwest::Error),
    /// The task pulling a chunk failed.
    #[error(transparent)]
    Task(tokio::task::JoinError),
}

/// A failed send or read: how long it waited when it timed out, else the error with its
/// causes (reqwest keeps "connection refused" in them).
fn cause(e: &reqwest::Error, timeout: &HumanDuration) -> String {
    if e.is_timeout() {
        format!("timed out after {timeout}")
    } else {
        chain(e)
    }
}

/// What was wrong with a history file or an answer ([`HistoryError::Parse`]).
#[derive(Debug, thiserror::Error)]
pub enum ParseError {
    /// A line of a CSV file.
    #[error(transparent)]
    Csv(#[from] CsvError),
    /// JSON that is not a `query_range` answer (a file, or a series of an answer).
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    /// A saved answer whose status is not `success`.
    #[error("status {status}: {error}")]
    Status {
        /// Its `status`.
        status: String,
        /// Its `error`, if any.
        error: String,
    },
    /// A saved answer without `data`.
    #[error("no data")]
    NoData,
    /// A `success` answer without `data`.
    #[error("success without data")]
    SuccessWithoutData,
    /// A result that is not a range query's (`resultType`).
    #[error("expected a matrix result, got `{0}`")]
    NotMatrix(String),
    /// The answer ended inside its JSON document, this many containers open.
    #[error("the answer ended inside the JSON document ({0} containers open)")]
    Unfinished(usize),
    /// The decoder of the answer failed.
    #[error(transparent)]
    Decoder(#[from] DecoderFailed),
    /// A remote-read answer rlc cannot read.
    #[error("{0} (`history.prometheus.api: query_range` reads the query as PromQL instead)")]
    RemoteRead(#[source] Unreadable),
    /// The body of a remote-read request could not be compressed.
    #[error(transparent)]
    Request(#[from] snap::Error),
    /// The task reading a history file failed.
    #[error(transparent)]
    Task(#[from] tokio::task::JoinError),
    /// A chunk's task still held the pull's series when the pull ended.
    #[error("a chunk task outlived the pull")]
    Outlived,
    /// A spilled history asked of a builder that does not spill.
    #[error("finish_spilled on a builder without a spill")]
    NotSpilled,
}

/// A bound on what a history pull reads from the network or holds ([`HistoryError::Exceeded`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Bound {
    /// One answer carried more bytes than `history.prometheus.max_response_bytes`.
    ResponseBytes(u64),
    /// The pull read more bytes than `history.prometheus.max_pull_bytes`.
    PullBytes(u64),
    /// The pull met more series than `history.prometheus.max_series`.
    Series(u64),
    /// One series' text in a `query_range` answer is longer than its points can be.
    SeriesText {
        /// The bound in bytes.
        max: usize,
        /// The points one series has at most in the request.
        points: usize,
    },
    /// One series' labels take more than [`LABELS_MAX`](super::LABELS_MAX) bytes.
    Labels(usize),
    /// A `query_range` answer has more than this many bytes outside `data.result`.
    Envelope(usize),
    /// A series came in more answers than the pull made requests and attempts.
    Repeated {
        /// The series (service/caller/procedure).
        series: String,
        /// Answers (requests × attempts) the pull could get.
        max: usize,
    },
}

impl Bound {
    /// The setting that raises the bound, if one does.
    pub fn key(&self) -> Option<&'static str> {
        match self {
            Bound::ResponseBytes(_) => Some("history.prometheus.max_response_bytes"),
            Bound::PullBytes(_) => Some("history.prometheus.max_pull_bytes"),
            Bound::Series(_) => Some("history.prometheus.max_series"),
            _ => None,
        }
    }

    /// What to do about it, after the error.
    fn advice(&self) -> String {
        match self.key() {
            Some(k) => format!(": raise `{k}` if such answers are legitimate"),
            None => ": not an answer Prometheus sends".into(),
        }
    }
}

impl std::fmt::Display for Bound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Bound::ResponseBytes(n) => write!(
                f,
                "the answer exceeds {n} bytes (history.prometheus.max_response_bytes)"
            ),
            Bound::PullBytes(n) => write!(
                f,
                "the pull exceeds {n} bytes in all (history.prometheus.max_pull_bytes)"
            ),
            Bound::Series(n) => write!(
                f,
                "the pull exceeds {n} series (history.prometheus.max_series)"
            ),
            Bound::SeriesText { max, points } => write!(
                f,
                "one series' text exceeds {max} bytes, more than its {points} points and labels can take"
            ),
            Bound::Labels(n) => write!(f, "one series' labels exceed {n} bytes"),
            Bound::Envelope(n) => write!(f, "more than {n} bytes outside data.result"),
            Bound::Repeated { series, max } => write!(
                f,
                "series {series} comes more than {max} times, once per request and attempt at most"
            ),
        }
    }
}

/// The decoder of an answer, on its blocking thread, panicked.
#[derive(Debug, thiserror::Error)]
#[error("the decoder of the answer failed: {0}")]
pub struct DecoderFailed(#[from] pub tokio::task::JoinError);

/// Why a history on disk (a pull's spill, the ring `rlc serve` holds) could not be written or
/// read. Each names the file.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    /// The ring's directory or file could not be created under `parent`.
    #[error("cannot create the held history under {}: {source}", parent.display())]
    Create {
        /// The directory it was to be created in.
        parent: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A write to the ring failed.
    #[error("cannot write the held history {}: {source}", path.display())]
    Write {
        /// The ring's file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A read of the ring failed.
    #[error("cannot read the held history {}: {source}", path.display())]
    Read {
        /// The ring's file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A read of one series from the ring failed.
    #[error("cannot read series {key:?} of the held history {}: {source}", path.display())]
    ReadSeries {
        /// The series.
        key: SeriesKey,
        /// The ring's file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A read of one run of a series from a pull's spill failed.
    #[error(
        "cannot read the history spill {} (series {key:?}, {len} bytes at {offset}): {source}",
        path.display()
    )]
    ReadSpill {
        /// The spill file.
        path: PathBuf,
        /// The series.
        key: SeriesKey,
        /// Bytes of the run.
        len: usize,
        /// Where the run starts in the file.
        offset: u64,
        /// The cause.
        source: std::io::Error,
    },
    /// Increments since this view of the ring overwrote its first points.
    #[error(
        "the held history {} moved on past this view (its first points were overwritten): pull again",
        path.display()
    )]
    MovedOn {
        /// The ring's file.
        path: PathBuf,
    },
    /// The ring refuses reads: an increment failed and could not be undone.
    #[error(transparent)]
    Broken(Arc<Unrestored>),
    /// The history to hold is one whose source failed (the reason it gives).
    #[error("{0}")]
    Unavailable(String),
    /// The blocking task writing the history (`the increment`, `the held history`) failed.
    #[error("writing {writing}: {source}")]
    Panicked {
        /// What it was writing.
        writing: &'static str,
        /// The cause.
        source: tokio::task::JoinError,
    },
}

/// Why a ring refuses reads ([`DiskError::Broken`]).
#[derive(Debug, thiserror::Error)]
pub enum Unrestored {
    /// An increment failed, and the cells of the held view it had overwritten could not be
    /// written back.
    #[error(
        "{failure}; and the held history could not be restored ({undo}): the next pull is a full one"
    )]
    Undo {
        /// Why the increment failed.
        #[source]
        failure: DiskError,
        /// Why writing the cells back failed.
        undo: std::io::Error,
    },
    /// Broken on purpose (`RingHistory::break_for_test`).
    #[doc(hidden)]
    #[error(transparent)]
    Injected(std::io::Error),
}

impl From<DiskError> for rlc_plan::history::Unreadable {
    /// The plan takes why a service's history could not be read as text.
    fn from(e: DiskError) -> Self {
        rlc_plan::history::Unreadable(e.to_string())
    }
}

/// A frame larger than this is taken for a corrupt length (Prometheus cuts frames at 1 MB by
/// default, `--storage.remote.read-max-bytes-in-frame`, going past it by one chunk of a
/// series at most: a few KB). Each request in flight holds up to one frame.
pub(super) const FRAME_MAX: usize = 16 << 20;

/// A streamed answer corrupt or cut on its way (a retry may get it whole).
#[derive(Debug, thiserror::Error)]
pub enum Corrupt {
    /// A frame failed its checks (length, size, checksum).
    #[error(transparent)]
    Frame(DecodeError),
    /// The answer ended inside a frame: these bytes of it had come.
    #[error("the answer ended inside a frame ({0} bytes left)")]
    Cut(usize),
    /// The decoder stopped before the answer's end.
    #[error(transparent)]
    Decoder(#[from] DecoderFailed),
}

/// A streamed answer the server sent whole but rlc cannot read (the same again on a retry).
#[derive(Debug, thiserror::Error)]
pub enum Unreadable {
    /// A message of a frame is not what the protocol says.
    #[error("undecodable frame: {0}")]
    Frame(#[source] DecodeError),
    /// A frame answers another query than the request's one.
    #[error("frame for query {0} of 1")]
    OtherQuery(i64),
    /// A chunk holds other samples than floats.
    #[error("series {series}: chunk encoding {encoding} is not float samples (native histograms are not request rates)")]
    Encoding {
        /// The series' labels.
        series: String,
        /// `Chunk.Encoding`.
        encoding: i32,
    },
    /// A chunk of a series could not be decoded.
    #[error("series {series}: {source}")]
    Chunk {
        /// The series' labels.
        series: String,
        /// What was wrong with the chunk.
        source: DecodeError,
    },
}

/// What could not be decoded in a streamed answer: a frame, a protobuf message in it, or an
/// XOR chunk of samples.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// A frame's length takes more than nine bytes.
    #[error("frame length is not a varint")]
    FrameLength,
    /// A frame longer than `FRAME_MAX` (16 MB): taken for a corrupt length.
    #[error("frame of {0} bytes (at most {FRAME_MAX})")]
    FrameTooLarge(usize),
    /// A frame whose CRC32C is not that of its message.
    #[error("frame checksum mismatch")]
    Checksum,
    /// A message ends inside a varint.
    #[error("the message ends inside a varint")]
    VarintCut,
    /// A varint of more than ten bytes (in a message or a chunk).
    #[error("varint too long")]
    VarintTooLong,
    /// A length-delimited field longer than what is left of its message.
    #[error("a length past the message's end")]
    LengthPastEnd,
    /// A message ends inside a fixed-width field.
    #[error("the message ends inside a field")]
    FieldCut,
    /// A wire type protobuf does not have (or the groups rlc does not read).
    #[error("wire type {0}")]
    WireType(u64),
    /// A field rlc reads with another wire type than its own.
    #[error("a field of the wrong type")]
    WrongType,
    /// A label name or value that is not UTF-8.
    #[error("a label that is not UTF-8")]
    NotUtf8,
    /// A chunk shorter than its 2-byte sample count.
    #[error("chunk shorter than its header")]
    ChunkHeader,
    /// A chunk that ends before its samples do.
    #[error("chunk ends early")]
    ChunkCut,
    /// XOR value widths that do not fit in 64 bits.
    #[error("bad XOR widths")]
    XorWidths,
}

/// Why a CSV file could not be read: the line (from 1) and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CsvError {
    /// Not five comma-separated fields.
    #[error("line {line}: expected 5 fields ts,service,caller,procedure,rps")]
    Fields {
        /// The line.
        line: usize,
    },
    /// A timestamp that is neither unix seconds nor RFC 3339.
    #[error("line {line}: bad timestamp `{text}`")]
    Timestamp {
        /// The line.
        line: usize,
        /// The field.
        text: String,
    },
    /// An rps that is not a number.
    #[error("line {line}: bad rps `{text}`")]
    Rps {
        /// The line.
        line: usize,
        /// The field.
        text: String,
        /// Why it is not a number.
        source: std::num::ParseFloatError,
    },
}

/// An error with its causes (reqwest hides "connection refused" in the source chain).
pub(crate) fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}
