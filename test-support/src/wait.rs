//! Waiting for what a test started: polls with a generous bound, a hang guard rather than a
//! speed assertion.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

/// How long [`eventually`] and [`wait_up`] wait.
pub const BOUND: Duration = Duration::from_secs(30);

/// Polls `check` every 50 ms until it holds; fails naming `what` after [`BOUND`].
pub async fn eventually<F, Fut>(what: &str, check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    eventually_within(what, BOUND, check).await
}

/// [`eventually`] with another bound.
pub async fn eventually_within<F, Fut>(what: &str, bound: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let end = Instant::now() + bound;
    while !check().await {
        assert!(
            Instant::now() < end,
            "timed out after {bound:?} waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until `url` gives any HTTP answer (the server is up, whatever it says).
pub async fn wait_up(url: &str) {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .expect("an HTTP client");
    eventually(&format!("{url} up"), || {
        let (http, url) = (http.clone(), url.to_string());
        async move { http.get(&url).send().await.is_ok() }
    })
    .await
}
