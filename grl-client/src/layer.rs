//! `GrlLayer`: the GRL client as a tower layer for axum (or any tower/hyper) services, whatever
//! their response body type (one that can be made from a `&'static str`). State lives behind an
//! `Arc`, so every clone of the service (axum clones per request) shares one limiter; a dropped
//! request is answered from `call` with 429 and `Retry-After`, a shadow drop passes through.
//! Built with [`GrlLayer::for_client`], it also counts every request by (caller, procedure),
//! matched by a bucket or not, for `grl_calls_total` (the history RLC learns quotas from).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use grl_core::{Decision, Limiter};
use schema::Criticality;

use crate::concurrency::{ConcurrencyLimiter, Permit, Refused};
use crate::tiers::TierFrom;
use http::{HeaderName, HeaderValue, Request, Response, StatusCode};
use tower::{Layer, Service};

/// Where a request's caller or procedure comes from.
#[derive(Debug, Clone)]
pub enum KeyFrom {
    /// A header's value (empty when absent).
    Header(HeaderName),
    /// The URI path.
    Path,
    /// The path's `n`-th segment (0-based, empty when absent).
    PathSegment(usize),
    /// A constant.
    Fixed(String),
}

impl KeyFrom {
    fn extract<'a, B>(&'a self, req: &'a Request<B>) -> &'a str {
        match self {
            KeyFrom::Header(h) => req
                .headers()
                .get(h)
                .and_then(|v| v.to_str().ok())
                .unwrap_or(""),
            KeyFrom::Path => req.uri().path(),
            KeyFrom::PathSegment(n) => req
                .uri()
                .path()
                .split('/')
                .filter(|s| !s.is_empty())
                .nth(*n)
                .unwrap_or(""),
            KeyFrom::Fixed(s) => s,
        }
    }
}

/// The decide path of [`GrlLayer::decide_tier`] and of the layer's service: count, then
/// decide.
#[inline]
fn decide(cfg: &Config, caller: &str, procedure: &str, tier: Criticality) -> Decision {
    if let Some(c) = &cfg.calls {
        c.count(caller, procedure);
    }
    cfg.limiter.decide_tier(caller, procedure, tier)
}

/// `tier` held at `caller`'s cap in the bucket file.
fn capped(cfg: &Config, tier: Criticality, caller: &str) -> Criticality {
    match cfg.limiter.cap(caller) {
        Some(cap) => tier.capped(cap),
        None => tier,
    }
}

struct Config {
    limiter: Arc<Limiter>,
    calls: Option<Arc<crate::calls::CallCounter>>,
    caller: KeyFrom,
    procedure: KeyFrom,
    tiers: TierFrom,
    retry_after: HeaderValue,
    concurrency: Option<Arc<ConcurrencyLimiter>>,
}

/// A tower layer that decides every request with a GRL limiter.
#[derive(Clone)]
pub struct GrlLayer {
    cfg: Arc<Config>,
}

impl GrlLayer {
    /// Decides with `client`'s limiter and counts every request with its call counter
    /// (`grl_calls_total` at the controller). Caller from the `x-caller` header, procedure
    /// from the path, `Retry-After: 1`.
    pub fn for_client(client: &crate::client::GrlClient) -> GrlLayer {
        GrlLayer::new(client.limiter().clone()).with(|c| c.calls = Some(client.calls().clone()))
    }

    /// Decides with `limiter` only: requests are not counted for `grl_calls_total` (prefer
    /// [`GrlLayer::for_client`]). Caller from the `x-caller` header, procedure from the path,
    /// `Retry-After: 1`.
    pub fn new(limiter: Arc<Limiter>) -> GrlLayer {
        GrlLayer {
            cfg: Arc::new(Config {
                limiter,
                calls: None,
                caller: KeyFrom::Header(HeaderName::from_static("x-caller")),
                procedure: KeyFrom::Path,
                tiers: TierFrom::default(),
                retry_after: HeaderValue::from_static("1"),
                concurrency: None,
            }),
        }
    }

    fn with(self, f: impl FnOnce(&mut Config)) -> GrlLayer {
        let mut c = Config {
            limiter: self.cfg.limiter.clone(),
            calls: self.cfg.calls.clone(),
            caller: self.cfg.caller.clone(),
            procedure: self.cfg.procedure.clone(),
            tiers: self.cfg.tiers.clone(),
            retry_after: self.cfg.retry_after.clone(),
            concurrency: self.cfg.concurrency.clone(),
        };
        f(&mut c);
        GrlLayer { cfg: Arc::new(c) }
    }

    /// Where the caller comes from.
    pub fn caller_from(self, k: KeyFrom) -> GrlLayer {
        self.with(|c| c.caller = k)
    }

    /// Where the procedure comes from.
    pub fn procedure_from(self, k: KeyFrom) -> GrlLayer {
        self.with(|c| c.procedure = k)
    }

    /// Where a request's criticality tier comes from: by default the `rpc-criticality`
    /// header, else a `criticality` member of `baggage`, else CRITICAL (see [`TierFrom`]).
    pub fn tiers_from(self, t: TierFrom) -> GrlLayer {
        self.with(|c| c.tiers = t)
    }

    /// A limit on the requests in flight to the wrapped service (`Mode::Auto`: learned from
    /// its latency; see [`crate::concurrency`]), with a queue that serves the more critical
    /// tiers first; a request that finds no slot within `queue_timeout` is answered 503 with
    /// `Retry-After`. The wrapped service's future is polled only once its request has a
    /// slot (axum handlers and most tower services do their work when polled; one that
    /// works in `call` itself is not held). [`Mode::Off`](crate::concurrency::Mode::Off)
    /// (the default) holds nothing.
    pub fn concurrency_limit(self, opts: crate::concurrency::Options) -> GrlLayer {
        let l = ConcurrencyLimiter::new(opts);
        self.with(|c| c.concurrency = l)
    }

    /// The concurrency limiter, when [`GrlLayer::concurrency_limit`] set one (its counters
    /// for the service's metrics).
    pub fn concurrency(&self) -> Option<&Arc<ConcurrencyLimiter>> {
        self.cfg.concurrency.as_ref()
    }

    /// The `Retry-After` seconds on a 429 (the control loop's tick is a good value).
    pub fn retry_after_secs(self, secs: u64) -> GrlLayer {
        self.with(|c| c.retry_after = HeaderValue::from(secs))
    }

    /// Counts one request of `caller` to `procedure` (when built with
    /// [`GrlLayer::for_client`]) and decides it: what the layer's service does before it
    /// answers 429 or passes the request on. For front ends that read the caller and the
    /// procedure their own way (`grl sidecar`).
    #[inline]
    pub fn decide(&self, caller: &str, procedure: &str) -> Decision {
        decide(&self.cfg, caller, procedure, Criticality::Critical)
    }

    /// [`GrlLayer::decide`] for a request of `tier` (see [`GrlLayer::tier_of`]).
    #[inline]
    pub fn decide_tier(&self, caller: &str, procedure: &str, tier: Criticality) -> Decision {
        decide(&self.cfg, caller, procedure, tier)
    }

    /// `tier` held at `caller`'s cap in the service's bucket file (`criticality.caps`), as
    /// the decision holds it: for a front end's own use of the tier (the overload queue).
    pub fn capped(&self, tier: Criticality, caller: &str) -> Criticality {
        capped(&self.cfg, tier, caller)
    }

    /// The tier of a request of `caller` with `headers`, as the layer reads it.
    #[inline]
    pub fn tier_of(&self, headers: &http::HeaderMap, caller: &str) -> Criticality {
        self.cfg.tiers.tier(headers, caller)
    }

    /// [`GrlLayer::decide`] with the fail-open check at `now_ms` (`grl_core::now_ms()`), for
    /// a front end that reads the clock per request anyway. `decide` reads a per-thread clock
    /// refreshed every 64 decisions; failing open does not depend on it, since the client's
    /// task expires stale directives on the real clock (see `GrlClient`).
    #[inline]
    pub fn decide_at(&self, caller: &str, procedure: &str, now_ms: u64) -> Decision {
        self.decide_tier_at(caller, procedure, Criticality::Critical, now_ms)
    }

    /// [`GrlLayer::decide_at`] for a request of `tier`.
    #[inline]
    pub fn decide_tier_at(
        &self,
        caller: &str,
        procedure: &str,
        tier: Criticality,
        now_ms: u64,
    ) -> Decision {
        if let Some(c) = &self.cfg.calls {
            c.count(caller, procedure);
        }
        self.cfg
            .limiter
            .decide_tier_at(caller, procedure, tier, now_ms)
    }

    /// The limiter the layer decides with.
    pub fn limiter(&self) -> &Arc<Limiter> {
        &self.cfg.limiter
    }
}

impl<S> Layer<S> for GrlLayer {
    type Service = GrlService<S>;

    fn layer(&self, inner: S) -> GrlService<S> {
        GrlService {
            inner,
            cfg: self.cfg.clone(),
        }
    }
}

/// The service `GrlLayer` wraps around another.
#[derive(Clone)]
pub struct GrlService<S> {
    inner: S,
    cfg: Arc<Config>,
}

impl<S, B, RB> Service<Request<B>> for GrlService<S>
where
    S: Service<Request<B>, Response = Response<RB>>,
    RB: From<&'static str>,
{
    type Response = Response<RB>;
    type Error = S::Error;
    type Future = GrlFuture<S::Future, RB>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let (caller, procedure) = (
            self.cfg.caller.extract(&req),
            self.cfg.procedure.extract(&req),
        );
        let tier = self.cfg.tiers.tier(req.headers(), caller);
        let d = decide(&self.cfg, caller, procedure, tier);
        if d == Decision::Drop {
            let mut resp = Response::new(RB::from("rate limited\n"));
            *resp.status_mut() = StatusCode::TOO_MANY_REQUESTS;
            resp.headers_mut()
                .insert(http::header::RETRY_AFTER, self.cfg.retry_after.clone());
            return GrlFuture::Limited { resp: Some(resp) };
        }
        if let Some(c) = &self.cfg.concurrency {
            let c = c.clone();
            let tier = capped(&self.cfg, tier, caller);
            return GrlFuture::Held {
                acquire: Some(Box::pin(async move { c.acquire(tier).await })),
                permit: None,
                retry_after: self.cfg.retry_after.clone(),
                fut: self.inner.call(req),
            };
        }
        GrlFuture::Inner {
            fut: self.inner.call(req),
        }
    }
}

pin_project_lite::pin_project! {
    /// The response future of `GrlService` (fields: the inner future, or the 429 to return;
    /// the macro takes no doc comments on fields).
    #[allow(missing_docs)]
    #[project = GrlFutureProj]
    pub enum GrlFuture<F, RB> {
        /// Passed to the inner service.
        Inner { #[pin] fut: F },
        /// Answered with 429.
        Limited { resp: Option<Response<RB>> },
        /// Under a concurrency limit: the slot first, then the inner future (503 without a
        /// slot in time).
        Held {
            acquire: Option<Acquire>,
            permit: Option<Permit>,
            retry_after: HeaderValue,
            #[pin] fut: F,
        },
    }
}

/// A request's wait for a slot under [`GrlLayer::concurrency_limit`].
pub type Acquire = Pin<Box<dyn Future<Output = Result<Permit, Refused>> + Send>>;

impl<F, E, RB> Future for GrlFuture<F, RB>
where
    F: Future<Output = Result<Response<RB>, E>>,
    RB: From<&'static str>,
{
    type Output = Result<Response<RB>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project() {
            GrlFutureProj::Inner { fut } => fut.poll(cx),
            GrlFutureProj::Limited { resp } => {
                Poll::Ready(Ok(resp.take().expect("polled after completion")))
            }
            GrlFutureProj::Held {
                acquire,
                permit,
                retry_after,
                fut,
            } => {
                if let Some(a) = acquire {
                    match a.as_mut().poll(cx) {
                        Poll::Pending => return Poll::Pending,
                        Poll::Ready(Ok(p)) => *permit = Some(p),
                        Poll::Ready(Err(_)) => {
                            *acquire = None;
                            let mut resp = Response::new(RB::from("overloaded\n"));
                            *resp.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
                            resp.headers_mut()
                                .insert(http::header::RETRY_AFTER, retry_after.clone());
                            return Poll::Ready(Ok(resp));
                        }
                    }
                    *acquire = None;
                }
                let out = std::task::ready!(fut.poll(cx));
                // The answer is there: the slot is free, its latency learned.
                drop(permit.take());
                Poll::Ready(out)
            }
        }
    }
}
