//! `POST /v1/previews`: the HTTP side of the what-if previews ([`rlc_plan::whatif`]). Checks the
//! media type (415) and the size (413, read bounded: a body is never buffered past
//! [`MAX_BODY_BYTES`]), takes the daemon's inputs, history and current plan from a
//! [`SnapshotFn`], and computes the preview off the async runtime. At most
//! [`MAX_CONCURRENT`] previews run at once; more answer 429. Every error is an
//! `application/problem+json` body.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};

use crate::history::snapshot::HeldHistory;
use crate::serve::limits::{read_bounded, ConcurrencyLimit, RETRY_AFTER_SECS};
use crate::serve::problem::Problem;
use rlc_plan::plan::Plan;
use rlc_plan::whatif::{self, BodyFormat, Inputs, Refusal, WhatIfError, MAX_BODY_BYTES};

/// Previews computed at once; more are refused with 429 (each is CPU-bound).
pub const MAX_CONCURRENT: usize = 2;

/// What a preview starts from: the inputs of the current plan, the history it was computed
/// on, and the plan itself.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// `rlc.yaml` and the config repo.
    pub inputs: Inputs,
    /// The history (read service by service when on disk).
    pub history: Arc<HeldHistory>,
    /// The current plan (what a run would compute now).
    pub current: Plan,
}

/// Hands out the current [`Snapshot`] (a problem, e.g. 503, when there is none yet).
pub type SnapshotFn = Arc<
    dyn Fn() -> Pin<Box<dyn Future<Output = Result<Arc<Snapshot>, Problem>> + Send>> + Send + Sync,
>;

/// The state of the previews endpoint.
#[derive(Clone)]
pub struct Previews {
    snapshot: SnapshotFn,
    running: ConcurrencyLimit,
}

impl Previews {
    /// Previews on the snapshots of `snapshot`.
    pub fn new(snapshot: SnapshotFn) -> Previews {
        Previews {
            snapshot,
            running: ConcurrencyLimit::new(MAX_CONCURRENT, RETRY_AFTER_SECS),
        }
    }

    /// Previews of a fixed snapshot (tests, benchmarks, embedding).
    pub fn fixed(snapshot: Snapshot) -> Previews {
        let snapshot = Arc::new(snapshot);
        Previews::new(Arc::new(move || {
            let s = snapshot.clone();
            Box::pin(async move { Ok(s) })
        }))
    }
}

/// The problem details of a refused what-if: 413, 415, 400 (cannot be read) or 422 (does not
/// validate), with every problem.
pub fn problem_of(e: WhatIfError) -> Problem {
    let status = match e.refusal {
        Refusal::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
        Refusal::MediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
        Refusal::Unreadable => StatusCode::BAD_REQUEST,
        Refusal::Invalid => StatusCode::UNPROCESSABLE_ENTITY,
    };
    Problem::new(status, e.detail).with_problems(e.problems)
}

/// The router of `POST /v1/previews` alone (merged into `rlc serve`'s, see
/// [`crate::serve::app`]).
pub fn routes(previews: Previews) -> Router {
    Router::new()
        .route("/v1/previews", post(post_preview))
        .with_state(previews)
}

async fn post_preview(State(p): State<Previews>, headers: HeaderMap, body: Body) -> Response {
    answer(&p, &headers, body).await
}

/// Answers one `POST /v1/previews` request.
pub async fn answer(p: &Previews, headers: &HeaderMap, body: Body) -> Response {
    // The cheap refusals first (media type, size), then a computing slot, then the work.
    let (bytes, content_type) = match read_body(headers, body).await {
        Ok(x) => x,
        Err(problem) => return problem.into_response(),
    };
    let _permit = match p.running.try_enter() {
        Ok(permit) => permit,
        Err(refusal) => return *refusal,
    };
    match compute(p, bytes, content_type).await {
        Ok(a) => Json(a).into_response(),
        Err(problem) => problem.into_response(),
    }
}

/// The body within [`MAX_BODY_BYTES`] and its media type (415, 413 or 400 otherwise).
async fn read_body(
    headers: &HeaderMap,
    body: Body,
) -> Result<(axum::body::Bytes, Option<String>), Problem> {
    let content_type = match headers.get(header::CONTENT_TYPE) {
        None => None,
        Some(v) => Some(
            v.to_str()
                .map_err(|_| problem_of(whatif::unsupported_media_type(Some("(not text)"))))?
                .to_string(),
        ),
    };
    // Refuse early what cannot be read, before the body is.
    if let Some(c) = &content_type {
        if BodyFormat::of(c).is_none() {
            return Err(problem_of(whatif::unsupported_media_type(Some(c))));
        }
    }
    let bytes = read_bounded(headers, body, MAX_BODY_BYTES).await?;
    Ok((bytes, content_type))
}

async fn compute(
    p: &Previews,
    bytes: axum::body::Bytes,
    content_type: Option<String>,
) -> Result<whatif::PreviewAnswer, Problem> {
    let snap = (p.snapshot)().await?;
    tokio::task::spawn_blocking(move || {
        whatif::preview(
            &snap.inputs,
            &*snap.history,
            &snap.current,
            &bytes,
            content_type.as_deref(),
            chrono::Utc::now(),
        )
    })
    .await
    .map_err(|e| {
        tracing::error!(error = %e, "what-if preview task failed");
        Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the preview could not be computed",
        )
    })?
    .map_err(problem_of)
}

/// `POST /v1/previews` on `rlc serve` (see [`crate::serve::openapi`]): 503 when this state
/// serves no previews.
pub(in crate::serve) async fn on_serve(
    State(s): State<crate::serve::AppState>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    match &s.inner.previews {
        Some(p) => answer(p, &headers, body).await,
        None => Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "previews are not available yet",
        )
        .into_response(),
    }
}

/// Previews over a config repo directory as it is on disk, for embedding and tests: every
/// request loads the directory, pulls the history ([`crate::history::load_or_unavailable`]) and
/// computes the current plan with no evidence (a directory has no run history nor shadow
/// reports). `rlc serve` uses the quota API's snapshot, plan and evidence instead
/// ([`crate::serve::quotas::Quotas::previews`]). A directory with problems answers 503.
pub fn from_directory(cfg: schema::DaemonConfig, base_dir: &std::path::Path) -> Previews {
    let mut cfg = cfg;
    crate::config::resolve_paths(&mut cfg, base_dir);
    let base = base_dir.to_path_buf();
    let snapshot: SnapshotFn = Arc::new(move || {
        let (cfg, base) = (cfg.clone(), base.clone());
        Box::pin(async move {
            let unavailable =
                |detail: String| Problem::new(StatusCode::SERVICE_UNAVAILABLE, detail);
            let dir = std::path::PathBuf::from(&cfg.config_repo.path);
            let (repo, diags) = tokio::task::spawn_blocking(move || schema::ConfigRepo::load(&dir))
                .await
                .map_err(|e| unavailable(format!("loading the config repo: {e}")))?;
            if !diags.is_empty() {
                return Err(unavailable(format!(
                    "the config repo's working copy has {} problem(s) (or is not cloned yet); previews need a valid repo",
                    diags.len()
                )));
            }
            let history = crate::history::load_or_unavailable(&cfg, &base).await;
            tokio::task::spawn_blocking(move || {
                let world = rlc_plan::pipeline::World::none();
                let now = chrono::Utc::now();
                let current = rlc_plan::pipeline::plan(
                    &cfg,
                    &repo,
                    &history,
                    &world,
                    now,
                    rlc_plan::pipeline::Purpose::Run,
                );
                Arc::new(Snapshot {
                    inputs: Inputs { cfg, repo, world },
                    history: Arc::new(history.into()),
                    current,
                })
            })
            .await
            .map_err(|e| unavailable(format!("computing the current plan: {e}")))
        })
    });
    Previews::new(snapshot)
}
