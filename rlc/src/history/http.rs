//! Reading an HTTP answer within bounds, shared by `query_range` ([`super::prometheus`]) and
//! remote read ([`super::remote_read`]): the pull's byte [`Budget`], sending with errors worded
//! for the pull, jittered backoff between tries, capped and streamed reads of a body.

use std::ops::ControlFlow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use schema::PrometheusConfig;

use super::{Bound, DecoderFailed, HistoryError, RequestFailure};

/// Between the tries of one history request.
const BACKOFF: crate::retry::Backoff = crate::retry::Backoff {
    min: Duration::from_millis(200),
    max: Duration::from_secs(5),
    attempts: None,
};

/// Sends a request ([`RequestFailure::Send`] when it fails or times out).
pub(super) async fn send(
    req: reqwest::RequestBuilder,
    p: &PrometheusConfig,
) -> Result<reqwest::Response, RequestFailure> {
    req.send().await.map_err(|source| RequestFailure::Send {
        source,
        timeout: p.timeout,
    })
}

/// A failure while reading an answer.
pub(super) fn read_failed(source: reqwest::Error, p: &PrometheusConfig) -> RequestFailure {
    RequestFailure::Read {
        source,
        timeout: p.timeout,
    }
}

/// How an attempt of a request that did not get its answer ends.
pub(super) enum Failed {
    /// Worth another attempt, if one is left: why this one failed.
    Retry(RequestFailure),
    /// Another attempt would fail the same way: the request fails now.
    GiveUp(RequestFailure),
    /// The pull fails with this at once.
    Fatal(HistoryError),
}

/// The attempts of one request: `history.prometheus.retries` at most, with jittered
/// exponential backoff between them.
pub(super) struct Tries<'a> {
    p: &'a PrometheusConfig,
    url: &'a str,
    /// The attempt made last, from 1.
    attempt: u32,
}

impl<'a> Tries<'a> {
    /// The attempts of a request to `url` (the first one being made).
    pub(super) fn new(p: &'a PrometheusConfig, url: &'a str) -> Self {
        Tries { p, url, attempt: 1 }
    }

    /// After an attempt that `failed`: waits for the next one, or gives the request's error
    /// when none is left or worth making ([`HistoryError::Unavailable`] with the last failure).
    pub(super) async fn after(&mut self, failed: Failed) -> Result<(), HistoryError> {
        let last = match failed {
            Failed::Fatal(e) => return Err(e),
            Failed::Retry(last) if self.attempt < self.p.retries.max(1) => last,
            Failed::Retry(last) | Failed::GiveUp(last) => {
                return Err(HistoryError::Unavailable {
                    url: self.p.url.clone(),
                    attempts: self.attempt,
                    source: last,
                })
            }
        };
        self.attempt += 1;
        backoff(self.url, self.attempt, &last).await;
        Ok(())
    }
}

/// Waits before attempt `attempt` (≥ 2) of a request to `url`: jittered exponential backoff.
async fn backoff(url: &str, attempt: u32, last_error: &RequestFailure) {
    let wait = BACKOFF.delay(attempt);
    tracing::warn!(url, attempt, wait_ms = wait.as_millis() as u64, error = %last_error, "retrying");
    tokio::time::sleep(wait).await;
}

/// At most this much of an error answer is kept (an HTML page from a proxy can be large).
pub(super) const ERROR_BODY_MAX: usize = 64 * 1024;

/// What a pull may still read: `max_response_bytes` per answer, `max_pull_bytes` in all
/// (every answer and every attempt of every request).
pub(crate) struct Budget {
    max_response: u64,
    max_pull: u64,
    read: AtomicU64,
}

impl Budget {
    pub(crate) fn new(p: &PrometheusConfig) -> Budget {
        Budget {
            max_response: p.max_response_bytes,
            max_pull: p.max_pull_bytes,
            read: AtomicU64::new(0),
        }
    }

    /// Bytes read so far.
    pub(crate) fn read(&self) -> u64 {
        self.read.load(Ordering::Relaxed)
    }

    /// Counts `n` more bytes of an answer that has now read `answer` bytes.
    pub(super) fn take(&self, answer: u64, n: u64) -> Result<(), Bound> {
        if answer > self.max_response {
            return Err(Bound::ResponseBytes(self.max_response));
        }
        if self.read.fetch_add(n, Ordering::Relaxed) + n > self.max_pull {
            return Err(Bound::PullBytes(self.max_pull));
        }
        Ok(())
    }
}

/// Why an answer could not be read whole.
#[derive(Debug)]
pub(super) enum ReadError {
    /// The connection failed or timed out (worth a retry).
    Http(reqwest::Error),
    /// A bound was crossed: the pull fails at once.
    Exceeded(Bound),
}
/// Network pieces queued between a request and its decoder (a piece is at most some 10s of
/// KB): what a request in flight holds besides one series' text.
const PIECES_IN_FLIGHT: usize = 16;

/// The first `max` bytes of a body.
pub(super) async fn read_capped(
    mut resp: reqwest::Response,
    max: usize,
) -> Result<Vec<u8>, reqwest::Error> {
    let mut body = Vec::new();
    while let Some(piece) = resp.chunk().await? {
        body.extend_from_slice(&piece[..piece.len().min(max - body.len())]);
        if body.len() >= max {
            break;
        }
    }
    Ok(body)
}

/// Hands the pieces of a body to `push` on a blocking thread as they arrive (at most
/// [`PIECES_IN_FLIGHT`] queued between them) and gives the decoder back once the whole body
/// was read, or once `push` said to stop (the decoder then knows why); `Err` if the body was
/// not read whole (nothing the decoder would only do at the end is done for a cut body) or
/// crossed a bound of `budget`; `Ok(Err(_))` when the decoder panicked.
pub(super) async fn stream_blocking<D: Send + 'static>(
    mut resp: reqwest::Response,
    mut decoder: D,
    push: fn(&mut D, &[u8]) -> ControlFlow<()>,
    budget: &Budget,
) -> Result<Result<D, DecoderFailed>, ReadError> {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<bytes::Bytes>(PIECES_IN_FLIGHT);
    let task = tokio::task::spawn_blocking(move || {
        while let Some(piece) = rx.blocking_recv() {
            if push(&mut decoder, &piece).is_break() {
                break; // `rx` dropped: the reader stops
            }
        }
        decoder
    });
    let mut read = Ok(());
    let mut answer = 0u64;
    loop {
        match resp.chunk().await {
            Ok(Some(piece)) => {
                answer += piece.len() as u64;
                if let Err(bound) = budget.take(answer, piece.len() as u64) {
                    read = Err(ReadError::Exceeded(bound));
                    break;
                }
                if tx.send(piece).await.is_err() {
                    break;
                }
            }
            Ok(None) => break,
            Err(e) => {
                read = Err(ReadError::Http(e));
                break;
            }
        }
    }
    drop(tx);
    let out = task.await.map_err(DecoderFailed);
    read.map(|()| out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each answer is counted against `max_response_bytes`, all of them together against
    /// `max_pull_bytes`.
    #[test]
    fn the_budget_bounds_an_answer_and_the_pull() {
        let b = Budget {
            max_response: 100,
            max_pull: 250,
            read: AtomicU64::new(0),
        };
        assert_eq!(b.take(60, 60), Ok(()));
        assert_eq!(b.take(100, 40), Ok(()));
        assert_eq!(b.take(101, 1), Err(Bound::ResponseBytes(100)));
        // A second answer, then a third that crosses the pull's bound.
        assert_eq!(b.take(100, 100), Ok(()));
        assert_eq!(b.take(51, 51), Err(Bound::PullBytes(250)));
    }
}
