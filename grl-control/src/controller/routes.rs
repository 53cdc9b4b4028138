//! The controller's HTTP handlers: config, overrides, reports, candidates, zone reports,
//! status, readiness and metrics.

use super::state::catch_up;
use super::*;

#[derive(Deserialize)]
pub(super) struct ConfigView {
    view: Option<String>,
}

/// `GET /v1/config`: the served config (the pushed one plus the buckets of traffic overrides,
/// what aggregators and clients run); `?view=pushed`: the config as pushed, which
/// `PUT /v1/config` takes back (a served config's `override:` buckets are refused there).
/// The served view, what aggregators fetch, leaves out what a peer below `grl-proto: 9`
/// cannot read (`ConfigDoc::for_peer`); the pushed view, what a person or a script takes
/// back to `PUT`, is always whole.
pub(super) async fn get_config(
    State(s): State<Arc<Shared>>,
    Query(q): Query<ConfigView>,
    headers: HeaderMap,
) -> Result<Json<ConfigDoc>, ApiError> {
    let e = s.engine.lock().expect("engine lock");
    let doc = match q.view.as_deref() {
        None | Some("served") => e.config(),
        Some("pushed") => return Ok(Json(e.base_config().clone())),
        Some(v) => {
            return Err(ApiError::BadRequest(format!(
                "view `{v}`: expected `served` (the default) or `pushed`"
            )))
        }
    };
    let mut doc = doc.clone();
    doc.for_peer(grl_wire::peer_version(&headers));
    Ok(Json(doc))
}

/// 422 when `max` overrides are active at `now` (expired ones not purged yet do not count).
pub(super) fn room_for_one_more(e: &Engine, now: u64, max: usize) -> Result<(), ApiError> {
    let active = e.overrides().iter().filter(|o| o.active(now)).count();
    if active >= max {
        return Err(ApiError::Invalid(format!(
            "{active} overrides are active, the most this controller takes (--max-overrides {max}); remove one (grl override rm ID) or let one expire, and put lasting limits in the bucket files"
        )));
    }
    Ok(())
}

/// `PUT /v1/config`: role `config` (rlc's credential).
pub(super) async fn put_config(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Body,
) -> Result<impl IntoResponse, ApiError> {
    let cred = s.authorize(&headers, "config", "PUT /v1/config")?;
    let body = read_body(body, MAX_BODY).await?;
    let doc: ConfigDoc = parse_json(&body)?;
    config::validate_pushed(&doc).map_err(|e| ApiError::Invalid(e.to_string()))?;
    if let Some(sync) = &s.db {
        return put_config_db(&s, sync, doc, &cred.name).await.map(Json);
    }
    // Hold the engine lock across the write so that two pushes cannot interleave their
    // persist and apply.
    let mut e = s.engine.lock().expect("engine lock");
    if e.base_config().version == doc.version {
        return Ok(Json(
            serde_json::json!({"version": doc.version, "changed": false}),
        ));
    }
    let bytes = serde_json::to_vec_pretty(&doc).map_err(|e| ApiError::Internal(e.to_string()))?;
    write_atomic(&s.state_dir.join("config.json"), &bytes)
        .map_err(|e| ApiError::Internal(format!("persist config: {e}")))?;
    let buckets: usize = doc.services.iter().map(|f| f.buckets.len()).sum();
    tracing::info!(from = %e.base_config().version, to = %doc.version, buckets, credential = %cred.name, "config applied");
    let version = doc.version.clone();
    e.set_config(doc);
    e.recompute(s.now_ms(), unix_now());
    Ok(Json(
        serde_json::json!({"version": version, "changed": true}),
    ))
}

/// `PUT /v1/config` with a state database: written in a transaction (unless its version is
/// the database's current one), then applied here; the other replicas apply it on the
/// notification.
pub(super) async fn put_config_db(
    s: &Shared,
    sync: &DbSync,
    doc: ConfigDoc,
    credential: &str,
) -> Result<serde_json::Value, ApiError> {
    let mut applied = sync.applied.lock().await;
    let w = sync
        .db
        .put_config(&doc, credential)
        .await
        .map_err(|e| sync.refuse("PUT /v1/config", e))?;
    if !w.changed {
        // Already the current version; this replica may not have applied it yet.
        let _ = catch_up(s, sync, &mut applied).await;
        return Ok(serde_json::json!({"version": doc.version, "changed": false}));
    }
    let version = doc.version.clone();
    let buckets: usize = doc.services.iter().map(|f| f.buckets.len()).sum();
    if w.rev == applied.rev + 1 {
        // Nothing else changed in between: apply what was written.
        let mut e = s.engine.lock().expect("engine lock");
        tracing::info!(from = %e.base_config().version, to = %doc.version, buckets, rev = w.rev, credential, "config applied (state database)");
        e.set_config(doc);
        e.recompute(s.now_ms(), unix_now());
        *applied = Applied {
            rev: w.rev,
            config_rev: w.rev,
        };
        drop(e);
        sync.ok(w.rev);
    } else {
        tracing::info!(to = %doc.version, buckets, rev = w.rev, credential, "config stored (state database); catching up");
        // Committed: when this catch-up fails, the follower applies it at its next turn.
        let _ = catch_up(s, sync, &mut applied).await;
    }
    Ok(serde_json::json!({"version": version, "changed": true}))
}

/// `GET /readyz`: the persisted state loaded and its directory present, the control loop
/// ticking (a tick within 3 periods, at least 2 s); 503 with the reason otherwise. A
/// controller without a pushed config is ready (rlc pushes to it).
pub(super) async fn readyz(State(s): State<Arc<Shared>>) -> grl_server::http_util::Readiness {
    let version = s
        .engine
        .lock()
        .expect("engine lock")
        .base_config()
        .version
        .clone();
    let state_dir = if s.state_dir.is_dir() {
        Ok(s.state_dir.display().to_string())
    } else {
        Err(format!("{} is not a directory", s.state_dir.display()))
    };
    let last = s.last_tick_ms.load(std::sync::atomic::Ordering::Relaxed);
    let bound = (s.tick * 3).max(Duration::from_secs(2)).as_millis() as u64;
    let ticking = if last == u64::MAX {
        Err("no tick yet".to_string())
    } else {
        let age = s.now_ms().saturating_sub(last);
        if age <= bound {
            Ok(format!("last tick {age} ms ago"))
        } else {
            Err(format!("last tick {age} ms ago (more than {bound} ms)"))
        }
    };
    let config = Ok(if version.is_empty() {
        "no config pushed yet".to_string()
    } else {
        format!("config version {version}")
    });
    let Some(sync) = &s.db else {
        return grl_server::http_util::Readiness::from_checks([
            ("config", config),
            ("state_dir", state_dir),
            ("ticking", ticking),
        ]);
    };
    // The state was loaded from the database before this answered at all; while the database
    // is unreachable the replica still enforces what it has (data plane fail-open, changes
    // answer 503), so that stays ready and the detail says so.
    let database = Ok(db_detail(sync));
    grl_server::http_util::Readiness::from_checks([
        ("config", config),
        ("database", database),
        ("ticking", ticking),
    ])
}

/// The state database as `/readyz` and `/v1/status` describe it.
pub(super) fn db_detail(sync: &DbSync) -> String {
    let h = sync.health.lock().expect("db health lock");
    let ago = h.ok_at.elapsed().as_millis();
    match &h.error {
        None => format!("revision {} (in sync {ago} ms ago)", h.rev),
        Some(err) => format!(
            "failing since {ago} ms: {err}; serving revision {}, changes answer 503",
            h.rev
        ),
    }
}

pub(super) async fn status(State(s): State<Arc<Shared>>) -> Json<serde_json::Value> {
    let state = match &s.db {
        Some(sync) => serde_json::json!({
            "backend": "postgres",
            "revision": sync.health.lock().expect("db health lock").rev,
            "detail": db_detail(sync),
        }),
        None => serde_json::json!({"backend": "state_dir"}),
    };
    let e = s.engine.lock().expect("engine lock");
    Json(serde_json::json!({
        "state": state,
        // The pushed version (what rlc reconciles against); clients run `served_version`,
        // which differs while traffic overrides add buckets.
        "version": e.base_config().version,
        "served_version": e.config().version,
        "buckets": e.bucket_count(),
        "services": e.config().services.len(),
        "overrides": e.overrides().len(),
        "candidates": e.candidates().count(),
        "tick_ms": s.tick.as_millis() as u64,
        "proto": grl_wire::PROTO_VERSION,
    }))
}

/// `GET /v1/candidates`: role `reports`. Each candidate limit's counts since this controller
/// began evaluating it; `epoch` changes when the controller restarts (its counts start over).
pub(super) async fn candidates(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
) -> Result<Json<grl_wire::CandidatesReply>, ApiError> {
    s.authorize(&headers, "reports", "GET /v1/candidates")?;
    let e = s.engine.lock().expect("engine lock");
    Ok(Json(grl_wire::CandidatesReply {
        epoch: format!("{:016x}", e.directives_version().0),
        now_ms: unix_now_ms(),
        candidates: e.candidate_reports(),
    }))
}

#[derive(Deserialize)]
pub(super) struct ReportsQuery {
    #[serde(default)]
    after: u64,
    #[serde(default = "default_limit")]
    limit: usize,
}

pub(super) fn default_limit() -> usize {
    1000
}

/// `GET /v1/reports`: role `reports` (rlc's credential, or a read-only one).
pub(super) async fn reports(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    Query(q): Query<ReportsQuery>,
) -> Result<Json<serde_json::Value>, ApiError> {
    s.authorize(&headers, "reports", "GET /v1/reports")?;
    let e = s.engine.lock().expect("engine lock");
    Ok(Json(
        serde_json::to_value(e.reports_after(q.after, q.limit.min(10_000))).unwrap_or_default(),
    ))
}

/// `POST /v1/aggregate`: role `zone-report` (aggregators, peer controllers).
pub(super) async fn aggregate(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Body,
) -> Result<impl IntoResponse, ApiError> {
    // Checked from the headers before the body is read: an unauthenticated report changes
    // nothing and costs no memory.
    let anonymous =
        s.allow_anonymous_reports && headers.get(axum::http::header::AUTHORIZATION).is_none();
    if !anonymous {
        match s.creds.authenticate(&headers) {
            Ok(c) if c.covers("zone-report") => {}
            Ok(c) => {
                let e = ApiError::Forbidden(format!(
                    "credential `{}` does not hold the `zone-report` role",
                    c.name
                ));
                return Err(s.refuse_report("forbidden", e));
            }
            Err(r) => return Err(s.refuse_report(r.reason(), ApiError::Unauthorized)),
        }
    }
    let body = match read_body(body, MAX_BODY).await {
        Ok(b) => b,
        Err(e @ ApiError::TooLarge(_)) => return Err(s.refuse_report("too_large", e)),
        Err(e @ ApiError::Timeout) => return Err(s.refuse_report("timeout", e)),
        Err(e) => return Err(s.refuse_report("malformed", e)),
    };
    let r: ZoneReport = parse_json(&body).map_err(|e| s.refuse_report("malformed", e))?;
    if r.zone.is_empty() || r.region.is_empty() {
        return Err(s.refuse_report(
            "invalid",
            ApiError::Invalid("zone and region must not be empty".into()),
        ));
    }
    for b in &r.buckets {
        let rates = [
            b.offered_rps,
            b.admitted_rps,
            b.dropped_rps,
            b.shadow_dropped_rps,
        ];
        if rates.iter().any(|x| !x.is_finite() || *x < 0.0) {
            return Err(s.refuse_report(
                "invalid",
                ApiError::Invalid(format!(
                    "bucket `{}`: rates must be finite and not negative",
                    b.bucket
                )),
            ));
        }
    }
    let mut e = s.engine.lock().expect("engine lock");
    // The reply's ratios already include this report: a zone's fresh counts reach its
    // clients in the same round trip instead of waiting for the next tick.
    // Serialized under the lock: the directives' bytes are shared between the zones' replies.
    let tiers = grl_wire::peer_version(&headers) >= grl_wire::PROTO_TIERS;
    let (reply, ingested) = e.answer_json(&r, s.now_ms(), unix_now(), tiers);
    drop(e);
    // The calls of a report answered `resync` come again with the full report the
    // aggregator sends at once: they count then, once.
    if !r.calls.is_empty() && ingested == crate::engine::Ingested::Applied {
        let mut c = s.calls.lock().expect("calls lock");
        for m in &r.calls {
            c.add(&m.service, &m.caller, &m.procedure, m.count);
        }
    }
    Ok((
        [
            (grl_wire::PROTO_HEADER, grl_wire::PROTO_VERSION.to_string()),
            (
                axum::http::header::CONTENT_TYPE.as_str(),
                "application/json".to_string(),
            ),
        ],
        reply,
    ))
}

/// An override with the served buckets it acts on (`affects`, empty for a bucket override).
pub(super) fn with_affects(o: &Override, e: &Engine) -> serde_json::Value {
    let mut v = serde_json::to_value(o).unwrap_or_default();
    v["affects"] = serde_json::to_value(e.affected(&o.id)).unwrap_or_default();
    v
}

pub(super) async fn list_overrides(State(s): State<Arc<Shared>>) -> Json<serde_json::Value> {
    let e = s.engine.lock().expect("engine lock");
    let now = unix_now();
    let list: Vec<serde_json::Value> = e
        .overrides()
        .iter()
        .filter(|o| o.active(now))
        .map(|o| with_affects(o, &e))
        .collect();
    Json(serde_json::json!({ "overrides": list }))
}

#[derive(Deserialize)]
pub(super) struct HistoryQuery {
    limit: Option<usize>,
}

/// `GET /v1/overrides/history?limit=N`: the overrides' audit log, newest first (100 events
/// unless `limit` says otherwise, at most [`crate::audit::MAX_PAGE`]); readable as
/// `GET /v1/overrides` is.
pub(super) async fn override_history(
    State(s): State<Arc<Shared>>,
    Query(q): Query<HistoryQuery>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let limit = q.limit.unwrap_or(100).clamp(1, crate::audit::MAX_PAGE);
    let events = match &s.db {
        Some(sync) => sync
            .db
            .history(limit)
            .await
            .map_err(|e| sync.refuse("GET /v1/overrides/history", e))?,
        None => {
            let log = crate::audit::FileLog::in_dir(&s.state_dir);
            tokio::task::spawn_blocking(move || log.read(limit))
                .await
                .map_err(|e| ApiError::Internal(e.to_string()))?
                .map_err(|e| ApiError::Internal(format!("read the overrides' audit log: {e}")))?
        }
    };
    Ok(Json(serde_json::json!({ "events": events })))
}

/// `POST /v1/overrides`: role `overrides` (on-call people); the credential's name is recorded.
pub(super) async fn add_override(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Body,
) -> Result<impl IntoResponse, ApiError> {
    let cred = s.authorize(&headers, "overrides", "POST /v1/overrides")?;
    let body = read_body(body, MAX_OVERRIDE_BODY).await?;
    let req: OverrideRequest = parse_json(&body)?;
    req.validate()
        .map_err(|e| ApiError::Invalid(e.to_string()))?;
    if let (Some(svc), Some(b)) = (&req.service, &req.bucket) {
        // A bucket override on a name that does not exist would silently do nothing.
        if s.engine
            .lock()
            .expect("engine lock")
            .scope_of(svc, b)
            .is_none()
        {
            return Err(ApiError::Invalid(format!(
                "service `{svc}` has no bucket `{b}` (to limit traffic without a bucket, target --caller/--procedure)"
            )));
        }
    }
    if let (Some(svc), None, Some(_)) = (&req.service, &req.bucket, req.shed_below) {
        // Likewise a service-wide floor on a service without buckets.
        if !s.engine.lock().expect("engine lock").has_service(svc) {
            return Err(ApiError::Invalid(format!(
                "service `{svc}` has no bucket to shed from"
            )));
        }
    }
    if let Some(sync) = &s.db {
        return add_override_db(&s, sync, req, &cred.name)
            .await
            .map(|v| (axum::http::StatusCode::CREATED, Json(v)));
    }
    let now = unix_now();
    let mut p = s.persisted.lock().expect("persisted lock");
    let mut e = s.engine.lock().expect("engine lock");
    room_for_one_more(&e, now, s.max_overrides)?;
    let next_id = p.next_id + 1;
    let o = Override {
        id: format!("ovr-{next_id}"),
        created_at: now,
        // Validated above (at most MAX_TTL_SECS); saturating all the same.
        expires_at: now.saturating_add(req.ttl_secs),
        credential: Some(cred.name.clone()),
        req,
    };
    let mut list = e.overrides().to_vec();
    list.push(o.clone());
    e.try_set_overrides(list, |l| s.save_overrides(next_id, l))
        .map_err(|err| ApiError::Invalid(format!("the override cannot be served: {err}")))??;
    p.next_id = next_id;
    s.audit(&[Event::created(&o)]);
    tracing::info!(id = %o.id, who = %o.req.who, credential = %cred.name, reason = %o.req.reason,
        target = %o.req.target(), action = %o.req.action(), ttl_secs = o.req.ttl_secs, "override added");
    e.recompute(s.now_ms(), now);
    let affects = e.affected(&o.id);
    if o.is_traffic() {
        tracing::info!(id = %o.id, buckets = affects.len(), version = %e.config().version, "override materialised");
    }
    Ok((axum::http::StatusCode::CREATED, Json(with_affects(&o, &e))))
}

/// `POST /v1/overrides` with a state database: checked against this replica's state at the
/// database's revision (caught up first when another replica changed it meanwhile; at most
/// three tries), written in a transaction that hands out the id, then applied here.
pub(super) async fn add_override_db(
    s: &Shared,
    sync: &DbSync,
    req: OverrideRequest,
    credential: &str,
) -> Result<serde_json::Value, ApiError> {
    let mut applied = sync.applied.lock().await;
    for _ in 0..3 {
        let now = unix_now();
        let made = sync
            .db
            .add_override(applied.rev, |next_id| {
                let o = Override {
                    id: format!("ovr-{next_id}"),
                    created_at: now,
                    expires_at: now.saturating_add(req.ttl_secs),
                    credential: Some(credential.to_string()),
                    req: req.clone(),
                };
                let e = s.engine.lock().expect("engine lock");
                room_for_one_more(&e, now, s.max_overrides)?;
                let mut list = e.overrides().to_vec();
                list.push(o.clone());
                e.check_overrides(&list).map(|()| o).map_err(|err| {
                    ApiError::Invalid(format!("the override cannot be served: {err}"))
                })
            })
            .await;
        let (o, rev) = match made {
            Err(crate::state_db::DbError::Stale(_)) => {
                catch_up(s, sync, &mut applied)
                    .await
                    .map_err(|e| sync.refuse("POST /v1/overrides", e))?;
                continue;
            }
            Err(e) => return Err(sync.refuse("POST /v1/overrides", e)),
            Ok(Err(err)) => return Err(err),
            Ok(Ok(made)) => made,
        };
        sync.ok(rev);
        let mut e = s.engine.lock().expect("engine lock");
        let mut list = e.overrides().to_vec();
        list.push(o.clone());
        // Checked against this very state in the transaction.
        if let Err(err) = e.try_set_overrides(list, |_| Ok::<(), ()>(())) {
            tracing::error!(id = %o.id, error = %err, "override stored but not applicable here");
        }
        *applied = Applied {
            rev,
            config_rev: applied.config_rev,
        };
        tracing::info!(id = %o.id, who = %o.req.who, credential, reason = %o.req.reason,
            target = %o.req.target(), action = %o.req.action(), ttl_secs = o.req.ttl_secs, rev, "override added (state database)");
        e.recompute(s.now_ms(), now);
        return Ok(with_affects(&o, &e));
    }
    Err(ApiError::Unavailable(
        "the state kept changing under this override (three tries); nothing was changed, retry"
            .into(),
    ))
}

/// `DELETE /v1/overrides/{id}` with a state database.
pub(super) async fn remove_override_db(
    s: &Shared,
    sync: &DbSync,
    id: &str,
    q: &WhoQuery,
    credential: &str,
) -> Result<Override, ApiError> {
    let mut applied = sync.applied.lock().await;
    let Some((o, rev)) = sync
        .db
        .remove_override(
            id,
            unix_now(),
            q.who.as_deref().unwrap_or("unknown"),
            q.reason.as_deref().unwrap_or(""),
            credential,
        )
        .await
        .map_err(|e| sync.refuse("DELETE /v1/overrides", e))?
    else {
        return Err(ApiError::NotFound(format!("no override `{id}`")));
    };
    sync.ok(rev);
    tracing::info!(id = %o.id, removed_by = q.who.as_deref().unwrap_or("unknown"), credential, why = q.reason.as_deref().unwrap_or(""),
        added_by = %o.req.who, rev, "override removed (state database)");
    if rev == applied.rev + 1 {
        let mut e = s.engine.lock().expect("engine lock");
        let list = e
            .overrides()
            .iter()
            .filter(|x| x.id != id)
            .cloned()
            .collect();
        e.set_overrides(list);
        e.recompute(s.now_ms(), unix_now());
        applied.rev = rev;
    } else {
        let _ = catch_up(s, sync, &mut applied).await;
    }
    Ok(o)
}

#[derive(Deserialize)]
pub(super) struct WhoQuery {
    who: Option<String>,
    reason: Option<String>,
}

pub(super) async fn remove_override(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    UrlPath(id): UrlPath<String>,
    Query(q): Query<WhoQuery>,
) -> Result<impl IntoResponse, ApiError> {
    let cred = s.authorize(&headers, "overrides", "DELETE /v1/overrides/{id}")?;
    if let Some(sync) = &s.db {
        return remove_override_db(&s, sync, &id, &q, &cred.name)
            .await
            .map(Json);
    }
    let p = s.persisted.lock().expect("persisted lock");
    let mut e = s.engine.lock().expect("engine lock");
    let mut list = e.overrides().to_vec();
    let Some(pos) = list.iter().position(|o| o.id == id) else {
        return Err(ApiError::NotFound(format!("no override `{id}`")));
    };
    let o = list.remove(pos);
    s.save_overrides(p.next_id, &list)?;
    s.audit(&[Event::removed(
        &o,
        unix_now(),
        q.who.as_deref().unwrap_or("unknown"),
        q.reason.as_deref().unwrap_or(""),
        &cred.name,
    )]);
    tracing::info!(id = %o.id, removed_by = q.who.as_deref().unwrap_or("unknown"), credential = %cred.name, why = q.reason.as_deref().unwrap_or(""),
        added_by = %o.req.who, "override removed");
    e.set_overrides(list);
    e.recompute(s.now_ms(), unix_now());
    Ok(Json(o))
}

/// `GET /metrics` (see [`crate::metrics::EngineCollector`] for the per-bucket series).
pub(super) async fn metrics(State(s): State<Arc<Shared>>) -> impl IntoResponse {
    grl_server::metrics::response(&s.registry)
}
