//! History from a Prometheus-compatible HTTP API (Prometheus, VictoriaMetrics).
//!
//! The lookback is split into time chunks of at most `max_points` steps (and at most
//! [`CHUNK_STEPS`], so one response stays a few hundred MB even with 10,000 series) and pulled
//! by POST to `/api/v1/query_range` with form-encoded parameters, `concurrency` requests at a
//! time, each with a timeout and up to `retries` attempts separated by jittered exponential
//! backoff. An answer Prometheus would repeat (HTTP 400/422: bad query, too many points) is not
//! retried and is reported as [`HistoryError::Refused`].
//!
//! Answers are decoded as they arrive (`ResultSplitter`): each series of `data.result` is
//! parsed on its own and put on the grid at once, so a pull holds no whole response, only
//! the grid, one series' text per request in flight and the network buffers. A request that
//! fails half-way is retried; what its first attempt already put on the grid is a subset of
//! the same answer, and samples merge by maximum, so the retry leaves the grid as one clean
//! answer would. The pull still fails as a whole when any chunk fails after its retries.
//!
//! What a pull reads is bounded whatever the server sends (`Budget`, [`Bound`]): bytes per
//! answer and per pull, series per pull, the text of one series (its points and labels), a
//! series once per request and attempt. An answer that crosses a bound stops the pull at once,
//! without a retry: the same server would send the same again.
//!
//! [`load_spilled`] (what `rlc run` and `rlc preview` use) puts the series on disk instead of
//! on a grid in memory ([`super::spill`]): the pull then holds the index of the series, the
//! answers in flight and a write buffer, whatever the fleet's size.

use std::collections::BTreeMap;
use std::ops::ControlFlow;
use std::path::Path;
use std::sync::{Arc, Mutex};

use chrono::{DateTime, Utc};
use schema::{HistoryApi, HistoryConfig, PrometheusConfig};
use serde::Deserialize;
use tokio::sync::Semaphore;

use super::http::{
    read_capped, read_failed, send, stream_blocking, Budget, Failed, ReadError, Tries,
    ERROR_BODY_MAX,
};
use super::{
    grid, remote_read, request_range, Bound, Builder, History, HistoryError, ParseError,
    RequestFailure, SpilledHistory, LABELS_MAX,
};

/// Upper bound on steps per request: 12 h at 1 m.
pub const CHUNK_STEPS: u32 = 720;

/// A `query_range` response (also the saved-file format).
#[derive(Debug, Deserialize)]
pub(crate) struct Response<'a> {
    pub status: String,
    #[serde(default, borrow)]
    pub data: Option<Data<'a>>,
    #[serde(default)]
    pub error: Option<String>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct Data<'a> {
    #[serde(rename = "resultType")]
    pub result_type: String,
    #[serde(borrow)]
    pub result: Vec<Matrix<'a>>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct Matrix<'a> {
    pub metric: BTreeMap<String, String>,
    /// Values borrowed from the body: numbers never contain JSON escapes.
    #[serde(default, borrow)]
    pub values: Vec<(f64, &'a str)>,
}

/// The envelope of a response, without its data.
#[derive(Debug, Deserialize)]
struct Envelope {
    status: String,
    #[serde(default, rename = "errorType")]
    error_type: Option<String>,
    #[serde(default)]
    error: Option<String>,
    #[serde(default, rename = "isPartial")]
    is_partial: bool,
    /// `data` without its series (the skeleton of [`ResultSplitter`]).
    #[serde(default)]
    data: Option<DataType>,
}

#[derive(Debug, Deserialize)]
struct DataType {
    #[serde(rename = "resultType")]
    result_type: String,
}

/// Feeds a parsed response into the builder.
pub(crate) fn feed(b: &mut Builder, data: &Data<'_>) -> Result<(), ParseError> {
    if data.result_type != "matrix" {
        return Err(ParseError::NotMatrix(data.result_type.clone()));
    }
    for m in &data.result {
        let Some(key) = b.key(&m.metric) else {
            continue;
        };
        // Prometheus writes NaN/+Inf as strings; garbage parses as NaN and is rejected too.
        b.add_many(
            &key,
            m.values
                .iter()
                .map(|(ts, v)| (*ts, v.parse::<f64>().unwrap_or(f64::NAN))),
        );
    }
    Ok(())
}

/// Loads the lookback ending at `end` from Prometheus.
pub async fn load(
    p: &PrometheusConfig,
    h: &HistoryConfig,
    end: DateTime<Utc>,
) -> Result<History, HistoryError> {
    Ok(pull(p, h, end, None, None).await?.0.finish())
}

/// The newest part of the lookback ending at `end`: its grid points at or after `since`
/// (at least the last one), pulled as a full pull would pull them.
#[derive(Debug)]
pub struct Tail {
    /// The series on the grid of the points pulled (`history.end()` is the lookback's end).
    pub history: History,
    /// The grid of the whole lookback: first point, step, points.
    pub grid: (i64, i64, usize),
    /// What the pull read.
    pub stats: super::PullStats,
}

/// Pulls the grid points of the lookback ending at `end` from the first at or after `since`
/// ([`Tail`]): what `rlc serve` merges into the history it holds
/// ([`super::incremental::merge`]).
pub async fn load_tail(
    p: &PrometheusConfig,
    h: &HistoryConfig,
    end: DateTime<Utc>,
    since: i64,
) -> Result<Tail, HistoryError> {
    let (b, grid, stats) = pull(p, h, end, None, Some(since)).await?;
    Ok(Tail {
        history: b.finish(),
        grid,
        stats,
    })
}

/// [`load`] with what the pull read.
pub async fn load_with_stats(
    p: &PrometheusConfig,
    h: &HistoryConfig,
    end: DateTime<Utc>,
) -> Result<(History, super::PullStats), HistoryError> {
    let (b, _, stats) = pull(p, h, end, None, None).await?;
    Ok((b.finish(), stats))
}

/// [`load`], the series spilled to a new temporary file under `dir` as they stream in
/// ([`super::spill`]): the pull holds the index of the series, not their samples.
pub async fn load_spilled(
    p: &PrometheusConfig,
    h: &HistoryConfig,
    end: DateTime<Utc>,
    dir: &Path,
) -> Result<SpilledHistory, HistoryError> {
    pull(p, h, end, Some(dir), None).await?.0.finish_spilled()
}

/// Pulls the lookback into a builder: in memory, or spilled under `spill`; with `since`, only
/// the grid points at or after it (at least the last point), on a builder whose grid holds
/// just those. Returns the builder, the grid of the whole lookback and what the pull read
/// (also logged at info).
async fn pull(
    p: &PrometheusConfig,
    h: &HistoryConfig,
    end: DateTime<Utc>,
    spill: Option<&Path>,
    since: Option<i64>,
) -> Result<(Builder, (i64, i64, usize), super::PullStats), HistoryError> {
    let began = std::time::Instant::now();
    let w = Window::new(p, h, end, since);
    let (start, step, len) = (w.start, w.step, w.len);
    let client = http_client(&w.p, reqwest::Client::builder().timeout(w.p.timeout.0))?;
    // The API is chosen on the query as written, before any server-side reduction.
    let read = remote_reader(p, &w, &client).await?;
    let per_chunk = chunk_points(&w, read.is_some());
    let builder = bounded_builder(&w, spill, per_chunk)?;
    let api = if read.is_some() {
        "remote_read"
    } else {
        "query_range"
    };
    let task = Chunk {
        client,
        url: format!("{}/api/v1/query_range", w.p.url.trim_end_matches('/')),
        read,
        sem: Arc::new(Semaphore::new(w.p.concurrency.max(1) as usize)),
        budget: Arc::new(Budget::new(&w.p)),
        b: Arc::new(Mutex::new(builder)),
        p: w.p,
    };
    let mut tasks = tokio::task::JoinSet::new();
    let mut i = 0;
    while i < len {
        let n = per_chunk.min(len - i);
        let (from, to) = (start + i as i64 * step, start + (i + n - 1) as i64 * step);
        tasks.spawn(task.clone().pull((from, to, step)));
        i += n;
    }
    let kind = if w.skip > 0 {
        super::PullKind::Incremental
    } else {
        super::PullKind::Full
    };
    let url = &task.p.url;
    tracing::info!(url = %url, api, %kind, chunks = tasks.len(), series_points = len, step, "pulling history");
    join_chunks(&mut tasks, url).await?;
    let Chunk { b, budget, .. } = task;
    let b = Arc::try_unwrap(b).map_err(|_| HistoryError::Parse {
        what: "history".into(),
        source: ParseError::Outlived,
    })?;
    let b = b.into_inner().unwrap_or_else(|e| e.into_inner());
    let stats = super::PullStats {
        api,
        kind,
        series: b.series_count(),
        points: b.points(),
        bytes: budget.read(),
        from: start,
        to: start + (len as i64 - 1) * step,
    };
    super::log_pull(&stats, began.elapsed().as_secs_f64());
    Ok((b, w.full_grid, stats))
}

/// What a pull asks for: the query as sent and the grid points pulled.
struct Window {
    /// The settings with the query as sent: reduced server-side to the maximum over each
    /// step of `downsample` when that is coarser than `history.step`.
    p: PrometheusConfig,
    /// Whether the query is reduced so.
    reduced: bool,
    /// `history.step`, seconds: the step of the series as written.
    raw_step: i64,
    /// The grid of the whole lookback: first point, step, points.
    full_grid: (i64, i64, usize),
    /// The first point pulled.
    start: i64,
    /// The step of the points pulled, seconds.
    step: i64,
    /// The points pulled.
    len: usize,
    /// The points of the lookback before `start`, not pulled (an increment).
    skip: usize,
}

impl Window {
    /// The lookback ending at `end`, from the first point at or after `since` when given.
    fn new(
        p: &PrometheusConfig,
        h: &HistoryConfig,
        end: DateTime<Utc>,
        since: Option<i64>,
    ) -> Self {
        let raw_step = h.step.as_secs() as i64;
        let reduced = p.downsample.is_some_and(|d| d.as_secs() > h.step.as_secs());
        let (query, h) = match p.downsample {
            Some(d) if d.as_secs() > h.step.as_secs() => {
                let mut h = h.clone();
                let q = format!("max_over_time(({})[{d}:{}])", p.query, h.step);
                h.step = d;
                (q, h)
            }
            _ => (p.query.clone(), h.clone()),
        };
        // Downsampled, the point at `t` is the maximum over `(t - step, t]`: the last point is
        // the first multiple of `step` at or after the last raw point, so the freshest raw
        // minutes are in the history too (a grid ending before them would drop up to two
        // steps of them).
        let grid_end = if h.step.as_secs() as i64 > raw_step {
            let last_raw = end.timestamp().div_euclid(raw_step) * raw_step - raw_step;
            last_raw + 2 * h.step.as_secs() as i64 - 1
        } else {
            end.timestamp()
        };
        let full_grid = grid(&h, grid_end);
        let (start, step, len) = full_grid;
        // An increment: the points from `since` on, on a grid of their own.
        let skip = since.map_or(0, |s| {
            usize::try_from(((s - start).max(0) + step - 1) / step)
                .unwrap_or(usize::MAX)
                .min(len - 1)
        });
        Window {
            p: PrometheusConfig { query, ..p.clone() },
            reduced,
            raw_step,
            full_grid,
            start: start + skip as i64 * step,
            step,
            len: len - skip,
            skip,
        }
    }
}

/// Remote read, when a pull reads its chunks so: its client, the endpoint, the matchers of
/// the query and the server's rules.
#[derive(Clone)]
struct RemoteRead {
    client: reqwest::Client,
    url: String,
    matchers: Arc<Vec<remote_read::Matcher>>,
    rules: remote_read::Rules,
}

/// How the chunks of `w` are read ([`read_api`] on the query as `written`): by remote read,
/// or `None` for `query_range` (with `client`).
async fn remote_reader(
    written: &PrometheusConfig,
    w: &Window,
    client: &reqwest::Client,
) -> Result<Option<RemoteRead>, HistoryError> {
    let last = w.start + (w.len as i64 - 1) * w.step;
    let Some((matchers, rules)) = read_api(written, w.reduced, client, last).await? else {
        return Ok(None);
    };
    // A remote-read answer's size grows with the fleet, not with `max_points`: its requests
    // time out when no byte came for `timeout` (a hung server), not after `timeout` in all.
    let p = &w.p;
    let client = http_client(
        p,
        reqwest::Client::builder()
            .connect_timeout(p.timeout.0)
            .read_timeout(p.timeout.0),
    )?;
    Ok(Some(RemoteRead {
        client,
        url: remote_read::endpoint(&p.url),
        matchers: Arc::new(matchers),
        rules,
    }))
}

/// Grid points per request.
fn chunk_points(w: &Window, remote: bool) -> usize {
    let p = &w.p;
    if remote {
        // Remote read moves whole TSDB chunks, not steps: a request covers one to seven days
        // (fewer chunks decoded twice at the edges; a retry downloads at most a week again),
        // about two requests per connection (each costs a pass over every series).
        w.len.div_ceil(2 * p.concurrency.max(1) as usize).clamp(
            (remote_read::CHUNK_SECS / w.step).max(1) as usize,
            (7 * remote_read::CHUNK_SECS / w.step).max(1) as usize,
        )
    } else {
        // Bound the samples Prometheus evaluates per request too (its `query.max-samples`):
        // with server-side reduction, one output point costs `downsample ÷ step` inner steps.
        let inner_per_point = (w.step / w.raw_step.max(1)).max(1) as usize;
        (p.max_points.clamp(2, CHUNK_STEPS) as usize / inner_per_point).max(1)
    }
}

/// The builder of a pull: on the points pulled, in memory or spilled under `spill`, bounded
/// in series and in runs per series (`per_chunk` points per request).
fn bounded_builder(
    w: &Window,
    spill: Option<&Path>,
    per_chunk: usize,
) -> Result<Builder, HistoryError> {
    let (p, start, step, len) = (&w.p, w.start, w.step, w.len);
    let builder = match spill {
        Some(dir) => Builder::spilled(start, step, len, p.labels.clone(), dir)?,
        None => Builder::new(start, step, len, p.labels.clone()),
    };
    // An answer lists a series once: one run per request and attempt at most.
    let max_runs = len.div_ceil(per_chunk) * p.retries.max(1) as usize;
    Ok(builder.bounded(
        usize::try_from(p.max_series).unwrap_or(usize::MAX),
        max_runs,
    ))
}

/// What the task pulling one chunk of a pull takes (each a clone).
#[derive(Clone)]
struct Chunk {
    client: reqwest::Client,
    /// `query_range`'s URL.
    url: String,
    read: Option<RemoteRead>,
    /// The pull's concurrency.
    sem: Arc<Semaphore>,
    p: PrometheusConfig,
    b: Arc<Mutex<Builder>>,
    budget: Arc<Budget>,
}

impl Chunk {
    /// Pulls the points `[from, to]` at `step` onto the grid, once the pull's concurrency
    /// allows.
    async fn pull(self, (from, to, step): (i64, i64, i64)) -> Result<(), HistoryError> {
        let Chunk {
            client,
            url,
            read,
            sem,
            p,
            b,
            budget,
        } = self;
        let _permit = sem.acquire_owned().await.expect("semaphore never closed");
        match read {
            Some(r) => {
                let steps = remote_read::Steps {
                    from,
                    to,
                    step,
                    lookback_ms: r.rules.lookback_ms,
                    include_start: r.rules.include_start,
                };
                let at = (&r.client, r.url.as_str(), &p);
                remote_read::fetch(at, &r.matchers, steps, &b, &budget).await
            }
            None => fetch(&client, &url, &p, (from, to, step), &b, &budget).await,
        }
    }
}

/// Waits for the chunk tasks of a pull to `url` (a progress bar on a terminal). One failed
/// chunk fails the pull, and the other tasks are aborted: a partial history could lower
/// quotas.
async fn join_chunks(
    tasks: &mut tokio::task::JoinSet<Result<(), HistoryError>>,
    url: &str,
) -> Result<(), HistoryError> {
    let progress = progress_bar(tasks.len() as u64);
    let mut first_err = None;
    while let Some(r) = tasks.join_next().await {
        progress.inc(1);
        match r {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tasks.abort_all();
                first_err.get_or_insert(e);
            }
            Err(e) if e.is_cancelled() => {}
            Err(e) => {
                first_err.get_or_insert(HistoryError::Unavailable {
                    url: url.to_string(),
                    attempts: 0,
                    source: RequestFailure::Task(e),
                });
            }
        }
    }
    progress.finish_and_clear();
    first_err.map_or(Ok(()), Err)
}

fn http_client(
    p: &PrometheusConfig,
    b: reqwest::ClientBuilder,
) -> Result<reqwest::Client, HistoryError> {
    b.build().map_err(|e| HistoryError::Unavailable {
        url: p.url.clone(),
        attempts: 0,
        source: RequestFailure::Client(e),
    })
}

/// The matchers to pull by remote read and the server's rules, or `None` for `query_range`
/// (see [`HistoryApi`]): `auto` reads remotely when the query as written is a plain selector,
/// nothing is reduced server-side, the server answers a probe with streamed chunks and tells
/// its lookback, version and external labels ([`remote_read::rules`]).
async fn read_api(
    p: &PrometheusConfig,
    reduced: bool,
    client: &reqwest::Client,
    last_step: i64,
) -> Result<Option<(Vec<remote_read::Matcher>, remote_read::Rules)>, HistoryError> {
    let matchers = remote_read::selector(&p.query);
    let labels = [
        p.labels.service.as_str(),
        p.labels.caller.as_str(),
        p.labels.procedure.as_str(),
    ];
    match (p.api, matchers) {
        (HistoryApi::QueryRange, _) => Ok(None),
        (HistoryApi::RemoteRead, _) if reduced => Err(HistoryError::Config(
            "history.prometheus.api: remote_read reads raw samples; it cannot be combined with `downsample` (use `auto` or `query_range`)".into(),
        )),
        (HistoryApi::RemoteRead, Some(m)) => {
            match remote_read::rules(client, &p.url, &labels, &m).await {
                Ok(rules) => Ok(Some((m, rules))),
                Err(remote_read::Refusal::Unreachable(message)) => Err(HistoryError::Unavailable {
                    url: p.url.clone(),
                    attempts: 1,
                    source: RequestFailure::Settings(message),
                }),
                Err(remote_read::Refusal::Final(why)) => Err(HistoryError::Config(format!(
                    "history.prometheus.api: remote_read cannot give what query_range would: {why} (use `auto` or `query_range`)"
                ))),
            }
        }
        (HistoryApi::RemoteRead, None) => Err(HistoryError::Config(format!(
            "history.prometheus.api: remote_read needs `query` to be a plain selector (a metric name, or a non-empty `=` matcher, with label matchers), not `{}`",
            p.query
        ))),
        (HistoryApi::Auto, Some(_)) if reduced => Ok(None),
        (HistoryApi::Auto, None) => Ok(None),
        (HistoryApi::Auto, Some(m)) => {
            let url = remote_read::endpoint(&p.url);
            let no = |why: &dyn std::fmt::Display| {
                tracing::info!(url, %why, "no remote read here: pulling with query_range");
            };
            match remote_read::probe(client, &url, &m, last_step * 1000).await {
                Ok(()) => match remote_read::rules(client, &p.url, &labels, &m).await {
                    Ok(rules) => return Ok(Some((m, rules))),
                    Err(r) => no(&r.why()),
                },
                Err(why) => no(&why),
            }
            Ok(None)
        }
    }
}

/// A progress bar over the pull's chunks on a terminal (stderr); hidden otherwise, so that
/// logs and pipes stay clean.
fn progress_bar(chunks: u64) -> indicatif::ProgressBar {
    use std::io::IsTerminal;
    if !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let pb = indicatif::ProgressBar::new(chunks);
    pb.set_style(
        indicatif::ProgressStyle::with_template(
            "pulling history {bar:30} {pos}/{len} chunks, {elapsed} (eta {eta})",
        )
        .expect("static template"),
    );
    pb
}

/// Pulls one chunk `[from, to]` at `step` and puts its samples on the grid as they arrive.
async fn fetch(
    client: &reqwest::Client,
    url: &str,
    p: &PrometheusConfig,
    (from, to, step): (i64, i64, i64),
    b: &Arc<Mutex<Builder>>,
    budget: &Budget,
) -> Result<(), HistoryError> {
    let form = [
        ("query", p.query.clone()),
        ("start", from.to_string()),
        ("end", to.to_string()),
        ("step", format!("{step}s")),
    ];
    let mut tries = Tries::new(p, url);
    loop {
        let req = client.post(url).form(&form);
        match fetch_once(req, p, (from, to, step), b, budget).await {
            Ok(()) => return Ok(()),
            Err(failed) => tries.after(failed).await?,
        }
    }
}

/// One attempt of [`fetch`]: sends `req` and reads its answer onto the grid.
async fn fetch_once(
    req: reqwest::RequestBuilder,
    p: &PrometheusConfig,
    (from, to, step): (i64, i64, i64),
    b: &Arc<Mutex<Builder>>,
    budget: &Budget,
) -> Result<(), Failed> {
    let resp = send(req, p).await.map_err(Failed::Retry)?;
    let status = resp.status();
    let streamed = if status.is_success() {
        let points = ((to - from) / step + 1) as usize;
        stream_into(resp, b.clone(), points, budget).await
    } else {
        read_capped(resp, ERROR_BODY_MAX)
            .await
            .map(|body| (body, Ok(())))
            .map_err(ReadError::Http)
    };
    match streamed {
        Ok((skeleton, fed)) => judge(p, (from, to), status, &skeleton, fed),
        Err(ReadError::Http(e)) => Err(Failed::Retry(read_failed(e, p))),
        Err(ReadError::Exceeded(bound)) => Err(Failed::Fatal(HistoryError::Exceeded {
            url: p.url.clone(),
            request: request_range("query_range", from, to),
            bound,
        })),
    }
}

/// What the envelope of an answer to `[from, to]` (the whole body without the series of
/// `data.result`) and its `status` say of the attempt, the series having been decoded or not
/// (`fed`).
fn judge(
    p: &PrometheusConfig,
    (from, to): (i64, i64),
    status: reqwest::StatusCode,
    skeleton: &[u8],
    fed: Result<(), ParseError>,
) -> Result<(), Failed> {
    let parse = |source| {
        Failed::Fatal(HistoryError::Parse {
            what: format!("response of {} for [{from}, {to}]", p.url),
            source,
        })
    };
    let refused = |error_type, error| {
        Failed::Fatal(HistoryError::Refused {
            url: p.url.clone(),
            status: status.as_u16(),
            error_type,
            error,
        })
    };
    let head = || String::from_utf8_lossy(&skeleton[..skeleton.len().min(200)]);
    match serde_json::from_slice::<Envelope>(skeleton) {
        // A partial answer could lower quotas: retry, then fail.
        Ok(r) if status.is_success() && r.is_partial => Err(Failed::Retry(RequestFailure::Partial)),
        Ok(r) if status.is_success() && r.status == "success" => {
            fed.map_err(&parse)?;
            match r.data {
                None => Err(parse(ParseError::SuccessWithoutData)),
                Some(d) if d.result_type != "matrix" => {
                    Err(parse(ParseError::NotMatrix(d.result_type)))
                }
                Some(_) => Ok(()),
            }
        }
        Ok(r) if status.as_u16() == 400 || status.as_u16() == 422 => Err(refused(
            r.error_type.unwrap_or_default(),
            r.error.unwrap_or_default(),
        )),
        Ok(r) => Err(Failed::Retry(RequestFailure::Status {
            status,
            error_type: r.error_type.unwrap_or_default(),
            error: r.error.unwrap_or_default(),
        })),
        Err(e) if status.is_client_error() && status.as_u16() != 429 => {
            Err(refused("http".into(), format!("{}: {e}", head())))
        }
        Err(source) => Err(Failed::Retry(RequestFailure::UnreadableBody {
            status,
            source,
            body: head().into_owned(),
        })),
    }
}

/// At most this much of a success answer outside `data.result` (envelope, warnings).
const SKELETON_MAX: usize = 1 << 20;
/// The text of one point of a series at most: `[1796096640.123,"-1.2345678901234567e-308"],`
/// takes 45 bytes written compactly (Prometheus and VictoriaMetrics write them so).
const POINT_TEXT_MAX: usize = 64;

/// Why a `query_range` decoder stopped taking series.
#[derive(Debug)]
enum Stop {
    /// A series could not be parsed: the rest of the answer is read (its envelope says
    /// whether the answer is partial, and so worth a retry).
    Parse(serde_json::Error),
    /// A bound was crossed: nothing more is read.
    Exceeded(Bound),
}

/// Streams a success answer through a [`ResultSplitter`] on a blocking thread, which puts each
/// series on the grid; returns the envelope (the body without the series) and whether every
/// series could be decoded. A series has at most `points` points.
async fn stream_into(
    resp: reqwest::Response,
    b: Arc<Mutex<Builder>>,
    points: usize,
    budget: &Budget,
) -> Result<(Vec<u8>, Result<(), ParseError>), ReadError> {
    struct Decoder {
        split: ResultSplitter,
        failed: Option<Stop>,
        b: Arc<Mutex<Builder>>,
    }
    let push = |d: &mut Decoder, piece: &[u8]| {
        match d.failed {
            Some(Stop::Exceeded(_)) => return ControlFlow::Break(()),
            // Drain, so that the reader finishes and the envelope can be read.
            Some(Stop::Parse(_)) => return ControlFlow::Continue(()),
            None => {}
        }
        let (b, failed) = (&d.b, &mut d.failed);
        let split = d.split.push(piece, &mut |series| {
            if failed.is_none() {
                if let Err(e) = feed_series(b, series) {
                    *failed = Some(e);
                }
            }
        });
        if let Err(bound) = split {
            d.failed = Some(Stop::Exceeded(bound));
        } else if d.split.skeleton.len() > SKELETON_MAX {
            d.failed = Some(Stop::Exceeded(Bound::Envelope(SKELETON_MAX)));
        }
        match d.failed {
            Some(Stop::Exceeded(_)) => ControlFlow::Break(()),
            _ => ControlFlow::Continue(()),
        }
    };
    let finish = |d: Decoder| match d.failed {
        Some(Stop::Exceeded(bound)) => Err(ReadError::Exceeded(bound)),
        Some(Stop::Parse(e)) => Ok((d.split.skeleton, Err(e.into()))),
        None => {
            let fed = d.split.finish();
            Ok((d.split.skeleton, fed))
        }
    };
    let d = Decoder {
        split: ResultSplitter::bounded(points),
        failed: None,
        b,
    };
    match stream_blocking(resp, d, push, budget).await? {
        Ok(d) => finish(d),
        Err(e) => Ok((Vec::new(), Err(e.into()))),
    }
}

/// Parses one element of `data.result` and puts its samples on the grid.
fn feed_series(b: &Mutex<Builder>, text: &[u8]) -> Result<(), Stop> {
    let m: Matrix<'_> = serde_json::from_slice(text).map_err(Stop::Parse)?;
    let mut b = b.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(key) = b.key(&m.metric) {
        b.add_many(
            &key,
            m.values
                .iter()
                .map(|(ts, v)| (*ts, v.parse::<f64>().unwrap_or(f64::NAN))),
        );
    }
    match b.exceeded() {
        Some(bound) => Err(Stop::Exceeded(bound.clone())),
        None => Ok(()),
    }
}

/// Decodes whole answers as a pull does, for `benches/history_decode.rs`.
#[doc(hidden)]
pub mod bench {
    use super::*;

    /// Splits `body` into its series and drops them; returns how many there were.
    pub fn split(body: &[u8]) -> usize {
        let mut n = 0;
        let mut split = ResultSplitter::default();
        split.push(body, &mut |_| n += 1).unwrap();
        n
    }

    /// Puts the series of `bodies` (answers on the grid `start`, `step`, `len`) on a grid in
    /// memory as a pull does; returns how many series it holds.
    pub fn decode(bodies: &[Vec<u8>], start: i64, step: i64, len: usize) -> usize {
        let b = Mutex::new(Builder::new(
            start,
            step,
            len,
            super::super::LabelNames::default(),
        ));
        for body in bodies {
            let mut split = ResultSplitter::default();
            split
                .push(body, &mut |s| feed_series(&b, s).unwrap())
                .unwrap();
            split.finish().unwrap();
        }
        b.into_inner().unwrap().finish().series.len()
    }
}

/// Cuts a `query_range` answer, fed in pieces of any size, into the elements of
/// `data.result` (each handed over whole, as JSON text) and the rest of the body, the
/// *skeleton*, which keeps `"result":[]` and is small. Only the JSON structure is tracked
/// (strings, escapes, nesting, the keys on the way to `data.result`); the elements are parsed
/// by whoever receives them. An element longer than [`ResultSplitter::bounded`] allows is an
/// error, so that what is held per answer stays bounded whatever the answer.
#[derive(Default)]
pub(crate) struct ResultSplitter {
    /// Everything but the elements of `data.result`.
    pub skeleton: Vec<u8>,
    /// The element being collected.
    element: Vec<u8>,
    /// Open containers.
    depth: usize,
    in_string: bool,
    escaped: bool,
    /// Inside `data.result` (its `[` seen, its `]` not yet).
    in_result: bool,
    /// The last string seen at depth 1 and 2 (a key once its `:` follows), short ones only.
    string: Vec<u8>,
    /// The current key at depth 1 and 2.
    keys: [Vec<u8>; 3],
    /// Whether the last string at depth ≤ 2 is still being read.
    capture: bool,
    /// Bytes an element may take at most, and the points that makes room for (0: unbounded).
    element_max: usize,
    points: usize,
}

impl ResultSplitter {
    /// A splitter for an answer whose series have at most `points` points each: an element
    /// may take the labels' bound and `points` points of the longest form.
    pub(crate) fn bounded(points: usize) -> Self {
        ResultSplitter {
            element_max: LABELS_MAX + points.saturating_mul(POINT_TEXT_MAX),
            points,
            ..Default::default()
        }
    }

    /// Checks that an element of `len` bytes is within the bound.
    fn within(&self, len: usize) -> Result<(), Bound> {
        if self.element_max > 0 && len > self.element_max {
            return Err(Bound::SeriesText {
                max: self.element_max,
                points: self.points,
            });
        }
        Ok(())
    }

    /// Takes the next piece of the body; `on_element` gets each complete element. An element
    /// over the bound is an error, and the splitter must not be used after it.
    pub(crate) fn push(
        &mut self,
        piece: &[u8],
        on_element: &mut dyn FnMut(&[u8]),
    ) -> Result<(), Bound> {
        let mut start = 0; // of the run of bytes not yet copied where they belong
        let mut i = 0;
        while i < piece.len() {
            // Skips what cannot change the state: in a string not being captured, all but a
            // quote or backslash; inside an element (depth > 3), all but quotes and brackets.
            // (Most of an answer: the samples.)
            if self.in_string && !self.escaped && !self.capture {
                match piece[i..].iter().position(|&c| c == b'"' || c == b'\\') {
                    Some(k) => i += k,
                    None => break,
                }
            } else if !self.in_string && self.depth > 3 {
                let structural = |&c: &u8| matches!(c, b'"' | b'{' | b'}' | b'[' | b']');
                match piece[i..].iter().position(structural) {
                    Some(k) => i += k,
                    None => break,
                }
            }
            let c = piece[i];
            if self.in_string {
                if self.escaped {
                    self.escaped = false;
                } else if c == b'\\' {
                    self.escaped = true;
                } else if c == b'"' {
                    self.in_string = false;
                    self.capture = false;
                }
                if self.capture && self.in_string && self.string.len() < 64 {
                    self.string.push(c);
                }
                i += 1;
                continue;
            }
            match c {
                b'"' => {
                    self.in_string = true;
                    if self.depth <= 2 {
                        self.capture = true;
                        self.string.clear();
                    }
                }
                b':' if self.depth <= 2 => {
                    self.keys[self.depth] = std::mem::take(&mut self.string);
                }
                b'{' | b'[' => {
                    if self.depth == 2
                        && c == b'['
                        && self.keys[1] == b"data"
                        && self.keys[2] == b"result"
                    {
                        // The `[` of data.result goes to the skeleton; what follows does not.
                        self.skeleton.extend_from_slice(&piece[start..=i]);
                        start = i + 1;
                        self.in_result = true;
                    }
                    self.depth += 1;
                }
                b'}' | b']' => {
                    self.depth = self.depth.saturating_sub(1);
                    if self.in_result && self.depth == 3 {
                        // An element closes: hand it over whole.
                        self.within(self.element.len() + i + 1 - start)?;
                        self.element.extend_from_slice(&piece[start..=i]);
                        start = i + 1;
                        on_element(&self.element);
                        self.element.clear();
                    } else if self.in_result && self.depth == 2 {
                        // The `]` of data.result: back to the skeleton.
                        self.in_result = false;
                        self.element.clear();
                        start = i;
                    }
                }
                b',' if self.in_result && self.depth == 3 => {
                    start = i + 1; // between elements
                }
                _ => {}
            }
            i += 1;
        }
        let rest = &piece[start..];
        if self.in_result {
            if self.depth > 3 {
                self.within(self.element.len() + rest.len())?;
                self.element.extend_from_slice(rest);
            }
        } else {
            self.skeleton.extend_from_slice(rest);
        }
        Ok(())
    }

    /// Checks that the body ended where a JSON document can end.
    pub(crate) fn finish(&self) -> Result<(), ParseError> {
        if self.depth != 0 || self.in_string {
            return Err(ParseError::Unfinished(self.depth));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use schema::LabelNames;

    /// Two chunks of one pull: a series in both (duplicate across chunks), a missing step, `NaN`
    /// and `+Inf` as Prometheus writes them, `values` before `metric`, label values with JSON
    /// structure and escapes in them, and the envelope around `data.result`.
    const CHUNKS: [&str; 2] = [
        r#"{"status":"success","data":{"resultType":"matrix","result":[
  {"metric":{"service":"shop","caller":"web","procedure":"browse"},"values":[[1000,"1.5"],[1060,"2"],[1180,"4.25"]]},
  {"values":[[1000,"3"],[1120,"3.5"]],"metric":{"service":"shop","caller":"api"}},
  {"metric":{"service":"pay","caller":"we{b}[\"x\\","procedure":"a"},"values":[[1000,"1"]]},
  {"metric":{"service":"pay","caller":"bad"},"values":[[1000,"NaN"],[1060,"1"]]},
  {"metric":{"service":"pay","caller":"inf"},"values":[[1060,"+Inf"]]},
  {"metric":{"caller":"nobody"},"values":[[1000,"1"]]}
 ]},"warnings":["a warning with ] and } in it"]}"#,
        r#"{"status" : "success" , "data" : { "result" : [ {"metric":{"service":"shop","caller":"web","procedure":"browse"},"values":[[1240,"5"],[1300,"0.125"]]} ,
 {"metric":{"service":"ship","procedure":"track"},"values":[[1300,"7"]]} ] , "resultType" : "matrix" } }"#,
    ];

    fn builder() -> Builder {
        Builder::new(1000, 60, 6, LabelNames::default())
    }

    fn old_path() -> History {
        let mut b = builder();
        for body in CHUNKS {
            let r: Response<'_> = serde_json::from_str(body).unwrap();
            feed(&mut b, &r.data.unwrap()).unwrap();
        }
        b.finish()
    }

    fn streamed(piece: usize) -> (History, Vec<Envelope>) {
        let b = Mutex::new(builder());
        let mut envelopes = Vec::new();
        for body in CHUNKS {
            let mut split = ResultSplitter::default();
            for p in body.as_bytes().chunks(piece) {
                split.push(p, &mut |s| feed_series(&b, s).unwrap()).unwrap();
            }
            split.finish().unwrap();
            envelopes.push(serde_json::from_slice(&split.skeleton).unwrap());
        }
        (b.into_inner().unwrap().finish(), envelopes)
    }

    fn bits(h: &History) -> Vec<(SeriesKey, Vec<u32>)> {
        h.series
            .iter()
            .map(|(k, s)| (k.clone(), s.values.iter().map(|v| v.to_bits()).collect()))
            .collect()
    }

    use super::super::SeriesKey;

    #[test]
    fn streamed_answers_give_the_series_of_whole_answers() {
        let old = old_path();
        assert_eq!(old.series.len(), 3, "{:?}", old.series.keys());
        let web = &old.series[&SeriesKey {
            service: "shop".into(),
            caller: Some("web".into()),
            procedure: Some("browse".into()),
        }];
        assert_eq!(web.values[..2], [1.5, 2.0]);
        assert!(web.values[2].is_nan());
        assert_eq!(web.values[3..], [4.25, 5.0, 0.125]);
        assert_eq!(old.rejected.len(), 4, "{:?}", old.rejected);
        for piece in [1, 2, 3, 7, 64, 100_000] {
            let (new, envelopes) = streamed(piece);
            assert_eq!(bits(&new), bits(&old), "pieces of {piece} bytes");
            assert_eq!(new.rejected, old.rejected, "pieces of {piece} bytes");
            for e in envelopes {
                assert_eq!(e.status, "success");
                assert!(!e.is_partial);
                assert_eq!(e.data.unwrap().result_type, "matrix");
            }
        }
    }

    /// The chunks streamed into a spilled builder under `dir`; `repeat` feeds the first half
    /// of the first answer once more first (a request cut and retried).
    fn spilled(dir: &std::path::Path, piece: usize, repeat: bool) -> SpilledHistory {
        let b = Mutex::new(Builder::spilled(1000, 60, 6, LabelNames::default(), dir).unwrap());
        if repeat {
            let mut split = ResultSplitter::default();
            split
                .push(&CHUNKS[0].as_bytes()[..CHUNKS[0].len() / 2], &mut |s| {
                    feed_series(&b, s).unwrap()
                })
                .unwrap();
        }
        for body in CHUNKS {
            let mut split = ResultSplitter::default();
            for p in body.as_bytes().chunks(piece) {
                split.push(p, &mut |s| feed_series(&b, s).unwrap()).unwrap();
            }
            split.finish().unwrap();
        }
        b.into_inner().unwrap().finish_spilled().unwrap()
    }

    #[test]
    fn a_spilled_pull_reads_back_the_series_of_one_in_memory() {
        let old = old_path();
        let dir = tempfile::tempdir().unwrap();
        for (piece, repeat) in [(1, false), (7, true), (100_000, false), (100_000, true)] {
            let s = spilled(dir.path(), piece, repeat);
            assert_eq!(s.series_count(), old.series.len());
            assert_eq!(s.rejected, old.rejected, "pieces of {piece} bytes");
            assert_eq!((s.start, s.step, s.len), (old.start, old.step, old.len));
            let whole = s.to_history().unwrap();
            assert_eq!(
                bits(&whole),
                bits(&old),
                "pieces of {piece}, retried {repeat}"
            );
            assert_eq!(whole.rejected, old.rejected);
            assert_eq!(s.services(), old.services());
            // One service at a time: its series, nothing else.
            for svc in old.services() {
                let one = s.service(&svc).unwrap();
                let want: Vec<_> = bits(&old)
                    .into_iter()
                    .filter(|(k, _)| k.service == svc)
                    .collect();
                assert_eq!(bits(&one), want, "service {svc}");
                assert!(one.rejected.is_empty() && one.source_error.is_none());
            }
            assert!(s.service("nobody").unwrap().series.is_empty());
            // The spill lives in a directory of its own, removed with the history.
            let spill_dir = s.path().parent().unwrap().to_path_buf();
            assert!(spill_dir.starts_with(dir.path()), "{spill_dir:?}");
            assert!(s.path().is_file());
            drop(s);
            assert!(!spill_dir.exists(), "{spill_dir:?} removed on drop");
        }
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);

        // A spill cut under the history: reading a service fails, naming the file and series.
        let s = spilled(dir.path(), 100_000, false);
        std::fs::File::options()
            .write(true)
            .open(s.path())
            .unwrap()
            .set_len(8)
            .unwrap();
        let e = s.service("shop").unwrap_err();
        assert!(
            matches!(e, super::super::DiskError::ReadSpill { .. }),
            "{e}"
        );
        let e = e.to_string();
        assert!(
            e.contains(&s.path().display().to_string()) && e.contains("shop"),
            "{e}"
        );
    }

    #[test]
    fn a_dropped_spilled_builder_removes_its_file() {
        let dir = tempfile::tempdir().unwrap();
        let b =
            Mutex::new(Builder::spilled(1000, 60, 6, LabelNames::default(), dir.path()).unwrap());
        let mut split = ResultSplitter::default();
        split
            .push(CHUNKS[0].as_bytes(), &mut |s| feed_series(&b, s).unwrap())
            .unwrap();
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        // A failed pull drops its builder, on an error or a panic (unwinding).
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let _b = b;
            panic!("a decoder panics");
        }));
        assert!(r.is_err());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);

        // A spill directory that cannot be created: a clear error naming it.
        let file = dir.path().join("a-file");
        std::fs::write(&file, "x").unwrap();
        let e = Builder::spilled(1000, 60, 6, LabelNames::default(), &file.join("sub"))
            .err()
            .unwrap();
        assert!(matches!(e, HistoryError::Spill { .. }), "{e}");
        assert!(e.to_string().contains("a-file"), "{e}");
    }

    #[test]
    fn the_skeleton_keeps_the_envelope_without_the_series() {
        let mut split = ResultSplitter::default();
        let mut n = 0;
        split.push(CHUNKS[0].as_bytes(), &mut |_| n += 1).unwrap();
        split.finish().unwrap();
        assert_eq!(n, 6);
        let text = String::from_utf8(split.skeleton).unwrap();
        assert!(text.contains(r#""result":[]"#), "{text}");
        assert!(text.contains("a warning with ] and } in it"), "{text}");
        assert!(!text.contains("shop"), "{text}");

        let mut split = ResultSplitter::default();
        split.push(
            br#"{"status":"success","isPartial":true,"data":{"resultType":"matrix","result":[]}}"#,
            &mut |_| n += 1,
        )
        .unwrap();
        let e: Envelope = serde_json::from_slice(&split.skeleton).unwrap();
        assert!(e.is_partial);
    }

    #[test]
    fn a_cut_answer_is_an_error() {
        let body = CHUNKS[0].as_bytes();
        let mut split = ResultSplitter::default();
        let mut n = 0;
        split
            .push(&body[..body.len() / 2], &mut |_| n += 1)
            .unwrap();
        assert!(matches!(split.finish(), Err(ParseError::Unfinished(_))));
        assert!(n < 6);
    }

    /// A series whose values never end, one whose labels never end, and one nested without
    /// end: each is refused once its text passes what `points` points and labels can take,
    /// having held no more than that.
    #[test]
    fn a_series_longer_than_its_points_can_be_is_refused() {
        let points = 720;
        let max = LABELS_MAX + points * POINT_TEXT_MAX;
        let head = r#"{"status":"success","data":{"resultType":"matrix","result":[{"metric":{"service":"a","#;
        for (start, endless) in [
            (r#""caller":"b"},"values":["#, r#"[1796096640,"1.5"],"#),
            (r#""caller":""#, "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"),
            (
                r#""caller":"b"},"values":"#,
                "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[",
            ),
        ] {
            let mut split = ResultSplitter::bounded(points);
            split
                .push(format!("{head}{start}").as_bytes(), &mut |_| panic!())
                .unwrap();
            let piece = endless.repeat(1000);
            let mut fed = 0;
            let e = loop {
                match split.push(piece.as_bytes(), &mut |_| panic!("no element ends")) {
                    Ok(()) => fed += piece.len(),
                    Err(e) => break e,
                }
            };
            assert_eq!(e, Bound::SeriesText { max, points }, "{endless}");
            assert!(fed <= max, "{endless}: {fed} bytes taken");
            assert!(split.element.capacity() <= 2 * max, "{endless}");
        }

        // The longest a real series can be: 720 points of the longest form and 1 KB of
        // labels, cut anywhere.
        let labels: String = (0..40)
            .map(|i| format!(r#""label_{i:02}":"{}","#, "v".repeat(12)))
            .collect();
        let values = vec![r#"[1796096640.123,"-1.2345678901234567e-308"]"#; points].join(",");
        let body = format!(
            r#"{{"status":"success","data":{{"resultType":"matrix","result":[{{"metric":{{{labels}"service":"a"}},"values":[{values}]}}]}}}}"#
        );
        for piece in [1, 7, 4096, body.len()] {
            let mut split = ResultSplitter::bounded(points);
            let mut n = 0;
            for p in body.as_bytes().chunks(piece) {
                split.push(p, &mut |_| n += 1).unwrap();
            }
            split.finish().unwrap();
            assert_eq!(n, 1);
        }
    }
}
