//! Calls to other tiers: the answer read up to a bound, the cause of a failure in words
//! ([`crate::cause`]).

use serde::de::DeserializeOwned;

/// Why a call to another tier failed: the cause in words ([`crate::cause`]), or an answer too
/// large to read.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The request failed: the cause in words.
    #[error("{0}")]
    Failed(String),
    /// No connection to the peer could be made: the request was never sent.
    #[error("{0}")]
    Unreached(String),
    /// The answer has an error status.
    #[error("{url}: answered {status}")]
    Status {
        /// Where the call went.
        url: String,
        /// The status.
        status: http::StatusCode,
    },
    /// The answer is larger than the caller reads.
    #[error("{url}: answer larger than {limit} bytes")]
    TooLarge {
        /// Where the call went.
        url: String,
        /// The bound.
        limit: usize,
    },
    /// The answer is not what was expected.
    #[error("{url}: unreadable answer: {reason}")]
    Unreadable {
        /// Where the call went.
        url: String,
        /// The decoder's message.
        reason: String,
    },
}

impl CallError {
    /// Whether the peer certainly did not act on the request: it was never sent, or the
    /// peer refused it with an error status (the tiers answer an error before applying
    /// anything). A timeout or a lost answer leaves it unknown.
    pub fn never_applied(&self) -> bool {
        matches!(self, CallError::Unreached(_) | CallError::Status { .. })
    }

    /// [`CallError::never_applied`] of an error that may hold a `CallError` in its chain.
    pub fn never_applied_any(e: &anyhow::Error) -> bool {
        e.chain()
            .find_map(|c| c.downcast_ref::<CallError>())
            .is_some_and(CallError::never_applied)
    }
}

/// Sends `req` and reads the answer's body, at most `limit` bytes: the cause of a failure is
/// named ([`crate::cause::describe`], `timeout` being the client's bound), an error status is
/// an error, and a larger answer is refused without being held.
pub async fn call(
    req: reqwest::RequestBuilder,
    timeout: std::time::Duration,
    limit: usize,
) -> Result<Answer, CallError> {
    let failed = |e: reqwest::Error| {
        let cause = crate::cause::describe(&e, timeout);
        if e.is_connect() {
            CallError::Unreached(cause)
        } else {
            CallError::Failed(cause)
        }
    };
    let resp = req.send().await.map_err(failed)?;
    let mut u = resp.url().clone();
    u.set_query(None);
    let url = u.to_string();
    let status = resp.status();
    if status.is_client_error() || status.is_server_error() {
        return Err(CallError::Status { url, status });
    }
    let headers = resp.headers().clone();
    let body = call_response(resp, timeout, limit).await?;
    Ok(Answer { url, headers, body })
}

/// Reads the body of `resp` (any status), at most `limit` bytes.
pub async fn call_response(
    mut resp: reqwest::Response,
    timeout: std::time::Duration,
    limit: usize,
) -> Result<bytes::Bytes, CallError> {
    let mut u = resp.url().clone();
    u.set_query(None);
    let url = u.to_string();
    if resp.content_length().is_some_and(|n| n > limit as u64) {
        return Err(CallError::TooLarge { url, limit });
    }
    let mut body = Vec::new();
    while let Some(chunk) = resp
        .chunk()
        .await
        .map_err(|e| CallError::Failed(crate::cause::describe(&e, timeout)))?
    {
        if body.len() + chunk.len() > limit {
            return Err(CallError::TooLarge { url, limit });
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body.into())
}

/// A successful answer read whole by [`call`].
#[derive(Debug)]
pub struct Answer {
    /// Where the call went.
    pub url: String,
    /// The answer's headers.
    pub headers: http::HeaderMap,
    /// The answer's body.
    pub body: bytes::Bytes,
}

impl Answer {
    /// The body parsed as JSON.
    pub fn json<T: DeserializeOwned>(&self) -> Result<T, CallError> {
        serde_json::from_slice(&self.body).map_err(|e| CallError::Unreadable {
            url: self.url.clone(),
            reason: e.to_string(),
        })
    }
}

/// Unix seconds now.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
