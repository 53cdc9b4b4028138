//! One run as an HTML page, `GET /runs/{id}` (the overview links each run here; its JSON is
//! `GET /v1/runs/{id}`): status, commit and pull request, the bucket changes it recorded,
//! what it held or left for review and why, per-service outcomes and its whole summary.

use axum::extract::State;
use axum::response::{Html, IntoResponse, Response};
use maud::{html, Markup, DOCTYPE};
use schemars::JsonSchema;
use serde::Deserialize;

use super::super::limits::Path;
use super::chart::CHART_CSS;
use super::overview::name_html;
use super::page::error_page;
use super::{encoded, load, pull_request_html, rate, when, DashError, Links, CSS};
use crate::serve::AppState;
use crate::store::{ChangeState, RunChange, RunRecord};

/// Changes listed on a run's page at most.
const MAX_RUN_CHANGES: i64 = 500;

/// Path of `GET /runs/{id}`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct RunPath {
    /// The store's numeric id of the run (`GET /v1/runs` lists them).
    pub id: i64,
}

/// `GET /runs/{id}`: the run's page; 404 (an HTML page) when the store has no such run.
pub(in crate::serve) async fn run_page(
    State(s): State<AppState>,
    Path(RunPath { id }): Path<RunPath>,
) -> Response {
    let links = s.links();
    let res = async {
        let store = s.store().ok_or(DashError::NoStore)?;
        let limit = s.query_timeout();
        let run = load("/runs/{id}", "the run", limit, store.run_by_id(id)).await?;
        let run = run.ok_or_else(|| DashError::NotFound(format!("no run with id {id}")))?;
        let changes = load(
            "/runs/{id}",
            "the run's changes",
            limit,
            store.run_changes(id, MAX_RUN_CHANGES),
        )
        .await?;
        // The rollouts of the changes this run committed (best effort: absent when the store
        // cannot say in time).
        let now = chrono::Utc::now();
        let rollouts: Vec<crate::rollout::RolloutView> = match &run.commit_sha {
            Some(sha) => crate::store::within(limit, store.recent_rollouts(None, 1000))
                .await
                .unwrap_or_default()
                .iter()
                .filter_map(crate::rollout::Rollout::from_row)
                .filter(|r| &r.version == sha)
                .map(|r| r.view(now))
                .collect(),
            None => Vec::new(),
        };
        Ok::<_, DashError>((run, changes, rollouts))
    }
    .await;
    match res {
        Ok((run, changes, rollouts)) => {
            Html(render(&run, &changes, &rollouts, &links)).into_response()
        }
        Err(e) => (
            e.status(),
            Html(error_page(&format!("Run {id}"), &e.message())),
        )
            .into_response(),
    }
}

/// The lines of a run's summary that say what it held or left for review, and why.
fn held_lines(summary: &str) -> Vec<&str> {
    // The first line is the run's status line (`rlc run (schedule): held`).
    summary
        .lines()
        .skip(1)
        .map(str::trim)
        .filter(|l| {
            let l = l.to_ascii_lowercase();
            l.contains("held") || l.contains("review") || l.contains("pending")
        })
        .collect()
}

/// A run's page: its facts, what it changed, its rollouts, what it held and why, its
/// services' outcomes and its whole summary.
fn render(
    r: &RunRecord,
    changes: &[RunChange],
    rollouts: &[crate::rollout::RolloutView],
    links: &Links,
) -> String {
    let services: Vec<serde_json::Value> = serde_json::from_str(&r.services).unwrap_or_default();
    let held = held_lines(&r.summary);
    html! {
        (DOCTYPE)
        html lang="en" {
            (super::head(&format!("RLC run {} — {}", r.id, r.status), &[CSS, CHART_CSS]))
            body {
                header {
                    h1 { "Run " (r.id) " · " (r.status) }
                    p {
                        a href="/" { "← all buckets" }
                        " · " a href={ "/v1/runs/" (r.id) } { "JSON" }
                    }
                }
                main {
                    (facts_section(r, links))
                    (changes_section(changes))
                    (rollouts_section(rollouts))
                    (held_section(&held))
                    (services_section(&services))
                    section id="summary" {
                        h2 { "Summary" }
                        pre class="summary" { (r.summary) }
                    }
                }
            }
        }
    }
    .into_string()
}

/// The run's facts: status, trigger, times, commit, pull request, version; its error if any.
fn facts_section(r: &RunRecord, links: &Links) -> Markup {
    html! {
        section id="run" {
            table class="facts" {
                tbody {
                    tr { th { "Status" } td { span class={ "badge " (r.status) } id="status" { (r.status) } } }
                    tr { th { "Trigger" } td { (r.trigger) } }
                    tr { th { "Started (UTC)" } td { (when(r.started_at)) } }
                    tr { th { "Finished (UTC)" } td { (when(r.finished_at)) } }
                    tr {
                        th { "Commit" }
                        td id="commit" {
                            @match &r.commit_sha {
                                Some(c) => { (links.commit_html(c)) }
                                None => { span class="muted" { "none" } }
                            }
                        }
                    }
                    tr {
                        th { "Pull request" }
                        td id="pull-request" {
                            @match r.pull_request() {
                                Some(pr) => { (pull_request_html(&pr)) }
                                None => { span class="muted" { "none" } }
                            }
                        }
                    }
                    tr {
                        th { "Controller version" }
                        td { (r.version_pushed.as_deref().unwrap_or("—")) }
                    }
                    @if let Some(run_uid) = &r.run_uid {
                        tr { th { "Run id" } td { code { (run_uid) } } }
                    }
                }
            }
            @if let Some(e) = &r.error {
                p class="err" id="error" { "Error: " (e) }
            }
        }
    }
}

/// The bucket changes the run recorded.
fn changes_section(changes: &[RunChange]) -> Markup {
    let opt = |v: Option<f64>| v.map(rate).unwrap_or_else(|| "—".into());
    html! {
        section id="changes" {
            h2 { "What changed" }
            @if changes.is_empty() {
                p class="muted" { "No bucket change recorded by this run." }
            } @else {
                div class="scroll" {
                    table {
                        thead {
                            tr {
                                th { "Service" } th { "Bucket" } th { "Change" }
                                th class="num" { "Before rps" } th class="num" { "After rps" }
                                th { "Mode" } th { "Policy" }
                            }
                        }
                        tbody {
                            @for c in changes {
                                @let proposed = c.state == ChangeState::Proposed;
                                tr class=[proposed.then_some("proposed")] data-bucket=(c.bucket) {
                                    td class="name" { (name_html(&c.service)) }
                                    td class="name" {
                                        a href={ "/buckets/" (encoded(&c.service)) "/" (encoded(&c.bucket)) } {
                                            code { (name_html(&c.bucket)) }
                                        }
                                    }
                                    td {
                                        (c.change)
                                        @if proposed { " (proposed, waiting for review)" }
                                    }
                                    td class="num" { (opt(c.previous_limit_rps)) }
                                    td class="num" { (opt(c.limit_rps)) }
                                    td { (c.mode.as_deref().unwrap_or("")) }
                                    td { (c.policy.as_deref().unwrap_or("")) }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The rollouts the run started or moved, if any.
fn rollouts_section(rollouts: &[crate::rollout::RolloutView]) -> Markup {
    html! {
        @if !rollouts.is_empty() {
            section id="rollouts" {
                h2 { "Rollouts" }
                ul class="why" {
                    @for ro in rollouts {
                        li data-bucket=(ro.bucket) {
                            code { (name_html(&ro.service)) "/" (name_html(&ro.bucket)) }
                            " (" (super::prose(&ro.change)) "): " (super::prose(&ro.summary))
                            @if let Some(how) = &ro.revert { " — " (super::prose(how)) }
                        }
                    }
                }
            }
        }
    }
}

/// What the run held, left pending or for review, and why, if anything.
fn held_section(held: &[&str]) -> Markup {
    html! {
        @if !held.is_empty() {
            section id="held" class="notice" {
                h2 { "Held, pending or needs review" }
                ul class="why" {
                    @for l in held { li { (super::prose(l)) } }
                }
            }
        }
    }
}

/// Each service's outcome and details, if the run recorded any.
fn services_section(services: &[serde_json::Value]) -> Markup {
    html! {
        @if !services.is_empty() {
            section id="services" {
                h2 { "Services" }
                table {
                    thead { tr { th { "Service" } th { "Outcome" } th { "Details" } } }
                    tbody {
                        @for v in services {
                            tr {
                                td class="name" { (name_html(v["service"].as_str().unwrap_or(""))) }
                                td { (v["outcome"].as_str().unwrap_or("")) }
                                td {
                                    @if let Some(o) = v.as_object() {
                                        @for (k, val) in o.iter().filter(|(k, _)| *k != "service" && *k != "outcome") {
                                            @if !val.is_null() {
                                                span class="muted" { (k) ": " }
                                                (val.as_str().map(str::to_string).unwrap_or_else(|| val.to_string()))
                                                " "
                                            }
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}
