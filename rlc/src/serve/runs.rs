//! Manual runs and run status: `POST /v1/runs` queues a run and answers its id (`run_uid`) with
//! `Location: /v1/runs/{run_uid}`; `GET /v1/runs/{id}` answers that run's state (queued,
//! running, finished with its outcome), so a caller follows its own run instead of racing on
//! `GET /v1/runs/last`.
//!
//! Ids are given out by the daemon ([`crate::cycle::new_run_uid`]) before the run starts and
//! stored with the run record, so a finished run is found in the store after a restart or on
//! another replica. Queued and running runs, and the last [`KEPT_OUTCOMES`] finished ones,
//! are known from memory.

use std::collections::VecDeque;

use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use super::dashboard::RunView;
use super::limits::{BoundedJson, Path};
use super::problem::CompatProblem;
use super::AppState;
use crate::cycle::{new_run_uid, RunOutcome};

/// Finished outcomes kept in memory for `GET /v1/runs/{id}` (older ones come from the store).
pub const KEPT_OUTCOMES: usize = 64;
/// Longest `POST /v1/runs` body.
const MAX_RUN_BODY: usize = 4 * 1024;

/// A run the scheduler is asked to make.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunRequest {
    /// Why (`api`, ...).
    pub trigger: String,
    /// Its id, given out before it starts.
    pub run_uid: String,
}

/// Runs the daemon knows of without the store.
#[derive(Default)]
pub(super) struct RunBook {
    /// The API run waiting for the scheduler (at most one: later requests join it).
    queued: Option<(RunRequest, DateTime<Utc>)>,
    /// The run in progress.
    running: Option<(RunRequest, DateTime<Utc>)>,
    /// Finished runs, oldest first.
    done: VecDeque<RunOutcome>,
}

impl RunBook {
    pub(super) fn started(&mut self, req: &RunRequest) {
        if self.queued.as_ref().is_some_and(|(q, _)| q == req) {
            self.queued = None;
        }
        self.running = Some((req.clone(), Utc::now()));
    }

    pub(super) fn finished(&mut self, out: &RunOutcome) {
        self.running = None;
        if self.done.len() == KEPT_OUTCOMES {
            self.done.pop_front();
        }
        self.done.push_back(out.clone());
    }

    /// A queued request the scheduler dropped (this replica lost the lead).
    pub(super) fn dropped(&mut self, req: &RunRequest) {
        if self.queued.as_ref().is_some_and(|(q, _)| q == req) {
            self.queued = None;
        }
    }
}

/// Where a run is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum RunState {
    /// Waiting for the scheduler.
    Queued,
    /// In progress.
    Running,
    /// Done; `status` says how it went.
    Finished,
}

/// The body of `POST /v1/runs`: optional; an empty object (no option yet).
#[derive(Debug, Default, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct RunOptions {}

// By hand: serde's derive takes `[]` for a struct without fields too; this is an object.
impl<'de> Deserialize<'de> for RunOptions {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<RunOptions, D::Error> {
        let m = serde_json::Map::<String, serde_json::Value>::deserialize(d)?;
        match m.keys().next() {
            Some(k) => Err(serde::de::Error::unknown_field(k, &[])),
            None => Ok(RunOptions {}),
        }
    }
}

/// The answer of `POST /v1/runs` (202).
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct Queued {
    /// Always true: a run will follow.
    pub queued: bool,
    /// True when a run was already waiting: this request joins it (same inputs). Absent
    /// otherwise.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub coalesced: bool,
    /// The run's id: `GET /v1/runs/{run_uid}` follows it.
    pub run_uid: String,
    /// `/v1/runs/{run_uid}`, also in the `Location` header.
    pub location: String,
}

/// The answer of `GET /v1/runs/{id}`.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct RunStatusView {
    /// The run's id (null for a run recorded before run ids existed).
    pub run_uid: Option<String>,
    /// The store's id of the run, once recorded.
    pub id: Option<i64>,
    /// queued | running | finished.
    pub state: RunState,
    /// Why it runs: `api`, `schedule`, `inputs-changed`, `once`.
    pub trigger: String,
    /// When it was queued (API runs, while queued).
    pub queued_at: Option<DateTime<Utc>>,
    /// When it started.
    pub started_at: Option<DateTime<Utc>>,
    /// When it finished.
    pub finished_at: Option<DateTime<Utc>>,
    /// How it ended, once finished: success | unchanged | pending | held | failed (`pending`:
    /// the commit stands, the controller push or the record is still pending).
    pub status: Option<String>,
    /// The full outcome (as `GET /v1/runs/last` shows it), while this daemon remembers it.
    pub outcome: Option<RunOutcome>,
    /// The stored record (as `GET /v1/runs` lists it), once recorded.
    pub record: Option<RunView>,
}

fn location(run_uid: &str) -> String {
    format!("/v1/runs/{run_uid}")
}

fn accepted(body: Queued) -> Response {
    let mut r = (StatusCode::ACCEPTED, Json(&body)).into_response();
    if let Ok(v) = HeaderValue::from_str(&body.location) {
        r.headers_mut().insert(header::LOCATION, v);
    }
    r
}

/// `POST /v1/runs` (write token, checked before the body is read): queues a run, or joins
/// the one already queued. 202 with the run's id and `Location`; 409 on a replica that is
/// not the active scheduler; 503 while shutting down.
pub(super) async fn trigger_run(
    State(s): State<AppState>,
    // Read (bounded) for its refusals only: no option yet.
    _body: Option<BoundedJson<RunOptions, MAX_RUN_BODY>>,
) -> Response {
    if !s.is_leader() {
        return CompatProblem::new(
            StatusCode::CONFLICT,
            "this replica is not the active scheduler; ask another replica",
        )
        .into_response();
    }
    let mut book = s.inner.book.lock().unwrap();
    if let Some((q, _)) = &book.queued {
        // A run is already queued: it will see the same inputs, so this one joins it.
        return accepted(Queued {
            queued: true,
            coalesced: true,
            location: location(&q.run_uid),
            run_uid: q.run_uid.clone(),
        });
    }
    let req = RunRequest {
        trigger: "api".into(),
        run_uid: new_run_uid(),
    };
    match s.inner.trigger.try_send(req.clone()) {
        Ok(()) => {
            book.queued = Some((req.clone(), Utc::now()));
            accepted(Queued {
                queued: true,
                coalesced: false,
                location: location(&req.run_uid),
                run_uid: req.run_uid,
            })
        }
        // Only this function sends, under the book's lock, and `queued` is cleared only once
        // the scheduler has received the request: with nothing queued the channel is empty.
        // Should that ever not hold, the caller retries rather than losing track of a run.
        Err(mpsc::error::TrySendError::Full(_)) => CompatProblem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "a run is being handed to the scheduler; retry",
        )
        .into_response(),
        Err(mpsc::error::TrySendError::Closed(_)) => {
            CompatProblem::new(StatusCode::SERVICE_UNAVAILABLE, "shutting down").into_response()
        }
    }
}

/// Path of `GET /v1/runs/{id}`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct RunPath {
    /// The run's `run_uid` (as `POST /v1/runs` answered it) or the store's numeric `id` (as
    /// `GET /v1/runs` lists it).
    pub id: String,
}

fn from_memory(s: &AppState, id: &str) -> Option<RunStatusView> {
    let book = s.inner.book.lock().unwrap();
    let pending = |req: &RunRequest, state, queued_at, started_at| RunStatusView {
        run_uid: Some(req.run_uid.clone()),
        id: None,
        state,
        trigger: req.trigger.clone(),
        queued_at,
        started_at,
        finished_at: None,
        status: None,
        outcome: None,
        record: None,
    };
    if let Some((q, at)) = book.queued.as_ref().filter(|(q, _)| q.run_uid == id) {
        return Some(pending(q, RunState::Queued, Some(*at), None));
    }
    if let Some((r, at)) = book.running.as_ref().filter(|(r, _)| r.run_uid == id) {
        return Some(pending(r, RunState::Running, None, Some(*at)));
    }
    let out = book
        .done
        .iter()
        .rev()
        .find(|o| o.run_uid == id || o.run_id.is_some_and(|n| n.to_string() == id))?;
    Some(RunStatusView {
        run_uid: Some(out.run_uid.clone()),
        id: out.run_id,
        state: RunState::Finished,
        trigger: out.trigger.clone(),
        queued_at: None,
        started_at: Some(out.started_at),
        finished_at: Some(out.finished_at),
        status: Some(out.status.as_str().into()),
        outcome: Some(out.clone()),
        record: None,
    })
}

/// `GET /v1/runs/{id}`: the state of one run. 404 for an unknown id; 503 when only the store
/// could say and it is not available.
pub(super) async fn run_status(
    State(s): State<AppState>,
    Path(p): Path<RunPath>,
) -> Result<Json<RunStatusView>, CompatProblem> {
    let memory = from_memory(&s, &p.id);
    // A finished run is also looked up in the store (its record, and its store id when the
    // record was flushed later); queued and running ones are not there yet.
    if memory
        .as_ref()
        .is_some_and(|m| m.state != RunState::Finished)
    {
        return Ok(Json(memory.expect("checked")));
    }
    let stored = match s.store() {
        Some(store) => {
            let found = match p.id.parse::<i64>() {
                Ok(n) => store.run_by_id(n).await,
                Err(_) => store.run_by_uid(&p.id).await,
            };
            found.map_err(|e| {
                tracing::warn!(endpoint = "/v1/runs/{id}", error = %e, "store query failed");
                CompatProblem::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "the store query failed; see the daemon log",
                )
            })?
        }
        None => None,
    };
    match (memory, stored) {
        (Some(mut m), rec) => {
            if let Some(r) = rec {
                m.id = Some(r.id);
                m.record = Some(RunView::new(&r, &s.links()));
            }
            Ok(Json(m))
        }
        (None, Some(r)) => Ok(Json(RunStatusView {
            run_uid: r.run_uid.clone(),
            id: Some(r.id),
            state: RunState::Finished,
            trigger: r.trigger.clone(),
            queued_at: None,
            started_at: Some(r.started_at),
            finished_at: Some(r.finished_at),
            status: Some(r.status.clone()),
            outcome: None,
            record: Some(RunView::new(&r, &s.links())),
        })),
        (None, None) if s.store().is_none() => Err(CompatProblem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "no such run in memory, and the store is not available yet to look further",
        )),
        (None, None) => Err(CompatProblem::new(
            StatusCode::NOT_FOUND,
            format!("no run with id `{}`", p.id),
        )),
    }
}

/// `GET /v1/runs/last`: the outcome of the last run this daemon finished; before it finished
/// one (a daemon started since), the newest run the store holds, rebuilt from its record
/// ([`RunOutcome::from_record`]: `from_store` says so); 404 when there is none (or no store
/// to ask yet), 500 when the store query fails.
pub(super) async fn last_run(State(s): State<AppState>) -> Result<Json<RunOutcome>, CompatProblem> {
    let memory = s.inner.last.lock().unwrap().clone();
    if let Some(o) = memory {
        return Ok(Json(o));
    }
    let Some(store) = s.store() else {
        return Err(CompatProblem::new(
            StatusCode::NOT_FOUND,
            "no run yet (no store connected yet to look further)",
        ));
    };
    let newest = crate::store::within(s.query_timeout(), store.recent_runs(1))
        .await
        .map_err(|e| {
            tracing::warn!(endpoint = "/v1/runs/last", error = %e, "store query failed");
            CompatProblem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the store query failed; see the daemon log",
            )
        })?;
    match newest.first() {
        Some(r) => RunOutcome::from_record(r).map(Json).ok_or_else(|| {
            CompatProblem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!(
                    "the store's newest run (id {}) has status `{}`, which this version does not know",
                    r.id, r.status
                ),
            )
        }),
        None => Err(CompatProblem::new(
            StatusCode::NOT_FOUND,
            "no run yet: the store holds none",
        )),
    }
}
