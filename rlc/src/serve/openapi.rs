//! The routes of `rlc serve` and their OpenAPI 3.1 document, generated from the same router
//! (aide over the handlers' extractor and answer types, whose schemas come from their
//! `schemars::JsonSchema` derives): a route is documented by being registered here.
//!
//! Registering an endpoint is one line in [`routes`], in the group that matches its access:
//! `.api_route("/v1/quotas/{service}", get_with(quotas::one, quotas::one_docs))` in `read`
//! (open, or the read token), in `queries` when it is expensive (it then shares their
//! concurrency bound: 429), in `write` for a mutating one (write token), in `open` for one
//! without data. The group's layers enforce the access (before any body is read) and its
//! `with_path_items` adds the security requirement and the 401 / 403 / 429 answers to the
//! document. The handler's docs function (`|op| op.summary(..)...`) adds the rest: handlers
//! returning `Result<Json<T>, Problem>` (T: `JsonSchema`) get their 200 schema inferred; list
//! each error status with [`problem`]; bodies read with [`super::limits::BoundedJson`]
//! document their 400/413/415/422.
//!
//! `docs/openapi.json` is a committed copy (`rlc openapi > docs/openapi.json`); a test fails
//! when it differs from what this module generates.

use std::sync::Arc;

use aide::axum::routing::{get_with, post_with};
use aide::axum::ApiRouter;
use aide::openapi::{
    Header, HeaderStyle, Info, OpenApi, ParameterSchemaOrContent, ReferenceOr, Response,
    SchemaObject, SecurityScheme, StatusCode as Status,
};
use aide::transform::{TransformOpenApi, TransformOperation, TransformPathItem};
use aide::OperationOutput;
use axum::response::Html;
use axum::{Extension, Json, Router};

use super::dashboard::{self, RunsPage, ShadowSummary};
use super::limits::{ConcurrencyLimit, RETRY_AFTER_SECS};
use super::problem::CompatProblem;
use super::runs::{self, Queued, RunStatusView};
use super::{auth, previews, quotas, AppState};
use crate::cycle::RunOutcome;

/// The security scheme's name in the document.
pub const BEARER: &str = "bearer";
/// Requests in flight at once on the store-backed read endpoints (dashboard, shadow, runs).
pub const MAX_CONCURRENT_QUERIES: usize = 8;
/// The operation id of `GET /v1/runs/{id}` (target of the link from `POST /v1/runs`).
const GET_RUN: &str = "getRun";

/// Every documented route, with the layers that enforce access and bounds.
pub fn routes(state: &AppState) -> ApiRouter<AppState> {
    // Store-backed reads: one concurrency bound for all of them.
    let queries = ApiRouter::new()
        .api_route("/", get_with(dashboard::page, page_docs))
        .api_route("/v1/shadow", get_with(dashboard::shadow_json, shadow_docs))
        .api_route("/v1/runs", get_with(dashboard::runs_json, runs_docs))
        .api_route(
            "/buckets/{service}/{bucket}",
            get_with(dashboard::bucket::bucket_page, bucket_page_docs),
        )
        .api_route(
            "/v1/shadow/{service}/{bucket}",
            get_with(dashboard::bucket::bucket_json, bucket_json_docs),
        )
        .api_route(
            "/runs/{id}",
            get_with(dashboard::run_page::run_page, run_page_docs),
        )
        .route_layer(ConcurrencyLimit::new(
            MAX_CONCURRENT_QUERIES,
            RETRY_AFTER_SECS,
        ))
        .with_path_items(limited_read_docs);
    // Read endpoints: open, or the read (or write) token when `server.read_token_env` is set.
    let read = ApiRouter::new()
        .api_route("/v1/runs/last", get_with(runs::last_run, last_docs))
        .api_route("/v1/runs/{id}", get_with(runs::run_status, run_docs))
        .api_route("/v1/previews", post_with(previews::on_serve, previews_docs))
        .api_route("/v1/quotas", get_with(quotas::list, quotas_docs))
        .api_route(
            "/v1/quotas/{service}",
            get_with(quotas::service, service_docs),
        )
        .api_route(
            "/v1/quotas/{service}/{bucket}/history",
            get_with(quotas::history, quota_history_docs),
        )
        .with_path_items(read_docs)
        .merge(queries)
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::require_read,
        ));
    // Mutating endpoints: the write token, checked before the body is read.
    let write = ApiRouter::new()
        .api_route("/v1/runs", post_with(runs::trigger_run, trigger_docs))
        .with_path_items(write_docs)
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::require_write,
        ));
    // Open: probes, Prometheus, the document itself.
    let open = ApiRouter::new()
        .api_route("/healthz", get_with(super::healthz, healthz_docs))
        .api_route("/readyz", get_with(super::readyz, readyz_docs))
        .api_route("/metrics", get_with(super::metrics, metrics_docs))
        .api_route("/openapi.json", get_with(serve_document, document_docs))
        .api_route("/docs", get_with(docs_page, docs_page_docs));
    read.merge(write).merge(open)
}

/// The router of `rlc serve` with its document served at `/openapi.json`; a path it does not
/// know answers 404 and a method a path does not take 405, both as problem details (an HTML
/// page for a browser).
pub fn router(state: AppState) -> Router {
    let mut api = OpenApi::default();
    let r = routes(&state).finish_api_with(&mut api, describe);
    super::examples::add_examples(&mut api);
    r.fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(Extension(Arc::new(api)))
        .with_state(state)
}

/// Whether the client asked for HTML first (a browser), rather than JSON.
fn wants_html(headers: &axum::http::HeaderMap) -> bool {
    headers
        .get(axum::http::header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.contains("text/html"))
}

/// 404 for a path no route takes.
async fn not_found(
    method: axum::http::Method,
    uri: axum::http::Uri,
    headers: axum::http::HeaderMap,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let detail = format!(
        "no such endpoint: {method} {}; the endpoints are listed at /docs and /openapi.json",
        uri.path()
    );
    if wants_html(&headers) {
        return (
            axum::http::StatusCode::NOT_FOUND,
            Html(dashboard::page::error_page("Not found", &detail)),
        )
            .into_response();
    }
    super::problem::Problem::new(axum::http::StatusCode::NOT_FOUND, detail).into_response()
}

/// 405 for a method a route does not take (axum adds the `Allow` header).
async fn method_not_allowed(
    method: axum::http::Method,
    uri: axum::http::Uri,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    super::problem::Problem::new(
        axum::http::StatusCode::METHOD_NOT_ALLOWED,
        format!(
            "{} does not take {method}; its methods are listed at /docs and /openapi.json",
            uri.path()
        ),
    )
    .into_response()
}

/// The interactive API documentation page (`GET /docs`): a page and a script of this binary
/// (no external asset) that render `/openapi.json` and send GET requests.
const DOCS_HTML: &str = include_str!("docs.html");

async fn docs_page() -> Html<&'static str> {
    Html(DOCS_HTML)
}

fn docs_page_docs(op: TransformOperation<'_>) -> TransformOperation<'_> {
    op.summary("Interactive API documentation (HTML)")
        .description(
            "Renders this document (`/openapi.json`): every operation with its parameters, \
             bodies, answers and examples, and a form that sends GET requests from the \
             browser. Served from the binary: no external script, style or font.",
        )
        .response_with::<200, Html<String>, _>(|r| r.description("The page."))
}

/// The OpenAPI document (what `GET /openapi.json` answers).
pub fn document() -> OpenApi {
    let state = AppState::new(None, tokio::sync::mpsc::channel(1).0);
    let mut api = OpenApi::default();
    let _ = routes(&state).finish_api_with(&mut api, describe);
    super::examples::add_examples(&mut api);
    api
}

/// The document as `rlc openapi` prints it and `docs/openapi.json` holds it.
pub fn document_json() -> String {
    let mut s = serde_json::to_string_pretty(&document()).expect("the document serialises");
    s.push('\n');
    s
}

// A plain response: the document is described as any JSON, not by the schema of its types.
async fn serve_document(Extension(api): Extension<Arc<OpenApi>>) -> axum::response::Response {
    use axum::response::IntoResponse;
    Json(api).into_response()
}

fn describe(api: TransformOpenApi) -> TransformOpenApi {
    api.info(Info {
        title: "rlc serve".into(),
        version: env!("CARGO_PKG_VERSION").into(),
        description: Some(
            "The HTTP API of the Rate Limit Configurator daemon: runs, the shadow-mode \
             dashboard, health and metrics. Errors are problem details \
             (`application/problem+json`, RFC 9457). Authentication: `docs/rlc-api.md`."
                .into(),
        ),
        ..Info::default()
    })
    .security_scheme(
        BEARER,
        SecurityScheme::Http {
            scheme: "bearer".into(),
            bearer_format: None,
            description: Some(
                "The write token (env var named by `server.token_env`) for mutating endpoints; \
                 the read token (`server.read_token_env`) or the write token for read \
                 endpoints when a read token is configured."
                    .into(),
            ),
            extensions: Default::default(),
        },
    )
}

/// The `application/problem+json` response of [`CompatProblem`], described as `what`.
fn problem_response(what: &str) -> Response {
    let mut r = aide::generate::in_context(|ctx| {
        CompatProblem::operation_response(ctx, &mut Default::default())
    })
    .unwrap_or_default();
    r.description = what.into();
    r
}

fn responses<'a>(
    op: &'a mut TransformOperation<'_>,
) -> &'a mut indexmap::IndexMap<Status, ReferenceOr<Response>> {
    &mut op
        .inner_mut()
        .responses
        .get_or_insert_with(Default::default)
        .responses
}

/// Adds a problem answer with `status`.
pub fn problem<'t>(
    mut op: TransformOperation<'t>,
    status: u16,
    what: &str,
) -> TransformOperation<'t> {
    responses(&mut op).insert(
        Status::Code(status),
        ReferenceOr::Item(problem_response(what)),
    );
    op
}

/// Adds header `name` (a string, `required` or not) to the answer with `status`.
fn header<'t>(
    mut op: TransformOperation<'t>,
    status: u16,
    name: &str,
    what: &str,
    required: bool,
) -> TransformOperation<'t> {
    if let Some(ReferenceOr::Item(r)) = responses(&mut op).get_mut(&Status::Code(status)) {
        let schema = aide::generate::in_context(|ctx| ctx.schema.subschema_for::<String>());
        r.headers.insert(
            name.into(),
            ReferenceOr::Item(Header {
                description: Some(what.into()),
                style: HeaderStyle::Simple,
                required,
                deprecated: None,
                format: ParameterSchemaOrContent::Schema(SchemaObject {
                    json_schema: schema,
                    example: None,
                    external_docs: None,
                }),
                example: None,
                examples: Default::default(),
                extensions: Default::default(),
            }),
        );
    }
    op
}

fn unauthorized(op: TransformOperation<'_>) -> TransformOperation<'_> {
    header(
        problem(
            op,
            401,
            "No bearer token, a malformed one, or an unknown one.",
        ),
        401,
        "WWW-Authenticate",
        "`Bearer realm=\"rlc\"` (with `error=\"invalid_token\"` when a token was presented).",
        true,
    )
}

/// Applies `f` to every operation of a path item.
fn each_operation<'t>(
    mut p: TransformPathItem<'t>,
    f: impl Fn(TransformOperation<'_>) -> TransformOperation<'_>,
) -> TransformPathItem<'t> {
    let item = p.inner_mut();
    for op in [
        &mut item.get,
        &mut item.put,
        &mut item.post,
        &mut item.delete,
        &mut item.patch,
    ]
    .into_iter()
    .flatten()
    {
        let _ = f(TransformOperation::new(op));
    }
    p
}

/// Docs of a route in the read group (see [`read_access`]).
pub fn read_docs(p: TransformPathItem<'_>) -> TransformPathItem<'_> {
    each_operation(p, read_access)
}

/// Docs of a route in the read group behind the queries' [`ConcurrencyLimit`].
pub fn limited_read_docs(p: TransformPathItem<'_>) -> TransformPathItem<'_> {
    each_operation(p, |op| saturated(read_access(op)))
}

/// Docs of a route in the write group (see [`write_access`]).
pub fn write_docs(p: TransformPathItem<'_>) -> TransformPathItem<'_> {
    each_operation(p, write_access)
}

/// Docs of an endpoint in the read group: the bearer token is optional (needed only when a
/// read token is configured), 401 without a good one then.
pub fn read_access(mut op: TransformOperation<'_>) -> TransformOperation<'_> {
    let sec = &mut op.inner_mut().security;
    sec.push(Default::default());
    sec.push([(BEARER.to_string(), Vec::new())].into_iter().collect());
    unauthorized(op)
}

/// Docs of an endpoint in the write group: the write token; 401 without a good one, 403 for
/// the read token.
pub fn write_access(op: TransformOperation<'_>) -> TransformOperation<'_> {
    let op = unauthorized(op.security_requirement(BEARER));
    problem(
        op,
        403,
        "The read token cannot do this: it needs the write token. Or the server has no write \
         token configured (rlc.yaml `server.token_env` unset or empty): the endpoint is not \
         enabled, whatever the request carries.",
    )
}

/// Docs of an endpoint behind a [`ConcurrencyLimit`]: 429 with `Retry-After`.
pub fn saturated(op: TransformOperation<'_>) -> TransformOperation<'_> {
    header(
        problem(
            op,
            429,
            "Too many requests in flight on this endpoint group.",
        ),
        429,
        "Retry-After",
        "Seconds to wait before retrying.",
        true,
    )
}

/// The answers of a dashboard endpoint that reads the store: not connected yet, unreachable
/// or too slow (503), a refused query (500); `detail` names what could not be loaded.
fn store_errors(op: TransformOperation<'_>) -> TransformOperation<'_> {
    let op = problem(
        op,
        503,
        "The store is not connected yet, is unreachable, or did not answer within \
         `store.query_timeout`; `detail` names what could not be loaded.",
    );
    problem(
        op,
        500,
        "The store refused a query; `detail` names what could not be loaded and the store's \
         error.",
    )
}

fn store_failed(op: TransformOperation<'_>) -> TransformOperation<'_> {
    problem(
        op,
        500,
        "The store query failed (details in the daemon log).",
    )
}

/// A page that renders the store's errors itself, as HTML with the status.
fn html_store_errors(op: TransformOperation<'_>) -> TransformOperation<'_> {
    op.response_with::<503, Html<String>, _>(|r| {
        r.description(
            "The store is not connected yet, is unreachable, or did not answer within \
             `store.query_timeout`: the page shows what loaded and names what did not.",
        )
    })
    .response_with::<500, Html<String>, _>(|r| {
        r.description(
            "The store refused a query: the page shows what loaded and names what did not, \
             with the store's error.",
        )
    })
}

fn page_docs(op: TransformOperation<'_>) -> TransformOperation<'_> {
    let op = op
        .summary("Dashboard overview (HTML)")
        .description(
            "One server-rendered page: every bucket of the config repo and every bucket that \
             reported, most in need of attention first (enforced buckets dropping real \
             requests, shadow buckets that would drop, stale, silent, ok), filtered by \
             `service`, `mode` and `verdict`, and the recent runs. No script; every value \
             escaped. A bad `window`, `mode` or `verdict`, or a store that is unavailable, \
             renders the page with the error and status 400 / 503 / 500.",
        )
        .response_with::<200, Html<String>, _>(|r| r.description("The dashboard."));
    let op = html_store_errors(op);
    let op = problem(
        op,
        400,
        "A query parameter of the wrong type (problem details), or a bad `window`, `mode` or \
         `verdict` (the page, as HTML, with the error).",
    );
    html_too(op, 400)
}

/// Adds the HTML page as a second media type of the `status` answer (a page that renders its
/// own error).
fn html_too(mut op: TransformOperation<'_>, status: u16) -> TransformOperation<'_> {
    if let Some(ReferenceOr::Item(r)) = responses(&mut op).get_mut(&Status::Code(status)) {
        let html = aide::generate::in_context(|ctx| {
            <Html<String> as OperationOutput>::operation_response(ctx, &mut Default::default())
        });
        if let Some(html) = html {
            r.content.extend(html.content);
        }
    }
    op
}

fn shadow_docs(op: TransformOperation<'_>) -> TransformOperation<'_> {
    let op = op
        .summary("Shadow-mode summary per bucket")
        .description(
            "Reports received within `window`, per bucket, largest virtual-drop share first; \
             `would_throttle` when enforcing the bucket as configured would refuse more than \
             `would_throttle_share` of its traffic.",
        )
        .response_with::<200, Json<ShadowSummary>, _>(|r| r.description("The summary."));
    let op = problem(
        op,
        400,
        "A bad `window` (e.g. `1h`, `7d`; 1 s to 30 d) or parameter.",
    );
    store_errors(op)
}

fn bucket_page_docs(op: TransformOperation<'_>) -> TransformOperation<'_> {
    let op = op
        .summary("One bucket over a window (HTML)")
        .description(
            "The limit in force (the config repo's base branch), incident overrides acting \
             on the bucket, offered, admitted, limit and virtual or real drops as \
             server-rendered SVG charts in requests/s (one per scope key; a minute without a \
             report is a gap, never zero), the readiness figures and verdict, and the bucket's \
             quota history. A bad `window` or a store that is unavailable renders the page \
             with the error.",
        )
        .response_with::<200, Html<String>, _>(|r| r.description("The bucket page."))
        .response_with::<404, Html<String>, _>(|r| {
            r.description(
                "No such bucket: not in the config repo (when the server has one), and no \
                 report or recorded change in the store.",
            )
        });
    let op = html_store_errors(op);
    let op = problem(
        op,
        400,
        "A malformed path or query (problem details), or a bad `window` (the page, as HTML, \
         with the error).",
    );
    html_too(op, 400)
}

fn run_page_docs(op: TransformOperation<'_>) -> TransformOperation<'_> {
    let op = op
        .summary("One run (HTML)")
        .description(
            "The run's status, commit and pull request (linked to the forge), the bucket \
             changes it recorded, what it held or left for review and why, per-service \
             outcomes and its whole summary. Its JSON is `GET /v1/runs/{id}`.",
        )
        .response_with::<200, Html<String>, _>(|r| r.description("The run page."))
        .response_with::<404, Html<String>, _>(|r| r.description("No run with this id."));
    let op = html_store_errors(op);
    problem(op, 400, "A malformed path (an id that is not a number).")
}

fn bucket_json_docs(op: TransformOperation<'_>) -> TransformOperation<'_> {
    let op = op
        .summary("One bucket over a window (JSON)")
        .description(
            "The bucket page's data: per scope key the per-step series (null where no report \
             arrived), the readiness figures (time in shadow, coverage, virtual-drop share, \
             peak share and when, suggested limit) and verdict, and the quota history.",
        )
        .response_with::<200, Json<dashboard::bucket::BucketDetail>, _>(|r| {
            r.description("The bucket.")
        });
    let op = problem(op, 400, "A bad `window` (1 s to 30 d) or a malformed path.");
    let op = problem(
        op,
        404,
        "No such bucket: not in the config repo (when the server has one), and no report or \
         recorded change in the store.",
    );
    store_errors(op)
}

/// The answers every quota endpoint shares: its own concurrency bound, a store or config repo
/// not ready yet, and a bad query string.
fn quota_errors(op: TransformOperation<'_>) -> TransformOperation<'_> {
    let op = problem(
        op,
        400,
        "An unknown or malformed query parameter, or a malformed path.",
    );
    let op = saturated(op);
    problem(
        op,
        503,
        "The quota API has no plan yet (the config repo is not synced, or the store is not \
         connected).",
    )
}

fn previews_docs(op: TransformOperation<'_>) -> TransformOperation<'_> {
    let op = op
        .summary("What-if preview")
        .description(
            "The plan a run would write if `rlc/policies.yaml`, `rlc/contracts.yaml` or \
             `rlc/capacity.yaml` were replaced or merge-patched as the body says (JSON, or \
             YAML with a YAML content type), optionally for some services only: the plan, its \
             diff against the current plan, and both scored on the held-out end of the \
             history. Writes nothing.",
        )
        .input::<Json<rlc_plan::whatif::Request>>()
        .response_with::<200, Json<rlc_plan::whatif::PreviewAnswer>, _>(|r| {
            r.description("The preview.")
        });
    let mut op = op;
    // No body at all previews the current inputs.
    if let Some(ReferenceOr::Item(b)) = op.inner_mut().request_body.as_mut() {
        b.required = false;
    }
    let op = problem(
        op,
        400,
        "A body that does not parse, or of the wrong shape.",
    );
    let op = problem(op, 413, "A body over 1 MiB.");
    let op = problem(op, 415, "A content type other than JSON or YAML.");
    let op = problem(
        op,
        422,
        "What-if inputs that fail validation (every problem with file, line and key), or \
         services that do not exist.",
    );
    let op = saturated(op);
    let op = problem(
        op,
        503,
        "No current plan yet (the config repo is not synced).",
    );
    problem(
        op,
        500,
        "The preview could not be computed (details in the daemon log).",
    )
}

fn quotas_docs(op: TransformOperation<'_>) -> TransformOperation<'_> {
    let op = op
        .summary("Every bucket's current and proposed limit")
        .description(
            "The plan a run would write now, computed from the daemon's history snapshot and \
             the config repo's base branch (the decrease guard included: a held decrease shows \
             the current limit and why). `refresh=true` re-pulls the history first; concurrent \
             refreshes share one pull. Same bucket shape as `rlc preview --format json`.",
        )
        .response_with::<200, Json<quotas::QuotasResponse>, _>(|r| r.description("The plan."));
    let op = problem(op, 404, "`service` names no service of the plan.");
    quota_errors(op)
}

fn service_docs(op: TransformOperation<'_>) -> TransformOperation<'_> {
    let op = op
        .summary("One service's buckets with their evidence")
        .description(
            "As `GET /v1/quotas?service=`, with per-bucket details: the peak and when, the \
             statistic used, the forecast bound, headroom, capacity share, coverage, and the \
             value a rail capped the limit from.",
        )
        .response_with::<200, Json<quotas::ServiceQuotas>, _>(|r| r.description("The service."));
    let op = problem(
        op,
        404,
        "No such service in the config repo or the history.",
    );
    quota_errors(op)
}

fn quota_history_docs(op: TransformOperation<'_>) -> TransformOperation<'_> {
    let op = op
        .summary("A bucket's quota history")
        .description(
            "Every recorded change of the bucket (the most recent 1000, oldest first): when, \
             which run and commit, old → new limit, and why.",
        )
        .response_with::<200, Json<quotas::BucketHistory>, _>(|r| r.description("The history."));
    let op = problem(
        op,
        404,
        "No recorded change and no such bucket in the latest plan.",
    );
    let op = store_failed(op);
    quota_errors(op)
}

fn runs_docs(op: TransformOperation<'_>) -> TransformOperation<'_> {
    let op = op
        .summary("Recent runs")
        .description("The recorded runs, newest first (`limit`: default 20, at most 200).")
        .response_with::<200, Json<RunsPage>, _>(|r| r.description("The runs."));
    let op = problem(op, 400, "A query parameter of the wrong type.");
    store_errors(op)
}

fn last_docs(op: TransformOperation<'_>) -> TransformOperation<'_> {
    let op = op
        .summary("The last run this daemon finished")
        .response_with::<200, Json<RunOutcome>, _>(|r| r.description("Its outcome."));
    problem(op, 404, "No run has finished since the daemon started.")
}

fn run_docs(op: TransformOperation<'_>) -> TransformOperation<'_> {
    let op = op
        .id(GET_RUN)
        .summary("One run's state")
        .description(
            "`id` is the `run_uid` that `POST /v1/runs` answered (also in its `Location`), or \
             the store's numeric `id` from `GET /v1/runs`. `state`: queued, running or \
             finished (then `status` and the outcome or the stored record).",
        )
        .response_with::<200, Json<RunStatusView>, _>(|r| r.description("The run."));
    let op = problem(op, 400, "A malformed path.");
    let op = problem(op, 404, "No run with this id.");
    let op = problem(
        op,
        503,
        "Not in memory, and the store is not available yet to look further.",
    );
    store_failed(op)
}

fn trigger_docs(op: TransformOperation<'_>) -> TransformOperation<'_> {
    let mut op = op
        .summary("Start a run")
        .description(
            "Queues a run, or joins the one already queued (`coalesced`). Answers its \
             `run_uid` and `Location: /v1/runs/{run_uid}` to follow it. The body is optional: \
             none, or an empty JSON object (at most 4 KiB).",
        )
        .response_with::<202, Json<Queued>, _>(|r| r.description("Queued."));
    if let Some(ReferenceOr::Item(body)) = op.inner_mut().request_body.as_mut() {
        body.required = false;
    }
    // `Option<BoundedJson>` does not pass on the body's refusals: listed here.
    let op = problem(op, 400, "Malformed JSON.");
    let op = problem(op, 413, "The body is longer than 4 KiB.");
    let op = problem(op, 415, "A body that is not `application/json`.");
    let op = problem(op, 422, "JSON that is not an empty object.");
    let mut op = header(
        op,
        202,
        "Location",
        "`/v1/runs/{run_uid}`: where the run's state is.",
        true,
    );
    // The link tells clients (and API testers) where the answered id leads.
    if let Some(ReferenceOr::Item(r)) = responses(&mut op).get_mut(&Status::Code(202)) {
        r.links.insert(
            "run".into(),
            ReferenceOr::Item(aide::openapi::Link {
                description: Some("The state of the run this request queued or joined.".into()),
                operation: aide::openapi::LinkOperation::OperationId(GET_RUN.into()),
                request_body: None,
                parameters: [("id".to_string(), "$response.body#/run_uid".into())]
                    .into_iter()
                    .collect(),
                server: None,
                extensions: Default::default(),
            }),
        );
    }
    let op = problem(
        op,
        409,
        "This replica is not the active scheduler; ask another replica.",
    );
    let op = problem(
        op,
        503,
        "Shutting down, or a run is being handed over; retry.",
    );
    op
}

fn healthz_docs(op: TransformOperation<'_>) -> TransformOperation<'_> {
    op.summary("Liveness")
        .response_with::<200, String, _>(|r| r.description("`ok`: the process answers."))
}

fn readyz_docs(op: TransformOperation<'_>) -> TransformOperation<'_> {
    op.summary("Readiness")
        .description(
            "Ready when rlc.yaml is loaded and the daemon started, and the store answers \
             (within 2 s); `role` says whether this replica is the active scheduler \
             (`leader`) or a `standby` (both serve every read). Every check is in `checks`.",
        )
        .response_with::<200, Json<grl_server::http_util::Readiness>, _>(|r| {
            r.description("Ready.")
        })
        .response_with::<503, Json<grl_server::http_util::Readiness>, _>(|r| {
            r.description("Not ready: `reason` names the failed checks.")
        })
}

fn metrics_docs(op: TransformOperation<'_>) -> TransformOperation<'_> {
    let mut op = op
        .summary("Prometheus metrics")
        .description("OpenMetrics text exposition (`docs/metrics.md` lists every series).")
        .response_with::<200, String, _>(|r| r.description("The metrics."));
    // The body is text, in the OpenMetrics media type rather than plain text.
    if let Some(ReferenceOr::Item(r)) = responses(&mut op).get_mut(&Status::Code(200)) {
        let media = std::mem::take(&mut r.content)
            .into_iter()
            .next()
            .map(|(_, m)| m);
        r.content.insert(
            grl_client::metrics::CONTENT_TYPE_OPENMETRICS.to_string(),
            media.unwrap_or_default(),
        );
    }
    op
}

fn document_docs(op: TransformOperation<'_>) -> TransformOperation<'_> {
    op.summary("This OpenAPI document")
        .response_with::<200, Json<serde_json::Value>, _>(|r| {
            r.description("The OpenAPI 3.1 document of this API.")
        })
}
