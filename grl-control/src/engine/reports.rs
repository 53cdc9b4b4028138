//! The per-second report rows `GET /v1/reports` pages through: rates and the requests
//! counted per key, with a sequence that keeps increasing across restarts.

use super::*;

/// The counts of key `id` in a bucket's pending counts, taken out (zeros when none).
pub(super) fn take_counts(pending: &mut Vec<(u32, Split)>, id: u32) -> Split {
    match pending.iter().position(|(k, _)| *k == id) {
        Some(p) => pending.swap_remove(p).1,
        None => Split::default(),
    }
}

/// The report row of bucket `s`'s key `scope_key` at second `t`: the key's rates (zeros for a
/// key without any now) with their `own_share`, and the requests counted since its previous
/// row.
pub(super) fn report_row(
    s: &BucketState,
    scope_key: &str,
    k: Option<&KeyState>,
    own_share: Option<f64>,
    counts: &Split,
    t: u64,
) -> ReportRow {
    ReportRow {
        seq: 0,
        t: t.into(),
        service: s.service.clone(),
        bucket: s.bucket.name.clone(),
        caller: s.bucket.caller.clone(),
        procedure: s.bucket.procedure.clone(),
        mode: std::borrow::Cow::Borrowed(s.bucket.mode.as_str()),
        scope_key: scope_key.to_string(),
        offered: k.map_or(0.0, |k| k.offered_rps),
        admitted: k.map_or(0.0, |k| k.admitted_rps),
        dropped: k.map_or(0.0, |k| k.dropped_rps),
        shadow_dropped: k.map_or(0.0, |k| k.shadow_dropped_rps),
        limit_rps: s.limit_rps,
        drop_ratio: k.map_or(0.0, |k| k.ratio),
        own_share,
        counts: Some(ReportCounts::from_tiers(counts)),
    }
}

impl Engine {
    /// Starts this run's report sequence after `base`. The controller passes its start time as
    /// `unix_ms << 10`, so cursors keep increasing across restarts without persisting anything
    /// (room for 1024 rows per millisecond of uptime; stays below 2^53 for JSON readers).
    pub fn set_report_seq_base(&mut self, base: u64) {
        self.seq = self.seq.max(base);
    }

    /// Appends one report row per bucket and scope key with traffic for each second since the
    /// last call, up to `unix_now` (call once per tick): a row's rates stand for one second, so
    /// a reader summing them counts requests whatever the tick. Several ticks in one second
    /// write that second once; a tick longer than a second (or a late one) writes each second
    /// it covers, at most [`MAX_REPORT_SECONDS`], with the rates in force; a clock that went
    /// back starts again at `unix_now`. Keys whose zones reported nothing but zeros are
    /// skipped so that the bounded ring holds useful rows.
    pub fn record_reports(&mut self, unix_now: u64) {
        let from = match self.reported_second {
            Some(last) if last == unix_now => return,
            Some(last) if last < unix_now => {
                (last + 1).max(unix_now.saturating_sub(MAX_REPORT_SECONDS - 1))
            }
            _ => unix_now,
        };
        // The counts go on the newest second's rows: when the ring is over its cap, the oldest
        // rows go first, and those of earlier seconds carry no counts then.
        for second in from..=unix_now {
            self.record_second(second, second == unix_now);
        }
        self.reported_second = Some(unix_now);
    }

    /// The rows of one second (see [`Engine::record_reports`]).
    pub(super) fn record_second(&mut self, unix_now: u64, with_counts: bool) {
        // Rows beyond the ring's capacity would be evicted at once: their sequence numbers are
        // used up (the count of keys with traffic is kept as sums change), but only the
        // newest `report_cap` rows are built, walking back from the last bucket.
        let keep = self.busy_rows.min(self.report_cap);
        let mut rows: Vec<ReportRow> = Vec::with_capacity(keep);
        let peers = self.global_zone_sums(true);
        let pending = &mut self.pending;
        'walk: for (i, s) in self.buckets.iter().enumerate().rev() {
            for k in s.keys.iter().rev() {
                if rows.len() == keep {
                    break 'walk;
                }
                if !busy(k) {
                    continue;
                }
                let counts = if with_counts {
                    take_counts(&mut pending[i], k.id)
                } else {
                    Split::default()
                };
                let share = own_share(i, k, &peers);
                rows.push(report_row(
                    s,
                    &k.scope_key,
                    Some(k),
                    share,
                    &counts,
                    unix_now,
                ));
            }
        }
        // Counts of keys without a row yet (their rates fell to zero, or the key is gone, or
        // the ring's cap left them out): a row each, so that every counted request is in a row.
        let mut late = Vec::new();
        if with_counts {
            let mut pending_in = std::mem::take(&mut self.pending_in);
            for &i in &pending_in {
                let s = &self.buckets[i];
                // Drained in place: the bucket's list keeps its capacity for the next second.
                let mut pending = std::mem::take(&mut self.pending[i]);
                for (id, c) in pending.drain(..) {
                    let k = s.keys.iter().find(|k| k.id == id);
                    let share = k.and_then(|k| own_share(i, k, &peers));
                    late.push(report_row(s, self.keys.name(id), k, share, &c, unix_now));
                }
                self.pending[i] = pending;
            }
            pending_in.clear();
            self.pending_in = pending_in;
        }
        self.seq += (self.busy_rows - keep) as u64;
        for mut row in rows.into_iter().rev().chain(late) {
            self.seq += 1;
            row.seq = self.seq;
            self.reports.push_back(row);
        }
        while self.reports.len() > self.report_cap {
            self.reports.pop_front();
        }
    }

    /// Up to `limit` report rows with `seq > after`, and the cursor to pass next.
    ///
    /// A cursor beyond the newest row (from a controller whose clock went back, or a cursor
    /// from another controller) cannot be answered as asked: the page then starts at the
    /// oldest row kept and says `reset`. A cursor older than the oldest row kept (rows evicted
    /// from the ring, or a restart in between) says `gap`: rows were lost.
    pub fn reports_after(&self, after: u64, limit: usize) -> ReportPage {
        let oldest = self.reports.front().map(|r| r.seq);
        let reset = after > self.seq;
        let from = if reset { 0 } else { after };
        let gap = !reset && after > 0 && oldest.is_some_and(|o| o > after + 1);
        // Rows are in seq order: skip to the first one after the cursor without a scan.
        let start = self.reports.partition_point(|r| r.seq <= from);
        let rows: Vec<ReportRow> = self.reports.range(start..).take(limit).cloned().collect();
        let next = rows
            .last()
            .map_or(if reset { self.seq } else { after }, |r| r.seq);
        ReportPage {
            next: next.into(),
            reports: rows,
            reset,
            gap,
        }
    }
}
