//! `POST /v1/report`: a client report checked, screened and summed into the zone's state,
//! answered with its service's directives.

use super::*;

/// `POST /v1/report`: a client credential covering the report's service.
pub(super) async fn report(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Body,
) -> Result<axum::response::Response, ApiError> {
    // The credential is checked from the headers before the body is read.
    let cred = s.report_credential(&headers)?;
    // Held until the report is summed: its decoded form is what takes the memory.
    let _large = s.large_report_permit(&headers).await?;
    let (mut r, binary) = s.decode_report(&headers, body).await?;
    // A client of protocol 8 reads the directives' tier splits.
    let tiers = grl_wire::peer_version(&headers) >= grl_wire::PROTO_TIERS;
    s.check_report(cred.as_ref(), &r)?;
    let (reply, age_ms, screened) = s.sum_report(&mut r)?;
    s.metrics.accepted.inc();
    if binary {
        s.metrics.accepted_binary.inc();
    }
    s.count_screened(&r, &screened);
    Ok(report_response(&reply, age_ms, binary, tiers))
}

impl Shared {
    /// The report's credential; `None` for an anonymous report where those are allowed.
    fn report_credential(
        &self,
        headers: &HeaderMap,
    ) -> Result<Option<grl_client::auth::Credential>, ApiError> {
        let anonymous = self.opts.allow_anonymous_reports
            && headers.get(axum::http::header::AUTHORIZATION).is_none();
        if anonymous {
            return Ok(None);
        }
        match self.creds.authenticate(headers) {
            Ok(c) => Ok(Some(c)),
            Err(r) => Err(self.refuse(r.reason(), "", ApiError::Unauthorized)),
        }
    }

    /// A permit to read a large report (or one without a length), waited for at most
    /// [`BODY_TIMEOUT`](grl_server::http_util::BODY_TIMEOUT); `None` for a small one.
    async fn large_report_permit(
        &self,
        headers: &HeaderMap,
    ) -> Result<Option<tokio::sync::SemaphorePermit<'_>>, ApiError> {
        let large = headers
            .get(axum::http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
            .is_none_or(|n| n > LARGE_REPORT);
        if !large {
            return Ok(None);
        }
        let permit = tokio::time::timeout(
            grl_server::http_util::BODY_TIMEOUT,
            self.large_reports.acquire(),
        );
        match permit.await {
            Ok(p) => Ok(Some(p.expect("never closed"))),
            Err(_) => {
                let e = ApiError::TooMany("too many large reports at once; retry later".into());
                Err(self.refuse("busy", "", e))
            }
        }
    }

    /// Reads and decodes the report: the binary encoding (protocol 3) when the content type
    /// says so (the `bool`), JSON otherwise.
    async fn decode_report(
        &self,
        headers: &HeaderMap,
        body: Body,
    ) -> Result<(ClientReport, bool), ApiError> {
        let body = match read_body(body, MAX_REPORT_BODY).await {
            Ok(b) => b,
            Err(e @ ApiError::TooLarge(_)) => return Err(self.refuse("too_large", "", e)),
            Err(e @ ApiError::Timeout) => return Err(self.refuse("timeout", "", e)),
            Err(e) => return Err(self.refuse("malformed", "", e)),
        };
        let binary = grl_wire::binary::is_binary(headers.get(axum::http::header::CONTENT_TYPE));
        let r: ClientReport = if binary {
            grl_wire::binary::decode_report(&body)
                .map_err(|e| self.refuse("malformed", "", ApiError::BadRequest(e.to_string())))?
        } else {
            parse_json(&body).map_err(|e| self.refuse("malformed", "", e))?
        };
        Ok((r, binary))
    }

    /// Refuses a report its credential does not cover, or whose fields or counts do not
    /// add up.
    fn check_report(
        &self,
        cred: Option<&grl_client::auth::Credential>,
        r: &ClientReport,
    ) -> Result<(), ApiError> {
        if let Some(c) = cred {
            if !c.covers(&r.service) {
                let detail = format!(
                    "credential `{}` reported for service `{}`",
                    c.name, r.service
                );
                let e = ApiError::Forbidden(format!(
                    "credential `{}` does not cover service `{}`",
                    c.name, r.service
                ));
                return Err(self.refuse("forbidden", &detail, e));
            }
        }
        if r.interval_ms == 0
            || r.client_id.is_empty()
            || r.client_id.len() > screen::MAX_CLIENT_ID_LEN
            || r.service.is_empty()
        {
            return Err(self.refuse(
                "invalid",
                "",
                ApiError::Invalid(format!(
                    "interval_ms must be positive; client_id (at most {} bytes) and service must not be empty",
                    screen::MAX_CLIENT_ID_LEN
                )),
            ));
        }
        for b in &r.buckets {
            if b.admitted.checked_add(b.dropped) != Some(b.offered) || b.shadow_dropped > b.admitted
            {
                return Err(self.refuse(
                    "invalid",
                    "",
                    ApiError::Invalid(format!(
                        "bucket `{}`: admitted + dropped must equal offered and shadow_dropped ≤ admitted",
                        b.bucket
                    )),
                ));
            }
        }
        Ok(())
    }

    /// Screens the report and sums it into the zone's state; returns the reply for its
    /// service, the directives' age and what screening dropped or cut.
    ///
    /// Under the lock only the screening, the sums, the client's entry and a shared handle on
    /// its service's reply; the reply is encoded outside. Known keys are looked up by the
    /// report's borrowed names (nothing allocated per bucket); only a new client, bucket or
    /// caller allocates.
    fn sum_report(
        &self,
        r: &mut ClientReport,
    ) -> Result<(Arc<ServiceReply>, Option<u64>, screen::Screened), ApiError> {
        use grl_client::keys::StrPair;
        let mut guard = self.state.lock().expect("aggregator lock");
        let st = &mut *guard;
        let now = Instant::now();
        let client = st
            .clients
            .get(&(r.service.as_str(), r.client_id.as_str()) as &dyn StrPair);
        let held = client.map(|c| c.rates.len());
        let new_client = held.is_none();
        let p = &self.opts.plausibility;
        let mut screened = st.known.screen(r, new_client, p);
        let (mut calls, elapsed) = allowance(client, r.interval_ms, now, self.opts.tick);
        let cut = st.known.screen_calls(r, &mut calls, elapsed, p);
        screened.add(screen::EntryRefusal::CallsCapped, cut);
        let service = r.service.as_str();
        // The service's budgets of clients and rates held: a report that would pass one
        // changes nothing.
        if let Err(over) = st.known.admit(service, held, r.buckets.len(), p) {
            drop(guard);
            self.count_screened(r, &screened);
            let detail = format!("service `{}`: {}", r.service, over.what());
            let e = ApiError::TooMany(over.message(&r.service, p));
            return Err(self.refuse("over_budget", &detail, e));
        }
        let c = refresh_client(
            &mut st.clients,
            &mut st.waiting,
            r,
            now,
            self.opts.tick,
            new_client,
            calls,
        );
        // Counts are summed over reports: no more than the client may add over the time it
        // really reported.
        let cut = st.known.screen_counts(
            service,
            &mut r.buckets,
            &mut c.counts,
            elapsed,
            &screened,
            p,
        );
        screened.add(screen::EntryRefusal::CountsCapped, cut);
        st.add_pending(service, r, self.opts.max_call_keys);
        st.recount_waiting(now, self.opts.tick);
        if r.urgent || st.waiting == 0 {
            self.all_in.notify_one();
        }
        Ok((
            st.service_reply(service),
            st.directives_at.map(|t| t.elapsed().as_millis() as u64),
            screened,
        ))
    }
}

/// A client is allowed the calls and counts of the time since its previous report; a new
/// one, of its interval, at most three ticks.
pub(super) fn allowance(
    client: Option<&ClientEntry>,
    interval_ms: u64,
    now: Instant,
    tick: Duration,
) -> (screen::ClientCalls, screen::Elapsed) {
    let first_ms = (tick * 3).as_millis() as u64;
    let (calls, since_ms, horizon_ms) = match client {
        Some(c) => (
            c.calls,
            now.duration_since(c.at).as_millis() as u64,
            c.horizon.as_millis() as u64,
        ),
        None => (Default::default(), interval_ms.min(first_ms), first_ms),
    };
    let elapsed = screen::Elapsed {
        since_ms,
        horizon_ms,
        new_client: client.is_none(),
    };
    (calls, elapsed)
}

/// The client's entry (inserted when new), its rates from the counts as the rate screen
/// left them (what the ratios follow) and its calls allowance; a client heard again since
/// the last forward leaves `waiting`.
pub(super) fn refresh_client<'a>(
    clients: &'a mut HashMap<(String, String), ClientEntry>,
    waiting: &mut usize,
    r: &ClientReport,
    now: Instant,
    tick: Duration,
    new_client: bool,
    calls: screen::ClientCalls,
) -> &'a mut ClientEntry {
    use grl_client::keys::StrPair;
    if new_client {
        let period_ms = crate::period::estimate(None, r.interval_ms);
        let entry = ClientEntry {
            at: now,
            horizon: client_horizon(tick, period_ms),
            period_ms,
            rates: Vec::new(),
            tier_mix: Vec::new(),
            calls: Default::default(),
            counts: Default::default(),
            fresh: true,
        };
        clients.insert((r.service.clone(), r.client_id.clone()), entry);
    }
    let c = clients
        .get_mut(&(r.service.as_str(), r.client_id.as_str()) as &dyn StrPair)
        .expect("held, or inserted above");
    if !c.fresh {
        *waiting = waiting.saturating_sub(1);
    }
    c.at = now;
    c.period_ms = crate::period::estimate(Some(c.period_ms), r.interval_ms);
    c.horizon = client_horizon(tick, c.period_ms);
    r.rates_into(&mut c.rates);
    c.tier_mix.clear();
    c.tier_mix.extend(r.buckets.iter().map(tier_mix));
    c.calls = calls;
    c.fresh = true;
    c
}

/// The shares of a bucket's offered requests by tier (None without believed tiers:
/// [`BucketCountsMsg::tiers_believed`]).
pub fn tier_mix(b: &BucketCountsMsg) -> Option<[f64; TIERS]> {
    let o = b.tier_offered().filter(|_| b.tiers_believed())?;
    let sum: u64 = o.iter().sum();
    (sum > 0).then(|| o.map(|t| t as f64 / sum as f64))
}

impl AggState {
    /// Adds the report's bucket counts and calls to what the next forward sends.
    fn add_pending(&mut self, service: &str, r: &ClientReport, max_call_keys: usize) {
        for b in &r.buckets {
            grl_client::keys::update(
                &mut self.pending,
                (service, &b.bucket),
                |k| BucketCountsMsg {
                    bucket: k.1.clone(),
                    ..Default::default()
                },
                |p| {
                    if b.tiers_believed() {
                        p.add(b);
                    } else {
                        // Tier counts beyond the (screened) whole are not believed.
                        p.add(&BucketCountsMsg {
                            tiers: Vec::new(),
                            ..b.clone()
                        });
                    }
                },
            );
        }
        if !r.calls.is_empty() {
            let room = self.calls.len() < MAX_CALL_SERVICES;
            if let Some(p) = match self.calls.get_mut(service) {
                Some(p) => Some(p),
                None if room => Some(
                    self.calls
                        .entry(service.to_string())
                        .or_insert_with(|| PendingCalls::new(max_call_keys)),
                ),
                None => None,
            } {
                for c in &r.calls {
                    p.add(&c.caller, &c.procedure, c.count);
                }
            }
        }
    }

    /// Every client heard within the horizon has reported since the last forward: forward
    /// now. `waiting` counts the clients not heard since; it is recounted (leaving out
    /// those gone quiet beyond the horizon) at most every quarter tick, never per report.
    fn recount_waiting(&mut self, now: Instant, tick: Duration) {
        if self.waiting > 0
            && self
                .waiting_counted
                .is_none_or(|t| now.duration_since(t) >= tick / 4)
        {
            self.waiting = self
                .clients
                .values()
                .filter(|c| !c.fresh && now.duration_since(c.at) <= c.horizon)
                .count();
            self.waiting_counted = Some(now);
        }
    }
}

/// The answer to an accepted report: its service's directives in the report's encoding.
pub(super) fn report_response(
    reply: &ServiceReply,
    age_ms: Option<u64>,
    binary: bool,
    tiers: bool,
) -> axum::response::Response {
    let ctype = if binary {
        grl_wire::binary::CONTENT_TYPE
    } else {
        "application/json"
    };
    let mut resp = axum::response::Response::new(Body::from(reply.body(age_ms, binary, tiers)));
    let h = resp.headers_mut();
    h.insert(
        axum::http::HeaderName::from_static(PROTO_HEADER),
        grl_wire::version_header(),
    );
    h.insert(
        axum::http::header::CONTENT_TYPE,
        axum::http::HeaderValue::from_static(ctype),
    );
    resp
}
