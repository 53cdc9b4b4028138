//! History from a Prometheus-compatible HTTP API (Prometheus, VictoriaMetrics).
//!
//! The lookback is split into time chunks of at most `max_points` steps (and at most
//! [`CHUNK_STEPS`], so one response stays a few hundred MB even with 10,000 series) and pulled
//! by POST to `/api/v1/query_range` with form-encoded parameters, `concurrency` requests at a
//! time, each with a timeout and up to `retries` attempts separated by jittered exponential
//! backoff. An answer Prometheus would repeat (HTTP 400/422: bad query, too many points) is not
//! retried and is reported as [`HistoryError::Refused`].

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use rand::Rng;
use schema::{HistoryConfig, PrometheusConfig};
use serde::Deserialize;
use tokio::sync::Semaphore;

use super::{grid, Builder, History, HistoryError};

/// Upper bound on steps per request: 12 h at 1 m.
pub const CHUNK_STEPS: u32 = 720;
const BACKOFF_BASE: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

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
}

/// Feeds a parsed response into the builder.
pub(crate) fn feed(b: &mut Builder, data: &Data<'_>) -> Result<(), String> {
    if data.result_type != "matrix" {
        return Err(format!(
            "expected a matrix result, got `{}`",
            data.result_type
        ));
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
    let raw_step = h.step.as_secs() as i64;
    let (query, h) = match p.downsample {
        Some(d) if d.as_secs() > h.step.as_secs() => {
            let mut h = h.clone();
            let q = format!("max_over_time(({})[{d}:{}])", p.query, h.step);
            h.step = d;
            (q, h)
        }
        _ => (p.query.clone(), h.clone()),
    };
    let p = &PrometheusConfig { query, ..p.clone() };
    // Downsampled, the point at `t` is the maximum over `(t - step, t]`: the last point is the
    // first multiple of `step` at or after the last raw point, so the freshest raw minutes
    // are in the history too (a grid ending before them would drop up to two steps of them).
    let grid_end = if h.step.as_secs() as i64 > raw_step {
        let last_raw = end.timestamp().div_euclid(raw_step) * raw_step - raw_step;
        last_raw + 2 * h.step.as_secs() as i64 - 1
    } else {
        end.timestamp()
    };
    let (start, step, len) = grid(&h, grid_end);
    // Bound the samples Prometheus evaluates per request too (its `query.max-samples`): with
    // server-side reduction, one output point costs `downsample ÷ step` inner steps.
    let inner_per_point = (step / raw_step.max(1)).max(1) as usize;
    let per_chunk = (p.max_points.clamp(2, CHUNK_STEPS) as usize / inner_per_point).max(1);
    let client = reqwest::Client::builder()
        .timeout(p.timeout.0)
        .build()
        .map_err(|e| HistoryError::Unavailable {
            url: p.url.clone(),
            attempts: 0,
            message: e.to_string(),
        })?;
    let url = format!("{}/api/v1/query_range", p.url.trim_end_matches('/'));
    let sem = Arc::new(Semaphore::new(p.concurrency.max(1) as usize));
    let builder = Arc::new(Mutex::new(Builder::new(start, step, len, p.labels.clone())));
    let mut tasks = tokio::task::JoinSet::new();
    let mut i = 0;
    while i < len {
        let n = per_chunk.min(len - i);
        let (from, to) = (start + i as i64 * step, start + (i + n - 1) as i64 * step);
        let (client, url, sem, p, b) = (
            client.clone(),
            url.clone(),
            sem.clone(),
            p.clone(),
            builder.clone(),
        );
        tasks.spawn(async move {
            let _permit = sem.acquire_owned().await.expect("semaphore never closed");
            let body = fetch(&client, &url, &p, from, to, step).await?;
            // Parse and feed on a blocking thread; the body is dropped as soon as its samples
            // are on the grid, so memory stays bounded by `concurrency` responses.
            tokio::task::spawn_blocking(move || {
                let r: Response<'_> = serde_json::from_slice(&body).map_err(|e| e.to_string())?;
                let data = r.data.ok_or_else(|| "success without data".to_string())?;
                feed(&mut b.lock().unwrap_or_else(|e| e.into_inner()), &data)
            })
            .await
            .map_err(|e| e.to_string())
            .and_then(|r| r)
            .map_err(|message| HistoryError::Parse {
                what: format!("response of {}", p.url),
                message,
            })
        });
        i += n;
    }
    tracing::info!(url = %p.url, chunks = tasks.len(), series_points = len, step, "pulling history");
    let progress = progress_bar(tasks.len() as u64);
    let mut first_err = None;
    while let Some(r) = tasks.join_next().await {
        progress.inc(1);
        match r {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                // One failed chunk fails the pull: a partial history could lower quotas.
                tasks.abort_all();
                first_err.get_or_insert(e);
            }
            Err(e) if e.is_cancelled() => {}
            Err(e) => {
                first_err.get_or_insert(HistoryError::Unavailable {
                    url: p.url.clone(),
                    attempts: 0,
                    message: e.to_string(),
                });
            }
        }
    }
    progress.finish_and_clear();
    if let Some(e) = first_err {
        return Err(e);
    }
    let b = Arc::try_unwrap(builder).map_err(|_| HistoryError::Parse {
        what: "history".into(),
        message: "a chunk task outlived the pull".into(),
    })?;
    Ok(b.into_inner().unwrap_or_else(|e| e.into_inner()).finish())
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

async fn fetch(
    client: &reqwest::Client,
    url: &str,
    p: &PrometheusConfig,
    from: i64,
    to: i64,
    step: i64,
) -> Result<Vec<u8>, HistoryError> {
    let form = [
        ("query", p.query.clone()),
        ("start", from.to_string()),
        ("end", to.to_string()),
        ("step", format!("{step}s")),
    ];
    let attempts = p.retries.max(1);
    let mut last = String::new();
    for attempt in 1..=attempts {
        if attempt > 1 {
            let cap = BACKOFF_BASE
                .saturating_mul(1 << (attempt - 2).min(10))
                .min(BACKOFF_MAX);
            let wait = rand::thread_rng().gen_range(cap / 2..=cap);
            tracing::warn!(url, attempt, wait_ms = wait.as_millis() as u64, error = %last, "retrying query_range");
            tokio::time::sleep(wait).await;
        }
        let resp = match client.post(url).form(&form).send().await {
            Ok(r) => r,
            Err(e) => {
                last = if e.is_timeout() {
                    format!("request failed: timed out after {}", p.timeout)
                } else {
                    format!("request failed: {}", chain(&e))
                };
                continue;
            }
        };
        let status = resp.status();
        let body = match resp.bytes().await {
            Ok(b) => b,
            Err(e) => {
                last = if e.is_timeout() {
                    format!("reading the response failed: timed out after {}", p.timeout)
                } else {
                    format!("reading the response failed: {}", chain(&e))
                };
                continue;
            }
        };
        // Only the envelope is looked at here; values are parsed once, when fed.
        let parsed: Result<Envelope, _> = serde_json::from_slice(&body);
        match parsed {
            Ok(r) if status.is_success() && r.is_partial => {
                // A partial answer could lower quotas: retry, then fail.
                last = "partial response (isPartial: some storage nodes did not answer)".into();
            }
            Ok(r) if status.is_success() && r.status == "success" => {
                drop(r);
                return Ok(body.into());
            }
            Ok(r) if status.as_u16() == 400 || status.as_u16() == 422 => {
                return Err(HistoryError::Refused {
                    url: p.url.clone(),
                    status: status.as_u16(),
                    error_type: r.error_type.unwrap_or_default(),
                    error: r.error.unwrap_or_default(),
                })
            }
            Ok(r) => {
                last = format!(
                    "HTTP {status}: {} {}",
                    r.error_type.unwrap_or_default(),
                    r.error.unwrap_or_default()
                );
            }
            Err(e) if status.is_client_error() && status.as_u16() != 429 => {
                return Err(HistoryError::Refused {
                    url: p.url.clone(),
                    status: status.as_u16(),
                    error_type: "http".into(),
                    error: format!(
                        "{}: {e}",
                        String::from_utf8_lossy(&body[..body.len().min(200)])
                    ),
                })
            }
            Err(e) => {
                last = format!(
                    "HTTP {status}, unreadable body ({e}): {}",
                    String::from_utf8_lossy(&body[..body.len().min(200)])
                );
            }
        }
    }
    Err(HistoryError::Unavailable {
        url: p.url.clone(),
        attempts,
        message: last,
    })
}

/// An error with its causes (reqwest hides "connection refused" in the source chain).
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}
