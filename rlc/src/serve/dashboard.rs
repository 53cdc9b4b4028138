//! The shadow-mode dashboard of `rlc serve`: what new or risky quotas would do before they are
//! enforced. Read-only (open, or the read token when one is configured: [`super::auth`]):
//! `GET /v1/shadow` and `GET /v1/runs` answer JSON, `GET /`
//! renders the same data as one HTML page (no script, no external asset, every value escaped by
//! maud's `html!`: service and bucket names come from config repos that many people edit).

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Response};
use axum::Json;
use chrono::{DateTime, Utc};
use maud::{html, Markup, PreEscaped, DOCTYPE};
use percent_encoding::{utf8_percent_encode, PercentEncode};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::limits::Query;
use super::problem::CompatProblem;
use super::AppState;
use crate::gitops::forge::{commit_url_prefix, is_http_url};
use crate::gitops::summary::URL_SEGMENT;
use crate::store::{BucketShadowSummary, PullRequestRef, RunRecord, Store};

/// Share of virtual drops (`shadow_dropped / offered`) above which a bucket is flagged
/// "would throttle": enforcing it as configured would refuse more than 1% of its traffic.
pub const WOULD_THROTTLE_SHARE: f64 = 0.01;
/// Window when the query string names none.
const DEFAULT_WINDOW: &str = "1h";
/// Longest window: keeps the aggregate scan bounded.
const MAX_WINDOW_SECS: i64 = 30 * 86_400;
/// Most buckets in one answer (and default).
const MAX_BUCKETS: i64 = 500;
/// Runs listed by default, and at most.
const DEFAULT_RUNS: i64 = 20;
const MAX_RUNS: i64 = 200;
/// Runs on the HTML page.
const PAGE_RUNS: i64 = 10;
/// Services offered by the HTML filter.
const MAX_SERVICES: i64 = 200;
/// Windows offered by the HTML filters (overview and bucket pages).
const WINDOWS: &[&str] = &["15m", "1h", "6h", "24h", "7d", "30d"];

/// The window asked, or [`DEFAULT_WINDOW`] when none (or an empty one) is.
fn window_or_default(window: Option<String>) -> String {
    window
        .filter(|w| !w.is_empty())
        .unwrap_or_else(|| DEFAULT_WINDOW.into())
}

/// The windows [`parse_window`] accepts, as a regular expression for the API document: a
/// number without sign or leading zero and a unit, 1 s to 30 d (or empty: the default).
pub const WINDOW_PATTERN: &str = "^(|([1-9][0-9]{0,5}|1[0-9]{6}|2[0-4][0-9]{5}|25[0-8][0-9]{4}|259[01][0-9]{3}|2592000)s|([1-9][0-9]{0,3}|[1-3][0-9]{4}|4[0-2][0-9]{3}|43[01][0-9]{2}|43200)m|([1-9][0-9]?|[1-6][0-9]{2}|7[01][0-9]|720)h|([1-9]|[12][0-9]|30)d)$";

/// A window [`parse_window`] refuses (the message names it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WindowError {
    #[error("window `{0}`: expected a number followed by s, m, h or d (e.g. 1h)")]
    Malformed(String),
    #[error("window `{0}`: must be between 1s and 30d")]
    OutOfRange(String),
}

/// Parses a window such as `90s`, `15m`, `1h` or `7d` (1 s to 30 days).
pub fn parse_window(s: &str) -> Result<chrono::Duration, WindowError> {
    let bad = || WindowError::Malformed(s.to_string());
    let unit = s.chars().last().ok_or_else(bad)?;
    let digits = &s[..s.len() - unit.len_utf8()];
    // Digits only, no sign, no leading zero: what WINDOW_PATTERN says.
    if digits.is_empty() || digits.starts_with('0') || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let n: i64 = digits.parse().map_err(|_| bad())?;
    let secs = match unit {
        's' => Some(n),
        'm' => n.checked_mul(60),
        'h' => n.checked_mul(3_600),
        'd' => n.checked_mul(86_400),
        _ => return Err(bad()),
    }
    .ok_or_else(bad)?;
    if !(1..=MAX_WINDOW_SECS).contains(&secs) {
        return Err(WindowError::OutOfRange(s.to_string()));
    }
    Ok(chrono::Duration::seconds(secs))
}

/// Query string of `GET /v1/shadow` and `GET /`.
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct ShadowQuery {
    /// Only this callee service (empty: all).
    pub service: Option<String>,
    /// How far back, e.g. `1h` (default) or `7d`: a number and a unit (s, m, h, d), 1 s to
    /// 30 d.
    #[schemars(regex(path = "WINDOW_PATTERN"))]
    pub window: Option<String>,
    /// Most buckets returned (default and maximum 500).
    pub limit: Option<i64>,
    /// Only buckets in this mode: `enforce` or `shadow` (empty: both), as the overview's.
    pub mode: Option<String>,
    /// Only buckets with this verdict: `dropping`, `would-throttle`, `stale`, `silent` or
    /// `ok` (empty: all), as the overview's.
    pub verdict: Option<String>,
}

/// Query string of the overview `GET /`: the filters of [`ShadowQuery`].
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct OverviewQuery {
    /// Only this callee service (empty: all).
    pub service: Option<String>,
    /// How far back, e.g. `1h` (default) or `7d`: a number and a unit (s, m, h, d), 1 s to
    /// 30 d.
    #[schemars(regex(path = "WINDOW_PATTERN"))]
    pub window: Option<String>,
    /// Only buckets in this mode: `enforce` or `shadow` (empty: both).
    pub mode: Option<String>,
    /// Only buckets with this verdict: `dropping`, `would-throttle`, `stale`, `silent` or
    /// `ok` (empty: all).
    pub verdict: Option<String>,
    /// Most buckets with reports read from the store (default and maximum 500).
    pub limit: Option<i64>,
}

/// One bucket of `GET /v1/shadow`.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct BucketView {
    /// The stored aggregate.
    #[serde(flatten)]
    pub summary: BucketShadowSummary,
    /// `virtual_drop_share > would_throttle_share`.
    pub would_throttle: bool,
    /// The overview's verdict: `dropping`, `would-throttle`, `stale`, `silent` or `ok`.
    pub verdict: String,
    /// The verdict in the overview's words (`dropping 25.00% of requests`).
    pub verdict_text: String,
}

/// A bucket of the config repo's base branch without a report in the window (the overview
/// lists it as `silent`).
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct SilentBucket {
    /// Callee service.
    pub service: String,
    /// Bucket.
    pub bucket: String,
    /// The limit in force (null: a new bucket that is only a candidate so far).
    pub limit_rps: Option<f64>,
    /// enforce | shadow, as in force.
    pub mode: String,
    /// Always `silent`.
    pub verdict: String,
    /// `no reports in the last 1h`.
    pub verdict_text: String,
}

/// `GET /v1/shadow?service=S&window=1h&limit=N&mode=M&verdict=V`: every bucket the overview
/// lists, with its filters:
///
/// ```json
/// {
///   "service": "payments",            // null: every service
///   "window": "1h",
///   "since": "2026-11-30T01:00:00Z",   // reports with a tick in this minute or later: the
///                                      // boundary of a minute, ten minutes, an hour or a UTC
///                                      // day at or before now - window (at most a sixth of
///                                      // the window earlier)
///   "would_throttle_share": 0.01,
///   "truncated": false,                // more buckets than `limit`
///   "buckets": [{                      // largest virtual-drop share first
///     "service": "payments", "bucket": "gw",
///     "reports": 3,                    // ticks × scope keys
///     "offered": 400.0, "admitted": 400.0, "dropped": 0.0, "shadow_dropped": 100.0,
///     "virtual_drop_share": 0.25,      // shadow_dropped / offered
///     "peak_offered_rps": 150.0, "max_drop_ratio": 0.333,
///     "limit_rps": 200.0, "mode": "shadow",   // from the latest report
///     "first_seen": "…", "last_seen": "…",  // first and newest tick in the window
///     "would_throttle": true,
///     "verdict": "would-throttle", "verdict_text": "would throttle 25.00%"
///   }],
///   "silent": [{                       // config repo buckets without a report in the window
///     "service": "payments", "bucket": "refund", "limit_rps": 50.0, "mode": "enforce",
///     "verdict": "silent", "verdict_text": "no reports in the last 1h"
///   }],
///   "config_error": null,              // why the config repo could not be read, if so
///   "incomplete": []
/// }
/// ```
///
/// `offered`, `admitted`, `dropped` and `shadow_dropped` are requests: sums of the
/// controllers' per-second report rows (a controller writes one row per key and second,
/// whatever its tick). Errors: 400 `{"error"}` for a bad window; 503 without a store, or when
/// the store does not answer within `store.query_timeout` or is unreachable; 500 when it
/// refuses the query. A store error names what could not be loaded and why (never the
/// database URL's password), instead of answering zeros.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct ShadowSummary {
    /// The service filter, if any.
    pub service: Option<String>,
    /// The window as asked.
    pub window: String,
    /// Start of the window: the boundary at or before `now - window` of the longest of a
    /// minute, ten minutes, an hour and a UTC day that is at most a sixth of the window.
    pub since: DateTime<Utc>,
    /// See [`WOULD_THROTTLE_SHARE`].
    pub would_throttle_share: f64,
    /// More buckets matched than were returned.
    pub truncated: bool,
    /// The buckets that reported in the window (with the `mode` and `verdict` filters).
    pub buckets: Vec<BucketView>,
    /// The config repo's buckets without a report in the window (with the filters): with
    /// `buckets`, every bucket the overview lists. Empty without a config repo.
    pub silent: Vec<SilentBucket>,
    /// Why the config repo's buckets could not be read (null: read, or no config repo):
    /// `silent` is then empty, not known to be.
    pub config_error: Option<String>,
    /// The regions whose controller rlc could not read at its last poll (empty: every
    /// region's reports are in): the figures miss their reports since `since`.
    pub incomplete: Vec<crate::store::UnreadRegion>,
}

/// Why a dashboard call failed.
#[derive(Debug)]
pub(super) enum DashError {
    BadRequest(String),
    NotFound(String),
    NoStore,
    /// A store call failed or was given up: what could not be loaded (`part`, e.g. "the
    /// bucket list") and why, without secrets.
    Store {
        part: &'static str,
        cause: String,
        unavailable: bool,
    },
}

impl DashError {
    fn status(&self) -> StatusCode {
        match self {
            DashError::BadRequest(_) => StatusCode::BAD_REQUEST,
            DashError::NotFound(_) => StatusCode::NOT_FOUND,
            DashError::NoStore => StatusCode::SERVICE_UNAVAILABLE,
            DashError::Store {
                unavailable: true, ..
            } => StatusCode::SERVICE_UNAVAILABLE,
            DashError::Store { .. } => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn message(&self) -> String {
        match self {
            DashError::BadRequest(m) | DashError::NotFound(m) => m.clone(),
            DashError::NoStore => {
                "the store is not available yet (database unreachable or still connecting)".into()
            }
            DashError::Store { part, cause, .. } => format!("{part} could not be loaded: {cause}"),
        }
    }

    /// The message as a page's notice shows it (a sentence when it names a part).
    fn notice(&self) -> String {
        match self {
            DashError::Store { part, cause, .. } => {
                format!("{} could not be loaded: {cause}", sentence(part))
            }
            e => e.message(),
        }
    }
}

impl IntoResponse for DashError {
    fn into_response(self) -> Response {
        CompatProblem::new(self.status(), self.message()).into_response()
    }
}

impl aide::OperationOutput for DashError {
    type Inner = CompatProblem;

    fn operation_response(
        ctx: &mut aide::generate::GenContext,
        operation: &mut aide::openapi::Operation,
    ) -> Option<aide::openapi::Response> {
        <CompatProblem as aide::OperationOutput>::operation_response(ctx, operation)
    }
}

/// The error of a store call that loads `part` of `endpoint`'s answer: logged, and named in
/// the answer. Any URL in the store's message loses its password.
fn store_failed(
    endpoint: &'static str,
    part: &'static str,
    e: crate::store::StoreError,
) -> DashError {
    tracing::warn!(endpoint, part, error = %e, "dashboard store query failed");
    let cause = e
        .to_string()
        .split(' ')
        .map(|w| {
            if w.contains("://") {
                super::redact_url(w)
            } else {
                w.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join(" ");
    DashError::Store {
        part,
        cause,
        unavailable: e.unavailable(),
    }
}

/// Runs one store call that loads `part` of `endpoint`'s answer, within `limit`
/// (`store.query_timeout`).
async fn load<T>(
    endpoint: &'static str,
    part: &'static str,
    limit: std::time::Duration,
    call: impl std::future::Future<Output = Result<T, crate::store::StoreError>>,
) -> Result<T, DashError> {
    crate::store::within(limit, call)
        .await
        .map_err(|e| store_failed(endpoint, part, e))
}

/// A parsed [`ShadowQuery`].
struct Filter {
    service: Option<String>,
    window: String,
    since: DateTime<Utc>,
    limit: i64,
}

impl Filter {
    fn parse(q: ShadowQuery) -> Result<Filter, DashError> {
        let window = window_or_default(q.window);
        let span = parse_window(&window).map_err(|e| DashError::BadRequest(e.to_string()))?;
        Ok(Filter {
            service: q.service.filter(|s| !s.is_empty()),
            window,
            // A window starts on the boundary of the longest roll-up period at most a sixth
            // of it (up to a sixth longer than asked): it is summed from a few roll-up rows a
            // bucket (30 days: 31 day rows) instead of every ten minutes or minute.
            since: crate::store::window_start(Utc::now(), span),
            limit: q.limit.unwrap_or(MAX_BUCKETS).clamp(1, MAX_BUCKETS),
        })
    }
}

async fn summary(
    store: &Store,
    f: &Filter,
    limit: std::time::Duration,
) -> Result<ShadowSummary, DashError> {
    // One more than asked tells whether the answer is cut.
    let rows = store.shadow_summary(f.service.as_deref(), f.since, f.limit + 1);
    let mut rows = load("/v1/shadow", "the bucket list", limit, rows).await?;
    let truncated = rows.len() as i64 > f.limit;
    rows.truncate(f.limit as usize);
    let incomplete = load(
        "/v1/shadow",
        "the regions read",
        limit,
        store.unread_regions(),
    )
    .await?;
    let now = Utc::now();
    Ok(ShadowSummary {
        incomplete,
        service: f.service.clone(),
        window: f.window.clone(),
        since: f.since,
        would_throttle_share: WOULD_THROTTLE_SHARE,
        truncated,
        buckets: rows
            .into_iter()
            .map(|summary| {
                let (attention, verdict_text) =
                    overview::verdict(Some(&summary), true, &f.window, now, max_report_age());
                BucketView {
                    would_throttle: summary.virtual_drop_share > WOULD_THROTTLE_SHARE,
                    verdict: attention.key().into(),
                    verdict_text,
                    summary,
                }
            })
            .collect(),
        silent: Vec::new(),
        config_error: None,
    })
}

/// How old a bucket's last report may be before the overview calls it stale.
fn max_report_age() -> chrono::Duration {
    rlc_plan::readiness::Rule::default().max_report_age
}

/// The overview's `mode` and `verdict` filters, checked (empty: no filter).
fn filters(
    mode: Option<&str>,
    verdict: Option<&str>,
) -> Result<(Option<String>, Option<overview::Attention>), DashError> {
    let mode = match mode.filter(|m| !m.is_empty()) {
        None => None,
        Some(m @ ("enforce" | "shadow")) => Some(m.to_string()),
        Some(m) => {
            return Err(DashError::BadRequest(format!(
                "mode `{m}`: expected enforce or shadow"
            )))
        }
    };
    let verdict = match verdict.filter(|v| !v.is_empty()) {
        None => None,
        Some(v) => Some(overview::Attention::parse(v).ok_or_else(|| {
            let keys: Vec<&str> = overview::Attention::ALL.iter().map(|a| a.key()).collect();
            DashError::BadRequest(format!(
                "verdict `{v}`: expected one of {}",
                keys.join(", ")
            ))
        })?),
    };
    Ok((mode, verdict))
}

/// The overview's rows of `sum` and `config` (the limits in force as `rollouts` keep them),
/// with the mode and verdict filters.
fn filtered_rows(
    sum: &ShadowSummary,
    config: Option<&[schema::BucketFile]>,
    overrides: &std::collections::BTreeMap<(String, String), Vec<rlc_plan::censor::OverrideWindow>>,
    rollouts: &std::collections::BTreeMap<(String, String), crate::rollout::Rollout>,
    (mode, verdict): (Option<&str>, Option<overview::Attention>),
) -> Vec<overview::Row> {
    let summaries: Vec<BucketShadowSummary> =
        sum.buckets.iter().map(|b| b.summary.clone()).collect();
    let rows = overview::rows(&overview::Sources {
        config,
        summaries: &summaries,
        overrides,
        rollouts,
        service: sum.service.as_deref(),
        window: &sum.window,
        now: Utc::now(),
        max_age: max_report_age(),
    });
    rows.into_iter()
        .filter(|r| mode.is_none_or(|m| r.mode() == m))
        .filter(|r| verdict.is_none_or(|v| r.attention == v))
        .collect()
}

/// `GET /v1/shadow`: see [`ShadowSummary`]. Lists what the overview lists, with its filters.
pub(super) async fn shadow_json(
    State(s): State<AppState>,
    Query(q): Query<ShadowQuery>,
) -> Result<Json<ShadowSummary>, DashError> {
    let (mode, verdict) = filters(q.mode.as_deref(), q.verdict.as_deref())?;
    let f = Filter::parse(q)?;
    let store = s.store().ok_or(DashError::NoStore)?;
    let limit = s.query_timeout();
    let mut sum = summary(&store, &f, limit).await?;
    let mut config = None;
    if let Some(quotas) = s.quotas() {
        match quotas.base_buckets().await {
            Ok((_, files)) => config = Some(files),
            Err(e) => sum.config_error = Some(e.to_string()),
        }
    }
    // The rollouts decide the limit and mode in force while a candidate bakes; without them
    // the config repo's are shown (logged, as the overview does).
    let rollouts =
        match crate::store::within(limit, crate::rollout::latest_by_bucket(&store, 10_000)).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "/v1/shadow: the rollouts could not be loaded");
                Default::default()
            }
        };
    let rows = filtered_rows(
        &sum,
        config.as_deref(),
        &Default::default(),
        &rollouts,
        (mode.as_deref(), verdict),
    );
    let listed: std::collections::BTreeSet<(&str, &str)> = rows
        .iter()
        .map(|r| (r.service.as_str(), r.bucket.as_str()))
        .collect();
    let silent = rows
        .iter()
        .filter(|r| r.summary.is_none())
        .map(|r| SilentBucket {
            service: r.service.clone(),
            bucket: r.bucket.clone(),
            limit_rps: r.config.as_ref().and_then(|c| c.limit_rps),
            mode: r.mode().to_string(),
            verdict: r.attention.key().into(),
            verdict_text: r.verdict.clone(),
        })
        .collect();
    sum.buckets
        .retain(|b| listed.contains(&(b.summary.service.as_str(), b.summary.bucket.as_str())));
    sum.silent = silent;
    Ok(Json(sum))
}

/// Query string of `GET /v1/runs`.
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct RunsQuery {
    /// How many runs, newest first (default 20, at most 200).
    pub limit: Option<i64>,
}

/// How the pages link a commit and a pull request to the forge (`config_repo.forge`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Links {
    /// A commit's web page is this followed by its SHA; none without a forge.
    commit_prefix: Option<String>,
}

impl Links {
    /// From rlc.yaml's `config_repo.forge` (none, or kind `none`: commits stay plain text).
    pub fn from_forge(forge: Option<&schema::ForgeConfig>) -> Links {
        Links {
            commit_prefix: forge.and_then(commit_url_prefix),
        }
    }

    /// The forge's web page of commit `sha`: none without a forge, or for a value that is not
    /// a commit id (7 to 64 hex digits).
    pub fn commit_url(&self, sha: &str) -> Option<String> {
        let prefix = self.commit_prefix.as_ref()?;
        let hex = (7..=64).contains(&sha.len()) && sha.bytes().all(|b| b.is_ascii_hexdigit());
        hex.then(|| format!("{prefix}{sha}"))
    }

    /// A commit as HTML: its first 12 characters (the whole SHA as title), a link to its
    /// forge page when there is one.
    pub fn commit_html(&self, sha: &str) -> Markup {
        let short: String = sha.chars().take(12).collect();
        html! {
            @if let Some(url) = self.commit_url(sha) {
                a class="commit" href=(url) { code title=(sha) { (short) } }
            } @else {
                code title=(sha) { (short) }
            }
        }
    }
}

/// A pull request as HTML: `#N`, a link to its page when that is an http(s) URL.
pub fn pull_request_html(pr: &PullRequestRef) -> Markup {
    html! {
        @match pr.url.as_deref().filter(|u| is_http_url(u)) {
            Some(url) => { a class="pr" href=(url) { "#" (pr.number) } }
            None => { span class="pr" { "#" (pr.number) } }
        }
    }
}

/// A run as `GET /v1/runs` shows it: the stored record with `services` as JSON instead of
/// JSON text, its pull request, and its commit's forge page.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct RunView {
    /// The store's id.
    pub id: i64,
    /// schedule | inputs-changed | api | once.
    pub trigger: String,
    /// Start.
    pub started_at: DateTime<Utc>,
    /// End.
    pub finished_at: DateTime<Utc>,
    /// success | unchanged | pending | held | failed.
    pub status: String,
    /// The commit made (or the PR branch tip), if any.
    pub commit_sha: Option<String>,
    /// The version the controller confirmed, if any.
    pub version_pushed: Option<String>,
    /// Per-service outcome (`[{"service", "outcome", ...}]`).
    pub services: serde_json::Value,
    /// The human-readable summary.
    pub summary: String,
    /// Why it failed, if it did.
    pub error: Option<String>,
    /// The id given out when the run was asked for or started (`GET /v1/runs/{run_uid}`);
    /// null for runs recorded before run ids.
    pub run_uid: Option<String>,
    /// The pull (merge) request the run opened or updated; null when it opened none (or was
    /// recorded before pull requests were).
    pub pull_request: Option<PullRequestRef>,
    /// The forge's web page of `commit_sha`; null without `config_repo.forge` (or kind
    /// `none`).
    pub commit_url: Option<String>,
}

impl RunView {
    /// `r` as shown, its commit linked per `links`.
    pub fn new(r: &RunRecord, links: &Links) -> RunView {
        RunView {
            id: r.id,
            trigger: r.trigger.clone(),
            started_at: r.started_at,
            finished_at: r.finished_at,
            status: r.status.clone(),
            commit_sha: r.commit_sha.clone(),
            version_pushed: r.version_pushed.clone(),
            // Stored as JSON text; shown as JSON (the text itself if it is not JSON).
            services: serde_json::from_str(&r.services)
                .unwrap_or_else(|_| serde_json::Value::String(r.services.clone())),
            summary: r.summary.clone(),
            error: r.error.clone(),
            run_uid: r.run_uid.clone(),
            pull_request: r.pull_request(),
            commit_url: r.commit_sha.as_deref().and_then(|c| links.commit_url(c)),
        }
    }
}

/// The answer of `GET /v1/runs`.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct RunsPage {
    /// Newest first.
    pub runs: Vec<RunView>,
}

/// `GET /v1/runs?limit=N`: `{"runs": [{"id", "trigger", "started_at", "finished_at",
/// "status", "commit_sha", "version_pushed", "services": [...], "summary", "error",
/// "run_uid", "pull_request": {"number", "url"}, "commit_url"}]}`, newest first. 503 without a
/// store.
pub(super) async fn runs_json(
    State(s): State<AppState>,
    Query(q): Query<RunsQuery>,
) -> Result<Json<RunsPage>, DashError> {
    let store = s.store().ok_or(DashError::NoStore)?;
    let limit = q.limit.unwrap_or(DEFAULT_RUNS).clamp(1, MAX_RUNS);
    let runs = load(
        "/v1/runs",
        "the runs",
        s.query_timeout(),
        store.recent_runs(limit),
    )
    .await?;
    let links = s.links();
    Ok(Json(RunsPage {
        runs: runs.iter().map(|r| RunView::new(r, &links)).collect(),
    }))
}

/// `GET /?service=S&window=1h`: the HTML dashboard. What loaded is shown; what did not is
/// named in a notice, and the status is that of the first failure.
pub(super) async fn page(State(s): State<AppState>, Query(q): Query<OverviewQuery>) -> Response {
    let (data, failed) = page_data(&s, q).await;
    let status = failed.map_or(StatusCode::OK, |e| e.status());
    (status, Html(render(&data))).into_response()
}

/// What the page shows.
#[derive(Default)]
struct PageData {
    service: Option<String>,
    window: String,
    services: Vec<String>,
    /// None when it could not be loaded (named in `problems`).
    summary: Option<ShadowSummary>,
    /// The config repo's bucket files at its base tip (none: no config repo on this server,
    /// or it could not be read: named in `problems`).
    config: Option<Vec<schema::BucketFile>>,
    /// Whether this server has a config repo.
    with_config: bool,
    /// The incident overrides in force now, by bucket.
    overrides: std::collections::BTreeMap<(String, String), Vec<rlc_plan::censor::OverrideWindow>>,
    /// The newest rollout of each bucket (empty when the store could not say: logged).
    rollouts: std::collections::BTreeMap<(String, String), crate::rollout::Rollout>,
    /// The mode filter.
    mode: Option<String>,
    /// The verdict filter.
    verdict: Option<overview::Attention>,
    /// The config repo's services (filter choices).
    config_services: Vec<String>,
    /// None when they could not be loaded (named in `problems`).
    runs: Option<Vec<RunRecord>>,
    /// Reports fetched but not stored yet.
    buffered: u64,
    /// What could not be loaded, and why.
    problems: Vec<String>,
    links: Links,
}

/// The page's data, and the first failure if any (every failure is in `problems`).
async fn page_data(s: &AppState, q: OverviewQuery) -> (PageData, Option<DashError>) {
    let mut data = PageData {
        buffered: s.inner.metrics.reports_buffered.get().max(0) as u64,
        service: q.service.clone().filter(|s| !s.is_empty()),
        window: q.window.clone().unwrap_or_else(|| DEFAULT_WINDOW.into()),
        links: s.links(),
        mode: q.mode.clone().filter(|m| !m.is_empty()),
        ..PageData::default()
    };
    let fail = |mut data: PageData, e: DashError| {
        data.problems.push(e.notice());
        (data, Some(e))
    };
    match filters(q.mode.as_deref(), q.verdict.as_deref()) {
        Ok((_, verdict)) => data.verdict = verdict,
        Err(e) => return fail(data, e),
    }
    let f = match Filter::parse(ShadowQuery {
        service: q.service,
        window: q.window,
        limit: q.limit,
        mode: None,
        verdict: None,
    }) {
        Ok(f) => f,
        Err(e) => return fail(data, e),
    };
    // The config repo's buckets: every bucket is listed, with reports or not.
    if let Some(quotas) = s.quotas() {
        data.with_config = true;
        match quotas.base_buckets().await {
            Ok((_, files)) => {
                data.config_services = files.iter().map(|f| f.service.clone()).collect();
                data.config = Some(files);
            }
            Err(e) => data.problems.push(format!(
                "The config repo's buckets could not be loaded: {e}"
            )),
        }
    }
    let Some(store) = s.store() else {
        return fail(data, DashError::NoStore);
    };
    // Four independent queries, each within the query timeout: at once on Postgres, one
    // after another on SQLite.
    let limit = s.query_timeout();
    let now = Utc::now();
    let services = load(
        "/",
        "the service list",
        limit,
        store.shadow_services(f.since, MAX_SERVICES),
    );
    let runs = load("/", "the last runs", limit, store.recent_runs(PAGE_RUNS));
    let summary = summary(&store, &f, limit);
    let overrides = load(
        "/",
        "the incident overrides",
        limit,
        store.override_windows(now),
    );
    let (services, runs, summary, overrides) = if store.concurrent() {
        tokio::join!(services, runs, summary, overrides)
    } else {
        (services.await, runs.await, summary.await, overrides.await)
    };
    let mut errors = Vec::new();
    match services {
        Ok(v) => data.services = v,
        Err(e) => errors.push(e),
    }
    match summary {
        Ok(v) => data.summary = Some(v),
        Err(e) => errors.push(e),
    }
    match runs {
        Ok(v) => data.runs = Some(v),
        Err(e) => errors.push(e),
    }
    match overrides {
        Ok(v) => data.overrides = v,
        Err(e) => errors.push(e),
    }
    data.problems.extend(errors.iter().map(DashError::notice));
    // The rollouts decide which limit is in force while a candidate bakes.
    match crate::store::within(limit, crate::rollout::latest_by_bucket(&store, 10_000)).await {
        Ok(r) => data.rollouts = r,
        Err(e) => data.problems.push(format!(
            "The rollouts could not be loaded ({e}): limits under a rollout show the config \
             repo's new value, not the one in force"
        )),
    }
    (data, errors.into_iter().next())
}

/// `s` percent-encoded as a URL path segment or query value ([`URL_SEGMENT`]: RFC 3986
/// unreserved characters kept).
fn encoded(s: &str) -> PercentEncode<'_> {
    utf8_percent_encode(s, URL_SEGMENT)
}

fn rate(v: f64) -> String {
    // Whole numbers (most limits) without a useless ".0"; small rates keep one decimal.
    if v.abs() >= 100.0 || v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

fn percent(v: f64) -> String {
    format!("{:.2}%", v * 100.0)
}

fn when(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S").to_string()
}

const CSS: &str = "
:root { color-scheme: light; }
* { box-sizing: border-box; }
body { margin: 0; font: 15px/1.45 system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif;
  color: #1d2433; background: #f4f6fa; }
header { background: #1f3a5f; color: #fff; padding: 14px 28px; }
header h1 { margin: 0; font-size: 20px; font-weight: 600; }
header p { margin: 2px 0 0; color: #c9d6ea; font-size: 13px; }
main { padding: 20px 28px 40px; max-width: 1400px; }
section { background: #fff; border: 1px solid #dde3ec; border-radius: 8px; padding: 16px 20px;
  margin-bottom: 18px; }
h2 { font-size: 16px; margin: 0 0 10px; }
.explain { color: #39445a; }
.explain p { margin: 6px 0; }
form { display: flex; gap: 14px; align-items: end; flex-wrap: wrap; }
label { display: flex; flex-direction: column; font-size: 12px; color: #56627a; gap: 3px; }
select, button { font: inherit; height: 32px; padding: 0 8px; border: 1px solid #b9c3d3; border-radius: 5px;
  background: #fff; }
button { background: #1f3a5f; color: #fff; border-color: #1f3a5f; cursor: pointer; }
.counts { margin-left: auto; align-self: center; color: #56627a; font-size: 14px; }
table { border-collapse: collapse; width: 100%; font-size: 14px; }
.scroll { overflow-x: auto; }
th { text-align: left; font-size: 11px; text-transform: uppercase; letter-spacing: .03em;
  color: #56627a; border-bottom: 2px solid #dde3ec; padding: 6px 8px; vertical-align: bottom; }
td { border-bottom: 1px solid #edf0f5; padding: 6px 8px; vertical-align: top; }
td.name { min-width: 7em; max-width: 320px; overflow-wrap: normal; word-break: keep-all; hyphens: none; }
.nowrap { white-space: nowrap; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
th.num { text-align: right; }
tr.throttle td { background: #fdecec; }
tr.throttle td.share { color: #a4161a; font-weight: 700; }
.badge { display: inline-block; padding: 1px 8px; border-radius: 10px; font-size: 12px;
  font-weight: 600; white-space: nowrap; }
.badge.warn { background: #c1121f; color: #fff; }
.badge.dropping { background: #8d0801; color: #fff; }
.badge.would-throttle { background: #c1121f; color: #fff; }
.badge.stale, .badge.silent { background: #fff4db; color: #7a5300; }
.badge.override { background: #5a189a; color: #fff; }
tr.dropping td { background: #fbe3e3; }
tr.would-throttle td { background: #fdecec; }
tr.dropping td.drops { color: #8d0801; font-weight: 700; }
tr.would-throttle td.share { color: #a4161a; font-weight: 700; }
.small { font-size: 12px; }
.badge.ok { background: #e3f4e8; color: #1b6b34; }
.badge.mode { background: #eef1f6; color: #39445a; font-weight: 500; }
.badge.failed, .badge.held { background: #fdecec; color: #a4161a; }
.badge.success { background: #e3f4e8; color: #1b6b34; }
.badge.unchanged, .badge.pending { background: #fff4db; color: #7a5300; }
code { font: 13px ui-monospace, SFMono-Regular, Menlo, monospace; }
.muted { color: #7a8499; }
.notice { background: #fff4db; border-color: #f0d58c; color: #5c3f00; }
.err { color: #a4161a; font-size: 13px; }
ul.why { margin: 4px 0 0; padding-left: 18px; font-size: 13px; color: #5c3f00; }
";

/// Upper-cases the first letter of a sentence.
fn sentence(s: &str) -> String {
    let mut c = s.chars();
    c.next()
        .map(|f| f.to_uppercase().chain(c).collect())
        .unwrap_or_default()
}

/// Text that marks code with backticks, as the strings rlc shares with Markdown do (pull
/// request bodies, CLI output, reasons): each `` `…` `` span becomes a `<code>` element, every
/// part escaped. With an odd number of backticks the text is shown as it is.
pub(super) fn prose(text: &str) -> Markup {
    let balanced = text.bytes().filter(|b| *b == b'`').count() % 2 == 0;
    html! {
        @if balanced {
            @for (i, part) in text.split('`').enumerate() {
                @if i % 2 == 1 { code { (part) } } @else { (part) }
            }
        } @else {
            (text)
        }
    }
}

/// The notice naming what could not be loaded (nothing when everything was).
fn problems_notice(problems: &[String]) -> Markup {
    html! {
        @if !problems.is_empty() {
            section class="notice" id="problem" {
                h2 { "Not loaded" }
                @for problem in problems {
                    p { (prose(problem)) }
                }
                p class="muted" {
                    "What is missing is not shown: nothing on this page stands in for it with zeros."
                }
            }
        }
    }
}

/// The notice naming the regions whose controller could not be read (nothing when every
/// region's reports are in).
pub(super) fn incomplete_notice(regions: &[crate::store::UnreadRegion]) -> Markup {
    html! {
        @if !regions.is_empty() {
            section class="notice" id="incomplete" {
                h2 { "Figures incomplete" }
                @for r in regions {
                    p {
                        "Region " strong { (r.region) } "'s controller cannot be read since "
                        (r.since.format("%Y-%m-%d %H:%M:%S UTC")) ": " (prose(&r.error))
                    }
                }
                p class="muted" {
                    "Its reports and overrides since then are missing from every figure here;                      no candidate is promoted until it can be read again."
                }
            }
        }
    }
}

/// The page's stylesheet: constant text of this file, no value in it.
/// Every page's `<head>`: charset, viewport, `title` (escaped) and the constant `css`.
fn head(title: &str, css: &[&'static str]) -> Markup {
    html! {
        head {
            meta charset="utf-8";
            meta name="viewport" content="width=device-width, initial-scale=1";
            title { (title) }
            // PreEscaped: constant CSS (a `<style>` element's text is not decoded, so
            // escaping would break it); nothing from a request or the store.
            style { @for c in css { (PreEscaped(*c)) } }
        }
    }
}

/// Renders the page: what loaded, and a notice naming what did not.
fn render(d: &PageData) -> String {
    let scope = match &d.service {
        Some(s) => format!("service {s}"),
        None => "all services".into(),
    };
    let rows = overview_rows(d);
    html! {
        (DOCTYPE)
        html lang="en" {
            (head(&format!("RLC shadow mode — {scope}"), &[CSS]))
            body {
                header {
                    h1 { "Rate Limit Configurator — shadow mode" }
                    p {
                        "What new or risky quotas would do if they were enforced · " (scope)
                        " · last " (d.window)
                    }
                }
                main {
                    (explain())
                    (filter(d, rows.as_deref()))
                    (problems_notice(&d.problems))
                    @if let Some(sum) = &d.summary {
                        (incomplete_notice(&sum.incomplete))
                    }
                    @if d.buffered > 0 {
                        section class="notice" id="buffered" {
                            h2 { "Reports waiting for the store" }
                            p {
                                (d.buffered) " controller reports are fetched but not stored yet \
                                 (the store is down or slow): the latest minutes are missing \
                                 here, not zero."
                            }
                        }
                    }
                    @if let Some(rows) = &rows {
                        (buckets_section(d, rows))
                    }
                    @if let Some(runs) = &d.runs {
                        (runs_table(runs, &d.links))
                    }
                }
            }
        }
    }
    .into_string()
}

/// What shadow mode is, for whoever opens the page.
fn explain() -> Markup {
    html! {
        section class="explain" {
            h2 { "What is shadow mode?" }
            p {
                "A quota in " b { "shadow" } " mode is computed and distributed like any other, \
                 but it never refuses a request: every client counts the requests it "
                i { "would" } " have dropped (" b { "virtual drops" } ") and lets them through. \
                 The controller reports these counts and they are shown here."
            }
            p {
                b { "Virtual-drop share" } " = virtual drops ÷ offered requests over the window. \
                 A bucket above 1% is flagged " span class="badge warn" { "would throttle" }
                ": switching it to " code { "mode: enforce" } " as is would refuse that share of \
                 its callers' traffic. If that traffic is legitimate, raise the limit (or ask for \
                 a contract in " code { "rlc/contracts.yaml" } ") before the quota is enforced; \
                 if it is not, enforcing is what protects your service."
            }
        }
    }
}

/// The overview's rows: every bucket of the config repo and of the reports, filtered by mode
/// and verdict; none when the reports could not be loaded.
fn overview_rows(d: &PageData) -> Option<Vec<overview::Row>> {
    let sum = d.summary.as_ref()?;
    Some(filtered_rows(
        sum,
        d.config.as_deref(),
        &d.overrides,
        &d.rollouts,
        (d.mode.as_deref(), d.verdict),
    ))
}

/// The filter: a plain GET form, so the page needs no script.
fn filter(d: &PageData, rows: Option<&[overview::Row]>) -> Markup {
    let mut services: Vec<String> = d
        .services
        .iter()
        .chain(&d.config_services)
        .cloned()
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    if let Some(s) = &d.service {
        if !services.contains(s) {
            services.push(s.clone());
        }
    }
    let mut windows: Vec<&str> = WINDOWS.to_vec();
    if !windows.contains(&d.window.as_str()) {
        windows.push(&d.window);
    }
    html! {
        section {
            form method="get" action="/" id="filter" {
                label {
                    "Service"
                    select name="service" {
                        option value="" selected[d.service.is_none()] { "all services" }
                        @for s in &services {
                            option value=(s) selected[d.service.as_ref() == Some(s)] { (s) }
                        }
                    }
                }
                label {
                    "Mode"
                    select name="mode" {
                        option value="" selected[d.mode.is_none()] { "enforce and shadow" }
                        @for m in ["enforce", "shadow"] {
                            option value=(m) selected[d.mode.as_deref() == Some(m)] { (m) }
                        }
                    }
                }
                label {
                    "Verdict"
                    select name="verdict" {
                        option value="" selected[d.verdict.is_none()] { "every verdict" }
                        @for a in overview::Attention::ALL {
                            option value=(a.key()) selected[d.verdict == Some(a)] { (a.label()) }
                        }
                    }
                }
                label {
                    "Window"
                    select name="window" {
                        @for w in windows {
                            option value=(w) selected[w == d.window] { (w) }
                        }
                    }
                }
                button type="submit" { "Show" }
                @if let Some(rows) = rows {
                    @let n = rows.len();
                    @let count = |a: overview::Attention| rows.iter().filter(|r| r.attention == a).count();
                    span class="counts" id="counts" {
                        (n) " bucket" @if n != 1 { "s" } " · "
                        b { (count(overview::Attention::Dropping)) } " dropping · "
                        b { (count(overview::Attention::WouldThrottle)) } " would throttle · "
                        b { (count(overview::Attention::Stale) + count(overview::Attention::Silent)) }
                        " stale or silent"
                        @if d.summary.as_ref().is_some_and(|s| s.truncated) { " · list truncated" }
                    }
                }
            }
        }
    }
}

/// Every bucket, most in need of attention first, each linked to its service's view and its
/// own page.
fn buckets_section(d: &PageData, rows: &[overview::Row]) -> Markup {
    html! {
        section {
            h2 { "Buckets" }
            @if !d.with_config {
                p class="muted" id="no-config" {
                    "No config repo on this server: only buckets with reports are listed."
                }
            }
            @if rows.is_empty() {
                p class="muted" {
                    "No bucket"
                    @if d.mode.is_some() || d.verdict.is_some() { " matches the filter" }
                    @if let Some(sum) = &d.summary { " (no report since " (when(sum.since)) " UTC)" }
                    "."
                }
            } @else {
                (overview::table(rows, &d.window, d.with_config))
                p class="muted" {
                    "Sorted by what needs attention: enforced buckets dropping real requests, \
                     then shadow buckets that would drop more than 1%, then buckets whose reports \
                     stopped (stale) or never came in the window (silent). Limit: the config \
                     repo's base branch (what the controller should run), with the controller's \
                     latest report when it differs. Offered and drops are requests: sums of the \
                     controllers' per-second rates."
                }
            }
        }
    }
}

/// The last runs: status, commit, pull request, the first line of the summary and, for a run
/// that did not succeed, why.
fn runs_table(runs: &[RunRecord], links: &Links) -> Markup {
    html! {
        section {
            h2 { "Last runs" }
            @if runs.is_empty() {
                p class="muted" { "No run recorded yet." }
            } @else {
                table id="runs" {
                    thead {
                        tr {
                            th class="num" { "#" } th { "Started (UTC)" } th { "Trigger" }
                            th { "Status" } th { "Commit" } th { "Pull request" } th { "Summary" }
                        }
                    }
                    tbody {
                        @for r in runs {
                            tr data-run=(r.id) {
                                td class="num" { a href={ "/runs/" (r.id) } { (r.id) } }
                                td { (when(r.started_at)) }
                                td { (r.trigger) }
                                td { span class={ "badge " (r.status) } { (r.status) } }
                                td {
                                    @match &r.commit_sha {
                                        Some(c) => { (links.commit_html(c)) }
                                        None => { span class="muted" { "—" } }
                                    }
                                }
                                td {
                                    @match r.pull_request() {
                                        Some(pr) => { (pull_request_html(&pr)) }
                                        None => { span class="muted" { "—" } }
                                    }
                                }
                                td { (run_summary(r)) }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// A run's summary cell: its first line, its error, and why a run is pending, held or failed
/// (the rest of its record).
fn run_summary(r: &RunRecord) -> Markup {
    let why: Vec<&str> = if matches!(r.status.as_str(), "pending" | "held" | "failed") {
        r.summary
            .lines()
            .skip(1)
            .map(str::trim)
            .filter(|l| !l.is_empty() && Some(*l) != r.error.as_deref().map(|e| e.trim()))
            .collect()
    } else {
        Vec::new()
    };
    html! {
        (r.summary.lines().next().unwrap_or(""))
        @if let Some(e) = &r.error {
            div class="err" { (e) }
        }
        @if !why.is_empty() {
            ul class="why" {
                @for l in why { li { (l) } }
            }
        }
    }
}

pub mod bucket;
pub mod chart;
pub mod lookback;
pub mod overview;
pub mod page;
pub mod run_page;

#[cfg(test)]
mod tests;
