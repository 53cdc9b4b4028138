//! What-if previews (`POST /v1/previews`): the plan a run would compute if `rlc/policies.yaml`,
//! `rlc/contracts.yaml` and/or `rlc/capacity.yaml` were replaced or patched, its difference
//! from the current plan, and the backtest of both on the held-out end of the history, so that
//! an owner sees the cost of a change before proposing it. Nothing is written: no file, no
//! git, no store.
//!
//! The body (JSON or YAML, at most [`MAX_BODY_BYTES`]) is a [`Request`]. The documents it
//! carries get exactly the checks of the files in the config repo
//! ([`schema::ConfigRepo::check_documents`]: parsed within the nesting and node limits, unknown
//! keys refused, policies checked, references across documents checked), and every problem
//! comes back with file, line and key ([`InputProblem`]): `file: "body"` with the line in the
//! body and the key's path in the body for what the body says, the repo file
//! (`rlc/contracts.yaml`, …) with its own line for a problem the change causes in a document
//! it does not touch. Problems that stop parsing (syntax, wrong shape, wrong types, unknown
//! keys, limits) answer 400; documents that parse but fail the checks, or unknown services,
//! answer 422.
//!
//! Given `services`, only those services are computed (their buckets, contracts, capacities
//! and series), so that a preview for one service of a large fleet stays fast. With or
//! without, the history is read one service at a time, as a run reads it (`View`): the plan,
//! both backtested plans (on [`crate::backtest::Training`]) and the scores each hold one
//! service's series at once, never the fleet's.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use chrono::{DateTime, TimeZone, Utc};
use schema::{
    ConfigRepo, DaemonConfig, Diagnostic, DocumentTexts, HumanDuration, Limits, Located, Locator,
    Mode, Scope,
};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_yaml::Value;

use crate::backtest::{score_plans, split_at, Score, Training};
use crate::change::ChangeKind;
use crate::history::{History, Rejected, SeriesSource, Unreadable};
use crate::pipeline::{self, Purpose, World};
use crate::plan::Plan;

/// One problem of the input, where it is: the file (`body` for the request itself), the line
/// and column (1-based; 0 when unknown), the key's path, and the message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, JsonSchema)]
pub struct InputProblem {
    /// `body`, or the config repo file the problem is in (`rlc/contracts.yaml`).
    pub file: String,
    /// Line, 1-based (0 when unknown).
    pub line: usize,
    /// Column, 1-based (0 when unknown).
    pub column: usize,
    /// The key's path (`policies.patch.default.headroom`), empty for the whole file.
    pub key: String,
    /// What is wrong, in words.
    pub message: String,
}

impl From<&schema::Diagnostic> for InputProblem {
    fn from(d: &schema::Diagnostic) -> InputProblem {
        InputProblem {
            file: d.file.to_string_lossy().into_owned(),
            line: d.line,
            column: d.column,
            key: d.key.clone(),
            message: d.message.clone(),
        }
    }
}

/// Why a what-if was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The body is larger than [`MAX_BODY_BYTES`].
    TooLarge,
    /// The body is not JSON or YAML.
    MediaType,
    /// The body cannot be read as a what-if (syntax, shape, types, unknown keys, limits).
    Unreadable,
    /// It parses, but the documents fail the checks, or a service is unknown.
    Invalid,
}

/// A refused what-if: why, in words, and every problem found with where it is.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{detail}")]
pub struct WhatIfError {
    /// The kind of refusal.
    pub refusal: Refusal,
    /// What is wrong, in words.
    pub detail: String,
    /// Every problem, with file, line and key (empty for the media type and the size).
    pub problems: Vec<InputProblem>,
}

impl WhatIfError {
    fn new(refusal: Refusal, detail: String, problems: Vec<InputProblem>) -> WhatIfError {
        WhatIfError {
            refusal,
            detail,
            problems,
        }
    }
}

/// The largest body accepted (413 above).
pub const MAX_BODY_BYTES: usize = 1 << 20;

/// The held-out window of the backtest when the request gives none.
pub const DEFAULT_HOLDOUT_SECS: i64 = 7 * 86_400;

/// The bounds on a body: the config repo's nesting limit, and fewer nodes (a 1 MiB body needs
/// far fewer than a repo file may have; aliases count the nodes they repeat).
pub const BODY_LIMITS: Limits = Limits {
    max_file_bytes: MAX_BODY_BYTES as u64,
    max_repo_bytes: MAX_BODY_BYTES as u64,
    max_nodes: 250_000,
    max_repo_nodes: 250_000,
    ..Limits::DEFAULT
};

/// What a what-if starts from: the daemon config (paths resolved), the config repo as on the
/// base branch, and the evidence the current plan was computed with (past decreases, shadow
/// figures): the what-if plan is computed as the current one is ([`pipeline::plan`]), with
/// other documents.
#[derive(Debug, Clone)]
pub struct Inputs {
    /// `rlc.yaml`, relative paths resolved.
    pub cfg: DaemonConfig,
    /// The config repo (valid: a repo with problems is never planned on).
    pub repo: ConfigRepo,
    /// The evidence gathered for the current plan.
    pub world: World,
}

/// The body of `POST /v1/previews`. Every key is optional; an empty body previews the current
/// inputs.
#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Request {
    /// Only these services (default: every service). Each must exist: have a bucket file, be
    /// named in `rlc/policies.yaml` (the what-if's, if it changes it) or have history.
    #[serde(default)]
    pub services: Option<Vec<String>>,
    /// A change of `rlc/policies.yaml`.
    #[serde(default)]
    pub policies: Option<Change>,
    /// A change of `rlc/contracts.yaml`.
    #[serde(default)]
    pub contracts: Option<Change>,
    /// A change of `rlc/capacity.yaml`.
    #[serde(default)]
    pub capacity: Option<Change>,
    /// The held-out end of the history the backtest scores on (`7d`, `36h`; default 7 days, at
    /// most half of the history).
    #[serde(default)]
    pub holdout: Option<HumanDuration>,
}

/// A change of one document: exactly one of `replace` (the whole new document, in the file's
/// format) and `patch` (a JSON merge patch, RFC 7396, over the current document: objects merge
/// key by key, `null` removes a key, anything else, lists included, replaces).
#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Change {
    /// The new document (a mapping, as the file's top level).
    #[serde(default)]
    #[schemars(with = "Option<serde_json::Map<String, serde_json::Value>>")]
    pub replace: Option<Value>,
    /// A merge patch over the current document (a mapping: its keys merge into the
    /// document's).
    #[serde(default)]
    #[schemars(with = "Option<serde_json::Map<String, serde_json::Value>>")]
    pub patch: Option<Value>,
}

/// The answer of `POST /v1/previews`.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct PreviewAnswer {
    /// The services previewed (null: every service).
    pub services: Option<Vec<String>>,
    /// The plan a run would compute with the what-if inputs: the shape of
    /// `rlc preview --format json`.
    // The plan types are documented in docs/rlc-api.md; they carry no schema of their own yet.
    #[schemars(with = "serde_json::Value")]
    pub plan: Plan,
    /// How the what-if plan differs from the current plan.
    pub diff: Diff,
    /// Both plans scored on the held-out end of the history.
    pub backtest: Backtest,
}

/// The difference between the current plan and the what-if plan.
#[derive(Debug, Clone, Default, Serialize, JsonSchema, PartialEq)]
pub struct Diff {
    /// Buckets added, removed or changed (limit, mode, scope or policy), by service and name.
    pub buckets: Vec<BucketChange>,
    /// Buckets the same in both plans.
    pub unchanged: usize,
}

/// `change` as the what-if diff has always said it: `added`, `removed`, or `changed` for a
/// bucket in both plans (raised, lowered or modified: `kind` says which).
fn coarse<S: serde::Serializer>(k: &ChangeKind, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(match k {
        ChangeKind::Added => "added",
        ChangeKind::Removed => "removed",
        ChangeKind::Raised | ChangeKind::Lowered | ChangeKind::Modified => "changed",
    })
}

/// The schema of [`coarse`]'s words.
fn coarse_schema(_: &mut schemars::gen::SchemaGenerator) -> schemars::schema::Schema {
    schemars::schema::SchemaObject {
        instance_type: Some(schemars::schema::InstanceType::String.into()),
        enum_values: Some(vec!["added".into(), "removed".into(), "changed".into()]),
        ..Default::default()
    }
    .into()
}

/// One bucket of the diff.
#[derive(Debug, Clone, Serialize, JsonSchema, PartialEq)]
pub struct BucketChange {
    /// Callee service.
    pub service: String,
    /// Bucket name.
    pub bucket: String,
    /// Added, removed or changed (limit, mode, scope or policy).
    #[serde(serialize_with = "coarse")]
    #[schemars(schema_with = "coarse_schema")]
    pub change: ChangeKind,
    /// What happened to it, in the words of every other change view: added, removed, raised,
    /// lowered or modified (same limit, other mode, scope or policy).
    pub kind: ChangeKind,
    /// The bucket in the current plan.
    pub current: Option<BucketState>,
    /// The bucket in the what-if plan.
    pub what_if: Option<BucketState>,
    /// What-if limit ÷ current plan limit, when both exist.
    pub limit_factor: Option<f64>,
}

/// The fields of a planned bucket the diff compares.
#[derive(Debug, Clone, Serialize, JsonSchema, PartialEq)]
pub struct BucketState {
    /// The limit.
    pub limit_rps: f64,
    /// `shadow` or `enforce`.
    pub mode: Mode,
    /// `global`, `region` or `zone`.
    pub scope: Scope,
    /// The policy that set the limit.
    pub policy: String,
}

/// The backtest of both plans: each computed on the history before `split`, each bucket's
/// limit scored on the traffic it saw from `split` on.
#[derive(Debug, Clone, Default, Serialize, JsonSchema, PartialEq)]
pub struct Backtest {
    /// Length of the held-out window, seconds.
    pub holdout_secs: i64,
    /// Start of the held-out window (null when there was no backtest).
    pub split: Option<DateTime<Utc>>,
    /// Why there is no backtest, when there is none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// Per bucket with traffic in the held-out window.
    pub buckets: Vec<BucketBacktest>,
}

/// One bucket's backtest under both plans.
#[derive(Debug, Clone, Serialize, JsonSchema, PartialEq)]
pub struct BucketBacktest {
    /// Callee service.
    pub service: String,
    /// Bucket name.
    pub bucket: String,
    /// Under the current inputs (null: no such bucket then).
    pub current: Option<Score>,
    /// Under the what-if inputs (null: no such bucket then).
    pub what_if: Option<Score>,
}

/// The media type of a body, from its `Content-Type` (parameters ignored).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyFormat {
    /// `application/json`.
    Json,
    /// `application/yaml`, `application/x-yaml`, `text/yaml`.
    Yaml,
}

impl BodyFormat {
    /// The format of `content_type`; None for anything else (415). A missing content type is
    /// accepted only for an empty body (see [`preview`]).
    pub fn of(content_type: &str) -> Option<BodyFormat> {
        let essence = content_type
            .split(';')
            .next()
            .unwrap_or_default()
            .trim()
            .to_ascii_lowercase();
        match essence.as_str() {
            "application/json" => Some(BodyFormat::Json),
            "application/yaml" | "application/x-yaml" | "text/yaml" => Some(BodyFormat::Yaml),
            _ => None,
        }
    }
}

/// The refusal of a body that is not JSON or YAML.
pub fn unsupported_media_type(content_type: Option<&str>) -> WhatIfError {
    WhatIfError::new(
        Refusal::MediaType,
        format!(
            "the body must be application/json or application/yaml (also application/x-yaml, text/yaml), got {}",
            content_type.map_or("no Content-Type".to_string(), |c| format!("`{c}`"))
        ),
        Vec::new(),
    )
}

/// Computes a what-if preview. `history` and `current_plan` are the daemon's (the current plan
/// is what a run would compute now, from `inputs`). Writes nothing.
pub fn preview(
    inputs: &Inputs,
    history: &dyn SeriesSource,
    current_plan: &Plan,
    body: &[u8],
    content_type: Option<&str>,
    now: DateTime<Utc>,
) -> Result<PreviewAnswer, WhatIfError> {
    if body.len() > MAX_BODY_BYTES {
        return Err(WhatIfError::new(
            Refusal::TooLarge,
            format!("the body is larger than {MAX_BODY_BYTES} bytes"),
            Vec::new(),
        ));
    }
    let empty = body.iter().all(|b| b.is_ascii_whitespace());
    let format = match content_type {
        Some(c) => Some(BodyFormat::of(c).ok_or_else(|| unsupported_media_type(Some(c)))?),
        None if empty => None,
        None => return Err(unsupported_media_type(None)),
    };
    let body = if empty {
        Body::default()
    } else {
        parse_body(body, format.unwrap_or(BodyFormat::Yaml))?
    };
    let req = &body.request;

    // The documents, as texts in the files' format: replaced, or the current one patched.
    let repo = &inputs.repo;
    let mut changes: Vec<DocChange> = Vec::new();
    let mut problems: Vec<InputProblem> = body.problems.clone();
    for (doc, change) in [
        (Doc::Policies, &req.policies),
        (Doc::Contracts, &req.contracts),
        (Doc::Capacity, &req.capacity),
    ] {
        let Some(change) = change else { continue };
        match (&change.replace, &change.patch) {
            (Some(v), None) => changes.push(DocChange::new(doc, "replace", v.clone(), None)),
            (None, Some(p)) => {
                let mut v = current_document(repo, doc);
                merge_patch(&mut v, p);
                changes.push(DocChange::new(doc, "patch", v, Some(p.clone())));
            }
            _ => problems.push(body.problem(
                doc.key(),
                "give exactly one of `replace` (a whole document) and `patch` (a merge patch)",
            )),
        }
    }
    let shape_problems = !problems.is_empty();
    let texts = {
        let mut t = DocumentTexts::default();
        for c in &changes {
            let entry = Some((c.sentinel.as_path(), c.text.as_str()));
            match c.doc {
                Doc::Policies => t.policies = entry,
                Doc::Contracts => t.contracts = entry,
                Doc::Capacity => t.capacity = entry,
            }
        }
        t
    };
    // The documents get the files' limits: they hold at most the body's nodes and the
    // current document's, which passed those limits.
    let checked = repo.check_documents(&texts, &Limits::DEFAULT);
    problems.extend(
        checked
            .problems
            .iter()
            .map(|d| map_problem(d, &changes, &body, repo)),
    );
    if shape_problems || checked.parse_problems {
        return Err(bad_request(problems));
    }

    // The what-if repo, with only the services asked for.
    let whatif_repo = ConfigRepo {
        policies: checked.policies,
        contracts: checked.contracts,
        capacity: checked.capacity,
        services_complete: checked.services_complete,
        ..ConfigRepo::default()
    };
    let only: Option<BTreeSet<String>> = match &req.services {
        None => None,
        Some(list) => {
            if list.is_empty() {
                problems.push(body.problem(
                    "services",
                    "name at least one service, or leave `services` out for every service",
                ));
            }
            for (i, s) in list.iter().enumerate() {
                let known = repo.buckets.contains_key(s)
                    || repo.unparsed_services.contains(s)
                    || whatif_repo
                        .policies
                        .as_ref()
                        .is_some_and(|p| p.value.services.contains_key(s))
                    || whatif_repo
                        .contracts
                        .as_ref()
                        .is_some_and(|c| c.value.contracts.iter().any(|c| &c.service == s))
                    || has_history(history, s);
                if !known {
                    problems.push(body.problem(
                        &format!("services[{i}]"),
                        &format!(
                            "unknown service `{s}`: no buckets/{s}.yaml, not in rlc/policies.yaml, no contract and no history"
                        ),
                    ));
                }
            }
            Some(list.iter().cloned().collect())
        }
    };
    if !problems.is_empty() {
        return Err(WhatIfError::new(
            Refusal::Invalid,
            format!(
                "the what-if inputs do not validate: {} problem(s), listed with file, line and key",
                problems.len()
            ),
            sorted(problems),
        ));
    }

    let whatif_repo = restrict_repo(repo, whatif_repo, only.as_ref());
    let current_repo = restrict_repo(
        repo,
        ConfigRepo {
            policies: repo.policies.clone(),
            contracts: repo.contracts.clone(),
            capacity: repo.capacity.clone(),
            services_complete: repo.services_complete,
            ..ConfigRepo::default()
        },
        only.as_ref(),
    );
    let view = View::new(history, only.as_ref());
    let cfg = &inputs.cfg;
    let current = restrict_plan(current_plan, only.as_ref());
    // Both backtested sides from no limit in force at the split: they differ exactly where
    // the inputs do, and each equals what `rlc backtest` scores for them.
    let holdout_asked = req
        .holdout
        .map_or(DEFAULT_HOLDOUT_SECS, |h| h.as_secs() as i64);
    // The plan, then (unless the view failed meanwhile: None) the backtest.
    let compute = |view: &View| {
        let plan = pipeline::plan(cfg, &whatif_repo, view, &inputs.world, now, Purpose::Run);
        // A service left unread by the plan (its history ambiguous) may still fail the view.
        view.read_unread();
        if view.fail() {
            return (plan, None);
        }
        let backtest = backtest(view, holdout_asked, |h, at| {
            let none = World::none();
            (
                pipeline::plan(cfg, &current_repo, h, &none, at, Purpose::Backtest),
                pipeline::plan(cfg, &whatif_repo, h, &none, at, Purpose::Backtest),
            )
        });
        (plan, Some(backtest))
    };
    let (mut plan, mut backtest) = compute(&view);
    if backtest.is_none() || view.fail() {
        // A service could not be read: the what-if's history failed as a whole, as a source
        // failure does (every service keeps its quotas, no backtest). Nothing is read again.
        (plan, backtest) = compute(&view);
    }
    let backtest = backtest.unwrap_or_default();
    let diff = diff(&current, &plan);
    Ok(PreviewAnswer {
        services: req.services.clone(),
        plan,
        diff,
        backtest,
    })
}

/// A parsed body and where its keys stand.
#[derive(Default)]
struct Body {
    request: Request,
    locator: Locator,
    /// Whether lines refer to the body (false when a JSON body had to be re-read).
    lines: bool,
    /// Problems of the body's shape (the faulty parts left out of `request`).
    problems: Vec<InputProblem>,
}

impl Body {
    /// A problem about `key` of the body.
    fn problem(&self, key: &str, message: &str) -> InputProblem {
        let pos = self.locator.pos(key);
        InputProblem {
            file: "body".into(),
            line: if self.lines { pos.line } else { 0 },
            column: if self.lines { pos.column } else { 0 },
            key: key.into(),
            message: message.into(),
        }
    }
}

/// Sorted by file (the body first), line, column and key.
fn sorted(mut problems: Vec<InputProblem>) -> Vec<InputProblem> {
    problems.sort_by(|a, b| {
        (&a.file, a.line, a.column, &a.key).cmp(&(&b.file, b.line, b.column, &b.key))
    });
    problems.dedup();
    problems
}

fn bad_request(problems: Vec<InputProblem>) -> WhatIfError {
    let problems = sorted(problems);
    WhatIfError::new(
        Refusal::Unreadable,
        format!(
            "the body cannot be read as a what-if: {} problem(s), listed with file, line and key",
            problems.len()
        ),
        problems,
    )
}

fn whole_body(line: usize, column: usize, message: String) -> InputProblem {
    InputProblem {
        file: "body".into(),
        line,
        column,
        key: String::new(),
        message,
    }
}

/// Parses the body within [`BODY_LIMITS`]: YAML through the config repo's reader (nesting and
/// node limits first, every problem with line and key); JSON checked as strict JSON first,
/// then read the same way (JSON is YAML), or, in the rare case the YAML reader refuses valid
/// JSON, re-read from the JSON value without line numbers.
fn parse_body(body: &[u8], format: BodyFormat) -> Result<Body, WhatIfError> {
    let text = std::str::from_utf8(body).map_err(|e| {
        bad_request(vec![whole_body(
            0,
            0,
            format!(
                "not UTF-8 text (invalid byte at offset {})",
                e.valid_up_to()
            ),
        )])
    })?;
    let mut json: Option<serde_json::Value> = None;
    if format == BodyFormat::Json {
        // serde_json bounds its own recursion (128 levels): no stack overflow here.
        match serde_json::from_str::<serde_json::Value>(text) {
            Ok(v) => json = Some(v),
            Err(e) => {
                return Err(bad_request(vec![whole_body(
                    e.line(),
                    e.column(),
                    format!("not valid JSON: {e}"),
                )]))
            }
        }
    }
    let file = Path::new("body");
    let parsed = schema::parse_all::<Request>(file, text, &BODY_LIMITS);
    let (parsed, lines) = match (&parsed.located, json) {
        (None, Some(v)) => {
            let yaml = serde_yaml::to_string(&v).unwrap_or_default();
            (
                schema::parse_all::<Request>(file, &yaml, &BODY_LIMITS),
                false,
            )
        }
        _ => (parsed, true),
    };
    // Problems of the body's own shape are reported with those of the documents it carries
    // (the faulty parts replaced), so that every problem is listed at once.
    let problems: Vec<InputProblem> = parsed
        .problems
        .iter()
        .map(|d| InputProblem {
            file: "body".into(),
            line: if lines { d.line } else { 0 },
            column: if lines { d.column } else { 0 },
            key: d.key.clone(),
            message: d.message.clone(),
        })
        .collect();
    let Some(Located { value, locator, .. }) = parsed.located else {
        return Err(bad_request(if problems.is_empty() {
            vec![whole_body(0, 0, "cannot read the body".into())]
        } else {
            problems
        }));
    };
    Ok(Body {
        request: value,
        locator,
        lines,
        problems,
    })
}

/// One of the documents a what-if may change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Doc {
    Policies,
    Contracts,
    Capacity,
}

impl Doc {
    /// The key of its change in the body.
    fn key(self) -> &'static str {
        match self {
            Doc::Policies => "policies",
            Doc::Contracts => "contracts",
            Doc::Capacity => "capacity",
        }
    }

    /// Its file in the config repo.
    fn file(self) -> &'static str {
        match self {
            Doc::Policies => "rlc/policies.yaml",
            Doc::Contracts => "rlc/contracts.yaml",
            Doc::Capacity => "rlc/capacity.yaml",
        }
    }
}

/// One document's change, as the text the checks read.
struct DocChange {
    doc: Doc,
    /// `replace` or `patch`.
    how: &'static str,
    /// The name the checks give the text; their diagnostics about it carry it.
    sentinel: PathBuf,
    text: String,
    /// The merge patch, for a patch.
    patch: Option<Value>,
}

impl DocChange {
    fn new(doc: Doc, how: &'static str, value: Value, patch: Option<Value>) -> DocChange {
        DocChange {
            doc,
            how,
            sentinel: PathBuf::from(format!("what-if {}", doc.file())),
            // A tree read from YAML always serialises back.
            text: serde_yaml::to_string(&value).unwrap_or_default(),
            patch,
        }
    }
}

/// The current document `doc` of `repo` as a YAML tree (an empty mapping when absent).
fn current_document(repo: &ConfigRepo, doc: Doc) -> Value {
    let v = match doc {
        Doc::Policies => repo
            .policies
            .as_ref()
            .map(|l| serde_yaml::to_value(&l.value)),
        Doc::Contracts => repo
            .contracts
            .as_ref()
            .map(|l| serde_yaml::to_value(&l.value)),
        Doc::Capacity => repo
            .capacity
            .as_ref()
            .map(|l| serde_yaml::to_value(&l.value)),
    };
    match v {
        Some(Ok(v)) => v,
        _ => Value::Mapping(Default::default()),
    }
}

/// Applies a JSON merge patch (RFC 7396) to a YAML tree: mappings merge key by key, `null`
/// removes a key, any other value (a sequence included) replaces. Recursion is bounded by the
/// nesting limit the patch was read within.
pub fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Mapping(p) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_mapping() {
        *target = Value::Mapping(Default::default());
    }
    let Value::Mapping(t) = target else {
        return;
    };
    for (k, v) in p {
        if v.is_null() {
            t.remove(k);
        } else {
            merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
        }
    }
}

/// Whether a merge patch sets the value at `key` (a YAML path of the document: `a.b[2].c`),
/// itself or through an ancestor it replaces.
fn patch_sets(patch: &Value, key: &str) -> bool {
    let mut cur = patch;
    for seg in key.split('.').filter(|s| !s.is_empty()) {
        let name = seg.split('[').next().unwrap_or(seg);
        let indexed = seg.len() > name.len();
        if !name.is_empty() {
            match cur {
                Value::Mapping(m) => match m.get(name) {
                    Some(v) => cur = v,
                    None => return false,
                },
                _ => return true,
            }
        }
        if indexed {
            // A merge patch replaces a sequence whole.
            return true;
        }
    }
    true
}

/// Turns a diagnostic of the checks into a problem the caller can find: about the body
/// (its line and the key's path in the body) when the body says it, about the repo file
/// otherwise.
fn map_problem(
    d: &Diagnostic,
    changes: &[DocChange],
    body: &Body,
    repo: &ConfigRepo,
) -> InputProblem {
    let in_repo_file = |file: &str, key: &str, pos: Option<schema::Pos>| InputProblem {
        file: file.to_string(),
        line: pos.map_or(0, |p| p.line),
        column: pos.map_or(0, |p| p.column),
        key: key.to_string(),
        message: d.message.clone(),
    };
    if let Some(c) = changes.iter().find(|c| c.sentinel == d.file) {
        let from_body = c.patch.as_ref().is_none_or(|p| patch_sets(p, &d.key));
        if from_body {
            let key = if d.key.is_empty() {
                format!("{}.{}", c.doc.key(), c.how)
            } else {
                format!("{}.{}.{}", c.doc.key(), c.how, d.key)
            };
            return body.problem(&key, &d.message);
        }
        // A part of the current document the patch leaves as it is.
        let pos = match c.doc {
            Doc::Policies => repo.policies.as_ref().map(|l| l.locator.pos(&d.key)),
            Doc::Contracts => repo.contracts.as_ref().map(|l| l.locator.pos(&d.key)),
            Doc::Capacity => repo.capacity.as_ref().map(|l| l.locator.pos(&d.key)),
        };
        return in_repo_file(c.doc.file(), &d.key, pos);
    }
    let file = d.file.strip_prefix(&repo.root).unwrap_or(&d.file);
    in_repo_file(
        &file.to_string_lossy(),
        &d.key,
        Some(schema::Pos {
            line: d.line,
            column: d.column,
        }),
    )
}

/// Whether `service` has a series in `history`.
fn has_history(history: &dyn SeriesSource, service: &str) -> bool {
    match history.whole() {
        Some(h) => h.service_series(service).next().is_some(),
        None => history.services().iter().any(|s| s == service),
    }
}

/// `docs` completed with `base`'s bucket files, keeping only the services in `only` (every
/// service when None): their buckets, contracts and capacities.
fn restrict_repo(
    base: &ConfigRepo,
    mut docs: ConfigRepo,
    only: Option<&BTreeSet<String>>,
) -> ConfigRepo {
    docs.root = base.root.clone();
    match only {
        None => {
            docs.buckets = base.buckets.clone();
            docs.unparsed_services = base.unparsed_services.clone();
        }
        Some(only) => {
            docs.buckets = only
                .iter()
                .filter_map(|s| base.buckets.get(s).map(|b| (s.clone(), b.clone())))
                .collect();
            docs.unparsed_services = base.unparsed_services.intersection(only).cloned().collect();
            if let Some(c) = &mut docs.contracts {
                c.value.contracts.retain(|c| only.contains(&c.service));
            }
            if let Some(c) = &mut docs.capacity {
                c.value.capacity.retain(|c| only.contains(&c.service));
            }
            if let Some(p) = &mut docs.policies {
                p.value.services.retain(|s, _| only.contains(s));
            }
        }
    }
    docs
}

/// The what-if's history: the services of `only` (every service for None), read from the
/// daemon's source one service at a time, as a run reads it, so that a preview of the whole
/// fleet holds no more than one service's series at once (a source in memory is read in
/// place). A service that cannot be read fails the what-if's history as a source failure
/// would: the first such error (in the order of the services) becomes the view's
/// [`SeriesSource::source_error`] once [`View::fail`] is called.
struct View<'a> {
    source: &'a dyn SeriesSource,
    only: Option<&'a BTreeSet<String>>,
    /// The services read from a source not in memory: those of `only`, or every service
    /// (sorted, as a source lists them).
    listed: BTreeSet<String>,
    rejected: Cow<'a, [Rejected]>,
    reads: std::sync::Mutex<Reads>,
    /// Set by [`View::fail`]: the source error, or the first service's read error.
    failed: std::sync::OnceLock<String>,
}

/// What the reads of a [`View`] found.
#[derive(Default)]
struct Reads {
    /// Per service read: whether it has a series, or why it could not be read.
    by_service: BTreeMap<String, Result<bool, String>>,
    /// The grid of the last good read.
    grid: (i64, i64, usize),
}

impl<'a> View<'a> {
    fn new(source: &'a dyn SeriesSource, only: Option<&'a BTreeSet<String>>) -> View<'a> {
        let rejected = match only {
            None => Cow::Borrowed(source.rejected()),
            Some(only) => Cow::Owned(
                source
                    .rejected()
                    .iter()
                    .filter(|r| r.service.as_ref().is_some_and(|s| only.contains(s)))
                    .cloned()
                    .collect(),
            ),
        };
        let listed = match (source.whole(), only) {
            (Some(_), _) => BTreeSet::new(),
            (None, Some(only)) => only.clone(),
            (None, None) => source.services().into_iter().collect(),
        };
        View {
            source,
            only,
            listed,
            rejected,
            reads: Default::default(),
            failed: Default::default(),
        }
    }

    /// Whether the series of `service` are in the view.
    fn in_view(&self, service: &str) -> bool {
        match (self.only, self.source.whole()) {
            (Some(only), _) => only.contains(service),
            (None, Some(_)) => true,
            (None, None) => self.listed.contains(service),
        }
    }

    /// The grid of the history: first point, step, points (none when nothing was read).
    fn grid(&self) -> (i64, i64, usize) {
        match self.source.whole() {
            Some(h) => (h.start, h.step, h.len),
            None => self.reads.lock().unwrap().grid,
        }
    }

    /// Reads the listed services no plan has read yet (their series are dropped at once).
    fn read_unread(&self) {
        if self.source.whole().is_some() || self.failed.get().is_some() {
            return;
        }
        let unread: Vec<String> = {
            let reads = self.reads.lock().unwrap();
            self.listed
                .iter()
                .filter(|s| !reads.by_service.contains_key(*s))
                .cloned()
                .collect()
        };
        for s in unread {
            let _ = self.service(&s);
        }
    }

    /// Whether the view failed (the source, or a service that could not be read); from then
    /// on it is a source that failed.
    fn fail(&self) -> bool {
        if self.failed.get().is_some() {
            return false;
        }
        let error = self.source.source_error().map(str::to_string).or_else(|| {
            let reads = self.reads.lock().unwrap();
            self.listed
                .iter()
                .find_map(|s| reads.by_service.get(s)?.as_ref().err().cloned())
        });
        match error {
            Some(e) if self.source.whole().is_none() => {
                let _ = self.failed.set(e);
                true
            }
            _ => false,
        }
    }
}

impl SeriesSource for View<'_> {
    fn services(&self) -> Vec<String> {
        if self.failed.get().is_some() {
            // The services whose series were read, as a history that failed holds them.
            let reads = self.reads.lock().unwrap();
            return reads
                .by_service
                .iter()
                .filter(|(_, r)| matches!(r, Ok(true)))
                .map(|(s, _)| s.clone())
                .collect();
        }
        let mut services = self.source.services();
        if let Some(only) = self.only {
            services.retain(|s| only.contains(s));
        }
        services
    }

    fn rejected(&self) -> &[Rejected] {
        &self.rejected
    }

    fn source_error(&self) -> Option<&str> {
        match self.source.whole() {
            Some(h) => h.source_error.as_deref(),
            None => self
                .failed
                .get()
                .map(String::as_str)
                .or(self.source.source_error()),
        }
    }

    fn service(&self, service: &str) -> Result<Cow<'_, History>, Unreadable> {
        if !self.in_view(service) {
            // Not in the view: no series.
            return Ok(Cow::Owned(History::default()));
        }
        if let Some(h) = self.source.whole() {
            return Ok(Cow::Borrowed(h));
        }
        let read = self.source.service(service);
        let mut reads = self.reads.lock().unwrap();
        let found = match &read {
            Ok(h) => {
                reads.grid = (h.start, h.step, h.len);
                Ok(h.service_series(service).next().is_some())
            }
            Err(e) => Err(e.to_string()),
        };
        // The first outcome counts (a later read of the same service finds the same).
        reads.by_service.entry(service.to_string()).or_insert(found);
        read
    }
}

/// The part of `plan` about the services in `only`.
/// `plan` with only the services of `only` (all of them for `None`).
pub fn restrict_plan(plan: &Plan, only: Option<&BTreeSet<String>>) -> Plan {
    let Some(only) = only else {
        return plan.clone();
    };
    Plan {
        promotions: plan
            .promotions
            .iter()
            .filter(|p| only.contains(&p.service))
            .cloned()
            .collect(),
        needs_review: plan
            .needs_review
            .iter()
            .filter(|r| only.contains(&r.service))
            .cloned()
            .collect(),
        shadow_error: plan.shadow_error.clone(),
        buckets: plan
            .buckets
            .iter()
            .filter(|b| only.contains(&b.service))
            .cloned()
            .collect(),
        skipped: plan
            .skipped
            .iter()
            .filter(|s| only.contains(&s.service))
            .cloned()
            .collect(),
        history_refused: plan
            .history_refused
            .iter()
            .filter(|s| only.contains(*s))
            .cloned()
            .collect(),
        history_failed: plan
            .history_failed
            .iter()
            .filter(|s| only.contains(*s))
            .cloned()
            .collect(),
        history_error: plan.history_error.clone(),
    }
}

fn state(b: &crate::plan::PlannedBucket) -> BucketState {
    BucketState {
        limit_rps: b.bucket.limit_rps,
        mode: b.bucket.mode,
        scope: b.bucket.scope,
        policy: b.bucket.policy.to_string(),
    }
}

/// Bucket by bucket: added, removed, changed (limit, mode, scope or policy), and how many are
/// the same.
pub fn diff(current: &Plan, what_if: &Plan) -> Diff {
    let key = |b: &crate::plan::PlannedBucket| (b.service.clone(), b.bucket.name.clone());
    let cur: BTreeMap<_, _> = current.buckets.iter().map(|b| (key(b), state(b))).collect();
    let new: BTreeMap<_, _> = what_if.buckets.iter().map(|b| (key(b), state(b))).collect();
    let names: BTreeSet<&(String, String)> = cur.keys().chain(new.keys()).collect();
    let mut d = Diff::default();
    for k in names {
        let (c, n) = (cur.get(k), new.get(k));
        let change = match (c, n) {
            (Some(c), Some(n)) if c == n => {
                d.unchanged += 1;
                continue;
            }
            (Some(c), Some(n)) if n.limit_rps > c.limit_rps => ChangeKind::Raised,
            (Some(c), Some(n)) if n.limit_rps < c.limit_rps => ChangeKind::Lowered,
            (Some(_), Some(_)) => ChangeKind::Modified,
            (Some(_), None) => ChangeKind::Removed,
            (None, _) => ChangeKind::Added,
        };
        let limit_factor = match (c, n) {
            (Some(c), Some(n)) if c.limit_rps > 0.0 => Some(n.limit_rps / c.limit_rps),
            _ => None,
        };
        d.buckets.push(BucketChange {
            service: k.0.clone(),
            bucket: k.1.clone(),
            change,
            kind: change,
            current: c.cloned(),
            what_if: n.cloned(),
            limit_factor,
        });
    }
    d
}

/// Both plans backtested on the last `holdout_asked` seconds of `history` (at most half of
/// it), read one service at a time. `plans` computes (current, what-if) on the training part
/// at the split.
fn backtest(
    history: &View,
    holdout_asked: i64,
    plans: impl Fn(&dyn SeriesSource, DateTime<Utc>) -> (Plan, Plan),
) -> Backtest {
    let (start, step, len) = history.grid();
    let span = len as i64 * step;
    let holdout = holdout_asked.min(span / 2).max(0);
    let none = |note: String| Backtest {
        holdout_secs: holdout,
        split: None,
        note: Some(note),
        buckets: Vec::new(),
    };
    if let Some(e) = history.source_error() {
        return none(format!("no backtest: the history source failed ({e})"));
    }
    if holdout < step.max(1) {
        return none("no backtest: the history is too short to hold a window out".into());
    }
    let at = split_at(start + span, holdout);
    let train = Training {
        source: history,
        split: at,
    };
    let (current, what_if) = plans(
        &train,
        Utc.timestamp_opt(at, 0).single().unwrap_or_default(),
    );
    let Ok(mut scores) = score_plans(history, &[&current, &what_if], at) else {
        // A service could not be read: the caller fails the view and computes again.
        return none("no backtest: the history could not be read".into());
    };
    let new = scores.pop().unwrap_or_default();
    let cur = scores.pop().unwrap_or_default();
    let mut by: BTreeMap<(String, String), (Option<Score>, Option<Score>)> = BTreeMap::new();
    for (s, b, sc) in cur {
        by.entry((s, b)).or_default().0 = Some(sc);
    }
    for (s, b, sc) in new {
        by.entry((s, b)).or_default().1 = Some(sc);
    }
    Backtest {
        holdout_secs: holdout,
        split: Utc.timestamp_opt(at, 0).single(),
        note: None,
        buckets: by
            .into_iter()
            .map(|((service, bucket), (current, what_if))| BucketBacktest {
                service,
                bucket,
                current,
                what_if,
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests;
