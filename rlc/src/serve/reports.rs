//! `rlc serve`'s report polling: each region's controller's reports (every mode) go through a
//! bounded buffer into the store; the stored cursor only moves past stored reports. Whether
//! each controller could be read is recorded, so that figures missing a region say so. And
//! the periodic retention of stored reports.

use std::time::Duration;

use chrono::Utc;

use super::{Loop, REPORT_CURSOR};
use crate::cycle::Cycle;
use crate::push::ControllerClient;
use crate::store::{within, Store};
use grl_wire::ReportRow;

/// How many controller reports `rlc serve` holds and fetches at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReportLimits {
    /// Reports held in memory while the store is down or slow. At the bound rlc stops polling
    /// (the controller keeps the reports until its own buffer evicts them; a loss then shows
    /// as `rlc_shadow_report_gaps_total`); the stored cursor only moves past stored reports.
    /// The buffer holds at most this plus one page less one report.
    pub buffer: usize,
    /// Reports fetched per `GET /v1/reports` call (the controller's maximum is 10,000).
    pub page: u32,
}

impl ReportLimits {
    /// 100,000 reports held, pages of 10,000.
    pub const DEFAULT: ReportLimits = ReportLimits {
        buffer: 100_000,
        page: 10_000,
    };
}

/// Pages fetched per poll at most: a backlog is drained over several polls.
const REPORT_PAGES_PER_POLL: usize = 200;
/// Reports per store transaction.
const REPORT_BATCH: usize = 20_000;
/// Between two retention passes over the stored reports.
const RETENTION_EVERY: Duration = Duration::from_secs(600);
/// How often the minutes of closed hours are rolled up into `shadow_hours`.
const ROLLUP_EVERY: Duration = Duration::from_secs(60);

/// The reports of one region's controller.
pub(super) struct Feed {
    /// The region (`default` for a `controller:` without one).
    pub(super) region: String,
    /// Its controller (an error when its settings cannot be used: the region is unread).
    client: Result<ControllerClient, String>,
    /// Its fetched reports not yet stored, and its cursor.
    reports: ReportBuffer,
    /// Several regions are read: rows of keys every region reports (`global`) are stored
    /// under `global@<region>` and counted by their own share ([`localize`]).
    several: bool,
    /// Why the last fetch from the controller failed (none: it answered).
    read_error: Option<String>,
    /// The `read_error` last written to the store (none: nothing written since the start):
    /// the store is written only when it changes.
    recorded: Option<Option<String>>,
}

/// One feed per controller of `controller:` / `controllers:`. The first region keeps the
/// cursor name a single controller always had, so adding regions continues where it was.
pub(super) fn feeds(cycle: &Cycle, limits: ReportLimits) -> Vec<Feed> {
    let regions = cycle.config().region_controllers();
    let several = regions.len() > 1;
    regions
        .iter()
        .enumerate()
        .map(|(i, (region, c))| {
            let client = ControllerClient::from_config(c, cycle.base_dir()).map_err(|e| {
                tracing::error!(region = %region, error = %e, "controller of this region disabled");
                e.to_string()
            });
            let mut reports = ReportBuffer::new(limits);
            if i > 0 {
                reports.cursor_name = format!("{REPORT_CURSOR}.{region}");
            }
            Feed {
                region: region.clone(),
                client,
                reports,
                several,
                read_error: None,
                recorded: None,
            }
        })
        .collect()
}

/// A region's rows as stored when several regions are read: a key every region reports
/// (`global`, or none from an older controller) becomes `global@<region>`, so that the regions'
/// rows of one tick are told apart and summed; and rates that peers of other regions
/// contributed are left out (`own_share`), so that each request is counted in one region.
/// A row's `counts` are its own region's already and stay as they are.
pub(super) fn localize(rows: &mut [ReportRow], region: &str) {
    for r in rows {
        if r.scope_key.is_empty() || r.scope_key == "global" {
            r.scope_key = format!("global@{region}");
        }
        if let Some(share) = r.own_share.take() {
            let share = if share.is_finite() {
                share.clamp(0.0, 1.0)
            } else {
                1.0
            };
            r.offered *= share;
            r.admitted *= share;
            r.dropped *= share;
            r.shadow_dropped *= share;
        }
    }
}

/// Controller reports fetched but not yet stored, page by page with the cursor after each.
pub(super) struct ReportBuffer {
    /// The name of the stored cursor (`controller.reports`, `controller.reports.<region>`).
    pub(super) cursor_name: String,
    /// The controller cursor after the last fetched page: `None` until read from the store.
    pub(super) cursor: Option<Option<String>>,
    pub(super) pages: std::collections::VecDeque<(Vec<ReportRow>, Option<String>)>,
    pub(super) rows: usize,
    pub(super) limits: ReportLimits,
}

impl Default for ReportBuffer {
    fn default() -> ReportBuffer {
        ReportBuffer::new(ReportLimits::DEFAULT)
    }
}

impl ReportBuffer {
    pub(super) fn new(limits: ReportLimits) -> ReportBuffer {
        ReportBuffer {
            cursor_name: REPORT_CURSOR.to_string(),
            cursor: None,
            pages: Default::default(),
            rows: 0,
            limits,
        }
    }

    /// Adds a fetched page and the controller cursor after it.
    pub(super) fn push(&mut self, reports: Vec<ReportRow>, next: Option<String>) {
        self.rows += reports.len();
        self.pages.push_back((reports, next));
    }

    /// Stores the buffered pages, a batch of up to [`REPORT_BATCH`] reports per transaction
    /// and each write within `limit` (`store.write_timeout`), moving the stored cursor past
    /// each stored batch; a failure or a write given up keeps the rest buffered. Returns how
    /// many reports were new, and the failure if any.
    pub(super) async fn flush(
        &mut self,
        store: &Store,
        limit: Duration,
    ) -> (u64, Result<(), crate::store::StoreError>) {
        let mut stored = 0;
        while !self.pages.is_empty() {
            let mut batch: Vec<ReportRow> = Vec::new();
            let mut pages = 0;
            let mut next = None;
            for (reports, cursor) in self.pages.iter() {
                if pages > 0 && batch.len() + reports.len() > REPORT_BATCH {
                    break;
                }
                batch.extend(reports.iter().cloned());
                next = cursor.clone();
                pages += 1;
            }
            match within(limit, store.insert_reports(&batch, Utc::now())).await {
                Ok(n) => stored += n,
                Err(e) => return (stored, Err(e)),
            }
            // Stored: out of the buffer, whether or not the cursor moves below (if it does not,
            // a restart fetches these again and the store ignores them as duplicates).
            self.pages.drain(..pages);
            self.rows -= batch.len();
            if let Some(next) = &next {
                if let Err(e) = within(limit, store.set_cursor(&self.cursor_name, next)).await {
                    return (stored, Err(e));
                }
            }
        }
        (stored, Ok(()))
    }
}

impl Loop {
    /// Fetches every region's reports and overrides, and records in the store whether each
    /// region's controller could be read.
    pub(super) async fn poll_regions(&mut self) {
        let mut feeds = std::mem::take(&mut self.feeds);
        for i in 0..feeds.len() {
            let f = &mut feeds[i];
            match f.client.clone() {
                Err(e) => f.read_error = Some(e),
                Ok(client) => {
                    if let Err(e) = self.poll_reports(f, &client).await {
                        tracing::warn!(region = %f.region, error = %e, "cannot poll controller reports");
                    }
                    // A controller that did not answer for its reports is not asked again.
                    if f.read_error.is_none() {
                        if let Err(e) = self.cycle.record_overrides(&f.region, &client).await {
                            f.read_error = Some(format!("overrides: {e}"));
                        }
                    }
                }
            }
            self.record_region_read(&mut feeds, i).await;
        }
        self.feeds = feeds;
    }

    /// Records `feeds[i]`'s last read in the store when it changed since the last write; the
    /// first write since the start also forgets the regions no longer in rlc.yaml. A store
    /// that cannot be written is logged: the next poll writes it again.
    async fn record_region_read(&self, feeds: &mut [Feed], i: usize) {
        if feeds[i].recorded.as_ref() == Some(&feeds[i].read_error) {
            return;
        }
        let Ok(store) = self.cycle.store().await else {
            return;
        };
        let regions: Option<Vec<String>> = feeds[i]
            .recorded
            .is_none()
            .then(|| feeds.iter().map(|f| f.region.clone()).collect());
        let f = &mut feeds[i];
        let limit = self.cycle.config().store.write_timeout.0;
        let write = store.record_region_read(
            &f.region,
            Utc::now(),
            f.read_error.as_deref(),
            regions.as_deref(),
        );
        match within(limit, write).await {
            Ok(()) => f.recorded = Some(f.read_error.clone()),
            Err(e) => {
                tracing::warn!(region = %f.region, error = %e, "cannot record whether the region's controller was read")
            }
        }
    }

    /// Fetches `f`'s controller's reports (every mode) and stores them with their minute
    /// roll-ups. Pages wait in a bounded buffer while the store is down or slow; the stored
    /// cursor only moves past stored reports, so a restart re-fetches what was not stored.
    ///
    /// The backlog is written first (a full buffer is emptied only here); after a failed or
    /// timed-out write, this poll writes nothing more and only fetches, up to the bound.
    async fn poll_reports(
        &mut self,
        f: &mut Feed,
        client: &ControllerClient,
    ) -> anyhow::Result<()> {
        let store = self.cycle.store().await;
        if f.reports.cursor.is_none() {
            // Where to start is in the store: without it, wait.
            let store = store.as_ref().map_err(|e| anyhow::anyhow!("{e}"))?;
            let limit = self.cycle.config().store.write_timeout.0;
            f.reports.cursor = Some(within(limit, store.cursor(&f.reports.cursor_name)).await?);
        }
        let state = self.state.clone();
        let m = &state.inner.metrics;
        let mut failed = None;
        if f.reports.rows > 0 {
            if let Ok(store) = &store {
                failed = self.flush_reports(&mut f.reports, store).await.err();
            }
        }
        for _ in 0..REPORT_PAGES_PER_POLL {
            if f.reports.rows >= f.reports.limits.buffer {
                m.report_polls_paused.inc();
                tracing::warn!(
                    region = %f.region,
                    buffered = f.reports.rows,
                    "report buffer full: not polling the controller until the store catches up"
                );
                break;
            }
            let cursor = f.reports.cursor.clone().flatten();
            let page_size = f.reports.limits.page;
            let mut page = match client.reports(cursor.as_deref(), page_size).await {
                Ok(p) => {
                    f.read_error = None;
                    p
                }
                Err(e) => {
                    f.read_error = Some(format!("{e:#}"));
                    return Err(e.into());
                }
            };
            if page.gap || page.reset {
                // Visible to operators: the dashboard misses some intervals.
                tracing::warn!(region = %f.region, gap = page.gap, reset = page.reset, cursor = ?cursor, "controller reports were lost between polls");
                m.report_gaps.inc();
            }
            if f.several {
                localize(&mut page.reports, &f.region);
            }
            let got = page.reports.len();
            let next = page.next.as_param();
            if got > 0 || (next.is_some() && next != cursor) {
                f.reports.push(page.reports, next.clone());
                f.reports.cursor = Some(next.clone().or(cursor.clone()));
            }
            m.reports_buffered.set(f.reports.rows as i64);
            if let (Ok(store), None) = (&store, &failed) {
                failed = self.flush_reports(&mut f.reports, store).await.err();
            }
            if got < page_size as usize || next.is_none() || next == cursor {
                break;
            }
        }
        match (store, failed) {
            (Ok(_), None) => Ok(()),
            (Err(e), _) => Err(anyhow::anyhow!("{e} ({} reports buffered)", f.reports.rows)),
            (Ok(_), Some(e)) => {
                Err(e.context(format!("storing reports ({} buffered)", f.reports.rows)))
            }
        }
    }

    /// Stores buffered pages, a batch per transaction, and moves the stored cursor past them.
    async fn flush_reports(&self, reports: &mut ReportBuffer, store: &Store) -> anyhow::Result<()> {
        let limit = self.cycle.config().store.write_timeout.0;
        let (stored, res) = reports.flush(store, limit).await;
        let m = &self.state.inner.metrics;
        m.reports_stored.inc_by(stored);
        m.reports_buffered.set(reports.rows as i64);
        Ok(res?)
    }

    /// Rolls the minutes of closed hours written since the last pass up into the hourly
    /// roll-ups ([`Store::roll_up_hours`]), at most every [`ROLLUP_EVERY`]. Until then the
    /// readers use those hours' minutes, so a late or failed pass only costs time.
    pub(super) async fn roll_up(&mut self) {
        let now = tokio::time::Instant::now();
        if self
            .last_rollup
            .is_some_and(|t| now.duration_since(t) < ROLLUP_EVERY)
        {
            return;
        }
        let Ok(store) = self.cycle.store().await else {
            return;
        };
        self.last_rollup = Some(now);
        let limit = self.cycle.config().store.write_timeout.0;
        match within(limit, store.roll_up_hours(Utc::now())).await {
            Ok(0) => {}
            Ok(n) => tracing::debug!(hours = n, "hourly report roll-ups written"),
            Err(e) => tracing::warn!(error = %e, "hourly report roll-up failed; retrying later"),
        }
    }

    /// Deletes reports past their retention (`store.shadow_raw_retention`,
    /// `store.shadow_rollup_retention`) and finished rollouts past theirs
    /// (`store.rollout_retention`), at most every [`RETENTION_EVERY`].
    pub(super) async fn retention(&mut self) {
        let now = tokio::time::Instant::now();
        if self
            .last_retention
            .is_some_and(|t| now.duration_since(t) < RETENTION_EVERY)
        {
            return;
        }
        let Ok(store) = self.cycle.store().await else {
            return;
        };
        self.last_retention = Some(now);
        let cfg = self.cycle.config().store.clone();
        let at = Utc::now();
        let ago = |d: schema::HumanDuration| {
            at - chrono::Duration::from_std(d.0).unwrap_or(chrono::Duration::days(36_500))
        };
        let pass = store.apply_retention(
            ago(cfg.shadow_raw_retention),
            ago(cfg.shadow_rollup_retention),
        );
        match within(cfg.write_timeout.0, pass).await {
            Ok(r) => tracing::debug!(
                raw = r.raw_deleted,
                minutes = r.minutes_deleted,
                "report retention applied"
            ),
            Err(e) => tracing::warn!(error = %e, "report retention failed; retrying later"),
        }
        let pass = crate::rollout::prune(&store, ago(cfg.rollout_retention));
        match within(cfg.write_timeout.0, pass).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(
                rollouts = n,
                "finished rollouts past store.rollout_retention deleted"
            ),
            Err(e) => tracing::warn!(error = %e, "rollout retention failed; retrying later"),
        }
    }
}
